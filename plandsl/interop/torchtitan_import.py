"""torchtitan's command-line arguments (torchtitan 0.3.0) -> a formatted plan that passes `plandsl check`.

Stage: interop, beside render. Contract: `import_flags(text, path, world_size, cluster)` reads the arguments as a
launch script spells them (`interop.flags`; tyro's `-` or `_` in names, the activation checkpointing subcommand
as a word of its own), starting from the values of the `--config` function they name, and returns the plan's
text, or Diagnostics naming the offending flag with a caret under it: E804 (unknown, missing or malformed), E805
(contradictory), E806 (a world size the degrees do not make), E807 (a setting plandsl has no word for); else the
checker's diagnostics on the plan written. It never raises on flags. The facts are `interop.torchtitan`'s.
"""
from __future__ import annotations

import math

from plandsl.diagnostics import diag, did_you_mean
from plandsl.diagnostics.source import SourceFile
from plandsl.interop import torchtitan as facts
from plandsl.interop.cluster import cluster_devices, cluster_lines
from plandsl.interop.flags import Flag, read_flags, shown_value, too_long, whole_number
from plandsl.interop.megatron_import import _Read, stages_lines
from plandsl.interop.result import Imported, checked, left_out

P, T, O = "--parallelism.", "--training.", "--lr_scheduler."
INT_FLAGS = (*facts.DEGREES.values(), facts.EXPERT_DEGREE, P + "pipeline_parallel_microbatch_size",
             T + "local_batch_size", T + "global_batch_size", T + "seq_len", O + "warmup_steps", "--debug.seed",
             facts.LAYERS_PER_STAGE, *facts.LESS_LAYERS, facts.LOSS_CHUNKS)
ZERO_OK = (O + "warmup_steps", "--debug.seed", *facts.LESS_LAYERS)   # integers that may be 0
NEGATIVE_OK = {P + "data_parallel_shard_degree": -1, T + "global_batch_size": -1}   # -1: "the rest" (configs.py)
FLOAT_FLAGS = (T + "max_norm", facts.LR, facts.WEIGHT_DECAY, O + "decay_ratio", O + "min_lr_factor")
CHOICE_FLAGS = {"--module": (facts.MODULE,), "--config": tuple(facts.CONFIGS),
                P + "pipeline_parallel_schedule": (*facts.SCHEDULES.values(), "PipelineScheduleSingle",
                                                   "PipelineScheduleMulti"),
                T + "mixed_precision_param": ("bfloat16", "float32"), T + "dtype": ("bfloat16", "float32"),
                T + "mixed_precision_reduce": ("float32",), O + "decay_type": ("linear", "sqrt", "cosine"),
                facts.RESHARD: ("default", "always", "never"), facts.OPTIMIZER_NAME: ("AdamW", "Adam", "DistMuon"),
                # the same FSDP2 under each (parallelize.py:42-90): read for Trainer.Config's refusals only
                P + "spmd_backend": ("partial_dtensor", "full_dtensor", "spmd_types")}
LIST_FLAGS = (P + "module_fqns_per_model_part", facts.COMPILE_COMPONENTS, facts.FORCE_RECOMPUTE)
TEXT_FLAGS = (P + "pipeline_parallel_schedule_csv", P + "context_parallel_load_balancer", facts.COMPILE_BACKEND)
SWITCHES = {P + "enable_sequence_parallel": True, P + "no_enable_sequence_parallel": False,
            facts.COMPILE: True, facts.COMPILE.replace(".enable", ".no_enable"): False,
            facts.ASYNC_TP: True, facts.ASYNC_TP.replace(".enable", ".no_enable"): False,
            T + "disable_cuda_graphs": True, T + "no_disable_cuda_graphs": False,
            facts.CPU_OFFLOAD: True, facts.CPU_OFFLOAD.replace(".enable", ".no_enable"): False,
            facts.SYMM_MEM: True, facts.SYMM_MEM.replace(".enable", ".no_enable"): False,
            "--debug.batch_invariant": True, "--debug.no_batch_invariant": False,
            "--debug.spmd_typechecking": True, "--debug.no_spmd_typechecking": False}
