"""Scaling a cluster plan down to one machine: the same layout, on a few CPU processes.

Stage: a plan file -> `.plan` text (`plandsl shrink`). Contract: `shrink(path, name, params, ranks)`
returns a `Shrunk` whose `text` is the plan with only its sizes changed, so that `plandsl run` trains
it here (gloo, one process per device) and `--check-equivalence` compares it with one process before
a cluster job is spent on it:

- the mesh keeps its axes, their names and their order; each axis of size > 1 becomes 2, an axis the
  plan pins keeps its size (the pipeline axis when `stages { }` numbers the stages, a stage-to-rank
  list maps them, or the schedule is a table or written for fixed sizes), and while the mesh has more
  than `ranks` devices, axes go to 1: data axes first (outermost first), then context, expert, tensor
  and pipeline axes;
- the model keeps its family at a tiny width that every split divides, and about 2 layers per pipeline
  stage (4 without a pipeline), or as many as the shard rules name (`layers[0:6]`: 6); a `stages { }`
  block that places layers by number (`layers[0:12]`, `layers.5`) is scaled with it, each range to
  about the same share of fewer layers (at least one, and one per stage that shares it: `0: layers[0:12]`,
  `1: layers[12:40]` become `layers[0:1]`, `layers[1:4]`); a block that names layers otherwise, or a plan
  that also names layers elsewhere (shard rules), keeps the model's layer count; a written model keeps
  its own sizes;
- `train` keeps every setting but the sizes (`offload_layers` offloads the first block of each stage: the
  scaled-down stages hold a few), micro_batch at most 2, as many microbatches as a table
  fixes, else at most 2 per pipeline rank (2 without a pipeline), the global batch to match, the
  sequence of the tiny model, and at most 1 warm-up step (a long warm-up would keep the few steps
  run here from moving the parameters);
- the cluster becomes `localhost` (stdlib_plans/clusters/local.plan); the rest of the file stays
  as written (schedules, shard rules, comments), other plans of the file are left out.

The result is checked by the language. Problems are `PlanError`s with diagnostics: the input plan's own
(as `plandsl check` reports them), E802 (`ShrinkError`, a `PlanError`) for a plan that cannot be scaled
down as written, at the line that fixes the size, and the scaled-down text's own when it does not check.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from plandsl import ir, syntax
from plandsl.diagnostics import Note, PlanError, diag
from plandsl.syntax.files import shown_path
from plandsl.syntax.loader import Loader, include, read_source, stdlib_root
from plandsl.diagnostics.source import Span
from plandsl.check.analysis import analyze
from plandsl.syntax.parser import parse_text
from plandsl.syntax.format import format_text
from plandsl.ir.select import select_plan

HEAD_DIM = 16      # the tiny model's width per attention head
SEQ = 32           # its sequence length, at least (4 tokens per context x tensor rank)
VOCAB = 256        # its vocabulary (divisible by every tensor degree up to 256)
MAX_EXPERTS = 8
MAX_MICRO_BATCH = 2
MAX_WARMUP = 1     # warm-up steps: a few steps must move the parameters for the comparison to mean much
CLUSTER = "localhost"
MAX_RANKS = 8      # the devices of one `localhost` node (stdlib_plans/clusters/local.plan)
CLUSTER_IMPORT = "clusters/local"


class ShrinkError(PlanError):
    """A plan `shrink` cannot scale down: E802 at the line that says why, and what to change."""

    def __init__(self, message: str, span: Span | None = None, hint: str | None = None,
                 sources: dict | None = None):
        super().__init__([diag("E802", message, span, hint=hint)], sources)


@dataclass(frozen=True)
class Shrunk:
    text: str
    plan: ir.Plan          # the scaled-down plan, checked
    original: ir.Plan
    changes: tuple[str, ...]  # one line per size that changed, as the header comment says
    include: tuple[str, ...] = ()  # folders outside the written file's tree that its imports read (--include)

    @property
    def ranks(self) -> int:
        return self.plan.mesh.size


def shrink(path: str | Path, name: str | None = None, params: dict[str, Any] | None = None, ranks: int = 8,
           precision: str | None = None, out_dir: str | Path | None = None) -> Shrunk:
    """The plan of `path` scaled down to at most `ranks` processes on one machine; `precision`
    overrides the plan's (fp32 makes `--check-equivalence` hold to 1e-5); `out_dir`: where the text
    will be written (relative imports are rewritten to resolve from there; default: the cwd)."""
    if not 1 <= ranks <= MAX_RANKS:
        raise ShrinkError(f"--ranks must be 1 to {MAX_RANKS} (the devices of one `{CLUSTER}` node), got {ranks}")
    path = str(path)
    analysis = analyze(str(path), params=params)
    if not analysis.ok or analysis.document is None:
        raise PlanError(analysis.errors, analysis.sources)
    original = select_plan(analysis.document, name)
    text = read_source(path).text  # read again, bounded, BOM dropped: the offsets of parse(text) below
    module = parse_text(text, path)
    definition = _plan_definition(module, original, path, analysis.sources)

    sizes = _mesh_sizes(original, definition, ranks, analysis.sources)
    microbatches = _microbatches(original, sizes)
    stage_layers = _stage_layers(original, definition)
    model_name, model_text, model_change = _model(original, sizes, module, definition, stage_layers)
    batch_degree = math.prod(sizes[axis] for axis in original.batch_axes())
    micro_batch = min(original.train.micro_batch, MAX_MICRO_BATCH)
    train = original.train.model_copy(update={
        "global_batch": microbatches * batch_degree * micro_batch, "micro_batch": micro_batch,
        "seq": _seq(original, sizes) if original.train.seq is not None and model_text else original.train.seq,
        "warmup_steps": min(original.train.warmup_steps, MAX_WARMUP),
        **({"precision": ir.Precision(precision)} if precision else {})})
    mesh = ", ".join(f"{axis.name} = {sizes[axis.name]}" for axis in original.mesh.axes)
    total = math.prod(sizes.values())
    replacements = {"model": model_name, "cluster": CLUSTER, "mesh": f"[{mesh}] over devices[0:{total}]",
                    "train": _train_text(train)}

    edits: list[tuple[int, int, str]] = list(stage_layers[1]) if stage_layers and model_text else []
    gather = _gather_edit(original, train, path) if precision else None
    if gather is not None:
        edits.append(gather[0])
    attrs = {item.name: item for item in definition.body or () if isinstance(item, syntax.Attr)}
    for key, value in replacements.items():
        if key == "model" and not model_text:
            continue
        if key in attrs:
            edits.append((attrs[key].value.span.start, attrs[key].span.end, value))
        else:
            close = definition.span.end - 1
            edits.append((close, close, f"  {key} = {value}\n"))
    for item in module.items:
        if isinstance(item, syntax.Definition) and item.kind == "plan" and item.name != original.name:
            edits.append((_leading(text, module, item), item.span.end, ""))  # its own comment goes with it
        if isinstance(item, syntax.Param) and params and item.name in params:
            edits.append((item.value.span.start, item.span.end, _literal(params[item.name])))
        if isinstance(item, syntax.Import):
            moved = _import_from(path, item.path, out_dir)
            if moved != item.path:
                edits.append((item.span.start, item.span.end, f'import "{moved}"'))
    imports = [item for item in module.items if isinstance(item, syntax.Import)]
    if not any(_is_local_cluster(path, item.path) for item in imports):
        at = _line_end(text, imports[-1].span.end) if imports else 0
        edits.append((at, at, ("\n" if imports else "") + f'import "{CLUSTER_IMPORT}"' + ("" if imports else "\n")))
    start = _leading(text, module, definition)  # above the plan's own comment
    if model_text:
        edits.append((start, start, model_text + "\n\n"))

    changes = _changes(original, sizes, total, microbatches, micro_batch, train, model_change, precision)
    if gather is not None:
        changes.append(gather[1])
    header = [f"# Plan {original.name} of {shown_path(str(path))},",  # a non-UTF-8 name was E108
              f"# scaled down by `plandsl shrink` to one machine and {total} process{'es' if total != 1 else ''}: "
              "the plan's layout at a tiny size.", "# What changed:",
              *(f"#   {line}" for line in changes),
              "# The rest is the plan as written. Run: plandsl run THIS.plan --check-equivalence", ""]
    body = _apply(text, edits)
    where = str(Path(out_dir or os.getcwd()) / "<shrunk>.plan")
    # The splice parses (a PlanError otherwise: a bug here, with the spliced text shown at the problem).
    shrunk_text = format_text("\n".join(header) + "\n" + body.lstrip("\n"), where)
    folders = _outside_folders(path, module, out_dir)
    with include(folders):
        analysis = analyze(where, text=shrunk_text, params=params)
    if not analysis.ok or analysis.document is None:
        note = Note(f"in plan '{original.name}' of {path} scaled down to {total} processes, as `plandsl shrink` "
                    "would write it (run `plandsl check` on the original; the rest is to finish by hand)")
        raise PlanError([replace(d, notes=d.notes + (note,)) for d in analysis.errors], analysis.sources)
    return Shrunk(shrunk_text, select_plan(analysis.document, original.name), original, tuple(changes), folders)


# ---- the mesh ----------------------------------------------------------------------------------------------
def _roles(plan: ir.Plan) -> dict[str, str]:
    """Each axis's part in the plan (`ir.Plan.axis_roles`), and "shard" for axes only shard rules use."""
    roles = plan.axis_roles()
    for rule in plan.shard:  # an axis only shard rules split over carries layout all the same
        for axis in [rule.axis] + [p.axis for param in rule.params for p in param.placements]:
            if axis is not None:
                roles.setdefault(axis, "shard")
    return roles


