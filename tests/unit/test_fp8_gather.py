"""The dtype data parallelism gathers the parameters in: `data = ... with gather = fp32 | bf16 | fp16 | fp8`.

The language (the option, E206 where nothing is gathered, E511 for FP8 without FP8 training), the bytes ZeRO's
all-gathers move (`cost.memory.gather_element`, a first bucket's own, `cost.stage.bucket_element`), the gathered
units' memory in that dtype (`cost.memory.gathered_bytes`), torchao's weight cast when the weight comes gathered in FP8
(`cost.compute.FP8_GATHERED_WEIGHT_BYTES`), and the search pricing a problem's gather dtype as `estimate` does.
Byte counts by hand for a 4-block llama (hidden 1024, ffn 4096, vocabulary 32000) on 8 data ranks.
"""
from __future__ import annotations

import textwrap

import pytest

from plandsl import ir
from plandsl.check.analysis import analyze
from plandsl.ir.layers import layers_of
from tests.support import error_codes, lowered_plan, space_leaves

# llama(layers=4, hidden=1024, heads=8, kv_heads=8, ffn=4096, vocab=32000): a block's q, k, v, o are 4 x 1024^2,
# its w1, w2, w3 3 x 1024 x 4096 (the linear weights FP8 quantizes), its two norms 2 x 1024; the root unit (the
# embedding, the final norm and the head) 2 x 32000 x 1024 + 1024.
LINEAR = 4 * 1024 ** 2 + 3 * 1024 * 4096   # 16,777,216
BLOCK = LINEAR + 2 * 1024                   # 16,779,264
ROOT = 2 * 32000 * 1024 + 1024              # 65,537,024


def plan_text(data: str, precision: str = "fp8", extra: str = "") -> str:
    cluster = "dgx_b200" if precision in ("mxfp8", "nvfp4") else "dgx_h100"  # Blackwell's block-scaled peaks
    return textwrap.dedent(f"""\
        import "clusters/{cluster}"
        plan p {{
          model   = llama(layers=4, hidden=1024, heads=8, kv_heads=8, ffn=4096, vocab=32000, seq=2048)
          cluster = {cluster}
          mesh    = [dp = 8]
          train   = {{ global_batch: 16, micro_batch: 2, precision: {precision}{extra} }}
          data    = {data}
        }}
        """)


def lowered(data: str, **kw) -> ir.Plan:
    return lowered_plan(plan_text(data, **kw))


def codes(data: str, **kw) -> list[str]:
    return error_codes(plan_text(data, **kw))


# ---- the language ----------------------------------------------------------------------------------------
def test_gather_lowers_dumps_only_when_given_and_is_written_back():
    assert lowered("fsdp over dp").data.gather is None
    assert "gather" not in lowered("fsdp over dp").data.model_dump()  # plans hash as before the option
    p = lowered("fsdp over dp with gather = fp8")
    assert p.data.gather is ir.Precision.fp8 and p.data.model_dump()["gather"] == "fp8"
    assert p.data.gathering == ir.Gathering(gather=ir.Precision.fp8) and p.data.gathering.default  # closed form
    assert ir.gathering_text(p.data.gathering, 3) == " with gather = fp8"
    assert ir.gathering_text(ir.Gathering(gather=ir.Precision.bf16), 1) == " with gather = bf16"
    assert lowered("zero1 over dp with gather = bf16", precision="bf16",  # ZeRO-1 gathers bf16 weights (E515)
                   extra=", param_dtype: bf16").data.gather is ir.Precision.bf16


@pytest.mark.parametrize("data, precision, code", [
    ("ddp over dp with gather = bf16", "bf16", "E206"),  # replicate gathers no parameters
    ("fsdp over dp with gather = fp9", "fp8", "E210"),
    ("fsdp over dp with gather = mxfp8", "mxfp8", "E210"),  # `fp8` names the recipe's own FP8 format
    ("fsdp over dp with gather = fp8", "bf16", "E511"),
    ("zero1 over dp with gather = fp8", "nvfp4", "E511"),
])
def test_bad_gathers_are_errors(data, precision, code):
    assert codes(data, precision=precision) == [code]


