"""`plandsl export --to megatron` held against megatron-core 0.16.1's own code (skipped without it; the
`interop` extra installs it): its TransformerConfig, ModelParallelConfig, DistributedDataParallelConfig and
OptimizerConfig take the exported settings, its PipelineParallelLayerLayout takes the exported layout, its
per-rank layer assignment (get_num_layers_to_build, get_transformer_layer_offset) is plandsl's stages for
every stdlib plan Megatron can express, and its RankGenerator lays the ranks out as the plan's mesh does."""
from __future__ import annotations

import dataclasses
import itertools
import shlex
import warnings

import pytest

from plandsl import api
from plandsl.interop import export_plan
from plandsl.interop.megatron_import import import_flags
from plandsl.ir.placement import assign_stages
from plandsl.search import search
from plandsl.search.emit import plan_text, resolve_problem
from test_interop_megatron import EXPRESSIBLE, stdlib_plan  # the stdlib plans Megatron-LM expresses, found by name

pytestmark = pytest.mark.xdist_group("torch")  # megatron-core imports torch

# The flags Megatron-LM's own parser adds by hand (megatron/training/arguments.py at core_v0.16.1, not in the
# megatron-core wheel), which `core_transformer_config_from_args` turns into config fields or the model's
# arguments: each with where it lands.
TRAINING_FLAGS = {
    "--seq-length": "GPTModel(max_sequence_length) and the data loader",
    "--max-position-embeddings": "GPTModel(max_sequence_length)",
    "--padded-vocab-size": "GPTModel(vocab_size)",
    "--position-embedding-type": "GPTModel(position_embedding_type)",
    "--untie-embeddings-and-output-weights": "GPTModel(share_embeddings_and_output_weights)",
    "--swiglu": "gated_linear_unit + activation_func silu",
    "--group-query-attention": "num_query_groups kept",
    "--num-experts": "num_moe_experts",
    "--num-virtual-stages-per-pipeline-rank": "virtual_pipeline_model_parallel_size",
    "--micro-batch-size": "the microbatch calculator", "--global-batch-size": "the microbatch calculator",
    "--lr-decay-style": "OptimizerParamScheduler", "--lr-warmup-iters": "OptimizerParamScheduler",
    "--seed": "the RNG", "--use-tp-pp-dp-mapping": "initialize_model_parallel(order='tp-cp-ep-pp-dp')",
    "--ckpt-format": "the checkpointer",
}


@pytest.fixture(scope="module")
def mcore():
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e .[interop])")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed"
        import megatron.core as core
        from megatron.core import parallel_state
        from megatron.core.distributed import DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig
        from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
        from megatron.core.transformer.transformer_block import get_num_layers_to_build
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_layer_specs
        from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
    assert core.__version__ == "0.16.1", core.__version__
    return dict(parallel_state=parallel_state, DDP=DistributedDataParallelConfig, Optimizer=OptimizerConfig,
                Layout=PipelineParallelLayerLayout, TransformerConfig=TransformerConfig,
                MLATransformerConfig=MLATransformerConfig, layer_specs=get_gpt_decoder_layer_specs,
                layers_to_build=get_num_layers_to_build, layer_offset=get_transformer_layer_offset)


def _flags(text: str) -> dict[str, object]:
    """The exported bash array as {flag: value}, read with shlex (independently of plandsl's reader)."""
    words = [w for w in shlex.split(text, comments=True) if w not in ("MEGATRON_ARGS=(", ")")]
    flags: dict[str, object] = {}
    for word in words:
        if word.startswith("--"):
            flags[word], last = True, word
        elif last == "--recompute-modules":  # argparse nargs="+" (TransformerConfig.recompute_modules, a list)
            flags[last] = [*(flags[last] if isinstance(flags[last], list) else ()), word]
        else:
            flags[last] = word
    return flags


def _field_flags(cls) -> dict[str, str]:
    """Flag -> field, as Megatron-LM's ArgumentGroupFactory names them (megatron/training/argument_utils.py:
    `--field-name`, a bool field defaulting to True as --no-/--disable-, argparse_meta's arg_names first)."""
    names = {}
    for field in dataclasses.fields(cls):
        meta = field.metadata.get("argparse_meta", {}) if field.metadata else {}
        if "arg_names" in meta:
            for name in meta["arg_names"]:
                names[name] = field.name
        elif field.type in (bool, "bool") and field.default is True:
            names["--no-" + field.name.replace("_", "-")] = field.name
            names["--disable-" + field.name.replace("_", "-")] = field.name
        else:
            names["--" + field.name.replace("_", "-")] = field.name
    return names


def _known_flags(mcore, *configs: str) -> set[str]:
    """Megatron-LM's flags a plan's export may write: the training script's own (TRAINING_FLAGS) and those of the
    named config dataclasses (`mcore`'s keys)."""
    known = set(TRAINING_FLAGS)
    for name in configs:
        known |= set(_field_flags(mcore[name]))
    return known


def _typed(value, field):
    if isinstance(value, list):
        return value
    if value is True or field.type in ("str", str) or "Literal" in str(field.type) or "str" == str(field.type):
        return value
    text = str(value)
    return int(text) if text.isdigit() else float(text) if text.replace(".", "", 1).replace("e-", "", 1).isdigit() \
        else value


