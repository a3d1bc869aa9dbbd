"""DeepSeek-style models in the llama family: multi-head latent attention (`kv_lora_rank`, `q_lora_rank`, the head
dims) and dense blocks before the mixture-of-experts ones (`dense_layers`, `dense_ffn`). The catalogue's parameters
against Hugging Face's DeepseekV3ForCausalLM (built on the meta device) and the published counts; two kinds of
block in the catalogue, the memory and time models; the checker's E222 and E226-E229."""
from __future__ import annotations

import pytest

from plandsl import api, ir
from plandsl.cost.estimate import estimate_plan, plan_work
from plandsl.cost.layer import estimate_layer_time, plan_links
from plandsl.cost.memory import estimate_layer_activations
from plandsl.ir.layers import (
    attention_widths,
    block_model,
    figures_key,
    layers_of,
    param_count,
)
from plandsl.ir.shapes import tensor_extents
from tests.support import assert_brute_force_optimum, lazy

torch = lazy("torch")

SMALL = {"layers": 4, "hidden": 64, "heads": 4, "seq": 128, "vocab": 256, "q_lora_rank": 24, "kv_lora_rank": 16,
         "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16, "experts": 8, "top_k": 2, "shared_experts": 1,
         "ffn": 32, "dense_layers": 1, "dense_ffn": 96}


def _model(**arguments) -> ir.TransformerModel:
    text = ", ".join(f"{key}={value}" for key, value in arguments.items())
    return api.loads(f"model m = llama({text})\n").models[0]


def _stdlib(name: str) -> ir.TransformerModel:
    return next(m for m in api.load(api_stdlib("models/deepseek.plan")).models if m.name == name)


def api_stdlib(relative: str) -> str:
    from plandsl.syntax.loader import stdlib_root
    return str(stdlib_root() / relative)


def _active(model: ir.TransformerModel) -> int:
    """Parameters one token runs through: all but the experts it is not routed to."""
    expert = 3 * model.ffn_hidden * model.hidden
    return param_count(model) - (model.layers - model.dense_layers) * (model.experts - model.top_k) * expert


def test_deepseek_v3_has_its_published_671b_and_37b_active():
    """671B and 37B active without its multi-token prediction depth; 685B in its checkpoint with the depth and the
    depth's copies of the embedding and the head (Hugging Face's deepseek-ai/DeepSeek-V3: 671B main model, 14B MTP
    module), which training shares (`mtp`)."""
    trained = _stdlib("deepseek_v3")
    assert trained.mtp == 1  # arXiv:2412.19437, Sec. 4.2: D = 1
    model = trained.model_copy(update={"mtp": 0})
    assert param_count(model) == 671_026_404_352  # DeepSeek-AI 2024, arXiv:2412.19437: 671B total
    assert _active(model) == pytest.approx(37e9, rel=0.02)  # 37B activated for each token
    depth = param_count(trained) - param_count(model)
    assert depth == 11_610_067_968
    assert param_count(model) + depth + 2 * model.vocab * model.hidden == pytest.approx(685e9, rel=0.001)
    lite = _stdlib("deepseek_v2_lite")
    assert param_count(lite) == pytest.approx(15.7e9, rel=0.01)  # arXiv:2405.04434, Appendix B: 15.7B
    assert _active(lite) - lite.vocab * lite.hidden == pytest.approx(2.4e9, rel=0.03)  # 2.4B active (no embedding)


@pytest.mark.slow
@pytest.mark.parametrize("q_lora", [24, 0], ids=["q_lora", "no_q_lora"])
def test_parameters_match_transformers_deepseek_v3(q_lora):
    transformers = pytest.importorskip("transformers")
    config = transformers.DeepseekV3Config(
        vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2,
        first_k_dense_replace=1, q_lora_rank=q_lora or None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=16, n_group=1, topk_group=1, max_position_embeddings=128, tie_word_embeddings=False)
    with torch.device("meta"):
        reference = transformers.DeepseekV3ForCausalLM(config)
    theirs = {name: param.numel() for name, param in reference.named_parameters()}
    model = _model(**{**SMALL, "q_lora_rank": q_lora})
    assert param_count(model) == sum(theirs.values())
    ours = {p.name: p.numel for layer in layers_of(model) for p in layer.params}
    for index in range(model.layers):  # block by block, so a dense block cannot pay for an MoE one
        prefix = f"model.layers.{index}."
        assert sum(n for name, n in ours.items() if name.startswith(f"layers.{index}.")) == \
            sum(n for name, n in theirs.items() if name.startswith(prefix))
    assert ours["layers.0.attn.wkv_a.weight"] == theirs["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"]
    assert ours["layers.0.attn.wkv_b.weight"] == theirs["model.layers.0.self_attn.kv_b_proj.weight"]


