"""Formatting stage: syntax tree -> canonical .plan text (what `plandsl fmt` writes).

Contract: `parse(format(x)) == parse(x)`, `format(format(x)) == format(x)`, and every comment
comes back exactly once, in source order (trailing whitespace removed). Layout: 2-space
indentation, one statement per line, minimal parentheses; dicts, lists and calls broken one item
per line when a line would pass 100 columns. Hand alignment is kept in canonical form: in a run of
consecutive statements of one kind, `=` lines up (attributes, shard rules, `model m = ...`
aliases), the values of `stages { k: v }` entries start in one column, schedule tables are padded
into columns, and trailing comments of consecutive one-line statements start in one column.
"""
from __future__ import annotations

import bisect
import re
from typing import Sequence

from plandsl.parser import parse_source
from plandsl.source import SourceFile
from plandsl.syntax import (ActionStmt, Attr, BinOp, Binding, Block, Bool, Call, Clause, Comment,
                            Definition, DictExpr, DictItem, Entry, Float, For, If, Import, Int,
                            KwArg, LayerDecl, Let, ListExpr, Member, Module, Name, Node, On, Param,
                            Quantity, RankRow, ShardRule, Slice, Str, Subscript, Unary, WithItem)

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


# ---- entry points ----------------------------------------------------------------------
def format_source(source: SourceFile) -> str:
    """Parse `source` and return its canonical text (raises PlanError on bad input)."""
    return format_module(parse_source(source))


def format_module(module: Module) -> str:
    """The canonical text of a parsed module, its comments included."""
    comments = sorted(module.comments, key=lambda c: c.span.start)
    _, lines = _body(module.items, comments, 0, top=True)
    return "\n".join(lines) + "\n" if lines else ""


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


def _joined(nodes: Sequence[Node], separator: str = ", ") -> list:
    parts: list = []
    for index, node in enumerate(nodes):
        parts += [separator, node] if index else [node]
    return parts


def _number(value: int | float) -> str:
    return str(value) if isinstance(value, int) else repr(value)


def _quote(text: str) -> str:
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
            return [_quote(node.value)]
        case Name():
            return [node.id]
        case Bool():
            return ["true" if node.value else "false"]
        case ListExpr():
            return ["[", *_joined(node.items), "]"] if node.items else ["[]"]
        case DictExpr():
            return ["{ ", *_joined(node.items), " }"] if node.items else ["{}"]
        case DictItem():
            key = node.key if _IDENTIFIER.fullmatch(node.key) and node.key not in _KEYWORDS else _quote(node.key)
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
            return [*_operand(node.func, _POSTFIX_LEVEL), "(", *_joined(node.args + node.kwargs), ")"]
        case KwArg():
            return [node.name, "=", node.value]
        case Clause():
            parts = [node.subject]
            if node.over is not None:
                parts += [" over ", node.over]
            if node.options:
                parts += [" with ", *_joined(node.options)]
            return parts
        case WithItem():
            return [node.name] if node.value is None else [node.name, " = ", node.value]
    raise TypeError(f"cannot format {type(node).__name__}")


def _flat(node: Node) -> str:
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
    flat = _flat(node)
    if not comments and (column + len(flat) + tail <= WIDTH or depth > MAX_BREAK_DEPTH
                         or not _has_container(node)):
        return flat
    if isinstance(node, (ListExpr, DictExpr)) and node.items:
        opening, closing = ("[", "]") if isinstance(node, ListExpr) else ("{", "}")
        return f"{opening}\n{_items(node.items, indent, depth, comments)}\n{' ' * indent}{closing}"
    if isinstance(node, Call) and (node.args or node.kwargs):
        return _render_call(node, indent, column, tail, depth, comments, loose)
    return _assemble(_parts(node), indent, column, tail, depth + 1, comments, loose)


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
    head = _assemble([*_operand(node.func, _POSTFIX_LEVEL), "("], indent, column, 0, depth + 1,
                     inside_func, loose)
    column = len(head) - head.rfind("\n") - 1 if "\n" in head else column + len(head)
    last = arguments[-1]
    if (isinstance(last, (ListExpr, DictExpr)) and last.items
            and all(_inside(comment, last) for comment in comments)):
        before = "".join(_flat(argument) + ", " for argument in arguments[:-1])
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
        hoisted, text = _scope([item], inner, inner, 1, depth + 1, within[index])
        before = [pad + _comment(comment) for comment in leading[index] + hoisted]
        item_lines = (pad + text + ",").split("\n")
        note = _comment(trailing[index]) if trailing[index] is not None else None
        if note is not None and len(item_lines) > 1:
            item_lines[-1] += "  " + note
            note = None
        lines += before + item_lines
        notes += [None] * (len(before) + len(item_lines) - 1) + [note]
    lines += [pad + _comment(comment) for comment in end]
    notes += [None] * len(end)
    return "\n".join(_align_notes(lines, notes))


