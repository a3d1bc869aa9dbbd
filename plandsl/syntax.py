"""The syntax tree of a .plan file: what was written, before any meaning is given to it.

Frozen, slotted dataclasses, one per construct of grammar/plan.lark; `span` is kept out
of equality so that two parses of equivalent text compare equal. `Builder` is the lark
transformer that builds them (its method names are the grammar's rule aliases).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

from lark import Token, Transformer, v_args

from plandsl.source import NO_SPAN, Span


@dataclass(frozen=True, slots=True)
class Node:
    span: Span = field(default=NO_SPAN, kw_only=True, compare=False, repr=False)


# ---- expressions ---------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Int(Node):
    value: int


@dataclass(frozen=True, slots=True)
class Float(Node):
    value: float
    text: str = field(default="", compare=False)


@dataclass(frozen=True, slots=True)
class Quantity(Node):
    value: float
    unit: str
    text: str = field(default="", compare=False)  # the number as written
    adjacent: bool = field(default=False, compare=False)  # `80GiB`: no space before the unit


@dataclass(frozen=True, slots=True)
class Str(Node):
    value: str


@dataclass(frozen=True, slots=True)
class Name(Node):
    id: str


@dataclass(frozen=True, slots=True)
class Bool(Node):
    value: bool


@dataclass(frozen=True, slots=True)
class ListExpr(Node):
    items: tuple[Expr, ...]


@dataclass(frozen=True, slots=True)
class Binding(Node):
    """`dp = 4` inside a list (mesh axes)."""
    name: str
    value: Expr
    name_span: Span = field(default=NO_SPAN, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class DictItem(Node):
    key: str
    value: Expr
    key_span: Span = field(default=NO_SPAN, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class DictExpr(Node):
    items: tuple[DictItem, ...]


@dataclass(frozen=True, slots=True)
class BinOp(Node):
    op: str  # + - * / // % and or == != < <= > >= .. x @
    left: Expr
    right: Expr


@dataclass(frozen=True, slots=True)
class Unary(Node):
    op: str  # - not
    operand: Expr


@dataclass(frozen=True, slots=True)
class Member(Node):
    """`obj.name`, `obj.3` (name is '3') or `obj.*` (name is '*')."""
    obj: Expr
    name: str


@dataclass(frozen=True, slots=True)
class Slice(Node):
    lo: Expr | None
    hi: Expr | None


@dataclass(frozen=True, slots=True)
class Subscript(Node):
    obj: Expr
    index: Expr  # a Slice or an expression


@dataclass(frozen=True, slots=True)
class KwArg(Node):
    name: str
    value: Expr


@dataclass(frozen=True, slots=True)
class Call(Node):
    func: Expr
    args: tuple[Expr, ...]
    kwargs: tuple[KwArg, ...]


@dataclass(frozen=True, slots=True)
class WithItem(Node):
    name: str
    value: Expr | None


@dataclass(frozen=True, slots=True)
class Clause(Node):
    """`subject over axes with a, b = 2` (an attribute value only)."""
    subject: Expr
    over: Expr | None
    options: tuple[WithItem, ...]


Expr = Union[Int, Float, Quantity, Str, Name, Bool, ListExpr, Binding, DictExpr, BinOp, Unary,
             Member, Slice, Subscript, Call, Clause]


# ---- statements ----------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Attr(Node):
    name: str
    value: Expr
    name_span: Span = field(default=NO_SPAN, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Entry(Node):
    """`0: embed, layers[0:10]` inside a block."""
    key: Expr
    values: tuple[Expr, ...]


@dataclass(frozen=True, slots=True)
class Block(Node):
    name: str
    body: tuple[Attr | Entry, ...]
    name_span: Span = field(default=NO_SPAN, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class ShardRule(Node):
    target: Expr
    value: Expr


@dataclass(frozen=True, slots=True)
class LayerDecl(Node):
    target: Expr
    body: tuple[Attr, ...]


@dataclass(frozen=True, slots=True)
class RankRow(Node):
    rank: int
    cells: tuple[str, ...]  # action text like '0F1', or '_' for idle
    cell_spans: tuple[Span, ...] = field(default=(), compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class For(Node):
    var: str
    iterable: Expr
    rank: Expr | None
    body: tuple[Stmt, ...]


@dataclass(frozen=True, slots=True)
class On(Node):
    rank: Expr
    body: tuple[Stmt, ...]


@dataclass(frozen=True, slots=True)
class If(Node):
    cond: Expr
    then: tuple[Stmt, ...]
    orelse: tuple[Stmt, ...] | None


@dataclass(frozen=True, slots=True)
class Let(Node):
    name: str
    value: Expr
    name_span: Span = field(default=NO_SPAN, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class ActionStmt(Node):
    call: Expr


Stmt = Union[Attr, Entry, Block, ShardRule, LayerDecl, RankRow, For, On, If, Let, ActionStmt]


# ---- top level -----------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Import(Node):
    path: str


@dataclass(frozen=True, slots=True)
class Param(Node):
    name: str
    value: Expr
    name_span: Span = field(default=NO_SPAN, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class SchedParam(Node):
    """`p: ranks` (a template variable) or `ranks = 4` (a fixed size)."""
    name: str
    dimension: str | None
    value: Expr | None


@dataclass(frozen=True, slots=True)
class Definition(Node):
    kind: str  # device node cluster model plan schedule
    name: str
    value: Expr | None = None  # `model m = gpt(...)`
    body: tuple[Stmt, ...] | None = None
    params: tuple[SchedParam, ...] = ()
    name_span: Span = field(default=NO_SPAN, compare=False, repr=False)


Item = Union[Import, Param, Let, Definition]


@dataclass(frozen=True, slots=True)
class Comment(Node):
    text: str
    own_line: bool  # nothing but whitespace before it on its line


@dataclass(frozen=True, slots=True)
class Module(Node):
    file: str
    items: tuple[Item, ...]
    comments: tuple[Comment, ...] = field(default=(), compare=False)


# ---- the transformer -------------------------------------------------------------------
MAX_DIGITS = 300  # no plan counts past 1e300; Python refuses to parse past 4300 digits anyway


class LiteralTooLong(Exception):
    """An integer literal with more than MAX_DIGITS digits (the parser turns it into E106)."""

    def __init__(self, token: Token):
        self.token = token

def _tok(token: Token) -> str:
    return str(token)


@v_args(meta=True)
class Builder(Transformer):
    """lark tree -> syntax nodes. `file` is set by the parser before each parse."""

    file = "<string>"

    def _span(self, meta) -> Span:
        if getattr(meta, "empty", True):
            return NO_SPAN
        return Span(self.file, meta.line, meta.column, meta.end_line, meta.end_column,
                    meta.start_pos, meta.end_pos)

    def _tspan(self, token: Token) -> Span:
        return Span(self.file, token.line, token.column, token.end_line, token.end_column,
                    token.start_pos, token.end_pos)

    # top level
    def start(self, meta, items):
        return Module(self.file, tuple(items), span=self._span(meta))

    def import_stmt(self, meta, c):
        return Import(_unquote(c[0]), span=self._span(meta))

    def param_stmt(self, meta, c):
        return Param(_tok(c[0]), c[1], span=self._span(meta), name_span=self._tspan(c[0]))

    def let_stmt(self, meta, c):
        return Let(_tok(c[0]), c[1], span=self._span(meta), name_span=self._tspan(c[0]))

    def _def(self, kind, meta, c, **kw):
        return Definition(kind, _tok(c[0]), span=self._span(meta), name_span=self._tspan(c[0]), **kw)

    def device_def(self, meta, c):
        return self._def("device", meta, c, body=c[1])

    def node_def(self, meta, c):
        return self._def("node", meta, c, body=c[1])

    def cluster_def(self, meta, c):
        return self._def("cluster", meta, c, body=c[1])

    def cluster_alias(self, meta, c):
        return self._def("cluster", meta, c, value=c[1])

    def model_alias(self, meta, c):
        return self._def("model", meta, c, value=c[1])

    def model_def(self, meta, c):
        return self._def("model", meta, c, body=c[1])

    def plan_def(self, meta, c):
        return self._def("plan", meta, c, body=c[1])

    def schedule_def(self, meta, c):
        return self._def("schedule", meta, c, params=c[1], body=c[2])

    # bodies
    def attr_body(self, meta, c):
        return tuple(c)

    model_body = plan_body = entry_body = sched_body = attr_body

    def attr(self, meta, c):
        return Attr(_tok(c[0]), c[1], span=self._span(meta), name_span=self._tspan(c[0]))

    def clause(self, meta, c):
        options = c[2] if len(c) > 2 else ()
        return Clause(c[0], c[1], options, span=self._span(meta))

    def clause_with(self, meta, c):
        return Clause(c[0], None, c[1], span=self._span(meta))

    def with_items(self, meta, c):
        return tuple(c)

    def with_item(self, meta, c):
        return WithItem(_tok(c[0]), c[1] if len(c) > 1 else None, span=self._span(meta))

    def layer_decl(self, meta, c):
        return LayerDecl(c[0], c[1], span=self._span(meta))

    def block(self, meta, c):
        return Block(_tok(c[0]), c[1], span=self._span(meta), name_span=self._tspan(c[0]))

    def shard_rule(self, meta, c):
        return ShardRule(c[0], c[1], span=self._span(meta))

    def entry(self, meta, c):
        return Entry(c[0], tuple(c[1:]), span=self._span(meta))

    # schedules
    def sched_params(self, meta, c):
        return tuple(p for p in c if p is not None)

    def sched_var(self, meta, c):
        return SchedParam(_tok(c[0]), _tok(c[1]), None, span=self._span(meta))

    def sched_size(self, meta, c):
        return SchedParam(_tok(c[0]), None, c[1], span=self._span(meta))

    def rank_row(self, meta, c):
        cells = c[1:]
        return RankRow(int(c[0]), tuple(_tok(t) for t in cells), span=self._span(meta),
                       cell_spans=tuple(self._tspan(t) for t in cells))

    def for_stmt(self, meta, c):
        return For(_tok(c[0]), c[1], c[2], c[3], span=self._span(meta))

    def on_stmt(self, meta, c):
        return On(c[0], c[1], span=self._span(meta))

    def if_stmt(self, meta, c):
        return If(c[0], c[1], c[2], span=self._span(meta))

    def action_stmt(self, meta, c):
        return ActionStmt(c[0], span=self._span(meta))

    # expressions
    def _bin(op):  # noqa: N805 - a factory used in the class body
        def method(self, meta, c):
            return BinOp(op, c[0], c[-1], span=self._span(meta))
        return method

    placed = _bin("@")
    or_ = _bin("or")
    and_ = _bin("and")
    range = _bin("..")
    repeat = _bin("x")
    add = _bin("+")
    sub = _bin("-")
    mul = _bin("*")
    div = _bin("/")
    floordiv = _bin("//")
    mod = _bin("%")
    del _bin

    def compare(self, meta, c):
        return BinOp(_tok(c[1]), c[0], c[2], span=self._span(meta))

    def not_(self, meta, c):
        return Unary("not", c[0], span=self._span(meta))

    def neg(self, meta, c):
        return Unary("-", c[0], span=self._span(meta))

    def member(self, meta, c):
        return Member(c[0], _tok(c[1]), span=self._span(meta))

    member_index = member

    def wildcard(self, meta, c):
        return Member(c[0], "*", span=self._span(meta))

    def subscript(self, meta, c):
        return Subscript(c[0], c[1], span=self._span(meta))

    def slice(self, meta, c):
        return Slice(c[0], c[1], span=self._span(meta))

    def call(self, meta, c):
        args = [a for a in c[1:] if a is not None]
        return Call(c[0], tuple(a for a in args if not isinstance(a, KwArg)),
                    tuple(a for a in args if isinstance(a, KwArg)), span=self._span(meta))

    def kwarg(self, meta, c):
        return KwArg(_tok(c[0]), c[1], span=self._span(meta))

    def int(self, meta, c):
        digits = str(c[0]).replace("_", "")
        if len(digits) > MAX_DIGITS:
            raise LiteralTooLong(c[0])
        return Int(int(digits), span=self._span(meta))

    def float(self, meta, c):
        return Float(float(str(c[0]).replace("_", "")), str(c[0]), span=self._span(meta))

    def quantity(self, meta, c):
        number, unit = c
        text = str(number)
        value = float(text.replace("_", ""))
        if value.is_integer() and "." not in text and "e" not in text.lower():
            value = int(text.replace("_", ""))
        return Quantity(value, str(unit), text, adjacent=number.end_pos == unit.start_pos,
                        span=self._span(meta))

    def string(self, meta, c):
        return Str(_unquote(c[0]), span=self._span(meta))

    def name(self, meta, c):
        return Name(_tok(c[0]), span=self._span(meta))

    def true(self, meta, c):
        return Bool(True, span=self._span(meta))

    def false(self, meta, c):
        return Bool(False, span=self._span(meta))

    def list(self, meta, c):
        return ListExpr(tuple(x for x in c if x is not None), span=self._span(meta))

    def binding(self, meta, c):
        return Binding(_tok(c[0]), c[1], span=self._span(meta), name_span=self._tspan(c[0]))

    def dict(self, meta, c):
        return DictExpr(tuple(x for x in c if x is not None), span=self._span(meta))

    def dict_item(self, meta, c):
        key = c[0]
        text = _unquote(key) if key.type == "STRING" else str(key)
        return DictItem(text, c[1], span=self._span(meta), key_span=self._tspan(key))


_ESCAPES = {"n": "\n", "t": "\t", '"': '"', "\\": "\\"}


def _unquote(token: Token | str) -> str:
    body = str(token)[1:-1]
    if "\\" not in body:
        return body
    out, i = [], 0
    while i < len(body):
        ch = body[i]
        if ch == "\\" and i + 1 < len(body):
            out.append(_ESCAPES.get(body[i + 1], body[i + 1]))
            i += 2
        else:
            out.append(ch)
            i += 1
    return "".join(out)
