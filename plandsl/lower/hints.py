"""Hints about names: the standard-library file (or a `.plan` beside the file) that defines a name the
file did not import and a name written with `-` (`llama3-70b` reads as llama3 minus 70 bits) (E201); a
misspelled attribute, key, block, option or argument, family, axis or schedule, respelled as the nearest
allowed name (`report_misspelled`: E206, E212, E302, E601).

Each hint comes with the `Edit`s that apply it, so following it gives a plan that knows the name.
"""
from __future__ import annotations

import itertools
import os
import re
from functools import lru_cache
from pathlib import Path
from typing import Iterable

from plandsl.diagnostics import Edit, PlanError, did_you_mean, nearest, respell
from plandsl.diagnostics.source import SourceFile, Span
from plandsl.syntax.loader import read_source, stdlib_files, stdlib_root
from plandsl.syntax.parser import parse_source

# Folders of the standard library whose files define things to import (examples and local/ define plans).
LIBRARY_FOLDERS = ("clusters", "models", "schedules")
_DASHED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:-[A-Za-z0-9_]+)+")
_IMPORT_LINE = re.compile(r'^[ \t]*import[ \t]+"[^"\n]*"[^\n]*(?:\n|$)', re.MULTILINE)


@lru_cache(maxsize=1)
def stdlib_definitions() -> dict[str, str]:
    """Name -> the import that defines it (`gpt3_175b` -> `models/gpt3`), for the library folders."""
    found: dict[str, str] = {}
    root = stdlib_root()
    for name in stdlib_files():
        if name.split("/")[0] not in LIBRARY_FOLDERS:
            continue
        try:
            module = parse_source(read_source(root / f"{name}.plan"))
        except PlanError:
            continue
        for item in module.items:
            defined = getattr(item, "name", None)
            if defined and getattr(item, "kind", "") != "plan":
                found.setdefault(defined, name)
    return found


SIBLINGS = 64  # .plan files of the importing file's folder read, at most, to find a name
SIBLING_ENTRIES = 4096  # entries of that folder looked at, at most, to choose them (a folder of a million files)


def sibling_definition(name: str, source: SourceFile | None) -> str | None:
    """The import (the file's stem) of the first other `.plan` file of `source`'s folder, in name order, that
    defines `name`. Only a file whose text holds `name` as a word is parsed: each was parsed whole for each unknown
    name, and a plan with a typo beside a few large generated plans (the 64 read at most, up to 2 MB each) took
    minutes to check, its work set by its neighbours rather than by what it says; likewise the folder is listed up to
    `SIBLING_ENTRIES` entries (all of them were, and each .plan file's path resolved)."""
    if source is None or not os.path.isfile(source.path):
        return None
    itself = Path(source.path).resolve()
    folder = itself.parent
    try:  # the first SIBLING_ENTRIES entries the folder lists, its .plan files among them in name order
        with os.scandir(folder) as entries:
            names = sorted(entry.name for entry in itertools.islice(entries, SIBLING_ENTRIES)
                           if entry.name.endswith(".plan"))
        files = [path for path in (folder / name for name in names[:SIBLINGS + 1]) if path.resolve() != itself]
    except OSError:
        return None
    files = files[:SIBLINGS]
    word = re.compile(rf"(?<![A-Za-z0-9_]){re.escape(name)}(?![A-Za-z0-9_])")
    for path in files:
        try:
            stat = path.stat()
            key = (str(path), stat.st_mtime_ns, stat.st_size)
            defined = _SIBLING_NAMES.get(key)
            if defined is None:
                text = read_source(path)
                if not word.search(text.text):
                    continue
                module = parse_source(text)
                defined = frozenset(getattr(item, "name", None) for item in module.items
                                    if getattr(item, "name", None) and getattr(item, "kind", "") != "plan")
                if len(_SIBLING_NAMES) >= 4 * SIBLINGS:
                    _SIBLING_NAMES.clear()
                _SIBLING_NAMES[key] = defined
        except (PlanError, OSError):
            continue
        if name in defined:
            return path.stem
    return None


