"""The lark transformer: lark's parse tree of grammar/plan.lark -> `plandsl.syntax` nodes.

Stage: parsing (`plandsl.syntax.parser` runs it). Contract: `Builder().transform(tree)` returns a
`syntax.Module`, each node with its source span; an integer literal past MAX_DIGITS digits raises
`LiteralTooLong` (the parser reports it as E106). Method names are the grammar's rule aliases.
"""
from __future__ import annotations

from lark import Token, Transformer, Tree, v_args

from plandsl.diagnostics.source import NO_SPAN, Span
from plandsl.syntax import (ActionStmt, Attr, BinOp, Binding, Block, Bool, Call, Clause, Definition, DictExpr,
                            DictItem, Entry, Float, For, If, Import, Int, KwArg, LayerDecl, Let, ListExpr,
                            Member, Module, Name, On, Param, Quantity, RankRow, SchedParam, ShardRule, Slice,
                            Str, Subscript, Unary, WithItem)

MAX_DIGITS = 300  # no plan counts past 1e300; Python refuses to parse past 4300 digits anyway
MAX_DEPTH = 4_000  # tree levels (a flat `1 + 1 + ...` nests one level per term): later stages recurse over them


class LiteralTooLong(Exception):
    """An integer literal with more than MAX_DIGITS digits (the parser turns it into E106)."""

    def __init__(self, token: Token):
        self.token = token


class TreeTooDeep(Exception):
    """A tree more than MAX_DEPTH levels deep (the parser turns it into E106)."""

def _tok(token: Token) -> str:
    return str(token)


def _integer(token) -> int:
    """An INT token's value: its underscores dropped (`1_000`, and `1_` as the grammar lexes it), at most
    MAX_DIGITS digits (LiteralTooLong, E106: Python's int() refuses past 4,300)."""
    digits = str(token).replace("_", "")
    if len(digits) > MAX_DIGITS:
        raise LiteralTooLong(token)
    return int(digits)


@v_args(meta=True)
class Builder(Transformer):
    """lark tree -> syntax nodes. `file` is set by the parser before each parse."""

    file = "<string>"

    @classmethod
    def _methods(cls) -> dict:
        if "_method_table" not in cls.__dict__:
            table = {}
            for name in dir(cls):
                attr = getattr(cls, name, None)
                if not name.startswith("_") and hasattr(attr, "base_func"):
                    table[name] = attr.base_func
            cls._method_table = table
        return cls._method_table

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
        return RankRow(_integer(c[0]), tuple(_tok(t) for t in cells), span=self._span(meta),
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
        return Int(_integer(c[0]), span=self._span(meta))

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


def build(builder: Builder, tree: Tree) -> Module:
    """What `builder.transform(tree)` gives, without recursion and about twice as fast: a post-order walk
    with an explicit stack that calls each rule's method directly (a rule without one stays a Tree, as
    lark's `__default__` keeps it). A method's exception comes out as itself (no VisitError); a tree
    deeper than MAX_DEPTH is TreeTooDeep."""
    methods = builder._methods()
    results: list = []
    todo: list = [(tree, 1, False)]
    pop, push, append = todo.pop, todo.append, results.append
    while todo:
        node, depth, built = pop()
        if built is None:  # a token or a None placeholder
            append(node)
        elif built:
            count = len(node.children)
            children = results[len(results) - count:] if count else []
            del results[len(results) - count:]
            method = methods.get(node.data)
            append(method(builder, node.meta, children) if method else Tree(node.data, children, node.meta))
        elif depth > MAX_DEPTH:
            raise TreeTooDeep()
        else:
            push((node, depth, True))
            for child in reversed(node.children):
                push((child, depth + 1, False) if isinstance(child, Tree) else (child, depth, None))
    return results[0]


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
