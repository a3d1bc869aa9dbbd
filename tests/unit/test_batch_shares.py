"""Uneven data-parallel shares of the global batch (`batch_shares`): the language, the checker's codes
(E507-E509, E502 per replica), `speed` resolved by the cost model, each replica priced by its own local
batch on its own devices, and `show`/`estimate` saying the shares."""
from __future__ import annotations

import itertools
import time

import pytest

from plandsl import api
from plandsl.cost.estimate import (
    data_shares,
    estimate_plan,
    format_estimate,
    replica_devices,
)
from plandsl.cost.shares import balance
from plandsl.ir import shares as batch
from plandsl.runtime.support import refusals
from tests.conftest import STDLIB

MIXED = """\
import "clusters/mixed_a100_h100"
import "models/llama2"
plan p {{
  model    = gpt(layers=8, hidden=8192, heads=64, seq=2048, vocab=32000)
  cluster  = mixed_a100_h100
  mesh     = {mesh}
  train    = {{ global_batch: {batch}, micro_batch: {mb}, batch_shares: {shares} }}
  data     = zero1 over dp
  tensor   = megatron over tp
{extra}}}
"""


def _text(shares="speed", mesh="[dp = 2, tp = 8] over devices[24:40]", batch=64, mb=2, extra=""):
    return MIXED.format(shares=shares, mesh=mesh, batch=batch, mb=mb, extra=extra)


def _codes(text: str) -> list[str]:
    return [d.code for d in api.checks(text).diagnostics if d.is_error]


def _plan(text: str):
    return api.loads(text).plans[0]


def test_batch_shares_lowers_as_a_list_or_speed():
    assert _plan(_text("[48, 16]")).train.batch_shares == (48, 16)
    assert _plan(_text()).train.batch_shares == "speed"
    assert _codes(_text("fastest")) == ["E210"]
    assert _codes(_text("4 GiB")) == ["E205"]


def test_a_plan_without_shares_dumps_as_before():
    """No `batch_shares` key in the IR dump, so the plan hashes (checkpoints) of existing plans stay."""
    plan = api.load_plan(STDLIB / "local" / "dp.plan")
    assert "batch_shares" not in plan.train.model_dump() and "batch_shares" not in plan.model_dump_json()
    assert _plan(_text("[48, 16]")).train.model_dump()["batch_shares"] == (48, 16)


def test_E507_one_share_per_data_rank():
    assert _codes(_text("[32, 16, 16]")) == ["E507"]


def test_E508_shares_sum_to_the_global_batch():
    (problem,) = [d for d in api.checks(_text("[48, 32]")).diagnostics if d.is_error]
    assert problem.code == "E508" and "48 + 32 = 80" in problem.message and "64" in problem.message


def test_E509_whole_microbatches_at_least_one():
    assert _codes(_text("[63, 1]")) == ["E509"]
    assert _codes(_text("[64, 0]")) == ["E509"]
    assert _codes(_text("speed", batch=2, mb=2)) == ["E509"]  # one microbatch, two data ranks
    assert _codes(_text("speed", batch=63, mb=2)) == ["E509"]


def test_shares_replace_the_even_split_rule():
    """62 is not a multiple of dp x micro_batch = 4 (E501), but it splits into 46 + 16."""
    assert _codes(_text("[46, 16]", batch=62)) == []
    assert _codes(_text("[46, 16]", batch=62).replace(", batch_shares: [46, 16]", "")) == ["E501"]


def test_E502_each_replica_runs_the_schedule():
    """1F1B over 2 pipeline ranks needs 2 microbatches a replica: shares of 3 and 1 leave one replica short."""
    extra = "  stages   = evenly over pp\n  schedule = 1f1b\n"
    mesh = "[dp = 2, pp = 2, tp = 8] over devices[0:32]"
    (problem,) = [d for d in api.checks(_text("[6, 2]", mesh=mesh, batch=8, mb=2, extra=extra)).diagnostics
                  if d.is_error]
    assert problem.code == "E502" and problem.message.startswith("data rank 1's share (2 sequences, 1 microbatches")
    assert _codes(_text("[4, 4]", mesh=mesh, batch=8, mb=2, extra=extra)) == []


