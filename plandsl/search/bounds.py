"""Seconds of a leaf's stages and the lower bounds of the search: a node's (the work spread perfectly, one
microbatch's chain through every layer), a node's leaves' before their partition (the busiest rank over
every split of the blocks) and a partitioned leaf's (each rank's work between the first microbatch's
arrival and the last gradient's return, plus its exposed reduction and optimizer step).

Stage: inside the search, above the figures. Contract: every bound is at most the step time
`cost.estimate` gives any plan below it (tests/unit/test_search.py checks it against brute force);
a transformer stage is (embedding?) + n blocks + (norm and head?), its seconds memoised per node and shape.
"""
from __future__ import annotations

import functools
import itertools
import math

import numpy as np

from plandsl.cost.estimate import pipeline_p2p_seconds
from plandsl.cost.layer import LayerTime
from plandsl.cost.stage import (StageTime, bucket_element, bucket_params, first_bucket, fsdp_units, gather_units,
                                rank_tail, stage_time, zero_traffic)
from plandsl.schedules.registry import BUILTIN
from plandsl.search.choices import stage_ranks, stages_by_rank
from plandsl.search.figures import Figures
from plandsl.search.partition import least_slowest
from plandsl.search.tree import Node


def _sums(time: LayerTime, count: int = 1) -> tuple[float, ...]:
    return (count * time.forward, count * time.input_grad, count * time.weight_grad,
            count * (time.forward_comm + time.backward_comm), count * time.flops, count * time.recompute_flops)