def _distribute(items: Sequence[Node], comments: Sequence[Comment]):
    """Comments of a broken container: (before each item, inside each, beside each, at the end)."""
    leading: list[list[Comment]] = [[] for _ in items]
    within: list[list[Comment]] = [[] for _ in items]
    trailing: list[Comment | None] = [None] * len(items)
    end: list[Comment] = []
    starts = [item.span.start for item in items]
    for comment in comments:
        index = bisect.bisect_right(starts, comment.span.start) - 1
        if index >= 0 and _inside(comment, items[index]):
            within[index].append(comment)
        elif (index >= 0 and not comment.own_line and trailing[index] is None
              and items[index].span.end_line == comment.span.line):
            trailing[index] = comment
        elif index + 1 < len(items):
            leading[index + 1].append(comment)
        else:
            end.append(comment)
    return leading, within, trailing, end


def _assemble(parts: list, indent: int, column: int, tail: int = 0, depth: int = 0,
              comments: Sequence[Comment] = (), loose: list[Comment] | None = None) -> str:
    flats = [part if isinstance(part, str) else _flat(part) for part in parts]
    owned: dict[int, list[Comment]] = {id(part): [] for part in parts if not isinstance(part, str)}
    for comment in comments:
        owner = next((part for part in parts if not isinstance(part, str) and _inside(comment, part)), None)
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


def _scope(parts: list, indent: int, column: int, tail: int, depth: int,
           comments: Sequence[Comment]) -> tuple[list[Comment], str]:
    """`parts` assembled as a line of their own (a statement, an item of a broken container), with
    the comments inside them: (comments for the lines before it, text). When one that has to go
    before would come after one that stays inside, all of them go before (order is kept)."""
    if not comments:
        return [], _assemble(parts, indent, column, tail, depth)
    loose: list[Comment] = []
    text = _assemble(parts, indent, column, tail, depth, comments, loose)
    moved = {id(comment) for comment in loose}
    stayed = [comment.span.start for comment in comments if id(comment) not in moved]
    if loose and stayed and max(comment.span.start for comment in loose) > min(stayed):
        return list(comments), _assemble(parts, indent, column, tail, depth)
    return sorted(loose, key=lambda comment: comment.span.start), text


# ---- statements ------------------------------------------------------------------------------
def _body_of(node: Node) -> tuple | None:
    if isinstance(node, If):
        return node.then
    return node.body if isinstance(node, (Block, LayerDecl, For, On, Definition)) else None


def _header_end(node: Node) -> int:
    """Offset where the header of a statement with a body ends (comments before it go first)."""
    if isinstance(node, Definition):
        return max([node.name_span.end] + [param.span.end for param in node.params])
    if isinstance(node, Block):
        return node.name_span.end
    if isinstance(node, LayerDecl):
        return node.target.span.end
    if isinstance(node, For):
        return (node.rank or node.iterable).span.end
    if isinstance(node, On):
        return node.rank.span.end
    return node.cond.span.end


def _header(node: Node, indent: int) -> str:
    pad = " " * indent
    if isinstance(node, Definition):
        if node.kind != "schedule":
            return f"{pad}{node.kind} {node.name}"
        params = [f"{p.name}: {p.dimension}" if p.dimension else f"{p.name} = {_flat(p.value)}"
                  for p in node.params]
        return f"{pad}schedule {node.name}({', '.join(params)})"
    if isinstance(node, Block):
        return pad + node.name
    parts: list
    if isinstance(node, LayerDecl):
        parts = ["layer ", node.target]
    elif isinstance(node, For):
        parts = [f"for {node.var} in ", node.iterable] + ([" on rank ", node.rank] if node.rank else [])
    elif isinstance(node, On):
        parts = ["on rank ", node.rank]
    else:
        parts = ["if ", node.cond]
    return pad + _assemble(parts, indent, indent, 2)


