"""One layer's seconds per microbatch: its compute plus the communication on the critical path.

Stage: cost model. Contract: `plan_links(plan)` / `mesh_links(...)` say over which links each parallel
group of a mesh communicates (`cost.comm.GroupLinks`); `estimate_layer_time(model, layer, work,
device, links)` is the layer's compute (`cost.compute`) plus the collectives its forward and backward
wait for: tensor-parallel all-reduces (or SP's all-gather + reduce-scatter; a pair a shard rule breaks, `plandsl
run`'s collectives for it, `_broken_pair_comm`), expert all-to-alls, and
context parallelism's K/V gather or the part of its ring that attention does not hide. Pure.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from plandsl import ir
from plandsl.cost.comm import (NO_COMM, GroupLinks, beside, collective_seconds, dispatch_seconds, group_links,
                                routing_map_seconds)
from plandsl.cost.compute import (
    Efficiency,
    LayerCompute,
    OverlapGemm,
    Work,
    dispatcher_share,
    estimate_layer_compute,
    mtp_projection_compute,
    overlap_gemms,
    reruns_core,
    userbuffers_share,
)
from plandsl.cost.ring import NO_RING, Ring, estimate_ring
from plandsl.ir import layers as ir_layers
from plandsl.ir.layers import Layer, attention_widths, block_model, kv_width
from plandsl.ir.pairs import PairLayout, broken, mtp_blocks, table_split


# ---- links of each parallel axis -----------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Links:
    """Where each parallel group of the plan communicates (`cost.comm.GroupLinks`)."""

    tp: GroupLinks = NO_COMM
    cp: GroupLinks = NO_COMM
    ep: GroupLinks = NO_COMM
    pp: GroupLinks = NO_COMM
    data: GroupLinks = NO_COMM          # dense gradients: the data axes, the expert and the context axis
    expert_data: GroupLinks = NO_COMM   # expert gradients: the data and the context axes
    replicate: GroupLinks = NO_COMM     # hsdp: the replicate axis


def plan_links(plan: ir.Plan) -> Links:
    return mesh_links(plan.cluster, tuple((a.name, a.size) for a in plan.mesh.axes), plan.mesh.first_device,
                      tuple(plan.data.axes) if plan.data else (), plan.data.kind if plan.data else None,
                      plan.tensor.axis if plan.tensor else None, plan.context.axis if plan.context else None,
                      plan.experts.axis if plan.experts else None, plan.stages.axis if plan.stages else None,
                      plan.experts.fold if plan.experts else ())


def mesh_links(cluster: ir.Cluster, axes: tuple[tuple[str, int], ...], first_device: int,
               data_axes: tuple[str, ...], data_kind: ir.DataKind | None, tensor: str | None, context: str | None,
               expert: str | None, stage: str | None, expert_fold: tuple[str, ...] = ()) -> Links:
    """Links of every parallel group of a mesh whose axes play the given roles; `expert_fold`, the axes folded
    into the expert group (`experts = alltoall over [ep, tp]`), join the all-to-all's group, not the gradients'."""
    def links(*names: str | None) -> GroupLinks:
        wanted = [n for n in names if n]
        return group_links(cluster, axes, wanted, first_device) if wanted else NO_COMM

    shard_axes, replicate = data_axes, NO_COMM
    if data_kind is not None and ir.DataKind(data_kind).hybrid:
        shard_axes, replicate = data_axes[-1:], links(*data_axes[:-1])
    # The context axis holds the same parameters for other tokens: gradients are reduced (and ZeRO
    # shards) over it too (cost.memory.zero_degrees).
    context_data = context if context not in shard_axes else None
    return Links(tp=links(tensor), cp=links(context), ep=links(expert, *expert_fold), pp=links(stage),
                 data=links(*shard_axes, expert if expert not in shard_axes else None, context_data),
                 expert_data=links(*(a for a in shard_axes if a != expert), context_data),
                 replicate=replicate)


# ---- one layer: compute plus critical-path communication ------------------------------------------------
@dataclass(frozen=True, slots=True)
class Moved:
    """Bytes one device moves per microbatch (or per step), per parallel axis, at the sizes `cost.comm` prices:
    the all-reduced buffer, a gather's output, a scatter's input, an all-to-all's buffer, a message."""

    tensor: float = 0.0
    context: float = 0.0
    expert: float = 0.0
    pipeline: float = 0.0
    data: float = 0.0

    def __add__(self, other: "Moved") -> "Moved":
        return Moved(*(a + b for a, b in zip(self.astuple(), other.astuple())))

    def __mul__(self, factor: float) -> "Moved":
        return Moved(*(a * factor for a in self.astuple()))

    def astuple(self) -> tuple[float, ...]:
        return (self.tensor, self.context, self.expert, self.pipeline, self.data)

    @property
    def total(self) -> float:
        return sum(self.astuple())


NOTHING_MOVED = Moved()


@dataclass(frozen=True, slots=True)
class LayerTime:
    """Seconds of one microbatch through one layer on one device, communication included."""

    forward: float
    input_grad: float
    weight_grad: float
    forward_comm: float
    backward_comm: float
    flops: float
    recompute_flops: float
    moved: Moved = NOTHING_MOVED  # bytes of the collectives above, per parallel axis

    @property
    def backward(self) -> float:
        return self.input_grad + self.weight_grad




