"""Every plan of stdlib_plans/local/ trained on its mesh's processes, against one process.

The promise these tests keep: a plan changes where work happens, never what is computed. Each local
plan trains for a few steps with `--check-equivalence` (losses and final parameters within the
documented 1e-5 relative of a one-process run), and the dense ones, which all train tiny.plan's GPT
with the same seed, data and batch, also give the same per-step losses as one another: each is
compared with one reference run in this process, so any two layouts agree.
"""
from __future__ import annotations

import pytest

from plandsl import api
from tests.conftest import STDLIB
from tests.distributed.harness import run_ranks
from tests.distributed.ranks import train
from tests.support import lazy

runtime_reference = lazy("plandsl.runtime.reference")

pytestmark = pytest.mark.dist

STEPS = 3
LOCAL = sorted((STDLIB / "local").glob("*.plan"))


def _plan(path):
    (plan,) = api.load(path).plans
    return plan


@pytest.fixture(scope="module")
def tiny_reference():
    """The tiny GPT trained in this process: the losses every dense layout must reproduce."""
    return runtime_reference.run_reference(_plan(STDLIB / "local" / "dp.plan"), STEPS).losses


@pytest.mark.parametrize("path", LOCAL, ids=lambda p: p.stem)
def test_local_plan_matches_one_process(path, tiny_reference):
    plan = _plan(path)
    results = run_ranks(plan.mesh.size, train, path, steps=STEPS, check_equivalence=True,
                        deadline_s=60 + 20 * plan.mesh.size)
    assert [r["status"] for r in results] == [0] * plan.mesh.size, results[0]["report_text"]
    report = results[0]["report"]
    assert report["missing"] == () and report["tolerance"] == 1e-5
    assert report["loss_diff"] <= 1e-5 and report["tensor_diff"] <= 1e-5, results[0]["report_text"]
    assert len(results[0]["losses"]) == STEPS
    # every rank reports the same global loss (it is all-reduced)
    assert all(r["losses"] == results[0]["losses"] for r in results)
    if plan.model.experts == 0:
        for step, (got, want) in enumerate(zip(results[0]["losses"], tiny_reference), start=1):
            assert abs(got - want) <= 1e-5 * abs(want), (path.name, step, got, want)
