"""A built-in transformer block's Megatron pairs as `plandsl run` lays them out over the tensor axis, read from the
roles of the block's parameters (`ir.shard_rules.ruled_layers` places them as the plan's `shard` rules say).

A pair is a block's producers (the attention's q/k/v projections, MLA's up-projections, the MLP's w1 and w3) and its
consumer (wo, w2). Intact (Megatron's split, Shoeybi et al. 2019: producers split along their output features, the
consumer along its input features, biases as their weights) what passes between them stays split over the tensor
axis: each rank its heads, its share of the MLP's hidden width. A rule that moves any member off that split breaks
the pair, and `run` (`runtime.parallel.tensor_parallel._pair`) makes every member take whole tensors and return
whole ones: a split producer's output is all-gathered, a consumer split along its input features reads its chunk
of the whole input, a whole member computes everything on every rank.

Stage: IR. Contract: pure functions of a layer's parameters: `block_pairs(layer)` (memoised per block template),
`broken(layer)`, `mtp_blocks(model, head)` (multi-token prediction's blocks as the rules place them),
`pair_projections(model, pair)` (a broken attention's GEMMs), `table_split(layer)` (how an embedding's or head's table
is split).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from plandsl import ir
from plandsl.ir.layers import (
    TENSOR_SHARDED_DIMS,
    BlockParams,
    Layer,
    Param,
    attention_widths,
    layers_of,
)

PAIRS = {"attn": (("wq", "wk", "wv", "wq_b", "wkv_b"), "wo"), "mlp": (("w1", "w3"), "w2"),
         "shared": (("w1", "w3"), "w2")}
"""Megatron's pairs in a block (group -> (producers, consumer)): an MoE layer's shared experts (`moe.shared`) are one
MLP; its routed experts are expert parallelism's. Multi-head latent attention's producers are its up-projections
(wq_b or wq, wkv_b); its down-projections wq_a and wkv_a stay whole on every rank (Megatron-Core's `duplicated`)."""


@dataclass(frozen=True, slots=True)
class PairLayout:
    """One pair of a block as `run` lays it out: `producers`, each producer's name and the dim of its weight split
    over the tensor axis (None: whole on every rank); `consumer`, the consumer's; `intact`, Megatron's split."""

    group: str
    producers: tuple[tuple[str, int | None], ...]
    consumer: int | None
    intact: bool

    @property
    def consumer_chunks(self) -> bool:
        """A broken pair whose consumer is split along its input features: it reads (and saves) its chunk of the
        whole input the producers made, and leaves partial sums."""
        return not self.intact and self.consumer == 1


def _split_dim(dims: tuple[str, ...]) -> int | None:
    return next((index for index, role in enumerate(dims) if role in TENSOR_SHARDED_DIMS), None)


def _group_of(module: str) -> tuple[str, str] | None:
    """(pair group, member) of a block's module name (`layers.3.attn.wq`, `layers.3.moe.shared.w1`), else None."""
    parts = module.split(".")
    if len(parts) < 2 or parts[-2] not in PAIRS:
        return None
    producers, consumer = PAIRS[parts[-2]]
    return (parts[-2], parts[-1]) if parts[-1] in producers or parts[-1] == consumer else None


def _pairs(template: tuple[tuple[str, str, tuple[int, ...], tuple[str, ...]], ...]) -> dict[str, PairLayout]:
    members: dict[str, dict[str, dict[str, int | None]]] = {}
    for name, module, _, dims in template:
        found = _group_of(module)
        if found is not None:
            members.setdefault(found[0], {}).setdefault(found[1], {})[name.rsplit(".", 1)[-1]] = _split_dim(dims)
    out = {}
    for group, present in members.items():
        producers, consumer = PAIRS[group]
        if consumer not in present:
            continue
        # Megatron's split: a producer's weight and bias along dim 0, the consumer's weight along dim 1, its bias whole
        intact = all(dim == (0 if name != consumer else 1 if leaf == "weight" else None)
                     for name, leaves in present.items() for leaf, dim in leaves.items())
        out[group] = PairLayout(group, tuple((name, present[name].get("weight")) for name in producers
                                             if name in present), present[consumer].get("weight"), intact)
    return out


_MEMO: dict[int, tuple[tuple, dict[str, PairLayout]]] = {}


def block_pairs(layer: Layer) -> dict[str, PairLayout]:
    """The pairs of a built-in transformer block (`layer.kind == "block"`), by group (`attn`, `mlp`, `shared`), as
    its parameters' roles place them; empty for any other layer. Memoised per block template (`BlockParams`)."""
    if layer.kind != "block":
        return {}
    params = layer.params
    if type(params) is BlockParams:
        found = _MEMO.get(id(params.template))
        if found is None or found[0] is not params.template:
            found = _MEMO[id(params.template)] = (params.template, _pairs(params.template))
        return found[1]
    return _pairs(tuple((p.name, p.module, p.shape, p.dims) for p in params))


def broken(layer: Layer) -> dict[str, PairLayout]:
    """The pairs of `layer` a shard rule breaks (`block_pairs`, not intact)."""
    return {group: pair for group, pair in block_pairs(layer).items() if not pair.intact}


def mtp_blocks(model: ir.TransformerModel, head: Layer) -> tuple[tuple[Layer, int], ...]:
    """The blocks of the multi-token prediction depths `head` carries (`ir.layers.mtp_params`: `mtp.N.block.*`), as
    (layer, how many depths) pairs: each depth whose pair a shard rule breaks (`run` lays out `mtp.N.block` as it does
    a block, `runtime.parallel.tensor_parallel._block_tp`) as a block of the last block's kind named as that block,
    its parameters placed as the rules place the depth's, so `broken` reads them; the depths alike together; the
    others the model's last block itself (`layers_of(model)[model.layers]`)."""
    found = _MTP_MEMO.get(id(head.params))
    if found is not None and found[0] is head.params and found[1] is model:
        return found[2]
    if len(_MTP_MEMO) > 256:
        _MTP_MEMO.clear()
    last = layers_of(model)[model.layers]
    cut = len(last.name) + 1
    groups: dict[object, tuple[Layer, int]] = {}
    for depth in range(model.mtp):
        prefix = f"mtp.{depth}.block."
        params = tuple(Param(last.name + "." + p.name[len(prefix):], last.name + "." + p.module[len(prefix):],
                             p.shape, p.dims) for p in head.params if p.name.startswith(prefix))
        block = replace(last, params=params)
        key = tuple((p.name[cut:], p.shape, p.dims) for p in params) if params and broken(block) else None
        found = groups.get(key)
        groups[key] = (found[0] if found else block if key is not None else last, (found[1] if found else 0) + 1)
    out = tuple(groups.values())
    _MTP_MEMO[id(head.params)] = (head.params, model, out)
    return out


_MTP_MEMO: dict[int, tuple[object, ir.TransformerModel, tuple[tuple[Layer, int], ...]]] = {}


def _placement(dim: int | None) -> str:
    """How a member's GEMM is split over the tensor axis (`attention_projections`' words): along its output features
    ("out"), its input features ("in"), or whole on every rank, on the whole (gathered) input ("all")."""
    return "out" if dim == 0 else "in" if dim == 1 else "all"


def pair_projections(model: ir.TransformerModel, pair: PairLayout) -> tuple[tuple[int, int, str], ...]:
    """A block's attention GEMMs as `ir.layers.attention_projections` says them, for an attention pair a rule breaks:
    each member a GEMM of its own, split as its weight is (`_placement`; "" for MLA's down-projections, whole on the
    sequence shard as ever), in the order they run."""
    widths = attention_widths(model)
    split = dict(pair.producers)
    hidden = model.hidden
    out = _placement(pair.consumer)
    if not model.latent_attention:
        return ((widths.q, hidden, _placement(split.get("wq"))), (widths.k, hidden, _placement(split.get("wk"))),
                (widths.v, hidden, _placement(split.get("wv"))), (hidden, widths.o, out))
    if model.q_lora_rank:
        queries = ((model.q_lora_rank, hidden, ""), (widths.q, model.q_lora_rank, _placement(split.get("wq_b"))))
    else:
        queries = ((widths.q, hidden, _placement(split.get("wq"))),)
    return queries + ((model.kv_lora_rank + model.qk_rope_head_dim, hidden, ""),
                      (widths.k - model.heads * model.qk_rope_head_dim + widths.v, model.kv_lora_rank,
                       _placement(split.get("wkv_b"))), (hidden, widths.o, out))


def table_split(layer: Layer) -> int | None:
    """The dim of a built-in embedding's or head's [vocab, hidden] table split over the tensor axis, as its parameters'
    roles place it: 0 the vocabulary (Megatron's, the default: the head's logits split, torch's loss parallel), 1 the
    hidden dim, None whole on every rank (`replicate`); 0 for a layer without a table of its own (a tied head)."""
    module = "embed.tok" if layer.kind == "embed" else "head"
    table = next((p for p in layer.params if p.module == module and len(p.shape) == 2), None)
    return 0 if table is None else _split_dim(table.dims)