def test_replicas_are_numbered_as_the_interpreter_numbers_data_ranks():
    """devices[24:40]: data rank 0 is the last A100 node, data rank 1 the first H100 node."""
    plan = _plan(_text())
    assert [[d.name for d in r] for r in replica_devices(plan)] == [["a100_80g"], ["h100_80g"]]


def test_speed_gives_the_faster_replica_more_and_evens_the_replicas():
    plan = _plan(_text())
    shares = data_shares(plan)
    assert sum(shares) == 64 and all(s % 2 == 0 for s in shares) and shares[1] > 2 * shares[0]
    estimate = estimate_plan(plan)
    assert estimate.shares == shares
    even = estimate_plan(_plan(_text("[32, 32]")))
    assert estimate.time.step < 0.75 * even.time.step  # the H100s no longer wait for the A100s
    # each replica priced on its own devices: the even plan's A100 replica is its slowest
    assert max(range(2), key=lambda r: even.replica_steps[r]) == 0
    spread = max(estimate.replica_steps) - min(estimate.replica_steps)
    assert spread < even.replica_steps[0] - even.replica_steps[1]


def test_the_step_waits_for_the_slowest_replica():
    plan = _plan(_text("[16, 48]"))
    estimate = estimate_plan(plan)
    rank0 = estimate_plan(batch.replica_plan(plan, 16), rank_devices=list(replica_devices(plan)[0]))
    rank1 = estimate_plan(batch.replica_plan(plan, 48), rank_devices=list(replica_devices(plan)[1]))
    assert estimate.replica_steps == pytest.approx((rank0.time.step, rank1.time.step))
    assert estimate.time.step == pytest.approx(max(rank0.time.pipeline, rank1.time.pipeline)
                                               + max(rank0.time.step - rank0.time.pipeline,
                                                     rank1.time.step - rank1.time.pipeline))
    assert estimate.flops_per_step == pytest.approx((rank0.flops_per_step + rank1.flops_per_step) / 2)


def test_estimate_and_show_say_the_shares():
    plan = _plan(_text("[16, 48]"))
    estimate = estimate_plan(plan)
    assert "batch shares   16, 48 sequences per data rank; data rank 1 is the slowest" in format_estimate(estimate)
    assert estimate.to_json()["batch_shares"] == [16, 48]
    assert "batch_shares" not in estimate_plan(_plan(_text("[32, 32]").replace(", batch_shares: [32, 32]", ""))
                                               ).to_json()
    shown = api.describe(api.loads(_text("[16, 48]")))
    assert "global batch 64 = per data rank 16, 48 sequences (8, 24 microbatches of 2)" in shown


def test_the_two_type_local_plan():
    plan = api.load_plan(STDLIB / "local" / "hetero.plan")
    assert plan.cluster.heterogeneous and data_shares(plan) == (5, 3)
    assert [[d.name for d in r] for r in replica_devices(plan)] == [["cpu_fast"] * 2, ["cpu_slow"] * 2]


@pytest.mark.parametrize("lines,total,least", [
    ([(0.0, 1.0), (0.0, 2.0)], 9, 1), ([(5.0, 1.0), (0.0, 1.0), (1.0, 3.0)], 10, 2),
    ([(0.0, 1.0)] * 3, 3, 1), ([(100.0, 1.0), (0.0, 1.0)], 4, 1),
])
def test_balance_is_the_min_max_split(lines, total, least):
    """Against every split of `total` with at least `least` each: the slowest replica is as early as can be."""
    counts = balance(total, lines, least)
    assert sum(counts) == total and min(counts) >= least

    def worst(split):
        return max(a + b * m for (a, b), m in zip(lines, split))
    best = min(worst(split) for split in itertools.product(range(least, total + 1), repeat=len(lines))
               if sum(split) == total)
    assert worst(counts) == pytest.approx(best)


