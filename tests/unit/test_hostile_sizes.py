"""Huge numbers in every field: work follows what was written, not the numbers in it.

Each case ends in a diagnostic (E505 past a documented cap in plandsl/diagnostics/limits.py, E609 for a
schedule table too large to lay out) or in a correct answer, within 10 s, never a traceback.
The bounded analysis of built-in schedules (`schedules.bounded`) is compared with the full
simulation for every built-in, ranks and virtual in a small grid, under unit and random
per-stage costs: around where the extrapolation starts and well past it (4 ranks in the slow tier),
and (slow tier) every microbatch count up to 300.
"""
from __future__ import annotations

import json
import math
import random
import re
import subprocess
from pathlib import Path

import pytest

from plandsl.diagnostics import PlanError, limits
from plandsl.check.analysis import analyze
from plandsl.diagnostics.codes import CODES
from plandsl.schedules.bounded import WARMUP_PERIODS, extrapolated_past, simulate_builtin
from plandsl.schedules.generators import check_sizes, generate
from plandsl.schedules.registry import BUILTIN
from plandsl.schedules.simulate import Costs, simulate
from support import VALID_PLAN, bounded, cli_in_process

ROOT = Path(__file__).resolve().parents[2]
LIMIT_S = 10.0
HUGE = "1" + "0" * 18  # 10^18: past every cap, still a legal literal


def analyzed(text: str, *codes: str):
    """analyze(text) within LIMIT_S of CPU, with one of `codes` among its errors (none: no error)."""
    with bounded(LIMIT_S, "analyze"):
        analysis = analyze(text=text)
    assert all(d.code in CODES for d in analysis.diagnostics)
    found = {d.code for d in analysis.errors}
    if codes:
        assert found & set(codes), [(d.code, d.message) for d in analysis.errors]
    else:
        assert not found, [(d.code, d.message) for d in analysis.errors]
    return analysis


def cli(*args: str) -> subprocess.CompletedProcess:
    """The command run from the repository's root, in this process (a real process adds only its start)."""
    with bounded(LIMIT_S + 5, "the CLI (its imports included)"):
        result = cli_in_process(*args, cwd=ROOT)
    assert "Traceback" not in result.stderr + result.stdout, result.stderr[-3000:]
    return result


# ---- every field of a plan ----------------------------------------------------------------------
FIELDS = {  # what to replace in VALID_PLAN -> with a huge number; the code expected
    "global_batch": ("global_batch: 64", f"global_batch: {HUGE}", "E505"),
    "micro_batch": ("micro_batch: 2", f"micro_batch: {HUGE}", "E505"),
    "train seq": ("recompute: selective", f"recompute: selective, seq: {HUGE}", "E505"),
    "warmup_steps": ("recompute: selective", f"recompute: selective, warmup_steps: {HUGE}", "E505"),
    "layers": ("layers=8", f"layers={HUGE}", "E505"),
    "hidden": ("hidden=1024", f"hidden={HUGE}", "E505"),
    "heads": ("heads=16", f"heads={HUGE}", "E505"),
    "model seq": ("seq=1024", f"seq={HUGE}", "E505"),
    "vocab": ("vocab=50304", f"vocab={HUGE}", "E505"),
    "virtual": ("stages  = evenly over pp", f"stages  = evenly over pp with virtual = {HUGE}", "E505"),
    "mesh dp": ("[dp = nodes * 8 / 4,", f"[dp = {HUGE},", "E301"),
    "mesh pp": ("pp = 2, tp = 2]", f"pp = {HUGE}, tp = 2]", "E301"),
    "nodes": ("param nodes = 2", f"param nodes = {HUGE}", "E205"),
    # the model families' later arguments and training counts (mtp's depths were walked one by one: a hang)
    **{arg: ("vocab=50304)", f"vocab=50304, {arg}={HUGE}{extra})", "E505") for arg, extra in (
        ("ffn", ""), ("experts", ""), ("top_k", ", experts=8"), ("shared_experts", ", experts=8"),
        ("dense_layers", ", experts=8"), ("dense_ffn", ", experts=8, dense_layers=1"), ("moe_every", ", experts=8"),
        ("moe_offset", ", experts=8, moe_every=2"), ("window", ""), ("full_every", ", window=128"), ("mtp", ""),
        ("kv_lora_rank", ""), ("q_lora_rank", ", kv_lora_rank=64"), ("v_head_dim", ", kv_lora_rank=64"))},
    "recompute_layers": ("recompute: selective", f"recompute: full, recompute_layers: {HUGE}", "E505"),
    "offload_layers": ("recompute: selective", f"offload_layers: {HUGE}", "E505"),
    "bf16_last_layers": ("precision: bf16, recompute: selective", f"precision: fp8, bf16_last_layers: {HUGE}", "E505"),
    # a seed past 2^64 - 1 (here 10^20) checked, then `run` failed at step 1 (torch's generators take 64 bits)
    "seed": ("recompute: selective", f"recompute: selective, seed: {HUGE}00", "E505"),
}


