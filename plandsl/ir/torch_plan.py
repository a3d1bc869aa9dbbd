"""A model written in torch, by its own names: which of its modules a pattern names, which dim of a
parameter a tensor-parallel style splits, and which layer (`embed`, a block, `head`) holds a module.

Stage: IR, torch-free (read by the layer catalogue, the checker and the cost model). Patterns are
Hugging Face's: dotted FQNs where `*` is any one name component (`model.layers.*.self_attn.q_proj`), matched by
`ir.fqn`.
Styles are the plan language's (`colwise`, `rowwise`, `sequence`, `replicate`) and Hugging Face's
(`colwise_gather_output`, `embedding_rowwise`, `replicated_with_grad_allreduce`, ...), as registered
in transformers' `distributed/tensor_parallel.py`.
"""
from __future__ import annotations

import bisect
import functools

from plandsl import ir
from plandsl.ir.fqn import Names, matches, matching  # noqa: F401 - matches: read from here by the interpreter and the catalogue
from plandsl.ir.shapes import indivisible

# Styles that split a Linear's weight [out, in] along dim 0 (its output features) or 1 (its inputs);
# on an Embedding [num, dim] torch's ColwiseParallel splits dim 1 and RowwiseParallel dim 0.
COLWISE = frozenset({"colwise", "colwise_gather_output", "colwise_rep", "unit_colwise", "packed_colwise"})
ROWWISE = frozenset({"rowwise", "unit_rowwise", "rowwise_split_input", "rowwise_rep", "packed_rowwise"})
EMBEDDING = {"embedding_rowwise": 0, "embedding_colwise": 1}
# Styles that keep the weights whole (activations split along the sequence, or replicated weights).
WHOLE = frozenset({"sequence", "sequence_parallel", "replicate", "replicated_with_grad_allreduce", "all_reduce"})
KNOWN_STYLES = COLWISE | ROWWISE | set(EMBEDDING) | WHOLE


def supports_style(module_type: str) -> bool:
    """Whether torch's ColwiseParallel / RowwiseParallel take the module (nn.Linear, nn.Embedding and their
    subclasses; known here by the class name's ending, the table holds names, not classes)."""
    return module_type.endswith(("Linear", "Embedding"))


def split_dim(style: str, module_type: str, param: str, ndim: int) -> int | None:
    """The dim of the module's parameter `param` (`weight`, `bias`) that `style` splits over the tensor axis;
    None when it keeps the parameter whole."""
    embedding = module_type.endswith("Embedding")
    if style in EMBEDDING:
        dim = EMBEDDING[style]
    elif style in COLWISE:
        dim = 1 if embedding else 0
    elif style in ROWWISE:
        dim = 0 if embedding else 1
    else:
        return None
    if param == "bias":  # colwise splits the bias with the outputs; rowwise adds the whole bias once
        return 0 if dim == 0 and not embedding else None
    return dim if dim < ndim else None


def shapes_of(fqns) -> list[str]:
    """The module names as patterns, `*` for indices (`model.layers.*.mlp`), each once, in their order."""
    import re  # lazy: only for a pattern that names nothing
    return list(dict.fromkeys(re.sub(r"\.\d+(?=\.|$)", ".*", f) for f in fqns if f))


def closest(pattern: str, fqns, shapes: list[str] | None = None) -> str:
    """The module names nearest a pattern that names none (for a hint), as patterns (`*` for indices); `shapes`:
    `shapes_of(fqns)` where the caller has it."""
    import difflib  # lazy: only for a pattern that names nothing
    import re  # lazy, with difflib
    shapes = shapes_of(fqns) if shapes is None else shapes
    found = difflib.get_close_matches(re.sub(r"\.\d+(?=\.|$)", ".*", pattern), shapes, n=3, cutoff=0.5)
    return ", ".join(found or shapes[:3])


