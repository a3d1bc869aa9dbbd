"""The search space of `plandsl.search`, its bounds and the partition of layers over stages.

Stage: inside the search. Contract: `Space` enumerates roots (layout and mesh order), nodes (plus
micro-batch size and recomputation) and leaves (plus ZeRO stage, schedule and virtual stages),
each with a lower bound on the step time of every plan below it, and `evaluate` gives a leaf's exact
figures through `cost.estimate`. Per-layer costs, memory and stage sums are memoised: blocks of a kind are
identical, so a stage is (embedding?) + n blocks + (norm and head?) (a dense-then-MoE model: n blocks of
two kinds).
"""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field

import numpy as np

from plandsl import ir
from plandsl.cost.compute import Efficiency, Work
from plandsl.cost.estimate import estimate_plan, pipeline_p2p_seconds
from plandsl.cost.layer import LayerTime, estimate_layer_time
from plandsl.cost.stage import StageTime, fsdp_units, param_split, rank_tail, stage_time, zero_traffic
from plandsl.cost.memory import (estimate_layer_activations, estimate_memory, gathered_bytes, inflight_microbatches,
                                 model_state_bytes, tied_embedding, StateBytes)
from plandsl.ir.layers import Layer, figures_key, layers_of
from plandsl.schedules.registry import BUILTIN, splits_backward
from plandsl.search.choices import (AXES, MAX_MICRO_BATCH, RECOMPUTE, divisors_up_to, layouts, mesh_orders,
                                    schedule_choices, sequence_parallel, stage_ranks, stages_by_rank)
from plandsl.search.partition import least_slowest, partition_blocks, partition_layers, partition_prefixed
from plandsl.search.problem import Candidate, Scored, SearchStats, build_plan
from plandsl.lower.units import format_bytes
from plandsl.diagnostics import PlanError
from plandsl.ir.placement import Assignment

SAFE = 1 - 1e-9  # bounds add in another order than the exact figures: keep them strictly below
_ONE_IN_FLIGHT = np.ones(1)  # a single stage's microbatches in flight (one object: `_caps_cache` keys by identity)


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
    # recompute_layers: `full` for the first N blocks of each stage (N per leaf), the kept blocks' node
    # (recompute none, same root and micro-batch) for the others' seconds and bytes
    kept: Node | None = None


@dataclass(slots=True)
class Leaf:
    node: Node
    schedule: str
    virtual: int
    zero: int
    counts: tuple[int, ...]
    bound: float
    recompute_layers: int | None = None  # a partly recomputed node's N (`Space._partial_partition`)


