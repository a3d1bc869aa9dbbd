"""What every diagnostic code means, a small plan that triggers it, and how to fix it.

One `Entry` per code of `plandsl.diagnostics.codes.CODES`, written for the person reading the error:
why the rule exists on a real cluster, not only what the checker compares. `explain(code)`
is the text `plandsl explain CODE` prints; docs/errors.md is generated from these entries
by tests/make_errors_doc.py, and tests/unit/test_diagnostics.py runs every example (it
must produce its code) and every fix (it must not).

An example is one file (`file`, `example.plan` unless said otherwise), self-contained
apart from standard-library imports. The fix is a sentence and a list of `(old, new)`
edits that turn the example into a plan without the problem; `fixed` applies them:

    _entry("E501", "why the rule exists", "<example plan>", "what to do, in a sentence",
           ("global_batch: 30", "global_batch: 32"))        # (old, new): each old occurs once

Every entry needs at least one edit (tests/unit/test_diagnostics.py fails, naming the code,
when one has none), and the fixed example must check clean. A diagnostic whose hint is
computed carries its own edits (`Diagnostic.edits`); tests/unit/test_hints.py applies those
to the example too.
"""
from __future__ import annotations

import textwrap
from dataclasses import dataclass

from plandsl.diagnostics import did_you_mean
from plandsl.diagnostics.codes import CODES


@dataclass(frozen=True)
class Entry:
    code: str
    title: str
    explanation: str
    example: str                               # the text of `file`
    fix: str                                   # what to do, in a sentence
    edits: tuple[tuple[str, str], ...] = ()    # (old, new) replacements: example -> fixed
    file: str = "example.plan"
    encoding: str = "utf-8"                    # how the example is saved (E105: latin-1)
    fixed_encoding: str = "utf-8"
    on_cuda: bool = False                      # E7xx: refused on a machine with CUDA (the example's rendering)
    folders: tuple[str, ...] = ()              # folders next to the example (E107: one named like a plan)
    command: tuple[str, ...] = ()              # E8xx: the command that reports it (`generate --from`, `shrink`)
    internal: bool = False                     # E108: no plan triggers it; the example's check has a stage raise

    @property
    def fixed(self) -> str:
        """The example with the fix applied (each `old` occurs exactly once in it)."""
        text = self.example
        for old, new in self.edits:
            text = text.replace(old, new, 1)
        return text

    @property
    def stage(self) -> str:
        return "W" if self.code.startswith("W") else self.code[:2]


def _text(block: str) -> str:
    return textwrap.dedent(block).strip("\n") + "\n"


def _para(block: str) -> str:
    return " ".join(textwrap.dedent(block).split())


_ENTRIES: list[Entry] = []


def _entry(code: str, explanation: str, example: str, fix: str, *edits: tuple[str, str], **options) -> None:
    _ENTRIES.append(Entry(code, CODES[code], _para(explanation), _text(example), _para(fix), tuple(edits), **options))


# The plan most examples start from: 8 A100s, 2-way data, pipeline and tensor parallel.
_GPT = "gpt(layers=4, hidden=256, heads=8, seq=128, vocab=1024)"
_DEEP = "(" * 65 + "16" + ")" * 65  # with the plan's and train's braces, well past the 64 allowed


# ---- E1xx: syntax ------------------------------------------------------------------------
_entry("E101", """
    The parser met a token that cannot continue the statement it is reading. Usually a
    missing comma or operator, or a word in the wrong place; the hint lists what the
    grammar would have accepted at that point. Nothing past a syntax error is checked,
    because the shape of the rest of the file is unknown.
    """, f"""
    import "clusters/dgx_a100"
    plan p {{
      model   = {_GPT}
      cluster = dgx_a100 x 1
      mesh:     [dp = 2, pp = 2, tp = 2]
      train   = {{ global_batch: 16, micro_batch: 1 }}
    }}
    """, "Attributes are set with `=`; `:` is for keys inside `{ }`.", ("mesh:    ", "mesh    ="))

_entry("E102", """
    The file ended while a statement, bracket or block was still open: typically a
    plan body whose closing `}` was lost while editing. The error points at the end of
    the file; the opening bracket is usually some lines above it.
    """, f"""
    import "clusters/dgx_a100"
    plan p {{
      model   = {_GPT}
      cluster = dgx_a100 x 1
      mesh    = [dp = 2, pp = 2, tp = 2]
      train   = {{ global_batch: 16, micro_batch: 1 }}
    """, "Close the plan body with `}`.", ("micro_batch: 1 }\n", "micro_batch: 1 }\n}\n"))

_entry("E103", """
    A string (an import path, a layer name) was opened with `\"` and not closed on the
    same line. Strings cannot span lines, so the rest of the line would be swallowed.
    """, f"""
    import "clusters/dgx_a100
    plan p {{
      model   = {_GPT}
      cluster = dgx_a100 x 1
      mesh    = [dp = 2, pp = 2, tp = 2]
      train   = {{ global_batch: 16, micro_batch: 1 }}
    }}
    """, "Close the string.", ('dgx_a100\n', 'dgx_a100"\n'))

_entry("E104", """
    A character that no token of the language starts with, often one pasted from a
    document: a typographic multiplication sign, a smart quote, a non-breaking space.
    Cluster sizes are written with the letter `x` (`dgx_a100 x 64`).
    """, f"""
    import "clusters/dgx_a100"
    plan p {{
      model   = {_GPT}
      cluster = dgx_a100 \u00d7 1
      mesh    = [dp = 2, pp = 2, tp = 2]
      train   = {{ global_batch: 16, micro_batch: 1 }}
    }}
    """, "Write the repetition with the letter `x`.", ("dgx_a100 \u00d7 1", "dgx_a100 x 1"))

_entry("E105", """
    Plans are UTF-8 text. This file has a byte that is not UTF-8 (here a `\u00b5` saved by
    an editor in Latin-1) or a NUL byte (a binary file, or a file truncated while being
    written). The offset of the first bad byte is given; nothing else in the file is
    read.
    """, f"""
    # the node link has 2 \u00b5s latency
    import "clusters/dgx_a100"
    plan p {{
      model   = {_GPT}
      cluster = dgx_a100 x 1
      mesh    = [dp = 2, pp = 2, tp = 2]
      train   = {{ global_batch: 16, micro_batch: 1 }}
    }}
    """, "Save the file as UTF-8 (the text itself is fine).", encoding="latin-1")

_entry("E106", """
    The file is larger than a plan can reasonably be (2 MB; only that much is read, and at most
    250,000 tokens are parsed), its brackets (all kinds counted together) nest more than 64 deep, or its imports nest more than 64 deep
    or load more than 256 files (8 MB together). All guard the parser and evaluator against
    generated or hostile input; a real plan never comes close, so this usually means the wrong
    file or a generator gone wrong.
    """, f"""
    import "clusters/dgx_a100"
    plan p {{
      model   = {_GPT}
      cluster = dgx_a100 x 1
      mesh    = [dp = 2, pp = 2, tp = 2]
      train   = {{ global_batch: {_DEEP}, micro_batch: 1 }}
    }}
    """, "Drop the redundant brackets, or split a deep expression into `let` definitions.", (_DEEP, "16"))

