"""`plandsl generate --from PLAN`: a partial plan's choices are pins, the search fills in the rest and
writes the file back completed (imports, comments, lets and training settings kept)."""
import json
import re
import signal
from pathlib import Path

import pytest
from click.testing import CliRunner

from plandsl import api
from plandsl.cli import main
from plandsl.cost.estimate import estimate_plan
from plandsl.diagnostics import PlanError
from plandsl.rewrite.complete import complete
from plandsl.search import SearchError, check_pins, search
from plandsl.search.partial import pins_with, read_partial
from support import bounded

HEADER = '''# a partial plan: the layout is left to the search
import "clusters/dgx_a100"

model small = gpt(layers=8, hidden=1024, heads=16, seq=1024, vocab=51200)
let recipe = { global_batch: 32, micro_batch: 2, precision: bf16, recompute: selective, lr: 1e-4, seed: 7 }
'''


def write(tmp_path, body: str, header: str = HEADER):
    path = tmp_path / "partial.plan"
    path.write_text(header + "\nplan mine {\n  model   = small\n  cluster = dgx_a100 x 2\n" + body + "}\n")
    return path


def generate(*args):
    return CliRunner().invoke(main, ["generate", *map(str, args)])


def test_what_the_plan_writes_is_pinned_and_the_rest_searched(tmp_path):
    path = write(tmp_path, "  train   = recipe\n  schedule = 1f1b\n  data    = zero1 over dp\n")
    partial = read_partial(path)
    assert partial.pins == {"micro_batch_size": 2, "recompute": "selective", "schedule": "1f1b", "zero_stage": 1}
    assert partial.problem.global_batch == 32 and partial.problem.model.name == "small"
    out = generate("--from", path, "--top", "5", "--json")
    assert out.exit_code == 0, out.output
    candidates = json.loads(out.output)["candidates"]
    assert len({tuple(c["degrees"].items()) for c in candidates}) > 1  # the layout was searched
    for c in candidates:
        assert (c["micro_batch_size"], c["recompute"], c["zero_stage"]) == (2, "selective", 1)
        assert c["degrees"]["pp"] == 1 or c["schedule"] == "1f1b"


def test_the_file_comes_back_completed_and_checks_clean(tmp_path):
    path = write(tmp_path, "  train   = recipe\n")
    out_path = tmp_path / "done.plan"
    out = generate("--from", path, "-o", out_path)
    assert out.exit_code == 0, out.output
    text = out_path.read_text()
    assert text.startswith(api.format_text(HEADER))  # imports, comments, the model and the let, untouched
    assert "plan mine {" in text and "  train   = recipe\n" in text  # its own train: it fixed what was searched
    analysis = api.check(out_path)
    assert analysis.diagnostics == [], [d.message for d in analysis.diagnostics]
    (plan,) = analysis.document.plans
    assert (plan.train.lr, plan.train.seed, plan.train.micro_batch) == (1e-4, 7, 2)


def test_settings_the_search_does_not_choose_are_carried_over(tmp_path):
    path = write(tmp_path, "  train   = { global_batch: 32, precision: bf16, optimizer: sgd, lr: 0.05, grad_clip: none }\n")
    out_path = tmp_path / "done.plan"
    assert generate("--from", path, "-o", out_path).exit_code == 0
    (plan,) = api.load(out_path).plans
    assert (plan.train.optimizer.value, plan.train.lr, plan.train.grad_clip) == ("sgd", 0.05, None)


def test_a_written_mesh_fixes_every_degree_and_the_order(tmp_path):
    path = write(tmp_path, "  mesh    = [pp = 2, dp = 4, tp = 2]\n  train   = { global_batch: 32, precision: bf16 }\n"
                           "  data    = zero2 over dp\n  tensor  = megatron over tp with sequence_parallel\n  stages  = evenly over pp\n"
                           "  schedule = 1f1b\n")
    partial = read_partial(path)
    assert partial.pins == {"dp": 4, "tp": 2, "pp": 2, "cp": 1, "ep": 1, "order": ("pp", "dp", "tp"), "zero_stage": 2,
                            "virtual_stages": 1, "schedule": "1f1b", "sequence_parallel": True}
    out = generate("--from", path, "--json")
    assert out.exit_code == 0, out.output
    for c in json.loads(out.output)["candidates"]:
        assert c["degrees"] == {"dp": 4, "tp": 2, "pp": 2, "cp": 1, "ep": 1} and c["zero_stage"] == 2
        (plan,) = api.loads(c["plan"], path=str(tmp_path / "c.plan")).plans
        assert [a.name for a in plan.mesh.axes] == ["pp", "dp", "tp"]
        assert estimate_plan(plan).time.step == pytest.approx(c["step_time_s"], rel=1e-9)


def test_command_line_pins_win_over_the_plan(tmp_path):
    path = write(tmp_path, "  train   = recipe\n")
    out = generate("--from", path, "--pin", "micro_batch_size=1", "--pin", "tp=2", "--json")
    assert out.exit_code == 0, out.output
    assert f"note: --pin micro_batch_size=1 wins over `micro_batch: 2` ({path}:5:34): the completed plan writes " \
           "micro_batch: 1" in out.stderr  # the let's value replaced, and said so
    for c in json.loads(out.stdout)["candidates"]:
        assert c["micro_batch_size"] == 1 and c["degrees"]["tp"] == 2
        (plan,) = api.loads(c["plan"], path=str(tmp_path / "c.plan")).plans
        assert plan.train.micro_batch == 1 and plan.train.lr == 1e-4  # the pin, not the let; the rest kept


def test_tensor_without_a_mesh_is_kept_over_an_axis_of_the_searched_mesh(tmp_path):
    path = write(tmp_path, "  train   = recipe\n  tensor  = megatron over tp\n")
    out = generate("--from", path, "--top", "3", "--json")
    assert out.exit_code == 0, out.output
    for c in json.loads(out.output)["candidates"]:
        (plan,) = api.loads(c["plan"], path=str(path)).plans
        assert plan.tensor is not None and plan.tensor.axis == "tp" and not plan.tensor.sequence_parallel
        assert "  tensor  = megatron over tp\n" in c["plan"]  # the line as written (a tp of 1 when chosen)


@pytest.mark.parametrize("body, code, line_text", [
    ("  schedule = 1f1b\n", "E207", "plan mine {"),
    ("  train   = recipe\n  schedule = mine\n", "E601", "schedule = mine"),
    ("  train   = { global_batch: 32, micro_batch: nope }\n", "E201", "nope"),
    ("  train   = { global_batch: 32, micro_bach: 2 }\n", "E206", "micro_bach"),
    ("  train   = recipe\n  data    = zero4\n", "E210", "zero4"),
    ("  train   = recipe\n  stages  = evenly over pp with virtual = 2, map = [0, 0, 1]\n", "E409", "map"),
])
def test_bad_partial_plans_are_diagnostics_at_their_own_lines(tmp_path, body, code, line_text):
    path = write(tmp_path, body)
    out = generate("--from", path)
    assert out.exit_code == 1 and "Traceback" not in out.output
    line = next(n for n, text in enumerate(path.read_text().splitlines(), 1) if line_text in text)
    assert f"partial.plan:{line}:" in out.output and f"error[{code}]" in out.output, out.output
    assert line_text in out.output  # the file's own line under the caret
    objects = [json.loads(text) for text in generate("--from", path, "--format", "json").stdout.splitlines()]
    assert {o["code"] for o in objects} == {code} and objects[0]["location"]["line"] == line


def test_a_misspelled_train_key_is_the_code_check_gives(tmp_path):
    path = write(tmp_path, "  mesh    = [dp = 16]\n  train   = { global_batch: 32, micro_bach: 2 }\n")
    checked = [(d.code, d.span.line) for d in api.check(path).errors]
    with pytest.raises(PlanError) as refused:
        read_partial(path)
    assert [(d.code, d.span.line) for d in refused.value.diagnostics] == checked and checked[0][0] == "E206"