@pytest.mark.slow
def test_deepseek_v3_is_transformers_default_deepseek_v3():
    """DeepseekV3Config's defaults are DeepSeek-V3's: its model on the meta device (about 8 s) holds as many
    parameters as models/deepseek's deepseek_v3, 671,026,404,352."""
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        reference = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config())
    # DeepseekV3ForCausalLM builds no multi-token prediction layer (num_nextn_predict_layers is read, not built)
    assert sum(param.numel() for param in reference.parameters()) == \
        param_count(_stdlib("deepseek_v3").model_copy(update={"mtp": 0}))


def test_two_kinds_of_block_each_computed_once():
    model = _model(**SMALL)
    blocks = [layer for layer in layers_of(model) if layer.kind == "block"]
    assert [any(".moe." in p.name for p in b.params) for b in blocks] == [False, True, True, True]
    assert "layers.0.mlp.w1.weight" in {p.name for p in blocks[0].params}
    assert {p.name: p.shape for p in blocks[0].params}["layers.0.mlp.w1.weight"] == (96, 64)
    keys = [figures_key(b) for b in blocks]
    assert keys[0] != keys[1] and keys[1] == keys[2] == keys[3]
    assert block_model(model, blocks[0]).ffn_hidden == 96 and not block_model(model, blocks[0]).experts
    assert block_model(model, blocks[1]) is model and block_model(model, blocks[0]) is block_model(model, 0)
    # FLOPs: 2 per multiply-add of each matmul's weights, plus the core's Q·Kᵀ (nope + rope) and P·V (v)
    dense = blocks[0]
    weights = sum(p.numel for p in dense.params if len(p.shape) == 2)
    assert dense.flops_per_token == 2 * weights + 2 * 128 * 4 * (16 + 8 + 16)


def test_latent_attention_defaults_and_widths():
    model = _model(layers=2, hidden=2048, heads=16, seq=128, vocab=256, kv_lora_rank=512)
    assert model.latent_attention and model.kv_heads == 16
    assert (model.qk_nope_head_dim, model.qk_rope_head_dim, model.v_head_dim, model.q_lora_rank) == (128, 64, 128, 0)
    widths = attention_widths(model)
    assert (widths.q, widths.k, widths.v, widths.o) == (16 * 192, 16 * 192, 16 * 128, 16 * 128)
    assert widths.latent == 2048 + 512 + 64  # no query latent: the block input itself, then the kv latent and rope
    assert not _model(layers=2, hidden=64, heads=4, seq=8, vocab=8).latent_attention


def test_tensor_parallel_splits_dense_ffn_too():
    model = _model(**SMALL)
    assert tensor_extents(model)["dense_ffn"] == 96 and "kv_heads" not in tensor_extents(model)


PLAN = """\
import "clusters/dgx_a100"
plan p {{
  model   = llama(layers=4, hidden=1024, heads=16, seq=1024, vocab=32000, ffn=512, experts=8, top_k=2,
                  shared_experts=1{extra})
  cluster = dgx_a100
  mesh    = [dp = 2, ep = 2, tp = 2]
  train   = {{ global_batch: 16, micro_batch: 2 }}
  data    = zero1 over dp
  experts = alltoall over ep
  tensor  = megatron over tp{sp}
}}
"""
MLA = ", q_lora_rank=384, kv_lora_rank=128, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64"


def _plan(extra: str = "", sp: bool = False, stack: str = "torch") -> ir.Plan:
    options = (" with sequence_parallel" if sp else "") + (f"{',' if sp else ' with'} implementation = {stack}"
                                                         if stack != "torch" else "")
    return api.loads(PLAN.format(extra=extra, sp=options)).plans[0]


def _block_times(plan: ir.Plan):
    blocks = [layer for layer in layers_of(plan.model) if layer.kind == "block"]
    device = plan.cluster.devices_in_order()[0]
    return [estimate_layer_time(plan.model, b, plan_work(plan), device, plan_links(plan)) for b in blocks]


