"""The lines of the mesh view: where node boxes go, the network bar under each row, and the lines
that join each group of the colouring axis.

Contract: `find_links` pairs each shown device with the next shown member of its group and
splits the pairs into per-device lines (inside a node box, or between boxes side by side) and
bundles (one arc per pair of boxes further apart, so no line crosses the boxes in between);
`draw_*` add them to the mesh's DOT graph at fixed positions (for `neato -n2`).
"""
from __future__ import annotations

from dataclasses import dataclass

from plandsl import ir
from plandsl.render.dot import Graph, inches, num, pos, text_width

FRAMES_PER_ROW = 8
DEVICE_HEIGHT, DEVICE_GAP, FRAME_GAP_X, FRAME_GAP_Y = 28.0, 6.0, 44.0, 56.0


@dataclass(frozen=True, slots=True)
class Frame:
    """A drawn node box: a cluster node (`node` >= 0) or a run of collapsed nodes (`collapsed` > 0)."""

    node: int
    group: int
    first_device: int   # global index of its first device
    devices: int
    collapsed: int = 0  # nodes folded into this box
    last_node: int = -1


def format_rate(bytes_per_second: float) -> str:
    for unit, factor in (("TB/s", 1e12), ("GB/s", 1e9), ("MB/s", 1e6)):
        if bytes_per_second >= factor:
            return f"{bytes_per_second / factor:.3g} {unit}"
    return f"{bytes_per_second:.3g} B/s"


@dataclass(frozen=True, slots=True)
class Grid:
    """Where node boxes go: FRAMES_PER_ROW to a row, rows `gap` apart (the network bar and the
    arcs over the next row live in the gap); y grows upwards, the first row's tops at 0."""

    frame_width: float
    frame_height: float
    gap: float

    def frame(self, number: int) -> tuple[float, float]:
        """(x of the centre, y of the top) of frame `number`."""
        column, row = number % FRAMES_PER_ROW, number // FRAMES_PER_ROW
        return column * (self.frame_width + FRAME_GAP_X) + self.frame_width / 2, -row * (self.frame_height + self.gap)

    def row_bottom(self, row: int) -> float:
        return -row * (self.frame_height + self.gap) - self.frame_height


@dataclass(frozen=True, slots=True)
class Link:
    """A shown device and the next shown member of its group, `step` coordinates further on."""

    tail: int
    head: int
    step: int