@pytest.mark.parametrize("body, line_text", [
    ("  train   = recipe\n  shard layers.*.mlp.w1 = colwise over tp\n", "shard"),
    ("  train   = recipe\n  data    = hsdp over [r, s]\n", "data"),
    ("  train   = recipe\n  data    = zero1 over dp\n  experts = alltoall over dp\n", "data"),
    ("  mesh    = [dp = 4, pp = 3] over devices[0:12]\n  train   = recipe\n  data    = zero1 over dp\n", "mesh"),
])
def test_what_the_search_cannot_keep_is_E801_at_its_line(tmp_path, body, line_text):
    path = write(tmp_path, body)
    out = generate("--from", path)
    line = next(n for n, text in enumerate(path.read_text().splitlines(), 1) if text.startswith(f"  {line_text}"))
    assert out.exit_code == 1 and f"partial.plan:{line}:" in out.output and "error[E801]" in out.output, out.output


def test_what_check_reports_comes_before_the_search(tmp_path):
    path = write(tmp_path, "  mesh    = [dp = 16]\n  train   = { global_batch: 32, micro_batch: 4 }\n")
    out = generate("--from", path)  # micro_batch and mesh written: E501 as check says, not a search failure
    assert out.exit_code == 1 and "error[E501]" in out.output, out.output


def test_nothing_that_keeps_the_decisions_is_E803_at_the_plan(tmp_path):
    path = tmp_path / "big.plan"
    path.write_text('import "clusters/dgx_a100"\nplan big {\n  model = gpt(layers=64, hidden=8192, heads=64, '
                    'seq=2048, vocab=51200)\n  cluster = dgx_a100 x 1\n  mesh = [dp = 8]\n'
                    '  train = { global_batch: 64 }\n}\n')
    out = generate("--from", path)
    assert out.exit_code == 1 and "big.plan:2:6: error[E803]" in out.output, out.output
    assert "does not fit" in out.output and "dp=8" in out.output


def test_from_excludes_the_problem_options_and_plan_needs_from(tmp_path):
    path = write(tmp_path, "  train   = recipe\n")
    assert generate("--from", path, "--model", "gpt2_small").exit_code == 2
    assert generate("--model", "gpt2_small").exit_code == 2  # no cluster, no batch, no --from
    assert generate("--model", "gpt2_small", "--cluster", "dgx_a100", "--global-batch", "8",
                    "--plan", "x").exit_code == 2


def test_several_plans_need_plan(tmp_path):
    path = write(tmp_path, "  train   = recipe\n")
    path.write_text(path.read_text() + "\nplan other {\n  model = small\n  cluster = dgx_a100\n  train = recipe\n}\n")
    with pytest.raises(PlanError, match="name one with --plan"):
        read_partial(path)
    assert read_partial(path, "other").name == "other"


def test_the_example_in_docs_cli_completes(tmp_path):
    from pathlib import Path
    doc = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text(encoding="utf-8")
    section = doc[doc.index("### `plandsl generate --from"):]
    example = section[section.index("```plan\n") + 8:section.index("\n```", section.index("```plan\n"))]
    path = tmp_path / "gpt3_run.plan"
    path.write_text(example + "\n")
    assert generate("--from", path, "-o", path).exit_code == 0
    analysis = api.check(path)
    assert analysis.ok, [d.message for d in analysis.diagnostics]
    (plan,) = analysis.document.plans
    assert plan.name == "gpt3_run" and plan.train.lr == 6e-5 and plan.mesh.size == 1024


STDLIB_EXAMPLES = Path(__file__).resolve().parents[2] / "stdlib_plans" / "examples"


def test_an_expert_parallel_mesh_pins_dp_and_ep_apart():
    partial = read_partial(STDLIB_EXAMPLES / "moe_expert_parallel.plan")
    plan = api.load_plan(STDLIB_EXAMPLES / "moe_expert_parallel.plan")
    assert partial.pins["ep"] == plan.ep and partial.pins["dp"] * plan.ep == plan.dp  # plan.dp counts ep too
    out = generate("--from", STDLIB_EXAMPLES / "moe_expert_parallel.plan", "--top", "1", "--json")
    assert out.exit_code == 0, out.output


def test_errors_point_at_the_plans_own_lines(tmp_path):
    path = write(tmp_path, "  tensor  = megatron over tp\n  train   = { global_batch: 32,\n"
                           "              precision: fp4 }\n")
    out = generate("--from", path)
    line = next(n for n, text in enumerate(path.read_text().splitlines(), 1) if "fp4" in text)
    assert out.exit_code == 1 and f"partial.plan:{line}:" in out.output and "error[E210]" in out.output
    assert "precision: fp4" in out.output  # the file's own line under the caret


def test_completing_again_replaces_the_figures(tmp_path):
    path = write(tmp_path, "  train   = recipe\n")
    assert generate("--from", path, "-o", path).exit_code == 0
    assert generate("--from", path, "-o", path).exit_code == 0  # the completed plan, as a partial one
    assert path.read_text().count("# Generated by `plandsl generate`") == 1
    assert api.check(path).diagnostics == []


def test_a_train_let_of_another_file_is_kept_with_a_note(tmp_path):
    (tmp_path / "recipes.plan").write_text("let shared = { global_batch: 32, micro_batch: 2, precision: bf16 }\n")
    path = write(tmp_path, '  train   = shared\n', header=HEADER + 'import "recipes"\n')
    partial = read_partial(path)
    assert partial.pins["micro_batch_size"] == 2 and partial.pins["recompute"] == "none"  # what it says, kept
    assert any("is not a dict of this file" in note for note in partial.notes)


def test_a_tensor_order_across_nodes_says_how_to_allow_it():
    out = generate("--model", "gpt(layers=8, hidden=1024, heads=16, seq=1024, vocab=51200)", "--cluster",
                   "dgx_a100 x 4", "--global-batch", "32", "--pin", "tp=4", "--pin", "dp=8", "--pin", "order=tp,dp")
    assert out.exit_code == 1 and "--pin tp_across_nodes=true" in out.output and "order=tp,dp" in out.output


def test_params_of_the_file_are_set_with_param(tmp_path):
    header = HEADER + "param nodes = 2\n"
    path = tmp_path / "partial.plan"
    path.write_text(header + "\nplan mine {\n  model   = small\n  cluster = dgx_a100 x nodes\n  train   = recipe\n}\n")
    assert read_partial(path).problem.cluster.num_devices == 16
    out_path = tmp_path / "one_node.plan"
    out = generate("--from", path, "--param", "nodes=1", "-o", out_path)
    assert out.exit_code == 0, out.output
    (plan,) = api.load(out_path, {"nodes": 1}).plans
    assert plan.mesh.size == 8  # laid out for the value given
    assert generate("--model", "gpt2_small", "--cluster", "dgx_a100", "--global-batch", "8",
                    "--param", "nodes=1").exit_code == 2


TIGHT = '''device small { memory = 7.25 GiB; bandwidth = 1000 GB/s; peak = { bf16: 200 TFLOP/s, fp32: 20 TFLOP/s } }
node tight_box { devices = 2 x small; link = { bandwidth: 100 GB/s, latency: 2 us }; nic = { bandwidth: 20 GB/s, latency: 5 us } }
model long = gpt(layers=16, hidden=2048, heads=16, seq=4096, vocab=4096)
'''


def test_recompute_layers_is_searched_written_back_and_kept_as_written(tmp_path):
    """A recompute the plan leaves free may come back as `full` for the first N blocks of each stage (the
    search's best on 7.25 GiB devices, test_search's), written with its key; one the plan writes is a pin of the search."""
    path = tmp_path / "partial.plan"
    body = "\nplan mine {\n  model   = long\n  cluster = tight_box x 2\n  mesh    = [pp = 4]\n  train   = { %s }\n}\n"
    path.write_text(TIGHT + body % "global_batch: 4")
    out_path = tmp_path / "done.plan"
    out = generate("--from", path, "-o", out_path)
    assert out.exit_code == 0, out.output
    assert "full 1/st" in out.output
    analysis = api.check(out_path)
    assert analysis.diagnostics == [], [d.message for d in analysis.diagnostics]
    (plan,) = analysis.document.plans
    assert (plan.train.recompute.value, plan.train.recompute_layers) == ("full", 1)
    path.write_text(TIGHT + body % "global_batch: 4, recompute: full, recompute_layers: 2")
    pins = read_partial(path).pins
    assert (pins["recompute"], pins["recompute_layers"], pins["pp"]) == ("full", 2, 4)