KNOWN = (*INT_FLAGS, *FLOAT_FLAGS, *CHOICE_FLAGS, *LIST_FLAGS, *TEXT_FLAGS, *SWITCHES)
# Sections and keys of torchtitan's config that mean nothing in a plan (logging, data, checkpoints, compilation,
# the optimizer's other constants): read, listed, left out.
# (--debug.*: determinism, anomaly detection, logging; --activation_checkpoint.*: the policy's RNG state and debug
# switches, which change what is recomputed no more than the mode does.)
IGNORED_SECTIONS = ("--metrics.", "--checkpoint.", "--profiler.", "--comm.", "--dataloader.", "--validator.",
                    "--compile.", "--tokenizer.", "--loss.", "--override.", "--debug.", "--activation_checkpoint.")
IGNORED = ("--dump_folder", "--hf_assets_path", T + "steps", T + "gc_freq", T + "gc_debug", T + "no_gc_debug",
           P + "context_parallel_ptrr_mask_key", O + "total_steps",
           facts.WEIGHT_DECAY, "--optimizer.param_groups.0.optimizer_kwargs.betas",
           "--optimizer.param_groups.0.optimizer_kwargs.eps", "--optimizer.implementation",
           "--optimizer.param_groups.0.pattern")
# What the config functions set that the import reads (config_registry.py; the dataclasses' defaults otherwise).
DEFAULTS = {P + "data_parallel_replicate_degree": 1, P + "data_parallel_shard_degree": -1,
            P + "tensor_parallel_degree": 1, P + "context_parallel_degree": 1, P + "pipeline_parallel_degree": 1,
            facts.EXPERT_DEGREE: 1, P + "enable_sequence_parallel": True, P + "pipeline_parallel_schedule": "1F1B",
            P + "pipeline_parallel_microbatch_size": 1, T + "global_batch_size": -1, T + "max_norm": 1.0,
            T + "mixed_precision_param": "bfloat16", T + "dtype": "float32", O + "warmup_steps": 200,
            O + "decay_ratio": None, O + "decay_type": "linear", O + "min_lr_factor": 0.0, "--debug.seed": None,
            "activation": "selective", facts.COMPILE: False, facts.COMPILE_COMPONENTS: (("model", "loss"),),
            facts.ASYNC_TP: False, facts.COMPILE_BACKEND: "inductor", facts.RESHARD: "default",
            facts.CPU_OFFLOAD: False, facts.SYMM_MEM: False, T + "mixed_precision_reduce": "float32",
            P + "context_parallel_load_balancer": "headtail", facts.OPTIMIZER_NAME: "AdamW",
            facts.LAYERS_PER_STAGE: None, facts.LESS_LAYERS[0]: 1, facts.LESS_LAYERS[1]: 1,
            facts.FORCE_RECOMPUTE: (("moe.router.gate",),), facts.LOSS_CHUNKS: facts.CHUNKS,
            P + "spmd_backend": "spmd_types", "--debug.batch_invariant": False, "--debug.spmd_typechecking": False}
CONFIG_DEFAULTS = {
    "llama3_debugmodel": {P + "pipeline_parallel_schedule": "Interleaved1F1B", T + "local_batch_size": 8,
                          T + "seq_len": 2048, facts.LR: 8e-4, O + "warmup_steps": 2, O + "decay_ratio": 0.8},
    "llama3_8b": {T + "local_batch_size": 1, T + "seq_len": 8192, facts.LR: 3e-4},
    "llama3_70b": {P + "tensor_parallel_degree": 8, T + "local_batch_size": 8, T + "seq_len": 8192,
                   facts.LR: 1.5e-4, "activation": "full"},
}
PLAN_RECOMPUTE = {mode: recompute.value for recompute, mode in facts.RECOMPUTE.items()}
PLAN_SCHEDULE = {torch: name for name, torch in facts.SCHEDULES.items()}


def _name(word: str) -> str:
    """A flag as this module spells it: tyro accepts `-` and `_` alike after `--`."""
    return "--" + word[2:].replace("-", "_") if word.startswith("--") else word


