"""`plandsl inspect`: a user's torch module (a factory, Hugging Face configs) built on the meta device and
read as a layer table; compared with plandsl's own `llama(...)` family; the cache and its staleness; the
model source parser; the command line. The bad-input codes E901-E904 run in tests/unit/test_diagnostics.py
(each catalogue example and its fix); the Hugging Face ones here."""
from __future__ import annotations

import importlib.util
import json
import os
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner

from plandsl import api
from plandsl.cli import main
from plandsl.ir import layers as ir_layers
from plandsl.ir.inspected import InspectedModel, ModelSource, parse_source, read_cache

# Skip without transformers, as importorskip did, but without importing it at collection: each xdist worker
# collects every module, and importing transformers (and huggingface_hub, httpx, trio...) cost ~1 CPU-s there.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")

HERE = str(Path(__file__).resolve().parent)
SEQ = 64
# Llama with grouped-query attention (8 heads, 2 key/value heads), untied, no biases.
LLAMA = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2, vocab_size=1000, max_position_embeddings=SEQ, tie_word_embeddings=False)


def _hf(cls: str, **config) -> str:
    return ModelSource("hf", cls, tuple(config.items())).text


@pytest.fixture(scope="module")
def llama() -> InspectedModel:
    return api.inspect_model(_hf("LlamaForCausalLM", **LLAMA), seq=SEQ)


def _plandsl_llama():
    text = ('model m = llama(layers=4, hidden=256, heads=8, kv_heads=2, ffn=688, seq=64, vocab=1000)\n')
    return api.loads(text).models[0]


def test_hf_llama_parameters_equal_plandsl_llama_exactly(llama):
    model = _plandsl_llama()
    ours = ir_layers.layers_of(model)
    assert llama.params == ir_layers.param_count(model)
    blocks = [layer for layer in ours if layer.kind == "block"]
    assert [b.params for b in llama.blocks] == [b.param_count for b in blocks]
    assert llama.before_params == next(layer.param_count for layer in ours if layer.kind == "embed")
    assert llama.after_params == sum(layer.param_count for layer in ours if layer.kind in ("norm", "head"))
    assert llama.block_list == "model.layers" and llama.block_list_from == "base_model_pp_plan"
    assert llama.traced_blocks == 1 and {b.shape_key for b in llama.blocks} == {0}


def test_hf_llama_flops_equal_plandsl_llama(llama):
    """Tolerance 0.1 %: FlopCounterMode counts the matmuls (mm, bmm: the attention scores and values at full
    s², as plandsl does) and nothing elementwise, which is exactly what `transformer_block_flops` and the
    head's 2·h·V count, so the figures agree to rounding."""
    model = _plandsl_llama()
    expected = ir_layers.transformer_block_flops(model)
    for block in llama.blocks:
        assert block.figures.flops_at(SEQ) == pytest.approx(expected, rel=1e-3)
        assert block.figures.flops_per_position == pytest.approx(4 * 256, rel=1e-3)  # Q·Kᵀ and scores·V: 4·h per position
    head = next(layer for layer in ir_layers.layers_of(model) if layer.kind == "head")
    assert llama.after.flops_at(SEQ) == pytest.approx(head.flops_per_token, rel=1e-3)
    assert llama.before.flops_at(SEQ) == 0  # an embedding is a lookup


def test_hf_llama_activations_against_plandsl_llama(llama):
    """plandsl's cost model counts what fused kernels keep (Korthikanti et al. 2022, 16-bit): here 29.1·h bytes
    per token. Hugging Face's eager modules on the meta device keep more: both RMSNorm inputs in fp32, the
    attention's q, k, v and output upcast to fp32 by the math attention (k and v repeated to all heads), and
    SwiGLU's silu output and product besides its two projections. The stated tolerance: linear part between
    1x and 2x of the cost model's (measured 1.79x); the quadratic part exactly one fp32 score matrix per head
    (heads·4 bytes per token per position), the cost model's llama `2·a·s/h` term at 4 bytes instead of 2."""
    from plandsl.cost.memory import _block_terms
    model = _plandsl_llama()
    replicated, sharded, _ = _block_terms(model, SEQ)
    fused = (replicated + sharded) * 256
    for block in llama.blocks:
        assert fused <= block.figures.activation_bytes <= 2 * fused
        assert block.figures.activation_bytes_per_position == pytest.approx(8 * 4, rel=1e-3)
        assert block.input_bytes == block.output_bytes == 256 * 2  # the hidden state, bf16


