"""Mixture-of-experts blocks every k-th block (`moe_every`, `moe_offset`): which blocks are MoE (Hugging Face's Llama 4
`interleave_moe_layer_step` and Qwen2-MoE's `decoder_sparse_step` by default, Megatron-LM's `--moe-layer-freq` with
`moe_offset=0`), the catalogue's parameters against transformers' Llama4ForCausalLM, the checker's E228-E230, and the
search's split of blocks that alternate in kind."""
from __future__ import annotations

import pytest

from plandsl import api, ir
from plandsl.ir.layers import block_model, figures_key, layers_of, param_count
from tests.support import assert_brute_force_optimum, lazy
from test_deepseek import CHECKED, HARDWARE  # a llama plan on one DGX A100; two nodes of two small GPUs

torch = lazy("torch")


def _model(**arguments) -> ir.TransformerModel:
    text = ", ".join(f"{key}={value}" for key, value in arguments.items())
    return api.loads(f"model m = llama({text})\n").models[0]


SMALL = {"layers": 6, "hidden": 64, "heads": 4, "kv_heads": 2, "seq": 128, "vocab": 256, "experts": 4, "top_k": 1,
         "shared_experts": 1, "ffn": 32, "moe_every": 2, "dense_ffn": 96}


def _moe(model: ir.TransformerModel) -> list[bool]:
    return [any(".moe." in p.name for p in layer.params) for layer in layers_of(model) if layer.kind == "block"]


@pytest.mark.parametrize("arguments, moe", [
    ({"moe_every": 2}, [False, True] * 3),  # Hugging Face's: the last of every two (Llama 4 Maverick)
    ({"moe_every": 2, "moe_offset": 0}, [True, False] * 3),  # Megatron-LM's --moe-layer-freq 2
    ({"moe_every": 3}, [False, False, True] * 2),  # Qwen2-MoE's decoder_sparse_step 3
    ({"moe_every": 2, "moe_offset": 0, "dense_layers": 3}, [False, False, False, False, True, False]),
    ({"dense_layers": 2}, [False, False, True, True, True, True]),  # dense-then-MoE, as before
])
def test_which_blocks_are_mixtures_of_experts(arguments, moe):
    model = _model(**{**SMALL, "moe_every": 1, **arguments})
    assert _moe(model) == moe == [model.moe_block(i) for i in range(model.layers)]
    assert model.mixed_blocks


def test_the_offset_defaults_to_the_last_of_every_k_and_dumps_only_when_written():
    model = _model(**SMALL)
    assert (model.moe_every, model.moe_offset, model.dense_ffn) == (2, 1, 96)
    plain = _model(**{key: value for key, value in SMALL.items() if key not in ("moe_every", "dense_ffn")})
    assert "moe_every" not in plain.model_dump() and "moe_offset" not in plain.model_dump()
    assert model.model_dump()["moe_every"] == 2 and model.model_dump()["moe_offset"] == 1
    assert _model(**{**SMALL, "moe_every": 3}).moe_offset == 2


def test_two_kinds_of_block_alternate_each_computed_once():
    model = _model(**SMALL)
    blocks = [layer for layer in layers_of(model) if layer.kind == "block"]
    keys = [figures_key(b) for b in blocks]
    assert keys[0] == keys[2] == keys[4] != keys[1] == keys[3] == keys[5]
    assert block_model(model, 0) is block_model(model, 2) and not block_model(model, 0).experts
    assert block_model(model, 0).ffn_hidden == 96 and block_model(model, 1) is model
    assert {p.name: p.shape for p in blocks[2].params}["layers.2.mlp.w1.weight"] == (96, 64)