LONG = '''import "models/llama3"
import "clusters/dgx_h100"

plan p {{
  model   = llama3_8b
  cluster = dgx_h100
{mesh}  train   = {{ global_batch: 8, seq: 65536, precision: bf16, offload_layers: 0 }}
}}
'''  # offload_layers: 0 (written, so pinned): offloading 22 of the blocks instead takes dp = 2 (0.3 s a step faster)


def test_zero_over_a_context_axis_comes_back_with_the_dp_axis_that_carries_it(tmp_path):
    """A layout with dp = 1 and a context axis shards ZeRO over the context axis (`Candidate.data_axis`): the
    completed plan writes the size-1 dp axis and the data line, so it checks as the search priced it; a written
    mesh without a data line shards nothing, and the search prices it so (a clean refusal, not a plan that fails
    its own check)."""
    path = tmp_path / "long.plan"
    path.write_text(LONG.format(mesh=""))
    done = tmp_path / "done.plan"
    out = generate("--from", path, "-o", done)
    assert out.exit_code == 0, out.output
    analysis = api.check(done)
    assert analysis.diagnostics == [], [d.message for d in analysis.diagnostics]
    (plan,) = analysis.document.plans
    assert plan.cp > 1 and plan.dp == 1  # the layout this is about: dp = 1 first in the mesh, ZeRO over it
    assert plan.mesh.axes[0].name == "dp" and plan.data is not None and plan.data.axes == ("dp",)
    path.write_text(LONG.format(mesh="  mesh    = [cp = 8]\n"))
    assert read_partial(path).pins["zero_stage"] == 0
    out = generate("--from", path, "-o", done)
    assert "this is a bug" not in out.output and out.exit_code != 0


def test_tensor_overlap_with_eager_kernels_is_a_usage_error():
    out = generate("--model", "llama3_8b", "--cluster", "dgx_h100", "--global-batch", "32", "--kernels", "eager",
                   "--tensor-overlap")
    assert out.exit_code != 0 and "--tensor-overlap with --kernels eager" in out.output


def test_a_plan_with_more_stages_than_blocks_under_account_completes_as_written(tmp_path):
    """1 block over pp 2 with `account = [embed, loss]` checks (3 items, E403 counts them); the search bounded pp by
    the blocks alone, and generate --from that complete plan was E803 ("pp at most the blocks")."""
    path = tmp_path / "counted.plan"
    path.write_text('import "clusters/local"\nplan p {\n  model    = llama(layers=1, hidden=64, heads=4, seq=32, '
                    'vocab=256)\n  cluster  = localhost\n  mesh     = [pp = 2] over devices[0:2]\n  train    = { '
                    'global_batch: 8, micro_batch: 1, precision: fp32 }\n  stages   = evenly over pp with account = '
                    '[embed, loss]\n  schedule = 1f1b\n}\n')
    assert api.check(path).ok
    out_path = tmp_path / "done.plan"
    out = generate("--from", path, "-o", out_path)
    assert out.exit_code == 0, out.output
    (written,) = api.check(out_path).document.plans
    (plan,) = api.check(path).document.plans
    assert estimate_plan(written).time.step == pytest.approx(estimate_plan(plan).time.step, rel=1e-12)


@pytest.mark.parametrize("tensor", ["megatron over model", "megatron over model with sequence_parallel"])
def test_a_written_tensor_line_is_searched_as_it_is_kept(tmp_path, tensor):
    """The completion keeps a written `tensor` line as it is, so the search takes its sequence parallelism as a pin:
    without it, a line without `sequence_parallel` was searched with it (0.0558 s, 7.56 GiB at the top), the table
    showed the completed plans' own estimates (0.0580 s, 7.96 GiB) in the search's order, and #4 (0.06296 s) came
    before #5 (0.06247 s)."""
    from plandsl.rewrite.complete import generate_from
    path = write(tmp_path, f"  mesh    = [data = 4, model = 2] over devices[0:8]\n"
                           f"  train   = {{ global_batch: 64, precision: bf16, optimizer: adam }}\n"
                           f"  data    = zero1 over data\n  tensor  = {tensor}\n",
                 header='import "clusters/dgx_a100"\nmodel small = gpt(layers=8, hidden=1024, heads=16, seq=1024, '
                        'vocab=32000)\n')
    completed = generate_from(str(path), top=5)
    steps = [scored.estimate.time.step for scored in completed.result.candidates]
    assert steps == sorted(steps) and len(steps) == 5
    for scored, text in zip(completed.result.candidates, completed.texts):
        exact = estimate_plan(api.select_plan(api.loads(text, path=str(path))))
        assert exact.time.step == pytest.approx(scored.estimate.time.step, rel=1e-9)
        assert scored.candidate.sequence_parallel == ("sequence_parallel" in tensor)


@pytest.mark.parametrize("body, pin, line, gives", [
    ("  mesh    = [dp = 2, tp = 8]\n  train   = recipe\n", "tp=4", "mesh    = [dp = 2, tp = 8]", "tp=8"),
    ("  train   = recipe\n  data    = zero1 over dp\n", "zero=3", "data    = zero1 over dp", "zero_stage=1"),
    ("  train   = recipe\n  data    = zero1 over dp\n", "data=hsdp", "data    = zero1 over dp", "data=zero1"),
    ("  train   = recipe\n  tensor  = megatron over tp\n", "sequence_parallel=true", "tensor  = megatron over tp",
     "sequence_parallel=false"),
    ("  train   = recipe\n  schedule = 1f1b\n", "schedule=gpipe", "schedule = 1f1b", "schedule=1f1b"),
    # 1F1B runs one stage per rank: without a stages line, the schedule's is the line (it was at the plan's name)
    ("  train   = recipe\n  schedule = 1f1b\n", "virtual=2", "schedule = 1f1b", "virtual_stages=1"),
])
def test_a_pin_that_contradicts_a_written_line_is_refused_at_both(tmp_path, body, pin, line, gives):
    """The completion keeps every line the plan writes, so a `--pin` against one is E803 naming the pin and the line
    (file:line:col). It was silently lost: the search ranked the pin's plans, the file kept the line, and the figures
    were the line's (`data = zero1` with `--pin zero=3` came back zero1)."""
    path = write(tmp_path, body)
    out_path = tmp_path / "done.plan"
    out = generate("--from", path, "--pin", pin, "-o", out_path)
    assert out.exit_code == 1 and not out_path.exists(), out.output
    where = f"{path}:{1 + HEADER.count(chr(10)) + 4 + body[:body.index(line)].count(chr(10))}:3"
    assert f"{where}: error[E803]: --pin {pin} contradicts the plan's `{' '.join(line.split())}`, which gives " \
           f"{gives}" in out.output, out.output
    assert f"drop --pin {pin}" in out.output
    agreeing = {"tp=4": "tp=8", "zero=3": "zero=1", "data=hsdp": "data=zero1", "sequence_parallel=true":
                "sequence_parallel=false", "schedule=gpipe": "schedule=1f1b", "virtual=2": "virtual=1"}[pin]
    assert generate("--from", path, "--pin", agreeing, "--top", "1").exit_code == 0  # the line's own word: no error


def test_a_pin_of_the_modules_selective_reruns_is_written_in_the_train(tmp_path):
    """`--pin recompute_modules=...` is what the search ranked: the completed train writes it (it wrote `recompute:
    selective` alone, the default modules), over the plan's own list with a note."""
    path = write(tmp_path, "  train   = { global_batch: 32, micro_batch: 2, recompute: selective, "
                           "recompute_modules: [core_attn] }\n")
    out_path = tmp_path / "done.plan"
    out = generate("--from", path, "--pin", "recompute_modules=layernorm,core_attn", "--top", "1", "-o", out_path)
    assert out.exit_code == 0, out.output
    assert "wins over `recompute_modules: [core_attn]`" in out.stderr and \
        "writes recompute_modules: [layernorm, core_attn]" in out.stderr, out.stderr
    (plan,) = api.load(out_path).plans
    assert [m.value for m in plan.train.recompute_modules] == ["layernorm", "core_attn"]
    path = write(tmp_path, "  train   = { global_batch: 32, micro_batch: 2 }\n")
    out = generate("--from", path, "--pin", "recompute_modules=layernorm", "--top", "1", "-o", out_path)
    assert out.exit_code == 0 and "note:" not in out.stderr, out.output
    (plan,) = api.load(out_path).plans
    assert (plan.train.recompute.value, [m.value for m in plan.train.recompute_modules]) == ("selective", ["layernorm"])


