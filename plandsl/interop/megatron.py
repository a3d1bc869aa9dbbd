"""A checked plan -> Megatron-LM's command-line arguments (megatron-core 0.16.1), and what they cannot say.

Stage: interop, beside render. Contract: `export_plan(plan)` returns the arguments as a bash array (the way
Megatron-LM's example scripts group them) and one E808 per part of the plan Megatron cannot express; it
never raises on a checked plan. Every fact is megatron-core 0.16.1's (tag core_v0.16.1 of NVIDIA/Megatron-LM),
cited where it is used; tests/unit/test_interop_megatron.py holds them against megatron-core's own code.
The flag table (`FLAGS`) is shared with the import (`megatron_import`).
"""
from __future__ import annotations

import shlex

from plandsl import ir
from plandsl.diagnostics import Diagnostic, diag
from plandsl.interop.result import Exported, loser
from plandsl.ir.placement import assign_stages
from plandsl.schedules.registry import megatron_microbatch_group, megatron_microbatches_fit

TARGET = "megatron"
VERSION = "megatron-core 0.16.1"

# Megatron's rank order, innermost first (megatron/training/initialize.py, `initialize_model_parallel(order=
# 'tp-cp-ep-dp-pp' if not args.use_tp_pp_dp_mapping else 'tp-cp-ep-pp-dp')`; parallel_state.RankGenerator).
ORDER = ("tp", "cp", "ep", "dp", "pp")
ORDER_TP_PP_DP = ("tp", "cp", "ep", "pp", "dp")

# Every flag the adapters read or write, by the kind of value it takes. Names are Megatron-LM's
# (megatron/training/arguments.py, and the flags it generates from TransformerConfig/ModelParallelConfig
# fields: `--field-name`, a bool field defaulting to False a switch).
INT_FLAGS = (
    "--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads", "--num-query-groups", "--kv-channels",
    "--seq-length", "--max-position-embeddings", "--padded-vocab-size", "--vocab-size",
    "--make-vocab-size-divisible-by", "--num-experts", "--moe-router-topk", "--moe-shared-expert-intermediate-size",
    "--micro-batch-size", "--global-batch-size", "--recompute-num-layers", "--lr-warmup-iters", "--seed",
    "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--num-virtual-stages-per-pipeline-rank",
    "--num-layers-per-virtual-pipeline-stage", "--decoder-first-pipeline-num-layers",
    "--decoder-last-pipeline-num-layers", "--context-parallel-size", "--expert-model-parallel-size",
    # ModelParallelConfig.microbatch_group_size_per_vp_stage: the microbatches interleaved 1F1B runs per virtual stage
    # in turn (default pp); schedules.py takes it in [pp, m], its last group 0 or at least pp
    "--microbatch-group-size-per-virtual-pipeline-stage",
    "--expert-tensor-parallel-size", "--num-distributed-optimizer-instances",
    # multi-head latent attention (MLATransformerConfig: q_lora_rank, kv_lora_rank, qk_head_dim = plandsl's
    # qk_nope_head_dim, qk_pos_emb_head_dim = qk_rope_head_dim, v_head_dim) and the MoE layers' own width
    "--q-lora-rank", "--kv-lora-rank", "--qk-head-dim", "--qk-pos-emb-head-dim", "--v-head-dim", "--moe-ffn-hidden-size",
    # the blocks an FP8 or FP4 recipe keeps in bf16, with --first-last-layers-bf16 (TransformerConfig, default 1 each)
    "--num-layers-at-start-in-bf16", "--num-layers-at-end-in-bf16",
    # the blocks whose activations go to the CPU (ModelParallelConfig.cpu_offloading_num_layers; > 0 sets
    # cpu_offloading, arguments.py's validate_args; no --cpu-offloading flag: the field is left out of the parser)
    "--cpu-offloading-num-layers",
    # multi-token prediction's depths (TransformerConfig.mtp_num_layers; megatron-core 0.16.1 multi_token_prediction.py)
    "--mtp-num-layers",
    # group-limited routing (TransformerConfig.moe_router_num_groups, moe_router_group_topk:
    # moe_utils.group_limited_topk)
    "--moe-router-num-groups", "--moe-router-group-topk",
)
FLOAT_FLAGS = ("--lr", "--clip-grad")
CHOICE_FLAGS: dict[str, tuple[str, ...]] = {
    "--normalization": ("LayerNorm", "RMSNorm"),
    "--position-embedding-type": ("learned_absolute", "rope", "mrope", "relative", "none"),
    "--recompute-granularity": ("full", "selective"),
    "--recompute-method": ("uniform", "block"),
    # TransformerConfig.cp_comm_type: "p2p", "all_gather", "a2a", "a2a+p2p" (transformer_config.py; the
    # --help text of arguments.py says "allgather", which Transformer Engine refuses)
    "--cp-comm-type": ("p2p", "all_gather", "a2a", "a2a+p2p"),
    "--data-parallel-sharding-strategy": ("no_shard", "optim", "optim_grads", "optim_grads_params"),
    "--optimizer": ("adam", "sgd", "muon", "dist_muon"),
    "--lr-decay-style": ("constant", "linear", "cosine", "inverse-square-root", "WSD"),
    "--ckpt-format": ("torch", "torch_dist", "zarr", "torch_dcp", "fsdp_dtensor"),
    # the precision-aware optimizer (OptimizerConfig: main_params_dtype, main_grads_dtype, exp_avg_dtype,
    # exp_avg_sq_dtype), with --use-precision-aware-optimizer: Adam and the distributed optimizer only
    # Transformer Engine's FP8 for the blocks' linear layers (TransformerConfig.fp8), beside --bf16
    "--fp8-format": ("e4m3", "hybrid"),
    # its scaling (TransformerConfig.fp8_recipe, default delayed): mxfp8 is MXFP8BlockScaling (Blackwell)
    "--fp8-recipe": ("tensorwise", "delayed", "mxfp8", "blockwise", "custom"),
    # Transformer Engine's FP4 (TransformerConfig.fp4, fp4_recipe): NVFP4BlockScaling (Blackwell), beside --bf16
    "--fp4-format": ("e2m1",),
    "--fp4-recipe": ("nvfp4", "custom"),
    # TransformerConfig.moe_token_dispatcher_type and moe_flex_dispatcher_backend: a plan's `experts = alltoall` is
    # the alltoall dispatcher (allgather's moves the same tokens and is read as it), `deepep`/`hybridep` flex's
    "--moe-token-dispatcher-type": ("allgather", "alltoall", "flex"),
    "--moe-flex-dispatcher-backend": ("deepep", "hybridep"),
    "--main-params-dtype": ("fp32", "fp16"),
    "--main-grads-dtype": ("fp32", "bf16"),
    "--exp-avg-dtype": ("fp32", "fp16", "bf16", "fp8"),
    "--exp-avg-sq-dtype": ("fp32", "fp16", "bf16", "fp8"),
    # MLATransformerConfig.rope_type: MLA takes YaRN by default; plandsl's rotary positions are plain rope
    "--rope-type": ("rope", "yarn"),
    # TransformerConfig.attention_backend (AttnBackend): flash, cuDNN's fused, auto (Transformer Engine picks one of
    # them) are a plan's `attention: flash`; unfused (TE's) and local (Megatron's own core) write the s x s scores
    # through memory, `attention: materialized`
    "--attention-backend": ("flash", "fused", "unfused", "local", "auto"),
    # TransformerConfig.softmax_type (through ArgumentGroupFactory): learnable is one offset per head in the softmax's
    # denominator (softmax_offset), a plan's attention sinks
    "--softmax-type": ("vanilla", "off-by-one", "learnable"),
    # ModelParallelConfig.cross_entropy_fusion_impl (model_parallel_config.py:246, through ArgumentGroupFactory), read
    # with --cross-entropy-loss-fusion: native is Megatron-Core's jit-fused cross entropy, te Transformer Engine's
    "--cross-entropy-fusion-impl": ("native", "te"),
}
MATERIALIZED_BACKENDS = ("unfused", "local")
# A plan's train key -> the precision-aware optimizer's flags that say it
DTYPE_FLAGS = {"master_dtype": ("--main-params-dtype",), "grad_dtype": ("--main-grads-dtype",),
               "optimizer_dtype": ("--exp-avg-dtype", "--exp-avg-sq-dtype")}