def test_balance_holds_replicas_with_a_long_fill_at_the_least_in_bounded_work():
    """Half the replicas with a fill a thousand microbatches long: they get the least each, the others the rest
    evenly, without taking the continuous optimum's overshoot back one unit at a time (~5 CPU-s before; ~1 ms now)."""
    lines = [(10.0, 1e-3)] * 64 + [(0.0, 1e-3)] * 64
    start = time.process_time()
    counts = balance(512, lines, 1)
    assert time.process_time() - start < 0.5
    assert counts == [1] * 64 + [7] * 64


def test_run_refuses_more_pipeline_microbatches_than_torch_builds_in_seconds():
    """`run --dry-run` of 2^31 microbatches on two stages spent days in torch's schedule builder; speed shares
    are counted per replica (131,072 sequences over two equal replicas: 65,536 each, which runs)."""
    text = """\
import "clusters/local_mixed"
plan p {{
  model    = llama(layers=4, hidden=64, heads=4, seq=32, vocab=256)
  cluster  = local_mixed
  mesh     = [dp = 2, pp = 2] over devices[0:4]
  train    = {{ global_batch: {batch}, micro_batch: 1, precision: fp32{shares} }}
  data     = ddp over dp
  stages   = evenly over pp
  schedule = 1f1b
}}
"""
    def codes(batch: int, shares: str = "") -> list[str]:
        return [d.code for d in refusals(api.loads(text.format(batch=batch, shares=shares)).plans[0], cuda=False)]
    assert codes(2 * 65_537) == ["E701"] and codes(2 * 65_536) == []
    assert codes(2 * 65_536, ", batch_shares: speed") == []
    assert codes(2 * 65_536, ", batch_shares: [65537, 65535]") == ["E701"]
    # one stage is torch's pipeline too: `mesh = [dp = 2, pp = 1]` with 2^31 sequences was not refused, and `run
    # --dry-run` grew past 2.6 GB in a minute building its schedule
    text = text.replace("pp = 2] over devices[0:4]", "pp = 1] over devices[0:2]")
    assert codes(2**31) == ["E701"] and codes(2 * 65_537) == ["E701"] and codes(2 * 65_536) == []


def test_run_refuses_shares_with_expert_parallelism():
    text = """\
import "clusters/local"
import "local/tiny"
plan p {
  model   = llama(layers=2, hidden=64, heads=4, seq=32, vocab=256, experts=4, top_k=2)
  cluster = localhost
  mesh    = [ep = 2] over devices[0:2]
  train   = { global_batch: 8, micro_batch: 1, precision: fp32, batch_shares: [6, 2] }
  experts = alltoall over ep
}
"""
    assert [d.code for d in refusals(_plan(text))] == ["E703"]


def test_run_takes_shares_with_every_data_kind():
    """DDP, ZeRO-1 and FSDP (kept gathered through the step: tests/distributed/test_batch_shares.py) all run."""
    for kind in ("zero1", "replicate", "zero2", "zero3"):
        plan = _plan(_text("[16, 48]").replace("data     = zero1 over dp", f"data     = {kind} over dp"))
        assert refusals(plan) == [], kind


# ---- generate on a mixed cluster ---------------------------------------------------------------------------
@pytest.mark.slow
def test_generate_on_a_mixed_cluster_shares_the_batch_and_says_the_gain():
    """A 1.3B GPT on 4 DGX A100 + 2 DGX H100 (no pipeline splits them into two equal halves): the best plan is
    data parallel with the batch dealt by speed (the H100 replicas take more), ahead of the pipelines the
    search ranks first, and the mix runs faster than the 16 H100s alone."""
    request = api.generate_request(model="gpt(layers=24, hidden=2048, heads=16, seq=2048, vocab=50304)",
                                   cluster="[dgx_a100 x 4, dgx_h100 x 2]", global_batch=480, top=3, time_limit=0)
    generated = api.generate(request)
    found = api.generate_json(generated)
    best = found["candidates"][0]
    shares = best["batch_shares"]
    assert best["mesh_order"] == ["dp"] and api.loads(best["plan"]).plans[0].train.batch_shares == tuple(shares)
    assert sum(shares) == 480 and min(shares[32:]) > max(shares[:32])  # devices 32-47 are the H100s
    plan = api.loads(best["plan"]).plans[0]
    assert api.estimate(plan).time.step == pytest.approx(best["step_time_s"])
    gain = found["heterogeneity"]
    assert gain["faster_device"] == "h100_80g" and gain["faster_devices"] == 16 and gain["gain"] > 1.3
    assert gain["mixed_step_time_s"] == pytest.approx(best["step_time_s"])
    assert "heterogeneity: the best plan on all 48 devices runs" in api.generate_report(generated)