class Bounds:
    def __init__(self, figures: Figures, apart: int = 0):
        """`apart`: whether the first and the last stage may hold no block (the embedding or the loss alone,
        `Splits`): then a rank holds at least one block per stage it runs, less one for each of those."""
        self.figures = figures
        self.free_ends = apart > 0
        self.problem, self.model, self.layers = figures.problem, figures.model, figures.layers
        self.kinds, self.transformer, self.states = figures.kinds, figures.transformer, figures.states
        self.blocks, self.dense_blocks = figures.blocks, figures.dense_blocks
        self._stage_cache: dict = {}
        self._tail_cache: dict = {}
        self._p2p_cache: dict = {}
        self._slopes: dict = {}     # node ident -> (ZeRO class, device name) -> `slopes`
        self._busy_cache: dict = {}  # (node ident, ZeRO class, the stages' ranks, virtual) -> `busy_bound`
        self._fill_cache: dict = {}  # (node ident, whether the backward is split) -> `fill_bound`
        # several kinds of block: per set of them (rows of `Figures.kind_before`), their blocks' (count, share, excess)
        # in the model's order (`_crowding`)
        self._crowding: dict = {}

    # -- a leaf's stages --
    def stage_times(self, node: Node, zero: int, ranks, counts, recomputed: int | None = None) -> list[StageTime]:
        root = node.root
        last = len(counts) - 1
        if not self.transformer:
            out = []
            for s, layers in enumerate(self.figures.stage_layers(counts)):
                device = root.rank_devices[ranks[s]]
                times = [self.figures.kind_times(node, device)[self.layers.index(layer)] for layer in layers]
                params = [self.figures.params(layer, root.tp, root.ep) for layer in layers]
                element = self.figures.element(layers, root.tp, root.ep)
                layer_bytes = [self.figures.gather_bytes(layer, root.tp, root.ep, True) for layer in layers] \
                    if self.problem.priced_gathering.gather is not None else ()
                out.append(stage_time(times, params, zero, element, root.links, fsdp_units(layers),
                                      self.problem.grad_dtype.bytes, self._gathered(root, zero, layers, times, params),
                                      pipelined=zero >= 2 and self.problem.pipelined(root.pp),
                                      share=device.contention,
                                      layer_bytes=layer_bytes))
            return out
        out, start, before = [], 0, self.figures.dense_before
        several = len(self.kinds) > 5  # more than two kinds of block: each stage's blocks' kinds in order
        for s, n in enumerate(counts):
            dense = int(before[start + n] - before[start])  # of a mixture of experts' blocks, the dense ones
            dense_order = self.figures.dense_order(start, n) if not several else None
            kinds_order = self.figures.stage_kinds(start, n) if several else None
            start += n
            out.append(self.stage_time(node, zero, root.rank_devices[ranks[s]], n, s == 0, s == last, dense,
                                       recomputed, dense_order, kinds_order))
        return out

    def stage_time(self, node: Node, zero: int, device, n: int, first: bool, last: bool,
                   dense_blocks: int = 0, recomputed: int | None = None,
                   dense_order: tuple[bool, ...] | None = None, kinds_order: tuple[int, ...] | None = None) -> StageTime:
        """One transformer stage of n blocks (`dense_blocks` of them a mixture of experts' dense ones, first unless
        `dense_order` says which are, `Figures.dense_order`; with more than two kinds of block, `kinds_order`: each block's
        index into the kinds, `Figures.stage_kinds`; the embedding on the first stage, the norm and head on the
        last), once per node, ZeRO stage, device and shape. A partly recomputed node's stage recomputes its first
        `recomputed` blocks and runs its other layers as its kept node does (`cost.memory.layer_recompute`)."""
        root = node.root
        recomputed = min(n, recomputed) if recomputed is not None else None
        key = (node.ident, zero, device.name, n, first, last, dense_blocks, recomputed, dense_order, kinds_order)
        found = self._stage_cache.get(key)
        if found is None:
            times = self.figures.kind_times(node, device)
            # the blocks' kinds in forward order (a dense-then-MoE model's dense blocks first), as `stage_time` sees them
            blocks = list(kinds_order) if kinds_order is not None else [4] * dense_blocks + [1] * (n - dense_blocks) \
                if dense_order is None else [4 if is_dense else 1 for is_dense in dense_order]
            offset = len(self.kinds)  # a kind's index at the kept node's times: its own + this
            parts = [(0, 1)] if first else []
            if recomputed is None:
                parts.append((1, n - dense_blocks))
            elif not self.dense_blocks:  # the kept blocks and the ends at the kept node's times
                times = [*times, *self.figures.kind_times(node.kept, device)]
                parts = [(offset, 1)] if first else []
                parts += [(1, recomputed), (offset + 1, n - recomputed)]
            else:  # several kinds of block: the first `recomputed` blocks at their kinds' full recomputation
                times = [*times, *self.figures.kind_times(node.kept, device)]
                parts = [(offset, 1)] if first else []
                rerun, rest = blocks[:recomputed], blocks[recomputed:]
                parts += [(kind, rerun.count(kind)) for kind in self.figures.block_kinds if kind in rerun]
                parts += [(offset + kind, rest.count(kind)) for kind in self.figures.block_kinds if kind in rest]
            if recomputed is None and kinds_order is not None:  # the main kind's blocks above, then each other kind's
                parts[-1] = (parts[-1][0], kinds_order.count(1))
                parts += [(kind, kinds_order.count(kind)) for kind in range(4, len(self.kinds)) if kind in kinds_order]
            elif recomputed is None and dense_blocks:
                parts.append((4, dense_blocks))
            if last:
                parts += [(2, 1), (3, 1)] if recomputed is None else [(offset + 2, 1), (offset + 3, 1)]
            sums = [0.0] * 6
            dense = expert = 0.0
            for index, count in parts:
                for i, value in enumerate(_sums(times[index], count)):
                    sums[i] += value
                d, e = self.figures.params(self.kinds[index % len(self.kinds)][0], root.tp, root.ep)
                dense, expert = dense + count * d, expert + count * e
            units = n + (1 if first or last else 0)  # the blocks, and the root (`fsdp_units`)
            gathered = None
            if zero >= 2 and not self.problem.priced_gathering.default:  # the units one by one, in the order they run
                order = [(self.kinds[index % len(self.kinds)][0], times[index]) for index, count in parts
                         for _ in range(count)]
                layers = [layer for layer, _ in order]
                gathered = self._gathered(root, zero, layers, [t for _, t in order],
                                          [self.figures.params(layer, root.tp, root.ep) for layer in layers])
            forward_order = [0] * first + blocks + [2, 3] * last
            in_order = [self.figures.params(self.kinds[i][0], root.tp, root.ep)[0] for i in forward_order]
            bucket = first_bucket(in_order, bucket_params(root.links.data.size))
            element = bucket_bytes = self.problem.precision.bytes  # the gathers' bytes per element (`Figures.element`)
            if self.problem.priced_gathering.gather is not None:
                kinds = [self.kinds[index % len(self.kinds)][0] for index, count in parts for _ in range(count)]
                element = self.figures.element(kinds, root.tp, root.ep)
                bucket_bytes = bucket_element(in_order, [self.figures.gather_bytes(self.kinds[i][0], root.tp, root.ep,
                                                                                   True) for i in forward_order],
                                              bucket, element)
            pipelined = zero >= 2 and self.problem.pipelined(root.pp)  # cost.memory.pipelined_shards
            found = self._stage_cache[key] = zero_traffic(*sums, dense, expert, zero, element,
                                                          root.links, units, self.problem.grad_dtype.bytes,
                                                          gathered=gathered, pipelined=pipelined,
                                                          bucket=bucket, share=device.contention,
                                                          bucket_bytes=bucket_bytes)
        return found

    def _gathered(self, root, zero: int, layers, times, params):
        """`cost.stage.gather_units` of a stage's layers when the problem gathers otherwise than FSDP's blocks
        one ahead (None: the closed form)."""
        gathering = self.problem.priced_gathering
        if zero < 2 or gathering.default:
            return None
        fold = self.problem.fold_experts and root.tp > 1  # as `Figures.params` splits the experts
        return gather_units(layers, times, params, gathering, root.tp, root.ep * root.tp if fold else root.ep,
                            1 if fold else None)

    def slopes(self, node: Node, zero: int, device) -> tuple[float, ...]:
        """`busy_bound`'s figures on a device: a stage without an end, a + n·b, as (a, b); a block's F + B;
        the embedding's and the norm and head's F + B (once per node, ZeRO stage and device)."""
        found = self._slopes.get(node.ident)
        if found is None:
            found = self._slopes[node.ident] = {}
        key = (zero if zero >= 2 else 0, device.name)  # ZeRO-0/1 add no traffic to a microbatch
        slope = found.get(key)
        if slope is None:
            embed, block, norm, head = self.figures.kind_times(node, device)[:4]
            # units gathered one by one (`unit_pass`) are not affine in n: their compute alone, which the
            # traffic only lengthens, bounds them
            exact = zero if self.problem.priced_gathering.default else 0
            one, two = (self.stage_time(node, exact, device, n, False, False) for n in (1, 2))
            middle = (two.forward + two.backward) - (one.forward + one.backward)
            slope = found[key] = (one.forward + one.backward - middle, middle, block.forward + block.backward,
                                  embed.forward + embed.backward,
                                  norm.forward + norm.backward + head.forward + head.backward)
        return slope

    # -- bounds --
    def microbatch_work(self, node: Node) -> float:
        """A bound on the busiest rank's seconds per microbatch: all the work spread perfectly.

        On rank r's device every kind of layer takes at least ratio_r times its time on the
        fastest device, so max_r busy_r >= W_fast / sum_r (1 / ratio_r) (= W / pp when all match)."""
        devices = self.figures.device_types(node.root)
        if len(devices) == 1:  # one device type: every ratio is 1 (the sum below, in its order)
            (device,) = devices.values()
            total = sum((t.forward + t.backward) * count
                        for t, (_, count) in zip(self.figures.kind_times(node, device), self.kinds))
            return total / len(node.root.rank_devices)
        per_device = {name: [t.forward + t.backward for t in self.figures.kind_times(node, d)] for name, d in devices.items()}
        totals = {name: sum(c * count for c, (_, count) in zip(costs, self.kinds)) for name, costs in per_device.items()}
        if len(totals) == 1:  # one device type: every ratio is 1
            return next(iter(totals.values())) / len(node.root.rank_devices)
        fastest = min(totals, key=totals.get)
        base = per_device[fastest]
        ratio = {name: min((c / b for c, b in zip(costs, base) if b > 0), default=1.0)
                 for name, costs in per_device.items()}
        return totals[fastest] / sum(1.0 / ratio[d.name] for d in node.root.rank_devices)

    def chain(self, node: Node) -> float:
        """A bound on any step: one microbatch's F through every layer, then its I back (B = I + W;
        W may wait), each layer on the fastest device for it. With fewer microbatches than
        pipeline ranks this, not the work spread over the ranks, bounds the step (`leaf_bound`'s chain)."""
        per_device = [self.figures.kind_times(node, d) for d in self.figures.device_types(node.root).values()]
        return sum(count * min(times[i].forward + times[i].input_grad for times in per_device)
                   for i, (_, count) in enumerate(self.kinds))

    def compute_bound(self, node: Node) -> float:
        """m x the least seconds per microbatch of the busiest pipeline rank over every split of the blocks,
        counting compute only: below every leaf's `leaf_bound` whatever its ZeRO stage, schedule (Chimera
        aside), virtual stages and split, so a bound on the node; one `least_slowest` per rank map instead of
        `busy_bound`'s one per (ZeRO stage, map, virtual stages), and tighter than those where ZeRO-2/3's
        first unit (a < 0 in a + n·b) lowers their end ranks. A stage takes at least its layers' F + B (ZeRO's
        traffic only adds: `cost.stage.zero_traffic`; a partly recomputed node's blocks at least its kept
        node's), a rank at least one block per stage it holds, the embedding's seconds on rank 0, the norm's
        and head's on the last stage's rank: rank pp - 1 in a loop, rank 0 in a V (two stages per rank); a
        model with several kinds of block a rank's blocks at least as `_kinds_bound` counts them. 0.0 for models other
        than transformers."""
        if not self.transformer:
            return 0.0
        root, kept = node.root, node.kept or node
        pp, devices = root.pp, self.figures.device_types(root)

        def seconds(device) -> tuple[float, float, float]:
            times = self.figures.kind_times(kept, device)
            embed, block, norm, head = times[:4]
            per_block = block.forward + block.backward
            for other in times[4:len(self.kinds)]:  # wherever the split puts each kind, a block takes at least the
                per_block = min(per_block, other.forward + other.backward)  # cheapest kind's seconds
            return (embed.forward + embed.backward, per_block,
                    norm.forward + norm.backward + head.forward + head.backward)

        least = []
        for last, stages in ((pp - 1, 1), (0, 2)):  # a loop's last stage, and a V's
            if pp == 1 and stages == 2:
                continue
            kinds: dict = {}
            free = int(self.free_ends)  # an end stage may hold no block
            if self.dense_blocks:  # each rank's stages and ends, its blocks' kinds bounded by `_kinds_bound`
                for rank, device in enumerate(root.rank_devices):
                    embed, _, head = seconds(device)
                    shape = (device.name, (embed if rank == 0 else 0.0) + (head if rank == last else 0.0), stages,
                             stages - free * ((rank == 0) + (rank == last)))
                    kinds[shape] = kinds.get(shape, 0) + 1
                least.append(self._kinds_bound(kept, kinds))
                continue
            if len(devices) == 1:  # the ranks' kinds as the loop below makes them, in its order: 0, then 1..pp-1
                embed, block, head = seconds(next(iter(devices.values())))
                kinds[(embed + (head if last == 0 else 0.0), block, stages - free - (free if last == 0 else 0))] = 1
                if pp > 2 or (pp == 2 and last == 0):
                    kind = (0.0 + 0.0, block, stages)
                    kinds[kind] = kinds.get(kind, 0) + pp - 1 - (last != 0)
                if last != 0:
                    kind = (0.0 + head, block, stages - free)
                    kinds[kind] = kinds.get(kind, 0) + 1
            else:
                for rank, device in enumerate(root.rank_devices):
                    embed, block, head = seconds(device)
                    kind = ((embed if rank == 0 else 0.0) + (head if rank == last else 0.0), block,
                            stages - free * ((rank == 0) + (rank == last)))
                    kinds[kind] = kinds.get(kind, 0) + 1
            least.append(least_slowest(self.blocks, kinds))
        return node.microbatches * min(least)

    def busy_bound(self, node: Node, zero: int, schedule: str, virtual: int, extra: dict | None = None) -> float:
        """m x the least seconds per microbatch of the busiest pipeline rank over every split of the blocks
        onto the stages (each stage at least one): below `leaf_bound`, whose ranks' busy time is one term
        of its maximum, for whatever split the partition picks. A stage holding n blocks and neither
        the embedding nor the head takes exactly a + n·b (ZeRO-2/3's units are its blocks, so their
        traffic is the same per unit: `cost.stage.zero_traffic` is affine in n; a problem that gathers
        otherwise takes at least its compute's a + n·b: `slopes`); the two stages with
        them take at least their compute, fixed + n·(a block's F + B), ZeRO's traffic only adding. A
        rank's stages sum to at least A + N·B over the N blocks it holds (B the least slope of its
        stages), and `least_slowest` gives the least max over whole splits of the blocks. Chimera's
        ranks run half the microbatches of two stages each: their leaves keep the node's bound. A model with
        several kinds of block counts compute alone, each rank's blocks as `_kinds_bound` bounds them. `extra`
        (seconds per stage, by device name): every stage's compute alone, plus that (a partly recomputed
        stage's one block rerun).

        Once per node and (ZeRO stage's traffic, the stages' ranks, virtual stages) without `extra`: a partly
        recomputed node asks for its kept node's, which that node's own leaves asked for too."""
        info = BUILTIN.get(schedule)
        if info is not None and info.pipelines == 2:
            return 0.0
        if extra is None:
            key = (node.ident, zero if zero >= 2 else 0, info.rank_map if info is not None else schedule, virtual)
            found = self._busy_cache.get(key)
            if found is None:
                found = self._busy_cache[key] = self._busy_bound(node, zero, schedule, virtual)
            return found
        return self._busy_bound(node, zero, schedule, virtual, extra)

    def _busy_bound(self, node: Node, zero: int, schedule: str, virtual: int, extra: dict | None = None) -> float:
        root = node.root
        ranks = stage_ranks(schedule, root.pp, virtual) if root.pp > 1 else (0,)
        last = len(ranks) - 1
        devices = root.rank_devices
        kinds: dict = {}

        def add(kind: tuple, count: int = 1) -> None:
            kinds[kind] = kinds.get(kind, 0) + count

        if self.dense_blocks:  # compute alone, the kinds by `_kinds_bound`; `extra` once per stage holding a block
            shapes: dict = {}
            for rank, owned in enumerate(stages_by_rank(ranks, root.pp)):
                embed, _, norm, head = self.figures.kind_times(node, devices[rank])[:4]
                embed_cost, head_cost = embed.forward + embed.backward, norm.forward + norm.backward + head.forward \
                    + head.backward
                least = self._least(owned, last)
                shape = (devices[rank].name, (embed_cost if 0 in owned else 0.0) + (head_cost if last in owned else 0.0)
                         + (least * extra[devices[rank].name] if extra is not None else 0.0), len(owned), least)
                shapes[shape] = shapes.get(shape, 0) + 1
            return node.microbatches * self._kinds_bound(node, shapes)
        ends, others = _rank_shapes(ranks, root.pp)
        if extra is not None:
            uniform = len(self.figures.device_types(root)) == 1
            for rank, owned in ends if uniform else enumerate(stages_by_rank(ranks, root.pp)):
                device = devices[rank]
                _, _, compute, embed_cost, head_cost = self.slopes(node, zero, device)
                fixed = (embed_cost if 0 in owned else 0.0) + (head_cost if last in owned else 0.0)
                least = self._least(owned, last)  # a rerun a stage holding a block (an end stage may hold none)
                add((fixed + least * extra[device.name], compute, least))
            if uniform:
                compute = self.slopes(node, zero, devices[0])[2]
                for stages, count in others.items():
                    add((stages * extra[devices[0].name], compute, stages), count)
            return node.microbatches * least_slowest(self.blocks, kinds)
        for rank, owned in ends:  # the ranks of the embedding's and the head's stages
            offset, middle, compute, embed_cost, head_cost = self.slopes(node, zero, devices[rank])
            fixed = sum(offset for s in owned if 0 < s < last)
            fixed += (embed_cost if 0 in owned else 0.0) + (head_cost if last in owned else 0.0)
            add((fixed, min(compute, middle), self._least(owned, last)))
        if len(self.figures.device_types(root)) == 1:  # on one device type, the others differ only in their stages
            offset, middle = self.slopes(node, zero, devices[0])[:2]
            for stages, count in others.items():
                add((stages * offset, middle, stages), count)
        else:
            for rank, owned in enumerate(stages_by_rank(ranks, root.pp)):
                if all(rank != r for r, _ in ends):
                    offset, middle = self.slopes(node, zero, devices[rank])[:2]
                    add((len(owned) * offset, middle, len(owned)))
        return node.microbatches * least_slowest(self.blocks, kinds)

    def fill_bound(self, node: Node, schedule: str, virtual: int) -> float:
        """A bound on `leaf_bound` under every split of the blocks, for a pipeline of one stage a rank (1F1B, GPipe,
        ZB-H1/H2; 0.0 for other stage maps, a model of several kinds of block and other models): the pipeline's fill
        and drain, which `busy_bound` leaves out. Rank r's term of `leaf_bound` is at least p·S + m·c·n, its n blocks
        at a block's F + B each (c, the least over the root's device types: a stage's traffic only adds) and the S
        blocks of the stages before it passed by the first microbatch's forward (p: a block's F) and, where the
        schedule does not split the backward, by the last one's backward too (p: F + B) before its first and after
        its last pass. Were every term at most T, S' = S + n <= (1 - p / (m·c))·S + T / (m·c), increasing in S (p <= c,
        m >= 1), so the blocks, S after the last rank, are at most T·(1 - (1 - p / (m·c))^pp) / p: T >= that bound.
        The search's leaves of m microbatches over pp stages of one rank each sit (pp - 1) / m of a stage's work above
        their busiest rank under 1F1B: most of those a 6,144-GPU search partitioned were past the plans it keeps."""
        info = BUILTIN.get(schedule)
        root = node.root
        if info is None or info.pipelines == 2 or root.pp == 1 or not self.transformer or self.dense_blocks \
                or stage_ranks(schedule, root.pp, virtual) != tuple(range(root.pp)):
            return 0.0
        key = (node.ident, info.split_backward)
        found = self._fill_cache.get(key)
        if found is None:
            blocks = [self.figures.kind_times(node, device)[1] for device in self.figures.device_types(root).values()]
            c = min(block.forward + block.backward for block in blocks)
            p = min(block.forward for block in blocks) if info.split_backward else c
            found = self._fill_cache[key] = fill_seconds(self.blocks, p, c, node.microbatches, root.pp)
        return found

    def _kinds_bound(self, node: Node, shapes: dict) -> float:
        """A bound on the least busiest rank's compute per microbatch over every split of several kinds of block in
        the model's order, for `shapes` = {(device name, fixed seconds, stages, fewest blocks): how many ranks}. A
        stage holds consecutive blocks. On a rank of k stages holding N blocks, with its kinds' seconds a block sorted
        c_1 <= ... <= c_K, its seconds are fixed + c_1·N + sum over j of (c_j+1 - c_j)·(N - X_j), X_j its blocks of the
        j cheapest kinds: X_j <= their count C_j in the model and X_j <= share_j·N + k·excess_j (`_crowding`), so each
        N - X_j is at least each of 0, N - C_j and N·(1 - share_j) - k·excess_j. One of the three per j makes a line in
        N below every rank's seconds, and `least_slowest` over each bounds the busiest rank (the largest is taken).
        Two kinds (cheap c, dear e, gap e - c): fixed + N·c, fixed - gap·C + N·e, fixed - gap·k·excess +
        N·(e - gap·share)."""
        devices = self.figures.device_types(node.root)
        levels = len(self.kinds) - 4  # the kinds of block less one: a choice of three each
        relaxed = [{} for _ in range(3 ** levels)]
        # the other kinds first, then the main one: of two kinds, the dense one is the cheaper where they tie
        order = list(range(4, len(self.kinds))) + [1]
        for (name, fixed, stages, least), count in shapes.items():
            times = self.figures.kind_times(node, devices[name])
            seconds = {kind: times[kind].forward + times[kind].backward for kind in order}
            ranked = sorted(order, key=seconds.__getitem__)  # cheapest first (stable: ties keep `order`)
            lines = [(fixed, seconds[ranked[0]])]
            for j in range(1, len(ranked)):
                held, share, excess = self._crowded(frozenset(ranked[:j]))  # the j cheapest kinds'
                gap = seconds[ranked[j]] - seconds[ranked[j - 1]]
                lines = [line for f, slope in lines for line in
                         ((f, slope), (f - gap * held, slope + gap), (f - gap * stages * excess, slope + gap - gap * share))]
            for kinds, (f, slope) in zip(relaxed, lines):
                kind = (f, slope, least)
                kinds[kind] = kinds.get(kind, 0) + count
        return max(least_slowest(self.blocks, kinds) for kinds in relaxed)

    def _crowded(self, kinds: frozenset) -> tuple[int, float, float]:
        """`_crowding` of the blocks of these kinds (indices into the kinds), once per set."""
        found = self._crowding.get(kinds)
        if found is None:
            rows = [self.figures.block_kinds.index(kind) for kind in sorted(kinds)]
            found = self._crowding[kinds] = _crowding(self.figures.kind_before[rows].sum(axis=0))
        return found

    def _least(self, owned, last: int) -> int:
        """The fewest blocks a rank holding the stages `owned` (of 0..last) holds: one a stage, none on an end stage
        that may hold the embedding or the loss alone."""
        return len(owned) - (self.free_ends and 0 in owned) - (self.free_ends and last in owned and last != 0)

    def split_bound(self, node: Node, zero: int, schedule: str, ranks, counts, recomputed: int | None = None) -> float:
        """m x the busiest rank's seconds per microbatch under this split of the blocks: at most `leaf_bound`,
        whose ranks' busy time is one term of its maximum, and made without a stage time (the search asks
        for `leaf_bound` only where this one does not already put the leaf past the plans it keeps).

        Each stage is bounded as `busy_bound` bounds it under any split: one without the embedding or the
        head takes a + n·b, one with them at least their compute, fixed + n·(a block's F + B). A partly
        recomputed node's stage takes at least its kept node's seconds (rerunning a block only adds), and
        at least its compute with its first `recomputed` blocks at full recomputation's F + B (ZeRO's
        traffic only adds to compute: `cost.stage.zero_traffic`). Several kinds of block: each stage's compute, its
        blocks of each kind at their seconds. 0.0 where `busy_bound` keeps the node's bound (Chimera) and for
        models other than transformers."""
        info = BUILTIN.get(schedule)
        if (info is not None and info.pipelines == 2) or not self.transformer:
            return 0.0
        root, kept = node.root, node.kept or node
        last = len(counts) - 1
        if self.dense_blocks:
            return node.microbatches * self._kinds_split(node, ranks, counts, recomputed)
        per_device: dict = {}
        busy = [0.0] * root.pp
        for s, n in enumerate(counts):
            rank = ranks[s]
            device = root.rank_devices[rank]
            slopes = per_device.get(device.name)
            if slopes is None:
                offset, middle, compute, embed, head = self.slopes(kept, zero, device)
                rerun = None
                if node.kept is not None:  # a block's F + B under full recomputation, less its kept F + B
                    full = self.figures.kind_times(node, device)[1]
                    rerun = (full.forward + full.backward) - compute
                slopes = per_device[device.name] = (offset, middle, compute, embed, head, rerun)
            offset, middle, compute, embed, head, rerun = slopes
            ends = (embed if s == 0 else 0.0) + (head if s == last else 0.0)
            seconds = offset + n * middle if 0 < s < last else ends + n * compute
            if rerun is not None:
                seconds = max(seconds, ends + n * compute + min(n, recomputed) * rerun)
            busy[rank] += seconds
        return node.microbatches * max(busy)

    def _kinds_split(self, node: Node, ranks, counts, recomputed: int | None = None) -> float:
        """The busiest rank's compute per microbatch under a split of several kinds of block (`split_bound`); a partly
        recomputed node's at its kept node's seconds, each stage's first `recomputed` blocks at full recomputation's
        (their kinds' in the model's order)."""
        root, last, before = node.root, len(counts) - 1, self.figures.kind_before
        block_kinds = self.figures.block_kinds  # the main kind, then the others
        kept = node.kept or node
        per_device: dict = {}
        busy = [0.0] * root.pp
        start = 0
        for s, n in enumerate(counts):
            device = root.rank_devices[ranks[s]]
            seconds = per_device.get(device.name)
            if seconds is None:
                times = self.figures.kind_times(kept, device)
                full = self.figures.kind_times(node, device) if node.kept is not None else times
                seconds = per_device[device.name] = (
                    times[0].forward + times[0].backward,
                    times[2].forward + times[2].backward + times[3].forward + times[3].backward,
                    [times[kind].forward + times[kind].backward for kind in block_kinds],
                    [(full[kind].forward + full[kind].backward) - (times[kind].forward + times[kind].backward)
                     for kind in block_kinds])
            stage = (seconds[0] if s == 0 else 0.0) + (seconds[1] if s == last else 0.0)
            for row, each in enumerate(seconds[2]):
                stage += int(before[row, start + n] - before[row, start]) * each
            if node.kept is not None:  # the first `recomputed` blocks rerun
                rerun = start + min(n, recomputed or 0)
                for row, each in enumerate(seconds[3]):
                    stage += int(before[row, rerun] - before[row, start]) * each
            start += n
            busy[ranks[s]] += stage
        return max(busy)

    def leaf_bound(self, node: Node, schedule: str, ranks, stages: list[StageTime], zero: int) -> float:
        """max over ranks of (first microbatch's arrival + busy + the last gradient's way back),
        plus the worst rank's exposed reduction and optimizer step."""
        root, m, pp = node.root, node.microbatches, node.root.pp
        by_rank = stages_by_rank(ranks, pp)
        tails = self._tail_cache if self.transformer else {}  # other models' stage times are not cached objects
        worst_tail = 0.0
        for rank, owned in enumerate(by_rank):
            # a transformer's stage times are the space's cached objects (`stage_times`, keyed by the node's
            # ident, never evicted): their ids name them for the whole search, so a rank's tail is computed
            # once per search, not once per leaf
            key = (id(root), zero, root.rank_devices[rank].name, tuple(id(stages[s]) for s in owned))
            tail = tails.get(key)
            if tail is None:
                tail = tails[key] = rank_tail([stages[s] for s in owned], zero, root.degrees,
                                              self.problem.precision.bytes, root.links, root.rank_devices[rank],
                                              self.problem.optimizer, self.problem.precision, self.states,
                                              pipelined=zero >= 2 and self.problem.pipelined(pp))
            worst_tail = max(worst_tail, tail.exposed + tail.optimizer)
        if pp == 1:
            return m * sum(s.forward + s.backward for s in stages) + worst_tail
        p2p = self._p2p_cache.get(node.ident)
        if p2p is None:
            p2p = self._p2p_cache[node.ident] = pipeline_p2p_seconds(self.model, self.figures.work(node), root.links)
        two_pipelines = BUILTIN[schedule].pipelines == 2
        split = BUILTIN[schedule].split_backward
        cost = [s.forward + s.backward for s in stages]
        forward_prefix = list(itertools.accumulate((s.forward for s in stages), initial=0.0))
        backward_prefix = list(itertools.accumulate((s.backward for s in stages), initial=0.0))
        # Every microbatch runs F through all the stages and then I (or B) back through all of them,
        # one hop between ranks each way (the dependency chain; W may wait): with few microbatches
        # over many stages this, not a rank's work, is the step (m = 1: the whole model in series).
        hops = sum(1 for a, b in zip(ranks, ranks[1:]) if a != b)
        back = sum(s.input_grad for s in stages) if split else backward_prefix[-1]
        best = forward_prefix[-1] + back + 2 * hops * p2p
        for rank, owned in enumerate(by_rank):
            first = owned[0]
            if two_pipelines:  # Chimera: half the microbatches run stage r, half stage p - 1 - r
                best = max(best, m / 2 * (cost[rank] + cost[pp - 1 - rank]))
                continue
            busy = m * sum(cost[s] for s in owned)
            arrival = forward_prefix[first] + first * p2p
            drain = 0.0 if split else backward_prefix[first] + first * p2p
            best = max(best, arrival + busy + drain)
        return best + worst_tail


