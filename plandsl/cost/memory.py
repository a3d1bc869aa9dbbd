"""The memory model: bytes one device of each pipeline rank holds at its peak.

Stage: cost model, once layers are assigned to stages and stages to pipeline ranks. Contract:
`estimate_memory` returns one `MemoryEstimate` per pipeline rank, for that rank's worst
tensor/data-parallel coordinate: model states follow ZeRO (Rajbhandari et al. 2020) plus the units
ZeRO-2/3 hold unsharded while gathering and reducing (FSDP, Zhao et al. 2023), activations
Korthikanti et al. 2022, in-flight microbatches the schedules' papers; a rank holds the weights of
every stage any of the schedule's pipelines puts on it (Chimera: two). Sharding follows
Megatron-style defaults where the plan's `shard` rules do not move a parameter (`ir.shard_rules.ruled_layers`, applied
by `assign_stages`: over the tensor axis; over the data axis, `data_split_modules`). Dtypes are the plan's `master_dtype`,
`grad_dtype` and `optimizer_dtype` (`StateBytes`), fp32 by default under every precision, as `plandsl run`
keeps them (docs/cost-model.md, "One memory model"), with the 16-bit copies autocast makes of fp32 weights
(`autocast_weight_copies`).
"""
from __future__ import annotations

import functools
import heapq
import math
from dataclasses import asdict, dataclass, replace
from typing import Sequence

from plandsl import ir
from plandsl.ir.layers import (EXPERTS, TENSOR_SHARDED_DIMS, VOCAB, Layer, Param, attention_widths, block_model,
                               figures_key, kv_width, layers_of, once_per_figures)
from plandsl.ir.pairs import PairLayout, broken, mtp_blocks, table_split
from plandsl.ir.placement import Assignment, assign_stages
from plandsl.ir.shard_rules import data_split_modules, ruled_layers
from plandsl.cost.schedule import plan_schedule, plan_splits_backward
from plandsl.schedules.bounded import builtin_layout
from plandsl.schedules.generators import check_sizes, pipeline_maps
from plandsl.schedules.program import Kind
from plandsl.schedules.registry import BUILTIN, DEFAULT_SCHEDULE

# Dim roles a tensor-parallel axis splits (Megatron, Shoeybi et al. 2019): column-parallel outputs
# (q/k/v heads, MLP ffn), row-parallel inputs (o heads, MLP ffn), the vocabulary of the embedding and head,
# and the attention sinks by heads. Everything else (norms, row-parallel biases, positions, router) is replicated.

# Bytes per element of a parameter, its gradient and each optimizer state by default, whatever `precision`
# says: the interpreter keeps parameters in fp32 and computes under autocast (`runtime.precision`), so
# gradients are fp32 too and Adam's m and v are fp32 tensors shaped like the parameters (torch.optim.AdamW);
# FSDP (`runtime.data_parallel.apply_fsdp`, no MixedPrecisionPolicy) gathers and reduces fp32. This is
# torchtitan's FSDP2 layout (sharded fp32 parameters), not Megatron's (16-bit parameters and gradients
# beside an fp32 master copy in the optimizer): the same 16 bytes per parameter unsharded, split
# differently by ZeRO-1/2. A plan's `master_dtype`, `grad_dtype` and `optimizer_dtype` change them (`StateBytes`).
STATE_BYTES = 4


@dataclass(frozen=True, slots=True)
class StateBytes:
    """Bytes per element of what training keeps for each parameter: the weights, their gradient, each
    optimizer state (Adam's m and v, SGD's momentum) and, when the weights are kept narrower than the master
    copy the optimizer updates (`param_dtype`), that copy (`master`), which the optimizer holds and ZeRO
    shards with its states (Rajbhandari et al. 2020, Sec. 3.1: K = 12 for fp16 weights and fp32 Adam).

    16-bit optimizer states and gradients are today's large-model recipes: Nemotron-4 340B's (NeMo's
    distributed Adam with `dtype: bf16`, `grad_sync_dtype: bf16`), Megatron-Core's precision-aware
    optimizer (`--exp-avg-dtype`, `--main-grads-dtype`, `--main-params-dtype`)."""

    params: int = STATE_BYTES
    grads: int = STATE_BYTES
    state: int = STATE_BYTES
    master: int = 0

    @classmethod
    def of(cls, train: ir.Training) -> "StateBytes":
        return cls(train.weights_dtype.bytes, train.grad_dtype.bytes, train.optimizer_dtype.bytes,
                   train.master_dtype.bytes if train.master_copy else 0)

    def optimizer(self, optimizer: ir.Optimizer) -> int:
        """Optimizer-state bytes per parameter (ZeRO's K): Adam's two moments, SGD's one, and the master copy
        when the weights are kept apart from it."""
        return (2 if optimizer is ir.Optimizer.adam else 1) * self.state + self.master

    def per_param(self, optimizer: ir.Optimizer) -> int:
        """Weights, gradient and optimizer states of one parameter, unsharded (16 for fp32 Adam)."""
        return self.params + self.grads + self.optimizer(optimizer)


FP32_STATES = StateBytes()


@dataclass(frozen=True, slots=True)
class MemoryEstimate:
    """Bytes on one device at its peak. `params` and `grads` are the ZeRO shards plus, with ZeRO-3
    (params) and ZeRO-2/3 (grads), the unsharded units being gathered and reduced
    (`gathered_bytes`), of which `gathered_params` and `gathered_grads` are those units. `other` is what torch's
    pipeline stage holds beside the layers (`torch_stage_bytes`; 0 without a pipeline and on Megatron-LM's): no
    allowance is invented (see `estimate_memory`). `host` is what its offloaded activations (`offload_layers`) take of
    its host's memory at its peak, no part of `total`. `apart`: the bytes of the terms above not alive at the peak,
    less in `total`: the gradients a step of one microbatch has not made yet at its loss's backward
    (`one_backward_apart`); 0 otherwise. `moments`: likewise the bytes of ZeRO-2/3's units in the backward and of the
    activations at the loss's backward never alive together, where the count places the units by moment
    (`gathers_by_moments`, `fsdp_apart`); 0 otherwise."""

    params: float
    grads: float
    optimizer: float
    activations: float
    other: float = 0.0
    gathered_params: float = 0.0
    gathered_grads: float = 0.0
    host: float = 0.0
    apart: float = 0.0
    moments: float = 0.0

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.other - self.apart - self.moments

    @property
    def states(self) -> float:
        """Parameters, gradients and optimizer states, the gathered units included."""
        return self.params + self.grads + self.optimizer

    @property
    def held(self) -> float:
        """What the rank holds through the step beside its activations: its states and torch's pipeline stage's
        buffers (`other`), the constant the schedule's simulation adds to its activations (`Costs.static_bytes`)."""
        return self.states + self.other

    @property
    def stored_states(self) -> float:
        """The states a rank stores between steps: its shards, without the units gathered during one
        (what `plandsl run --dry-run` builds)."""
        return self.states - self.gathered_params - self.gathered_grads

    def to_json(self) -> dict:
        data = {**asdict(self), "total": self.total}
        if not self.host:  # a plan that offloads nothing reads as before `host` existed
            del data["host"]
        if not self.apart:  # nor a step of several microbatches as before `apart` existed
            del data["apart"]
        if not self.moments:  # nor a plan whose units are not placed by moment
            del data["moments"]
        return data


def estimate_memory(plan: ir.Plan, stage_layers: Sequence[Sequence[Layer]],
                    rank_stages: Sequence[Sequence[int]], inflight: Sequence[float], *,
                    attention_matrix: bool = False, held: bool = False) -> list[MemoryEstimate]:
    """One estimate per pipeline rank.

    `stage_layers[stage]` are the layers of a stage, `rank_stages[rank]` the stages a rank runs,
    `inflight[rank]` its peak in-flight microbatches in units of all of the rank's layers
    (`inflight_microbatches`). `attention_matrix`: whether attention stores its s×s scores; by default
    as the plan's `train.attention` says: off for `flash` (the interpreter's torch SDPA and FlashAttention
    keep only the output and a per-row logsumexp, Dao et al. 2022, which Korthikanti's formula predates),
    on for `materialized`.
    `other` stays 0: allocator fragmentation, communication buffers and the CUDA context depend on
    the software stack and the device, and a fixed allowance would be a hardware constant in code.
    `held`: a replica of a plan with `batch_shares`, which reduces its gradients after its last microbatch only: ZeRO-2/3
    units stay gathered through the step (`gathered_bytes`), and torch's tensor-parallel embedding's gradient over the
    whole vocabulary accumulates (`whole_vocab_gradient_bytes`).
    """
    if len(inflight) != len(rank_stages):
        raise ValueError(f"inflight has {len(inflight)} entries for {len(rank_stages)} pipeline ranks")
    attention_matrix = _keeps_scores(plan, attention_matrix)
    schedule = plan.schedule.name if plan.schedule and plan.stages else DEFAULT_SCHEDULE
    tied = tied_embedding(plan, [layer for stage in stage_layers for layer in stage])
    # A built-in model's `Param`s are the interpreter's tensors; a custom model's are one synthetic
    # tensor per authored layer, so its ZeRO-1 partition is taken as even.
    whole_tensors = not isinstance(plan.model, ir.CustomModel)
    kept: dict = {}  # activations per `figures_key`: the same for every rank
    groups = open_gradients(plan, schedule, rank_stages)
    estimates = []
    for stages in held_stages(plan, rank_stages):
        layers = [layer for stage in stages for layer in stage_layers[stage]]
        # A tied head's stage without the embedding keeps its own copy of the weight, kept in sync by an
        # all-reduce of the gradients (Megatron-LM, Narayanan et al. 2021), also on a rank that holds the
        # embedding's stage too (a V-shape's first rank: each stage is a model chunk of its own); two copies where
        # the tied head's weight is kept apart from multi-token prediction's (`head_weight_apart`).
        copies = 2 if head_weight_apart(plan) else 1
        extra = [tied] * copies if tied and any(_copies_embedding(stage_layers[stage]) for stage in stages) else []
        params, grads, optimizer = model_state_bytes(plan, layers, extra, whole_tensors=whole_tensors)
        (gathered_params, gathered_grads), moments = gathered_moments(plan, layers, extra, held=held)
        accumulator = whole_vocab_gradient_bytes(plan, layers, extra, held)
        gathered_grads += accumulator
        split = data_split_gathered(plan, layers, held or plan.train.batch_shares is not None)
        gathered_params, gathered_grads = gathered_params + split[0], gathered_grads + split[1]
        if groups is not None and len(stages) > 1:  # the most the rank's stages open at once hold (`open_gradients`)
            own = {stage: gathered_bytes(plan, stage_layers[stage],
                                         extra if _copies_embedding(stage_layers[stage]) else [], held=held)[1]
                   + whole_vocab_gradient_bytes(plan, stage_layers[stage],
                                                extra if _copies_embedding(stage_layers[stage]) else [], held)
                   for stage in stages}
            gathered_grads = max(sum(own[stage] for stage in group) for group in groups[len(estimates)])
        stored = [0.0, 0.0]  # per microbatch: [the rank's layers but the last stage's norm and head, those two]
        host = 0.0  # per microbatch: the offloaded blocks' (`offload_layers`), in host memory
        for stage in stages:
            layers = stage_layers[stage]
            for layer, mode, away in zip(layers, layer_recompute(plan, layers), layer_offload(plan, layers)):
                saved = once_per_figures(
                    kept.setdefault((mode, layer_precision(plan.train, plan.model, layer)), {}), layer,
                    lambda layer, mode=mode: _layer_activations(
                        plan, layer, mode, attention_matrix))
                if away:
                    host += saved
                else:
                    stored[layer.kind in LAST_STAGE_KINDS] += saved
        rank_inflight = inflight[len(estimates)]
        head = head_inflight(schedule, rank_inflight) if len(rank_stages) > 1 else rank_inflight
        activations = rank_inflight * stored[0] + head * stored[1] \
            + beyond_layers(plan, [stage_layers[stage] for stage in stages], attention_matrix)
        own = rank_stages[len(estimates)]
        buffers = torch_stage_bytes(plan, len(stage_layers), own, rank_inflight, head) if len(rank_stages) > 1 else 0.0
        # the step's end, where it returns the last stage's outputs: its stored states and the outputs with their merge
        merge = returned_merge_bytes(plan, len(stage_layers), own) if len(rank_stages) > 1 else 0.0
        buffers = max(buffers, merge - gathered_params - gathered_grads - activations)
        estimate = MemoryEstimate(params + gathered_params, grads + gathered_grads, optimizer, activations,
                                  other=buffers, gathered_params=gathered_params, gathered_grads=gathered_grads,
                                  host=rank_inflight * host)
        if len(rank_stages) == 1 and moments is not None:  # the loss's backward, a block's, the embedding's
            own = [stage_layers[stage] for stage in stages]
            at_loss, in_backward, in_blocks, at_end = moments
            beyond = activations - rank_inflight * stored[0] - head * stored[1]
            # the blocks' backward: their activations and the block rebuilt, not the loss's moment nor the embedding's
            freed = activations - rank_inflight * stored[0] - beyond_layers(plan, own, attention_matrix, backward=True,
                                                                            vocab=False)
            # the embedding's backward (its whole-vocabulary gradient with the units, `_unit_moments`) and the root's
            # reduce-scatter: the blocks' activations freed, autocast's copies with them (saved by the matmuls)
            held_end = at_end + batch_bytes(plan, sum(len(layer.params) for layer in layers) + len(extra))
            estimate = replace(estimate, moments=fsdp_apart(
                at_loss, in_backward, freed, beyond - beyond_layers(plan, own, attention_matrix, vocab=False),
                in_blocks, in_backward + activations - held_end))
        elif len(rank_stages) == 1 and one_backward_makes_gradients(plan) and not _rebuilds_in_backward(plan, layers):
            after = max(optimizer_step_bytes(plan, [p for layer in layers for p in layer.params] + list(extra),
                                             optimizer), whole_vocab_gradient_moment(plan, layers))
            estimate = replace(estimate, apart=one_backward_apart(estimate, grads + accumulator, after,
                                                                  fused_head_gradient_bytes(plan, layers)))
        estimates.append(estimate)
    return estimates


def fsdp_apart(at_loss: float, in_backward: float, freed: float, over_loss: float = 0.0,
               in_blocks: float | None = None, end: float = math.inf) -> float:
    """Bytes of an estimate's terms not alive at the peak of a rank whose units are placed by moment
    (`gathers_by_moments`), whose activations are counted at their fullest with its units `in_backward` (the most of
    the backward's moments, `unit_moments`): the least any moment leaves out, the total being the largest moment:

    - the loss's backward: the units it holds less than `in_backward` (`at_loss`), and `over_loss`, what the
      activations' working set exceeds the loss's there by (the embedding's whole-vocabulary gradient's moment,
      `whole_vocab_gradient_moment`, larger than the loss's backward: made at the end of the backward, not beside it);
    - a block's backward: the units it holds (`in_blocks`; `in_backward` if None) less than `in_backward`, and the
      activations its blocks' backward has `freed` (the loss's temporaries, the norm's and head's saved tensors, the
      embedding's moment: `beyond_layers(backward=True, vocab=False)`);
    - the embedding's backward and the root's reduce-scatter, the blocks' activations freed: `end`, what they leave
      out of the units `in_backward` and the activations (`estimate_memory`), none by default."""
    blocks = in_backward if in_blocks is None else in_blocks
    return max(0.0, min(in_backward - at_loss + over_loss, in_backward - blocks + freed, end))


def batch_bytes(plan: ir.Plan, tensors: int = 0) -> float:
    """Bytes of what a rank's step holds beside its model: a transformer's batch as `plandsl run` moves it to the device
    (`runtime.train.train_step`: inputs and targets, int64 token ids, every microbatch's rows, the whole sequence: a
    bound under context parallelism), the loss's few 0-dim tensors and one step count per parameter tensor of the
    `tensors` a rank steps (torch's Adam keeps them on the host unless `capturable` or `fused`; a trace on the host
    sees them). A few KiB (a [4, 128] pair of batches and 69 counts in tests/distributed/test_fsdp_tp_moments.py), but
    what a trace holds beyond the count at the embedding's backward, a moment the count otherwise counts tensor by
    tensor (`fsdp_apart`'s `end`); no other moment counts it (their terms are bounds above what they hold)."""
    if not isinstance(plan.model, ir.TransformerModel):
        return 0.0
    return float(2 * 8 * plan.num_microbatches * plan.train.micro_batch * plan.seq + 4 * (tensors + 4))


def one_backward_makes_gradients(plan: ir.Plan) -> bool:
    """Whether the count leaves the step's gradients out of the moment its activations peak, as its one backward makes
    them after it: a step of one microbatch a rank (no pipeline, which runs at least one per stage), on `plandsl
    run`'s stack, where the optimizer's `zero_grad` at the step's start (`runtime.train.train_step`; torch's
    `set_to_none`) has freed the last step's. `replicate`'s gradients and a plain parameter's `.grad` without data
    parallelism are made by the backward, so the step peaks without them at its backward's start, or with them after
    its backward, its activations freed (`one_backward_apart`); over several microbatches the first one's gradients
    are alive beside every later one's activations. Not DistributedDataParallel (plain parameters under `ddp`,
    `replicate` or `zero1` without a pipeline), whose reducer's buckets, as large as the gradients, are made with it
    and kept; nor a plan naming Megatron-LM's stack (`implementation = megatron`), its layout (`param_dtype`) or its
    FP8 gather (`gather = fp8`), whose gradient buffers are kept and zeroed in place (`zero_grad_buffer`). FSDP2's
    sharded gradients are made by the backward too, but kept in the count (docs/validation.md, "The count is above
    `run`'s tensors where no pipeline holds them"): its units are placed by moment (`unit_moments`), the search's caps
    count these gradients whatever the microbatches (Table 1's eager run: 72.1 GiB counted, 66.4 traced)."""
    if plan.num_microbatches != 1 or plan.stages is not None or plan.train.master_copy:
        return False
    if plan.tensor is not None and plan.tp > 1 and plan.tensor.stack != "torch":
        return False
    if plan.data is not None and (plan.data.zero_stage >= 2 or plan.data.gather is ir.Precision.fp8):
        return False  # FSDP2's, kept (above); Megatron's distributed optimizer
    return _reduce_degree(plan) == 1 or replicates_units(plan)  # no wrapper, or `replicate`: not DDP's buckets


