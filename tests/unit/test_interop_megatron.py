"""`plandsl export --to megatron` and `plandsl import --from megatron`: the exported arguments of every stdlib
plan (golden files), what each plan Megatron-LM cannot express loses, round trips both ways, the published
Megatron-LM configurations, bad flags as diagnostics (never a traceback) and the CLI. megatron-core's own code
judges the same exports in test_interop_megatron_core.py."""
from __future__ import annotations

import functools
import importlib.util
import re
import shlex
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings, strategies as st

from plandsl import api, ir
from plandsl.cli import main
from plandsl.interop import export_plan, import_text
from plandsl.ir.placement import assign_stages
from support import bounded

ROOT = Path(__file__).resolve().parents[2]
PLANS = sorted(p for p in (ROOT / "stdlib_plans").rglob("*.plan") if p.parent.name in ("examples", "local"))

# What Megatron-LM cannot express of the other stdlib plans, as the E808 messages say it.
LOST = {
    "llama3_8b_hsdp": ["data parallelism over 2 axes (replica, shard)", "data = hsdp"],
    "mixtral_8x7b_ep": ["the mesh order [dp(dp), pp(pp), ep(ep)]"],
    "gpt3_6_7b_table": ["schedule = one_f_one_b_4x8"],
    "gpt3_6_7b_template": ["schedule = pipedream_flush"],
    "gpt3_6_7b_rules": ["shard rule `embed.tok`", "shard rule `layers.*.attn.wq`", "shard rule `layers[0:4].mlp.*`",
                        "shard rule `layers.0.mlp.w2`", "shard rule `head`"],
    "llama2_70b_zbv": ["schedule = zbv", "the stage-to-rank map vshape"],
    "tiny_pp_custom": ["schedule = tiny_1f1b"],
    "tiny_hetero": ["batch_shares"],
    "gpt_1b3_shares": ["batch_shares"],
}

# Every plan of the stdlib examples, found by name (loading them all at collection would cost every xdist worker
# ~1 CPU-s); `stdlib_plan` loads one when a test runs.
NAMED = [(str(path), name) for path in PLANS for name in re.findall(r"^plan (\w+)", path.read_text(), re.M)]
ALL = [pytest.param(path, name, id=f"{Path(path).parent.name}/{Path(path).stem}:{name}") for path, name in NAMED]
EXPRESSIBLE = [param for param in ALL if param.values[1] not in LOST]


@functools.lru_cache(maxsize=None)
def stdlib_plan(path: str, name: str):
    return api.select_plan(api.load(path), name)


def _flags(text: str) -> list[str]:
    return [w for w in shlex.split(text, comments=True) if w not in ("MEGATRON_ARGS=(", ")")]


def _body(text: str) -> str:
    """The exported arguments without the header comment (which names the plan)."""
    return "".join(line + "\n" for line in text.splitlines() if not line.startswith("#"))


def _reimport(plan, **options):
    exported = export_plan(plan, "megatron")
    imported = import_text("megatron", exported.text, "plan.args", world_size=options.pop("world_size", plan.mesh.size),
                           name=plan.name, **options)
    assert imported.ok, api.render_all(imported.diagnostics, imported.sources)
    return exported, imported


def test_every_stdlib_plan_is_expressible_or_says_what_is_lost():
    assert set(LOST) <= {name for _, name in NAMED}
    for path, name in NAMED:
        plan = stdlib_plan(path, name)
        lost = [d.message.removeprefix("Megatron-LM cannot express ") for d in export_plan(plan, "megatron").lost]
        assert all(d.startswith(tuple(LOST.get(plan.name, ()))) for d in lost) and len(lost) == len(LOST.get(plan.name, ()))
        for expected in LOST.get(plan.name, ()):
            assert any(message.startswith(expected) for message in lost), (plan.name, expected, lost)


@pytest.mark.parametrize("path, name", EXPRESSIBLE)
def test_exported_arguments_match_golden(path, name, golden):
    plan = stdlib_plan(path, name)
    golden(f"interop/megatron/{plan.name}.args", export_plan(plan, "megatron").text)


