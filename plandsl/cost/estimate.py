"""A plan's step time, throughput and memory per device, as a breakdown (`plandsl estimate`).

Stage: cost model over a checked plan. Contract: `estimate_plan(plan) -> PlanEstimate`, pure. Per
microbatch, each layer costs its compute plus the communication on its critical path (`cost.layer`);
a stage sums its layers with ZeRO's per-microbatch traffic (`cost.stage`). Those sums are the
durations of F, B (or I and W) that the schedule simulator (`schedules.simulate`) turns into the
pipeline's makespan. Then

    step time = makespan + exposed data-parallel reduction + optimizer step

(the gradient reduction of a rank overlaps the backward of its last microbatch, the parameter
all-gather of ZeRO-1/2 the first forward of the next step; ZeRO-2/3 reduce and gather per
microbatch behind each F and B: `cost.stage.rank_tail`). Memory is `cost.memory` (the one memory
model, as `plandsl check` uses it) with the in-flight microbatches of the schedule, or the
simulator's peak when higher.

With `batch_shares` each replica is priced by its own local batch on its own devices: its microbatch
count and the slowest device of each of its pipeline ranks (`ir.shares`), one estimate per distinct
(share, devices); then step time = the slowest replica's makespan + the largest data-parallel tail. Memory
is each replica's own (its microbatches in flight; under ZeRO-2/3 every unit held gathered through the step,
`cost.memory.gathered_bytes`) against its own devices' capacity (`replica_memory`, `replica_capacity`,
`fits`); `memory` and `capacity` per pipeline rank are the most any replica needs and the smallest device.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

from plandsl import ir
from plandsl.ir import shares as batch
from plandsl.cost.comm import collective_seconds
from plandsl.cost.compute import Efficiency, Work, accumulate_bytes, peak_of
from plandsl.cost.layer import NOTHING_MOVED, LayerTime, Links, Moved, estimate_layer_time, plan_links
from plandsl.cost.memory import (MemoryEstimate, StateBytes, beyond_layers, estimate_layer_activations,
                                 estimate_plan_memory, gather_element, gathered_param_bytes, gathers_kv, held_stages, layer_precision, pipelined_shards,
                                 layer_offload, layer_recompute,
                                 zero_degrees)
from plandsl.cost.offload import host_capacity, offload_seconds
from plandsl.cost.stage import StageTime, fsdp_units, gather_units, param_split, rank_tail, slowest, stage_time
from plandsl.schedules.registry import BUILTIN, microbatches_fit, min_microbatches, pipelines_of
from plandsl.schedules.simulate import BUBBLE_DEFINITION, Costs, bubble_seconds
from plandsl.ir.placement import assign_stages, mesh_device_runs, pipeline_rank_device_types
from plandsl.cost.schedule import simulate_plan_schedule
from plandsl.cost.shares import balance
from plandsl.diagnostics import PlanError, diag
from plandsl.ir.layers import figures_key, layers_of, once_per_figures
from plandsl.lower.units import format_bytes


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

    @property
    def bubble_fraction(self) -> float:
        """`bubble` over the makespan: `schedules.simulate.BUBBLE_DEFINITION`, `plandsl simulate`'s figure."""
        return self.bubble / self.pipeline if self.pipeline > 0 else 0.0


