"""The search space of `plandsl.search`: its tree enumerated, each step bounded.

Stage: inside the search. Contract: `Space` enumerates roots (layout and mesh order), nodes (plus
micro-batch size and recomputation) and leaves (plus ZeRO stage, schedule and virtual stages),
each with a lower bound on the step time of every plan below it (`bounds`), a leaf partitioned
(`splits`, within `caps`) only when the search reaches it, and `evaluate` gives a leaf's exact
figures through `cost.estimate`. The per-layer figures every step reads are memoised in `figures`.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from plandsl import ir
from plandsl.cost.compute import Efficiency
from plandsl.cost.estimate import estimate_plan
from plandsl.cost.memory import autocast_weight_copies
from plandsl.cost.offload import host_capacity
from plandsl.diagnostics import PlanError
from plandsl.ir.placement import Assignment
from plandsl.lower.units import format_bytes
from plandsl.schedules.registry import BUILTIN, splits_backward
from plandsl.search.bounds import Bounds
from plandsl.search.caps import Caps
from plandsl.search.closest import Closest
from plandsl.search.choices import (AXES, MAX_MICRO_BATCH, RECOMPUTE, divisors_up_to, hybrid_orders, layouts,
                                    mesh_orders, schedule_choices, sequence_parallel, stage_ranks)
from plandsl.search.figures import Figures
from plandsl.search.problem import Scored, SearchStats, build_plan
from plandsl.search.splits import Splits
from plandsl.search.tree import SAFE, Leaf, Node, Pending, Root, candidate_of

_ONE_IN_FLIGHT = np.ones(1)  # a single stage's microbatches in flight (one object: `Caps.caps` keys by identity)


class Space:
    def __init__(self, problem, pins, efficiency: Efficiency | None, stats: SearchStats | None = None,
                 chosen: tuple[bool, bool] = (False, False), shared: dict | None = None):
        """`stats`: counters shared with the spaces of the other experts' variants (`experts_variants`), and
        `shared` what does not depend on their dispatcher, only on their folding, computed once per folding: a
        layout's model states against memory, its mesh orders, and the memory figures (`Figures`' memory caches);
        `chosen`: whether the search itself chose (fold, dispatcher) for this space, not the problem or a pin:
        then folding keeps only the roots with tp > 1 and ep > 1, and a flex dispatcher only those with ep > 1, the
        roots where it changes the plan (elsewhere the variant without it has it). Each dispatcher prices something
        the others do not (the nodes it sees and HybridEP's routing map: `cost.comm.dispatch_seconds`; its SMs, the
        alltoall dispatcher's sorting copies and FP8 padding: `cost.compute`), so none is left out where there is an
        expert group."""
        self.problem, self.pins, self.efficiency = problem, pins, efficiency
        self.chosen = chosen
        self.shared = shared if shared is not None else {}
        memory = self.shared.setdefault(("memory", problem.fold_experts), {})
        self.figures = figures = Figures(problem, efficiency, memory)
        self.caps = Caps(figures)
        self.splits = Splits(figures, self.caps, pins)
        # The stages beyond the blocks that may hold the embedding or the loss alone (`Splits`): those the pin
        # `account` counts; unpinned, both (`Splits`: an end stage holds no block where that is faster); none under a
        # kept `evenly` without it (its split, `Splits.fixed`: a block a stage)
        account = pins.get("account")
        self.apart = 0 if not figures.transformer else len(account) if account is not None else \
            0 if problem.split == "evenly" else 2
        self.bounds = Bounds(figures, self.apart)
        self.model, self.layers, self.kinds, self.base = figures.model, figures.layers, figures.kinds, figures.base
        self.transformer, self.blocks, self.dense_blocks = figures.transformer, figures.blocks, figures.dense_blocks
        # E506: a microbatch must give each of the model's BatchNorms more than one value per channel
        self.norm_values = problem.model.norm_values if isinstance(problem.model, ir.CustomModel) else 0
        self.devices = problem.cluster.devices_in_order()
        self.stats = stats if stats is not None else SearchStats()
        # what memory ruled out came closest to fitting
        self.closest = Closest(self.stats, self.base, efficiency, self.problem.kept)

    # -- roots: layouts and orders --
    def layouts(self, check_batch: bool = True) -> list[tuple[int, int, int, int, int]]:
        p = self.problem
        # under a pinned `account` the split is of its items (the blocks, the embedding, the loss), as the checker's
        # E403 counts them: a plan of 1 block over pp 2 with account = [embed, loss] checks, and `generate --from` it
        # was E803 ("pp at most the blocks")
        items = self.blocks + (self.apart if "account" in self.pins else 0)
        return layouts(self.model, p.cluster.num_devices, p.sequence, p.global_batch, items, self.pins,
                       check_batch, p.fold_experts)

    def roots(self) -> list[Root]:
        p, pins = self.problem, self.pins
        out = []
        for layout in self.layouts():
            dp, tp, pp, cp, ep = layout
            per_replica = p.global_batch // (dp * ep)
            sizes = tuple(mb for mb in divisors_up_to(per_replica, MAX_MICRO_BATCH)
                          if pins.get("micro_batch_size", mb) == mb and mb * self.norm_values >= min(2, self.norm_values)
                          and pins.get("num_microbatches", per_replica // mb) == per_replica // mb)
            if not sizes:
                continue
            if self.chosen[0] and p.fold_experts and (tp == 1 or ep == 1):
                continue  # folding over tp 1 is the unfolded plan
            if pp == 1 and p.stages_kept and pins.get("virtual_stages", 1) > 1:
                continue  # a kept stages line's virtual stages need a schedule that runs them: one pp = 1 writes none
            if self.chosen[1] and p.dispatcher != "alltoall" and ep == 1:
                continue  # no expert group to dispatch over: the all-to-all's variant has the plan
            if p.overlap_experts and ep * (tp if p.fold_experts else 1) == 1:
                continue  # the experts' overlap needs an expert group (the checker's E419)
            hybrid = self._hybrid(layout)  # hsdp's roots where the pins leave it (their states checked when reached)
            if not hybrid and pins.get("data") == "hsdp":
                continue
            # where it can, unless pinned off (`--pin sequence_parallel=false`: a stack without it) or on DeepSpeed's
            # pipeline engine, which runs none (the checker's E611); pinned on, a layout that cannot is left out
            splits_sequence = sequence_parallel(self.model, p.sequence, tp, cp) \
                and pins.get("sequence_parallel", True) and not p.deepspeed_engine(pp)
            if pins.get("sequence_parallel") and tp > 1 and not splits_sequence:
                continue
            one_axis = [] if pins.get("data") == "hsdp" else [(*each, 0) for each in self._orders(layout)]
            computes = {}  # the layout's mesh orders differ in their links (and devices) alone: the compute bound
            for order, links, devices, capacity, shard in one_axis + hybrid:  # of each set of devices, once
                root = Root(dp, tp, pp, cp, ep, order, links, devices, capacity, splits_sequence, sizes, shard=shard)
                names = tuple(sorted({d.name for d in devices}))
                if names not in computes:
                    computes[names] = self._root_bound(root, self.figures.kind_compute)
                root.bound = computes[names]
                out.append(root)
        self.stats.roots = len(out)
        return out

    def tighten_root(self, root: Root) -> Root | None:
        """The root with its bound raised to count its links' communication, when the search reaches it; None where
        the layout's model states cannot fit under any ZeRO stage (`_states_may_fit`). Both once per root, and only
        for the roots the search reaches: a mixture of experts on 1,024 GPUs has thousands of layouts x mesh orders,
        whose bounds and states took half of the default time limit before any was searched."""
        root.tight = True
        layout = (root.dp, root.tp, root.pp, root.cp, root.ep)
        if not self._states_may_fit(layout) or (root.shard and not self._states_may_fit(layout, root.shard)):
            self.stats.memory_pruned += 1
            return None
        root.bound = max(root.bound, self._root_bound(root, self.figures.kind_times))
        return root

    def _root_bound(self, root: Root, times) -> float:
        """A lower bound of every plan below `root`: per token, a microbatch costs least at the largest micro-batch
        size and without recomputation (GEMMs grow, latencies amortise). The experts' overlap hides all-to-alls only
        behind another microbatch, so where the largest size leaves one microbatch the largest size that leaves two
        may cost less: the bound takes the cheaper. `times(node, device)`: each kind's seconds (`Figures.kind_times`,
        or `Figures.kind_compute`: the compute alone, no greater)."""
        sizes, per_replica = root.micro_batches, self.problem.global_batch // (root.dp * root.ep)
        largest = Node(root, sizes[-1], per_replica // sizes[-1], "none")
        nodes = [largest] + ([Node(root, sizes[-2], per_replica // sizes[-2], "none")]
                             if self.problem.overlap_experts and largest.microbatches == 1 and len(sizes) > 1 else [])
        return min(node.microbatches * min(
            sum(count * (t.forward + t.backward) for t, (_, count) in zip(times(node, d), self.kinds))
            for d in {d.name: d for d in root.rank_devices}.values()) for node in nodes) / root.pp * SAFE

    def _orders(self, layout):
        key = ("orders", self.problem.fold_experts, layout)
        found = self.shared.get(key)
        if found is None:
            found = self.shared[key] = mesh_orders(self.problem.cluster, layout, self.pins, self.devices,
                                                   self.problem.precision, self.problem.fold_experts)
        orders, across = found
        self.stats.tp_across_nodes += across
        return orders

    def _hybrid(self, layout) -> list[tuple]:
        """hsdp's (order, links, devices, capacity, shard) of a layout (`choices.hybrid_orders`) where the pins leave
        it (`data` hsdp, or neither `data` nor `zero_stage` pinned: a pinned stage is its kind over one data axis), of
        a pinned `dp_shard` alone (not on DeepSpeed's pipeline engine, which takes ZeRO 0 or 1, nor where the problem
        rules it out, `Problem.hybrid`), once per layout; whether their states may fit is asked when the search reaches
        each (`tighten_root`)."""
        pins, p = self.pins, self.problem
        unpinned = "data" not in pins and "zero_stage" not in pins  # a pinned stage is over one data axis
        if not p.hybrid or not (pins.get("data") == "hsdp" or unpinned) or p.deepspeed_engine(layout[2]):
            return []
        key = ("hybrid", p.fold_experts, layout)
        found = self.shared.get(key)
        if found is None:
            found = self.shared[key] = hybrid_orders(p.cluster, layout, self._orders(layout), pins.get("dp_shard"))
        return found

    def _states_may_fit(self, layout, shard: int = 0) -> bool:
        """The least model states of any ZeRO stage (of hsdp over `shard` ranks) spread perfectly over the pipeline
        fit: a necessary condition."""
        key = ("states", self.problem.fold_experts, layout, shard)
        if key not in self.shared:
            self.shared[key] = self._states_fit(layout, shard)
        return self.shared[key]

    def _states_fit(self, layout, shard: int = 0) -> bool:
        dp, tp, pp, cp, ep = layout
        sizes = {"dp": dp, "ep": ep, "pp": pp, "cp": cp, "tp": tp}
        probe = Root(dp, tp, pp, cp, ep, tuple(a for a in AXES if sizes[a] > 1), None, (), (), False, (1,),
                     shard=shard)
        node = Node(probe, 1, 1, "full")

        def states(zero: int) -> float:
            # the model states alone (not the activations `layer_memory` adds, which no node of this probe's shape
            # reads); the figures' states carry autocast's weight copies too (`Figures._states`): taken off
            per_kind, _, plan = self.figures.layer_states(node, zero)
            return sum(count * (per_kind[i] - autocast_weight_copies(plan, [layer]))
                       for i, (layer, count) in enumerate(self.kinds))
        least, stage = states(3 if probe.data_ranks > 1 else 0), "even with ZeRO-3"
        capacity = max(g.node.device.usable_memory for g in self.problem.cluster.groups)
        if shard:  # hsdp's own (more than ZeRO-3's over every data rank, which the layout's check recorded)
            return least / pp <= capacity
        if least / pp > capacity and self.problem.pipelined(pp) and probe.data_ranks > 1:
            # under a pipeline ZeRO-3 keeps every unit gathered and its gradients whole through the step beside its
            # shards (`cost.memory.pipelined_shards`), which can hold more than ZeRO-1's whole parameters (a mixture
            # of experts sharded over its expert axis; at pp = 1 too where a kept stages line builds the pipeline,
            # `Problem.pipelined`): the least of the stages (only where ZeRO-3's does not fit)
            least, stage = min(least, *(states(zero) for zero in (0, 1, 2))), "under any ZeRO stage"
        if least / pp > capacity:
            self.closest.bound(f"dp={dp} tp={tp} pp={pp} cp={cp} ep={ep} needs at least {format_bytes(least / pp)} "
                               f"per device for its model states alone, {stage} (of {format_bytes(capacity)})",
                               least / pp / capacity)
            return False
        return True

    # -- nodes: micro-batch size and recomputation --
    def expand_root(self, root: Root) -> list[Node]:
        recomputes = [self.pins["recompute"]] if "recompute" in self.pins else list(RECOMPUTE)
        # No attention core without a transformer; selective_op keeps dense blocks' matmuls only (E704).
        dropped = ("selective", "selective_op") if not self.transformer else \
            ("selective_op",) if self.problem.model.experts or self.problem.model.latent_attention else ()
        recomputes = [r for r in recomputes if r not in dropped] or recomputes
        per_replica = self.problem.global_batch // (root.dp * root.ep)
        # recompute_layers: full recomputation of the first N blocks of each stage, the others kept (Megatron's
        # --recompute-num-layers), for transformers (of several kinds of block: `Splits.mixed_partial_partition`), unless
        # a pin rules it out
        pinned, layers = self.pins.get("recompute"), self.pins.get("recompute_layers")
        partly = self.transformer and (layers is not None or pinned is None)
        # offload_layers: recompute none, the first N blocks' activations on the host (Megatron's
        # --cpu-offloading-num-layers), without a pipeline as megatron-core offloads, where no pin rules it out
        offloaded = self.pins.get("offload_layers")
        offloads = self.transformer and root.pp == 1 and offloaded != 0 \
            and pinned in (None, "none") and layers is None
        if layers is not None or offloaded:
            recomputes = []
        if self.problem.overlap_experts:  # Megatron-Core's expert overlap refuses full recomputation (the checker's E418)
            recomputes = [r for r in recomputes if r != "full"]
            partly = partly and layers == 0
        if offloaded:
            partly = False
        out = []
        for mb in root.micro_batches:
            for recompute in recomputes:
                node = Node(root, mb, per_replica // mb, recompute)
                node.bound = max(node.microbatches * self.bounds.microbatch_work(node), self.bounds.chain(node)) * SAFE
                out.append(node)
            if partly:  # bounded by its kept node's figures: recomputing a block only adds to its seconds
                kept = next((n for n in out if n.micro_batch == mb and n.recompute == "none"), None) or \
                    Node(root, mb, per_replica // mb, "none")
                kept.bound = kept.bound or max(kept.microbatches * self.bounds.microbatch_work(kept),
                                               self.bounds.chain(kept)) * SAFE
                out.append(Node(root, mb, per_replica // mb, "full", bound=kept.bound, kept=kept))
            if offloads:  # bounded by the node that keeps every block: offloading only adds copies
                kept = next((n for n in out if n.micro_batch == mb and n.recompute == "none" and not n.offload
                             and n.kept is None), None) or Node(root, mb, per_replica // mb, "none")
                kept.bound = kept.bound or max(kept.microbatches * self.bounds.microbatch_work(kept),
                                               self.bounds.chain(kept)) * SAFE
                out.append(Node(root, mb, per_replica // mb, "none", bound=kept.bound, offload=True))
        self.stats.nodes += len(out)
        return out

    def tighten(self, node: Node) -> Node:
        """The node with its bound raised to its busiest rank's compute (`Bounds.compute_bound`), when the
        search reaches it: a node it then passes over is never expanded into leaves (6 in 10 of those a
        6,144-GPU search reached). Not under a pinned Chimera, whose ranks run two stages' halves."""
        node.tight = True
        schedule = BUILTIN.get(self.pins.get("schedule"))
        if schedule is None or schedule.pipelines != 2:
            node.bound = max(node.bound, self.bounds.compute_bound(node) * SAFE * SAFE)
        return node

    # -- leaves: ZeRO stage, schedule, virtual stages --
    def expand(self, node: Node) -> list[Leaf]:
        """Every leaf below a node, each with its bound, in the space's order (brute force; the search
        partitions them lazily, `pending`)."""
        pending = self.pending(node)
        if pending is None:
            return []
        out = []
        for _, _, zero, schedule, virtual in sorted(pending.leaves, key=lambda entry: entry[1]):
            self.stats.leaves += 1
            leaf = self._leaf(node, zero, schedule, virtual, pending.memory[zero])
            if leaf is not None:
                out.append(self.finish(leaf))
        return out

    def pending(self, node: Node) -> Pending | None:
        """The node's leaves before their partition, each bounded by its busiest rank over every split
        of the blocks (`busy_bound`), best first: a leaf is partitioned and given its exact bound only
        when the search reaches that bound, and most never are (a 6,144-GPU search partitions 1 in 5)."""
        self.stats.expanded += 1
        root, pins = node.root, self.pins
        zeros = [pins["zero_stage"]] if "zero_stage" in pins else list(ir.ZERO_STAGES)
        if root.shard:  # hsdp: ZeRO-3 within its shard axis
            zeros = [3]
        if root.data_ranks == 1:  # nothing for ZeRO to shard over (Candidate.data_axis)
            zeros = [z for z in zeros if z == 0] or zeros[:1]
        if self.problem.deepspeed_engine(root.pp):  # its engine takes ZeRO 0 or 1 (the checker's E611)
            zeros = [z for z in zeros if z <= 1]
        choices = schedule_choices(root.pp, node.microbatches, self.blocks + self.apart, pins.get("schedule"),
                                   pins.get("virtual_stages"), pipeline=self.problem.pipeline,
                                   virtual_needed=self.problem.overlap_experts)
        choices = [c for c in choices if self.problem.runs_map(c[0], root.pp, c[1])]  # a kept line's map (E409)
        if node.recompute == "selective_op":  # its kept outputs serve one backward pass, not I then W (E703)
            choices = [c for c in choices if not splits_backward(c[0])] or choices
        leaves, memories, busy = [], {}, {}
        for zero in zeros:
            memory = self.figures.layer_memory(node, zero)
            per_kind = memory[0]
            states = sum(count * per_kind[i][0] for i, (_, count) in enumerate(self.kinds))
            stored = sum(count * per_kind[i][1] for i, (_, count) in enumerate(self.kinds))
            if node.offload and not self.dense_blocks:  # every block's activations but one in flight may sit on the host
                stored -= (self.blocks - 1) * per_kind[1][1]
            elif node.offload:  # of several kinds: all but the largest kind's one
                blocks = [1] + list(range(4, len(self.kinds)))
                stored -= sum(self.kinds[i][1] * per_kind[i][1] for i in blocks) - max(per_kind[i][1] for i in blocks)
            if root.pp == 1 and not node.offload:  # what the exact estimate of a one-microbatch step leaves apart
                states -= self.figures.apart(memory)
            if (states + stored) / root.pp > max(root.capacity):
                self.stats.memory_pruned += len(choices)
                candidate = candidate_of(node, '', 1, zero)
                self.closest.bound(f"{candidate.describe()} needs at least {format_bytes((states + stored) / root.pp)} "
                                   f"per device (of {format_bytes(max(root.capacity))})",
                                   (states + stored) / root.pp / max(root.capacity),
                                   # one stage: its estimate settles it (recomputing N blocks of it: at least
                                   # recomputing all of them, the same record)
                                   candidate if root.pp == 1 else None)
                continue
            memories[zero] = memory
            for schedule, virtual in choices:
                key = (zero if zero >= 2 else 0, schedule if schedule not in BUILTIN else BUILTIN[schedule].rank_map,
                       virtual)  # ZeRO-0/1 add no traffic to a microbatch; the stages' ranks
                bound = busy.get(key)
                if bound is None and not self.transformer:
                    bound = busy[key] = 0.0
                elif bound is None:  # a partly recomputed node: at least its kept node's seconds, and at least
                    # their compute with one block more recomputed per stage (N >= 1)
                    bound = self.bounds.busy_bound(node.kept or node, zero, schedule, virtual)
                    if node.kept is not None:
                        extra = busy.get("extra")
                        if extra is None:  # of several kinds of block, the least kind's rerun
                            extra = busy["extra"] = {
                                name: self._least_rerun(node, device)
                                for name, device in self.figures.device_types(node.root).items()}
                        bound = max(bound, self.bounds.busy_bound(node.kept, zero, schedule, virtual, extra))
                    busy[key] = bound
                if self.transformer:  # the pipeline's fill and drain (per schedule: the key is the stages' ranks)
                    bound = max(bound, self.bounds.fill_bound(node.kept or node, schedule, virtual))
                leaves.append((max(node.bound, bound * SAFE * SAFE), len(leaves), zero, schedule, virtual))
        if not leaves:
            return None
        leaves.sort()
        return Pending(node, leaves, memories)

    def _least_rerun(self, node: Node, device: ir.DeviceType) -> float:
        """The seconds a block's recomputation adds on `device` for a partly recomputed node, least over the kinds
        of block: each kind's forward and backward at the node's recomputation less at its kept node's."""
        rerun, kept = self.figures.kind_times(node, device), self.figures.kind_times(node.kept, device)
        return min(max(0.0, (rerun[kind].forward + rerun[kind].backward) - (kept[kind].forward + kept[kind].backward))
                   for kind in self.figures.block_kinds)

    def resolve(self, pending: Pending) -> tuple[Leaf | None, Pending | None]:
        """The pending node's next leaf partitioned and bounded by its split (`Bounds.split_bound`; None when
        no partition fits), and the node's leaves left (None when none is). The search asks for the leaf's
        exact bound (`finish`) when it reaches that one: most leaves never get there (a 6,144-GPU search's
        busiest rank under the split the caps allow is past the plans it keeps for 6 in 7 of them)."""
        self.stats.leaves += 1
        bound, _, zero, schedule, virtual = pending.leaves[pending.next]
        leaf = self._leaf(pending.node, zero, schedule, virtual, pending.memory[zero], bound)
        rest = None
        if pending.next + 1 < len(pending.leaves):
            rest = Pending(pending.node, pending.leaves, pending.memory, pending.next + 1)
        return leaf, rest

    def retry(self, leaf: Leaf) -> Leaf | None:
        """A partly recomputed leaf that the exact estimate refused (`evaluate`), at the next N with a split that fits
        (`Splits.partial_partition` from N + 1), partitioned and bounded by that split (`resolve`'s form: `finish`
        gives its exact bound); None where N is pinned, where no N short of `full` has a split, and for any other
        leaf. The splits are held to the exact estimate's terms (`Caps.split_fits`) but for the merge of returned
        outputs at the step's end (`outputs = returned`), where it may still refuse one: the leaf is asked again at
        N + 1 rather than dropped. So is an offloading leaf of several kinds of block (`Splits.mixed_offloaded`)."""
        node = leaf.node
        if node.offload and self.dense_blocks and "offload_layers" not in self.pins:  # `Splits.mixed_offloaded`'s N
            return self._leaf(node, leaf.zero, leaf.schedule, leaf.virtual, self.figures.layer_memory(node, leaf.zero),
                              node.bound, leaf.offload_layers + 1)
        if leaf.recompute_layers is None or node.kept is None or "recompute_layers" in self.pins:
            return None
        return self._leaf(node, leaf.zero, leaf.schedule, leaf.virtual, self.figures.layer_memory(node, leaf.zero),
                          node.bound, leaf.recompute_layers + 1)

    def settle(self, leaf: Leaf):
        """The leaf evaluated (`evaluate`), a partly recomputed one at its least N that fits (`retry`): what the
        search returns for it, without its bounds (brute force)."""
        while leaf is not None:
            scored = self.evaluate(leaf)
            if scored is not None:
                return scored
            leaf = self.retry(leaf)
        return None

    def _leaf(self, node: Node, zero: int, schedule: str, virtual: int, memory, floor: float = 0.0,
              least: int = 1) -> Leaf | None:
        """The leaf partitioned (None when no split fits), bounded by its split and `floor` (its bound before); a
        partly recomputed one at its least N from `least` on (`Splits.partial_partition`)."""
        root = node.root
        pp, m = root.pp, node.microbatches
        ranks = stage_ranks(schedule, pp, virtual) if pp > 1 else (0,)
        inflight = self.figures.inflight(schedule, pp, m, virtual) if pp > 1 else _ONE_IN_FLIGHT
        recomputed, offloaded = None, 0
        if node.offload:
            found = self._offloaded(node, zero, ranks, inflight, memory, virtual) if not self.dense_blocks else \
                self.splits.mixed_offloaded(node, zero, ranks, inflight, memory, least)
            if found is None:
                self.stats.memory_pruned += 1
                return None
            counts, offloaded = found
        elif node.kept is not None:
            found = self.splits.partial_partition(node, zero, ranks, inflight, memory, virtual, least) \
                if not self.dense_blocks else self.splits.mixed_partial_partition(node, zero, ranks, inflight, memory,
                                                                                  least)
            counts, recomputed = found if found is not None else (None, None)
        elif self.dense_blocks:
            counts = self.splits.mixed_partition(node, zero, ranks, inflight, memory)
        elif self.transformer:
            counts = self.splits.fitted_partition(node, ranks, inflight, memory, virtual)
        else:
            counts = self.splits.layer_partition(node, ranks, inflight, memory)
        if counts is None:
            self.stats.memory_pruned += 1
            # Recomputing the first N blocks of each stage needs at least what recomputing all of them does (that
            # node's own record); otherwise one stage has one split, whose estimate says what it needs, and over
            # several stages the least need over the splits is not known.
            if node.kept is None and root.pp == 1:
                self.closest.above(candidate_of(node, schedule, virtual, zero), max(root.capacity))
            elif node.kept is None:
                self.stats.memory_unsplit += 1
            return None
        bound = self.bounds.split_bound(node, zero, schedule, ranks, counts, recomputed) * SAFE * SAFE
        return Leaf(node, schedule, virtual, zero, counts, max(floor, bound), recomputed, offloaded, exact=False)

    def _offloaded(self, node: Node, zero: int, ranks, inflight, memory,
                   virtual: int) -> tuple[tuple[int, ...], int] | None:
        """(blocks per stage, N) of an offloading node (one stage), or None: N is the pin, else the least whose
        caps hold every block (`Caps.least_recomputed` over `Caps.offload_memory`: the caps only grow with N, and
        each block offloaded more only adds copies). None where the blocks fit without offloading (the node that
        keeps them is faster; by its caps and the exact estimate, `Figures.kept_fits`), and where no N fits: on the device, where every block offloaded holds as much as all
        but one (the one its backward reloads, `cost.memory.offload_inflight`) and so fits only where N = L - 1 does,
        and on the host, whose memory a device's N offloaded blocks must fit (E514's `cost.offload.host_capacity`),
        which only more N fill."""
        root, pinned = node.root, self.pins.get("offload_layers")
        if pinned is None and self.caps.caps(root, ranks, inflight, memory, virtual) is not None \
                and self.figures.kept_fits(node, zero):
            return None
        moved, kept = self.caps.offload_memory(memory)
        least = pinned if pinned is not None else \
            self.caps.least_recomputed(root, ranks, inflight, moved, virtual, kept)
        if least is None or least > self.blocks or (pinned is None and least >= self.blocks) or \
                least * kept > host_capacity(memory[2]) * (1 + 1e-12) or \
                self.caps.caps(root, ranks, inflight, moved, virtual, least, kept) is None:
            return None
        return (self.blocks,), least

    def finish(self, leaf: Leaf) -> Leaf:
        """The leaf with its exact bound (`Bounds.leaf_bound`: every rank's busy time between the first
        microbatch's arrival and the last gradient's return, plus its exposed reduction and optimizer step),
        never below the bound it had."""
        node, schedule, virtual, zero = leaf.node, leaf.schedule, leaf.virtual, leaf.zero
        ranks = stage_ranks(schedule, node.root.pp, virtual) if node.root.pp > 1 else (0,)
        stages = self.bounds.stage_times(node, zero, ranks, leaf.counts, leaf.recompute_layers)
        bound = self.bounds.leaf_bound(node, schedule, ranks, stages, zero) * SAFE
        return Leaf(node, schedule, virtual, zero, leaf.counts, max(leaf.bound, bound), leaf.recompute_layers,
                    leaf.offload_layers)

    def evaluate(self, leaf: Leaf):
        """The emitted plan through `cost.estimate` (simulation included); None if it does not fit."""
        self.stats.simulated += 1
        node = leaf.node
        candidate = candidate_of(node, leaf.schedule, leaf.virtual, leaf.zero, leaf.recompute_layers,
                                 leaf.offload_layers)
        if node.root.ep > 1:  # the experts' clause `build_plan` writes from the problem's (`self.base`)
            candidate = replace(candidate, fold=self.problem.fold_experts and node.root.tp > 1,
                                dispatcher=self.problem.dispatcher)
        plan = build_plan(self.base, candidate, self.problem.kept)
        ranks = stage_ranks(leaf.schedule, node.root.pp, leaf.virtual) if node.root.pp > 1 else (0,)
        assignment = Assignment(tuple(tuple(s) for s in self.figures.stage_layers(leaf.counts)), ranks, leaf.virtual)
        try:
            estimate = estimate_plan(plan, self.efficiency, assignment)
        except PlanError:
            self.stats.invalid += 1
            return None
        if not estimate.fits:
            self.stats.memory_pruned += 1
            self.closest.estimated(candidate, estimate)
            return None
        return Scored(candidate, leaf.counts, estimate, plan)


__all__ = ["Space", "Root", "Node", "Pending", "Leaf", "SAFE", "candidate_of"]

