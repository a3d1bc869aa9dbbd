"""A checked plan -> torchtitan's command-line arguments (torchtitan 0.3.0), and what they cannot say.

Stage: interop, beside render. Contract: `export_plan(plan)` returns the arguments as a bash array and one E808
per part of the plan torchtitan cannot express; it never raises on a checked plan. torchtitan 0.3.0 picks the
model and its defaults with `--module llama3 --config FUNCTION` (a config_registry function: model sizes are
registry flavors, not flags) and overrides them with `--SECTION.KEY VALUE` (tyro), the activation checkpointing
policy last, as a subcommand. Facts are torchtitan 0.3.0's (config/configs.py, trainer.py,
distributed/{parallel_dims,pipeline_parallel,activation_checkpoint}.py, models/llama3/{__init__,
config_registry}.py), shared with the import (`torchtitan_import`); tests/unit/test_interop_torchtitan.py holds
them against torchtitan's own ConfigManager and ParallelDims.
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass

from plandsl import ir
from plandsl.diagnostics import Diagnostic, diag
from plandsl.interop.result import Exported, loser
from plandsl.ir.placement import assign_stages

TARGET = "torchtitan"
VERSION = "torchtitan 0.3.0"
MODULE = "llama3"


@dataclass(frozen=True)
class Flavor:
    """A llama3 config_registry function's model (models/llama3/__init__.py's registry flavor)."""
    flavor: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    tied: bool = False   # Llama3Model.Config.enable_weight_tying (only 1B and 3B tie, and no config builds them)


# The config functions of models/llama3/config_registry.py whose model ConfigManager builds with torchtitan's own
# dependencies (llama3_405b adds a Float8 converter that needs torchao, and 1B/3B have no config function).
CONFIGS = {
    "llama3_debugmodel": Flavor("debugmodel", layers=6, hidden=256, heads=16, kv_heads=16, ffn=768, vocab=2048),
    "llama3_8b": Flavor("8B", layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256),
    "llama3_70b": Flavor("70B", layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=128256),
}
# The other llama3 config functions of 0.3.0 (config_registry.py) and what a plan cannot say of them.
OTHER_CONFIGS = {
    "llama3_405b": "torchao's Float8 linears with the rowwise recipe (Float8LinearConverter), which no plan's fp8_recipe is",
    "llama3_debugmodel_float8": "torchao's Float8 linears with the rowwise recipe, which no plan's fp8_recipe is",
    "llama3_debugmodel_float8_emulate_lora": "emulated Float8 linears and LoRA adapters",
    "llama3_8b_mxfp8": "torchao's MXFP8 linears (MXFP8LinearConverter)",
    "llama3_debugmodel_nvfp4": "NVFP4 linears (NVFP4LinearConverter)",
    "llama3_debugmodel_first_85_pct_layers_nvfp4": "NVFP4 linears in the first 85 % of the blocks",
    "llama3_8b_first_85_pct_layers_nvfp4": "NVFP4 linears in the first 85 % of the blocks",
    "llama3_debugmodel_varlen_attn": "variable-length (per-document) attention",
    "llama3_debugmodel_dist_gemm": "attention projections fused with their tensor-parallel collectives (dist_gemm)",
    "llama3_debugmodel_ce_loss": "the debug model's own unchunked loss (use llama3_debugmodel --loss.num_chunks 1)",
    "sft_debugmodel": "fine-tuning on chat data with FlexAttention document masks",
}
# ParallelDims' world mesh, outermost first (parallel_dims.py: ["pp", "dp_replicate", "dp_shard", "cp", "tp"]).
MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
DEGREES = {"pp": "--parallelism.pipeline_parallel_degree", "dp_replicate":
           "--parallelism.data_parallel_replicate_degree", "dp_shard": "--parallelism.data_parallel_shard_degree",
           "cp": "--parallelism.context_parallel_degree", "tp": "--parallelism.tensor_parallel_degree"}
EXPERT_DEGREE = "--parallelism.expert_parallel_degree"
# plandsl's built-in schedule -> torch's schedule name (get_schedule_class), which torchtitan passes through.
SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": "Interleaved1F1B", "looped_bfs": "LoopedBFS",
             "interleaved_zero_bubble": "InterleavedZeroBubble", "zbv": "ZBVZeroBubble", "dualpipev": "DualPipeV"}
SINGLE_STAGE = ("GPipe", "1F1B")   # PipelineScheduleSingle: one stage per rank
# Two stages per rank placed as a V (pipeline_parallel.py:559-572, which asserts the two).
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")
# plandsl's recompute -> torchtitan's activation checkpointing subcommand (ActivationCheckpointingConfig):
# SelectiveAC is op-level (keeps matmuls and attention, recomputes every other matmul): plandsl's selective_op.
RECOMPUTE = {ir.Recompute.none: "none", ir.Recompute.selective_op: "selective", ir.Recompute.full: "full"}
SUBCOMMAND = "activation-checkpoint:"
# torch.compile over the model and the loss (CompileConfig: enable, components ["model", "loss"]): a plan's
# `kernels: fused`; without it torchtitan runs eager, `kernels: eager`.
COMPILE = "--compile.enable"
COMPILE_COMPONENTS = "--compile.components"
# Async tensor parallelism (CompileConfig.enable_async_tensor_parallel: torch's micro-pipeline TP pass, which
# "requires 'model' in --compile.components and --compile.enable"): a plan's `tensor ... with overlap`.
ASYNC_TP = "--compile.enable_async_tensor_parallel"
# The config functions' loss (ChunkedLossWrapper, components/loss.py:567-606): the last norm's output split along
# the sequence into num_chunks (8) pieces, lm_head and the cross entropy run on each, its backward right after it,
# so at most one chunk's logits are alive (16-bit, the fp32 copy and their gradients: about 2 bytes per logit of the
# microbatch over 8 chunks). A plan's `loss: fused` (16-bit logits held, no fp32 copy; `plandsl run` chunks it too)
# is that; one chunk is the whole fp32 cross entropy (cross_entropy_loss: `.float()`), a plan's `loss: standard`.
LOSS_CHUNKS = "--loss.num_chunks"
CHUNKS = 8   # ChunkedLossWrapper.Config.num_chunks
COMPILE_BACKEND = "--compile.backend"   # inductor fuses (`kernels: fused`); another backend is no plan's kernels
# torchtitan 0.3.0 applies FSDP2 at every data-parallel degree (models/llama3/parallelize.py:69-90, "Always run
# apply_fsdp_to_decoder -- with shard_degree=1 it is a no-op for the all-gather but still installs the
# MixedPrecisionPolicy"): fully_shard over dp_shard (and cp), replicated over dp_replicate, with
# MixedPrecisionPolicy(param_dtype=mixed_precision_param, reduce_dtype=mixed_precision_reduce) (distributed/
# fsdp.py:165-170; distributed/full_dtensor.py:70-106 names the shard and replicate axes). No DDP: a plan's
# `replicate` is not what it runs, dp_replicate alone is HSDP with a shard of 1 (torch 2.14's FSDP2 still copies
# each unit into its unsharded buffer in param_dtype at a shard of 1, _fsdp_param_group.py:447-470).
# Its reshard policy (fsdp.py:54-78): "default" reshards after the forward but under a pipeline, as a plan's
# ZeRO-3 does (`cost.memory.pipelined_shards`); "always" under a pipeline and "never" without one are not a plan's.
RESHARD = "--parallelism.fsdp_reshard_after_forward"
CPU_OFFLOAD = "--training.enable_cpu_offload"   # FSDP2's CPUOffloadPolicy: parameters, gradients, optimizer states
SYMM_MEM = "--parallelism.enable_fsdp_symm_mem"  # FSDP2's symmetric-memory collectives
OPTIMIZER_NAME = "--optimizer.param_groups.0.optimizer_name"   # Adam, AdamW, DistMuon (components/optimizer)
# SelectiveAC.Config.force_recompute_mm_shapes_by_fqns: matmuls always recomputed; its default names the MoE
# router, which llama3 has not (distributed/activation_checkpoint.py:196).
FORCE_RECOMPUTE = "--activation_checkpoint.force_recompute_mm_shapes_by_fqns"
# The pipeline's split without module_fqns_per_model_part (distributed/pipeline_parallel.py:194-264, 366-476):
# stages of pipeline_parallel_layers_per_stage blocks, else 1 (single-stage schedules) or 2 per rank; the embedding
# and the output count as this many blocks each.
LAYERS_PER_STAGE = "--parallelism.pipeline_parallel_layers_per_stage"
LESS_LAYERS = ("--parallelism.pipeline_parallel_first_stage_less_layers",
               "--parallelism.pipeline_parallel_last_stage_less_layers")
# LR schedules: warm-up, then the plan's decay over the rest of training (decay_ratio None), or none (0.0).
DECAY = {"cosine": "cosine", "linear": "linear"}
# The module names of a llama3 model, for module_fqns_per_model_part (Llama3Model: tok_embeddings, layers.N,
# norm, lm_head).
MODULES = {"embed": "tok_embeddings", "norm": "norm", "head": "lm_head"}
LR = "--optimizer.param_groups.0.optimizer_kwargs.lr"
WEIGHT_DECAY = "--optimizer.param_groups.0.optimizer_kwargs.weight_decay"   # default_adamw's is 0.1; plandsl's 0


def config_of(model: ir.Model) -> str | None:
    """The config function whose registry model is `model` (sizes and tying), None when none is."""
    if not isinstance(model, ir.TransformerModel) or model.kind != "llama" or model.experts or model.parallel_blocks \
            or model.latent_attention or model.head_dim or model.window or model.sinks or model.mtp:
        return None
    for name, flavor in CONFIGS.items():
        if (model.layers, model.hidden, model.heads, model.kv_heads, model.ffn_hidden, model.vocab,
                model.tied_embeddings) == (flavor.layers, flavor.hidden, flavor.heads, flavor.kv_heads, flavor.ffn,
                                           flavor.vocab, flavor.tied):
            return name
    return None


def export_plan(plan: ir.Plan) -> Exported:
    """`plan` as torchtitan arguments, and an E808 for each part of it they cannot express."""
    args: list[tuple[str, str | None]] = []
    lost: list[Diagnostic] = []

    lose = loser(plan, "torchtitan", lost)

    config = config_of(plan.model)
    if config is None:
        lose(f"{_model_text(plan.model)}: its models are registry flavors chosen by --config, and "
             f"{MODULE}'s are {', '.join(f'{n} ({f.flavor})' for n, f in CONFIGS.items())}", "model",
             hint="use models/llama3's llama3_8b or llama3_70b, or the sizes of a flavor (docs/interop.md)")
        config = _nearest(plan.model)
    args += [("--module", MODULE), ("--config", config)]
    degrees = _parallel_args(plan, args, lose)
    _train_args(plan, args, lose, degrees)
    if plan.train.batch_shares is not None:
        lose("batch_shares (uneven data-parallel shares: every data rank takes the same local batch)", "train")
    if plan.data is not None and not plan.data.gathering.default:
        lose("the data line's gathering (`with unit`, `prefetch`, `prefetch_bucket`): torchtitan wraps each block "
             "in FSDP2 and prefetches one ahead", "data", hint="drop the with clause: FSDP's blocks one ahead")
    gather = plan.data.gather if plan.data is not None else None
    if plan.data is None or plan.data.kind is ir.DataKind.replicate:  # FSDP2 at every degree (RESHARD's note)
        lose(("no data line" if plan.data is None else "data = replicate") + " (torchtitan 0.3.0 has no DDP: it "
             "applies FSDP2 at every data-parallel degree, fully_shard over dp_shard, replicated over "
             "dp_replicate, and gathers each unit in --training.mixed_precision_param)", "data",
             hint="data = hsdp over [replica, shard] with a shard axis of 1 (zero3 over a dp axis of 1 without data "
             "parallelism)" + (", with gather = bf16" if _mixed(plan) else ""))
    elif plan.data.kind.zero_stage == 3 and gather is None and _mixed(plan):
        lose("bf16 over fp32 weights without `gather = bf16` (torchtitan's FSDP2 gathers bf16 copies, "
             "MixedPrecisionPolicy(param_dtype=bfloat16), and computes with them: no autocast copies)", "data",
             hint="add `with gather = bf16`")
    if gather is not None and gather is not plan.train.precision.unquantized:
        # FSDP2's MixedPrecisionPolicy(param_dtype=training.mixed_precision_param): the compute dtype is the gather's
        lose(f"gather = {gather.value} (torchtitan gathers in its --training.mixed_precision_param, the dtype it "
             "computes in" + ("; the FP8 all-gather is torchao's float8 converter's, which the export does not write"
                              if gather is ir.Precision.fp8 else "") + ")", "data", hint="drop `with gather`")
    lost.extend(diag("E808", f"torchtitan cannot express shard rule `{rule.target.text}` (its tensor parallelism "
                     "is the model's own plan: --parallelism.tensor_parallel_degree)", rule.span)
                for rule in plan.shard)
    lines = [f"# torchtitan arguments ({VERSION}) of plan '{plan.name}' (plandsl export --to torchtitan):",
             f"# {plan.mesh.size} processes; torchrun ... -m torchtitan.train \"${{TORCHTITAN_ARGS[@]}}\"",
             "TORCHTITAN_ARGS=("]
    lines += [f"    {flag}" + "".join(f" {shlex.quote(word)}" for word in _words(value)) for flag, value in args]
    return Exported(TARGET, "\n".join(lines + [")"]) + "\n", tuple(lost))


def _mixed(plan: ir.Plan) -> bool:
    """bf16 compute over fp32 weights: --training.mixed_precision_param bfloat16 --training.dtype float32."""
    return plan.train.precision is ir.Precision.bf16 and plan.train.weights_dtype is ir.Precision.fp32


def _words(value: str | tuple[str, ...] | None) -> tuple[str, ...]:
    return () if value is None else (value,) if isinstance(value, str) else value


def _model_text(model: ir.Model) -> str:
    if not isinstance(model, ir.TransformerModel):
        return f"a {model.kind} model"
    if model.kind != "llama":
        return f"a {model.kind}(...) model (torchtitan's {MODULE} is RMSNorm, SwiGLU, rotary, no biases)"
    if model.parallel_blocks:
        return f"parallel blocks (GPT-NeoX's parallel residual; {MODULE}'s blocks are sequential)"
    if model.latent_attention:
        return f"multi-head latent attention (kv_lora_rank={model.kv_lora_rank}; {MODULE}'s attention is grouped-query " \
               "attention: DeepSeek's are torchtitan's deepseek_v3 module)"
    if model.head_dim:
        return f"head_dim={model.head_dim} ({MODULE}'s heads are hidden / heads wide)"
    if model.window or model.sinks:
        return f"sliding-window attention or attention sinks ({MODULE}'s attention is causal over the whole " \
               "sequence; torchtitan's gpt_oss module has GPT-OSS's own)"
    if model.mtp:
        return f"multi-token prediction (mtp={model.mtp}; {MODULE}'s models predict the next token only)"
    if model.experts:
        return f"a mixture of {model.experts} experts ({MODULE} is dense; --parallelism.expert_parallel_degree " \
               "is for other modules' MoE models)"
    return (f"llama(layers={model.layers}, hidden={model.hidden}, heads={model.heads}, kv_heads={model.kv_heads}, "
            f"ffn={model.ffn_hidden}, vocab={model.vocab}{'' if not model.tied_embeddings else ', tied=true'})")


def _nearest(model: ir.Model) -> str:
    """The config written for --lossy: the flavor nearest in width, then depth."""
    if not isinstance(model, ir.TransformerModel):
        return "llama3_debugmodel"
    return min(CONFIGS, key=lambda n: (abs(CONFIGS[n].hidden - model.hidden), abs(CONFIGS[n].layers - model.layers)))


def _parallel_args(plan: ir.Plan, args: list, lose) -> dict[str, int]:
    """The --parallelism.* degrees (all written: a config function sets its own), the pipeline's split and
    schedule; returns the degrees by torchtitan's axis name."""
    roles = plan.axis_roles()
    degrees = dict.fromkeys(MESH_ORDER, 1)
    written: list[str] = []   # torchtitan's axis of each plan mesh axis of size > 1, outermost first
    data = plan.data
    for axis in plan.mesh.axes:
        if axis.size == 1:
            continue
        role = roles.get(axis.name)
        if role is None:
            lose(f"mesh axis '{axis.name}', which only shard rules use", "mesh")
            continue
        if role == "ep":
            lose(f"expert parallelism over '{axis.name}' ({MODULE} has no experts)", "experts")
            continue
        if role == "dp":
            shard = data.kind is not ir.DataKind.replicate and (not data.hybrid or axis.name == data.axes[-1])
            role = "dp_shard" if shard else "dp_replicate"
        degrees[role] *= axis.size
        written.append(role)
    order = [role for index, role in enumerate(written) if index == 0 or written[index - 1] != role]
    if order != [role for role in MESH_ORDER if role in order]:
        shown = ", ".join(f"{a.name}({r})" for a, r in zip([a for a in plan.mesh.axes if a.size > 1], written))
        lose(f"the mesh order [{shown}] (torchtitan lays ranks out outermost first as pp, dp_replicate, dp_shard, "
             "cp, tp)", "mesh", hint="order the mesh [pp, dp, cp, tp]")
    if data is not None and data.kind in (ir.DataKind.zero1, ir.DataKind.zero2):
        lose(f"data = {data.kind} (torchtitan has no ZeRO-1 or ZeRO-2: its FSDP, "
             "--parallelism.data_parallel_shard_degree, shards parameters too, as zero3 does)", "data",
             hint="use data = zero3 (or hsdp, or replicate)")
    args += [(DEGREES[role], str(degrees[role])) for role in ("dp_replicate", "dp_shard", "tp")]
    if degrees["tp"] > 1:
        sequence = plan.tensor.sequence_parallel
        args.append(("--parallelism.enable_sequence_parallel" if sequence else
                     "--parallelism.no_enable_sequence_parallel", None))
        if plan.tensor.userbuffers:
            lose("overlap = userbuffers (Transformer Engine's userbuffers: torchtitan overlaps tensor-parallel "
                 "communication only with torch's async TP, --compile.enable_async_tensor_parallel)", "tensor",
                 hint="`overlap = async_tp` (or `overlap`), priced as torchtitan runs it")
        elif plan.tensor.overlap:  # the checker's E417 leaves it with sequence parallelism and compiled kernels
            args.append((ASYNC_TP, None))
        if sequence and plan.tensor.stack == "megatron" and not plan.tensor.userbuffers:  # said apart above
            lose("implementation = megatron (Megatron-LM's tensor parallelism, whose column-parallel layers save their "
                 "sequence shard: torchtitan splits a block with torch's DTensor styles, which save the gathered "
                 "input)", "tensor", hint="drop `implementation = megatron`, priced as torchtitan runs it")
    args.append((DEGREES["cp"], str(degrees["cp"])))
    if plan.context is not None and plan.cp > 1 and (plan.context.kind, plan.context.implementation) != ("ring", "torch"):
        said = "allgather" if plan.context.kind == "allgather" else f"ring with implementation = {plan.context.implementation}"
        lose(f"context = {said} (torchtitan runs torch's context_parallel: a ring whose K and V are all-gathered once "
             "per pass and whose outputs and gradients are merged step by step, `ring ... with implementation = "
             "torch`)", "context", hint="use context = ring over cp with implementation = torch")
    args += [(EXPERT_DEGREE, "1"), (DEGREES["pp"], str(degrees["pp"]))]
    if plan.stages is not None and (plan.pp > 1 or plan.stages.virtual > 1):
        _pipeline_args(plan, args, lose)
    return degrees