@pytest.mark.slow
@pytest.mark.parametrize("step", [1, 2, 3])
def test_parameters_match_transformers_llama4(step):
    """Llama 4's text model (the router, the grouped experts, one shared expert, `intermediate_size_mlp` dense blocks)
    block by block, on the meta device; Llama 4 adds no parameters for its QK norm, chunked attention or NoPE layers."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Llama4TextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=32, intermediate_size_mlp=96, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=1,
        interleave_moe_layer_step=step, max_position_embeddings=128, tie_word_embeddings=False)
    with torch.device("meta"):
        reference = transformers.Llama4ForCausalLM(config)
    theirs = {name: param.numel() for name, param in reference.named_parameters()}
    model = _model(**{**SMALL, "moe_every": step})
    assert param_count(model) == sum(theirs.values())
    ours = {p.name: p.numel for layer in layers_of(model) for p in layer.params}
    for index in range(model.layers):  # block by block: a dense block cannot pay for an MoE one
        assert sum(n for name, n in ours.items() if name.startswith(f"layers.{index}.")) == \
            sum(n for name, n in theirs.items() if name.startswith(f"model.layers.{index}."))
    assert [model.moe_block(i) for i in range(6)] == [i in config.moe_layers for i in range(6)]


@pytest.mark.slow
def test_llama4_maverick_is_transformers_llama4_with_128_experts_every_other_block():
    """transformers' Llama4TextConfig defaults are Llama 4 Scout's text model; with 128 experts every other block it
    is Maverick's (about 10 s on the meta device): models/llama4's two models count as many parameters."""
    transformers = pytest.importorskip("transformers")
    models = {m.name: m for m in api.load(_stdlib("models/llama4.plan")).models}
    for name, changes in (("llama4_scout", {}), ("llama4_maverick", {"num_local_experts": 128,
                                                                     "interleave_moe_layer_step": 2})):
        with torch.device("meta"):
            reference = transformers.Llama4ForCausalLM(transformers.Llama4TextConfig(**changes))
        assert sum(param.numel() for param in reference.parameters()) == param_count(models[name]), name


def _stdlib(relative: str) -> str:
    from plandsl.syntax.loader import stdlib_root
    return str(stdlib_root() / relative)




@pytest.mark.parametrize("args, codes, argument", [
    (", experts=8, moe_every=2, moe_offset=2", ["E230"], "moe_offset=2"),
    (", experts=8, moe_offset=1", ["E230"], "moe_offset=1"),  # the period is 1: only offset 0
    (", moe_every=2", ["E229"], "moe_every=2"),
    (", experts=8, dense_layers=7, moe_every=4, moe_offset=0", ["E228"], "moe_every=4"),  # the first MoE block: 8
    (", experts=8, moe_every=16", ["E228"], "moe_every=16"),
    (", experts=8, moe_every=2, dense_layers=2, dense_ffn=4096", [], None),
    (", experts=8, moe_every=1, dense_ffn=4096", ["E229"], "dense_ffn=4096"),
    (", experts=8, moe_every=1, moe_offset=0", [], None),  # Megatron-LM's --moe-layer-freq 1, written out
], ids=["E230", "E230_period_1", "E229", "E228_dense_first", "E228_period", "clean", "E229_ffn", "every_block"])
def test_checker_rules(args, codes, argument):
    text = CHECKED.format(args=args)
    analysis = api.checks(text)
    assert [d.code for d in analysis.errors] == codes, [str(d) for d in analysis.errors]
    for d in analysis.errors:
        assert text[d.span.start:d.span.end] == argument


def test_the_offsets_fix_is_hugging_faces_offset():
    text = CHECKED.format(args=", experts=8, moe_every=4, moe_offset=4")
    (d,) = api.checks(text).errors
    assert "moe_offset=3" in d.hint and [e.text for e in d.edits] == ["moe_offset=3"]


# ---- the search -------------------------------------------------------------------------------------------
INTERLEAVED = ("llama(layers=6, hidden=512, heads=8, seq=512, vocab=4096, experts=4, top_k=2, ffn=256, moe_every={every}, "
               "moe_offset={offset}, dense_ffn=32768)")


def _problem(every: int = 2, offset: int = 1):
    from plandsl.search import Problem
    document = api.loads(HARDWARE + f"model m = {INTERLEAVED.format(every=every, offset=offset)}\n")
    return Problem(document.models[0], document.clusters[0], 8, None)


def test_the_search_finds_the_brute_force_optimum_of_alternating_blocks():
    from plandsl.cost.compute import DEFAULT_EFFICIENCY
    from plandsl.search.space import Space
    problem, pins = _problem(), {"recompute": "none", "zero_stage": 1}
    space = Space(problem, pins, DEFAULT_EFFICIENCY)
    assert space.figures.interleaved and space.figures.dense_blocks == 3
    assert_brute_force_optimum(problem, pins)


@pytest.mark.parametrize("every, offset", [(2, 1), (2, 0), (3, 0)])
def test_stages_split_alternating_blocks_in_order_at_their_own_costs(every, offset):
    """The pipeline's blocks per stage minimise the slowest stage over every split of the blocks in order, each block
    at its own kind's seconds (the heavy dense blocks where the pattern puts them), and the leaf's stage times are the
    estimate's, block by block."""
    from plandsl.cost.compute import DEFAULT_EFFICIENCY
    from plandsl.search.space import Space
    space = Space(_problem(every, offset), {"pp": 2, "dp": 2, "tp": 1, "schedule": "1f1b", "virtual_stages": 1,
                                            "recompute": "none", "zero_stage": 1, "micro_batch_size": 1,
                                            "order": ("pp", "dp")}, DEFAULT_EFFICIENCY)
    (root,) = space.roots()
    (node,) = space.expand_root(root)
    (leaf,) = space.expand(node)
    seconds = [t.forward + t.backward for t in space.figures.kind_times(node, root.rank_devices[0])]
    model = space.figures.model
    blocks = [seconds[1] if model.moe_block(i) else seconds[4] for i in range(6)]

    def slowest(counts):
        return max(seconds[0] + sum(blocks[:counts[0]]), sum(blocks[counts[0]:]) + seconds[2] + seconds[3])

    assert slowest(leaf.counts) == pytest.approx(min(slowest((n, 6 - n)) for n in range(1, 6)))
    from plandsl.cost.estimate import estimate_stage_times
    from plandsl.ir.placement import Assignment
    assignment = Assignment(tuple(tuple(s) for s in space.figures.stage_layers(leaf.counts)), (0, 1), 1)
    exact = [stage.flops for stage in estimate_stage_times(space.evaluate(leaf).plan, assignment)]
    searched = [stage.flops for stage in space.bounds.stage_times(node, 1, (0, 1), leaf.counts)]
    assert searched == pytest.approx(exact, rel=1e-9)  # the search's stage FLOPs are the estimate's, kinds in order


