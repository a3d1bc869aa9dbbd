"""The plan's schedule for the plan's sizes: a built-in must be able to run them (E502, its size
rules only: nothing is laid out, whatever the microbatch count), a written schedule is
instantiated and validated (E602-E608) and must put stages on the ranks the plan's stage map
says (E409). The table itself is laid out by `cost.schedule.plan_schedule`."""
from __future__ import annotations

from typing import Iterator

from plandsl import ir
from plandsl.diagnostics import Diagnostic, diag
from plandsl.ir.placement import rank_map
from plandsl.cost.schedule import builtin_sizes, plan_schedule


def check_schedule(plan: ir.Plan) -> Iterator[Diagnostic]:
    if plan.schedule is None or plan.stages is None:
        return
    if plan.schedule.definition is None:
        yield from builtin_sizes(plan)
        return
    schedule, problems = plan_schedule(plan)
    yield from problems
    if schedule is None or problems:
        return
    expected, _ = rank_map(plan.stages, plan.pp)
    derived = schedule.stage_to_rank[0]
    if expected and tuple(derived) != tuple(expected):
        wrong = [s for s, (a, b) in enumerate(zip(derived, expected)) if a != b]
        yield diag("E409", f"schedule '{plan.schedule.name}' runs stage {wrong[0]} on rank {derived[wrong[0]]}, but the "
                   f"plan's stage map puts it on rank {expected[wrong[0]]}", plan.schedule.span,
                   hint=f"the schedule's map is {list(derived)}: set `map = {list(derived)}` in the stages, or "
                   "change the schedule")
