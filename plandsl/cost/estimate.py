"""A plan's step time, throughput and memory per device, as a breakdown (`plandsl estimate`).

Stage: cost model over a checked plan. Contract: `estimate_plan(plan) -> PlanEstimate`, pure. Per
microbatch, each layer costs its compute (`cost.compute`) plus the communication that sits on the
critical path (tensor-parallel collectives, expert all-to-alls, context parallelism's K/V gather or
the part of its ring that attention does not hide; `cost.comm` over the links each group really uses). Per stage
those sums are the durations of F, B (or I and W) that the schedule simulator
(`schedules.simulate`) turns into the pipeline's makespan. Then

    step time = makespan + exposed data-parallel reduction + optimizer step

(the gradient reduction of a rank overlaps the backward of its last microbatch, the parameter
all-gather of ZeRO-1/2 the first forward of the next step; ZeRO-2/3 reduce and gather per
microbatch behind each F and B). Memory is `cost.memory` (the one memory model, as `plandsl check`
uses it) with the in-flight microbatches of the schedule, or the simulator's peak when higher.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Sequence

from plandsl import ir
from plandsl.cost.comm import NO_COMM, GroupLinks, collective_seconds, group_links
from plandsl.cost.compute import (Efficiency, LayerCompute, Work, estimate_layer_compute,
                                  estimate_optimizer_step, peak_of)
from plandsl.cost.memory import (MemoryEstimate, estimate_layer_activations, gathers_kv, held_stages, local_numel,
                                 zero_degrees)
from plandsl.models import Layer, kv_width

_EXPERT = "experts"


# ---- links of each parallel axis -----------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Links:
    """Where each parallel group of the plan communicates (`cost.comm.GroupLinks`)."""

    tp: GroupLinks = NO_COMM
    cp: GroupLinks = NO_COMM
    ep: GroupLinks = NO_COMM
    pp: GroupLinks = NO_COMM
    data: GroupLinks = NO_COMM          # dense gradients: the data axes, the expert and the context axis
    expert_data: GroupLinks = NO_COMM   # expert gradients: the data and the context axes
    replicate: GroupLinks = NO_COMM     # hsdp: the replicate axis


def plan_links(plan: ir.Plan) -> Links:
    return mesh_links(plan.cluster, tuple((a.name, a.size) for a in plan.mesh.axes), plan.mesh.first_device,
                      tuple(plan.data.axes) if plan.data else (), plan.data.kind if plan.data else "",
                      plan.tensor.axis if plan.tensor else None, plan.context.axis if plan.context else None,
                      plan.experts.axis if plan.experts else None, plan.stages.axis if plan.stages else None)


def mesh_links(cluster: ir.Cluster, axes: tuple[tuple[str, int], ...], first_device: int,
               data_axes: tuple[str, ...], data_kind: str, tensor: str | None, context: str | None,
               expert: str | None, stage: str | None) -> Links:
    """Links of every parallel group of a mesh whose axes play the given roles."""
    def links(*names: str | None) -> GroupLinks:
        wanted = [n for n in names if n]
        return group_links(cluster, axes, wanted, first_device) if wanted else NO_COMM

    shard_axes, replicate = data_axes, NO_COMM
    if data_kind == "hsdp":
        shard_axes, replicate = data_axes[-1:], links(*data_axes[:-1])
    # The context axis holds the same parameters for other tokens: gradients are reduced (and ZeRO
    # shards) over it too (cost.memory.zero_degrees).
    context_data = context if context not in shard_axes else None
    return Links(tp=links(tensor), cp=links(context), ep=links(expert), pp=links(stage),
                 data=links(*shard_axes, expert if expert not in shard_axes else None, context_data),
                 expert_data=links(*(a for a in shard_axes if a != expert), context_data),
                 replicate=replicate)


# ---- one layer: compute plus critical-path communication ------------------------------------------------
@dataclass(frozen=True, slots=True)
class LayerTime:
    """Seconds of one microbatch through one layer on one device, communication included."""

    forward: float
    input_grad: float
    weight_grad: float
    forward_comm: float
    backward_comm: float
    flops: float
    recompute_flops: float

    @property
    def backward(self) -> float:
        return self.input_grad + self.weight_grad


def estimate_layer_time(model: ir.Model, layer: Layer, work: Work, device: ir.DeviceType, links: Links,
                        efficiency: Efficiency | None = None) -> LayerTime:
    compute = estimate_layer_compute(model, layer, work, device, efficiency)
    forward_comm, backward_comm = _layer_comm(model, layer, work, links, compute)
    return LayerTime(compute.forward + forward_comm, compute.input_grad + backward_comm, compute.weight_grad,
                     forward_comm, backward_comm, compute.flops, compute.recompute_flops)


def _layer_comm(model: ir.Model, layer: Layer, work: Work, links: Links, compute: LayerCompute) -> tuple[float, float]:
    """(forward, backward) seconds of communication a layer waits for, per microbatch."""
    if not isinstance(model, ir.TransformerModel):
        return 0.0, 0.0  # mlp and written layers are not tensor parallel (cost.memory's defaults)
    element = work.precision.bytes
    activation = work.tokens * model.hidden * element  # one [b, s/cp, h] tensor
    full = work.recompute is ir.Recompute.full

    def tp_pair() -> float:
        # Megatron (Shoeybi et al. 2019, Sec. 3): one all-reduce of [b, s, h]; with sequence
        # parallelism an all-gather plus a reduce-scatter of the same volume (Korthikanti et al. 2022, Sec. 4.2.2).
        if work.sequence_parallel:
            return (collective_seconds("all_gather", activation, links.tp)
                    + collective_seconds("reduce_scatter", activation, links.tp))
        return collective_seconds("all_reduce", activation, links.tp)

    if layer.kind == "embed":
        return tp_pair(), 0.0  # vocabulary-parallel embedding: partial sums reduced once
    if layer.kind == "head":
        gather = collective_seconds("all_gather", activation, links.tp) if work.sequence_parallel else 0.0
        # Vocabulary-parallel cross entropy: max, sum and target logit per token (3 fp32 all-reduces).
        loss = collective_seconds("all_reduce", 3 * 4 * work.tokens, links.tp)
        return gather + loss, tp_pair()
    if layer.kind != "block":
        return 0.0, 0.0
    pair = tp_pair()
    forward, backward = 2 * pair, 2 * pair  # after attention and after the MLP, both directions
    if model.experts and links.ep.size > 1:
        # Dispatch and combine all-to-alls of the routed tokens (Lepikhin et al. 2020, GShard), twice
        # in each direction; sequence parallelism leaves each tensor-parallel rank 1/t of the tokens.
        routed = work.tokens * model.top_k * model.hidden * element / (work.tp if work.sequence_parallel else 1)
        a2a = collective_seconds("all_to_all", routed, links.ep)
        forward, backward = forward + 2 * a2a, backward + 2 * a2a
        if full:
            backward += 2 * a2a
    if links.cp.size > 1 and work.gather_kv:
        # All-gather context parallelism (Llama Team 2024, arXiv:2407.21783, Sec. 3.3.2): K and V of
        # the whole sequence are gathered before the attention core, on its critical path ("the
        # all-gather communication latency is exposed"); the backward reduce-scatters their
        # gradients, and recomputation (full, or selective: the core with its gather) gathers again.
        gathered = 2 * work.tokens * links.cp.size * kv_width(model) / work.tp * element
        gather = collective_seconds("all_gather", gathered, links.cp)
        forward += gather
        backward += collective_seconds("reduce_scatter", gathered, links.cp)
        if work.recompute is not ir.Recompute.none:
            backward += gather
    elif links.cp.size > 1:
        # Ring attention (Liu et al. 2023): cp - 1 steps pass the local K and V chunk on while the
        # attention core works; only what the core does not hide is exposed. Backward passes K, V
        # and their gradients (twice the bytes) behind a core twice as long.
        chunk = 2 * work.tokens * kv_width(model) / work.tp * element
        ring = (links.cp.size - 1) * collective_seconds("p2p", chunk, links.cp)
        exposed = max(0.0, ring - compute.attention)
        forward += exposed
        backward += max(0.0, 2 * ring - 2 * compute.attention)
        if full:
            backward += exposed
    if full:
        backward += 2 * pair  # the forward's collectives, rerun by the recomputation
    return forward, backward


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

    @property
    def backward(self) -> float:
        return self.input_grad + self.weight_grad

    @property
    def compute(self) -> float:
        return self.forward + self.backward - self.comm


def param_split(layer: Layer, tp: int, ep: int) -> tuple[int, int]:
    """(dense, expert) elements of a layer's parameters on one device."""
    dense = expert = 0
    for param in layer.params:
        count = local_numel(param, tp, ep)
        if len(param.dims) == 3 and param.dims[0] == _EXPERT:
            expert += count
        else:
            dense += count
    return dense, expert