_entry("E107", """
    A file plandsl was asked to read (a plan, an import, a schedule CSV, a token file) is a
    directory, a device, a FIFO or a socket. Only regular files are read: a device such as
    `/dev/zero` never ends and a FIFO may never answer, so they are refused from what the
    file system says they are, before a byte is read. A file that says it is regular but
    reports size 0 and has content is made up by the kernel (`/proc`, `/sys`) and is refused
    too, without being shown. Here the import names a folder that
    happens to be called `shared.plan`.
    """, f"""
    import "clusters/dgx_a100"
    import "shared"
    plan p {{
      model   = {_GPT}
      cluster = dgx_a100 x 1
      mesh    = [dp = 2, pp = 2, tp = 2]
      train   = {{ global_batch: 16, micro_batch: 1 }}
    }}
    """, "Import a plan file (a folder's files are imported one by one: `import \"shared/models\"`).",
    ('import "shared"\n', ""), folders=("shared.plan",))

_entry("E108", """
    plandsl itself failed: an exception it did not expect escaped a stage while it worked on
    this file. That is a bug in plandsl, not a problem of the plan, and the message names the
    exception (its type and message). The command reports it like any other problem of that
    file and goes on with the next one (`check a.plan b.plan` still checks `b.plan`); it exits
    with status 1. Set `PLANDSL_DEBUG=1` to have the traceback added as a note. In this
    example the plan is fine and a stage was made to raise `KeyError('tp')`.
    """, f"""
    import "clusters/dgx_a100"
    plan p {{
      model   = {_GPT}
      cluster = dgx_a100 x 1
      mesh    = [dp = 2, pp = 2, tp = 2]
      train   = {{ global_batch: 16, micro_batch: 1 }}
    }}
    """, "Report it to the plandsl maintainers with the command, the plan file(s) and the message "
         "(run it again with `PLANDSL_DEBUG=1` for the traceback); the plan itself needs no change.",
    internal=True)

_entry("E109", """
    The file exists but the system refuses to read it: permission denied, a path longer
    than the file system allows (255 bytes a name on Linux), a loop of symbolic links. The
    system's reason is given; nothing of the file is shown.
    """, f"""
    import "clusters/dgx_a100"
    import "{"models_" * 40}"
    plan p {{
      model   = {_GPT}
      cluster = dgx_a100 x 1
      mesh    = [dp = 2, pp = 2, tp = 2]
      train   = {{ global_batch: 16, micro_batch: 1 }}
    }}
    """, "Name a file the system can read (here a name of at most 255 bytes).",
    (f'import "{"models_" * 40}"\n', ""))

# ---- E2xx: names, types, units, imports ----------------------------------------------------
_entry("E201", """
    A name that is not defined in this file nor in any file it imports. Devices, nodes,
    clusters and models come into scope through `import`; the hint suggests the
    closest name that is in scope.
    """, f"""
    import "clusters/dgx_a100"
    plan p {{
      model   = {_GPT}
      cluster = dgx_a10 x 1
      mesh    = [dp = 2, pp = 2, tp = 2]
      train   = {{ global_batch: 16, micro_batch: 1 }}
    }}
    """, "Use the node's real name.", ("dgx_a10 x", "dgx_a100 x"))

_entry("E202", """
    Two top-level definitions (params, lets, devices, nodes, clusters, models,
    schedules, plans) share a name in one file, so every use of it would be ambiguous.
    The second one is reported; the note points at the first.
    """, f"""
    import "clusters/dgx_a100"
    model small = {_GPT}
    model small = gpt(layers=8, hidden=512, heads=8, seq=128, vocab=1024)
    plan p {{
      model   = small
      cluster = dgx_a100 x 1
      mesh    = [dp = 2, pp = 2, tp = 2]
      train   = {{ global_batch: 16, micro_batch: 1 }}
    }}
    """, "Give each definition its own name.", ("model small = gpt(layers=8", "model medium = gpt(layers=8"))

_entry("E203", """
    A quantity of the wrong dimension: a bandwidth where a memory size belongs, a time
    where a bandwidth belongs. Memory, bandwidth and FLOP/s feed the memory check and
    the cost model directly, so a swapped unit would silently give nonsense estimates.
    """, """
    device v100 {
      memory    = 900 GB/s
      bandwidth = 900 GB/s
      peak      = { fp32: 15.7 TFLOP/s, fp16: 125 TFLOP/s }
    }
    node dgx1 {
      devices = 8 x v100
      link    = { bandwidth: 150 GB/s, latency: 2 us }
    }
    plan p {
      model   = gpt(layers=4, hidden=256, heads=8, seq=128, vocab=1024)
      cluster = dgx1 x 1
      mesh    = [dp = 8]
      train   = { global_batch: 16, micro_batch: 1, precision: fp16 }
    }
    """, "Give the device memory in bytes.", ("memory    = 900 GB/s", "memory    = 32 GiB"))

_entry("E204", """
    A number carries a unit the language does not know. Units are case-sensitive:
    `GiB` (2^30 bytes) and `GB` (10^9 bytes) are sizes, `Gb/s` is bits per second,
    `TFLOP/s` is compute, `us`/`ms`/`s` are times.
    """, """
    device v100 {
      memory    = 32 Gib
      bandwidth = 900 GB/s
      peak      = { fp32: 15.7 TFLOP/s, fp16: 125 TFLOP/s }
    }
    node dgx1 {
      devices = 8 x v100
      link    = { bandwidth: 150 GB/s, latency: 2 us }
    }
    plan p {
      model   = gpt(layers=4, hidden=256, heads=8, seq=128, vocab=1024)
      cluster = dgx1 x 1
      mesh    = [dp = 8]
      train   = { global_batch: 16, micro_batch: 1, precision: fp16 }
    }
    """, "Write the unit as `GiB`.", ("32 Gib", "32 GiB"))

_entry("E205", """
    A value of the wrong kind for where it is used: a number where a list of mesh
    axes is expected, a string where a number is expected. The message says what the
    attribute takes.
    """, f"""
    import "clusters/dgx_a100"
    plan p {{
      model   = {_GPT}
      cluster = dgx_a100 x 1
      mesh    = 8
      train   = {{ global_batch: 16, micro_batch: 1 }}
    }}
    """, "A mesh is a list of named axes whose sizes multiply to the devices used.",
       ("mesh    = 8", "mesh    = [dp = 8]"))

_entry("E206", """
    An attribute, key or option that the thing it is written in does not have: a typo,
    or a setting that belongs elsewhere (the optimizer goes in `train`, not in the
    plan). Unknown settings are errors rather than ignored, so a misspelt
    `micro_batch` cannot silently fall back to its default of 1.
    """, f"""
    import "clusters/dgx_a100"
    plan p {{
      model   = {_GPT}
      cluster = dgx_a100 x 1
      mesh    = [dp = 2, pp = 2, tp = 2]
      train   = {{ global_batch: 16, microbatch: 2 }}
    }}
    """, "Spell the key as the hint suggests.", ("microbatch: 2", "micro_batch: 2"))

_entry("E207", """
    A required attribute is missing. A plan needs `model`, `cluster`, `mesh` and `train`
    (with at least `global_batch`): without them there is nothing to lay out, nothing
    to lay it out on, or no batch to split.
    """, f"""
    import "clusters/dgx_a100"
    plan p {{
      model   = {_GPT}
      cluster = dgx_a100 x 1
      mesh    = [dp = 2, pp = 2, tp = 2]
    }}
    """, "Add the missing attribute.", ("tp = 2]\n", "tp = 2]\n  train   = { global_batch: 16, micro_batch: 1 }\n"))

