"""`plandsl inspect FILE.plan`: every `hf(...)`/`factory(...)` model a plan file writes, inspected at its seq and
written where the plan reads it (`.plandsl/` beside the file).

Stage: interpreter side (`inspect_model` imports torch and the model's code). Contract: `inspect_plan(path)` returns
(table, cache path) per model, or raises PlanError: the file's own (E1xx, read and parsed only), E905 at a call whose
arguments are not literals (E205, E212, E213 as `check` says them for a call of another shape), E901-E904 from
inspecting a model, E110 at the model's call where its table cannot be written (checked before the model is built,
which can take minutes, and again as it is written: a full disk).
"""
from __future__ import annotations

import os

from plandsl.diagnostics import PlanError
from plandsl.diagnostics.source import SourceFile, Span
from plandsl.ir.inspected import InspectedModel, ModelSource, write_cache
from plandsl.lower.inspected import written_models
from plandsl.runtime.inspect import inspect_model
from plandsl.syntax.files import unwritable, writable_dir
from plandsl.syntax.loader import read_source
from plandsl.syntax.parser import parse_source

DTYPE = "bfloat16"


def inspect_plan(path: str | os.PathLike) -> list[tuple[InspectedModel, str]]:
    """Every model of the plan file at `path` inspected and written where the plan reads it: (table, cache path)
    each. The file's folder and the current one are searched first for a factory's module."""
    source_file = read_source(path)
    try:
        models = written_models(parse_source(source_file))
    except PlanError as error:  # E905 (E205, E212, E213) at a call no model source can be read from
        raise PlanError(error.diagnostics, {source_file.path: source_file}) from None
    written = []
    for source, seq, cache, span in models:
        folder = os.path.dirname(cache) or "."
        problem = writable_dir(folder)
        if problem:
            raise _unwritable(source_file, cache, f"{folder}: {problem}", source, span)
        table = inspect_model(source, seq, DTYPE, (os.path.dirname(os.fspath(path)) or ".", "."))
        try:
            os.makedirs(folder, exist_ok=True)
            write_cache(table, cache)
        except OSError as error:
            raise _unwritable(source_file, cache, error, source, span) from None
        written.append((table, cache))
    return written


def _unwritable(source_file: SourceFile, cache: str, error: OSError | str, source: ModelSource,
                span: Span) -> PlanError:
    """E110 at the model's call: its table cannot be written at `cache`, where the plan reads it."""
    folder = os.path.dirname(cache) or "."
    if isinstance(error, OSError):
        hint = None  # from the system's reason (a full disk, a refusal)
    elif not os.path.lexists(folder):  # the plan's own folder refuses it (read-only)
        hint = "the plan reads its models' tables from the .plandsl folder beside it, which cannot be created there: " \
               "make the plan's folder writable, or inspect a copy of the plan in a folder you may write"
    else:
        hint = "the plan reads its models' tables from the .plandsl folder beside it: make that a directory you may " \
               "write" + ("" if os.path.isdir(folder) else " (a file of that name moved away)")
    return PlanError([unwritable(cache, error, f"the layer table of {source.text}", span, hint)],
                     {source_file.path: source_file})
