"""Expressions -> values, inside the scope of one file (E201, E203-E205, E211).

Values are Python numbers, strings and booleans, `Q` for quantities with units (SI),
`Word` for a bare name that is not defined (an enum word or an axis name: its meaning
is decided by where it is used), `Rep` for `8 x a100`, and IR objects for definitions.
`let` names are macros: `Scope.deref` follows them to the expression they stand for,
so errors point at where a value was written; their values are computed once per name and
scope (a chain `let a2 = a1 + a1` costs one evaluation per link, not 2^links), and a chain of
any length is computed from a stack of bounded depth (`names.Chain`).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Callable

from plandsl import syntax as s
from plandsl.diagnostics import Diagnostic, Note, diag, did_you_mean, respell
from plandsl.lower.hints import dashed_name_hint, unknown_name_hint
from plandsl.lower.names import Chain, Poison
from plandsl.diagnostics.source import Span
from plandsl.lower.units import Dimension, lookup, suggest


@dataclass(frozen=True, slots=True)
class Q:
    value: float
    dimension: Dimension


@dataclass(frozen=True, slots=True)
class Word:
    name: str
    span: Span


@dataclass(frozen=True, slots=True)
class Rep:
    """`count x thing` (either order in the source)."""
    count: Any
    thing: Any
    count_expr: s.Expr
    thing_expr: s.Expr


MATH: dict[str, Callable[..., Any]] = {
    "min": lambda *a: min(a), "max": lambda *a: max(a), "abs": abs,  # min(a) of one number is a
    "ceil": lambda x: math.ceil(x), "floor": lambda x: math.floor(x),
}
ONE_ARGUMENT = ("abs", "ceil", "floor")


class Reporter:
    def __init__(self) -> None:
        self.diagnostics: list[Diagnostic] = []
        self.chain = Chain()  # one per reporter: the scopes that report together evaluate together

    def error(self, code: str, message: str, span: Span | None, hint: str | None = None,
              notes=(), edits=()) -> Poison:
        self.diagnostics.append(diag(code, message, span, hint, notes, edits=edits))
        return Poison()

    def warn(self, code: str, message: str, span: Span | None, hint: str | None = None, notes=(), edits=()) -> None:
        self.diagnostics.append(diag(code, message, span, hint, notes, edits=edits))


class Scope:
    """Names visible in one file: its own params, lets and definitions, then its imports'.

    `resolve_definition(kind, definition)` is supplied by the lowering: it turns a
    device/node/cluster/model/schedule definition into its IR object (memoised there).
    """

    def __init__(self, reporter: Reporter, file: str, resolve_definition: Callable[["Scope", s.Definition], Any],
                 param_overrides: dict[str, Any] | None = None):
        self.reporter = reporter
        self.file = file
        self.resolve_definition = resolve_definition
        self.params: dict[str, s.Param] = {}
        self.lets: dict[str, s.Let] = {}
        self.definitions: dict[str, s.Definition] = {}
        self.imported: list[Scope] = []
        self.overrides = dict(param_overrides or {})
        self.locals: dict[str, Any] = {}
        self.source = None  # the SourceFile, set by the lowering
        self.used: set[str] = set()
        self._param_values: dict[str, Any] = {}
        self._let_values: dict[str, Any] = {}  # file:name -> value, for this scope's locals
        self._evaluating: set[str] = set()

    # ---- names -------------------------------------------------------------------
    def own(self, name: str):
        return self.params.get(name) or self.lets.get(name) or self.definitions.get(name)

    def find(self, name: str) -> tuple["Scope", Any] | None:
        found = self.own(name)
        if found is not None:
            return self, found
        for other in self.imported:
            found = other.own(name)
            if found is not None:
                return other, found
        return None

    def visible_names(self) -> set[str]:
        names = set(self.params) | set(self.lets) | set(self.definitions) | set(self.locals)
        for other in self.imported:
            names |= set(other.params) | set(other.lets) | set(other.definitions)
        return names

    def plan_names(self) -> set[str]:
        return {name for scope in (self, *self.imported) for name, d in scope.definitions.items()
                if getattr(d, "kind", None) == "plan"}

    def with_locals(self, values: dict[str, Any]) -> "Scope":
        child = Scope.__new__(Scope)
        child.__dict__.update(self.__dict__)
        child.locals = {**self.locals, **values}
        child._let_values = {}  # a `let` may read the locals (a template's sizes): its value is the child's own
        return child

    def deref(self, expr: s.Expr) -> tuple[s.Expr, "Scope"]:
        """Follow names bound by `let` to the expression they stand for."""
        scope = self
        seen: set[tuple[str, str]] = set()
        while isinstance(expr, s.Name) and expr.id not in scope.locals:
            found = scope.find(expr.id)
            if found is None or not isinstance(found[1], s.Let):
                break
            key = (found[0].file, expr.id)
            if key in seen:
                raise self.reporter.error("E211", f"`let {expr.id}` refers to itself through other `let`s",
                                          expr.span)
            seen.add(key)
            found[0].used.add(expr.id)
            scope, expr = found[0], found[1].value
        return expr, scope

    # ---- evaluation --------------------------------------------------------------
    def name(self, expr: s.Name) -> Any:
        if expr.id in self.locals:
            return self.locals[expr.id]
        found = self.find(expr.id)
        if found is None:
            return Word(expr.id, expr.span)
        scope, node = found
        scope.used.add(expr.id)
        key = f"{scope.file}:{expr.id}"
        if key in self._evaluating:
            raise self.reporter.error("E211", f"'{expr.id}' is defined in terms of itself", expr.span)
        self._evaluating.add(key)
        try:
            if isinstance(node, s.Param):
                return scope.param_value(node, self._evaluating, key)
            if isinstance(node, s.Let):
                # evaluated once, in the scope it was found in: this one for a `let` of this file (it may
                # read the locals: `with_locals` gives a child its own cache), its own file's for an import
                return self.reporter.chain.value(scope._let_values, key, scope, node.value, self._evaluating, key)
            return scope.resolve_definition(scope, node)
        finally:
            self._evaluating.discard(key)

    def param_value(self, node: s.Param, evaluating: set[str] | None = None, mark: str | None = None) -> Any:
        if node.name in self.overrides:
            return self._param_values.setdefault(node.name, self.overrides[node.name])
        return self.reporter.chain.value(self._param_values, node.name, self, node.value, evaluating, mark)

    def eval(self, expr: s.Expr) -> Any:
        method = getattr(self, f"_eval_{type(expr).__name__}", None)
        if method is None:
            raise self.reporter.error("E205", "this expression has no value here", expr.span)
        try:
            return method(expr)
        except (OverflowError, ValueError) as error:  # 1e400, 10**400 / 3, ceil(inf)
            raise self.reporter.error("E211", f"arithmetic out of range: {error}", expr.span,
                                      hint="plans count devices, layers and bytes: keep numbers below 1e300") from None

    def _eval_Int(self, e: s.Int):
        return e.value

    def _eval_Float(self, e: s.Float):
        return e.value

    def _eval_Str(self, e: s.Str):
        return e.value

    def _eval_Bool(self, e: s.Bool):
        return e.value

    def _eval_Name(self, e: s.Name):
        return self.name(e)

    def _eval_Quantity(self, e: s.Quantity):
        found = lookup(e.unit)
        if found is None:
            close = suggest(e.unit)
            raise self.reporter.error("E204", f"unknown unit '{e.unit}'", e.span,
                                      hint=f"did you mean '{close}'?" if close else
                                      "units: B KB MB GB KiB MiB GiB, B/s GB/s Gb/s, FLOP/s TFLOP/s, s ms us ns",
                                      edits=respell(e.unit, (), e.span, at_end=True, to=close) if close else ())
        dimension, factor = found
        return Q(float(f"{e.value * factor:.15g}"), dimension)  # 5 us is 5e-06, not 4.9999999999999996e-06

    def _eval_Unary(self, e: s.Unary):
        value = self.eval(e.operand)
        if e.op == "not":
            return not self.truth(value, e.operand)
        if isinstance(value, Q):
            return Q(-value.value, value.dimension)
        return -self.number(value, e.operand)

    def _eval_Call(self, e: s.Call):
        if isinstance(e.func, s.Name) and e.func.id in MATH and self.find(e.func.id) is None:
            args = [self.number(self.eval(a), a) for a in e.args]
            if e.kwargs or not args or (e.func.id in ONE_ARGUMENT and len(args) != 1):
                raise self.reporter.error("E205", f"{e.func.id}() takes "
                                          f"{'one number' if e.func.id in ONE_ARGUMENT else 'numbers'}", e.span)
            try:
                return MATH[e.func.id](*args)
            except (TypeError, ValueError, OverflowError) as error:
                raise self.reporter.error("E211", f"{e.func.id}(): {error}", e.span) from None
        return self.resolve_definition(self, e)

    def _eval_BinOp(self, e: s.BinOp):
        if e.op == "x":
            left, right = self.eval(e.left), self.eval(e.right)
            if isinstance(left, (int, float)) and not isinstance(left, bool):
                return Rep(left, right, e.left, e.right)
            return Rep(right, left, e.right, e.left)
        if e.op in ("and", "or"):
            left = self.truth(self.eval(e.left), e.left)
            if e.op == "and" and not left or e.op == "or" and left:
                return left
            return self.truth(self.eval(e.right), e.right)
        if e.op in ("..", "@"):
            raise self.reporter.error("E205", f"'{e.op}' is not allowed here", e.span)
        if e.op == "-":
            self.dashed(e)
        left, right = self.eval(e.left), self.eval(e.right)
        if isinstance(left, Q) or isinstance(right, Q):
            return self._quantity_op(e, left, right)
        a, b = self.number(left, e.left), self.number(right, e.right)
        if e.op in ("==", "!=", "<", "<=", ">", ">="):
            return {"==": a == b, "!=": a != b, "<": a < b, "<=": a <= b, ">": a > b, ">=": a >= b}[e.op]
        if e.op in ("/", "//", "%") and b == 0:
            raise self.reporter.error("E211", f"division by zero: {_show(a)} {e.op} 0", e.span)
        if e.op == "+":
            return a + b
        if e.op == "-":
            return a - b
        if e.op == "*":
            return a * b
        if e.op == "//":
            return a // b
        if e.op == "%":
            return a % b
        result = a / b
        return int(result) if isinstance(a, int) and isinstance(b, int) and a % b == 0 else result

    def _quantity_op(self, e: s.BinOp, left, right):
        def fail():
            return self.reporter.error("E203", f"cannot combine {_describe(left)} and {_describe(right)} with '{e.op}'", e.span)
        if e.op in ("+", "-"):
            if not (isinstance(left, Q) and isinstance(right, Q) and left.dimension == right.dimension):
                raise fail()
            return Q(left.value + right.value if e.op == "+" else left.value - right.value, left.dimension)
        if e.op == "*":
            if isinstance(left, Q) and isinstance(right, (int, float)):
                return Q(left.value * right, left.dimension)
            if isinstance(right, Q) and isinstance(left, (int, float)):
                return Q(right.value * left, right.dimension)
            raise fail()
        if e.op == "/":
            if isinstance(left, Q) and isinstance(right, (int, float)) and right != 0:
                return Q(left.value / right, left.dimension)
            if isinstance(left, Q) and isinstance(right, Q) and left.dimension == right.dimension and right.value:
                return left.value / right.value
            raise fail()
        if e.op in ("==", "!=", "<", "<=", ">", ">=") and isinstance(left, Q) and isinstance(right, Q) \
                and left.dimension == right.dimension:
            a, b = left.value, right.value
            return {"==": a == b, "!=": a != b, "<": a < b, "<=": a <= b, ">": a > b, ">=": a >= b}[e.op]
        raise fail()

    # ---- typed access ----------------------------------------------------------------
    def number(self, value: Any, expr: s.Expr) -> int | float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            if isinstance(value, Word):
                raise self.unknown(value)
            raise self.reporter.error("E205", f"expected a number, found {_describe(value)}", expr.span)
        if isinstance(value, float) and not math.isfinite(value):
            raise self.reporter.error("E211", f"number out of range ({value})", expr.span,
                                      hint="plans count devices, layers and bytes: keep numbers below 1e300")
        return value

    def truth(self, value: Any, expr: s.Expr) -> bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, (int, float)):
            return value != 0
        if isinstance(value, Word):
            raise self.unknown(value)
        raise self.reporter.error("E205", f"expected true or false, found {_describe(value)}", expr.span)

    def text(self, expr: s.Expr) -> str:
        """The source text of an expression (for messages that show the arithmetic)."""
        if self.source is not None and expr.span.file == self.source.path and expr.span.end > expr.span.start:
            return self.source.text[expr.span.start:expr.span.end]
        return type(expr).__name__.lower()

    def unknown(self, word: Word) -> Poison:
        hint, edits = unknown_name_hint(word.name, word.span, self.visible_names() - self.plan_names(), self.source)
        return self.reporter.error("E201", f"unknown name '{word.name}'", word.span, hint=hint, edits=edits)

    def dashed(self, e: s.BinOp) -> None:
        """`llama3-70b` where `llama3_70b` exists: E201 naming it (not E203 for `70 b`)."""
        text = self.text(e)
        first = re.match(r"[A-Za-z_][A-Za-z0-9_]*", text)
        if first is None or first.group() in self.locals or self.find(first.group()) is not None:
            return
        found = dashed_name_hint(text, e.span, self.visible_names() - self.plan_names(), self.source)
        if found is not None:
            hint, edits = found
            raise self.reporter.error("E201", f"unknown name '{first.group()}': `{text}` reads as a subtraction",
                                      e.span, hint=hint, edits=edits)

    def integer(self, expr: s.Expr, what: str, minimum: int | None = None, maximum: int | None = None) -> int:
        value = self.number(self.eval(expr), expr)
        if isinstance(value, float):
            if not value.is_integer():
                raise self.reporter.error("E211", f"{what} must be a whole number, but `{self.text(expr)}` = {value:g}",
                                          expr.span, hint="use `//` to round down, or change the numbers")
            value = int(value)
        if minimum is not None and value < minimum:
            raise self.reporter.error("E205", f"{what} must be at least {minimum}, found {value}", expr.span)
        if maximum is not None and value > maximum:
            raise self.reporter.error("E505", f"{what} must be at most {maximum:,}, found {value:,}", expr.span,
                                      hint="plandsl caps every count far beyond today's largest runs, so that "
                                           "checking stays fast: see Limits in docs/language.md")
        return value

    def quantity(self, expr: s.Expr, dimension: Dimension, what: str, allow_zero: bool = False) -> float:
        value = self.eval(expr)
        if isinstance(value, Q) and value.dimension == dimension:
            if not math.isfinite(value.value):
                raise self.reporter.error("E211", f"{what} is out of range ({value.value})", expr.span)
            if value.value < 0 or (value.value == 0 and not allow_zero):
                raise self.reporter.error("E205", f"{what} must be {'zero or more' if allow_zero else 'positive'}",
                                          expr.span)
            return value.value
        if isinstance(value, Word):
            raise self.unknown(value)
        found = f"a {value.dimension.name} quantity" if isinstance(value, Q) else _describe(value)
        hint = f"{what} is in {dimension.name}, like `{dimension.example}`" if isinstance(value, Q) else \
            f"write it with a unit, like `{dimension.example}`"
        raise self.reporter.error("E203", f"{what} takes a {dimension.name} quantity, found {found}", expr.span,
                                  hint=hint)

    def word(self, expr: s.Expr, options: tuple[str, ...] | dict, what: str) -> str:
        """A bare word from a fixed vocabulary (enum values are the surface syntax)."""
        expr, scope = self.deref(expr)
        if isinstance(expr, (s.Name, s.Str)):
            text = expr.id if isinstance(expr, s.Name) else expr.value
            if text in options:
                return options[text] if isinstance(options, dict) else text
            raise self.reporter.error("E210", f"'{text}' is not a valid {what}", expr.span,
                                      hint=did_you_mean(text, options, f"valid {what}s"),
                                      edits=respell(text, options, expr.span) if isinstance(expr, s.Name) else ())
        raise self.reporter.error("E205", f"expected a {what} ({', '.join(sorted(options))})", expr.span)


def _describe(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return f"the number {_show(value)}"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, Q):
        return f"a {value.dimension.name} quantity"
    if isinstance(value, Word):
        return f"the name '{value.name}'"
    if isinstance(value, Rep):
        return "a repetition (`n x thing`)"
    kind = getattr(value, "kind", None) or type(value).__name__
    return f"a {kind}"


def _show(value: float) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)




def note_defined(what: str, span: Span | None) -> Note:
    return Note(f"{what} defined", span)