def test_dense_blocks_cost_as_dense_blocks_and_route_nothing():
    plan = _plan(", dense_layers=1, dense_ffn=4096")
    dense, moe = _block_times(plan)[:2]
    assert dense.moved.expert == 0 and moe.moved.expert > 0  # no all-to-all in a dense block
    assert dense.moved.tensor == moe.moved.tensor
    blocks = [layer for layer in layers_of(plan.model) if layer.kind == "block"]
    assert dense.flops == pytest.approx(2 * 1024 * blocks[0].flops_per_token / 2)  # tokens x FLOPs / tp
    all_moe = estimate_plan(_plan())
    mixed = estimate_plan(plan)
    widened = 3 * 4096 * 1024 - (3 * 512 * 1024 * (8 + 1) + 8 * 1024)  # the dense MLP against the MoE layer
    assert mixed.flops_per_step != all_moe.flops_per_step
    assert sum(layer.param_count for layer in layers_of(plan.model)) - \
        sum(layer.param_count for layer in layers_of(_plan().model)) == widened
    kept = [estimate_layer_activations(plan, b) for b in blocks[:2]]
    assert kept[0] != kept[1]


@pytest.mark.parametrize("sp, stack", [(False, "torch"), (True, "megatron"), (True, "torch")])
def test_latent_attention_keeps_and_moves_its_latents(sp, stack):
    plan = _plan(MLA, sp, stack)
    block = next(layer for layer in layers_of(plan.model) if layer.kind == "block")
    # kept: 2 bytes per element: the block's norms, inputs, latents (query 384, kv 128, twice: norm input and
    # up-projection input), rope key (32), per-head Q, K (96 wide), V and output (64 wide) split by tp, the
    # experts'; against the GQA block of the same model: the attention terms differ only. Under sequence
    # parallelism Megatron-LM's layers keep the latents on the sequence shard; torch's compute the down-projections
    # duplicated on the gathered input and keep them whole (`cost.memory._gathered_terms`)
    gqa = _plan(sp=sp, stack=stack)
    tokens = 1024 * 2
    divisor = 2 if sp else 1
    difference = estimate_layer_activations(plan, block) - estimate_layer_activations(
        gqa, next(layer for layer in layers_of(gqa.model) if layer.kind == "block"))
    mla_terms = (4 * (384 + 128) + 2 * 32) / (divisor if stack == "megatron" else 1) \
        + (2 * 16 * 96 * 2 + 2 * 16 * 64 * 2) / 2
    gqa_terms = (2 * 1024 + 4 * 1024 + 2 * 1024) / 2
    assert difference == pytest.approx(tokens * (mla_terms - gqa_terms))
    time = _block_times(plan)[0]
    activation, latent = tokens * 1024 * 2, tokens * (384 + 128 + 32) * 2
    # the attention half's column-parallel input is the latents: all-gathered (sp) or all-reduced (backward); under
    # sp the experts' dispatcher gathers and scatters the top_k (2) routed copies over the tensor axis, the shared
    # expert its own [b, s, h] (test_moe_cost.py), each way
    expected = (activation + latent) * 2 + 2 * (2 * activation + activation) * 2 if sp \
        else activation * 2 + latent + activation
    assert time.moved.tensor == pytest.approx(expected)
    estimate = estimate_plan(plan)
    assert estimate.fits and estimate.flops_per_step > 0


def test_sequence_parallelism_splits_the_latents_down_projections():
    """Megatron-Core runs MLA's replicated down-projections (wq_a, wkv_a) on each rank's sequence shard under
    sequence parallelism, then gathers the latents; without it every rank computes them for every token."""
    whole, shard = (_block_times(_plan(MLA, sp))[0].flops for sp in (False, True))
    tokens, hidden, tp = 2 * 1024, 1024, 2
    assert whole - shard == pytest.approx(2 * tokens * (1 - 1 / tp) * hidden * (384 + 128 + 32))


CHECKED = """\
import "clusters/dgx_a100"
plan p {{
  model   = llama(layers=8, hidden=1024, heads=16, seq=2048, vocab=32000{args})
  cluster = dgx_a100 x 1
  mesh    = [dp = 8]
  train   = {{ global_batch: 64, micro_batch: 2 }}
}}
"""


