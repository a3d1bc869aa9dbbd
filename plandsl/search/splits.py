"""A leaf's blocks per stage: the partition algorithms (`search.partition`) fed with the node's seconds per
kind of layer on each stage's rank and the caps of its ranks' memory.

Stage: inside the search, above the figures and the caps. Contract: `Splits` gives a leaf's layers per
stage (fewest seconds on the slowest stage, within memory), or None when no split fits; for a node that
recomputes the first N blocks of each stage, the split and the least N that fits.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from plandsl.cost.memory import gathered_bytes, gathers_whole, pipelined_shards, replicates_units
from plandsl.cost.offload import host_capacity
from plandsl.ir.placement import account_counts, split_evenly
from plandsl.search.caps import Caps
from plandsl.search.figures import Figures
from plandsl.search.partition import partition_blocks, partition_layers, partition_prefixed
from plandsl.search.tree import Node


_MISSING = object()  # a cache's miss (None is a split's answer: none fits)
# `_moved_split`: the rounds of blocks moved from a split the schedule's simulated peak overfills, at most
_PEAK_TRIES = 8


class Splits:
    def __init__(self, figures: Figures, caps: Caps, pins: Mapping[str, object]):
        self.figures, self.caps, self.pins = figures, caps, pins
        self.blocks, self.dense_blocks, self.layers = figures.blocks, figures.dense_blocks, figures.layers
        self._partition_cache: dict = {}
        self._mixed_cache: dict = {}  # `mixed_partition`'s figures (as bytes) -> its split
        self._shares: dict = {}  # ranks -> `_shared_split`'s stages per rank
        self._even: dict = {}  # stages -> the even split of the blocks (`_shared_split`)
        self._partial_memories: dict = {}  # `_mixed_partial_memory`'s, kept with the memories they are made of
        # the kinds of block (indices into the figures' kinds) as `mixed_partition` sums them: the others, then the
        # main one (of a dense and an MoE kind, the dense blocks' seconds first)
        self._summed = list(range(4, len(figures.kinds))) + [1]
        # the split is not the search's to choose: a pinned `account` (Megatron's split counting the embedding and the
        # loss as layers), or the split of a kept stages line (`Problem.split`), which the completion writes as it is
        self.fixes = bool(pins.get("account")) or figures.problem.split is not None

    def fixed(self, stages: int) -> tuple[int, ...] | None:
        """The blocks per stage of `stages` stages where the split is fixed (`fixes`): a kept `stages { }` block's (of
        its own stage count), else `evenly`'s (`placement.account_counts`, with the pinned `account`'s parts counted as
        items, as the checker assigns them); None where there is none (more stages than items: the checker's E403)."""
        split = self.figures.problem.split
        if isinstance(split, tuple):
            return split if len(split) == stages else None
        return account_counts(self.blocks, stages, self.pins.get("account") or ())

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
        if virtual == 1:  # a rank's room for blocks is its one stage's
            caps = [rank_caps[r] for r in ranks]
        else:  # shared by its stages evenly (the earlier ones first)
            caps, seen = [], [0] * root.pp
            for r in ranks:
                base, more = divmod(rank_caps[r], virtual)
                caps.append(base + (1 if seen[r] < more else 0))
                seen[r] += 1
        types = self.figures.device_types(root)
        if len(types) == 1:  # one device type: every stage's seconds a block the same, the ends' own
            embed, block, head = self._seconds(node.kept or node, next(iter(types.values())))
            fixed = [embed + head] if stages == 1 else [embed + 0.0] + [0.0 + 0.0] * (stages - 2) + [0.0 + head]
            per_block = [block] * stages
        else:
            costs = {}
            fixed, per_block = [], []
            for s, r in enumerate(ranks):
                device = root.rank_devices[r]
                cost = costs.get(device.name)
                if cost is None:  # a partly recomputed node's split: at its kept blocks' seconds
                    cost = costs[device.name] = self._seconds(node.kept or node, device)
                fixed.append((cost[0] if s == 0 else 0.0) + (cost[2] if s == stages - 1 else 0.0))
                per_block.append(cost[1])
        found = self._partition_cache[key] = self._blocks_split(fixed, per_block, caps, ranks, rank_caps)
        return found

    def _seconds(self, node: Node, device) -> tuple[float, float, float]:
        """The embedding's, a block's and the norm and head's forward and backward seconds on the device."""
        embed, block, norm, head = self.figures.kind_times(node, device)[:4]
        return (embed.forward + embed.backward, block.forward + block.backward,
                norm.forward + norm.backward + head.forward + head.backward)

    def _blocks_split(self, fixed, per_block, caps, ranks, rank_caps) -> tuple[int, ...] | None:
        """The blocks per stage of a fixed split (`fixes`: the pin `account`, Megatron's split counting the embedding
        and the loss as layers, `stages = evenly ... with account`; a kept stages line's), within the caps; unpinned,
        `partition_blocks`' split, or
        where it is impossible or strictly slower, its split with the first and the last stage free to hold no
        block (the embedding or the loss alone: more stages than blocks, or an end stage's fixed seconds worth
        a block)."""
        account = self.pins.get("account")
        if self.fixes:  # within each rank's room for blocks, whichever of its stages holds them
            counts = self.fixed(len(fixed))
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
            # the least N whose rule's caps admit a split first: where none does, the leaf is None whatever the kept
            # node's split (what it computes and caches is the same in either order)
            found = self.caps.least_recomputed(root, ranks, inflight, partial, virtual, kept)
            if found is None:
                return None
            kept_caps = self.caps.caps(root, ranks, inflight, kept_memory, virtual)
            if kept_caps is not None and self.figures.kept_fits(node.kept, zero):  # else the kept node is refused
                split = self.fitted_partition(node.kept, ranks, inflight, kept_memory, virtual, rank_caps=kept_caps)
                free = self.transformer_partition(node.kept, ranks, inflight, kept_memory, virtual,
                                                  [self.blocks * virtual] * root.pp)
                if split == free:  # its caps do not bound the kept node's split: nothing to recompute
                    if self._kept_split_fits(node.kept, zero, ranks, inflight, kept_memory, split):
                        return None
                    split = None  # the exact estimate refuses the kept node's split: any N's may do
            least = max(found, least)
        else:
            least = pinned
        high = self.blocks - len(ranks) + 1  # the most blocks a stage holds
        while True:
            counts = self.fitted_partition(node, ranks, inflight, partial, virtual, least, kept)
            if counts is not None or pinned is not None or least >= high:
                break
            least += 1
        if counts is None or (pinned is None and least >= max(counts)):
            return None
        if pinned is None and counts == split and self._kept_split_fits(node.kept, zero, ranks, inflight, kept_memory,
                                                                         split):
            return None  # the kept node's split, which fits: it recomputes nothing
        return counts, least

    def _kept_split_fits(self, kept: Node, zero: int, ranks, inflight, kept_memory, split) -> bool:
        """Whether the exact estimate fits the kept node's (recompute none) plan of its split (`Figures.kept_fits`
        with the split), asked only where the caps leave some rank less room than they can count below it: the caps'
        figure of the split (`Caps.split_room`) is the exact estimate's but for ZeRO-1's optimizer states, counted even
        (`Figures.caps_gap`, at most a rank's largest tensors' states; the two equal to the byte on every pipeline leaf
        of the gpt, tied gpt and MoE test spaces at ZeRO-0/2/3), so that a split with at least that much room on every
        rank, and a billionth of the capacity for sums taken in another order, fits by the exact estimate too."""
        if kept.root.pp > 1 and inflight is not None and split is not None:
            room = self.caps.split_room(kept.root, ranks, inflight, kept_memory, split)
            capacity = self.figures.capacity(kept.root)
            if bool((room >= self.figures.caps_gap(kept, zero, ranks) + capacity * 1e-9).all()):
                return True
        return self.figures.kept_fits(kept, zero, ranks, inflight, split)

    def mixed_partition(self, node: Node, zero: int, ranks, inflight, memory, bounded: bool = True):
        """Blocks per stage of a transformer with several kinds of block (dense and MoE, windowed and full, or more)
        in the model's order: the dynamic programme over the blocks in order (`partition_layers`), each block at its
        own kind's seconds and bytes on its stage's rank, the embedding and the norm and head as fixed seconds and
        bytes of the first and last stage, ZeRO's gathered units taken as
        the two largest of each kind (a bound), a rank's room shared by its stages as `_shared_split` does. `bounded`
        False: the split without memory's caps. Cached by the in-flight array's values and the figures of its schedule
        that the room and the gradients read beside them (`_schedule_figures`), so that schedules alike in them share
        it (`_by_schedule`)."""
        key = (node.ident, zero, ranks, inflight.tobytes(), self._schedule_figures(ranks, inflight), bounded)
        return self._by_schedule(self._partition_cache, key, inflight,
                                 lambda read: self._mixed_split_of(node, ranks, inflight, memory, bounded, read))

    def _schedule_figures(self, ranks, inflight) -> tuple:
        """What `_mixed_split_of` reads of the schedule beyond the in-flight array's values: the head's microbatches in
        flight (`Figures.head_inflight`: one for the 1F1B family, the rank's for looped BFS, both [2, 2] at pp=2
        virtual_stages=2 and 2 microbatches; the room and torch's stage buffers count it), the copies of the embedding
        the head's stage holds (`tied_copies`) and the rank's stages open at once (`open_stages`). A split cached
        without them was one schedule's for another's: a looped BFS leaf took interleaved 1F1B's split, which the
        exact estimate refused."""
        opens = self.figures.open_stages(inflight)
        return (self.figures.head_inflight(inflight, ranks[-1]), self.figures.tied_copies(inflight),
                None if opens is None else (opens.shape, opens.tobytes()))

    def _by_schedule(self, cache: dict, key, inflight, find):
        """`find(read)`, cached under `key` where the schedule has a simulated peak (`Figures.held`) and `find` did not
        read it (`_mixed_peak`, which `_shared_split` makes only where even shares of a rank's room fit no split:
        whether they do depends on `key`'s figures alone), else under `key` and the schedule (its in-flight array's own
        object, one per schedule; None, one for all, where it has no simulated peak). `find` calls `read()` where it
        makes the peak. Leaves of other schedules then share the split wherever it is the even shares' (case 11's
        61,376 calls find 48,270). A schedule without a simulated peak reads none where it has none to read: a fixed
        split (`_fixed_fits`) and a rank that holds only its open stages' gradients (`_released_split`) are not given
        one, so its split is for the schedules without one alone: 1F1B's fixed split (the pin `account`) was zero
        bubble H1's of the same figures (the rule's microbatches in flight alike), which the exact estimate refused
        (`test_a_schedule_with_a_simulated_peak_takes_no_split_found_without_it`; case 11 found 44,770 with it)."""
        found = cache.get(key, _MISSING)
        if found is _MISSING:
            simulated = self.figures.held(inflight) is not None
            exact = key + (id(inflight) if simulated else None,)
            found = cache.get(exact, _MISSING)
            if found is _MISSING:
                read: list = []
                found = find(lambda: read.append(True))
                cache[key if simulated and not read else exact] = found
        return found

    def _mixed_split_of(self, node: Node, ranks, inflight, memory, bounded: bool, read):
        """`mixed_partition`'s split; `read()` where it makes the schedule's simulated peak (`_by_schedule`)."""
        room, caps = self._mixed_room(node.root, ranks, inflight, memory)
        block_bytes = self._mixed_bytes(memory[0], ranks, inflight)
        released = self._mixed_released(node.root, ranks, inflight, memory) if bounded else None

        def peak():
            read()
            return self._mixed_peak(node.root, ranks, inflight, memory)

        if released is not None:  # the rank's open stages' gradients, not all of its stages' (`_released_split`)
            def released_split(relaxed, counted, figures):
                fixed, per, prefix, held = figures
                return self._shared_split(
                    ranks, relaxed,
                    lambda caps: self._cached_split(per, counted, caps, prefix, held, fixed, len(ranks)),
                    held, prefix, fixed, peak=peak, checks=False)  # (`_released_split` checks it)
            return self._released_split(node, ranks, room, block_bytes, released, released_split,
                                        peak=peak if self.figures.held(inflight) is not None else None)
        if not bounded:
            room = np.full(len(ranks), np.inf)
        elif not self._mixed_may_fit(room, block_bytes, ranks):
            return None
        fixed, per, prefix, held = self._mixed_prefixes(node, ranks, block_bytes)
        if self.fixes:  # a fixed split (Megatron's counting the embedding and the loss, a kept line's), within each
            counts = self.fixed(len(ranks))  # rank's room
            return counts if counts is not None and (not bounded or self._fixed_fits(
                counts, ranks, room, held, peak=peak if self.figures.held(inflight) is not None else None)) else None
        return self._shared_split(
            ranks, room, lambda caps: self._cached_split(per, block_bytes, caps, prefix, held, fixed, len(ranks)),
            held, prefix, fixed, peak=peak)

    def _shared_split(self, ranks, room, split, held, prefix, fixed, recomputed: int | None = None, rerun=None,
                      rerun_held=None, peak=None, checks: bool = True):
        """The split `split(caps)` makes (the programme within each stage's cap of bytes) within each rank's room
        (`room`, per stage: its rank's, whole). A rank of one stage: its room. Of several: first an even share of it
        each (the split as before, kept where there is one). Where none fits those shares, which prunes splits whose
        stages differ in bytes (a dense stage and an MoE one on a rank, a V's first rank with the embedding's stage and
        the head's), the rank's room is shared as the even split of the blocks' (`placement.split_evenly`) stages hold
        bytes, where it fits each rank's room, else as those of the split a block or a few moved from it that fits
        (`_moved_split`: a rank of the embedding's stage or the head's beside one of MoE blocks, which the even split
        overfills, holds a split of one block at the end; of the 1,294 partly recomputed leaves of a dense-then-MoE
        test space with a split that fits, 252 were dropped without it, 4 are): the programme's split within those
        shares (at least as fast as the one they are taken from, which they admit), or that split where the
        programme's does not fit; else None. The bytes of a stage: `held`'s (cumulative per stage),
        its first `recomputed` blocks at `rerun_held`'s more; a split fits where each rank's stages' bytes and
        `peak()(counts)` (`_mixed_peak`: what the schedule's simulated peak holds beyond the in-flight rule, which the
        exact estimate counts) are within its room. The programme's split within the room (one stage a rank) or the even
        shares, which count the rule alone, is checked with that peak too (`checks`; `_released_split` checks its own
        with the open gradients), and where a rank is over, the split is the fastest of those a block moved across a
        stage's bound from it that fit (`_moved_split`), or None: it was kept, and the exact estimate refused it."""
        shares = self._shares.get(ranks)
        if shares is None:  # (the stages' ranks, each stage's rank's stages), None where a rank holds one
            on = np.asarray(ranks)
            stages = np.bincount(on)[on]
            shares = self._shares[ranks] = (on, stages) if stages.max() > 1 else None
        def used(counts):  # each stage's bytes under the split (splits as rows: each row's)
            bounds = _bounds(counts)
            rows = np.arange(bounds.shape[-1] - 1)
            out = held[rows, bounds[..., 1:]] - held[rows, bounds[..., :-1]]
            if recomputed is not None:
                out = out + rerun_held[rows, np.minimum(bounds[..., :-1] + recomputed, bounds[..., 1:])] \
                    - rerun_held[rows, bounds[..., :-1]]
            return out

        def fits(counts, simulated: bool = True) -> bool:
            need = np.bincount(on, weights=used(counts))
            if peak is not None and simulated:
                beyond = peak(counts)
                if beyond is not None:
                    need = need + beyond
            return bool((need[on] <= room).all())

        def excess_of(made):  # per rank (splits as rows: per split and rank), by how much the split overfills its
            def excess(counts):  # room: by the rule, and by the simulated peak where `made` (`_mixed_peak`'s) is given
                need = _rank_sums(used(counts), on, len(rank_room))
                beyond = made(counts) if made is not None else None
                return (need if beyond is None else need + beyond) - rank_room
            return excess

        def moved(counts, made):  # `_moved_split` from the split, the fastest as the programme counts time
            return _moved_split(counts, excess_of(made), lambda c: max(_table_seconds(c, prefix, fixed, recomputed,
                                                                                      rerun)),
                                self.pins.get("account") is None)

        def checked(found):  # where the simulated peak overfills a rank with the rule's split: a block moved or a few
            if found is None or peak is None or not checks:
                return found
            made = peak()
            if made is None or not (excess_of(made)(found) > 0).any():
                return found
            return moved(found, made)

        on = np.asarray(ranks)
        rank_room = np.zeros(int(on.max()) + 1)
        rank_room[on] = room
        if shares is None or not np.isfinite(room).all():
            return checked(split(room)) if np.isfinite(room).all() else split(room)
        on, stages = shares
        found = split(room / stages)
        if found is not None:
            return checked(found)
        even = self._even.get(len(ranks))
        if even is None:
            even = self._even[len(ranks)] = tuple(
                len(part) for part in split_evenly(list(range(self.blocks)), len(ranks)))
        if min(even) < 1:
            return None
        # the even split, or where a rank does not hold it, the splits a block or a few moved from it: the rule's bytes
        # first (the simulated peak only adds), then the peak's
        start = even if fits(even, simulated=False) else moved(even, None)
        if start is None:
            return None
        peak = peak() if peak is not None else None  # made only here: most leaves never get here
        if peak is not None and not fits(start):
            start = moved(start, peak)
            if start is None:
                return None
        bytes_ = used(start)
        total = np.bincount(on, weights=bytes_)[on]
        caps = np.where(total > 0, room * bytes_ / np.where(total > 0, total, 1.0), room / stages)
        found = split(np.where(stages == 1, room, np.maximum(caps, bytes_)))
        return found if found is not None and fits(found) else start

    def _mixed_peak(self, root, ranks, inflight, memory, full=None):
        """`_shared_split`'s `peak` for a node of several kinds of block (`full`: a partly recomputed one's, its first N
        blocks a stage at full recomputation's activations): `Caps.peak_beyond_rule` of a split's stages' activations a
        microbatch; None where the schedule's simulation holds no more than the rule."""
        if self.figures.held(inflight) is None:
            return None
        before = [self.figures.kind_before[self.figures.block_kinds.index(kind)] for kind in self._summed]
        kept = sum(memory[0][kind][1] * count for kind, count in zip(self._summed, before))  # per block i, cumulative
        more = sum(full[0][kind][1] * count for kind, count in zip(self._summed, before)) - kept \
            if full is not None else None

        def peak(counts, recomputed=None):  # per rank (splits as rows: per split and rank)
            bounds = _bounds(counts)
            stored = kept[bounds[..., 1:]] - kept[bounds[..., :-1]]
            if recomputed is not None:
                stored = stored + more[np.minimum(bounds[..., :-1] + recomputed, bounds[..., 1:])] \
                    - more[bounds[..., :-1]]
            return self.caps.peak_beyond_rule(root, ranks, inflight, memory, stored)
        return peak

    def _cached_split(self, per, block_bytes, caps, prefix, held, fixed, stages: int):
        """`_mixed_split`, once per figures: the split depends on them alone (leaves of other nodes, ZeRO stages or
        schedules often share them: half of a Llama 4 Maverick search's), and the dynamic programme is most of a
        leaf's partition."""
        figures = tuple(np.asarray(each, dtype=np.float64).tobytes() for each in (per, *block_bytes, caps))
        found = self._mixed_cache.get(figures, False)
        if found is False:
            found = self._mixed_split(prefix, held, caps, fixed, stages)
            self._mixed_cache[figures] = found
        return found

    def _mixed_released(self, root, ranks, inflight, memory):
        """Where a rank of several stages frees each stage's unsharded gradients after its last backward (ZeRO-2/3 on
        torch's pipeline, `Figures.open_stages`, `kind_gradients`) and holds no more than some of them at once: (per
        stage, the sets of its rank's stages open at once as an array stages x its rank's sets, the share of its rank's
        stages the largest set holds; per kind of block (`_summed`'s order), a block's gradients; per stage, the
        embedding's and the norm and head's (with the copies of the embedding the head's stage holds) gradients). Else
        None: every stage's gradients at once, as `memory`'s states count them."""
        grads = self.figures.kind_gradients(memory)
        opens = self.figures.open_stages(inflight) if grads is not None else None
        if opens is None:
            return None
        per_kind, copy = grads
        stage_sets, share = _stage_sets(opens, ranks, root.pp)
        if stage_sets is None:
            return None
        ends = np.zeros(len(ranks))
        ends[0] += per_kind[0]  # the embedding's
        # the norm's and head's, with the copies of the embedding the head's stage holds (as `Caps._released`)
        ends[-1] += per_kind[2] + per_kind[3] + self.figures.copy_vocab(memory) + copy * self.figures.tied_copies(inflight)
        return stage_sets, share, [per_kind[kind] for kind in self._summed], ends

    def _released_split(self, node: Node, ranks, room, block_bytes, released, split, recomputed: int | None = None,
                        rerun_held=None, also=(), prefixes=None, peak=None, rerun=None):
        """`mixed_partition`'s split where a rank holds only its open stages' unsharded gradients (`_mixed_released`),
        as the exact estimate counts them (`cost.memory.estimate_memory`: the largest sum over a set of the rank's
        stages open at once). The programme shares a rank's room over its stages (`_shared_split`: evenly first), so
        it takes each stage's gradients at the largest open set's share of the rank's stages (k of c: k / c), the
        ends' too (a bound exact
        where the rank's stages hold as much): the split it makes is checked against the rank's whole room with the
        largest open set's gradients, and where a rank does not fit, its stages count their gradients whole (as
        before) and the programme runs again. Each run admits a split within the caps of every stage counting all of
        its gradients (the last one is that split), so the split is never slower than that one, and it fits: the room
        less the rank's blocks' states and activations and its largest open set's gradients is never below 0.
        `peak` (where the schedule's simulation may hold more than the rule, `Figures.held`: interleaved zero bubble
        and the others that defer W; `_shared_split`'s, made only here) gives, per rank, what the simulated peak holds
        beyond the in-flight rule with a split (`_mixed_peak`, `Caps.peak_beyond_rule`), which the exact estimate
        counts too: the split that fits by the rule is checked with it, and where a rank is over, the split is the
        fastest (the programme's slowest stage, `_table_seconds`, `rerun` its recomputation's seconds) of those a
        block moved across a stage's bound from it that fit (`_moved_split`), or None (a partly recomputed node then
        tries the next N). The programme's caps, a rank's room shared over its stages by the rule, cannot see the
        peak, which grows with the blocks of the stages it holds more microbatches of (interleaved zero bubble's
        later chunk); it took the split the exact estimate refused and the leaf was dropped.
        `split(relaxed, counted, figures)`: the programme's split within the room `relaxed` (per stage, its rank's,
        whole) at the blocks' bytes `counted` (per kind, per stage), `figures` `_mixed_prefixes`' of them (a fixed
        split, `fixes`, is not asked for); a partly recomputed node's (`mixed_partial_partition`): each stage's first
        `recomputed` blocks at `rerun_held`'s bytes more (full recomputation's activations beyond the kept ones',
        cumulative per stage: no gradients), `also` its rebuilt blocks' bytes per kind (`_mixed_may_fit`'s lighter
        kind among them too) and `prefixes(counted)` its `_mixed_prefixes` (the kept node's seconds)."""
        stage_sets, share, kind_grads, ends = released
        on = np.asarray(ranks)
        before = [self.figures.kind_before[self.figures.block_kinds.index(kind)] for kind in self._summed]
        whole = room + np.bincount(on, weights=ends, minlength=int(on.max()) + 1)[on]  # the ends' gradients apart
        lean = [each - g for each, g in zip(block_bytes, kind_grads)]  # a block's bytes without its gradients
        weight = share.copy()
        rows = np.arange(len(ranks))

        def excess(counts, simulated: bool = True):
            """Per rank, by how much the split overfills its room (positive where it does): its stages' bytes, its
            largest open set's gradients and, `simulated`, the schedule's simulated peak beyond the rule."""
            bounds = _bounds(counts)  # (splits as rows: per split and rank)
            used = np.zeros(bounds.shape[:-1] + (len(ranks),))
            grads = ends + used
            for each, g, count in zip(lean, kind_grads, before):
                blocks = count[bounds[..., 1:]] - count[bounds[..., :-1]]
                used += each * blocks
                grads += g * blocks
            if recomputed is not None:  # the first N blocks' full recomputation's activations beyond the kept ones'
                used += rerun_held[rows, np.minimum(bounds[..., :-1] + recomputed, bounds[..., 1:])] \
                    - rerun_held[rows, bounds[..., :-1]]
            beyond = made[0](counts) if simulated and made[0] is not None else None
            return _open_over(on, used, grads, stage_sets, whole, beyond, excess=True)

        made: list = [None]  # the simulated peak's function, made where a split fits by the rule
        while True:
            # a stage's blocks at their bytes less (1 - weight) of their gradients; the ends' in the rank's room alike
            freed = 1.0 - weight
            counted = [each - freed * g for each, g in zip(block_bytes, kind_grads)]
            lighter = counted + [each - freed * g for each, g in zip(also, kind_grads)]
            relaxed = room + np.bincount(on, weights=freed * ends, minlength=int(on.max()) + 1)[on]
            found = None
            if self._mixed_may_fit(relaxed, lighter, ranks):
                figures = prefixes(counted) if prefixes is not None else self._mixed_prefixes(node, ranks, counted)
                held = figures[3]
                found = self.fixed(len(ranks)) if self.fixes else split(relaxed, counted, figures)
            if found is None or ((weight >= 1.0).all() and peak is None):
                if found is not None and self.fixes:  # every stage's gradients: the rank's room
                    return found if self._fixed_fits(found, ranks, room, held, recomputed, rerun_held) else None
                return found
            over = excess(found, simulated=False) > 0  # by the rule
            if over.any() and self.fixes:  # the one split, which more weight leaves as it is (the loop never ended
                return None  # where some rank but not all was over): a rank does not hold it with its largest open
                # set's gradients (one whose set holds every stage of it, its weight 1 from the start, too)
            if not over.any() or (weight[over[on]] >= 1.0).all():  # (every gradient counted: within their caps)
                break
            weight = np.where(over[on], 1.0, weight)  # those ranks' stages: every gradient, as before
        if peak is None:
            return found
        made[0] = peak()
        if made[0] is None or not (excess(found) > 0).any():
            return found
        if self.fixes:
            return None  # the one split, which the simulated peak overfills
        # the programme's split overfilled by the peak (its caps share a rank's room by the rule): the splits a block
        # or a few moved across a stage's bounds from it, the fastest that fits as the programme counts time
        fixed, _, prefix, _ = figures
        return _moved_split(found, excess, lambda counts: max(_table_seconds(counts, prefix, fixed, recomputed, rerun)),
                            self.pins.get("account") is None)

    def mixed_partial_partition(self, node: Node, zero: int, ranks, inflight, memory, least: int = 1):
        """`partial_partition` for several kinds of block: (blocks per stage, N) of a node that recomputes the first N
        blocks of each stage (their kinds in the model's order) and keeps the others', or None. The same programme as
        `mixed_partition` at the kept node's seconds and bytes, each stage's first N blocks at full recomputation's
        (`partition_prefixed`'s `recomputed`), within the room the partly recomputed memory leaves (the kept node's
        embedding, norm and head, a block rebuilt by recomputation as the working set). N is the least from `least` on
        with a split (`_least_recomputed`: galloping from `least`, then by bisection, where the split is one or the
        programme's exact within each rank's room (a stage a rank, no simulated peak) and a recomputed block holds no
        more than a kept one of its kind, more N only freeing memory; else one N after another). None where the kept node's
        split is the one memory does not bound (it recomputes nothing: faster), where N reaches every stage's blocks
        (that is `full`) and where the split is the kept node's. Where a rank of several stages holds only its open
        stages' unsharded gradients at once (ZeRO-2/3 on torch's pipeline, `_mixed_released`), each N's split counts
        them as `mixed_partition`'s does (`_released_split`, its first N blocks at full recomputation's bytes), not
        every stage's at once."""
        pinned = self.pins.get("recompute_layers")
        kept_memory = self.figures.layer_memory(node.kept, zero)
        split = None
        if pinned is None:
            split = self.mixed_partition(node.kept, zero, ranks, inflight, kept_memory)
            if split == self.mixed_partition(node.kept, zero, ranks, inflight, kept_memory, bounded=False):
                if self.figures.kept_fits(node.kept, zero, ranks, inflight, split):
                    return None
                split = None  # the exact estimate refuses the kept node's split (`Figures.kept_fits`): any N's may do
        partial = self._mixed_partial_memory(memory, kept_memory)
        room, caps = self._mixed_room(node.root, ranks, inflight, partial)
        full_bytes = self._mixed_bytes(memory[0], ranks, inflight)
        kept_bytes = self._mixed_bytes(kept_memory[0], ranks, inflight)
        # where a rank holds only its open stages' gradients, the split counts them so (`_released_split`, which asks
        # `_mixed_may_fit` at their share); else every stage's, as `memory`'s states count them
        released = self._mixed_released(node.root, ranks, inflight, partial)
        if released is None and not self._mixed_may_fit(room, full_bytes + kept_bytes, ranks):
            return None
        fixed, _, prefix, held = self._mixed_prefixes(node.kept, ranks, kept_bytes)
        _, _, full_prefix, full_held = self._mixed_prefixes(node, ranks, full_bytes)
        rerun, rerun_held = full_prefix - prefix, full_held - held
        counts = self.fixed(len(ranks)) if self.fixes else None
        if self.fixes and counts is None:
            return None

        high = self.blocks - len(ranks) + 1 if pinned is None else pinned  # the most blocks a stage holds
        least = pinned if pinned is not None else least
        if least > high:
            return None

        counted_prefixes: dict = {}
        simulated = self.figures.held(inflight) is not None  # the schedule's simulated peak may hold more than the rule

        def prefixes(counted):  # `_mixed_prefixes` of the kept node at the bytes `_released_split` counts, once each
            key = tuple(each.tobytes() for each in counted)
            found = counted_prefixes.get(key)
            if found is None:
                found = counted_prefixes[key] = self._mixed_prefixes(node.kept, ranks, counted)
            return found

        def least_recomputed(read):
            tried: dict = {}
            peaks: list = []

            def peak():  # `_mixed_peak`, made once where a split needs it (`_shared_split`)
                if not peaks:
                    read()
                    peaks.append(self._mixed_peak(node.root, ranks, inflight, kept_memory, memory))
                return peaks[0]

            def peak_at(n: int):  # `_shared_split`'s `peak` at N
                return lambda: None if peak() is None else lambda c: peak()(c, n)

            def shared_split(n: int, room, figures, checks: bool = True):  # the programme's split at N in the room
                fixed, _, prefix, held = figures
                return self._shared_split(
                    ranks, room, lambda caps: self._mixed_split(prefix, held, caps, fixed, len(ranks), n, rerun,
                                                                rerun_held),
                    held, prefix, fixed, n, rerun, rerun_held, peak_at(n), checks)

            def split_at(n: int):
                if n not in tried:
                    if released is not None:
                        tried[n] = self._released_split(
                            node.kept, ranks, room, kept_bytes, released,
                            lambda relaxed, _, figures: shared_split(n, relaxed, figures, False), n, rerun_held,
                            full_bytes, prefixes, peak_at(n) if simulated else None, rerun)
                    elif self.fixes:
                        tried[n] = counts if self._fixed_fits(counts, ranks, room, held, n, rerun_held,
                                                              peak_at(n) if simulated else None) else None
                    else:
                        tried[n] = shared_split(n, room, (fixed, None, prefix, held))
                return tried[n]
            # the split is one, or the programme's exact within each rank's room (a stage a rank, no simulated peak:
            # no shares, no walk), where a split at N is one at N + 1
            return self._least_recomputed(split_at, least, high, pinned, memory, kept_memory,
                                          self.fixes or len(ranks) == 1 or (len(set(ranks)) == len(ranks)
                                                                           and not simulated and released is None))

        # the N and split depend on these figures alone (and the schedule's simulated peak where a split reads it):
        # partly recomputed leaves of other ZeRO stages or schedules often share them (each N's programme is what a
        # Llama 4 Maverick leaf's partition spends its time on)
        figures = (least, split) + tuple(np.asarray(each, dtype=np.float64).tobytes()
                                         for each in (fixed, prefix, held, rerun, rerun_held, caps, room))
        if released is not None:  # and the rank's stages open at once, and their gradients
            figures += tuple(np.asarray(each, dtype=np.float64).tobytes() for each in released)
        found = self._by_schedule(self._mixed_cache, figures, inflight, least_recomputed)
        if found is not None and pinned is None and split is not None and found[0] == split \
                and self.figures.kept_fits(node.kept, zero, ranks, inflight, split):
            return None  # the kept node's split, which fits: it recomputes nothing
        return found

    def _least_recomputed(self, split_at, least: int, high: int, pinned, memory, kept_memory, one: bool = False):
        """`mixed_partial_partition`'s (split, N) from `split_at(N)`, N from `least` to `high`, or None (N reaching
        the split's every block unpinned: that is `full`): the least N with a split. Where a recomputed block holds no
        more than a kept one of its kind, more N only frees memory: a split that fits at N fits at N + 1. Where the
        split is `one` (a stage's, a fixed one's, or the programme's exact within each rank's room: a stage a rank, no
        simulated peak), its N is then found galloping from `least` (least + 1, + 3, + 7, ...) and by bisection below
        the first hit: about 2 log2 of the least N's distance from `least` calls, few where it is near (case 11), at
        most about twice bisection's where it is near `high` (tight memory). Where the programme chooses among
        splits, its finder can miss at N + 1 the split it found at N (`_moved_split`'s walk from the even split, which
        takes another way where a stage of more than N blocks is lighter: [F, F, T, F, T] over N), and bisection,
        which takes a miss at N for none below, could return a larger N than the least (more recomputation: slower);
        there, after `high` (none there: None, as before), N one after another from `least` (at most as many as
        bisection's where the least N is within a few of `least`, as it is where a stage holds a few blocks)."""
        found = split_at(least)
        if found is None and pinned is None:
            lighter = all(memory[0][kind][1] <= kept_memory[0][kind][1] for kind in self._summed)
            if lighter and split_at(high) is None:
                return None
            if lighter and one:  # a split at N is one at N + 1: the least N with one, galloping from `least`, then
                low, step = least, 1  # by bisection (no split at `low`; one at `high`)
                while low + step < high:
                    if split_at(low + step) is not None:
                        high = low + step
                        break
                    low, step = low + step, 2 * step
                while high - low > 1:
                    middle = (low + high) // 2
                    low, high = (middle, high) if split_at(middle) is None else (low, middle)
                least, found = high, split_at(high)
            while found is None and least < high:
                least += 1
                found = split_at(least)
        if found is None or (pinned is None and least >= max(found)):
            return None
        return found, least

    def mixed_offloaded(self, node: Node, zero: int, ranks, inflight, memory,
                        least: int = 1) -> tuple[tuple[int, ...], int] | None:
        """`Space._offloaded` for several kinds of block: (blocks, N) of an offloading node (one stage), or None. The
        stage holds every block's states and the kept blocks' activations, and beyond them what the largest offloaded
        block's activations exceed the largest kept one's by (`cost.memory.offload_inflight`: the block its backward
        reloads), within `mixed_partition`'s room; N is the pin, else the least that fits. None where the blocks fit
        without offloading (the node that keeps them is faster), where every block would be offloaded unpinned (it
        holds as much as all but one), and where the host cannot hold the offloaded blocks' activations
        (`cost.offload.host_capacity`, E514). N from `least` on: the exact estimate can refuse an N these figures admit
        (at a boundary: 11.5 MiB more in a 1 GiB device's estimate than these figures count for test_search_two_kinds'
        three-kind model offloading 2 blocks, its working sets and autocast copies; not traced further), and `Space.retry`
        asks again at N + 1."""
        pinned = self.pins.get("offload_layers")
        if pinned is None and self.mixed_partition(node, zero, ranks, inflight, memory) is not None \
                and self.figures.kept_fits(node, zero):
            return None
        per_kind = memory[0]
        _, caps = self._mixed_room(node.root, ranks, inflight, memory, apart=False)
        stored = self._mixed_bytes(per_kind, ranks, inflight)  # a kept block's bytes, per kind
        activations = [per_kind[kind][1] * float(inflight[ranks[0]]) for kind in self._summed]
        before = np.array([self.figures.kind_before[self.figures.block_kinds.index(kind)] for kind in self._summed])
        counts = before[:, -1:] - before  # per kind, the blocks from N on (N = 0..L)
        host = sum(a * b for a, b in zip(activations, before))  # the first N blocks' activations, away on the host
        need = sum(each[0] * count for each, count in zip(stored, before[:, -1])) - host
        away = np.max(np.where(before > 0, np.array(activations)[:, None], 0.0), axis=0)
        kept = np.max(np.where(counts > 0, np.array(activations)[:, None], 0.0), axis=0)
        need = need + np.maximum(away - kept, 0.0)
        fits = need <= caps[0]
        fits[:max(1, least)] = False  # N = 0 is the node that keeps every block
        if pinned is not None:
            least = pinned if pinned <= self.blocks and fits[pinned] else None
        else:
            least = int(fits.argmax()) if fits[:self.blocks].any() else None  # never every block unpinned
        if least is None or host[least] > host_capacity(memory[2]) * (1 + 1e-12):
            return None
        return (self.blocks,), least

    def _mixed_split(self, prefix, held, caps, fixed, stages: int, recomputed: int | None = None, rerun=None,
                     rerun_held=None):
        """`mixed_partition`'s programme, or where an end stage is the slowest (or none fits) the split with the
        first and the last stage free to hold no block (the embedding or the loss alone) where that is faster."""
        found = partition_prefixed(prefix, held, caps, fixed, False, recomputed, rerun, rerun_held)
        seconds = _table_seconds(found, prefix, fixed, recomputed, rerun) if found is not None else None
        if self.pins.get("account") is None and stages > 1 and (found is None or _end_slowest(seconds, found)):
            free = partition_prefixed(prefix, held, caps, fixed, True, recomputed, rerun, rerun_held)
            if found is None or (free is not None and
                                 max(_table_seconds(free, prefix, fixed, recomputed, rerun)) < max(seconds)):
                found = free
        return found

    def _mixed_room(self, root, ranks, inflight, memory, apart: bool = True):
        """(each stage's rank's room for blocks, whole; each stage's share of it) under `memory`: the capacity less
        the working set (the largest of the kinds of block), torch's pipeline buffers, ZeRO's gathered units, the
        embedding on the first stage and the norm and head on the last, as arrays over the stages; on one rank, plus
        what the exact estimate of its one-microbatch step holds apart from its peak (`Figures.apart`, as
        `Caps.rank_caps` counts it), unless `apart` is False (an offloading node's: its step holds nothing apart)."""
        per_kind, tied, _ = memory
        (embed_s, embed_a, _), _, (norm_s, norm_a, _), (head_s, head_a, loss) = per_kind[:4]
        working = max(per_kind[kind][2] for kind in self._summed)
        first_rank, last_rank = ranks[0], ranks[-1]
        on = np.asarray(ranks)
        first, final = on == first_rank, on == last_rank
        kept = inflight[on]
        gathered = {(a, b): self.figures.gathered(memory, a, b, 2) for a in (False, True) for b in (False, True)}
        room = self.figures.capacity(root)[on] - working - self.figures.stage_buffers(memory, ranks, inflight)[on] \
            - np.where(
            first, np.where(final, gathered[True, True], gathered[True, False]),
            np.where(final, gathered[False, True], gathered[False, False]))
        room -= np.where(first, embed_s + kept * embed_a   # and the embedding's gradient's moment, as `Caps.rank_caps`
                         + self.figures.beyond_working(memory, working, first_rank == last_rank), 0.0)
        head = self.figures.head_inflight(inflight, last_rank)  # the last stage's in flight, not its rank's
        room -= np.where(final, norm_s + head_s + head * (norm_a + head_a) + max(0.0, loss - working)
                         + (self.figures.head_copies(memory, inflight) if tied and len(ranks) > 1 else 0.0),
                         0.0)
        if apart and len(ranks) == 1:
            room = room + self.figures.apart(memory)
        return room, room / np.bincount(on)[on]  # a rank's room is shared by its stages

    def _mixed_bytes(self, per_kind, ranks, inflight) -> list:
        """Per kind of block (`_summed`'s order), a block's bytes on each stage: its states and its stage's microbatches
        in flight's activations."""
        kept = inflight[np.asarray(ranks)]
        return [per_kind[kind][0] + kept * per_kind[kind][1] for kind in self._summed]

    def _mixed_may_fit(self, room, block_bytes, ranks) -> bool:
        """Memory first, before any timing: whether the ranks could hold the blocks at the lightest kind's bytes
        (`room`: each stage's rank's, whole), each rank one a stage of its that must hold one (every stage under
        `account=none`, the middle ones unpinned: an end may hold the embedding or the loss alone); a fixed split
        (`fixes`: a pinned `account`, a kept line's) is checked by `_fixed_fits`."""
        if self.fixes:
            return True
        account = self.pins.get("account")
        lighter = np.minimum.reduce(block_bytes)
        most = np.where(lighter <= 0, self.blocks, np.maximum(room, 0.0) // np.where(lighter <= 0, 1.0, lighter))
        if len(set(ranks)) == len(ranks):  # a stage a rank
            must = most if account is not None else most[1:-1]
            return not (most.sum() < self.blocks or (must.size and must.min() < 1))
        on = np.asarray(ranks)
        must = np.ones(len(ranks))
        if account is None:
            must[0] = must[-1] = 0.0
        first = np.unique(on, return_index=True)[1]  # a rank's most, once (its stages' bytes alike)
        return not (most[first].sum() < self.blocks or (np.bincount(on, weights=must)[on] > most).any())

    def _mixed_prefixes(self, node: Node, ranks, block_bytes):
        """(each stage's fixed seconds, the kinds' seconds per stage, the cumulative seconds and bytes of the first i
        blocks on each stage, i = 0..L), each block at its own kind's figures on its stage's rank."""
        root, last = node.root, len(ranks) - 1
        summed = self._summed
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
        return fixed, per, prefix, held

    def _fixed_fits(self, counts, ranks, room, held, recomputed: int | None = None, rerun_held=None,
                    peak=None) -> bool:
        """Whether the fixed split (`fixes`: a pinned `account`, a kept line's) fits each rank's room (`room`: a stage's
        rank's, whole), each stage's first `recomputed` blocks at `rerun_held`'s bytes more, and `peak()(counts)`
        (`_shared_split`'s `peak`, made only where the rule's bytes fit: what the schedule's simulated peak holds
        beyond the in-flight rule, per rank, which the exact estimate counts) with them."""
        bounds, used = np.cumsum((0,) + counts), {}
        for s, r in enumerate(ranks):
            a, b = bounds[s], bounds[s + 1]
            used[r] = used.get(r, 0.0) + held[s][b] - held[s][a]
            if recomputed is not None:
                used[r] += rerun_held[s][min(a + recomputed, b)] - rerun_held[s][a]
        if not all(used[r] <= room[ranks.index(r)] for r in used):
            return False
        beyond = peak() if peak is not None else None
        beyond = beyond(counts) if beyond is not None else None
        return beyond is None or all(used[r] + beyond[r] <= room[ranks.index(r)] for r in used)

    def _mixed_partial_memory(self, memory, kept_memory):
        """The memory of a partly recomputed node of several kinds of block (`Caps.partial_memory`'s): the kept node's
        embedding, norm and head, each kind of block's full recomputation figures (its working set the block rebuilt),
        the states a head adds and the plan of `memory`; one object per pair (the figures key by it)."""
        key = ("mixed", id(memory), id(kept_memory))
        found = self._partial_memories.get(key)
        if found is None:
            per_kind = list(memory[0])
            per_kind[0], per_kind[2], per_kind[3] = kept_memory[0][0], kept_memory[0][2], kept_memory[0][3]
            found = self._partial_memories[key] = ((per_kind, memory[1], memory[2]), memory, kept_memory)
            self.figures.share_buffers(found[0], memory)
        return found[0]

    def layer_partition(self, node: Node, ranks, inflight, layer_memory):
        """Layers per stage of a model of layers that differ (a written model, an mlp): `partition_layers` at each
        layer's seconds and bytes on its stage's rank, a rank's room shared evenly by its stages. Where a rank of
        several stages frees each stage's unsharded gradients after its last backward (ZeRO-2/3 on torch's pipeline,
        `Figures.open_stages`), its stages count them at the largest open set's share of the rank's stages, and a
        rank the split does not fit with its largest open set's gradients counts them whole (`_released_split`'s
        way)."""
        root = node.root
        per_kind, plan = layer_memory[0], layer_memory[2]
        costs, memory, caps = [], [], []
        # ZeRO-2/3's gathered units: the two largest of the model, wherever they are (a bound); ZeRO-2's parameters,
        # whole through the step, are in each layer's states (`figures.Figures._states`), its gradients' units here;
        # under a pipeline every unit of the rank's layers is whole through the step (`cost.memory.pipelined_shards`),
        # in each layer's states: nothing beyond them
        both = (0.0, 0.0) if pipelined_shards(plan) else gathered_bytes(plan, self.layers)
        working = max(k[2] for k in per_kind) + (both[1] if gathers_whole(plan) or replicates_units(plan) else sum(both))
        for r in ranks:
            costs.append([t.forward + t.backward for t in self.figures.kind_times(node, root.rank_devices[r])])
            memory.append([k[0] + inflight[r] * k[1] for k in per_kind])
            caps.append((root.capacity[r] - working + (self.figures.apart(layer_memory) if len(ranks) == 1 else 0.0))
                        / sum(1 for q in ranks if q == r))  # one rank: what its one-microbatch step holds apart
        grads = self.figures.kind_gradients(layer_memory)
        opens = self.figures.open_stages(inflight) if grads is not None and len(ranks) > 1 else None
        stage_sets, share = _stage_sets(opens, ranks, root.pp) if opens is not None else (None, None)
        on = np.asarray(ranks)
        stages = np.bincount(on)[on]
        whole = np.asarray(caps) * stages  # each stage's rank's room, whole

        def split(rows):  # the programme's, or a fixed split's (`fixes`) where each rank holds its stages' layers
            if not self.fixes:
                return partition_layers(costs, rows, caps)
            counts = self.fixed(len(ranks))
            if counts is None:
                return None
            bounds = np.cumsum((0,) + counts)
            used = np.bincount(on, weights=[sum(row[a:b]) for row, a, b in zip(rows, bounds, bounds[1:])])
            return counts if bool((used[on] <= whole * (1 + 1e-12)).all()) else None
        if stage_sets is None:
            return split(memory)
        grads = np.asarray(grads[0])  # per layer
        weight = share.copy()
        while True:
            counted = np.asarray(memory) - (1.0 - weight)[:, None] * grads  # each stage's layers less freed gradients
            found = split(counted.tolist())
            if found is None or (weight >= 1.0).all():
                return found
            bounds = np.cumsum((0,) + tuple(found))
            held = np.asarray(memory) - grads
            used = np.array([held[s, a:b].sum() for s, (a, b) in enumerate(zip(bounds, bounds[1:]))])
            stage_grads = np.array([grads[a:b].sum() for a, b in zip(bounds, bounds[1:])])
            over = _open_over(on, used, stage_grads, stage_sets, whole)
            if not over.any():
                return found
            if self.fixes:  # the one split, which more weight leaves as it is (as `_released_split`'s)
                return None
            weight = np.where(over[on], 1.0, weight)



def _bounds(counts) -> np.ndarray:
    """Each stage's first and last block bounds of a split (blocks per stage: 0, then the running sums); of several
    splits as rows, a row each."""
    counts = np.asarray(counts, dtype=np.int64)
    bounds = np.zeros(counts.shape[:-1] + (counts.shape[-1] + 1,), dtype=np.int64)
    np.cumsum(counts, axis=-1, out=bounds[..., 1:])
    return bounds


def _rank_sums(values, on, ranks: int) -> np.ndarray:
    """Per rank, the sum of its stages' `values` (per stage; `on`: each stage's rank), added in stage order as
    `np.bincount` adds them (to the bit); of several rows (leading dimensions), a row each."""
    values = np.asarray(values, dtype=np.float64)
    if values.ndim == 1:
        return np.bincount(on, weights=values, minlength=ranks)
    sums = np.zeros(values.shape[:-1] + (ranks,))
    np.add.at(np.moveaxis(sums, -1, 0), on, np.moveaxis(values, -1, 0))
    return sums


def _stage_sets(opens, ranks, pp: int):
    """(per stage, the sets of its rank's stages open at once, stages x sets; per stage, the largest set's share of its
    rank's stages) from `Figures.open_stages`' array (ranks x a rank's stages x sets), or (None, None) where every
    rank's largest set holds all its stages."""
    sizes = opens.sum(axis=1)  # ranks x sets
    share = sizes.max(axis=1) / opens.shape[1]
    if (share >= 1.0).all():
        return None, None
    on = np.asarray(ranks)
    seen, index = [0] * pp, []
    for r in ranks:  # a stage's place among its rank's (stage order: `Figures.open_stages`' columns)
        index.append(seen[r])
        seen[r] += 1
    return opens[on, np.asarray(index)], share[on]


def _open_over(on, used, grads, stage_sets, whole, beyond=None, excess: bool = False) -> np.ndarray:
    """Per rank, whether its stages' bytes beside their gradients (`used`, per stage) and the largest sum of the
    gradients (`grads`, per stage) of a set of its stages open at once, and `beyond` (per rank: the schedule's
    simulated peak beyond the in-flight rule, `Caps.peak_beyond_rule`), exceed its room (`whole`, per stage: its
    rank's): what the exact estimate counts of them (`cost.memory.estimate_memory`, `open_gradients`). `excess`: by
    how much (positive where it does)."""
    ranks = int(on.max()) + 1
    most = np.zeros(np.shape(used)[:-1] + (ranks,))
    for k in range(stage_sets.shape[1]):
        most = np.maximum(most, _rank_sums(grads * stage_sets[:, k], on, ranks))
    room = np.zeros(ranks)
    room[on] = whole
    need = _rank_sums(used, on, ranks) + most
    if beyond is not None:
        need = need + beyond
    return need - room * (1 + 1e-12) if excess else need > room * (1 + 1e-12)


def _moved_split(counts, excess, seconds, ends_free: bool, tries: int = _PEAK_TRIES):
    """The fastest split (least `seconds(split)`) among those one block moved across a bound between two stages from
    `counts` that fit (`excess(splits)`, per split, as rows, and rank, none above 0); where none does, the same from the one of them least
    over (its largest excess), `tries` rounds at most; None where no split so reached fits. Each stage holds a block at
    least, the first and the last none where `ends_free` (an end may hold the embedding or the loss alone)."""
    least = [0 if ends_free and s in (0, len(counts) - 1) else 1 for s in range(len(counts))]
    seen = {tuple(counts)}
    current = tuple(counts)
    for _ in range(tries):
        moved = []
        for s in range(len(current) - 1):
            for into, out in ((s, s + 1), (s + 1, s)):
                if current[out] > least[out]:
                    each = list(current)
                    each[out] -= 1
                    each[into] += 1
                    if tuple(each) not in seen:
                        seen.add(tuple(each))
                        moved.append(tuple(each))
        if not moved:
            return None
        over = excess(np.array(moved)).max(axis=-1).tolist()  # every moved split at once: one row each
        fits = [each for each, o in zip(moved, over) if o <= 0]
        if fits:
            return min(fits, key=seconds)
        current = moved[int(np.argmin(over))]
    return None


def _stage_seconds(counts, fixed, per_block) -> list[float]:
    """Each stage's seconds under a split of identical blocks (`partition_blocks` minimises the slowest)."""
    return [f + n * b for f, n, b in zip(fixed, counts, per_block)]


def _table_seconds(counts, prefix, fixed, recomputed: int | None = None, rerun=None) -> list[float]:
    """Each stage's seconds under a split of layers that differ (`partition_prefixed` minimises the slowest), each
    stage's first `recomputed` layers at `rerun`'s seconds more."""
    bounds = np.cumsum((0,) + tuple(counts))
    seconds = [fixed[s] + prefix[s][bounds[s + 1]] - prefix[s][bounds[s]] for s in range(len(counts))]
    if recomputed is not None:
        seconds = [each + rerun[s][min(bounds[s] + recomputed, bounds[s + 1])] - rerun[s][bounds[s]]
                   for s, each in enumerate(seconds)]
    return seconds


def _end_slowest(seconds: list[float], counts, one_block: bool = False) -> bool:
    """Whether the first or the last stage is the slowest (`one_block`: and holds one block): only then can a split
    leaving it empty be faster. Under identical blocks an end's lower bound of one block can make the split slower
    only where that end holds one block: the least slowest over splits with the ends free is below the least with
    them at one only where one block there costs more than it."""
    slowest = max(seconds)
    return any((counts[s] == 1 or not one_block) and seconds[s] >= slowest for s in (0, len(counts) - 1))


__all__ = ["Splits"]
