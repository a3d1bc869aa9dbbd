"""`loss: fused`: a cross entropy that keeps only the 16-bit logits and writes their gradient in place (flash-attn's,
llm-foundry's default, Liger's), against the standard one over an fp32 copy. The bytes of the head, the memory it
keeps, the key in the language, `show`, `diff` and `generate`."""
import pytest

from plandsl import api, ir
from plandsl.cost.compute import Efficiency, Work, estimate_layer_compute
from plandsl.ir.layers import layers_of
from tests.support import generated_plan

A100 = ir.DeviceType(name="a100", memory=80 * 2**30, bandwidth=2.0e12, peak={"bf16": 312e12, "fp32": 19.5e12})
EFF = Efficiency(peak_fraction=0.8, kernel_seconds=10e-6)
GPT = ir.TransformerModel(kind="gpt", name="g", layers=4, hidden=1024, heads=16, kv_heads=16, ffn_hidden=4096,
                          seq=2048, vocab=50368, tied_embeddings=True)

PLAN = """
import "clusters/dgx_a100.plan"
plan p {
  model   = gpt(layers=24, hidden=1024, heads=16, seq=2048, vocab=50368, tied=true)
  cluster = dgx_a100
  mesh    = [dp = 8]
  train   = { global_batch: 512, micro_batch: %d, recompute: none%s }
  data    = zero3 over dp
}
"""


def _plan(micro_batch=8, extra=""):
    return api.select_plan(api.loads(PLAN % (micro_batch, extra), path="p.plan"))


def _head(model):
    return next(layer for layer in layers_of(model) if layer.kind == "head")


@pytest.mark.parametrize("kernels", list(ir.Kernels))
def test_the_head_moves_the_16_bit_logits_once_each_way(kernels):
    b, s, tp = 4, 2048, 2
    logits = b * s * -(-GPT.vocab // tp)
    standard = estimate_layer_compute(GPT, _head(GPT), Work(b, s, tp=tp, kernels=kernels), A100, EFF)
    fused = estimate_layer_compute(GPT, _head(GPT), Work(b, s, tp=tp, kernels=kernels, loss=ir.Loss.fused), A100, EFF)
    assert fused.forward_other == pytest.approx(logits * 4 / 2.0e12, rel=1e-12)  # write, read: 2 + 2 bytes
    assert fused.backward_other == pytest.approx(logits * 4 / 2.0e12, rel=1e-12)  # read, write in place
    assert fused.forward_matmul == standard.forward_matmul and fused.flops == standard.flops
    assert fused.forward_other < standard.forward_other and fused.backward_other < standard.backward_other
    if kernels is ir.Kernels.fused:  # the standard loss: 2e + 4 forward, 4 + e backward (Korthikanti et al. 2022)
        assert standard.forward_other == pytest.approx(logits * 8 / 2.0e12, rel=1e-12)
        assert standard.backward_other == pytest.approx(logits * 6 / 2.0e12, rel=1e-12)


def test_memory_keeps_the_16_bit_logits_and_no_fp32_gradients():
    from plandsl.cost.memory import estimate_layer_activations, loss_backward_bytes
    standard, fused = _plan(), _plan(extra=", loss: fused")
    head = _head(standard.model)
    logits = 8 * 2048 * 50368
    assert estimate_layer_activations(standard, head) - estimate_layer_activations(fused, head) == \
        pytest.approx(logits * (4 - 2), rel=1e-12)
    layers = layers_of(standard.model)
    assert loss_backward_bytes(standard, layers) == 8.0 * logits and loss_backward_bytes(fused, layers) == 0.0
    # MosaicML's MPT-350M at micro-batch 32 without checkpointing ran on 80 GB A100s with its fused loss
    assert [d.code for d in api.checks(PLAN % (32, ""), path="p.plan").errors] == ["E503"]
    assert not api.checks(PLAN % (32, ", loss: fused"), path="p.plan").errors


def test_the_key_parses_dumps_only_when_set_and_rejects_other_words():
    plan = _plan(extra=", loss: fused")
    assert plan.train.loss is ir.Loss.fused and plan.train.model_dump()["loss"] == "fused"
    assert "loss" not in _plan().train.model_dump()
    result = api.checks(PLAN % (8, ", loss: liger"), path="bad.plan")
    assert [d.code for d in result.errors] == ["E210"]
    assert result.errors[0].hint.startswith("valid loss kernels: ") and {"standard", "fused"} <= set(
        result.errors[0].hint.split(": ")[1].split(", "))


def test_show_and_diff_name_it():
    from plandsl.render.summary import describe_plan
    from plandsl.rewrite.diff import diff_plans
    assert "fused loss; " in describe_plan(_plan(extra=", loss: fused")) and "loss" not in describe_plan(_plan())
    changes = diff_plans(_plan(), _plan(extra=", loss: fused"))
    assert any(c.field == "train.loss" and (c.old, c.new) == ("standard", "fused") for c in changes.changes)


def test_generate_writes_the_loss_it_was_given(tmp_path):
    text, plan = generated_plan(tmp_path, model="gpt(layers=4, hidden=1024, heads=16, seq=2048, vocab=50368)",
                                cluster="dgx_a100", global_batch=32, loss="fused", top=1,
                                output=str(tmp_path / "p.plan"))
    assert "loss: fused" in text and plan.train.loss is ir.Loss.fused


def test_megatrons_loss_adds_only_the_16_bit_gradient_when_its_backward_starts():
    """megatron-core's `vocab_parallel_cross_entropy` multiplies its saved softmax in place and casts it back:
    beside the fp32 copy it keeps (as standard does), only the 16-bit gradient of the logits, where torch's
    log_softmax backward makes two fp32 tensors."""
    from plandsl.cost.memory import loss_backward_bytes
    megatron = _plan(extra=", loss: megatron")
    layers = layers_of(megatron.model)
    assert loss_backward_bytes(megatron, layers) == 2.0 * 8 * 2048 * 50368
    assert loss_backward_bytes(_plan(), layers) == 8.0 * 8 * 2048 * 50368