@pytest.mark.parametrize("args, codes", [
    (", q_lora_rank=256, v_head_dim=64", ["E226"]),
    (", kv_lora_rank=128, kv_heads=4", ["E227"]),
    (", kv_lora_rank=128, qk_rope_head_dim=31", ["E222"]),
    (", experts=8, dense_layers=8", ["E228"]),
    (", dense_layers=2", ["E229"]),
    (", experts=8, dense_ffn=4096", ["E229"]),
    (", kv_lora_rank=128, hidden=1000", None),  # under MLA the head dims are its own: hidden/heads need not divide
    (", experts=8, dense_layers=2, kv_lora_rank=64, q_lora_rank=96", []),
], ids=["E226", "E227", "E222", "E228", "E229", "E229_ffn", "mla_hidden", "clean"])
def test_checker_rules(args, codes):
    if codes is None:  # a second `hidden`: E213; written once instead
        text = CHECKED.format(args=", kv_lora_rank=128, qk_nope_head_dim=64").replace("hidden=1024", "hidden=1000")
        assert not api.checks(text).errors, [str(d) for d in api.checks(text).errors]
        return
    analysis = api.checks(CHECKED.format(args=args))
    assert [d.code for d in analysis.errors] == codes, [str(d) for d in analysis.errors]


def test_gpt_takes_no_latent_attention():
    analysis = api.checks(CHECKED.format(args=", kv_lora_rank=128").replace("llama(", "gpt("))
    assert [d.code for d in analysis.errors] == ["E212"]


def test_tensor_parallel_degree_must_divide_dense_ffn():
    text = CHECKED.format(args=", experts=8, dense_layers=2, dense_ffn=4098").replace("[dp = 8]", "[dp = 2, tp = 4]")
    text = text.replace("micro_batch: 2 }", "micro_batch: 2 }\n  tensor  = megatron over tp")
    analysis = api.checks(text)
    assert [d.code for d in analysis.errors] == ["E406"] and "dense_ffn" in analysis.errors[0].message


@pytest.mark.parametrize("q_lora", [24, 0], ids=["q_lora", "no_q_lora"])
def test_the_interpreters_module_is_the_catalogue(q_lora):
    from plandsl.runtime.models import build_model
    model = _model(**{**SMALL, "q_lora_rank": q_lora})
    module = build_model(model, seed=0)
    assert {name: tuple(p.shape) for name, p in module.named_parameters()} == \
        {p.name: p.shape for layer in layers_of(model) for p in layer.params}
    logits = module(torch.randint(0, 256, (2, 16)))
    logits.float().sum().backward()
    assert logits.shape == (2, 16, 256) and all(p.grad is not None for p in module.parameters())


def test_ring_context_parallelism_refuses_values_wider_than_keys():
    """The interpreter pads MLA's values to the query/key head width, so that the fused kernels (the CPU flash
    kernel every ring step calls) run: narrower values run under ring, wider ones cannot be padded (E704)."""
    from plandsl.runtime.support import refusals
    text = CHECKED.format(args=", kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=VALUE")
    text = text.replace("[dp = 8]", "[dp = 4, cp = 2]").replace("micro_batch: 2 }", "micro_batch: 2 }\n  context = KIND over cp")

    def plan(value: int, kind: str) -> ir.Plan:
        return api.loads(text.replace("VALUE", str(value)).replace("KIND", kind)).plans[0]

    assert [d.code for d in refusals(plan(128, "ring"), cuda=False)] == ["E704"]
    for value, kind in ((128, "allgather"), (64, "ring"), (96, "ring")):
        assert refusals(plan(value, kind), cuda=False) == []


# ---- the search -------------------------------------------------------------------------------------------
HARDWARE = """
device gpu { memory = 16 GiB; bandwidth = 1000 GB/s; peak = { bf16: 200 TFLOP/s, fp32: 20 TFLOP/s } }
node box { devices = 2 x gpu; link = { bandwidth: 100 GB/s, latency: 2 us }; nic = { bandwidth: 20 GB/s, latency: 5 us } }
cluster pair = box x 2
"""
MIXED = ("llama(layers=6, hidden=512, heads=8, seq=512, vocab=4096, kv_lora_rank=64, q_lora_rank=96, experts=4, "
         "top_k=2, ffn=256, dense_layers={dense}, dense_ffn=32768)")