DROP_ORDER = ("unused", "dp", "cp", "ep", "shard", "tp", "pp")  # the order axes go to 1 in


def pinned_axes(plan: ir.Plan, definition: syntax.Definition) -> dict[str, tuple[str, str]]:
    """Axes whose size the plan's text fixes -> (why, what would free it); the pipeline axis only."""
    if plan.stages is None or plan.pp == 1:
        return {}
    written = plan.schedule.definition if plan.schedule is not None else None
    why = None
    if any(isinstance(item, syntax.Block) and item.name == "stages" for item in definition.body or ()):
        why = "`stages { }` numbers the stages", f"split the stages `evenly over {plan.stages.axis}`"
    elif isinstance(plan.stages.rank_map, tuple):
        why = "the stage-to-rank map lists ranks", "drop the map list (`map = loop` or `vshape`)"
    elif written is not None and written.kind == "table":
        why = f"schedule '{written.name}' is a table for {plan.pp} ranks", "use a template over `ranks` or a built-in"
    elif written is not None and ("ranks" in written.sizes or "stages" in written.sizes
                                  or "ranks" not in written.variables.values()):
        why = f"schedule '{written.name}' is written for {plan.pp} ranks", "write it over a `ranks` variable"
    return {plan.stages.axis: why} if why else {}