@pytest.mark.parametrize("field", list(FIELDS))
def test_huge_number_in_every_field(field):
    old, new, code = FIELDS[field]
    plan = VALID_PLAN.replace("gpt(", "llama(") if "vocab=50304," in new else VALID_PLAN  # llama takes them all
    assert old in plan
    analysis = analyzed(plan.replace(old, new, 1), code)
    if code == "E505":
        assert any(f"{HUGE[:4]}" in d.message.replace(",", "") for d in analysis.errors)


def test_a_seed_at_its_cap_draws_every_step():
    """`seed: 18446744073709551615` (2^64 - 1) checked, and `plandsl run` failed at its first batch: the data seeds its
    generator with seed * 1,000,003 + step, past torch's 64 bits ("Overflow when unpacking long long")."""
    pytest.importorskip("torch")
    from plandsl import api
    from plandsl.runtime.data import Batches
    text = VALID_PLAN.replace("recompute: selective", f"recompute: selective, seed: {limits.MAX_SEED}")
    analyzed(text)
    plan = api.loads(text).plans[0]
    for step in (0, limits.MAX_STEPS):
        Batches(plan)._generator(step)
    analyzed(text.replace(f"seed: {limits.MAX_SEED}", f"seed: {limits.MAX_SEED + 1}"), "E505")


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_an_lr_at_its_cap_steps_fp16_weights(optimizer):
    """`lr: 1e39` (an `import --from megatron --lr 1e308` wrote one) checked, and `plandsl run` failed at the first
    optimizer step: torch converts lr to the update's dtype ("value cannot be converted to type float without
    overflow"). The cap is E505, far inside that; at it, the optimizer the plan builds steps even fp16 weights (which
    `run`'s own optimizers widen to fp32) to finite values. The message says the number written, not one rounded to
    the cap."""
    torch = pytest.importorskip("torch")
    from plandsl import api
    from plandsl.runtime.optim import build_optimizer
    text = VALID_PLAN.replace("precision: bf16, recompute: selective",
                              f"precision: fp16, recompute: selective, lr: {limits.MAX_LR}, optimizer: {optimizer}")
    analyzed(text)
    plan = api.loads(text).plans[0]
    weight = torch.nn.Parameter(torch.zeros(4, dtype=torch.float16))
    weight.grad = torch.full((4,), 1e-3, dtype=torch.float16)
    build_optimizer(plan, [weight]).step()
    assert torch.isfinite(weight).all() and weight.abs().max() > 0
    analyzed(text.replace(f"lr: {limits.MAX_LR}", "lr: 3e38"), "E505")
    over = analyzed(text.replace(f"lr: {limits.MAX_LR}", "lr: 10000.000001"), "E505")
    assert "found 10,000.000001" in next(d.message for d in over.errors if d.code == "E505")


def test_caps_are_answered_at_the_cap_not_below():
    """The largest allowed value is accepted by the lowering; one more is E505."""
    at = VALID_PLAN.replace("global_batch: 64", f"global_batch: {limits.MAX_GLOBAL_BATCH}")
    # 2^32 sequences: 2^29 microbatches, checked without laying the schedule out, on Megatron-LM's pipeline (torch's
    # stages would keep a receive buffer for each: E503)
    analyzed(at.replace("stages  = evenly over pp", "stages  = evenly over pp with implementation = megatron"))
    past = VALID_PLAN.replace("global_batch: 64", f"global_batch: {limits.MAX_GLOBAL_BATCH + 1}")
    analyzed(past, "E505")


def test_huge_param_from_the_command_line(tmp_path):
    path = tmp_path / "p.plan"
    path.write_text(VALID_PLAN)
    result = cli("check", str(path), "--param", f"nodes={HUGE}")
    assert result.returncode == 1 and "error[" in result.stdout + result.stderr


# ---- the schedule of a plan: any microbatch count checks in bounded work ---------------------
FOUR_M = VALID_PLAN.replace("global_batch: 64", f"global_batch: {4 * 2**20 * 4 * 2}")  # dp 4, micro_batch 2
# torch's pipeline stages keep a receive buffer for each of 4M microbatches (E503): Megatron-LM's pipeline, which
# runs 1f1b and interleaved_1f1b, does not
FOUR_M_TORCH = FOUR_M
FOUR_M = FOUR_M.replace("stages  = evenly over pp", "stages  = evenly over pp with implementation = megatron")


@pytest.mark.parametrize("schedule, stages", [
    ("1f1b", "evenly over pp"), ("gpipe", "evenly over pp"), ("zb_h1", "evenly over pp"),
    ("interleaved_1f1b", "evenly over pp with virtual = 2"), ("zbv", "evenly over pp with virtual = 2, map = vshape"),
    ("interleaved_zero_bubble", "evenly over pp with virtual = 2")])
