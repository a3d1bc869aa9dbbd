"""E4xx: placement and sharding, layers onto pipeline stages and tensors onto mesh axes.

Each `_entry(...)` is one code: why the rule exists, a failing example and the fix; see
`plandsl.diagnostics.catalogue.entry` for the form."""
from __future__ import annotations

from plandsl.diagnostics.catalogue.entry import GPT, Family

FAMILY = Family("E4")
_entry = FAMILY.add


_entry("E401", """
    A `stages` block puts one layer on two pipeline stages. A layer's weights live on
    exactly one stage: placing it twice would either run it twice per microbatch or
    keep two diverging copies.
    """, f"""
    import "clusters/dgx_a100"
    plan p {{
      model   = {GPT}
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
      model   = {GPT}
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
      model   = {GPT}
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
      model   = {GPT}
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
      model   = {GPT}
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
      model   = {GPT}
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
      model   = {GPT}
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
      model    = {GPT}
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
      model   = {GPT}
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
      model   = {GPT}
      cluster = dgx_a100 x 1
      mesh    = [dp = 2, ep = 4]
      train   = {{ global_batch: 16, micro_batch: 1 }}
      experts = alltoall over ep
    }}
    """, "Use a model with experts (`llama(..., experts=8)`), or use the axis for something else.",
       ("ep = 4", "tp = 4"), ("experts = alltoall over ep", "tensor  = megatron over tp"))