def _moe_freq(text: str):
    """Megatron-LM's moe_freq_type (arguments.py): an int, or the string's Python list expression evaluated."""
    return int(text) if text.isdigit() else eval(text)  # the test's own exported text, as Megatron-LM evaluates it


def _configs(mcore, flags: dict[str, object]):
    """What `core_transformer_config_from_args` (arguments.py) and the DDP and optimizer setup build from the
    flags: (TransformerConfig, or MLATransformerConfig with --multi-latent-attention, DistributedDataParallelConfig,
    OptimizerConfig)."""
    import torch
    import torch.nn.functional as F
    built = {}
    transformer = mcore["MLATransformerConfig"] if "--multi-latent-attention" in flags else mcore["TransformerConfig"]
    for cls in (transformer, mcore["DDP"], mcore["Optimizer"]):
        fields = {f.name: f for f in dataclasses.fields(cls)}
        by_flag = _field_flags(cls)
        kwargs = {}
        for flag, value in flags.items():
            if flag in by_flag:
                field = fields[by_flag[flag]]
                kwargs[field.name] = (not value) if flag.startswith(("--no-", "--disable-")) else _typed(value, field)
        built[cls] = kwargs
    config = built[transformer]
    if "--multi-latent-attention" in flags and "--q-lora-rank" not in flags:
        config["q_lora_rank"] = None  # Megatron-LM's default: no query latent (MLATransformerConfig's is 512)
    if "--moe-layer-freq" in flags:
        config["moe_layer_freq"] = _moe_freq(str(flags["--moe-layer-freq"]))
    if "--swiglu" in flags:
        config.update(gated_linear_unit=True, activation_func=F.silu)
    if "--group-query-attention" not in flags:
        config["num_query_groups"] = None
    if "--num-experts" in flags:
        config["num_moe_experts"] = int(flags["--num-experts"])
    if "--num-virtual-stages-per-pipeline-rank" in flags:
        config["virtual_pipeline_model_parallel_size"] = int(flags["--num-virtual-stages-per-pipeline-rank"])
    layout = flags.get("--pipeline-model-parallel-layout")
    if layout is not None:
        stages = mcore["Layout"].get_num_stages_from_str(layout)
        pp = int(flags["--pipeline-model-parallel-size"])
        config["virtual_pipeline_model_parallel_size"] = stages // pp if stages // pp > 1 else None
    dtype = torch.bfloat16 if "--bf16" in flags else torch.float16 if "--fp16" in flags else torch.float32
    config.update(params_dtype=dtype, pipeline_dtype=dtype)
    return (transformer(**config), mcore["DDP"](**built[mcore["DDP"]]),
            mcore["Optimizer"](**built[mcore["Optimizer"]]))


def _exported(path: str, name: str):
    plan = stdlib_plan(path, name)
    exported = export_plan(plan, "megatron")
    assert not exported.lost
    return plan, exported


def test_most_stdlib_plans_are_expressible():
    assert len(EXPRESSIBLE) >= 20


@pytest.mark.parametrize("path, name", EXPRESSIBLE)
def test_every_exported_flag_is_megatrons_and_its_configs_accept_them(mcore, path, name):
    plan, exported = _exported(path, name)
    flags = _flags(exported.text)
    known = _known_flags(mcore, "TransformerConfig", "MLATransformerConfig", "DDP", "Optimizer")
    assert set(flags) <= known, f"not Megatron-LM flags: {sorted(set(flags) - known)}"
    config, ddp, optimizer = _configs(mcore, flags)
    assert (config.tensor_model_parallel_size, config.pipeline_model_parallel_size) == (plan.tp, plan.pp)
    assert (config.context_parallel_size, config.expert_model_parallel_size) == (plan.cp, plan.ep)
    assert config.num_layers == plan.model.layers and config.hidden_size == plan.model.hidden
    dense = plan.model.dense_layers  # then --ffn-hidden-size is the dense layers' MLP, --moe-ffn-hidden-size the experts'
    assert config.ffn_hidden_size == (plan.model.dense_ffn if dense else plan.model.ffn_hidden)
    assert (config.moe_ffn_hidden_size or config.ffn_hidden_size) == plan.model.ffn_hidden
    assert (config.num_query_groups or config.num_attention_heads) == plan.model.kv_heads
    assert config.sequence_parallel == bool(plan.tensor and plan.tensor.sequence_parallel and plan.tp > 1)
    assert config.normalization == ("RMSNorm" if plan.model.kind == "llama" else "LayerNorm")
    assert config.add_bias_linear == (plan.model.kind == "gpt")
    assert (config.num_moe_experts or 0) == plan.model.experts
    recompute = {"none": None, "selective": "selective", "full": "full"}[plan.train.recompute.value]
    assert config.recompute_granularity == recompute
    zero = plan.data.zero_stage if plan.data else 0
    strategy = ddp.data_parallel_sharding_strategy if ddp.use_megatron_fsdp else "no_shard"
    assert (ddp.use_distributed_optimizer, strategy) == (zero == 1, {0: "no_shard", 1: "no_shard", 2: "optim_grads",
                                                                      3: "optim_grads_params"}[zero])
    assert optimizer.lr == plan.train.lr and optimizer.optimizer == plan.train.optimizer.value
    assert (optimizer.bf16, optimizer.fp16) == (plan.train.precision.value == "bf16", plan.train.precision.value == "fp16")