def test_four_million_microbatches_check_and_estimate(schedule, stages):
    from plandsl.cost.estimate import estimate_plan
    megatron = schedule in ("1f1b", "interleaved_1f1b")  # the others only torch's pipeline runs
    stages += (", " if "with" in stages else " with ") + "implementation = megatron" if megatron else ""
    text = FOUR_M_TORCH.replace("schedule = 1f1b", f"schedule = {schedule}").replace("evenly over pp", stages)
    # gpipe holds every microbatch; torch's stages a receive buffer for each
    analysis = analyzed(text, *(("E503",) if not megatron else ()))
    plan = analysis.document.plans[0]
    assert plan.num_microbatches == 4 * 2**20
    if analysis.errors and schedule == "gpipe":
        return
    with bounded(LIMIT_S, "estimate_plan"):
        result = estimate_plan(plan)
    assert result.microbatches == 4 * 2**20 and result.time.step > 0
    # the bubble is the pipeline's fill and drain only: a vanishing share of 4M microbatches
    assert result.time.bubble / result.time.step < 1e-3


def test_let_chain_is_evaluated_once_per_name():
    lets = "let a0 = 1\n" + "".join(f"let a{i} = a{i - 1} + a{i - 1}\n" for i in range(1, 1001))
    text = lets + VALID_PLAN.replace("[dp = nodes * 8 / 4,", "[dp = a1000 / a998,")
    analysis = analyzed(text)
    assert analysis.document.plans[0].dp == 4


def _doubling(links: int, first: str = "1") -> str:
    return f"let a0 = {first}\n" + "".join(f"let a{i} = a{i - 1} + a{i - 1}\n" for i in range(1, links + 1))


# 10,000 links: past what a recursive evaluation survives under parser.RECURSION_LIMIT (~2 CPU-s, mostly
# parsing 10,000 lines; slow tier); 1,000 in the unit tier: the same path, without the depth
@pytest.mark.parametrize("links", [1_000, pytest.param(10_000, marks=pytest.mark.slow)])
def test_a_long_let_chain_is_evaluated_without_deep_recursion(links):
    text = _doubling(links) + VALID_PLAN.replace("[dp = nodes * 8 / 4,", f"[dp = a{links} / a{links - 2},")
    analysis = analyzed(text)
    assert analysis.document.plans[0].dp == 4


@pytest.mark.parametrize("links", [500, pytest.param(5_000, marks=pytest.mark.slow)])  # 5,000: ~3.5 CPU-s
def test_a_long_chain_through_params_and_an_imported_file(tmp_path, links):
    """The chain crosses a param and an import; a param override still wins over its expression."""
    (tmp_path / "numbers.plan").write_text(_doubling(links))
    lets = f"param q = a{links}\n" + "".join(f"let b{i} = {'q' if i == 0 else f'b{i - 1}'} + 0\n" for i in range(links))
    plan = tmp_path / "main.plan"
    plan.write_text('import "numbers"\n' + lets + VALID_PLAN.replace("[dp = nodes * 8 / 4,", f"[dp = b{links - 1} / a{links - 2},"))
    with bounded(LIMIT_S, "analyze"):  # CPU time: wall time stretches on a shared machine
        analysis = analyze(str(plan))
    assert analysis.ok, analysis.diagnostics
    assert analysis.document.plans[0].dp == 4
    overridden = analyze(str(plan), params={"q": 2**(links - 1)})
    assert overridden.ok and overridden.document.plans[0].dp == 2


@pytest.mark.parametrize("links", [500, pytest.param(5_000, marks=pytest.mark.slow)])  # 5,000: ~1 CPU-s
def test_a_long_let_cycle_is_a_cycle(links):
    text = _doubling(links, first=f"a{links}") + VALID_PLAN.replace("[dp = nodes * 8 / 4,", f"[dp = a{links},")
    analysis = analyzed(text, "E211")
    assert [d.code for d in analysis.errors] == ["E211"]
    assert "defined in terms of itself" in analysis.errors[0].message


def test_an_error_at_the_end_of_a_long_chain_is_reported_once():
    text = _doubling(3_000, first="1 / 0") + VALID_PLAN.replace("[dp = nodes * 8 / 4,", "[dp = a3000,")
    analysis = analyzed(text, "E211")
    assert [(d.code, d.span.line) for d in analysis.errors] == [("E211", 1)]
    assert "division by zero" in analysis.errors[0].message


def test_let_inside_a_template_still_reads_the_loop():
    """Memoised lets are per scope: a template's `let` of a loop variable gets each value."""
    text = VALID_PLAN.replace("schedule = 1f1b", "schedule = flush") + """
schedule flush(p: ranks, m: microbatches) {
  for r in 0..p on rank r {
    let w = min(p - r - 1, m)
    for i in 0..w { F(r, i) }
    for i in 0..m - w { F(r, w + i); B(r, i) }
    for i in m - w..m { B(r, i) }
  }
}
"""
    analyzed(text)


