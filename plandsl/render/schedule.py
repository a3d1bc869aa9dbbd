"""Plan -> its pipeline schedule as a picture: the whole timeline action by action when it reads on one
screen (`schedule_timeline`), else an overview (`schedule_overview`): per-rank utilisation over the step
and one zoomed window of the steady state, marked on it.

Contract: `render_schedule(plan) -> DOT text` for `neato -n2`; `NotApplicable` for a plan without a
pipeline. `simulated` is the simulation every time-based view draws (memory too).
"""
from __future__ import annotations

import math

from plandsl import ir
from plandsl.render.dot import NotApplicable
from plandsl.render.schedule_overview import draw_overview
from plandsl.render.timeline import seconds_text
from plandsl.render.schedule_timeline import (FILLS, LINE_WIDTH, chunk_fills, critical_path, draw_timeline)
from plandsl.schedules.program import Schedule
from plandsl.schedules.simulate import Simulation
from plandsl.cost.pipeline import estimate_stage_costs
from plandsl.ir.placement import assign_stages
from plandsl.cost.simulation import simulate_plan, simulate_replicas
from plandsl.ir import shares as batch

ENGINE = ("neato", "-n2")
__all__ = ["ENGINE", "FILLS", "chunk_fills", "critical_path", "draw_schedule", "fits", "render_schedule",
           "replicas_title", "simulated"]


def simulated(plan: ir.Plan) -> tuple[Schedule, Simulation, float]:
    """(schedule, simulation, seconds per stage-to-stage transfer); NotApplicable without a pipeline. With
    `batch_shares`: the slowest replica's, its own microbatches on its own devices (`slowest_replica`)."""
    if plan.stages is None or plan.schedule is None:
        raise NotApplicable(f"no pipeline in this plan: '{plan.name}' has no stages over a pipeline axis, "
                            "so it has no schedule")
    if batch.uneven(plan):
        slowest = simulate_replicas(plan, every_action=True)[0]
        return slowest.schedule, slowest.simulation, slowest.p2p
    schedule, simulation = simulate_plan(plan, every_action=True)
    assignment, _ = assign_stages(plan)
    return schedule, simulation, estimate_stage_costs(plan, assignment).p2p


def replicas_title(plan: ir.Plan) -> str:
    """`batch_shares`: which replica a time-based view draws (the slowest, whose makespan sets the step) and
    how long the fastest one's is; '' without shares."""
    if not batch.uneven(plan) or plan.stages is None or plan.schedule is None:
        return ""
    replicas = simulate_replicas(plan)
    slowest, fastest = replicas[0], replicas[-1]

    def what(replica) -> str:
        kinds = ", ".join(dict.fromkeys(replica.devices))
        return f"{replica.microbatches} microbatch(es) on {kinds}, {seconds_text(replica.simulation.makespan)}"
    return (f" · drawn: {slowest.name()}, the slowest replica ({what(slowest)})"
            + (f" · the fastest: {fastest.name()} ({what(fastest)})" if len(replicas) > 1 else ""))


def render_schedule(plan: ir.Plan) -> str:
    schedule, simulation, p2p = simulated(plan)
    return draw_schedule(schedule, simulation, p2p, title=f"plan {plan.name}{replicas_title(plan)}")


def fits(ranks: int, per_rank: int) -> bool:
    """Whether the whole timeline, block by block, reads on one screen: at most 4 wrapped lines and 24
    rows of ranks in all (`layout_for`'s 14 pt per action)."""
    lines = math.ceil(max(720.0, per_rank * 14.0) / LINE_WIDTH - 1e-9)
    return lines <= 4 and lines * ranks <= 24


def draw_schedule(schedule: Schedule, simulation: Simulation, p2p: float = 0.0, title: str = "") -> str:
    """The simulated schedule as DOT text (for `neato -n2`): the whole timeline when it `fits`, else an
    overview (`schedule_overview`: utilisation bars over the step and a zoomed window of its steady state)."""
    per_rank = max((len(row) for row in schedule.actions), default=1)
    if not fits(schedule.ranks, per_rank):
        return draw_overview(schedule, simulation, p2p, title)
    return draw_timeline(schedule, simulation, p2p, title)
