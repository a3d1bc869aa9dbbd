"""Two checked plans -> what differs between them and what the cost model predicts of it (`plandsl diff`).

Stage: comparison of two `ir.Plan`s. Contract: `diff_plans(a, b) -> PlanDiff`, pure; each change once
(field, old, new), in the order of `FIELDS`; moved layers from the resolved placement
(`ir.placement.assign_stages`); the predictions from `cost.estimate.estimate_plan`, as `plandsl estimate`
makes them. `format_diff` and `diff_json` render it (docs/cli.md, "diff").
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

from plandsl import ir
from plandsl.cost.estimate import PlanEstimate, estimate_plan
from plandsl.ir.placement import assign_stages, compress_names
from plandsl.lower.units import format_bytes

DIFF_VERSION = 1
"""The version of `diff_json`'s structure; it rises when a key changes meaning or goes away."""

Value = Any  # a JSON value: None (absent), bool, int, float, str, list


def _dump(node) -> Value:
    return None if node is None else node.model_dump(mode="json")


# ---- what is compared: (section, field, value of a plan) ------------------------------------------------
FIELDS: tuple[tuple[str, str, Callable[[ir.Plan], Value]], ...] = (
    ("model", "model", lambda p: p.model.name),
    ("cluster", "cluster", lambda p: f"{p.cluster.name} ({p.cluster.num_devices} devices)"),
    ("mesh", "mesh.order", lambda p: [a.name for a in p.mesh.axes]),
    ("mesh", "mesh.first_device", lambda p: p.mesh.first_device),
    ("sharding", "data.kind", lambda p: p.data and str(p.data.kind)),
    ("sharding", "data.axes", lambda p: p.data and list(p.data.axes)),
    # the gathering options where written (their defaults, FSDP's blocks one ahead, show as none)
    ("sharding", "data.unit", lambda p: str(p.data.unit) if p.data and p.data.unit is not ir.GatherUnit.block else None),
    ("sharding", "data.prefetch", lambda p: p.data.prefetch if p.data and p.data.prefetch != 1 else None),
    ("sharding", "data.prefetch_bucket", lambda p: p.data and p.data.prefetch_bucket),
    ("sharding", "data.gather", lambda p: p.data.gather.value if p.data and p.data.gather else None),
    ("sharding", "tensor.axis", lambda p: p.tensor and p.tensor.axis),
    ("sharding", "tensor.sequence_parallel", lambda p: p.tensor is not None and p.tensor.sequence_parallel),
    ("sharding", "tensor.overlap", lambda p: p.tensor is not None and p.tensor.overlap),
    ("sharding", "tensor.implementation", lambda p: "userbuffers" if p.tensor and p.tensor.userbuffers else None),
    ("sharding", "tensor.sm_margin", lambda p: p.tensor.sm_margin if p.tensor and p.tensor.userbuffers else None),
    ("sharding", "tensor.stack", lambda p: p.tensor and p.tensor.stack),  # whose tensor parallelism runs the layers
    ("sharding", "context.kind", lambda p: p.context and p.context.kind),
    ("sharding", "context.axis", lambda p: p.context and p.context.axis),
    ("sharding", "experts.kind", lambda p: p.experts and p.experts.kind),
    ("sharding", "experts.axis", lambda p: p.experts and p.experts.axis),
    ("sharding", "experts.fold", lambda p: p.experts and list(p.experts.fold) or None),
    ("sharding", "experts.overlap", lambda p: p.experts is not None and p.experts.overlap),
    ("sharding", "shard", lambda p: [_dump(rule) for rule in p.shard] or None),
    ("stages", "stages.axis", lambda p: p.stages and p.stages.axis),
    ("stages", "stages.mode", lambda p: p.stages and p.stages.mode),
    ("stages", "stages.groups", lambda p: p.stages and [_dump(g) for g in p.stages.groups] or None),
    ("stages", "stages.rank_map", lambda p: p.stages and (p.stages.rank_map if isinstance(p.stages.rank_map, str)
                                                          else list(p.stages.rank_map))),
    ("stages", "stages.implementation", lambda p: p.stages and p.stages.implementation),  # whose pipeline
    ("stages", "stages.outputs", lambda p: p.stages and p.stages.outputs),  # the last stage's outputs kept or not
    ("schedule", "schedule.name", lambda p: p.schedule and p.schedule.name),
    ("schedule", "schedule.virtual", lambda p: p.stages and p.stages.virtual),
    ("schedule", "schedule.options", lambda p: p.schedule and dict(p.schedule.options) or None),
    ("schedule", "schedule.definition", lambda p: p.schedule and _dump(p.schedule.definition)),
    ("schedule", "microbatches", lambda p: p.num_microbatches),
    ("batch", "train.global_batch", lambda p: p.train.global_batch),
    ("batch", "train.micro_batch", lambda p: p.train.micro_batch),
    ("batch", "seq", lambda p: p.seq),
    ("batch", "train.batch_shares", lambda p: p.train.batch_shares),
    ("training", "train.precision", lambda p: p.train.precision.value),
    ("training", "train.master_dtype", lambda p: p.train.master_dtype.value),
    ("training", "train.param_dtype", lambda p: p.train.weights_dtype.value),
    ("training", "train.grad_dtype", lambda p: p.train.grad_dtype.value),
    ("training", "train.optimizer_dtype", lambda p: p.train.optimizer_dtype.value),
    ("training", "train.recompute", lambda p: p.train.recompute.value),
    ("training", "train.recompute_layers", lambda p: p.train.recompute_layers),
    ("training", "train.recompute_modules", lambda p: p.train.recompute_modules and
     ", ".join(m.value for m in p.train.recompute_modules)),
    ("training", "train.offload_layers", lambda p: p.train.offload_layers),
    ("training", "train.kernels", lambda p: p.train.kernels.value),
    ("training", "train.attention", lambda p: p.train.attention.value),
    ("training", "train.loss", lambda p: p.train.loss.value),
    ("training", "train.optimizer", lambda p: p.train.optimizer.value),
    ("training", "train.lr", lambda p: p.train.lr),
    ("training", "train.lr_schedule", lambda p: p.train.lr_schedule),
    ("training", "train.warmup_steps", lambda p: p.train.warmup_steps),
    ("training", "train.grad_clip", lambda p: p.train.grad_clip),
    ("training", "train.seed", lambda p: p.train.seed),
)
"""Every compared field of a plan, in the order changes are listed; None: the plan has no such part. Mesh axis
sizes (`mesh.AXIS`) follow `mesh.order`; the model's own fields (`model.FIELD`) follow `model` when both plans
name the same model with different contents."""

