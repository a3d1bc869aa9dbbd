"""A partial plan as the search's input: what it fixes becomes pins, the search fills in the rest.

Stage: around `plandsl.search` (`plandsl generate --from FILE.plan`). Contract:
`read_partial(path, name)` reads one plan of a file that may leave out the mesh and anything after
it; its model, cluster and `train` (global batch, sequence, precision, optimizer) make the
`Problem`, and every choice it writes is pinned:

- `mesh = [...]`: every degree (dp, tp, pp, cp, ep by the role of each axis) and the axis order;
- `data = KIND over ...`: the ZeRO stage; `stages = ... with virtual = v`: the virtual stages;
  `schedule = NAME` (a built-in): the schedule;
- `micro_batch` and `recompute` written in the plan's `train` dict (or in the `let` it names).

`complete(partial, plan_block)` is the file with the partial plan replaced by the search's plan
under the same name, everything else (imports, comments, other definitions) kept, and the training
settings the search does not choose (optimizer, learning rate, ...) carried over. Bad input raises
`SearchError` with the file's diagnostics.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from plandsl import ir, syntax
from plandsl.check.mesh import axis_group_span
from plandsl.schedules.registry import BUILTIN
from plandsl.search import Problem, SearchError

ZERO_STAGE = {"replicate": 0, "ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp": 3, "hsdp": 3}
SEARCHED_TRAIN_KEYS = ("global_batch", "micro_batch", "seq", "precision", "recompute")
_DEFAULTS = ir.Training(global_batch=1)


@dataclass(frozen=True)
class Partial:
    path: str
    text: str
    name: str                     # the plan's name, kept for the completed plan
    block: tuple[int, int]        # the plan's [start, end) in `text`
    model: str                    # its model and cluster expressions, as written
    cluster: str
    problem: Problem
    pins: dict[str, object]
    train_extra: tuple[str, ...]  # `key: value` items the completed train dict carries over
    train_text: str | None        # the plan's own train expression, when it fixes all the search would choose
    notes: tuple[str, ...] = field(default=())  # what the plan writes that fixes nothing


def read_partial(path: str | Path, name: str | None = None) -> Partial:
    from plandsl import api
    from plandsl.diagnostics import PlanError
    path = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise SearchError(f"cannot read --from {path}: {error}") from None
    try:
        module = api.parse(text, path)
    except PlanError as error:
        raise SearchError(str(error)) from None
    definition = _plan_definition(module, name, path)
    attrs = {item.name: item for item in definition.body or () if isinstance(item, syntax.Attr)}
    for needed in ("model", "cluster", "train"):
        if needed not in attrs:
            raise SearchError(f"{definition.span}: plan '{definition.name}' needs `{needed}` for the search "
                              "(the model, the cluster and the global batch are the problem it solves)")
    start, end = definition.span.start, definition.span.end

    def source(attr: str) -> str:
        value = attrs[attr].value
        return text[value.span.start:value.span.end]

    plan = _lowered(path, text, definition, attrs, source)
    notes = []
    pins: dict[str, object] = {}
    if "mesh" in attrs:
        pins.update(_mesh_pins(plan))
    else:
        for attr in ("tensor", "context", "experts"):
            if attr in attrs:
                notes.append(f"`{attr}` without a mesh fixes nothing: the search chooses its degree "
                             "(write the mesh, or --pin, to fix it)")
    if "mesh" in attrs:  # the plan reads whole: its IR says what it chose
        if plan.data is not None:
            pins["zero_stage"] = plan.data.zero_stage
        if plan.stages is not None:
            pins["virtual_stages"] = plan.stages.virtual
        schedule = plan.schedule.name if plan.schedule and plan.schedule.definition is None else None
        written_schedule = plan.schedule.name if plan.schedule and plan.schedule.definition else None
    else:  # read through the probe, which has no data, stages or schedule: their syntax says it
        pins.update(_choices_without_mesh(attrs))
        name = attrs["schedule"].value if "schedule" in attrs else None
        schedule = name.id if isinstance(name, syntax.Name) and name.id in BUILTIN else None
        written_schedule = None if name is None or schedule else _text_of(text, name)
    if written_schedule:
        raise SearchError(f"{attrs['schedule'].span}: the search chooses among the built-in schedules; "
                          f"'{written_schedule}' is not one (remove it, or run `plandsl estimate` on the "
                          "plan as it is)")
    if schedule:
        pins["schedule"] = schedule
    written = _train_keys(module, attrs["train"].value)
    if "micro_batch" in written:
        pins["micro_batch_size"] = plan.train.micro_batch
    if "recompute" in written:
        pins["recompute"] = plan.train.recompute.value
    problem = Problem(plan.model, plan.cluster, plan.train.global_batch, plan.train.seq, plan.train.precision,
                      plan.train.optimizer)
    kept = source("train") if {"micro_batch", "recompute"} <= written else None
    return Partial(path, text, definition.name, (start, end), source("model"), source("cluster"), problem, pins,
                   _train_extra(plan.train), kept, tuple(notes))


def pins_with(partial: Partial, overrides) -> dict[str, object]:
    """The partial plan's pins, with `overrides` (`--pin K=V`, parsed by `search.parse_pins`) winning."""
    from plandsl.search import parse_pins
    return {**parse_pins(partial.pins), **parse_pins(overrides)}


