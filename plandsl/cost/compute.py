"""Compute: seconds one device spends on a layer for one microbatch, as a breakdown.

Stage: cost model. Contract: `estimate_layer_compute(model, layer, work, device)` returns a
`LayerCompute` (matrix multiplications and the rest, forward and backward, recomputation) from the
layer's shapes, the per-device share of the work (`Work`: tokens, tensor/expert parallel split) and
the device's figures from the cluster description (peak FLOP/s per precision, memory bandwidth).

A matrix multiplication (GEMM) of m x k by k x n takes its FLOPs at a fraction of the peak, plus
its operands' bytes at the memory bandwidth (the roofline, Williams et al. 2009, "Roofline: An
Insightful Visual Performance Model"), plus a fixed time per kernel (launch and the last, partial
wave of thread blocks):

    t = 2·m·n·k / (peak_fraction · peak) + bytes(A, B, C) / bandwidth + kernel_seconds

so small shards reach a lower fraction of the peak, smoothly in the GEMM's size:
efficiency = 2mnk / (peak · t). The two knobs (`peak_fraction`, `kernel_seconds`) are a property of
the device, from its description (`efficiency = { matmul, kernel_latency }`), defaulting to the fit
on published runs (docs/cost-model.md, docs/validation.md); `efficiency=` overrides them for a fit. Everything that is no GEMM (norms,
activations, residual adds, dropout, rotary, the softmax of the loss) moves its bytes at the device's
memory bandwidth; fused attention (Dao et al. 2022) reads Q, K, V and writes O once.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from plandsl import ir
from plandsl.ir.layers import TP_SPLIT, Layer, attention_projections, attention_widths, block_model, kv_width
from plandsl.ir.pairs import PairLayout, broken, pair_projections, table_split
from plandsl.cost.measured import ratio_at
from plandsl.cost.memory import FP32_STATES, StateBytes


GROUPED_GEMM_STREAMS = 4
"""Compute streams Transformer Engine deals a grouped GEMM's GEMMs to (`transformer_engine::num_streams`)."""


MOE_HOST_OPS = (28, 33)
"""ATen ops the host issues for one MoE layer (router, Megatron-Core's alltoall dispatcher with its device-to-host
copies of the tokens per expert, permutation, the experts' MLP as one grouped call per projection, unpermutation),
forward and backward: megatron-core 0.16.1's `MoELayer` counted op by op on CPU under a `TorchDispatchMode`, 22 + 6
per expert forward and 20 + 13 backward with its `SequentialMLP`, here with one expert for Transformer Engine's
`GroupedLinear` (one Python call per projection for all local experts). tests/unit/test_moe_host.py recounts it."""

FP8_PADDING_COPIES = 2
"""Copies of the dispatched tokens (`top_k·h` per token, read and written at the activations' width) Megatron-Core's
`TEGroupedMLP` makes per pass under FP8 or FP4: forward `Fp8Padding` pads each local expert's rows to the quantization's
alignment (Transformer Engine's `fused_multi_row_padding`) and `Fp8Unpadding` unpads the output; backward their
gradients are copied back the other way. Not with HybridEP, whose dispatch kernel pads (`pad_multiple`), nor with
`moe_router_padding_for_quantization` (no recipe sets it; the language does not say it)."""

SORT_CHUNKS_COPIES = 2
"""Copies of the dispatched tokens (`top_k·h` per token, read and written) Megatron-Core's alltoall dispatcher makes per
pass with more than one local expert, beyond its first permutation and last unpermutation: `dispatch_postprocess`
sorts the tokens the all-to-all brought (grouped by source rank) into groups by local expert and `combine_preprocess`
sorts them back (`sort_chunks_by_idxs`; fused, Transformer Engine's `moe_sort_chunks_by_index`: one copy each), and
the backward copies the gradients the same two ways. The flex dispatcher (DeepEP, HybridEP) has no such step."""

HOST_SECONDS_PER_OP = 10.7e-6
"""Host seconds per ATen op of that layer in eager mode (Python, Megatron-Core's module code, autograd, the
dispatcher): the slope of its forward + backward wall time over its op count, 80 to 194 ops (2 to 8 experts, one
thread, fastest of 200 runs, tests/unit/test_moe_host.py's layer), on this repository's CPU host; CUDA's own launch
call is not in it."""


