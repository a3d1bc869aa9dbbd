"""A model written in torch, in a plan: `hf("LlamaForCausalLM", key=value, ...)` or
`factory("pkg.module:function", key=value, ...)` -> `ir.CustomModel` whose layers are read from
`plandsl inspect`'s cache beside the plan (E215 when it is missing or stale, naming the command).
`input=image(C, H, W)` among the arguments: the model takes images, its figures are per sample (seq 1).

Stage: lowering. No code runs here: the cache is JSON (`ir.inspected`), read without torch.
"""
from __future__ import annotations

import contextlib
import contextvars
import hashlib
import os
import shlex
from typing import Callable

from plandsl import ir
from plandsl import syntax as s
from plandsl.diagnostics import PlanError, diag
from plandsl.diagnostics.limits import MAX_SEQ
from plandsl.diagnostics.source import Span
from plandsl.ir.fqn import naming_something
from plandsl.ir.inspected import INPUT_KEY, InspectedModel, ModelSource, check_image, read_cache, write_cache
from plandsl.lower.bodies import build
from plandsl.lower.evaluate import Poison, Scope

SOURCES = ("hf", "factory")  # the calls that name a model written in torch
DEFAULT_SEQ = 2048
DTYPE, DTYPE_BYTES = "bfloat16", 2
_SEQ_KEYS = ("max_position_embeddings", "n_positions")  # a Hugging Face config's sequence length


def model_seq(source: ModelSource) -> int:
    """The sequence length a source is inspected at: 1 for images (one sample), else its config's, else 2048; at most
    the longest sequence a plan trains on (`limits.MAX_SEQ`: a config's 2^25 positions made a table past it, which
    `inspect` refused as a pydantic error and `check`'s hint asked for with a `--seq` click refuses)."""
    if source.image:
        return 1
    return min(MAX_SEQ, next((value for key, value in source.args
                              if key in _SEQ_KEYS and isinstance(value, int) and value > 0), DEFAULT_SEQ))


def inspect_command(source: ModelSource, seq: int, path: str) -> str:
    """The `plandsl inspect` command that writes the table of `source` to `path`."""
    return (f"plandsl inspect {shlex.quote(source.text)}" + ("" if source.image else f" --seq {seq}")
            + f" -o {shlex.quote(path)}")


def cache_path(plan_file: str, source: ModelSource, seq: int) -> str:
    """Where `plandsl inspect` writes the table of `source` for a plan in `plan_file`: `.plandsl/` beside it,
    named by the source, seq and dtype (the library versions and the factory's file are checked inside)."""
    key = hashlib.sha256(f"{source.text}|{seq}|{DTYPE}".encode()).hexdigest()[:16]
    return os.path.join(os.path.dirname(plan_file), ".plandsl", f"inspect-{key}.json")


_DERIVE: contextvars.ContextVar = contextvars.ContextVar("plandsl_model_import", default=None)


@contextlib.contextmanager
def model_imports(derive: Callable[[ModelSource, int, str], InspectedModel]):
    """A context inside which a missing or stale table is derived, `derive(source, seq, plan_file)` (the API
    passes `plandsl inspect`: lowering itself never imports torch or the user's code), and written where the
    plan reads it (`--allow-model-import`)."""
    token = _DERIVE.set(derive)
    try:
        yield
    finally:
        _DERIVE.reset(token)