def fsdp_units(layers: Sequence[Layer]) -> int:
    """The units ZeRO-2/3 gather and reduce one at a time: each block (or written layer), and the
    stage's other layers together (the root), as `runtime.data_parallel.apply_fsdp` wraps them."""
    blocks = sum(1 for layer in layers if layer.kind in ("block", "custom"))
    return max(1, blocks + (1 if blocks < len(layers) else 0))


def stage_time(times: Sequence[LayerTime], params: Sequence[tuple[int, int]], zero_stage: int,
               element: int, links: Links, units: int | None = None) -> StageTime:
    """Sum the layers of a stage (then `zero_traffic`); `units`: its FSDP units (default: one per layer)."""
    return zero_traffic(sum(t.forward for t in times), sum(t.input_grad for t in times),
                        sum(t.weight_grad for t in times), sum(t.forward_comm + t.backward_comm for t in times),
                        sum(t.flops for t in times), sum(t.recompute_flops for t in times),
                        float(sum(p[0] for p in params)), float(sum(p[1] for p in params)),
                        zero_stage, element, links, units or len(times))


def zero_traffic(forward: float, input_grad: float, weight_grad: float, comm: float, flops: float,
                 recompute_flops: float, dense: float, expert: float, zero_stage: int, element: int,
                 links: Links, units: int = 1) -> StageTime:
    """A stage's microbatch with ZeRO's per-microbatch traffic, one collective per unit.

    ZeRO-3 all-gathers every unit's parameters before its forward and again before its backward,
    and reduce-scatters its gradients after: 3x the parameter volume (Rajbhandari et al. 2020,
    Sec. 5.3 and 7.2); ZeRO-2 only reduce-scatters. Each unit is its own collective (FSDP, Zhao et
    al. 2023, Sec. 3.4), so each pays the ring's latency. Prefetching overlaps a unit's traffic
    with the neighbouring unit's compute only, so the first unit's all-gather waits with nothing to
    hide behind; the last unit's reduce-scatter is asynchronous and runs behind whatever the rank
    computes next. With u equal units of compute c and traffic x (backward: all-gather g plus
    reduce-scatter s) a pass takes g + (u - 1)·max(c, x) + c: for the forward max(C, X) + min(c, x).
    """
    if zero_stage >= 2:
        units = max(1, units)
        scatter = _over_data("reduce_scatter", dense / units, expert / units, element, links)
        gather = _over_data("all_gather", dense / units, expert / units, element, links) \
            if zero_stage >= 3 else 0.0
        backward = input_grad + weight_grad

        def overlapped(compute: float, traffic: float, first: float) -> float:
            if traffic <= 0.0:
                return compute
            return first + (units - 1) * max(compute / units, traffic) + compute / units

        longer_forward = overlapped(forward, gather, gather)
        longer_backward = overlapped(backward, gather + scatter, gather)
        comm += (longer_forward - forward) + (longer_backward - backward)
        forward, input_grad = longer_forward, input_grad + longer_backward - backward
    return StageTime(forward, input_grad, weight_grad, comm, flops, recompute_flops, dense, expert)


