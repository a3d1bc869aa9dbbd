"""A `plan { ... }` block -> `ir.Plan`: model, cluster, mesh, training, parallelisms,
stages, schedule and shard rules (E2xx, and E302/E304/E305 for mesh axes by name).

Conventional axis names give defaults, so the common case stays short: an axis `dp`
means plain data parallel over it, `tp` Megatron tensor parallel, `cp` all-gather context
parallel, `ep` expert parallel and `pp` stages split evenly with the `1f1b` schedule,
unless the plan says otherwise.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from plandsl import ir
from plandsl import syntax as s
from plandsl.diagnostics import Edit, Note, did_you_mean, nearest
from plandsl.lower.bodies import attributes, build, require
from plandsl.lower.evaluate import Poison, Scope, Word
from plandsl.lower.hints import report_misspelled
from plandsl.lower.mesh import mesh, training
from plandsl.diagnostics.limits import MAX_PREFETCH, MAX_PREFETCH_BUCKET, MAX_VIRTUAL
from plandsl.lower.model import model_value
from plandsl.lower.selectors import selector
from plandsl.schedules.registry import BUILTIN, DEFAULT_SCHEDULE
from plandsl.diagnostics.source import Span

if TYPE_CHECKING:
    from plandsl.lower import Lowering

PLAN_ATTRS = {"model": True, "cluster": True, "mesh": True, "train": True, "data": False, "tensor": False,
              "context": False, "experts": False, "stages": False, "schedule": False}
DATA_KINDS: dict[str, ir.DataKind | str] = {  # each kind, then its other spellings (`ddp`, `fsdp`), then `none`
    **{name: kind for kind in ir.DataKind
       for name in (kind.value, *(other for other, meant in ir.DATA_KIND_SPELLINGS.items() if meant is kind))},
    "none": "none"}
TENSOR_STYLES = ("megatron", "none")
CONTEXT_KINDS = ("ring", "allgather", "none")
EXPERT_KINDS = ("alltoall", "deepep", "hybridep", "none")
CLAUSE_OPTIONS: dict[str, tuple[str, ...]] = {  # an attribute's clause -> the `with` options it takes
    "data": ("unit", "prefetch", "prefetch_bucket", "gather"), "tensor": ("sequence_parallel", "overlap", "sm_margin", "implementation"), "context": ("implementation",), "experts": ("overlap",),
    "stages": ("virtual", "map", "implementation", "account", "outputs")}
STYLES = ("colwise", "rowwise", "sequence", "replicate")
DEFAULT_AXES = {"data": "dp", "tensor": "tp", "context": "cp", "experts": "ep", "stages": "pp"}


def lower_plan(lowering: "Lowering", scope: Scope, d: s.Definition) -> ir.Plan:
    what = f"plan '{d.name}'"
    found = attributes(scope, d.body, PLAN_ATTRS, what)
    blocks = [b for b in d.body if isinstance(b, s.Block)]
    for block in blocks:
        if block.name != "stages":
            report_misspelled(scope.reporter, "E206", f"{what} has no block '{block.name}'", block.name,
                              block.name_span, ["stages"], "blocks")
        elif "stages" in found:
            scope.reporter.error("E213", "stages are given twice", block.name_span,
                                 notes=[Note("first given", found["stages"].name_span)])
    stage_block = next((b for b in blocks if b.name == "stages"), None)
    if not require(scope, found, PLAN_ATTRS, what, d.name_span, d.body):
        raise Poison()
    fields: dict = {}
    failed = False

    def attempt(key, function, *args):
        nonlocal failed
        try:
            fields[key] = function(*args)
        except Poison:
            failed = True

    attempt("model", model_value, scope, found["model"].value, None)
    attempt("cluster", lowering.cluster, scope, found["cluster"].value)
    attempt("mesh", mesh, scope, found["mesh"].value, fields.get("cluster"))
    attempt("train", training, scope, found["train"].value)
    if "mesh" not in fields:
        raise Poison()
    m: ir.Mesh = fields["mesh"]
    for key, function in (("data", data_parallel), ("tensor", tensor_parallel), ("context", context_parallel),
                          ("experts", expert_parallel)):
        if key in found:
            attempt(key, function, scope, found[key].value, m)
        elif m.axis(DEFAULT_AXES[key]):
            fields[key] = _default(key, m)
    if stage_block is not None:
        attempt("stages", stages_block, scope, stage_block, m)
    elif "stages" in found:
        attempt("stages", stages_clause, scope, found["stages"].value, m)
    elif m.axis("pp"):
        fields["stages"] = ir.Stages(axis="pp", span=m.axis("pp").span)
    if "schedule" in found:
        attempt("schedule", schedule_ref, scope, found["schedule"].value)
    elif fields.get("stages") is not None:
        fields["schedule"] = ir.ScheduleRef(name=DEFAULT_SCHEDULE, span=fields["stages"].span)
    rules = []
    for stmt in d.body:
        if isinstance(stmt, s.ShardRule):
            try:
                rules.append(shard_rule(scope, stmt, m))
            except Poison:
                failed = True
    if failed:
        raise Poison()
    fields = {k: v for k, v in fields.items() if v is not None}
    return build(scope, ir.Plan, d.span, name=d.name, shard=tuple(rules), **fields)


def _default(key: str, m: ir.Mesh):
    """The parallelism an axis's conventional name implies; it points at the axis in errors."""
    axis = DEFAULT_AXES[key]
    span = m.axis(axis).span
    return {"data": lambda: ir.DataParallel(kind=ir.DataKind.replicate, axes=(axis,), span=span),
            "tensor": lambda: ir.TensorParallel(axis=axis, span=span),
            "context": lambda: ir.ContextParallel(axis=axis, span=span),
            "experts": lambda: ir.ExpertParallel(axis=axis, span=span)}[key]()


