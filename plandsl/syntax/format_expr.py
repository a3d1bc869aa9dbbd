"""Formatting of expressions and of the comments inside them: syntax tree -> canonical text.

Stage: formatting (`plandsl.syntax.format` lays out the statements). Contract: `flat(node)` is an
expression on one line with minimal parentheses; `scope(parts, ...)` lays it out from a column,
breaking dicts, lists and calls one item per line when a line would pass WIDTH, and returns the
comments that must move before the statement.
"""
from __future__ import annotations

import bisect
import re
from typing import Sequence

from plandsl.syntax import (BinOp, Binding, Bool, Call, Clause, Comment, DictExpr, DictItem, Float, Int, KwArg,
                            ListExpr, Member, Name, Node, Quantity, Slice, Str, Subscript, Unary, WithItem)

WIDTH = 100
STEP = 2  # indentation per body
MAX_BREAK_DEPTH = 100  # expression depth past which lines are not broken

# Precedence, loosest first (grammar/plan.lark's expression rules).
_BINARY_LEVEL = {"@": 1, "or": 2, "and": 3, "==": 5, "!=": 5, "<": 5, "<=": 5, ">": 5, ">=": 5,
                 "..": 6, "x": 7, "+": 8, "-": 8, "*": 9, "/": 9, "//": 9, "%": 9}
_NOT_LEVEL, _NEGATE_LEVEL, _POSTFIX_LEVEL, _ATOM_LEVEL = 4, 10, 11, 12
_LEFT_ASSOCIATIVE = {"or", "and", "+", "-", "*", "/", "//", "%"}
_ATOMS = (Int, Float, Quantity, Str, Name, Bool, ListExpr, DictExpr)

# Units printed after one space even when written glued (`80GiB` -> `80 GiB`).
_PREFIXES = ("", "K", "M", "G", "T", "P", "E")
_UNITS = frozenset(
    [f"{p}{u}" for p in _PREFIXES for u in ("B", "b", "B/s", "b/s", "FLOP", "FLOP/s", "bps")]
    + [f"{p}{u}" for p in ("Ki", "Mi", "Gi", "Ti", "Pi") for u in ("B", "B/s")]
    + ["s", "ms", "us", "ns", "min", "h"])
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_KEYWORDS = frozenset("and or not x true false over with in on rank if else for let layer shard "
                      "import param device node cluster model plan schedule".split())


# ---- expressions ---------------------------------------------------------------------------
def _level(node: Node) -> int:
    if isinstance(node, BinOp):
        return _BINARY_LEVEL[node.op]
    if isinstance(node, Unary):
        return _NOT_LEVEL if node.op == "not" else _NEGATE_LEVEL
    if isinstance(node, (Member, Subscript, Call)):
        return _POSTFIX_LEVEL
    return _ATOM_LEVEL if isinstance(node, _ATOMS) else 0


def _operand(node: Node, minimum: int) -> list:
    return ["(", node, ")"] if _level(node) < minimum else [node]


def joined(nodes: Sequence[Node], separator: str = ", ") -> list:
    parts: list = []
    for index, node in enumerate(nodes):
        parts += [separator, node] if index else [node]
    return parts


def _number(value: int | float) -> str:
    return str(value) if isinstance(value, int) else repr(value)


def quote(text: str) -> str:
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\t", "\\t")
    return f'"{escaped}"'


def _quantity(node: Quantity) -> str:
    number = node.text or _number(node.value)
    glued = number + node.unit
    keep_glued = (node.adjacent and node.unit not in _UNITS and node.unit[:1] not in ("e", "E")
                  and not glued.startswith("1f1b"))
    return glued if keep_glued else f"{number} {node.unit}"


def _parts(node: Node) -> list:
    """The pieces of `node` in order: literal text and child nodes (parentheses included)."""
    match node:
        case Int():
            return [str(node.value)]
        case Float():
            return [node.text or repr(node.value)]
        case Quantity():
            return [_quantity(node)]
        case Str():
            return [quote(node.value)]
        case Name():
            return [node.id]
        case Bool():
            return ["true" if node.value else "false"]
        case ListExpr():
            return ["[", *joined(node.items), "]"] if node.items else ["[]"]
        case DictExpr():
            return ["{ ", *joined(node.items), " }"] if node.items else ["{}"]
        case DictItem():
            key = node.key if _IDENTIFIER.fullmatch(node.key) and node.key not in _KEYWORDS else quote(node.key)
            return [key, ": ", node.value]
        case Binding():
            return [node.name, " = ", node.value]
        case BinOp():
            level = _BINARY_LEVEL[node.op]
            left = _operand(node.left, level if node.op in _LEFT_ASSOCIATIVE else level + 1)
            return [*left, ".." if node.op == ".." else f" {node.op} ", *_operand(node.right, level + 1)]
        case Unary():
            if node.op == "not":
                return ["not ", *_operand(node.operand, _NOT_LEVEL)]
            return ["-", *_operand(node.operand, _NEGATE_LEVEL)]
        case Member():
            needs_parentheses = isinstance(node.obj, Int) and node.name[:1].isdigit()  # `(1).3`, not `1.3`
            obj = ["(", node.obj, ")"] if needs_parentheses else _operand(node.obj, _POSTFIX_LEVEL)
            return [*obj, ".", node.name]
        case Subscript():
            return [*_operand(node.obj, _POSTFIX_LEVEL), "[", node.index, "]"]
        case Slice():
            return [*([node.lo] if node.lo is not None else []), ":", *([node.hi] if node.hi is not None else [])]
        case Call():
            return [*_operand(node.func, _POSTFIX_LEVEL), "(", *joined(node.args + node.kwargs), ")"]
        case KwArg():
            return [node.name, "=", node.value]
        case Clause():
            parts = [node.subject]
            if node.over is not None:
                parts += [" over ", node.over]
            if node.options:
                parts += [" with ", *joined(node.options)]
            return parts
        case WithItem():
            return [node.name] if node.value is None else [node.name, " = ", node.value]
    raise TypeError(f"cannot format {type(node).__name__}")


