"""Text -> syntax tree (plandsl.syntax.Module), or E1xx diagnostics.

The lark LALR parser is built once per process from grammar/plan.lark (shipped as the
package data `plandsl.grammar`). Syntax errors come back as `PlanError`, never as lark's
own exceptions or terminal names.
"""
from __future__ import annotations

import contextlib
import sys
import threading
from functools import cache, lru_cache
from importlib import resources

from lark import Lark, Token
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken

from plandsl.diagnostics import Diagnostic, Note, PlanError, diag
from plandsl.diagnostics.source import SourceFile
from plandsl.syntax import Comment, Module
from plandsl.syntax.build import MAX_DEPTH, MAX_DIGITS, Builder, LiteralTooLong, TreeTooDeep, build

MAX_BYTES = 2_000_000  # a plan is a page, not a data set; generated 10,000-layer plans are ~1 MB
MAX_NESTING = 64       # brackets inside brackets
MAX_TOKENS = 250_000   # lark parses ~50,000 tokens/s: a plan parses in seconds (a 1 MB 10,000-layer one has 220,000)

_OPEN = {"LPAR": "RPAR", "LSQB": "RSQB", "LBRACE": "RBRACE"}
_CLOSE = {v: k for k, v in _OPEN.items()}


class _TooDeep(Exception):
    def __init__(self, token: Token):
        self.token = token


class _TooMany(_TooDeep):
    """More than MAX_TOKENS tokens: the parse stops there, in time proportional to the limit."""


class _TooLong(_TooDeep):
    """More than MAX_DEPTH operators in a row (each nests the tree one level deeper): refused as read."""


# operators, each one more level of the tree in a chain (`..` and `//` are lark's anonymous terminals)
_CHAIN = {"PLUS", "MINUS", "STAR", "SLASH", "PERCENT", "AT", "DOT", "CMP_OP", "X", "OR", "AND", "NOT"}
_SEPARATORS = {"COMMA", "EQUAL", "COLON", "_NL"}


class _PostLex:
    """Drops newlines inside ( ) and [ ], where they only continue a line; guards nesting."""

    always_accept = ("_NL",)

    def process(self, stream):
        stack: list[str] = []
        in_a_row = [0]  # operators since the last separator, per bracket level
        previous = None
        for count, token in enumerate(stream):
            if count >= MAX_TOKENS:
                raise _TooMany(token)
            kind = token.type
            if kind == "_NL" and previous == "_NL":
                continue  # a comment line between two newlines
            if kind in _OPEN:
                stack.append(kind)
                in_a_row.append(0)
                if len(stack) > MAX_NESTING:
                    raise _TooDeep(token)
            elif kind in _CLOSE:
                if stack and stack[-1] == _CLOSE[kind]:
                    stack.pop()
                    in_a_row.pop()
            elif kind == "_NL" and stack and stack[-1] != "LBRACE":
                continue
            elif kind in _CHAIN or kind.startswith("__ANON"):
                in_a_row[-1] += 1
                if in_a_row[-1] > MAX_DEPTH:
                    raise _TooLong(token)
            elif kind in _SEPARATORS:
                in_a_row[-1] = 0
            previous = kind
            yield token


RECURSION_LIMIT = 12_000  # evaluation recurses over trees up to syntax.build.MAX_DEPTH levels deep


@contextlib.contextmanager
def deep_recursion():
    """Room for long operator chains while trees are evaluated (restored after)."""
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(max(old, RECURSION_LIMIT))
    try:
        yield
    finally:
        sys.setrecursionlimit(old)


class _Parser:
    def __init__(self) -> None:
        grammar = resources.files("plandsl.grammar").joinpath("plan.lark").read_text(encoding="utf-8")
        self.builder = Builder()
        self.comments: list[Token] = []
        self.lark = Lark(grammar, parser="lalr", lexer="contextual", postlex=_PostLex(),
                         propagate_positions=True, maybe_placeholders=True,
                         lexer_callbacks={"COMMENT": self.comments.append},
                         cache=True)
        _pass_children_through(self.lark)
        self.lock = threading.Lock()

    def parse(self, source: SourceFile) -> Module:
        with self.lock:
            self.builder.file = source.path
            self.comments.clear()
            module = build(self.builder, self.lark.parse(source.text))
            comments = tuple(_comment(source, t) for t in self.comments)
        return Module(module.file, module.items, comments, span=module.span)


