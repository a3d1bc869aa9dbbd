"""A checked plan <-> DeepSpeed's JSON configuration (DeepSpeed 0.19.8).

Stage: interop, beside render. Contract: `export_plan(plan)` writes the JSON and one E808 per part of the plan
it cannot say; `import_json(text, path, world_size, cluster, model)` reads a JSON config (with the model, which
DeepSpeed's config does not name) as a formatted plan that passes `check`, or E804-E807 with a caret under the
key, or the checker's diagnostics. DeepSpeed's config says the batch, ZeRO, precision, clipping, optimizer and
learning-rate schedule; the model, its tensor, pipeline, context and expert parallelism and what it recomputes
live in the training script (PipelineModule, deepspeed.checkpointing, MoE layers), so a plan with them is
lossy. DeepSpeed accepts unknown top-level keys silently (`DeepSpeedConfig` reads the keys it knows), so the
import checks every key itself. Facts are deepspeed/runtime/{config,constants,lr_schedules}.py and
zero/config.py at 0.19.8; tests/unit/test_interop_deepspeed.py holds them against DeepSpeedConfig.
"""
from __future__ import annotations

import enum
import json
import math
import re

from pydantic import TypeAdapter, ValidationError

from plandsl import ir
from plandsl.diagnostics import Diagnostic, did_you_mean, diag
from plandsl.diagnostics.limits import MAX_PREFETCH_BUCKET
from plandsl.diagnostics.source import SourceFile
from plandsl.interop.cluster import cluster_devices, cluster_lines, stdlib_imports
from plandsl.interop.result import Capped, Exported, Imported, checked, escaped, left_out, loser

TARGET = "deepspeed"
VERSION = "DeepSpeed 0.19.8"

# The keys the import reads (constants.py), and those of DeepSpeed's config that mean nothing in a plan: read,
# listed, left out. Any other top-level key is a typo DeepSpeed itself would silently ignore: E804.
READ = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "zero_optimization",
        "bf16", "bfloat16", "fp16", "gradient_clipping", "optimizer", "scheduler")
BF16_OLD = "bfloat16"
"""DeepSpeed's older name of "bf16", read where "bf16" is not written (precision_config.get_bfloat16_config):
it was an unknown key, E804, said to be one DeepSpeed ignores."""
IGNORED = ("steps_per_print", "wall_clock_breakdown", "dump_state", "memory_breakdown", "tensorboard", "wandb",
           "csv_monitor", "comet", "flops_profiler", "comms_logger", "checkpoint", "zero_allow_untested_optimizer",
           "zero_force_ds_cpu_optimizer", "prescale_gradients", "gradient_predivide_factor", "communication_data_type",
           "seq_parallel_communication_data_type", "dataloader_drop_last", "aio", "activation_checkpointing",
           "data_types", "disable_allgather", "sparse_gradients", "timers")
OPTIMIZERS = {"Adam": ir.Optimizer.adam, "AdamW": ir.Optimizer.adam, "SGD": ir.Optimizer.sgd}
# ZeRO-3 gathers each sub-module's parameters when it runs and prefetches the following ones until this many
# elements are on their way (zero/config.py: `prefetch_bucket_size`, alias stage3_prefetch_bucket_size, 5e7 since
# 2021): a plan's `data = zero3 over dp with unit = module, prefetch_bucket = N`
PREFETCH_BUCKET = "stage3_prefetch_bucket_size"
PREFETCH_BUCKET_FIELD = "prefetch_bucket_size"
"""The same setting by its field's own name, which DeepSpeed's config model takes too (populate_by_name): it was
listed as left out, and the plan given DeepSpeed's default bucket instead of the one the config sets."""
PREFETCH_BUCKET_DEFAULT = 50_000_000
SGD_MOMENTUM = 0.9   # plandsl's sgd (runtime/optim.py)