@pytest.mark.parametrize("path, name", EXPRESSIBLE)
def test_import_of_the_export_is_the_plan(path, name):
    """import(export(plan)) keeps everything Megatron-LM's arguments say: the model (a llama's positions are no
    table: only the training sequence counts), the training settings, each parallelism's degree and kind, the
    mesh order, the layers of every stage and the schedule; the cluster is the launcher's, not Megatron's."""
    plan = stdlib_plan(path, name)
    _, imported = _reimport(plan)
    back = api.select_plan(api.loads(imported.text, path="back.plan"))
    skip = {"name"} | ({"seq"} if plan.model.kind == "llama" else set())
    assert back.model.model_dump(exclude=skip) == plan.model.model_dump(exclude=skip)
    assert back.seq == plan.seq
    # Megatron keeps 16-bit weights (bf16 under FP8) beside its fp32 main params: the plan comes back saying so
    weights = plan.train.precision.unquantized if plan.train.precision is not ir.Precision.fp32 else None
    assert back.train.param_dtype is weights
    assert back.train.model_dump(exclude={"seq", "param_dtype"}) == plan.train.model_dump(exclude={"seq", "param_dtype"})
    assert (back.tp, back.pp, back.cp, back.ep, back.dp) == (plan.tp, plan.pp, plan.cp, plan.ep, plan.dp)
    roles, back_roles = plan.axis_roles(), back.axis_roles()
    order = [roles[a.name] for a in plan.mesh.axes if a.size > 1]
    assert [back_roles[a.name] for a in back.mesh.axes if a.size > 1] == order
    assert (back.data.zero_stage if back.data else 0) == (plan.data.zero_stage if plan.data else 0)
    assert bool(back.tensor and back.tensor.sequence_parallel) == bool(plan.tensor and plan.tensor.sequence_parallel
                                                                       and plan.tp > 1)
    assert (back.context.kind if back.context else None) == (plan.context.kind if plan.context and plan.cp > 1 else None)
    stages, back_stages = assign_stages(plan)[0], assign_stages(back)[0]
    assert [[layer.name for layer in s] for s in back_stages.stage_layers] == \
           [[layer.name for layer in s] for s in stages.stage_layers]
    assert back_stages.rank_of_stage == stages.rank_of_stage
    if plan.pp > 1:
        assert back.schedule.name == (plan.schedule.name if plan.schedule else "1f1b")


@pytest.mark.parametrize("path, name", EXPRESSIBLE)
def test_export_of_the_import_is_the_arguments(path, name):
    exported, imported = _reimport(stdlib_plan(path, name))
    again = export_plan(api.select_plan(api.loads(imported.text, path="back.plan")), "megatron")
    assert not again.lost
    assert _body(again.text) == _body(exported.text)


# A launch script's arrays as Megatron-LM's users write them: other spellings of the same settings
# (layers per virtual stage, an unpadded vocabulary, --recompute-activations, Megatron-FSDP's ZeRO-1), flags
# that mean nothing in a plan, comments and continued lines.
SCRIPT = """\
GPT_MODEL_ARGS=(
    --num-layers 24 --hidden-size 2048 --num-attention-heads 16  # a 1.3B GPT
    --seq-length 2048 --max-position-embeddings 2048 \\
    --vocab-size 50257 --make-vocab-size-divisible-by 128
)
TRAINING_ARGS=(
    --micro-batch-size 2 --global-batch-size 256 --train-iters 500000 --weight-decay 0.1
    --bf16 --recompute-activations --lr 6.0e-4 --lr-decay-style cosine --min-lr 6.0e-5
    --data-path "$DATA_PATH" --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt
)
MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 2 --sequence-parallel
    --pipeline-model-parallel-size 4 --num-layers-per-virtual-pipeline-stage 3
    --use-megatron-fsdp --data-parallel-sharding-strategy optim --ckpt-format fsdp_dtensor
)
"""


def test_a_launch_scripts_arrays_import_and_export_to_the_same_settings():
    imported = import_text("megatron", SCRIPT, "train.sh", world_size=64, name="gpt_1_3b")
    assert imported.ok, api.render_all(imported.diagnostics, imported.sources)
    plan = api.select_plan(api.loads(imported.text, path="gpt.plan"))
    assert (plan.tp, plan.pp, plan.dp, plan.stages.virtual) == (2, 4, 8, 2)
    assert plan.model.vocab == 50432   # 50257 padded to a multiple of 128 x tp(2) (_vocab_size_with_padding)
    assert plan.train.recompute.value == "selective" and plan.data.kind.value == "zero1"
    assert plan.model.tied_embeddings and plan.train.lr_schedule == "cosine"
    assert "--weight-decay 0.1" in imported.ignored and "--data-path $DATA_PATH" in imported.ignored
    flags = _flags(export_plan(plan, "megatron").text)
    for setting in ("--num-virtual-stages-per-pipeline-rank 2", "--padded-vocab-size 50432",
                    "--recompute-granularity selective", "--use-distributed-optimizer", "--sequence-parallel"):
        assert setting in " ".join(flags)
    again = import_text("megatron", export_plan(plan, "megatron").text, "x.args", world_size=64, name="gpt_1_3b")
    assert again.text.split("\n", 2)[2] == imported.text.split("\n", 3)[3]  # the same plan, less the left-out comment


@pytest.mark.parametrize("space", ["\u00a0", "\u2003", "\u3000", "\x0b"])
def test_a_unicode_space_does_not_split_a_word_as_bash_does_not(space):
    """`--lr\u00a00.0005` (a no-break space pasted from a web page) is one word to bash, which Megatron-LM's
    argparse refuses; the import read it as `--lr 0.0005` and wrote a plan with that learning rate."""
    text = SCRIPT.replace("--lr 6.0e-4", f"--lr{space}0.0005")
    assert text != SCRIPT
    imported = import_text("megatron", text, "train.sh", world_size=64, name="gpt_1_3b")
    assert not imported.ok and [d.code for d in imported.diagnostics if d.is_error] == ["E804"]
    assert f"--lr{space}0.0005" in imported.diagnostics[0].message


