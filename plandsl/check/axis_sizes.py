"""The hint of E406 (an axis that does not divide a dim it splits): the sizes of that axis that check; and
of E301 (a mesh larger than the cluster) and E404 (stage count against pp): the resizing that checks.

A size is offered only when the plan, resized to it, checks without errors it did not already
have: it divides every extent split over the axis (heads, kv_heads, hidden, ffn, vocab, the
sequence under sequence parallelism, the experts, shard rules' dims) and the mesh still fits the
cluster and the devices' memory. When a data axis can absorb the change, it is resized too, so the
mesh keeps its device count. The best size comes with an `Edit` of the mesh line.
"""
from __future__ import annotations

import math
from dataclasses import replace

from plandsl import ir
from plandsl.check.families import check_families
from plandsl.check.mesh import used_axes
from plandsl.check.sharding import axis_at, divisors, split_extents
from plandsl.diagnostics import Diagnostic, Edit
from plandsl.ir.shapes import indivisible

TRIES = 6  # plans re-checked per diagnostic, nearest sizes first


def _resized(plan: ir.Plan, sizes: dict[str, int]) -> ir.Plan:
    axes = tuple(a.model_copy(update={"size": sizes.get(a.name, a.size)}) for a in plan.mesh.axes)
    return plan.model_copy(update={"mesh": plan.mesh.model_copy(update={"axes": axes})})


def _fits(plan: ir.Plan, sizes: dict[str, int]) -> bool:
    total = math.prod(sizes.get(a.name, a.size) for a in plan.mesh.axes)
    return total == plan.mesh.part if plan.mesh.part is not None else total <= plan.cluster.num_devices


