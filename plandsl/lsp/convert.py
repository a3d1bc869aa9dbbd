"""Spans (1-based lines, columns in characters) <-> LSP positions (0-based, in the client's code units),
file keys <-> URIs, and plandsl's `Diagnostic` -> LSP's, its code linked to `plandsl explain CODE`."""
from __future__ import annotations

import atexit
import bisect
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from lsprotocol import types
from pygls.uris import to_fs_path
from pygls.workspace.position_codec import PositionCodec

from plandsl import api
from plandsl.diagnostics import Diagnostic
from plandsl.diagnostics.source import SourceFile, Span


def uri_of(file: str) -> str:
    """A span's file (the loader's key: relative to the working folder, or absolute) as a file URI."""
    return Path(os.path.abspath(file)).as_uri()


def path_of(uri: str) -> str:
    """A document's URI as the path the loader reads imports beside (`untitled:` documents: a name in the
    working folder, so that they may import the standard library)."""
    path = to_fs_path(uri) if uri.startswith("file:") else None
    return os.path.abspath(path) if path else os.path.join(os.getcwd(), "untitled.plan")


_NOT_ASCII = re.compile(r"[^\x00-\x7f]")


class Positions:
    """Converts spans of the files of one analysis (`sources`) into the client's positions."""

    def __init__(self, sources: Mapping[str, SourceFile], codec: PositionCodec):
        self.sources = sources
        self.codec = codec
        self._lines: dict[str, Sequence[str]] = {}
        self._wide: dict[tuple[str, int], tuple[list[int], list[int]]] = {}

    def lines(self, file: str) -> Sequence[str]:
        if file not in self._lines:
            source = self.sources.get(file)
            self._lines[file] = source.text.splitlines(True) if source is not None else ()
        return self._lines[file]

    def position(self, file: str, line: int, column: int) -> types.Position:
        lines = self.lines(file)
        if not lines or line < 1:
            return types.Position(line=max(line - 1, 0), character=max(column - 1, 0))
        if line > len(lines):
            line, column = len(lines), len(lines[-1]) + 1
        return types.Position(line=line - 1, character=self._units(file, line - 1, max(column - 1, 0)))

    def _units(self, file: str, index: int, character: int) -> int:
        """The client's code units of the first `character` characters of line `index` (0-based), as the codec's
        `position_to_client_units` counts them, in a look-up: that counts them one by one each time (every diagnostic
        of a line of 400 kB counted up to its column: 5,000 diagnostics on one line took 42 s to publish). The
        characters of more than one unit (past ASCII, as the codec counts them) are found once per line."""
        text = self.lines(file)[index]
        character = min(character, len(text))
        key = (file, index)
        if key not in self._wide:
            at, extra = [], [0]  # where each character of several units is, and the units past one up to it
            for found in () if text.isascii() else _NOT_ASCII.finditer(text):
                more = self.codec.client_num_units(found.group()) - 1
                if more:
                    at.append(found.start())
                    extra.append(extra[-1] + more)
            self._wide[key] = (at, extra)
        at, extra = self._wide[key]
        return character + extra[bisect.bisect_left(at, character)]

    def range(self, span: Span | None) -> types.Range:
        if span is None or span.line < 1:  # NO_SPAN: the file as a whole
            return types.Range(start=types.Position(line=0, character=0), end=types.Position(line=0, character=0))
        start = self.position(span.file, span.line, span.column)
        end = self.position(span.file, span.end_line, span.end_column) if span.end_line >= 1 else start
        return types.Range(start=start, end=end)

    def location(self, span: Span) -> types.Location:
        return types.Location(uri=uri_of(span.file), range=self.range(span))


def diagnostic(problem: Diagnostic, positions: Positions, explained: Callable[[str], str | None]) -> types.Diagnostic:
    """An LSP diagnostic: plandsl's code, range, message (the hint and a schedule's grid after it) and notes
    as related locations; the code links to its `plandsl explain` text (`explained(code)`: a URI)."""
    message = problem.message
    if problem.grid:
        message += "\n" + problem.grid
    if problem.hint:
        message += f"\nhint: {problem.hint}"
    related = []
    for note in problem.notes:
        if note.span is not None and note.span.line >= 1:
            related.append(types.DiagnosticRelatedInformation(location=positions.location(note.span),
                                                              message=note.message))
        else:
            message += f"\nnote: {note.message}"
    link = explained(problem.code)
    return types.Diagnostic(
        range=positions.range(problem.span), message=message, code=problem.code, source="plandsl",
        severity=types.DiagnosticSeverity.Warning if problem.severity == "warning" else types.DiagnosticSeverity.Error,
        code_description=types.CodeDescription(href=link) if link else None,
        related_information=related or None)


class Explanations:
    """`plandsl explain CODE`'s text, written once per code into a folder of this server's own, so that
    a diagnostic's code can link to it as a file any client opens."""

    def __init__(self) -> None:
        self._folder: str | None = None
        self._uris: dict[str, str | None] = {}

    def __call__(self, code: str) -> str | None:
        if code not in self._uris:
            self._uris[code] = self._write(code)
        return self._uris[code]

    def _write(self, code: str) -> str | None:
        text = api.explain(code)
        if text is None:
            return None
        try:
            if self._folder is None:
                self._folder = tempfile.mkdtemp(prefix="plandsl-explain-")
                atexit.register(shutil.rmtree, self._folder, True)  # the server's own folder goes with it
            path = Path(self._folder) / f"{code}.md"
            path.write_text(f"`plandsl explain {code}`\n\n```\n{text}\n```\n", encoding="utf-8")
        except OSError:
            return None
        return path.as_uri()