def estimate_layer_time(model: ir.Model, layer: Layer, work: Work, device: ir.DeviceType, links: Links,
                        efficiency: Efficiency | None = None, compute: LayerCompute | None = None) -> LayerTime:
    """`layer`'s seconds for one microbatch; a transformer's head with multi-token prediction (`mtp`) runs its depths
    after it, on its stage (`mtp_time`). `compute`: `estimate_layer_compute(model, layer, work, device, efficiency)`
    where the caller has it (the search computes it once per work, kind and device, and the links' part once per
    links: `search.figures`)."""
    time = _layer_time(model, layer, work, device, links, efficiency, compute)
    if layer.kind == "head" and isinstance(model, ir.TransformerModel) and model.mtp:
        for block, depths in mtp_blocks(model, layer):  # the depths' blocks as the rules place them
            time = _plus(time, mtp_time(model, layer, work, device, links, efficiency, block), depths)
    return time


def mtp_time(model: ir.TransformerModel, head: Layer, work: Work, device: ir.DeviceType, links: Links,
             efficiency: Efficiency | None = None, block: Layer | None = None) -> LayerTime:
    """One multi-token prediction depth (megatron-core 0.16.1 `MultiTokenPredictionLayer.forward` and
    `GPTModel._postprocess`, multi_token_prediction.py:681-821, gpt_model.py:592-660): the embedding of the tokens
    shifted by one more (the vocabulary-parallel lookup and its reduction: the embedding's figures), the two input norms
    and the final one (the final norm's figures, three times), `eh_proj` (`cost.compute.mtp_projection_compute`: its
    output gathered over the tensor axis in the forward, its input gradient reduced in the backward, each priced as the
    embedding's one tensor-parallel reduction), one block of the last block's kind (`ir.layers.mtp_block`: its own figures, communication included)
    and the shared output layer with its loss again (the head's figures). `block`: the depth's block where a shard rule
    breaks a pair of it (`ir.pairs.mtp_blocks`), else the last block."""
    layers = ir_layers.layers_of(model)
    by_kind = {candidate.kind: candidate for candidate in layers if candidate.kind != "block"}
    block = layers[model.layers] if block is None else block  # the last block: embed is layers[0]
    work = replace(work, precision=work.precision.mtp)  # the depth's own (`ir.Precision.mtp`)
    embed = _layer_time(model, by_kind["embed"], work, device, links, efficiency)
    norm = _layer_time(model, by_kind["norm"], work, device, links, efficiency)
    projection = mtp_projection_compute(model, work, device, efficiency)
    comm = embed.forward_comm  # forward: the output gathered; backward: the input gradient reduced
    pair = LayerTime(projection.forward + comm, projection.input_grad + comm, projection.weight_grad, comm, comm,
                     projection.flops, projection.recompute_flops, embed.moved * 2)
    time = _plus(_plus(embed, norm, 3), pair)
    time = _plus(time, _layer_time(model, block, work, device, links, efficiency))
    return _plus(time, _layer_time(model, head, work, device, links, efficiency))


def _plus(time: LayerTime, other: LayerTime, times: float = 1.0) -> LayerTime:
    """`time` and `times` x `other`, field by field."""
    return LayerTime(time.forward + times * other.forward, time.input_grad + times * other.input_grad,
                     time.weight_grad + times * other.weight_grad, time.forward_comm + times * other.forward_comm,
                     time.backward_comm + times * other.backward_comm, time.flops + times * other.flops,
                     time.recompute_flops + times * other.recompute_flops, time.moved + other.moved * times)


def _layer_time(model: ir.Model, layer: Layer, work: Work, device: ir.DeviceType, links: Links,
                efficiency: Efficiency | None = None, compute: LayerCompute | None = None) -> LayerTime:
    if compute is None:
        compute = estimate_layer_compute(model, layer, work, device, efficiency)
    moved: dict[str, float] = {}
    overlapped = backward_gemms = ()
    if work.overlap_tensor and work.sequence_parallel and links.tp.size > 1 and layer.kind == "block" \
            and isinstance(model, ir.TransformerModel):
        overlapped = overlap_gemms(block_model(model, layer), work, device, efficiency)
        backward_gemms = overlap_gemms(block_model(model, layer), work, device, efficiency, backward=True)
    ring = estimate_ring(block_model(model, layer), work, device, links.cp, device.contention, efficiency) \
        if links.cp.size > 1 and not work.gather_kv and layer.kind == "block" \
        and isinstance(model, ir.TransformerModel) else NO_RING
    forward_comm, backward_comm = _layer_comm(model, layer, work, links, compute, moved, overlapped, device.contention,
                                              ring, backward_gemms, userbuffers_share(device),
                                              dispatcher_share(device, work.dispatcher))
    # what the ring's steps compute beyond the one attention kernel `compute` prices; recomputation reruns the forward
    rerun = ring.forward if work.recompute is not ir.Recompute.selective_op and reruns_core(work) else 0.0
    return LayerTime(compute.forward + ring.forward + forward_comm,
                     compute.input_grad + ring.backward + rerun + backward_comm, compute.weight_grad,
                     forward_comm, backward_comm, compute.flops, compute.recompute_flops,
                     Moved(**moved) if moved else NOTHING_MOVED)


AMAX_REDUCED = (ir.Fp8Recipe.current, ir.Fp8Recipe.tensorwise)
"""The FP8 recipes whose per-tensor scale comes from the tensor's own amax, all-reduced over the tensor-parallel axis
under sequence parallelism (`_layer_comm`); delayed scaling reduces its amax history once a step, blockwise and MXFP8
scale tiles locally."""
AMAX_BYTES = 4
"""One fp32 amax per quantized tensor (the all-reduce's payload: its latency is the cost)."""


