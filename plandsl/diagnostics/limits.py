"""Caps on every count a user writes, so that work follows what was written, not the numbers in it.

Each is far beyond today's largest runs; past one, the checker answers E505 at the number (a
command-line option: exit 2 naming the option). The table is docs/language.md's "Limits";
tests/unit/test_hostile_sizes.py writes a number past each cap in every field.
"""
from __future__ import annotations

# Imports nothing: the CLI reads it for its options' ranges before any heavy module is loaded.
MAX_NODES = 131_072             # nodes of a cluster
MAX_MESH_DEVICES = 1_048_576    # devices of a mesh
MAX_STAGES = 100_000            # pipeline stages, pipeline ranks (`schedule --ranks`)
MAX_ACTIONS = 500_000
"""Compute actions a schedule table is laid out with, to print, simulate or validate it (E609).
Checking and estimating a built-in schedule lay out none (`schedules.bounded`)."""
MAX_GRID_CELLS = 4 * MAX_ACTIONS
"""Cells (ranks x unit-time steps, idle ones included) of a schedule's step x rank grid, which `schedule` prints, torch's
CSV and a table schedule write, and `import --from torch-csv` writes as a table (E609): a table of MAX_ACTIONS actions
with a bubble three times its work fits. A grid is not bounded by its actions: n ranks with one forward and one
backward each, in a chain, are n x 2n cells (a 26 KB CSV of 2,000 such rows wrote a 42 MB table in 8.5 s; `schedule
gpipe --ranks 3000 --microbatches 1` took 7 s and 570 MB, 100,000 ranks more memory than a machine has). Below the cap
a table is bounded by a plan's MAX_BYTES: 400 such rows, 320,000 cells, a 5 KB CSV, are a 1.4 MB table that takes 6 s
of CPU to format and check (the parser's pace, two parses)."""
MAX_GLOBAL_BATCH = 2**32        # sequences per step (GPT-3 used 3.2M tokens = 1,536 sequences)
MAX_MICRO_BATCH = 2**20         # sequences per microbatch
MAX_SEQ = 2**24                 # tokens per sequence (16M; the longest contexts trained are ~1M)
MAX_VIRTUAL = 1024              # stages per pipeline rank
MAX_PREFETCH = 1024             # units ZeRO-3 gathers ahead (`data = zero3 ... with prefetch`)
MAX_PREFETCH_BUCKET = 10**15    # parameters ZeRO-3 gathers ahead (`with prefetch_bucket`; a 1T model has 10^12)
MAX_LAYERS = 100_000            # blocks of a model family, layers of a written model
MAX_MTP = 1024                  # multi-token prediction depths of a model family (DeepSeek-V3 trains 1)
MAX_WIDTH = 2**20               # hidden, ffn, input and output widths of a model family
MAX_HEADS = 2**16               # attention heads and kv heads
MAX_VOCAB = 2**24               # vocabulary entries
MAX_EXPERTS = 2**16             # experts and top_k
MAX_STEPS = 10**9               # warm-up steps, `run --steps`
MAX_TIMEOUT_SECONDS = 604_800.0  # `run --timeout`: a week a collective may wait (torch's default is 10 minutes)
MAX_SEED = 2**64 - 1            # `seed`: torch's generators take an unsigned 64-bit seed
MAX_LR = 1e4                    # `lr`: torch converts it to the update's dtype (fp32 in run): Adam's step raises past ~5e37
MAX_MODULE_PARAMETERS = 200_000
"""Parameter tensors a model from torch (`hf(...)`, a factory) may register while `inspect` (or `run`) builds it:
DeepSeek-V3 with its 256 experts a layer unfused registers about 48,000; the cap keeps a config's layer count (5,000
GPT-2 blocks, 60,000 tensors, took 24 s and 770 MB to build on the meta device) from making the build unbounded."""
MAX_MICROBATCHES = MAX_GLOBAL_BATCH  # `schedule --microbatches`: a microbatch holds at least one sequence
MAX_LOCAL_RANKS = 256
"""Processes `run --nproc-per-node` starts on one machine: a node holds 8 to 16 accelerators today; 256 leaves
room for many CPU (gloo) ranks, not for a typo that forks thousands."""
MAX_PROFILE_NODES = 64
"""Nodes `plandsl profile --nnodes` measures together: two already give the links between nodes."""
MAX_SUSTAIN_SECONDS = 600.0
"""Seconds `plandsl profile --sustain` holds the device busy before its sustained timings: a GPU reaches its
power-limited steady state in tens of seconds; ten minutes is far past it."""
MAX_SMS = 65_536                # a device's `sms` (streaming multiprocessors; a B200 has 148)
MAX_NODE_CPUS = 65_536
"""CPUs a node asks for, `launch --cpu`: the largest machines hold a few thousand; past this (10^30) the number went
into the sbatch script and each rank's OMP_NUM_THREADS as written."""
MAX_NODE_MEMORY_MB = 2**30
"""Host memory a node asks for, `launch --mem-mb` (1 PiB; the largest machines hold tens of TB)."""

