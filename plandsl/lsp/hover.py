"""Hover: what the thing under the cursor is, in markdown. A name: its resolved value with units (a
device's figures and the memory the file's plans are estimated to take of it; a plan: `plandsl show`'s
summary and `plandsl estimate`'s figures); a layer of a plan's model: its parameters and its stages; a
diagnostic's or a written code's explanation (`plandsl explain`); a built-in schedule; a unit."""
from __future__ import annotations

import re
from typing import Any

from plandsl import api, ir
from plandsl import syntax as s
from plandsl.ir.layers import Layer, layers_of, param_count
from plandsl.ir.placement import assign_stages, compress_names
from plandsl.lower.evaluate import Q, Rep, Word
from plandsl.lower.names import Poison
from plandsl.lower.units import (
    BANDWIDTH,
    BYTES,
    FLOPS,
    UNITS,
    format_bytes,
    format_count,
)
from plandsl.lsp.document import Snapshot
from plandsl.schedules.registry import BUILTIN

CODE = re.compile(r"^[EW][0-9]{3}$")
BINARY_OR_BITS = re.compile(r"^[KMGTP]i|b")  # units left out of a value's display: binary prefixes, bits
MAX_VALUE_TEXT = 400  # characters of a value shown; a list of 10,000 layers is not a hover
MAX_TENSORS = 12  # parameter tensors of one layer listed
MODELS = (ir.TransformerModel, ir.MLPModel, ir.CustomModel)  # ir.Model's members


def hover_text(snapshot: Snapshot, offset: int) -> str | None:
    """Markdown for the cursor at character `offset`, or None when there is nothing to say."""
    parts = [_diagnostic(d) for d in snapshot.analysis.diagnostics
             if d.span.file == snapshot.path and d.span.start <= offset <= d.span.end and d.span.line >= 1]
    word = snapshot.word_at(offset)
    if word is not None:
        found = _word(snapshot, word[2], offset)
        if found:
            parts.append(found)
    return "\n\n---\n\n".join(dict.fromkeys(parts)) or None


def _diagnostic(problem) -> str:
    """The catalogue's title and meaning of a diagnostic's code (`E201: unknown name`, then a paragraph)."""
    parts = (api.explain(problem.code) or problem.code).split("\n\n")
    meaning = " ".join(parts[1].split()) if len(parts) > 1 else ""
    return f"**{parts[0]}**\n\n{meaning}\n\n(`plandsl explain {problem.code}`: an example and its fix)"


def _word(snapshot: Snapshot, word: str, offset: int) -> str | None:
    if CODE.match(word):
        text = api.explain(word)
        return f"```\n{text}\n```" if text else None
    names = snapshot.names
    if names is not None:
        if names.find(word) is not None:
            return _name(snapshot, word)
        axis = snapshot.axis(offset, word)
        if axis is not None:
            return f"mesh axis **{axis.name}** of size {axis.size}"
        definition = names.enclosing(offset)
        layer = _layer(snapshot, definition, word) if definition is not None else None
        if layer:
            return layer
    if word in BUILTIN:
        return f"schedule **{word}** (built-in): {BUILTIN[word].summary}"
    if word in UNITS:
        dimension, factor = UNITS[word]
        return f"unit **{word}**: {dimension.name}, {factor:g} in SI units"
    return None


def _name(snapshot: Snapshot, name: str) -> str:
    names = snapshot.names
    scope, node = names.find(name)
    kind = node.kind if isinstance(node, s.Definition) else ("param" if isinstance(node, s.Param) else "let")
    where = "" if scope is names.scope else f" (from `{scope.file}`)"
    try:
        value = names.value(name)
    except Poison:
        return f"{kind} **{name}**{where}: has errors (see the diagnostics)"
    if isinstance(value, ir.Plan):
        return _plan(snapshot, value, where)
    if isinstance(value, ir.DeviceType):
        return f"device **{name}**{where}\n\n" + _device(snapshot, value)
    return f"{kind} **{name}**{where} = {_value(value)}"


def _plan(snapshot: Snapshot, plan: ir.Plan, where: str) -> str:
    """`plandsl show`'s summary of the plan, and `plandsl estimate`'s figures when it checks."""
    text = f"plan **{plan.name}**{where}\n\n```\n{api.describe(snapshot.document, [plan])}\n```"
    lowered = snapshot.plan(plan.name)  # the analysis's own plan, which the checker saw
    estimate = snapshot.estimate(lowered) if lowered is not None else None
    if estimate is not None:
        text += f"\n\n```\n{api.format_estimate(estimate)}\n```"
    return text