def test_gpt2_ties_its_head_to_the_embedding():
    table = api.inspect_model(_hf("GPT2LMHeadModel", n_embd=64, n_layer=2, n_head=4, n_positions=SEQ, vocab_size=500),
                              seq=SEQ)
    assert table.tied == (("lm_head.weight", "transformer.wte.weight"),)
    assert table.block_list == "transformer.h" and len(table.blocks) == 2
    # wte 500·64 + wpe 64·64 + 2 blocks of 12·64² + 13·64 + ln_f 2·64, the head counted once (tied)
    assert table.params == 500 * 64 + SEQ * 64 + 2 * (12 * 64 * 64 + 13 * 64) + 2 * 64
    assert table.blocks[0].figures.flops_at(SEQ) == pytest.approx(24 * 64 * 64 + 4 * SEQ * 64, rel=1e-3)


def test_mixtral_moe_through_inspect():
    table = api.inspect_model(_hf("MixtralForCausalLM", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                  num_experts_per_tok=2, vocab_size=300, max_position_embeddings=SEQ), seq=SEQ)
    model = api.loads("model m = llama(layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, seq=64, vocab=300, "
                      "experts=4, top_k=2)\n").models[0]
    assert table.params == ir_layers.param_count(model)
    assert len(table.blocks) == 2 and table.traced_blocks == 1
    assert all(block.figures.flops > 0 and block.figures.activation_bytes > 0 for block in table.blocks)


def test_a_user_factory_in_a_test_file():
    table = api.inspect_model("inspect_models.tiny:build(depth=3, width=32)", seq=16, search_path=(HERE,))
    assert table.block_list == "layers" and table.block_list_from == "layers" and len(table.blocks) == 3
    assert table.tied == (("out.weight", "tok.weight"),)
    assert table.params == 100 * 32 + 3 * (2 * 32 + 32 * 64 + 64 + 64 * 32 + 32)
    block = table.blocks[0].figures
    assert block.flops == pytest.approx(2 * 2 * 32 * 64) and block.flops_per_position == 0
    assert table.after.flops == pytest.approx(2 * 32 * 100) and table.before.flops == 0
    assert (table.before_params, table.after_params) == (100 * 32, 0)  # the head is tied to the embedding
    root = next(m for m in table.modules if m.name == "")
    assert root.type == "Tiny" and {m.name for m in table.modules} >= {"layers.0.up", "layers.2.down", "out"}


def test_blocks_in_a_module_dict_as_torchtitan_holds_them():
    """torchtitan's layout: `layers` an nn.ModuleDict keyed "0" .. "3" (E904 before), the blocks by its keys in its
    order, traced as a prefix of it (one block) and cut by torch's pipeline frontend; the same table as the model
    holding them in an nn.ModuleList."""
    source = "inspect_models.titan:build(n_layers=4)"
    table = api.inspect_model(source, seq=16, search_path=(HERE,))
    assert (table.block_list, table.block_list_from, table.containers) == ("layers", "layers", ("layers",))
    assert [block.name for block in table.blocks] == ["layers.0", "layers.1", "layers.2", "layers.3"]
    assert table.traced_blocks == 1 and table.traceable
    listed = api.inspect_model(source.replace(")", ", as_dict=false)"), seq=16, search_path=(HERE,))
    assert listed.block_list_from == "layers"
    assert [b.figures for b in table.blocks] == [b.figures for b in listed.blocks]
    assert (table.before, table.after, table.params) == (listed.before, listed.after, listed.params)
    other = api.inspect_model(source.replace(")", ', container="blocks")'), seq=16, search_path=(HERE,))
    assert other.block_list_from == "largest ModuleDict" and other.blocks[-1].name == "blocks.3"


@pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None, reason="torchtitan is not installed")
def test_torchtitans_own_llama3_is_inspected_by_its_module_dict():
    """With its q, k, v projections apart torch's pipeline frontend cuts it; with the fused `wqkv` (torchtitan's
    default) torch.export lifts that weight to an input of each stage, which no stage is fed (every rank of `plandsl
    run` failed: "forward() missing 2 required positional arguments"): not traceable, so run refuses its stages (E704)."""
    table = api.inspect_model("inspect_models.titan:llama3(n_layers=3, fuse_qkv=False)", seq=16, search_path=(HERE,))
    assert table.model_type == "Llama3Model" and table.block_list == "layers" and table.traceable
    assert [block.name for block in table.blocks] == ["layers.0", "layers.1", "layers.2"]
    assert {m.name for m in table.modules} >= {"layers.2.attention.wo", "layers.0.feed_forward.w1", "lm_head"}
    fused = api.inspect_model("inspect_models.titan:llama3(n_layers=3)", seq=16, search_path=(HERE,))
    assert not fused.traceable and len(fused.blocks) == 3
    from plandsl.runtime.inspect import DTYPES, stage_trace_problem
    from plandsl.runtime.inspect.factory import build
    from plandsl.runtime.inspect.trace import Inputs, find_block_list
    source = parse_source("inspect_models.titan:llama3(n_layers=3)")
    model, _ = build(source, "bfloat16", (HERE,))
    problem = stage_trace_problem(model, find_block_list(model, source), Inputs(source, 16, DTYPES["bfloat16"]))
    assert problem == ("torch.export lifted layers_0_attention_qkv_linear_wqkv_weight to inputs of stage 0, which its "
                       "pipeline frontend feeds nothing")