# ---- Megatron-LM interop ------------------------------------------------------------------------------------
ROUND_TRIP = """import "clusters/dgx_h100"
plan p {{
  model    = llama(layers={layers}, hidden=512, heads=8, seq=1024, vocab=32000, experts=8, top_k=2, ffn=256, {kinds},
                   dense_ffn=2048)
  cluster  = dgx_h100
  mesh     = [dp = 2, ep = 4]
  train    = {{ global_batch: 16, micro_batch: 1 }}
  data     = zero1 over dp
  experts  = alltoall over ep
}}
"""


@pytest.mark.parametrize("layers, kinds, freq", [
    (8, "moe_every=2", "(([0]*1+[1]*1)*4)"),  # Llama 4 Maverick's
    (8, "moe_every=2, moe_offset=0", "2"),  # Megatron-LM's own integer
    (7, "moe_every=3", "(([0]*2+[1]*1)*2+[0]*1)"),  # the last period cut short
    (9, "dense_layers=3, moe_every=2, moe_offset=0", "([0]*4+([1]*1+[0]*1)*2+[1]*1)"),
    (8, "dense_layers=3, moe_every=4", "([0]*3+[1]*1+([0]*3+[1]*1)*1)"),  # dense_layers changes no block here
    (8, "dense_layers=2", "([0]*2+[1]*6)"),  # DeepSeek-V3's form, as before
])
def test_megatron_moe_layer_freq_round_trips(layers, kinds, freq):
    from plandsl.interop import export_plan, import_text
    plan = api.loads(ROUND_TRIP.format(layers=layers, kinds=kinds)).plans[0]
    exported = export_plan(plan, "megatron")
    assert not exported.lost
    assert exported.text.split("--moe-layer-freq ")[1].split()[0].strip("'") == freq
    imported = import_text("megatron", exported.text, "p.args", world_size=8, cluster="dgx_h100")
    assert imported.ok, [str(d) for d in imported.diagnostics]
    back = api.select_plan(api.loads(imported.text, path="back.plan")).model
    assert [back.moe_block(i) for i in range(layers)] == [plan.model.moe_block(i) for i in range(layers)]
    assert (back.dense_ffn, back.ffn_hidden) == (2048, 256)


@pytest.mark.parametrize("freq, kinds", [
    ("2", (0, 2, 0)), ("4", (0, 4, 0)), ("([0]*3+[1]*1)*2", (0, 4, 3)), ("([0]+[1])*4", (0, 2, 1)),
    ("[0]*5+[1]*3", (5, 1, 0)), ("[0]*7+[1]", (7, 1, 0)), ("[0]*2+[1]+[0]*5", (0, 6, 2)),
])
def test_megatron_patterns_import_as_the_fewest_arguments(freq, kinds):
    """Megatron-LM's integer (MoE where i % N == 0) and its lists (`([0]*3+[1]*1)*12`, Llama 4's every other layer
    from the second) as dense_layers, moe_every and moe_offset, each written only where it is not its default."""
    from plandsl.interop import import_text
    text = ("--num-layers 8 --hidden-size 512 --ffn-hidden-size 2048 --moe-ffn-hidden-size 256 --num-attention-heads 8 "
            "--seq-length 1024 --max-position-embeddings 1024 --padded-vocab-size 32000 --normalization RMSNorm "
            "--swiglu --position-embedding-type rope --disable-bias-linear --num-experts 8 --moe-router-topk 2 "
            f"--expert-model-parallel-size 4 --micro-batch-size 1 --global-batch-size 16 --moe-layer-freq '{freq}'")
    imported = import_text("megatron", text, "p.args", world_size=8, cluster="dgx_h100")
    assert imported.ok, [str(d) for d in imported.diagnostics]
    model = api.select_plan(api.loads(imported.text, path="back.plan")).model
    assert (model.dense_layers, model.moe_every, model.moe_offset) == kinds
    dense, every, offset = kinds
    written = [key for key, default in (("dense_layers", 0), ("moe_every", 1), ("moe_offset", every - 1))
               if dict(dense_layers=dense, moe_every=every, moe_offset=offset)[key] != default]
    assert [key for key in ("dense_layers", "moe_every", "moe_offset") if f"{key}=" in imported.text] == written


