"""`plandsl lsp` fed malformed JSON-RPC over its stdin: it reads within bounds, logs one line per message it cannot
read (no traceback), and goes on answering. The raw bytes go through a real process (no LSP client library: a
client would not send them)."""
from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from plandsl.lsp.server import MAX_HEADER_BYTES, MAX_MESSAGE_BYTES, BoundedStdin, OneLineErrors

ROOT = Path(__file__).resolve().parents[2]


def frame(message: object = None, body: bytes | None = None, length: int | None = None) -> bytes:
    body = json.dumps(message).encode() if body is None else body
    return f"Content-Length: {len(body) if length is None else length}\r\n\r\n".encode() + body


def request(method: str, params: object, id: int) -> dict:
    return {"jsonrpc": "2.0", "id": id, "method": method, "params": params}


def test_a_message_past_the_limit_is_skipped_in_pieces_and_the_next_is_read():
    big = b" " * (MAX_MESSAGE_BYTES + 1)
    stream = io.BytesIO(frame(body=big) + frame({"jsonrpc": "2.0", "method": "exit"}))
    reader = BoundedStdin(stream)
    assert reader.readline().startswith(b"Content-Length:") and reader.readline() == b"\r\n"
    skipped = reader.read(len(big))
    assert json.loads(skipped)["method"] == "$/cancelRequest"  # a notification that does nothing
    assert reader.readline().startswith(b"Content-Length:")
    assert BoundedStdin(io.BytesIO(b"x" * (3 * MAX_HEADER_BYTES))).readline() == b"x" * MAX_HEADER_BYTES
    assert BoundedStdin(io.BytesIO(frame(length=10**12))).read(10**12) == b""  # the stream ends inside it


def test_a_logged_traceback_is_one_line_unless_debugging(monkeypatch):
    monkeypatch.delenv("PLANDSL_DEBUG", raising=False)
    try:
        json.loads("{not json")
    except ValueError:
        record = logging.LogRecord("pygls.io_", logging.ERROR, "x", 1, "Unable to handle message", (), sys.exc_info())
    OneLineErrors().filter(record)
    assert record.exc_info is None and record.getMessage().startswith("Unable to handle message: JSONDecodeError:")
    formatted = logging.LogRecord("pygls", logging.ERROR, "x", 1, "Unable to deserialize message\n%s", (
        "Traceback (most recent call last):\n  File ...",), None)
    OneLineErrors().filter(formatted)
    assert formatted.getMessage() == "Unable to deserialize message"


def test_the_server_survives_malformed_json_rpc_and_answers_after_it(tmp_path):
    plan = tmp_path / "p.plan"
    plan.write_text((ROOT / "stdlib_plans" / "local" / "tiny.plan").read_text())
    uri = plan.as_uri()
    position = {"line": 0, "character": 0}
    stream = b"".join([
        frame(request("initialize", {"capabilities": {}, "rootUri": None, "processId": None}, 1)),
        frame({"jsonrpc": "2.0", "method": "initialized", "params": {}}),
        frame(body=b"{not json"),
        frame([1, 2, 3]),
        frame(request("textDocument/hover", None, 2)),
        frame(request("textDocument/hover", {"textDocument": {"uri": uri}, "position": {"line": -1, "character": 0}},
                      3)),
        frame(body=b" " * (MAX_MESSAGE_BYTES + 1)),  # 16 MiB: read past in pieces
        b"Content-Length: x" + b"y" * (2 * MAX_HEADER_BYTES) + b"\r\n\r\n",
        frame({"jsonrpc": "2.0", "method": "textDocument/didOpen", "params": {"textDocument": {
            "uri": uri, "languageId": "plandsl", "version": 1, "text": plan.read_text()}}}),
        frame(request("textDocument/hover", {"textDocument": {"uri": uri}, "position": position}, 4)),
        frame(request("shutdown", None, 5)),
        frame({"jsonrpc": "2.0", "method": "exit"}),
        frame(body=b"{}", length=10**12),  # after exit: never read
    ])
    result = subprocess.run([sys.executable, "-m", "plandsl.cli", "lsp", "--stdio"], input=stream,
                            capture_output=True, timeout=60, env={**os.environ, "PLANDSL_DEBUG": ""})
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    stderr = result.stderr.decode()
    assert "Traceback" not in stderr and "MemoryError" not in stderr, stderr[-2000:]
    assert f"skipped a message of {MAX_MESSAGE_BYTES + 1} bytes" in stderr
    answered = {json.loads(part.split(b"\r\n\r\n", 1)[1]).get("id") for part in result.stdout.split(b"Content-Length")
                if b"\r\n\r\n" in part}
    assert {1, 4, 5} <= answered, result.stdout[-2000:]


