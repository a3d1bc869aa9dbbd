"""`precision: mxfp8`: Transformer Engine's MXFP8BlockScaling as the cost model prices it (Blackwell). The blocks'
linear layers run at the device's `mxfp8` peak with FP8 elements and one 8-bit scale per 32 (row- and column-wise
copies); the rest stays bf16. `check` refuses it on a device without an mxfp8 peak (Hopper: E504), `run` refuses
it (E706), Megatron's `--fp8-recipe mxfp8` says it both ways. The Blackwell clusters of the stdlib hold it.
`precision: nvfp4` (NVFP4BlockScaling: FP4 elements, an E4M3 scale per 16) likewise, at the devices' FP4 peak."""
from __future__ import annotations

import pytest

from plandsl import api, ir
from plandsl.cost.estimate import estimate_plan
from plandsl.interop import export_plan, import_text
from tests.unit.test_fp8 import PLAN

def _text(precision: str, file: str = "dgx_b200", cluster: str = "dgx_b200 x 2") -> str:
    """test_fp8's plan (llama 16 x 4096, dp 2 x pp 2 x tp 4) on `file`'s cluster."""
    return PLAN.format(devices=f'import "clusters/{file}"', cluster=cluster, precision=precision)


def _plan(precision: str, **where) -> ir.Plan:
    return api.loads(_text(precision, **where)).plans[0]


@pytest.mark.parametrize("file, cluster", [("dgx_h100", "dgx_h100 x 2"), ("dgx_h200", "dgx_h200 x 2")])
def test_hopper_has_no_mxfp8_peak(file, cluster):
    analysis = api.checks(_text("mxfp8", file, cluster))
    assert [d.code for d in analysis.errors] == ["E504"]
    error = analysis.errors[0]
    assert "no peak for mxfp8" in error.message and "precision: fp8" in error.hint
    assert api.checks(_text("fp8", file, cluster)).ok


@pytest.mark.parametrize("file, cluster", [("dgx_b200", "dgx_b200 x 2"), ("gb200_nvl72", "gb200_nvl72"),
                                           ("dgx_b300", "dgx_b300 x 2"), ("gb300_nvl72", "gb300_nvl72")])
def test_blackwell_runs_mxfp8_at_its_fp8_rate(file, cluster):
    assert api.checks(_text("mxfp8", file, cluster)).ok
    device = _plan("mxfp8", file=file, cluster=cluster).cluster.devices_in_order()[0]
    assert device.peak[ir.Precision.mxfp8] == device.peak[ir.Precision.fp8] == 2 * device.peak[ir.Precision.bf16]


def test_mxfp8_needs_the_bf16_peak_too():
    text = _text("mxfp8").replace('import "clusters/dgx_b200"', (
        "device mx_only {\n  memory = 180 GB\n  bandwidth = 8000 GB/s\n  peak = { mxfp8: 4500 TFLOP/s }\n}\n"
        "node box {\n  devices = 8 x mx_only\n  link = { bandwidth: 900 GB/s, latency: 2 us }\n"
        "  nic = { bandwidth: 400 GB/s, latency: 5 us }\n}\n")).replace("dgx_b200 x 2", "box x 2")
    errors = api.checks(text).errors
    assert [d.code for d in errors] == ["E504"] and "no peak for bf16" in errors[0].message
    assert "mxfp8 runs the blocks' linear layers in FP8" in errors[0].message


def _block(precision: ir.Precision, tp: int = 4):
    """A llama block's compute on a device whose peaks are all equal, at full efficiency and no kernel time:
    the seconds differ only by the bytes each precision moves."""
    from plandsl.cost.compute import Efficiency, Work, estimate_layer_compute
    from plandsl.ir.layers import layers_of
    model = ir.TransformerModel(kind="llama", name="l", layers=2, hidden=4096, heads=32, kv_heads=8,
                                ffn_hidden=14336, seq=4096, vocab=32000)
    device = ir.DeviceType(name="d", memory=80 * 2**30, bandwidth=1.0,
                           peak={"bf16": 1e15, "fp8": 1e15, "mxfp8": 1e15, "nvfp4": 1e15})
    block = next(x for x in layers_of(model) if x.kind == "block")
    work = Work(1, 4096, tp=tp, sequence_parallel=True, precision=precision)
    return estimate_layer_compute(model, block, work, device, Efficiency(1.0, 0.0))


