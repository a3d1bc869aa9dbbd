"""`plandsl export --to torchtitan` and `plandsl import --from torchtitan`: torchtitan 0.3.0's arguments. Every
stdlib plan's export (what torchtitan cannot express as E808), golden files, round trips, bad flags as E804-E807,
and the exports held against torchtitan's own ConfigManager, ParallelDims, config functions and pipeline split
(skipped without torchtitan: .ci/run installs it with --no-deps, README)."""
from __future__ import annotations

import functools
import shlex

import pytest
from click.testing import CliRunner
from test_interop_megatron import ALL, stdlib_plan  # the stdlib plans, found by name

from plandsl import api, ir
from plandsl.cli import main
from plandsl.interop import export_plan, import_text, torchtitan
from plandsl.interop.torchtitan_import import CONFIG_DEFAULTS, DEFAULTS, default_split

pytestmark = pytest.mark.xdist_group("torchtitan")  # one worker imports torchtitan once (~15 s wall)

EXPRESSED = {"llama3_8b_hsdp"}   # the stdlib plans torchtitan expresses whole: llama3 8B, hsdp, full recompute
WHOLE = [param for param in ALL if param.values[1] in EXPRESSED]

# Plans torchtitan expresses whole, beyond the stdlib's one: each parallelism it has, its schedules, precisions,
# recomputation and learning-rate schedules.
HEADER = 'import "clusters/dgx_h100"\nimport "models/llama3"\n'
VARIANTS = {
    "fsdp_tp_pp_interleaved": """plan fsdp_tp_pp_interleaved {
  model = llama3_8b
  cluster = dgx_h100 x 1
  mesh = [pp = 2, dp = 2, tp = 2]
  train = { global_batch: 16, micro_batch: 1, precision: bf16, recompute: selective_op, lr: 1e-4, loss: fused }
  data = zero3 over dp with gather = bf16
  tensor = megatron over tp with sequence_parallel
  stages = evenly over pp with virtual = 2
  schedule = interleaved_1f1b
}""",
    "context_bf16_everywhere": """plan context_bf16_everywhere {
  model = llama3_8b
  cluster = dgx_h100 x 1
  mesh = [dp = 4, cp = 2]
  train = { global_batch: 32, micro_batch: 2, seq: 32768, precision: bf16, master_dtype: bf16, grad_dtype: bf16,
            optimizer_dtype: bf16, recompute: full, lr_schedule: linear, warmup_steps: 100 }
  data = zero3 over dp
  context = ring over cp with implementation = torch
}""",
    "debug_gpipe_replicate": """plan debug_gpipe_replicate {
  model = llama(layers=6, hidden=256, heads=16, ffn=768, seq=2048, vocab=2048)
  cluster = dgx_h100 x 1
  mesh = [pp = 2, replica = 2, shard = 1]
  train = { global_batch: 16, micro_batch: 2, precision: fp32, lr: 8e-4, lr_schedule: cosine, warmup_steps: 2,
            grad_clip: none, seed: 3 }
  data = hsdp over [replica, shard]
  stages = evenly over pp
  schedule = gpipe
}""",
    "llama3_70b_zbv_tp": """plan llama3_70b_zbv_tp {
  model = llama3_70b
  cluster = dgx_h100 x 8
  mesh = [pp = 4, dp = 2, tp = 8]
  train = { global_batch: 32, micro_batch: 1, precision: bf16, recompute: full }
  data = zero3 over dp with gather = bf16
  tensor = megatron over tp
  stages = evenly over pp with virtual = 2, map = vshape
  schedule = zbv
}""",
    "async_tp": """plan async_tp {
  model = llama3_70b
  cluster = dgx_h100 x 4
  mesh = [dp = 4, tp = 8]
  train = { global_batch: 32, micro_batch: 2, precision: bf16, recompute: full }
  data = zero3 over dp with gather = bf16
  tensor = megatron over tp with sequence_parallel, overlap
}""",
    "eager_fsdp": """plan eager_fsdp {
  model = llama3_8b
  cluster = dgx_h100 x 1
  mesh = [dp = 8]
  train = { global_batch: 16, micro_batch: 1, precision: bf16, kernels: eager, recompute: full }
  data = zero3 over dp with gather = bf16
}""",
}


@functools.cache
def variant(name: str):
    return api.select_plan(api.loads(HEADER + VARIANTS[name] + "\n", path=f"{name}.plan"))


def plans():
    """(name, plan) of every plan torchtitan expresses whole: the stdlib's, then the variants."""
    return [(p.values[1], stdlib_plan(*p.values)) for p in WHOLE] + [(n, variant(n)) for n in VARIANTS]


def _words(text: str) -> list[str]:
    """The exported arguments as torchrun hands them to torchtitan (the bash array's words)."""
    return [w for w in shlex.split(text, comments=True) if w not in ("TORCHTITAN_ARGS=(", ")")]


def test_torchtitan_expresses_exactly_the_llama3_flavor_plans():
    whole = {name for path, name in (p.values for p in ALL) if not export_plan(stdlib_plan(path, name), "torchtitan").lost}
    assert whole == EXPRESSED
    assert all(not export_plan(variant(name), "torchtitan").lost for name in VARIANTS)


@pytest.mark.parametrize("name", [*EXPRESSED, *VARIANTS])
def test_exported_arguments_match_golden(name, golden):
    plan = dict(plans())[name]
    golden(f"interop/torchtitan/{name}.args", export_plan(plan, "torchtitan").text)