@pytest.mark.parametrize("data, precision, extra, code", [
    ("fsdp over dp with gather = fp16", "bf16", "", "E515"),  # FSDP2 would compute in fp16
    ("zero2 over dp with gather = bf16", "fp16", "", "E515"),
    ("fsdp over dp with gather = bf16", "fp32", "", "E515"),  # the forward would compute in bf16
    ("fsdp over dp with gather = fp16", "fp8", "", "E515"),  # FP8 training's 16-bit layers are bf16
    ("zero1 over dp with gather = bf16", "bf16", "", "E515"),  # ZeRO-1 gathers the fp32 weights as they are
    ("zero1 over dp with gather = fp32", "bf16", ", param_dtype: bf16", "E515"),
    ("fsdp over dp with gather = bf16", "bf16", "", None),
    ("fsdp over dp with gather = fp32", "bf16", "", None),
    ("fsdp over dp with gather = bf16", "fp8", "", None),  # torchtitan's mixed_precision_param beside Float8
    ("fsdp over dp with gather = fp32", "fp32", "", None),
    ("zero1 over dp with gather = fp32", "bf16", "", None),
    ("zero1 over dp with gather = bf16", "bf16", ", param_dtype: bf16", None),  # Megatron-LM's bf16 parameters
    ("zero1 over dp with gather = fp8", "fp8", ", param_dtype: bf16", None),  # --fp8-param-gather
], ids=["fp16_at_bf16", "zero2_bf16_at_fp16", "bf16_at_fp32", "fp16_at_fp8", "zero1_bf16", "zero1_fp32_of_bf16",
        "bf16", "fp32", "bf16_at_fp8", "fp32_at_fp32", "zero1_fp32", "zero1_bf16_of_bf16", "zero1_fp8"])
def test_a_gather_the_data_parallelism_does_not_gather_in_is_e515(data, precision, extra, code):
    assert codes(data, precision=precision, extra=extra) == ([code] if code else [])


def test_e515_offers_the_compute_precision_and_names_the_weights_under_zero1():
    text = plan_text("fsdp over dp with gather = fp16", precision="bf16")
    [error] = analyze(text=text).errors
    assert "precision bf16 computes in bf16" in error.message and error.hint == "gather = bf16 (or fp32)"
    [edit] = error.edits
    fixed = text[:edit.span.start] + edit.text + text[edit.span.end:]
    assert "with gather = bf16" in fixed and codes("fsdp over dp with gather = bf16", precision="bf16") == []
    [fp32] = analyze(text=plan_text("fsdp over dp with gather = bf16", precision="fp32")).errors
    assert fp32.hint == "gather = fp32, or precision: bf16 to compute in bf16"
    [zero1] = analyze(text=plan_text("zero1 over dp with gather = bf16", precision="bf16")).errors
    assert "master_dtype fp32" in zero1.message and zero1.hint.startswith("param_dtype: bf16 keeps bf16 weights")
    assert not zero1.edits


def test_e511_points_at_the_option_and_the_precision():
    [error] = analyze(text=plan_text("fsdp over dp with gather = fp8", precision="bf16")).errors
    assert error.code == "E511" and "gather = fp8" in error.message and error.hint.endswith("gather = bf16")
    assert [note.message for note in error.notes] == ["precision given here"]
    assert codes("fsdp over dp with gather = fp8", precision="mxfp8") == []


# ---- the bytes -------------------------------------------------------------------------------------------
def test_fp8_gather_bytes_by_recipe():
    from plandsl.cost.memory import fp8_gather_bytes
    train = lowered("fsdp over dp").train
    assert fp8_gather_bytes(train) == 1.0  # a per-tensor scale travels as metadata, not with the data
    assert fp8_gather_bytes(lowered("fsdp over dp", extra=", fp8_recipe: blockwise").train) == 1 + 4 / 128 ** 2
    assert fp8_gather_bytes(lowered("fsdp over dp", precision="mxfp8").train) == 1 + 1 / 32


IN_BLOCKS = 4 * (ROOT - 32000 * 1024 + 2 * BLOCK)  # the gradients at grad_dtype, whatever the gather
FP8_PARAMS = 2 * ROOT + 2 * (1 * LINEAR + 2 * 2 * 1024)  # linear weights 1, norms 2