@dataclass(frozen=True, slots=True)
class PlanEstimate:
    plan: str
    devices: int
    microbatches: int
    time: TimeBreakdown
    memory: tuple[MemoryEstimate, ...]       # per pipeline rank, worst device
    capacity: tuple[float, ...]              # per pipeline rank, smallest device memory less its reserve
    tokens_per_s: float
    tflops_per_device: float                 # executed FLOPs (with recomputation) / step / devices
    mfu: float                               # model FLOPs (no recomputation) / (step x devices x peak)
    flops_per_step: float
    model_flops_per_step: float
    stage_times: tuple[StageTime, ...] = field(repr=False, default=())
    communication: Moved = NOTHING_MOVED     # bytes one device of the busiest pipeline rank moves per step
    shares: tuple[int, ...] = ()             # batch_shares: sequences per data rank (empty: global_batch / dp each)
    replica_steps: tuple[float, ...] = ()    # batch_shares: each data rank's makespan + tail, seconds
    replica_memory: tuple[tuple[MemoryEstimate, ...], ...] = field(repr=False, default=())
    """batch_shares: per data rank, per pipeline rank, that replica's own memory."""
    replica_capacity: tuple[tuple[float, ...], ...] = field(repr=False, default=())
    """batch_shares: per data rank, per pipeline rank, the smallest of that replica's own devices there."""
    host_capacity: float = math.inf
    """What a device's offloaded activations may take of its host's memory (`cost.offload.host_capacity`)."""

    @property
    def peak_memory_bytes(self) -> float:
        return max((m.total for m in self.memory), default=0.0)

    @property
    def fits(self) -> bool:
        """Every pipeline rank within its devices' capacity; with batch_shares, every replica within its own."""
        if self.replica_memory:
            return all(m.total <= c for memory, capacity in zip(self.replica_memory, self.replica_capacity)
                       for m, c in zip(memory, capacity))
        return all(m.total <= c for m, c in zip(self.memory, self.capacity)) \
            and all(m.host <= self.host_capacity for m in self.memory)  # offloaded activations (E514)

    def overflow(self) -> tuple[int, int] | None:
        """batch_shares: (data rank, pipeline rank) of the first replica's rank above its own capacity."""
        for replica, (memory, capacity) in enumerate(zip(self.replica_memory, self.replica_capacity)):
            for rank, (m, c) in enumerate(zip(memory, capacity)):
                if m.total > c:
                    return replica, rank
        return None

    def to_json(self) -> dict:
        return {"plan": self.plan, "devices": self.devices, "num_microbatches": self.microbatches,
                "time": asdict(self.time), "step_time_s": self.time.step, "bubble_fraction": self.time.bubble_fraction,
                "tokens_per_s": self.tokens_per_s,
                "tflops_per_device": self.tflops_per_device, "mfu": self.mfu,
                "flops_per_step": self.flops_per_step, "model_flops_per_step": self.model_flops_per_step,
                "peak_memory_bytes": self.peak_memory_bytes, "fits": self.fits,
                "communication_bytes": {**asdict(self.communication), "total": self.communication.total},
                "memory": [{"pipeline_rank": r, **m.to_json(), "capacity": c}
                           for r, (m, c) in enumerate(zip(self.memory, self.capacity))],
                **({"batch_shares": list(self.shares), "replica_step_time_s": list(self.replica_steps),
                    "replica_peak_memory_bytes": [max(m.total for m in ms) for ms in self.replica_memory],
                    "replica_fits": [all(m.total <= c for m, c in zip(ms, cs))
                                     for ms, cs in zip(self.replica_memory, self.replica_capacity)]}
                   if self.shares else {})}


def plan_work(plan: ir.Plan) -> Work:
    sequence_parallel = bool(plan.tensor and plan.tensor.sequence_parallel)
    return Work(plan.train.micro_batch, plan.seq, plan.tp, plan.cp, plan.expert_group, sequence_parallel,
                plan.train.precision, plan.train.recompute, gather_kv=gathers_kv(plan), kernels=plan.train.kernels,
                overlap_experts=bool(plan.experts and plan.experts.overlap) and plan.num_microbatches > 1,
                attention=plan.train.attention,  # one microbatch: no other one's pass to hide the all-to-alls behind
                fold_experts=plan.expert_tp != plan.tp, loss=plan.train.loss,
                overlap_tensor=bool(plan.tensor and plan.tensor.overlap),
                tensor_overlap=plan.tensor.implementation if plan.tensor else ir.TensorOverlap.async_tp,
                modules=plan.train.modules or frozenset((ir.RecomputeModule.core_attn,)),
                sm_margin=plan.tensor.sm_margin if plan.tensor else True,
                dispatcher=plan.experts.kind if plan.experts else "alltoall", fp8_recipe=plan.train.recipe,
                ring=plan.context.implementation if plan.context else "te",
                fp8_gather=plan.data is not None and plan.data.gather is ir.Precision.fp8,
                accumulate=accumulate_bytes(plan.train))