TABLE = HEADER + '''schedule tiny_1f1b(ranks = 2, microbatches = 4) {
  rank 0: 0F0 0F1 _   0B0 0F2 0B1 0F3 0B2 _   0B3
  rank 1: _   1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3
}
'''


@pytest.mark.parametrize("pin", ["schedule=1f1b", "schedule=gpipe"])
def test_a_schedule_pin_against_a_written_table_is_refused_at_its_line(tmp_path, pin):
    """A plan's `schedule = TABLE` (a table or template it defines) is kept as written, so `--pin schedule=1f1b` is
    E803 at that line like one against `schedule = gpipe`: it was ranked by the search and silently lost (exit 0, the
    completed file kept the table, its figures the table's)."""
    path = write(tmp_path, "  train   = { global_batch: 8, micro_batch: 2 }\n  schedule = tiny_1f1b\n", header=TABLE)
    out_path = tmp_path / "done.plan"
    assert generate("--from", path, "--top", "1", "-o", out_path).exit_code == 0  # the table alone completes
    out_path.unlink()
    out = generate("--from", path, "--pin", pin, "--top", "1", "-o", out_path)
    assert out.exit_code == 1 and not out_path.exists(), out.output
    line = path.read_text().splitlines().index("  schedule = tiny_1f1b") + 1
    assert f"{path}:{line}:3: error[E803]: --pin {pin} contradicts the plan's `schedule = tiny_1f1b`, which gives " \
           "schedule=tiny_1f1b" in out.output, out.output


@pytest.mark.parametrize("train, pin, wins_over, written", [
    ("recompute: selective, recompute_modules: [core_attn]", "recompute=full", "recompute_modules: [core_attn]",
     ("full", None, None, 0)),
    ("recompute: full, recompute_layers: 2", "recompute=selective", "recompute_layers: 2", ("selective", None, None, 0)),
    ("recompute: full", "recompute_modules=core_attn", "recompute: full", ("selective", ["core_attn"], None, 0)),
    ("recompute: selective, recompute_modules: [core_attn]", "recompute_layers=2", "recompute: selective",
     ("full", None, 2, 0)),
    ("recompute: selective", "offload_layers=2", "recompute: selective", ("none", None, None, 2)),
    ("recompute: none, offload_layers: 2", "recompute=full", "offload_layers: 2", ("full", None, None, 0)),
])
def test_a_pin_of_how_blocks_are_rerun_wins_over_the_trains_others(tmp_path, train, pin, wins_over, written):
    """recompute, recompute_layers, recompute_modules and offload_layers go together (E205: modules under selective,
    layers under full, offloading without recomputation): a --pin of one wins over the plan's others it leaves no room
    for, which the completed train no longer writes, with a note. It was E803 at the plan's name ("contradictory
    pins: recompute_modules=core_attn names what `recompute: selective` reruns, recompute=full"), the plan's own
    values taken for pins, though the train's values are the ones a --pin wins over."""
    path = write(tmp_path, f"  train   = {{ global_batch: 32, micro_batch: 2, {train} }}\n")
    out_path = tmp_path / "done.plan"
    out = generate("--from", path, "--pin", pin, "--pin", "tp=1", "--pin", "pp=1", "--top", "1", "-o", out_path)
    assert out.exit_code == 0, out.output
    assert f"note: --pin {pin} wins over `{wins_over}` ({path}:10:" in out.stderr, out.stderr
    analysis = api.check(out_path)
    assert analysis.ok, [d.message for d in analysis.diagnostics]
    (plan,) = analysis.document.plans
    modules = [m.value for m in plan.train.recompute_modules] if plan.train.recompute_modules is not None else None
    assert (plan.train.recompute.value, modules, plan.train.recompute_layers, plan.train.offload_layers) == written


def test_pins_the_search_finds_contradictory_say_which_line_or_pins(tmp_path):
    """The search's own 'contradictory pins' was E803 at the plan's name whatever its cause. A --pin against what a
    written line pins is at that line; --pins against each other (whatever the plan writes) are named together, at no
    place of the file; a pin the problem refuses on its own (the cluster's devices) stays at the plan."""
    path = write(tmp_path, "  mesh    = [pp = 2, dp = 8]\n  train   = recipe\n")
    out = generate("--from", path, "--pin", "offload_layers=2")
    assert out.exit_code == 1 and f"{path}:10:3: error[E803]: --pin offload_layers=2 contradicts the plan's " \
        "`mesh = [pp = 2, dp = 8]`: offload_layers=2 is searched without a pipeline (as megatron-core offloads), pp=2" \
        in out.output and "drop --pin offload_layers=2, or edit this line" in out.output, out.output
    path = write(tmp_path, "  train   = recipe\n")
    out = generate("--from", path, "--pin", "tp=1", "--pin", "offload_layers=2", "--pin", "pp=2")
    assert out.exit_code == 1 and "error[E803]: the command line's --pin offload_layers=2 and --pin pp=2 contradict " \
        "each other: offload_layers=2 is searched without a pipeline" in out.output and str(path) not in out.output, \
        out.output
    out = generate("--from", path, "--pin", "tp=3")
    assert out.exit_code == 1 and f"{path}:7:6: error[E803]: contradictory pins: tp(3) = 3, which does not divide " \
        "the 16 devices" in out.output, out.output
    # ... its hint names the pin: it said to free one of the plan's pins (micro_batch_size=2, recompute=selective),
    # which would not help
    assert "hint: --pin tp=3 is refused by the problem the plan states" in out.output and "free one" not in out.output, \
        out.output


@pytest.mark.parametrize("pin", ["tp", "=4"])
def test_a_pin_that_is_not_key_value_is_said_so_under_from(tmp_path, pin):
    """`generate --from` checks the pins against the plan (aa0a8de) after they are read as KEY=VALUE: `--pin tp` had
    become "--pin tp=: tp is a whole number" and `--pin =4` "unknown pin ''"."""
    out = generate("--from", write(tmp_path, "  train   = recipe\n"), "--pin", pin)
    assert out.exit_code == 1 and f"pin '{pin}' is not KEY=VALUE (e.g. tp=8)" in out.output, out.output


@pytest.mark.parametrize("stages", ["evenly over pp", "evenly over pp with virtual = 1"])
def test_an_account_pin_against_a_written_stages_line_is_refused_at_it(tmp_path, stages):
    """A written `stages = evenly over pp` counts blocks alone, and the completion keeps it as written, so `--pin
    account=embed` (7 blocks: 3 and 4 with the embedding counted, 4 and 3 without) is E803 at that line: it was
    silently lost (exit 0, the file's split 4 and 3, as `generate` without --from never writes under that pin)."""
    path = write(tmp_path, f"  train   = {{ global_batch: 32, micro_batch: 1, precision: bf16 }}\n  stages  = {stages}\n",
                 header=HEADER.replace("layers=8", "layers=7"))
    pins = ("--pin", "pp=2", "--pin", "schedule=1f1b", "--top", "1")
    out = generate("--from", path, "--pin", "account=embed", *pins)
    line = path.read_text().splitlines().index(f"  stages  = {stages}") + 1
    assert out.exit_code == 1 and f"{path}:{line}:3: error[E803]: --pin account=embed contradicts the plan's " \
        f"`stages = {stages}`, which gives account=none" in out.output, out.output
    assert generate("--from", path, "--pin", "account=none", *pins).exit_code == 0  # the line's own split


