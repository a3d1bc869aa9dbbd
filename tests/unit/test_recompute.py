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


def _gradients(function, inputs, grad):
    leaves = [tensor.clone().requires_grad_() for tensor in inputs]
    function(*leaves).backward(grad)
    return [leaf.grad for leaf in leaves]


def _wide_swiglu_gradients(a, b, grad):
    """swiglu's derivative from the inputs in fp32, rounded once to their dtype (the backward before it was
    eager autograd's)."""
    a32, b32, grad32 = a.float(), b.float(), grad.float()
    sigmoid = torch.sigmoid(a32)
    return [(grad32 * b32 * sigmoid * (1 + a32 * (1 - sigmoid))).to(a.dtype), (grad32 * a32 * sigmoid).to(b.dtype)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_swiglu_backward_is_eager_autograds(dtype):
    """swiglu's gradients are those of autograd through `F.silu(a) * b` (on the CPU bit for bit: the same kernels,
    `mul` and `silu_backward`), and in bf16 within two roundings of the derivative computed in fp32: the product
    grad·b (or silu(a)) and the result each rounded to bf16, a relative 2⁻⁸ apiece."""
    torch.manual_seed(0)
    a, b, grad = (torch.randn(4, 64, 96).to(getattr(torch, dtype)) * 3 for _ in range(3))
    ours = _gradients(models.swiglu, (a, b), grad)
    eager = _gradients(lambda a, b: torch.nn.functional.silu(a) * b, (a, b), grad)
    assert all(tensor.dtype == a.dtype for tensor in ours)
    for mine, theirs, wide in zip(ours, eager, _wide_swiglu_gradients(a, b, grad)):
        assert torch.equal(mine, theirs)
        if dtype == "float32":
            torch.testing.assert_close(mine, wide)
        else:
            torch.testing.assert_close(mine.float(), wide.float(), rtol=2 ** -7, atol=1e-6)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rmsnorm_backward_is_the_derivative_of_its_forward(dtype):
    """The norm's gradients against autograd through its forward's formula (fp32 statistics, cast back, times the
    weight): in fp32 up to the order of the sums; in bf16 the weight's bit for bit (the same products and sum), x's
    against the formula's derivative in fp64 within bf16's rounding of grad·weight (a relative 2⁻⁸ of each term of
    rstd·(g - normed·mean(g·normed)), which cancel: bounded by 2⁻⁷ of the largest) and of the result."""
    from plandsl.runtime.models import _RMSNorm
    torch.manual_seed(0)
    dtype = getattr(torch, dtype)
    x, grad = torch.randn(4, 64, 96).to(dtype), torch.randn(4, 64, 96).to(dtype)
    weight = torch.randn(96).to(dtype)

    def formula(x, weight):
        wide = x.float() if x.dtype == torch.bfloat16 else x
        return (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + 1e-6)).type_as(x) * weight

    ours = _gradients(lambda x, weight: _RMSNorm.apply(x, weight, 1e-6), (x, weight), grad)
    eager = _gradients(formula, (x, weight), grad)
    assert [tensor.dtype for tensor in ours] == [dtype, dtype]
    if dtype == torch.float32:
        torch.testing.assert_close(ours, eager)
        return
    assert torch.equal(ours[1], eager[1])
    exact = _gradients(formula, (x.double(), weight.double()), grad.double())[0]
    torch.testing.assert_close(ours[0].double(), exact, rtol=2 ** -8, atol=2 ** -7 * exact.abs().max().item())


def _backward_bytes(function, inputs: int, shape: tuple[int, ...]) -> float:
    """The most bytes a backward of `function` on fake bf16 tensors of `shape` allocates at once (beyond its inputs,
    the saved tensors and the incoming gradient), in bytes of one input (`runtime.memtrace`'s recorder)."""
    from plandsl.runtime import memtrace
    with memtrace.recording() as recorder, memtrace._RecordingFakeMode(recorder):
        leaves = [torch.randn(shape, dtype=torch.bfloat16, requires_grad=True) for _ in range(inputs)]
        output = function(*leaves)
        grad = torch.randn_like(output)
        start = len(recorder.events)
        output.backward(grad)
    now = most = 0
    for op, _, size in recorder.events[start:]:
        now += op * size
        most = max(most, now)
    return most / (leaves[0].numel() * leaves[0].element_size())


def test_swiglu_and_rmsnorm_backwards_allocate_a_few_tensors_of_their_inputs_dtype():
    """Llama 3.1 405B's MLP under TP 8 at 4 x 8192 tokens (a, b [4, 8192, 6656] bf16, 416 MiB each): swiglu's
    backward allocates the two gradients alone, 2 a's bytes (widening to fp32 and spelling the derivative out
    allocated 12: 4.9 GiB); RMSNorm's, on the [4, 8192, 16384] stream, at most two fp32 tensors of x's shape at
    once, 4 x's bytes and its per-token numbers (spelled out: 8)."""
    from plandsl.runtime.models import _RMSNorm
    assert _backward_bytes(models.swiglu, 2, (4, 8192, 6656)) == 2
    weight = torch.ones(16384, dtype=torch.bfloat16)
    norm = _backward_bytes(lambda x: _RMSNorm.apply(x, weight, 1e-6), 1, (4, 8192, 16384))
    assert 4 <= norm <= 4.01


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


def test_swiglu_backward_in_fp16_does_not_overflow_where_the_gradient_fits():
    """fp16 under a loss scale: grad·b past fp16's 65504 where grad·b·silu'(a) is not (silu'(-2) = -0.09) gave -inf
    in eager autograd's order (a skipped step under GradScaler); computed as silu'(a)·grad, then times b, it is the
    finite gradient the fp32 formula gives, within fp16's rounding."""
    a = torch.tensor([-2.0, -4.0, 1.0], dtype=torch.float16)
    b = torch.tensor([300.0, 300.0, 3.0], dtype=torch.float16)
    grad = torch.tensor([300.0, 300.0, 2.0], dtype=torch.float16)
    ours = _gradients(models.swiglu, (a, b), grad)
    wide = _wide_swiglu_gradients(a, b, grad)
    assert all(torch.isfinite(tensor).all() for tensor in ours) and ours[0].dtype == torch.float16
    for mine, theirs in zip(ours, wide):
        torch.testing.assert_close(mine.float(), theirs.float(), rtol=2 ** -9, atol=0)
