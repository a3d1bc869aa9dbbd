"""Compute cost terms in closed form: the GEMM roofline, FLOPs per layer against the models'
catalogue and Megatron's count, backward = 2 x forward, recomputation, the optimizer step."""
import pytest

from plandsl import ir
from plandsl.cost.compute import (DEFAULT_EFFICIENCY, Efficiency, Work, estimate_layer_compute,
                                  estimate_optimizer_step)
from plandsl.ir.layers import layers_of, transformer_block_flops

A100 = ir.DeviceType(name="a100", memory=80 * 2**30, bandwidth=2.0e12, peak={"bf16": 312e12, "fp32": 19.5e12})
GPT = ir.TransformerModel(kind="gpt", name="g", layers=4, hidden=4096, heads=32, kv_heads=32, ffn_hidden=16384,
                          seq=2048, vocab=51200)
LLAMA = ir.TransformerModel(kind="llama", name="l", layers=4, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336,
                            seq=8192, vocab=128256)
MOE = ir.TransformerModel(kind="llama", name="m", layers=2, hidden=1024, heads=8, kv_heads=8, ffn_hidden=2048,
                          seq=1024, vocab=32000, experts=8, top_k=2)
EFF = Efficiency(peak_fraction=0.8, kernel_seconds=10e-6)


def layer(model, kind):
    return next(x for x in layers_of(model) if x.kind == kind)


def test_gemm_is_flops_at_a_fraction_of_peak_plus_operand_bytes_plus_a_kernel_time():
    m, n, k = 2048, 4096, 1024
    expected = 2 * m * n * k / (0.8 * 312e12) + (m * k + k * n + m * n) * 2 / 2.0e12 + 10e-6
    assert EFF.gemm_seconds(m, n, k, A100, ir.Precision.bf16) == pytest.approx(expected, rel=1e-12)
    batched = 3 * (expected - 10e-6) + 10e-6  # one kernel for the batch
    assert EFF.gemm_seconds(m, n, k, A100, ir.Precision.bf16, count=3) == pytest.approx(batched, rel=1e-12)


def test_small_shards_run_less_efficiently_and_large_ones_approach_the_fraction():
    big = EFF.efficiency(8192, 8192, 8192, A100, ir.Precision.bf16)
    small = EFF.efficiency(2048, 512, 4096, A100, ir.Precision.bf16)
    assert small < big < 0.8
    assert big > 0.7
    # efficiency = 1 / (1/f + (peak / bandwidth) / intensity + peak * kernel_seconds / flops)
    m = n = k = 4096
    flops = 2 * m * n * k
    intensity = flops / ((m * k + k * n + m * n) * 2)
    closed = 1 / (1 / 0.8 + (312e12 / 2.0e12) / intensity + 312e12 * 10e-6 / flops)
    assert EFF.efficiency(m, n, k, A100, ir.Precision.bf16) == pytest.approx(closed, rel=1e-12)


@pytest.mark.parametrize("model", [GPT, LLAMA, MOE])
def test_block_flops_are_the_catalogue_flops(model):
    work = Work(micro_batch=2, seq=model.seq)
    result = estimate_layer_compute(model, layer(model, "block"), work, A100, EFF)
    assert result.flops == pytest.approx(transformer_block_flops(model) * work.tokens, rel=1e-12)


def test_gpt_block_flops_are_megatrons_24bsh2_plus_4bs2h_split_over_tensor_parallel():
    b, s, h, t = 2, GPT.seq, GPT.hidden, 4
    work = Work(micro_batch=b, seq=s, tp=t)
    result = estimate_layer_compute(GPT, layer(GPT, "block"), work, A100, EFF)
    assert result.flops == pytest.approx((24 * b * s * h * h + 4 * b * s * s * h) / t, rel=1e-12)


def test_head_is_the_logit_gemm_2bshv():
    work = Work(micro_batch=1, seq=GPT.seq, tp=8)
    result = estimate_layer_compute(GPT, layer(GPT, "head"), work, A100, EFF)
    assert result.flops == pytest.approx(2 * GPT.seq * GPT.hidden * GPT.vocab / 8, rel=1e-12)
    assert result.forward_matmul == pytest.approx(
        EFF.gemm_seconds(GPT.seq, GPT.vocab / 8, GPT.hidden, A100, ir.Precision.bf16), rel=1e-12)


def test_backward_is_twice_forward_and_splits_into_input_and_weight_gradients():
    result = estimate_layer_compute(GPT, layer(GPT, "block"), Work(1, GPT.seq), A100, EFF)
    assert result.backward_matmul == pytest.approx(2 * result.forward_matmul)
    assert result.backward_other == pytest.approx(2 * result.forward_other)
    assert result.input_grad + result.weight_grad == pytest.approx(result.backward)
    assert result.weight_grad == pytest.approx(result.forward_matmul)


@pytest.mark.parametrize("recompute", list(ir.Recompute))
def test_recomputation_adds_a_forward(recompute):
    work = Work(1, GPT.seq, recompute=recompute)
    result = estimate_layer_compute(GPT, layer(GPT, "block"), work, A100, EFF)
    s, h = GPT.seq, GPT.hidden
    # selective_op (gpt): wk and wo rerun, with everything outside the GEMMs
    op = EFF.gemm_seconds(s, h, h, A100, ir.Precision.bf16) * 2 + result.forward_other
    expected = {"none": 0.0, "selective": result.attention, "selective_op": op,
                "full": result.forward}[recompute.value]
    assert result.recompute == pytest.approx(expected)
    flops = {"none": 0.0, "selective": 4.0 * s * s * h, "selective_op": 2 * 2.0 * s * h * h,
             "full": result.flops}[recompute.value]
    assert result.recompute_flops == pytest.approx(flops)


