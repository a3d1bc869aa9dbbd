"""The syntax tree of a .plan file: what was written, before any meaning is given to it.

Frozen, slotted dataclasses, one per construct of grammar/plan.lark; `span` is kept out
of equality so that two parses of equivalent text compare equal. `plandsl.syntax.build.Builder`
is the lark transformer that builds them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

from plandsl.diagnostics.source import NO_SPAN, Span


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