def _over_data(collective: str, dense: float, expert: float, element: int, links: Links) -> float:
    """A collective of dense parameters over the data (+expert) axes and of expert ones over data."""
    return (collective_seconds(collective, dense * element, links.data)
            + collective_seconds(collective, expert * element, links.expert_data))


@dataclass(frozen=True, slots=True)
class RankTail:
    """What a pipeline rank does after its last backward: exposed gradient reduction, optimizer."""

    exposed: float
    optimizer: float


def rank_tail(stages: Sequence[StageTime], zero_stage: int, degrees: tuple[int, int], element: int,
              links: Links, device: ir.DeviceType, optimizer: ir.Optimizer,
              precision: ir.Precision) -> RankTail:
    """Exposed data-parallel traffic and the optimizer step of one pipeline rank.

    ZeRO-0 all-reduces the gradients (bucketed, behind the backward of the last microbatch, as
    torch DDP and Megatron's overlap_grad_reduce do); ZeRO-1 reduce-scatters them the same way and
    all-gathers the updated parameters behind the next step's first forward (Megatron's distributed
    optimizer); ZeRO-2 reduced them already, and gathers the parameters; ZeRO-3 has nothing left.
    hsdp adds an all-reduce of its shard over the replicate axis. The optimizer step updates the
    parameters a device owns: all of them, or 1/N_d with ZeRO >= 1 (Rajbhandari et al. 2020).
    """
    dense = sum(s.dense_params for s in stages)
    expert = sum(s.expert_params for s in stages)
    backward = sum(s.backward for s in stages)
    forward = sum(s.forward for s in stages)
    exposed = 0.0
    if zero_stage == 0:
        exposed = max(0.0, _over_data("all_reduce", dense, expert, element, links) - backward)
    elif zero_stage == 1:
        exposed = max(0.0, _over_data("reduce_scatter", dense, expert, element, links) - backward)
        exposed += max(0.0, _over_data("all_gather", dense, expert, element, links) - forward)
    elif zero_stage == 2:
        exposed = max(0.0, _over_data("all_gather", dense, expert, element, links) - forward)
    dense_degree, expert_degree = degrees
    if links.replicate.size > 1:
        shard = dense / dense_degree + expert / expert_degree
        exposed += max(0.0, collective_seconds("all_reduce", shard * element, links.replicate) - backward)
    owned = dense + expert if zero_stage == 0 else math.ceil(dense / dense_degree) + math.ceil(expert / expert_degree)
    return RankTail(exposed, estimate_optimizer_step(owned, device, optimizer, precision))


