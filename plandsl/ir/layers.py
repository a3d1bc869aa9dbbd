"""The layer catalogue: an `ir.Model` as its top-level pipeline layers, with parameters and FLOPs.

Stage: after lowering; read by the checks, the cost model and the runtime interpreter. Contract:
`layers_of(model)` is pure and cached, and its names are exactly the names the interpreter gives
its torch modules (`embed.tok`, `layers.3.attn.wq`, `layers.3.moe.experts`, `norm`, `head`).
"""
from __future__ import annotations

import dataclasses
import functools
import weakref
import math
from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import TypeAdapter

from plandsl import ir

# Roles of tensor dims: what a dim indexes, so sharding and cost code never guess from positions.
HIDDEN = "hidden"
HEADS_X_HEAD_DIM = "heads_x_head_dim"
HEADS = "heads"  # one value per attention head (attention sinks)
KV = "kv"  # kv_heads * head_dim
FFN = "ffn"
VOCAB = "vocab"
EXPERTS = "experts"
INPUT = "input"
OUTPUT = "output"
OTHER = "other"
TP_SPLIT = "tp_split"  # a dim of a torch model's parameter that its tensor-parallel plan splits
DIM_ROLES = (HIDDEN, HEADS_X_HEAD_DIM, HEADS, KV, FFN, VOCAB, EXPERTS, INPUT, OUTPUT, OTHER, TP_SPLIT)
# The roles tensor parallelism splits: a parameter's first dim of one of them is split over the tensor axis (Megatron's
# default placements, a torch model's own plan: TP_SPLIT; a plan's shard rules move it, `ir.shard_rules.ruled_layers`)
TENSOR_SHARDED_DIMS = (HEADS_X_HEAD_DIM, HEADS, KV, FFN, VOCAB, TP_SPLIT)


