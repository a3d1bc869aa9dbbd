"""The attributes of a body and the keys of a `{ ... }` value, checked against what a definition allows
(E205-E207, E213), and IR nodes built with a validator's complaint as E205 at the field that caused it.
Shared by every lowering module; imports nothing else of `plandsl.lower` but the evaluator and its hints.
"""
from __future__ import annotations

from pydantic import ValidationError

from plandsl import syntax as s
from plandsl.diagnostics import Note
from plandsl.lower.evaluate import Poison, Scope, Word
from plandsl.lower.hints import report_misspelled, respelled


def attributes(scope: Scope, body: tuple, allowed: dict[str, bool], what: str) -> dict[str, s.Attr]:
    """The attributes of a body by name; reports unknown (E206), duplicate (E213), missing (E207).

    `allowed` maps each attribute name to whether it is required.
    """
    found: dict[str, s.Attr] = {}
    for stmt in body:
        if not isinstance(stmt, s.Attr):
            continue
        if stmt.name not in allowed:
            report_misspelled(scope.reporter, "E206", f"{what} has no attribute '{stmt.name}'", stmt.name,
                              stmt.name_span, allowed, f"attributes of {what}")
        elif stmt.name in found:
            scope.reporter.error("E213", f"'{stmt.name}' is set twice", stmt.name_span,
                                 notes=[Note("first set", found[stmt.name].name_span)])
        else:
            found[stmt.name] = stmt
    return found


def require(scope: Scope, found: dict[str, s.Attr], allowed: dict[str, bool], what: str, span,
            body: tuple = ()) -> bool:
    """Report required attributes that are missing (E207), except one a misspelled attribute of `body`
    stands for: that was reported once, as E206 with its did-you-mean."""
    missing = [name for name, required in allowed.items() if required and name not in found]
    meant = respelled([(stmt.name, stmt.name_span) for stmt in body if isinstance(stmt, s.Attr)], allowed)
    for name in missing:
        if name in meant:
            continue
        scope.reporter.error("E207", f"{what} is missing '{name}'", span,
                             hint=f"add `{name} = ...` to its body")
    return not missing


def dict_items(scope: Scope, expr: s.Expr, allowed: dict[str, bool], what: str) -> dict[str, s.DictItem]:
    expr, scope_ = scope.deref(expr)
    if isinstance(expr, s.Name) and expr.id not in scope_.locals and scope_.find(expr.id) is None:
        raise scope_.unknown(Word(expr.id, expr.span))  # `train = tiny_train` without its import
    if isinstance(expr, s.BinOp) and expr.op == "-":
        scope_.dashed(expr)  # `train = tiny-train`: E201 naming `tiny_train`
    if not isinstance(expr, s.DictExpr):
        raise scope.reporter.error("E205", f"{what} takes `{{ key: value, ... }}`", expr.span)
    found: dict[str, s.DictItem] = {}
    meant: set[str] = set()  # keys a misspelling stands for: not reported missing as well
    for item in expr.items:
        if item.key not in allowed:
            meant |= report_misspelled(scope.reporter, "E206", f"{what} has no key '{item.key}'", item.key,
                                       item.key_span, allowed, f"keys of {what}")
        elif item.key in found:
            scope.reporter.error("E213", f"'{item.key}' is given twice", item.key_span,
                                 notes=[Note("first given", found[item.key].key_span)])
        else:
            found[item.key] = item
    missing = [k for k, required in allowed.items() if required and k not in found]
    if missing and set(missing) <= meant:
        raise Poison()  # reported as the misspelled key
    missing = [k for k in missing if k not in meant]
    if missing:
        raise scope.reporter.error("E207", f"{what} is missing {', '.join(repr(m) for m in missing)}", expr.span,
                                   hint=f"add {', '.join(f'{m}: ...' for m in missing)}")
    return found


def build(scope: Scope, cls, span, /, **fields):
    """Construct an IR node; a validator's complaint becomes E205 at the field it names (when `field_spans`
    says where that field was written), else at `span`."""
    try:
        return cls(span=span, **fields)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        at = (fields.get("field_spans") or {}).get(str(first["loc"][0])) if first["loc"] else None
        raise scope.reporter.error("E205", f"{where}: {first['msg'].lower()}", at or span) from None