# --moe-layer-freq: an int N (one MoE layer every N) or a Python list expression of 0 (dense) and 1 (MoE) per layer,
# "([0]*3+[1]*58)" (TransformerConfig.moe_layer_freq, Megatron-LM's moe_freq_type)
# sliding-window attention: --window-size "LEFT,RIGHT" (arguments.py's tuple_type; TransformerConfig.window_size) and
# --window-attn-skip-freq, an int N (every N-th layer full) or a 0/1 list per layer, 1 windowed (moe_freq_type)
TEXT_FLAGS = ("--pipeline-model-parallel-layout", "--moe-layer-freq", "--window-size", "--window-attn-skip-freq")
# --recompute-modules: TransformerConfig.recompute_modules, a list (argparse nargs="+", argument_utils.py)
LIST_FLAGS = {"--recompute-modules": tuple(m.value for m in ir.RecomputeModule)}
SWITCHES = (
    "--bf16", "--fp16", "--swiglu", "--untie-embeddings-and-output-weights", "--group-query-attention",
    "--disable-bias-linear", "--use-rotary-position-embeddings", "--recompute-activations",
    "--sequence-parallel", "--use-distributed-optimizer", "--use-megatron-fsdp", "--use-tp-pp-dp-mapping",
    "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
    "--use-precision-aware-optimizer", "--multi-latent-attention", "--overlap-moe-expert-parallel-comm",
    "--delay-wgrad-compute", "--tp-comm-overlap", "--moe-enable-deepep", "--cross-entropy-loss-fusion",
    "--first-last-layers-bf16", "--fp8-param-gather",
)
# Flags of Megatron-LM's launch scripts that mean nothing in a plan (data, tokenizer, logging, checkpoints,
# initialisation, fusions, kernels, the optimizer's other constants): read, listed, left out.
IGNORED = (
    "--data-path", "--split", "--vocab-file", "--merge-file", "--tokenizer-type", "--tokenizer-model", "--mock-data",
    "--train-iters", "--train-samples", "--rampup-batch-size", "--min-lr", "--lr-decay-iters", "--lr-decay-samples",
    "--lr-warmup-fraction", "--lr-warmup-samples", "--weight-decay", "--adam-beta1", "--adam-beta2", "--adam-eps",
    "--init-method-std", "--attention-dropout", "--hidden-dropout", "--log-interval", "--save-interval",
    "--eval-interval", "--eval-iters", "--save", "--load", "--tensorboard-dir", "--wandb-project", "--log-throughput",
    "--transformer-impl", "--use-mcore-models", "--use-flash-attn", "--distributed-backend",
    "--overlap-grad-reduce", "--overlap-param-gather", "--no-masked-softmax-fusion",
    "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-gradient-accumulation-fusion", "--rotary-base",
    "--rotary-percent", "--moe-grouped-gemm", "--moe-aux-loss-coeff",
    "--moe-router-load-balancing-type", "--exit-duration-in-mins", "--timing-log-level",
    "--distributed-timeout-minutes", "--rotary-scaling-factor", "--mscale", "--mscale-all-dim",
    "--moe-router-score-function", "--moe-router-enable-expert-bias", "--moe-router-topk-scaling-factor",
    "--moe-router-pre-softmax", "--moe-router-dtype",
    # Transformer Engine's userbuffers configuration file (per-layer SM counts, methods, splits): a plan's
    # `overlap = userbuffers` prices TE's defaults (`initialize_ub`); the file is named as left out
    "--tp-comm-overlap-cfg",
    # multi-token prediction's loss weight (TransformerConfig.mtp_loss_scaling_factor, default 0.1): it scales a loss,
    # no FLOP, byte or message
    "--mtp-loss-scaling-factor",
)

