"""A checked plan -> its schedule simulated with the plan's own costs (or given ones), and the
text report `plandsl simulate` and `plandsl schedule --simulate` print. With `batch_shares` each data rank
runs its own number of microbatches on its own devices: `simulate_replicas` simulates each distinct
(share, devices) replica, whose makespans are the estimate's (`cost.estimate`: the slowest sets the step)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from plandsl import ir
from plandsl.cost.schedule import builtin_virtual, plan_schedule, simulate_plan_schedule
from plandsl.cost.estimate import data_shares, replica_devices
from plandsl.cost.pipeline import estimate_stage_costs
from plandsl.ir import shares as batch
from plandsl.diagnostics import PlanError, diag
from plandsl.ir.placement import assign_stages
from plandsl.schedules.bounded import simulate_builtin
from plandsl.schedules.generators import MAX_ACTIONS, TooLarge, check_sizes, count_actions
from plandsl.schedules.program import Schedule
from plandsl.schedules.registry import BUILTIN, pipelines_of
from plandsl.schedules.simulate import BUBBLE_DEFINITION, Costs, Simulation, simulate, to_chrome_trace
from plandsl.lower.units import format_bytes
from plandsl.lower.schedule_spec import load_schedule


@dataclass(frozen=True)
class Outline:
    """A built-in schedule's name and sizes, for a simulation whose table was not laid out in full."""

    name: str
    ranks: int
    stages: int
    microbatches: int
    num_actions: int  # at most this many compute actions (count_actions)


def outline(name: str, ranks: int, microbatches: int, virtual: int | None) -> Outline:
    virtual = check_sizes(name, ranks, microbatches, virtual)
    stages = ranks if pipelines_of(name) == 2 else ranks * virtual
    return Outline(name, ranks, stages, microbatches, count_actions(name, ranks, microbatches, virtual))


def simulate_plan(plan: ir.Plan, costs: Costs | None = None, every_action: bool = False,
                  rank_devices=None, held: bool = False) -> tuple[Schedule | Outline, Simulation]:
    """The plan's pipeline simulated; `costs` replaces the plan's durations (memory stays the plan's).
    A built-in schedule too large to lay out (E609) is simulated in bounded work (`schedules.bounded`):
    exact step time, bubble and peaks, the steady state extrapolated (`Simulation.extrapolated`), and
    an `Outline` for the table; unless `every_action` (a timeline needs them all: E609 stays).
    `rank_devices`, `held`: one replica of a plan with `batch_shares` (`simulate_replicas`)."""
    if plan.stages is None or plan.schedule is None:
        raise PlanError([diag("E306", f"plan '{plan.name}' has no pipeline to simulate", plan.span,
                              hint="add a `pp` axis (stages over it) to the mesh")])
    assignment, problems = assign_stages(plan)
    schedule, more = plan_schedule(plan)
    bounded = schedule is None and plan.schedule.definition is None and [d.code for d in more] == ["E609"] \
        and not every_action
    if bounded:
        schedule, more = outline(plan.schedule.name, plan.pp, plan.num_microbatches, builtin_virtual(plan)), []
    if assignment is None or schedule is None or problems or more:
        raise PlanError(problems + more)
    plan_costs = estimate_stage_costs(plan, assignment, rank_devices, held)
    if costs is not None:
        plan_costs = dataclasses.replace(costs, activation_bytes=plan_costs.activation_bytes,
                                         static_bytes=plan_costs.static_bytes)
        if pipelines_of(plan.schedule.name) == 2 or schedule.stages != len(plan_costs.activation_bytes):
            plan_costs = dataclasses.replace(plan_costs, activation_bytes=(), static_bytes=())
    return schedule, simulate_plan_schedule(plan, plan_costs) if bounded else simulate(schedule, plan_costs)


