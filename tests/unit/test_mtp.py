"""Multi-token prediction (`mtp=N`, DeepSeek-V3's, Megatron-LM's --mtp-num-layers): the language and the checker's
E233 and E234, the catalogue's parameters and FLOPs (on the head), the time and memory models (the depths on the
head's stage, with a copy of the embedding), the search (its head kind carries the depths), Megatron interop both ways
(the layout's `m`), and the interpreter: its loss against Megatron's rolled and masked one, no E703 beside any
parallelism (tests/distributed/test_model_variants_run.py runs it under data, expert, tensor and sequence parallelism
against one process, tests/distributed/test_mtp_pipeline_run.py on pipelines and under context parallelism)."""
from __future__ import annotations

import pytest

from plandsl import api, ir
from plandsl.cost.estimate import estimate_plan, plan_work
from plandsl.cost.layer import estimate_layer_time, plan_links
from plandsl.cost.memory import _mtp_activations, estimate_layer_activations
from plandsl.ir.layers import layers_of, mtp_block, param_count, transformer_block_flops
from tests.unit.test_deepseek import HARDWARE, MIXED, PLAN, _imported, _plan
from tests.support import assert_brute_force_optimum

PIPELINE = """\
import "clusters/dgx_a100"
plan p {{
  model   = llama(layers=4, hidden=1024, heads=16, seq=1024, vocab=32000, ffn=512, experts=8, top_k=2{extra})
  cluster = dgx_a100
  mesh    = [pp = 2, ep = 2, tp = 2]
  train   = {{ global_batch: 16, micro_batch: 2 }}
  experts = alltoall over ep
  tensor  = megatron over tp
  stages  = evenly over pp
  schedule = 1f1b
}}
"""


def _codes(text: str) -> list[str]:
    return [d.code for d in api.checks(text).diagnostics]


def _pipelined(extra: str = "") -> ir.Plan:
    return api.loads(PIPELINE.format(extra=extra)).plans[0]


def _head(model: ir.TransformerModel):
    return next(layer for layer in layers_of(model) if layer.kind == "head")


# ---- language and checker --------------------------------------------------------------------------------------
def test_mtp_lowers_and_dumps_only_when_written():
    plan = _plan(", mtp=2")
    assert plan.model.mtp == 2 and "mtp" in plan.model.model_dump()
    assert "mtp" not in _plan().model.model_dump()  # plans without it dump (and hash) as before
    assert _codes(PLAN.format(extra=", mtp=1", sp="")) == []


def test_e233_mtp_on_learned_positions():
    text = PLAN.format(extra="", sp="").replace(
        "llama(layers=4, hidden=1024, heads=16, seq=1024, vocab=32000, ffn=512, experts=8, top_k=2,\n"
        "                  shared_experts=1)", "gpt(layers=4, hidden=1024, heads=16, seq=1024, vocab=32000, mtp=1)")
    assert "E233" in _codes(text)


def test_e234_a_depth_with_no_token_to_predict():
    """A 4-token sequence's sample holds 5 tokens: depth 3 predicts the 5th from position 0, depth 4 nothing."""
    text = PLAN.format(extra=", mtp=4", sp="").replace("seq=1024", "seq=4")
    assert _codes(text) == ["E234"]
    assert _codes(text.replace("mtp=4", "mtp=3")) == []


# ---- catalogue ----------------------------------------------------------------------------------------------------
def test_depths_are_the_heads_parameters_and_flops():
    plain, deep = _plan().model, _plan(", mtp=2").model
    h, v = plain.hidden, plain.vocab
    block = layers_of(plain)[plain.layers]  # the last block: the depths' kind
    per_depth = 3 * h + 2 * h * h + block.param_count  # enorm, hnorm, final norm; eh_proj; the block
    assert param_count(deep) - param_count(plain) == 2 * per_depth
    names = {p.name for p in _head(deep).params}
    assert {"mtp.1.eh_proj.weight", "mtp.0.enorm.weight", "mtp.0.block.moe.experts.w1", "mtp.1.norm.weight"} <= names
    assert {p.name: p.shape for p in _head(deep).params}["mtp.0.eh_proj.weight"] == (h, 2 * h)
    assert [layer.name for layer in layers_of(deep)] == [layer.name for layer in layers_of(plain)]
    added = _head(deep).flops_per_token - _head(plain).flops_per_token
    assert added == 2 * (2 * 2 * h * h + transformer_block_flops(plain) + 2 * h * v)