def test_a_script_saved_with_crlf_line_ends_reads_as_saved_with_lf():
    """A launch script saved with CRLF line ends (edited on Windows): `\\` before `\r\n` was read as an escaped \r,
    one more value of the flag before it (`--num-layers takes one value, found 2`), not as the continuation it is
    with `\n`, where `\r` alone already separates words."""
    crlf = import_text("megatron", SCRIPT.replace("\n", "\r\n"), "train.sh", world_size=64, name="gpt_1_3b")
    lf = import_text("megatron", SCRIPT, "train.sh", world_size=64, name="gpt_1_3b")
    assert "\\\r\n" in SCRIPT.replace("\n", "\r\n") and lf.ok
    assert crlf.ok and crlf.text == lf.text, [d.message for d in crlf.diagnostics]


@pytest.mark.parametrize("stem, name", [("café", "caf_"), ("x\u0663", "x_"), ("3d-run", "d_run"), ("\u00bd", "_")])
def test_an_output_name_outside_ascii_gives_a_plan_name_the_language_reads(tmp_path, stem, name):
    """`import -o café.plan` named the plan `café` (str.isalnum() is Unicode's), which the plan written could not
    parse: E104 unexpected character 'é', nothing written."""
    args = tmp_path / "train.sh"
    args.write_text(SCRIPT)
    out = tmp_path / f"{stem}.plan"
    result = CliRunner().invoke(main, ["import", "--from", "megatron", "--world-size", "64", "--args-file", str(args),
                                       "-o", str(out)])
    assert result.exit_code == 0 and f"plan '{name}'" in result.output, result.output
    assert api.check(str(out), {}).ok


# Published Megatron-LM runs (docs/validation.md's sources): Narayanan et al. 2021 (arXiv:2104.04473) Table 1
# and Table 2 (PTD-P), Korthikanti et al. 2022 (arXiv:2205.05198) Table 3, BigScience's BLOOM, and Megatron-LM's
# own examples/gpt3/train_gpt3_175b_distributed.sh at core_v0.16.1 (TP 8, PP 16, batch 1536, micro-batch 1,
# fp16): (model, world size, global batch, micro batch, tp, pp, extra train keys, extra plan lines, the flags).
PUBLISHED = [
    ("gpt(layers=96, hidden=12288, heads=96, seq=2048, vocab=51200)", 1024, 1536, 1, 8, 16, "precision: fp16", "",
     "--num-layers 96 --hidden-size 12288 --num-attention-heads 96 --seq-length 2048 --max-position-embeddings 2048 "
     "--micro-batch-size 1 --global-batch-size 1536 --fp16 --tensor-model-parallel-size 8 "
     "--pipeline-model-parallel-size 16"),
    ("gpt(layers=48, hidden=8192, heads=64, seq=2048, vocab=51200)", 512, 1536, 1, 8, 2, "recompute: full",
     "stages = evenly over pp with virtual = 2\n  schedule = interleaved_1f1b", "--num-layers 48 --tensor-model-parallel-size 8 --pipeline-model-parallel-size 2 "
     "--num-virtual-stages-per-pipeline-rank 2 --global-batch-size 1536"),
    # Megatron-LM's pipeline: torch's stage buffers, a receive buffer for each of 512 microbatches a rank, would not fit 80 GB
    ("gpt(layers=128, hidden=25600, heads=160, seq=2048, vocab=51200)", 3072, 3072, 1, 8, 64, "recompute: full",
     "stages = evenly over pp with implementation = megatron",
     "--num-layers 128 --hidden-size 25600 --num-attention-heads 160 --tensor-model-parallel-size 8 "
     "--pipeline-model-parallel-size 64 --global-batch-size 3072"),
    ("gpt(layers=96, hidden=12288, heads=96, seq=2048, vocab=51200)", 1536, 1536, 1, 8, 12, "recompute: full",
     "stages = evenly over pp with virtual = 2\n  schedule = interleaved_1f1b", "--tensor-model-parallel-size 8 --pipeline-model-parallel-size 12 "
     "--num-virtual-stages-per-pipeline-rank 2 --global-batch-size 1536 --micro-batch-size 1"),
    ("gpt(layers=96, hidden=12288, heads=96, seq=2048, vocab=51200)", 64, 64, 1, 8, 8, "recompute: selective",
     "tensor = megatron over tp with sequence_parallel", "--tensor-model-parallel-size 8 --sequence-parallel "
     "--pipeline-model-parallel-size 8 --recompute-granularity selective --global-batch-size 64"),
    # BLOOM's 16-bit weights (Megatron-DeepSpeed's bf16 parameters beside the optimizer's fp32 master): fp32 ones
    # under autocast would also hold a bf16 copy of each, which pipeline rank 1 does not fit beside torch's buffers;
    # and Megatron's layers (its vocabulary-parallel embedding makes its rows' gradient: torch's makes a 13.4 GiB
    # fp32 one over BLOOM's 250,880 words, which rank 0 does not fit, `cost.memory.whole_vocab_gradient_bytes`)
    ("gpt(layers=70, hidden=14336, heads=112, seq=2048, vocab=250880)", 384, 2048, 2, 4, 12,
     "recompute: full, param_dtype: bf16",
     "data = zero1 over dp\n  tensor = megatron over tp with implementation = megatron\n  stages = evenly over pp", "--tensor-model-parallel-size 4 --pipeline-model-parallel-size 12 "
     "--micro-batch-size 2 --global-batch-size 2048 --use-distributed-optimizer --pipeline-model-parallel-layout "
     "Et*6|t*6|t*6|t*6|t*6|t*6|t*6|t*6|t*6|t*6|t*5|t*5L"),
]


