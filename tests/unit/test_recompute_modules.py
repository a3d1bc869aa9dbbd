"""`recompute: selective, recompute_modules: [...]` (Megatron-Core's --recompute-modules): the language, the
checker and what each module drops from a block's saved activations and reruns in its backward, held against the
tensors megatron-core 0.16.1's checkpoints free (cost.memory._module_terms)."""
from __future__ import annotations

import pytest

from plandsl import api, ir
from plandsl.cost.compute import Work, estimate_layer_compute
from plandsl.cost.estimate import estimate_plan
from plandsl.cost.memory import transformer_block_activations
from plandsl.ir.layers import layers_of

PLAN = """\
import "clusters/dgx_h100"
plan p {{
  model   = llama(layers=4, hidden=1024, heads=8, kv_heads=8, seq=2048, vocab=1024, {model})
  cluster = dgx_h100 x 1
  mesh    = [dp = 8]
  train   = {{ global_batch: 16, micro_batch: 1, {train} }}
  data    = fsdp over dp
}}
"""
MOE = "experts=8, top_k=2, ffn=2048, shared_experts=1"
MLA = "kv_lora_rank=256, q_lora_rank=384, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64"
Module = ir.RecomputeModule


def _codes(model: str, train: str) -> list[str]:
    return [d.code for d in api.checks(PLAN.format(model=model, train=train), path="p.plan").diagnostics]


def _plan(model: str, train: str) -> ir.Plan:
    return api.select_plan(api.loads(PLAN.format(model=model, train=train), path="p.plan"))


def test_selective_alone_is_the_attention_core_and_dumps_as_before():
    plan = _plan(MOE, "recompute: selective")
    assert plan.train.recompute_modules is None and plan.train.modules == {Module.core_attn}
    assert "recompute_modules" not in plan.train.model_dump()
    written = _plan(MOE, "recompute: selective, recompute_modules: [core_attn]")
    assert estimate_plan(written).time.step == estimate_plan(plan).time.step
    assert [m.activations for m in estimate_plan(written).memory] == [m.activations for m in estimate_plan(plan).memory]


@pytest.mark.parametrize("train, code", [
    ("recompute: full, recompute_modules: [moe_act]", "E205"),         # modules without selective
    ("recompute: selective, recompute_modules: [moe_ac]", "E210"),     # not a module
    ("recompute: selective, recompute_modules: [moe, moe]", "E205"),   # twice
    ("recompute: selective, recompute_modules: []", "E205"),           # none
])
def test_the_list_is_read_as_megatrons(train, code):
    assert _codes(MOE, train) == [code]


@pytest.mark.parametrize("model, module", [
    ("", "moe_act"), ("", "moe"), ("", "shared_experts"), ("experts=8, top_k=2", "shared_experts"),
    (MOE, "mla_up_proj"), (MOE, "mlp"),
])
def test_a_module_the_model_does_not_have_is_E516(model, module):
    assert _codes(model, f"recompute: selective, recompute_modules: [{module}]") == ["E516"]


def test_fp8_delayed_scaling_refuses_layernorm_and_moe_act_E517():
    assert _codes(MOE, "precision: fp8, recompute: selective, recompute_modules: [layernorm]") == ["E517"]
    assert _codes(MOE, "precision: fp8, fp8_recipe: current, recompute: selective, recompute_modules: "
                       "[layernorm, moe_act]") == []
    assert _codes(MOE, "precision: fp8, recompute: selective, recompute_modules: [moe]") == []


def _block(model: ir.TransformerModel, modules, precision=ir.Precision.bf16, recipe=None) -> float:
    return transformer_block_activations(model, 2048, 1, 1, False, ir.Recompute.selective, precision,
                                         recipe=recipe, modules=frozenset(modules))


def test_each_module_drops_what_megatron_core_frees():
    """Per s·b·h element at 16 bits (2 bytes): layernorm the MoE block's router input (its MLP norm is TENorm; the
    attention's is fused into linear_qkv, nothing) and under MLA the down-projections' input too; moe_act the
    activation's output per routed copy (ffn each); moe the dispatched copies and every expert's internals;
    shared_experts their internals; mla_up_proj Q, K, V and the normed latents; mlp a dense block's MLP input and
    internals."""
    moe = _plan(MOE, "recompute: selective").model
    sbh, h, ffn = 2048 * 1024, 1024, 2048
    base = _block(moe, [])
    assert base - _block(moe, [Module.layernorm]) == 2 * sbh
    assert base - _block(moe, [Module.moe_act]) == 2 * sbh * ffn / h * 2
    assert base - _block(moe, [Module.shared_experts]) == 6 * sbh * ffn / h
    assert base - _block(moe, [Module.moe]) == 2 * sbh * 2 + 6 * sbh * ffn / h * 3
    assert _block(moe, [Module.moe, Module.moe_act, Module.shared_experts]) == _block(moe, [Module.moe])
    dense = _plan("ffn=4096", "recompute: selective").model
    assert _block(dense, []) - _block(dense, [Module.layernorm]) == 0  # fused into the next linear
    assert _block(dense, []) - _block(dense, [Module.mlp]) == 2 * sbh + 6 * sbh * 4096 / h
    mla = _plan(MLA, "recompute: selective").model
    widths = (8 * 96, 8 * 96, 8 * 64)  # q, k (nope + rope), v per head
    assert _block(mla, []) - _block(mla, [Module.mla_up_proj]) == \
        pytest.approx(2 * sbh * (384 + 256) / h + 2 * 2048 * sum(widths))
    assert _block(mla, []) - _block(mla, [Module.layernorm]) == 2 * sbh


