"""Tensor dims against the axes they are split over (E406, E411) and shard rules
against the model's modules (E405, E407, E408)."""
from __future__ import annotations

from typing import Iterator

from plandsl import ir
from plandsl.diagnostics import Diagnostic, Note, diag
from plandsl.models import layers_of
from plandsl.placement import NameIndex, precision


def _divisors(n: int, limit: int = 12) -> str:
    values = [d for d in range(1, n + 1) if n % d == 0]
    return ", ".join(map(str, values[:limit])) + (", ..." if len(values) > limit else "")


def _axis_divides(dims: dict[str, int], axis: str, size: int, span) -> Diagnostic | None:
    """One diagnostic for every dim an axis fails to divide (one cause, one report)."""
    failing = {name: value for name, value in dims.items() if value % size}
    if not failing:
        return None
    if len(failing) == 1:
        ((name, value),) = failing.items()
        return _not_divisible(name, value, axis, size, span)
    listed = ", ".join(f"{name} ({value})" for name, value in failing.items())
    common = [d for d in range(1, min(dims.values()) + 1) if all(v % d == 0 for v in dims.values())]
    return diag("E406", f"axis '{axis}' ({size}) divides none of {listed}", span,
                hint=f"'{axis}' in {{{', '.join(map(str, common[:12]))}{', ...' if len(common) > 12 else ''}}} "
                f"divides all of {', '.join(dims)}")


def _not_divisible(what: str, value: int, axis: str, size: int, span) -> Diagnostic:
    return diag("E406", f"{what} ({value}) is not divisible by axis '{axis}' ({size})", span,
                hint=f"'{axis}' in {{{_divisors(value)}}} divides {what}")


def check_sharding(plan: ir.Plan) -> Iterator[Diagnostic]:
    model = plan.model
    if plan.tensor:
        dims: dict[str, int] = {}
        if isinstance(model, ir.TransformerModel):
            dims = {"heads": model.heads, "kv_heads": model.kv_heads, "hidden": model.hidden,
                    "ffn_hidden": model.ffn_hidden, "vocab": model.vocab}
            if model.kv_heads == model.heads:
                del dims["kv_heads"]  # multi-head attention: the same figure twice
            if plan.tensor.sequence_parallel and plan.cp > 1 and plan.seq % plan.cp == 0:
                dims["seq / cp"] = plan.seq // plan.cp  # each context rank's share is what is split
            elif plan.tensor.sequence_parallel:
                dims["seq"] = plan.seq
        elif isinstance(model, ir.MLPModel):
            dims = {"hidden": model.hidden}
        problem = _axis_divides(dims, plan.tensor.axis, plan.tp, plan.tensor.span)
        if problem:
            yield problem
    if plan.context:
        c = plan.cp
        if plan.seq % c:
            yield _not_divisible("seq", plan.seq, plan.context.axis, c, plan.context.span)
    if plan.experts:
        experts = getattr(model, "experts", 0)
        if not experts:
            yield diag("E411", f"expert parallel over '{plan.experts.axis}', but model '{model.name}' has no experts",
                       plan.experts.span, hint="give the model `experts=` (llama) or drop the experts line")
        elif experts % plan.ep:
            yield _not_divisible("experts", experts, plan.experts.axis, plan.ep, plan.experts.span)
    yield from _check_rules(plan)


def _check_rules(plan: ir.Plan) -> Iterator[Diagnostic]:
    if not plan.shard:
        return
    params = [p for layer in layers_of(plan.model) for p in layer.params]
    modules: dict[str, list] = {}
    for param in params:
        modules.setdefault(param.module, []).append(param)
    winners: dict[str, ir.ShardRule] = {}
    index = NameIndex(list(modules))
    for rule in plan.shard:
        hit = [index.names[i] for i in index.select(rule.target, prefix=True)]
        if not hit:
            yield diag("E405", f"'{rule.target.text}' matches no module of model '{plan.model.name}'",
                       rule.target.span, hint=_module_hint(rule.target.text, modules))
            continue
        for module in hit:
            other = winners.get(module)
            if other is None or precision(rule.target) > precision(other.target):
                winners[module] = rule
            elif precision(rule.target) == precision(other.target) and _setting(rule) != _setting(other):
                yield diag("E407", f"'{rule.target.text}' and '{other.target.text}' both set module '{module}' "
                           "differently, and neither names it more precisely", rule.span,
                           notes=[Note("the other rule", other.span)],
                           hint="an exact name beats a range, a range beats a glob: make one rule more precise")
                break
        for param_rule in rule.params:
            yield from _check_param_rule(plan, rule, param_rule, [p for m in hit for p in modules[m]])


def _setting(rule: ir.ShardRule):
    return rule.model_dump(exclude={"target"})


def _check_param_rule(plan: ir.Plan, rule: ir.ShardRule, param_rule: ir.ParamRule, params) -> Iterator[Diagnostic]:
    names = {p.name.rsplit(".", 1)[-1] for p in params}
    chosen = [p for p in params if param_rule.param in ("*", p.name.rsplit(".", 1)[-1])]
    if not chosen:
        yield diag("E408", f"modules matched by '{rule.target.text}' have no parameter '{param_rule.param}'",
                   param_rule.span, hint=f"their parameters: {', '.join(sorted(names))}")
        return
    for placement in param_rule.placements:
        if placement.kind != "shard":
            continue
        size = plan.mesh.degree(placement.axis)
        for param in chosen:
            if placement.dim is None or not -len(param.shape) <= placement.dim < len(param.shape):
                yield diag("E408", f"Shard({placement.dim}) on '{param.name}', which has {len(param.shape)} dims "
                           f"{list(param.shape)}", placement.span, hint=f"dims are 0..{len(param.shape) - 1}")
                break
            extent = param.shape[placement.dim]
            if extent % size:
                yield _not_divisible(f"dim {placement.dim} of '{param.name}'", extent, placement.axis, size,
                                     placement.span)
                break


def _module_hint(text: str, modules) -> str:
    """The module patterns closest to a selector that matched nothing (`layers.*.mlp.w1`, ...)."""
    import difflib
    import re
    patterns = list(dict.fromkeys(re.sub(r"\.\d+(?=\.|$)", ".*", m) for m in modules))
    wanted = re.sub(r"\[[^]]*\]|\.\d+(?=\.|$)", ".*", text)
    close = difflib.get_close_matches(wanted, patterns, n=4, cutoff=0.4) or patterns[:4]
    return "modules look like " + ", ".join(close)