def test_the_variants_on_a_mixed_cluster_keep_a_pinned_degree():
    """The layouts `generate` adds on a mixed cluster for uneven shares (without a pipeline, the data axis outermost)
    keep the user's pinned degrees: under --pin dp=8 they proposed dp=16 and dp=32 (`rewrite.mixed._user` kept none of
    dp, tp, pp, cp, ep; `generate --from` kept them all)."""
    request = api.generate_request(model="gpt(layers=2, hidden=512, heads=8, seq=512, vocab=4096)",
                                   cluster="mixed_a100_h100", global_batch=128, pins=["dp=8"], top=6)
    found = api.generate_json(api.generate(request))
    assert {c["dp"] for c in found["candidates"]} == {8}, [(c["dp"], c["tp"], c["pp"]) for c in found["candidates"]]

def test_generate_on_one_device_type_says_nothing_of_heterogeneity():
    request = api.generate_request(model="gpt(layers=2, hidden=256, heads=4, seq=128, vocab=1024)",
                                   cluster="dgx_a100 x 1", global_batch=16, top=1)
    generated = api.generate(request)
    assert generated.gain is None and "heterogeneity" not in api.generate_json(generated)


LOCAL_MIXED_PARTIAL = """\
import "clusters/local_mixed"
plan p {
  model   = gpt(layers=4, hidden=256, heads=4, seq=128, vocab=1024)
  cluster = local_mixed
  train   = { global_batch: 32, micro_batch: 1, precision: fp32 }
}
"""


def _even(text: str) -> str:
    """The plan text without its batch_shares item (and the comment above it): even shares."""
    return "\n".join(line for line in text.splitlines()
                     if not line.strip().startswith(("batch_shares", "# batch_shares"))) + "\n"


def test_generate_writes_the_shares_out_and_prices_them_against_even_ones():
    """Four fast and four slow CPU devices without a pipeline: the shares speed resolves to are written out as
    an editable list, the plan estimates as generate says, and the same layout with even shares (what the
    search ranked it by) is the slower figure generate reports beside it."""
    request = api.generate_request(model="gpt(layers=4, hidden=256, heads=4, seq=128, vocab=1024)",
                                   cluster="local_mixed", global_batch=32, precision="fp32", top=3,
                                   pins=("pp=1", "mb=1"), time_limit=0)
    generated = api.generate(request)
    found = api.generate_json(generated)
    best = found["candidates"][0]
    shares = best["batch_shares"]
    assert sum(shares) == 32 and min(shares[:4]) > max(shares[4:])  # devices 0-3 are the fast ones
    assert f"batch_shares: [{', '.join(map(str, shares))}]" in best["plan"]  # written out, editable
    assert not any(line.strip().startswith("batch_shares: speed") for line in best["plan"].splitlines())
    shared = api.estimate(api.loads(best["plan"]).plans[0])
    even = api.estimate(api.loads(_even(best["plan"])).plans[0])
    assert shared.time.step == pytest.approx(best["step_time_s"]) and shared.shares == tuple(shares)
    assert best["even_shares_step_time_s"] == pytest.approx(even.time.step) and even.time.step > 1.2 * shared.time.step
    assert best["replica_step_time_s"] == pytest.approx(list(shared.replica_steps))
    report = api.generate_report(generated)
    low, high = min(shares), max(shares)
    assert f" {low}-{high}  " in report.splitlines()[1]  # the table's m: microbatches per data rank (mb 1)
    assert f"why #1: dp=8 mb=1 m={low}-{high} " in report
    assert (f"batch shares: {high} x 4, {low} x 4 sequences per data rank run {shared.time.step:.4g} s a step "
            f"against {even.time.step:.4g} s with 4 each ({even.time.step / shared.time.step:.2f}x the tokens/s)"
            in report)
    gain = found["heterogeneity"]
    assert gain["mixed_step_time_s"] == pytest.approx(shared.time.step) and gain["gain"] > 1.2


