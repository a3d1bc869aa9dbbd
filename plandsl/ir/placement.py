"""Plan -> which layers each pipeline stage holds and which rank runs each stage.

`assign_stages` implements the placement semantics of the language: `evenly` splits the
transformer blocks over pp x virtual stages (embedding on the first, final norm and head
on the last); an explicit `stages { ... }` block places layers by name, range or glob.
Problems come back as diagnostics (E401-E404, E409, E410), never as exceptions.
"""
from __future__ import annotations

from dataclasses import dataclass

from plandsl import ir
from plandsl.diagnostics import Diagnostic, Edit, Note, describe_numbers, diag
from plandsl.ir.layers import Layer, layers_of
from plandsl.ir.torch_plan import layer_of_module
from plandsl.ir.selectors import NameIndex, matches, precision  # noqa: F401 (re-exported)
from plandsl.ir.shard_rules import ruled_layers
from plandsl.diagnostics.source import Span


@dataclass(frozen=True, slots=True)
class Assignment:
    stage_layers: tuple[tuple[Layer, ...], ...]   # stage index -> its layers, in model order
    rank_of_stage: tuple[int, ...]                # stage index -> pipeline rank
    virtual: int

    @property
    def num_stages(self) -> int:
        return len(self.stage_layers)

    def rank_stages(self) -> tuple[tuple[int, ...], ...]:
        """Pipeline rank -> its stages, in stage order."""
        ranks = max(self.rank_of_stage, default=-1) + 1
        return tuple(tuple(s for s, r in enumerate(self.rank_of_stage) if r == rank) for rank in range(ranks))


def split_evenly(items: list, parts: int) -> list[list]:
    """Contiguous split; the first `len % parts` pieces get one more item."""
    base, extra = divmod(len(items), parts)
    out, start = [], 0
    for index in range(parts):
        size = base + (1 if index < extra else 0)
        out.append(items[start:start + size])
        start += size
    return out


def account_counts(blocks: int, stages: int, account: tuple[str, ...]) -> tuple[int, ...] | None:
    """Blocks per stage of `evenly`'s split of `blocks` over `stages` with the parts `account` counted as items
    (`_evenly`: the embedding the first item, the loss the last); None where some stage would hold nothing."""
    items = blocks + len(account)
    if items < stages:
        return None
    sizes = [len(part) for part in split_evenly(range(items), stages)]
    if "embed" in account:
        sizes[0] -= 1
    if "loss" in account:
        sizes[-1] -= 1
    return tuple(sizes)


def counted_split(counts: tuple[int, ...] | list[int]) -> tuple[str, ...] | None:
    """The parts `account` counts whose split the blocks per stage `counts` are (`account_counts`), where an end stage
    holds no block (the embedding or the loss alone); None where none is (every stage holding a block is `evenly`'s
    own split or a `stages { }` block's). The embedding and the loss together are tried first."""
    counts = tuple(counts)
    if not counts or 0 not in (counts[0], counts[-1]):
        return None
    return next((counted for counted in (("embed", "loss"), ("embed",), ("loss",))
                 if counts == account_counts(sum(counts), len(counts), counted)), None)


def rank_map(stages: ir.Stages, pp: int) -> tuple[tuple[int, ...], list[Diagnostic]]:
    count = pp * stages.virtual
    if stages.rank_map == "loop":
        return tuple(s % pp for s in range(count)), []
    if stages.rank_map == "vshape":
        if stages.virtual != 2:
            return (), [diag("E409", f"a V-shape map needs exactly 2 stages per rank, found virtual = {stages.virtual}",
                             stages.span, hint="set `virtual = 2` or use `map = loop`")]
        return tuple(s if s < pp else 2 * pp - 1 - s for s in range(count)), []
    mapping = tuple(stages.rank_map)
    problems = []
    if len(mapping) != count:
        problems.append(f"it lists {len(mapping)} stages, but pp({pp}) x virtual({stages.virtual}) = {count}")
    bad = sorted({r for r in mapping if r >= pp})
    if bad:
        problems.append(f"rank(s) {', '.join(map(str, bad))} do not exist with pp = {pp}")
    if not bad and len(mapping) == count:
        wrong = [f"rank {rank} runs {mapping.count(rank)}" for rank in range(pp) if mapping.count(rank) != stages.virtual]
        if wrong:
            problems.append(f"{', '.join(wrong)} (each must run virtual = {stages.virtual} stage"
                            f"{'s' if stages.virtual > 1 else ''})")
    if problems:
        return (), [diag("E409", "invalid stage-to-rank map: " + "; ".join(problems), stages.span,
                         hint="each rank must run exactly `virtual` stages, e.g. V-shape [0, 1, 1, 0] for pp = 2")]
    return mapping, []


