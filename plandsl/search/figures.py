"""Per-layer figures of one search, memoised: the model's kinds of layer, each kind's seconds on a device
(`cost.layer`), its parameters, its memory (`cost.memory`: states, activations, ZeRO's gathered units),
and the per-root and per-schedule arrays the caps read.

Stage: inside the search, below the caps, the partitions, the bounds and the space. Contract: `Figures`
answers for a node (or root) of the search tree from the one cost model; blocks of a kind are identical,
so every answer is per kind, computed once per search.
"""
from __future__ import annotations

from dataclasses import replace
import functools
import itertools

import numpy as np

from plandsl import ir
from plandsl.cost.compute import Efficiency, LayerCompute, Work, accumulate_bytes, estimate_layer_compute
from plandsl.cost.estimate import simulated_peaks, estimate_plan
from plandsl.cost.layer import LayerTime, estimate_layer_time
from plandsl.cost.memory import (autocast_weight_copies, beyond_layers, estimate_layer_activations, estimate_memory,
                                 fsdp_apart, gathered_bytes, gathered_param_bytes, gathers_by_moments, unit_moments,
                                 gathers_whole, head_inflight, holds_autocast_copies, inflight_microbatches,
                                 whole_vocab_gradient, whole_vocab_gradient_element,
                                 layer_precision, one_backward_makes_gradients, open_gradient_stages,
                                 pipelined_shards, releases_gradients,
                                 model_state_bytes, returned_output_bytes, tied_embedding, torch_stage_sizes,
                                 replicates_units, whole_vocab_gradient_bytes, StateBytes, estimate_plan_memory,
                                 held_stages, layer_offload, layer_recompute, local_numel, zero_degrees,
                                 is_expert_tensor)
from plandsl.cost.stage import param_split
from plandsl.diagnostics import PlanError
from plandsl.ir.placement import Assignment
from plandsl.ir.layers import Layer, figures_key, layers_of, once_per_figures
from plandsl.ir.shard_rules import ruled_layers
from plandsl.schedules.bounded import builtin_profiles
from plandsl.schedules.registry import BUILTIN, splits_backward
from plandsl.search.choices import stage_ranks
from plandsl.search.problem import CONTEXT, Problem, build_plan
from plandsl.search.tree import Node, Root, candidate_of


