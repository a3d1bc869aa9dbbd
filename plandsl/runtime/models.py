"""Reference torch modules for the plan's model families, named exactly as `plandsl.ir.layers` lists them.

Stage: interpreter. Contract: `build_model(plan.model, seed)` returns the full model, initialised from
`seed` alone (never from the layout), with the top-level parts `embed`, `layers` (a ModuleDict keyed
"0".."n-1"), `norm`, `head`; `forward` skips parts set to None, so a pipeline stage may drop them.
`build_meta_model(plan.model)` returns the same model with its parameters on the meta device (a built-in family's,
or a Hugging Face model's: `torch_model.build_meta`) and `materialize(part, plan.model, seed, device)` fills a
(parallelized) part of it with exactly `build_model`'s values (`plandsl run`'s ranks).
"""
from __future__ import annotations

import functools
import hashlib
import importlib
import itertools
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch._guards import detect_fake_mode
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from plandsl import ir
from plandsl.ir.layers import block_model, mtp_block
from plandsl.runtime.discard import DiscardedOutput, discard_after
from plandsl.runtime.loss import vocab_cross_entropy

INIT_STD = 0.02  # GPT-2 (Radford et al. 2019); residual projections get INIT_STD / sqrt(2 * layers)
MTP_LOSS_WEIGHT = 0.1
"""Multi-token prediction's losses weigh this much, shared by the depths: megatron-core 0.16.1's default
`mtp_loss_scaling_factor` (transformer_config.py:55), which Megatron-Bridge's DeepSeek-V3 recipes keep (deepseek_v3.py:
mtp_loss_scaling_factor 0.1), each depth's loss times it / mtp (gpt_model.py:653)."""
ROPE_THETA = 10_000.0  # Su et al. 2021, as in Llama


# ---- building blocks ------------------------------------------------------------------
# RMSNorm and SwiGLU's gate keep for their backward what fused kernels keep (the input and the
# per-token rstd; the two projections' outputs), not every intermediate eager autograd would: what
# the memory model counts (cost.memory, Korthikanti et al. 2022; tests/unit/test_recompute.py).
def _wide(t: torch.Tensor) -> torch.Tensor:
    """16-bit tensors in fp32; wider ones as they are."""
    return t.float() if t.dtype in (torch.bfloat16, torch.float16) else t