_entry("E208", """
    An imported file does not exist next to the importing file nor in the standard
    library (`clusters/dgx_a100`, `clusters/local`, ...). `.plan` may be left off the
    name. The hint suggests the closest standard-library file.
    """, f"""
    import "cluster/dgx_a100"
    plan p {{
      model   = {_GPT}
      cluster = dgx_a100 x 1
      mesh    = [dp = 2, pp = 2, tp = 2]
      train   = {{ global_batch: 16, micro_batch: 1 }}
    }}
    """, "Import a file that exists (or create it next to this one).", ("cluster/", "clusters/"))

_entry("E214", """
    Imports read `.plan` files from three places only: the folder of the file named on the
    command line and the folders below it, the standard library, and folders named with
    `--include DIR` (repeatable) or the `PLANDSL_PATH` environment variable (folders separated
    by `:`). A name that leaves them (`../`, an absolute path) or a symbolic link that leads
    out of them is refused before anything is read, so a plan cannot make plandsl read (and
    quote in a message) a file such as `/etc/shadow` or `/proc/self/environ`.
    """, f"""
    import "clusters/dgx_a100"
    import "../shared/models"
    plan p {{
      model   = {_GPT}
      cluster = dgx_a100 x 1
      mesh    = [dp = 2, pp = 2, tp = 2]
      train   = {{ global_batch: 16, micro_batch: 1 }}
    }}
    """, "Name the folder on the command line (`plandsl check example.plan --include ../shared`) and "
    "import the file by its name there, or copy it next to the plan.",
    ('import "../shared/models"\n', ""))

_entry("E209", """
    Files import each other in a circle (here a file imports itself), so neither can
    be loaded first. Every file on the cycle is listed. Shared definitions (devices,
    nodes, models) belong in a file that the others import and that imports none of
    them.
    """, f"""
    import "self.plan"
    import "clusters/dgx_a100"
    plan p {{
      model   = {_GPT}
      cluster = dgx_a100 x 1
      mesh    = [dp = 2, pp = 2, tp = 2]
      train   = {{ global_batch: 16, micro_batch: 1 }}
    }}
    """, "Remove the import of the file itself.", ('import "self.plan"\n', ""), file="self.plan")

_entry("E210", """
    A word that is not one of the values this setting accepts: a precision other than
    fp32/bf16/fp16, a data-parallel kind other than ddp/zero1/zero2/zero3/fsdp/hsdp, a
    recompute mode, an optimizer. The hint lists the valid ones.
    """, f"""
    import "clusters/dgx_a100"
    plan p {{
      model   = {_GPT}
      cluster = dgx_a100 x 1
      mesh    = [dp = 2, pp = 2, tp = 2]
      train   = {{ global_batch: 16, micro_batch: 1, precision: bf32 }}
    }}
    """, "Use one of the valid precisions.", ("bf32", "bf16"))

_entry("E211", """
    Arithmetic that has no answer here: a division by zero, a fraction where a count
    is needed (a batch of 15.6 sequences does not exist), or a `let` defined in terms
    of itself. Counts are never rounded silently, because rounding a batch or an axis
    changes the plan.
    """, f"""
    import "clusters/dgx_a100"
    param tokens_per_step = 2000
    plan p {{
      model   = {_GPT}
      cluster = dgx_a100 x 1
      mesh    = [dp = 2, pp = 2, tp = 2]
      train   = {{ global_batch: tokens_per_step / 128, micro_batch: 1 }}
    }}
    """, "Choose numbers that divide: 2048 tokens per step are 16 sequences of 128.",
       ("tokens_per_step = 2000", "tokens_per_step = 2048"))

_entry("E212", """
    A model family that does not exist (the families are `gpt`, `llama` and `mlp`), or
    an argument the family does not take or is missing. The hyper-parameters decide
    every tensor shape the sharding and memory checks reason about, so they are never
    guessed.
    """, """
    import "clusters/dgx_a100"
    plan p {
      model   = gpt(layers=4, hidden=256, heads=8, seq=128, vocab=1024, dropout=0.1)
      cluster = dgx_a100 x 1
      mesh    = [dp = 2, pp = 2, tp = 2]
      train   = { global_batch: 16, micro_batch: 1 }
    }
    """, "Drop the argument; dropout does not change the layout, so plans do not describe it.",
       (", dropout=0.1", ""))

_entry("E213", """
    The same attribute, key or argument is given twice in one body. Rather than let
    the last one win silently, both are pointed at.
    """, f"""
    import "clusters/dgx_a100"
    plan p {{
      model   = {_GPT}
      cluster = dgx_a100 x 1
      mesh    = [dp = 2, pp = 2, tp = 2]
      train   = {{ global_batch: 16, micro_batch: 1 }}
      mesh    = [dp = 4, tp = 2]
    }}
    """, "Keep one of them.", ("  mesh    = [dp = 4, tp = 2]\n", ""))

# ---- E22x: model shapes -----------------------------------------------------------------------
_entry("E220", """
    Attention splits the model width into `heads` heads of hidden/heads features each: the
    query, key and value projections are viewed as [batch, seq, heads, hidden/heads], which
    needs a whole number. The hint gives the widths nearest the written one that keep the
    head count, and the head counts nearest the written one that divide the width.
    """, """
    import "clusters/dgx_a100"
    plan p {
      model   = gpt(layers=12, hidden=768, heads=10, seq=1024, vocab=50304)
      cluster = dgx_a100 x 1
      mesh    = [dp = 8]
      train   = { global_batch: 64, micro_batch: 2 }
    }
    """, "Use a head count that divides the width (GPT-2 small has 12 heads of 64).", ("heads=10", "heads=12"))

_entry("E221", """
    Grouped-query attention (Ainslie et al. 2023) shares each key/value head among an equal
    group of query heads, heads/kv_heads of them, so `kv_heads` must divide `heads` (and so
    be at most `heads`; `kv_heads = heads` is multi-head attention, 1 is multi-query).
    Under tensor parallelism kv_heads is also split over the tensor axis (E406); the hint
    lists values that satisfy both.
    """, """
    import "clusters/dgx_a100"
    plan p {
      model   = llama(layers=16, hidden=2048, heads=16, kv_heads=6, seq=2048, vocab=32000)
      cluster = dgx_a100 x 1
      mesh    = [dp = 4, tp = 2]
      train   = { global_batch: 64, micro_batch: 2 }
      tensor  = megatron over tp
    }
    """, "Use a key/value head count that divides the query heads (4 query heads per key/value head here).",
    ("kv_heads=6", "kv_heads=4"))

_entry("E222", """
    Rotary position embeddings (Su et al. 2021), which llama models use, rotate each head's
    first half of features together with its second half, pair by pair, so the head
    dimension hidden/heads must be even (Llama's is 128). gpt models add learned positions
    instead and take any head dimension.
    """, """
    import "clusters/dgx_a100"
    plan p {
      model   = llama(layers=16, hidden=1800, heads=24, seq=2048, vocab=32000)
      cluster = dgx_a100 x 1
      mesh    = [dp = 8]
      train   = { global_batch: 64, micro_batch: 2 }
    }
    """, "Widen the model to an even head dimension (1920 / 24 = 80).", ("hidden=1800", "hidden=1920"))

