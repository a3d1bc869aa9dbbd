"""The plan's schedule for the plan's sizes: a built-in must be able to run them (E502), a
written schedule is instantiated and validated (E602-E608) and must put stages on the
ranks the plan's stage map says (E409)."""
from __future__ import annotations

from typing import Iterator

from plandsl import ir
from plandsl.diagnostics import Diagnostic, diag
from plandsl.placement import rank_map
from plandsl.schedules.generators import generate
from plandsl.schedules.registry import BUILTIN
from plandsl.schedules.template import instantiate


def plan_schedule(plan: ir.Plan):
    """(Schedule or None, diagnostics) of the plan's pipeline for its sizes."""
    ref, stages = plan.schedule, plan.stages
    if ref is None or stages is None:
        return None, []
    m = plan.num_microbatches
    if ref.definition is not None:
        return instantiate(ref.definition, ref.definition.scope, ranks=plan.pp, microbatches=m,
                           virtual=stages.virtual)
    info = BUILTIN[ref.name]
    try:
        return generate(ref.name, plan.pp, m, None if info.pipelines == 2 else stages.virtual), []
    except ValueError as error:
        return None, [diag("E502", f"{error} (global_batch {plan.train.global_batch} / (dp {plan.dp} x micro_batch "
                           f"{plan.train.micro_batch}) = {m} microbatches)", ref.span,
                           hint="change global_batch or micro_batch so the microbatch count fits the schedule")]


def check_schedule(plan: ir.Plan) -> Iterator[Diagnostic]:
    schedule, problems = plan_schedule(plan)
    yield from problems
    if schedule is None or problems or plan.schedule.definition is None:
        return
    expected, _ = rank_map(plan.stages, plan.pp)
    derived = schedule.stage_to_rank[0]
    if expected and tuple(derived) != tuple(expected):
        wrong = [s for s, (a, b) in enumerate(zip(derived, expected)) if a != b]
        yield diag("E409", f"schedule '{plan.schedule.name}' runs stage {wrong[0]} on rank {derived[wrong[0]]}, but the "
                   f"plan's stage map puts it on rank {expected[wrong[0]]}", plan.schedule.span,
                   hint=f"the schedule's map is {list(derived)}: set `map = {list(derived)}` in the stages, or "
                   "change the schedule")
