"""E8xx: what `plandsl generate --from` cannot keep of a partial plan and what `plandsl shrink`
cannot scale down; what `plandsl import` cannot read and `plandsl export` cannot write (E804-E808), what
`plandsl estimate --against` cannot read of a run's metrics (E809-E810), `plandsl render` cannot draw (E811-E813) and
`plandsl generate` cannot find (E814: no plan fits; its flags' problems are E804-E805, as an import's) and `plandsl lsp`
cannot start without (E815).

Each `_entry(...)` is one code: why the rule exists, a failing example and the fix; see
`plandsl.diagnostics.catalogue.entry` for the form."""
from __future__ import annotations

from plandsl.diagnostics.catalogue.entry import GPT, Family

FAMILY = Family("E8")
_entry = FAMILY.add


_entry("E801", """
    `plandsl generate --from` keeps every decision a partial plan writes, as a pin of the search, and
    adds only what the plan leaves out. The search lays out one mesh axis per parallelism, named by
    the plan's own lines, over the whole cluster; a decision that needs more than that can only be
    kept under a mesh the plan writes itself: a shard rule (it names axes), a data or other
    parallelism over two axes or sharing one, a mesh over part of the cluster.
    """, f"""
    import "clusters/dgx_a100"
    plan p {{
      model   = {GPT}
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
      model   = {GPT}
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
    plan satisfies them all: here a 52B-parameter model whose 16-bit weights, gradients, Adam states and
    fp32 master copy need about 940 GB on one node of 640 GB, whatever the ZeRO stage, micro-batch or
    recomputation.
    The message says which constraint left nothing and what would fit, and which plan came closest: the
    one that needs least by its estimate ("the closest"), or, where only a lower bound on what plans need
    is known (here their model states alone), the lowest bound ("the lowest bound").
    A `--pin` that contradicts a line the plan writes (`--pin tp=4` against `mesh = [dp = 2, tp = 8]`) is
    this error too, at that line and naming the pin: the completed file keeps every line as written, so
    the search cannot rank the pin's plans (a pin of the train's micro_batch or recompute replaces the
    value written there instead, with a note). Pins the search finds contradictory are this error at the
    written line a `--pin` meets (`--pin offload_layers=2` against `mesh = [pp = 2, dp = 8]`, `--pin zero=3`
    against `stages = evenly over pp with implementation = deepspeed`), or, where `--pin`s meet each other whatever
    the plan writes, naming them, at no line of the file.
    """, """
    import "clusters/dgx_a100"
    plan p {
      model   = gpt(layers=64, hidden=8192, heads=64, seq=2048, vocab=51200)
      cluster = dgx_a100 x 1
      mesh    = [dp = 8]
      train   = { global_batch: 64, param_dtype: bf16 }
    }
    """, "Give the plan more devices (or a smaller model).",
    ("dgx_a100 x 1", "dgx_a100 x 2"), ("[dp = 8]", "[dp = 16]"), command=("generate", "--from"))

# ---- plandsl import and export: other tools' configurations (plandsl/interop/) ----------------------------------
# The flags of a small GPT as a launch script's bash array (the examples add one line or more before its end).
_FLAGS = """MEGATRON_ARGS=(
        --num-layers 4 --hidden-size 256 --num-attention-heads 8
        --seq-length 128 --max-position-embeddings 128 --padded-vocab-size 1024
        --micro-batch-size 1 --global-batch-size 16"""
_IMPORT = ("import", "--from", "megatron", "--world-size", "8")