_entry("E223", """
    A mixture-of-experts layer sends each token to the `top_k` experts its router scores
    highest, so top_k must be at least 1 (0 would route nothing: the layer would add zero)
    and at most `experts` (there are no more distinct experts to pick). Without `top_k`
    a model with experts routes to min(2, experts), as Mixtral does.
    """, """
    import "clusters/dgx_a100"
    plan p {
      model   = llama(layers=8, hidden=1024, heads=16, seq=2048, vocab=32000, experts=8, top_k=0)
      cluster = dgx_a100 x 1
      mesh    = [dp = 8]
      train   = { global_batch: 64, micro_batch: 2 }
    }
    """, "Route each token to 2 of the 8 experts (or drop `experts` for a dense model).", ("top_k=0", "top_k=2"))

_entry("E224", """
    A gpt model learns one position embedding per position, `seq` of them; training on
    longer sequences would look up positions that do not exist. (llama's rotary positions
    have no such table: a llama model trains on any sequence length.) Train on at most the
    model's `seq` tokens, or give the model more positions.
    """, """
    import "clusters/dgx_a100"
    plan p {
      model   = gpt(layers=12, hidden=768, heads=12, seq=1024, vocab=50304)
      cluster = dgx_a100 x 1
      mesh    = [dp = 8]
      train   = { global_batch: 64, micro_batch: 2, seq: 2048 }
    }
    """, "Train on the model's 1024 positions (or write seq=2048 in the model).", ("seq: 2048", "seq: 1024"))


# ---- E3xx: clusters and meshes ---------------------------------------------------------------
_entry("E301", """
    The device mesh is the grid every rank gets a coordinate in; its axis sizes
    multiply to the number of ranks. A mesh that needs more devices than the cluster
    has cannot be launched: some coordinates would have no GPU.
    """, f"""
    import "clusters/dgx_a100"
    plan p {{
      model   = {_GPT}
      cluster = dgx_a100 x 1
      mesh    = [dp = 4, pp = 2, tp = 2]
      train   = {{ global_batch: 16, micro_batch: 1 }}
    }}
    """, "Shrink an axis, or use two nodes (`dgx_a100 x 2`).", ("dp = 4", "dp = 2"))

_entry("E302", """
    A parallelism, shard rule or stage split names a mesh axis the mesh does not
    declare. Every collective runs over the process group of one mesh axis, so the
    axis must exist.
    """, f"""
    import "clusters/dgx_a100"
    plan p {{
      model   = {_GPT}
      cluster = dgx_a100 x 1
      mesh    = [dp = 2, pp = 2, tp = 2]
      train   = {{ global_batch: 16, micro_batch: 1 }}
      tensor  = megatron over mp
    }}
    """, "Name an axis of the mesh.", ("over mp", "over tp"))

_entry("E303", """
    One sharding names the same mesh axis twice. Like a DTensor, a sharded tensor has
    exactly one placement per mesh axis (`Shard(dim)`, `Replicate` or `Partial`): one
    dimension may be split over several axes, but one axis cannot split the tensor
    twice.
    """, f"""
    import "clusters/dgx_a100"
    plan p {{
      model   = {_GPT}
      cluster = dgx_a100 x 1
      mesh    = [dp = 2, pp = 2, tp = 2]
      train   = {{ global_batch: 16, micro_batch: 1 }}
      shard layers.*.mlp.w1 = {{ weight: [Shard(0) @ tp, Shard(1) @ tp] }}
    }}
    """, "Shard the weight over the axis once.", ("[Shard(0) @ tp, Shard(1) @ tp]", "Shard(0) @ tp"))

_entry("E304", """
    A mesh declares the same axis name twice. Axis names identify process groups
    (`over dp`), so each must be unique.
    """, f"""
    import "clusters/dgx_a100"
    plan p {{
      model   = {_GPT}
      cluster = dgx_a100 x 1
      mesh    = [dp = 2, pp = 2, dp = 2]
      train   = {{ global_batch: 16, micro_batch: 1 }}
    }}
    """, "Give the third axis its own name.", ("pp = 2, dp = 2", "pp = 2, tp = 2"))

_entry("E305", """
    Mesh axis sizes are positive integers: the number of ranks along that axis. To
    turn a kind of parallelism off, give its axis size 1 or leave the axis out; 0
    would make the whole mesh empty.
    """, f"""
    import "clusters/dgx_a100"
    plan p {{
      model   = {_GPT}
      cluster = dgx_a100 x 1
      mesh    = [dp = 8, pp = 0]
      train   = {{ global_batch: 16, micro_batch: 1 }}
    }}
    """, "Leave the pipeline axis out (or give it size 1).", ("dp = 8, pp = 0", "dp = 8"))

_entry("E306", """
    A mesh axis larger than 1 that no parallelism uses, or a parallelism that says
    which axis it runs over. An unused axis multiplies the device count while every
    rank along it does identical work on identical data: pure waste. Axes named
    dp/tp/pp/cp/ep get their conventional use by default; other names need e.g.
    `data = zero1 over <axis>`.
    """, f"""
    import "clusters/dgx_a100"
    plan p {{
      model   = {_GPT}
      cluster = dgx_a100 x 1
      mesh    = [dp = 2, mp = 4]
      train   = {{ global_batch: 16, micro_batch: 1 }}
    }}
    """, "Say what the axis is for: here tensor parallelism.", ("mp = 4]\n", "mp = 4]\n  tensor  = megatron over mp\n"))

_entry("E307", """
    One mesh axis is named by two parallelisms. An axis is one coordinate of the devices, and
    each parallelism splits its own thing along its axis: the batch (data), the weights
    (tensor), the sequence (context), the layers (stages). Two on one axis would split two
    things along the same coordinate: ranks would hold neither a full batch share nor a full
    layer. The one sharing allowed is the expert axis with a data axis, since expert
    parallelism splits the batch too.
    """, f"""
    import "clusters/dgx_a100"
    plan p {{
      model   = {_GPT}
      cluster = dgx_a100 x 1
      mesh    = [dp = 2, pp = 2, tp = 2]
      train   = {{ global_batch: 16, micro_batch: 1 }}
      tensor  = megatron over tp
      stages  = evenly over tp
    }}
    """, "Give the pipeline its own axis: here `pp`, which nothing uses yet.",
    ("stages  = evenly over tp", "stages  = evenly over pp"))

# ---- E4xx: placement and sharding --------------------------------------------------------------
_entry("E401", """
    A `stages` block puts one layer on two pipeline stages. A layer's weights live on
    exactly one stage: placing it twice would either run it twice per microbatch or
    keep two diverging copies.
    """, f"""
    import "clusters/dgx_a100"
    plan p {{
      model   = {_GPT}
      cluster = dgx_a100 x 1
      mesh    = [dp = 2, pp = 2, tp = 2]
      train   = {{ global_batch: 16, micro_batch: 1 }}
      stages {{
        0: embed, layers[0:2]
        1: layers[1:4], norm, head
      }}
    }}
    """, "Give each layer to one stage: ranges leave out their end.", ("layers[1:4]", "layers[2:4]"))