@pytest.mark.parametrize("length", [10**12, 2**63])
def test_a_header_claiming_a_huge_body_allocates_nothing(length):
    """Content-Length: 10^12 then the end of input: pygls read it at once (MemoryError, E108 on stderr, exit 1)."""
    stream = frame(request("initialize", {"capabilities": {}, "rootUri": None, "processId": None}, 1)) + \
        f"Content-Length: {length}\r\n\r\n{{}}".encode()
    result = subprocess.run(["bash", "-c", f"ulimit -v 4000000; exec {sys.executable} -m plandsl.cli lsp --stdio"],
                            input=stream, capture_output=True, timeout=60)
    assert result.returncode == 0 and b"MemoryError" not in result.stderr and b"E108" not in result.stderr, \
        result.stderr.decode()[-2000:]


def _messages(stdout: bytes) -> list[dict]:
    return [json.loads(part.split(b"\r\n\r\n", 1)[1]) for part in stdout.split(b"Content-Length") if b"\r\n\r\n" in part]


def test_a_request_with_params_it_cannot_read_is_answered_invalid_params(tmp_path):
    """pygls logged such a request and answered nothing: a client waited for ids 2-4 for ever (and then showed
    "Error in server: Invalid Params" beside the answer)."""
    uri = (tmp_path / "p.plan").as_uri()
    stream = b"".join([
        frame(request("initialize", {"capabilities": {}, "rootUri": None, "processId": None}, 1)),
        frame({"jsonrpc": "2.0", "method": "initialized", "params": {}}),
        frame(request("textDocument/hover", None, 2)),
        frame(request("textDocument/hover", {"textDocument": {"uri": uri}, "position": {"line": -1, "character": 0}},
                      3)),
        frame(request("textDocument/completion", {"textDocument": {"uri": uri}, "position": {"line": 2**31,
                                                                                              "character": 0}}, "a")),
        frame(request("shutdown", None, 5)),
        frame({"jsonrpc": "2.0", "method": "exit"}),
    ])
    result = subprocess.run([sys.executable, "-m", "plandsl.cli", "lsp", "--stdio"], input=stream,
                            capture_output=True, timeout=60, env={**os.environ, "PLANDSL_DEBUG": ""})
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    errors = {m["id"]: m["error"]["code"] for m in _messages(result.stdout) if "error" in m}
    assert errors == {2: -32602, 3: -32602, "a": -32602}, result.stdout[-2000:]
    assert 5 in {m.get("id") for m in _messages(result.stdout)}
    # answered, so no "Error in server: Invalid Params" pop-up beside the answer (the review)
    assert [m for m in _messages(result.stdout) if m.get("method") == "window/showMessage"] == []