def _candidates(plan: ir.Plan, axis: str) -> list[dict[str, int]]:
    """Resizings to try, nearest first: the axis alone, or with a data axis taking up the difference."""
    old = plan.mesh.degree(axis)
    extents = split_extents(plan, axis)
    limit = min(plan.cluster.num_devices, ir.MAX_MESH_DEVICES)
    sizes = divisors(math.gcd(*extents.values()), limit) if extents else list(range(1, min(limit, 64) + 1))
    sizes = sorted((s for s in sizes if s != old), key=lambda s: (abs(math.log(s / old)), -s))
    data = next((a for a in (plan.data.axes if plan.data else ()) if a != axis and plan.mesh.axis(a)), None)
    out: list[dict[str, int]] = []
    for size in sizes:
        if data is not None and (plan.mesh.degree(data) * old) % size == 0:
            both = {axis: size, data: plan.mesh.degree(data) * old // size}
            if _fits(plan, both):
                out.append(both)
        if _fits(plan, {axis: size}):
            out.append({axis: size})
        if len(out) >= TRIES:
            break
    return out[:TRIES]


def _key(problem: Diagnostic):
    """What identifies an error across resizings: its code (E406: its code and place, one per axis)."""
    return (problem.code, problem.span) if problem.code == "E406" else problem.code


def _errors(plan: ir.Plan) -> set:
    return {_key(d) for d in check_families(plan) if d.is_error}  # the whole checker judges each resized plan


def suggest_axis_size(plan: ir.Plan, problem: Diagnostic, found: list[Diagnostic]) -> Diagnostic:
    """`problem` (an E406) with a hint naming sizes that check and an edit to the best of them."""
    axis = axis_at(plan, problem.span)
    if axis is None or plan.mesh.axis(axis) is None:
        return problem
    already = {_key(d) for d in found if d.is_error and d is not problem}  # errors it had anyway
    good = [sizes for sizes in _candidates(plan, axis) if _errors(_resized(plan, sizes)) <= already]
    if not good:
        return replace(problem, hint=_change_the_dims(plan, axis))
    best = good[0]
    change = " and ".join(f"'{name}' to {size}" for name, size in best.items())
    keeps = f" (the mesh keeps its {plan.mesh.size} devices)" if len(best) > 1 else ""
    others = sorted({sizes[axis] for sizes in good[1:]} - {best[axis]})
    extents = split_extents(plan, axis)
    splits = f": {best[axis]} divides {', '.join(f'{n} ({v})' for n, v in extents.items())}" if extents else ""
    more = f"; other sizes that check: {', '.join(map(str, others))}" if others else ""
    edits = tuple(Edit(plan.mesh.axis(name).span, f"{name} = {size}") for name, size in best.items()
                  if plan.mesh.axis(name).span is not None)
    old = plan.mesh.degree(axis)
    keep = f"; or {_keeping(plan, axis)}" if not old / 2 <= best[axis] <= old * 2 else ""
    return replace(problem, hint=f"set {change}{keeps}{splits}{more}{keep}", edits=edits)


def _change_the_dims(plan: ir.Plan, axis: str) -> str:
    """No size of `axis` checks: the dims it fails to divide are the ones to change."""
    return f"no other size of '{axis}' checks with this model and cluster; {_keeping(plan, axis)}"


def _keeping(plan: ir.Plan, axis: str) -> str:
    """`to keep 'tp' = 8, change seq (131073) to 131072 or 131080`: the dims that fail, rounded."""
    size = plan.mesh.degree(axis)
    failing = indivisible(split_extents(plan, axis), size)
    near = ", ".join(f"{name} ({value}) to {value // size * size or size} or {(value // size + 1) * size}"
                     for name, value in failing.items())
    return f"to keep '{axis}' = {size}, change {near}" if near else f"change the dims '{axis}' splits"


def _offer(plan: ir.Plan, problem: Diagnostic, found: list[Diagnostic], options: list[dict[str, int]]
           ) -> dict[str, int] | None:
    """The first resizing (of at most TRIES) after which the plan has no error it did not already have."""
    already = {_key(d) for d in found if d.is_error and d is not problem}
    for sizes in options[:TRIES]:
        if _errors(_resized(plan, sizes)) <= already:
            return sizes
    return None


def _size_edits(plan: ir.Plan, sizes: dict[str, int]) -> tuple[Edit, ...]:
    axes = [plan.mesh.axis(name) for name in sizes]
    if any(axis is None or axis.span is None for axis in axes):
        return ()
    return tuple(Edit(axis.span, f"{axis.name} = {sizes[axis.name]}") for axis in axes)


def suggest_mesh_fit(plan: ir.Plan, problem: Diagnostic, found: list[Diagnostic]) -> Diagnostic:
    """`problem` (an E301: the mesh needs more devices than it has) with the resizing that checks: an axis
    nothing uses shrunk first, then the data axis (each rank keeps its share of the model), then the
    others, outermost first."""
    mesh = plan.mesh
    target = mesh.part if mesh.part is not None else plan.cluster.num_devices
    if mesh.size <= target or mesh.first_device + (mesh.part or 0) > plan.cluster.num_devices:
        return problem
    unused = [a.name for a in mesh.axes if a.name not in used_axes(plan)]  # an axis nothing uses goes first
    data = [a for a in (plan.data.axes if plan.data else ()) if mesh.axis(a)]
    order = unused + data + [a.name for a in mesh.axes if a.name not in data + unused]
    options = []
    for name in order:
        old = mesh.degree(name)
        others = mesh.size // old
        for size in range(min(old - 1, target // others), 0, -1):
            if old % size == 0 and (mesh.part is None or others * size == target):
                options.append({name: size})
                break
    best = _offer(plan, problem, found, options)
    edits = _size_edits(plan, best) if best else ()
    if not edits:
        return _grow_cluster(plan, problem, found, options)
    name, size = next(iter(best.items()))
    total = mesh.size // mesh.degree(name) * size
    fits = " x ".join(str(best.get(a.name, a.size)) for a in mesh.axes) + " = " if len(mesh.axes) > 1 else ""
    larger = ", or use a larger cluster" if mesh.part is None else ""
    return replace(problem, hint=f"set '{name}' to {size} ({fits}{total} devices)"
                   f"{larger}", edits=edits)


def _grow_cluster(plan: ir.Plan, problem: Diagnostic, found: list[Diagnostic],
                  shrunk: list[dict[str, int]]) -> Diagnostic:
    """E301 when no smaller axis checks: the cluster's node count grown to hold the mesh (a cluster of one
    kind of node whose count is a number written in the plan's file), when that checks; else the hint
    says what stops the smaller mesh."""
    mesh, cluster = plan.mesh, plan.cluster
    already = {_key(d) for d in found if d.is_error and d is not problem}
    why = ""
    if shrunk:
        error = next((d for d in check_families(_resized(plan, shrunk[0]))  # the whole checker judges it
                      if d.is_error and _key(d) not in already), None)
        name, size = next(iter(shrunk[0].items()))
        why = f"; a smaller mesh does not check ('{name}' = {size} gives {error.code}: {error.message})" \
            if error else ""
    span = cluster.groups[0].field_spans.get("count") if len(cluster.groups) == 1 else None
    if mesh.part is not None or span is None or plan.span is None or span.file != plan.span.file:
        return replace(problem, hint=(problem.hint or "") + why)
    group = cluster.groups[0]
    nodes = -(-(mesh.first_device + mesh.size) // group.node.devices)
    if nodes > ir.MAX_NODES:
        return replace(problem, hint=(problem.hint or "") + why)
    grown = plan.model_copy(update={"cluster": cluster.model_copy(update={
        "groups": (group.model_copy(update={"count": nodes}),)})})
    if _errors(grown) - already:
        return replace(problem, hint=(problem.hint or "") + why)
    return replace(problem, hint=f"use {nodes} nodes ({nodes} x {group.node.devices} = "
                   f"{nodes * group.node.devices} devices){why}", edits=(Edit(span, str(nodes)),))


def suggest_stage_axis(plan: ir.Plan, problem: Diagnostic, found: list[Diagnostic], declared: int) -> Diagnostic:
    """`problem` (an E404: a stages block of `declared` stages, pp x virtual of another count) with the
    pipeline axis resized to the declared stages when that checks, a data axis absorbing the change (the
    stages stay as written); else, with more stages declared than the axis has, the stages merged into
    that many; else the hint says what stops the resizing."""
    stages = plan.stages
    if stages is None or plan.mesh.axis(stages.axis) is None:
        return problem
    axis, count = stages.axis, plan.pp * stages.virtual
    old = plan.mesh.degree(axis)
    options = []
    want = declared // stages.virtual if declared % stages.virtual == 0 else None
    if want is not None:
        data = next((a for a in (plan.data.axes if plan.data else ()) if a != axis and plan.mesh.axis(a)), None)
        if data is not None and (plan.mesh.degree(data) * old) % want == 0:
            options.append({axis: want, data: plan.mesh.degree(data) * old // want})
        options.append({axis: want})
    fitting = [o for o in options if _fits(plan, o)]
    best = _offer(plan, problem, found, fitting)
    edits = _size_edits(plan, best) if best else ()
    if edits:
        change = " and ".join(f"'{name}' to {size}" for name, size in best.items())
        keeps = f" (the mesh keeps its {plan.mesh.size} devices)" if len(best) > 1 else ""
        return replace(problem, hint=f"set {change}{keeps} for the {declared} stages declared, or declare "
                       f"{count} stages", edits=edits)
    why = _why_not(plan, problem, found, fitting, options, axis, want)
    merged = _merged(plan, declared, count) if declared > count else None
    if merged is not None and _errors(merged[0]) <= {_key(d) for d in found if d.is_error and d is not problem}:
        return replace(problem, hint=f"merge the {declared} stages into the {count} of {axis}({old}) x "
                       f"virtual({stages.virtual}): {merged[2]}{why}", edits=merged[1])
    return replace(problem, hint=(problem.hint or "") + why)


def _why_not(plan: ir.Plan, problem: Diagnostic, found: list[Diagnostic], fitting: list[dict[str, int]],
             options: list[dict[str, int]], axis: str, want: int | None) -> str:
    """Why '{axis}' cannot become `want`: it is not a whole number, the mesh outgrows the cluster, or the
    error the resized plan would have."""
    if want is None:
        return ""
    if not fitting:
        has = f"it runs over {plan.mesh.part}" if plan.mesh.part is not None else \
            f"the cluster has {plan.cluster.num_devices}"
        return f"; '{axis}' = {want} needs {plan.mesh.size // plan.mesh.degree(axis) * want} devices, {has}" \
            if options else ""
    already = {_key(d) for d in found if d.is_error and d is not problem}
    error = next((d for d in check_families(_resized(plan, fitting[0]))  # the whole checker judges it
                  if d.is_error and _key(d) not in already), None)
    return f"; '{axis}' = {want} gives {error.code}: {error.message}" if error else ""


def _merged(plan: ir.Plan, declared: int, count: int) -> tuple[ir.Plan, tuple[Edit, ...], str] | None:
    """The stages block with its `declared` stages relabelled into `count` (stage s -> s * count //
    declared, in order): the changed plan, the edits of each entry's label, and the labels' change."""
    stages = plan.stages
    groups, edits, shown = [], [], []
    for group in stages.groups:
        first, last = group.stages[0] * count // declared, group.stages[-1] * count // declared
        label = str(first) if first == last else f"{first}..{last + 1}"
        old = str(group.stages[0]) if len(group.stages) == 1 else f"{group.stages[0]}..{group.stages[-1] + 1}"
        span = group.field_spans.get("stages")
        if span is None:
            return None
        groups.append(group.model_copy(update={"stages": tuple(range(first, last + 1))}))
        if label != old:
            edits.append(Edit(span, label))
            shown.append(f"{old} -> {label}")
    merged = plan.model_copy(update={"stages": stages.model_copy(update={"groups": tuple(groups)})})
    return merged, tuple(edits), ", ".join(shown)
