"""The schedule drawn action by action: per rank, F/B/I/W blocks as long as the simulator says,
microbatch numbers inside, idle time (bubbles) grey, the critical path outlined in red; colours and key.

Contract: `draw_timeline(schedule, simulation, p2p, title) -> DOT text` for `neato -n2` (fixed
positions, so thousands of blocks lay out in no time), the whole step wrapped like text; the pieces
(`blocks_of`, `_block`, `_header`, `chunk_fills`) also draw `schedule_overview`'s zoomed window.
`critical_path` walks back from the last action to finish through whatever made each action start.
"""
from __future__ import annotations

import colorsys
import math
from dataclasses import dataclass

from plandsl.render.dot import FONT, Graph, inches, pos, spline, text_width
from plandsl.render.timeline import (FIXED_GRAPH, TimeAxis, draw_time_axis, seconds_text, text_node, tick_step,
                                     time_unit)
from plandsl.schedules.program import Kind, Schedule
from plandsl.schedules.simulate import BUBBLE_DEFINITION, Event, Simulation

# Per kind, fills for a rank's first, second, ... stage (virtual stages get other shades): these three
# up to three stage chunks, past that `chunk_fills` generates one shade per chunk.
FILLS = {Kind.F: ("#4c78a8", "#9ecae9", "#2f4b7c"), Kind.B: ("#59a14f", "#a8d8a0", "#2e6b27"),
         Kind.I: ("#e49444", "#ffc999", "#a35a12"), Kind.W: ("#b07aa1", "#d8b5d0", "#6f4a67")}
DARK = {"#4c78a8", "#2f4b7c", "#59a14f", "#2e6b27", "#a35a12", "#b07aa1", "#6f4a67"}  # white text on these
HUES = {Kind.F: 0.59, Kind.B: 0.31, Kind.I: 0.08, Kind.W: 0.86}  # the hues of FILLS, for generated shades
NAMES = {Kind.F: "forward", Kind.B: "backward", Kind.I: "input grad", Kind.W: "weight grad"}
CRITICAL = "#d62728"
# LINE_WIDTH: a wrapped line, with the rank names and idle shares, fits a 1600-pixel page at 100%
LEFT, ROW, BLOCK, BOTTOM, LINE_GAP, LINE_WIDTH = 70.0, 20.0, 15.0, 46.0, 46.0, 1000.0
LABEL_SIZE = 7.0


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


def chunk_count(schedule: Schedule) -> int:
    """How many stage chunks a rank holds at most (the schedule's virtual stages)."""
    return max([max(chunks.values(), default=0) + 1 for chunks in _chunks(schedule)] + [max(1, schedule.virtual)])


def chunk_fills(kind: Kind, chunks: int) -> tuple[str, ...]:
    """One fill per stage chunk for actions of `kind`: FILLS up to three chunks; past that, shades of the
    kind's hue from dark to light (lightness 0.28 to 0.82, the hue drifting a little), all different."""
    if chunks <= len(FILLS[kind]):
        return FILLS[kind][:max(1, chunks)]
    out = []
    for chunk in range(chunks):
        share = chunk / (chunks - 1)
        red, green, blue = colorsys.hls_to_rgb((HUES[kind] + 0.06 * (share - 0.5)) % 1.0, 0.28 + 0.54 * share, 0.5)
        out.append(f"#{round(red * 255):02x}{round(green * 255):02x}{round(blue * 255):02x}")
    return tuple(out)


def is_dark(fill: str) -> bool:
    """Whether white text reads better than black on `fill`: DARK's, and generated shades of luminance
    under 0.45."""
    if fill in DARK or any(fill in fills for fills in FILLS.values()):
        return fill in DARK
    red, green, blue = (int(fill[i:i + 2], 16) / 255 for i in (1, 3, 5))
    return 0.2126 * red + 0.7152 * green + 0.0722 * blue < 0.45


def blocks_of(schedule: Schedule, simulation: Simulation, critical: set[int], axis: TimeAxis,
              window: tuple[float, float] | None = None) -> list[list[Block]]:
    """Per rank, its blocks in time order (of the actions that overlap `window`, when given); a run of
    back-to-back actions of one kind and stage chunk, each too thin for its number, is collapsed into one
    block."""
    chunks = _chunks(schedule)
    rows: list[list[Block]] = [[] for _ in range(schedule.ranks)]
    tolerance = 1e-9 * max(1.0, simulation.makespan)
    for index, event in enumerate(simulation.events):
        if window is not None and (event.end <= window[0] or event.start >= window[1]):
            continue
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


def draw_timeline(schedule: Schedule, simulation: Simulation, p2p: float = 0.0, title: str = "") -> str:
    """The whole timeline of a simulated schedule, block by block, wrapped like text."""
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
    chunks = chunk_count(schedule)
    fills = {kind: chunk_fills(kind, chunks) for kind in FILLS}
    for rank, row in enumerate(rows):
        for number, block in enumerate(row):
            _block(graph, f"b{rank}_{number}", block, simulation.events, lines, fills,
                   action_text(schedule, simulation.events, block, chunks))
            first_line, last_line = lines.line_of(block.start), lines.line_of(block.end)
            starts[block.first] = (first_line, lines.axes[first_line].x(block.start), lines.row_y[first_line][rank])
            ends[block.last] = (last_line, lines.axes[last_line].x(block.end), lines.row_y[last_line][rank])
    _path_edges(graph, simulation, path, starts, ends)
    return graph.source()