@pytest.mark.parametrize("kinds, pp", [("moe_every=2", 16), ("moe_every=2, moe_offset=0", 4), ("moe_every=4", 1)])
def test_shrink_keeps_mixtures_of_experts_between_dense_blocks(tmp_path, kinds, pp):
    """`plandsl shrink` of a model shaped as Llama 4 Maverick keeps dense blocks between MoE ones, with one MoE block
    at least."""
    path = tmp_path / "m.plan"
    path.write_text(f"""import "clusters/dgx_h100"
model m = llama(layers=48, hidden=1024, heads=8, seq=2048, vocab=32000, experts=16, top_k=1, shared_experts=1,
                ffn=512, {kinds}, dense_ffn=4096)
plan p {{
  model   = m
  cluster = dgx_h100 x 32
  mesh    = [dp = {64 // pp}, pp = {pp}, ep = 4]
  train   = {{ global_batch: 1024, micro_batch: 1, recompute: full }}
  data    = zero1 over dp
  experts = alltoall over ep
  {"stages  = evenly over pp" if pp > 1 else ""}
}}
""")
    small = api.shrink(path).plan.model
    kinds = [small.moe_block(i) for i in range(small.layers)]
    assert any(kinds) and not all(kinds) and small.moe_every > 1 and small.dense_ffn


def test_generate_writes_the_model_as_given_and_splits_its_blocks_by_kind():
    """`plandsl generate` for a model with MoE blocks between dense ones writes the model argument as given, and the
    plan it writes (its stages split at each kind's costs) passes `check`."""
    model = ("llama(layers=8, hidden=1024, heads=8, seq=2048, vocab=32000, experts=8, top_k=1, shared_experts=1, "
             "ffn=512, moe_every=2, moe_offset=0, dense_ffn=8192)")
    request = api.generate_request(model=model, cluster="dgx_h100 x 1", global_batch=64, top=1,
                                   pins=("pp=4", "ep=2", "virtual_stages=1", "recompute=none"))
    generated = api.generate(request)
    (text,) = generated.texts
    assert "moe_every=2," in text and "moe_offset=0," in text and "dense_ffn=8192," in text
    assert api.checks(text, path="generated.plan").ok
    plan = api.select_plan(api.loads(text, path="generated.plan"))
    assert plan.model.model_dump(exclude={"name"}) == api.loads(f"model m = {model}\n").models[0].model_dump(
        exclude={"name"})


def test_a_top_1_router_weights_by_the_probability_over_all_experts_and_learns():
    """Llama 4's top-1 routing as `plandsl run` runs it: the chosen expert's output weighted by its softmax
    probability over every expert (the Switch Transformer's router, Megatron-Core's --moe-router-pre-softmax, which
    the export writes), so that the router's weight has a gradient; a softmax over the one chosen logit would be 1
    and leave the router untrained. Top-2 and more keep the softmax over the chosen logits (Mixtral's)."""
    from plandsl.runtime.models import MoE
    torch.manual_seed(0)
    x = torch.randn(3, 4, 16)
    for top_k in (1, 2):
        moe = MoE(16, 32, experts=4, top_k=top_k, gated=True)
        with torch.no_grad():
            for param in moe.parameters():
                param.copy_(torch.randn_like(param) * 0.1)
        scores = moe.router(x.reshape(-1, 16))
        chosen = scores.topk(top_k, dim=-1).indices
        gate = scores.softmax(-1).gather(-1, chosen) if top_k == 1 else scores.gather(-1, chosen).softmax(-1)
        expected = torch.zeros(12, 16)
        for token in range(12):
            for slot in range(top_k):
                expert = int(chosen[token, slot])
                one = moe.experts(x.reshape(-1, 16)[token:token + 1], [1 if e == expert else 0 for e in range(4)])
                expected[token] += gate[token, slot] * one[0]
        out = moe(x)
        assert torch.allclose(out.reshape(-1, 16), expected, atol=1e-6)
        out.square().sum().backward()
        assert moe.router.weight.grad.abs().sum() > 0