_entry("E402", """
    A `stages` block leaves a layer on no stage. Every layer of the model must run
    somewhere; the message lists the unplaced ones as ranges, and the hint adds each to
    the stage of the layer before it (the first stage for leading ones), so that
    activations still flow forward through the stages (E410).
    """, f"""
    import "clusters/dgx_a100"
    plan p {{
      model   = {_GPT}
      cluster = dgx_a100 x 1
      mesh    = [dp = 2, pp = 2, tp = 2]
      train   = {{ global_batch: 16, micro_batch: 1 }}
      stages {{
        0: embed, layers[0:2]
        1: layers[2:4], norm
      }}
    }}
    """, "Place the output head on the last stage.", ("layers[2:4], norm\n", "layers[2:4], norm, head\n"))

_entry("E403", """
    A pipeline stage would hold no layer. Its rank would only pass activations along,
    adding a pipeline hop and a bubble while holding no work: there are more stages
    (pp x virtual) than layers to split.
    """, f"""
    import "clusters/dgx_a100"
    plan p {{
      model   = {_GPT}
      cluster = dgx_a100 x 1
      mesh    = [pp = 8]
      train   = {{ global_batch: 16, micro_batch: 1 }}
      stages  = evenly over pp
    }}
    """, "Use at most as many stages as the model has blocks, and the other devices for data parallelism.",
       ("[pp = 8]", "[dp = 2, pp = 4]"))

_entry("E404", """
    The stages of a `stages` block do not match the pipeline axis: there must be
    exactly pp x virtual stages, numbered from 0, one set per pipeline rank.
    """, f"""
    import "clusters/dgx_a100"
    plan p {{
      model   = {_GPT}
      cluster = dgx_a100 x 1
      mesh    = [dp = 2, pp = 2, tp = 2]
      train   = {{ global_batch: 16, micro_batch: 1 }}
      stages {{
        0: embed, layers[0:1]
        1: layers[1:2]
        2: layers[2:3]
        3: layers[3:4], norm, head
      }}
    }}
    """, "Make the pipeline axis as wide as the stages declared (`pp = 4, dp = 1` keeps the 8 devices), "
       "or declare two stages for `pp = 2`.", ("[dp = 2, pp = 2, tp = 2]", "[dp = 1, pp = 4, tp = 2]"))

_entry("E405", """
    A layer selector (`layers[0:8]`, `layers.*.mlp`, `embed`) in a stage block or
    shard rule matches nothing in the model. A rule that applies to nothing is almost
    always a misspelt module name, and ignoring it would leave the intended tensors
    unsharded.
    """, f"""
    import "clusters/dgx_a100"
    plan p {{
      model   = {_GPT}
      cluster = dgx_a100 x 1
      mesh    = [dp = 2, pp = 2, tp = 2]
      train   = {{ global_batch: 16, micro_batch: 1 }}
      shard layers.*.mlp.fc1 = colwise over tp
    }}
    """, "Name a module the model has (gpt's MLP projections are `mlp.w1` and `mlp.w2`).",
       ("mlp.fc1", "mlp.w1"))

_entry("E406", """
    A tensor dimension is split over a mesh axis whose size does not divide it.
    Megatron tensor parallelism gives each of tp ranks heads/tp attention heads and
    ffn/tp MLP columns, and its kernels and collectives expect equal shards on every
    rank (uneven ones would also leave the slowest rank setting the pace). The hint
    names the sizes of the axis with which the whole plan checks (every dim the axis
    splits, the cluster, the memory) and edits the mesh to the nearest, resizing a data
    axis so the mesh keeps its devices when it can.
    """, """
    import "clusters/dgx_a100"
    plan p {
      model   = gpt(layers=4, hidden=384, heads=12, seq=128, vocab=1024)
      cluster = dgx_a100 x 1
      mesh    = [tp = 8]
      train   = { global_batch: 16, micro_batch: 1 }
      tensor  = megatron over tp
    }
    """, "Use a tensor-parallel size that divides the head count, and the rest for data parallelism.",
       ("[tp = 8]", "[dp = 2, tp = 4]"))

_entry("E407", """
    Two shard rules set the same module differently and neither is more precise (an
    exact name beats a range, a range beats a glob). The plan's result would depend
    on rule order, so it is refused.
    """, f"""
    import "clusters/dgx_a100"
    plan p {{
      model   = {_GPT}
      cluster = dgx_a100 x 1
      mesh    = [dp = 2, pp = 2, tp = 2]
      train   = {{ global_batch: 16, micro_batch: 1 }}
      shard layers[0:2].mlp.w1 = colwise over tp
      shard layers[1:4].mlp.w1 = rowwise over tp
    }}
    """, "Make the ranges disjoint (or name the shared layer exactly).", ("layers[1:4]", "layers[2:4]"))

_entry("E408", """
    A placement that cannot apply to the tensor it names: a `Shard(dim)` past the
    tensor's last dimension, a parameter the matched modules do not have, or a value
    that is not `Shard(dim) @ axis`, `Replicate @ axis` or `Partial @ axis`.
    """, f"""
    import "clusters/dgx_a100"
    plan p {{
      model   = {_GPT}
      cluster = dgx_a100 x 1
      mesh    = [dp = 2, pp = 2, tp = 2]
      train   = {{ global_batch: 16, micro_batch: 1 }}
      shard layers.*.mlp.w1 = {{ weight: Shard(2) @ tp }}
    }}
    """, "A linear weight is [out, in]: shard dim 0 (columns) or 1 (rows).", ("Shard(2)", "Shard(0)"))

_entry("E409", """
    The map from pipeline stages to ranks does not fit: every rank must run exactly
    `virtual` stages, and the schedule decides how many that is (1F1B and GPipe run
    one stage per rank, interleaved 1F1B several, ZBV and DualPipeV two in a V).
    """, f"""
    import "clusters/dgx_a100"
    plan p {{
      model    = {_GPT}
      cluster  = dgx_a100 x 1
      mesh     = [dp = 2, pp = 2, tp = 2]
      train    = {{ global_batch: 16, micro_batch: 1 }}
      stages   = evenly over pp with virtual = 2, map = [0, 1, 1, 1]
      schedule = interleaved_1f1b
    }}
    """, "Give each rank two stages, e.g. the V-shape [0, 1, 1, 0] or the loop [0, 1, 0, 1].",
       ("[0, 1, 1, 1]", "[0, 1, 0, 1]"))

_entry("E410", """
    A stage holds layers that come before the layers of the stage ahead of it.
    Activations flow forward from stage 0 to the last stage, so each stage must
    take the layers that follow those of the stage before.
    """, f"""
    import "clusters/dgx_a100"
    plan p {{
      model   = {_GPT}
      cluster = dgx_a100 x 1
      mesh    = [dp = 2, pp = 2, tp = 2]
      train   = {{ global_batch: 16, micro_batch: 1 }}
      stages {{
        0: embed, layers[2:4]
        1: layers[0:2], norm, head
      }}
    }}
    """, "Keep the layers in model order across the stages.",
       ("embed, layers[2:4]", "embed, layers[0:2]"), ("  1: layers[0:2]", "  1: layers[2:4]"))

_entry("E411", """
    Expert parallelism splits the experts of mixture-of-experts layers over a mesh
    axis and routes tokens to them with all-to-all. A dense model has no experts to
    split, so the axis would only replicate work.
    """, f"""
    import "clusters/dgx_a100"
    plan p {{
      model   = {_GPT}
      cluster = dgx_a100 x 1
      mesh    = [dp = 2, ep = 4]
      train   = {{ global_batch: 16, micro_batch: 1 }}
      experts = alltoall over ep
    }}
    """, "Use a model with experts (`llama(..., experts=8)`), or use the axis for something else.",
       ("ep = 4", "tp = 4"), ("experts = alltoall over ep", "tensor  = megatron over tp"))