def flat(node: Node) -> str:
    """`node` on one line (iterative: left-deep chains of hundreds of operators are fine)."""
    pieces: list[str] = []
    stack: list = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            pieces.append(item)
        else:
            stack.extend(reversed(_parts(item)))
    return "".join(pieces)


def _breakable(node: Node) -> bool:
    """A non-empty list, dict or call: what can be broken one item per line."""
    if isinstance(node, Call):
        return bool(node.args or node.kwargs)
    return isinstance(node, (ListExpr, DictExpr)) and bool(node.items)


def _has_container(node: Node) -> bool:
    stack: list = [node]
    while stack:
        item = stack.pop()
        if _breakable(item):
            return True
        stack.extend(part for part in _parts(item) if not isinstance(part, str))
    return False


def _render(node: Node, indent: int, column: int, tail: int = 0, depth: int = 0,
            comments: Sequence[Comment] = (), loose: list[Comment] | None = None) -> str:
    """`node` starting at `column` with `tail` characters after it; breaks containers to fit.

    `comments` are the comments inside `node`, in source order: a list, dict or call holding some
    is broken one item per line so that they stay beside their items; those that cannot stay where
    they are (inside an operator, say) go to `loose`, to be put on lines before this one.
    Below MAX_BREAK_DEPTH nested nodes everything stays flat, so recursion stays bounded."""
    if comments and depth > MAX_BREAK_DEPTH:
        loose.extend(comments)
        comments = ()
    text = flat(node)
    if not comments and (column + len(text) + tail <= WIDTH or depth > MAX_BREAK_DEPTH
                         or not _has_container(node)):
        return text
    if isinstance(node, (ListExpr, DictExpr)) and node.items:
        opening, closing = ("[", "]") if isinstance(node, ListExpr) else ("{", "}")
        return f"{opening}\n{_items(node.items, indent, depth, comments)}\n{' ' * indent}{closing}"
    if isinstance(node, Call) and (node.args or node.kwargs):
        return _render_call(node, indent, column, tail, depth, comments, loose)
    return assemble(_parts(node), indent, column, tail, depth + 1, comments, loose)


def _render_call(node: Call, indent: int, column: int, tail: int, depth: int,
                 comments: Sequence[Comment], loose: list[Comment] | None) -> str:
    """A call too long for its line (or holding comments): `f({` ... `})` when its last argument
    is a list or dict that can open on the first line, else one argument per line and `)` on a line
    of its own."""
    arguments = node.args + node.kwargs
    if comments and any(a.span.start > b.span.start for a, b in zip(arguments, arguments[1:])):
        loose.extend(comments)  # `f(k=1, a)` is printed `f(a, k=1)`: its comments would reorder
        return _render(node, indent, column, tail, depth)
    inside_func = [c for c in comments if c.span.start < node.func.span.end]
    comments = comments[len(inside_func):]
    head = assemble([*_operand(node.func, _POSTFIX_LEVEL), "("], indent, column, 0, depth + 1,
                     inside_func, loose)
    column = len(head) - head.rfind("\n") - 1 if "\n" in head else column + len(head)
    last = arguments[-1]
    if (isinstance(last, (ListExpr, DictExpr)) and last.items
            and all(inside(comment, last) for comment in comments)):
        before = "".join(flat(argument) + ", " for argument in arguments[:-1])
        if column + len(before) + 1 <= WIDTH:
            text = _render(last, indent, column + len(before), tail + 1, depth + 1, comments, loose)
            return head + before + text + ")"
    return f"{head}\n{_items(arguments, indent, depth, comments)}\n{' ' * indent})"