def estimate_plan(plan: ir.Plan, efficiency: Efficiency | None = None, assignment=None,
                  rank_devices: list[ir.DeviceType] | None = None, held: bool = False) -> PlanEstimate:
    """The plan's step time, throughput and memory; PlanError when its placement or schedule is invalid.
    `efficiency` overrides every device's GEMM knobs (None: each device's own); `rank_devices` the device
    each pipeline rank is timed on (None: its slowest over the mesh); `held`: ZeRO-2/3 units kept gathered
    through the step (a replica of a plan with `batch_shares`: `cost.memory.gathered_bytes`)."""
    if assignment is None:
        assignment, problems = assign_stages(plan)
        if assignment is None:
            raise PlanError(problems)
    if batch.uneven(plan) and rank_devices is None:
        return _estimate_replicas(plan, efficiency, assignment)
    precision = plan.train.precision
    work, links = plan_work(plan), plan_links(plan)
    if rank_devices is None:
        rank_devices = [slowest(devices, precision) for devices in pipeline_rank_device_types(plan)]
    stage_times = estimate_stage_times(plan, assignment, efficiency, links, rank_devices)
    zero_stage, dense_degree, expert_degree = zero_degrees(plan)
    ranks = assignment.rank_stages()
    m = plan.num_microbatches
    p2p = pipeline_p2p(plan, links, work)
    memory = estimate_plan_memory(plan, assignment, held=held) or []
    kept: dict = {}  # per `figures_key`: a family's blocks keep the same bytes
    activations = tuple(sum(once_per_figures(kept.setdefault((mode, layer_precision(plan.train, plan.model, layer)), {}),
                                             layer, lambda layer, mode=mode:
                                             estimate_layer_activations(plan, layer, recompute=mode))
                            for layer, mode, away in zip(layers, layer_recompute(plan, layers),
                                                         layer_offload(plan, layers)) if not away)
                        for layers in assignment.stage_layers)  # offloaded blocks' on the host (`offload_layers`)
    if plan.stages is not None and plan.schedule is not None:
        costs = Costs(stage_costs=tuple((s.forward, s.backward, s.input_grad, s.weight_grad) for s in stage_times),
                      p2p=schedule_p2p(plan, links, work), activation_bytes=activations,
                      static_bytes=tuple(e.held for e in memory))
        simulation = simulate_plan_schedule(plan, costs)
        if simulation.deadlock is not None:
            raise PlanError([_deadlock(plan, simulation)])
        makespan = simulation.makespan
        peaks = [s.peak_memory_bytes - static for s, static in zip(simulation.ranks, costs.static_bytes)]
    else:  # no pipeline: the microbatches run one after another (gradient accumulation)
        makespan = m * sum(s.forward + s.backward for s in stage_times)
        peaks = [activations[0]] if activations else [0.0]
    memory = simulated_peaks(plan, assignment, memory, activations, peaks)
    degrees = (dense_degree, expert_degree)
    # A rank reduces and updates the weights of every stage it holds (Chimera: one of each pipeline).
    tails = [rank_tail([stage_times[s] for s in stages], zero_stage, degrees, precision.bytes, links,
                       rank_devices[rank], plan.train.optimizer, precision, StateBytes.of(plan.train),
                       pipelined_shards(plan), after_schedule=deepspeed_pipeline(plan))
             for rank, stages in enumerate(held_stages(plan, ranks))]
    runs = _stage_runs(plan, assignment, m)
    busy = [sum(runs[r][s] * (stage_times[s].forward + stage_times[s].backward) for s in runs[r])
            for r in range(len(ranks))]
    comm = [sum(runs[r][s] * stage_times[s].comm for s in runs[r]) for r in range(len(ranks))]
    worst = max(range(len(ranks)), key=lambda r: busy[r])
    tail = max(range(len(ranks)), key=lambda r: tails[r].exposed + tails[r].optimizer)
    step = makespan + tails[tail].exposed + tails[tail].optimizer
    time = TimeBreakdown(step, busy[worst] - comm[worst], comm[worst] + tails[tail].exposed,
                         bubble_seconds(makespan, busy), tails[tail].optimizer, makespan, p2p)
    devices = plan.mesh.size
    per_rank_devices = devices / len(ranks)
    model_flops = sum(3 * per_rank_devices * sum(n * stage_times[s].flops for s, n in run.items()) for run in runs)
    executed = model_flops + sum(per_rank_devices * sum(n * stage_times[s].recompute_flops for s, n in run.items())
                                 for run in runs)
    runs = mesh_device_runs(plan)  # per node group, not per device
    peak = sum((end - first) * peak_of(d, precision) for d, first, end in runs) / max(1, sum(e - f for _, f, e in runs))
    capacity = tuple(min(d.usable_memory for d in group) if group else math.inf
                     for group in pipeline_rank_device_types(plan))
    moved = [_moved(plan, assignment, stage_times, run, tails[rank].moved, work)
             for rank, run in enumerate(_stage_runs(plan, assignment, m))]
    return PlanEstimate(plan.name, devices, m, time, tuple(memory), capacity,
                        plan.train.global_batch * plan.seq / step if step else 0.0,
                        executed / step / devices / 1e12 if step else 0.0,
                        model_flops / (step * devices * peak) if step else 0.0,
                        executed, model_flops, tuple(stage_times), max(moved, key=lambda v: v.total),
                        host_capacity=host_capacity(plan))


