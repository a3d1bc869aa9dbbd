"""`train { precision: fp8, fp8_recipe: ... }` and the blocks a recipe keeps in bf16 (`bf16_first_layers`,
`bf16_last_layers`): how each recipe scales its tensors, and what that moves. Each expected figure is derived here
from the recipe (what its quantizer reads and writes per element), not read from the cost model's tables:
delayed scaling's fused cast-transpose reads the 16-bit element and writes a row- and a column-wise FP8 copy
(2 + 1 + 1 bytes); Transformer Engine's current scaling reads it once more first for its amax; torchao's tensorwise
scaling fuses the activations' amax into the kernel before but casts every weight again in each forward (an amax
pass and the cast: 2 + 2 + 1 + 1); blockwise scaling writes an FP32 scale per 128 elements beside each copy."""
from __future__ import annotations

import pytest

from plandsl import api, ir
from plandsl.cost.estimate import estimate_plan
from plandsl.interop import export_plan, import_text

H, KV, FFN, TP, TOKENS, HEADS = 4096, 1024, 14336, 4, 4096, 32

PLAN = """\
import "clusters/dgx_h100"
plan p {{
  model    = llama(layers=8, hidden=1024, heads=16, kv_heads=8, seq=2048, vocab=32000)
  cluster  = dgx_h100 x 1
  mesh     = [dp = 2, pp = 2, tp = 2]
  train    = {{ global_batch: 16, micro_batch: 1, precision: {train} }}
  data     = zero1 over dp
  tensor   = megatron over tp with sequence_parallel
  stages   = evenly over pp
  schedule = 1f1b
}}
"""


def _plan(train: str) -> ir.Plan:
    return api.loads(PLAN.format(train=train)).plans[0]


def _block(recipe: ir.Fp8Recipe | None, precision: ir.Precision = ir.Precision.fp8):
    """A llama block (hidden 4096, 32 heads, 8 KV heads, ffn 14336) under tp 4 with sequence parallelism, one
    microbatch of 4096 tokens, on a device of 1 byte/s whose GEMMs take no time for their bytes' sake alone: its
    element-wise seconds are the bytes it moves."""
    from plandsl.cost.compute import Efficiency, Work, estimate_layer_compute
    from plandsl.ir.layers import layers_of
    model = ir.TransformerModel(kind="llama", name="l", layers=2, hidden=H, heads=HEADS, kv_heads=8,
                                ffn_hidden=FFN, seq=TOKENS, vocab=32000)
    device = ir.DeviceType(name="d", memory=80 * 2**30, bandwidth=1.0, peak={"bf16": 1e15, "fp8": 2e15})
    block = next(x for x in layers_of(model) if x.kind == "block")
    work = Work(1, TOKENS, tp=TP, sequence_parallel=True, precision=precision, fp8_recipe=recipe)
    return estimate_layer_compute(model, block, work, device, Efficiency(1.0, 0.0))


# Elements per token the FP8 linear layers quantize: forward the QKV and fc1 inputs on the sequence shard, wo's and
# fc2's on this rank's heads and MLP share; backward the gradients of the QKV and fc1 outputs and of wo's and fc2's.
CAST_IN = H / TP + H / TP + H / TP + FFN / TP
CAST_GRAD = (H + 2 * KV) / TP + 2 * FFN / TP + H / TP + H / TP
# This rank's weights of those layers: wq, wk, wv, wo and w1, w3, w2, each split over tp.
WEIGHTS = (H * (H + 2 * KV) + H * H + 3 * H * FFN) / TP


def test_delayed_is_the_default_and_unchanged():
    """No recipe under fp8 is delayed scaling, priced as before the recipes existed (2 + 1 + 1 per element)."""
    default, delayed, bf16 = _block(None), _block(ir.Fp8Recipe.delayed), _block(None, ir.Precision.bf16)
    assert (default.forward_other, default.backward_other) == (delayed.forward_other, delayed.backward_other)
    assert default.forward_other - bf16.forward_other == pytest.approx(TOKENS * CAST_IN * (2 + 1 + 1), rel=1e-12)
    assert _plan("fp8").train.recipe is ir.Fp8Recipe.delayed
    assert "fp8_recipe" not in _plan("fp8").train.model_dump()  # an existing plan dumps (and hashes) as before


