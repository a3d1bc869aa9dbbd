"""`plandsl run`'s tensor-parallel collectives, counted on forked gloo ranks (a dispatch mode sees each collective
operator of the second step that runs through dispatch; those DTensor issues inside its own op handlers, the loss
parallel's [b·s, 1] and the norms' weight gradients', it does not, and none is [b, s, h], the shape counted here): an intact Megatron pair reduces its producers' input gradients once (`tensor_parallel.
_block_tp` hands them one Replicate DTensor), the pair the time model prices (`cost.layer._layer_comm`); and an MoE
layer's intact shared experts under sequence parallelism: what they cost beside replicated ones."""
from __future__ import annotations

from collections import Counter

import pytest

from tests.distributed.harness import run_ranks
from tests.distributed.ranks import load

pytestmark = [pytest.mark.dist, pytest.mark.xdist_group("torch")]

COLLECTIVES = ("all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter", "all_to_all", "alltoall")
PLAN = """
import "clusters/local"
plan counted {
  model    = MODEL
  cluster  = localhost x 2
  mesh     = [tp = 2] over devices[0:2]
  train    = { global_batch: 2, micro_batch: 1, precision: fp32, optimizer: adam, lr: 1e-3, seed: 0 }
  tensor   = megatron over tp SP
RULES}
"""
DENSE = "llama(layers=2, hidden=64, heads=4, seq=32, vocab=256)"
SHARED = "llama(layers=2, hidden=64, heads=4, seq=32, vocab=256, ffn=64, experts=4, top_k=2, shared_experts=1)"
BLOCKS, MICROBATCHES = 2, 2
PASSES = BLOCKS * MICROBATCHES  # blocks x microbatches of a step


def _count(rank: int, source: str) -> dict:
    """The second step's collective operators on this rank, by (operator, the shape of its first tensor)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from plandsl.runtime import train
    from plandsl.runtime.parallel.mesh import build_mesh, init_distributed
    plan = load(source)
    device = init_distributed(60.0, "cpu")
    torch.manual_seed(0)
    job = train.build_job(plan, build_mesh(plan, device), device, train.RunConfig(steps=2, quiet=True))
    train.train_step(job, 0, report=False)
    found: Counter = Counter()

    class Counting(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(word in str(func) for word in COLLECTIVES):
                first = next((a for a in args if isinstance(a, torch.Tensor)), None)
                found[(str(func).split(".")[1], tuple(first.shape) if first is not None else ())] += 1
            return func(*args, **(kwargs or {}))

    with Counting():
        train.train_step(job, 1, report=False)
    return dict(found)


def _activations(found: dict) -> dict[str, int]:
    """The collectives of [b, s, h] tensors (and of their sequence shards), by operator."""
    out: Counter = Counter()
    for (op, shape), count in found.items():
        if shape in ((1, 32, 64), (1, 16, 64), (2, 16, 64)):
            out[op] += count
    return dict(out)


@pytest.mark.parametrize("sp", [True, False], ids=["sequence_parallel", "plain"])
def test_an_intact_pair_reduces_its_input_gradient_once(sp):
    """Per block and microbatch, Megatron's two pairs (attention, MLP): under sequence parallelism an all-gather and a
    reduce-scatter each way each; without, an all-reduce each way each. Beside them the embedding's reduction and the
    head's input (2 a microbatch). Before, each producer all-reduced its own input's gradient: 5 all-reduces a block's
    backward (q, k, v, w1, w3) where these are 2 reduce-scatters (2 all-reduces)."""
    found = _activations(run_ranks(2, _count, PLAN.replace("MODEL", DENSE).replace(
        " SP", " with sequence_parallel" if sp else "").replace("RULES", ""), deadline_s=60)[0])
    extra = 2 * MICROBATCHES  # the embedding's and the head's, one each per microbatch
    if sp:
        assert found == {"all_gather_into_tensor": 4 * PASSES + extra, "reduce_scatter_tensor": 4 * PASSES + extra}
    else:
        assert found == {"all_reduce": 4 * PASSES + extra}


def test_intact_shared_experts_all_reduce_once_each_way():
    """An MoE layer's shared experts under sequence parallelism, against the same replicated: the layer's input is
    gathered once for the router and them, so their pair all-reduces its output (the bytes of Megatron's all-gather
    and reduce-scatter, the all-gather being the layer's) and, backward, its producers' summed input gradient once
    (the output gradient's all-gather the layer's): 2 all-reduces per block and microbatch (3 before: w1's and w3's
    input gradients apart)."""
    def count(rules):
        return _activations(run_ranks(2, _count, PLAN.replace("MODEL", SHARED).replace(" SP", " with sequence_parallel")
                                      .replace("RULES", rules), deadline_s=60)[0])
    intact, replicated = count(""), count("  shard layers.*.moe.shared = replicate\n")
    assert {op: intact.get(op, 0) - replicated.get(op, 0) for op in set(intact) | set(replicated)
            if intact.get(op, 0) != replicated.get(op, 0)} == {"all_reduce": 2 * PASSES}