def import_flags(text: str, path: str, world_size: int | None = None, cluster: str | None = None,
                 name: str = "torchtitan", plan_path: str = "torchtitan.plan") -> Imported:
    """The plan torchtitan's arguments `text` (read from `path`) describe, on `world_size` devices of `cluster`
    (default: nodes of 8 H100s); ValueError for a `cluster` that is no cluster (the caller's option)."""
    if cluster is not None:
        cluster_devices(cluster)
    source, flags = read_flags(text, path)
    read = _read(flags, source)
    sources = {path: source}
    if not read.problems:
        plan = _plan_text(read, world_size, cluster, name)
        if plan is not None and not read.problems:
            return checked(plan, plan_path, sources, read.ignored)
    return Imported(None, tuple(read.problems), sources, tuple(read.ignored))


# ---- reading the flags ----------------------------------------------------------------------------------------
def _split_subcommand(flags: list[Flag], source: SourceFile) -> list[Flag]:
    """The activation checkpointing subcommand as a flag of its own (`read_flags` hands a word after a switch to
    the switch as its value)."""
    out: list[Flag] = []
    for flag in flags:
        values = list(flag.values)
        at = next((i for i, v in enumerate(values) if v.startswith(facts.SUBCOMMAND)), None)
        if at is None or not flag.name.startswith("--"):
            out.append(flag)
            continue
        out.append(Flag(flag.name, tuple(values[:at]), flag.span, flag.value_span if at else flag.span))
        # among the flag's values: to the end of the text, the search for one written with quotes or escapes (not
        # found as read) was quadratic in such flags (20,000 took 3 s)
        start = source.text.find(values[at], flag.span.end, flag.value_span.end)
        span = source.span(start, start + len(values[at])) if start >= 0 else flag.value_span
        out.append(Flag(values[at], (), span, span))
        out.extend(Flag(word, (), span, span) for word in values[at + 1:])
    return out


def _read(flags: list[Flag], source: SourceFile) -> _Read:
    read = _Read({}, {}, [], [], source)
    for flag in _split_subcommand(flags, source):
        flag = Flag(_name(flag.name), flag.values, flag.span, flag.value_span)
        key, value = _value(flag, read)
        if key is None:
            continue
        earlier = read.given.get(key)
        if earlier is not None and read.values[key] != value and read.report("E805", "flags given twice", flag):
            read.problems.append(diag("E805", f"{key} is given twice, as `{earlier.text}` and `{flag.text}` "
                                      "(torchtitan would keep the last silently)", flag.span, hint=f"keep one {key}"))
        read.values[key], read.given[key] = value, flag
    read.summaries()
    return read


