"""`plandsl lsp`: the language server over stdio (pygls), wiring LSP requests to this package's answers.

Each open document is analysed when it opens or changes (`document.Snapshot`: `plandsl check`'s
diagnostics, published at once; of changes that arrived together, only the last is checked); a request
reads the snapshot of the latest text. The last version that lowered is kept, so that completion still
knows the file's names and axes while the text is half-typed.
"""
from __future__ import annotations

import asyncio

from lsprotocol import types
from pygls.lsp.server import LanguageServer

from plandsl import __version__
from plandsl.diagnostics import Diagnostic
from plandsl.lsp.actions import formatting, quick_fixes
from plandsl.lsp.complete import completions
from plandsl.lsp.convert import Explanations, Positions, diagnostic, path_of, uri_of
from plandsl.lsp.document import Snapshot
from plandsl.lsp.hover import hover_text
from plandsl.lsp.navigate import definition


class PlanServer(LanguageServer):
    def __init__(self) -> None:
        super().__init__("plandsl", __version__, text_document_sync_kind=types.TextDocumentSyncKind.Incremental)
        self.snapshots: dict[str, Snapshot] = {}
        self.lowered: dict[str, Snapshot] = {}  # the last version of each document that lowered
        self.shown: dict[str, dict[Diagnostic, types.Diagnostic]] = {}
        self.published: dict[str, set[str]] = {}  # document -> the other files its diagnostics were published on
        self.explained = Explanations()

    def analyse(self, uri: str) -> None:
        document = self.workspace.get_text_document(uri)
        snapshot = Snapshot(uri, path_of(uri), document.source, document.version)
        self.snapshots[uri] = snapshot
        if snapshot.document is not None:
            self.lowered[uri] = snapshot
        positions = self.positions(snapshot)
        shown = {problem: diagnostic(problem, positions, self.explained) for problem in snapshot.analysis.diagnostics}
        self.shown[uri] = shown
        by_file: dict[str, list[types.Diagnostic]] = {uri: []}
        for problem, converted in shown.items():
            file_uri = uri if problem.span.line < 1 or problem.span.file == snapshot.path else uri_of(problem.span.file)
            by_file.setdefault(file_uri, []).append(converted)
        for stale in self.published.get(uri, set()) - set(by_file):
            by_file[stale] = []
        self.published[uri] = set(by_file) - {uri}
        for file_uri, found in by_file.items():
            self.text_document_publish_diagnostics(types.PublishDiagnosticsParams(
                uri=file_uri, diagnostics=found, version=document.version if file_uri == uri else None))

    def current(self, uri: str) -> Snapshot | None:
        """The snapshot of the document's latest text (analysed now if a change has not been yet)."""
        snapshot = self.snapshots.get(uri)
        if snapshot is not None and snapshot.version != self.workspace.get_text_document(uri).version:
            self.analyse(uri)
            snapshot = self.snapshots[uri]
        return snapshot

    def positions(self, snapshot: Snapshot) -> Positions:
        return Positions(snapshot.analysis.sources, self.workspace.position_codec)

    def offset(self, uri: str, position: types.Position) -> int:
        return self.workspace.get_text_document(uri).offset_at_position(position)


server = PlanServer()


@server.feature(types.TEXT_DOCUMENT_DID_OPEN)
def did_open(ls: PlanServer, params: types.DidOpenTextDocumentParams) -> None:
    ls.analyse(params.text_document.uri)


@server.feature(types.TEXT_DOCUMENT_DID_CHANGE)
async def did_change(ls: PlanServer, params: types.DidChangeTextDocumentParams) -> None:
    # Changes already sent are applied first: of a burst typed while a long check ran, only the last is checked.
    await asyncio.sleep(0)
    uri = params.text_document.uri
    if ls.workspace.get_text_document(uri).version == params.text_document.version:
        ls.analyse(uri)


@server.feature(types.TEXT_DOCUMENT_DID_CLOSE)
def did_close(ls: PlanServer, params: types.DidCloseTextDocumentParams) -> None:
    uri = params.text_document.uri
    for file_uri in {uri} | ls.published.pop(uri, set()):
        ls.text_document_publish_diagnostics(types.PublishDiagnosticsParams(uri=file_uri, diagnostics=[]))
    for table in (ls.snapshots, ls.lowered, ls.shown):
        table.pop(uri, None)


@server.feature(types.TEXT_DOCUMENT_HOVER)
def hover(ls: PlanServer, params: types.HoverParams) -> types.Hover | None:
    snapshot = ls.current(params.text_document.uri)
    if snapshot is None:
        return None
    text = hover_text(snapshot, ls.offset(snapshot.uri, params.position))
    return types.Hover(contents=types.MarkupContent(kind=types.MarkupKind.Markdown, value=text)) if text else None


@server.feature(types.TEXT_DOCUMENT_COMPLETION,
                types.CompletionOptions(trigger_characters=["{", "(", ",", "."]))
def completion(ls: PlanServer, params: types.CompletionParams) -> types.CompletionList | None:
    uri = params.text_document.uri
    snapshot = ls.current(uri)
    if snapshot is None:
        return None
    items = completions(snapshot, ls.offset(uri, params.position), ls.lowered.get(uri))
    return types.CompletionList(is_incomplete=False, items=items)


@server.feature(types.TEXT_DOCUMENT_DEFINITION)
def go_to_definition(ls: PlanServer, params: types.DefinitionParams) -> types.Location | None:
    snapshot = ls.current(params.text_document.uri)
    if snapshot is None:
        return None
    return definition(snapshot, ls.offset(snapshot.uri, params.position), ls.positions(snapshot))


@server.feature(types.TEXT_DOCUMENT_FORMATTING)
def format_document(ls: PlanServer, params: types.DocumentFormattingParams) -> list[types.TextEdit] | None:
    snapshot = ls.current(params.text_document.uri)
    return formatting(snapshot, ls.positions(snapshot)) if snapshot else None


@server.feature(types.TEXT_DOCUMENT_CODE_ACTION,
                types.CodeActionOptions(code_action_kinds=[types.CodeActionKind.QuickFix]))
def code_actions(ls: PlanServer, params: types.CodeActionParams) -> list[types.CodeAction] | None:
    uri = params.text_document.uri
    snapshot = ls.current(uri)
    if snapshot is None:
        return None
    return quick_fixes(snapshot, params.range, ls.positions(snapshot), ls.shown.get(uri, {}))


def serve() -> None:
    """Answer one client on stdin/stdout until it exits."""
    server.start_io()