def _layer_comm(model: ir.Model, layer: Layer, work: Work, links: Links, compute: LayerCompute,
                moved: dict[str, float], overlapped: tuple[OverlapGemm, ...] = (), share: float = 0.0,
                ring: Ring = NO_RING, backward_gemms: tuple[OverlapGemm, ...] = (),
                bulk_share: float = 0.0, experts_share: float | None = None) -> tuple[float, float]:
    """(forward, backward) seconds of communication a layer waits for, per microbatch; `moved` gathers the
    bytes of those collectives per parallel axis (`Moved`'s fields); `overlapped`, the GEMMs that hide the
    block's sequence-parallel collectives under `tensor ... with overlap` (`cost.compute.overlap_gemms`), and
    `backward_gemms` those beside the backward's all-gathers; `share`, what an NCCL collective running beside the
    layer's compute takes of it (the device's `comm_share`, `cost.comm.beside`: the experts' overlapped all-to-alls,
    ring attention's steps); `ring`, ring attention's steps (`cost.ring.estimate_ring`); `bulk_share`, what
    userbuffers' bulk overlaps take (`cost.compute.userbuffers_share`); `experts_share`, what the expert dispatcher's
    overlapped all-to-alls take (`cost.compute.dispatcher_share`: the flex dispatcher's own SMs; None: `share`)."""
    def count(axis: str, size: float, times: float = 1.0) -> None:
        if size and times and links_of[axis].size > 1:
            moved[axis] = moved.get(axis, 0.0) + size * times

    links_of = {"tensor": links.tp, "context": links.cp, "expert": links.ep}
    if isinstance(model, ir.CustomModel) and work.tp > 1:
        return _torch_layer_comm(layer, work, links, count)
    if not isinstance(model, ir.TransformerModel):
        return 0.0, 0.0  # mlp and written layers are not tensor parallel (cost.memory's defaults)
    element = work.precision.bytes
    activation = work.tokens * model.hidden * element  # one [b, s/cp, h] tensor
    full = work.recompute is ir.Recompute.full
    # Megatron (Shoeybi et al. 2019, Sec. 3): one all-reduce of [b, s, h]; with sequence parallelism an
    # all-gather plus a reduce-scatter of the same volume (Korthikanti et al. 2022, Sec. 4.2.2).
    pair_bytes = 2 * activation if work.sequence_parallel else activation
    pair = (collective_seconds("all_gather", activation, links.tp)
            + collective_seconds("reduce_scatter", activation, links.tp)) if work.sequence_parallel \
        else collective_seconds("all_reduce", activation, links.tp)

    def tp_pair() -> float:
        count("tensor", pair_bytes)
        return pair

    # A block's all-gathers under a quantized precision with sequence parallelism move the quantized copy: the
    # column-parallel layers' input (forward) and the row-parallel layers' output gradient (backward) are cast before
    # they are gathered, and the GEMM reads the gathered copy (Transformer Engine's `gather_along_first_dim` with the
    # layer's quantizer: `_all_gather_fp8`, `_all_gather_mxfp8`, `_all_gather_nvfp4`; torchao's
    # `Float8ColwiseParallel` casts the sharded DTensor input, then redistributes the Float8 tensor); the
    # reduce-scatters of the row-parallel outputs and of the input gradients stay 16-bit. The embedding's and the
    # head's collectives stay 16-bit (those layers are not quantized).
    gathered = activation * work.precision.gemm_bytes / element \
        if work.precision.quantized and work.sequence_parallel else activation
    if gathered != activation:
        block_pair_bytes = gathered + activation
        block_pair = collective_seconds("all_gather", gathered, links.tp) \
            + collective_seconds("reduce_scatter", activation, links.tp)
    else:
        block_pair, block_pair_bytes = pair, pair_bytes

    split = table_split(layer) if layer.kind in ("embed", "head") and links.tp.size > 1 else 0
    if split != 0:  # a rule keeps the table's vocabulary whole: `plandsl run`'s collectives for it (`_ruled_table_comm`)
        forward, backward, forward_bytes, backward_bytes = _ruled_table_comm(layer.kind, split, work, links,
                                                                             activation, model.vocab)
        count("tensor", forward_bytes + backward_bytes)
        return forward, backward
    if layer.kind == "embed":
        return tp_pair(), 0.0  # vocabulary-parallel embedding: partial sums reduced once
    if layer.kind == "head":
        gather = collective_seconds("all_gather", activation, links.tp) if work.sequence_parallel else 0.0
        count("tensor", activation if work.sequence_parallel else 0.0)
        # Vocabulary-parallel cross entropy: max, sum and target logit per token (3 fp32 all-reduces).
        loss = collective_seconds("all_reduce", 3 * 4 * work.tokens, links.tp)
        count("tensor", 3 * 4 * work.tokens)
        return gather + loss, tp_pair()
    if layer.kind != "block":
        return 0.0, 0.0
    model = block_model(model, layer)  # a dense block of a dense-then-MoE model: no experts
    # After attention and after the MLP, both directions; parallel blocks add the two row-parallel partial
    # sums before one forward reduction (GPT-NeoX's residual), while the backward still reduces each
    # branch's input gradient at its own column-parallel input (Megatron's `f` operator after each norm).
    per_block = 1 if model.parallel_blocks else 2
    if model.latent_attention:
        forward, backward, rerun, halves = _latent_comm(model, work, links, activation, count)
    else:
        forward, backward = per_block * block_pair, 2 * block_pair
        rerun = (per_block * block_pair, per_block * block_pair_bytes, block_pair, block_pair_bytes)
        count("tensor", block_pair_bytes, per_block + 2)
        half = ((block_pair * per_block / 2, block_pair), (block_pair_bytes * per_block / 2, block_pair_bytes))
        halves = {"attn": half, "mlp": half}  # parallel blocks' one forward reduction shared between the halves
    # a half whose pair a shard rule breaks (`ir.pairs.broken`): its collectives as `plandsl run` lays it out, in place
    # of Megatron's pair; an MoE layer's shared experts (`shared`) in place of the MoE half's [b, s, h] pair, which
    # stands for theirs (below)
    for group, pair in (broken(layer) if links.tp.size > 1 else {}).items():
        half = "mlp" if group == "shared" and model.shared_experts else group
        if half not in halves:
            continue
        ruled = _broken_pair_comm(model, pair, work, links)
        (half_forward, half_backward), (forward_bytes, backward_bytes) = halves[half]
        forward, backward = forward + ruled[0] - half_forward, backward + ruled[1] - half_backward
        count("tensor", ruled[2] + ruled[3] - forward_bytes - backward_bytes)
        if group == "attn":
            selective = (ruled[0], ruled[2])
        else:
            # selective_op reruns the MLP's forward up to its consumer (torch's checkpoint stops once it has remade
            # what the backward needs): its collectives before the consumer's (`_broken_pair_comm`), kept GEMMs'
            # gathers included, in place of an intact MLP's share (its input's gather under sequence parallelism)
            gathers = work.sequence_parallel and not model.latent_attention
            intact = (collective_seconds("all_gather", gathered, links.tp), gathered) if gathers else (0.0, 0.0)
            selective = (rerun[2] + ruled[4] - intact[0], rerun[3] + ruled[5] - intact[1])
        # full recomputation reruns the block's forward under torch's checkpoint, which stops once it has remade
        # what the backward needs: a broken MLP's (or shared experts', which the MoE layer runs last) up to its
        # consumer's input, so the consumer's own collective (its output is saved by nothing) is not rerun (traced:
        # tests/distributed/test_memtrace.py; counted on gloo ranks for the shared experts); Megatron's intact pair
        # keeps its reentrant rerun of the whole forward
        full_rerun = (ruled[4], ruled[5]) if group in ("mlp", "shared") else (ruled[0], ruled[2])
        rerun = (rerun[0] + full_rerun[0] - half_forward, rerun[1] + full_rerun[1] - forward_bytes, *selective)
    if model.experts and work.sequence_parallel and links.tp.size > 1 and work.fold_experts:
        # The experts folded over the tensor axis, each whole on one rank (Megatron-Core's MoE parallel folding):
        # each rank routes its own sequence shard through the all-to-all below, and the MoE half has no
        # tensor-parallel collective; shared experts, an MLP split over the axis, keep their [b, s, h] pair
        extra, extra_bytes = (0.0, 0.0) if model.shared_experts else (block_pair, block_pair_bytes)
        forward -= 0.0 if model.parallel_blocks else extra  # parallel blocks reduce both branches' sums at once
        backward -= extra
        count("tensor", -extra_bytes, 1 if model.parallel_blocks else 2)
        rerun = (rerun[0] - (0.0 if model.parallel_blocks else extra),
                 rerun[1] - (0.0 if model.parallel_blocks else extra_bytes), rerun[2], rerun[3])
    elif model.experts and work.sequence_parallel and links.tp.size > 1:
        # The experts split over the tensor axis (Megatron-Core's expert tensor parallelism, as a plan splits them):
        # its alltoall dispatcher all-gathers the top_k routed copies of each token over the axis after the
        # all-to-all and reduce-scatters them before the combine (`dispatch_postprocess`, `combine_preprocess`),
        # not the dense MLP's [b, s, h]; shared experts, an MLP of their own, keep that [b, s, h] pair
        routed_pair = model.top_k * activation
        moe_pair = collective_seconds("all_gather", routed_pair, links.tp) \
            + collective_seconds("reduce_scatter", routed_pair, links.tp)
        extra = moe_pair - (0.0 if model.shared_experts else block_pair)
        extra_bytes = 2 * routed_pair - (0.0 if model.shared_experts else block_pair_bytes)
        forward, backward = forward + extra, backward + extra
        count("tensor", extra_bytes, 2)
        rerun = (rerun[0] + extra, rerun[1] + extra_bytes, rerun[2], rerun[3])
    if overlapped and not model.parallel_blocks:
        # Each all-gather and reduce-scatter split into chunks behind the GEMM it feeds or follows (`_exposed`), as
        # torch's micro-pipeline pass fuses them (torch/_inductor/fx_passes/micro_pipeline_tp.py): forward, AG ->
        # column-parallel GEMM and row-parallel GEMM -> RS; backward, the output gradient's AG -> the row-parallel
        # GEMM's input gradient (as large as its forward GEMM). The backward's RS of the column-parallel input
        # gradient stays whole: it sums q's, k's and v's (w1's and w3's) input gradients, and the pass fuses a
        # reduce-scatter only with the one matmul that produces its input.
        gather = collective_seconds("all_gather", gathered, links.tp)
        scatter = collective_seconds("reduce_scatter", activation, links.tp)
        halves = [(overlapped[i], overlapped[i + 1], backward_gemms[i + 1]) for i in range(0, len(overlapped), 2)]
        saved = [(gather + scatter - _exposed(gather, first) - _exposed(scatter, second),
                  gather - _exposed(gather, row_backward)) for first, second, row_backward in halves]
        if work.tensor_overlap is ir.TensorOverlap.userbuffers:
            # Transformer Engine's bulk overlaps (`initialize_ub`: qkv_dgrad, qkv_wgrad, fc1_dgrad, fc1_wgrad): the
            # column-parallel GEMM's input gradient beside the all-gather of its input (which its weight gradient
            # reads), and its weight gradient beside the reduce-scatter of that input gradient, no longer exposed
            saved = [(forward, backward + scatter - _bulk(gather, first.whole, bulk_share, work.sm_margin)
                      - _bulk(scatter, first.whole, bulk_share, work.sm_margin))
                     for (forward, backward), (first, _, _) in zip(saved, halves)]
        # a half whose pair a rule breaks has no Megatron collective to hide (`_broken_pair_comm`; MLA's keep theirs)
        ruled = {} if model.latent_attention else broken(layer)
        ruled = {"mlp" if group == "shared" else group for group in ruled}
        saved = [(0.0, 0.0) if index < 2 and ("attn", "mlp")[index] in ruled else half
                 for index, half in enumerate(saved)]
        forward -= sum(f for f, _ in saved)
        backward -= sum(b for _, b in saved)
        rerun = (rerun[0] - sum(f for f, _ in saved), rerun[1], rerun[2] - saved[0][0], rerun[3])
    if work.precision is ir.Precision.fp8 and work.fp8_recipe in AMAX_REDUCED and work.sequence_parallel \
            and links.tp.size > 1:
        # Per-tensor current scaling under sequence parallelism: the input of each column-parallel layer (forward)
        # and the output gradient of each row-parallel one (backward) is quantized before its all-gather, with one
        # scale over the axis, so its amax is all-reduced first, on the critical path between the amax and the cast
        # (TE's `Float8CurrentScalingQuantizer::quantize_impl`: `amax_reduction_group->allreduce(...)->wait()`,
        # the group set by `_Linear`'s `set_quantizer_amax_reduction_group`; torchao's `Float8ColwiseParallel`
        # casts the sharded DTensor input, whose amax DTensor reduces). Per block: attention's q/k/v input and wo's
        # output gradient, and the MLP's w1 input and w2 output gradient unless folded experts have no TP MLP.
        casts = 1 + (0 if model.experts and work.fold_experts and not model.shared_experts else 1)
        amax = collective_seconds("all_reduce", AMAX_BYTES, links.tp)
        forward, backward = forward + casts * amax, backward + casts * amax
        count("tensor", AMAX_BYTES, 2 * casts)
        rerun = (rerun[0] + casts * amax, rerun[1] + casts * AMAX_BYTES, rerun[2] + amax, rerun[3] + AMAX_BYTES)
    if model.experts and links.ep.size > 1:
        # Dispatch and combine all-to-alls of the routed tokens (Lepikhin et al. 2020, GShard), twice
        # in each direction; sequence parallelism leaves each tensor-parallel rank 1/t of the tokens. Rerun by full
        # recomputation and by `recompute_modules: [moe]` (the MoE layer checkpointed with its dispatcher).
        rerun_experts = full or (work.recompute is ir.Recompute.selective and ir.RecomputeModule.moe in work.modules)
        routed = work.tokens * model.top_k * model.hidden * element / (work.tp if work.sequence_parallel else 1)
        a2a = dispatch_seconds(work.dispatcher, routed, links.ep, model.experts, model.top_k,  # flex: once per node
                               model.expert_groups, model.group_top_k)
        count("expert", routed, 6 if rerun_experts else 4)
        dispatch_combine = (2 * a2a, (4 if rerun_experts else 2) * a2a)  # forward; backward (and the rerun's)
        routing = 0.0  # HybridEP's routing map, all-gathered before each forward's dispatch (and its rerun's)
        if work.dispatcher == "hybridep":
            tokens = work.tokens / (work.tp if work.sequence_parallel else 1)
            routing = routing_map_seconds(tokens, model.experts, links.ep)
            count("expert", links.ep.size * tokens * model.experts, 2 if rerun_experts else 1)
            dispatch_combine = (dispatch_combine[0] + routing,
                                dispatch_combine[1] + (routing if rerun_experts else 0.0))
        if work.overlap_experts:
            # Megatron-Core's --overlap-moe-expert-parallel-comm (combined 1F1B: one microbatch's forward runs
            # beside another's backward, layer by layer, on a computation and a communication stream; DualPipe's
            # overlapped chunks likewise, DeepSeek-AI 2024, arXiv:2412.19437, Sec. 3.2.1): each all-to-all beside
            # the one sub-module of the other pass the schedule pairs it with (`combined_1f1b_exposed`)
            taken = share if experts_share is None else experts_share  # the dispatcher's SMs (dispatcher_share)
            exposed = combined_1f1b_exposed(a2a, compute, taken, a2a + routing)
            forward += exposed[0]
            backward += exposed[1] + (beside(2 * a2a + routing, compute.recompute, taken) if rerun_experts else 0.0)
        else:
            forward, backward = forward + dispatch_combine[0], backward + dispatch_combine[1]
    if links.cp.size > 1 and work.gather_kv:
        # All-gather context parallelism (Llama Team 2024, arXiv:2407.21783, Sec. 3.3.2): K and V of
        # the whole sequence are gathered before the attention core, on its critical path ("the
        # all-gather communication latency is exposed"); the backward reduce-scatters their
        # gradients, and recomputation (full, or selective: the core with its gather) gathers again.
        gathered = 2 * work.tokens * links.cp.size * kv_width(model) / work.tp * element
        gather = collective_seconds("all_gather", gathered, links.cp)
        forward += gather
        backward += collective_seconds("reduce_scatter", gathered, links.cp)
        count("context", gathered, 3 if reruns_core(work) else 2)
        if reruns_core(work):
            backward += gather
    elif links.cp.size > 1:
        # Ring attention (Liu et al. 2023), step by step as its implementation runs it (`cost.ring`): K and V go
        # round the ring while each step's kernel works; only what the kernels do not hide is exposed. Backward
        # sends K, V and their gradients; recomputation (full, or selective: the core with its ring) reruns the
        # forward's traffic.
        again = reruns_core(work)
        count("context", ring.forward_sent * (2 if again else 1) + ring.backward_sent)
        forward += ring.forward_comm
        backward += ring.backward_comm + (ring.forward_comm if again else 0.0)
    if full:
        backward += rerun[0]  # the forward's collectives, rerun by the recomputation
        count("tensor", rerun[1])
    elif work.recompute is ir.Recompute.selective_op:
        backward += rerun[2]  # the attention half's (wo's reduction, or sequence parallelism's gathers) rerun
        count("tensor", rerun[3])
    return forward, backward