def test_written_table_declaring_a_trillion_microbatches():
    text = (ROOT / "stdlib_plans/examples/schedule_table.plan").read_text()
    text = text.replace("microbatches = 8)", "microbatches = 1000000000000)")
    text = text.replace("global_batch: 128,", "global_batch: 4294967296,")  # 2^28 microbatches of the plan
    analysis = analyzed(text, "E608")
    text = text.replace("microbatches = 1000000000000)", f"microbatches = {2**28})")
    analysis = analyzed(text, "E603")
    assert any(f"8..{2**28 - 1}" in d.message for d in analysis.errors)


def test_template_too_large_to_lay_out_is_e609():
    text = (ROOT / "stdlib_plans/examples/schedule_template.plan").read_text()
    analysis = analyzed(text.replace("global_batch: 256,", "global_batch: 4294967296,"), "E609")
    # (and E503: torch's pipeline stages would keep a receive buffer for each of its 2^31 microbatches)
    assert f"{limits.MAX_ACTIONS:,}" in next(d for d in analysis.errors if d.code == "E609").message


# ---- the schedule command ---------------------------------------------------------------------
@pytest.mark.parametrize("args, code, option", [
    (["--ranks", "4", "--microbatches", "1000000000"], "E609", None),
    (["--ranks", "100000", "--microbatches", "100000"], "E609", None),
    (["--ranks", "1000000000", "--microbatches", "4"], None, "--ranks"),
    (["--ranks", "4", "--microbatches", HUGE], None, "--microbatches"),
    (["--ranks", "4", "--microbatches", "8", "--virtual", "100000"], None, "--virtual"),
])
def test_schedule_command_with_huge_counts(args, code, option):
    name = "interleaved_1f1b" if "--virtual" in args else "1f1b"
    result = cli("schedule", name, *args)
    if code:
        assert result.returncode == 1 and f"error[{code}]" in result.stdout + result.stderr
    else:
        assert result.returncode == 2 and option in result.stderr


def test_schedule_command_template_with_huge_sizes():
    plan = ROOT / "stdlib_plans/examples/schedule_template.plan"
    result = cli("schedule", f"{plan}:pipedream_flush", "--ranks", "4", "--microbatches", "1000000000")
    assert result.returncode == 1 and "error[E609]" in result.stdout + result.stderr


def _bounded_figures(text: str):
    """What `estimate` simulates for the plan (schedules.bounded, with the plan's own stage costs)."""
    from plandsl.cost.pipeline import estimate_stage_costs
    from plandsl.cost.schedule import simulate_plan_schedule
    from plandsl.ir.placement import assign_stages
    plan = analyzed(text).document.plans[0]
    return simulate_plan_schedule(plan, estimate_stage_costs(plan, assign_stages(plan)[0]))


def test_simulate_past_the_action_cap_gives_the_bounded_figures(tmp_path):
    """4M microbatches: the figures estimate has (step time, bubble, peaks), said to be extrapolated."""
    path = tmp_path / "big.plan"
    path.write_text(FOUR_M)
    result = cli("simulate", str(path), "--json")
    assert result.returncode == 0, result.stderr
    figures, expected = json.loads(result.stdout), _bounded_figures(FOUR_M)
    assert expected.extrapolated is not None
    assert figures["makespan"] == expected.makespan and figures["bubble_fraction"] == expected.bubble_fraction
    assert [r["peak_memory_bytes"] for r in figures["ranks"]] == [r.peak_memory_bytes for r in expected.ranks]
    assert figures["extrapolated"]["microbatches"] == 4 * 2**20
    text = cli("simulate", str(path))
    assert text.returncode == 0 and "steady state extrapolated" in text.stdout and "4,194,304" in text.stdout


def test_a_trace_or_a_timeline_past_the_cap_is_e609_saying_what_to_do(tmp_path):
    path = tmp_path / "big.plan"
    path.write_text(FOUR_M)
    line = FOUR_M.splitlines().index("  schedule = 1f1b") + 1
    traced = cli("simulate", str(path), "--trace", str(tmp_path / "trace.json"))
    assert traced.returncode == 1 and f"big.plan:{line}:" in traced.stderr and "error[E609]" in traced.stderr
    assert "drop --trace" in traced.stderr and not (tmp_path / "trace.json").exists()
    drawn = cli("render", str(path), "--view", "schedule", "-o", str(tmp_path / "s.svg"))
    assert drawn.returncode == 1 and f"big.plan:{line}:" in drawn.stderr and "plandsl simulate" in drawn.stderr


DEEP = """\
import "clusters/dgx_h100"
plan deep {
  model    = llama(layers=256, hidden=1024, heads=16, seq=1024, vocab=32000)
  cluster  = dgx_h100 x 16
  mesh     = [pp = 16, tp = 8]
  train    = { global_batch: 1024, micro_batch: 1, precision: bf16 }
  tensor   = megatron over tp with sequence_parallel
  stages   = evenly over pp with virtual = 16
  schedule = interleaved_1f1b
}
"""


