"""Benchmark: generating, lowering and simulating pipeline schedules, over ranks x microbatches.

    python bench/bench_schedules.py                 # Markdown table
    python bench/bench_schedules.py --quick         # smaller sweep

Each figure is the best of a few runs (seconds). The target (issue: schedules) is simulating
64 ranks x 1,024 microbatches x 2 stages per rank (~262k actions) in well under 2 s. When
`plandsl.schedules.generators` is not there yet, a looped breadth-first schedule built here
stands in for the generated one (its generate column then reads "-").
"""
from __future__ import annotations

import sys
import time

from plandsl.schedules.lower import add_send_recv
from plandsl.schedules.program import Action, Kind, Schedule, loop_map
from plandsl.schedules.simulate import simulate

try:
    from plandsl.schedules.generators import generate
except ImportError:  # another engineer's module, not written yet
    generate = None


def best(function, repeat: int = 3) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeat):
        start = time.perf_counter()
        result = function()
        times.append(time.perf_counter() - start)
    return min(times), result


def looped_bfs(ranks: int, microbatches: int, virtual: int) -> Schedule:
    """Every rank: all forwards of its stages in order, then all backwards in reverse."""
    stages = ranks * virtual
    rows = []
    for r in range(ranks):
        mine = list(range(r, stages, ranks))
        rows.append(tuple(Action(s, Kind.F, i) for s in mine for i in range(microbatches))
                    + tuple(Action(s, Kind.B, i) for s in reversed(mine) for i in range(microbatches)))
    return Schedule("looped_bfs", ranks, stages, microbatches, (loop_map(ranks, stages),), tuple(rows))


def row(name: str, ranks: int, microbatches: int, virtual: int | None) -> str:
    if generate is not None:
        make = lambda: generate(name, ranks, microbatches, virtual)  # noqa: E731
        generate_s, schedule = best(make)
        generated = f"{generate_s:.3f}"
    else:
        schedule, generated = looped_bfs(ranks, microbatches, virtual or 1), "-"
    lower_s, lowered = best(lambda: add_send_recv(schedule))
    simulate_s, result = best(lambda: simulate(schedule))
    lowered_s, _ = best(lambda: simulate(lowered))
    return (f"| {schedule.name} | {ranks} | {microbatches} | {schedule.virtual} | {schedule.num_actions:,} "
            f"| {generated} | {lower_s:.3f} | {simulate_s:.3f} | {lowered_s:.3f} "
            f"| {result.bubble_fraction:.3f} |")


def main() -> None:
    quick = "--quick" in sys.argv
    sweep = [(8, 64), (16, 256), (64, 1024)] if not quick else [(8, 64), (16, 256)]
    names = [("1f1b", None), ("interleaved_1f1b", 2), ("zbv", 2)] if generate else [("looped_bfs", 2)]
    print("| schedule | ranks | microbatches | virtual | actions | generate s | add_send_recv s "
          "| simulate s | simulate lowered s | bubble |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, virtual in names:
        for ranks, microbatches in sweep:
            print(row(name, ranks, microbatches, virtual), flush=True)


if __name__ == "__main__":
    main()
