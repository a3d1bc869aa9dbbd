"""Plan -> memory per pipeline rank over one step: parameters, gradients and optimizer states as
constant bands, torch's pipeline stage's buffers as one more (`estimate`'s `pipeline` column, none on Megatron-LM's
pipeline), activations in flight as a stepped line from the simulator, capacity dashed.

Contract: `render_memory(plan) -> DOT text` for `neato -n2`; `NotApplicable` without a pipeline.
`memory_over_time` is the series: F(s, m) adds stage s's activation bytes when it starts, B frees
them when it ends; with a split backward I frees (1 - weight_grad_fraction) and W the rest, as
`schedules.simulate` counts them, so each line's top is the simulator's peak (which holds the states and the pipeline's
buffers, `cost.memory.torch_stage_bytes`, through the step as `MemoryEstimate.held` says).
"""
from __future__ import annotations

from dataclasses import dataclass

from plandsl import ir
from plandsl.render.dot import FONT, Graph, inches, pos, spline
from plandsl.cost.estimate import replica_devices
from plandsl.cost.simulation import simulate_replicas
from plandsl.ir import shares as batch
from plandsl.render.schedule import replicas_title, simulated
from plandsl.render.timeline import FIXED_GRAPH, TimeAxis, draw_time_axis, grid_line, text_node, tick_step, ticks
from plandsl.schedules.program import Kind
from plandsl.schedules.simulate import Simulation
from plandsl.lower.units import format_bytes
from plandsl.cost.memory import estimate_plan_memory
from plandsl.ir.placement import assign_stages, pipeline_rank_devices
from plandsl.cost.pipeline import estimate_stage_costs

ENGINE = ("neato", "-n2")
LEFT, WIDTH, PANEL, GAP, BOTTOM = 150.0, 900.0, 92.0, 22.0, 46.0
BANDS = (("parameters", "#a6c8e8"), ("gradients", "#ffc999"), ("optimizer", "#d8b5d0"), ("pipeline", "#b5dcb0"))
LINE, CAPACITY = "#222222", "#d62728"
MAX_PANELS = 16


