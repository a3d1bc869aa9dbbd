"""E2xx: names, types, units and imports, found while lowering; E22x-E230: the shapes a model needs
to run, found by the checker.

Each `_entry(...)` is one code: why the rule exists, a failing example and the fix; see
`plandsl.diagnostics.catalogue.entry` for the form."""
from __future__ import annotations

from plandsl.diagnostics.catalogue.entry import GPT, Family

FAMILY = Family("E2")
_entry = FAMILY.add


_entry("E201", """
    A name that is not defined in this file nor in any file it imports. Devices, nodes,
    clusters and models come into scope through `import`; the hint suggests the
    closest name that is in scope.
    """, f"""
    import "clusters/dgx_a100"
    plan p {{
      model   = {GPT}
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
    model small = {GPT}
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
      model   = {GPT}
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
      model   = {GPT}
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
      model   = {GPT}
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
      model   = {GPT}
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
      model   = {GPT}
      cluster = dgx_a100 x 1
      mesh    = [dp = 2, pp = 2, tp = 2]
      train   = {{ global_batch: 16, micro_batch: 1 }}
    }}
    """, "Name the folder on the command line (`plandsl check example.plan --include ../shared`) and "
    "import the file by its name there, or copy it next to the plan.",
    ('import "../shared/models"\n', ""))

_entry("E215", """
    A model written in torch (`hf("LlamaForCausalLM", ...)`, a Hugging Face class built from
    config keys, or `factory("pkg.module:function", ...)`) is known to plandsl through its layer
    table, which `plandsl inspect` derives by building the model on the meta device and writes
    beside the plan (`.plandsl/`). Checking never imports torch or runs the model's code, so it
    reads that table, and refuses a missing one, or one made for other arguments, another torch,
    transformers or plandsl, or an older version of the factory's file. The hint is the command
    that writes it; `--allow-model-import` (check, estimate, render, simulate, generate, run, ...)
    runs it instead, importing the model's code.
    """, """
    import "clusters/dgx_a100"
    plan p {
      model   = hf("LlamaForCausalLM", hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                   num_attention_heads=8, num_key_value_heads=2, vocab_size=1024)
      cluster = dgx_a100 x 1
      mesh    = [dp = 8]
      train   = { global_batch: 16, micro_batch: 1, seq: 128 }
    }
    """, "Run the command of the hint (or describe the model with a family, as here).",
    ("""hf("LlamaForCausalLM", hidden_size=256, intermediate_size=688, num_hidden_layers=4,
               num_attention_heads=8, num_key_value_heads=2, vocab_size=1024)""",
     "llama(layers=4, hidden=256, heads=8, kv_heads=2, ffn=688, seq=2048, vocab=1024)"))

_entry("E216", """
    A device's `measured` GEMM table (what `plandsl profile` writes inside `efficiency`, for the
    cost model to interpolate between) is a list of `[m, n, k, time]` rows: the GEMM of an m x k
    by a k x n matrix and the time it took, each shape once, at most 256 rows. A link's `measured`
    table is `{ collective: [[ranks, bytes, time], ...] }` with the cost model's collectives
    (all_reduce, reduce_scatter, all_gather, all_to_all, p2p), 2 ranks or more, each (ranks,
    bytes) once. Anything else would leave the cost model a curve through points that are not
    there.
    """, f"""
    device box {{
      memory     = 16 GiB
      bandwidth  = 20 GB/s
      peak       = {{ fp32: 100 GFLOP/s }}
      efficiency = {{ fp32: {{ measured: [[512, 512, 512, 3 ms], [1024, 1024, 4.2 ms]] }} }}
    }}
    node one {{
      devices = 2 x box
      link    = {{ bandwidth: 5 GB/s, latency: 20 us }}
    }}
    plan p {{
      model   = {GPT}
      cluster = one x 1
      mesh    = [dp = 2]
      train   = {{ global_batch: 16, micro_batch: 1, precision: fp32 }}
    }}
    """, "Give every row its m, n and k and its time.", ("[1024, 1024, 4.2 ms]", "[1024, 1024, 1024, 24 ms]"))

