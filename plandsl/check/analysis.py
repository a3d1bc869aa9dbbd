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
from plandsl.diagnostics import Diagnostic, sort_key
from plandsl.syntax.loader import Loader
from plandsl.syntax.parser import deep_recursion
from plandsl.lower import Lowering
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
    loader = Loader() if search_path is None else Loader(search_path=search_path)
    root = loader.load_text(text, path or "<string>") if text is not None else loader.load_file(path)
    diagnostics = list(loader.diagnostics)
    if root is None or root.syntax is None or diagnostics:
        key = root.path if root else (path or "<string>")
        return Analysis(key, None, sorted(diagnostics, key=sort_key), loader.sources)
    lowering = Lowering(loader.modules, params)
    try:
        with deep_recursion():
            document = lowering.document(root)
    except RecursionError:
        from plandsl.diagnostics import diag
        lowering.diagnostics.append(diag("E106", "an expression is nested too deeply to evaluate", root.syntax.span))
        document = None
    diagnostics += lowering.diagnostics
    if check and document is not None:
        for plan in document.plans:
            diagnostics += check_plan(plan)
    unique = list(dict.fromkeys(diagnostics))
    return Analysis(root.path, document, sorted(unique, key=sort_key), loader.sources)