def test_a_deep_model_is_traced_once_per_block_shape():
    config = dict(LLAMA, num_hidden_layers=12, rope_theta=500000.0)  # a legacy key transformers still takes
    table = api.inspect_model(_hf("LlamaForCausalLM", **config), seq=16)
    assert table.traced_blocks == 1 and len(table.blocks) == 12
    assert len({block.figures for block in table.blocks}) == 1


@pytest.mark.parametrize("source, code", [
    ('hf("LlamaForCausalLn", hidden_size=64)', "E901"),
    ('hf("LlamaForCausalLM", hiden_size=64)', "E902"),
    ('hf("LlamaForCausalLM", hidden_size=65, num_attention_heads=4)', "E902"),  # the config refuses it
    ("inspect_models.not_there:build", "E901"),
    ("inspect_models.tiny:biuld", "E901"),
    ("inspect_models.tiny:build(width=-1)", "E902"),
    ("inspect_models.tiny:build(depth=0)", "E904"),  # an empty ModuleList holds no blocks
])
def test_bad_sources_are_coded(source, code):
    with pytest.raises(api.PlanError) as raised:
        api.inspect_model(source, seq=16, search_path=(HERE,))
    assert [d.code for d in raised.value.diagnostics] == [code]


@pytest.mark.parametrize("source, code, words", [
    # SystemExit is no Exception: `plandsl inspect` ended with the factory's status and printed nothing (exit 0
    # for sys.exit(0), as if the table were made)
    ("inspect_models.exits:build", "E902", "raised SystemExit"),
    ("inspect_models.exits:build(code=3)", "E902", "raised SystemExit: 3"),
    ("inspect_models.exits:parse_args", "E902", "raised SystemExit: 2"),  # argparse's refusal
    ("inspect_models.exits_on_import:build", "E901", "SystemExit: 0"),
    ("inspect_models.exits:leaves", "E903", "SystemExit: done"),
])
def test_user_code_that_exits_is_coded_not_the_commands_exit(source, code, words):
    with pytest.raises(api.PlanError) as raised:
        api.inspect_model(source, seq=16, search_path=(HERE,))
    assert [d.code for d in raised.value.diagnostics] == [code]
    assert words in raised.value.diagnostics[0].message, raised.value.diagnostics[0].message


@pytest.mark.parametrize("source", ['hf("GPT2LMHeadModel", n_embd=64, n_layer=4, n_head=4, n_positions=16, '
                                    'vocab_size=128)', "inspect_models.tiny:build(depth=4)"])
def test_a_build_past_the_parameter_limit_stops_there_E505(monkeypatch, source):
    """A config's layer count is a number in the plan: `inspect 'hf("GPT2LMHeadModel", n_layer=20000, ...)'` built
    for as long as it took (5,000 blocks: 24 s, 770 MB); the build stops past `limits.MAX_MODULE_PARAMETERS`
    parameter tensors (20,000 blocks would register 240,000: E505 at the 200,001st, after 32 s and 1.1 GB). Here the limit is lowered below what the module
    registers, and the same build under the limit as it is succeeds."""
    from plandsl.diagnostics import limits
    api.inspect_model(source, seq=16, search_path=(HERE,))
    monkeypatch.setattr(limits, "MAX_MODULE_PARAMETERS", 5)
    with pytest.raises(api.PlanError) as raised:
        api.inspect_model(source, seq=16, search_path=(HERE,))
    assert [d.code for d in raised.value.diagnostics] == ["E505"]
    assert "more than 5 parameter tensors" in raised.value.diagnostics[0].message


@pytest.mark.parametrize("text", ["os.system('x')", "m:f(__import__('os'))", 'hf(LlamaForCausalLM)', "m:f(x=y)",
                                  "m:f(**k)", "m:f(1)", "m:f(x=1, x=2)", "m:f(x=float('nan'))", "m:f(x=1e999)",
                                  "not a source"])
def test_the_source_parser_takes_literals_only(text):
    with pytest.raises(ValueError):
        parse_source(text)