def export_plan(plan: ir.Plan) -> Exported:
    lost: list[Diagnostic] = []

    lose = loser(plan, "DeepSpeed's config", lost)

    train = plan.train
    if train.batch_shares is not None:
        lose("batch_shares (uneven data-parallel shares: every rank takes train_micro_batch_size_per_gpu x "
             "gradient_accumulation_steps)", "train")
    for what, degree, field in (("tensor", plan.tp, "tensor"), ("pipeline", plan.pp, "stages"),
                                ("context", plan.cp, "context"), ("expert", plan.ep, "experts")):
        if degree > 1:
            lose(f"{what} parallelism ({degree}: the training script builds it, not the JSON)", field)
    if plan.data is not None and (plan.data.hybrid or len(plan.data.axes) > 1):
        lose(f"data = {plan.data.kind} over {len(plan.data.axes)} axes (ZeRO shards over the whole data-parallel "
             "group)", "data")
    if train.recompute is not ir.Recompute.none:
        lose(f"recompute: {train.recompute.value} (the model's code calls deepspeed.checkpointing)", "train")
    if train.offload_layers:  # activation_checkpointing.cpu_checkpointing: only the checkpoints of recomputed blocks
        lose(f"offload_layers: {train.offload_layers} (DeepSpeed's cpu_checkpointing moves the inputs of recomputed "
             "blocks to the CPU, not a kept block's activations)", "train")
    if train.lr_schedule != "constant":
        lose(f"lr_schedule: {train.lr_schedule} (WarmupCosineLR and WarmupDecayLR need total_num_steps, which a "
             "plan does not fix)", "train")
    if train.seed != 0:
        lose(f"seed: {train.seed} (the training script seeds)", "train")
    if train.precision.quantized:
        lose(f"precision: {train.precision.value} (Transformer Engine's FP8 is the model code's, not the JSON's)", "train",
             hint="precision: bf16 is what the JSON can say")
    # DeepSpeed's own layout: the weights in the compute precision, an fp32 master copy with the states
    native = {"param_dtype": train.precision} if train.precision is not ir.Precision.fp32 else {}
    kept = [f"{key}: {value.value}" for key, value in train.given_dtypes().items() if native.get(key) is not value]
    if kept:
        lose(f"{', '.join(kept)} (DeepSpeed keeps fp32 master weights and optimizer states under bf16 and fp16)",
             "train")
    gather = plan.data.gather if plan.data is not None else None
    if gather is not None and gather is not train.precision:  # ZeRO gathers the weights it keeps, in the precision
        lose(f"gather = {gather.value} (DeepSpeed gathers its {train.precision.value} weights as they are)", "data",
             hint="drop `with gather`")
    zero: dict = {"stage": plan.data.zero_stage if plan.data else 0}
    if plan.data is not None and plan.data.zero_stage >= 3:
        # DeepSpeed's ZeRO-3 gathers module by module whatever the plan's unit; it prefetches by elements
        if plan.data.prefetch not in (0, 1):
            lose(f"prefetch = {plan.data.prefetch} (DeepSpeed prefetches by elements: {PREFETCH_BUCKET}, "
                 "a plan's prefetch_bucket)", "data")
        bucket = 0 if plan.data.prefetch == 0 else plan.data.prefetch_bucket  # 0: DeepSpeed prefetches nothing
        if bucket is not None and bucket != PREFETCH_BUCKET_DEFAULT:
            zero[PREFETCH_BUCKET] = bucket
    lost.extend(diag("E808", f"DeepSpeed's config cannot express shard rule `{rule.target.text}`", rule.span)
                for rule in plan.shard)
    config: dict = {
        "train_batch_size": train.global_batch,
        "train_micro_batch_size_per_gpu": train.micro_batch,
        "gradient_accumulation_steps": plan.num_microbatches,   # train_batch = micro x accumulation x dp
        "zero_optimization": zero,
        "bf16": {"enabled": train.precision is ir.Precision.bf16},
        "fp16": {"enabled": train.precision is ir.Precision.fp16},
        # 0 turns clipping off (engine.py: `if self.gradient_clipping() > 0.0`)
        "gradient_clipping": train.grad_clip if train.grad_clip is not None else 0.0,
        # plandsl's adam is AdamW without weight decay (runtime/optim.py), DeepSpeed's Adam is AdamW-mode with
        # weight_decay 0 by default; its sgd has momentum 0.9, DeepSpeed's SGD (torch's) 0 unless told
        "optimizer": {"type": "Adam", "params": {"lr": train.lr}} if train.optimizer is ir.Optimizer.adam else
                     {"type": "SGD", "params": {"lr": train.lr, "momentum": SGD_MOMENTUM}},
    }
    if train.warmup_steps:  # WarmupLR's default warmup_type is log: plandsl's warm-up is linear
        config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": train.lr,
                                                              "warmup_num_steps": train.warmup_steps,
                                                              "warmup_type": "linear"}}
    return Exported(TARGET, json.dumps(config, indent=2) + "\n", tuple(lost))


