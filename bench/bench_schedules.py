"""Benchmark: generating, validating, lowering and simulating pipeline schedules, over ranks x
microbatches.

    python bench/bench_schedules.py                 # Markdown table
    python bench/bench_schedules.py --quick         # smaller sweep

Each figure is the best of a few runs (seconds). The target (issue: schedules) is generating,
validating and simulating `interleaved_1f1b` with 64 ranks x 1,024 microbatches x 2 stages per
rank (~262k actions) in under 2 s; the `total` column is that path (validation reuses the
simulation for its deadlock check, as `plandsl check` does).
"""
from __future__ import annotations

import sys

from plandsl.schedules.generators import generate
from plandsl.schedules.lower import add_send_recv
from plandsl.schedules.simulate import simulate
from plandsl.schedules.validate import validate
from timing import best  # bench/ is on sys.path when the script runs


def total(name: str, ranks: int, microbatches: int, virtual: int | None) -> float:
    def run():
        schedule = generate(name, ranks, microbatches, virtual)
        result = simulate(schedule)
        assert not validate(schedule, simulation=result)
    return best(run)[0]


def row(name: str, ranks: int, microbatches: int, virtual: int | None) -> str:
    generate_s, schedule = best(lambda: generate(name, ranks, microbatches, virtual))
    simulate_s, result = best(lambda: simulate(schedule))
    validate_s, _ = best(lambda: validate(schedule, simulation=result))
    lower_s, lowered = best(lambda: add_send_recv(schedule))
    lowered_s, _ = best(lambda: simulate(lowered))
    return (f"| {schedule.name} | {ranks} | {microbatches} | {schedule.virtual} | {schedule.num_actions:,} "
            f"| {generate_s:.3f} | {validate_s:.3f} | {simulate_s:.3f} | "
            f"{total(name, ranks, microbatches, virtual):.3f} | {lower_s:.3f} | {lowered_s:.3f} "
            f"| {result.bubble_fraction:.3f} |")


def main() -> None:
    quick = "--quick" in sys.argv
    sweep = [(8, 64), (16, 256), (32, 512), (64, 1024)] if not quick else [(8, 64), (16, 256)]
    names = [("1f1b", None), ("interleaved_1f1b", 2), ("zbv", 2)]
    print("| schedule | ranks | microbatches | virtual | actions | generate s | validate s | simulate s "
          "| total s | add_send_recv s | simulate lowered s | bubble |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, virtual in names:
        for ranks, microbatches in sweep:
            print(row(name, ranks, microbatches, virtual), flush=True)


if __name__ == "__main__":
    main()