def test_the_depths_block_is_the_last_blocks_kind():
    """Megatron-Core builds the depth from the decoder's last layer spec and counts it MoE when the last layer is
    (training.py's last_layer_is_moe): a dense-then-MoE model's depth is MoE, a model whose last block is dense
    (moe_every with moe_offset=0 over an even count) has a dense one."""
    dense_last = api.loads(f"model m = {MIXED.format(dense=2)}\n".replace(
        "dense_layers=2", "moe_every=2, moe_offset=0")).models[0]
    assert not dense_last.moe_block(dense_last.layers - 1) and not mtp_block(dense_last).experts
    moe_last = api.loads(f"model m = {MIXED.format(dense=2)}\n").models[0]
    assert mtp_block(moe_last) is moe_last


# ---- time and memory --------------------------------------------------------------------------------------------
def test_a_depth_adds_a_block_a_projection_and_a_head_to_the_heads_time():
    plain, deep = _plan(), _plan(", mtp=1")
    device, work, links = plain.cluster.devices_in_order()[0], plan_work(plain), plan_links(plain)
    head = estimate_layer_time(plain.model, _head(plain.model), work, device, links)
    block = estimate_layer_time(plain.model, layers_of(plain.model)[plain.model.layers], work, device, links)
    both = estimate_layer_time(deep.model, _head(deep.model), work, device, links)
    assert both.forward > head.forward * 2 + block.forward - 1e-12
    assert both.moved.expert == pytest.approx(block.moved.expert)  # the depth's MoE block's all-to-alls
    assert both.moved.tensor > head.moved.tensor + block.moved.tensor
    assert both.flops == pytest.approx(head.flops * 2 + block.flops + 2.0 * work.tokens * 1024 * 2048 / 2)


def test_the_head_keeps_the_depths_activations():
    plain, deep = _plan(), _plan(", mtp=1")
    block = layers_of(plain.model)[plain.model.layers]
    head = estimate_layer_activations(plain, _head(plain.model))
    kept = estimate_layer_activations(deep, _head(deep.model))
    assert kept > 2 * head + estimate_layer_activations(plain, block)


def test_the_last_stage_holds_the_depths_and_a_copy_of_the_embedding():
    """megatron-core builds the embedding on the MTP stage too (gpt_model.py:149): the last rank holds its states."""
    plain, deep = estimate_plan(_pipelined()), estimate_plan(_pipelined(", mtp=1"))
    assert deep.memory[0].params == plain.memory[0].params  # the first rank: unchanged
    model = _pipelined(", mtp=1").model
    embedding = model.vocab * model.hidden // 2  # vocabulary-parallel over tp = 2
    depth = sum(p.numel for p in _head(model).params if p.name.startswith("mtp.") and "experts" not in p.name) // 2
    assert deep.memory[1].params - plain.memory[1].params >= (embedding + depth) * 2 - 1
    assert deep.model_flops_per_step > plain.model_flops_per_step and deep.time.step > plain.time.step


def test_model_flops_count_the_depths_as_megatron_does():
    """Megatron-LM core_v0.16.1's num_floating_point_operations counts each depth as one more layer of the last
    layer's kind, its projection (2h x h) and one more logit GEMM (training.py:354-358, 553-572): 3 x forward."""
    plain, deep = estimate_plan(_plan()), estimate_plan(_plan(", mtp=1"))
    model = _plan().model
    tokens, tp = 16 * model.seq, 2
    per_token = 2 * 2 * model.hidden ** 2 + transformer_block_flops(model) + 2 * model.hidden * model.vocab
    per_token += 2 * model.hidden * model.experts * (tp - 1)  # the router, run whole on each tensor rank (as a block's)
    assert deep.model_flops_per_step - plain.model_flops_per_step == pytest.approx(3 * tokens * per_token, rel=1e-9)