def test_a_pipeline_too_deep_to_extrapolate_is_e609_naming_what_fits():
    """256 stages: the run a built-in's figures are extrapolated from passes the action cap by itself, so `estimate`
    and `simulate` refuse the plan `check` accepts (E609); the hint names the microbatch count simulated whole (and
    that count estimates: the next test), not `simulate` and `estimate`, which are the commands refusing it."""
    with pytest.raises(PlanError) as refused:
        _bounded_figures(DEEP)
    (error,) = refused.value.diagnostics
    assert error.code == "E609" and DEEP.splitlines()[error.span.line - 1].strip().startswith("schedule =")
    assert "plandsl estimate" not in error.hint and "256 stages" in error.hint, error.hint
    assert _whole(error.hint) == limits.MAX_ACTIONS // (256 * 2)


def _whole(hint: str) -> int:
    return int(re.search(r"at most ([\d,]+) microbatches", hint).group(1).replace(",", ""))


@pytest.mark.slow  # ~2.5 CPU-s: 500,000 actions simulated
def test_the_microbatches_a_too_deep_pipelines_hint_names_estimate():
    from plandsl.cost.estimate import estimate_plan
    with pytest.raises(PlanError) as refused:
        _bounded_figures(DEEP)
    whole = _whole(refused.value.diagnostics[0].hint)
    plan = analyzed(DEEP.replace("global_batch: 1024", f"global_batch: {whole}")).document.plans[0]
    with bounded(LIMIT_S, "estimate_plan"):
        assert estimate_plan(plan).microbatches == whole


def test_schedule_simulate_past_the_cap_gives_the_figures():
    """1F1B with F=1, B=2 on p ranks: (m + p - 1) x 3, exactly, for a billion microbatches too."""
    result = cli("schedule", "1f1b", "--ranks", "4", "--microbatches", "1000000000", "--simulate",
                 "--costs", "F=1,B=2", "--json")
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout)
    assert figures["makespan"] == (10**9 + 3) * 3 and figures["extrapolated"]["microbatches"] == 10**9
    printed = cli("schedule", "1f1b", "--ranks", "4", "--microbatches", "1000000000")
    assert printed.returncode == 1 and "--simulate" in printed.stdout + printed.stderr


def test_a_small_simulation_is_not_extrapolated():
    result = cli("schedule", "1f1b", "--ranks", "4", "--microbatches", "8", "--simulate", "--costs", "F=1,B=2", "--json")
    assert "extrapolated" not in json.loads(result.stdout)


def test_a_written_schedule_too_large_points_at_the_plans_schedule_line():
    text = (ROOT / "stdlib_plans/examples/schedule_template.plan").read_text()
    text = text.replace("global_batch: 256,", "global_batch: 4294967296,")
    (error,) = [d for d in analyzed(text, "E609").errors if d.code != "E503"]  # E503: torch's receive buffers
    assert text.splitlines()[error.span.line - 1].strip().startswith("schedule =")
    assert [n.message.split()[0] for n in error.notes][:1] == ["schedule"]


# ---- bounded analysis of built-in schedules == the full one --------------------------------------
def _grid(ranks_options=(1, 2, 3, 4), virtual_options=(1, 2, 3)):
    for name, info in BUILTIN.items():
        for ranks in ranks_options:
            if name == "chimera" and ranks % 2:
                continue
            for virtual in (virtual_options if info.virtual == "any" else (None,)):
                yield name, ranks, virtual


def _costs(kind: str, stages: int, ranks: int, seed: int) -> Costs:
    if kind == "unit":
        return Costs()
    rng = random.Random(seed)
    return Costs(stage_costs=tuple((rng.uniform(.5, 2), rng.uniform(1, 3), rng.uniform(.3, 1.5), rng.uniform(.3, 1.5))
                                   for _ in range(stages)),
                 p2p=rng.uniform(0, .3), activation_bytes=tuple(rng.uniform(1, 5) for _ in range(stages)),
                 static_bytes=tuple(rng.uniform(0, 9) for _ in range(ranks)))


def _same(full, bounded) -> None:
    close = dict(rel_tol=1e-9, abs_tol=1e-9)
    assert math.isclose(full.makespan, bounded.makespan, **close)
    assert math.isclose(full.bubble_fraction, bounded.bubble_fraction, **close)
    for a, b in zip(full.ranks, bounded.ranks, strict=True):
        assert a.peak_inflight_microbatches == b.peak_inflight_microbatches
        assert math.isclose(a.peak_memory_bytes, b.peak_memory_bytes, **close)
        assert math.isclose(a.busy, b.busy, **close) and math.isclose(a.idle, b.idle, **close)


def _compare(name: str, ranks: int, virtual, counts) -> int:
    compared = 0
    for kind in ("unit", "random"):
        for m in counts:
            try:
                check_sizes(name, ranks, m, virtual)
            except ValueError:
                continue
            schedule = generate(name, ranks, m, virtual)
            costs = _costs(kind, schedule.stages, ranks, seed=ranks * 1000 + (virtual or 0))
            start = WARMUP_PERIODS * ranks * schedule.virtual
            _same(simulate(schedule, costs), simulate_builtin(name, ranks, m, virtual, costs, start=start))
            compared += 1
    return compared


