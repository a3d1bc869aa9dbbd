"""The hint of E406 (an axis that does not divide a dim it splits): the sizes of that axis that check.

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
from plandsl.check.sharding import axis_at, divisors, split_extents
from plandsl.diagnostics import Diagnostic, Edit

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


def _errors(plan: ir.Plan) -> set[str]:
    from plandsl.check import check_plan  # the whole checker judges each resized plan
    return {d.code for d in check_plan(plan, suggest=False) if d.is_error}


def suggest_axis_size(plan: ir.Plan, problem: Diagnostic, found: list[Diagnostic]) -> Diagnostic:
    """`problem` (an E406) with a hint naming sizes that check and an edit to the best of them."""
    axis = axis_at(plan, problem.span)
    if axis is None or plan.mesh.axis(axis) is None:
        return problem
    already = {d.code for d in found if d.is_error and d.code != "E406"}
    good = [sizes for sizes in _candidates(plan, axis) if _errors(_resized(plan, sizes)) <= already]
    if not good:
        return replace(problem, hint=f"{problem.hint}; no such size fits this mesh and cluster: change the model "
                                     f"or the cluster" if problem.hint else None)
    best = good[0]
    change = " and ".join(f"'{name}' to {size}" for name, size in best.items())
    keeps = f" (the mesh keeps its {plan.mesh.size} devices)" if len(best) > 1 else ""
    others = sorted({sizes[axis] for sizes in good[1:]} - {best[axis]})
    extents = split_extents(plan, axis)
    splits = f": {best[axis]} divides {', '.join(f'{n} ({v})' for n, v in extents.items())}" if extents else ""
    more = f"; other sizes that check: {', '.join(map(str, others))}" if others else ""
    edits = tuple(Edit(plan.mesh.axis(name).span, f"{name} = {size}") for name, size in best.items()
                  if plan.mesh.axis(name).span is not None)
    return replace(problem, hint=f"set {change}{keeps}{splits}{more}", edits=edits)
