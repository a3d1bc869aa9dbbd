"""A schedule too long to draw block by block: the whole step as per-rank utilisation bars, and one
window of the steady state zoomed in, block by block, with a marker on the bars where it sits.

Contract: `draw_overview(schedule, simulation, p2p, title) -> DOT text` for `neato -n2`, used by
`schedule.draw_schedule` when the timeline would need more than `schedule.fits` allows. The bars
split the step into columns of a few points: each column's height is the rank's busy share then
(runs of equal columns are one box). The window holds about WINDOW_ACTIONS actions of a rank,
centred on the steady state (from the last rank's first action to the first rank to finish).
"""
from __future__ import annotations

from plandsl.render.dot import FONT, Graph, inches, pos, spline
from plandsl.render.schedule_timeline import (BLOCK, FILLS, LABEL_SIZE, LEFT, LINE_WIDTH, _header,
                                     _block, _path_edges, action_text, blocks_of, chunk_count, chunk_fills,
                                     critical_path)
from plandsl.render.timeline import (FIXED_GRAPH, TimeAxis, draw_time_axis, seconds_text, text_node, tick_step,
                                     time_unit)
from plandsl.schedules.program import Schedule
from plandsl.schedules.simulate import Simulation

WINDOW_ACTIONS = 32   # actions of a rank in the zoomed window: about 30 pt each, 3-digit numbers fit
COLUMN = 4.0          # points of step per utilisation column
BUSY, IDLE, MARK = "#5b6f86", "#ececec", "#222222"
MAX_ZOOMED = 16       # ranks drawn in the window, as the memory view's panels
QUANTUM = 10          # busy shares drawn to 1/10 at most (a point a level), so steady runs merge into one box


def steady_window(simulation: Simulation, ranks: int, per_rank: int) -> tuple[float, float]:
    """(start, end) of the zoomed window: WINDOW_ACTIONS of an average rank's actions long, centred on
    the steady state (every rank has started, none has finished), inside the step."""
    makespan = simulation.makespan
    firsts, lasts = [makespan] * ranks, [0.0] * ranks
    for event in simulation.events:
        firsts[event.rank] = min(firsts[event.rank], event.start)
        lasts[event.rank] = max(lasts[event.rank], event.end)
    start, end = max(firsts), min(lasts)
    centre = (start + end) / 2 if end > start else makespan / 2
    length = min(makespan, makespan * WINDOW_ACTIONS / max(1, per_rank))
    begin = min(max(0.0, centre - length / 2), makespan - length)
    return begin, begin + length


def utilisation(simulation: Simulation, ranks: int, columns: int) -> list[list[float]]:
    """Per rank, its busy share of each of `columns` equal slices of the step."""
    width = simulation.makespan / columns if simulation.makespan > 0 else 1.0
    busy = [[0.0] * columns for _ in range(ranks)]
    for event in simulation.events:
        row, start, end = busy[event.rank], event.start, event.end
        column = min(columns - 1, int(start / width))
        while start < end and column < columns:
            stop = min(end, (column + 1) * width)
            row[column] += stop - start
            start, column = stop, column + 1
    return [[min(1.0, value / width) for value in row] for row in busy]


