"""Uneven data-parallel shares (`batch_shares`) train like one device on the whole global batch.

Each data rank trains on its own share (its own microbatch count, in a pipeline its own schedule length)
and weights its loss by share x dp / global batch, so the data-parallel mean is the global batch's:
`--check-equivalence` against one process, with DDP, ZeRO-1 (torch's and plandsl's DTensor one, whose
composable `replicate` reduces once, after the last microbatch), FSDP (ZeRO-2 and 3, gathered from the first
forward to the last backward, so every rank calls the same collectives) and pipelines (torch's single- and
multi-stage classes and its action runtime) over each. The two-device-type local plan (stdlib_plans/local/hetero.plan) gives each replica the
microbatches its devices' speed earns.
"""
from __future__ import annotations

import pytest

from tests.conftest import STDLIB
from tests.distributed.harness import run_ranks
from tests.distributed.ranks import load, train

pytestmark = [pytest.mark.dist, pytest.mark.slow]

STEPS = 3


def _plan(mesh: str, data: str, shares: str, micro_batch: int = 1, extra: str = "") -> str:
    return f"""
import "clusters/local"
import "local/tiny"
plan uneven {{
  model   = tiny_gpt
  cluster = localhost
  mesh    = {mesh}
  train   = {{ global_batch: 8, micro_batch: {micro_batch}, precision: fp32, optimizer: adam, lr: 1e-3, seed: 0,
              batch_shares: {shares} }}
  data    = {data}
{extra}}}
"""


def _matches(text: str, ranks: int) -> list[dict]:
    results = run_ranks(ranks, train, text, steps=STEPS, check_equivalence=True, deadline_s=60 + 20 * ranks)
    assert [r["status"] for r in results] == [0] * ranks, results[0]["report_text"]
    report = results[0]["report"]
    assert report["loss_diff"] <= 1e-5 and report["param_diff"] <= 1e-5 and report["tensor_diff"] <= 1e-5, report
    return results


@pytest.mark.parametrize("mesh,data,shares,micro_batch,extra", [
    ("[dp = 2] over devices[0:2]", "ddp over dp", "[6, 2]", 2, ""),            # DDP, gradient accumulation 3 + 1
    ("[dp = 2] over devices[0:2]", "zero1 over dp", "[1, 7]", 1, ""),          # torch's ZeroRedundancyOptimizer
    ("[dp = 2] over devices[0:2]", "fsdp over dp", "[5, 3]", 1, ""),           # FSDP2, gathered through the step
    ("[dp = 2] over devices[0:2]", "zero2 over dp", "[2, 6]", 2, ""),
    ("[dp = 2, pp = 2] over devices[0:4]", "fsdp over dp", "[6, 2]", 1,        # FSDP2 stages of a 1F1B pipeline
     "  stages  = evenly over pp\n  schedule = 1f1b\n"),
    ("[dp = 2, pp = 2] over devices[0:4]", "fsdp over dp", "[6, 2]", 1,        # ... of GPipe
     "  stages  = evenly over pp\n  schedule = gpipe\n"),
    ("[dp = 2, pp = 2] over devices[0:4]", "fsdp over dp", "[6, 2]", 1,        # ... interleaved (torch's Multi)
     "  stages  = evenly over pp with virtual = 2\n  schedule = interleaved_1f1b\n"),
    ("[dp = 2, pp = 2] over devices[0:4]", "fsdp over dp", "[6, 2]", 1,        # ... zb_h1 (plandsl's table, torch's
     "  stages  = evenly over pp\n  schedule = zb_h1\n"),                      # runtime: UNSHARD/RESHARD actions)
    ("[dp = 2, tp = 2] over devices[0:4]", "zero1 over dp", "[6, 2]", 1,       # Zero1Optimizer over DTensors
     "  tensor  = megatron over tp\n"),
    ("[dp = 2, pp = 2] over devices[0:4]", "ddp over dp", "[6, 2]", 1,         # 1F1B, 6 and 2 microbatches
     "  stages  = evenly over pp\n  schedule = 1f1b\n"),
], ids=["ddp", "zero1", "fsdp", "zero2", "fsdp_1f1b", "fsdp_gpipe", "fsdp_interleaved", "fsdp_zb_h1", "zero1_tp", "pp_1f1b"])
def test_uneven_shares_match_one_process(mesh, data, shares, micro_batch, extra):
    text = _plan(mesh, data, shares, micro_batch, extra)
    _matches(text, load(text).mesh.size)


def _microbatches(rank: int, path: str) -> tuple[int, int]:
    """(this rank's data rank, the microbatches its pipeline runs), read from the job `run` builds."""
    from plandsl.runtime.parallel.mesh import build_mesh, init_distributed
    from plandsl.runtime.train import RunConfig, build_job
    plan = load(path)
    device = init_distributed()
    job = build_job(plan, build_mesh(plan, device), device, RunConfig(steps=1))
    return job.dp_rank, job.pipeline.microbatches


def test_the_two_type_local_plan_gives_the_faster_replica_more_microbatches():
    """hetero.plan: replica 0 (fast fast fast slow) runs 5 microbatches, replica 1 (fast slow slow slow) 3;
    trained against one process by test_local_plans too."""
    path = str(STDLIB / "local" / "hetero.plan")
    found = run_ranks(8, _microbatches, path, deadline_s=120)
    assert sorted(set(found)) == [(0, 5), (1, 3)]
    _matches(path, 8)