def test_generate_from_adds_the_shares_where_they_pay(tmp_path):
    """`generate --from` a partial plan on the mixed cluster completes it with the shares written out; a plan
    on one device type gets none (tests/golden/generate: its goldens are unchanged)."""
    path = tmp_path / "partial.plan"
    path.write_text(LOCAL_MIXED_PARTIAL)
    generated = api.generate(api.generate_request(from_file=str(path), pins=("pp=1",), top=2, time_limit=0))
    text, estimate = generated.texts[0], generated.result.best.estimate
    assert estimate.shares and f"batch_shares: [{', '.join(map(str, estimate.shares))}]" in text
    plan = api.loads(text).plans[0]
    assert api.estimate(plan).time.step == pytest.approx(estimate.time.step)
    even = api.estimate(api.loads(_even(text)).plans[0])
    assert generated.shared[0].even.time.step == pytest.approx(even.time.step) and even.time.step > estimate.time.step
    report = api.generate_report(generated)
    assert "batch shares: " in report
    gain = api.generate_json(generated)["heterogeneity"]  # against the 4 fast devices alone, the plan's pins kept
    assert gain["faster_devices"] == 4 and gain["mixed_step_time_s"] == pytest.approx(estimate.time.step)
    assert f"heterogeneity: the completed plan on all 8 devices runs {gain['gain']:.2f}x the tokens/s" in report
    path.write_text(LOCAL_MIXED_PARTIAL.replace("local_mixed", "localhost").replace("clusters/localhost",
                                                                                      "clusters/local"))
    alone = api.generate(api.generate_request(from_file=str(path), pins=("pp=1",), top=1, time_limit=0))
    assert "batch_shares" not in alone.texts[0] and not alone.result.best.estimate.shares and alone.gain is None


# ---- memory per replica ---------------------------------------------------------------------------------------
TWO_MEMORIES = """\
device big {{
  memory     = 4 GiB
  bandwidth  = 20 GB/s
  peak       = {{ fp32: 100 GFLOP/s, bf16: 100 GFLOP/s, fp16: 100 GFLOP/s }}
  efficiency = {{ matmul: 0.57, kernel_latency: 60 us }}
  reserve    = 0 GiB
}}
device small {{
  memory     = 1.5 GiB
  bandwidth  = 10 GB/s
  peak       = {{ fp32: 50 GFLOP/s, bf16: 50 GFLOP/s, fp16: 50 GFLOP/s }}
  efficiency = {{ matmul: 0.57, kernel_latency: 120 us }}
  reserve    = 0 GiB
}}
node bigs {{
  devices = 2 x big
  link    = {{ bandwidth: 5 GB/s, latency: 20 us }}
  nic     = {{ bandwidth: 5 GB/s, latency: 20 us }}
}}
node smalls {{
  devices = 2 x small
  link    = {{ bandwidth: 5 GB/s, latency: 20 us }}
  nic     = {{ bandwidth: 5 GB/s, latency: 20 us }}
}}
cluster two = [bigs x 1, smalls x 1]
plan p {{
  model    = gpt(layers=4, hidden=1024, heads=16, seq=1024, vocab=8192)
  cluster  = two
  mesh     = [dp = 2, pp = 2]
  train    = {{ global_batch: 16, micro_batch: 1, precision: fp32, batch_shares: {shares} }}
  data     = {kind} over dp
  stages   = evenly over pp
  schedule = gpipe
}}
"""


def _errors(text: str) -> list:
    return [d for d in api.checks(text).diagnostics if d.is_error]