def test_current_scaling_reads_each_tensor_once_more_for_its_amax():
    delayed, current = _block(ir.Fp8Recipe.delayed), _block(ir.Fp8Recipe.current)
    amax = 2  # one read of each 16-bit element before its cast
    assert current.forward_other - delayed.forward_other == pytest.approx(TOKENS * CAST_IN * amax, rel=1e-12)
    assert current.backward_other - delayed.backward_other == pytest.approx(TOKENS * CAST_GRAD * amax, rel=1e-12)
    assert current.forward_matmul == delayed.forward_matmul


def test_tensorwise_casts_every_weight_again_in_each_forward():
    """torchao's activations and gradients cost what delayed scaling's do (their amax fused into the kernel before);
    each forward adds an amax pass and a cast over the rank's weights, 2 + 2 + 1 + 1 bytes per weight."""
    delayed, tensorwise = _block(ir.Fp8Recipe.delayed), _block(ir.Fp8Recipe.tensorwise)
    assert tensorwise.forward_other - delayed.forward_other == pytest.approx(WEIGHTS * (2 + 2 + 1 + 1), rel=1e-12)
    assert tensorwise.backward_other == pytest.approx(delayed.backward_other, rel=1e-12)


def test_tensorwise_weight_casts_rerun_with_the_recomputed_forward():
    from plandsl.cost.compute import Efficiency, Work, estimate_layer_compute
    from plandsl.ir.layers import layers_of
    model = ir.TransformerModel(kind="llama", name="l", layers=2, hidden=H, heads=HEADS, kv_heads=8,
                                ffn_hidden=FFN, seq=TOKENS, vocab=32000)
    device = ir.DeviceType(name="d", memory=80 * 2**30, bandwidth=1.0, peak={"bf16": 1e15, "fp8": 2e15})
    block = next(x for x in layers_of(model) if x.kind == "block")
    reruns = [estimate_layer_compute(model, block, Work(1, TOKENS, tp=TP, sequence_parallel=True,
                                                        precision=ir.Precision.fp8, recompute=ir.Recompute.full,
                                                        fp8_recipe=recipe), device, Efficiency(1.0, 0.0)).recompute
              for recipe in (ir.Fp8Recipe.delayed, ir.Fp8Recipe.tensorwise)]
    assert reruns[1] - reruns[0] == pytest.approx(WEIGHTS * 6, rel=1e-12)


def test_blockwise_writes_an_fp32_scale_per_128_elements_of_each_copy():
    delayed, blockwise = _block(ir.Fp8Recipe.delayed), _block(ir.Fp8Recipe.blockwise)
    scales = 2 * 4 / 128  # row- and column-wise copies, 4 bytes per tile of 128
    assert blockwise.forward_other - delayed.forward_other == pytest.approx(TOKENS * CAST_IN * scales, rel=1e-12)
    assert blockwise.backward_other - delayed.backward_other == pytest.approx(TOKENS * CAST_GRAD * scales, rel=1e-12)


def test_blockwise_saves_its_inputs_with_their_tile_scales():
    """The inputs FP8 keeps for the weight gradients (q/k/v, MLP and w2 inputs) are 1 + 4/128 bytes; the
    out-projection's is the attention's 16-bit output under blockwise (megatron-core's `set_save_original_input`),
    where the delayed recipe keeps a one-byte copy beside it: a byte less per element of it."""
    from plandsl.cost.memory import transformer_block_activations
    model = _plan("fp8").model
    seq, tp = 2048, 2
    delayed, blockwise = (transformer_block_activations(model, seq, 1, tp, True, ir.Recompute.none, ir.Precision.fp8,
                                                        recipe=recipe)
                          for recipe in (ir.Fp8Recipe.delayed, ir.Fp8Recipe.blockwise))
    saved = seq * (model.hidden * 3 + model.ffn_hidden) / tp  # elements
    output = seq * model.hidden / tp  # the attention's output, the out-projection's input
    assert blockwise - delayed == pytest.approx((saved - output) * 4 / 128 - output)