def test_mxfp8_counts_its_scales_in_the_casts_and_the_gemms():
    """The casts: one E8M0 byte per 32 elements for each of the row- and column-wise copies, beyond FP8's 4 bytes
    per element (read 2, write 1 + 1) -- the forward quantizes the QKV, out-projection, fc1 and fc2 inputs
    (h/4, q/4, h/4, ffn/4 per token under tp 4 with sequence parallelism), the backward their output gradients.
    The GEMMs: each operand element is 1 + 1/32 bytes where fp8's is 1 and bf16's 2, so (mxfp8 - fp8) is 1/32 of
    (bf16 - fp8) in the linear GEMMs' bytes; the attention core and the rest stay bf16 in all three."""
    h, kv, ffn, t, tokens = 4096, 1024, 14336, 4, 4096
    bf16, fp8, mx = (_block(p) for p in (ir.Precision.bf16, ir.Precision.fp8, ir.Precision.mxfp8))
    scales = 2 / 32
    assert mx.forward_other - fp8.forward_other == pytest.approx(
        tokens * (h / t + h / t + h / t + ffn / t) * scales, rel=1e-12)
    assert mx.backward_other - fp8.backward_other == pytest.approx(
        tokens * ((h + 2 * kv) / t + h / t + 2 * ffn / t + h / t) * scales, rel=1e-12)
    assert mx.attention == fp8.attention == bf16.attention > 0
    assert mx.forward_matmul - fp8.forward_matmul == pytest.approx((bf16.forward_matmul - fp8.forward_matmul) / 32,
                                                                   rel=1e-9)
    assert mx.forward_matmul > fp8.forward_matmul


def test_mxfp8_keeps_the_saved_inputs_with_their_scales():
    """Per block and microbatch: the inputs FP8 keeps in one byte (test_fp8) are 1 + 1/32 bytes under mxfp8, but the
    out-projection's, which under MXFP8 megatron-core has it save in 16 bits, the attention's own output
    (`set_save_original_input`; the delayed FP8 recipe keeps that 16-bit output beside its FP8 copy)."""
    from plandsl.cost.memory import transformer_block_activations
    model = _plan("bf16").model
    seq, tp = 4096, 4
    bf16, fp8, mx = (transformer_block_activations(model, seq, 1, tp, True, ir.Recompute.none, ir.Precision(p))
                     for p in ("bf16", "fp8", "mxfp8"))
    saved = seq * (model.hidden * 3 + model.ffn_hidden) / tp  # elements
    output = seq * model.hidden / tp  # the attention's output, the out-projection's input
    assert bf16 - fp8 == pytest.approx(saved - 2 * output)
    assert bf16 - mx == pytest.approx((saved - output) * (2 - ir.Precision.mxfp8.gemm_bytes))


def test_mxfp8_estimates_between_bf16_and_fp8_on_blackwell():
    bf16, fp8, mx = (estimate_plan(_plan(p)) for p in ("bf16", "fp8", "mxfp8"))
    assert fp8.time.step < mx.time.step < bf16.time.step
    assert mx.flops_per_step == pytest.approx(bf16.flops_per_step)


def test_run_refuses_mxfp8():
    refusals = api.run_refusals(_plan("mxfp8"))
    assert [d.code for d in refusals] == ["E706"] and "mxfp8" in refusals[0].message


