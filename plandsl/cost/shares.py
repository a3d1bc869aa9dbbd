"""Microbatches dealt to data-parallel replicas so that their predicted times come out even.

Stage: cost model (`cost.estimate.data_shares` resolves `batch_shares: speed` with it). Contract:
`balance(total, lines, least)` gives each replica a whole number of microbatches, at least `least`,
summing to `total`, that minimises the slowest replica's time when replica r takes `a_r + b_r * m`
seconds for m microbatches (a pipeline's makespan is affine in m: the fill and drain, then one
microbatch per slowest-stage time). The continuous optimum sets every time equal (a replica it would give less than the least is held
at the least, and the rest balanced again); it is rounded down, then units go one at a time to the replica that
ends soonest with one more, which is exact for affine times.
"""
from __future__ import annotations

import heapq
import math


def balance(total: int, lines: list[tuple[float, float]], least: int = 1) -> list[int]:
    """Microbatches per replica (see the module docstring); `lines[r] = (a_r, b_r)`, b_r > 0."""
    count = len(lines)
    least = least if total >= least * count else 1
    slopes = [max(b, 1e-30) for _, b in lines]
    # every replica above `least` at the same time T: sum((T - a) / b) = what the held ones leave; a replica
    # that would get less than `least` at T is held at it and T found again (T only falls, so it ends within
    # `count` rounds; rounding it down then leaves at most one unit per replica to deal)
    held: set[int] = set()
    while True:
        free = [r for r in range(count) if r not in held]
        level = (total - least * len(held) + sum(lines[r][0] / slopes[r] for r in free)) \
            / sum(1 / slopes[r] for r in free)
        under = {r for r in free if (level - lines[r][0]) / slopes[r] < least}
        if not under or len(under) == len(free):
            break
        held |= under
    counts = [least if r in held else min(total, max(least, math.floor((level - lines[r][0]) / slopes[r])))
              for r in range(count)]

    def time(r: int, m: int) -> float:
        return lines[r][0] + slopes[r] * m

    # what rounding left over (float error only): taken from the replica that ends last
    last = [(-time(r, counts[r]), r) for r in range(count) if counts[r] > least]
    heapq.heapify(last)
    for _ in range(max(0, sum(counts) - total)):
        _, r = heapq.heappop(last)
        counts[r] -= 1
        if counts[r] > least:
            heapq.heappush(last, (-time(r, counts[r]), r))
    heap = [(time(r, counts[r] + 1), r) for r in range(count)]
    heapq.heapify(heap)
    for _ in range(total - sum(counts)):  # the rest, one at a time, to whoever ends soonest with it
        _, r = heapq.heappop(heap)
        counts[r] += 1
        heapq.heappush(heap, (time(r, counts[r] + 1), r))
    return counts


__all__ = ["balance"]