def _gathering(stage: int, bucket: int) -> str:
    """ZeRO-3's gathering as DeepSpeed does it: each sub-module, the following ones prefetched until `bucket`
    elements (a bucket of 0 prefetches nothing: `prefetch = 0`)."""
    if stage != 3:
        return ""
    return " with unit = module, " + (f"prefetch_bucket = {bucket}" if bucket else "prefetch = 0")


# A JSON string (with the colon after it where it is a key) or a bracket. Matched string after string from the text's
# start, in a text json.loads read: a quote outside a string opens one, so each match is a string as written. A search
# for `"...":` anywhere began wherever it found one, at a value's closing quote too: `"x", ":b": 1` read `, ` as a key
# and lost ":b".
_TOKEN = re.compile(r'"((?:[^"\\]|\\.)*)"(\s*:)?|([{}\[\]])')


class _Keys:
    """Where each key of a config is written, found in one pass over its text as the first span is asked for (a
    search of the text for each of a config's keys was quadratic: 50,000 unknown keys took 15 s): the top-level
    keys (what the import reads and reports), each key at any depth, and where the first object json closes with a
    key written twice writes it again (what `pairs` finds first: json reads an inner object before the outer)."""

    def __init__(self, source: SourceFile):
        self.source, self._top, self._any, self._twice = source, None, {}, None

    def _read(self) -> None:
        # for each object open: the keys written so far in it, and where its first key written again is; None an array
        self._top, open_objects = {}, []
        for found in _TOKEN.finditer(self.source.text):
            bracket = found.group(3)
            if bracket in ("{", "["):
                open_objects.append([set(), None] if bracket == "{" else None)
            elif bracket:
                closed = open_objects.pop() if open_objects else None
                if closed and closed[1] is not None and self._twice is None:
                    self._twice = closed[1]
            elif found.group(2) and open_objects and open_objects[-1] is not None:
                key, span, (written, _) = _decoded(found.group(1)), found.span(1), open_objects[-1]
                self._any.setdefault(key, []).append(span)
                if len(open_objects) == 1:
                    self._top.setdefault(key, []).append(span)
                if key in written and open_objects[-1][1] is None:
                    open_objects[-1][1] = span
                written.add(key)

    def span(self, key: str, last: bool = False):
        """Where the top-level `"key"` (else one at any depth) is first (`last`: last) written, the file's start when
        it is not."""
        if self._top is None:
            self._read()
        starts = self._top.get(key) or self._any.get(key)
        return self._at(starts[-1 if last else 0]) if starts else self.source.span(0, 1)

    def twice(self, key: str):
        """Where a key is written a second time in the first object json closes holding one twice (`key`'s last
        anywhere when none is found)."""
        if self._top is None:
            self._read()
        return self._at(self._twice) if self._twice is not None else self.span(key, last=True)

    def _at(self, span: tuple[int, int]):
        start, end = span
        return self.source.span(start - 1, end + 1)


def _decoded(written: str) -> str:
    """A JSON string's characters as written between its quotes -> the string json reads."""
    if "\\" not in written:
        return written
    try:
        return json.loads(f'"{written}"')
    except ValueError:
        return written


def _finite(value: object, whole: bool) -> bool:
    """Whether a config's value is a finite number of zero or more (an integer where `whole`)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (whole and not isinstance(value, int)):
        return False
    if whole:
        return value >= 0
    try:  # an integer past float's range (`1` and 400 zeros) overflowed float() as the plan was written
        return value >= 0 and math.isfinite(float(value))
    except OverflowError:
        return False


class _ZeroStage(enum.IntEnum):
    """DeepSpeed's ZeroStageEnum (deepspeed/runtime/zero/config.py): what its pydantic model takes as a stage."""
    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3


