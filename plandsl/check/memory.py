"""Estimated memory per device against the device's capacity (E503).

Uses the one memory model (`plandsl.cost.memory`) with the plan's real stage placement;
the capacity of a pipeline rank is that of the smallest device holding it. With `batch_shares`, the
replica with the most microbatches (the most activations in flight) stands for every replica.
"""
from __future__ import annotations

from typing import Iterator

from plandsl import ir
from plandsl.cost.estimate import data_shares
from plandsl.cost.memory import MemoryEstimate, estimate_plan_memory
from plandsl.diagnostics import Diagnostic, Note, diag
from plandsl.ir import shares as batch
from plandsl.ir.placement import pipeline_rank_device_types
from plandsl.lower.units import format_bytes


def check_memory(plan: ir.Plan) -> Iterator[Diagnostic]:
    shares = data_shares(plan) if batch.uneven(plan) else None
    estimates = estimate_plan_memory(batch.replica_plan(plan, max(shares)) if shares else plan)
    if estimates is None:
        return
    for rank, (estimate, devices) in enumerate(zip(estimates, pipeline_rank_device_types(plan))):
        if not devices:
            continue
        device = min(devices, key=lambda d: d.usable_memory)
        if estimate.total > device.usable_memory:
            where = f"pipeline rank {rank}" if plan.stages else "each device"
            parts = (f"parameters {format_bytes(estimate.params)}, gradients {format_bytes(estimate.grads)}, "
                     f"optimizer {format_bytes(estimate.optimizer)}, activations {format_bytes(estimate.activations)}")
            yield diag("E503", f"{where} needs about {format_bytes(estimate.total)} ({parts}), but "
                       f"'{device.name}' has {_room(device)}", plan.mesh.span or plan.span,
                       hint=_memory_hint(plan, estimate),
                       notes=[Note(f"plan '{plan.name}'", plan.span)])
            return  # one report per plan: the other ranks share the cause


def _room(device: ir.DeviceType) -> str:
    """The memory a plan's tensors may use on the device, with its reserve when it keeps one."""
    reserve = device.memory - device.usable_memory
    if not reserve:
        return format_bytes(device.memory)
    return f"{format_bytes(device.usable_memory)} for them ({format_bytes(device.memory)} less a reserve of " \
           f"{format_bytes(reserve)})"


def _memory_hint(plan: ir.Plan, estimate: MemoryEstimate) -> str:
    states = estimate.params + estimate.grads + estimate.optimizer
    if estimate.activations > states:
        if plan.train.recompute != ir.Recompute.full:
            return "activations dominate: try `recompute: full` in train, a smaller micro_batch, or more tp/pp"
        return "activations dominate: lower micro_batch or add tensor/sequence/pipeline parallelism"
    if plan.data is None or plan.data.zero_stage < 3:
        return "model states dominate: shard them with `data = zero3 over dp` (FSDP), or add tp/pp"
    return "model states dominate even with ZeRO-3: add tensor or pipeline parallelism, or more devices"
