"""Layer catalogue: parameter counts against published figures, names, FLOPs."""
import pytest

from plandsl import api, ir
from plandsl.ir.layers import DIM_ROLES, layers_of, modules_of, param_count


def gpt(layers, hidden, heads, seq, vocab, tied=False):
    return ir.TransformerModel(kind="gpt", name="g", layers=layers, hidden=hidden, heads=heads,
                               kv_heads=heads, ffn_hidden=4 * hidden, seq=seq, vocab=vocab,
                               tied_embeddings=tied)


def llama(layers, hidden, heads, kv_heads, ffn, vocab, experts=0, top_k=0, seq=4096):
    return ir.TransformerModel(kind="llama", name="l", layers=layers, hidden=hidden, heads=heads,
                               kv_heads=kv_heads, ffn_hidden=ffn, seq=seq, vocab=vocab,
                               experts=experts, top_k=top_k)


GPT3 = gpt(96, 12288, 96, 2048, 51200)
GPT2_SMALL = gpt(12, 768, 12, 1024, 50257, tied=True)
LLAMA2_7B = llama(32, 4096, 32, 32, 11008, 32000)
LLAMA3_8B = llama(32, 4096, 32, 8, 14336, 128256)
LLAMA2_70B = llama(80, 8192, 64, 8, 28672, 32000)
MIXTRAL = llama(32, 4096, 32, 8, 14336, 32000, experts=8, top_k=2)


@pytest.mark.parametrize("model, published, tolerance", [
    (GPT3, 174.6e9, 0.01),        # Brown et al. 2020
    (GPT2_SMALL, 124.4e6, 0.01),  # Radford et al. 2019 / HF gpt2: 124,439,808
    (LLAMA2_7B, 6.74e9, 0.01),    # Touvron et al. 2023
    (LLAMA3_8B, 8.03e9, 0.01),    # Meta Llama 3 model card
    (LLAMA2_70B, 69e9, 0.015),
    (MIXTRAL, 46.7e9, 0.015),     # Jiang et al. 2024
])
def test_param_count_matches_published(model, published, tolerance):
    assert param_count(model) == pytest.approx(published, rel=tolerance)


def test_gpt2_small_exact():
    assert param_count(GPT2_SMALL) == 124_439_808


def test_gpt_names_and_shapes():
    model = gpt(2, 64, 4, 16, 100)
    layers = layers_of(model)
    assert [layer.name for layer in layers] == ["embed", "layers.0", "layers.1", "norm", "head"]
    assert [layer.kind for layer in layers] == ["embed", "block", "block", "norm", "head"]
    shapes = {p.name: p.shape for layer in layers for p in layer.params}
    assert shapes["embed.tok.weight"] == (100, 64)
    assert shapes["embed.pos.weight"] == (16, 64)
    assert shapes["layers.1.attn.wq.weight"] == (64, 64)
    assert shapes["layers.1.attn.wq.bias"] == (64,)
    assert shapes["layers.1.mlp.w1.weight"] == (256, 64)
    assert shapes["layers.1.mlp.w2.weight"] == (64, 256)
    assert shapes["layers.1.norm1.bias"] == (64,)
    assert shapes["norm.weight"] == (64,) and "norm.bias" in shapes
    assert shapes["head.weight"] == (100, 64)
    assert "layers.0.mlp.w3.weight" not in shapes
    for layer in layers:
        assert layer.param_count == sum(p.numel for p in layer.params)
        for p in layer.params:
            assert p.name.startswith(p.module + ".") and len(p.dims) == len(p.shape)
            assert set(p.dims) <= set(DIM_ROLES)


def test_llama_gqa_swiglu_no_biases():
    names = {p.name: p for layer in layers_of(LLAMA3_8B) for p in layer.params}
    assert names["layers.0.attn.wk.weight"].shape == (8 * 128, 4096)
    assert names["layers.0.attn.wk.weight"].dims == ("kv", "hidden")
    assert names["layers.0.attn.wo.weight"].dims == ("hidden", "heads_x_head_dim")
    assert names["layers.0.mlp.w3.weight"].shape == (14336, 4096)
    assert names["layers.0.mlp.w2.weight"].shape == (4096, 14336)
    assert not any(name.endswith(".bias") for name in names)
    assert "embed.pos.weight" not in names and "layers.0.norm1.weight" in names