def test_non_matmul_work_moves_bytes_at_the_device_bandwidth():
    slow = A100.model_copy(update={"bandwidth": 1.0e12})
    work = Work(1, GPT.seq)
    fast_norm = estimate_layer_compute(GPT, layer(GPT, "norm"), work, A100, EFF)
    slow_norm = estimate_layer_compute(GPT, layer(GPT, "norm"), work, slow, EFF)
    assert slow_norm.forward_other == pytest.approx(2 * fast_norm.forward_other)
    assert fast_norm.forward_other == pytest.approx(4 * GPT.seq * GPT.hidden * 2 / 2.0e12)
    # sequence parallelism splits the norm's tokens over the tensor-parallel ranks
    sp = estimate_layer_compute(GPT, layer(GPT, "norm"), Work(1, GPT.seq, tp=4, sequence_parallel=True), A100, EFF)
    assert sp.forward_other == pytest.approx(fast_norm.forward_other / 4)


def test_context_parallel_splits_queries_not_keys():
    full = estimate_layer_compute(GPT, layer(GPT, "block"), Work(1, GPT.seq), A100, EFF)
    split = estimate_layer_compute(GPT, layer(GPT, "block"), Work(1, GPT.seq, cp=4), A100, EFF)
    assert split.flops == pytest.approx(full.flops / 4)


def test_expert_parallel_keeps_per_device_flops_for_balanced_routing():
    one = estimate_layer_compute(MOE, layer(MOE, "block"), Work(1, MOE.seq), A100, EFF)
    four = estimate_layer_compute(MOE, layer(MOE, "block"), Work(1, MOE.seq, ep=4), A100, EFF)
    assert four.flops == pytest.approx(one.flops)


def test_optimizer_step_reads_and_writes_states_gradients_and_parameters():
    # Adam, 16-bit: 12 bytes of states read and written, a 2-byte gradient read, a 2-byte parameter written.
    seconds = estimate_optimizer_step(1e9, A100, ir.Optimizer.adam, ir.Precision.bf16)
    assert seconds == pytest.approx(1e9 * (2 * 12 + 2 + 2) / 2.0e12)


def test_default_efficiency_is_a_fraction():
    assert 0 < DEFAULT_EFFICIENCY.peak_fraction <= 1
    assert DEFAULT_EFFICIENCY.kernel_seconds >= 0


def test_a_device_brings_its_own_gemm_knobs_and_an_override_wins():
    own = A100.model_copy(update={"efficiency": ir.DeviceEfficiency(matmul=0.8, kernel_latency=10e-6)})
    work = Work(micro_batch=1, seq=2048)
    block = layer(GPT, "block")
    assert estimate_layer_compute(GPT, block, work, own) == estimate_layer_compute(GPT, block, work, A100, EFF)
    # No knobs in the description: the language's defaults, the fit.
    assert estimate_layer_compute(GPT, block, work, A100) == \
        estimate_layer_compute(GPT, block, work, A100, DEFAULT_EFFICIENCY)
    assert (DEFAULT_EFFICIENCY.peak_fraction, DEFAULT_EFFICIENCY.kernel_seconds) == (0.64, 18e-6)
    # An explicit efficiency (the fit's override) replaces the device's own.
    assert estimate_layer_compute(GPT, block, work, own, DEFAULT_EFFICIENCY) == \
        estimate_layer_compute(GPT, block, work, A100)


def test_eager_rotary_under_latent_attention_is_q_per_head_and_the_one_shared_key():
    """`kernels: eager` prices rotary per element of q and of k (`EagerBytes`): under MLA q's rope part is
    heads x qk_rope_head_dim, split over the tensor axis, and k's is one qk_rope_head_dim for every head (computed
    from the replicated latent, on the sequence shard), as Hugging Face's DeepseekV3Attention rotates k_rot with
    one head before expanding it, and as the fused count has it. The rest of the block by the same table."""
    from plandsl.cost.compute import EAGER
    mla = ir.TransformerModel(kind="llama", name="d", layers=2, hidden=2048, heads=16, kv_heads=16, ffn_hidden=8192,
                              seq=1024, vocab=32000, q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64,
                              qk_nope_head_dim=128, v_head_dim=128)
    tp, tokens, h = 2, 1024, 2048
    work = Work(micro_batch=1, seq=1024, tp=tp, sequence_parallel=True, kernels=ir.Kernels.eager)
    eager = EAGER[2]
    norms = (2 * h + 1536 + 512) / tp
    rotary = 16 * 64 / tp + 64 / tp
    forward = tokens * (norms * eager.norm_forward + h / tp * eager.block_forward + rotary * eager.rotary_forward
                        + 8192 / tp * eager.gate_forward) / A100.bandwidth
    backward = tokens * (norms * eager.norm_backward + h / tp * eager.block_backward
                         + rotary * eager.rotary_backward + 8192 / tp * eager.gate_backward) / A100.bandwidth
    found = estimate_layer_compute(mla, layer(mla, "block"), work, A100, EFF)
    assert (found.forward_other, found.backward_other) == (pytest.approx(forward, rel=1e-12),
                                                           pytest.approx(backward, rel=1e-12))