def _mesh_sizes(plan: ir.Plan, definition: syntax.Definition, ranks: int, sources: dict) -> dict[str, int]:
    pinned = pinned_axes(plan, definition)
    roles = _roles(plan)
    sizes = {a.name: a.size if a.name in pinned else min(a.size, 2) for a in plan.mesh.axes}
    fixed = math.prod(sizes[a] for a in pinned)
    if fixed > ranks:
        (axis, (why, fix)), = pinned.items()
        more = f"give --ranks {fixed} or more, or " if fixed <= MAX_RANKS else ""
        stages = plan.stages.span if plan.stages is not None else None
        raise ShrinkError(f"plan '{plan.name}' keeps {axis} = {sizes[axis]} ({why}), more than --ranks {ranks}",
                          stages or plan.mesh.span, f"{more}{fix}", sources)
    order = sorted((a.name for a in plan.mesh.axes if a.name not in pinned),
                   key=lambda axis: DROP_ORDER.index(roles.get(axis, "unused")))
    for axis in order:  # stable sort: outermost first within a role
        if math.prod(sizes.values()) <= ranks:
            break
        sizes[axis] = 1
    return sizes


# ---- the batch ---------------------------------------------------------------------------------------------
def _microbatches(plan: ir.Plan, sizes: dict[str, int]) -> int:
    """How many microbatches each data rank runs per step: what a table fixes, else a few."""
    m = plan.num_microbatches
    written = plan.schedule.definition if plan.schedule is not None else None
    if written is not None and (written.kind == "table" or "microbatches" in written.sizes
                                or "microbatches" not in written.variables.values()):
        return m
    pp = sizes[plan.stages.axis] if plan.stages is not None else 1
    if pp > 1:
        return m if m <= 2 * pp else 2 * pp
    return min(m, 2)


