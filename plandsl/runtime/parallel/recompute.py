"""Activation recomputation (`train.recompute`) with torch's checkpoint_wrapper.

Stage: interpreter. Contract: `apply_ac(model, mode, count, modules)` wraps in place (the first `count` blocks only,
when given): `full` recomputes whole blocks
(wrapping inserts `_checkpoint_wrapped_module` into their parameter names), `selective` the parts of each block
`modules` names (`ir.Training.modules`, Megatron-Core's --recompute-modules; by default the attention core
`attn.core`: the softmax(q kᵀ) v of Korthikanti et al. 2022, Sec. 5, whose activations grow with seq²; it holds no
parameters), `selective_op` whole blocks under torch's
selective checkpointing policy (`keep_every_other_matmul`), `none` changes nothing. A recomputed forward leaves the
persistent buffers of what it reruns (BatchNorms' running statistics) as the forward left them (`state_kept`), so a
run with recomputation ends with the buffers of one without.
"""
from __future__ import annotations

import contextlib
from collections import Counter

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from plandsl import ir
from plandsl.runtime.discard import rerun_without_output
from plandsl.runtime.torch_model import blocks

_MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)


def _kept_ops() -> frozenset:
    """The ops whose outputs `selective_op` always keeps: every SDPA kernel torch has here (the
    attention core, which is the expensive one to rerun) and tensor parallelism's reduce-scatter
    (so sequence parallelism does not communicate again)."""
    names = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
             "_scaled_dot_product_fused_attention_overrideable")
    kept = {getattr(torch.ops.aten, name).default for name in names if hasattr(torch.ops.aten, name)}
    functional = getattr(torch.ops, "_c10d_functional", None)
    if functional is not None and hasattr(functional, "reduce_scatter_tensor"):
        kept.add(functional.reduce_scatter_tensor.default)
    return frozenset(kept)


_KEPT = _kept_ops()


def keep_every_other_matmul():
    """A selective-checkpoint context for one block's forward (torchtitan's op-level policy): keep the
    outputs of the 1st, 3rd, ... matmul (`mm`, `addmm`) and of the attention core, recompute the rest.
    Over a block's wq, wk, wv, wo, w1, (w3,) w2 it keeps q, v, w1's output (and llama's w2 output),
    and the backward reruns the norms, wk, rotary, wo, the activation (and w3). Dropout, if any, is
    replayed with the forward's random state (checkpoint's `preserve_rng_state`)."""
    count = Counter()

    def policy(ctx, func, *args, **kwargs):
        if func in _MATMULS:  # some torch versions ask again while recomputing: count each pass apart
            key = "recompute" if ctx.is_recompute else "forward"
            count[key] += 1
            kept = count[key] % 2 == 1
        else:
            kept = func in _KEPT
        return CheckpointPolicy.MUST_SAVE if kept else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def state_kept(module: nn.Module):
    """The recomputation context for `module` (None when it holds no persistent buffer): the recomputation in backward
    runs inside a context that puts each persistent buffer of the module (its state dict's: BatchNorm's running mean,
    variance and batch count) back as it was before it. A BatchNorm in training normalises by the batch's own
    statistics, so the recomputed activations are the forward's, but it also updates its running statistics again: a
    second update per step (pytorch/pytorch#96136; fairscale's `patch_batchnorm` skips it for reentrant checkpointing
    only, by `torch.is_grad_enabled`, which non-reentrant checkpointing leaves on in both passes). By the buffers, not
    the BatchNorm modules: a block of a stage torch's pipeline frontend traced holds them in modules of its own kind."""
    if next(_persistent(module), None) is None:
        return None

    @contextlib.contextmanager
    def restoring():
        saved = [(buffer, buffer.clone()) for buffer in _persistent(module)]
        try:
            yield
        finally:  # also when checkpoint stops the recomputation early, once it has every tensor it needs
            with torch.no_grad():
                for buffer, value in saved:
                    buffer.copy_(value)

    return restoring


