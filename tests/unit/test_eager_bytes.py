"""`kernels: eager` against PyTorch itself: the bytes `cost.compute.EAGER` charges outside the GEMMs of a Llama
block and of the loss are the bytes eager PyTorch's kernels read and write when Hugging Face transformers'
`LlamaDecoderLayer` (code nobody here wrote) and a cross entropy over fp32 logits run forward and backward,
counted kernel by kernel under a `TorchDispatchMode` (every ATen op's tensor inputs and outputs, views, GEMMs
and the attention core excluded); and what the key changes in the language, the estimate and the search."""
import importlib.util

import pytest

from plandsl import api, ir
from plandsl.cost.compute import EAGER, Efficiency, Work, estimate_layer_compute
from plandsl.ir.layers import layers_of

BYTES = ir.DeviceType(name="bytes", memory=80 * 2**30, bandwidth=1.0, peak={"bf16": 1e15, "fp32": 1e15})
EFF = Efficiency(peak_fraction=1.0, kernel_seconds=0.0)
NOT_COUNTED = {"mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention_for_cpu",
               "_scaled_dot_product_flash_attention_for_cpu_backward", "detach", "alias", "lift_fresh", "_unsafe_view",
               "ones_like"}  # ones_like: the seed gradient the test itself passes to backward


def _llama(hidden, ffn, heads, kv_heads, vocab=256):
    return ir.TransformerModel(kind="llama", name="l", layers=1, hidden=hidden, heads=heads, kv_heads=kv_heads,
                               ffn_hidden=ffn, seq=256, vocab=vocab)


def _modelled(model, kind, dtype, tokens, kernels=ir.Kernels.eager):
    precision = ir.Precision.fp32 if dtype == "float32" else ir.Precision.bf16
    work = Work(micro_batch=1, seq=tokens, precision=precision, kernels=kernels)
    layer = next(x for x in layers_of(model) if x.kind == kind)
    result = estimate_layer_compute(model, layer, work, BYTES, EFF)
    return result.forward_other, result.backward_other  # seconds at 1 B/s: bytes


def _counter():
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.bytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if not func.is_view and func.__name__.split(".")[0] not in NOT_COUNTED:
                self.bytes += sum(t.numel() * t.element_size() for t in tree_flatten((args, kwargs, out))[0]
                                  if isinstance(t, torch.Tensor))
            return out
    return Count


needs_transformers = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                        reason="transformers is not installed")


@pytest.mark.slow  # imports transformers (~3 CPU-s)
@needs_transformers
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("hidden,ffn,heads,kv_heads", [(256, 768, 4, 1), (512, 512, 8, 8)])
def test_a_llama_block_moves_what_eager_pytorch_moves(dtype, hidden, ffn, heads, kv_heads):
    import torch
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    tokens = 128
    config = LlamaConfig(hidden_size=hidden, intermediate_size=ffn, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, num_hidden_layers=1, vocab_size=64)
    config._attn_implementation = "sdpa"
    torch_dtype = getattr(torch, dtype)
    block = LlamaDecoderLayer(config, 0).to(torch_dtype)
    x = torch.randn(1, tokens, hidden, dtype=torch_dtype, requires_grad=True)
    cos, sin = LlamaRotaryEmbedding(config)(x, torch.arange(tokens)[None])
    Count = _counter()
    with Count() as forward:
        y = block(x, position_embeddings=(cos, sin), attention_mask=None)
        y = y[0] if isinstance(y, tuple) else y
    seed = torch.ones_like(y)
    with Count() as backward:
        y.backward(seed)
    modelled_forward, modelled_backward = _modelled(_llama(hidden, ffn, heads, kv_heads), "block", dtype, tokens)
    assert modelled_forward == pytest.approx(forward.bytes, rel=0.03)
    assert modelled_backward == pytest.approx(backward.bytes, rel=0.04)