_entry("E804", """
    `plandsl import --from megatron` reads Megatron-LM's flags as its launch scripts spell them. A flag it does
    not know is an error, not something to skip: Megatron-LM itself would stop on a misspelt one, and a plan
    built without it would describe another run. A flag that needs a value and has none or a malformed one,
    or a required one that is missing (the model's shape, the micro-batch size, the vocabulary, which
    Megatron-LM otherwise reads from a tokenizer file), is reported the same way, the flag under the caret.
    Flags that mean nothing in a plan (data paths, logging, checkpoints) are read and listed as left out.
    `plandsl import --from deepspeed` reports an unknown key of DeepSpeed's JSON config the same way:
    DeepSpeed itself ignores keys it does not know, so a misspelt `gradient_cliping` would go unnoticed.
    An import reports the first 20 problems of one kind (unknown flags or keys, words that are not flags;
    flags given twice, E805) one by one, with their hints, and counts the rest in one more diagnostic that
    names the first few: a file with thousands is not a configuration with typos. `plandsl check` reports
    every problem of a plan. `plandsl generate` reports a `--pin` it does not know, or one whose value is
    malformed (`--pin tp=abc`), with this code too, before it searches (`error[E804]: unknown pin 'colour'`).
    """, f"""
    {_FLAGS}
        --tensor-model-paralel-size 2
    )
    """, "Spell the flag as Megatron-LM does.",
    ("--tensor-model-paralel-size", "--tensor-model-parallel-size"), file="megatron.args", command=_IMPORT)

_entry("E805", """
    Megatron-LM refuses some pairs of flags, or keeps the last of a flag given twice without a word. A
    virtual-stage count and a pipeline layout both say how many stages each rank runs; Megatron-LM's
    `validate_args` takes at most one of `--pipeline-model-parallel-layout`,
    `--num-virtual-stages-per-pipeline-rank` and `--num-layers-per-virtual-pipeline-stage`. The import
    reports such flags before it writes a plan, naming the second one. `plandsl generate` reports pins that
    contradict each other (`--pin tp=2 --pin tp=4`, a schedule and a virtual-stage count it does not run) or
    what the problem runs (a tensor-parallel degree that does not divide the devices, a schedule a pipeline
    runtime does not run) with this code too, before it searches; with `--from`, a pin against a line the
    partial plan keeps is E803 at that line.
    """, f"""
    {_FLAGS}
        --pipeline-model-parallel-size 2
        --pipeline-model-parallel-layout 'Et|t|t|tL'
        --num-virtual-stages-per-pipeline-rank 2
    )
    """, "Keep the layout (its four stages on two ranks are two virtual stages each) and drop the count.",
    ("\n    --num-virtual-stages-per-pipeline-rank 2", ""), file="megatron.args", command=_IMPORT)

_entry("E806", """
    Megatron-LM's data-parallel size is what is left of the world size after the tensor, pipeline and
    context parallel degrees: world / (tp x pp x cp), which must be a whole number (`validate_args`), and
    the expert-parallel degree must divide it. The world size is the import's `--world-size`, or the
    devices of its `--cluster`.
    """, f"""
    {_FLAGS}
        --tensor-model-parallel-size 3
    )
    """, "Use a tensor-parallel degree that divides the world size (or another world size).",
    ("--tensor-model-parallel-size 3", "--tensor-model-parallel-size 2"), file="megatron.args", command=_IMPORT)

_entry("E807", """
    Megatron-LM has settings a plan has no word for: Ulysses context parallelism (`--cp-comm-type a2a`) or
    a type per layer, partial recomputation (`--recompute-method block`, or more than one block per
    recomputed unit), expert tensor parallelism that differs from the tensor axis, several distributed
    optimizer instances, a model whose norm, activation, positions and biases are neither plandsl's gpt(...)
    nor its llama(...). torchtitan's have theirs too: memory-budget checkpointing, a schedule CSV, gradient
    accumulation with a pipeline, expert parallelism for llama3, a learning-rate decay that stops short of
    0, FSDP's CPU offload or symmetric-memory collectives, a reshard-after-forward policy other than its
    default where the two differ, an unbalanced context-parallel split, the float8, MXFP8 and NVFP4 config
    functions. The import stops rather than write a plan that would estimate another run.
    """, f"""
    {_FLAGS}
        --context-parallel-size 2 --cp-comm-type a2a
    )
    """, "Use a kind of context parallelism a plan has: all_gather (or p2p, a ring).",
    ("--cp-comm-type a2a", "--cp-comm-type all_gather"), file="megatron.args", command=_IMPORT)