@dataclass(frozen=True)
class Replica:
    """The data ranks of a plan with `batch_shares` that take one share on one kind of devices, simulated."""

    data_ranks: tuple[int, ...]
    share: int                       # sequences per step
    microbatches: int
    devices: tuple[str, ...]         # the device each pipeline rank is timed on (its slowest)
    schedule: Schedule | Outline
    simulation: Simulation
    p2p: float = 0.0                 # seconds of one stage-to-stage transfer

    def name(self) -> str:
        """`data rank 0` / `data ranks 0-15, 20`: the ranks as runs."""
        runs: list[list[int]] = []
        for rank in self.data_ranks:
            if runs and runs[-1][1] == rank - 1:
                runs[-1][1] = rank
            else:
                runs.append([rank, rank])
        shown = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs[:8]) + (", ..." if len(runs) > 8 else "")
        return f"data rank{'s' if len(self.data_ranks) > 1 else ''} {shown}"

    def describe(self, unit: str = " s") -> str:
        """`unit`: the durations' ('' for `--costs`, which are the user's units)."""
        kinds = ", ".join(dict.fromkeys(self.devices))
        return (f"{self.name()}: {self.share} sequences, {self.microbatches} microbatch(es) on {kinds}, makespan "
                f"{self.simulation.makespan:.6g}{unit}")

    def to_json(self) -> dict:
        return {"data_ranks": list(self.data_ranks), "share": self.share, "microbatches": self.microbatches,
                "devices": list(self.devices), **self.simulation.to_json()}