def draw_overview(schedule: Schedule, simulation: Simulation, p2p: float = 0.0, title: str = "") -> str:
    ranks, makespan = schedule.ranks, simulation.makespan
    per_rank = max((len(row) for row in schedule.actions), default=1)
    begin, end = steady_window(simulation, ranks, per_rank)
    zoom = TimeAxis(end - begin, LEFT, LINE_WIDTH, start=begin)
    whole = TimeAxis(makespan, LEFT, LINE_WIDTH)
    row = 20.0                                       # the zoomed window's rows, as the full timeline's
    bar = max(4.0, min(14.0, 240.0 / ranks))         # the utilisation bars' rows
    shown = zoomed_ranks(ranks)
    path = critical_path(schedule, simulation, p2p)
    graph = Graph("schedule", comment=f"plandsl render --view schedule: {title}\nlay out with: neato -n2",
                  graph=FIXED_GRAPH, node={"shape": "box", "fixedsize": True, "style": "filled", "label": "",
                                           "fontname": FONT, "fontsize": LABEL_SIZE, "penwidth": 0.4,
                                           "color": "white", "height": inches(BLOCK)},
                  edge={"arrowsize": 0.4})
    zoom_bottom = 46.0
    zoom_top = zoom_bottom + (len(shown) + (len(shown) < ranks)) * row
    bars_bottom = zoom_top + 76.0
    bars_top = bars_bottom + ranks * bar
    columns = max(1, round(LINE_WIDTH / COLUMN))
    subtitle = (f"top: each rank's busy share over the whole step ({seconds_text(makespan / columns)} columns), "
                f"the box marks the window drawn below · below: {seconds_text(begin)} to {seconds_text(end)} "
                f"of the steady state, action by action"
                + (f", ranks {shown[MAX_ZOOMED - 5] + 1}..{shown[-4] - 1} left out" if len(shown) < ranks else ""))
    _header(graph, schedule, simulation, path, LEFT, bars_top + 22, title, LINE_WIDTH, subtitle)
    _bars(graph, simulation, ranks, whole, bars_bottom, bar, columns)
    _marker(graph, whole, zoom, begin, end, bars_bottom, bars_top, zoom_top)
    _zoomed(graph, schedule, simulation, zoom, zoom_bottom, row, path, shown)
    return graph.source()


def zoomed_ranks(ranks: int) -> list[int]:
    """The ranks the window draws: every one up to MAX_ZOOMED, else the first 12 and the last 4."""
    return list(range(ranks)) if ranks <= MAX_ZOOMED else list(range(MAX_ZOOMED - 4)) + list(range(ranks - 4, ranks))