def test_moe_layout():
    names = {p.name: p for layer in layers_of(MIXTRAL) for p in layer.params}
    assert names["layers.0.moe.router.weight"].shape == (8, 4096)
    assert names["layers.0.moe.experts.w1"].shape == (8, 14336, 4096)
    assert names["layers.0.moe.experts.w2"].dims == ("experts", "hidden", "ffn")
    assert names["layers.0.moe.experts.w3"].shape == (8, 14336, 4096)
    assert not any(".mlp." in name for name in names)
    assert "layers.31.moe.experts" in modules_of(MIXTRAL)


def test_tied_head_has_no_params():
    layers = {layer.name: layer for layer in layers_of(GPT2_SMALL)}
    assert layers["head"].params == () and layers["head"].param_count == 0
    assert "head" not in modules_of(GPT2_SMALL)
    assert "head" in modules_of(GPT3)


def test_gpt_flops_per_layer_exact():
    h, s = 12288, 2048
    block = layers_of(GPT3)[1]
    assert block.flops_per_token == 24 * h * h + 4 * s * h  # Narayanan et al. 2021
    assert layers_of(GPT3)[-1].flops_per_token == 2 * h * 51200
    assert layers_of(GPT3)[0].flops_per_token == 0


def test_llama_and_moe_flops_from_shapes():
    h, kv, f, s = 4096, 1024, 14336, 4096
    attention = 2 * (2 * h * h + 2 * h * kv) + 4 * s * h
    assert layers_of(LLAMA3_8B)[1].flops_per_token == attention + 6 * h * f
    assert layers_of(MIXTRAL)[1].flops_per_token == attention + 2 * h * 8 + 2 * 6 * h * f


def test_mlp_family():
    model = ir.MLPModel(kind="mlp", name="m", layers=3, hidden=32, input=10, output=4)
    layers = layers_of(model)
    assert [layer.name for layer in layers] == ["layers.0", "layers.1", "layers.2"]
    assert [layer.params[0].shape for layer in layers] == [(32, 10), (32, 32), (4, 32)]
    assert layers[0].params[0].dims == ("hidden", "input")
    assert layers[2].params[1].shape == (4,)
    assert [layer.output_width for layer in layers] == [32, 32, 4]
    assert layers[1].flops_per_token == 2 * 32 * 32
    assert modules_of(model) == ("layers.0", "layers.1", "layers.2")
    assert param_count(model) == 32 * 11 + 32 * 33 + 4 * 33


def test_custom_model():
    model = ir.CustomModel(kind="custom", name="c", factory_args={"width": 3}, layers=(
        ir.CustomLayer(name="stem", params=100, flops=5.0, activations=8, output=16),
        ir.CustomLayer(name="act", params=0, flops=1.0, activations=4, output=16),
    ))
    stem, act = layers_of(model)
    assert stem.params[0].name == "stem.weight" and stem.params[0].shape == (100,)
    assert act.params == () and act.kind == "custom"
    assert (stem.flops_per_token, stem.output_width) == (5.0, 16)
    assert modules_of(model) == ("stem",)
    assert param_count(model) == 100


def test_layers_are_cached():
    assert layers_of(LLAMA2_7B) is layers_of(llama(32, 4096, 32, 32, 11008, 32000))


def test_renamed_blocks_read_as_the_tuples_they_stand_for():
    import pickle
    from plandsl.ir.layers import BlockParams, Param, _block_params
    model = api.loads("model m = llama(layers=3, hidden=256, heads=4, kv_heads=2, seq=128, vocab=512)\n").models[0]
    blocks = [layer for layer in layers_of(model) if layer.kind == "block"]
    for index, block in enumerate(blocks):
        built = tuple(_block_params(model, index))  # each block's params built in full, as before
        assert isinstance(block.params, BlockParams)
        assert tuple(block.params) == built and block.params == built and len(block.params) == len(built)
        assert block.params[0] == built[0] and block.params[-1] == built[-1] and block.params[1:3] == built[1:3]
        assert all(isinstance(p, Param) for p in block.params)
        assert pickle.loads(pickle.dumps(block)) == block
    assert blocks[0].params != blocks[1].params and blocks[0] != blocks[1]
    assert hash(blocks[1].params) == hash(tuple(_block_params(model, 1))) == hash(BlockParams("layers.1.", blocks[1].params.template))
