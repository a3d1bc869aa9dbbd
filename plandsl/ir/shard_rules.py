"""Shard rules resolved per module, without torch: which rule sets each module (the most precise selector), how it
places the module's parameters over the tensor axis (`ModuleRule`: a torch style, or placements per parameter) and
over the data axis, and which rules the interpreter cannot run (`tp_rules`, `rule_problems`). The interpreter applies
them (`runtime.parallel.tensor_parallel.apply_tp`); the cost model counts the parameters as they place them
(`ruled_layers`).

Stage: IR. Contract: functions of the plan only.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field, replace

from plandsl import ir
from plandsl.ir.layers import OTHER, TENSOR_SHARDED_DIMS, TP_SPLIT, BlockParams, Layer, Param, layers_of
from plandsl.ir.pairs import PAIRS
from plandsl.ir.selectors import NameIndex, precision


@dataclass(frozen=True)
class ModuleRule:
    """How one module is placed over the tensor axis, after the plan's rules: `colwise`, `rowwise`,
    `replicate`, `sequence`, or `placements` (per parameter: the dim split over tp, None = Replicate)."""

    style: str
    placements: dict[str, int | None] = field(default_factory=dict)
    source: str = ""  # the rule's selector, for messages
    data: dict[str, int] = field(default_factory=dict)
    """Per parameter, the dim whose storage is split over the data axis (`Shard(d) @ dp`): FSDP's
    sharding of that module (`data_parallel.shard_by_rules`), gathered for compute."""


# Linears the interpreter keeps whole on every rank of the tensor axis (`apply_tp` places no style on them): multi-head
# latent attention's down-projections (Megatron-Core's `duplicated` linears) and multi-token prediction's `eh_proj`
KEPT_WHOLE = ("wq_a", "wkv_a", "eh_proj")


def _kind(module: str) -> str:
    leaf = module.rsplit(".", 1)[-1]
    if module.startswith("embed."):
        return "embedding"
    if leaf.startswith("norm") or leaf.endswith("norm"):  # norm1, norm; MLA's q_norm, kv_norm; MTP's enorm, hnorm
        return "norm"
    if ".moe." in module:
        return "moe"
    return "linear"


def winning_rules(plan: ir.Plan, modules: list[str]) -> dict[str, ir.ShardRule]:
    """Module (of `modules`) -> the shard rule that sets it: the most precise selector, the first among equals (as
    the checker, `check.sharding`, which also reports the equals that disagree)."""
    winners: dict[str, ir.ShardRule] = {}
    if not plan.shard:
        return winners
    index = NameIndex(modules)
    for rule in plan.shard:
        for position in index.select(rule.target, prefix=True):
            other = winners.get(modules[position])
            if other is None or precision(rule.target) > precision(other.target):
                winners[modules[position]] = rule
    return winners


def _winners(plan: ir.Plan) -> dict[str, ir.ShardRule]:
    """Every module of the model that a rule sets -> that rule (`winning_rules`)."""
    return winning_rules(plan, list(dict.fromkeys(p.module for layer in layers_of(plan.model) for p in layer.params)))


def _resolve(plan: ir.Plan, module: str, rule: ir.ShardRule, params: list[str]) -> tuple[ModuleRule | None, list[str]]:
    source = rule.target.text
    axis = plan.tensor.axis
    problems = []
    if rule.axis is not None and rule.axis != axis:
        problems.append(f"shard rule '{source}' splits over '{rule.axis}'; the interpreter places parameters over "
                        f"the tensor axis '{axis}' only (ranks along '{rule.axis}' do not share activations)")
    if not rule.params:
        return (None if problems else ModuleRule(rule.style, {}, source)), problems
    dims: dict[str, int | None] = {name: None for name in params}
    data: dict[str, int] = {}
    if rule.style == "colwise":
        dims = {name: 0 for name in params}
    elif rule.style == "rowwise":
        dims["weight"] = 1
    for param_rule in rule.params:
        for name in params:
            if param_rule.param not in ("*", name):
                continue
            dims[name] = None
            for placement in param_rule.placements:
                where = f"shard rule '{source}' places '{module}.{name}'"
                if placement.kind == "partial":
                    problems.append(f"{where} as Partial @ {placement.axis}: a parameter held as a partial sum "
                                    "gets the optimizer's update once per rank; the interpreter runs Shard and "
                                    "Replicate")
                elif placement.kind == "shard" and placement.axis != axis:
                    problem = _data_shard_problem(plan, placement.axis)
                    if problem:
                        problems.append(f"{where} over '{placement.axis}'; {problem}")
                    else:
                        data[name] = placement.dim
                elif placement.kind == "shard":
                    dims[name] = placement.dim
    if data and set(data) != set(params):
        problems.append(f"shard rule '{source}' splits {', '.join(sorted(data))} of '{module}' over the data axis "
                        f"but not {', '.join(sorted(set(params) - set(data)))}: FSDP shards a module's "
                        "parameters together")
    if problems:
        return None, problems
    return ModuleRule(_classify(dims, _kind(module)), dims, source, data), []


def _data_shard_problem(plan: ir.Plan, axis: str) -> str | None:
    """Why a parameter cannot be split over `axis` (not the tensor axis), None when it can: over the one
    axis gradients are reduced over, its storage is sharded as FSDP does (ZeRO-3 for that module)."""
    group = plan.reduce_axes()
    if axis not in group:
        return (f"the interpreter places parameters over the tensor axis '{plan.tensor.axis}', and shards their "
                f"storage over the data axis, only (ranks along '{axis}' do not share activations)")
    if plan.data is not None and plan.data.hybrid:
        return "hsdp already shards every parameter over its shard axis"
    if group != (axis,):
        return (f"its storage is sharded over the whole group gradients are reduced over "
                f"({' x '.join(group)}), not over '{axis}' alone")
    if plan.stages is not None and (plan.data is None or not plan.data.sharded):  # `plandsl run` builds stages at pp 1 too
        return (f"on pipeline stages with {plan.data.kind if plan.data else 'replicate'} data parallelism the "
                "module would be an FSDP group inside a `replicate` one, and torch's stages reduce the gradients "
                "of `replicate`'s groups only; with zero2 or zero3 (fsdp) over the axis it runs")
    return None


def _classify(dims: dict[str, int | None], kind: str) -> str:
    """A torch parallel style when the placements are one, else `placements`. For a Linear [out, in],
    ColwiseParallel splits dim 0 (and the bias), RowwiseParallel dim 1; for an Embedding [vocab, hidden]
    torch's RowwiseParallel splits the vocabulary (dim 0) and ColwiseParallel the hidden dim (1)."""
    weight, others = dims.get("weight"), {k: v for k, v in dims.items() if k != "weight"}
    if weight is None and not any(v is not None for v in others.values()):
        return "replicate"
    if kind == "embedding" and not others:
        return "rowwise" if weight in (0, -2) else "colwise"
    if kind == "linear" and weight in (0, -2) and all(v in (0, -1) for v in others.values()):
        return "colwise"
    if kind == "linear" and weight in (1, -1) and all(v is None for v in others.values()):
        return "rowwise"
    return "placements"