def _pass_children_through(lark: Lark) -> None:
    """A `?rule: other` reduction hands its one child up unchanged: skip lark's position pass there.

    lark runs PropagatePositions on every reduction, also on the dozen precedence levels an operand
    climbs (`?expr` -> ... -> `?atom`), where it only copies a node's container positions onto
    themselves. Replacing those callbacks (one symbol, expand-single-child, no child filter) by
    `children[0]` gives the same tree and metas, and parses ~20 % faster. Any other lark layout:
    left as it is."""
    try:
        # lark internals: a lark without them skips this
        from lark.parse_tree_builder import ExpandSingleChild, PropagatePositions
        callbacks = lark._callbacks
    except (ImportError, AttributeError):
        return
    for rule, callback in list(callbacks.items()):
        if isinstance(callback, PropagatePositions) and isinstance(callback.node_builder, ExpandSingleChild) \
                and len(rule.expansion) == 1:
            callbacks[rule] = _first_child


def _first_child(children: list):
    return children[0]


@cache
def _parser() -> _Parser:
    return _Parser()


def terminal_names() -> dict[str, str]:
    """lark terminal name -> how a person would name it in a message."""
    names = {"NAME": "a name", "INT": "an integer", "FLOAT": "a number", "UNIT": "a unit",
             "STRING": "a string", "ACTION": "an action like 0F1", "IDLE": "'_'",
             "_NL": "a new line", "$END": "the end of the file", "CMP_OP": "a comparison",
             "ONE_F_ONE_B": "a name", "COMMENT": "a comment"}
    for terminal in _parser().lark.terminals:
        if terminal.name not in names and terminal.pattern.type == "str":
            names[terminal.name] = f"'{terminal.pattern.value}'"
    return names


def keywords() -> tuple[str, ...]:
    """The grammar's keywords (`plan`, `over`, `with`, `x`, ...): its string terminals that are words, which the
    contextual lexer treats as keywords only where the grammar expects them (the language server completes
    them; tests/unit/test_tmgrammar.py holds the editor grammar to them)."""
    return tuple(sorted({t.pattern.value for t in _parser().lark.terminals
                         if t.pattern.type == "str" and t.pattern.value.isalpha()}))


def _comment(source: SourceFile, token: Token) -> Comment:
    line_start = source.text.rfind("\n", 0, token.start_pos) + 1
    own_line = source.text[line_start:token.start_pos].strip() == ""
    return Comment(str(token), own_line, span=source.span(token.start_pos, token.end_pos))


def parse_source(source: SourceFile) -> Module:
    """Parse one source file; raises PlanError with one E1xx diagnostic on bad input."""
    problem = _precheck(source)
    if problem:
        raise PlanError([problem], {source.path: source})
    if len(source.text) <= CACHED_BYTES:
        return _parse_cached(source.path, source.text)
    return _parse_checked(source)


CACHED_BYTES = 64_000  # the stdlib's files and hand-written plans; generated 10,000-layer plans are parsed afresh


@lru_cache(maxsize=128)
def _parse_cached(path: str, text: str) -> Module:
    """The tree of a small file, kept: the stdlib's clusters and models are imported by every plan a
    process loads (a search checks dozens); the tree is immutable and depends only on path and text.
    A file that does not parse raises each time (lru_cache keeps no exceptions)."""
    return _parse_checked(SourceFile(path, text))


def _parse_checked(source: SourceFile) -> Module:
    try:
        return _parser().parse(source)
    except LiteralTooLong as long:
        token = long.token
        error = diag("E106", f"a number with {len(str(token))} digits; plans allow at most {MAX_DIGITS}",
                     source.span(token.start_pos, token.end_pos))
    except _TooMany as many:
        token = many.token
        error = diag("E106", f"the file has more than {MAX_TOKENS:,} tokens (names, numbers and symbols); "
                     "a plan may have at most that many", source.span(token.start_pos, token.end_pos),
                     hint="write repeated layers as ranges (`layer blocks[0:100] { ... }`) and long lists with `let`"
                          " and arithmetic; is this the file you meant?")
    except _TooLong as long_:
        error = _too_deep(source.span(long_.token.start_pos, long_.token.end_pos))
    except _TooDeep as deep:
        error = diag("E106", f"brackets nested more than {MAX_NESTING} deep",
                     source.span(deep.token.start_pos, deep.token.end_pos),
                     hint="split the expression with `let` definitions")
    except UnexpectedInput as exc:
        error = _syntax_error(source, exc)
    except TreeTooDeep:
        error = _too_deep(source.span(0, 1))
    raise PlanError([error], {source.path: source})