def _slow_past(cases, ranks: int):
    """4 ranks (two thirds of the grid's CPU: ~8 s) run in the slow tier; 2 and 3 take the same path here."""
    return [pytest.param(*case, marks=pytest.mark.slow) if case[1] >= ranks else case for case in cases]


@pytest.mark.parametrize("name, ranks, virtual", _slow_past(_grid((2, 3, 4), (1, 2)), ranks=4))
def test_bounded_simulation_equals_the_full_one(name, ranks, virtual):
    """Around where the extrapolation starts, and well past it (the full tier: every m to 300)."""
    start = WARMUP_PERIODS * ranks * (virtual or 2)
    past = max(extrapolated_past(name, ranks, ranks * k, virtual, start) for k in (16, 24, 32, 48))
    counts = list(range(past - 3, past + 2 * ranks * (virtual or 2) + 3)) + [past + 101, 2 * past + 37]
    assert _compare(name, ranks, virtual, counts) > 0


@pytest.mark.slow
@pytest.mark.parametrize("name, ranks, virtual", list(_grid((2, 3), (1, 2))))
def test_bounded_simulation_equals_the_full_one_up_to_300(name, ranks, virtual):
    """Every m to 128, then counts spread to 300 (primes, powers of two and their neighbours): the extrapolation
    repeats a period of ranks x virtual microbatches, so a wrong period shows at many counts past its start;
    the full simulation of every m to 300 cost ~115 CPU-s of the slow tier for counts that test nothing new."""
    counts = list(range(1, 129)) + [131, 157, 191, 199, 223, 255, 256, 257, 263, 293, 299, 300]
    assert _compare(name, ranks, virtual, counts) > 0


def test_bounded_simulation_lays_out_few_actions():
    """4M microbatches: each run lays out a few rounds of ranks x virtual, not the table."""
    import plandsl.schedules.bounded as bounded
    seen = []
    original = bounded._layout

    def spy(*args):
        schedule = original(*args)
        seen.append(schedule.num_actions)
        return schedule

    bounded._layout = spy
    try:
        result = simulate_builtin("interleaved_1f1b", 8, 4 * 2**20, 2, Costs())
    finally:
        bounded._layout = original
    assert len(seen) == 3 and max(seen) < 20_000  # the run that finds the cycle, then two runs a cycle apart
    assert result.ranks[0].peak_inflight_microbatches == simulate(generate("interleaved_1f1b", 8, 256, 2)) \
        .ranks[0].peak_inflight_microbatches


def test_size_rules_are_the_generators():
    """check_sizes (nothing laid out) refuses exactly what generate refuses."""
    for name, info in BUILTIN.items():
        for ranks in range(1, 7):
            for m in range(1, 25):
                for virtual in ((None, 1, 2, 3) if info.virtual == "any" else (None, 1, 2)):
                    try:
                        generate(name, ranks, m, virtual)
                        generated = None
                    except ValueError as error:
                        generated = str(error)
                    try:
                        check_sizes(name, ranks, m, virtual)
                        checked = None
                    except ValueError as error:
                        checked = str(error)
                    assert generated == checked, (name, ranks, m, virtual)


# ---- generate ------------------------------------------------------------------------------------
@pytest.mark.parametrize("model, nodes, batch", [
    ("gpt3_175b", 1, limits.MAX_GLOBAL_BATCH),                                      # nothing fits
    ("gpt(layers=1000, hidden=91264, heads=713, seq=2048, vocab=51200)", 1, 1536),  # ~100T parameters
])
def test_generate_answers_a_hostile_input_quickly(model, nodes, batch):
    from plandsl.search import SearchError, search
    from plandsl.search.emit import resolve_problem
    with bounded(LIMIT_S, "search"):
        problem, _ = resolve_problem(model, f"dgx_a100 x {nodes}", batch)
        with pytest.raises(SearchError, match=r"states alone need at least dgx_a100 x [\d,]+"):
            search(problem, top=1)


def test_generate_option_past_its_cap_names_it():
    result = cli("generate", "--model", "gpt3_175b", "--cluster", "dgx_a100 x 1", "--global-batch", HUGE)
    assert result.returncode == 2 and "--global-batch" in result.stderr


def test_device_types_per_rank_are_the_devices_without_counts():
    """The per-group walk gives, per pipeline rank, the types the per-device lists hold."""
    from plandsl.ir.placement import pipeline_rank_device_types, pipeline_rank_devices
    checked = 0
    for path in sorted((ROOT / "stdlib_plans").rglob("*.plan")):
        analysis = analyze(str(path))
        for plan in analysis.document.plans if analysis.document else ():
            full = [[d.name for d in {d.name: d for d in rank}.values()] for rank in pipeline_rank_devices(plan)]
            assert full == [[d.name for d in rank] for rank in pipeline_rank_device_types(plan)], (path, plan.name)
            checked += 1
    assert checked >= 20


@pytest.mark.parametrize("count,shown", [(0, "0"), (128, "128"), (4096, "4.1K"), (999_500, "1M"),
                                         (174.6e9, "175B"), (1e14, "100T"), (999.6e12, "1e15"), (1.23e15, "1.23e15"),
                                         (2**63, "9.22e18")])