def test_a_change_to_a_document_never_opened_is_left_out_not_a_server_error(tmp_path):
    """pygls's workspace raised KeyError, which the client showed as "Error in server: KeyError: 'file:///...'"."""
    plan = tmp_path / "p.plan"
    plan.write_text((ROOT / "stdlib_plans" / "local" / "tiny.plan").read_text())
    change = {"jsonrpc": "2.0", "method": "textDocument/didChange", "params": {
        "textDocument": {"uri": plan.as_uri(), "version": 2}, "contentChanges": [{"text": "plan x {"}]}}
    stream = b"".join([
        frame(request("initialize", {"capabilities": {}, "rootUri": None, "processId": None}, 1)),
        frame({"jsonrpc": "2.0", "method": "initialized", "params": {}}),
        frame(change),
        frame({"jsonrpc": "2.0", "method": "textDocument/didOpen", "params": {"textDocument": {
            "uri": plan.as_uri(), "languageId": "plandsl", "version": 1, "text": plan.read_text()}}}),
        frame({"jsonrpc": "2.0", "method": "textDocument/didClose", "params": {"textDocument": {"uri": plan.as_uri()}}}),
        frame(change),  # closed: the same
        frame(request("shutdown", None, 2)),
        frame({"jsonrpc": "2.0", "method": "exit"}),
    ])
    result = subprocess.run([sys.executable, "-m", "plandsl.cli", "lsp", "--stdio"], input=stream,
                            capture_output=True, timeout=60, env={**os.environ, "PLANDSL_DEBUG": ""})
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    shown = [m for m in _messages(result.stdout) if m.get("method") == "window/showMessage"]
    assert shown == [], shown
    assert result.stderr.decode().count("which is not open, left out") == 2
    assert 2 in {m.get("id") for m in _messages(result.stdout)}


def test_a_document_opened_before_initialize_is_dropped_not_a_server_error(tmp_path):
    """didOpen before `initialize` raised RuntimeError (no workspace yet), which a client showed as "Error in
    server: RuntimeError: The workspace is not available"; LSP drops such a notification, and answers a request
    with ServerNotInitialized (-32002)."""
    plan = tmp_path / "p.plan"
    plan.write_text((ROOT / "stdlib_plans" / "local" / "tiny.plan").read_text())
    opened = frame({"jsonrpc": "2.0", "method": "textDocument/didOpen", "params": {"textDocument": {
        "uri": plan.as_uri(), "languageId": "plandsl", "version": 1, "text": plan.read_text()}}})
    stream = b"".join([
        opened,
        frame({"jsonrpc": "2.0", "method": "textDocument/didChange", "params": {
            "textDocument": {"uri": plan.as_uri(), "version": 2}, "contentChanges": [{"text": "plan x {"}]}}),
        frame({"jsonrpc": "2.0", "method": "textDocument/didClose", "params": {"textDocument": {"uri": plan.as_uri()}}}),
        # notifications pygls's own handlers failed on too, and a request (answered `null` before): -32002
        frame({"jsonrpc": "2.0", "method": "notebookDocument/didOpen", "params": {"notebookDocument": {
            "uri": plan.as_uri() + ".ipynb", "notebookType": "jupyter", "version": 1, "cells": []},
            "cellTextDocuments": []}}),
        frame({"jsonrpc": "2.0", "method": "workspace/didChangeWorkspaceFolders", "params": {
            "event": {"added": [], "removed": []}}}),
        frame(request("textDocument/hover", {"textDocument": {"uri": plan.as_uri()},
                                             "position": {"line": 0, "character": 0}}, 7)),
        frame(request("initialize", {"capabilities": {}, "rootUri": None, "processId": None}, 1)),
        frame({"jsonrpc": "2.0", "method": "initialized", "params": {}}),
        opened,  # after initialize: read and checked
        frame(request("shutdown", None, 2)),
        frame({"jsonrpc": "2.0", "method": "exit"}),
    ])
    result = subprocess.run([sys.executable, "-m", "plandsl.cli", "lsp", "--stdio"], input=stream,
                            capture_output=True, timeout=60, env={**os.environ, "PLANDSL_DEBUG": ""})
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    messages = _messages(result.stdout)
    assert [m for m in messages if m.get("method") == "window/showMessage"] == []
    assert result.stderr.decode().count("before initialize, dropped") == 5
    assert [m["error"]["code"] for m in messages if m.get("id") == 7] == [-32002]
    assert [m["params"]["uri"] for m in messages if m.get("method") == "textDocument/publishDiagnostics"] == \
        [plan.as_uri()]


