"""`plandsl shrink`: a cluster plan scaled down to one machine keeps its layout and checks.

Golden text per example (tests/golden/shrink/); then what the scaling keeps and changes: the axes
and their order, pinned pipeline axes, layer names a plan refers to, a written model's sizes,
imports of the user's files, other plans of the file; and the refusals. The shrunk examples train
against one process in tests/distributed/test_shrunk_examples.py.
"""
from __future__ import annotations

import math

import pytest
from click.testing import CliRunner

from plandsl import api, ir
from plandsl.cli import main
from plandsl.syntax.loader import include
from plandsl.rewrite.shrink import ShrinkError, shrink
from plandsl.ir.placement import assign_stages
from tests.conftest import STDLIB

ROOT = STDLIB.parent
EXAMPLES = sorted((STDLIB / "examples").glob("*.plan"))


def _dump(node):
    return None if node is None else node.model_dump(mode="json")  # spans left out


def _unnumbered(stages):
    """A stage list without the numbers of its layer ranges (`layers[0:12]` -> `layers[:]`)."""
    if stages is None:
        return None
    groups = [group.model_copy(update={"selectors": tuple(
        selector.model_copy(update={"text": "", "parts": tuple(
            part.model_copy(update={"lo": None, "hi": None, "name": None if part.kind == "range" or (part.name or "").isdigit()
                                    else part.name}) for part in selector.parts)})
        for selector in group.selectors)}) for group in stages.groups]
    return stages.model_copy(update={"groups": tuple(groups)})


def _layers_per_stage(plan) -> list[int]:
    assignment, problems = assign_stages(plan)
    assert not problems
    return [sum(layer.kind == "block" for layer in stage) for stage in assignment.stage_layers]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_every_example_shrinks_to_a_checked_plan_on_one_machine(path, golden, monkeypatch):
    monkeypatch.chdir(ROOT)  # the header names the file as given: relative, so the golden text is portable
    shrunk = shrink(f"stdlib_plans/examples/{path.name}")
    golden(f"shrink/{path.stem}.plan", shrunk.text)
    small, big = shrunk.plan, shrunk.original
    assert 2 <= small.mesh.size <= 8 and small.cluster.name.startswith("localhost")
    assert [a.name for a in small.mesh.axes] == [a.name for a in big.mesh.axes]
    assert all(s.size <= max(b.size, 1) for s, b in zip(small.mesh.axes, big.mesh.axes))
    # the layout is the plan's own: the same parallelisms over the same axes, schedule and rules; a stage
    # list the same but for its layer numbers, scaled with the layer count (test_a_pipeline_the_plan_numbers_...)
    for key in ("data", "tensor", "context", "experts", "schedule"):
        assert _dump(getattr(small, key)) == _dump(getattr(big, key)), key
    assert _dump(_unnumbered(small.stages)) == _dump(_unnumbered(big.stages))
    if big.stages is None or big.stages.mode != "explicit":
        assert _dump(small.stages) == _dump(big.stages)
    assert [_dump(rule) for rule in small.shard] == [_dump(rule) for rule in big.shard]
    sizes = {"global_batch": 1, "micro_batch": 1, "seq": None, "warmup_steps": 0}
    assert _dump(small.train.model_copy(update=sizes)) == _dump(big.train.model_copy(update=sizes))
    assert small.model.kind == big.model.kind and small.model.hidden < big.model.hidden
    assert api.format_text(shrunk.text) == shrunk.text  # written in canonical layout
    assert not api.checks(shrunk.text).errors


def test_each_axis_becomes_two_and_data_axes_go_first_when_there_are_too_many():
    gpt3 = STDLIB / "examples" / "gpt3_175b_3d.plan"
    assert [a.size for a in shrink(gpt3).plan.mesh.axes] == [2, 2, 2]
    assert [a.size for a in shrink(gpt3, ranks=4).plan.mesh.axes] == [1, 2, 2]   # dp first
    assert [a.size for a in shrink(gpt3, ranks=2).plan.mesh.axes] == [1, 2, 1]   # then tp, pp last
    assert [a.size for a in shrink(gpt3, ranks=1).plan.mesh.axes] == [1, 1, 1]
    context = shrink(STDLIB / "examples" / "long_context.plan", ranks=4).plan.mesh.axes
    assert [(a.name, a.size) for a in context] == [("dp", 1), ("cp", 2), ("tp", 2)]  # then context


