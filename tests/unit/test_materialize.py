"""A built-in family's model built on the meta device and materialized (`runtime.models.build_meta_model`,
`materialize`: what `plandsl run`'s ranks do, tests/distributed/test_meta_init.py over layouts) holds bit for bit the
values of the full model `build_model` gives from the same seed, in the plan's weights dtype, a tied head tied. A
Hugging Face model's values are its own `_init_weights`' (tests/distributed/test_torch_models.py over layouts)."""
from __future__ import annotations

import pytest

from tests.distributed.ranks import load
from tests.support import lazy

torch = lazy("torch")

_PLAN = """import "clusters/local"
import "local/tiny"
plan p {{
  model   = {model}
  cluster = localhost
  mesh    = [dp = 2] over devices[0:2]
  train   = {train}
  data    = ddp over dp
}}
"""
_BF16 = "{ global_batch: 8, micro_batch: 2, precision: bf16, master_dtype: bf16, lr: 1e-3, seed: 7 }"


@pytest.mark.parametrize("model,train", [
    ("gpt(layers=2, hidden=32, heads=4, seq=16, vocab=128, tied=true)", "tiny_train"),
    ("llama(layers=4, hidden=32, heads=4, kv_heads=2, seq=16, vocab=128, ffn=64, mtp=2, experts=4, top_k=2, "
     "shared_experts=1, dense_layers=1, dense_ffn=48)", _BF16),
    ("mlp(layers=3, input=8, hidden=16, output=4)", "tiny_train"),
], ids=["gpt_tied", "llama_moe_mtp_bf16", "mlp"])
def test_materialized_meta_model_equals_build_model(model, train):
    from plandsl.runtime.models import build_meta_model, build_model, is_meta, materialize
    from plandsl.runtime.precision import keep_weights
    plan = load(_PLAN.format(model=model, train=train))
    meta = keep_weights(plan, build_meta_model(plan.model))
    assert is_meta(meta) and all(p.is_meta for p in meta.parameters())
    materialize(meta, plan.model, plan.train.seed, "cpu")
    full = keep_weights(plan, build_model(plan.model, plan.train.seed))
    assert not is_meta(meta)
    built = dict(meta.named_parameters(remove_duplicate=False))
    expected = dict(full.named_parameters(remove_duplicate=False))
    assert list(built) == list(expected)
    for name, param in expected.items():
        assert built[name].dtype == param.dtype and torch.equal(built[name], param), name
    if getattr(plan.model, "tied_embeddings", False):
        assert meta.head.weight is meta.embed.tok.weight


def test_models_from_torch_and_factories_are_not_built_on_meta():
    from plandsl import ir
    from plandsl.runtime.models import build_meta_model
    assert build_meta_model(ir.CustomModel.model_construct(name="m", factory="pkg.mod:f")) is None


_HF_LLAMA = ('hf("LlamaForCausalLM", hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, '
             'num_key_value_heads=2, vocab_size=128, max_position_embeddings=16, tie_word_embeddings=true)')


def _hf_model(source: str = _HF_LLAMA):
    from plandsl.ir import CustomModel
    return CustomModel.model_construct(name="m", source=source, factory="", span=None)


def test_a_hugging_face_models_initial_values_are_its_own_init():
    """`build_model` builds a Hugging Face model with its parameters on the meta device and fills it as each rank
    does: linear and embedding weights normal with the config's initializer_range (0.02), norms one, a tied head the
    embedding itself, the rotary frequencies (a buffer) as the model computes them; the same seed gives the same
    values, another seed others."""
    from plandsl.runtime.models import build_meta_model, build_model, is_meta
    meta = build_meta_model(_hf_model())
    assert is_meta(meta) and not any(b.is_meta for b in meta.buffers())
    first, again, other = build_model(_hf_model(), 0), build_model(_hf_model(), 0), build_model(_hf_model(), 1)
    params = dict(first.named_parameters())
    assert not is_meta(first) and first.lm_head.weight is first.model.embed_tokens.weight
    q = params["model.layers.0.self_attn.q_proj.weight"]
    assert abs(q.std().item() - 0.02) < 0.003 and abs(q.mean().item()) < 0.003
    assert torch.equal(params["model.norm.weight"], torch.ones(64))
    assert all(torch.equal(p, dict(again.named_parameters())[n]) for n, p in params.items())
    assert not torch.equal(q, dict(other.named_parameters())["model.layers.0.self_attn.q_proj.weight"])
    assert torch.allclose(first.model.rotary_emb.inv_freq, 1.0 / 10000 ** (torch.arange(0, 16, 2).float() / 16))


