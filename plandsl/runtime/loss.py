"""The plan's cross entropy (`train.loss`): `fused` as a chunked cross entropy that never holds the logits.

Stage: interpreter. Contract: `vocab_cross_entropy(hidden, weight, targets)` is the mean cross entropy of
`hidden @ weight.T` (the head's logits) computed chunk by chunk of tokens, vocabulary-parallel when `weight`
is a DTensor split by rows; `fused_loss(plan, model)` turns a gpt/llama model's head into that loss (the
model called with the targets returns it; a pipeline's last stage, called without, returns its final hidden
states and `HeadLoss(outputs, targets)` calls the head with both), or returns None: `standard` and `megatron`
are torch's cross entropy over the whole logits (one function, the same numbers: Megatron-LM's
vocabulary-parallel cross entropy computes that one too).

Each chunk of tokens has its logits computed (in the GEMM's dtype, as autocast runs the head), reduced to a
log-sum-exp and the target's logit in fp32, and dropped; the backward recomputes them chunk by chunk and
writes the chunk's share of both gradients, so the loss keeps for its backward only its input, the weight
and one float per token (the log-sum-exp), and holds at any moment one chunk's logits and their gradient
(`chunk_tokens`: Liger-Kernel's fused linear cross entropy's size, at most torchtune's 8 chunks). Under tensor
parallelism each rank holds a slice of the vocabulary (Megatron's vocabulary-parallel cross entropy, Shoeybi et
al. 2019 Sec. 3): the per-token max, sum of exponentials and target logit are all-reduced over the tensor axis,
once per call, not per chunk.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from plandsl import ir


MAX_CHUNKS = 8
"""The most chunks the tokens are split into: torchtune's chunked cross entropy's count (`num_output_chunks`)."""


def chunk_tokens(tokens: int, rows: int, width: int) -> int:
    """Tokens per chunk: `ceil(rows / width)` chunks (`rows`: the whole vocabulary, also under tensor parallelism,
    where a rank's chunk holds its slice of it), so that a chunk's logits ([chunk, rows]) are about as large
    as the head's input ([tokens, width]), Liger-Kernel's rule for its fused linear cross entropy, but at most
    `MAX_CHUNKS` of them: each chunk's GEMMs stay large and the weight's gradient is added to once per chunk
    (on CPU, 62 chunks of 33 tokens took 3.3x the standard loss's CPU time, 8 chunks 1.4x: docs/running.md). A chunk's
    transient (its fp32 logits and their 16-bit gradient, 6 bytes a logit) is then at most 6/8 of a byte per
    logit of the microbatch, below the 16-bit logits (2 bytes) the cost model counts for the fused loss."""
    chunks = min(MAX_CHUNKS, max(1, -(-rows // max(1, width))))
    return max(1, -(-tokens // chunks))


class ChunkedCrossEntropy(torch.autograd.Function):
    """mean over tokens of logsumexp(x W^T) - (x W^T)[target], chunk by chunk of tokens.

    hidden [tokens, width], weight [rows, width]: the rows `offset .. offset + rows` of the vocabulary (all of
    it when `group` is None, else this rank's slice of a split over `group`), targets [tokens] (whole-vocabulary
    indices). `dtype`: what the GEMMs compute in (autocast's dtype under autocast); the reductions are fp32."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, group, offset: int, chunk: int, dtype: torch.dtype):
        tokens, rows = hidden.shape[0], weight.shape[0]
        local, mine = _local_targets(targets, offset, rows)
        high = torch.empty(tokens, dtype=torch.float32, device=hidden.device)
        total, picked = torch.empty_like(high), torch.empty_like(high)
        with torch.autocast(hidden.device.type, enabled=False):  # the casts are this function's own
            w = weight.to(dtype)  # cast once (autocast caches its cast of a weight the same way)
            for start in range(0, tokens, chunk):
                stop = min(start + chunk, tokens)
                logits = (hidden[start:stop].to(dtype) @ w.t()).float()
                picked[start:stop] = logits.gather(1, local[start:stop, None]).squeeze(1)
                high[start:stop] = logits.amax(dim=1)
                total[start:stop] = logits.sub_(high[start:stop, None]).exp_().sum(dim=1)
                del logits
            picked = torch.where(mine, picked, torch.zeros_like(picked))
            if group is not None:  # the vocabulary's slices: max, then the sum rescaled to it, and the target
                own = high.clone()
                dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
                total.mul_((own - high).exp())
                dist.all_reduce(total, group=group)
                dist.all_reduce(picked, group=group)
            lse = high + total.log()
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.offset, ctx.chunk, ctx.dtype = offset, chunk, dtype
        return (lse - picked).mean()

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, targets, lse = ctx.saved_tensors
        tokens, rows, dtype = hidden.shape[0], weight.shape[0], ctx.dtype
        local, mine = _local_targets(targets, ctx.offset, rows)
        scale = grad.float() / tokens
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)
            for start in range(0, tokens, ctx.chunk):
                stop = min(start + ctx.chunk, tokens)
                x = hidden[start:stop].to(dtype)
                # softmax recomputed from the log-sum-exp, minus one at the target (where this rank holds it)
                probs = (x @ w.t()).float().sub_(lse[start:stop, None]).exp_()
                hit = mine[start:stop].nonzero().squeeze(1)
                probs[hit, local[start:stop][hit]] -= 1.0
                grad_logits = probs.mul_(scale).to(dtype)
                del probs
                if grad_hidden is not None:
                    grad_hidden[start:stop] = grad_logits @ w
                if grad_weight is not None:
                    if grad_logits.dtype == torch.float32:
                        grad_weight.addmm_(grad_logits.t(), x)
                    else:
                        grad_weight += (grad_logits.t() @ x).float()
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        # The hidden states' gradient is this slice of the vocabulary's share: the caller sums it over the
        # group (the head's input hook, `tensor_parallel.VocabParallelLoss`).
        return grad_hidden, grad_weight, None, None, None, None, None


def _local_targets(targets: torch.Tensor, offset: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each target as a row of this slice (clamped into it) and whether the slice holds it."""
    local = targets - offset
    mine = (local >= 0) & (local < rows)
    return local.clamp(0, max(rows - 1, 0)), mine


def vocab_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                        chunk: int | None = None) -> torch.Tensor:
    """The mean cross entropy of `hidden @ weight.T` ([..., width] against [vocab, width]) over `targets`
    ([...], the same leading shape), chunk by chunk (`chunk` tokens; default `chunk_tokens`'). A DTensor weight
    split by rows over one mesh dimension (the head under tensor parallelism) computes it vocabulary-parallel
    over that dimension's group; any other DTensor weight is gathered whole first. `hidden` must be whole on
    every rank of the group, and its gradient is this rank's part: the caller sums it over the group."""
    hidden, targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    group, offset = None, 0
    vocab = weight.shape[0]  # the whole vocabulary: the chunks are counted from it, not from this rank's slice
    if isinstance(weight, DTensor):
        mesh = weight.device_mesh
        if mesh.ndim == 1 and tuple(weight.placements) == (Shard(0),):
            size = -(-weight.shape[0] // mesh.size())  # torch.chunk's split, as Shard(0) lays the rows out
            group, offset = mesh.get_group(), min(mesh.get_local_rank() * size, weight.shape[0])
            weight = weight.to_local()
        else:
            weight = weight.full_tensor()
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else \
        torch.promote_types(hidden.dtype, weight.dtype)
    chunk = chunk or chunk_tokens(hidden.shape[0], vocab, hidden.shape[1])
    return ChunkedCrossEntropy.apply(hidden, weight, targets, group, offset, chunk, dtype)


class HeadLoss:
    """The loss of a model whose head computes it (`fused_loss`). Off a pipeline the trainer calls the model with
    the targets (`model(inputs, targets)`: the head runs inside the model's call, where FSDP holds the root's
    parameters gathered). On a pipeline the last stage returns its final hidden states and the schedule calls
    this with them: the head module is called with them and the targets, so its hooks (tensor parallelism's
    input layout, an FSDP unit's gathering) run as for any call; the stages keep their parameters gathered
    after the forward under pipelining (`data_parallel.apply_dp`). The head is the last stage's copy, known
    once the stages are built: `bind`."""

    def __init__(self, head: nn.Module | None = None):
        self.head = head

    def bind(self, parts) -> None:
        """Use the head of whichever of `parts` (this rank's stage modules) holds it; none: no head."""
        self.head = None
        for part in parts:
            if getattr(part, "head", None) is not None:
                self.head = part.head

    def __call__(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.head is None:
            raise RuntimeError("the fused loss was called on a rank without the model's head")
        return self.head(outputs, targets)


class DepthsLoss(HeadLoss):
    """The loss of a model with multi-token prediction's depths (`fused_loss`): off a pipeline the model computes it
    when called with the targets (as `HeadLoss`). On a pipeline the last stage returns its final hidden states, and
    the schedule calls this with them and that microbatch's `sample`, the input tokens and the targets stacked
    ([microbatch, 2, seq]: `sample`; whole rows, also under context parallelism, where the model called off a
    pipeline takes them as its targets too): the depths embed the tokens k ahead, so the last stage is fed them along
    the targets' path (megatron-core's last stage loads the token ids too for its depths). The depths, the embedding's
    copy and the head are the last stage's (`pipeline.split_stage`), known once the stages are built: `bind`."""

    def __init__(self, head: nn.Module | None = None):
        super().__init__(head)
        self.model = None

    @staticmethod
    def sample(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """What a pipeline's last stage is fed as its targets: the tokens and the targets, stacked on dim 1."""
        return torch.stack((tokens, targets), dim=1)

    def bind(self, parts) -> None:
        """Use whichever of `parts` (this rank's stage modules) holds the depths; none: no loss here."""
        super().bind(parts)
        self.model = next((part for part in parts if getattr(part, "mtp", None) is not None), None)

    def __call__(self, outputs: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
        if self.model is None:
            raise RuntimeError("the loss of multi-token prediction was called on a rank without its depths")
        return self.model.loss_with_depths(sample[:, 0], outputs, sample[:, 1])


def fused_loss(plan: ir.Plan, model: nn.Module) -> HeadLoss | None:
    """With `loss: fused`, a gpt/llama model (one with a `Head`) set to return its final hidden states, and the
    loss that calls its head with them; a model with multi-token prediction's depths likewise whatever the loss (the
    model computes it, its depths' included: `models.Transformer.loss_with_depths`; `DepthsLoss`); None otherwise (the model's logits
    go to torch's cross entropy)."""
    if getattr(model, "mtp", None) is not None:  # multi-token prediction: the model computes its loss, any loss
        model.loss_in_head = plan.train.loss is ir.Loss.fused
        return DepthsLoss(model.head)
    if plan.train.loss is not ir.Loss.fused or not hasattr(model, "loss_in_head"):
        return None
    model.loss_in_head = True
    return HeadLoss(model.head)