@dataclass(frozen=True, slots=True)
class RankMemory:
    """One pipeline rank: its constant bytes, activation level over time, and device capacity."""

    rank: int
    params: float
    grads: float
    optimizer: float
    steps: tuple[tuple[float, float], ...]  # (time, activation bytes from then on), time-ordered
    capacity: float
    device: str
    pipeline: float = 0.0  # torch's pipeline stage's buffers (`MemoryEstimate.other`), held through the step

    @property
    def states(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def static(self) -> float:
        """What the rank holds through the step: its states and the pipeline's buffers."""
        return self.states + self.pipeline

    @property
    def peak(self) -> float:
        return self.static + max((level for _, level in self.steps), default=0.0)


def memory_over_time(plan: ir.Plan) -> tuple[list[RankMemory], Simulation]:
    """Per pipeline rank, memory over the simulated step; NotApplicable without a pipeline."""
    schedule, simulation, _ = simulated(plan)
    assignment, _ = assign_stages(plan)
    view, timed, held, devices = plan, None, False, pipeline_rank_devices(plan)
    if batch.uneven(plan):  # the slowest replica, as `simulated` draws it: its share, its own devices
        slowest = simulate_replicas(plan)[0]
        first = slowest.data_ranks[0]
        view, timed = batch.replica_plan(plan, slowest.share), list(replica_devices(plan)[first])
        held, devices = plan.data is not None, batch.replica_device_types(plan)[first]
    costs = estimate_stage_costs(view, assignment, timed, held)
    activation = costs.activation_bytes
    if len(activation) != schedule.stages:  # the checker's E404/E602/E603 make them equal: a plandsl bug (E108)
        raise RuntimeError(f"schedule '{schedule.name}' has {schedule.stages} stages but the plan places "
                           f"{len(activation)}: no activation sizes to draw memory with")
    share = costs.weight_grad_fraction
    release = {Kind.B: 1.0, Kind.I: 1.0 - share, Kind.W: share}
    changes: list[list[tuple[float, float]]] = [[] for _ in range(schedule.ranks)]
    for event in simulation.events:
        stage, kind = event.action.stage, event.action.kind
        if kind is Kind.F:
            changes[event.rank].append((event.start, activation[stage]))
        elif kind in release:
            changes[event.rank].append((event.end, -activation[stage] * release[kind]))
    estimates = estimate_plan_memory(view, assignment, held=held) or []
    ranks = []
    for rank in range(schedule.ranks):
        level, steps = 0.0, [(0.0, 0.0)]
        for time, delta in sorted(changes[rank]):  # at one instant, frees (negative) come first
            level = max(0.0, level + delta)
            if steps[-1][0] == time and len(steps) > 1:
                steps[-1] = (time, level)
            else:
                steps.append((time, level))
        estimate = estimates[rank] if rank < len(estimates) else None
        device = min(devices[rank], key=lambda d: d.memory) if rank < len(devices) and devices[rank] else None
        ranks.append(RankMemory(rank, estimate.params if estimate else 0.0, estimate.grads if estimate else 0.0,
                                estimate.optimizer if estimate else 0.0, tuple(steps),
                                device.memory if device else 0.0, device.name if device else "?",
                                estimate.other if estimate else 0.0))
    return ranks, simulation


def percent(share: float) -> str:
    """12%, 3.4%, 0.024%: two significant digits below 10%."""
    return f"{share:.0%}" if share >= 0.1 or share == 0 else f"{share * 100:.2g}%"


def _peak_envelope(steps: tuple[tuple[float, float], ...], axis: TimeAxis, makespan: float,
                   resolution: float = 2.0) -> list[tuple[float, float]]:
    """(x, level) corners of the stepped line; changes closer than `resolution` points merge,
    keeping the highest and lowest level between them, so no peak is lost."""
    points: list[tuple[float, float]] = []
    column, entry, high, low, last = None, 0.0, 0.0, 0.0, 0.0
    for time, level in steps:
        x = round(axis.x(time) / resolution) * resolution
        if x != column:
            if column is not None:
                points += [(column, entry), (column, high), (column, low), (column, last)]
            column, entry, high, low = x, last, max(last, level), min(last, level)
        high, low, last = max(high, level), min(low, level), level
    if column is not None:
        points += [(column, entry), (column, high), (column, low), (column, last)]
    points.append((axis.x(makespan), last))
    deduped: list[tuple[float, float]] = []
    for point in points:
        if not deduped or deduped[-1] != point:
            deduped.append(point)
    return deduped


def byte_axis(value: float) -> tuple[float, float, str, float]:
    """(axis top, tick step, unit, bytes per unit) for levels up to `value` bytes: the step 1, 2 or 5 x 10^k
    of the unit (GiB for 86.4 GiB: steps of 20 GiB), the top the first tick at or above `value`."""
    unit, factor = next(((u, f) for u, f in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))
                         if value >= f), ("B", 1))
    step = tick_step(value / factor, target=5) * factor
    return max(step, -(-value // step) * step), step, unit, factor


def tick_text(value: float, unit: str, factor: float) -> str:
    """`20 GiB`, `2.5 GiB`: a tick's label, no more digits than it needs."""
    return f"{value / factor:g} {unit}" if value else "0"


def render_memory(plan: ir.Plan) -> str:
    ranks, simulation = memory_over_time(plan)
    return draw_memory(ranks, simulation.makespan, title=f"plan {plan.name}{replicas_title(plan)}")


def draw_memory(ranks: list[RankMemory], makespan: float, title: str = "") -> str:
    shown = ranks if len(ranks) <= MAX_PANELS else ranks[:MAX_PANELS - 4] + ranks[-4:]
    peak = max((r.peak for r in ranks), default=0.0) or 1.0
    capacity = min((r.capacity for r in ranks if r.capacity), default=0.0)
    on_scale = 0 < capacity <= 4 * peak
    top_value, tick, unit, factor = byte_axis(max(peak, capacity if on_scale else 0.0) * 1.04)
    axis = TimeAxis(makespan, LEFT, WIDTH)
    graph = Graph("memory", comment=f"plandsl render --view memory: {title}\nlay out with: neato -n2",
                  graph={**FIXED_GRAPH, "outputorder": "nodesfirst"},
                  node={"shape": "box", "fixedsize": True, "style": "filled", "fontname": FONT, "fontsize": 8,
                        "penwidth": 0, "label": ""},
                  edge={"dir": "none"})
    panel = panel_height(len(shown))
    panels_top = BOTTOM + len(shown) * (panel + GAP)
    _header(graph, ranks, shown, panels_top, title, capacity, on_scale, peak)
    step = draw_time_axis(graph, axis, panels_top - GAP, BOTTOM - 4, grid=False)
    for slot, memory in enumerate(shown):
        base = BOTTOM + (len(shown) - 1 - slot) * (panel + GAP)
        _panel(graph, memory, axis, makespan, base, panel, top_value, on_scale, (tick, unit, factor))
        # grid lines above the bands only: through them they would strike out the bands' labels
        states = base + memory.static * panel / top_value
        for index, x in ticks(axis, step):
            grid_line(graph, f"grid{memory.rank}_{index}", x, states, base + panel)
    return graph.source()


def panel_height(panels: int) -> float:
    """A panel's height: PANEL for up to four, then lower, so eight ranks fit one screen (~640 pt of panels)."""
    return max(56.0, min(PANEL, 640.0 / max(1, panels) - GAP))


def _panel(graph: Graph, memory: RankMemory, axis: TimeAxis, makespan: float, base: float, panel: float,
           top_value: float, on_scale: bool, ticks_of: tuple[float, str, float]) -> None:
    rank = memory.rank
    scale = panel / top_value

    def y(level: float) -> float:
        return base + level * scale

    graph.node(f"frame{rank}", pos=pos(LEFT + WIDTH / 2, base + panel / 2), width=inches(WIDTH),
               height=inches(panel), style="solid", color="#bbbbbb", penwidth=0.6)
    bottom = 0.0
    for (name, fill), value in zip(BANDS, (memory.params, memory.grads, memory.optimizer, memory.pipeline)):
        height = value * scale
        if height >= 0.2:
            label = f"{name} {format_bytes(value)}" if height >= 10 else ""
            graph.node(f"{name}{rank}", pos=pos(LEFT + WIDTH / 2, y(bottom) + height / 2), width=inches(WIDTH),
                       height=inches(height), fillcolor=fill, label=label, tooltip=f"{name}: {format_bytes(value)}")
        bottom += value
    corners = _peak_envelope(memory.steps, axis, makespan)
    line = [(x, y(memory.static + level)) for x, level in corners]
    _line(graph, f"act{rank}", line, color=LINE, penwidth=1.2,
          tooltip=f"rank {rank}: states{' + pipeline buffers' if memory.pipeline else ''} + activations in flight, "
                  f"peak {format_bytes(memory.peak)}")
    if on_scale and memory.capacity:
        level = y(memory.capacity)
        _line(graph, f"cap{rank}", [(LEFT, level), (LEFT + WIDTH, level)], color=CAPACITY, style="dashed",
              penwidth=1.0, tooltip=f"capacity of {memory.device}: {format_bytes(memory.capacity)}")
        text_node(graph, f"cap{rank}_text", LEFT + WIDTH - 4, level + 6,
                  f"capacity {format_bytes(memory.capacity)} ({memory.device})", size=7, align="r",
                  fontcolor=CAPACITY)
    peak_text = f"peak {format_bytes(memory.peak)}"
    if memory.capacity:
        peak_text += f" = {percent(memory.peak / memory.capacity)}"
    text_node(graph, f"label{rank}", LEFT - 40, base + panel / 2 + 7, f"rank {rank}", size=10, align="r")
    text_node(graph, f"peak{rank}", LEFT - 40, base + panel / 2 - 7, peak_text, size=8, align="r")
    text_node(graph, f"static{rank}", LEFT - 40, base + panel / 2 - 19, f"states {format_bytes(memory.states)}",
              size=8, align="r")
    step, unit, factor = ticks_of
    count = round(top_value / step)
    every = 1 if panel / count >= 14 else 2  # labels 14 pt apart at least: 0, 40, 80 GiB on a low panel
    for number in range(count + 1):  # round levels: 0, 20 GiB, 40 GiB, ...
        level = y(number * step)
        _line(graph, f"ytick{rank}_{number}", [(LEFT - 3, level), (LEFT, level)], color="#888888", penwidth=0.6)
        if number % every == 0:
            text_node(graph, f"ylabel{rank}_{number}", LEFT - 5, level, tick_text(number * step, unit, factor),
                      size=7, align="r")


def _line(graph: Graph, name: str, points: list[tuple[float, float]], **attrs: object) -> None:
    """A polyline: an edge between two invisible points, its route given."""
    graph.node(f"{name}_a", pos=pos(*points[0]), shape="point", width=0, height=0, style="invis")
    graph.node(f"{name}_b", pos=pos(*points[-1]), shape="point", width=0, height=0, style="invis")
    graph.edge(f"{name}_a", f"{name}_b", pos=spline(points), **attrs)


def _header(graph: Graph, ranks: list[RankMemory], shown: list[RankMemory], top: float, title: str,
            capacity: float, on_scale: bool, peak: float) -> None:
    head = f"{title + ' · ' if title else ''}memory per device over one step, by pipeline rank"
    if len(shown) < len(ranks):
        head += f" (showing {len(shown)} of {len(ranks)} ranks: {shown[MAX_PANELS - 5].rank + 1}.." \
                f"{shown[-4].rank - 1} left out)"
    text_node(graph, "title", LEFT, top + 30, head, size=11, align="l")
    x = LEFT
    keys = [(name, fill, "filled") for name, fill in BANDS if name != "pipeline" or any(r.pipeline for r in ranks)] \
        + [("activations in flight (simulated)", LINE, "line")]
    if on_scale:
        keys.append(("device capacity", CAPACITY, "dashed"))
    for number, (name, colour, kind) in enumerate(keys):
        if kind == "filled":
            graph.node(f"key{number}", pos=pos(x + 6, top + 12), width=inches(12), height=inches(9),
                       fillcolor=colour)
        else:
            _line(graph, f"key{number}", [(x, top + 12), (x + 14, top + 12)], color=colour, penwidth=1.2,
                  style="dashed" if kind == "dashed" else None)
        text_node(graph, f"key{number}_text", x + 17, top + 12, name, size=8, align="l")
        x += 30 + len(name) * 8 * 0.6
    if capacity and not on_scale:
        text_node(graph, "offscale", x + 4, top + 12,
                  f"capacity {format_bytes(capacity)} is off the scale: the peak uses {percent(peak / capacity)} of it",
                  size=8, align="l", fontcolor=CAPACITY)
