"""ZeRO-1's gradient buckets as Megatron-Core fills them: the bucket of a rank's first layers (the embedding's,
which cannot be split) is reduced only after the backward ends and gathered before the next forward starts, so
its reduce-scatter and all-gather stay exposed even when the rest hides behind the backward and forward."""
import pytest

from plandsl import api
from plandsl.cost.comm import beside, collective_seconds
from plandsl.cost.estimate import estimate_plan
from plandsl.cost.layer import plan_links
from plandsl.cost.stage import bucket_params, first_bucket


def test_the_bucket_is_megatrons_default():
    assert bucket_params(8) == 40e6 and bucket_params(40) == 40e6 and bucket_params(48) == 48e6


def test_the_first_bucket_is_what_the_backward_walk_leaves_for_the_first_layers():
    blocks = [12 * 2048**2 + 13 * 2048] * 24               # GPT 1.7B's blocks, each over a 48M bucket alone
    embedding, head = 131072 * 2048 + 4096 * 2048, 131072 * 2048
    assert first_bucket([embedding, *blocks, 4096, head], 48e6) == embedding   # closed alone: it cannot split
    assert first_bucket(blocks, 48e6) == blocks[0]
    assert first_bucket([10e6] * 10, 40e6) == 20e6          # two buckets of four layers, the first two left
    assert first_bucket([10e6] * 8, 40e6) == 40e6            # nothing left: the last bucket closed is the first
    assert first_bucket([], 40e6) == 0.0


PLAN = """
import "clusters/dgx_h100.plan"
plan p {{
  model   = gpt(layers=24, hidden=2048, heads=16, seq=4096, vocab=131072)
  cluster = dgx_h100 x 6
  mesh    = [dp = 48]
  train   = {{ global_batch: 192, micro_batch: {mb}, param_dtype: bf16 }}
  data    = {data} over dp
}}
"""


def test_zero1_exposes_the_first_buckets_reduce_scatter_and_all_gather():
    """Megatron-LM's GPT 1.7B on 48 H100s (its README's table): all the gradients' reduce-scatter (24 ms) hides
    behind the 0.2 s backward, but the embedding's bucket (277M parameters) is exposed: 5.1 ms of fp32
    reduce-scatter after the backward, 2.6 ms of bf16 all-gather before the forward (4.6 and 2.3 ms before NVLink
    was priced at the 360 GB/s NCCL reaches on H100s, not its datasheet's 450)."""
    plan = api.loads(PLAN.format(data="zero1", mb=4), path="p.plan").plans[0]
    estimate = estimate_plan(plan)
    links = plan_links(plan).data
    bucket = 131072 * 2048 + 4096 * 2048
    exposed = collective_seconds("reduce_scatter", 4 * bucket, links) + collective_seconds("all_gather", 2 * bucket, links)
    assert exposed == pytest.approx(7.7e-3, rel=0.02)
    # the other buckets behind the backward and the forward cost them the device's share (cost.comm.beside)
    [stage], share = estimate.stage_times, plan.cluster.devices_in_order()[0].contention
    hidden = beside(collective_seconds("reduce_scatter", 4 * stage.dense_params, links)
                    - collective_seconds("reduce_scatter", 4 * bucket, links), stage.backward, share) \
        + beside(collective_seconds("all_gather", 2 * stage.dense_params, links)
                 - collective_seconds("all_gather", 2 * bucket, links), stage.forward, share)
    assert estimate.time.step == pytest.approx(estimate.time.pipeline + exposed + hidden + estimate.time.optimizer,
                                               rel=1e-9)
    # replicate (ZeRO-0) keeps its all-reduce (48 ms) behind the backward (about 100 ms at micro-batch 2), at the
    # device's share of its seconds
    replicated = estimate_plan(api.loads(PLAN.format(data="replicate", mb=2), path="p.plan").plans[0])
    [stage] = replicated.stage_times
    reduce = collective_seconds("all_reduce", 4 * stage.dense_params, links)
    assert reduce < stage.backward
    assert replicated.time.step == pytest.approx(replicated.time.pipeline + share * reduce
                                                 + replicated.time.optimizer, rel=1e-9)


def test_zero2_and_zero3_end_their_backward_on_the_same_bucket():
    """FSDP's and DeepSpeed's last reduce-scatter is the first layers' unit, and the optimizer step waits for it:
    ZeRO-2 and ZeRO-3 pay the bucket's reduce-scatter after the backward as ZeRO-1 does, ZeRO-2 its all-gather
    before the forward, so on a plan where all three hide everything else none wins by leaving it out."""
    plans = {kind: api.loads(PLAN.format(data=kind, mb=4), path="p.plan").plans[0] for kind in ("zero1", "zero2")}
    links = plan_links(plans["zero1"]).data
    bucket = 131072 * 2048 + 4096 * 2048
    scatter = collective_seconds("reduce_scatter", 4 * bucket, links)
    gather = collective_seconds("all_gather", 2 * bucket, links)
    tails = {kind: (lambda e: e.time.step - e.time.pipeline - e.time.optimizer)(estimate_plan(plan))
             for kind, plan in plans.items()}
    # the rest of the gathers behind the forward, and for ZeRO-1 the rest of the reduce-scatters behind the backward
    # (ZeRO-2 reduced those unit by unit during it), cost the device's share of their seconds
    stage, share = estimate_plan(plans["zero2"]).stage_times[0], plans["zero2"].cluster.devices_in_order()[0].contention
    rest_gather = beside(collective_seconds("all_gather", 2 * stage.dense_params, links) - gather, stage.forward, share)
    rest_scatter = beside(collective_seconds("reduce_scatter", 4 * stage.dense_params, links) - scatter,
                          estimate_plan(plans["zero1"]).stage_times[0].backward, share)
    assert tails["zero2"] == pytest.approx(scatter + gather + rest_gather, rel=1e-9)
    assert tails["zero1"] == pytest.approx(tails["zero2"] + rest_scatter, rel=1e-9)
    zero3 = estimate_plan(api.loads(PLAN.format(data="zero3", mb=4), path="p.plan").plans[0])
    assert zero3.time.step - zero3.time.pipeline - zero3.time.optimizer >= scatter