def simulate_replicas(plan: ir.Plan, costs: Costs | None = None, every_action: bool = False) -> list[Replica]:
    """`batch_shares`: every distinct (share, devices) replica's pipeline simulated on its own devices with its
    own microbatch count, slowest first (its makespan sets the step); the plan's own simulation without shares."""
    if not batch.uneven(plan):
        schedule, simulation = simulate_plan(plan, costs, every_action)
        return [Replica(tuple(range(plan.dp)), plan.train.global_batch // max(1, plan.dp), plan.num_microbatches,
                        (), schedule, simulation)]
    shares = data_shares(plan)
    if shares is None:
        raise PlanError([diag("E509", "batch_shares: speed cannot split this global batch into whole microbatches "
                                      "for every data rank", plan.train.span_of("batch_shares"))])
    held = plan.data is not None  # `cost.estimate._estimate_replicas`
    groups: dict[tuple, list[int]] = {}
    devices = replica_devices(plan)
    for rank, (share, kinds) in enumerate(zip(shares, devices)):
        groups.setdefault((share, tuple(d.name for d in kinds)), []).append(rank)
    found = []
    for (share, names), ranks in groups.items():
        replica = batch.replica_plan(plan, share)
        schedule, simulation = simulate_plan(replica, costs, every_action, list(devices[ranks[0]]), held)
        assignment, _ = assign_stages(replica)
        p2p = estimate_stage_costs(replica, assignment, list(devices[ranks[0]])).p2p if assignment else 0.0
        found.append(Replica(tuple(ranks), share, share // plan.train.micro_batch, names, schedule, simulation, p2p))
    return sorted(found, key=lambda r: (-r.simulation.makespan, r.data_ranks))


def replicas_report(replicas: list[Replica], unit: str = "", memory_in_bytes: bool = False) -> str:
    """`plandsl simulate` of a plan with `batch_shares`: which replica sets the step, then each one's report."""
    slowest, fastest = replicas[0], replicas[-1]
    lines = [f"batch_shares: {len(replicas)} kind(s) of replica, each with its own microbatches on its own devices; "
             f"the step waits for {slowest.name()} (makespan {slowest.simulation.makespan:.6g}{unit}), "
             f"{fastest.name()} ends first ({fastest.simulation.makespan:.6g}{unit})"]
    for replica in replicas:
        lines += ["", replica.describe(unit), report(replica.schedule, replica.simulation, unit, memory_in_bytes)]
    return "\n".join(lines)


def replicas_trace(replicas: list[Replica]) -> dict:
    """A Chrome/Perfetto trace of every replica: one process each (named by its data ranks), a thread per rank."""
    events: list[dict] = []
    for pid, replica in enumerate(replicas):
        for event in to_chrome_trace(replica.simulation)["traceEvents"]:
            event = {**event, "pid": pid}
            if event["name"] == "process_name":
                event["args"] = {"name": replica.describe()}
            events.append(event)
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def simulate_named(name: str, ranks: int | None, microbatches: int | None, virtual: int | None,
                   costs: Costs) -> tuple[Schedule | Outline, Simulation]:
    """`plandsl schedule NAME --simulate`: the schedule laid out and simulated, or, for a built-in too
    large to lay out (E609), simulated in bounded work like `simulate_plan`."""
    try:
        found = load_schedule(name, ranks, microbatches, virtual)
    except PlanError as error:
        if [d.code for d in error.diagnostics] != ["E609"] or name not in BUILTIN:
            raise
        try:
            return outline(name, ranks, microbatches, virtual), simulate_builtin(name, ranks, microbatches, virtual,
                                                                                 costs)
        except TooLarge as too_large:
            raise PlanError([diag("E609", str(too_large), hint="lower --ranks or --virtual")]) from None
    return found, simulate(found, costs)


def trace_problem(simulation: Simulation, span=None) -> PlanError | None:
    """E609 when a trace was asked for a simulation whose steady state was extrapolated: a trace
    holds every action, and only the figures of such a simulation are known."""
    if simulation.extrapolated is None:
        return None
    return PlanError([diag("E609", f"a trace needs every action laid out, and {simulation.extrapolated.microbatches:,} "
                           f"microbatches take more than the {MAX_ACTIONS:,} actions a simulation lays out", span,
                           hint="drop --trace for the figures at this size (step time, bubble and peaks are "
                                "exact); for the picture, simulate fewer microbatches (lower global_batch or raise "
                                "micro_batch, or --microbatches)")])


def report(schedule: Schedule | Outline, simulation: Simulation, unit: str = "", memory_in_bytes: bool = False) -> str:
    """Makespan, bubble, and one row per rank."""
    actions = f"{schedule.num_actions} actions" if simulation.extrapolated is None else \
        f"up to {schedule.num_actions:,} actions, not laid out"
    lines = [f"schedule {schedule.name}: {schedule.ranks} ranks, {schedule.stages} stages, "
             f"{schedule.microbatches} microbatches, {actions}"]
    if simulation.extrapolated is not None:
        lines.append(str(simulation.extrapolated))
    if simulation.deadlock is not None:
        lines.append(f"DEADLOCK: {simulation.deadlock}")
    lines.append(f"makespan {simulation.makespan:.6g}{unit}, bubble {simulation.bubble_fraction:.1%} "
                 f"({BUBBLE_DEFINITION})")
    memory = "simulated peak" if memory_in_bytes else "peak activations (units)"
    lines.append(f"{'rank':>5} {'busy':>12} {'idle':>12} {'idle %':>7} {'in flight':>9} {memory:>24}")
    for stats in simulation.ranks:
        share = stats.idle / simulation.makespan if simulation.makespan else 0.0
        peak = format_bytes(stats.peak_memory_bytes) if memory_in_bytes else f"{stats.peak_memory_bytes:g}"
        lines.append(f"{stats.rank:>5} {stats.busy:>12.6g} {stats.idle:>12.6g} {share:>7.1%} "
                     f"{stats.peak_inflight_microbatches:>9} {peak:>24}")
    if memory_in_bytes:
        lines.append("simulated peak: parameters, gradients and optimizer states and torch's pipeline stage's buffers "
                     "(as `plandsl estimate` counts them) + the activations the simulated order holds at once; "
                     "`estimate`'s peak also counts the recomputation working set and the loss's backward and takes "
                     "the schedule's in-flight bound when that is higher")
    return "\n".join(lines)