def one_backward_apart(estimate: MemoryEstimate, made: float, after: float = 0.0, before: float = 0.0) -> float:
    """Bytes of `estimate`'s terms not alive at the peak of a step whose one backward makes its gradients
    (`one_backward_makes_gradients`), `made` of them (the rank's stored gradients, with the embedding's
    whole-vocabulary `.grad` a rank without data parallelism keeps, `whole_vocab_gradient_bytes`), where the
    activations outweigh them, so that the backward's start (the loss's backward) holds more without them than the
    rest of the step holds with them (none where a block is rebuilt inside it: `_rebuilds_in_backward`); but no more
    than the activations outweigh what the step holds beside all its gradients after the backward (`after`: the
    optimizer's step's temporaries, `optimizer_step_bytes`; the embedding's whole-vocabulary gradient at the
    backward's end, `whole_vocab_gradient_moment`): the total stays at least the states, the gradients and `after`;
    nor the `before` of them the loss's backward makes itself (a fused loss's head's, `fused_head_gradient_bytes`).
    Where the
    gradients outweigh the activations, nothing: the count is kept as before, the peak lying in the optimizer's step
    there (traced: a gpt whose gradients outweigh its activations, 416.5 MiB in Adam's step, 387.6 counted, the
    states with their gradients 352.5). Traced (`plandsl run --dry-run --memory`, tests/distributed/test_memtrace.py):
    a gpt at dp 2 x tp 4 under `zero1` whose head's rule keeps the vocabulary whole holds no gradient at its loss's
    backward, 184.3 MiB, where 206.7 were counted before, as for four microbatches (206.1 traced); 184.9 now. Without
    `after`, a one-device gpt (2 layers, hidden 256, vocab 16384, seq 192, fp32 Adam) was counted 157.5 MiB against
    184.9 traced in Adam's step (its two [16384, 256] temporaries beside the gradients), 191.1 with it; at dp 2 x
    tp 4 under `zero1` (seq 128) 49.2 against 53.8 traced at the embedding's backward, 54.6 with it."""
    if estimate.activations < made:
        return 0.0
    return max(0.0, min(made - before, estimate.activations - after))


def fused_head_gradient_bytes(plan: ir.Plan, layers: Sequence[Layer]) -> float:
    """Bytes of the head's gradient a fused loss's backward makes itself (`loss: fused`: `runtime.loss`'s
    `ChunkedCrossEntropy.backward` allocates the weight's whole gradient before its first chunk), alive at the loss's
    backward, where `one_backward_apart` leaves the others out: the head's weight's, or the embedding's table it is
    tied to; 0 for any other loss (the head's matmul makes its gradient after the loss's backward) or a rank without
    the head."""
    if plan.train.loss is not ir.Loss.fused:
        return 0.0
    head = next((layer for layer in layers if layer.kind == "head"), None)
    if head is None:
        return 0.0
    params = list(head.params) or (_embedding_tables(layers) if getattr(plan.model, "tied_embeddings", False) else [])
    elements = sum(local_numel(p, plan.tp, plan.expert_group, plan.expert_tp) for p in params)
    return float(elements * StateBytes.of(plan.train).grads)


def _rebuilds_in_backward(plan: ir.Plan, layers: Sequence[Layer]) -> bool:
    """Whether the rank's backward rebuilds a block (`_recompute_working_set`), runs a ring's (`context`) or brings
    offloaded activations back (`offload_layers`, at its end): moments inside the backward, after the head's and the
    later blocks' gradients are made, which `one_backward_apart` cannot weigh against the loss's backward (traced: a
    gpt under `recompute: full` peaks at a rebuilt block's `gelu_backward` beside the head's and the last block's
    gradients, above its count less all of them; a trace on the host does not show offloading)."""
    return plan.cp > 1 or bool(plan.train.offload_layers) \
        or _recompute_working_set(plan, layers, _keeps_scores(plan, False)) > 0


def optimizer_step_bytes(plan: ir.Plan, params: Sequence[Param], optimizer: float) -> float:
    """Bytes `plandsl run`'s optimizer step allocates at once beyond the states, on a rank of `params` (its layers'
    and a head's copy of the embedding) whose optimizer holds `optimizer` bytes of states (ZeRO-1's share), for a plan
    whose weights are their own master copy (`one_backward_makes_gradients`). torch's AdamW (fp32 weights and states)
    takes the square root of every second moment at once on CUDA (`_multi_tensor_adam`'s `_foreach_sqrt`: the
    states' share of one moment), two of one tensor's size at a time without `foreach` (the CPU's `_single_tensor_adam`,
    its `denom`): the larger. With 16-bit weights or states (`runtime.optim.AdamWStates`, one tensor at a time) fp32
    copies of the largest tensor's weight, gradient and states where they are narrower, and Adam's two; SGD's momentum
    updates in place (`SGDStates`: its fp32 copies). ZeRO-1 over DTensors (`zero.Zero1Optimizer`) then broadcasts
    each owner's updated shards in one flat buffer, its share of the weights. Gradient clipping's norms are scalars,
    its scaling (and fp16's unscaling) in place."""
    train = plan.train
    states = StateBytes.of(train)
    largest = max((local_numel(p, plan.tp, plan.expert_group, plan.expert_tp) for p in params), default=0)
    adam = train.optimizer is ir.Optimizer.adam
    owned = optimizer / states.optimizer(train.optimizer) if states.optimizer(train.optimizer) else 0.0
    narrow = (train.master_dtype, train.optimizer_dtype) != (ir.Precision.fp32, ir.Precision.fp32)
    if not narrow:  # torch.optim.AdamW / SGD (`runtime.optim.optimizer_settings`)
        step = max(owned * states.state, 2.0 * largest * states.state) if adam else 0.0
    else:  # the states' class: fp32 copies of one tensor at a time, its gradient in the weights' dtype
        copies = 2 * (train.weights_dtype is not ir.Precision.fp32) \
            + (2 if adam else 1) * (train.optimizer_dtype is not ir.Precision.fp32) + (2 if adam else 0)
        step = float(largest * 4 * copies)
    if plan.data is not None and plan.data.zero_stage == 1 and replicates_units(plan):
        step = max(step, owned * states.params)  # Zero1Optimizer's broadcast of the owner's shards
    return step


def beyond_layers(plan: ir.Plan, stages: Sequence[Sequence[Layer]], attention_matrix: bool = False,
                  backward: bool = False, vocab: bool = True) -> float:
    """What a pipeline rank holding `stages` keeps once, beyond its layers' saved activations per microbatch in
    flight (which the schedule's simulation also counts, stage by stage): the larger of the block its recomputation
    rebuilds, the loss's backward and the embedding's under torch's tensor parallelism, peaks of different moments
    (`loss_backward_bytes`, `whole_vocab_gradient_moment`). `backward`: at the blocks' backward, after the loss's;
    `vocab` False: without the embedding's moment (a rank whose units are placed by moment counts it at the
    embedding's backward, `fsdp_apart`)."""
    layers = [layer for stage in stages for layer in stage]
    modes = [(layer, mode) for stage in stages for layer, mode in zip(stage, layer_recompute(plan, stage))]
    rerun = [layer for layer, mode in modes if mode is plan.train.recompute]  # with recompute_layers, those rerun
    scores = _keeps_scores(plan, attention_matrix)
    return max(_recompute_working_set(plan, rerun, scores),
               max((_ring_working_set(plan, layer, mode, scores) for layer, mode in modes), default=0.0),
               0.0 if backward else loss_backward_bytes(plan, layers),
               whole_vocab_gradient_moment(plan, layers) if vocab else 0.0) \
        + offload_inflight(plan, stages, scores) \
        + autocast_weight_copies(plan, layers)


def layer_offload(plan: ir.Plan, layers: Sequence[Layer]) -> list[bool]:
    """Whether each layer of one stage (virtual chunk) keeps its saved activations in host memory: the stage's first
    `offload_layers` blocks (Megatron's --cpu-offloading-num-layers); never the embedding, norm or head."""
    count = plan.train.offload_layers
    if not count:
        return [False] * len(layers)
    flags, index = [], 0
    for layer in layers:
        block = is_block(plan, layer)
        flags.append(block and plan.train.block_offloaded(index))
        index += block
    return flags


def offload_inflight(plan: ir.Plan, stages: Sequence[Sequence[Layer]], attention_matrix: bool = False) -> float:
    """The offloaded activations a rank holds on the device at its peak beyond its kept blocks', once: for a stage
    that keeps none of its blocks, the one reloaded for its backward; else what the largest offloaded block exceeds
    the largest kept one by (0 for equal blocks). Megatron-LM's --cpu-offloading-num-layers runs Transformer Engine's
    `get_cpu_offload_context` (megatron-core 0.16.1's transformer_block.py), which from TE 2.10 on (megatron-core
    0.16.1's pyproject takes 2.9 to 2.11 and its uv source pins v2.12, 5671fd3) is the `DefaultOffloadSynchronizer` of
    `transformer_engine/pytorch/cpu_offload.py` (TE 2.9's handler, now `cpu_offload_v1`, only under
    NVTE_CPU_OFFLOAD_V1=1): it frees offloaded block i's device copy at block L - N + i's forward and starts its
    reload at block L - 1 - N + i's backward, so that the stage's saved activations are L - N blocks' at any moment
    ("(num_layers - num_offloaded_layers) * T"). `plandsl run`'s hooks (torch's `save_on_cpu`) copy each saved
    tensor out as it is saved and back as the backward unpacks it, the kept blocks freed by then."""
    if not plan.train.offload_layers:
        return 0.0
    most = 0.0
    for stage in stages:
        away, kept = [], []
        for layer, mode, offloaded in zip(stage, layer_recompute(plan, stage), layer_offload(plan, stage)):
            if is_block(plan, layer):
                (away if offloaded else kept).append(_layer_activations(plan, layer, mode, attention_matrix))
        if away:
            most = max(most, max(away) - max(kept, default=0.0))
    return most


# ---- autocast's 16-bit copies of wider weights (`plandsl run`) ---------------------------------------------
def holds_autocast_copies(plan: ir.Plan) -> bool:
    """Whether `plandsl run` computes a 16-bit precision over wider weights under `torch.autocast`, which casts each
    weight a matmul reads and keeps the copy (`autocast_weight_copies`): fp32 weights (no `param_dtype`, `master_dtype`
    fp32) at bf16 or fp16, unless FSDP gathers them in the compute precision (`ir.Plan.run_gather`: `data = zero2 |
    zero3 | hsdp ... with gather = bf16` at bf16, FSDP2's `MixedPrecisionPolicy`, as torchtitan runs; Megatron-LM's
    16-bit parameters are `param_dtype`), or 16-bit weights gathered in fp32 (`gather = fp32`); a model `run` can build
    (not a written layer table without a factory). `zero1 ... with gather = bf16` is counted as run holds it: torch's
    ZeroRedundancyOptimizer keeps the weights fp32 and autocast casts them."""
    train, model = plan.train, plan.model
    runs = not isinstance(model, ir.CustomModel) or bool(model.source or model.factory)  # an authored table cannot run
    computed = plan.run_gather or train.weights_dtype  # the weights as the matmuls read them
    return runs and train.precision in (ir.Precision.bf16, ir.Precision.fp16) and computed.bytes > train.precision.bytes


def _copied(plan: ir.Plan, layer: Layer) -> list[Param]:
    """`layer`'s parameters that a matmul reads under autocast: not the embeddings' tables (a lookup, not cast) nor
    the norms' weights (cast by the norm to its input's dtype, `runtime.models`: one hidden vector each, left out), nor
    a head computing a fused loss (`runtime.loss.ChunkedCrossEntropy` casts its weight itself, chunk by chunk, and
    saves the fp32 one), though its multi-token prediction depths' linear layers are."""
    if layer.kind in ("embed", "norm"):
        return []
    params = layer.params
    if layer.kind == "head" and plan.train.loss is ir.Loss.fused:  # its multi-token prediction depths' are cast
        params = [p for p in params if p.module.startswith("mtp.")]
    return [p for p in params if "norm" not in p.module.rsplit(".", 1)[-1]]


def autocast_weight_copies(plan: ir.Plan, layers: Sequence[Layer]) -> float:
    """Bytes of autocast's 16-bit copies of the (fp32) weights of `layers`, a pipeline rank's, that `plandsl run` holds
    at its peak (`holds_autocast_copies`; 0 otherwise), beside the layers' saved activations: 2 bytes per element of
    every linear weight and bias the rank computes with, as it computes with them (tensor- and expert-parallel shards,
    whole under ZeRO-3, which gathers them), once. autocast caches the cast of a leaf parameter until its context exits
    (torch 2.13, `autocast_mode.cpp` `cached_cast`), and the matmul saves the copy for its backward: on a pipeline one
    context spans the step, so each weight is cast once for every microbatch and held to the step's end; off one a
    context spans a microbatch's forward, whose copies its backward holds (one microbatch in flight). Checked: a
    weight's copy is one tensor for two microbatches in one context, with FSDP2 too (tests/distributed/
    test_autocast_copies.py). The grouped experts' weights are read as slices (`runtime.models.expert_mlps`), which
    autocast does not cache: each microbatch saves its own copies, counted with the block's activations
    (`expert_weight_copies`). A tied head reads the embedding's table: its copy is counted on the head's rank."""
    if not holds_autocast_copies(plan):
        return 0.0
    tp, ep, expert_tp = plan.tp, plan.expert_group, plan.expert_tp
    elements = 0
    seen: dict = {}
    for layer in layers:
        elements += once_per_figures(seen, layer, lambda layer: sum(
            local_numel(p, tp, ep, expert_tp) for p in _copied(plan, layer) if not is_expert_tensor(p)))
    if any(layer.kind == "head" for layer in layers) and plan.train.loss is not ir.Loss.fused \
            and getattr(plan.model, "tied_embeddings", False):
        tied = tied_embedding(plan, layers_of(plan.model))
        elements += local_numel(tied, tp, ep, expert_tp) if tied is not None else 0
    return float(elements * plan.train.precision.bytes)


def expert_weight_copies(plan: ir.Plan, layer: Layer, recompute: ir.Recompute) -> float:
    """Bytes of the 16-bit copies of a block's grouped expert weights that one microbatch saves for its backward under
    `plandsl run`'s autocast (`holds_autocast_copies`): the rank's experts, each read as a slice that autocast casts
    anew (no cache for a view), the copy saved by its matmuls; none when the block is rerun whole in the backward."""
    if not holds_autocast_copies(plan) or recompute is ir.Recompute.full or layer.kind != "block":
        return 0.0
    tp, ep, expert_tp = plan.tp, plan.expert_group, plan.expert_tp
    return float(sum(local_numel(p, tp, ep, expert_tp) for p in layer.params if is_expert_tensor(p))
                 * plan.train.precision.bytes)