def inspected_model(scope: Scope, call: s.Call, name: str | None) -> ir.CustomModel:
    """The call's model, its layers from the cache: the part before the blocks (`embed`), each block by its
    fully qualified name, the part after them (`head`)."""
    kind = call.func.id
    source = _source(scope, call, kind)
    seq = model_seq(source)
    path = cache_path(call.span.file, source, seq)
    state = read_cache(path, source, seq, DTYPE)
    if not state.fresh and _DERIVE.get() is not None:
        state = _derived(scope, call, source, seq, path, state.problem)
    if not state.fresh:
        folder = os.path.dirname(path) or "."
        command = (f"mkdir -p {shlex.quote(folder)} && " if state.model is None else "") + \
            inspect_command(source, seq, path)
        try:  # `plandsl inspect FILE` reads the call's literals: where it cannot (E905), only the command with
            _written_source(call)  # the values filled in writes the table
            hint = f"run: plandsl inspect {shlex.quote(call.span.file)} (or: {command})"
        except PlanError:
            hint = f"run: {command} (its arguments are not all literals, which `plandsl inspect FILE.plan` reads)"
        raise scope.reporter.error("E215", f"the layer table of {source.text} is {state.problem}", call.span,
                                   hint=hint)
    table = state.model
    return build(scope, ir.CustomModel, call.span, kind="custom", name=name or source.target.rpartition(":")[2],
                 layers=_layers(scope, call, table), seq=seq, source=source.text, block_list=table.block_list,
                 blocks=tuple(block.name for block in table.blocks), image=source.image,
                 norm_values=table.norm_values, positions=table.positions, stage_problem=table.stage_problem,
                 stages_by="base_model_pp_plan" if table.block_list_from == "base_model_pp_plan" and not table.stage_problem else
                 "trace" if table.traceable else None, **torch_names(table))


def _derived(scope: Scope, call: s.Call, source: ModelSource, seq: int, path: str, problem: str):
    """The table derived now and written to `path` (`--allow-model-import`); E215 naming why it could not be."""
    try:
        table = _DERIVE.get()(source, seq, call.span.file)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        write_cache(table, path)
    except PlanError as error:
        first = error.diagnostics[0]
        raise scope.reporter.error("E215", f"the layer table of {source.text} is {problem}, and inspecting the "
                                           f"model failed: error[{first.code}]: {first.message}", call.span,
                                   hint=f"run plandsl inspect {shlex.quote(source.text)} to see where") from None
    except OSError as error:
        raise scope.reporter.error("E215", f"the layer table of {source.text} is {problem}, and it cannot be "
                                           f"written to {path}: {error.strerror or error}", call.span) from None
    return read_cache(path, source, seq, DTYPE)


def torch_names(table: InspectedModel) -> dict:
    """What placement and sharding by the model's own names read: its module tree, its parameters (a tied
    one once), the tied pairs and its tensor-parallel plan (`ir.CustomModel`'s fields of the same names): a
    transformers model's plan without the entries that name nothing in it, as transformers applies it
    (`ir.fqn.naming_something`); a module's own plan whole (`check` says E405 of an entry naming nothing)."""
    names = [m.name for m in table.modules] + [p.name for p in table.param_list]
    plan = naming_something(table.tp_plan, names) if table.tp_plan_from_transformers else table.tp_plan
    return dict(modules=tuple((m.name, m.type) for m in table.modules),
                parameters=tuple((p.name, p.shape) for p in table.param_list if p.tied_to is None),
                tied=table.tied, tp_plan=plan, experts=table.experts, ep_plan=table.ep_plan)


def _one_string_first(kind: str) -> tuple[str, str]:
    """E212's message and hint for an `hf(...)`/`factory(...)` call that does not start with its one string."""
    example = 'hf("LlamaForCausalLM", hidden_size=4096, ...)' if kind == "hf" else \
        'factory("my_models.llama:build", depth=32)'
    return f"{kind}() takes one string first, then named arguments", example


_IMAGE_HINT = "input=image(3, 224, 224): channels, height, width"
_FACTORY_TARGET = 'factory() takes "package.module:function"'


