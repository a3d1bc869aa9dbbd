"""`plandsl profile --quick` for real, end to end: two gloo processes started by torch's launcher measure this
machine, the file they write checks, and a plan over it is estimated with the measured figures."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import plandsl
from plandsl import api, ir
from plandsl.cost.compute import device_efficiency
from tests.support import run_group

PLAN = """import "lab"
plan p {
  model   = gpt(layers=2, hidden=128, heads=4, seq=64, vocab=256)
  cluster = lab x 1
  mesh    = [dp = 2]
  train   = { global_batch: 4, micro_batch: 1, precision: fp32 }
}
"""


@pytest.mark.slow
def test_profile_quick_on_two_processes_writes_a_cluster_that_estimate_uses(tmp_path: Path):
    root = str(Path(plandsl.__file__).parents[1])  # the plandsl under test, in the ranks too
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    result = run_group([sys.executable, "-m", "plandsl.cli", "profile", "--quick", "--nproc-per-node", "2",
                        "-o", "lab.plan"], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                       timeout=300, env=env)  # on the timeout, torch's launcher's two ranks are ended with it
    assert result.returncode == 0, result.stdout + result.stderr
    assert "wrote lab.plan" in result.stdout and "all_reduce" in result.stdout and "(min " in result.stdout
    text = (tmp_path / "lab.plan").read_text()
    assert "gloo, 2 process(es) per node; --quick" in text and "# Collectives measured" in text
    (tmp_path / "use.plan").write_text(PLAN)
    analysis = api.check(str(tmp_path / "use.plan"))
    assert analysis.ok, api.render_all(analysis.diagnostics, analysis.sources)
    plan = api.load_plan(str(tmp_path / "use.plan"))
    node = plan.cluster.groups[0].node
    assert node.devices == 2 and node.link.bandwidth > 0
    device = node.device
    assert set(device.peak) >= {ir.Precision.fp32, ir.Precision.bf16}
    # The fp32 GEMMs the cost model prices are the measured ones: within the fit's error, or exactly (the table).
    fp32 = device.efficiency.precisions[ir.Precision.fp32]
    knobs = device_efficiency(device)
    for line in text.splitlines():
        if line.startswith("#   fp32"):
            m, n, k = (int(part) for part in line.split(":")[0].split()[2::2])
            fit = abs(int(line.rsplit("fit ", 1)[1].rstrip("%"))) / 100
            seconds = knobs.gemm_seconds(m, n, k, device, ir.Precision.fp32)
            median = _median_seconds(line)
            assert seconds == pytest.approx(median, rel=(2e-3 if fp32.measured else fit + 0.01))
    assert api.estimate(plan).time.step > 0


def _median_seconds(line: str) -> float:
    value, unit = line.split(": ", 1)[1].split(" (")[0].split()
    return float(value) * {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}[unit]
