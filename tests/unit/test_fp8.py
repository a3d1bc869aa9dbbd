"""`precision: fp8`: Transformer Engine's recipe as the cost model prices it. The blocks' linear layers run
their GEMMs at the device's FP8 peak; the attention core, the embedding and the output layer stay bf16, as
do activations and communication. `check` needs both peaks (E504), `run` refuses it (E706), Megatron's
`--fp8-format` says it both ways."""
from __future__ import annotations

import pytest

from plandsl import api, ir
from plandsl.cost.estimate import estimate_plan
from plandsl.interop import export_plan, import_text

PLAN = """\
import "clusters/dgx_h100"
{devices}
plan p {{
  model    = llama(layers=16, hidden=4096, heads=32, kv_heads=8, seq=4096, vocab=128256)
  cluster  = {cluster}
  mesh     = [dp = 2, pp = 2, tp = 4]
  train    = {{ global_batch: 32, micro_batch: 1, precision: {precision} }}
  data     = zero1 over dp
  tensor   = megatron over tp with sequence_parallel
  stages   = evenly over pp
  schedule = 1f1b
}}
"""


def _plan(precision: str) -> ir.Plan:
    return api.loads(PLAN.format(devices="", cluster="dgx_h100 x 2", precision=precision)).plans[0]


def test_fp8_speeds_up_the_blocks_linear_layers_only():
    bf16, fp8 = estimate_plan(_plan("bf16")), estimate_plan(_plan("fp8"))
    assert fp8.time.step < bf16.time.step
    assert fp8.flops_per_step == pytest.approx(bf16.flops_per_step)  # the same work, at a higher peak
    # Transformer Engine keeps the linear layers' saved inputs in FP8: less activation memory, the states alike
    assert all(f.activations < b.activations for f, b in zip(fp8.memory, bf16.memory))
    assert [m.states for m in fp8.memory] == [m.states for m in bf16.memory]
    plan = _plan("fp8")
    h100 = plan.cluster.devices_in_order()[0]
    assert fp8.mfu == pytest.approx(fp8.model_flops_per_step / (fp8.time.step * fp8.devices * h100.peak[ir.Precision.fp8]))


def test_attention_and_the_output_layer_stay_16_bit():
    from plandsl.cost.compute import DEFAULT_EFFICIENCY, Work, estimate_layer_compute
    from plandsl.ir.placement import assign_stages
    plan = _plan("bf16")
    model, device = plan.model, plan.cluster.devices_in_order()[0]
    assignment, _ = assign_stages(plan)
    layers = {layer.kind: layer for stage in assignment.stage_layers for layer in stage}
    for efficiency in (DEFAULT_EFFICIENCY, None):  # one pair of knobs for every precision; the H100's measured ones
        times = {(kind, p): estimate_layer_compute(model, layers[kind], Work(1, 4096, tp=4, precision=ir.Precision(p)),
                                                   device, efficiency)
                 for kind in ("head", "block") for p in ("bf16", "fp8")}
        assert times["head", "fp8"].forward_matmul == pytest.approx(times["head", "bf16"].forward_matmul)
        fp8, bf16 = times["block", "fp8"], times["block", "bf16"]
        assert fp8.attention == pytest.approx(bf16.attention) and fp8.attention > 0
        linear_fp8, linear_bf16 = fp8.forward_matmul - fp8.attention, bf16.forward_matmul - bf16.attention
        if efficiency is DEFAULT_EFFICIENCY:
            assert linear_fp8 < linear_bf16 / 1.5  # the linear layers at twice the peak
        else:  # measured: FP8 GEMMs reach a smaller fraction of their peak, with a longer fixed time
            assert linear_bf16 / 2 < linear_fp8 < linear_bf16


def test_fp8_needs_the_bf16_peak_too_and_run_refuses_it():
    device = ("device fp8_only {\n  memory = 80 GiB\n  bandwidth = 3350 GB/s\n  peak = { fp8: 1979 TFLOP/s }\n}\n"
              "node box {\n  devices = 8 x fp8_only\n  link = { bandwidth: 450 GB/s, latency: 2 us }\n"
              "  nic = { bandwidth: 400 GB/s, latency: 5 us }\n}\n")
    analysis = api.checks(PLAN.format(devices=device, cluster="box x 2", precision="fp8"))
    assert [d.code for d in analysis.errors] == ["E504"] and "bf16" in analysis.errors[0].message
    refusals = api.run_refusals(_plan("fp8"))
    assert [d.code for d in refusals] == ["E706"]
    assert api.run_refusals(_plan("bf16")) == []


