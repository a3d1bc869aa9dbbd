"""Plan -> where the model lives: layers grouped into pipeline stages, stages onto pipeline ranks
(interleaved and V-shape maps drawn as they are), how each layer group's parameters are sharded
(`Shard(0)@tp`), and what crosses each stage boundary per microbatch and per step.

Contract: `render_placement(plan) -> DOT text` for `dot`. Each pipeline rank is a row; its stages
follow in the order it holds them, so a loop map reads down one column and then the next, and a
V-shape map comes back up. Columns wrap into bands under each other so a band fits PAGE_WIDTH.
What crosses to the next stage is written in the stage's table, so it stays with its arrow. A
plan without a pipeline is one stage on every device.
Sharding: Megatron's defaults for `tensor = megatron` (the first tensor-sharded dim of each
parameter over the tensor axis, experts over the expert axis), then the plan's `shard` rules,
the most precise selector winning, as the checker resolves them.
"""
from __future__ import annotations

from plandsl import ir
from plandsl.ir.layers import EXPERTS, TENSOR_SHARDED_DIMS, Layer, Param, layers_of, param_count
from plandsl.ir.shard_rules import ruled_layers, style_dim, winning_rules
from plandsl.ir.placement import Assignment, assign_stages, compress_names, pipeline_rank_devices
from plandsl.render.dot import FONT, Graph, Html, categorical, escape, text_width
from plandsl.render.mesh import format_rate
from plandsl.lower.units import format_bytes, format_count
from plandsl.diagnostics import PlanError

ENGINE = ("dot",)
WRAP = 52  # characters per line of a sharding list


# ---- sharding ---------------------------------------------------------------------------------
def _placement_text(placement: ir.Placement) -> str | None:
    if placement.kind == "shard":
        return f"Shard({placement.dim})@{placement.axis}"
    if placement.kind == "partial":
        return f"Partial@{placement.axis}"
    return None  # Replicate is what is not said


def param_placements(plan: ir.Plan, param: Param, rule: ir.ShardRule | None) -> tuple[str, ...]:
    """The parameter's placements on the mesh axes, `()` for replicated everywhere."""
    tensor_axis = plan.tensor.axis if plan.tensor else None
    if rule is None:
        out = []
        expert = plan.experts is not None and len(param.dims) == 3 and param.dims[0] == EXPERTS
        if expert:  # folded: the experts' dim over the expert axis and the tensor axis, each expert whole
            out += [f"Shard(0)@{axis}" for axis in plan.experts.axes]
        if tensor_axis and isinstance(plan.model, ir.TransformerModel) and not (expert and plan.expert_tp == 1):
            dim = next((i for i, role in enumerate(param.dims) if role in TENSOR_SHARDED_DIMS), None)
            if dim is not None:
                out.append(f"Shard({dim})@{tensor_axis}")
        return tuple(out)
    out: tuple[str, ...] = ()
    kind = param.name.rsplit(".", 1)[-1]
    axis = rule.axis or tensor_axis
    dim = style_dim(rule.style, kind, param.module.startswith("embed."))  # an Embedding's the other way round
    if dim is not None and axis:
        out = (f"Shard({dim})@{axis}",)
    for param_rule in rule.params:
        if param_rule.param in ("*", kind):
            out = tuple(t for t in map(_placement_text, param_rule.placements) if t)
    return out


def layer_sharding(plan: ir.Plan, layer: Layer, winners: dict[str, ir.ShardRule]) -> tuple[tuple[str, str], ...]:
    """(name within the layer, placements text) per module, or per parameter where a module's differ."""
    prefix = layer.name + "." if layer.kind == "block" else ""
    by_module: dict[str, list[tuple[str, str]]] = {}
    for param in layer.params:
        text = ", ".join(param_placements(plan, param, winners.get(param.module))) or "Replicate"
        by_module.setdefault(param.module, []).append((param.name, text))
    entries = []
    for module, params in by_module.items():
        local = module[len(prefix):] if module.startswith(prefix) else module
        if len({text for _, text in params}) == 1:
            entries.append((local, params[0][1]))
        else:
            entries += [((name[len(prefix):] if name.startswith(prefix) else name), text) for name, text in params]
    return tuple(entries)


def _sharding_lines(entries: tuple[tuple[str, str], ...]) -> list[str]:
    """`Shard(0)@tp: attn.wq, attn.wk` lines, Replicate last, long lists wrapped."""
    grouped: dict[str, list[str]] = {}
    for name, text in entries:
        grouped.setdefault(text, []).append(name)
    order = sorted(grouped, key=lambda t: (t == "Replicate", list(grouped).index(t)))
    lines = []
    for text in order:
        names = grouped[text]
        line = f"{text}: "
        for number, name in enumerate(names):
            piece = name + (", " if number < len(names) - 1 else "")
            if len(line) + len(piece) > WRAP and not line.endswith(": "):
                lines.append(line.rstrip())
                line = "    "
            line += piece
        lines.append(line)
    return lines