def _source(scope: Scope, call: s.Call, kind: str) -> ModelSource:
    if len(call.args) != 1 or not isinstance(call.args[0], s.Str):
        message, example = _one_string_first(kind)
        raise scope.reporter.error("E212", message, call.span, hint=example)
    target = call.args[0].value
    if kind == "factory" and ":" not in target:
        raise scope.reporter.error("E205", _FACTORY_TARGET, call.args[0].span)
    args, image, failed = [], None, False
    for kwarg in call.kwargs:
        if kwarg.name == INPUT_KEY and _is_image(kwarg.value):
            if image is not None:
                scope.reporter.error("E213", f"argument '{kwarg.name}' is given twice", kwarg.span)
                failed = True
            elif (image := _image(scope, kwarg.value)) is None:
                failed = True
            continue
        value = scope.eval(kwarg.value)
        if not isinstance(value, (int, float, str, bool)):
            scope.reporter.error("E205", f"argument '{kwarg.name}' must be a number, string or boolean",
                                 kwarg.value.span)
            failed = True
        elif kwarg.name in dict(args):
            scope.reporter.error("E213", f"argument '{kwarg.name}' is given twice", kwarg.span)
            failed = True
        else:
            args.append((kwarg.name, value))
    if failed:
        raise Poison()
    return ModelSource(kind if kind == "hf" else "factory", target, tuple(args), image)


def _is_image(expr: s.Expr) -> bool:
    return isinstance(expr, s.Call) and isinstance(expr.func, s.Name) and expr.func.id == "image"


def _image(scope: Scope, call: s.Call) -> tuple[int, ...] | None:
    """`input=image(3, 224, 224)`: [channels, height, width] of one sample; None after reporting E205."""
    sizes = tuple(scope.eval(arg) for arg in call.args)
    try:
        if call.kwargs:
            raise ValueError("image() takes its sizes in order: image(channels, height, width)")
        return check_image(sizes, "input")
    except ValueError as error:
        scope.reporter.error("E205", str(error), call.span, hint=_IMAGE_HINT)
        return None


def model_input(scope: Scope, expr: s.Expr) -> tuple[int, ...]:
    """A written model's `input = image(C, H, W)`: the shape of one sample; E205 for anything else."""
    if not _is_image(expr):
        raise scope.reporter.error("E205", "input takes image(channels, height, width)", expr.span,
                                   hint="input = image(3, 224, 224)")
    image = _image(scope, expr)
    if image is None:
        raise Poison()
    return image