def _items(items: Sequence[Node], indent: int, depth: int, comments: Sequence[Comment]) -> str:
    """The lines of a broken list, dict or argument list: one item a line, each with a comma,
    one step in from `indent`; comments stay before, beside (aligned) or inside their items."""
    inner = indent + STEP
    pad = " " * inner
    leading, within, trailing, end = _distribute(items, comments)
    lines: list[str] = []
    notes: list[str | None] = []
    for index, item in enumerate(items):
        hoisted, text = scope([item], inner, inner, 1, depth + 1, within[index])
        before = [pad + comment_text(comment) for comment in leading[index] + hoisted]
        item_lines = (pad + text + ",").split("\n")
        note = comment_text(trailing[index]) if trailing[index] is not None else None
        if note is not None and len(item_lines) > 1:
            item_lines[-1] += "  " + note
            note = None
        lines += before + item_lines
        notes += [None] * (len(before) + len(item_lines) - 1) + [note]
    lines += [pad + comment_text(comment) for comment in end]
    notes += [None] * len(end)
    return "\n".join(align_notes(lines, notes))


def _distribute(items: Sequence[Node], comments: Sequence[Comment]):
    """Comments of a broken container: (before each item, inside each, beside each, at the end)."""
    leading: list[list[Comment]] = [[] for _ in items]
    trailing: list[Comment | None] = [None] * len(items)
    end: list[Comment] = []
    within, between = by_owner(comments, items)
    for index, comment in between:
        if (index >= 0 and not comment.own_line and trailing[index] is None
                and items[index].span.end_line == comment.span.line):
            trailing[index] = comment
        elif index + 1 < len(items):
            leading[index + 1].append(comment)
        else:
            end.append(comment)
    return leading, within, trailing, end


def assemble(parts: list, indent: int, column: int, tail: int = 0, depth: int = 0,
              comments: Sequence[Comment] = (), loose: list[Comment] | None = None) -> str:
    flats = [part if isinstance(part, str) else flat(part) for part in parts]
    owned: dict[int, list[Comment]] = {id(part): [] for part in parts if not isinstance(part, str)}
    for comment in comments:
        owner = next((part for part in parts if not isinstance(part, str) and inside(comment, part)), None)
        (owned[id(owner)] if owner is not None else loose).append(comment)
    text = ""
    for index, part in enumerate(parts):
        if isinstance(part, str):
            piece = part
        else:
            piece = _render(part, indent, column, sum(map(len, flats[index + 1:])) + tail, depth,
                            owned[id(part)], loose)
        text += piece
        column = len(piece) - piece.rfind("\n") - 1 if "\n" in piece else column + len(piece)
    return text


def scope(parts: list, indent: int, column: int, tail: int, depth: int,
           comments: Sequence[Comment]) -> tuple[list[Comment], str]:
    """`parts` assembled as a line of their own (a statement, an item of a broken container), with
    the comments inside them: (comments for the lines before it, text). When one that has to go
    before would come after one that stays inside, all of them go before (order is kept)."""
    if not comments:
        return [], assemble(parts, indent, column, tail, depth)
    loose: list[Comment] = []
    text = assemble(parts, indent, column, tail, depth, comments, loose)
    moved = {id(comment) for comment in loose}
    stayed = [comment.span.start for comment in comments if id(comment) not in moved]
    if loose and stayed and max(comment.span.start for comment in loose) > min(stayed):
        return list(comments), assemble(parts, indent, column, tail, depth)
    return sorted(loose, key=lambda comment: comment.span.start), text


# ---- comments ----------------------------------------------------------------------------
def comment_text(comment: Comment) -> str:
    return comment.text.rstrip()


def inside(comment: Comment, node: Node) -> bool:
    return node.span.start <= comment.span.start < node.span.end


def by_owner(comments: Sequence[Comment], nodes: Sequence[Node]
             ) -> tuple[list[list[Comment]], list[tuple[int, Comment]]]:
    """(the comments inside each node, the others with the index of the node they follow: -1
    before the first), both in source order; `nodes` in source order."""
    within: list[list[Comment]] = [[] for _ in nodes]
    between: list[tuple[int, Comment]] = []
    starts = [node.span.start for node in nodes]
    for comment in comments:
        index = bisect.bisect_right(starts, comment.span.start) - 1
        if index >= 0 and inside(comment, nodes[index]):
            within[index].append(comment)
        else:
            between.append((index, comment))
    return within, between


def align_notes(lines: list[str], notes: list[str | None]) -> list[str]:
    """Append the trailing comments; in a run of consecutive lines that all have one, they start
    in one column: two spaces after the longest line of the run (like gofmt)."""
    out: list[str] = []
    start = 0
    while start < len(lines):
        if notes[start] is None:
            out.append(lines[start])
            start += 1
            continue
        stop = start
        while stop < len(lines) and notes[stop] is not None:
            stop += 1
        column = max(len(line) for line in lines[start:stop]) + 2
        out += [line.ljust(column) + note for line, note in zip(lines[start:stop], notes[start:stop])]
        start = stop
    return out