def test_the_blocks_kept_in_bf16_run_and_save_as_bf16():
    """bf16_first_layers: 1, bf16_last_layers: 1 on 8 blocks over 2 pipeline stages: each stage has one bf16 block
    (block 0 on the first, block 7 on the last), which takes a bf16 block's seconds and keeps its bytes."""
    from plandsl.cost.estimate import estimate_stage_times
    from plandsl.cost.memory import estimate_layer_activations
    from plandsl.ir.layers import layers_of
    from plandsl.ir.placement import assign_stages
    fp8, bf16, kept = (_plan(t) for t in ("fp8, fp8_recipe: current", "bf16",
                                           "fp8, fp8_recipe: current, bf16_first_layers: 1, bf16_last_layers: 1"))
    blocks = [layer for layer in layers_of(fp8.model) if layer.kind == "block"]
    assert [kept.train.block_precision(i, 8).value for i in range(8)] == ["bf16"] + ["fp8"] * 6 + ["bf16"]
    for stage in range(2):
        times = [estimate_stage_times(p, assign_stages(p)[0])[stage] for p in (fp8, bf16, kept)]
        # one block of four moved from the fp8 figure to the bf16 one
        assert times[2].forward - times[0].forward == pytest.approx((times[1].forward - times[0].forward) / 4, rel=1e-6)
    first, middle, last = blocks[0], blocks[3], blocks[7]
    assert estimate_layer_activations(kept, first) == estimate_layer_activations(bf16, first)
    assert estimate_layer_activations(kept, last) == estimate_layer_activations(bf16, last)
    assert estimate_layer_activations(kept, middle) == estimate_layer_activations(fp8, middle)
    assert estimate_layer_activations(bf16, first) > estimate_layer_activations(fp8, first)
    steps = sorted(estimate_plan(p).time.step for p in (fp8, bf16))  # small GEMMs: fp8's may be the slower here
    assert steps[0] < estimate_plan(kept).time.step < steps[1]


def test_recipes_order_on_a_plan():
    steps = {recipe: estimate_plan(_plan(f"fp8, fp8_recipe: {recipe}")).time.step
             for recipe in ("delayed", "current", "tensorwise", "blockwise")}
    assert steps["delayed"] < steps["blockwise"] < steps["current"]
    assert steps["delayed"] < steps["tensorwise"]
    assert estimate_plan(_plan("fp8")).time.step == steps["delayed"]


@pytest.mark.parametrize("train, key", [("bf16, fp8_recipe: current", "fp8_recipe"),
                                        ("mxfp8, fp8_recipe: blockwise", "fp8_recipe"),
                                        ("bf16, bf16_first_layers: 1", "bf16_first_layers"),
                                        ("fp16, bf16_last_layers: 2", "bf16_last_layers")])
def test_a_recipe_the_precision_does_not_take_is_e510(train, key):
    text = PLAN.format(train=train).replace("dgx_h100", "dgx_b200") if "mxfp8" in train else PLAN.format(train=train)
    errors = api.checks(text).errors
    assert [d.code for d in errors] == ["E510"], [str(d) for d in errors]
    assert key in errors[0].message and errors[0].span is not None


def test_more_bf16_blocks_than_the_model_has_is_e205():
    errors = api.checks(PLAN.format(train="fp8, fp8_recipe: current, bf16_first_layers: 4, bf16_last_layers: 5")).errors
    assert [d.code for d in errors] == ["E205"] and "= 9 is more than the 8 blocks" in errors[0].message


def test_every_recipe_and_bf16_layers_check_under_fp8_and_the_block_precisions():
    for recipe in ir.Fp8Recipe:
        assert api.checks(PLAN.format(train=f"fp8, fp8_recipe: {recipe.value}")).ok
    text = PLAN.format(train="nvfp4, bf16_last_layers: 2").replace("dgx_h100", "dgx_b200")
    assert api.checks(text).ok  # Megatron's NVFP4 recipes keep their last layers in bf16


def test_run_refuses_every_recipe_with_fp8s_code():
    for recipe in ir.Fp8Recipe:
        refusals = api.run_refusals(_plan(f"fp8, fp8_recipe: {recipe.value}, bf16_first_layers: 1"))
        assert [d.code for d in refusals] == ["E706"]


def test_show_names_the_recipe_and_the_bf16_blocks():
    text = api.describe(api.loads(PLAN.format(train="fp8, fp8_recipe: current, bf16_first_layers: 1, "
                                              "bf16_last_layers: 1")))
    assert "fp8 (current scaling, first 1 and last 1 blocks in bf16)" in text


@pytest.mark.parametrize("train, flags", [
    ("fp8", ["--fp8-format hybrid"]),
    ("fp8, fp8_recipe: delayed", ["--fp8-format hybrid", "--fp8-recipe delayed"]),
    ("fp8, fp8_recipe: current, bf16_first_layers: 1, bf16_last_layers: 2",
     ["--fp8-recipe tensorwise", "--first-last-layers-bf16", "--num-layers-at-start-in-bf16 1",
      "--num-layers-at-end-in-bf16 2"]),
    ("fp8, fp8_recipe: blockwise", ["--fp8-recipe blockwise"])])