# ---- parallelisms ------------------------------------------------------------------------
def axis_spans(scope: Scope, expr: s.Expr | None, m: ir.Mesh, key: str = "axis") -> dict:
    """Where each axis name of `over ...` was written, as `field_spans` (`axis`, or `axes.0`, `axes.1`, ...):
    hints that move a parallelism to another axis edit that name."""
    if expr is None:
        return {}
    target = expr if isinstance(expr, s.Name) and m.axis(expr.id) else scope.deref(expr)[0]
    items = target.items if isinstance(target, s.ListExpr) else (target,)
    if key == "axis":
        return {"axis": items[0].span} if len(items) == 1 and items[0].span else {}
    return {f"{key}.{i}": item.span for i, item in enumerate(items) if item.span}


def _over_edit(span, what: str, m: ir.Mesh) -> tuple[str, tuple[Edit, ...]]:
    """The hint of a parallelism without `over`, and its edit when the mesh has the role's usual axis (for
    data: else the first axis no other role's name claims; hsdp's two). The checker's analysis checks the
    edited plan before it offers the edit (`check.axis_roles.confirm_over`)."""
    role = next((r for r, words in _ROLE_WORDS.items() if what.startswith(words)), None)
    usual = DEFAULT_AXES.get(role or "")
    axes = ", ".join(a.name for a in m.axes)
    names = [usual] if usual is not None and m.axis(usual) is not None else []
    if role == "data":
        names += [a.name for a in m.axes if a.name not in DEFAULT_AXES.values()]
        names = names[:2] if what.endswith("'hsdp'") else names[:1]
    if not names or (what.endswith("'hsdp'") and len(names) < 2) or span is None:
        return f"add `over <axis>`; the mesh has {axes}", ()
    over = names[0] if len(names) == 1 else f"[{', '.join(names)}]"
    end = Span(span.file, span.end_line, span.end_column, span.end_line, span.end_column, span.end, span.end)
    return f"add `over {over}` (the mesh has {axes})", (Edit(end, f" over {over}"),)


_ROLE_WORDS = {"data": "data parallel", "tensor": "tensor parallel", "context": "context parallel",
               "experts": "expert parallel", "stages": "stages"}