MODEL_ARGUMENTS = {"layers": MAX_LAYERS, "hidden": MAX_WIDTH, "ffn": MAX_WIDTH, "input": MAX_WIDTH,
                   "output": MAX_WIDTH, "heads": MAX_HEADS, "kv_heads": MAX_HEADS, "seq": MAX_SEQ,
                   "vocab": MAX_VOCAB, "head_dim": MAX_WIDTH, "experts": MAX_EXPERTS, "top_k": MAX_EXPERTS,
                   "shared_experts": MAX_EXPERTS, "expert_groups": MAX_EXPERTS, "group_top_k": MAX_EXPERTS,
                   "q_lora_rank": MAX_WIDTH, "kv_lora_rank": MAX_WIDTH,
                   "qk_rope_head_dim": MAX_WIDTH, "qk_nope_head_dim": MAX_WIDTH, "v_head_dim": MAX_WIDTH,
                   "dense_layers": MAX_LAYERS, "dense_ffn": MAX_WIDTH,
                   "moe_every": MAX_LAYERS, "moe_offset": MAX_LAYERS, "window": MAX_SEQ, "full_every": MAX_LAYERS,
                   "mtp": MAX_MTP}
TRAIN = {"global_batch": MAX_GLOBAL_BATCH, "micro_batch": MAX_MICRO_BATCH, "seq": MAX_SEQ, "recompute_layers": MAX_LAYERS, "offload_layers": MAX_LAYERS,
         "bf16_first_layers": MAX_LAYERS, "bf16_last_layers": MAX_LAYERS, "warmup_steps": MAX_STEPS, "seed": MAX_SEED}

__all__ = ["MAX_ACTIONS", "MAX_GRID_CELLS", "MAX_NODE_CPUS", "MAX_NODE_MEMORY_MB", "MAX_EXPERTS", "MAX_GLOBAL_BATCH", "MAX_HEADS", "MAX_LAYERS", "MAX_LOCAL_RANKS", "MAX_LR",
           "MAX_MESH_DEVICES", "MAX_MTP",
           "MAX_MICROBATCHES", "MAX_MICRO_BATCH", "MAX_NODES", "MAX_PROFILE_NODES", "MAX_SEQ", "MAX_SEED", "MAX_SMS", "MAX_SUSTAIN_SECONDS", "MAX_STAGES", "MAX_STEPS", "MAX_TIMEOUT_SECONDS", "MAX_VIRTUAL",
           "MAX_VOCAB", "MAX_WIDTH", "MODEL_ARGUMENTS", "TRAIN"]
GENERATE_SECONDS = 6.0
"""`generate --time-limit`'s default (CPU seconds of the search): it stops there with the fastest plans it simulated (marked as not
proven the fastest), so `generate` answers any input within seconds; 0 searches to the end."""
MAX_GENERATE_SECONDS = 86_400.0
