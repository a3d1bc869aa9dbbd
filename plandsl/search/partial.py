"""A partial plan as the search's input: what it writes is kept (and pinned), the search fills in the rest.

Stage: around `plandsl.search` (`plandsl generate --from FILE.plan`). Contract:
`read_partial(path, name, params)` reads one plan of a file that may leave out the mesh and anything
after it, and checks it the way `plandsl check` does (the same codes at the plan's own lines; a plan
without a mesh is checked through a probe mesh whose axes are the ones its lines name, and only the
problems no layout could fix are reported). Its model, cluster and `train` make the `Problem`, and every
decision it writes becomes a pin:

- `mesh = [...]`: every degree (dp, tp, pp, cp, ep by the role of each axis) and the axis order;
- `data = KIND`: the ZeRO stage; `stages` (a clause or a `stages { }` block, its `virtual` and `map`):
  the virtual stages and, where they fix it, the pipeline degree; `schedule = NAME`: a built-in
  schedule, or (a table) its ranks and microbatches;
- `micro_batch` and `recompute` written in the plan's `train` (or a train the file cannot see into);
- `experts = ...`: the clause; a mixture of experts without one (`experts_free`) leaves its folding over tp and its
  dispatcher to the search, as `generate` without `--from` does (`Problem.search_experts`).

What the search cannot keep is refused with an E801 diagnostic at its line, and a `--pin` that contradicts a written
line with E803 at it (`pins_with`; one of the train's values the completion writes wins instead); pins the search finds
contradictory are E803 at the written line a `--pin` meets, or naming the `--pin`s that meet each other (`refusal`).
Errors raise `PlanError`.
`search_complete` writes the completed file.
"""
from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass, field, replace
from collections.abc import Mapping
from pathlib import Path

from plandsl import ir, syntax
from plandsl.check.mesh import axis_group_span
from plandsl.diagnostics import Diagnostic, Note, PlanError, diag, did_you_mean
from plandsl.search import CONTEXT, Problem, SearchError, fixed_virtual, parse_pins, pins_conflict
from plandsl.diagnostics.source import SourceFile, Span
from plandsl.syntax.parser import parse_text
from plandsl.syntax.loader import read_source
from plandsl.check.analysis import analyze
from plandsl.schedules.registry import BUILTIN
from plandsl.ir.placement import assign_stages
from plandsl.ir.layers import layers_of
from plandsl.search.figures import placed_layers

ROLE_ATTR = {"dp": "data", "tp": "tensor", "cp": "context", "ep": "experts", "pp": "stages"}
ATTR_ROLE = {attr: role for role, attr in ROLE_ATTR.items()}
DEFAULT_NAMES = {"dp": "dp", "tp": "tp", "cp": "cp", "ep": "ep", "pp": "pp"}
# Problems of a probe (one device per axis) that a layout chosen by the search may not have.
_PROBE_LAYOUT = {"E503", "E602", "E603", "E604", "E605", "E606", "E607", "E608"}


@dataclass(frozen=True)
class Partial:
    path: str
    text: str
    module: syntax.Module
    definition: syntax.Definition
    attrs: dict                   # the plan's attributes by name (syntax.Attr)
    stage_block: syntax.Block | None
    plan: ir.Plan                 # the plan as written (through the probe mesh when it writes none)
    problem: Problem
    pins: dict[str, object]
    names: dict[str, str]         # role (dp, tp, ...) -> the mesh axis that carries it
    overs: tuple[tuple[int, str], ...]  # (offset, " over AXIS") for lines that name no axis yet
    train_items: tuple[tuple[str, str], ...] | None  # the train dict's (key, text), when the file writes it
    train_local: bool             # the train dict is written in the plan itself (edited in place)
    params: dict | None = None
    notes: tuple[str, ...] = field(default=())
    decided: bool = False         # the plan leaves the search nothing to choose: it is estimated as written
    # pin key -> (its value as the plan writes it, the span of what writes it): `pins` and what a written data line or
    # mesh implies of the data pins (`data`, `dp_shard`), a built-in schedule of the stages per rank (`virtual_stages`);
    # `pins_with` compares `--pin` with them
    written_pins: dict[str, tuple[object, Span]] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.definition.name

    @property
    def mesh_written(self) -> bool:
        return "mesh" in self.attrs

    def written(self, attr: str) -> bool:
        return attr in self.attrs or (attr == "stages" and self.stage_block is not None)


