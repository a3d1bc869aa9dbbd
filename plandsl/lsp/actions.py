"""Formatting (`plandsl fmt`'s canonical text, as one edit) and quick fixes: a diagnostic whose hint names
one concrete change carries it as `edits` (`plandsl.diagnostics.Edit`), offered here as a code action."""
from __future__ import annotations

from lsprotocol import types

from plandsl import api
from plandsl.diagnostics import Diagnostic
from plandsl.lsp.convert import Positions, uri_of
from plandsl.lsp.document import Snapshot


def formatting(snapshot: Snapshot, positions: Positions) -> list[types.TextEdit] | None:
    """The whole document replaced by its canonical layout; None when it does not parse (the diagnostics say
    why), [] when it is already canonical."""
    try:
        formatted = api.format_text(snapshot.text, snapshot.path)
    except api.PlanError:
        return None
    if formatted == snapshot.text:
        return []
    lines = snapshot.text.splitlines(True)
    end = positions.codec.position_to_client_units(lines, types.Position(line=len(lines), character=0)) \
        if lines else types.Position(line=0, character=0)
    return [types.TextEdit(range=types.Range(start=types.Position(line=0, character=0), end=end), new_text=formatted)]


def quick_fixes(snapshot: Snapshot, wanted: types.Range, positions: Positions,
                lsp_diagnostics: dict[Diagnostic, types.Diagnostic]) -> list[types.CodeAction]:
    """A code action for each diagnostic with edits whose range touches `wanted`."""
    actions = []
    for problem in snapshot.analysis.diagnostics:
        if not problem.edits or problem.span.file != snapshot.path:
            continue
        shown = lsp_diagnostics.get(problem)
        where = positions.range(problem.span)
        if not _touches(where, wanted):
            continue
        changes: dict[str, list[types.TextEdit]] = {}
        for edit in problem.edits:
            changes.setdefault(uri_of(edit.span.file), []).append(
                types.TextEdit(range=positions.range(edit.span), new_text=edit.text))
        actions.append(types.CodeAction(
            title=f"{problem.code}: {problem.hint or 'apply the fix'}", kind=types.CodeActionKind.QuickFix,
            diagnostics=[shown] if shown else None, is_preferred=len(problem.edits) == 1,
            edit=types.WorkspaceEdit(changes=changes)))
    return actions


def _touches(a: types.Range, b: types.Range) -> bool:
    def key(p: types.Position) -> tuple[int, int]:
        return p.line, p.character
    return key(a.start) <= key(b.end) and key(b.start) <= key(a.end)
