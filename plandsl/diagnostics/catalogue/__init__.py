"""What every diagnostic code means, a small plan that triggers it, and how to fix it.

One `Entry` per code of `plandsl.diagnostics.codes.CODES`, written for the person reading the error:
why the rule exists on a real cluster, not only what the checker compares. One module per family of
codes fills a `Family` (`entry.py` says how an entry is written):

    syntax (E1xx)  names (E2xx, E22x model shapes)  meshes (E3xx)  placement (E4xx)  training (E5xx)
    schedules (E6xx)  refusals (E7xx, `plandsl run`)  rewrite (E8xx, generate --from, shrink, import, export,
    estimate --against, render)
    models (E9xx, `plandsl inspect`)  warnings (W)

`explain(code)` is the text `plandsl explain CODE` prints; docs/errors.md is generated from these
entries by tests/make_errors_doc.py, and tests/unit/test_diagnostics.py runs every example (it
must produce its code) and every fix (it must not).
"""
from __future__ import annotations

import textwrap

from plandsl.diagnostics import did_you_mean
from plandsl.diagnostics.catalogue import (meshes, models, names, placement, refusals, rewrite, schedules, syntax,
                                           training, warnings)
from plandsl.diagnostics.catalogue.entry import Entry, Family, family_of
from plandsl.diagnostics.codes import CODES

__all__ = ["ENTRIES", "FAMILIES", "Entry", "Family", "explain", "family_of", "unknown_code"]

# In the order of docs/errors.md: E1xx ... E9xx, then the warnings.
FAMILIES: tuple[Family, ...] = tuple(module.FAMILY for module in (
    syntax, names, meshes, placement, training, schedules, refusals, rewrite, models, warnings))

ENTRIES: dict[str, Entry] = {e.code: e for e in sorted((e for f in FAMILIES for e in f.entries), key=lambda e: e.code)}


def explain(code: str) -> str | None:
    """The text `plandsl explain CODE` prints, or None for an unknown code."""
    entry = ENTRIES.get(code.upper())
    if entry is None:
        return None
    wrapped = textwrap.fill(entry.explanation, width=88)
    lines = [f"{entry.code}: {entry.title}", "", wrapped, "", f"Example ({entry.file}):",
             textwrap.indent(entry.example, "    ").rstrip("\n"), "", f"Fix: {entry.fix}"]
    if entry.fixed_command:  # the options were wrong (or the machine lacked something): the command before and after
        before = after = ""
        if entry.lacks:  # E717, E719, E812, E815: the same command, on another machine
            before, after = f"    # on a machine without {entry.lacks}", f"    # on one with {entry.lacks}"
        lines[-2:-1] = ["", f"    plandsl {' '.join(entry.command)}{entry.named_file}{before}", ""]
        lines.append(f"    plandsl {' '.join(entry.fixed_command)}{entry.named_file}{after}")
    if entry.edits:
        lines.append(textwrap.indent(entry.fixed, "    ").rstrip("\n"))
    return "\n".join(lines)


def unknown_code(code: str) -> str:
    """What `plandsl explain CODE` says of a code it does not know: the nearest known codes, else where the
    list is."""
    suggestion = did_you_mean(code.upper(), CODES, "codes")
    return f"unknown code '{code}'" + (f"; {suggestion}" if suggestion else "; see docs/errors.md")
