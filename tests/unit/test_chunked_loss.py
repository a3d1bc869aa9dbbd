"""`loss: fused` as `plandsl run` computes it (runtime.loss): a chunked cross entropy whose loss and gradients are
torch's cross entropy over the whole fp32 logits, and which never holds those logits (the largest tensor any of its
ops makes, counted by a dispatch mode, and what it saves for the backward, by saved_tensors_hooks). The
vocabulary split over a tensor axis is tests/distributed/test_fused_loss_run.py's."""
from __future__ import annotations

import pytest

from plandsl import ir
from tests.support import lazy

torch = lazy("torch")

GPT = ir.TransformerModel(kind="gpt", name="g", layers=2, hidden=32, heads=4, kv_heads=4, ffn_hidden=64, seq=16,
                          vocab=200, tied_embeddings=True)
LLAMA = ir.TransformerModel(kind="llama", name="l", layers=2, hidden=32, heads=4, kv_heads=2, ffn_hidden=64, seq=16,
                            vocab=200)


def _grads(model, loss):
    model.zero_grad()
    loss.backward()
    return {name: param.grad.clone() for name, param in model.named_parameters()}


def _relative(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("model", [GPT, LLAMA], ids=["gpt_tied", "llama"])
@pytest.mark.parametrize("chunk", [None, 1, 7, 48], ids=["default", "1", "7_uneven", "48_whole"])
def test_loss_and_gradients_are_torchs_cross_entropy(model, chunk, monkeypatch):
    from plandsl.runtime import loss as loss_module
    from plandsl.runtime.models import build_model, loss_fn
    module = build_model(model, seed=0)
    generator = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, model.vocab, (3, model.seq), generator=generator) for _ in range(2))
    standard = loss_fn(module(x), y)
    expected = _grads(module, standard)
    if chunk is not None:  # the head's chunk, whatever chunk_tokens would pick
        monkeypatch.setattr(loss_module, "chunk_tokens", lambda tokens, rows, width: chunk)
    module.loss_in_head = True
    fused = module(x, y)
    found = _grads(module, fused)
    assert fused.item() == pytest.approx(standard.item(), rel=1e-6)
    assert fused.dtype == torch.float32 and fused.ndim == 0
    assert max(_relative(found[name], expected[name]) for name in expected) < 1e-5
    assert module(x).shape == (3, model.seq, model.hidden)  # no targets: the final hidden states (a last stage)