_entry("E808", """
    `plandsl export --to megatron` writes only what Megatron-LM can be told. Megatron-LM runs 1F1B, or
    interleaved 1F1B with virtual stages placed round robin; it lays ranks out innermost first as
    tp-cp-ep-dp-pp (or tp-cp-ep-pp-dp); it has one data axis, no shard rules and no op-level
    recomputation. `--to torchtitan` likewise: its models are its llama3 config functions' registry
    flavors, its FSDP is ZeRO-3 at every data-parallel degree (no DDP, no zero1 or zero2; bf16 gathered
    over fp32 weights, `gather = bf16`), its mesh is pp, dp_replicate, dp_shard, cp, tp
    outermost first, and its selective checkpointing is op-level. Each part of the plan outside that is
    listed, and nothing is written unless `--lossy` is given, so that a run launched from the export is
    the run the plan describes.
    """, f"""
    import "clusters/dgx_a100"
    plan p {{
      model    = {GPT}
      cluster  = dgx_a100 x 1
      mesh     = [dp = 4, pp = 2]
      train    = {{ global_batch: 16, micro_batch: 1 }}
      schedule = gpipe
    }}
    """, "Use a schedule Megatron-LM runs (or export with --lossy and launch its 1F1B knowingly).",
    ("schedule = gpipe", "schedule = 1f1b"), command=("export", "--to", "megatron"))

# E809-E810: `plandsl estimate PLAN --against METRICS.jsonl` reads what a run of the plan measured. The example is the
# metrics file; tests/make_errors_doc.py estimates a small plan (train.plan, written beside it) against it.
_AGAINST = ("estimate", "train.plan", "--against")
_RECORD = '{"step": 1, "loss": 6.93, "step_time_s": 0.412, "tokens_per_s": 9942.1, "peak_memory_bytes": 1073741824}'

_entry("E809", """
    `--against` sets the estimate beside the JSON lines `plandsl run --metrics FILE` wrote, one per step: a file
    that cannot be read (missing, a folder, larger than 64 MiB) or that holds no step's record has nothing to
    compare. A run stopped before its first step ended leaves the file empty, as the example is. (train.plan: any
    plan.)
    """, "\n", "Give the metrics of a run that recorded a step.", ("\n", _RECORD + "\n"),
    file="metrics.jsonl", command=_AGAINST, command_line=True)

_entry("E810", """
    Each line of the metrics is one step's JSON object as `plandsl run --metrics` writes it: `step` (a number at
    least 0), `step_time_s` and `tokens_per_s` (finite numbers above 0), optionally `peak_memory_bytes` and
    `peak_reserved_bytes` (at least 0); other keys are ignored. A line that is not (a log line, a figure written
    as a string, NaN or infinity, a time of 0) is refused at its line, rather than compared as something it is
    not. (train.plan: any plan.)
    """, f"""
    {_RECORD}
    {_RECORD.replace('"step": 1', '"step": 2').replace('0.412', '"0.208"')}
    """, "Write each figure as a JSON number.", ('"0.208"', "0.208"),
    file="metrics.jsonl", command=_AGAINST)

# E811-E813: what `plandsl render` cannot draw. tests/make_errors_doc.py renders each example with the view and format
# named, on a machine without graphviz (E812), or with a graphviz that fails (E813: a stub, as no plan known makes
# graphviz fail); the fixes' graphviz is a stub that writes an empty picture.
_DATA_PARALLEL = f"""
    import "clusters/dgx_a100"
    plan p {{
      model   = {GPT}
      cluster = dgx_a100 x 1
      mesh    = [dp = 8]
      train   = {{ global_batch: 16, micro_batch: 1 }}
    }}
    """