def test_a_train_of_another_file_rebuilt_for_a_pin_keeps_every_setting_it_writes(tmp_path):
    """A train that is not a dict of this file is rebuilt where a pin changes one of its values: every value it sets
    comes back (the completion wrote a fixed list of keys, and lost the loss, the kernels, the attention core, the
    modules `selective` reruns and FP8's recipe: the completed plan was not the one searched)."""
    (tmp_path / "recipes.plan").write_text(
        "let shared = { global_batch: 32, micro_batch: 2, precision: bf16, recompute: selective,"
        " recompute_modules: [core_attn, layernorm], loss: fused, kernels: eager, attention: materialized,"
        " lr: 1e-4, lr_schedule: cosine, warmup_steps: 3, grad_clip: 0.5, seed: 7,"
        " optimizer_dtype: bf16 }\n")
    path = write(tmp_path, '  train   = shared\n', header=HEADER + 'import "recipes"\n')
    written = read_partial(path).plan.train
    out_path = tmp_path / "done.plan"
    out = generate("--from", path, "--pin", "micro_batch_size=1", "--top", "1", "-o", out_path)
    assert out.exit_code == 0, out.output
    analysis = api.check(out_path)
    assert analysis.ok, [d.message for d in analysis.diagnostics]  # (HEADER's own let is unused here: W201)
    (plan,) = analysis.document.plans
    assert plan.train.micro_batch == 1
    where = {"span", "field_spans"}  # the values, not where they are written
    assert plan.train.model_dump(exclude=where) == written.model_copy(update={"micro_batch": 1}).model_dump(exclude=where)


@pytest.mark.parametrize("stages, pins, named", [
    # Megatron-LM's pipeline runs 1F1B and interleaved 1F1B alone: the pin was E803 at the plan's name
    ("megatron", ["schedule=zb_h1"], "--pin schedule=zb_h1 contradicts"),
    # two pins that DeepSpeed's engine refuses together (sequence parallelism, which it does not run, and a tensor
    # axis to run it over): they were 'the command line's ... contradict each other', with no place, as if no plan
    # could take them (and with pp=2 pinned too before the engine was known to run at pp=1: `test_a_kept_deepspeed...`)
    ("deepspeed", ["sequence_parallel=true", "tp=2"], "--pin sequence_parallel=true and --pin tp=2 contradict"),
    ("deepspeed", ["dp_shard=4"], "--pin dp_shard=4 contradicts"),  # hsdp is ZeRO-3: it was at the plan's name
])
def test_pins_a_stages_lines_pipeline_refuses_are_refused_at_that_line(tmp_path, stages, pins, named):
    """The pipeline a stages line names (`with implementation = megatron | deepspeed`) is part of the problem, not a
    pin: what it refuses of the pins is E803 at that line, not at the plan's name nor between the --pins."""
    path = write(tmp_path, f"  train   = recipe\n  stages  = evenly over pp with implementation = {stages}\n")
    out = generate("--from", path, *[arg for pin in pins for arg in ("--pin", pin)])
    assert out.exit_code == 1 and f"{path}:11:3: error[E803]: {named} the plan's `stages = evenly over pp with " \
        f"implementation = {stages}`" in out.output and "contradict each other" not in out.output, out.output


def test_pins_that_contradict_only_together_are_found_in_bounded_work(tmp_path):
    """Four `--pin`s whose degrees multiply past the devices contradict only all together; a hundred `--pin zero=1`
    before them are the same pin a hundred times. Every group of every size was tried, 2^n of them (4.6 million
    groups of four alone: minutes); a key pinned again counts once, as its last, and groups past three are found by
    shrinking the whole set."""
    path = write(tmp_path, "  train   = recipe\n")
    pins = ["zero=1"] * 100 + ["dp=2", "tp=2", "pp=2", "cp=4"]
    with bounded(5, "generate --from with 104 --pins"):
        out = generate("--from", path, *[arg for pin in pins for arg in ("--pin", pin)])
    assert out.exit_code == 1 and "error[E803]: the command line's --pin dp=2, --pin tp=2, --pin pp=2 and --pin " \
        "cp=4 contradict each other: dp(2) * tp(2) * pp(2) * cp(4) = 32, which does not divide the 16 devices" \
        in out.output, out.output


def test_pins_that_contradict_each_other_are_named_in_the_order_given_a_repeat_as_its_first(tmp_path):
    """A `--pin` given again (or under an alias) is the same pin (`parse_pins` refuses one pinned to two values): the
    pair that contradicts is named as every group was tried, in the order the pins are given. Kept as its last
    `--pin`, `--pin tp=4 --pin cp=8 --pin tp=4` named "cp=8 and tp=4"."""
    path = write(tmp_path, "  train   = recipe\n")
    for pins in (["tp=4", "cp=8", "tp=4"], ["zero_stage=1", "tp=4", "cp=8", "zero=1"]):
        out = generate("--from", path, *[arg for pin in pins for arg in ("--pin", pin)])
        assert out.exit_code == 1 and "error[E803]: the command line's --pin tp=4 and --pin cp=8 contradict each " \
            "other: tp(4) * cp(8) = 32" in out.output, out.output


def test_a_kept_deepspeed_stages_line_runs_its_engine_at_one_stage_too(tmp_path):
    """A written `stages = ... with implementation = deepspeed` is kept in every candidate, at pp = 1 too, where
    DeepSpeed's engine still takes ZeRO 0 or 1 and no sequence parallelism (E611): the search laid out ZeRO-2/3 and
    sequence parallelism there as for `--pipeline deepspeed`, whose pp = 1 plans have no stages line, so `--pin tp=2`
    and `--pin zero=3` were 'a bug of plandsl generate --from' (E611 at lines of the completed plan, not the user's)."""
    path = write(tmp_path, "  train   = recipe\n  stages  = evenly over pp with implementation = deepspeed\n")
    out = generate("--from", path, "--pin", "tp=2", "--top", "3", "--json")
    assert out.exit_code == 0, out.output
    candidates = json.loads(out.output)["candidates"]
    assert candidates and all(c["zero_stage"] <= 1 and not c["sequence_parallel"] for c in candidates), candidates
    for c in candidates:  # as written: the stages line kept, and it checks
        assert "implementation = deepspeed" in c["plan"], c["plan"]
        assert api.checks(c["plan"], path=str(tmp_path / "c.plan")).diagnostics == [], c["plan"]
    out = generate("--from", path, "--pin", "zero=3")
    assert out.exit_code == 1 and f"{path}:11:3: error[E803]: --pin zero=3 contradicts the plan's `stages = evenly " \
        "over pp with implementation = deepspeed`: DeepSpeed's pipeline engine takes ZeRO 0 or 1" in out.output \
        and "bug" not in out.output, out.output


def test_full_recomputation_pinned_against_a_written_experts_overlap_is_refused_at_the_experts_line(tmp_path):
    """The experts' overlap (`experts = ... with overlap`) is part of the problem: Megatron-Core refuses full
    recomputation beside it (E418), so `--pin recompute=full` is E803 at the experts line (it was at the plan's name)."""
    header = ('import "clusters/dgx_h100"\nmodel moe = llama(layers=4, hidden=2048, heads=32, kv_heads=4, head_dim=128, '
              'ffn=768, experts=16, top_k=2, vocab=32000, seq=1024)\n')
    path = tmp_path / "partial.plan"
    path.write_text(header + "plan mine {\n  model   = moe\n  cluster = dgx_h100 x 2\n  mesh    = [dp = 2, ep = 8]\n"
                    "  train   = { global_batch: 64, micro_batch: 1, recompute: none }\n"
                    "  experts = alltoall over ep with overlap\n}\n")
    out = generate("--from", path, "--pin", "recompute=full")
    assert out.exit_code == 1 and f"{path}:8:3: error[E803]: --pin recompute=full contradicts the plan's `experts = " \
        "alltoall over ep with overlap`: the experts' overlap" in out.output, out.output