def test_each_replica_is_counted_on_its_own_devices():
    """GPipe holds every microbatch's activations: data rank 0 (on the 4 GiB devices) with 12 microbatches needs
    more than the 1.5 GiB devices hold, data rank 1 (on those) with 4 does not (torch's pipeline stage keeping
    each of them's logits until its backward, 128 MiB of its last rank's 1.4 GiB: `cost.memory.torch_stage_bytes`;
    `replicate`'s copy of its stage's weights, 128 MiB more: `cost.memory.replicate_copy_bytes`). Counted replica by replica the
    plan fits (the most microbatches against the smallest device refused it); with the shares swapped the
    error names the data rank, its share and its device."""
    text = TWO_MEMORIES.format(kind="zero1", shares="[12, 4]")
    assert _errors(text) == []
    estimate = estimate_plan(_plan(text))
    small = 1.5 * 2**30
    assert estimate.replica_capacity == ((4 * 2**30,) * 2, (small,) * 2)
    assert estimate.replica_memory[0][0].total > small >= max(m.total for m in estimate.replica_memory[1])
    assert estimate.fits and estimate.overflow() is None
    assert "replica memory data rank 1, pipeline rank 1 is the fullest: 1.4 GiB of its devices' 1.5 GiB" \
        in format_estimate(estimate)  # the nearest its own capacity
    shown = api.describe(api.loads(text))  # show: the replica with the most microbatches, on its own devices
    assert "estimate of data rank 0, the most microbatches, on its own devices" in shown
    assert [line.split(" / ")[-1] for line in shown.splitlines() if line.startswith(("      0:", "      1:"))] \
        == ["4.0 GiB", "4.0 GiB"]  # data rank 0's devices (the smallest in the mesh hold 1.5 GiB)
    swapped = _errors(TWO_MEMORIES.format(kind="zero1", shares="[4, 12]"))
    assert [d.code for d in swapped] == ["E503"]
    assert swapped[0].message.startswith("data rank 1 (12 sequences: 12 microbatch(es) of 1), pipeline rank 0, needs "
                                         "about 2.2 GiB") and "its device 'small' has 1.5 GiB" in swapped[0].message
    smaller = api.checks(TWO_MEMORIES.format(kind="zero1", shares="[12, 4]").replace("1.5 GiB", "0.75 GiB"))
    assert [d.message[:30] for d in smaller.diagnostics if d.is_error] == ["data rank 1 (4 sequences: 4 mi"]
    over = estimate_plan(smaller.document.plans[0])
    assert not over.fits and over.overflow() == (1, 0)


def test_fsdp_with_shares_holds_every_unit_gathered_through_the_step():
    """ZeRO-3 with shares: the interpreter keeps every unit's parameters gathered from the first forward to the
    last backward and accumulates unsharded gradients (runtime.parallel.data_parallel), so a replica holds its
    stage's whole parameters and gradients on top of its shards, byte for byte what replication stores (which holds
    `replicate`'s copy of the parameters beside them on torch's pipeline); that overflows data rank 1's devices at
    1.375 GiB, and the hint says why."""
    from plandsl.cost.memory import estimate_plan_memory
    zero3 = _plan(TWO_MEMORIES.format(kind="zero3", shares="[12, 4]").replace("1.5 GiB", "4 GiB"))
    whole = _plan(TWO_MEMORIES.format(kind="replicate", shares="[12, 4]").replace("1.5 GiB", "4 GiB"))
    for share in (12, 4):
        held = estimate_plan_memory(batch.replica_plan(zero3, share), held=True)
        replicated = estimate_plan_memory(batch.replica_plan(whole, share))
        assert [(m.gathered_params, m.gathered_grads) for m in held] == \
            [(m.params - m.gathered_params, m.grads) for m in replicated]  # the stored ones (beside `replicate`'s copy)
        # a pipelined stage holds them anyway (torch's schedules reduce once, after the last backward:
        # cost.memory.pipelined_shards), shares or not
        pipelined = estimate_plan_memory(batch.replica_plan(zero3, share))
        assert [h.total for h in held] == [t.total for t in pipelined]
    assert estimate_plan(zero3).replica_memory[1] == tuple(estimate_plan_memory(batch.replica_plan(zero3, 4),
                                                                                  held=True))
    errors = _errors(TWO_MEMORIES.format(kind="zero3", shares="[12, 4]").replace("1.5 GiB", "1.375 GiB"))
    assert [d.code for d in errors] == ["E503"] and errors[0].message.startswith("data rank 1 (4 sequences")
    assert "ZeRO-2/3 keep every unit gathered through the step" in errors[0].hint


