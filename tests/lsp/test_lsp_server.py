"""`plandsl lsp` driven as an editor drives it: pytest-lsp's client starts the real command and speaks LSP over
its stdio. One server for the module (started once: ~1 s of the module's time); each test opens its own file.
pytest-lsp's plugin is off (pyproject's addopts: its entry point imports lsprotocol into every pytest process,
~0.5 CPU-s each), so the fixture below starts the client itself, and lsprotocol loads only when a test runs."""
from __future__ import annotations

import asyncio
import importlib.util
import os
import sys
from pathlib import Path

import pytest
from support import lazy

pytestmark = [pytest.mark.xdist_group("lsp"),  # one worker starts the one server of the module
              pytest.mark.skipif(importlib.util.find_spec("pytest_lsp") is None,
                                 reason="pytest-lsp is not installed (the `test` extra has it)")]
types = lazy("lsprotocol.types")

ROOT = Path(__file__).resolve().parents[2]
# The model's factory module raises (and leaves a mark) if anything imports it: the server must not.
TRAP = ('from pathlib import Path\nPath(__file__).with_name("imported.txt").write_text("imported")\n'
        "raise SystemExit(3)\n")
PLAN = """\
import "clusters/dgx_a100"
import "models/gpt3"

param micro = 1
let memory_per_node = 8 x 80 GiB

plan p {
  model    = gpt3_6_7b
  cluster  = dgx_a10 x 2
  mesh     = [dp = 4, pp = 2, tp = 2]
  train    = { global_batch: 64, micro_batch: micro, precision: bf16 }
  data     = zero1 over dp
  tensor   = megatron over tp
  stages   = evenly over pp
  schedule = 1f1b
}
"""
OK_PLAN = PLAN.replace("dgx_a10 x", "dgx_a100 x") + "let unused_here = 1\n"


def at(text: str, needle: str, offset: int = 0) -> types.Position:
    """The position of `needle`'s first character (+ offset) in `text` (ASCII: code units are characters)."""
    index = text.index(needle) + offset
    line = text.count("\n", 0, index)
    return types.Position(line=line, character=index - (text.rfind("\n", 0, index) + 1))


if importlib.util.find_spec("pytest_lsp") is not None:
    import pytest_asyncio

    @pytest_asyncio.fixture(scope="module", loop_scope="module")
    async def client(folder):
        from pytest_lsp import ClientServerConfig
        # `folder` is on the server's import path: the trap model there would be imported if anything tried
        path = os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH", "")) if p)
        config = ClientServerConfig(server_command=[sys.executable, "-m", "plandsl.cli", "lsp", "--stdio"],
                                    server_env={**os.environ, "PYTHONPATH": path})
        lsp_client = await config.start()
        await lsp_client.initialize_session(types.InitializeParams(capabilities=types.ClientCapabilities()))
        yield lsp_client
        await lsp_client.shutdown_session()
        await lsp_client.stop()


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("lsp")


async def open_file(client, folder: Path, name: str, text: str) -> tuple[str, list[types.Diagnostic]]:
    """Open `name` with `text` in the client; its URI and the diagnostics the server published for it."""
    path = folder / name
    path.write_text(text)
    uri = path.as_uri()
    client.text_document_did_open(types.DidOpenTextDocumentParams(
        text_document=types.TextDocumentItem(uri=uri, language_id="plandsl", version=1, text=text)))
    return uri, await published(client, uri)


async def published(client, uri: str) -> list[types.Diagnostic]:
    await asyncio.wait_for(client.wait_for_notification(types.TEXT_DOCUMENT_PUBLISH_DIAGNOSTICS), 30)
    while uri not in client.diagnostics:
        await asyncio.wait_for(client.wait_for_notification(types.TEXT_DOCUMENT_PUBLISH_DIAGNOSTICS), 30)
    return client.diagnostics[uri]