def axis_names(scope: Scope, expr: s.Expr | None, m: ir.Mesh, what: str, span=None) -> tuple[str, ...]:
    """`over tp` or `over [dp, fsdp]`: names of mesh axes (E302 for unknown, E303 for repeats)."""
    if expr is None:
        hint, edits = _over_edit(span, what, m)
        raise scope.reporter.error("E306", f"{what} needs the mesh axis it runs over", span, hint=hint, edits=edits)
    # An axis's own name wins over a `let` of the same name: `over tp` means the mesh axis.
    target = expr if isinstance(expr, s.Name) and m.axis(expr.id) else scope.deref(expr)[0]
    items = target.items if isinstance(target, s.ListExpr) else (target,)
    names: list[str] = []
    for item in items:
        if not isinstance(item, s.Name):
            raise scope.reporter.error("E205", f"{what} runs over mesh axes by name, like `over tp`", item.span)
        if m.axis(item.id) is None:
            report_misspelled(scope.reporter, "E302", f"the mesh has no axis '{item.id}'", item.id, item.span,
                              [a.name for a in m.axes], "mesh axes", notes=[Note("mesh declared", m.span)])
            raise Poison()
        if item.id in names:
            raise scope.reporter.error("E303", f"axis '{item.id}' is used twice in {what}", item.span)
        names.append(item.id)
    return tuple(names)


def one_axis(scope: Scope, expr: s.Expr | None, m: ir.Mesh, what: str, span) -> str:
    """`over tp`: exactly one mesh axis."""
    names = axis_names(scope, expr, m, what, span)
    if len(names) != 1:
        raise scope.reporter.error("E205", f"{what} runs over one mesh axis, not {len(names)}", expr.span,
                                   hint=f"fold them into one axis, e.g. `over {names[-1]}`")
    return names[0]


def _clause(scope: Scope, expr: s.Expr) -> tuple[s.Expr, s.Expr | None, tuple[s.WithItem, ...]]:
    target, _ = scope.deref(expr)
    if isinstance(target, s.Clause):
        return target.subject, target.over, target.options
    return target, None, ()


def _options(scope: Scope, options: tuple[s.WithItem, ...], allowed: tuple[str, ...], what: str,
             kind: str | None = None) -> dict:
    """The clause's `with` options by name: E206 for one `what` does not take (or any, after `kind` none, which
    has nothing to set them on), E213 for one given twice."""
    found = {}
    for option in options:
        if option.name not in allowed:
            report_misspelled(scope.reporter, "E206", f"{what} has no option '{option.name}'", option.name,
                              option.span, allowed, f"options of {what}")
            raise Poison()
        if option.name in found:
            raise scope.reporter.error("E213", f"option '{option.name}' is given twice", option.span,
                                       notes=[Note("first given", found[option.name].span)])
        if kind == "none":
            raise scope.reporter.error("E206", f"{what} = none takes no options ('{option.name}' would set nothing)",
                                       option.span, hint=f"drop `with {option.name}`, or name a kind for {what}")
        found[option.name] = option
    return found


def data_parallel(scope: Scope, expr: s.Expr, m: ir.Mesh) -> ir.DataParallel | None:
    subject, over, options = _clause(scope, expr)
    kind = scope.word(subject, DATA_KINDS, "data-parallel kind")
    found = _options(scope, options, CLAUSE_OPTIONS["data"], "data", kind)
    if kind == "none":
        return None
    axes = axis_names(scope, over, m, f"data parallel '{kind}'", expr.span)
    if kind.hybrid and len(axes) != 2:
        raise scope.reporter.error("E205", f"hsdp runs over two axes, [replicate, shard]; found {len(axes)}",
                                   (over or expr).span, hint="data = hsdp over [dp_replicate, dp_shard]")
    gathering = _gathering(scope, found, ir.DataKind(kind))
    return ir.DataParallel(kind=kind, axes=axes, **gathering, span=expr.span,
                           field_spans=axis_spans(scope, over, m, "axes")
                           | {name: option.span for name, option in found.items() if option.span})