@pytest.mark.parametrize("data, expected, grads", [
    ("fsdp over dp", 4 * (ROOT + 2 * BLOCK), IN_BLOCKS),               # the weights' dtype, fp32: `plandsl run`'s
    ("fsdp over dp with gather = bf16", 2 * (ROOT + 2 * BLOCK), IN_BLOCKS),
    ("fsdp over dp with gather = fp32", 4 * (ROOT + 2 * BLOCK), IN_BLOCKS),
    # the blocks' FP8 copies small beside the root's: the embedding's backward outweighs theirs, the root's bf16
    # parameters, all its gradients and the first block's reduce-scatter input
    ("fsdp over dp with gather = fp8", FP8_PARAMS, 2 * ROOT + 4 * (ROOT + BLOCK) - FP8_PARAMS),
])
def test_the_gathered_units_are_held_in_the_gather_dtype(data, expected, grads):
    """In a block's backward (`cost.memory.unit_moments`): the root's parameters and two blocks' (the block's and the
    one FSDP2 prefetches), the gradients of the root but the embedding's (made after the blocks') and of two blocks;
    the grads the most any moment of the backward holds beyond those parameters."""
    from plandsl.cost.memory import gathered_bytes
    p = lowered(data)
    assert gathered_bytes(p, layers_of(p.model)) == (expected, grads)


def test_param_dtype_bf16_gathers_bf16_by_default():
    from plandsl.cost.memory import gathered_bytes
    p = lowered("fsdp over dp", extra=", param_dtype: bf16")
    assert gathered_bytes(p, layers_of(p.model))[0] == 2 * (ROOT + 2 * BLOCK)


def test_a_blocks_kept_in_bf16_gather_in_16_bits():
    from plandsl.cost.memory import gathered_param_bytes
    p = lowered("fsdp over dp with gather = fp8", extra=", fp8_recipe: current, bf16_first_layers: 1")
    first, second = [layer for layer in layers_of(p.model) if layer.kind == "block"][:2]
    assert gathered_param_bytes(p, first, 2, 1, 1) == 2 * BLOCK
    assert gathered_param_bytes(p, second, 2, 1, 1) == LINEAR + 2 * 2 * 1024


def test_the_gathers_move_the_gather_dtype():
    from plandsl.cost.estimate import estimate_plan
    default, bf16, fp8 = (estimate_plan(lowered(data)) for data in
                          ("fsdp over dp", "fsdp over dp with gather = bf16", "fsdp over dp with gather = fp8"))
    # one stage: the root and four blocks, their gathers at 2 bytes (the compute precision's, by default) or, under
    # fp8, the linear weights at 1
    elements = ROOT + 4 * BLOCK
    [stage] = fp8.stage_times
    assert stage.element == pytest.approx((2 * ROOT + 4 * (LINEAR + 2 * 2 * 1024)) / elements)
    assert default.stage_times[0].element == bf16.stage_times[0].element == 2
    # ZeRO-3 gathers the parameters twice a microbatch (before the forward and the backward), one microbatch here:
    # the four blocks' linear weights at 1 byte instead of 2, twice
    moved = [e.communication.data for e in (default, bf16, fp8)]
    assert moved[0] == moved[1] > moved[2]
    assert moved[0] - moved[2] == pytest.approx(2 * 4 * LINEAR)
    assert fp8.time.step < bf16.time.step == default.time.step


def test_a_first_bucket_gathers_its_own_layers_bytes():
    from plandsl.cost.stage import bucket_element
    # the embedding (16-bit) closes the first bucket alone: its 2 bytes, not the stage's average
    assert bucket_element([32_768_000, BLOCK, BLOCK], [2 * 32_768_000, LINEAR + 4096, LINEAR + 4096],
                          32_768_000, 1.2) == 2
    assert bucket_element([10, 10], [10, 20], 20, 1.2) == 1.5
    assert bucket_element([10, 10], (), 20, 1.2) == 1.2  # no gather dtype: the stage's element