def combined_1f1b_exposed(a2a: float, compute: LayerCompute, share: float,
                          dispatch: float | None = None) -> tuple[float, float]:
    """Seconds one MoE layer's four all-to-alls (dispatch and combine of a forward and of a backward, `a2a` each)
    add to the forward and to the backward when Megatron-Core's combined 1F1B runs one microbatch's forward beside
    another's backward (`TransformerLayerSchedulePlan.run`, megatron/core/models/common/model_chunk_schedule_plan.py,
    the same in core_r0.15 to r0.17): three phases per layer, each as long as its longer stream,

        comm stream: combine_bwd | dispatch_fwd -> dispatch_bwd        | combine_fwd
        comp stream: attn_fwd    | mlp_bwd -> mlp_bwd_dw -> mlp_fwd    | attn_bwd

    where `mlp` is the routed experts (`LayerCompute.experts_*`) and `attn` the rest of the layer (attention, the
    router and the first permutation); in the middle phase the forward's experts wait for their dispatch and the
    backward's dispatch for the experts' input gradients. A stream left waiting is exposed; beside a running
    all-to-all the computation runs at (1 - `share`) of its speed (`cost.comm.beside`). The middle phase's exposure
    is split evenly between the passes (one all-to-all of each). `dispatch`: the forward's dispatch where it takes
    longer than the others (HybridEP's, after its routing map's all-gather; None: `a2a`)."""
    dispatch = a2a if dispatch is None else dispatch
    experts_backward = compute.experts_input_grad + compute.experts_weight_grad
    attention_forward = max(0.0, compute.forward - compute.experts_forward)
    attention_backward = max(0.0, compute.backward - experts_backward)
    first = beside(a2a, attention_forward, share)     # the backward's combine beside the forward's attention
    last = beside(a2a, attention_backward, share)     # the forward's combine beside the backward's attention
    end = max(max(experts_backward, dispatch) + compute.experts_forward,
              max(dispatch, compute.experts_input_grad) + a2a)
    middle = max(end - experts_backward - compute.experts_forward, share * (dispatch + a2a)) if a2a > 0.0 else 0.0
    return last + middle / 2, first + middle / 2