# DeepSpeed's configs are pydantic models in lax mode: a stage of 1.0, true or "1" is stage 1, an "enabled" of "yes",
# 1 or "off" a bool (checked against DeepSpeed 0.19.8's DeepSpeedZeroConfig and get_bfloat16_config); read alike
_STAGE, _BOOL = TypeAdapter(_ZeroStage), TypeAdapter(bool)


def _enabled(config: dict, key: str, problem) -> bool:
    """`{"enabled": true}` of the "bf16" or "fp16" section, the value read as DeepSpeed's pydantic model reads it
    ("false", "off" and 0 are off: bool("false") imported bf16); a section that is not an object (`"bf16": true`
    was read as off), or a value pydantic refuses, is E804."""
    section = config.get(key)
    if section is None:
        return False
    if isinstance(section, dict):
        try:
            return _BOOL.validate_python(section.get("enabled", False))
        except ValidationError:
            pass
    problem("E804", f"\"{key}\" must be an object whose \"enabled\" is true or false, found "
            f"{_json_shown(section)}", key)
    return False


def _json_shown(value: object) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else f"{text[:30]}... ({len(text):,} characters)"


def import_json(text: str, path: str, world_size: int | None = None, cluster: str | None = None,
                model: str | None = None, name: str = "deepspeed", plan_path: str = "deepspeed.plan") -> Imported:
    source = SourceFile(path, text)
    sources = {path: source}
    problems: list[Diagnostic] = []
    keys = _Keys(source)

    def problem(code: str, message: str, key: str, hint: str | None = None) -> None:
        problems.append(diag(code, message, keys.span(key), hint=hint))

    duplicates: list[str] = []

    def pairs(items: list) -> dict:  # DeepSpeed reads with dict_raise_error_on_duplicate_keys: a key twice is refused
        found = dict(items)
        if len(found) < len(items):
            seen: set[str] = set()
            duplicates.extend(key for key, _ in items if key in seen or seen.add(key))
        return found

    try:
        config = json.loads(text, object_pairs_hook=pairs)
    except json.JSONDecodeError as error:
        problems.append(diag("E804", f"not JSON: {error.msg} (line {error.lineno}, column {error.colno})",
                             source.span(error.pos, error.pos + 1)))
        return Imported(None, tuple(problems), sources)
    except (ValueError, RecursionError) as error:  # int()'s digit limit; the decoder's recursion, once per nesting
        why = "arrays or objects nested too deeply" if isinstance(error, RecursionError) else \
            "an integer of more than 4,300 digits"
        problems.append(diag("E804", f"not a DeepSpeed config: it holds {why}", source.span(0, 1)))
        return Imported(None, tuple(problems), sources)
    if not isinstance(config, dict):
        problems.append(diag("E804", "a DeepSpeed config is a JSON object", source.span(0, 1)))
        return Imported(None, tuple(problems), sources)
    if duplicates:  # json keeps the last; DeepSpeed stops
        problems.append(diag("E804", f"key \"{escaped(duplicates[0])}\" written twice in one object (DeepSpeed refuses a "
                             "config with a duplicate key)", keys.twice(duplicates[0])))
        return Imported(None, tuple(problems), sources)
    if model is None:
        raise ValueError("--model: DeepSpeed's config does not say the model (gpt(...), llama(...) or a stdlib name)")
    ignored = [key for key in config if key in IGNORED]
    zero = config.get("zero_optimization", {})
    unknown = Capped("E804", "unknown keys")
    for key in config:
        if key not in READ and key not in IGNORED and unknown.report(key, keys.span(key)):
            problem("E804", f"unknown key \"{escaped(key)}\" (DeepSpeed would ignore it without a word)", key,
                    hint=did_you_mean(key, READ + IGNORED, "keys") or "docs/interop.md lists the keys plandsl reads")
    problems += unknown.summary()
    world = world_size if world_size is not None else cluster_devices(cluster)
    numbers = {}
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        value = config.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            problem("E804", f"\"{key}\" must be a positive integer, found {json.dumps(value)}", key)
        numbers[key] = value
    if problems:
        return Imported(None, tuple(problems), sources, tuple(ignored))
    batch, micro, accumulation = (numbers[k] for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                                        "gradient_accumulation_steps"))
    # config.py _set_batch_related_parameters: any two give the third; _batch_assertion: train_batch_size =
    # micro x accumulation x world size
    if batch is None and micro is None:
        problem("E804", "missing \"train_batch_size\" and \"train_micro_batch_size_per_gpu\" (DeepSpeed needs one)",
                "train_batch_size")
        return Imported(None, tuple(problems), sources, tuple(ignored))
    if micro is None:
        if batch % ((accumulation or 1) * world):
            problem("E806", f"\"train_batch_size\" {batch} is not divisible by gradient_accumulation_steps x world "
                    f"size ({accumulation or 1} x {world})", "train_batch_size")
            return Imported(None, tuple(problems), sources, tuple(ignored))
        micro = batch // ((accumulation or 1) * world)
    if batch is None:
        batch = micro * (accumulation or 1) * world
    if batch % (micro * world):
        problem("E806", f"\"train_batch_size\" {batch} is not divisible by train_micro_batch_size_per_gpu x world "
                f"size ({micro} x {world})", "train_batch_size")
        return Imported(None, tuple(problems), sources, tuple(ignored))
    if accumulation is not None and accumulation != batch // (micro * world):
        problem("E805", f"\"train_batch_size\" {batch} != train_micro_batch_size_per_gpu {micro} x "
                f"gradient_accumulation_steps {accumulation} x world size {world} (= {micro * accumulation * world})",
                "gradient_accumulation_steps")
        return Imported(None, tuple(problems), sources, tuple(ignored))
    # DeepSpeed reads an object, or (deprecated, `read_zero_config_deprecated`) a bool: true is stage 1
    if not isinstance(zero, (dict, bool)):
        problem("E804", f"\"zero_optimization\" must be an object (or true/false), found {_json_shown(zero)}",
                "zero_optimization")
        zero = {}
    stage = zero.get("stage", 0) if isinstance(zero, dict) else (1 if zero else 0)
    try:
        stage = int(_STAGE.validate_python(stage))  # 1.0, true, "1" as DeepSpeed reads them (1.0 indexed a tuple)
    except ValidationError:
        problem("E804", f"zero_optimization stage {_json_shown(stage)}: one of 0, 1, 2, 3", "zero_optimization")
        stage = 0
    written = config.get("bf16") is not None  # DeepSpeed's get("bf16", None): a null "bf16" falls back to the old name
    if BF16_OLD in config and written:  # DeepSpeed reads "bf16" and passes the older name by
        ignored.append(BF16_OLD)
    bf16 = _enabled(config, "bf16" if written or BF16_OLD not in config else BF16_OLD, problem)
    fp16 = _enabled(config, "fp16", problem)
    if bf16 and fp16:
        problem("E805", "bf16 and fp16 both enabled", "fp16", hint="enable one")
    optimizer = config.get("optimizer", {"type": "Adam", "params": {}})
    kind = optimizer.get("type") if isinstance(optimizer, dict) else None
    if not isinstance(kind, str) or kind not in OPTIMIZERS:  # a list or an object was unhashable: a traceback
        problem("E807", f"optimizer {_json_shown(kind)}: a plan's optimizer is adam or sgd", "optimizer")
    params = (optimizer.get("params") or {}) if isinstance(optimizer, dict) else {}
    if not isinstance(params, dict):
        problem("E804", f"optimizer's \"params\" must be an object, found {_json_shown(params)}", "optimizer")
        params = {}
    lr = params.get("lr", 1e-3)
    if kind == "SGD" and params.get("momentum", 0) != SGD_MOMENTUM:
        problem("E807", f"SGD with momentum {params.get('momentum', 0)}: a plan's sgd has momentum {SGD_MOMENTUM}",
                "optimizer")
    # what the sections say besides what a plan keeps: listed as left out
    ignored += [f"optimizer.params.{k}" for k in params if k not in ("lr", "momentum")]
    ignored += [f"zero_optimization.{k}" for k in (zero if isinstance(zero, dict) else {})
                if k not in ("stage", PREFETCH_BUCKET, PREFETCH_BUCKET_FIELD)]
    named = PREFETCH_BUCKET_FIELD if isinstance(zero, dict) and PREFETCH_BUCKET_FIELD in zero else PREFETCH_BUCKET
    if isinstance(zero, dict) and PREFETCH_BUCKET in zero and PREFETCH_BUCKET_FIELD in zero:
        problem("E804", f"\"{PREFETCH_BUCKET}\" and \"{PREFETCH_BUCKET_FIELD}\" both given: one setting by its two "
                "names (DeepSpeed refuses the config)", PREFETCH_BUCKET_FIELD)
    bucket = zero.get(named, PREFETCH_BUCKET_DEFAULT) if isinstance(zero, dict) else PREFETCH_BUCKET_DEFAULT
    if isinstance(bucket, float) and bucket.is_integer():  # `5e7`, as DeepSpeed's docs write it (its config takes it)
        bucket = int(bucket)
    if stage == 3 and (not isinstance(bucket, int) or isinstance(bucket, bool) or not 0 <= bucket <= MAX_PREFETCH_BUCKET):
        # 1e300 was written as its 301 digits, a plan no parser reads
        problem("E804", f"\"{named}\" must be a whole number of elements up to {MAX_PREFETCH_BUCKET:.0e}, "
                f"found {_json_shown(bucket)}", named)
    warmup = 0
    scheduler = config.get("scheduler")
    if scheduler is not None:
        params = scheduler.get("params", {}) if isinstance(scheduler, dict) else {}
        params = params if isinstance(params, dict) else {"warmup_type": params}  # not an object: E807 below
        if not isinstance(scheduler, dict) or scheduler.get("type") != "WarmupLR" \
                or params.get("warmup_type", "log") != "linear" or params.get("warmup_min_lr", 0) != 0:
            problem("E807", "scheduler: a plan's warm-up is WarmupLR, linear from 0 to the optimizer's lr", "scheduler")
        else:
            warmup = params.get("warmup_num_steps", 1000)
            lr = params.get("warmup_max_lr", lr)
    clip = config.get("gradient_clipping", 0.0)
    # the numbers written into the plan: each a finite number (a string, a list or NaN was a traceback, or text in
    # the plan as written)
    for value, key, what, whole in ((lr, "optimizer", "the learning rate (lr, or WarmupLR's warmup_max_lr)", False),
                                    (clip, "gradient_clipping", "\"gradient_clipping\"", False),
                                    (warmup, "scheduler", "WarmupLR's \"warmup_num_steps\"", True)):
        if not _finite(value, whole):
            problem("E804", f"{what} must be {'a whole number' if whole else 'a number'} of zero or more, found "
                    f"{_json_shown(value)}", key)
    if problems:
        return Imported(None, tuple(problems), sources, tuple(ignored))
    cluster_text, imports, part = cluster_lines(cluster, world)
    imports = sorted(set(imports) | set(stdlib_imports(model)))
    precision = "bf16" if bf16 else "fp16" if fp16 else "fp32"
    weights = f"param_dtype: {precision}, " if precision != "fp32" else ""  # 16-bit weights beside an fp32 master
    data = ir.DataKind.of_zero_stage(stage).value
    lines = [f"# Imported from a DeepSpeed config ({VERSION}) by `plandsl import --from deepspeed`."]
    if ignored:
        lines.append("# Left out (a plan does not hold them): " + left_out(ignored, ", "))
    lines += [f'import "{i}"' for i in imports] + [
        "", f"plan {name} {{", f"  model = {model}", f"  cluster = {cluster_text}",
        f"  mesh = [dp = {world}]" + (f" over devices[0:{world}]" if part else ""),
        f"  train = {{ global_batch: {batch}, micro_batch: {micro}, precision: {precision}, {weights}"
        f"optimizer: {OPTIMIZERS[kind].value}, lr: {float(lr)!r}, warmup_steps: {warmup}, "
        f"grad_clip: {repr(float(clip)) if clip else 'none'} }}",
        f"  data = {data} over dp" + _gathering(stage, bucket), "}"]
    return checked("\n".join(lines) + "\n", plan_path, sources, ignored)
