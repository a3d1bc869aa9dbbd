"""ZeRO-2/3 under a pipeline schedule, as torch's schedules run FSDP stages (`plandsl run`, torchtitan): a stage keeps
its parameters gathered and its gradients unsharded until every microbatch has run, then reduce-scatters them once
(`cost.memory.pipelined_shards`). The memory counts every unit whole, a microbatch moves nothing over the data axis,
and the rank's tail is the one reduce-scatter, exposed, and the one gather behind a forward."""
import pytest

from plandsl import api
from plandsl.cost.comm import beside, collective_seconds
from plandsl.cost.estimate import estimate_plan, estimate_stage_times
from plandsl.cost.layer import plan_links
from plandsl.cost.memory import estimate_plan_memory, pipelined_shards
from plandsl.ir.placement import assign_stages

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
    rest, `cost.memory.gathers_whole`)."""
    replicated = estimate_plan_memory(_plan("replicate"))
    for kind in ("zero3", "zero2"):
        held = estimate_plan_memory(_plan(kind))
        assert [m.gathered_grads for m in held] == [m.grads for m in replicated]
        assert [m.gathered_params for m in held] == [m.params for m in replicated]


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
