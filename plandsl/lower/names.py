"""Named values (params, `let`s) computed from a Python stack of bounded depth.

`Chain.value(cache, key, scope, expr)` is `cache[key]`, computed once as `scope.eval(expr)`; a
chain `let a2 = a1 + a1` of any length evaluates without deep recursion (no E106 past ~2,000 links).
"""
from __future__ import annotations

from typing import Any, Protocol

from plandsl import syntax as s


class Scope(Protocol):
    """What a chain needs of `evaluate.Scope` (named here so that names does not import evaluate)."""

    reporter: Any

    def eval(self, expr: s.Expr) -> Any: ...


class Poison(Exception):
    """A value that could not be computed; its diagnostic has already been reported."""


MAX_CHAIN = 48  # names evaluated inside one another before the deepest is deferred to a shallow stack


class _Deferred(BaseException):
    """Unwinds an evaluation that went MAX_CHAIN names deep, up to its chain's outermost name.
    A BaseException, so that no handler between the two can take it for an error."""

    def __init__(self, chain: "Chain", cache: dict, key: str, scope: Scope, expr: s.Expr,
                 evaluating: set[str] | None, mark: str | None):
        self.chain, self.cache, self.key, self.scope, self.expr = chain, cache, key, scope, expr
        self.evaluating, self.mark = evaluating, mark


class Chain:
    """Evaluates named values (params, lets) without deep recursion.

    A name whose value is needed MAX_CHAIN names deep is deferred: the evaluation unwinds to the
    outermost name, which computes the deferred one first, from a shallow stack, then retries.
    Values are cached, so a chain of n links costs about 2n evaluations and n / MAX_CHAIN retries;
    a name that failed is remembered for the run, so a retry raises its Poison again without
    reporting it twice. Cycles are still found by `Scope.name` (a deferred name stays marked).
    """

    def __init__(self) -> None:
        self.depth = 0
        self.failed: set[tuple[int, str]] = set()

    def value(self, cache: dict, key: str, scope: Scope, expr: s.Expr, evaluating: set[str] | None = None,
              mark: str | None = None) -> Any:
        """`cache[key]`, computed as `scope.eval(expr)` if missing; `mark` stays in `evaluating` meanwhile."""
        if key in cache:
            return cache[key]
        if (id(cache), key) in self.failed:
            raise Poison()
        if self.depth >= MAX_CHAIN:
            raise _Deferred(self, cache, key, scope, expr, evaluating, mark)
        if self.depth:
            self.depth += 1
            try:
                cache[key] = scope.eval(expr)
            finally:
                self.depth -= 1
            return cache[key]
        return self._outermost(cache, key, scope, expr)

    def _outermost(self, cache: dict, key: str, scope: Scope, expr: s.Expr) -> Any:
        pending: list[tuple[dict, str, Scope, s.Expr, set[str] | None, str | None]] = [
            (cache, key, scope, expr, None, None)]
        try:
            while pending:
                at, name, where, value, evaluating, mark = pending[-1]
                if name not in at and (id(at), name) not in self.failed:
                    self.depth = 1
                    try:
                        try:
                            at[name] = where.eval(value)
                        except RecursionError:  # an expression thousands of operators deep, in a `let` it uses
                            raise where.reporter.error(
                                "E106", "an expression is nested too deeply to evaluate", value.span,
                                hint="split long sums and chains of operators with `let` definitions") from None
                    except _Deferred as deferred:
                        if deferred.chain is not self:
                            raise
                        marked = deferred.evaluating is not None and deferred.mark not in deferred.evaluating
                        if marked:  # still being evaluated: a cycle back to it is found
                            deferred.evaluating.add(deferred.mark)
                        pending.append((deferred.cache, deferred.key, deferred.scope, deferred.expr,
                                        deferred.evaluating if marked else None, deferred.mark))
                        continue
                    except Poison:
                        if len(pending) == 1:
                            raise
                        self.failed.add((id(at), name))
                    finally:
                        self.depth = 0
                pending.pop()
                if evaluating is not None:
                    evaluating.discard(mark)
            return cache[key]
        finally:
            for *_, evaluating, mark in pending:
                if evaluating is not None:
                    evaluating.discard(mark)
            self.failed.clear()
