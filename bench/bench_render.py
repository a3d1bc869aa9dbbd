"""Benchmark: writing DOT text for large pictures, and graphviz's own time to lay them out.

    python bench/bench_render.py            # Markdown table
    python bench/bench_render.py --no-dot   # DOT generation only (no graphviz needed)

Each figure is the best of a few runs (seconds). Targets (issue: render): DOT text for a
4,096-device mesh and for a 64-rank x 256-microbatch schedule in under 2 s each, graphviz
excluded (the schedule's DOT is timed apart from its simulation, which `simulate` owns). The
graphviz columns run the view's engine (`neato -n2` or `dot`) to SVG and PNG.
"""
from __future__ import annotations

import sys
from pathlib import Path

from plandsl import api
from plandsl.render import engine, render
from plandsl.render.output import graphviz_available, to_image
from plandsl.render.schedule import draw_schedule, simulated
from timing import best  # bench/ is on sys.path when the script runs

ROOT = Path(__file__).resolve().parent.parent
MESH_4096 = """\
import "clusters/dgx_h100"
model big = gpt(layers=64, hidden=4096, heads=32, seq=2048, vocab=50304)
plan mesh_4096 {
  model    = big
  cluster  = dgx_h100 x 512
  mesh     = [dp = 64, pp = 8, tp = 8]
  train    = { global_batch: 512, micro_batch: 1, precision: bf16, recompute: full }
  data     = zero1 over dp
  tensor   = megatron over tp with sequence_parallel
  stages   = evenly over pp
  schedule = 1f1b
}
"""
PIPELINE_64x256 = """\
import "clusters/dgx_h100"
model deep = gpt(layers=128, hidden=2048, heads=16, seq=1024, vocab=50304)
plan pipeline_64x256 {
  model    = deep
  cluster  = dgx_h100 x 8
  mesh     = [pp = 64]
  train    = { global_batch: 256, micro_batch: 1, precision: bf16, recompute: full }
  stages   = evenly over pp
  schedule = 1f1b
}
"""


def row(name: str, view: str, plan, make_dot, with_graphviz: bool, pad: int = 0) -> str:
    dot_s, text = best(make_dot)
    cells = [name, view, f"{dot_s:.3f}", f"{len(text) / 1e3:,.0f}"] + [""] * pad
    if with_graphviz:
        svg_s, svg = best(lambda: to_image(text, "svg", engine(view)), repeat=1)
        png_s, png = best(lambda: to_image(text, "png", engine(view)), repeat=1)
        cells += [" ".join(engine(view)), f"{svg_s:.3f}", f"{len(svg) / 1e3:,.0f}", f"{png_s:.3f}",
                  f"{len(png) / 1e3:,.0f}"]
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    with_graphviz = "--no-dot" not in sys.argv and graphviz_available()
    head = ["plan", "view", "DOT s", "DOT kB"]
    if with_graphviz:
        head += ["graphviz", "SVG s", "SVG kB", "PNG s", "PNG kB"]
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" if name in ("plan", "view", "graphviz") else "---:" for name in head) + "|")
    mesh = api.loads(MESH_4096).plans[0]
    print(row("4,096-device mesh", "mesh", mesh, lambda: render(mesh, "mesh"), with_graphviz), flush=True)
    pipeline = api.loads(PIPELINE_64x256).plans[0]
    schedule, simulation, p2p = simulated(pipeline)
    print(row("64 ranks x 256 microbatches (1f1b)", "schedule", pipeline,
              lambda: draw_schedule(schedule, simulation, p2p, title=f"plan {pipeline.name}"), with_graphviz),
          flush=True)
    print(row("64 ranks x 256 microbatches, with simulation", "schedule", pipeline,
              lambda: render(pipeline, "schedule"), False, pad=5 if with_graphviz else 0), flush=True)
    print(row("64 ranks x 256 microbatches (1f1b)", "memory", pipeline, lambda: render(pipeline, "memory"),
              with_graphviz), flush=True)
    for example, view in (("gpt3_175b_3d", "schedule"), ("gpt3_175b_3d", "placement"), ("gpt3_175b_3d", "mesh"),
                          ("zero_bubble_v", "schedule"), ("zero_bubble_v", "memory")):
        plan = api.load_plan(ROOT / "stdlib_plans" / "examples" / f"{example}.plan")
        print(row(example, view, plan, lambda: render(plan, view), with_graphviz), flush=True)


if __name__ == "__main__":
    main()
