"""Estimated memory per device against the device's capacity (E503).

Uses the one memory model (`plandsl.cost.memory`) with the plan's real stage placement;
the capacity of a pipeline rank is that of the smallest device holding it.
"""
from __future__ import annotations

from typing import Iterator

from plandsl import ir
from plandsl.cost.memory import MemoryEstimate, estimate_memory, inflight_microbatches
from plandsl.diagnostics import Diagnostic, Note, diag
from plandsl.ir.placement import Assignment, assign_stages
from plandsl.lower.units import format_bytes


def pipeline_rank_devices(plan: ir.Plan) -> list[list[ir.DeviceType]]:
    """Pipeline rank -> the device types of the mesh devices at that pp coordinate (one per device)."""
    start = plan.mesh.first_device
    devices = plan.cluster.devices_in_order()[start:start + plan.mesh.size]
    if plan.stages is None:
        return [devices]
    names = [a.name for a in plan.mesh.axes]
    position = names.index(plan.stages.axis)
    stride = 1
    for axis in plan.mesh.axes[position + 1:]:
        stride *= axis.size
    pp = plan.pp
    return [[d for index, d in enumerate(devices) if (index // stride) % pp == rank] for rank in range(pp)]


def pipeline_rank_device_types(plan: ir.Plan) -> list[list[ir.DeviceType]]:
    """Pipeline rank -> the device types at that pp coordinate of the mesh, each once, in device
    order (what `pipeline_rank_devices` holds, without the counts). Work is per run of one device
    type (a node group) and rank, not per device: a million-device cluster costs what its few
    groups do."""
    pp = plan.pp if plan.stages is not None else 1
    stride = 1
    if plan.stages is not None:
        names = [a.name for a in plan.mesh.axes]
        for axis in plan.mesh.axes[names.index(plan.stages.axis) + 1:]:
            stride *= axis.size
    ranks: list[dict[str, ir.DeviceType]] = [{} for _ in range(pp)]
    for device, first, end in mesh_device_runs(plan):
        if end - first >= stride * pp:  # the run covers every rank
            for found in ranks:
                found.setdefault(device.name, device)
            continue
        block = first // stride
        while block * stride < end:
            ranks[block % pp].setdefault(device.name, device)
            block += 1
    return [list(found.values()) for found in ranks]


def mesh_device_runs(plan: ir.Plan) -> list[tuple[ir.DeviceType, int, int]]:
    """(device type, first, end) of each run of one node group inside the mesh, as mesh indices."""
    start, size = plan.mesh.first_device, plan.mesh.size
    runs, offset = [], 0
    for group in plan.cluster.groups:
        length = group.count * group.node.devices
        first, end = max(offset, start), min(offset + length, start + size)
        if first < end:
            runs.append((group.node.device, first - start, end - start))
        offset += length
    return runs


def estimate_plan_memory(plan: ir.Plan, assignment: Assignment | None = None) -> list[MemoryEstimate] | None:
    """Per pipeline rank memory, or None when the placement is invalid."""
    if assignment is None:
        assignment, problems = assign_stages(plan)
        if assignment is None:
            return None
    ranks = assignment.rank_stages()
    schedule = plan.schedule.name if plan.schedule and plan.stages else "gpipe"
    inflight = inflight_microbatches(schedule, len(ranks), plan.num_microbatches, assignment.virtual) \
        if plan.stages else [1]
    return estimate_memory(plan, assignment.stage_layers, ranks, inflight)


def check_memory(plan: ir.Plan) -> Iterator[Diagnostic]:
    estimates = estimate_plan_memory(plan)
    if estimates is None:
        return
    for rank, (estimate, devices) in enumerate(zip(estimates, pipeline_rank_device_types(plan))):
        if not devices:
            continue
        device = min(devices, key=lambda d: d.memory)
        if estimate.total > device.memory:
            where = f"pipeline rank {rank}" if plan.stages else "each device"
            parts = (f"parameters {format_bytes(estimate.params)}, gradients {format_bytes(estimate.grads)}, "
                     f"optimizer {format_bytes(estimate.optimizer)}, activations {format_bytes(estimate.activations)}")
            yield diag("E503", f"{where} needs about {format_bytes(estimate.total)} ({parts}), but "
                       f"'{device.name}' has {format_bytes(device.memory)}", plan.mesh.span or plan.span,
                       hint=_memory_hint(plan, estimate),
                       notes=[Note(f"plan '{plan.name}'", plan.span)])
            return  # one report per plan: the other ranks share the cause


def _memory_hint(plan: ir.Plan, estimate: MemoryEstimate) -> str:
    states = estimate.params + estimate.grads + estimate.optimizer
    if estimate.activations > states:
        if plan.train.recompute != ir.Recompute.full:
            return "activations dominate: try `recompute: full` in train, a smaller micro_batch, or more tp/pp"
        return "activations dominate: lower micro_batch or add tensor/sequence/pipeline parallelism"
    if plan.data is None or plan.data.zero_stage < 3:
        return "model states dominate: shard them with `data = zero3 over dp` (FSDP), or add tp/pp"
    return "model states dominate even with ZeRO-3: add tensor or pipeline parallelism, or more devices"