# ---- E5xx: training and memory ---------------------------------------------------------------
_entry("E501", """
    Each step, the global batch is split evenly over the data-parallel ranks (the
    data axes, and the expert axis), and each rank's share is cut into microbatches
    of `micro_batch` sequences. Every data-parallel rank must get the same whole
    number of microbatches, or the gradient all-reduce would average unequal
    batches, so global_batch must be a multiple of dp x micro_batch.
    """, f"""
    import "clusters/dgx_a100"
    plan p {{
      model   = {_GPT}
      cluster = dgx_a100 x 1
      mesh    = [dp = 4, tp = 2]
      train   = {{ global_batch: 30, micro_batch: 2 }}
    }}
    """, "Use a global batch that dp x micro_batch divides (here 24 or 32).", ("global_batch: 30", "global_batch: 32"))

_entry("E502", """
    A pipeline schedule cannot run every microbatch count: the zero-bubble schedules
    need at least one per pipeline rank, DualPipeV one per stage, chimera a multiple of
    the ranks, and torch's interleaved schedules (interleaved 1F1B, interleaved zero
    bubble) take them in max(1, m // pp) rounds, which must divide m (so 6 runs on 4
    ranks and 9 does not; a multiple of the ranks is not needed). The count m is
    global_batch / (dp x micro_batch); the hint names the nearest global batch that runs.
    """, f"""
    import "clusters/dgx_a100"
    plan p {{
      model    = {_GPT}
      cluster  = dgx_a100 x 1
      mesh     = [dp = 2, pp = 4]
      train    = {{ global_batch: 4, micro_batch: 1 }}
      schedule = zb_h1
    }}
    """, "Raise the global batch (or lower micro_batch) so there are at least pp microbatches.",
       ("global_batch: 4", "global_batch: 8"))

_entry("E503", """
    The estimated peak memory of one device (parameters, gradients, optimizer states
    and activations, with the plan's sharding, pipeline split and schedule) exceeds
    the device's memory: the job would die with an out-of-memory error. The message
    breaks the total down; the hint says which part dominates and what shrinks it.
    Plain data parallelism keeps a full copy of the model states on every rank, about
    16 bytes per parameter with Adam in mixed precision.
    """, """
    import "clusters/dgx_a100"
    plan p {
      model   = llama(layers=32, hidden=4096, heads=32, seq=4096, vocab=32000)
      cluster = dgx_a100 x 1
      mesh    = [dp = 8]
      train   = { global_batch: 64, micro_batch: 1, recompute: full }
    }
    """, "Shard the model states over the data axis (ZeRO-3 / FSDP).",
       ("recompute: full }\n", "recompute: full }\n  data    = zero3 over dp\n"))

_entry("E504", """
    The plan trains in a precision the device has no peak throughput for, and usually
    no hardware support for either: a V100 has no bfloat16 units. The cost model
    could not estimate the step, and the run would fall back to slow emulation or fail.
    """, """
    device v100 {
      memory    = 32 GiB
      bandwidth = 900 GB/s
      peak      = { fp32: 15.7 TFLOP/s, fp16: 125 TFLOP/s }
    }
    node dgx1 {
      devices = 8 x v100
      link    = { bandwidth: 150 GB/s, latency: 2 us }
    }
    plan p {
      model   = gpt(layers=4, hidden=256, heads=8, seq=128, vocab=1024)
      cluster = dgx1 x 1
      mesh    = [dp = 8]
      train   = { global_batch: 16, micro_batch: 1, precision: bf16 }
    }
    """, "Train in a precision the device supports (fp16 on a V100).", ("precision: bf16", "precision: fp16"))

_entry("E505", """
    Every count a plan writes has a cap far beyond today's largest runs (global_batch at
    most 2^32 sequences, micro_batch 2^20, seq 2^24 tokens, virtual 1,024 stages per rank,
    a model family's layers 100,000 and widths 2^20; the table is under Limits in
    docs/language.md). The caps keep the work of checking proportional to what was
    written, not to the numbers in it: a typo that adds six zeros is answered at once.
    """, f"""
    import "clusters/dgx_a100"
    plan p {{
      model    = {_GPT}
      cluster  = dgx_a100 x 1
      mesh     = [dp = 2, pp = 4]
      train    = {{ global_batch: 80000000000000, micro_batch: 1 }}
      schedule = 1f1b
    }}
    """, "Write the count the run needs; a global batch is thousands of sequences, not trillions.",
       ("global_batch: 80000000000000", "global_batch: 8"))

# ---- E6xx: schedules --------------------------------------------------------------------------
_entry("E601", """
    The plan names a pipeline schedule that is neither built in (gpipe, 1f1b,
    interleaved_1f1b, looped_bfs, zb_h1, zb_h2, interleaved_zero_bubble, zbv,
    dualpipev, chimera) nor defined with `schedule NAME(...) { ... }` in scope.
    """, f"""
    import "clusters/dgx_a100"
    plan p {{
      model    = {_GPT}
      cluster  = dgx_a100 x 1
      mesh     = [dp = 2, pp = 2, tp = 2]
      train    = {{ global_batch: 16, micro_batch: 1 }}
      stages   = evenly over pp with virtual = 2
      schedule = interleaved
    }}
    """, "Use the schedule's full name.", ("= interleaved\n", "= interleaved_1f1b\n"))

_SCHEDULE_PLAN = """
    import "clusters/local"
    schedule mine(ranks = 2, microbatches = 2) {{
    {rows}
    }}
    plan p {{
      model    = gpt(layers=4, hidden=64, heads=4, seq=32, vocab=256)
      cluster  = localhost
      mesh     = [pp = 2] over devices[0:2]
      train    = {{ global_batch: 2, micro_batch: 1, precision: fp32 }}
      schedule = mine
    }}
    """


def _schedule_example(rank0: str, rank1: str) -> str:
    return _SCHEDULE_PLAN.format(rows=f"  rank 0: {rank0}\n      rank 1: {rank1}")


_entry("E602", """
    A written schedule names a stage or a microbatch the plan does not have: with the
    plan's global batch, data-parallel size and micro-batch there are m microbatches
    (0..m-1), and pp x virtual stages. Such an action could never be fed with data.
    """, _schedule_example("0F0 0F1 0B0 0B1 0F2", "1F0 1B0 1F1 1B1"),
    "Remove the action, or raise the microbatch count of the plan and the table together.",
    (" 0F2\n", "\n"))

_entry("E603", """
    Every stage must run a forward and a backward (or an input-gradient and a
    weight-gradient action) for every microbatch; otherwise some gradients are never
    computed and the step is not the step one device would take.
    """, _schedule_example("0F0 0F1 0B0 0B1", "1F0 1B0 1F1"),
    "Add the missing action.", ("1F0 1B0 1F1\n", "1F0 1B0 1F1 1B1\n"))

_entry("E604", """
    An action appears twice. Running a forward or backward twice for one microbatch
    would double its gradient contribution (or overwrite the stored activations).
    """, _schedule_example("0F0 0F1 0B0 0B1 0B1", "1F0 1B0 1F1 1B1"),
    "Remove the repeated action.", (" 0B1 0B1\n", " 0B1\n"))