def _problem(dense: int = 2):
    from plandsl.search import Problem
    document = api.loads(HARDWARE + f"model m = {MIXED.format(dense=dense)}\n")
    return Problem(document.models[0], document.clusters[0], 8, None)


def test_the_search_finds_the_brute_force_optimum_of_two_kinds_of_block():
    assert_brute_force_optimum(_problem(), {"recompute": "none", "zero_stage": 1})


@pytest.mark.parametrize("dense", [1, 3])
def test_stages_split_the_blocks_in_order_at_their_own_costs(dense):
    """The pipeline's blocks per stage minimise the slowest stage over every split of the blocks in order,
    each block at its kind's seconds (the heavy dense blocks first), not as if all were the first block."""
    from plandsl.cost.compute import DEFAULT_EFFICIENCY
    from plandsl.search.space import Space
    space = Space(_problem(dense), {"pp": 2, "dp": 2, "tp": 1, "schedule": "1f1b", "virtual_stages": 1,
                                    "recompute": "none", "zero_stage": 1, "micro_batch_size": 1,
                                    "order": ("pp", "dp")}, DEFAULT_EFFICIENCY)
    (root,) = space.roots()
    (node,) = space.expand_root(root)
    (leaf,) = space.expand(node)
    seconds = [t.forward + t.backward for t in space.figures.kind_times(node, root.rank_devices[0])]
    blocks = [seconds[4]] * dense + [seconds[1]] * (6 - dense)

    def slowest(counts):
        return max(seconds[0] + sum(blocks[:counts[0]]), sum(blocks[counts[0]:]) + seconds[2] + seconds[3])

    best = min(slowest((n, 6 - n)) for n in range(1, 6))
    assert slowest(leaf.counts) == pytest.approx(best)
    if dense == 3:  # three heavy blocks first: the first stage takes fewer than half
        assert leaf.counts[0] < 3 and slowest((3, 3)) > best


def test_a_mixed_stage_is_timed_block_by_block():
    """The estimate times each kind of block on its own (a cache keyed by the layer's kind gave every block of a
    stage the first one's time)."""
    from plandsl.cost.estimate import estimate_stage_times
    from plandsl.ir.placement import assign_stages
    plan = _plan(", dense_layers=1, dense_ffn=4096")
    assignment = assign_stages(plan)[0]
    (stage,) = estimate_stage_times(plan, assignment)
    device = plan.cluster.devices_in_order()[0]
    expected = sum(estimate_layer_time(plan.model, layer, plan_work(plan), device, plan_links(plan)).flops
                   for layer in assignment.stage_layers[0])
    assert stage.flops == pytest.approx(expected)


# ---- interop ----------------------------------------------------------------------------------------------
RECIPE = """--num-layers 61 --hidden-size 7168 --ffn-hidden-size 18432 --num-attention-heads 128
--multi-latent-attention --q-lora-rank 1536 --kv-lora-rank 512 --qk-head-dim 128 --qk-pos-emb-head-dim 64
--v-head-dim 128 --rotary-scaling-factor 40 --mscale 1.0 --mscale-all-dim 1.0
--seq-length 4096 --max-position-embeddings 4096 --padded-vocab-size 129280 --normalization RMSNorm --swiglu
--position-embedding-type rope --disable-bias-linear --untie-embeddings-and-output-weights
--num-experts 256 --moe-router-topk 8 --moe-ffn-hidden-size 2048 --moe-shared-expert-intermediate-size 2048
--moe-layer-freq ([0]*3+[1]*58) --moe-router-num-groups 8 --moe-router-group-topk 4
--moe-router-score-function sigmoid --moe-router-enable-expert-bias
--micro-batch-size 1 --global-batch-size 15360 --bf16 --tensor-model-parallel-size 1
--pipeline-model-parallel-size 16 --decoder-first-pipeline-num-layers 3 --decoder-last-pipeline-num-layers 2
--expert-model-parallel-size 64 --use-distributed-optimizer --use-precision-aware-optimizer --main-grads-dtype bf16
--exp-avg-dtype bf16 --exp-avg-sq-dtype bf16 --recompute-granularity full --recompute-method uniform
--recompute-num-layers 1 --mtp-num-layers 1 --mtp-loss-scaling-factor 0.1
"""