def assign_stages(plan: ir.Plan) -> tuple[Assignment | None, list[Diagnostic]]:
    """The stages' layers and ranks; each layer's parameters as the plan's shard rules place them
    (`shard_rules.ruled_layers`), as `plandsl run` builds them."""
    layers = list(ruled_layers(plan, layers_of(plan.model)))
    stages = plan.stages
    if stages is None:
        return Assignment((tuple(layers),), (0,), 1), []
    pp = plan.pp
    mapping, problems = rank_map(stages, pp)
    count = pp * stages.virtual
    if stages.mode == "evenly":
        split, more = _evenly(plan, layers, count)
    else:
        split, more = _explicit(plan, layers, count)
    problems += more
    if problems or split is None:
        return None, problems
    return Assignment(tuple(tuple(s) for s in split), mapping, stages.virtual), []


def _evenly(plan: ir.Plan, layers: list[Layer], count: int):
    """`evenly`'s split: the blocks over `count` stages, the first stages taking one more, the embedding joining the
    first stage and the final norm and head the last; with `account`, the embedding and the loss (norm and head) are
    items of the split themselves, first and last (Megatron-LM's get_num_layers_to_build with
    --account-for-embedding/loss-in-pipeline-split: where the items divide, each stage holds as many, and a chunk
    may hold the embedding or the loss alone)."""
    stages = plan.stages
    blocks = [layer for layer in layers if layer.kind == "block"] or layers
    embed = [layer for layer in layers if layer.kind == "embed"]
    loss = [layer for layer in layers if layer.kind in ("norm", "head")]
    missing = [part for part, held in (("embed", embed), ("loss", loss)) if part in stages.account and not held]
    if missing or (stages.account and len(blocks) == len(layers)):
        part = missing[0] if missing else stages.account[0]
        return None, [diag("E405", f"`account` counts the {'loss' if part == 'loss' else 'embedding'} in the split, "
                           f"but model '{plan.model.name}' has no {'final norm or head' if part == 'loss' else part} "
                           "apart from its layers", stages.span_of("account") or stages.span,
                           hint="drop `account`: every layer of the model is split evenly already")]
    counted = "embed" in stages.account, "loss" in stages.account
    items: list = ([tuple(embed)] if counted[0] else []) + [(b,) for b in blocks] + ([tuple(loss)] if counted[1] else [])
    if len(items) < count:
        pp, v = plan.pp, stages.virtual
        what = f"{len(blocks)} layers" if len(items) == len(blocks) else \
            f"{len(items)} items ({len(blocks)} blocks, {' and '.join(p for p, c in zip(('embed', 'loss'), counted) if c)})"
        return None, [diag("E403", f"{count} stages (pp({pp}) x virtual({v})) but only {what} to "
                           "split: some stages would be empty", stages.span,
                           hint=f"use at most {len(items)} stages")]
    split = [[layer for item in part for layer in item] for part in split_evenly(items, count)]
    if len(blocks) != len(layers):
        if not counted[0]:
            split[0] = embed + split[0]
        if not counted[1]:
            split[-1] = split[-1] + loss
    return split, []


