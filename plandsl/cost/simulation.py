"""A checked plan -> its schedule simulated with the plan's own costs (or given ones), and the
text report `plandsl simulate` and `plandsl schedule --simulate` print."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from plandsl import ir
from plandsl.cost.schedule import builtin_virtual, plan_schedule, simulate_plan_schedule
from plandsl.cost.pipeline import estimate_stage_costs
from plandsl.diagnostics import PlanError, diag
from plandsl.ir.placement import assign_stages
from plandsl.schedules.bounded import simulate_builtin
from plandsl.schedules.generators import MAX_ACTIONS, TooLarge, check_sizes, count_actions
from plandsl.schedules.program import Schedule
from plandsl.schedules.registry import BUILTIN, pipelines_of
from plandsl.schedules.simulate import BUBBLE_DEFINITION, Costs, Simulation, simulate
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


def simulate_plan(plan: ir.Plan, costs: Costs | None = None,
                  every_action: bool = False) -> tuple[Schedule | Outline, Simulation]:
    """The plan's pipeline simulated; `costs` replaces the plan's durations (memory stays the plan's).
    A built-in schedule too large to lay out (E609) is simulated in bounded work (`schedules.bounded`):
    exact step time, bubble and peaks, the steady state extrapolated (`Simulation.extrapolated`), and
    an `Outline` for the table; unless `every_action` (a timeline needs them all: E609 stays)."""
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
    plan_costs = estimate_stage_costs(plan, assignment)
    if costs is not None:
        plan_costs = dataclasses.replace(costs, activation_bytes=plan_costs.activation_bytes,
                                         static_bytes=plan_costs.static_bytes)
        if pipelines_of(plan.schedule.name) == 2 or schedule.stages != len(plan_costs.activation_bytes):
            plan_costs = dataclasses.replace(plan_costs, activation_bytes=(), static_bytes=())
    return schedule, simulate_plan_schedule(plan, plan_costs) if bounded else simulate(schedule, plan_costs)


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
        lines.append("simulated peak: parameters, gradients and optimizer states (as `plandsl estimate` counts them) "
                     "+ the activations the simulated order holds at once; `estimate`'s peak also counts the "
                     "recomputation working set and takes the schedule's in-flight bound when that is higher")
    return "\n".join(lines)