@pytest.mark.parametrize("name", [*EXPRESSED, *VARIANTS])
def test_import_of_the_export_is_the_plan(name):
    plan = dict(plans())[name]
    exported = export_plan(plan, "torchtitan")
    imported = import_text("torchtitan", exported.text, "plan.args", world_size=plan.mesh.size, name=plan.name)
    assert imported.ok, api.render_all(imported.diagnostics, imported.sources)
    back = api.select_plan(api.loads(imported.text, path="back.plan"))
    assert export_plan(back, "torchtitan").text == exported.text
    assert (back.dp, back.tp, back.pp, back.cp, back.data.kind) == (plan.dp, plan.tp, plan.pp, plan.cp, plan.data.kind)
    assert back.train.model_dump(exclude={"seq"}) == plan.train.model_dump(exclude={"seq"}) and back.seq == plan.seq


def test_compile_is_the_plans_kernels_both_ways():
    fused, eager = variant("fsdp_tp_pp_interleaved"), variant("eager_fsdp")
    assert "--compile.enable" in _words(export_plan(fused, "torchtitan").text)
    assert "--compile.enable" not in _words(export_plan(eager, "torchtitan").text)
    flags = "--module llama3 --config llama3_8b --parallelism.data_parallel_shard_degree 8 {}"
    for extra, kernels in (("", "eager"), ("--compile.enable", None), ("--compile.enable --compile.components loss",
                                                                       "eager"),
                           ("--compile.enable --compile.components model,loss", None),
                           ("--compile.no-enable", "eager"),
                           # the backend compiles the loss alone: the blocks run eager whatever it is
                           ("--compile.enable --compile.components loss --compile.backend aot_eager", "eager")):
        imported = import_text("torchtitan", flags.format(extra), "args.sh", world_size=8)
        assert imported.ok, (extra, imported.diagnostics)
        assert (f"kernels: {kernels}" in imported.text) if kernels else ("kernels" not in imported.text), extra
    materialized = api.select_plan(api.loads(HEADER + VARIANTS["eager_fsdp"].replace("kernels: eager",
                                                                                     "attention: materialized")
                                             + "\n", path="m.plan"))
    lost = export_plan(materialized, "torchtitan").lost
    assert [d.code for d in lost] == ["E808"] and "attention: materialized" in lost[0].message


def test_async_tp_is_the_plans_tensor_overlap_both_ways():
    """--compile.enable_async_tensor_parallel is `tensor ... with overlap`; torchtitan refuses it without compiling
    the model (E805), and a plan's overlap needs sequence parallelism (E807, the checker's E417)."""
    assert "--compile.enable_async_tensor_parallel" in _words(export_plan(variant("async_tp"), "torchtitan").text)
    assert "--compile.enable_async_tensor_parallel" not in _words(export_plan(variant("fsdp_tp_pp_interleaved"),
                                                                              "torchtitan").text)
    flags = ("--module llama3 --config llama3_8b --parallelism.data_parallel_shard_degree 2 "
             "--parallelism.tensor_parallel_degree 4 {}")
    imported = import_text("torchtitan", flags.format("--compile.enable --compile.enable_async_tensor_parallel"),
                           "args.sh", world_size=8)
    assert imported.ok and "megatron over tp with sequence_parallel, overlap\n" in imported.text  # async TP's
    userbuffers = api.select_plan(api.loads(imported.text.replace(", overlap\n", ", overlap = userbuffers\n"),
                                            path="ub.plan"))
    exported = export_plan(userbuffers, "torchtitan")  # Transformer Engine's userbuffers: no torchtitan flag
    assert "--compile.enable_async_tensor_parallel" not in _words(exported.text)
    assert [d.code for d in exported.lost] == ["E808"] and "overlap = userbuffers" in exported.lost[0].message
    # Megatron-LM's tensor parallelism (shards saved) is no torchtitan run's: lost, not exported as torch's silently
    stacked = api.select_plan(api.loads(imported.text.replace(", overlap\n", ", implementation = megatron\n"),
                                        path="stack.plan"))
    lost = export_plan(stacked, "torchtitan").lost
    assert [d.code for d in lost] == ["E808"] and "implementation = megatron" in lost[0].message
    without_sp = "--compile.enable --compile.enable_async_tensor_parallel --parallelism.no_enable_sequence_parallel"
    for extra, code in (("--compile.enable_async_tensor_parallel", "E805"),
                        ("--compile.enable --compile.components loss --compile.enable_async_tensor_parallel", "E805"),
                        (without_sp, "E807")):
        found = import_text("torchtitan", flags.format(extra), "args.sh", world_size=8)
        assert [d.code for d in found.diagnostics] == [code], (extra, found.diagnostics)
        assert "enable_async_tensor_parallel" in found.diagnostics[0].message


def test_what_torchtitan_cannot_express_is_listed():
    plan = stdlib_plan(next(p.values[0] for p in ALL if p.values[1] == "gpt3_megatron"), "gpt3_megatron")
    lost = [d.message.removeprefix("torchtitan cannot express ").split(" (")[0] for d in
            export_plan(plan, "torchtitan").lost]
    assert lost == ["a gpt(...) model", "the mesh order [dp(dp_shard), pp(pp), tp(tp)]", "data = zero1"]


def test_a_model_of_no_flavor_is_named_with_the_flavors():
    plan = stdlib_plan(next(p.values[0] for p in ALL if p.values[1] == "llama2_7b_fsdp"), "llama2_7b_fsdp")
    message = export_plan(plan, "torchtitan").lost[0].message
    assert "llama(layers=32, hidden=4096, heads=32, kv_heads=32, ffn=11008, vocab=32000)" in message
    assert "llama3_8b (8B)" in message and "llama3_70b (70B)" in message


BASE = ["--module", "llama3", "--config", "llama3_8b", "--parallelism.tensor_parallel_degree", "2"]