def test_megatron_fp8_recipe_mxfp8_both_ways():
    plan = _plan("mxfp8")
    exported = export_plan(plan, "megatron")
    assert not exported.lost
    text = " ".join(line.strip() for line in exported.text.splitlines() if not line.startswith("#"))
    assert "--bf16" in text and "--fp8-format e4m3" in text and "--fp8-recipe mxfp8" in text
    back = import_text("megatron", exported.text, "plan.args", world_size=plan.mesh.size, cluster="dgx_b200 x 2",
                       name=plan.name)
    assert back.ok, [str(d) for d in back.diagnostics]
    assert api.select_plan(api.loads(back.text, path="back.plan")).train.precision is ir.Precision.mxfp8
    for recipe in ("delayed", "tensorwise", "blockwise"):  # per-tensor or blockwise scales: the plan's fp8
        other = import_text("megatron", exported.text.replace("mxfp8", recipe), "plan.args",
                            world_size=plan.mesh.size, cluster="dgx_b200 x 2", name=plan.name)
        assert api.select_plan(api.loads(other.text, path="o.plan")).train.precision is ir.Precision.fp8
    custom = import_text("megatron", exported.text.replace("mxfp8", "custom"), "plan.args",
                         world_size=plan.mesh.size, cluster="dgx_b200 x 2", name=plan.name)
    assert [d.code for d in custom.diagnostics] == ["E807"]
    alone = import_text("megatron", exported.text.replace("--fp8-format e4m3", ""), "plan.args",
                        world_size=plan.mesh.size, cluster="dgx_b200 x 2", name=plan.name)
    assert [d.code for d in alone.diagnostics] == ["E807"] and "--fp8-recipe" in alone.diagnostics[0].message


def test_other_exports_say_they_lose_mxfp8():
    plan = _plan("mxfp8")
    assert any("precision: mxfp8" in d.message for d in export_plan(plan, "deepspeed").lost)
    assert any("precision: mxfp8" in d.message for d in export_plan(plan, "torchtitan").lost)


def test_generate_searches_in_mxfp8_on_blackwell_only():
    generated = api.generate(api.generate_request(model="llama3_8b", cluster="dgx_b200", global_batch=64,
                                                  precision="mxfp8", top=1))
    plan = api.select_plan(api.loads(generated.texts[0], path="gen.plan"))
    assert plan.train.precision is ir.Precision.mxfp8
    from click.testing import CliRunner
    from plandsl.cli import main
    out = CliRunner().invoke(main, ["generate", "--model", "llama3_8b", "--cluster", "dgx_h100", "--global-batch",
                                    "64", "--precision", "mxfp8"])
    assert out.exit_code == 1 and "give no peak for mxfp8;" in out.output, out.output  # the H100 has bf16: not named
    assert "--precision fp8" in out.output


def test_an_nvl72_rack_is_one_node_of_72_devices():
    """GB200 NVL72: 72 devices in one NVLink domain, so data parallelism over all 72 never crosses a NIC: its
    gradient reduction is faster than over the same devices in nodes of 8 (the DGX B200's)."""
    rack = api.loads('import "clusters/gb200_nvl72"\ncluster c = gb200_nvl72\n').clusters[0]
    assert rack.num_devices == 72 and len(rack.groups) == 1 and rack.groups[0].node.devices == 72
    text = PLAN.replace("mesh     = [dp = 2, pp = 2, tp = 4]", "mesh     = [dp = 72]").replace(
        "  tensor   = megatron over tp with sequence_parallel\n  stages   = evenly over pp\n  schedule = 1f1b\n", "")
    eights = ("node eights {\n  devices = 8 x gb200\n  link = { bandwidth: 900 GB/s, latency: 2 us }\n"
              "  nic = { bandwidth: 400 GB/s, latency: 5 us }\n}\n")
    rack_text = text.format(devices='import "clusters/gb200_nvl72"', cluster="gb200_nvl72", precision="bf16")
    nine_text = text.format(devices='import "clusters/gb200_nvl72"', cluster="eights x 9", precision="bf16") + eights
    assert api.checks(rack_text.replace("global_batch: 32", "global_batch: 72")).ok
    one, nine = (api.loads(t.replace("global_batch: 32", "global_batch: 72")).plans[0] for t in (rack_text, nine_text))
    assert estimate_plan(one).time.step < estimate_plan(nine).time.step


# ---- nvfp4 ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("file, cluster", [("dgx_h100", "dgx_h100 x 2"), ("dgx_h200", "dgx_h200 x 2")])
def test_hopper_has_no_nvfp4_peak(file, cluster):
    errors = api.checks(_text("nvfp4", file, cluster)).errors
    assert [d.code for d in errors] == ["E504"] and "no peak for nvfp4" in errors[0].message
    assert "FP4 tensor cores" in errors[0].hint


