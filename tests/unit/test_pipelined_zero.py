"""ZeRO-2/3 under a pipeline schedule, as torch's schedules run FSDP stages (`plandsl run`, torchtitan): a stage keeps
its parameters gathered and its gradients unsharded until every microbatch has run, then reduce-scatters them once
(`cost.memory.pipelined_shards`). The memory counts every unit whole, a microbatch moves nothing over the data axis,
and the rank's tail is the one reduce-scatter, exposed, and the one gather behind a forward."""
import pytest

from plandsl import api
from plandsl.cost.comm import beside, collective_seconds
from plandsl.cost.estimate import estimate_plan, estimate_stage_times
from plandsl.cost.layer import plan_links
from plandsl.cost.memory import (estimate_plan_memory, open_gradient_stages, open_gradients, pipelined_shards,
                                 releases_gradients)
from plandsl.ir.placement import assign_stages
from plandsl.schedules.bounded import builtin_layout
from plandsl.schedules.generators import generate
from plandsl.schedules.program import Kind

PLAN = """
import "clusters/dgx_a100.plan"
plan p {{
  model    = gpt(layers=8, hidden=1024, heads=16, seq=1024, vocab=8192)
  cluster  = dgx_a100 x 2
  mesh     = [dp = 8, pp = 2]
  train    = {{ global_batch: 64, micro_batch: 2 }}
  data     = {kind} over dp
  {pipeline}
}}
"""
PIPELINE = "stages   = evenly over pp\n  schedule = 1f1b"


def _plan(kind, pipeline=PIPELINE):
    return api.select_plan(api.loads(PLAN.format(kind=kind, pipeline=pipeline), path="p.plan"))


def test_only_sharded_data_under_a_pipeline_is_held():
    assert pipelined_shards(_plan("zero3")) and pipelined_shards(_plan("zero2"))
    assert not pipelined_shards(_plan("zero1")) and not pipelined_shards(_plan("replicate"))
    flat = api.select_plan(api.loads(PLAN.format(kind="zero3", pipeline="").replace("[dp = 8, pp = 2]", "[dp = 16]"),
                                     path="p.plan"))
    assert flat.stages is None and not pipelined_shards(flat)


def test_a_stage_holds_its_whole_parameters_and_gradients():
    """On top of its shards, each pipeline rank holds what replication would: every unit's parameters and
    gradients, whole, whatever the number of microbatches (ZeRO-2 as ZeRO-3: FSDP2 keeps its parameters sharded at
    rest, `cost.memory.gathers_whole`); replication stores them whole and, on torch's pipeline, holds `replicate`'s
    copy of the parameters beside them too (`cost.memory.replicate_copy_bytes`), the same bytes again."""
    replicated = estimate_plan_memory(_plan("replicate"))
    for kind in ("zero3", "zero2"):
        held = estimate_plan_memory(_plan(kind))
        assert [m.gathered_grads for m in held] == [m.grads for m in replicated]
        assert [m.gathered_params for m in held] == [m.params - m.gathered_params for m in replicated] \
            == [m.gathered_params for m in replicated]


def test_a_microbatch_moves_nothing_over_the_data_axis_and_the_tail_reduces_once():
    zero3, zero1 = _plan("zero3"), _plan("zero1")
    assignment, _ = assign_stages(zero3)
    held, sharded_states_only = estimate_stage_times(zero3, assignment), estimate_stage_times(zero1, assignment)
    for s, t in zip(held, sharded_states_only):
        assert (s.forward, s.backward, s.comm, s.moved.data) == pytest.approx((t.forward, t.backward, t.comm, 0.0))
    estimate = estimate_plan(zero3)
    stage = held[0]
    links = plan_links(zero3)
    scatter = collective_seconds("reduce_scatter", stage.dense_params * 4, links.data)
    gather = collective_seconds("all_gather", stage.dense_params * 2, links.data)
    tail = estimate.time.step - estimate.time.pipeline - estimate.time.optimizer
    share = zero3.cluster.devices_in_order()[0].contention  # the gather behind the forward takes its share of it
    assert tail == pytest.approx(scatter + beside(gather, stage.forward, share), rel=1e-6)
    assert beside(gather, stage.forward, 0.0) == max(0.0, gather - stage.forward)
    assert tail > 0.0


ROUND = PLAN.replace("dgx_a100 x 2", "dgx_a100 x 8").replace("[dp = 8, pp = 2]", "[dp = 8, pp = 8]") \
    .replace("layers=8,", "layers=32,").replace("global_batch: 64", "global_batch: 128")  # m = 8 = pp: one round


def _round(schedule="interleaved_1f1b", virtual=2, kind="zero3", implementation=""):
    stages = f"stages   = evenly over pp with virtual = {virtual}{implementation}\n  schedule = {schedule}"
    return api.select_plan(api.loads(ROUND.format(kind=kind, pipeline=stages), path="p.plan"))


def test_an_interleaved_rank_holds_one_stages_gradients_at_a_time():
    """torch's interleaved 1F1B over one round (8 microbatches on 8 ranks, 2 stages a rank, 2 blocks a stage) runs each
    stage's backwards together, the later stage's first, and frees a stage's unsharded gradients after its last one: a
    rank holds one stage's at a time, the larger (the embedding's on the first rank, the head's on the last), where
    Megatron-LM's pipeline (no FSDP stages) is counted with every stage's, as before. Its gathered parameters stay
    whole."""
    plan, megatron = _round(), _round(implementation=", implementation = megatron")
    assert releases_gradients(plan) and not releases_gradients(megatron)
    ranks = assign_stages(plan)[0].rank_stages()
    assert open_gradients(plan, "interleaved_1f1b", ranks) == tuple(((r,), (r + 8,)) for r in range(8))
    torch_, whole = estimate_plan_memory(plan), estimate_plan_memory(megatron)
    two_blocks = whole[3].gathered_grads / 2  # a middle rank's stage: two blocks
    for rank, (held, every) in enumerate(zip(torch_, whole)):
        assert held.gathered_grads == pytest.approx(every.gathered_grads - two_blocks, rel=1e-12), rank
        assert held.gathered_params == every.gathered_params
        assert held.grads == pytest.approx(every.grads - two_blocks, rel=1e-12)
    assert torch_[0].gathered_grads > two_blocks and torch_[7].gathered_grads > two_blocks  # the ends' stages