def test_counts_read_as_people_write_them(count, shown):
    from plandsl.lower.units import format_count
    assert format_count(count) == shown


def test_a_100t_parameter_model_is_described_in_trillions():
    from plandsl.ir.layers import param_count
    from plandsl.render.summary import describe_plan
    text = VALID_PLAN.replace("gpt(layers=8, hidden=1024, heads=16, seq=1024, vocab=50304)",
                              "gpt(layers=1000, hidden=100000, heads=100, seq=1024, vocab=50000)")
    plan = analyze("huge.plan", text=text).document.plans[0]
    assert 1e14 < param_count(plan.model) < 1e15
    assert "T parameters)" in describe_plan(plan) and "e+" not in describe_plan(plan)


def test_partition_of_a_hundred_thousand_blocks_is_closed_form():
    """100,000 blocks over 4,096 stages: bisection over the distinct stages, not a step per block."""
    from plandsl.search.partition import partition_blocks
    with bounded(LIMIT_S, "partition_blocks"):
        counts = partition_blocks(limits.MAX_LAYERS, [0.5] + [0.0] * 4094 + [0.9], [0.01] * 4096)
    assert sum(counts) == limits.MAX_LAYERS and max(counts) - min(counts) <= 90


def _span_walked(per_node, first, sizes, position):
    """axis_group_span's walk over every device (what the closed form replaces), nodes of `per_node`."""
    stride = 1
    for inner in sizes[position + 1:]:
        stride *= inner
    size, total = sizes[position], 1
    for s in sizes:
        total *= s
    worst = 1
    for base in range(total):
        if (base // stride) % size:
            continue
        worst = max(worst, len({(first + base + k * stride) // per_node for k in range(size)}))
    return worst


def test_group_span_on_equal_nodes_is_the_walk_over_every_device():
    import itertools
    import math
    from plandsl.check.mesh import _span_on_equal_nodes
    compared = 0
    for per_node in (1, 2, 3, 4, 8):
        for sizes in itertools.product((1, 2, 3, 4, 6), repeat=3):
            total = sizes[0] * sizes[1] * sizes[2]
            for first in (0, 1, 3, 5):
                for position in range(3):
                    stride = math.prod(sizes[position + 1:])
                    assert _span_on_equal_nodes(per_node, first, total, stride, sizes[position]) == \
                        _span_walked(per_node, first, sizes, position), (per_node, first, sizes, position)
                    compared += 1
    assert compared == 5 * 125 * 4 * 3


# ---- a stage range's end ------------------------------------------------------------------------
RANGE_PLAN = """\
import "clusters/local"
model m = gpt(layers=4, hidden=64, heads=4, seq=32, vocab=256)
plan p {
  model   = m
  cluster = localhost
  mesh    = [pp = 2] over devices[0:2]
  train   = { global_batch: 8, micro_batch: 1 }
  stages {
    0: embed, layers[0:2]
    1: layers[2:END], norm, head
  }
}
"""


@pytest.mark.parametrize("end", ["4", "5", "9", HUGE])
def test_a_stage_range_past_the_last_layer_is_e405_in_time_bounded_by_the_model(end):
    """`layers[2:9]` on a 4-layer model was accepted (Python's slice clamps), and `layers[2:10^18]` looped over
    its whole range: now both are E405 naming the last layer, in work bounded by the model's layers."""
    text = RANGE_PLAN.replace("END", end)
    if end == "4":
        analyzed(text)
        return
    [error] = analyzed(text, "E405").errors
    assert f"'layers[2:{end}]' reaches past the end of model 'm', whose last is 'layers.3' (layers[4:{end}] do not " \
           "exist)" in error.message


def test_a_stages_block_of_many_ranges_reads_the_model_once_per_range_head():
    """1,000 ranges over 10,000 layers: checking each range's end reads the model's names once (per head),
    not once per range (which took ~30 CPU-s for this plan)."""
    pp = 1000
    lines = "\n".join(f"    {s}: " + ("embed, " if s == 0 else "") + f"layers[{s * 10}:{s * 10 + 10}]"
                      + (", norm, head" if s == pp - 1 else "") for s in range(pp))
    analyzed(f"""\
import "clusters/local"
model m = gpt(layers=10000, hidden=64, heads=4, seq=32, vocab=256)
plan p {{
  model   = m
  cluster = localhost x 125
  mesh    = [pp = {pp}] over devices[0:{pp}]
  train   = {{ global_batch: {pp}, micro_batch: 1 }}
  stages {{
{lines}
  }}
}}
""")


# ---- tiny rates: every time the cost model gives stays finite ------------------------------------
_TINY = """device g {{
  memory = 80 GiB
  bandwidth = {bandwidth}
  peak = {{ bf16: {peak} }}
  efficiency = {{ matmul: {matmul}, kernel_latency: 0 us{extra}, attention: 0.4, attention_by_sequence: [[2048, {ratio}]] }}
}}
node n {{ devices = 8 x g; link = {{ bandwidth: {link} }} }}
plan p {{
  model   = llama(layers=2, hidden=1024, heads=8, seq=2048, vocab=1000)
  cluster = n
  train   = {{ global_batch: 2, micro_batch: 1, recompute: none }}
}}
"""
_SANE = dict(bandwidth="2 TB/s", peak="1000 TFLOP/s", matmul="0.5", ratio="1", link="100 GB/s", extra="")


@pytest.mark.parametrize("field, value, code, words", [
    ("ratio", "5e-324", "E205", "attention x its smallest attention_by_sequence ratio"),
    ("ratio", "1e-300", "E205", "below 1 FLOP/s"), ("matmul", "5e-324", "E205", "efficiency matmul"),
    ("peak", "1e-300 FLOP/s", "E205", "peak bf16 is 1e-300 FLOP/s"),
    ("bandwidth", "1e-300 B/s", "E205", "bandwidth is 1e-300 B/s"),
    ("link", "1e-300 B/s", "E205", "link bandwidth is 1e-300 B/s"),
    ("extra", ", measured: [[1, 1, 1, 1e299 s], [4096, 4096, 4096, 1e299 s]]", "E217", "runs at 2e-299 FLOP/s"),
])
def test_a_rate_below_one_per_second_is_refused_not_an_infinite_time(tmp_path, field, value, code, words):
    """A device's or link's rate (or a fraction of the peak, an attention_by_sequence ratio, a measured GEMM) so small
    that a plan's work over it overflowed made `estimate` print `inf s` (or `nan s`) and `nan%` and `generate` fail
    with E108 (a ZeroDivisionError or a NaN in the search's bounds); every rate is now at least 1 per second (E205;
    a measured GEMM's E217; lower.measured.MIN_RATE)."""
    path = tmp_path / "partial.plan"
    path.write_text(_TINY.format(**{**_SANE, field: value}))
    result = cli("generate", "--from", str(path), "--top", "1")
    assert result.returncode == 1 and "E108" not in result.stdout + result.stderr, result.stdout + result.stderr
    assert f"error[{code}]" in result.stdout + result.stderr and words in result.stdout + result.stderr
    path.write_text(_TINY.format(**_SANE))
    assert cli("generate", "--from", str(path), "--top", "1").returncode == 0


# ---- many unknown names: each hint's look-up costs what reading the name costs --------------------
def _train_keys(keys: int, key: str) -> str:
    return VALID_PLAN.replace("train   = {", "train   = { " + ", ".join(key.format(i) for i in range(keys)) + ",", 1)


@pytest.mark.parametrize("key", ["zz{}: 1", "micro_bach: 1"], ids=["unknown", "one misspelling"])
def test_unknown_keys_cost_little_more_than_keys_given_twice(key):
    """A train block of 4,000 unknown keys (E206 each, with its did-you-mean) against one of 4,000 keys given twice
    (E213 each, no hint), each file's tree already parsed (parser._parse_cached: under 64 kB), so that the ratio is
    the lowering's and its hints': difflib read the 25 train keys twice per unknown key (the hint and its edit): 16x
    the peer's CPU, 40x for one misspelt key written 4,000 times (and two thirds of `plandsl check` of 40,000 unknown
    keys on one line, 9.6 s); now the train keys that could be close are looked up by character and the answer is
    kept per name: 2.5-3.5x."""
    from support import cpu_ratio
    unknown, twice = _train_keys(4_000, key), _train_keys(4_000, "seed: {}")
    assert len(unknown) < 64_000 and len(twice) < 64_000  # parser.CACHED_BYTES
    assert cpu_ratio(lambda: analyze(text=unknown), lambda: analyze(text=twice)) < 7
    hints = {d.hint for d in analyze(text=unknown).errors}
    assert hints == {None if key.startswith("zz") else "did you mean 'micro_batch'?"}


def test_the_nearest_name_is_difflibs():
    """`nearest` passes over the options that cannot reach difflib's cutoff before asking difflib: the same answer as
    difflib's over all of them, for random names and options (characters of several kinds, repeats, empty ones),
    and for names long enough for difflib's junk heuristic."""
    import difflib

    from plandsl.diagnostics import nearest
    rng = random.Random(3)
    alphabet = "ab_cdeé\U0001F600xyz"

    def word(most: int) -> str:
        return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, most)))
    for _ in range(20_000):
        options = [word(8) for _ in range(rng.randint(0, 8))]
        name = rng.choice(options) + word(2) if options and rng.random() < 0.3 else word(10)
        expected = difflib.get_close_matches(name, options, n=1, cutoff=0.6)
        assert nearest(name, options) == (expected[0] if expected else None), (name, options)
    for _ in range(100):
        options = [word(300) for _ in range(3)] + ["a" * 250 + "b"]
        name = "a" * rng.randint(150, 300) + word(20)
        expected = difflib.get_close_matches(name, options, n=1, cutoff=0.6)
        assert nearest(name, options) == (expected[0] if expected else None)
