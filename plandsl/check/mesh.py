"""Mesh against cluster: size (E301, W301), unused axes (E306), axes with two roles (E307), axes straddling
nodes (W302)."""
from __future__ import annotations

from typing import Iterator

from plandsl import ir
from plandsl.diagnostics import Diagnostic, Edit, Note, diag
from plandsl.diagnostics.source import Span
from plandsl.lower.plan import DEFAULT_AXES  # the axis each role takes by default


def used_axes(plan: ir.Plan) -> dict[str, str]:
    """Mesh axis -> what uses it."""
    used: dict[str, str] = {}
    if plan.data:
        used.update({a: f"data ({plan.data.kind})" for a in plan.data.axes})
    for part, what in ((plan.tensor, "tensor"), (plan.context, "context"), (plan.experts, "experts"),
                       (plan.stages, "stages")):
        if part is not None:
            used.setdefault(part.axis, what)
    for rule in plan.shard:
        if rule.axis:
            used.setdefault(rule.axis, "a shard rule")
        for param in rule.params:
            for placement in param.placements:
                used.setdefault(placement.axis, "a shard rule")
    return used


def check_mesh(plan: ir.Plan) -> Iterator[Diagnostic]:
    mesh, cluster = plan.mesh, plan.cluster
    product = " * ".join(f"{a.name}({a.size})" for a in mesh.axes)
    if mesh.part is not None:
        end = mesh.first_device + mesh.part
        if end > cluster.num_devices:
            yield diag("E301", f"the mesh runs over devices[{mesh.first_device}:{end}], but cluster "
                       f"'{cluster.name}' has {cluster.num_devices}", mesh.span)
        elif mesh.size != mesh.part:
            yield diag("E301", f"mesh {product} = {mesh.size} devices, but it runs over {mesh.part} devices "
                       f"[{mesh.first_device}:{end}]", mesh.span, hint=f"make the axes multiply to {mesh.part}")
    elif mesh.size > cluster.num_devices:
        yield diag("E301", f"mesh {product} = {mesh.size} devices, but cluster '{cluster.name}' has "
                   f"{cluster.num_devices}", mesh.span,
                   hint=f"make the axes multiply to at most {cluster.num_devices}, or use a larger cluster",
                   notes=[Note(f"cluster: {cluster.num_nodes} node(s) x "
                               f"{'/'.join(str(g.node.devices) for g in cluster.groups)} devices", cluster.span)])
    elif mesh.size < cluster.num_devices:
        yield diag("W301", f"mesh {product} = {mesh.size} devices uses {mesh.size} of the "
                   f"{cluster.num_devices} devices of '{cluster.name}'", mesh.span,
                   hint="the rest stay idle; grow an axis to use them")
    used = used_axes(plan)
    shared = list(_shared_axes(plan))
    named = {d.edits[0].text for d in shared if d.edits}  # free axes E307 moves a parallelism to: said once
    for axis in mesh.axes:
        if axis.name not in used and axis.size > 1 and axis.name not in named:
            hint, edits = _use_hint(plan, axis.name)
            yield diag("E306", f"mesh axis '{axis.name}' (size {axis.size}) is not used by data, tensor, context, "
                       "expert parallelism or stages", axis.span, hint=hint, edits=edits)
    yield from shared
    if plan.tensor and mesh.first_device + mesh.size <= cluster.num_devices:
        span = axis_group_span(plan, plan.tensor.axis)
        if span > 1:
            yield diag("W302", f"tensor-parallel axis '{plan.tensor.axis}' ({plan.tp}) has groups spanning {span} "
                       "nodes: its all-reduces cross the inter-node fabric", mesh.axis(plan.tensor.axis).span,
                       hint="move the tensor axis last in the mesh (innermost), shrink it to fit a node, or start "
                       "the mesh on a node boundary")


def _shared_axes(plan: ir.Plan) -> Iterator[Diagnostic]:
    """Each mesh axis splits one thing: the batch (data), the layers' weights (tensor), the sequence
    (context), the experts or the stages. The expert axis may also be a data axis (it splits the batch
    too, `ir.Plan.batch_axes`); every other pair would split two things along one coordinate."""
    roles: list[tuple[str, str, object]] = []  # (axis, role, span)
    if plan.data:
        roles += [(axis, "data", plan.data.span) for axis in plan.data.axes]
    for part, role in ((plan.tensor, "tensor"), (plan.context, "context"), (plan.experts, "experts"),
                       (plan.stages, "stages")):
        if part is not None:
            roles.append((part.axis, role, part.span))
    first: dict[str, str] = {}
    where: dict[str, object] = {}  # role -> where it was written
    for axis, role, span in roles:
        other = first.setdefault(axis, role)
        where.setdefault(role, span)
        if other != role and {other, role} != {"data", "experts"}:
            free = [a.name for a in plan.mesh.axes if a.name not in used_axes(plan)]
            # the role whose usual axis is free moved off it by mistake; else the one off its usual axis
            # (`tensor` over pp beside `stages`), else the one written second
            moved, named = next(((r, DEFAULT_AXES[r]) for r in (role, other) if DEFAULT_AXES[r] in free),
                                (next((r for r in (role, other) if DEFAULT_AXES[r] != axis), role),
                                 free[0] if len(free) == 1 else None))
            stays = other if moved == role else role
            yield diag("E307", f"mesh axis '{axis}' is used by both `{other}` and `{role}`; each splits its own "
                       "thing, so each needs an axis of its own", where.get(moved) or span,  # the line to change
                       notes=[Note(f"`{stays}` runs over '{axis}' here", where.get(stays))] if where.get(stays) else [],
                       hint=f"the mesh's axis '{named}' is unused: `{moved} = {role_line(plan, moved)} over {named}`"
                       if named else f"add a mesh axis for `{moved}`, e.g. `[..., {DEFAULT_AXES[moved]} = 2]`, "
                       "and name it here", edits=move_edit(plan, moved, named) if named else ())