SECTIONS = ("model", "cluster", "mesh", "sharding", "stages", "schedule", "batch", "training")


@dataclass(frozen=True, slots=True)
class Change:
    section: str
    field: str
    old: Value
    new: Value


@dataclass(frozen=True, slots=True)
class MovedLayers:
    """Consecutive layers that went from (stage, pipeline rank) `old` to `new` together."""
    layers: tuple[str, ...]
    old: tuple[int, int]
    new: tuple[int, int]


@dataclass(frozen=True, slots=True)
class Prediction:
    metric: str
    old: float
    new: float
    comparable: bool
    why: str | None = None  # why the two figures are not comparable

    @property
    def change(self) -> float:
        return self.new - self.old

    @property
    def relative(self) -> float | None:
        return self.change / self.old if self.old else None


@dataclass(frozen=True, slots=True)
class PlanDiff:
    a: str                      # plan names
    b: str
    changes: tuple[Change, ...]
    moved: tuple[MovedLayers, ...]
    predictions: tuple[Prediction, ...]
    files: tuple[str, str] | None = None  # where the plans were read, to name them

    @property
    def identical(self) -> bool:
        return not self.changes and not self.moved


# ---- the stage -------------------------------------------------------------------------------------------
def diff_plans(a: ir.Plan, b: ir.Plan, files: tuple[str, str] | None = None) -> PlanDiff:
    """What differs from plan `a` to plan `b`, with the cost model's predictions for both; PlanError when a
    plan's placement or schedule is invalid (a checked plan's never is)."""
    return PlanDiff(a.name, b.name, tuple(changes(a, b)), moved_layers(a, b),
                    predictions(a, b, estimate_plan(a), estimate_plan(b)), files)


