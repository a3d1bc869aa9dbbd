"""The plan-level cost model: FLOPs against Megatron's eq. 3, the step-time identity, MFU,
data-parallel overlap, memory from the one memory model, and `plandsl estimate`."""
import json

import pytest
from click.testing import CliRunner

from plandsl import api, ir
from plandsl.cost.memory import estimate_plan_memory
from plandsl.cli import main
from plandsl.cost.comm import collective_seconds
from plandsl.cost.estimate import estimate_plan
from plandsl.cost.layer import plan_links
from plandsl.cost.stage import rank_tail
from tests.conftest import STDLIB
from plandsl.cost.pipeline import estimate_stage_costs
from plandsl.ir.placement import assign_stages

PLAN = """\
import "clusters/dgx_a100"
plan p {{
  model    = gpt(layers=8, hidden=1024, heads=16, seq=1024, vocab=51200)
  cluster  = dgx_a100 x 2
  mesh     = [{mesh}]
  train    = {{ global_batch: 64, micro_batch: 2, recompute: {recompute} }}
  {extra}
}}
"""


def load(mesh="dp = 2, pp = 4, tp = 2", recompute="full", extra="data = zero1 over dp\n  stages = evenly over pp"):
    return api.loads(PLAN.format(mesh=mesh, recompute=recompute, extra=extra)).plans[0]


def test_flops_are_megatrons_equation_3_with_full_recomputation():
    plan = load()
    e = estimate_plan(plan)
    b, s, l, h, v = 64, 1024, 8, 1024, 51200
    eq3 = 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
    assert e.flops_per_step == pytest.approx(eq3, rel=1e-9)
    assert e.model_flops_per_step == pytest.approx(72 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h)),
                                                   rel=1e-9)
    assert e.tflops_per_device == pytest.approx(eq3 / e.time.step / 16 / 1e12)
    assert e.mfu == pytest.approx(e.model_flops_per_step / (e.time.step * 16 * 312e12))
    assert e.tokens_per_s == pytest.approx(b * s / e.time.step)


@pytest.mark.parametrize("extra", ["data = zero1 over dp\n  stages = evenly over pp",
                                   "data = zero3 over dp\n  stages = evenly over pp\n  schedule = zb_h1",
                                   "data = zero2 over dp\n  stages = evenly over pp with virtual = 2\n"
                                   "  schedule = interleaved_1f1b"])
def test_step_is_compute_plus_communication_plus_bubble_plus_optimizer(extra):
    e = estimate_plan(load(extra=extra))
    t = e.time
    assert t.step == pytest.approx(t.compute + t.communication + t.bubble + t.optimizer, rel=1e-12)
    assert min(t.compute, t.communication, t.bubble, t.optimizer) >= 0


def test_no_pipeline_runs_microbatches_back_to_back():
    plan = load(mesh="dp = 2, tp = 8", extra="data = zero1 over dp")
    e = estimate_plan(plan)
    [stage] = e.stage_times
    assert e.time.pipeline == pytest.approx(16 * (stage.forward + stage.backward))
    assert e.time.bubble == pytest.approx(0.0)


def test_gradient_reduction_hides_behind_the_last_backward():
    plan = load(mesh="dp = 16", extra="data = replicate over dp")
    e = estimate_plan(plan)
    [stage] = e.stage_times
    links = plan_links(plan)
    reduce = collective_seconds("all_reduce", (stage.dense_params + stage.expert_params) * 4, links.data)  # fp32 gradients
    device = plan.cluster.groups[0].node.device
    perfect = device.model_copy(update={"comm_share": 0.0})  # the collective takes nothing from the backward
    tail = rank_tail([stage], 0, (16, 16), 2, links, perfect, plan.train.optimizer, plan.train.precision)
    assert tail.exposed == pytest.approx(max(0.0, reduce - stage.backward))
    # by default it takes the device's share of the backward while it runs (cost.comm.beside)
    tail = rank_tail([stage], 0, (16, 16), 2, links, device, plan.train.optimizer, plan.train.precision)
    assert tail.exposed == pytest.approx(max(reduce - stage.backward, device.contention * reduce))
    assert e.time.communication >= tail.exposed


def test_tensor_parallel_collectives_sit_on_the_critical_path():
    inside = estimate_plan(load(mesh="dp = 2, pp = 1, tp = 8", extra="data = zero1 over dp"))
    across = estimate_plan(load(mesh="tp = 8, dp = 2", extra="data = zero1 over dp"))  # tp straddles nodes
    assert across.stage_times[0].comm > inside.stage_times[0].comm > 0