@functools.lru_cache(maxsize=64)
def layer_index(blocks: tuple[str, ...], modules: tuple[str, ...]) -> dict[str, str]:
    """Module FQN -> the layer holding it: a block by its FQN prefix, else `embed` before the first block in
    the tree's order and `head` after it (as `plandsl inspect` splits the parameters outside the blocks)."""
    ordered = sorted(blocks)
    found: dict[str, str] = {}
    after = False
    for fqn in modules:
        index = bisect.bisect_right(ordered, fqn) - 1
        if index >= 0 and (fqn == ordered[index] or fqn.startswith(ordered[index] + ".")):
            found[fqn] = ordered[index]
            after = True
        else:
            found[fqn] = "head" if after else "embed"
    return found


def layer_of_module(model: ir.CustomModel) -> dict[str, str]:
    """Module FQN -> the name of the layer that holds it, for a model from torch ({} for any other)."""
    if not model.source or not model.modules:
        return {}
    blocks = tuple(layer.name for layer in model.layers[1:-1])
    return layer_index(blocks, tuple(m for m, _ in model.modules))


def layer_of_param(model: ir.CustomModel, param: str) -> str | None:
    return layer_of_module(model).get(param.rpartition(".")[0])


def ties_across_layers(model: ir.Model) -> bool:
    """Whether a model from torch has a tensor under two names in different layers (GPT-2's head and
    embedding): its pipeline stages could not share it (E412), so it runs without a pipeline."""
    if not isinstance(model, ir.CustomModel) or not model.tied:
        return False
    layer_of = layer_of_module(model)
    return any(layer_of.get(a.rpartition(".")[0]) != layer_of.get(b.rpartition(".")[0]) for a, b in model.tied)


HEAD_KEYS = ("num_attention_heads", "num_key_value_heads")  # a Hugging Face config's head counts


def head_counts(model: ir.CustomModel) -> dict[str, int]:
    """The head counts a Hugging Face source sets ({} for a factory, or keys left at their defaults)."""
    if not model.source or not model.source.startswith("hf("):
        return {}
    from plandsl.ir.inspected import parse_source  # lazy: ir.inspected imports pydantic models of its own
    args = dict(parse_source(model.source).args)
    return {key: args[key] for key in HEAD_KEYS
            if isinstance(args.get(key), int) and not isinstance(args[key], bool) and args[key] > 0}


def split_extents(model: ir.CustomModel) -> dict[str, int] | None:
    """Every extent the model's own tensor-parallel plan splits, by name (its config's head counts, each
    split dim of a matched parameter: `dim 0 of 'model.layers.0.self_attn.q_proj.weight'`); None when the
    plan cannot apply (a style plandsl does not know, a pattern naming a parameter rather than a module, a
    module torch cannot split so: the checker's E414; a pattern of a module's own plan naming nothing: E405)."""
    extents: dict[str, int] = dict(head_counts(model))
    types = dict(model.modules)
    shapes: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
    for name, shape in model.parameters:
        module, _, local = name.rpartition(".")
        shapes.setdefault(module, []).append((local, tuple(shape)))
    names = Names(types)
    for pattern, style in model.tp_plan:
        hit = names.matching(pattern)
        if style not in KNOWN_STYLES or not hit:
            return None
        for module in hit:
            for local, shape in shapes.get(module, ()):
                dim = split_dim(style, types[module], local, len(shape))
                if dim is None:
                    continue
                if not supports_style(types[module]):
                    return None
                extents[f"dim {dim} of '{module}.{local}'"] = shape[dim]
    return extents


def tp_splits(model: ir.Model, tp: int) -> bool:
    """Whether `tensor = megatron` of degree tp applies a torch model's own plan cleanly (the checker's rules,
    `check.torch_model`): its `split_extents` exist and the degree divides them all (`ir.shapes.indivisible`).
    False for a model with no plan (and for any other model)."""
    if not isinstance(model, ir.CustomModel) or not model.tp_plan:
        return False
    extents = split_extents(model)
    return extents is not None and (tp == 1 or not indivisible(extents, tp))