def test_megatron_fp8_format_both_ways():
    plan = _plan("fp8")
    exported = export_plan(plan, "megatron")
    assert not exported.lost
    text = " ".join(line.strip() for line in exported.text.splitlines() if not line.startswith("#"))
    assert "--bf16" in text and "--fp8-format hybrid" in text
    imported = import_text("megatron", exported.text, "plan.args", world_size=plan.mesh.size, name=plan.name)
    assert imported.ok, [str(d) for d in imported.diagnostics]
    assert api.select_plan(api.loads(imported.text, path="back.plan")).train.precision is ir.Precision.fp8
    bad = exported.text.replace("--bf16", "--fp16")
    refused = import_text("megatron", bad, "plan.args", world_size=plan.mesh.size, name=plan.name)
    assert "E807" in [d.code for d in refused.diagnostics]


def test_deepspeed_export_says_it_loses_fp8():
    exported = export_plan(_plan("fp8"), "deepspeed")
    assert any("precision: fp8" in d.message for d in exported.lost)


def test_the_clis_precisions_are_the_languages():
    assert sorted(api.precisions()) == sorted(p.value for p in ir.Precision)


def test_generate_searches_in_fp8():
    generated = api.generate(api.generate_request(model="llama3_8b", cluster="dgx_h100", global_batch=64,
                                                  precision="fp8", top=1))
    plan = api.select_plan(api.loads(generated.texts[0], path="gen.plan"))
    assert plan.train.precision is ir.Precision.fp8
    from click.testing import CliRunner
    from plandsl.cli import main
    out = CliRunner().invoke(main, ["generate", "--model", "llama3_8b", "--cluster", "dgx_a100", "--global-batch", "64",
                                    "--precision", "fp8"])
    assert out.exit_code == 1 and "give no peak for fp8" in out.output, out.output  # the A100 has no FP8


def test_fp8_keeps_the_linear_layers_saved_inputs_in_one_byte():
    """Per block and microbatch: bf16 minus what FP8 saves, the q/k/v and MLP inputs (one byte each of h) and the
    w2 input (ffn), split by tp under sequence parallelism; the out-projection's input, the attention's output O,
    costs a byte more (h): the fused attention keeps O in 16 bits for its own backward and the out-projection its
    FP8 copy beside it (the delayed recipe, `cost.memory._attention_output_terms`)."""
    from plandsl.cost.memory import transformer_block_activations
    plan = _plan("bf16")
    model = plan.model
    seq, tp = 4096, 4
    bf16, fp8 = (transformer_block_activations(model, seq, 1, tp, True, ir.Recompute.none, ir.Precision(p))
                 for p in ("bf16", "fp8"))
    saved = seq * (model.hidden * 3 + model.ffn_hidden) / tp
    assert bf16 - fp8 == pytest.approx(saved - 2 * seq * model.hidden / tp)
    full = [transformer_block_activations(model, seq, 1, tp, True, ir.Recompute.full, ir.Precision(p))
            for p in ("bf16", "fp8")]
    assert full[0] == full[1]  # full recomputation keeps the block's 16-bit input only


def test_fp8_latent_attention_saves_its_latents_and_its_wide_output_in_one_byte():
    """MLA under FP8: besides the block input and the MLP's inputs, the two normed latents the up-projections read
    and the out-projection's input (heads x v_head_dim, wider than hidden in DeepSeek-V3) are kept in one byte, the
    latter beside the 16-bit attention output it copies (delayed recipe), as wide."""
    from plandsl.cost.memory import transformer_block_activations
    model = api.loads("model m = llama(layers=4, hidden=256, heads=8, ffn=512, seq=128, vocab=1000, "
                      "q_lora_rank=96, kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, "
                      "v_head_dim=48)\n").models[0]
    seq = 128
    bf16, fp8 = (transformer_block_activations(model, seq, 1, 1, False, ir.Recompute.none, ir.Precision(p))
                 for p in ("bf16", "fp8"))
    saved = seq * ((model.hidden + 96 + 64) + model.hidden + (8 * 48) + model.ffn_hidden)
    assert bf16 - fp8 == pytest.approx(saved - 2 * seq * 8 * 48)


