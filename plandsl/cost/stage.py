"""A pipeline stage's microbatch and a pipeline rank's tail: layers summed, ZeRO's traffic added.

Stage: cost model. Contract: `stage_time(layer_times, params, zero_stage, ...)` sums a stage's layers
and lengthens F and B by ZeRO-2/3's per-unit traffic (`zero_traffic`); `rank_tail(stages, ...)` is
what a rank does after its last backward: the exposed gradient reduction (ZeRO-0/1, hsdp's
replicas) and the optimizer step. Pure.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Sequence

from plandsl import ir
from plandsl.cost.comm import beside, collective_seconds
from plandsl.cost.compute import estimate_optimizer_step, peak_of
from plandsl.cost.layer import NOTHING_MOVED, LayerTime, Links, Moved
from plandsl.cost.memory import FP32_STATES, STATE_BYTES, StateBytes, local_numel, module_split
from plandsl.ir.layers import Layer

_EXPERT = "experts"
# Gradients travel at the dtype they are kept in: fp32 by default (`cost.memory.STATE_BYTES`), as the
# interpreter holds them (fp32 parameters under autocast) and as Megatron-LM reduces its fp32 main-grad
# buffers by default (`accumulate_allreduce_grads_in_fp32`, on for bf16); a plan's `grad_dtype` changes
# it (`grad_bytes`, `StateBytes.grads`); parameter gathers move `element` bytes per element: the compute precision's,
# or the plan's `gather` dtype averaged over a stage's parameters (`cost.memory.gather_element`: under `gather = fp8`
# the quantized layers' weights at one byte, the rest at 16 bits).


# ---- stages and ranks ------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class StageTime:
    """Seconds of one microbatch through one stage (F, I, W; B = I + W), ZeRO traffic included."""

    forward: float
    input_grad: float
    weight_grad: float
    comm: float          # communication inside F and B (critical path)
    flops: float         # forward FLOPs per device
    recompute_flops: float
    dense_params: float  # parameters held per device (after tensor/expert parallelism)
    expert_params: float
    moved: Moved = NOTHING_MOVED  # bytes its collectives move (layers' and ZeRO-2/3's), per microbatch
    first_bucket: float = 0.0  # dense parameters of the bucket holding its first layers (`first_bucket`)
    first_gather: float = math.inf  # ZeRO-3's closed form: the seconds of the forward's first all-gather, an
    #                                 average unit's (`rank_tail` tops it up to the first bucket's); inf: priced
    element: float = 0.0  # bytes per parameter element its gathers move (`cost.memory.gather_element`); 0: none given
    bucket_element: float = 0.0  # the same for its first bucket's parameters (`bucket_element`; 0: `element`)

    @property
    def backward(self) -> float:
        return self.input_grad + self.weight_grad

    @property
    def compute(self) -> float:
        return self.forward + self.backward - self.comm


def param_split(layer: Layer, tp: int, ep: int, expert_tp: int | None = None) -> tuple[int, int]:
    """(dense, expert) elements of a layer's parameters on one device (`ep`: the expert group's ranks)."""
    dense = expert = 0
    for param in layer.params:
        count = local_numel(param, tp, ep, expert_tp)
        if len(param.dims) == 3 and param.dims[0] == _EXPERT:
            expert += count
        else:
            dense += count
    return dense, expert


BUCKET_PARAMS, BUCKET_PARAMS_PER_RANK = 40_000_000, 1_000_000
"""Megatron-Core's default gradient bucket: max(40M, 1M x data-parallel ranks) parameters
(`DistributedDataParallelConfig.bucket_size`, `megatron/core/distributed/distributed_data_parallel.py`)."""


def bucket_params(data_ranks: int) -> float:
    """Parameters per bucket of Megatron-Core's data-parallel gradient buffer over `data_ranks` ranks."""
    return float(max(BUCKET_PARAMS, BUCKET_PARAMS_PER_RANK * data_ranks))


def first_bucket(params: Sequence[float], bucket: float) -> float:
    """Parameters of the bucket that holds a stage's first layers (`params`: each layer's, in forward order).

    Megatron-Core fills buckets walking the parameters backwards (the order the backward makes their
    gradients) and closes one once it holds `bucket` parameters; a parameter is never split, so the
    embedding (V·h/t) closes the last bucket it falls in alone or with what came before it. That bucket's
    gradients are ready only when the backward ends, and its parameters are the first the next forward needs
    (`param_and_grad_buffer.py`; the layer, not the parameter, is the unit here)."""
    held = closed = 0.0
    for count in reversed(params):
        held += count
        if held >= bucket:
            held, closed = 0.0, held
    return held if held > 0 else closed


