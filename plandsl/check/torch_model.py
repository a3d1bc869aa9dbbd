"""A model from torch (`hf(...)`, `factory(...)` with a layer table) against the plan, by its own names:
tied parameters split over pipeline stages (E412), tensor parallelism with no plan to apply (E413), its
own tensor-parallel plan and the plan's styled shard rules against the real module tree (E405 an entry of a
module's own plan naming nothing, E406 a split dim or head count the axis does not divide, E414 a style torch
cannot apply to that module, or an entry naming a parameter; a transformers model's entries naming nothing were
left out by the lowering, as transformers skips them).

Stage: checker. Reads only the IR (`ir.CustomModel`'s modules, parameters, tied pairs and tp_plan).
"""
from __future__ import annotations

from typing import Iterator

from plandsl import ir
from plandsl.diagnostics import Diagnostic, diag
from plandsl.ir import torch_plan
from plandsl.ir.placement import Assignment, assign_stages, matches
from plandsl.ir.shapes import indivisible

NEAREST_HINTS = 20
"""E405s of one table whose hint searches for the nearest module names; the others name the first module names: each
search is over every module's name."""


def check_torch_model(plan: ir.Plan, placement_ok: bool = True) -> Iterator[Diagnostic]:
    """`placement_ok`: whether the placement checked clean (else the tied pairs are not checked)."""
    model = plan.model
    if not isinstance(model, ir.CustomModel) or not model.source or not model.modules:
        return
    if model.positions and plan.seq > model.positions:
        # a seq the plan does not write is the model's table's (its config's positions, else 2048, `model_seq`)
        given = "" if "seq" in plan.train.field_spans else ", the sequence its table was made at: train writes none"
        yield diag("E224", f"train seq ({plan.seq}{given}) is longer than the {model.positions} learned positions of "
                   f"{_name(model)}: its position embedding has one row per position, and a longer sequence looks "
                   "up rows that do not exist (every rank would fail at its first step)",
                   plan.train.span_of("seq") or model.span,
                   hint=f"`seq: {model.positions}` in train (or less), or more positions in the model's config "
                        "(n_positions, max_position_embeddings)")
    assignment = assign_stages(plan)[0] if placement_ok and plan.stages is not None else None
    if assignment is not None and assignment.num_stages > 1:
        yield from _tied_across_stages(plan, model, assignment)
    if plan.tensor is not None and plan.tp > 1:
        yield from _tensor_plan(plan, model)
    yield from _styled_rules(plan, model)


def _tied_across_stages(plan: ir.Plan, model: ir.CustomModel, assignment: Assignment) -> Iterator[Diagnostic]:
    stage_of = {layer.name: stage for stage, layers in enumerate(assignment.stage_layers) for layer in layers}
    layer_of = torch_plan.layer_of_module(model)
    for param, first in model.tied:
        here, there = layer_of.get(param.rpartition(".")[0]), layer_of.get(first.rpartition(".")[0])
        if here is None or there is None or stage_of.get(here) == stage_of.get(there):
            continue
        untie = ("add `tie_word_embeddings=false` to the hf(...) call" if model.source.startswith("hf(")
                 else "give the two modules their own parameters in the factory")
        yield diag("E412", f"'{param}' is the same tensor as '{first}', but its layer '{here}' is on pipeline stage "
                   f"{stage_of[here]} and '{there}' on stage {stage_of[there]}: a module from torch is split into "
                   "stages that cannot share a parameter", plan.stages.span,
                   hint=f"untie them: {untie} (each end then trains its own weight); or keep '{here}' and "
                        f"'{there}' on one stage (stages hold consecutive layers, so only without a pipeline)")


def _tensor_plan(plan: ir.Plan, model: ir.CustomModel) -> Iterator[Diagnostic]:
    axis, size, span = plan.tensor.axis, plan.tp, plan.tensor.span
    styled = [rule for rule in plan.shard if rule.style in ("colwise", "rowwise") and rule.axis == axis]
    if not model.tp_plan:
        if not styled:
            yield diag("E413", f"tensor parallel over '{axis}', but {_name(model)} has no tensor-parallel plan "
                       "(no `base_model_tp_plan`/`_tp_plan`) and no shard rule splits its modules over "
                       f"'{axis}'", span, hint=_rules_hint(model, axis))
        return
    modules = dict(model.modules)
    shapes = _shapes(model)
    indexed, tensors = torch_plan.Names(modules), None  # each pattern's matches without a scan of every name
    looks, searched = None, 0  # the module names as patterns, for E405's hint
    for pattern, style in model.tp_plan:
        if style not in torch_plan.KNOWN_STYLES:
            yield diag("E414", f"{_name(model)}'s tensor-parallel plan gives '{pattern}' the style '{style}', "
                       "which plandsl cannot check or apply", span,
                       hint="styles plandsl applies: " + ", ".join(sorted(torch_plan.KNOWN_STYLES))
                       + f"; or drop the tensor axis '{axis}'")
            continue
        hit = indexed.matching(pattern)
        if not hit and tensors is None:
            tensors = torch_plan.Names([name for name, _ in model.parameters] + [name for name, _ in model.tied])
        named = [] if hit else tensors.matching(pattern)
        if not hit and not named:  # a transformers plan's entries naming nothing were left out (`torch_names`)
            # every such entry is reported; the first NEAREST_HINTS with the nearest names, a search over every
            # module's (a table of 2,000 such entries over 2,000 modules took 11 s of `check`, 8,000 three minutes)
            looks = torch_plan.shapes_of(modules) if looks is None else looks
            searched += 1
            yield diag("E405", f"{_name(model)}'s tensor-parallel plan names '{pattern}', which matches no module",
                       span, hint="modules look like " + (torch_plan.closest(pattern, modules, looks)
                                                          if searched <= NEAREST_HINTS else ", ".join(looks[:3])))
            continue
        if not hit:
            yield diag("E414", f"{_name(model)}'s tensor-parallel plan gives '{pattern}' the style '{style}', and it "
                       f"names the parameter '{named[0]}', not a module: plandsl applies "
                       "torch's styles to whole modules (`parallelize_module`)", span,
                       hint=f"drop the tensor axis '{axis}' (give its devices to data or expert parallelism)")
            continue
        yield from _split(hit, style, modules, shapes, axis, size, span, f"its plan's '{pattern}' ({style})")
    yield from _heads(model, axis, size, span)