def read_partial(path: str | Path, name: str | None = None, params: dict | None = None,
                 text: str | None = None) -> Partial:
    """`params`: values for the file's `param`s (`--param`); `text`: the file's text, already read."""
    path = str(path)
    if text is None:
        text = _read(path)
    module = parse_text(text, path)  # PlanError (E1xx) when it does not parse
    source = SourceFile(path, text)
    definition = _plan_definition(module, name, path)
    attrs = {item.name: item for item in definition.body or () if isinstance(item, syntax.Attr)}
    blocks = [item for item in definition.body or () if isinstance(item, syntax.Block) and item.name == "stages"]
    stage_block = blocks[0] if blocks else None
    missing = [key for key in ("model", "cluster", "train") if key not in attrs]
    if missing:
        raise PlanError([diag("E207", f"plan '{definition.name}' is missing '{key}'", definition.name_span,
                              hint=f"add `{key} = ...`: the model, the cluster and the train's global batch are "
                                   "the problem the search solves") for key in missing], {path: source})
    refused = _unkept(definition, attrs, stage_block)
    names, overs, refused2 = _axis_names(attrs, stage_block)
    refused += refused2
    if refused:
        raise PlanError(refused, {path: source})
    plan = _checked(path, text, source, definition, attrs, stage_block, names, overs, params)
    notes: list[str] = []
    pins: dict[str, object] = {}
    if "mesh" in attrs:
        refused = _mesh_refusals(plan, attrs)
        if refused:
            raise PlanError(refused, {path: source})
        pins.update(_mesh_pins(plan))
        pins.update({k: v for k, v in _pipeline_pins(plan, stage_block).items() if k != "pp"})
    else:
        pins.update(_pipeline_pins(plan, stage_block))
        for attr, role in ATTR_ROLE.items():  # `data = none`, `tensor = none`, ...: none of that parallelism
            if attr in attrs and attr != "stages" and getattr(plan, attr) is None:
                pins[role] = 1
    if "data" in attrs and plan.data is not None:
        pins["zero_stage"] = plan.data.zero_stage
        # hsdp, not zero3 over one axis (the stage's kind), and its shard axis as written; where the written mesh
        # gives its replicas or its shard axis one rank, a split the search does not lay out (`Candidate.shard`:
        # two replicas or more of two ranks or more), the stage alone (the written lines stay, as every decision)
        written = "mesh" in attrs
        shard = plan.mesh.degree(plan.data.axes[-1]) if plan.data.hybrid and written else 0
        if plan.data.hybrid and (not written or 1 < shard < math.prod(plan.mesh.degree(a) for a in plan.data.axes)):
            pins["data"] = "hsdp"
            if written:
                pins["dp_shard"] = shard
    elif "mesh" in attrs and plan.data is None:  # a written mesh without data shards nothing (`Candidate.data_axis`)
        pins["zero_stage"] = 0
    if ("stages" in attrs or stage_block is not None) and plan.stages is not None:
        pins["virtual_stages"] = 2 if plan.stages.rank_map == "vshape" else plan.stages.virtual
        if plan.stages.account:  # the written split's: what `evenly ... with account` counts
            pins["account"] = plan.stages.account
    if "schedule" in attrs and plan.schedule is not None and plan.schedule.definition is None:
        pins["schedule"] = plan.schedule.name
    elif plan.schedule is not None and plan.schedule.definition is not None:
        pins.setdefault("virtual_stages", 1)  # a written schedule runs one stage per rank unless the stages say
    train_items, local = _train_items(module, attrs["train"].value, text)
    keys = {key for key, _ in train_items} if train_items is not None else None
    if keys is None or "micro_batch" in keys:
        pins["micro_batch_size"] = plan.train.micro_batch
    if keys is None or "recompute" in keys:
        pins["recompute"] = plan.train.recompute.value
        if plan.train.recompute_layers:  # the first N blocks of each stage: as written
            pins["recompute_layers"] = plan.train.recompute_layers
        if plan.train.recompute_modules is not None:  # what selective reruns: as written
            pins["recompute_modules"] = tuple(m.value for m in plan.train.recompute_modules)
    if keys is None or "offload_layers" in keys:  # as written, 0 included: the search keeps what the plan says
        pins["offload_layers"] = plan.train.offload_layers
    if keys is None:
        notes.append(f"`train` is not a dict of this file: its micro_batch ({plan.train.micro_batch}) and "
                     f"recompute ({plan.train.recompute.value}) are kept as they are")
    if "tensor" in attrs and plan.tensor is not None:  # the written line is kept as it is: search what it says
        pins["sequence_parallel"] = plan.tensor.sequence_parallel
    cluster = _covered(plan) if "mesh" in attrs else plan.cluster  # the devices a written mesh lays out
    searched = experts_free(attrs, plan)
    if searched and plan.tensor is not None and "tensor" in attrs and not plan.tensor.sequence_parallel:
        pins["fold"] = False  # folding the experts over the tensor axis needs its sequence parallelism (E416)
    problem = Problem(plan.model, cluster, plan.train.global_batch, plan.train.seq, plan.train.precision,
                      plan.train.optimizer, plan.train.master_dtype, plan.train.grad_dtype, plan.train.optimizer_dtype,
                      plan.train.param_dtype, plan.train.kernels,
                      overlap_experts=bool(plan.experts and plan.experts.overlap), attention=plan.train.attention,
                      loss=plan.train.loss, fold_experts=bool(plan.experts and plan.experts.fold),
                      overlap_tensor=bool(plan.tensor and plan.tensor.overlap),
                      tensor_overlap=plan.tensor.implementation if plan.tensor else ir.TensorOverlap.async_tp,
                      sm_margin=plan.tensor.sm_margin if plan.tensor else True,
                      tensor_stack=plan.tensor.stack if plan.tensor else None,
                      # a written data clause gathers as it says (`data = none`: nothing); else the search's choice
                      gathering=(plan.data.gathering if plan.data is not None else ir.FSDP_GATHERING)
                      if "data" in attrs else None,
                      dispatcher=plan.experts.kind if plan.experts else "alltoall", fp8_recipe=plan.train.fp8_recipe,
                      bf16_first_layers=plan.train.bf16_first_layers, bf16_last_layers=plan.train.bf16_last_layers,
                      context=plan.context.kind if plan.context else CONTEXT,
                      ring=plan.context.implementation if plan.context else "te", search_experts=searched,
                      pipeline=plan.stages.implementation if plan.stages else "torch",
                      stages_kept="stages" in attrs or stage_block is not None,  # at pp=1 too: its engine runs
                      data_kept="data" in attrs and plan.data is not None,  # at dp=1 too: its units held
                      stage_map=plan.stages.rank_map if ("stages" in attrs or stage_block is not None)
                      and plan.stages is not None else None,  # the schedules that place its stages so (E409)
                      stages_block=stage_block is not None,  # a `stages { }` block, not a line (its messages say so)
                      split=_kept_split(plan) if ("stages" in attrs or stage_block is not None) else None,
                      outputs=plan.stages.outputs if plan.stages else "dropped",
                      shard=_conventional_rules(plan.shard, names),
                      # a written mesh or data line of one data axis leaves no room for hsdp's two (the line stays)
                      hybrid=not (("mesh" in attrs or "data" in attrs)
                                  and not (plan.data is not None and plan.data.hybrid)))
    decided = "mesh" in attrs and not free_choices(attrs, stage_block, plan)
    pins = parse_pins(pins)
    return Partial(path, text, module, definition, attrs, stage_block, plan, problem, pins, names,
                   tuple(overs), train_items, local, params, tuple(notes), decided,
                   _written_pins(pins, attrs, stage_block, plan, module))


# The train's keys the completion writes as the candidate has them (`rewrite.complete._train_edits`): a `--pin` of one
# wins over the value the plan writes, and the completed plan says the pin's value (with a note)
TRAIN_PINS = {"micro_batch_size": "micro_batch", "recompute": "recompute", "recompute_layers": "recompute_layers",
              "offload_layers": "offload_layers", "recompute_modules": "recompute_modules"}
_DATA_PINS = ("zero_stage", "data", "dp_shard")


