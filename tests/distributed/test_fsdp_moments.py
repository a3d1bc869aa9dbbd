"""`cost.memory.unit_moments`: FSDP2's units counted at the moments `plandsl run` holds them, against a rank's trace.

ZeRO-2/3 without a pipeline (`gathers_by_moments`): at the loss's backward, where the activations peak, FSDP2 holds
no unit's unsharded gradient and no block's parameters but the last block's (kept gathered) and the root's; in a
block's backward the loss's temporaries and the head's activations are gone, two blocks' parameters (the block's and
the one prefetched) and two blocks' gradients (the block's and the reduce-scatter input of the block before) are
alive, the embedding's gradient not yet. The count takes the larger moment (`fsdp_apart`); it counted every unit
beside the loss's activations before (above the trace), one block's units in a block's backward (below it). Where
the root (embedding, norm, head) outweighs a block: ZeRO-3 gathers it again for the head's backward (the all-gather's
output beside the parameters copied out of it), a tied table's two gradients and their sum live together at the
embedding's backward beside the first block's reduce-scatter input, and the root's reduce-scatter holds its input
and output in the gradients' dtype beside its gradients in the gather's. One rank traced on fake tensors with a fake
process group (`runtime.memtrace`), two steps of two microbatches, 1-3 s each.
"""
from __future__ import annotations

import pytest

from tests.distributed.ranks import load
from tests.support import lazy

memtrace = lazy("plandsl.runtime.memtrace")

pytestmark = [pytest.mark.dist, pytest.mark.xdist_group("torch")]

PLAN = """
import "clusters/local"
plan moments {{
  model    = {model}
  cluster  = localhost x 2
  mesh     = [dp = 2] over devices[0:2]
  train    = {{ global_batch: 4, micro_batch: 1, precision: {precision}, optimizer: adam, lr: 1e-3, seed: 0{train} }}
  data     = {data}
}}
"""


GPT = "gpt(layers={}, hidden={}, heads=4, seq={}, vocab={})"


@pytest.mark.parametrize("data, model, precision, train, most", [
    # the loss's backward outweighs a block's (a wide vocabulary): counted beside every unit, 1.214 x traced (zero3's
    # 1.136, then 1.055; 1.096 with the first block's reduce-scatter input at the embedding's backward: docs/validation.md)
    ("zero2", GPT.format(2, 256, 128, 4096), "fp32", "", 1.10),
    # a block's backward outweighs the loss's (a rebuilt block, small activations): 0.978 x traced with one block's
    # units there, below what the run holds
    ("zero3", GPT.format(3, 64, 32, 256), "fp32", ", recompute: full", 1.05),
    # a root (embedding, head) larger than a block: ZeRO-3 resharded it after the forward and gathers it again for
    # the head's backward, its all-gather's output beside the parameters copied out of it (0.929 x traced without)
    ("zero3", GPT.format(2, 64, 32, 4096), "fp32", "", 1.10),
    # a tied table: the head's and the embedding's gradients of it and their sum alive together, beside the first
    # block's reduce-scatter input (0.841 x traced without)
    ("zero3", "llama(layers=2, hidden=64, heads=4, kv_heads=2, seq=32, vocab=4096, tied=true)", "fp32",
     ", recompute: full", 1.10),
    # gathered in bf16: the root's reduce-scatter input and output in fp32 beside the head's bf16 gradient
    # (0.956 x traced without)
    ("zero3 over dp with gather = bf16", GPT.format(2, 64, 32, 4096), "bf16", "", 1.10),
])
def test_the_count_places_fsdps_units_at_the_moments_a_trace_holds_them(data, model, precision, train, most):
    from plandsl.cost.memory import estimate_plan_memory, gathers_by_moments
    data = data if " over " in data else f"{data} over dp"
    plan = load(PLAN.format(data=data, model=model, precision=precision, train=train))
    assert gathers_by_moments(plan) and plan.num_microbatches == 2
    trace = memtrace.trace_rank(plan, 0, 2)
    peak, _ = trace.peak_allocated(trace.steps[0])
    counted = estimate_plan_memory(plan)[0]
    assert 1.0 <= counted.total / peak <= most, (counted, peak)
