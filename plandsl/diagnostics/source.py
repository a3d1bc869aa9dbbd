"""Source text and spans: where every node of a plan came from.

`Span` is 1-based line/column with 0-based character offsets; `SourceFile` turns a
span back into the source line with a caret under it.
"""
from __future__ import annotations

import bisect
import unicodedata
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Span:
    """A half-open region of one file: [start, end) in characters."""

    file: str
    line: int
    column: int
    end_line: int
    end_column: int
    start: int = 0
    end: int = 0

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.column}"

    def to(self, other: Span) -> Span:
        """The span from the start of `self` to the end of `other`."""
        return Span(self.file, self.line, self.column, other.end_line, other.end_column,
                    self.start, other.end)


NO_SPAN = Span("<unknown>", 0, 0, 0, 0)


@dataclass(frozen=True)
class SourceFile:
    path: str
    text: str
    _line_starts: list[int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        starts = [0]
        index = self.text.find("\n")
        while index != -1:
            starts.append(index + 1)
            index = self.text.find("\n", index + 1)
        object.__setattr__(self, "_line_starts", starts)

    def line_text(self, line: int) -> str:
        """The text of 1-based `line`, without its newline ('' when out of range)."""
        if not 1 <= line <= len(self._line_starts):
            return ""
        start = self._line_starts[line - 1]
        end = self.text.find("\n", start)
        return self.text[start:] if end == -1 else self.text[start:end].rstrip("\r")

    def position(self, offset: int) -> tuple[int, int]:
        """1-based (line, column) of a 0-based character offset."""
        offset = max(0, min(offset, len(self.text)))
        line = bisect.bisect_right(self._line_starts, offset)
        return line, offset - self._line_starts[line - 1] + 1

    def span(self, start: int, end: int) -> Span:
        line, column = self.position(start)
        end_line, end_column = self.position(end)
        return Span(self.path, line, column, end_line, end_column, start, end)

    def end_span(self) -> Span:
        """A one-character span at the end of the file (where EOF errors point)."""
        return self.span(max(0, len(self.text) - 1), len(self.text))

    def excerpt(self, span: Span, label: str = "") -> list[str]:
        """The source line of `span` and a caret line under it, gutter included. The line is shown as a terminal
        would not otherwise show it plainly: tabs expanded (stops of 4), each other character that does not print
        (a lone \\r, U+2028, a BOM) escaped as Python's repr escapes it; the caret is placed under the span's
        characters as shown (it was counted in characters, so a tab before the span put it short of it), in the
        columns a terminal gives them: two for an East Asian wide or fullwidth character, none for a nonspacing or
        enclosing mark (`_columns`; counted one each, a Chinese comment's characters before the span put the caret a
        column short per character). The line is shown to its first 200 columns, or where the span starts past them, a
        window of 200 columns from 60 characters before it, `...` where the window leaves the line's start out."""
        text = self.line_text(span.line)
        if not text and span.line == 0:
            return []
        index = min(max(span.column, 1), len(text) + 1) - 1  # the span's first character
        first, prefix = 0, ""
        pieces, at = _lay_out(text, 0, 0)
        if at[min(index, len(at) - 1)] > _SHOWN_COLUMNS - _AFTER:  # past the columns shown: a window around it
            first, prefix = max(0, index - _BEFORE), _LEFT_OUT
            pieces, at = _lay_out(text, first, len(prefix))
            if at[min(index - first, len(at) - 1)] > _SHOWN_COLUMNS - _AFTER:  # wide or escaped
                first = index  # characters before it: the window from the span itself
                pieces, at = _lay_out(text, first, len(prefix))
        kept = bisect.bisect_right(at, _SHOWN_COLUMNS) - 1  # the characters that end within the columns shown
        shown, shown_columns = prefix + "".join(pieces[:kept]), at[kept]

        def column_of(index: int) -> int:  # where character `index` (0-based) starts; past those laid out, somewhere
            return at[min(max(index - first, 0), len(at) - 1)]  # past the columns shown, all the caret needs to know

        start = column_of(index)
        if span.end_line == span.line and span.end_column > span.column:
            end = column_of(min(span.end_column, len(text) + 1) - 1)
        elif span.end_line > span.line:
            end = at[-1]
        else:
            end = start + 1
        column = min(start + 1, shown_columns + 1)
        width = max(1, min(end - start, shown_columns - column + 1 if shown_columns >= column else 1))
        gutter = len(str(span.line))
        caret = " " * (column - 1) + "^" * width + (f" {label}" if label else "")
        return [f"{' ' * gutter} |", f"{span.line} | {shown}", f"{' ' * gutter} | {caret}"]


def _lay_out(text: str, first: int, column: int) -> tuple[list[str], list[int]]:
    """The shown text of `text`'s characters from `first` on (tabs expanded to stops of 4 of the shown line, each other
    character that does not print escaped) and the column where each starts, from `column` on, up to the first
    character past the columns shown, of 8 characters a column at most (marks that take none): a diagnostic's work is
    not its line's length (100 diagnostics on one 400 kB line laid all of it out 100 times)."""
    pieces, at = [], [column]
    for c in text[first:first + 8 * _SHOWN_COLUMNS]:
        if at[-1] > _SHOWN_COLUMNS:
            break
        piece = " " * (4 - at[-1] % 4) if c == "\t" else c if c.isprintable() else repr(c)[1:-1]
        pieces.append(piece)
        at.append(at[-1] + _columns(piece))
    return pieces, at


_SHOWN_COLUMNS = 200
"""The most terminal columns of a source line an excerpt shows."""

_BEFORE, _AFTER = 60, 40
"""Characters shown before a span that starts past a line's first columns, and columns kept for it: a span that starts
within the last 40 of the columns shown is shown in a window from 60 characters before it."""

_LEFT_OUT = "..."
"""What stands for the characters of a line before its window (ASCII: one column each in every terminal)."""


_NO_COLUMN = ("Mn", "Me")
"""The categories of the marks a terminal draws over the character before them (wcwidth's zero width): nonspacing and
enclosing marks, most of which have no combining class (Thai's and Devanagari's vowel signs, U+FE0F, U+20DD), so
`unicodedata.combining` alone counted them a column each."""


def _columns(shown: str) -> int:
    """The terminal columns `shown` takes (as wcwidth counts printable characters): two for each East Asian wide or
    fullwidth character, none for a nonspacing or enclosing mark (`_NO_COLUMN`), one for any other."""
    if shown.isascii():
        return len(shown)
    return sum(0 if unicodedata.category(c) in _NO_COLUMN else 2 if unicodedata.east_asian_width(c) in ("W", "F")
               else 1 for c in shown)