def test_torchaos_weight_cast_under_an_fp8_gather():
    """torchao's tensorwise scaling casts each weight in every forward (6 bytes per element); gathered in FP8 the
    weight needs only the backward's column-major copy (2)."""
    from dataclasses import replace

    from plandsl.cost.compute import FP8_GATHERED_WEIGHT_BYTES, FP8_WEIGHT_CAST_BYTES
    from plandsl.cost.estimate import plan_links, plan_work
    from plandsl.cost.layer import estimate_layer_time
    p = lowered("fsdp over dp with gather = fp8", extra=", fp8_recipe: tensorwise")
    work, links = plan_work(p), plan_links(p)
    assert work.fp8_gather
    block = next(layer for layer in layers_of(p.model) if layer.kind == "block")
    from plandsl.ir.placement import pipeline_rank_device_types
    device = pipeline_rank_device_types(p)[0][0]
    gathered = estimate_layer_time(p.model, block, work, device, links)
    cast = estimate_layer_time(p.model, block, replace(work, fp8_gather=False), device, links)
    bandwidth = device.bandwidth
    assert cast.forward - gathered.forward == pytest.approx(LINEAR * FP8_WEIGHT_CAST_BYTES[ir.Fp8Recipe.tensorwise]
                                                            / bandwidth)
    assert gathered.input_grad + gathered.weight_grad - cast.input_grad - cast.weight_grad == pytest.approx(
        LINEAR * FP8_GATHERED_WEIGHT_BYTES / bandwidth)
    # Transformer Engine's recipes cast the weights once a step: the gather changes no kernel
    current = lowered("fsdp over dp with gather = fp8", extra=", fp8_recipe: current")
    work = plan_work(current)
    assert estimate_layer_time(p.model, block, work, device, links) == \
        estimate_layer_time(p.model, block, replace(work, fp8_gather=False), device, links)


def test_the_search_prices_and_writes_the_gather_dtype():
    from plandsl.cost.estimate import estimate_plan
    from plandsl.search import Problem, search
    p = lowered("fsdp over dp with gather = fp8")
    # ZeRO-3, and ZeRO-1, which gathers after the step in the same dtype: each written from ZeRO-1 on
    for zero_stage in (3, 1):
        pins = {"dp": 8, "tp": 1, "pp": 1, "cp": 1, "ep": 1, "zero_stage": zero_stage, "micro_batch_size": 2,
                "recompute": "none"}
        best = search(Problem(p.model, p.cluster, 16, precision=ir.Precision.fp8, gathering=p.data.gathering),
                      pins=pins, top=1).best
        assert best.plan.data.gather is ir.Precision.fp8, zero_stage
        assert best.estimate.time.step == pytest.approx(estimate_plan(best.plan).time.step)
        assert max(m.total for m in best.estimate.memory) == pytest.approx(max(m.total for m in
                                                                              estimate_plan(best.plan).memory))


def test_diff_and_show_name_the_gather():
    from plandsl.render.summary import describe_plan
    from plandsl.rewrite.diff import changes
    assert {c.field for c in changes(lowered("fsdp over dp"), lowered("fsdp over dp with gather = fp8"))} == \
        {"data.gather"}
    assert "parallel  zero3 over dp with gather = fp8\n" in describe_plan(lowered("fsdp over dp with gather = fp8"))


# ---- interop -----------------------------------------------------------------------------------------------
MEGATRON = ("--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 128 --max-position-embeddings 128 "
            "--padded-vocab-size 1024 --micro-batch-size 1 --global-batch-size 16 --bf16")


def test_megatrons_fp8_param_gather_is_the_gather_both_ways():
    from plandsl.interop import export_plan, import_text
    p = lowered("zero1 over dp with gather = fp8", extra=", fp8_recipe: current")
    exported = export_plan(p, "megatron")
    assert not exported.lost and "--fp8-param-gather" in exported.text.split()
    back = import_text("megatron", exported.text, "plan.args", world_size=8, name="p")
    assert back.ok and "data = zero1 over dp with gather = fp8" in " ".join(back.text.split())
    assert "--fp8-param-gather" not in export_plan(lowered("zero1 over dp"), "megatron").text.split()
    # Megatron gathers its bf16 weights as they are: `gather = bf16` writes nothing, fp32 it cannot say
    assert not export_plan(lowered("zero1 over dp with gather = bf16", extra=", param_dtype: bf16"), "megatron").lost
    [lost] = export_plan(lowered("zero1 over dp with gather = fp32"), "megatron").lost
    assert lost.code == "E808" and "gather = fp32" in lost.message