def slowest(devices: Sequence[ir.DeviceType], precision: ir.Precision) -> ir.DeviceType:
    """The device that bounds a group: the lowest peak, then the lowest bandwidth."""
    return min(devices, key=lambda d: (peak_of(d, precision), d.bandwidth, d.memory))


# ---- the whole plan -------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class TimeBreakdown:
    """Seconds of one step, from the busiest pipeline rank's point of view:
    step = compute + communication + bubble + optimizer."""

    step: float
    compute: float
    communication: float  # exposed: in F/B (tp, ep, cp, ZeRO-2/3) plus the data-parallel tail
    bubble: float
    optimizer: float
    pipeline: float        # the simulated makespan of the microbatches
    p2p: float             # one stage-to-stage transfer


@dataclass(frozen=True, slots=True)
class PlanEstimate:
    plan: str
    devices: int
    microbatches: int
    time: TimeBreakdown
    memory: tuple[MemoryEstimate, ...]       # per pipeline rank, worst device
    capacity: tuple[float, ...]              # per pipeline rank, smallest device memory
    tokens_per_s: float
    tflops_per_device: float                 # executed FLOPs (with recomputation) / step / devices
    mfu: float                               # model FLOPs (no recomputation) / (step x devices x peak)
    flops_per_step: float
    model_flops_per_step: float
    stage_times: tuple[StageTime, ...] = field(repr=False, default=())

    @property
    def peak_memory_bytes(self) -> float:
        return max((m.total for m in self.memory), default=0.0)

    @property
    def fits(self) -> bool:
        return all(m.total <= c for m, c in zip(self.memory, self.capacity))

    def to_json(self) -> dict:
        return {"plan": self.plan, "devices": self.devices, "num_microbatches": self.microbatches,
                "time": asdict(self.time), "step_time_s": self.time.step, "tokens_per_s": self.tokens_per_s,
                "tflops_per_device": self.tflops_per_device, "mfu": self.mfu,
                "flops_per_step": self.flops_per_step, "model_flops_per_step": self.model_flops_per_step,
                "peak_memory_bytes": self.peak_memory_bytes, "fits": self.fits,
                "memory": [{"pipeline_rank": r, **m.to_json(), "capacity": c}
                           for r, (m, c) in enumerate(zip(self.memory, self.capacity))]}