def _value(flag: Flag, read: _Read):
    """(the key, the typed value) of one flag, (None, None) when it is reported or left out."""
    name, values = flag.name, flag.values
    if name.startswith(facts.SUBCOMMAND):
        mode = name.removeprefix(facts.SUBCOMMAND)
        if mode not in PLAN_RECOMPUTE:
            read.problems.append(diag("E807" if mode == "memory-budget" else "E804",
                                      f"`{name}`: a plan recomputes with none, selective or full",
                                      flag.span, hint="activation-checkpoint:none, :selective or :full"))
            return None, None
        return "activation", mode
    if not name.startswith("--"):
        if read.report("E804", "words that are not flags", flag):
            read.problems.append(diag("E804", f"`{name}` is not a flag (torchtitan's flags start with --, its "
                                      f"activation checkpointing is `{facts.SUBCOMMAND}MODE`)", flag.span,
                                      hint="give flags and their values only, as after `-m torchtitan.train`"))
        return None, None
    if name == facts.WEIGHT_DECAY and len(values) == 1 and values[0] in ("0", "0.0"):
        return None, None   # a plan's adam: AdamW without weight decay, as the export writes it
    if name in IGNORED or (name.startswith(IGNORED_SECTIONS) and name not in KNOWN):
        read.ignored.append(flag.text)
        return None, None
    if name not in KNOWN:
        if read.report("E804", "unknown flags", flag):
            suggestion = did_you_mean(name, (*KNOWN, *IGNORED), "flags")
            read.problems.append(diag("E804", f"unknown flag {name}", flag.span,
                                      hint=suggestion or "plandsl reads torchtitan's --module, --config, "
                                      "--parallelism.*, batch, precision and activation checkpointing flags "
                                      "(docs/interop.md)"))
        return None, None
    if name in SWITCHES:
        if values:
            read.problems.append(diag("E804", f"{name} is a switch and takes no value, found `{' '.join(values)}`",
                                      flag.value_span, hint=f"write {name} alone"))
            return None, None
        key = name.replace(".no_", ".")
        return key, SWITCHES[name]
    if name in LIST_FLAGS:
        if not values:
            read.problems.append(diag("E804", f"{name} takes one comma-separated list of modules per stage",
                                      flag.span))
            return None, None
        return name, tuple(tuple(part.split(",")) for part in values)
    if len(values) != 1:
        read.problems.append(diag("E804", f"{name} takes one value, found {len(values)}",
                                  flag.value_span if values else flag.span, hint=f"write {name} VALUE"))
        return None, None
    text = values[0]
    if name == facts.LAYERS_PER_STAGE and text == "None":
        return name, None
    if name in INT_FLAGS:
        allowed = NEGATIVE_OK.get(name)
        low = 0 if name in ZERO_OK else 1
        number = whole_number(text, signed=True)
        if number is None or number < low and number != allowed:
            read.problems.append(diag("E804", f"{name} takes an integer of {low} or more"
                                      + (f" (or {allowed})" if allowed else "") + f"{too_long(text)}, found "
                                      f"{shown_value(text)}", flag.value_span))
            return None, None
        return name, number
    if name in FLOAT_FLAGS:
        if text == "None" and name == O + "decay_ratio":
            return name, None
        try:
            number = float(text)
        except ValueError:
            number = math.nan
        if math.isnan(number) or number < 0 or (math.isinf(number) and name != T + "max_norm"):
            read.problems.append(diag("E804", f"{name} takes a number of zero or more, found `{text}`",
                                      flag.value_span))
            return None, None
        return name, number
    if name in CHOICE_FLAGS:
        choices = CHOICE_FLAGS[name]
        found = next((c for c in choices if c.lower() == text.lower()), None)  # get_schedule_class: any case
        if found is None:
            why = f" ({facts.OTHER_CONFIGS[text]})" if name == "--config" and text in facts.OTHER_CONFIGS else ""
            read.problems.append(diag("E807" if name in ("--module", "--config") else "E804",
                                      f"{name} {text}{why}: not one of {', '.join(choices)}", flag.value_span,
                                      hint=did_you_mean(text, choices, "values") or f"one of {', '.join(choices)}"))
            return None, None
        return name, found
    return name, text