@pytest.mark.parametrize("extra, code, offending", [
    (["--parallelism.tensor_parallel_dgree", "2"], "E804", "--parallelism.tensor_parallel_dgree"),
    (["--training.local_batch_size", "x"], "E804", "x"),
    (["--config", "llama3_405b"], "E807", "llama3_405b"),
    (["--parallelism.pipeline_parallel_degree", "3"], "E806", "--parallelism.pipeline_parallel_degree"),
    (["--parallelism.tensor_parallel_degree", "4"], "E805", "--parallelism.tensor_parallel_degree"),
    (["--parallelism.expert_parallel_degree", "2"], "E807", "--parallelism.expert_parallel_degree"),
    (["--parallelism.pipeline_parallel_degree", "2", "--parallelism.module_fqns_per_model_part",
      "tok_embeddings,layers.0", "layers.2,norm,lm_head"], "E805", "--parallelism.module_fqns_per_model_part"),
    (["--lr_scheduler.decay_type", "sqrt"], "E807", "--lr_scheduler.decay_type"),
    (["activation-checkpoint:memory-budget"], "E807", "activation-checkpoint:memory-budget"),
    (["--parallelism.pipeline_parallel_schedule_csv", "mine.csv"], "E807",
     "--parallelism.pipeline_parallel_schedule_csv"),
    (["--parallelism.pipeline_parallel_degree", "2", "--training.global_batch_size", "64"], "E807",
     "--training.global_batch_size"),
    (["--module", "qwen3"], "E807", "qwen3"),
    (["--training.disable_cuda_graphs", "stray"], "E804", "stray"),
    (["--parallelism.data_parallel_shard_degree", "-2"], "E804", "-2"),
    (["--parallelism.data_parallel_shard_degree", "\u0668"], "E804", "'\u0668'"),  # an Arabic-Indic 8, read as 8
    (["--debug.seed", "1" + "0" * 5000], "E804", "1" + "0" * 5000),  # int()'s own words, a usage error
    (["--training.enable_cpu_offload"], "E807", "--training.enable_cpu_offload"),
    (["--parallelism.enable_fsdp_symm_mem"], "E807", "--parallelism.enable_fsdp_symm_mem"),
    (["--parallelism.context_parallel_load_balancer", "None"], "E807", "--parallelism.context_parallel_load_balancer"),
    (["--compile.enable", "--compile.backend", "aot_eager"], "E807", "--compile.backend"),
    (["--parallelism.context_parallel_load_balancer", "roundrobin"], "E807",
     "--parallelism.context_parallel_load_balancer"),
    (["--optimizer.param_groups.0.optimizer_name", "DistMuon"], "E807", "--optimizer.param_groups.0.optimizer_name"),
    (["activation-checkpoint:selective", "--activation-checkpoint.force-recompute-mm-shapes-by-fqns", "wo"], "E807",
     "--activation-checkpoint.force-recompute-mm-shapes-by-fqns"),
    (["--debug.batch_invariant"], "E805", "--debug.batch_invariant"),
    (["--parallelism.pipeline_parallel_degree", "2", "--debug.spmd-typechecking"], "E805", "--debug.spmd-typechecking"),
    (["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_layers_per_stage", "3"], "E805",
     "--parallelism.pipeline_parallel_layers_per_stage"),
])
def test_bad_flags_are_diagnostics_naming_the_flag(extra, code, offending):
    text = shlex.join(BASE + extra) + "\n"
    imported = import_text("torchtitan", text, "<flags>", world_size=8)
    assert [d.code for d in imported.diagnostics] == [code], api.render_all(imported.diagnostics, imported.sources)
    span = imported.diagnostics[0].span
    assert text[span.start:span.end] == offending


def test_a_typo_is_named_with_the_nearest_flag():
    imported = import_text("torchtitan", shlex.join(BASE + ["--training.seq-lenn", "4096"]), "<flags>", world_size=8)
    assert "did you mean '--training.seq_len'" in (imported.diagnostics[0].hint or "")


def test_a_bare_config_is_read_with_its_own_values():
    """The config function's defaults fill what the flags leave out: llama3_70b's tensor degree 8 and full
    checkpointing, its local batch of 8 sequences of 8192 tokens, dp_shard the leftover ranks."""
    imported = import_text("torchtitan", "--module llama3 --config llama3_70b --lr_scheduler.warmup_steps 0\n",
                           "<flags>", world_size=64)
    assert imported.ok, api.render_all(imported.diagnostics, imported.sources)
    plan = api.select_plan(api.loads(imported.text, path="back.plan"))
    assert (plan.tp, plan.dp, plan.data.kind, plan.train.recompute.value) == (8, 8, "zero3", "full")
    assert (plan.train.global_batch, plan.train.micro_batch, plan.seq, plan.train.lr) == (64, 8, 8192, 1.5e-4)
    assert plan.tensor.sequence_parallel and torchtitan.config_of(plan.model) == "llama3_70b"


def test_default_split_counts_the_embedding_and_the_output_as_a_block_each():
    # 6 blocks + 2 over 4 stages: 2 each, the embedding and the output taking one block's place
    assert default_split(4, 6) == [["tok_embeddings", "layers.0"], ["layers.1", "layers.2"], ["layers.3", "layers.4"],
                                   ["layers.5", "norm", "lm_head"]]
    assert default_split(8, 2) is None


