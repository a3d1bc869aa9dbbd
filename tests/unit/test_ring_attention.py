"""Ring attention step by step (`cost.ring`, `context = ring over cp with implementation = te | torch`): what each
implementation's steps move beyond the fused attention kernel, counted here op by op from their code, and what the
ring sends; the language's option and what the search writes."""
import pytest

from plandsl import api, ir
from plandsl.cost.comm import NO_COMM
from plandsl.cost.compute import Work
from plandsl.cost.ring import HIGHER, LOWER, estimate_ring, merge_bytes
from plandsl.diagnostics import PlanError

E = 2  # bf16

# torch's `_SDPAMerger` (torch/distributed/tensor/experimental/_attention.py, torch 2.6-2.13), one later step op by op,
# as (bytes read, bytes written) per element of the step's output: `step` converts it to fp32, `_merge_one` computes
# `out - F.sigmoid(block_lse - lse) * (out - block_out)` (the sigmoid is over the log-sum-exp, one per row of d)
TORCH_MERGE = {"block_out.to(float32)": (E, 4), "out - block_out": (4 + 4, 4), "sigmoid(...) * (...)": (4, 4),
               "out - (...)": (4 + 4, 4)}
TORCH_PARTIAL = {"torch.cat(chunks) of the whole output": (4, 4)}  # `_partial_update` rebuilds it
# `_templated_ring_attention_backward`, per element of each fp32 buffer: `grad += grad_` (fp32 += 16-bit), and the
# `torch.cat` of dK and dV into the buffer `dkv_rotater` sends
TORCH_ACCUMULATE = {"grad += grad_": (4 + E, 4)}
TORCH_SEND = {"torch.cat([grad_key.flatten(), grad_value.flatten()])": (4, 4)}


def _bytes(ops: dict) -> float:
    return sum(read + written for read, written in ops.values())


def test_torch_eager_merge_is_the_mergers_ops_one_by_one():
    merge = merge_bytes("torch", ir.Kernels.eager, E)
    assert merge.out == _bytes(TORCH_MERGE) == 36 + E
    assert merge.out_partial == _bytes(TORCH_PARTIAL)
    assert merge.dq == merge.dkv == _bytes(TORCH_ACCUMULATE)
    assert merge.grad_partial == _bytes(TORCH_PARTIAL) and merge.send_dkv == _bytes(TORCH_SEND)
    # once per pass: step 0's conversion and the final cast back; fp32 zeros and the final casts of the gradients
    assert merge.fixed_out == (E + 4) + (4 + E) and merge.fixed_dq == merge.fixed_dkv == 4 + (4 + E)
    # compiled, each step's chain is one kernel: read the fp32 result and the step's 16 bits, write fp32
    fused = merge_bytes("torch", ir.Kernels.fused, E)
    assert fused.out == fused.dq == fused.dkv == 4 + E + 4 and fused.send_dkv == 0 and fused.fixed_out == 0
    # Transformer Engine's jit-fused correction: out += out_i * exp(lse_i - lse) in 16 bits
    te = merge_bytes("te", ir.Kernels.eager, E)
    assert te.out == te.dq == te.dkv == 3 * E and te.out_partial == te.grad_partial == te.send_dkv == 0


PLAN = """
device g {{
  memory = 80 GiB
  bandwidth = 1 TB/s
  peak = {{ bf16: 1000000 PFLOP/s }}
  efficiency = {{ matmul: 1, kernel_latency: 0 us, attention: 1, attention_backward: 1 }}
}}
node n {{ devices = 4 x g; link = {{ bandwidth: 100 GB/s, latency: 0 us }} }}
plan p {{
  model   = llama(layers=1, hidden=1024, heads=8, kv_heads={kv}, seq=8192, vocab=1000)
  cluster = n
  mesh    = [cp = {cp}]
  train   = {{ global_batch: 1, micro_batch: 1 }}
  context = ring over cp{option}
}}
"""


