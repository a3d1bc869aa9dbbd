"""Activation offloading (`train.offload_layers`): the first N blocks of a stage keep what autograd saves for their
backward in host memory.

Stage: interpreter. Contract: `apply_offload(model, count)` hooks, in place, the first `count` blocks of `model` (one
pipeline stage or virtual chunk) so that their forward runs under a pair of saved-tensors hooks, torch's
`autograd.graph.save_on_cpu` less the parameters: each tensor saved for the backward is copied to host memory (pinned
where the device is a GPU) and copied back when the backward unpacks it; parameters (and FSDP's gathered weights)
stay where they are, as Transformer Engine's offload handler leaves weights (`offload_weights=False`); a DTensor
(tensor parallelism's activations) moves its local shard and comes back with its spec. Hooks, not a
wrapper module, so parameter names stay as written. Each hooked block counts the tensors it moved
(`Offload.moved`): on CPU the copies are host to host, and that count is what shows they happened.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from plandsl.runtime.torch_model import blocks


class Offload:
    """One block's hook pair and its count of tensors moved to the host, and of those brought back."""

    def __init__(self) -> None:
        self.moved = 0
        self.restored = 0
        self._context = None

    def pack(self, tensor: torch.Tensor):
        if isinstance(tensor, nn.Parameter) or tensor.numel() == 0:
            return tensor
        if isinstance(tensor, DTensor):  # tensor parallelism's activations: their local shard, the spec kept
            return (DTensor, tensor._spec, tensor.requires_grad, self.pack(tensor._local_tensor))
        if type(tensor) is not torch.Tensor:  # another tensor subclass: left where it is, uncounted
            return tensor
        host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, device="cpu",
                           pin_memory=tensor.is_cuda and torch.cuda.is_available())
        host.copy_(tensor)
        self.moved += 1
        return (tensor.device, host)

    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        if packed[0] is DTensor:
            _, spec, requires_grad, local = packed
            return DTensor(self.unpack(local), spec, requires_grad=requires_grad)
        device, host = packed
        self.restored += 1
        return host.to(device, non_blocking=True)

    def enter(self, module, args) -> None:
        self._context = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        self._context.__enter__()

    def exit(self, module, args, output) -> None:
        context, self._context = self._context, None
        if context is not None:
            context.__exit__(None, None, None)


def apply_offload(model: nn.Module, count: int) -> list[Offload]:
    """Hook the first `count` blocks of `model` (a stage or virtual chunk: Megatron's --cpu-offloading-num-layers
    counts them per model, which has one stage there); their `Offload`s, in block order."""
    layers, names = blocks(model)
    if not count or layers is None:
        return []
    hooked = []
    for name in names[:count]:
        block = layers.get_submodule(name)
        offload = Offload()
        block.register_forward_pre_hook(offload.enter)
        block.register_forward_hook(offload.exit)
        block._plandsl_offload = offload  # what a test reads back (`offloads`)
        hooked.append(offload)
    return hooked


def offloads(model: nn.Module) -> list[Offload]:
    """The `Offload`s hooked on `model`'s blocks, in module order."""
    return [module._plandsl_offload for module in model.modules() if hasattr(module, "_plandsl_offload")]


__all__ = ["Offload", "apply_offload", "offloads"]