def _gathering(scope: Scope, found: dict, kind: ir.DataKind) -> dict:
    """`with unit = module, prefetch_bucket = 5e7, gather = bf16`: how ZeRO-1/2/3 gathers its units and in which
    dtype (E206 on a kind that gathers none of them, E218 for both prefetch forms)."""
    needs = {"unit": 2, "prefetch": 3, "prefetch_bucket": 3, "gather": 1}  # the ZeRO stage from which each acts
    for name, option in found.items():
        if kind.zero_stage < needs[name]:
            does = "reduces no units" if needs[name] == 2 else "gathers no parameters"
            kinds = {1: "zero1, zero2, zero3 or hsdp", 2: "zero2, zero3 or hsdp", 3: "zero3 or hsdp"}[needs[name]]
            raise scope.reporter.error("E206", f"data = {kind} {does}: '{name}' would set nothing", option.span,
                                       hint=f"drop `with {name}`, or use {kinds}")
    if "prefetch" in found and "prefetch_bucket" in found:
        raise scope.reporter.error("E218", "prefetch and prefetch_bucket both say how far ahead to gather",
                                   found["prefetch_bucket"].span, hint="keep one: a count of units, or of parameters",
                                   notes=[Note("prefetch given", found["prefetch"].span)])
    out = {}
    if "unit" in found:
        out["unit"] = ir.GatherUnit(scope.word(_value(scope, found["unit"]), tuple(u.value for u in ir.GatherUnit),
                                               "gathering unit"))
    if "prefetch" in found:
        out["prefetch"] = scope.integer(_value(scope, found["prefetch"]), "prefetch", minimum=0, maximum=MAX_PREFETCH)
    if "prefetch_bucket" in found:
        out["prefetch_bucket"] = scope.integer(_value(scope, found["prefetch_bucket"]), "prefetch_bucket", minimum=1,
                                               maximum=MAX_PREFETCH_BUCKET)
    if "gather" in found:
        out["gather"] = ir.Precision(scope.word(_value(scope, found["gather"]),
                                                tuple(dtype.value for dtype in ir.GATHER_DTYPES), "gather dtype"))
    return out


def _value(scope: Scope, option: s.WithItem) -> s.Expr:
    """An option's value (`with unit = module`): E205 when only its name is written."""
    if option.value is None:
        raise scope.reporter.error("E205", f"option '{option.name}' needs a value, like `{option.name} = ...`",
                                   option.span)
    return option.value


def tensor_parallel(scope: Scope, expr: s.Expr, m: ir.Mesh) -> ir.TensorParallel | None:
    subject, over, options = _clause(scope, expr)
    style = scope.word(subject, TENSOR_STYLES, "tensor-parallel style")
    found = _options(scope, options, CLAUSE_OPTIONS["tensor"], "tensor", style)
    if style == "none":
        return None
    axis = one_axis(scope, over, m, "tensor parallel", expr.span)
    spans = axis_spans(scope, over, m)
    if "overlap" in found:  # the checker's E417 points at the option
        spans["overlap"] = found["overlap"].span
    overlap, implementation = _tensor_overlap(scope, found)
    if "sm_margin" in found and implementation is not ir.TensorOverlap.userbuffers:
        raise scope.reporter.error("E206", "sm_margin is Transformer Engine's userbuffers' (set_sm_margin): without "
                                   "`overlap = userbuffers` it would set nothing", found["sm_margin"].span,
                                   hint="`with sequence_parallel, overlap = userbuffers, sm_margin = false`, or drop "
                                        "`sm_margin`")
    stack = {}
    if "implementation" in found:  # whose tensor parallelism runs the layers (not written: as the overlap implies)
        option = found["implementation"]
        stack["stack"] = scope.word(_value(scope, option), ir.TENSOR_STACKS, "tensor-parallel implementation")
        spans["stack"] = option.span
        runs = ir.overlap_stack(implementation)
        if runs is not None and runs != stack["stack"]:
            overlap_name = "Transformer Engine's userbuffers" if runs == "megatron" else "torch's async TP"
            raise scope.reporter.error(
                "E206", f"implementation = {stack['stack']} beside `overlap{' = userbuffers' if runs == 'megatron' else ''}`, "
                f"{overlap_name}, which only {'Megatron-LM' if runs == 'megatron' else 'torch'}'s tensor parallelism runs",
                option.span, hint=f"`implementation = {runs}`, or drop `implementation` (the overlap implies it)")
    return ir.TensorParallel(style=style, axis=axis, sequence_parallel=_switch(scope, found, "sequence_parallel"),
                             overlap=overlap, implementation=implementation or ir.TensorOverlap.async_tp,
                             sm_margin="sm_margin" not in found or _switch(scope, found, "sm_margin"),
                             span=expr.span, field_spans=spans, **stack)