def _ring(cp: int, implementation: str, kernels=ir.Kernels.eager, kv: int = 8):
    option = f" with implementation = {implementation}" if implementation != "te" else ""
    plan = api.loads(PLAN.format(cp=cp, kv=kv, option=option), path="p.plan").plans[0]
    device = plan.cluster.devices_in_order()[0]
    work = Work(1, 8192, cp=cp, kernels=kernels, ring=plan.context.implementation)
    from plandsl.cost.layer import plan_links
    return estimate_ring(plan.model, work, device, plan_links(plan).cp), estimate_ring(plan.model, work, device, NO_COMM)


def test_torch_ring_moves_its_merges_and_fp32_gradients_beyond_transformer_engines():
    """FLOPs free and no kernel latency: each step's time is its bytes at 1 TB/s. With as many K/V heads as query
    heads both rings' kernels read the same tensors, so what torch's adds over Transformer Engine's is the merges'
    and accumulations' bytes, counted here from the two codes: cp = 2, 4096 tokens a rank, 1024 wide."""
    tokens, width = 8192 // 2, 1024
    out = tokens * width           # the rank's output, and its dQ
    kv = 2 * tokens * width        # its K and V together
    torch, _ = _ring(2, "torch")
    te, _ = _ring(2, "te")
    # forward: the one later step is the slower side, LOWER (the whole output merged; HIGHER merges half and
    # rebuilds the whole: 19 + 8 < 38 per element of the output)
    torch_forward = ((E + 4) * out + _bytes(TORCH_MERGE) * out + (4 + E) * out  # convert, merge, cast back
                     + 2 * E * kv + 2 * E * kv)                          # K, V contiguous; concatenated for the rotater
    te_forward = 2 * E * out + 3 * E * out + 2 * E * kv                # first step scaled, one correction; K, V stacked
    assert torch.forward - te.forward == pytest.approx((torch_forward - te_forward) / 1e12, rel=1e-9)
    # backward: fp32 zeros and the casts back, step 0 (dQ, dK, dV added in full, dK and dV concatenated to send),
    # step 1 on its slower side (per buffer the larger of the LOWER and HIGHER updates), K, V made contiguous again and
    # concatenated for the all-gather
    accumulate, partial, send = _bytes(TORCH_ACCUMULATE), _bytes(TORCH_PARTIAL), _bytes(TORCH_SEND)
    lower = accumulate * out + accumulate * kv / 2 + partial * kv + send * kv
    higher = accumulate * out / 2 + partial * out + accumulate * kv + send * kv
    torch_backward = ((4 + (4 + E)) * (out + kv) + accumulate * (out + kv) + send * kv
                      + max(lower, higher) + 2 * E * kv + 2 * E * kv)
    te_backward = (2 * E * kv                                          # K, V copied into the first send buffer
                   + 3 * E * (out + kv) + max(3 * E * out + 3 * E * kv / 2, 3 * E * out / 2 + 3 * E * kv))
    assert torch.backward - te.backward == pytest.approx((torch_backward - te_backward) / 1e12, rel=1e-9)
    assert torch.forward > te.forward > 0


def test_the_ring_sends_kv_on_and_torchs_sends_its_gradients_in_fp32_as_wide_as_the_queries():
    """Forward, both send K and V once round the ring (cp - 1 chunks); backward, Transformer Engine's passes K, V
    and 16-bit dK, dV with them, torch's all-gathers K, V again and sends dK, dV in fp32 at every step. torch's
    SDPA gets K and V repeated to the query heads (torchtitan's `repeat_kv`): 8 heads over 2 K/V heads, 4x the
    bytes Transformer Engine's ring sends."""
    cp, tokens, width = 4, 8192 // 4, 1024
    for kv_heads in (8, 2):
        te, _ = _ring(cp, "te", kv=kv_heads)
        torch, _ = _ring(cp, "torch", kv=kv_heads)
        te_chunk = 2 * tokens * width * kv_heads // 8 * E
        chunk = 2 * tokens * width * E  # repeated to 8 heads
        assert te.forward_sent == (cp - 1) * te_chunk and te.backward_sent == 2 * (cp - 1) * te_chunk
        assert torch.forward_sent == (cp - 1) * chunk
        assert torch.backward_sent == (cp - 1) * chunk + cp * chunk // E * 4