def _device(snapshot: Snapshot, device: ir.DeviceType) -> str:
    """A device's figures, and the peak memory per device the file's checked plans are estimated at on it."""
    lines = [(f"memory {format_bytes(device.memory)} ({format_bytes(device.usable_memory)} usable), "
             f"bandwidth {quantity(device.bandwidth, BANDWIDTH)}"),
             "peak " + ", ".join(f"{p.value} {quantity(v, FLOPS)}" for p, v in device.peak.items())]
    for plan in snapshot.document.plans if snapshot.document else ():
        if not any(group.node.device.name == device.name for group in plan.cluster.groups):
            continue
        estimate = snapshot.estimate(plan)
        if estimate is not None:
            capacity = min(estimate.capacity, default=0)
            lines.append(f"plan {plan.name}: peak {format_bytes(estimate.peak_memory_bytes)} of "
                         f"{format_bytes(capacity)} per device (estimate)"
                         + ("" if estimate.fits else ": does not fit"))
    return "\n\n".join(lines)


def _layer(snapshot: Snapshot, definition: s.Definition, word: str) -> str | None:
    """A layer (or a group, `layers` for `layers.0` ...) of the model of the plan or model around the cursor:
    its parameters and, in a plan, the stages and pipeline ranks that hold it."""
    plan = snapshot.plan(definition.name) if definition.kind == "plan" else None
    model = plan.model if plan else next((m for m in (snapshot.document.models if snapshot.document else ())
                                          if m.name == definition.name and definition.kind == "model"), None)
    if model is None:
        return None
    chosen = [layer for layer in layers_of(model) if layer.name == word or layer.name.startswith(word + ".")]
    if not chosen:
        return None
    text = f"layer{'s' if len(chosen) > 1 else ''} **{compress_names([layer.name for layer in chosen])}** of model " \
           f"`{model.name}`: {format_count(sum(layer.param_count for layer in chosen))} parameters " \
           f"(of {format_count(param_count(model))}), {_kinds(chosen)}"
    if len(chosen) == 1:
        shown = list(chosen[0].params[:MAX_TENSORS])
        text += "\n\n" + "\n".join(f"- `{p.name}` {list(p.shape)}" for p in shown)
        if len(chosen[0].params) > MAX_TENSORS:
            text += f"\n- ... ({len(chosen[0].params)} tensors)"
    if plan is not None and plan.stages is not None:
        assignment, _ = assign_stages(plan)
        if assignment is not None:
            names = {layer.name for layer in chosen}
            stages = [i for i, layers in enumerate(assignment.stage_layers) if any(x.name in names for x in layers)]
            text += "\n\n" + "; ".join(f"stage {i} on pipeline rank {assignment.rank_of_stage[i]}" for i in stages[:16])
            if len(stages) > 16:
                text += f"; ... ({len(stages)} stages)"
    return text


def _kinds(layers: list[Layer]) -> str:
    kinds = dict.fromkeys(layer.kind for layer in layers)
    return ", ".join(kinds)


def quantity(value: float, dimension) -> str:
    """`value` (SI) in the largest unit of its dimension that keeps it >= 1: 2.039e12 B/s -> `2.039 TB/s`."""
    if dimension == BYTES:
        return format_bytes(value)
    units = sorted(((factor, unit) for unit, (d, factor) in UNITS.items()  # decimal prefixes; bytes, not bits
                    if d == dimension and not BINARY_OR_BITS.search(unit)), reverse=True)
    for factor, unit in units:
        if abs(value) >= factor:
            return f"{value / factor:.4g} {unit}"
    return f"{value:.4g} {units[-1][1]}" if units else f"{value:.4g}"


def _value(value: Any) -> str:
    if isinstance(value, Q):
        text = f"{quantity(value.value, value.dimension)} ({value.value:g} SI, {value.dimension.name})"
    elif isinstance(value, bool) or value is None:
        text = str(value).lower()
    elif isinstance(value, (int, float)):
        text = f"{value:,}" if isinstance(value, int) else f"{value:g}"
    elif isinstance(value, str):
        text = f'"{value}"'
    elif isinstance(value, Word):
        text = f"`{value.name}` (a word: its meaning depends on where it is used)"
    elif isinstance(value, Rep):
        text = f"{_value(value.count)} x {_value(value.thing)}"
    elif isinstance(value, MODELS):
        text = f"{value.kind} model, {format_count(param_count(value))} parameters, {len(layers_of(value))} layers"
    elif isinstance(value, ir.Cluster):
        text = f"{value.num_nodes} node(s), {value.num_devices} devices ({value.name})"
    elif isinstance(value, ir.NodeType):
        text = f"{value.devices} x {value.device.name}, link {quantity(value.link.bandwidth, BANDWIDTH)}"
    elif isinstance(value, ir.Node):
        text = type(value).__name__
    elif isinstance(value, (list, tuple)):
        text = "[" + ", ".join(_value(v) for v in value[:16]) + (", ..." if len(value) > 16 else "") + "]"
    else:
        text = str(value)
    return text if len(text) <= MAX_VALUE_TEXT else text[:MAX_VALUE_TEXT] + " ..."