def test_a_request_after_shutdown_is_answered_invalid_request():
    """pygls logged it ("No more requests!") and answered nothing: a client waited for id 3 for ever."""
    stream = b"".join([
        frame(request("initialize", {"capabilities": {}, "rootUri": None, "processId": None}, 1)),
        frame({"jsonrpc": "2.0", "method": "initialized", "params": {}}),
        frame(request("shutdown", None, 2)),
        frame(request("textDocument/hover", {"textDocument": {"uri": "file:///x.plan"},
                                             "position": {"line": 0, "character": 0}}, 3)),
        frame({"jsonrpc": "2.0", "method": "exit"}),
    ])
    result = subprocess.run([sys.executable, "-m", "plandsl.cli", "lsp", "--stdio"], input=stream,
                            capture_output=True, timeout=60, env={**os.environ, "PLANDSL_DEBUG": ""})
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    errors = {m["id"]: m["error"]["code"] for m in _messages(result.stdout) if "error" in m}
    assert errors == {3: -32600}, result.stdout


def test_the_changes_of_one_message_are_applied_in_one_pass():
    """pygls split and rewrote the whole text for each change of a didChange: 2,000 changes to a document of 100,000
    lines took 26 s of CPU (the changes a 16 MB message holds, hours); now 0.02 s, the text as pygls would make it."""
    from lsprotocol import types
    from pygls.workspace import Workspace

    from plandsl.lsp.server import PlanServer
    from support import bounded
    uri, server = "file:///x.plan", PlanServer()
    server.protocol._workspace = Workspace(None, sync_kind=types.TextDocumentSyncKind.Incremental)
    server.workspace.put_text_document(types.TextDocumentItem(uri=uri, language_id="plan", version=1,
                                                              text="let a = 1\n" * 100_000))
    changes = [types.TextDocumentContentChangePartial(range=types.Range(start=types.Position(line=i, character=4),
                                                                        end=types.Position(line=i, character=5)),
                                                      text="b") for i in range(2_000)]
    params = types.DidChangeTextDocumentParams(text_document=types.VersionedTextDocumentIdentifier(uri=uri, version=2),
                                               content_changes=changes)
    with bounded(1.0, "didChange"):
        list(server.protocol.lsp_text_document__did_change(params))
    document = server.workspace.get_text_document(uri)
    assert document.version == 2 and document.source == "let b = 1\n" * 2_000 + "let a = 1\n" * 98_000


@pytest.mark.parametrize("long_line, piece", [(None, None), (4, 1), (7, 3)],
                         ids=["as served", "every line in pieces of 1", "lines past 7 in pieces of 3"])