@pytest.mark.parametrize("model, world, batch, micro, tp, pp, train, extra, flags", PUBLISHED,
                         ids=["megatron-example-175b", "table1-39b", "table1-1t", "table2-175b", "sp-selective-175b",
                              "bloom-176b"])
def test_published_configurations_export_to_the_flags_those_runs_used(model, world, batch, micro, tp, pp, train,
                                                                      extra, flags):
    dp = world // (tp * pp)
    text = f"""import "clusters/dgx_a100"
plan run {{
  model   = {model}
  cluster = dgx_a100 x {world // 8}
  mesh    = [pp = {pp}, dp = {dp}, tp = {tp}]
  train   = {{ global_batch: {batch}, micro_batch: {micro}, {train} }}
  {extra}
}}
"""
    plan = api.select_plan(api.loads(text, path="run.plan"))
    exported = export_plan(plan, "megatron")
    assert not exported.lost
    assert f"# {world} processes;" in exported.text
    written = " ".join(_flags(exported.text))
    for flag, value in re.findall(r"(--[a-z0-9-]+)(?: ([^-][^ ]*))?", flags):
        assert (f"{flag} {value}" if value else flag) in written, f"{flag} {value}"
    assert "--use-tp-pp-dp-mapping" not in written  # pp outermost: Megatron's default order


# ---- bad flags: the offending flag named, never a traceback ----------------------------------------------------
BASE = ("--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 128 --max-position-embeddings 128 "
        "--padded-vocab-size 1024 --micro-batch-size 1 --global-batch-size 16")
BAD = [
    ("--tensor-model-paralel-size 2", "E804", "--tensor-model-paralel-size"),
    ("--tensor-model-parallel-size two", "E804", "two"),
    ("--fp16 yes", "E804", "yes"),
    ("--cp-comm-type allgather --context-parallel-size 2", "E804", "allgather"),
    ("--recompute-granularity full", "E804", "--recompute-granularity"),
    ("--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1 "
     "--num-virtual-stages-per-pipeline-rank 2", "E805", "--num-virtual-stages-per-pipeline-rank"),
    ("--bf16 --fp16", "E805", "--fp16"),
    ("--micro-batch-size 2", "E805", "--micro-batch-size"),
    ("--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout Et|t|tL", "E805",
     "--pipeline-model-parallel-layout"),
    ("--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads", "E805", "--use-megatron-fsdp"),
    ("--pipeline-model-parallel-size 3", "E806", "--pipeline-model-parallel-size"),
    ("--context-parallel-size 3", "E806", "--context-parallel-size"),
    ("--tensor-model-parallel-size 2 --tensor-model-parallel-size 4", "E805", "--tensor-model-parallel-size 4"),
    ("--recompute-granularity full --recompute-method uniform --recompute-num-layers 2", "E807", "--recompute-method"),
    ("--swiglu", "E807", "--swiglu"),
    ("--expert-tensor-parallel-size 2 --tensor-model-parallel-size 1", "E807", "--expert-tensor-parallel-size"),
    ("--tensor-model-parallel-size 2 --tp-comm-overlap", "E805", "--tp-comm-overlap"),
    ("--tp-comm-overlap", "E805", "--tp-comm-overlap"),
    # interleaved 1F1B's microbatch group: 4 microbatches on 2 ranks; Megatron takes 2 to 4, plandsl runs torch's 2
    ("--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 "
     "--microbatch-group-size-per-virtual-pipeline-stage 8", "E805", "--microbatch-group-size-per-virtual-pipeline-stage"),
    ("--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 "
     "--microbatch-group-size-per-virtual-pipeline-stage 4", "E807", "--microbatch-group-size-per-virtual-pipeline-stage"),
    # hostile numbers: an Arabic-Indic 2 read as 2; 5,001 digits were int()'s own words (a usage error, exit 2)
    ("--tensor-model-parallel-size \u0662", "E804", "\u0662"),
    ("--seed 1" + "0" * 5000, "E804", "1" + "0" * 5000),
    ("--window-size 1" + "0" * 5000 + ",0", "E804", "--window-size"),
    # a layout unrolled to 10^11 characters (MemoryError, E108) or 9 x 10^9 (4 GB, then E108)
    ("--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout Et*99999999999|L", "E805",
     "--pipeline-model-parallel-layout"),
    ("--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout (Et*99999|)*99999L", "E805",
     "--pipeline-model-parallel-layout"),
]


@pytest.mark.parametrize("extra, code, shown", BAD, ids=[f"{c}:{e[:40]}" for e, c, _ in BAD])
def test_bad_flags_are_diagnostics_naming_the_flag(extra, code, shown):
    text = f"{BASE} {extra}\n"
    imported = import_text("megatron", text, "flags", world_size=8)
    assert not imported.ok
    assert [d.code for d in imported.diagnostics] == [code]
    span = imported.diagnostics[0].span
    assert span.end > span.start and text[span.start:].startswith(shown), (text[span.start:span.end], shown)