def _tensor_overlap(scope: Scope, found: dict) -> tuple[bool, ir.TensorOverlap | None]:
    """`overlap` (async TP), `overlap = async_tp | userbuffers`, `overlap = true/false`: whether the tensor-parallel
    collectives overlap, and by which implementation (None: they do not)."""
    if "overlap" not in found:
        return False, None
    value = found["overlap"].value
    kinds = tuple(k.value for k in ir.TensorOverlap)
    if value is not None:
        target, _ = scope.deref(value)
        if isinstance(target, s.Name) and target.id in kinds:
            return True, ir.TensorOverlap(scope.word(target, kinds, "tensor-parallel overlap"))
    on = _switch(scope, found, "overlap")
    return on, ir.TensorOverlap.async_tp if on else None


def _switch(scope: Scope, found: dict, name: str) -> bool:
    """An on/off option: `with NAME` (on), `with NAME = true/false`, or absent (off)."""
    return name in found and (found[name].value is None or scope.truth(scope.eval(found[name].value), found[name].value))


def context_parallel(scope: Scope, expr: s.Expr, m: ir.Mesh) -> ir.ContextParallel | None:
    subject, over, options = _clause(scope, expr)
    kind = scope.word(subject, CONTEXT_KINDS, "context-parallel kind")
    found = _options(scope, options, CLAUSE_OPTIONS["context"], "context", kind)
    if kind == "none":
        return None
    spans = axis_spans(scope, over, m)
    implementation = {}
    if "implementation" in found:  # whose ring: only a ring has one
        option = found["implementation"]
        if kind != "ring":
            raise scope.reporter.error("E206", f"context = {kind} runs no ring: 'implementation' would set nothing",
                                       option.span, hint="drop `with implementation`, or use context = ring")
        implementation["implementation"] = scope.word(_value(scope, option), ir.RING_IMPLEMENTATIONS,
                                                      "ring implementation")
        spans["implementation"] = option.span
    return ir.ContextParallel(kind=kind, axis=one_axis(scope, over, m, "context parallel", expr.span), span=expr.span,
                              field_spans=spans, **implementation)


def expert_parallel(scope: Scope, expr: s.Expr, m: ir.Mesh) -> ir.ExpertParallel | None:
    subject, over, options = _clause(scope, expr)
    kind = scope.word(subject, EXPERT_KINDS, "expert-parallel kind")
    found = _options(scope, options, CLAUSE_OPTIONS["experts"], "experts", kind)
    if kind == "none":
        return None
    overlap = _switch(scope, found, "overlap")
    # `over [ep, tp]`: the expert axis, then the axes folded into its group (the checker's E416 says which may be)
    axes = axis_names(scope, over, m, "expert parallel", expr.span)
    spans = axis_spans(scope, over, m) if len(axes) == 1 else axis_spans(scope, over, m, "fold")
    if len(axes) > 1:  # `axis` is where the expert axis was written, `fold.0`, ... the folded ones
        spans = {"axis": spans.pop("fold.0", expr.span), **{f"fold.{int(k[5:]) - 1}": v for k, v in spans.items()}}
    return ir.ExpertParallel(kind=kind, axis=axes[0], fold=axes[1:], overlap=overlap, span=expr.span,
                             field_spans=spans)


# ---- stages and schedules -----------------------------------------------------------------
def rank_map(scope: Scope, expr: s.Expr) -> str | tuple[int, ...]:
    target, inner = scope.deref(expr)
    if isinstance(target, s.ListExpr):
        return tuple(inner.integer(item, "rank", minimum=0) for item in target.items)
    return scope.word(target, ("loop", "vshape"), "stage-to-rank map")