def test_cli_export_refuses_a_lossy_plan_and_imports_flags(tmp_path):
    runner = CliRunner()
    path = next(p.values[0] for p in ALL if p.values[1] == "gpt3_megatron")
    result = runner.invoke(main, ["export", path, "--to", "torchtitan"])
    assert result.exit_code == 1 and "E808" in result.output and "nothing written" in result.output
    result = runner.invoke(main, ["export", path, "--to", "torchtitan", "--lossy", "-o", str(tmp_path / "t.args")])
    assert result.exit_code == 0 and "lost: torchtitan cannot express data = zero1" in result.output
    result = runner.invoke(main, ["import", "--from", "torchtitan", "--world-size", "16", "-o",
                                  str(tmp_path / "titan.plan"), "--", *BASE, "activation-checkpoint:none"])
    assert result.exit_code == 0, result.output
    text = (tmp_path / "titan.plan").read_text()
    assert "mesh    = [dp = 8, tp = 2]" in text and "recompute: none" in text and "Left out" not in text


# ---- against torchtitan's own code -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def titan():
    """torchtitan's ConfigManager, ParallelDims and the llama3 config functions, imported once (~5-10 s)."""
    pytest.importorskip("tyro", reason="torchtitan is not installed (.ci/run installs it: README)")
    pytest.importorskip("torchtitan", reason="torchtitan is not installed (.ci/run installs it: README)")
    import importlib.metadata
    import logging

    from torchtitan.config.manager import ConfigManager
    from torchtitan.distributed import pipeline_parallel
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.models.llama3 import config_registry
    assert importlib.metadata.version("torchtitan") == "0.3.0"
    logging.getLogger("torchtitan").setLevel(logging.ERROR)   # "HF assets path ... does not exist"
    return ConfigManager, ParallelDims, config_registry, pipeline_parallel


def _parse(titan, words: list[str]):
    return titan[0]().parse_args(words)


@pytest.mark.slow
@pytest.mark.parametrize("name", [*EXPRESSED, *VARIANTS])
def test_config_manager_parses_the_export_into_the_plan(titan, name):
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    plan = dict(plans())[name]
    config = _parse(titan, _words(export_plan(plan, "torchtitan").text))
    parallel = config.parallelism
    dims = titan[1].from_config(parallel, plan.mesh.size)   # its own check: the degrees multiply to the world
    assert dims.dp_replicate * dims.dp_shard * dims.cp * dims.tp * dims.pp == plan.mesh.size
    assert (dims.dp_replicate * dims.dp_shard, dims.tp, dims.pp, dims.cp, dims.ep) == (plan.dp, plan.tp, plan.pp,
                                                                                       plan.cp, 1)
    assert dims.dp_shard == (1 if plan.data.kind == "replicate" else plan.mesh.degree(plan.data.axes[-1]))
    assert parallel.enable_sequence_parallel == (plan.tensor is None or plan.tensor.sequence_parallel)
    assert config.training.seq_len == plan.seq and config.training.global_batch_size == plan.train.global_batch
    assert config.model_spec.flavor == torchtitan.CONFIGS[torchtitan.config_of(plan.model)].flavor
    recompute = {"none": type(None), "selective_op": SelectiveAC.Config, "full": FullAC.Config}
    assert type(config.activation_checkpoint) is recompute[plan.train.recompute.value]
    assert config.optimizer.param_groups[0].optimizer_kwargs["lr"] == plan.train.lr
    # torch.compile over the model: the fused element-wise kernels a plan is costed with by default
    assert (config.compile.enable and "model" in config.compile.components) == (plan.train.kernels.value == "fused")
    assert config.compile.enable_async_tensor_parallel == bool(plan.tensor and plan.tensor.overlap)  # async TP
    # the chunked loss a plan's `loss: fused` is, or the whole fp32 cross entropy of `loss: standard`
    assert config.loss.num_chunks == (torchtitan.CHUNKS if plan.train.loss.value == "fused" else 1)
    if plan.pp > 1:
        from plandsl.ir.placement import assign_stages
        assignment, _ = assign_stages(plan)
        names = {"embed": "tok_embeddings", "head": "lm_head"}
        assert parallel.module_fqns_per_model_part == [[names.get(layer.name, layer.name) for layer in stage]
                                                       for stage in assignment.stage_layers]
        # torchtitan's stage -> rank placement (round robin, V-shape for ZBV and DualPipeV) is the plan's
        ranks = [titan[3]._get_pp_rank_to_stage_indices_mapping(rank, plan.pp, parallel.pipeline_parallel_schedule,
                                                                 assignment.num_stages) for rank in range(plan.pp)]
        assert tuple(tuple(sorted(stages)) for stages in ranks) == assignment.rank_stages()
        schedule = titan[3].get_schedule_class(parallel.pipeline_parallel_schedule)
        assert schedule.__name__ == f"Schedule{parallel.pipeline_parallel_schedule}"
        assert config.training.local_batch_size // parallel.pipeline_parallel_microbatch_size == \
            plan.num_microbatches
    else:
        assert config.training.local_batch_size == plan.train.micro_batch