class Figures:
    def __init__(self, problem: Problem, efficiency: Efficiency | None, memory_caches: dict | None = None):
        """`memory_caches`: the memory figures' memos (per kind, the caps of `Caps`), shared by the spaces of the
        experts' dispatchers with one folding (`search._spaces`): memory does not depend on the dispatcher
        (tests/unit/test_search_experts.py holds the estimate to it), the layer times do."""
        self.problem, self.efficiency = problem, efficiency
        self.model = problem.model
        self.transformer = isinstance(problem.model, ir.TransformerModel)
        self.layers = self._ruled(layers_of(problem.model))
        self.blocks = sum(1 for layer in self.layers if layer.kind == "block") if self.transformer \
            else len(self.layers)
        self.dense_blocks = 0  # a transformer's blocks of its kinds but the main one (`_kinds`: dense, windowed)
        self.dense_before, self.interleaved = np.zeros(self.blocks + 1, dtype=np.int64), False
        self.kinds = self._kinds()
        self.base = self._base_plan()
        self.states = StateBytes.of(self.base.train)  # the kept dtypes' bytes, read on every rank's tail
        self.accumulate = accumulate_bytes(self.base.train)  # the weight-gradient GEMMs' (`plan_work`)
        self._time_cache: dict = {}
        self._compute_cache: dict = {}  # (work, kind, device name) -> `cost.compute.estimate_layer_compute`
        self._kind_times_cache: dict = {}
        self.memory_caches = caches = memory_caches if memory_caches is not None else {}
        self._memory_cache: dict = caches.setdefault("memory", {})
        self._states_cache: dict = caches.setdefault("states", {})
        self._activations_cache: dict = caches.setdefault("activations", {})
        self._param_cache: dict = caches.setdefault("params", {})
        self._gathered_cache: dict = caches.setdefault("gathered", {})
        self._end_cache: dict = caches.setdefault("end_moment", {})  # `end_moment`s, per plan of the states
        # (kind, its precision, tp, ep) -> its parameters' bytes as gathered
        self._gather_cache: dict = caches.setdefault("gather", {})
        self._capacity_cache: dict = {}
        self._inflight_cache: dict = caches.setdefault("inflight", {})
        self._head_cache: dict = caches.setdefault("head", {})  # id(an `inflight` array) -> (it, its sizes, head's)
        self._held_cache: dict = caches.setdefault("held", {})  # (schedule, pp, m, v) -> `held`'s array
        self._open_cache: dict = caches.setdefault("open", {})  # (schedule, pp, m, v) -> `open_stages`' array
        self._gradients_cache: dict = caches.setdefault("gradients", {})  # id(a states plan) -> (it, `gradients`)
        self._kind_gradients_cache: dict = caches.setdefault("kind_gradients", {})  # -> (it, `kind_gradients`)
        self._copy_vocab_cache: dict = caches.setdefault("copy_vocab", {})  # id(a states plan) -> (it, `copy_vocab`)
        # id(a node's memory) -> the plan torch's pipeline buffers are counted for (its micro-batch and data ranks) and
        # its `cost.memory.torch_stage_sizes`
        self._buffer_plans: dict = caches.setdefault("buffer_plans", {})
        self._buffers_cache: dict = caches.setdefault("buffers", {})
        self._buffer_shapes: dict = caches.setdefault("buffer_shapes", {})  # microbatches' shape -> (plan, sizes)
        # id(a one-stage node's memory) -> the bytes its step of one microbatch holds apart (`apart`)
        self._apart: dict = caches.setdefault("apart", {})
        # (id(a one-stage node's memory), its microbatches) -> the exact estimate's total of its plan (`kept_fits`)
        self._kept_totals: dict = caches.setdefault("kept_totals", {})
        # id(a one-stage node's memory whose ZeRO-2/3 units are placed by moment) -> its plan at its micro-batch, which
        # `unit_moments` reads (the loss's released bytes), and (id(a states plan), a micro-batch) -> that plan
        self._moment_plans: dict = caches.setdefault("moment_plans", {})
        self._moment_plan_cache: dict = caches.setdefault("moment_plan_shapes", {})
        self._class_cache: dict = caches.setdefault("class", {})  # id(a memory) -> (it, `memory_class`)
        self._classes: dict = caches.setdefault("classes", {})  # what the caps read of a memory -> its number
        self._types_cache: dict = {}
        self._links_cache: dict = {}
        self._links_numbers: dict = {}

    def _ruled(self, layers: tuple[Layer, ...]) -> tuple[Layer, ...]:
        """`layers` placed as the problem's shard rules place them (`ir.shard_rules.ruled_layers`, what the exact
        estimate of a plan that keeps them counts: `ir.placement.assign_stages`), read on a plan of the problem with
        a data and a tensor axis (the rules' `@ dp` and `over tp`), so every figure (states, activations, time) and the
        caps count them; blocks placed differently are kinds of their own (`_kinds`). The layers as they are without
        rules."""
        if not self.problem.shard or not self.transformer:
            return layers
        gathering = ir.FSDP_GATHERING._asdict()
        probe = self._base_plan().model_copy(update={
            "mesh": ir.Mesh(axes=(ir.Axis(name="dp", size=2), ir.Axis(name="tp", size=2))),
            "data": ir.DataParallel.model_construct(field_spans={}, kind=ir.DataKind.zero3, axes=("dp",), **gathering),
            "tensor": ir.TensorParallel.model_construct(style="megatron", axis="tp", sequence_parallel=False)})
        return ruled_layers(probe, layers)

    def _kinds(self) -> list[tuple[Layer, int]]:
        """(layer, count): transformers are an embedding, L identical blocks, a norm and a head; one with more kinds
        of block (a mixture of experts with dense blocks, `dense_layers`, `moe_every`; a sliding-window pattern's
        windowed and full-attention blocks, `full_every`; both) has its main kind as the second (the MoE blocks of
        two kinds that are dense and MoE, else the kind of the last block) and each other kind after the head, in the
        order the blocks first show it (`dense_blocks`: the blocks of those; `dense_before[i]`: those among the first
        i; `kind_before[k][i]`: the blocks of the k-th kind of block (`block_kinds[k]`, the main one first) among the
        first i; `block_kind[i]`: block i's index into the kinds; `interleaved`: whether some of the others follow a
        main one). Their stages are partitioned over the blocks in order (`Splits.mixed_partition`)."""
        self.block_kinds, self.kind_before, self.block_kind = [1], None, None
        if not self.transformer:
            return [(layer, 1) for layer in self.layers]
        blocks = [layer for layer in self.layers if layer.kind == "block"]
        model = self.problem.model
        keys = [figures_key(block) for block in blocks]
        distinct = list(dict.fromkeys(keys))
        moe, dense = blocks[-1], blocks[0]  # the last block is MoE and the first dense, unless interleaved
        others: list[tuple[Layer, int]] = []
        if len(distinct) == 2:
            is_dense = np.fromiter((not model.moe_block(i) for i in range(self.blocks)) if model.mixed_blocks
                                   else (key != keys[-1] for key in keys), dtype=bool, count=self.blocks)
            moe = moe if not is_dense[-1] else blocks[int(np.argmin(is_dense))]
            dense = dense if is_dense[0] else blocks[int(np.argmax(is_dense))]
            kind_of = np.where(is_dense, 4, 1)
            others = [(dense, int(is_dense.sum()))]
        elif len(distinct) > 2:  # the main kind, the last block's; the others as the blocks first show them
            main = keys[-1]
            rest = [key for key in distinct if key != main]
            index = {main: 1, **{key: 4 + k for k, key in enumerate(rest)}}
            kind_of = np.fromiter((index[key] for key in keys), dtype=np.int64, count=self.blocks)
            first = {key: blocks[keys.index(key)] for key in rest}
            others = [(first[key], keys.count(key)) for key in rest]
        if others:
            is_dense = kind_of != 1
            np.cumsum(is_dense, out=self.dense_before[1:])
            self.dense_blocks = int(self.dense_before[-1])
            self.interleaved = bool(is_dense[self.dense_blocks:].any())  # a dense block after an MoE one
            self.block_kinds = [1] + [4 + k for k in range(len(others))]
            self.block_kind = kind_of
            self.kind_before = np.zeros((len(self.block_kinds), self.blocks + 1), dtype=np.int64)
            for row, kind in enumerate(self.block_kinds):
                np.cumsum(kind_of == kind, out=self.kind_before[row, 1:])
        by_kind = {layer.kind: layer for layer in self.layers if layer.kind != "block"}
        kinds = [(by_kind["embed"], 1), (moe, self.blocks - self.dense_blocks), (by_kind["norm"], 1),
                 (by_kind["head"], 1)]
        return kinds + others

    def dense_order(self, start: int, n: int) -> tuple[bool, ...] | None:
        """Blocks start .. start + n - 1, whether each is of the second kind (dense; windowed or full), where those
        follow blocks of the other (`interleaved`); None where they are all first (a stage runs them first)."""
        if not self.interleaved:
            return None
        before = self.dense_before
        return tuple(bool(before[i + 1] - before[i]) for i in range(start, start + n))

    def stage_kinds(self, start: int, n: int) -> tuple[int, ...]:
        """Blocks start .. start + n - 1, each one's index into the kinds, in the model's order."""
        return tuple(int(k) for k in self.block_kind[start:start + n])

    def _base_plan(self) -> ir.Plan:
        p = self.problem
        train = p.training()
        mesh = ir.Mesh(axes=(ir.Axis(name="dp", size=1),))
        # the experts' overlap and folding are the problem's, carried here for `build_plan` (its candidates set the axis)
        experts = ir.ExpertParallel.model_construct(kind=p.dispatcher, axis="ep", overlap=p.overlap_experts,
                                                    fold=("tp",) if p.fold_experts else ()) \
            if p.overlap_experts or p.fold_experts or p.dispatcher != "alltoall" else None
        # likewise the tensor-parallel collectives' overlap (`build_plan` writes it where there is sequence parallelism)
        # and whose tensor parallelism runs the layers
        tensor = ir.TensorParallel.model_construct(style="megatron", axis="tp", sequence_parallel=True,
                                                   overlap=p.overlap_tensor, implementation=p.tensor_overlap,
                                                   sm_margin=p.sm_margin, stack=p.stack_of_tensor) \
            if p.overlap_tensor or p.stack_of_tensor != "torch" else None
        # and the gathering, in the dtype the problem's ZeRO-2/3 gather in (`build_plan` reads it from here and gives
        # ZeRO-1 its own; the candidate sets the kind and axes)
        gathering = p.priced_gathering._replace(gather=p.gather_dtype)
        data = None if gathering == ir.FSDP_GATHERING else ir.DataParallel.model_construct(
            field_spans={}, kind=ir.DataKind.zero3, axes=(), **gathering._asdict())
        # and the context parallelism's kind and ring (`build_plan` reads them; the candidate decides whether there is one)
        context = ir.ContextParallel.model_construct(kind=p.context, axis="cp", implementation=p.ring) \
            if p.context != CONTEXT or p.ring != "te" else None
        # and whose pipeline runs the stages, what it does with the last stage's outputs (`build_plan` reads them; the
        # candidate decides whether there are stages)
        stages = ir.Stages.model_construct(field_spans={}, implementation=p.pipeline, outputs=p.outputs) \
            if p.pipeline != "torch" or p.outputs != "dropped" else None
        return ir.Plan.model_construct(name="generated", model=p.model, cluster=p.cluster, mesh=mesh, train=train,
                                       data=data, tensor=tensor, context=context, experts=experts, stages=stages,
                                       schedule=None, shard=p.shard)

    def work(self, node: Node) -> Work:
        root = node.root
        fold = self.problem.fold_experts and root.tp > 1  # the expert group is ep x tp, each expert whole
        return Work(node.micro_batch, self.problem.sequence, root.tp, root.cp, root.ep * (root.tp if fold else 1),
                    root.sequence_parallel, self.problem.precision, ir.Recompute(node.recompute),
                    gather_kv=root.cp > 1 and self.problem.context == "allgather",  # search.CONTEXT by default
                    kernels=self.problem.kernels,  # `plan_work`: one microbatch has nothing to overlap with
                    modules=frozenset(self.problem.recompute_modules or (ir.RecomputeModule.core_attn,)),
                    overlap_experts=self.problem.overlap_experts and node.microbatches > 1,
                    attention=self.problem.attention, fold_experts=fold, loss=self.problem.loss,
                    overlap_tensor=self.problem.overlap_tensor and root.sequence_parallel,
                    tensor_overlap=self.problem.tensor_overlap, sm_margin=self.problem.sm_margin,
                    dispatcher=self.problem.dispatcher,
                    fp8_recipe=self.problem.fp8_recipe or ir.Fp8Recipe.delayed
                    if self.problem.precision is ir.Precision.fp8 else None, ring=self.problem.ring,
                    fp8_gather=self.problem.priced_gathering.gather is ir.Precision.fp8,
                    accumulate=self.accumulate)

    def device_types(self, root: Root) -> dict:
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
        """Each kind's `LayerTime` on the device for the node's work: once per node, from one list per
        distinct work, device and links (the nodes of a layout's mesh orders share them)."""
        found = node.times.get(device.name)
        if found is None:
            root = node.root
            links = root.links
            layer_links = self._layer_links(links)
            # what `work` varies by in one search, and the device and links: a cheaper key than the Work
            same = (node.micro_batch, node.recompute, root.tp, root.cp, root.ep, root.sequence_parallel,
                    device.name, layer_links, self.problem.overlap_experts and node.microbatches > 1)
            found = self._kind_times_cache.get(same)
            if found is not None:
                node.times[device.name] = found
                return found
            work = self.work(node)
            found = self._kind_times_cache[same] = []
            for layer, _ in self.kinds:
                key = (work, figures_key(layer), device.name, layer_links)
                time = self._time_cache.get(key)
                if time is None:
                    # the compute part once per work, kind and device: the mesh orders of a layout differ in links
                    # alone (a Llama 4 Maverick search asks for 4,545 computes for 13,065 layer times)
                    time = self._time_cache[key] = estimate_layer_time(self.model, layer, work, device, links,
                                                                       self.efficiency,
                                                                       self._layer_compute(work, layer, device))
                found.append(time)
            node.times[device.name] = found
        return found

    def kind_compute(self, node: Node, device: ir.DeviceType) -> list[LayerCompute]:
        """Each kind's compute on the device for the node's work, no communication: no more than its `kind_times`, the
        same for every mesh order of a layout (a root's bound before the search reaches it: `Space.roots`)."""
        work = self.work(node)
        return [self._layer_compute(work, layer, device) for layer, _ in self.kinds]

    def _layer_compute(self, work: Work, layer: Layer, device: ir.DeviceType) -> LayerCompute:
        """`estimate_layer_compute` of one kind, once per work, kind and device."""
        key = (work, figures_key(layer), device.name)
        compute = self._compute_cache.get(key)
        if compute is None:
            compute = self._compute_cache[key] = estimate_layer_compute(self.model, layer, work, device,
                                                                        self.efficiency)
        return compute

    def params(self, layer: Layer, tp: int, ep: int) -> tuple[int, int]:
        key = (figures_key(layer), tp, ep)
        found = self._param_cache.get(key)
        if found is None:
            fold = self.problem.fold_experts and tp > 1  # the experts whole over the ep x tp ranks
            found = self._param_cache[key] = param_split(layer, tp, ep * tp, 1) if fold else param_split(layer, tp, ep)
        return found

    def element(self, layers, tp: int, ep: int) -> float:
        """Bytes per element the parameter gathers of these layers move (`cost.memory.gather_element`): the compute
        precision's, or the problem's gather dtype averaged over their parameters on one device."""
        precision = self.problem.precision.bytes
        if self.problem.priced_gathering.gather is None:
            return precision
        elements = gathered = 0.0
        for layer in layers:
            elements, gathered = elements + sum(self.params(layer, tp, ep)), gathered + self.gather_bytes(layer, tp, ep)
        return gathered / elements if elements else precision

    def gather_bytes(self, layer: Layer, tp: int, ep: int, dense_only: bool = False) -> float:
        """`cost.memory.gathered_param_bytes` of one layer on one device (`dense_only`: its non-expert parameters,
        a gradient bucket's), once per kind, its precision and the degrees."""
        key = (figures_key(layer), layer_precision(self.base.train, self.model, layer), tp, ep, dense_only)
        found = self._gather_cache.get(key)
        if found is None:
            fold = self.problem.fold_experts and tp > 1
            found = self._gather_cache[key] = gathered_param_bytes(self.base, layer, self.problem.precision.bytes, tp,
                                                                   ep * tp if fold else ep, 1 if fold else None,
                                                                   dense_only)
        return found

    # -- memory per layer kind, from the one memory model --
    def layer_memory(self, node: Node, zero: int):
        """Per kind (model-state bytes, activation bytes per microbatch, recompute working set), the
        states a head adds on a rank without its tied embedding, and a plan with the node's states."""
        root = node.root
        key = (root.tp, root.cp, root.ep, root.dp, root.pp > 1, node.micro_batch, zero, node.recompute,
               root.sequence_parallel, root.shard)
        found = self._memory_cache.get(key)
        if found is None:
            states, tied, plan = self._states(node, zero)
            # the embedding's whole-vocabulary gradient's moment (`cost.memory.whole_vocab_gradient_moment`) reads the
            # dtype ZeRO's stage gathers in, and whether the step is one microbatch that keeps it (none then): keys
            element = (whole_vocab_gradient_element(plan), node.microbatches == 1
                       and (plan.stages is not None or plan.data is None)) if whole_vocab_gradient(plan) else None
            kept = self._activations(node, zero, holds_autocast_copies(plan), element)
            found = self._memory_cache[key] = ([(s, *a) for s, a in zip(states, kept)], tied, plan)
            if root.pp == 1 and node.microbatches == 1:  # the key's dp, ep and micro-batch make its microbatches
                self._apart[id(found)] = self._one_stage_apart(node, zero)
            if root.pp == 1 and gathers_by_moments(plan):  # `gathered`'s moments at the node's own micro-batch
                # (the states' plan is the first node's of the layout and ZeRO stage, of any micro-batch)
                shape = (id(plan), node.micro_batch)
                moments = self._moment_plan_cache.get(shape)
                if moments is None:
                    moments = self._moment_plan_cache[shape] = self._one_stage_plan(node, zero)
                self._moment_plans[id(found)] = moments
            if root.pp > 1 and self.transformer:  # the plan of the node's microbatches and its sizes (`stage_buffers`)
                # what they read (`cost.memory.torch_stage_sizes`, `returned_output_bytes`) is the microbatches' shape
                # and count and the problem's, not the ZeRO stage nor the recomputation: once for those
                shape = (root.tp, root.cp, root.ep, root.dp, node.micro_batch, root.sequence_parallel, root.shard)
                buffers = self._buffer_shapes.get(shape)
                if buffers is None:
                    plan = self._one_stage_plan(node, zero)
                    buffers = self._buffer_shapes[shape] = (plan, torch_stage_sizes(plan))
                self._buffer_plans[id(found)] = buffers
        return found

    def _one_stage_plan(self, node: Node, zero: int) -> ir.Plan:
        """The node's plan at the ZeRO stage with every layer on one stage (`build_plan` of its candidate, the
        problem's kept stages line with it); each caller keeps what it reads of it."""
        return build_plan(self.base, candidate_of(node, "", 1, zero), self.problem.kept)

    def _one_stage_apart(self, node: Node, zero: int) -> float:
        """The bytes the exact estimate of the node's one stage (every layer on one rank, one microbatch) holds apart
        from its peak (`cost.memory.MemoryEstimate.apart`: the gradients its one backward makes, `cost.memory.
        one_backward_apart`); 0 where it holds none apart. Once per memory (a few per search: one microbatch a rank
        without a pipeline)."""
        plan = self._one_stage_plan(node, zero)
        if not one_backward_makes_gradients(plan):
            return 0.0
        layers = self.stage_layers((self.blocks,))[0]
        return float(estimate_memory(plan, [layers], [[0]], [1.0])[0].apart)

    def kept_fits(self, node: Node, zero: int, ranks=None, inflight=None, counts=None) -> bool:
        """Whether a node that keeps every block's activations (recompute none, the kept node of a partly recomputed
        or an offloading one) fits by the exact estimate where its caps hold every block: without a pipeline where the
        exact estimate of its one stage (`cost.estimate.estimate_plan`, what `Space.evaluate` asks) is within the
        rank's capacity; with one, where that of its split `counts` over `ranks` under the schedule of `inflight`
        (`Figures.inflight`'s array) is within every rank's (True where no split is given). The caps count no more
        than the exact estimate, and some less (ZeRO-1's shards of whole tensors, counted even; 0.5 % of a gpt at dp
        4, 3 % of a two-kind MoE at ep 2; under a pipeline, of several kinds of block, the simulated peak): a kept
        node within its caps can still be refused, and the node that recomputes or offloads some of its blocks must
        not be given up for it then (`Splits.partial_partition`, `mixed_partial_partition`, `mixed_offloaded`,
        `Space._offloaded`). Once per memory and microbatches; with a pipeline once per layout but its mesh order, node's
        micro-batch, microbatches, ZeRO stage, schedule and split, asked only where the kept node's split is the one a
        partly recomputed node would be given up for and, with one kind of block, where the caps leave some rank less
        room than they leave out (`Splits._kept_split_fits`)."""
        root = node.root
        if root.pp > 1:
            schedule = self._schedule_of(inflight) if counts is not None else None
            if schedule is None:
                return True
            # what the plan's memory reads: the layout but its mesh order (where the groups sit), the node's
            # micro-batch, microbatches and recomputation, the ZeRO stage, schedule and split (not the node: a layout's
            # mesh orders share one estimate)
            key = (root.dp, root.tp, root.pp, root.cp, root.ep, root.sequence_parallel, root.shard, node.micro_batch,
                   node.microbatches, node.recompute, zero, schedule, tuple(ranks), tuple(counts))
            totals = self._kept_totals.get(key)
            if totals is None:
                name, _, _, virtual = schedule
                candidate = candidate_of(node, name, virtual, zero)
                if root.ep > 1:  # the experts' clause, as `Space.evaluate` writes it
                    candidate = replace(candidate, fold=self.problem.fold_experts and root.tp > 1,
                                        dispatcher=self.problem.dispatcher)
                plan = build_plan(self.base, candidate, self.problem.kept)
                assignment = Assignment(tuple(tuple(s) for s in self.stage_layers(tuple(counts))), tuple(ranks),
                                        virtual)
                totals = self._pipeline_totals(plan, assignment, name, root.pp, node.microbatches, virtual)
                self._kept_totals[key] = totals
            return all(t <= c for t, c in zip(totals, root.capacity))
        memory = self.layer_memory(node, zero)
        key = (id(memory), node.microbatches)
        total = self._kept_totals.get(key)
        if total is None:
            plan = self._one_stage_plan(node, zero)
            layers = tuple(self.stage_layers((self.blocks,))[0])
            try:
                total = estimate_plan(plan, self.efficiency, Assignment((layers,), (0,), 1)).memory[0].total
            except PlanError:
                total = float("inf")
            self._kept_totals[key] = total
        return total <= root.capacity[0]

    def caps_gap(self, node: Node, zero: int, ranks) -> np.ndarray | float:
        """Per pipeline rank, the most bytes the exact estimate of a node of one kind of block counts beyond what
        `Caps.split_room` counts of its split (the in-flight rule, the simulated peak, the open stages' gradients: every
        term the exact estimate has): ZeRO-1's optimizer states, which the exact estimate partitions as whole tensors
        over the data ranks (`cost.memory.zero_one_elements`: the greedy rule gives each tensor, largest first, to the
        least loaded rank, so the most loaded one held at most the even share before its last tensor, and at most the
        even share and one tensor after it) and the caps evenly (each block's share rounded up: no less than the
        whole's), at most the states of the rank's largest dense and largest expert tensor on a device (the blocks'; on
        the first and last stages' ranks, the embedding's, norm's and head's too); 0 at ZeRO-0/2/3, over one data rank
        and for a custom model's tensors (partitioned even)."""
        if zero != 1:
            return 0.0
        root = node.root
        key = ("gap", root.tp, root.ep, root.dp, root.cp, root.shard, root.pp, ranks[0], ranks[-1])
        found = self._kept_totals.get(key)
        if found is None:
            plan = self.layer_memory(node, zero)[2]  # the node's states' plan: its degrees and dtypes
            _, dense_degree, expert_degree = zero_degrees(plan)
            found = 0.0
            if not isinstance(plan.model, ir.CustomModel):
                tp, ep, expert_tp = plan.tp, plan.expert_group, plan.expert_tp
                largest = {}  # (whether a block's, whether an expert tensor) -> elements on a device
                for k, (layer, _) in enumerate(self.kinds):  # a tied head's copy is the embedding's size
                    for p in layer.params:
                        at = (k == 1 or k >= 4, bool(is_expert_tensor(p)))
                        largest[at] = max(largest.get(at, 0), local_numel(p, tp, ep, expert_tp))
                per = StateBytes.of(plan.train).optimizer(plan.train.optimizer)
                dense, expert = dense_degree > 1, expert_degree > 1

                def gap(ends: bool) -> float:
                    return per * sum(max(largest.get((True, e), 0), largest.get((False, e), 0) if ends else 0)
                                     for e, sharded in ((False, dense), (True, expert)) if sharded)
                found = np.full(root.pp, gap(False))
                found[ranks[0]] = found[ranks[-1]] = gap(True)
            self._kept_totals[key] = found
        return found

    def _pipeline_totals(self, plan, assignment, schedule: str, pp: int, microbatches: int, virtual: int) -> tuple:
        """Each pipeline rank's total by the exact estimate (`cost.estimate.estimate_plan`'s memory) without its stage
        times: the in-flight rule's count (`cost.memory.estimate_plan_memory`), its activations raised to the
        schedule's simulated peak where higher, the largest sum over the moments the simulation lists
        (`schedules.bounded.builtin_profiles`) of each stage's saved activations x the microbatches it holds, beside
        the rank's working set (`cost.estimate.simulated_peaks`); `estimate_plan` itself for a schedule of two
        pipelines or sizes the layout refuses."""
        rule = estimate_plan_memory(plan, assignment)
        if rule is None:
            return (float("inf"),) * pp
        info = BUILTIN.get(schedule)
        profiles = None
        if info is not None and info.pipelines == 1:
            try:
                profiles = builtin_profiles(schedule, pp, microbatches, virtual)
            except ValueError:
                profiles = None
        if profiles is None:
            try:
                return tuple(m.total for m in estimate_plan(plan, self.efficiency, assignment).memory)
            except PlanError:
                return (float("inf"),) * pp
        kept: dict = {}
        activations = [sum(once_per_figures(kept.setdefault((mode, layer_precision(plan.train, plan.model, layer)), {}),
                                            layer, lambda layer, mode=mode:
                                            estimate_layer_activations(plan, layer, recompute=mode))
                           for layer, mode, away in zip(layers, layer_recompute(plan, layers),
                                                        layer_offload(plan, layers)) if not away)
                       for layers in assignment.stage_layers]
        ranks = held_stages(plan, assignment.rank_stages())
        peaks = [max(sum(h * activations[s] for h, s in zip(moment, own)) for moment in moments)
                 for moments, own in zip(profiles, ranks)]
        return tuple(m.total for m in simulated_peaks(plan, assignment, rule, activations, peaks))

    def apart(self, memory) -> float:
        """What the exact estimate leaves out of the peak of the one rank of a node without a pipeline whose `memory`
        this is (`layer_memory`), where its step of one microbatch makes its gradients in its one backward
        (`cost.memory.one_backward_apart`): the bytes its states and activations hold beyond its peak when it holds
        every layer, which the search's memory figures take off a one-stage rank's (`Caps.rank_caps`, the node's own
        check in `Space.pending`, the several kinds' and a layer model's splits), so that they never count more than
        the exact estimate. 0 for any other memory (a pipeline's, several microbatches', a partly recomputed or
        offloading node's figures, whose exact estimate holds nothing apart)."""
        return self._apart.get(id(memory), 0.0)

    def share_buffers(self, memory, like) -> None:
        """`memory` (a partly recomputed or offloading node's) holds torch's pipeline buffers as `like` does, and places
        ZeRO's units by moment at its micro-batch (`gathered`): the same microbatches."""
        if id(like) in self._buffer_plans:
            self._buffer_plans[id(memory)] = self._buffer_plans[id(like)]
        if id(like) in self._moment_plans:  # and places ZeRO's units by moment at the same micro-batch (`gathered`)
            self._moment_plans[id(memory)] = self._moment_plans[id(like)]

    def memory_class(self, memory) -> int:
        """A number for what the caps read of a node's `memory` (`Caps`): its per-kind figures and the states a head
        adds, ZeRO's gathered units (`gathered`: none, or its plan's), torch's pipeline buffers' sizes
        (`stage_buffers`) and what a one-microbatch step holds apart (`apart`); equal for memories equal in those, so
        that the caps of one serve the others (ZeRO-2 and 3 under a pipeline, which keeps both stages' units gathered;
        layouts trading dp for cp at the same tokens a microbatch). Once per memory object (kept alive here, so that
        its id names it)."""
        found = self._class_cache.get(id(memory))
        if found is None or found[0] is not memory:
            plan = memory[2]  # ZeRO's gathered units: none, or the plan's (kept alive by the states' cache)
            gathered = id(plan) if _gathers_units(plan) else None
            plan, sizes = self._buffer_plans.get(id(memory), (None, None))
            buffers = (sizes, plan.stages.outputs, plan.train.loss) if sizes is not None else None
            moments = self._moment_plans.get(id(memory))
            content = (tuple(tuple(kind) for kind in memory[0]), memory[1], gathered, buffers, self.gradients(memory),
                       self.apart(memory), id(moments) if moments is not None else None)
            found = self._class_cache[id(memory)] = (memory, self._classes.setdefault(content, len(self._classes)))
        return found[1]

    def stage_buffers(self, memory, ranks, inflight) -> np.ndarray:
        """Per pipeline rank, what torch's pipeline stage holds beside the layers (`cost.memory.torch_stage_bytes`, 0 on
        Megatron-LM's pipeline) for the node whose `memory` this is, its stages on `ranks` and `inflight` microbatches
        in flight on each rank, the last stage's logits for its own microbatches in flight (`head_inflight`): the exact
        estimate's terms (but the merge of returned outputs at the step's end, where it is the larger), the same sums as
        `torch_stage_bytes`, over all ranks at once."""
        key = (id(memory), ranks, id(inflight))
        found = self._buffers_cache.get(key)
        if found is None:
            plan, sizes = self._buffer_plans.get(id(memory), (None, None))
            sizes = sizes if len(ranks) > 1 else None
            found = np.zeros(len(inflight), dtype=np.float64)
            if sizes is not None:
                boundary, output, m = sizes
                after_first, before_last = _stage_ends(ranks, len(inflight))
                found = after_first * np.maximum(0.0, m - inflight) * boundary \
                    + before_last * (m + np.minimum(inflight, m)) * boundary
                head = self.head_inflight(inflight, ranks[-1])
                found[ranks[-1]] += head * output
                if plan.stages.outputs == "returned":  # every microbatch's output kept to the step's end beyond
                    found[ranks[-1]] += max(0.0, m - head) * returned_output_bytes(plan, boundary, output)  # in flight
            self._buffers_cache[key] = found
        return found

    def layer_states(self, node: Node, zero: int):
        """(model-state bytes per kind, the states a head adds on a rank without its tied embedding, the plan): the
        first part of `layer_memory`, without the activations."""
        return self._states(node, zero)

    def _states(self, node: Node, zero: int):
        """Model states per kind: a function of the degrees and the ZeRO stage, not of the micro-batch
        or the recomputation (`cost.memory.model_state_bytes`), so one per layout and stage. Under a pipeline
        ZeRO-2/3 keeps every layer's units gathered through the step (`cost.memory.pipelined_shards`): those
        bytes grow with the layers as the states do, so they are counted with them (and `gathered` is 0); their
        gradients' part, which a rank of several stages frees stage by stage on torch's pipeline, is `gradients`."""
        root = node.root
        key = (root.tp, root.cp, root.ep, root.dp, root.pp > 1, zero, root.shard)  # hsdp's shard axis
        found = self._states_cache.get(key)
        if found is None:
            plan = self._one_stage_plan(node, zero)
            held = pipelined_shards(plan)
            # autocast's 16-bit copies of fp32 weights (`cost.memory.autocast_weight_copies`) are held once per weight
            # a rank computes with, as its states are: counted with them, layer by layer (and left out of the working
            # sets, `_activations`, where the exact estimate of one layer has them)
            # ZeRO-2 keeps every unit's parameters whole through the step beside its shards (`cost.memory.
            # gathers_whole`): they too grow with the layers, counted here (and its gradients' two units in `gathered`)
            # and so does `replicate`'s copy of each unit under replication on torch's stack (`replicate_copy_bytes`)
            whole = (gathers_whole(plan) or replicates_units(plan)) and not held

            def unsharded(layers, extra=()):
                both = gathered_bytes(plan, layers, extra)
                return sum(both) if held else both[0] if whole else 0.0
            # the embedding's gradient over the whole vocabulary under torch's tensor parallelism, where it accumulates
            # (`cost.memory.whole_vocab_gradient_bytes`): the first stage's states, as the exact estimate counts it
            states = [sum(model_state_bytes(plan, [layer])) + unsharded([layer]) + autocast_weight_copies(plan, [layer])
                      + whole_vocab_gradient_bytes(plan, [layer]) for layer, _ in self.kinds]
            tied = 0.0
            if self.transformer and (self.model.tied_embeddings or self.model.mtp):  # `tied_embedding`'s copy
                copy = tied_embedding(plan, self.layers)
                tied = sum(model_state_bytes(plan, [], [copy])) + unsharded([], [copy]) if copy is not None else 0.0
            found = self._states_cache[key] = (states, tied, plan)
        return found

    def _activations(self, node: Node, zero: int, copies: bool, element=None):
        """(stored per microbatch, recompute working set) per kind: a function of the micro-batch, the
        recomputation and the tensor and context split, not of dp or ZeRO (`cost.memory._layer_activations`), and of
        whether autocast copies the weights (`copies`, `cost.memory.holds_autocast_copies`: a grouped expert's
        copies are saved per microbatch; ZeRO-2/3 gathering in the compute precision hold none), and of the embedding's
        whole-vocabulary gradient's moment's bytes an element (`element`, `cost.memory.whole_vocab_gradient_moment`: the
        ZeRO stage's gather where `copies` does not tell them apart: an FP8 precision's; and whether a step of one
        microbatch keeps it, where it has none)."""
        root = node.root
        key = (root.tp, root.cp, root.ep, node.micro_batch, node.recompute, root.sequence_parallel, copies, element)
        found = self._activations_cache.get(key)
        if found is None:
            plan = self._one_stage_plan(node, zero)
            # the working set: `estimate_memory(plan, [[layer]], [[0]], [0])[0].activations`, which with no microbatch
            # in flight is the layer's `beyond_layers` (0.0 x the stored bytes added to it), without the rest of the
            # stage's estimate (~4 % of a 6,144-GPU search)
            found = self._activations_cache[key] = [
                (estimate_layer_activations(plan, layer),
                 beyond_layers(plan, [[layer]]) - autocast_weight_copies(plan, [layer]))
                for layer, _ in self.kinds]
        return found

    def gradients(self, memory) -> tuple[float, float, float, float] | None:
        """(a block's, the embedding's, the norm's and head's, one tied copy's of the embedding) unsharded gradients,
        bytes, that the states of a node's `memory` count (`_states`: ZeRO-2/3's units under a pipeline, `cost.memory.gathered_bytes`)
        where a rank frees each stage's after that stage's last backward (`cost.memory.releases_gradients`), so that a
        rank holds those of the stages open at once (`open_stages`); None where it holds them all through the step, and
        for a model of several kinds of block (`kind_gradients`)."""
        plan = memory[2]
        found = self._gradients_cache.get(id(plan))
        if found is None or found[0] is not plan:
            value = None
            if self.transformer and len(self.kinds) == 4 and releases_gradients(plan):
                embed, block, norm, head = (layer for layer, _ in self.kinds)
                copy = tied_embedding(plan, self.layers) if self.model.tied_embeddings or self.model.mtp else None

                def grads(layers, extra=()):
                    return gathered_bytes(plan, layers, extra)[1] + whole_vocab_gradient_bytes(plan, layers)
                value = (grads([block]), grads([embed]), grads([norm, head]) + self.copy_vocab(memory),
                         grads([], [copy]) if copy else 0.0)
            found = self._gradients_cache[id(plan)] = (plan, value)
        return found[1]

    def kind_gradients(self, memory) -> tuple[list[float], float] | None:
        """(each kind's layer's unsharded gradients, bytes, in `kinds`' order; one tied copy's of the embedding) that
        the states of a node's `memory` count, where a rank frees each stage's after that stage's last backward
        (`cost.memory.releases_gradients`): `gradients` for a transformer of several kinds of block and a model of
        layers (a layer each), whose splits (`Splits.mixed_partition`, `layer_partition`) count those of the rank's
        stages open at once (`open_stages`). None where a rank holds them all through the step."""
        plan = memory[2]
        found = self._kind_gradients_cache.get(id(plan))
        if found is None or found[0] is not plan:
            value = None
            if releases_gradients(plan):
                copy = tied_embedding(plan, self.layers) \
                    if self.transformer and (self.model.tied_embeddings or self.model.mtp) else None
                value = ([gathered_bytes(plan, [layer])[1] + whole_vocab_gradient_bytes(plan, [layer])
                          for layer, _ in self.kinds],
                         gathered_bytes(plan, [], [copy])[1] + whole_vocab_gradient_bytes(plan, [], [copy])
                         if copy else 0.0)
            found = self._kind_gradients_cache[id(plan)] = (plan, value)
        return found[1]

    def copy_vocab(self, memory) -> float:
        """What the head's stage holds, once, beyond its copies of the embedding's states (the memory's `tied`, per
        copy): multi-token prediction's copy's gradient over the whole vocabulary under torch's tensor parallelism
        (`cost.memory.whole_vocab_gradient_bytes`, which the exact estimate counts once however many copies)."""
        plan = memory[2]
        found = self._copy_vocab_cache.get(id(plan))
        if found is None or found[0] is not plan:
            copy = tied_embedding(plan, self.layers) if self.transformer and self.model.mtp else None
            found = self._copy_vocab_cache[id(plan)] = (plan, whole_vocab_gradient_bytes(plan, [], [copy])
                                                        if copy is not None else 0.0)
        return found[1]

    def beyond_working(self, memory, working: float, both_ends: bool) -> float:
        """What the embedding's working set, its whole-vocabulary gradient's moment (`cost.memory.
        whole_vocab_gradient_moment`), adds on the first rank beyond `working` (the block rebuilt): the exact estimate
        takes the largest of a rank's moments, the loss's backward among them where the rank holds both ends."""
        (_, _, moment), (_, _, loss) = memory[0][0], memory[0][3]
        return max(0.0, moment - (max(working, loss) if both_ends else working))

    def head_copies(self, memory, inflight: np.ndarray) -> float:
        """What the head's stage holds for its copies of the embedding (the memory's `tied`, per copy,
        `tied_copies` of them) and, once, multi-token prediction's copy's whole-vocabulary gradient (`copy_vocab`)."""
        return memory[1] * self.tied_copies(inflight) + self.copy_vocab(memory)

    def tied_copies(self, inflight: np.ndarray) -> int:
        """How many copies of the embedding's weight the head's stage holds, for an array `inflight` gave (of a memory's
        `tied`, `_states`' one): two where the model ties its head and has multi-token prediction and the schedule runs
        the backward as I then W (`cost.memory.head_weight_apart`: the tied head's weight apart from the depths'
        copy), else one."""
        if not (self.transformer and getattr(self.model, "tied_embeddings", False) and getattr(self.model, "mtp", 0)):
            return 1
        key = self._schedule_of(inflight)
        return 2 if key is not None and splits_backward(key[0]) else 1

    def _schedule_of(self, inflight: np.ndarray) -> tuple | None:
        """(schedule, pp, microbatches, virtual) of an array `inflight` gave; None for any other array."""
        found = self._head_cache.get(id(inflight))
        return found[1] if found is not None and found[0] is inflight else None

    def open_stages(self, inflight: np.ndarray) -> np.ndarray | None:
        """For an array `inflight` gave, the sets of each rank's stages whose gradients it holds at once
        (`cost.memory.open_gradient_stages`) as an array ranks x the rank's stages (in stage order) x sets (1 where the
        set holds the stage; sets padded with zeros); None where every rank holds all its stages at some moment (one
        stage a rank, several rounds of an interleaved schedule, Chimera's two pipelines, sizes the layout refuses)."""
        key = self._schedule_of(inflight)
        if key is None:
            return None
        if key in self._open_cache:
            return self._open_cache[key]
        schedule, pp, microbatches, virtual = key
        groups = open_gradient_stages(schedule, pp, microbatches, virtual) if virtual > 1 and pp > 1 else None
        array = None
        if groups is not None and not all(any(len(group) == virtual for group in rank) for rank in groups):
            ranks = stage_ranks(schedule, pp, virtual)
            own = [[s for s, r in enumerate(ranks) if r == rank] for rank in range(pp)]
            array = np.zeros((pp, virtual, max(len(rank) for rank in groups)))
            for rank, sets in enumerate(groups):
                for k, group in enumerate(sets):
                    for stage in group:
                        array[rank, own[rank].index(stage), k] = 1.0
        self._open_cache[key] = array
        return array

    def gathered(self, memory, first: bool, last: bool, blocks: int) -> float:
        """ZeRO-2/3's unsharded units on a rank (`cost.memory.gathered_bytes`) of a transformer with
        `blocks` blocks there, the embedding on the first rank and the norm and head on the last. On the rank of both
        ends (no pipeline) as the exact estimate places them by moment (`cost.memory.unit_moments`, `fsdp_apart`):
        the units of the loss's backward, or those of the blocks' less the activations freed by then (`freed`)."""
        plan = memory[2]
        freed = self.freed(memory) if first and last else (0.0, 0.0)
        # the plan of the states: one per layout and stage; the units' moments read the memory's own micro-batch
        # (`unit_moments`: the loss's released bytes), which the states' plan (the first node's) need not have
        moments = self._moment_plans.get(id(memory), plan) if first and last else plan
        key = (id(plan), first, last, min(blocks, 2), freed, id(moments))
        found = self._gathered_cache.get(key)
        if found is not None:
            return found
        if not _gathers_units(plan):
            found = self._gathered_cache[key] = 0.0
        else:
            embed, block, norm, head = (layer for layer, _ in self.kinds[:4])
            layers = ([embed] if first else []) + [block] * min(blocks, 2) + ([norm, head] if last else [])
            for layer, _ in self.kinds[4:]:  # any kind may be the two gathered: the two largest of each (a bound)
                layers += [layer] * min(blocks, 2)
            copy = tied_embedding(plan, self.layers) if last and not first else None
            extra = [copy] if copy else []
            both = gathered_bytes(plan, layers, extra)
            found = sum(both)
            if first and last and gathers_by_moments(plan):
                at_loss, in_backward, in_blocks, _ = unit_moments(moments, layers, extra, apart=True)
                found -= fsdp_apart(at_loss, in_backward, *freed, in_blocks)
            found = self._gathered_cache[key] = found - both[0] if gathers_whole(plan) else found  # ZeRO-2's: `_states`
        return found

    def end_moment(self, memory) -> tuple[float, float] | None:
        """(the bytes beside its blocks, each block's) of a rank of every layer, whose ZeRO-2/3 units are placed by
        moment (`cost.memory.gathers_by_moments`), at its embedding's backward or the root's reduce-scatter (`cost.
        memory.fsdp_apart`'s `end`): the states (autocast's copies freed with the matmuls' saved tensors) and the units
        of that moment (`unit_moments`), with the embedding's whole-vocabulary gradient, and the step's 0-dim tensors
        (`cost.memory.batch_bytes`, less the batch's tokens, which the figures' plan does not size: no more than the
        exact estimate); None for any other rank, or a model of several kinds of block."""
        plan = memory[2]
        if not (self.transformer and len(self.kinds) == 4 and gathers_by_moments(plan)):
            return None
        key = (id(plan), *(kind[0] for kind in memory[0][:4]))  # the states plan and its kinds' states
        found = self._end_cache.get(key)
        if found is not None and found[0] is plan:
            return found[1]
        kinds = [layer for layer, _ in self.kinds]
        states = [kind[0] - autocast_weight_copies(plan, [layer]) + 4.0 * len(layer.params)
                  for kind, layer in zip(memory[0][:4], kinds)]
        embed, block, norm, head = kinds
        layers = [embed, block, block, norm, head]
        at_end = unit_moments(plan, layers, apart=True)[3]
        whole = gathered_bytes(plan, layers)[0] if gathers_whole(plan) else 0.0  # ZeRO-2's, in the states
        value = (states[0] + states[2] + states[3] + at_end - whole + 16.0, states[1])
        self._end_cache[key] = (plan, value)
        return value

    def freed(self, memory) -> tuple[float, float]:
        """What the blocks' backward has freed of a rank of both ends' activations at their fullest (`cost.memory.
        fsdp_apart`'s `freed`): the norm's and head's saved activations of its one microbatch in flight, and what the
        rank's working set (`beyond_working`: the block rebuilt, the loss's backward, the embedding's whole-vocabulary
        gradient's moment) exceeds the block rebuilt by; and what it exceeds the loss's backward's by (`over_loss`)."""
        (_, _, moment), (_, _, working), (_, norm_a, _), (_, head_a, loss) = memory[0][:4]
        most = max(working, loss, moment)
        return norm_a + head_a + most - working, most - max(working, loss)

    def capacity(self, root: Root) -> np.ndarray:
        """The ranks' capacities as an array, once per root (keyed by identity: hashing a 4,096-entry
        tuple on every leaf would cost what the array saves)."""
        found = self._capacity_cache.get(id(root))
        if found is None or found[0] is not root:
            found = self._capacity_cache[id(root)] = (root, np.array(root.capacity, dtype=np.float64))
        return found[1]

    def inflight(self, schedule: str, pp: int, microbatches: int, virtual: int) -> np.ndarray:
        """`cost.memory.inflight_microbatches` per rank, once per (schedule, pp, m, v) of the search."""
        key = (schedule, pp, microbatches, virtual)
        found = self._inflight_cache.get(key)
        if found is None:
            found = self._inflight_cache[key] = np.array(inflight_microbatches(schedule, pp, microbatches, virtual),
                                                         dtype=np.float64)
            head = head_inflight(schedule, float(found[stage_ranks(schedule, pp, virtual)[-1]]))
            self._head_cache[id(found)] = (found, (schedule, pp, microbatches, virtual), head)
        return found

    def head_inflight(self, inflight: np.ndarray, last_rank: int) -> float:
        """Microbatches in flight through the last stage's norm and head (`cost.memory.head_inflight`) for an array
        `inflight` gave: one for the schedules of the 1F1B family, whatever its rank's average over its stages (an
        interleaved last rank's, a V-shaped schedule's rank 0), `last_rank` holding the last stage; the last rank's own
        without a pipeline."""
        found = self._head_cache.get(id(inflight))
        return found[2] if found is not None and found[0] is inflight else float(inflight[last_rank])

    def held(self, inflight: np.ndarray) -> np.ndarray | None:
        """For an array `inflight` gave, what the schedule's simulation holds beyond the in-flight rule: per rank, the
        microbatches each of its stages holds at the moments that can be its peak (`schedules.bounded.builtin_profiles`,
        which the exact estimate's simulated peak is the largest sum of), as an array ranks x moments x the rank's
        stages (in stage order; moments padded with zeros); None where no moment holds more on any stage than the rule
        (`cost.memory.inflight_microbatches`, the norm and head's `head_inflight`) counts for the whole rank, so that the
        simulated peak never exceeds the rule's sum (the 1F1B, GPipe and BFS schedules), and for Chimera's two
        pipelines and any size the simulation refuses."""
        key = self._schedule_of(inflight)
        if key is None:
            return None
        if key in self._held_cache:
            return self._held_cache[key]
        schedule, pp, microbatches, virtual = key
        info = BUILTIN.get(schedule)
        profiles = None
        # GPipe's and BFS's rule counts every microbatch on every stage, the most a stage can hold; 1F1B's rank holds
        # its rule's at most, its one stage freeing each microbatch by its backward (tests/unit/test_search_caps.py)
        ruled = info is None or info.inflight == "every" or (virtual == 1 and not info.split_backward)
        if not ruled and info.pipelines == 1 and pp > 1:
            try:
                profiles = builtin_profiles(schedule, pp, microbatches, virtual)
            except ValueError:  # sizes the simulation refuses (TooLarge too): the estimate refuses them as well
                profiles = None
        array = None
        if profiles is not None:
            last_rank = stage_ranks(schedule, pp, virtual)[-1]
            head = head_inflight(schedule, float(inflight[last_rank]))
            chunks = len(profiles[0][0])
            if _beyond(profiles, inflight, last_rank, head):  # the moments no other one of the rank covers on every stage: only they can be its peak
                fronts = [_uncovered(np.array(moments)) for moments in profiles]
                array = np.zeros((pp, max(len(f) for f in fronts), chunks))
                for rank, front in enumerate(fronts):
                    array[rank, :len(front)] = front
        self._held_cache[key] = array
        return array

    def stage_layers(self, counts: tuple[int, ...]) -> list[list[Layer]]:
        return placed_layers(self.layers, self.transformer, counts)


