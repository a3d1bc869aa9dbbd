"""The global batch's share of each data rank, as far as the plan alone says it: even, or written.

Stage: IR, read by the checker, the cost model and the interpreter. Contract: `written_shares(plan)` gives
the sequences each data rank trains on per step, in data-rank order (the batch axes' coordinates,
outermost first, as the interpreter's `parallel.mesh.coordinate` numbers them), or None for
`batch_shares: speed`, which the cost model resolves (`cost.estimate.data_shares`: the shares that
balance the replicas' predicted step times); `replica_device_types(plan)` the device types of each
pipeline rank of each replica; `replica_plan` the plan as one replica of it runs (every data rank
with that share).
"""
from __future__ import annotations

from plandsl import ir

SPEED = "speed"


def data_ranks(plan: ir.Plan) -> int:
    """How many shares the global batch is cut into: the data ranks (`plan.dp`, every batch axis)."""
    return plan.dp


def uneven(plan: ir.Plan) -> bool:
    """Whether the plan chooses its shares (`batch_shares`), rather than global_batch / dp each."""
    return plan.train.batch_shares is not None


def written_shares(plan: ir.Plan) -> tuple[int, ...] | None:
    """Sequences per data rank and step, where the plan fixes them (even, or a written list); None for `speed`."""
    train, dp = plan.train, data_ranks(plan)
    if train.batch_shares is None:
        return (train.global_batch // dp,) * dp
    if train.batch_shares == SPEED:
        return None
    return tuple(train.batch_shares)


def replica_device_types(plan: ir.Plan) -> list[tuple[tuple[ir.DeviceType, ...], ...]]:
    """Per data rank, per pipeline rank (one without a pipeline): the device types of its devices, each once, in
    device order (the cost model times a rank on the slowest: `cost.stage.slowest`)."""
    strides, stride = {}, 1
    for axis in reversed(plan.mesh.axes):
        strides[axis.name] = stride
        stride *= axis.size
    batch = [(strides[name], plan.mesh.degree(name)) for name in plan.batch_axes() if plan.mesh.axis(name)]
    pp_axis = plan.stages.axis if plan.stages is not None else None
    pp_stride, pp = (strides[pp_axis], plan.pp) if pp_axis in strides else (1, 1)
    start = plan.mesh.first_device
    devices = plan.cluster.devices_in_order()[start:start + plan.mesh.size]
    found: list[list[dict[str, ir.DeviceType]]] = [[{} for _ in range(pp)] for _ in range(data_ranks(plan))]
    for index, device in enumerate(devices):
        rank = 0
        for size_stride, size in batch:
            rank = rank * size + (index // size_stride) % size
        found[rank][(index // pp_stride) % pp].setdefault(device.name, device)
    return [tuple(tuple(types.values()) for types in ranks) for ranks in found]


def mixed_replicas(plan: ir.Plan) -> bool:
    """Whether the plan's data ranks sit on different device types (where uneven shares can pay)."""
    return len({tuple(tuple(d.name for d in types) for types in ranks) for ranks in replica_device_types(plan)}) > 1


def replica_plan(plan: ir.Plan, share: int) -> ir.Plan:
    """The plan as one replica with `share` sequences runs it: every data rank with that share, no
    `batch_shares` (its microbatch count, schedule and memory are the even plan's)."""
    train = plan.train.model_copy(update={"global_batch": share * data_ranks(plan), "batch_shares": None})
    return plan.model_copy(update={"train": train})


__all__ = ["SPEED", "data_ranks", "mixed_replicas", "replica_device_types", "replica_plan", "uneven", "written_shares"]
