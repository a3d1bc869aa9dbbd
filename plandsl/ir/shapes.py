"""What each parallelism splits of a model, and the rule that its axis divides every such extent.

Stage: IR, under both the checker and the search. Contract: `tensor_extents`, `context_extents` and
`expert_extents` name the extents a tensor-parallel, context- or expert-parallel axis splits; `indivisible`
says which of them an axis size leaves a remainder of, and `tp_splits` whether a tensor-parallel degree
leaves none (the checker's model hints and the search ask it). The checker reports those as E406
(`check.sharding`, and `check.axis_sizes` for the sizes it offers); the search proposes only the
degrees that leave none (`search.choices.layouts`, sequence parallelism in `search.choices`), so it
never writes a plan the checker refuses for it (tests/unit/test_shapes.py).
"""
from __future__ import annotations

from plandsl import ir


def tensor_extents(model: ir.Model, seq: int | None = None, cp: int = 1) -> dict[str, int]:
    """Every extent a tensor-parallel axis splits, by name (as E406 names them).

    A transformer's heads, kv_heads (when they differ from heads: with multi-head attention it is
    the same figure twice, and multi-head latent attention has as many), hidden, ffn_hidden (and the
    dense blocks' dense_ffn) and vocab (Megatron-LM's column and row splits and its vocabulary-parallel
    embedding; MLA's latents are replicated, its up-projections split by heads); with sequence parallelism (`seq` given) also the sequence
    each context rank holds, `seq / cp` when the `cp` context ranks split it evenly. An MLP's hidden.
    Nothing for a model without a tensor-parallel layout."""
    if isinstance(model, ir.TransformerModel):
        dims = {"heads": model.heads, "kv_heads": model.kv_heads, "hidden": model.hidden,
                "ffn_hidden": model.ffn_hidden, "vocab": model.vocab}
        if model.kv_heads == model.heads:
            del dims["kv_heads"]
        if model.mixed_blocks:  # the dense blocks' MLP, split as ffn_hidden is
            dims["dense_ffn"] = model.dense_ffn
        if seq is not None and cp > 1 and seq % cp == 0:
            dims["seq / cp"] = seq // cp  # each context rank's share is what is split
        elif seq is not None:
            dims["seq"] = seq
        return dims
    if isinstance(model, ir.MLPModel):
        return {"hidden": model.hidden}
    return {}


def context_extents(seq: int) -> dict[str, int]:
    """What a context-parallel axis splits: the sequence."""
    return {"seq": seq}


def expert_extents(model: ir.Model) -> dict[str, int]:
    """What an expert-parallel axis splits: the experts ({} for a model without them)."""
    experts = getattr(model, "experts", 0)
    return {"experts": experts} if experts else {}


def indivisible(extents: dict[str, int], size: int) -> dict[str, int]:
    """The extents an axis of `size` leaves a remainder of ({} when it splits them all evenly)."""
    return {name: value for name, value in extents.items() if value % size}


def tp_splits(model: ir.Model, tp: int, only: tuple[str, ...] | None = None) -> bool:
    """Whether a tensor-parallel axis of size `tp` splits the model's `tensor_extents` evenly (E406's rule);
    with `only`, just those extents (a hint that changes heads asks about heads and kv_heads)."""
    extents = tensor_extents(model)
    return not indivisible({k: v for k, v in extents.items() if only is None or k in only}, tp)
