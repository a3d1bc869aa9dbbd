"""Layers onto stages and stages onto ranks (E401-E404, E409, E410), and what the chosen
schedule needs of that map (virtual stages, V-shape, and a built-in's own map: the one `plandsl run` runs)."""
from __future__ import annotations

from typing import Iterator

from plandsl import ir
from plandsl.diagnostics import Diagnostic, Note, diag
from plandsl.ir.placement import assign_stages, rank_map
from plandsl.schedules.program import loop_map, vshape_map
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
    elif not problems:
        yield from _builtin_map(plan, info)


def _builtin_map(plan: ir.Plan, info) -> Iterator[Diagnostic]:
    """A built-in lays its stages out on its own map (torch's classes: s mod pp, or the V; the generated
    tables alike), which is what `plandsl run` runs and the estimate simulates: a stage map written otherwise
    (`map = [1, 0]`) is E409, as a written schedule's is (check.schedule)."""
    mapping, problems = rank_map(plan.stages, plan.pp)
    if problems or not mapping:
        return
    runs = vshape_map(plan.pp) if info.rank_map == "vshape" else loop_map(plan.pp, len(mapping))
    if tuple(mapping) != runs:
        stage = next(s for s, (a, b) in enumerate(zip(runs, mapping)) if a != b)
        yield diag("E409", f"schedule '{info.name}' runs stage {stage} on rank {runs[stage]}, but the plan's stage "
                   f"map puts it on rank {mapping[stage]}: the schedule's map is {_show_map(runs)}",
                   plan.stages.span_of("map") or plan.stages.span,
                   notes=[Note(f"schedule '{info.name}' chosen here", plan.schedule.span)]
                   if plan.schedule.span != plan.stages.span else [],
                   hint=("map = loop (or no `map`)" if info.rank_map == "loop" else "map = vshape")
                   + ", or a written schedule that runs the stages where the map puts them")


def _show_map(mapping) -> str:
    return mapping if isinstance(mapping, str) else "[" + ", ".join(map(str, mapping)) + "]"
