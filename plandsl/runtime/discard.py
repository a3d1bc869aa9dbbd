"""Outputs freed after the layer that reads them and rebuilt in the backward: megatron-core's `CheckpointWithoutOutput`.

Stage: interpreter. Contract: `DiscardedOutput(function)(*inputs)` runs `function` without a graph, keeping its
inputs; `.discard(after)` frees its outputs' storage and rebuilds them when the gradient of `after` arrives;
`rerun_without_output(module)` runs a module so, and `discard_after(module, after)` frees what its last call made.
The storage is freed and refilled by `free_storage` and `refill_storage` (the memory tracer records both).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule


class _WithoutOutput(torch.autograd.Function):
    """megatron-core 0.16.1's CheckpointWithoutOutputFunction (tensor_parallel/random.py): the function's forward
    without a graph, its inputs kept (detached, each with its own `.grad`); the backward is that of the outputs the
    rebuild hook made with their graph (`DiscardedOutput`)."""

    @staticmethod
    def forward(ctx, holder: "DiscardedOutput", *inputs):
        with torch.no_grad():
            outputs = holder.function(*inputs)
        kept = []
        for tensor in inputs:
            leaf = tensor.detach()
            leaf.requires_grad_(tensor.requires_grad)
            kept.append(leaf)
        ctx.save_for_backward(*kept)
        holder.ctx = ctx
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        inputs, rebuilt = ctx.saved_tensors, ctx.rebuilt
        pairs = [(out, grad) for out, grad in zip(rebuilt, grads) if grad is not None and out.requires_grad]
        torch.autograd.backward([out for out, _ in pairs], [grad for _, grad in pairs])
        ctx.rebuilt = None
        return (None, *(tensor.grad if tensor.requires_grad else None for tensor in inputs))


class DiscardedOutput:
    """One call of `function` whose outputs are freed once the layer after it has run and rebuilt in the backward
    before that layer's own backward reads them: megatron-core's `CheckpointWithoutOutput`, which its
    `layernorm`, `moe_act` and `mla_up_proj` recompute modules run. `discard(after)` frees the outputs' storage
    (the layer after them keeps the same storage for its backward) and hooks their rebuild on the gradient of
    `after`, that layer's output."""

    def __init__(self, function, module: nn.Module | None = None):
        self.function, self.ctx, self.outputs, self.module = function, None, (), module

    def __call__(self, *inputs):
        outputs = _WithoutOutput.apply(self, *inputs)
        self.outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        return outputs

    def discard(self, after: torch.Tensor) -> None:
        if not after.requires_grad:
            return
        with torch.no_grad():
            for output in self.outputs:
                free_storage(output)
        after.register_hook(self._rebuild)

    def _rebuild(self, _grad) -> None:
        if isinstance(self.module, FSDPModule):  # an FSDP unit of its own (`unit = module`) is resharded since its
            self.module.unshard()  # forward, and its own pre-backward runs only after this rebuild: gather it now
        with torch.enable_grad():
            rebuilt = self.function(*self.ctx.saved_tensors)
        rebuilt = rebuilt if isinstance(rebuilt, tuple) else (rebuilt,)
        with torch.no_grad():  # the same storage, so the tensors the layer after saved see the values again
            for output, again in zip(self.outputs, rebuilt):
                refill_storage(output, again)
        self.ctx.rebuilt, self.outputs, self.ctx = rebuilt, (), None


def _storage(tensor: torch.Tensor):
    return local_tensor(tensor).untyped_storage()


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, or a DTensor's shard."""
    return getattr(tensor, "_local_tensor", tensor)


def free_storage(output: torch.Tensor) -> None:
    """Frees `output`'s storage (the tensors sharing it keep their shapes, their data gone till `refill_storage`);
    `runtime.memtrace` records it as a free."""
    _storage(output).resize_(0)


def refill_storage(output: torch.Tensor, again: torch.Tensor) -> None:
    """`output`'s freed storage allocated again and given `again`'s values (so every tensor sharing it sees them);
    `runtime.memtrace` records it as an allocation."""
    storage = _storage(output)
    storage.resize_(_storage(again).size())
    storage.copy_(_storage(again))


def rerun_without_output(module: nn.Module) -> None:
    """Each call of `module` runs as a `DiscardedOutput`, left in `module.pending` for the caller to `discard`
    (`runtime.models.discard_after`); its parameters' names stay as they are."""
    plain = module.forward

    def forward(*inputs):
        module.pending = DiscardedOutput(plain, module)
        return module.pending(*inputs)

    module.forward = forward


def discard_after(module: nn.Module, after: torch.Tensor) -> torch.Tensor:
    """Frees the outputs of `module`'s last call once `after`, what the layer after it made of them, exists, when
    `module` runs without output (`rerun_without_output`); returns `after`."""
    pending = getattr(module, "pending", None)
    if pending is not None:
        module.pending = None
        pending.discard(after)
    return after