def test_the_source_parser_reads_factories_and_configs():
    assert parse_source("pkg.mod:fn") == ModelSource("factory", "pkg.mod:fn")
    assert parse_source("pkg.mod:fn(a=1, b='x', c=[1, 2], d=None)").args == (
        ("a", 1), ("b", "x"), ("c", (1, 2)), ("d", None))
    source = parse_source('hf("LlamaForCausalLM", hidden_size=64, rope_theta=5e5)')
    assert source.kind == "hf" and parse_source(source.text) == source
    # as a plan writes it (true/false) or as Python does: the same source, the same cache key
    assert parse_source('hf("X", tie_word_embeddings=false)') == parse_source('hf("X", tie_word_embeddings=False)')


def test_the_cache_is_keyed_by_source_settings_and_versions(llama, tmp_path):
    path = tmp_path / "model.json"
    api.write_inspected(llama, path)
    source = parse_source(llama.source)
    assert read_cache(path, source, SEQ, "bfloat16").fresh
    assert read_cache(path, source, SEQ, "bfloat16").model == llama
    assert "missing" in read_cache(tmp_path / "none.json", source).problem
    assert "stale" in read_cache(path, parse_source(_hf("LlamaForCausalLM", hidden_size=128))).problem
    assert "seq" in read_cache(path, source, 128).problem
    assert "float32" in read_cache(path, source, SEQ, "float32").problem
    changed = dict(llama.versions, torch="0.0")
    assert "torch" in read_cache(path, source, versions=changed).problem
    path.write_text("{}", encoding="utf-8")
    assert "stale" in read_cache(path, source).problem


def test_a_factory_cache_is_stale_once_its_module_changes(tmp_path):
    module = tmp_path / "edited_model.py"
    module.write_text((Path(HERE) / "inspect_models" / "tiny.py").read_text(encoding="utf-8"), encoding="utf-8")
    table = api.inspect_model("edited_model:build(depth=1)", seq=8, search_path=(str(tmp_path),))
    assert set(table.files) == {str(module.resolve())}
    api.write_inspected(table, tmp_path / "cache.json")
    assert api.read_inspected(tmp_path / "cache.json", "edited_model:build(depth=1)", 8).fresh
    module.write_text(module.read_text(encoding="utf-8") + "\n# edited\n", encoding="utf-8")
    state = api.read_inspected(tmp_path / "cache.json", "edited_model:build(depth=1)", 8)
    assert not state.fresh and "edited_model.py changed" in state.problem


@pytest.mark.parametrize("named", ["/dev/zero", "fifo", "folder"])
def test_a_cache_naming_a_file_without_end_is_stale_not_read(tmp_path, named):
    """A cache's `files` is anyone's to write: one naming /dev/zero made `plandsl check` (and the language server)
    read it until memory ran out (E108 MemoryError), a FIFO waited for a writer for ever. Such a file is no
    factory's module: the cache is stale, at once."""
    table = api.inspect_model("inspect_models.tiny:build(depth=1)", seq=8, search_path=(HERE,))
    special = {"fifo": tmp_path / "fifo", "folder": tmp_path}.get(named, Path(named))
    if named == "fifo":
        os.mkfifo(special)
    cache = tmp_path / "cache.json"
    api.write_inspected(table.model_copy(update={"files": {**table.files, str(special): "0" * 64}}), cache)
    found: list = []
    reader = threading.Thread(target=lambda: found.append(api.read_inspected(cache, "inspect_models.tiny:build"
                                                                             "(depth=1)", 8)), daemon=True)
    reader.start()
    reader.join(10)
    assert found, f"reading a cache that names {special} did not end within 10 s"
    assert not found[0].fresh and f"{special} changed" in found[0].problem


def test_a_cache_naming_more_files_than_a_factory_has_is_stale_unread(tmp_path):
    """A factory's table names its module, one file; one edited to name thousands (spellings of one large file)
    hashed each, up to 64 MiB apiece, on every `check`: past `MAX_TABLE_FILES` the table is stale, nothing read."""
    from plandsl.ir.inspected import MAX_TABLE_FILES
    table = api.inspect_model("inspect_models.tiny:build(depth=1)", seq=8, search_path=(HERE,))
    cache = tmp_path / "cache.json"
    data = json.loads(table.model_dump_json())
    data["files"] = {**table.files, **{f"/./{'/.' * i}{tmp_path}/x": "0" * 64 for i in range(MAX_TABLE_FILES)}}
    cache.write_text(json.dumps(data))
    state = api.read_inspected(cache, "inspect_models.tiny:build(depth=1)", 8)
    assert not state.fresh