def _styled_rules(plan: ir.Plan, model: ir.CustomModel) -> Iterator[Diagnostic]:
    """The plan's `shard SELECTOR = colwise|rowwise over AXIS` on a torch model's modules."""
    modules = dict(model.modules)
    shapes = _shapes(model)
    holders = list(shapes)
    for rule in plan.shard:
        if rule.style not in ("colwise", "rowwise") or rule.axis is None:
            continue
        hit = [m for m in holders if matches(rule.target, m, prefix=True)]
        yield from _split(hit, rule.style, modules, shapes, rule.axis, plan.mesh.degree(rule.axis), rule.span,
                          f"'{rule.target.text}' ({rule.style})")


def _split(hit: list[str], style: str, modules: dict[str, str], shapes: dict[str, list], axis: str,
           size: int, span, what: str) -> Iterator[Diagnostic]:
    """One diagnostic per rule at most: a module torch cannot split so, or a split dim the axis leaves a
    remainder of."""
    for module in hit:
        splits = [(local, shape, torch_plan.split_dim(style, modules.get(module, ""), local, len(shape)))
                  for local, shape in shapes.get(module, ())]
        if not any(dim is not None for _, _, dim in splits) and style in torch_plan.WHOLE:
            continue
        if not torch_plan.supports_style(modules.get(module, "")):
            yield diag("E414", f"{what} names '{module}', a {modules.get(module, 'module')}: torch's "
                       f"{'Colwise' if 'col' in style else 'Rowwise'}Parallel splits only nn.Linear and nn.Embedding",
                       span, hint="name the Linear modules inside it (e.g. its projections), or replicate it")
            return
        for local, shape, dim in splits:
            if dim is not None and indivisible({local: shape[dim]}, size):
                yield diag("E406", f"dim {dim} of '{module}.{local}' ({shape[dim]}), which {what} splits, is not "
                           f"divisible by axis '{axis}' ({size})", span,
                           hint=f"'{axis}' must divide {shape[dim]}: one of "
                                + ", ".join(str(d) for d in range(1, min(shape[dim], 64) + 1) if shape[dim] % d == 0))
                return


def _heads(model: ir.CustomModel, axis: str, size: int, span) -> Iterator[Diagnostic]:
    """A Hugging Face config's head counts: each rank computes whole heads (the attention reshapes its
    share of q, k, v by the head dim)."""
    for key, value in indivisible(torch_plan.head_counts(model), size).items():
        if value:
            yield diag("E406", f"{key} ({value}) is not divisible by axis '{axis}' ({size}): each tensor-parallel "
                       "rank computes whole attention heads", span,
                       hint=f"'{axis}' must divide {value}: one of "
                            + ", ".join(str(d) for d in range(1, value + 1) if value % d == 0))


def _shapes(model: ir.CustomModel) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
    """Module FQN -> its parameters (local name, shape), a tied one under both its modules."""
    shapes = {name: tuple(shape) for name, shape in model.parameters}
    for name, first in model.tied:
        if first in shapes:
            shapes[name] = shapes[first]
    found: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
    for name, shape in shapes.items():
        module, _, local = name.rpartition(".")
        found.setdefault(module, []).append((local, shape))
    return found


def _name(model: ir.CustomModel) -> str:
    return f"model '{model.name}'"


def _rules_hint(model: ir.CustomModel, axis: str) -> str:
    """Shard rules for the first block's Linear modules (colwise, the last one rowwise), or why there are none."""
    first = model.layers[1].name if len(model.layers) > 2 else None
    linear = [m for m, kind in model.modules if first and m.startswith(first + ".") and torch_plan.supports_style(kind)]
    if not linear:
        return (f"its blocks hold no nn.Linear (torch's tensor-parallel styles split nn.Linear and nn.Embedding): "
                f"give the devices of '{axis}' to data parallelism")
    prefix = first.rpartition(".")[0]
    rules = [f"shard {prefix}.*{m[len(first):]} = {'rowwise' if i == len(linear) - 1 else 'colwise'} over {axis}"
             for i, m in enumerate(linear[:4])]
    return "name the modules to split, e.g. " + "; ".join(rules)
