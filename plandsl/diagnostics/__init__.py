"""Diagnostics: the one type every user-facing problem is reported as.

A `Diagnostic` has a stable code (catalogued in `plandsl.diagnostics.codes`), a message that shows
the numbers involved, a span, an optional hint and notes pointing at related spans. A hint
that names one concrete change also carries it as `edits` (text replacements), so tools and
tests can apply it: applied, the plan no longer has this problem (tests/unit/test_hints.py).
`render` draws it the way compilers do; `PlanError` carries a list of them across the
API boundary.
"""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from typing import Iterable, Mapping

from plandsl.diagnostics.codes import CODES
from plandsl.diagnostics.source import NO_SPAN, SourceFile, Span


@dataclass(frozen=True, slots=True)
class Note:
    message: str
    span: Span | None = None


@dataclass(frozen=True, slots=True)
class Edit:
    """Replace the text of `span` (its [start, end) offsets in `span.file`) by `text`."""
    span: Span
    text: str


@dataclass(frozen=True, slots=True)
class Diagnostic:
    code: str
    message: str
    span: Span = NO_SPAN
    hint: str | None = None
    notes: tuple[Note, ...] = ()
    grid: str | None = None  # the step x rank grid of a schedule error, pre-rendered
    edits: tuple[Edit, ...] = ()  # the hint as replacements, when it names one concrete change
    # (shown, total): this diagnostic stands for the problems of one kind past the `shown` reported one by one, `total`
    # in all (an import's `interop.result.Capped`); JSON says both, so no consumer takes the lines for all of them
    capped: tuple[int, int] | None = None

    @property
    def severity(self) -> str:
        return "warning" if self.code.startswith("W") else "error"

    @property
    def is_error(self) -> bool:
        return self.severity == "error"

    def to_json(self) -> dict:
        def where(span: Span | None) -> dict | None:
            if span is None or span is NO_SPAN:
                return None
            return {"file": span.file, "line": span.line, "column": span.column,
                    "end_line": span.end_line, "end_column": span.end_column}
        return {
            "code": self.code, "severity": self.severity, "message": self.message,
            "location": where(self.span), "hint": self.hint,
            "notes": [{"message": n.message, "location": where(n.span)} for n in self.notes],
            "grid": self.grid,
            "edits": [{"location": where(e.span), "text": e.text} for e in self.edits],
        } | ({"capped": {"shown": self.capped[0], "total": self.capped[1]}} if self.capped is not None else {})


def diag(code: str, message: str, span: Span | None = None, hint: str | None = None,
         notes: Iterable[Note] = (), grid: str | None = None, edits: Iterable[Edit] = (),
         capped: tuple[int, int] | None = None) -> Diagnostic:
    """Build a diagnostic; the code must be registered in `plandsl.diagnostics.codes`."""
    if code not in CODES:
        raise KeyError(f"unregistered diagnostic code {code}")
    return Diagnostic(code, message, span or NO_SPAN, hint, tuple(notes), grid, tuple(edits), capped)


def apply_edits(text: str, edits: Iterable[Edit]) -> str:
    """`text` with every edit applied (edits must not overlap; later offsets first)."""
    for edit in sorted(edits, key=lambda e: (e.span.start, e.span.end), reverse=True):
        text = text[:edit.span.start] + edit.text + text[edit.span.end:]
    return text


class PlanError(ValueError):
    """Raised at the API boundary when a plan has errors; `.diagnostics` has all of them."""

    def __init__(self, diagnostics: Iterable[Diagnostic], sources: Mapping[str, SourceFile] | None = None):
        self.diagnostics = tuple(diagnostics)
        self.sources = dict(sources or {})
        super().__init__(render_all(self.diagnostics, self.sources))


MAX_SHOWN_TEXT = 1000
"""Characters of a message, hint or note `render` shows: one quoting a value of a million characters (a flag's, a
key's) shows its start and says how much more there is; `--format json` keeps the whole text."""


def _shown(text: str) -> str:
    if len(text) <= MAX_SHOWN_TEXT:
        return text
    return f"{text[:MAX_SHOWN_TEXT]}... ({len(text) - MAX_SHOWN_TEXT:,} more characters)"


def render(d: Diagnostic, sources: Mapping[str, SourceFile]) -> str:
    message = _shown(d.message)
    lines = [f"{d.span}: {d.severity}[{d.code}]: {message}" if d.span is not NO_SPAN
             else f"{d.severity}[{d.code}]: {message}"]
    source = sources.get(d.span.file)
    if source is not None:
        lines += source.excerpt(d.span)
    pad = " " * (len(str(d.span.line)) + 1)
    if d.grid:
        lines += [f"{pad}|"] + [f"{pad}| {row}" for row in d.grid.splitlines()]
    if d.hint:
        lines.append(f"{pad}= hint: {_shown(d.hint)}")
    for note in d.notes:
        where = f" at {note.span}" if note.span and note.span is not NO_SPAN else ""
        lines.append(f"{pad}= note: {_shown(note.message)}{where}")
    return "\n".join(lines)


MAX_PER_FILE = 100


