"""torch's loss parallel under `plandsl run`: where tensor parallelism splits the head's vocabulary, the cross entropy
sees the logits as a DTensor split over the vocabulary (`Shard` on the last dim, torchtitan's output layer) and keeps
for its backward one rank's slice of the log-probabilities, [tokens, vocab / tp] in fp32: what the memory model
counts (`cost.memory.loss_backward_bytes`, 4sbV/t), not the whole vocabulary on every rank. Losses and final
parameters still equal the one-process reference (`--check-equivalence`). Cases: tp alone, with sequence parallelism
(the head's input gathered from the sequence shards), on a pipeline's last stage with tied embeddings (the schedule
calls the loss and runs its backward inside `step`), with the outputs returned (merged DTensors), under ZBV's split
backward; a `shard head = replicate` rule keeps the logits whole. Multi-token prediction's losses, which the model
computes inside its forward (the main one and each depth's), likewise."""
from __future__ import annotations

import pytest

from tests.distributed.harness import run_ranks
from tests.distributed.ranks import RANK_TIMEOUT_S, load

pytestmark = pytest.mark.dist

VOCAB, SEQ, MICRO_BATCH = 256, 32, 2
_PLAN = """import "clusters/local"
plan p {{
  model   = {model}
  cluster = localhost
  mesh    = {mesh} over devices[0:{world}]
  train   = {{ global_batch: 8, micro_batch: %d, precision: fp32, lr: 1e-3, seed: 0 }}
{lines}
}}
""" % MICRO_BATCH
_GPT = f"gpt(layers=2, hidden=64, heads=4, seq={SEQ}, vocab={VOCAB})"
_LLAMA = f"llama(layers=2, hidden=64, heads=4, kv_heads=2, seq={SEQ}, vocab={VOCAB})"