@dataclass(slots=True)
class Pending:
    """A node's leaves before their partition, best bound first: the search holds one entry per node, for
    the next leaf (`bound`), and partitions them one at a time (`Space.resolve`)."""

    node: Node
    leaves: list            # (bound, index, zero, schedule, virtual), ascending
    memory: dict            # ZeRO stage -> `Space.layer_memory`
    next: int = 0

    @property
    def bound(self) -> float:
        return self.leaves[self.next][0]


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
        self.states = StateBytes.of(self.base.train)  # the kept dtypes' bytes, read on every rank's tail
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
        self._types_cache: dict = {}
        self._caps_cache: dict = {}
        self._partial_cache: dict = {}
        self._p2p_cache: dict = {}
        self._links_cache: dict = {}
        self._links_numbers: dict = {}
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
        # recompute_layers: full recomputation of the first N blocks of each stage, the others kept (Megatron's
        # --recompute-num-layers), for transformers of one block kind, unless a pin rules it out
        pinned, layers = self.pins.get("recompute"), self.pins.get("recompute_layers")
        partly = self.transformer and not self.dense_blocks and (
            layers is not None or pinned is None)
        if layers is not None:
            recomputes = []
        out = []
        for mb in root.micro_batches:
            for recompute in recomputes:
                node = Node(root, mb, per_replica // mb, recompute)
                node.bound = max(node.microbatches * self._microbatch_work(node), self._chain(node)) * SAFE
                out.append(node)
            if partly:  # bounded by its kept node's figures: recomputing a block only adds to its seconds
                kept = next((n for n in out if n.micro_batch == mb and n.recompute == "none"), None) or \
                    Node(root, mb, per_replica // mb, "none")
                kept.bound = kept.bound or max(kept.microbatches * self._microbatch_work(kept), self._chain(kept)) * SAFE
                out.append(Node(root, mb, per_replica // mb, "full", bound=kept.bound, kept=kept))
        self.stats.nodes += len(out)
        return out

    def work(self, node: Node) -> Work:
        root = node.root
        return Work(node.micro_batch, self.problem.sequence, root.tp, root.cp, root.ep, root.sequence_parallel,
                    self.problem.precision, ir.Recompute(node.recompute), gather_kv=root.cp > 1)  # search.CONTEXT

    def _device_types(self, root: Root) -> dict:
        """The root's device types by name, once per root."""
        found = self._types_cache.get(id(root))
        if found is None or found[0] is not root:
            found = self._types_cache[id(root)] = (root, {d.name: d for d in root.rank_devices})
        return found[1]

    def _layer_links(self, links) -> int:
        """The tensor, context and expert links that a layer's time depends on, as a number: one per
        distinct three (hashing the links on every lookup would cost more than the lookup saves)."""
        found = self._links_cache.get(id(links))
        if found is None or found[0] is not links:
            number = self._links_numbers.setdefault((links.tp, links.cp, links.ep), len(self._links_numbers))
            found = self._links_cache[id(links)] = (links, number)
        return found[1]

    def kind_times(self, node: Node, device: ir.DeviceType) -> list[LayerTime]:
        found = node.times.get(device.name)
        if found is None:
            work, links = self.work(node), node.root.links
            layer_links = self._layer_links(links)
            found = []
            for layer, _ in self.kinds:
                key = (work, figures_key(layer), device.name, layer_links)
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
        devices = self._device_types(node.root)
        per_device = {name: [t.forward + t.backward for t in self.kind_times(node, d)] for name, d in devices.items()}
        totals = {name: sum(c * count for c, (_, count) in zip(costs, self.kinds)) for name, costs in per_device.items()}
        if len(totals) == 1:  # one device type: every ratio is 1
            return next(iter(totals.values())) / len(node.root.rank_devices)
        fastest = min(totals, key=totals.get)
        base = per_device[fastest]
        ratio = {name: min((c / b for c, b in zip(costs, base) if b > 0), default=1.0)
                 for name, costs in per_device.items()}
        return totals[fastest] / sum(1.0 / ratio[d.name] for d in node.root.rank_devices)

    def _chain(self, node: Node) -> float:
        """A bound on any step: one microbatch's F through every layer, then its I back (B = I + W;
        W may wait), each layer on the fastest device for it. With fewer microbatches than
        pipeline ranks this, not the work spread over the ranks, bounds the step (`_bound`'s chain)."""
        per_device = [self.kind_times(node, d) for d in self._device_types(node.root).values()]
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
                out.append(leaf)
        return out

    def pending(self, node: Node) -> Pending | None:
        """The node's leaves before their partition, each bounded by its busiest rank over every split
        of the blocks (`_busy_bound`), best first: a leaf is partitioned and given its exact bound only
        when the search reaches that bound, and most never are (a 6,144-GPU search partitions 1 in 5)."""
        self.stats.expanded += 1
        root, pins = node.root, self.pins
        zeros = [pins["zero_stage"]] if "zero_stage" in pins else list(ir.ZERO_STAGES)
        if root.dp * root.ep == 1:
            zeros = [z for z in zeros if z == 0] or zeros[:1]
        choices = schedule_choices(root.pp, node.microbatches, self.blocks, pins.get("schedule"),
                                   pins.get("virtual_stages"))
        if node.recompute == "selective_op":  # its kept outputs serve one backward pass, not I then W (E703)
            choices = [c for c in choices if not splits_backward(c[0])] or choices
        leaves, memories, busy = [], {}, {}
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
            memories[zero] = memory
            for schedule, virtual in choices:
                key = (zero if zero >= 2 else 0, schedule if schedule not in BUILTIN else BUILTIN[schedule].rank_map,
                       virtual)  # ZeRO-0/1 add no traffic to a microbatch; the stages' ranks
                bound = busy.get(key)
                if bound is None and not self.transformer:
                    bound = busy[key] = 0.0
                elif bound is None:  # a partly recomputed node: at least its kept node's seconds, and at least
                    # their compute with one block more recomputed per stage (N >= 1)
                    bound = self._busy_bound(node.kept or node, zero, schedule, virtual, busy)
                    if node.kept is not None:
                        extra = busy.get("extra")
                        if extra is None:
                            extra = busy["extra"] = {
                                name: max(0.0, (self.kind_times(node, device)[1].forward
                                                + self.kind_times(node, device)[1].backward)
                                          - (self.kind_times(node.kept, device)[1].forward
                                             + self.kind_times(node.kept, device)[1].backward))
                                for name, device in self._device_types(node.root).items()}
                        bound = max(bound, self._busy_bound(node.kept, zero, schedule, virtual, busy, extra))
                    busy[key] = bound
                leaves.append((max(node.bound, bound * SAFE * SAFE), len(leaves), zero, schedule, virtual))
        if not leaves:
            return None
        leaves.sort()
        return Pending(node, leaves, memories)

    def resolve(self, pending: Pending) -> tuple[Leaf | None, Pending | None]:
        """The pending node's next leaf partitioned and bounded (None when no partition fits), and the
        node's leaves left (None when none is)."""
        self.stats.leaves += 1
        _, _, zero, schedule, virtual = pending.leaves[pending.next]
        leaf = self._leaf(pending.node, zero, schedule, virtual, pending.memory[zero])
        rest = None
        if pending.next + 1 < len(pending.leaves):
            rest = Pending(pending.node, pending.leaves, pending.memory, pending.next + 1)
        return leaf, rest

    def _busy_bound(self, node: Node, zero: int, schedule: str, virtual: int, found: dict,
                    extra: dict | None = None) -> float:
        """m x the least seconds per microbatch of the busiest pipeline rank over every split of the blocks
        onto the stages (each stage at least one): below `_bound`, whose ranks' busy time is one term
        of its maximum, for whatever split the partition picks. A stage holding n blocks and neither
        the embedding nor the head takes exactly a + n·b (ZeRO-2/3's units are its blocks, so their
        traffic is the same per unit: `cost.stage.zero_traffic` is affine in n); the two stages with
        them take at least their compute, fixed + n·(a block's F + B), ZeRO's traffic only adding. A
        rank's stages sum to at least A + N·B over the N blocks it holds (B the least slope of its
        stages), and `least_slowest` gives the least max over whole splits of the blocks. Chimera's
        ranks run half the microbatches of two stages each, and a dense-then-MoE model's stages hold
        blocks of two kinds: their leaves keep the node's bound. `extra` (seconds per stage, by device
        name): every stage's compute alone, plus that (a partly recomputed stage's one block rerun)."""
        root, info = node.root, BUILTIN.get(schedule)
        if (info is not None and info.pipelines == 2) or self.dense_blocks:
            return 0.0
        ranks = stage_ranks(schedule, root.pp, virtual) if root.pp > 1 else (0,)
        last = len(ranks) - 1
        devices = root.rank_devices
        kinds: dict = {}

        def add(kind: tuple, count: int = 1) -> None:
            kinds[kind] = kinds.get(kind, 0) + count

        ends, others = _rank_shapes(ranks, root.pp)
        if extra is not None:
            uniform = len(self._device_types(root)) == 1
            for rank, owned in ends if uniform else enumerate(stages_by_rank(ranks, root.pp)):
                device = devices[rank]
                _, _, compute, embed_cost, head_cost = self._slopes(node, zero, device, found)
                fixed = (embed_cost if 0 in owned else 0.0) + (head_cost if last in owned else 0.0)
                add((fixed + len(owned) * extra[device.name], compute, len(owned)))
            if uniform:
                compute = self._slopes(node, zero, devices[0], found)[2]
                for stages, count in others.items():
                    add((stages * extra[devices[0].name], compute, stages), count)
            return node.microbatches * least_slowest(self.blocks, kinds)
        for rank, owned in ends:  # the ranks of the embedding's and the head's stages
            offset, middle, compute, embed_cost, head_cost = self._slopes(node, zero, devices[rank], found)
            fixed = sum(offset for s in owned if 0 < s < last)
            fixed += (embed_cost if 0 in owned else 0.0) + (head_cost if last in owned else 0.0)
            add((fixed, min(compute, middle), len(owned)))
        if len(self._device_types(root)) == 1:  # on one device type, the others differ only in their stages
            offset, middle = self._slopes(node, zero, devices[0], found)[:2]
            for stages, count in others.items():
                add((stages * offset, middle, stages), count)
        else:
            for rank, owned in enumerate(stages_by_rank(ranks, root.pp)):
                if all(rank != r for r, _ in ends):
                    offset, middle = self._slopes(node, zero, devices[rank], found)[:2]
                    add((len(owned) * offset, middle, len(owned)))
        return node.microbatches * least_slowest(self.blocks, kinds)

    def _leaf(self, node: Node, zero: int, schedule: str, virtual: int, memory) -> Leaf | None:
        root = node.root
        pp, m = root.pp, node.microbatches
        ranks = stage_ranks(schedule, pp, virtual) if pp > 1 else (0,)
        inflight = self._inflight(schedule, pp, m, virtual) if pp > 1 else _ONE_IN_FLIGHT
        recomputed = None
        if node.kept is not None:
            found = self._partial_partition(node, zero, ranks, inflight, memory, virtual)
            counts, recomputed = found if found is not None else (None, None)
        elif self.dense_blocks:
            counts = self._mixed_partition(node, zero, ranks, inflight, memory)
        elif self.transformer:
            counts = self._transformer_partition(node, ranks, inflight, memory, virtual)
        else:
            counts = self._layer_partition(node, ranks, inflight, memory)
        if counts is None:
            self.stats.memory_pruned += 1
            return None
        stages = self.stage_times(node, zero, ranks, counts, recomputed)
        return Leaf(node, schedule, virtual, zero, counts, self._bound(node, schedule, ranks, stages, zero) * SAFE,
                    recomputed)

    def _rank_caps(self, root: Root, ranks, inflight: np.ndarray, memory, recomputed: int | None = None,
                   kept: float = 0.0) -> np.ndarray:
        """The most blocks each rank holds within its memory: its capacity less the embedding (first
        stage), the norm and head (last), the working set and ZeRO's gathered units, over a block's
        states plus its in-flight microbatches' activations. One array operation over the ranks (a
        pipeline of 4,096 ranks costs what one of 4 does, per leaf). `recomputed` (`recompute_layers`):
        the first that many blocks of each stage store `memory`'s block activations, the others `kept`
        bytes (their own); a rank's blocks are its stages' evenly, so it recomputes min(B, stages x N)
        of B blocks, as many as any split of B recomputes at most (the even split stores the least)."""
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
        per_kept = block_s + inflight * kept if recomputed is not None else per
        # the blocks a rank recomputes at most; an array of N: one row of caps per N
        head = len(ranks) // root.pp * (recomputed[:, None] if isinstance(recomputed, np.ndarray) else recomputed or 0)

        def within(room, per, per_kept):
            if recomputed is None:
                return room // per
            return np.where(room >= head * per, head + (room - head * per) // per_kept, room // per)

        free = per_kept <= 0  # a block that costs a rank nothing (no states, no activations): any number fits
        any_free = bool(free.any())
        if any_free:
            per, per_kept = np.where(free, 1.0, per), np.where(free, 1.0, per_kept)
        room = capacity - working
        one, two = self.gathered(memory, False, False, 1), self.gathered(memory, False, False, 2)
        caps = within(room - two, per, per_kept)  # blocks that fit in the room less the gathered units
        if one != two:  # a rank with 1 block gathers less than one with >= 2 blocks: where 2 do not fit, 1 may
            caps = np.where(caps >= 2, caps, np.minimum(within(room - one, per, per_kept), 1))
        if any_free:
            caps = np.where(free, float(self.blocks), caps)
        if np.ndim(head):  # rows of N: the first and last ranks' columns as the loop below, for every row at once
            caps = np.array(caps, dtype=np.float64)
            for r in fixed:
                room = float(capacity[r]) - fixed[r] - working
                two = within(room - self.gathered(memory, r == first_rank, r == last_rank, 2), per[r], per_kept[r])
                one = within(room - self.gathered(memory, r == first_rank, r == last_rank, 1), per[r], per_kept[r])
                caps[:, r] = self.blocks if free[r] else np.where(two >= 2, two, np.minimum(one, 1.0))[:, 0]
            return np.clip(caps, 0, 2**62).astype(np.int64)
        for r in fixed:  # the first and last ranks, one at a time (`cost.memory` order of terms)
            room = float(capacity[r]) - fixed[r] - working
            cap = self.blocks
            for blocks in (2, 1):
                if free[r]:
                    break
                cap = room - self.gathered(memory, r == first_rank, r == last_rank, blocks)
                cap = float(within(cap, float(per[r]), float(per_kept[r])))
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

    def _caps(self, root: Root, ranks, inflight, memory, virtual, recomputed: int | None = None, kept: float = 0.0):
        """`_rank_caps` as a list, or None when no split fits them; they depend on memory, not on where the
        groups sit, so once for every mesh order of a layout."""
        key = (id(memory), ranks, id(inflight), root.capacity, recomputed, kept)  # memory, inflight: cached objects
        rank_caps = self._caps_cache.get(key, False)
        if rank_caps is False:
            rank_caps = self._rank_caps(root, ranks, inflight, memory, recomputed, kept)
            fits = int(rank_caps.sum()) >= self.blocks and int(rank_caps.min()) >= virtual
            rank_caps = self._caps_cache[key] = rank_caps.tolist() if fits else None
        return rank_caps

    def _transformer_partition(self, node: Node, ranks, inflight, memory, virtual, rank_caps=None):
        root = node.root
        stages = len(ranks)
        rank_caps = rank_caps or self._caps(root, ranks, inflight, memory, virtual)
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
                embed, block, norm, head = self.kind_times(node.kept or node, device)
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

    def _partial_partition(self, node: Node, zero: int, ranks, inflight, memory, virtual):
        """(blocks per stage, N) of a node that recomputes the first N blocks of each stage and keeps the
        others' activations (`recompute_layers`), or None. N is the least whose caps admit a split
        (`_least_recomputed`: the caps only grow with N); among the N that fit, the least is the fastest for its split:
        a larger N recomputes more of the same blocks, all else equal. (It could loosen a cap that bounds
        the split and even it out: one N per leaf keeps the space bounded, and that trade unexplored.)
        None where the kept node's own leaf has the same split (it recomputes nothing: faster), also when
        its caps do not bound its split, and where N reaches every stage's blocks (that is `full`)."""
        root = node.root
        kept_memory = self.layer_memory(node.kept, zero)
        partial, kept = self._partial_memory(memory, kept_memory)
        pinned = self.pins.get("recompute_layers")
        split = None
        if pinned is None:
            kept_caps = self._caps(root, ranks, inflight, kept_memory, virtual)
            if kept_caps is not None:
                split = self._transformer_partition(node.kept, ranks, inflight, kept_memory, virtual, kept_caps)
                free = self._transformer_partition(node.kept, ranks, inflight, kept_memory, virtual,
                                                   [self.blocks * virtual] * root.pp)
                if split == free:  # its caps do not bound the kept node's split: nothing to recompute
                    return None
        least = pinned if pinned is not None else self._least_recomputed(root, ranks, inflight, partial, virtual, kept)
        caps = self._caps(root, ranks, inflight, partial, virtual, least, kept) if least is not None else None
        if caps is None:
            return None
        counts = self._transformer_partition(node, ranks, inflight, partial, virtual, caps)
        if counts is None or (pinned is None and (least >= max(counts) or counts == split)):
            return None
        return counts, least

    def _least_recomputed(self, root: Root, ranks, inflight, partial, virtual, kept: float) -> int | None:
        """The least N (recompute_layers) whose caps admit a split, or None: the caps of every N from 1 to
        the most blocks a stage can hold in one array operation (by bisection where that array would be
        large: the caps only grow with N)."""
        high = self.blocks - len(ranks) + 1
        key = ("least", id(partial), ranks, id(inflight), root.capacity, kept)
        found = self._caps_cache.get(key, False)
        if found is not False:
            return found
        if high * root.pp <= 1 << 16:
            choices = np.arange(1, high + 1, dtype=np.float64)
            caps = self._rank_caps(root, ranks, inflight, partial, choices, kept)
            fits = (caps.sum(axis=1) >= self.blocks) & (caps.min(axis=1) >= virtual)
            found = int(choices[int(fits.argmax())]) if fits.any() else None
        elif self._caps(root, ranks, inflight, partial, virtual, high, kept) is None:
            found = None
        else:
            low = 0
            while high - low > 1:  # the caps at `high` admit a split; at `low`, none (or N = 0, not a choice)
                middle = (low + high) // 2
                low, high = (middle, high) if self._caps(root, ranks, inflight, partial, virtual, middle, kept) is None \
                    else (low, middle)
            found = high
        self._caps_cache[key] = found
        return found

    def _partial_memory(self, memory, kept_memory) -> tuple[tuple, float]:
        """The per-kind memory of a partly recomputed node: a recomputed block's (states, activations, working
        set) from `memory` (full), the embedding's, norm's and head's from `kept_memory` (recompute_layers
        leaves them as they are), and a kept block's activations; one object per pair (`_caps` keys by it)."""
        key = (id(memory), id(kept_memory))
        found = self._partial_cache.get(key)
        if found is None:
            block, tied, plan = memory[0][1], memory[1], memory[2]
            kept_embed, kept_block, kept_norm, kept_head = kept_memory[0][:4]
            found = self._partial_cache[key] = (([kept_embed, block, kept_norm, kept_head], tied, plan),
                                                kept_block[1], memory, kept_memory)
        return found[0], found[1]

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
        dense = self.dense_blocks
        # per stage, as arrays over the stages (a pipeline of many stages costs what one of few does)
        on = np.asarray(ranks)
        first, final = on == first_rank, on == last_rank
        kept = inflight[on]
        dense_bytes, moe_bytes = dense_s + kept * dense_a, moe_s + kept * moe_a
        gathered = {(a, b): self.gathered(memory, a, b, 2) for a in (False, True) for b in (False, True)}
        room = self._capacity(root)[on] - working - np.where(
            first, np.where(final, gathered[True, True], gathered[True, False]),
            np.where(final, gathered[False, True], gathered[False, False]))
        room -= np.where(first, embed_s + kept * embed_a, 0.0)
        room -= np.where(final, norm_s + head_s + kept * (norm_a + head_a) + max(0.0, loss - working)
                         + (tied if tied and first_rank != last_rank else 0.0), 0.0)
        caps = room / np.bincount(on)[on]  # a rank's room is shared by its stages
        # memory first, before any timing: the most blocks of the lighter kind each stage could hold
        lighter = np.minimum(dense_bytes, moe_bytes)
        most = np.where(lighter <= 0, self.blocks, np.maximum(caps, 0.0) // np.where(lighter <= 0, 1.0, lighter))
        if most.min() < 1 or most.sum() < self.blocks:
            self._partition_cache[key] = None
            return None
        seconds = {}
        for r in set(ranks):
            embed, block, norm, head, dense_block = self.kind_times(node, root.rank_devices[r])
            seconds[r] = (dense_block.forward + dense_block.backward, block.forward + block.backward,
                          embed.forward + embed.backward, norm.forward + norm.backward + head.forward + head.backward)
        per = np.array([seconds[r] for r in ranks])
        fixed = np.where(np.arange(len(ranks)) == 0, per[:, 2], 0.0) + np.where(np.arange(len(ranks)) == last, per[:, 3], 0.0)
        count = np.arange(self.blocks + 1)
        in_dense, in_moe = np.minimum(count, dense), np.maximum(count - dense, 0)  # blocks of each kind in 0..i
        prefix = per[:, :1] * in_dense + per[:, 1:2] * in_moe
        held = dense_bytes[:, None] * in_dense + moe_bytes[:, None] * in_moe
        found = self._partition_cache[key] = partition_prefixed(prefix, held, caps, fixed)
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

    def stage_times(self, node: Node, zero: int, ranks, counts, recomputed: int | None = None) -> list[StageTime]:
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
        out, start = [], 0
        for s, n in enumerate(counts):
            dense = max(0, min(start + n, self.dense_blocks) - start)  # of a dense-then-MoE model's blocks
            start += n
            out.append(self._stage_time(node, zero, root.rank_devices[ranks[s]], n, s == 0, s == last, dense,
                                        recomputed))
        return out

    def _slopes(self, node: Node, zero: int, device, found: dict) -> tuple[float, ...]:
        """`_busy_bound`'s figures on a device: a stage without an end, a + n·b, as (a, b); a block's F + B;
        the embedding's and the norm and head's F + B (`found`: the node's, by ZeRO stage and device)."""
        key = (zero if zero >= 2 else 0, device.name)  # ZeRO-0/1 add no traffic to a microbatch
        slope = found.get(key)
        if slope is None:
            embed, block, norm, head = self.kind_times(node, device)[:4]
            one, two = (self._stage_time(node, zero, device, n, False, False) for n in (1, 2))
            middle = (two.forward + two.backward) - (one.forward + one.backward)
            slope = found[key] = (one.forward + one.backward - middle, middle, block.forward + block.backward,
                                          embed.forward + embed.backward,
                                          norm.forward + norm.backward + head.forward + head.backward)
        return slope

    def _stage_time(self, node: Node, zero: int, device, n: int, first: bool, last: bool,
                    dense_blocks: int = 0, recomputed: int | None = None) -> StageTime:
        """One transformer stage of n blocks (`dense_blocks` of them a dense-then-MoE model's dense ones; the
        embedding on the first stage, the norm and head on the last), once per node, ZeRO stage, device
        and shape. A partly recomputed node's stage recomputes its first `recomputed` blocks and runs its
        other layers as its kept node does (`cost.memory.layer_recompute`)."""
        root = node.root
        recomputed = min(n, recomputed) if recomputed is not None else None
        key = (node.ident, zero, device.name, n, first, last, dense_blocks, recomputed)
        found = self._stage_cache.get(key)
        if found is None:
            times = self.kind_times(node, device)
            parts = [(0, 1)] if first else []
            if recomputed is None:
                parts.append((1, n - dense_blocks))
            else:  # the kept blocks and the ends at the kept node's times: their kinds' indices + 4
                times = [*times, *self.kind_times(node.kept, device)]
                parts = [(4, 1)] if first else []
                parts += [(1, recomputed), (5, n - recomputed)]
            if dense_blocks:
                parts.append((4, dense_blocks))
            if last:
                parts += [(2, 1), (3, 1)] if recomputed is None else [(6, 1), (7, 1)]
            sums = [0.0] * 6
            dense = expert = 0.0
            for index, count in parts:
                for i, value in enumerate(_sums(times[index], count)):
                    sums[i] += value
                d, e = self.params(self.kinds[index % len(self.kinds)][0], root.tp, root.ep)
                dense, expert = dense + count * d, expert + count * e
            units = n + (1 if first or last else 0)  # the blocks, and the root (`fsdp_units`)
            found = self._stage_cache[key] = zero_traffic(*sums, dense, expert, zero, self.problem.precision.bytes,
                                                          root.links, units, self.problem.grad_dtype.bytes)
        return found

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
                                              self.problem.optimizer, self.problem.precision, self.states)
            worst_tail = max(worst_tail, tail.exposed + tail.optimizer)
        if pp == 1:
            return m * sum(s.forward + s.backward for s in stages) + worst_tail
        p2p = self._p2p_cache.get(node.ident)
        if p2p is None:
            p2p = self._p2p_cache[node.ident] = pipeline_p2p_seconds(self.model, self.work(node), root.links)
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
        candidate = candidate_of(node, leaf.schedule, leaf.virtual, leaf.zero, leaf.recompute_layers)
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


__all__ = ["Space", "Root", "Node", "Pending", "Leaf", "candidate_of", "partition_blocks", "partition_layers"]


@functools.lru_cache(maxsize=4096)
def _rank_shapes(ranks: tuple[int, ...], pp: int) -> tuple[tuple, dict]:
    """The ranks holding the first and the last stage, with their stages, and how many other ranks hold
    each number of stages (`_busy_bound`, on one device type)."""
    by_rank = stages_by_rank(ranks, pp)
    ends = tuple((rank, by_rank[rank]) for rank in sorted({ranks[0], ranks[-1]}))
    others: dict = {}
    for rank, owned in enumerate(by_rank):
        if rank not in (ranks[0], ranks[-1]):
            others[len(owned)] = others.get(len(owned), 0) + 1
    return ends, others


def candidate_of(node: Node, schedule: str, virtual: int, zero: int, recompute_layers: int | None = None) -> Candidate:
    r = node.root
    return Candidate(r.dp, r.tp, r.pp, r.cp, r.ep, r.order, node.micro_batch, node.microbatches, schedule, virtual,
                     zero, node.recompute, r.sequence_parallel, recompute_layers)