_entry("E811", """
    The schedule and memory views draw a pipeline's step: its stages' actions over time, and what each pipeline
    rank holds as they run. A plan without stages over a pipeline axis has no schedule to draw. The mesh and
    placement views draw any plan; `--view all` draws every view that applies and says why the others do not.
    """, _DATA_PARALLEL, "Draw a view that applies: the mesh or the placement.",
    command=("render", "--view", "schedule"), fixed_command=("render", "--view", "mesh"))

_entry("E812", """
    DOT text (`--format dot`, and the views without `-o`) needs nothing but plandsl; an SVG, PNG or PDF picture,
    and the HTML page of `--view all`, are laid out by graphviz's own programs (`dot`, `neato`), which are not a
    Python package: the system's package manager installs them.
    """, _DATA_PARALLEL, "Install graphviz (or write DOT text with `--format dot`).",
    command=("render", "--view", "mesh", "--format", "svg"), fixed_command=("render", "--view", "mesh", "--format", "svg"),
    command_line=True, lacks="Graphviz")

_entry("E813", """
    graphviz exited with an error laying out the DOT text plandsl wrote: its first line of error is in the message.
    It may run out of memory or time on a very large picture; otherwise the DOT text is wrong, a plandsl bug.
    `--format dot` writes that text without graphviz, to run graphviz on by hand. The example has graphviz fail
    (a stub), as no plan known makes it.
    """, _DATA_PARALLEL, "Write the DOT text and run graphviz on it to see its whole message; report it with the plan.",
    command=("render", "--view", "mesh", "--format", "svg"), fixed_command=("render", "--view", "mesh", "--format", "dot"),
    command_line=True, internal=True)

# E814: `plandsl generate` without --from (no plan file: the example is a file of models, which `--model FILE:NAME`
# names). tests/make_errors_doc.py runs the search through api.generate.
_entry("E814", """
    `plandsl generate` searches every layout of the model on the cluster (data, tensor, pipeline, context and
    expert degrees, the schedule, ZeRO stage, micro-batch, recomputation, under the `--pin`s) and found none that
    runs within the devices' memory by the cost model: here a 175B-parameter model whose weights, gradients and
    Adam states alone need more than one node's eight 80 GB GPUs, whatever the plan. The message says which
    constraint left nothing and what would work (here the least cluster the model states need), and which plan
    came closest; a search stopped by `--time-limit` before any plan it simulated fitted says what it searched.
    (With `--from`, a partial plan whose decisions leave nothing is E803, at the plan.) The flags' own problems
    are E804 (a malformed or unknown value) and E805 (flags or pins that contradict each other); what the plan
    language says of `--model` or `--cluster` has the language's code (E201, E212, E22x, E504, ...).
    """, """
    model big = gpt(layers=96, hidden=12288, heads=96, seq=2048, vocab=51200)
    """, "Give the search more devices, a smaller global batch or a smaller model (here a smaller model).",
    ("layers=96, hidden=12288, heads=96", "layers=8, hidden=1024, heads=16"), file="big.plan",
    command=("generate", "--cluster", "dgx_a100", "--global-batch", "8", "--model"), command_line=True)

# E815: `plandsl lsp`, which an editor starts (the example is a plan the editor opens). tests/make_errors_doc.py imports
# the language server on a machine where importing pygls fails, and the fix's with pygls as installed.
_entry("E815", """
    `plandsl lsp` is the language server an editor starts for plan files (diagnostics, hovers, completions, quick
    fixes as you type). It speaks LSP through pygls, which comes with the `lsp` extra, not with plandsl itself:
    checking, estimating and running plans need none of it. It is a usage error (exit 2), as for `plandsl launch`
    without TorchX (E717); the message names the module that could not be imported.
    """, f"""
    import "clusters/dgx_a100"
    plan p {{
      model   = {GPT}
      cluster = dgx_a100 x 1
      mesh    = [dp = 2, pp = 2, tp = 2]
      train   = {{ global_batch: 16, micro_batch: 1 }}
    }}
    """, "Install the `lsp` extra where the editor starts `plandsl lsp`.",
    command=("lsp", "--stdio"), fixed_command=("lsp", "--stdio"), command_line=True, lacks="pygls")