def test_a_pipeline_the_plan_numbers_keeps_its_size_and_scales_its_layers():
    uneven = shrink(STDLIB / "examples" / "uneven_pipeline.plan")  # stages { 0: ..., 1..7: ..., 7: ... }
    assert uneven.plan.pp == 8 and [a.size for a in uneven.plan.mesh.axes] == [1, 8, 1]
    # 80 layers cut at 9 and 72, about 2 per stage: 80 // 16 = 5 old layers per new one, each run rounded
    # (9 -> 2, 63 -> 13, 8 -> 2); the six stages of `1..7` share their 13 as they shared 63, the first ones
    # getting the extra
    assert uneven.original.model.layers == 80 and uneven.plan.model.layers == 17
    assert _layers_per_stage(uneven.original) == [9, 11, 11, 11, 10, 10, 10, 8]
    assert _layers_per_stage(uneven.plan) == [2, 3, 2, 2, 2, 2, 2, 2]
    assert [s.text for g in uneven.plan.stages.groups for s in g.selectors if "layers" in s.text] == \
        ["layers[0:2]", "layers[2:15]", "layers[15:17]"]
    mixed = shrink(STDLIB / "examples" / "heterogeneous.plan")  # 0: embed, layers[0:12]  1: layers[12:40], ...
    assert mixed.plan.pp == 2 and _layers_per_stage(mixed.original) == [12, 28]
    assert mixed.plan.model.layers == 4 and _layers_per_stage(mixed.plan) == [1, 3]  # 40 // 4 = 10 per new one
    table = shrink(STDLIB / "examples" / "schedule_table.plan")  # a table for 4 ranks and 8 microbatches
    assert table.plan.pp == 4 and table.plan.num_microbatches == 8
    with pytest.raises(ShrinkError) as refused:
        shrink(STDLIB / "examples" / "uneven_pipeline.plan", ranks=4)
    (d,) = refused.value.diagnostics
    assert d.code == "E802" and d.message.endswith("keeps pp = 8 (`stages { }` numbers the stages), more than --ranks 4")
    assert d.hint == "give --ranks 8 or more, or split the stages `evenly over pp`" and d.span.line == 16


def test_layers_go_down_unless_the_plan_names_them():
    gpt3 = shrink(STDLIB / "examples" / "gpt3_175b_3d.plan").plan  # evenly over pp = 2 with virtual = 2
    assert gpt3.model.layers == 8 and gpt3.num_microbatches == 4
    rules = shrink(STDLIB / "examples" / "shard_rules.plan").plan  # `layers[0:4].mlp.*`, `layers.0.mlp.w2`
    assert rules.model.layers == 4


def test_the_tiny_model_divides_every_split():
    for path in EXAMPLES:
        plan = shrink(path).plan
        model = plan.model
        assert model.heads % plan.tp == 0 and model.kv_heads % plan.tp == 0 and model.vocab % plan.tp == 0
        assert (model.kv_heads < model.heads) == (shrink(path).original.model.kv_heads
                                                  < shrink(path).original.model.heads)  # GQA stays GQA
        assert plan.seq % (plan.cp * plan.tp) == 0
        if model.experts:
            assert model.experts % plan.ep == 0 and model.top_k <= model.experts
        assert plan.train.global_batch == plan.num_microbatches * plan.dp * plan.train.micro_batch


def test_precision_can_be_overridden():
    plan = shrink(STDLIB / "examples" / "fsdp.plan", precision="fp32").plan
    assert plan.train.precision.value == "fp32"
    assert plan.train.lr_schedule == "cosine" and plan.train.recompute.value == "selective"  # the rest is kept
    assert plan.train.warmup_steps == 1  # of 2000: two steps move the parameters