def test_a_hugging_face_model_whose_init_leaves_a_parameter_unset_is_built_whole(monkeypatch):
    """A parameter no `_init_weights` writes (found on the meta build, where nothing is drawn) cannot take its values
    on a rank: the model is built whole on the CPU, its constructor's values kept, not refused nor left unset."""
    from transformers.models.llama.modeling_llama import LlamaPreTrainedModel

    from plandsl.runtime.models import build_meta_model, build_model
    own = LlamaPreTrainedModel._init_weights
    monkeypatch.setattr(LlamaPreTrainedModel, "_init_weights", lambda self, module: None
                        if isinstance(module, torch.nn.Embedding) else own(self, module))
    assert build_meta_model(_hf_model()) is None
    built = build_model(_hf_model(), 0)
    assert not any(p.is_meta or torch.isnan(p).any() for p in built.parameters())


def test_a_factory_model_is_built_whole():
    """A factory's module sets its own values in its own code, which cannot be replayed a module at a time."""
    from plandsl.ir import CustomModel
    from plandsl.runtime.models import build_meta_model
    factory = CustomModel.model_construct(name="m", source="inspect_models.tiny:build(depth=3)", factory="",
                                          span=None)
    assert build_meta_model(factory) is None


def test_a_large_parameters_values_are_drawn_tile_by_tile_and_any_block_is_its_cut(monkeypatch):
    """A parameter of LARGE elements or more takes its numbers tile by tile, each tile from a generator of its own
    (the seed, the name, the tile's place), so a block of it (a rank's shard) is the full values' cut while drawing
    only the tiles it covers; the small parameters before and after it keep the one generator's stream."""
    from plandsl.runtime import models
    shape = (3000, 1500)  # 4.5M elements: 3 x 2 tiles of 1024, the last ones partial
    generator = torch.Generator().manual_seed(5)
    full = models.ParameterValues(None, "layers.0.weight", shape, torch.float32, 5, generator)
    assert full.tiled and full.full is None
    whole = full.block((slice(0, 3000), slice(0, 1500)))
    assert abs(whole.std().item() - 1 / 1500 ** 0.5) < 1e-3 and abs(whole.mean().item()) < 1e-3
    drawn = []
    own = models.ParameterValues._tile_generator
    monkeypatch.setattr(models.ParameterValues, "_tile_generator", lambda self, index: drawn.append(index) or own(self, index))
    for block in [(slice(0, 1024), slice(0, 1500)), (slice(1000, 2100), slice(700, 1100)), (slice(2999, 3000), slice(0, 1))]:
        assert torch.equal(full.block(block), whole[block])
    assert drawn == [(0, 0), (0, 1), (0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1), (2, 0)]  # those each block covers
    again = models.ParameterValues(None, "layers.0.weight", shape, torch.float32, 5, torch.Generator().manual_seed(5))
    other = models.ParameterValues(None, "layers.1.weight", shape, torch.float32, 5, torch.Generator().manual_seed(5))
    block = (slice(0, 8), slice(0, 8))
    assert torch.equal(again.block(block), whole[block]) and not torch.equal(other.block(block), whole[block])
    # the one stream is untouched by the tiled parameter: a small one after it draws what it would without it
    small = models.ParameterValues(None, "layers.1.weight", (4, 4), torch.float32, 5, generator)
    assert torch.equal(small.full, torch.empty(4, 4).normal_(0, 0.5, generator=torch.Generator().manual_seed(5)))


def test_a_model_with_large_parameters_materializes_its_build_models_values():
    """`build_model` and `materialize` follow the same rule: a llama whose embedding and head are tiled."""
    from plandsl.runtime.models import LARGE, build_meta_model, build_model, materialize
    plan = load(_PLAN.format(model="llama(layers=1, hidden=256, heads=4, kv_heads=2, seq=16, vocab=4096, ffn=64)",
                             train="tiny_train"))
    meta = materialize(build_meta_model(plan.model), plan.model, plan.train.seed, "cpu")
    full = build_model(plan.model, plan.train.seed)
    assert full.embed.tok.weight.numel() >= LARGE
    for (name, built), (_, expected) in zip(meta.named_parameters(), full.named_parameters()):
        assert torch.equal(built, expected), name