def bucket_element(params: Sequence[float], gathered: Sequence[float], bucket: float, element: float) -> float:
    """Bytes per element the gather of a stage's first bucket moves (`first_bucket`: its first layers whose
    parameters sum to `bucket`, a bucket closing at a layer's end): those layers' bytes as gathered (`gathered`, per
    layer) over their parameters; `element` when none is given. Under `gather = fp8` the first stage's bucket is its
    16-bit embedding, where the stage's average counts its blocks' FP8 weights."""
    if not gathered or bucket <= 0:
        return element
    held = size = 0.0
    for count, bytes_ in zip(params, gathered):
        if held >= bucket:
            break
        held, size = held + count, size + bytes_
    return size / held if held else element


def fsdp_units(layers: Sequence[Layer]) -> int:
    """The units ZeRO-2/3 gather and reduce one at a time: each block (or written layer), and the
    stage's other layers together (the root), as `runtime.data_parallel.apply_fsdp` wraps them."""
    blocks = sum(1 for layer in layers if layer.kind in ("block", "custom"))
    return max(1, blocks + (1 if blocks < len(layers) else 0))


def stage_time(times: Sequence[LayerTime], params: Sequence[tuple[int, int]], zero_stage: int,
               element: float, links: Links, units: int | None = None, grad_bytes: int = STATE_BYTES,
               gathered: Sequence[Unit] | None = None, pipelined: bool = False, share: float = 0.0,
               layer_bytes: Sequence[float] = ()) -> StageTime:
    """Sum the layers of a stage (then `zero_traffic`); `units`: its FSDP units (default: one per layer);
    `gathered`: the units in execution order when the plan gathers otherwise than FSDP's blocks one ahead
    (`gather_units`); `pipelined`: ZeRO-2/3 under a pipeline schedule (`cost.memory.pipelined_shards`);
    `share`: the device's `comm_share` (`cost.comm.beside`); `layer_bytes`: each layer's dense parameters' bytes as
    gathered (the plan's `gather` dtype, `bucket_element`; none: every element at `element`)."""
    dense_params = [float(p[0]) for p in params]
    bucket = first_bucket(dense_params, bucket_params(links.data.size))
    return zero_traffic(sum(t.forward for t in times), sum(t.input_grad for t in times),
                        sum(t.weight_grad for t in times), sum(t.forward_comm + t.backward_comm for t in times),
                        sum(t.flops for t in times), sum(t.recompute_flops for t in times),
                        float(sum(p[0] for p in params)), float(sum(p[1] for p in params)),
                        zero_stage, element, links, units or len(times), grad_bytes,
                        sum((t.moved for t in times), NOTHING_MOVED), gathered, pipelined, bucket, share,
                        bucket_element(dense_params, layer_bytes, bucket, element))


# ---- units gathered otherwise than FSDP's blocks one ahead ----------------------------------------------
@dataclass(frozen=True, slots=True)
class Unit:
    """One collective's worth of a stage (`data = zero3 ... with unit, prefetch, prefetch_bucket`): its share of
    the compute, forward and backward (recomputation included), its parameters on one device (dense, expert),
    and how many units after it are gathered while it computes (`ahead`, from the plan's prefetch)."""

    forward: float
    backward: float
    dense: float
    expert: float
    ahead: int = 1


