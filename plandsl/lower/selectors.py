"""Layer selectors -> IR: `blocks[0:12]`, `layers.*.mlp`, `"embed"` as `ir.Selector` parts (stages and
shard rules), and the exact layer names a model's layer declaration lists (E205, E505)."""
from __future__ import annotations

from plandsl import ir
from plandsl import syntax as s
from plandsl.diagnostics.limits import MAX_LAYERS
from plandsl.lower.evaluate import Scope


def selector(scope: Scope, expr: s.Expr) -> ir.Selector:
    parts = _selector_parts(scope, expr)
    return ir.Selector(text=selector_text(parts), parts=tuple(parts), span=expr.span)


def _selector_parts(scope: Scope, expr: s.Expr) -> list[ir.SelectorPart]:
    if isinstance(expr, s.Name):
        return [ir.SelectorPart(kind="any" if expr.id == "*" else "name", name=expr.id)]
    if isinstance(expr, s.Str):
        parts = []
        for piece in expr.value.split("."):
            if not piece:
                raise scope.reporter.error("E205", f"'{expr.value}' is not a layer name", expr.span)
            parts.append(ir.SelectorPart(kind="any") if piece == "*" else ir.SelectorPart(kind="name", name=piece))
        return parts
    if isinstance(expr, s.Member):
        part = ir.SelectorPart(kind="any") if expr.name == "*" else ir.SelectorPart(kind="name", name=expr.name)
        return _selector_parts(scope, expr.obj) + [part]
    if isinstance(expr, s.Subscript):
        head = _selector_parts(scope, expr.obj)
        if isinstance(expr.index, s.Slice):
            lo = scope.integer(expr.index.lo, "range start", minimum=0) if expr.index.lo else 0
            hi = scope.integer(expr.index.hi, "range end", minimum=0) if expr.index.hi else None
            if hi is not None and hi <= lo:
                raise scope.reporter.error("E205", f"range [{lo}:{hi}] is empty", expr.index.span)
            return head + [ir.SelectorPart(kind="range", lo=lo, hi=hi)]
        index = scope.integer(expr.index, "layer index", minimum=0)
        return head + [ir.SelectorPart(kind="name", name=str(index))]
    raise scope.reporter.error("E205", "expected a layer name, range or glob, like `layers[0:8]` or `layers.*.mlp`",
                               expr.span)


def selector_text(parts: list[ir.SelectorPart]) -> str:
    text = ""
    for part in parts:
        if part.kind == "range":
            text += f"[{part.lo}:{'' if part.hi is None else part.hi}]"
        else:
            text += ("." if text else "") + ("*" if part.kind == "any" else part.name)
    return text


def layer_names(scope: Scope, expr: s.Expr) -> list[str]:
    """`blocks[0:12]` -> blocks.0 .. blocks.11; `embed` -> embed (layer declarations)."""
    parts = _selector_parts(scope, expr)
    names = [""]
    for part in parts:
        if part.kind == "any" or (part.kind == "range" and part.hi is None):
            raise scope.reporter.error("E205", "a layer declaration names its layers exactly: no `*` or open ranges",
                                       expr.span)
        pieces = [part.name] if part.kind == "name" else [str(i) for i in range(part.lo, min(part.hi, part.lo + MAX_LAYERS + 1))]
        names = [f"{n}.{p}" if n else p for n in names for p in pieces]
        if len(names) > MAX_LAYERS:
            raise scope.reporter.error("E505", f"a model may declare at most {MAX_LAYERS:,} layers", expr.span)
    return names
