"""Plan -> its pipeline schedule as a timeline: per rank, F/B/I/W blocks as long as the simulator
says, microbatch numbers inside, idle time (bubbles) grey, the critical path outlined in red.

Contract: `render_schedule(plan) -> DOT text` for `neato -n2` (fixed positions, so thousands of
blocks lay out in no time); `NotApplicable` for a plan without a pipeline. `critical_path`
walks back from the last action to finish through whatever made each action start when it did.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from plandsl import ir
from plandsl.render.dot import FONT, Graph, NotApplicable, inches, pos, spline, text_width
from plandsl.render.timeline import FIXED_GRAPH, TimeAxis, draw_time_axis, seconds_text, text_node, tick_step
from plandsl.schedules.program import Kind, Schedule
from plandsl.schedules.simulate import BUBBLE_DEFINITION, Event, Simulation
from plandsl.cost.pipeline import estimate_stage_costs
from plandsl.ir.placement import assign_stages
from plandsl.cost.simulation import simulate_plan

ENGINE = ("neato", "-n2")
# Per kind, fills for a rank's first, second, ... stage (virtual stages get lighter shades).
FILLS = {Kind.F: ("#4c78a8", "#9ecae9", "#2f4b7c"), Kind.B: ("#59a14f", "#a8d8a0", "#2e6b27"),
         Kind.I: ("#e49444", "#ffc999", "#a35a12"), Kind.W: ("#b07aa1", "#d8b5d0", "#6f4a67")}
DARK = {"#4c78a8", "#2f4b7c", "#59a14f", "#2e6b27", "#a35a12", "#b07aa1", "#6f4a67"}
NAMES = {Kind.F: "forward", Kind.B: "backward", Kind.I: "input grad", Kind.W: "weight grad"}
CRITICAL = "#d62728"
# LINE_WIDTH: a wrapped line, with the rank names and idle shares, fits a 1600-pixel page at 100%
LEFT, ROW, BLOCK, BOTTOM, LINE_GAP, LINE_WIDTH = 70.0, 20.0, 15.0, 46.0, 46.0, 1000.0
LABEL_SIZE = 7.0


def simulated(plan: ir.Plan) -> tuple[Schedule, Simulation, float]:
    """(schedule, simulation, seconds per stage-to-stage transfer); NotApplicable without a pipeline."""
    if plan.stages is None or plan.schedule is None:
        raise NotApplicable(f"no pipeline in this plan: '{plan.name}' has no stages over a pipeline axis, "
                            "so it has no schedule (try --view mesh or --view placement)")
    schedule, simulation = simulate_plan(plan, every_action=True)
    assignment, _ = assign_stages(plan)
    return schedule, simulation, estimate_stage_costs(plan, assignment).p2p


def critical_path(schedule: Schedule, simulation: Simulation, p2p: float = 0.0) -> list[int]:
    """Indices into `simulation.events` of the critical path, first action first.

    From the last action to finish, step back to what determined each start: the rank's previous
    action (the rank was busy) or the producer of its input (plus `p2p` when on another rank):
    F(s, m) needs F(s-1, m); B/I(s, m) need B/I(s+1, m) and F(s, m); W(s, m) needs I(s, m).
    On a tie the input wins: it is the dependency that crosses ranks."""
    events = simulation.events
    if not events:
        return []
    made = {(e.action.stage, e.action.kind, e.action.microbatch): i for i, e in enumerate(events)}
    previous: dict[int, int] = {}
    last_on_rank: dict[int, int] = {}
    for index, event in enumerate(events):
        if event.rank in last_on_rank:
            previous[index] = last_on_rank[event.rank]
        last_on_rank[event.rank] = index
    tolerance = 1e-9 * max(1.0, simulation.makespan)
    last_stage = schedule.stages - 1
    current = max(range(len(events)), key=lambda i: (events[i].end, -i))
    path = [current]
    while events[current].start > tolerance:
        event = events[current]
        stage, kind, microbatch = event.action
        inputs = []
        if kind is Kind.F and stage > 0:
            inputs.append(made.get((stage - 1, Kind.F, microbatch)))
        elif kind in (Kind.B, Kind.I):
            if stage < last_stage:
                grad = made.get((stage + 1, Kind.B, microbatch), made.get((stage + 1, Kind.I, microbatch)))
                inputs.append(grad)
            inputs.append(made.get((stage, Kind.F, microbatch)))
        elif kind is Kind.W:
            inputs.append(made.get((stage, Kind.I, microbatch)))
        candidates = []
        for found in inputs:
            if found is not None:
                other = events[found]
                candidates.append((other.end + (p2p if other.rank != event.rank else 0.0), 1, found))
        if current in previous:
            candidates.append((events[previous[current]].end, 0, previous[current]))
        if not candidates:
            break
        ready, _, chosen = max(candidates)
        if ready < event.start - tolerance - abs(p2p):
            break  # nothing explains the start (cannot happen for a simulated schedule)
        current = chosen
        path.append(current)
    path.reverse()
    return path


@dataclass(frozen=True, slots=True)
class Block:
    """One drawn block: an action, or a run of back-to-back actions of one kind too thin to label."""

    rank: int
    kind: Kind
    chunk: int
    start: float
    end: float
    first: int  # event indices
    last: int
    count: int
    critical: bool
    thin: bool


def _chunks(schedule: Schedule) -> list[dict[int, int]]:
    """Per pipeline: stage -> its position among its rank's stages (0 for the first)."""
    out = []
    for mapping in schedule.stage_to_rank:
        seen: dict[int, int] = {}
        chunk = {}
        for stage, rank in enumerate(mapping):
            chunk[stage] = seen.get(rank, 0)
            seen[rank] = chunk[stage] + 1
        out.append(chunk)
    return out