def role_line(plan: ir.Plan, role: str) -> str:
    """What the plan's line for `role` says before `over` (`zero1`, `megatron`), for hints."""
    kinds = {"data": plan.data.kind if plan.data else ir.DataKind.zero1, "tensor": "megatron",
             "context": plan.context.kind if plan.context else "allgather", "experts": plan.experts.kind if plan.experts else "alltoall",
             "stages": "evenly"}
    return kinds[role]


# Axis names people give a role other than its default name (`mp` for Megatron's model parallelism).
ROLE_OF_NAME = {"mp": "tensor", "tensor": "tensor", "model": "tensor", "sp": "context", "context": "context",
                "seq": "context", "pipe": "stages", "pipeline": "stages", "stage": "stages", "stages": "stages",
                "expert": "experts", "experts": "experts", "moe": "experts"}


def role_of(plan: ir.Plan, role: str):
    return {"data": plan.data, "tensor": plan.tensor, "context": plan.context, "experts": plan.experts,
            "stages": plan.stages}[role]


def move_edit(plan: ir.Plan, role: str, to: str) -> tuple[Edit, ...]:
    """Rewrite the axis name in `role`'s `over ...` to `to` (when the role runs over one axis written there)."""
    part = role_of(plan, role)
    if part is None:
        return ()
    axes = part.axes if role == "data" else (part.axis,)
    span = part.field_spans.get("axes.0" if role == "data" else "axis")
    if len(axes) != 1 or span is None or span.end - span.start != len(axes[0]):
        return ()
    return (Edit(span, to),)


def add_line_edit(plan: ir.Plan, line: str) -> tuple[Edit, ...]:
    """Insert `line` as the plan's last attribute, when its closing brace starts a line."""
    span = plan.span
    if span is None or span.end_column != 2 or span.end < 1:
        return ()
    at = span.end - 1
    return (Edit(Span(span.file, span.end_line, 1, span.end_line, 1, at, at), f"  {line}\n"),)


def _use_hint(plan: ir.Plan, name: str) -> tuple[str, tuple[Edit, ...]]:
    """How to use an axis no parallelism uses: the role its name says (tp: tensor, mp: tensor, ...), else
    data; with the edit that does it (the role's `over` moved to this axis, or a line added)."""
    role = next((r for r, default in DEFAULT_AXES.items() if default == name), None) or ROLE_OF_NAME.get(name)
    current = role_of(plan, role) if role else None
    if role is None or current is None:
        line = f"{role or 'data'} = {role_line(plan, role or 'data')} over {name}"
        other = "" if role else ", or name it dp/tp/pp/cp/ep for the default"
        return f"add `{line}`{other}", add_line_edit(plan, line)
    line = f"`{role} = {role_line(plan, role)} over {name}`"
    where = ", ".join(current.axes) if role == "data" else current.axis
    return f"`{role}` is over '{where}', not '{name}': did you mean {line}?", move_edit(plan, role, name)


def node_of_device(cluster: ir.Cluster) -> list[int]:
    """Node index of every device of the cluster (node-major order)."""
    nodes = []
    index = 0
    for group in cluster.groups:
        for _ in range(group.count):
            nodes += [index] * group.node.devices
            index += 1
    return nodes


def _span_on_equal_nodes(per_node: int, first: int, devices: int, stride: int, size: int) -> int:
    """`axis_group_span` where every node holds `per_node` devices. A group's members lie `stride`
    apart: at least a node apart, each is on its own node; closer, the group touches every node from
    its first member's to its last's, which depends on where the first sits in its node only, so the
    groups of D = `per_node` consecutive periods cover every case (at most D x stride groups)."""
    if size == 1:
        return 1
    if stride >= per_node:
        return size
    period = stride * size
    worst = 1
    for q in range(min(devices // period, per_node)):
        for j in range(stride):
            start = first + q * period + j
            worst = max(worst, (start + (size - 1) * stride) // per_node - start // per_node + 1)
    return worst


def axis_group_span(plan: ir.Plan, axis: str) -> int:
    """The most nodes any group of `axis` (devices differing only in that coordinate) touches."""
    mesh = plan.mesh
    names = [a.name for a in mesh.axes]
    position = names.index(axis)
    stride = 1
    for inner in mesh.axes[position + 1:]:
        stride *= inner.size
    size = mesh.axes[position].size
    per_node = {group.node.devices for group in plan.cluster.groups}
    if len(per_node) == 1:  # nodes alike: a closed form, not a walk over every device
        return _span_on_equal_nodes(per_node.pop(), mesh.first_device, mesh.size, stride, size)
    nodes = node_of_device(plan.cluster)
    worst = 1
    for base in range(mesh.size):
        if (base // stride) % size:
            continue  # not the first member of its group
        touched = {nodes[mesh.first_device + base + k * stride] for k in range(size)}
        worst = max(worst, len(touched))
    return worst