@pytest.mark.parametrize("mesh", ["", "  mesh    = [pp = 2, dp = 8]\n"])
def test_written_virtual_stages_without_a_schedule_are_completed_with_one_that_runs_them(tmp_path, mesh):
    """`stages = evenly over pp with virtual = 2` and no schedule line leaves the schedule to the search, which writes
    one of virtual stages: the plan was refused with E409 (the probe's, or the mesh's, default schedule 1f1b runs one
    stage per rank); without E409 the search laid out pp = 1, where it writes no schedule, and the kept line was the
    completed plan's E409, 'a bug of generate --from'. pp = 1 is left out under it (`--pin pp=1`: E803 at the line)."""
    path = write(tmp_path, "  train   = recipe\n" + mesh + "  stages  = evenly over pp with virtual = 2\n")
    out = generate("--from", path, "--top", "2", "--json")
    assert out.exit_code == 0, out.output
    candidates = json.loads(out.output)["candidates"]
    for c in candidates:
        assert c["pp"] > 1 and c["virtual_stages"] == 2, c
        assert re.search(r"stages += evenly over pp with virtual = 2", c["plan"]) and "schedule" in c["plan"], c["plan"]
        assert api.checks(c["plan"], path=str(tmp_path / "c.plan")).diagnostics == [], c["plan"]
    if not mesh:  # what needs pp = 1 contradicts the line (offloading: it was 'no plan satisfies', at the plan's name)
        for pin in ("pp=1", "offload_layers=2"):
            out = generate("--from", path, "--pin", pin)
            assert out.exit_code == 1 and f"{path}:11:3: error[E803]: --pin {pin} contradicts the plan's `stages = " \
                "evenly over pp with virtual = 2`" in out.output, out.output


@pytest.mark.parametrize("implementation", ["torch", "megatron"])
def test_a_kept_stages_line_is_priced_at_one_stage_as_its_completion_runs(tmp_path, implementation):
    """A written stages line is kept at pp = 1 (over a pipeline axis of size 1), where `plandsl run` builds the
    pipeline's stages too and ZeRO-2's gradients stay whole to the step's end (`cost.memory.pipelined_shards`): the
    search priced its pp = 1 candidates without the line, so Llama 3 8B on two DGX H100 nodes came back as dp 16
    ZeRO-2 at 68.3 GiB, whose completed plan counts 98.2 GiB ('this is a bug of plandsl generate --from'). Each
    candidate is now the plan its completion writes, with the memory that plan's estimate gives."""
    path = tmp_path / "partial.plan"
    path.write_text('import "clusters/dgx_h100"\nimport "models/llama3"\n\nplan p {\n  model   = llama3_8b\n'
                    "  cluster = dgx_h100 x 2\n  train   = { global_batch: 64, micro_batch: 1, precision: bf16, "
                    "optimizer: adam, lr: 1e-4 }\n"
                    f"  stages  = evenly over pp with implementation = {implementation}\n}}\n")
    out = generate("--from", path, "--pin", "pp=1", "--top", "2", "--json")
    assert out.exit_code == 0, out.output
    candidates = json.loads(out.output)["candidates"]
    assert candidates
    for c in candidates:
        assert f"stages  = evenly over pp with implementation = {implementation}" in c["plan"], c["plan"]
        analysis = api.checks(c["plan"], path=str(tmp_path / "c.plan"))
        assert analysis.diagnostics == [], c["plan"]
        (plan,) = analysis.document.plans
        assert plan.pp == 1 and plan.stages is not None
        peak = max(m.total for m in estimate_plan(plan).memory)
        assert peak == pytest.approx(c["peak_memory_bytes"], rel=1e-9), c["plan"]
    assert generate("--from", path).exit_code == 0  # whatever the search picks


def test_a_kept_stages_lines_root_is_not_pruned_by_zero3s_pipelined_states_at_one_stage(tmp_path):
    """At pp = 1 a kept stages line runs ZeRO-3 on the pipeline's runtime (every unit gathered and its gradients whole
    through the step, `cost.memory.pipelined_shards`), where it holds more than ZeRO-1 on Megatron-LM's pipeline (no
    `replicate` copies): dp 2 x tp 2 of a 1.07B gpt, ZeRO-3's states 7.26 GiB, ZeRO-1's 6.26 and its whole plan
    7.16 GiB, on devices of 7.19 GiB usable. The layout's states check took ZeRO-3's as the least past one stage only,
    so `generate --from` said no layout fits ('needs at least 7.2 GiB per device for its model states alone, even
    with ZeRO-3'), where the ZeRO-1 plan it now completes checks and fits (`plandsl estimate`)."""
    path = tmp_path / "partial.plan"
    path.write_text(
        "device mid { memory = 7.82 GiB; bandwidth = 1000 GB/s; peak = { bf16: 200 TFLOP/s, fp32: 20 TFLOP/s } }\n"
        "node box { devices = 2 x mid; link = { bandwidth: 100 GB/s, latency: 2 us }; "
        "nic = { bandwidth: 20 GB/s, latency: 5 us } }\ncluster pair = box x 2\n"
        "model short = gpt(layers=4, hidden=4096, heads=32, seq=128, vocab=32000)\n\nplan p {\n  model   = short\n"
        "  cluster = pair\n  train   = { global_batch: 4, precision: bf16, optimizer: adam, lr: 1e-4 }\n"
        "  stages  = evenly over pp with implementation = megatron\n}\n")
    out = generate("--from", path, "--pin", "pp=1", "--pin", "tp=2", "--top", "1", "--json")
    assert out.exit_code == 0, out.output
    (c,) = json.loads(out.output)["candidates"]
    assert (c["degrees"]["pp"], c["degrees"]["tp"], c["zero_stage"]) == (1, 2, 1), c
    analysis = api.checks(c["plan"], path=str(tmp_path / "c.plan"))
    assert analysis.diagnostics == [], c["plan"]
    (plan,) = analysis.document.plans
    estimate = estimate_plan(plan)
    assert estimate.fits and max(m.total for m in estimate.memory) == pytest.approx(c["peak_memory_bytes"], rel=1e-9)


def test_a_kept_stages_lines_map_rules_out_the_schedules_that_place_its_stages_otherwise(tmp_path):
    """`stages = evenly over pp with virtual = 2` maps its stages to the ranks in a loop: the search chose zbv and
    dualpipev beside it (a V, the checker's E409), and with `--top 1` `generate --from` ended in 'this is a bug of
    `plandsl generate --from`' (8 of its 8 best candidates refused); a written list that is a loop likewise. Each
    candidate now runs a schedule that places the stages as the line's map does, and a V's (`map = vshape` or its
    list) only V-shape schedules."""
    header = HEADER.replace("layers=8, hidden=1024", "layers=8, hidden=2048")
    for written, vshape in (("virtual = 2", False), ("virtual = 2, map = [0, 1, 0, 1]", False),
                            ("virtual = 2, map = vshape", True), ("virtual = 2, map = [0, 1, 1, 0]", True)):
        path = write(tmp_path, "  train   = { global_batch: 16, precision: bf16, optimizer: adam, lr: 1e-4 }\n"
                               f"  stages  = evenly over pp with {written}\n", header)
        out = generate("--from", path, "--pin", "pp=2", "--top", "4", "--json")
        assert out.exit_code == 0, (written, out.output)
        candidates = json.loads(out.output)["candidates"]
        assert len(candidates) == 4
        for c in candidates:
            assert (c["schedule"] in ("zbv", "dualpipev")) is vshape, (written, c["schedule"])
            assert api.checks(c["plan"], path=str(tmp_path / "c.plan")).errors == [], c["plan"]


