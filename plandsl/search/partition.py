"""Layers onto pipeline stages for the search: the fewest seconds on the slowest stage, within memory.

Stage: inside `plandsl.search`. Contract: `partition_blocks` (identical blocks, a greedy that is exact
for this minimax) and `partition_layers` (layers that differ, dynamic programming; a transformer's two
kinds of block) return layers per stage, or None when no split fits.
"""
from __future__ import annotations

import heapq
import itertools
import math
import struct
from collections import Counter
from typing import Mapping

import numpy as np


def partition_blocks(blocks: int, fixed: list[float], per_block: list[float],
                     caps: list[int] | None = None, least: list[int] | None = None) -> tuple[int, ...] | None:
    """Blocks per stage minimising the slowest stage, max_s fixed[s] + n[s] * per_block[s], with
    least[s] <= n[s] <= caps[s] and sum n = blocks; None when impossible. `least`: 1 on every stage unless
    given (0 where a stage may hold no block: the embedding or the loss alone, `stages ... with account`).

    The dynamic programme over identical blocks collapses to a greedy: giving the next block to
    the stage that stays cheapest is optimal for a minimax of increasing separable costs (Ibaraki &
    Katoh 1988, "Resource Allocation Problems", Ch. 4); ties go to the earlier stage, so equal
    costs split as `placement.split_evenly` does. The greedy starts from `_below`'s counts: the blocks it would
    hand out first, all at once."""
    stages = len(fixed)
    caps = caps if caps is not None else [blocks] * stages
    least = least if least is not None else [1] * stages
    if sum(least) > blocks or any(c < lo for c, lo in zip(caps, least)) or sum(min(c, blocks) for c in caps) < blocks:
        return None
    if blocks - sum(least) > GREEDY_STEPS:
        return _partition_by_threshold(blocks, fixed, per_block, [min(c, blocks) for c in caps], least)
    counts = _below(blocks, fixed, per_block, caps, least)
    heap = [(fixed[s] + (counts[s] + 1) * per_block[s], s) for s in range(stages) if caps[s] > counts[s]]
    heapq.heapify(heap)
    pop, push = heapq.heappop, heapq.heappush
    for _ in range(blocks - sum(counts)):
        _, s = pop(heap)
        counts[s] += 1
        if counts[s] < caps[s]:
            push(heap, (fixed[s] + (counts[s] + 1) * per_block[s], s))
    return tuple(counts)


def _below(blocks: int, fixed: list[float], per_block: list[float], caps: list[int], least: list[int]) -> list[int]:
    """The counts the greedy of `partition_blocks` reaches after handing out every cost below a level: it hands out
    the costs (fixed[s] + k * per_block[s], s), k = least[s] + 1..caps[s], in their sorted order (each stage's rise
    with k: the heap pops their merge), so where fewer than the blocks to hand out are below the level, those are
    the first it hands out, whatever their order. The level: where the blocks would be spread evenly over the
    stages' seconds, lowered by the dearest block until few enough are below it (a few times at most). `least` (the
    greedy alone) for as few blocks as stages, where a cost is not a positive finite float (a free block), and past
    those lowerings."""
    extra = blocks - sum(least)
    stages = len(fixed)
    if extra <= stages or not all(0.0 < b < math.inf for b in per_block) or \
            not all(-math.inf < f < math.inf for f in fixed):
        return list(least)
    level = (extra + sum(lo + f / b for f, b, lo in zip(fixed, per_block, least))) / sum(1.0 / b for b in per_block)
    step = max(per_block)
    for _ in range(4):  # each lowering takes a block from every stage between its least and its cap
        if not -math.inf < level < math.inf:
            break
        counts, alike = [], {}  # stages alike (one device type's middle ones) counted once
        for stage in zip(fixed, per_block, caps, least):
            k = alike.get(stage)
            if k is None:
                f, b, cap, lo = stage
                k = min(cap, max(lo, int((level - f) / b)))  # the most k in lo..cap with f + k * b below the level
                while k < cap and f + (k + 1) * b < level:
                    k += 1
                while k > lo and f + k * b >= level:
                    k -= 1
                alike[stage] = k
            counts.append(k)
        if sum(counts) <= blocks:
            return counts
        level -= step
    return list(least)


# Past this many blocks to hand out one at a time, `partition_blocks` answers in closed form instead
# (work by the stages, not by the blocks: a 100,000-block model on thousands of stages).
GREEDY_STEPS = 4096


