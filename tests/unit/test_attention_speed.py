"""The fused attention kernel at the device's own speed: a device that states `attention` (and
`attention_backward`) runs the attention core's executed FLOPs, the causal triangle's tiles and not the full
s x s, at those fractions of its peak, the backward 2.5 times the forward's FLOPs (FlashAttention's count); a
device that does not keeps the core priced as a batched GEMM over the full s x s at its GEMM knob."""
import math

import pytest

from plandsl import api
from plandsl.cost.compute import causal_fraction, estimate_layer_compute
from plandsl.cost.estimate import plan_work
from plandsl.ir.layers import layers_of

PLAN = """
device g {{
  memory = 80 GiB
  bandwidth = 2 TB/s
  peak = {{ bf16: 1000 TFLOP/s }}
  efficiency = {{ matmul: 0.5, kernel_latency: 0 us{extra} }}
}}
node n {{ devices = 1 x g; link = {{ bandwidth: 100 GB/s }} }}
plan p {{
  model   = llama(layers=1, hidden=1024, heads=8, seq={seq}, vocab=1000)
  cluster = n
  mesh    = [dp = 1]
  train   = {{ global_batch: 1, micro_batch: 1 }}
}}
"""


def _block(seq: int, extra: str = ""):
    plan = api.loads(PLAN.format(seq=seq, extra=extra), path="p.plan").plans[0]
    block = next(layer for layer in layers_of(plan.model) if layer.kind == "block")
    return estimate_layer_compute(plan.model, block, plan_work(plan), plan.cluster.devices_in_order()[0])


def test_causal_fraction_counts_the_diagonal_tiles():
    # n x n tiles of 128, those on and below the diagonal: 1 of 1, 3 of 4, 36 of 64
    assert causal_fraction(128) == 1.0 and causal_fraction(256) == 0.75 and causal_fraction(1024) == 36 / 64
    assert causal_fraction(100) == 1.0 and causal_fraction(8192) == pytest.approx(0.5078125)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_each_context_parallel_rank_executes_the_same_fraction(cp):
    """Load-balanced chunks (Megatron's and torch's): the sequence in 2cp chunks, rank r holding chunks r and
    2cp - 1 - r. Counting each rank's executed tiles of 128 against all keys, tile by tile, every rank executes the
    whole triangle's fraction of its rectangle, causal_fraction(seq), not that of its own s/cp square."""
    seq, tile = 8192, 128
    n = seq // tile
    per_chunk = n // (2 * cp)
    for rank in range(cp):
        rows = [chunk * per_chunk + i for chunk in (rank, 2 * cp - 1 - rank) for i in range(per_chunk)]
        executed = sum(q + 1 for q in rows)  # query tile q meets key tiles 0 .. q
        assert executed / (len(rows) * n) == pytest.approx(causal_fraction(seq))
    assert causal_fraction(seq // cp) > causal_fraction(seq)


def test_a_stated_kernel_runs_the_executed_flops_at_its_fractions():
    """seq 2048, hidden 1024 (8 heads of 128): the full Q·Kᵀ and P·V are 2 · 2 · 2048² · 1024 = 17.18 GFLOP; a causal
    mask executes 136 of 256 tiles of 128 (16 · 17 / 2), 9.13 GFLOP; at 0.4 of 1000 TFLOP/s that is 22.8 µs, plus
    Q, K, V and O read and written once (4 · 2048 · 1024 · 2 bytes = 16.8 MB at 2 TB/s: 8.4 µs). The backward runs
    2.5 times the FLOPs at 0.25 (91.3 µs) and moves twice the bytes (16.8 µs)."""
    seq, width = 2048, 1024
    executed = 2 * 2 * seq * seq * width * 136 / 256
    moved = 4 * seq * width * 2
    plain, stated = _block(seq), _block(seq, ", attention: 0.4, attention_backward: 0.25")
    forward = executed / (0.4 * 1e15) + moved / 2e12
    backward = 2.5 * executed / (0.25 * 1e15) + 2 * moved / 2e12
    assert stated.attention == pytest.approx(forward, rel=1e-9)
    # everything else in the block is priced as before: the difference is the attention core's
    gemm = 2 * 2 * seq * seq * width / (0.5 * 1e15) + moved / 2e12  # the full s x s as a GEMM at matmul 0.5
    assert plain.attention == pytest.approx(gemm, rel=1e-9)
    assert stated.forward_matmul - plain.forward_matmul == pytest.approx(forward - gemm, rel=1e-9)
    assert stated.backward_matmul - plain.backward_matmul == pytest.approx(backward - 2 * gemm, rel=1e-9)
    assert stated.flops == plain.flops  # model FLOPs (MFU) count the full s x s either way


def test_the_backward_fraction_defaults_to_the_forwards():
    one, both = _block(4096, ", attention: 0.3"), _block(4096, ", attention: 0.3, attention_backward: 0.3")
    assert one.backward_matmul == both.backward_matmul and one.attention == both.attention


RING = """
device g {{
  memory = 80 GiB
  bandwidth = 2 TB/s
  peak = {{ bf16: 1000 TFLOP/s }}
  efficiency = {{ matmul: 0.5, kernel_latency: 0 us, attention: 0.5, attention_backward: {backward} }}
  comm_share = 0
}}
node n {{ devices = 2 x g; link = {{ bandwidth: 20 GB/s }} }}
plan p {{
  model   = llama(layers=1, hidden=1024, heads=8, seq=16384, vocab=1000)
  cluster = n
  mesh    = [cp = 2]
  train   = {{ global_batch: 1, micro_batch: 1 }}
  context = ring over cp
}}
"""


def test_the_rings_backward_hides_behind_the_kernels_own_backward():
    """Ring attention's backward passes K, V and their gradients (twice the forward's bytes) behind the core's
    backward: with the device's own attention kernel, that kernel's backward, not twice the forward. A slower
    backward kernel (0.1 of the peak against 0.9) hides more of the same traffic."""
    from plandsl.cost.estimate import estimate_plan
    fast, slow = (estimate_plan(api.loads(RING.format(backward=b), path="p.plan").plans[0]) for b in (0.9, 0.1))
    assert fast.time.communication > slow.time.communication


def test_a_kernel_stated_by_sequence_runs_at_the_ratio_interpolated_in_log_tokens():
    """`attention_by_sequence` scales `attention` and `attention_backward` by the ratio at the sequence, linear in
    ln tokens between rows (2,896 tokens, halfway between 2,048 and 4,096 in the logarithm: 0.9), the ends held
    beyond them; the rest of the block is priced as before."""
    curve = ", attention: 0.4, attention_backward: 0.25, attention_by_sequence: [[2048, 0.8], [4096, 1], [16384, 1.2]]"
    flat = ", attention: 0.4, attention_backward: 0.25"
    for seq, ratio in ((1024, 0.8), (2048, 0.8), (2896, 0.8 + 0.2 * math.log(2896 / 2048) / math.log(2)),
                       (4096, 1.0), (32768, 1.2)):
        scaled, plain = _block(seq, curve), _block(seq, flat)
        moved = 4 * seq * 1024 * 2 / 2e12  # Q, K, V and O at 2 TB/s: not scaled
        assert scaled.attention - moved == pytest.approx((plain.attention - moved) / ratio, rel=1e-9), seq
        assert scaled.backward_matmul - plain.backward_matmul == pytest.approx(
            (plain.attention - moved) * 2.5 * 0.4 / 0.25 * (1 / ratio - 1), rel=1e-6), seq
        assert scaled.flops == plain.flops