def stages_clause(scope: Scope, expr: s.Expr, m: ir.Mesh) -> ir.Stages:
    subject, over, options = _clause(scope, expr)
    scope.word(subject, ("evenly",), "stage split")
    found = _options(scope, options, CLAUSE_OPTIONS["stages"], "stages")
    axis = one_axis(scope, over, m, "stages", expr.span)
    virtual = scope.integer(found["virtual"].value, "virtual", minimum=1, maximum=MAX_VIRTUAL) if "virtual" in found else 1
    mapping = rank_map(scope, found["map"].value) if "map" in found else "loop"
    spans = axis_spans(scope, over, m)
    options = _pipeline_options(scope, {key: (_value(scope, found[key]), found[key].span)
                                        for key in ("implementation", "outputs") if key in found})
    spans.update({key: found[key].span for key in options})
    if "account" in found:  # the embedding and the loss counted as layers of the split (Megatron's --account-for-*)
        options["account"] = accounted(scope, _value(scope, found["account"]))
        spans["account"] = found["account"].span
    return ir.Stages(axis=axis, mode="evenly", virtual=virtual, rank_map=mapping, span=expr.span,
                     field_spans=spans, **options)


def _pipeline_options(scope: Scope, found: dict) -> dict:
    """`implementation` (whose pipeline: the checker's E610 points at it) and `outputs` (what torch's does with the
    last stage's outputs; Megatron-LM's returns none: E206) of a stages clause or block, as `ir.Stages` fields;
    `found`: option -> (value expression, span)."""
    options = {}
    if "implementation" in found:
        options["implementation"] = scope.word(found["implementation"][0], ir.PIPELINE_IMPLEMENTATIONS,
                                               "pipeline implementation")
    if "outputs" in found:
        if options.get("implementation") in ("megatron", "deepspeed", "dualpipe"):
            whose = {"megatron": "Megatron-LM's pipeline returns no outputs (its schedules return the losses)",
                     "deepspeed": "DeepSpeed's pipeline engine returns no outputs (`train_batch` returns the mean "
                                  "loss)",
                     "dualpipe": "DualPipe's runtime is counted as `DualPipeV.step` runs by default "
                                 "(`return_outputs=False`: the last stage's outputs freed once used); its "
                                 "returned outputs are not modelled"}[options["implementation"]]
            raise scope.reporter.error("E206", f"{whose}: 'outputs' would set nothing", found["outputs"][1],
                                       hint=f"drop `outputs`, or run torch's pipeline: drop `implementation = "
                                       f"{options['implementation']}`")
        options["outputs"] = scope.word(found["outputs"][0], ir.PIPELINE_OUTPUTS, "pipeline outputs setting")
    return options


def accounted(scope: Scope, expr: s.Expr) -> tuple[str, ...]:
    """`account = embed`, `account = [embed, loss]`: what the split counts besides the blocks, in model order
    (E213 for one named twice)."""
    target, inner = scope.deref(expr)
    items = target.items if isinstance(target, s.ListExpr) else (target,)
    found: dict[str, s.Expr] = {}
    for item in items:
        name = inner.word(item, ir.PIPELINE_ACCOUNTED, "part counted in the split")
        if name in found:
            raise scope.reporter.error("E213", f"'{name}' is counted twice", item.span,
                                       notes=[Note("first counted", found[name].span)])
        found[name] = item
    return tuple(name for name in ir.PIPELINE_ACCOUNTED if name in found)