def _exposed(collective: float, gemm: OverlapGemm) -> float:
    """Seconds a collective decomposed into `gemm.chunks` chunks adds to the GEMM it overlaps (Wang et al. 2022,
    "Overlap communication with dependent computation via decomposition in large deep learning models"; torch's
    async TP; Transformer Engine's userbuffers): chunk i's transfer runs beside GEMM chunk i -/+ 1 on other
    streams, a two-stage pipeline of n steps whose span over the GEMM's is one transfer chunk (the first
    all-gathered one, or the last reduce-scattered one, has no GEMM beside it) plus, per further step, what a
    transfer chunk exceeds a GEMM chunk by; the GEMM run as n smaller GEMMs (`OverlapGemm.chunked`: each pays
    the kernel's fixed time and a smaller GEMM's efficiency) less the whole GEMM; and after a reduce-scatter's
    last chunk, the sum of the partial chunks (`OverlapGemm.reduction`, which the collective's own kernel did)."""
    n = gemm.chunks
    chunk, gemm_chunk = collective / n, gemm.chunked / n
    # each further step: what the transfer exceeds its GEMM chunk by, or the share its kernel takes of it
    # (`cost.comm.beside`; userbuffers' pipelined reduce-scatter without `set_sm_margin`)
    step = max(0.0, chunk - gemm_chunk, gemm.share * chunk)
    return gemm.chunked - gemm.whole + chunk + (n - 1) * step + gemm.reduction


