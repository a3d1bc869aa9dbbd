"""`loss: megatron`: Megatron-LM's default cross entropy (`vocab_parallel_cross_entropy` over an fp32 copy of the
logits, a pass per op, beside fused blocks). The bytes against a hand count of its ops, the time they add to the
head, the key in the language and in `generate --from`."""
import pytest

from plandsl import api, ir
from plandsl.cost.compute import MEGATRON_LOSS_BYTES, Efficiency, Work, estimate_layer_compute
from plandsl.ir.layers import layers_of
from tests.support import generated_plan

H100 = ir.DeviceType(name="h100", memory=80 * 2**30, bandwidth=3.35e12, peak={"bf16": 989e12})
EFF = Efficiency(peak_fraction=0.75, kernel_seconds=14e-6)
GPT = ir.TransformerModel(kind="gpt", name="g", layers=24, hidden=2048, heads=16, kv_heads=16, ffn_hidden=8192,
                          seq=4096, vocab=131072)


def head(work):
    return estimate_layer_compute(GPT, next(x for x in layers_of(GPT) if x.kind == "head"), work, H100, EFF)


def test_the_bytes_are_megatrons_ops_over_the_fp32_copy():
    # forward: .float() r2 w4, max r4, -= r4 w4, exp(out=) r4 w4, sum r4, div_ r4 w4; backward: mul_ r4 w4,
    # the cast back r4 w2
    assert MEGATRON_LOSS_BYTES == (2 + 4 + 4 + 8 + 8 + 4 + 8, 8 + 6)


def test_the_head_moves_them_at_the_memory_bandwidth_beside_the_same_gemm():
    standard, megatron = head(Work(1, 4096, tp=2)), head(Work(1, 4096, tp=2, loss=ir.Loss.megatron))
    logits = 4096 * 131072 / 2
    assert megatron.forward_matmul == standard.forward_matmul and megatron.flops == standard.flops
    assert megatron.forward_other == pytest.approx(logits * (2 + 38) / 3.35e12, rel=1e-12)
    assert megatron.backward_other == pytest.approx(logits * 14 / 3.35e12, rel=1e-12)
    assert standard.forward_other == pytest.approx(logits * 8 / 3.35e12, rel=1e-12)  # 16-bit write, read, fp32 write
    # 32 + 8 bytes per logit more than standard's: unsplit (tp 1), 6.4 ms per 4,096-token sequence of 131,072 words
    extra = megatron.forward + megatron.backward - standard.forward - standard.backward
    assert extra == pytest.approx(logits * (32 + 8) / 3.35e12, rel=1e-9)
    assert 2 * extra == pytest.approx(6.41e-3, rel=1e-3)
    # whatever the blocks' kernels: Megatron's loss is the same ops under eager blocks
    assert head(Work(1, 4096, tp=2, loss=ir.Loss.megatron, kernels=ir.Kernels.eager)) == megatron


PLAN = """
import "clusters/dgx_h100.plan"
plan p {
  model   = gpt(layers=4, hidden=2048, heads=16, seq=4096, vocab=131072)
  cluster = dgx_h100
  mesh    = [dp = 8]
  train   = { global_batch: 32, micro_batch: 1%s }
}
"""


def test_the_key_parses_dumps_only_when_set_shows_and_slows_the_step():
    from plandsl.render.summary import describe_plan
    plan = api.select_plan(api.loads(PLAN % ", loss: megatron", path="p.plan"))
    plain = api.select_plan(api.loads(PLAN % "", path="p.plan"))
    assert plan.train.loss is ir.Loss.megatron and plan.train.model_dump()["loss"] == "megatron"
    assert "loss" not in plain.train.model_dump()
    assert "megatron loss; " in describe_plan(plan) and "loss; " not in describe_plan(plain)
    assert api.estimate(plan).time.step > api.estimate(plain).time.step * 1.02
    assert api.estimate(plan).peak_memory_bytes < api.estimate(plain).peak_memory_bytes  # its backward works in place
    result = api.checks(PLAN % ", loss: eager", path="bad.plan")
    assert [d.code for d in result.errors] == ["E210"]
    assert result.errors[0].hint == "valid loss kernels: fused, megatron, standard"


def test_generate_from_a_partial_plan_keeps_and_prices_the_loss(tmp_path):
    partial = tmp_path / "p.plan"
    partial.write_text(PLAN.replace("  mesh    = [dp = 8]\n", "") % ", loss: megatron")
    text, plan = generated_plan(tmp_path, from_file=str(partial), pins=("dp=8",), top=1, time_limit=0)
    assert "loss: megatron" in text and plan.train.loss is ir.Loss.megatron