def changes(a: ir.Plan, b: ir.Plan) -> list[Change]:
    """The fields of `FIELDS` (and mesh axes, a same-named model's or cluster's fields) that differ from `a` to `b`."""
    found = []
    for section, name, value in FIELDS:
        old, new = value(a), value(b)
        if old != new:
            found.append(Change(section, name, old, new))
        if name in ("model", "cluster") and old == new:  # the same name, other contents: which fields
            found += _node_fields(name, getattr(a, name), getattr(b, name))
        if name == "mesh.order":  # each axis's size, A's axes first
            names = [x.name for x in a.mesh.axes] + [x.name for x in b.mesh.axes if a.mesh.axis(x.name) is None]
            found += [Change("mesh", f"mesh.{axis}", _size(a, axis), _size(b, axis)) for axis in names
                      if _size(a, axis) != _size(b, axis)]
    return found


def _size(plan: ir.Plan, axis: str) -> int | None:
    found = plan.mesh.axis(axis)
    return found.size if found else None


def _node_fields(section: str, a: ir.Node, b: ir.Node) -> list[Change]:
    old, new = _dump(a), _dump(b)
    return [Change(section, f"{section}.{key}", old.get(key), new.get(key))
            for key in list(old) + [k for k in new if k not in old] if old.get(key) != new.get(key)]


def moved_layers(a: ir.Plan, b: ir.Plan) -> tuple[MovedLayers, ...]:
    """Layers of both plans (by name) whose (stage, pipeline rank) differs, in runs of consecutive layers
    that moved alike; empty when a placement cannot be resolved (the checker reports that)."""
    old, new = _placement(a), _placement(b)
    runs: list[list] = []  # [first index, names, old, new]
    for index, (name, where) in enumerate(old.items()):
        if name not in new or new[name] == where:
            continue
        last = runs[-1] if runs else None
        if last and (last[2], last[3]) == (where, new[name]) and last[0] + len(last[1]) == index:
            last[1].append(name)
        else:
            runs.append([index, [name], where, new[name]])
    return tuple(MovedLayers(tuple(names), where, to) for _, names, where, to in runs)


def _placement(plan: ir.Plan) -> dict[str, tuple[int, int]]:
    """Layer name -> (stage, pipeline rank), in model order; a plan without stages holds them all on stage 0."""
    assignment, _ = assign_stages(plan)
    if assignment is None:
        return {}
    return {layer.name: (stage, assignment.rank_of_stage[stage])
            for stage, layers in enumerate(assignment.stage_layers) for layer in layers}


# ---- predictions -----------------------------------------------------------------------------------------
METRICS = (
    ("step_time_s", "step time", lambda e: e.time.step, "s"),
    ("tokens_per_s", "tokens/s", lambda e: e.tokens_per_s, ""),
    ("peak_memory_bytes", "memory per device", lambda e: e.peak_memory_bytes, "B"),
    ("exposed_comm_s", "comm exposed", lambda e: e.time.communication, "s"),
    ("comm_bytes", "comm volume", lambda e: e.communication.total, "B"),
)
"""What each plan's estimate predicts, as `plandsl estimate` prints it: the step time; tokens per second;
memory per device, the peak over devices (`PlanEstimate.peak_memory_bytes`, the worst device of the worst
pipeline rank); the communication the step waits for, in seconds (`TimeBreakdown.communication`: the
busiest rank's tensor/expert/context/ZeRO-2/3 collectives inside F and B plus the data-parallel reduction
not hidden behind the backward); and the communication volume per step, the bytes one device of the busiest
pipeline rank moves (`PlanEstimate.communication`: every collective and pipeline message of the step, hidden or
not, at the sizes the cost model prices them)."""


def predictions(a: ir.Plan, b: ir.Plan, old: PlanEstimate, new: PlanEstimate) -> tuple[Prediction, ...]:
    """Each metric of `METRICS` for both plans; not comparable where the plans train different models (every
    metric) or run on different clusters (the times: other hardware; memory and communication volume per device
    still compare)."""
    other_model = _dump(a.model) != _dump(b.model)
    other_cluster = _dump(a.cluster) != _dump(b.cluster)
    result = []
    for metric, _, value, _ in METRICS:
        why = None
        if other_model:
            why = "the plans train different models"
        elif other_cluster and metric not in ("peak_memory_bytes", "comm_bytes"):  # bytes are not the hardware's
            why = "the plans run on different clusters"
        result.append(Prediction(metric, value(old), value(new), why is None, why))
    return tuple(result)


