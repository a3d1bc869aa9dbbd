"""What a block of the runtime keeps for its backward, against the memory model.

One process, CPU, fp32: a block of the runtime's own modules under `apply_ac`, the bytes of every
activation-sized tensor its forward leaves alive (what autograd or the selective-checkpoint cache
holds: parameters, the output and per-token or per-head scalars such as norms' rstd and flash
attention's log-sum-exp left out; the block's input belongs to the caller and is added as the model
counts it), against `cost.memory.transformer_block_activations`, byte for byte. Where the reference
modules differ from the Megatron blocks the model describes, the test says by how much: gpt has no
dropout (the model counts two masks, 2·s·b·h bytes at 16 bits).
"""
from __future__ import annotations

import gc
import weakref

import pytest

from plandsl import api, ir
from plandsl.cost.memory import transformer_block_activations
from support import lazy

torch = lazy("torch")
models = lazy("plandsl.runtime.models")
recompute = lazy("plandsl.runtime.parallel.recompute")

SEQ, BATCH, HIDDEN = 32, 2, 64


def _outputs():
    """A dispatch mode that keeps weak references to every tensor an op returns (made here, not at
    import: collecting this module must not import torch)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Outputs(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.refs: list[weakref.ref] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.refs.append(weakref.ref(t))
            return out

    return Outputs()


def _kept_bytes(block: torch.nn.Module, x: torch.Tensor) -> tuple[int, torch.Tensor]:
    """Bytes of the activation-sized storages the forward created that are still alive afterwards."""
    outputs = _outputs()
    with outputs:
        y = block(x)
    gc.collect()
    storages = {}
    for ref in outputs.refs:
        t = ref()
        if t is not None and t.untyped_storage().nbytes() > x.untyped_storage().nbytes() // 16:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    for owned in (y, x, *block.parameters()):  # the output, the input (the caller's: a detached alias of it, kept by
        # a checkpoint without output, is no more) and views of the weights (w.t()) are not kept activations
        storages.pop(owned.untyped_storage().data_ptr(), None)
    return sum(storages.values()), y


def _block(text: str, mode: str) -> tuple[ir.TransformerModel, torch.nn.Module]:
    model = api.loads(f"model m = {text}\n", path="m.plan").models[0]
    torch.manual_seed(0)
    holder = torch.nn.Module()
    holder.layers = torch.nn.ModuleDict({"0": models.Block(model)})
    recompute.apply_ac(holder, ir.Recompute(mode))
    return model, holder.layers["0"]


MODELS = [f"gpt(layers=1, hidden={HIDDEN}, heads=4, seq={SEQ}, vocab=128)",
          f"llama(layers=1, hidden={HIDDEN}, heads=4, kv_heads=1, seq={SEQ}, vocab=128, ffn=224)"]


@pytest.mark.parametrize("text", MODELS, ids=["gpt", "llama_gqa"])
@pytest.mark.parametrize("mode", ["none", "selective", "selective_op", "full"])
def test_block_keeps_what_the_memory_model_counts(text, mode):
    model, block = _block(text, mode)
    x = torch.randn(BATCH, SEQ, HIDDEN, requires_grad=True)
    kept, y = _kept_bytes(block, x)
    measured = kept + x.numel() * x.element_size()  # the input, kept by the caller and counted by the model
    modelled = transformer_block_activations(model, SEQ, BATCH, 1, False, ir.Recompute(mode), ir.Precision.fp32)
    unit = BATCH * SEQ * HIDDEN * 4  # 2·s·b·h bytes at 16 bits, in fp32
    if mode in ("none", "selective") and model.kind == "gpt":
        modelled -= unit  # no dropout masks
    assert measured == modelled
    # and the backward still gives the gradients of the block without recomputation
    y.sum().backward()
    _, plain = _block(text, "none")
    x2 = x.detach().clone().requires_grad_(True)
    plain(x2).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=0, atol=0)


def test_selective_op_keeps_less_than_none_and_more_than_full():
    sizes = {}
    for mode in ("none", "selective_op", "full"):
        _, block = _block(MODELS[1], mode)
        sizes[mode], _ = _kept_bytes(block, torch.randn(BATCH, SEQ, HIDDEN, requires_grad=True))
    assert sizes["full"] < sizes["selective_op"] < sizes["none"] / 2


@pytest.mark.parametrize("shape", [(8,), (3, 8), (2, 3, 8)])
def test_fused_style_functions_have_the_right_gradients(shape):
    """RMSNorm and swiglu write their own backward (autograd Functions): it must be the derivative of
    their forward, for the input and for the norm's weight."""
    from torch.func import functional_call

    from plandsl.runtime.models import RMSNorm, swiglu
    x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    w = torch.randn(shape[-1], dtype=torch.float64, requires_grad=True)
    norm = RMSNorm(shape[-1], eps=1e-6).double()
    assert torch.autograd.gradcheck(lambda x, w: functional_call(norm, {"weight": w}, (x,)), (x, w))
    b = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(swiglu, (x, b))