def tp_rules(plan: ir.Plan) -> tuple[dict[str, ModuleRule], list[tuple[str | None, str]]]:
    """Module name -> its rule, for the modules the plan's `shard` rules reach; and the problems (refusals),
    each with the selector text of its rule (None: all of them)."""
    if not plan.shard:
        return {}, []
    if plan.tensor is None:
        rules = ", ".join(rule.target.text for rule in plan.shard)
        return {}, [(None, f"shard rules ({rules}) refine tensor parallelism; add `tensor = megatron over AXIS`")]
    params: dict[str, list[str]] = {}
    for layer in layers_of(plan.model):
        for param in layer.params:
            params.setdefault(param.module, []).append(param.name.rsplit(".", 1)[-1])
    tied = getattr(plan.model, "tied_embeddings", False)
    rules, problems = {}, []
    for module, rule in _winners(plan).items():
        resolved, found = _resolve(plan, module, rule, params[module])
        problems += [(rule.target.text, problem) for problem in found]
        if resolved is None:
            continue
        kind, style, source = _kind(module), resolved.style, resolved.source
        why = ""
        if resolved.data and (kind == "moe" or (tied and module in ("embed.tok", "head"))):
            why = ("its parameters are split over the data axis, which the interpreter does for dense modules that "
                   "share no weight (experts are split by `experts =`; a tied head shares the embedding's)")
        elif kind == "moe" and style != "replicate":
            why = ("the router stays replicated over the tensor axis, and the experts' FFNs are split over it as "
                   "Megatron-Core's expert tensor parallelism does (experts are split by `experts =`)")
        elif module.rsplit(".", 1)[-1] in KEPT_WHOLE and style != "replicate":
            why = ("the interpreter keeps it whole on every rank of the tensor axis (multi-head latent attention's "
                   "down-projections, multi-token prediction's projection: Megatron-Core's duplicated linears); "
                   "replicate only")
        elif kind == "norm" and style not in ("replicate", "sequence"):
            why = "a norm's parameters stay whole: it normalises over the hidden dim (replicate or sequence only)"
        elif style == "sequence" and kind != "norm":
            why = "`sequence` runs on norms (SequenceParallel); a projection takes gathered activations"
        elif style == "sequence" and not plan.tensor.sequence_parallel:
            why = (f"`sequence` needs `tensor = megatron over {plan.tensor.axis} with sequence_parallel` (the "
                   "activations between blocks are not split along the sequence)")
        elif tied and module == "embed.tok" and style != "rowwise":
            why = ("tied embeddings share one weight with the head, which keeps the vocabulary split (Shard(0)); "
                   "untie them or keep the embedding's weight Shard(0)")
        if why:
            problems.append((source, f"shard rule '{source}' on '{module}' cannot run: {why}"))
        else:
            rules[module] = resolved
    return rules, problems


