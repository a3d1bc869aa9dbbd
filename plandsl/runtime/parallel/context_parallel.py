"""Context parallelism: the plan's `context = allgather | ring over cp`, each sequence split over the axis.

Stage: interpreter. Contract: `sequence_columns(seq, rank, cp)` are the token positions rank `rank`
of the axis holds; `apply_cp(model, kind, cp_mesh, seq, device)` changes the model in place so that,
fed those columns of every sequence, each rank computes exactly its share of what one process
computes:

- positions: the embedding (gpt's learned positions) and rotary embeddings (llama) use the global
  position of each local token, not 0..s/cp;
- `allgather`: each layer's attention core all-gathers K and V over the axis (autograd-aware, so
  the backward reduce-scatters their gradients) and attends its local queries to every key with
  the causal mask of the global positions. This is Llama 3's context parallelism (Llama Team 2024,
  arXiv:2407.21783, Sec. 3.3.2): K and V are gathered before the attention core (with GQA they are
  the small tensors), the attention itself is the one-process kernel with a mask;
- `ring`: each layer's core is torch's ring attention (`_templated_ring_attention` and its
  backward, the algorithm behind torch's `context_parallel`; Liu et al. 2023): K and V pass from
  rank to rank (`_cp_options.rotate_method = ALL_TO_ALL`, i.e. `permute_tensor`, set around each
  call) while each block of scores is computed, the partial outputs merged by their log-sum-exp, and the K/V gradients
  travel the ring back. torch maps its ring only onto the CUDA SDPA kernels; here it runs the CPU
  flash kernel (`_scaled_dot_product_flash_attention_for_cpu` and its backward), GQA's K and V
  rotated with their own head count. torch's ring is a private API: pinned by tests/distributed (CUDA is refused,
  E702, until it is checked on a GPU);
- load balance: with a causal mask the last tokens attend to the most keys, so the sequence is cut
  into 2·cp chunks and rank r holds chunks r and 2·cp-1-r (Megatron-LM's and torch's head-tail
  balance); when 2·cp does not divide the sequence each rank holds one contiguous chunk.

The loss each rank computes is the mean over its tokens, all ranks hold as many, so the mean over
the axis is the sequence's mean: data parallelism averages gradients (and the loop the loss) over
the context axis as over a data axis (`ir.Plan.reduce_axes`).
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed._functional_collectives import all_gather_tensor_autograd  # in torch 2.6 and later
from torch.distributed.device_mesh import DeviceMesh

from plandsl.runtime.models import Attention, Embedding, Transformer, attend, attention_mask, with_sink

SEQ_DIM = 2  # attention's q, k, v are [batch, heads, seq, head_dim]


def sequence_columns(seq: int, rank: int, cp: int) -> torch.Tensor:
    """The positions (ascending) of the tokens rank `rank` of `cp` holds."""
    if seq % (2 * cp) == 0:
        chunk = seq // (2 * cp)
        first, second = rank * chunk, (2 * cp - 1 - rank) * chunk
        return torch.cat((torch.arange(first, first + chunk), torch.arange(second, second + chunk)))
    chunk = seq // cp
    return torch.arange(rank * chunk, (rank + 1) * chunk)


class GatheredAttentionCore(nn.Module):
    """The attention core of one rank: K and V of every rank gathered along the sequence (in rank order),
    the local queries attending to them under the causal mask of the tokens' global positions (banded by the
    block's sliding `window`, with its attention sinks: `models.attend`)."""

    def __init__(self, cp_mesh: DeviceMesh, seq: int, device: torch.device, window: int = 0):
        super().__init__()
        cp, rank = cp_mesh.size(), cp_mesh.get_local_rank()
        self.group = cp_mesh.get_group()
        queries = sequence_columns(seq, rank, cp).to(device)
        keys = torch.cat([sequence_columns(seq, r, cp) for r in range(cp)]).to(device)
        self.mask = attention_mask(queries, keys, window if window < seq else 0)  # True: the query attends
        self.sink_mask = with_sink(self.mask)  # with attention sinks: one more key, the sink's

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        k, v = (all_gather_tensor_autograd(t.contiguous(), SEQ_DIM, self.group) for t in (k, v))
        return attend(q, k, v, self.mask if sinks is None else self.sink_mask, sinks)


class RingAttentionCore(nn.Module):
    """The attention core as torch's ring attention over the context axis (module docstring);
    `balanced`: whether the sequence is split head-tail (`sequence_columns`)."""

    def __init__(self, cp_mesh: DeviceMesh, balanced: bool):
        super().__init__()
        self.group = cp_mesh.get_group()
        self.balanced = balanced

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k, v = (t.to(q.dtype).contiguous() for t in (k, v))  # the raw kernels take one dtype
        return _RingAttention.apply(q, k, v, self.group, self.balanced)


@contextlib.contextmanager
def _ring_options(balanced: bool):
    """torch's ring reads process-wide options: a ring (`permute_tensor`, not one all-gather) and the
    load balance of our split, set for the call and restored after."""
    # torch's experimental ring attention, only for a ring
    from torch.distributed.tensor.experimental._context_parallel import _attention
    options = _attention._cp_options
    saved = (options.rotate_method, options.enable_load_balance)
    options.rotate_method, options.enable_load_balance = _attention._RotateMethod.ALL_TO_ALL, balanced
    try:
        yield _attention
    finally:
        options.rotate_method, options.enable_load_balance = saved


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, balanced):
        with _ring_options(balanced) as attention:
            out, lse = attention._templated_ring_attention(group, SEQ_DIM, _cpu_forward, q, k, v, is_causal=True)[:2]
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.balanced = group, balanced
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        with _ring_options(ctx.balanced) as attention:
            grad_q, grad_k, grad_v = attention._templated_ring_attention_backward(
                ctx.group, SEQ_DIM, _cpu_backward, grad_out.contiguous(), "grad_out", q, k, v, out, lse,
                is_causal=True)[:3]
        return grad_q, grad_k, grad_v, None, None


def _cpu_forward(query, key, value, *, is_causal):
    """One block of ring attention: (output, log-sum-exp of each query's scores); the CPU flash kernel
    takes GQA's fewer K/V heads as they are."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, is_causal)


def _cpu_backward(*, grad_out, query, key, value, out, logsumexp, is_causal):
    """The gradients of one block (of q, k and v, each shaped like its input)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, query, key, value, out, logsumexp, 0.0, is_causal)[:3]


def apply_cp(model: nn.Module, kind: str, cp_mesh: DeviceMesh, seq: int, device: torch.device) -> None:
    cores: dict[int, nn.Module] = {}  # one per window (a sliding-window pattern's blocks have two): one mask each
    positions = sequence_columns(seq, cp_mesh.get_local_rank(), cp_mesh.size()).to(device)
    for module in list(model.modules()):  # the loop replaces submodules
        if isinstance(module, Attention):
            window = module.window
            if window not in cores:  # a `ring` over a window or sinks is refused before it runs (the checker, E420)
                cores[window] = RingAttentionCore(cp_mesh, balanced=seq % (2 * cp_mesh.size()) == 0) \
                    if kind == "ring" else GatheredAttentionCore(cp_mesh, seq, device, window)  # sequence_columns
            module.core, module.positions = cores[window], positions
        elif isinstance(module, Embedding):
            module.positions = positions
        elif isinstance(module, Transformer):  # multi-token prediction's depths pick this rank's positions
            module.columns, module.context = positions, cp_mesh.size()
