"""Benchmark: work proportional to what was written, not to the numbers in it (issue 16).

    python bench/bench_bounds.py            # prints Markdown tables for docs/benchmarks.md

Targets: `check` of a 4M-microbatch plan < 1 s; a 1,000-link `let` chain < 1 s (10,000 links: no E106); `generate` on
any input < 10 s. Each in-process figure is the best of a few runs, beside a peer in the same
process (the same plan at 64 microbatches; a 10-link chain), so the ratio says what the numbers
cost. The shell figures include Python's start-up and the imports (~0.4 s here).
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from timing import best  # noqa: E402

from plandsl.check.analysis import analyze  # noqa: E402
from plandsl.cost.estimate import estimate_plan  # noqa: E402
from plandsl.diagnostics.source import SourceFile  # noqa: E402
from plandsl.syntax.parser import parse_source  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = (ROOT / "stdlib_plans/examples/gpt3_175b_3d.plan").read_text()
DP_TIMES_MICRO = 16  # the example's dp 16 x micro_batch 1


def plan(microbatches: int, schedule: str = "interleaved_1f1b") -> str:
    text = EXAMPLE.replace("global_batch: 1536", f"global_batch: {microbatches * DP_TIMES_MICRO}")
    if schedule != "interleaved_1f1b":
        text = text.replace("schedule = interleaved_1f1b", f"schedule = {schedule}")
        text = text.replace("evenly over pp with virtual = 2", "evenly over pp")
    return text


def let_chain(links: int) -> str:
    lets = "let a0 = 1\n" + "".join(f"let a{i} = a{i - 1} + a{i - 1}\n" for i in range(1, links + 1))
    return lets + EXAMPLE.replace("[dp = 16,", f"[dp = a{links} / a{links - 4},")


def in_process() -> list[tuple[str, float, float, str]]:
    rows = []
    for schedule in ("interleaved_1f1b", "1f1b", "zb_h1"):
        big, small = plan(4 * 2**20, schedule), plan(64, schedule)
        analyze(text=small)  # warm: the parser is built once per process
        check_big = best(lambda: analyze(text=big), 3)[0]
        check_small = best(lambda: analyze(text=small), 3)[0]
        rows.append((f"check, gpt3 175B, {schedule}, 4,194,304 microbatches (peer: 64)", check_big, check_small,
                     ", ".join(sorted({d.code for d in analyze(text=big).diagnostics})) or "-"))
        plan_big, plan_small = analyze(text=big).document.plans[0], analyze(text=small).document.plans[0]
        est_big = best(lambda: estimate_plan(plan_big), 3)[0]
        est_small = best(lambda: estimate_plan(plan_small), 3)[0]
        rows.append(("estimate, same plan, 4,194,304 microbatches (peer: 64)", est_big, est_small, "-"))
    short = let_chain(10)
    short_s = best(lambda: analyze(text=short), 3)[0]
    for links in (1_000, 10_000):
        chain = let_chain(links)
        source = SourceFile("<chain>", chain)
        check_s = best(lambda: analyze(text=chain), 3)[0]
        parse_s = best(lambda: parse_source(source), 3)[0]
        rows.append((f"check, a {links:,}-link `let a(i) = a(i-1) + a(i-1)` chain (peer: 10 links)", check_s,
                     short_s, ", ".join(sorted({d.code for d in analyze(text=chain).diagnostics})) or "-"))
        rows.append(("the same less its parse (peer: the same, 10 links)", check_s - parse_s, short_s, "-"))
    return rows


def search_parts() -> list[tuple[str, float, float, str]]:
    """The search's per-layer parts on a 100,000-layer model: the partition of identical blocks over
    stages (closed form; peer: the greedy it replaces, one block at a time) and the layer catalogue."""
    from plandsl.ir import layers
    from plandsl.search import partition
    rows = []
    for stages in (512, 4096):
        fixed, per_block = [0.5] + [0.0] * (stages - 2) + [0.9], [0.01] * stages
        closed = best(lambda: partition.partition_blocks(100_000, fixed, per_block), 3)[0]
        saved, partition.GREEDY_STEPS = partition.GREEDY_STEPS, 10**9
        try:
            greedy = best(lambda: partition.partition_blocks(100_000, fixed, per_block), 3)[0]
        finally:
            partition.GREEDY_STEPS = saved
        rows.append((f"partition of 100,000 identical blocks over {stages:,} stages (peer: the greedy)", closed,
                     greedy, "-"))
    from plandsl.search.emit import resolve_problem
    model = resolve_problem("gpt(layers=100000, hidden=4096, heads=32, seq=2048, vocab=51200)", "dgx_a100 x 1",
                            8)[0].model
    small = resolve_problem("gpt(layers=1000, hidden=4096, heads=32, seq=2048, vocab=51200)", "dgx_a100 x 1",
                            8)[0].model
    rows.append(("layer catalogue (`layers_of`) of a 100,000-layer gpt (peer: 1,000 layers)",
                 best(lambda: layers._transformer_layers(model), 1)[0],
                 best(lambda: layers._transformer_layers(small), 3)[0], "-"))
    return rows


def shell(args: list[str], limit: float = 120) -> tuple[float, float, int | str, str]:
    """(wall s, CPU s of the child, exit status, the first line; for `generate`, whether the search stopped)."""
    start, before = time.perf_counter(), os.times()
    try:
        result = subprocess.run([sys.executable, "-m", "plandsl.cli", *args], capture_output=True, text=True,
                                timeout=limit, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return time.perf_counter() - start, math.nan, "killed", f"still running after {limit:.0f} s"
    elapsed, after = time.perf_counter() - start, os.times()
    cpu = (after.children_user - before.children_user) + (after.children_system - before.children_system)
    output = (result.stdout + result.stderr).strip().splitlines()
    first = next((line for line in output if line.strip()), "")
    if "stopped at its time limit" in result.stdout:
        first = "(stopped at the time limit) " + first
    return elapsed, cpu, result.returncode, first[:110]


SHELL = [
    ["--help"],
    ["schedule", "1f1b", "--ranks", "4", "--microbatches", "1000000000"],
    ["schedule", "1f1b", "--ranks", "1000000000", "--microbatches", "4"],
    ["schedule", "interleaved_1f1b", "--ranks", "8", "--microbatches", "64", "--virtual", "2"],
    ["generate", "--model", "gpt3_175b", "--cluster", "dgx_a100 x 1", "--global-batch", "1000000000000000000"],
    ["generate", "--model", "gpt3_175b", "--cluster", "dgx_a100 x 1", "--global-batch", "4294967296"],
    ["generate", "--model", "gpt(layers=1000, hidden=91264, heads=713, seq=2048, vocab=51200)", "--cluster",
     "dgx_a100 x 1", "--global-batch", "1536"],
    ["generate", "--model", "gpt3_175b", "--cluster", "dgx_a100 x 128", "--global-batch", "1536"],
    ["generate", "--model", "gpt3_175b", "--cluster", "dgx_a100 x 128", "--global-batch", "1536", "--time-limit", "0"],
    ["generate", "--model", "gpt(layers=1000, hidden=1024, heads=16, seq=2048, vocab=51200)", "--cluster",
     "dgx_a100 x 256", "--global-batch", "1536"],
    ["generate", "--model", "gpt3_175b", "--cluster", "dgx_a100 x 131072", "--global-batch", "1536"],
    ["generate", "--model", "gpt(layers=100000, hidden=4096, heads=32, seq=2048, vocab=51200)", "--cluster",
     "dgx_a100 x 4096", "--global-batch", "1536"],
]


def main() -> None:
    rows = in_process() + search_parts()
    print("| case | time (s) | peer (s) | ratio | diagnostics |")
    print("|---|---|---|---|---|")
    for name, time_s, peer, codes in rows:
        print(f"| {name} | {time_s:.3f} | {peer:.3f} | {time_s / peer:.2f} | {codes} |")
    print()
    print("| command (`plandsl ...`) | wall time (s) | CPU time (s) | exit | first line |")
    print("|---|---|---|---|---|")
    for args in SHELL:
        elapsed, cpu, code, first = shell(args)
        shown = " ".join(f'"{a}"' if " " in a else a for a in args)
        print(f"| `{shown}` | {elapsed:.2f} | {cpu:.2f} | {code} | {first.replace('|', '/')} |")
    print(f"\nmachine: {os.cpu_count()} cores, Python {sys.version.split()[0]}, load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