def test_under_fp8_the_freed_inputs_are_the_saved_fp8_copies():
    """Under FP8 the layers after the module save the 16-bit original (set_save_original_input), freed with the
    module's output: moe_act drops fc2's FP8 input (1 byte per element, current scaling) where bf16 drops 2."""
    moe = _plan(MOE, "recompute: selective").model
    fp8, current = ir.Precision.fp8, ir.Fp8Recipe.current
    sbh, ffn_share = 2048 * 1024, 2048 / 1024 * 2
    assert _block(moe, [], fp8, current) - _block(moe, [Module.moe_act], fp8, current) == pytest.approx(sbh * ffn_share)


def test_each_module_reruns_its_forward_in_the_backward():
    """The rerun seconds: nothing without modules; core_attn the attention core; the others a part of the forward
    each, `moe` more than its parts (moe_act, shared_experts) and the whole MoE's FLOPs."""
    plan = _plan(MOE, "recompute: selective")
    block = next(layer for layer in layers_of(plan.model) if layer.kind == "block")
    device = plan.cluster.groups[0].node.device

    def rerun(*modules):
        work = Work(1, 2048, recompute=ir.Recompute.selective, modules=frozenset(modules))
        compute = estimate_layer_compute(plan.model, block, work, device)
        return compute.recompute, compute.recompute_flops, compute.forward

    assert rerun()[:2] == (0.0, 0.0)
    assert rerun(Module.core_attn)[0] == estimate_layer_compute(
        plan.model, block, Work(1, 2048, recompute=ir.Recompute.selective), device).attention
    for module in (Module.layernorm, Module.moe_act, Module.shared_experts, Module.moe):
        assert 0 < rerun(module)[0] < rerun(module)[2]
    assert rerun(Module.moe)[0] > rerun(Module.moe_act)[0] + rerun(Module.shared_experts)[0]
    assert rerun(Module.moe_act)[1] == 0.0 and rerun(Module.moe)[1] > rerun(Module.shared_experts)[1] > 0


def test_the_plan_keeps_less_and_takes_longer_as_modules_are_added():
    core = estimate_plan(_plan(MOE, "recompute: selective"))
    more = estimate_plan(_plan(MOE, "recompute: selective, recompute_modules: [core_attn, layernorm, moe_act]"))
    assert more.memory[0].activations < core.memory[0].activations
    assert more.time.step > core.time.step
    shown = api.describe(api.loads(PLAN.format(model=MOE, train="recompute: selective, recompute_modules: [moe]")))
    assert "recompute selective (moe)" in shown


def test_run_refuses_output_freeing_modules_with_a_split_backward_E703():
    """layernorm, moe_act and mla_up_proj rebuild their outputs from a gradient hook that serves one backward pass;
    a zero-bubble schedule's separate input- and weight-gradient passes are refused for them, not for the others."""
    text = PLAN.replace("mesh    = [dp = 8]", "mesh    = [pp = 2, dp = 4]").replace(
        "data    = fsdp over dp", "stages  = evenly over pp\n  schedule = zb_h1")
    for modules, refused in (("layernorm, moe_act", ["E703"]), ("core_attn, moe, shared_experts", [])):
        plan = api.select_plan(api.loads(text.format(model=MOE, train=f"recompute: selective, recompute_modules: "
                                                                         f"[{modules}]"), path="p.plan"))
        assert [d.code for d in api.run_refusals(plan)] == refused


def test_run_refuses_selective_op_with_a_split_backward_on_a_one_rank_pipeline_E703():
    """Drawn by tests/property/test_check_runs.py: `zbv` over `pp = 1` (two stages on the one rank) with
    `recompute: selective_op` raised torch's "Trying to backward an extra time" on 2 data ranks: the run builds
    torch's schedule for any `stages`, so its I and W passes split the backward whatever the axis's size."""
    text = PLAN.replace("mesh    = [dp = 8]", "mesh    = [pp = 1, dp = 8]").replace(
        "data    = fsdp over dp", "stages  = evenly over pp with virtual = 2, map = vshape\n  schedule = zbv")
    for recompute, refused in (("selective_op", ["E703"]), ("full", [])):
        plan = api.select_plan(api.loads(text.format(model="", train=f"recompute: {recompute}"), path="p.plan"))
        assert [d.code for d in api.run_refusals(plan)] == refused, recompute