def action_text(schedule: Schedule, events: tuple[Event, ...], block: Block, chunks: int) -> str:
    """A block's hover text for people: `rank 2 · stage 5 (chunk 1 of 5) · forward · microbatch 7 ·
    1.204-1.246 s (42 ms)`; a collapsed run names its microbatches `0-14`."""
    first, last = events[block.first].action, events[block.last].action
    stage = f"stage {first.stage}" if first.stage == last.stage else f"stages {first.stage}-{last.stage}"
    if chunks > 1:
        stage += f" (chunk {block.chunk} of {chunks})"
    what = f"microbatch {first.microbatch}" if block.count == 1 else \
        f"{block.count} microbatches {first.microbatch}-{last.microbatch}"
    unit = time_unit(max(block.end, 1e-12))
    return (f"rank {block.rank} · {stage} · {NAMES[block.kind]} · {what} · {seconds_text(block.start, unit)}-"
            f"{seconds_text(block.end, unit)} ({seconds_text(block.end - block.start)})")


def _block(graph: Graph, node_id: str, block: Block, events: tuple[Event, ...], layout: _Lines,
           fills: dict[Kind, tuple[str, ...]], tip: str) -> None:
    """The block, cut where the timeline wraps; each piece labelled if its number fits."""
    palette = fills[block.kind]
    fill = palette[block.chunk % len(palette)]
    first, last = events[block.first].action, events[block.last].action
    label = str(first.microbatch) if block.count == 1 else f"{first.microbatch}-{last.microbatch}"
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
        if shown and is_dark(fill):
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


def wrap_at_dots(text: str, width: int) -> list[str]:
    """`text` in lines of at most `width` characters, broken after a ` · `."""
    lines = [""]
    for part in text.split(" · "):
        if lines[-1] and len(lines[-1]) + 3 + len(part) > width:
            lines.append("")
        lines[-1] += (" · " if lines[-1] else "") + part
    return lines


def _header(graph: Graph, schedule: Schedule, simulation: Simulation, path: list[int], left: float,
            top: float, title: str, width: float, subtitle: str | None = None) -> float:
    """Title and key over the timeline; the key wraps into rows no wider than the timeline and names every
    stage chunk of every kind (`forward, stage chunk: 0 1 2 3 4`, a swatch each). Returns the top."""
    head = (f"{title + ' · ' if title else ''}schedule {schedule.name}: {schedule.ranks} ranks, "
            f"{schedule.stages} stages, {schedule.microbatches} microbatches · makespan "
            f"{seconds_text(simulation.makespan)} · bubble {simulation.bubble_fraction:.1%} ({BUBBLE_DEFINITION}) · critical path "
            f"{len(path)} actions")
    if simulation.deadlock is not None:
        head += f" · DEADLOCK: {simulation.deadlock}"
    kinds = sorted({e.action.kind for e in simulation.events}, key=lambda k: "FBIW".index(k.value))
    chunks = chunk_count(schedule)
    items = []  # (width, [(x offset, id, text or None, node attributes)]): a key entry, kept on one row
    for kind in kinds:
        fills = chunk_fills(kind, chunks)
        if chunks == 1:
            items.append((28 + text_width(NAMES[kind], 8), [(0.0, f"key_{kind.value}0", NAMES[kind],
                                                              {"fillcolor": fills[0], "tooltip": NAMES[kind]})]))
            continue
        name = f"{NAMES[kind]}, stage chunk"
        parts, x = [], text_width(name, 8) + 8
        parts.append((0.0, f"key_{kind.value}_name", name, None))
        for chunk, fill in enumerate(fills):
            attrs = {"fillcolor": fill, "label": str(chunk), "width": inches(16), "height": inches(11),
                     "fontsize": 7, "tooltip": f"{NAMES[kind]}, stage chunk {chunk} of {chunks}"}
            if is_dark(fill):
                attrs["fontcolor"] = "white"
            parts.append((x, f"key_{kind.value}{chunk}", None, attrs))
            x += 18
        items.append((x + 16, parts))
    items.append((28 + text_width("idle", 8), [(0.0, "key_idle", "idle",
                                                {"fillcolor": "#ececec", "color": "#ececec", "tooltip": "idle"})]))
    text = "critical path; numbers: microbatch"
    items.append((28 + text_width(text, 8), [(0.0, "key_critical", text, {"fillcolor": "white", "color": CRITICAL,
                                                                          "penwidth": 1.6, "tooltip": text})]))
    rows: list[list[tuple[float, list]]] = [[]]
    x = left
    for advance, parts in items:
        if rows[-1] and x + advance - 12 > left + max(width, 600.0):
            rows.append([])
            x = left
        rows[-1].append((x, parts))
        x += advance
    lines = [line for text in [head] + ([subtitle] if subtitle else []) for line in wrap_at_dots(text, 130)]
    title_y = top + 20 + 14 * len(rows)
    text_node(graph, "title", left, title_y + 7 * (len(lines) - 1), "\\n".join(lines), size=11, align="l")
    for number, row in enumerate(rows):
        y = top + 14 * (len(rows) - number)
        for x, parts in row:
            for offset, node_id, name, attrs in parts:
                if attrs is not None:
                    attrs = {"width": inches(12), "height": inches(10), "label": "", **attrs}
                    graph.node(node_id, pos=pos(x + offset + float(attrs["width"]) * 36, y), **attrs)
                    if name:
                        text_node(graph, f"{node_id}_text", x + offset + 16, y, name, size=8, align="l")
                else:
                    text_node(graph, node_id, x + offset, y, name, size=8, align="l")
    return title_y + 14 * len(lines)
