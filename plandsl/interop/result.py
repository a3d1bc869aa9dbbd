"""What an adapter returns: the exported text and what the target cannot express, or the imported plan.

Stage: below every adapter of `plandsl.interop`. Contract: frozen results; an adapter never raises on a
plan or on flags, it returns their problems as Diagnostics (`lost`, `diagnostics`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from plandsl.diagnostics import Diagnostic
from plandsl.diagnostics.source import SourceFile


@dataclass(frozen=True)
class Exported:
    """A plan in a target's own format; `lost`: one E808 per part of the plan the target cannot express
    (empty: the text says everything the target can be told)."""
    target: str
    text: str
    lost: tuple[Diagnostic, ...] = ()


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
