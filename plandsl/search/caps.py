"""How many blocks each pipeline rank can hold within its memory (the caps a leaf's partition keeps to).

Stage: inside the search, above the figures. Contract: `Caps` turns a leaf's per-kind memory
(`Figures.layer_memory`), its stages' ranks and its in-flight microbatches into the most blocks per
rank, as one array operation over the ranks; once per layout (memory does not depend on the mesh order).
"""
from __future__ import annotations

import numpy as np

from plandsl.search.choices import stages_by_rank
from plandsl.search.figures import Figures
from plandsl.search.tree import Root

_WINDOWS = (np.arange(4.0), np.arange(4.0, 20.0))  # what `Caps._held_caps` tries first below the rule's caps
_ROWS = 8  # rows of N `Caps._rank_caps` lowers at a time for `Caps.least_recomputed`


def _whole(caps: np.ndarray) -> np.ndarray:
    """Caps as whole blocks, none below 0 nor above 2**62 (`np.clip`'s result, without its dispatch)."""
    return np.minimum(np.maximum(caps, 0), 2**62).astype(np.int64)


class Caps:
    def __init__(self, figures: Figures):
        self.figures = figures
        self.blocks = figures.blocks
        self._caps_cache: dict = figures.memory_caches.setdefault("caps", {})  # shared as the figures' memory
        self._partial_cache: dict = figures.memory_caches.setdefault("partial", {})
        self._offload_cache: dict = figures.memory_caches.setdefault("offload", {})
        self._held_cache: dict = figures.memory_caches.setdefault("held_room", {})
        self._bound_cache: dict = figures.memory_caches.setdefault("released_bound", {})  # `_released_bound`'s
        self._rank_order: dict = {}
        self.one_kind = figures.transformer and not figures.dense_blocks  # `may_admit`'s: one kind of block

    def rank_caps(self, root: Root, ranks, inflight: np.ndarray, memory, recomputed: int | None = None,
                  kept: float = 0.0, held: bool = False, virtual: int | None = None) -> np.ndarray:
        """`_rank_caps`, and on a rank that holds every layer, whose ZeRO-2/3 units are placed by moment, no more blocks
        than fit the embedding's backward (`Figures.end_moment`: the blocks' activations freed there, the embedding's
        whole-vocabulary gradient beside the units, `cost.memory.fsdp_apart`'s `end`). `virtual` given: caps that admit
        no split already by the rule's count (`_admit`) are not lowered further (`_held_caps` only lowers them), as
        `caps` and `least_recomputed`, which ask only whether they admit one, need; rows of N past those that hold the
        least N whose caps admit one are then -1 (`_rank_caps`)."""
        caps = self._rank_caps(root, ranks, inflight, memory, recomputed, kept, held, virtual)
        end = self.figures.end_moment(memory) if len(ranks) == 1 else None
        if end is not None and end[1] > 0.0:
            fixed, per = end
            capacity = self.figures.capacity(root)
            caps = np.minimum(caps, _whole(np.floor((capacity[ranks[0]] - fixed) / per)))
        return caps

    def _rank_caps(self, root: Root, ranks, inflight: np.ndarray, memory, recomputed: int | None = None,
                   kept: float = 0.0, held: bool = False, virtual: int | None = None) -> np.ndarray:
        """The most blocks each rank holds within its memory: its capacity less the embedding (first
        stage), the norm and head (last), the working set, ZeRO's gathered units and torch's pipeline stage's
        buffers (`Figures.stage_buffers`, at most the exact estimate's), over a block's
        states plus its in-flight microbatches' activations. One array operation over the ranks (a
        pipeline of 4,096 ranks costs what one of 4 does, per leaf). `recomputed` (`recompute_layers`):
        the first that many blocks of each stage store `memory`'s block activations, the others `kept`
        bytes (their own); a rank's blocks are its stages' evenly, so it recomputes min(B, stages x N)
        of B blocks (as many as any split of B recomputes at most). These caps (the in-flight rule's) never count more
        than the exact estimate; it can refuse a split within them (`split_fits`). `held`: lowered to what the
        schedule's simulated peak leaves room for (`_held_caps`), the caps of the exact estimate for the split
        `Splits.transformer_partition` makes of a rank's blocks, within which it refuses none. `recomputed` as an array
        of N: one row of the rule's caps per N. Where a rank holds only its open stages' unsharded gradients
        (`_released`: ZeRO-2/3 on torch's pipeline, several stages a rank, `cost.memory.open_gradient_stages`), the
        rule's caps count no more than they hold (`_released_bound`) and are lowered, held or not, to the most blocks
        whose even split fits with the largest open set's gradients (`_held_caps`), as the exact estimate counts.
        Without a pipeline (one rank, which holds every block) where the exact estimate of a step of one microbatch
        leaves the gradients its one backward makes out of its peak (`Figures.apart`), the rank's room is that much
        larger: the caps' count of every block less those bytes is no more than the exact estimate (which counts the
        same terms, then leaves them out), so that the cap reaches the model's blocks wherever the exact estimate fits
        them (the only figure a one-rank cap is compared to)."""
        per_kind, tied, _ = memory
        (embed_s, embed_a, _), (block_s, block_a, working), (norm_s, norm_a, _), (head_s, head_a, loss) = per_kind
        figures = self.figures
        first_rank, last_rank = ranks[0], ranks[-1]
        fixed = {first_rank: 0.0, last_rank: 0.0}
        # the embedding's working set, its whole-vocabulary gradient's moment, where larger than the rebuilt block's
        fixed[first_rank] += embed_s + float(inflight[first_rank]) * embed_a \
            + figures.beyond_working(memory, working, first_rank == last_rank)
        # the head's working set is the loss's backward (`cost.memory.loss_backward_bytes`): the last rank's
        # peak moment is the larger of it and the block rebuilt by recomputation; the norm and head hold the last
        # stage's microbatches in flight, not its rank's (`Figures.head_inflight`: one in the 1F1B family)
        head = figures.head_inflight(inflight, last_rank)
        fixed[last_rank] += norm_s + head_s + head * (norm_a + head_a) + max(0.0, loss - working)
        if tied and len(ranks) > 1:  # the head's stage copies the embedding, on the first rank too (a V-shape's), twice
            fixed[last_rank] += figures.head_copies(memory, inflight)  # twice where the tied head's weight is apart
        capacity = figures.capacity(root)
        if len(ranks) == 1 and figures.apart(memory):  # one rank, every block: what its step holds apart from its peak
            capacity = capacity + figures.apart(memory)
        released = self._released(memory, inflight)
        grads = released[1] if released is not None else None
        if released is not None:  # the rule's caps at most (`_held_caps` lowers them to the open stages' gradients)
            block_s, capacity = self._released_bound(released, ranks, block_s, capacity, fixed)
        elif recomputed is None and not held:
            return self._rule_caps(memory, ranks, inflight, fixed, capacity, block_s, block_a, working)
        per = block_s + inflight * block_a
        per_kept = block_s + inflight * kept if recomputed is not None else per
        # the blocks a rank recomputes at most; an array of N: one row of caps per N
        rerun = len(ranks) // root.pp * (recomputed[:, None] if isinstance(recomputed, np.ndarray) else recomputed or 0)

        def within(room, per, per_kept):
            if recomputed is None:
                return room // per
            if isinstance(room, float) and isinstance(rerun, int):  # one rank's Python floats: no 0-d arrays
                return rerun + (room - rerun * per) // per_kept if room >= rerun * per else room // per
            return np.where(room >= rerun * per, rerun + (room - rerun * per) // per_kept, room // per)

        free = per_kept <= 0  # a block that costs a rank nothing (no states, no activations): any number fits
        any_free = bool(free.any())
        if any_free:
            per, per_kept = np.where(free, 1.0, per), np.where(free, 1.0, per_kept)
        # torch's pipeline stage's buffers (`cost.memory.torch_stage_bytes`): a rank's, whatever its blocks
        buffers = self.figures.stage_buffers(memory, ranks, inflight)
        room = capacity - working - buffers
        one, two = self.figures.gathered(memory, False, False, 1), self.figures.gathered(memory, False, False, 2)
        caps = within(room - two, per, per_kept)  # blocks that fit in the room less the gathered units
        if one != two:  # a rank with 1 block gathers less than one with >= 2 blocks: where 2 do not fit, 1 may
            caps = np.where(caps >= 2, caps, np.minimum(within(room - one, per, per_kept), 1))
        if any_free:
            caps = np.where(free, float(self.blocks), caps)
        if np.ndim(rerun):  # rows of N: the first and last ranks' columns as the loop below, for every row at once
            caps = np.array(caps, dtype=np.float64)
            for r in fixed:
                room = float(capacity[r]) - fixed[r] - working - float(buffers[r])
                gathered = self.figures.gathered
                two = within(room - gathered(memory, r == first_rank, r == last_rank, 2), per[r], per_kept[r])
                one = within(room - gathered(memory, r == first_rank, r == last_rank, 1), per[r], per_kept[r])
                caps[:, r] = self.blocks if free[r] else np.where(two >= 2, two, np.minimum(one, 1.0))[:, 0]
            if grads is not None and virtual is None:  # each row lowered to the gradients of the stages open at once,
                caps = self._held_caps(root, ranks, inflight, memory, caps, recomputed, kept, free, buffers, False)
            elif grads is not None:  # as `caps` lowers N's: `_ROWS` rows at a time from the first that admits a split
                # by the rule (the rows before admit none lowered either) to those holding the first that admits one
                # lowered; the rows past them -1, left out. Each row's lowering is its own, the same operations on a
                # C-ordered run of the rows.
                admits = self._admit(_whole(caps), virtual)
                if not admits.any():
                    return _whole(caps)
                start = int(admits.argmax())
                while start < len(caps):
                    rows = slice(start, start + _ROWS)
                    caps[rows] = self._held_caps(root, ranks, inflight, memory, caps[rows], recomputed[rows], kept,
                                                 free, buffers, False)
                    start += _ROWS
                    if self._admit(_whole(caps[rows]), virtual).any():
                        caps = _whole(caps)
                        caps[start:] = -1
                        return caps
            return _whole(caps)  # as the in-flight rule counts: at least the caps of each N (`least_recomputed`)
        for r in fixed:  # the first and last ranks, one at a time (`cost.memory` order of terms)
            room = float(capacity[r]) - fixed[r] - working - float(buffers[r])
            cap = self.blocks
            for blocks in (2, 1):
                if free[r]:
                    break
                cap = room - self.figures.gathered(memory, r == first_rank, r == last_rank, blocks)
                cap = float(within(cap, float(per[r]), float(per_kept[r])))
                if blocks == 1:  # gathering one unit, the rank holds one block at most (two gather two)
                    cap = min(cap, 1.0)
                elif cap >= 2:
                    break
            caps[r] = cap
        if (held or grads is not None) and (virtual is None or self._admit(_whole(caps), virtual)):
            caps = self._held_caps(root, ranks, inflight, memory, caps, recomputed, kept, free, buffers, held)
        return _whole(caps)

    def may_admit(self, root: Root, ranks, inflight: np.ndarray, memory, virtual: int) -> bool:
        """False where no caps of a node that keeps or recomputes all of its blocks can admit a split (`caps` None,
        `fitted_partition` None), by a few array operations before any of theirs: each rank's room taken as its
        capacity less the working set (the ends' states and activations, torch's stage buffers and ZeRO's gathered
        units, which `_rank_caps` takes out of it too, are left in: none is below 0), over a block's states (less the
        gradients its rank frees, `_released_bound`, as `_rank_caps` counts) and its activations by the in-flight rule;
        `_held_caps` and `end_moment` only lower those caps. So these caps are at least `rank_caps`' on every rank, and
        where they admit no split neither do those: `caps` asks it first (of a pipeline's node that keeps or recomputes
        all of its blocks, one kind of them) and computes none of `rank_caps`' terms where it refuses."""
        _, (block_s, block_a, working), _, _ = memory[0][:4]
        capacity = self.figures.capacity(root)
        released = self._released(memory, inflight)
        if released is not None:  # the ends' lowered `fixed` left out, as the rest of theirs
            block_s, capacity = self._released_bound(released, ranks, block_s, capacity, {ranks[0]: 0.0, ranks[-1]: 0.0})
        per = block_s + inflight * block_a
        if not bool((per > 0.0).all()):  # a block that costs a rank nothing: any number fits there
            return True
        return bool(self._admit(_whole((capacity - working) // per), virtual))

    def _admit(self, caps: np.ndarray, virtual: int):
        """Whether whole caps (a row each, or one array) admit a split: every block somewhere, and a block on each of
        a rank's `virtual` stages (`caps`' test; each cap taken at most at that, so that no int64 sum overflows)."""
        caps = np.minimum(caps, max(self.blocks, virtual))
        return (caps.sum(axis=-1) >= self.blocks) & (caps.min(axis=-1) >= virtual)

    def _rule_caps(self, memory, ranks, inflight, fixed, capacity, block_s, block_a, working) -> np.ndarray:
        """`rank_caps` of a node that recomputes all or none of its blocks, by the in-flight rule alone: the same
        operations on the same figures, fewer of them (no `within`: every block stores `per`)."""
        figures = self.figures
        per = block_s + inflight * block_a
        # a block that costs a rank nothing (no states, no activations: `per` 0, the counts in flight never below 0)
        free = None if block_s > 0.0 and block_a >= 0.0 else per <= 0
        if free is not None and not free.any():
            free = None
        if free is not None:
            per = np.where(free, 1.0, per)
        buffers = figures.stage_buffers(memory, ranks, inflight)
        room = capacity - working - buffers
        gathered = figures.gathered
        one, two = gathered(memory, False, False, 1), gathered(memory, False, False, 2)
        caps = (room - two) // per  # blocks that fit in the room less the gathered units
        if one != two:  # a rank with 1 block gathers less than one with >= 2 blocks: where 2 do not fit, 1 may
            caps = np.where(caps >= 2, caps, np.minimum((room - one) // per, 1))
        if free is not None:
            caps = np.where(free, float(self.blocks), caps)
        first_rank, last_rank = ranks[0], ranks[-1]
        for r, ends in fixed.items():  # the first and last ranks, one at a time (`cost.memory` order of terms)
            if free is not None and free[r]:
                caps[r] = self.blocks
                continue
            room_r = float(capacity[r]) - ends - working - float(buffers[r])
            per_r = float(per[r])
            cap = float((room_r - gathered(memory, r == first_rank, r == last_rank, 2)) // per_r)
            if cap < 2:  # gathering one unit, the rank holds one block at most (two gather two)
                cap = min(float((room_r - gathered(memory, r == first_rank, r == last_rank, 1)) // per_r), 1.0)
            caps[r] = cap
        return _whole(caps)

    def split_fits(self, root: Root, ranks, inflight, memory, counts, recomputed: int | None = None,
                   kept: float = 0.0) -> bool:
        """Whether the exact estimate fits a split (blocks per stage) within the rule's caps on every rank: by the
        in-flight rule with the blocks each stage recomputes, and by the schedule's simulated peak where it holds more
        (`Figures.held`): the terms `_held_caps` counts, for this split. By the rule alone any split within the caps
        fits: each stage holds at most its share of the caps' even split, which they count (needs only grow with a
        stage's blocks, recomputed first or kept)."""
        held = self.figures.held(inflight)
        if held is None:
            return True
        key = ("fits", self.figures.memory_class(memory), ranks, id(inflight), root.capacity, counts, recomputed, kept)
        found = self._caps_cache.get(key)
        if found is None:
            found = self._caps_cache[key] = self._split_fits(root, ranks, inflight, memory, counts, recomputed, kept,
                                                             held)
        return found

    def _split_fits(self, root: Root, ranks, inflight, memory, counts, recomputed, kept, held) -> bool:
        need, room = self._split_need(root, ranks, inflight, memory, counts, recomputed, kept, held)
        return bool((need <= room + room * 1e-12).all())

    def split_room(self, root: Root, ranks, inflight, memory, counts) -> np.ndarray:
        """Each rank's bytes a split (blocks per stage) of a node that keeps or recomputes all of its blocks leaves of
        its capacity as `split_fits` counts them (the in-flight rule, the schedule's simulated peak where it holds more,
        the open stages' gradients): the exact estimate's terms, ZeRO-1's optimizer states counted even
        (`Figures.caps_gap`). Negative where the split does not fit."""
        need, room = self._split_need(root, ranks, inflight, memory, counts, None, 0.0, self.figures.held(inflight))
        return room - need

    def peak_beyond_rule(self, root: Root, ranks, inflight, memory, stored) -> np.ndarray | None:
        """Per rank, the bytes the schedule's simulated peak of activations holds beyond the in-flight rule's count
        (`_need`'s two figures: the exact estimate takes the larger), where each stage holds `stored` bytes of
        activations a microbatch (per stage, in stage order; blocks of several kinds: `Splits._shared_split`; any leading
        dimensions: several splits' at once); None where the simulation holds no more than the rule (`Figures.held`)."""
        held = self.figures.held(inflight)
        if held is None:
            return None
        pp, chunks = root.pp, len(ranks) // root.pp
        buffers = self.figures.stage_buffers(memory, ranks, inflight)
        ends, _, _, _, moments, rule_ends = self._held_room(root, ranks, inflight, memory, chunks, held, buffers)[:6]
        order = self._rank_order.get(ranks)
        if order is None:  # the stages rank by rank, each rank's in stage order
            order = self._rank_order[ranks] = np.array([s for stages in stages_by_rank(ranks, pp) for s in stages])
        stored = np.asarray(stored, dtype=np.float64)
        # in C order as one split's are: a gather of rows' last axis comes back column-major, where matmul does not
        # take BLAS's path, and adds a rank's 4 chunks or more in another order than one split's (not to the bit)
        stored = np.ascontiguousarray(stored[..., order]).reshape(stored.shape[:-1] + (pp, chunks))
        rule = inflight * stored.sum(axis=-1) + rule_ends
        simulated = np.matmul((stored + ends)[..., None, :], moments).max(axis=-1)[..., 0]
        return np.maximum(simulated - rule, 0.0)

    def _split_need(self, root: Root, ranks, inflight, memory, counts, recomputed, kept, held) -> tuple:
        """(each rank's bytes beside its room with the split `counts`, its room): `split_fits`' figures."""
        pp, chunks = root.pp, len(ranks) // root.pp
        block_a = memory[0][1][1]
        buffers = self.figures.stage_buffers(memory, ranks, inflight)
        room_figures = self._held_room(root, ranks, inflight, memory, chunks, held, buffers)
        order = self._rank_order.get(ranks)
        if order is None:  # the stages rank by rank, each rank's in stage order
            order = self._rank_order[ranks] = np.array([s for stages in stages_by_rank(ranks, pp) for s in stages])
        n = np.asarray(counts, dtype=np.float64)[order].reshape(pp, chunks)  # blocks per rank and stage
        stored = n * block_a if recomputed is None else \
            np.minimum(n, recomputed) * block_a + np.maximum(n - recomputed, 0) * kept
        return self._need(n.sum(axis=1), n, stored, inflight, room_figures), room_figures[1]

    @staticmethod
    def _need(blocks, n, stored, inflight, room_figures, simulated: bool = True):
        """Each rank's bytes beside its room (`_held_room`) with `n` blocks on each of its stages (`blocks` in all, their
        activations `stored` a microbatch), as the exact estimate counts them: the states growing with the blocks, the
        activations by the in-flight rule (`cost.memory.estimate_memory`: the rank's in flight, the head's own) or by
        the schedule's simulated peak where it holds more (the largest sum(held x bytes) over its moments), ZeRO's
        gathered units, and the unsharded gradients of the rank's stages open at once where it frees them stage by
        stage (`Figures.open_stages`: the largest sum over an open set). Any leading dimensions."""
        _, _, units, _, moments, rule_ends, opens, ends_g, block_lin, block_g = room_figures
        activations = inflight * stored.sum(axis=-1) + rule_ends
        if moments is not None and simulated:
            ends = room_figures[0]
            activations = np.maximum(activations, np.matmul((stored + ends)[..., None, :], moments).max(axis=-1)[..., 0])
        need = blocks * block_lin + activations + np.where(blocks >= 2, units[1], units[0])
        if opens is not None:
            need = need + np.matmul((n * block_g + ends_g)[..., None, :], opens).max(axis=-1)[..., 0]
        return need

    def _released_bound(self, released, ranks, block_s, capacity, fixed):
        """(a block's states, the ranks' capacities) that count, linearly in a rank's blocks B, no more unsharded
        gradients than its open stages hold (`_need`), the ends' in `fixed` lowered alike: where a rank's largest open
        set S has k of its c stages, the even split puts at least floor(B / c) >= (B - c + 1) / c blocks on each, so S
        holds at least k (B - c + 1) / c blocks' and the ends' of its stages (S the one that holds the most of the
        ends); unchanged where some set holds every stage."""
        opens, (block_g, embed_g, head_g) = released
        found = self._bound_cache.get((id(opens), ranks))
        if found is None or found[0] is not opens:
            chunks = opens.shape[1]
            sizes = opens.sum(axis=1)  # ranks x sets
            k = sizes.max(axis=1)
            full = k >= chunks
            first_rank, last_rank = ranks[0], ranks[-1]
            dropped = {first_rank: [False, False], last_rank: [False, False]}  # the embedding's, the head's
            for r in dropped:
                if not full[r]:
                    ends = 2.0 * opens[r, 0] * (r == first_rank) + opens[r, chunks - 1] * (r == last_rank)
                    chosen = int(np.argmax(4.0 * sizes[r] + ends))  # a largest set, the one with the most ends
                    dropped[r] = [r == first_rank and not opens[r, 0, chosen],
                                  r == last_rank and not opens[r, chunks - 1, chosen]]
            found = self._bound_cache[(id(opens), ranks)] = (
                opens, np.where(full, 0.0, 1.0 - k / chunks), np.where(full, 0.0, k * (chunks - 1) / chunks), dropped)
        _, freed, credit, dropped = found
        for r, (embed, head) in dropped.items():
            fixed[r] -= embed_g * embed + head_g * head
        return block_s - block_g * freed, capacity + credit * block_g

    def _released(self, memory, inflight):
        """(`Figures.open_stages`, (a block's, the embedding's, the norm's and head's with the copies of the embedding
        its stage holds) gradients, `Figures.gradients`) where a rank frees its stages' gradients apart, else None."""
        grads = self.figures.gradients(memory)  # first: no schedule is laid out for memories that hold them all
        opens = self.figures.open_stages(inflight) if grads is not None else None
        if opens is None:
            return None
        block_g, embed_g, head_g, copy_g = grads  # the head's stage's copies of the embedding (`Figures.tied_copies`)
        return opens, (block_g, embed_g, head_g + copy_g * self.figures.tied_copies(inflight))

    def _held_caps(self, root: Root, ranks, inflight, memory, caps, recomputed, kept: float, free, buffers,
                   simulated: bool = True):
        """`caps` (as the in-flight rule counts a rank's activations) lowered to what the schedule's simulated peak
        leaves room for, which the exact estimate takes where it is higher (`cost.estimate`: the simulation's peak of
        each stage's saved activations by the microbatches each stage holds, `Figures.held`): a zero-bubble schedule's
        deferred weight gradients, the uneven chunks of an interleaved or V-shaped rank (which chunk holds more
        microbatches, and which the kept blocks). A rank's blocks are its stages' evenly, the earlier stages one more
        (`Splits.transformer_partition`'s stage caps), the first N of each stage recomputed (`recompute_layers`), so
        that the caps are what fits of that split: the largest B, tried a few at a time below the rule's and then by
        bisection (the need only grows with B), for every rank at once. Unchanged where the simulation holds no more."""
        held = self.figures.held(inflight)
        released = self._released(memory, inflight)
        if (held is None or not simulated) and released is None:
            return caps
        block_a = memory[0][1][1]
        chunks = held.shape[2] if held is not None else released[0].shape[1]
        room_figures = self._held_room(root, ranks, inflight, memory, chunks, held, buffers)
        room, turns = room_figures[1], room_figures[3]
        rerun = recomputed[:, None, None] if isinstance(recomputed, np.ndarray) else recomputed  # rows of N: per row

        def need(blocks):  # each rank's bytes beside its room with `blocks` blocks, split evenly over its stages
            n = (blocks // chunks)[..., None] + (turns < (blocks % chunks)[..., None])
            stored = n * block_a if rerun is None else np.minimum(n, rerun) * block_a + np.maximum(n - rerun, 0) * kept
            return self._need(blocks, n, stored, inflight, room_figures, simulated)

        rule = caps
        caps = np.minimum(caps, float(self.blocks * chunks))  # more: no stage's cap binds
        slack = room * 1e-12  # bytes summed in another order than the exact estimate's: never below it
        # B, B - 1, ..., B - 3 at once (the simulated peak lowers 95 in 100 caps of a 6,144-GPU search by 3 at most),
        # then B - 4 ... B - 19, then by bisection
        over = (caps > 0) & ~free
        for window in _WINDOWS:
            tried = np.maximum(caps - window.reshape((-1,) + (1,) * caps.ndim), 0.0)
            fits = need(tried) <= room + slack
            if window[0] == 0:
                over &= ~fits[0]
                if not over.any():
                    return rule
                lowered = over.copy()
            within = fits.any(axis=0)
            caps = np.where(over & within, np.maximum(caps - window[fits.argmax(axis=0)], 0.0), caps)  # the first
            over &= ~within
            if not over.any():
                return np.where(lowered, caps, rule)
        low, high = np.zeros_like(caps), tried[-1]  # `high` does not fit; `low` fits, or is 0
        while True:
            open_ = over & (high - low > 1)
            if not open_.any():
                break
            middle = np.floor((low + high) / 2)
            fits = need(np.where(open_, middle, low)) <= room + slack
            low, high = np.where(open_ & fits, middle, low), np.where(open_ & ~fits, middle, high)
        return np.where(over, low, np.where(lowered, caps, rule))

    def _held_room(self, root: Root, ranks, inflight, memory, chunks: int, held, buffers) -> tuple:
        """`_held_caps`' figures of a node's memory, stages and schedule, whatever its N: per rank and stage the
        embedding's and the norm and head's activations, the room for the blocks and their activations, and ZeRO's
        gathered units with one block and with two or more (`cost.memory` terms, as `rank_caps` counts them)."""
        capacity = self.figures.capacity(root)
        key = (self.figures.memory_class(memory), ranks, id(inflight), id(capacity))  # `inflight`, `capacity`: cached
        found = self._held_cache.get(key)
        if found is not None:
            return found
        per_kind, tied, _ = memory
        (embed_s, embed_a, _), (block_s, _, working), (norm_s, norm_a, _), (head_s, head_a, loss) = per_kind[:4]
        pp = root.pp
        first_rank, last_rank = ranks[0], ranks[-1]
        ends = np.zeros((pp, chunks))
        ends[first_rank, 0] += embed_a
        ends[last_rank, chunks - 1] += norm_a + head_a
        rule_ends = np.zeros(pp)  # the in-flight rule's: the rank's in flight, the head's own (`head_inflight`)
        rule_ends[first_rank] += float(inflight[first_rank]) * embed_a
        rule_ends[last_rank] += self.figures.head_inflight(inflight, last_rank) * (norm_a + head_a)
        room = capacity - working - buffers
        room[first_rank] -= embed_s + self.figures.beyond_working(memory, working, first_rank == last_rank)
        room[last_rank] -= norm_s + head_s + max(0.0, loss - working) \
            + (self.figures.head_copies(memory, inflight) if tied and len(ranks) > 1 else 0.0)
        units = []
        for blocks in (1, 2):
            unit = np.full(pp, self.figures.gathered(memory, False, False, blocks))
            for r in {first_rank, last_rank}:
                unit[r] = self.figures.gathered(memory, r == first_rank, r == last_rank, blocks)
            units.append(unit)
        released = self._released(memory, inflight)
        opens, ends_g, block_lin, block_g = None, None, block_s, 0.0
        if released is not None:  # the gradients counted apart: the blocks' and the ends' out of the states and room
            opens, (block_g, embed_g, head_g) = released
            ends_g = np.zeros((pp, chunks))
            ends_g[first_rank, 0] += embed_g
            ends_g[last_rank, chunks - 1] += head_g
            room = room + ends_g.sum(axis=1)
            block_lin = block_s - block_g
        found = self._held_cache[key] = (ends, room, units, np.arange(chunks),
                                         None if held is None else held.transpose(0, 2, 1).copy(), rule_ends, opens,
                                         ends_g, block_lin, block_g)
        return found

    def caps(self, root: Root, ranks, inflight, memory, virtual, recomputed: int | None = None, kept: float = 0.0,
             held: bool = False):
        """`rank_caps` as a list, or None when no split fits them; they depend on memory, not on where the
        groups sit, so once for every mesh order of a layout."""
        key = (self.figures.memory_class(memory), ranks, id(inflight), root.capacity, recomputed, kept) + \
            ((True,) if held else ())
        rank_caps = self._caps_cache.get(key, False)  # memory, inflight: cached objects
        if rank_caps is False and recomputed is None and not held and len(ranks) > 1 and self.one_kind \
                and not self.may_admit(root, ranks, inflight, memory, virtual):
            rank_caps = self._caps_cache[key] = None
        elif rank_caps is False:
            found = self.rank_caps(root, ranks, inflight, memory, recomputed, kept, held, virtual)
            rank_caps = self._caps_cache[key] = found.tolist() if self._admit(found, virtual) else None
        return rank_caps

    def least_recomputed(self, root: Root, ranks, inflight, partial, virtual, kept: float) -> int | None:
        """The least N (recompute_layers) whose caps admit a split, or None: the caps of every N from 1 to
        the most blocks a stage can hold in one array operation (by bisection where that array would be
        large: the caps only grow with N)."""
        high = self.blocks - len(ranks) + 1
        key = ("least", self.figures.memory_class(partial), ranks, id(inflight), root.capacity, kept)
        found = self._caps_cache.get(key, False)
        if found is not False:
            return found
        if high * root.pp <= 1 << 16:
            choices = np.arange(1, high + 1, dtype=np.float64)
            caps = self.rank_caps(root, ranks, inflight, partial, choices, kept, virtual=virtual)
            fits = self._admit(caps, virtual)
            found = int(choices[int(fits.argmax())]) if fits.any() else None
            if found is not None:  # each row from N = found on is what `caps` gives for its N (the same operations),
                for n, row, fit in zip(range(found, high + 1), caps[found - 1:].tolist(), fits[found - 1:].tolist()):
                    if row[0] < 0:  # but the rows left out
                        break
                    self._caps_cache[(key[1], ranks, id(inflight), root.capacity, n, kept)] = row if fit else None
        elif self.caps(root, ranks, inflight, partial, virtual, high, kept) is None:
            found = None
        else:
            low = 0
            while high - low > 1:  # the caps at `high` admit a split; at `low`, none (or N = 0, not a choice)
                middle = (low + high) // 2
                low, high = (middle, high) if self.caps(root, ranks, inflight, partial, virtual, middle, kept) is None \
                    else (low, middle)
            found = high
        self._caps_cache[key] = found
        return found

    def partial_memory(self, memory, kept_memory) -> tuple[tuple, float]:
        """The per-kind memory of a partly recomputed node: a recomputed block's (states, activations, working
        set) from `memory` (full), the embedding's, norm's and head's from `kept_memory` (recompute_layers
        leaves them as they are), and a kept block's activations; one object per pair (`caps` keys by it)."""
        key = (id(memory), id(kept_memory))
        found = self._partial_cache.get(key)
        if found is None:
            block, tied, plan = memory[0][1], memory[1], memory[2]
            kept_embed, kept_block, kept_norm, kept_head = kept_memory[0][:4]
            found = self._partial_cache[key] = (([kept_embed, block, kept_norm, kept_head], tied, plan),
                                                kept_block[1], memory, kept_memory)
            self.figures.share_buffers(found[0], memory)
        return found[0], found[1]


    def offload_memory(self, memory) -> tuple[tuple, float]:
        """The per-kind memory of an offloading node (`offload_layers`) in `partial_memory`'s form, for `rank_caps`'
        `recomputed` N: an offloaded block keeps its states and no activations on the device, a kept block its own
        (the second value), and the working sets are `none`'s (`cost.memory.offload_inflight`: a reloaded block
        replaces a kept one on the device, and only a stage that keeps no block holds one more: N = L - 1 holds as
        much, so the caps never exceed the exact estimate and the least N that fits is the same)."""
        found = self._offload_cache.get(id(memory))
        if found is None:
            (embed, (block_s, block_a, working), norm, (head_s, head_a, loss)), tied, plan = memory[0][:4], *memory[1:]
            moved = ([embed, (block_s, 0.0, working), norm, (head_s, head_a, loss)], tied, plan)
            found = self._offload_cache[id(memory)] = (moved, block_a, memory)  # the memory kept alive: ids stay
            self.figures.share_buffers(moved, memory)
        return found[0], found[1]


__all__ = ["Caps"]