@pytest.mark.slow
def test_the_flavor_table_and_defaults_are_torchtitans(titan):
    """CONFIGS (the registry's model sizes) and the import's defaults are what the config functions build."""
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    modes = {SelectiveAC.Config: "selective", FullAC.Config: "full", type(None): "none"}
    for name, flavor in torchtitan.CONFIGS.items():
        config = getattr(titan[2], name)()
        model = config.model_spec.model
        attention, ffn = model.layers[0].attention, model.layers[0].feed_forward
        found = (config.model_spec.flavor, len(model.layers), model.dim, attention.n_heads,
                 attention.n_kv_heads or attention.n_heads, ffn.w1.out_features, model.vocab_size,
                 bool(getattr(model, "enable_weight_tying", False)))
        assert found == (flavor.flavor, flavor.layers, flavor.hidden, flavor.heads, flavor.kv_heads, flavor.ffn,
                         flavor.vocab, flavor.tied), name
        read = {
            "--parallelism." + key: getattr(config.parallelism, key) for key in (
                "data_parallel_replicate_degree", "data_parallel_shard_degree", "tensor_parallel_degree",
                "context_parallel_degree", "pipeline_parallel_degree", "expert_parallel_degree",
                "enable_sequence_parallel", "pipeline_parallel_schedule", "pipeline_parallel_microbatch_size")}
        read |= {"--training." + key: getattr(config.training, key) for key in (
            "local_batch_size", "global_batch_size", "seq_len", "max_norm", "mixed_precision_param", "dtype")}
        read |= {"--lr_scheduler." + key: getattr(config.lr_scheduler, key) for key in (
            "warmup_steps", "decay_ratio", "decay_type", "min_lr_factor")}
        read |= {torchtitan.LOSS_CHUNKS: config.loss.num_chunks}   # ChunkedLossWrapper's
        read |= {"--debug.seed": config.debug.seed, torchtitan.LR: config.optimizer.param_groups[0].optimizer_kwargs["lr"],
                 "activation": modes[type(config.activation_checkpoint)]}
        assert {key: {**DEFAULTS, **CONFIG_DEFAULTS[name]}.get(key) for key in read} == read, name


@pytest.mark.slow
def test_default_split_is_torchtitans(titan):
    for stages in range(2, 9):
        for layers in range(1, 20):
            try:
                theirs = titan[3]._generate_llm_fqn_per_model_part(stages, layers)
            except ValueError:
                theirs = None
            assert default_split(stages, layers) == theirs, (stages, layers)


# ---- docs/interop.md's torchtitan section: its commands run and write what it shows ---------------------------
def test_the_interop_doc_torchtitan_commands_run_as_shown(tmp_path, monkeypatch):
    import re
    from pathlib import Path
    doc = (Path(__file__).resolve().parents[2] / "docs" / "interop.md").read_text(encoding="utf-8")
    section = doc[doc.index("## torchtitan"):doc.index("## torch's pipeline schedule CSV")]
    (_, args), (_, commands), (_, plan) = re.findall(r"```(\w+)\n(.*?)```", section, re.DOTALL)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "titan_args.sh").write_text(args, encoding="utf-8")
    runner = CliRunner()
    for line in commands.strip().splitlines():
        result = runner.invoke(main, shlex.split(line)[1:])
        assert result.exit_code == 0, f"{line}\n{result.output}"
    assert (tmp_path / "llama3_8b_titan.plan").read_text(encoding="utf-8") == plan
    back = _words((tmp_path / "titan_args_back.sh").read_text(encoding="utf-8"))
    assert "--parallelism.data_parallel_shard_degree" in back and back[-1] == "activation-checkpoint:selective"


def test_torchtitans_context_parallelism_is_torchs_ring():
    """torchtitan runs torch's context_parallel, a ring whose K and V are all-gathered once per pass and whose outputs
    and gradients are merged step by step: `ring ... with implementation = torch` exports as its degree and imports
    back as it; the all-gather core (Megatron's, Llama 3's) and Transformer Engine's ring are other algorithms: E808."""
    plan = variant("context_bf16_everywhere")
    exported = export_plan(plan, "torchtitan")
    assert not exported.lost and "--parallelism.context_parallel_degree 2" in exported.text.replace("=", " ")
    back = import_text("torchtitan", exported.text, "plan.toml" if exported.text.lstrip().startswith("[") else
                       "plan.args", world_size=8, cluster="dgx_h100 x 1", name="p")
    context = api.select_plan(api.loads(back.text, path="back.plan")).context
    assert (context.kind, context.implementation) == ("ring", "torch")
    for other in ("context = allgather over cp", "context = ring over cp"):
        text = VARIANTS["context_bf16_everywhere"].replace("context = ring over cp with implementation = torch", other)
        lost = export_plan(api.select_plan(api.loads(HEADER + text + "\n", path="o.plan")), "torchtitan").lost
        assert [d.code for d in lost] == ["E808"] and "implementation = torch" in lost[0].hint


@pytest.mark.parametrize("name", [*EXPRESSED, *VARIANTS])
def test_import_gathers_in_the_mixed_precision_param(name):
    """torchtitan's FSDP2 and HSDP gather the fp32 shards in --training.mixed_precision_param (MixedPrecisionPolicy's
    param_dtype): an imported bf16 plan over fp32 weights says `gather = bf16`, so that it counts no autocast copies
    (`cost.memory.holds_autocast_copies`) and `plandsl run` gathers as torchtitan does; DDP and bf16 weights gather
    nothing of their own."""
    plan = dict(plans())[name]
    imported = import_text("torchtitan", export_plan(plan, "torchtitan").text, "plan.args",
                           world_size=plan.mesh.size, name=plan.name)
    back = api.select_plan(api.loads(imported.text, path="back.plan"))
    sharded = back.data.kind in (ir.DataKind.zero3, ir.DataKind.hsdp)
    mixed = back.train.precision is ir.Precision.bf16 and back.train.weights_dtype is ir.Precision.fp32
    assert back.data.gather is (ir.Precision.bf16 if sharded and mixed else None)


# ---- torchtitan 0.3.0 runs FSDP2 at every data-parallel degree ------------------------------------------------
D8 = "--module llama3 --config llama3_debugmodel --lr_scheduler.decay_ratio 0.0 "
PP2 = "--parallelism.pipeline_parallel_degree 2 --training.disable_cuda_graphs "