# ---- search -------------------------------------------------------------------------------------------------------
def test_the_search_finds_the_brute_force_optimum_with_a_depth():
    from plandsl.search import Problem
    document = api.loads(HARDWARE + f"model m = {MIXED.format(dense=2).replace(')', ', mtp=1)')}\n")
    assert document.models[0].mtp == 1
    assert_brute_force_optimum(Problem(document.models[0], document.clusters[0], 8, None),
                               {"recompute": "none", "zero_stage": 1})


# ---- Megatron interop -------------------------------------------------------------------------------------------
def test_megatron_export_and_import_round_trip():
    from plandsl.interop import export_plan
    plan = _pipelined(", mtp=1")
    exported = export_plan(plan, "megatron")
    assert "--mtp-num-layers 1" in exported.text
    imported = _imported(exported.text, world_size=plan.mesh.size)
    assert imported.ok, [str(d) for d in imported.diagnostics]
    back = api.select_plan(api.loads(imported.text, path="back.plan")).model
    assert back.model_dump(exclude={"name"}) == plan.model.model_dump(exclude={"name"})


def test_megatron_layout_places_the_depths_before_the_loss():
    from plandsl.interop import export_plan
    plan = api.loads(PIPELINE.format(extra=", mtp=2").replace("stages  = evenly over pp",
                                                              "stages {\n    0: embed, layers[0:3]\n"
                                                              "    1: layers[3:4], norm, head\n  }")).plans[0]
    exported = export_plan(plan, "megatron")
    assert "--pipeline-model-parallel-layout 'Et*3|tmmL'" in exported.text, exported.text
    imported = _imported(exported.text, world_size=plan.mesh.size)
    assert imported.ok, [str(d) for d in imported.diagnostics]


def test_shrink_keeps_the_depths(tmp_path):
    from plandsl.rewrite.shrink import shrink
    path = tmp_path / "deepseek.plan"
    path.write_text('import "clusters/dgx_h100"\nplan p {\n  model = llama(layers=8, hidden=1024, heads=16, '
                    'seq=1024, vocab=32000, ffn=512, experts=8, top_k=2, dense_layers=1, mtp=2)\n'
                    '  cluster = dgx_h100\n  mesh = [dp = 4, ep = 2]\n'
                    '  train = { global_batch: 64, micro_batch: 1 }\n  experts = alltoall over ep\n}\n')
    small = shrink(path).plan
    assert small.model.mtp == 2 and api.run_refusals(small) == []


def test_torchtitan_export_loses_the_depths():
    """A llama3_8b with a depth is no registry flavor of torchtitan's llama3 (E808), not the flavor without it."""
    from plandsl.interop import export_plan
    text = """import "clusters/dgx_h100"
import "models/llama3"
plan p {{
  model   = llama(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, seq=8192, vocab=128256{extra})
  cluster = dgx_h100
  mesh    = [dp = 8]
  train   = {{ global_batch: 64, micro_batch: 1, recompute: full }}
  data    = zero3 over dp with gather = bf16
}}
"""
    assert not export_plan(api.loads(text.format(extra="")).plans[0], "torchtitan").lost
    lost = export_plan(api.loads(text.format(extra=", mtp=1")).plans[0], "torchtitan").lost
    assert [d.code for d in lost] == ["E808"] and "multi-token prediction" in lost[0].message


