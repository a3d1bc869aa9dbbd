"""One version of an open plan: its analysis (`plandsl.api.checks`: load, lower, check, as `plandsl check`),
and, when a request needs them, the lowering's scopes (what each name of the file means) and estimates.

Nothing is evaluated that `check` would not evaluate: a model written in torch is read from its
`plandsl inspect` table, never imported (the API's default, without `--allow-model-import`).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from plandsl import api, ir
from plandsl import syntax as s
from plandsl.check.analysis import Analysis
from plandsl.lower import Lowering
from plandsl.lower.evaluate import Scope
from plandsl.lower.names import Poison
from plandsl.syntax.loader import Loaded, Loader

WORD = re.compile(r"[A-Za-z0-9_]+")


@dataclass
class Names:
    """The scopes of a file and its imports, as the lowering builds them (names -> syntax, lazily values)."""
    root: Loaded
    scope: Scope
    loader: Loader

    def find(self, name: str) -> tuple[Scope, Any] | None:
        return self.scope.find(name)

    def value(self, name: str) -> Any:
        """What `name` evaluates to in the file (a number, a quantity, an IR object); Poison when it fails."""
        return self.scope.name(s.Name(name))

    def enclosing(self, offset: int) -> s.Definition | None:
        """The top-level definition of the file around character `offset`."""
        for item in self.root.syntax.items:
            if isinstance(item, s.Definition) and item.span.start <= offset <= item.span.end:
                return item
        return None


def names_of(text: str, path: str) -> Names | None:
    """The file's scopes; None when it does not parse."""
    loader = Loader()
    root = loader.load_text(text, path)
    if root is None or root.syntax is None:
        return None
    lowering = Lowering(loader.modules)
    return Names(root, lowering.scopes[root.path], loader)


class Snapshot:
    """A document's text at one version, analysed; names and estimates computed on first use."""

    def __init__(self, uri: str, path: str, text: str, version: int | None = None):
        self.uri, self.path, self.text, self.version = uri, path, text, version
        self.analysis: Analysis = api.checks(text, path=path)
        self._names: Names | None | bool = False
        self._estimates: dict[str, Any] = {}

    @property
    def names(self) -> Names | None:
        if self._names is False:
            try:
                self._names = names_of(self.text, self.path)
            except Poison:
                self._names = None
        return self._names

    @property
    def document(self) -> ir.Document | None:
        return self.analysis.document

    def plan(self, name: str) -> ir.Plan | None:
        document = self.document
        return next((p for p in document.plans if p.name == name), None) if document else None

    def checked(self, plan: ir.Plan) -> bool:
        """Whether `plan` has no error of its own (an estimate of a plan the checker refused means nothing)."""
        span = plan.span
        return not any(d.is_error and (span is None or d.span.file != span.file
                                       or span.start <= d.span.start <= span.end) for d in self.analysis.diagnostics)

    def estimate(self, plan: ir.Plan):
        """The cost model's estimate of a checked plan (cached for this version); None when it cannot be made."""
        if plan.name not in self._estimates:
            try:
                self._estimates[plan.name] = api.estimate(plan) if self.checked(plan) else None
            except api.PlanError:
                self._estimates[plan.name] = None
        return self._estimates[plan.name]

    def axis(self, offset: int, name: str) -> ir.Axis | None:
        """The mesh axis `name` of the plan around `offset` (of this version, or None)."""
        names = self.names
        definition = names.enclosing(offset) if names is not None else None
        plan = self.plan(definition.name) if definition is not None and definition.kind == "plan" else None
        return next((axis for axis in plan.mesh.axes if axis.name == name), None) if plan else None

    def word_at(self, offset: int) -> tuple[int, int, str] | None:
        """The name (or number, or code) around character `offset`: (start, end, text)."""
        for match in WORD.finditer(self.text, max(0, offset - 200), offset + 200):
            if match.start() <= offset <= match.end():
                return match.start(), match.end(), match.group()
        return None
