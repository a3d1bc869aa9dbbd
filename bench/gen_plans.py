"""Generators of large plans for the benchmarks (written to a temp dir, never committed)."""
from __future__ import annotations


def big_custom_plan(layers: int = 10_000, nodes: int = 2048, pp: int = 32, tp: int = 8) -> str:
    """A custom model written out layer by layer, placed explicitly on `pp` stages."""
    dp = nodes * 8 // (pp * tp)
    lines = ['import "clusters/dgx_a100"', "", "model big {", "  seq = 2048"]
    lines.append("  layer embed { params = 50304 * 4096; flops = 0; activations = 8192; output = 4096 }")
    for i in range(layers):
        lines.append(f"  layer blocks.{i} {{ params = {12 * 4096 * 4096 + i}; flops = {24 * 4096 * 4096}; "
                     f"activations = {34 * 4096}; output = 4096 }}")
    lines.append("  layer head { params = 50304 * 4096; flops = 2 * 50304 * 4096; output = 50304 }")
    lines.append("}")
    per = layers // pp
    lines += ["", "plan big_plan {", "  model   = big", f"  cluster = dgx_a100 x {nodes}",
              f"  mesh    = [dp = {dp}, pp = {pp}, tp = {tp}]",
              "  train   = { global_batch: 4096, micro_batch: 1, precision: bf16, recompute: full }",
              "  data    = zero3 over dp", "  tensor  = megatron over tp with sequence_parallel", "  stages {"]
    for stage in range(pp):
        lo, hi = stage * per, (stage + 1) * per if stage < pp - 1 else layers
        extra = "embed, " if stage == 0 else ""
        tail = ", head" if stage == pp - 1 else ""
        lines.append(f"    {stage}: {extra}blocks[{lo}:{hi}]{tail}")
    lines += ["  }", "}", ""]
    return "\n".join(lines)


def big_gpt_plan(layers: int = 10_000, nodes: int = 2048) -> str:
    return f"""import "clusters/dgx_a100"

plan huge {{
  model   = gpt(layers={layers}, hidden=4096, heads=32, seq=2048, vocab=50304)
  cluster = dgx_a100 x {nodes}
  mesh    = [dp = {nodes * 8 // 256}, pp = 32, tp = 8]
  train   = {{ global_batch: 4096, micro_batch: 1, precision: bf16, recompute: full }}
  data    = zero3 over dp
  tensor  = megatron over tp with sequence_parallel
  stages  = evenly over pp
}}
"""


def big_gpt_explicit_plan(layers: int = 10_000, nodes: int = 2048, pp: int = 32) -> str:
    """gpt(layers=...) placed by an explicit stages block on a 16,384-device mesh."""
    per = layers // pp
    entries = []
    for stage in range(pp):
        lo, hi = stage * per, (stage + 1) * per if stage < pp - 1 else layers
        head = "embed, " if stage == 0 else ""
        tail = ", norm, head" if stage == pp - 1 else ""
        entries.append(f"    {stage}: {head}layers[{lo}:{hi}]{tail}")
    body = "\n".join(entries)
    return f"""import "clusters/dgx_a100"

plan huge {{
  model   = gpt(layers={layers}, hidden=4096, heads=32, seq=2048, vocab=50304)
  cluster = dgx_a100 x {nodes}
  mesh    = [dp = {nodes * 8 // (pp * 8)}, pp = {pp}, tp = 8]
  train   = {{ global_batch: 4096, micro_batch: 1, precision: bf16, recompute: full }}
  data    = zero3 over dp
  tensor  = megatron over tp with sequence_parallel
  stages {{
{body}
  }}
  shard layers[0:8].mlp.* = {{ weight: Shard(0) @ tp }}
}}
"""


def grouped_custom_plan(layers: int = 10_000, groups: int = 100, nodes: int = 2048, pp: int = 32) -> str:
    """A custom model of `layers` layers declared in `groups` range declarations."""
    text = big_custom_plan(layers=0, nodes=nodes, pp=pp)
    per = layers // groups
    decls = "\n".join(f"  layer blocks[{g * per}:{(g + 1) * per}] {{ params = {12 * 4096 * 4096 + g}; "
                      f"flops = {24 * 4096 * 4096}; activations = {34 * 4096}; output = 4096 }}"
                      for g in range(groups))
    text = text.replace("  layer head", decls + "\n  layer head")
    stage_per = layers // pp
    lines = []
    for stage in range(pp):
        lo, hi = stage * stage_per, (stage + 1) * stage_per if stage < pp - 1 else layers
        lines.append(f"    {stage}: {'embed, ' if stage == 0 else ''}blocks[{lo}:{hi}]{', head' if stage == pp - 1 else ''}")
    start = text.index("  stages {") + len("  stages {\n")
    end = text.index("  }\n}", start)
    return text[:start] + "\n".join(lines) + "\n" + text[end:]
