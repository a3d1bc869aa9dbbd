"""`plandsl run` applies `data = zero3 ... with gather = bf16` at `precision: bf16` (FSDP2's `MixedPrecisionPolicy`,
`runtime.parallel.data_parallel.mixed_precision`): every linear layer computes with its weight gathered in bf16, so
autocast casts no weight and holds no 16-bit copy of one (the memory model's `autocast_weight_copies` is 0 for the
plan, where without `gather` the same run holds them: tests/distributed/test_autocast_copies.py), and training
matches the one-process reference (fp32 weights under autocast) within the bf16 tolerance."""
from __future__ import annotations

import pytest

from tests.distributed.harness import run_ranks
from tests.distributed.ranks import RANK_TIMEOUT_S, load, train
from tests.distributed.test_autocast_copies import _PLAN, _expected

pytestmark = pytest.mark.dist


def _observed(rank: int, text: str) -> dict:
    """Two steps with `--check-equivalence`: the dtypes every module's own parameters have as it runs (FSDP's groups,
    the experts' too, gathered), the weights whose autocast casts a matmul saved (a bf16 tensor cast from a
    parameter), and rank 0's report."""
    from dataclasses import asdict

    import torch

    import plandsl.runtime.train as train
    from plandsl.runtime.train import RunConfig, run
    weights: set[str] = set()
    cast: set[str] = set()

    def record(module, args, output):  # global hooks run before the module's own: before FSDP reshards it
        weights.update(str(param.dtype) for param in module.parameters(recurse=False))

    def pack(tensor):
        node = tensor.grad_fn  # a matmul saves a view of the copy (its transpose): through it to the cast
        while node is not None and type(node).__name__ in ("TBackward0", "ViewBackward0", "TransposeBackward0"):
            node = node.next_functions[0][0]
        if node is not None and type(node).__name__ == "ToCopyBackward0":
            source = node.next_functions[0][0]
            if type(source).__name__ == "AccumulateGrad" and source.variable.dim() >= 2:
                cast.add(str(tuple(source.variable.shape)))
        return tensor

    step = train.train_step

    def observed(job, index):  # the distributed steps only, not the reference's
        handle = torch.nn.modules.module.register_module_forward_hook(record)
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                return step(job, index)
        finally:
            handle.remove()

    train.train_step = observed
    try:
        status, job = run(load(text), RunConfig(steps=2, check_equivalence=True, quiet=True, timeout_s=RANK_TIMEOUT_S))
    finally:
        train.train_step = step
    return {"status": status, "weights": sorted(weights), "cast": sorted(cast),
            "report": asdict(job.report) if job.report else None}


_MOE = _PLAN.replace(
    "llama(layers=4, hidden=64, heads=4, kv_heads=2, ffn=96, seq=16, vocab=256)",
    "llama(layers=2, hidden=32, heads=4, kv_heads=2, seq=16, vocab=128, ffn=32, experts=4, top_k=2)").replace(
    "[{axis} = 2] over devices[0:2]", "[dp = 2, ep = 2] over devices[0:4]")


@pytest.mark.parametrize("text, gather, weights, copies", [
    (_PLAN, "bf16", "torch.bfloat16", False),
    (_PLAN, "fp32", "torch.float32", True),  # gathered as kept: autocast casts each weight, as the memory model counts
    (_MOE, "bf16", "torch.bfloat16", False),  # the experts' own FSDP group (over dp) gathers bf16 too
], ids=["bf16", "fp32", "experts_bf16"])
def test_zero3_gathers_in_the_plans_dtype_and_trains_like_one_process(text, gather, weights, copies):
    text = text.format(axis="dp", lines=f"data = zero3 over dp with gather = {gather}"
                       + ("\n  experts = alltoall over ep" if "experts=" in text else ""))
    plan = load(text)
    assert (_expected(plan)[0] > 0) is copies  # what the memory model counts for the plan
    results = run_ranks(plan.mesh.size, _observed, text, deadline_s=200)
    assert [r["status"] for r in results] == [0] * plan.mesh.size
    for result in results:
        assert result["weights"] == [weights], result["weights"]
        assert bool(result["cast"]) is copies, result["cast"]
    report = results[0]["report"]
    assert report["tolerance"] == 2e-2 and max(report["loss_diff"], report["param_diff"]) <= report["tolerance"]


def test_bf16_gradient_reduction_under_fp32_is_held_to_the_16_bit_bound():
    """`precision: fp32, grad_dtype: bf16` under zero3 with `gather = fp32` (drawn by tests/property/
    test_check_runs.py): FSDP2 reduce-scatters the gradients in bf16 (`reduce_dtype`), which the fp32 reference
    cannot, so the parameters differ by the gradients' bf16 rounding (5.7e-4 here); `--check-equivalence` held the run
    to the fp32 bound (1e-5) and failed a plan that runs as written (runtime.equivalence.tolerance)."""
    text = _PLAN.replace("precision: bf16", "precision: fp32, grad_dtype: bf16").format(
        axis="dp", lines="data = zero3 over dp with gather = fp32")
    results = run_ranks(2, train, text, steps=1, check_equivalence=True, deadline_s=100)
    assert [r["status"] for r in results] == [0, 0], results[0]["report_text"]
    report = results[0]["report"]
    assert report["tolerance"] == 2e-2 and 1e-5 < report["param_diff"] <= 2e-2, results[0]["report_text"]