def test_more_layers_than_plandsl_takes_stop_before_their_patterns_are_walked():
    """--num-layers 10^18 with a window pattern walked every block before the plan's E505 (a hang, 600 MB)."""
    text = BASE.replace("--num-layers 4", "--num-layers 1000000000000000000") + " --window-size 7,0 " \
        "--window-attn-skip-freq 2\n"
    with bounded(5, "import"):
        imported = import_text("megatron", text, "flags", world_size=8)
    assert [d.code for d in imported.diagnostics] == ["E505"] and "--num-layers must be at most 100,000" in \
        imported.diagnostics[0].message


@pytest.mark.parametrize("flag", ["--num-layers-at-start-in-bf16", "--num-layers-at-end-in-bf16"])
def test_bf16_layer_counts_say_they_take_zero_or_more(flag):
    """0 is accepted (no block kept in bf16 at that end), so E804 says so rather than "a positive integer"."""
    text = f"{BASE} --bf16 --fp8-format hybrid --fp8-recipe tensorwise --first-last-layers-bf16 {flag} one\n"
    imported = import_text("megatron", text, "flags", world_size=8, cluster="dgx_h100 x 1")
    assert [d.code for d in imported.diagnostics] == ["E804"]
    assert imported.diagnostics[0].message == f"{flag} takes an integer of zero or more, found `one`"
    zero = import_text("megatron", text.replace(" one\n", " 0\n"), "flags", world_size=8, cluster="dgx_h100 x 1")
    assert zero.ok, [str(d) for d in zero.diagnostics]
    assert import_text("megatron", f"{BASE} --num-layers 0\n", "flags", world_size=8).diagnostics[0].message == \
        "--num-layers takes a positive integer, found `0`"


def test_missing_required_flags_are_named_together():
    text = BASE.replace("--max-position-embeddings 128 ", "").replace("--padded-vocab-size 1024 ", "") + "\n"
    imported = import_text("megatron", text, "flags", world_size=8)
    assert [d.code for d in imported.diagnostics] == ["E804"]
    assert "missing --max-position-embeddings, --padded-vocab-size" in imported.diagnostics[0].message


def test_a_plan_the_checker_refuses_comes_back_as_the_checkers_diagnostics():
    imported = import_text("megatron", BASE.replace("16", "12") + "\n", "flags", world_size=8)
    assert [d.code for d in imported.diagnostics] == ["E501"] and imported.text is None
    assert imported.diagnostics[0].span.file == "imported.plan"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(["--num-layers", "--tensor-model-parallel-size", "--pipeline-model-parallel-layout",
                                 "--fp16", "--swiglu", "--cp-comm-type", "--context-parallel-size", "4", "0", "x",
                                 "'Et|tL'", '"', "(", ")", "\\\n", "#", "--", "=", "E|t*3|L", "--num-experts=2"]),
                max_size=12))
def test_no_flags_raise(words):
    imported = import_text("megatron", BASE + " " + " ".join(words) + "\n", "flags", world_size=8)
    assert imported.ok or imported.diagnostics


# ---- the CLI -------------------------------------------------------------------------------------------------------
def test_cli_exports_and_imports_back(tmp_path):
    runner = CliRunner()
    plan = ROOT / "stdlib_plans" / "examples" / "gpt3_175b_3d.plan"
    args = tmp_path / "gpt3.args"
    result = runner.invoke(main, ["export", str(plan), "--to", "megatron", "-o", str(args)])
    assert result.exit_code == 0, result.output
    result = runner.invoke(main, ["import", "--from", "megatron", "--world-size", "1024", "--args-file", str(args),
                                  "-o", str(tmp_path / "gpt3.plan")])
    assert result.exit_code == 0, result.output
    assert "plan gpt3 {" in (tmp_path / "gpt3.plan").read_text()
    assert runner.invoke(main, ["check", str(tmp_path / "gpt3.plan")]).exit_code == 0
    result = runner.invoke(main, ["import", "--from", "megatron", "--cluster", "dgx_a100 x 2", "-o",
                                  str(tmp_path / "small.plan"), "--", *BASE.split()])
    assert result.exit_code == 0, result.output
    assert "cluster = dgx_a100 x 2" in (tmp_path / "small.plan").read_text()


def test_cli_refuses_a_lossy_export_unless_asked(tmp_path):
    runner = CliRunner()
    plan = ROOT / "stdlib_plans" / "examples" / "zero_bubble_v.plan"
    out = tmp_path / "zbv.args"
    result = runner.invoke(main, ["export", str(plan), "--to", "megatron", "-o", str(out)])
    assert result.exit_code == 1 and not out.exists()
    assert "error[E808]" in result.output and "schedule = zbv" in result.output
    result = runner.invoke(main, ["export", str(plan), "--to", "megatron", "-o", str(out), "--lossy"])
    assert result.exit_code == 0 and out.exists()
    assert "lost: Megatron-LM cannot express schedule = zbv" in result.output


def test_cli_import_names_the_flag_and_writes_nothing(tmp_path):
    out = tmp_path / "x.plan"
    result = CliRunner().invoke(main, ["import", "--from", "megatron", "--world-size", "8", "-o", str(out), "--",
                                       *BASE.split(), "--tensor-model-paralel-size", "2"])
    assert result.exit_code == 1 and not out.exists()
    assert "<flags>:1:" in result.output and "error[E804]: unknown flag --tensor-model-paralel-size" in result.output
    assert "did you mean '--tensor-model-parallel-size'" in result.output