def test_the_kept_dtypes_and_recompute_layers_stay_unless_narrower_than_a_given_precision(tmp_path):
    text = (STDLIB / "examples" / "fsdp.plan").read_text().replace(
        "recompute: selective,", "recompute: full, recompute_layers: 3, param_dtype: bf16, optimizer_dtype: bf16, "
        "grad_dtype: bf16,")
    (tmp_path / "dtypes.plan").write_text(text)
    train = shrink(tmp_path / "dtypes.plan").plan.train
    assert (train.param_dtype, train.optimizer_dtype, train.grad_dtype, train.master_dtype) == (
        ir.Precision.bf16, ir.Precision.bf16, ir.Precision.bf16, ir.Precision.fp32)
    assert train.master_copy and train.recompute_layers == 3
    train = shrink(tmp_path / "dtypes.plan", precision="fp32").plan.train  # bf16 weights would compute in bf16
    assert train.param_dtype is None and train.optimizer_dtype is ir.Precision.bf16


def test_offloading_stays_on_the_first_block_of_each_stage(tmp_path):
    text = (STDLIB / "examples" / "fsdp.plan").read_text().replace("recompute: selective,", "offload_layers: 20,")
    (tmp_path / "offload.plan").write_text(text)
    assert shrink(tmp_path / "offload.plan").plan.train.offload_layers == 1


def test_a_users_files_keep_resolving_from_where_the_plan_is_written(tmp_path):
    project, out = tmp_path / "project", tmp_path / "elsewhere"
    project.mkdir()
    out.mkdir()
    (project / "mymodels.plan").write_text("model wide = gpt(layers=12, hidden=768, heads=12, seq=1024, vocab=50304)\n")
    (project / "job.plan").write_text('import "clusters/dgx_a100"\nimport "mymodels"\n\n'
                                      "plan job {\n  model   = wide\n  cluster = dgx_a100\n"
                                      "  mesh    = [dp = 2, tp = 4]\n  train   = { global_batch: 64 }\n"
                                      "  data    = zero2 over dp\n  tensor  = megatron over tp\n}\n"
                                      "plan other {\n  model   = wide\n  cluster = dgx_a100\n  mesh    = [dp = 8]\n"
                                      "  train   = { global_batch: 64 }\n  data    = ddp over dp\n}\n")
    result = CliRunner().invoke(main, ["shrink", str(project / "job.plan"), "--plan", "job",
                                       "-o", str(out / "small.plan")])
    assert result.exit_code == 0, result.output
    text = (out / "small.plan").read_text()
    assert 'import "../project/mymodels.plan"' in text and "plan other" not in text
    assert "wrote" in result.output and "mesh [dp = 2, tp = 4] -> [dp = 2, tp = 2] (8 -> 4 devices)" in result.output
    # project/ is outside the written file's folder: it reads it only when named with --include
    assert f"run it: plandsl run {out / 'small.plan'} --include {project.resolve()} --check-equivalence" in result.output
    assert [d.code for d in api.check(out / "small.plan").errors] == ["E214"]
    with include([project]):
        (plan,) = api.load(out / "small.plan").plans
    assert plan.name == "job" and plan.mesh.size == 4 and plan.model.layers == 4


def test_a_written_model_keeps_its_sizes(tmp_path):
    (tmp_path / "mine.plan").write_text('import "clusters/dgx_a100"\n\n'
                                        'model mine {\n  factory = "mypkg.models:build"\n  seq = 16\n'
                                        "  layer a {\n    params = 100\n    output = 8\n  }\n"
                                        "  layer b {\n    params = 100\n    output = 8\n  }\n}\n\n"
                                        "plan p {\n  model   = mine\n  cluster = dgx_a100\n  mesh    = [dp = 8]\n"
                                        "  train   = { global_batch: 64, micro_batch: 4 }\n  data    = ddp over dp\n}\n")
    shrunk = shrink(tmp_path / "mine.plan")
    assert _dump(shrunk.plan.model) == _dump(shrunk.original.model) and shrunk.plan.mesh.size == 2
    assert "model mine: a written model keeps its own sizes" in shrunk.text


def test_the_cli_prints_the_plan_and_refuses_what_it_cannot_scale(tmp_path):
    result = CliRunner().invoke(main, ["shrink", str(STDLIB / "examples" / "hsdp.plan")])
    assert result.exit_code == 0 and result.output.startswith("# Plan llama3_8b_hsdp of ")
    assert "mesh    = [replica = 2, shard = 2] over devices[0:4]" in result.output
    result = CliRunner().invoke(main, ["shrink", str(STDLIB / "examples" / "uneven_pipeline.plan"), "--ranks", "2"])
    assert result.exit_code == 1 and "give --ranks 8 or more" in result.output
    bad = tmp_path / "bad.plan"
    bad.write_text("plan p { model = nothing }\n")
    result = CliRunner().invoke(main, ["shrink", str(bad)])
    assert result.exit_code == 1 and "error[E207]" in result.output  # the plan is checked first