def layer_groups(plan: ir.Plan, layers: tuple[Layer, ...], winners) -> list[tuple[list[Layer], tuple]]:
    """Consecutive layers of one kind with the same sharding, as (layers, sharding) groups."""
    groups: list[tuple[list[Layer], tuple]] = []
    for layer in layers:
        sharding = layer_sharding(plan, layer, winners)
        if groups and groups[-1][0][-1].kind == layer.kind and groups[-1][1] == sharding:
            groups[-1][0].append(layer)
        else:
            groups.append(([layer], sharding))
    return groups


# ---- the picture -------------------------------------------------------------------------------
PAGE_WIDTH = 1150.0   # points: a band of columns fits a 1,600-pixel page (graphviz draws 96 pixels an inch)
COLUMN_GAP = 18.0     # nodesep, in points


def render_placement(plan: ir.Plan) -> str:
    assignment, problems = assign_stages(plan)
    if assignment is None:
        raise PlanError(problems)
    layers = ruled_layers(plan, layers_of(plan.model))  # the parameters as the rules place them (attention sinks)
    modules = list(dict.fromkeys(p.module for layer in layers for p in layer.params))
    winners = winning_rules(plan, modules)
    ranks = assignment.rank_stages()
    fills = categorical(len(ranks))
    graph = Graph("placement", comment=f"plandsl render --view placement: plan {plan.name}\nlay out with: dot",
                  graph={"rankdir": "TB", "nodesep": round(COLUMN_GAP / 72, 3), "ranksep": 0.3, "newrank": True,
                         "fontname": FONT, "fontsize": 10, "labelloc": "t", "labeljust": "l", "bgcolor": "white",
                         "label": Html(_title(plan, assignment))},
                  node={"shape": "plain", "fontname": FONT, "fontsize": 9},
                  edge={"fontname": FONT, "fontsize": 8})
    devices = _rank_devices(plan)
    tables = {stage: _stage_table(plan, assignment, stage, winners, fills[rank])
              for rank, stages in enumerate(ranks) for stage in stages}
    columns = max(len(stages) for stages in ranks)
    per_band = columns_per_band(max(width for _, width in tables.values()), columns, max(map(_label_width, devices)))
    cell: dict[int, tuple[int, int, int]] = {}  # stage -> (band, rank, column in its band)
    previous_row = None
    for band_start in range(0, columns, per_band):
        band = band_start // per_band
        band_columns = range(band_start, min(columns, band_start + per_band))
        for rank, stages in enumerate(ranks):
            row = [_rank_id(band, rank)]
            with graph.subgraph(f"row{band}_{rank}", rank="same"):
                graph.node(row[0], shape="box", style="rounded,filled", fillcolor=fills[rank], color="#888888",
                           margin="0.12,0.06", label=devices[rank], tooltip=devices[rank].replace("\\n", ", "))
                for column in band_columns:
                    if column < len(stages):
                        stage = stages[column]
                        cell[stage] = (band, rank, column - band_start)
                        graph.node(f"stage{stage}", label=Html(tables[stage][0]),
                                   tooltip=_stage_tooltip(plan, assignment, stage))
                        row.append(f"stage{stage}")
                    else:  # an empty place keeps the column straight
                        row.append(f"gap{band}_{rank}_{column}")
                        graph.node(row[-1], shape="point", style="invis", width=0.01)
            for left, right in zip(row, row[1:]):  # left to right along the row
                graph.edge(left, right, style="invis")
            if previous_row is not None:  # each column straight down (and the next band under the last)
                for upper, lower in zip(previous_row, row if len(row) == len(previous_row) else row[:1]):
                    graph.edge(upper, lower, style="invis", weight=10)
            previous_row = row
    for stage in range(assignment.num_stages - 1):
        ports = _ports(cell[stage], cell[stage + 1])
        graph.edge(f"stage{stage}", f"stage{stage + 1}", constraint=False, penwidth=1.4, color="#333333",
                   tooltip=f"stage {stage} -> stage {stage + 1}: " + ", ".join(_boundary(plan, assignment, stage)),
                   **ports)
    return graph.source()