# plandsl's training precision -> Megatron's switch (ModelParallelConfig.bf16 / .fp16; fp32 is neither).
PRECISION_SWITCH = {ir.Precision.bf16: "--bf16", ir.Precision.fp16: "--fp16"}
# A data-parallel kind -> Megatron's arguments: ZeRO-1 is the distributed optimizer; ZeRO-2/3 are Megatron-FSDP's
# sharding strategies (arguments.py: --data-parallel-sharding-strategy), which need --ckpt-format fsdp_dtensor
# ("Megatron FSDP only supports fsdp_dtensor checkpoint format", validate_args).
DATA_ARGS: dict[ir.DataKind, tuple[tuple[str, str | None], ...]] = {
    ir.DataKind.replicate: (),
    ir.DataKind.zero1: (("--use-distributed-optimizer", None),),
    ir.DataKind.zero2: (("--use-megatron-fsdp", None), ("--data-parallel-sharding-strategy", "optim_grads"),
                        ("--ckpt-format", "fsdp_dtensor")),
    ir.DataKind.zero3: (("--use-megatron-fsdp", None), ("--data-parallel-sharding-strategy", "optim_grads_params"),
                        ("--ckpt-format", "fsdp_dtensor")),
}
SHARDING_KIND = {"no_shard": ir.DataKind.replicate, "optim": ir.DataKind.zero1, "optim_grads": ir.DataKind.zero2,
                 "optim_grads_params": ir.DataKind.zero3}
CONTEXT_COMM = {"allgather": "all_gather", "ring": "p2p"}   # plandsl's kind -> --cp-comm-type
# A plan's FP8 recipe -> Megatron's --fp8-recipe (TransformerConfig.fp8_recipe, Fp8Recipe; fp8_utils.get_fp8_recipe:
# delayed -> TE's DelayedScaling, tensorwise -> Float8CurrentScaling, blockwise -> Float8BlockScaling) and the
# --fp8-format its recipes take (Megatron-Bridge's bf16_with_fp8_*_mixed: hybrid for each). torchao's tensorwise
# dynamic scaling (`fp8_recipe: tensorwise`) is no recipe of Megatron's: Megatron's `tensorwise` is TE's current scaling.
FP8_RECIPES = {ir.Fp8Recipe.delayed: "delayed", ir.Fp8Recipe.current: "tensorwise", ir.Fp8Recipe.blockwise: "blockwise"}
LR_STYLES = ("constant", "cosine", "linear")                 # the --lr-decay-style values plandsl has


def export_plan(plan: ir.Plan) -> Exported:
    """`plan` as Megatron-LM arguments, and an E808 for each part of it they cannot express."""
    args: list[tuple[str, str | None]] = []
    lost: list[Diagnostic] = []

    lose = loser(plan, "Megatron-LM", lost)

    _model_args(plan, args, lose)
    _train_args(plan, args, lose)
    _parallel_args(plan, args, lose)
    if plan.train.batch_shares is not None:
        lose("batch_shares (uneven data-parallel shares: every data rank takes --global-batch-size / dp)", "train")
    if plan.data is not None and not plan.data.gathering.default:
        lose("the data line's gathering (`with unit`, `prefetch`, `prefetch_bucket`): Megatron-LM gathers by its own "
             "buckets", "data", hint="drop the with clause: FSDP's blocks one ahead")
    lost.extend(diag("E808", f"Megatron-LM cannot express shard rule `{rule.target.text}` (its tensor parallelism "
                     "is the model's own split: --tensor-model-parallel-size)", rule.span) for rule in plan.shard)
    lines = [f"# Megatron-LM arguments ({VERSION}) of plan '{plan.name}' (plandsl export --to megatron):",
             f"# {plan.mesh.size} processes; torchrun ... pretrain_gpt.py \"${{MEGATRON_ARGS[@]}}\"",
             "MEGATRON_ARGS=("]
    lines += [f"    {flag}" + ("" if value is None else f" {shlex.quote(value)}" if isinstance(value, str)
                                  else "".join(f" {shlex.quote(v)}" for v in value)) for flag, value in args]
    return Exported(TARGET, "\n".join(lines + [")"]) + "\n", tuple(lost))