class _RMSNorm(torch.autograd.Function):
    """(x · rsqrt(mean(x²) + eps)) in at least fp32, cast back to x's dtype, times the weight.

    The backward allocates at most two fp32 tensors of x's shape at once (4 x's bytes for a 16-bit x; spelling the
    formula out took 8: 8 GiB for Llama 3.1 405B's [4, 8192, 16384] bf16 stream): x·rstd is never kept in fp32 (the
    mixed-dtype products widen x as they read it), and the fp32 gradient is built in place."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rstd = torch.rsqrt(_wide(x).pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return (_wide(x) * rstd).type_as(x) * weight

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        product = (x * rstd).to(x.dtype)  # the forward's normed input in x's dtype (a fresh tensor either way)
        grad_weight = product.mul_(grad)
        if grad.ndim > 1:  # summed over every token
            grad_weight = grad_weight.sum(dim=tuple(range(grad.ndim - 1)))
        del product
        # with normed = x·rstd: grad_x = rstd · (g - normed · mean(g · normed)), g = grad · weight in at least fp32
        grad_normed = _wide(grad * weight)  # a fresh tensor: built in place from here on
        dot = (grad_normed * x).mean(-1, keepdim=True).mul_(rstd)  # mean(g · normed), one number per token
        grad_normed.addcmul_(x, dot.mul_(rstd), value=-1).mul_(rstd)
        return grad_normed.to(x.dtype), grad_weight, None


class _SwiGLU(torch.autograd.Function):
    """silu(a) · b (Shazeer 2020), silu recomputed in the backward from a.

    The backward is eager autograd's (`mul`'s backward, then `silu_backward`, whose CPU and CUDA kernels compute in
    at least fp32 and return a's dtype), with both products written in place: it allocates the two gradients alone,
    tensors of the inputs' dtype (2 a's bytes; eager autograd allocates 3, beside the silu(a) it keeps). In fp16 the
    order is silu_backward(grad, a) · b (the same two tensors): grad · b overflows fp16's 65504 under a loss scale
    where the gradient itself fits (silu' is within [-0.1, 1.1]). Widening the operands to fp32
    and spelling the derivative out allocated 12 a's bytes at once, fp32 temporaries of a's shape: 4.9 GiB for
    Llama 3.1 405B's [4, 8192, 6656] bf16 under TP 8 (tests/unit/test_recompute.py measures it)."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        return F.silu(a) * b

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        a, b = ctx.saved_tensors
        grad_b = F.silu(a).mul_(grad)
        if a.dtype == torch.float16:  # grad·b overflows fp16 (65504) where grad·b·silu'(a) does not: a scaled loss's
            grad_a = torch.ops.aten.silu_backward(grad.to(a.dtype), a).mul_(b)  # silu' <= 1.1: the same two tensors
            return grad_a, grad_b.to(b.dtype)
        grad_a = (grad * b).to(a.dtype)
        torch.ops.aten.silu_backward.grad_input(grad_a, a, grad_input=grad_a)  # in place: the kernel is elementwise
        return grad_a, grad_b.to(b.dtype)


def swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _SwiGLU.apply(a, b)


# The norms return their input's dtype, so a 16-bit residual stream stays 16-bit (`runtime.precision.keep_stream`):
# the weights are cast to it, as 16-bit weights (Megatron-LM's, torchtitan's gathered ones) would be, and the
# statistics are computed in fp32 (the kernels' accumulation; `_RMSNorm`'s `_wide`). With fp32 inputs and weights
# every cast is a no-op.
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNorm.apply(x, self.weight.to(x.dtype), self.eps)


class LayerNorm(nn.LayerNorm):
    """torch's LayerNorm in its input's dtype. autocast is left out of it: on CUDA it runs layer_norm in fp32,
    returning fp32 and saving a widened copy of the input; on the CPU it keeps the input's dtype already."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = None if self.weight is None else self.weight.to(x.dtype)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        device = x.device.type
        if device == "meta" or not torch.is_autocast_enabled(device):
            return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps)
        with torch.autocast(device, enabled=False):
            return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps)


def rotary(x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Rotary position embedding of x [batch, seq, heads, head_dim] (pairs of halves, as in GPT-NeoX);
    `positions` are the tokens' positions in the sequence (None: 0, 1, ...). In this layout the
    attention core's output, transposed back to [batch, seq, hidden], needs no copy."""
    seq, head_dim = x.shape[1], x.shape[-1]
    inverse = 1.0 / (ROPE_THETA ** (torch.arange(0, head_dim, 2, device=x.device, dtype=torch.float32) / head_dim))
    positions = torch.arange(seq, device=x.device) if positions is None else positions
    angles = torch.outer(positions.to(torch.float32), inverse)[:, None, :]  # [seq, 1 (heads), head_dim / 2]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    first, second = x[..., : head_dim // 2], x[..., head_dim // 2:]
    return torch.cat((first * cos - second * sin, first * sin + second * cos), dim=-1)


class KeyProjection(nn.Linear):
    """wk. A key bias b adds q·b to every score of a query, which softmax cancels: it changes nothing and
    its gradient is zero. Computed, that zero is rounding noise that Adam scales up to lr-sized steps
    that differ between layouts; `0 * b` keeps the parameter (GPT-2 has it) with the exact gradient, 0."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)
        return out if self.bias is None else out + (0 * self.bias).to(out.dtype)  # autocast keeps k in 16 bits


def attention_mask(queries: torch.Tensor, keys: torch.Tensor, window: int = 0) -> torch.Tensor:
    """[queries, keys] booleans, True where a query attends to a key, from their positions in the sequence: causal,
    and with a `window` only the `window - 1` keys before the query and itself (Hugging Face's `sliding_window`;
    Megatron-Core's window_size (window - 1, 0))."""
    allowed = keys[None, :] <= queries[:, None]
    return allowed & (queries[:, None] - keys[None, :] < window) if window else allowed


def with_sink(mask: torch.Tensor) -> torch.Tensor:
    """`mask` with one more key every query attends to: the sink `attend` appends."""
    return torch.cat((mask, mask.new_ones(mask.shape[0], 1)), dim=-1)


@functools.lru_cache(maxsize=32)
def band_mask(seq: int, window: int, sink: bool, device: torch.device) -> torch.Tensor:
    """The mask of a sequence's own positions (`attention_mask`, `with_sink` for sinks), one tensor per length,
    window and device that every block and microbatch shares (each SDPA call keeps it for its backward)."""
    positions = torch.arange(seq, device=device)
    mask = attention_mask(positions, positions, window if window < seq else 0)
    return with_sink(mask) if sink else mask


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q kᵀ / √d, masked) v through SDPA (`mask` None: causal over equal lengths; with `sinks`, its last
    column the sink's, `with_sink`). `sinks` (one logit per local head, GPT-OSS's attention sinks) join each query's
    softmax denominator and take no value: as a key with a zero value that every query attends to, scoring sink[h]
    for head h, written as one more head dim (q's holds sink[h]·√d, every real key's 0, the sink key's 1), so SDPA's
    kernel runs it and autograd reaches the sinks; their softmax mass is what GPT-OSS's eager_attention_forward
    drops after its softmax over [scores, sink]."""
    gqa = k.shape[1] != q.shape[1]
    if sinks is None:
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    batch, heads, seq, dim = q.shape
    scale = 1.0 / math.sqrt(dim)
    column = (sinks.to(q.dtype) / scale).view(1, heads, 1, 1).expand(batch, heads, seq, 1)
    q = torch.cat((q, column), dim=-1)
    sink_key = torch.cat((k.new_zeros(*k.shape[:2], 1, dim), k.new_ones(*k.shape[:2], 1, 1)), dim=-1)
    k = torch.cat((F.pad(k, (0, 1)), sink_key), dim=2)
    v = torch.cat((v, v.new_zeros(*v.shape[:2], 1, v.shape[-1])), dim=2)
    if mask is None:
        mask = band_mask(seq, 0, True, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


class AttentionCore(nn.Module):
    """softmax(q kᵀ / √d + causal mask) v on [batch, heads, seq, head_dim] tensors, k and v with fewer
    heads under grouped-query attention (SDPA's `enable_gqa`: the kernel reads each kv head for its
    group of q heads, nothing widened is stored); with a `window`, the banded causal mask (`attention_mask`),
    and the block's attention `sinks` when it has them (`attend`). No parameters: `selective` recomputation wraps
    exactly this (Korthikanti et al. 2022's attention core), and context parallelism replaces it
    (plandsl.runtime.parallel.context_parallel)."""

    def __init__(self, window: int = 0):
        super().__init__()
        self.window = window

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        seq = q.shape[2]
        banded = self.window and self.window < seq  # a window as long as the sequence bands nothing
        mask = band_mask(seq, self.window, sinks is not None, q.device) if banded or sinks is not None else None
        return attend(q, k, v, mask, sinks)


def local_sinks(sinks: nn.Parameter | None) -> torch.Tensor | None:
    """This rank's attention sinks: tensor parallelism shards them by heads, as it does wq's outputs."""
    return sinks.to_local() if sinks is not None and hasattr(sinks, "to_local") else sinks


class Attention(nn.Module):
    """Causal self-attention; head counts are read from the (possibly tensor-parallel) local widths.
    `positions` are those of the tokens fed (None: 0, 1, ...; context parallelism sets the rank's)."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, bias: bool, rope: bool, head_dim: int = 0,
                 window: int = 0, sinks: bool = False):
        super().__init__()
        # The shapes the checker requires (plandsl.check.model); a module built around them would fail at
        # its first forward, or (an odd rotary head dim of 1 or 3) silently compute something else.
        self.head_dim = head_dim or hidden // heads  # `head_dim` apart from hidden / heads (Qwen3, GPT-OSS)
        if (hidden % heads and not head_dim) or heads % kv_heads or (rope and self.head_dim % 2):
            raise ValueError(f"attention with hidden {hidden}, heads {heads}, kv_heads {kv_heads}"
                             f"{' and rotary positions' if rope else ''} cannot run (E220-E222)")
        self.rope = rope
        kv = kv_heads * self.head_dim
        self.wq = nn.Linear(hidden, heads * self.head_dim, bias=bias)
        self.wk = KeyProjection(hidden, kv, bias=bias)
        self.wv = nn.Linear(hidden, kv, bias=bias)
        self.wo = nn.Linear(heads * self.head_dim, hidden, bias=bias)
        self.sinks = nn.Parameter(torch.empty(heads)) if sinks else None  # GPT-OSS's per-head sink logits
        self.window = window  # context parallelism's core bands its mask by it
        self.core = AttentionCore(window)
        self.positions: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq = x.shape[0], x.shape[1]
        q, k, v = (w(x).view(batch, seq, -1, self.head_dim) for w in (self.wq, self.wk, self.wv))
        if self.rope:
            q, k = rotary(q, self.positions), rotary(k, self.positions)
        out = self._core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The core, given the sinks only when the block has them (a core replaced by context parallelism or
        wrapped for recomputation takes them as a fourth argument)."""
        sinks = local_sinks(self.sinks)
        return self.core(q, k, v) if sinks is None else self.core(q, k, v, sinks)


class LatentAttention(Attention):
    """Multi-head latent attention (DeepSeek-AI 2024, arXiv:2405.04434, Sec. 2.1; Hugging Face's
    DeepseekV3Attention): q = wq_b(q_norm(wq_a x)) (or wq x), each head's (nope + rope) wide; the key/value
    latent and one rotary key part for all heads from wkv_a, each head's keys (nope) and values from
    wkv_b(kv_norm(latent)); rotary positions on the rope parts only; wo reads heads x v_head_dim. The same
    core and positions as `Attention` (recomputation and context parallelism replace them alike); head
    counts are read from the local widths, so tensor parallelism splits wq_b (wq), wkv_b and wo by heads and
    leaves the latents whole, with `reduce_rope_key` summing the shared rotary key's gradient over the
    tensor axis (each rank's heads use it)."""

    def __init__(self, model: ir.TransformerModel):
        nn.Module.__init__(self)
        if model.qk_rope_head_dim % 2 or model.kv_heads != model.heads:
            raise ValueError(f"latent attention with qk_rope_head_dim {model.qk_rope_head_dim} and kv_heads "
                             f"{model.kv_heads} of {model.heads} heads cannot run (E222, E227)")
        hidden, heads = model.hidden, model.heads
        self.nope, self.rope, self.v_dim = model.qk_nope_head_dim, model.qk_rope_head_dim, model.v_head_dim
        self.lora = model.kv_lora_rank
        qk = self.nope + self.rope
        if model.q_lora_rank:
            self.wq_a = nn.Linear(hidden, model.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(model.q_lora_rank)
            self.wq_b = nn.Linear(model.q_lora_rank, heads * qk, bias=False)
        else:
            self.wq = nn.Linear(hidden, heads * qk, bias=False)
        self.wkv_a = nn.Linear(hidden, model.kv_lora_rank + self.rope, bias=False)
        self.kv_norm = RMSNorm(model.kv_lora_rank)
        self.wkv_b = nn.Linear(model.kv_lora_rank, heads * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(heads * self.v_dim, hidden, bias=False)
        self.sinks = nn.Parameter(torch.empty(heads)) if model.sinks else None
        self.window = model.window
        self.core = AttentionCore(model.window)
        self.positions: torch.Tensor | None = None
        self.reduce_rope_key = None  # tensor parallelism: the shared rotary key's gradient, summed over the axis
        self.rerun_up = False  # `recompute_modules: [mla_up_proj]`: Q, K, V freed after the core, rebuilt in backward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq = x.shape[0], x.shape[1]
        q_latent = self.wq_a(x) if hasattr(self, "wq_a") else x
        latent, k_rope = self.wkv_a(x).split((self.lora, self.rope), dim=-1)
        if self.rerun_up:  # megatron-core's qkv_up_checkpoint around qkv_up_proj_and_rope_apply
            up = DiscardedOutput(self._queries_keys_values)
            q, k, v = up(q_latent, latent, k_rope)
            out = self._core(q, k, v)
            up.discard(out)
        else:
            out = self._core(*self._queries_keys_values(q_latent, latent, k_rope))
        return self.wo(out[..., : self.v_dim].transpose(1, 2).reshape(batch, seq, -1))

    def _queries_keys_values(self, q_latent: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor):
        """The up-projections (after their latents' norms) and the rotary parts: Q, K, V [batch, heads, seq, width]."""
        batch, seq = latent.shape[0], latent.shape[1]
        queries = self.wq_b(self.q_norm(q_latent)) if hasattr(self, "wq_a") else self.wq(q_latent)
        q = queries.view(batch, seq, -1, self.nope + self.rope)
        q_nope, q_rope = q.split((self.nope, self.rope), dim=-1)
        kv = self.wkv_b(self.kv_norm(latent)).view(batch, seq, -1, self.nope + self.v_dim)
        k_nope, v = kv.split((self.nope, self.v_dim), dim=-1)
        q_rope, k_rope = rotary(q_rope, self.positions), rotary(k_rope.view(batch, seq, 1, self.rope), self.positions)
        if self.reduce_rope_key is not None:
            k_rope = self.reduce_rope_key(k_rope)
        q = torch.cat((q_nope, q_rope), dim=-1)
        k = torch.cat((k_nope, k_rope.expand(-1, -1, k_nope.shape[2], -1)), dim=-1)
        # Values padded with zeros to the query/key head width (a copy of v either way, so wkv_b's output, k_nope
        # with it, is not kept): fused attention kernels take one head size (softmax(q kᵀ) [v, 0] = [o, 0])
        width = self.nope + self.rope
        v = F.pad(v, (0, width - self.v_dim)) if width > self.v_dim else v.contiguous()
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


class MLP(nn.Module):
    """gpt: w2(gelu(w1 x)); llama: SwiGLU w2(silu(w1 x) * w3 x)."""

    def __init__(self, hidden: int, ffn: int, gated: bool, bias: bool):
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn, bias=bias)
        self.w2 = nn.Linear(ffn, hidden, bias=bias)
        self.w3 = nn.Linear(hidden, ffn, bias=False) if gated else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w3 is None:
            return self.w2(F.gelu(self.w1(x)))
        return self.w2(swiglu(self.w1(x), self.w3(x)))


class Experts(nn.Module):
    """Grouped expert weights, one [experts, out, in] tensor per projection (under expert parallelism
    each rank holds a contiguous range of experts, as DTensor shards of dim 0)."""

    def __init__(self, experts: int, hidden: int, ffn: int, gated: bool):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(experts, ffn, hidden))
        self.w2 = nn.Parameter(torch.empty(experts, hidden, ffn))
        self.w3 = nn.Parameter(torch.empty(experts, ffn, hidden)) if gated else None
        self.rerun_activation = False  # `recompute_modules: [moe_act]`

    def forward(self, routed: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """routed [tokens, hidden], grouped by expert: the first counts[0] rows go to expert 0, ..."""
        return expert_mlps(routed, counts, self.w1, self.w2, self.w3, self.rerun_activation)


def expert_mlps(routed: torch.Tensor, counts: list[int], w1: torch.Tensor, w2: torch.Tensor,
                w3: torch.Tensor | None, rerun_activation: bool = False) -> torch.Tensor:
    """Each expert's MLP (gpt: GELU, llama: SwiGLU) on its group of rows; weights are [experts, out, in].
    `rerun_activation`: the activation's output (w2's input) freed after w2 and rebuilt from w1's (and w3's) in the
    backward, as megatron-core's TEGroupedMLP under `moe_act` recomputation."""
    outputs = []
    for expert, rows in enumerate(routed.split(counts)):
        inputs = (rows @ w1[expert].t(),) if w3 is None else (rows @ w1[expert].t(), rows @ w3[expert].t())
        activation = DiscardedOutput(_activation) if rerun_activation else _activation
        output = activation(*inputs) @ w2[expert].t()
        if rerun_activation:
            activation.discard(output)
        outputs.append(output)
    return torch.cat(outputs)


def _activation(*inputs: torch.Tensor) -> torch.Tensor:
    """GELU of w1's output, or SwiGLU of w1's and w3's."""
    return F.gelu(inputs[0]) if len(inputs) == 1 else swiglu(*inputs)


def limit_groups(scores: torch.Tensor, top_k: int, groups: int, group_top_k: int) -> torch.Tensor:
    """Group-limited routing (`expert_groups`, `group_top_k`: DeepSeek-V2's device-limited, DeepSeek-V3's node-limited
    routing) as Megatron-Core's `group_limited_topk` does it: `scores` [tokens, experts] with the experts in `groups`
    equal groups of consecutive ones, each group scored by the sum of its best `top_k // group_top_k` scores, every
    expert outside a token's best `group_top_k` groups masked to -inf (its top_k then taken inside them). `scores`
    itself without groups."""
    if not groups:
        return scores
    tokens, experts = scores.shape
    grouped = scores.view(tokens, groups, experts // groups)
    best = grouped.topk(top_k // group_top_k, dim=-1).values.sum(dim=-1).topk(group_top_k, dim=-1).indices
    keep = torch.zeros(tokens, groups, dtype=torch.bool, device=scores.device).scatter_(1, best, True)
    return scores.masked_fill(~keep.repeat_interleave(experts // groups, dim=1), float("-inf"))


class MoE(nn.Module):
    """Top-k routing (softmax over the chosen logits, as Mixtral; top-1 the chosen expert's probability over all of
    them, as the Switch Transformer and Megatron-Core's --moe-router-pre-softmax: a softmax over one logit is 1, and
    its router would learn nothing), inside each token's best groups under group-limited routing (`limit_groups`:
    Megatron-Core's `topk_routing_with_score_function` with `num_groups`, `group_topk`), dropless: every token reaches
    its k experts. `dispatch` runs the experts on the rows grouped by expert; expert parallelism replaces it by an
    all-to-all exchange (plandsl.runtime.parallel.expert_parallel), routing and combining stay here."""

    def __init__(self, hidden: int, ffn: int, experts: int, top_k: int, gated: bool, shared: int = 0,
                 groups: int = 0, group_top_k: int = 0):
        super().__init__()
        if not 1 <= top_k <= experts:  # topk would fail, or (top_k = 0) route nothing (E223)
            raise ValueError(f"top_k ({top_k}) must be 1 to experts ({experts})")
        if groups and not (experts % groups == 0 and 1 <= group_top_k <= min(groups, top_k)
                           and group_top_k * (experts // groups) >= top_k):  # E235
            raise ValueError(f"cannot route top {top_k} of {experts} experts inside {group_top_k} of {groups} groups")
        self.top_k = top_k
        self.groups, self.group_top_k = groups, group_top_k
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = Experts(experts, hidden, ffn, gated)
        # DeepSeekMoE's shared experts, one MLP of shared x ffn every token runs through
        self.shared = MLP(hidden, shared * ffn, gated=gated, bias=False) if shared else None
        self.dispatch = None  # None: every expert is local; else (routed, counts, experts) -> outputs
        # Expert tensor parallelism (each rank computes its slice of every expert's FFN, a partial sum):
        # `sum_gradients` (Megatron's `f`: identity forward, gradient summed over the tensor axis) on what
        # meets the partial outputs, `sum_partial` (`g`: summed forward) on the combined output. None: whole.
        self.sum_gradients = None
        self.sum_partial = None
        # Experts folded over the tensor axis: (this rank's index, the ranks) of it; each routes its own share
        # of the tokens (consecutive rows), through the experts whole on the ep x tp ranks. None: every row.
        self.keep = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        scores = self.router(tokens)
        if self.top_k == 1:
            weights, chosen = limit_groups(scores.softmax(dim=-1, dtype=torch.float32), 1, self.groups,
                                           self.group_top_k).topk(1, dim=-1)
        else:
            logits, chosen = limit_groups(scores, self.top_k, self.groups, self.group_top_k).topk(self.top_k, dim=-1)
            weights = logits.softmax(dim=-1, dtype=torch.float32)  # in fp32, as megatron-core's router
        weights = weights.to(tokens.dtype)
        # The (token, slot) assignments sorted by expert; within an expert by token.
        order = chosen.flatten().argsort(stable=True)
        counts = chosen.flatten().bincount(minlength=self.router.out_features)
        rows = order // self.top_k
        weights, inputs = weights.flatten()[order, None], tokens
        if self.sum_gradients is not None:  # the router's own gradient path stays whole
            weights, inputs = self.sum_gradients(weights), self.sum_gradients(tokens)
        if self.keep is not None:  # this tensor rank's tokens only (the others route theirs)
            index, ranks = self.keep
            mine = rows * ranks // tokens.shape[0] == index
            rows, weights = rows[mine], weights[mine]
            counts = chosen.flatten()[order][mine].bincount(minlength=self.router.out_features)
        routed = inputs[rows]
        if self.dispatch is None:
            outputs = self.experts(routed, counts.tolist())
        else:
            outputs = self.dispatch(routed, counts, self.experts)
        # Each token's k outputs are added in expert order, whatever the layout.
        combined = torch.zeros_like(tokens).index_add(0, rows, weights * outputs)
        if self.sum_partial is not None:
            combined = self.sum_partial(combined)
        combined = combined.view_as(x)
        return combined if self.shared is None else combined + self.shared(x)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm1 x), then + mlp/moe(norm2 x); with `parallel_blocks`
    (GPT-NeoX's parallel residual) x + attn(norm1 x) + mlp/moe(norm2 x). `model` as the block sees it
    (`ir.layers.block_model`: a dense block of a mixture of experts is a dense model's, a full-attention block
    of a sliding-window pattern one without a window)."""

    def __init__(self, model: ir.TransformerModel):
        super().__init__()
        self.parallel = model.parallel_blocks
        gpt = model.kind == "gpt"
        norm = (lambda: LayerNorm(model.hidden)) if gpt else (lambda: RMSNorm(model.hidden))
        self.norm1 = norm()
        self.attn = LatentAttention(model) if model.latent_attention else \
            Attention(model.hidden, model.heads, model.kv_heads, bias=gpt, rope=not gpt, head_dim=model.head_dim,
                      window=model.window, sinks=model.sinks)
        self.norm2 = norm()
        if model.experts:
            self.moe = MoE(model.hidden, model.ffn_hidden, model.experts, model.top_k, gated=not gpt,
                           shared=model.shared_experts, groups=model.expert_groups, group_top_k=model.group_top_k)
        else:
            self.mlp = MLP(model.hidden, model.ffn_hidden, gated=not gpt, bias=gpt)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # `discard_after`: a norm run without its output (`recompute_modules: [layernorm]`) frees it once read
        ffn = self.moe if hasattr(self, "moe") else self.mlp
        if self.parallel:
            return x + discard_after(self.norm1, self.attn(self.norm1(x))) + \
                discard_after(self.norm2, ffn(self.norm2(x)))
        x = x + discard_after(self.norm1, self.attn(self.norm1(x)))
        return x + discard_after(self.norm2, ffn(self.norm2(x)))


class _Anchored(torch.autograd.Function):
    """`x` unchanged, its autograd node hung from `anchor` too, which takes no gradient from it. Multi-token
    prediction's embedding on a pipeline's last stage (`Transformer.loss_with_depths`) is anchored to the stage's
    output so that torch's split backward (I then W: `pipelining._backward.get_param_groups`, torch 2.13) finds its
    weight's gradient at each depth's embedding: unanchored, the weight's group starts at the depths' concatenations,
    and its W pass runs from depth 2's back through depth 1's hidden states (nodes the input gradient's graph owns,
    freed then: 'Trying to backward through the graph a second time')."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class MultiTokenPrediction(nn.Module):
    """One multi-token prediction depth (DeepSeek-AI 2024, arXiv:2412.19437, Sec. 2.2; megatron-core 0.16.1
    `MultiTokenPredictionLayer`, multi_token_prediction.py:642-821): the embeddings of the tokens k ahead and the
    previous depth's hidden states, each RMS-normalised (`enorm`, `hnorm`), concatenated in that order (:736-739),
    projected 2h -> h (`eh_proj`), through one block of the last block's kind (`ir.layers.mtp_block`) and the norm
    before the shared output layer (`norm`, :809-817), whose output is the next depth's hidden states."""

    def __init__(self, model: ir.TransformerModel):
        super().__init__()
        self.enorm, self.hnorm = RMSNorm(model.hidden), RMSNorm(model.hidden)
        self.eh_proj = nn.Linear(2 * model.hidden, model.hidden, bias=False)
        self.block = Block(mtp_block(model))
        self.norm = RMSNorm(model.hidden)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        x = self.eh_proj(torch.cat((self.enorm(embedded), self.hnorm(hidden)), dim=-1))
        return self.norm(self.block(x))


class Embedding(nn.Module):
    """Token embedding, plus learned absolute positions for gpt. `positions` are those of the tokens fed
    (None: 0, 1, ...; context parallelism sets the rank's)."""

    def __init__(self, vocab: int, hidden: int, seq: int | None):
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seq, hidden) if seq else None
        self.positions: torch.Tensor | None = None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok(tokens)
        if self.pos is not None:
            positions = self.positions
            if positions is None:
                positions = torch.arange(tokens.shape[1], device=tokens.device)
            h = h + self.pos(positions)
        return h


class Head(nn.Linear):
    """The output layer: hidden states -> logits; called with the targets too, the mean cross entropy of those
    logits computed chunk by chunk without holding them (`loss: fused`, `runtime.loss.vocab_cross_entropy`)."""

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None,
                kept: torch.Tensor | None = None) -> torch.Tensor:
        """`kept`: the positions of `x` the targets are for (None: the first `targets.shape[1]`; a depth's)."""
        if targets is None:
            return super().forward(x)
        return vocab_cross_entropy(x[:, :targets.shape[1]] if kept is None else x[:, kept], self.weight, targets)


# ---- whole models ---------------------------------------------------------------------
class Transformer(nn.Module):
    """Decoder-only transformer: tokens [batch, seq] -> logits [batch, seq, vocab] (with `loss_in_head`, the loss;
    on a pipeline's last stage, which gets no targets, the final hidden states, which the loss hands to `head`)."""

    def __init__(self, model: ir.TransformerModel):
        super().__init__()
        self.config = model
        self.embed = Embedding(model.vocab, model.hidden, model.seq if model.kind == "gpt" else None)
        # a mixture of experts' dense blocks (`dense_layers`, `moe_every`) are dense models' (`ir.layers.block_model`)
        self.layers = nn.ModuleDict({str(i): Block(block_model(model, i)) for i in range(model.layers)})
        self.norm = LayerNorm(model.hidden) if model.kind == "gpt" else RMSNorm(model.hidden)
        self.head = Head(model.hidden, model.vocab, bias=False)
        if model.tied_embeddings:
            self.head.weight = self.embed.tok.weight
        # multi-token prediction's depths (`mtp`): given the targets, the model returns the loss with theirs
        self.mtp = nn.ModuleDict({str(k): MultiTokenPrediction(model) for k in range(model.mtp)}) \
            if model.mtp else None
        self.loss_in_head = False  # `loss: fused` (runtime.loss.fused_loss): return the final hidden states
        # False on a pipeline's last stage that holds `embed` only for the depths (`pipeline.split_stage`): its
        # input is the previous stage's hidden states
        self.embeds_inputs = True
        # context parallelism (`context_parallel.apply_cp`): the positions of each sequence this rank holds, of `context`
        self.columns: torch.Tensor | None = None
        self.context = 1

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits; with `loss_in_head`, the final hidden states, or given `targets` the loss the head computes
        from them (inside this call, so a wrapper that gathers the parameters for it, FSDP's, holds them); with
        multi-token prediction, given `targets`, that loss and the depths' (`loss_with_depths`; under context
        parallelism `targets` are the whole rows of tokens and targets stacked, `runtime.loss.DepthsLoss.sample`, whose
        tokens k ahead the depths read), else the final hidden states (a pipeline's last stage: its loss function runs
        the depths, `runtime.loss.DepthsLoss`)."""
        # Each part may be None on a pipeline stage that does not hold it (as in torchtitan).
        h = self.embed(x) if self.embed is not None and self.embeds_inputs else x
        for block in self.layers.values():
            h = block(h)
        h = self.norm(h) if self.norm is not None else h
        if self.mtp is not None and targets is not None:
            tokens, targets = targets.unbind(1) if targets.dim() == 3 else (x, targets)
            return self.loss_with_depths(tokens, h, targets)
        if self.head is None or (targets is None and (self.loss_in_head or self.mtp is not None)):
            return h
        return self.head(h, targets) if self.loss_in_head else self.head(h)

    def _loss(self, h: torch.Tensor, targets: torch.Tensor, kept: torch.Tensor | None = None) -> torch.Tensor:
        """The mean cross entropy over the positions `kept` of `h` (None: the first `targets.shape[1]`; a depth's
        positions past the end have no target)."""
        if self.loss_in_head:
            return self.head(h, targets, kept)
        logits = self.head(h)
        if kept is not None and isinstance(logits, DTensor):  # split over the vocabulary (loss parallel): the
            # positions picked on every rank alike, a replicated index (DTensor takes no plain one beside its own)
            kept = DTensor.from_local(kept, logits.device_mesh, [Replicate()] * logits.device_mesh.ndim,
                                      run_check=False)
        return loss_fn(logits[:, :targets.shape[1]] if kept is None else logits[:, kept], targets)

    def _depth_loss(self, h: torch.Tensor, targets: torch.Tensor, k: int) -> torch.Tensor:
        """Depth k's mean cross entropy over the positions that have a target k ahead (below seq - k). Under context
        parallelism, of this rank's such positions, weighed by their share of them times the axis's ranks, so that
        the mean over the axis (the data-parallel mean, `ir.Plan.reduce_axes`) is the sequence's; a rank without
        any still runs the head on one position, weighed 0, so that every rank calls it as often (an FSDP group of
        its own gathers it on every rank of the data axes alike)."""
        seq = targets.shape[1]
        if self.columns is None:
            return self._loss(h, targets[:, k:])
        kept = (self.columns < seq - k).nonzero().squeeze(1)
        weight = len(kept) * self.context / (seq - k)
        if not len(kept):
            kept = kept.new_zeros(1)
        return weight * self._loss(h, targets[:, (self.columns[kept] + k) % seq], kept)

    def loss_with_depths(self, tokens: torch.Tensor, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean cross entropy of the next tokens plus MTP_LOSS_WEIGHT / mtp times each depth's: depth k (from 1)
        reads the tokens k ahead and predicts the targets k ahead, over the positions that have them. As megatron-core
        (gpt_model.py:611-660), each depth runs over the whole sequence, its tokens rolled by k, and its loss leaves
        out the last k positions, whose rolled tokens wrapped round: under causal attention the positions kept see
        none of those, and every rank of a sequence-parallel group keeps its shard of the same positions. `tokens` and
        `targets` are whole rows, `h` this rank's positions (`columns`: all of them but under context parallelism)."""
        if len(self.mtp) >= targets.shape[1]:  # rolled, the deepest would run on tokens wrapped round only (E234)
            raise ValueError(f"mtp={len(self.mtp)} on sequences of {targets.shape[1]} tokens: depth {len(self.mtp)} "
                             "has no target left to predict")
        columns = slice(None) if self.columns is None else self.columns  # context parallelism: this rank's
        loss = self._loss(h, targets[:, columns])
        trunk = h
        for k, depth in enumerate(self.mtp.values(), start=1):
            embedded = self.embed(tokens.roll(-k, dims=1)[:, columns])
            if not self.embeds_inputs:  # a pipeline's last stage, whose backward may be split in two (`_Anchored`)
                embedded = _Anchored.apply(embedded, trunk)
            h = depth(h, embedded)
            loss = loss + MTP_LOSS_WEIGHT / len(self.mtp) * self._depth_loss(h, targets, k)
        return loss

    def init_weights(self, seed: int) -> None:
        init_parameters_(self, self.config, seed)


class MLPNet(nn.Module):
    """`mlp(...)`: Linear layers with ReLU between them; inputs [batch, input] -> [batch, output]."""

    def __init__(self, model: ir.MLPModel):
        super().__init__()
        widths = [model.input] + [model.hidden] * (model.layers - 1) + [model.output]
        self.last = model.layers - 1  # the model's last layer (a pipeline stage holds only some of them)
        self.layers = nn.ModuleDict({str(i): nn.Linear(widths[i], widths[i + 1]) for i in range(model.layers)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for name, layer in self.layers.items():
            x = layer(x)
            x = F.relu(x) if int(name) != self.last else x
        return x

    def init_weights(self, seed: int) -> None:
        init_parameters_(self, None, seed)


# ---- initial values -------------------------------------------------------------------
# One function says each parameter's initial distribution, by its name in the full model (`init_spec`), and one
# rule where its numbers come from (`ParameterValues`): a parameter of fewer than LARGE elements from the model's one
# generator, seeded with the seed, in `named_parameters()` order; a larger one tile by tile, each TILE x TILE tile of
# its last two dims (a run of TILE * TILE elements of a vector) from a generator of its own, seeded with the seed, the
# parameter's name and the tile's place. `build_model` fills the full CPU model so; `materialize` draws a small
# parameter whole and a large one's tiles that the rank's part covers only, so a rank's work is its shards', and every
# layout starts from the same values.
LARGE = 1 << 20
"""Elements from which a parameter's values are drawn tile by tile (4 MiB of fp32: every weight matrix of a model
users train; the tests' tiny models draw from the one generator, as they always did)."""
TILE = 1024


def init_spec(config: ir.TransformerModel | None, name: str, shape: tuple[int, ...]) -> tuple[str, float]:
    """The initial distribution of the full parameter `name`, of `shape`, of a `Transformer` of `config` (None: of an
    `MLPNet`): ("zeros" | "ones" | "normal", std). Biases zero, norms' weights one; a Transformer's other weights
    normal with std INIT_STD (residual projections INIT_STD / sqrt(2 * layers), GPT-2's); an MLPNet's weights normal
    with std 1 / sqrt(in_features)."""
    if name.endswith("bias"):
        return "zeros", 0.0
    if config is None:  # an MLPNet's Linear weight [out, in]
        return "normal", 1.0 / math.sqrt(shape[1])
    if name.rsplit(".", 1)[-1] == "weight" and (".norm" in f".{name}" or name.rsplit(".", 2)[-2] in ("enorm", "hnorm")):
        return "ones", 0.0
    if name.endswith(("attn.wo.weight", "mlp.w2.weight", "experts.w2", "shared.w2.weight")):
        return "normal", INIT_STD / math.sqrt(2 * config.layers)
    return "normal", INIT_STD


def whole(shape) -> tuple[slice, ...]:
    """The block of a parameter of `shape` that is all of it (`ParameterValues.block`, `FullValues.block`)."""
    return tuple(slice(0, n) for n in shape)


class ParameterValues:
    """The initial values of one full parameter of a built-in family (the rule above), any block of them on demand:
    `block(slices)` is the block `slices` cut (one slice per dim), a CPU tensor in `dtype` (a view of a small
    parameter's values, a new tensor of a large one's). A small parameter's are drawn whole from `generator` when
    the object is made (its turn in the one stream); a large one's, tile by tile as a block asks, from the
    generators of the tiles it covers."""

    def __init__(self, config: ir.TransformerModel | None, name: str, shape: tuple[int, ...], dtype: torch.dtype,
                 seed: int, generator: torch.Generator):
        self.name, self.shape, self.dtype, self.seed = name, tuple(shape), dtype, seed
        self.kind, self.std = init_spec(config, name, self.shape)
        self.tiled = self.kind == "normal" and math.prod(self.shape) >= LARGE
        self.full = None
        if not self.tiled:
            self.full = torch.empty(self.shape, dtype=dtype)
            self.fill_(self.full, generator)

    def fill_(self, tensor: torch.Tensor, generator: torch.Generator) -> None:
        """Draw `tensor` (this parameter or a tile of it) from `generator` by the parameter's distribution."""
        if self.kind == "zeros":
            nn.init.zeros_(tensor)
        elif self.kind == "ones":
            nn.init.ones_(tensor)
        else:
            nn.init.normal_(tensor, 0.0, self.std, generator=generator)

    def block(self, slices: tuple[slice, ...]) -> torch.Tensor:
        if self.full is not None:
            return self.full[slices]
        out = torch.empty([s.stop - s.start for s in slices], dtype=self.dtype)
        sizes = self._tile_sizes()
        ranges = [range(s.start // t, -(-s.stop // t)) for s, t in zip(slices, sizes)]
        for index in itertools.product(*ranges):
            tile = tuple(slice(i * t, min((i + 1) * t, n)) for i, t, n in zip(index, sizes, self.shape))
            values = torch.empty([t.stop - t.start for t in tile], dtype=self.dtype)
            self.fill_(values, self._tile_generator(index))
            overlap = tuple(slice(max(a.start, b.start), min(a.stop, b.stop)) for a, b in zip(tile, slices))
            out[tuple(slice(o.start - s.start, o.stop - s.start) for o, s in zip(overlap, slices))] = \
                values[tuple(slice(o.start - t.start, o.stop - t.start) for o, t in zip(overlap, tile))]
        return out

    def _tile_sizes(self) -> tuple[int, ...]:
        if len(self.shape) == 1:
            return (TILE * TILE,)
        return (1,) * (len(self.shape) - 2) + (TILE, TILE)  # leading dims (experts) one at a time

    def _tile_generator(self, index: tuple[int, ...]) -> torch.Generator:
        key = hashlib.blake2b(f"{self.seed}/{self.name}/{index}".encode(), digest_size=8).digest()
        return torch.Generator().manual_seed(int.from_bytes(key, "little") >> 1)


@torch.no_grad()
def init_parameters_(module: nn.Module, config: ir.TransformerModel | None, seed: int) -> None:
    """Fill every parameter of `module`, a full `Transformer` of `config` (None: an `MLPNet`), with its initial values
    from `seed` (`ParameterValues`)."""
    generator = torch.Generator().manual_seed(seed)
    drawing = _drawing()
    for name, param in module.named_parameters():
        values = ParameterValues(config, name, param.shape, param.dtype, seed, generator)
        if values.tiled and not drawing:  # fake tensors (`runtime.memtrace`): no numbers, one operator, not a tile's
            values.fill_(param, generator)
        else:
            param.copy_(values.block(whole(param.shape)))


def build_model(model: ir.Model, seed: int) -> nn.Module:
    """The full model on the CPU, initialised from `seed` only: every layout starts from these values."""
    if isinstance(model, ir.TransformerModel):
        module = Transformer(model)
    elif isinstance(model, ir.MLPModel):
        module = MLPNet(model)
    elif model.source:  # a model from torch, run unchanged
        from plandsl.runtime.torch_model import build  # lazy: it imports the user's code (and transformers)
        if _drawing():
            skeleton = build_meta_model(model)
            if skeleton is not None:  # a Hugging Face model: its values as each rank draws them (`materialize`)
                return materialize(skeleton, model, seed, torch.get_default_device())
        return build(model, seed)  # a factory's module; or built where nothing is drawn, as it builds itself
    else:
        return _from_factory(model, seed)
    module.init_weights(seed)
    return module


def _drawing() -> bool:
    """Are values drawn where models are built now: not on the meta device (`run --dry-run`), not on fake tensors
    (`runtime.memtrace`)?"""
    return torch.get_default_device().type != "meta" and detect_fake_mode() is None


def build_meta_model(model: ir.Model) -> nn.Module | None:
    """The full model with its parameters on the meta device: shapes without storage, nothing drawn, to be
    parallelized, then `materialize`d with the values `build_model` gives. A built-in family (`ir.TransformerModel`,
    `ir.MLPModel`) and a Hugging Face language model (its buffers built on the CPU: `torch_model.build_meta`); None
    for the others (a factory's module, an image model), which `build_model` builds on the CPU."""
    if isinstance(model, ir.CustomModel):
        from plandsl.runtime import torch_model  # lazy: it imports the user's code (and transformers)
        return torch_model.build_meta(model) if model.source and torch_model.meta_buildable(model) else None
    if not isinstance(model, (ir.TransformerModel, ir.MLPModel)):
        return None
    with torch.device("meta"):
        return Transformer(model) if isinstance(model, ir.TransformerModel) else MLPNet(model)


def is_meta(module: nn.Module) -> bool:
    """Does `module` hold a parameter on the meta device (a DTensor's local shard's device)? Fake tensors
    (`runtime.memtrace`) say the device they stand for."""
    return any(p.device.type == "meta" for p in module.parameters())


WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "_orig_mod.")


def clean_name(name: str) -> str:
    """A parameter's name as the unwrapped model has it (wrappers insert path components: recomputation's
    checkpoint_wrapper, FSDP1's, `torch.compile`'s)."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


@torch.no_grad()
def materialize(module: nn.Module, model: ir.Model, seed: int, device: torch.device | str) -> nn.Module:
    """`module`, a part of `build_meta_model(model)` (the whole or one pipeline stage, parallelized or not: tensor,
    expert, data parallelism leave its parameters DTensors on the meta device), allocated on `device` and filled with
    exactly the values `build_model(model, seed)` gives its parameters, each kept in its own dtype (`keep_weights`'s
    cast, as `copy_` casts): every parameter of the full model in turn (`initial_values`), this rank's part of it cut
    on the CPU and copied in (`local_part`): a small one drawn whole, a large one's tiles that part covers only.
    Parameters tied in the full model (a tied head) take their one value. Buffers not on the meta device (a Hugging
    Face model's rotary frequencies) are kept, moved to `device`. `module` itself where there is nothing to fill: it
    holds no meta parameter, or `device` is the meta device (the dry run builds there: nothing drawn)."""
    device = torch.device(device)
    if device.type == "meta" or not is_meta(module):
        return module
    kept = {(owner, name): buffer for owner in module.modules() for name, buffer in owner._buffers.items()
            if buffer is not None and buffer.device.type != "meta"}
    meta_buffers = [name for name, buffer in module.named_buffers() if buffer.device.type == "meta"]
    if meta_buffers:
        raise ValueError(f"cannot materialize buffers built on the meta device: {', '.join(meta_buffers)}")
    holders: dict[int, list[tuple[nn.Module, str]]] = {}  # each parameter's modules: more than one when tied
    for owner in module.modules():
        for name, param in owner._parameters.items():
            if param is not None:
                holders.setdefault(id(param), []).append((owner, name))
    # DTensors are swapped in place (the Parameter objects stay); a plain parameter gets a new Parameter per module
    # holding it, which would untie a tied head: each holder takes the first's again
    module.to_empty(device=device)
    for (first_owner, first_name), *others in holders.values():
        for owner, name in others:
            owner._parameters[name] = first_owner._parameters[first_name]
    for (owner, name), buffer in kept.items():
        owner._buffers[name] = buffer.to(device)
    skeleton = _skeleton(model)
    canonical: dict[str, str] = {}  # each name of the full model -> the first name of its parameter (a tied head's)
    first: dict[int, str] = {}
    for name, param in skeleton.named_parameters(remove_duplicate=False):
        canonical[name] = first.setdefault(id(param), name)
    local: dict[str, dict[int, torch.Tensor]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        full_name = clean_name(name)
        if full_name not in canonical:
            raise ValueError(f"cannot materialize '{name}': the model has no parameter '{full_name}'")
        local.setdefault(canonical[full_name], {})[id(param)] = param
    unfilled = set(local)
    for name, values in initial_values(skeleton, model, seed):
        name = canonical.get(name, name)  # a tied parameter's values come under the name of the module drawing them
        unfilled.discard(name)
        for param in local.get(name, {}).values():
            if isinstance(param, DTensor):
                param.to_local().copy_(local_part(values, param))
            else:
                param.copy_(values.block(whole(param.shape)))
        del values
    if unfilled:
        raise ValueError(f"cannot materialize {', '.join(sorted(unfilled))}: no initial values were drawn for them")
    return module


_SKELETONS: dict[str, nn.Module] = {}


def _skeleton(model: ir.Model) -> nn.Module:
    """`build_meta_model(model)` for `materialize` to read (never parallelized), built once per model in a process
    (a pipeline rank fills each of its stages from it; a Hugging Face model's build and the reading of its
    `_init_weights` take seconds for a large one). The last model's only."""
    key = model.model_dump_json()
    if key not in _SKELETONS:
        _SKELETONS.clear()
        _SKELETONS[key] = build_meta_model(model)
    return _SKELETONS[key]


def initial_values(skeleton: nn.Module, model: ir.Model, seed: int):
    """(name, its values) of every parameter of `skeleton`, `build_meta_model(model)`, one at a time in the order
    they are drawn: a built-in family's `ParameterValues`, a Hugging Face model's own `_init_weights`
    (`torch_model.initial_values`, each a full tensor). Each has `block(slices)`."""
    if isinstance(model, ir.CustomModel):
        from plandsl.runtime.torch_model import initial_values as torch_values  # lazy: as `build_model`'s
        for name, full in torch_values(skeleton, seed):
            yield name, FullValues(full)
        return
    config = model if isinstance(model, ir.TransformerModel) else None
    generator = torch.Generator().manual_seed(seed)
    for name, param in list(skeleton.named_parameters()):  # `build_model` draws in its dtype, before `keep_weights`
        yield name, ParameterValues(config, name, param.shape, param.dtype, seed, generator)


class FullValues:
    """A parameter's full values, drawn: `block(slices)` cuts them."""

    def __init__(self, full: torch.Tensor):
        self.full = full

    def block(self, slices: tuple[slice, ...]) -> torch.Tensor:
        return self.full[slices]


def local_part(values, param: DTensor) -> torch.Tensor:
    """This rank's part of a parameter's values (`ParameterValues`, `FullValues`: of `param`'s global shape), cut on
    the CPU as `param`'s placements cut it (`local_indices`), so that the full value never moves to the device, nor
    is drawn where tiled: a block of each dim (a tiled parameter's covering tiles only), or the rows a strided shard
    takes out of the whole; `distribute_tensor` over the whole (which moves it to the device first) where torch's
    own cut cannot be read."""
    shape = tuple(param.shape)
    indices = local_indices(shape, param)
    if indices is None:
        full = values.block(whole(shape))
        return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
    slices, picks = [], {}
    for dim, size in enumerate(shape):
        index = indices.get(dim)
        if index is None:
            slices.append(slice(0, size))
        elif index.numel() == 0 or torch.equal(index, torch.arange(int(index[0]), int(index[0]) + index.numel())):
            start = int(index[0]) if index.numel() else 0
            slices.append(slice(start, start + index.numel()))
        else:  # a strided shard's rows, not one block: cut out of the whole dim
            slices.append(slice(0, size))
            picks[dim] = index
    part = values.block(tuple(slices))
    for dim, index in picks.items():
        part = part.index_select(dim, index)
    return part


def local_indices(shape: tuple[int, ...], param: DTensor) -> dict[int, torch.Tensor] | None:
    """The global indices this rank holds along each dim `param`'s placements split, narrowed mesh dim by mesh dim
    as `distribute_tensor` splits (torch's `_local_shard_size_and_offset`, a strided shard's every offset: FSDP2's
    `_StridedShard` over tensor parallelism). None where a placement is neither a shard nor a replica, or torch's
    private helpers differ from torch 2.13's."""
    try:
        from torch.distributed.tensor.placement_types import _StridedShard, _StridedShardOffsetMode  # torch's
        # private placements, read only here: a torch without them cuts through `distribute_tensor`
    except ImportError:
        return None
    mesh, coordinate, found = param.device_mesh, param.device_mesh.get_coordinate(), {}
    if coordinate is None:
        return None
    try:
        for mesh_dim, placement in enumerate(param.placements):
            if isinstance(placement, Replicate):
                continue
            if not isinstance(placement, (Shard, _StridedShard)):
                return None
            before = found.get(placement.dim)
            size = shape[placement.dim] if before is None else before.numel()
            options = {"offset_mode": _StridedShardOffsetMode.ALL} if isinstance(placement, _StridedShard) else {}
            count, offset = placement._local_shard_size_and_offset(curr_local_size=size, num_chunks=mesh.size(mesh_dim),
                                                                   rank=coordinate[mesh_dim], **options)
            local = torch.arange(offset, offset + count) if isinstance(offset, int) else \
                torch.tensor(list(offset), dtype=torch.long)[:count]
            found[placement.dim] = local if before is None else before[local]
    except (TypeError, AttributeError):
        return None
    return found


def _from_factory(model: ir.CustomModel, seed: int) -> nn.Module:
    """A written model's `factory = "pkg.mod:function"`, called with its `args` under `torch.manual_seed(seed)`."""
    if not model.factory:
        raise ValueError(f"model '{model.name}' has no `factory`, so it cannot run: "
                         'add `factory = "package.module:function"` (see docs/models.md)')
    module_name, _, function_name = model.factory.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"model '{model.name}': cannot import factory '{model.factory}': {error}") from error
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        module = factory(**model.factory_args)
    if not isinstance(module, nn.Module) or not hasattr(module, "make_batch"):
        raise ValueError(f"model '{model.name}': factory '{model.factory}' must return a torch.nn.Module "
                         "with a `make_batch(batch, seq, generator)` method (see docs/models.md)")
    return module


def loss_fn(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy over every token for integer targets, else mean squared error. Logits split over the
    vocabulary (a DTensor `Shard(-1)`: `tensor_parallel.splits_logits`) take torch's loss parallel, which the
    caller enters for the forward and the backward (`tensor_parallel.loss_context`); the loss, the same on every
    rank, is returned as a plain tensor (its gradient flows back into the DTensor graph) of its own, not a view of
    the DTensor's local one: torch's split backward detaches a pipeline stage's loss in place (`detach_`, which
    refuses views; `pipelining._backward.stage_backward_input`, torch 2.13)."""
    if targets.dtype in (torch.int64, torch.int32):
        loss = F.cross_entropy(outputs.flatten(0, -2).float(), targets.flatten())
        return loss.to_local().clone() if isinstance(loss, DTensor) else loss
    return F.mse_loss(outputs.float(), targets.float())
