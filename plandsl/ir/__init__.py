"""The authored plan as typed, frozen data: what `plandsl show --json` prints.

Produced by `plandsl.lower` from the syntax tree once imports and parameters are
applied. Units are SI base units (bytes, seconds, FLOP/s, bytes/s). Every node keeps
the span it came from, out of dumps and schema, so round trips compare `model_dump()`.
Local invariants live in validators here; anything needing the whole plan is a check.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from enum import Enum
from typing import Annotated, Any, ClassVar, Literal, NamedTuple, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator
from pydantic.json_schema import SkipJsonSchema

from plandsl.diagnostics.limits import MAX_MESH_DEVICES, MAX_NODES, MAX_SMS, MAX_STAGES  # noqa: F401 - bounds on the IR, in limits.py
from plandsl.diagnostics.source import Span

IR_VERSION = 1


class Node(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)
    span: SkipJsonSchema[Optional[Span]] = Field(default=None, exclude=True, repr=False)
    field_spans: SkipJsonSchema[dict[str, Span]] = Field(default_factory=dict, exclude=True, repr=False)

    def span_of(self, name: str) -> Optional[Span]:
        """Where field `name` was written, else where the node was."""
        return self.field_spans.get(name, self.span)



class OptionalKeys(Node):
    """A node whose `optional_keys` were added to the language after plans existed: each is left out of its dump
    while it holds its field's default, so that plans which do not write it dump (and hash: checkpoints name plans
    by it) as before the key existed."""
    optional_keys: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _without_unset_options(self, handler):
        data = handler(self)
        if isinstance(data, dict):
            for key in self.optional_keys:
                if getattr(self, key) == type(self).model_fields[key].default:
                    data.pop(key, None)
        return data


MX_BLOCK = 32
"""Elements that share one 8-bit (E8M0) scale in an MX format (OCP Microscaling Formats (MX) v1.0, 2023;
Transformer Engine's MXFP8BlockScaling): `mxfp8`'s block."""
NVFP4_BLOCK = 16
"""Elements that share one 8-bit (E4M3) scale in NVFP4 (FP4 E2M1 elements, and an FP32 scale per tensor:
Transformer Engine's NVFP4BlockScaling): `nvfp4`'s block."""


class Precision(str, Enum):
    """What the matmuls compute in (`train.precision`), and the dtypes training keeps (`master_dtype`, ...;
    not fp8 or mxfp8). `fp8` is Transformer Engine's recipe with per-tensor scales: the linear layers of the
    transformer blocks run their GEMMs in FP8 (e4m3 forward, e5m2 gradients), everything else in bf16
    (`unquantized`). `mxfp8` is its MXFP8BlockScaling recipe (Blackwell): the same layers in FP8 e4m3 with one
    8-bit scale per `MX_BLOCK` elements along each copy's rows or columns, at the device's `mxfp8` peak. `nvfp4`
    is its NVFP4BlockScaling recipe (Blackwell): the same layers in FP4 E2M1, an E4M3 scale per `NVFP4_BLOCK`
    elements and an FP32 one per tensor, at the device's `nvfp4` peak."""
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"
    fp8 = "fp8"
    mxfp8 = "mxfp8"
    nvfp4 = "nvfp4"

    @property
    def bytes(self) -> int:
        """Bytes of an element of the activations and of what moves between devices: 16-bit under fp8 and
        mxfp8 too (Transformer Engine keeps the tensors between its GEMMs, and the communication, in bf16)."""
        return 4 if self is Precision.fp32 else 2

    @property
    def quantized(self) -> bool:
        """Whether the blocks' linear layers run their GEMMs in FP8 or FP4 (fp8, mxfp8, nvfp4)."""
        return self in (Precision.fp8, Precision.mxfp8, Precision.nvfp4)

    @property
    def gemm_bytes(self) -> float:
        """Bytes of a GEMM's operand elements: 1 for fp8 (as `plandsl profile` measures `torch._scaled_mm`),
        1 + 1/32 for mxfp8 (each block of `MX_BLOCK` elements carries its 1-byte scale), 1/2 + 1/16 for nvfp4
        (4-bit elements, a 1-byte scale per `NVFP4_BLOCK`), 16- or 32-bit otherwise."""
        if self is Precision.mxfp8:
            return 1 + 1 / MX_BLOCK
        if self is Precision.nvfp4:
            return 0.5 + 1 / NVFP4_BLOCK
        return 1 if self is Precision.fp8 else self.bytes

    @property
    def mtp(self) -> "Precision":
        """The precision of multi-token prediction's depths under this one: megatron-core 0.16.1 runs each depth's
        projection and block under the global FP8 context only (`MultiTokenPredictionLayer.forward`,
        multi_token_prediction.py:772-781: "MTP only use global fp8 context", "currently ignoring FP4 in MTP
        layers"), so this precision, but bf16 under `nvfp4`."""
        return Precision.bf16 if self is Precision.nvfp4 else self

    @property
    def unquantized(self) -> "Precision":
        """The precision of the matmuls FP8 training leaves in 16 bits (the attention core, the embedding
        and the output layer: Megatron-LM's --fp8-format applies to the blocks' linear layers): bf16 for
        fp8, mxfp8 and nvfp4, the precision itself otherwise."""
        return Precision.bf16 if self.quantized else self


class Fp8Recipe(str, Enum):
    """How `precision: fp8` scales its tensors (`train.fp8_recipe`), as the stack that trains implements it;
    `cost.compute.FP8_RECIPE_BYTES` counts what each one's casts move. `delayed`: Transformer Engine's
    DelayedScaling (its and Megatron-LM's default; Megatron's `--fp8-recipe delayed`): one scale per tensor
    from the amax history of earlier steps, so each cast is one fused cast-transpose pass. `current`: Transformer
    Engine's Float8CurrentScaling (Megatron's `--fp8-recipe tensorwise`, Megatron-Bridge's FP8-CS): one scale per
    tensor from its own amax, computed by a pass of its own before the cast. `tensorwise`: torchao's Float8 with
    tensorwise dynamic scaling (torchtitan's `float8` converter): the same per-tensor scale from the tensor's own
    amax, the amaxes of activations and gradients fused by `torch.compile` into the kernel before, but the weights
    cast again in every forward. `blockwise`: Transformer Engine's Float8BlockScaling (Megatron's `--fp8-recipe
    blockwise`; DeepSeek-V3's recipe): an FP32 scale per 1 x `FP8_BLOCK` tile of the activations and gradients
    (per `FP8_BLOCK` x `FP8_BLOCK` block of the weights), found by the cast itself. TE's recipes cast the weights
    once a step (cached across the microbatches)."""
    delayed = "delayed"
    current = "current"
    tensorwise = "tensorwise"
    blockwise = "blockwise"

    @property
    def saved_bytes(self) -> float:
        """Bytes per element of the input an FP8 linear layer saves for its weight gradient: 1, and under
        `blockwise` the FP32 scale of its 1 x `FP8_BLOCK` tile too (Transformer Engine saves the column-wise copy)."""
        return 1 + 4 / FP8_BLOCK if self is Fp8Recipe.blockwise else 1.0


FP8_BLOCK = 128
"""Elements per scaling tile of `fp8_recipe: blockwise` (1 x 128 for activations and gradients, 128 x 128 for the
weights: DeepSeek-V3, arXiv:2412.19437, Sec. 3.3.2; Transformer Engine's Float8BlockScaling), each with an FP32 scale."""


KEPT_DTYPES = (Precision.fp32, Precision.bf16, Precision.fp16)
"""The dtypes `master_dtype`, `grad_dtype` and `optimizer_dtype` take (no FP8 or FP4 weights, gradients or states)."""
GATHER_DTYPES = (*KEPT_DTYPES, Precision.fp8)
"""The dtypes data parallelism gathers parameters in (`data = ... with gather = ...`): fp8 the quantized layers' weights."""
KEPT_DTYPE_KEYS = ("master_dtype", "grad_dtype", "optimizer_dtype")
"""The train keys of the dtypes training keeps (weights, gradients, optimizer states), fp32 by default."""


class Recompute(str, Enum):
    """Activation recomputation of transformer blocks: `selective` reruns the attention core
    (Korthikanti et al. 2022); `selective_op` keeps every other matmul's output and the attention
    core's and reruns the rest (torchtitan's op-level selective checkpointing); `full` keeps only
    each block's input."""
    none = "none"
    selective = "selective"
    selective_op = "selective_op"
    full = "full"


class RecomputeModule(str, Enum):
    """What `recompute: selective` reruns of each block (`recompute_modules`), Megatron-Core's
    `--recompute-modules` (megatron-core 0.16.1, `TransformerConfig.recompute_modules`): `core_attn` the attention
    core (the default); `layernorm` the norms before attention and MLP that Transformer Engine does not fuse into the
    next linear layer, their outputs dropped; `moe_act` the routed experts' activation, its output (fc2's input)
    dropped; `mla_up_proj` MLA's up-projections and rotary parts, Q, K and V dropped; `mlp` a dense block's MLP; `moe`
    a block's whole mixture of experts, its dispatch included; `shared_experts` the shared experts."""
    core_attn = "core_attn"
    moe_act = "moe_act"
    layernorm = "layernorm"
    mla_up_proj = "mla_up_proj"
    mlp = "mlp"
    moe = "moe"
    shared_experts = "shared_experts"


class Kernels(str, Enum):
    """How the implementation runs what is no GEMM (norms, rotary embeddings, the activation, the loss):
    `fused` as Transformer Engine, Megatron-Core's fused kernels or `torch.compile` do, each fused op reading
    its inputs and writing its output once; `eager` as PyTorch eager mode runs a Llama block (Hugging Face
    transformers, torchtitan without `compile`), one kernel per op: RMSNorm upcast to fp32 in five passes,
    rotary embeddings as multiply, negate, concatenate and add, silu and the gate's product apart, the loss
    over an fp32 copy of the logits. `cost.compute` prices the bytes each moves (docs/cost-model.md)."""
    fused = "fused"
    eager = "eager"


class Attention(str, Enum):
    """How the implementation runs the attention core: `flash` as one fused kernel that never writes the
    s x s scores to memory (Dao et al. 2022: FlashAttention, PyTorch's SDPA, cuDNN and Transformer Engine's
    fused attention); `materialized` as Megatron-LM did before it (2019-2022) and Hugging Face's `eager`
    attention do: the scores written by one batched GEMM, a softmax kernel, gpt's attention dropout, then
    the second batched GEMM reading the probabilities, each s x s matrix through memory, and the softmax's
    output (and gpt's dropout mask and output) kept for the backward (Korthikanti et al. 2022's 5as/h)."""
    flash = "flash"
    materialized = "materialized"


class Loss(str, Enum):
    """How the implementation computes the cross entropy over the vocabulary: `standard` as `torch.nn.functional
    .cross_entropy` under autocast does, over an fp32 copy of the logits whose log-probabilities it keeps for the
    backward, which makes two more fp32 tensors of the logits' shape (Korthikanti et al. 2022, Sec. 4.3); `fused` as
    one kernel over the 16-bit logits that keeps only them and a log-sum-exp per token and writes their gradient in
    place (flash-attn's `CrossEntropyLoss(inplace_backward=True)`, llm-foundry's default `fused_crossentropy`, Liger's
    cross entropy, Transformer Engine's `parallel_cross_entropy`: Megatron's `--cross-entropy-fusion-impl te`).
    `megatron` is Megatron-Core's vocabulary-parallel cross entropy as Megatron-LM's default flags run it (no
    `--cross-entropy-loss-fusion`; with it, the native impl jit-fuses the same steps: the same memory in fewer passes,
    for which the language has no word), op by op beside fused blocks: `.float()`, then max, subtract, exp, sum and divide, each a pass over the fp32 copy, and
    backward a multiply in place and the cast back (`cost.compute.MEGATRON_LOSS_BYTES`); it keeps what standard keeps
    (4 bytes per logit), but its backward works in place and adds only the 16-bit gradient of the logits.
    `cost.memory` and `cost.compute` count each one's bytes; `plandsl run` computes the same loss either way."""
    standard = "standard"
    fused = "fused"
    megatron = "megatron"


class Optimizer(str, Enum):
    adam = "adam"
    sgd = "sgd"


# ---- hardware -------------------------------------------------------------------------
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "p2p")
"""The collectives the cost model prices (`cost.comm`), by the names a link's `measured` table uses."""


class CommPoint(Node):
    """One measured collective (`plandsl profile`): over `ranks` ranks, `bytes` as `cost.comm` counts them
    (the all-reduced buffer, the gathered output, ...) took `seconds`."""
    ranks: int = Field(gt=1)
    bytes: float = Field(gt=0)
    seconds: float = Field(gt=0)


class Link(Node):
    bandwidth: float = Field(gt=0, description="bytes/s, each direction")
    latency: float = Field(ge=0, description="seconds")
    measured: dict[Literal["all_reduce", "reduce_scatter", "all_gather", "all_to_all", "p2p"], tuple[CommPoint, ...]] = \
        Field(default_factory=dict, description="measured collectives per name (COLLECTIVES); the cost model scales "
                                                "its alpha-beta time by the measured ratio, interpolated in the bytes")


DEFAULT_RESERVE = 0.08
"""The fraction of a device's memory no plan's tensors may use when its description gives no `reserve`: the
caching allocator's slack, the CUDA context and library workspaces, the communication buffers. 8 %: torchtitan's
published H100 run reserves 4.2 % above the tensors the model counts, the context and NCCL's buffers come on top,
and one H200 measured here left 3.2 of 31.9 GiB to what the model does not count (docs/cost-model.md, "Reserve")."""


NCCL_CHANNELS = 24
"""NCCL's channels on an NVLink node, one thread block (one SM) each for a collective's length: on a DGX H100 it builds
24 (`src/graph/search.cc`: 6 rings of 60 GB/s fill NVLink 4's 18 x 20.6 GB/s, `ncclTopoDupChannels` doubles them and
`ncclTopoPostset` doubles them again)."""
DEFAULT_COMM_SHARE = NCCL_CHANNELS / 132
"""The fraction of a device's compute a collective running beside it takes when the device's description gives
neither `comm_share` nor `sms`: NCCL's channels over the H100's 132 SMs, 0.18, where Lee et al. 2025
(arXiv:2507.03114) measure GEMMs 18.9 % slower on average beside NCCL collectives on A100s and H100s
(docs/cost-model.md, "Compute beside a collective")."""


def sm_share(sms_taken: int, sms: int) -> float:
    """The fraction of a device's `sms` SMs that a kernel holding `sms_taken` of them takes: at most half of them (a
    GPU with 48 SMs or fewer is no NVSwitch node's, and NCCL builds fewer channels on the links such GPUs have)."""
    return min(sms_taken, sms / 2) / sms


class GemmPoint(Node):
    """One measured GEMM of a device (`plandsl profile`): m x k by k x n took `seconds`."""
    m: int = Field(gt=0)
    n: int = Field(gt=0)
    k: int = Field(gt=0)
    seconds: float = Field(gt=0)


class AttentionPoint(Node):
    """The fused attention kernel's speed at one sequence length (`attention_by_sequence`), as a ratio to the
    device's `attention` and `attention_backward` figures."""
    tokens: int = Field(gt=0)
    ratio: float = Field(gt=0)


class DeviceEfficiency(OptionalKeys):
    """The GEMM model's two knobs (`cost.compute`): a GEMM takes 2mnk / (matmul · peak) +
    bytes / bandwidth + kernel_latency. The defaults are the fit on Megatron-LM's A100 runs
    (docs/validation.md). `measured` GEMM times, when given, correct that curve: the cost model
    interpolates the ratio of measured to modelled time between them (`cost.compute`). `precisions`
    holds knobs for one precision (written `bf16: { ... }` inside the device's `efficiency`), which
    hold no `precisions` of their own; a precision not listed takes these."""
    optional_keys = ("attention_by_sequence",)  # a device without it dumps as before it existed
    matmul: float = Field(default=0.64, gt=0, le=1, description="fraction of the peak a large GEMM's FLOPs run at")
    kernel_latency: float = Field(default=18e-6, ge=0, description="seconds per GEMM kernel")
    attention: Optional[float] = Field(
        default=None, gt=0, le=1, description="fraction of the peak the fused attention kernel's forward runs its "
                                              "executed FLOPs at (a causal mask's skipped blocks are not executed); "
                                              "None: the attention core is priced as a GEMM at `matmul`")
    attention_backward: Optional[float] = Field(
        default=None, gt=0, le=1, description="the same for its backward, which executes 2.5 times the forward's "
                                              "FLOPs (it recomputes the scores); None: `attention`")
    attention_by_sequence: tuple[AttentionPoint, ...] = Field(
        default=(), description="the attention kernel's speed by sequence length, as ratios to `attention` and "
                                "`attention_backward`, sorted by tokens: the cost model interpolates them in the "
                                "logarithm of the sequence and holds the ends beyond them; (): the figures at any length")
    measured: tuple[GemmPoint, ...] = Field(default=(), description="measured GEMMs the cost model interpolates")
    precisions: dict[Precision, "DeviceEfficiency"] = Field(
        default_factory=dict, description="knobs of one precision, which take the place of these for it")


DEFAULT_HOST_BANDWIDTH = 25e9
"""Bytes/s each way between a device and its host's memory when the device's description gives no `host_bandwidth`:
a PCIe Gen4 x16 slot's pinned-memory copies (32 GB/s raw per direction, about 25 GB/s of it reached by cudaMemcpy from
pinned memory), the oldest link of the stdlib's GPUs that offload; the stdlib's devices state their own."""


class DeviceType(OptionalKeys):
    optional_keys = ("sms", "host_bandwidth")  # a device without them dumps as before they existed
    name: str
    memory: float = Field(gt=0, description="bytes")
    bandwidth: float = Field(gt=0, description="memory bandwidth, bytes/s")
    peak: dict[Precision, float] = Field(description="peak dense FLOP/s per precision")
    efficiency: Optional[DeviceEfficiency] = Field(
        default=None, description="the GEMM model's knobs; None: the fitted defaults (DeviceEfficiency())")
    reserve: Optional[float] = Field(
        default=None, ge=0, description="bytes no plan's tensors may use (allocator, context, communication "
                                        "buffers); None: DEFAULT_RESERVE of `memory`")
    comm_share: Optional[float] = Field(
        default=None, ge=0, lt=1, description="fraction of the device's compute a collective in flight beside it "
                                              "takes (NCCL: its channels / the SMs); None: NCCL_CHANNELS over `sms`, "
                                              "else DEFAULT_COMM_SHARE")
    sms: Optional[int] = Field(default=None, gt=0, le=MAX_SMS, description="streaming multiprocessors (a GPU's SM "
                                                                         "count); None: not stated")
    host_bandwidth: Optional[float] = Field(
        default=None, gt=0, description="bytes/s each way between the device and its host's memory (PCIe, NVLink-C2C): "
                                        "what offloaded activations cross; None: DEFAULT_HOST_BANDWIDTH")

    @property
    def host_link(self) -> float:
        """Bytes/s each way to host memory: `host_bandwidth`, else DEFAULT_HOST_BANDWIDTH."""
        return self.host_bandwidth if self.host_bandwidth is not None else DEFAULT_HOST_BANDWIDTH

    @property
    def contention(self) -> float:
        """The share of its compute a collective running beside it takes (docs/cost-model.md): `comm_share` when
        stated, else NCCL's channels over the device's `sms`, else the H100's (DEFAULT_COMM_SHARE)."""
        if self.comm_share is not None:
            return self.comm_share
        return sm_share(NCCL_CHANNELS, self.sms) if self.sms is not None else DEFAULT_COMM_SHARE

    @property
    def usable_memory(self) -> float:
        """The bytes a plan's tensors may take: `memory` less the reserve (docs/cost-model.md, "Reserve")."""
        return self.memory - (self.reserve if self.reserve is not None else DEFAULT_RESERVE * self.memory)


class NodeType(OptionalKeys):
    optional_keys = ("hosts", "host_memory")  # a node on one machine, of unstated host memory, dumps as before
    name: str
    device: DeviceType
    devices: int = Field(gt=0, le=1024, description="devices per node")
    link: Link = Field(description="intra-node link, per device")
    nic: Optional[Link] = Field(default=None, description="inter-node injection, per node")
    hosts: int = Field(default=1, gt=0, le=1024, description="machines the node's devices sit on, an equal share "
                       "each (torchrun's nodes): a rack-scale NVLink domain (GB200 NVL72: 18 trays of 4 GPUs)")
    host_memory: Optional[float] = Field(default=None, gt=0, description="bytes of CPU memory on each of the node's "
                                         "machines (`hosts`), which activations offloaded to the host share; None: not "
                                         "stated (not checked)")

    @model_validator(mode="after")
    def _hosts_divide_devices(self) -> "NodeType":
        if self.devices % self.hosts:
            raise ValueError(f"hosts ({self.hosts}) must divide devices ({self.devices}): each machine of a node "
                             f"holds the same number of its devices")
        return self

    @property
    def host_devices(self) -> int:
        """Devices per machine: what one torchrun starts (`--nproc-per-node`)."""
        return self.devices // self.hosts



class NodeGroup(Node):
    node: NodeType
    count: int = Field(gt=0, le=MAX_NODES)


class Cluster(Node):
    name: str
    groups: tuple[NodeGroup, ...]
    fabric: Optional[Link] = Field(default=None, description="inter-node fabric, per node")

    @property
    def num_nodes(self) -> int:
        return sum(g.count for g in self.groups)

    @property
    def num_devices(self) -> int:
        return sum(g.count * g.node.devices for g in self.groups)

    @property
    def heterogeneous(self) -> bool:
        return len({g.node.device.name for g in self.groups}) > 1

    def devices_in_order(self) -> list[DeviceType]:
        """Device type of each global device index (node-major)."""
        return [g.node.device for g in self.groups for _ in range(g.count * g.node.devices)]


# ---- models ---------------------------------------------------------------------------
class TransformerModel(OptionalKeys):
    """A decoder-only transformer: `gpt(...)` (MHA, GELU MLP 4h) or `llama(...)` (GQA or multi-head latent
    attention, SwiGLU, a mixture of experts, optionally after `dense_layers` dense blocks or every `moe_every`-th
    block)."""
    optional_keys = ("head_dim", "moe_every", "moe_offset", "window", "full_every", "sinks", "mtp", "expert_groups",
                     "group_top_k")  # a model that writes none dumps as before they existed
    kind: Literal["gpt", "llama"]
    name: str
    layers: int = Field(gt=0, le=100_000)
    hidden: int = Field(gt=0)
    heads: int = Field(gt=0)
    kv_heads: int = Field(gt=0, description="key/value heads (GQA); = heads for MHA")
    ffn_hidden: int = Field(gt=0)
    seq: int = Field(gt=0, description="sequence length")
    vocab: int = Field(gt=0)
    experts: int = Field(default=0, ge=0, description="0 for a dense model")
    top_k: int = Field(default=0, ge=0)
    shared_experts: int = Field(default=0, ge=0, description="experts every token runs through besides its "
                                "top_k routed ones (DeepSeekMoE, Dai et al. 2024): one MLP of shared_experts x ffn")
    expert_groups: int = Field(default=0, ge=0, description="group-limited routing (DeepSeek-V2's device-limited, "
                               "DeepSeek-V3's node-limited; Megatron-Core's --moe-router-num-groups, Hugging Face's "
                               "n_group): the experts in this many equal groups of consecutive ones, each token's top_k "
                               "chosen inside the group_top_k groups whose best top_k // group_top_k logits sum highest; "
                               "0: no groups")
    group_top_k: int = Field(default=0, ge=0, description="with expert_groups: the groups each token's experts come "
                             "from (Megatron-Core's --moe-router-group-topk, Hugging Face's topk_group)")
    q_lora_rank: int = Field(default=0, ge=0, description="with multi-head latent attention: the rank of the "
                             "queries' compression, q = wq_b(norm(wq_a x)); 0: q = wq x (DeepSeek-V2-Lite)")
    kv_lora_rank: int = Field(default=0, ge=0, description="multi-head latent attention (MLA, DeepSeek-AI 2024, "
                              "arXiv:2405.04434): keys and values up-projected per head from one normed latent of "
                              "this width, k and v = wkv_b(norm(wkv_a x)), beside a rotary key part all heads share; "
                              "0: grouped-query attention")
    qk_rope_head_dim: int = Field(default=0, ge=0, description="with MLA: per head, the width of the query and key "
                                  "parts that carry rotary positions (the key's one for all heads)")
    qk_nope_head_dim: int = Field(default=0, ge=0, description="with MLA: per head, the width of the query and key "
                                  "parts without positions")
    v_head_dim: int = Field(default=0, ge=0, description="with MLA: per head, the width of a value (and of the "
                            "attention output wo reads)")
    head_dim: int = Field(default=0, ge=0, description="grouped-query attention: per head, the width of a query, "
                          "key and value (Qwen3, GPT-OSS: not hidden / heads); 0: hidden / heads")
    dense_layers: int = Field(default=0, ge=0, description="with experts: the first dense_layers blocks are dense "
                              "(a SwiGLU MLP of dense_ffn), the others mixture-of-experts layers (DeepSeek-V3's "
                              "first_k_dense_replace)")
    dense_ffn: int = Field(default=0, ge=0, description="the dense blocks' MLP width, with dense_layers or moe_every")
    moe_every: int = Field(default=1, ge=1, description="with experts: every moe_every-th block is a mixture of "
                           "experts, the others dense (a SwiGLU MLP of dense_ffn): Llama 4's interleave_moe_layer_step, "
                           "Qwen2-MoE's decoder_sparse_step, Megatron-LM's --moe-layer-freq N")
    moe_offset: int = Field(default=0, ge=0, description="with moe_every: the mixture-of-experts blocks are those whose "
                            "index i has i % moe_every == moe_offset (and i >= dense_layers); Hugging Face's "
                            "moe_every - 1, Megatron-LM's 0")
    tied_embeddings: bool = False
    parallel_blocks: bool = Field(default=False, description="GPT-NeoX's parallel residual: each block adds "
                                  "attn(norm1 x) and mlp(norm2 x) to the same input x (Black et al. 2022), "
                                  "instead of feeding the MLP x + attn(norm1 x)")
    window: int = Field(default=0, ge=0, description="sliding-window (banded causal) attention: a query attends to "
                        "itself and the window - 1 keys before it (Hugging Face's sliding_window; Megatron-LM's "
                        "--window-size window-1,0); 0: the whole causal sequence")
    full_every: int = Field(default=0, ge=0, description="with window: every full_every-th block (index i with i % "
                            "full_every == full_every - 1) attends the whole causal sequence, the others the window "
                            "(Gemma 2 and GPT-OSS 2, Gemma 3 6; Megatron-LM's --window-attn-skip-freq); 0: every "
                            "block windowed (Mistral)")
    sinks: bool = Field(default=False, description="a learned logit per head joins each query's softmax denominator "
                        "and takes no value (GPT-OSS's attention sinks; Megatron-Core's softmax_type learnable)")
    mtp: int = Field(default=0, ge=0, description="multi-token prediction depths (DeepSeek-AI 2024, arXiv:2412.19437, "
                     "Sec. 2.2; Megatron-LM's --mtp-num-layers): depth k norms the previous depth's hidden states and "
                     "the embeddings of the tokens k ahead, projects the two (2h -> h), runs one more block of the "
                     "last block's kind and the shared output head, a cross entropy on the tokens k + 1 ahead; "
                     "held by the head's stage (`ir.layers`: the head layer's parameters and FLOPs); 0: none")

    @property
    def head_width(self) -> int:
        """Grouped-query attention's width per head: `head_dim`, or hidden / heads when it is not given."""
        return self.head_dim or self.hidden // self.heads

    @property
    def latent_attention(self) -> bool:
        """Whether attention is multi-head latent attention (MLA): `kv_lora_rank` set."""
        return self.kv_lora_rank > 0

    def moe_block(self, index: int) -> bool:
        """Whether block `index` is a mixture of experts: with experts, past the first `dense_layers` blocks, at
        `moe_offset` of every `moe_every` blocks (Megatron-Core's per-layer pattern, `--moe-layer-freq`)."""
        return self.experts > 0 and index >= self.dense_layers and index % self.moe_every == self.moe_offset

    @property
    def mixed_blocks(self) -> bool:
        """Whether a mixture of experts has dense blocks too (`dense_layers`, `moe_every`): two kinds of block."""
        return self.experts > 0 and any(not self.moe_block(i)
                                        for i in range(min(self.layers, self.dense_layers + self.moe_every)))

    def window_of(self, index: int) -> int:
        """The attention window of block `index`: `window`, or 0 (the whole causal sequence) without one or on a
        full-attention block of the pattern (`full_every`; Megatron-Core's `is_layer_window_attention`)."""
        if not self.window or (self.full_every and index % self.full_every == self.full_every - 1):
            return 0
        return self.window


class MLPModel(Node):
    kind: Literal["mlp"]
    name: str
    layers: int = Field(gt=0, le=100_000)
    hidden: int = Field(gt=0)
    input: int = Field(gt=0)
    output: int = Field(gt=0)


class CustomLayer(Node):
    name: str
    params: int = Field(ge=0, description="parameter count")
    flops: float = Field(ge=0, description="forward FLOPs per token")
    activations: float = Field(ge=0, description="bytes of activations kept for backward, per token")
    output: int = Field(ge=0, description="width of the output per token (elements), sent between stages")
    attention_flops: float = Field(default=0, ge=0, description="of `flops`, the part that grows with the "
                                   "sequence (attention scores and values), measured by `plandsl inspect`")


class CustomModel(OptionalKeys):
    optional_keys = ("stage_problem",)  # a model without it dumps as before it existed
    kind: Literal["custom"]
    name: str
    layers: tuple[CustomLayer, ...]
    seq: int = Field(default=1, gt=0)
    factory: Optional[str] = Field(default=None, description="'package.module:function' that builds the torch module")
    factory_args: dict[str, Union[int, float, str, bool]] = Field(default_factory=dict)
    source: Optional[str] = Field(default=None, description="a model written in torch: its source as `plandsl inspect` "
                                  "reads it (`hf(\"LlamaForCausalLM\", ...)`, `pkg.mod:fn(k=v)`); the module is run "
                                  "unchanged, its layers are the inspected table's")
    block_list: Optional[str] = Field(default=None, description="with `source`: the FQN of the module list holding "
                                      "the blocks (the layers between `embed` and `head`); None when the blocks are "
                                      "the children of several containers (a ResNet's layer1 .. layer4)")
    blocks: tuple[str, ...] = Field(default=(), description="with `source`: every block's FQN in forward order "
                                    "(`model.layers.0`, ...; `layer1.0` .. `layer4.1`): the layers between `embed` "
                                    "and `head`, where pipeline stages may be split")
    image: Optional[tuple[int, ...]] = Field(default=None, description="with `source` or a written model: the shape "
                                             "of one sample, [channels, *spatial], of a model that takes images "
                                             "(`input=image(...)`; seq is 1: its figures are per sample); None: token "
                                             "ids [batch, seq]")
    norm_values: int = Field(default=0, ge=0, description="with `source`: the fewest values per channel per sample "
                             "any of its BatchNorms normalises in training (1 for a ResNet's last stage at 32x32); "
                             "0: none. A microbatch must give each more than one")
    positions: Optional[int] = Field(default=None, gt=0, description="with `source`: the positions its learned "
                                     "position embedding holds (GPT-2's `n_positions`); None without one. A longer "
                                     "train seq is E224")
    stage_problem: Optional[str] = Field(default=None, description="with `source`: why the model's stages by its own "
                                         "convention would compute otherwise than the whole model (its table's, "
                                         "`plandsl inspect`'s), quoted by `run`'s refusal")
    stages_by: Optional[Literal["base_model_pp_plan", "trace"]] = Field(
        default=None, description="with `source`: how `plandsl run` splits the module into pipeline stages: by the "
        "model's own convention (transformers' `base_model_pp_plan`), by tracing its forward with torch's pipeline "
        "frontend (a factory's module that `plandsl inspect` traced), or not at all (None)")
    experts: int = Field(default=0, ge=0, description="with `source`: experts per MoE layer (0: dense), what an "
                         "expert axis splits (`experts = alltoall over AXIS`)")
    ep_plan: tuple[tuple[str, str], ...] = Field(default=(), description="with `source`: the model's own "
                                                 "expert-parallel plan as (FQN pattern, style), transformers' `ep_plan`")
    modules: tuple[tuple[str, str], ...] = Field(default=(), description="with `source`: every module of the tree "
                                                 "as (FQN, class name), in the tree's order (the root is \"\")")
    parameters: tuple[tuple[str, tuple[int, ...]], ...] = Field(
        default=(), description="with `source`: every parameter as (FQN, shape), in the tree's order; a tied one "
                                "once, under the first name of its tensor")
    tied: tuple[tuple[str, str], ...] = Field(default=(), description="with `source`: (parameter, the parameter "
                                              "it is the same tensor as), e.g. (lm_head.weight, transformer.wte.weight)")
    tp_plan: tuple[tuple[str, str], ...] = Field(
        default=(), description="with `source`: the model's own tensor-parallel plan as (FQN pattern, style), "
                                "`*` one name component, styles as Hugging Face writes them (`colwise`, `rowwise`, "
                                "`colwise_gather_output`, `embedding_rowwise`, `replicated_with_grad_allreduce`, "
                                "...): its `tp_plan` (the class's `_tp_plan` and the config's `base_model_tp_plan` "
                                "under their module's prefix), applied with `tensor = megatron over AXIS`")


Model = Annotated[Union[TransformerModel, MLPModel, CustomModel], Field(discriminator="kind")]


# ---- layout ---------------------------------------------------------------------------
class Axis(Node):
    name: str
    size: int = Field(gt=0)


class Mesh(Node):
    """Named axes, outermost first: the last axis varies fastest over device indices.

    The mesh covers devices `first_device .. first_device + size` of the cluster (node-major
    order); `part` is True when the plan chose that range (`over devices[0:16]`).
    """
    axes: tuple[Axis, ...]
    first_device: int = Field(default=0, ge=0, le=MAX_NODES * 1024)
    part: Optional[int] = Field(default=None, description="devices claimed by `over devices[a:b]` / `over nodes[a:b]`")

    @property
    def size(self) -> int:
        total = 1
        for axis in self.axes:
            total *= axis.size
        return total

    def axis(self, name: str) -> Axis | None:
        return next((a for a in self.axes if a.name == name), None)

    def degree(self, name: str | None) -> int:
        axis = self.axis(name) if name else None
        return axis.size if axis else 1


class Training(Node):
    global_batch: int = Field(gt=0, description="sequences per optimizer step")
    micro_batch: int = Field(default=1, gt=0, description="sequences per microbatch per data-parallel rank")
    seq: Optional[int] = Field(default=None, gt=0, description="sequence length; default: the model's")
    precision: Precision = Precision.bf16
    recompute: Recompute = Recompute.none
    recompute_layers: Optional[int] = Field(
        default=None, ge=0, description="with `recompute: full`, recompute only the first N blocks of each "
        "stage (virtual chunk) and keep the others' activations (Megatron's --recompute-method block "
        "--recompute-num-layers N); None: every block")
    recompute_modules: Optional[tuple[RecomputeModule, ...]] = Field(
        default=None, description="with `recompute: selective`, the parts of each block it reruns (Megatron's "
        "--recompute-modules); None: the attention core alone (core_attn)")
    offload_layers: int = Field(
        default=0, ge=0, description="keep the saved activations of the first N blocks of each stage (virtual chunk) "
        "in host memory between their forward and backward, copied out and back on a side stream (Megatron's "
        "--cpu-offloading-num-layers N, Transformer Engine's get_cpu_offload_context, torch's "
        "autograd.graph.save_on_cpu); 0: none")
    kernels: Kernels = Field(default=Kernels.fused, description="the implementation's element-wise kernels: "
                             "fused (Transformer Engine, torch.compile) or eager (PyTorch eager mode)")
    attention: Attention = Field(default=Attention.flash, description="the implementation's attention core: flash "
                                 "(fused, no s x s matrix in memory) or materialized (Megatron-LM before 2022)")
    loss: Loss = Field(default=Loss.standard, description="the implementation's cross entropy: standard (over an "
                       "fp32 copy of the logits), fused (one kernel over the 16-bit logits, gradient in place) or megatron "
                       "(Megatron-LM's vocab_parallel_cross_entropy, op by op: the fp32 softmax kept, the gradient "
                       "written over it)")
    fp8_recipe: Fp8Recipe | None = Field(
        default=None, description="with `precision: fp8`, how its tensors are scaled (`Fp8Recipe`): delayed, "
        "current, tensorwise or blockwise; None: delayed, Transformer Engine's default")
    bf16_first_layers: int = Field(
        default=0, ge=0, description="under an FP8 or FP4 precision, how many of the model's first transformer "
        "blocks keep their linear layers in bf16 (Megatron's --first-last-layers-bf16 "
        "--num-layers-at-start-in-bf16 N)")
    bf16_last_layers: int = Field(
        default=0, ge=0, description="the same for the model's last blocks (--num-layers-at-end-in-bf16 N)")
    optimizer: Optimizer = Optimizer.adam
    master_dtype: Precision = Field(
        default=Precision.fp32, description="the dtype the weights are kept and updated in (the optimizer's "
        "master copy; `precision` is what matmuls compute in): Megatron's --main-params-dtype")
    grad_dtype: Precision = Field(
        default=Precision.fp32, description="the dtype gradients are accumulated and reduced in: Megatron's "
        "--main-grads-dtype, DeepSpeed's and Apex's grad_sync_dtype")
    optimizer_dtype: Precision = Field(
        default=Precision.fp32, description="the dtype of the optimizer's states (Adam's m and v, SGD's "
        "momentum): Megatron's --exp-avg-dtype and --exp-avg-sq-dtype")
    param_dtype: Optional[Precision] = Field(
        default=None, description="the dtype the model's weights are kept in between steps, when narrower than "
        "master_dtype: the optimizer then keeps the master copy at master_dtype beside its states, sharded as "
        "they are (Megatron-LM's and DeepSpeed's 16-bit weights with an fp32 master, Micikevicius et al. 2018); "
        "None: master_dtype, the weights are the master copy")
    lr: float = Field(default=3e-4, gt=0)
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    warmup_steps: int = Field(default=0, ge=0)
    grad_clip: Optional[float] = Field(default=1.0, gt=0)
    seed: int = 0
    batch_shares: tuple[int, ...] | Literal["speed"] | None = Field(
        default=None, description="sequences of the global batch each data rank trains on per step, in data-rank "
        "order (the batch axes' coordinates, outermost first): written per rank, or `speed` (in proportion to each "
        "replica's device peaks, `ir.shares`); None: global_batch / dp each")

    @model_serializer(mode="wrap")
    def _without_new_defaults(self, handler):
        """A plan that sets no `batch_shares` and keeps the default `kernels`, `attention` and `loss` dumps (and hashes:
        checkpoints name plans by it) as before those keys existed."""
        data = handler(self)
        if isinstance(data, dict):
            if self.batch_shares is None:
                data.pop("batch_shares", None)
            if self.kernels is Kernels.fused:
                data.pop("kernels", None)
            if self.attention is Attention.flash:
                data.pop("attention", None)
            if self.loss is Loss.standard:
                data.pop("loss", None)
            if self.fp8_recipe is None:
                data.pop("fp8_recipe", None)
            if self.recompute_modules is None:
                data.pop("recompute_modules", None)
            for key in ("bf16_first_layers", "bf16_last_layers", "offload_layers"):
                if not getattr(self, key):
                    data.pop(key, None)
        return data

    @property
    def recipe(self) -> Fp8Recipe | None:
        """The FP8 scaling recipe `precision: fp8` runs (`fp8_recipe`, delayed when not given); None under any
        other precision."""
        if self.precision is not Precision.fp8:
            return None
        return self.fp8_recipe or Fp8Recipe.delayed

    def block_precision(self, index: int, blocks: int) -> Precision:
        """The precision of the linear layers of the model's `index`-th of `blocks` transformer blocks (from 0):
        bf16 for the first `bf16_first_layers` and the last `bf16_last_layers` under a quantized precision,
        `precision` otherwise."""
        if self.precision.quantized and (index < self.bf16_first_layers or index >= blocks - self.bf16_last_layers):
            return Precision.bf16
        return self.precision

    @property
    def mtp_precision(self) -> Precision:
        """The precision of multi-token prediction's depths (`mtp`): the global one's (`Precision.mtp`), whatever
        `bf16_first_layers`/`bf16_last_layers` keep."""
        return self.precision.mtp

    @property
    def weights_dtype(self) -> Precision:
        """The dtype the model's weights are kept in: `param_dtype`, or `master_dtype` when it is not given."""
        return self.param_dtype or self.master_dtype

    @property
    def master_copy(self) -> bool:
        """Whether the optimizer keeps a master copy of the weights apart from them (`param_dtype` narrower
        than `master_dtype`)."""
        return self.weights_dtype.bytes < self.master_dtype.bytes

    def given_dtypes(self) -> dict[str, Precision]:
        """The kept dtypes (`KEPT_DTYPE_KEYS`) set to other than their default, fp32, by key, and `param_dtype`
        when it is given."""
        given = {key: getattr(self, key) for key in KEPT_DTYPE_KEYS if getattr(self, key) is not Precision.fp32}
        return given | ({"param_dtype": self.param_dtype} if self.param_dtype is not None else {})

    def block_offloaded(self, index: int) -> bool:
        """Whether a stage's (virtual chunk's) `index`-th transformer block, from 0, keeps its saved activations in
        host memory (`offload_layers`)."""
        return index < self.offload_layers

    @property
    def modules(self) -> frozenset[RecomputeModule]:
        """What `recompute: selective` reruns of each block (`recompute_modules`, the attention core by default);
        empty under the other modes."""
        if self.recompute is not Recompute.selective:
            return frozenset()
        return frozenset(self.recompute_modules) if self.recompute_modules is not None \
            else frozenset((RecomputeModule.core_attn,))

    def block_recompute(self, index: int) -> Recompute:
        """The recomputation of a stage's (virtual chunk's) `index`-th transformer block, from 0."""
        if self.recompute_layers is None:
            return self.recompute
        return Recompute.full if index < self.recompute_layers else Recompute.none


class DataKind(str, Enum):
    """How data parallelism keeps parameters, gradients and optimizer states; the values are the
    surface syntax (`data = zero2 over dp`). The one home of the kind <-> ZeRO stage map (Rajbhandari
    et al. 2020): every stage, the search and the interpreter read `zero_stage`, `sharded`, `hybrid`
    and `of_zero_stage` rather than lists of names. Formatted as its value (`f"{kind}"` is `zero2`)."""
    replicate = "replicate"   # ZeRO-0: every state whole on every data rank (DDP)
    zero1 = "zero1"           # optimizer states sharded
    zero2 = "zero2"           # and gradients
    zero3 = "zero3"           # and parameters (FSDP)
    hsdp = "hsdp"             # ZeRO-3 over the last data axis, replicated over the others

    __str__ = str.__str__
    __format__ = str.__format__

    @property
    def zero_stage(self) -> int:
        """The ZeRO stage: 0 (replicate) to 3 (zero3, and hsdp within its shard axis)."""
        return _ZERO_STAGE[self]

    @property
    def sharded(self) -> bool:
        """Whether the interpreter shards the stored gradients (or parameters) with FSDP: ZeRO-2 and up."""
        return self.zero_stage >= 2

    @property
    def hybrid(self) -> bool:
        """Whether it shards over its last data axis only and replicates over the others (hsdp)."""
        return self is DataKind.hsdp

    @classmethod
    def of_zero_stage(cls, stage: int) -> "DataKind":
        """The kind over one data axis that runs ZeRO stage `stage` (0-3), as the search writes it."""
        return (cls.replicate, cls.zero1, cls.zero2, cls.zero3)[stage]


_ZERO_STAGE = {DataKind.replicate: 0, DataKind.zero1: 1, DataKind.zero2: 2, DataKind.zero3: 3, DataKind.hsdp: 3}
ZERO_STAGES = tuple(sorted(set(_ZERO_STAGE.values())))  # 0, 1, 2, 3
DATA_KIND_SPELLINGS: dict[str, DataKind] = {"ddp": DataKind.replicate, "fsdp": DataKind.zero3}
"""Other names the language accepts for a kind (PyTorch's): the IR holds the kind."""


class GatherUnit(str, Enum):
    """What ZeRO-2/3 gathers and reduces as one collective (`data = zero3 over dp with unit = module`); the values
    are the surface syntax. `block`: each transformer block (or written layer) and the stage's other layers as the
    root, as FSDP wraps a model (`fully_shard` per block, torchtitan); `module`: each module that owns parameters
    (a block's norms and linear layers one by one), as DeepSpeed's ZeRO-3 gathers a sub-module's parameters when it
    runs (`deepspeed.runtime.zero.stage3`, 2021)."""
    block = "block"
    module = "module"

    __str__ = str.__str__
    __format__ = str.__format__


class DataParallel(OptionalKeys):
    """How parameters, gradients and optimizer states are kept across the data axes."""
    optional_keys = ("unit", "prefetch", "prefetch_bucket", "gather")  # the gathering options
    kind: DataKind
    axes: tuple[str, ...]
    unit: GatherUnit = Field(default=GatherUnit.block, description="`with unit = ...`: what ZeRO-2/3 gathers and "
                             "reduces as one collective: FSDP's blocks (default) or each module with parameters "
                             "(DeepSpeed's ZeRO-3)")
    prefetch: int = Field(default=1, ge=0, description="`with prefetch = N`: the units whose parameters are gathered "
                          "ahead of the one computing (FSDP: 1)")
    prefetch_bucket: int | None = Field(default=None, gt=0, description="`with prefetch_bucket = N`: gather "
                                           "the following units ahead until N parameters (elements) are on their "
                                           "way, at least one unit (DeepSpeed's stage3_prefetch_bucket_size)")
    gather: Precision | None = Field(default=None, description="`with gather = ...`: the dtype ZeRO-1/2/3 all-gather "
                                     "the parameters in and ZeRO-3 holds the gathered units in: fp32, bf16, fp16 "
                                     "(FSDP2's MixedPrecisionPolicy param_dtype), or fp8, the quantized linear "
                                     "layers' weights in the plan's FP8 format and the rest 16-bit (torchao's "
                                     "enable_fsdp_float8_all_gather, Megatron's --fp8-param-gather); None: the time "
                                     "prices 16-bit gathers at the compute precision, the memory the weights' dtype")

    @property
    def gathering(self) -> "Gathering":
        """How its units are gathered (`Gathering`: FSDP's blocks, one ahead, unless the plan says otherwise)."""
        return Gathering(self.unit, self.prefetch, self.prefetch_bucket, self.gather)

    @property
    def zero_stage(self) -> int:
        return DataKind(self.kind).zero_stage

    @property
    def sharded(self) -> bool:
        return DataKind(self.kind).sharded

    @property
    def hybrid(self) -> bool:
        return DataKind(self.kind).hybrid


class Gathering(NamedTuple):
    """ZeRO-2/3's units and prefetch, and the dtype ZeRO-1/2/3 gather the parameters in, as the cost model reads them
    (`DataParallel.gathering`, the search's problem)."""
    unit: GatherUnit = GatherUnit.block
    prefetch: int = 1
    prefetch_bucket: int | None = None
    gather: "Precision | None" = None

    @property
    def default(self) -> bool:
        """FSDP's blocks, one unit ahead: what the cost model prices in closed form."""
        return self.unit is GatherUnit.block and self.prefetch == 1 and self.prefetch_bucket is None

    def ahead(self, sizes: Sequence[float], index: int) -> int:
        """How many units after unit `index` (of units of `sizes` parameters, in the order they run) are gathered
        while it runs: `prefetch`, or with `prefetch_bucket` the fewest following units (at least one) whose
        parameters reach it, as DeepSpeed's `get_params_to_prefetch` issues them (stage3.py, 0.3.13-0.5.x)."""
        if self.prefetch_bucket is None:
            return self.prefetch
        elements, count = 0.0, 0
        for size in sizes[index + 1:]:
            elements, count = elements + size, count + 1
            if elements >= self.prefetch_bucket:
                break
        return max(1, count)


FSDP_GATHERING = Gathering()


def gathering_text(gathering: Gathering, zero_stage: int) -> str:
    """` with unit = module, prefetch_bucket = 50000000`: the options a data clause of ZeRO stage `zero_stage` writes
    for `gathering` (the gather dtype from ZeRO-1, the unit from ZeRO-2, the prefetch from ZeRO-3, those at their
    defaults left out)."""
    options = []
    if zero_stage >= 2 and gathering.unit is not GatherUnit.block:
        options.append(f"unit = {gathering.unit}")
    if zero_stage >= 3 and gathering.prefetch != 1:
        options.append(f"prefetch = {gathering.prefetch}")
    if zero_stage >= 3 and gathering.prefetch_bucket is not None:
        options.append(f"prefetch_bucket = {gathering.prefetch_bucket}")
    if zero_stage >= 1 and gathering.gather is not None:
        options.append(f"gather = {gathering.gather.value}")
    return f" with {', '.join(options)}" if options else ""


def gathers_as_written(zero_stage: int, gather: Precision | None, train: Training) -> bool:
    """Whether data parallelism of ZeRO stage `zero_stage` gathers the parameters in `gather` as the stacks do (the
    checker's E515 refuses the rest, the search writes no other): ZeRO-2/3 in FSDP2's `MixedPrecisionPolicy`
    param_dtype, which is also the dtype the forward computes with, so fp32 or the compute precision (FP8 training's
    16-bit one, `unquantized`: torchtitan's `mixed_precision_param` beside Float8); ZeRO-1 the updated weights as
    they are kept (`weights_dtype`: torch's ZeroRedundancyOptimizer broadcasts them, Megatron-LM's distributed
    optimizer all-gathers its 16-bit parameter buffer). No `gather`, and `fp8` (E511's), always."""
    if gather is None or gather is Precision.fp8:
        return True
    if zero_stage >= 2:
        return gather in (Precision.fp32, train.precision.unquantized)
    return gather is train.weights_dtype


class TensorOverlap(str, Enum):
    """Which implementation overlaps the tensor-parallel collectives with their GEMMs (`overlap = ...`):
    `async_tp`, torch's async tensor parallelism (torchtitan's --compile.enable_async_tensor_parallel: chunks moved
    by the copy engines through symmetric memory, no SMs taken), what `overlap` alone means; `userbuffers`,
    Transformer Engine's userbuffers (Megatron-LM's --tp-comm-overlap, NeMo's tp_comm_overlap): ring exchanges on
    the copy engines for the all-gathers, and 16 SMs of its own for the pipelined reduce-scatters after wo and fc2
    and the backward's bulk overlaps (docs/cost-model.md, "Tensor parallel with `overlap`")."""
    async_tp = "async_tp"
    userbuffers = "userbuffers"


TENSOR_STACKS = ("torch", "megatron")
"""Whose tensor parallelism runs the layers (`tensor = ... with implementation = ...`; docs/cost-model.md)."""


def overlap_stack(overlap: TensorOverlap | None) -> str | None:
    """Whose tensor parallelism an overlap implementation is part of: torch's async TP torch's, Transformer Engine's
    userbuffers Megatron-LM's; None without an overlap."""
    return None if overlap is None else "megatron" if overlap is TensorOverlap.userbuffers else "torch"


class TensorParallel(Node):
    style: Literal["megatron"] = "megatron"
    axis: str
    sequence_parallel: bool = False
    overlap: bool = Field(default=False, description="`with overlap`: each tensor-parallel all-gather and "
                          "reduce-scatter is split into chunks that run behind the GEMM it feeds or follows "
                          "(torch's async TP, torchtitan's --compile.enable_async_tensor_parallel; Megatron-LM's "
                          "--tp-comm-overlap, Transformer Engine's userbuffers); needs sequence parallelism")
    implementation: TensorOverlap = Field(
        default=TensorOverlap.async_tp, description="`overlap = async_tp | userbuffers`: which stack overlaps "
        "(`overlap` alone: async_tp)")
    stack: Literal["torch", "megatron"] = Field(
        default="torch", description="`implementation = torch | megatron`: whose tensor parallelism runs the layers, "
        "which decides what a column-parallel linear saves for its weight gradient under sequence parallelism: torch's "
        "(DTensor's ColwiseParallel behind PrepareModuleInput, as torchtitan and `plandsl run` split a block) the "
        "gathered input, Megatron-LM's (and Transformer Engine's) its sequence shard, gathered again in the backward. "
        "Not written: megatron where `overlap = userbuffers` says Transformer Engine's, torch otherwise")
    sm_margin: bool = Field(default=True, description="`overlap = userbuffers, sm_margin = false`: Transformer "
                            "Engine's set_sm_margin of its pipelined and bulk overlaps (true from TE 2.0, false "
                            "before): their GEMMs run on the SMs the communication leaves for their whole length, "
                            "else on all of them, slowed only while the communication runs")

    @model_validator(mode="before")
    @classmethod
    def _stack_as_the_line_implies(cls, data):
        """A dump without `stack` (the serializer drops the implied one) reads back as the line implied it: Megatron-LM's
        under `overlap = userbuffers`, torch's otherwise."""
        if isinstance(data, dict) and "stack" not in data and data.get("overlap") and data.get("implementation"):
            data = {**data, "stack": overlap_stack(TensorOverlap(data["implementation"]))}
        return data

    @model_serializer(mode="wrap")
    def _without_unset_options(self, handler):
        """Tensor parallelism without `with overlap`, or with async TP's, dumps (and its plan hashes) as before the
        options existed."""
        data = handler(self)
        if isinstance(data, dict):
            if not self.overlap:
                data.pop("overlap", None)
            if not self.overlap or self.implementation is TensorOverlap.async_tp:
                data.pop("implementation", None)
            if self.sm_margin or not self.overlap or self.implementation is TensorOverlap.async_tp:
                data.pop("sm_margin", None)
            if self.stack == self.default_stack:
                data.pop("stack", None)
        return data

    @property
    def default_stack(self) -> str:
        """The stack a tensor line without `implementation` says: Transformer Engine's userbuffers are Megatron's
        (`overlap = userbuffers`), anything else torch's."""
        return overlap_stack(self.implementation if self.overlap else None) or "torch"

    @property
    def saves_gathered(self) -> bool:
        """Under sequence parallelism, whether each column-parallel linear saves the gathered (whole-sequence) input
        for its weight gradient, as torch's DTensor styles do, rather than its shard (Megatron-LM's
        `LinearWithGradAccumulationAndAsyncCommunication`, which gathers it again in the backward)."""
        return self.sequence_parallel and self.stack == "torch"

    @property
    def userbuffers(self) -> bool:
        """The collectives overlap as Transformer Engine's userbuffers runs them."""
        return self.overlap and self.implementation is TensorOverlap.userbuffers

    def options_text(self) -> str:
        """` with sequence_parallel, overlap = userbuffers, sm_margin = false, implementation = torch` and the
        like: the options that write this tensor parallelism back (nothing when it has none)."""
        options = ["sequence_parallel"] if self.sequence_parallel else []
        if self.overlap:
            options.append("overlap" if self.implementation is TensorOverlap.async_tp else "overlap = userbuffers")
            if self.userbuffers and not self.sm_margin:
                options.append("sm_margin = false")
        if self.stack != self.default_stack:
            options.append(f"implementation = {self.stack}")
        return " with " + ", ".join(options) if options else ""


RING_IMPLEMENTATIONS = ("te", "torch")
"""Whose ring attention `context = ring` runs (`with implementation = ...`; docs/cost-model.md, `cost.ring`)."""


class ContextParallel(OptionalKeys):
    optional_keys = ("implementation",)  # a ring without `with implementation`: as before the option
    kind: Literal["ring", "allgather"] = "allgather"
    axis: str
    implementation: Literal["te", "torch"] = Field(
        default="te", description="`ring ... with implementation = te | torch`: whose ring runs it: Transformer "
        "Engine's (`AttnFuncWithCPAndKVP2P`, Megatron-Core's p2p: K, V passed on at each step, fused per-step "
        "corrections, gradients accumulated in 16 bits), or torch's `context_parallel` as torchtitan runs it (K, V "
        "all-gathered once per pass, outputs merged and dQ, dK, dV accumulated in fp32, dK, dV passed on in fp32)")



class ExpertParallel(OptionalKeys):
    optional_keys = ("overlap", "fold")  # without `with overlap`, folding no axis: as before both existed
    kind: Literal["alltoall", "deepep", "hybridep"] = Field(
        default="alltoall", description="the dispatcher that moves the routed tokens: `alltoall` (Megatron-Core's "
        "alltoall dispatcher, NCCL's all-to-all: every routed copy to its expert's rank), `deepep` or `hybridep` "
        "(Megatron-Core's flex dispatcher on DeepEP's or HybridEP's kernels: a token crosses the network once per "
        "node that holds any of its experts, then NVLink carries it to each expert there)")
    axis: str
    overlap: bool = Field(default=False, description="`with overlap`: each microbatch's dispatch and combine "
                          "all-to-alls run behind another microbatch's computation, as Megatron-Core's "
                          "--overlap-moe-expert-parallel-comm merges one microbatch's forward with another's backward "
                          "(and DeepSeek-V3's DualPipe overlaps its chunks' all-to-alls)")
    fold: tuple[str, ...] = Field(default=(), description="`over [ep, tp]`: axes folded into the expert group "
                                  "besides `axis` (the tensor axis): each expert whole on one rank of the ep x tp "
                                  "ranks, Megatron-Core's MoE parallel folding (--expert-tensor-parallel-size 1, "
                                  "--expert-model-parallel-size ep x tp)")

    @property
    def axes(self) -> tuple[str, ...]:
        """The axes of the expert group: the expert axis, then those folded into it."""
        return (self.axis,) + self.fold


class SelectorPart(Node):
    kind: Literal["name", "range", "any"]
    name: Optional[str] = None
    lo: Optional[int] = None
    hi: Optional[int] = None


class Selector(Node):
    """A layer or module pattern: `embed`, `layers[0:8]`, `layers.*.mlp.w1`."""
    text: str
    parts: tuple[SelectorPart, ...]


class StageGroup(Node):
    """Stages `first..last+1` together hold the layers matched by `selectors`, split evenly."""
    stages: tuple[int, ...]
    selectors: tuple[Selector, ...]


PIPELINE_IMPLEMENTATIONS = ("torch", "megatron", "deepspeed", "dualpipe")
"""Whose pipeline runs the stages (`stages = ... with implementation = ...`; docs/cost-model.md, "torch's pipeline
stage")."""
PIPELINE_RUNTIMES = {"megatron": "Megatron-LM's pipeline", "deepspeed": "DeepSpeed's pipeline engine",
                     "dualpipe": "DualPipe's runtime"}
"""The pipelines other than torch's, by the name a message gives each (E610; each runs the schedules its
`ScheduleInfo` flag of the same name marks)."""
PIPELINE_OUTPUTS = ("dropped", "returned")
"""What torch's pipeline does with the last stage's outputs (`stages = ... with outputs = ...`): drop each after its
backward (`step(return_outputs=False)`, `plandsl run`'s) or keep every microbatch's to the step's end and return
their merge (`return_outputs=True`, torch's default; the torch of late 2024 always did)."""


PIPELINE_ACCOUNTED = ("embed", "loss")
"""What `stages = evenly ... with account = [...]` may count as a layer of the split beside the blocks: the embedding,
and the loss (the final norm, the head and the loss), as Megatron-LM's --account-for-embedding-in-pipeline-split and
--account-for-loss-in-pipeline-split do."""


class Stages(OptionalKeys):
    optional_keys = ("implementation", "account", "outputs")  # stages without these options: as before them
    axis: str = "pp"
    mode: Literal["evenly", "explicit"] = "evenly"
    virtual: int = Field(default=1, gt=0, le=1024, description="stages per pipeline rank")
    rank_map: Union[Literal["loop", "vshape"], tuple[int, ...]] = "loop"
    groups: tuple[StageGroup, ...] = ()
    implementation: Literal["torch", "megatron", "deepspeed", "dualpipe"] = Field(
        default="torch", description="`stages = ... with implementation = torch | megatron | deepspeed | dualpipe`: whose "
        "pipeline runs them: torch's `torch.distributed.pipelining` (`plandsl run`'s and torchtitan's: each stage "
        "keeps a receive buffer per microbatch for activations and for gradients, and each output until its "
        "backward), Megatron-LM's (`megatron.core.pipeline_parallel.schedules`: an output freed once sent, one "
        "receive at a time), or DeepSpeed's pipeline engine (`deepspeed/runtime/pipe`, Megatron-DeepSpeed's: "
        "Megatron's memory; its TrainSchedule's 1F1B with blocking sends and receives between the instructions, "
        "each tensor-parallel rank sending 1/tp of a boundary and all-gathering it on arrival, and the gradients "
        "reduced only after the schedule: docs/cost-model.md, \"DeepSpeed's pipeline engine\"), or DeepSeek's "
        "DualPipe (deepseek-ai/DualPipe's `DualPipeV`, DeepSeek-V3's: each chunk received into a tensor of its own and "
        "an output's storage freed once sent, as Megatron-LM's, under a data-parallel wrapper that reduces into "
        "buffers beside one copy of the parameters; it runs the dualpipev schedule only)")
    account: tuple[Literal["embed", "loss"], ...] = Field(
        default=(), description="`stages = evenly ... with account = [embed, loss]`: the embedding and the loss (final "
        "norm, head and loss) each counted as one layer of the even split, in model order (Megatron-LM's "
        "--account-for-embedding-in-pipeline-split, --account-for-loss-in-pipeline-split); uncounted, they join the "
        "first and the last stage")
    outputs: Literal["dropped", "returned"] = Field(
        default="dropped", description="`stages = ... with outputs = dropped | returned` (torch's pipeline only): "
        "whether the last stage keeps every microbatch's output to the step's end and returns their merge, as "
        "torch's `step(return_outputs=True)` does, or drops each after its backward (`return_outputs=False`, "
        "`plandsl run`'s)")



class Placement(Node):
    """One mesh axis of a DTensor placement: Shard(dim) @ axis, Replicate @ axis, Partial @ axis."""
    kind: Literal["shard", "replicate", "partial"]
    axis: str
    dim: Optional[int] = None


class ParamRule(Node):
    param: str  # `weight`, `bias`, or `*`
    placements: tuple[Placement, ...]


class ShardRule(Node):
    target: Selector
    style: Optional[Literal["colwise", "rowwise", "sequence", "replicate"]] = None
    axis: Optional[str] = None
    params: tuple[ParamRule, ...] = ()




class ScheduleDef(Node):
    """A schedule written in the language: a table for one size or a template."""
    name: str
    kind: Literal["table", "template"]
    sizes: dict[str, int] = Field(default_factory=dict, description="table: ranks, microbatches, ...")
    variables: dict[str, str] = Field(default_factory=dict, description="template: variable -> dimension")
    rows: tuple[tuple[str, ...], ...] = Field(default=(), description="table: actions per rank, '_' idle")
    source: str = Field(default="", description="template: its text")
    syntax: SkipJsonSchema[Optional[Any]] = Field(default=None, exclude=True, repr=False)
    scope: SkipJsonSchema[Optional[Any]] = Field(default=None, exclude=True, repr=False,
                                                description="the file scope its template evaluates in")


class ScheduleRef(Node):
    """The plan's schedule: a built-in by name, or a schedule written in the language."""
    name: str
    options: dict[str, Union[int, float, str, bool]] = Field(default_factory=dict)
    definition: Optional[ScheduleDef] = Field(default=None, description="a written schedule; None for built-ins")


class Plan(Node):
    name: str
    model: Model
    cluster: Cluster
    mesh: Mesh
    train: Training
    data: Optional[DataParallel] = None
    tensor: Optional[TensorParallel] = None
    context: Optional[ContextParallel] = None
    experts: Optional[ExpertParallel] = None
    stages: Optional[Stages] = None
    schedule: Optional[ScheduleRef] = None
    shard: tuple[ShardRule, ...] = ()

    @property
    def seq(self) -> int:
        return self.train.seq or getattr(self.model, "seq", 1)

    def batch_axes(self) -> tuple[str, ...]:
        """Axes over which the global batch is split: data axes, then the expert axis."""
        axes = tuple(self.data.axes) if self.data else ()
        if self.experts and self.experts.axis not in axes:
            axes += (self.experts.axis,)
        return axes

    def axis_roles(self) -> dict[str, str]:
        """Mesh axis -> the parallelism it carries: "tp", "pp", "cp", "ep" or "dp" (an expert axis that is
        also a data axis is "ep"). Axes only shard rules use, and unused ones, are left out."""
        roles: dict[str, str] = {}
        if self.tensor is not None:
            roles[self.tensor.axis] = "tp"
        if self.stages is not None:
            roles[self.stages.axis] = "pp"
        if self.context is not None:
            roles[self.context.axis] = "cp"
        if self.experts is not None:
            roles.setdefault(self.experts.axis, "ep")
        for axis in self.data.axes if self.data is not None else ():
            roles.setdefault(axis, "dp")
        return roles

    def reduce_axes(self) -> tuple[str, ...]:
        """The axes whose ranks hold the same parameters and different tokens: the batch axes and the
        context axis (which splits each sequence). Gradients and the loss are averaged over them, and
        ZeRO shards over them."""
        context = (self.context.axis,) if self.context is not None and self.cp > 1 else ()
        return self.batch_axes() + tuple(axis for axis in context if axis not in self.batch_axes())

    @property
    def dp(self) -> int:
        total = 1
        for name in self.batch_axes():
            total *= self.mesh.degree(name)
        return total

    @property
    def pp(self) -> int:
        return self.mesh.degree(self.stages.axis) if self.stages else 1

    @property
    def tp(self) -> int:
        return self.mesh.degree(self.tensor.axis) if self.tensor else 1

    @property
    def cp(self) -> int:
        return self.mesh.degree(self.context.axis) if self.context else 1

    @property
    def ep(self) -> int:
        return self.mesh.degree(self.experts.axis) if self.experts else 1

    @property
    def run_gather(self) -> Precision | None:
        """The dtype `plandsl run` gathers the parameters in (FSDP2's `MixedPrecisionPolicy(param_dtype=...)`,
        `runtime.parallel.data_parallel.apply_dp`): the plan's `gather` under zero2, zero3 and hsdp when it is fp32
        or the compute precision (bf16, fp16), which autocast then computes with as they are. None where run gathers
        the weights' own dtype: no `gather`, `zero1` (torch's ZeroRedundancyOptimizer broadcasts the updated weights
        as they are kept, which is the only `gather` a checked zero1 plan names: `gathers_as_written`), `fp8`
        (torchao's FP8 all-gather, the cost model's only) and a 16-bit `gather` other than the compute precision
        (which the checker refuses, E515: FSDP2 would compute in it; kept here for plans built unchecked)."""
        gather = self.data.gather if self.data is not None and self.data.sharded else None
        return gather if gather in (Precision.fp32, self.train.precision) and gather is not Precision.fp8 else None

    @property
    def expert_group(self) -> int:
        """Ranks the experts are spread over (Megatron's expert-model-parallel size): the expert axis times
        the axes folded into it."""
        if self.experts is None:
            return 1
        return math.prod(self.mesh.degree(axis) for axis in self.experts.axes)

    @property
    def expert_tp(self) -> int:
        """Ranks each expert is split over (Megatron's expert-tensor-parallel size): the tensor axis, or 1
        when the experts fold it into their group."""
        folded = self.experts is not None and self.tensor is not None and self.tensor.axis in self.experts.fold
        return 1 if folded else self.tp

    @property
    def num_microbatches(self) -> int:
        return max(1, self.train.global_batch // max(1, self.dp * self.train.micro_batch))


class Document(Node):
    """Everything one .plan file defines, resolved (imports and parameters applied)."""
    version: int = IR_VERSION
    file: str
    params: dict[str, Union[int, float, str, bool]] = Field(default_factory=dict)
    devices: tuple[DeviceType, ...] = ()
    nodes: tuple[NodeType, ...] = ()
    clusters: tuple[Cluster, ...] = ()
    models: tuple[Model, ...] = ()
    schedules: tuple[ScheduleDef, ...] = ()
    plans: tuple[Plan, ...] = ()