def _explicit(plan: ir.Plan, layers: list[Layer], count: int):
    stages = plan.stages
    problems: list[Diagnostic] = []
    owner: dict[str, tuple[int, ir.Selector]] = {}
    by_stage: dict[int, list[int]] = {}
    declared = 0
    index = NameIndex([layer.name for layer in layers])
    group_of: dict[str, ir.StageGroup] = {}
    for group in stages.groups:
        declared = max(declared, max(group.stages) + 1)
        chosen: list[int] = []
        for selector in group.selectors:
            # `layers` alone names the container: every layer under it
            hits = index.select(selector) or index.select(selector, prefix=True)
            by_module = False
            if not hits:  # a model from torch: the modules of `embed` and `head` by their own names
                hits, problem = _module_layers(plan.model, selector, index)
                by_module = bool(hits)
                if problem is not None:
                    problems.append(problem)
                    continue
            if not hits:
                problems.append(diag("E405", f"'{selector.text}' matches no layer of model '{plan.model.name}'",
                                     selector.span, hint=_layer_summary(layers, plan.model)))
                continue
            beyond = index.past_the_end(selector)
            if beyond is not None:  # `layers[60:80]` on a 64-layer model: written for another model
                head = selector.text.rsplit("[", 1)[0]
                problems.append(diag("E405", f"'{selector.text}' reaches past the end of model '{plan.model.name}', "
                                     f"whose last is '{head}.{beyond[0] - 1}' ({head}[{beyond[0]}:{beyond[1]}] do not "
                                     "exist)", selector.span, hint=_layer_summary(layers, plan.model)))
                continue
            for i in hits:
                name = layers[i].name
                if by_module and name in owner and group_of.get(name) is group:
                    continue  # `model.norm, lm_head`: both name the head, placed once
                if name in owner:
                    first_stage, first = owner[name]
                    problems.append(diag("E401", f"layer '{name}' is placed on stage {first_stage} and again on "
                                         f"stage {group.stages[0]}", selector.span,
                                         notes=[Note(f"first placed by '{first.text}'", first.span)]))
                    continue
                owner[name] = (group.stages[0], selector)
                group_of[name] = group
                chosen.append(i)
        chosen.sort()
        for stage, part in zip(group.stages, split_evenly(chosen, len(group.stages))):
            by_stage.setdefault(stage, []).extend(part)
    if declared > len(layers):
        return None, problems + [diag("E403", f"the stages block declares {declared:,} stages for {len(layers):,} "
                                      "layers: some stages would be empty", stages.span,
                                      hint=f"declare at most {len(layers)} stages")]
    if declared != count:
        problems.append(diag("E404", f"the stages block declares {declared} stages, but pp({plan.pp}) x "
                             f"virtual({stages.virtual}) = {count}", stages.span,
                             hint=f"declare stages 0..{count}" + (
                                 f", or set '{stages.axis}' to {declared // stages.virtual}" if declared % stages.virtual
                                 == 0 else "") + " (the axis size x virtual is the stage count)"))
    missing = [layer.name for layer in layers if layer.name not in owner]
    unmatched = any(d.code == "E405" for d in problems)  # those layers are missing because of it
    if missing and not unmatched:
        edits = _placing_edits(layers, group_of)
        where = "; ".join(f"`{_stage_label(group)}: ..., {names}`" for group, names in edits)
        at = edits[0][0].span if edits and edits[0][0].span is not None else stages.span  # where they go
        problems.append(diag("E402", f"{len(missing)} layer(s) are on no stage: {compress_names(missing)}", at,
                             hint=f"add them beside their neighbours: {where}",
                             edits=[Edit(_end_of(group.selectors[-1].span), f", {names}") for group, names in edits
                                    if group.selectors and group.selectors[-1].span is not None]))
    empty = [stage for stage in range(declared) if not by_stage.get(stage)]
    if empty:
        shown = describe_numbers(empty)
        problems.append(diag("E403", f"stage{'s' if len(empty) > 1 else ''} {shown} hold{'' if len(empty) > 1 else 's'} "
                             "no layer", _stage_span(stages, empty[0]),
                             hint=_short_range(stages, empty[0]) or
                             f"give {'them' if len(empty) > 1 else 'it'} layers, or declare fewer stages"))
    order = [sorted(by_stage.get(s, [])) for s in range(declared)]
    flat = [i for stage in order for i in stage]
    if not problems and flat != sorted(flat):
        stage = next(s for s in range(1, declared) if order[s] and order[s - 1] and order[s][0] < order[s - 1][-1])
        problems.append(diag("E410", f"stage {stage} holds '{layers[order[stage][0]].name}', which comes before "
                             f"'{layers[order[stage - 1][-1]].name}' of stage {stage - 1}: activations only flow "
                             "forward through the stages", _stage_span(stages, stage),
                             hint="give each stage the layers that follow those of the stage before"))
    if problems:
        return None, problems
    return [[layers[i] for i in order[s]] for s in range(declared)], []