@pytest.mark.parametrize("change", [
    # each was E108 in `plandsl check` of a plan whose model the table describes
    lambda t: {"param_list": [{**t["param_list"][0], "shape": [10**80]}] + t["param_list"][1:]},  # OverflowError
    lambda t: {"blocks": [{**t["blocks"][0], "params": 10**80}] + t["blocks"][1:]},               # OverflowError
    lambda t: {"blocks": [{**t["blocks"][0], "figures": {**t["blocks"][0]["figures"],
                                                         "flops_per_position": 1e308}}] + t["blocks"][1:]},
    lambda t: {"after": {**t["after"], "flops": float("inf")}},       # an inf layer the model then refused
    lambda t: {"before": {**t["before"], "activation_bytes": float("nan")}},
    lambda t: {"param_list": [{**t["param_list"][0], "shape": [-1, 32]}] + t["param_list"][1:]},  # a negative dim
])
def test_a_hand_edited_table_out_of_bounds_is_stale_and_check_says_E215(tmp_path, change):
    plan = _factory_plan(tmp_path)
    written = api.inspect_plan(str(plan))
    assert written and api.check(str(plan), {}).ok
    cache = Path(written[0][1])
    table = json.loads(cache.read_text())
    cache.write_text(json.dumps({**table, **change(table)}))
    analysis = api.check(str(plan), {})
    assert [d.code for d in analysis.errors] == ["E215"], [d.message for d in analysis.diagnostics]


def _factory_plan(folder: Path, module: str = "tiny_model") -> Path:
    plan = folder / "m.plan"
    (folder / f"{module}.py").write_text((Path(HERE) / "inspect_models" / "tiny.py").read_text())
    plan.write_text(f'import "clusters/local"\nplan p {{\n  model = factory("{module}:build")\n  cluster = localhost\n'
                    '  mesh = [dp = 1]\n  train = { global_batch: 2, micro_batch: 1, seq: 16 }\n}\n')
    return plan


def test_a_table_that_cannot_be_written_is_an_error_not_E108(tmp_path):
    """`plandsl inspect m.plan` where `.plandsl` is a file: FileExistsError escaped as E108."""
    plan = _factory_plan(tmp_path)
    (tmp_path / ".plandsl").write_text("")
    result = CliRunner().invoke(main, ["inspect", str(plan)])
    assert result.exit_code == 1 and "E108" not in result.output, result.output
    # E110 at the model's call (an uncoded `error: cannot write ...` line before), found before the model is built
    assert f"{plan}:3:11: error[E110]: cannot write the layer table of tiny_model:build() to " in result.output
    assert ".plandsl: it is a file, not a directory" in result.output and "= hint: the plan reads" in result.output


def test_a_plan_folder_that_refuses_the_tables_folder_is_E110_without_a_file_to_move(tmp_path, monkeypatch):
    """`.plandsl` missing and the plan's folder not writable (a read-only checkout, as a user who is not root sees it):
    E110 before the model is built, whose hint said to move away "a file of that name" that is not there; it says
    to make the plan's folder writable."""
    plan = _factory_plan(tmp_path)
    real = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: False if os.fspath(path) == str(tmp_path)
                        else real(path, mode, **kw))
    result = CliRunner().invoke(main, ["inspect", str(plan)])
    assert result.exit_code == 1, result.output
    assert f"{plan}:3:11: error[E110]: cannot write the layer table of tiny_model:build() to " in result.output
    assert f"its folder {tmp_path} is not writable" in result.output, result.output
    assert "a file of that name" not in result.output and "make the plan's folder writable" in result.output, \
        result.output
    assert not (tmp_path / ".plandsl").exists()


def test_a_table_that_cannot_be_written_after_it_is_built_is_E110_at_the_call(tmp_path, monkeypatch):
    """A full disk as the table is written (after the model is built): E110 at the call, the system's reason."""
    from plandsl.runtime.inspect import plan as inspecting
    plan = _factory_plan(tmp_path)

    def full(table, cache):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(inspecting, "write_cache", full)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["inspect", str(plan)])
    assert result.exit_code == 1, result.output
    assert f"{plan}:3:11: error[E110]: cannot write the layer table of tiny_model:build() to " in result.output
    assert "No space left on device" in result.output and "= hint: the disk (or your quota) is full" in result.output


@pytest.mark.parametrize("kind", ["fifo", "link to /dev/full"])
def test_a_table_is_written_over_what_is_there_not_through_it(tmp_path, kind):
    """A FIFO where the table goes was opened for writing and waited on for ever (inspect, and check
    --allow-model-import); a link to /dev/full was written into (E108 No space left on device)."""
    plan = _factory_plan(tmp_path)
    folder = tmp_path / ".plandsl"
    folder.mkdir()
    cache = Path(api.inspect_plan(str(plan))[0][1])
    cache.unlink()
    if kind == "fifo":
        os.mkfifo(cache)
    else:
        cache.symlink_to("/dev/full")
    done: list = []
    writer = threading.Thread(target=lambda: done.append(api.inspect_plan(str(plan))), daemon=True)
    writer.start()
    writer.join(60)
    assert done, f"inspect did not end within 60 s with a {kind} where its table goes"
    assert cache.is_file() and not cache.is_symlink() and api.check(str(plan), {}).ok
    assert [p.name for p in folder.iterdir()] == [cache.name]  # no temporary file left


