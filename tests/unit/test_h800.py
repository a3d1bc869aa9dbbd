"""clusters/hgx_h800: DeepSeek-AI's training servers (DeepSeek-V3 report, Sec. 3.1 and 3.2.2): the H100's GH100
(the device is dgx_h100's h100_80g) with NVLink at the report's 160 GB/s and 8 x 400 Gb/s InfiniBand."""
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