def test_rmsnorm_in_bf16_computes_what_the_eager_formula_does():
    from plandsl.runtime.models import RMSNorm
    norm = RMSNorm(32)
    x = torch.randn(4, 16, 32).bfloat16()
    # the weight in the input's dtype, as a 16-bit model holds it: the norm returns the stream's dtype (precision.keep_stream)
    eager = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + norm.eps)).type_as(x) * norm.weight.to(x.dtype)
    assert torch.equal(norm(x), eager) and norm(x).dtype == eager.dtype == torch.bfloat16


MOE_MLA = (f"llama(layers=1, hidden={HIDDEN}, heads=4, seq={SEQ}, vocab=128, experts=4, top_k=2, ffn=48, "
           "shared_experts=1, kv_lora_rank=32, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)")


def _module_block(model: ir.TransformerModel, modules: tuple[str, ...]) -> torch.nn.Module:
    torch.manual_seed(0)
    holder = torch.nn.Module()
    holder.layers = torch.nn.ModuleDict({"0": models.Block(model)})
    for parameter in holder.parameters():  # the experts' weights are made empty
        torch.nn.init.normal_(parameter, std=0.05)
    recompute.apply_ac(holder, ir.Recompute.selective if modules else ir.Recompute.none, None,
                       frozenset(ir.RecomputeModule(m) for m in modules))
    return holder.layers["0"]


@pytest.mark.parametrize("modules", [("layernorm",), ("moe_act",), ("shared_experts",), ("mla_up_proj",), ("moe",),
                                     ("core_attn", "layernorm", "moe_act", "mla_up_proj")])
def test_recompute_modules_drop_what_the_memory_model_drops_with_the_same_gradients(modules):
    """`recompute_modules` on a block with MLA, routed and shared experts: the output, input and weight gradients
    of the block without recomputation, bit for bit, and the bytes the runtime no longer keeps against what the memory
    model drops (`cost.memory._module_terms`): exactly for layernorm, moe_act and shared_experts; more for mla_up_proj
    (the eager rotary embedding's products keep views of the up-projections' outputs the model does not count) and
    moe (the runtime's routing keeps copies Megatron's fused permutation does not)."""
    model = api.loads(f"model m = {MOE_MLA}\n", path="m.plan").models[0]
    x = torch.randn(BATCH, SEQ, HIDDEN)
    plain, rerun = _module_block(model, ()), _module_block(model, modules)
    results = []
    for block in (plain, rerun):
        given = x.clone().requires_grad_(True)
        kept, y = _kept_bytes(block, given)
        y.square().sum().backward()
        results.append((kept, y, given.grad, {n.replace("._checkpoint_wrapped_module", ""): p.grad
                                              for n, p in block.named_parameters()}))
    (kept, y, grad, grads), (kept_rerun, y_rerun, grad_rerun, grads_rerun) = results
    torch.testing.assert_close(y_rerun, y, rtol=0, atol=0)
    torch.testing.assert_close(grad_rerun, grad, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grads_rerun, grads, rtol=1e-6, atol=1e-7)
    modelled = [transformer_block_activations(model, SEQ, BATCH, 1, False, ir.Recompute.selective, ir.Precision.fp32,
                                              modules=frozenset(ir.RecomputeModule(m) for m in chosen))
                for chosen in ((), modules)]
    dropped, modelled_drop = kept - kept_rerun, modelled[0] - modelled[1]
    if set(modules) & {"mla_up_proj", "moe", "core_attn"}:
        assert dropped > modelled_drop > 0
    else:
        assert dropped == modelled_drop > 0
