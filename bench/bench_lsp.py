"""Benchmark: how long `plandsl lsp` takes to answer, as an editor sees it (a real client over stdio).

    python bench/bench_lsp.py     # prints a Markdown table for docs/benchmarks.md

Target (issue 21): every answer within 100 ms on a 50-line plan after start-up. The server is started
with `python -m plandsl.cli lsp`; start-up is the time to the `initialize` answer. Each request is
timed from the client's send to its answer, each edit from `didChange` to the diagnostics it publishes
(the whole check of the new text); the hover on the plan after an edit is a cold one (it computes
`plandsl show`'s summary and the estimate of the new version). Median and worst of REPEAT rounds.
"""
from __future__ import annotations

import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from lsprotocol import types
from pygls.lsp.client import LanguageClient

REPEAT = 20
PLAN = """\
# A 50-line plan: devices, a node, a cluster, a model of its own, parameters and a plan with explicit stages.
import "models/llama3"

param gpus = 16
param micro = 1
let per_node = 8
let step_budget = 2 s  # what a step may take

# NVIDIA H100 SXM (public datasheet figures)

device h100 {
  memory     = 80 GiB
  bandwidth  = 3350 GB/s
  peak       = { fp32: 67 TFLOP/s, bf16: 989 TFLOP/s, fp16: 989 TFLOP/s }
  efficiency = { matmul: 0.6, kernel_latency: 50 us }
  reserve    = 4 GiB
}

node hgx {
  devices = per_node x h100
  link    = { bandwidth: 450 GB/s, latency: 2 us }
  nic     = { bandwidth: 400 GB/s, latency: 5 us }
}

cluster pod {
  nodes  = hgx x (gpus // per_node)
  fabric = { bandwidth: 400 GB/s, latency: 5 us }
}

model small = llama(layers=16, hidden=2048, heads=16, kv_heads=8, seq=4096, vocab=128256)

plan llama_pod {
  model    = small
  cluster  = pod
  mesh     = [dp = 2, pp = 2, tp = 4]
  train    = {
    global_batch: 64,
    micro_batch: micro,
    precision: bf16,
    recompute: selective,
    optimizer: adam,
  }
  data     = zero1 over dp
  tensor   = megatron over tp with sequence_parallel
  stages {
    0: embed, layers[0:8]
    1: layers[8:16], norm, head
  }
  schedule = 1f1b
}
"""


def at(text: str, needle: str, offset: int = 1) -> types.Position:
    index = text.index(needle) + offset
    return types.Position(line=text.count("\n", 0, index), character=index - (text.rfind("\n", 0, index) + 1))


async def main() -> None:
    folder = Path(tempfile.mkdtemp())
    path = folder / "bench.plan"
    path.write_text(PLAN)
    uri = path.as_uri()
    assert len(PLAN.splitlines()) == 50
    client = LanguageClient("bench", "0")
    published: asyncio.Queue = asyncio.Queue()

    @client.feature(types.TEXT_DOCUMENT_PUBLISH_DIAGNOSTICS)
    def on_diagnostics(params):
        published.put_nowait((time.perf_counter(), params))

    start = time.perf_counter()
    await client.start_io(sys.executable, "-m", "plandsl.cli", "lsp", env={**os.environ})
    await client.initialize_async(types.InitializeParams(capabilities=types.ClientCapabilities()))
    startup = time.perf_counter() - start
    client.initialized(types.InitializedParams())

    sent = time.perf_counter()
    client.text_document_did_open(types.DidOpenTextDocumentParams(
        text_document=types.TextDocumentItem(uri=uri, language_id="plandsl", version=1, text=PLAN)))
    when, params = await published.get()
    first_open = when - sent
    assert [d.code for d in params.diagnostics] == ["W201"], params.diagnostics  # step_budget: unused
    document = types.TextDocumentIdentifier(uri=uri)
    times: dict[str, list[float]] = {}

    async def timed(name: str, request):
        start = time.perf_counter()
        result = await request
        times.setdefault(name, []).append(time.perf_counter() - start)
        return result

    for version in range(2, REPEAT + 2):
        sent = time.perf_counter()  # an edit: a new global batch each time (no cache holds the new text)
        text = PLAN.replace("global_batch: 64", f"global_batch: {60 + 2 * version}")
        client.text_document_did_change(types.DidChangeTextDocumentParams(
            text_document=types.VersionedTextDocumentIdentifier(uri=uri, version=version),
            content_changes=[types.TextDocumentContentChangeWholeDocument(text=text)]))
        when, _ = await published.get()
        times.setdefault("edit -> diagnostics", []).append(when - sent)
        await timed("hover: the plan (show + estimate, cold)", client.text_document_hover_async(
            types.HoverParams(text_document=document, position=at(text, "plan llama_pod", 6))))
        await timed("hover: a device (figures, memory estimate)", client.text_document_hover_async(
            types.HoverParams(text_document=document, position=at(text, "x h100", 3))))
        await timed("hover: a layer (parameters, stage)", client.text_document_hover_async(
            types.HoverParams(text_document=document, position=at(text, "embed"))))
        await timed("hover: a let with a unit", client.text_document_hover_async(
            types.HoverParams(text_document=document, position=at(text, "step_budget"))))
        await timed("completion: names in scope", client.text_document_completion_async(
            types.CompletionParams(text_document=document, position=at(text, "model    = small", 11))))
        await timed("completion: axes after `over`", client.text_document_completion_async(
            types.CompletionParams(text_document=document, position=at(text, "over dp", 5))))
        await timed("definition: across an import", client.text_document_definition_async(
            types.DefinitionParams(text_document=document, position=at(text, "llama(", 0))))
        await timed("formatting", client.text_document_formatting_async(types.DocumentFormattingParams(
            text_document=document, options=types.FormattingOptions(tab_size=2, insert_spaces=True))))
        await timed("code actions", client.text_document_code_action_async(types.CodeActionParams(
            text_document=document, range=types.Range(start=at(text, "model", 0), end=at(text, "model", 5)),
            context=types.CodeActionContext(diagnostics=[]))))
    await client.shutdown_async(None)
    client.exit(None)
    await client.stop()

    print(f"start-up (spawn -> initialize answered): {startup * 1000:.0f} ms; first didOpen -> diagnostics: "
          f"{first_open * 1000:.0f} ms\n")
    print("| answer (50-line plan, after start-up) | median (ms) | worst (ms) |")
    print("|---|---|---|")
    for name, values in times.items():
        print(f"| {name} | {statistics.median(values) * 1000:.1f} | {max(values) * 1000:.1f} |")
    print(f"\n{REPEAT} rounds; machine: {os.cpu_count()} cores, Python {sys.version.split()[0]}")


if __name__ == "__main__":
    asyncio.run(main())