@pytest.mark.parametrize("layout, extra", [
    ("Et*30|t*31mL", ""),              # an m without --mtp-num-layers
    ("Et*30|t*31L", "--mtp-num-layers 1"),  # --mtp-num-layers without its m in a layout
    ("Et*30m|t*31L", "--mtp-num-layers 1"),  # a depth away from the loss
])
def test_megatron_import_refuses_depths_a_plan_cannot_place(layout, extra):
    from tests.unit.test_deepseek import RECIPE
    recipe = RECIPE.replace("--mtp-num-layers 1 ", "").replace(
        "--decoder-first-pipeline-num-layers 3 --decoder-last-pipeline-num-layers 2",
        f"--pipeline-model-parallel-layout {layout} {extra}").replace("--pipeline-model-parallel-size 16",
                                                                      "--pipeline-model-parallel-size 2")
    imported = _imported(recipe, world_size=256)
    assert not imported.ok and "E805" in [d.code for d in imported.diagnostics], imported.diagnostics


# ---- run ----------------------------------------------------------------------------------------------------------
def test_run_runs_depths_beside_every_parallelism():
    assert api.run_refusals(_plan(", mtp=1", sp=True)) == []  # sequence parallelism
    assert api.run_refusals(_plan(", mtp=1")) == []  # tensor parallelism without sequence parallelism
    assert api.run_refusals(_pipelined(", mtp=1")) == []  # the depths on the last stage (test_mtp_pipeline_run.py)
    context = PIPELINE.format(extra=", mtp=1").replace("[pp = 2, ep = 2, tp = 2]", "[pp = 2, cp = 2, tp = 2]") \
        .replace("experts = alltoall over ep", "context = allgather over cp")
    context = api.loads(context).plans[0]
    assert (context.cp, context.ep, context.model.mtp) == (2, 1, 1)  # the replacements took (else it checks nothing new)
    assert api.run_refusals(context) == []  # context parallelism, fed the whole rows
    assert api.run_refusals(_plan()) == [] and api.run_refusals(_pipelined()) == []
    data = PLAN.format(extra=", mtp=1", sp="").replace("mesh    = [dp = 2, ep = 2, tp = 2]", "mesh    = [dp = 4, ep = 2]") \
        .replace("  tensor  = megatron over tp\n", "")
    data = api.loads(data).plans[0]
    assert (data.mesh.degree("dp"), data.ep, data.tp, data.model.mtp) == (4, 2, 1, 1)
    assert api.run_refusals(data) == []  # data and expert parallelism run it


TINY = "llama(layers=2, hidden=32, heads=4, seq=16, vocab=64, ffn=32, experts=4, top_k=2, dense_layers=1, mtp=2)"


def _tiny():
    torch = pytest.importorskip("torch")
    from plandsl.runtime.models import build_model
    model = api.loads(f"model m = {TINY}\n").models[0]
    return torch, model, build_model(model, seed=0)


def test_run_refuses_depths_beside_uneven_shares_over_fsdp_groups_of_modules():
    """Drawn by tests/property/test_check_runs.py: mtp=1, `batch_shares: [7, 1]`, zero3 `with unit = module` on 2
    ranks aborted in gloo (the head, its own FSDP2 group, runs twice a microbatch; the single-microbatch rank's
    reduce-scatters fell out of step with the other's). Gathering by block, or even shares, run."""
    text = """import "clusters/local"
plan p {
  model   = llama(layers=2, hidden=32, heads=4, seq=8, vocab=16, mtp=1)
  cluster = localhost
  mesh    = [dp = 2] over devices[0:2]
  train   = { global_batch: 8, micro_batch: 1, precision: fp32, batch_shares: [7, 1] }
  data    = DATA
}
"""
    for data, refused in (("zero3 over dp with unit = module", ["E703"]), ("zero2 over dp with unit = module", ["E703"]),
                          ("zero3 over dp", []), ("replicate over dp", [])):
        refusals = api.run_refusals(api.select_plan(api.loads(text.replace("DATA", data))))
        assert [d.code for d in refusals] == refused, data
    even = api.loads(text.replace("DATA", "zero3 over dp with unit = module").replace(", batch_shares: [7, 1]", ""))
    assert api.run_refusals(api.select_plan(even)) == []