def test_what_the_header_says_changed_is_what_changed():
    shrunk = shrink(STDLIB / "examples" / "moe_expert_parallel.plan")
    big, small = shrunk.original, shrunk.plan
    assert shrunk.changes[0] == "mesh [dp = 2, pp = 4, ep = 8] -> [dp = 2, pp = 2, ep = 2] (64 -> 8 devices)"
    assert f"batch {big.train.global_batch:,} sequences" in shrunk.changes[2]
    assert f"-> {small.train.global_batch} ({small.num_microbatches} of {small.train.micro_batch})" in shrunk.changes[2]
    assert all(f"#   {line}" in shrunk.text for line in shrunk.changes)
    assert math.prod(a.size for a in small.mesh.axes) == shrunk.ranks == 8


def test_param_values_given_are_written_into_the_file():
    shrunk = shrink(STDLIB / "examples" / "fsdp.plan", params={"nodes": 4})
    assert shrunk.changes[0] == "mesh [dp = 32] -> [dp = 2] (32 -> 2 devices)"
    assert "param nodes = 4\n" in shrunk.text  # so `run` of the written file needs no --param


def test_context_and_sequence_parallelism_keep_tokens_on_every_rank(tmp_path):
    shrunk = shrink(STDLIB / "examples" / "long_context.plan", ranks=8)
    assert shrunk.plan.cp * shrunk.plan.tp == 4 and shrunk.plan.seq == 32
    # no data parallelism left to shrink first: whatever context x tensor (sequence) parallelism the
    # 8 ranks get, each still holds at least 4 tokens of the sequence
    text = (STDLIB / "examples" / "long_context.plan").read_text().replace("[dp = 2, cp = 4, tp = 8]",
                                                                            "[dp = 1, cp = 4, tp = 8]")
    path = tmp_path / "all_context.plan"
    path.write_text(text)
    plan = shrink(path, ranks=8, out_dir=tmp_path).plan
    split = plan.cp * plan.tp
    assert split > 1 and plan.seq % split == 0 and plan.seq // split >= 4, (plan.cp, plan.tp, plan.seq)


def _write(path, text):
    path.write_text(text)
    return path


PLAN = '''import "clusters/dgx_a100"

model wide = gpt(layers=12, hidden=768, heads=12, seq=1024, vocab=50304)

{schedule}
# the plan's own comment
plan job {{
  model    = wide
  cluster  = dgx_a100 x 2
  mesh     = {mesh}
  train    = {{ global_batch: 64 }}
{body}
}}
'''


def test_an_axis_only_shard_rules_use_goes_after_the_data_axes(tmp_path):
    path = _write(tmp_path / "rules.plan", PLAN.format(schedule="", mesh="[dp = 2, mp = 4]", body=(
        "  data     = ddp over dp\n  shard layers.*.attn.wq = colwise over mp")))
    assert [a.size for a in shrink(path, ranks=2).plan.mesh.axes] == [1, 2]


def test_a_template_without_a_ranks_variable_pins_the_pipeline_and_its_microbatches(tmp_path):
    template = ("schedule four(m: microbatches) {\n  for r in 0..4 on rank r {\n    for i in 0..m { F(r, i) }\n"
                "    for i in 0..m { B(r, i) }\n  }\n}\n"
                "schedule sixteen(p: ranks) {\n  for r in 0..p on rank r {\n    for i in 0..16 { F(r, i) }\n"
                "    for i in 0..16 { B(r, i) }\n  }\n}\n")
    body = "  data     = ddp over dp\n  stages   = evenly over pp\n  schedule = {}"
    path = _write(tmp_path / "four.plan", PLAN.format(schedule=template, mesh="[dp = 4, pp = 4]",
                                                       body=body.format("four")))
    plan = shrink(path).plan
    assert plan.pp == 4 and [a.size for a in plan.mesh.axes] == [2, 4] and plan.num_microbatches == 8
    path = _write(tmp_path / "sixteen.plan", PLAN.format(schedule=template, mesh="[dp = 4, pp = 4]",
                                                          body=body.format("sixteen")))
    plan = shrink(path).plan
    assert plan.pp == 2 and plan.num_microbatches == 16  # the template fixes 16 microbatches