def test_a_factory_in_a_folder_of_non_utf8_bytes_is_fresh_after_inspect(tmp_path):
    """The table's `files` named the module by a path holding argv's surrogates, which its JSON wrote as U+FFFD:
    read back it named another file, so `check` called the table stale for ever, whatever `inspect` wrote."""
    folder = Path(os.fsdecode(os.fsencode(str(tmp_path)) + b"/s\xffd"))
    folder.mkdir()
    plan = _factory_plan(folder, "tiny_in_odd_folder")  # a module name of its own: imported once a process
    cache = api.inspect_plan(str(plan))[0][1]
    assert api.check(str(plan), {}).ok
    module = folder / "tiny_in_odd_folder.py"
    module.write_text(module.read_text() + "\n# edited\n")
    state = api.read_inspected(cache, "tiny_in_odd_folder:build()")
    assert not state.fresh and "s\\xffd/tiny_in_odd_folder.py changed" in state.problem, state.problem


def test_the_cli_prints_and_writes_the_table(tmp_path, monkeypatch):
    monkeypatch.chdir(HERE)
    out = tmp_path / "tiny.json"
    result = CliRunner().invoke(main, ["inspect", "inspect_models.tiny:build(depth=2)", "--seq", "16", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "layers.0..1 x2 (Block)" in result.stdout and "tied to tok.weight" in result.stdout
    assert api.read_inspected(out, "inspect_models.tiny:build(depth=2)", 16).fresh
    assert json.loads(out.read_text())["block_list"] == "layers"
    bad = CliRunner().invoke(main, ["inspect", "m:f(x=y)"])
    assert bad.exit_code == 2 and "literals" in bad.output
    missing = CliRunner().invoke(main, ["inspect", "inspect_models.not_there:build"])
    assert missing.exit_code == 1 and "E901" in missing.output


PLAN = """\
import "clusters/dgx_a100"
plan p {
  model   = MODEL
  cluster = dgx_a100 x 1
  mesh    = [dp = 2, pp = 2, tp = 2]
  train   = { global_batch: 16, micro_batch: 1, seq: 64 }
  stages  = evenly over pp
}
"""
HF_CALL = ('hf("LlamaForCausalLM", hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8, '
           'num_key_value_heads=2, vocab_size=1000, max_position_embeddings=64, tie_word_embeddings=false)')


def test_a_plan_over_a_torch_model_reads_its_cache_and_says_how_to_make_it(tmp_path):
    plan = tmp_path / "hf.plan"
    plan.write_text(PLAN.replace("MODEL", HF_CALL), encoding="utf-8")
    missing = api.check(plan)
    assert [d.code for d in missing.diagnostics] == ["E215"]
    hint = missing.diagnostics[0].hint
    assert "is missing" in missing.diagnostics[0].message and "plandsl inspect 'hf(\"LlamaForCausalLM\"" in hint
    assert hint.startswith(f"run: plandsl inspect {plan} (or: ")
    source, seq, output = hint.split("plandsl inspect ")[2].split("'")[1], 64, hint.rsplit("-o ", 1)[1].rstrip(")")
    assert f"--seq {seq}" in hint and output.startswith(str(tmp_path / ".plandsl"))
    (tmp_path / ".plandsl").mkdir()
    api.write_inspected(api.inspect_model(source, seq=seq), output)

    analysis = api.check(plan)
    assert analysis.ok, [d.message for d in analysis.diagnostics]
    model = analysis.document.plans[0].model
    names = [layer.name for layer in model.layers]
    assert names == ["embed", "model.layers.0", "model.layers.1", "model.layers.2", "model.layers.3", "head"]
    ours = _plandsl_llama()
    assert sum(layer.params for layer in model.layers) == ir_layers.param_count(ours)
    assert model.layers[1].flops == pytest.approx(ir_layers.transformer_block_flops(ours), rel=1e-3)
    assert model.layers[1].output == 256
    estimate = api.estimate(analysis.document.plans[0])
    assert estimate.to_json()  # the cost model reads the table like a written model

    cache = json.loads(Path(output).read_text(encoding="utf-8"))
    cache["versions"]["torch"] = "1.0"
    Path(output).write_text(json.dumps(cache), encoding="utf-8")
    stale = api.check(plan)
    assert [d.code for d in stale.diagnostics] == ["E215"]
    assert "stale: torch '1.0' ->" in stale.diagnostics[0].message


def test_allow_model_import_inspects_what_is_missing_or_stale(tmp_path, monkeypatch):
    """`--allow-model-import` (api.model_imports): the table is derived and written where the plan reads it;
    a model that cannot be inspected is still E215, naming the inspect error."""
    monkeypatch.syspath_prepend(HERE)
    plan = tmp_path / "tiny.plan"
    plan.write_text(PLAN.replace("MODEL", 'factory("inspect_models.tiny:build", depth=2, tied=false)')
                    .replace("[dp = 2, pp = 2, tp = 2]", "[dp = 8]").replace("  stages  = evenly over pp\n", ""),
                    encoding="utf-8")
    assert [d.code for d in api.check(plan).diagnostics] == ["E215"]
    with api.model_imports():
        analysis = api.check(plan)
    assert analysis.ok, [d.message for d in analysis.diagnostics]
    assert api.check(plan).ok and len(list((tmp_path / ".plandsl").iterdir())) == 1  # written, read next time
    plan.write_text(plan.read_text(encoding="utf-8").replace("inspect_models.tiny:build", "inspect_models.tiny:nothing"),
                    encoding="utf-8")
    with api.model_imports():
        [refused] = api.check(plan).diagnostics
    assert refused.code == "E215" and "inspecting the model failed: error[E901]: module 'inspect_models.tiny' has no 'nothing'" \
        in refused.message
    result = CliRunner().invoke(main, ["check", str(plan), "--allow-model-import"])
    assert result.exit_code == 1 and "inspecting the model failed" in result.output


def test_a_factory_in_a_plan(tmp_path):
    plan = tmp_path / "tiny.plan"
    plan.write_text(PLAN.replace("MODEL", 'factory("inspect_models.tiny:build", depth=4)')
                    .replace("[dp = 2, pp = 2, tp = 2]", "[dp = 4, pp = 2]"), encoding="utf-8")
    hint = api.check(plan).diagnostics[0].hint
    assert "plandsl inspect 'inspect_models.tiny:build(depth=4)' --seq 2048" in hint
    (tmp_path / ".plandsl").mkdir()
    table = api.inspect_model("inspect_models.tiny:build(depth=4)", seq=2048, search_path=(HERE,))
    api.write_inspected(table, hint.rsplit("-o ", 1)[1].rstrip(")"))
    analysis = api.check(plan)
    # tiny ties its head to its embedding, which two pipeline stages cannot share (tests/unit/test_torch_names.py)
    assert [d.code for d in analysis.diagnostics] == ["E412"], [d.message for d in analysis.diagnostics]
    assert [layer.name for layer in analysis.document.plans[0].model.layers][1:-1] == [f"layers.{i}" for i in range(4)]


@pytest.mark.parametrize("call, code", [('hf(hidden_size=4)', "E212"), ('factory("no_colon")', "E205"),
                                        ('hf("X", a=[1])', "E205"), ('hf("X", a=1, a=2)', "E213")])
def test_a_torch_model_call_is_checked_before_its_cache_is_read(tmp_path, call, code):
    plan = tmp_path / "bad.plan"
    plan.write_text(PLAN.replace("MODEL", call), encoding="utf-8")
    assert code in [d.code for d in api.check(plan).diagnostics]


def test_inspect_of_a_plan_file_writes_every_table_where_the_plan_reads_it(tmp_path, monkeypatch):
    plan = tmp_path / "both.plan"
    plan.write_text(PLAN.replace("MODEL", "tiny_b").replace("plan p {", 'model tiny_a = factory("inspect_models.tiny:build", '
                    'depth=2)\nmodel tiny_b = factory("inspect_models.tiny:build", depth=3)\nplan p {'), encoding="utf-8")
    assert [d.code for d in api.check(plan).diagnostics] == ["E215", "E215"]
    monkeypatch.chdir(HERE)  # the factory's package is found from the current folder
    result = CliRunner().invoke(main, ["inspect", str(plan)])
    assert result.exit_code == 0, result.output
    assert result.stdout.count("wrote ") == 2 and len(list((tmp_path / ".plandsl").iterdir())) == 2
    # the tables are read; what is left (tests/unit/test_torch_names.py): tiny has no tensor-parallel plan for
    # tp = 2 (E413) and ties its head to its embedding across the pipeline (E412)
    assert sorted(d.code for d in api.check(plan).diagnostics) == ["E412", "E413"]
    plan.write_text(PLAN.replace("MODEL", 'factory("inspect_models.tiny:build", depth=n)').replace(
        "plan p {", "param n = 2\nplan p {"), encoding="utf-8")
    refused = CliRunner().invoke(main, ["inspect", str(plan)])
    assert refused.exit_code == 1, refused.output
    assert refused.output.startswith(f"{plan}:4:13: error[E905]: argument 'depth' of factory(...) is not a literal"), \
        refused.output
    # check's E215 for that call names only the command that writes its table (its values filled in): its first
    # command, `plandsl inspect FILE.plan`, was the E905 above, whose hint sent the user back to the second
    fresh = tmp_path / "fresh" / "p.plan"  # a folder without the tables written above
    fresh.parent.mkdir()
    fresh.write_text(plan.read_text(encoding="utf-8"), encoding="utf-8")
    [missing] = api.check(fresh).diagnostics
    assert missing.code == "E215" and "plandsl inspect 'inspect_models.tiny:build(depth=2)' --seq" in missing.hint
    assert f"plandsl inspect {fresh}" not in missing.hint and "not all literals" in missing.hint, missing.hint


@pytest.mark.parametrize("call, code, where, words", [
    ('factory("inspect_models.tiny:build", depth=n)', "E905", "3:11", "argument 'depth' of factory(...) is not"),
    ('factory("inspect_models.tiny:build", depth=1 + 1)', "E905", "3:11", "argument 'depth' of factory(...) is not"),
    ('hf("X", input=image(3, n, 4))', "E905", "3:11", "input=image(...) of hf(...) has a size that is not a literal"),
    ('hf(n, hidden_size=4)', "E212", "3:11", "hf() takes one string first, then named arguments"),
    ('hf("A", "B")', "E212", "3:11", "hf() takes one string first"),  # was `error: zip() argument 2 is longer ...`
    ('hf()', "E212", "3:11", "hf() takes one string first"),
    ('hf("A", input=image(3, 4, 4), input=image(3, 4, 4))', "E213", "3:41", "argument 'input' is given twice"),
    ('hf("A", input=image(0, 4))', "E205", "3:25", "image() sizes must be between 1 and 65,536, not (0, 4)"),
    # were inspected as written: E901 (no module `tiny`), and a table with hidden_size given twice
    ('factory("tiny", depth=2)', "E205", "3:19", 'factory() takes "package.module:function"'),
    ('hf("A", hidden_size=4, hidden_size=4)', "E213", "3:34", "argument 'hidden_size' is given twice")])
def test_inspect_of_a_plan_refuses_a_call_it_cannot_read_with_a_code_at_the_call(tmp_path, call, code, where, words):
    """`plandsl inspect FILE.plan` reads each model's source from the text: a call whose arguments are not literals
    was an uncoded `error: FILE:L:C: ... not literals` line (and one with two positional arguments `error: zip() ...`);
    now E905 at the call, and for a call of another shape the code `check` gives it, exit 1, nothing built."""
    plan = tmp_path / "m.plan"
    plan.write_text(f'import "clusters/local"\nplan p {{\n  model = {call}\n  cluster = localhost\n'
                    '  mesh = [dp = 1]\n  train = { global_batch: 2, micro_batch: 1, seq: 16 }\n}\nparam n = 2\n')
    result = CliRunner().invoke(main, ["inspect", str(plan)])
    assert result.exit_code == 1, result.output
    assert result.output.startswith(f"{plan}:{where}: error[{code}]: ") and words in result.output, result.output
    assert "^" in result.output and "= hint: " in result.output or code == "E213" or "factory()" in words, \
        result.output
    if code != "E905":  # the same code as check gives the call
        assert code in [d.code for d in api.check(plan).diagnostics]
    assert not (tmp_path / ".plandsl").exists()


def test_a_config_with_more_positions_than_a_plan_trains_is_inspected_at_the_longest_it_does():
    """`max_position_embeddings=2^25` made `model_seq` ask for a table at 2^25 tokens, past `MAX_SEQ`: `inspect`
    printed pydantic's validation error, and `check`'s E215 hint asked for a `--seq` click refuses. The table is now
    made at `MAX_SEQ`."""
    from plandsl.diagnostics.limits import MAX_SEQ
    from plandsl.lower.inspected import model_seq
    source = ModelSource("hf", "LlamaForCausalLM", tuple({**LLAMA, "max_position_embeddings": 2**25}.items()))
    assert model_seq(source) == MAX_SEQ
    assert model_seq(ModelSource("hf", "LlamaForCausalLM", tuple(LLAMA.items()))) == SEQ


@pytest.mark.parametrize("version, words", [(5, "table version 5, written by an older plandsl"),
                                            (99, "table version 99, written by a newer plandsl")])
def test_a_table_of_another_version_says_so(tmp_path, version, words):
    """After an upgrade every table reads stale; the reason said only "not a cache of this plandsl (1 problem(s))"
    (the review): now the version it was written at and the one this plandsl reads."""
    table = api.inspect_model("inspect_models.tiny:build(depth=1)", seq=8, search_path=(HERE,))
    cache = tmp_path / "cache.json"
    cache.write_text(table.model_dump_json().replace(f'"version":{table.version}', f'"version":{version}'))
    state = api.read_inspected(cache, "inspect_models.tiny:build(depth=1)", 8)
    assert not state.fresh and words in state.problem