@pytest.mark.parametrize("extra, shown", [
    ("--fp8-format hybrid --fp8-param-gather", "without --use-distributed-optimizer"),
    ("--use-distributed-optimizer --fp8-param-gather", "without --fp8-format"),
])
def test_megatrons_fp8_param_gather_where_it_cannot_apply(extra, shown):
    from plandsl.interop import import_text
    text = f"{MEGATRON} {extra}\n"
    imported = import_text("megatron", text, "flags", world_size=8)
    assert [d.code for d in imported.diagnostics] == ["E805"] and shown in imported.diagnostics[0].message
    span = imported.diagnostics[0].span
    assert text[span.start:span.end] == "--fp8-param-gather"


def test_torchtitan_and_deepspeed_say_the_gathers_they_cannot_write():
    from plandsl.interop import export_plan
    bf16 = lowered("fsdp over dp with gather = bf16", precision="bf16")
    assert not [d for d in export_plan(bf16, "torchtitan").lost if "gather" in d.message]  # mixed_precision_param
    assert not [d for d in export_plan(bf16, "deepspeed").lost if "gather" in d.message]
    fp32 = lowered("fsdp over dp with gather = fp32", precision="bf16")
    for target in ("torchtitan", "deepspeed"):
        assert [d.code for d in export_plan(fp32, target).lost if "gather = fp32" in d.message] == ["E808"]


# ---- current scaling's amax all-reduce ---------------------------------------------------------------------
def tp_block(precision: str, extra: str):
    """The plan of `plan_text` on dp 4 x tp 2 with sequence parallelism: (plan, work, links, device, a block)."""
    from plandsl.cost.estimate import plan_links, plan_work
    from plandsl.ir.placement import pipeline_rank_device_types
    text = plan_text("fsdp over dp", precision=precision, extra=extra).replace("[dp = 8]", "[dp = 4, tp = 2]") \
        .replace("  data ", "  tensor  = megatron over tp with sequence_parallel\n  data ")
    analysis = analyze(text=text)
    assert analysis.ok, [(d.code, d.message) for d in analysis.diagnostics]
    (p,) = analysis.document.plans
    block = next(layer for layer in layers_of(p.model) if layer.kind == "block")
    return p, plan_work(p), plan_links(p), pipeline_rank_device_types(p)[0][0], block



@pytest.mark.parametrize("recipe, reduced", [("current", True), ("tensorwise", True), ("delayed", False),
                                             ("blockwise", False)])
def test_per_tensor_current_scaling_all_reduces_its_amax_over_the_tensor_axis(recipe, reduced):
    """Under sequence parallelism a column-parallel layer's input (forward) and a row-parallel layer's output
    gradient (backward) are cast to FP8 before their all-gather with one scale over the axis: the amax all-reduced
    first, one float, latency on the critical path: a dense block's q/k/v and w1 inputs, wo's and w2's gradients."""
    from dataclasses import replace

    from plandsl.cost.comm import collective_seconds
    from plandsl.cost.layer import AMAX_BYTES, estimate_layer_time
    p, work, links, device, block = tp_block("fp8", f", fp8_recipe: {recipe}")
    reduced_time = estimate_layer_time(p.model, block, work, device, links)
    plain = estimate_layer_time(p.model, block, replace(work, fp8_recipe=ir.Fp8Recipe.delayed), device, links)
    amax = 2 * collective_seconds("all_reduce", AMAX_BYTES, links.tp) if reduced else 0.0
    assert reduced_time.forward_comm - plain.forward_comm == pytest.approx(amax, abs=1e-15)
    assert reduced_time.backward_comm - plain.backward_comm == pytest.approx(amax, abs=1e-15)
    # no tensor axis, or no sequence parallelism: no reduction
    solo = estimate_layer_time(p.model, block, replace(work, sequence_parallel=False), device, links)
    assert solo.forward_comm == estimate_layer_time(p.model, block, replace(work, sequence_parallel=False,
                                                                             fp8_recipe=ir.Fp8Recipe.delayed),
                                                    device, links).forward_comm


