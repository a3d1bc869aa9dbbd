"""`plandsl lsp`: the language server over stdio (pygls), wiring LSP requests to this package's answers.

Each open document is analysed when it opens or changes (`document.Snapshot`: `plandsl check`'s
diagnostics, published at once; of changes that arrived together, only the last is checked); a request
reads the snapshot of the latest text. The last version that lowered is kept, so that completion still
knows the file's names and axes while the text is half-typed.
"""
from __future__ import annotations

import asyncio
import logging
import re
import sys
from typing import BinaryIO
from urllib.parse import unquote

from lsprotocol import types
from pygls.exceptions import JsonRpcException, JsonRpcInvalidRequest, JsonRpcServerNotInitialized
from pygls.lsp.server import LanguageServer
from pygls.protocol import LanguageServerProtocol
from pygls.protocol.language_server import lsp_method
from pygls.workspace.position_codec import ServerTextPosition, Utf8, Utf16, Utf32

from plandsl import __version__
from plandsl.diagnostics import Diagnostic
from plandsl.diagnostics.internal import debugging
from plandsl.lsp.actions import formatting, quick_fixes
from plandsl.lsp.complete import completions
from plandsl.lsp.convert import Explanations, Positions, diagnostic, path_of, uri_of
from plandsl.lsp.document import Snapshot
from plandsl.lsp.hover import hover_text
from plandsl.lsp.navigate import definition


class Answered(Exception):
    """A message the server already answered with a JSON-RPC error (unreadable params): pygls's reader still logs
    the exception, and `PlanServer.report_server_error` shows the client nothing more."""


class PlanProtocol(LanguageServerProtocol):
    """pygls's protocol, answering what it left unanswered or reported as the server's own error:

    1. A request whose params do not read as the method's (a negative position, a line past 2^31) got no
       response at all, so a client waited for it for ever: now the JSON-RPC error -32602 (Invalid Params)
       answers it, by its id.
    2. A change to a document that was never opened (or already closed) raised KeyError in pygls's workspace,
       which a client showed as "Error in server: KeyError": now it is logged and left out, as LSP leaves
       such a change undefined.
    3. A notification before `initialize` (a document opened, changed or closed, a notebook's, a workspace
       folder's) raised RuntimeError in pygls's handlers (no workspace yet), shown as "Error in server:
       RuntimeError", and a request was answered `null`: LSP says a notification is dropped then and a request
       errors with ServerNotInitialized (-32002); now both are so, the dropped ones logged.
    4. A request after `shutdown` was logged and never answered; LSP says it errors with InvalidRequest
       (-32600), which it now does.
    5. The changes of one didChange are applied in one pass over the text (`applied`), not each by pygls's split
       and rewrite of the whole text."""

    def handle_message(self, message):
        method = getattr(message, "method", None)
        if method is not None and self._workspace is None and method not in (types.INITIALIZE, types.EXIT):
            if getattr(message, "id", None) is not None:
                self._send_response(message.id, error=JsonRpcServerNotInitialized(
                    "the server is not initialized: send initialize first").to_response_error())
            else:
                logging.getLogger("pygls").warning("plandsl lsp: %s before initialize, dropped", method)
            return
        if self._shutdown and getattr(message, "method", types.EXIT) != types.EXIT \
                and getattr(message, "id", None) is not None:
            self._send_response(message.id, error=JsonRpcInvalidRequest(
                "the server is shutting down: no request after shutdown").to_response_error())
            return
        super().handle_message(message)

    def structure_message(self, data):
        try:
            return super().structure_message(data)
        except JsonRpcException as error:
            if isinstance(data, dict) and "method" in data and isinstance(data.get("id"), (int, str)) \
                    and not isinstance(data.get("id"), bool):
                self._send_response(data["id"], error=error.to_response_error())
                raise Answered(error) from error  # answered: one line on stderr, no "Error in server" pop-up
            raise

    @lsp_method(types.TEXT_DOCUMENT_DID_CHANGE)
    def lsp_text_document__did_change(self, params: types.DidChangeTextDocumentParams):
        uri = params.text_document.uri
        if self.workspace.text_documents.get(unquote(uri)) is None:
            logging.getLogger("pygls").warning("plandsl lsp: a change to %s, which is not open, left out", uri)
            return
        if len(params.content_changes) > 1:
            document = self.workspace.get_text_document(uri)
            whole = applied(document.source, params.content_changes, document.position_codec)
            params = types.DidChangeTextDocumentParams(
                text_document=params.text_document,
                content_changes=[types.TextDocumentContentChangeWholeDocument(text=whole)])
        yield from super().lsp_text_document__did_change(params)


def applied(text: str, changes, codec) -> str:
    """`text` after the changes of one didChange, in order, each on the text the ones before it left, as pygls's
    TextDocument applies them (a change at the line past the last appends; a range ending past the last line drops
    the rest; one ending on a line before it starts changes nothing), on a list of the lines: pygls splits and
    rewrites the whole text for each change (2,000 changes to a document of 100,000 lines took 26 s, the changes a
    16 MB message holds hours). A change is spliced in with the lines beside it, split again together, so that a
    `\r` and a `\n` that meet make one line break, as they do in the whole text."""
    lines = text.splitlines(True)
    for change in changes:
        if not isinstance(change, types.TextDocumentContentChangePartial):
            lines = change.text.splitlines(True)
            continue
        start, end = (_from_client_units(lines, codec, change.range.start),
                      _from_client_units(lines, codec, change.range.end))
        if start.line == len(lines):
            last = lines.pop() if lines else ""
            lines += (last + change.text).splitlines(True)
            continue
        if start.line > len(lines) or end.line < start.line:
            continue
        low, high = max(start.line - 1, 0), min(end.line + 2, len(lines))
        head = "".join(lines[low:start.line]) + lines[start.line][:start.character] + change.text
        tail = lines[end.line][end.character:] + "".join(lines[end.line + 1:high]) if end.line < len(lines) else ""
        lines[low:high] = (head + tail).splitlines(True)
    return "".join(lines)


