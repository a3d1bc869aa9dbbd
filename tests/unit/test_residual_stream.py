"""At `precision: bf16`/`fp16` over fp32 weights the interpreter's residual stream is 16-bit (`runtime.precision.
keep_stream`): the embeddings' outputs are cast to autocast's dtype, the norms return their input's dtype, so every
block's input is 16-bit, as with Megatron-LM's 16-bit parameters or torchtitan's bf16 FSDP weights and as the memory
model counts it; the loss still reduces in fp32, and an fp32 plan runs exactly as before (no cast anywhere)."""
from __future__ import annotations

import pytest

from plandsl import api
from tests.support import lazy

torch = lazy("torch")

_PLAN = """import "clusters/local"
plan p {{
  model   = {model}
  cluster = localhost
  mesh    = [dp = 1] over devices[0:1]
  train   = {{ global_batch: 2, micro_batch: 2, precision: {precision}, lr: 1e-3, seed: 0{extra} }}
}}
"""
GPT = "gpt(layers=2, hidden=32, heads=4, seq=16, vocab=64)"
MOE = "llama(layers=2, hidden=32, heads=4, kv_heads=2, seq=16, vocab=64, ffn=32, experts=4, top_k=2)"


def _plan(model: str, precision: str, extra: str = ""):
    return api.select_plan(api.loads(_PLAN.format(model=model, precision=precision, extra=extra)))


def _step(plan):
    """One forward and backward as `plandsl run` does it; the dtypes of every block's input, the output, the loss
    and the gradients."""
    from plandsl.runtime.models import Block, build_model, loss_fn
    from plandsl.runtime.precision import autocast, keep_weights
    model = keep_weights(plan, build_model(plan.model, 0))
    seen = []
    for module in model.modules():
        if isinstance(module, Block):
            module.register_forward_pre_hook(lambda _, args: seen.append(args[0].dtype))
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))
    with autocast(plan, "cpu"):
        out = model(tokens[:, :-1])
        loss = loss_fn(out, tokens[:, 1:])
    loss.backward()
    grads = {(p.dtype, p.grad.dtype) for p in model.parameters()}
    return model, seen, out, loss, grads


@pytest.mark.parametrize("model", [GPT, GPT.replace("gpt(", "llama("), MOE], ids=["gpt", "llama", "moe"])
@pytest.mark.parametrize("precision, dtype", [("bf16", "bfloat16"), ("fp16", "float16")])
def test_a_16_bit_precision_keeps_every_block_input_16_bit(model, precision, dtype):
    _, seen, out, loss, grads = _step(_plan(model, precision))
    assert seen and set(seen) == {getattr(torch, dtype)}, seen
    assert out.dtype == getattr(torch, dtype)
    assert loss.dtype == torch.float32  # the loss reduces in fp32 (`runtime.models.loss_fn`)
    assert grads == {(torch.float32, torch.float32)}  # fp32 weights keep fp32 gradients


def test_fp32_casts_nothing_and_16_bit_weights_need_no_cast():
    model, seen, out, _, _ = _step(_plan(GPT, "fp32"))
    assert set(seen) == {torch.float32} and out.dtype == torch.float32
    assert not any(module._forward_hooks for module in model.modules() if isinstance(module, torch.nn.Embedding))
    model, seen, _, _, grads = _step(_plan(GPT, "bf16", ", param_dtype: bf16"))  # bf16 lookups already
    assert set(seen) == {torch.bfloat16} and grads == {(torch.bfloat16, torch.bfloat16)}
    assert not any(module._forward_hooks for module in model.modules() if isinstance(module, torch.nn.Embedding))


def test_the_norms_return_their_inputs_dtype_and_fp32_is_torchs_own():
    from plandsl.runtime.models import LayerNorm, RMSNorm
    x = torch.randn(2, 8, 32)
    ours, torchs = LayerNorm(32), torch.nn.LayerNorm(32)
    with torch.no_grad():
        ours.weight.normal_(), ours.bias.normal_()
    torchs.load_state_dict(ours.state_dict())
    assert torch.equal(ours(x), torchs(x))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for norm in (ours, RMSNorm(32)):
            out = norm(x.bfloat16())
            assert out.dtype == torch.bfloat16
            out.float().sum().backward()
            assert norm.weight.grad.dtype == torch.float32