def test_one_stage_a_rank_holds_its_stages_gradients_as_before():
    """1F1B (one stage a rank) and interleaved 1F1B over two rounds (both stages' backwards alternate): every stage of
    a rank is open at once, its whole gradients, on torch's pipeline as on Megatron-LM's."""
    for schedule, virtual, batch in (("1f1b", 1, 128), ("interleaved_1f1b", 2, 256)):
        text = ROUND.replace("global_batch: 128", f"global_batch: {batch}")
        plans = [api.select_plan(api.loads(text.format(kind="zero3", pipeline=(
            f"stages   = evenly over pp with virtual = {virtual}{implementation}\n  schedule = {schedule}")),
            path="p.plan")) for implementation in ("", ", implementation = megatron")]
        assert open_gradients(plans[0], schedule, assign_stages(plans[0])[0].rank_stages()) is None
        torch_, megatron = (estimate_plan_memory(plan) for plan in plans)
        assert [m.gathered_grads for m in torch_] == [m.gathered_grads for m in megatron]


def test_a_split_backward_opens_a_stage_at_its_first_weight_gradient():
    """Under a zero-bubble schedule a stage's I passes compute no weight gradient: its gradients exist from its first W
    (torch's FSDP accumulates at W) to its last. torch's interleaved zero bubble over one round on 4 ranks runs rank 1's
    later stage's I passes before its earlier stage's last W but their W passes after it: one stage open at a time
    (had the I opened it, both)."""
    groups = open_gradient_stages("interleaved_zero_bubble", 4, 4, 2)
    assert groups == tuple(((r,), (r + 4,)) for r in range(4))
    row = generate("interleaved_zero_bubble", 4, 4, 2).actions[1]
    first_i = min(i for i, a in enumerate(row) if a.stage == 5 and a.kind is Kind.I)
    last_w = max(i for i, a in enumerate(row) if a.stage == 1 and a.kind is Kind.W)
    assert first_i < last_w  # an I of stage 5 while stage 1's gradients are open


@pytest.mark.parametrize("schedule, ranks, virtual", [("interleaved_1f1b", 2, 2), ("interleaved_zero_bubble", 3, 2),
                                                      ("looped_bfs", 2, 3), ("zbv", 2, 2), ("dualpipev", 2, 2)])
def test_the_open_stages_of_the_bounded_layout_are_those_of_the_whole_schedule(schedule, ranks, virtual):
    """Past `extrapolated_past` the open sets are read from a run of the same microbatches modulo the steady state's
    period (`schedules.bounded.builtin_layout`): the same sets as the whole schedule's."""
    m = 240
    whole = generate(schedule, ranks, m, virtual)
    expected = []
    for row in whole.actions:
        first, last = {}, {}
        for index, action in enumerate(row):
            if action.kind in (Kind.B, Kind.W):
                first.setdefault(action.stage, index)
                last[action.stage] = index
        sets = {frozenset(t for t in first if first[t] <= first[s] <= last[t]) for s in first}
        expected.append(tuple(sorted(tuple(sorted(a)) for a in sets if not any(a < b for b in sets))))
    assert open_gradient_stages(schedule, ranks, m, virtual) == tuple(expected)
    assert builtin_layout(schedule, ranks, m, virtual, peaks=False).microbatches < m  # a shorter run was read


def test_a_written_schedule_frees_each_stages_gradients_after_its_last_backward_as_the_built_in_does():
    """`plandsl run` lowers a written table with torch's own passes (`runtime_schedule`: `_add_reduce_grad`, a
    REDUCE_GRAD after a stage's n-th B or W), so a rank of several stages frees each stage's unsharded gradients as
    the built-in does: interleaved 1F1B over one round written as a table holds what the built-in holds (it was
    counted with every stage's at once, 321 MiB on rank 0 for the built-in's 225)."""
    table = generate("interleaved_1f1b", 2, 2, 2)
    rows = "\n".join(f"  rank {r}: " + " ".join(str(a) for a in row) for r, row in enumerate(table.actions))
    text = """import "clusters/dgx_a100"
{schedule}
plan p {{
  model    = gpt(layers=8, hidden=1024, heads=8, seq=1024, vocab=32000)
  cluster  = dgx_a100 x 1
  mesh     = [dp = 4, pp = 2]
  train    = {{ global_batch: 8, micro_batch: 1, precision: bf16 }}
  data     = zero3 over dp
  stages   = evenly over pp with virtual = 2{implementation}
  schedule = {name}
}}
"""
    def memory(schedule, name, implementation=""):
        plan = api.select_plan(api.loads(text.format(schedule=schedule, name=name, implementation=implementation),
                                         path="w.plan"))
        return [m.gathered_grads for m in estimate_plan_memory(plan)]
    written = f"schedule mine(ranks = 2, microbatches = 2) {{\n{rows}\n}}"
    assert memory(written, "mine") == pytest.approx(memory("", "interleaved_1f1b"), rel=1e-12)
    whole = memory("", "interleaved_1f1b", ", implementation = megatron")  # every stage's at once
    assert all(a < b for a, b in zip(memory(written, "mine"), whole))