def _pipeline_args(plan: ir.Plan, args: list, lose) -> None:
    stages = plan.stages
    if stages.implementation != "torch":  # torchtitan drives torch.distributed.pipelining's stages
        lose(f"stages with implementation = {stages.implementation} (torchtitan runs torch's pipeline, whose stages "
             "keep a receive buffer per microbatch and each output until its backward: more memory)", "stages",
             hint=f"drop `implementation = {stages.implementation}`: torch's pipeline is the default")
    if stages.outputs == "returned":  # torchtitan's trainer steps with return_outputs=False (trainer.py)
        lose("stages with outputs = returned (torchtitan's trainer drops the last stage's outputs, "
             "`step(..., return_outputs=False)`: less memory)", "stages", hint="drop `outputs = returned`")
    name = plan.schedule.name if plan.schedule is not None else "1f1b"
    schedule = SCHEDULES.get(name) if plan.schedule is None or plan.schedule.definition is None else None
    if schedule is None:
        lose(f"schedule = {name} (torchtitan runs torch's schedule classes, {', '.join(SCHEDULES.values())}, or a "
             "CSV file: --parallelism.pipeline_parallel_schedule_csv)", "schedule",
             hint="export the schedule with `plandsl export --to torch-csv` and pass its file")
        schedule = "1F1B" if stages.virtual == 1 else "Interleaved1F1B"
    # pipeline_llm places stages on ranks as torch's schedule does: round robin, V-shape for ZBV and DualPipeV
    style = "vshape" if schedule in V_SHAPED else "loop"
    if stages.rank_map != style:
        shown = stages.rank_map if isinstance(stages.rank_map, str) else list(stages.rank_map)
        lose(f"the stage-to-rank map {shown} with {schedule} (torchtitan places its stages {style})", "stages",
             hint=f"use map = {style}")
    args.append(("--parallelism.pipeline_parallel_schedule", schedule))
    args.append(("--parallelism.pipeline_parallel_microbatch_size", str(plan.train.micro_batch)))
    assignment, _ = assign_stages(plan)
    if assignment is not None:  # one comma-separated list per stage (ConfigManager's list[str] rule)
        parts = [",".join(MODULES.get(layer.kind, layer.name) for layer in layers)
                 for layers in assignment.stage_layers]
        args.append(("--parallelism.module_fqns_per_model_part", tuple(parts)))


