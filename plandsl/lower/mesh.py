"""A plan's `mesh = [...]` and `train = {...}` -> `ir.Mesh` and `ir.Training` (E2xx).

Stage: lowering (`plandsl.lower.plan` calls it for each plan). Contract: `mesh(scope, expr,
cluster)` and `training(scope, expr)` evaluate the expression in the file's scope and return the IR
node, reporting problems through the scope; `TRAIN_KEYS` are the keys `train` takes.
"""
from __future__ import annotations

from plandsl import ir
from plandsl.diagnostics import limits
from plandsl import syntax as s
from plandsl.diagnostics import Edit, Note, nearest
from plandsl.lower.bodies import build, dict_items
from plandsl.lower.evaluate import Poison, Scope

TRAIN_KEYS = {"global_batch": True, "micro_batch": False, "seq": False, "precision": False, "fp8_recipe": False,
              "bf16_first_layers": False, "bf16_last_layers": False, "recompute": False,
              "recompute_layers": False, "recompute_modules": False, "offload_layers": False, "kernels": False, "attention": False, "loss": False, "optimizer": False,
              "master_dtype": False, "grad_dtype": False, "optimizer_dtype": False, "param_dtype": False, "lr": False, "lr_schedule": False, "warmup_steps": False, "grad_clip": False,
              "seed": False, "batch_shares": False}


def mesh(scope: Scope, expr: s.Expr, cluster: ir.Cluster | None = None) -> ir.Mesh:
    target, inner = scope.deref(expr)
    first, part = 0, None
    if isinstance(target, s.Clause):
        if target.options:
            raise scope.reporter.error("E206", "mesh takes no `with` options", target.options[0].span)
        first, part = _mesh_part(inner, target.over, cluster)
        target = target.subject
    if not isinstance(target, s.ListExpr) or not target.items:
        raise scope.reporter.error("E205", "mesh takes a list of named axes, like `[dp = 8, tp = 8]`", expr.span)
    axes: list[ir.Axis] = []
    seen: dict[str, s.Binding] = {}
    failed = False
    for item in target.items:
        if not isinstance(item, s.Binding):
            scope.reporter.error("E205", "each mesh axis needs a name: `tp = 8`", item.span)
            failed = True
            continue
        if item.name in seen:
            scope.reporter.error("E304", f"axis '{item.name}' appears twice in the mesh", item.name_span,
                                 notes=[Note("first here", seen[item.name].name_span)])
            failed = True
            continue
        seen[item.name] = item
        try:
            size = inner.integer(item.value, f"axis '{item.name}'")
        except Poison:
            failed = True
            continue
        if size < 1:
            scope.reporter.error("E305", f"axis '{item.name}' has size {size}; sizes are positive integers", item.value.span)
            failed = True
            continue
        axes.append(ir.Axis(name=item.name, size=size, span=item.span))
    if failed:
        raise Poison()
    total = 1
    for axis in axes:
        total *= axis.size
    if total > ir.MAX_MESH_DEVICES:
        raise scope.reporter.error("E301", f"the mesh has {total:,} devices; plandsl plans meshes of at most "
                                   f"{ir.MAX_MESH_DEVICES:,}", expr.span)
    return ir.Mesh(axes=tuple(axes), first_device=first, part=part, span=expr.span)


def _mesh_part(scope: Scope, expr: s.Expr, cluster: ir.Cluster | None) -> tuple[int, int]:
    """`over devices[0:16]` or `over nodes[2:4]` -> (first device, device count)."""
    if not (isinstance(expr, s.Subscript) and isinstance(expr.obj, s.Name) and expr.obj.id in ("devices", "nodes")
            and isinstance(expr.index, s.Slice)):
        word = expr.obj if isinstance(expr, s.Subscript) and isinstance(expr.obj, s.Name) else None
        close = nearest(word.id, ("devices", "nodes")) if word is not None else None
        raise scope.reporter.error("E205", "a mesh runs over part of the cluster as `over devices[a:b]` or "
                                   "`over nodes[a:b]`", expr.span,
                                   hint=f"did you mean '{close}'?" if close else None,
                                   edits=(Edit(word.span, close),) if close else ())
    lo = scope.integer(expr.index.lo, "range start", minimum=0) if expr.index.lo else 0
    if expr.index.hi is None:
        raise scope.reporter.error("E205", "give the end of the range: `devices[0:16]`", expr.span)
    hi = scope.integer(expr.index.hi, "range end", minimum=0)
    if hi <= lo:
        raise scope.reporter.error("E205", f"range [{lo}:{hi}] is empty", expr.index.span)
    if expr.obj.id == "devices":
        return lo, hi - lo
    if cluster is None:
        raise Poison()
    sizes = [g.node.devices for g in cluster.groups for _ in range(g.count)]
    if hi > len(sizes):
        raise scope.reporter.error("E301", f"nodes[{lo}:{hi}]: cluster '{cluster.name}' has {len(sizes)} nodes",
                                   expr.span)
    return sum(sizes[:lo]), sum(sizes[lo:hi])