@pytest.mark.parametrize("kind", ["zero2", "zero3"])
def test_a_kept_data_line_is_priced_at_one_data_rank_as_its_completion_runs(tmp_path, kind):
    """A written data line is kept when the search lays out dp = 1 (over an axis of size 1), where ZeRO-2/3 still
    hold their units whole beside the shards: the search priced those candidates without a data clause, 1.4 GB under
    the completed plan's estimate (4.35 against 5.71 GB here), so it ranked them, and could keep them, by memory
    their plans do not have. Each candidate is now the plan its completion writes."""
    path = tmp_path / "partial.plan"
    path.write_text(
        "device gpu { memory = 16 GiB; bandwidth = 1000 GB/s; peak = { bf16: 200 TFLOP/s, fp32: 20 TFLOP/s } }\n"
        "node box { devices = 2 x gpu; link = { bandwidth: 100 GB/s, latency: 2 us }; "
        "nic = { bandwidth: 1 GB/s, latency: 10 us } }\ncluster slow = box x 4\n"
        "model big = gpt(layers=4, hidden=4096, heads=32, seq=1024, vocab=32000)\n\nplan p {\n  model   = big\n"
        "  cluster = slow\n  train   = { global_batch: 8, precision: bf16, optimizer: adam, lr: 1e-4 }\n"
        f"  data    = {kind} over dp\n}}\n")
    partial = read_partial(path)
    pins, _ = pins_with(partial, ["dp=1"])
    result = search(partial.problem, pins, 2)
    assert result.candidates
    for searched in result.candidates:  # the search's own figures, not the completion's (which re-estimates)
        done = complete(partial, searched)
        assert not isinstance(done, PlanError), done
        text = done[1]
        assert re.search(rf"data +\= {kind} over dp\n", text) and "dp = 1" in text, text
        (plan,) = api.checks(text, path=str(path)).document.plans
        estimate = estimate_plan(plan)
        assert max(m.total for m in estimate.memory) == pytest.approx(max(m.total for m in searched.estimate.memory),
                                                                     rel=1e-9), text
        assert estimate.time.step == pytest.approx(searched.estimate.time.step, rel=1e-9), text


PAIR = ("device gpu { memory = 16 GiB; bandwidth = 1000 GB/s; peak = { bf16: 200 TFLOP/s, fp32: 20 TFLOP/s } }\n"
        "node box { devices = 2 x gpu; link = { bandwidth: 100 GB/s, latency: 2 us }; "
        "nic = { bandwidth: 20 GB/s, latency: 5 us } }\ncluster pair = box x 2\n")


def _searched_as_completed(path, pins, top=5):
    """Each of the search's candidates (its own figures, not the completion's re-estimate) beside the estimate of the
    plan its completion writes."""
    partial = read_partial(path)
    merged, _ = pins_with(partial, pins)
    result = search(partial.problem, merged, top)
    assert result.candidates
    for searched in result.candidates:
        done = complete(partial, searched)
        assert not isinstance(done, PlanError), (searched.candidate.describe(), searched.blocks, done)
        (plan,) = api.checks(done[1], path=str(path)).document.plans
        yield searched, estimate_plan(plan), done[1]


def test_a_kept_evenly_line_is_priced_at_its_even_split_under_partial_recomputation(tmp_path):
    """A kept `stages = evenly over pp` splits the blocks evenly whatever the search would choose: a node that
    recomputes the first N blocks of each stage was priced at the search's own split (7 and 9 blocks of 16 here), the
    completion wrote `evenly` (8 and 8), and its plan needed more than the device (E503, the candidate dropped as
    'a bug of generate --from'). Each candidate is now priced at the line's split, as its completed plan is."""
    path = tmp_path / "partial.plan"
    path.write_text(TIGHT + "\nplan mine {\n  model   = long\n  cluster = tight_box x 2\n  train   = { global_batch: 4, "
                    "precision: bf16, optimizer: adam, lr: 1e-4 }\n  stages  = evenly over pp\n}\n")
    seen = []
    for searched, estimate, text in _searched_as_completed(path, ["pp=2"]):
        assert searched.blocks == (8, 8) and re.search(r"stages += evenly over pp\n", text), (searched.blocks, text)
        assert max(m.total for m in estimate.memory) == pytest.approx(max(m.total for m in searched.estimate.memory),
                                                                     rel=1e-9), text
        assert estimate.time.step == pytest.approx(searched.estimate.time.step, rel=1e-9), text
        seen.append(searched.candidate.recompute_layers)
    assert any(seen), seen  # the case this is about: a partly recomputed candidate among them


def test_a_written_stages_block_is_priced_at_its_own_split(tmp_path):
    """A `stages { }` block is kept as written, so the search prices its split: it priced its own (2 and 2 blocks
    where the block writes 1 and 3), ranking by 434 MB a plan whose completion counts 557 MB (and a slower step)."""
    path = tmp_path / "partial.plan"
    path.write_text(PAIR + "model gpt = gpt(layers=4, hidden=512, heads=8, seq=512, vocab=4096)\n\nplan p {\n"
                    "  model   = gpt\n  cluster = pair\n  train   = { global_batch: 16, precision: bf16, optimizer: adam, "
                    "lr: 1e-4 }\n  stages {\n    0: embed, layers[0:1]\n    1: layers[1:4], norm, head\n  }\n}\n")
    for searched, estimate, text in _searched_as_completed(path, []):
        assert max(m.total for m in estimate.memory) == pytest.approx(max(m.total for m in searched.estimate.memory),
                                                                     rel=1e-9), text
        assert estimate.time.step == pytest.approx(searched.estimate.time.step, rel=1e-9), text
        assert searched.candidate.pp == 2 and searched.blocks == (1, 3), searched.candidate.describe()
    assert read_partial(path).problem.split == (1, 3)


@pytest.mark.parametrize("written, pin, placed", [
    ("virtual = 2, map = vshape", "interleaved_1f1b", "in a loop, and the kept stages line's map places them in a V"),
    ("virtual = 2", "zbv", "in a V, and the kept stages line's map places them in a loop"),
    ("virtual = 2, map = [0, 1, 1, 0]", "interleaved_1f1b", "in a loop, and the kept stages line's map places them as "
                                                             "[0, 1, 1, 0]"),
])
def test_a_pinned_schedule_that_places_the_stages_against_a_kept_map_is_refused_at_the_line(tmp_path, written, pin,
                                                                                            placed):
    """`map = vshape` kept beside `--pin schedule=interleaved_1f1b` (which places the stages in a loop) is a
    contradiction: it ended in the generic 'no plan ... satisfies the pins: the schedules need enough microbatches'
    at the plan's name; it is E803 at the stages line, naming both placements."""
    path = write(tmp_path, "  train   = { global_batch: 16, precision: bf16, optimizer: adam, lr: 1e-4 }\n"
                           f"  stages  = evenly over pp with {written}\n")
    out = generate("--from", path, "--pin", f"schedule={pin}")
    assert out.exit_code == 1 and f"{path}:11:3: error[E803]: --pin schedule={pin} contradicts the plan's `stages = " \
        f"evenly over pp with {written}`: schedule={pin} places the stages on the ranks {placed}" in out.output, \
        out.output
    assert "microbatches" not in out.output


@pytest.mark.parametrize("written, pin, placed", [
    ("", "zbv", "in a V, and the kept stages block's map places them in a loop"),
    ("    map = vshape\n", "interleaved_1f1b", "in a loop, and the kept stages block's map places them in a V"),
])
def test_a_pinned_schedule_against_a_kept_stages_blocks_map_says_it_is_the_block(tmp_path, written, pin, placed):
    """The same contradiction where the kept placement is a `stages { }` block: the message called it 'the kept stages
    line's map', a line the plan does not write; it names the block."""
    path = write(tmp_path, "  train   = { global_batch: 16, precision: bf16, optimizer: adam, lr: 1e-4 }\n"
                           "  stages {\n    0: embed, layers[0:2]\n    1: layers[2:4]\n    2: layers[4:6]\n"
                           f"    3: layers[6:8], norm, head\n    virtual = 2\n{written}  }}\n")
    out = generate("--from", path, "--pin", f"schedule={pin}")
    assert out.exit_code == 1 and f"{path}:11:3: error[E803]: --pin schedule={pin} contradicts the plan's `stages {{" \
        in out.output and f"schedule={pin} places the stages on the ranks {placed} (the checker's E409)" \
        in out.output, out.output
    assert "stages line" not in out.output and "microbatches" not in out.output


_ONE_STAGE_BLOCK = "  stages {\n    0: embed, layers[0:8], norm, head\n    implementation = deepspeed\n  }\n"


