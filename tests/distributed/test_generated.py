"""A plan `plandsl generate` writes runs: on one machine, for a small model, it trains like one process.

The partial plan names the tiny GPT, a node of two CPU devices and tiny.plan's training settings; the
search fills in the layout (the best one, and the best with tp, pp or cp pinned to 2, and pp with
selective_op), and each trains for two steps on 2
forked gloo ranks with `--check-equivalence`.
"""
from __future__ import annotations

import re

import pytest
from click.testing import CliRunner

from plandsl.cli import main
from tests.distributed.harness import run_ranks
from tests.distributed.ranks import train

pytestmark = pytest.mark.dist

PARTIAL = '''import "clusters/local"
import "local/tiny"

node two_cpus {
  devices = 2 x cpu
  link    = { bandwidth: 5 GB/s, latency: 20 us }
}

plan searched {
  model   = tiny_gpt
  cluster = two_cpus
  train   = tiny_train
}
'''


@pytest.mark.parametrize("pins", [[], ["tp=2"], ["pp=2"], ["cp=2"], ["pp=2", "recompute=selective_op"]],
                         ids=["best", "tp", "pp", "cp", "pp_selective_op"])
def test_the_generated_plan_trains_like_one_process(tmp_path, pins):
    path, plan_file = tmp_path / "partial.plan", tmp_path / "generated.plan"
    path.write_text(PARTIAL)
    args = ["generate", "--from", str(path), "--top", "1", "-o", str(plan_file)]
    out = CliRunner().invoke(main, args + [f"--pin={pin}" for pin in pins])
    assert out.exit_code == 0, out.output
    assert "plan searched {" in plan_file.read_text()
    if "cp=2" in pins:
        assert re.search(r"^\s*context\s*=\s*allgather over cp\s*$", plan_file.read_text(), re.M)
    if "recompute=selective_op" in pins:  # with a schedule that runs the backward in one pass (E703)
        from plandsl import api
        from plandsl.schedules.registry import splits_backward
        [plan] = api.load(str(plan_file)).plans
        assert plan.train.recompute.value == "selective_op" and not splits_backward(plan.schedule.name)
    results = run_ranks(2, train, str(plan_file), steps=2, check_equivalence=True, deadline_s=100)
    assert [r["status"] for r in results] == [0, 0], results[0]["report_text"]
    report = results[0]["report"]
    assert report["loss_diff"] <= 1e-5 and report["tensor_diff"] <= 1e-5, results[0]["report_text"]
