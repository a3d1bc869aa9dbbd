"""What an adapter returns: the exported text and what the target cannot express, or the imported plan.

Stage: below every adapter of `plandsl.interop`. Contract: frozen results; an adapter never raises on a
plan or on flags, it returns their problems as Diagnostics (`lost`, `diagnostics`); `Capped` keeps an import's
problems of one kind to MAX_REPORTED diagnostics and one count of the rest.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from plandsl import ir
from plandsl.check.analysis import analyze
from plandsl.diagnostics import Diagnostic, PlanError, diag
from plandsl.diagnostics.source import SourceFile
from plandsl.syntax.format import format_text


def loser(plan: ir.Plan, tool: str, lost: list[Diagnostic]) -> Callable[..., None]:
    """`lose(message, field, hint=None)`: appends to `lost` the E808 "{tool} cannot express {message}" at the
    plan's attribute `field` (where it was written, else the plan)."""
    def lose(message: str, field: str, hint: str | None = None) -> None:
        node = getattr(plan, field, None)
        span = getattr(node, "span", None) or plan.span_of(field)
        lost.append(diag("E808", f"{tool} cannot express {message}", span, hint=hint))
    return lose


@dataclass(frozen=True)
class Exported:
    """A plan in a target's own format; `lost`: one E808 per part of the plan the target cannot express
    (empty: the text says everything the target can be told)."""
    target: str
    text: str
    lost: tuple[Diagnostic, ...] = ()

    @property
    def empty(self) -> bool:
        """Nothing of the plan is in the target's format (torch's schedule CSV of a plan without a pipeline): no
        file to write, even with --lossy (an empty CSV, which `plandsl import` refuses, E603)."""
        return not self.text.strip()


@dataclass(frozen=True)
class Imported:
    """A target's configuration as a formatted plan that passes `plandsl check` (`text`), or the problems
    that stop it (`diagnostics`: the flags' own E804-E807, else the checker's on the plan written)."""
    text: str | None
    diagnostics: tuple[Diagnostic, ...] = ()
    sources: dict[str, SourceFile] = field(default_factory=dict)
    ignored: tuple[str, ...] = ()   # flags read and left out: they mean nothing in a plan (logging, data paths)

    @property
    def ok(self) -> bool:
        return self.text is not None and not any(d.is_error for d in self.diagnostics)

    def left_out(self, separator: str = " ") -> str:
        """`ignored` as the CLI's note says it (`left_out`)."""
        return left_out(self.ignored, separator)


MAX_LEFT_OUT = 50
"""What an import left out that its plan's comment and the CLI's note name one by one; then how many more."""
MAX_LEFT_OUT_CHARS = 80
"""Characters of one of them the comment shows (a value of a million characters: its start and how many more)."""


def escaped(text: str) -> str:
    """`text` on one line: each character that is not printable escaped as Python's repr escapes it, the backslash
    itself included (`\\\\` for a backslash: `\\n` is a line break), as `left_out` and the messages that quote a name
    read from the user's file show it (a DeepSpeed key holding a line break broke its E804 over two lines)."""
    return "".join(c if c.isprintable() and c != "\\" else repr(c)[1:-1] for c in text)


def left_out(ignored, separator: str) -> str:
    """What an import left out (flags as written, DeepSpeed's keys) as one line of the plan's comment: each with the
    characters that are not printable escaped as Python's repr escapes them, the backslash itself included (a flag's
    value or a key holding a line break wrote the rest of it into the plan as plan text: `--log-interval $'1\nlet q =
    2'` added `let q = 2`, a key `"b\n}"` made the plan E101; a value of a backslash and an n, `'a\nb'`, was shown as a
    line break is, `a\nb`: now `a\\nb`),
    the first MAX_LEFT_OUT, each of at most MAX_LEFT_OUT_CHARS (50,000 left out were a comment of 1.2 MB; 150,000
    made the plan too large to read back, E106 on a file never written)."""
    def shown(text: str) -> str:
        # whole escapes only, and `...` wherever something is dropped: the escaped text was cut at 80 characters,
        # halving an escape (`\u2028` shown `\u20`) and dropping the end of a short value without a sign
        pieces, size = [], 0
        for c in text[:MAX_LEFT_OUT_CHARS]:
            piece = escaped(c)
            if size + len(piece) > MAX_LEFT_OUT_CHARS:
                break
            pieces.append(piece)
            size += len(piece)
        return "".join(pieces) + ("..." if len(pieces) < len(text) else "")
    ignored = list(ignored)
    line = separator.join(shown(item) for item in ignored[:MAX_LEFT_OUT])
    return line + (f"{separator}... and {len(ignored) - MAX_LEFT_OUT:,} more" if len(ignored) > MAX_LEFT_OUT else "")


MAX_REPORTED = 20
"""Problems of one kind (unknown flags or keys, words that are no flag, flags given twice) an import reports one by one,
each with its hint; past them one more diagnostic counts the rest and names the first few. A file with thousands is
not a configuration with typos (another tool's, or generated): 50,000 unknown keys were 50,000 diagnostics and a
nearest-name search for each (2 s of CPU of DeepSpeed's import, 10 s of Megatron-LM's), of which `render` shows 100."""
NAMED_MORE = 5
"""Names of the problems past MAX_REPORTED that their summary quotes."""


class Capped:
    """The problems of one kind an import finds: `report(name, span)` is True for the first MAX_REPORTED, which the
    adapter reports as it always has (the work of their hints is done for these only), and counts the others;
    `summary()` is the one diagnostic of those others (none when there are none), at the first of them, whose JSON says
    how many were shown and how many there are (`"capped": {"shown": 20, "total": N}`)."""

    def __init__(self, code: str, what: str):
        self.code, self.what = code, what   # what: "unknown flags"
        self.reported, self.more, self.named = 0, 0, []
        self.span = None

    def report(self, name: str, span) -> bool:
        if self.reported < MAX_REPORTED:
            self.reported += 1
            return True
        if self.more == 0:
            self.span = span
        self.more += 1
        if len(self.named) < NAMED_MORE:
            self.named.append(escaped(name if len(name) <= 40 else f"{name[:30]}..."))
        return False

    def summary(self) -> list[Diagnostic]:
        if not self.more:
            return []
        names = ", ".join(self.named) + (", ..." if self.more > len(self.named) else "")
        return [diag(self.code, f"and {self.more:,} more {self.what} ({names}): the first {MAX_REPORTED} are "
                     "reported one by one", self.span,
                     hint=f"{MAX_REPORTED + self.more:,} {self.what} in all; docs/interop.md lists what the import reads",
                     capped=(MAX_REPORTED, MAX_REPORTED + self.more))]  # JSON: {"capped": {"shown", "total"}}


def checked(plan: str, plan_path: str, sources: dict[str, SourceFile], ignored=()) -> "Imported":
    """An import's plan text, formatted and checked: the plan, or the checker's diagnostics on it (`sources`
    gains the files they point into). A plan that does not parse (a number of the flags too long for a plan,
    E106) is the parser's diagnostics on the text that would have been written, not a usage error."""
    try:
        formatted = format_text(plan, plan_path)
    except PlanError as error:
        sources.update(error.sources)
        sources.setdefault(plan_path, SourceFile(plan_path, plan))
        return Imported(None, error.diagnostics, sources, tuple(ignored))
    analysis = analyze(plan_path, text=formatted)
    sources.update(analysis.sources)
    return Imported(formatted if analysis.ok else None, tuple(analysis.diagnostics), sources, tuple(ignored))