@pytest.mark.parametrize("precision", ["fp8", "mxfp8", "nvfp4", "bf16"])
def test_a_quantized_blocks_sequence_parallel_all_gathers_move_the_quantized_copy(precision):
    """Under sequence parallelism a block's all-gathers (the column-parallel inputs forward, the row-parallel output
    gradients backward) move the quantized copy, `gemm_bytes` an element, where the reduce-scatters stay 16-bit:
    Transformer Engine's `gather_along_first_dim` with the layer's quantizer, torchao's Float8ColwiseParallel. Two
    pairs a block each way (attention's and the MLP's), priced by hand from the collectives."""
    from dataclasses import replace

    from plandsl.cost.comm import collective_seconds
    from plandsl.cost.layer import estimate_layer_time
    p, work, links, device, block = tp_block(precision, ", fp8_recipe: delayed" if precision == "fp8" else "")
    time = estimate_layer_time(p.model, block, work, device, links)
    activation = work.tokens * p.model.hidden * 2
    gathered = activation * ir.Precision(precision).gemm_bytes / 2 if precision != "bf16" else activation
    pair = collective_seconds("all_gather", gathered, links.tp) + collective_seconds("reduce_scatter", activation,
                                                                                       links.tp)
    assert time.forward_comm == pytest.approx(2 * pair, rel=1e-12)
    assert time.backward_comm == pytest.approx(2 * pair, rel=1e-12)
    assert time.moved.tensor == pytest.approx(4 * (gathered + activation), rel=1e-12)
    if precision != "bf16":  # without sequence parallelism the all-reduces stay 16-bit
        plain = estimate_layer_time(p.model, block, replace(work, sequence_parallel=False), device, links)
        assert plain.forward_comm == pytest.approx(2 * collective_seconds("all_reduce", activation, links.tp))