def placed_layers(layers, transformer: bool, counts: tuple[int, ...]) -> list[list[Layer]]:
    """The layers of each stage of a split (`counts`: blocks per stage; of a model of layers, its layers), as the
    search places them: in the model's order, a transformer's embedding with the first stage and its norm and head
    with the last."""
    bounds = list(itertools.accumulate(counts, initial=0))
    if not transformer:
        return [list(layers[a:b]) for a, b in zip(bounds, bounds[1:])]
    blocks = [layer for layer in layers if layer.kind == "block"]
    out = [blocks[a:b] for a, b in zip(bounds, bounds[1:])]
    out[0] = [layers[0]] + out[0]
    out[-1] = out[-1] + [layer for layer in layers if layer.kind in ("norm", "head")]
    return out



def _beyond(profiles, inflight: np.ndarray, last_rank: int, head: float) -> bool:
    """Whether a moment of the simulated profiles holds more on some stage than the in-flight rule counts for its whole
    rank (`Figures.held`), the last rank's last stage more than the norm and head's `head` microbatches."""
    for rank, moments in enumerate(profiles):
        limit = float(inflight[rank]) * (1 + 1e-12)
        for moment in moments:
            if max(moment) > limit or (rank == last_rank and moment[-1] > head * (1 + 1e-12)):  # its last stage: its last
                return True
    return False


def _gathers_units(plan: ir.Plan) -> bool:
    """Whether `gathered` counts ZeRO-2/3's units apart: not under a pipeline, where the states hold them (`_states`)."""
    return plan.data is not None and plan.data.zero_stage >= 2 and not pipelined_shards(plan)


@functools.lru_cache(maxsize=4096)
def _stage_ends(ranks: tuple[int, ...], pp: int) -> tuple[np.ndarray, np.ndarray]:
    """Per rank of `pp`, how many of its stages (`ranks`: each stage's) come after the first and how many before the
    last (`cost.memory._stage_ends`), once per map of the stages."""
    on = np.asarray(ranks)
    return np.bincount(on[1:], minlength=pp), np.bincount(on[:-1], minlength=pp)


def _uncovered(moments: np.ndarray) -> np.ndarray:
    """The rows of `moments` that no other row covers in every column (one of equal rows)."""
    covers = (moments[:, None, :] >= moments[None, :, :]).all(axis=2)  # [a, b]: row a covers row b
    strictly = covers & ~covers.T
    equal_before = np.triu(covers & covers.T, 1)  # a before b, equal: b is the copy left out
    return moments[~(strictly.any(axis=0) | equal_before.any(axis=0))]


__all__ = ["Figures"]