# ---- the plan ---------------------------------------------------------------------------------------------------
def _plan_text(read: _Read, world_size: int | None, cluster: str | None, name: str) -> str | None:
    for flag in ("--module", "--config"):
        if flag not in read.values:  # ConfigManager._load_config: "--module is required", "--config is required"
            read.problem("E804", f"missing {flag} (torchtitan requires --module and --config)",
                         hint="add --module llama3 --config llama3_8b")
            return None
    config = read.values["--config"]
    values = {**DEFAULTS, **CONFIG_DEFAULTS[config], **read.values}
    get = values.get
    flag = P + "pipeline_parallel_schedule_csv"
    if get(flag):
        read.problem("E807", f"{flag}: import the CSV with `plandsl import --from torch-csv` and name its table in "
                     "the plan", flag)
        return None
    if not _expressible(read, values):
        return None
    # Trainer.Config.__post_init__ refuses these (trainer.py:119-122, 143-152)
    for flag, refused, why in (("--debug.batch_invariant", get("--debug.batch_invariant"),
                                "batch-invariant mode is not supported in pre-training"),
                               ("--debug.spmd_typechecking", get("--debug.spmd_typechecking")
                                and get(facts.DEGREES["pp"]) > 1 and get(P + "spmd_backend") ==
                                "spmd_types", "SPMD typechecking is not supported with pipeline parallelism")):
        if refused:
            read.problem("E805", f"{flag}: torchtitan refuses it (\"{why}\")", flag)
            return None
    if get(facts.EXPERT_DEGREE) != 1:
        read.problem("E807", f"{facts.EXPERT_DEGREE} {get(facts.EXPERT_DEGREE)}: {facts.MODULE}'s models have no "
                     "experts", facts.EXPERT_DEGREE)
        return None
    degrees = {role: get(flag) for role, flag in facts.DEGREES.items()}
    world = world_size if world_size is not None else cluster_devices(cluster)
    fixed = degrees["dp_replicate"] * degrees["cp"] * degrees["tp"] * degrees["pp"]
    if degrees["dp_shard"] == -1:  # ParallelDims._validate: the leftover ranks
        degrees["dp_shard"] = world // fixed
    total = fixed * degrees["dp_shard"]
    if total != world or degrees["dp_shard"] < 1:
        shown = " * ".join(f"{role}({degrees[role]})" for role in ("dp_replicate", "dp_shard", "cp", "tp", "pp"))
        read.problem("E806", f"{shown} != world size {world} (ParallelDims: the degrees must multiply to it)",
                     *[flag for role, flag in facts.DEGREES.items() if degrees[role] > 1 or flag in read.values],
                     hint=f"a world size that is a multiple of {fixed}")
        return None
    overlap = _async_tp(read, values, degrees)
    if overlap is None:
        return None
    flavor = facts.CONFIGS[config]
    model = (f"llama(layers={flavor.layers}, hidden={flavor.hidden}, heads={flavor.heads}, kv_heads={flavor.kv_heads}, "
             f"ffn={flavor.ffn}, seq={get(T + 'seq_len')}, vocab={flavor.vocab}, tied={str(flavor.tied).lower()})")
    train = _train(read, values, degrees)
    stages = _stages(read, values, flavor.layers, degrees["pp"]) if degrees["pp"] > 1 else []
    if train is None or stages is None:
        return None
    if degrees["pp"] > 1 and not get(T + "disable_cuda_graphs"):  # Trainer.Config._validate_cuda_graphs
        read.problem("E805", "a pipeline without --training.disable_cuda_graphs: torchtitan refuses it (\"CUDA "
                     "graphs do not support pipeline parallelism yet\")", facts.DEGREES["pp"],
                     hint="add --training.disable_cuda_graphs")
        return None
    # FSDP2 at every degree (facts.RESHARD's note): fully_shard over dp_shard (with cp), HSDP when dp_replicate > 1
    # (its shard axis kept at 1 where dp_shard is 1), over a data axis of 1 when there is no data parallelism
    hybrid = degrees["dp_replicate"] > 1
    sizes = {"pp": degrees["pp"], "dp_replicate": degrees["dp_replicate"], "dp_shard": degrees["dp_shard"],
             "cp": degrees["cp"], "tp": degrees["tp"]}
    axes = [(role if hybrid or role != "dp_shard" else "dp", sizes[role]) for role in facts.MESH_ORDER
            if sizes[role] > 1 or role == "dp_shard"]
    data = "hsdp over [dp_replicate, dp_shard]" if hybrid else "zero3 over dp"
    if get(T + "mixed_precision_param") == "bfloat16" and get(T + "dtype") == "float32":
        # FSDP2's MixedPrecisionPolicy(param_dtype=bfloat16): the fp32 shards all-gathered as bf16 copies, which the
        # forward computes with (no autocast copies beside them)
        data += " with gather = bf16"
    cluster_text, imports, part = cluster_lines(cluster, world)
    lines = [f"# Imported from torchtitan arguments ({facts.VERSION}) by `plandsl import --from torchtitan`."]
    if read.ignored:
        lines.append("# Left out (a plan does not hold them): " + left_out(read.ignored, " "))
    mesh = "[" + ", ".join(f"{axis} = {size}" for axis, size in axes) + "]"
    lines += [f'import "{i}"' for i in imports] + [
        "", f"plan {name} {{", f"  model = {model}", f"  cluster = {cluster_text}",
        f"  mesh = {mesh}" + (f" over devices[0:{world}]" if part else ""), f"  train = {train}",
        f"  data = {data}"]
    if degrees["tp"] > 1:
        lines.append("  tensor = megatron over tp" + (" with sequence_parallel" if get(P + "enable_sequence_parallel")
                                                      else "") + (", overlap" if overlap else ""))
    if degrees["cp"] > 1:
        lines.append("  context = ring over cp with implementation = torch")  # torch's context_parallel
    lines += stages
    return "\n".join(lines + ["}"]) + "\n"