def gather_units(layers: Sequence[Layer], times: Sequence[LayerTime], params: Sequence[tuple[int, int]],
                 gathering: ir.Gathering, tp: int, ep: int, expert_tp: int | None = None) -> list[Unit]:
    """A stage's units in execution order, each with its own compute and parameters.

    `block`: each block (or written layer) its own unit at its own seconds, the stage's other layers
    (embedding, norm, head) one root unit gathered first, as `fsdp_units` counts them. `module`: each module
    that owns parameters (DeepSpeed's ZeRO-3 gathers a sub-module's parameters in its forward pre-hook), its
    layer's seconds shared among its modules by their parameters (a linear layer's FLOPs are 2 x tokens x its
    parameters; a block's attention core and element-wise work, a few per cent of it, go with them).
    `ahead`: `prefetch` units, or with `prefetch_bucket` the fewest following units (at least one) whose
    parameters reach it, as DeepSpeed's `get_params_to_prefetch` issues them (stage3.py, 0.3.13-0.5.x)."""
    units: list[Unit] = []
    if gathering.unit is ir.GatherUnit.block:
        root = [(t, p) for layer, t, p in zip(layers, times, params) if layer.kind not in ("block", "custom")]
        if root:
            units.append(Unit(sum(t.forward for t, _ in root), sum(t.backward for t, _ in root),
                              sum(p[0] for _, p in root), sum(p[1] for _, p in root)))
        units += [Unit(t.forward, t.backward, p[0], p[1])
                  for layer, t, p in zip(layers, times, params) if layer.kind in ("block", "custom")]
    else:
        for layer, t in zip(layers, times):
            split = module_split(layer, tp, ep, expert_tp)
            total = sum(d + e for d, e in split) or 1
            units += [Unit(t.forward * (d + e) / total, t.backward * (d + e) / total, d, e) for d, e in split]
    sizes = [unit.dense + unit.expert for unit in units]
    return [replace(unit, ahead=gathering.ahead(sizes, index)) for index, unit in enumerate(units)]


def unit_pass(compute: Sequence[float], gather: Sequence[float], scatter: Sequence[float],
              ahead: Sequence[int], share: float = 0.0) -> float:
    """Seconds of one pass over units in execution order: a compute stream and one communication stream
    that runs its collectives in the order they are issued. Unit i computes once its all-gather is done and
    the previous unit has computed; when it starts, the gathers of the next `ahead[i]` units are issued; when
    it ends, its reduce-scatter is. The pass ends when the last unit has computed and every collective but
    the last reduce-scatter is done (that one runs behind the rank's next work, as `zero_traffic` takes it).
    A unit computes at (1 - `share`) of its speed while the communication stream is busy beside it (`share`: the
    device's `comm_share`; the stream is taken as busy from the unit's start until its last issued collective
    ends), so `c` seconds of compute beside `b` busy seconds take c + share·min(b, c/(1 - share))
    (`cost.comm.beside`). For u equal units one ahead, without reduce-scatters, g + (u - 1)·max(c + share·g, g)
    + c: `zero_traffic`'s closed form."""
    issued, comm, clock = 0, 0.0, 0.0
    done = [0.0] * len(compute)
    for i, seconds in enumerate(compute):
        while issued <= i:  # not prefetched: gathered now, exposed
            comm = done[issued] = max(comm, clock) + gather[issued]
            issued += 1
        start = max(clock, done[i])
        while issued < len(compute) and issued <= i + ahead[i]:
            comm = done[issued] = max(comm, start) + gather[issued]
            issued += 1
        busy = max(0.0, comm - start)  # the communication stream's collectives beside this unit's compute
        clock = start + seconds + share * min(busy, seconds / (1.0 - share))
        if scatter[i] > 0.0 and i + 1 < len(compute):
            comm = max(comm, clock) + scatter[i]
    return max(clock, comm)