def _observe(rank: int, text: str, depths: bool = False) -> dict:
    """Two steps with `--check-equivalence`; what each call of the loss function saw: the logits' type and
    placements, and the largest tensor the loss saved for its backward (this rank's bytes of it). `depths`: also the
    calls the model makes itself (multi-token prediction's losses, `Transformer.loss_with_depths`)."""
    import torch
    from torch.distributed.tensor import DTensor

    import plandsl.runtime.train as train
    from plandsl.runtime.models import loss_fn
    calls: list[dict] = []

    def local_bytes(tensor: torch.Tensor) -> int:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        return local.numel() * local.element_size()

    def observed(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        saved: list[int] = []

        def pack(tensor):
            saved.append(local_bytes(tensor))
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            loss = loss_fn(outputs, targets)
        calls.append({"dtensor": isinstance(outputs, DTensor), "tokens": targets.numel(),
                      "placements": [str(p) for p in outputs.placements] if isinstance(outputs, DTensor) else None,
                      "ndim": outputs.ndim, "saved": max(saved), "plain_loss": not isinstance(loss, DTensor)})
        return loss

    train.loss_fn = observed  # what build_job hands the trainer, and a pipeline's schedule, as the model's loss
    if depths:
        import plandsl.runtime.models as models
        models.loss_fn = observed  # what the model calls for its depths' losses and its own (a forked rank's module)
    status, job = train.run(load(text), train.RunConfig(steps=2, check_equivalence=True, quiet=True,
                                                        timeout_s=RANK_TIMEOUT_S))
    return {"status": status, "calls": calls, "report": str(job.report) if job.report else None}


CASES = [
    # (name, model, mesh, lines, world, split): split: the loss sees the vocabulary split over tp=2
    ("tp", _GPT, "[tp = 2]", "  tensor = megatron over tp", 2, True),
    ("tp_sp", _LLAMA, "[tp = 2]", "  tensor = megatron over tp with sequence_parallel", 2, True),
    ("pp_x_tp_tied", _GPT.replace(")", ", tied=true)"), "[pp = 2, tp = 2]",
     "  tensor   = megatron over tp\n  stages   = evenly over pp\n  schedule = 1f1b", 4, True),
    # the last stage's outputs kept and merged (`outputs = returned`): DTensor chunks
    ("pp_x_tp_returned", _GPT, "[pp = 2, tp = 2]",
     "  tensor   = megatron over tp\n  stages   = evenly over pp with outputs = returned\n  schedule = gpipe", 4, True),
    # a split backward (input, then weights) through the loss's, rank 0 holding the first and the last stage
    ("zbv_x_tp_sp", _LLAMA.replace("layers=2", "layers=4"), "[pp = 2, tp = 2]",
     "  tensor   = megatron over tp with sequence_parallel\n"
     "  stages   = evenly over pp with virtual = 2, map = vshape\n  schedule = zbv", 4, True),
    ("head_replicated", _GPT, "[tp = 2]", "  tensor = megatron over tp\n  shard head = replicate", 2, False),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_the_loss_is_computed_over_the_vocabulary_split(case):
    name, model, mesh, lines, world, split = case
    text = _PLAN.format(model=model, mesh=mesh, world=world, lines=lines)
    results = run_ranks(world, _observe, text, deadline_s=60 + 20 * world)
    assert [r["status"] for r in results] == [0] * world, results[0]["report"]
    calls = [call for r in results for call in r["calls"]]
    assert calls, "no rank called the loss"
    whole = MICRO_BATCH * SEQ * VOCAB * 4  # a microbatch's fp32 log-probabilities over the whole vocabulary
    for call in calls:
        assert call["tokens"] == MICRO_BATCH * SEQ and call["plain_loss"], call
        if split:  # the head's logits: a DTensor sharded on the vocabulary, as torchtitan's
            assert call["dtensor"] and call["placements"] == [f"S({call['ndim'] - 1})"], call
            assert call["saved"] == whole // 2, call  # one rank's half of the vocabulary
        else:
            assert not call["dtensor"] and call["saved"] == whole, call


MTP_CASES = [
    ("tp_sp", "[tp = 2]", "  tensor = megatron over tp with sequence_parallel", 2),
    ("pp_x_tp", "[pp = 2, tp = 2]", "  tensor   = megatron over tp\n  stages   = evenly over pp\n  schedule = 1f1b", 4),
]


@pytest.mark.parametrize("case", MTP_CASES, ids=[c[0] for c in MTP_CASES])
def test_multi_token_predictions_losses_are_computed_over_the_vocabulary_split(case):
    """Multi-token prediction's depths (`mtp = 2`) under tensor parallelism: the main loss and each depth's see the
    head's logits split over the vocabulary (they gathered the whole vocabulary on every rank before), one rank's half
    of the fp32 log-probabilities saved; the run still equals one process."""
    name, mesh, lines, world = case
    model = _LLAMA.replace(")", ", mtp=2)")
    text = _PLAN.format(model=model, mesh=mesh, world=world, lines=lines)
    results = run_ranks(world, _observe, text, True, deadline_s=60 + 20 * world)
    assert [r["status"] for r in results] == [0] * world, results[0]["report"]
    calls = [call for r in results for call in r["calls"]]
    split = [call for call in calls if call["dtensor"]]
    whole = [call for call in calls if not call["dtensor"]]  # the one-process reference's (rank 0), whole logits
    assert len(split) >= 2 * len(whole) > 0, calls  # both tensor ranks of the head's stage, every call split (a
    # pipeline's first step also runs its last stage to learn its shapes)
    assert len({call["tokens"] for call in split}) == 3, split  # the main loss's and two depths' positions
    for call in split:
        assert call["placements"] == [f"S({call['ndim'] - 1})"] and call["plain_loss"], call
        assert call["saved"] == call["tokens"] * VOCAB // 2 * 4, call  # one rank's half of the vocabulary
    assert all(call["saved"] == call["tokens"] * VOCAB * 4 for call in whole), whole
