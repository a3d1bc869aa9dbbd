"""A module's buffers, walked one way for everyone who compares, saves or puts them back.

Stage: interpreter. Contract: `owned_buffers(module)` yields an `Owned` (the owner's path, the owner, the buffer's
name, the buffer, whether the state dict holds it) for each buffer of `module` and its descendants as they are now;
`save(owned)` clones them and `put_back(saved)` rebinds each name to the tensor it named when saved and copies the
saved value into it (so a forward that rebinds a buffer, `self.calls = self.calls + 1`, is undone too), the latest
saved first (a buffer saved twice ends as it was first). Used by the reference's comparison (`runtime.reference`),
recomputation (`runtime.parallel.recompute`), traced stages (`runtime.torch_model`) and the pipeline's shape inference
(`runtime.parallel.pipeline`).
"""
from __future__ import annotations

from typing import Iterable, Iterator, NamedTuple

import torch
from torch import nn


class Owned(NamedTuple):
    path: str          # the owner's FQN in the module walked ("" for the module itself)
    owner: nn.Module
    name: str          # the buffer's name in its owner
    buffer: torch.Tensor
    persistent: bool   # in the state dict (BatchNorm's running statistics), not a table rebuilt from the config

    @property
    def fqn(self) -> str:
        return f"{self.path}.{self.name}" if self.path else self.name


def owned_buffers(module: nn.Module) -> Iterator[Owned]:
    """Each buffer of `module` and its descendants (each module once), as they are now."""
    for path, owner in module.named_modules():
        for name, buffer in owner._buffers.items():
            if buffer is not None:
                yield Owned(path, owner, name, buffer, name not in owner._non_persistent_buffers_set)


Saved = list[tuple[nn.Module, str, torch.Tensor, torch.Tensor]]


def save(owned: Iterable[Owned]) -> Saved:
    """(owner, name, buffer, a copy of its value) of each buffer in `owned`."""
    with torch.no_grad():
        return [(entry.owner, entry.name, entry.buffer, entry.buffer.clone()) for entry in owned]


def put_back(saved: Saved) -> None:
    """Each saved name bound again to the tensor it named, holding the value it held (`save`); the latest saved first,
    so a buffer saved twice (two stages' savings of a tensor both hold, between which one's forward changed it) ends
    as the first saving found it."""
    with torch.no_grad():
        for owner, name, buffer, value in reversed(saved):
            owner._buffers[name] = buffer
            buffer.copy_(value)