def test_run_refuses_selective_op_over_fsdp_groups_of_modules_E703():
    """`recompute: selective_op` beside ZeRO-2/3 gathering by module (drawn by tests/property/test_check_runs.py:
    zero3 with `unit = module` on 2 ranks raised torch's "invocation index ... not found in storage"): every module
    of a block is then an FSDP2 group whose hooks run inside the block the selective checkpoint replays, other ops in
    the rerun than in the forward. Gathering by block keeps the groups around the checkpointed blocks."""
    for data, refused in (("fsdp over dp with unit = module", ["E703"]), ("zero2 over dp with unit = module", ["E703"]),
                          ("fsdp over dp", []), ("fsdp over dp with unit = block", [])):
        plan = api.select_plan(api.loads(PLAN.replace("fsdp over dp", data).format(model="", train="recompute: "
                                                                                  "selective_op"), path="p.plan"))
        assert [d.code for d in api.run_refusals(plan)] == refused, data
    plan = api.select_plan(api.loads(PLAN.replace("fsdp over dp", "fsdp over dp with unit = module").format(
        model="", train="recompute: full"), path="p.plan"))
    assert api.run_refusals(plan) == []  # checkpoint_wrapper alone reruns whatever the forward ran


def test_generate_takes_the_modules_as_a_pin_and_writes_them():
    """`generate --pin recompute_modules=...`: every plan recomputes selectively with those modules, written in its
    train dict, and the search's figures are the written plan's estimate; a module the model lacks is refused."""
    model = "llama(layers=4, hidden=1024, heads=8, kv_heads=8, seq=2048, vocab=1024, experts=8, top_k=2, ffn=2048)"
    request = api.generate_request(model=model, cluster="dgx_h100 x 1", global_batch=16, top=2,
                                   pins=("recompute_modules=layernorm,moe_act",))
    generated = api.generate(request)
    for scored, text in zip(generated.result.candidates, generated.texts):
        assert "recompute: selective" in text and "recompute_modules: [layernorm, moe_act]" in text
        plan = api.select_plan(api.loads(text, path="generated.plan"))
        assert estimate_plan(plan).time.step == pytest.approx(scored.estimate.time.step)
    refused = api.generate_request(model=model.replace(", experts=8, top_k=2", ""), cluster="dgx_h100 x 1",
                                   global_batch=16, pins=("recompute_modules=moe_act",))
    with pytest.raises(api.PlanError, match="E516") as raised:  # the search's refusal, coded as the pin's (E805)
        api.generate(refused)
    assert [d.code for d in raised.value.diagnostics] == ["E805"]


def test_moe_reruns_the_dispatch_and_combine_and_nothing_else_of_the_block():
    """`moe` checkpoints the MoE layer with its token dispatcher: the backward sends the routed tokens again (the
    expert axis's bytes 6/4 of the forward-and-backward's), the tensor axis's collectives (outside the MoE layer) are
    not rerun; `moe_act` and `layernorm` rerun no communication."""
    text = PLAN.replace("mesh    = [dp = 8]", "mesh    = [ep = 4, tp = 2]").replace(
        "data    = fsdp over dp", "tensor  = megatron over tp with sequence_parallel\n  experts = alltoall over ep")
    moved = {}
    for modules in ("core_attn", "moe_act, layernorm", "moe"):
        plan = api.select_plan(api.loads(text.format(model=MOE, train=f"recompute: selective, recompute_modules: "
                                                                       f"[{modules}]"), path="p.plan"))
        moved[modules] = estimate_plan(plan).communication
    assert moved["moe_act, layernorm"] == moved["core_attn"]
    assert moved["moe"].expert == pytest.approx(moved["core_attn"].expert * 6 / 4)
    assert moved["moe"].tensor == moved["core_attn"].tensor


def test_the_memory_tracer_sees_a_discarded_output_freed_and_refilled():
    """`runtime.discard` frees an output's storage by resizing it (no operator shows it) once the layer after it has
    run, and refills it in the backward: the tracer records both (`memtrace._discard_resizes`), so a trace of
    `recompute_modules` holds the outputs only where `run` does. Here on real tensors: the output's storage
    allocated, freed after the layer reading it, allocated again by the rebuild, freed when the backward is done."""
    import torch

    from plandsl.runtime import memtrace
    from plandsl.runtime.discard import DiscardedOutput

    weight = torch.randn(64, 64, requires_grad=True)
    x = torch.randn(32, 64, requires_grad=True)
    with memtrace.recording(fake=False) as recorder, recorder:  # the recorder records as a dispatch mode
        up = DiscardedOutput(lambda inputs: torch.tanh(inputs @ weight))
        hidden = up(x)
        after = hidden * 2.0
        up.discard(after)
        after.sum().backward()
    tanh = [serial for serial, label in recorder.labels.items() if label.startswith("tanh")]
    events = [(op, serial) for op, serial, _ in recorder.events if serial in tanh]
    # allocated (forward), freed (discard), allocated again (rebuilt, a new serial of the same storage) ... freed
    assert events[:2] == [(1, tanh[0]), (-1, tanh[0])]
    assert (1, tanh[1]) in events[2:] and len(tanh) >= 2
    assert weight.grad is not None and torch.allclose(x.grad, 2 * (1 - torch.tanh(x @ weight) ** 2) @ weight.T, atol=1e-5)
