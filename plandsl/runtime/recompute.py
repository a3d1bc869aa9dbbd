"""Activation recomputation (`train.recompute`) with torch's checkpoint_wrapper.

Stage: interpreter. Contract: `apply_ac(model, mode)` wraps in place: `full` recomputes whole blocks,
`selective` only the attention of each block (its activations grow with seq², Korthikanti et al.
2022), `none` changes nothing. Wrapping inserts `_checkpoint_wrapped_module` into parameter names.
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
            block.register_module("attn", checkpoint_wrapper(block.attn))