def _bulk(collective: float, gemm: float, share: float, margin: bool) -> float:
    """Seconds a collective of `collective` seconds run beside a GEMM of `gemm` seconds by one of Transformer
    Engine's bulk overlaps (`CommOverlapBase::bulk_overlap`: the communication kernel on `num_sm` SMs of its own
    stream, the GEMM launched beside it) adds to that GEMM. With `set_sm_margin` the GEMM runs on the SMs left,
    1 - `share` of the device, for its whole length, and the collective is exposed by what it exceeds that by;
    without, the GEMM has every SM but those the collective holds while it runs (`cost.comm.beside`)."""
    if not margin:
        return beside(collective, gemm, share)
    slowed = gemm / (1 - share)
    return slowed - gemm + max(0.0, collective - slowed)


def _latent_comm(model: ir.TransformerModel, work: Work, links: Links, activation: float, count):
    """A multi-head latent attention block's tensor-parallel collectives: (forward, backward seconds, what
    recomputation reruns: (full's seconds, bytes, selective_op's seconds, bytes), per half: ((forward, backward
    seconds), (forward, backward bytes)) of the attention's and the MLP's, for a pair a shard rule breaks). The latents are computed
    by every rank (Megatron-Core's `duplicated` down-projections), so the attention half's column-parallel
    input is the latents (`AttentionWidths.latent`), not the block input: without sequence parallelism the
    backward all-reduces their gradient, with it the forward all-gathers them (and the backward
    reduce-scatters their gradient); wo's reduction is the block input's width, as the MLP's is. Under a quantized
    precision the all-gathers move the quantized copy, as a dense block's do (`_layer_comm`)."""
    element = work.precision.bytes
    latent = work.tokens * attention_widths(model).latent * element
    sp = work.sequence_parallel
    quantized = work.precision.gemm_bytes / element if work.precision.quantized else 1.0  # an all-gather's share
    reduce = collective_seconds("reduce_scatter" if sp else "all_reduce", activation, links.tp)  # after wo, w2

    def gather(size: float) -> float:
        return collective_seconds("all_gather", quantized * size, links.tp) if sp else 0.0

    def input_grad(size: float) -> float:
        return collective_seconds("reduce_scatter" if sp else "all_reduce", size, links.tp)

    attention = (gather(latent) + reduce, gather(activation) + input_grad(latent))
    attention_bytes = ((quantized * latent if sp else 0.0) + activation,
                       (quantized * activation if sp else 0.0) + latent)
    mlp = (gather(activation) + reduce, gather(activation) + input_grad(activation))
    mlp_bytes = (((1 + quantized) if sp else 1) * activation,) * 2
    merged = reduce if model.parallel_blocks else 0.0  # GPT-NeoX's residual: one forward reduction
    forward = attention[0] + mlp[0] - merged
    forward_bytes = attention_bytes[0] + mlp_bytes[0] - (activation if model.parallel_blocks else 0.0)
    count("tensor", forward_bytes + attention_bytes[1] + mlp_bytes[1])
    return forward, attention[1] + mlp[1], (forward, forward_bytes, attention[0], attention_bytes[0]), \
        {"attn": (attention, attention_bytes), "mlp": (mlp, mlp_bytes)}