def _too_deep(span) -> Diagnostic:
    return diag("E106", "an expression is too long or nested too deeply to parse "
                f"(more than about {MAX_DEPTH:,} operators in a row)", span, hint="split it with `let` definitions")


def _precheck(source: SourceFile) -> Diagnostic | None:
    if len(source.text) > MAX_BYTES:
        return diag("E106", f"file has {len(source.text):,} characters; a plan may have at most {MAX_BYTES:,}",
                    source.span(0, 1), hint="is this really a .plan file?")
    nul = source.text.find("\x00")
    if nul != -1:
        return diag("E105", "file contains a NUL byte: it is binary, not a plan",
                    source.span(nul, nul + 1))
    return None


def parse_text(text: str, path: str = "<string>") -> Module:
    """Text -> syntax tree (no imports, no meaning); PlanError (E1xx) when it does not parse, E105 for text no
    UTF-8 file holds (a lone surrogate: a path of non-UTF-8 bytes written into a plan was UnicodeEncodeError, E108)."""
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise PlanError([diag("E105", f"the text holds {text[error.start]!r} at offset {error.start}, which no UTF-8 "
                                      "file holds (a file name of bytes that are not UTF-8?)",
                              SourceFile(path, text.encode("utf-8", "backslashreplace").decode()).span(0, 1))]) from None
    return parse_source(decode(path, data))