def _placing_edits(layers: list[Layer], group_of: dict[str, ir.StageGroup]) -> list[tuple[ir.StageGroup, str]]:
    """Where each unplaced layer can go without breaking the order of the stages: the group that
    holds the nearest placed layer before it (or after it, for leading layers)."""
    placed = [i for i, layer in enumerate(layers) if layer.name in group_of]
    if not placed:
        return []
    targets: dict[int, tuple[ir.StageGroup, list[str]]] = {}
    for i, layer in enumerate(layers):
        if layer.name in group_of:
            continue
        before = [j for j in placed if j < i]
        group = group_of[layers[before[-1] if before else placed[0]].name]
        targets.setdefault(id(group), (group, []))[1].append(layer.name)
    return [(group, compress_names(names, limit=None)) for group, names in targets.values()]


def _stage_label(group: ir.StageGroup) -> str:
    first, last = group.stages[0], group.stages[-1]
    return str(first) if first == last else f"{first}..{last + 1}"


def _end_of(span: Span) -> Span:
    return Span(span.file, span.end_line, span.end_column, span.end_line, span.end_column, span.end, span.end)


def _short_range(stages: ir.Stages, stage: int) -> str | None:
    """`1..6: ...` then nothing for stage 6: the range was most likely meant to include it."""
    for group in stages.groups:
        first, last = group.stages[0], group.stages[-1]
        if len(group.stages) > 1 and last == stage - 1:
            return (f"`{first}..{last + 1}` is stages {first} to {last}: a range leaves out its end; "
                    f"did you mean `{first}..{stage + 1}`?")
    return None


def _stage_span(stages: ir.Stages, stage: int):
    """The entry that declares `stage`; for a stage no entry declares, the range that stops just short of
    it (`1..6` for `1..7`), else the entry of the next stage declared (`2:` for `1:`), else the one before."""
    for group in stages.groups:
        if stage in group.stages:
            return group.span
    after = [g for g in stages.groups if g.stages[0] > stage and g.span is not None]
    before = [g for g in stages.groups if g.stages[-1] < stage and g.span is not None]
    short = [g for g in before if g.stages[-1] == stage - 1 and len(g.stages) > 1]
    if short:
        return short[0].span
    if after:
        return min(after, key=lambda g: g.stages[0]).span
    if before:
        return max(before, key=lambda g: g.stages[-1]).span
    return stages.span


def compress_names(names: list[str], limit: int | None = 8) -> str:
    """layers.3, layers.4, layers.5, head -> layers[3:6], head."""
    out: list[str] = []
    run: list[int] = []
    prefix = None

    def flush():
        if run:
            out.append(f"{prefix}.{run[0]}" if len(run) == 1 else f"{prefix}[{run[0]}:{run[-1] + 1}]")
            run.clear()

    for name in names:
        head, _, tail = name.rpartition(".")
        if tail.isdigit() and head == prefix and run and int(tail) == run[-1] + 1:
            run.append(int(tail))
        elif tail.isdigit():
            flush()
            prefix, run[:] = head, [int(tail)]
        else:
            flush()
            prefix = None
            out.append(name)
    flush()
    if limit is None or len(out) <= limit:
        return ", ".join(out)
    return ", ".join(out[:limit]) + ", ..."