def test_memory_is_the_memory_model_with_the_schedules_inflight_microbatches():
    plan = load()
    assignment, _ = assign_stages(plan)
    e = estimate_plan(plan)
    expected = estimate_plan_memory(plan, assignment)
    assert [m.total for m in e.memory] == pytest.approx([m.total for m in expected])
    assert e.capacity == pytest.approx((80 * 2**30 * (1 - ir.DEFAULT_RESERVE),) * 4)  # the device's memory less its reserve
    assert e.fits


def test_stage_costs_for_the_simulator_are_the_estimates():
    plan = load()
    assignment, _ = assign_stages(plan)
    costs = estimate_stage_costs(plan, assignment)
    e = estimate_plan(plan)
    assert [c[0] for c in costs.stage_costs] == pytest.approx([s.forward for s in e.stage_times])
    assert [c[1] for c in costs.stage_costs] == pytest.approx([s.backward for s in e.stage_times])
    assert costs.p2p == pytest.approx(e.time.p2p)


def test_faster_devices_and_links_never_slow_a_plan_down():
    plan = load()
    faster = plan.model_copy(update={"cluster": api.loads(
        'import "clusters/dgx_h100"\ncluster c = dgx_h100 x 2\n').clusters[0]})
    assert estimate_plan(faster).time.step < estimate_plan(plan).time.step


def test_cli_estimate_text_and_json(tmp_path):
    path = tmp_path / "p.plan"
    path.write_text(PLAN.format(mesh="dp = 2, pp = 4, tp = 2", recompute="full",
                                extra="data = zero1 over dp\n  stages = evenly over pp"), encoding="utf-8")
    runner = CliRunner()
    text = runner.invoke(main, ["estimate", str(path)])
    assert text.exit_code == 0, text.output
    for word in ("step time", "compute", "comm exposed", "bubble", "memory per device", "activations", "MFU"):
        assert word in text.output
    out = runner.invoke(main, ["estimate", str(path), "--json"])
    data = json.loads(out.output)
    assert {"step_time_s", "tokens_per_s", "tflops_per_device", "mfu", "peak_memory_bytes", "memory", "time"} <= set(data)
    assert {"params", "grads", "optimizer", "activations", "total"} <= set(data["memory"][0])
    bad = runner.invoke(main, ["estimate", str(tmp_path / "missing.plan")])
    assert bad.exit_code == 1 and "Traceback" not in bad.output


def test_gpt3_on_1024_a100s_is_near_megatrons_measured_140_tflops():
    """Narayanan et al. 2021, Sec. 5.1: 140 TFLOP/s per GPU (docs/validation.md: t8 p8 d16 assumed)."""
    plan = api.load_plan("stdlib_plans/examples/gpt3_175b_3d.plan")
    assert estimate_plan(plan).tflops_per_device == pytest.approx(140, rel=0.3)


@pytest.mark.parametrize("compute_per_unit, traffic_per_unit", [(3.0, 1.0), (1.0, 3.0)])
def test_zero3_overlaps_each_unit_with_its_neighbours_compute_only(compute_per_unit, traffic_per_unit):
    # u units; per unit: forward compute c, backward 2c, and all-gather = reduce-scatter = x. The first
    # unit's gather has no compute beside it; the last unit's reduce-scatter runs behind the rank's
    # next work (Zhao et al. 2023, prefetching): g + (u - 1)·max(c, traffic) + c.
    from plandsl.cost.comm import GroupLinks
    from plandsl.cost.layer import Links
    from plandsl.cost.memory import STATE_BYTES
    from plandsl.cost.stage import zero_traffic
    u, element, dense = 4, STATE_BYTES, 1e9  # fp32 compute: parameters gathered as wide as gradients
    # One node of 2 devices, no latency: an all-gather or reduce-scatter of S bytes takes S/2/bandwidth.
    bandwidth = dense / u * element / 2 / traffic_per_unit
    links = Links(data=GroupLinks(2, 2, 1, bandwidth, 0.0, bandwidth, 0.0))
    c, x = compute_per_unit, traffic_per_unit
    stage = zero_traffic(u * c, u * c, u * c, 0.0, 1.0, 0.0, dense, 0.0, 3, element, links, units=u)
    assert stage.forward == pytest.approx(max(u * c, u * x) + min(c, x))
    assert stage.backward == pytest.approx({(3.0, 1.0): 25.0, (1.0, 3.0): 23.0}[(c, x)])  # x + 3·max(2c, 2x) + 2c
    assert stage.comm == pytest.approx(stage.forward + stage.backward - 3 * u * c)
    # ZeRO-2 only reduce-scatters, behind the backward: 3·max(2c, x) + 2c.
    zero2 = zero_traffic(u * c, u * c, u * c, 0.0, 1.0, 0.0, dense, 0.0, 2, element, links, units=u)
    assert zero2.forward == u * c
    assert zero2.backward == pytest.approx({(3.0, 1.0): 24.0, (1.0, 3.0): 11.0}[(c, x)])
    # 16-bit compute: the gradients still move at fp32, the parameters at 2 bytes (half the gather).
    half = zero_traffic(u * c, u * c, u * c, 0.0, 1.0, 0.0, dense, 0.0, 2, 2, links, units=u)
    assert half.backward == pytest.approx(zero2.backward)
    half3 = zero_traffic(u * c, u * c, u * c, 0.0, 1.0, 0.0, dense, 0.0, 3, 2, links, units=u)
    assert half3.forward == pytest.approx(max(u * c, u * x / 2) + min(c, x / 2))


