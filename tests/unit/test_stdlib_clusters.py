"""The stdlib's clusters that reuse another's figures: clusters/hgx_h800, DeepSeek-AI's training servers (DeepSeek-V3
report, Sec. 3.1 and 3.2.2: the H100's GH100, dgx_h100's h100_80g, with NVLink at the report's 160 GB/s and 8 x 400
Gb/s InfiniBand), and clusters/dgx_a100_40g (the A100 80 GB's die and GEMM knobs in 40 GB of HBM2)."""
from __future__ import annotations

import pytest

from plandsl import api
from plandsl.cost.comm import collective_seconds
from plandsl.cost.layer import plan_links

PLAN = """\
import "clusters/{file}"
plan p {{
  model   = llama(layers=4, hidden=4096, heads=32, seq=4096, vocab=32000)
  cluster = {node} x 2
  mesh    = [dp = 2, tp = 8]
  train   = {{ global_batch: 16, micro_batch: 1 }}
  data    = zero1 over dp
  tensor  = megatron over tp with sequence_parallel
}}
"""


def _links(file: str, node: str):
    return plan_links(api.loads(PLAN.format(file=file, node=node)).plans[0])


def test_the_h800_is_the_h100_with_narrower_nvlink():
    h800, h100 = _links("hgx_h800", "hgx_h800"), _links("dgx_h100", "dgx_h100")
    plan = api.loads(PLAN.format(file="hgx_h800", node="hgx_h800")).plans[0]
    assert plan.cluster.devices_in_order()[0].name == "h100_80g"
    size = 1 << 30  # a large all-gather inside the node: its bandwidth term, 360 / 160 GB/s apart
    ratio = collective_seconds("all_gather", size, h800.tp) / collective_seconds("all_gather", size, h100.tp)
    assert ratio == pytest.approx(360 / 160, rel=0.01)
    assert h800.data.inter_bandwidth == h100.data.inter_bandwidth == 50e9  # 8 x 400 Gb/s out of the node: 50 GB/s a GPU


def test_the_a100_40g_is_the_80g_die_in_half_the_memory():
    """The same plan, a GPT of 3.7B under ZeRO-1 over 16 GPUs: the 80 GB part holds it, the 40 GB part (and AWS's p4d,
    the same GPUs) does not (E503); where both fit, the same GEMMs take the same seconds but the bytes' (HBM2)."""
    text = PLAN.replace("llama(layers=4, hidden=4096, heads=32, seq=4096, vocab=32000)",
                        "gpt(layers=32, hidden=3072, heads=32, seq=2048, vocab=51200)").replace(
        "mesh    = [dp = 2, tp = 8]", "mesh    = [dp = 16]").replace(
        "  tensor  = megatron over tp with sequence_parallel\n", "")
    codes = lambda file, node: [d.code for d in api.checks(text.format(file=file, node=node)).errors]  # noqa: E731
    assert codes("dgx_a100", "dgx_a100") == []
    assert codes("dgx_a100_40g", "dgx_a100_40g") == ["E503"] == codes("dgx_a100_40g", "p4d_24xlarge")
    small = PLAN.format(file="dgx_a100_40g", node="dgx_a100_40g")
    device = api.loads(small).plans[0].cluster.devices_in_order()[0]
    big = api.loads(PLAN.format(file="dgx_a100", node="dgx_a100")).plans[0].cluster.devices_in_order()[0]
    knobs = lambda d: (d.efficiency.matmul, d.efficiency.kernel_latency)  # noqa: E731
    assert (device.peak, knobs(device), device.sms) == (big.peak, knobs(big), big.sms)
    assert device.memory == big.memory / 2 and device.bandwidth < big.bandwidth