def held_stages(plan: ir.Plan, rank_stages: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
    """Per pipeline rank, the stages whose weights (and gradients, optimizer states) it holds.

    A rank holds every stage that any pipeline of the plan's schedule maps onto it (the
    schedule's `stage_to_rank` maps): its own stages for one-pipeline schedules; with Chimera's two
    pipelines (Li & Hoefler 2021, Sec. 3: two copies of the weights per worker) stage r of the
    down pipeline and stage p - 1 - r of the up one."""
    maps = _pipeline_maps(plan.schedule.name if plan.schedule and plan.stages else "", len(rank_stages))
    own = [tuple(stages) for stages in rank_stages]
    count = sum(len(stages) for stages in own)
    if len(maps) < 2 or any(len(m) != count for m in maps):
        return own
    return [tuple(sorted({s for m in maps for s, r in enumerate(m) if r == rank} | set(stages)))
            for rank, stages in enumerate(own)]


@functools.lru_cache(maxsize=256)
def _pipeline_maps(schedule: str, ranks: int) -> tuple[tuple[int, ...], ...]:
    """The stage -> rank map of each pipeline of a built-in schedule with several pipelines."""
    info = BUILTIN.get(schedule)
    if info is None or info.pipelines < 2:
        return ()
    try:  # the smallest run the generator accepts: one unit of `ranks` microbatches
        check_sizes(schedule, ranks, ranks)
    except ValueError:  # the checker reports the schedule's own error (an odd pp for Chimera)
        return ()
    return pipeline_maps(schedule, ranks)


def inflight_microbatches(schedule: str, pp: int, microbatches: int, virtual: int) -> list[float]:
    """Peak microbatches whose activations a pipeline rank holds at once, per rank, by the built-in's
    in-flight rule (`ScheduleInfo.inflight`; names that are no built-in take `depth`).

    Counted in units of one microbatch through all the rank's layers (all its virtual stages).
    `every` (gpipe, looped_bfs): every microbatch (Huang et al. 2019). `depth` (1f1b, zb_h1,
    interleaved_zero_bubble, dualpipev, other names): min(pp - rank, m) (Narayanan et al. 2021;
    ZB-H1 matches 1F1B's memory, Qi et al. 2023). `double_depth` (zb_h2): min(2(pp - rank) - 1, m)
    (Qi et al. 2023, Table 1: (2p - 1)·M_B on the first rank). `full_depth` (zbv): min(pp, m) on
    every rank (Qi et al. 2023, Sec. 6: p·M_B, balanced across ranks). `two_pipelines` (chimera):
    half of p/2 + 1 + min(r, p - 1 - r) stage-microbatches (the rank's two stages).
    `interleaved` (interleaved_1f1b, virtual v > 1; `depth` for v = 1): Megatron-LM warms up
    2(pp - rank - 1) + (v - 1)·pp chunk microbatches, so 2(pp - rank - 1) + (v - 1)·pp + 1 chunk
    microbatches are in flight, each 1/v of the rank: we return that over v, rounded UP to an int
    (rank 0: pp·(1 + (pp - 1)/(pp·v)), Korthikanti et al. 2022, Sec. 4.2.3), capped at m.
    """
    info = BUILTIN.get(schedule)
    rule = info.inflight if info is not None else "depth"
    m = microbatches
    if rule == "every":
        return [m] * pp
    if rule == "interleaved" and virtual > 1:
        chunks = [2 * (pp - rank - 1) + (virtual - 1) * pp + 1 for rank in range(pp)]
        return [min(m, -(-count // virtual)) for count in chunks]
    if rule == "double_depth":
        return [min(m, 2 * (pp - rank) - 1) for rank in range(pp)]
    if rule == "full_depth":
        return [min(m, pp)] * pp
    if rule == "two_pipelines":
        # Li & Hoefler 2021, Table 2: between (p/2 + 1) and p stage-microbatches per worker; the
        # generated schedule holds p/2 + 1 + min(r, p - 1 - r) on rank r. A rank holds two stages
        # (`held_stages`), so in units of both: half of that.
        return [min(m, pp // 2 + 1 + min(rank, pp - 1 - rank)) / 2 for rank in range(pp)]
    return [min(m, pp - rank) for rank in range(pp)]


# ---- model states (ZeRO) --------------------------------------------------------------
def optimizer_bytes_per_param(optimizer: ir.Optimizer, states: StateBytes = FP32_STATES) -> int:
    """Optimizer-state bytes per parameter (ZeRO's K), before any sharding, at any precision.

    The parameters are their own master copy (`master_dtype`), so the optimizer keeps its states only,
    as the interpreter's (`runtime.optim.optimizer_settings`): AdamW's momentum and variance, 4 + 4 = 8
    in fp32; SGD's momentum buffer, 4. (Megatron's layout would be K = 12 for Adam: ZeRO, Sec. 3.1,
    with 2-byte parameters and gradients.)
    """
    return states.optimizer(optimizer)


def local_numel(param: Param, tp: int, ep: int, expert_tp: int | None = None) -> int:
    """Elements of `param` on the worst tensor/expert-parallel coordinate.

    The first tensor-sharded dim is split over tp (Megatron); a grouped expert tensor's leading
    `experts` dim over ep (the expert group's ranks). Expert FFNs are split over `expert_tp`, tp unless
    given (Megatron-Core's default expert tensor parallelism equals tp; 1 when the experts fold the tensor
    axis into their group). Uneven splits round up: the worst coordinate.
    """
    if expert_tp is not None and is_expert_tensor(param):
        return _local_numel(param.shape, param.dims, expert_tp, ep)
    return _local_numel(param.shape, param.dims, tp, ep)


@functools.lru_cache(maxsize=4096)
def _local_numel(shape: tuple[int, ...], dims: tuple[str, ...], tp: int, ep: int) -> int:
    # Memoised on the shape: the blocks of a model repeat the same few shapes thousands of times.
    local = list(shape)
    sharded = next((i for i, role in enumerate(dims) if role in TENSOR_SHARDED_DIMS), None)
    if sharded is not None:
        local[sharded] = -(-local[sharded] // tp)
    if len(dims) == 3 and dims[0] == EXPERTS:
        local[0] = -(-local[0] // ep)
    return math.prod(local)


def is_expert_tensor(param: Param) -> bool:
    """A grouped expert tensor [experts, out, in]; the router [experts, hidden] is not one."""
    return len(param.dims) == 3 and param.dims[0] == EXPERTS


def zero_degrees(plan: ir.Plan) -> tuple[int, int, int]:
    """(ZeRO stage, shard degree of dense params, shard degree of expert params).

    zero1/2/3 shard over N_d = plan.dp times the context axis (whose ranks hold the same parameters:
    torchtitan's FSDP over dp x cp, Megatron-LM's distributed optimizer over its data-context
    group); hsdp shards over its shard axis, the last data axis (and the context axis), and
    replicates over the others.
    Expert params have only N_d / ep replicas (the expert axis holds different experts), so that
    is all ZeRO can shard them over.
    """
    if plan.data is None:
        return 0, 1, 1
    if plan.data.hybrid:  # the context axis joins the shard axis (torchtitan's dp_shard_cp)
        shard_axis = plan.data.axes[-1]
        dense = plan.mesh.degree(shard_axis) * plan.cp
        expert = plan.cp if plan.experts and plan.experts.axis == shard_axis else dense
        return plan.data.zero_stage, dense, expert
    replicas = plan.dp * plan.cp
    return plan.data.zero_stage, replicas, max(1, replicas // plan.ep)


def model_state_bytes(plan: ir.Plan, layers: Sequence[Layer], extra: Sequence[Param] = (), *,
                      whole_tensors: bool = False) -> tuple[float, float, float]:
    """(params, grads, optimizer) bytes of these layers' (and `extra`) ZeRO shards on one device.

    `whole_tensors`: ZeRO-1's optimizer states as the interpreter partitions them, whole tensors over
    the data ranks (`zero_one_elements`), on the most loaded rank: exact for a rank's whole share, but
    not additive over layers, so callers that sum per-layer figures (the search) leave it off and get
    the even split, 1/N_d of the elements."""
    tp, ep, expert_tp = plan.tp, plan.expert_group, plan.expert_tp
    dense: list[int] = []
    expert: list[int] = []
    seen: dict = {}
    apart = data_split_modules(plan) if zero_degrees(plan)[0] < 2 else frozenset()  # ZeRO-2/3 shard them anyway
    own = 0  # elements of the modules a shard rule splits over the data axis: FSDP groups of their own
    for layer in layers:  # a family's blocks share one set of sizes (`figures_key`)
        if apart and any(p.module in apart for p in layer.params):
            sizes = _sizes([p for p in layer.params if p.module not in apart], tp, ep, expert_tp)
            own += sum(local_numel(p, tp, ep, expert_tp) for p in layer.params if p.module in apart)
        else:
            sizes = once_per_figures(seen, layer, lambda layer: _sizes(layer.params, tp, ep, expert_tp))
        dense += sizes[0]
        expert += sizes[1]
    more = _sizes(extra, tp, ep, expert_tp)
    params, grads, optimizer = _model_states(plan, dense + more[0], expert + more[1], whole_tensors)
    if own:  # 1/dp of each rank's, every state (ZeRO-1 steps them as they are held: `build_dp_optimizer`'s `own`)
        shard, states = -(-own // _reduce_degree(plan)), StateBytes.of(plan.train)
        params, grads = params + shard * states.params, grads + shard * states.grads
        optimizer += shard * states.optimizer(plan.train.optimizer)
    if plan.data is not None and plan.data.gather is ir.Precision.fp8 and 1 <= plan.data.zero_stage < 3:
        # Megatron's --fp8-param-gather (the only stack that gathers FP8 weights under ZeRO-1/2: its distributed
        # optimizer) keeps the quantized layers' weights as FP8 tensors (`fp8_model_init`: one byte, one copy on
        # Blackwell; MXFP8 both copies, `fp8_weight_bytes`; Hopper's transpose made after each gather is not counted,
        # docs/cost-model.md "Not modelled"), the master copy with the optimizer. Under ZeRO-3 see
        # `megatron_fsdp_shards`.
        quantized = sum(_quantized_numel(plan, layer, tp, ep, expert_tp) for layer in layers)
        states = StateBytes.of(plan.train)
        params -= quantized * (states.params - fp8_weight_bytes(plan.train))
        if not plan.train.master_copy:  # the weights were the master copy: it stays, with the optimizer's shards
            dense_only = sum(_quantized_numel(plan, layer, tp, ep, expert_tp, True) for layer in layers)
            _, dense_degree, expert_degree = zero_degrees(plan)
            optimizer += (-(-dense_only // dense_degree) + -(-(quantized - dense_only) // expert_degree)) \
                * plan.train.master_dtype.bytes
    elif megatron_fsdp_shards(plan):
        quantized = sum(_quantized_numel(plan, layer, tp, ep, expert_tp) for layer in layers)
        dense_only = sum(_quantized_numel(plan, layer, tp, ep, expert_tp, True) for layer in layers)
        _, dense_degree, expert_degree = zero_degrees(plan)
        shards = -(-dense_only // dense_degree) + -(-(quantized - dense_only) // expert_degree)
        params -= shards * (StateBytes.of(plan.train).params - fp8_weight_bytes(plan.train))
    return params, grads, optimizer


def _reduce_degree(plan: ir.Plan) -> int:
    """The ranks the gradients are reduced over (`ir.Plan.reduce_axes`: the data and context axes): what `run`'s
    data parallelism wraps (none where 1), and what a shard rule's `Shard(d) @ AXIS` splits a module's storage over
    (the one reduce axis: `runtime.parallel.tensor_parallel._data_shard_problem` refuses any other)."""
    return math.prod(plan.mesh.degree(axis) for axis in plan.reduce_axes())


def data_split_gathered(plan: ir.Plan, layers: Sequence[Layer], held: bool = False) -> tuple[float, float]:
    """(params, grads) bytes of the modules a shard rule splits over the data axis (`data_split_modules`) gathered
    whole beside their shards under ZeRO-0/1 (ZeRO-2/3 gather them with their units, `gathered_bytes`): each an FSDP
    group of its own (`data_parallel.shard_by_rules`), gathered for its forward and again for its backward and freed
    after each, its gradient whole until reduce-scattered: the largest one's; every one's, whole through the step,
    where the step holds its units (`batch_shares`: FSDP keeps them gathered from the first forward to the last
    backward, `apply_dp(uneven=True)`). In the weights' and gradients' dtypes (no `MixedPrecisionPolicy` under ZeRO-0/1).
    `replicate`'s copies leave these modules out (`replicate_copy_bytes`)."""
    apart = data_split_modules(plan) if zero_degrees(plan)[0] < 2 else frozenset()
    if not apart:
        return 0.0, 0.0
    tp, ep, expert_tp = plan.tp, plan.expert_group, plan.expert_tp
    modules: dict[str, int] = {}
    for layer in layers:
        for p in layer.params:
            if p.module in apart:
                modules[p.module] = modules.get(p.module, 0) + local_numel(p, tp, ep, expert_tp)
    elements = sum(modules.values()) if held else max(modules.values(), default=0)
    states = StateBytes.of(plan.train)
    return float(elements * states.params), float(elements * states.grads)


def megatron_fsdp_shards(plan: ir.Plan) -> bool:
    """Whether a ZeRO-3 plan's quantized weights rest as FP8 shards: a plan that gathers them in FP8 (`gather =
    fp8`) and keeps its weights narrower than the master copy (`param_dtype: bf16` over fp32) is Megatron-FSDP's
    layout with --fp8-param-gather (torchtitan's FSDP2 with torchao's FP8 gather keeps the fp32 weights, which are
    their own master copy, and casts each shard before its gather). Megatron-FSDP (megatron-core 0.16.1,
    megatron/core/distributed/fsdp/src/megatron_fsdp/param_and_grad_buffer.py:1940-2031) gives an FP8 parameter
    group a `model_weight_buffer` of `torch.uint8` (one byte a parameter, sharded under `optim_grads_params`),
    MXFP8's a `transpose_weight_buffer` of the same beside it (`fp8_need_transpose_data`, mixed_precision.py:182:
    "only mxfp8"), an fp32 `main_weight_buffer` (the master copy) and a bf16 `main_grad_buffer`
    (`grad_dtype = torch.bfloat16` for an FP8 group unless `grad_reduce_in_fp32`): 1 + 4 + 2 + 8 (Adam's fp32
    moments) = 15 bytes a parameter, not the 16 of a bf16 shard."""
    return (plan.data is not None and plan.data.gather is ir.Precision.fp8 and plan.data.zero_stage == 3
            and plan.train.master_copy)


def _quantized_numel(plan: ir.Plan, layer: Layer, tp: int, ep: int, expert_tp: int | None,
                     dense_only: bool = False) -> int:
    """Elements on one device of `layer`'s weights that FP8 training quantizes: the linear weights (two or more
    dims) of a block whose layers run quantized (`layer_precision`); `dense_only`: not the experts'."""
    if layer.kind != "block" or not layer_precision(plan.train, plan.model, layer).quantized:
        return 0
    return sum(local_numel(p, tp, ep, expert_tp) for p in layer.params
               if len(p.dims) >= 2 and not (dense_only and is_expert_tensor(p)))


def _sizes(params: Sequence[Param], tp: int, ep: int, expert_tp: int | None = None) -> tuple[list[int], list[int]]:
    """(dense, expert) elements of each of these params on one device."""
    return ([local_numel(p, tp, ep) for p in params if not is_expert_tensor(p)],
            [local_numel(p, tp, ep, expert_tp) for p in params if is_expert_tensor(p)])


def _model_states(plan: ir.Plan, dense: list[int], expert: list[int],
                  whole_tensors: bool = False) -> tuple[float, float, float]:
    """(params, grads, optimizer) bytes for params of these sizes (elements per device) on one device."""
    stage, dense_degree, expert_degree = zero_degrees(plan)

    def held(from_stage: int) -> float:  # elements kept per device: ZeRO stage s shards it if s >= from_stage
        if stage < from_stage:
            return float(sum(dense) + sum(expert))
        if stage == 1 and whole_tensors:
            return float(zero_one_elements(dense, dense_degree) + zero_one_elements(expert, expert_degree))
        return -(-sum(dense) // dense_degree) + -(-sum(expert) // expert_degree)

    # ZeRO Sec. 3.1 with the plan's dtypes (fp32 by default: 4Ψ params + 4Ψ grads + KΨ optimizer); stage 1
    # shards the optimizer states, stage 2 also the grads, stage 3 also the params (Sec. 5.1-5.3).
    states = StateBytes.of(plan.train)
    params = held(2) if gathers_whole(plan) else held(3)  # ZeRO-2's shards at rest, its units whole in `gathered_bytes`
    return (params * states.params, held(2) * states.grads, held(1) * states.optimizer(plan.train.optimizer))


def gathers_whole(plan: ir.Plan) -> bool:
    """ZeRO-2 as `plandsl run` holds it: FSDP2's `fully_shard(reshard_after_forward=False)`
    (`runtime.parallel.data_parallel`) keeps the parameters sharded at rest (`_model_states`) and gathers each unit
    before its first forward into buffers of its own, in the plan's `gather` dtype, which it frees only after that
    unit's backward: at the backward's start every unit is whole beside the shards (`gathered_bytes`). Not under
    `gather = fp8`, Megatron's --fp8-param-gather, whose model keeps the weights whole (`model_state_bytes`)."""
    return plan.data is not None and plan.data.zero_stage == 2 and plan.data.gather is not ir.Precision.fp8


def replicates_units(plan: ir.Plan) -> bool:
    """Whether `plandsl run` replicates the rank's parameters with torch's composable `replicate`
    (`runtime.parallel.data_parallel.apply_ddp`), FSDP2's machinery over a mesh it does not shard: under replication
    (`ddp`, `replicate`, `zero1`, or no `data` with a context or expert axis to reduce over) of tensor- or
    expert-parallel (DTensor) parameters, which DistributedDataParallel does not take, and of every pipeline stage,
    which DDP's reducer does not survive under every schedule. It copies each unit's parameters into buffers of their
    own before the unit's forward (the all-gather of one rank) and, with no mesh to reshard to after the forward
    (`replicate_with_fsdp`: `post_forward_mesh_info` None; `set_reshard_after_forward` refuses its mesh), frees them
    only after the unit's backward (under a pipeline or `batch_shares`, after the step's last backward): at a
    backward's start the rank holds its parameters twice (`replicate_copy_bytes`). Not on DistributedDataParallel
    (plain parameters without a pipeline), nor where the plan names Megatron-LM's or DeepSpeed's stack
    (`implementation = megatron | deepspeed`: their DDP reduces into buckets beside one copy of the parameters)."""
    if plan.data is not None and (plan.data.zero_stage >= 2 or plan.data.gather is ir.Precision.fp8):
        return False  # FSDP; or Megatron's FP8 parameter gather (`--fp8-param-gather`, `model_state_bytes`)
    if _reduce_degree(plan) == 1:  # nothing to reduce over: no wrapper
        return False
    if plan.stages is not None:
        return plan.stages.implementation == "torch"
    if plan.tensor is not None and plan.tp > 1:
        return plan.tensor.stack == "torch"
    # expert shards; a shard rule's split over the data axis makes DTensors of its parameters too
    return (plan.experts is not None and plan.ep > 1) or bool(data_split_modules(plan))


def replicate_copy_bytes(plan: ir.Plan, layers: Sequence[Layer], extra: Sequence[Param] = ()) -> float:
    """Bytes of `replicate`'s copies of the parameters of `layers` (and `extra`: a head stage's copies of the
    embedding) where the plan's replication runs on it (`replicates_units`): every unit whole from its forward to its
    backward, in the weights' dtype (`run` gives `replicate` no `MixedPrecisionPolicy`). Left out: the experts of an
    expert axis replicated over no other axis (`_group_experts`: `replicate` ignores them; without an expert axis
    they are a block's like any parameter), and the modules a shard rule splits over the data axis (FSDP groups of
    their own, `data_parallel.shard_by_rules`, gathered apart: `data_split_gathered`).
    Traced (`plandsl run --dry-run --memory`, tests/distributed/test_memtrace.py): a llama at dp 2 x tp 2 under `ddp`,
    40.9 MiB of tensors at the peak against 33.2 counted without the copies, 40.2 with them."""
    if not replicates_units(plan):
        return 0.0
    tp, ep, expert_tp = plan.tp, plan.expert_group, plan.expert_tp
    split = plan.experts is not None and plan.ep > 1
    experts = not split or math.prod(
        plan.mesh.degree(axis) for axis in plan.reduce_axes() if axis != plan.experts.axis) > 1
    apart = data_split_modules(plan)
    params = [p for layer in layers for p in layer.params] + list(extra)
    return float(sum(local_numel(p, tp, ep, expert_tp) for p in params
                     if (experts or not is_expert_tensor(p)) and p.module not in apart)
                 * StateBytes.of(plan.train).params)


def zero_one_elements(sizes: Sequence[int], ranks: int) -> int:
    """Elements of the most loaded of `ranks` ZeRO-1 partitions of tensors of these `sizes`.

    The interpreter's ZeRO-1 (torch's ZeroRedundancyOptimizer, `runtime.zero.assign`) gives each
    tensor whole to one rank, largest first, to the rank holding the fewest elements so far (Graham's
    LPT): a few large tensors over many ranks load them unevenly (Mixtral's stages over 16 data ranks:
    14 % above the even split). O(n log ranks) with a heap."""
    if ranks <= 1 or not sizes:
        return sum(sizes)
    ordered = sorted(sizes, reverse=True)
    if len(ordered) <= ranks:
        return ordered[0]
    load = [(0, rank) for rank in range(ranks)]  # (elements, rank): ties go to the lowest rank
    for size in ordered:
        elements, rank = heapq.heappop(load)
        heapq.heappush(load, (elements + size, rank))
    return max(elements for elements, _ in load)


def gathered_bytes(plan: ir.Plan, layers: Sequence[Layer], extra: Sequence[Param] = (),
                   held: bool = False) -> tuple[float, float]:
    """(params, grads) bytes a rank holds unsharded on top of its shards while it gathers and reduces.

    ZeRO-3 all-gathers a unit's parameters just before its forward and again before its backward,
    and frees them after (Rajbhandari et al. 2020, Sec. 5.3); FSDP prefetches the next unit's
    all-gather while the current one computes, so two units' full parameters are live at once
    (Zhao et al. 2023, Sec. 3.4-3.5: backward and forward prefetching, and a rate limiter that keeps
    at most two all-gathers in flight). In backward a unit's full gradients live until its
    reduce-scatter is done, which overlaps the next unit's backward: two units' gradients. ZeRO-2
    reduce-scatters the gradients the same way, but gathers each unit once a step and keeps it whole until its
    backward (`gathers_whole`): every unit's parameters beside the shards. Units as the interpreter wraps them
    (`runtime.data_parallel.apply_fsdp`): each block (or written layer) is one, the rank's other
    layers (embedding, final norm, head, a tied head's copy: `extra`) one more, the root.

    `held`: the data ranks run their own microbatch counts (`batch_shares`), so the interpreter keeps every
    unit gathered from the step's first forward to its last backward and reduces once, after the last
    microbatch (`runtime.parallel.data_parallel.apply_dp(uneven=True)`, `gradient_sync`): ZeRO-3 holds every
    unit's parameters whole at once, and with more than one microbatch the unsharded gradients of every unit
    accumulate until then (with one, each unit reduces after its backward: two units' gradients, as above).
    A pipelined plan is held too (`pipelined_shards`): torch's pipeline schedules keep a stage's parameters
    gathered and its gradients unsharded until every microbatch has run, and reduce them after the last
    backward even with one microbatch. Under replication on torch's stack (`replicates_units`) the parameters are
    `replicate`'s copies of every unit (`replicate_copy_bytes`), the gradients nothing beyond the rank's own.
    """
    if replicates_units(plan):  # replicate's copies: every unit whole, no gradients beyond the rank's own
        return replicate_copy_bytes(plan, layers, extra), 0.0
    stage = zero_degrees(plan)[0]
    if stage < 2:
        return 0.0, 0.0
    pipelined = pipelined_shards(plan)
    held = held or pipelined
    states = StateBytes.of(plan.train)
    if gathers_by_moments(plan, held):  # the most any moment of the backward holds (`unit_moments`)
        return _backward_bytes(_unit_moments(plan, layers, extra))
    units, (root, root_bytes) = _gather_units(plan, layers, extra)
    gathering = plan.data.gathering
    largest = sorted(units + [(root, root_bytes)], reverse=True)[:2]
    live, live_bytes = sum(count for count, _ in largest), sum(size for _, size in largest)
    if not gathering.default and not held:  # the units as they run, each with those gathered ahead of it
        live = _live_units(plan, layers, root, gathering)
        everything = sum(count for count, _ in units) + root
        live_bytes = live * (sum(size for _, size in units) + root_bytes) / everything if everything else 0.0
    whole = sum(count for count, _ in units) + root if held else live
    whole_bytes = sum(size for _, size in units) + root_bytes if held else live_bytes
    grads = whole if held and (plan.num_microbatches > 1 or pipelined) else live
    if gathers_whole(plan):  # ZeRO-2: every unit whole through the step, beside the shards
        return float(sum(size for _, size in units) + root_bytes), float(grads * states.grads)
    return (float(whole_bytes) if stage >= 3 else 0.0), float(grads * states.grads)


def gathered_moments(plan: ir.Plan, layers: Sequence[Layer], extra: Sequence[Param] = (), held: bool = False) \
        -> tuple[tuple[float, float], tuple[float, float, float, float] | None]:
    """(`gathered_bytes`, `unit_moments(apart=True)` where the count places the units by moment,
    `gathers_by_moments`, else None), the moments counted once (`_unit_moments`) for both."""
    if not gathers_by_moments(plan, held):
        return gathered_bytes(plan, layers, extra, held), None
    whole = _unit_moments(plan, layers, extra)
    return _backward_bytes(whole), _apart_moments(whole)


def _backward_bytes(whole: tuple[float, ...]) -> tuple[float, float]:
    """`gathered_bytes` of units placed by moment: (the parameters in the backward, the rest of the backward's most)."""
    return whole[1], whole[2] - whole[1]


def _apart_moments(whole: tuple[float, ...]) -> tuple[float, float, float, float]:
    """`unit_moments(apart=True)` of `_unit_moments`' count."""
    return whole[0], whole[2], whole[3], whole[4]


def _gather_units(plan: ir.Plan, layers: Sequence[Layer], extra: Sequence[Param] = ()) \
        -> tuple[list[tuple[int, float]], tuple[int, float]]:
    """(elements, bytes as gathered) of each block's unit among `layers`, and of the root's (the other layers and
    `extra`): each unit's parameters as gathered (`gather = DTYPE`; the weights' dtype unless the plan names one:
    `plandsl run` applies FSDP without a MixedPrecisionPolicy)."""
    tp, ep, expert_tp = plan.tp, plan.expert_group, plan.expert_tp
    states = StateBytes.of(plan.train)
    root = sum(local_numel(p, tp, ep, expert_tp) for p in extra)
    units, root_bytes = [], root * gather_element_bytes(plan.train, plan.data.gather, False, states.params)
    seen: dict = {}
    for layer in layers:
        key = (figures_key(layer), layer_precision(plan.train, plan.model, layer))
        if key not in seen:
            seen[key] = (sum(local_numel(p, tp, ep, expert_tp) for p in layer.params),
                         gathered_param_bytes(plan, layer, states.params, tp, ep, expert_tp))
        count, size = seen[key]
        if layer.kind in ("block", "custom"):
            units.append((count, size))
        else:
            root, root_bytes = root + count, root_bytes + size
    return units, (root, root_bytes)


def gathers_by_moments(plan: ir.Plan, held: bool = False) -> bool:
    """Whether the count places ZeRO-2/3's units at the moments FSDP2 holds them (`unit_moments`,
    `fsdp_apart`): `plandsl run`'s FSDP2 with its default units (blocks, one ahead) and no pipeline, each microbatch
    reduced after its backward (not `held`: `batch_shares`, whose units stay gathered through the step)."""
    return (plan.data is not None and plan.data.zero_stage >= 2 and plan.stages is None and not held
            and plan.data.gathering.default and not replicates_units(plan))


def unit_moments(plan: ir.Plan, layers: Sequence[Layer], extra: Sequence[Param] = (), apart: bool = False) \
        -> tuple[float, ...]:
    """(at the loss's backward, in the backward) bytes of ZeRO-2/3's units a rank of `layers` holds unsharded beside its
    shards, where the count places them by moment (`gathers_by_moments`), as torch 2.13's FSDP2 holds them under
    `plandsl run`'s `apply_fsdp` (traced, tests/distributed/test_fsdp_moments.py):

    - at the loss's backward, the activations' fullest moment: no unsharded gradient yet; the parameters of every
      unit under ZeRO-2 (`gathers_whole`), under ZeRO-3 those of the root (the embedding, final norm and head,
      gathered again for the head's backward: the all-gather's output beside the parameters copied out of it, once
      the loss's temporaries but the logits' gradient are freed, `loss_released_bytes`) and of the last block (kept
      gathered after its forward, which the backward needs at once), the largest block;
    - in a block's backward, its loss's temporaries and the norm's and head's saved activations freed: the root's
      parameters, two blocks' (the block's and the one FSDP2 prefetches; every unit under ZeRO-2), the gradients
      of the head and norm (made by their backward, reduced with the root's at the backward's end), of the block
      and of the block before, whose flat reduce-scatter input FSDP2 keeps till the next one's
      (`reduce_scatter_states`); not the embedding's, made after the blocks' backward (but a table a tied head
      shares), when the root holds its parameters and every one of its gradients (a tied table's three times: the
      head's, the embedding's and their sum), under torch's tensor parallelism the embedding's gradient over the whole
      vocabulary as its backward makes it (`whole_vocab_gradient_moment`, before its reduction to the rank's rows),
      and no block's but the first block's reduce-scatter input, then its
      reduce-scatter's input and output shard beside what is left of its gradients (in the gather's dtype): the
      largest, a bound on every block's moment and the embedding's.

    Each in the gradients' dtype and the parameters' gather dtype (`_gather_units`). `apart`: (at the loss's
    backward, in the backward, in a block's backward, at the embedding's backward or the root's reduce-scatter), the
    last two apart, as the activations beside them differ (`estimate_memory`, `fsdp_apart`'s `end`)."""
    found = _unit_moments(plan, layers, extra)
    return _apart_moments(found) if apart else found[:3:2]


def _unit_moments(plan: ir.Plan, layers: Sequence[Layer], extra: Sequence[Param] = ()) \
        -> tuple[float, float, float, float, float]:
    """`unit_moments`' (at the loss's backward, the parameters in the backward, all in the backward, all in a block's
    backward, all at the embedding's backward or the root's reduce-scatter)."""
    units, (root, root_bytes) = _gather_units(plan, layers, extra)
    tp, ep, expert_tp = plan.tp, plan.expert_group, plan.expert_tp
    grad = StateBytes.of(plan.train).grads
    # the embedding's gradients, made after the blocks' backward (a table a tied head shares: by the head's)
    tied = tied_embedding(plan, layers) if getattr(plan.model, "tied_embeddings", False) else None
    late = sum(local_numel(p, tp, ep, expert_tp) for layer in layers if layer.kind == "embed" for p in layer.params
               if p is not tied)
    blocks = sorted(units, reverse=True)[:2]
    if gathers_whole(plan):
        at_loss = params = float(root_bytes + sum(size for _, size in units))
    else:  # ZeRO-3 resharded the root after the forward: gathered again for the head's backward, the all-gather's
        # output beside the parameters it is copied into, once the loss's temporaries but the logits' gradient are freed
        again = max(0.0, root_bytes - loss_released_bytes(plan, layers))
        at_loss = float(root_bytes + again + max((size for _, size in units), default=0.0))
        params = float(root_bytes + sum(size for _, size in blocks))
    in_blocks = params + (root - late + sum(count for count, _ in blocks)) * grad
    # a tied table's two gradients (the head's, the embedding's) and their sum, alive together as autograd adds them;
    # the first block's reduce-scatter input, which FSDP2 keeps till the root's (`reduce_scatter_states`)
    shared = 2 * local_numel(tied, tp, ep, expert_tp) if tied is not None else 0
    first = max((count for count, _ in units), default=0)
    whole = sum(size for _, size in units) if gathers_whole(plan) else 0.0
    # the embedding's gradient over the whole vocabulary under torch's tensor parallelism, beside its rows' (traced at
    # dp 2 x tp 2: its [vocab, hidden] `Partial` and the `Shard(0)` rows FSDP2 takes of it, the root's parameters and
    # the head's gradient, the first block's reduce-scatter input; freed before the root's reduce-scatter)
    at_embedding = root_bytes + whole + (root + shared + first) * grad + whole_vocab_gradient_moment(plan, layers)
    # then the root's reduce-scatter: its input and output in the gradients' dtype beside the head's gradient, in
    # the gather's dtype (FSDP2's `param_dtype`), a bound on what is left of them
    at_reduce = root_bytes + root * grad * (1 + 1 / zero_degrees(plan)[1])
    at_end = max(at_embedding, at_reduce)
    return at_loss, params, float(max(in_blocks, at_end)), float(in_blocks), float(at_end)


def whole_vocab_gradient(plan: ir.Plan) -> bool:
    """Whether every tensor rank makes the embedding's weight gradient over the whole vocabulary: torch's tensor
    parallelism (`tensor = ... with implementation = torch`, the default: `plandsl run`'s and torchtitan's
    `RowwiseParallel(input_layouts=Replicate())` embedding) splits the embedding's vocabulary rows, and DTensor's
    `embedding_dense_backward` has no strategy that keeps them split (torch/distributed/tensor/_ops/_embedding_ops.py,
    2.6 to 2.13: replicated, hidden-split, or `Partial` over the batch-sharded tokens): each rank makes a `Partial`
    [vocab, hidden] gradient, reduced to its `Shard(0)` rows only where the gradient is reduced (FSDP2's
    `_get_grad_inner_tensor`, the optimizer's step on the shard). Megatron-LM's `VocabParallelEmbedding` masks the
    tokens outside its rows and makes its shard's gradient only. Seen in `plandsl run --dry-run --memory`'s trace of
    torch's own embedding backward (a [128,256, 16,384] fp32 accumulator on the 405B's first stage)."""
    return (plan.tp > 1 and plan.tensor is not None and plan.tensor.stack == "torch"
            and isinstance(plan.model, ir.TransformerModel))


def whole_vocab_gradient_bytes(plan: ir.Plan, layers: Sequence[Layer], extra: Sequence[Param] = (),
                               held: bool = False) -> float:
    """Bytes beyond its tensor-parallel shard of the embedding's whole-vocabulary gradient (`whole_vocab_gradient`)
    that a rank of `layers` holds through its step's backwards, where the step accumulates it unreduced: a pipeline
    stage (torch's schedules run a stage's backwards without gradient sync till its last: FSDP2's accumulator,
    `replicate`'s and a plain stage's `.grad`), a plan without data parallelism (its `.grad` kept till the next
    `zero_grad`), a replica of a plan with `batch_shares` over several microbatches (`held`: FSDP2 and, for TP's DTensor
    parameters, `replicate` under replicate and zero1, reduce after the last only: `gradient_sync`). In the gradients'
    dtype (`grad_dtype`: FSDP2 accumulates in its reduce dtype). Counted with the unsharded gradients
    (`MemoryEstimate.gathered_grads`), not the stored states. Nothing where each microbatch reduces it (DDP's
    `replicate`, FSDP2 without a pipeline): there the [vocab, hidden] gradient each backward makes is a moment of its
    own (`whole_vocab_gradient_moment`), as it is beside the accumulator.
    `extra`: a head's stage's copies of the embedding (`tied_embedding`), one of which multi-token prediction's depths
    embed their shifted tokens with (the same gradient there); a tied head's own copy computes a matmul's, split."""
    if not whole_vocab_gradient(plan):
        return 0.0
    accumulates = plan.stages is not None or plan.data is None \
        or (held and plan.num_microbatches > 1)
    if not accumulates:
        return 0.0
    tables = _embedding_tables(layers)
    if extra and getattr(plan.model, "mtp", 0) and VOCAB in extra[0].dims:  # split over its vocabulary (no rule moved it)
        tables.append(extra[0])
    beyond = sum(math.prod(p.shape) - local_numel(p, plan.tp, plan.expert_group, plan.expert_tp) for p in tables)
    return float(beyond * StateBytes.of(plan.train).grads)


def _embedding_tables(layers: Sequence[Layer]) -> list[Param]:
    """The vocabulary tables of the embeddings among `layers` (`whole_vocab_gradient_bytes`, `_moment`)."""
    return [p for layer in layers if layer.kind == "embed" for p in layer.params if VOCAB in p.dims]


def whole_vocab_gradient_moment(plan: ir.Plan, layers: Sequence[Layer]) -> float:
    """The embedding's [vocab, hidden] gradient a microbatch's backward makes on its rank under torch's tensor
    parallelism (`whole_vocab_gradient`), before it is added into the accumulator or reduced: a moment at the end of
    that microbatch's backward, one of `beyond_layers`' (counted beside every microbatch's activations in flight, its
    own freed by then: over by those). In the dtype autograd computes it in (`whole_vocab_gradient_element`). Beside
    the accumulator, where the step keeps one (`whole_vocab_gradient_bytes`) over several microbatches: a step of one
    microbatch that keeps it makes one gradient, the accumulator itself, nothing beside it (traced: one [vocab, hidden]
    storage alive, tp 2 without data parallelism). Traced on `plandsl run` at the peak of small models' first stages;
    on torchtitan's 405B first rank (bf16, 3.9 GiB) it is above the rebuilt block's 2.3 GiB. Not counted: multi-token
    prediction's copy's, at its depths' backward on the head's stage, after the loss's larger one."""
    if not whole_vocab_gradient(plan):
        return 0.0
    if plan.num_microbatches == 1 and (plan.stages is not None or plan.data is None):  # the accumulator's own
        return 0.0
    tables = _embedding_tables(layers)
    if not tables:
        return 0.0
    return float(max(math.prod(p.shape) for p in tables) * whole_vocab_gradient_element(plan))


def whole_vocab_gradient_element(plan: ir.Plan) -> float:
    """Bytes per element of the embedding's gradient as autograd makes it (`whole_vocab_gradient_moment`), the
    embedding's weight as the forward reads it (a lookup, which autocast does not cast): the plan's `gather` dtype
    under FSDP's (`gather_element_bytes`: a 16-bit one under `gather = fp8`, torchtitan's `mixed_precision_param`
    beside its Float8 all-gather, as the gathered units are counted; `plandsl run`, which applies no FP8 all-gather
    and no 16-bit gather under an FP8 precision, `ir.Plan.run_gather`, makes it in the weights' fp32 there), the
    weights' otherwise. It depends on the ZeRO stage: the search's figures key their working sets on it
    (`search.figures.Figures._activations`)."""
    return float(gather_element_bytes(plan.train, plan.data.gather if plan.data is not None else None, False,
                                      StateBytes.of(plan.train).params))


# ---- the dtype the parameters are gathered in ------------------------------------------------------------
def fp8_gather_bytes(train: ir.Training) -> float:
    """Bytes per element of a quantized linear layer's weight all-gathered in FP8 (`data = ... with gather = fp8`):
    one, and the recipe's scales where they travel with it. A per-tensor scale (delayed, current, tensorwise) is one
    float per tensor: torchao's `WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather` all-gathers the FP8 data
    alone and hands the scale, the same on every rank from the all-reduced amax, as metadata; Megatron's FP8
    parameters keep theirs beside the buffer. Blockwise carries an FP32 scale per `FP8_BLOCK` x `FP8_BLOCK` block of a
    weight, MXFP8 a one-byte scale per `MX_BLOCK` elements (`ir.Precision.gemm_bytes`)."""
    if train.precision is ir.Precision.mxfp8:
        return ir.Precision.mxfp8.gemm_bytes
    return 1.0 + (4 / ir.FP8_BLOCK ** 2 if train.recipe is ir.Fp8Recipe.blockwise else 0.0)


def fp8_weight_bytes(train: ir.Training) -> float:
    """Bytes per element a quantized linear layer's weight takes at rest as an FP8 parameter (Megatron's
    --fp8-param-gather, `fp8_model_init`): the gathered bytes (`fp8_gather_bytes`), twice under MXFP8, whose weights
    keep a row-wise and a column-wise copy, each with its own scales (a block's scale runs along one axis, so the
    forward's and the backward's GEMMs read different data): Transformer Engine makes its FP8 parameters with
    `quantizer.set_usage(rowwise=True, columnwise=torch.is_grad_enabled())` (transformer_engine/pytorch/module/
    base.py:1265 at v2.10), and megatron-core's distributed optimizer copies each gathered bf16 weight into both
    (`param.data.copy_`, distributed_data_parallel.py:486-497 at core_v0.16.1: "the paramaters are cast from bf16
    to MXFP8 during copy"). A per-tensor FP8 weight is one copy on Blackwell, whose GEMMs read either layout
    (`is_non_tn_fp8_gemm_supported`, quantizer.cpp:137: no transpose made)."""
    return fp8_gather_bytes(train) * (2 if train.precision is ir.Precision.mxfp8 else 1)


def gather_element_bytes(train: ir.Training, gather: ir.Precision | None, quantized: bool, default: float) -> float:
    """Bytes per element of a parameter as data parallelism gathers it (`data = ... with gather = DTYPE`): the
    dtype's; under `gather = fp8` a quantized linear layer's weight in FP8 (`fp8_gather_bytes`) and every other
    parameter (norms, embedding, head, blocks kept in bf16) at the compute precision's 16 bits, as torchao's FP8
    all-gather leaves the other parameters to FSDP's `MixedPrecisionPolicy` and Megatron keeps them in bf16.
    `default` when the plan names no dtype (the time's compute precision, the memory's weights' dtype)."""
    if gather is None:
        return default
    if gather is ir.Precision.fp8:
        return fp8_gather_bytes(train) if quantized else train.precision.unquantized.bytes
    return gather.bytes


def gathered_param_bytes(plan: ir.Plan, layer: Layer, default: float, tp: int, ep: int,
                         expert_tp: int | None = None, dense_only: bool = False) -> float:
    """Bytes on one device of `layer`'s parameters as gathered (`gather_element_bytes`): under `gather = fp8` the
    linear weights (two or more dims) of a block whose layers run quantized (`layer_precision`) in FP8.
    `dense_only`: of its parameters other than the experts' (a gradient bucket's, `cost.stage.bucket_element`)."""
    gather = plan.data.gather if plan.data is not None else None
    params = [p for p in layer.params if not (dense_only and is_expert_tensor(p))]
    numel = sum(local_numel(p, tp, ep, expert_tp) for p in params)
    if gather is not ir.Precision.fp8:
        return numel * gather_element_bytes(plan.train, gather, False, default)
    quantized = _quantized_numel(plan, layer, tp, ep, expert_tp, dense_only)
    return (quantized * gather_element_bytes(plan.train, gather, True, default)
            + (numel - quantized) * gather_element_bytes(plan.train, gather, False, default))


def gather_element(plan: ir.Plan, layers: Sequence[Layer], default: float) -> float:
    """Bytes per element the parameter gathers of these layers (a stage's) move on average (`gathered_param_bytes`
    over their elements): `default` when the plan names no gather dtype."""
    if plan.data is None or plan.data.gather is None:
        return default
    tp, ep, expert_tp = plan.tp, plan.expert_group, plan.expert_tp
    seen: dict = {}  # per kind of layer and its precision (a family's blocks, those kept in bf16 apart)
    elements = gathered = 0.0
    for layer in layers:
        key = (figures_key(layer), layer_precision(plan.train, plan.model, layer))
        if key not in seen:
            seen[key] = (sum(local_numel(p, tp, ep, expert_tp) for p in layer.params),
                         gathered_param_bytes(plan, layer, default, tp, ep, expert_tp))
        count, size = seen[key]
        elements, gathered = elements + count, gathered + size
    return gathered / elements if elements else gather_element_bytes(plan.train, plan.data.gather, False, default)


def module_split(layer: Layer, tp: int, ep: int, expert_tp: int | None = None) -> list[tuple[int, int]]:
    """(dense, expert) elements on one device of each module of `layer` that owns parameters, in the order
    its parameters are listed (the order they run: a block's norm, q, k, v, o, norm, the MLP)."""
    modules: dict[str, list[int]] = {}
    for param in layer.params:
        count = local_numel(param, tp, ep, expert_tp)
        slot = modules.setdefault(param.module, [0, 0])
        slot[1 if len(param.dims) == 3 and param.dims[0] == "experts" else 0] += count
    return [(dense, expert) for dense, expert in modules.values()]


def _live_units(plan: ir.Plan, layers: Sequence[Layer], root: float, gathering: ir.Gathering) -> float:
    """Elements gathered at once when units are gathered otherwise than FSDP's blocks one ahead: the most that
    one unit and the units prefetched while it computes hold; under `unit = block` beside the root's group (the
    embedding, norm and head), which FSDP2 holds gathered through each pass (`unit_moments`); under `unit = module`
    each module with parameters its own unit, the root's first. The gradients of two consecutive units live
    together (one reduce-scattering behind the next one's backward)."""
    tp, ep, expert_tp = plan.tp, plan.expert_group, plan.expert_tp
    blocks = [layer for layer in layers if layer.kind in ("block", "custom")]
    if gathering.unit is ir.GatherUnit.block:
        sizes = [sum(local_numel(p, tp, ep, expert_tp) for p in layer.params) for layer in blocks]
    else:
        sizes = ([root] if root else []) + [d + e for layer in blocks for d, e in module_split(layer, tp, ep, expert_tp)]
    held = root if gathering.unit is ir.GatherUnit.block else 0.0
    return held + max((sum(sizes[index:index + 1 + gathering.ahead(sizes, index)]) for index in range(len(sizes))),
                      default=0.0)


def pipelined_shards(plan: ir.Plan) -> bool:
    """ZeRO-2/3 under a pipeline schedule, as `plandsl run` and torchtitan run it: torch's schedules keep an FSDP
    stage's gradients unsharded and its parameters gathered after each backward until every microbatch has run,
    then reduce-scatter them once (`PipelineStage.backward_maybe_with_nosync`, `perform_reduce_grad`), and the
    parameters are not resharded after the forward either (`runtime.parallel.data_parallel.apply_dp(pipelined=
    True)`, torchtitan's default): one all-gather and one reduce-scatter per unit and step (`cost.stage.rank_tail`),
    every unit whole through the step (`gathered_bytes`)."""
    return plan.stages is not None and plan.data is not None and plan.data.zero_stage >= 2


def releases_gradients(plan: ir.Plan) -> bool:
    """Whether a pipeline rank frees each stage's unsharded gradients after that stage's last backward, not after its
    last stage's: ZeRO-2/3 under torch's pipeline (`pipelined_shards`, `implementation = torch`) running a built-in
    schedule. torch's multi-stage schedules count backwards per stage and reduce-scatter a stage's accumulated
    gradients at its last one (`PipelineScheduleMulti._step_microbatches`, `last_backward` per stage; torch 2.13's
    `_add_reduce_grad`: a REDUCE_GRAD right after a stage's n-th B or W), and so does `plandsl run`, a written schedule
    too (`runtime.parallel.pipeline.runtime_schedule` lowers its table with the same pass: its order read from the
    table, `open_gradients`). Megatron-LM's and DeepSpeed's pipelines keep the whole rank's."""
    return pipelined_shards(plan) and plan.stages.implementation == "torch"


def open_gradients(plan: ir.Plan, schedule: str, rank_stages: Sequence[Sequence[int]]) \
        -> tuple[tuple[tuple[int, ...], ...], ...] | None:
    """Per pipeline rank of `rank_stages`, the sets of its stages whose unsharded gradients it holds at once
    (`open_gradient_stages`) where the plan frees them stage by stage (`releases_gradients`) and a rank runs several;
    None where every rank holds its stages' all at once (one stage a rank, Chimera's two pipelines, sizes the
    generator refuses, a map of the stages other than the schedule's)."""
    ranks = len(rank_stages)
    stages = sum(len(own) for own in rank_stages)
    if stages <= ranks or stages % ranks or not releases_gradients(plan):
        return None
    if plan.schedule is not None and plan.schedule.definition is not None:  # a written one: its own table's order
        table, _ = plan_schedule(plan)
        groups = _open_sets(table.compute_only()) \
            if table is not None and len(table.stage_to_rank) == 1 and not table.microbatch_pipeline else None
    else:
        groups = open_gradient_stages(schedule, ranks, plan.num_microbatches, stages // ranks)
    if groups is None or any(set().union(*rank) != set(own) for rank, own in zip(groups, rank_stages)) \
            or all(len(rank) == 1 for rank in groups):
        return None
    return groups


@functools.lru_cache(maxsize=256)
def open_gradient_stages(schedule: str, pp: int, microbatches: int, virtual: int) \
        -> tuple[tuple[tuple[int, ...], ...], ...] | None:
    """Per rank of the built-in `schedule`, the largest sets of its stages open together: a stage is open from its
    first action that computes weight gradients (B, or W where the schedule splits the backward into I and W) to its
    last, after which torch reduce-scatters and frees its gradients (`releases_gradients`). Read from each rank's order
    in the layout the simulation lays out (`schedules.bounded.builtin_layout`: the steady state's order repeats, so a
    run of the same microbatches modulo its period opens the same sets, GPipe's and BFS's too); None for schedules of
    two pipelines and sizes it refuses (the whole rank's gradients then)."""
    info = BUILTIN.get(schedule)
    if info is None or info.pipelines != 1:
        return None
    try:
        layout = builtin_layout(schedule, pp, microbatches, virtual, peaks=False)
    except ValueError:  # TooLarge too
        return None
    return _open_sets(layout)


def _open_sets(layout) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """`open_gradient_stages` of a laid-out table of one pipeline: per rank, the largest sets of its stages open
    together, each from its first B or W to its last."""
    weights = (Kind.B, Kind.W)
    out = []
    for row, stages in zip(layout.actions, _own_stages(layout)):
        first: dict[int, int] = {}
        last: dict[int, int] = {}
        for index, (stage, kind, _) in enumerate(row):  # each stage's first, from the start, till every one is seen
            if kind in weights and stage not in first:
                first[stage] = index
                if len(first) == stages:
                    break
        for index in range(len(row) - 1, -1, -1):  # and its last, from the end
            stage, kind, _ = row[index]
            if kind in weights and stage not in last:
                last[stage] = index
                if len(last) == stages:
                    break
        # the open sets at each stage's opening: every largest set is one of them (intervals)
        sets = {frozenset(t for t in first if first[t] <= first[s] <= last[t]) for s in first}
        out.append(tuple(sorted(tuple(sorted(a)) for a in sets if not any(a < b for b in sets))))
    return tuple(out)


def _own_stages(layout) -> list[int]:
    """Per rank of a one-pipeline layout, how many stages it runs."""
    counts = [0] * layout.ranks
    for rank in layout.stage_to_rank[0]:
        counts[rank] += 1
    return counts


def _copies_embedding(layers: Sequence[Layer]) -> bool:
    """Whether a stage of `layers` holds a copy of the embedding's weight (`tied_embedding`): the head's without the
    embedding."""
    kinds = {layer.kind for layer in layers}
    return "head" in kinds and "embed" not in kinds


def head_weight_apart(plan: ir.Plan) -> bool:
    """Whether the head's stage, without the embedding, holds a tied head's weight apart from multi-token prediction's
    copy of the embedding: under a schedule that runs the backward as I then W, `plandsl run` gives the tied head a
    weight of its own, its gradient summed with both (`runtime.parallel.pipeline.stage_part`: as one weight, its W pass
    would run back through each depth to the copy, through nodes the I pass freed). One copy otherwise: the head's
    weight is the copy."""
    return bool(getattr(plan.model, "tied_embeddings", False) and getattr(plan.model, "mtp", 0)) \
        and plan_splits_backward(plan)


def tied_embedding(plan: ir.Plan, layers: Sequence[Layer]) -> Param | None:
    """The embedding weight a head's rank without the embedding keeps a copy of: when the model ties them, or has
    multi-token prediction, whose depths embed the shifted tokens on the head's stage (megatron-core 0.16.1 builds the
    embedding there too and ties it to the first stage's, gpt_model.py:149-157 and 829-843)."""
    if not getattr(plan.model, "tied_embeddings", False) and not getattr(plan.model, "mtp", 0):
        return None
    embed = next((layer for layer in layers if layer.kind == "embed"), None)
    # its vocabulary table: by its role, or by its name where a shard rule moved the split off the vocabulary
    return next((p for p in embed.params if VOCAB in p.dims or p.module == "embed.tok"), None) if embed else None


# ---- activations (Korthikanti et al. 2022) ---------------------------------------------
def estimate_layer_activations(plan: ir.Plan, layer: Layer, *, attention_matrix: bool = False,
                               recompute: ir.Recompute | None = None) -> float:
    """Bytes one microbatch leaves stored in `layer` for backward, on one device; `recompute`: the
    layer's own mode (`layer_recompute`), default the plan's; the s×s scores as the plan's `train.attention` says
    (or `attention_matrix`)."""
    return _layer_activations(plan, layer, plan.train.recompute if recompute is None else recompute,
                              _keeps_scores(plan, attention_matrix))


def _keeps_scores(plan: ir.Plan, attention_matrix: bool = False) -> bool:
    """Whether attention stores its s×s scores for the backward: `attention: materialized` (or asked for)."""
    return attention_matrix or plan.train.attention is ir.Attention.materialized


def is_block(plan: ir.Plan, layer: Layer) -> bool:
    """Whether `layer` is a block that recomputation reruns: a transformer block or a written (torch) model's layer,
    not its embedding or head."""
    return layer.kind == "block" or (layer.kind == "custom" and layer.name not in ("embed", "head"))


def layer_precision(train: ir.Training, model: ir.Model, layer: Layer) -> ir.Precision:
    """The precision `layer`'s linear layers run in: bf16 for a transformer block that `bf16_first_layers` or
    `bf16_last_layers` keeps so (`ir.Training.block_precision`; blocks are named `layers.{index}`), the plan's
    otherwise."""
    if layer.kind != "block" or not (train.bf16_first_layers or train.bf16_last_layers) \
            or not isinstance(model, ir.TransformerModel):
        return train.precision
    return train.block_precision(int(layer.name.rsplit(".", 1)[1]), model.layers)


def layer_recompute(plan: ir.Plan, layers: Sequence[Layer]) -> list[ir.Recompute]:
    """The recomputation of each layer of one stage (virtual chunk): the plan's mode, or with
    `recompute_layers: N` (Megatron's `--recompute-method block`) `full` for the stage's first N blocks
    and `none` for its other blocks and its non-block layers (embedding, norm, head)."""
    train = plan.train
    if train.recompute_layers is None:
        return [train.recompute] * len(layers)
    modes, index = [], 0
    for layer in layers:
        if is_block(plan, layer):
            modes.append(train.block_recompute(index))
            index += 1
        else:
            modes.append(ir.Recompute.none)
    return modes


def transformer_block_activations(model: ir.TransformerModel, seq: int, micro_batch: int, tp: int,
                                  sequence_parallel: bool, recompute: ir.Recompute,
                                  precision: ir.Precision, attention_matrix: bool = False,
                                  kv_gathered: int = 1, recipe: ir.Fp8Recipe | None = None,
                                  modules: frozenset[ir.RecomputeModule] = frozenset((ir.RecomputeModule.core_attn,)),
                                  saves_gathered: bool = False, pairs: dict[str, PairLayout] | None = None,
                                  ring: bool = False) -> float:
    """Bytes stored by one transformer block for one microbatch (Korthikanti et al. 2022, Sec. 4).

    For GPT (MHA, ffn = 4h, dropout) this is exactly the paper's Table 2, in units of s·b·h bytes
    with 16-bit activations: 34 + 5as/h; tp t: 10 + 24/t + 5as/(ht); + sequence parallel:
    34/t + 5as/(ht); selective recompute drops 5as/h; full recompute keeps the input, 2 (÷t with
    sequence parallel). The terms below are the paper's, sized from the model's own shapes.
    fp32 activations double every term. `kv_gathered`: all-gather context parallelism over that
    many ranks keeps K and V of the whole sequence for the attention backward, not the local part
    (selective recomputation reruns the core with its gather, so 1 then). Under `precision: fp8` the
    linear layers' saved inputs are FP8 (`_fp8_saved_terms`); under `mxfp8` FP8 with a 1-byte scale per 32
    elements (TE keeps the column-wise copy its weight gradient reads).
    `modules`: what `recompute: selective` reruns (`ir.Training.modules`; `_module_terms` drops their tensors).
    `saves_gathered`: under sequence parallelism the column-parallel linears save the gathered input, not their
    shard (`ir.TensorParallel.saves_gathered`: torch's tensor parallelism; `_gathered_terms`).
    `pairs`: the block's pairs a shard rule breaks (`ir.pairs.broken`), whose tensors between producers and consumer
    every tensor rank keeps whole (`_broken_terms`); `ring`: ring context parallelism runs the core (torch's
    `context_parallel` in `plandsl run`), which keeps its own output apart from the out-projection's input.
    """
    sbh = seq * micro_batch * model.hidden
    scale = precision.bytes / 2
    divisor = tp if sequence_parallel else 1
    if recompute is ir.Recompute.full:
        return 2 * sbh * scale / divisor  # Sec. 5: only the block input is kept
    if recompute is ir.Recompute.selective_op:
        return sbh * _selective_op_terms(model, tp, sequence_parallel, pairs) * scale
    terms, saved = _block_terms(model, seq, kv_gathered), _fp8_saved_terms(model)
    rerun = modules if recompute is ir.Recompute.selective else frozenset()
    if recompute is ir.Recompute.selective:
        dropped, dropped_saved = _module_terms(model, kv_gathered, modules)
        if saves_gathered and sequence_parallel and ir.RecomputeModule.layernorm in modules:
            # the norm's output that `layernorm` frees is a sequence shard torch's gather reads and no layer saves: the
            # gathered copy the next linear layers save stays (MLA's down-projections' input, a MoE block's router's)
            kept = (2.0 if model.latent_attention else 0.0) \
                + (2.0 if model.experts and ir.RecomputeModule.moe not in modules else 0.0)
            dropped = (dropped[0] - kept, dropped[1])
            dropped_saved = (dropped_saved[0] - (1.0 if model.latent_attention else 0.0), dropped_saved[1])
        terms = (terms[0] - dropped[0], terms[1] - dropped[1], terms[2])
        saved = (saved[0] - dropped_saved[0], saved[1] - dropped_saved[1])
        if ir.RecomputeModule.core_attn not in modules:
            recompute = ir.Recompute.none  # the scores stay, as without recomputation
    gathered = _gathered_terms(model, rerun) if saves_gathered else (0.0, 0.0)
    matrix_whole = False
    if pairs:  # moved from the tensor-sharded terms to those every tensor rank keeps whole, and the core's whole output
        moved, extra, moved_saved, matrix_whole = _broken_terms(model, kv_gathered, pairs, rerun,
                                                                attention_matrix or recompute is ir.Recompute.selective,
                                                                ring)
        terms = (terms[0] + moved + extra, terms[1] - moved, terms[2])
        saved = (saved[0] + moved_saved, saved[1] - moved_saved)
        gathered = (gathered[0] + moved + extra, gathered[1] + moved_saved)
    return _kept(model, terms, saved, sbh, tp, sequence_parallel, recompute, precision, attention_matrix, recipe,
                 gathered, matrix_whole)


def _broken_terms(model: ir.TransformerModel, kv_gathered: int, pairs: dict[str, PairLayout],
                  rerun: frozenset[ir.RecomputeModule], core_drops_output: bool, ring: bool = False
                  ) -> tuple[float, float, float, bool]:
    """What a block keeps whole on every tensor rank where a shard rule breaks its pairs (`ir.pairs.broken`), in
    `_block_terms`' units: (moved, the tensor-sharded terms kept whole instead; extra, whole tensors beside them; of
    `moved`, the inputs FP8 linear layers save, in `_fp8_saved_terms`' units; whether the scores are whole).

    `plandsl run` (`runtime.parallel.tensor_parallel._pair`) makes a broken pair's producers return whole outputs (a
    split producer's all-gathered) and its consumer take the whole input: the attention's Q, K and V (all heads: the
    core runs every head on every rank, its scores too) and the MLP's w1 (and w3) outputs, the activation function's
    saved inputs, are whole. The consumer's saved input is its chunk where it is split along its input features
    (`PairLayout.consumer_chunks`: RowwiseParallel reads the whole input as Replicate and takes its local chunk),
    else the whole input; a chunking wo's whole input, the core's output, is still kept by flash attention for its own
    backward (unless the core keeps its probabilities instead, `attention: materialized`, or is rerun,
    `core_drops_output`). Under ring context parallelism (`ring`) the core keeps its own output apart from wo's input
    in Megatron's layout too (torch's ring returns it [b, heads, s, d], cast from its fp32 merge; wo reads a
    transposed copy), which the default count holds as one with wo's input: breaking the pair makes that output whole,
    2o beyond its share, whatever wo's layout (traced: tests/distributed/test_memtrace.py). Selective recomputation's
    modules (`rerun`) drop theirs as `_module_terms` does: `mlp` a dense MLP's, `moe` and `shared_experts` the shared
    experts', `mla_up_proj` MLA's Q, K and V."""
    Module = ir.RecomputeModule
    hidden = model.hidden
    moved = extra = moved_saved = 0.0
    attention = pairs.get("attn")
    if attention is not None:
        widths = attention_widths(model)
        if not (model.latent_attention and Module.mla_up_proj in rerun):
            qkv = (2 * widths.q + 2 * (widths.k + widths.v) * kv_gathered) / hidden if model.latent_attention \
                else 2 * widths.q / hidden + 4 * kv_width(model) / hidden * kv_gathered
            moved += qkv
        ring_output = ring and not core_drops_output  # the ring's own output, whole whatever wo's layout
        if ring_output:
            moved += 2 * widths.o / hidden  # beside wo's chunk it stands as the default's one share
        if attention.consumer_chunks:
            extra += 0.0 if core_drops_output or ring_output else 2 * widths.o / hidden
        else:
            moved, moved_saved = moved + 2 * widths.o / hidden, moved_saved + widths.o / hidden
    for group, dropped in (("mlp", Module.mlp), ("shared", Module.shared_experts)):
        pair = pairs.get(group)
        if pair is None or dropped in rerun or (group == "shared" and Module.moe in rerun):
            continue
        ffn = model.ffn_hidden / hidden * (model.shared_experts if group == "shared" else 1)
        moved += 2 * ffn * len(pair.producers)  # the activation function's inputs: w1's (and w3's) outputs
        if not pair.consumer_chunks:
            moved, moved_saved = moved + 2 * ffn, moved_saved + ffn  # w2's input
    return moved, extra, moved_saved, attention is not None


# Under sequence parallelism torch's tensor parallelism (`ir.TensorParallel.saves_gathered`) gathers a block's
# attention input and its MLP input whole before the column-parallel linears (DTensor's `PrepareModuleInput` with
# `desired_input_layouts=Replicate()`, then `ColwiseParallel`: torchtitan's `parallelize_llama` and `plandsl run`'s
# `runtime.parallel.tensor_parallel._block_tp`), and each linear saves that gathered input for its weight gradient:
# of Korthikanti's terms outside tensor parallelism, the q/k/v input (2) and the MLP input (2) are kept whole, not
# split along the sequence (Megatron-LM's `LinearWithGradAccumulationAndAsyncCommunication` saves its shard and
# all-gathers it again in the backward, which Korthikanti et al. 2022, Sec. 4.2.2, count). Under FP8 the gathered
# copy is the quantized one (torchao's `Float8ColwiseParallel` casts before it gathers): `_kept` sizes it so. MLA's
# latents and a MoE block's router input, and what recomputation frees of them, below.
def _gathered_terms(model: ir.TransformerModel, rerun: frozenset[ir.RecomputeModule] = frozenset(),
                    mlp: bool = True) -> tuple[float, float]:
    """(bytes per s·b·h element, 16-bit; of them the inputs FP8 linear layers save, in `_fp8_saved_terms`' units) of
    Korthikanti's replicated terms that torch's tensor parallelism keeps whole under sequence parallelism
    (the comment above): the attention's gathered input (2); under MLA the down-projections' outputs too, which stay
    whole on every rank (`runtime.parallel.tensor_parallel.PAIRS`: wq_a, wkv_a duplicated on the gathered input;
    Megatron-LM's run on the sequence shard), each latent as its norm's input and as the up-projections' input (4 per
    latent element, 2 of them an FP8 input) and the shared rotary key (2), less the up-projections' inputs
    `mla_up_proj` frees; with `mlp` the MLP's gathered input (2; a MoE block's router's, which stays 16-bit), unless
    the checkpointed module gathers inside its rerun (`mlp`, a MoE block's `moe`: its input kept is the shard).
    `rerun`: the modules `recompute: selective` reruns."""
    Module = ir.RecomputeModule
    whole, fp8 = 2.0, 1.0
    if model.latent_attention:
        latents = (model.q_lora_rank + model.kv_lora_rank) / model.hidden
        whole += 4 * latents + 2 * model.qk_rope_head_dim / model.hidden
        fp8 += latents
        if Module.mla_up_proj in rerun:
            whole, fp8 = whole - 2 * latents, fp8 - latents
    if mlp and (Module.moe if model.experts else Module.mlp) not in rerun:
        whole += 2.0
        fp8 += 0.0 if model.experts else 1.0
    return whole, fp8


def _module_terms(model: ir.TransformerModel, kv_gathered: int, modules: frozenset[ir.RecomputeModule]
                  ) -> tuple[tuple[float, float], tuple[float, float]]:
    """What `recompute: selective` with `modules` drops of `_block_terms` (replicated, tensor-sharded; the scores are
    `core_attn`'s) and of `_fp8_saved_terms` (the FP8 inputs among them), as megatron-core 0.16.1 with Transformer
    Engine's layer spec (`get_gpt_layer_with_transformer_engine_spec`) runs them:

    - `layernorm` (`CheckpointWithoutOutput` around `input_layernorm` and `pre_mlp_layernorm`, the output's storage
      freed once the next layer ran, rebuilt by a hook in the backward): the norms that are modules of their own, the
      attention's under MLA (its down-projections' input, 2; under FP8 they save the 16-bit original,
      `set_for_recompute_input_layernorm`, freed too) and the MLP's in a MoE block (the router's input, 2); elsewhere
      Transformer Engine fuses the norm into the next linear layer (`TELayerNormColumnParallelLinear`,
      `input_layernorm=IdentityOp`) and nothing is dropped;
    - `moe_act` (`TEGroupedMLP`, the same checkpoint around the activation): its output, fc2's input (2·ffn per routed
      copy; under FP8 fc2 saves the original, `set_save_original_input`, freed too); fc1's output stays;
    - `mla_up_proj` (`qkv_up_proj_and_rope_apply` checkpointed, its outputs freed after the core): Q, K and V and the
      up-projections' normed latents (their fused norms' inputs, the latents, stay);
    - `mlp` (`tensor_parallel.checkpoint` around a dense block's MLP, its input kept: with the fused norm the block's
      residual, whose copy the norm keeps): the MLP's input and internals;
    - `moe` (the MoE layer checkpointed, its input, the router's, kept): the dispatched copies and every expert's
      internals, the shared experts' with them;
    - `shared_experts` (the shared experts checkpointed): their internals."""
    Module = ir.RecomputeModule
    hidden = model.hidden
    gpt = model.kind == "gpt"
    ffn = model.ffn_hidden / hidden
    mlp = (4 if gpt else 6) * ffn  # `_block_terms`' MLP internals, per dense MLP or expert visit
    replicated = sharded = saved_replicated = saved_sharded = 0.0
    if Module.layernorm in modules:
        if model.latent_attention:
            replicated, saved_replicated = replicated + 2, saved_replicated + 1.0
        if model.experts:
            replicated += 2
    if Module.mla_up_proj in modules and model.latent_attention:
        widths = attention_widths(model)
        latents = (model.q_lora_rank + model.kv_lora_rank) / hidden
        replicated, saved_replicated = replicated + 2 * latents, saved_replicated + latents
        sharded += (2 * widths.q + 2 * (widths.k + widths.v) * kv_gathered) / hidden
    if Module.mlp in modules and not model.experts:
        replicated, saved_replicated = replicated + 2, saved_replicated + 1.0
        sharded, saved_sharded = sharded + mlp, saved_sharded + ffn
    if model.experts and Module.moe in modules:
        replicated, saved_replicated = replicated + 2 * model.top_k, saved_replicated + model.top_k
        sharded += mlp * (model.top_k + model.shared_experts)
        saved_sharded += (model.top_k + model.shared_experts) * ffn
    elif model.experts:
        if Module.moe_act in modules:
            sharded, saved_sharded = sharded + 2 * ffn * model.top_k, saved_sharded + ffn * model.top_k
        if Module.shared_experts in modules:
            sharded += mlp * model.shared_experts
            saved_sharded += ffn * model.shared_experts
    return (replicated, sharded), (saved_replicated, saved_sharded)


def _kept(model: ir.TransformerModel, terms: tuple[float, float, float], saved: tuple[float, float], sbh: float,
          tp: int, sequence_parallel: bool, recompute: ir.Recompute, precision: ir.Precision, attention_matrix: bool,
          recipe: ir.Fp8Recipe | None, gathered: tuple[float, float] = (0.0, 0.0), matrix_whole: bool = False) -> float:
    """Bytes of Korthikanti's `terms` (replicated, tensor-sharded, scores per s·b·h element, 16-bit) at `precision`,
    the inputs FP8 linear layers save (`saved`, in the same units) at their own width; `gathered` (those units, the
    FP8 inputs among them) of the replicated terms, kept whole under sequence parallelism (`_gathered_terms`), FP8
    ones among them at their width too; `matrix_whole`: the scores of every head on every tensor rank (a broken
    attention pair, `_broken_terms`)."""
    replicated, sharded, matrix = terms
    gathered, gathered_saved = gathered
    scale = precision.bytes / 2
    if precision.quantized:  # each saved input's 2 bytes become gemm_bytes (mxfp8: its scales too; fp8: the recipe's)
        saving = 2 - (recipe.saved_bytes if recipe and precision is ir.Precision.fp8 else precision.gemm_bytes)
        replicated, sharded = replicated - saving * saved[0], sharded - saving * saved[1]
        gathered -= saving * gathered_saved
        # the attention core's 16-bit output beside (or instead of) the out-projection's FP8 copy of it
        sharded += _attention_output_terms(model, precision, recipe, saving,
                                           not attention_matrix and recompute is not ir.Recompute.selective)
    if not attention_matrix or recompute is ir.Recompute.selective:
        matrix = 0.0  # selective recompute (Sec. 5) recomputes exactly the attention core
    if matrix_whole:
        replicated, gathered, matrix = replicated + matrix, gathered + matrix, 0.0
    if sequence_parallel:  # Sec. 4.2.2: the replicated parts are split along the sequence too (but `gathered`)
        return sbh * ((replicated - gathered + sharded + matrix) / tp + gathered) * scale
    return sbh * (replicated + (sharded + matrix) / tp) * scale


def _attention_output_terms(model: ir.TransformerModel, precision: ir.Precision, recipe: ir.Fp8Recipe | None,
                            saving: float, core_keeps_output: bool) -> float:
    """What the attention core's output O (heads x head_dim wide, 16-bit) costs under a quantized precision beyond
    the FP8 copy `_fp8_saved_terms` counts as the out-projection's saved input, per s·b·h element, tensor-sharded.

    Transformer Engine's fused attention keeps O for its own backward: without FP8 attention (Megatron-Bridge's
    recipes set no `fp8_dot_product_attention`) `FusedAttnFunc.forward` saves `qkvo_tensors = (q, k, v, out)`, the
    16-bit output (TE v2.10, transformer_engine/pytorch/attention/dot_product_attention/backends.py:1301), as
    flash attention does; the unfused core (`attention: materialized`) keeps the probabilities and V instead, and a
    core that selective recomputation reruns (`core_attn`) keeps only its inputs. Then:

    - `fp8` under the delayed recipe (TE's DelayedScaling, the default): the out-projection (`linear_proj`, a TE
      `Linear`) saves its own quantized copy of O (transformer_engine/pytorch/module/linear.py:383-404 at v2.10,
      the column-wise data it keeps for the weight gradient), so O is held twice: 16-bit by the core, FP8 by the
      projection, 2 more bytes per element than the FP8 copy alone (for Llama 3 70B's block, 29 s·b·h, not 27);
    - every other TE recipe (`fp8` current or blockwise, `mxfp8`, `nvfp4`): megatron-core (since 0.14.0, commit
      781e765818; megatron/core/transformer/attention.py:363-379 at core_v0.16.1) calls `set_save_original_input`
      on `linear_proj` "for fp8/fp4 training, [as] the output of the fused core_attn is saved by itself", so the
      projection saves the 16-bit O itself, the core's (or, recomputed, the checkpoint's output), and no FP8 copy:
      its input costs 2 bytes, not `gemm_bytes` (Llama 3 70B's block: 28 s·b·h under `fp8_recipe: current`);
    - torchao's Float8 (`tensorwise`): as `_fp8_saved_terms` counts it (not re-read here)."""
    if not precision.quantized or recipe is ir.Fp8Recipe.tensorwise and precision is ir.Precision.fp8:
        return 0.0
    output = attention_widths(model).o / model.hidden
    if precision is ir.Precision.fp8 and recipe in (None, ir.Fp8Recipe.delayed):
        return 2 * output if core_keeps_output else 0.0
    return saving * output


def _attention_terms(model: ir.TransformerModel, seq: int, kv_gathered: int = 1) -> tuple[float, float, float]:
    """(replicated, tensor-sharded, attention-matrix) bytes per s·b·h element, 16-bit, of a block's attention half
    (Sec. 4.1): what its backward reads after the MLP's backward has freed the MLP's."""
    gpt = model.kind == "gpt"  # gpt keeps dropout masks (1 byte each); llama has no dropout
    kv = kv_width(model) / model.hidden
    dropout = 1.0 if gpt else 0.0
    # Outside tensor parallelism: the norm's input (2), the q/k/v input (2), the attention's dropout mask (1).
    replicated = 2 + 2 + dropout
    # Inside: Q (2) and K (2·kv), V (2·kv), the out-projection input (2), Q and the out-projection input
    # heads x head_dim wide where `head_dim` is not hidden/heads.
    widths = attention_widths(model)
    attention = (2 * widths.q + 2 * widths.o) / model.hidden + 4 * kv * kv_gathered
    if model.latent_attention:
        # MLA (DeepSeek-AI 2024, arXiv:2405.04434): outside tensor parallelism the latents, each kept as its
        # norm's input and as the up-projection's input (2 + 2 per element: the query latent, the key/value
        # latent) and the shared rotary key (2); inside, per head, Q and K (nope + rope), V and the output
        # (v_head_dim), each 2 bytes.
        replicated += (4 * (model.q_lora_rank + model.kv_lora_rank) + 2 * model.qk_rope_head_dim) / model.hidden
        attention = (2 * widths.q + 2 * (widths.k + widths.v) * kv_gathered + 2 * widths.o) / model.hidden
    # Scores: softmax output (2), plus gpt's dropout mask (1) and output (2): 5as/h (2as/h llama).
    matrix = (2 + 3 * dropout) * model.heads * seq / model.hidden
    return replicated, attention, matrix


def _block_terms(model: ir.TransformerModel, seq: int, kv_gathered: int = 1) -> tuple[float, float, float]:
    """(replicated, tensor-sharded, attention-matrix) bytes per s·b·h element, 16-bit (Sec. 4.1): the attention
    half's (`_attention_terms`) and the MLP half's."""
    replicated, attention, matrix = _attention_terms(model, seq, kv_gathered)
    gpt = model.kind == "gpt"
    ffn = model.ffn_hidden / model.hidden
    # The MLP half outside tensor parallelism: its norm's input (2; parallel blocks normalise the block's one input
    # for both halves, counted with the attention's), the MLP input (2), gpt's MLP dropout mask (1).
    replicated += (0 if model.parallel_blocks else 2) + 2 + (1.0 if gpt else 0.0)
    # Inside: gpt MLP: GELU input (2·ffn) and w2 input (2·ffn); llama SwiGLU: w1 and w3 outputs, w2 input.
    mlp = (4 if gpt else 6) * ffn
    if model.experts:
        # Each token visits top_k experts (load-balanced, so top_k·tokens per device): their
        # dispatched inputs next to the router's input, and their internals.
        replicated += 2 * model.top_k
        mlp *= model.top_k + model.shared_experts  # the shared experts' internals, for every token
    return replicated, attention + mlp, matrix


def _fp8_saved_terms(model: ir.TransformerModel) -> tuple[float, float]:
    """What FP8 saves of `_block_terms`, in the same units: Transformer Engine keeps the input each FP8
    linear layer saves for its weight gradient in FP8, one byte instead of two (its `Linear` and
    `LayerNormLinear` save the quantized input they already made for the forward GEMM): the q/k/v input
    (MLA: the down-projections' input and the two normed latents the up-projections read) and the MLP input
    outside tensor parallelism (SwiGLU's w1 and w3 share theirs), the out-projection input (MLA: heads x
    v_head_dim wide) and the w2 input inside. Each token's routed experts (top_k) and the shared ones save
    their own inputs."""
    hidden = model.hidden
    attention_in, attention_out = 1.0, attention_widths(model).o / hidden  # wo reads heads x head_dim
    if model.latent_attention:
        attention_in += (model.q_lora_rank + model.kv_lora_rank) / hidden
    ffn = model.ffn_hidden / hidden
    if not model.experts:
        return attention_in + 1.0, attention_out + ffn
    visits = model.top_k + model.shared_experts
    return attention_in + model.top_k, attention_out + visits * ffn


def _selective_op_terms(model: ir.TransformerModel, tp: int, sequence_parallel: bool,
                        pairs: dict[str, PairLayout] | None = None) -> float:
    """Bytes per s·b·h element, 16-bit, that `selective_op` keeps of a dense block
    (`runtime.recompute.keep_every_other_matmul`): the block input (2, ÷t with sequence
    parallelism), the 1st, 3rd, ... matmul outputs of wq, wk, wv, wo, w1, (w3,) w2 — q (2/t),
    v (2·kv/t), w1's (2·ffn/t) and, for llama, w2's before its reduction (2, whole: the partial
    sums) — the attention core's output (2/t; flash attention's log-sum-exp is per head,
    negligible) and, under sequence parallelism, the reduce-scatters after wo and w2 (2/t each).
    MoE blocks run refused (E704); they are counted as dense blocks of top_k experts. A pair a shard rule breaks
    (`pairs`, `ir.pairs.broken`): a projection whole on every tensor rank keeps its whole output (q, v, w1's; a split
    producer's kept output is its own part, gathered after), a broken attention its core's whole output; a consumer
    not split along its input features has no reduce-scatter to keep (its output whole, chunked to the sequence
    shards, or all-to-all'd there), and llama's w2 split along its output features keeps its own part (2/t)."""
    ffn = model.ffn_hidden / model.hidden * (model.top_k if model.experts else 1)
    widths = attention_widths(model)  # MLA's q, v and output widths; hidden, kv, hidden otherwise
    q, v, o = widths.q / model.hidden, widths.v / model.hidden, widths.o / model.hidden
    terms = (2 if not sequence_parallel else 2 / tp) + (2 * q + 2 * v + 2 * ffn + 2 * o) / tp
    if model.kind != "gpt":
        terms += 2
    if sequence_parallel:
        terms += 2 * 2 / tp
    whole = 0.0
    for group, pair in (pairs or {}).items():  # a whole projection's output; a broken attention's core output
        split = dict(pair.producers)
        if group == "attn":
            whole += 2 * o + sum(2 * width for names, width in ((("wq", "wq_b"), q), (("wv", "wkv_b"), v))
                                 if any(name in split and split[name] is None for name in names))
        elif group == "mlp" and split.get("w1", 0) is None:
            whole += 2 * ffn
        if pair.consumer != 1 and group in ("attn", "mlp"):
            # traced (tests/distributed/test_memtrace.py): wo or w2 whole or split along its output features makes
            # no reduce-scatter, the only collective the policy keeps (`runtime.recompute._kept_ops`)
            terms -= 2 / tp if sequence_parallel else 0.0
            terms -= (2 - 2 / tp) if group == "mlp" and pair.consumer == 0 and model.kind != "gpt" else 0.0
    return terms + whole * (1 - 1 / tp)


def _layer_activations(plan: ir.Plan, layer: Layer, recompute: ir.Recompute,
                       attention_matrix: bool, modules: frozenset[ir.RecomputeModule] | None = None) -> float:
    model = plan.model
    seq = -(-plan.seq // plan.cp)  # context parallelism splits the sequence (worst rank rounds up)
    tokens = seq * plan.train.micro_batch
    precision = layer_precision(plan.train, model, layer)  # a block a recipe keeps in bf16 saves bf16 inputs
    if isinstance(model, ir.CustomModel):
        if model.source and recompute is ir.Recompute.full and layer.name not in ("embed", "head"):
            # a torch model's block rerun whole in its backward keeps only its input (the boundary before it)
            return float(_block_input_width(model, layer) * precision.bytes * tokens)
        return layer.activation_bytes_per_token * tokens  # authored (or measured) bytes per token
    if isinstance(model, ir.MLPModel):
        # Each Linear keeps its input (weight gradient) and output (activation backward); with
        # full recompute only the input. Not tensor-parallel by default.
        out_features, in_features = layer.params[0].shape
        kept = in_features if recompute is ir.Recompute.full else in_features + out_features
        return float(tokens * kept * precision.bytes)
    tp = plan.tp
    sequence_parallel = bool(plan.tensor and plan.tensor.sequence_parallel)
    divisor = tp if sequence_parallel else 1
    sbh = tokens * model.hidden
    scale = precision.bytes / 2
    if layer.kind == "block":
        return transformer_block_activations(block_model(model, layer), seq, plan.train.micro_batch, tp,
                                             sequence_parallel, recompute, precision,
                                             attention_matrix, _kv_gathered(plan, recompute), plan.train.recipe,
                                             plan.train.modules if modules is None else modules,
                                             _saves_gathered(plan), broken(layer) if tp > 1 else None,
                                             plan.context is not None and plan.context.kind == "ring" and plan.cp > 1) \
            + expert_weight_copies(plan, layer, recompute)
    if layer.kind == "embed":
        # Sec. 4.3: embeddings keep nothing large but gpt's embedding dropout mask (1 byte); the
        # embedding output is kept as the first block's input, counted there.
        return sbh * (1.0 if model.kind == "gpt" else 0.0) * scale / divisor
    if layer.kind == "norm":
        return 2 * sbh * scale / divisor  # Sec. 4.3: the final norm keeps its input
    if layer.kind == "head":
        # Sec. 4.3: the head keeps its input (2sbh) and the cross entropy fp32 logits (4sbV/t); a fused loss keeps
        # the 16-bit logits instead (`ir.Loss`). Under sequence parallelism the input is whole on torch's tensor
        # parallelism: `ColwiseParallel(input_layouts=Shard(1))` (torchtitan's and `plandsl run`'s output layer)
        # all-gathers the sequence and its linear saves that gathered input for the weight gradient; Megatron's
        # column-parallel layer saves its shard and gathers again in the backward (Korthikanti's 2sbh/t).
        # A head whose rule keeps the vocabulary whole (`replicate`, rowwise: `ir.pairs.table_split`) makes the whole
        # logits on every rank (`plandsl run`: no loss parallel, `tensor_parallel.splits_logits`).
        logit = precision.unquantized.bytes if plan.train.loss is ir.Loss.fused else 4.0
        shard = divisor if plan.tensor is not None and not plan.tensor.saves_gathered else 1
        vocab = -(-model.vocab // tp) if table_split(layer) == 0 else model.vocab
        head = 2 * sbh * scale / shard + logit * tokens * vocab
        # each depth's block as the rules place it (`ir.pairs.mtp_blocks`: the last block's unless a rule breaks a pair)
        return head + sum(depths * (head + _mtp_activations(plan, recompute, attention_matrix, modules, block))
                          for block, depths in mtp_blocks(model, layer))
    return 0.0


def _mtp_activations(plan: ir.Plan, recompute: ir.Recompute, attention_matrix: bool,
                     modules: frozenset[ir.RecomputeModule] | None, block: Layer | None = None) -> float:
    """Bytes one multi-token prediction depth keeps for one microbatch beside its pass of the output layer (the
    head's, counted by the caller): its block's as a block of the last block's kind under the head's recomputation
    (megatron-core 0.16.1 checkpoints the depth under full recomputation, multi_token_prediction.py:823-858), and the
    inputs its element-wise layers and projection save, 2sbh bytes each (Korthikanti et al. 2022, Sec. 4.3's norm),
    1/t under sequence parallelism: enorm's and hnorm's, the concatenation `eh_proj` reads (two) and the final norm's;
    none but the block's input under full recomputation."""
    model = plan.model
    block = layers_of(model)[model.layers] if block is None else block  # the last block (`ir.layers.mtp_block`)
    precision = plan.train.mtp_precision  # the global FP8 context, not the last block's (bf16_last_layers)
    if precision is not layer_precision(plan.train, model, block):
        plan = plan.model_copy(update={"train": plan.train.model_copy(update={
            "precision": precision, "bf16_first_layers": 0, "bf16_last_layers": 0})})
    kept = _layer_activations(plan, block, recompute, attention_matrix, modules)
    sequence_parallel = bool(plan.tensor and plan.tensor.sequence_parallel)
    sbh = -(-plan.seq // plan.cp) * plan.train.micro_batch * model.hidden
    scale = precision.bytes / 2
    if recompute is ir.Recompute.full:
        return kept
    # enorm's, hnorm's and the final norm's inputs on the sequence shards; `eh_proj`'s (two of the five) whole where
    # torch's tensor parallelism gathers it (`runtime.parallel.tensor_parallel.apply_tp`: `PrepareModuleInputOutput`)
    whole = 2 if _saves_gathered(plan) else 0
    return kept + ((5 - whole) / (plan.tp if sequence_parallel else 1) + whole) * 2 * sbh * scale


def loss_backward_bytes(plan: ir.Plan, layers: Sequence[Layer]) -> float:
    """The loss's backward on the rank holding a transformer's head: beside the fp32 log-probabilities
    the cross entropy keeps (the head's 4sbV/t, counted in its activations), it makes the gradient of
    those and then of the fp32 logits, two more fp32 tensors of the logits' shape, alive together
    (torch's `log_softmax_backward`); over vocabulary-sharded logits (tp > 1) torch's loss parallel makes three
    (`LOSS_PARALLEL_TEMPORARIES`). A peak of the moment the backward starts, as the block the
    recomputation rebuilds is of a later moment: the larger of the two counts (`estimate_memory`)."""
    per_logit, logits = _loss_backward_logits(plan, layers)
    return per_logit * logits


def _loss_backward_logits(plan: ir.Plan, layers: Sequence[Layer]) -> tuple[float, float]:
    """`loss_backward_bytes`' (bytes per logit, the rank's logits); (0, 0) where it counts none."""
    if not isinstance(plan.model, ir.TransformerModel) or not any(layer.kind == "head" for layer in layers) \
            or plan.train.loss is ir.Loss.fused:  # a fused loss writes the logits' gradient in place
        return 0.0, 0.0
    tokens = -(-plan.seq // plan.cp) * plan.train.micro_batch
    # a head whose rule keeps the vocabulary whole: the whole logits, torch's plain cross entropy (`ir.pairs.table_split`)
    split = plan.tp > 1 and table_split(next(layer for layer in layers if layer.kind == "head")) == 0
    # Megatron's own loss multiplies its saved softmax in place and casts it back: the 16-bit gradient only
    per_logit = plan.train.precision.unquantized.bytes if plan.train.loss is ir.Loss.megatron \
        else LOSS_PARALLEL_TEMPORARIES * 4.0 if split else 2 * 4.0
    return per_logit, tokens * (-(-plan.model.vocab // plan.tp) if split else plan.model.vocab)


def loss_released_bytes(plan: ir.Plan, layers: Sequence[Layer]) -> float:
    """What of the loss's backward (`loss_backward_bytes`) and the head's saved activations is freed by the time the
    head's backward starts (where ZeRO-3 gathers the root again, `unit_moments`): all but the logits' fp32 gradient
    and, in a 16-bit precision, its copy in the compute dtype (the head's output gradient); with them torch's cross
    entropy's saved fp32 log-probabilities (the head's 4sbV/t, `_layer_activations`), which its backward's node
    releases once it has made the logits' gradient (traced at tp 2: loss parallel's saved `sub` freed before the
    root's all-gather for the head's backward). Megatron's loss turns its saved softmax into the gradient in place."""
    per_logit, logits = _loss_backward_logits(plan, layers)
    kept = 4.0 + (plan.train.precision.unquantized.bytes if plan.train.precision.unquantized.bytes < 4 else 0.0)
    saved = 0.0 if plan.train.loss is ir.Loss.megatron else 4.0
    return max(0.0, per_logit + saved - kept) * logits


def ring_backward_bytes(plan: ir.Plan, layer: Layer) -> float:
    """What torch's ring attention (`context = ring over cp with implementation = torch`: torch's `context_parallel`,
    torchtitan's) allocates in one block's attention backward beyond the tensors the block saved, on one rank at a
    step after the first (`_templated_ring_attention_backward` with torchtitan's rotate method, `allgather`, for K
    and V and the all-to-all rotater for dK and dV, `convert_to_f32` on; torch 2.6 to 2.13):

    - K and V of every rank, all-gathered once (`_AllGatherRotater._aggregated_buffer`): cp x the rank's K and V;
    - the rank's K and V concatenated for the rotater (`next_kv = torch.cat(...)`, remade every step but the last);
    - dQ accumulated in fp32 (`grad_query = zeros_like(query, dtype=float32)`);
    - three fp32 copies of dK and dV: the accumulated ones (`grad_key`, `grad_value`), their concatenation being sent
      (`next_grad_kv = torch.cat(...)`) and the buffer the next rank's arrive in (`permute_tensor`'s output);
    - the step's kernel's 16-bit dQ, dK and dV (`grad_query_`, `grad_key_`, `grad_value_`, kept to the next step).

    K and V as the model hands them to SDPA: torchtitan's Llama repeats them to the query heads (`repeat_kv`), as wide
    as Q and the output (`cost.ring.estimate_ring`); MLA's at their own widths. The forward's transients (the gathered
    K and V, fp32 output and log-sum-exp merges) are fewer. 0 for a plan without torch's ring."""
    context, model = plan.context, plan.model
    if context is None or context.kind != "ring" or context.implementation != "torch" or plan.cp <= 1 \
            or not isinstance(model, ir.TransformerModel) or layer.kind != "block":
        return 0.0
    block = block_model(model, layer)
    widths = attention_widths(block)
    kv = widths.k + widths.v if block.latent_attention else widths.q + widths.o
    tokens = plan.train.micro_batch * -(-plan.seq // plan.cp)
    queries, keys = tokens * widths.q / plan.tp, tokens * kv / plan.tp
    e = layer_precision(plan.train, model, layer).unquantized.bytes
    return e * (plan.cp + 1) * keys + 4.0 * queries + 3 * 4.0 * keys + e * (queries + keys)


def _ring_working_set(plan: ir.Plan, layer: Layer, recompute: ir.Recompute, attention_matrix: bool) -> float:
    """A block's backward under torch's ring, beyond what its microbatches in flight keep: the ring's transients
    (`ring_backward_bytes`) and, when recomputation rebuilt the block, what it rebuilt of the attention half, whose
    backward the ring's is (the MLP's backward ran first and freed the MLP's); at most the block rebuilt."""
    transient = ring_backward_bytes(plan, layer)
    if not transient or recompute not in (ir.Recompute.full, ir.Recompute.selective_op):
        return transient
    rebuilt = _layer_activations(plan, layer, ir.Recompute.none, attention_matrix) \
        - _layer_activations(plan, layer, recompute, attention_matrix)
    return transient + min(rebuilt, _attention_half(plan, layer, attention_matrix)
                           - _layer_activations(plan, layer, ir.Recompute.full, attention_matrix))


def _attention_half(plan: ir.Plan, layer: Layer, attention_matrix: bool) -> float:
    """Bytes a transformer block's attention half keeps for one microbatch without recomputation (`_attention_terms`,
    its FP8 linears' inputs at their width), on one device."""
    model = block_model(plan.model, layer)
    seq = -(-plan.seq // plan.cp)
    widths = attention_widths(model)
    saved = 1.0 + ((model.q_lora_rank + model.kv_lora_rank) / model.hidden if model.latent_attention else 0.0), \
        widths.o / model.hidden  # `_fp8_saved_terms`' attention inputs
    return _kept(model, _attention_terms(model, seq, _kv_gathered(plan, ir.Recompute.none)), saved,
                 seq * plan.train.micro_batch * model.hidden, plan.tp,
                 bool(plan.tensor and plan.tensor.sequence_parallel), ir.Recompute.none,
                 layer_precision(plan.train, plan.model, layer), attention_matrix, plan.train.recipe,
                 _gathered_terms(model, mlp=False) if _saves_gathered(plan) else (0.0, 0.0))  # the attention's


# torch's cross entropy over vocabulary-sharded logits (`torch.distributed.tensor.parallel.loss_parallel`, which
# torchtitan enables whenever the tensor axis splits the vocabulary) computes the backward of nll_loss and
# log_softmax together (`_nll_loss_and_log_softmax_backward`): `grad_input = zeros_like(x)`, then
# `(grad_input + torch.exp(x)) * grad_output`. Beside the saved log-probabilities x, three fp32 tensors of their
# shape are alive at once: grad_input, exp(x) and their sum while it is made, grad_input, the sum and the product
# while that is (one more than `log_softmax_backward`'s two).
LOSS_PARALLEL_TEMPORARIES = 3


LAST_STAGE_KINDS = ("norm", "head")
"""The layers of a transformer's last stage after its blocks, whose microbatches in flight are the last stage's
(`head_inflight`), not its rank's."""


def head_inflight(schedule: str, rank_inflight: float) -> float:
    """Microbatches in flight through the last stage's norm and head. The schedules of the 1F1B family run a
    microbatch's backward on the last stage right after its forward (Narayanan et al. 2021, Fig. 4: the last
    rank's warm-up is its other virtual stages' forwards; ZB-H1/H2's last stage likewise), so one is in flight
    there whatever the rank's average over its virtual stages says (`inflight_microbatches`: an interleaved last
    rank holds ((v - 1)·pp + 1)/v microbatches of its layers, but all of them on its earlier virtual stages).
    GPipe-like schedules (`every`) hold every microbatch there; Chimera's rank-average rule is kept."""
    info = BUILTIN.get(schedule)
    rule = info.inflight if info is not None else "depth"
    return rank_inflight if rule in ("every", "two_pipelines") else min(1.0, rank_inflight)


def torch_stage_bytes(plan: ir.Plan, stages: int, own: Sequence[int], inflight: float, head: float) -> float:
    """What torch's `PipelineStage` (torch 2.13, `torch.distributed.pipelining.stage`, as `plandsl run` and torchtitan's
    trainer drive it: `step(..., return_outputs=False)`) holds on a pipeline rank beyond its layers' saved activations,
    for the stages `own` it runs of `stages`, `inflight` microbatches of each in flight (`inflight_microbatches`, the
    rank's average over its stages) and `head` on the last stage (`head_inflight`); 0 on Megatron-LM's pipeline, which
    frees an output once sent (`deallocate_output_tensor`) and receives into a fresh tensor one at a time. Per stage,
    for m microbatches of b boundary bytes (the blocks' output: tokens x hidden at the activations' 16-bit width, over
    t with sequence parallelism, as torch sends the local shard):

    - a stage after the first: a receive buffer per microbatch (`_setup_forward_recv_info`, allocated once, kept across
      steps): m·b, of which the microbatches in flight are the stage's first block's saved input, counted with the
      layers: (m - inflight)·b;
    - a stage before the last: a gradient receive buffer per microbatch (`_create_grad_recv_info`, kept likewise): m·b,
      and each microbatch's output until its backward (`forward_one_chunk`'s `fwd_cache`; no layer of the stage saves
      it, the next stage's first block saves its received copy): inflight·b;
    - the last stage: its output until its backward (`fwd_cache`), head x the 16-bit logits (tokens x vocab/t), which
      nothing else keeps (the loss saves its fp32 log-probabilities); none under a fused loss, where the stage returns
      its final hidden states, which the loss (`plandsl run`'s schedule calls the head in it) saves and the head's
      activations count.

    With `outputs = returned` (`step(return_outputs=True)`, torch's default, and what torchtitan's torch of late 2024
    always did: its `forward_one_chunk` appended every output to `output_chunks`, cleared at the next step's start) the
    last stage keeps every microbatch's output to the step's end: m outputs at its last microbatch's backward, the
    m - head beyond those in flight counted here (their merge at the step's end: `returned_merge_bytes`); under a fused
    loss those outputs are the final hidden states, a boundary each (`returned_output_bytes`), which the head's
    activations hold only for the microbatches in flight.

    Not counted: the input gradients (`stage_backward` drops them from the inputs, `bwd_cache` is popped by the next
    send: transient, as in Megatron-LM); torch 2.6 kept them to the step's end, and every stage's outputs in
    `output_chunks`, which no option of torch 2.13 does."""
    sizes = torch_stage_sizes(plan)
    if sizes is None or stages < 2 or not own:
        return 0.0
    boundary, output, m = sizes
    after_first, before_last = _stage_ends(own, stages)
    total = after_first * max(0.0, m - inflight) * boundary + before_last * (m + min(inflight, m)) * boundary
    if stages - 1 in own:
        total += head * output
        if plan.stages.outputs == "returned":  # the outputs `output_chunks` keeps beyond those in flight
            total += max(0.0, m - head) * returned_output_bytes(plan, boundary, output)
    return total


def returned_output_bytes(plan: ir.Plan, boundary: float, output: float) -> float:
    """One microbatch's output that torch's last stage keeps in `output_chunks` under `outputs = returned`: its
    logits (`output`, `torch_stage_sizes`), or under a fused loss (`runtime.loss.fused_loss`: the stage returns its
    final hidden states and the loss calls the head on them) the final hidden states, a boundary's bytes."""
    return boundary if plan.train.loss is ir.Loss.fused else output


def returned_merge_bytes(plan: ir.Plan, stages: int, own: Sequence[int]) -> float:
    """What a rank holding the last stage of torch's pipeline keeps beside its stored states when the step returns the
    last stage's outputs (`outputs = returned`): `_merge_outputs` concatenates the m outputs `output_chunks` kept
    (`merge_chunks`, a `torch.cat`) after the last backward, when the layers' activations are freed and FSDP's units
    resharded and reduced: the m outputs, their merge, and the receive buffers (`torch_stage_bytes`). 0 for a rank
    without the last stage, with the outputs dropped, or where nothing of torch's pipeline is counted."""
    sizes = torch_stage_sizes(plan)
    if sizes is None or stages < 2 or stages - 1 not in own or plan.stages.outputs != "returned":
        return 0.0
    boundary, output, m = sizes
    after_first, before_last = _stage_ends(own, stages)
    return (after_first + before_last) * m * boundary + 2 * m * returned_output_bytes(plan, boundary, output)


def _stage_ends(own: Sequence[int], stages: int) -> tuple[int, int]:
    """Of a rank's stages `own` (of `stages`): how many come after the first (each keeps a receive buffer per
    microbatch) and how many before the last (a gradient receive buffer per microbatch, and its outputs)."""
    return sum(1 for stage in own if stage > 0), sum(1 for stage in own if stage < stages - 1)


def torch_stage_sizes(plan: ir.Plan) -> tuple[float, float, int] | None:
    """(boundary bytes, the last stage's output bytes, microbatches) of one microbatch through torch's pipeline
    (`torch_stage_bytes`), or None where nothing of it is counted: Megatron-LM's pipeline, no stages, a model other
    than a transformer (whose boundaries the model does not size)."""
    model = plan.model
    if plan.stages is None or plan.stages.implementation != "torch" or not isinstance(model, ir.TransformerModel):
        return None
    tokens = -(-plan.seq // plan.cp) * plan.train.micro_batch
    e = plan.train.precision.unquantized.bytes
    sequence_parallel = bool(plan.tensor and plan.tensor.sequence_parallel)
    boundary = tokens * model.hidden * e / (plan.tp if sequence_parallel else 1)
    # the logits over the vocabulary's slice, or all of it where the head's rule keeps it whole (`ir.pairs.table_split`)
    head = next(layer for layer in reversed(ruled_layers(plan, layers_of(model))) if layer.kind == "head")
    vocab = -(-model.vocab // plan.tp) if table_split(head) == 0 else model.vocab
    output = 0.0 if plan.train.loss is ir.Loss.fused else e * tokens * vocab
    return boundary, output, plan.num_microbatches


def _block_input_width(model: ir.CustomModel, layer: Layer) -> int:
    """Elements per token entering a torch model's block: the output of the layer before it."""
    names = [authored.name for authored in model.layers]
    index = names.index(layer.name) if layer.name in names else 0
    return model.layers[index - 1].output if index > 0 else layer.output_width


def _saves_gathered(plan: ir.Plan) -> bool:
    """Whether the plan's column-parallel linears save their gathered input (`ir.TensorParallel.saves_gathered`)."""
    return plan.tensor is not None and plan.tp > 1 and plan.tensor.saves_gathered


def _kv_gathered(plan: ir.Plan, recompute: ir.Recompute) -> int:
    """Over how many ranks' sequences a block keeps K and V: all-gather context parallelism keeps the
    gathered ones, unless recomputation reruns the core (and its gather) in the backward."""
    rerun = recompute is not ir.Recompute.none and (recompute is not ir.Recompute.selective
                                                    or ir.RecomputeModule.core_attn in plan.train.modules)
    return plan.cp if gathers_kv(plan) and not rerun else 1


def gathers_kv(plan: ir.Plan) -> bool:
    """Whether the plan's context parallelism all-gathers K and V (`allgather`) rather than rotating them."""
    return plan.context is not None and plan.context.kind == "allgather" and plan.cp > 1


def _recompute_working_set(plan: ir.Plan, layers: Sequence[Layer], attention_matrix: bool) -> float:
    """With full (or selective_op) recompute, backward rebuilds one block at a time: its activations,
    once per rank (Korthikanti et al. 2022, Sec. 5: 2sbhL plus the memory of one recomputed layer)."""
    recompute = plan.train.recompute
    if recompute is ir.Recompute.selective and plan.train.modules - {ir.RecomputeModule.core_attn} \
            and isinstance(plan.model, ir.TransformerModel):
        # the modules rebuild in the backward what they dropped: at most a block's worth, once per rank
        blocks = [layer for layer in layers if layer.kind == "block"]
        attention_core = plan.train.modules & {ir.RecomputeModule.core_attn}
        return max((_layer_activations(plan, b, recompute, attention_matrix, attention_core)
                    - _layer_activations(plan, b, recompute, attention_matrix) for b in blocks), default=0.0)
    if recompute not in (ir.Recompute.full, ir.Recompute.selective_op):
        return 0.0
    blocks = [layer for layer in layers if layer.kind in ("block", "custom")]
    if isinstance(plan.model, ir.CustomModel) and plan.model.source and recompute is ir.Recompute.full:
        blocks = [layer for layer in blocks if layer.name not in ("embed", "head")]  # a torch model's blocks
    elif isinstance(plan.model, ir.CustomModel):
        return 0.0
    if not blocks:
        return 0.0
    seen: dict = {}  # per precision: a block a recipe keeps in bf16 keeps more than its family's others
    return max(once_per_figures(seen.setdefault(layer_precision(plan.train, plan.model, b), {}), b,
                                lambda b: _layer_activations(plan, b, ir.Recompute.none, attention_matrix)
                                - _layer_activations(plan, b, recompute, attention_matrix)) for b in blocks)


__all__ = ["MemoryEstimate", "estimate_memory", "inflight_microbatches", "estimate_layer_activations", "layer_recompute",
           "held_stages", "gathered_bytes", "gather_element", "gather_element_bytes", "gathered_param_bytes",
           "fp8_gather_bytes", "fp8_weight_bytes", "megatron_fsdp_shards", "gathers_whole", "pipelined_shards",
           "releases_gradients", "open_gradients", "open_gradient_stages",
           "whole_vocab_gradient", "whole_vocab_gradient_bytes", "whole_vocab_gradient_moment",
           "whole_vocab_gradient_element", "replicates_units", "replicate_copy_bytes", "data_split_gathered",
           "returned_merge_bytes", "returned_output_bytes", "model_state_bytes",
           "tied_embedding", "head_weight_apart",
           "transformer_block_activations", "optimizer_bytes_per_param", "local_numel",
           "zero_degrees", "zero_one_elements", "gathers_kv", "STATE_BYTES", "StateBytes", "FP32_STATES", "module_split",
           "head_inflight", "beyond_layers", "LAST_STAGE_KINDS", "LOSS_PARALLEL_TEMPORARIES",
           "ring_backward_bytes", "torch_stage_bytes", "torch_stage_sizes", "layer_offload", "offload_inflight",
           "holds_autocast_copies", "autocast_weight_copies", "expert_weight_copies",
           "one_backward_makes_gradients", "one_backward_apart", "optimizer_step_bytes",
           "fused_head_gradient_bytes", "gathers_by_moments", "unit_moments", "gathered_moments", "fsdp_apart",
           "loss_released_bytes"]


def estimate_plan_memory(plan: ir.Plan, assignment: Assignment | None = None,
                         held: bool = False) -> list[MemoryEstimate] | None:
    """Per pipeline rank memory, or None when the placement is invalid; `held`: ZeRO-2/3 units kept gathered
    through the step (one replica of a plan with `batch_shares`, `gathered_bytes`)."""
    if assignment is None:
        assignment, problems = assign_stages(plan)
        if assignment is None:
            return None
    ranks = assignment.rank_stages()
    schedule = plan.schedule.name if plan.schedule and plan.stages else DEFAULT_SCHEDULE  # as lowering fills it in
    inflight = inflight_microbatches(schedule, len(ranks), plan.num_microbatches, assignment.virtual) \
        if plan.stages else [1]
    return estimate_memory(plan, assignment.stage_layers, ranks, inflight, held=held)