_entry("E217", """
    A measured GEMM cannot run faster than the device's peak for its precision: 2·m·n·k FLOPs
    in the time given would need more FLOP/s than the device has. Either the peak is too low
    (`plandsl profile` writes the fastest GEMM it measured as the peak) or the time is wrong;
    an `efficiency` entry for a precision the device has no peak for is refused too, and so is a
    GEMM measured below 1 FLOP/s (a time past 2·m·n·k seconds), whose times the cost model
    could not keep finite.
    """, f"""
    device box {{
      memory     = 16 GiB
      bandwidth  = 20 GB/s
      peak       = {{ fp32: 100 GFLOP/s }}
      efficiency = {{ fp32: {{ measured: [[512, 512, 512, 3 ms], [1024, 1024, 1024, 2.4 ms]] }} }}
    }}
    node one {{
      devices = 2 x box
      link    = {{ bandwidth: 5 GB/s, latency: 20 us }}
    }}
    plan p {{
      model   = {GPT}
      cluster = one x 1
      mesh    = [dp = 2]
      train   = {{ global_batch: 16, micro_batch: 1, precision: fp32 }}
    }}
    """, "Correct the time (or the peak).", ("1024, 2.4 ms]", "1024, 24 ms]"))

_entry("E218", """
    Two options that both set the same thing. ZeRO-3's prefetch is either a count of units
    (`prefetch = 2`: the two units after the one computing are gathered while it computes, as
    FSDP's `set_modules_to_forward_prefetch` lists them) or a count of parameters
    (`prefetch_bucket = 5e7`: the following units until that many elements are on their way,
    DeepSpeed's `stage3_prefetch_bucket_size`), not both.
    """, f"""
    import "clusters/dgx_a100"
    plan p {{
      model   = {GPT}
      cluster = dgx_a100 x 1
      mesh    = [dp = 8]
      train   = {{ global_batch: 16, micro_batch: 1 }}
      data    = zero3 over dp with unit = module, prefetch = 2, prefetch_bucket = 5e7
    }}
    """, "Keep one of the two.", (", prefetch = 2", ""))

_entry("E209", """
    Files import each other in a circle (here a file imports itself), so neither can
    be loaded first. Every file on the cycle is listed. Shared definitions (devices,
    nodes, models) belong in a file that the others import and that imports none of
    them.
    """, f"""
    import "self.plan"
    import "clusters/dgx_a100"
    plan p {{
      model   = {GPT}
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
      model   = {GPT}
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
      model   = {GPT}
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
      model   = {GPT}
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
    model's `seq` tokens, or give the model more positions. A model from torch with a learned
    position embedding (GPT-2's `wpe`, OPT's `embed_positions`) holds its config's `n_positions`
    or `max_position_embeddings` (`plandsl inspect` records them) and is held to them the same way.
    """, """
    import "clusters/dgx_a100"
    plan p {
      model   = gpt(layers=12, hidden=768, heads=12, seq=1024, vocab=50304)
      cluster = dgx_a100 x 1
      mesh    = [dp = 8]
      train   = { global_batch: 64, micro_batch: 2, seq: 2048 }
    }
    """, "Train on the model's 1024 positions (or write seq=2048 in the model).", ("seq: 2048", "seq: 1024"))

_entry("E225", """
    `shared_experts` are the experts of a mixture-of-experts layer that every token runs
    through besides the `top_k` its router picks (DeepSeekMoE, Dai et al. 2024; DeepSeek-V2
    and V3, Qwen-MoE): a model without `experts` has no such layer to add them to. For a
    dense model, widen `ffn` instead.
    """, """
    import "clusters/dgx_a100"
    plan p {
      model   = llama(layers=8, hidden=1024, heads=16, seq=2048, vocab=32000, shared_experts=2)
      cluster = dgx_a100 x 1
      mesh    = [dp = 8]
      train   = { global_batch: 64, micro_batch: 2 }
    }
    """, "Add the routed experts the shared ones sit beside.", ("shared_experts=2", "experts=8, shared_experts=2"))