def _expressible(read: _Read, values: dict) -> bool:
    """False (and an E807 naming the flag) for a setting torchtitan runs that a plan has no word for."""
    get = values.get
    pp = get(facts.DEGREES["pp"]) > 1
    policy = get(facts.RESHARD)
    refusals = (
        (facts.RESHARD, policy == "always" and pp,
         "always: FSDP reshards after every microbatch's forward under the pipeline, and a plan's ZeRO-3 keeps its "
         "units gathered through a pipelined step (torchtitan's default)"),
        (facts.RESHARD, policy == "never" and not pp,
         "never: every FSDP unit stays gathered from the forward to its backward, and a plan's ZeRO-3 off a "
         "pipeline reshards after the forward (torchtitan's default)"),
        (facts.CPU_OFFLOAD, get(facts.CPU_OFFLOAD),
         "FSDP2's CPUOffloadPolicy keeps parameters, gradients and optimizer states in host memory and steps on the "
         "CPU; a plan's offload_layers moves activations only"),
        (facts.SYMM_MEM, get(facts.SYMM_MEM),
         "FSDP2's symmetric-memory all-gathers and reduce-scatters, which a plan's collectives are not priced as"),
        (P + "context_parallel_load_balancer", get(P + "context_parallel_load_balancer") not in ("headtail", "ptrr"),
         f"{get(P + 'context_parallel_load_balancer')}: a plan's ring gives every rank the same share of the causal "
         "mask, as headtail (or ptrr) balances it; None leaves it unbalanced"),
        (facts.COMPILE_BACKEND, _compiled(values) and get(facts.COMPILE_BACKEND) != "inductor",
         f"{get(facts.COMPILE_BACKEND)}: a plan's kernels are inductor's fused ones (`kernels: fused`) or eager"),
        (facts.OPTIMIZER_NAME, get(facts.OPTIMIZER_NAME) == "DistMuon",
         "DistMuon: a plan's optimizer is adam or sgd"),
        (facts.FORCE_RECOMPUTE, get(facts.FORCE_RECOMPUTE) != DEFAULTS[facts.FORCE_RECOMPUTE]
         and get("activation") == "selective",
         "matmuls recomputed beside selective checkpointing's every other one: a plan's selective_op is "
         "torchtitan's policy as it ships"),
    )
    for flag, refused, why in refusals:
        if refused:
            read.problem("E807", f"{flag} {why}", flag)
            return False
    return True


def _compiled(values: dict) -> bool:
    """torch.compile over the model (CompileConfig: enable, and "model" in components)."""
    return bool(values.get(facts.COMPILE)) and "model" in {part for parts in values.get(facts.COMPILE_COMPONENTS)
                                                            for part in parts}


def _async_tp(read: _Read, values: dict, degrees: dict[str, int]) -> bool | None:
    """Whether the plan's tensor parallelism overlaps (`with overlap`); None when the flags cannot run: torchtitan
    refuses async TP without compiling the model (CompileConfig.__post_init__), and its pass fuses sequence
    parallelism's all-gathers and reduce-scatters, which a plan needs (E417)."""
    if not values.get(facts.ASYNC_TP):
        return False
    if not _compiled(values):
        read.problem("E805", f"{facts.ASYNC_TP} without compiling the model: torchtitan refuses it (\"Async TP "
                     "requires 'model' in --compile.components and --compile.enable\")", facts.ASYNC_TP,
                     hint=f"add {facts.COMPILE}")
        return None
    if degrees["tp"] > 1 and not values.get(P + "enable_sequence_parallel"):
        read.problem("E807", f"{facts.ASYNC_TP} with --parallelism.no_enable_sequence_parallel: torch's pass overlaps "
                     "sequence parallelism's all-gathers and reduce-scatters, and a plan's overlap needs them (E417)",
                     facts.ASYNC_TP, P + "enable_sequence_parallel", hint="drop --parallelism.no_enable_sequence_parallel")
        return None
    return degrees["tp"] > 1