def test_megatron_says_the_recipes_both_ways(train, flags):
    plan = _plan(train)
    exported = export_plan(plan, "megatron")
    assert not exported.lost
    text = " ".join(line.strip() for line in exported.text.splitlines() if not line.startswith("#"))
    assert all(flag in text for flag in flags), text
    back = import_text("megatron", exported.text, "plan.args", world_size=plan.mesh.size, cluster="dgx_h100 x 1",
                       name=plan.name)
    assert back.ok, [str(d) for d in back.diagnostics]
    again = api.select_plan(api.loads(back.text, path="back.plan")).train
    assert (again.precision, again.fp8_recipe, again.bf16_first_layers, again.bf16_last_layers) == \
        (plan.train.precision, plan.train.fp8_recipe, plan.train.bf16_first_layers, plan.train.bf16_last_layers)


def test_megatron_cannot_say_torchaos_recipe_nor_bf16_blocks_under_delayed_scaling():
    lost = export_plan(_plan("fp8, fp8_recipe: tensorwise"), "megatron").lost
    assert [d.code for d in lost] == ["E808"] and "fp8_recipe: current" in lost[0].hint
    lost = export_plan(_plan("fp8, bf16_first_layers: 1"), "megatron").lost
    assert [d.code for d in lost] == ["E808"] and "Delayed scaling" in lost[0].message


def test_megatron_first_last_layers_bf16_needs_fp8_or_fp4():
    exported = export_plan(_plan("fp8, fp8_recipe: current, bf16_first_layers: 1"), "megatron").text
    plain = exported.replace("--fp8-format hybrid", "").replace("--fp8-recipe tensorwise", "")
    back = import_text("megatron", plain, "plan.args", world_size=8, cluster="dgx_h100 x 1", name="p")
    assert [d.code for d in back.diagnostics] == ["E807"] and "--first-last-layers-bf16" in back.diagnostics[0].message
    # with FP8's default recipe, delayed scaling, megatron-core refuses the switch: so does the import, as the export
    # refuses the plan (import then export would fail)
    for delayed in (exported.replace("--fp8-recipe tensorwise", ""),
                    exported.replace("--fp8-recipe tensorwise", "--fp8-recipe delayed")):
        back = import_text("megatron", delayed, "plan.args", world_size=8, cluster="dgx_h100 x 1", name="p")
        assert [d.code for d in back.diagnostics] == ["E807"] and "Delayed scaling" in back.diagnostics[0].message


def test_a_partial_plans_recipe_is_kept_by_the_search():
    """`generate --from` keeps the recipe and the bf16 blocks a partial plan writes: the problem carries them into
    every candidate's `train` and into the text it writes."""
    from plandsl.search.problem import Problem
    plan = _plan("fp8, fp8_recipe: current, bf16_first_layers: 1, bf16_last_layers: 1")
    problem = Problem(plan.model, plan.cluster, 16, precision=ir.Precision.fp8, fp8_recipe=ir.Fp8Recipe.current,
                      bf16_first_layers=1, bf16_last_layers=1)
    train = problem.training()
    assert (train.recipe, train.bf16_first_layers, train.bf16_last_layers) == (ir.Fp8Recipe.current, 1, 1)
    assert {"fp8_recipe: current", "bf16_first_layers: 1", "bf16_last_layers: 1"} <= set(problem.given_items())


def test_generate_searches_with_a_recipe_and_writes_it():
    generated = api.generate(api.generate_request(model="llama3_8b", cluster="dgx_h100", global_batch=64,
                                                  precision="fp8", fp8_recipe="current", top=1))
    plan = api.select_plan(api.loads(generated.texts[0], path="gen.plan"))
    assert plan.train.recipe is ir.Fp8Recipe.current
    assert generated.result.best.estimate.time.step == pytest.approx(estimate_plan(plan).time.step, rel=1e-9)
    usage_problem = api.generate_usage_error()
    with pytest.raises(usage_problem, match="--fp8-recipe with --precision bf16"):
        api.generate(api.generate_request(model="llama3_8b", cluster="dgx_h100", global_batch=64,
                                          fp8_recipe="current", top=1))
