"""Plan -> its device mesh on the cluster: nodes as boxes holding their devices, each device
labelled with its coordinate on every mesh axis and coloured by one axis, lines joining each
group of that axis (the devices that communicate over it; `mesh_lines` draws them), bandwidths
on the links.

Contract: `render_mesh(plan, color_by=None) -> DOT text` for `neato -n2`. Large meshes stay
readable: beyond `MAX_NODES` nodes, runs of identical nodes collapse into one box that says so.
Device index = row-major over the mesh axes (last axis fastest), from `mesh.first_device`.
"""
from __future__ import annotations

import bisect

from plandsl import ir
from plandsl.render.dot import FONT, Graph, Html, categorical, escape, inches, pos, text_width
from plandsl.render.mesh_lines import (DEVICE_GAP, DEVICE_HEIGHT, FRAME_GAP_Y, Frame, Grid, arc_space, draw_bundles,
                                       draw_group_lines, draw_networks, find_links, format_rate)
from plandsl.render.timeline import text_node

ENGINE = ("neato", "-n2")
MAX_NODES = 16        # nodes drawn before runs of identical ones collapse
KEEP_FIRST = 8        # of a collapsed mesh: the first nodes kept, to show how the axes unfold
MAX_DEVICES = 16      # devices drawn per node before the middle of the node collapses
HEADER = 44.0        # top of a node box, above its devices
SHAPES = (("box", "rounded,filled"), ("box", "filled,diagonals"), ("octagon", "filled"), ("hexagon", "filled"))
ROLES = {"tensor": "tensor parallel: all-reduce activations", "data": "data parallel: all-reduce gradients",
         "zero": "ZeRO: reduce-scatter gradients, all-gather parameters",
         "stages": "pipeline: send activations / gradients between stages",
         "context": "context parallel: ring exchange of keys and values",
         "experts": "expert parallel: all-to-all of tokens", "none": "no parallelism uses this axis"}