def decode(path: str, data: bytes) -> SourceFile:
    """Bytes -> SourceFile, or PlanError E105 for bytes that are not UTF-8."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        prefix = data[:exc.start].decode("utf-8", errors="replace")
        source = SourceFile(path, prefix + "\ufffd")
        raise PlanError([diag("E105", f"byte 0x{data[exc.start]:02x} at offset {exc.start} is not UTF-8",
                              source.span(len(prefix), len(prefix) + 1),
                              hint="save the file as UTF-8")], {path: source}) from None
    if text.startswith("\ufeff"):
        text = text[1:]
    return SourceFile(path, text)


_CHARACTER_HINTS = {
    "\u00d7": "write `x` for repetition, like `8 x a100_80g`",
    "'": 'strings use double quotes: "text"',
    "\u00b5": "write `us` for microseconds",
    "\u2212": "use the ASCII minus '-'",
    "\u201c": 'use ASCII double quotes "',
    "\u201d": 'use ASCII double quotes "',
    "\t": "tabs are fine as spacing; this one is inside a token",
    "$": "plans have no `$` variables: write the parameter's name",
}


def _syntax_error(source: SourceFile, exc: UnexpectedInput) -> Diagnostic:
    names = terminal_names()
    if isinstance(exc, UnexpectedCharacters):
        char = source.text[exc.pos_in_stream] if exc.pos_in_stream < len(source.text) else ""
        span = source.span(exc.pos_in_stream, exc.pos_in_stream + 1)
        if char == '"':
            return diag("E103", "string is not closed before the end of the line", span,
                        hint='close it with " on the same line')
        shown = repr(char) if char.isprintable() and char != " " else f"U+{ord(char):04X}" if char else "?"
        return diag("E104", f"unexpected character {shown}", span, hint=_CHARACTER_HINTS.get(
            char, "plans use letters, digits, _ and the operators + - * / // % @ .. x = : , ; ( ) [ ] { } #"))
    if isinstance(exc, UnexpectedEOF) or (isinstance(exc, UnexpectedToken) and exc.token.type == "$END"):
        unclosed = _unclosed(source.text)
        notes = [Note(f"'{source.text[unclosed]}' opened here is never closed", source.span(unclosed, unclosed + 1))] \
            if unclosed is not None else []
        last = len(source.text.rstrip())  # the end of the last line written, not the empty line after it
        at = source.span(last, last + 1) if 0 < last < len(source.text) else source.end_span()
        return diag("E102", "the file ends in the middle of a statement", at,
                    hint=_expected(exc, names) or "is a '}' or ')' missing?", notes=notes)
    assert isinstance(exc, UnexpectedToken)
    token = exc.token
    span = source.span(token.start_pos, token.end_pos) if token.start_pos is not None else source.end_span()
    found = "a new line" if token.type == "_NL" else f"'{token}'"
    expected = set(exc.expected or ())
    opener = _open_on_an_earlier_line(source, token, expected)
    if opener is not None:
        char = source.text[opener]
        closer = {"[": "]", "(": ")", "{": "}"}[char]
        return diag("E101", f"'{char}' is not closed on its line", source.span(opener, opener + 1),
                    hint=f"add '{closer}' at the end of line {source.position(opener)[0]}",
                    notes=[Note(f"the next line is read as part of it: unexpected {found}", span)])
    hint = _missing_comma(source, token, expected) or _expected(exc, names)
    return diag("E101", f"unexpected {found}", span, hint=hint)


def _open_on_an_earlier_line(source: SourceFile, token: Token, expected: set[str]) -> int | None:
    """`mesh = [dp = 2, tp = 2` with its `]` forgotten: the bracket still open where the parser stopped,
    when it was opened on an earlier line that goes on after it (a list, call or dict written on one line,
    not one laid out over several; a block's `{` ends its line) and, for '[' and '(', its closer is one of
    the tokens expected (a dict's items may also be separated by new lines)."""
    if token.start_pos is None:
        return None
    opener = _unclosed(source.text[:token.start_pos])
    if opener is None:
        return None
    closer = {"[": "RSQB", "(": "RPAR"}.get(source.text[opener])
    line_end = source.text.find("\n", opener)
    rest = source.text[opener + 1:line_end].split("#")[0].strip()
    if (closer is not None and closer not in expected) or line_end == -1 or line_end >= token.start_pos or not rest or rest.endswith(","):
        return None
    return opener


_VALUE_STARTS = {"NAME", "INT", "FLOAT", "STRING", "LPAR", "LSQB", "LBRACE", "MINUS", "NOT", "TRUE", "FALSE",
                 "ONE_F_ONE_B"}
_OPERATORS = {"PLUS", "MINUS", "STAR", "SLASH", "__ANON_SLASH", "PERCENT", "AT", "DOT", "CMP_OP", "X", "OR", "AND",
              "UNIT"}


def _expected(exc: UnexpectedInput, names: dict[str, str]) -> str | None:
    """The expected terminals in a person's words: closers first, then 'a value' or 'an operator'."""
    expected = set(getattr(exc, "expected", None) or getattr(exc, "allowed", None) or ())
    shown: list[str] = []
    if expected & _VALUE_STARTS and len(expected & _VALUE_STARTS) > 2:
        shown.append("a value")
        expected -= _VALUE_STARTS
    operators = {e for e in expected if e in _OPERATORS or names.get(e, "").strip("'") in
                 ("+", "-", "*", "/", "//", "%", "@", ".", "..", "x", "or", "and", "(", "[")}
    if len(operators) > 2:
        expected -= operators
        shown.append("an operator")
    rest = sorted(names.get(e, e.lower()) for e in expected if not e.startswith("__ANON") or e in names)
    words = [w for w in rest if not w.startswith("'")] + [w for w in rest if w.startswith("'")]
    shown = [w for w in words if w not in ("a new line",)] + shown + (["a new line"] if "a new line" in words else [])
    if not shown:
        return None
    return "expected " + ", ".join(shown[:7]) + (", ..." if len(shown) > 7 else "")


def _unclosed(text: str) -> int | None:
    """Offset of the innermost bracket still open at the end of `text` (strings, comments skipped)."""
    stack: list[int] = []
    pairs = {")": "(", "]": "[", "}": "{"}
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if ch == "#":
            end = text.find("\n", i)
            i = n if end == -1 else end
        elif ch == '"':
            end = text.find('"', i + 1)
            i = n if end == -1 else end + 1
            continue
        elif ch in "([{":
            stack.append(i)
        elif ch in pairs and stack and text[stack[-1]] == pairs[ch]:
            stack.pop()
        i += 1
    return stack[-1] if stack else None


def _missing_comma(source: SourceFile, token: Token, expected: set[str]) -> str | None:
    """`[dp = 2 tp = 2]` lexes `2 tp` as a quantity: say what is probably missing."""
    if "COMMA" not in expected:
        return None
    line_start = source.text.rfind("\n", 0, token.start_pos) + 1
    before = source.text[line_start:token.start_pos].rstrip().split()
    if len(before) >= 2 and before[-2][:1].isdigit() and before[-1].isidentifier():
        return f"is a ',' missing before '{before[-1]}'?"
    return None