def stages_block(scope: Scope, block: s.Block, m: ir.Mesh) -> ir.Stages:
    found = attributes(scope, block.body, {"axis": False, "virtual": False, "map": False, "implementation": False,
                                           "outputs": False}, "stages")
    axis = one_axis(scope, found["axis"].value, m, "stages", block.name_span) if "axis" in found else "pp"
    if m.axis(axis) is None:
        raise scope.reporter.error("E302", f"stages run over axis '{axis}', which the mesh does not have",
                                   block.name_span, hint="add `pp = <stages>` to the mesh or `axis = <name>` here")
    virtual = scope.integer(found["virtual"].value, "virtual", minimum=1, maximum=MAX_VIRTUAL) if "virtual" in found else 1
    mapping = rank_map(scope, found["map"].value) if "map" in found else "loop"
    groups = []
    for entry in block.body:
        if not isinstance(entry, s.Entry):
            continue
        key, inner = scope.deref(entry.key)
        if isinstance(key, s.BinOp) and key.op == "..":
            first = inner.integer(key.left, "stage", minimum=0, maximum=ir.MAX_STAGES)
            end = inner.integer(key.right, "stage", minimum=0, maximum=ir.MAX_STAGES)
            if end <= first:
                raise scope.reporter.error("E205", f"stage range {first}..{end} is empty (ranges leave out their end)",
                                           key.span, hint=f"{first}..{first + 1} is stage {first} alone")
            stages = tuple(range(first, end))
        else:
            stages = (inner.integer(key, "stage", minimum=0, maximum=ir.MAX_STAGES),)
        groups.append(ir.StageGroup(stages=stages, selectors=tuple(selector(scope, v) for v in entry.values),
                                    span=entry.span, field_spans={"stages": entry.key.span} if entry.key.span else {}))
    if not groups:
        raise scope.reporter.error("E207", "a stages block needs `stage: layers` entries", block.name_span,
                                   hint="0: embed, layers[0:16]")
    options = _pipeline_options(scope, {key: (found[key].value, found[key].span)
                                        for key in ("implementation", "outputs") if key in found})
    return ir.Stages(axis=axis, mode="explicit", virtual=virtual, rank_map=mapping, groups=tuple(groups),
                     span=block.span, field_spans={key: found[key].span for key in options}, **options)


def schedule_ref(scope: Scope, expr: s.Expr) -> ir.ScheduleRef:
    target, inner = scope.deref(expr)
    options: dict = {}
    first_option = None
    if isinstance(target, s.Call):
        if target.args:  # nothing binds them, built-in or written: they would be dropped
            raise scope.reporter.error(
                "E206", f"schedule '{inner.text(target.func)}' takes no positional arguments "
                f"('{inner.text(target.args[0])}' would be ignored)", target.args[0].span,
                hint="virtual stages are the stages' own: `stages = evenly over pp with virtual = N`; ranks and "
                "microbatches come from the mesh and the batch")
        first_option = target.kwargs[0] if target.kwargs else None
        for kwarg in target.kwargs:
            value = inner.eval(kwarg.value)
            if isinstance(value, Word):
                value = value.name
            if not isinstance(value, (int, float, str, bool)):
                raise scope.reporter.error("E205", "schedule options are numbers, names or booleans", kwarg.value.span)
            options[kwarg.name] = value
        target = target.func
    if isinstance(target, s.BinOp) and target.op == "-":  # `interleaved-1f1b` for `interleaved_1f1b`
        written = inner.text(target)
        meant = written.replace("-", "_").replace(" ", "")
        names = set(BUILTIN) | {n for n, d in inner.definitions.items() if d.kind == "schedule"}
        if meant in names:
            raise scope.reporter.error("E601", f"unknown schedule '{written}'", target.span,
                                       hint=f"did you mean '{meant}'? names join words with `_`",
                                       edits=(Edit(target.span, meant),))
    if not isinstance(target, s.Name):
        raise scope.reporter.error("E205", "schedule takes a schedule's name, like `1f1b`", expr.span)
    found = inner.find(target.id)
    if found is not None and isinstance(found[1], s.Definition) and found[1].kind == "schedule":
        if first_option is not None:  # its variables are bound to the plan's sizes: nothing reads an option
            raise scope.reporter.error(
                "E206", f"the written schedule '{target.id}' takes no options ('{first_option.name}' would be "
                f"ignored)", first_option.span,
                hint=f"write `schedule = {target.id}`; its variables take the plan's sizes (`NAME: ranks`, "
                "`microbatches`, `virtual`, `stages`)")
        definition = inner.eval(target)  # lowers the user's schedule; the checker instantiates it
        return ir.ScheduleRef(name=target.id, options=options, definition=definition, span=expr.span)
    if target.id not in BUILTIN:
        user = [n for n, d in inner.definitions.items() if d.kind == "schedule"]
        report_misspelled(scope.reporter, "E601", f"unknown schedule '{target.id}'", target.id, target.span,
                          list(BUILTIN) + user, "schedules")
        raise Poison()
    if first_option is not None:  # a built-in is generated from the plan alone: an option would be ignored
        virtual = first_option.name == "virtual"
        raise scope.reporter.error(
            "E206", f"the built-in schedule '{target.id}' takes no options ('{first_option.name}' would be ignored)",
            first_option.span,
            hint="virtual stages are the stages' own: `stages = evenly over pp with virtual = N`" if virtual else
            f"write `schedule = {target.id}`; ranks and microbatches come from the mesh and the batch")
    return ir.ScheduleRef(name=target.id, options=options, span=expr.span)