def test_cli_import_json_diagnostics_and_a_cluster_too_small(tmp_path):
    runner = CliRunner()
    result = runner.invoke(main, ["import", "--from", "megatron", "--world-size", "8", "--format", "json", "-o",
                                  str(tmp_path / "x.plan"), "--", *BASE.split(), "--fp16", "--bf16"])
    assert result.exit_code == 1
    (line,) = result.stdout.strip().splitlines()
    assert '"code": "E805"' in line and '"file": "<flags>"' in line
    result = runner.invoke(main, ["import", "--from", "megatron", "--world-size", "16", "--cluster", "dgx_a100 x 1",
                                  "-o", str(tmp_path / "x.plan"), "--", *BASE.split()])
    assert result.exit_code == 1 and "error[E301]" in result.output and not (tmp_path / "x.plan").exists()


@pytest.mark.parametrize("args, message", [
    (["-o", "x.plan", "--", "--num-layers", "4"], "--world-size N or --cluster"),
    (["--world-size", "8", "-o", "x.plan"], "after `--`, or --args-file"),
    (["--cluster", "dgx_a1000 x 2", "-o", "x.plan", "--", "--num-layers", "4"], "unknown name 'dgx_a1000'"),
])
def test_cli_import_usage_errors(tmp_path, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["import", "--from", "megatron", *args])
    assert result.exit_code == 2 and message in result.output, result.output


# ---- docs/interop.md: its commands run, and print and write what it shows ---------------------------------------
def test_the_interop_doc_commands_run_as_shown(tmp_path, monkeypatch):
    doc = (ROOT / "docs" / "interop.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```(\w+)\n(.*?)```", doc, re.S)
    (_, script), (_, commands), (_, plan), (_, exported) = blocks[:4]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train_args.sh").write_text(script, encoding="utf-8")
    runner = CliRunner()
    for line in commands.strip().splitlines():
        words = shlex.split(line)
        assert words[0] == "plandsl"
        result = runner.invoke(main, words[1:])
        assert result.exit_code == 0, f"{line}\n{result.output}"
    assert (tmp_path / "llama3_8b.plan").read_text(encoding="utf-8") == plan
    assert (tmp_path / "llama3_8b.args").read_text(encoding="utf-8") == exported
    assert "<svg" in (tmp_path / "llama3_8b.html").read_text(encoding="utf-8")  # the rendered report
    refused = next(text for language, text in blocks if text.startswith("$ plandsl export"))
    command, *shown = refused.splitlines()
    monkeypatch.chdir(ROOT)
    result = runner.invoke(main, shlex.split(command)[2:])
    assert result.exit_code == 1 and not (ROOT / "zbv.args").exists()
    assert result.output.splitlines()[:len(shown) - 1] == shown[:-1] and shown[-1] == "..."
    (_, config), (_, commands), (_, plan), (_, exported) = blocks[5:9]  # the DeepSpeed section
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ds_config.json").write_text(config, encoding="utf-8")
    for line in commands.strip().splitlines():
        result = runner.invoke(main, shlex.split(line)[1:])
        assert result.exit_code == 0, f"{line}\n{result.output}"
    assert (tmp_path / "llama2_7b_zero3.plan").read_text(encoding="utf-8") == plan
    assert (tmp_path / "ds_config_back.json").read_text(encoding="utf-8") == exported
    # improve the imported run with the search, diff the two, export the result (llama3_8b.plan is here)
    partial = next(text for language, text in blocks if text.startswith("# llama3_8b.plan's model"))
    commands = next(text for language, text in blocks if text.startswith("plandsl generate --from"))
    shown = next(text for language, text in blocks if text.startswith("plan 'llama3_8b' (llama3_8b.plan) ->"))
    (tmp_path / "llama3_8b_partial.plan").write_text(partial, encoding="utf-8")
    outputs = []
    for line in commands.strip().splitlines():
        result = runner.invoke(main, shlex.split(line)[1:])
        assert result.exit_code == 0, f"{line}\n{result.output}"
        outputs.append(result.output)
    assert outputs[1] == shown
    assert "--use-megatron-fsdp" in (tmp_path / "llama3_8b_generated.args").read_text(encoding="utf-8")
    # and submit it to Slurm or Kubernetes: TorchX's dry runs (no `sinfo` on the PATH: TorchX assumes Slurm 24.05)
    if importlib.util.find_spec("torchx") is None:
        pytest.skip("TorchX is not installed (pip install 'plandsl[launch]'): the walkthrough's last step not run")
    launches = next(text for language, text in blocks if text.startswith("plandsl launch"))
    script = next(text for language, text in blocks if text.startswith("sbatch --parsable"))
    monkeypatch.setenv("PATH", str(tmp_path))
    outputs = []
    for line in launches.strip().splitlines():
        result = runner.invoke(main, shlex.split(line)[1:])
        assert result.exit_code == 0, f"{line}\n{result.output}"
        words = " ".join(result.stdout.split())  # the YAML folds long lines
        assert words.count("--nnodes 8 --nproc_per_node 8") == 8, result.stdout
        assert words.count("-m plandsl.run llama3_8b_generated.plan --steps 100000") == 8, result.stdout
        outputs.append(result.stdout)
    *lines, more = script.splitlines()
    assert outputs[0].splitlines()[:len(lines)] == lines and more == "..."
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in outputs[0] + outputs[1]


