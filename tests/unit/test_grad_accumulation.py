"""Megatron-Core's gradient buffer, which a plan keeping 16-bit weights apart from the master copy (`param_dtype`)
holds at `grad_dtype`: each weight-gradient GEMM adds its product into it (gradient-accumulation fusion: it reads
and writes the buffer instead of writing its output), and a step zeroes it and scales it by 1 / data ranks
(Megatron-LM f2e5db402c: transformer_engine.py:153, param_and_grad_buffer.py:122-123 and 508)."""
import pytest

from plandsl import api, ir
from plandsl.cost.compute import (DEFAULT_EFFICIENCY, Work, accumulate_bytes, estimate_layer_compute,
                                  estimate_optimizer_step)
from plandsl.cost.estimate import estimate_plan
from plandsl.cost.memory import StateBytes
from plandsl.ir.layers import layers_of

H100 = ir.DeviceType(name="h100", memory=80 * 2**30, bandwidth=3.35e12, peak={"bf16": 989e12, "fp32": 67e12})
GPT = ir.TransformerModel(kind="gpt", name="g", layers=4, hidden=4096, heads=32, kv_heads=32, ffn_hidden=16384,
                          seq=4096, vocab=131072)


def layer(kind):
    return next(x for x in layers_of(GPT) if x.kind == kind)


def test_the_buffer_is_read_and_written_at_grad_dtype_only_beside_a_master_copy():
    assert accumulate_bytes(ir.Training(global_batch=8, micro_batch=1, param_dtype=ir.Precision.bf16)) == 8
    assert accumulate_bytes(ir.Training(global_batch=8, micro_batch=1, param_dtype=ir.Precision.bf16,
                                        grad_dtype=ir.Precision.bf16)) == 4
    assert accumulate_bytes(ir.Training(global_batch=8, micro_batch=1)) == 0  # the weights are the master


@pytest.mark.parametrize("tp", [1, 8])
def test_weight_gradient_gemms_read_and_write_the_fp32_buffer_they_accumulate_into(tp):
    """A gpt block's linear weights (12h² over tp) each cost 8 - 2 bytes more in W: the fp32 buffer read and
    written where the GEMM wrote its 16-bit output; F and I do not change. The head's weight (V·h/tp) too."""
    h = GPT.hidden
    for kind, elements in (("block", 12 * h * h / tp), ("head", -(-GPT.vocab // tp) * h)):
        plain = Work(micro_batch=2, seq=4096, tp=tp, sequence_parallel=tp > 1)
        fused = Work(micro_batch=2, seq=4096, tp=tp, sequence_parallel=tp > 1, accumulate=8)
        before = estimate_layer_compute(GPT, layer(kind), plain, H100, DEFAULT_EFFICIENCY)
        after = estimate_layer_compute(GPT, layer(kind), fused, H100, DEFAULT_EFFICIENCY)
        assert after.forward == before.forward and after.input_grad == before.input_grad
        assert after.weight_grad - before.weight_grad == pytest.approx(elements * 6 / H100.bandwidth, rel=1e-12)


PLAN = """
import "clusters/dgx_h100.plan"
plan p {{
  model   = gpt(layers=24, hidden=2048, heads=16, seq=4096, vocab=131072)
  cluster = dgx_h100 x 6
  mesh    = [dp = 48]
  train   = {{ global_batch: 192, micro_batch: {mb}{dtypes} }}
  data    = {data} over dp
}}
"""


@pytest.mark.parametrize("data, mb", [("zero1", 4), ("replicate", 2)])
def test_a_step_zeroes_the_buffer_and_scales_it_by_the_data_ranks(data, mb):
    """Megatron-LM's GPT 1.7B on 48 H100s (its README's table): the step writes zeros over its 1.75G gradients
    (4 bytes each) and scales them by 1/48 before their reduce-scatter (read and write): 12 bytes per parameter at
    the HBM's bandwidth, 6.3 ms beside the optimizer step over its shard; none where the weights are the master."""
    plan = api.loads(PLAN.format(data=data, mb=mb, dtypes=", param_dtype: bf16"), path="p.plan").plans[0]
    estimate = estimate_plan(plan)
    [stage] = estimate.stage_times
    device = plan.cluster.devices_in_order()[0]
    owned = stage.dense_params if data == "replicate" else -(-stage.dense_params // 48)
    step = estimate_optimizer_step(owned, device, plan.train.optimizer, plan.train.precision,
                                   StateBytes.of(plan.train))
    assert estimate.time.optimizer - step == pytest.approx(stage.dense_params * 12 / device.bandwidth, rel=1e-9)
    assert estimate.time.optimizer - step == pytest.approx(6.3e-3, rel=0.03)
    master = estimate_plan(api.loads(PLAN.format(data=data, mb=mb, dtypes=""), path="p.plan").plans[0])
    assert master.time.optimizer == pytest.approx(
        estimate_optimizer_step(owned, device, plan.train.optimizer, plan.train.precision), rel=1e-9)


def test_zero3_keeps_no_whole_buffer_to_zero():
    plan = api.loads(PLAN.format(data="zero3", mb=4, dtypes=", param_dtype: bf16"), path="p.plan").plans[0]
    estimate = estimate_plan(plan)
    [stage] = estimate.stage_times
    device = plan.cluster.devices_in_order()[0]
    step = estimate_optimizer_step(-(-stage.dense_params // 48), device, plan.train.optimizer, plan.train.precision,
                                   StateBytes.of(plan.train))
    assert estimate.time.optimizer == pytest.approx(step, rel=1e-9)


def estimate_states(plan):
    from plandsl.cost.memory import StateBytes
    return StateBytes.of(plan.train)


def test_multi_token_predictions_projection_accumulates_its_weight_gradient_too():
    """`eh_proj` (2h -> h, column-parallel over tp) is a linear layer like the block's: its W reads and writes the
    buffer, 6 more bytes per weight element than the 16-bit output the GEMM model writes; F and I do not change."""
    from plandsl.cost.compute import mtp_projection_compute
    h = GPT.hidden
    for tp in (1, 8):
        plain = Work(micro_batch=2, seq=4096, tp=tp)
        fused = Work(micro_batch=2, seq=4096, tp=tp, accumulate=8)
        before, after = (mtp_projection_compute(GPT, work, H100, DEFAULT_EFFICIENCY) for work in (plain, fused))
        assert after.forward == before.forward and after.input_grad == before.input_grad
        assert after.weight_grad - before.weight_grad == pytest.approx(2 * h * h / tp * 6 / H100.bandwidth, rel=1e-12)