def _broken_pair_comm(model: ir.TransformerModel, pair: PairLayout, work: Work, links: Links
                      ) -> tuple[float, float, float, float, float, float]:
    """(forward seconds, backward seconds, forward bytes, backward bytes, and the seconds and bytes of the forward's
    collectives before the consumer's, which `selective_op` reruns) of the tensor-parallel collectives of one half of
    a block (its attention, grouped-query or multi-head latent, a dense MLP, or an MoE layer's shared experts, one MLP
    shared_experts x ffn wide) whose pair a shard rule breaks, as `plandsl run` lays it out
    (`runtime.parallel.tensor_parallel._pair`: every member takes whole tensors and returns whole ones; DTensor's
    redistributions, each direction's the other's backward). The shared experts sit inside the MoE layer, whose input
    and output are whole (`_block_tp`): under sequence parallelism the layer's input is all-gathered and its output
    chunked to the shards (its gradient all-gathered), and the pair's own output stays whole, as without it:

    - under sequence parallelism the half's input all-gathered along the sequence (`PrepareModuleInput`), its gradient
      chunked back (no collective);
    - a producer split along its output features (ColwiseParallel): its output all-gathered, its input's partial
      gradient all-reduced (MLA's up-projections': their latents', whole on every rank); along its input features: its partial output all-reduced, its input's gradient gathered;
      whole: nothing, its gradients whole on every rank (its input is);
    - the consumer split along its input features (RowwiseParallel, reading its chunk of the whole input): its partial
      output all-reduced (reduce-scattered to the sequence shards), its input's gradient all-gathered (and the output's
      gradient under sequence parallelism); along its output features: its output all-gathered (or all-to-all'd to
      the sequence shards), its input's partial gradient all-reduced; whole: its output chunked to the shards, their
      gradient all-gathered under sequence parallelism, nothing without."""
    element, tokens, sp = work.precision.bytes, work.tokens, work.sequence_parallel
    hidden = model.hidden
    activation = tokens * hidden * element
    inputs: dict[str, int] = {}  # a producer's input width where it is not the block's (MLA's latents)
    if pair.group == "attn":
        widths = attention_widths(model)
        outputs = {"wq": widths.q, "wk": widths.k, "wv": widths.v, "wq_b": widths.q,
                   "wkv_b": widths.k - model.heads * model.qk_rope_head_dim + widths.v}
        inputs = {"wq_b": model.q_lora_rank, "wkv_b": model.kv_lora_rank}
        between = widths.o
    else:
        between = model.ffn_hidden * (model.shared_experts if pair.group == "shared" else 1)
        outputs = {name: between for name, _ in pair.producers}
    forward: list[tuple[str, float]] = [("all_gather", activation)] if sp else []
    backward: list[tuple[str, float]] = []
    if pair.group == "shared":
        backward += [("all_gather", activation)] if sp else []
        sp = False  # the pair's own output whole: the MoE layer chunks it
    for name, dim in pair.producers:
        made, read = tokens * outputs[name] * element, tokens * inputs.get(name, hidden) * element
        if dim == 0:
            forward.append(("all_gather", made))
            backward.append(("all_reduce", read))
        elif dim == 1:
            forward.append(("all_reduce", made))
            backward.append(("all_gather", read))
    read = tokens * between * element
    rerun = forward[:]
    if pair.consumer == 1:
        forward.append(("reduce_scatter" if sp else "all_reduce", activation))
        backward += [("all_gather", read)] + ([("all_gather", activation)] if sp else [])
    elif pair.consumer == 0:
        forward.append(("all_to_all" if sp else "all_gather", activation))
        backward += [("all_reduce", read)] + ([("all_to_all", activation)] if sp else [])
    elif sp:
        backward.append(("all_gather", activation))
    return (sum(collective_seconds(kind, size, links.tp) for kind, size in forward),
            sum(collective_seconds(kind, size, links.tp) for kind, size in backward),
            sum(size for _, size in forward), sum(size for _, size in backward),
            sum(collective_seconds(kind, size, links.tp) for kind, size in rerun), sum(size for _, size in rerun))