def test_more_ranks_than_one_machine_is_refused():
    with pytest.raises(ShrinkError, match="--ranks must be 1 to 8"):
        shrink(STDLIB / "examples" / "gpt3_175b_3d.plan", ranks=16)
    result = CliRunner().invoke(main, ["shrink", str(STDLIB / "examples" / "gpt3_175b_3d.plan"), "--ranks", "16"])
    assert result.exit_code == 2 and "16 is not in the range 1<=x<=8" in result.output


def test_a_stdlib_plans_own_import_and_a_byte_order_mark_survive(tmp_path):
    result = CliRunner().invoke(main, ["shrink", str(STDLIB / "local" / "3d.plan"), "-o", str(tmp_path / "3d.plan")])
    assert result.exit_code == 0, result.output
    assert 'import "local/tiny"' in (tmp_path / "3d.plan").read_text()  # was `import "tiny"`, next to it
    bom = _write(tmp_path / "bom.plan", "\ufeff" + PLAN.format(schedule="", mesh="[dp = 8]", body="  data = ddp over dp"))
    assert shrink(bom).plan.mesh.size == 2


def test_other_plans_go_with_their_comment_and_the_model_goes_above_the_plans(tmp_path):
    other = "# the other plan's comment\nplan other {\n  model   = wide\n  cluster = dgx_a100\n" \
            "  mesh    = [dp = 8]\n  train   = { global_batch: 64 }\n  data    = ddp over dp\n}\n"
    path = _write(tmp_path / "two.plan", PLAN.format(schedule="", mesh="[dp = 8]", body="  data     = ddp over dp")
                  + "\n" + other)
    text = shrink(path, "job").text
    assert "plan other" not in text and "the other plan's comment" not in text
    assert text.index("model wide_small") < text.index("# the plan's own comment") < text.index("plan job")


def test_an_unwritable_output_is_an_error_not_a_traceback(tmp_path):
    result = CliRunner().invoke(main, ["shrink", str(STDLIB / "examples" / "hsdp.plan"),
                                       "-o", str(tmp_path / "missing" / "x.plan")])
    # refused before any work starts: a usage error naming the option
    assert result.exit_code == 2 and "cannot write" in result.output and "'-o'" in result.output


@pytest.mark.parametrize("pp, stages, selectors, per_stage", [
    # about 2 layers per stage, at least one per run: 12 // 4 = 3 old layers per new one
    (2, "0: embed, layers[0:2]\n    1: layers[2:12], norm, head", ["layers[0:1]", "layers[1:4]"], [1, 3]),
    # 12 // 6 = 2; a single layer stays one, an open range stays open
    (3, "0: embed, layers.0\n    1..2: layers[1:11]\n    2: layers[11:], norm, head",
     ["layers.0", "layers[1:6]", "layers[6:]"], [1, 5, 1]),
    # a range shared by 2 stages keeps a block for each, though its share would be 1 (2 of 12 // 6 = 2): as
    # written, its 2 blocks, norm and head split evenly, 2 blocks on stage 1, norm and head on stage 2
    (3, "0: embed, layers[0:10]\n    1..3: layers[10:12], norm, head", ["layers[0:5]", "layers[5:7]"], [5, 2, 0]),
])
def test_a_stage_list_is_scaled_with_the_layers(tmp_path, pp, stages, selectors, per_stage):
    body = f"  stages {{\n    {stages}\n  }}\n  schedule = 1f1b"
    path = _write(tmp_path / "staged.plan", PLAN.format(schedule="", mesh=f"[pp = {pp}]", body=body))
    shrunk = shrink(path)
    assert [s.text for g in shrunk.plan.stages.groups for s in g.selectors if "layers" in s.text] == selectors
    assert shrunk.plan.model.layers == sum(per_stage) and _layers_per_stage(shrunk.plan) == per_stage
    assert _layers_per_stage(shrunk.original) != per_stage and shrunk.original.model.layers == 12