def _model_args(plan: ir.Plan, args: list, lose) -> None:
    model = plan.model
    if not isinstance(model, ir.TransformerModel):
        lose(f"a {model.kind} model (only gpt(...) and llama(...) are Megatron's GPTModel)", "model")
        return
    # with dense layers, --ffn-hidden-size is the dense layers' MLP and --moe-ffn-hidden-size the experts'
    dense = model.mixed_blocks
    args += [("--num-layers", str(model.layers)), ("--hidden-size", str(model.hidden)),
             ("--ffn-hidden-size", str(model.dense_ffn if dense else model.ffn_hidden)),
             ("--num-attention-heads", str(model.heads))]
    if model.latent_attention:
        args += [("--multi-latent-attention", None)]
        if model.q_lora_rank:  # Megatron-LM's default None: queries projected directly, as without it here
            args.append(("--q-lora-rank", str(model.q_lora_rank)))
        args += [("--kv-lora-rank", str(model.kv_lora_rank)), ("--qk-head-dim", str(model.qk_nope_head_dim)),
                 ("--qk-pos-emb-head-dim", str(model.qk_rope_head_dim)), ("--v-head-dim", str(model.v_head_dim)),
                 ("--rope-type", "rope")]
    if model.kv_heads != model.heads:
        args += [("--group-query-attention", None), ("--num-query-groups", str(model.kv_heads))]
    if model.head_dim and not model.latent_attention:  # validate_args' default: hidden_size // num_attention_heads
        args.append(("--kv-channels", str(model.head_dim)))
    # validate_args: max_position_embeddings >= seq_length; a gpt model's are its learned positions (the
    # checker's E224 keeps the training sequence within them), a llama model's rotary ones have no table
    positions = model.seq if model.kind == "gpt" else max(model.seq, plan.seq)
    args += [("--seq-length", str(plan.seq)), ("--max-position-embeddings", str(positions)),
             ("--padded-vocab-size", str(model.vocab))]
    if model.kind == "llama":  # RMSNorm, SwiGLU, rotary positions, no biases (docs/language.md, section 7)
        args += [("--normalization", "RMSNorm"), ("--swiglu", None), ("--position-embedding-type", "rope"),
                 ("--disable-bias-linear", None)]
    else:  # Megatron's defaults: LayerNorm, GELU, learned absolute positions, biases
        args += [("--position-embedding-type", "learned_absolute")]
    if not model.tied_embeddings:
        args.append(("--untie-embeddings-and-output-weights", None))
    if model.window:  # Megatron-Core's window_size (left, right): W - 1 keys before the query (Megatron-Bridge's)
        args.append(("--window-size", f"{model.window - 1},0"))
        if model.full_every:  # is_layer_window_attention: layer_number % freq != 0 windowed, 1-based
            args.append(("--window-attn-skip-freq", str(model.full_every)))
    if model.sinks:  # Megatron-Core's learnable softmax offset, one per head (softmax_offset)
        args.append(("--softmax-type", "learnable"))
        if plan.context is not None and plan.cp > 1:
            lose("attention sinks under context parallelism: Transformer Engine 2.9 runs a learnable softmax under "
                 "context parallelism only with --cp-comm-type a2a (get_attention_backend, \"Filter: Softmax type\": "
                 "its fused core, the unfused one never), and a plan's context kinds are p2p's ring and all_gather",
                 "context", hint="use the context axis for data parallelism, or drop sinks")
    if model.mtp:  # TransformerConfig.mtp_num_layers: the depths on the loss's stage (the layout's `m`, `_pipeline_args`)
        args.append(("--mtp-num-layers", str(model.mtp)))
    if model.parallel_blocks:
        lose("parallel blocks (GPT-NeoX's parallel residual: Megatron-Core's transformer layer adds the attention, "
             "then feeds the MLP)", "model")
    if model.experts:
        args += [("--num-experts", str(model.experts)), ("--moe-router-topk", str(model.top_k))]
        if model.top_k == 1:  # TransformerConfig refuses top-1 routing after the softmax (its weight would be 1)
            args.append(("--moe-router-pre-softmax", None))
        if model.expert_groups:  # moe_utils.group_limited_topk, as runtime.models.limit_groups
            args += [("--moe-router-num-groups", str(model.expert_groups)),
                     ("--moe-router-group-topk", str(model.group_top_k))]
        if model.shared_experts:  # TransformerConfig.moe_shared_expert_intermediate_size: one MLP that wide
            args.append(("--moe-shared-expert-intermediate-size", str(model.shared_experts * model.ffn_hidden)))
        if dense:
            args += [("--moe-ffn-hidden-size", str(model.ffn_hidden)), ("--moe-layer-freq", moe_layer_freq(model))]