def test_an_uneven_layout_imports_as_the_stage_ranges_a_plan_writes():
    text = (BASE.replace("--num-layers 4", "--num-layers 80") + " --pipeline-model-parallel-size 8 "
            "--pipeline-model-parallel-layout 'Et*9|t*11|t*11|t*11|t*10|t*10|t*10|t*8L'\n")
    imported = import_text("megatron", text, "flags", world_size=8)
    assert imported.ok, api.render_all(imported.diagnostics, imported.sources)
    assert "0:    embed, layers[0:9]\n    1..7: layers[9:72]\n    7:    layers[72:80], norm, head\n" in imported.text


@pytest.mark.parametrize("backend, materialized", [("unfused", True), ("local", True), ("flash", False),
                                                   ("fused", False), ("auto", False), (None, False)])
def test_the_attention_backend_is_the_plans_attention_both_ways(backend, materialized):
    text = f"{BASE}{f' --attention-backend {backend}' if backend else ''}\n"
    imported = import_text("megatron", text, "flags", world_size=8)
    assert imported.ok, imported.diagnostics
    assert ("attention: materialized" in imported.text) == materialized
    plan = api.select_plan(api.loads(imported.text, path="imported.plan"))
    exported = export_plan(plan, "megatron")
    assert not exported.lost
    assert ("--attention-backend unfused" in exported.text) == materialized
    back = import_text("megatron", exported.text, "flags", world_size=8)
    assert back.ok and ("attention: materialized" in back.text) == materialized


def test_tp_comm_overlap_is_the_plans_tensor_overlap_both_ways():
    """--tp-comm-overlap (Transformer Engine's userbuffers) is `tensor = megatron over tp with sequence_parallel,
    overlap = userbuffers`, and the plan exports it back; without --sequence-parallel Megatron-LM refuses it (E805,
    above)."""
    text = f"{BASE} --tensor-model-parallel-size 2 --sequence-parallel --tp-comm-overlap\n"
    imported = import_text("megatron", text, "flags", world_size=8)
    assert imported.ok, imported.diagnostics
    assert "megatron over tp with sequence_parallel, overlap = userbuffers\n" in imported.text
    plan = api.select_plan(api.loads(imported.text, path="imported.plan"))
    exported = export_plan(plan, "megatron")
    assert not exported.lost and "--sequence-parallel" in exported.text and "--tp-comm-overlap" in exported.text
    plain = import_text("megatron", text.replace(" --tp-comm-overlap", ""), "flags", world_size=8)
    assert "overlap" not in plain.text and "--tp-comm-overlap" not in export_plan(
        api.select_plan(api.loads(plain.text, path="plain.plan")), "megatron").text
    # a launch script's userbuffers configuration file (per-layer SM counts) is no plan's: named as left out, the
    # overlap priced at Transformer Engine's defaults, the import not refused
    configured = import_text("megatron", text.replace("--tp-comm-overlap", "--tp-comm-overlap --tp-comm-overlap-cfg "
                                                      "ub.yaml"), "flags", world_size=8)
    assert configured.ok and "overlap = userbuffers" in configured.text
    assert "# Left out (a plan does not hold them): --tp-comm-overlap-cfg ub.yaml" in configured.text


@pytest.mark.parametrize("flags, loss", [(" --cross-entropy-loss-fusion", "standard"), ("", "megatron"),
                                         (" --cross-entropy-loss-fusion --cross-entropy-fusion-impl te", "fused"),
                                         (" --cross-entropy-fusion-impl te", "megatron")])
def test_the_cross_entropy_fusion_flags_are_the_plans_loss_both_ways(flags, loss):
    """Without --cross-entropy-loss-fusion Megatron-LM runs its own cross entropy op by op (`loss: megatron`; the impl
    flag alone changes nothing, language_module.py:140-167 at core_v0.16.1); with it, the native impl's jit-fused steps
    over the same fp32 copy, which the adapters spell `standard` (the nearest: the same copy kept, none of torch's fp32
    temporaries made; a plan's default loss exports), and `--cross-entropy-fusion-impl te` Transformer Engine's cross
    entropy, which writes the gradient over the 16-bit logits (`fused`)."""
    imported = import_text("megatron", f"{BASE}{flags}\n", "flags", world_size=8)
    assert imported.ok, imported.diagnostics
    plan = api.select_plan(api.loads(imported.text, path="imported.plan"))
    assert plan.train.loss.value == loss
    exported = export_plan(plan, "megatron")
    assert not exported.lost and ("--cross-entropy-loss-fusion" in exported.text) == (loss != "megatron")
    assert ("--cross-entropy-fusion-impl te" in exported.text) == (loss == "fused")
    back = import_text("megatron", exported.text, "flags", world_size=8)
    assert api.select_plan(api.loads(back.text, path="back.plan")).train.loss.value == loss