def render(partial: Partial, scored) -> str:
    """The whole file with the partial plan completed by `scored`."""
    from plandsl.search_emit import Source, plan_text
    block = plan_text(scored, partial.problem, Source((), partial.model, partial.cluster), partial.name,
                      partial.train_extra, partial.train_text)
    return complete(partial, block)


def complete(partial: Partial, plan_block: str) -> str:
    """The file with its partial plan replaced by `plan_block` (the search's plan, same name)."""
    start, end = partial.block
    line_start = partial.text.rfind("\n", 0, start) + 1  # keep the plan's own indentation out
    return partial.text[:line_start] + plan_block.rstrip("\n") + partial.text[end:]


def _plan_definition(module: syntax.Module, name: str | None, path: str) -> syntax.Definition:
    plans = [item for item in module.items if isinstance(item, syntax.Definition) and item.kind == "plan"]
    chosen = [p for p in plans if name is None or p.name == name]
    if not plans:
        raise SearchError(f"{path} has no plan to start from")
    if name is not None and not chosen:
        raise SearchError(f"{path} has no plan '{name}' (its plans: {', '.join(p.name for p in plans)})")
    if len(chosen) > 1:
        raise SearchError(f"{path} has {len(chosen)} plans ({', '.join(p.name for p in chosen)}): name one with --plan")
    return chosen[0]


def _lowered(path: str, text: str, definition: syntax.Definition, attrs: dict, source) -> ir.Plan:
    """The plan as the language reads it. Checks that fail because the layout is not chosen yet (memory,
    batch divisibility) do not matter here; a plan without a mesh is read through a one-device probe."""
    from plandsl import api
    from plandsl.diagnostics import render_all
    if "mesh" in attrs:
        probe_text, probe = text, definition.name
    else:
        probe = "__partial"
        block = (f"plan {probe} {{\n  model = {source('model')}\n  cluster = {source('cluster')}\n"
                 f"  mesh = [dp = 1] over devices[0:1]\n  train = {source('train')}\n}}")
        probe_text = text[:definition.span.start] + block + text[definition.span.end:]
    analysis = api.checks(probe_text, path=path)
    plans = [p for p in (analysis.document.plans if analysis.document else ()) if p.name == probe]
    if not plans:
        errors = [d for d in analysis.diagnostics if d.is_error]
        raise SearchError(f"--from {path}: the plan does not read:\n" + render_all(errors, analysis.sources))
    return plans[0]


def _text_of(text: str, node: syntax.Node) -> str:
    return text[node.span.start:node.span.end]


def _choices_without_mesh(attrs: dict) -> dict[str, object]:
    """`data = KIND over ...` -> its ZeRO stage; `stages = ... with virtual = v` -> v (a literal)."""
    pins: dict[str, object] = {}
    data = attrs["data"].value if "data" in attrs else None
    if isinstance(data, syntax.Clause) and isinstance(data.subject, syntax.Name) and data.subject.id in ZERO_STAGE:
        pins["zero_stage"] = ZERO_STAGE[data.subject.id]
    stages = attrs["stages"].value if "stages" in attrs else None
    if isinstance(stages, syntax.Clause):
        written = [o.value for o in stages.options if o.name == "virtual"]
        if not written:
            pins["virtual_stages"] = 1
        elif isinstance(written[0], syntax.Int):
            pins["virtual_stages"] = written[0].value
    return pins


def _mesh_pins(plan: ir.Plan) -> dict[str, object]:
    roles = {}
    if plan.tensor is not None:
        roles[plan.tensor.axis] = "tp"
    if plan.stages is not None:
        roles[plan.stages.axis] = "pp"
    if plan.context is not None:
        roles[plan.context.axis] = "cp"
    if plan.experts is not None:
        roles.setdefault(plan.experts.axis, "ep")
    for axis in plan.data.axes if plan.data is not None else ():
        roles.setdefault(axis, "dp")
    pins: dict[str, object] = {"dp": plan.dp, "tp": plan.tp, "pp": plan.pp, "cp": plan.cp, "ep": plan.ep}
    if plan.tensor is not None and axis_group_span(plan, plan.tensor.axis) > 1:
        pins["tp_across_nodes"] = True  # the plan chose it (W302 says so when it is checked)
    order = [roles.get(axis.name) for axis in plan.mesh.axes if axis.size > 1]
    if None not in order and len(set(order)) == len(order):  # hsdp's two data axes have no single order
        pins["order"] = ",".join(order)
    return pins


def _train_keys(module: syntax.Module, value: syntax.Expr) -> set[str]:
    """The keys the plan's train dict writes (through a `let` of the same file too)."""
    if isinstance(value, syntax.Name):
        lets = {item.name: item.value for item in module.items if isinstance(item, syntax.Let)}
        value = lets.get(value.id, value)
    if isinstance(value, syntax.DictExpr):
        return {item.key for item in value.items}
    return set()


def _train_extra(train: ir.Training) -> tuple[str, ...]:
    """The settings the search does not choose, where they differ from the language's defaults."""
    items = []
    for key in ("optimizer", "lr", "lr_schedule", "warmup_steps", "grad_clip", "seed"):
        value = getattr(train, key)
        if value == getattr(_DEFAULTS, key):
            continue
        if isinstance(value, ir.Optimizer):
            value = value.value
        items.append(f"{key}: {'none' if value is None else value}")
    return tuple(items)


__all__ = ["Partial", "read_partial", "pins_with", "render", "complete"]