def _partition_by_threshold(blocks: int, fixed: list[float], per_block: list[float],
                            caps: list[int], least: list[int]) -> tuple[int, ...]:
    """What the greedy of `partition_blocks` ends with, without its steps. The greedy hands out the
    blocks beyond `least` per stage in the order of (fixed[s] + k * per_block[s], s) for k = least[s] + 1..
    caps[s] (each stage's costs rise with k, so the heap pops their sorted merge): it takes the q = blocks -
    sum(least) smallest. Bisecting over the bit patterns of non-negative floats (ordered as the floats)
    finds the q-th smallest cost V exactly in 64 rounds over the distinct stages; every cost below V is taken,
    then those equal to V stage by stage, as the heap's ties go."""
    extra = blocks - sum(least)

    kinds = Counter(zip(fixed, per_block, caps, least))  # stages alike count once, times how many

    def taken(s: int, limit: float) -> int:
        return taken_of(fixed[s], per_block[s], caps[s], least[s], limit)

    def taken_of(f: float, b: float, cap: int, lo: int, limit: float) -> int:
        """How many of a stage's costs f + k * b, k = lo + 1..cap, are <= limit (the greedy's float expression)."""
        first = lo + 1
        if cap < first or f + first * b > limit:
            return 0
        if b <= 0.0:
            return cap - lo
        k = min(cap, max(first, int((limit - f) / b)))
        while k < cap and f + (k + 1) * b <= limit:
            k += 1
        while k > first and f + k * b > limit:
            k -= 1
        return k - lo

    def count(limit: float) -> int:
        return sum(n * taken_of(f, b, cap, lo, limit) for (f, b, cap, lo), n in kinds.items())

    low, high = 0, _bits(max(f + c * b for f, b, c in zip(fixed, per_block, caps)))
    if count(_float(low)) < extra:  # the q-th smallest cost is above 0.0: the least bits that reach it
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (low, middle) if count(_float(middle)) >= extra else (middle, high)
        value = _float(high)
        below = _float(high - 1)
    else:
        value, below = _float(low), None
    counts = [least[s] + (taken(s, below) if below is not None else 0) for s in range(len(fixed))]
    left = extra - (sum(counts) - sum(least))
    for s in range(len(fixed)):
        if left <= 0:
            break
        more = min(left, taken(s, value) + least[s] - counts[s])
        counts[s] += more
        left -= more
    return tuple(counts)


def _bits(value: float) -> int:
    return struct.unpack("<q", struct.pack("<d", value))[0]