def _train_text(train: ir.Training) -> str:
    items = [f"global_batch: {train.global_batch}", f"micro_batch: {train.micro_batch}"]
    if train.seq is not None:
        items.append(f"seq: {train.seq}")
    defaults = ir.Training(global_batch=1)
    for key in ("precision", "recompute", "optimizer", "lr", "lr_schedule", "warmup_steps", "grad_clip", "seed"):
        value = getattr(train, key)
        if key not in ("precision", "recompute") and value == getattr(defaults, key):
            continue
        value = value.value if hasattr(value, "value") else value
        items.append(f"{key}: {'none' if value is None else value}")
    if train.recompute_layers is not None:
        items.append(f"recompute_layers: {train.recompute_layers}")
    if train.recompute_modules is not None:
        items.append(f"recompute_modules: [{', '.join(m.value for m in train.recompute_modules)}]")
    if train.offload_layers:  # a stage's first block: its few blocks here (2 per stage, 4 without) hold fewer than N
        items.append("offload_layers: 1")
    for key, value in train.given_dtypes().items():  # the weights narrower than a --precision given would be E205
        if key not in ("master_dtype", "param_dtype") or value.bytes >= train.precision.bytes:
            items.append(f"{key}: {value.value}")
    if train.batch_shares is not None:  # uneven shares: the cost model's at the small size (a written list would not sum)
        items.append("batch_shares: speed")
    return "{ " + ", ".join(items) + " }"


# ---- the model ---------------------------------------------------------------------------------------------
def _layers(plan: ir.Plan, sizes: dict[str, int], definition: syntax.Definition,
            stage_layers: tuple[int, list] | None) -> int:
    """The layer count: a `stages { }` block's scaled count (`_stage_layers`), the model's when the block
    names layers otherwise, else 2 per pipeline stage (4 without a pipeline), and at least enough for the
    highest layer a shard rule names (`layers[0:4]`, `layers.0`)."""
    if stage_layers is not None:
        return stage_layers[0]
    if any(isinstance(item, syntax.Block) and item.name == "stages" for item in definition.body or ()):
        return plan.model.layers
    stages = sizes[plan.stages.axis] * plan.stages.virtual if plan.stages is not None else 1
    named = [part.hi if part.kind == "range" and part.hi is not None else int(part.name) + 1
             for rule in plan.shard for part in rule.target.parts
             if part.kind == "range" or (part.name or "").isdigit()]
    return min(plan.model.layers, max(4, 2 * stages, *named))