def _fsdp_probe(rank: int, world: int, runs: list[list[str]]) -> list[list]:
    """torchtitan's FSDP param group of block 0 under each of `runs`' flags: mesh info's type, mesh shape, param
    dtype. Run in a process forked from this worker (`fsdp_groups`), which has torchtitan imported (`titan`)."""
    import logging

    import torch
    import torch.distributed as dist
    from torchtitan.distributed import parallel_dims
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torchtitan.config.manager import ConfigManager
    from torchtitan.models.llama3.parallelize import parallelize_llama
    logging.getLogger("torchtitan").setLevel(logging.ERROR)
    parallel_dims.device_type = "cpu"   # the mesh on this machine's CPU (torchtitan picks cuda where torch has it)
    found = []
    for args in runs:  # each configuration on a fresh fake process group
        config = ConfigManager().parse_args(args)
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        dims = parallel_dims.ParallelDims.from_config(config.parallelism, world)
        dims.build_mesh()
        with torch.device("meta"):
            model = config.model_spec.model.build()
        parallelize_llama(model, parallel_dims=dims, training=config.training, parallelism=config.parallelism,
                          compile_config=config.compile, ac_config=None, dump_folder="")
        group = model.layers["0"]._get_fsdp_state()._fsdp_param_group
        found.append([type(group.mesh_info).__name__, list(group.mesh_info.mesh.shape),
                      str(group.mp_policy.param_dtype)])
        dist.destroy_process_group()
    return found


DATA_LINES = [
    ("--parallelism.data_parallel_replicate_degree 8 --parallelism.data_parallel_shard_degree 1", "hsdp", 1),
    ("--parallelism.tensor_parallel_degree 8", "zero3", 1),
    ("--parallelism.data_parallel_replicate_degree 2 --parallelism.data_parallel_shard_degree 4", "hsdp", 4),
    ("--parallelism.data_parallel_shard_degree 8", "zero3", 8),
]


@pytest.fixture(scope="module")
def fsdp_groups(titan):
    """torchtitan's FSDP param group of block 0 (mesh info's type, mesh shape, param dtype) under each of DATA_LINES'
    flags, from one process forked from this worker (`harness.run_ranks`: the fake process group and torchtitan's CPU
    device stay out of the test's). Forked, it starts with torch and torchtitan imported (`titan`): a child
    interpreter imported them again, ~10 CPU-s."""
    from tests.distributed.harness import run_ranks
    runs = [shlex.split(D8 + flags) + ["--parallelism.spmd_backend", "partial_dtensor"] for flags, _, _ in DATA_LINES]
    [found] = run_ranks(1, _fsdp_probe, 8, runs, deadline_s=80)
    assert len(found) == len(DATA_LINES), found
    return {flags: found_ for (flags, _, _), found_ in zip(DATA_LINES, found)}


@pytest.mark.slow
@pytest.mark.parametrize("flags, kind, shard", DATA_LINES)
def test_the_data_line_is_the_fsdp2_torchtitan_applies(fsdp_groups, flags, kind, shard):
    """torchtitan's own parallelize_llama, on a fake 8-rank process group, wraps every block with fully_shard and
    a bf16 MixedPrecisionPolicy at every data-parallel degree: dp_replicate alone is HSDP over a shard of 1, no
    data parallelism FSDP over a mesh of 1 (parallelize.py:69-90). The import says the same: hsdp or zero3 with
    `gather = bf16`, never replicate or no data line (which would count autocast copies torchtitan never holds).
    The legacy partial_dtensor backend, whose FSDP mesh is torch's alone (the default spmd_types backend takes the
    same fully_shard call, parallelize.py:71-90, with its parameters annotated on a device)."""
    mesh_info, shape, param_dtype = fsdp_groups[flags]
    assert mesh_info == ("HSDPMeshInfo" if kind == "hsdp" else "FSDPMeshInfo") and shape[-1] == shard
    assert param_dtype == "torch.bfloat16"
    imported = import_text("torchtitan", D8 + flags, "args.sh", world_size=8)
    assert imported.ok, api.render_all(imported.diagnostics, imported.sources)
    plan = api.select_plan(api.loads(imported.text, path="back.plan"))
    assert (plan.data.kind.value, plan.mesh.degree(plan.data.axes[-1]), plan.data.gather) == \
        (kind, shard, ir.Precision.bf16)
    if kind == "hsdp":
        assert plan.mesh.degree(plan.data.axes[0]) == shape[0]


def test_dp_replicate_alone_counts_no_autocast_copies():
    """The known bug: dp_replicate 8 with dp_shard 1 was imported as `replicate` (DDP), whose bf16 compute over
    fp32 weights holds autocast's 2-byte copy of every weight; torchtitan gathers bf16 copies unit by unit
    instead. The imported plan holds no autocast copies, and its memory is below the DDP reading's by at least
    those copies less the gathered units."""
    from plandsl.cost.memory import autocast_weight_copies, holds_autocast_copies
    from plandsl.ir.placement import assign_stages
    imported = import_text("torchtitan", D8 + "--parallelism.data_parallel_replicate_degree 8 "
                           "--parallelism.data_parallel_shard_degree 1", "args.sh", world_size=8)
    assert imported.ok, api.render_all(imported.diagnostics, imported.sources)
    assert "data    = hsdp over [dp_replicate, dp_shard] with gather = bf16" in imported.text
    plan = api.select_plan(api.loads(imported.text, path="back.plan"))
    assert not holds_autocast_copies(plan)
    ddp = api.select_plan(api.loads(imported.text.replace("hsdp over [dp_replicate, dp_shard] with gather = bf16",
                                                          "replicate over dp_replicate"), path="ddp.plan"))
    assert holds_autocast_copies(ddp)
    layers = [layer for stage in assign_stages(ddp)[0].stage_layers for layer in stage]
    assert autocast_weight_copies(ddp, layers) > 0
    ours, theirs = api.estimate(plan).memory[0], api.estimate(ddp).memory[0]
    assert theirs.activations - ours.activations == autocast_weight_copies(ddp, layers)  # the copies, exactly
    assert ours.gathered_params > 0 and theirs.gathered_params == 0   # FSDP2's bf16 units in their place