def test_eager_kernels_are_what_megatron_cannot_run():
    imported = import_text("megatron", BASE + "\n", "flags", world_size=8)
    text = imported.text.replace("precision: ", "kernels: eager, precision: ", 1)
    plan = api.select_plan(api.loads(text, path="eager.plan"))
    lost = export_plan(plan, "megatron").lost
    assert [d.code for d in lost] == ["E808"] and "kernels: eager" in lost[0].message


@pytest.mark.parametrize("channels", ["--kv-channels 16", ""])
def test_a_head_width_that_is_not_hidden_over_heads_is_written_even_when_it_is_the_floor(channels):
    """--hidden-size 100 --num-attention-heads 6: Megatron's heads are 16 wide (--kv-channels, or the floor
    validate_args takes), which hidden / heads does not say; the import came back without head_dim and the
    checker refused the plan (E220)."""
    llama = ("--num-layers 2 --hidden-size 100 --num-attention-heads 6 --seq-length 128 --max-position-embeddings 128 "
             "--padded-vocab-size 1024 --micro-batch-size 1 --global-batch-size 16 --normalization RMSNorm --swiglu "
             "--position-embedding-type rope --disable-bias-linear --ffn-hidden-size 256")
    imported = import_text("megatron", f"{llama} {channels}\n", "flags", world_size=8)
    assert imported.ok, imported.diagnostics
    plan = api.select_plan(api.loads(imported.text, path="imported.plan"))
    assert plan.model.head_dim == 16 and plan.model.head_width == 16


def test_megatron_runs_no_async_tp_and_no_margin_by_flag():
    """torch's async TP (`overlap`, `overlap = async_tp`) is no Megatron-LM flag: E808, and no --tp-comm-overlap
    written for it (Megatron would run userbuffers, priced otherwise); userbuffers without its SM margin lives in
    --tp-comm-overlap-cfg's YAML: the flag is written, the margin is E808."""
    text = f"{BASE} --tensor-model-parallel-size 2 --sequence-parallel --tp-comm-overlap\n"
    source = import_text("megatron", text, "flags", world_size=8).text
    for written, flag, lost in (("overlap", False, "overlap = async_tp"), ("overlap = async_tp", False, "async_tp"),
                                ("overlap = userbuffers, sm_margin = false", True, "sm_margin = false")):
        plan = api.select_plan(api.loads(source.replace("overlap = userbuffers", written), path="p.plan"))
        exported = export_plan(plan, "megatron")
        assert ("--tp-comm-overlap" in exported.text) == flag, written
        assert [d.code for d in exported.lost] == ["E808"] and lost in exported.lost[0].message, exported.lost


def test_interleaved_microbatches_not_a_multiple_of_pp_round_trip_with_megatrons_group():
    """12 microbatches over 8 ranks of 2 virtual stages: the export says Megatron-LM's group per virtual stage, 12
    (torch's one round, what the plan lays out), the import reads it back to the same plan, and without it Megatron's
    default group, pp, leaves a last group of 4 < pp, which its interleaved schedule refuses: E805."""
    text = """import "clusters/dgx_a100"
plan p {
  model    = gpt(layers=16, hidden=1024, heads=16, seq=1024, vocab=51200)
  cluster  = dgx_a100 x 2
  mesh     = [dp = 2, pp = 8]
  train    = { global_batch: 24, micro_batch: 1 }
  stages   = evenly over pp with virtual = 2, implementation = megatron
  schedule = interleaved_1f1b
}
"""
    plan = api.select_plan(api.loads(text, path="p.plan"))
    exported = export_plan(plan, "megatron")
    assert not exported.lost and "--microbatch-group-size-per-virtual-pipeline-stage 12" in exported.text
    back = import_text("megatron", exported.text, "plan.args", world_size=16, cluster="dgx_a100 x 2")
    assert back.ok, back.diagnostics
    again = api.select_plan(api.loads(back.text, path="back.plan"))
    assert (again.num_microbatches, again.stages.virtual, again.schedule.name) == (12, 2, "interleaved_1f1b")
    plain = import_text("megatron", exported.text.replace("--microbatch-group-size-per-virtual-pipeline-stage 12", ""),
                        "plan.args", world_size=16, cluster="dgx_a100 x 2")
    assert [d.code for d in plain.diagnostics] == ["E805"] and "last group" in plain.diagnostics[0].message


def test_a_seed_megatron_cannot_give_numpy_is_lost():
    """Megatron-LM seeds numpy with --seed plus 100 per pipeline rank (`_set_random_seed`), and numpy takes less than
    2^32: a plan's seed past that (plandsl's go to 2^64 - 1) was written as --seed and stopped Megatron before its
    first step; now it is an E808, and the largest seed it takes is written as it is."""
    imported = import_text("megatron", BASE + " --pipeline-model-parallel-size 2\n", "flags", world_size=8)
    plan = api.select_plan(api.loads(imported.text, path="seed.plan"))
    assert plan.pp == 2
    most = 2**32 - 1 - 100 * (plan.pp - 1)
    for seed, lost in ((most, False), (most + 1, True)):
        exported = export_plan(plan.model_copy(update={"train": plan.train.model_copy(update={"seed": seed})}),
                               "megatron")
        assert bool(exported.lost) == lost and (not lost or "seed" in exported.lost[0].message)