def blocks_of(schedule: Schedule, simulation: Simulation, critical: set[int], axis: TimeAxis) -> list[list[Block]]:
    """Per rank, its blocks in time order; a run of back-to-back actions of one kind and stage
    chunk, each too thin for its number, is collapsed into one block."""
    chunks = _chunks(schedule)
    rows: list[list[Block]] = [[] for _ in range(schedule.ranks)]
    tolerance = 1e-9 * max(1.0, simulation.makespan)
    for index, event in enumerate(simulation.events):
        action = event.action
        chunk = chunks[schedule.pipeline_of(action.microbatch)].get(action.stage, 0)
        row = rows[event.rank]
        thin = axis.x(event.end) - axis.x(event.start) < _label_width(str(action.microbatch))
        if row and thin:
            prior = row[-1]
            if prior.thin and prior.kind is action.kind and prior.chunk == chunk and \
                    abs(prior.end - event.start) <= tolerance:
                row[-1] = Block(event.rank, action.kind, chunk, prior.start, event.end, prior.first, index,
                                prior.count + 1, prior.critical or index in critical, True)
                continue
        row.append(Block(event.rank, action.kind, chunk, event.start, event.end, index, index, 1,
                         index in critical, thin))
    return rows


def _label_width(text: str) -> float:
    return text_width(text, LABEL_SIZE) + 2


def render_schedule(plan: ir.Plan) -> str:
    schedule, simulation, p2p = simulated(plan)
    return draw_schedule(schedule, simulation, p2p, title=f"plan {plan.name}")


@dataclass(frozen=True, slots=True)
class Layout:
    """The timeline wrapped like text: `lines` lines of `width` points, each a slice of the step."""

    ranks: int
    lines: int
    width: float
    makespan: float

    @property
    def slice(self) -> float:
        return self.makespan / self.lines

    def line_height(self) -> float:
        return self.ranks * ROW + LINE_GAP

    def base(self, line: int) -> float:
        """y of line `line`'s time axis (line 0 is on top)."""
        return BOTTOM + (self.lines - 1 - line) * self.line_height()

    def row_y(self, line: int, rank: int) -> float:
        return self.base(line) + self.ranks * ROW - ROW * (rank + 0.5)

    def axis(self, line: int) -> TimeAxis:
        return TimeAxis(self.slice, LEFT, self.width, start=line * self.slice)

    def line_of(self, seconds: float) -> int:
        return min(self.lines - 1, max(0, int(seconds / self.slice))) if self.slice > 0 else 0