def test_the_export_says_what_torchtitans_fsdp_is_not():
    """A plan's replicate (or no data line) and a bf16 plan over fp32 weights that gathers its units at their fp32
    dtype are not what torchtitan runs: E808, with the data line that is."""
    base = """plan small {
  model = llama(layers=6, hidden=256, heads=16, ffn=768, seq=2048, vocab=2048)
  cluster = dgx_h100 x 1
  mesh = [dp = 8]
  train = { global_batch: 16, micro_batch: 2, precision: bf16, recompute: full }
  data = zero3 over dp with gather = bf16
}"""
    assert not export_plan(api.select_plan(api.loads(HEADER + base + "\n", path="x.plan")), "torchtitan").lost
    for old, new, said in (("zero3 over dp with gather = bf16", "replicate over dp", "data = replicate"),
                           ("zero3 over dp with gather = bf16", "zero3 over dp", "without `gather = bf16`"),
                           ("mesh = [dp = 8]\n  train", "mesh = [tp = 8]\n  tensor = megatron over tp\n  train",
                            "no data line")):
        text = base.replace(old, new)
        if said == "no data line":
            text = text.replace("  data = zero3 over dp with gather = bf16\n", "")
        lost = export_plan(api.select_plan(api.loads(HEADER + text + "\n", path="x.plan")), "torchtitan").lost
        assert [d.code for d in lost] == ["E808"] and said in lost[0].message, (said, lost)


@pytest.mark.parametrize("extra, ok", [
    ("--parallelism.fsdp_reshard_after_forward always", True),            # off a pipeline: the default
    ("--parallelism.fsdp_reshard_after_forward never", False),
    (PP2 + "--parallelism.fsdp_reshard_after_forward never", True),  # under a pipeline: the default
    (PP2 + "--parallelism.fsdp_reshard_after_forward always", False),
    (PP2.replace("--training.disable_cuda_graphs ", ""), False),   # Trainer.Config: CUDA graphs refuse a pipeline
])
def test_the_reshard_policy_is_read_where_a_plan_says_it(extra, ok):
    """fsdp.py's get_fsdp_reshard_after_forward_policy: default reshards after the forward but under a pipeline,
    as a plan's ZeRO-3 does; the other two are E807 where they differ from it. A pipeline needs CUDA graphs off."""
    imported = import_text("torchtitan", D8 + extra, "args.sh", world_size=4)
    assert imported.ok == ok, api.render_all(imported.diagnostics, imported.sources)
    if not ok:
        code, flag = ("E807", "fsdp_reshard_after_forward") if "reshard" in extra else ("E805", "disable_cuda_graphs")
        assert [d.code for d in imported.diagnostics] == [code] and flag in imported.diagnostics[0].message


@pytest.mark.slow
def test_every_flag_torchtitan_accepts_is_read(titan):
    """No flag torchtitan 0.3.0's ConfigManager accepts for a llama3 config (its own --help, the activation
    checkpointing subcommands' too) is unknown to the import: each is read into the plan, refused with E807 where a
    plan has no word for it, or listed as left out."""
    import contextlib
    import io
    import re

    from plandsl.interop.torchtitan_import import IGNORED, IGNORED_SECTIONS, KNOWN, SWITCHES, _name
    found = set()
    for mode in ("", "activation-checkpoint:selective", "activation-checkpoint:full"):
        text = io.StringIO()
        with contextlib.redirect_stdout(text), pytest.raises(SystemExit):
            _parse(titan, ["--module", "llama3", "--config", "llama3_8b", *([mode] if mode else []), "--help"])
        found |= set(re.findall(r"(--[a-z][a-z_.0-9-]+)", text.getvalue()))
    assert "--training.mixed-precision-reduce" in found and "--parallelism.fsdp-reshard-after-forward" in found
    unread = sorted(flag for flag in found - {"--help"} if _name(flag) not in {*KNOWN, *IGNORED, *SWITCHES}
                    and not (_name(flag).startswith(IGNORED_SECTIONS)))
    assert unread == []


@pytest.mark.slow
@pytest.mark.parametrize("extra", [
    "--parallelism.pipeline_parallel_layers_per_stage 2",
    "--parallelism.pipeline_parallel_layers_per_stage 4 --parallelism.pipeline_parallel_schedule 1F1B "
    "--parallelism.pipeline_parallel_first_stage_less_layers 0",
    "--parallelism.pipeline_parallel_first_stage_less_layers 2 --parallelism.pipeline_parallel_last_stage_less_layers 0",
    "--parallelism.pipeline_parallel_schedule GPipe --parallelism.pipeline_parallel_last_stage_less_layers 2",
])
def test_the_pipeline_split_is_torchtitans(titan, extra):
    """pipeline_parallel_layers_per_stage and the first and last stages' less layers give torchtitan's stages
    (_get_pipeline_metadata, _generate_llm_fqn_per_model_part), block for block."""
    from plandsl.ir.placement import assign_stages
    words = shlex.split(D8 + "--parallelism.pipeline_parallel_degree 2 --training.disable_cuda_graphs " + extra)
    config = _parse(titan, words)
    dims = titan[1].from_config(config.parallelism, 4)
    stages, layers, first, last = titan[3]._get_pipeline_metadata(dims, config.parallelism, config.model_spec.model)
    theirs = titan[3]._generate_llm_fqn_per_model_part(stages, layers, first, last)
    imported = import_text("torchtitan", shlex.join(words), "args.sh", world_size=4)
    assert imported.ok, api.render_all(imported.diagnostics, imported.sources)
    plan = api.select_plan(api.loads(imported.text, path="back.plan"))
    names = {"embed": "tok_embeddings", "head": "lm_head"}
    ours = [[names.get(layer.name, layer.name) for layer in stage] for stage in assign_stages(plan)[0].stage_layers]
    assert ours == theirs