def rule_problems(plan: ir.Plan) -> list[tuple[str | None, str]]:
    """(the rule's selector text, or None for all of them; a message) per problem of the shard rules the
    interpreter cannot run correctly (empty when all can). Every message names its rule."""
    return tp_rules(plan)[1]




# ---- the parameters as the rules place them ------------------------------------------------------------------------
def ruled_layers(plan: ir.Plan, layers: tuple[Layer, ...]) -> tuple[Layer, ...]:
    """`layers` with each parameter a shard rule places (`tp_rules`, the rules the interpreter runs) split over the
    tensor axis where the rule splits it and nowhere else: the dim the rule splits takes a tensor-sharded role
    (`TENSOR_SHARDED_DIMS`; its own, or `TP_SPLIT`), the others lose theirs (`OTHER`), so every count that reads the
    roles (`cost.memory.local_numel`, the embedding's whole-vocabulary gradient, `render --view placement`) sees what
    `plandsl run` builds; attention sinks split as an intact attention pair splits the heads (`_block_tp`), whole
    where a rule breaks the pair. A layer no rule reaches is returned as it is; a block's parameters stay one template for every block
    its rules place alike (`BlockParams`: their figures computed once). Memoised per plan. The built-in families only
    (a torch model's own plan places its parameters, `tp_plan`). A rule's split over the data axis (`Shard(d) @ dp`,
    FSDP's of that module) is the memory count's to take apart (`data_split_modules`, `cost.memory.model_state_bytes`).
    """
    if not plan.shard or plan.tensor is None or plan.tp == 1 or not isinstance(plan.model, ir.TransformerModel):
        return layers
    found = _RULED.get(id(plan))
    if found is not None and found[0]() is plan and found[1] is layers:
        return found[2]
    rules, templates = tp_rules(plan)[0], {}
    ruled = tuple(_ruled_layer(layer, rules, templates) for layer in layers) if rules else layers
    _RULED[id(plan)] = (weakref.ref(plan, lambda _, key=id(plan): _RULED.pop(key, None)), layers, ruled)
    return ruled


_RULED: dict[int, tuple[weakref.ref, tuple[Layer, ...], tuple[Layer, ...]]] = {}


def _ruled_layer(layer: Layer, rules: dict[str, ModuleRule], templates: dict) -> Layer:
    """`layer` with its parameters placed by `rules` (`ruled_layers`); itself where no rule reaches it. `templates`:
    (a block template's identity, how its modules are placed) -> the template placed so, for one call's blocks."""
    def placement(module: str) -> tuple | None:  # a rule's effect, hashable: what `_placed` reads of it
        rule = rules.get(module)
        return None if rule is None else (rule.style, tuple(sorted(rule.placements.items())))

    params = layer.params
    if not any(param.module in rules for param in params):
        return layer
    if type(params) is BlockParams:  # one placed template per block template and placement
        prefix = params.prefix
        key = (id(params.template), tuple((module, placement(prefix + module))
                                          for module in dict.fromkeys(m for _, m, _, _ in params.template)))
        template = templates.get(key)
        if template is None:
            template = templates[key] = tuple(
                (name, module, shape, _roles(Param(prefix + name, prefix + module, shape, dims), rules, layer.kind))
                for name, module, shape, dims in params.template)
        return replace(layer, params=BlockParams(prefix, template))
    return replace(layer, params=tuple(Param(p.name, p.module, p.shape, _roles(p, rules, layer.kind)) for p in params))


