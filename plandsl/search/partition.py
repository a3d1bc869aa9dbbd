"""Layers onto pipeline stages for the search: the fewest seconds on the slowest stage, within memory.

Stage: inside `plandsl.search`. Contract: `partition_blocks` (identical blocks, a greedy that is exact
for this minimax) and `partition_layers` (layers that differ, dynamic programming) return layers
per stage, or None when no split fits.
"""
from __future__ import annotations

import heapq
import itertools
import math


def partition_blocks(blocks: int, fixed: list[float], per_block: list[float],
                     caps: list[int] | None = None) -> tuple[int, ...] | None:
    """Blocks per stage minimising the slowest stage, max_s fixed[s] + n[s] * per_block[s], with
    1 <= n[s] <= caps[s] and sum n = blocks; None when impossible.

    The dynamic programme over identical blocks collapses to a greedy: giving the next block to
    the stage that stays cheapest is optimal for a minimax of increasing separable costs (Ibaraki &
    Katoh 1988, "Resource Allocation Problems", Ch. 4); ties go to the earlier stage, so equal
    costs split as `placement.split_evenly` does."""
    stages = len(fixed)
    caps = caps if caps is not None else [blocks] * stages
    if stages > blocks or min(caps, default=0) < 1 or sum(min(c, blocks) for c in caps) < blocks:
        return None
    counts = [1] * stages
    heap = [(fixed[s] + 2 * per_block[s], s) for s in range(stages) if caps[s] > 1]
    heapq.heapify(heap)
    pop, push = heapq.heappop, heapq.heappush
    for _ in range(blocks - stages):
        _, s = pop(heap)
        counts[s] += 1
        if counts[s] < caps[s]:
            push(heap, (fixed[s] + (counts[s] + 1) * per_block[s], s))
    return tuple(counts)


def partition_layers(costs: list[list[float]], memory: list[list[float]] | None = None,
                     caps: list[float] | None = None) -> tuple[int, ...] | None:
    """Layers per stage for layers that differ (written models, mlp): dynamic programming over the
    layers, f[s][i] = min over j of max(f[s-1][j], cost of layers j..i on stage s), each stage
    holding at least one layer and at most caps[s] bytes. `costs[s][i]` is layer i's seconds on
    stage s's device, `memory[s][i]` its bytes there. O(stages x layers^2)."""
    stages, layers = len(costs), len(costs[0]) if costs else 0
    if stages > layers:
        return None
    prefix = [list(itertools.accumulate(row, initial=0.0)) for row in costs]
    held = [list(itertools.accumulate(row, initial=0.0)) for row in memory] if memory else None
    inf = math.inf
    best = [[inf] * (layers + 1) for _ in range(stages + 1)]
    cut = [[0] * (layers + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for i in range(s, layers - (stages - s) + 1):
            for j in range(s - 1, i):
                if best[s - 1][j] == inf:
                    continue
                if held is not None and caps is not None and held[s - 1][i] - held[s - 1][j] > caps[s - 1]:
                    continue
                value = max(best[s - 1][j], prefix[s - 1][i] - prefix[s - 1][j])
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    if best[stages][layers] == inf:
        return None
    counts, i = [], layers
    for s in range(stages, 0, -1):
        j = cut[s][i]
        counts.append(i - j)
        i = j
    return tuple(reversed(counts))


__all__ = ["partition_blocks", "partition_layers"]