# (path, modified, size) -> the names a sibling parsed once defines: the siblings that mention one unknown name are
# parsed once for all the others (a plan with 100 typos beside plans that mention them parsed each one 100 times)
_SIBLING_NAMES: dict[tuple[str, int, int], frozenset[str]] = {}


def import_edit(source: SourceFile | None, file: str) -> Edit | None:
    """Insert `import "file"` after the last import of `source` (or at its top)."""
    if source is None:
        return None
    lines = list(_IMPORT_LINE.finditer(source.text))
    at = lines[-1].end() if lines else 0
    text = f'import "{file}"\n'
    if lines and not source.text[:at].endswith("\n"):
        text = "\n" + text.rstrip("\n")
    return Edit(source.span(at, at), text)


def missing_import(name: str, visible: set[str], source: SourceFile | None,
                   fuzzy: bool = False) -> tuple[str, str, tuple[Edit, ...]] | None:
    """`name` is defined by a stdlib file the plan did not import (with `fuzzy`, a name close to it):
    (that name, the hint, the edit adding the import)."""
    library = stdlib_definitions()
    if name not in library and not fuzzy:
        beside = sibling_definition(name, source)
        library = {**library, name: beside} if beside is not None else library
    known = name if name in library else (nearest(name, [n for n in library if n not in visible]) if fuzzy else None)
    if known is None or known in visible:
        return None
    edit = import_edit(source, library[known])
    edits = (edit,) if edit else ()
    if known == name:
        return known, f'add `import "{library[known]}"`, which defines \'{name}\'', edits
    return known, f"did you mean '{known}'? add `import \"{library[known]}\"`, which defines it", edits


def unknown_name_hint(name: str, span: Span, visible: set[str], source: SourceFile | None
                      ) -> tuple[str | None, tuple[Edit, ...]]:
    """The hint for an unknown name and its edits: the import of the stdlib file that defines it, else
    the closest name of all those in scope or in the standard library (with its import if needed)."""
    library = missing_import(name, visible, source)
    close = nearest(name, visible)
    if library is None and close not in (None, nearest(name, visible | set(stdlib_definitions()))):
        close = None  # a name of the standard library is closer
    if library is None and close is None:
        library = missing_import(name, visible, source, fuzzy=True)
    if library is not None:
        known, hint, edits = library
        return hint, ((Edit(span, known),) if known != name else ()) + edits
    return did_you_mean(name, visible, "names in scope"), (Edit(span, close),) if close else ()


def dashed_name_hint(text: str, span: Span, visible: set[str], source: SourceFile | None
                     ) -> tuple[str, tuple[Edit, ...]] | None:
    """`text` is a name written with `-` for `_` (`llama3-70b` for `llama3_70b`) that exists in scope or
    in the standard library: the hint and its edits."""
    if not _DASHED.fullmatch(text):
        return None
    meant = text.replace("-", "_")
    if meant not in visible and meant not in stdlib_definitions():
        return None
    hint, edits = f"did you mean '{meant}'? names join words with `_`", (Edit(span, meant),)
    library = missing_import(meant, visible, source)
    if library is not None:
        hint, edits = f"{hint}; {library[1]}", edits + library[2]
    return hint, edits


def report_misspelled(reporter, code: str, message: str, name: str, span: Span | None,
                      allowed: Iterable[str], listed: str, notes=()) -> set[str]:
    """Report `name`, none of `allowed`, to `reporter` (the evaluator's `Reporter`; not imported, the evaluator
    imports this module) as `code` with the nearest allowed name as its did-you-mean and its edit; the
    allowed names it stands for, which the caller does not report missing as well (E207)."""
    allowed = list(allowed)
    edits = respell(name, allowed, span)
    reporter.error(code, message, span, hint=did_you_mean(name, allowed, listed), notes=notes, edits=edits)
    return {edit.text for edit in edits}


def respelled(names: Iterable[tuple[str, Span | None]], allowed: Iterable[str]) -> set[str]:
    """The allowed names that the unknown ones of `names` (name, where written) stand for, as
    `report_misspelled` reported them."""
    allowed = list(allowed)
    return {edit.text for name, span in names if name not in allowed for edit in respell(name, allowed, span)}
