"""What an adapter returns: the exported text and what the target cannot express, or the imported plan.

Stage: below every adapter of `plandsl.interop`. Contract: frozen results; an adapter never raises on a
plan or on flags, it returns their problems as Diagnostics (`lost`, `diagnostics`).
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