def test_each_zero3_unit_pays_the_collective_latency():
    from plandsl.cost.comm import GroupLinks
    from plandsl.cost.layer import Links
    from plandsl.cost.stage import zero_traffic
    latency = 1e-3
    links = Links(data=GroupLinks(4, 4, 1, 1e30, latency, 1e30, 0.0))  # bandwidth free: latency only
    one = zero_traffic(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1e9, 0.0, 3, 2, links, units=1)
    ten = zero_traffic(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1e9, 0.0, 3, 2, links, units=10)
    ring = 3 * latency  # a ring of 4: 3 steps
    assert one.forward == pytest.approx(ring)
    assert ten.forward == pytest.approx(10 * ring)
    # Backward: each unit's gather and reduce-scatter, the last reduce-scatter behind later work.
    assert ten.backward == pytest.approx(ring + 9 * 2 * ring)


def test_allgather_context_parallelism_gathers_kv_on_the_critical_path_and_shards_zero_over_cp():
    from plandsl.cost.estimate import plan_work
    from plandsl.cost.layer import estimate_layer_time
    from plandsl.ir.layers import layers_of
    gather = load(mesh="dp = 4, cp = 4", recompute="none", extra="data = zero1 over dp\n  context = allgather over cp")
    ring = load(mesh="dp = 4, cp = 4", recompute="none", extra="data = zero1 over dp\n  context = ring over cp")
    block = layers_of(gather.model)[1]
    device = gather.cluster.groups[0].node.device
    links = plan_links(gather)
    assert (links.cp.size, links.data.size) == (4, 16)  # gradients are reduced over dp x cp
    layer = estimate_layer_time(gather.model, block, plan_work(gather), device, links)
    kv = 2 * 2 * 1024 * 1024 * 2  # K and V of the whole sequence: 2 x micro-batch 2 x s x h, 2 bytes
    assert layer.forward_comm == pytest.approx(collective_seconds("all_gather", kv, links.cp))
    assert layer.backward_comm == pytest.approx(collective_seconds("reduce_scatter", kv, links.cp))
    rotated = estimate_layer_time(ring.model, block, plan_work(ring), device, plan_links(ring))
    assert rotated.forward_comm < layer.forward_comm  # the ring hides behind the attention core here
    # selective recomputation reruns the core, and with it the gather (or what the ring exposes)
    for kind, none in (("allgather", layer), ("ring", rotated)):
        again = load(mesh="dp = 4, cp = 4", recompute="selective",
                     extra=f"data = zero1 over dp\n  context = {kind} over cp")
        redone = estimate_layer_time(again.model, block, plan_work(again), device, plan_links(again))
        assert redone.backward_comm == pytest.approx(none.backward_comm + none.forward_comm), kind
    # ZeRO-1 shards the optimizer over all 16 ranks holding the same parameters, as dp = 16 does
    flat = load(mesh="dp = 16", recompute="none", extra="data = zero1 over dp")
    assert estimate_plan(gather).memory[0].optimizer == pytest.approx(estimate_plan(flat).memory[0].optimizer)