# ---- selectors and shard rules --------------------------------------------------------------
def shard_rule(scope: Scope, stmt: s.ShardRule, m: ir.Mesh) -> ir.ShardRule:
    target = selector(scope, stmt.target)
    value, inner = scope.deref(stmt.value)
    if isinstance(value, s.DictExpr):
        params = tuple(ir.ParamRule(param=item.key, placements=placements(inner, item.value, m), span=item.span)
                       for item in value.items)
        return ir.ShardRule(target=target, params=params, span=stmt.span)
    subject, over, options = _clause(scope, value)
    close = nearest(subject.id, STYLES) if isinstance(subject, s.Name) and subject.id not in STYLES else None
    if close and subject.id != "Replicate":
        raise scope.reporter.error("E408", f"'{subject.id}' is not a shard style", subject.span,
                                   hint=f"did you mean '{close}'? (styles: {', '.join(STYLES)})",
                                   edits=(Edit(subject.span, close),))
    if isinstance(subject, s.Name) and subject.id in STYLES:
        _options(scope, options, (), "shard")
        axis = one_axis(scope, over, m, f"'{subject.id}'", value.span) if subject.id != "replicate" else None
        return ir.ShardRule(target=target, style=subject.id, axis=axis, span=stmt.span)
    return ir.ShardRule(target=target, params=(ir.ParamRule(param="*", placements=placements(inner, value, m),
                                                            span=value.span),), span=stmt.span)


def placements(scope: Scope, expr: s.Expr, m: ir.Mesh) -> tuple[ir.Placement, ...]:
    """`Shard(0) @ tp`, `[Shard(0) @ tp, Shard(1) @ cp]`, `Replicate`: one placement per axis named."""
    target, inner = scope.deref(expr)
    items = target.items if isinstance(target, s.ListExpr) else (target,)
    result: list[ir.Placement] = []
    seen: dict[str, s.Expr] = {}
    for item in items:
        if isinstance(item, s.Name) and item.id == "Replicate":
            continue  # replicated over every axis not named
        if not (isinstance(item, s.BinOp) and item.op == "@"):
            close = nearest(item.id, STYLES) if isinstance(item, s.Name) else None
            raise scope.reporter.error("E408", "a placement is `Shard(dim) @ axis`, `Replicate @ axis` or "
                                       "`Partial @ axis`", item.span,
                                       hint=f"did you mean the style '{close}'? (`shard M = {close} over AXIS`; "
                                       f"styles: {', '.join(STYLES)})" if close else None,
                                       edits=(Edit(item.span, close),) if close else ())
        kind, dim = _placement_kind(inner, item.left)
        axis = one_axis(inner, item.right, m, "a placement", item.span)
        if axis in seen:
            raise scope.reporter.error("E303", f"axis '{axis}' is used twice in one sharding", item.right.span,
                                       notes=[Note("first used", seen[axis].span)],
                                       hint="a tensor dim can be split over several axes, but each axis places it once")
        seen[axis] = item.right
        result.append(ir.Placement(kind=kind, axis=axis, dim=dim, span=item.span))
    return tuple(result)


def _placement_kind(scope: Scope, expr: s.Expr) -> tuple[str, int | None]:
    if isinstance(expr, s.Name) and expr.id in ("Replicate", "Partial"):
        return expr.id.lower(), None
    if isinstance(expr, s.Call) and isinstance(expr.func, s.Name) and expr.func.id == "Shard" \
            and len(expr.args) == 1 and not expr.kwargs:
        return "shard", scope.integer(expr.args[0], "Shard dim")
    name = expr.func.id if isinstance(expr, s.Call) and isinstance(expr.func, s.Name) else \
        expr.id if isinstance(expr, s.Name) else None
    raise scope.reporter.error("E408", "expected Shard(dim), Replicate or Partial", expr.span,
                               hint=did_you_mean(name, ("Shard", "Replicate", "Partial")) if name else None)