@pytest.mark.asyncio(loop_scope="module")
async def test_diagnostics_as_you_type_with_codes_and_a_quick_fix(client, folder):
    uri, found = await open_file(client, folder, "typo.plan", PLAN)
    assert [(d.code, d.range.start.line, d.severity) for d in found] == [("E201", 8, types.DiagnosticSeverity.Error)]
    problem = found[0]
    assert problem.range == types.Range(start=at(PLAN, "dgx_a10 "), end=at(PLAN, "dgx_a10 ", 7))
    hover = await client.text_document_hover_async(types.HoverParams(
        text_document=types.TextDocumentIdentifier(uri=uri), position=at(PLAN, "dgx_a10 ", 2)))
    assert hover.contents.value.startswith("**E201: unknown name**\n\nA name that is not defined")
    assert "unknown name 'dgx_a10'" in problem.message and "dgx_a100" in problem.message
    explained = Path.from_uri(problem.code_description.href) if sys.version_info >= (3, 13) else \
        Path(problem.code_description.href.removeprefix("file://"))
    assert explained.read_text().startswith("`plandsl explain E201`") and "unknown name" in explained.read_text()

    actions = await client.text_document_code_action_async(types.CodeActionParams(
        text_document=types.TextDocumentIdentifier(uri=uri), range=problem.range,
        context=types.CodeActionContext(diagnostics=[problem])))
    assert len(actions) == 1 and actions[0].kind == types.CodeActionKind.QuickFix
    (edit,) = actions[0].edit.changes[uri]
    assert (edit.range, edit.new_text) == (problem.range, "dgx_a100")

    # the fix typed in: the error goes, and the unused `let` is a warning (W201)
    client.text_document_did_change(types.DidChangeTextDocumentParams(
        text_document=types.VersionedTextDocumentIdentifier(uri=uri, version=2),
        content_changes=[types.TextDocumentContentChangePartial(range=problem.range, text="dgx_a100")]))
    del client.diagnostics[uri]
    found = await published(client, uri)
    assert [(d.code, d.severity) for d in found] == [("W201", types.DiagnosticSeverity.Warning)]


@pytest.mark.asyncio(loop_scope="module")
async def test_hover_values_units_layers_devices_and_codes(client, folder):
    text = OK_PLAN + "# see E406\n"
    uri, _ = await open_file(client, folder, "hover.plan", text)

    async def hover(needle: str, offset: int = 1) -> str:
        found = await client.text_document_hover_async(types.HoverParams(
            text_document=types.TextDocumentIdentifier(uri=uri), position=at(text, needle, offset)))
        assert found is not None, needle
        return found.contents.value

    assert "8 x 80.0 GiB" in await hover("memory_per_node")  # with its unit
    assert "param **micro** = 1" in await hover("micro =")
    device = await hover("dgx_a100 x", 3)  # a node: its devices
    assert "8 x a100_80g" in device
    plan = await hover("plan p", 5)
    assert "model     gpt3_6_7b" in plan and "step time" in plan  # show's summary and estimate's figures
    assert "E406" in await hover("E406")
    assert "1F1B" in await hover("1f1b") or "PipeDream" in await hover("1f1b")


@pytest.mark.asyncio(loop_scope="module")
async def test_hover_on_a_layer_and_a_device(client, folder):
    text = OK_PLAN.replace("  stages   = evenly over pp\n",
                           "  stages { 0: embed, layers[0:16]\n 1: layers[16:32], norm, head }\n")
    uri, found = await open_file(client, folder, "layers.plan", text)
    assert not [d for d in found if d.severity == types.DiagnosticSeverity.Error], found
    layer = await client.text_document_hover_async(types.HoverParams(
        text_document=types.TextDocumentIdentifier(uri=uri), position=at(text, "embed", 1)))
    assert "embed" in layer.contents.value and "stage 0 on pipeline rank 0" in layer.contents.value
    assert "`embed.tok.weight` [51200, 4096]" in layer.contents.value  # its tensors, as torch names them
    found = await client.text_document_completion_async(types.CompletionParams(
        text_document=types.TextDocumentIdentifier(uri=uri), position=at(text, "layers[16:32]", 0)))
    assert {"embed", "layers", "norm", "head"} <= {item.label for item in found.items}  # the model's layers
    axis = await client.text_document_hover_async(types.HoverParams(
        text_document=types.TextDocumentIdentifier(uri=uri), position=at(text, "over tp", 5)))
    assert axis.contents.value == "mesh axis **tp** of size 2"
    device_text = "import \"clusters/dgx_a100\"\nlet d = a100_80g\n"
    uri, _ = await open_file(client, folder, "device.plan", device_text)
    device = await client.text_document_hover_async(types.HoverParams(
        text_document=types.TextDocumentIdentifier(uri=uri), position=at(device_text, "a100_80g", 2)))
    assert "memory 80.0 GiB" in device.contents.value and "312 TFLOP/s" in device.contents.value