@pytest.mark.parametrize("path, name", EXPRESSIBLE)
def test_megatrons_layer_assignment_is_the_plans_stages(mcore, monkeypatch, path, name):
    plan, exported = _exported(path, name)  # without a pipeline: every block on the one stage
    _holds_the_plans_stages(mcore, monkeypatch, plan, _flags(exported.text))


def test_an_uneven_split_generated_for_megatrons_pipeline_is_a_layout_megatron_builds(mcore, monkeypatch):
    """`generate --pipeline megatron` splits 92 blocks over 8 ranks x 4 virtual stages (32 chunks of 3 and 2, which
    `--num-layers-per-virtual-pipeline-stage` cannot say: arguments.py asserts the blocks per rank divisible, and
    get_num_layers_to_build num_layers by pp); the export writes them as --pipeline-model-parallel-layout (alone of
    the three vpp flags, as validate_args asserts, its 32 stages a multiple of pp), which megatron-core builds
    chunk by chunk as the plan's stages."""
    problem, source = resolve_problem("gpt(layers=92, hidden=4096, heads=32, seq=2048, vocab=51200)",
                                      "dgx_a100 x 16", 512, pipeline="megatron")
    best = search(problem, pins=["pp=8", "virtual_stages=4", "schedule=interleaved_1f1b"], top=1).best
    [plan] = api.loads(plan_text(best, problem, source), path="generated.plan").plans
    assert plan.stages.implementation == "megatron" and (plan.pp, plan.stages.virtual) == (8, 4)
    exported = export_plan(plan, "megatron")
    assert not exported.lost
    flags = _flags(exported.text)
    layout = flags["--pipeline-model-parallel-layout"]
    assert not {"--num-layers-per-virtual-pipeline-stage", "--num-virtual-stages-per-pipeline-rank"} & set(flags)
    assert mcore["Layout"].get_num_stages_from_str(layout) == 32 and 92 % 32
    _holds_the_plans_stages(mcore, monkeypatch, plan, flags)