def test_pins_against_a_kept_stages_block_say_block_not_line(tmp_path):
    """E803's hint said "or edit this line" and the search's messages "a kept stages line" / "the plan's stages line"
    also where the plan writes a `stages { }` block; they name what the user wrote (the line form reads as before)."""
    path = write(tmp_path, "  train   = { global_batch: 16, precision: bf16, optimizer: adam, lr: 1e-4 }\n"
                           "  stages {\n    0: embed, layers[0:2]\n    1: layers[2:4]\n    2: layers[4:6]\n"
                           "    3: layers[6:8], norm, head\n    virtual = 2\n  }\n")
    out = generate("--from", path, "--pin", "pp=1")  # a --pin against the block's own pin
    assert out.exit_code == 1 and f"{path}:11:3: error[E803]: --pin pp=1 contradicts the plan's `stages {{" \
        in out.output and "drop --pin pp=1, or edit this block (remove it" in out.output, out.output
    assert "this line" not in out.output
    # a --pin the block's pipeline refuses (`_shaping_lines`), and the search's own message in it
    path = write(tmp_path, "  train   = recipe\n" + _ONE_STAGE_BLOCK)
    out = generate("--from", path, "--pin", "tp=2", "--pin", "sequence_parallel=true")
    assert out.exit_code == 1 and f"{path}:11:3: error[E803]: --pin tp=2 and --pin sequence_parallel=true " \
        "contradict the plan's `stages {" in out.output and "runs no sequence parallelism, at any pp where the " \
        "plan's stages block names it (E611)" in out.output and "or edit this block (remove it" in out.output, \
        out.output
    assert "stages line" not in out.output and "this line" not in out.output
    problem = read_partial(path).problem
    for pins, said in (({"virtual_stages": 2, "pp": 1}, "virtual_stages=2 of a kept stages block needs a schedule that "
                                                        "runs them, which pp=1 lays out none of"),
                       ({"offload_layers": 2, "virtual_stages": 2}, "virtual_stages=2 of a kept stages block needs one")):
        with pytest.raises(SearchError, match=re.escape(said)):
            check_pins(problem, pins)
    path = write(tmp_path, "  train   = recipe\n  stages  = evenly over pp with implementation = deepspeed\n")
    with pytest.raises(SearchError, match="of a kept stages line needs a schedule"):
        check_pins(read_partial(path).problem, {"virtual_stages": 2, "pp": 1})


def test_a_kept_split_past_a_rank_its_open_gradients_overfill_is_refused_not_searched_forever(tmp_path):
    """ZeRO-2 on torch's pipeline with virtual stages frees each stage's gradients after its last backward, and the
    split of several kinds of block (`Splits._released_split`) counts a rank's largest set of stages open at once; a
    rank over its room counted its stages' gradients whole and split again, which for a fixed split (a kept `evenly`,
    the pinned `account`) gave the same split, over the same rank, forever: on 2 GiB devices this search never
    returned (9 of 61 device sizes from 1 to 16 GiB). The split is refused there; what the search keeps completes
    to its own figures."""
    def hung(*_):
        raise TimeoutError("the search did not return in 60 s")
    path = tmp_path / "partial.plan"
    path.write_text(
        "device small { memory = 2 GiB; bandwidth = 1000 GB/s; peak = { bf16: 200 TFLOP/s, fp32: 20 TFLOP/s } }\n"
        "node tight_box { devices = 2 x small; link = { bandwidth: 100 GB/s, latency: 2 us }; "
        "nic = { bandwidth: 20 GB/s, latency: 5 us } }\n"
        "model mixed = llama(layers=8, hidden=1024, heads=8, kv_heads=4, seq=1024, vocab=8192, experts=4, top_k=2, "
        "dense_layers=3)\n\nplan p {\n  model   = mixed\n  cluster = tight_box x 2\n  train   = { global_batch: 16, "
        "precision: bf16, optimizer: adam, lr: 1e-4 }\n  stages  = evenly over pp with virtual = 2\n}\n")
    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(60)
    try:
        seen = list(_searched_as_completed(path, ["pp=2", "zero=2"], top=3))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    for searched, estimate, text in seen:
        assert searched.blocks == (2, 2, 2, 2), searched.blocks
        assert max(m.total for m in estimate.memory) == pytest.approx(max(m.total for m in searched.estimate.memory),
                                                                     rel=1e-9), text
        assert estimate.time.step == pytest.approx(searched.estimate.time.step, rel=1e-9), text


def test_a_kept_evenly_line_with_more_stages_than_blocks_says_so_at_the_line(tmp_path):
    """`stages = evenly over pp with virtual = 2` on a model of 6 blocks with --pin pp=4 (8 stages, each given a
    block by the kept `evenly` line) ended in the search's generic 'the schedules need enough microbatches ... and
    stages need blocks' at the plan's name; the pins contradict each other at the line that pins one of them."""
    header = HEADER.replace("gpt(layers=8,", "gpt(layers=6,")
    path = write(tmp_path, "  train   = recipe\n  stages  = evenly over pp with virtual = 2\n", header)
    out = generate("--from", path, "--pin", "pp=4")
    assert out.exit_code == 1 and f"{path}:11:3: error[E803]: --pin pp=4 contradicts the plan's `stages = evenly " \
        "over pp with virtual = 2`: pp=4 with virtual_stages=2 is 8 stages, more than the model's 6 blocks" \
        in out.output, out.output
    out = generate("--from", path, "--pin", "pp=2")  # 4 stages of 6 blocks: a plan
    assert out.exit_code == 0, out.output


MOE_HEADER = '''import "clusters/dgx_h100"
model moe = llama(layers=8, hidden=1024, heads=16, kv_heads=4, seq=2048, vocab=32000, experts=16)
'''


def test_the_experts_overlap_without_a_mesh_is_searched_over_an_expert_group(tmp_path):
    """`experts = alltoall with overlap` without a mesh: the check through the probe mesh (one device an axis) gave
    E419 'beside one expert rank', which no plan without a mesh could avoid, where the search lays out an expert group
    for the overlap. With a written mesh of one expert rank it stays E419, at the experts line."""
    def partial(lines: str):
        path = tmp_path / "moe.plan"
        path.write_text(MOE_HEADER + "plan p {\n  model    = moe\n  cluster  = dgx_h100 x 2\n"
                        "  train    = { global_batch: 64, micro_batch: 1, precision: bf16 }\n" + lines + "}\n")
        return path
    path, out_path = partial("  experts  = alltoall with overlap\n"), tmp_path / "done.plan"
    out = generate("--from", path, "--top", "1", "-o", out_path)
    assert out.exit_code == 0, out.output
    (plan,) = api.check(out_path).document.plans
    assert plan.experts.overlap and plan.expert_group > 1, out_path.read_text()
    meshed = partial("  mesh     = [dp = 16, ep = 1]\n  experts  = alltoall over ep with overlap\n")
    refused = generate("--from", meshed)
    assert refused.exit_code == 1 and f"{meshed}:8:14: error[E419]" in refused.output \
        and "beside one expert rank" in refused.output, refused.output


def test_the_experts_overlap_where_no_layout_has_an_expert_group_says_so(tmp_path):
    """Past the probe mesh's E419 (2c41cf5), a partial plan's overlap that no layout can give an expert group went to
    the search, which found no root and said "the schedules need enough microbatches ... and stages need blocks":
    `--pin ep=1` is E803 at the experts line, pins that leave ep no room and a model of one expert say the overlap
    needs an expert group (E419's reason); the completed file of a plan that can checks clean (the test above)."""
    path = tmp_path / "moe.plan"

    def partial(experts: int = 16):
        path.write_text(MOE_HEADER.replace("experts=16", f"experts={experts}") + "plan p {\n  model    = moe\n"
                        "  cluster  = dgx_h100 x 2\n  train    = { global_batch: 64, micro_batch: 1, precision: bf16 }\n"
                        "  experts  = alltoall with overlap\n}\n")
        return path
    out = generate("--from", partial(), "--pin", "ep=1")
    assert out.exit_code == 1 and f"{path}:7:3: error[E803]: --pin ep=1 contradicts the plan's `experts = alltoall " \
        "with overlap`: the experts' overlap" in out.output and "needs more than one expert rank (E419" in out.output, \
        out.output
    for args, experts in ((("--pin", "dp=16"), 16), (("--pin", "dp=2", "--pin", "pp=8"), 16), ((), 1)):
        out = generate("--from", partial(experts), *args)
        assert out.exit_code == 1 and "error[E803]: `experts = ... with overlap` needs an expert group of more than " \
            "one rank (E419" in out.output and "has one expert rank" in out.output \
            and "schedules need enough microbatches" not in out.output and "Traceback" not in out.output, out.output
