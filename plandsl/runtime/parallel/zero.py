"""ZeRO-1 for DTensor parameters: optimizer states partitioned over the ranks that replicate them.

Stage: interpreter. Contract: `Zero1Optimizer(partitions, optimizer_class, **defaults)` takes groups
of parameters, each with the process group whose ranks hold them identically (None: no other rank
does); every rank steps, with one `optimizer_class` (`.optim`), only the whole parameters its group
assigns it, and then each owner broadcasts their new values to the rest of its group. Gradients,
parameters and the step's arithmetic are those of the plain optimizer, so a run matches one process.

Why not torch's `ZeroRedundancyOptimizer`: it broadcasts the parameters themselves through c10d,
which takes plain tensors only; tensor-parallel and expert shards, and the pipeline stages' composable
`replicate`, make parameters DTensors. Here the owner's optimizer steps the DTensor (so its states
are DTensors, which `torch.distributed.checkpoint` reshards by name), and the broadcast carries each
DTensor's local shard: the ranks of one data-parallel group hold the same shard (same tensor, pipeline
and expert coordinates), so a shard's bytes are all that differ after the step. This is stage 1 of
Rajbhandari et al. 2020 (ZeRO, P_os): states 1/N_d, gradients and parameters whole. Parameters are
assigned whole, largest first to the least loaded rank, as `ZeroRedundancyOptimizer` does.
"""
from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor


def assign(sizes: list[int], ranks: int) -> list[int]:
    """The rank that steps each parameter (by its element count): largest first, each to the rank holding
    the fewest elements so far (ties to the lowest rank). Deterministic, so every rank agrees."""
    load = [0] * ranks
    owners = [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        owner = min(range(ranks), key=lambda r: (load[r], r))
        owners[index] = owner
        load[owner] += sizes[index]
    return owners


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The storage this rank holds of a parameter: a DTensor's local shard (an alias), else the tensor."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _nbytes(tensor: torch.Tensor) -> int:
    shard = local(tensor)
    return shard.numel() * shard.element_size()


class Zero1Optimizer(torch.optim.Optimizer):
    """`optimizer_class` over this rank's partition; the outer object holds every parameter (one group),
    so `zero_grad`, learning-rate schedulers and gradient clipping see the whole model."""

    def __init__(self, partitions: list[tuple[list[torch.Tensor], ProcessGroup | None]],
                 optimizer_class: type[torch.optim.Optimizer], **defaults):
        params = [p for group_params, _ in partitions for p in group_params]
        super().__init__(params, defaults)
        owned: list[torch.Tensor] = []
        # (process group, the owner's global rank, the parameters it broadcasts), one per owner
        self._broadcasts: list[tuple[ProcessGroup, int, list[torch.Tensor]]] = []
        self.partition_bytes: list[list[int]] = []
        """Per partition, the bytes of the parameters each rank of its group steps (every rank computes all)."""
        for group_params, group in partitions:
            size = 1 if group is None else dist.get_world_size(group)
            if size == 1:
                owned += group_params
                self.partition_bytes.append([sum(_nbytes(p) for p in group_params)])
                continue
            owners = assign([local(p).numel() for p in group_params], size)
            me = dist.get_rank(group)
            owned += [p for p, owner in zip(group_params, owners) if owner == me]
            loads = [0] * size
            for p, owner in zip(group_params, owners):
                loads[owner] += _nbytes(p)
            self.partition_bytes.append(loads)
            for owner in range(size):
                mine = [p for p, o in zip(group_params, owners) if o == owner]
                if mine:
                    self._broadcasts.append((group, dist.get_global_rank(group, owner), mine))
        self.optim = optimizer_class([{"params": owned}], **defaults)

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("Zero1Optimizer.step takes no closure")
        inner = self.optim.param_groups[0]
        for key, value in self.param_groups[0].items():  # the learning rate the scheduler set, ...
            if key != "params":
                inner[key] = value
        self.optim.step()
        self._broadcast()

    def _broadcast(self) -> None:
        """Each owner's new parameter shards to the other ranks of its group: one flat buffer per owner
        and dtype (a broadcast per tensor would pay the latency once per tensor)."""
        me = dist.get_rank()
        for group, owner, params in self._broadcasts:
            by_dtype: dict[torch.dtype, list[torch.Tensor]] = defaultdict(list)
            for param in params:
                by_dtype[local(param).dtype].append(local(param))
            for shards in by_dtype.values():
                flat = torch.cat([s.reshape(-1) for s in shards]) if me == owner else \
                    torch.empty(sum(s.numel() for s in shards), dtype=shards[0].dtype, device=shards[0].device)
                dist.broadcast(flat, src=owner, group=group)
                if me != owner:
                    for shard, value in zip(shards, flat.split([s.numel() for s in shards])):
                        shard.copy_(value.view_as(shard))