def _written_pins(pins: dict, attrs: dict, stage_block, plan: ir.Plan, module: syntax.Module) -> dict:
    """Each pin the plan's text decides, as (value, span of the line, block or train item that writes it); the data
    pins a written data line (or a mesh without one) implies are added: its kind, and `dp_shard` 0 where it has one
    data axis (a written mesh without a data line: one data axis, the search lays out no hsdp under it), so that a
    `--pin` naming another is found contradicting the line; hsdp's `dp_shard` is the written mesh's (its shard axis's
    degree: the data line names the axis, the mesh sizes it); and the stages per rank a built-in schedule written
    without stages fixes (`schedule = 1f1b`: one)."""
    stages = stage_block if stage_block is not None else attrs.get("stages")
    schedule = attrs.get("schedule")

    def origin(key: str):
        if key in ("dp", "tp", "pp", "cp", "ep", "order", "tp_across_nodes", "dp_shard") and "mesh" in attrs:
            return attrs["mesh"]
        if key == "pp":  # without a mesh: a stage map or block, else a schedule table (`_pipeline_pins`)
            return stages if stages is not None and (stage_block is not None or (
                plan.stages is not None and isinstance(plan.stages.rank_map, tuple))) else schedule
        if key in ATTR_ROLE.values():  # `data = none`, `tensor = none`, ...
            return attrs[ROLE_ATTR[key]]
        if key in _DATA_PINS:
            return attrs.get("data") or attrs["mesh"]
        if key in ("virtual_stages", "account"):
            return stages if stages is not None else schedule
        if key in ("schedule", "num_microbatches"):
            return schedule
        if key in ("sequence_parallel", "fold"):
            return attrs["tensor"]
        return _train_item(attrs["train"], module, TRAIN_PINS[key])

    written = {key: (value, origin(key).span) for key, value in pins.items()}
    if schedule is not None and plan.schedule is not None and plan.schedule.definition is not None:
        # a table or template the file defines (not a pin of the search, which runs it as written): no `--pin
        # schedule=` names it, so every one contradicts the line (it was ranked, and the file kept the table)
        written.setdefault("schedule", (plan.schedule.name, schedule.span))
    if stages is not None and plan.stages is not None:  # a written split counts the parts its `account` names, or none
        written.setdefault("account", (tuple(plan.stages.account or ()), stages.span))
    if "experts" in attrs and plan.experts is not None:  # the problem's dispatcher and folding (`experts_variants`)
        written.setdefault("dispatcher", (plan.experts.kind, attrs["experts"].span))
        written.setdefault("fold", (bool(plan.experts.fold), attrs["experts"].span))
    if "zero_stage" in pins or "data" in attrs:  # the data line's kind (`data = none`, or a mesh without one: replicate)
        span = origin("zero_stage").span
        kind = plan.data.kind if "data" in attrs and plan.data is not None else ir.DataKind.replicate
        written.setdefault("zero_stage", (kind.zero_stage, span))
        written.setdefault("data", (kind.value, span))
        if not kind.hybrid:  # one data axis: no shard axis to pin
            written.setdefault("dp_shard", (0, span))
        elif "mesh" in attrs:  # its shard axis as the mesh sizes it (a pin only where the search lays it out)
            written.setdefault("dp_shard", (plan.mesh.degree(plan.data.axes[-1]), attrs["mesh"].span))
    elif "mesh" in attrs and plan.data is not None and not plan.data.hybrid:  # the language's data over one axis
        written.setdefault("dp_shard", (0, attrs["mesh"].span))
    if schedule is not None and stages is None and plan.schedule is not None and plan.schedule.definition is None \
            and plan.schedule.name in BUILTIN and fixed_virtual(plan.schedule.name) is not None:
        written.setdefault("virtual_stages", (fixed_virtual(plan.schedule.name), schedule.span))
    return written


def _train_item(attr: syntax.Attr, module: syntax.Module, key: str):
    """The item of the train dict that writes `key` (in the plan, or in the `let` of this file it names), else the
    plan's train line."""
    value = _train_dict(module, attr.value)
    return next((item for item in (value.items if value is not None else ()) if item.key == key), attr)


def _conventional_rules(rules: tuple[ir.ShardRule, ...], names: dict[str, str]) -> tuple[ir.ShardRule, ...]:
    """The plan's shard rules with the axes they name renamed from the plan's names to the search's (`DEFAULT_NAMES`:
    the candidates lay out `dp`, `tp`, ...), so a rule `over model` of a plan whose tensor axis is `model` is read
    on the candidates' `tp`; an axis no parallelism runs over is named apart from every candidate axis (a size-1
    `tp` beside a tensor axis `model` would otherwise be read as the candidates' tensor axis), and the rule then places
    as `ir.shard_rules` says of an axis the mesh lacks."""
    conventional = {axis: DEFAULT_NAMES[role] for role, axis in names.items()}
    taken = set(DEFAULT_NAMES.values())
    roleless = {axis for rule in rules for axis in (rule.axis, *(placement.axis for param in rule.params
                                                                  for placement in param.placements))
                if axis is not None and axis not in conventional and axis in taken}
    for axis in sorted(roleless):
        name = axis + "_"
        while name in taken:
            name += "_"
        conventional[axis] = name
        taken.add(name)
    if all(axis == name for axis, name in conventional.items()):
        return rules

    def renamed(axis: str | None) -> str | None:
        return conventional.get(axis, axis) if axis is not None else None

    return tuple(rule.model_copy(update={
        "axis": renamed(rule.axis),
        "params": tuple(param.model_copy(update={"placements": tuple(
            placement.model_copy(update={"axis": renamed(placement.axis)}) for placement in param.placements)})
            for param in rule.params)}) for rule in rules)


def pins_with(partial: Partial, overrides) -> tuple[dict[str, object], tuple[str, ...]]:
    """(the partial plan's pins with `overrides` (`--pin K=V`, parsed by `search.parse_pins`) added, a note for each
    `--pin` that wins over a value the plan's train writes). One of the train's keys the completion writes
    (`TRAIN_PINS`) wins over the plan's value, and over the plan's others of how blocks are rerun it leaves no room
    for (`_rerun_replaced`). A pin that contradicts a line the plan writes is E803 at that line: the completion adds
    lines and never rewrites one, so the search would rank plans the completed file is not (PlanError, every such pin
    reported)."""
    contradicted, notes = _against_plan(partial, overrides)
    if contradicted:
        raise PlanError(contradicted, {partial.path: SourceFile(partial.path, partial.text)})
    over = parse_pins(overrides)
    _, replaced = _rerun_replaced(partial.pins, over)
    # a data pin that says what the written lines do, where the plan does not pin it (a written hsdp with a replica or
    # shard axis of one rank, which the search lays out as ZeRO-3 over one axis): what the completion keeps anyway
    over = {k: v for k, v in over.items() if not (k in _DATA_PINS and k not in partial.pins
                                                  and partial.written_pins.get(k, (None,))[0] == v)}
    return {**{k: v for k, v in partial.pins.items() if k not in replaced}, **over}, notes