def _names_layers(node: Any) -> bool:
    """Whether the syntax below `node` names the model's `layers` (`layers.3`, `layers[0:4]`, ...)."""
    if isinstance(node, syntax.Name):
        return node.id == "layers"
    if isinstance(node, (tuple, list)):
        return any(_names_layers(item) for item in node)
    if isinstance(node, syntax.Node):
        return any(_names_layers(getattr(node, name)) for name in node.__dataclass_fields__ if name != "span")
    return False


def _stage_layers(plan: ir.Plan, definition: syntax.Definition) -> tuple[int, list[tuple[int, int, str]]] | None:
    """A `stages { }` block that places a built-in model's layers by number, scaled down: (the new layer
    count, the edits to the block's numbers); None when there is no such block or it cannot be scaled as
    written (a key or selector that is not a literal, layers named elsewhere in the plan).

    The numbers cut the layers into runs; each run keeps about its share of 2 layers per stage (the
    model's layers over `2 x stages`, rounded), at least one, and an entry at least one per stage it
    spreads over, so the uneven splits stay uneven and every stage keeps its own layers."""
    block = next((item for item in definition.body or () if isinstance(item, syntax.Block) and item.name == "stages"),
                 None)
    if block is None or isinstance(plan.model, ir.CustomModel) or plan.stages is None:
        return None
    if any(_names_layers(item) for item in definition.body if item is not block):
        return None  # shard rules and the like keep their layer numbers: the model keeps its count
    total = plan.model.layers
    entries: list[tuple[int, list[tuple[int, int, syntax.Node]]]] = []  # (stages, [(lo, hi, selector)])
    for item in block.body:
        if not isinstance(item, syntax.Entry):
            if _names_layers(item):
                return None
            continue
        key = item.key
        if isinstance(key, syntax.Int):
            count = 1
        elif (isinstance(key, syntax.BinOp) and key.op == ".." and isinstance(key.left, syntax.Int)
              and isinstance(key.right, syntax.Int)):
            count = key.right.value - key.left.value
        else:
            return None
        runs = []
        for value in item.values:
            if not _names_layers(value):
                continue  # embed, norm, head
            if (isinstance(value, syntax.Member) and isinstance(value.obj, syntax.Name) and value.name.isdigit()):
                runs.append((int(value.name), int(value.name) + 1, value))
            elif (isinstance(value, syntax.Subscript) and isinstance(value.obj, syntax.Name)
                  and isinstance(value.index, syntax.Slice)
                  and all(end is None or isinstance(end, syntax.Int) for end in (value.index.lo, value.index.hi))):
                lo = value.index.lo.value if value.index.lo is not None else 0
                hi = value.index.hi.value if value.index.hi is not None else total
                runs.append((lo, hi, value))
            else:
                return None  # `layers.*` and other selectors: the layer count stays
        entries.append((count, runs))
    cuts = sorted({0, total} | {end for _, runs in entries for lo, hi, _ in runs for end in (lo, hi)})
    if cuts[0] != 0 or cuts[-1] != total or not any(runs for _, runs in entries):
        return None
    per = max(1, total // (2 * plan.pp * plan.stages.virtual))  # old layers per new one
    kept = {(a, b): max(1, math.floor((b - a) / per + 0.5)) for a, b in zip(cuts, cuts[1:])}
    for count, runs in entries:  # an entry spread over several stages keeps a layer for each
        pieces = [(a, b) for lo, hi, _ in runs for a, b in zip(cuts, cuts[1:]) if lo <= a and b <= hi]
        short = count - sum(kept[piece] for piece in pieces)
        if short > 0 and pieces:
            kept[max(pieces, key=lambda piece: piece[1] - piece[0])] += short
    new = {0: 0}
    for a, b in zip(cuts, cuts[1:]):
        new[b] = new[a] + kept[(a, b)]
    if new[total] >= total:
        return None
    edits = []
    for _, runs in entries:
        for lo, hi, value in runs:
            if isinstance(value, syntax.Member):
                edits.append((value.span.start, value.span.end, f"layers.{new[lo]}"))
                continue
            for end, at in ((value.index.lo, lo), (value.index.hi, hi)):
                if end is not None:
                    edits.append((end.span.start, end.span.end, str(new[at])))
    return new[total], edits


def _seq(plan: ir.Plan, sizes: dict[str, int]) -> int:
    """The tiny sequence: 32 tokens, more when context x sequence parallelism would leave fewer than 4
    per rank."""
    cp = sizes[plan.context.axis] if plan.context is not None else 1
    tp = sizes[plan.tensor.axis] if plan.tensor is not None else 1
    return max(SEQ, 4 * cp * tp)


def _model(plan: ir.Plan, sizes: dict[str, int], module: syntax.Module, definition: syntax.Definition,
           stage_layers: tuple[int, list] | None) -> tuple[str, str, str]:
    """(name, definition text, what changed) of the tiny model; ("", "", note) for a written model."""
    model = plan.model
    if isinstance(model, ir.CustomModel):
        return model.name, "", f"model {model.name}: a written model keeps its own sizes"
    taken = {item.name for item in module.items if isinstance(item, (syntax.Definition, syntax.Let, syntax.Param))}
    name = f"{model.name}_small"
    while name in taken:
        name += "_"
    layers = _layers(plan, sizes, definition, stage_layers)
    same = "the same" if layers == model.layers else f"{model.layers} ->"
    if isinstance(model, ir.MLPModel):
        hidden, inp, out = 32, min(model.input, 32), min(model.output, 32)
        return (name, f"model {name} = mlp(layers={layers}, hidden={hidden}, input={inp}, output={out})",
                f"model {model.name} (hidden {model.hidden}) -> {name}: {same} {layers} layers, hidden {hidden}")
    tp = sizes[plan.tensor.axis] if plan.tensor is not None else 1
    ep = sizes[plan.experts.axis] if plan.experts is not None else 1
    if model.kv_heads < model.heads:  # GQA stays GQA: half as many K/V heads as query heads
        kv_heads = max(2, tp)
        heads = 2 * kv_heads
    else:
        heads = kv_heads = max(4, tp)
    hidden = heads * HEAD_DIM
    step = 8 * tp
    ffn = max(step, round(model.ffn_hidden / model.hidden * hidden / step) * step)
    args = [f"layers={layers}", f"hidden={hidden}", f"heads={heads}"]
    if model.kind == "llama" and kv_heads != heads:
        args.append(f"kv_heads={kv_heads}")
    if model.kind == "llama" or ffn != 4 * hidden:
        args.append(f"ffn={ffn}")
    seq = _seq(plan, sizes)
    args += [f"seq={seq}", f"vocab={VOCAB}"]
    experts = ""
    if model.experts:
        count = max(ep, min(model.experts, MAX_EXPERTS))
        count = math.ceil(count / ep) * ep
        top_k = min(model.top_k, count)
        args += [f"experts={count}", f"top_k={top_k}"]
        experts = f", {count} experts (top {top_k})"
        if model.shared_experts:
            args.append(f"shared_experts={min(model.shared_experts, 2)}")
        if model.expert_groups:  # group-limited routing stays so (E235): the most groups, at most the model's, that
            # divide the experts and still hold top_k in group_top_k of them
            groups = max(g for g in range(1, min(model.expert_groups, count) + 1)
                         if count % g == 0 and count // g * min(model.group_top_k, g) >= top_k)
            chosen = max(min(model.group_top_k, groups, top_k), -(-top_k // (count // groups)))
            args += [f"expert_groups={groups}", f"group_top_k={chosen}"]
            experts += f", top {top_k} inside {chosen} of {groups} groups"
        if model.mixed_blocks:  # dense blocks first or between stay so, at least one MoE block among them
            dense = min(model.dense_layers, max(1, layers - 1))
            every = min(model.moe_every, max(1, layers - dense))
            offset = min(model.moe_offset, every - 1)
            if dense + (offset - dense) % every >= layers:  # no MoE block left: the first after the dense ones
                offset = dense % every
            dense_ffn = max(step, round(model.dense_ffn / model.hidden * hidden / step) * step)
            args += [f"dense_layers={dense}"] if dense else []
            args += [f"moe_every={every}"] + ([f"moe_offset={offset}"] if offset != every - 1 else []) \
                if every > 1 else []
            args += [f"dense_ffn={dense_ffn}"] if dense or every > 1 else []
            experts += f", the first {dense} dense" if dense else ""
            experts += f", every {every}th block MoE" if every > 1 else ""
    args += _latent_args(model)
    if model.window:  # still a band at the smaller sequence (W203 otherwise), every full_every-th block full
        args.append(f"window={min(model.window, max(1, seq // 2))}")
        if model.full_every and layers >= 2:
            args.append(f"full_every={min(model.full_every, layers)}")
    if model.sinks:
        args.append("sinks=true")
    if model.mtp and seq >= 2:  # each depth still with a token to predict (E234)
        args.append(f"mtp={min(model.mtp, seq - 1)}")
    if model.parallel_blocks:
        args.append("parallel=true")
    if model.tied_embeddings:
        args.append("tied=true")
    change = (f"model {model.name} (hidden {model.hidden}, {model.heads} heads, seq {model.seq}, vocab {model.vocab}"
              f"{f', {model.experts} experts' if model.experts else ''}) -> {name}: {same} {layers} layers, "
              f"hidden {hidden}, {heads} heads, seq {seq}, vocab {VOCAB}{experts}")
    return name, f"model {name} = {model.kind}({', '.join(args)})", change


def _latent_args(model: ir.TransformerModel) -> list[str]:
    """Multi-head latent attention stays so at the tiny size: latents of 2 and 1 head widths (the query's only where
    the model compresses queries), the head dims HEAD_DIM (rope half of it), values as wide as the model's ratio."""
    if not model.latent_attention:
        return []
    args = [f"q_lora_rank={2 * HEAD_DIM}"] if model.q_lora_rank else []
    value = HEAD_DIM if model.v_head_dim == model.qk_nope_head_dim else HEAD_DIM * 3 // 4
    return args + [f"kv_lora_rank={HEAD_DIM}", f"qk_rope_head_dim={HEAD_DIM // 2}", f"qk_nope_head_dim={HEAD_DIM}",
                   f"v_head_dim={value}"]


def _gather_edit(plan: ir.Plan, train: ir.Training, path: str) -> tuple[tuple[int, int, str], str] | None:
    """Under a precision override, the plan's `with gather = DTYPE` rewritten to the dtype its data parallelism
    gathers in at the new precision (the checker's E511/E515 otherwise refuse the shrunk plan: `gather = bf16` over
    an fp32 run, `gather = fp8` without FP8 training), with the line `changes` reports; None when it still holds or
    the data line is not written in `path` (analysis then says what to finish by hand)."""
    data = plan.data
    if data is None or data.gather is None:
        return None
    fp8_without = data.gather is ir.Precision.fp8 and not train.precision.quantized
    if not fp8_without and ir.gathers_as_written(data.zero_stage, data.gather, train):
        return None
    span = data.field_spans.get("gather")
    if span is None or Path(span.file).resolve() != Path(path).resolve():
        return None
    dtype = train.precision.unquantized if data.sharded else train.weights_dtype
    return (span.start, span.end, f"gather = {dtype.value}"), f"gather {data.gather.value} -> {dtype.value}"


def _changes(plan: ir.Plan, sizes: dict[str, int], total: int, microbatches: int, micro_batch: int,
             train: ir.Training, model_change: str, precision: str | None) -> list[str]:
    before = ", ".join(f"{a.name} = {a.size}" for a in plan.mesh.axes)
    after = ", ".join(f"{a.name} = {sizes[a.name]}" for a in plan.mesh.axes)
    lines = [f"mesh [{before}] -> [{after}] ({plan.mesh.size:,} -> {total} devices)", model_change,
             f"batch {plan.train.global_batch:,} sequences ({plan.num_microbatches:,} microbatches of "
             f"{plan.train.micro_batch}) -> {train.global_batch} ({microbatches} of {micro_batch})",
             f"cluster {plan.cluster.name} -> {CLUSTER}"]
    if train.warmup_steps != plan.train.warmup_steps:
        lines.append(f"warm-up {plan.train.warmup_steps:,} steps -> {train.warmup_steps}")
    if precision and precision != plan.train.precision.value:
        lines.append(f"precision {plan.train.precision.value} -> {precision}")
    return lines


# ---- the text ----------------------------------------------------------------------------------------------
def _plan_definition(module: syntax.Module, plan: ir.Plan, path: str, sources: dict) -> syntax.Definition:
    for item in module.items:
        if isinstance(item, syntax.Definition) and item.kind == "plan" and item.name == plan.name:
            return item
    raise ShrinkError(f"plan '{plan.name}' is not written in {path}", plan.span,
                      f"shrink {plan.span.file if plan.span else 'the file that defines it'}, where it is written",
                      sources)


def _is_local_cluster(importer: str, name: str) -> bool:
    found = Loader().resolve(importer, name)
    return found is not None and found.resolve() == (stdlib_root() / f"{CLUSTER_IMPORT}.plan").resolve()


def _import_from(importer: str, name: str, out_dir: str | Path | None) -> str:
    """The import as the written file must spell it: a standard-library name stays, a file next to the
    plan is named relative to `out_dir`."""
    found = Loader().resolve(importer, name)
    if found is None:
        return name
    found, root = Path(found).resolve(), stdlib_root().resolve()
    if found.is_relative_to(root):  # `import "tiny"` next to a stdlib plan: its stdlib name resolves anywhere
        return found.relative_to(root).with_suffix("").as_posix()
    return os.path.relpath(found, Path(out_dir or os.getcwd()).resolve())


def _outside_folders(importer: str, module: syntax.Module, out_dir: str | Path | None) -> tuple[str, ...]:
    """The folders of the plan's own imports that are not below `out_dir` (nor in the standard library):
    the written plan reads them only when they are named with `--include`."""
    base = Path(out_dir or os.getcwd()).resolve()
    folders = []
    for item in module.items:
        if isinstance(item, syntax.Import):
            found = Loader().resolve(importer, item.path)
            if found is None:
                continue
            found = Path(found).resolve()
            if not found.is_relative_to(base) and not found.is_relative_to(stdlib_root().resolve()):
                folders.append(str(found.parent))
    return tuple(dict.fromkeys(folders))


def _literal(value: Any) -> str:
    """A `--param` value as the language writes it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)


def _leading(text: str, module: syntax.Module, node: syntax.Node) -> int:
    """Where `node` starts with the comment lines right above it (no blank line between)."""
    start = _line_start(text, node.span.start)
    for comment in sorted((c for c in module.comments if c.own_line and c.span.end <= start),
                          key=lambda c: c.span.start, reverse=True):
        between = text[comment.span.end:start]
        if between.strip() or between.count("\n") > 1:
            break
        start = _line_start(text, comment.span.start)
    return start


def _line_start(text: str, offset: int) -> int:
    return text.rfind("\n", 0, offset) + 1


def _line_end(text: str, offset: int) -> int:
    end = text.find("\n", offset)
    return len(text) if end < 0 else end


def _apply(text: str, edits: list[tuple[int, int, str]]) -> str:
    for start, end, value in sorted(edits, key=lambda e: (e[0], e[1]), reverse=True):
        text = text[:start] + value + text[end:]
    return text


__all__ = ["Shrunk", "ShrinkError", "shrink", "pinned_axes"]