@pytest.mark.asyncio(loop_scope="module")
async def test_completion_definition_and_formatting(client, folder):
    text = OK_PLAN
    uri, _ = await open_file(client, folder, "complete.plan", text)

    async def labels(position: types.Position, document: str | None = None) -> set[str]:
        found = await client.text_document_completion_async(types.CompletionParams(
            text_document=types.TextDocumentIdentifier(uri=document or uri), position=position))
        return {item.label for item in found.items}

    assert {"import", "plan", "device"} <= await labels(types.Position(line=len(text.splitlines()), character=0))
    assert {"data", "tensor", "schedule", "stages"} <= await labels(at(text, "  model", 2))  # a plan's attributes
    after_over = await labels(at(text, "over dp", 5))
    assert {"dp", "pp", "tp"} <= after_over and "zero1" not in after_over  # mesh axes, not data's kinds
    assert {"zbv", "interleaved_1f1b", "gpipe"} <= await labels(at(text, "1f1b"))  # built-in schedules
    assert {"precision", "micro_batch", "global_batch"} <= await labels(at(text, "micro_batch"))  # train's keys
    assert {"GiB", "TFLOP/s", "us"} <= await labels(at(text, "GiB"))  # units after a number
    gathered = OK_PLAN.replace("data     = zero1 over dp",
                               "data     = zero3 over dp with unit = module, gather = bf16").replace(
        "megatron over tp", "megatron over tp with sequence_parallel")
    gathered_uri, _ = await open_file(client, folder, "gathered.plan", gathered)
    options = await labels(at(gathered, "unit = module", 0), gathered_uri)
    assert {"unit", "prefetch", "prefetch_bucket", "gather"} <= options and "sequence_parallel" not in options
    assert {"block", "module"} <= await labels(at(gathered, "module", 0), gathered_uri)  # the unit's words
    assert {"bf16", "fp8"} <= await labels(at(gathered, "gather = bf16", len("gather = ")), gathered_uri)  # dtypes
    assert "sequence_parallel" in await labels(at(gathered, "sequence_parallel", 0), gathered_uri)  # tensor's
    dtypes = OK_PLAN.replace("precision: bf16 }", "precision: bf16, param_dtype: bf16 }")
    dtypes_uri, _ = await open_file(client, folder, "dtypes.plan", dtypes)
    kept = await labels(at(dtypes, "param_dtype: bf16", len("param_dtype: ")), dtypes_uri)
    assert {"fp32", "bf16", "fp16"} <= kept and "fp8" not in kept  # the kept dtypes, no FP8 weights
    options = OK_PLAN.replace("megatron over tp\n", "megatron over tp with sequence_parallel\n")
    options_uri, _ = await open_file(client, folder, "options.plan", options)
    assert {"sequence_parallel", "overlap"} <= await labels(at(options, "sequence_parallel"), options_uri)  # `with`'s
    piped = OK_PLAN.replace("evenly over pp\n", "evenly over pp with implementation = megatron\n").replace(
        "megatron over tp\n", "megatron over tp\n  context  = ring over dp with implementation = te\n")
    piped_uri, _ = await open_file(client, folder, "piped.plan", piped)
    whose = await labels(at(piped, "megatron\n", 0), piped_uri)  # whose pipeline, not whose ring
    assert {"torch", "megatron"} <= whose and "te" not in whose
    ring = await labels(at(piped, "te\n", 0), piped_uri)
    assert {"te", "torch"} <= ring and "megatron" not in ring
    stacked = OK_PLAN.replace("megatron over tp\n", "megatron over tp with sequence_parallel, implementation = megatron\n")
    stacked_uri, _ = await open_file(client, folder, "stacked.plan", stacked)
    stack = await labels(at(stacked, "implementation = megatron", len("implementation = ")), stacked_uri)
    assert {"torch", "megatron"} <= stack and "te" not in stack and "deepspeed" not in stack  # whose tensor parallelism
    counted = OK_PLAN.replace("evenly over pp\n", "evenly over pp with account = [embed, loss]\n")
    counted_uri, _ = await open_file(client, folder, "counted.plan", counted)
    assert "account" in await labels(at(counted, "account", 0), counted_uri)  # the stages clause's option
    assert {"embed", "loss"} <= await labels(at(counted, "embed, loss", 0), counted_uri)  # what it counts
    block = OK_PLAN.replace("  stages   = evenly over pp\n",
                            "  stages {\n    0..2: embed, layers.*, norm, head\n    implementation = megatron\n  }\n")
    block_uri, _ = await open_file(client, folder, "block.plan", block)
    assert "implementation" in await labels(at(block, "implementation", 0), block_uri)  # the block's attribute
    assert {"torch", "megatron"} <= await labels(at(block, "implementation = m", len("implementation = ")), block_uri)  # its values
    value = await labels(at(text, "gpt3_6_7b"))
    assert {"gpt3_175b", "dgx_a100", "micro", "memory_per_node", "gpt", "llama"} <= value
    assert not {"for", "layer", "rank", "import"} & value  # statement keywords have no place in a value

    target = await client.text_document_definition_async(types.DefinitionParams(
        text_document=types.TextDocumentIdentifier(uri=uri), position=at(text, "gpt3_6_7b", 2)))
    assert target.uri.endswith("stdlib_plans/models/gpt3.plan") and target.range.start.line == 4
    axis = await client.text_document_definition_async(types.DefinitionParams(
        text_document=types.TextDocumentIdentifier(uri=uri), position=at(text, "over dp", 5)))
    assert axis.uri == uri and axis.range.start == at(text, "dp = 4", 0)
    imported = await client.text_document_definition_async(types.DefinitionParams(
        text_document=types.TextDocumentIdentifier(uri=uri), position=at(text, "clusters/dgx_a100")))
    assert imported.uri.endswith("stdlib_plans/clusters/dgx_a100.plan")

    messy = "param   micro=1\nplan q {\nmodel=gpt(layers=2,hidden=8,heads=2,seq=4,vocab=16)\n}\n"
    uri, _ = await open_file(client, folder, "messy.plan", messy)
    edits = await client.text_document_formatting_async(types.DocumentFormattingParams(
        text_document=types.TextDocumentIdentifier(uri=uri),
        options=types.FormattingOptions(tab_size=2, insert_spaces=True)))
    from plandsl import api
    assert len(edits) == 1 and edits[0].new_text == api.format_text(messy)
    assert edits[0].range.end.line == len(messy.splitlines())