def _simple(node: Node, indent: int, name_width,
            comments: Sequence[Comment] = ()) -> tuple[list[Comment], str]:
    """A statement without a body, starting with its indentation, and the comments inside it that
    go on lines before it (see _scope); `name_width` pads what comes before the `=` (or the `:` of
    an entry) to line it up with its run (see _alignment)."""
    pad = " " * indent
    match node:
        case Import():
            return list(comments), f"{pad}import {_quote(node.path)}"
        case RankRow():
            # A table is read by eye: columns line up (name_width is (rank digits, cell width)).
            rank_width, cell_width = name_width if isinstance(name_width, tuple) else (0, 0)
            label = f"rank {node.rank}:".ljust(len("rank :") + rank_width)
            return list(comments), (f"{pad}{label}" + "".join(" " + cell.ljust(cell_width) for cell in node.cells)).rstrip()
        case Attr():
            parts = [node.name.ljust(name_width), " = ", node.value]
        case Param():
            parts = [f"param {node.name} = ", node.value]
        case Let():
            parts = [f"let {node.name} = ", node.value]
        case Definition():
            parts = [f"{node.kind} {node.name.ljust(name_width)} = ", node.value]
        case Entry():
            parts = [f"{_flat(node.key)}:".ljust(name_width + 1) + " ", *_joined(node.values)]
        case ShardRule():
            parts = [f"shard {_flat(node.target).ljust(name_width)} = ", node.value]
        case ActionStmt():
            parts = [node.call]
        case _:
            raise TypeError(f"cannot format statement {type(node).__name__}")
    hoisted, text = _scope(parts, indent, indent, 0, 0, comments)
    return hoisted, pad + text


def _comment(comment: Comment) -> str:
    return comment.text.rstrip()


def _statement(node: Node, comments: list[Comment], indent: int, name_width) -> tuple[list[str], int]:
    """(lines of one statement, how many of them are comments put before it): comments inside its
    header go before it; those inside its expressions too, unless a broken container keeps them."""
    pad = " " * indent
    if _body_of(node) is None:
        hoisted, text = _simple(node, indent, name_width, comments)
        return [pad + _comment(c) for c in hoisted] + text.split("\n"), len(hoisted)
    end = _header_end(node)
    lines = [pad + _comment(c) for c in comments if c.span.start < end]
    before = len(lines)
    rest = [c for c in comments if c.span.start >= end]
    header = _header(node, indent).split("\n")
    lines += header[:-1]
    head = header[-1]
    if isinstance(node, If) and node.orelse is not None:
        then_comments, else_comments = _split_if(node, rest)
        then_header, then_lines = _body(node.then, then_comments, indent + STEP)
        else_header, else_lines = _body(node.orelse, else_comments, indent + STEP)
        return (lines + [_open(head, then_header)] + then_lines + [_open(pad + "} else", else_header)]
                + else_lines + [pad + "}"]), before
    body = _body_of(node)
    if len(header) == 1 and _fits_one_line(node, body, head):
        return lines + [f"{head} {{ {_actions(body)} }}"], before
    body_header, body_lines = _body(body, rest, indent + STEP)
    if not body_lines and body_header is None:
        return lines + [head + " {}"], before
    return lines + [_open(head, body_header)] + body_lines + [pad + "}"], before


def _open(head: str, comment: Comment | None) -> str:
    return head + " {" + (f"  {_comment(comment)}" if comment else "")


def _actions(body: tuple) -> str:
    return "; ".join(_flat(statement.call) for statement in body)


def _fits_one_line(node: Node, body: tuple, head: str) -> bool:
    """`for i in 0..w { F(r, i) }` and `for i in 0..m { F(r, i); B(r, i) }` stay on one line
    when written so and short enough (only actions in the body)."""
    only_actions = (isinstance(node, (For, On, If)) and body
                    and all(isinstance(statement, ActionStmt) for statement in body))
    return bool(only_actions and node.span.line == node.span.end_line
                and len(head) + len(_actions(body)) + 5 <= WIDTH)


def _split_if(node: If, comments: list[Comment]) -> tuple[list[Comment], list[Comment]]:
    """Comments of the `then` body and of the `else` body (`} else {  # c` opens the else)."""
    then_comments: list[Comment] = []
    for index, comment in enumerate(comments):
        if node.orelse and comment.span.start > node.orelse[0].span.start:
            return then_comments, comments[index:]
        if not comment.own_line and all(child.span.start < comment.span.start for child in node.then):
            before = [child for child in node.then if child.span.end <= comment.span.start]
            trails = before and before[-1].span.end_line == comment.span.line
            opens_then = not before and not then_comments
            if not trails and not opens_then:
                return then_comments, comments[index:]
        then_comments.append(comment)
    return then_comments, []


# ---- bodies and comments -----------------------------------------------------------------------
def _place(comments: list[Comment], children: Sequence[Node], allow_header: bool):
    """Attach comments outside any child: header (after `{`), leading, trailing, or at the end."""
    header = None
    leading: list[list[Comment]] = [[] for _ in children]
    trailing: list[Comment | None] = [None] * len(children)
    end: list[Comment] = []
    starts = [child.span.start for child in children]
    ends = [child.span.end for child in children]  # children never overlap: sorted too
    for position, comment in enumerate(comments):
        start = comment.span.start
        previous = bisect.bisect_right(ends, start) - 1
        previous = previous if previous >= 0 else None
        if not comment.own_line:
            if (previous is not None and children[previous].span.end_line == comment.span.line
                    and trailing[previous] is None):
                trailing[previous] = comment
                continue
            if previous is None and allow_header and position == 0:
                header = comment
                continue
        following = bisect.bisect_right(starts, start)
        (leading[following] if following < len(children) else end).append(comment)
    return header, leading, trailing, end