_entry("E226", """
    Multi-head latent attention (MLA, DeepSeek-V2 and V3: DeepSeek-AI 2024, arXiv:2405.04434 and
    arXiv:2412.19437) is on when `kv_lora_rank` gives the width of the key/value latent; its other
    arguments (`q_lora_rank`, `qk_rope_head_dim`, `qk_nope_head_dim`, `v_head_dim`) shape it and mean
    nothing without it. Add `kv_lora_rank`, or drop them for grouped-query attention. The other
    way round, `head_dim` is grouped-query attention's width per head: under MLA a head is
    `qk_nope_head_dim + qk_rope_head_dim` wide (`v_head_dim` for values), so `head_dim` is refused there.
    """, """
    import "clusters/dgx_a100"
    plan p {
      model   = llama(layers=8, hidden=1024, heads=16, seq=2048, vocab=32000, q_lora_rank=256)
      cluster = dgx_a100 x 1
      mesh    = [dp = 8]
      train   = { global_batch: 64, micro_batch: 2 }
    }
    """, "Give the key/value latent that turns MLA on.", ("q_lora_rank=256", "q_lora_rank=256, kv_lora_rank=128"))

_entry("E227", """
    Under multi-head latent attention every head up-projects its own keys and values from one
    shared latent (`wkv_b`), so there are exactly as many key/value heads as heads: grouped
    queries have nothing to share. MLA's saving on keys and values is the latent itself
    (`kv_lora_rank`). Drop `kv_heads`, or set it to `heads`.
    """, """
    import "clusters/dgx_a100"
    plan p {
      model   = llama(layers=8, hidden=1024, heads=16, kv_heads=4, seq=2048, vocab=32000, kv_lora_rank=128)
      cluster = dgx_a100 x 1
      mesh    = [dp = 8]
      train   = { global_batch: 64, micro_batch: 2 }
    }
    """, "One key/value head per head.", ("kv_heads=4", "kv_heads=16"))

_entry("E228", """
    `dense_layers=N` makes the first N blocks of a mixture-of-experts model dense (DeepSeek-V3
    keeps 3 of its 61 dense: its `first_k_dense_replace`); N must leave at least one block a
    mixture of experts, and so must `moe_every` and `moe_offset` after them. For a model that is
    dense throughout, drop `experts` instead.
    """, """
    import "clusters/dgx_a100"
    plan p {
      model   = llama(layers=8, hidden=1024, heads=16, seq=2048, vocab=32000, experts=8, dense_layers=8)
      cluster = dgx_a100 x 1
      mesh    = [dp = 8]
      train   = { global_batch: 64, micro_batch: 2 }
    }
    """, "Keep some blocks a mixture of experts.", ("dense_layers=8", "dense_layers=2"))

_entry("E229", """
    `dense_layers`, `moe_every` and `dense_ffn` shape the dense blocks that come before or between
    the mixture-of-experts blocks of a model with `experts`; a dense model's blocks are all dense
    already (their width is `ffn`), and `dense_ffn` without `dense_layers` or `moe_every` makes no
    block dense.
    """, """
    import "clusters/dgx_a100"
    plan p {
      model   = llama(layers=8, hidden=1024, heads=16, seq=2048, vocab=32000, dense_layers=2, dense_ffn=4096)
      cluster = dgx_a100 x 1
      mesh    = [dp = 8]
      train   = { global_batch: 64, micro_batch: 2 }
    }
    """, "Add the experts the dense layers come before.", ("dense_layers=2", "experts=8, dense_layers=2"))

_entry("E230", """
    `moe_every=K` makes every K-th block a mixture of experts and the others dense: block i is one
    where `i % K == moe_offset`. The offset is therefore 0 to K - 1: `K - 1` (the default, the last
    block of every K, as Hugging Face's Llama 4 `interleave_moe_layer_step` and Qwen2-MoE's
    `decoder_sparse_step` place them) or `0` (the first, as Megatron-LM's `--moe-layer-freq K`).
    """, """
    import "clusters/dgx_a100"
    plan p {
      model   = llama(layers=8, hidden=1024, heads=16, seq=2048, vocab=32000, experts=8, moe_every=2, moe_offset=2)
      cluster = dgx_a100 x 1
      mesh    = [dp = 8]
      train   = { global_batch: 64, micro_batch: 2 }
    }
    """, "An offset within the period.", ("moe_offset=2", "moe_offset=1"))