_entry("E605", """
    On one rank an action comes before an action it depends on: a backward before the
    forward it differentiates, a weight gradient before its input gradient, or a stage
    before the stage that feeds it when both live on this rank. A rank runs its row in
    order, so this can never execute.
    """, _schedule_example("0F0 0B1 0F1 0B0", "1F0 1B0 1F1 1B1"),
    "Put the forward first.", ("0F0 0B1 0F1 0B0", "0F0 0F1 0B0 0B1"))

_entry("E606", """
    Run with blocking receives (as torch's schedule runtime runs it), every rank would
    end up waiting for an action that another waiting rank runs only later: the job
    would hang on the first step. The diagnostic lists every stuck rank and what it
    waits for.
    """, _schedule_example("0F0 0B0 0F1 0B1", "1F1 1B1 1F0 1B0"),
    "Let the last stage process microbatches in the order they arrive.",
    ("1F1 1B1 1F0 1B0", "1F0 1B0 1F1 1B1"))

_entry("E607", """
    A stage's actions appear on two ranks. A stage's weights live on one rank, so every
    action of the stage must be in that rank's row (V-shape and interleaved maps give a
    rank several stages, never a stage several ranks).
    """, _schedule_example("0F0 0F1 0B0 0B1 1F1 1B1", "1F0 1B0 1F1 1B1"),
    "Remove the actions from the other rank's row.", (" 0B1 1F1 1B1\n", " 0B1\n"))

_entry("E608", """
    A user-defined schedule is written either as a table (`rank 0: 0F0 0B0 ...` rows,
    with fixed sizes such as `ranks = 2`) or as a template (loops over variables such
    as `p: ranks, m: microbatches` that work for any size), not a mix of both: a table
    has no variables to loop over.
    """, """
    schedule mine(p: ranks, m: microbatches) {
      rank 0: 0F0 0F1 0B0 0B1
      rank 1: _ 1F0 1B0 1F1 1B1
    }
    """, "Make it a table with fixed sizes.", ("p: ranks, m: microbatches", "ranks = 2, microbatches = 2"))

_entry("E609", """
    A written schedule is laid out action by action for the plan's sizes before it is
    validated, and a valid one holds at least F and B for every stage and microbatch.
    Past 500,000 actions (`MAX_ACTIONS`) the template is not run: its table would take
    longer to lay out and check than the plan is worth. Built-in schedules are checked
    and estimated without laying them out, for any microbatch count, and `plandsl simulate`
    gives their figures past the cap by extrapolating the steady state; printing, drawing or
    tracing every action (`plandsl schedule`, `render --view schedule`, `simulate --trace`)
    has the same cap. The error points at the plan's `schedule =` line, with notes at the
    definition and at where the microbatch count comes from.
    """, """
    import "clusters/dgx_a100"
    schedule flush(p: ranks, m: microbatches) {
      for r in 0..p on rank r {
        for i in 0..m { F(r, i) }
        for i in 0..m { B(r, i) }
      }
    }
    plan p {
      model    = gpt(layers=4, hidden=256, heads=8, seq=128, vocab=1024)
      cluster  = dgx_a100 x 1
      mesh     = [dp = 2, pp = 4]
      train    = { global_batch: 200000, micro_batch: 1 }
      schedule = flush
    }
    """, "Use a built-in schedule, which needs no table to check, or fewer microbatches (a larger micro_batch or a smaller global_batch).",
       ("schedule = flush", "schedule = 1f1b"))

# ---- E7xx: what `plandsl run` refuses --------------------------------------------------------
# The plan checks clean (it can be estimated and rendered); `plandsl run` refuses it before any
# process starts, rather than run something else. tests/make_errors_doc.py runs these examples
# through `plandsl.runtime.support.refusals` as well.
_LOCAL_GPT = "gpt(layers=4, hidden=64, heads=4, seq=32, vocab=256)"


def _local_plan(lines: str, mesh: str = "[pp = 2]", model: str = _LOCAL_GPT, header: str = "") -> str:
    return f"""
    import "clusters/local"
    {header}plan p {{
      model   = {model}
      cluster = localhost
      mesh    = {mesh} over devices[0:{2 if mesh.count("=") == 1 else 4}]
      train   = {{ global_batch: 8, micro_batch: 1 }}
      {lines}
    }}
    """


_entry("E701", """
    The plan names a built-in schedule the interpreter cannot run yet. `chimera` runs two
    pipelines in opposite directions, each rank holding one stage of each and each microbatch
    taking one of them; torch.distributed.pipelining runs one chain of stages, so there is no
    faithful way to run it. The cost model and the renderer handle it; `plandsl run` refuses
    it rather than run another schedule under its name.
    """, _local_plan("stages   = evenly over pp\n      schedule = chimera"),
    "Run a schedule over one chain of stages with a similar bubble (1f1b, or zbv with a V-shape map).",
    ("schedule = chimera", "schedule = 1f1b"))

_entry("E702", """
    The plan splits the sequence over a context-parallel axis in a way the interpreter cannot
    run on this machine's backend. `ring` runs torch's ring attention (the algorithm behind
    torch's `context_parallel`) over the CPU flash-attention kernel with gloo; on CUDA it
    would need the CUDA attention kernels, whose outputs it merges differently, and that path
    is not written yet (no GPU has checked it), so with CUDA present `plandsl run` refuses
    it. `allgather` computes the same attention with public torch only (functional
    collectives and SDPA with a mask), on CPU and CUDA: each layer all-gathers K and V over
    the axis before the attention core (Llama 3's context parallelism).
    """, _local_plan("context = ring over cp", mesh="[cp = 2]"),
    "Gather K and V instead of passing them around the ring; the ring plan still estimates, renders and runs on CPU.",
    ("context = ring over cp", "context = allgather over cp"), on_cuda=True)

_entry("E703", """
    Two parallelisms the plan combines cannot run together with torch's building blocks.
    Context and expert parallelism do not run with `hsdp`: the context axis would have to join
    its shard dimension, and the parameters besides the experts would need a 2-D mesh
    replicated over the expert axis too. `recompute: selective_op` does not run with a
    schedule that splits the backward into I and W (`zbv`, the zero-bubble ones): torch's
    selective checkpointing serves the outputs it kept to one backward pass.
    """, _local_plan("data    = hsdp over [r, s]\n      context = allgather over cp", mesh="[r = 2, s = 1, cp = 2]"),
    "Shard over the data axes with zero3 (fsdp), which runs with context parallelism.",
    ("data    = hsdp over [r, s]", "data    = zero3 over [r, s]"))

_entry("E704", """
    The interpreter needs a torch module for the model, and has none. A model written layer
    by layer describes sizes for the cost model; to run it, `factory` names the Python
    function that builds it (docs/models.md says what the module must look like). Tensor
    parallelism, context parallelism and `recompute: selective_op` also need to know the
    module's layout, which only the gpt and llama families have (`selective_op` only their
    dense blocks).
    """, _local_plan("data    = replicate over dp", mesh="[dp = 2]", model="tiny_written", header="""model tiny_written {
      layer blocks[0:2] {
        params = 64 * 64
        flops  = 2 * 64 * 64
        output = 64
      }
    }
    """),
    "Add a factory that builds the module.", ("model tiny_written {", 'model tiny_written {\n  factory = "my_models:build"'))