def plan_work(plan: ir.Plan) -> Work:
    sequence_parallel = bool(plan.tensor and plan.tensor.sequence_parallel)
    return Work(plan.train.micro_batch, plan.seq, plan.tp, plan.cp, plan.ep, sequence_parallel,
                plan.train.precision, plan.train.recompute, gather_kv=gathers_kv(plan))


def estimate_plan(plan: ir.Plan, efficiency: Efficiency | None = None, assignment=None) -> PlanEstimate:
    """The plan's step time, throughput and memory; PlanError when its placement or schedule is invalid.
    `efficiency` overrides every device's GEMM knobs (None: each device's own)."""
    from plandsl.check.memory import estimate_plan_memory, pipeline_rank_devices
    from plandsl.check.schedule import plan_schedule
    from plandsl.diagnostics import PlanError
    from plandsl.placement import assign_stages
    from plandsl.schedules.simulate import Costs, simulate

    if assignment is None:
        assignment, problems = assign_stages(plan)
        if assignment is None:
            raise PlanError(problems)
    precision = plan.train.precision
    work, links = plan_work(plan), plan_links(plan)
    rank_devices = [slowest(devices, precision) for devices in pipeline_rank_devices(plan)]
    stage_times = estimate_stage_times(plan, assignment, efficiency, links, rank_devices)
    zero_stage, dense_degree, expert_degree = zero_degrees(plan)
    ranks = assignment.rank_stages()
    m = plan.num_microbatches
    p2p = pipeline_p2p(plan, links, work)
    memory = estimate_plan_memory(plan, assignment) or []
    activations = tuple(sum(estimate_layer_activations(plan, layer) for layer in layers)
                        for layers in assignment.stage_layers)
    if plan.stages is not None and plan.schedule is not None:
        schedule, problems = plan_schedule(plan)
        if schedule is None or problems:
            raise PlanError(problems)
        costs = Costs(stage_costs=tuple((s.forward, s.backward, s.input_grad, s.weight_grad) for s in stage_times),
                      p2p=p2p, activation_bytes=activations,
                      static_bytes=tuple(e.params + e.grads + e.optimizer for e in memory))
        simulation = simulate(schedule, costs)
        if simulation.deadlock is not None:
            raise PlanError([_deadlock(plan, simulation)])
        makespan = simulation.makespan
        peaks = [s.peak_memory_bytes - static for s, static in zip(simulation.ranks, costs.static_bytes)]
    else:  # no pipeline: the microbatches run one after another (gradient accumulation)
        makespan = m * sum(s.forward + s.backward for s in stage_times)
        peaks = [activations[0]] if activations else [0.0]
    memory = _with_simulated_peaks(plan, assignment, memory, activations, peaks)
    degrees = (dense_degree, expert_degree)
    # A rank reduces and updates the weights of every stage it holds (Chimera: one of each pipeline).
    tails = [rank_tail([stage_times[s] for s in stages], zero_stage, degrees, precision.bytes, links,
                       rank_devices[rank], plan.train.optimizer, precision)
             for rank, stages in enumerate(held_stages(plan, ranks))]
    runs = _stage_runs(plan, assignment, m)
    busy = [sum(runs[r][s] * (stage_times[s].forward + stage_times[s].backward) for s in runs[r])
            for r in range(len(ranks))]
    comm = [sum(runs[r][s] * stage_times[s].comm for s in runs[r]) for r in range(len(ranks))]
    worst = max(range(len(ranks)), key=lambda r: busy[r])
    tail = max(range(len(ranks)), key=lambda r: tails[r].exposed + tails[r].optimizer)
    step = makespan + tails[tail].exposed + tails[tail].optimizer
    time = TimeBreakdown(step, busy[worst] - comm[worst], comm[worst] + tails[tail].exposed,
                         max(0.0, makespan - busy[worst]), tails[tail].optimizer, makespan, p2p)
    devices = plan.mesh.size
    per_rank_devices = devices / len(ranks)
    model_flops = sum(3 * per_rank_devices * sum(n * stage_times[s].flops for s, n in run.items()) for run in runs)
    executed = model_flops + sum(per_rank_devices * sum(n * stage_times[s].recompute_flops for s, n in run.items())
                                 for run in runs)
    start = plan.mesh.first_device
    mesh_devices = plan.cluster.devices_in_order()[start:start + devices]
    peak = sum(peak_of(d, precision) for d in mesh_devices) / max(1, len(mesh_devices))
    capacity = tuple(min(d.memory for d in group) if group else math.inf
                     for group in pipeline_rank_devices(plan))
    return PlanEstimate(plan.name, devices, m, time, tuple(memory), capacity,
                        plan.train.global_batch * plan.seq / step if step else 0.0,
                        executed / step / devices / 1e12 if step else 0.0,
                        model_flops / (step * devices * peak) if step else 0.0,
                        executed, model_flops, tuple(stage_times))