@dataclass(frozen=True, slots=True)
class Param:
    """One parameter tensor, named as torch names it (`layers.3.attn.wq.weight`)."""

    name: str
    module: str
    shape: tuple[int, ...]
    dims: tuple[str, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class BlockParams(Sequence):
    """Block `index`'s parameters: one template, renamed `layers.{index}.` when first read.

    A 100,000-block model would otherwise build 1.3M `Param`s (5 s) that the search, which reads
    one block per kind, never looks at; a sequence of `Param`s like the tuple it stands for."""

    __slots__ = ("prefix", "template", "_params", "key")

    def __init__(self, prefix: str, template: tuple[tuple[str, str, tuple[int, ...], tuple[str, ...]], ...]):
        self.prefix, self.template, self._params = prefix, template, None
        self.key = ("block", id(template))  # `figures_key`: the blocks sharing a template have equal figures

    def _built(self) -> tuple[Param, ...]:
        if self._params is None:
            prefix = self.prefix
            self._params = tuple([Param(prefix + name, prefix + module, shape, dims)
                                  for name, module, shape, dims in self.template])
        return self._params

    def __getitem__(self, index):
        return self._built()[index]

    def __len__(self) -> int:
        return len(self.template)

    def __iter__(self):
        return iter(self._built())

    def __eq__(self, other) -> bool:
        if isinstance(other, BlockParams):
            return self.prefix == other.prefix and self.template == other.template
        return isinstance(other, tuple) and self._built() == other

    def __hash__(self) -> int:  # the tuple's: equal to it, so hashed as it is
        return hash(self._built())

    def __reduce__(self):
        return BlockParams, (self.prefix, self.template)

    def __repr__(self) -> str:
        return repr(self._built())


def figures_key(layer: "Layer") -> object:
    """Equal for layers whose parameter shapes and figures are equal, whatever their names: the
    blocks of one catalogue share its `BlockParams` template (`_transformer_layers` builds them with
    the same kind, shapes, FLOPs and width), so a walk over 100,000 blocks computes a block's
    figures once. Any other layer is its own. For keys within one walk, while the layers live."""
    params = layer.params
    return params.key if type(params) is BlockParams else id(layer)


def once_per_figures(seen: dict, layer: "Layer", figure):
    """`figure(layer)`, computed once per `figures_key` in `seen` (one dict per walk)."""
    key = figures_key(layer)
    found = seen.get(key)
    if found is None:
        found = seen[key] = figure(layer)
    return found


@dataclass(frozen=True, slots=True)
class Layer:
    """One top-level pipeline unit: the smallest thing a stage boundary can fall between."""

    name: str
    kind: str  # "embed" | "block" | "norm" | "head" | "custom"
    params: Sequence[Param]  # a tuple, or a block's `BlockParams`
    param_count: int
    flops_per_token: float  # forward, 2 FLOPs per multiply-add
    output_width: int  # elements per token handed to the next layer
    activation_bytes_per_token: float = 0.0  # authored figure of a custom layer (built-ins derive theirs)
    attention_flops_per_token: float = 0.0  # of a torch model's block's FLOPs, the attention core's (its table)


_BY_ID: dict[int, tuple[weakref.ref, tuple[Layer, ...]]] = {}


def layers_of(model: ir.Model) -> tuple[Layer, ...]:
    """The model's top-level layers in execution order."""
    # Memoised per model object (the IR is frozen), then on the JSON dump so that equal
    # models share one catalogue; the dump copes with unhashable fields (factory_args).
    found = _BY_ID.get(id(model))
    if found is not None and found[0]() is model:
        return found[1]
    layers = _catalogue(model.model_dump_json())
    _BY_ID[id(model)] = (weakref.ref(model, lambda _, key=id(model): _BY_ID.pop(key, None)), layers)
    return layers


def modules_of(model: ir.Model) -> tuple[str, ...]:
    """Every module that holds parameters, in execution order (a tied head holds none)."""
    return tuple(dict.fromkeys(p.module for layer in layers_of(model) for p in layer.params))


def param_count(model: ir.Model) -> int:
    """Total parameters; tied embeddings are counted once, in `embed`."""
    return sum(layer.param_count for layer in layers_of(model))


_MODEL = TypeAdapter(ir.Model)


@functools.lru_cache(maxsize=256)
def _catalogue(model_json: str) -> tuple[Layer, ...]:
    model = _MODEL.validate_json(model_json)
    if isinstance(model, ir.TransformerModel):
        return _transformer_layers(model)
    if isinstance(model, ir.MLPModel):
        return _mlp_layers(model)
    return _custom_layers(model)


def _layer(name: str, kind: str, params: list[Param], flops: float, output_width: int) -> Layer:
    return Layer(name, kind, tuple(params), sum(p.numel for p in params), float(flops), output_width)


def _linear(module: str, out_features: int, in_features: int, out_dim: str, in_dim: str,
            bias: bool) -> list[Param]:
    """torch.nn.Linear: weight [out_features, in_features], bias [out_features]."""
    params = [Param(f"{module}.weight", module, (out_features, in_features), (out_dim, in_dim))]
    if bias:
        params.append(Param(f"{module}.bias", module, (out_features,), (out_dim,)))
    return params


def _norm(module: str, hidden: int, bias: bool) -> list[Param]:
    """LayerNorm (weight and bias) for gpt, RMSNorm (weight only) for llama."""
    params = [Param(f"{module}.weight", module, (hidden,), (HIDDEN,))]
    if bias:
        params.append(Param(f"{module}.bias", module, (hidden,), (HIDDEN,)))
    return params


# ---- transformers ---------------------------------------------------------------------
def _transformer_layers(model: ir.TransformerModel) -> tuple[Layer, ...]:
    gpt = model.kind == "gpt"  # gpt: biases, LayerNorm, GELU MLP; llama: none, RMSNorm, SwiGLU
    hidden, vocab = model.hidden, model.vocab

    embed = [Param("embed.tok.weight", "embed.tok", (vocab, hidden), (VOCAB, HIDDEN))]
    if gpt:  # learned absolute positions; llama uses rotary embeddings, which hold no params
        embed.append(Param("embed.pos.weight", "embed.pos", (model.seq, hidden), (OTHER, HIDDEN)))
    layers = [_layer("embed", "embed", embed, 0, hidden)]

    # Blocks of one kind differ only in their names: one block's params, renamed per index when read
    # (`BlockParams`). Two kinds with `dense_layers` or `moe_every`: the dense blocks and the MoE ones.
    kinds = {}
    for index in range(model.layers):
        view = block_model(model, index)
        kind = kinds.get(id(view))
        if kind is None:
            first = _block_params(view, 0)
            cut = len("layers.0.")
            kind = kinds[id(view)] = (tuple((p.name[cut:], p.module[cut:], p.shape, p.dims) for p in first),
                                      sum(p.numel for p in first), float(transformer_block_flops(view)))
        shapes, count, flops = kind
        layers.append(Layer(f"layers.{index}", "block", BlockParams(f"layers.{index}.", shapes), count, flops, hidden))

    layers.append(_layer("norm", "norm", _norm("norm", hidden, bias=gpt), 0, hidden))
    head = [] if model.tied_embeddings else _linear("head", vocab, hidden, VOCAB, HIDDEN, bias=False)
    # Output projection: 2·h·V per token (Narayanan et al. 2021, eq. 3's 6·B·s·h·V over fwd+bwd).
    flops = 2 * hidden * vocab
    for depth in range(model.mtp):  # multi-token prediction: on the head's stage, after it (`mtp_params`)
        head += mtp_params(model, depth)
        flops += mtp_flops(model)
    layers.append(_layer("head", "head", head, flops, vocab))
    return tuple(layers)


def mtp_block(model: ir.TransformerModel) -> ir.TransformerModel:
    """The model as a multi-token prediction depth's block sees it: the kind of the last block (Megatron-Core builds
    it from the decoder's last layer spec, and counts it MoE when the last layer is: megatron/training/training.py:
    354-358 at core_v0.16.1, `last_layer_is_moe`)."""
    return block_model(model, model.layers - 1)


def mtp_params(model: ir.TransformerModel, depth: int) -> list[Param]:
    """Depth `depth` of multi-token prediction (DeepSeek-AI 2024, arXiv:2412.19437, Sec. 2.2; megatron-core 0.16.1
    `MultiTokenPredictionLayer.__init__`, multi_token_prediction.py:642-679): RMSNorms of the shifted tokens' embeddings
    (`enorm`) and of the previous depth's hidden states (`hnorm`), their concatenation projected 2h -> h (`eh_proj`,
    column-parallel, no bias), one block and the norm before the shared head (`norm`). The embedding and the output
    layer are the model's own, shared."""
    hidden, gpt = model.hidden, model.kind == "gpt"
    prefix = f"mtp.{depth}"
    params = _norm(f"{prefix}.enorm", hidden, bias=gpt) + _norm(f"{prefix}.hnorm", hidden, bias=gpt)
    params += _linear(f"{prefix}.eh_proj", hidden, 2 * hidden, HIDDEN, OTHER, bias=False)
    cut = len("layers.0")
    params += [Param(f"{prefix}.block{p.name[cut:]}", f"{prefix}.block{p.module[cut:]}", p.shape, p.dims)
               for p in _block_params(mtp_block(model), 0)]
    return params + _norm(f"{prefix}.norm", hidden, bias=gpt)


def mtp_flops(model: ir.TransformerModel) -> float:
    """Forward FLOPs per token of one multi-token prediction depth: the projection 2h -> h, its block and one more
    pass of the output layer, 2·h·V (the norms' and the loss's element-wise work is not counted, as for the head)."""
    hidden = model.hidden
    return 2.0 * 2 * hidden * hidden + transformer_block_flops(mtp_block(model)) + 2.0 * hidden * model.vocab


_DENSE_VIEWS: dict[int, tuple[weakref.ref, ir.TransformerModel]] = {}


def block_model(model: ir.Model, block: "int | Layer") -> ir.Model:
    """The model as block `block` (its index, or its layer) sees it: its MLP's (`mlp_model`) with the attention
    window the block has (`ir.TransformerModel.window_of`): a full-attention block of a sliding-window pattern
    (`full_every`) is the model without a window, a windowed one the model windowed throughout. The cost model
    and the catalogue size a block from this: one object per kind of block while the model lives."""
    view = mlp_model(model, block)
    if not isinstance(model, ir.TransformerModel) or not model.full_every or not model.window:
        return view
    if isinstance(block, Layer):
        if block.kind != "block":
            return view
        block = int(block.name.rpartition(".")[2])
    full = model.window_of(block) == 0
    key = (id(view), full)
    found = _WINDOW_VIEWS.get(key)
    if found is None or found[0]() is not view:
        update = {"window": 0, "full_every": 0} if full else {"full_every": 0}
        found = _WINDOW_VIEWS[key] = (weakref.ref(view, lambda _, key=key: _WINDOW_VIEWS.pop(key, None)),
                                      view.model_copy(update=update))
    return found[1]


_WINDOW_VIEWS: dict[tuple[int, bool], tuple[weakref.ref, ir.TransformerModel]] = {}


def mlp_model(model: ir.Model, block: "int | Layer") -> ir.Model:
    """The model as block `block` (its index, or its layer) sees its MLP: a dense block of a mixture of experts with
    dense blocks (`dense_layers`, `moe_every`: `ir.TransformerModel.moe_block`) is a dense llama block with
    `dense_ffn`, every other block the model itself. The cost model and the catalogue size a block from this, so
    a kind of block is computed once (the same object for every dense block of a model, while the model lives)."""
    if not isinstance(model, ir.TransformerModel) or not model.experts or not (model.dense_layers or model.moe_every > 1):
        return model
    if isinstance(block, Layer):
        if block.kind != "block":
            return model
        block = int(block.name.rpartition(".")[2])
    if model.moe_block(block):
        return model
    found = _DENSE_VIEWS.get(id(model))
    if found is not None and found[0]() is model:
        return found[1]
    view = model.model_copy(update={"experts": 0, "top_k": 0, "shared_experts": 0, "ffn_hidden": model.dense_ffn,
                                    "dense_layers": 0, "dense_ffn": 0, "moe_every": 1, "moe_offset": 0})
    _DENSE_VIEWS[id(model)] = (weakref.ref(model, lambda _, key=id(model): _DENSE_VIEWS.pop(key, None)), view)
    return view


def _block_params(model: ir.TransformerModel, index: int) -> list[Param]:
    gpt = model.kind == "gpt"
    hidden, ffn = model.hidden, model.ffn_hidden
    prefix = f"layers.{index}"
    params = _norm(f"{prefix}.norm1", hidden, bias=gpt)
    params += _attention_params(model, f"{prefix}.attn")
    params += _norm(f"{prefix}.norm2", hidden, bias=gpt)
    if model.experts:
        params += _moe_params(model, f"{prefix}.moe")
        return params
    params += _linear(f"{prefix}.mlp.w1", ffn, hidden, FFN, HIDDEN, bias=gpt)
    params += _linear(f"{prefix}.mlp.w2", hidden, ffn, HIDDEN, FFN, bias=gpt)
    if not gpt:  # SwiGLU: w2(silu(w1 x) * w3 x)
        params += _linear(f"{prefix}.mlp.w3", ffn, hidden, FFN, HIDDEN, bias=False)
    return params


def _moe_params(model: ir.TransformerModel, prefix: str) -> list[Param]:
    """Router plus grouped experts: one [experts, out, in] tensor per projection, no biases."""
    experts, hidden, ffn = model.experts, model.hidden, model.ffn_hidden
    module = f"{prefix}.experts"
    params = _linear(f"{prefix}.router", experts, hidden, EXPERTS, HIDDEN, bias=False)
    params.append(Param(f"{module}.w1", module, (experts, ffn, hidden), (EXPERTS, FFN, HIDDEN)))
    params.append(Param(f"{module}.w2", module, (experts, hidden, ffn), (EXPERTS, HIDDEN, FFN)))
    if model.kind == "llama":
        params.append(Param(f"{module}.w3", module, (experts, ffn, hidden), (EXPERTS, FFN, HIDDEN)))
    if model.shared_experts:  # one MLP of shared_experts x ffn, every token through it (DeepSeekMoE)
        width = model.shared_experts * ffn
        params += _linear(f"{prefix}.shared.w1", width, hidden, FFN, HIDDEN, bias=False)
        params += _linear(f"{prefix}.shared.w2", hidden, width, HIDDEN, FFN, bias=False)
        params += _linear(f"{prefix}.shared.w3", width, hidden, FFN, HIDDEN, bias=False)
    return params


def _attention_params(model: ir.TransformerModel, module: str) -> list[Param]:
    """wq, wk, wv, wo (grouped-query attention), or multi-head latent attention's projections (DeepSeek-AI
    2024, arXiv:2405.04434, Sec. 2.1): the queries from a normed latent (wq_a, q_norm, wq_b; wq without
    `q_lora_rank`), the keys' and values' latent with the shared rotary key part (wkv_a: kv_lora_rank + rope
    outputs), its norm, and their per-head up-projection (wkv_b: heads x (nope + v)); wo reads heads x v.
    The latents are replicated over a tensor-parallel axis, the up-projections split by heads (Megatron-Core's
    MLA: its down-projections are `duplicated`)."""
    gpt = model.kind == "gpt"
    hidden = model.hidden
    widths = attention_widths(model)
    # attention sinks (GPT-OSS): one learned logit per head, the attention module's own parameter
    sinks = [Param(f"{module}.sinks", module, (model.heads,), (HEADS,))] if model.sinks else []
    if not model.latent_attention:
        return (_linear(f"{module}.wq", widths.q, hidden, HEADS_X_HEAD_DIM, HIDDEN, bias=gpt)
                + _linear(f"{module}.wk", widths.k, hidden, KV, HIDDEN, bias=gpt)
                + _linear(f"{module}.wv", widths.v, hidden, KV, HIDDEN, bias=gpt)
                + _linear(f"{module}.wo", hidden, widths.o, HIDDEN, HEADS_X_HEAD_DIM, bias=gpt) + sinks)
    heads, rope = model.heads, model.qk_rope_head_dim
    if model.q_lora_rank:
        params = _linear(f"{module}.wq_a", model.q_lora_rank, hidden, OTHER, HIDDEN, bias=False)
        params.append(Param(f"{module}.q_norm.weight", f"{module}.q_norm", (model.q_lora_rank,), (OTHER,)))
        params += _linear(f"{module}.wq_b", widths.q, model.q_lora_rank, HEADS_X_HEAD_DIM, OTHER, bias=False)
    else:
        params = _linear(f"{module}.wq", widths.q, hidden, HEADS_X_HEAD_DIM, HIDDEN, bias=False)
    params += _linear(f"{module}.wkv_a", model.kv_lora_rank + rope, hidden, OTHER, HIDDEN, bias=False)
    params.append(Param(f"{module}.kv_norm.weight", f"{module}.kv_norm", (model.kv_lora_rank,), (OTHER,)))
    params += _linear(f"{module}.wkv_b", heads * (model.qk_nope_head_dim + model.v_head_dim), model.kv_lora_rank,
                      HEADS_X_HEAD_DIM, OTHER, bias=False)
    params += _linear(f"{module}.wo", hidden, widths.o, HIDDEN, HEADS_X_HEAD_DIM, bias=False)
    return params + sinks


@dataclass(frozen=True, slots=True)
class AttentionWidths:
    """Elements per token of one block's attention tensors, over all heads: the queries, keys and values the
    core reads (`q`, `k`, `v`), its output (`o`, what wo reads), and under MLA the latents (`latent`: the
    compressed queries, or the block input wq reads without them, plus the key/value latent and the shared
    rotary key, what a tensor-parallel rank gathers under sequence parallelism). `qk_head_dim` and
    `v_head_dim` are per head."""

    q: int
    k: int
    v: int
    o: int
    qk_head_dim: int
    v_head_dim: int
    latent: int = 0


def attention_widths(model: ir.TransformerModel) -> AttentionWidths:
    """Grouped-query attention: q = o = heads x head_dim, k = v = kv_heads x head_dim (head_dim hidden/heads unless
    written). MLA: q and k heads x (nope +
    rope), v and o heads x v_head_dim."""
    if not model.latent_attention:
        head_dim = model.head_width
        kv = model.kv_heads * head_dim
        return AttentionWidths(model.heads * head_dim, kv, kv, model.heads * head_dim, head_dim, head_dim)
    qk = model.qk_nope_head_dim + model.qk_rope_head_dim
    latent = (model.q_lora_rank or model.hidden) + model.kv_lora_rank + model.qk_rope_head_dim
    return AttentionWidths(model.heads * qk, model.heads * qk, model.heads * model.v_head_dim,
                           model.heads * model.v_head_dim, qk, model.v_head_dim, latent)


def attention_projections(model: ir.TransformerModel) -> tuple[tuple[int, int, str], ...]:
    """One block's attention GEMMs as (out features, in features, what a tensor-parallel axis splits: "out"
    for a column-parallel one, "in" for a row-parallel one, "" for a replicated one), in the order they run:
    the fused q/k/v and wo of grouped-query attention, MLA's down- and up-projections and wo."""
    widths = attention_widths(model)
    if not model.latent_attention:
        return ((widths.q + widths.k + widths.v, model.hidden, "out"), (model.hidden, widths.o, "in"))
    hidden = model.hidden
    if model.q_lora_rank:
        queries = ((model.q_lora_rank, hidden, ""), (widths.q, model.q_lora_rank, "out"))
    else:
        queries = ((widths.q, hidden, "out"),)
    return queries + ((model.kv_lora_rank + model.qk_rope_head_dim, hidden, ""),
                      (widths.k - model.heads * model.qk_rope_head_dim + widths.v, model.kv_lora_rank, "out"),
                      (hidden, widths.o, "in"))


def kv_width(model: ir.TransformerModel) -> int:
    """Output features of wk and wv: kv_heads · head_dim (GQA; = hidden for MHA); under MLA the mean of the
    keys' and values' widths, so that 2 x kv_width is what the attention core reads of both."""
    if model.latent_attention:
        widths = attention_widths(model)
        return (widths.k + widths.v) // 2
    return model.kv_heads * model.head_width


def transformer_block_flops(model: ir.TransformerModel) -> float:
    """Forward FLOPs per token of one block, each matmul counted from its shapes.

    Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters",
    Sec. 5.1) count 24·b·s·h² + 4·b·s²·h per layer per batch for GPT (MHA, ffn = 4h); per token
    that is 24·h² + 4·s·h, which these terms reproduce exactly for such a model.
    """
    hidden, seq = model.hidden, model.seq
    # q and o projections h·h each, k and v h·kv each (GQA shrinks kv); MLA's down- and up-projections;
    # 2 FLOPs per multiply-add.
    projections = 2 * sum(out * features for out, features, _ in attention_projections(model))
    # Q·Kᵀ and scores·V: 2·s·h each per token (Narayanan et al. 2021); full s², no causal halving. Under MLA
    # 2·s·heads·(nope + rope) and 2·s·heads·v.
    widths = attention_widths(model)
    attention = 2 * seq * (widths.q + widths.o)
    # gpt: two h×ffn matmuls (GELU MLP); llama SwiGLU: three (gate, up, down).
    matmuls = 2 if model.kind == "gpt" else 3
    mlp = 2 * matmuls * hidden * model.ffn_hidden
    if model.experts:
        # Router h·E, then each token runs through top_k experts (Fedus et al. 2021, Switch) and the
        # shared ones (DeepSeekMoE).
        mlp = 2 * hidden * model.experts + (model.top_k + model.shared_experts) * mlp
    return float(projections + attention + mlp)


# ---- other families -------------------------------------------------------------------
def _mlp_layers(model: ir.MLPModel) -> tuple[Layer, ...]:
    """Linear layers input -> hidden -> ... -> output, each with weight and bias."""
    widths = [model.input] + [model.hidden] * (model.layers - 1) + [model.output]
    layers = []
    for index in range(model.layers):
        in_features, out_features = widths[index], widths[index + 1]
        in_dim = INPUT if index == 0 else HIDDEN
        out_dim = OUTPUT if index == model.layers - 1 else HIDDEN
        params = _linear(f"layers.{index}", out_features, in_features, out_dim, in_dim, bias=True)
        # A Linear is one multiply-add per weight per token: 2·in·out FLOPs.
        layers.append(_layer(f"layers.{index}", "block", params, 2 * in_features * out_features,
                             out_features))
    return tuple(layers)


def _custom_layers(model: ir.CustomModel) -> tuple[Layer, ...]:
    """One layer per authored layer; its parameters as one synthetic flat tensor, or for a model from torch
    its real parameters by FQN, the dims its own tensor-parallel plan splits marked `TP_SPLIT`."""
    real = _torch_params(model) if model.source and model.parameters else None
    layers = []
    for authored in model.layers:
        if real is not None:
            params = real.get(authored.name, [])
            layer = Layer(authored.name, "custom", tuple(params), authored.params, float(authored.flops),
                          authored.output)
            layers.append(dataclasses.replace(layer, activation_bytes_per_token=authored.activations,
                                              attention_flops_per_token=authored.attention_flops))
            continue
        params = ([Param(f"{authored.name}.weight", authored.name, (authored.params,), (OTHER,))]
                  if authored.params else [])
        layer = _layer(authored.name, "custom", params, authored.flops, authored.output)
        layers.append(dataclasses.replace(layer, activation_bytes_per_token=authored.activations))
    return tuple(layers)


def _torch_params(model: ir.CustomModel) -> dict[str, list[Param]]:
    """Layer name -> its parameters (a tied one once, where it first appears), each dim the model's
    tensor-parallel plan splits as `TP_SPLIT` (`ir.torch_plan.split_dim`; the plan's first pattern wins), the
    leading dim of the grouped expert tensors its expert-parallel plan names as `EXPERTS`."""
    from plandsl.ir import torch_plan  # torch_plan imports ir: here, not at the top
    layer_of = torch_plan.layer_of_module(model)
    types = dict(model.modules)
    styles: dict[str, str] = {}
    modules = torch_plan.Names(types)  # indexed once: each pattern's matches without a scan of every module
    for pattern, style in model.tp_plan:
        for fqn in modules.matching(pattern):
            styles.setdefault(fqn, style)
    experts: set[str] = set()  # the parameters and modules the expert-parallel plan names
    if model.experts and model.ep_plan:
        params = torch_plan.Names(name for name, _ in model.parameters)
        for pattern, _ in model.ep_plan:
            experts.update(params.matching(pattern), modules.matching(pattern))
    found: dict[str, list[Param]] = {}
    for name, shape in model.parameters:
        module, _, local = name.rpartition(".")
        dims = [OTHER] * len(shape)
        style = styles.get(module)
        dim = torch_plan.split_dim(style, types.get(module, ""), local, len(shape)) if style else None
        if dim is not None:
            dims[dim] = TP_SPLIT
        if len(shape) == 3 and model.experts and shape[0] == model.experts and (name in experts or module in experts):
            dims[0] = EXPERTS  # grouped experts [experts, out, in], what the expert axis splits (its ep_plan)
        found.setdefault(layer_of.get(module, "embed"), []).append(Param(name, module, tuple(shape), tuple(dims)))
    return found