def test_a_stage_list_keeps_its_numbers_when_shard_rules_name_layers_too(tmp_path):
    body = ("  tensor   = megatron over tp\n  shard layers.5.attn.wq = colwise over tp\n"
            "  stages {\n    0: embed, layers[0:4]\n    1: layers[4:12], norm, head\n  }\n  schedule = 1f1b")
    shrunk = shrink(_write(tmp_path / "named.plan", PLAN.format(schedule="", mesh="[pp = 2, tp = 2]", body=body)))
    assert shrunk.plan.model.layers == 12 and "1: layers[4:12], norm, head" in shrunk.text
    assert _layers_per_stage(shrunk.plan) == [4, 8]
    # a selector that is not a number (`layers.*`: every block) leaves the list and the layer count as written
    body = "  stages {\n    0: embed\n    1: layers.*, norm, head\n  }\n  schedule = 1f1b"
    shrunk = shrink(_write(tmp_path / "every.plan", PLAN.format(schedule="", mesh="[pp = 2]", body=body)))
    assert shrunk.plan.model.layers == 12 and _layers_per_stage(shrunk.plan) == [0, 12]


def test_layers_a_shard_rule_names_are_kept(tmp_path):
    path = _write(tmp_path / "named.plan", PLAN.format(schedule="", mesh="[dp = 2, tp = 2]", body=(
        "  data     = ddp over dp\n  tensor   = megatron over tp\n  shard layers.5.attn.wq = colwise over tp")))
    plan = shrink(path).plan
    assert plan.model.layers == 6 and plan.shard[0].target.text == "layers.5.attn.wq"


@pytest.mark.parametrize("ranks", range(1, 9))
def test_any_rank_budget_gives_a_checked_plan_within_it_or_says_why(ranks):
    for path in EXAMPLES:
        try:
            shrunk = shrink(path, ranks=ranks)
        except ShrinkError as error:
            assert "more than --ranks" in str(error) and f"--ranks {ranks}" in str(error), (path.name, error)
            continue
        assert shrunk.ranks <= ranks and [a.name for a in shrunk.plan.mesh.axes] == \
            [a.name for a in shrunk.original.mesh.axes], path.name


def test_shrink_reports_diagnostics_and_json(tmp_path):
    """--format json: the refusal as one JSON object per line (as check prints), the result as one object."""
    import json
    result = CliRunner().invoke(main, ["shrink", str(STDLIB / "examples" / "uneven_pipeline.plan"), "--ranks", "4",
                                       "--format", "json"])
    assert result.exit_code == 1
    (refusal,) = [json.loads(line) for line in result.stdout.splitlines()]
    assert refusal["code"] == "E802" and refusal["location"]["line"] == 16
    text = CliRunner().invoke(main, ["shrink", str(STDLIB / "examples" / "uneven_pipeline.plan"), "--ranks", "4"])
    assert text.exit_code == 1 and "error[E802]" in text.output and "  stages {" in text.output  # caret, source line
    done = CliRunner().invoke(main, ["shrink", str(STDLIB / "examples" / "data_parallel.plan"), "--format", "json"])
    assert done.exit_code == 0, done.output
    payload = json.loads(done.stdout)
    assert payload["ranks"] >= 2 and payload["changes"] and api.checks(payload["plan"]).ok


@pytest.mark.parametrize("precision, gathered", [("fp32", "fp32"), ("bf16", "bf16")])
def test_a_precision_override_rewrites_the_gather_dtype_it_would_break(tmp_path, precision, gathered):
    """hsdp.plan gathers bf16 over fp32 weights (torchtitan's FSDP2); shrunk to fp32 for `--check-equivalence`, its
    `gather = bf16` would compute in bf16 (E515), so it becomes the new precision's, and the header says so; at
    bf16 it still holds and stays as written."""
    shrunk = shrink(STDLIB / "examples" / "hsdp.plan", precision=precision, out_dir=tmp_path, ranks=4)
    assert f"with gather = {gathered}" in shrunk.text and shrunk.plan.data.gather is ir.Precision(gathered)
    assert ("#   gather bf16 -> fp32" in shrunk.text) is (precision == "fp32")