def data_shares(plan: ir.Plan, efficiency: Efficiency | None = None, assignment=None) -> tuple[int, ...] | None:
    """Sequences per data rank and step: as the plan writes them (`ir.shares.written_shares`), or for
    `batch_shares: speed` the whole microbatches that balance the replicas' predicted makespans, each replica
    timed on its own devices at two microbatch counts (`cost.shares.balance`; by the replicas' summed peaks
    where the plan cannot be estimated); None when there are fewer microbatches than data ranks (E509)."""
    written = batch.written_shares(plan)
    if written is not None:
        return written
    train, dp = plan.train, batch.data_ranks(plan)
    total = train.global_batch // train.micro_batch
    if train.global_batch % train.micro_batch or total < dp:
        return None
    pp = plan.pp if plan.stages is not None else 1
    info = BUILTIN.get(plan.schedule.name) if plan.stages is not None and plan.schedule is not None \
        and plan.schedule.definition is None else None
    least = min_microbatches(info, pp) if info is not None else 1
    if assignment is None:
        assignment = assign_stages(plan)[0]
    first = pp * -(-least // pp)  # a multiple of the ranks: every built-in schedule runs it
    devices = replica_devices(plan)
    kinds = {tuple(d.name for d in replica): replica for replica in devices}

    def line(replica, m: int) -> tuple[float, float]:
        """The replica's makespan as a + b·m through m and m + first microbatches."""
        times = [estimate_plan(batch.replica_plan(plan, count * train.micro_batch), efficiency, assignment,
                               list(replica)).time.pipeline for count in (m, m + first)]
        return 2 * times[0] - times[1] if m == first else times[0] - m * (times[1] - times[0]) / first, \
            (times[1] - times[0]) / first

    lines: dict[tuple[str, ...], tuple[float, float]] = {}
    for key, replica in kinds.items():
        try:
            lines[key] = line(replica, first)
        except PlanError:  # placement or schedule invalid (the checker says so): by the devices' peaks
            lines[key] = (0.0, 1.0 / sum(peak_of(d, train.precision) for d in replica))
    keys = [tuple(d.name for d in replica) for replica in devices]
    counts = balance(total, [lines[key] for key in keys], least)
    # Once more through the counts each kind got (a pipeline's makespan bends at few microbatches): the line
    # through the kind's own count and one more round, where that count runs on the schedule.
    for key, replica in kinds.items():
        m = max(count for count, k in zip(counts, keys) if k == key)
        if m != first and (info is None or microbatches_fit(info, pp, m) and microbatches_fit(info, pp, m + first)):
            try:
                lines[key] = line(replica, m)
            except PlanError:
                pass
    counts = balance(total, [lines[key] for key in keys], least)
    return tuple(count * train.micro_batch for count in counts)


def replica_devices(plan: ir.Plan) -> list[tuple[ir.DeviceType, ...]]:
    """Per data rank: the device each of its pipeline ranks is timed on, its slowest (`slowest`)."""
    precision = plan.train.precision
    return [tuple(slowest(types, precision) for types in ranks) for ranks in batch.replica_device_types(plan)]


def format_shares(plan: ir.Plan, shares: tuple[int, ...] | None) -> str:
    """`5, 3 sequences by speed (5, 3 microbatches of 1)`: what `show` and `estimate` print for `batch_shares`."""
    if shares is None:
        return "none (the global batch is fewer whole microbatches than data ranks)"
    mb = plan.train.micro_batch
    how = " by speed" if plan.train.batch_shares == batch.SPEED else ""
    return (f"{share_runs(shares)} sequences{how} ({share_runs(tuple(s // mb for s in shares))} "
            f"microbatches of {mb})")


def share_runs(values: tuple[int, ...], most: int = 16) -> str:
    """`5, 3`, or with runs of equal values `10 x 16, 40 x 8` (value x data ranks, as the language writes a
    repetition), the first `most` runs."""
    runs: list[list[int]] = []
    for value in values:
        if runs and runs[-1][0] == value:
            runs[-1][1] += 1
        else:
            runs.append([value, 1])
    if len(runs) == len(values) and len(values) <= most:
        return ", ".join(map(str, values))
    shown = ", ".join(f"{value} x {count}" if count > 1 else str(value) for value, count in runs[:most])
    return shown + (f", ... ({len(values)} data ranks)" if len(runs) > most else "")


def _estimate_replicas(plan: ir.Plan, efficiency: Efficiency | None, assignment) -> PlanEstimate:
    """`batch_shares`: each replica estimated as the even plan of its share on its own devices (one estimate per
    distinct pair); the step waits for the slowest replica's pipeline, then for the largest tail (the gradient
    reduction joins every replica). FLOPs are each replica's; memory and capacity per pipeline rank the worst."""
    shares = data_shares(plan, efficiency, assignment)
    if shares is None:
        why = "batch_shares: speed cannot split this global batch into whole microbatches for every data rank"
        raise PlanError([diag("E509", why, plan.train.span_of("batch_shares"))])
    dp = len(shares)
    found: dict[tuple, PlanEstimate] = {}
    keys = []
    # each replica accumulates its microbatches' gradients unreduced (`gradient_sync(every_microbatch=False)`): FSDP
    # keeps every unit gathered through the step; under torch's tensor parallelism `replicate` (replicate, zero1) too
    held = plan.data is not None
    for share, devices in zip(shares, replica_devices(plan)):
        key = (share, tuple(d.name for d in devices))
        if key not in found:
            found[key] = estimate_plan(batch.replica_plan(plan, share), efficiency, assignment, list(devices), held)
        keys.append(key)
    replicas = [found[key] for key in keys]
    makespans = [e.time.pipeline for e in replicas]
    tails = [e.time.step - e.time.pipeline for e in replicas]
    slow = max(range(dp), key=lambda r: makespans[r])
    tail = max(tails)
    step = makespans[slow] + tail
    t = replicas[slow].time
    time = replace(t, step=step, communication=t.communication - tails[slow] + tail - t.optimizer
                   + replicas[tails.index(tail)].time.optimizer, optimizer=replicas[tails.index(tail)].time.optimizer)
    executed = sum(e.flops_per_step for e in replicas) / dp  # each replica estimate counts dp copies of itself
    model_flops = sum(e.model_flops_per_step for e in replicas) / dp
    runs = mesh_device_runs(plan)
    peak = sum((end - first) * peak_of(d, plan.train.precision) for d, first, end in runs) / \
        max(1, sum(e - f for _, f, e in runs))
    memory = tuple(max(ms, key=lambda m: m.total) for ms in zip(*(e.memory for e in found.values())))
    capacity = tuple(min(d.usable_memory for d in group) if group else math.inf
                     for group in pipeline_rank_device_types(plan))
    devices = plan.mesh.size
    return PlanEstimate(plan.name, devices, max(e.microbatches for e in replicas), time, memory, capacity,
                        plan.train.global_batch * plan.seq / step if step else 0.0,
                        executed / step / devices / 1e12 if step else 0.0,
                        model_flops / (step * devices * peak) if step else 0.0,
                        executed, model_flops, replicas[slow].stage_times,
                        max((e.communication for e in replicas), key=lambda v: v.total), shares,
                        tuple(m + t for m, t in zip(makespans, tails)), tuple(e.memory for e in replicas),
                        tuple(replica_capacity(plan)))


def replica_capacity(plan: ir.Plan) -> list[tuple[float, ...]]:
    """Per data rank, per pipeline rank: the memory its smallest device there leaves the plan (less its reserve)."""
    return [tuple(min(d.usable_memory for d in types) for types in ranks)
            for ranks in batch.replica_device_types(plan)]


def _volume_parts(moved: Moved) -> str:
    """`   (tensor 1.2 GiB, data 300 MiB)`: the axes that moved anything, for the busiest pipeline rank."""
    parts = [f"{name} {format_bytes(value)}" for name, value in zip(("tensor", "context", "expert", "pipeline", "data"),
                                                                       moved.astuple()) if value]
    return f"   ({', '.join(parts)}; the busiest pipeline rank)" if parts else ""


def _moved(plan: ir.Plan, assignment, stage_times: list[StageTime], run: dict[int, float], tail: float,
           work: Work) -> Moved:
    """Bytes one device of a pipeline rank moves in a step: its stages' collectives for each microbatch they
    run (`StageTime.moved`), a message in and one out for every microbatch at each edge of its stages whose
    neighbour is on another rank (activations forward, gradients back: `pipeline_message_bytes`), and the
    data-parallel reduction and gather after the last backward (`RankTail.moved`)."""
    owner = assignment.rank_of_stage
    message = pipeline_message_bytes(plan.model, work) if plan.stages is not None and plan.pp > 1 else 0.0
    total = Moved(data=tail)
    for stage, microbatches in run.items():
        edges = sum(1 for other in (stage - 1, stage + 1)
                    if 0 <= other < len(owner) and owner[other] != owner[stage])
        total = total + stage_times[stage].moved * microbatches + Moved(pipeline=2 * edges * microbatches * message)
    return total


def estimate_stage_times(plan: ir.Plan, assignment, efficiency: Efficiency | None = None,
                         links: Links | None = None, rank_devices=None) -> list[StageTime]:
    """Per stage of `assignment`, the seconds of one microbatch's F, I and W on its rank's slowest device."""
    precision = plan.train.precision
    work, links = plan_work(plan), links or plan_links(plan)
    if rank_devices is None:
        rank_devices = [slowest(devices, precision) for devices in pipeline_rank_device_types(plan)]
    zero_stage = zero_degrees(plan)[0]
    cache: dict[tuple, LayerTime] = {}
    splits: dict = {}
    result = []
    for stage, layers in enumerate(assignment.stage_layers):
        device = rank_devices[assignment.rank_of_stage[stage]]
        times = []
        for layer, mode in zip(layers, layer_recompute(plan, layers)):  # recompute_layers: per block
            own = layer_precision(plan.train, plan.model, layer)  # bf16_first_layers, bf16_last_layers
            key = (figures_key(layer), id(device), mode, own)  # a kind of block once (dense-then-MoE: two)
            if key not in cache:
                cache[key] = estimate_layer_time(plan.model, layer, replace(work, recompute=mode, precision=own),
                                                 device, links, efficiency)
            times.append(cache[key])
        params = [once_per_figures(splits, layer, lambda layer: param_split(layer, plan.tp, plan.expert_group,
                                                                                      plan.expert_tp))
                  for layer in layers]  # a family's blocks share one split (`figures_key`)
        gathering = plan.data.gathering if plan.data is not None else ir.FSDP_GATHERING
        gathered = None if gathering.default else gather_units(layers, times, params, gathering, plan.tp,
                                                               plan.expert_group, plan.expert_tp)
        element = gather_element(plan, layers, precision.bytes)
        layer_bytes = () if plan.data is None or plan.data.gather is None else [  # the first bucket's own bytes
            gathered_param_bytes(plan, layer, precision.bytes, plan.tp, plan.expert_group, plan.expert_tp, True)
            for layer in layers]
        timed = stage_time(times, params, zero_stage, element, links, fsdp_units(layers),
                           plan.train.grad_dtype.bytes, gathered, pipelined_shards(plan), device.contention,
                           layer_bytes)
        forward, backward = offload_seconds(plan, layers, times, device)  # host copies the compute does not hide
        if forward or backward:
            timed = replace(timed, forward=timed.forward + forward, input_grad=timed.input_grad + backward,
                            comm=timed.comm + forward + backward)
        result.append(timed)
    return deepspeed_exchanges(plan, result, links, work) if deepspeed_pipeline(plan) else result


def deepspeed_pipeline(plan: ir.Plan) -> bool:
    """Whether DeepSpeed's pipeline engine runs the plan's stages over more than one rank (`stages = ... with
    implementation = deepspeed`): its transfers block the stages (`deepspeed_exchanges`) and its gradients are
    reduced after the schedule (`cost.stage.rank_tail`'s `after_schedule`)."""
    return plan.stages is not None and plan.stages.implementation == "deepspeed" and plan.pp > 1


def deepspeed_exchanges(plan: ir.Plan, stage_times: list[StageTime], links: Links, work: Work) -> list[StageTime]:
    """The stage times on DeepSpeed's pipeline engine (docs/cost-model.md, "DeepSpeed's pipeline engine";
    deepspeed v0.5.8, the version of late 2021 that BLOOM's and MT-NLG's Megatron-DeepSpeed ran). Its TrainSchedule
    runs each step's transfers before the step's computation on the same stream, `p2p.send` / `p2p.recv` with no
    `async_op` (runtime/pipe/p2p.py: `dist.send`, `dist.recv`): a forward step receives the microbatch's activation
    from the stage before and sends it the gradient the backward before made (`RecvActivation`, `SendGrad`), a
    backward step sends the stage after the activation the forward before made and receives its gradient
    (`SendActivation`, `RecvGrad`; runtime/pipe/schedule.py, `TrainSchedule.steps`). So a stage after the first
    spends two transfers in each forward, one before the last two in each backward, nothing overlapping them
    (`Costs.p2p` is then 0: the transfer is in the durations). With tensor parallelism each rank sends 1/tp of the
    boundary (`is_pipe_partitioned`, `PartitionedTensor`), the size `pipeline_message_bytes` already counts, and
    all-gathers the whole over the tensor-parallel group before using it: once in a forward after the first stage
    (the received input, `_exec_forward_pass`), twice in a backward before the last (its own output restored,
    `part_output.full()`, and the received gradient, `part_grad.full()`, `_exec_backward_pass`)."""
    transfer = pipeline_p2p_seconds(plan.model, work, links)
    gather = collective_seconds("all_gather", work.tokens * plan.model.hidden * work.precision.bytes, links.tp) \
        if isinstance(plan.model, ir.TransformerModel) and work.tp > 1 else 0.0
    last = len(stage_times) - 1
    out = []
    for stage, timed in enumerate(stage_times):
        forward = 2 * transfer + gather if stage > 0 else 0.0
        backward = 2 * transfer + 2 * gather if stage < last else 0.0
        out.append(replace(timed, forward=timed.forward + forward, input_grad=timed.input_grad + backward,
                           comm=timed.comm + forward + backward))
    return out


def _stage_runs(plan: ir.Plan, assignment, m: int) -> list[dict[int, float]]:
    """Per pipeline rank: stage -> microbatches it runs there. Every rank runs each of its stages
    m times, except Chimera's (Li & Hoefler 2021), whose two pipelines each take half the
    microbatches: rank r runs stage r for one and stage p - 1 - r for the other."""
    ranks = assignment.rank_stages()
    if plan.schedule is not None and plan.stages is not None and pipelines_of(plan.schedule.name) == 2:
        p = len(ranks)
        return [{r: m / 2, p - 1 - r: m / 2} if r != p - 1 - r else {r: m} for r in range(p)]
    return [{s: m for s in stages} for stages in ranks]


def pipeline_p2p(plan: ir.Plan, links: Links, work: Work) -> float:
    if plan.stages is None or plan.pp == 1:
        return 0.0
    return pipeline_p2p_seconds(plan.model, work, links)


def schedule_p2p(plan: ir.Plan, links: Links, work: Work) -> float:
    """The transfer the schedule's simulation puts between a stage and the next (`Costs.p2p`): `pipeline_p2p`, none on
    DeepSpeed's pipeline engine, whose blocking transfers are in the stages' durations (`deepspeed_exchanges`)."""
    return 0.0 if deepspeed_pipeline(plan) else pipeline_p2p(plan, links, work)


def pipeline_p2p_seconds(model: ir.Model, work: Work, links: Links) -> float:
    """One microbatch's activations between neighbouring pipeline ranks (`pipeline_message_bytes`)."""
    return collective_seconds("p2p", pipeline_message_bytes(model, work), links.pp)


def pipeline_message_bytes(model: ir.Model, work: Work) -> float:
    """Bytes of one microbatch's activations from a pipeline rank to the next. Megatron's scatter/gather
    optimisation (Narayanan et al. 2021, Sec. 4.1) sends 1/t of the [b, s, h] tensor per tensor-parallel
    rank; other models send their widest layer output."""
    if isinstance(model, ir.TransformerModel):
        return work.tokens * model.hidden * work.precision.bytes / work.tp
    return work.tokens * max(layer.output_width for layer in layers_of(model)) * work.precision.bytes


def simulated_peaks(plan: ir.Plan, assignment, memory: list[MemoryEstimate], activations, peaks) -> list[MemoryEstimate]:
    """Activation memory: the in-flight formula of `cost.memory`, or the simulated peak when higher
    (plus the recomputation working set the formula adds)."""
    ranks = held_stages(plan, assignment.rank_stages())
    result = []
    for rank, estimate in enumerate(memory):
        # the simulation counts each stage's saved activations per microbatch in flight there; beside them the rank
        # keeps the recomputed block or the loss's backward once (`cost.memory.beyond_layers`)
        working = beyond_layers(plan, [assignment.stage_layers[s] for s in ranks[rank]])
        simulated = peaks[rank] + working if rank < len(peaks) else 0.0
        if simulated > estimate.activations * (1 + 1e-9):
            estimate = replace(estimate, activations=simulated)
        result.append(estimate)
    return result


def _deadlock(plan: ir.Plan, simulation):
    return diag("E502", f"schedule '{plan.schedule.name}' deadlocks on this plan: {simulation.deadlock}",
                plan.schedule.span)


# ---- text ------------------------------------------------------------------------------------------------
def format_estimate(estimate: PlanEstimate) -> str:
    t = estimate.time

    def share(value: float) -> str:
        return f"{value:10.4g} s  {value / t.step:6.1%}" if t.step else f"{value:10.4g} s"

    lines = [f"plan {estimate.plan}: {estimate.devices} devices, {estimate.microbatches} microbatches per step"
             + (" (the most of any replica)" if estimate.shares else ""),
             f"  step time      {t.step:10.4g} s",
             f"    compute      {share(t.compute)}",
             f"    comm exposed {share(t.communication)}",
             (f"    bubble       {share(t.bubble)}   ({t.bubble_fraction:.1%} of the {t.pipeline:.4g} s makespan: "
              f"{BUBBLE_DEFINITION})"),
             f"    optimizer    {share(t.optimizer)}",
             *_share_lines(estimate),
             f"  tokens/s       {estimate.tokens_per_s:10.4g}",
             f"  TFLOP/s/device {estimate.tflops_per_device:10.4g}   (executed, with recomputation)",
             f"  MFU            {estimate.mfu:10.1%}",
             f"  comm volume    {format_bytes(estimate.communication.total):>10} per device per step"
             + _volume_parts(estimate.communication),
             "  memory per device (worst device of each pipeline rank):",
             f"  {'rank':>6} {'params':>11} {'grads':>11} {'optimizer':>11} {'activations':>11}"
             + (f" {'pipeline':>11}" if any(m.other for m in estimate.memory) else "")
             + f" {'total':>11} {'capacity':>11}"]
    buffers = any(m.other for m in estimate.memory)  # torch's pipeline stage's buffers (`cost.memory.torch_stage_bytes`)
    for rank, (m, c) in enumerate(zip(estimate.memory, estimate.capacity)):
        flag = "" if m.total <= c else "  DOES NOT FIT"
        lines.append(f"  {rank:>6} {format_bytes(m.params):>11} {format_bytes(m.grads):>11} "
                     f"{format_bytes(m.optimizer):>11} {format_bytes(m.activations):>11} "
                     + (f"{format_bytes(m.other):>11} " if buffers else "")
                     + f"{format_bytes(m.total):>11} {format_bytes(c):>11}{flag}")
    lines.append("  params, grads, optimizer: at the plan's master_dtype (or param_dtype: then the master copy counts "
                 "with the optimizer), grad_dtype and optimizer_dtype (fp32 unless it says), ZeRO-sharded, with the "
                 "units ZeRO-2/3 "
                 "gather; activations: the schedule's in-flight bound or the simulated peak, whichever is higher, "
                 "plus the recomputation working set or the loss's backward and, over fp32 weights at a 16-bit "
                 "precision without `gather`, autocast's 16-bit copies of them; "
                 + ("pipeline: what torch's pipeline stage keeps beside the layers (a receive buffer per microbatch "
                    "for activations and for gradients, each output until its backward); " if buffers else "")
                 + ("total: their sum, the peak; " if not any(m.apart or m.moments for m in estimate.memory) else
                    f"total: their sum, less {format_bytes(max(m.apart for m in estimate.memory))} of the gradients a "
                    "step of one microbatch has not made yet at its peak (the loss's backward: `zero_grad` freed the "
                    "last step's; no more than the activations outweigh the step's later moments, the optimizer's "
                    "step's temporaries among them), the peak; " if any(m.apart for m in estimate.memory) else
                    f"total: their sum, less {format_bytes(max(m.moments for m in estimate.memory))} of ZeRO-2/3's "
                    "units and activations never alive together (the loss's backward holds no unit's gradient and no "
                    "block's parameters but its last's, a block's backward neither the loss's temporaries nor the "
                    "norm's and head's activations), the peak; ")
                 + "capacity: the device's memory less its reserve (allocator, context, communication buffers)")
    host = max((m.host for m in estimate.memory), default=0.0)
    if host:  # offload_layers: what waits in the host's memory, no part of the total above
        room = f" of {format_bytes(estimate.host_capacity)} (host_memory over its machine's devices)" \
            if estimate.host_capacity < math.inf else " (the node states no host_memory)"
        lines.append(f"  offloaded to the host: {format_bytes(host)} per device at the most{room}"
                     + ("  DOES NOT FIT" if host > estimate.host_capacity else ""))
    return "\n".join(lines)


def _share_lines(estimate: PlanEstimate) -> list[str]:
    """`batch_shares`: each data rank's sequences and its own step (makespan + tail), the slowest marked."""
    if not estimate.shares:
        return []
    slowest_rank = max(range(len(estimate.replica_steps)), key=lambda r: estimate.replica_steps[r])
    lines = [f"  batch shares   {share_runs(estimate.shares)} sequences per data rank; data rank {slowest_rank} is the slowest "
             f"({estimate.replica_steps[slowest_rank]:.4g} s with its tail; the fastest "
             f"{min(estimate.replica_steps):.4g} s)"]
    if estimate.replica_memory:  # the data rank nearest its own devices' capacity (or over it)
        fullest = max(((m.total / c if c else math.inf, replica, rank, m.total, c)
                       for replica, (ms, cs) in enumerate(zip(estimate.replica_memory, estimate.replica_capacity))
                       for rank, (m, c) in enumerate(zip(ms, cs))), key=lambda f: f[:1])
        _, replica, rank, total, capacity = fullest
        where = f", pipeline rank {rank}" if len(estimate.memory) > 1 else ""
        lines.append(f"  replica memory data rank {replica}{where} is the fullest: {format_bytes(total)} of its "
                     f"devices' {format_bytes(capacity)}" + ("" if total <= capacity else " (does not fit)"))
    return lines


__all__ = ["TimeBreakdown", "PlanEstimate", "estimate_plan", "data_shares", "format_shares", "share_runs", "replica_devices", "replica_capacity", "plan_work", "pipeline_p2p", "pipeline_p2p_seconds",
           "deepspeed_pipeline", "deepspeed_exchanges", "schedule_p2p",
           "estimate_stage_times", "format_estimate"]
