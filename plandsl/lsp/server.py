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
from bisect import bisect_right
from itertools import accumulate
from math import isqrt
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
    `\r` and a `\n` that meet make one line break, as they do in the whole text.

    A line longer than LONG_LINE characters is kept in pieces with their lengths in the client's units (`_Long`): a
    change to it finds its piece by those lengths' running sums and splices that piece, where copying the line (and
    counting its units) for each change made 1,000 changes to a line of 100,000 characters cost 1,000 copies of it
    (2,000 changes to 200,000 characters 1.2 s: quadratic)."""
    units = _unit_counter(codec)
    largest = len(text) + sum(len(change.text) for change in changes)  # the most characters a line can reach
    piece = max(PIECE, isqrt(largest) * PIECE_ROOTS)  # a change costs a piece's characters and a line's pieces
    lines: list[str | _Long] = []
    _Builder(lines, units, piece).feed(text).close()
    for change in changes:
        if not isinstance(change, types.TextDocumentContentChangePartial):
            lines = []
            _Builder(lines, units, piece).feed(change.text).close()
            continue
        start, end = (_position(lines, codec, units, change.range.start),
                      _position(lines, codec, units, change.range.end))
        if start.line == len(lines):
            last = [lines.pop()] if lines else []
            built: list[str | _Long] = []
            _Builder(built, units, piece).feed(*last, change.text).close()
            lines += built
            continue
        if start.line > len(lines) or end.line < start.line:
            continue
        low, high = max(start.line - 1, 0), min(end.line + 2, len(lines))
        built = []
        builder = _Builder(built, units, piece).feed(*lines[low:start.line])
        builder.feed(_head(lines[start.line], start.character, units), change.text)
        if end.line < len(lines):
            builder.feed(_tail(lines[end.line], end.character, units), *lines[end.line + 1:high])
        builder.close()
        lines[low:high] = built
    return "".join(line if isinstance(line, str) else "".join(line.pieces) for line in lines)


LONG_LINE = 8_192  # characters of a line kept whole; a longer one is kept in pieces (`_Long`)
PIECE = 2_048  # characters of a piece of a long line, at most, or PIECE_ROOTS x the square root of the most the
PIECE_ROOTS = 8  # text can be, if more
_BREAKS = frozenset("\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029")  # what str.splitlines ends a line at


class _Long:
    """A line of more than LONG_LINE characters: its text in pieces, none empty, its line break (`\r\n` too) in the
    last, and each piece's length in the client's units."""
    __slots__ = ("pieces", "units")

    def __init__(self, pieces: list[str], units: list[int]) -> None:
        self.pieces, self.units = pieces, units


def _unit_counter(codec):
    """The length of a text in the client's units (UTF-8, -16 or -32), counted by the codecs in C; -1 for a text with
    a lone surrogate (which pygls counts, and does not encode); None for a codec of another encoding (no line is kept
    in pieces: pygls counts every position)."""
    if isinstance(codec.impl, Utf32):
        return len
    encoded = _ENCODED.get(type(codec.impl))
    if encoded is None:
        return None
    encoding, width = encoded

    def units(text: str) -> int:
        if text.isascii():
            return len(text)
        if _SURROGATE.search(text):
            return -1
        return len(text.encode(encoding)) // width
    return units


class _Builder:
    """The lines of the texts and lines fed to it, one after the other, split as str.splitlines splits their
    concatenation: into `out`, each a str or (past LONG_LINE characters, where the client's units can be counted) a
    `_Long`. The middle pieces of a `_Long` fed are taken as they are (a line break is only in its last), not
    copied or counted again."""

    def __init__(self, out: list, units, piece: int) -> None:
        self.out, self.units, self.piece = out, units, piece
        self.pieces: list[str] = []  # the line being built: texts to join, or (`long`) its pieces
        self.counts: list[int] = []  # with `long`, its pieces' units
        self.long = False
        self.size = 0
        self.cr = False  # the line ends in `\r`: a `\n` next is its line break's

    def feed(self, *parts: str | _Long) -> _Builder:
        for part in parts:
            if isinstance(part, str):
                self._text(part)
            else:
                pieces, counts = part.pieces, part.units
                if self.cr:  # its first piece may end the line before
                    self._text(pieces[0])
                    pieces, counts = pieces[1:], counts[1:]
                if len(pieces) > 1:  # pieces with no line break, taken with their units
                    self._long()
                    self.size += sum(map(len, pieces[:-1]))
                    self.pieces += pieces[:-1]
                    self.counts += counts[:-1]
                if pieces:
                    self._text(pieces[-1])
        return self

    def close(self) -> None:
        self.cr = False
        self._end()

    def _text(self, text: str) -> None:
        if not text:
            return
        if self.cr:
            self.cr = False
            if text[0] == "\n":
                self._add("\n")
                text = text[1:]
            self._end()
            if not text:
                return
        lines = text.splitlines(True)
        for line in lines[:-1]:
            self._add(line)
            self._end()
        last = lines[-1]
        self._add(last)
        if last[-1] == "\r":
            self.cr = True
        elif last[-1] in _BREAKS:
            self._end()

    def _add(self, text: str) -> None:
        self.size += len(text)
        if not self.long and (self.units is None or self.size <= LONG_LINE):
            self.pieces.append(text)
            return
        self._long()
        self._chunks(text)

    def _long(self) -> None:
        """The line so far in pieces, with their units."""
        if not self.long:
            self.long = True
            whole, self.pieces, self.counts = "".join(self.pieces), [], []
            self._chunks(whole)

    def _chunks(self, text: str) -> None:
        for at in range(0, len(text), self.piece):
            piece = text[at:at + self.piece]
            self.pieces.append(piece)
            self.counts.append(self.units(piece))

    def _end(self) -> None:
        pieces, counts = self.pieces, self.counts
        if not self.long or self.size <= LONG_LINE:
            if pieces:
                self.out.append("".join(pieces))
        else:
            if len(pieces) > 4 + 2 * self.size // self.piece:  # cut into more pieces than it needs: cut afresh
                whole, size = "".join(pieces), self.piece
                pieces = [whole[at:at + size] for at in range(0, len(whole), size)]
                counts = [self.units(piece) for piece in pieces]
            if len(pieces) > 1 and len(pieces[-1]) < 2:  # a line break cut in two (`\r`, `\n`) is made one again
                pieces[-2:] = [pieces[-2] + pieces[-1]]
                counts[-2:] = [self.units(pieces[-1])]
            self.out.append(_Long(pieces, counts))
        self.pieces, self.counts, self.long, self.size = [], [], False, 0


def _head(line: str | _Long, end: int, units) -> str | _Long:
    """line[:end]."""
    if isinstance(line, str):
        return line[:end]
    pieces = line.pieces
    k = bisect_right(list(accumulate(map(len, pieces))), end)  # the piece `end` is in
    if k == len(pieces):
        return line
    cut = pieces[k][:end - sum(map(len, pieces[:k]))]
    if not cut:
        return _Long(pieces[:k], line.units[:k]) if k else ""
    return _Long([*pieces[:k], cut], [*line.units[:k], units(cut)])


def _tail(line: str | _Long, start: int, units) -> str | _Long:
    """line[start:]."""
    if isinstance(line, str):
        return line[start:]
    pieces = line.pieces
    k = bisect_right(list(accumulate(map(len, pieces))), start)  # the piece `start` is in
    if k == len(pieces):
        return ""
    cut = pieces[k][start - sum(map(len, pieces[:k])):]
    return _Long([cut, *pieces[k + 1:]], [units(cut), *line.units[k + 1:]])


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


def _position(lines: list, codec, units, position: types.Position) -> ServerTextPosition:
    """`_from_client_units` over `lines`, whose long lines are `_Long`s: one of those is counted by its pieces' units,
    their running sums found in C and the piece the position is in counted alone. pygls counts a line with a lone
    surrogate in it."""
    if not lines:
        return codec.position_from_client_units(lines, position)
    last = position.line >= len(lines)
    line = lines[-1] if last else lines[position.line]
    if isinstance(line, str):
        return _from_client_units(lines, codec, position)
    pieces, counts = line.pieces, line.units
    if min(counts) < 0:  # a lone surrogate: pygls's to count, on this line alone
        found = codec.position_from_client_units(["".join(pieces)], types.Position(
            line=1 if last else 0, character=position.character))
        return ServerTextPosition(len(lines) - 1 if last else position.line, found.character)
    if last:  # pygls: the last line's units (a `\r\n` two)
        return ServerTextPosition(len(lines) - 1, sum(counts))
    crlf = pieces[-1].endswith("\r\n")
    ends = list(accumulate(counts))
    ends[-1] -= crlf  # pygls counts a `\r\n` as one unit
    length = ends[-1]
    character = length - 1 if position.character > length else position.character
    k = bisect_right(ends, character)  # the piece the position is in
    before = sum(map(len, pieces[:k]))
    if k == len(pieces):
        return ServerTextPosition(position.line, before - crlf)
    piece = pieces[k][:-2] + "\n" if crlf and k == len(pieces) - 1 else pieces[k]
    return ServerTextPosition(position.line, before + _within(piece, character - (ends[k - 1] if k else 0), codec))


def _within(text: str, character: int, codec) -> int:
    """The characters of `text` before its `character`-th unit (and one more where the unit is inside a
    character)."""
    encoded = _ENCODED.get(type(codec.impl))
    if text.isascii() or encoded is None:
        return character
    encoding, width = encoded
    head = text.encode(encoding)[:character * width].decode(encoding, "ignore")
    return len(head) + (len(head.encode(encoding)) < character * width)


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