def _imported(text: str, world_size: int = 2048):
    from plandsl.interop import import_text
    return import_text("megatron", text, "recipe.args", world_size=world_size, cluster="dgx_h100 x 256")


def test_megatron_recipe_of_deepseek_v3_imports_as_models_deepseek():
    """DeepSeek-V3's Megatron-LM flags (MLA, dense layers first by --moe-layer-freq, the experts' own width;
    YaRN and the sigmoid router, which change no parameter or FLOP, read and left out) are models/deepseek's."""
    imported = _imported(RECIPE)
    assert imported.ok, [str(d) for d in imported.diagnostics]
    model = api.select_plan(api.loads(imported.text, path="recipe.plan")).model
    assert model.model_dump(exclude={"name"}) == _stdlib("deepseek_v3").model_dump(exclude={"name"})


@pytest.mark.parametrize("q_lora", [True, False])
def test_megatron_export_and_import_round_trip(q_lora):
    from plandsl.interop import export_plan
    plan = _plan(MLA if q_lora else MLA.replace("q_lora_rank=384, ", "") + ", dense_layers=1, dense_ffn=4096")
    exported = export_plan(plan, "megatron")
    assert ("--q-lora-rank 384" in exported.text) == q_lora and "--multi-latent-attention" in exported.text
    imported = _imported(exported.text, world_size=plan.mesh.size)
    assert imported.ok, [str(d) for d in imported.diagnostics]
    back = api.select_plan(api.loads(imported.text, path="back.plan")).model
    assert back.model_dump(exclude={"name"}) == plan.model.model_dump(exclude={"name"})


@pytest.mark.parametrize("change, code", [
    (("--multi-latent-attention ", ""), "E805"),                         # MLA's shapes without it: ignored there
    (("--moe-layer-freq ([0]*3+[1]*58)", "--moe-layer-freq ([1]*3+[0]*2)*12+[1]"), "E807"),  # MoE at uneven steps
    (("--moe-layer-freq ([0]*3+[1]*58)", "--moe-layer-freq ([0]*3+[1]*57)"), "E804"),  # not one entry per layer
    (("--moe-layer-freq ([0]*3+[1]*58)", "--moe-layer-freq __import__('os')"), "E804"),  # no code is run
    (("--num-experts 256 --moe-router-topk 8", ""), "E805"),             # an expert width without experts
])
def test_megatron_import_says_what_a_plan_cannot_hold(change, code):
    imported = _imported(RECIPE.replace(*change))
    assert not imported.ok and code in [d.code for d in imported.diagnostics], [str(d) for d in imported.diagnostics]


def test_torchtitan_cannot_express_latent_attention():
    from plandsl.interop import export_plan
    text = """import "clusters/dgx_h100"
plan p {
  model = llama(layers=32, hidden=4096, heads=32, ffn=14336, seq=8192, vocab=128256, kv_lora_rank=512)
  cluster = dgx_h100
  mesh = [dp = 8]
  train = { global_batch: 16, recompute: full }
  data = zero3 over dp with gather = bf16
}
"""
    lost = export_plan(api.loads(text).plans[0], "torchtitan").lost
    assert [d.code for d in lost] == ["E808"] and "multi-head latent attention" in lost[0].message


def test_shrink_keeps_the_architecture(tmp_path):
    """`plandsl shrink` of a DeepSeek plan is a tiny DeepSeek: latent attention (with its query latent), shared
    experts and the dense blocks first stay, as does a parallel residual."""
    path = tmp_path / "v3.plan"
    path.write_text("""import "clusters/dgx_h100"
import "models/deepseek"
plan v3 {
  model   = deepseek_v3
  cluster = dgx_h100 x 256
  mesh    = [dp = 2, pp = 16, ep = 64]
  train   = { global_batch: 15360, micro_batch: 1, recompute: full, grad_dtype: bf16, optimizer_dtype: bf16 }
  data    = zero1 over dp
  experts = alltoall over ep
  stages  = evenly over pp
}
""")
    small = api.shrink(path).plan.model
    assert small.latent_attention and small.q_lora_rank and small.kv_heads == small.heads
    assert small.shared_experts == 1 and 0 < small.dense_layers < small.layers and small.dense_ffn
    assert small.hidden <= 128 and small.experts <= 8