class _Lines:
    """A layout's per-line figures computed once (a picture asks for them ~10^5 times): the same numbers
    as `Layout.axis`, `Layout.row_y` and `Layout.line_of`."""

    def __init__(self, layout: Layout) -> None:
        self.axes = [layout.axis(line) for line in range(layout.lines)]
        self.row_y = [[layout.row_y(line, rank) for rank in range(layout.ranks)] for line in range(layout.lines)]
        self._slice, self._last = layout.slice, layout.lines - 1

    def line_of(self, seconds: float) -> int:
        return min(self._last, max(0, int(seconds / self._slice))) if self._slice > 0 else 0


def layout_for(ranks: int, per_rank: int, makespan: float) -> Layout:
    """About 14 pt per action, wrapped at LINE_WIDTH; at most ~128 rows of ranks in all."""
    total = min(max(720.0, per_rank * 14.0), 9600.0)
    width = min(total, LINE_WIDTH)
    lines = max(1, min(math.ceil(total / width - 1e-9), 128 // max(1, ranks)))
    return Layout(ranks, lines, width, makespan)


def draw_schedule(schedule: Schedule, simulation: Simulation, p2p: float = 0.0, title: str = "") -> str:
    """The timeline of a simulated schedule as DOT text (for `neato -n2`)."""
    per_rank = max((len(row) for row in schedule.actions), default=1)
    layout = layout_for(schedule.ranks, per_rank, simulation.makespan)
    scale = TimeAxis(simulation.makespan, LEFT, layout.width * layout.lines)  # for block widths only
    path = critical_path(schedule, simulation, p2p)
    rows = blocks_of(schedule, simulation, set(path), scale)
    graph = Graph("schedule", comment=f"plandsl render --view schedule: {title}\nlay out with: neato -n2",
                  graph=FIXED_GRAPH, node={"shape": "box", "fixedsize": True, "style": "filled", "label": "",
                                           "fontname": FONT, "fontsize": LABEL_SIZE, "penwidth": 0.4,
                                           "color": "white", "height": inches(BLOCK)},
                  edge={"arrowsize": 0.4})
    top = layout.base(0) + schedule.ranks * ROW
    _header(graph, schedule, simulation, path, LEFT, top, title, layout.width)
    step = tick_step(layout.slice, target=max(4, round(8 * layout.width / 1000)))
    for line in range(layout.lines):
        axis = layout.axis(line)
        base = layout.base(line)
        draw_time_axis(graph, axis, base + schedule.ranks * ROW, base - 4, step=step, prefix=f"t{line}_")
        for rank in range(schedule.ranks):
            y = layout.row_y(line, rank)
            graph.node(f"row{line}_{rank}", pos=pos(LEFT + layout.width / 2, y), width=inches(layout.width),
                       height=inches(ROW - 3), fillcolor="#ececec", color="#ececec", label="")
            text_node(graph, f"rank{line}_{rank}", LEFT - 6, y, f"rank {rank}", size=9, align="r")
            if line == 0:
                stats = simulation.ranks[rank]
                share = stats.idle / simulation.makespan if simulation.makespan else 0.0
                text_node(graph, f"idle{rank}", LEFT + layout.width + 6, y, f"idle {share:.0%}", size=8, align="l")
    ends: dict[int, tuple[int, float, float]] = {}    # event index -> (line, x, y) of its start / end
    starts: dict[int, tuple[int, float, float]] = {}
    lines = _Lines(layout)
    for rank, row in enumerate(rows):
        for number, block in enumerate(row):
            _block(graph, f"b{rank}_{number}", block, simulation.events, lines)
            first_line, last_line = lines.line_of(block.start), lines.line_of(block.end)
            starts[block.first] = (first_line, lines.axes[first_line].x(block.start), lines.row_y[first_line][rank])
            ends[block.last] = (last_line, lines.axes[last_line].x(block.end), lines.row_y[last_line][rank])
    _path_edges(graph, simulation, path, starts, ends)
    return graph.source()


def _block(graph: Graph, node_id: str, block: Block, events: tuple[Event, ...], layout: _Lines) -> None:
    """The block, cut where the timeline wraps; each piece labelled if its number fits."""
    fills = FILLS[block.kind]
    fill = fills[block.chunk % len(fills)]
    first, last = events[block.first].action, events[block.last].action
    if block.count == 1:
        label, tip = str(first.microbatch), str(first)
    else:
        label, tip = f"{first.microbatch}-{last.microbatch}", f"{first}..{last}"
    first_line, last_line = layout.line_of(block.start), layout.line_of(block.end)
    for line in range(first_line, last_line + 1):
        axis = layout.axes[line]
        x0 = axis.x(max(block.start, axis.start))
        x1 = axis.x(min(block.end, axis.start + axis.span))
        if x1 - x0 < 0.05 and line != first_line:
            continue
        shown = label if x1 - x0 >= _label_width(label) else None
        attrs: dict[str, object] = {"pos": pos((x0 + x1) / 2, layout.row_y[line][block.rank]),
                                    "width": inches(max(x1 - x0, 0.5)), "fillcolor": fill, "label": shown,
                                    "tooltip": tip}
        if fill in DARK and shown:
            attrs["fontcolor"] = "white"
        if block.critical:
            attrs.update(color=CRITICAL, penwidth=1.6)
        graph.node(node_id if line == first_line else f"{node_id}_{line}", **attrs)


def _path_edges(graph: Graph, simulation: Simulation, path: list[int], starts: dict, ends: dict) -> None:
    """Red arrows where the critical path changes rank: from the producer's end to the consumer's start."""
    events = simulation.events
    for number, (tail, head) in enumerate(zip(path, path[1:])):
        if events[tail].rank == events[head].rank or tail not in ends or head not in starts:
            continue
        tail_line, tail_x, tail_y = ends[tail]
        head_line, head_x, head_y = starts[head]
        if tail_line != head_line:
            continue
        offset = BLOCK / 2 if head_y < tail_y else -BLOCK / 2
        start, end = (tail_x, tail_y - offset), (head_x, head_y + offset)
        graph.node(f"cp{number}_a", pos=pos(*start), shape="point", width=0, height=0, style="invis", label="")
        graph.node(f"cp{number}_b", pos=pos(*end), shape="point", width=0, height=0, style="invis", label="")
        graph.edge(f"cp{number}_a", f"cp{number}_b", pos=spline([start, end], arrow=True), color=CRITICAL,
                   penwidth=1.0)


def _header(graph: Graph, schedule: Schedule, simulation: Simulation, path: list[int], left: float,
            top: float, title: str, width: float) -> None:
    """Title and key over the timeline; the key wraps into rows no wider than the timeline."""
    head = (f"{title + ' · ' if title else ''}schedule {schedule.name}: {schedule.ranks} ranks, "
            f"{schedule.stages} stages, {schedule.microbatches} microbatches · makespan "
            f"{seconds_text(simulation.makespan)} · bubble {simulation.bubble_fraction:.1%} ({BUBBLE_DEFINITION}) · critical path "
            f"{len(path)} actions")
    if simulation.deadlock is not None:
        head += f" · DEADLOCK: {simulation.deadlock}"
    kinds = sorted({e.action.kind for e in simulation.events}, key=lambda k: "FBIW".index(k.value))
    virtual = max(1, schedule.virtual)
    keys = []  # (id, text, node attributes)
    for kind in kinds:
        for chunk in range(min(virtual, len(FILLS[kind]))):
            keys.append((f"key_{kind.value}{chunk}", NAMES[kind] + (f" (stage chunk {chunk})" if virtual > 1 else ""),
                         {"fillcolor": FILLS[kind][chunk]}))
    keys.append(("key_idle", "idle", {"fillcolor": "#ececec", "color": "#ececec"}))
    keys.append(("key_critical", "critical path; numbers: microbatch",
                 {"fillcolor": "white", "color": CRITICAL, "penwidth": 1.6}))
    rows: list[list[tuple[float, tuple]]] = [[]]
    x = left
    for key in keys:
        advance = 28 + text_width(key[1], 8)
        if rows[-1] and x + advance - 12 > left + max(width, 600.0):
            rows.append([])
            x = left
        rows[-1].append((x, key))
        x += advance
    text_node(graph, "title", left, top + 20 + 14 * len(rows), head, size=11, align="l")
    for number, row in enumerate(rows):
        y = top + 14 * (len(rows) - number)
        for x, (node_id, name, attrs) in row:
            graph.node(node_id, pos=pos(x + 6, y), width=inches(12), height=inches(10), label="", **attrs)
            text_node(graph, f"{node_id}_text", x + 16, y, name, size=8, align="l")