_entry("E231", """
    `full_every=K` says which blocks of a sliding-window model attend the whole causal sequence:
    every K-th one (Gemma 2 and GPT-OSS: 2, Gemma 3: 6), the others only `window` keys. A model
    without `window` has no windowed block for the pattern to interleave with.
    """, """
    import "clusters/dgx_a100"
    plan p {
      model   = llama(layers=8, hidden=1024, heads=16, seq=2048, vocab=32000, full_every=2)
      cluster = dgx_a100 x 1
      mesh    = [dp = 8]
      train   = { global_batch: 64, micro_batch: 2 }
    }
    """, "Give the windowed blocks their window.", ("full_every=2", "window=512, full_every=2"))

_entry("E232", """
    With `window`, block i attends the whole causal sequence when i % full_every == full_every - 1
    (Megatron-Core's `window_attn_skip_freq`, Hugging Face's `sliding_window_pattern`): `full_every=1`
    makes every block full, so the window bands none, and a `full_every` above `layers` makes none
    full. Write the pattern that has both, or say what is meant: no `window` for full attention
    everywhere, no `full_every` for a window on every block (Mistral).
    """, """
    import "clusters/dgx_a100"
    plan p {
      model   = llama(layers=8, hidden=1024, heads=16, seq=2048, vocab=32000, window=512, full_every=1)
      cluster = dgx_a100 x 1
      mesh    = [dp = 8]
      train   = { global_batch: 64, micro_batch: 2 }
    }
    """, "Make every second block full, the others windowed.", ("full_every=1", "full_every=2"))

_entry("E233", """
    `mtp=N` adds N multi-token prediction depths (DeepSeek-V3; Megatron-LM's `--mtp-num-layers`):
    depth k embeds the tokens k ahead and joins them to the previous depth's hidden states. Megatron-Core
    builds it only over rotary (or no) position embeddings, a llama's; a gpt's learned absolute positions
    are not shifted with the tokens. Write the model as a llama to keep multi-token prediction.
    """, """
    import "clusters/dgx_a100"
    plan p {
      model   = gpt(layers=8, hidden=1024, heads=16, seq=2048, vocab=32000, mtp=1)
      cluster = dgx_a100 x 1
      mesh    = [dp = 8]
      train   = { global_batch: 64, micro_batch: 2 }
    }
    """, "Use rotary positions: a llama.", ("gpt(layers", "llama(layers"))

_entry("E234", """
    Multi-token prediction's depth k predicts the token k + 1 ahead of each position, and a sample
    holds the sequence and one token more, so with `mtp=N` the deepest depth needs a sequence of at
    least N + 1 tokens for any position to have a target; on a shorter one its loss averages over no
    token at all.
    """, """
    import "clusters/dgx_a100"
    plan p {
      model   = llama(layers=8, hidden=1024, heads=16, seq=4, vocab=32000, mtp=4)
      cluster = dgx_a100 x 1
      mesh    = [dp = 8]
      train   = { global_batch: 64, micro_batch: 2 }
    }
    """, "Predict fewer tokens ahead.", ("mtp=4", "mtp=3"))

_entry("E235", """
    Group-limited routing (`expert_groups=G, group_top_k=M`: DeepSeek-V2's device-limited and
    DeepSeek-V3's node-limited routing, Megatron-Core's `--moe-router-num-groups` and
    `--moe-router-group-topk`) splits the experts into G equal groups of consecutive ones, scores each
    group by the sum of its best `top_k // M` logits, and chooses each token's `top_k` experts inside
    its M best groups. So both numbers go together on a mixture of experts, G divides the experts, M
    is 1 to G and at most `top_k`, and M groups hold at least `top_k` experts.
    """, """
    import "clusters/dgx_a100"
    plan p {
      model   = llama(layers=8, hidden=1024, heads=16, seq=2048, vocab=32000, ffn=512, experts=16, top_k=4,
                      expert_groups=6, group_top_k=2)
      cluster = dgx_a100 x 1
      mesh    = [dp = 8]
      train   = { global_batch: 64, micro_batch: 2 }
    }
    """, "Divide the experts into equal groups.", ("expert_groups=6", "expert_groups=4"))