# ---- rendering -------------------------------------------------------------------------------------------
def _text(value: Value) -> str:
    if value is None:
        return "(none)"
    if isinstance(value, list) and all(isinstance(v, (str, int)) for v in value):
        return "[" + ", ".join(map(str, value)) + "]"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value) if not isinstance(value, (list, dict)) else _compact(value)


def _compact(value: Value) -> str:
    text = json.dumps(value, separators=(",", ":"), sort_keys=True)
    return text if len(text) <= 60 else text[:57] + "..."


def _figure(value: float, unit: str) -> str:
    if unit == "B":
        return format_bytes(value)
    return f"{value:.4g}" + (f" {unit}" if unit else "")


def _names(diff: PlanDiff) -> tuple[str, str]:
    if diff.files is None:
        return f"'{diff.a}'", f"'{diff.b}'"
    return f"'{diff.a}' ({diff.files[0]})", f"'{diff.b}' ({diff.files[1]})"


def format_diff(diff: PlanDiff) -> str:
    """The diff as `plandsl diff` prints it: changes by section, moved layers, then the predictions."""
    a, b = _names(diff)
    if diff.identical:
        lines = [f"plans {a} and {b} are identical (same layout, placement, schedule, batch and training)"]
    else:
        moved = sum(len(m.layers) for m in diff.moved)
        lines = [f"plan {a} -> plan {b}: {len(diff.changes)} change(s), {moved} layer(s) moved"]
    for section in SECTIONS:
        changes = [c for c in diff.changes if c.section == section]
        if changes:
            lines.append(f"  {section}")
            lines += [f"    {c.field:<26} {_text(c.old)} -> {_text(c.new)}" for c in changes]
    if diff.moved:
        lines.append("  moved layers (stage/pipeline rank)")
        lines += [f"    {compress_names(list(m.layers), None):<26} {m.old[0]}/{m.old[1]} -> {m.new[0]}/{m.new[1]}"
                  for m in diff.moved]
    if diff.identical:
        return "\n".join(lines)
    lines.append("  predicted (cost model, as `plandsl estimate`)")
    for prediction, (_, label, _, unit) in zip(diff.predictions, METRICS):
        relative = "same" if prediction.change == 0 else \
            f"{prediction.relative:+.1%}" if prediction.relative is not None else "from 0"
        note = f"   not comparable: {prediction.why}" if not prediction.comparable else f"   ({relative})"
        lines.append(f"    {label:<26} {_figure(prediction.old, unit)} -> {_figure(prediction.new, unit)}{note}")
    lines.append("  memory per device: the peak over devices; comm exposed: the seconds of communication the step "
                 "waits for; comm volume: the bytes one device of the busiest pipeline rank moves per step")
    return "\n".join(lines)


def _round(value: float) -> float:
    return float(f"{value:.6g}")


def diff_json(diff: PlanDiff) -> dict:
    """The diff's stable structure (docs/cli.md, "diff"); figures to 6 significant digits."""
    files = diff.files or (None, None)
    return {"version": DIFF_VERSION, "a": {"plan": diff.a, "file": files[0]}, "b": {"plan": diff.b, "file": files[1]},
            "identical": diff.identical,
            "changes": [{"section": c.section, "field": c.field, "old": c.old, "new": c.new} for c in diff.changes],
            "moved_layers": [{"layers": list(m.layers), "old": {"stage": m.old[0], "rank": m.old[1]},
                              "new": {"stage": m.new[0], "rank": m.new[1]}} for m in diff.moved],
            "predictions": [{"metric": p.metric, "old": _round(p.old), "new": _round(p.new),
                             "change": _round(p.change),
                             "relative": None if p.relative is None else _round(p.relative),
                             "comparable": p.comparable, "why": p.why} for p in diff.predictions]}


__all__ = ["DIFF_VERSION", "FIELDS", "METRICS", "Change", "MovedLayers", "Prediction", "PlanDiff", "diff_plans",
           "changes", "moved_layers", "predictions", "format_diff", "diff_json"]