def moe_layer_freq(model: ir.TransformerModel) -> str:
    """--moe-layer-freq for a model's dense and MoE blocks (`ir.TransformerModel.moe_block`): dense ones first,
    "([0]*3+[1]*58)" as DeepSeek-V3's recipes write it; MoE every N-th from the first, Megatron-LM's own integer N;
    any other, the list expression of one period repeated, "([0]*1+[1]*1)*24", after the blocks before the first whole
    period that `dense_layers` changes and before those the last period leaves."""
    layers, every = model.layers, model.moe_every
    if every == 1:
        return f"([0]*{model.dense_layers}+[1]*{layers - model.dense_layers})"
    if not model.dense_layers and model.moe_offset == 0:
        return str(every)
    kinds = [int(model.moe_block(i)) for i in range(layers)]
    start = -(-model.dense_layers // every) * every  # the first period the dense layers leave whole
    periods = max(0, layers - start) // every
    end = start + periods * every
    parts = [_runs(kinds[:start]), f"({_runs(kinds[start:start + every])})*{periods}" if periods else "",
             _runs(kinds[end:])]
    return "(" + "+".join(part for part in parts if part) + ")"


def _runs(kinds: list[int]) -> str:
    """0s and 1s as Megatron-LM's list expression, a term per run: [0, 0, 1] -> "[0]*2+[1]*1"."""
    terms, index = [], 0
    while index < len(kinds):
        length = next((n for n in range(1, len(kinds) - index) if kinds[index + n] != kinds[index]), len(kinds) - index)
        terms.append(f"[{kinds[index]}]*{length}")
        index += length
    return "+".join(terms)


def _train_args(plan: ir.Plan, args: list, lose) -> None:
    train = plan.train
    args += [("--micro-batch-size", str(train.micro_batch)), ("--global-batch-size", str(train.global_batch))]
    if train.precision in PRECISION_SWITCH:
        args.append((PRECISION_SWITCH[train.precision], None))
    elif train.precision is ir.Precision.fp8:  # TE's recipes: e4m3 forward, e5m2 gradients (delayed by default)
        args += [("--bf16", None), ("--fp8-format", "hybrid")]
        if train.fp8_recipe in FP8_RECIPES:
            args.append(("--fp8-recipe", FP8_RECIPES[train.fp8_recipe]))
        elif train.fp8_recipe is not None:
            lose(f"fp8_recipe: {train.fp8_recipe.value} (torchao's tensorwise dynamic scaling: Megatron-LM trains FP8 "
                 "through Transformer Engine, whose per-tensor current scaling is --fp8-recipe tensorwise)", "train",
                 hint="write fp8_recipe: current")
    elif train.precision is ir.Precision.mxfp8:  # MXFP8BlockScaling: e4m3 both ways (Megatron-Bridge's bf16_with_mxfp8_mixed)
        args += [("--bf16", None), ("--fp8-format", "e4m3"), ("--fp8-recipe", "mxfp8")]
    elif train.precision is ir.Precision.nvfp4:  # NVFP4BlockScaling (Megatron-Bridge's bf16_with_nvfp4_mixed)
        args += [("--bf16", None), ("--fp4-format", "e2m1"), ("--fp4-recipe", "nvfp4")]
    if train.bf16_first_layers or train.bf16_last_layers:  # fp8_utils.is_first_last_bf16_layer: global indices
        if train.recipe is ir.Fp8Recipe.delayed:  # TransformerConfig.__post_init__ refuses it
            lose("bf16_first_layers and bf16_last_layers with delayed scaling (Megatron-LM: \"Delayed scaling does "
                 "not support first / last layer in BF16\")", "train", hint="write fp8_recipe: current")
        else:
            args += [("--first-last-layers-bf16", None),
                     ("--num-layers-at-start-in-bf16", str(train.bf16_first_layers)),
                     ("--num-layers-at-end-in-bf16", str(train.bf16_last_layers))]
    _dtype_args(plan, args, lose)
    if train.recompute is ir.Recompute.selective:  # recompute_modules defaults to ["core_attn"]: the attention core
        args.append(("--recompute-granularity", "selective"))
        if train.recompute_modules is not None:
            args.append(("--recompute-modules", tuple(m.value for m in train.recompute_modules)))
            if ir.RecomputeModule.moe_act in train.recompute_modules:  # TransformerConfig needs it with moe_act
                args.append(("--moe-grouped-gemm", None))
    elif train.recompute is ir.Recompute.full and train.recompute_layers is not None:
        if train.recompute_layers:  # the first N blocks of each stage (virtual chunk); 0 recomputes none
            args += [("--recompute-granularity", "full"), ("--recompute-method", "block"),
                     ("--recompute-num-layers", str(train.recompute_layers))]
    elif train.recompute is ir.Recompute.full:  # every block from its input: uniform, one block per unit
        args += [("--recompute-granularity", "full"), ("--recompute-method", "uniform"),
                 ("--recompute-num-layers", "1")]
    elif train.recompute is ir.Recompute.selective_op:
        lose("recompute: selective_op (op-level selective checkpointing; Megatron recomputes modules: "
             "--recompute-granularity selective)", "train", hint="use recompute: selective or full")
    if train.offload_layers:  # TransformerConfig.__post_init__: fewer than num_layers, no pipeline, no recomputation
        if plan.pp > 1:
            lose(f"offload_layers: {train.offload_layers} with pipeline parallelism (megatron-core: \"Currently there "
                 "is no support for Pipeline parallelism with CPU offloading\")", "train",
                 hint="offload without stages, or drop offload_layers")
        elif isinstance(plan.model, ir.TransformerModel) and train.offload_layers >= plan.model.layers:
            lose(f"offload_layers: {train.offload_layers} of {plan.model.layers} blocks (megatron-core offloads "
                 "fewer than num_layers: \"CPU offloading can be done only for layers less than\" it)", "train",
                 hint=f"offload_layers: {plan.model.layers - 1}")
        else:
            args.append(("--cpu-offloading-num-layers", str(train.offload_layers)))
    if train.attention is ir.Attention.materialized:  # TE's unfused core: the scores through memory
        args.append(("--attention-backend", "unfused"))
    # Megatron's cross entropy (language_module.py:140-167): without --cross-entropy-loss-fusion its own op by op over
    # an fp32 copy of the logits, the softmax kept and the gradient written over it (`loss: megatron`); with it and the
    # native impl the same steps jit-fused (fused_cross_entropy.py): `megatron`'s memory in fewer passes, which this
    # adapter writes for `standard` (no Megatron loss makes torch's fp32 temporaries; the nearest, so that a plan's
    # default loss exports and reads back); with --cross-entropy-fusion-impl te Transformer Engine's, the gradient
    # written over the 16-bit logits (`fused`: transformer_engine/pytorch/triton/cross_entropy.py)
    if train.loss is ir.Loss.standard:
        args.append(("--cross-entropy-loss-fusion", None))
    elif train.loss is ir.Loss.fused:
        args += [("--cross-entropy-loss-fusion", None), ("--cross-entropy-fusion-impl", "te")]
    if train.kernels is ir.Kernels.eager:
        lose("kernels: eager (Megatron-LM runs its element-wise work in fused kernels, Transformer Engine's or its "
             "own)", "train", hint="drop kernels, or write kernels: fused")
    args += [("--optimizer", train.optimizer.value), ("--lr", _number(train.lr)),
             ("--lr-decay-style", train.lr_schedule), ("--lr-warmup-iters", str(train.warmup_steps)),
             # clip_grad 0 turns clipping off (megatron/core/optimizer/optimizer.py: `if config.clip_grad > 0.0`)
             ("--clip-grad", _number(train.grad_clip if train.grad_clip is not None else 0.0)),
             ("--seed", str(train.seed))]
    # Megatron-LM seeds numpy with the seed plus 100 per pipeline rank (`_set_random_seed`: np.random.seed, which
    # takes less than 2^32), so a larger seed stops it before the first step
    if train.seed + 100 * (plan.pp - 1) >= 2**32:
        lose(f"seed: {train.seed} (Megatron-LM seeds numpy with it plus 100 per pipeline rank, which must stay below "
             "2^32)", "train", hint=f"write a seed below {2**32 - 100 * (plan.pp - 1):,}")


def _dtype_args(plan: ir.Plan, args: list, lose) -> None:
    """master_dtype, grad_dtype and optimizer_dtype as Megatron-Core's precision-aware optimizer flags, which
    it takes with Adam and the distributed optimizer only (OptimizerConfig.__post_init__)."""
    train = plan.train
    given = {key: value.value for key, value in train.given_dtypes().items()}
    if "param_dtype" in given:  # Megatron keeps its weights in the compute dtype and an fp32 master beside them
        if train.param_dtype is not train.precision.unquantized or train.master_dtype is not ir.Precision.fp32:
            lose(f"param_dtype: {given['param_dtype']} (Megatron keeps the weights in the compute precision, "
                 f"{train.precision.unquantized.value}, beside an fp32 master copy)", "train",
                 hint=f"param_dtype: {train.precision.unquantized.value} with master_dtype: fp32")
        del given["param_dtype"]
    if not given:
        return
    if train.optimizer is not ir.Optimizer.adam or plan.data is None or plan.data.zero_stage < 1:
        lose(f"{', '.join(f'{k}: {v}' for k, v in given.items())} without Adam and a sharded optimizer "
             "(Megatron's --use-precision-aware-optimizer needs --optimizer adam and the distributed optimizer)",
             "train", hint="use optimizer: adam with data = zero1 (or zero2, zero3)")
        return
    flags = [("--use-precision-aware-optimizer", None)]
    for key, value in given.items():
        names = DTYPE_FLAGS[key]
        if value not in CHOICE_FLAGS[names[0]]:
            lose(f"{key}: {value} (its {names[0]} takes {', '.join(CHOICE_FLAGS[names[0]])})", "train")
            continue
        flags += [(name, value) for name in names]
    args += flags


def _number(value: float) -> str:
    return repr(float(value))


def _parallel_args(plan: ir.Plan, args: list, lose) -> None:
    order = mesh_order(plan)
    if isinstance(order, str):
        lose(order, "mesh", hint="order the mesh, outermost first, as [pp, dp, ep, cp, tp] (or [dp, pp, cp, tp])")
    args += [("--tensor-model-parallel-size", str(plan.tp))]
    if plan.tensor is not None and plan.tensor.sequence_parallel and plan.tp > 1:
        args.append(("--sequence-parallel", None))
        if plan.tensor.userbuffers:  # Transformer Engine's userbuffers; validate_args asserts --sequence-parallel
            args.append(("--tp-comm-overlap", None))
            if not plan.tensor.sm_margin:
                lose("sm_margin = false (Megatron-LM takes Transformer Engine's set_sm_margin per layer from the YAML "
                     "file --tp-comm-overlap-cfg names, not from a flag; without one TE 2.x sets the margin)", "tensor",
                     hint="write the file with set_sm_margin: false for the pipelined and bulk overlaps and pass "
                          "--tp-comm-overlap-cfg")
        elif plan.tensor.overlap:
            lose("overlap = async_tp (torch's async tensor parallelism, a torch.compile pass: Megatron-LM overlaps "
                 "tensor-parallel communication only with Transformer Engine's userbuffers, --tp-comm-overlap)",
                 "tensor", hint="`overlap = userbuffers`, priced as Megatron-LM runs it")
    args.append(("--pipeline-model-parallel-size", str(plan.pp)))
    if plan.pp > 1 or (plan.stages is not None and plan.stages.virtual > 1):
        _pipeline_args(plan, args, lose)
    if plan.context is not None and plan.cp > 1:
        args += [("--context-parallel-size", str(plan.cp)), ("--cp-comm-type", CONTEXT_COMM[plan.context.kind])]
        if plan.seq % (2 * plan.cp):  # validate_args: seq-length a multiple of 2 * context-parallel-size
            lose(f"a sequence of {plan.seq} over context parallel {plan.cp} (Megatron needs a multiple of "
                 f"2 x {plan.cp} = {2 * plan.cp})", "context")
    if plan.experts is not None and plan.expert_group > 1:
        args.append(("--expert-model-parallel-size", str(plan.expert_group)))
        if plan.experts.kind != "alltoall":  # DeepEP's or HybridEP's kernels behind the flex dispatcher
            args += [("--moe-token-dispatcher-type", "flex"), ("--moe-flex-dispatcher-backend", plan.experts.kind)]
        if plan.expert_tp != plan.tp:  # folded over the tensor axis: each expert whole (MoE parallel folding)
            args.append(("--expert-tensor-parallel-size", str(plan.expert_tp)))
        # the all-to-alls behind the other microbatch's work (and its weight gradients); what TransformerConfig refuses
        # beside it (full recomputation, a pipeline without virtual stages, fp32) a checked plan cannot hold (E418, E419)
        if plan.experts.overlap:
            args += [("--overlap-moe-expert-parallel-comm", None), ("--delay-wgrad-compute", None)]
    if order == ORDER_TP_PP_DP:
        args.append(("--use-tp-pp-dp-mapping", None))
    if plan.data is not None:
        if plan.data.kind in DATA_ARGS:
            args += DATA_ARGS[plan.data.kind]
        else:
            lose(f"data = {plan.data.kind} (Megatron-FSDP's sharding strategies shard over the whole data-parallel "
                 "group)", "data", hint="use zero3 over one data axis")
        _gather_args(plan, args, lose)


def _gather_args(plan: ir.Plan, args: list, lose) -> None:
    """The plan's gather dtype: `gather = fp8` is `--fp8-param-gather` (DistributedDataParallelConfig.fp8_param_gather:
    the FP8 weights kept as such and all-gathered in FP8 by the distributed optimizer or Megatron-FSDP); Megatron-LM
    gathers its parameters in their own dtype otherwise, the 16-bit weights beside its fp32 master."""
    gather = plan.data.gather if plan.data is not None else None
    if gather is ir.Precision.fp8:
        args.append(("--fp8-param-gather", None))
    elif gather is not None and gather is not plan.train.precision.unquantized:
        lose(f"gather = {gather.value} (Megatron-LM gathers its {plan.train.precision.unquantized.value} weights as they "
             "are, or with --fp8-param-gather in FP8)", "data", hint="drop `with gather`")


def mesh_order(plan: ir.Plan) -> tuple[str, ...] | str:
    """Megatron's rank order that lays the plan's mesh out (ORDER or ORDER_TP_PP_DP), or why none does."""
    roles = plan.axis_roles()
    data_axes = [a for a in (plan.data.axes if plan.data else ()) if roles.get(a) == "dp" and plan.mesh.degree(a) > 1]
    if len(data_axes) > 1:
        return f"data parallelism over {len(data_axes)} axes ({', '.join(data_axes)}): Megatron has one data axis"
    inner_first = [axis for axis in reversed(plan.mesh.axes) if axis.size > 1]
    unused = [axis.name for axis in inner_first if axis.name not in roles]
    if unused:
        return f"mesh axis '{unused[0]}', which only shard rules use"
    if plan.cp > 1 and plan.ep > 1:
        return ("context and expert parallelism together (Megatron folds the expert axis into context x data: "
                "parallel_state's expert rank generator has no cp)")
    written = tuple(roles[axis.name] for axis in inner_first)
    for order in (ORDER, ORDER_TP_PP_DP):
        if written == tuple(role for role in order if role in written):
            if order == ORDER_TP_PP_DP and plan.ep > 1 and plan.pp > 1 and "dp" in written:
                break  # initialize_model_parallel: pp-last order, or one data size for attention and MoE layers
            return order
    shown = ", ".join(f"{axis.name}({roles[axis.name]})" for axis in reversed(inner_first))
    return (f"the mesh order [{shown}] (Megatron lays ranks out innermost first as tp-cp-ep-dp-pp, or "
            "tp-cp-ep-pp-dp with --use-tp-pp-dp-mapping)")


def _pipeline_args(plan: ir.Plan, args: list, lose) -> None:
    stages = plan.stages
    name = plan.schedule.name if plan.schedule is not None else "1f1b"
    # Megatron runs 1F1B with one stage per rank and interleaved 1F1B with several (schedules.py:
    # get_forward_backward_func), its virtual stages round robin (PipelineParallelLayerLayout: stage
    # vpp_rank * pp + pp_rank on pp_rank)
    expected = "interleaved_1f1b" if stages.virtual > 1 else "1f1b"
    if plan.schedule is not None and (plan.schedule.definition is not None or name != expected):
        lose(f"schedule = {name} (Megatron has 1F1B, and interleaved 1F1B with virtual stages)", "schedule",
             hint=f"use schedule = {expected}")
    if stages.virtual > 1 and name == "interleaved_1f1b":  # the order of torch's rounds (`megatron_microbatch_group`)
        m = plan.num_microbatches
        if not megatron_microbatches_fit(plan.pp, m, stages.virtual):
            lose(f"interleaved 1F1B over {m} microbatches on {plan.pp} pipeline ranks (Megatron-LM's interleaved "
                 "schedule runs at least pp microbatches per virtual stage in turn)", "schedule",
                 hint=f"at least {plan.pp} microbatches per step")
        elif megatron_microbatch_group(plan.pp, m) != plan.pp:
            args.append(("--microbatch-group-size-per-virtual-pipeline-stage", str(megatron_microbatch_group(plan.pp, m))))
    round_robin = tuple(s % plan.pp for s in range(plan.pp * stages.virtual))
    if stages.rank_map != "loop" and tuple(stages.rank_map) != round_robin:
        lose(f"the stage-to-rank map {_map_text(stages.rank_map)} (Megatron places virtual stages round robin)",
             "stages", hint="use map = loop")
    assignment, _ = assign_stages(plan)
    if assignment is None:
        return
    layout = []
    for index, layers in enumerate(assignment.stage_layers):
        kinds = [layer.kind for layer in layers]
        if "norm" in kinds and "head" not in kinds or "head" in kinds and "norm" not in kinds:
            lose(f"the final norm and the head on different stages (stage {index} holds only one: Megatron "
                 "builds both where the loss is, 'L')", "stages")
            return
        # multi-token prediction's depths go with the head, after the blocks and before the loss: `m` once per depth
        # where the layout says (validate_layer_layout: as many as mtp_num_layers, in one virtual stage, after every
        # block); the even split builds them on the last stage itself (mtp_on_this_rank)
        depths = getattr(plan.model, "mtp", 0) if "head" in kinds else 0
        layout.append(("E" if "embed" in kinds else "") + _blocks(kinds.count("block")) + "m" * depths
                      + ("L" if "head" in kinds else ""))
    blocks = plan.model.layers if isinstance(plan.model, ir.TransformerModel) else 0
    count = len(layout)
    # get_num_layers_to_build's even split, the embedding and the loss counted as layers where the plan counts them
    # (the flags its `account` says first, then any others whose split it is: a `stages { }` block's)
    for counted in dict.fromkeys((stages.account, (), ("embed", "loss"), ("embed",), ("loss",))):
        items = blocks + len(counted)
        if blocks and items % count == 0 and [stage.replace("m", "") for stage in layout] == \
                _even_layout(blocks, count, counted):
            args += [(ACCOUNT_FLAGS[part], None) for part in counted]
            if stages.virtual > 1:
                args.append(("--num-virtual-stages-per-pipeline-rank", str(stages.virtual)))
            return
    args.append(("--pipeline-model-parallel-layout", "|".join(layout)))


ACCOUNT_FLAGS = {"embed": "--account-for-embedding-in-pipeline-split", "loss": "--account-for-loss-in-pipeline-split"}
"""`stages = evenly ... with account = [...]`'s parts -> Megatron-LM's switches that count them in the split."""


def _even_layout(blocks: int, count: int, counted: tuple[str, ...]) -> list[str]:
    """The layout of megatron-core's even split of `blocks` over `count` stages with the parts `counted` as layers
    (get_num_layers_to_build: each stage as many items, the first one block fewer for the embedding and the last
    one fewer for the loss); the caller has checked that they divide."""
    each = (blocks + len(counted)) // count
    return [("E" if s == 0 else "") + _blocks(each - ("embed" in counted and s == 0)
                                              - ("loss" in counted and s == count - 1))
            + ("L" if s == count - 1 else "") for s in range(count)]


def _blocks(count: int) -> str:
    return "" if count == 0 else "t" if count == 1 else f"t*{count}"


def _map_text(rank_map) -> str:
    return rank_map if isinstance(rank_map, str) else "[" + ", ".join(map(str, rank_map)) + "]"