def _holds_the_plans_stages(mcore, monkeypatch, plan, flags: dict[str, object]) -> None:
    """Megatron-core's blocks per (pipeline rank, virtual stage), their offsets and where it builds the embedding
    and the loss are the plan's stages."""
    config, _, _ = _configs(mcore, flags)
    assignment, problems = assign_stages(plan)
    assert not problems
    pp, virtual = plan.pp, assignment.virtual
    state = mcore["parallel_state"]
    rank = {"pp": 0}
    monkeypatch.setattr(state, "get_pipeline_model_parallel_rank", lambda: rank["pp"])
    monkeypatch.setattr(state, "get_pipeline_model_parallel_world_size", lambda: pp)
    monkeypatch.setattr(state, "get_virtual_pipeline_model_parallel_world_size", lambda: virtual if virtual > 1 else None)
    layout = config.pipeline_model_parallel_layout
    if "--pipeline-model-parallel-layout" in flags:
        assert layout is not None
        layout.validate_layer_layout(config.num_layers, None)
    start = 0
    for stage, layers in enumerate(assignment.stage_layers):
        rank["pp"] = stage % pp
        vp_stage = stage // pp if virtual > 1 else None
        count = mcore["layers_to_build"](config, vp_stage=vp_stage, pp_rank=stage % pp)
        offset = mcore["layer_offset"](config, vp_stage=vp_stage, pp_rank=stage % pp)
        blocks = [layer.name for layer in layers if layer.kind == "block"]
        assert blocks == [f"layers.{i}" for i in range(offset, offset + count)], f"stage {stage}"
        assert offset == start
        start += count
        kinds = {layer.kind for layer in layers}
        if layout is not None:  # where Megatron builds the embedding (E) and the final norm, head and loss (L)
            held = layout.layout[stage % pp][stage // pp]
            assert ("embed" in kinds, "head" in kinds) == (any(t.name == "embedding" for t in held),
                                                           any(t.name == "loss" for t in held))
        else:  # the first stage of rank 0 pre-processes, the last stage of the last rank post-processes
            assert ("embed" in kinds, "head" in kinds) == (stage == 0, stage == len(assignment.stage_layers) - 1)
    assert start == plan.model.layers


def _groups(sizes: list[int], varying: set[int]) -> set[tuple[int, ...]]:
    """The rank groups of a row-major mesh of `sizes` (last innermost) whose members differ in `varying` axes only."""
    ranks = {}
    for coords in itertools.product(*(range(s) for s in sizes)):
        index = 0
        for size, c in zip(sizes, coords):
            index = index * size + c
        key = tuple(c for i, c in enumerate(coords) if i not in varying)
        ranks.setdefault(key, []).append(index)
    return {tuple(sorted(group)) for group in ranks.values()}


@pytest.mark.parametrize("path, name", EXPRESSIBLE)
def test_megatrons_rank_groups_are_the_plans_mesh_axes(mcore, path, name):
    plan, exported = _exported(path, name)
    flags = _flags(exported.text)
    order = "tp-cp-ep-pp-dp" if "--use-tp-pp-dp-mapping" in flags else "tp-cp-ep-dp-pp"  # initialize.py
    sizes = [axis.size for axis in plan.mesh.axes]
    roles = plan.axis_roles()
    index = {role: {i for i, axis in enumerate(plan.mesh.axes) if roles.get(axis.name) == role}
             for role in ("tp", "cp", "ep", "dp", "pp")}
    generator = mcore["parallel_state"].RankGenerator
    decoder = generator(tp=plan.tp, ep=1, dp=plan.dp, pp=plan.pp, cp=plan.cp, order=order)
    for token, roles_of in (("tp", {"tp"}), ("pp", {"pp"}), ("cp", {"cp"}), ("dp", {"dp", "ep"})):
        varying = set().union(*(index[r] for r in roles_of))
        assert {tuple(sorted(g)) for g in decoder.get_ranks(token)} == _groups(sizes, varying), token
    if plan.ep > 1:
        experts = generator(tp=plan.tp, ep=plan.ep, dp=plan.dp // plan.ep, pp=plan.pp, cp=1, order=order)
        assert {tuple(sorted(g)) for g in experts.get_ranks("ep")} == _groups(sizes, index["ep"])


@pytest.mark.parametrize("count, virtual", [(1, ""), (3, ""), (2, " with virtual = 2")])
def test_the_block_method_export_is_what_megatron_core_recomputes(mcore, count, virtual):
    """`recompute: full, recompute_layers: N` exports as the block method, which megatron-core's TransformerConfig
    accepts as such (granularity full, method block, N layers), interleaved pipelines included."""
    text = f"""\
import "clusters/dgx_a100"
plan p {{
  model    = gpt(layers=16, hidden=1024, heads=16, seq=1024, vocab=51200)
  cluster  = dgx_a100 x 2
  mesh     = [dp = 2, pp = 4, tp = 2]
  train    = {{ global_batch: 64, micro_batch: 2, recompute: full, recompute_layers: {count} }}
  stages   = evenly over pp{virtual}
  schedule = {"interleaved_1f1b" if virtual else "1f1b"}
}}
"""
    plan = api.select_plan(api.loads(text, path="p.plan"))
    exported = export_plan(plan, "megatron")
    assert not exported.lost
    config, _, _ = _configs(mcore, _flags(exported.text))
    assert (config.recompute_granularity, config.recompute_method, config.recompute_num_layers) == \
        ("full", "block", count)


_MODULES = """import "clusters/dgx_h100"
plan p {{
  model    = llama(layers=4, hidden=512, heads=8, seq=1024, vocab=32000, {attention}experts=8, top_k=2,
                   shared_experts=1, ffn=256, dense_layers=1, dense_ffn=1024)
  cluster  = dgx_h100
  mesh     = [ep = 8]
  train    = {{ global_batch: 16, micro_batch: 1, precision: {precision}, recompute: selective,
               recompute_modules: [{modules}] }}
  experts  = alltoall over ep
}}
"""


@pytest.mark.parametrize("modules, attention", [
    ("layernorm, moe_act", ""), ("mla_up_proj, moe_act", "kv_lora_rank=64, qk_rope_head_dim=32, qk_nope_head_dim=64, "
                                 "v_head_dim=48, "),
    ("core_attn, mlp, shared_experts", ""), ("moe", "")])
def test_recompute_modules_export_as_megatron_cores(mcore, modules, attention):
    """`recompute: selective, recompute_modules: [...]` exports as --recompute-modules, which megatron-core's
    TransformerConfig takes as its recompute_modules (moe_act with the --moe-grouped-gemm it requires)."""
    text = _MODULES.format(attention=attention, precision="bf16", modules=modules)
    exported = export_plan(api.select_plan(api.loads(text, path="p.plan")), "megatron")
    assert not exported.lost
    flags = _flags(exported.text)
    config, _, _ = _configs(mcore, flags)
    assert (config.recompute_granularity, config.recompute_modules) == ("selective", modules.split(", "))
    assert ("moe_act" in modules) == ("--moe-grouped-gemm" in flags) == bool(config.moe_grouped_gemm)
    back = import_flags(exported.text, "megatron.sh", world_size=8)
    assert back.ok, [d.message for d in back.diagnostics]
    assert f"recompute_modules: [{modules}]" in back.text


def test_recompute_modules_megatron_core_refuses_are_refused(mcore):
    """What E517 refuses (moe_act or layernorm under FP8 delayed scaling) megatron-core's TransformerConfig refuses
    too, and current scaling it takes."""
    text = _MODULES.format(attention="", precision="fp8", modules="layernorm, moe_act")
    assert [d.code for d in api.checks(text, path="p.plan").diagnostics] == ["E517"]
    fields = dict(num_layers=4, hidden_size=512, num_attention_heads=8, num_moe_experts=8, moe_grouped_gemm=True,
                  recompute_granularity="selective", recompute_modules=["layernorm", "moe_act"], fp8="hybrid")
    with pytest.raises(ValueError, match="Delayed scaling does not support moe_act and layernorm"):
        mcore["TransformerConfig"](**fields, fp8_recipe="delayed")


_DEEPSEEK = """import "clusters/dgx_a100"
plan tiny_deepseek {{
  model    = llama(layers=6, hidden=512, heads=8, seq=1024, vocab=32000, {q_lora}kv_lora_rank=64,
                   qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=48, experts=8, top_k=2, shared_experts=1,
                   ffn=256, dense_layers=2, dense_ffn=2048{groups})
  cluster  = dgx_a100
  mesh     = [pp = 2, ep = 2, tp = 2]
  train    = {{ global_batch: 16, micro_batch: 1 }}
  tensor   = megatron over tp with sequence_parallel
  experts  = alltoall over ep
  stages   = evenly over pp
  schedule = 1f1b
}}
"""


@pytest.mark.parametrize("q_lora, groups", [("q_lora_rank=96, ", ", expert_groups=2, group_top_k=1"), ("", "")],
                         ids=["q_lora_grouped", "no_q_lora"])
def test_deepseek_exports_megatrons_latent_attention_and_dense_then_moe_layers(mcore, q_lora, groups):
    """Multi-head latent attention as MLATransformerConfig takes it, and the dense layers first as Megatron-Core's own
    decoder spec builds them from --moe-layer-freq: an MLP in the first two layers, a MoELayer in the others; group-
    limited routing as TransformerConfig's moe_router_num_groups and moe_router_group_topk."""
    plan = api.loads(_DEEPSEEK.format(q_lora=q_lora, groups=groups)).plans[0]
    exported = export_plan(plan, "megatron")
    assert not exported.lost, [d.message for d in exported.lost]
    flags = _flags(exported.text)
    # --multi-latent-attention: TransformerConfig's switch
    known = _known_flags(mcore, "TransformerConfig", "MLATransformerConfig", "DDP", "Optimizer")
    assert set(flags) <= known, f"not Megatron-LM flags: {sorted(set(flags) - known)}"
    config, _, _ = _configs(mcore, flags)
    model = plan.model
    assert config.multi_latent_attention and config.rope_type == "rope"
    assert (config.q_lora_rank or 0, config.kv_lora_rank) == (model.q_lora_rank, model.kv_lora_rank)
    assert (config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim) == \
        (model.qk_nope_head_dim, model.qk_rope_head_dim, model.v_head_dim)
    assert (config.ffn_hidden_size, config.moe_ffn_hidden_size) == (model.dense_ffn, model.ffn_hidden)
    assert config.moe_shared_expert_intermediate_size == model.ffn_hidden
    assert (config.moe_router_num_groups or 0, config.moe_router_group_topk or 0) == \
        (model.expert_groups, model.group_top_k)
    specs = mcore["layer_specs"](config, use_transformer_engine=False)
    assert [spec.submodules.mlp.module.__name__ for spec in specs] == ["MLP"] * 2 + ["MoELayer"] * 4
    assert {spec.submodules.self_attention.module.__name__ for spec in specs} == {"MLASelfAttention"}


_INTERLEAVED = """import "clusters/dgx_a100"
plan p {{
  model    = llama(layers=7, hidden=512, heads=8, seq=1024, vocab=32000, experts=8, shared_experts=1,
                   ffn=256, {kinds}, dense_ffn=2048)
  cluster  = dgx_a100
  mesh     = [pp = 2, ep = 4]
  train    = {{ global_batch: 16, micro_batch: 1 }}
  experts  = alltoall over ep
  stages   = evenly over pp
  schedule = 1f1b
}}
"""


@pytest.mark.parametrize("kinds", ["top_k=1, moe_every=2", "moe_every=2, moe_offset=0", "moe_every=3",
                                   "dense_layers=3, moe_every=2, moe_offset=0", "dense_layers=2, moe_every=3"])
def test_interleaved_experts_are_megatrons_moe_layer_freq(mcore, kinds):
    """MoE blocks every N-th block export as --moe-layer-freq, which Megatron-Core's own decoder spec builds layer by
    layer as the plan's blocks: a MoELayer where `moe_block`, an MLP elsewhere. Top-1 routing (Llama 4's) exports
    --moe-router-pre-softmax, without which TransformerConfig refuses it."""
    plan = api.loads(_INTERLEAVED.format(kinds=kinds)).plans[0]
    exported = export_plan(plan, "megatron")
    assert not exported.lost, [d.message for d in exported.lost]
    config, _, _ = _configs(mcore, _flags(exported.text))
    model = plan.model
    assert (config.ffn_hidden_size, config.moe_ffn_hidden_size) == (model.dense_ffn, model.ffn_hidden)
    assert (config.moe_router_topk, config.moe_router_pre_softmax) == (model.top_k, model.top_k == 1)
    specs = mcore["layer_specs"](config, use_transformer_engine=False)
    assert [spec.submodules.mlp.module.__name__ for spec in specs] == \
        ["MoELayer" if model.moe_block(i) else "MLP" for i in range(model.layers)]


def test_tensor_overlap_is_megatrons_tp_comm_overlap(mcore):
    """`tensor ... with sequence_parallel, overlap = userbuffers` exports --tp-comm-overlap, ModelParallelConfig's
    tp_comm_overlap, beside its sequence_parallel."""
    plan = api.loads("""
import "clusters/dgx_h100"
plan p {
  model   = llama(layers=4, hidden=1024, heads=8, kv_heads=4, ffn=2816, vocab=32000, seq=2048)
  cluster = dgx_h100
  mesh    = [dp = 2, tp = 4]
  train   = { global_batch: 16, micro_batch: 1, precision: bf16 }
  data    = zero1 over dp
  tensor  = megatron over tp with sequence_parallel, overlap = userbuffers
}
""").plans[0]
    exported = export_plan(plan, "megatron")
    assert not exported.lost
    flags = _flags(exported.text)
    known = _known_flags(mcore, "TransformerConfig", "DDP", "Optimizer")
    assert "--tp-comm-overlap" in flags and set(flags) <= known
    config = _configs(mcore, flags)[0]
    assert config.tp_comm_overlap and config.sequence_parallel and config.tensor_model_parallel_size == 4


def test_folded_experts_are_megatrons_expert_groups(mcore):
    """`experts = alltoall over [ep, tp]` exports --expert-model-parallel-size ep x tp --expert-tensor-parallel-size 1,
    which ModelParallelConfig takes beside --tensor-model-parallel-size 2, and Megatron-Core's expert RankGenerator
    (initialize_model_parallel: tp = expert TP, ep, dp = expert data parallel, cp 1) puts each expert group on the
    ranks the plan's ep and tp axes span together (MoE parallel folding)."""
    plan = api.loads("""
import "clusters/dgx_h100"
plan p {
  model   = llama(layers=4, hidden=1024, heads=8, kv_heads=4, ffn=512, experts=32, top_k=4, vocab=32000, seq=2048)
  cluster = dgx_h100 x 4
  mesh    = [pp = 2, dp = 2, ep = 4, tp = 2]
  train   = { global_batch: 64, micro_batch: 1, precision: bf16 }
  data    = zero1 over dp
  tensor  = megatron over tp with sequence_parallel
  experts = alltoall over [ep, tp]
}
""").plans[0]
    exported = export_plan(plan, "megatron")
    assert not exported.lost
    flags = _flags(exported.text)
    assert (flags["--expert-model-parallel-size"], flags["--expert-tensor-parallel-size"]) == ("8", "1")
    config = _configs(mcore, flags)[0]
    assert (config.tensor_model_parallel_size, config.expert_model_parallel_size,
            config.expert_tensor_parallel_size) == (2, 8, 1)
    sizes = [axis.size for axis in plan.mesh.axes]
    world = plan.mesh.size
    experts = mcore["parallel_state"].RankGenerator(tp=1, ep=8, dp=world // (8 * plan.pp), pp=plan.pp, cp=1,
                                                    order="tp-cp-ep-dp-pp")
    assert {tuple(sorted(g)) for g in experts.get_ranks("ep")} == _groups(sizes, {2, 3})
    assert {tuple(sorted(g)) for g in experts.get_ranks("dp")} == _groups(sizes, {1})


@pytest.mark.parametrize("kind", ["deepep", "hybridep"])
def test_the_flex_dispatchers_are_megatrons(mcore, kind):
    """`experts = deepep | hybridep over ep` exports --moe-token-dispatcher-type flex --moe-flex-dispatcher-backend,
    which TransformerConfig takes as its moe_token_dispatcher_type and moe_flex_dispatcher_backend."""
    plan = api.loads(f"""
import "clusters/dgx_h100"
plan p {{
  model   = llama(layers=4, hidden=1024, heads=8, kv_heads=4, ffn=512, experts=32, top_k=4, vocab=32000, seq=2048)
  cluster = dgx_h100 x 2
  mesh    = [dp = 2, ep = 8]
  train   = {{ global_batch: 64, micro_batch: 1, precision: bf16 }}
  data    = zero1 over dp
  experts = {kind} over ep
}}
""").plans[0]
    exported = export_plan(plan, "megatron")
    assert not exported.lost
    config = _configs(mcore, _flags(exported.text))[0]
    assert (config.moe_token_dispatcher_type, config.moe_flex_dispatcher_backend) == ("flex", kind)


@pytest.mark.parametrize("precision, fields", [("fp8", {"fp8": "hybrid", "fp8_recipe": "delayed"}),
                                               ("fp8, fp8_recipe: current, bf16_first_layers: 1, bf16_last_layers: 2",
                                                {"fp8": "hybrid", "fp8_recipe": "tensorwise",
                                                 "first_last_layers_bf16": True, "num_layers_at_start_in_bf16": 1,
                                                 "num_layers_at_end_in_bf16": 2}),
                                               ("fp8, fp8_recipe: blockwise", {"fp8": "hybrid",
                                                                               "fp8_recipe": "blockwise"}),
                                               ("mxfp8", {"fp8": "e4m3", "fp8_recipe": "mxfp8"}),
                                               ("nvfp4", {"fp4": "e2m1", "fp4_recipe": "nvfp4", "fp8": None})])
def test_the_quantized_precisions_are_megatrons_recipes(mcore, precision, fields):
    """fp8, mxfp8 and nvfp4 export to flags megatron-core's TransformerConfig takes, as Transformer Engine's
    delayed-scaling, MXFP8BlockScaling and NVFP4BlockScaling recipes, beside bf16 params; fp8's current and blockwise
    recipes as Float8CurrentScaling (Megatron's `tensorwise`) and Float8BlockScaling, the bf16 blocks as
    first_last_layers_bf16 with its two counts."""
    import torch
    plan = api.loads(f"""import "clusters/dgx_b200"
plan p {{
  model    = llama(layers=4, hidden=1024, heads=16, kv_heads=8, seq=2048, vocab=32000)
  cluster  = dgx_b200
  mesh     = [dp = 4, tp = 2]
  train    = {{ global_batch: 16, micro_batch: 1, precision: {precision} }}
  data     = zero1 over dp
  tensor   = megatron over tp with sequence_parallel
}}
""").plans[0]
    exported = export_plan(plan, "megatron")
    assert not exported.lost
    flags = _flags(exported.text)
    known = _known_flags(mcore, "TransformerConfig", "DDP", "Optimizer")
    assert set(flags) <= known, sorted(set(flags) - known)
    config, _, optimizer = _configs(mcore, flags)
    assert {name: getattr(config, name) for name in fields} == fields
    assert config.params_dtype is torch.bfloat16 and optimizer.bf16


@pytest.mark.parametrize("blocks, pp, virtual, account", [(6, 4, 2, "[embed, loss]"), (126, 16, 8, "[embed, loss]"),
                                                          (14, 4, 2, "[embed, loss]"), (7, 4, 1, "embed"),
                                                          (11, 4, 1, "loss"), (9, 4, 2, "[embed, loss]")])
def test_counted_embedding_and_loss_are_megatrons_account_flags(mcore, monkeypatch, blocks, pp, virtual, account):
    """`stages = evenly ... with account = [...]` exports as --account-for-embedding/loss-in-pipeline-split where
    the items divide (megatron-core's TransformerConfig asserts that they do), else as the layout of the same
    split (9 blocks + 2 over 8 chunks); megatron-core builds either chunk by chunk as the plan's stages."""
    from test_pipeline_account import _plan
    [plan] = api.loads(_plan(blocks, pp, virtual, account).replace(
        "evenly over pp with", "evenly over pp with implementation = megatron,")).plans
    exported = export_plan(plan, "megatron")
    assert not exported.lost
    flags = _flags(exported.text)
    divides = (blocks + len(plan.stages.account)) % (pp * virtual) == 0
    counted = {"--account-for-embedding-in-pipeline-split": "embed" in plan.stages.account,
               "--account-for-loss-in-pipeline-split": "loss" in plan.stages.account}
    assert {flag: flag in flags for flag in counted} == {flag: on and divides for flag, on in counted.items()}
    assert ("--pipeline-model-parallel-layout" in flags) == (not divides)
    _holds_the_plans_stages(mcore, monkeypatch, plan, flags)


MEGATRON_M12 = """import "clusters/dgx_a100"
plan p {
  model    = gpt(layers=32, hidden=4096, heads=32, seq=2048, vocab=51200)
  cluster  = dgx_a100 x 8
  mesh     = [dp = 2, pp = 8, tp = 4]
  train    = { global_batch: 24, micro_batch: 1, recompute: full }
  tensor   = megatron over tp with sequence_parallel
  stages   = evenly over pp with virtual = 2, implementation = megatron
  schedule = interleaved_1f1b
}
"""


def test_interleaved_microbatches_not_a_multiple_of_pp_run_in_megatrons_order(mcore):
    """12 microbatches on 8 ranks of 2 virtual stages: torch's one round of 12, which plandsl lays out and prices, is
    Megatron-LM's interleaved 1F1B with --microbatch-group-size-per-virtual-pipeline-stage 12 (its default group, pp,
    leaves a last group of 4 < pp, which forward_backward_pipelining_with_interleaving refuses); megatron-core's own
    schedule table and warm-up count (get_schedule_table, get_pp_rank_microbatches) give every rank's actions in
    plandsl's order."""
    from types import SimpleNamespace
    from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches, get_schedule_table
    from plandsl.schedules.generators import interleaved_1f1b
    [plan] = api.loads(MEGATRON_M12, path="p.plan").plans
    exported = export_plan(plan, "megatron")
    assert not exported.lost
    pp, m, virtual = 8, plan.num_microbatches, 2
    group = int(_flags(exported.text)["--microbatch-group-size-per-virtual-pipeline-stage"])
    assert (m, group) == (12, 12) and pp <= group <= m and not 0 < m % group < pp  # schedules.py's two checks
    config, _, _ = _configs(mcore, _flags(exported.text))
    assert config.microbatch_group_size_per_vp_stage == 12
    table = get_schedule_table(m, virtual, group)
    schedule = interleaved_1f1b(pp, m, virtual)
    for rank in range(pp):
        p2p = SimpleNamespace(pp_group=SimpleNamespace(size=lambda: pp, rank=lambda rank=rank: rank),
                              virtual_pipeline_model_parallel_size=virtual)
        total, _, warmup, remaining = get_pp_rank_microbatches(m, virtual, group, p2p_communicator=p2p)
        forwards = [("F", chunk, micro) for micro, chunk in table]
        backwards = [("B", virtual - 1 - chunk, micro) for micro, chunk in table]
        order = forwards[:warmup] + [a for k in range(remaining) for a in (forwards[warmup + k], backwards[k])] \
            + backwards[remaining:]
        mine = [(a.kind.value, a.stage // pp, a.microbatch) for a in schedule.actions[rank] if a.kind.value in ("F", "B")]
        assert mine == order, f"rank {rank}"


_WINDOWED = """import "clusters/dgx_h100"
plan tiny_oss {
  model    = llama(layers=6, hidden=512, heads=8, kv_heads=2, head_dim=64, seq=1024, vocab=32000, experts=8, top_k=2,
                   window=128, full_every=3, sinks=true)
  cluster  = dgx_h100
  mesh     = [pp = 2, ep = 4]
  train    = { global_batch: 16, micro_batch: 1 }
  experts  = alltoall over ep
  stages   = evenly over pp
  schedule = 1f1b
}
"""


def test_the_sliding_window_and_sinks_are_megatrons(mcore, monkeypatch):
    """--window-size, --window-attn-skip-freq and --softmax-type as TransformerConfig takes them (arguments.py's
    tuple_type and moe_freq_type), each layer windowed where Megatron-Core's is_layer_window_attention says, under the
    band its get_sliding_window_causal_mask builds (its mask on the CPU: the function asks for CUDA)."""
    import torch
    import megatron.core.transformer.utils as mutils
    from plandsl.runtime.models import attention_mask
    plan = api.loads(_WINDOWED).plans[0]
    exported = export_plan(plan, "megatron")
    assert not exported.lost, [d.message for d in exported.lost]
    flags = _flags(exported.text)
    known = _known_flags(mcore, "TransformerConfig", "DDP", "Optimizer")
    assert set(flags) <= known, f"not Megatron-LM flags: {sorted(set(flags) - known)}"
    window = tuple(int(side) for side in str(flags.pop("--window-size")).split(","))  # arguments.py: tuple_type
    every = int(flags.pop("--window-attn-skip-freq"))  # moe_freq_type: an int
    config, _, _ = _configs(mcore, flags)
    config = dataclasses.replace(config, window_size=window, window_attn_skip_freq=every)
    assert config.softmax_type == "learnable"
    model = plan.model
    assert [mutils.is_layer_window_attention(config.window_size, config.window_attn_skip_freq, n)
            for n in range(1, model.layers + 1)] == [model.window_of(i) > 0 for i in range(model.layers)]
    ones = torch.ones
    monkeypatch.setattr(torch, "ones", lambda *shape, device=None, **kwargs: ones(*shape, **kwargs))
    positions = torch.arange(300)
    masked = mutils.get_sliding_window_causal_mask(300, 300, config.window_size)  # True: masked out
    assert torch.equal(~masked, attention_mask(positions, positions, model.window))


_MTP = """import "clusters/dgx_a100"
plan p {{
  model   = llama(layers=6, hidden=1024, heads=16, seq=1024, vocab=32000, ffn=512, experts=8, top_k=2,
                  dense_layers=1, dense_ffn=2048, mtp=2)
  cluster = dgx_a100 x 2
  mesh    = [pp = 2, dp = 2, ep = 2, tp = 2]
  train   = {{ global_batch: 16, micro_batch: 1 }}
  experts = alltoall over ep
  tensor  = megatron over tp
{stages}
}}
"""


@pytest.mark.parametrize("stages", ["  stages  = evenly over pp\n  schedule = 1f1b",
                                    "  stages {\n    0: embed, layers[0:4]\n    1: layers[4:6], norm, head\n  }"],
                         ids=["even", "layout"])
def test_multi_token_prediction_is_megatrons(mcore, monkeypatch, stages):
    """--mtp-num-layers as TransformerConfig.mtp_num_layers; the depths where Megatron-Core builds them: with the
    layout, its `m` as many as the depths in the loss's stage (validate_layer_layout; get_mtp_num_layers_to_build
    there, none elsewhere), without one on the last stage (mtp_on_this_rank)."""
    from megatron.core.transformer.multi_token_prediction import get_mtp_num_layers_to_build, mtp_on_this_rank
    plan = api.loads(_MTP.format(stages=stages)).plans[0]
    exported = export_plan(plan, "megatron")
    assert not exported.lost, [d.message for d in exported.lost]
    flags = _flags(exported.text)
    known = _known_flags(mcore, "TransformerConfig", "DDP", "Optimizer")
    assert set(flags) <= known, f"not Megatron-LM flags: {sorted(set(flags) - known)}"
    config, _, _ = _configs(mcore, flags)
    assert config.mtp_num_layers == 2
    state = mcore["parallel_state"]
    rank = {"pp": 0}
    monkeypatch.setattr(state, "get_pipeline_model_parallel_rank", lambda: rank["pp"])
    monkeypatch.setattr(state, "get_pipeline_model_parallel_world_size", lambda: 2)
    monkeypatch.setattr(state, "get_virtual_pipeline_model_parallel_world_size", lambda: None)
    monkeypatch.setattr(state, "is_pipeline_last_stage", lambda ignore_virtual=True, vp_stage=None: rank["pp"] == 1)
    if "--pipeline-model-parallel-layout" in flags:
        config.pipeline_model_parallel_layout.validate_layer_layout(config.num_layers, config.mtp_num_layers)
    assignment, _ = assign_stages(plan)
    for stage, layers in enumerate(assignment.stage_layers):
        rank["pp"] = stage
        held = any(layer.kind == "head" for layer in layers)
        assert mtp_on_this_rank(config) == held
        assert get_mtp_num_layers_to_build(config, pp_rank=stage) == (2 if held else 0)
