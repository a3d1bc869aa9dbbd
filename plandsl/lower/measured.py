"""Measured tables (what `plandsl profile` writes) -> IR: a device's GEMMs and a link's collectives.

Stage: lowering. Contract: `measured_table(scope, expr, peak, precision)` returns a device's
`measured: [[m, n, k, time], ...]` as `ir.GemmPoint`s sorted by FLOPs, or reports E216 (not a table of
[m, n, k, time] rows with positive whole m, n, k, each shape once, at most `MAX_MEASURED` rows) and E217
(a row faster than the device's peak allows: 2mnk / time above the peak of its precision, or slower than
`MIN_RATE`, 1 FLOP/s);
`attention_curve(scope, expr)` returns a device's `attention_by_sequence: [[tokens, ratio], ...]` as
`ir.AttentionPoint`s sorted by tokens, or reports E205 (not 1 to `MAX_MEASURED` rows [tokens, ratio] with tokens
a positive whole number, each once, and a positive ratio); `measured_collectives(scope, expr, what)` returns a
link's `measured: { all_reduce: [[ranks, bytes, time], ...], ... }` as `ir.CommPoint`s per collective sorted by
bytes, or reports E216 (an unknown collective, a row that is not [ranks, bytes, time] with ranks a whole number of
at least 2, a (ranks, bytes) twice). Each error points at the row or key that breaks it.
"""
from __future__ import annotations

from plandsl import ir
from plandsl import syntax as s
from plandsl.diagnostics import Note
from plandsl.lower.bodies import build
from plandsl.lower.evaluate import Scope, Word
from plandsl.lower.units import BYTES, TIME

MAX_MEASURED = 256
MIN_RATE = 1.0
"""The least rate a device or link may state or imply (FLOP/s, B/s): a plan's work (at most ~1e40 FLOPs or bytes
under docs/language.md's Limits) over it stays far below the largest float, where a smaller one made times infinite."""
"""Rows of one table: `plandsl profile` writes at most a dozen; the cost model reads them per GEMM."""
ROW = "[m, n, k, time]"


def measured_table(scope: Scope, expr: s.Expr, peak: float, precision: str) -> tuple[ir.GemmPoint, ...]:
    expr, inner = scope.deref(expr)
    if not isinstance(expr, s.ListExpr) or not expr.items:
        raise scope.reporter.error("E216", f"measured takes a list of {ROW} rows", expr.span,
                                   hint="e.g. `measured: [[1024, 1024, 1024, 2.9 ms], [4096, 4096, 4096, 160 ms]]`")
    if len(expr.items) > MAX_MEASURED:
        raise scope.reporter.error("E216", f"measured has {len(expr.items)} rows, above the limit of {MAX_MEASURED}",
                                   expr.span, hint="keep a row per shape that matters: sizes spaced by 2x to 4x")
    rows: list[ir.GemmPoint] = []
    seen: dict[tuple[int, int, int], s.Expr] = {}
    for item in expr.items:
        row, row_scope = inner.deref(item)
        if not isinstance(row, s.ListExpr) or len(row.items) != 4:
            raise scope.reporter.error("E216", f"a measured row is {ROW}, found `{inner.text(item)}`", item.span,
                                       hint="e.g. `[1024, 1024, 1024, 2.9 ms]`: the GEMM's m, n and k, and its time")
        shape = tuple(_dimension(row_scope, e, name) for e, name in zip(row.items[:3], "mnk"))
        seconds = row_scope.quantity(row.items[3], TIME, "a measured GEMM's time")
        if shape in seen:
            raise scope.reporter.error("E216", f"GEMM {' x '.join(map(str, shape))} is measured twice", item.span,
                                       notes=[Note("first measured", seen[shape].span)],
                                       hint="keep one row per shape (the median of its runs)")
        seen[shape] = item
        rate = 2.0 * shape[0] * shape[1] * shape[2] / seconds
        if rate < MIN_RATE:  # a plan's GEMMs over it, interpolated from it, would take no finite time
            raise scope.reporter.error("E217", f"GEMM {' x '.join(map(str, shape))} in {inner.text(row.items[3])} "
                                       f"runs at {rate:.4g} FLOP/s, below {MIN_RATE:g} FLOP/s", item.span,
                                       hint="a measured time is at most 2mnk seconds (1 FLOP/s): correct the time or "
                                            "its unit")
        if rate > peak * (1 + 1e-9):
            raise scope.reporter.error("E217", f"GEMM {' x '.join(map(str, shape))} in {inner.text(row.items[3])} "
                                       f"runs at {rate / 1e12:.4g} TFLOP/s, above the device's {precision} peak "
                                       f"({peak / 1e12:.4g} TFLOP/s)", item.span,
                                       hint="a measured time cannot beat the peak: raise the peak to the fastest "
                                            "GEMM measured, or correct the time")
        rows.append(build(row_scope, ir.GemmPoint, item.span, m=shape[0], n=shape[1], k=shape[2], seconds=seconds))
    return tuple(sorted(rows, key=lambda p: (p.m * p.n * p.k, p.m, p.n, p.k)))


