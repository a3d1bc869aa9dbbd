"""A .plan file -> its resolved IR and every diagnostic: load, lower, check.

The one place the stages are chained: loader (E1xx, E208, E209) -> lowering (E2xx) ->
checker (E3xx-E5xx) for each plan that lowered cleanly. Nothing here raises on bad input.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from plandsl import ir
from plandsl.check import check_plan
from plandsl.check.axis_roles import confirm_over
from plandsl.diagnostics import Diagnostic, PlanError, sort_key
from plandsl.lower import lower_file
from plandsl.diagnostics.source import SourceFile


@dataclass
class Analysis:
    path: str
    document: ir.Document | None
    diagnostics: list[Diagnostic] = field(default_factory=list)
    sources: dict[str, SourceFile] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not any(d.is_error for d in self.diagnostics)

    @property
    def errors(self) -> list[Diagnostic]:
        return [d for d in self.diagnostics if d.is_error]


def analyze(path: str | None = None, text: str | None = None, params: dict[str, Any] | None = None,
            search_path: tuple[Path, ...] | None = None, check: bool = True) -> Analysis:
    """Load `path` (or `text`), resolve imports and parameters, lower and check every plan."""
    return _analyze(path, text, params, search_path, check, confirm=True)


def _analyze(path, text, params, search_path, check: bool, confirm: bool) -> Analysis:
    lowered = lower_file(path, text, params, search_path)
    diagnostics, document = lowered.diagnostics, lowered.document
    if check and document is not None:
        for plan in document.plans:
            diagnostics += check_plan(plan)
    if check and confirm:  # the `over` a lowering E306 offers, checked (once: not for the edited plans)
        source = lowered.sources.get(lowered.path)
        diagnostics = [_confirmed(d, source, path, params, search_path) for d in diagnostics]
    unique = list(dict.fromkeys(diagnostics))
    return Analysis(lowered.path, document, sorted(unique, key=sort_key), lowered.sources)


def _confirmed(problem: Diagnostic, source: SourceFile | None, path, params, search_path) -> Diagnostic:
    """A lowering E306 (a parallelism without `over`) with an edit that checks (`axis_roles.confirm_over`)."""
    if (problem.code != "E306" or not problem.edits or source is None or problem.span.file != source.path
            or any(edit.span.file != source.path for edit in problem.edits)):
        return problem

    def errors_of(text: str) -> list[Diagnostic]:
        return [d for d in _analyze(path, text, params, search_path, True, confirm=False).diagnostics if d.is_error]
    return confirm_over(problem, source, errors_of)


def checked_document(analysis: Analysis) -> ir.Document:
    """The analysed document; PlanError carrying every error when it has any."""
    if not analysis.ok or analysis.document is None:
        raise PlanError(analysis.errors, analysis.sources)
    return analysis.document


def load_plan(path: str | Path, name: str | None = None, params: dict[str, Any] | None = None) -> ir.Plan:
    """The plan called `name` (or the file's only plan), checked; PlanError otherwise."""
    from plandsl.ir.select import select_plan  # lazy: `check` never picks one plan; `run` and the API do
    return select_plan(checked_document(analyze(str(path), params=params)), name)
