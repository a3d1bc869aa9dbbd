"""Estimated memory per device against the device's capacity (E503), and the activations a plan offloads against
its hosts' memory where the node states it (E514).

Uses the one memory model (`plandsl.cost.memory`) with the plan's real stage placement;
the capacity of a pipeline rank is that of the smallest device holding it. With `batch_shares` each data
rank's replica is counted on its own (its own microbatches in flight; under ZeRO-2/3 every unit held
gathered through the step) against its own devices, and the error names the data rank and its device.
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
    if batch.uneven(plan):
        yield from _check_replicas(plan)
        return
    estimates = estimate_plan_memory(plan)
    if estimates is None:
        return
    yield from _check_host(plan, estimates)
    for rank, (estimate, devices) in enumerate(zip(estimates, pipeline_rank_device_types(plan))):
        if not devices:
            continue
        device = min(devices, key=lambda d: d.usable_memory)
        if estimate.total > device.usable_memory:
            where = f"pipeline rank {rank}" if plan.stages else "each device"
            yield diag("E503", f"{where} needs about {format_bytes(estimate.total)} ({_parts(estimate)}), but "
                       f"'{device.name}' has {_room(device)}", plan.mesh.span or plan.span,
                       hint=_memory_hint(plan, estimate),
                       notes=[Note(f"plan '{plan.name}'", plan.span)])
            return  # one report per plan: the other ranks share the cause


def _check_host(plan: ir.Plan, estimates: list[MemoryEstimate]) -> Iterator[Diagnostic]:
    """The offloaded activations of one machine's devices (each at the most any pipeline rank offloads: a bound)
    against its `host_memory`, for each node type of the cluster that states it (E514)."""
    most = max((estimate.host for estimate in estimates), default=0.0)
    if not most:
        return
    for group in plan.cluster.groups:
        node = group.node
        if node.host_memory is not None and node.host_devices * most > node.host_memory:
            yield diag("E514", f"offload_layers({plan.train.offload_layers}) keeps about {format_bytes(most)} of "
                       f"activations per device in host memory, {format_bytes(node.host_devices * most)} for the "
                       f"{node.host_devices} devices of one machine of node '{node.name}', but it has "
                       f"{format_bytes(node.host_memory)} (host_memory)", plan.train.span_of("offload_layers"),
                       hint="offload fewer blocks, or a smaller micro_batch",
                       notes=[Note(f"node '{node.name}'", node.span)] if node.span else [])
            return


def _check_replicas(plan: ir.Plan) -> Iterator[Diagnostic]:
    """`batch_shares`: each data rank's replica (its share's microbatches) on its own devices; one report."""
    shares = data_shares(plan)
    if shares is None:
        return  # E509 (the training check)
    held = plan.data is not None  # `cost.estimate._estimate_replicas`
    mb = plan.train.micro_batch
    found: dict[int, list[MemoryEstimate] | None] = {}
    for replica, (share, ranks) in enumerate(zip(shares, batch.replica_device_types(plan))):
        if share not in found:
            found[share] = estimate_plan_memory(batch.replica_plan(plan, share), held=held)
        estimates = found[share]
        if estimates is None:
            return
        for rank, (estimate, devices) in enumerate(zip(estimates, ranks)):
            if not devices:
                continue
            device = min(devices, key=lambda d: d.usable_memory)
            if estimate.total > device.usable_memory:
                where = (f"data rank {replica} ({share} sequences: {share // mb} microbatch(es) of {mb}"
                         + (f"), pipeline rank {rank}," if plan.stages else ")"))
                yield diag("E503", f"{where} needs about {format_bytes(estimate.total)} ({_parts(estimate)}), but "
                           f"its device '{device.name}' has {_room(device)}", plan.mesh.span or plan.span,
                           hint=_shares_hint(plan, estimate, device.usable_memory) or _memory_hint(plan, estimate),
                           notes=[Note(f"plan '{plan.name}'", plan.span)]
                           + ([Note("the shares: batch_shares", plan.train.field_spans["batch_shares"])]
                              if plan.train.field_spans.get("batch_shares") else []))
                return


def _parts(estimate: MemoryEstimate) -> str:
    return (f"parameters {format_bytes(estimate.params)}, gradients {format_bytes(estimate.grads)}, "
            f"optimizer {format_bytes(estimate.optimizer)}, activations {format_bytes(estimate.activations)}"
            + (f", torch's pipeline buffers {format_bytes(estimate.other)}" if estimate.other else "")
            + (f"; less {format_bytes(estimate.apart)} of gradients a step of one microbatch has not made at its peak"
               if estimate.apart else "")
            + (f"; less {format_bytes(estimate.moments)} of ZeRO's units and activations never alive together"
               if estimate.moments else ""))


def _shares_hint(plan: ir.Plan, estimate: MemoryEstimate, room: float) -> str | None:
    """With shares under ZeRO-2/3, when the units held gathered through the step are what overflows `room` (not
    replication's copies of the parameters, `cost.memory.replicate_copy_bytes`, which ZeRO-1 holds too)."""
    gathered = estimate.gathered_params + estimate.gathered_grads
    if plan.data is None or plan.data.zero_stage < 2 or not gathered or estimate.total - gathered > room:
        return None
    return (f"with batch_shares, ZeRO-2/3 keep every unit gathered through the step ({format_bytes(gathered)} "
            "here): use `data = zero1 over dp`, or add tensor or pipeline parallelism")


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