def test_under_autocast_it_is_the_same_bf16_gemm():
    from plandsl.runtime.models import build_model, loss_fn
    module = build_model(LLAMA, seed=0)
    x, y = (torch.randint(0, LLAMA.vocab, (2, LLAMA.seq), generator=torch.Generator().manual_seed(2)) for _ in range(2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        standard = loss_fn(module(x), y)
    expected = _grads(module, standard)
    module.loss_in_head = True
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = module(x, y)
    found = _grads(module, fused)
    assert fused.item() == pytest.approx(standard.item(), rel=1e-5)  # the logits are the same bf16 GEMM's
    assert max(_relative(found[name], expected[name]) for name in expected) < 2e-2


# ---- memory: what the fused loss holds --------------------------------------------------------------------------
TOKENS, VOCAB, WIDTH = 128, 1024, 32  # the fp32 logits: 128 x 1024 x 4 = 512 KiB; the head's weight 128 KiB


def _head_inputs():
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(TOKENS, WIDTH, generator=generator, requires_grad=True)
    weight = (0.02 * torch.randn(VOCAB, WIDTH, generator=generator)).requires_grad_()
    return hidden, weight, torch.randint(0, VOCAB, (TOKENS,), generator=generator)


def _measured(loss_of):
    """(the largest tensor any op made, in bytes, forward and backward; the bytes saved for the backward beyond
    the hidden states and the weight, which the head keeps either way)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Largest(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    Largest.largest = max(Largest.largest, t.numel() * t.element_size())
            return out

    hidden, weight, targets = _head_inputs()
    inputs = {hidden.data_ptr(), weight.data_ptr()}
    saved = []

    def pack(t):
        if t.data_ptr() not in inputs:
            saved.append(t.numel() * t.element_size())
        return t

    with Largest(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_of(hidden, weight, targets)
        loss.backward()
    return Largest.largest, sum(saved)


def test_it_never_holds_the_fp32_logits():
    from plandsl.runtime.loss import vocab_cross_entropy
    logits = TOKENS * VOCAB * 4
    standard_largest, standard_saved = _measured(
        lambda h, w, t: torch.nn.functional.cross_entropy(torch.nn.functional.linear(h, w).float(), t))
    fused_largest, fused_saved = _measured(vocab_cross_entropy)
    # the measure sees the logits where they are made: torch's loss makes and keeps [tokens, vocab] in fp32
    assert standard_largest >= logits and standard_saved >= logits
    # the fused loss: no tensor larger than the weight's own gradient ([vocab, width] fp32), a quarter of the
    # logits here; it keeps for its backward one fp32 log-sum-exp and the int64 target per token
    assert fused_largest <= VOCAB * WIDTH * 4 < logits
    assert fused_saved <= TOKENS * (4 + 8)


_PLAN = """
import "clusters/local"
plan p {
  model   = %s
  cluster = localhost
  mesh    = [dp = 2] over devices[0:2]
  train   = { global_batch: 4, loss: %s }
  data    = ddp over dp
}
"""


@pytest.mark.parametrize("loss", list(ir.Loss), ids=[loss.value for loss in ir.Loss])
def test_run_takes_every_loss_and_chunks_only_the_fused_one(loss):
    """`standard` and `megatron` run as torch's cross entropy (the model returns logits, the trainer's loss is
    models.loss_fn); `fused` makes the head compute the loss. A model without a head keeps its own loss."""
    from plandsl import api
    from plandsl.runtime.loss import HeadLoss, fused_loss
    from plandsl.runtime.models import build_model
    from plandsl.runtime.support import refusals
    plan = api.select_plan(api.loads(_PLAN % ("gpt(layers=1, hidden=32, heads=4, seq=16, vocab=64)", loss.value)))
    assert refusals(plan, cuda=False) == []
    model = build_model(plan.model, seed=0)
    found = fused_loss(plan, model)
    assert isinstance(found, HeadLoss) == (loss is ir.Loss.fused) == model.loss_in_head
    mlp = api.select_plan(api.loads(_PLAN % ("mlp(layers=2, hidden=8, input=4, output=2)", loss.value)))
    assert fused_loss(mlp, build_model(mlp.model, seed=0)) is None


def test_the_chunks_are_counted_from_the_whole_vocabulary(monkeypatch):
    """Under tensor parallelism a rank holds vocab / tp rows of the head; the chunks are ceil(vocab / width) of the
    whole vocabulary (at most 8), not of the rank's slice, else at tp = 8 a rank would run its logits in one or two
    chunks and hold them whole. A one-rank mesh whose DTensor says the head has twice its local rows stands for a
    rank of two: the count takes the whole 2 x 48 rows against width 16, six chunks, not three."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from plandsl.runtime import loss as loss_module
    assert not dist.is_initialized()  # a one-process group of its own, destroyed after: the worker's others run none
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        local = torch.randn(48, 16)
        weight = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size((96, 16)),
                                    stride=local.stride())
        counted = []
        real = loss_module.chunk_tokens
        monkeypatch.setattr(loss_module, "chunk_tokens", lambda tokens, rows, width: counted.append(rows) or
                            real(tokens, rows, width))
        loss_module.vocab_cross_entropy(torch.randn(12, 16), weight, torch.randint(0, 48, (12,)))
    finally:
        dist.destroy_process_group()
    assert counted == [96] and real(12, 96, 16) == 2  # 12 tokens in 6 chunks of 2