def test_the_partition_table_row_at_once_is_the_loop(monkeypatch):
    """`partition_layers` computes each stage's row of its table as one array (a DeepSeek-V3 leaf: 0.45 ms instead
    of 9.5): the same splits as the cell-by-cell loop, ties (the smallest cut) and memory caps included."""
    import random

    from plandsl.search import partition
    rng = random.Random(20)
    found = 0
    for _ in range(400):
        stages, layers = rng.randint(1, 5), rng.randint(1, 10)
        costs = [[rng.choice([0.0, 0.1, 0.5, 1.0, 3.0]) for _ in range(layers)] for _ in range(stages)]
        memory = [[rng.choice([0.0, 1.0, 2.0]) for _ in range(layers)] for _ in range(stages)]
        caps = [rng.choice([1.0, 2.0, 4.0, 100.0]) for _ in range(stages)]
        fixed = [rng.choice([0.0, 0.3, 1.5]) for _ in range(stages)]
        table = partition.partition_layers(costs, memory, caps, fixed)
        with monkeypatch.context() as patched:
            patched.setattr(partition, "TABLE_LAYERS", 0)
            assert partition.partition_layers(costs, memory, caps, fixed) == table
        found += table is not None
    assert found > 100


def test_selective_op_refuses_latent_attention_and_the_search_leaves_it_out():
    """torch's op-level policy keeps every other matmul's output: under MLA those are the latents, not what
    the memory model counts, so run refuses it (E704) and the search does not propose it."""
    from plandsl.cost.compute import DEFAULT_EFFICIENCY
    from plandsl.runtime.support import refusals
    from plandsl.search.space import Space
    plan = api.loads(CHECKED.format(args=", kv_lora_rank=128").replace("micro_batch: 2 }",
                                                                       "micro_batch: 2, recompute: selective_op }")).plans[0]
    assert [d.code for d in refusals(plan, cuda=False)] == ["E704"] and "latent" in refusals(plan, cuda=False)[0].message
    from plandsl.search import Problem
    document = api.loads(HARDWARE + "model m = llama(layers=4, hidden=512, heads=8, seq=512, vocab=4096, "
                                    "kv_lora_rank=64)\n")
    space = Space(Problem(document.models[0], document.clusters[0], 8, None), {"pp": 1, "tp": 1, "cp": 1},
                  DEFAULT_EFFICIENCY)
    assert {node.recompute for root in space.roots() for node in space.expand_root(root)} == {"none", "selective", "full"}


@pytest.mark.parametrize("q_lora", [24, 0], ids=["q_lora", "no_q_lora"])
@pytest.mark.parametrize("mode", ["none", "selective", "full"])
@pytest.mark.parametrize("value", [24, 12], ids=["v_as_wide", "v_narrower"])
def test_a_latent_attention_block_keeps_what_the_memory_model_counts(mode, q_lora, value):
    """tests/unit/test_recompute.py's measurement on an MLA block: the bytes the runtime's block leaves alive for
    its backward are the memory model's, byte for byte (the latents before and after their norms, the shared
    rotary key, per head q, k, v and the core's output), when values are as wide as queries and keys. Narrower
    ones the interpreter pads to that width for the fused kernel: it keeps heads x (qk - v) more per token (the
    padding), and without recomputing the core heads x qk more (the padded output beside wo's input)."""
    from test_recompute import BATCH, HIDDEN, SEQ, _block, _kept_bytes

    from plandsl.cost.memory import transformer_block_activations
    text = (f"llama(layers=1, hidden={HIDDEN}, heads=4, seq={SEQ}, vocab=128, ffn=224, kv_lora_rank=16, "
            f"qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim={value}{f', q_lora_rank={q_lora}' if q_lora else ''})")
    model, block = _block(text, mode)
    x = torch.randn(BATCH, SEQ, HIDDEN, requires_grad=True)
    kept, _ = _kept_bytes(block, x)
    modelled = transformer_block_activations(model, SEQ, BATCH, 1, False, ir.Recompute(mode), ir.Precision.fp32)
    padding = {"none": 4 * (24 - value) + (4 * 24 if value < 24 else 0), "selective": 4 * (24 - value), "full": 0}
    assert kept + x.numel() * x.element_size() - modelled == BATCH * SEQ * 4 * padding[mode]
