"""Formatting stage: syntax tree -> canonical .plan text (what `plandsl fmt` writes); statements and
bodies here, expressions and the comments inside them in `plandsl.syntax.format_expr`.

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
from typing import BinaryIO, Sequence

from plandsl.syntax.format_expr import (STEP, WIDTH, align_notes, assemble, by_owner, comment_text, flat, joined, quote,
                                 scope)
from plandsl.syntax.files import FileProblem, read_bounded, read_stdin
from plandsl.syntax.parser import MAX_BYTES, decode, parse_source, parse_text
from plandsl.diagnostics import PlanError
from plandsl.diagnostics.source import SourceFile
from plandsl.syntax import (ActionStmt, Attr, Block, Comment, Definition, Entry, For, If, Import, LayerDecl, Let,
                            Module, Node, On, Param, RankRow, ShardRule)


# ---- entry points ----------------------------------------------------------------------
def format_source(source: SourceFile) -> str:
    """Parse `source` and return its canonical text (raises PlanError on bad input)."""
    return format_module(parse_source(source))


def format_text(text: str, path: str = "<string>") -> str:
    """Canonical layout of a plan's text (comments kept); PlanError (E1xx) when it does not parse."""
    return format_module(parse_text(text, path))


def format_file(path: str, stdin: BinaryIO | None = None) -> tuple[bytes, str]:
    """A plan file's bytes (`-`: `stdin`'s), read bounded like every plan file, and their canonical layout;
    PlanError when they cannot be read (E106-E109) or are not a plan (E1xx)."""
    try:
        data = read_stdin(stdin, MAX_BYTES) if path == "-" else read_bounded(path, MAX_BYTES, "plan file")
    except FileProblem as problem:
        raise PlanError([problem.diagnostic(file=None if path == "-" else path)]) from None
    return data, format_module(parse_source(decode("<stdin>" if path == "-" else path, data)))


def format_module(module: Module) -> str:
    """The canonical text of a parsed module, its comments included."""
    comments = sorted(module.comments, key=lambda c: c.span.start)
    _, lines = _body(module.items, comments, 0, top=True)
    return "\n".join(lines) + "\n" if lines else ""


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
        params = [f"{p.name}: {p.dimension}" if p.dimension else f"{p.name} = {flat(p.value)}"
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
    return pad + assemble(parts, indent, indent, 2)


def _simple(node: Node, indent: int, name_width,
            comments: Sequence[Comment] = ()) -> tuple[list[Comment], str]:
    """A statement without a body, starting with its indentation, and the comments inside it that
    go on lines before it (see _scope); `name_width` pads what comes before the `=` (or the `:` of
    an entry) to line it up with its run (see _alignment)."""
    pad = " " * indent
    match node:
        case Import():
            return list(comments), f"{pad}import {quote(node.path)}"
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
            parts = [f"{flat(node.key)}:".ljust(name_width + 1) + " ", *joined(node.values)]
        case ShardRule():
            parts = [f"shard {flat(node.target).ljust(name_width)} = ", node.value]
        case ActionStmt():
            parts = [node.call]
        case _:
            raise TypeError(f"cannot format statement {type(node).__name__}")
    hoisted, text = scope(parts, indent, indent, 0, 0, comments)
    return hoisted, pad + text


def _statement(node: Node, comments: list[Comment], indent: int, name_width) -> tuple[list[str], int]:
    """(lines of one statement, how many of them are comments put before it): comments inside its
    header go before it; those inside its expressions too, unless a broken container keeps them."""
    pad = " " * indent
    if _body_of(node) is None:
        hoisted, text = _simple(node, indent, name_width, comments)
        return [pad + comment_text(c) for c in hoisted] + text.split("\n"), len(hoisted)
    end = _header_end(node)
    lines = [pad + comment_text(c) for c in comments if c.span.start < end]
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
    return head + " {" + (f"  {comment_text(comment)}" if comment else "")


def _actions(body: tuple) -> str:
    return "; ".join(flat(statement.call) for statement in body)


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
    inner, between = by_owner(comments, children)
    free = [comment for _, comment in between]
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
            lines.append(pad + comment_text(unit))
            notes.append(None)
            continue
        statement, before = _statement(children[unit], inner[unit], indent, widths[unit])
        note = comment_text(trailing[unit]) if trailing[unit] is not None else None
        if note is not None and len(statement) - before > 1:
            statement[-1] += "  " + note
            note = None
        lines += statement
        notes += [None] * (len(statement) - 1) + [note]
    return header, align_notes(lines, notes)


def _aligned_text(node: Node) -> str | None:
    """What is padded before the `=` (or an entry's `:`) of a statement that lines up with its run."""
    if isinstance(node, Attr) or _alias(node):
        return node.name
    if isinstance(node, Entry):
        return flat(node.key)
    if isinstance(node, ShardRule):
        return flat(node.target)
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