def columns_per_band(table_width: float, columns: int, label_width: float) -> int:
    """How many columns of stages fit PAGE_WIDTH beside the ranks' labels (at least one)."""
    room = PAGE_WIDTH - label_width - COLUMN_GAP
    return max(1, min(columns, int((room + COLUMN_GAP) // (table_width + COLUMN_GAP))))


def _rank_id(band: int, rank: int) -> str:
    return f"rank{rank}" if band == 0 else f"rank{rank}_{band}"


def _label_width(label: str) -> float:
    return max(text_width(line, 9) for line in label.split("\\n")) + 20


def _ports(tail: tuple[int, int, int], head: tuple[int, int, int]) -> dict[str, str]:
    """Where an arrow leaves and enters: straight down (or up, a V-shape's way back) within a column,
    sideways between neighbours on one rank; elsewhere graphviz chooses."""
    (band_a, rank_a, column_a), (band_b, rank_b, column_b) = tail, head
    if band_a == band_b and column_a == column_b and abs(rank_a - rank_b) == 1:
        return {"tailport": "s", "headport": "n"} if rank_b > rank_a else {"tailport": "n", "headport": "s"}
    if band_a == band_b and rank_a == rank_b and column_b == column_a + 1:
        return {"tailport": "e", "headport": "w"}
    return {}


def _stage_tooltip(plan: ir.Plan, assignment: Assignment, stage: int) -> str:
    layers = assignment.stage_layers[stage]
    names = compress_names([layer.name for layer in layers])
    return (f"stage {stage} on pipeline rank {assignment.rank_of_stage[stage]}: {names} "
            f"({format_count(sum(layer.param_count for layer in layers))} parameters)")


def _title(plan: ir.Plan, assignment: Assignment) -> str:
    model = plan.model
    lines = [f"<b>plan {escape(plan.name)}</b> · model {escape(model.name)} "
             f"({format_count(param_count(model))} parameters, {len(layers_of(model))} layers)"]
    if plan.stages:
        rank_map = plan.stages.rank_map if isinstance(plan.stages.rank_map, str) else list(plan.stages.rank_map)
        lines.append(f"{assignment.num_stages} stages over '{escape(plan.stages.axis)}': {plan.pp} ranks × "
                     f"{assignment.virtual} stage{'s' if assignment.virtual > 1 else ''} each, map "
                     f"{escape(rank_map)}; schedule {escape(plan.schedule.name if plan.schedule else '-')}")
    else:
        lines.append(f"no pipeline: every device holds every layer ({plan.mesh.size:,} devices)")
    parts = []
    if plan.tensor:
        parts.append(f"tensor: {plan.tensor.style} over {plan.tensor.axis} ({plan.tp})"
                     + (" with sequence parallel" if plan.tensor.sequence_parallel else ""))
    if plan.data:
        what = {0: "parameters replicated, gradients all-reduced", 1: "optimizer states Shard(0)@{a}",
                2: "gradients and optimizer states Shard(0)@{a}",
                3: "parameters, gradients and optimizer states Shard(0)@{a}"}[plan.data.zero_stage]
        shard_axis = plan.data.axes[-1] if plan.data.hybrid else "+".join(plan.data.axes)
        if plan.context is not None and plan.cp > 1:
            shard_axis += f"+{plan.context.axis}"  # the context axis holds the same parameters (cost.memory.zero_degrees)
        parts.append(f"data: {plan.data.kind} over {', '.join(plan.data.axes)} ({plan.dp}): "
                     + what.format(a=shard_axis))
    if plan.context:
        how = "K, V all-gathered" if plan.context.kind == "allgather" else "K, V passed around the ring"
        parts.append(f"context: {plan.context.kind} over {plan.context.axis} ({plan.cp}): sequence Shard(1), {how}")
    if plan.experts:
        over = plan.experts.axis if not plan.experts.fold else f"[{', '.join(plan.experts.axes)}]"
        parts.append(f"experts: {plan.experts.kind} over {over} ({plan.expert_group})")
    if parts:
        lines.append(escape(" · ".join(parts)))
    lines.append("→ rows: the activations each stage sends to the next, per microbatch and per step (gradients "
                 "of the same size come back)")
    return "<br align='left'/>".join(lines) + "<br align='left'/>"


def _rank_devices(plan: ir.Plan) -> list[str]:
    """Per pipeline rank, the label of its column: devices and their type."""
    others = [a for a in plan.mesh.axes if not (plan.stages and a.name == plan.stages.axis)]
    spread = " × ".join(f"{a.name} {a.size}" for a in others if a.size > 1)
    out = []
    for rank, devices in enumerate(pipeline_rank_devices(plan)):
        types = ", ".join(dict.fromkeys(d.name for d in devices))
        count = f"{len(devices):,} device{'s' if len(devices) != 1 else ''}" + (f"\\n({spread})" if spread else "")
        if plan.stages:
            out.append(f"pipeline rank {rank}\\n{plan.stages.axis} = {rank}\\n{count}\\n{types}")
        else:
            out.append(f"every device\\n{count}\\n{types}")
    return out


def _stage_table(plan: ir.Plan, assignment: Assignment, stage: int, winners, fill: str) -> tuple[str, float]:
    """The stage's table and its estimated width in points: head, a row per layer group, and what goes
    to the next stage (its arrow's label, kept in the table so it cannot drift from the arrow)."""
    layers = assignment.stage_layers[stage]
    rank = assignment.rank_of_stage[stage]
    params = sum(layer.param_count for layer in layers)
    head = f"stage {stage} · rank {rank} · {format_count(params)} parameters, {len(layers)} " \
           f"layer{'s' if len(layers) != 1 else ''}"
    rows = [f'<tr><td colspan="2" bgcolor="{fill}" align="left"><b>stage {stage}</b>{escape(head[len(f"stage {stage}"):])}'
            f'</td></tr>']
    width = text_width(head, 9) * 1.05
    for group, sharding in layer_groups(plan, layers, winners):
        name = compress_names([layer.name for layer in group])
        kind = group[0].kind
        what = f"{len(group)} {kind}{'s' if len(group) > 1 and kind != 'custom' else ''}"
        count = sum(layer.param_count for layer in group)
        lines = _sharding_lines(sharding) or ["no parameters"]
        body = "<br align='left'/>".join(escape(line) for line in lines) + "<br align='left'/>"
        rows.append(f'<tr><td align="left" valign="top"><b>{escape(name)}</b><br align="left"/>{what}, '
                    f'{format_count(count)}<br align="left"/></td><td align="left" valign="top">'
                    f'<font point-size="8">{body}</font></td></tr>')
        width = max(width, max(text_width(name, 9) * 1.05, text_width(f"{what}, {format_count(count)}", 9))
                    + max(text_width(line, 8) for line in lines) + 12)
    if stage + 1 < assignment.num_stages:
        size, *link = _boundary(plan, assignment, stage)
        lines = [" · ".join([f"to stage {stage + 1} (rank {assignment.rank_of_stage[stage + 1]})", *link]), size]
        rows.append('<tr><td colspan="2" align="left" bgcolor="#f4f4f4"><font point-size="8" color="#333333">&#8594; '
                    + "<br align='left'/>".join(escape(line) for line in lines) + "<br align='left'/></font></td></tr>")
        width = max(width, max(text_width(line, 8) for line in lines) + 16)
    return ('<table border="0" cellborder="1" cellspacing="0" cellpadding="3" color="#999999">' + "".join(rows)
            + "</table>", width + 8)


def _boundary(plan: ir.Plan, assignment: Assignment, stage: int) -> list[str]:
    """The lines of the stage -> stage + 1 arrow's label: bytes per microbatch and per step, the link."""
    last = assignment.stage_layers[stage][-1]
    tokens = plan.train.micro_batch * -(-plan.seq // plan.cp)
    sequence_parallel = plan.tensor is not None and plan.tensor.sequence_parallel
    size = tokens * last.output_width * plan.train.precision.bytes / (plan.tp if sequence_parallel else 1)
    m = plan.num_microbatches
    text = f"{format_bytes(size)} / microbatch, × {m} = {format_bytes(size * m)} / step"
    a, b = assignment.rank_of_stage[stage], assignment.rank_of_stage[stage + 1]
    if a == b:
        return [text, "same rank: no transfer"]
    link = _pipeline_link(plan, a, b)
    if link is None:
        return [text]
    name, rate = link
    return [text, f"{name} {format_rate(rate.bandwidth)}: {1e3 * (rate.latency + size / rate.bandwidth):.3g} ms"]


def _pipeline_link(plan: ir.Plan, a: int, b: int):
    """(name, link) between pipeline ranks a and b: inside a node, or over the network."""
    names = [axis.name for axis in plan.mesh.axes]
    stride = 1
    for axis in plan.mesh.axes[names.index(plan.stages.axis) + 1:]:
        stride *= axis.size
    per_node = min(g.node.devices for g in plan.cluster.groups)
    first = plan.mesh.first_device
    same_node = (first + a * stride) // per_node == (first + b * stride) // per_node and \
        len(plan.cluster.groups) == 1
    if same_node:
        return "link", plan.cluster.groups[0].node.link
    links = [g.node.nic for g in plan.cluster.groups if g.node.nic] + ([plan.cluster.fabric] if plan.cluster.fabric else [])
    if not links:
        return "link", plan.cluster.groups[0].node.link
    return "network", min(links, key=lambda link: link.bandwidth)