def _against_plan(partial: Partial, overrides) -> tuple[list[Diagnostic], tuple[str, ...]]:
    """Each `--pin` (as given) against what the plan writes: (E803 for those that contradict a written line, notes
    for those that replace a written train value)."""
    if overrides is None:
        return [], ()
    over = parse_pins(overrides)  # SearchError for a pin that is not KEY=VALUE, or pins that contradict each other
    errors, notes, shown_as = [], [], {}
    for shown, parsed in _given(overrides):
        shown_as.update({k: shown for k in parsed})
        against = [(k, v, partial.written_pins[k]) for k, v in parsed.items()
                   if k in partial.written_pins and partial.written_pins[k][0] != v]
        if not against and parsed.get("data") == "hsdp" and partial.written_pins.get("dp_shard", (None,))[0] == 0:
            against = [("dp_shard", None, partial.written_pins["dp_shard"])]  # hsdp needs the two axes it leaves out
        if not against:
            continue
        k, v, (was, span) = against[0]
        excerpt = _excerpt(partial, span)
        if k in TRAIN_PINS and all(each in TRAIN_PINS for each, _, _ in against):
            written = f"[{', '.join(v)}]" if isinstance(v, tuple) else _shown(v)  # as the train writes it
            notes.append(f"{shown} wins over `{excerpt}` ({span}): the completed plan writes {TRAIN_PINS[k]}: {written}")
            continue
        gives = "one data axis, no dp_shard" if (k, was) == ("dp_shard", 0) else f"{k}={_shown(was)}"
        errors.append(diag("E803", f"{shown} contradicts the plan's `{excerpt}`, which gives {gives}",
                           span, hint="`generate --from` keeps every line the plan writes and adds only what it leaves "
                                      f"out: drop {shown}, or edit this {_written_as(partial, span)} (remove it to let "
                                      "the search choose)"))
    setter, replaced = _rerun_replaced(partial.pins, over)
    for k in replaced:
        span = partial.written_pins[k][1]
        mode = _RERUN_MODE.get(setter) or over["recompute"]
        after = {"recompute": f"recompute: {mode}", "offload_layers": "offload_layers: 0"}.get(k, f"no {TRAIN_PINS[k]}")
        notes.append(f"{shown_as[setter]} wins over `{_excerpt(partial, span)}` ({span}): the completed plan writes "
                     f"{after}")
    return errors, tuple(notes)


def _given(overrides) -> list[tuple[str, dict]]:
    """Each `--pin` as the user wrote it (`--pin K=V`) with its parsed pins (SearchError for a bad one)."""
    if overrides is None:
        return []
    given = overrides.items() if isinstance(overrides, Mapping) else (str(pin).partition("=")[::2] for pin in overrides)
    return [(f"--pin {str(key).strip()}={','.join(value) if isinstance(value, (tuple, list)) else value}",
             parse_pins({key: value})) for key, value in given]


def refusal(partial: Partial, overrides, error: SearchError) -> Diagnostic:
    """E803 for the search's `error` under the plan's pins and `overrides` (`--pin`). Where the pins contradict each
    other before any search (`search.pins_conflict`) and a `--pin` is the cause, it says which: one that contradicts
    the plan's pins alone is at the line that writes the pin it meets (the first of the plan's pins whose absence
    lets it stand), or at a line that shapes the problem beyond the pins (`_shaping_lines`: whose pipeline a stages
    line names, an experts line's overlap) where the problem without it lets it stand; `--pin`s that contradict each
    other, without the plan, are named together, with no place in the file (and at that line where they contradict
    it together). A `--pin` the problem refuses on its own (`--pin tp=3` on 16 devices) is at the plan's name, the
    hint naming the pin; anything else (nothing fits, or the plan's own pins) is at the plan's name, the plan's pins in
    the hint."""
    shown = ", ".join(f"{k}={','.join(v) if isinstance(v, tuple) else v}" for k, v in partial.pins.items())
    default = diag("E803", str(error), partial.definition.name_span,
                   hint="the plan's decisions are pins of the search" + (f": {shown}" if shown else "")
                        + "; free one (remove its line or key) to widen the search")
    given = _given(overrides)
    problem = partial.problem
    if not given or pins_conflict(problem, partial.pins) is not None or \
            pins_conflict(problem, pins_with(partial, overrides)[0]) is None:
        return default

    def detail(found: SearchError) -> str:  # the reason, without what the diagnostic says first
        return re.sub(r"^(contradictory pins|--pin [^:]*): ", "", str(found))

    def at_line(pins: list[str], found: SearchError, span: Span) -> Diagnostic:
        named = pins[0] if len(pins) == 1 else f"{', '.join(pins[:-1])} and {pins[-1]}"
        return diag("E803", f"{named} contradict{'s' if len(pins) == 1 else ''} the plan's "
                            f"`{_excerpt(partial, span)}`: {detail(found)}", span,
                    hint="`generate --from` keeps every line the plan writes and adds only what it leaves "
                         f"out: drop {named}, or edit this {_written_as(partial, span)} (remove it to let the "
                         "search choose)")

    def shaping(pins: Mapping[str, object]) -> Span | None:  # the line whose absence from the problem lets them stand
        return next((span for freed, span in _shaping_lines(partial) if pins_conflict(freed, pins) is None), None)
    for pin, parsed in given:  # a pin the problem refuses on its own: a line that shapes it, else the message says
        alone = pins_conflict(problem, parsed)
        if alone is not None:
            span = shaping(parsed)
            if span is not None:
                return at_line([pin], alone, span)
            return diag("E803", str(alone), partial.definition.name_span,  # not the plan's pins: freeing one is no help
                        hint=f"{pin} is refused by the problem the plan states (its model, cluster and train) whatever "
                             "else is pinned: drop or change it")
    for pin, parsed in given:
        merged = pins_with(partial, {k: _shown(v) for k, v in parsed.items()})[0]
        alone = pins_conflict(problem, merged)
        if alone is None:
            continue
        for key in partial.pins:
            if key not in parsed and pins_conflict(problem, {k: v for k, v in merged.items() if k != key}) is None:
                return at_line([pin], alone, partial.written_pins[key][1])
        span = shaping(merged)
        if span is not None:
            return at_line([pin], alone, span)
    group = _contradicting(problem, given)
    if group is None:
        return default
    pins = {k: v for _, parsed in group for k, v in parsed.items()}
    found = pins_conflict(problem, pins)
    named = [pin for pin, _ in group]
    span = shaping(pins)
    if span is not None:
        return at_line(named, found, span)
    return diag("E803", f"the command line's {', '.join(named[:-1])} and {named[-1]} contradict each "
                        f"other: {detail(found)}", hint="drop or change one of them")


