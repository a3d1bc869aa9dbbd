"""A convolutional model through `plandsl inspect` and the plan side (issue 18 item 4): torchvision's ResNet-18
(written out in inspect_models/resnet.py: torchvision's wheel does not load beside the CPU torch), traced on
images [2, 3, 32, 32] per sample, its block list the BasicBlocks of the Sequential stages layer1 .. layer4;
then check, estimate, render, simulate and generate over a plan of it; what no plan over it may ask (E413,
E414: tensor parallelism; E415: spatial sharding); bad input specs and a forward that fails on the given shape."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from plandsl import api
from plandsl.cli import main
from plandsl.ir.inspected import ModelSource, parse_source

pytestmark = pytest.mark.xdist_group("torch")  # one worker pays for importing torch and tracing

HERE = str(Path(__file__).resolve().parent)
RESNET = "inspect_models.resnet:resnet18(num_classes=10, input=image(3, 32, 32))"
BLOCKS = [f"layer{stage}.{index}" for stage in range(1, 5) for index in range(2)]


@pytest.fixture(scope="module")
def resnet():
    return api.inspect_model(RESNET, search_path=(HERE,))


def _conv(out_hw: int, c_out: int, c_in: int, kernel: int) -> int:
    """Forward FLOPs of a convolution per sample: 2 per multiply-add, one per output element per input tap."""
    return 2 * out_hw * out_hw * c_out * c_in * kernel * kernel


def test_resnet18_parameters_and_block_list(resnet):
    # torchvision's resnet18 has 11,689,512 parameters with 1000 classes; 10 classes: fc 512·10 + 10
    assert resnet.params == 11_689_512 - (512 * 1000 + 1000) + (512 * 10 + 10) == 11_181_642
    assert resnet.block_list is None and resnet.block_list_from == "nn.Sequential"
    assert resnet.containers == ("layer1", "layer2", "layer3", "layer4")
    assert [block.name for block in resnet.blocks] == BLOCKS
    assert {block.type for block in resnet.blocks} == {"BasicBlock"} and resnet.traced_blocks == 8
    assert resnet.seq == 1 and resnet.image == (3, 32, 32) and resnet.output_shape == (10,)
    assert resnet.norm_values == 1  # layer4's BatchNorms see 1x1 maps: a microbatch needs 2 images (E506)
    # before: conv1 (3·49·64) and bn1 (2·64); after: fc
    assert (resnet.before_params, resnet.after_params) == (3 * 49 * 64 + 2 * 64, 512 * 10 + 10)
    assert resnet.before_params + sum(b.params for b in resnet.blocks) + resnet.after_params == resnet.params


def test_resnet18_flops_per_sample_are_its_convolutions(resnet):
    """FlopCounterMode counts the convolutions and the head exactly (BatchNorm, ReLU and pooling are elementwise,
    uncounted, as in the cost model): 32x32 -> conv1 stride 2 -> 16x16 -> maxpool -> 8x8, halved per stage."""
    assert resnet.before.flops == _conv(16, 64, 3, 7)
    expected = {"layer1.0": 2 * _conv(8, 64, 64, 3), "layer1.1": 2 * _conv(8, 64, 64, 3)}
    for stage, (hw, width) in enumerate([(4, 128), (2, 256), (1, 512)], start=2):
        expected[f"layer{stage}.0"] = _conv(hw, width, width // 2, 3) + _conv(hw, width, width, 3) \
            + _conv(hw, width, width // 2, 1)  # the stride-2 block and its 1x1 downsample
        expected[f"layer{stage}.1"] = 2 * _conv(hw, width, width, 3)
    assert {b.name: b.figures.flops for b in resnet.blocks} == expected
    assert resnet.after.flops == 2 * 512 * 10
    assert all(b.figures.flops_per_position == b.figures.activation_bytes_per_position == 0 for b in resnet.blocks)
    # the same at 224x224 scales by the area: 3.63 GFLOPs per image (torchvision's 1.81 G multiply-adds)
    assert resnet.flops_per_token() == pytest.approx(3.627e9 / (224 / 32) ** 2, rel=2e-3)


def test_resnet18_boundaries_and_activations_per_sample(resnet):
    """The boundary a stage sends is the block's output per image (bf16): 64·8·8 after layer1, 512·1·1 after
    layer4. A BasicBlock without downsample keeps exactly five tensors of its output's size (its input, conv1's
    and conv2's outputs for their BatchNorms, the two ReLU outputs) and, per channel and per traced batch of 2,
    each BatchNorm's saved mean and inverse std (fp32): 2·C·8 bytes per batch, 8·C per sample. Its running mean
    and variance, which batch_norm saves too, are buffers, not activations."""
    sizes = {1: 64 * 8 * 8 * 2, 2: 128 * 4 * 4 * 2, 3: 256 * 2 * 2 * 2, 4: 512 * 2}
    for block in resnet.blocks:
        stage = int(block.name[5])
        assert block.output_bytes == sizes[stage]
        assert block.input_bytes == (sizes[stage] if block.name != f"layer{stage}.0" or stage == 1 else 2 * sizes[stage])
        if block.name.endswith(".1") or block.name == "layer1.0":
            channels = 64 * 2 ** (stage - 1)
            assert block.figures.activation_bytes == 5 * sizes[stage] + 8 * channels


def test_a_module_dict_of_heads_is_not_the_block_list():
    """A ModuleDict of a multi-task model's heads (two Linears, keyed by task) holds modules of one class, as a block
    list does, but is not torchtitan's ModuleDict keyed "0" .. "N-1": the blocks stay the trunk's Sequential stages
    (the heads were taken as the two blocks, the trunk's eight left before them)."""
    table = api.inspect_model("inspect_models.resnet:two_heads(input=image(3, 32, 32))", search_path=(HERE,))
    assert table.block_list_from == "nn.Sequential" and len(table.blocks) == 8
    assert table.containers == tuple(f"trunk.layer{stage}" for stage in range(1, 5))


# ~3 CPU-s (25.6 M parameters initialised and traced): the slow tier, which `.ci/run` runs; ResNet-18 above takes
# the same path in the unit tier
@pytest.mark.slow
def test_resnet50_bottlenecks_and_a_features_classifier_layout():
    """ResNet-50 as torchvision's: 25,557,032 parameters, 16 Bottleneck blocks, 8.18 GFLOPs per 224x224 image
    (torchvision's 4.09 G multiply-adds), here at 32x32, where every conv's output has 1/49 of the positions.
    `small`: the run of Sequentials `features`, `classifier` loses `classifier`, which holds no block."""
    table = api.inspect_model("inspect_models.resnet:resnet50(input=image(3, 32, 32))", search_path=(HERE,))
    assert table.params == 25_557_032 and len(table.blocks) == 16 and table.containers == resnet_containers()
    assert table.blocks[0].name == "layer1.0" and {b.type for b in table.blocks} == {"Bottleneck"}
    head = 2 * 2048 * 1000  # fc is the one figure that does not scale with the image
    assert table.flops_per_token() - head == pytest.approx((8.178e9 - head) / 49, rel=2e-3)
    small = api.inspect_model("inspect_models.resnet:small(input=image(3, 16, 16))", search_path=(HERE,))
    assert small.containers == ("features",) and [b.name for b in small.blocks] == [f"features.{i}" for i in range(4)]
    assert small.after_params == 16 * 10 + 10 and small.after.flops == 2 * 16 * 10  # the classifier, after them
    assert small.norm_values == 16 * 16  # no stride: every BatchNorm sees the whole 16x16 map


@pytest.mark.slow  # imports transformers (~3 CPU-s) when no test before it on the worker has
def test_hugging_face_vision_models_take_images():
    """`hf(..., input=image(...))` calls the model with `pixel_values=`: a Hugging Face ResNet (its stages a
    ModuleList, each traced: they differ in resolution) and a ViT (its encoder's `layers`, one traced)."""
    pytest.importorskip("transformers")
    resnet = api.inspect_model('hf("ResNetForImageClassification", embedding_size=16, hidden_sizes=[16, 32], '
                               'depths=[1, 1], layer_type="basic", num_labels=10, input=image(3, 32, 32))')
    assert resnet.block_list == "resnet.encoder.stages" and resnet.traced_blocks == 2
    assert resnet.output_shape == (10,) and [b.output_bytes for b in resnet.blocks] == [16 * 8 * 8 * 2, 32 * 4 * 4 * 2]
    vit = api.inspect_model('hf("ViTForImageClassification", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,'
                            ' intermediate_size=128, image_size=32, patch_size=8, num_labels=10, input=image(3, 32, 32))')
    assert vit.seq == 1 and vit.image == (3, 32, 32) and len(vit.blocks) == 2 and vit.output_shape == (10,)
    assert vit.blocks[0].output_bytes == (16 + 1) * 64 * 2  # 16 patches and the class token per image, bf16


def resnet_containers() -> tuple[str, ...]:
    return ("layer1", "layer2", "layer3", "layer4")


def test_the_input_spec_is_part_of_the_source_and_its_key():
    source = parse_source(RESNET)
    assert source.image == (3, 32, 32) and dict(source.args) == {"num_classes": 10}
    assert parse_source(source.text) == source and "input=image(3, 32, 32)" in source.text
    assert ModelSource("factory", "m:f", (("n", 1),), (1, 28, 28)).text == "m:f(n=1, input=image(1, 28, 28))"
    assert parse_source("m:f(input=image(1, 100))").image == (1, 100)  # 1-D: channels, length
    assert parse_source("m:f(input=7)").args == (("input", 7),)  # a literal `input` is the factory's own argument


@pytest.mark.parametrize("text", ["m:f(input=image())", "m:f(input=image(3))", "m:f(input=image(0, 32, 32))",
                                  "m:f(input=imag(3, 32, 32))", "m:f(input=image(3, 8, 8, 8, 8))",
                                  "m:f(input=image(3, x, 32))", "m:f(input=image(3, 32.0, 32))",
                                  "m:f(input=image(c=3))", "m:f(input=image(3, 32, 32), input=image(3, 8, 8))",
                                  "m:f(input=image(3, 99999999, 32))"])
def test_an_input_spec_that_does_not_parse_is_refused(text):
    with pytest.raises(ValueError, match="image|input"):
        parse_source(text)


@pytest.mark.parametrize("source, shown", [
    ("inspect_models.resnet:resnet18(width=8, input=image(1, 32, 32))", "images [2, 1, 32, 32]"),  # 3 channels
    ("inspect_models.tiny:build(input=image(3, 8, 8))", "images [2, 3, 8, 8]"),  # a token model given images
])
def test_a_forward_that_fails_on_the_given_input_is_E903(source, shown):
    with pytest.raises(api.PlanError) as raised:
        api.inspect_model(source, search_path=(HERE,))
    [diagnostic] = raised.value.diagnostics
    assert diagnostic.code == "E903" and shown in diagnostic.message and "image(" in diagnostic.hint


def test_the_cli_prints_figures_per_sample_and_refuses_a_seq(monkeypatch):
    monkeypatch.chdir(HERE)
    small = "inspect_models.resnet:resnet18(num_classes=10, width=8, input=image(3, 32, 32))"
    result = CliRunner().invoke(main, ["inspect", small])
    assert result.exit_code == 0, result.output
    assert "FLOPs/sample" in result.stdout and "input image(3, 32, 32) per sample" in result.stdout
    assert "layer1, layer2, layer3, layer4 (from nn.Sequential), 8 blocks" in result.stdout
    refused = CliRunner().invoke(main, ["inspect", small, "--seq", "64"])
    assert refused.exit_code == 2 and "per sample" in refused.output
    bad = CliRunner().invoke(main, ["inspect", "inspect_models.resnet:resnet18(input=image(3, 32))x"])
    assert bad.exit_code == 2


PLAN = """\
import "clusters/dgx_a100"
model resnet = factory("inspect_models.resnet:resnet18", num_classes=10, input=image(3, 32, 32))
plan p {
  model   = resnet
  cluster = dgx_a100 x 1
  MESH
  train   = { global_batch: 256, micro_batch: 8 }
  EXTRA
}
"""


@pytest.fixture()
def plan_of(tmp_path, monkeypatch, resnet):
    """`plan_of(mesh, extra)`: a plan over the ResNet with its table where the plan reads it."""
    monkeypatch.chdir(HERE)

    def write(mesh: str = "mesh    = [dp = 4, pp = 2]", extra: str = "stages  = evenly over pp") -> Path:
        plan = tmp_path / "resnet.plan"
        plan.write_text(PLAN.replace("MESH", mesh).replace("EXTRA", extra), encoding="utf-8")
        hint = api.check(plan).diagnostics[0].hint if not (tmp_path / ".plandsl").exists() else None
        if hint is not None:
            assert "plandsl inspect" in hint and "--seq" not in hint  # images: no sequence length
            (tmp_path / ".plandsl").mkdir()
            api.write_inspected(resnet, hint.rsplit("-o ", 1)[1].rstrip(")"))
        return plan
    return write


def test_a_resnet_plan_checks_estimates_renders_and_simulates(plan_of):
    plan = plan_of(extra="data    = zero3 over dp\n  stages  = evenly over pp")
    analysis = api.check(plan)
    assert analysis.ok, [d.message for d in analysis.diagnostics]
    model = analysis.document.plans[0].model
    assert model.image == (3, 32, 32) and model.seq == 1 and model.block_list is None
    assert model.blocks == tuple(BLOCKS) and [layer.name for layer in model.layers] == ["embed", *BLOCKS, "head"]
    assert model.layers[1].output == 64 * 8 * 8  # elements per sample sent on at a stage boundary
    estimate = api.estimate(analysis.document.plans[0])
    assert estimate.time.step > 0
    for command in (["estimate"], ["simulate"], ["render", "--view", "placement"]):
        result = CliRunner().invoke(main, [*command, str(plan)])
        assert result.exit_code == 0, (command, result.output)


def test_a_microbatch_of_one_image_is_E506_and_generate_gives_two(plan_of, tmp_path):
    plan = plan_of(mesh="mesh    = [dp = 8]", extra="")
    plan.write_text(plan.read_text().replace("global_batch: 256, micro_batch: 8", "global_batch: 8, micro_batch: 1"))
    assert [d.code for d in api.check(plan).diagnostics] == ["E506"]
    plan.write_text(plan.read_text().replace(", micro_batch: 1", "").replace("  mesh    = [dp = 8]\n", ""))
    result = CliRunner().invoke(main, ["generate", "--from", str(plan), "--top", "5", "--json"])
    assert result.exit_code == 0, result.output
    candidates = json.loads(result.stdout)["candidates"]
    assert candidates and all(c["micro_batch_size"] >= 2 for c in candidates)


def test_generate_proposes_data_parallel_and_pipeline_plans_without_tensor_parallelism(plan_of, tmp_path):
    plan = plan_of(mesh="", extra="")
    out = tmp_path / "generated.plan"
    result = CliRunner().invoke(main, ["generate", "--from", str(plan), "--top", "5", "-o", str(out), "--json"])
    assert result.exit_code == 0, result.output
    candidates = json.loads(result.stdout)["candidates"]
    assert candidates and all(c["tp"] == 1 and c["cp"] == 1 for c in candidates)
    assert any(c["pp"] > 1 for c in candidates) or any(c["zero_stage"] == 3 for c in candidates)
    analysis = api.check(out)
    assert analysis.ok and analysis.document.plans[0].model.image == (3, 32, 32)


@pytest.mark.parametrize("mesh, extra, code", [
    ("mesh    = [dp = 4, tp = 2]", "", "E413"),  # an axis named tp: tensor parallelism, and a CNN has no plan
    ("mesh    = [dp = 4, mp = 2]", "tensor  = megatron over mp", "E413"),
    ("mesh    = [dp = 4, tp = 2]", "shard layer1.0.conv1 = colwise over tp", "E414"),  # torch's styles: no conv
    ("mesh    = [dp = 4, cp = 2]", "context = allgather over cp", "E415"),
    ("mesh    = [dp = 4, sp = 2]", "shard layer1.0 = sequence over sp", "E415"),
    ("mesh    = [dp = 8]", "", "E415"),  # train seq 64 below
])
def test_what_no_plan_over_a_cnn_may_ask_is_coded(plan_of, mesh, extra, code):
    plan = plan_of(mesh=mesh, extra=extra)
    if not extra and code == "E415":
        plan.write_text(plan.read_text().replace("micro_batch: 8", "micro_batch: 8, seq: 64"), encoding="utf-8")
    assert code in [d.code for d in api.check(plan).diagnostics]


WRITTEN = """\
import "clusters/dgx_a100"
model cnn {
  INPUT
  layer embed {
    params = 9536
    output = 4096
  }
  layer blocks[0:2] {
    params = 73984
    flops  = 9437184
    output = 4096
  }
}
plan p {
  model   = cnn
  cluster = dgx_a100 x 1
  mesh    = [dp = 8]
  train   = { global_batch: 64, micro_batch: 8 }
}
"""


def test_a_written_model_takes_images_too():
    analysis = api.loads(WRITTEN.replace("INPUT", "input = image(3, 32, 32)"))
    assert analysis.plans[0].model.image == (3, 32, 32) and analysis.plans[0].model.seq == 1


@pytest.mark.parametrize("text", ["input = 3", "input = image(3, 0, 32)", "input = image(3)", "input = imag(3, 8, 8)",
                                  "input = image(3, 32, 32)\n  seq = 4"])
def test_a_bad_input_in_a_plan_is_E205(text):
    with pytest.raises(api.PlanError) as raised:
        api.loads(WRITTEN.replace("INPUT", text))
    assert [d.code for d in raised.value.diagnostics] == ["E205"]


def test_a_bad_input_in_a_torch_model_call_is_E205(tmp_path):
    plan = tmp_path / "bad.plan"
    plan.write_text(PLAN.replace("MESH", "mesh    = [dp = 8]").replace("EXTRA", "").replace(
        "image(3, 32, 32)", "image(3, 32, 32.5)"), encoding="utf-8")
    assert [d.code for d in api.check(plan).diagnostics] == ["E205"]