def _layers(scope: Scope, call: s.Call, table: InspectedModel) -> tuple[ir.CustomLayer, ...]:
    seq = table.seq
    width = max(1, int(table.blocks[0].input_bytes // DTYPE_BYTES)) if table.blocks else 0
    layers = [build(scope, ir.CustomLayer, call.span, name="embed", params=table.before_params,
                    flops=table.before.flops_at(seq), activations=table.before.activation_bytes_at(seq), output=width)]
    for block in table.blocks:
        layers.append(build(scope, ir.CustomLayer, call.span, name=block.name, params=block.params,
                            flops=block.figures.flops_at(seq), activations=block.figures.activation_bytes_at(seq),
                            output=int(block.output_bytes // DTYPE_BYTES),
                            attention_flops=block.figures.flops_per_position * seq))
    layers.append(build(scope, ir.CustomLayer, call.span, name="head", params=table.after_params,
                        flops=table.after.flops_at(seq), activations=table.after.activation_bytes_at(seq), output=0))
    return tuple(layers)


def written_sources(module: s.Module) -> list[tuple[ModelSource, int, str]]:
    """Every `hf(...)`/`factory(...)` call of a parsed file whose arguments are literals, with its seq and the
    cache path a plan in that file reads (what `plandsl inspect FILE.plan` writes); PlanError (`written_models`)
    for a call it cannot read a model source from."""
    return [(source, seq, cache) for source, seq, cache, _ in written_models(module)]


def written_models(module: s.Module) -> list[tuple[ModelSource, int, str, Span]]:
    """`written_sources`, each with the span of its (first) call. PlanError (no sources: the caller has the file's
    text) at a call no model source can be read from, without evaluating anything: E905 for an argument (or an
    image size) that is not a literal (a `param`, a `let`, an expression: `plandsl inspect` reads the text), and
    the codes `check` gives the same call for the rest: E212 (not one string first), E213 (`input=` twice), E205
    (an image's sizes)."""
    found: dict[str, tuple[ModelSource, int, str, Span]] = {}
    for call in _calls(module):
        source = _written_source(call)
        seq = model_seq(source)
        found.setdefault(source.text, (source, seq, cache_path(module.file, source, seq), call.span))
    return list(found.values())


def _written_source(call: s.Call) -> ModelSource:
    """The model source an `hf(...)`/`factory(...)` call writes in literals; PlanError (`written_models`)."""
    kind = call.func.id
    if len(call.args) != 1 or not isinstance(call.args[0], s.Str):
        message, example = _one_string_first(kind)
        raise PlanError([diag("E212", message, call.span, hint=example)])
    if kind == "factory" and ":" not in call.args[0].value:  # as check says it (was E901: no module of that name)
        raise PlanError([diag("E205", _FACTORY_TARGET, call.args[0].span)])
    inputs = [kwarg for kwarg in call.kwargs if kwarg.name == INPUT_KEY and _is_image(kwarg.value)]
    if len(inputs) > 1:
        raise PlanError([diag("E213", f"argument '{INPUT_KEY}' is given twice", inputs[1].span)])
    kwargs = [kwarg for kwarg in call.kwargs if kwarg not in inputs]
    named: set[str] = set()
    for kwarg in kwargs:  # as check says it (was inspected and written, the last value winning)
        if kwarg.name in named:
            raise PlanError([diag("E213", f"argument '{kwarg.name}' is given twice", kwarg.span)])
        named.add(kwarg.name)
    values = [_literal(kwarg.value) for kwarg in kwargs]
    sizes = tuple(_literal(arg) for arg in inputs[0].value.args) if inputs else ()
    unread = [f"argument '{kwarg.name}' of {kind}(...) is not a literal" for kwarg, value in zip(kwargs, values)
              if value is _NOT_LITERAL]
    unread += [f"{INPUT_KEY}=image(...) of {kind}(...) has a size that is not a literal"] if _NOT_LITERAL in sizes else []
    if unread:
        raise PlanError([diag(
            "E905", f"{unread[0]}: plandsl inspect reads a plan's model sources from its text, where a `param`, a "
                    "`let` or an expression has no value", call.span,
            hint="write the value itself here, or run the command `plandsl check` names in its E215 hint for this "
                 "model (plandsl inspect 'SOURCE' --seq N -o PATH: the values filled in)")])
    image = None
    if inputs:
        try:
            image = check_image(sizes, INPUT_KEY)
        except ValueError as error:
            raise PlanError([diag("E205", str(error), inputs[0].value.span, hint=_IMAGE_HINT)]) from None
    return ModelSource("hf" if kind == "hf" else "factory", call.args[0].value,
                       tuple((kwarg.name, value) for kwarg, value in zip(kwargs, values, strict=True)), image)


_NOT_LITERAL = object()


def _literal(expr: s.Expr):
    if isinstance(expr, (s.Int, s.Float, s.Str, s.Bool)):
        return expr.value
    if isinstance(expr, s.Unary) and expr.op == "-" and isinstance(expr.operand, (s.Int, s.Float)):
        return -expr.operand.value
    return _NOT_LITERAL


def _calls(node) -> list[s.Call]:
    """The `hf(...)`/`factory(...)` calls under a syntax node, in source order (a stack walk: no recursion)."""
    found, stack = [], [node]
    while stack:
        item = stack.pop()
        if isinstance(item, s.Call) and isinstance(item.func, s.Name) and item.func.id in SOURCES:
            found.append(item)
            continue
        if isinstance(item, (tuple, list)):
            stack.extend(reversed(item))
        elif hasattr(item, "__dataclass_fields__"):
            stack.extend(reversed([getattr(item, name) for name in item.__dataclass_fields__
                                   if name not in ("span", "comments")]))
    return found