def test_the_steps_kernels_and_the_later_steps_sides_carry_equal_flops():
    # each later step runs half a rank's rectangle either way: all queries on half a chunk, or half on the whole
    assert LOWER.queries * LOWER.keys == HIGHER.queries * HIGHER.keys == 0.5
    # with free FLOPs, Transformer Engine's ring over one kernel is bytes: cp = 2, t = 4096 tokens a rank, 1024 wide.
    # One kernel reads q, writes o (t each) and reads K, V of all 2t tokens: 6t; the steps read and write 4t (step 0)
    # and 3t (either side of step 1): t more. Its merges: the first output scaled (2e), one correction (3e) and K, V
    # stacked (2e over 2t)
    t, width = 4096, 1024
    te, _ = _ring(2, "te")
    expected = (7 - 6) * t * width * E + (2 * E + 3 * E) * t * width + 2 * E * 2 * t * width
    assert te.forward == pytest.approx(expected / 1e12, rel=1e-6)


def test_the_option_names_whose_ring_and_only_a_ring_takes_it():
    plan = api.loads(PLAN.format(cp=2, kv=8, option=" with implementation = torch"), path="p.plan").plans[0]
    assert plan.context.implementation == "torch"
    plain = api.loads(PLAN.format(cp=2, kv=8, option=""), path="p.plan").plans[0]
    assert plain.context.implementation == "te" and "implementation" not in plain.context.model_dump()
    with pytest.raises(PlanError) as raised:
        api.loads(PLAN.format(cp=2, kv=8, option=" with implementation = torch").replace("ring over", "allgather over"),
                  path="p.plan")
    assert [d.code for d in raised.value.diagnostics] == ["E206"]
    with pytest.raises(PlanError) as raised:
        api.loads(PLAN.format(cp=2, kv=8, option=" with implementation = megatron"), path="p.plan")
    assert [d.code for d in raised.value.diagnostics] == ["E210"]


def test_the_search_writes_the_problems_ring():
    from plandsl.search import Problem, search
    from plandsl.search.emit import Source, plan_text
    plan = api.loads(PLAN.format(cp=2, kv=8, option=" with implementation = torch"), path="p.plan").plans[0]
    problem = Problem(plan.model, plan.cluster, 1, context="ring", ring="torch")
    best = search(problem, pins={"cp": 4, "dp": 1, "tp": 1, "pp": 1}, top=1).best
    assert best.plan.context.kind == "ring" and best.plan.context.implementation == "torch"
    # priced as that ring: the same plan estimated from its own IR
    from plandsl.cost.estimate import estimate_plan
    assert best.estimate.time.step == pytest.approx(estimate_plan(best.plan).time.step, rel=1e-9)
    text = plan_text(best, problem, Source((), "m", "c"))
    assert "context = ring over cp with implementation = torch" in text
    default = search(Problem(plan.model, plan.cluster, 1), pins={"cp": 4, "dp": 1, "tp": 1, "pp": 1}, top=1).best
    assert default.plan.context.kind == "allgather"  # the search's own kind when the problem names none


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_the_ring_replaces_exactly_the_kernel_compute_prices(cp):
    """The ring's steps stand in for the one attention kernel `cost.compute` prices for the rank; what it subtracts
    must be that kernel, at the whole sequence's causal share, or with cp > 1 the ring's extra cost is off by the
    difference (causal_fraction(s/cp) against causal_fraction(s): 0.5625 against 0.5078 at 8K over 8)."""
    from plandsl.cost.compute import device_efficiency, estimate_layer_compute
    from plandsl.cost.ring import single_kernel
    from plandsl.ir.layers import layers_of
    plan = api.loads(f'''
import "clusters/dgx_h100"
plan p {{
  model   = llama(layers=2, hidden=4096, heads=32, kv_heads=8, seq=8192, vocab=1000)
  cluster = dgx_h100
  mesh    = [cp = {cp}]
  train   = {{ global_batch: 1, micro_batch: 1 }}
  context = ring over cp
}}
''', path="p.plan").plans[0]
    from plandsl.cost.estimate import plan_work
    work, device = plan_work(plan), plan.cluster.devices_in_order()[0]
    block = next(layer for layer in layers_of(plan.model) if layer.kind == "block")
    compute = estimate_layer_compute(plan.model, block, work, device)
    assert single_kernel(plan.model, work, device, device_efficiency(device))[0] == pytest.approx(compute.attention)