@pytest.mark.parametrize("file, cluster", [("dgx_b200", "dgx_b200 x 2"), ("gb200_nvl72", "gb200_nvl72")])
def test_blackwell_runs_nvfp4_at_twice_its_fp8_rate(file, cluster):
    assert api.checks(_text("nvfp4", file, cluster)).ok
    device = _plan("nvfp4", file=file, cluster=cluster).cluster.devices_in_order()[0]
    assert device.peak[ir.Precision.nvfp4] == 2 * device.peak[ir.Precision.fp8]


def test_nvfp4_counts_half_bytes_its_scales_and_its_amax_pass():
    """Casts: an amax pass (read 2 bytes: the per-tensor FP32 scale comes first), then read 2 and write two FP4
    copies, each element half a byte and its block of 16 one E4M3 byte: 2 + 2 + 2 (1/2 + 1/16) per element of the
    same tensors FP8 quantizes. GEMMs: 1/2 + 1/16 bytes per operand element where fp8's is 1 and bf16's 2."""
    h, kv, ffn, t, tokens = 4096, 1024, 14336, 4, 4096
    bf16, fp8, nv = (_block(p) for p in (ir.Precision.bf16, ir.Precision.fp8, ir.Precision.nvfp4))
    per_element = 2 + 2 + 2 * (0.5 + 1 / 16)
    assert nv.forward_other - bf16.forward_other == pytest.approx(
        tokens * (h / t + h / t + h / t + ffn / t) * per_element, rel=1e-12)
    assert nv.backward_other - bf16.backward_other == pytest.approx(
        tokens * ((h + 2 * kv) / t + h / t + 2 * ffn / t + h / t) * per_element, rel=1e-12)
    assert nv.forward_matmul - fp8.forward_matmul == pytest.approx(
        -(1 - 0.5625) * (bf16.forward_matmul - fp8.forward_matmul), rel=1e-9)


def test_nvfp4_keeps_its_saved_inputs_in_half_a_byte_and_a_scale():
    from plandsl.cost.memory import transformer_block_activations
    model = _plan("bf16").model
    bf16, nv = (transformer_block_activations(model, 4096, 1, 4, True, ir.Recompute.none, ir.Precision(p))
                for p in ("bf16", "nvfp4"))
    # the out-projection's input stays 16-bit, the attention's own output (`set_save_original_input`)
    assert bf16 - nv == pytest.approx(4096 * (model.hidden * 2 + model.ffn_hidden) / 4 * (2 - 0.5625))


def test_nvfp4_estimates_faster_than_mxfp8_and_run_refuses_it():
    assert estimate_plan(_plan("nvfp4")).time.step < estimate_plan(_plan("mxfp8")).time.step
    refusals = api.run_refusals(_plan("nvfp4"))
    assert [d.code for d in refusals] == ["E706"] and "FP4 tensor cores" in refusals[0].message


def test_megatron_fp4_recipe_nvfp4_both_ways():
    plan = _plan("nvfp4")
    exported = export_plan(plan, "megatron")
    assert not exported.lost
    text = " ".join(line.strip() for line in exported.text.splitlines() if not line.startswith("#"))
    assert "--bf16" in text and "--fp4-format e2m1" in text and "--fp4-recipe nvfp4" in text and "--fp8" not in text
    where = dict(world_size=plan.mesh.size, cluster="dgx_b200 x 2", name=plan.name)
    back = import_text("megatron", exported.text, "plan.args", **where)
    assert back.ok, [str(d) for d in back.diagnostics]
    assert api.select_plan(api.loads(back.text, path="back.plan")).train.precision is ir.Precision.nvfp4
    custom = import_text("megatron", exported.text.replace("--fp4-recipe nvfp4", "--fp4-recipe custom"), "a", **where)
    both = import_text("megatron", exported.text.replace("--bf16", "--bf16 --fp8-format e4m3"), "a", **where)
    assert [d.code for d in custom.diagnostics] == ["E807"] and [d.code for d in both.diagnostics] == ["E807"]
    alone = import_text("megatron", exported.text.replace("--fp4-format e2m1", ""), "a", **where)
    assert [d.code for d in alone.diagnostics] == ["E807"] and "--fp4-recipe" in alone.diagnostics[0].message