def pair_intact(rules: dict[str, ModuleRule], module: str, group: str) -> bool:
    """Whether the rules keep the pair `group` (`ir.pairs.PAIRS`: attn, mlp, shared) of `module` (its path,
    `layers.3.attn`) Megatron's: every member's rule, where it has one, its default style (producers colwise, the
    consumer rowwise). `plandsl run` splits such a pair as Megatron does (`runtime.parallel.tensor_parallel._pair`),
    and the count places its parameters so."""
    producers, consumer = PAIRS[group]
    return all((rule := rules.get(f"{module}.{name}")) is None
               or rule.style == ("rowwise" if name == consumer else "colwise") for name in (*producers, consumer))


def _roles(param: Param, rules: dict[str, ModuleRule], kind: str) -> tuple[str, ...]:
    """The roles of `param`'s dims as the rules place it: its module's rule (`_placed`); attention sinks, one logit
    per head, split where the attention pair is intact (every member's rule, if any, its default style: `_block_tp`)
    and whole where a rule breaks it (every rank then runs every head)."""
    if param.name.endswith(".attn.sinks"):
        split = pair_intact(rules, param.module, "attn")
        return param.dims if split else tuple(OTHER if role in TENSOR_SHARDED_DIMS else role for role in param.dims)
    rule = rules.get(param.module)
    return param.dims if rule is None else _placed(param, rule, kind == "embed").dims


def style_dim(style: str, leaf: str, embedding: bool) -> int | None:
    """The dim of parameter `leaf` (`weight`, `bias`) a torch style splits over the tensor axis (None: whole):
    ColwiseParallel a Linear's weight and bias along dim 0 and an Embedding's weight along dim 1, RowwiseParallel a
    Linear's weight along dim 1 and an Embedding's along dim 0; `replicate` and `sequence` none."""
    if style == "colwise":
        return (1 if leaf == "weight" else None) if embedding else 0
    if style == "rowwise":
        return (0 if embedding else 1) if leaf == "weight" else None
    return None


def _placed(param: Param, rule: ModuleRule, embedding: bool) -> Param:
    """`param` with the roles of its dims as `rule` places it over the tensor axis (`apply_tp`: a torch style's split,
    `style_dim`; placements per parameter, `PlacedParallel`)."""
    leaf, rank = param.name.rsplit(".", 1)[-1], len(param.shape)
    dim = rule.placements.get(leaf) if rule.style == "placements" else style_dim(rule.style, leaf, embedding)
    dim = None if dim is None or rank == 0 else dim % rank
    roles = tuple((role if role in TENSOR_SHARDED_DIMS else TP_SPLIT) if index == dim else
                  (OTHER if role in TENSOR_SHARDED_DIMS else role) for index, role in enumerate(param.dims))
    return param if roles == param.dims else Param(param.name, param.module, param.shape, roles)


def data_split_modules(plan: ir.Plan) -> frozenset[str]:
    """The modules a shard rule splits over the data axis (`Shard(d) @ dp`, `ModuleRule.data`), which `plandsl run`
    makes FSDP groups of their own (`data_parallel.shard_by_rules`): their storage 1/dp on each rank whatever `data =`
    says, gathered while they compute. Memoised per plan (with `ruled_layers`' rules)."""
    if not plan.shard or plan.tensor is None:
        return frozenset()
    found = _SPLIT.get(id(plan))
    if found is not None and found[0]() is plan:
        return found[1]
    modules = frozenset(module for module, rule in tp_rules(plan)[0].items() if rule.data)
    _SPLIT[id(plan)] = (weakref.ref(plan, lambda _, key=id(plan): _SPLIT.pop(key, None)), modules)
    return modules


_SPLIT: dict[int, tuple[weakref.ref, frozenset[str]]] = {}