_SURROGATE = re.compile("[\ud800-\udfff]")
_ENCODED = {Utf8: ("utf-8", 1), Utf16: ("utf-16-le", 2)}


def _from_client_units(lines: list[str], codec, position: types.Position) -> ServerTextPosition:
    """pygls's `position_from_client_units` (the line and the character it is in, past the end the line's last, a
    position inside a character of several units past it), counted by the codecs in C: pygls counts the line's units
    one character at a time in Python, twice, for each position, and a didChange of 1,000 changes to a line of
    100 kB took 61 s. A line with a lone surrogate in it, or a codec of another encoding, is pygls's to count."""
    encoded = _ENCODED.get(type(codec.impl))
    if not lines or position.line >= len(lines) or (encoded is None and not isinstance(codec.impl, Utf32)):
        return codec.position_from_client_units(lines, position)
    line = lines[position.line].replace("\r\n", "\n")
    if not line.isascii() and encoded is not None:
        if _SURROGATE.search(line):
            return codec.position_from_client_units(lines, types.Position(line=position.line,
                                                                          character=position.character))
        encoding, width = encoded
        units = line.encode(encoding)
        length = len(units) // width
    else:
        units, length = None, len(line)
    if length == 0:
        return ServerTextPosition(position.line, 0)
    character = length - 1 if position.character > length else position.character
    if units is None:  # a character is a unit
        return ServerTextPosition(position.line, character)
    head = units[:character * width].decode(encoding, "ignore")  # the whole characters before the position
    inside = len(head.encode(encoding)) < character * width  # and one the position is inside of
    return ServerTextPosition(position.line, len(head) + inside)


class PlanServer(LanguageServer):
    def __init__(self) -> None:
        super().__init__("plandsl", __version__, text_document_sync_kind=types.TextDocumentSyncKind.Incremental,
                         protocol_cls=PlanProtocol)
        self.snapshots: dict[str, Snapshot] = {}
        self.lowered: dict[str, Snapshot] = {}  # the last version of each document that lowered
        self.shown: dict[str, dict[Diagnostic, types.Diagnostic]] = {}
        self.published: dict[str, set[str]] = {}  # document -> the other files its diagnostics were published on
        self.explained = Explanations()

    def report_server_error(self, error: Exception, source) -> None:
        """pygls's reporter shows the client "Error in server: ..." (window/showMessage) for every error; one the
        server already answered (`Answered`: -32602 for unreadable params) is the stderr line pygls logged only."""
        if isinstance(error, Answered):
            return
        super().report_server_error(error, source)

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


MAX_MESSAGE_BYTES = 16 * 2**20
"""A JSON-RPC message's body: a plan is at most the parser's 2 MB (`syntax.parser.MAX_BYTES`), which JSON's escapes
(`\\u0001`: 6 bytes a character) keep below 12 MB. A larger one is read past in pieces and skipped: pygls read the
Content-Length a header gave at once (Content-Length: 10^12 was a MemoryError, the server gone)."""
MAX_HEADER_BYTES = 64 * 2**10
"""A header line is read in pieces of at most this: a line without its newline no longer grows without limit."""
_SKIPPED = b'{"jsonrpc": "2.0", "method": "$/cancelRequest", "params": {"id": "plandsl: a skipped message"}}'


class BoundedStdin:
    """The client's stream as pygls reads it (`readline`, `read(n)`), each read bounded (MAX_HEADER_BYTES,
    MAX_MESSAGE_BYTES): a message past the bound is read in pieces, dropped, and answered by a notification that
    does nothing, so the server goes on with the next."""

    def __init__(self, stream: BinaryIO, log: logging.Logger | None = None) -> None:
        self.stream = stream
        self.log = log or logging.getLogger(__name__)

    def readline(self) -> bytes:
        return self.stream.readline(MAX_HEADER_BYTES)

    def read(self, size: int) -> bytes:
        if size <= MAX_MESSAGE_BYTES:
            return self.stream.read(size)
        left = size
        while left > 0:
            piece = self.stream.read(min(left, 2**20))
            if not piece:
                return b""  # the stream ended inside the message: the server stops, as at any end of input
            left -= len(piece)
        self.log.error("plandsl lsp: skipped a message of %d bytes, past the limit of %d", size, MAX_MESSAGE_BYTES)
        return _SKIPPED


class OneLineErrors(logging.Filter):
    """pygls logs a message it cannot read (not JSON, not JSON-RPC, invalid params) with its traceback: one line
    instead, the exception's type and message, unless PLANDSL_DEBUG=1 (as the CLI's E108)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if debugging():
            return True
        if record.exc_info and record.exc_info[1] is not None:
            error = record.exc_info[1]
            record.msg, record.args = f"{record.getMessage()}: {type(error).__name__}: {error}", ()
            record.exc_info = record.exc_text = None
        elif "Traceback (most recent call last)" in record.getMessage():  # one formatted into the message
            record.msg, record.args = record.getMessage().split("\n", 1)[0], ()
        return True


def serve() -> None:
    """Answer one client on stdin/stdout until it exits."""
    handler = logging.StreamHandler()  # stderr, as logging's last resort wrote, at the same level
    handler.setLevel(logging.WARNING)
    handler.addFilter(OneLineErrors())
    pygls_log = logging.getLogger("pygls")
    pygls_log.addHandler(handler)
    pygls_log.propagate = False
    server.start_io(stdin=BoundedStdin(sys.stdin.buffer, pygls_log))