_entry("E705", """
    A shard rule asks for a placement the interpreter cannot run correctly: a norm's weight
    split (it normalises over the whole hidden dimension), `sequence` on a projection or
    without sequence parallelism, a parameter left `Partial`, split over an axis that is
    neither the tensor axis nor the one axis gradients are reduced over, a module split over
    that axis only in part, with `hsdp` or on `replicate`/`zero1` pipeline stages, MoE
    routers and experts split over the tensor axis. docs/running.md lists what runs.
    """, _local_plan("tensor  = megatron over tp\n      shard layers.*.norm1 = colwise over tp", mesh="[tp = 2]"),
    "Leave the norm replicated (or use `sequence` with sequence parallelism).",
    ("colwise over tp", "replicate"))

# ---- E8xx: what generate --from cannot keep, shrink cannot do ---------------------------------------
_entry("E801", """
    `plandsl generate --from` keeps every decision a partial plan writes, as a pin of the search, and
    adds only what the plan leaves out. The search lays out one mesh axis per parallelism, named by
    the plan's own lines, over the whole cluster; a decision that needs more than that can only be
    kept under a mesh the plan writes itself: a shard rule (it names axes), a data or other
    parallelism over two axes or sharing one, a mesh over part of the cluster.
    """, f"""
    import "clusters/dgx_a100"
    plan p {{
      model   = {_GPT}
      cluster = dgx_a100 x 1
      train   = {{ global_batch: 16, micro_batch: 1 }}
      shard layers.*.mlp.w1 = colwise over tp
    }}
    """, "Write the mesh the rule runs on (or remove the rule and let the search lay out the plan).",
    ("train   = {", "mesh    = [dp = 4, tp = 2]\n  tensor  = megatron over tp\n  train   = {"),
    command=("generate", "--from"))

_entry("E802", """
    `plandsl shrink` keeps a plan's layout and changes only its sizes: each mesh axis becomes 2 (or
    1 while there are more processes than `--ranks`). An axis the plan's text fixes keeps its size:
    the pipeline axis when a `stages { }` block numbers the stages, a stage-to-rank map lists ranks
    or the schedule is a table or a template written for fixed sizes. When that axis alone needs more
    processes than `--ranks`, or the plan is defined in another file than the one given, the plan
    cannot be scaled down as it is written.
    """, f"""
    import "clusters/dgx_a100"
    plan p {{
      model   = {_GPT}
      cluster = dgx_a100 x 1
      mesh    = [pp = 4]
      train   = {{ global_batch: 16, micro_batch: 1 }}
      stages {{
        0: embed, layers[0:1]
        1..3: layers[1:3]
        3: layers[3:4], norm, head
      }}
    }}
    """, "Split the stages evenly, so the pipeline axis can shrink (or give --ranks 4).",
    ("stages {\n    0: embed, layers[0:1]\n    1..3: layers[1:3]\n    3: layers[3:4], norm, head\n  }",
     "stages  = evenly over pp"),
    command=("shrink", "--ranks", "2"))

_entry("E803", """
    Every decision a partial plan writes is a pin of the search (`plandsl generate --from`), and no
    plan satisfies them all: here a 52B-parameter model whose weights, gradients and Adam states
    need about 830 GB on one node of 640 GB, whatever the ZeRO stage, micro-batch or recomputation.
    The message says which constraint left nothing and what would fit.
    """, """
    import "clusters/dgx_a100"
    plan p {
      model   = gpt(layers=64, hidden=8192, heads=64, seq=2048, vocab=51200)
      cluster = dgx_a100 x 1
      mesh    = [dp = 8]
      train   = { global_batch: 64 }
    }
    """, "Give the plan more devices (or a smaller model).",
    ("dgx_a100 x 1", "dgx_a100 x 2"), ("[dp = 8]", "[dp = 16]"), command=("generate", "--from"))


# ---- warnings ---------------------------------------------------------------------------------
_entry("W201", """
    A `param` or `let` of the file is never used. Usually a leftover from an edit, or a
    sign that a plan refers to a literal where it meant the parameter, so that
    `--param` overrides do nothing. Only reported when the file has no errors.
    """, f"""
    import "clusters/dgx_a100"
    param batch = 32
    plan p {{
      model   = {_GPT}
      cluster = dgx_a100 x 1
      mesh    = [dp = 2, pp = 2, tp = 2]
      train   = {{ global_batch: 16, micro_batch: 1 }}
    }}
    """, "Use the parameter (or remove it).", ("global_batch: 16", "global_batch: batch"))

_entry("W202", """
    `top_k` says how many experts each token is routed to in a mixture of experts. A llama
    without `experts` is dense: every token goes through the one MLP of each block, and `top_k`
    changes nothing in the model, its cost or its memory. Usually `experts=` was forgotten,
    or the argument was copied from a MoE model.
    """, f"""
    import "clusters/dgx_a100"
    plan p {{
      model   = llama(layers=4, hidden=256, heads=8, seq=128, vocab=1024, top_k=2)
      cluster = dgx_a100 x 1
      mesh    = [dp = 8]
      train   = {{ global_batch: 16, micro_batch: 1 }}
    }}
    """, "Remove `top_k` (or add `experts=8` to make it a mixture of experts).", (", top_k=2)", ")"))

_entry("W301", """
    The mesh covers fewer devices than the cluster has; the others stay idle for the
    whole run. Fine for a quick test, but on a reserved cluster it is paid-for
    hardware doing nothing.
    """, f"""
    import "clusters/dgx_a100"
    plan p {{
      model   = {_GPT}
      cluster = dgx_a100 x 1
      mesh    = [dp = 2, tp = 2]
      train   = {{ global_batch: 16, micro_batch: 1 }}
    }}
    """, "Grow an axis to use every device.", ("dp = 2, tp", "dp = 4, tp"))

_entry("W302", """
    Tensor parallelism all-reduces activations twice per layer, forward and backward,
    so its axis should stay inside one node, on NVLink. Ranks are laid out with the
    last mesh axis innermost (contiguous devices); a tensor axis placed outer, or
    larger than a node, puts those all-reduces on the inter-node fabric, typically 10x
    slower.
    """, f"""
    import "clusters/dgx_a100"
    plan p {{
      model   = {_GPT}
      cluster = dgx_a100 x 2
      mesh    = [tp = 4, dp = 4]
      train   = {{ global_batch: 16, micro_batch: 1 }}
    }}
    """, "Make the tensor axis the last (innermost) one.", ("[tp = 4, dp = 4]", "[dp = 4, tp = 4]"))


ENTRIES: dict[str, Entry] = {e.code: e for e in sorted(_ENTRIES, key=lambda e: e.code)}


def explain(code: str) -> str | None:
    """The text `plandsl explain CODE` prints, or None for an unknown code."""
    entry = ENTRIES.get(code.upper())
    if entry is None:
        return None
    wrapped = textwrap.fill(entry.explanation, width=88)
    lines = [f"{entry.code}: {entry.title}", "", wrapped, "", f"Example ({entry.file}):",
             textwrap.indent(entry.example, "    ").rstrip("\n"), "", f"Fix: {entry.fix}"]
    if entry.edits:
        lines.append(textwrap.indent(entry.fixed, "    ").rstrip("\n"))
    return "\n".join(lines)


def unknown_code(code: str) -> str:
    """What `plandsl explain CODE` says of a code it does not know: the nearest known codes, else where the
    list is."""
    suggestion = did_you_mean(code.upper(), CODES, "codes")
    return f"unknown code '{code}'" + (f"; {suggestion}" if suggestion else "; see docs/errors.md")