def test_fp8_attention_output_is_kept_in_16_bits_beside_the_out_projections_fp8_copy():
    """Llama 3 70B's block (h 8192, 8 KV heads, ffn 28672) without recomputation, per s·b·h: 33.5 bytes in bf16; under
    FP8 the q/k/v, MLP, out-projection and w2 inputs saved in one byte would make it 27, but Transformer Engine's fused
    attention keeps its 16-bit output O for its backward (backends.py:1301 at v2.10), so under the delayed recipe,
    whose out-projection saves its own FP8 copy, it is 29. Under the other TE recipes megatron-core has the
    out-projection save the 16-bit O itself (`set_save_original_input`, attention.py:363-379 at core_v0.16.1): 28
    (fp8 current), and MXFP8 and NVFP4 likewise keep wo's input at 2 bytes. Selective recomputation of the core keeps
    only its inputs, so O is the out-projection's alone again: 27 under the delayed recipe."""
    from plandsl.cost.memory import transformer_block_activations
    model = api.loads('import "models/llama3"\nmodel m = llama3_70b\n', path="m.plan").models[0]
    seq = 8192
    sbh = seq * model.hidden

    def per_sbh(precision, recipe=None, recompute=ir.Recompute.none):
        return transformer_block_activations(model, seq, 1, 1, False, recompute, ir.Precision(precision),
                                             recipe=recipe) / sbh

    assert per_sbh("bf16") == pytest.approx(33.5)
    assert per_sbh("fp8", ir.Fp8Recipe.delayed) == pytest.approx(29.0)
    assert per_sbh("fp8") == pytest.approx(29.0)  # the recipe not given is delayed (`ir.Training.recipe`)
    assert per_sbh("fp8", ir.Fp8Recipe.current) == pytest.approx(28.0)
    assert per_sbh("fp8", ir.Fp8Recipe.delayed, ir.Recompute.selective) == pytest.approx(27.0)
    assert per_sbh("fp8", ir.Fp8Recipe.current, ir.Recompute.selective) == pytest.approx(28.0)
    mx = 2 - ir.Precision.mxfp8.gemm_bytes  # what MXFP8 saves per saved input element
    assert per_sbh("mxfp8") == pytest.approx(33.5 - mx * (1 + 1 + 3.5))  # all but wo's input (1 wide)


def test_fp8_quantizes_each_gemms_input_forward_and_its_output_gradient_backward():
    """Transformer Engine's cast-transpose per GEMM operand: read 16-bit, write row- and column-wise FP8, 4 bytes
    per element (delayed scaling). A llama block under tp 4 with sequence parallelism, per token: forward the QKV
    and fc1 inputs on the sequence shard (h/4 each), wo's and fc2's inputs on the rank's heads and MLP share
    (q/4, ffn/4); backward the QKV and fc1 outputs' gradients ((q + 2 kv)/4, 2 ffn/4), wo's and fc2's (h/4)."""
    from plandsl.cost.compute import FP8_CAST_BYTES, Efficiency, Work, estimate_layer_compute
    from plandsl.ir.layers import layers_of
    model = ir.TransformerModel(kind="llama", name="l", layers=2, hidden=4096, heads=32, kv_heads=8,
                                ffn_hidden=14336, seq=4096, vocab=32000)
    device = ir.DeviceType(name="d", memory=80 * 2**30, bandwidth=1.0, peak={"bf16": 1e15, "fp8": 2e15})
    block = next(x for x in layers_of(model) if x.kind == "block")
    h, kv, ffn, t, tokens = 4096, 1024, 14336, 4, 4096

    def other(precision):
        work = Work(1, tokens, tp=t, sequence_parallel=True, precision=precision)
        result = estimate_layer_compute(model, block, work, device, Efficiency(1.0, 0.0))
        return result.forward_other, result.backward_other
    (fwd8, bwd8), (fwd16, bwd16) = other(ir.Precision.fp8), other(ir.Precision.bf16)
    assert FP8_CAST_BYTES == 4.0
    assert fwd8 - fwd16 == pytest.approx(tokens * (h / t + h / t + h / t + ffn / t) * 4, rel=1e-12)
    assert bwd8 - bwd16 == pytest.approx(tokens * ((h + 2 * kv) / t + h / t + 2 * ffn / t + h / t) * 4, rel=1e-12)
