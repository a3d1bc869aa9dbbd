"""The hints of E306 (a mesh axis no parallelism uses) and E307 (an axis two parallelisms use): a change
of roles or of the mesh after which the plan checks, each confirmed by checking the changed plan.

E306: the role the axis's name says (`tp`, `mp`: tensor), else the data parallelism takes the axis too
(`over [dp, x]`), else the axis shrinks to 1; at a parallelism written without `over`, the `over` the
lowering offers, with that change after it when the plan then leaves an axis unused (`confirm_over`). E307: one of the two moves to a free axis, else to a new
axis split off a data axis (`dp = 8` -> `dp = 4, pp = 2`) or, when the cluster has room, added. When no
change checks, the hint says what stops the plain one instead of offering an edit.
"""
from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, replace
from typing import Callable

from plandsl import ir
from plandsl.check.families import check_families
from plandsl.check.mesh import ROLE_OF_NAME, add_line_edit, move_edit, role_line, role_of, used_axes
from plandsl.diagnostics import Diagnostic, Edit, apply_edits
from plandsl.diagnostics.source import SourceFile, Span
from plandsl.lower.plan import DEFAULT_AXES
from plandsl.schedules.registry import DEFAULT_SCHEDULE

TRIES = 6  # changed plans checked per diagnostic


@dataclass(frozen=True)
class Change:
    plan: ir.Plan          # the plan as the edits leave it
    edits: tuple[Edit, ...]
    says: str              # the hint: what to change
    short: str = ""        # the change in a few words, for a hint that says why it does not check


def _key(problem: Diagnostic) -> tuple:
    return problem.code, problem.span


def _new_errors(change: Change, problem: Diagnostic, found: list[Diagnostic]) -> list[Diagnostic]:
    """The errors of the changed plan it did not have anyway (the problem itself counts as new)."""
    already = {_key(d) for d in found if d.is_error and d is not problem}
    return [d for d in check_families(change.plan) if d.is_error and _key(d) not in already]  # the whole checker


def _best(problem: Diagnostic, found: list[Diagnostic], changes: list[Change], fallback: str) -> Diagnostic:
    """`problem` with the first change that checks (hint and edits), else with `fallback` and what stops
    the first change: a hint that, followed, gives a plan that checks, or says why there is none."""
    changes = [c for c in changes if c.edits][:TRIES]
    blocked = None
    for change in changes:
        errors = _new_errors(change, problem, found)
        if not errors:
            return replace(problem, hint=change.says, edits=change.edits)
        blocked = blocked or (change, errors[0])
    if blocked is None:
        return replace(problem, hint=fallback, edits=())
    change, error = blocked
    return replace(problem, edits=(), hint=f"{fallback}; no one change makes the plan check ("
                   f"{change.short or change.says} gives {error.code}: {error.message})")


# ---- E306: an axis nothing uses ----------------------------------------------------------------------
def suggest_axis_use(plan: ir.Plan, problem: Diagnostic, found: list[Diagnostic]) -> Diagnostic:
    """`problem` (E306 at an unused mesh axis) with a use of that axis that checks."""
    axis = next((a for a in plan.mesh.axes if a.span == problem.span), None)
    if axis is None or axis.name in used_axes(plan):
        return problem
    changes = _role_by_name(plan, axis.name) + _data_too(plan, axis.name) + _shrink(plan, axis)
    return _best(problem, found, changes, f"give '{axis.name}' a parallelism to carry, or remove it from the mesh")


def _role_by_name(plan: ir.Plan, name: str) -> list[Change]:
    """The role the axis's name says (tp: tensor, mp: tensor, ...): added, or moved there."""
    role = next((r for r, default in DEFAULT_AXES.items() if default == name), None) or ROLE_OF_NAME.get(name)
    if role is None:
        return []
    current = role_of(plan, role)
    line = f"{role} = {role_line(plan, role)} over {name}"
    if current is None:
        return [Change(_with_role(plan, role, name), add_line_edit(plan, line), f"add `{line}`")]
    where = ", ".join(current.axes) if role == "data" else current.axis
    return [Change(_moved(plan, role, name), move_edit(plan, role, name),
                   f"`{role}` is over '{where}', not '{name}': did you mean `{line}`?", f"`{line}`")]