def test_the_interpreters_modules_are_the_catalogues():
    _, model, module = _tiny()
    assert {name: tuple(p.shape) for name, p in module.named_parameters()} == \
        {p.name: p.shape for layer in layers_of(model) for p in layer.params}


@pytest.mark.parametrize("fused", [False, True])
def test_the_loss_is_megatrons_rolled_and_masked_depths(fused):
    """`Transformer.loss_with_depths` rolls the tokens and leaves the positions past the end out of each depth's loss;
    megatron-core 0.16.1 rolls the ids and labels
    by one a depth (zero at the end), masks those positions and averages over the rest, each depth's loss weighed by
    mtp_loss_scaling_factor / mtp (gpt_model.py:611-660, multi_token_prediction.py:127, 681-821): written here
    as Megatron does it, from the model's own modules."""
    torch, model, module = _tiny()
    import torch.nn.functional as F
    module.loss_in_head = fused
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 64, (2, 16), generator=generator)
    targets = torch.randint(0, 64, (2, 16), generator=generator)
    ours = module(tokens, targets)

    def roll(t):
        rolled = torch.roll(t, -1, dims=-1)
        rolled[..., -1] = 0
        return rolled

    h = module.norm(module.layers["1"](module.layers["0"](module.embed(tokens))))
    theirs = F.cross_entropy(F.linear(h, module.head.weight).flatten(0, 1), targets.flatten())
    ids, labels, mask = tokens, targets, torch.ones_like(targets, dtype=torch.float32)
    for depth in module.mtp.values():
        ids, labels, mask = roll(ids), roll(labels), roll(mask)
        h = depth.norm(depth.block(depth.eh_proj(torch.cat((depth.enorm(module.embed(ids)), depth.hnorm(h)), -1))))
        each = F.cross_entropy(F.linear(h, module.head.weight).flatten(0, 1), labels.flatten(), reduction="none")
        theirs = theirs + 0.1 / 2 * (each * mask.flatten()).sum() / mask.sum()
    assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-6), (ours, theirs)
    ours.backward()
    assert all(p.grad is not None for name, p in module.named_parameters() if name.startswith("mtp.1."))


_PRECISION = """import "clusters/{cluster}"
plan p {{
  model   = llama(layers=4, hidden=1024, heads=16, seq=1024, vocab=32000, mtp={mtp})
  cluster = {cluster} x 1
  mesh    = [dp = 8]
  train   = {{ global_batch: 64, micro_batch: 2, precision: {precision}{extra} }}
}}
"""


def _depth_cost(cluster: str, precision: str, extra: str = "") -> tuple[float, float]:
    """(seconds a step the one depth adds, bytes it keeps for a microbatch: `cost.memory._mtp_activations`)."""
    plans = [api.loads(_PRECISION.format(cluster=cluster, mtp=mtp, precision=precision, extra=extra),
                       path="p.plan").plans[0] for mtp in (0, 1)]
    estimates = [estimate_plan(plan) for plan in plans]
    return (estimates[1].time.step - estimates[0].time.step,
            _mtp_activations(plans[1], plans[1].train.recompute, False, None))


def test_the_depths_run_under_the_global_fp8_context_and_never_in_fp4():
    """megatron-core 0.16.1 runs a depth under the global FP8 context (multi_token_prediction.py:772-781): in FP8
    though bf16_last_layers keeps the last block in bf16, and in bf16 under NVFP4 ("ignoring FP4 in MTP layers")."""
    fp8, fp8_last_bf16, bf16 = (_depth_cost("dgx_h100", p, e) for p, e in
                                (("fp8", ""), ("fp8", ", bf16_last_layers: 1"), ("bf16", "")))
    assert fp8_last_bf16 == pytest.approx(fp8) and fp8[1] < bf16[1] and fp8[0] != pytest.approx(bf16[0])
    nvfp4, bf16_b200 = _depth_cost("dgx_b200", "nvfp4"), _depth_cost("dgx_b200", "bf16")
    assert nvfp4 == pytest.approx(bf16_b200)
