"""Activation recomputation (`train.recompute`) with torch's checkpoint_wrapper.

Stage: interpreter. Contract: `apply_ac(model, mode, count, modules)` wraps in place (the first `count` blocks only,
when given): `full` recomputes whole blocks
(wrapping inserts `_checkpoint_wrapped_module` into their parameter names), `selective` the parts of each block
`modules` names (`ir.Training.modules`, Megatron-Core's --recompute-modules; by default the attention core
`attn.core`: the softmax(q kᵀ) v of Korthikanti et al. 2022, Sec. 5, whose activations grow with seq²; it holds no
parameters), `selective_op` whole blocks under torch's
selective checkpointing policy (`keep_every_other_matmul`), `none` changes nothing. A recomputation leaves the
buffers of what it reruns (BatchNorms' running statistics) as it found them (`state_kept`), so a run with
recomputation ends with the buffers of one without.
"""
from __future__ import annotations

import contextlib
from collections import Counter

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from plandsl import ir
from plandsl.runtime.buffers import owned_buffers, put_back, save
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
    """The checkpoint contexts for `module` (`context_fn`'s (forward, recompute) pair; None when it holds no buffer):
    each recomputation in backward puts the module's buffers back as they were before it. A BatchNorm in training
    normalises by the batch's own statistics, so the recomputed activations are the forward's, but it also updates its
    running statistics again: a second update per step (pytorch/pytorch#96136; fairscale's `patch_batchnorm` skips it
    for reentrant checkpointing only, by `torch.is_grad_enabled`, which non-reentrant checkpointing leaves on in both
    passes). Put back: every persistent buffer (its state dict's: BatchNorm's running mean, variance and batch count;
    by the buffers, not the BatchNorm modules, for a block of a stage torch's pipeline frontend traced holds them in
    modules of its own kind, whose graph writes them without bumping their version counters) and each non-persistent
    one the forward changed (its version counter or the tensor it names moved: a counter), not the constant tables
    (a causal mask, rotary frequencies) that would otherwise be copied at every rerun. A buffer the forward rebinds
    (`self.calls = self.calls + 1`) is named again by the tensor it named before."""
    if next(owned_buffers(module), None) is None:
        return None

    def contexts(policy=None):
        forward, recompute = policy() if policy else (contextlib.nullcontext(), contextlib.nullcontext())
        watch = _Changed(module, forward)
        return watch, _Restoring(module, watch, recompute)

    return contexts


class _Changed:
    """The forward's context: which non-persistent buffers it changes (`changed`: (owner, name) pairs), around the
    selective policy's forward context (`inner`)."""

    def __init__(self, module: nn.Module, inner):
        self.module, self.inner, self.changed, self._before = module, inner, set(), {}

    def __enter__(self):
        self._before = {(id(entry.owner), entry.name): (entry.buffer, entry.buffer._version)
                        for entry in owned_buffers(self.module) if not entry.persistent}
        return self.inner.__enter__()

    def __exit__(self, *exc):
        for entry in owned_buffers(self.module):
            was = self._before.get((id(entry.owner), entry.name))
            if not entry.persistent and (was is None or was[0] is not entry.buffer or was[1] != entry.buffer._version):
                self.changed.add((id(entry.owner), entry.name))
        return self.inner.__exit__(*exc)


class _Restoring:
    """The recomputation's context, entered once per rerun (zero-bubble's input and weight passes are two graph
    tasks, each reruns the block): the buffers saved on entry and put back on exit, after the selective policy's
    recompute context (`inner`) closes (so its copies are no ops of the recomputation), an exception or checkpoint's
    early stop (`_StopRecomputationError`) included."""

    def __init__(self, module: nn.Module, forward: _Changed, inner):
        self.module, self.forward, self.inner, self._stacks = module, forward, inner, []

    def __enter__(self):
        stack = contextlib.ExitStack()
        stack.callback(put_back, save(_kept(self.module, self.forward.changed)))
        try:
            stack.enter_context(self.inner)
        except BaseException:
            stack.close()
            raise
        self._stacks.append(stack)

    def __exit__(self, *exc):
        return self._stacks.pop().__exit__(*exc)


def _kept(module: nn.Module, changed: set) -> list:
    """The buffers (`runtime.buffers.Owned`) a recomputation of `module` puts back: every persistent one, and the
    non-persistent ones in `changed` (`_Changed.changed`, by the forward)."""
    return [entry for entry in owned_buffers(module) if entry.persistent or (id(entry.owner), entry.name) in changed]


def _wrap(module: nn.Module, policy=None) -> nn.Module:
    """`module` under torch's checkpoint_wrapper (non-reentrant): with `policy`'s contexts (selective checkpointing),
    and its buffers (BatchNorms' running statistics) put back after each recomputation (`state_kept`)."""
    kept = state_kept(module)
    if kept is None:
        return checkpoint_wrapper(module, context_fn=policy) if policy else checkpoint_wrapper(module)
    return checkpoint_wrapper(module, context_fn=lambda: kept(policy))


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