def _ruled_table_comm(kind: str, split: int | None, work: Work, links: Links, activation: float, vocab: int
                      ) -> tuple[float, float, float, float]:
    """(forward seconds, backward seconds, forward bytes, backward bytes) of the tensor-parallel collectives of a
    built-in embedding or head whose rule keeps its table's vocabulary whole (`ir.pairs.table_split`: `split` None,
    whole; 1, its hidden dim split), as `plandsl run` lays it out (`runtime.parallel.tensor_parallel.apply_tp`):

    - a whole embedding: nothing forward, its output chunked to the sequence shards, whose gradient is all-gathered
      under sequence parallelism; split along the hidden dim (ColwiseParallel): its output all-gathered (all-to-all'd
      to the shards), the same back under sequence parallelism;
    - a whole head: its input all-gathered along the sequence under sequence parallelism (its gradient chunked back),
      the whole logits' plain cross entropy, no loss-parallel reduction; split along the hidden dim
      (RowwiseParallel): its input chunked along the hidden dim (all-to-all'd from the sequence shards), its partial
      logits all-reduced ([tokens, vocab]), its input's gradient all-gathered (all-to-all'd back)."""
    sp, element = work.sequence_parallel, work.precision.unquantized.bytes  # the logits stay 16-bit
    forward: list[tuple[str, float]] = []
    backward: list[tuple[str, float]] = []
    if kind == "embed":
        if split == 1:
            forward.append(("all_to_all" if sp else "all_gather", activation))
        if sp:
            backward.append(("all_to_all" if split == 1 else "all_gather", activation))
    elif split == 1:
        forward += ([("all_to_all", activation)] if sp else []) + [("all_reduce", work.tokens * vocab * element)]
        backward.append(("all_to_all" if sp else "all_gather", activation))
    elif sp:
        forward.append(("all_gather", activation))
    return (sum(collective_seconds(k, size, links.tp) for k, size in forward),
            sum(collective_seconds(k, size, links.tp) for k, size in backward),
            sum(size for _, size in forward), sum(size for _, size in backward))


def _torch_layer_comm(layer: Layer, work: Work, links: Links, count) -> tuple[float, float]:
    """(forward, backward) seconds of a torch model's tensor-parallel collectives in one layer, from the dims
    its plan splits (`ir.layers.TP_SPLIT`, a weight [out, in]): a row-split Linear (rowwise) leaves partial
    sums, all-reduced over the axis in the forward ([tokens, out]), and the column-split Linears that feed
    it all-reduce their input's gradient in the backward, one as large (Megatron's f and g, Shoeybi et al.
    2019, Sec. 3); a row-split embedding (`embedding_rowwise`, in `embed`) all-reduces its output; a
    column-split head (`colwise_gather_output`) all-gathers its logits. Full recomputation reruns the
    forward's collectives in the backward."""
    element = work.precision.bytes
    forward = backward = forward_bytes = 0.0
    for param in layer.params:
        if len(param.shape) != 2 or ir_layers.TP_SPLIT not in param.dims:
            continue
        rows, columns = param.shape
        if param.dims[1] == ir_layers.TP_SPLIT:  # rowwise Linear: [tokens, out] partial sums
            pair = collective_seconds("all_reduce", work.tokens * rows * element, links.tp)
            forward, backward = forward + pair, backward + pair
            count("tensor", work.tokens * rows * element, 2)
            forward_bytes += work.tokens * rows * element
        elif layer.name == "embed":  # a vocabulary-split embedding: its [tokens, dim] output
            forward += collective_seconds("all_reduce", work.tokens * columns * element, links.tp)
            count("tensor", work.tokens * columns * element)
            forward_bytes += work.tokens * columns * element
        elif layer.name == "head":  # the logits, gathered
            forward += collective_seconds("all_gather", work.tokens * rows * element, links.tp)
            backward += collective_seconds("all_reduce", work.tokens * columns * element, links.tp)
            count("tensor", work.tokens * (rows + columns) * element)
            forward_bytes += work.tokens * rows * element
    if work.recompute is ir.Recompute.full:
        backward += forward
        count("tensor", forward_bytes)
    return forward, backward


__all__ = ["Links", "plan_links", "mesh_links", "LayerTime", "Moved", "NOTHING_MOVED", "estimate_layer_time",
           "combined_1f1b_exposed"]