def training(scope: Scope, expr: s.Expr) -> ir.Training:
    items = dict_items(scope, expr, TRAIN_KEYS, "train")
    values: dict = {}
    failed = False
    for key, item in items.items():
        try:
            if key in ("global_batch", "micro_batch", "seq", "warmup_steps", "seed", "recompute_layers",
                       "offload_layers", "bf16_first_layers", "bf16_last_layers"):
                values[key] = scope.integer(item.value, key,
                                            minimum=0 if key in ("warmup_steps", "seed", "recompute_layers",
                                                                 "offload_layers", "bf16_first_layers",
                                                                 "bf16_last_layers") else 1,
                                            maximum=limits.TRAIN.get(key))
            elif key == "precision":
                values[key] = scope.word(item.value, tuple(p.value for p in ir.Precision), "precision")
            elif key == "fp8_recipe":
                values[key] = scope.word(item.value, tuple(r.value for r in ir.Fp8Recipe), "FP8 recipe")
            elif key in ir.KEPT_DTYPE_KEYS or key == "param_dtype":
                values[key] = scope.word(item.value, tuple(p.value for p in ir.KEPT_DTYPES), "dtype")
            elif key == "recompute":
                values[key] = scope.word(item.value, tuple(r.value for r in ir.Recompute), "recompute mode")
            elif key == "optimizer":
                values[key] = scope.word(item.value, tuple(o.value for o in ir.Optimizer), "optimizer")
            elif key == "kernels":
                values[key] = scope.word(item.value, tuple(k.value for k in ir.Kernels), "kernel mode")
            elif key == "attention":
                values[key] = scope.word(item.value, tuple(a.value for a in ir.Attention), "attention kernel")
            elif key == "loss":
                values[key] = scope.word(item.value, tuple(l.value for l in ir.Loss), "loss kernel")
            elif key == "lr_schedule":
                values[key] = scope.word(item.value, ("constant", "cosine", "linear"), "learning-rate schedule")
            elif key == "batch_shares":
                values[key] = _batch_shares(scope, item.value)
            elif key == "recompute_modules":
                values[key] = _recompute_modules(scope, item.value)
            elif key == "grad_clip":
                target, _ = scope.deref(item.value)
                values[key] = None if isinstance(target, s.Name) and target.id == "none" else \
                    float(scope.number(scope.eval(item.value), item.value))
            else:
                values[key] = float(scope.number(scope.eval(item.value), item.value))
                if key == "lr" and values[key] > limits.MAX_LR:  # far inside what a step converts to fp32 (Adam: ~5e37)
                    raise scope.reporter.error(
                        "E505", f"lr must be at most {limits.MAX_LR:,g}, found {values[key]:,.15g}", item.value.span,
                        hint="a learning rate is below 10 in practice; torch's optimizers convert it to the update's "
                             "dtype (fp32) and raise past about 5e37 (Adam) at the first step: see Limits in "
                             "docs/language.md")
        except Poison:
            failed = True
    if "recompute_layers" in values and values.get("recompute") != ir.Recompute.full.value:
        scope.reporter.error("E205", "recompute_layers counts the blocks of each stage that `recompute: full` "
                             f"reruns; with recompute {values.get('recompute', 'none')} there are none to count",
                             items["recompute_layers"].span, hint="add `recompute: full`, or drop recompute_layers")
        failed = True
    if "recompute_modules" in values and values.get("recompute") != ir.Recompute.selective.value:
        scope.reporter.error("E205", "recompute_modules names what `recompute: selective` reruns of each block; "
                             f"with recompute {values.get('recompute', 'none')} nothing is rerun by module",
                             items["recompute_modules"].span,
                             hint="add `recompute: selective`, or drop recompute_modules")
        failed = True
    if failed:
        raise Poison()
    return build(scope, ir.Training, expr.span, field_spans={k: item.span for k, item in items.items()}, **values)


def _recompute_modules(scope: Scope, expr: s.Expr) -> tuple[str, ...]:
    """`recompute_modules: [layernorm, moe_act]`: Megatron's --recompute-modules, each named once."""
    target, inner = scope.deref(expr)
    if not isinstance(target, s.ListExpr) or not target.items:
        raise scope.reporter.error("E205", "recompute_modules takes a list of the parts `recompute: selective` "
                                   "reruns, like `[core_attn, moe_act]`", expr.span,
                                   hint="modules: " + ", ".join(m.value for m in ir.RecomputeModule))
    modules, seen, failed = [], {}, False
    for item in target.items:
        try:
            module = inner.word(item, tuple(m.value for m in ir.RecomputeModule), "recompute module")
        except Poison:
            failed = True
            continue
        if module in seen:
            scope.reporter.error("E205", f"recompute module {module} is named twice", item.span,
                                 notes=[Note("first here", seen[module])])
            failed = True
            continue
        seen[module] = item.span
        modules.append(module)
    if failed:
        raise Poison()
    return tuple(modules)


def _batch_shares(scope: Scope, expr: s.Expr) -> tuple[int, ...] | str:
    """`batch_shares: [48, 16]` (sequences per data rank) or `batch_shares: speed`."""
    target, inner = scope.deref(expr)
    if isinstance(target, s.ListExpr) and target.items:
        if len(target.items) > ir.MAX_MESH_DEVICES:
            raise scope.reporter.error("E505", f"batch_shares lists {len(target.items):,} data ranks; a mesh has at "
                                       f"most {ir.MAX_MESH_DEVICES:,} devices", expr.span)
        shares, failed = [], False
        for item in target.items:
            try:
                shares.append(inner.integer(item, "a batch share", minimum=0, maximum=limits.TRAIN["global_batch"]))
            except Poison:
                failed = True
        if failed:
            raise Poison()
        return tuple(shares)
    if isinstance(target, (s.Name, s.Str)):
        return inner.word(target, ("speed",), "batch_shares")
    raise scope.reporter.error("E205", "batch_shares takes the sequences of each data rank, like `[48, 16]`, or "
                               "`speed`", expr.span)