@pytest.mark.asyncio(loop_scope="module")
async def test_a_model_written_in_torch_is_never_imported(client, folder):
    (folder / "trap_model.py").write_text(TRAP)
    text = ('model m = factory("trap_model:build")\n'
            "plan t {\n  model = m\n  cluster = localhost\n  mesh = [dp = 1]\n  train = { global_batch: 1 }\n}\n"
            'import "clusters/local"\n')
    _, found = await open_file(client, folder, "trap.plan", text)
    assert "E215" in {d.code for d in found}  # no layer table: `plandsl inspect` makes one, the server does not
    assert not (folder / "imported.txt").exists()


@pytest.mark.asyncio(loop_scope="module")
async def test_ranges_count_utf16_code_units(client, folder):
    text = 'param s = "😀é" )\n'  # the client counts 😀 as two UTF-16 code units, Python as one character
    _, found = await open_file(client, folder, "utf16.plan", text)
    assert [(d.code, d.range.start) for d in found] == [("E101", types.Position(line=0, character=text.index(")") + 1))]


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads the server's mapped files from /proc (Linux)")
@pytest.mark.asyncio(loop_scope="module")
async def test_the_server_loaded_no_torch_and_no_numpy(client):
    """After every request above (checks, estimates, hovers, completions, formatting), the server process has
    mapped neither torch's nor numpy's compiled libraries: it imported neither (the checker's own rule)."""
    maps = Path(f"/proc/{client._server.pid}/maps").read_text()
    assert "/torch/" not in maps and "/numpy/" not in maps