def attention_curve(scope: Scope, expr: s.Expr) -> tuple[ir.AttentionPoint, ...]:
    """A device's `attention_by_sequence: [[tokens, ratio], ...]` (the attention kernel's speed at each sequence
    length, as a ratio to its `attention` and `attention_backward` figures) sorted by tokens, or E205: not a list of
    [tokens, ratio] rows with tokens a positive whole number, each once, and a positive ratio, at most
    `MAX_MEASURED` rows."""
    expr, inner = scope.deref(expr)
    if not isinstance(expr, s.ListExpr) or not expr.items or len(expr.items) > MAX_MEASURED:
        raise scope.reporter.error("E205", f"attention_by_sequence takes 1 to {MAX_MEASURED} rows [tokens, ratio]",
                                   expr.span, hint="e.g. `attention_by_sequence: [[2048, 0.8], [8192, 1]]`: the "
                                                   "kernel at 0.8 of its figures at 2,048 tokens")
    rows: dict[int, ir.AttentionPoint] = {}
    for item in expr.items:
        row, row_scope = inner.deref(item)
        if not isinstance(row, s.ListExpr) or len(row.items) != 2:
            raise scope.reporter.error("E205", f"an attention_by_sequence row is [tokens, ratio], found "
                                       f"`{inner.text(item)}`", item.span,
                                       hint="e.g. `[2048, 0.8]`: the sequence length and the kernel's speed there "
                                            "as a ratio to `attention` and `attention_backward`")
        tokens = _whole(row_scope, row.items[0], "E205", "an attention_by_sequence row's tokens")
        ratio = row_scope.number(row_scope.eval(row.items[1]), row.items[1])
        if not ratio > 0:
            raise scope.reporter.error("E205", f"an attention_by_sequence ratio is above 0, found {ratio:g}",
                                       row.items[1].span)
        if tokens in rows:
            raise scope.reporter.error("E205", f"attention_by_sequence gives {tokens:,} tokens twice", item.span,
                                       hint="keep one row per sequence length")
        rows[tokens] = build(row_scope, ir.AttentionPoint, item.span, tokens=tokens, ratio=float(ratio))
    return tuple(rows[tokens] for tokens in sorted(rows))


def measured_collectives(scope: Scope, expr: s.Expr, what: str) -> dict[str, tuple[ir.CommPoint, ...]]:
    expr, inner = scope.deref(expr)
    if not isinstance(expr, s.DictExpr) or not expr.items:
        raise scope.reporter.error("E216", f"{what} measured takes `{{ collective: [[ranks, bytes, time], ...] }}`",
                                   expr.span, hint="e.g. `measured: { all_reduce: [[2, 1 MiB, 2.3 ms]] }`")
    tables: dict[str, tuple[ir.CommPoint, ...]] = {}
    for item in expr.items:
        if item.key not in ir.COLLECTIVES:
            raise scope.reporter.error("E216", f"{what} measured: no collective '{item.key}'", item.key_span,
                                       hint=f"one of {', '.join(ir.COLLECTIVES)}")
        if item.key in tables:
            raise scope.reporter.error("E216", f"{what} measured: '{item.key}' is given twice", item.key_span)
        rows, row_scope = inner.deref(item.value)
        if not isinstance(rows, s.ListExpr) or not rows.items or len(rows.items) > MAX_MEASURED:
            raise scope.reporter.error("E216", f"{what} measured {item.key} takes 1 to {MAX_MEASURED} rows "
                                       "[ranks, bytes, time]", item.value.span)
        points: dict[tuple[int, float], ir.CommPoint] = {}
        for row_expr in rows.items:
            row, cell_scope = row_scope.deref(row_expr)
            if not isinstance(row, s.ListExpr) or len(row.items) != 3:
                raise scope.reporter.error("E216", f"a measured {item.key} row is [ranks, bytes, time], found "
                                           f"`{row_scope.text(row_expr)}`", row_expr.span,
                                           hint="e.g. `[2, 1 MiB, 2.3 ms]`: the ranks, the bytes, the time")
            ranks = _dimension(cell_scope, row.items[0], "ranks")
            if ranks < 2:
                raise scope.reporter.error("E216", f"a measured {item.key} runs over 2 or more ranks, found {ranks}",
                                           row.items[0].span)
            nbytes = cell_scope.quantity(row.items[1], BYTES, f"a measured {item.key}'s bytes")
            seconds = cell_scope.quantity(row.items[2], TIME, f"a measured {item.key}'s time")
            if (ranks, nbytes) in points:
                raise scope.reporter.error("E216", f"{item.key} over {ranks} ranks of {cell_scope.text(row.items[1])} "
                                           "is measured twice", row_expr.span,
                                           hint="keep one row per size (the median of its runs)")
            points[(ranks, nbytes)] = build(cell_scope, ir.CommPoint, row_expr.span, ranks=ranks, bytes=nbytes,
                                            seconds=seconds)
        tables[item.key] = tuple(sorted(points.values(), key=lambda p: (p.bytes, p.ranks)))
    return tables


def _dimension(scope: Scope, expr: s.Expr, name: str) -> int:
    return _whole(scope, expr, "E216", f"a measured row's {name}", hint=f"rows are {ROW}")


def _whole(scope: Scope, expr: s.Expr, code: str, what: str, hint: str | None = None) -> int:
    """`expr`'s value, a positive whole number (a float that is one taken as it), or `code`: "`what` is a positive
    whole number"."""
    value = scope.eval(expr)
    if isinstance(value, Word):
        raise scope.unknown(value)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise scope.reporter.error(code, f"{what} is a positive whole number, found `{scope.text(expr)}`", expr.span,
                                   hint=hint)
    return value