def zero_traffic(forward: float, input_grad: float, weight_grad: float, comm: float, flops: float,
                 recompute_flops: float, dense: float, expert: float, zero_stage: int, element: float,
                 links: Links, units: int = 1, grad_bytes: int = STATE_BYTES,
                 moved: Moved = NOTHING_MOVED, gathered: Sequence[Unit] | None = None,
                 pipelined: bool = False, bucket: float = 0.0, share: float = 0.0,
                 bucket_bytes: float = 0.0) -> StageTime:
    """A stage's microbatch with ZeRO's per-microbatch traffic, one collective per unit.

    ZeRO-3 all-gathers every unit's parameters before its forward and again before its backward,
    and reduce-scatters its gradients after: 3x the parameter volume (Rajbhandari et al. 2020,
    Sec. 5.3 and 7.2); ZeRO-2 only reduce-scatters. Each unit is its own collective (FSDP, Zhao et
    al. 2023, Sec. 3.4), so each pays the ring's latency. Prefetching overlaps a unit's traffic
    with the neighbouring unit's compute only, so the first unit's all-gather waits with nothing to
    hide behind; the last unit's reduce-scatter is asynchronous and runs behind whatever the rank
    computes next. With u equal units of compute c and traffic x (backward: all-gather g plus
    reduce-scatter s) a pass takes g + (u - 1)·max(c, x) + c: for the forward max(C, X) + min(c, x); a unit
    computing beside its neighbour's traffic runs at (1 - `share`) of its speed meanwhile (the device's
    `comm_share`, `cost.comm.beside`), so each of those u - 1 steps is max(c + share·x, x).
    Gradients move at `grad_bytes` (the plan's `grad_dtype`, fp32 by default), parameters at `element`
    (the compute precision). `bucket`: the dense parameters of the stage's first bucket (`first_bucket`), gathered at
    `bucket_bytes` per element (`bucket_element`; 0: `element`).

    `gathered` (a plan's `with unit`, `prefetch` or `prefetch_bucket`, `gather_units`): the units as they run,
    each with its own compute and traffic, priced by `unit_pass` forward and then backward in reverse order,
    instead of the closed form's equal units one ahead.

    `pipelined` (ZeRO-2/3 under a pipeline schedule, `cost.memory.pipelined_shards`): a stage keeps its units
    gathered and its gradients unsharded through the step, so a microbatch moves nothing over the data axes;
    the step's one all-gather and one reduce-scatter are the rank's (`rank_tail`).
    """
    first_gather = math.inf
    if zero_stage >= 2 and pipelined:
        pass
    elif zero_stage >= 2 and gathered:
        backward = input_grad + weight_grad
        gathers = [_over_data("all_gather", u.dense, u.expert, element, links) if zero_stage >= 3 else 0.0
                   for u in gathered]
        scatters = [_over_data("reduce_scatter", u.dense, u.expert, grad_bytes, links) for u in gathered]
        ahead = [u.ahead for u in gathered]
        longer_forward = unit_pass([u.forward for u in gathered], gathers, [0.0] * len(gathered), ahead, share) \
            if zero_stage >= 3 else forward
        longer_backward = unit_pass([u.backward for u in reversed(gathered)], gathers[::-1], scatters[::-1],
                                    ahead[::-1], share)
        # the units carry the layers' compute; the pass adds only what waits on the traffic
        longer_forward += forward - sum(u.forward for u in gathered) if zero_stage >= 3 else 0.0
        longer_backward += backward - sum(u.backward for u in gathered)
        comm += (longer_forward - forward) + (longer_backward - backward)
        forward, input_grad = longer_forward, input_grad + longer_backward - backward
        moved = moved + Moved(data=_data_bytes(dense, expert, grad_bytes, links)
                              + (2 * _data_bytes(dense, expert, element, links) if zero_stage >= 3 else 0.0))
    elif zero_stage >= 2:
        units = max(1, units)
        scatter = _over_data("reduce_scatter", dense / units, expert / units, grad_bytes, links)
        gather = _over_data("all_gather", dense / units, expert / units, element, links) \
            if zero_stage >= 3 else 0.0
        backward = input_grad + weight_grad

        def overlapped(compute: float, traffic: float, first: float) -> float:
            if traffic <= 0.0:
                return compute
            unit = compute / units
            return first + (units - 1) * (unit + beside(traffic, unit, share)) + unit

        longer_forward = overlapped(forward, gather, gather)
        first_gather = gather if zero_stage >= 3 else math.inf
        longer_backward = overlapped(backward, gather + scatter, gather)
        comm += (longer_forward - forward) + (longer_backward - backward)
        forward, input_grad = longer_forward, input_grad + longer_backward - backward
        moved = moved + Moved(data=_data_bytes(dense, expert, grad_bytes, links)
                              + (2 * _data_bytes(dense, expert, element, links) if zero_stage >= 3 else 0.0))
    return StageTime(forward, input_grad, weight_grad, comm, flops, recompute_flops, dense, expert, moved, bucket,
                     first_gather, element, bucket_bytes or element)


def _data_bytes(dense: float, expert: float, element: float, links: Links) -> float:
    """Bytes of one collective over the data (+expert) axes of these parameters (`_over_data`'s buffers)."""
    return (dense * element if links.data.size > 1 else 0.0) + (expert * element if links.expert_data.size > 1 else 0.0)


def _over_data(collective: str, dense: float, expert: float, element: float, links: Links) -> float:
    """A collective of dense parameters over the data (+expert) axes and of expert ones over data."""
    return (collective_seconds(collective, dense * element, links.data)
            + collective_seconds(collective, expert * element, links.expert_data))


