"""A plan's pipeline schedule laid out and simulated: the built-in generator for the plan's sizes or the
plan's own table or template, instantiated for its stages. `plan_schedule` lays the whole table out for
the commands that print or simulate it, up to `generators.MAX_ACTIONS` actions (E609 past it);
`simulate_plan_schedule` simulates a built-in in bounded work for any microbatch count."""
from __future__ import annotations

import dataclasses

from plandsl import ir
from plandsl.diagnostics import Diagnostic, Note, PlanError, diag
from plandsl.lower.schedule_template import instantiate
from plandsl.schedules.bounded import simulate_builtin
from plandsl.schedules.generators import MAX_ACTIONS, TooLarge, check_sizes, count_actions, generate
from plandsl.schedules.program import Kind
from plandsl.schedules.registry import BUILTIN, splits_backward
from plandsl.schedules.simulate import Simulation, simulate


def plan_schedule(plan: ir.Plan):
    """(Schedule or None, diagnostics) of the plan's pipeline for its sizes, laid out in full."""
    ref, stages = plan.schedule, plan.stages
    if ref is None or stages is None:
        return None, []
    m = plan.num_microbatches
    if ref.definition is not None:
        schedule, problems = instantiate(ref.definition, ref.definition.scope, ranks=plan.pp, microbatches=m,
                                         virtual=stages.virtual)
        return schedule, [_at_the_plan(plan, d) if d.code == "E609" else d for d in problems]
    try:
        return generate(ref.name, plan.pp, m, builtin_virtual(plan)), []
    except TooLarge as error:
        return None, [too_large(plan, str(error))]
    except ValueError as error:
        return None, [_size_problem(plan, error)]


def plan_splits_backward(plan: ir.Plan) -> bool:
    """Whether the plan's pipeline runs input and weight gradients as separate actions (I and W): a built-in by its
    name, without laying it out; a written one if any action of its table is an I. With stages `plandsl run` builds
    torch's schedule whatever the pipeline axis's size (`runtime.train.build_job`), so a one-rank `zbv` splits them
    too."""
    if plan.schedule is None or plan.stages is None:
        return False
    if plan.schedule.definition is None:
        return splits_backward(plan.schedule.name)
    schedule, _ = plan_schedule(plan)
    return schedule is not None and any(action.kind is Kind.I for row in schedule.actions for action in row)


def simulate_plan_schedule(plan: ir.Plan, costs) -> Simulation:
    """The plan's pipeline simulated under `costs`: a built-in in bounded work for any microbatch
    count (`schedules.bounded`), a written one in full; PlanError when it cannot be."""
    if plan.schedule.definition is None:
        problems = builtin_sizes(plan)
        try:
            if not problems:
                return simulate_builtin(plan.schedule.name, plan.pp, plan.num_microbatches, builtin_virtual(plan),
                                        costs)
        except TooLarge as error:
            problems = [_steady_state_too_large(plan, str(error))]
        raise PlanError(problems)
    schedule, problems = plan_schedule(plan)
    if schedule is None or problems:
        raise PlanError(problems)
    return simulate(schedule, costs)


def too_large(plan: ir.Plan, message: str) -> Diagnostic:
    return diag("E609", message, plan.schedule.span, notes=[_microbatches(plan)],
                hint=f"`plandsl simulate` and `plandsl estimate` give the figures at this size (step time, bubble, "
                     f"peaks); to print, draw or trace every action, use fewer microbatches: lower global_batch or "
                     f"raise micro_batch (at most {MAX_ACTIONS:,} actions)")


def _steady_state_too_large(plan: ir.Plan, message: str) -> Diagnostic:
    """E609 where even the bounded simulation of a built-in (`simulate_builtin`: a run of a few rounds of its stages'
    microbatches, extrapolated) passes the cap: its pipeline is too deep for that run, whatever the microbatches; the
    hint names what does fit (not `simulate` or `estimate`, which are the commands that failed)."""
    name, pp = plan.schedule.name, plan.pp
    virtual = check_sizes(name, pp, plan.num_microbatches, builtin_virtual(plan))
    whole = MAX_ACTIONS // count_actions(name, pp, 1, virtual)  # microbatches simulated whole, not extrapolated
    return diag("E609", message, plan.schedule.span, notes=[_microbatches(plan)],
                hint=f"a built-in schedule's figures are extrapolated from a run of a few rounds of its "
                     f"{pp * virtual:,} stages (pp {pp} x virtual {virtual}), and that run alone is more than "
                     f"{MAX_ACTIONS:,} actions: use fewer pipeline stages (lower pp or virtual), or at most "
                     f"{whole:,} microbatches (lower global_batch or raise micro_batch), which are simulated whole")


def _at_the_plan(plan: ir.Plan, problem: Diagnostic) -> Diagnostic:
    """A written schedule too large for the plan's sizes (E609), shown where the plan names it and where
    the microbatches come from, with the definition as a note."""
    return dataclasses.replace(problem, span=plan.schedule.span, notes=(
        Note(f"schedule '{plan.schedule.name}' defined here", problem.span), _microbatches(plan), *problem.notes))


def _microbatches(plan: ir.Plan) -> Note:
    return Note(f"{plan.num_microbatches:,} microbatches = global_batch {plan.train.global_batch:,} / (dp {plan.dp} "
                f"x micro_batch {plan.train.micro_batch})", plan.train.span)


def builtin_sizes(plan: ir.Plan) -> list[Diagnostic]:
    """E502 when the plan's built-in schedule cannot run its sizes; lays nothing out."""
    try:
        check_sizes(plan.schedule.name, plan.pp, plan.num_microbatches, builtin_virtual(plan))
    except ValueError as error:
        return [_size_problem(plan, error)]
    return []


def builtin_virtual(plan: ir.Plan) -> int | None:
    return None if BUILTIN[plan.schedule.name].pipelines == 2 else plan.stages.virtual


def _size_problem(plan: ir.Plan, error: ValueError) -> Diagnostic:
    return diag("E502", f"{error} (global_batch {plan.train.global_batch} / (dp {plan.dp} x micro_batch "
                f"{plan.train.micro_batch}) = {plan.num_microbatches} microbatches)", plan.schedule.span,
                hint="change global_batch or micro_batch so the microbatch count fits the schedule")