def _train(read: _Read, values: dict, degrees: dict[str, int]) -> str | None:
    get = values.get
    dp = degrees["dp_replicate"] * degrees["dp_shard"]
    local, micro = get(T + "local_batch_size"), get(P + "pipeline_parallel_microbatch_size")
    batch = get(T + "global_batch_size")
    batch = local * dp if batch == -1 else batch
    if batch % (local * dp):  # trainer.py: global_batch_size % (local_batch_size * dp) == 0
        read.problem("E806", f"--training.global_batch_size {batch} is not a multiple of local_batch_size x "
                     f"data parallel ({local} x {dp})", T + "global_batch_size", T + "local_batch_size")
        return None
    if degrees["pp"] > 1:
        if local % micro:  # Trainer.Config.__post_init__
            read.problem("E805", f"--training.local_batch_size {local} is not divisible by "
                         f"--parallelism.pipeline_parallel_microbatch_size {micro}", T + "local_batch_size",
                         P + "pipeline_parallel_microbatch_size")
            return None
        if batch != local * dp:
            read.problem("E807", f"gradient accumulation ({batch // (local * dp)} steps) with a pipeline: a plan's "
                         "pipeline runs every microbatch of a step in one schedule", T + "global_batch_size",
                         hint=f"--training.local_batch_size {batch // dp}")
            return None
    else:
        micro = local
    param, dtype = get(T + "mixed_precision_param"), get(T + "dtype")
    if dtype == "bfloat16":
        if param != "bfloat16":
            read.problem("E805", "--training.dtype bfloat16 with --training.mixed_precision_param float32",
                         T + "dtype", hint="--training.mixed_precision_param bfloat16")
            return None
        precision = ["precision: bf16", "master_dtype: bf16", "grad_dtype: bf16", "optimizer_dtype: bf16"]
    else:
        precision = [f"precision: {'bf16' if param == 'bfloat16' else 'fp32'}"]
    decay, ratio = get(O + "decay_type"), get(O + "decay_ratio")
    if ratio == 0.0:
        schedule = "constant"
    elif ratio is None and decay in facts.DECAY.values() and get(O + "min_lr_factor") == 0.0:
        schedule = decay
    else:
        read.problem("E807", f"--lr_scheduler.decay_ratio {ratio} --lr_scheduler.decay_type {decay} "
                     f"--lr_scheduler.min_lr_factor {get(O + 'min_lr_factor')}: a plan's lr_schedule decays from the "
                     "warm-up's end to 0 (linear, cosine) or not at all (constant)",
                     O + "decay_ratio", O + "decay_type", O + "min_lr_factor", "--config",
                     hint="--lr_scheduler.decay_ratio 0.0 (constant) or None (linear, cosine)")
        return None
    clip = get(T + "max_norm")
    # torch.compile over the model fuses its element-wise kernels (`kernels: fused`, the plan's default); without
    # it (torchtitan's default) the model runs in eager mode
    compiled = _compiled(values)
    items = [f"global_batch: {batch}", f"micro_batch: {micro}", *precision,
             *([] if compiled else ["kernels: eager"]), *(["loss: fused"] if get(facts.LOSS_CHUNKS) > 1 else []),
             f"recompute: {PLAN_RECOMPUTE[get('activation')]}", "optimizer: adam", f"lr: {float(get(facts.LR))!r}",
             f"lr_schedule: {schedule}", f"warmup_steps: {get(O + 'warmup_steps')}",
             f"grad_clip: {repr(float(clip)) if math.isfinite(clip) and clip > 0 else 'none'}",
             f"seed: {get('--debug.seed') or 0}"]
    return "{ " + ", ".join(items) + " }"


