"""Layers onto stages and stages onto ranks (E401-E404, E409, E410), and what the chosen
schedule needs of that map (virtual stages, V-shape)."""
from __future__ import annotations

from typing import Iterator

from plandsl import ir
from plandsl.diagnostics import Diagnostic, diag
from plandsl.ir.placement import assign_stages
from plandsl.schedules.registry import BUILTIN


def check_placement(plan: ir.Plan) -> Iterator[Diagnostic]:
    if plan.stages is None:
        return
    _, problems = assign_stages(plan)
    yield from problems
    schedule = plan.schedule
    info = BUILTIN.get(schedule.name) if schedule else None
    if info is None:
        return
    virtual = plan.stages.virtual
    if info.pipelines == 2:
        if virtual != 1:
            yield diag("E409", f"schedule '{info.name}' runs two pipelines over the same {plan.pp} stages (each rank "
                       f"holds one stage of each); the plan splits the model into virtual = {virtual} stages per rank",
                       schedule.span, hint="stages = evenly over pp")
        return
    if info.virtual == "one" and virtual != 1:
        yield diag("E409", f"schedule '{info.name}' runs one stage per rank, but the plan has virtual = {virtual}",
                   schedule.span, hint="use interleaved_1f1b, looped_bfs or interleaved_zero_bubble for virtual > 1")
    elif info.virtual == "two" and (virtual != 2 or plan.stages.rank_map == "loop"):
        yield diag("E409", f"schedule '{info.name}' runs two stages per rank in a V (rank r holds stages r and "
                   f"2p-1-r); the plan has virtual = {virtual}, map = {_show_map(plan.stages.rank_map)}",
                   schedule.span, hint="stages = evenly over pp with virtual = 2, map = vshape")


def _show_map(mapping) -> str:
    return mapping if isinstance(mapping, str) else "[" + ", ".join(map(str, mapping)) + "]"