@needs_transformers
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_loss_moves_what_eager_pytorch_moves(dtype):
    import torch
    import torch.nn.functional as F

    tokens, vocab = 128, 1024
    logits = torch.randn(tokens, vocab, dtype=getattr(torch, dtype), requires_grad=True)
    labels = torch.randint(0, vocab, (tokens,))
    Count = _counter()
    with Count() as forward:
        loss = F.cross_entropy(logits.float(), labels)
    with Count() as backward:
        loss.backward()
    eager = EAGER[logits.element_size()]
    assert tokens * vocab * eager.loss_forward == pytest.approx(forward.bytes, rel=0.02)
    assert tokens * vocab * eager.loss_backward == pytest.approx(backward.bytes, rel=0.02)
    element = logits.element_size()
    modelled_forward, modelled_backward = _modelled(_llama(64, 128, 2, 2, vocab=vocab), "head", dtype, tokens)
    assert modelled_forward == pytest.approx(tokens * vocab * (element + eager.loss_forward), rel=1e-12)
    assert modelled_backward == pytest.approx(backward.bytes, rel=0.02)


def test_eager_moves_more_than_fused_and_splits_under_tensor_and_sequence_parallelism():
    model = _llama(4096, 14336, 32, 8)
    fused = _modelled(model, "block", "bfloat16", 1024, ir.Kernels.fused)
    eager = _modelled(model, "block", "bfloat16", 1024)
    assert eager[0] > 3 * fused[0] and eager[1] > 3 * fused[1]
    layer = next(x for x in layers_of(model) if x.kind == "block")
    split = estimate_layer_compute(model, layer, Work(1, 1024, tp=4, sequence_parallel=True,
                                                      kernels=ir.Kernels.eager), BYTES, EFF)
    assert split.forward_other == pytest.approx(eager[0] / 4, rel=1e-12)
    assert split.backward_other == pytest.approx(eager[1] / 4, rel=1e-12)
    # gpt's LayerNorm, GeLU and dropout are one kernel each in eager mode too: nothing changes
    gpt = ir.TransformerModel(kind="gpt", name="g", layers=1, hidden=1024, heads=16, kv_heads=16, ffn_hidden=4096,
                              seq=1024, vocab=50304)
    assert _modelled(gpt, "block", "bfloat16", 1024) == _modelled(gpt, "block", "bfloat16", 1024, ir.Kernels.fused)


PLAN = """
import "models/llama3.plan"
import "clusters/dgx_h100.plan"
plan p {
  model   = llama3_8b
  cluster = dgx_h100 x 1
  mesh    = [dp = 8]
  train   = { global_batch: 16, micro_batch: 2, recompute: full%s }
  data    = fsdp over dp
}
"""


def test_the_key_is_written_estimated_and_kept_out_of_a_default_plans_dump():
    fused = api.select_plan(api.loads(PLAN % "", path="fused.plan"))
    eager = api.select_plan(api.loads(PLAN % ", kernels: eager", path="eager.plan"))
    assert fused.train.kernels is ir.Kernels.fused and eager.train.kernels is ir.Kernels.eager
    assert "kernels" not in fused.train.model_dump() and eager.train.model_dump()["kernels"] == "eager"
    slower = api.estimate(eager).time.step / api.estimate(fused).time.step
    assert 1.05 < slower < 1.5  # torchtitan: compiled 16 % faster than eager (docs/validation.md)


def test_a_kernel_mode_the_language_does_not_know_is_E210():
    result = api.checks(PLAN % ", kernels: compiled", path="bad.plan")
    assert [d.code for d in result.errors] == ["E210"]
    assert result.errors[0].hint == "valid kernel modes: eager, fused"


def test_generate_searches_and_writes_the_kernels_it_was_given(tmp_path):
    def best(kernels):
        request = api.generate_request(model="llama3_8b", cluster="dgx_h100 x 1", global_batch=16, kernels=kernels,
                                       top=1, output=str(tmp_path / "p.plan"))
        generated = api.generate(request)
        return generated.result.best.estimate, generated.texts[0]
    fused, fused_text = best(None)
    eager, eager_text = best("eager")
    assert "kernels" not in fused_text and "kernels: eager" in eager_text
    assert eager.time.step > fused.time.step
    (tmp_path / "p.plan").write_text(eager_text)
    plan = api.load_plan(tmp_path / "p.plan")
    assert plan.train.kernels is ir.Kernels.eager
    assert api.estimate(plan).time.step == pytest.approx(eager.time.step, rel=1e-9)