def _train_args(plan: ir.Plan, args: list, lose, degrees: dict[str, int]) -> None:
    train = plan.train
    dp = degrees["dp_replicate"] * degrees["dp_shard"]
    if degrees["pp"] > 1:  # the pipeline splits the local batch into microbatches (pipeline_parallel.py)
        local = train.global_batch // dp
    else:                  # gradient accumulation: global_batch_size / (local_batch_size x dp) steps
        local = train.micro_batch
    args += [("--training.local_batch_size", str(local)), ("--training.global_batch_size", str(train.global_batch)),
             ("--training.seq_len", str(plan.seq)),
             # clip_grad_norm_ with max_norm; plandsl's grad_clip none is no clipping: an infinite norm
             ("--training.max_norm", repr(float(train.grad_clip)) if train.grad_clip is not None else "inf")]
    if degrees["pp"] > 1:  # Trainer.Config._validate_cuda_graphs: "CUDA graphs do not support pipeline parallelism"
        args.append(("--training.disable_cuda_graphs", None))
    if train.precision in (ir.Precision.bf16, ir.Precision.fp32):
        args.append(("--training.mixed_precision_param", "bfloat16" if train.precision is ir.Precision.bf16
                     else "float32"))
    else:
        lose(f"precision: {train.precision.value} (torchtitan trains in bfloat16 or float32; its float8 and MX "
             "(mxfp8) linears are model converters of other config functions)", "train", hint="use precision: bf16")
    dtypes = {key: getattr(train, key) for key in ir.KEPT_DTYPE_KEYS}
    if all(value is ir.Precision.bf16 for value in dtypes.values()) and train.precision is ir.Precision.bf16:
        args.append(("--training.dtype", "bfloat16"))  # everything bf16, no fp32 copy (TrainingConfig.dtype)
    else:
        if train.given_dtypes():
            kept = ", ".join(f"{k}: {v.value}" for k, v in train.given_dtypes().items())
            lose(f"{kept} (torchtitan keeps fp32 weights, gradients and optimizer states, or, with --training.dtype "
                 "bfloat16, all three in bf16)", "train")
        args.append(("--training.dtype", "float32"))
    if train.optimizer is not ir.Optimizer.adam:
        lose(f"optimizer: {train.optimizer.value} (the config functions build AdamW)", "train",
             hint="use optimizer: adam")
    args += [(LR, repr(float(train.lr))), (WEIGHT_DECAY, "0.0"),
             ("--lr_scheduler.warmup_steps", str(train.warmup_steps))]
    if train.lr_schedule == "constant":
        args.append(("--lr_scheduler.decay_ratio", "0.0"))  # no decay steps: warm-up, then stable
    else:
        args += [("--lr_scheduler.decay_ratio", "None"), ("--lr_scheduler.decay_type", DECAY[train.lr_schedule]),
                 ("--lr_scheduler.min_lr_factor", "0.0")]
    args.append(("--debug.seed", str(train.seed)))
    if train.kernels is ir.Kernels.fused:  # the fused element-wise kernels the plan was costed with: torch.compile's
        args.append((COMPILE, None))       # (CompileConfig: components model and loss); eager is its default
    if train.loss is ir.Loss.megatron:
        lose("loss: megatron (Megatron-LM's op-by-op cross entropy; torchtitan's is torch's, chunked: loss: fused, "
             "or in one piece: loss: standard)", "train", hint="use loss: fused (torchtitan's default)")
    args.append((LOSS_CHUNKS, str(CHUNKS if train.loss is ir.Loss.fused else 1)))
    if train.attention is ir.Attention.materialized:
        lose("attention: materialized (torchtitan's attention is SDPA's fused kernel)", "train",
             hint="drop attention, or write attention: flash")
    mode = RECOMPUTE.get(train.recompute)
    if mode is None or train.recompute_layers is not None:
        what = f"recompute: {train.recompute.value}" + (f", recompute_layers: {train.recompute_layers}"
                                                        if train.recompute_layers is not None else "")
        lose(f"{what} (torchtitan checkpoints every block, fully or op by op: none, selective (= plandsl's "
             "selective_op), full)", "train", hint="use recompute: selective_op or full")
        mode = mode or "selective"
    args.append((SUBCOMMAND + mode, None))
    if train.offload_layers:  # torchtitan offloads FSDP's parameters (--training.enable_cpu_offload), no activations
        lose(f"offload_layers: {train.offload_layers} (torchtitan keeps every saved activation on the device; its CPU "
             "offload moves FSDP's parameters, gradients and optimizer states)", "train",
             hint="drop offload_layers, or export to megatron")
