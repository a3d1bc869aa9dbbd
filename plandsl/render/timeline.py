"""What the schedule and memory views share: a time axis over a step, drawn at fixed positions.

Both views are pictures with x = time, laid out by us and drawn by `neato -n2`; this module
maps seconds to points, picks round tick steps and draws the axis with its grid lines.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from plandsl.render.dot import FONT, Graph, inches, num, pos, spline

ENGINE = ("neato", "-n2")  # positions are ours; neato only draws them
FIXED_GRAPH = {"layout": "neato", "inputscale": 72, "outputorder": "edgesfirst", "bgcolor": "white",
               "fontname": FONT, "pad": 0.2}


@dataclass(frozen=True, slots=True)
class TimeAxis:
    """Seconds [start, start + span] onto points [left, left + width]."""

    span: float
    left: float
    width: float
    start: float = 0.0

    def x(self, seconds: float) -> float:
        return self.left + ((seconds - self.start) / self.span * self.width if self.span > 0 else 0.0)


def seconds_text(value: float, unit: tuple[str, float] | None = None) -> str:
    """1.5e-3 -> '1.5 ms'; `unit` forces (name, seconds per unit)."""
    name, factor = unit or time_unit(value)
    return f"{value / factor:.4g} {name}"


def time_unit(value: float) -> tuple[str, float]:
    for name, factor in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if abs(value) >= factor:
            return name, factor
    return "ns", 1e-9


def tick_step(span: float, target: int = 8) -> float:
    """A round step (1, 2 or 5 x 10^k) giving about `target` ticks over `span`."""
    if span <= 0:
        return 1.0
    raw = span / target
    power = 10 ** math.floor(math.log10(raw))
    return next(step * power for step in (1, 2, 5, 10) if step * power >= raw)


def ticks(axis: TimeAxis, step: float) -> list[tuple[int, float]]:
    """(index, x) of every multiple of `step` seconds on the axis."""
    first = math.ceil(axis.start / step - 1e-9)
    last = math.floor((axis.start + axis.span) / step + 1e-9) if axis.span > 0 else first
    return [(index, axis.x(index * step)) for index in range(first, last + 1)]


def grid_line(graph: Graph, name: str, x: float, bottom: float, top: float) -> None:
    """A light vertical grid line from `bottom` to `top`."""
    graph.node(f"{name}_a", pos=pos(x, bottom), shape="point", width=0, height=0, style="invis")
    graph.node(f"{name}_b", pos=pos(x, top), shape="point", width=0, height=0, style="invis")
    graph.edge(f"{name}_a", f"{name}_b", pos=spline([(x, bottom), (x, top)]), dir="none", color="#d9d9d9",
               penwidth=0.6)


def draw_time_axis(graph: Graph, axis: TimeAxis, top: float, bottom: float, step: float | None = None,
                   prefix: str = "tick", grid: bool = True, unit: tuple[str, float] | None = None) -> float:
    """Tick labels under `bottom` and (with `grid`) light grid lines from `bottom` to `top` (y grows
    upwards); returns the tick step in seconds, for views that draw their own grid lines. The labels'
    unit is `unit`, else the one of five steps."""
    step = step or tick_step(axis.span)
    unit = unit or time_unit(step * 5)
    for index, x in ticks(axis, step):
        if grid:
            grid_line(graph, f"{prefix}{index}", x, bottom, top)
        graph.node(f"{prefix}{index}", pos=pos(x, bottom - 9), shape="plaintext",
                   label=seconds_text(index * step, unit),
                   fontsize=8, fontname=FONT, width=0, height=0, margin=0, fixedsize=False, style="solid")
    graph.node(f"{prefix}_label", pos=pos(axis.left + axis.width / 2, bottom - 23), shape="plaintext",
               label=f"time in the step ({unit[0]})", fontsize=9, fontname=FONT, width=0, height=0, margin=0,
               fixedsize=False, style="solid")
    return step


def text_node(graph: Graph, node_id: str, x: float, y: float, text: str, size: float = 9,
              align: str = "c", **attrs: object) -> None:
    """A free-standing line of text at (x, y): `align` c (centred on x), l (starting at x) or r
    (ending at x). The node is as wide as the text could be; the text is justified inside it."""
    width = max(len(line) for line in text.split("\\n")) * size * 0.62 + 4
    shift = {"c": 0.0, "l": width / 2, "r": -width / 2}[align]
    end = {"c": "", "l": "\\l", "r": "\\r"}[align]
    label = text.replace("\\n", end or "\\n") + end
    graph.node(node_id, pos=pos(x + shift, y), shape="plaintext", label=label, fontsize=num(size, 1),
               fontname=FONT, width=inches(width), height=inches(size * 1.3 * (text.count("\\n") + 1)),
               margin=0, fixedsize=True, style="solid", **attrs)
