"""The search space of `plandsl.search`, its bounds and the partition of layers over stages.

Stage: inside the search. Contract: `Space` enumerates roots (layout and mesh order), nodes (plus
micro-batch size and recomputation) and leaves (plus ZeRO stage, schedule and virtual stages),
each with a lower bound on the step time of every plan below it, and `evaluate` gives a leaf's exact
figures through `cost.estimate`. Per-layer costs, memory and stage sums are memoised: blocks of a kind are
identical, so a stage is (embedding?) + n blocks + (norm and head?) (a dense-then-MoE model: n blocks of
two kinds).
"""
from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from plandsl import ir
from plandsl.cost.compute import Efficiency, Work
from plandsl.cost.estimate import estimate_plan, pipeline_p2p_seconds
from plandsl.cost.layer import LayerTime, estimate_layer_time
from plandsl.cost.stage import StageTime, fsdp_units, param_split, rank_tail, stage_time, zero_traffic
from plandsl.cost.memory import (estimate_layer_activations, estimate_memory, gathered_bytes, inflight_microbatches,
                                 model_state_bytes, tied_embedding)
from plandsl.ir.layers import Layer, figures_key, layers_of
from plandsl.schedules.registry import BUILTIN, splits_backward
from plandsl.search.choices import (AXES, MAX_MICRO_BATCH, RECOMPUTE, divisors_up_to, layouts, mesh_orders,
                                    schedule_choices, sequence_parallel, stage_ranks, stages_by_rank)
from plandsl.search.partition import partition_blocks, partition_layers
from plandsl.search.problem import Candidate, Scored, SearchStats, build_plan
from plandsl.lower.units import format_bytes
from plandsl.diagnostics import PlanError
from plandsl.ir.placement import Assignment

SAFE = 1 - 1e-9  # bounds add in another order than the exact figures: keep them strictly below


# ---- the tree ------------------------------------------------------------------------------------------------
@dataclass
class Root:
    """A layout (degrees) and a mesh order, i.e. where every group sits on the nodes."""

    dp: int
    tp: int
    pp: int
    cp: int
    ep: int
    order: tuple[str, ...]
    links: object
    rank_devices: tuple
    capacity: tuple
    sequence_parallel: bool
    micro_batches: tuple[int, ...]
    bound: float = 0.0


_IDENT = itertools.count()


@dataclass
class Node:
    root: Root
    micro_batch: int
    microbatches: int
    recompute: str
    times: dict = field(default_factory=dict)   # device name -> per kind LayerTime
    bound: float = 0.0
    ident: int = field(default_factory=lambda: next(_IDENT))


@dataclass
class Leaf:
    node: Node
    schedule: str
    virtual: int
    zero: int
    counts: tuple[int, ...]
    bound: float


_FIELDS = 7  # forward, input_grad, weight_grad, comm, flops, recompute_flops, (params below)


def _sums(time: LayerTime, count: int = 1) -> tuple[float, ...]:
    return (count * time.forward, count * time.input_grad, count * time.weight_grad,
            count * (time.forward_comm + time.backward_comm), count * time.flops, count * time.recompute_flops)