def _rank_label_every(height: float) -> int:
    """Label every rank when rows are 8 pt or more, else every n-th so labels (7 pt) stay 8 pt apart."""
    return max(1, -(-8 // int(max(1.0, height))))


def _bars(graph: Graph, simulation: Simulation, ranks: int, axis: TimeAxis, bottom: float, height: float,
          columns: int) -> None:
    """Per rank a grey row over the step; on it, columns as high as the rank's busy share there."""
    draw_time_axis(graph, axis, bottom + ranks * height, bottom - 4, step=tick_step(axis.span), prefix="u",
                   grid=False)
    shares = utilisation(simulation, ranks, columns)
    width = axis.width / columns
    every = _rank_label_every(height)
    levels = max(2, min(QUANTUM, int(height - 1)))
    unit = time_unit(axis.span)
    for rank in range(ranks):
        y = bottom + (ranks - 1 - rank) * height + height / 2
        stats = simulation.ranks[rank]
        busy = stats.busy / simulation.makespan if simulation.makespan else 0.0
        graph.node(f"urow{rank}", pos=pos(axis.left + axis.width / 2, y), width=inches(axis.width),
                   height=inches(height - 1), fillcolor=IDLE, color=IDLE, label="",
                   tooltip=f"rank {rank}: busy {busy:.1%} of the step ({seconds_text(stats.busy)}), "
                           f"idle {seconds_text(stats.idle)}")
        if (rank % every == 0 and ranks - 1 - rank >= every) or rank == ranks - 1:  # the last, never crowded
            text_node(graph, f"urank{rank}", axis.left - 6, y, f"rank {rank}", size=9.0 if every == 1 else 7.0,
                      align="r")
            text_node(graph, f"ubusy{rank}", axis.left + axis.width + 6, y, f"busy {busy:.0%}",
                      size=8.0 if every == 1 else 7.0, align="l")
        quantised = [round(share * levels) for share in shares[rank]]
        column = 0
        while column < columns:
            level, run = quantised[column], column
            while run + 1 < columns and quantised[run + 1] == level:
                run += 1
            if level:
                x0, x1 = axis.left + column * width, axis.left + (run + 1) * width
                tall = (height - 1) * level / levels
                graph.node(f"u{rank}_{column}", pos=pos((x0 + x1) / 2, y - (height - 1) / 2 + tall / 2),
                           width=inches(x1 - x0), height=inches(tall), fillcolor=BUSY, color=BUSY, penwidth=0,
                           tooltip=f"rank {rank} · {seconds_text(column * axis.span / columns, unit)}-"
                                   f"{seconds_text((run + 1) * axis.span / columns, unit)}: busy {level * 100 // levels}%")
            column = run + 1


def _marker(graph: Graph, whole: TimeAxis, zoom: TimeAxis, begin: float, end: float, bottom: float, top: float,
            zoom_top: float) -> None:
    """A box on the bars around the window's time, and two lines from it to the window's corners."""
    x0, x1 = whole.x(begin), whole.x(end)
    graph.node("window", pos=pos((x0 + x1) / 2, (bottom + top) / 2), width=inches(max(x1 - x0, 2.0)),
               height=inches(top - bottom + 4), style="solid", color=MARK, penwidth=1.4, label="",
               tooltip=f"the window drawn below: {seconds_text(begin)} to {seconds_text(end)}")
    for side, (upper, lower) in enumerate(((x0, zoom.left), (x1, zoom.left + zoom.width))):
        start, stop = (upper, bottom - 30), (lower, zoom_top + 2)
        graph.node(f"window{side}_a", pos=pos(*start), shape="point", width=0, height=0, style="invis")
        graph.node(f"window{side}_b", pos=pos(*stop), shape="point", width=0, height=0, style="invis")
        graph.edge(f"window{side}_a", f"window{side}_b", pos=spline([start, (lower, bottom - 48), stop]),
                   dir="none", color="#888888", style="dashed", penwidth=0.8)


def _zoomed(graph: Graph, schedule: Schedule, simulation: Simulation, axis: TimeAxis, bottom: float, row: float,
            path: list[int], shown: list[int]) -> None:
    """The window block by block, as the full timeline draws them, blocks cut at its edges; of many
    ranks the `shown` ones, a row saying how many are left out between them."""
    ranks = schedule.ranks
    slots = len(shown) + (len(shown) < ranks)
    step = tick_step(axis.span)  # the unit of the window's end: 10.5 s, not 1.05e+04 ms
    draw_time_axis(graph, axis, bottom + slots * row, bottom - 4, step=step, prefix="z",
                   unit=time_unit(max(step * 5, axis.start + axis.span)))
    ys: list[float | None] = [None] * ranks
    for slot, rank in enumerate(shown):
        slot += slot >= MAX_ZOOMED - 4 and len(shown) < ranks  # past the row that says what is left out
        ys[rank] = bottom + (slots - 1 - slot) * row + row / 2
        graph.node(f"zrow{rank}", pos=pos(axis.left + axis.width / 2, ys[rank]), width=inches(axis.width),
                   height=inches(row - 3), fillcolor=IDLE, color=IDLE, label="")
        text_node(graph, f"zrank{rank}", axis.left - 6, ys[rank], f"rank {rank}", size=9, align="r")
    if len(shown) < ranks:
        left_out = shown[-4] - shown[MAX_ZOOMED - 5] - 1
        text_node(graph, "zgap", axis.left + axis.width / 2, bottom + (slots - MAX_ZOOMED + 3.5) * row,
                  f"... ranks {shown[MAX_ZOOMED - 5] + 1}..{shown[-4] - 1} ({left_out}) not drawn ...", size=9)
    lines = _Window(axis, ys)
    chunks = chunk_count(schedule)
    fills = {kind: chunk_fills(kind, chunks) for kind in FILLS}
    rows = blocks_of(schedule, simulation, set(path), axis, window=(axis.start, axis.start + axis.span))
    starts: dict[int, tuple[int, float, float]] = {}
    ends: dict[int, tuple[int, float, float]] = {}
    for rank, blocks in enumerate(rows):
        if ys[rank] is None:
            continue
        for number, block in enumerate(blocks):
            _block(graph, f"b{rank}_{number}", block, simulation.events, lines, fills,
                   action_text(schedule, simulation.events, block, chunks))
            if block.start >= axis.start:
                starts[block.first] = (0, axis.x(block.start), ys[rank])
            if block.end <= axis.start + axis.span:
                ends[block.last] = (0, axis.x(block.end), ys[rank])
    _path_edges(graph, simulation, path, starts, ends)


class _Window:
    """One line of timeline for `_block`: the window's axis and its rows."""

    def __init__(self, axis: TimeAxis, ys: list[float | None]) -> None:
        self.axes, self.row_y = [axis], [ys]

    def line_of(self, seconds: float) -> int:
        return 0