def estimate_stage_times(plan: ir.Plan, assignment, efficiency: Efficiency | None = None,
                         links: Links | None = None, rank_devices=None) -> list[StageTime]:
    """Per stage of `assignment`, the seconds of one microbatch's F, I and W on its rank's slowest device."""
    from plandsl.check.memory import pipeline_rank_devices
    precision = plan.train.precision
    work, links = plan_work(plan), links or plan_links(plan)
    if rank_devices is None:
        rank_devices = [slowest(devices, precision) for devices in pipeline_rank_devices(plan)]
    zero_stage = zero_degrees(plan)[0]
    transformer = isinstance(plan.model, ir.TransformerModel)
    cache: dict[tuple, LayerTime] = {}
    result = []
    for stage, layers in enumerate(assignment.stage_layers):
        device = rank_devices[assignment.rank_of_stage[stage]]
        times = []
        for layer in layers:
            key = (layer.kind, "" if transformer else layer.name, id(device))
            if key not in cache:
                cache[key] = estimate_layer_time(plan.model, layer, work, device, links, efficiency)
            times.append(cache[key])
        params = [param_split(layer, plan.tp, plan.ep) for layer in layers]
        result.append(stage_time(times, params, zero_stage, precision.bytes, links, fsdp_units(layers)))
    return result


def _stage_runs(plan: ir.Plan, assignment, m: int) -> list[dict[int, float]]:
    """Per pipeline rank: stage -> microbatches it runs there. Every rank runs each of its stages
    m times, except Chimera's (Li & Hoefler 2021), whose two pipelines each take half the
    microbatches: rank r runs stage r for one and stage p - 1 - r for the other."""
    ranks = assignment.rank_stages()
    if plan.schedule is not None and plan.stages is not None and plan.schedule.name == "chimera":
        p = len(ranks)
        return [{r: m / 2, p - 1 - r: m / 2} if r != p - 1 - r else {r: m} for r in range(p)]
    return [{s: m for s in stages} for stages in ranks]


def pipeline_p2p(plan: ir.Plan, links: Links, work: Work) -> float:
    if plan.stages is None or plan.pp == 1:
        return 0.0
    return pipeline_p2p_seconds(plan.model, work, links)


