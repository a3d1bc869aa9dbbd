"""Placement and sharding of a model from torch by its own names (issue 18): pipeline stages by FQN ranges,
shard rules by FQN patterns with torch's styles, a Hugging Face model's own tensor-parallel plan taken by
`tensor = megatron over tp` and checked against the real module tree, tied parameters refused across
stages, and the cost model counting that tensor parallelism. Real transformers models from small configs
(Llama with GQA, GPT-2 with its tied head, Qwen3), their tables built once for the module."""
from __future__ import annotations

import importlib.util

import pytest

from plandsl import api
from plandsl.ir import Recompute
from plandsl.ir import layers as ir_layers
from plandsl.ir import torch_plan
from plandsl.ir.inspected import ModelSource
from plandsl.lower.inspected import cache_path

pytestmark = [pytest.mark.xdist_group("torch"),  # one worker imports torch and transformers
              # as importorskip, without importing transformers when collecting (~1 CPU-s in each worker)
              pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")]

SEQ = 64
LLAMA = ModelSource("hf", "LlamaForCausalLM", (
    ("hidden_size", 256), ("intermediate_size", 688), ("num_hidden_layers", 4), ("num_attention_heads", 8),
    ("num_key_value_heads", 2), ("vocab_size", 1000), ("max_position_embeddings", SEQ), ("tie_word_embeddings", False)))
GPT2 = ModelSource("hf", "GPT2LMHeadModel", (("n_embd", 64), ("n_layer", 4), ("n_head", 4), ("n_positions", SEQ),
                                             ("vocab_size", 500)))
QWEN3 = ModelSource("hf", "Qwen3ForCausalLM", (
    ("hidden_size", 128), ("intermediate_size", 384), ("num_hidden_layers", 2), ("num_attention_heads", 4),
    ("num_key_value_heads", 2), ("head_dim", 32), ("vocab_size", 512), ("max_position_embeddings", SEQ)))

MIXTRAL = ModelSource("hf", "MixtralForCausalLM", (
    ("hidden_size", 64), ("intermediate_size", 128), ("num_hidden_layers", 2), ("num_attention_heads", 4),
    ("num_key_value_heads", 2), ("num_local_experts", 4), ("num_experts_per_tok", 2), ("vocab_size", 300),
    ("max_position_embeddings", SEQ)))


def _call(source: ModelSource) -> str:
    return source.text.replace("False", "false").replace("True", "true")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A folder whose `.plandsl/` holds the four tables, as `plandsl inspect FILE.plan` writes them."""
    where = tmp_path_factory.mktemp("torch_names")
    (where / ".plandsl").mkdir()
    for source in (LLAMA, GPT2, QWEN3, MIXTRAL):
        table = api.inspect_model(source.text, seq=SEQ)
        api.write_inspected(table, cache_path(str(where / "p.plan"), source, SEQ))
    return where


def _check(folder, body: str, model: ModelSource = LLAMA, mesh: str = "[dp = 2, pp = 2, tp = 2]"):
    text = (f'import "clusters/dgx_a100"\nplan p {{\n  model   = {_call(model)}\n  cluster = dgx_a100 x 1\n'
            f'  mesh    = {mesh}\n  train   = {{ global_batch: 16, micro_batch: 1, seq: {SEQ} }}\n{body}}}\n')
    path = folder / "p.plan"
    path.write_text(text, encoding="utf-8")
    return api.check(path)


def _codes(analysis) -> list[str]:
    return [d.code for d in analysis.diagnostics]


def test_the_table_records_a_hugging_face_models_tensor_parallel_plan(folder):
    model = _check(folder, "").document.plans[0].model
    plan = dict(model.tp_plan)
    assert plan["model.layers.*.self_attn.q_proj"] == "colwise" and plan["model.layers.*.mlp.down_proj"] == "rowwise"
    assert plan["lm_head"] == "colwise_gather_output" and plan["model.embed_tokens"] == "embedding_rowwise"
    assert model.block_list == "model.layers" and ("model.layers.0.self_attn.k_proj", "Linear") in model.modules
    # the catalogue's layers hold the real parameters, by FQN, the same count as the table's
    layers = ir_layers.layers_of(model)
    assert [p.name for p in layers[0].params] == ["model.embed_tokens.weight"]
    assert layers[-1].params[-1].name == "lm_head.weight"
    for layer, authored in zip(layers, model.layers, strict=True):
        assert sum(p.numel for p in layer.params) == authored.params
    k_proj = next(p for p in layers[1].params if p.name == "model.layers.0.self_attn.k_proj.weight")
    o_proj = next(p for p in layers[1].params if p.name == "model.layers.0.self_attn.o_proj.weight")
    assert k_proj.shape == (64, 256) and k_proj.dims == (ir_layers.TP_SPLIT, ir_layers.OTHER)
    assert o_proj.dims == (ir_layers.OTHER, ir_layers.TP_SPLIT)


def test_stages_by_fqn_ranges(folder):
    stages = "  stages {\n    0: embed, model.layers[0:3]\n    1: model.layers[3:], head\n  }\n"
    analysis = _check(folder, stages)
    assert analysis.ok, [d.message for d in analysis.diagnostics]
    from plandsl.ir.placement import assign_stages
    assignment, _ = assign_stages(analysis.document.plans[0])
    assert [[layer.name for layer in stage] for stage in assignment.stage_layers] == [
        ["embed", "model.layers.0", "model.layers.1", "model.layers.2"], ["model.layers.3", "head"]]
    assert _check(folder, "  stages = evenly over pp\n").ok
    assert _codes(_check(folder, stages.replace("model.layers[3:]", "model.layer[3:]"))) == ["E405"]
    overlapping = _check(folder, stages.replace("model.layers[3:]", "model.layers[2:]"))
    assert _codes(overlapping) == ["E401"]
    backwards = _check(folder, "  stages {\n    0: embed, model.layers[2:4]\n    1: model.layers[0:2], head\n  }\n")
    assert _codes(backwards) == ["E410"]


def test_stages_name_the_embedding_and_the_head_by_their_modules(folder):
    by_modules = _check(folder, "  stages {\n    0: model.embed_tokens, model.layers[0:2]\n"
                                "    1: model.layers[2:], model.norm, lm_head\n  }\n")
    assert by_modules.ok, [d.message for d in by_modules.diagnostics]
    from plandsl.ir.placement import assign_stages
    assignment, _ = assign_stages(by_modules.document.plans[0])
    assert [stage[0].name for stage in assignment.stage_layers] == ["embed", "model.layers.2"]
    assert assignment.stage_layers[-1][-1].name == "head"
    part = _check(folder, "  stages {\n    0: embed, model.layers[0:2], model.layers.2.mlp\n"
                          "    1: model.layers.3, head, lm_hed\n  }\n")
    assert _codes(part) == ["E405", "E405"]
    assert "names a part of block 'model.layers.2'" in part.diagnostics[0].message
    assert part.diagnostics[0].hint == "name the block: model.layers.2"
    assert "head holds model.norm, lm_head" in part.diagnostics[1].hint


def test_tied_parameters_across_stages_are_refused(folder):
    analysis = _check(folder, "", model=GPT2, mesh="[dp = 4, pp = 2]")
    assert _codes(analysis) == ["E412"]
    diagnostic = analysis.diagnostics[0]
    assert "'lm_head.weight' is the same tensor as 'transformer.wte.weight'" in diagnostic.message
    assert "tie_word_embeddings=false" in diagnostic.hint
    assert _check(folder, "", model=GPT2, mesh="[dp = 8]").ok  # one stage: the tie stays inside it


def test_megatron_takes_the_models_own_plan_and_checks_it(folder):
    assert _check(folder, "  stages = evenly over pp\n").ok  # kv heads 2, tp 2
    four = _check(folder, "", mesh="[dp = 2, tp = 4]")
    assert _codes(four) == ["E406"]
    assert "num_key_value_heads (2) is not divisible by axis 'tp' (4)" in four.diagnostics[0].message
    assert _check(folder, "", model=QWEN3, mesh="[dp = 4, tp = 2]").ok  # q_norm, k_norm: replicated
    three = _check(folder, "", model=QWEN3, mesh="[dp = 2, tp = 3]", ).diagnostics  # 6 devices of 8: W301
    assert {d.code for d in three if d.is_error} == {"E406"}
    assert any("dim 0 of 'model.layers.0.self_attn.q_proj.weight' (128)" in d.message for d in three)


def test_shard_rules_name_modules_by_fqn_patterns(folder):
    rules = ("  tensor  = none\n  shard model.layers.*.mlp.gate_proj = colwise over dp\n"
             "  shard model.layers.*.mlp.down_proj = rowwise over dp\n")
    assert _check(folder, rules, mesh="[dp = 8]").ok
    typo = _check(folder, "  shard model.layers.*.mlp.gate_prj = colwise over tp\n", mesh="[dp = 4, tp = 2]")
    assert _codes(typo) == ["E405"] and "model.layers.*.mlp.gate_proj" in typo.diagnostics[0].hint
    odd = _check(folder, "  tensor  = none\n  shard model.layers.*.mlp.gate_proj = colwise over tp\n",
                 mesh="[dp = 2, tp = 3]")  # 6 of the 8 devices: W301 besides
    errors = [d for d in odd.diagnostics if d.is_error]
    assert [d.code for d in errors] == ["E406"]
    assert "dim 0 of 'model.layers.0.mlp.gate_proj.weight' (688)" in errors[0].message


def test_tensor_parallel_needs_a_plan_or_rules(folder):
    analysis = _check(folder, "", model=GPT2, mesh="[dp = 4, tp = 2]")
    assert _codes(analysis) == ["E413"]
    conv = _check(folder, "  shard transformer.h.*.mlp.c_fc = colwise over tp\n", model=GPT2, mesh="[dp = 4, tp = 2]")
    assert _codes(conv) == ["E414"] and "Conv1D" in conv.diagnostics[0].message


def test_the_cost_model_counts_the_models_tensor_parallelism(folder):
    plain = _check(folder, "", mesh="[dp = 8]").document.plans[0]
    split = _check(folder, "", mesh="[dp = 4, tp = 2]").document.plans[0]
    one, two = api.estimate(plain), api.estimate(split)
    # parameters: every colwise/rowwise weight halves (the norms stay whole); the stored ones (DTensor parameters are
    # replicated by `replicate`, whose copy `gathered_params` holds: `cost.memory.replicate_copy_bytes`)
    stored = [m.memory[0].params - m.memory[0].gathered_params for m in (one, two)]
    assert two.memory[0].gathered_params > 0 == one.memory[0].gathered_params and stored[1] < 0.6 * stored[0]
    # every matmul of a Llama block is split (q, k, v, o, gate, up, down and the attention core): half each
    from plandsl.cost.compute import _tensor_parallel_flops
    block = ir_layers.layers_of(split.model)[1]
    assert block.attention_flops_per_token == pytest.approx(4 * 256 * SEQ, rel=1e-3)
    assert _tensor_parallel_flops(block, 2) == pytest.approx(block.flops_per_token / 2, rel=1e-6)
    # work per device falls, and the all-reduces of the rowwise outputs are paid
    assert two.stage_times[0].flops < one.stage_times[0].flops
    assert two.stage_times[0].comm > 0 and one.stage_times[0].comm == 0
    # full recomputation: each block keeps its input (256 bf16 values per token), not what the table measured
    text = _check(folder, "", mesh="[dp = 8]").document.plans[0]
    full = text.model_copy(update={"train": text.train.model_copy(update={"recompute": Recompute.full})})
    # (beside autocast's bf16 copies of its fp32 weights, the same with or without recomputation)
    from plandsl.cost.memory import autocast_weight_copies
    copies = autocast_weight_copies(text, ir_layers.layers_of(text.model))
    assert copies > 0 and api.estimate(full).memory[0].activations - copies < 0.5 * (one.memory[0].activations - copies)


def _generate(folder, model: str, *pins: str, output: str = "g.plan"):
    request = api.generate_request(model=model, cluster="dgx_a100", global_batch=64, top=5, pins=pins,
                                   output=str(folder / output))
    return api.generate(request)


def test_generate_takes_a_hugging_face_model_and_writes_a_plan_that_checks(folder):
    generated = _generate(folder, LLAMA.text, "tp=2")  # Python's spelling, as plandsl inspect takes it
    best = generated.texts[0]
    assert 'model   = hf(\n    "LlamaForCausalLM",' in best and "tie_word_embeddings=false," in best
    assert "tensor  = megatron over tp\n" in best  # the model's own plan; no sequence parallelism
    (folder / "g.plan").write_text(best, encoding="utf-8")
    assert api.check(folder / "g.plan").ok
    # GPT-2's tied head: never a pipeline (E412), never tensor parallel (no plan, E413)
    tied = _generate(folder, GPT2.text)
    assert tied.result.candidates and all(s.candidate.pp == 1 and s.candidate.tp == 1 for s in tied.result.candidates)


@pytest.mark.parametrize("source", [QWEN3, MIXTRAL], ids=["qwen3", "mixtral"])
def test_generate_proposes_plans_that_check_for_each_model(folder, source):
    """Every Hugging Face model of these tests through generate: its best plan, written out, checks."""
    generated = _generate(folder, source.text, output=f"{source.target}.plan")
    assert generated.result.candidates and f'"{source.target}",' in generated.texts[0]
    (folder / f"{source.target}.plan").write_text(generated.texts[0], encoding="utf-8")
    analysis = api.check(folder / f"{source.target}.plan")
    assert analysis.ok, [d.message for d in analysis.diagnostics]


def test_generate_says_how_to_write_a_missing_table(folder, tmp_path):
    with pytest.raises(api.PlanError) as raised:
        _generate(tmp_path, GPT2.text.replace("n_layer=4", "n_layer=3"))
    message = str(raised.value)
    assert [d.code for d in raised.value.diagnostics] == ["E215"]  # the language's code (an uncoded `error:` before)
    assert "is missing (E215; run: mkdir -p" in message and "plandsl inspect 'hf(\"GPT2LMHeadModel\"" in message
    assert f"-o {tmp_path}/.plandsl/inspect-" in message
    with pytest.raises(api.PlanError, match="cannot be written in a plan"):
        _generate(folder, 'hf("GPT2LMHeadModel", n_embd=None)')


def test_generate_takes_a_factory_and_the_cli_says_how_to_inspect(folder, tmp_path):
    from pathlib import Path

    from plandsl.lower.inspected import DEFAULT_SEQ
    from support import cli_in_process
    here = str(Path(__file__).resolve().parent)
    source = ModelSource("factory", "inspect_models.tiny:build", (("depth", 2),))
    table = api.inspect_model(source.text, seq=DEFAULT_SEQ, search_path=(here,))
    api.write_inspected(table, cache_path(str(folder / "f.plan"), source, DEFAULT_SEQ))
    generated = _generate(folder, source.text, output="f.plan")
    assert 'model   = factory("inspect_models.tiny:build", depth=2)' in generated.texts[0]
    assert all(s.candidate.pp == 1 for s in generated.result.candidates)  # tiny ties its head to its embedding
    (folder / "f.plan").write_text(generated.texts[0], encoding="utf-8")
    assert api.check(folder / "f.plan").ok
    missing = cli_in_process("generate", "--model", source.text, "--cluster", "dgx_a100", "--global-batch", "8",
                             cwd=tmp_path)
    assert missing.returncode == 1 and "(E215; run: mkdir -p " in missing.stderr
    assert "plandsl inspect 'inspect_models.tiny:build(depth=2)' --seq 2048 -o " in missing.stderr


def test_the_expert_axis_splits_a_hugging_face_moes_grouped_experts(folder):
    dense = _check(folder, "", model=MIXTRAL, mesh="[dp = 8]").document.plans[0]
    split = _check(folder, "  experts = alltoall over ep\n", model=MIXTRAL, mesh="[dp = 2, ep = 4]")
    assert split.ok, [d.message for d in split.diagnostics]
    experts = [p for layer in ir_layers.layers_of(dense.model) for p in layer.params if p.dims[0] == ir_layers.EXPERTS]
    assert [p.name for p in experts][:2] == ["model.layers.0.mlp.experts.gate_up_proj",
                                             "model.layers.0.mlp.experts.down_proj"]
    # each rank stores 1 of the 4 experts of every grouped tensor (fp32 parameters: 4 bytes; `replicate`'s copy of the
    # expert-parallel model's apart, `cost.memory.replicate_copy_bytes`)
    held = [m.params - m.gathered_params for m in (api.estimate(plan).memory[0] for plan in (dense, split.document.plans[0]))]
    held = held[0] - held[1]
    assert held == 4 * sum(p.numel for p in experts) * 3 / 4


# Class plans naming modules these models do not have (transformers 5: "rules ... match nothing ... and will not be
# applied"): Qwen2-MoE's and Qwen3-Next's a dense MLP's `mlp.gate_proj`, `up_proj`, `down_proj` where their layers
# hold experts; Llama 4's both `layers.*` and `model.layers.*`, and its experts' entries in a dense model
QWEN2_MOE = ModelSource("hf", "Qwen2MoeForCausalLM", (
    ("hidden_size", 64), ("intermediate_size", 128), ("moe_intermediate_size", 32),
    ("shared_expert_intermediate_size", 64), ("num_hidden_layers", 2), ("num_attention_heads", 4),
    ("num_key_value_heads", 2), ("num_experts", 4), ("num_experts_per_tok", 2), ("vocab_size", 300),
    ("max_position_embeddings", SEQ)))
QWEN3_NEXT = ModelSource("hf", "Qwen3NextForCausalLM", (
    ("hidden_size", 64), ("intermediate_size", 128), ("moe_intermediate_size", 32),
    ("shared_expert_intermediate_size", 64), ("num_hidden_layers", 4), ("num_attention_heads", 4),
    ("num_key_value_heads", 2), ("head_dim", 16), ("num_experts", 4), ("num_experts_per_tok", 2),
    ("linear_num_value_heads", 4), ("linear_num_key_heads", 2), ("linear_key_head_dim", 16),
    ("linear_value_head_dim", 16), ("vocab_size", 300), ("max_position_embeddings", SEQ)))
LLAMA4 = ModelSource("hf", "Llama4ForCausalLM", (
    ("hidden_size", 64), ("intermediate_size", 128), ("intermediate_size_mlp", 128), ("num_hidden_layers", 2),
    ("num_attention_heads", 4), ("num_key_value_heads", 2), ("head_dim", 16), ("num_local_experts", 4),
    ("num_experts_per_tok", 1), ("vocab_size", 300), ("max_position_embeddings", SEQ)))
# every 4th layer MoE: none of its 2 (a dense Llama 4)
LLAMA4_DENSE = ModelSource("hf", "Llama4ForCausalLM", LLAMA4.args + (("interleave_moe_layer_step", 4),))


@pytest.fixture(scope="module")
def loose_plans(tmp_path_factory):
    """A folder holding the tables of the models whose own plans name modules they do not have."""
    where = tmp_path_factory.mktemp("loose_plans")
    (where / ".plandsl").mkdir()
    tables = {}
    for source in (QWEN2_MOE, QWEN3_NEXT, LLAMA4, LLAMA4_DENSE):
        tables[source] = api.inspect_model(source.text, seq=SEQ)
        api.write_inspected(tables[source], cache_path(str(where / "p.plan"), source, SEQ))
    return where, tables


@pytest.mark.parametrize("source", [QWEN2_MOE, QWEN3_NEXT, LLAMA4_DENSE], ids=["qwen2_moe", "qwen3_next", "llama4_dense"])
def test_entries_of_a_models_own_plan_naming_nothing_are_skipped_as_transformers_does(loose_plans, source):
    folder, tables = loose_plans
    names = {m.name for m in tables[source].modules}
    unmatched = [p for p, _ in tables[source].tp_plan if not any(torch_plan.matches(p, n) for n in names)]
    assert unmatched  # the class's plan names modules the model does not have (it was E405 for each)
    assert (f"tensor-parallel plan: {len(unmatched)} of its {len(tables[source].tp_plan)} entries name nothing in the "
            f"model and are skipped, as transformers skips them: {unmatched[0]}, ") in api.format_inspected(tables[source])
    analysis = _check(folder, "", model=source, mesh="[dp = 4, tp = 2]")
    assert analysis.ok, [d.message for d in analysis.diagnostics]
    model = analysis.document.plans[0].model
    assert {p for p, _ in model.tp_plan} == {p for p, _ in tables[source].tp_plan} - set(unmatched)
    assert any(p.endswith("self_attn.q_proj") for p, _ in model.tp_plan)  # attention is still split
    assert torch_plan.tp_splits(model, 2)  # the cost model and the search take tp = 2 for it too
    if source is QWEN2_MOE:  # what plandsl run applies: the attention's pairs, the experts whole on every rank
        plan = api.load_runnable(folder / "p.plan", cuda=False)
        assert all(".mlp." not in p for p, _ in plan.model.tp_plan)


def test_a_models_own_plan_naming_a_parameter_or_a_style_plandsl_lacks_is_e414_not_e405(loose_plans):
    """Llama 4's experts: `experts.gate_up_proj` names a parameter (packed_rowwise), `experts` a style plandsl does
    not run (moe_tp_experts); its entries naming nothing (`layers.*...`) are skipped as for the dense one."""
    folder, _ = loose_plans
    analysis = _check(folder, "", model=LLAMA4, mesh="[dp = 4, tp = 2]")
    assert set(_codes(analysis)) == {"E414"}, [d.message for d in analysis.diagnostics]
    messages = [d.message for d in analysis.diagnostics]
    assert any("names the parameter 'model.layers.0.feed_forward.experts.gate_up_proj', not a module" in m
               for m in messages)
    assert any("'model.layers.*.feed_forward.experts' the style 'moe_tp_experts'" in m for m in messages)
    assert not any("'layers.*" in m for m in messages)


def test_an_entry_of_a_modules_own_plan_naming_nothing_is_e405_with_the_names_it_has(tmp_path):
    """A factory's module's own `tp_plan` is its author's: `layers.*.upp` (a typo of `up`) is a mistake, as
    transformers raises on a user's plan naming nothing (`DistributedConfig(tp_plan=...)`), not a stale entry of a
    transformers class to skip (checked as ok before, and run refused the lone rowwise `down` instead, E704)."""
    from pathlib import Path

    from plandsl.lower.inspected import DEFAULT_SEQ, written_sources
    here = str(Path(__file__).resolve().parent)
    texts = {}
    for typo in (False, True):
        source = ModelSource("factory", "inspect_models.planned:build", (("typo", typo),))
        table = api.inspect_model(source.text, seq=DEFAULT_SEQ, search_path=(here,))
        assert not table.tp_plan_from_transformers and "are skipped" not in api.format_inspected(table)
        (tmp_path / "p.plan").write_text(
            f'import "clusters/dgx_a100"\nplan p {{\n  model = factory("inspect_models.planned:build", '
            f'typo={str(typo).lower()})\n  cluster = dgx_a100 x 1\n  mesh = [dp = 4, tp = 2]\n'
            f'  train = {{ global_batch: 16, micro_batch: 1, seq: {SEQ} }}\n}}\n', encoding="utf-8")
        [(_, _, cache)] = written_sources(api.parse_file(tmp_path / "p.plan"))
        Path(cache).parent.mkdir(exist_ok=True)
        api.write_inspected(table, cache)
        texts[typo] = api.check(tmp_path / "p.plan")
    assert texts[False].ok, [d.message for d in texts[False].diagnostics]
    [typo] = texts[True].diagnostics
    assert typo.code == "E405" and "names 'layers.*.upp', which matches no module" in typo.message
    assert "layers.*.up" in typo.hint
