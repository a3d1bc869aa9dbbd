"""Microbatches dealt to data-parallel replicas so that their predicted times come out even.

Stage: cost model (`cost.estimate.data_shares` resolves `batch_shares: speed` with it). Contract:
`balance(total, lines, least)` gives each replica a whole number of microbatches, at least `least`,
summing to `total`, that minimises the slowest replica's time when replica r takes `a_r + b_r * m`
seconds for m microbatches (a pipeline's makespan is affine in m: the fill and drain, then one
microbatch per slowest-stage time). The continuous optimum sets every time equal; it is rounded down,
then units go one at a time to the replica that ends soonest with one more (or leave the one that ends
last), which is exact for affine times.
"""
from __future__ import annotations

import heapq
import math


def balance(total: int, lines: list[tuple[float, float]], least: int = 1) -> list[int]:
    """Microbatches per replica (see the module docstring); `lines[r] = (a_r, b_r)`, b_r > 0."""
    count = len(lines)
    least = least if total >= least * count else 1
    slopes = [max(b, 1e-30) for _, b in lines]
    # every replica at the same time T: sum((T - a) / b) = total
    level = (total + sum(a / b for (a, _), b in zip(lines, slopes))) / sum(1 / b for b in slopes)
    counts = [max(least, math.floor((level - a) / b)) for (a, _), b in zip(lines, slopes)]

    def time(r: int, m: int) -> float:
        return lines[r][0] + slopes[r] * m

    while sum(counts) > total:  # clipped up to `least`: take from the replica that ends last
        r = max((r for r in range(count) if counts[r] > least), key=lambda r: (time(r, counts[r]), -r))
        counts[r] -= 1
    heap = [(time(r, counts[r] + 1), r) for r in range(count)]
    heapq.heapify(heap)
    for _ in range(total - sum(counts)):  # the rest, one at a time, to whoever ends soonest with it
        _, r = heapq.heappop(heap)
        counts[r] += 1
        heapq.heappush(heap, (time(r, counts[r] + 1), r))
    return counts


__all__ = ["balance"]
