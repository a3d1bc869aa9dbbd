"""The checker: a resolved `ir.Plan` -> every problem in it, as diagnostics.

One module per family (`mesh`, `model`, `placement`, `sharding`, `training`, `schedule`, `memory`); each
`check_*` yields diagnostics and never raises. Families that depend on another's result
(memory needs a valid placement) are skipped when that one failed, so a single mistake
is reported once, not as a cascade: `families` runs them in that order, and `axis_sizes` confirms the
sizes a hint offers by running them again on the resized plan.
"""
from __future__ import annotations

from plandsl import ir
from plandsl.check.axis_roles import suggest_axis_split, suggest_axis_use
from plandsl.check.axis_sizes import suggest_axis_size, suggest_mesh_fit, suggest_stage_axis
from plandsl.check.families import check_families
from plandsl.diagnostics import Diagnostic


def check_plan(plan: ir.Plan, suggest: bool = True) -> list[Diagnostic]:
    """Every problem of `plan`; with `suggest`, hints that offer a new value are confirmed by
    checking the plan with that value (`plandsl.check.axis_sizes`)."""
    found = check_families(plan)
    if suggest:
        found = [_suggest(plan, d, found) for d in found]
    return found


def _suggest(plan: ir.Plan, problem: Diagnostic, found: list[Diagnostic]) -> Diagnostic:
    """`problem` with a hint whose new sizes were checked, when it is one that offers sizes."""
    if problem.code == "E406":
        return suggest_axis_size(plan, problem, found)
    if problem.code == "E301":
        return suggest_mesh_fit(plan, problem, found)
    if problem.code == "E306":
        return suggest_axis_use(plan, problem, found)
    if problem.code == "E307":
        return suggest_axis_split(plan, problem, found)
    if problem.code == "E404" and problem.message.startswith("the stages block declares"):
        return suggest_stage_axis(plan, problem, found, int(problem.message.split()[4]))
    return problem