def test_changes_applied_in_one_pass_make_the_text_pygls_makes(monkeypatch, long_line, piece):
    """Random changes (line breaks of each kind, a \\r meeting a \\n, characters outside the BMP, a lone surrogate,
    ranges past the end or inverted, whole-text changes) to random texts, in each encoding of positions, against
    pygls's own TextDocument; the long lines kept in pieces (`server._Long`) as the server keeps them past 8,192
    characters, and with every line of more than 4 (7) characters in pieces of 1 (3)."""
    import copy
    import random

    from lsprotocol import types
    from pygls.workspace import Workspace

    from plandsl.lsp import server
    from plandsl.lsp.server import applied
    if long_line is not None:
        monkeypatch.setattr(server, "LONG_LINE", long_line)
        monkeypatch.setattr(server, "PIECE", piece)
        monkeypatch.setattr(server, "PIECE_ROOTS", 0)
    rng = random.Random(7)
    pieces = ["a", "b", "\n", "\r", "\r\n", "é", "\U0001F600", "x\ny", "\u2028", "abcdefgh", "\ud800"]

    def text(most: int) -> str:
        return "".join(rng.choice(pieces) for _ in range(rng.randint(0, most)))

    def position() -> types.Position:
        return types.Position(line=rng.randint(0, 6), character=rng.randint(0, 20))

    for encoding in (types.PositionEncodingKind.Utf16, types.PositionEncodingKind.Utf8,
                     types.PositionEncodingKind.Utf32):
        for _ in range(300):
            original = text(30)
            changes = [types.TextDocumentContentChangeWholeDocument(text=text(20)) if rng.random() < 0.05 else
                       types.TextDocumentContentChangePartial(range=types.Range(start=position(), end=position()),
                                                              text=text(5)) for _ in range(rng.randint(1, 6))]
            ours = copy.deepcopy(changes)  # pygls moves a position past the end of its line to the line's last
            workspace = Workspace(None, sync_kind=types.TextDocumentSyncKind.Incremental, position_encoding=encoding)
            workspace.put_text_document(types.TextDocumentItem(uri="file:///x", language_id="plan", version=1,
                                                               text=original))
            for change in changes:
                workspace.update_text_document(types.VersionedTextDocumentIdentifier(uri="file:///x", version=2),
                                               change)
            document = workspace.get_text_document("file:///x")
            assert applied(original, ours, document.position_codec) == document.source, (original, ours)


def test_the_diagnostics_of_one_long_line_are_published_in_time_their_count_sets():
    """A plan whose `train = { ... }` holds 5,000 unknown keys on one line of 55 kB: for each of its 5,000 diagnostics
    (the server publishes them all) pygls counted the code units up to its column one character at a time, 5,000 x
    27 kB (35 s of CPU, 4x per doubling of the keys); now the line's characters of several units are found once and
    each position is a look-up: 1-2 s, nearly all of it the checking. A character outside the BMP before the keys
    makes the line count in UTF-16 units."""
    from lsprotocol import types
    from pygls.workspace import Workspace

    from plandsl.lsp.server import PlanServer
    from support import VALID_PLAN, bounded
    keys = ", ".join(f"zz{i}: 1" for i in range(5_000))
    text = VALID_PLAN.replace("train   = {", "train   = { \"\U0001F600\": 1, " + keys + ",", 1)
    uri, server = "file:///long.plan", PlanServer()
    server.protocol._workspace = Workspace(None, sync_kind=types.TextDocumentSyncKind.Incremental)
    server.workspace.put_text_document(types.TextDocumentItem(uri=uri, language_id="plan", version=1, text=text))
    published = []
    server.text_document_publish_diagnostics = published.append
    with bounded(4.0, "publishing 5,000 diagnostics of one line"):
        server.analyse(uri)
    found = [d for d in published[0].diagnostics if d.message.startswith("train has no key 'zz")]
    assert len(found) == 5_000
    line = text.splitlines()[found[-1].range.start.line]
    column = line.index("zz4999:")
    assert found[-1].range.start == types.Position(line=found[-1].range.start.line, character=column + 1)  # 2 units
    assert found[-1].range.end.character == column + 1 + len("zz4999")