def _data_too(plan: ir.Plan, name: str) -> list[Change]:
    """The data parallelism over this axis as well (`over [dp, x]`), or over it alone when there is none."""
    data = plan.data
    if data is None:
        line = f"data = replicate over {name}"
        return [Change(_with_role(plan, "data", name), add_line_edit(plan, line), f"add `{line}`")]
    axes = (*data.axes, name)
    wider = plan.model_copy(update={"data": data.model_copy(update={"axes": axes})})
    listed = f"[{', '.join(axes)}]"
    kind = role_line(plan, "data")
    says = f"split the batch over '{name}' too: `data = {kind} over {listed}`"
    short = f"`data = {kind} over {listed}`"
    if not data.field_spans:  # the default data parallelism of an axis called dp: written out, with this axis
        return [Change(wider, add_line_edit(plan, f"data = {kind} over {listed}"), says, short)]
    last = data.field_spans.get(f"axes.{len(data.axes) - 1}")
    if last is None or data.span is None:
        return []
    if data.span.end == last.end and len(data.axes) == 1:  # `over dp`
        return [Change(wider, (Edit(last, listed),), says, short)]
    if data.span.end == last.end + 1:  # `over [dp, fsdp]`
        return [Change(wider, (Edit(_end_of(last), f", {name}"),), says, short)]
    return []


def _shrink(plan: ir.Plan, axis: ir.Axis) -> list[Change]:
    if axis.span is None:
        return []
    return [Change(_sized(plan, {axis.name: 1}), (Edit(axis.span, f"{axis.name} = 1"),),
                   f"set '{axis.name}' to 1 (no parallelism runs over it; the mesh keeps "
                   f"{plan.mesh.size // axis.size} devices)", f"'{axis.name}' = 1")]


# ---- E306 at a parallelism without `over`: the lowering's edit, checked ---------------------------------
def confirm_over(problem: Diagnostic, source: SourceFile, errors_of: Callable[[str], list[Diagnostic]]
                 ) -> Diagnostic:
    """`problem` (the lowering's E306 at a parallelism written without `over`, whose edit adds one) with an
    edit that checks: its own; else its own and then the edit of the one error the edited plan has, when
    that is an unused axis (E306, `suggest_axis_use`: `over [dp, x]`, or x = 1), as one change; else no
    edit, and the hint says what stops it. `errors_of(text)`: the errors of `source` with that text."""
    edited = apply_edits(source.text, problem.edits)
    errors = errors_of(edited)
    if not errors:
        return problem
    then = errors[0]
    if len(errors) == 1 and then.code == "E306" and then.edits and all(e.span.file == source.path for e in then.edits):
        final = apply_edits(edited, then.edits)
        after = errors_of(final)
        if not after:
            return replace(problem, hint=f"{problem.hint}; then {then.hint}", edits=edits_between(source, final))
        then = after[0]
    return replace(problem, edits=(), hint=f"{problem.hint}; no one change makes the plan check (with it the plan "
                   f"has {then.code}: {then.message})")


def edits_between(source: SourceFile, text: str) -> tuple[Edit, ...]:
    """`text` as replacements of `source`'s text: one per run of changed lines, trimmed to what changed."""
    before = source.text
    start = len(os.path.commonprefix([before, text]))
    tail = len(os.path.commonprefix([before[start:][::-1], text[start:][::-1]]))
    old = before[start:len(before) - tail].splitlines(keepends=True)
    new = text[start:len(text) - tail].splitlines(keepends=True)
    edits = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, old, new, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        at = start + sum(map(len, old[:i1]))
        was, now = "".join(old[i1:i2]), "".join(new[j1:j2])
        same = len(os.path.commonprefix([was, now]))
        same_end = len(os.path.commonprefix([was[same:][::-1], now[same:][::-1]]))
        edits.append(Edit(source.span(at + same, at + len(was) - same_end), now[same:len(now) - same_end]))
    return tuple(edits)


# ---- E307: an axis two parallelisms use -----------------------------------------------------------------
def suggest_axis_split(plan: ir.Plan, problem: Diagnostic, found: list[Diagnostic]) -> Diagnostic:
    """`problem` (E307 at the line of the parallelism to move) with a move that checks: to a free axis,
    else to a new axis split off a data axis or added to the mesh."""
    roles = [r for r in ("data", "tensor", "context", "experts", "stages")
             if role_of(plan, r) is not None and role_of(plan, r).span == problem.span]
    if len(roles) != 1:
        return problem
    moved = roles[0]
    free = [a.name for a in plan.mesh.axes if a.name not in used_axes(plan)]
    changes = [Change(_moved(plan, moved, name), move_edit(plan, moved, name),
                      f"the mesh's axis '{name}' is unused: `{moved} = {role_line(plan, moved)} over {name}`",
                      f"`{moved} = {role_line(plan, moved)} over {name}`") for name in free]
    changes += _new_axis(plan, moved)
    if not [c for c in changes if c.edits]:
        return replace(problem, edits=(), hint=f"give `{moved}` an axis of its own: the mesh has no free axis, "
                       "no data axis to split and the cluster no room for another; make one axis smaller and add "
                       f"one (e.g. `{DEFAULT_AXES[moved]} = 2`) for `{moved}`")
    return _best(problem, found, changes, f"give `{moved}` an axis of its own: add one to the mesh (e.g. "
                 f"`{DEFAULT_AXES[moved]} = 2`) and name it here")