@pytest.mark.parametrize("extra, loss", [("", "fused"), ("--loss.num_chunks 4", "fused"), ("--loss.num_chunks 1", "standard")])
def test_the_chunked_loss_is_a_fused_one(extra, loss):
    """The config functions' ChunkedLossWrapper (8 chunks) holds one chunk's logits at a time, about the 2 bytes per
    logit a plan's `loss: fused` counts; one chunk is the whole fp32 cross entropy, `loss: standard` (4 bytes per
    logit kept and two fp32 gradients in the backward)."""
    imported = import_text("torchtitan", D8 + extra, "args.sh", world_size=4)
    assert imported.ok, api.render_all(imported.diagnostics, imported.sources)
    assert api.select_plan(api.loads(imported.text, path="back.plan")).train.loss.value == loss
    megatron = api.select_plan(api.loads(imported.text.replace("  train   = {\n", "  train   = {\n    loss: megatron,\n")
                                         .replace("    loss: fused,\n", ""), path="m.plan"))
    lost = export_plan(megatron, "torchtitan").lost
    assert [d.code for d in lost] == ["E808"] and "loss: megatron" in lost[0].message


@pytest.mark.slow
def test_every_llama3_config_function_is_read_or_refused_with_its_reason(titan):
    """The import reads the three config functions a plan says whole and refuses each other one of 0.3.0's
    config_registry with what a plan cannot say of it (E807): its Float8 is rowwise only (no tensorwise, so no FP8
    all-gather), MXFP8 and NVFP4 are converters of their own."""
    import typing

    from torchtitan.components.quantization import Float8LinearConverter
    names = {name for name in dir(titan[2]) if name.startswith(("llama3_", "sft_")) and callable(getattr(titan[2], name))}
    assert names == set(torchtitan.CONFIGS) | set(torchtitan.OTHER_CONFIGS)
    recipes = typing.get_args(typing.get_type_hints(Float8LinearConverter.Config)["recipe_name"])
    assert set(recipes) == {"rowwise", "rowwise_with_gw_hp"}
    for name, why in torchtitan.OTHER_CONFIGS.items():
        imported = import_text("torchtitan", f"--module llama3 --config {name}", "args.sh", world_size=8)
        assert [d.code for d in imported.diagnostics] == ["E807"] and why in imported.diagnostics[0].message


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["ZBVZeroBubble", "DualPipeV"])
def test_a_v_schedule_runs_two_stages_a_rank(titan, schedule):
    """torchtitan places ZBVZeroBubble's and DualPipeV's stages as a V and asserts two a rank
    (_get_pp_rank_to_stage_indices_mapping): more, from pipeline_parallel_layers_per_stage, is E805; its default,
    two, is read."""
    flags = D8 + PP2 + f"--parallelism.pipeline_parallel_schedule {schedule} "
    with pytest.raises(AssertionError, match="2 stages per rank"):
        titan[3]._get_pp_rank_to_stage_indices_mapping(0, 2, schedule, 8)
    assert titan[3]._get_pp_rank_to_stage_indices_mapping(0, 2, schedule, 4) == (0, 3)
    found = import_text("torchtitan", flags + "--parallelism.pipeline_parallel_layers_per_stage 1", "args.sh",
                        world_size=4)
    assert [d.code for d in found.diagnostics] == ["E805"] and "two stages per rank" in found.diagnostics[0].message
    imported = import_text("torchtitan", flags, "args.sh", world_size=4)
    assert imported.ok, api.render_all(imported.diagnostics, imported.sources)
    assert api.select_plan(api.loads(imported.text, path="v.plan")).stages.rank_map == "vshape"


@pytest.mark.slow
@pytest.mark.parametrize("extra", ["--debug.batch_invariant", PP2 + "--debug.spmd_typechecking",
                                   "--parallelism.pipeline_parallel_degree 2"])
def test_what_torchtitans_config_refuses_is_e805(titan, extra):
    """Trainer.Config refuses batch-invariant mode in pre-training, SPMD typechecking under a pipeline and a pipeline
    with CUDA graphs on; the import says so (E805) rather than write a plan torchtitan would not run."""
    words = shlex.split(D8 + extra)
    with pytest.raises(SystemExit):
        _parse(titan, words)
    imported = import_text("torchtitan", shlex.join(words), "args.sh", world_size=4)
    assert [d.code for d in imported.diagnostics] == ["E805"] and "torchtitan refuses" in imported.diagnostics[0].message


@pytest.mark.parametrize("pp, each, says", [
    ("2", "3", "12 stages over 2 pipeline ranks, 6 a rank, and 1F1B runs one stage per rank"),
    ("4", "1", "34 stages over 4 pipeline ranks, not a whole number a rank"),
])
def test_layers_per_stage_says_which_of_its_two_rules_it_breaks(pp, each, says):
    """torchtitan wants a whole number of stages a rank (pipeline_parallel.py's _get_pipeline_metadata) and, for a
    single-stage schedule, one: the message names the rule broken, not the other."""
    extra = ["--parallelism.pipeline_parallel_degree", pp, "--parallelism.pipeline_parallel_layers_per_stage", each]
    imported = import_text("torchtitan", shlex.join(BASE + extra) + "\n", "<flags>", world_size=8)
    assert [d.code for d in imported.diagnostics] == ["E805"] and says in imported.diagnostics[0].message