# ---- one bubble, one peak: the same figures in estimate, simulate and render -----------------------------
from pathlib import Path  # noqa: E402

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "stdlib_plans" / "examples").glob("*.plan"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_estimate_and_simulate_report_the_same_bubble(path):
    """`schedules.simulate.bubble_seconds` is the one definition: the busiest rank's idle time over the
    makespan, in `estimate` (seconds and fraction) as in `simulate`."""
    from plandsl.schedules.simulate import bubble_seconds
    from plandsl.cost.simulation import simulate_plan
    plan = api.load_plan(path)
    t = estimate_plan(plan).time
    if plan.stages is None or plan.schedule is None:
        assert t.bubble == 0.0 and t.bubble_fraction == 0.0
        return
    _, simulation = simulate_plan(plan)
    assert simulation.makespan == pytest.approx(t.pipeline, rel=1e-9)
    assert simulation.bubble == pytest.approx(t.bubble, rel=1e-9, abs=1e-12)
    assert simulation.bubble_fraction == pytest.approx(t.bubble_fraction, rel=1e-9, abs=1e-12)
    busiest = max(r.busy for r in simulation.ranks)
    assert simulation.bubble == pytest.approx(simulation.makespan - busiest) == \
        pytest.approx(bubble_seconds(simulation.makespan, [r.busy for r in simulation.ranks]))


def test_bubble_is_the_busiest_ranks_idle_time_not_the_mean():
    """Unbalanced stages: the slow stage's rank is busy almost all the time; the others idle for the
    imbalance, which the per-rank idle share shows and the bubble leaves out."""
    from plandsl.schedules.generators import generate
    from plandsl.schedules.simulate import Costs, simulate
    schedule = generate("1f1b", 4, 8)
    simulation = simulate(schedule, Costs(stage_costs=((1, 2, 1, 1),) * 3 + ((3, 6, 3, 3),)))
    busy = [r.busy for r in simulation.ranks]
    assert busy[3] == max(busy) == 8 * 9
    mean_idle = sum(r.idle for r in simulation.ranks) / (4 * simulation.makespan)
    assert simulation.bubble_fraction == pytest.approx((simulation.makespan - 72) / simulation.makespan)
    assert simulation.bubble_fraction < mean_idle


@pytest.mark.parametrize("command", ["estimate", "simulate"])
def test_estimate_and_simulate_text(command, golden):
    """Both print the bubble with its definition, and say what their peak memory counts."""
    path = Path(__file__).resolve().parents[2] / "stdlib_plans" / "examples" / "gpt3_175b_3d.plan"
    result = CliRunner().invoke(main, [command, str(path)])
    assert result.exit_code == 0, result.output
    assert "bubble" in result.output and "idle time of the busiest rank / makespan" in result.output
    golden(f"cli/{command}_gpt3_175b_3d.txt", result.output)


def test_communication_volume_counts_each_axis_as_the_layout_moves_it():
    """`PlanEstimate.communication`: the bytes one device of the busiest pipeline rank moves in a step. For the
    stdlib's GPT-3 175B (tp 8 with SP, pp 8 interleaved v 2, dp 16 ZeRO-1, full recompute, micro-batch 1, 96
    microbatches): per block and microbatch 6 SP pairs (2 forward, 2 backward, 2 rerun) of an all-gather and a
    reduce-scatter of [s, h] bf16; a pipeline message in and out at each edge to another rank; the ZeRO-1
    reduce-scatter of fp32 gradients and all-gather of bf16 parameters once a step."""
    from plandsl.cost.estimate import plan_work, pipeline_message_bytes
    plan = api.load_plan(STDLIB / "examples" / "gpt3_175b_3d.plan")
    estimate = api.estimate(plan)
    moved = estimate.communication
    s, h = 2048, 12288
    pair = 2 * s * h * 2
    blocks_per_rank = 96 // 8
    assert moved.tensor >= 96 * blocks_per_rank * 6 * pair
    assert moved.tensor < 96 * (blocks_per_rank * 6 * pair + 8 * pair)  # plus the embedding's and head's
    message = pipeline_message_bytes(plan.model, plan_work(plan))
    assert message == s * h * 2 / 8
    assert moved.pipeline in (96 * 2 * 3 * message, 96 * 2 * 4 * message)  # 3 edges on the first/last rank, else 4
    assert moved.context == moved.expert == 0
    params = max(m.params - m.gathered_params for m in estimate.memory) / 4  # fp32 parameters stored per device
    assert moved.data == pytest.approx(params * (4 + 2), rel=0.1)
    dp_only = api.estimate(api.load_plan(STDLIB / "examples" / "data_parallel.plan")).communication
    assert dp_only.tensor == dp_only.pipeline == 0 and dp_only.data > 0
