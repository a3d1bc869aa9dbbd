"""E3xx: clusters and meshes, the device mesh against the cluster it runs on.

Each `_entry(...)` is one code: why the rule exists, a failing example and the fix; see
`plandsl.diagnostics.catalogue.entry` for the form."""
from __future__ import annotations

from plandsl.diagnostics.catalogue.entry import GPT, Family

FAMILY = Family("E3")
_entry = FAMILY.add


_entry("E301", """
    The device mesh is the grid every rank gets a coordinate in; its axis sizes
    multiply to the number of ranks. A mesh that needs more devices than the cluster
    has cannot be launched: some coordinates would have no GPU.
    """, f"""
    import "clusters/dgx_a100"
    plan p {{
      model   = {GPT}
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
      model   = {GPT}
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
      model   = {GPT}
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
      model   = {GPT}
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
      model   = {GPT}
      cluster = dgx_a100 x 1
      mesh    = [dp = 8, pp = 0]
      train   = {{ global_batch: 16, micro_batch: 1 }}
    }}
    """, "Leave the pipeline axis out (or give it size 1).", ("dp = 8, pp = 0", "dp = 8"))

_entry("E306", """
    A mesh axis larger than 1 that no parallelism uses, or a parallelism that does not
    say which axis it runs over. An unused axis multiplies the device count while every
    rank along it does identical work on identical data: pure waste. Axes named
    dp/tp/pp/cp/ep get their conventional use by default; other names need e.g.
    `data = zero1 over <axis>`. The hint's change is checked before it is offered: for
    `data = zero1` without `over`, the axes that leave none unused (`over [dp, x]`).
    """, f"""
    import "clusters/dgx_a100"
    plan p {{
      model   = {GPT}
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
      model   = {GPT}
      cluster = dgx_a100 x 1
      mesh    = [dp = 2, pp = 2, tp = 2]
      train   = {{ global_batch: 16, micro_batch: 1 }}
      tensor  = megatron over tp
      stages  = evenly over tp
    }}
    """, "Give the pipeline its own axis: here `pp`, which nothing uses yet.",
    ("stages  = evenly over tp", "stages  = evenly over pp"))
