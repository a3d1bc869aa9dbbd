"""A device's SM count (`sms`, docs/language.md "Devices"): a positive whole number, capped; where a device states
it, NCCL's default share of its compute (`comm_share`) and userbuffers' are their SMs over it; `comm_share` stays an
override. Expected shares are worked out here from the counts, not read back from the model."""
from __future__ import annotations

import pytest

from plandsl import api, ir
from plandsl.cost.compute import UB_COMM_SMS, userbuffers_share
from plandsl.diagnostics.limits import MAX_SMS

DEVICE = """\
device g {{ memory = 80 GiB; bandwidth = 2 TB/s; peak = {{ bf16: 312 TFLOP/s }}{extra} }}
"""


def _device(extra: str) -> ir.DeviceType:
    [device] = api.loads(DEVICE.format(extra=extra)).devices
    return device


def _codes(extra: str) -> list[str]:
    return [d.code for d in api.checks(DEVICE.format(extra=extra)).diagnostics]


def test_sms_sets_nccls_and_userbuffers_shares():
    """24 NCCL channels and 16 userbuffers SMs of a B200's 148; of a V100's 80."""
    b200 = _device("; sms = 148")
    assert b200.sms == 148 and b200.comm_share is None
    assert b200.contention == pytest.approx(24 / 148) and userbuffers_share(b200) == pytest.approx(16 / 148)
    assert _device("; sms = 80").contention == pytest.approx(24 / 80)
    assert UB_COMM_SMS == 16 and ir.NCCL_CHANNELS == 24


def test_comm_share_overrides_sms_and_unstated_counts_keep_the_h100s():
    stated = _device("; sms = 148; comm_share = 0.05")
    assert stated.contention == 0.05 and userbuffers_share(stated) == pytest.approx(16 / 148)
    unstated = _device("")
    assert unstated.sms is None and unstated.contention == pytest.approx(24 / 132)
    assert userbuffers_share(unstated) == pytest.approx(16 / 132)
    assert userbuffers_share(_device("; comm_share = 0.3")) == pytest.approx(0.3 * 16 / 24)  # as before `sms`


def test_a_small_gpu_gives_at_most_half_its_sms():
    """A 16-SM GPU: NCCL's 24 channels and userbuffers' 16 SMs are capped at half of it (8)."""
    small = _device("; sms = 16")
    assert small.contention == pytest.approx(0.5) and userbuffers_share(small) == pytest.approx(0.5)
    assert _device("; sms = 48").contention == pytest.approx(0.5)
    assert _device("; sms = 49").contention == pytest.approx(24 / 49)


def test_a_device_without_sms_dumps_as_before():
    assert "sms" not in _device("").model_dump()
    assert _device("; sms = 132").model_dump()["sms"] == 132


def test_sms_below_one_is_e205():
    assert _codes("; sms = 0") == ["E205"] and _codes("; sms = -3") == ["E205"]


def test_sms_not_a_whole_number_is_e211():
    assert _codes("; sms = 131.5") == ["E211"]


def test_sms_past_the_cap_is_e505():
    assert _codes(f"; sms = {MAX_SMS + 1}") == ["E505"]
    assert _codes(f"; sms = {MAX_SMS}") == [] and _codes("; sms = 33 * 4") == []


@pytest.mark.parametrize("cluster, device, sms", [("dgx_a100", "a100_80g", 108), ("a100_pcie", "a100_40g_pcie", 108),
                                                  ("dgx_h100", "h100_80g", 132), ("dgx_h200", "h200_141g", 132),
                                                  ("dgx_b200", "b200", 148), ("gb200_nvl72", "gb200", 152),
                                                  ("dgx_b300", "b300", 148), ("gb300_nvl72", "gb300", 152),
                                                  ("dgx1_v100", "v100_32g", 80), ("dgx_a100_40g", "a100_40g", 108)])
def test_stdlib_devices_state_their_sms(cluster, device, sms):
    text = (f'import "clusters/{cluster}"\nplan p {{ model = gpt(layers=2, hidden=64, heads=2, seq=64, vocab=128)\n'
            f' cluster = {cluster} x 1\n mesh = [dp = 1]\n train = {{ global_batch: 8, precision: fp32 }}\n}}\n')
    devices = {g.node.device.name: g.node.device for g in api.loads(text).plans[0].cluster.groups}
    assert devices[device].sms == sms
    assert devices[device].contention == pytest.approx(24 / sms)  # dgx_a100's 24 / 108 as it stated it before