_TRIED_TOGETHER = 3
"""`_contradicting` tries every group of up to this many `--pin`s before it shrinks the whole set."""


def _contradicting(problem: Problem, given: list[tuple[str, dict]]) -> list[tuple[str, dict]] | None:
    """The `--pin`s (of `_given`) that contradict each other without the plan (`pins_conflict`), fewest first: the
    first group of two, then of three, that does; past three, the whole set shrunk one pin at a time (each dropped
    while the rest still contradict), so that no pin of the group can go. None where the whole set does not
    contradict itself. A key pinned again counts once, as its first `--pin`: `parse_pins` refuses a key pinned twice
    to different values (E805) before any refusal, so a repeat is the same pin (`zero=1` and `zero_stage=1` too), and
    the first contradicting group of the `--pin`s in order is one of first ones, as every group was tried (the names
    in the order given: `--pin tp=4 --pin cp=8 --pin tp=4` is "tp=4 and cp=8"). At most 24 such pins (`PIN_KEYS`;
    a `data` pin parses to two keys, `dp_shard` to three): some 2,300 checks however many `--pin`s are given, where
    every group of every size was 2^n of them (a hundred `--pin zero=1` before four that contradict: 4.6 million)."""
    first: dict[tuple, int] = {}
    for index, (_, parsed) in enumerate(given):
        first.setdefault(tuple(parsed.items()), index)
    distinct = [given[index] for index in sorted(first.values())]

    def contradict(group) -> bool:
        return pins_conflict(problem, {k: v for _, parsed in group for k, v in parsed.items()}) is not None
    for count in range(2, min(_TRIED_TOGETHER, len(distinct)) + 1):
        found = next((list(group) for group in itertools.combinations(distinct, count) if contradict(group)), None)
        if found is not None:
            return found
    if len(distinct) <= _TRIED_TOGETHER or not contradict(distinct):
        return None
    group = list(distinct)
    for pin in distinct:
        rest = [other for other in group if other is not pin]
        if contradict(rest):
            group = rest
    return group


def _shaping_lines(partial: Partial) -> list[tuple[Problem, Span]]:
    """The lines the plan writes that shape its problem beyond the pins, each as (the problem without what it says,
    its span): a stages line's or block's pipeline other than torch's (`implementation = megatron | deepspeed`: the
    schedules and ZeRO stages they run) and its map (the schedules that place its stages so), an experts line's
    overlap."""
    lines = []
    stages = partial.stage_block if partial.stage_block is not None else partial.attrs.get("stages")
    if stages is not None and partial.problem.pipeline != "torch":
        lines.append((replace(partial.problem, pipeline="torch"), stages.span))
    if stages is not None and partial.problem.stage_map is not None:  # the schedules that place its stages so
        lines.append((replace(partial.problem, stage_map=None), stages.span))
    if "experts" in partial.attrs and partial.problem.overlap_experts:
        lines.append((replace(partial.problem, overlap_experts=False), partial.attrs["experts"].span))
    return lines


# How a block's activations are rerun or kept, which go together (E205): recompute_modules under `recompute:
# selective`, recompute_layers under full, offload_layers without recomputation; the mode a --pin of each sets
_RERUN_MODE = {"recompute_modules": "selective", "recompute_layers": "full", "offload_layers": "none"}


def _rerun_replaced(pins: dict, over: dict) -> tuple[str | None, list[str]]:
    """(the `--pin` that sets how blocks are rerun: recompute, or one of `_RERUN_MODE`; the plan's pins among
    recompute, recompute_modules, recompute_layers and offload_layers that it leaves no room for and no --pin names).
    Those are train values the completion writes from the candidate, so the pin wins over them too (a plan's
    `recompute: selective, recompute_modules: [core_attn]` under `--pin recompute=full`: full, without the modules)."""
    setter = "recompute" if "recompute" in over else next((k for k in _RERUN_MODE if over.get(k)), None)
    if setter is None:
        return None, []
    mode = over["recompute"] if setter == "recompute" else _RERUN_MODE[setter]
    fits = {"recompute": lambda v: v == mode, "recompute_modules": lambda v: mode == "selective",
            "recompute_layers": lambda v: mode == "full", "offload_layers": lambda v: not v or mode == "none"}
    return setter, [k for k, fit in fits.items() if k in pins and k not in over and not fit(pins[k])]


def _excerpt(partial: Partial, span: Span) -> str:
    """The text at `span` on one line, at most 60 characters."""
    excerpt = " ".join(partial.text[span.start:span.end].split())
    return excerpt if len(excerpt) <= 60 else excerpt[:57] + "..."


def _written_as(partial: Partial, span: Span) -> str:
    """What the user wrote at `span`: the plan's `stages { }` block, else a line (or a train item on one)."""
    return "block" if partial.stage_block is not None and span == partial.stage_block.span else "line"


def _shown(value) -> str:
    """A pin's value as `--pin` writes it (`order` and `account` comma-separated, an account of no part none; booleans
    in lower case)."""
    if isinstance(value, tuple):
        return ",".join(value) or "none"  # `account` of no part
    return str(value).lower() if isinstance(value, bool) else str(value)


# ---- reading ------------------------------------------------------------------------------------------
def _read(path: str) -> str:
    """The file's text, read bounded (`loader.read_source`: E106-E109, E208 as diagnostics), BOM dropped."""
    return read_source(path).text