def pipeline_p2p_seconds(model: ir.Model, work: Work, links: Links) -> float:
    """One microbatch's activations between neighbouring pipeline ranks. Megatron's scatter/gather
    optimisation (Narayanan et al. 2021, Sec. 4.1) sends 1/t of the [b, s, h] tensor per
    tensor-parallel rank; other models send their widest layer output."""
    if isinstance(model, ir.TransformerModel):
        size = work.tokens * model.hidden * work.precision.bytes / work.tp
    else:
        from plandsl.models import layers_of
        size = work.tokens * max(layer.output_width for layer in layers_of(model)) * work.precision.bytes
    return collective_seconds("p2p", size, links.pp)


def _with_simulated_peaks(plan: ir.Plan, assignment, memory: list[MemoryEstimate], activations, peaks) -> list[MemoryEstimate]:
    """Activation memory: the in-flight formula of `cost.memory`, or the simulated peak when higher
    (plus the recomputation working set the formula adds)."""
    from plandsl.cost.memory import inflight_microbatches
    ranks = held_stages(plan, assignment.rank_stages())
    if plan.stages is not None:
        schedule = plan.schedule.name if plan.schedule else "gpipe"
        inflight = inflight_microbatches(schedule, len(ranks), plan.num_microbatches, assignment.virtual)
    else:
        inflight = [1]
    result = []
    for rank, estimate in enumerate(memory):
        stored = sum(activations[s] for s in ranks[rank])
        working = max(0.0, estimate.activations - inflight[rank] * stored)
        simulated = peaks[rank] + working if rank < len(peaks) else 0.0
        if simulated > estimate.activations * (1 + 1e-9):
            estimate = MemoryEstimate(estimate.params, estimate.grads, estimate.optimizer, simulated, estimate.other)
        result.append(estimate)
    return result


def _deadlock(plan: ir.Plan, simulation):
    from plandsl.diagnostics import diag
    return diag("E502", f"schedule '{plan.schedule.name}' deadlocks on this plan: {simulation.deadlock}",
                plan.schedule.span)


# ---- text ------------------------------------------------------------------------------------------------
def format_estimate(estimate: PlanEstimate) -> str:
    from plandsl.units import format_bytes
    t = estimate.time

    def share(value: float) -> str:
        return f"{value:10.4g} s  {value / t.step:6.1%}" if t.step else f"{value:10.4g} s"

    lines = [f"plan {estimate.plan}: {estimate.devices} devices, {estimate.microbatches} microbatches per step",
             f"  step time      {t.step:10.4g} s",
             f"    compute      {share(t.compute)}",
             f"    comm exposed {share(t.communication)}",
             f"    bubble       {share(t.bubble)}",
             f"    optimizer    {share(t.optimizer)}",
             f"  tokens/s       {estimate.tokens_per_s:10.4g}",
             f"  TFLOP/s/device {estimate.tflops_per_device:10.4g}   (executed, with recomputation)",
             f"  MFU            {estimate.mfu:10.1%}",
             "  memory per device (worst device of each pipeline rank):",
             f"  {'rank':>6} {'params':>11} {'grads':>11} {'optimizer':>11} {'activations':>11} {'total':>11} {'capacity':>11}"]
    for rank, (m, c) in enumerate(zip(estimate.memory, estimate.capacity)):
        flag = "" if m.total <= c else "  DOES NOT FIT"
        lines.append(f"  {rank:>6} {format_bytes(m.params):>11} {format_bytes(m.grads):>11} "
                     f"{format_bytes(m.optimizer):>11} {format_bytes(m.activations):>11} "
                     f"{format_bytes(m.total):>11} {format_bytes(c):>11}{flag}")
    return "\n".join(lines)


__all__ = ["Links", "plan_links", "mesh_links", "LayerTime", "estimate_layer_time", "StageTime", "stage_time", "zero_traffic", "fsdp_units", "RankTail",
           "rank_tail", "param_split", "TimeBreakdown", "PlanEstimate", "estimate_plan", "plan_work",
           "pipeline_p2p", "pipeline_p2p_seconds", "estimate_stage_times", "format_estimate", "slowest"]