def _stages(read: _Read, values: dict, layers: int, pp: int) -> list[str] | None:
    """The plan's `stages` and `schedule` lines for pipeline degree `pp`."""
    schedule = values[P + "pipeline_parallel_schedule"]
    if schedule not in PLAN_SCHEDULE:
        read.problem("E807", f"--parallelism.pipeline_parallel_schedule {schedule}: a plan names a schedule "
                     "(GPipe, 1F1B, Interleaved1F1B, ...)", P + "pipeline_parallel_schedule")
        return None
    parts = values.get(P + "module_fqns_per_model_part")
    flag = P + "module_fqns_per_model_part"
    if parts is None:  # pipeline_parallel.py's _get_pipeline_metadata and _generate_llm_fqn_per_model_part
        first, last = (values[flag] for flag in facts.LESS_LAYERS)
        single = schedule in facts.SINGLE_STAGE
        each = values.get(facts.LAYERS_PER_STAGE)
        if each is None:  # 1 stage per rank for single-stage schedules, else 2
            count = pp * (1 if single else 2)
        else:             # ceil((blocks + first + last) / layers_per_stage) stages, a whole number per rank
            count = -(-(layers + first + last) // each)
            per_rank = count / pp
            if count % pp or (per_rank != 1 if single else per_rank < 2):
                stages = f"{count} stage{'s' if count != 1 else ''}"
                why = ("not a whole number a rank" if count % pp else
                       f"{per_rank:g} a rank, and {schedule} runs {'one stage' if single else 'two or more'} per rank")
                read.problem("E805", f"{facts.LAYERS_PER_STAGE} {each}: {stages} over {pp} pipeline ranks, {why}",
                             facts.LAYERS_PER_STAGE, P + "pipeline_parallel_schedule")
                return None
        parts = default_split(count, layers, first, last)
        if parts is None:
            read.problem("E805", f"{count} stages over {layers} blocks, the embedding and the output counted as "
                         f"{first} and {last}: torchtitan's split leaves a stage without a block",
                         facts.LAYERS_PER_STAGE, *facts.LESS_LAYERS, P + "pipeline_parallel_degree")
            return None
    modules = [module for part in parts for module in part]
    expected = ["tok_embeddings", *(f"layers.{i}" for i in range(layers)), "norm", "lm_head"]
    problem = None
    if modules != expected:
        odd = next((m for m in modules if m not in expected), None)
        problem = (f"`{odd}` is not a module of {facts.MODULE} (tok_embeddings, layers.0-{layers - 1}, norm, lm_head)"
                   if odd else "its stages must hold tok_embeddings, layers.0, layers.1, ..., norm, lm_head, each once "
                   "and in order")
    elif len(parts) % pp:
        problem = f"its {len(parts)} stages are not a multiple of the pipeline degree {pp}"
    elif any("norm" in part and "lm_head" not in part for part in parts):
        problem = "norm and lm_head are on different stages"
    elif (len(parts) == pp) != (schedule in facts.SINGLE_STAGE):
        problem = f"{schedule} runs {'one stage' if schedule in facts.SINGLE_STAGE else 'two or more'} per rank, " \
                  f"and it makes {len(parts) // pp}"
    elif schedule in facts.V_SHAPED and len(parts) != 2 * pp:  # _get_pp_rank_to_stage_indices_mapping's assert
        problem = f"{schedule} runs two stages per rank, a V, and it makes {len(parts) // pp}"
    if problem:
        read.problem("E805", f"{flag if flag in values and values[flag] == parts else facts.LAYERS_PER_STAGE}: "
                     f"{problem}", flag, facts.LAYERS_PER_STAGE, P + "pipeline_parallel_schedule")
        return None
    counts = [("tok_embeddings" in part, sum(m.startswith("layers.") for m in part), "lm_head" in part)
              for part in parts]
    lines = stages_lines(counts, len(parts) // pp)
    if schedule in facts.V_SHAPED:
        lines.append("    map = vshape")
    return lines + ["  }", f"  schedule = {PLAN_SCHEDULE[schedule]}"]


def default_split(stages: int, layers: int, first_less: int = 1, last_less: int = 1) -> list[list[str]] | None:
    """torchtitan's split without module_fqns_per_model_part (pipeline_parallel.py,
    _generate_llm_fqn_per_model_part: the embedding and the output count as one block each); None where it
    raises."""
    effective = layers + first_less + last_less
    each, extra = divmod(effective, stages)
    if stages > effective or each == 0 or first_less > each or last_less > each:
        return None
    parts, block = [], 0
    for stage in range(stages):
        size = each + (stage < extra)
        part = ["tok_embeddings"] if stage == 0 else []
        size -= first_less if stage == 0 else last_less if stage == stages - 1 else 0
        for _ in range(size):
            if block < layers:
                part.append(f"layers.{block}")
                block += 1
        if stage == stages - 1:
            part += ["norm", "lm_head"]
        parts.append(part)
    return parts
