"""`master_dtype`, `optimizer_dtype` and `param_dtype` on the interpreter, against one process.

The optimizer keeps its states in `optimizer_dtype` (`runtime.optim.AdamWStates`: 16-bit m and v, the
update in fp32), the weights in `master_dtype` (`runtime.precision.keep_weights`); the reference does the
same, so `--check-equivalence` holds: ZeRO-1 over torch's ZeroRedundancyOptimizer, whose local optimizer is
`AdamWStates`, and FSDP (zero3) over bf16 weights.
"""
from __future__ import annotations

import pytest

from tests.distributed.harness import run_ranks
from tests.distributed.ranks import RANK_TIMEOUT_S, load
from tests.support import lazy

torch = lazy("torch")

pytestmark = pytest.mark.dist

_PLAN = """import "clusters/local"
import "local/tiny"
plan p {{
  model   = tiny_gpt
  cluster = localhost
  mesh    = [dp = 2] over devices[0:2]
  train   = {{ global_batch: 8, micro_batch: 2, precision: {precision}, lr: 1e-3, seed: 0, {dtypes} }}
  data    = {data} over dp
}}
"""


def _train_dtypes(rank: int, source) -> dict:
    from plandsl.runtime.train import RunConfig, run
    plan = load(source)
    status, job = run(plan, RunConfig(steps=2, check_equivalence=True, quiet=True, timeout_s=RANK_TIMEOUT_S))
    inner = getattr(job.optimizer, "optim", job.optimizer)
    return {"status": status, "optimizer": type(inner).__name__,
            "params": sorted({str(p.dtype) for model in job.models for p in model.parameters()}),
            "states": sorted({str(v.dtype) for state in inner.state.values() for k, v in state.items() if k != "step"}),
            "report": job.report.__dict__ if job.report else None,
            "report_text": str(job.report) if job.report else None}


@pytest.mark.parametrize("data, precision, dtypes, optimizer, params, states", [
    ("zero1", "bf16", "optimizer_dtype: bf16, grad_dtype: bf16", "AdamWStates", ["torch.float32"], ["torch.bfloat16"]),
    ("zero3", "bf16", "master_dtype: bf16, optimizer_dtype: fp32", "AdamWStates", ["torch.bfloat16"], ["torch.float32"]),
    # Megatron's layout: bf16 weights, the fp32 master copy a state of the optimizer (ZeRO shards it with m and v)
    ("zero1", "bf16", "param_dtype: bf16", "AdamWStates", ["torch.bfloat16"], ["torch.float32"]),
    ("zero3", "bf16", "param_dtype: bf16, optimizer_dtype: bf16", "AdamWStates", ["torch.bfloat16"],
     ["torch.bfloat16", "torch.float32"]),
], ids=["zero1_bf16_states", "fsdp_bf16_weights", "zero1_bf16_weights_fp32_master", "fsdp_bf16_weights_fp32_master"])
def test_state_dtypes_run_and_match_one_process(data, precision, dtypes, optimizer, params, states):
    text = _PLAN.format(precision=precision, dtypes=dtypes, data=data)
    results = run_ranks(2, _train_dtypes, text, deadline_s=120)
    assert [r["status"] for r in results] == [0, 0], results[0]["report_text"]
    for result in results:
        assert (result["optimizer"], result["params"], result["states"]) == (optimizer, params, states)
    assert results[0]["report"]["loss_diff"] <= 1e-3, results[0]["report_text"]


def test_16_bit_states_resume_from_a_checkpoint_as_if_never_stopped(tmp_path):
    """bf16 Adam states through a DCP checkpoint: 2 steps, then 2 more resumed, lose what 4 uninterrupted steps
    lose (the states come back in bf16, not widened by torch's load, nor rounded twice)."""
    from tests.distributed.ranks import train
    text = _PLAN.format(precision="bf16", dtypes="optimizer_dtype: bf16", data="zero3")
    whole = run_ranks(2, train, text, steps=4, deadline_s=120)[0]["losses"]
    first = run_ranks(2, train, text, steps=2, checkpoint_dir=tmp_path / "ck", deadline_s=120)
    second = run_ranks(2, train, text, steps=4, checkpoint_dir=tmp_path / "ck", resume=True, deadline_s=120)
    assert [r["status"] for r in first + second] == [0] * 4
    assert second[0]["first_step"] == 2
    for got, want in zip(first[0]["losses"] + second[0]["losses"], whole):
        assert abs(got - want) <= 1e-5 * abs(want), (got, want)


def test_fp32_master_copy_resumes_from_a_checkpoint_as_if_never_stopped(tmp_path):
    """bf16 weights with their fp32 master copy kept by the optimizer: the master comes back in fp32 (torch's load
    would cast it to the weights' bf16, and the resumed run would then step from the rounded weights)."""
    from tests.distributed.ranks import train
    text = _PLAN.format(precision="bf16", dtypes="param_dtype: bf16, optimizer_dtype: bf16", data="zero3")
    whole = run_ranks(2, train, text, steps=4, deadline_s=120)[0]["losses"]
    first = run_ranks(2, train, text, steps=2, checkpoint_dir=tmp_path / "ck", deadline_s=120)
    second = run_ranks(2, train, text, steps=4, checkpoint_dir=tmp_path / "ck", resume=True, deadline_s=120)
    assert [r["status"] for r in first + second] == [0] * 4
    for got, want in zip(first[0]["losses"] + second[0]["losses"], whole):
        assert abs(got - want) <= 1e-5 * abs(want), (got, want)