@dataclass(frozen=True, slots=True)
class RankTail:
    """What a pipeline rank does after its last backward: exposed gradient reduction, optimizer."""

    exposed: float
    optimizer: float
    moved: float = 0.0  # bytes its data-parallel collectives move


def rank_tail(stages: Sequence[StageTime], zero_stage: int, degrees: tuple[int, int], element: float,
              links: Links, device: ir.DeviceType, optimizer: ir.Optimizer,
              precision: ir.Precision, states: StateBytes = FP32_STATES, pipelined: bool = False,
              after_schedule: bool = False) -> RankTail:
    """Exposed data-parallel traffic and the optimizer step of one pipeline rank.

    ZeRO-0 all-reduces the gradients (bucketed, behind the backward of the last microbatch, as
    torch DDP and Megatron's overlap_grad_reduce do); ZeRO-1 reduce-scatters them the same way and
    all-gathers the updated parameters behind the next step's first forward (Megatron's distributed
    optimizer); ZeRO-2 reduced them already, and gathers the parameters; ZeRO-3 has nothing left.
    ZeRO-1's buckets are Megatron-Core's (`first_bucket`): the bucket of the rank's first layers is reduced
    only after the backward has ended and gathered before the forward can start (`--overlap-param-gather`
    dispatches the first gather at `zero_grad` and each next one when the one before is waited on), so
    each of those two collectives is exposed at least on that bucket.
    hsdp adds an all-reduce of its shard over the replicate axis. The optimizer step updates the
    parameters a device owns: all of them, or 1/N_d with ZeRO >= 1 (Rajbhandari et al. 2020).
    Gradients are reduced at `states.grads` (the plan's `grad_dtype`, fp32 by default), parameters
    gathered at `element` (or at the stages' own, `StageTime.element`, averaged over their parameters: the plan's
    `gather` dtype); the optimizer step reads and writes the plan's dtypes (`states`).
    `pipelined` (ZeRO-2/3 under a pipeline schedule, `cost.memory.pipelined_shards`): the stage's gradients are
    reduce-scattered once, after its last backward, with nothing left to compute behind them (torch's
    `perform_reduce_grad` runs after every microbatch's backward): exposed whole; its parameters are gathered
    once a step, ZeRO-3's before the first forward and ZeRO-2's after the optimizer, each behind a
    microbatch's forward as ZeRO-1's gather is.
    `after_schedule` (DeepSpeed's pipeline engine, `cost.estimate.deepspeed_pipeline`; ZeRO 0 or 1, all it takes):
    the schedule's last step reduces the gradients (`ReduceGrads` after the last `BackwardPass`,
    runtime/pipe/schedule.py; the engine turns the backward's own reduction off, `enable_backward_allreduce =
    False`), an all-reduce under ZeRO-1 too (zero/stage2.py `reduce_gradients` -> `buffered_reduce_fallback` ->
    `dist.all_reduce`), and ZeRO-1's optimizer step all-gathers the updated parameters before it returns
    (`all_gather_partitions`): both exposed whole, nothing computing beside them.
    A collective behind the backward or the forward slows it by the device's `comm_share` of its own seconds
    (`cost.comm.beside`); those exposed after the backward (the first bucket's, the pipelined reduce-scatter) have
    no computation beside them.
    """
    share = device.contention

    def behind(collective: float, compute: float) -> float:
        return beside(max(0.0, collective), compute, share)

    grad_bytes = states.grads
    dense = sum(s.dense_params for s in stages)
    expert = sum(s.expert_params for s in stages)
    if stages and all(s.element for s in stages) and dense + expert:
        element = sum(s.element * (s.dense_params + s.expert_params) for s in stages) / (dense + expert)
    first_element = stages[0].bucket_element or element if stages else element  # its first bucket's layers
    backward = sum(s.backward for s in stages)
    forward = sum(s.forward for s in stages)
    exposed = moved = 0.0
    if after_schedule and zero_stage <= 1:
        exposed = _over_data("all_reduce", dense, expert, grad_bytes, links)
        moved = _data_bytes(dense, expert, grad_bytes, links)
        if zero_stage == 1:
            exposed += _over_data("all_gather", dense, expert, element, links)
            moved += _data_bytes(dense, expert, element, links)
    elif zero_stage >= 2 and pipelined:
        exposed = _over_data("reduce_scatter", dense, expert, grad_bytes, links)
        exposed += behind(_over_data("all_gather", dense, expert, element, links), forward)
        moved = _data_bytes(dense, expert, grad_bytes, links) + _data_bytes(dense, expert, element, links)
    elif zero_stage == 0:
        exposed = behind(_over_data("all_reduce", dense, expert, grad_bytes, links), backward)
        moved = _data_bytes(dense, expert, grad_bytes, links)
    elif zero_stage == 1:
        bucket = stages[0].first_bucket if stages else 0.0
        # the other buckets behind the backward, then the first one's, exposed: max(RS - B, RS(bucket)) without
        # contention (and the same for the gathers before and behind the forward)
        first = _over_data("reduce_scatter", bucket, 0.0, grad_bytes, links)
        exposed = first + behind(_over_data("reduce_scatter", dense, expert, grad_bytes, links) - first, backward)
        first = _over_data("all_gather", bucket, 0.0, first_element, links)
        exposed += first + behind(_over_data("all_gather", dense, expert, element, links) - first, forward)
        moved = _data_bytes(dense, expert, grad_bytes, links) + _data_bytes(dense, expert, element, links)
    elif zero_stage == 2:
        bucket = stages[0].first_bucket if stages else 0.0
        exposed = _over_data("reduce_scatter", bucket, 0.0, grad_bytes, links)
        first = _over_data("all_gather", bucket, 0.0, first_element, links)
        exposed += first + behind(_over_data("all_gather", dense, expert, element, links) - first, forward)
        moved = _data_bytes(dense, expert, element, links)
    elif stages:  # ZeRO-3: its gathers are the microbatches' (`zero_traffic`), but its closed form's first one is an
        # average unit's: the first bucket's is the rest; the last unit's reduce-scatter is the tail's
        bucket = stages[0].first_bucket
        exposed = _over_data("reduce_scatter", bucket, 0.0, grad_bytes, links)
        exposed += max(0.0, _over_data("all_gather", bucket, 0.0, first_element, links) - stages[0].first_gather)
    dense_degree, expert_degree = degrees
    if links.replicate.size > 1:
        shard = dense / dense_degree + expert / expert_degree
        exposed += behind(collective_seconds("all_reduce", shard * grad_bytes, links.replicate), backward)
        moved += shard * grad_bytes
    owned = dense + expert if zero_stage == 0 else math.ceil(dense / dense_degree) + math.ceil(expert / expert_degree)
    return RankTail(exposed, estimate_optimizer_step(owned, device, optimizer, precision, states)
                    + gradient_buffer_passes(dense, expert, zero_stage, links, device, states), moved)


