"""A checked plan -> its schedule simulated with the plan's own costs (or given ones), and the
text report `plandsl simulate` and `plandsl schedule --simulate` print."""
from __future__ import annotations

import dataclasses

from plandsl import ir
from plandsl.cost.schedule import plan_schedule
from plandsl.cost.pipeline import estimate_stage_costs
from plandsl.diagnostics import PlanError, diag
from plandsl.ir.placement import assign_stages
from plandsl.schedules.program import Schedule
from plandsl.schedules.registry import pipelines_of
from plandsl.schedules.simulate import BUBBLE_DEFINITION, Costs, Simulation, simulate
from plandsl.lower.units import format_bytes


def simulate_plan(plan: ir.Plan, costs: Costs | None = None) -> tuple[Schedule, Simulation]:
    """The plan's pipeline simulated; `costs` replaces the plan's durations (memory stays the plan's)."""
    if plan.stages is None or plan.schedule is None:
        raise PlanError([diag("E306", f"plan '{plan.name}' has no pipeline to simulate", plan.span,
                              hint="add a `pp` axis (stages over it) to the mesh")])
    assignment, problems = assign_stages(plan)
    schedule, more = plan_schedule(plan)
    if assignment is None or schedule is None or problems or more:
        raise PlanError(problems + more)
    plan_costs = estimate_stage_costs(plan, assignment)
    if costs is not None:
        plan_costs = dataclasses.replace(costs, activation_bytes=plan_costs.activation_bytes,
                                         static_bytes=plan_costs.static_bytes)
        if pipelines_of(plan.schedule.name) == 2 or schedule.stages != len(plan_costs.activation_bytes):
            plan_costs = dataclasses.replace(plan_costs, activation_bytes=(), static_bytes=())
    return schedule, simulate(schedule, plan_costs)


def report(schedule: Schedule, simulation: Simulation, unit: str = "", memory_in_bytes: bool = False) -> str:
    """Makespan, bubble, and one row per rank."""
    lines = [f"schedule {schedule.name}: {schedule.ranks} ranks, {schedule.stages} stages, "
             f"{schedule.microbatches} microbatches, {schedule.num_actions} actions"]
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