# ---- simulate and render per replica ---------------------------------------------------------------------------
def test_simulate_runs_each_replica_with_its_own_microbatches_on_its_own_devices(tmp_path):
    """local/hetero.plan: data rank 0 takes 5 microbatches on the fast devices, data rank 1 3 on the slow ones;
    each replica's simulated makespan is the estimate's for it, and the slowest is the step's pipeline."""
    import json

    from click.testing import CliRunner

    from plandsl.cli import main
    path = STDLIB / "local" / "hetero.plan"
    plan = api.load_plan(path)
    replicas = api.simulate_replicas(plan)
    assert [(r.data_ranks, r.microbatches, r.devices) for r in replicas] == \
        [((1,), 3, ("cpu_slow", "cpu_slow")), ((0,), 5, ("cpu_fast", "cpu_fast"))]
    assert [r.schedule.microbatches for r in replicas] == [3, 5]
    for replica in replicas:
        alone = estimate_plan(batch.replica_plan(plan, replica.share),
                              rank_devices=list(replica_devices(plan)[replica.data_ranks[0]]))
        assert replica.simulation.makespan == pytest.approx(alone.time.pipeline)
    assert replicas[0].simulation.makespan == pytest.approx(estimate_plan(plan).time.pipeline)
    assert api.simulate(plan)[1] == replicas[0].simulation
    trace = tmp_path / "trace.json"
    runner = CliRunner()
    result = runner.invoke(main, ["simulate", str(path), "--trace", str(trace)])
    assert result.exit_code == 0, result.output
    assert "the step waits for data rank 1 (makespan" in result.output
    assert "schedule 1f1b: 2 ranks, 2 stages, 3 microbatches" in result.output
    assert "schedule 1f1b: 2 ranks, 2 stages, 5 microbatches" in result.output
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1} and sum(e["ph"] == "X" for e in events) == 4 * 3 + 4 * 5
    found = json.loads(runner.invoke(main, ["simulate", str(path), "--json"]).output)
    assert [r["microbatches"] for r in found["replicas"]] == [3, 5]
    assert found["makespan"] == pytest.approx(replicas[0].simulation.makespan)



def test_simulate_with_given_costs_prints_their_units_not_seconds():
    """`--costs F=1,B=2` durations are in the user's units: the replica lines say `makespan 18`, as the header and
    each schedule's report do, not `makespan 18 s`."""
    from click.testing import CliRunner

    from plandsl.cli import main
    result = CliRunner().invoke(main, ["simulate", str(STDLIB / "local" / "hetero.plan"), "--costs", "F=1,B=2"])
    assert result.exit_code == 0, result.output
    assert "data rank 0: 5 sequences, 5 microbatch(es) on cpu_fast, makespan 18\n" in result.output

def test_render_draws_the_slowest_replica_and_says_the_fastest():
    from plandsl.render.memory import render_memory
    from plandsl.render.schedule import render_schedule
    plan = api.load_plan(STDLIB / "local" / "hetero.plan")
    drawn = render_schedule(plan)
    assert "drawn: data rank 1, the slowest replica (3 microbatch(es) on cpu_slow" in drawn
    assert "the fastest: data rank 0 (5 microbatch(es) on cpu_fast" in drawn
    assert "2 stages, 3 microbatches" in drawn and "5 microbatches ·" not in drawn
    assert "drawn: data rank 1, the slowest replica" in render_memory(plan)