@dataclass(frozen=True, slots=True)
class Efficiency:
    """The two fitted knobs of the GEMM model (see the module docstring), per precision when the device
    gives them so, corrected by measured GEMMs when it has them (`device_efficiency`)."""

    peak_fraction: float
    """Fraction of the peak the FLOPs of a large GEMM run at (cuBLAS: 0.7-0.9 of the datasheet)."""
    kernel_seconds: float
    """Fixed seconds per GEMM kernel: launch, and the tail wave that leaves most of the device idle."""
    corrections: tuple[tuple[float, float], ...] = ()
    """(ln FLOPs, measured / modelled seconds) of the device's measured GEMMs, by FLOPs: between two the
    model's time is scaled by the ratio interpolated linearly in ln FLOPs, beyond the ends by the end's."""
    precisions: tuple[tuple[ir.Precision, "Efficiency"], ...] = ()
    """The knobs of each precision, where they differ from these."""
    attention: float | None = None
    """Fraction of the peak the fused attention kernel's forward runs its executed FLOPs at (`attention_seconds`);
    None: the attention core is a batched GEMM at `peak_fraction`, its full s x s counted."""
    attention_backward: float | None = None
    """The same for its backward (2.5 times the forward's executed FLOPs); None: `attention`."""
    attention_curve: tuple[tuple[float, float], ...] = ()
    """(ln tokens, ratio) of the device's `attention_by_sequence`, by tokens: the kernel's speed at a sequence is
    `attention` and `attention_backward` times the ratio interpolated linearly in ln tokens, beyond the ends the
    end's; (): the figures at any length."""

    def of(self, precision: ir.Precision) -> "Efficiency":
        for own, knobs in self.precisions:
            if own is precision:
                return knobs
        return self

    def gemm_seconds(self, m: float, n: float, k: float, device: ir.DeviceType,
                     precision: ir.Precision, count: float = 1.0) -> float:
        """`count` GEMMs of m x k by k x n in one kernel (a batched GEMM: heads, experts)."""
        if m <= 0 or n <= 0 or k <= 0 or count <= 0:
            return 0.0
        flops = 2.0 * m * n * k * count
        moved = (m * k + k * n + m * n) * precision.gemm_bytes * count
        return self.kernel(flops, moved, device, precision)

    def grouped_gemm_seconds(self, m: float, n: float, k: float, device: ir.DeviceType, precision: ir.Precision,
                             count: int, streams: int = GROUPED_GEMM_STREAMS) -> float:
        """`count` GEMMs of m x k by k x n as Transformer Engine's grouped GEMM runs a device's experts
        (`GroupedLinear`: one cuBLAS GEMM per expert, dealt round-robin to `streams` compute streams,
        `nvte_multi_stream_cublas_gemm`): the device does every GEMM's FLOPs and bytes, and the fixed time per
        kernel (launch, the last partial wave) is paid once per round of `streams` concurrent GEMMs."""
        if count <= 0:
            return 0.0
        one = self.gemm_seconds(m, n, k, device, precision)
        fixed = min(one, (self.of(precision) if self.precisions else self).kernel_seconds)
        return count * (one - fixed) + -(-count // streams) * fixed

    def chunked_gemm_seconds(self, m: float, n: float, k: float, device: ir.DeviceType, precision: ir.Precision,
                             chunks: int, streams: int) -> float:
        """An m x k by k x n GEMM run as `chunks` GEMMs of m / chunks rows each, dealt to `streams` streams, as a
        decomposition beside a tensor-parallel collective runs it (`overlap_gemms`). Together the chunks do the
        whole GEMM's FLOPs and read and write its activations once; each reads the whole k x n weight again
        (torch's async TP multiplies each gathered shard by the whole weight, Transformer Engine's ring exchange
        each received chunk), but a GEMM streams its operands from memory while its tensor cores work, so a
        re-read costs only what it exceeds its chunk's math by (and the ring's consecutive chunks find a weight
        of tens of MB in an H100's 50 MB L2). The first chunk pays the weight's bytes as the whole GEMM does (the
        GEMM model's sum of FLOPs' and bytes' time is calibrated on whole GEMMs); a chunk's last partial wave runs
        beside the next chunk's first, so the fixed time per kernel is paid once per round of `streams`."""
        if m <= 0 or n <= 0 or k <= 0 or chunks <= 0:
            return 0.0
        knobs = self.of(precision) if self.precisions else self
        rows = m / chunks
        flops = 2.0 * rows * n * k
        own = (rows * k + rows * n) * precision.gemm_bytes  # this chunk's input rows and output rows
        weight = k * n * precision.gemm_bytes
        math_seconds = flops / (knobs.peak_fraction * peak_of(device, precision))
        reread = max(0.0, weight / device.bandwidth - math_seconds) * device.bandwidth  # bytes not hidden
        first = self.kernel(flops, own + weight, device, precision)
        rest = self.kernel(flops, own + reread, device, precision)
        fixed = min(first, knobs.kernel_seconds)
        return first + (chunks - 1) * rest - (chunks - -(-chunks // streams)) * fixed

    def kernel(self, flops: float, moved: float, device: ir.DeviceType, precision: ir.Precision) -> float:
        """Seconds of one compute kernel of `flops` FLOPs that moves `moved` bytes."""
        knobs = self.of(precision) if self.precisions else self
        seconds = flops / (knobs.peak_fraction * peak_of(device, precision)) + moved / device.bandwidth + \
            knobs.kernel_seconds
        return seconds * knobs.correction(flops) if knobs.corrections and flops > 0 else seconds

    def attention_seconds(self, flops: float, moved: float, causal: float, device: ir.DeviceType,
                          precision: ir.Precision, seq: int = 0) -> tuple[float, float] | None:
        """(forward, backward) seconds of a fused attention kernel whose full s x s product is `flops` FLOPs,
        moving `moved` bytes (Q, K, V, O) forward and twice that backward, of which the fraction `causal` is
        executed, when the device states its attention kernel's fractions of the peak; None when it does not.
        The backward executes 2.5 times the forward's FLOPs: its five matrix products against the forward's two,
        the scores recomputed (Dao 2023, FlashAttention-2, Sec. 3.1; its benchmarks count it so). `seq`: the keys
        each query runs over, which the device's `attention_by_sequence` scales the fractions by (0: unscaled)."""
        knobs = self.of(precision) if self.precisions else self
        if knobs.attention is None:
            return None
        scale = ratio_at(knobs.attention_curve, seq) if knobs.attention_curve and seq > 0 else 1.0
        peak = peak_of(device, precision) * scale
        executed = flops * causal
        backward = knobs.attention_backward or knobs.attention
        return (executed / (knobs.attention * peak) + moved / device.bandwidth + knobs.kernel_seconds,
                2.5 * executed / (backward * peak) + 2 * moved / device.bandwidth + knobs.kernel_seconds)

    def correction(self, flops: float) -> float:
        """The measured / modelled ratio at `flops` (1 without measured GEMMs)."""
        return ratio_at(self.corrections, flops)

    def efficiency(self, m: float, n: float, k: float, device: ir.DeviceType, precision: ir.Precision) -> float:
        """Achieved fraction of the peak for one m x k by k x n GEMM."""
        seconds = self.gemm_seconds(m, n, k, device, precision)
        return 2.0 * m * n * k / (seconds * peak_of(device, precision)) if seconds else 0.0


def device_efficiency(device: ir.DeviceType) -> Efficiency:
    """The device's own knobs (`device ... { efficiency = { matmul, kernel_latency } }`, per precision
    `{ bf16: { ... } }`, with `measured` GEMMs), else the language's defaults (`ir.DeviceEfficiency`),
    fitted on Megatron-LM's A100 weak-scaling runs (Narayanan et al. 2021, Table 1, every other row;
    `python bench/bench_search.py --fit`)."""
    found = _DEVICE_CACHE.get(id(device))
    if found is not None and found[0] is device:
        return found[1]
    knobs = device.efficiency or _DEFAULT_KNOBS
    if not knobs.precisions and not knobs.measured:
        efficiency = Efficiency(knobs.matmul, knobs.kernel_latency, attention=knobs.attention,
                                attention_backward=knobs.attention_backward, attention_curve=_curve(knobs))
    else:
        efficiency = Efficiency(knobs.matmul, knobs.kernel_latency, precisions=tuple(
            (precision, _measured(knobs.precisions.get(precision, knobs), device, precision))
            for precision in device.peak), attention=knobs.attention, attention_backward=knobs.attention_backward,
            attention_curve=_curve(knobs))
    if len(_DEVICE_CACHE) > 4096:
        _DEVICE_CACHE.clear()
    _DEVICE_CACHE[id(device)] = (device, efficiency)
    return efficiency


_DEVICE_CACHE: dict[int, tuple[ir.DeviceType, Efficiency]] = {}  # the IR holds dicts: not hashable, keyed by id


def _measured(knobs: ir.DeviceEfficiency, device: ir.DeviceType, precision: ir.Precision) -> Efficiency:
    """One precision's knobs, with the ratios of its measured GEMMs to the two-knob curve (GEMMs of equal
    FLOPs: their geometric mean)."""
    plain = Efficiency(knobs.matmul, knobs.kernel_latency)
    ratios: dict[float, list[float]] = {}
    for point in knobs.measured:
        modelled = plain.gemm_seconds(point.m, point.n, point.k, device, precision)
        ratios.setdefault(math.log(2.0 * point.m * point.n * point.k), []).append(math.log(point.seconds / modelled))
    corrections = tuple((x, math.exp(sum(logs) / len(logs))) for x, logs in sorted(ratios.items()))
    return Efficiency(knobs.matmul, knobs.kernel_latency, corrections, attention=knobs.attention,
                      attention_backward=knobs.attention_backward, attention_curve=_curve(knobs))


def _curve(knobs: ir.DeviceEfficiency) -> tuple[tuple[float, float], ...]:
    """The device's `attention_by_sequence` as (ln tokens, ratio), by tokens."""
    return tuple((math.log(point.tokens), point.ratio) for point in knobs.attention_by_sequence)


_DEFAULT_KNOBS = ir.DeviceEfficiency()
DEFAULT_EFFICIENCY = Efficiency(_DEFAULT_KNOBS.matmul, _DEFAULT_KNOBS.kernel_latency)


def peak_of(device: ir.DeviceType, precision: ir.Precision) -> float:
    """The device's peak for the precision (the checker's E504 guarantees there is one)."""
    peak = device.peak.get(precision)
    return peak if peak is not None else min(device.peak.values())


@dataclass(frozen=True, slots=True)
class Work:
    """The share of one microbatch one device computes."""

    micro_batch: int
    seq: int                 # full sequence length: the keys each query attends to
    tp: int = 1
    cp: int = 1
    ep: int = 1
    sequence_parallel: bool = False
    precision: ir.Precision = ir.Precision.bf16
    recompute: ir.Recompute = ir.Recompute.none
    gather_kv: bool = False  # context parallelism all-gathers K and V (`allgather`), else rotates them (`ring`)
    kernels: ir.Kernels = ir.Kernels.fused
    overlap_experts: bool = False  # `experts = ... with overlap`: the all-to-alls behind another microbatch's compute
    attention: ir.Attention = ir.Attention.flash
    fold_experts: bool = False  # `experts = alltoall over [ep, tp]`: each expert whole, `ep` ranks counting tp's
    loss: ir.Loss = ir.Loss.standard
    overlap_tensor: bool = False  # `tensor = ... with sequence_parallel, overlap`: TP collectives chunked behind GEMMs
    tensor_overlap: ir.TensorOverlap = ir.TensorOverlap.async_tp  # `overlap = userbuffers`: Transformer Engine's
    sm_margin: bool = True  # userbuffers' set_sm_margin: its pipelined and bulk overlaps' GEMMs on the SMs left
    dispatcher: str = "alltoall"  # `experts = deepep | hybridep over ...`: a token crosses the network once per node
    fp8_recipe: ir.Fp8Recipe | None = None  # `precision: fp8`'s scaling (`ir.Training.recipe`; None: delayed)
    fp8_gather: bool = False  # `data = ... with gather = fp8`: the weights reach the linear layers in FP8 already
    ring: str = "te"  # `context = ring over cp with implementation = te | torch`: whose ring runs (cost.ring)
    modules: frozenset = frozenset((ir.RecomputeModule.core_attn,))  # what `selective` reruns (`ir.Training.modules`)
    accumulate: int = 0  # bytes per weight element a weight-gradient GEMM reads and writes of the gradient it adds its
    # product into (`accumulate_bytes`: under `param_dtype`, twice `grad_dtype`'s); 0: it writes its output at its bytes

    @property
    def tokens(self) -> int:
        """Tokens of one microbatch on one context-parallel rank (the worst rank rounds up)."""
        return self.micro_batch * -(-self.seq // self.cp)


@dataclass(frozen=True, slots=True)
class LayerCompute:
    """Seconds for one microbatch through one layer on one device, and the FLOPs behind them."""

    forward_matmul: float
    forward_other: float
    backward_matmul: float
    backward_other: float
    recompute: float
    attention: float = 0.0     # forward seconds of the attention core (ring context parallelism hides behind it)
    flops: float = 0.0         # forward FLOPs on this device
    recompute_flops: float = 0.0
    # Of the seconds above, the experts' own (Megatron-Core's `mlp` node: the routed experts' grouped GEMMs, activation,
    # FP8 casts, padding and the dispatcher's sorting copies, and the shared experts), which combined 1F1B runs beside
    # the all-to-alls of another microbatch (cost.layer):
    experts_forward: float = 0.0
    experts_input_grad: float = 0.0   # their backward for the inputs: the dgrad GEMMs and the element-wise work
    experts_weight_grad: float = 0.0  # their weight-gradient GEMMs
    accumulate: float = 0.0  # of the backward, seconds its weight-gradient GEMMs read and write the gradient buffer
    #                          they accumulate into beyond writing their output (`Work.accumulate`), W's

    @property
    def forward(self) -> float:
        return self.forward_matmul + self.forward_other

    @property
    def input_grad(self) -> float:
        """Backward for the inputs (I of a split backward): half the matmuls, the rest, recomputation."""
        return self.backward_matmul / 2 + self.backward_other + self.recompute

    @property
    def weight_grad(self) -> float:
        """Backward for the weights (W): the other half of the backward matmuls, and their accumulation."""
        return self.backward_matmul / 2 + self.accumulate

    @property
    def backward(self) -> float:
        return self.input_grad + self.weight_grad


ZERO = LayerCompute(0.0, 0.0, 0.0, 0.0, 0.0)


def reruns_core(work: Work) -> bool:
    """Whether the backward reruns the attention core (and the context-parallel traffic that feeds it): every mode
    but `none` and a `selective` whose modules leave `core_attn` out."""
    if work.recompute is ir.Recompute.selective:
        return ir.RecomputeModule.core_attn in work.modules
    return work.recompute is not ir.Recompute.none


def estimate_layer_compute(model: ir.Model, layer: Layer, work: Work, device: ir.DeviceType,
                           efficiency: Efficiency | None = None) -> LayerCompute:
    """Forward, backward and recomputation seconds of `layer` for one microbatch on `device`.

    Backward = 2 x forward matmuls (input and weight gradients, each a GEMM as large as the
    forward's; Narayanan et al. 2021, Sec. 5.1) and 2 x the forward's other bytes (read the output
    gradient and the saved input, write the input gradient). Recomputation (Korthikanti et al. 2022):
    `full` reruns the block's forward inside its backward, `selective` the attention core only,
    `selective_op` half of the matmuls and the element-wise work.
    `efficiency`: None for the device's own knobs (`device_efficiency`).
    """
    efficiency = efficiency or device_efficiency(device)
    if isinstance(model, ir.TransformerModel):
        return _transformer_layer(model, layer, work, device, efficiency)
    precision = work.precision
    tokens = work.tokens
    if isinstance(model, ir.MLPModel):
        out_features, in_features = layer.params[0].shape
        matmul = efficiency.gemm_seconds(tokens, out_features, in_features, device, precision)
        other = 2 * tokens * out_features * precision.bytes / device.bandwidth  # bias + activation
        flops = 2.0 * tokens * in_features * out_features
    else:  # custom layer: authored FLOPs per token, no shapes: the large-GEMM efficiency
        flops = _tensor_parallel_flops(layer, work.tp) * tokens
        matmul = efficiency.kernel(flops, 0.0, device, precision) if flops else 0.0
        other = 2 * tokens * layer.output_width * precision.bytes / device.bandwidth
    full = work.recompute is ir.Recompute.full
    return LayerCompute(matmul, other, 2 * matmul, 2 * other, (matmul + other) if full else 0.0,
                        flops=flops, recompute_flops=flops if full else 0.0)


def mtp_projection_compute(model: ir.TransformerModel, work: Work, device: ir.DeviceType,
                           efficiency: Efficiency | None = None) -> LayerCompute:
    """One multi-token prediction depth's `eh_proj` for one microbatch: the normed embeddings and hidden states
    concatenated (2h) and projected to h by a column-parallel GEMM without bias (megatron-core 0.16.1
    multi_token_prediction.py:662-671, 741-743), in the plan's precision (the depth runs under the global FP8 context,
    :775-787); its backward as any GEMM's (`estimate_layer_compute`). The depth's norms, embedding lookup, block and
    output layer are those layers' own figures (`cost.layer.estimate_layer_time` adds them). Its weight gradient
    accumulates into the gradient buffer as every linear layer's does (`accumulate_seconds`)."""
    efficiency = efficiency or device_efficiency(device)
    tokens, h = work.tokens, model.hidden
    out = -(-h // work.tp)
    matmul = efficiency.gemm_seconds(tokens, out, 2 * h, device, work.precision)
    other = tokens * (2 * h + out) * work.precision.bytes / device.bandwidth  # the concatenation's write and read
    flops = 2.0 * tokens * out * 2 * h
    full = work.recompute is ir.Recompute.full
    return LayerCompute(matmul, other, 2 * matmul, 2 * other, (matmul + other) if full else 0.0,
                        flops=flops, recompute_flops=flops if full else 0.0,
                        accumulate=accumulate_seconds(out * 2 * h, work, work.precision, device))


def _tensor_parallel_flops(layer: Layer, tp: int) -> float:
    """A custom layer's forward FLOPs per token on one device. A torch model's tensor-parallel plan splits
    some Linear weights (`ir.layers.TP_SPLIT`): each such weight's 2·in·out multiply-adds per token are
    shared by the tp ranks, and so is the attention core the table measured (the part of the FLOPs that
    grows with the sequence: each rank computes the scores of its share of the heads, as column-split q, k
    and v give it). Elementwise work is not counted by the table. An embedding's lookup has no FLOPs to
    split (the layer's figure caps the share)."""
    if tp <= 1:
        return layer.flops_per_token
    split = sum(2.0 * p.numel for p in layer.params if len(p.shape) == 2 and TP_SPLIT in p.dims)
    if split:
        split += layer.attention_flops_per_token
    return layer.flops_per_token - min(split, layer.flops_per_token) * (1 - 1 / tp)


@dataclass(frozen=True, slots=True)
class EagerBytes:
    """Bytes per element that PyTorch eager mode moves through memory outside the GEMMs of a Llama block and
    its loss, forward and backward (input gradients), at one activation width (`EAGER`).

    Measured, not fitted: the inputs and outputs of every ATen kernel that is no GEMM and no attention core
    (views excluded), counted under a `TorchDispatchMode` while Hugging Face transformers' `LlamaRMSNorm`,
    `apply_rotary_pos_emb`, `LlamaDecoderLayer` and a cross entropy over `logits.float()` run forward and
    backward, solved per element of each width (tests/unit/test_eager_bytes.py repeats the count against
    this table). `norm`: one RMSNorm per element of its width (upcast to fp32, square, mean, scale, downcast,
    weight: five passes forward, nine backward); `block`: the rest of a block per element of the hidden size
    (the two residual adds and their gradients' sums, layout copies); `rotary` per element of q and of k
    (multiply by cos, negate half, concatenate, multiply by sin, add); `gate` per element of the MLP's hidden
    width (silu, then the product with the up projection); `loss` per logit (the fp32 copy, log-softmax, the
    NLL). The fused kernels of the default move, 16-bit, forward: 4 bytes per norm element, 12 of residual
    adds, 4 of rotary, 6 of gate per element, twice that backward."""

    norm_forward: float
    norm_backward: float
    block_forward: float
    block_backward: float
    rotary_forward: float
    rotary_backward: float
    gate_forward: float
    gate_backward: float
    loss_forward: float
    loss_backward: float


MEGATRON_LOSS_BYTES = (38.0, 14.0)
"""Bytes per logit Megatron-LM's `vocab_parallel_cross_entropy` (`loss: megatron`) moves beyond the GEMM's write of
the 16-bit logits, (forward, backward), counted from `megatron/core/tensor_parallel/cross_entropy.py` (called by
`language_module.py` without `--cross-entropy-loss-fusion`) at the commit of Megatron-LM's 2024 H100 table
(f2e5db402c): forward, `.float()` reads 2 and writes 4, the max reads 4, `-= logits_max`, `exp(out=)` and
`div_(sum)` read and write 4 each, the sum reads 4; backward, `grad_input.mul_(grad_output)` reads and writes 4,
the `.float()`'s backward reads 4 and writes 2. 16-bit logits (bf16, fp16; FP8 keeps the output layer 16-bit)."""

FP8_CAST_BYTES = 4.0  # read 2 bytes of a 16-bit element, write its row-wise and column-wise FP8 copies (1 + 1)
MXFP8_CAST_BYTES = FP8_CAST_BYTES + 2 / ir.MX_BLOCK  # and each copy's E8M0 scale per block of 32 (rows, columns)
NVFP4_CAST_BYTES = 2 + 2 + 2 * ir.Precision.nvfp4.gemm_bytes  # an amax pass (read 2: the FP32 per-tensor scale
# comes first), then read 2 and write the row-wise and column-wise FP4 copies with their E4M3 scales (1/2 + 1/16 each)
CAST_BYTES = {ir.Precision.fp8: FP8_CAST_BYTES, ir.Precision.mxfp8: MXFP8_CAST_BYTES,
              ir.Precision.nvfp4: NVFP4_CAST_BYTES}
"""Bytes a quantizing precision moves per element of a linear layer's input or output gradient (`_transformer_layer`)."""

FP8_AMAX_BYTES = 2.0
"""An amax pass over a 16-bit tensor before its cast: it reads the tensor once (its output, one float, is nothing)."""

FP8_RECIPE_CAST_BYTES = {
    # TE's DelayedScaling: the scale from the amax history, the amax of this cast recorded by the cast itself (one
    # fused cast-transpose: read 2, write the row- and column-wise FP8 copies, 1 + 1)
    ir.Fp8Recipe.delayed: FP8_CAST_BYTES,
    # TE's Float8CurrentScaling (`Float8CurrentScalingQuantizer::quantize_impl`): `nvte_compute_amax` reads the
    # tensor, `nvte_compute_scale_from_amax` (one float), then the cast-transpose as delayed's
    ir.Fp8Recipe.current: FP8_AMAX_BYTES + FP8_CAST_BYTES,
    # torchao's tensorwise dynamic scaling under torch.compile (torchao/float8/roofline_utils.py,
    # `get_float8_mem_sympy`: the input's and the output gradient's amax fused into the kernel that wrote them,
    # `fuse_with_prev=True`), then one cast writing the row- and column-major FP8 copies
    ir.Fp8Recipe.tensorwise: FP8_CAST_BYTES,
    # TE's Float8BlockScaling (DeepSeek-V3's 1 x 128 tiles): each tile's amax found by the cast itself, each copy's
    # FP32 scale per tile written beside it (4 bytes per `FP8_BLOCK` elements, row- and column-wise)
    ir.Fp8Recipe.blockwise: FP8_CAST_BYTES + 2 * 4 / ir.FP8_BLOCK,
}
"""Bytes each FP8 recipe moves per element of a linear layer's input (forward) and output gradient (backward)."""

FP8_WEIGHT_CAST_BYTES = {ir.Fp8Recipe.tensorwise: FP8_AMAX_BYTES + FP8_CAST_BYTES}
"""Bytes a recipe moves per element of a linear layer's weight in every forward (and every forward a recomputation
reruns): torchao's tensorwise scaling casts the weight again each time, its amax a pass of its own
(`get_float8_mem_sympy`: `fwd_fp8_weight_mem`, `fuse_with_prev=False`: read 2, read 2, write 1 + 1; the backward's
grad_input GEMM reads the copy the forward made). Transformer Engine's recipes cast a weight once a step and cache
it across microbatches (Megatron's `is_first_microbatch`): not per microbatch, so not here."""
FP8_GATHERED_WEIGHT_BYTES = 2.0
"""Bytes per element of a linear layer's weight in every backward under torchao's tensorwise scaling when FSDP gathers
it in FP8 (`gather = fp8`, `enable_fsdp_float8_all_gather`): the weight arrives as a `Float8TrainingTensor`, which the
forward's GEMM reads as it is (`weight.t()` is column-major), so no cast; the backward's grad_input GEMM reads it
row-major, which `float8_ops` copies column-major first (`b_data.t().contiguous().t()`: read 1, write 1). The cast
itself runs on each rank's shard before each all-gather (`WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather`, the
scale precomputed once a step: read the shard, write 1 byte), 1/N_d of it per gather, not priced."""


def cast_bytes(work: Work) -> float:
    """Bytes per element the casts of `work`'s quantized linear layers move (`CAST_BYTES`; fp8 by its recipe)."""
    if work.precision is ir.Precision.fp8:
        return FP8_RECIPE_CAST_BYTES[work.fp8_recipe or ir.Fp8Recipe.delayed]
    return CAST_BYTES[work.precision]

EAGER = {2: EagerBytes(36.0, 98.0, 13.0, 31.0, 20.0, 32.0, 10.0, 18.0, 18.0, 26.0),  # bf16, fp16, fp8's activations
         4: EagerBytes(28.0, 96.0, 26.0, 69.0, 40.0, 64.0, 20.0, 36.0, 12.0, 20.0)}  # fp32


def materialized_attention_bytes(model: ir.TransformerModel, work: Work) -> tuple[float, float]:
    """Bytes one device's materialized attention core moves for its s x s matrices in one block and microbatch,
    (forward, backward), beyond the Q, K, V and O the fused core reads and writes: Megatron-LM's core before
    flash attention (`attention: materialized`). Per element of this rank's `b · heads/t · s_q · s` scores,
    at the activations' width e: forward, the first batched GEMM writes the scores (e), the fused
    scale-mask-softmax reads them and writes the probabilities (2e), gpt's attention dropout reads those and
    writes its output and a 1-byte mask (2e + 1), the second batched GEMM reads the result (e); backward, its
    gradient GEMMs read the probabilities and write their gradient (2e), the dropout's backward reads that and
    the mask and writes (2e + 1), the softmax's backward reads the gradient and its output and writes (3e), and
    both gradient GEMMs of the scores read theirs (2e): 13 and 19 bytes for gpt at 16 bits, 8 and 14 for llama
    (no attention dropout). The full s² is computed: Megatron's upper-triangular softmax masks, it does not skip."""
    element = work.precision.bytes
    seq_q = -(-work.seq // work.cp)
    scores = work.micro_batch * model.heads / work.tp * seq_q * work.seq
    dropout = model.kind == "gpt"
    forward = 4 * element + (2 * element + 1 if dropout else 0)
    backward = 7 * element + (2 * element + 1 if dropout else 0)
    return scores * forward, scores * backward


def _transformer_layer(model: ir.TransformerModel, layer: Layer, work: Work, device: ir.DeviceType,
                       efficiency: Efficiency) -> LayerCompute:
    precision, tokens, tp = work.precision, work.tokens, work.tp
    h = model.hidden
    element = precision.bytes
    bandwidth = device.bandwidth
    split = tp if work.sequence_parallel else 1   # sequence parallel splits the norms' tokens too
    gemm = efficiency.gemm_seconds
    if layer.kind == "embed":
        # A lookup: read the rows, write the activations (vocabulary-parallel: each rank its rows).
        other = 2 * tokens * h * element / bandwidth
        return LayerCompute(0.0, other, 0.0, 2 * other, 0.0)
    if layer.kind == "norm":
        other = 2 * 2 * tokens * h * element / split / bandwidth  # read and write, mean/var pass fused
        if work.kernels is ir.Kernels.eager and model.kind != "gpt":  # RMSNorm op by op (EagerBytes)
            eager = EAGER[element]
            return LayerCompute(0.0, tokens * h / split * eager.norm_forward / bandwidth, 0.0,
                                tokens * h / split * eager.norm_backward / bandwidth, 0.0)
        return LayerCompute(0.0, other, 0.0, 2 * other, 0.0)
    if layer.kind == "head":
        # a head whose rule keeps the vocabulary whole (`ir.pairs.table_split`): every rank's logits over all of it, its
        # GEMM over the hidden dim's share (rowwise) or all of it (`replicate`)
        table = table_split(layer) if tp > 1 else 0
        vocab = -(-model.vocab // tp) if table == 0 else model.vocab
        features = h / tp if table == 1 else h
        matmul = gemm(tokens, vocab, features, device, precision.unquantized)  # fp8: the output layer stays 16-bit
        # Cross entropy over fp32 logits (Korthikanti et al. 2022, Sec. 4.3): write the 16-bit
        # logits, read them, write fp32 probabilities; backward reads them and writes the gradient.
        forward_other = tokens * vocab * (element + element + 4) / bandwidth
        backward_other = tokens * vocab * (4 + element) / bandwidth
        if work.loss is ir.Loss.fused:  # one kernel: write the 16-bit logits, read them once (a log-sum-exp per
            # token); backward reads them and writes their gradient in place, whatever the other kernels are
            forward_other = tokens * vocab * 2 * element / bandwidth
            backward_other = tokens * vocab * 2 * element / bandwidth
        elif work.loss is ir.Loss.megatron:  # the GEMM's write of the logits, then Megatron's ops over the fp32 copy
            forward_other = tokens * vocab * (element + MEGATRON_LOSS_BYTES[0]) / bandwidth
            backward_other = tokens * vocab * MEGATRON_LOSS_BYTES[1] / bandwidth
        elif work.kernels is ir.Kernels.eager:  # the GEMM's write of the logits, then the loss op by op (EagerBytes)
            eager = EAGER[element]
            forward_other = tokens * vocab * (element + eager.loss_forward) / bandwidth
            backward_other = tokens * vocab * eager.loss_backward / bandwidth
        flops = 2.0 * tokens * vocab * features
        return LayerCompute(matmul, forward_other, 2 * matmul, backward_other, 0.0, flops=flops,
                            accumulate=accumulate_seconds(vocab * features, work, precision.unquantized, device))
    # A block: fused QKV (or MLA's down- and up-projections), attention core, output projection, MLP (or
    # experts), as Megatron runs it; a dense block of a dense-then-MoE model as the dense model it is. A pair a shard
    # rule breaks (`ir.pairs.broken`) as `plandsl run` lays it out: each member a GEMM split as its weight is (a whole
    # one computes all its FLOPs on every tensor rank), what passes between the members whole, so a broken attention
    # runs every head's core on every rank (`core_work`) and its rotary on all of q and k.
    model = block_model(model, layer)
    pairs = broken(layer) if tp > 1 else {}
    attention_pair = pairs.get("attn")
    attention_tp, core_work = (1, replace(work, tp=1)) if attention_pair else (tp, work)
    kv = kv_width(model)
    ffn = model.ffn_hidden
    gpt = model.kind == "gpt"
    widths = attention_widths(model)
    matmul = flops = 0.0
    cast_in = cast_grad = 0.0  # elements per token FP8 quantizes: each GEMM's input (forward), its output's gradient
    weights = 0.0  # elements of this rank's quantized weights (the linear layers run in `precision`)
    up_projections = up_flops = 0.0  # MLA's column-parallel projections (`mla_up_proj` reruns them)
    # wq, wk, wv (column-parallel), wo (row-parallel); a broken pair's members as their weights are split, "all": whole
    for out, features, splits in (pair_projections(model, attention_pair) if attention_pair
                                  else attention_projections(model)):
        out, features = (out / tp, features) if splits == "out" else (out, features / tp) if splits == "in" \
            else (out, features)
        rows = tokens if splits else tokens / split  # MLA's replicated down-projections: the sequence shard under SP
        matmul += gemm(rows, out, features, device, precision)
        flops += 2.0 * rows * out * features
        if splits in ("out", "all") and model.latent_attention:
            up_projections += gemm(rows, out, features, device, precision)
            up_flops += 2.0 * rows * out * features
        weights += out * features
        # a column-parallel or replicated GEMM's input and a row-parallel one's output are this rank's sequence
        # shard under sequence parallelism (quantized before the gather, after the reduce-scatter)
        cast_in += features if splits in ("in", "all") else features / split
        cast_grad += out if splits in ("out", "all") else out / split
    attention_flops, attention_bytes = rank_attention(widths, core_work)  # Q·Kᵀ and P·V over this rank's heads
    causal = causal_fraction(work.seq)  # a windowed block's kernel executes only its band's tiles (`window_band`)
    attention, attention_backward = attention_core_seconds(attention_flops, attention_bytes, causal, core_work,
                                                           device, efficiency, band=window_band(work.seq, model.window),
                                                           seq=work.seq)
    attention_backward_extra = 0.0
    if work.attention is ir.Attention.materialized:
        # The s x s matrices through memory (`materialized_attention_bytes`): the fused core's FLOPs and Q, K, V, O
        # bytes, plus the scores' and probabilities' bytes, forward and backward.
        forward_bytes, backward_bytes = materialized_attention_bytes(model, core_work)
        attention += forward_bytes / bandwidth
        attention_backward_extra = backward_bytes / bandwidth
    projections = 3 if not gpt else 2                                      # SwiGLU: w1, w3 and w2
    experts_matmul = experts_elements = experts_cast_in = experts_cast_grad = experts_copied = experts_weights = 0.0
    shared = shared_flops = shared_elements = dense_matmul = dense_flops = router = activation_elements = 0.0
    if model.experts:
        experts = model.experts
        # the router: a plain linear layer, outside Transformer Engine's FP8 (replicated)
        router = gemm(tokens, experts, h, device, precision.unquantized)
        matmul += router
        flops += 2.0 * tokens * h * experts
        # Folded over the tensor axis (Megatron-Core's MoE parallel folding, expert TP 1): each rank dispatches its
        # own sequence shard and runs its experts whole; otherwise every tensor rank runs all tokens on 1/tp of each.
        expert_tp, rows = (1, tokens / tp) if work.fold_experts else (tp, tokens)
        share = rows / tokens                                               # of the block's tokens, per device
        routed = rows * model.top_k * work.ep / experts                     # tokens per local expert
        local = max(1, experts // work.ep)
        # the local experts' projections: Megatron-Core's TEGroupedMLP, a grouped GEMM per projection
        grouped = efficiency.grouped_gemm_seconds
        experts_matmul = grouped(routed, (projections - 1) * ffn / expert_tp, h, device, precision, local) \
            + grouped(routed, h, ffn / expert_tp, device, precision, local)
        matmul += experts_matmul
        flops += 2.0 * rows * model.top_k * projections * h * ffn / expert_tp
        experts_elements = model.top_k * (2 if gpt else 3) * ffn / expert_tp * share  # the activation, per token
        activation_elements = experts_elements
        mlp_elements = experts_elements + model.top_k * 4 * h * share + 2 * experts
        gate_width = model.top_k * ffn / expert_tp * share
        routing = model.top_k * 4 * h * share + 2 * experts                 # permute, unpermute; router
        # the experts' fc1 and fc2 on top_k routed copies: inputs h and the gate's width, output gradients
        experts_cast_in = model.top_k * (h + ffn / expert_tp) * share
        experts_cast_grad = model.top_k * ((projections - 1) * ffn / expert_tp + h) * share
        cast_in += experts_cast_in
        cast_grad += experts_cast_grad
        if precision.quantized and work.dispatcher != "hybridep":
            # TEGroupedMLP's FP8 padding and unpadding of the routed copies (FP8_PADDING_COPIES), read and written
            experts_copied = FP8_PADDING_COPIES * 2 * model.top_k * h * share
        if work.dispatcher == "alltoall" and local > 1:
            # the alltoall dispatcher's tokens sorted by local expert after the all-to-all and back before the
            # combine (SORT_CHUNKS_COPIES), read and written
            experts_copied += SORT_CHUNKS_COPIES * 2 * model.top_k * h * share
        weights += local * projections * h * ffn / expert_tp
        experts_weights = local * projections * h * ffn / expert_tp
        if model.shared_experts:  # every token through one MLP of shared_experts x ffn (DeepSeekMoE)
            width = model.shared_experts * ffn
            # the gate's width on this rank: whole where a rule breaks the shared experts' pair (`_pair_gemms`)
            local = width if "shared" in pairs else width / tp
            if "shared" in pairs:
                shared, shared_flops, shared_weights = _pair_gemms(pairs["shared"], tokens, h, width, tp, gemm,
                                                                   device, precision)
            else:
                shared = gemm(tokens, (projections - 1) * width / tp, h, device, precision) \
                    + gemm(tokens, h, width / tp, device, precision)
                shared_flops = 2.0 * tokens * projections * h * width / tp
                shared_weights = projections * h * width / tp
            matmul += shared
            experts_matmul += shared  # combined 1F1B's `mlp` node runs them with the routed experts
            flops += shared_flops
            shared_elements = 3 * local if "shared" in pairs else 3 * width / tp
            mlp_elements += shared_elements
            experts_elements += shared_elements
            gate_width += local
            gated = (projections - 1) * local if "shared" in pairs else (projections - 1) * width / tp
            cast_in += h / split + local
            cast_grad += gated + h / split
            experts_cast_in += h / split + local
            experts_cast_grad += gated + h / split
            weights += shared_weights
            experts_weights += shared_weights
    elif "mlp" in pairs:  # a rule breaks the MLP's pair: each member as its weight is split, the gate whole
        dense_matmul, dense_flops, dense_weights = _pair_gemms(pairs["mlp"], tokens, h, ffn, tp, gemm, device,
                                                               precision)
        matmul += dense_matmul
        flops += dense_flops
        mlp_elements = (2 if gpt else 3) * ffn
        gate_width, routing = ffn, 0.0
        cast_in += h / split + ffn
        cast_grad += (projections - 1) * ffn + h / split
        weights += dense_weights
    else:
        dense_matmul = gemm(tokens, (projections - 1) * ffn / tp, h, device, precision) \
            + gemm(tokens, h, ffn / tp, device, precision)
        matmul += dense_matmul
        dense_flops = 2.0 * tokens * projections * h * ffn / tp
        flops += dense_flops
        mlp_elements = (2 if gpt else 3) * ffn / tp                        # GeLU r/w; SwiGLU r 2, w 1
        gate_width, routing = ffn / tp, 0.0
        cast_in += h / split + ffn / tp                         # fc1's input (w1 and w3 share it), fc2's
        cast_grad += (projections - 1) * ffn / tp + h / split   # fc1's output gradient, fc2's
        weights += projections * h * ffn / tp
    # Outside the GEMMs, per token: two norms (read, write: 4h), two residual adds (read 2, write
    # 1: 6h), gpt's two dropout masks (1 byte each: h in 16-bit units); inside tensor parallelism
    # the activation function and llama's rotary embedding on q and k (read, write: 2(q + kv), q = h unless
    # head_dim says otherwise).
    replicated = (4 + 6 + (1 if gpt else 0)) * h / split
    sharded = mlp_elements + (0 if gpt else 2 * (widths.q + kv) / attention_tp)
    if model.latent_attention:  # MLA: the latents' norms (read, write), rotary on its rope parts only
        replicated += 2 * (model.q_lora_rank + model.kv_lora_rank + model.qk_rope_head_dim) / split
        sharded = mlp_elements + 2 * model.heads * model.qk_rope_head_dim / attention_tp
    other = tokens * (replicated + sharded + experts_copied) * element / bandwidth
    backward_other = 2 * other - tokens * experts_copied * element / bandwidth  # the backward's copies: as many
    if work.kernels is ir.Kernels.eager and not gpt:
        # PyTorch eager's kernels (EagerBytes; gpt's LayerNorm, GeLU and dropout are one kernel each in eager
        # mode too, as the fused model prices them). The norms' work runs on the sequence shard under sequence
        # parallelism, rotary on this rank's heads, the gate on its share of the MLP (top_k experts' and the
        # shared experts' widths), MLA's two latent norms too; routing (the router's scores, the permutation) as
        # the fused model has it.
        eager = EAGER[element]
        rotary = (model.heads * model.qk_rope_head_dim / attention_tp + model.qk_rope_head_dim / split) \
            if model.latent_attention else (widths.q + kv) / attention_tp  # MLA: q's rope per head, k's one shared
        norms = (2 * h + ((model.q_lora_rank + model.kv_lora_rank) if model.latent_attention else 0)) / split
        forward_bytes = (norms * eager.norm_forward + h / split * eager.block_forward
                         + rotary * eager.rotary_forward + gate_width * eager.gate_forward + routing * element)
        backward_bytes = (norms * eager.norm_backward + h / split * eager.block_backward
                          + rotary * eager.rotary_backward + gate_width * eager.gate_backward + 2 * routing * element)
        other = tokens * (forward_bytes + experts_copied * element) / bandwidth
        backward_other = tokens * (backward_bytes + experts_copied * element) / bandwidth
    if precision.quantized:
        # Transformer Engine's FP8 linear layers quantize each GEMM's input in the forward and its output
        # gradient in the backward, each with one cast-transpose kernel that reads the 16-bit tensor and writes
        # the row-wise and the column-wise FP8 copies the GEMMs read (CAST_BYTES per element). fp8: delayed
        # scaling, TE's and Megatron's default recipe, the scale from the amax history, no extra pass. mxfp8:
        # MXFP8BlockScaling, each copy's scales (one byte per 32 elements along its rows, resp. columns) found
        # by the same kernel over its own block and written beside it. nvfp4: NVFP4BlockScaling, FP4 copies
        # with an E4M3 scale per 16 elements and an FP32 one per tensor, whose amax takes a pass of its own
        # first (the weight gradient's random Hadamard transform is applied in the same kernel). fp8 by its recipe
        # (`FP8_RECIPE_CAST_BYTES`: current scaling's amax pass, blockwise's tile scales). The weights' casts: once a
        # step under Transformer Engine's recipes (cached across microbatches, not here), every forward under
        # torchao's tensorwise (`FP8_WEIGHT_CAST_BYTES`); the GEMMs' reads (`gemm_bytes`) are the GEMMs'.
        # Under `gather = fp8` torchao's weights come gathered in FP8: only the backward's column-major copy
        # (`FP8_GATHERED_WEIGHT_BYTES`); Transformer Engine's recipes cast once a step either way.
        per_element = cast_bytes(work)
        gathered = work.fp8_gather and work.fp8_recipe is ir.Fp8Recipe.tensorwise
        other += (tokens * cast_in * per_element
                  + (0.0 if gathered else weights * FP8_WEIGHT_CAST_BYTES.get(work.fp8_recipe, 0.0))) / bandwidth
        backward_other += (tokens * cast_grad * per_element
                           + (weights * FP8_GATHERED_WEIGHT_BYTES if gathered else 0.0)) / bandwidth
    flops += attention_flops
    recompute, recompute_flops = 0.0, 0.0
    if work.recompute is ir.Recompute.full:
        recompute, recompute_flops = matmul + attention + other, flops
    elif work.recompute is ir.Recompute.selective:
        # what each of `recompute_modules` reruns of the forward, fused kernels' bytes at `element` each (FP8's casts
        # of a rerun GEMM's input not counted)
        Module, modules = ir.RecomputeModule, work.modules
        per_element = tokens * element / bandwidth
        if Module.core_attn in modules:
            recompute, recompute_flops = attention, attention_flops
        if Module.layernorm in modules:  # the norms that are modules of their own (cost.memory._module_terms)
            recompute += per_element * 2 * h / split * ((1 if model.latent_attention else 0)
                                                        + (1 if model.experts else 0))
        if Module.mla_up_proj in modules and model.latent_attention:  # the up-projections (their fused norms), rotary
            recompute += up_projections + per_element * (2 * (model.q_lora_rank + model.kv_lora_rank) / split
                                                         + 2 * model.heads * model.qk_rope_head_dim / tp)
            recompute_flops += up_flops
        if Module.mlp in modules and not model.experts:
            recompute += dense_matmul + per_element * mlp_elements
            recompute_flops += dense_flops
        if model.experts and Module.moe in modules:  # the router, experts, shared experts, routing copies
            recompute += router + experts_matmul + per_element * (experts_elements + routing + experts_copied)
            recompute_flops += 2.0 * tokens * h * model.experts \
                + 2.0 * rows * model.top_k * projections * h * ffn / expert_tp + shared_flops
        elif model.experts:
            if Module.moe_act in modules:
                recompute += per_element * activation_elements
            if Module.shared_experts in modules:
                recompute += shared + per_element * shared_elements
                recompute_flops += shared_flops
    elif work.recompute is ir.Recompute.selective_op:
        # runtime.recompute.keep_every_other_matmul: the backward reruns wk, wo and (SwiGLU) w3 and
        # everything outside the GEMMs (norms, rotary, the activation); the attention core, wq, wv,
        # w1 and w2 are kept. MoE blocks (refused by the interpreter) as if dense with top_k experts.
        width = ffn * (model.top_k if model.experts else 1) / tp
        if pairs and not model.latent_attention:  # the rerun GEMMs split as a rule places them (`_rerun_gemms`)
            recompute, recompute_flops = _rerun_gemms(pairs, tokens, h, kv, widths.o, ffn, gpt, tp, gemm, device,
                                                      precision)
            recompute += other
        else:
            recompute = gemm(tokens, kv / tp, h, device, precision) \
                + gemm(tokens, h, widths.o / tp, device, precision) + other
            recompute_flops = 2.0 * tokens * h * (kv + widths.o) / tp
            if not gpt:
                recompute += gemm(tokens, width, h, device, precision)
                recompute_flops += 2.0 * tokens * h * width
        if work.attention is ir.Attention.materialized:  # its s x s scores are not kept (cost.memory): it reruns
            recompute, recompute_flops = recompute + attention, recompute_flops + attention_flops
    backward_matmul = 2 * matmul + attention_backward + attention_backward_extra
    if model.experts:
        # Host-bound: the dropless dispatcher copies the tokens per expert to the host every MoE layer (a
        # device-to-host synchronisation), so the host cannot run ahead of the device across layers, and a layer
        # takes at least the time its host needs to issue its ops (no CUDA graph can capture the dropless part).
        host_forward, host_backward = (ops * HOST_SECONDS_PER_OP for ops in MOE_HOST_OPS)
        forward_wait = max(0.0, host_forward - (matmul + attention + other))
        other += forward_wait
        backward_other += max(0.0, host_backward - (backward_matmul + backward_other))
        if work.recompute is ir.Recompute.full:
            recompute += forward_wait
    # The experts' share of the above (Megatron-Core's `mlp` node: the routed experts and the shared ones), fused
    # kernels' bytes: their GEMMs, the activation (twice backward), the casts of their inputs and of their outputs'
    # gradients, the FP8 padding and the dispatcher's sorting copies.
    casting = cast_bytes(work) if precision.quantized else 0.0
    accumulate = accumulate_seconds(weights, work, precision, device)
    experts_accumulate = accumulate_seconds(experts_weights, work, precision, device)
    experts_forward = experts_matmul + tokens * ((experts_elements + experts_copied) * element
                                                 + experts_cast_in * casting) / bandwidth
    experts_input_grad = experts_matmul + tokens * ((2 * experts_elements + experts_copied) * element
                                                    + experts_cast_grad * casting) / bandwidth
    return LayerCompute(matmul + attention, other, backward_matmul, backward_other, recompute,
                        attention=attention, flops=flops, recompute_flops=recompute_flops,
                        experts_forward=experts_forward, experts_input_grad=experts_input_grad,
                        experts_weight_grad=experts_matmul + experts_accumulate, accumulate=accumulate)


def _rerun_gemms(pairs: dict[str, PairLayout], tokens: float, h: int, kv: int, o: int, ffn: int, gpt: bool, tp: int,
                 gemm, device: ir.DeviceType, precision: ir.Precision) -> tuple[float, float]:
    """(seconds, FLOPs) of the GEMMs `selective_op` reruns in a dense block a shard rule breaks a pair of
    (`runtime.recompute.keep_every_other_matmul`: wk, wo and SwiGLU's w3), each split over the tensor axis as its
    weight is (an intact pair's members as Megatron splits them)."""
    attention, mlp = pairs.get("attn"), pairs.get("mlp")
    members = [(kv, h, dict(attention.producers).get("wk") if attention else 0),
               (h, o, attention.consumer if attention else 1)]
    if not gpt:
        members.append((ffn, h, dict(mlp.producers).get("w3") if mlp else 0))
    seconds = flops = 0.0
    for out, features, dim in members:
        out, features = (out / tp, features) if dim == 0 else (out, features / tp) if dim == 1 else (out, features)
        seconds += gemm(tokens, out, features, device, precision)
        flops += 2.0 * tokens * out * features
    return seconds, flops


def _pair_gemms(pair: PairLayout, tokens: float, h: int, width: float, tp: int, gemm, device: ir.DeviceType,
                precision: ir.Precision) -> tuple[float, float, float]:
    """(seconds, forward FLOPs, weight elements on this rank) of an MLP whose pair a shard rule breaks
    (`ir.pairs.broken`): each producer [width, h] and the consumer [h, width] a GEMM of its own over all the tokens (the
    input gathered whole), split over the tensor axis along the dim its weight is (`PairLayout`), else whole."""
    seconds = flops = weights = 0.0
    for out, features, dim in [(width, h, d) for _, d in pair.producers] + [(h, width, pair.consumer)]:
        out, features = (out / tp, features) if dim == 0 else (out, features / tp) if dim == 1 else (out, features)
        seconds += gemm(tokens, out, features, device, precision)
        flops += 2.0 * tokens * out * features
        weights += out * features
    return seconds, flops, weights


def accumulate_bytes(train: ir.Training) -> int:
    """Bytes per weight element a weight-gradient GEMM reads and writes of the gradient it accumulates into: a plan
    that keeps 16-bit weights apart from the master copy (`param_dtype`) keeps their gradients in a buffer of their
    own at `grad_dtype` (Megatron-Core's `main_grad`, `ParamAndGradBuffer`), and each microbatch's weight-gradient
    GEMM adds its product into it in the GEMM's epilogue (Megatron-LM's `--gradient-accumulation-fusion`, on by
    default: Transformer Engine's `fuse_wgrad_accumulation`, megatron/core/transformer/custom_layers/
    transformer_engine.py:153 at f2e5db402c, and `wgrad_gemm_accum_fp32` for the output layer, core/tensor_parallel/
    layers.py:490-494 there), the buffer zeroed at the step's start: read and write, twice `grad_dtype`'s bytes. 0
    otherwise: the GEMM writes its output (the weights are the master copy, whose gradient autograd keeps)."""
    return 2 * train.grad_dtype.bytes if train.master_copy else 0


def accumulate_seconds(elements: float, work: Work, precision: ir.Precision, device: ir.DeviceType) -> float:
    """Seconds weight-gradient GEMMs over `elements` weight elements spend reading and writing the gradient buffer
    they accumulate into (`Work.accumulate` bytes each) beyond writing their output at `precision`'s GEMM bytes, as
    the GEMM model counts it (the roofline's sum: the GEMM knobs were measured on GEMMs that write their output)."""
    if not work.accumulate or elements <= 0:
        return 0.0
    return elements * max(0, work.accumulate - precision.gemm_bytes) / device.bandwidth


def rank_attention(widths, work: Work) -> tuple[float, float]:
    """(FLOPs, bytes) of one rank's attention core for one microbatch: Q·Kᵀ and P·V of its s/cp queries against all
    s keys over its heads, the full s x s counted (model FLOPs; the kernel's causal share is `causal_fraction`'s), and
    Q, K, V and O read or written once in 16 bits (fp8 and the block-scaled precisions keep attention 16-bit).
    `widths`: `ir.layers.attention_widths` of the model (MLA: q and k nope + rope wide per head, v and o v wide)."""
    seq_q = -(-work.seq // work.cp)
    flops = 2.0 * work.micro_batch * seq_q * work.seq * (widths.q + widths.o) / work.tp
    moved = work.micro_batch * (seq_q * (widths.q + widths.o) + work.seq * (widths.k + widths.v)) / work.tp \
        * work.precision.unquantized.bytes
    return flops, moved


def attention_core_seconds(flops: float, moved: float, causal: float, work: Work, device: ir.DeviceType,
                           efficiency: Efficiency, band: float = 1.0, seq: int = 0) -> tuple[float, float]:
    """(forward, backward) seconds of an attention core whose full s x s product is `flops`, moving `moved` bytes: the
    device's fused kernel at its stated speed (`Efficiency.attention_seconds`, the fraction `causal` executed) when the
    plan runs a flash core and the device states one, else a batched GEMM over the whole rectangle at the GEMM knob,
    its backward twice its forward like the GEMMs' (what the A100 fit absorbed). 16-bit whatever the precision.
    `band`: of the causal tiles, the share a sliding window leaves a flash kernel (`window_band`; 1 without one),
    taken off the GEMM-knob price in the same proportion; a materialized core computes the whole rectangle
    whatever the window (Megatron-LM's and Transformer Engine's unfused cores mask it: `materialized_attention_bytes`).
    `seq`: the keys each query runs over, for the device's `attention_by_sequence` (0: its figures as stated)."""
    precision = work.precision.unquantized
    flash = work.attention is ir.Attention.flash
    fused = efficiency.attention_seconds(flops, moved, causal * band, device, precision, seq) if flash else None
    if fused is not None:
        return fused
    forward = efficiency.kernel(flops * band if flash else flops, moved, device, precision)
    return forward, 2 * forward


FLASH_TILE = 128
"""Queries and keys per tile of the fused attention kernels (FlashAttention-2 and -3, cuDNN, head dim 128): under a
causal mask a tile is computed when any of its pairs is unmasked."""


def causal_fraction(seq: int) -> float:
    """Fraction of one rank's `seq / cp` x `seq` query-key products a tiled kernel executes under a causal mask: of
    the whole sequence's n x n tiles (n = seq / FLASH_TILE) those on and below the diagonal, n(n + 1)/2, dealt evenly
    over the `cp` ranks (Megatron's and torch's load-balanced chunks give every rank the same share of the triangle),
    so a rank executes n(n + 1) / 2cp of its n²/cp tiles: (n + 1) / 2n, whatever `cp` is. Every transformer of the
    language is a causal decoder."""
    tiles = max(1, -(-seq // FLASH_TILE))
    return (tiles + 1) / (2 * tiles)


def window_band(seq: int, window: int) -> float:
    """Of the causal tiles `causal_fraction` counts, the share a tiled kernel executes under a sliding window of
    `window` keys (a query attends to itself and the window - 1 before it): with n = seq / FLASH_TILE tiles a side,
    a query tile reaches r = ceil((window - 1) / FLASH_TILE) key tiles below its diagonal one (the tile r below holds
    a pair within the window, r + 1 below none), so the band holds r(r + 1)/2 + (n - r)(r + 1) tiles of the
    triangle's n(n + 1)/2, dealt evenly over the context ranks as the triangle is (Transformer Engine's and
    FlashAttention's kernels skip a tile the window masks whole). 1 without a window or with one that reaches every
    tile: GPT-OSS's 128 keys at 4,096 tokens execute 63 of 528 tiles."""
    tiles = max(1, -(-seq // FLASH_TILE))
    reach = -(-(window - 1) // FLASH_TILE) if window else tiles
    if reach >= tiles - 1:
        return 1.0
    return (reach * (reach + 1) / 2 + (tiles - reach) * (reach + 1)) / (tiles * (tiles + 1) / 2)


@dataclass(frozen=True, slots=True)
class OverlapGemm:
    """A GEMM beside a tensor-parallel collective under `with overlap`: its forward seconds whole, and split
    along the tokens into `chunks` GEMMs, as the decomposition runs it (one sub-GEMM per chunk of the
    collective: Wang et al. 2022; torch's async TP; Transformer Engine's ring exchange, `num_splits` = tp, or its
    pipelined reduce-scatter, 4); `chunked` includes what an SM margin costs (userbuffers' `set_sm_margin`: the
    chunks on the SMs its communication leaves, for their whole length); `reduction`: the seconds of the kernel
    that then sums the `chunks` partial outputs a reduce-scatter's chunks bring (torch's
    `fused_matmul_reduce_scatter` ends with `torch.sum` over them: it reads the block's [tokens, hidden] partial
    sums and writes this rank's 1/chunks of them); `share`: what the communication's kernel takes of the device
    while a chunk runs beside it without a margin (`cost.comm.beside`)."""

    whole: float
    chunked: float
    chunks: int
    reduction: float = 0.0
    share: float = 0.0


CHUNK_STREAMS = 2
"""Streams torch's async TP deals a decomposed GEMM's chunks to (`_pipelined_all_gather_and_consume`,
`_pipelined_produce_and_all2all`: "computation/computation overlapping ... greatly reducing quantization
inefficiency"): a chunk's last partial wave runs beside the next chunk's first."""


UB_STREAMS = 3
"""Compute streams Transformer Engine's userbuffers deals a split GEMM's chunks to (`_NUM_MAX_UB_STREAMS`,
transformer_engine/pytorch/cpp_extensions/gemm.py; `_stream_compute[i % size]` in comm_gemm_overlap.cpp)."""
UB_PIPELINE_SPLITS = 4
"""Chunks of userbuffers' pipelined reduce-scatter (`num_splits` 4 for the `pipeline` method, `initialize_ub`'s
default; its ring exchanges split into tp)."""
UB_COMM_SMS = 16
"""SMs userbuffers' pipelined and bulk overlaps take for their communication (`num_sm` 16, `initialize_ub`'s default
in TE 1.x and 2.x alike: proj_fprop and fc2_fprop `pipeline`; qkv_dgrad, qkv_wgrad, fc1_dgrad, fc1_wgrad `bulk`;
its ring exchanges move their chunks with the copy engines, `use_ce`, on 1 SM and no margin)."""


FLEX_DISPATCHER_SMS = {"deepep": 20, "hybridep": 16}
"""SMs Megatron-Core gives the flex dispatcher's kernels by default (`moe_deepep_num_sms`, DeepEP's
`Buffer.set_num_sms`; `moe_hybridep_num_sms`; Megatron-Bridge's performance scripts raise HybridEP's to 32 where they
run it without overlap); the alltoall dispatcher's NCCL all-to-all takes NCCL's channels (the device's `comm_share`)."""


def dispatcher_share(device: ir.DeviceType, dispatcher: str) -> float:
    """The fraction of `device` an expert dispatcher's all-to-all kernels take from the computation they overlap: the
    flex dispatcher's SMs (`FLEX_DISPATCHER_SMS`) of the device's `sms` when it states them, else that many of NCCL's
    24 channels' `comm_share`; the alltoall dispatcher's NCCL all-to-all, `comm_share`."""
    sms = FLEX_DISPATCHER_SMS.get(dispatcher)
    if sms is None:
        return device.contention
    if device.sms is not None:
        return ir.sm_share(sms, device.sms)
    return device.contention * sms / ir.NCCL_CHANNELS


def userbuffers_share(device: ir.DeviceType) -> float:
    """The fraction of `device` userbuffers' 16 communication SMs are: of its `sms` when it states them (16/132 of an
    H100, 16/148 of a B200), else 16/24 of its `comm_share` (NCCL's 24 channels, `ir.NCCL_CHANNELS`, over its SMs:
    docs/cost-model.md, "Compute beside a collective")."""
    if device.sms is not None:
        return ir.sm_share(UB_COMM_SMS, device.sms)
    return device.contention * UB_COMM_SMS / ir.NCCL_CHANNELS


def overlap_gemms(model: ir.TransformerModel, work: Work, device: ir.DeviceType,
                  efficiency: Efficiency | None = None, backward: bool = False) -> tuple[OverlapGemm, ...]:
    """The GEMMs of a block beside its sequence-parallel all-gathers and reduce-scatters, in the order
    (attention's column-parallel input, attention's row-parallel output, the MLP's column-parallel input, the MLP's
    row-parallel output): the fused q/k/v, wo, fc1 (w1 and w3 as one GEMM, as torch's pass fuses one all-gather
    with every GEMM that reads it) and fc2. A block with experts has only the first two (the MoE dispatcher's
    collectives are no linear layer's); multi-head latent attention none.

    As `work.tensor_overlap` runs them: torch's async TP splits each into tp chunks on two streams
    (`CHUNK_STREAMS`) and sums a reduce-scatter's chunks after them; Transformer Engine's userbuffers ring-exchanges
    the all-gathers in tp chunks on three streams (`UB_STREAMS`) and pipelines the forward's reduce-scatters in
    `UB_PIPELINE_SPLITS` chunks whose communication kernel sums them on `UB_COMM_SMS` SMs, set as a margin on the
    GEMM (`work.sm_margin`: every chunk on the SMs left, 116 of an H100's 132) or taken beside it (`share`).
    `backward`: the row-parallel GEMMs as their input gradients run beside the output gradient's all-gather, which
    has nothing to sum (async TP's `fused_all_gather_matmul`; userbuffers' ring exchange, `proj_dgrad` and
    `fc2_dgrad`)."""
    efficiency = efficiency or device_efficiency(device)
    if model.latent_attention:
        return ()
    tokens, tp, precision, h = work.tokens, work.tp, work.precision, model.hidden
    widths = attention_widths(model)
    shapes = [((widths.q + widths.k + widths.v) / tp, h), (h, widths.o / tp)]
    if not model.experts:
        projections = 3 if model.kind != "gpt" else 2
        shapes += [((projections - 1) * model.ffn_hidden / tp, h), (h, model.ffn_hidden / tp)]
    gemm = efficiency.gemm_seconds
    reduction = tokens * h * precision.unquantized.bytes * (1 + 1 / tp) / device.bandwidth
    chunked = efficiency.chunked_gemm_seconds
    if work.tensor_overlap is not ir.TensorOverlap.userbuffers:
        # the row-parallel GEMMs (wo, fc2: the odd entries) feed a reduce-scatter in the forward; by position, not
        # by `features != h`, which a GPT's fc2 at tp = 4 (ffn / tp = h) would fail
        return tuple(OverlapGemm(gemm(tokens, out, features, device, precision),
                                 chunked(tokens, out, features, device, precision, tp, CHUNK_STREAMS), tp,
                                 reduction if index % 2 and not backward else 0.0)
                     for index, (out, features) in enumerate(shapes))
    share = userbuffers_share(device)
    gemms = []
    for index, (out, features) in enumerate(shapes):
        whole = gemm(tokens, out, features, device, precision)
        if index % 2 == 0 or backward:  # a ring exchange: tp chunks on the copy engines, no SMs taken
            gemms.append(OverlapGemm(whole, chunked(tokens, out, features, device, precision, tp, UB_STREAMS), tp))
            continue
        # `split_overlap_rs` splits the output's features (`m_chunk = m / num_splits`), each chunk re-reading the input
        split = chunked(out, tokens, features, device, precision, UB_PIPELINE_SPLITS, UB_STREAMS)
        gemms.append(OverlapGemm(whole, split / (1 - share), UB_PIPELINE_SPLITS) if work.sm_margin else
                     OverlapGemm(whole, split, UB_PIPELINE_SPLITS, share=share))
    return tuple(gemms)


def estimate_optimizer_step(local_params: float, device: ir.DeviceType, optimizer: ir.Optimizer,
                            precision: ir.Precision, states: StateBytes = FP32_STATES) -> float:
    """Seconds of the optimizer step over the `local_params` a device updates (after ZeRO).

    Element-wise and memory bound: read and write every optimizer state (ZeRO's K bytes per
    parameter, Rajbhandari et al. 2020, Sec. 3.1), read the gradient, read and write the parameter,
    at the plan's dtypes (`cost.memory.StateBytes`; fp32 by default whatever `precision` is). For fp32
    Adam that is 28 bytes per parameter, as Megatron's layout reads and writes (2·12 + 2 + 2).
    """
    per_param = 2 * states.optimizer(optimizer) + states.grads + 2 * states.params
    return local_params * per_param / device.bandwidth


__all__ = ["cast_bytes", "Efficiency", "DEFAULT_EFFICIENCY", "device_efficiency", "Work", "LayerCompute", "estimate_layer_compute",
           "mtp_projection_compute",
           "OverlapGemm", "reruns_core", "overlap_gemms", "userbuffers_share", "dispatcher_share",
           "rank_attention", "attention_core_seconds", "accumulate_bytes", "accumulate_seconds", "causal_fraction",
           "window_band",
           "estimate_optimizer_step", "peak_of"]