class Space:
    def __init__(self, problem, pins, efficiency: Efficiency | None):
        self.problem, self.pins, self.efficiency = problem, pins, efficiency
        self.model = problem.model
        self.layers = layers_of(problem.model)
        self.transformer = isinstance(problem.model, ir.TransformerModel)
        # E506: a microbatch must give each of the model's BatchNorms more than one value per channel
        self.norm_values = problem.model.norm_values if isinstance(problem.model, ir.CustomModel) else 0
        self.blocks = sum(1 for layer in self.layers if layer.kind == "block") if self.transformer \
            else len(self.layers)
        self.dense_blocks = 0  # a dense-then-MoE transformer's leading dense blocks (`_kinds`)
        self.kinds = self._kinds()
        self.devices = problem.cluster.devices_in_order()
        self.base = self._base_plan()
        self._time_cache: dict = {}
        self._memory_cache: dict = {}
        self._states_cache: dict = {}
        self._activations_cache: dict = {}
        self._param_cache: dict = {}
        self._stage_cache: dict = {}
        self._tail_cache: dict = {}
        self._partition_cache: dict = {}
        self._gathered_cache: dict = {}
        self._capacity_cache: dict = {}
        self._inflight_cache: dict = {}
        self.stats = SearchStats()

    def _kinds(self) -> list[tuple[Layer, int]]:
        """(layer, count): transformers are an embedding, L identical blocks, a norm and a head; a dense-then-MoE
        one (`dense_layers`) has its D leading dense blocks as a fifth kind after them, the L - D MoE blocks
        as the second (`dense_blocks` = D; its stages are partitioned over the blocks in order,
        `_mixed_partition`)."""
        if not self.transformer:
            return [(layer, 1) for layer in self.layers]
        blocks = [layer for layer in self.layers if layer.kind == "block"]
        last = figures_key(blocks[-1])
        self.dense_blocks = next((i for i, block in enumerate(blocks) if figures_key(block) == last), 0)
        by_kind = {layer.kind: layer for layer in self.layers if layer.kind != "block"}
        kinds = [(by_kind["embed"], 1), (blocks[-1], self.blocks - self.dense_blocks), (by_kind["norm"], 1),
                 (by_kind["head"], 1)]
        return kinds + ([(blocks[0], self.dense_blocks)] if self.dense_blocks else [])

    def _base_plan(self) -> ir.Plan:
        p = self.problem
        train = p.training()
        mesh = ir.Mesh(axes=(ir.Axis(name="dp", size=1),))
        return ir.Plan.model_construct(name="generated", model=p.model, cluster=p.cluster, mesh=mesh, train=train,
                                       data=None, tensor=None, context=None, experts=None, stages=None,
                                       schedule=None, shard=())

    # -- roots: layouts and orders --
    def layouts(self, check_batch: bool = True) -> list[tuple[int, int, int, int, int]]:
        p = self.problem
        return layouts(self.model, p.cluster.num_devices, p.sequence, p.global_batch, self.blocks, self.pins,
                       check_batch)

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
            if not self._states_may_fit(layout):
                self.stats.memory_pruned += 1
                continue
            splits_sequence = sequence_parallel(self.model, p.sequence, tp, cp)
            for order, links, devices, capacity in self._orders(layout):
                root = Root(dp, tp, pp, cp, ep, order, links, devices, capacity, splits_sequence, sizes)
                # Per token, a microbatch costs least at the largest micro-batch size and without
                # recomputation (GEMMs grow, latencies amortise): a bound for every node below.
                largest = Node(root, sizes[-1], per_replica // sizes[-1], "none")
                fastest = min(sum(count * (t.forward + t.backward) for t, (_, count) in
                                  zip(self.kind_times(largest, d), self.kinds)) for d in {d.name: d for d in devices}.values())
                root.bound = largest.microbatches * fastest / pp * SAFE
                out.append(root)
        self.stats.roots = len(out)
        return out

    def _orders(self, layout):
        orders, across = mesh_orders(self.problem.cluster, layout, self.pins, self.devices, self.problem.precision)
        self.stats.tp_across_nodes += across
        return orders

    def _states_may_fit(self, layout) -> bool:
        """ZeRO-3 model states spread perfectly over the pipeline: a necessary condition."""
        dp, tp, pp, cp, ep = layout
        sizes = {"dp": dp, "ep": ep, "pp": pp, "cp": cp, "tp": tp}
        probe = Root(dp, tp, pp, cp, ep, tuple(a for a in AXES if sizes[a] > 1), None, (), (), False, (1,))
        per_kind = self.layer_memory(Node(probe, 1, 1, "full"), 3 if dp * ep > 1 else 0)[0]
        states = sum(count * per_kind[i][0] for i, (_, count) in enumerate(self.kinds))
        capacity = max(g.node.device.usable_memory for g in self.problem.cluster.groups)
        if states / pp > capacity:
            self._note_memory(f"dp={dp} tp={tp} pp={pp} cp={cp} ep={ep} needs {format_bytes(states / pp)} of model "
                              f"states per device even with ZeRO-3", states / pp / capacity)
            return False
        return True

    def _note_memory(self, text: str, ratio: float) -> None:
        if ratio < self.stats.memory_example_ratio:
            self.stats.memory_example, self.stats.memory_example_ratio = text, ratio

    # -- nodes: micro-batch size and recomputation --
    def expand_root(self, root: Root) -> list[Node]:
        recomputes = [self.pins["recompute"]] if "recompute" in self.pins else list(RECOMPUTE)
        # No attention core without a transformer; selective_op keeps dense blocks' matmuls only (E704).
        dropped = ("selective", "selective_op") if not self.transformer else \
            ("selective_op",) if self.problem.model.experts or self.problem.model.latent_attention else ()
        recomputes = [r for r in recomputes if r not in dropped] or recomputes
        per_replica = self.problem.global_batch // (root.dp * root.ep)
        out = []
        for mb in root.micro_batches:
            for recompute in recomputes:
                node = Node(root, mb, per_replica // mb, recompute)
                node.bound = max(node.microbatches * self._microbatch_work(node), self._chain(node)) * SAFE
                out.append(node)
        self.stats.nodes += len(out)
        return out

    def work(self, node: Node) -> Work:
        root = node.root
        return Work(node.micro_batch, self.problem.sequence, root.tp, root.cp, root.ep, root.sequence_parallel,
                    self.problem.precision, ir.Recompute(node.recompute), gather_kv=root.cp > 1)  # search.CONTEXT

    def kind_times(self, node: Node, device: ir.DeviceType) -> list[LayerTime]:
        found = node.times.get(device.name)
        if found is None:
            work, links = self.work(node), node.root.links
            found = []
            for layer, _ in self.kinds:
                key = (work, figures_key(layer), device.name, links.tp, links.cp, links.ep)
                time = self._time_cache.get(key)
                if time is None:
                    time = self._time_cache[key] = estimate_layer_time(self.model, layer, work, device, links,
                                                                       self.efficiency)
                found.append(time)
            node.times[device.name] = found
        return found

    def _microbatch_work(self, node: Node) -> float:
        """A bound on the busiest rank's seconds per microbatch: all the work spread perfectly.

        On rank r's device every kind of layer takes at least ratio_r times its time on the
        fastest device, so max_r busy_r >= W_fast / sum_r (1 / ratio_r) (= W / pp when all match)."""
        devices = {d.name: d for d in node.root.rank_devices}
        per_device = {name: [t.forward + t.backward for t in self.kind_times(node, d)] for name, d in devices.items()}
        totals = {name: sum(c * count for c, (_, count) in zip(costs, self.kinds)) for name, costs in per_device.items()}
        fastest = min(totals, key=totals.get)
        base = per_device[fastest]
        ratio = {name: min((c / b for c, b in zip(costs, base) if b > 0), default=1.0)
                 for name, costs in per_device.items()}
        return totals[fastest] / sum(1.0 / ratio[d.name] for d in node.root.rank_devices)

    def _chain(self, node: Node) -> float:
        """A bound on any step: one microbatch's F through every layer, then its I back (B = I + W;
        W may wait), each layer on the fastest device for it. With fewer microbatches than
        pipeline ranks this, not the work spread over the ranks, bounds the step (`_bound`'s chain)."""
        devices = {d.name: d for d in node.root.rank_devices}.values()
        per_device = [self.kind_times(node, d) for d in devices]
        return sum(count * min(times[i].forward + times[i].input_grad for times in per_device)
                   for i, (_, count) in enumerate(self.kinds))

    def params(self, layer: Layer, tp: int, ep: int) -> tuple[int, int]:
        key = (figures_key(layer), tp, ep)
        found = self._param_cache.get(key)
        if found is None:
            found = self._param_cache[key] = param_split(layer, tp, ep)
        return found

    # -- memory per layer kind, from the one memory model --
    def layer_memory(self, node: Node, zero: int):
        """Per kind (model-state bytes, activation bytes per microbatch, recompute working set), the
        states a head adds on a rank without its tied embedding, and a plan with the node's states."""
        root = node.root
        key = (root.tp, root.cp, root.ep, root.dp, node.micro_batch, zero, node.recompute, root.sequence_parallel)
        found = self._memory_cache.get(key)
        if found is None:
            states, tied, plan = self._states(node, zero)
            kept = self._activations(node, zero)
            found = self._memory_cache[key] = ([(s, *a) for s, a in zip(states, kept)], tied, plan)
        return found

    def _states(self, node: Node, zero: int):
        """Model states per kind: a function of the degrees and the ZeRO stage, not of the micro-batch
        or the recomputation (`cost.memory.model_state_bytes`), so one per layout and stage."""
        root = node.root
        key = (root.tp, root.cp, root.ep, root.dp, zero)
        found = self._states_cache.get(key)
        if found is None:
            plan = build_plan(self.base, candidate_of(node, "", 1, zero))
            states = [sum(model_state_bytes(plan, [layer])) for layer, _ in self.kinds]
            tied = 0.0
            if self.transformer and getattr(self.model, "tied_embeddings", False):
                copy = tied_embedding(plan, self.layers)
                tied = sum(model_state_bytes(plan, [], [copy])) if copy is not None else 0.0
            found = self._states_cache[key] = (states, tied, plan)
        return found

    def _activations(self, node: Node, zero: int):
        """(stored per microbatch, recompute working set) per kind: a function of the micro-batch, the
        recomputation and the tensor and context split, not of dp or ZeRO (`cost.memory._layer_activations`)."""
        root = node.root
        key = (root.tp, root.cp, root.ep, node.micro_batch, node.recompute, root.sequence_parallel)
        found = self._activations_cache.get(key)
        if found is None:
            plan = build_plan(self.base, candidate_of(node, "", 1, zero))
            found = self._activations_cache[key] = [
                (estimate_layer_activations(plan, layer), estimate_memory(plan, [[layer]], [[0]], [0])[0].activations)
                for layer, _ in self.kinds]
        return found

    def gathered(self, memory, first: bool, last: bool, blocks: int) -> float:
        """ZeRO-2/3's unsharded units on a rank (`cost.memory.gathered_bytes`) of a transformer with
        `blocks` blocks there, the embedding on the first rank and the norm and head on the last."""
        plan = memory[2]
        if plan.data is None or plan.data.zero_stage < 2:
            return 0.0
        key = (id(plan), first, last, min(blocks, 2))  # the plan of the states: one per layout and stage
        found = self._gathered_cache.get(key)
        if found is None:
            embed, block, norm, head = (layer for layer, _ in self.kinds[:4])
            layers = ([embed] if first else []) + [block] * min(blocks, 2) + ([norm, head] if last else [])
            if self.dense_blocks:  # either kind may be the two gathered: the two largest of both (a bound)
                layers += [self.kinds[4][0]] * min(blocks, 2)
            copy = tied_embedding(plan, self.layers) if last and not first else None
            found = self._gathered_cache[key] = sum(gathered_bytes(plan, layers, [copy] if copy else []))
        return found

    # -- leaves: ZeRO stage, schedule, virtual stages --
    def expand(self, node: Node) -> list[Leaf]:
        self.stats.expanded += 1
        root, pins = node.root, self.pins
        zeros = [pins["zero_stage"]] if "zero_stage" in pins else list(ir.ZERO_STAGES)
        if root.dp * root.ep == 1:
            zeros = [z for z in zeros if z == 0] or zeros[:1]
        choices = schedule_choices(root.pp, node.microbatches, self.blocks, pins.get("schedule"),
                                   pins.get("virtual_stages"))
        if node.recompute == "selective_op":  # its kept outputs serve one backward pass, not I then W (E703)
            choices = [c for c in choices if not splits_backward(c[0])] or choices
        out = []
        for zero in zeros:
            memory = self.layer_memory(node, zero)
            per_kind = memory[0]
            states = sum(count * per_kind[i][0] for i, (_, count) in enumerate(self.kinds))
            stored = sum(count * per_kind[i][1] for i, (_, count) in enumerate(self.kinds))
            if (states + stored) / root.pp > max(root.capacity):
                self.stats.memory_pruned += len(choices)
                self._note_memory(f"{candidate_of(node, '', 1, zero).describe()} needs at least "
                                  f"{format_bytes((states + stored) / root.pp)} per device "
                                  f"(of {format_bytes(max(root.capacity))})",
                                  (states + stored) / root.pp / max(root.capacity))
                continue
            for schedule, virtual in choices:
                self.stats.leaves += 1
                leaf = self._leaf(node, zero, schedule, virtual, memory)
                if leaf is not None:
                    out.append(leaf)
        return out

    def _leaf(self, node: Node, zero: int, schedule: str, virtual: int, memory) -> Leaf | None:
        root = node.root
        pp, m = root.pp, node.microbatches
        ranks = stage_ranks(schedule, pp, virtual) if pp > 1 else (0,)
        inflight = self._inflight(schedule, pp, m, virtual) if pp > 1 else np.ones(1)
        if self.dense_blocks:
            counts = self._mixed_partition(node, zero, ranks, inflight, memory)
        elif self.transformer:
            counts = self._transformer_partition(node, ranks, inflight, memory, virtual)
        else:
            counts = self._layer_partition(node, ranks, inflight, memory)
        if counts is None:
            self.stats.memory_pruned += 1
            return None
        stages = self.stage_times(node, zero, ranks, counts)
        return Leaf(node, schedule, virtual, zero, counts, self._bound(node, schedule, ranks, stages, zero) * SAFE)

    def _rank_caps(self, root: Root, ranks, inflight: np.ndarray, memory) -> np.ndarray:
        """The most blocks each rank holds within its memory: its capacity less the embedding (first
        stage), the norm and head (last), the working set and ZeRO's gathered units, over a block's
        states plus its in-flight microbatches' activations. One array operation over the ranks (a
        pipeline of 4,096 ranks costs what one of 4 does, per leaf)."""
        per_kind, tied, _ = memory
        (embed_s, embed_a, _), (block_s, block_a, working), (norm_s, norm_a, _), (head_s, head_a, loss) = per_kind
        first_rank, last_rank = ranks[0], ranks[-1]
        fixed = {first_rank: 0.0, last_rank: 0.0}
        fixed[first_rank] += embed_s + inflight[first_rank] * embed_a
        # the head's working set is the loss's backward (`cost.memory.loss_backward_bytes`): the last rank's
        # peak moment is the larger of it and the block rebuilt by recomputation
        fixed[last_rank] += norm_s + head_s + inflight[last_rank] * (norm_a + head_a) + max(0.0, loss - working)
        if tied and first_rank != last_rank:
            fixed[last_rank] += tied
        capacity = self._capacity(root)
        per = block_s + inflight * block_a

        free = per <= 0  # a block that costs a rank nothing (no states, no activations): any number fits
        any_free = bool(free.any())
        if any_free:
            per = np.where(free, 1.0, per)
        room = capacity - working
        one, two = self.gathered(memory, False, False, 1), self.gathered(memory, False, False, 2)
        caps = (room - two) // per  # blocks that fit in the room less the gathered units
        if one != two:  # a rank with 1 block gathers less than one with >= 2 blocks: where 2 do not fit, 1 may
            caps = np.where(caps >= 2, caps, np.minimum((room - one) // per, 1))
        if any_free:
            caps = np.where(free, float(self.blocks), caps)
        for r in fixed:  # the first and last ranks, one at a time (`cost.memory` order of terms)
            room = float(capacity[r]) - fixed[r] - working
            cap = self.blocks
            for blocks in (2, 1):
                if free[r]:
                    break
                cap = room - self.gathered(memory, r == first_rank, r == last_rank, blocks)
                cap = cap // float(per[r])
                if cap >= 2:
                    break
                if blocks == 1:  # gathering one unit, the rank holds one block at most (two gather two)
                    cap = min(cap, 1.0)
            caps[r] = cap
        return np.clip(caps, 0, 2**62).astype(np.int64)

    def _capacity(self, root: Root) -> np.ndarray:
        """The ranks' capacities as an array, once per root (keyed by identity: hashing a 4,096-entry
        tuple on every leaf would cost what the array saves)."""
        found = self._capacity_cache.get(id(root))
        if found is None or found[0] is not root:
            found = self._capacity_cache[id(root)] = (root, np.array(root.capacity, dtype=np.float64))
        return found[1]

    def _inflight(self, schedule: str, pp: int, microbatches: int, virtual: int) -> np.ndarray:
        """`cost.memory.inflight_microbatches` per rank, once per (schedule, pp, m, v) of the search."""
        key = (schedule, pp, microbatches, virtual)
        found = self._inflight_cache.get(key)
        if found is None:
            found = self._inflight_cache[key] = np.array(inflight_microbatches(schedule, pp, microbatches, virtual),
                                                         dtype=np.float64)
        return found

    def _transformer_partition(self, node: Node, ranks, inflight, memory, virtual):
        root = node.root
        stages = len(ranks)
        rank_caps = self._rank_caps(root, ranks, inflight, memory)
        if int(rank_caps.sum()) < self.blocks or int(rank_caps.min()) < virtual:
            return None  # memory: no split fits, before any timing
        rank_caps = rank_caps.tolist()
        key = (node.ident, ranks, tuple(rank_caps))
        found = self._partition_cache.get(key, False)
        if found is not False:
            return found
        costs = {}
        fixed, per_block, caps, seen = [], [], [], [0] * root.pp
        for s, r in enumerate(ranks):
            device = root.rank_devices[r]
            cost = costs.get(device.name)
            if cost is None:
                embed, block, norm, head = self.kind_times(node, device)
                cost = costs[device.name] = (embed.forward + embed.backward, block.forward + block.backward,
                                             norm.forward + norm.backward + head.forward + head.backward)
            fixed.append((cost[0] if s == 0 else 0.0) + (cost[2] if s == stages - 1 else 0.0))
            per_block.append(cost[1])
            # A rank's room for blocks, shared by its stages evenly (the earlier ones first).
            base, more = divmod(rank_caps[r], virtual)
            caps.append(base + (1 if seen[r] < more else 0))
            seen[r] += 1
        found = self._partition_cache[key] = partition_blocks(self.blocks, fixed, per_block, caps)
        return found

    def _mixed_partition(self, node: Node, zero: int, ranks, inflight, memory):
        """Blocks per stage of a transformer with two kinds of block, the dense ones first: the dynamic
        programme over the blocks in order (`partition_layers`), each block at its own kind's seconds and
        bytes on its stage's rank, the embedding and the norm and head as fixed seconds and bytes of the
        first and last stage, a rank's room shared evenly by its stages, ZeRO's gathered units taken as the
        two largest of either kind (a bound)."""
        root = node.root
        key = (node.ident, zero, ranks, inflight.tobytes())
        found = self._partition_cache.get(key, False)
        if found is not False:
            return found
        per_kind, tied, _ = memory
        (embed_s, embed_a, _), (moe_s, moe_a, moe_w), (norm_s, norm_a, _), (head_s, head_a, loss), \
            (dense_s, dense_a, dense_w) = per_kind
        working = max(moe_w, dense_w)
        first_rank, last_rank, last = ranks[0], ranks[-1], len(ranks) - 1
        dense, moe = self.dense_blocks, self.blocks - self.dense_blocks
        shares = Counter(ranks)  # a rank's room is shared by its stages
        held, caps = [], []
        for r in ranks:
            held.append((dense_s + inflight[r] * dense_a, moe_s + inflight[r] * moe_a))
            room = root.capacity[r] - working - self.gathered(memory, r == first_rank, r == last_rank, 2)
            if r == first_rank:
                room -= embed_s + inflight[r] * embed_a
            if r == last_rank:
                room -= norm_s + head_s + inflight[r] * (norm_a + head_a) + max(0.0, loss - working)
                room -= tied if tied and first_rank != last_rank else 0.0
            caps.append(room / shares[r])
        # memory first, before any timing: the most blocks of the lighter kind each stage could hold
        most = [self.blocks if min(pair) <= 0 else max(0.0, cap) // min(pair) for pair, cap in zip(held, caps)]
        if min(most) < 1 or sum(most) < self.blocks:
            self._partition_cache[key] = None
            return None
        costs, fixed = [], []
        for s, r in enumerate(ranks):
            embed, block, norm, head, dense_block = self.kind_times(node, root.rank_devices[r])
            costs.append([dense_block.forward + dense_block.backward] * dense + [block.forward + block.backward] * moe)
            fixed.append((embed.forward + embed.backward if s == 0 else 0.0)
                         + (norm.forward + norm.backward + head.forward + head.backward if s == last else 0.0))
        held = [[dense_bytes] * dense + [moe_bytes] * moe for dense_bytes, moe_bytes in held]
        found = self._partition_cache[key] = partition_layers(costs, held, caps, fixed)
        return found

    def _layer_partition(self, node: Node, ranks, inflight, layer_memory):
        root = node.root
        per_kind, plan = layer_memory[0], layer_memory[2]
        costs, memory, caps = [], [], []
        # ZeRO-2/3's gathered units: the two largest of the model, wherever they are (a bound).
        working = max(k[2] for k in per_kind) + sum(gathered_bytes(plan, self.layers))
        for r in ranks:
            costs.append([t.forward + t.backward for t in self.kind_times(node, root.rank_devices[r])])
            memory.append([k[0] + inflight[r] * k[1] for k in per_kind])
            caps.append((root.capacity[r] - working) / sum(1 for q in ranks if q == r))
        return partition_layers(costs, memory, caps)

    def stage_layers(self, counts: tuple[int, ...]) -> list[list[Layer]]:
        if not self.transformer:
            bounds = list(itertools.accumulate(counts, initial=0))
            return [list(self.layers[a:b]) for a, b in zip(bounds, bounds[1:])]
        blocks = [layer for layer in self.layers if layer.kind == "block"]
        bounds = list(itertools.accumulate(counts, initial=0))
        out = [blocks[a:b] for a, b in zip(bounds, bounds[1:])]
        out[0] = [self.layers[0]] + out[0]
        out[-1] = out[-1] + [layer for layer in self.layers if layer.kind in ("norm", "head")]
        return out

    def stage_times(self, node: Node, zero: int, ranks, counts) -> list[StageTime]:
        root = node.root
        element = self.problem.precision.bytes
        last = len(counts) - 1
        if not self.transformer:
            out = []
            for s, layers in enumerate(self.stage_layers(counts)):
                device = root.rank_devices[ranks[s]]
                times = [self.kind_times(node, device)[self.layers.index(layer)] for layer in layers]
                params = [self.params(layer, root.tp, root.ep) for layer in layers]
                out.append(stage_time(times, params, zero, element, root.links, fsdp_units(layers),
                                      self.problem.grad_dtype.bytes))
            return out
        out = []
        start = 0
        for s, n in enumerate(counts):
            device = root.rank_devices[ranks[s]]
            dense = max(0, min(start + n, self.dense_blocks) - start)  # of a dense-then-MoE model's blocks
            start += n
            key = (node.ident, zero, device.name, n, s == 0, s == last, dense)
            found = self._stage_cache.get(key)
            if found is None:
                parts = [(0, 1)] if s == 0 else []
                parts.append((1, n - dense))
                if dense:
                    parts.append((4, dense))
                if s == last:
                    parts += [(2, 1), (3, 1)]
                times = self.kind_times(node, device)
                sums = [0.0] * 6
                dense = expert = 0.0
                for index, count in parts:
                    for i, value in enumerate(_sums(times[index], count)):
                        sums[i] += value
                    d, e = self.params(self.kinds[index][0], root.tp, root.ep)
                    dense, expert = dense + count * d, expert + count * e
                units = n + (1 if s == 0 or s == last else 0)  # the blocks, and the root (`fsdp_units`)
                found = self._stage_cache[key] = zero_traffic(*sums, dense, expert, zero, element, root.links, units,
                                                              self.problem.grad_dtype.bytes)
            out.append(found)
        return out

    def _bound(self, node: Node, schedule: str, ranks, stages: list[StageTime], zero: int) -> float:
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
                replicas = root.dp * root.ep * root.cp  # cost.memory.zero_degrees
                tail = tails[key] = rank_tail([stages[s] for s in owned], zero, (replicas, replicas // root.ep),
                                              self.problem.precision.bytes, root.links, root.rank_devices[rank],
                                              self.problem.optimizer, self.problem.precision, self.problem.states)
            worst_tail = max(worst_tail, tail.exposed + tail.optimizer)
        if pp == 1:
            return m * sum(s.forward + s.backward for s in stages) + worst_tail
        p2p = pipeline_p2p_seconds(self.model, self.work(node), root.links)
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

    # -- the exact figures --
    def evaluate(self, leaf: Leaf):
        """The emitted plan through `cost.estimate` (simulation included); None if it does not fit."""
        self.stats.simulated += 1
        node = leaf.node
        candidate = candidate_of(node, leaf.schedule, leaf.virtual, leaf.zero)
        plan = build_plan(self.base, candidate)
        ranks = stage_ranks(leaf.schedule, node.root.pp, leaf.virtual) if node.root.pp > 1 else (0,)
        assignment = Assignment(tuple(tuple(s) for s in self.stage_layers(leaf.counts)), ranks, leaf.virtual)
        try:
            estimate = estimate_plan(plan, self.efficiency, assignment)
        except PlanError:
            self.stats.invalid += 1
            return None
        if not estimate.fits:
            self.stats.memory_pruned += 1
            return None
        return Scored(candidate, leaf.counts, estimate, plan)


__all__ = ["Space", "Root", "Node", "Leaf", "candidate_of", "partition_blocks", "partition_layers"]


def candidate_of(node: Node, schedule: str, virtual: int, zero: int) -> Candidate:
    r = node.root
    return Candidate(r.dp, r.tp, r.pp, r.cp, r.ep, r.order, node.micro_batch, node.microbatches, schedule, virtual,
                     zero, node.recompute, r.sequence_parallel)