def fill_seconds(blocks: int, p: float, c: float, microbatches: int, pp: int) -> float:
    """`Bounds.fill_bound`'s L·p / (1 - (1 - p / (m·c))^pp), its denominator as -expm1(pp·log1p(-p / (m·c))): the
    power's 1 - (1 - q)^pp loses about 1e-16 / q of itself, 1.3e-4 above the exact bound at 10^12 microbatches, past
    the 2e-9 the search's bounds keep below the exact figures (`SAFE`); this is within 4e-16 of it at any m. 0.0 where
    a block costs nothing."""
    if p <= 0.0 or c <= 0.0:
        return 0.0
    q = p / (microbatches * c)
    return blocks * p / (1.0 if q >= 1.0 else -math.expm1(pp * math.log1p(-q)))  # q = 1: one microbatch, F + B


def _crowding(before: np.ndarray) -> tuple[int, float, float]:
    """(count, share, excess) of one kind of block from `before[i]`, how many of the first i are of that kind: any n
    consecutive blocks hold at most share·n + excess of them (share = count / blocks; excess the largest
    before[t] - before[s] - share·(t - s) over s < t, in one pass; a hair added for the floats)."""
    blocks = len(before) - 1
    count = int(before[-1])
    share = count / blocks
    level = before - share * np.arange(blocks + 1)
    excess = float(np.max(level[1:] - np.minimum.accumulate(level[:-1]))) if blocks else 0.0
    return count, share, max(0.0, excess) + 1e-9


@functools.lru_cache(maxsize=4096)
def _rank_shapes(ranks: tuple[int, ...], pp: int) -> tuple[tuple, dict]:
    """The ranks holding the first and the last stage, with their stages, and how many other ranks hold
    each number of stages (`busy_bound`, on one device type)."""
    by_rank = stages_by_rank(ranks, pp)
    ends = tuple((rank, by_rank[rank]) for rank in sorted({ranks[0], ranks[-1]}))
    others: dict = {}
    for rank, owned in enumerate(by_rank):
        if rank not in (ranks[0], ranks[-1]):
            others[len(owned)] = others.get(len(owned), 0) + 1
    return ends, others


__all__ = ["Bounds", "fill_seconds"]