def _new_axis(plan: ir.Plan, role: str) -> list[Change]:
    """`role` over a new axis named as usual (pp, tp, ...): split off a data axis, or added to the mesh."""
    name = DEFAULT_AXES[role]
    mesh = plan.mesh
    if mesh.axis(name) is not None or not move_edit(plan, role, name):
        return []
    last = mesh.axes[-1]
    if last.span is None:
        return []
    line = f"`{role} = {role_line(plan, role)} over {name}`"
    changes = []
    for source in [a for a in (plan.data.axes if plan.data else ()) if mesh.axis(a) and mesh.axis(a).span]:
        old = mesh.axis(source)
        for size in [k for k in range(2, old.size + 1) if old.size % k == 0][:3]:
            after = last if role == "tensor" else old  # tensor innermost; the others beside the axis split
            axes = _inserted(mesh.axes, after.name, ir.Axis(name=name, size=size), {source: old.size // size})
            if after is old:
                edits = (Edit(old.span, f"{source} = {old.size // size}, {name} = {size}"),)
            else:
                edits = (Edit(old.span, f"{source} = {old.size // size}"), Edit(_end_of(last.span), f", {name} = {size}"))
            changes.append(Change(_moved(_meshed(plan, axes), role, name), edits + move_edit(plan, role, name),
                                  f"split '{source}' for a new axis: `{source} = {old.size // size}, "
                                  f"{name} = {size}` in the mesh, and {line}", f"`{name} = {size}` split off '{source}'"))
    room = plan.cluster.num_devices // mesh.size if mesh.part is None else 1
    for size in [k for k in (2, 4, 8) if k <= room][:2]:
        axes = _inserted(mesh.axes, last.name, ir.Axis(name=name, size=size), {})
        changes.append(Change(_moved(_meshed(plan, axes), role, name),
                              (Edit(_end_of(last.span), f", {name} = {size}"),) + move_edit(plan, role, name),
                              f"add `{name} = {size}` to the mesh (it then has {mesh.size * size} devices) "
                              f"and {line}", f"a new axis `{name} = {size}`"))
    return changes


# ---- changed plans -----------------------------------------------------------------------------------------
def _moved(plan: ir.Plan, role: str, axis: str) -> ir.Plan:
    part = role_of(plan, role)
    update = {"axes": (axis,)} if role == "data" else {"axis": axis}
    return plan.model_copy(update={role: part.model_copy(update=update)})


def _with_role(plan: ir.Plan, role: str, axis: str) -> ir.Plan:
    """`plan` with the line `role = ... over axis` added, as lowering would make it."""
    part = {"data": lambda: ir.DataParallel(kind=ir.DataKind.replicate, axes=(axis,)),
            "tensor": lambda: ir.TensorParallel(axis=axis), "context": lambda: ir.ContextParallel(axis=axis),
            "experts": lambda: ir.ExpertParallel(axis=axis), "stages": lambda: ir.Stages(axis=axis)}[role]()
    update = {role: part}
    if role == "stages" and plan.schedule is None:
        update["schedule"] = ir.ScheduleRef(name=DEFAULT_SCHEDULE)
    return plan.model_copy(update=update)


def _sized(plan: ir.Plan, sizes: dict[str, int]) -> ir.Plan:
    return _meshed(plan, tuple(a.model_copy(update={"size": sizes.get(a.name, a.size)}) for a in plan.mesh.axes))


def _meshed(plan: ir.Plan, axes: tuple[ir.Axis, ...]) -> ir.Plan:
    return plan.model_copy(update={"mesh": plan.mesh.model_copy(update={"axes": axes})})


def _inserted(axes: tuple[ir.Axis, ...], after: str, new: ir.Axis, sizes: dict[str, int]) -> tuple[ir.Axis, ...]:
    out = []
    for axis in axes:
        out.append(axis.model_copy(update={"size": sizes.get(axis.name, axis.size)}))
        if axis.name == after:
            out.append(new)
    return tuple(out)


def _end_of(span: Span) -> Span:
    return Span(span.file, span.end_line, span.end_column, span.end_line, span.end_column, span.end, span.end)
