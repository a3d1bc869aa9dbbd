"""E8xx: what `plandsl generate --from` cannot keep of a partial plan and what `plandsl shrink`
cannot scale down.

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
