"""Activation recomputation (`train.recompute`) with torch's checkpoint_wrapper.

Stage: interpreter. Contract: `apply_ac(model, mode)` wraps in place: `full` recomputes whole blocks
(wrapping inserts `_checkpoint_wrapped_module` into their parameter names), `selective` only each
block's attention core (`attn.core`: the softmax(q kᵀ) v of Korthikanti et al. 2022, Sec. 5, whose
activations grow with seq²; it holds no parameters), `none` changes nothing.
"""
from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from plandsl import ir


def apply_ac(model: nn.Module, mode: ir.Recompute) -> None:
    layers = getattr(model, "layers", None)
    if mode is ir.Recompute.none or layers is None:
        return
    for name, block in layers.items():
        if mode is ir.Recompute.full:
            layers.register_module(name, checkpoint_wrapper(block))
        elif hasattr(block, "attn"):
            block.attn.register_module("core", checkpoint_wrapper(block.attn.core))