def _float(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", bits))[0]


def least_slowest(blocks: int, ranks: Mapping[tuple[float, float, int], int]) -> float:
    """A lower bound on min over whole splits N_r >= least_r, sum N_r = blocks, of max_r fixed_r + N_r·per_block_r,
    for `ranks` = {(fixed, per_block, least): how many ranks}: the least value T at which the ranks hold the
    blocks, counting each rank's floor((T - fixed) / per_block) generously (a hair more blocks, so
    T comes out at most a hair low); math.inf when the ranks' `least` add up to more than the blocks.

    The optimum is one of the values fixed_r + N·per_block_r. It is at least the ranks' floor (each
    holds `least`) and the weighted mean (the max is at least any mean); from there the candidates
    are walked upward, the next being the least fixed_r + (N_r(T) + 1)·per_block_r, never past the
    optimum: within one block of the mean per kind of rank, so a few steps."""
    kinds = [(fixed, per, least, n) for (fixed, per, least), n in ranks.items()]  # plain loops: ~9 µs -> 6
    held = 0
    for _, _, least, n in kinds:
        held += n * least
    if held > blocks:
        return math.inf
    floor = max(fixed + least * per for fixed, per, least, _ in kinds)
    weight = spread = 0
    for fixed, per, _, n in kinds:
        if per <= 0.0:
            return floor  # a rank holds any number of blocks at its fixed cost
        weight += n / per
        spread += n * fixed / per
    limit = max(floor, (blocks + spread) / weight)
    while True:  # the next candidate until the ranks hold the blocks (each rank's count is exact here)
        held = 0
        for fixed, per, least, n in kinds:
            held += n * max(least, int((limit - fixed) / per + 1e-9))
        if held >= blocks:
            return limit
        step = min(fixed + (max(least, int((limit - fixed) / per)) + 1) * per for fixed, per, least, _ in kinds)
        limit = max(step, math.nextafter(limit, math.inf))


def partition_layers(costs: list[list[float]], memory: list[list[float]] | None = None,
                     caps: list[float] | None = None, fixed: list[float] | None = None) -> tuple[int, ...] | None:
    """Layers per stage for layers that differ (written models, mlp, a transformer's dense blocks before
    its MoE ones): dynamic programming over the layers, f[s][i] = min over j of max(f[s-1][j], fixed[s] +
    cost of layers j..i on stage s), each stage holding at least one layer and at most caps[s] bytes.
    `costs[s][i]` is layer i's seconds on stage s's device, `memory[s][i]` its bytes there, `fixed[s]` the
    seconds stage s spends besides them (a transformer's embedding, norm and head). O(stages x layers^2), each
    stage's row as one array operation up to TABLE_LAYERS layers."""
    stages, layers = len(costs), len(costs[0]) if costs else 0
    if stages > layers:
        return None
    prefix = [list(itertools.accumulate(row, initial=0.0)) for row in costs]
    held = [list(itertools.accumulate(row, initial=0.0)) for row in memory] if memory else None
    if layers <= TABLE_LAYERS:
        return _partition_by_table(prefix, held if caps is not None else None, caps, fixed)
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
                value = max(best[s - 1][j], (fixed[s - 1] if fixed else 0.0) + prefix[s - 1][i] - prefix[s - 1][j])
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


# Up to this many layers `partition_layers` computes each stage's row of the table at once, as a (layers + 1)^2
# array (8 MB at 1,024); beyond, one cell at a time
TABLE_LAYERS = 1024


def partition_prefixed(prefix, held, caps, fixed, free_ends: bool = False, recomputed: int | None = None,
                       rerun=None, rerun_held=None) -> tuple[int, ...] | None:
    """`partition_layers` from the cumulative seconds and bytes of each stage's first i layers (`prefix[s][i]`,
    `held[s][i]`, i = 0..layers; arrays or lists), as a caller that has them in closed form gives them (a
    transformer's dense blocks then its MoE ones): the same programme, each stage's row at once. `free_ends`: the
    first and the last stage may hold no layer (the embedding or the loss alone). `recomputed` N (`recompute_layers`):
    each stage's first N layers add `rerun[s][i + 1] - rerun[s][i]` seconds and `rerun_held[s][i + 1] -
    rerun_held[s][i]` bytes (cumulative, as `prefix` and `held`: full recomputation's figures less the kept ones)."""
    if len(prefix) > len(prefix[0]) - 1 + (2 if free_ends and len(prefix) > 1 else 0):
        return None
    return _partition_by_table(prefix, held, caps, fixed, free_ends, recomputed, rerun, rerun_held)


def _partition_by_table(prefix, held, caps, fixed, free_ends: bool = False, recomputed: int | None = None,
                        rerun=None, rerun_held=None) -> tuple[int, ...] | None:
    """`partition_layers`'s programme with each stage's row at once over every (j, i): the same float
    expressions and the same choice among equal values (the smallest j), 100x faster for a few dozen layers. A
    stage's table of seconds, infinite where it may not end (fewer than one layer, past its cap: max(x, inf) is
    inf, as masking after the maximum), is made once for the stages that share its figures (the middle stages of
    a pipeline mostly do: the search's calls for DeepSeek-V3 build half as many tables as stages, 1.7x faster)."""
    stages, layers = len(prefix), len(prefix[0]) - 1
    starts = np.arange(layers + 1)
    empty = starts[:, None] >= starts[None, :]  # j >= i: a stage holds at least one layer
    backwards = starts[:, None] > starts[None, :]  # j > i: an end stage free to hold none holds at least none
    # a stage of layers j..i - 1 recomputes j..min(j + N, i) - 1
    upto = np.minimum(starts[:, None] + recomputed, starts[None, :]) if recomputed is not None else None
    rows = np.asarray(prefix, dtype=float)
    bytes_rows = np.asarray(held, dtype=float) if held is not None else None
    reruns = np.asarray(rerun, dtype=float) if upto is not None else None
    rerun_bytes = np.asarray(rerun_held, dtype=float) if upto is not None and held is not None else None
    tables: dict = {}
    best = np.full(layers + 1, np.inf)
    best[0] = 0.0
    cuts = np.zeros((stages + 1, layers + 1), dtype=np.int64)
    for s in range(1, stages + 1):
        end = free_ends and stages > 1 and s in (1, stages)
        key = (rows[s - 1].tobytes(), fixed[s - 1] if fixed is not None else 0.0, end,
               None if bytes_rows is None else bytes_rows[s - 1].tobytes(), None if held is None else caps[s - 1],
               None if reruns is None else reruns[s - 1].tobytes(),
               None if rerun_bytes is None else rerun_bytes[s - 1].tobytes())
        table = tables.get(key)
        if table is None:
            row = rows[s - 1]
            seconds = ((fixed[s - 1] if fixed is not None else 0.0) + row[None, :]) - row[:, None]
            if upto is not None:
                more = reruns[s - 1]
                seconds = seconds + (more[upto] - more[:, None])
            blocked = backwards if end else empty
            if held is not None:
                bytes_ = bytes_rows[s - 1]
                need = bytes_[None, :] - bytes_[:, None]
                if upto is not None:
                    more = rerun_bytes[s - 1]
                    need = need + (more[upto] - more[:, None])
                blocked = blocked | (need > caps[s - 1])
            table = tables[key] = np.where(blocked, np.inf, seconds)
        value = np.maximum(best[:, None], table)
        cuts[s] = value.argmin(axis=0)  # the first of equal values: the smallest j, as the loop takes
        best = value[cuts[s], starts]
    if best[layers] == np.inf:
        return None
    counts, i = [], layers
    for s in range(stages, 0, -1):
        j = int(cuts[s][i])
        counts.append(i - j)
        i = j
    return tuple(reversed(counts))


__all__ = ["partition_blocks", "partition_layers", "least_slowest"]
