"""Model expressions and schedule definitions -> IR (E212 for families and arguments).

`gpt(layers=, hidden=, heads=, seq=, vocab=)`, `llama(...)` (GQA or multi-head latent attention, SwiGLU, MoE
with `experts=`/`top_k=`/`shared_experts=`, group-limited routing `expert_groups=`/`group_top_k=`, dense blocks
before the MoE ones or between them; either family with
sliding-window attention, `window=`/`full_every=`, attention sinks, `sinks=`, and multi-token prediction, `mtp=`),
`mlp(...)`, and models written out
layer by layer.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from plandsl import ir
from plandsl.diagnostics import limits
from plandsl import syntax as s
from plandsl.diagnostics import Edit, did_you_mean
from plandsl.lower.bodies import attributes, build, dict_items
from plandsl.lower.evaluate import Poison, Scope, Word
from plandsl.lower.hints import report_misspelled, respelled
from plandsl.lower.inspected import SOURCES, inspected_model, model_input
from plandsl.lower.selectors import layer_names
from plandsl.lower.units import BYTES

if TYPE_CHECKING:
    from plandsl.lower import Lowering

# family -> {argument: required}
FAMILIES: dict[str, dict[str, bool]] = {
    "gpt": {"layers": True, "hidden": True, "heads": True, "seq": True, "vocab": True,
            "ffn": False, "tied": False, "parallel": False, "window": False, "full_every": False, "sinks": False,
            "mtp": False},
    "llama": {"layers": True, "hidden": True, "heads": True, "seq": True, "vocab": True,
              "kv_heads": False, "head_dim": False, "ffn": False, "experts": False, "top_k": False, "shared_experts": False,
              "expert_groups": False, "group_top_k": False, "q_lora_rank": False, "kv_lora_rank": False,
              "qk_rope_head_dim": False, "qk_nope_head_dim": False,
              "v_head_dim": False, "dense_layers": False, "dense_ffn": False, "moe_every": False, "moe_offset": False,
              "tied": False, "parallel": False,
              "window": False, "full_every": False, "sinks": False, "mtp": False},
    "mlp": {"layers": True, "hidden": True, "input": True, "output": True},
}


def llama_ffn(hidden: int, multiple_of: int = 256) -> int:
    """Llama's default SwiGLU width: 2/3 of 4h, rounded up to a multiple of 256 (Touvron et al. 2023)."""
    width = int(2 * 4 * hidden / 3)
    return multiple_of * ((width + multiple_of - 1) // multiple_of)


def model_value(scope: Scope, expr: s.Expr, name: str | None) -> ir.Model:
    """A model expression: a family call or the name of a model definition."""
    target, inner = scope.deref(expr)
    if isinstance(target, s.Call):
        return model_call(inner, target, name)
    value = inner.eval(target)
    if isinstance(value, (ir.TransformerModel, ir.MLPModel, ir.CustomModel)):
        return value if name is None else value.model_copy(update={"name": name})
    if isinstance(value, Word):
        if value.name in FAMILIES:
            raise scope.reporter.error("E212", f"model family '{value.name}' needs its hyper-parameters",
                                       expr.span, hint=f"{value.name}({', '.join(f'{a}=...' for a, r in FAMILIES[value.name].items() if r)})")
        raise scope.unknown(value)
    raise scope.reporter.error("E205", "expected a model: `gpt(...)`, `llama(...)`, `mlp(...)` or a model's name",
                               expr.span)


def model_call(scope: Scope, call: s.Call, name: str | None) -> ir.Model:
    if isinstance(call.func, s.Name) and call.func.id in SOURCES:  # a model written in torch, read from its cache
        return inspected_model(scope, call, name)
    if not isinstance(call.func, s.Name) or call.func.id not in FAMILIES:
        shown = call.func.id if isinstance(call.func, s.Name) else "this"
        report_misspelled(scope.reporter, "E212", f"unknown model family '{shown}'", shown,
                          call.func.span if shown != "this" else None, FAMILIES, "model families")
        raise Poison()
    family = call.func.id
    allowed = FAMILIES[family]
    if call.args:
        raise scope.reporter.error("E212", f"{family}() takes named arguments only", call.args[0].span,
                                   hint=f"{family}({', '.join(f'{a}=...' for a, r in allowed.items() if r)})")
    args: dict[str, s.KwArg] = {}
    failed = False
    meant: set[str] = set()  # arguments a misspelling stands for: not reported missing as well
    for kwarg in call.kwargs:
        if kwarg.name not in allowed:
            meant |= report_misspelled(scope.reporter, "E212", f"{family}() has no argument '{kwarg.name}'",
                                       kwarg.name, kwarg.span, allowed, f"arguments of {family}()")
            failed = True
        elif kwarg.name in args:
            scope.reporter.error("E213", f"argument '{kwarg.name}' is given twice", kwarg.span)
            failed = True
        else:
            args[kwarg.name] = kwarg
    missing = [a for a, required in allowed.items() if required and a not in args and a not in meant]
    if missing:
        raise scope.reporter.error("E212", f"{family}() is missing {', '.join(missing)}", call.span,
                                   hint=f"add {', '.join(f'{m}=...' for m in missing)}")
    if failed:
        raise Poison()
    values = {}
    for key, kwarg in args.items():
        if key in ("tied", "parallel", "sinks"):
            values[key] = scope.truth(scope.eval(kwarg.value), kwarg.value)
        else:
            minimum = 0 if key in _MAY_BE_ZERO else 1
            what, cap = f"{family}() argument '{key}'", limits.MODEL_ARGUMENTS.get(key)
            # layers and mtp depths past the cap would be walked one by one: refused; a width past its cap
            # is reported and kept, so that the shape rules (E22x) still say what else is wrong
            values[key] = scope.integer(kwarg.value, what, minimum=minimum, maximum=cap if key in _WALKED else None)
            if cap is not None and values[key] > cap:
                scope.reporter.error("E505", f"{what} must be at most {cap:,}, found {values[key]:,}", kwarg.value.span,
                                     hint="plandsl caps every count far beyond today's largest runs: see Limits in "
                                          "docs/language.md")
    label = name or family
    if family == "mlp":
        return build(scope, ir.MLPModel, call.span, kind="mlp", name=label, **values)
    hidden = values["hidden"]
    attention = {key: values[key] for key in ("window", "full_every", "sinks", "mtp") if key in values}  # E231-E234, W203
    if family == "gpt":
        fields = dict(kv_heads=values["heads"], ffn_hidden=values.get("ffn", 4 * hidden),
                      tied_embeddings=values.get("tied", False), parallel_blocks=values.get("parallel", False))
    else:
        fields = dict(kv_heads=values.get("kv_heads", values["heads"]), ffn_hidden=values.get("ffn", llama_ffn(hidden)),
                      experts=values.get("experts", 0), top_k=values.get("top_k", 0),
                      shared_experts=values.get("shared_experts", 0), head_dim=values.get("head_dim", 0),
                      expert_groups=values.get("expert_groups", 0), group_top_k=values.get("group_top_k", 0),
                      tied_embeddings=values.get("tied", False), parallel_blocks=values.get("parallel", False))
        fields.update(_latent_attention(values, hidden), **_dense_layers(values, hidden))
        if fields["experts"] and "top_k" not in values:
            fields["top_k"] = min(2, fields["experts"])  # a top_k outside 1..experts is the checker's (E223)
        if not fields["experts"] and fields["top_k"]:
            _unrouted_top_k(scope, call, args)
    spans = {_FIELDS.get(key, key): kwarg.span for key, kwarg in args.items()}  # where each shape was written
    return build(scope, ir.TransformerModel, call.span, kind=family, name=label, layers=values["layers"],
                 field_spans=spans,
                 hidden=hidden, heads=values["heads"], seq=values["seq"], vocab=values["vocab"], **fields, **attention)


_WALKED = ("layers", "mtp")  # counts the layer catalogue builds one by one (a block, a depth each)
_FIELDS = {"ffn": "ffn_hidden", "tied": "tied_embeddings", "parallel": "parallel_blocks"}  # argument -> ir.TransformerModel field
_MAY_BE_ZERO = ("experts", "top_k", "shared_experts", "q_lora_rank", "kv_lora_rank", "dense_layers", "moe_offset",
                "window", "full_every", "mtp")  # window=0: the whole causal sequence, full_every=0: every block windowed
LATENT_ATTENTION = ("q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
"""llama()'s arguments of multi-head latent attention, named as Hugging Face's DeepseekV3Config names them."""


def _latent_attention(values: dict, hidden: int) -> dict:
    """MLA's fields as written; with `kv_lora_rank`, the head dims not written follow the head dim hidden/heads
    as DeepSeek-V2(-Lite) has them (nope = v = hidden/heads, rope half of it, even) and kv_heads is heads
    (each head its own keys and values; another kv_heads is the checker's E227). Without kv_lora_rank the other
    arguments are kept as written, for the checker's E226."""
    fields = {key: values[key] for key in LATENT_ATTENTION if key in values}
    if not values.get("kv_lora_rank"):
        return fields
    nope = fields.setdefault("qk_nope_head_dim", max(1, hidden // values["heads"]))
    fields.setdefault("qk_rope_head_dim", 2 * max(1, nope // 4))
    fields.setdefault("v_head_dim", nope)
    return fields


def _dense_layers(values: dict, hidden: int) -> dict:
    """`dense_layers` dense blocks before the MoE ones, and with `moe_every` a mixture of experts every moe_every-th
    block (at `moe_offset`, by default the last of each moe_every: Hugging Face's Llama 4 and Qwen2-MoE); the dense
    blocks `dense_ffn` wide (Llama's default width unless written)."""
    fields = {key: values[key] for key in ("dense_layers", "dense_ffn", "moe_every", "moe_offset") if key in values}
    if "moe_every" in fields and "moe_offset" not in fields:
        fields["moe_offset"] = fields["moe_every"] - 1
    if fields.get("dense_layers") or fields.get("moe_every", 1) > 1:
        fields.setdefault("dense_ffn", llama_ffn(hidden))
    return fields


def _unrouted_top_k(scope: Scope, call: s.Call, args: dict[str, s.KwArg]) -> None:
    """W202: `top_k` on a dense llama (no `experts`) routes nothing; the edit removes the argument with
    the comma that joins it to its neighbour."""
    top_k = args["top_k"]
    kwargs = list(call.kwargs)
    at = kwargs.index(top_k)
    if at > 0:
        start, end = kwargs[at - 1].span.end, top_k.span.end
    elif len(kwargs) > 1:
        start, end = top_k.span.start, kwargs[1].span.start
    else:
        start, end = top_k.span.start, top_k.span.end
    source = scope.source
    edits = (Edit(source.span(start, end), ""),) if source is not None and source.path == top_k.span.file else ()
    scope.reporter.warn("W202", "top_k is set, but the model has no experts: a dense llama routes no tokens, so "
                        "top_k changes nothing", top_k.span,
                        hint="remove `top_k`, or add `experts=<count>` for a mixture of experts", edits=edits)

LAYER_ATTRS = {"params": True, "flops": False, "activations": False, "output": False}
MODEL_ATTRS = {"seq": False, "factory": False, "args": False, "input": False}


def _respells(body: tuple, name: str) -> bool:
    """Some attribute of `body` is a misspelling of `name` (its E206 names it)."""
    return name in respelled([(stmt.name, stmt.name_span) for stmt in body if isinstance(stmt, s.Attr)], LAYER_ATTRS)


def custom_model(lowering: "Lowering", scope: Scope, d: s.Definition) -> ir.CustomModel:
    found = attributes(scope, d.body, MODEL_ATTRS, f"model '{d.name}'")
    layers: list[ir.CustomLayer] = []
    seen: dict[str, s.LayerDecl] = {}
    for stmt in d.body:
        if not isinstance(stmt, s.LayerDecl):
            continue
        try:
            names = layer_names(scope, stmt.target)
            attrs = attributes(scope, stmt.body, LAYER_ATTRS, f"layer {names[0] if len(names) == 1 else 'group'}")
            if "params" not in attrs and _respells(stmt.body, "params"):
                raise Poison()  # reported once, as the misspelled attribute (E206)
            if "params" not in attrs:
                raise scope.reporter.error("E207", "a layer needs `params = <count>`", stmt.target.span)
            params = scope.integer(attrs["params"].value, "params", minimum=0)
            flops = _number(scope, attrs, "flops")
            output = scope.integer(attrs["output"].value, "output", minimum=0) if "output" in attrs else 0
            activations = 0.0
            if "activations" in attrs:
                value = scope.eval(attrs["activations"].value)
                activations = scope.quantity(attrs["activations"].value, BYTES, "activations") \
                    if not isinstance(value, (int, float)) else float(value)
        except Poison:
            continue
        for layer_name in names:
            if layer_name in seen:
                scope.reporter.error("E202", f"layer '{layer_name}' is declared twice", stmt.target.span)
                continue
            seen[layer_name] = stmt
            layers.append(build(scope, ir.CustomLayer, stmt.span, name=layer_name, params=params, flops=flops,
                                activations=activations, output=output))
    if not layers:
        raise scope.reporter.error("E207", f"model '{d.name}' declares no layers", d.name_span,
                                   hint="add `layer embed { params = 1000 }` lines")
    seq = scope.integer(found["seq"].value, "seq", minimum=1, maximum=limits.MAX_SEQ) if "seq" in found else 1
    image = model_input(scope, found["input"].value) if "input" in found else None
    if image is not None and seq != 1:
        raise scope.reporter.error("E205", f"a model that takes images has its figures per sample (seq 1), "
                                   f"not seq {seq}", found["seq"].value.span, hint="remove `seq`")
    factory = None
    if "factory" in found:
        factory = scope.eval(found["factory"].value)
        if not isinstance(factory, str) or ":" not in factory:
            raise scope.reporter.error("E205", "factory takes a string \"package.module:function\"",
                                       found["factory"].value.span)
    args = {}
    if "args" in found:
        items = dict_items(scope, found["args"].value, _AnyKey(), "args")
        for key, item in items.items():
            value = scope.eval(item.value)
            if not isinstance(value, (int, float, str, bool)):
                raise scope.reporter.error("E205", "factory arguments are numbers, strings or booleans", item.value.span)
            args[key] = value
    return build(scope, ir.CustomModel, d.span, kind="custom", name=d.name, layers=tuple(layers), seq=seq,
                 factory=factory, factory_args=args, image=image)


class _AnyKey(dict):
    """An `allowed` mapping that allows every key and requires none."""

    def __contains__(self, key) -> bool:
        return True


def _number(scope: Scope, attrs: dict, key: str) -> float:
    if key not in attrs:
        return 0.0
    value = scope.number(scope.eval(attrs[key].value), attrs[key].value)
    if value < 0:
        raise scope.reporter.error("E205", f"{key} must not be negative", attrs[key].value.span)
    return float(value)


DIMENSIONS = ("ranks", "microbatches", "stages", "virtual")


def schedule_def(scope: Scope, d: s.Definition) -> ir.ScheduleDef:
    rows = [stmt for stmt in d.body if isinstance(stmt, s.RankRow)]
    others = [stmt for stmt in d.body if not isinstance(stmt, s.RankRow)]
    sizes, variables = {}, {}
    for param in d.params:
        if param.dimension is not None:
            if param.dimension not in DIMENSIONS:
                scope.reporter.error("E210", f"'{param.dimension}' is not a schedule dimension", param.span,
                                     hint=did_you_mean(param.dimension, DIMENSIONS, "dimensions"))
                continue
            variables[param.name] = param.dimension
        else:
            if param.name not in DIMENSIONS:
                scope.reporter.error("E210", f"'{param.name}' is not a schedule dimension", param.span,
                                     hint=did_you_mean(param.name, DIMENSIONS, "dimensions"))
                continue
            sizes[param.name] = scope.integer(param.value, param.name, minimum=1)
    if rows and (others or variables):
        raise scope.reporter.error("E608", "a schedule is either a table (`rank 0: ...` rows, fixed sizes) "
                                   "or a template (loops over `p: ranks, m: microbatches`), not both", d.name_span)
    if rows:
        by_rank = {}
        for row in rows:
            if row.rank >= ir.MAX_STAGES:
                raise scope.reporter.error("E205", f"rank {row.rank:,}: a table has at most {ir.MAX_STAGES:,} ranks",
                                           row.span)
            if row.rank in by_rank:
                scope.reporter.error("E202", f"rank {row.rank} has two rows", row.span)
            by_rank[row.rank] = row.cells
        count = max(by_rank) + 1
        return build(scope, ir.ScheduleDef, d.span, name=d.name, kind="table", sizes=sizes,
                     rows=tuple(by_rank.get(r, ()) for r in range(count)), syntax=d, scope=scope)
    _mark_used(scope, d.body)
    return build(scope, ir.ScheduleDef, d.span, name=d.name, kind="template", sizes=sizes,
                 variables=variables, source=_source_text(scope, d), syntax=d, scope=scope)


def _mark_used(scope: Scope, body) -> None:
    """Names a template's body uses count as used (W201), though they are evaluated only later."""
    stack = list(body)
    while stack:
        node = stack.pop()
        if isinstance(node, s.Name):
            found = scope.find(node.id)
            if found is not None:
                found[0].used.add(node.id)
        elif isinstance(node, s.Node):
            stack.extend(getattr(node, name) for name in node.__dataclass_fields__ if name != "span")
        elif isinstance(node, tuple):
            stack.extend(node)


def _source_text(scope: Scope, d: s.Definition) -> str:
    source = scope.source
    return source.text[d.span.start:d.span.end] if source is not None else ""