def _layer_summary(layers: list[Layer], model: ir.Model | None = None) -> str:
    text = "its layers: " + compress_names([layer.name for layer in layers])
    parts = _outside_modules(model) if isinstance(model, ir.CustomModel) else {}
    shown = [f"{layer} holds {', '.join(names[:4])}{', ...' if len(names) > 4 else ''}" for layer, names in parts.items()]
    return text + (f" ({'; '.join(shown)})" if shown else "")


def _outside_modules(model: ir.CustomModel) -> dict[str, list[str]]:
    """`embed` and `head` of a model from torch -> the modules holding their parameters, by FQN."""
    layer_of = layer_of_module(model)
    found: dict[str, list[str]] = {}
    for name, _ in model.parameters:
        module = name.rpartition(".")[0]
        layer = layer_of.get(module)
        if layer in ("embed", "head") and module not in found.get(layer, []):
            found.setdefault(layer, []).append(module)
    return found


def _module_layers(model: ir.Model, selector: ir.Selector, index: NameIndex) -> tuple[list[int], Diagnostic | None]:
    """A stage selector that names modules of a model from torch (`model.embed_tokens`, `lm_head`,
    `model.norm`): the layers holding them; E405 when it names part of a block (a stage holds whole blocks)."""
    if not isinstance(model, ir.CustomModel) or not model.modules:
        return [], None
    layer_of = layer_of_module(model)
    named = [m for m, _ in model.modules if m and matches(selector, m, prefix=True)]
    inside = [m for m in named if layer_of.get(m) not in (None, "embed", "head") and layer_of[m] != m]
    if inside:
        block = layer_of[inside[0]]
        through = "" if inside[0] == selector.text else f" ('{inside[0]}')"
        return [], diag("E405", f"'{selector.text}' names a part of block '{block}'{through}: a stage holds whole "
                        "layers", selector.span, hint=f"name the block: {block}")
    found = sorted({index.position[layer_of[m]] for m in named if layer_of.get(m) in index.position})
    return found, None


def pipeline_rank_devices(plan: ir.Plan) -> list[list[ir.DeviceType]]:
    """Pipeline rank -> the device types of the mesh devices at that pp coordinate (one per device)."""
    start = plan.mesh.first_device
    devices = plan.cluster.devices_in_order()[start:start + plan.mesh.size]
    if plan.stages is None:
        return [devices]
    names = [a.name for a in plan.mesh.axes]
    position = names.index(plan.stages.axis)
    stride = 1
    for axis in plan.mesh.axes[position + 1:]:
        stride *= axis.size
    pp = plan.pp
    return [[d for index, d in enumerate(devices) if (index // stride) % pp == rank] for rank in range(pp)]


def pipeline_rank_device_types(plan: ir.Plan) -> list[list[ir.DeviceType]]:
    """Pipeline rank -> the device types at that pp coordinate of the mesh, each once, in device
    order (what `pipeline_rank_devices` holds, without the counts). Work is per run of one device
    type (a node group) and rank, not per device: a million-device cluster costs what its few
    groups do."""
    pp = plan.pp if plan.stages is not None else 1
    stride = 1
    if plan.stages is not None:
        names = [a.name for a in plan.mesh.axes]
        for axis in plan.mesh.axes[names.index(plan.stages.axis) + 1:]:
            stride *= axis.size
    ranks: list[dict[str, ir.DeviceType]] = [{} for _ in range(pp)]
    for device, first, end in mesh_device_runs(plan):
        if end - first >= stride * pp:  # the run covers every rank
            for found in ranks:
                found.setdefault(device.name, device)
            continue
        block = first // stride
        while block * stride < end:
            ranks[block % pp].setdefault(device.name, device)
            block += 1
    return [list(found.values()) for found in ranks]


def mesh_device_runs(plan: ir.Plan) -> list[tuple[ir.DeviceType, int, int]]:
    """(device type, first, end) of each run of one node group inside the mesh, as mesh indices."""
    start, size = plan.mesh.first_device, plan.mesh.size
    runs, offset = [], 0
    for group in plan.cluster.groups:
        length = group.count * group.node.devices
        first, end = max(offset, start), min(offset + length, start + size)
        if first < end:
            runs.append((group.node.device, first - start, end - start))
        offset += length
    return runs