def test_the_changes_of_one_long_line_are_placed_without_counting_the_line_each_time():
    """1,000 changes of one didChange to a line of 100,000 characters (a character outside the BMP at its start, so
    that UTF-16 units are not characters): pygls counted the line's code units one character at a time in Python, twice
    per position, 61 s of CPU (4x per doubling); now the codecs count them in C, 0.35 s, and the line is kept in
    pieces (see the next test). The text is the one pygls makes."""
    from lsprotocol import types
    from pygls.workspace import Workspace

    from plandsl.lsp.server import PlanServer, applied
    from support import bounded
    uri, server = "file:///x.plan", PlanServer()
    server.protocol._workspace = Workspace(None, sync_kind=types.TextDocumentSyncKind.Incremental)
    original = "\U0001F600" + "a" * 99_999
    server.workspace.put_text_document(types.TextDocumentItem(uri=uri, language_id="plan", version=1, text=original))

    def changes():
        return [types.TextDocumentContentChangePartial(
            range=types.Range(start=types.Position(line=0, character=100_000 - i),
                              end=types.Position(line=0, character=100_001 - i)), text="b") for i in range(1_000)]
    params = types.DidChangeTextDocumentParams(text_document=types.VersionedTextDocumentIdentifier(uri=uri, version=2),
                                               content_changes=changes())
    with bounded(3.0, "didChange of 1,000 changes to one line"):
        list(server.protocol.lsp_text_document__did_change(params))
    document = server.workspace.get_text_document(uri)
    assert document.source == "\U0001F600" + "a" * 98_999 + "b" * 1_000
    few = changes()[:20]  # pygls's own TextDocument, change by change, where it takes a moment
    workspace = Workspace(None, sync_kind=types.TextDocumentSyncKind.Incremental)
    workspace.put_text_document(types.TextDocumentItem(uri="file:///y", language_id="plan", version=1, text=original))
    for change in few:
        workspace.update_text_document(types.VersionedTextDocumentIdentifier(uri="file:///y", version=2), change)
    assert applied(original, changes()[:20], document.position_codec) == workspace.get_text_document("file:///y").source


def test_changes_to_a_longer_line_cost_each_little_more():
    """1,000 changes of one didChange to a line of 100,000 characters and to one of 400,000 (a character outside the
    BMP at its start): each change copied the line it spliced and counted its units (in C), so the longer line's
    changes cost 4.8-5.3x the shorter's (the changes a 16 MB message holds, to a line of 16 MB: hours); now a line
    past 8,192 characters is kept in pieces of ~8 x the square root of the text's size, and a change copies one piece
    and reads the line's list of pieces: 1.7-2.1x (a change's cost grows as the square root of the line)."""
    from lsprotocol import types
    from pygls.workspace import Workspace

    from plandsl.lsp.server import applied
    from support import cpu_ratio
    workspace = Workspace(None, sync_kind=types.TextDocumentSyncKind.Incremental)
    workspace.put_text_document(types.TextDocumentItem(uri="file:///x", language_id="plan", version=1, text=""))
    codec = workspace.get_text_document("file:///x").position_codec

    def changing(length: int):
        original = "\U0001F600" + "a" * (length - 1)
        changes = [types.TextDocumentContentChangePartial(
            range=types.Range(start=types.Position(line=0, character=length - i),
                              end=types.Position(line=0, character=length + 1 - i)), text="b") for i in range(1_000)]
        assert applied(original, changes, codec) == "\U0001F600" + "a" * (length - 1_001) + "b" * 1_000
        return lambda: applied(original, changes, codec)
    assert cpu_ratio(changing(400_000), changing(100_000)) < 3.2


@pytest.mark.parametrize("braces", ["}" * 120_000, '"}" ' * 60_000], ids=["one line", "in strings"])
def test_a_completion_after_many_braces_reads_the_text_once(braces):
    """Completing after 120,000 closing braces on one line (or 60,000 in strings) below one `{`: each brace's line
    was sliced and split to see whether a comment or a string held it (8.4 s and 46.6 s of CPU here, 4x per
    doubling), and each look-up of the other kind of brace read back to the `{` (in C: 0.07 s at 40,000 lines of `}`);
    now each line is read once, and each kind of brace looked for once per stretch of text: 0.03-0.1 s."""
    from plandsl.lsp.complete import completions
    from plandsl.lsp.document import Snapshot
    from support import bounded
    text = "plan p {\n  train = { " + braces + "\n  "
    snapshot = Snapshot("file:///x.plan", "/nonexistent/x.plan", text)
    with bounded(1.0, "completion"):
        items = completions(snapshot, len(text))
    assert items is not None