_HF_MODELS = {  # small configs of models whose `_init_weights` takes each path `initial_values` has
    "llama": _HF_LLAMA,
    # a block's `_init_weights` scales its children's c_proj (a subtree at once)
    "gpt2": 'hf("GPT2LMHeadModel", n_embd=64, n_layer=3, n_head=4, n_positions=16, vocab_size=128)',
    "mixtral": ('hf("MixtralForCausalLM", hidden_size=64, intermediate_size=64, num_hidden_layers=2, '
                'num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, '
                'vocab_size=128, max_position_embeddings=16, tie_word_embeddings=false)'),
    # the mixer's `_init_weights` writes dt_proj's bias and conv1d's weight (children's)
    "mamba": 'hf("MambaForCausalLM", hidden_size=64, num_hidden_layers=2, vocab_size=128, state_size=8)',
    # the prediction head's bias tied to its decoder's after the draws (all_tied_weights_keys, the decoder first)
    "bert": ('hf("BertLMHeadModel", hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, '
             'vocab_size=128, max_position_embeddings=64, is_decoder=true)'),
}


@pytest.mark.parametrize("name", list(_HF_MODELS))
def test_a_hugging_face_models_values_are_transformers_initialize_weights(name):
    """Drawn module by module on the meta build (`torch_model.initial_values`), the values are bit for bit those
    transformers' own `initialize_weights` gives a model of the config from the same seed (its children-first order,
    a parent's `_init_weights` over its children's parameters included)."""
    import transformers

    from plandsl.ir.inspected import parse_source
    from plandsl.runtime.models import build_meta_model, build_model
    model = _hf_model(_HF_MODELS[name])
    assert build_meta_model(model) is not None  # built on the meta device, not whole
    source = parse_source(model.source)
    cls = getattr(transformers, source.target)
    reference = cls(cls.config_class(**dict(source.args)))
    for module in reference.modules():  # as a fresh model: nothing initialised yet
        module.__dict__.pop("_is_hf_initialized", None)
    for tensor in list(reference.parameters()) + list(reference.buffers()):
        tensor.__dict__.pop("_is_hf_initialized", None)
    head, embedding = reference.get_output_embeddings(), reference.get_input_embeddings()
    tied = head is not None and head.weight is embedding.weight
    if tied:  # drawn as a parameter of its own, then tied: as a fresh model's construction holds it
        head.weight = torch.nn.Parameter(torch.empty_like(embedding.weight))
    torch.manual_seed(0)
    reference.initialize_weights()
    if tied:
        head.weight = embedding.weight
    ours = dict(build_model(model, 0).named_parameters())
    expected = dict(reference.named_parameters())
    assert list(ours) == list(expected)
    for key, value in expected.items():
        assert torch.equal(ours[key], value), key


def test_a_model_whose_constructor_alone_sets_a_parameter_is_built_whole():
    """Apertus's xIELU activation sets `alpha_p` in its constructor only (no `_init_weights` writes it): its value
    cannot be drawn on a rank, so the model is built whole on the CPU, as every model was."""
    from plandsl.runtime.models import build_meta_model, build_model
    model = _hf_model('hf("ApertusForCausalLM", hidden_size=64, intermediate_size=96, num_hidden_layers=2, '
                      'num_attention_heads=4, num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)')
    assert build_meta_model(model) is None
    built = build_model(model, 0)
    assert not any(p.is_meta or torch.isnan(p).any() for p in built.parameters())


def test_parameters_go_to_the_meta_device_in_the_building_thread_only():
    import threading

    from plandsl.runtime.torch_model import meta_parameters
    inside, other = threading.Event(), {}

    def build_elsewhere():
        inside.wait(10)
        other["device"] = torch.nn.Linear(2, 2).weight.device.type

    thread = threading.Thread(target=build_elsewhere)
    thread.start()
    with meta_parameters():
        here = torch.nn.Linear(2, 2).weight.device.type
        inside.set()
        thread.join(10)
    assert here == "meta" and other["device"] == "cpu"
    assert torch.nn.Linear(2, 2).weight.device.type == "cpu"