def _persistent(module: nn.Module):
    """The buffers of `module` and its descendants that their state dicts hold, as they are now."""
    for sub in module.modules():
        for name, buffer in sub._buffers.items():
            if buffer is not None and name not in sub._non_persistent_buffers_set:
                yield buffer


def _wrap(module: nn.Module, policy=None) -> nn.Module:
    """`module` under torch's checkpoint_wrapper (non-reentrant): with `policy`'s contexts (selective checkpointing),
    and its persistent buffers (BatchNorms' running statistics) restored after a recomputation (`state_kept`)."""
    restoring = state_kept(module)
    if restoring is None:
        return checkpoint_wrapper(module, context_fn=policy) if policy else checkpoint_wrapper(module)

    def context_fn():
        forward, recompute = policy() if policy else (contextlib.nullcontext(), contextlib.nullcontext())
        return forward, _nested(restoring(), recompute)  # outside: its copies are no ops of the recomputation

    return checkpoint_wrapper(module, context_fn=context_fn)


@contextlib.contextmanager
def _nested(first, second):
    with first, second:
        yield


def _apply_modules(block: nn.Module, modules: frozenset[ir.RecomputeModule]) -> None:
    """`recompute: selective` with `modules` on one of plandsl's blocks, as megatron-core 0.16.1 runs each with
    Transformer Engine's layer spec (cost.memory._module_terms): `core_attn`, `mlp`, `moe`, `shared_experts` rerun the
    module from its input (checkpoint_wrapper, Megatron's `tensor_parallel.checkpoint`); `layernorm` the norms that are
    modules of their own there (MLA's attention norm, a MoE block's MLP norm; the others Transformer Engine fuses into
    the next linear layer), `moe_act` the experts' activation and `mla_up_proj` MLA's up-projections and rotary
    embedding without their outputs (`DiscardedOutput`)."""
    Module = ir.RecomputeModule
    latent, moe = hasattr(block.attn, "wkv_b"), getattr(block, "moe", None)
    if Module.core_attn in modules:
        block.attn.register_module("core", _wrap(block.attn.core))
    if Module.layernorm in modules:
        for norm, wanted in ((block.norm1, latent), (block.norm2, moe is not None)):
            if wanted:
                rerun_without_output(norm)
    if Module.mla_up_proj in modules and latent:
        block.attn.rerun_up = True
    if Module.mlp in modules and moe is None:
        block.register_module("mlp", _wrap(block.mlp))
    if Module.moe in modules and moe is not None:
        block.register_module("moe", _wrap(moe))
        return
    if Module.moe_act in modules and moe is not None:
        moe.experts.rerun_activation = True
    if Module.shared_experts in modules and moe is not None and moe.shared is not None:
        moe.register_module("shared", _wrap(moe.shared))


def apply_ac(model: nn.Module, mode: ir.Recompute, count: int | None = None,
             modules: frozenset[ir.RecomputeModule] = frozenset((ir.RecomputeModule.core_attn,))) -> None:
    """`count`: wrap only the first `count` blocks of `model` (one pipeline stage or virtual chunk:
    Megatron's `--recompute-method block`, `train.recompute_layers`); None: every block. `modules`: what
    `selective` reruns."""
    layers, names = blocks(model)
    if mode is ir.Recompute.none or layers is None:
        return
    for name in names[:count]:
        block = layers.get_submodule(name)
        parent_name, _, child = name.rpartition(".")  # a block named in full (layer1.0) sits in its own container
        parent = layers.get_submodule(parent_name)
        if mode is ir.Recompute.full:
            parent.register_module(child, _wrap(block))
        elif mode is ir.Recompute.selective_op:
            parent.register_module(child, _wrap(block, keep_every_other_matmul))
        elif hasattr(block, "attn"):
            _apply_modules(block, modules)
