"""plandsl as a library: one function per stage, like `json` (load/loads, dump/dumps).

No logic lives here; each function calls the module that owns its stage. Functions that
return a checked plan raise `PlanError` (a ValueError) carrying every diagnostic.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from plandsl import ir
from plandsl.check.analysis import Analysis, analyze, checked_document
from plandsl.diagnostics import PlanError
from plandsl.syntax import Module


def parse(text: str, path: str = "<string>") -> Module:
    """Text -> syntax tree (no imports, no meaning)."""
    from plandsl.syntax.parser import parse_text
    return parse_text(text, path)


def parse_file(path: str | Path) -> Module:
    from plandsl.syntax.loader import read_source
    from plandsl.syntax.parser import parse_source
    return parse_source(read_source(path))


def check(path: str | Path, params: dict[str, Any] | None = None) -> Analysis:
    """Every diagnostic of a file and what it imports; never raises on bad input."""
    return analyze(str(path), params=params)


def checks(text: str, params: dict[str, Any] | None = None, path: str = "<string>") -> Analysis:
    return analyze(path, text=text, params=params)


def load(path: str | Path, params: dict[str, Any] | None = None) -> ir.Document:
    """A checked document; raises PlanError when the file has errors."""
    return _document(check(path, params))


def loads(text: str, params: dict[str, Any] | None = None, path: str = "<string>") -> ir.Document:
    return _document(checks(text, params, path))


def load_plan(path: str | Path, name: str | None = None, params: dict[str, Any] | None = None) -> ir.Plan:
    """The plan called `name` (or the file's only plan), checked."""
    from plandsl.check.analysis import load_plan as load_checked_plan
    return load_checked_plan(path, name, params)


def load_runnable(path: str | Path, name: str | None = None, params: dict[str, Any] | None = None) -> ir.Plan:
    """`load_plan`, and what `plandsl run` needs on top: PlanError with the E7xx refusals when the
    interpreter cannot run the plan (`plandsl.runtime.support`)."""
    from plandsl.runtime.support import refusals
    from plandsl.ir.select import select_plan
    analysis = check(path, params)
    plan = select_plan(_document(analysis), name)
    refused = refusals(plan)
    if refused:
        raise PlanError(refused, analysis.sources)
    return plan


def run_refusals(plan: ir.Plan, cuda: bool | None = False) -> list:
    """Every reason `plandsl run` refuses a checked plan (E7xx Diagnostics), empty when it runs; `cuda`:
    whether its ranks run on CUDA (default: as on this CPU machine; None: whether this machine has CUDA)."""
    from plandsl.runtime.support import refusals
    return refusals(plan, cuda=cuda)


def format_text(text: str, path: str = "<string>") -> str:
    """Canonical layout of a plan's text (comments kept)."""
    from plandsl.syntax.format import format_text as format_plan_text
    return format_plan_text(text, path)


def format_bytes(data: bytes, path: str = "<string>") -> str:
    """Canonical layout of a file's bytes; PlanError E105 when they are not UTF-8 text."""
    from plandsl.syntax.format import format_module
    from plandsl.syntax.parser import decode, parse_source
    return format_module(parse_source(decode(path, data)))


def schema() -> dict:
    """JSON Schema of the resolved IR (`plandsl show --json`)."""
    return ir.Document.model_json_schema()


def _document(analysis: Analysis) -> ir.Document:
    return checked_document(analysis)