def _plan_definition(module: syntax.Module, name: str | None, path: str) -> syntax.Definition:
    plans = [item for item in module.items if isinstance(item, syntax.Definition) and item.kind == "plan"]
    chosen = [p for p in plans if name is None or p.name == name]
    if not plans:
        raise PlanError([diag("E201", f"{path} defines no plan to start from", module.span,
                              hint="add `plan NAME { model = ..., cluster = ..., train = { global_batch: ... } }`")])
    if name is not None and not chosen:
        raise PlanError([diag("E201", f"{path} has no plan '{name}'",
                              hint=did_you_mean(name, [p.name for p in plans], "plans"))])
    if len(chosen) > 1:
        raise PlanError([diag("E201", f"{path} defines {len(chosen)} plans; name one with --plan",
                              hint=", ".join(p.name for p in chosen))])
    return chosen[0]


# ---- what cannot be kept ------------------------------------------------------------------------------
def _unkept(definition: syntax.Definition, attrs: dict, stage_block) -> list[Diagnostic]:
    """Decisions the search cannot keep without a written mesh: it lays out one axis per parallelism."""
    if "mesh" in attrs:
        return []
    found = []
    for item in definition.body or ():
        if isinstance(item, syntax.ShardRule):
            found.append(diag("E801", "a shard rule names mesh axes, and the plan writes no mesh for them",
                              item.span, hint="write the mesh (`mesh = [...]`) to keep the rule, or remove the "
                                              "rule to search the layout"))
    return found


def _axis_names(attrs: dict, stage_block) -> tuple[dict[str, str], list[tuple[int, str]], list[Diagnostic]]:
    """Role -> the axis the plan's lines name for it (the conventional name when they name none);
    `over` insertions for lines that name no axis; E801 for lines one axis per role cannot keep."""
    names: dict[str, str] = {}
    overs: list[tuple[int, str]] = []
    refused: list[Diagnostic] = []
    written: dict[str, tuple[str, Span]] = {}
    for attr, role in ATTR_ROLE.items():
        if attr not in attrs:
            continue
        value = attrs[attr].value
        over = value.over if isinstance(value, syntax.Clause) else None
        subject = value.subject if isinstance(value, syntax.Clause) else value
        if isinstance(subject, syntax.Name) and subject.id == "none":
            continue
        if over is None:
            if "mesh" not in attrs:
                overs.append((subject.span.end, role))
            continue
        items = over.items if isinstance(over, syntax.ListExpr) else (over,)
        axes = [item.id for item in items if isinstance(item, syntax.Name)]
        tensor = written["tp"][0] if "tp" in written else ("tp" if "tensor" in attrs else None)
        if attr == "experts" and len(items) == len(axes) == 2 and axes[1] == tensor and axes[0] != tensor:
            written[role] = (axes[0], value.span)  # folded over the tensor axis: the search lays out ep and tp
            continue
        if len(axes) != 1:
            if "mesh" not in attrs:
                refused.append(diag("E801", f"`{attr}` runs over {len(items)} axes, and the search lays out one "
                                            "axis per parallelism", value.span,
                                    hint="write the mesh (`mesh = [...]`) to keep it"))
            continue
        written[role] = (axes[0], value.span)
    if stage_block is not None:
        axis = next((a for a in stage_block.body if isinstance(a, syntax.Attr) and a.name == "axis"), None)
        if axis is None or isinstance(axis.value, syntax.Name):
            written["pp"] = (axis.value.id if axis is not None else "pp", stage_block.name_span)
    for role, (axis, span) in written.items():
        other = next((r for r, (a, _) in written.items() if a == axis and r != role), None)
        if other is not None and "mesh" not in attrs:
            refused.append(diag("E801", f"axis '{axis}' carries both {ROLE_ATTR[other]} and {ROLE_ATTR[role]}, and "
                                        "the search lays out one axis per parallelism", span,
                                hint="write the mesh to keep it, or give each its own axis"))
            break
        names[role] = axis
    taken = set(names.values())
    for role, default in DEFAULT_NAMES.items():
        if role not in names:
            name = default
            while name in taken:
                name += "_"
            names[role] = name
            taken.add(name)
    return names, [(offset, f" over {names[role]}") for offset, role in overs], refused


def _mesh_refusals(plan: ir.Plan, attrs: dict) -> list[Diagnostic]:
    if plan.mesh.size != plan.cluster.num_devices and _covered(plan) is None:
        return [diag("E801", f"the mesh covers {plan.mesh.size} of the {plan.cluster.num_devices} devices of "
                             f"'{plan.cluster.name}', and the search lays out a whole cluster of one kind of node",
                     attrs["mesh"].value.span, hint="name a cluster of that size, or remove the mesh to search it")]
    return []