def test_megatrons_fp8_params_are_kept_in_fp8_under_zero1():
    """Megatron's --fp8-param-gather keeps the quantized weights as FP8 tensors (the master copy with the optimizer):
    under ZeRO-1 a rank stores them at 1 byte; under ZeRO-3 with bf16 weights over an fp32 master (Megatron-FSDP's
    layout, `megatron_fsdp_shards`) each rank's shard of them is one byte too (its uint8 `model_weight_buffer`),
    while torchao's shards, of fp32 weights that are their own master, keep the weights' dtype."""
    from plandsl.cost.memory import model_state_bytes
    bf16 = ", param_dtype: bf16"
    zero1 = lowered("zero1 over dp", extra=bf16)
    fp8 = lowered("zero1 over dp with gather = fp8", extra=bf16)
    layers = layers_of(zero1.model)
    (params, grads, optimizer), (fp8_params, fp8_grads, fp8_optimizer) = \
        model_state_bytes(zero1, layers), model_state_bytes(fp8, layers)
    assert params == 2 * (ROOT + 4 * BLOCK)
    assert fp8_params == params - 4 * LINEAR * (2 - 1)
    assert (fp8_grads, fp8_optimizer) == (grads, optimizer)
    zero3 = lowered("fsdp over dp with gather = fp8", extra=bf16)
    shards = model_state_bytes(lowered("fsdp over dp", extra=bf16), layers)
    assert shards[0] == 2 * (ROOT + 4 * BLOCK) // 8
    assert model_state_bytes(zero3, layers) == (shards[0] - 4 * LINEAR // 8 * (2 - 1), *shards[1:])
    torchao = lowered("fsdp over dp with gather = fp8")  # fp32 weights, their own master copy
    assert model_state_bytes(torchao, layers)[0] == model_state_bytes(lowered("fsdp over dp"), layers)[0]


def test_megatrons_mxfp8_params_keep_a_row_wise_and_a_column_wise_copy():
    """An MXFP8 parameter holds its data twice, row-wise and column-wise, each with a one-byte scale per 32 elements
    (Transformer Engine creates it for both usages; Megatron-FSDP gives it a `transpose_weight_buffer`): 2 x 33/32
    bytes, more than the bf16 weight it replaces, under ZeRO-1 and as Megatron-FSDP's shards."""
    from plandsl.cost.memory import fp8_weight_bytes, model_state_bytes
    bf16 = ", param_dtype: bf16"
    assert fp8_weight_bytes(lowered("zero1 over dp", precision="mxfp8").train) == 2 * (1 + 1 / 32)
    assert fp8_weight_bytes(lowered("zero1 over dp", extra=", fp8_recipe: current").train) == 1.0
    zero1 = lowered("zero1 over dp", precision="mxfp8", extra=bf16)
    mx = lowered("zero1 over dp with gather = fp8", precision="mxfp8", extra=bf16)
    layers = layers_of(zero1.model)
    params = model_state_bytes(zero1, layers)[0]
    assert model_state_bytes(mx, layers)[0] == pytest.approx(params + 4 * LINEAR * (2 * (1 + 1 / 32) - 2))
    fsdp = lowered("fsdp over dp with gather = fp8", precision="mxfp8", extra=bf16)
    shards = model_state_bytes(lowered("fsdp over dp", precision="mxfp8", extra=bf16), layers)[0]
    assert model_state_bytes(fsdp, layers)[0] == pytest.approx(shards + 4 * LINEAR // 8 * (2 * (1 + 1 / 32) - 2))


def test_fp8_params_keep_their_master_copy_when_the_weights_were_it():
    """Without `param_dtype` the fp32 weights are the master copy (no other is kept); --fp8-param-gather's FP8 weights
    do not replace it: the fp32 master of the quantized weights moves to the optimizer, sharded with its states
    over the 8 data ranks; the other parameters stay fp32 weights."""
    from plandsl.cost.memory import model_state_bytes
    zero1 = lowered("zero1 over dp")
    fp8 = lowered("zero1 over dp with gather = fp8")
    layers = layers_of(zero1.model)
    (params, grads, optimizer), (fp8_params, fp8_grads, fp8_optimizer) = \
        model_state_bytes(zero1, layers), model_state_bytes(fp8, layers)
    assert params == 4 * (ROOT + 4 * BLOCK)
    assert fp8_params == params - 4 * LINEAR * (4 - 1)
    assert fp8_grads == grads
    assert fp8_optimizer == optimizer + 4 * (4 * LINEAR) / 8



MLA = "q_lora_rank=384, kv_lora_rank=128, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64"


def mla_block(precision: str, experts: str = ""):
    """`tp_block`'s plan with multi-head latent attention (and `experts`, folded over the tensor axis: `experts = alltoall
    over [ep, tp]` on ep 4 x tp 2), delayed scaling under fp8 (no amax all-reduce): (plan, work, links, device, block)."""
    from plandsl.cost.estimate import plan_links, plan_work
    from plandsl.ir.placement import pipeline_rank_device_types
    text = plan_text("fsdp over dp", precision=precision, extra=", fp8_recipe: delayed" if precision == "fp8" else "")
    text = text.replace("seq=2048)", f"seq=2048, {MLA}{experts})").replace(
        "  data ", "  tensor  = megatron over tp with sequence_parallel\n  data ")
    if experts:
        text = text.replace("[dp = 8]", "[ep = 4, tp = 2]").replace("fsdp over dp", "fsdp over ep") \
            .replace("  data ", "  experts = alltoall over [ep, tp]\n  data ")
    else:
        text = text.replace("[dp = 8]", "[dp = 4, tp = 2]")
    p = lowered_plan(text)
    block = next(layer for layer in layers_of(p.model) if layer.kind == "block")
    return p, plan_work(p), plan_links(p), pipeline_rank_device_types(p)[0][0], block


@pytest.mark.parametrize("precision", ["fp8", "bf16"])
def test_a_latent_attention_blocks_all_gathers_move_the_quantized_copy_too(precision):
    """Multi-head latent attention's block (`cost.layer._latent_comm`) under sequence parallelism: the latents gathered
    for the up-projections and the MLP's input forward, wo's and w2's output gradients backward, all cast before their
    all-gather as a dense block's are; the reduce-scatters 16-bit. Priced by hand from the collectives."""
    from plandsl.cost.comm import collective_seconds
    from plandsl.cost.layer import estimate_layer_time
    from plandsl.ir.layers import attention_widths
    p, work, links, device, block = mla_block(precision)
    assert p.model.latent_attention
    time = estimate_layer_time(p.model, block, work, device, links)
    activation = work.tokens * p.model.hidden * 2
    latent = work.tokens * attention_widths(p.model).latent * 2
    q = ir.Precision(precision).gemm_bytes / 2

    def ag(size):
        return collective_seconds("all_gather", size, links.tp)

    def rs(size):
        return collective_seconds("reduce_scatter", size, links.tp)
    assert time.forward_comm == pytest.approx(ag(q * latent) + rs(activation) + ag(q * activation) + rs(activation),
                                              rel=1e-12)
    assert time.backward_comm == pytest.approx(ag(q * activation) + rs(latent) + ag(q * activation) + rs(activation),
                                               rel=1e-12)
    assert time.moved.tensor == pytest.approx((q * latent + activation) + (q * activation + activation)
                                              + (q * activation + latent) + (q * activation + activation), rel=1e-12)


def test_folded_experts_leave_a_latent_attention_block_no_mlp_collective_under_fp8():
    """Experts folded over the tensor axis (no shared experts) take the MLP half's tensor-parallel pair away; under
    FP8 with sequence parallelism that pair is the quantized one in a latent attention block too, so nothing of it is
    left: FP8 changes the block's forward collectives by the attention half's latent gather alone (the all-to-alls
    move 16-bit tokens either way)."""
    from dataclasses import replace

    from plandsl.cost.comm import collective_seconds
    from plandsl.cost.layer import estimate_layer_time
    from plandsl.ir.layers import attention_widths
    p, work, links, device, block = mla_block("fp8", ", experts=8, top_k=2")
    assert p.model.latent_attention and work.fold_experts and not p.model.shared_experts
    fp8 = estimate_layer_time(p.model, block, work, device, links)
    bf16 = estimate_layer_time(p.model, block, replace(work, precision=ir.Precision.bf16, fp8_recipe=None), device,
                               links)
    latent = work.tokens * attention_widths(p.model).latent * 2
    saved = collective_seconds("all_gather", latent, links.tp) - collective_seconds("all_gather", latent / 2, links.tp)
    assert bf16.forward_comm - fp8.forward_comm == pytest.approx(saved, rel=1e-9)


@pytest.mark.parametrize("zero", [1, 3])
def test_the_searchs_bounds_price_the_gather_dtype_as_the_estimate_does(zero):
    """The search's own figures (`search.bounds`, `Figures.element`, a first bucket's `bucket_element`) against the
    plan it writes: on every leaf of an FP8-gathering problem the bounds stay at or below the estimate, and without a
    pipeline the exact bound is the estimate (less `SAFE`'s margin), so a figure that moved the gathers at 16 bits
    would sit above it and one that left them out below it. (`test_the_search_prices_and_writes_the_gather_dtype`
    compares the search's estimate, `estimate_plan` of its plan, with `estimate_plan` again.)"""
    from plandsl.cost.compute import DEFAULT_EFFICIENCY
    from plandsl.search import Problem
    from plandsl.search.space import SAFE, Space
    p = lowered("fsdp over dp with gather = fp8", extra=", fp8_recipe: current")
    problem = Problem(p.model, p.cluster, 16, precision=ir.Precision.fp8, fp8_recipe=ir.Fp8Recipe.current,
                      gathering=p.data.gathering)
    space = Space(problem, {"zero_stage": zero, "tp": 1, "cp": 1}, DEFAULT_EFFICIENCY)
    unpipelined = 0
    for root, node, leaf in space_leaves(space):
        exact, scored = space.finish(leaf), space.evaluate(leaf)
        if scored is None:
            continue
        assert scored.plan.data.gather is ir.Precision.fp8
        step = scored.estimate.time.step
        assert node.bound <= leaf.bound <= exact.bound <= step * (1 + 1e-12)
        if root.pp == 1:
            unpipelined += 1
            assert exact.bound == pytest.approx(step * SAFE, rel=1e-12)
    assert unpipelined