def _inside(comment: Comment, node: Node) -> bool:
    return node.span.start <= comment.span.start < node.span.end


def _alias(node: Node) -> bool:
    """`model m = ...`, `cluster c = ...`: a one-statement definition."""
    return isinstance(node, Definition) and node.body is None and node.value is not None


def _one_line_alias(node: Node) -> bool:
    return _alias(node) and "\n" not in _simple(node, 0, len(node.name))[1]


def _separated(previous: Node, current: Node) -> bool:
    """Top level: a blank line between definitions and between different kinds of items
    (consecutive one-line aliases of one kind, like `model a = gpt(...)` lines, stay together)."""
    if _one_line_alias(previous) and _one_line_alias(current) and previous.kind == current.kind:
        return False
    return isinstance(previous, Definition) or isinstance(current, Definition) or type(previous) is not type(current)


def _body(children: Sequence[Node], comments: list[Comment], indent: int, top: bool = False):
    """(comment after the opening brace, lines) of a body or of the whole module."""
    inner: list[list[Comment]] = [[] for _ in children]
    free: list[Comment] = []
    starts = [child.span.start for child in children]
    for comment in comments:
        owner = bisect.bisect_right(starts, comment.span.start) - 1
        if owner >= 0 and _inside(comment, children[owner]):
            inner[owner].append(comment)
        else:
            free.append(comment)
    header, leading, trailing, end = _place(free, children, allow_header=not top)

    # units in output order: (first line, last line, comment or child index); blank lines between
    units: list[tuple[int, int, Comment | int]] = []
    for index, child in enumerate(children):
        units += [(c.span.line, c.span.line, c) for c in leading[index]]
        units.append((child.span.line, child.span.end_line, index))
    units += [(c.span.line, c.span.line, c) for c in end]
    blank = [False] * len(units)
    for k in range(1, len(units)):
        blank[k] = units[k][0] - units[k - 1][1] > 1
        previous = units[k - 1][2]
        if top and isinstance(previous, int) and previous + 1 < len(children):
            blank[k] = blank[k] or _separated(children[previous], children[previous + 1])

    widths = _alignment(children, units, blank)
    pad = " " * indent
    lines: list[str] = []
    notes: list[str | None] = []  # the trailing comment of each one-line statement, to align
    for k, (_, _, unit) in enumerate(units):
        if blank[k]:
            lines.append("")
            notes.append(None)
        if isinstance(unit, Comment):
            lines.append(pad + _comment(unit))
            notes.append(None)
            continue
        statement, before = _statement(children[unit], inner[unit], indent, widths[unit])
        note = _comment(trailing[unit]) if trailing[unit] is not None else None
        if note is not None and len(statement) - before > 1:
            statement[-1] += "  " + note
            note = None
        lines += statement
        notes += [None] * (len(statement) - 1) + [note]
    return header, _align_notes(lines, notes)


def _align_notes(lines: list[str], notes: list[str | None]) -> list[str]:
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


def _aligned_text(node: Node) -> str | None:
    """What is padded before the `=` (or an entry's `:`) of a statement that lines up with its run."""
    if isinstance(node, Attr) or _alias(node):
        return node.name
    if isinstance(node, Entry):
        return _flat(node.key)
    if isinstance(node, ShardRule):
        return _flat(node.target)
    return None


def _run_kind(node: Node) -> tuple:
    return (type(node), node.kind) if isinstance(node, Definition) else (type(node),)


def _alignment(children: Sequence[Node], units: list, blank: list[bool]) -> list:
    """Pad width of each statement that lines up: the longest name (attribute, alias), target
    (shard rule) or key (entry) in its run of consecutive statements of one kind (broken by blank
    lines); for the rows of a schedule table, (rank digits, widest cell) so the columns line up."""
    runs: list[list[int]] = [[]]
    for k, (_, _, unit) in enumerate(units):
        if blank[k]:
            runs.append([])
        if not isinstance(unit, int):
            continue
        child = children[unit]
        if _aligned_text(child) is None:
            runs.append([])
            continue
        if runs[-1] and _run_kind(children[runs[-1][-1]]) != _run_kind(child):
            runs.append([])
        runs[-1].append(unit)
    widths: list = [0] * len(children)
    for run in runs:
        for index in run:
            widths[index] = max(len(_aligned_text(children[other])) for other in run)
    rows = [child for child in children if isinstance(child, RankRow)]
    if rows:
        table = (max(len(str(row.rank)) for row in rows), max((len(c) for row in rows for c in row.cells), default=0))
        widths = [table if isinstance(child, RankRow) else width for child, width in zip(children, widths)]
    return widths
