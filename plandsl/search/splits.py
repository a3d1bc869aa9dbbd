"""A leaf's blocks per stage: the partition algorithms (`search.partition`) fed with the node's seconds per
kind of layer on each stage's rank and the caps of its ranks' memory.

Stage: inside the search, above the figures and the caps. Contract: `Splits` gives a leaf's layers per
stage (fewest seconds on the slowest stage, within memory), or None when no split fits; for a node that
recomputes the first N blocks of each stage, the split and the least N that fits.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from plandsl.cost.memory import gathered_bytes, gathers_whole
from plandsl.ir.placement import account_counts
from plandsl.search.caps import Caps
from plandsl.search.figures import Figures
from plandsl.search.partition import partition_blocks, partition_layers, partition_prefixed
from plandsl.search.tree import Node


class Splits:
    def __init__(self, figures: Figures, caps: Caps, pins: Mapping[str, object]):
        self.figures, self.caps, self.pins = figures, caps, pins
        self.blocks, self.dense_blocks, self.layers = figures.blocks, figures.dense_blocks, figures.layers
        self._partition_cache: dict = {}
        self._mixed_cache: dict = {}  # `mixed_partition`'s figures (as bytes) -> its split
        # the kinds of block (indices into the figures' kinds) as `mixed_partition` sums them: the others, then the
        # main one (of a dense and an MoE kind, the dense blocks' seconds first)
        self._summed = list(range(4, len(figures.kinds))) + [1]

    def transformer_partition(self, node: Node, ranks, inflight, memory, virtual, rank_caps=None):
        root = node.root
        stages = len(ranks)
        rank_caps = rank_caps or self.caps.caps(root, ranks, inflight, memory, virtual)
        if rank_caps is None:
            return None  # memory: no split fits, before any timing
        key = (node.ident, ranks, tuple(rank_caps))
        found = self._partition_cache.get(key, False)
        if found is not False:
            return found
        costs = {}
        fixed, per_block, caps, seen = [], [], [], [0] * root.pp
        for s, r in enumerate(ranks):
            device = root.rank_devices[r]
            cost = costs.get(device.name)
            if cost is None:  # a partly recomputed node's split: at its kept blocks' seconds
                embed, block, norm, head = self.figures.kind_times(node.kept or node, device)
                cost = costs[device.name] = (embed.forward + embed.backward, block.forward + block.backward,
                                             norm.forward + norm.backward + head.forward + head.backward)
            fixed.append((cost[0] if s == 0 else 0.0) + (cost[2] if s == stages - 1 else 0.0))
            per_block.append(cost[1])
            # A rank's room for blocks, shared by its stages evenly (the earlier ones first).
            base, more = divmod(rank_caps[r], virtual)
            caps.append(base + (1 if seen[r] < more else 0))
            seen[r] += 1
        found = self._partition_cache[key] = self._blocks_split(fixed, per_block, caps, ranks, rank_caps)
        return found

    def _blocks_split(self, fixed, per_block, caps, ranks, rank_caps) -> tuple[int, ...] | None:
        """The blocks per stage under the pin `account` (Megatron's split counting the embedding and the loss as
        layers: `stages = evenly ... with account`), within the caps; unpinned, `partition_blocks`' split, or
        where it is impossible or strictly slower, its split with the first and the last stage free to hold no
        block (the embedding or the loss alone: more stages than blocks, or an end stage's fixed seconds worth
        a block)."""
        account = self.pins.get("account")
        if account:  # within each rank's room for blocks, whichever of its stages holds them
            counts = account_counts(self.blocks, len(fixed), account)
            held = [0] * len(rank_caps)
            for n, r in zip(counts or (), ranks):
                held[r] += n
            return counts if counts is not None and all(n <= c for n, c in zip(held, rank_caps)) else None
        found = partition_blocks(self.blocks, fixed, per_block, caps)
        if account is not None or len(fixed) == 1:  # `account=none`: every stage at least one block
            return found
        seconds = _stage_seconds(found, fixed, per_block) if found is not None else None
        if found is not None and not _end_slowest(seconds, found, one_block=True):
            return found  # an end stage's one block does not set the slowest stage: no split with it empty is faster
        least = [0] + [1] * (len(fixed) - 2) + [0]
        free = partition_blocks(self.blocks, fixed, per_block, caps, least)
        if found is None or (free is not None and max(_stage_seconds(free, fixed, per_block)) < max(seconds)):
            return free
        return found

    def fitted_partition(self, node: Node, ranks, inflight, memory, virtual, recomputed: int | None = None,
                         kept: float = 0.0, rank_caps=None):
        """The blocks per stage within the in-flight rule's caps where the exact estimate fits them (`Caps.split_fits`),
        else within the caps the schedule's simulated peak leaves (`Caps.caps(held=True)`, within which it fits any
        split), or None: the rule's split as before where it fits, and one that fits where it does not (the simulated
        peak of a zero-bubble schedule's deferred weight gradients, of an interleaved or V-shaped rank's uneven stages,
        the blocks a stage recomputes where a split recomputes fewer than the caps count)."""
        root = node.root
        caps = rank_caps or self.caps.caps(root, ranks, inflight, memory, virtual, recomputed, kept)
        counts = self.transformer_partition(node, ranks, inflight, memory, virtual, caps) if caps is not None else None
        if counts is None or self.caps.split_fits(root, ranks, inflight, memory, counts, recomputed, kept):
            return counts
        held = self.caps.caps(root, ranks, inflight, memory, virtual, recomputed, kept, held=True)
        return self.transformer_partition(node, ranks, inflight, memory, virtual, held) if held is not None else None

    def partial_partition(self, node: Node, zero: int, ranks, inflight, memory, virtual, least: int = 1):
        """(blocks per stage, N) of a node that recomputes the first N blocks of each stage and keeps the
        others' activations (`recompute_layers`), or None. N is the least from `least` on with a split that fits
        (`fitted_partition`), from the least whose rule's caps admit one (`least_recomputed`: the caps only grow with
        N, and never count more than the exact estimate: no N below fits); among the N that fit, the least is the
        fastest for its split: a larger N recomputes more of the same blocks, all else equal. (It could loosen a cap
        that bounds the split and even it out: one N per leaf keeps the space bounded, and that trade unexplored.)
        None where the kept node's own leaf has the same split (it recomputes nothing: faster), also when
        its caps do not bound its split, and where N reaches every stage's blocks (that is `full`)."""
        root = node.root
        kept_memory = self.figures.layer_memory(node.kept, zero)
        partial, kept = self.caps.partial_memory(memory, kept_memory)
        pinned = self.pins.get("recompute_layers")
        split = None
        if pinned is None:
            kept_caps = self.caps.caps(root, ranks, inflight, kept_memory, virtual)
            if kept_caps is not None:
                split = self.fitted_partition(node.kept, ranks, inflight, kept_memory, virtual, rank_caps=kept_caps)
                free = self.transformer_partition(node.kept, ranks, inflight, kept_memory, virtual,
                                                  [self.blocks * virtual] * root.pp)
                if split == free:  # its caps do not bound the kept node's split: nothing to recompute
                    return None
            found = self.caps.least_recomputed(root, ranks, inflight, partial, virtual, kept)
            if found is None:
                return None
            least = max(found, least)
        else:
            least = pinned
        high = self.blocks - len(ranks) + 1  # the most blocks a stage holds
        while True:
            counts = self.fitted_partition(node, ranks, inflight, partial, virtual, least, kept)
            if counts is not None or pinned is not None or least >= high:
                break
            least += 1
        if counts is None or (pinned is None and (least >= max(counts) or counts == split)):
            return None
        return counts, least

    def mixed_partition(self, node: Node, zero: int, ranks, inflight, memory):
        """Blocks per stage of a transformer with several kinds of block (dense and MoE, windowed and full, or more)
        in the model's order: the dynamic programme over the blocks in order (`partition_layers`), each block at its
        own kind's seconds and bytes on its stage's rank, the embedding and the norm and head as fixed seconds and
        bytes of the first and last stage, a rank's room shared evenly by its stages, ZeRO's gathered units taken as
        the two largest of each kind (a bound)."""
        root = node.root
        key = (node.ident, zero, ranks, inflight.tobytes())
        found = self._partition_cache.get(key, False)
        if found is not False:
            return found
        per_kind, tied, _ = memory
        (embed_s, embed_a, _), _, (norm_s, norm_a, _), (head_s, head_a, loss) = per_kind[:4]
        summed = self._summed  # the kinds of block, in the order their seconds and bytes are summed
        working = max(per_kind[kind][2] for kind in summed)
        first_rank, last_rank, last = ranks[0], ranks[-1], len(ranks) - 1
        # per stage, as arrays over the stages (a pipeline of many stages costs what one of few does)
        on = np.asarray(ranks)
        first, final = on == first_rank, on == last_rank
        kept = inflight[on]
        block_bytes = [per_kind[kind][0] + kept * per_kind[kind][1] for kind in summed]
        gathered = {(a, b): self.figures.gathered(memory, a, b, 2) for a in (False, True) for b in (False, True)}
        room = self.figures.capacity(root)[on] - working - self.figures.stage_buffers(memory, ranks, inflight)[on] \
            - np.where(
            first, np.where(final, gathered[True, True], gathered[True, False]),
            np.where(final, gathered[False, True], gathered[False, False]))
        room -= np.where(first, embed_s + kept * embed_a, 0.0)
        head = self.figures.head_inflight(inflight, last_rank)  # the last stage's in flight, not its rank's
        room -= np.where(final, norm_s + head_s + head * (norm_a + head_a) + max(0.0, loss - working)
                         + (tied if tied and first_rank != last_rank else 0.0), 0.0)
        caps = room / np.bincount(on)[on]  # a rank's room is shared by its stages
        # memory first, before any timing: the most blocks of the lightest kind each stage could hold
        lighter = np.minimum.reduce(block_bytes)
        most = np.where(lighter <= 0, self.blocks, np.maximum(caps, 0.0) // np.where(lighter <= 0, 1.0, lighter))
        account = self.pins.get("account")
        # a stage that must hold a block and cannot: every stage under `account=none`, the middle ones unpinned (an
        # end may hold the embedding or the loss alone); under a pinned `account` its split is checked below
        must = most if account is not None else most[1:-1]
        if not account and (most.sum() < self.blocks or (must.size and must.min() < 1)):
            self._partition_cache[key] = None
            return None
        seconds = {}
        for r in set(ranks):
            times = self.figures.kind_times(node, root.rank_devices[r])
            embed, norm, head = times[0], times[2], times[3]
            seconds[r] = (embed.forward + embed.backward, norm.forward + norm.backward + head.forward + head.backward,
                          *(times[kind].forward + times[kind].backward for kind in summed))
        per = np.array([seconds[r] for r in ranks])
        fixed = np.where(np.arange(len(ranks)) == 0, per[:, 0], 0.0) + np.where(np.arange(len(ranks)) == last, per[:, 1], 0.0)
        # blocks of each kind in 0..i, in the model's order: each kind's seconds and bytes summed over them
        before = [self.figures.kind_before[self.figures.block_kinds.index(kind)] for kind in summed]
        prefix = per[:, 2:3] * before[0]
        held = block_bytes[0][:, None] * before[0]
        for column, (each, count) in enumerate(zip(block_bytes[1:], before[1:]), start=3):
            prefix = prefix + per[:, column:column + 1] * count
            held = held + each[:, None] * count
        if account:  # Megatron's split counting the embedding and the loss, within each rank's room
            counts = account_counts(self.blocks, len(ranks), account)
            fits = counts is not None
            if fits:
                bounds, used = np.cumsum((0,) + counts), {}
                for s, r in enumerate(ranks):
                    used[r] = used.get(r, 0.0) + held[s][bounds[s + 1]] - held[s][bounds[s]]
                fits = all(used[r] <= room[ranks.index(r)] for r in used)  # `room`: a stage's rank's, whole
            found = self._partition_cache[key] = counts if fits else None
            return found
        # the split depends on these figures alone: leaves of other nodes, ZeRO stages or schedules often share them
        # (half of a Llama 4 Maverick search's), and the dynamic programme is most of a leaf's partition
        figures = tuple(np.asarray(each, dtype=np.float64).tobytes() for each in (per, *block_bytes, caps))
        found = self._mixed_cache.get(figures, False)
        if found is False:
            found = partition_prefixed(prefix, held, caps, fixed)
            seconds = _table_seconds(found, prefix, fixed) if found is not None else None
            if account is None and len(ranks) > 1 and (found is None or _end_slowest(seconds, found)):
                free = partition_prefixed(prefix, held, caps, fixed, free_ends=True)  # an end: the embedding or loss alone
                if found is None or (free is not None and max(_table_seconds(free, prefix, fixed)) < max(seconds)):
                    found = free
            self._mixed_cache[figures] = found
        self._partition_cache[key] = found
        return found

    def layer_partition(self, node: Node, ranks, inflight, layer_memory):
        root = node.root
        per_kind, plan = layer_memory[0], layer_memory[2]
        costs, memory, caps = [], [], []
        # ZeRO-2/3's gathered units: the two largest of the model, wherever they are (a bound); ZeRO-2's parameters,
        # whole through the step, are in each layer's states (`figures.Figures._states`), its gradients' units here
        both = gathered_bytes(plan, self.layers)
        working = max(k[2] for k in per_kind) + (both[1] if gathers_whole(plan) else sum(both))
        for r in ranks:
            costs.append([t.forward + t.backward for t in self.figures.kind_times(node, root.rank_devices[r])])
            memory.append([k[0] + inflight[r] * k[1] for k in per_kind])
            caps.append((root.capacity[r] - working) / sum(1 for q in ranks if q == r))
        return partition_layers(costs, memory, caps)



def _stage_seconds(counts, fixed, per_block) -> list[float]:
    """Each stage's seconds under a split of identical blocks (`partition_blocks` minimises the slowest)."""
    return [f + n * b for f, n, b in zip(fixed, counts, per_block)]


def _table_seconds(counts, prefix, fixed) -> list[float]:
    """Each stage's seconds under a split of layers that differ (`partition_prefixed` minimises the slowest)."""
    bounds = np.cumsum((0,) + tuple(counts))
    return [fixed[s] + prefix[s][bounds[s + 1]] - prefix[s][bounds[s]] for s in range(len(counts))]


def _end_slowest(seconds: list[float], counts, one_block: bool = False) -> bool:
    """Whether the first or the last stage is the slowest (`one_block`: and holds one block): only then can a split
    leaving it empty be faster. Under identical blocks an end's lower bound of one block can make the split slower
    only where that end holds one block: the least slowest over splits with the ends free is below the least with
    them at one only where one block there costs more than it."""
    slowest = max(seconds)
    return any((counts[s] == 1 or not one_block) and seconds[s] >= slowest for s in (0, len(counts) - 1))


__all__ = ["Splits"]
