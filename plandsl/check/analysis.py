"""A .plan file -> its resolved IR and every diagnostic: load, lower, check.

The one place the stages are chained: loader (E1xx, E208, E209) -> lowering (E2xx) ->
checker (E3xx-E5xx) for each plan that lowered cleanly. Nothing here raises on bad input.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from plandsl import ir
from plandsl.check import check_plan
from plandsl.check.axis_roles import confirm_over
from plandsl.diagnostics import Diagnostic, PlanError, sort_key
from plandsl.lower import lower_file
from plandsl.diagnostics.source import SourceFile
from plandsl.syntax import Definition
from plandsl.syntax.parser import parse_text


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
        plans: _Plans | None = None  # where the file's plans are written, and it with them blanked: once, if needed
        confirmed = []
        for d in diagnostics:
            if _confirmable(d, source) and plans is None:
                plans = _plans(source)
            confirmed.append(_confirmed(d, source, path, params, search_path, plans or _Plans([], "")))
        diagnostics = confirmed
    unique = list(dict.fromkeys(diagnostics))
    return Analysis(lowered.path, document, sorted(unique, key=sort_key), lowered.sources)


def _confirmable(problem: Diagnostic, source: SourceFile | None) -> bool:
    return (problem.code == "E306" and bool(problem.edits) and source is not None and problem.span.file == source.path
            and all(edit.span.file == source.path for edit in problem.edits))


class _Plans(NamedTuple):
    """Where a file's plans are written, (start, end) each, and the file with every one of them blanked (`_alone`)."""
    spans: list[tuple[int, int]]
    blanked: str


def _plans(source: SourceFile) -> _Plans:
    """`_Plans` of `source` (it parsed: it lowered)."""
    try:
        module = parse_text(source.text, source.path)
    except PlanError:
        return _Plans([], source.text)
    spans = [(item.span.start, item.span.end) for item in module.items
             if isinstance(item, Definition) and item.kind == "plan"]
    text, pieces, at = source.text, [], 0
    for start, end in spans:
        pieces += [text[at:start], _WRITTEN.sub(" ", text[start:end])]
        at = end
    return _Plans(spans, "".join(pieces) + text[at:])


def _confirmed(problem: Diagnostic, source: SourceFile | None, path, params, search_path, plans: _Plans) -> Diagnostic:
    """A lowering E306 (a parallelism without `over`) with an edit that checks (`axis_roles.confirm_over`), in the
    file with its other plans blanked (`_alone`): their errors were taken as this plan's (a file of two plans without
    `over` offered each the other's edit too), and each E306 analysed the whole file again (quadratic in its plans:
    10, 20, 40 such plans 0.5, 1.4, 5.7 s)."""
    if not _confirmable(problem, source):
        return problem

    def errors_of(text: str) -> list[Diagnostic]:
        return [d for d in _analyze(path, text, params, search_path, True, confirm=False).diagnostics if d.is_error]
    return confirm_over(problem, _alone(source, problem, plans), errors_of)


_WRITTEN = re.compile(r"[^\r\n]")


def _alone(source: SourceFile, problem: Diagnostic, plans: _Plans) -> SourceFile:
    """`source` with every plan but the one `problem` is in written as spaces, line breaks kept: every offset, line
    and column as in the file, so that an edit of the plan is an edit of the file. Made from the file with every plan
    blanked (`_Plans.blanked`, once per file) and this plan's text put back: the blanking of the others per edit
    made a file of N such plans cost N x its length in regular-expression substitutions."""
    mine = [(start, end) for start, end in plans.spans if start <= problem.span.start < end]
    if not mine or len(plans.spans) == 1:
        return source
    (start, end), blanked = mine[0], plans.blanked
    return SourceFile(source.path, blanked[:start] + source.text[start:end] + blanked[end:])


def checked_document(analysis: Analysis) -> ir.Document:
    """The analysed document; PlanError carrying every error when it has any."""
    if not analysis.ok or analysis.document is None:
        raise PlanError(analysis.errors, analysis.sources)
    return analysis.document


def load_plan(path: str | Path, name: str | None = None, params: dict[str, Any] | None = None) -> ir.Plan:
    """The plan called `name` (or the file's only plan), checked; PlanError otherwise."""
    from plandsl.ir.select import select_plan  # lazy: `check` never picks one plan; `run` and the API do
    return select_plan(checked_document(analyze(str(path), params=params)), name)