def default_axis(plan: ir.Plan, frames: list[Frame] | None = None) -> str:
    """The axis to colour by: the one that tells the drawn nodes apart. Of the axes of size > 1, the
    one taking the most coordinates over the first devices of the drawn nodes (`frames`), the outermost
    among equals; a mesh inside one node (no axis tells nodes apart) takes its outermost such axis."""
    mesh = plan.mesh
    sizes = [a.size for a in mesh.axes]
    strides = [1] * len(sizes)
    for i in range(len(sizes) - 2, -1, -1):
        strides[i] = strides[i + 1] * sizes[i + 1]
    firsts = [max(0, f.first_device - mesh.first_device) for f in (frames or []) if not f.collapsed]
    firsts = [i for i in firsts if i < mesh.size]
    best, most = None, -1
    for axis, stride, size in zip(mesh.axes, strides, sizes):
        count = len({first // stride % size for first in firsts})
        if size > 1 and count > most:
            best, most = axis.name, count
    return best or mesh.axes[-1].name


def axis_role(plan: ir.Plan, name: str) -> str:
    if plan.tensor and plan.tensor.axis == name:
        return ROLES["tensor"]
    if plan.context and plan.context.axis == name:
        return ROLES["context"]
    if plan.experts and plan.experts.axis == name:
        return ROLES["experts"]
    if plan.stages and plan.stages.axis == name:
        return ROLES["stages"]
    if plan.data and name in plan.data.axes:
        if plan.data.hybrid and name == plan.data.axes[0]:
            return ROLES["data"]
        return ROLES["zero"] if plan.data.zero_stage else ROLES["data"]
    return ROLES["none"]


class ClusterIndex:
    """Global node and device numbering of a cluster, without listing every node."""

    def __init__(self, cluster: ir.Cluster):
        self.groups = cluster.groups
        self.node_starts, self.device_starts = [], []
        nodes = devices = 0
        for group in cluster.groups:
            self.node_starts.append(nodes)
            self.device_starts.append(devices)
            nodes += group.count
            devices += group.count * group.node.devices

    def node_of(self, device: int) -> tuple[int, int]:
        """(node index, group index) of a global device index."""
        group = bisect.bisect_right(self.device_starts, device) - 1
        local = (device - self.device_starts[group]) // self.groups[group].node.devices
        return self.node_starts[group] + local, group

    def first_device(self, node: int) -> tuple[int, int]:
        """(global index of the node's first device, group index)."""
        group = bisect.bisect_right(self.node_starts, node) - 1
        per = self.groups[group].node.devices
        return self.device_starts[group] + (node - self.node_starts[group]) * per, group


def frames_of(plan: ir.Plan, index: ClusterIndex) -> list[Frame]:
    """The node boxes to draw: every node the mesh touches, or, past MAX_NODES, the first
    KEEP_FIRST, the first two of each later node type and the last, identical runs collapsed."""
    first, last = plan.mesh.first_device, plan.mesh.first_device + plan.mesh.size - 1
    first_node, _ = index.node_of(first)
    last_node, _ = index.node_of(last)
    count = last_node - first_node + 1
    keep = set(range(first_node, last_node + 1)) if count <= MAX_NODES else \
        set(range(first_node, first_node + KEEP_FIRST)) | {last_node}
    if count > MAX_NODES:
        for start in index.node_starts:
            if first_node < start <= last_node:
                keep |= {start, min(start + 1, last_node)}
    frames: list[Frame] = []
    node = first_node
    while node <= last_node:
        device, group = index.first_device(node)
        if node in keep:
            frames.append(Frame(node, group, device, index.groups[group].node.devices))
            node += 1
            continue
        run_end = node
        while run_end + 1 <= last_node and run_end + 1 not in keep and index.first_device(run_end + 1)[1] == group:
            run_end += 1
        frames.append(Frame(node, group, device, index.groups[group].node.devices, run_end - node + 1, run_end))
        node = run_end + 1
    return frames


def shown_slots(devices: int) -> list[int | None]:
    """Local device indices drawn in a node; None marks the collapsed middle of a huge node."""
    if devices <= MAX_DEVICES:
        return list(range(devices))
    return list(range(8)) + [None] + [devices - 2, devices - 1]


def render_mesh(plan: ir.Plan, color_by: str | None = None) -> str:
    mesh = plan.mesh
    names = [a.name for a in mesh.axes]
    index = ClusterIndex(plan.cluster)
    frames = frames_of(plan, index)
    axis = color_by or default_axis(plan, frames)
    if axis not in names:
        raise ValueError(f"--color-by '{axis}': the mesh has no such axis; its axes: {', '.join(names)}")
    sizes = [a.size for a in mesh.axes]
    strides = [1] * len(sizes)
    for i in range(len(sizes) - 2, -1, -1):
        strides[i] = strides[i + 1] * sizes[i + 1]
    which = names.index(axis)
    fills = categorical(sizes[which])
    type_names = list(dict.fromkeys(g.node.device.name for g in plan.cluster.groups))

    def coords(mesh_index: int) -> list[int]:
        return [mesh_index // stride % size for stride, size in zip(strides, sizes)]

    def label(mesh_index: int) -> str:
        return " · ".join(f"{n} {c}" for n, c in zip(names, coords(mesh_index)))

    widest = max([text_width(label(0).replace("0", "00"), 8)] + [text_width("unused", 8)])
    device_width = max(46.0, widest + 12)
    frame_width = max(device_width + 16, max(text_width(line, 8.6) for f in frames for line in _frame_lines(plan, f)) + 10)
    slots_per_frame = [shown_slots(f.devices) if not f.collapsed else [] for f in frames]
    rows = max([len(s) for s in slots_per_frame] + [3])
    frame_height = HEADER + rows * (DEVICE_HEIGHT + DEVICE_GAP) + 6
    shown = {}  # mesh index -> (frame number, slot)
    for number, frame in enumerate(frames):
        for slot, local in enumerate(slots_per_frame[number]):
            if local is not None and 0 <= frame.first_device + local - mesh.first_device < mesh.size:
                shown[frame.first_device + local - mesh.first_device] = (number, slot)
    lines, bundles = find_links(shown, strides[which], sizes[which], coords, which)
    arcs = arc_space(bundles)
    grid = Grid(frame_width, frame_height, FRAME_GAP_Y + arcs)
    graph = Graph("mesh", comment=f"plandsl render --view mesh: plan {plan.name}, colour by {axis}\n"
                  "lay out with: neato -n2",
                  graph={"layout": "neato", "inputscale": 72, "outputorder": "edgesfirst", "bgcolor": "white",
                         "fontname": FONT, "pad": 0.2},
                  node={"shape": "box", "fixedsize": True, "style": "filled", "fontname": FONT, "fontsize": 8,
                        "penwidth": 0.8},
                  edge={"dir": "none", "fontname": FONT, "fontsize": 7})
    _header(graph, plan, axis, sizes[which], fills, type_names, frames, arcs)
    placed: dict[int, tuple[float, float, int, str]] = {}  # mesh index -> (x, y, frame number, node id)
    for number, frame in enumerate(frames):
        x, top = grid.frame(number)
        centre = top - frame_height / 2
        title, detail, link = _frame_lines(plan, frame)
        text = Html(f"<b>{escape(title)}</b><br/>{escape(detail)}<br/>{escape(link)}")
        graph.node(f"node{number}", pos=pos(x, centre), width=inches(frame_width), height=inches(frame_height),
                   label=text, labelloc="t", style="rounded,dashed" if frame.collapsed else "rounded",
                   color="#777777", fontsize=8,
                   tooltip=f"{title}: {detail}")
        shape, style = SHAPES[type_names.index(index.groups[frame.group].node.device.name) % len(SHAPES)]
        for slot, local in enumerate(slots_per_frame[number]):
            y = top - HEADER - slot * (DEVICE_HEIGHT + DEVICE_GAP) - DEVICE_HEIGHT / 2
            node_id = f"n{frame.node}_d{local}" if local is not None else f"n{frame.node}_more"
            if local is None:
                hidden = frame.devices - 10
                graph.node(node_id, pos=pos(x, y), width=inches(device_width), height=inches(DEVICE_HEIGHT),
                           label=f"... {hidden} more", style="dashed", color="#999999")
                continue
            device = frame.first_device + local
            mesh_index = device - plan.mesh.first_device
            if mesh_index not in shown:
                graph.node(node_id, pos=pos(x, y), width=inches(device_width), height=inches(DEVICE_HEIGHT),
                           label=f"d{device}\\nunused", shape=shape, style=style.replace("filled", "dashed"),
                           color="#aaaaaa", fontcolor="#999999", tooltip=f"device {device}: not in the mesh")
                continue
            mine = coords(mesh_index)
            graph.node(node_id, pos=pos(x, y), width=inches(device_width), height=inches(DEVICE_HEIGHT),
                       label=f"d{device}\\n{label(mesh_index)}", shape=shape, style=style,
                       fillcolor=fills[mine[which]], tooltip=f"device {device} (mesh rank {mesh_index}): "
                       f"{label(mesh_index)}; {index.groups[frame.group].node.device.name}")
            placed[mesh_index] = (x, y, number, node_id)
        if frame.collapsed:
            graph.node(f"node{number}_note", pos=pos(x, centre - 10), shape="plaintext", fixedsize=False,
                       width=0, height=0, margin=0, style="solid", fontsize=8,
                       label=f"{frame.collapsed} identical\\nnodes collapsed\\n(same device layout,\\n"
                             f"other coordinates)")
    draw_networks(graph, plan, frames, grid)
    draw_group_lines(graph, plan, frames, placed, lines, device_width)
    draw_bundles(graph, plan, frames, bundles, grid, axis)
    return graph.source()


def _frame_lines(plan: ir.Plan, frame: Frame) -> tuple[str, str, str]:
    node_type = plan.cluster.groups[frame.group].node
    device = node_type.device
    if frame.collapsed:
        title = f"nodes {frame.node}..{frame.last_node}"
        detail = f"{frame.collapsed} × {node_type.name}"
    else:
        title = f"node {frame.node} · {node_type.name}"
        detail = f"{node_type.devices} × {device.name} ({device.memory / 2**30:.0f} GiB)"
    return title, detail, f"link {format_rate(node_type.link.bandwidth)} per device"


def _header(graph: Graph, plan: ir.Plan, axis: str, size: int, fills: list[str], type_names: list[str],
            frames: list[Frame], lift: float) -> None:
    """Title, subtitle, colour key and device-type key, `lift` points higher to clear the arcs."""
    mesh = plan.mesh
    shape = " × ".join(f"{a.name}={a.size}" for a in mesh.axes)
    where = f", devices {mesh.first_device}..{mesh.first_device + mesh.size - 1}" if mesh.part is not None else ""
    cluster = plan.cluster
    nodes = f"{cluster.num_nodes:,} node{'s' if cluster.num_nodes != 1 else ''}"
    text_node(graph, "title", 0, lift + 100, f"plan {plan.name} · mesh [{shape}] = {mesh.size:,} devices on "
              f"{cluster.name} ({nodes}, {cluster.num_devices:,} devices{where})", size=11, align="l")
    text_node(graph, "subtitle", 0, lift + 84, f"colour: coordinate on '{axis}' · lines join each '{axis}' group, the "
              f"devices that communicate over it: {axis_role(plan, axis)} · {_group_shape(plan, axis)}",
              size=8, align="l")
    x = 0.0
    shown = list(range(size)) if size <= 16 else list(range(12)) + [size - 2, size - 1]
    key_width = text_width(f"{axis} {size - 1}", 7) + 8
    for coordinate in shown:
        graph.node(f"key{coordinate}", pos=pos(x + key_width / 2, lift + 62), width=inches(key_width),
                   height=inches(12), fillcolor=fills[coordinate], label=f"{axis} {coordinate}", fontsize=7,
                   style="rounded,filled", penwidth=0.5)
        x += key_width + 4
    if len(shown) < size:
        text_node(graph, "key_more", x + 2, lift + 62, f"(of {size})", size=7, align="l")
        x += 40
    if len(type_names) > 1:
        for number, name in enumerate(type_names):
            shape, style = SHAPES[number % len(SHAPES)]
            graph.node(f"type{number}", pos=pos(x + 20, lift + 62), width=inches(40), height=inches(12), shape=shape,
                       style=style, fillcolor="white", label="", penwidth=0.8)
            text_node(graph, f"type{number}_text", x + 44, lift + 62, name, size=8, align="l")
            x += 52 + text_width(name, 8)
    collapsed = [f for f in frames if f.collapsed]
    if collapsed:
        drawn = sum(1 for f in frames if not f.collapsed)
        nodes = sum(f.collapsed for f in collapsed)
        text_node(graph, "summary", 0, lift + 44, f"{mesh.size:,} devices: showing {drawn} nodes; {nodes:,} identical "
                  f"nodes collapsed ({', '.join(f'nodes {f.node}..{f.last_node}' for f in collapsed)})",
                  size=9, align="l", fontcolor="#b35900")


def _group_shape(plan: ir.Plan, axis: str) -> str:
    """`each 'dp' group: 16 devices, 64 apart (across nodes)`."""
    names = [a.name for a in plan.mesh.axes]
    size = plan.mesh.degree(axis)
    stride = 1
    for other in plan.mesh.axes[names.index(axis) + 1:]:
        stride *= other.size
    span = stride * size  # groups fill aligned blocks of this many devices
    inside = plan.mesh.first_device % span == 0 and all(g.node.devices % span == 0 for g in plan.cluster.groups)
    spacing = "consecutive" if stride == 1 else f"{stride:,} apart"
    return f"each '{axis}' group: {size:,} devices, {spacing} ({'inside a node' if inside else 'across nodes'})"