def _covered(plan: ir.Plan) -> ir.Cluster | None:
    """The part of a cluster of one node type that the mesh covers, as a cluster (None: not one)."""
    if plan.mesh.size == plan.cluster.num_devices:
        return plan.cluster
    if len(plan.cluster.groups) != 1:
        return None
    group = plan.cluster.groups[0]
    node, size = group.node, plan.mesh.size
    if size % node.devices == 0:
        group = group.model_copy(update={"count": size // node.devices})
    elif size < node.devices and plan.mesh.first_device % node.devices + size <= node.devices:
        group = group.model_copy(update={"count": 1, "node": node.model_copy(update={"devices": size})})
    else:
        return None
    return plan.cluster.model_copy(update={"groups": (group,)})


# ---- checking what is written ---------------------------------------------------------------------------
def _checked(path: str, text: str, source: SourceFile, definition, attrs: dict, stage_block,
             names: dict[str, str], overs: list, params: dict | None) -> ir.Plan:
    """The plan as the language reads it, checked like `plandsl check`; without a mesh, through a probe
    mesh of the axes its lines name (one device each, the pipeline degree its stages fix), reporting what
    no layout could fix. PlanError with the diagnostics at the file's own lines."""
    others = other_plans(path, source.text, definition.name)
    if "mesh" in attrs:
        analysis = analyze(path, text=text, params=params)
        lowered = [p for p in (analysis.document.plans if analysis.document else ()) if p.name == definition.name]
        free = free_choices(attrs, stage_block, lowered[0]) if lowered else set()
        pipelined = bool(lowered) and lowered[0].pp > 1  # (a schedule of virtual stages needs a pipeline)
        errors = [d for d in analysis.errors if not _fixable(d, free, pipelined) and not others(d)]
        return _plan_of(analysis, definition.name, errors, lambda d: d, analysis.sources)
    edits = sorted(overs)
    probe = _apply(text, [(offset, offset, piece) for offset, piece in edits])
    close = definition.span.end - 1 + sum(len(piece) for _, piece in edits)
    pp = 1
    for _ in range(2):  # again with the pipeline degree the stages or the schedule fix, when they do
        axes = [(axis, pp if axis == names["pp"] else 1) for axis in _probe_axes(attrs, stage_block, names)]
        line = ("\n  mesh = [" + ", ".join(f"{a} = {s}" for a, s in axes)
                + f"] over devices[0:{math.prod(s for _, s in axes)}]\n")
        inserted = edits + [(definition.span.end - 1, line)]
        analysis = analyze(path, text=probe[:close] + line + probe[close:], params=params)
        plans = [p for p in (analysis.document.plans if analysis.document else ()) if p.name == definition.name]
        pinned = _pipeline_pins(plans[0], stage_block).get("pp", 1) if plans else 1
        if pinned == pp or pinned > plans[0].cluster.num_devices:
            break
        pp = pinned

    def back(d: Diagnostic) -> Diagnostic:
        return _remap(d, path, source, inserted)
    keys = _written_train_keys(attrs)
    searched = keys is not None and "micro_batch" not in keys  # E506: a micro_batch the search chooses
    errors = [d for d in map(back, analysis.errors)
              if d.code not in _PROBE_LAYOUT and not (d.code == "E506" and searched) and not others(d)
              and not (_of_the_schedule(d) and "schedule" not in attrs)  # the search writes one that runs them
              and not _of_the_expert_group(d)]  # the search lays out an expert group for the overlap
    sources = {**analysis.sources, path: source}
    plan = _plan_of(analysis, definition.name, errors, back, sources)
    missing = sorted({d.name for d in plan.cluster.devices_in_order() if plan.train.precision not in d.peak})
    if missing:  # the search lays out every device of the cluster
        device = next(d for d in plan.cluster.devices_in_order() if d.name == missing[0])
        span = _remap_span(plan.train.span_of("precision"), path, source, inserted)
        raise PlanError([diag("E504", f"device '{device.name}' gives no peak for {plan.train.precision.value}", span,
                              hint=f"its peaks: {', '.join(p.value for p in device.peak)}; add "
                                   f"`{plan.train.precision.value}: ... TFLOP/s` to its peak, or change precision")],
                        sources)
    return plan


def other_plans(path: str, text: str, name: str):
    """A test: is a diagnostic inside another plan of the file (left as written, its problems its own)?"""
    spans = [(item.span.start, item.span.end) for item in parse_text(text, path).items
             if isinstance(item, syntax.Definition) and item.kind == "plan" and item.name != name]
    return lambda d: d.span.file == path and any(a <= d.span.start < b for a, b in spans)


def _probe_axes(attrs: dict, stage_block, names: dict[str, str]) -> list[str]:
    """The probe mesh's axes: one for every role the plan's lines name."""
    used = [role for role in ROLE_ATTR
            if ROLE_ATTR[role] in attrs or (role == "pp" and (stage_block is not None or "schedule" in attrs))]
    if not used:
        used = ["dp"]
    return [names[role] for role in used]


def _of_the_schedule(d: Diagnostic) -> bool:
    """An E409 of the schedule against the stages (`check.placement`: `schedule '1f1b' runs one stage per rank, but
    the plan has virtual = 2`), which a schedule the search writes may fix; not one of the stage map itself."""
    return d.code == "E409" and d.message.startswith("schedule '")


def _of_the_expert_group(d: Diagnostic) -> bool:
    """An E419 of the experts' overlap beside one expert rank (`check.sharding`), which the probe mesh's one device an
    axis gives every plan without a mesh: the search lays out an expert group wherever the overlap is written
    (`Space.roots`)."""
    return d.code == "E419" and "with overlap beside one expert rank" in d.message


def _fixable(d: Diagnostic, free: set[str], pipelined: bool = True) -> bool:
    """A problem of a plan with a mesh that a choice the plan leaves to the search may fix (or a warning);
    `pipelined`: the mesh's pipeline degree is more than 1."""
    if not d.is_error:
        return True
    if d.code in ("E501", "E506"):
        return "micro_batch" in free
    if _of_the_schedule(d):  # the default schedule beside written virtual stages: the search writes one that runs them
        return "schedule" in free and pipelined
    if d.code in ("E502", "E602", "E603", "E604", "E605", "E606", "E607", "E608"):
        return bool(free & {"micro_batch", "stages", "schedule"})
    return d.code == "E503" and bool(free - {"experts"})  # the dispatcher under a written mesh holds no memory


def free_choices(attrs: dict, stage_block, plan: ir.Plan) -> set[str]:
    """What a plan with a mesh leaves to the search: micro_batch and recompute its train dict leaves out,
    and the data, tensor, stages and schedule lines it leaves to the language's defaults."""
    keys = _written_train_keys(attrs)
    free = {key for key in ("micro_batch", "recompute") if keys is not None and key not in keys}
    for attr in ("data", "tensor", "stages"):
        if attr not in attrs and not (attr == "stages" and stage_block is not None) and getattr(plan, attr):
            free.add(attr)
    if "schedule" not in attrs and plan.stages is not None:
        free.add("schedule")
    if experts_free(attrs, plan):
        free.add("experts")
    return free


def experts_free(attrs: dict, plan: ir.Plan) -> bool:
    """Whether the search chooses the experts' clause (folded over tp or not, the dispatcher: `search.experts_variants`),
    as it does without `--from`: a mixture of experts whose plan writes no `experts` line, and, when it writes the
    mesh, one whose mesh has an expert axis (`ep`, the language's default clause over it)."""
    if "experts" in attrs or not getattr(plan.model, "experts", 0):
        return False
    return "mesh" not in attrs or plan.expert_group > 1


def _written_train_keys(attrs: dict) -> set[str] | None:
    value = attrs["train"].value
    return {item.key for item in value.items} if isinstance(value, syntax.DictExpr) else None


def _plan_of(analysis, name: str, errors: list[Diagnostic], back, sources) -> ir.Plan:
    plans = [p for p in (analysis.document.plans if analysis.document else ()) if p.name == name]
    if errors or not plans:
        if not errors:  # the plan did not lower: its problems are among the errors (poisoned)
            errors = [back(d) for d in analysis.errors]
        raise PlanError(errors, sources)
    return plans[0]


def _remap_span(span: Span | None, path: str, source: SourceFile, inserted: list[tuple[int, str]]) -> Span | None:
    """A span of the probe text -> the same place in the file's own text."""
    if span is None or span.file != path:
        return span

    def back(offset: int) -> int:
        shift = 0
        for at, piece in sorted(inserted):
            if at + shift >= offset:
                break
            shift += len(piece)
            if offset < at + shift:
                return at
        return offset - shift
    start, end = back(span.start), back(span.end)
    return source.span(min(start, len(source.text)), min(max(end, start), len(source.text)))


def _touches_inserted(span: Span, path: str, inserted) -> bool:
    if span.file != path:
        return False
    shift = 0
    for at, piece in sorted(inserted):
        if span.start <= at + shift + len(piece) and at + shift <= span.end:
            return True
        shift += len(piece)
    return False


def _remap(d: Diagnostic, path: str, source: SourceFile, inserted) -> Diagnostic:
    notes = tuple(Note(n.message, _remap_span(n.span, path, source, inserted)) for n in d.notes)
    edits = tuple(replace(e, span=_remap_span(e.span, path, source, inserted)) for e in d.edits
                  if not _touches_inserted(e.span, path, inserted))  # an edit of the probe's own text: no place here
    return replace(d, span=_remap_span(d.span, path, source, inserted), notes=notes, edits=edits)


def _apply(text: str, edits: list[tuple[int, int, str]]) -> str:
    for start, end, value in sorted(edits, key=lambda e: (e[0], e[1]), reverse=True):
        text = text[:start] + value + text[end:]
    return text


# ---- pins ---------------------------------------------------------------------------------------------
def _mesh_pins(plan: ir.Plan) -> dict[str, object]:
    roles = plan.axis_roles()
    dp = math.prod(axis.size for axis in plan.mesh.axes if roles.get(axis.name) == "dp")
    pins: dict[str, object] = {"dp": dp, "tp": plan.tp, "pp": plan.pp, "cp": plan.cp, "ep": plan.expert_group}
    if plan.tensor is not None and axis_group_span(plan, plan.tensor.axis) > 1:
        pins["tp_across_nodes"] = True  # the plan chose it (W302 says so when it is checked)
    shard = plan.data.axes[-1] if plan.data is not None and plan.data.hybrid else None
    names = [axis.name for axis in plan.mesh.axes if axis.size > 1]
    if shard in names and names.index(shard) > 0 and names[names.index(shard) - 1] == plan.data.axes[0]:
        names.remove(plan.data.axes[0])  # hsdp's replicas just outside its shards: one dp, as the search lays it out
    order = [roles.get(name) for name in names]
    if None not in order and len(set(order)) == len(order):  # hsdp's two data axes apart have no single order
        pins["order"] = ",".join(order)
    return pins


def _kept_split(plan: ir.Plan) -> str | tuple[int, ...] | None:
    """The split of the plan's stages line, which its completion keeps whatever the search chooses
    (`Problem.split`): "evenly" for `stages = evenly ...`; a `stages { }` block's blocks per stage (of a model of
    layers, its layers), where its stages hold them as the search places them (`figures.placed_layers`: in the model's
    order, the embedding with the first and the norm and head with the last); else None (the search's own)."""
    stages = plan.stages
    if stages is None:
        return None
    if stages.mode == "evenly":
        return "evenly"
    assignment, problems = assign_stages(plan)
    if assignment is None or problems:
        return None
    names = [[layer.name for layer in stage] for stage in assignment.stage_layers]
    layers = layers_of(plan.model)
    transformer = isinstance(plan.model, ir.TransformerModel)
    if transformer and layers[0].kind != "embed":
        return None
    blocks = {layer.name for layer in layers if layer.kind == "block"}
    counts = tuple(sum(1 for name in stage if name in blocks) if transformer else len(stage) for stage in names)
    placed = [[layer.name for layer in stage] for stage in placed_layers(layers, transformer, counts)]
    return counts if placed == names else None


def _pipeline_pins(plan: ir.Plan, stage_block) -> dict[str, object]:
    """Without a mesh: the pipeline degree a stage map, a `stages { }` block or a schedule table fixes."""
    pins: dict[str, object] = {}
    stages = plan.stages
    if stages is not None and isinstance(stages.rank_map, tuple):
        pins["pp"] = max(stages.rank_map) + 1
    elif stages is not None and stage_block is not None:
        count = max(s for group in stages.groups for s in group.stages) + 1
        per_rank = 2 if stages.rank_map == "vshape" else stages.virtual
        pins["pp"] = max(1, count // per_rank)
    written = plan.schedule.definition if plan.schedule is not None else None
    if written is not None and written.kind == "table":
        if "ranks" in written.sizes:
            pins.setdefault("pp", written.sizes["ranks"])
        if "microbatches" in written.sizes:
            pins["num_microbatches"] = written.sizes["microbatches"]
    return pins


def _train_items(module: syntax.Module, value: syntax.Expr, text: str) -> tuple[tuple | None, bool]:
    """The train dict's items as (key, value text) when this file writes it (in the plan, or in a `let`
    of this file the plan names), and whether it is written in the plan itself."""
    local = isinstance(value, syntax.DictExpr)
    value = _train_dict(module, value)
    if value is not None:
        return tuple((item.key, text[item.value.span.start:item.value.span.end]) for item in value.items), local
    return None, False


def _train_dict(module: syntax.Module, value: syntax.Expr) -> syntax.DictExpr | None:
    """The train's dict as this file writes it: the plan's own, or that of the `let` of this file the plan names; None
    for any other (a `let` of another file, a call)."""
    if isinstance(value, syntax.Name):
        value = next((item.value for item in module.items if isinstance(item, syntax.Let) and item.name == value.id),
                     value)
    return value if isinstance(value, syntax.DictExpr) else None


__all__ = ["Partial", "read_partial", "pins_with", "refusal", "other_plans", "ROLE_ATTR"]
