"""Blackwell Ultra in the stdlib: `clusters/dgx_b300` (8 x B300 on NVLink 5, 8 x 800 Gb/s ConnectX-8) and
`clusters/gb300_nvl72` (one rack: 72 GB300s in one NVLink domain on 18 trays of 4). Each checks a plan at every
precision it states; the figures are the datasheets' as the files derive them (dense peaks; FP4 given dense by
NVIDIA itself, 1.5 times Blackwell's; 288 GB), and the extra memory is what lets a plan fit that a B200 refuses."""
from __future__ import annotations

import pytest

from plandsl import api, ir
from tests.unit.test_fp8 import PLAN

ULTRA = [("dgx_b300", "dgx_b300 x 2", "b300", "dgx_b200", "b200"),
         ("gb300_nvl72", "gb300_nvl72", "gb300", "gb200_nvl72", "gb200")]


def _device(file: str, name: str) -> ir.DeviceType:
    cluster = api.loads(f'import "clusters/{file}"\ncluster c = {file}\n').clusters[0]
    return next(d for d in cluster.devices_in_order() if d.name == name)


@pytest.mark.parametrize("file, cluster, device, blackwell_file, blackwell", ULTRA)
@pytest.mark.parametrize("precision", ["bf16", "fp8", "mxfp8", "nvfp4"])
def test_a_plan_on_blackwell_ultra_checks_clean(file, cluster, device, blackwell_file, blackwell, precision):
    analysis = api.checks(PLAN.format(devices=f'import "clusters/{file}"', cluster=cluster, precision=precision))
    assert analysis.ok, [d.code for d in analysis.diagnostics]


@pytest.mark.parametrize("file, cluster, device, blackwell_file, blackwell", ULTRA)
def test_blackwell_ultra_raises_memory_and_fp4_only(file, cluster, device, blackwell_file, blackwell):
    ultra, old = _device(file, device), _device(blackwell_file, blackwell)
    assert ultra.memory == 288e9 and ultra.bandwidth == 8e12
    for precision in (ir.Precision.bf16, ir.Precision.fp16, ir.Precision.fp8, ir.Precision.mxfp8):
        assert ultra.peak[precision] == old.peak[precision]  # the same tensor rates below FP4
    assert ultra.peak[ir.Precision.nvfp4] / old.peak[ir.Precision.nvfp4] == pytest.approx(1.5, abs=0.05)
    assert ultra.peak[ir.Precision.nvfp4] > 2 * ultra.peak[ir.Precision.fp8]  # no longer FP8's double


def test_the_nvl72_rack_and_the_dgx_b300_node():
    """GB300 NVL72: 72 devices on 18 trays of 4, one NVLink domain, 72 x 800 Gb/s to the next rack; DGX B300:
    8 devices, 8 x 800 Gb/s, NVLink 5 at the rate the B200's states; each to its host as its Blackwell peer."""
    rack = api.loads('import "clusters/gb300_nvl72"\ncluster c = gb300_nvl72\n').clusters[0]
    node = rack.groups[0].node
    assert rack.num_devices == 72 and len(rack.groups) == 1 and node.devices == 72 and node.hosts == 18
    assert node.nic.bandwidth == 72 * 800e9 / 8
    dgx = api.loads('import "clusters/dgx_b300"\ncluster c = dgx_b300\n').clusters[0].groups[0].node
    b200 = api.loads('import "clusters/dgx_b200"\ncluster c = dgx_b200\n').clusters[0].groups[0].node
    assert dgx.devices == 8 and dgx.nic.bandwidth == 8 * 800e9 / 8
    assert (dgx.link.bandwidth, dgx.link.latency) == (b200.link.bandwidth, b200.link.latency)
    # to the host: the DGX B300's Gen5 CPUs as the B200's slots; a GB300 tray's NVLink-C2C as a GB200's
    assert dgx.device.host_bandwidth == b200.device.host_bandwidth == 55e9
    assert node.device.host_bandwidth == _device("gb200_nvl72", "gb200").host_bandwidth == 225e9


def test_what_a_b200_cannot_hold_a_b300_does():
    text = ('import "clusters/{file}"\nimport "models/llama3"\nplan p {{\n  model = llama3_8b\n'
            '  cluster = {file} x 1\n  mesh = [dp = 8]\n'
            '  train = {{ global_batch: 64, micro_batch: 2, precision: bf16 }}\n  data = zero1 over dp\n}}\n')
    assert [d.code for d in api.checks(text.format(file="dgx_b200")).errors] == ["E503"]
    assert api.checks(text.format(file="dgx_b300")).ok