def gradient_buffer_passes(dense: float, expert: float, zero_stage: int, links: Links, device: ir.DeviceType,
                           states: StateBytes) -> float:
    """Seconds a step spends on Megatron-Core's gradient buffer outside the GEMMs, where the plan keeps its 16-bit
    weights apart from the master copy (`param_dtype`: the buffer the weight-gradient GEMMs accumulate into,
    `cost.compute.accumulate_bytes`) and ZeRO-0 or 1 holds it whole: `zero_grad_buffer` writes zeros over it at the
    step's start (`grad_data.zero_()`, megatron/core/distributed/param_and_grad_buffer.py:508 at f2e5db402c), and each
    bucket is scaled by 1 / its data-parallel ranks before its collective (`grad_data *= gradient_scaling_factor`,
    param_and_grad_buffer.py:122-123 there, the factor set in distributed_data_parallel.py:146-158 unless
    `--ddp-average-in-collective`): read and write. Both on the compute stream, memory bound, exposed; at `grad_dtype`."""
    if not states.master or zero_stage > 1:
        return 0.0
    scaled = (dense if links.data.size > 1 else 0.0) + (expert if links.expert_data.size > 1 else 0.0)
    return (dense + expert + 2 * scaled) * states.grads / device.bandwidth


def slowest(devices: Sequence[ir.DeviceType], precision: ir.Precision) -> ir.DeviceType:
    """The device that bounds a group: the lowest peak, then the lowest bandwidth."""
    return min(devices, key=lambda d: (peak_of(d, precision), d.bandwidth, d.memory))


__all__ = ["StageTime", "stage_time", "zero_traffic", "fsdp_units", "first_bucket", "bucket_params", "bucket_element",
           "param_split",
           "RankTail", "rank_tail", "gradient_buffer_passes", "slowest", "Unit", "gather_units", "unit_pass"]