def find_links(shown: dict[int, tuple[int, int]], stride: int, size: int, coords, which: int
               ) -> tuple[list[Link], dict[tuple[int, int], list[Link]]]:
    """Each shown device to the next shown member of its group, split into lines drawn per device
    (inside a node box, or between boxes side by side) and bundles, one per pair of boxes further
    apart: per-device lines there would cross every box in between."""
    lines: list[Link] = []
    bundles: dict[tuple[int, int], list[Link]] = {}
    for mesh_index in sorted(shown):
        coordinate = coords(mesh_index)[which]
        step = 1
        while coordinate + step < size and mesh_index + step * stride not in shown:
            step += 1
        if coordinate + step >= size:
            continue
        link = Link(mesh_index, mesh_index + step * stride, step)
        f0, f1 = shown[link.tail][0], shown[link.head][0]
        if f0 == f1 or (f1 == f0 + 1 and f0 // FRAMES_PER_ROW == f1 // FRAMES_PER_ROW):
            lines.append(link)
        else:
            bundles.setdefault((f0, f1), []).append(link)
    return lines, bundles


ARC_BASE, ARC_LANE, ARC_LANES = 16.0, 16.0, 8


def arc_lanes(bundles: dict[tuple[int, int], list[Link]]) -> dict[tuple[int, int], int]:
    """Each bundle between boxes of one row gets its own height (shorter spans lower), so arcs
    that overlap never share a top; bundles between rows get none."""
    same_row = [key for key in bundles if key[0] // FRAMES_PER_ROW == key[1] // FRAMES_PER_ROW]
    lanes: dict[tuple[int, int], int] = {}
    for row in sorted({key[0] // FRAMES_PER_ROW for key in same_row}):
        mine = sorted((key for key in same_row if key[0] // FRAMES_PER_ROW == row), key=lambda k: (k[1] - k[0], k))
        for lane, key in enumerate(mine):
            lanes[key] = lane % ARC_LANES
    return lanes


def arc_space(bundles: dict[tuple[int, int], list[Link]]) -> float:
    """Height to keep above each row of boxes for the arcs and their labels."""
    if not bundles:
        return 0.0
    lanes = arc_lanes(bundles)
    arcs = 0.75 * (ARC_BASE + ARC_LANE * max(lanes.values())) + 10 if lanes else 0.0
    return max(arcs, 24.0)  # at least room for labels of bundles between rows, under the network bar


def inter_node_rate(plan: ir.Plan, a: int, b: int) -> float | None:
    """Bandwidth between two node types' devices across nodes: the slowest of NICs and fabric."""
    links = [plan.cluster.groups[g].node.nic for g in (a, b)] + [plan.cluster.fabric]
    rates = [link.bandwidth for link in links if link is not None]
    return min(rates) if rates else None


def draw_networks(graph: Graph, plan: ir.Plan, frames: list[Frame], grid: Grid) -> None:
    """Under each row of node boxes, a bar for the network between nodes, with its bandwidths."""
    if plan.cluster.num_nodes < 2 or len(frames) < 2:
        return
    nics = dict.fromkeys(f"{g.node.name} NIC {format_rate(g.node.nic.bandwidth)}"
                         for g in plan.cluster.groups if g.node.nic)
    parts = list(nics) + ([f"fabric {format_rate(plan.cluster.fabric.bandwidth)}"] if plan.cluster.fabric else [])
    text = "network between nodes: " + (", ".join(parts) + " per node" if parts else "no NIC given")
    for row in range(-(-len(frames) // FRAMES_PER_ROW)):
        members = frames[row * FRAMES_PER_ROW:(row + 1) * FRAMES_PER_ROW]
        width = len(members) * (grid.frame_width + FRAME_GAP_X) - FRAME_GAP_X
        y = grid.row_bottom(row) - FRAME_GAP_Y / 2
        graph.node(f"net{row}", pos=pos(width / 2, y), width=inches(width), height=inches(14), label=text,
                   fillcolor="#eeeeee", color="#999999", fontsize=8)
        for column in range(len(members)):
            x = column * (grid.frame_width + FRAME_GAP_X) + grid.frame_width / 2
            top, bottom = y + FRAME_GAP_Y / 2, y + 7
            graph.node(f"net{row}_{column}_a", pos=pos(x, top), shape="point", width=0, height=0, style="invis")
            graph.node(f"net{row}_{column}_b", pos=pos(x, bottom), shape="point", width=0, height=0, style="invis")
            graph.edge(f"net{row}_{column}_a", f"net{row}_{column}_b", color="#999999", penwidth=1.2,
                       pos=f"{num(x)},{num(top)} {num(x)},{num(top)} {num(x)},{num(bottom)} {num(x)},{num(bottom)}")


def draw_group_lines(graph: Graph, plan: ir.Plan, frames: list[Frame], placed: dict, lines: list[Link],
                 device_width: float) -> None:
    """Per-device lines: each shown device to the next shown member of its group; dashed across
    hidden members; the first line between two boxes says the bandwidth between them."""
    labelled: set[tuple[int, int]] = set()
    for link in lines:
        (x0, y0, f0, tail), (x1, y1, f1, head) = placed[link.tail], placed[link.head]
        attrs: dict[str, object] = {"color": "#444444", "penwidth": 1.6}
        if link.step > 1:
            attrs.update(style="dashed", color="#888888")
        route = _route(x0, y0, x1, y1, f0 == f1, f1 == f0 + 1, device_width, link.tail)
        attrs["pos"] = " ".join(f"{num(x)},{num(y)}" for x, y in route)
        text = []
        if f0 != f1 and (f0, f1) not in labelled:
            labelled.add((f0, f1))
            rate = inter_node_rate(plan, frames[f0].group, frames[f1].group)
            if rate:
                text.append(format_rate(rate))
        if link.step > 1:
            text.append(f"via {link.step - 1} hidden")
        if text:
            bx = (route[0][0] + 3 * route[1][0] + 3 * route[2][0] + route[3][0]) / 8
            by = (route[0][1] + 3 * route[1][1] + 3 * route[2][1] + route[3][1]) / 8
            attrs.update(label=", ".join(text), lp=f"{num(bx)},{num(by + 6)}")
        graph.edge(tail, head, **attrs)


def draw_bundles(graph: Graph, plan: ir.Plan, frames: list[Frame],
             bundles: dict[tuple[int, int], list[Link]], grid: Grid, axis: str) -> None:
    """One arc per pair of node boxes whose devices pair up over the axis but are not side by
    side: over the row for boxes of one row, from the bottom of one to the top of the other
    across rows. The label counts the links; the tooltip names them."""
    lanes = arc_lanes(bundles)
    quarter = grid.frame_width / 4
    for (f0, f1), links in sorted(bundles.items()):
        (x0, top0), (x1, top1) = grid.frame(f0), grid.frame(f1)
        if (f0, f1) in lanes:
            height = ARC_BASE + ARC_LANE * lanes[(f0, f1)]
            start, end = (x0 + quarter, top0), (x1 - quarter, top1)
            route = [start, (start[0], top0 + height), (end[0], top1 + height), end]
            label_at = ((start[0] + end[0]) / 2, top0 + 0.75 * height)
        else:
            bottom = top0 - grid.frame_height
            start, end = (x0 + quarter, bottom), (x1 - quarter if x1 > x0 else x1 + quarter, top1)
            bend = (bottom - top1) / 2
            route = [start, (start[0], bottom - bend), (end[0], top1 + bend), end]
            label_at = ((start[0] + end[0]) / 2, (bottom + top1) / 2)
        steps = sorted({link.step for link in links})
        text = [f"{len(links)} '{axis}' link{'s' if len(links) != 1 else ''}"]
        rate = inter_node_rate(plan, frames[f0].group, frames[f1].group)
        if rate:
            text.append(format_rate(rate))
        if steps[-1] > 1:
            hidden = f"{steps[0] - 1}" if len(steps) == 1 else f"{steps[0] - 1}-{steps[-1] - 1}"
            text.append(f"via {hidden} hidden each")
        first = plan.mesh.first_device
        pairs = ", ".join(f"d{first + link.tail}-d{first + link.head}" for link in links[:16])
        more = f", ... ({len(links)} in all)" if len(links) > 16 else ""
        tooltip = f"'{axis}' links between these nodes: {pairs}{more}"
        attrs: dict[str, object] = {"color": "#444444", "penwidth": 2.2, "tooltip": tooltip,
                                    "pos": " ".join(f"{num(x)},{num(y)}" for x, y in route)}
        if steps[-1] > 1:
            attrs.update(style="dashed", color="#888888")
        graph.edge(f"node{f0}", f"node{f1}", **attrs)
        words = ", ".join(text)  # on the arc, white behind it: lines drawn first pass under it
        graph.node(f"bundle{f0}_{f1}", pos=pos(*label_at), width=inches(text_width(words, 7) * 0.9 + 6),
                   height=inches(10), label=words, fontsize=7, shape="box", style="filled", fillcolor="white",
                   color="white", penwidth=0, tooltip=tooltip)


def _route(x0: float, y0: float, x1: float, y1: float, same_frame: bool, neighbours: bool, device_width: float,
           number: int):
    """Cubic Bézier control points from one device to another: straight between neighbours in a
    node, bowed to the right when skipping devices of the node, arched between nodes."""
    if same_frame:
        gap = abs(y1 - y0)
        if gap <= DEVICE_HEIGHT + DEVICE_GAP + 0.5:
            start, end = (x0, y0 - DEVICE_HEIGHT / 2), (x1, y1 + DEVICE_HEIGHT / 2)
            return [start, start, end, end]
        bow = 10 + 6 * (number % 4) + min(12.0, gap / 16)
        start, end = (x0 + device_width / 2, y0), (x1 + device_width / 2, y1)
        return [start, (start[0] + bow, y0), (end[0] + bow, y1), end]
    start = (x0 + device_width / 2 if x1 > x0 else x0 - device_width / 2, y0)
    end = (x1 - device_width / 2 if x1 > x0 else x1 + device_width / 2, y1)
    if abs(y1 - y0) < 0.5 and neighbours:
        return [start, start, end, end]
    lift = min(60.0, abs(x1 - x0) / 6 + abs(y1 - y0) / 6)
    return [start, (start[0], start[1] + lift), (end[0], end[1] + lift), end]
