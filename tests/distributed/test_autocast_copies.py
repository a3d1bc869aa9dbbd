"""autocast's 16-bit copies of fp32 weights under `plandsl run` (`precision: bf16`, no `param_dtype`), against what the
memory model counts for them (`cost.memory.autocast_weight_copies`).

Every copy a matmul saves for its backward is seen by a saved-tensor hook (a bf16 tensor whose `grad_fn` casts a
parameter); kept alive to the step's end, two copies of one weight cannot share an address. On a pipeline one
autocast context spans the step, so each weight is cast once for all four microbatches; off one (FSDP, two
microbatches accumulated) each microbatch's forward casts anew, and its backward frees them before the next: one
microbatch's copies at a time. Either way a rank holds one copy of each weight it computes with, which is the term."""
from __future__ import annotations

import pytest

from tests.distributed.harness import run_ranks
from tests.distributed.ranks import RANK_TIMEOUT_S, load

pytestmark = pytest.mark.dist

# no biases (llama): the copies of a linear's bias are cached but not saved, so no hook sees them
_PLAN = """import "clusters/local"
plan p {{
  model   = llama(layers=4, hidden=64, heads=4, kv_heads=2, ffn=96, seq=16, vocab=256)
  cluster = localhost
  mesh    = [{axis} = 2] over devices[0:2]
  train   = {{ global_batch: 8, micro_batch: 2, precision: bf16, lr: 1e-3, seed: 0 }}
  {lines}
}}
"""


def _copies(rank: int, text: str) -> dict:
    """One step; per parameter (by name) the distinct 16-bit copies its matmuls saved, and their bytes."""
    import torch

    import plandsl.runtime.train as train
    from plandsl.runtime.train import RunConfig, run
    saved: list[torch.Tensor] = []

    def pack(tensor):
        node = tensor.grad_fn  # the matmuls save views of the copy (its transpose): through them to the cast
        while node is not None and type(node).__name__ in ("TBackward0", "ViewBackward0", "TransposeBackward0"):
            node = node.next_functions[0][0]
        if tensor.dtype == torch.bfloat16 and node is not None and type(node).__name__ == "ToCopyBackward0":
            source = node.next_functions[0][0]
            if type(source).__name__ == "AccumulateGrad" and source.variable.dim() >= 2:  # a weight, not a norm's
                saved.append((tensor, source.variable))  # kept to the step's end: no two live copies share an address
        return tensor

    step = train.train_step

    def observed(job, index):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            return step(job, index)

    train.train_step = observed
    try:
        status, job = run(load(text), RunConfig(steps=1, quiet=True, timeout_s=RANK_TIMEOUT_S))
    finally:
        train.train_step = step
    names = {id(p): name for part in job.parts for name, p in part.named_parameters()}
    copies: dict[str, set] = {}
    for tensor, variable in saved:
        name = names.get(id(variable), f"unsharded-{tuple(variable.shape)}-{id(variable)}")
        copies.setdefault(name, set()).add((tensor.untyped_storage().data_ptr(), tensor.numel() * tensor.element_size()))
    return {"status": status, "copies": {name: sorted(found) for name, found in copies.items()},
            "microbatches": job.plan.num_microbatches if job.pipeline is not None else 2}


def _expected(plan) -> list[float]:
    from plandsl.cost.memory import autocast_weight_copies
    from plandsl.ir.placement import assign_stages
    assignment, _ = assign_stages(plan)
    return [autocast_weight_copies(plan, [layer for s in stages for layer in assignment.stage_layers[s]])
            for stages in assignment.rank_stages()]


def test_a_pipeline_rank_holds_one_copy_of_each_weight_for_all_its_microbatches():
    text = _PLAN.format(axis="pp", lines="stages = evenly over pp\n  schedule = 1f1b")
    plan = load(text)
    results = run_ranks(2, _copies, text, deadline_s=120)
    assert [r["status"] for r in results] == [0, 0]
    for rank, (result, expected) in enumerate(zip(results, _expected(plan))):
        assert result["microbatches"] == 4
        assert all(len(found) == 1 for found in result["copies"].values()), result["copies"]  # cached: one per weight
        held = sum(size for found in result["copies"].values() for _, size in found)
        assert held == expected > 0, (rank, held, expected)


def test_fsdp_casts_each_microbatch_anew_and_holds_one_microbatchs_copies():
    text = _PLAN.format(axis="dp", lines="data = zero3 over dp")
    plan = load(text)
    (expected,) = _expected(plan)
    results = run_ranks(2, _copies, text, deadline_s=120)
    assert [r["status"] for r in results] == [0, 0]
    for result in results:
        counts = {len(found) for found in result["copies"].values()}
        assert counts == {2}, result["copies"]  # a context per microbatch: each casts its own, freed by its backward
        per_microbatch = sum(size for found in result["copies"].values() for _, size in found) / 2
        assert per_microbatch == expected > 0, (per_microbatch, expected)