def render_all(diagnostics: Iterable[Diagnostic], sources: Mapping[str, SourceFile],
               limit: int = MAX_PER_FILE) -> str:
    """Render diagnostics in order, at most `limit` per file, then say how many more."""
    shown: dict[str, int] = {}
    hidden: dict[str, int] = {}
    parts = []
    for d in diagnostics:
        key = d.span.file
        if shown.get(key, 0) >= limit:
            hidden[key] = hidden.get(key, 0) + 1
            continue
        shown[key] = shown.get(key, 0) + 1
        parts.append(render(d, sources))
    for file, count in hidden.items():
        parts.append(f"{file}: ... and {count} more problem{'s' if count > 1 else ''} not shown")
    return "\n\n".join(parts)


def to_json_lines(diagnostics: Iterable[Diagnostic]) -> str:
    return "\n".join(json.dumps(d.to_json()) for d in diagnostics)


def sort_key(d: Diagnostic) -> tuple:
    return (d.span.file, d.span.line, d.span.column, d.code)


def describe_numbers(values: Iterable[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0..2, 5, 7..8' (ranges in messages are inclusive)."""
    ordered = sorted(set(values))
    parts, i = [], 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}..{ordered[j]}")
        i = j + 1
    return ", ".join(parts)


NEAREST_CUTOFF = 0.6  # difflib's ratio an option needs to be suggested


def nearest(name: str, options: Iterable[str]) -> str | None:
    """The option closest to `name` by edit distance, if it is close enough to suggest: difflib's
    `get_close_matches(name, options, n=1, cutoff=0.6)` (whose answer does not depend on the options' order),
    asked only of the options that could reach the cutoff, once per name and set of options.

    difflib reads every option: its first filters (the lengths, then the characters the two have in common, counted
    in Python) cost each unknown key of a `train` block ~0.1 ms over its 25 keys, twice (the hint and its edit):
    two thirds of checking a plan of 40,000 unknown keys. Now the options that share a character with `name` are
    looked up by character (an index built once per set of options), and of those the ones whose length, or whose
    characters shared with `name` (counted as often as `name` has them), cannot make up the cutoff are passed over:
    both bounds are at or above difflib's own (real_quick_ratio, quick_ratio), which bound the ratio, so the
    answer is difflib's. The answer is kept for the next call with the same name and options."""
    options = frozenset(options)
    if len(name) > _REMEMBERED_NAME:  # not kept: a key of a megabyte is no name a user repeats
        return _nearest(name, options)
    return _remembered_nearest(name, options)


_REMEMBERED_NAME = 200  # characters of a name whose nearest option is kept


def _nearest(name: str, options: frozenset[str]) -> str | None:
    import difflib  # lazy: difflib only for a misspelt name; `plandsl --help` loads this package
    if not name:  # difflib: an empty name is 1.0 from the empty option, 0 from any other
        return "" if "" in options else None
    ordered, index = _options_by_letter(options)
    letters = set(name)
    sharing = set().union(*(index.get(c, ()) for c in letters))
    size, counts, possible = len(name), None, []
    for i in sharing:
        option = ordered[i]
        total = size + len(option)
        if 2.0 * min(size, len(option)) / total < NEAREST_CUTOFF:  # difflib's real_quick_ratio
            continue
        common = letters.intersection(option)
        if len(common) < len(letters):  # some of `name`'s characters are not in `option`: count those that are
            if counts is None:
                counts = Counter(name)
            if 2.0 * min(sum(counts[c] for c in common), len(option)) / total < NEAREST_CUTOFF:
                continue
        possible.append(option)
    matches = difflib.get_close_matches(name, possible, n=1, cutoff=NEAREST_CUTOFF) if possible else []
    return matches[0] if matches else None


_remembered_nearest = lru_cache(maxsize=1024)(_nearest)


@lru_cache(maxsize=64)
def _options_by_letter(options: frozenset[str]) -> tuple[tuple[str, ...], dict[str, tuple[int, ...]]]:
    """`options` in a tuple, and character -> the positions in it of the options that have that character."""
    ordered = tuple(options)
    index: dict[str, list[int]] = {}
    for i, option in enumerate(ordered):
        for c in set(option):
            index.setdefault(c, []).append(i)
    return ordered, {c: tuple(at) for c, at in index.items()}


def respell(name: str, options: Iterable[str], span: Span | None, at_end: bool = False,
            to: str | None = None) -> tuple[Edit, ...]:
    """The edit of `did_you_mean`: `name`, written at the start (or `at_end`) of `span`, replaced by
    the closest option (or by `to`); () when none is close or the span is unknown."""
    close = to or nearest(name, list(options))
    if close is None or span is None or span is NO_SPAN or span.end - span.start < len(name):
        return ()
    start = span.end - len(name) if at_end else span.start
    line, column = (span.end_line, span.end_column - len(name)) if at_end else (span.line, span.column)
    return (Edit(Span(span.file, line, column, line, column + len(name), start, start + len(name)), close),)


def did_you_mean(name: str, options: Iterable[str], what: str = "") -> str | None:
    options = sorted(set(options))
    close = nearest(name, options)
    if close and len(options) <= 6:
        return f"did you mean '{close}'? ({what or 'expected one of'}: {', '.join(options)})"
    if close:
        return f"did you mean '{close}'?"
    if options and len(options) <= 12:
        return f"{what or 'expected one of'}: {', '.join(options)}"
    return None
