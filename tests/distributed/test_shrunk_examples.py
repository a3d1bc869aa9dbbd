"""Every cluster-sized example, scaled down by `plandsl shrink`, trains on one machine like one process.

The examples in stdlib_plans/examples/ are written for clusters of 8 to 1,024 GPUs. `shrink` keeps
each one's layout (axes, parallelisms, stage list, schedule, shard rules, training settings) at a
tiny size on 2 to 4 processes (8 for a stage list of 8); here each trains for two steps on forked gloo ranks with
`--check-equivalence` in fp32, so the tolerance is the documented 1e-5, and one keeps its bf16.
"""
from __future__ import annotations

import pytest

from plandsl.rewrite.shrink import shrink
from tests.conftest import STDLIB
from tests.distributed.harness import run_ranks
from tests.distributed.ranks import train

pytestmark = pytest.mark.dist

EXAMPLES = sorted((STDLIB / "examples").glob("*.plan"))
STEPS = 2


def _train_shrunk(path, tmp_path, precision, ranks=8):
    shrunk = shrink(path, precision=precision, out_dir=tmp_path, ranks=ranks)
    small = tmp_path / path.name
    small.write_text(shrunk.text)
    results = run_ranks(shrunk.ranks, train, str(small), steps=STEPS, check_equivalence=True,
                        deadline_s=60 + 30 * shrunk.ranks)
    assert [r["status"] for r in results] == [0] * shrunk.ranks, results[0]["report_text"]
    assert all(r["losses"] == results[0]["losses"] for r in results) and len(results[0]["losses"]) == STEPS
    print(f"{path.stem} ({shrunk.ranks} processes): {results[0]['report_text']}")  # the figures, with -s
    return shrunk, results[0]["report"]


# The examples shrunk to 4 processes (their data axis dropped first, `shrink`'s order, or the schedule table's tensor axis)
# but the stage list of 8, which needs 8: an 8-rank run costs twice a 4-rank one on the CI's 2 cores, and each
# example's own constructs (its schedule, stage list, shard rules, context and expert axes) stay; the data axis beside
# them trains in test_parallelisms and test_local_plans (stdlib_plans/local/3d.plan: data x pipeline x tensor on 8)
EIGHT = {"uneven_pipeline"}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_the_shrunk_example_matches_one_process(path, tmp_path):
    shrunk, report = _train_shrunk(path, tmp_path, "fp32", ranks=8 if path.stem in EIGHT else 4)
    assert 2 <= shrunk.ranks <= (8 if path.stem in EIGHT else 4)
    assert report["missing"] == () and report["tolerance"] == 1e-5
    assert report["loss_diff"] <= 1e-5 and report["param_diff"] <= 1e-5, report


def test_a_shrunk_example_keeps_its_bf16(tmp_path):
    """On 4 processes, pipeline (interleaved) x tensor (with sequence parallelism) in bf16; the data axis, which
    shrink drops first, reduces bf16 gradients in test_parallelisms' bf16_fsdp."""
    shrunk, report = _train_shrunk(STDLIB / "examples" / "gpt3_175b_3d.plan", tmp_path, None, ranks=4)
    assert [(a.name, a.size) for a in shrunk.plan.mesh.axes] == [("dp", 1), ("pp", 2), ("tp", 2)]
    assert shrunk.plan.train.precision.value == "bf16" and report["tolerance"] == 2e-2
    assert report["loss_diff"] <= 2e-2 and report["param_diff"] <= 2e-2, report
