"""A plan's ZeRO gathering (`data = zero3 over dp with unit = module, prefetch = N | prefetch_bucket = N`) is what
DeepSpeed says (tests/unit/test_interop_deepspeed.py); torchtitan and Megatron-LM cannot say it, and their exports
report it as lost (E808) rather than drop it."""
import pytest

from plandsl import api
from plandsl.interop import export_plan

PLAN = """
import "clusters/dgx_a100"
import "models/llama3"
plan p {{
  model   = llama3_8b
  cluster = dgx_a100
  mesh    = [dp = 8]
  train   = {{ global_batch: 8, micro_batch: 1, recompute: full }}
  data    = zero3 over dp with gather = bf16{gathering}
}}
"""


@pytest.mark.parametrize("target", ["torchtitan", "megatron"])
@pytest.mark.parametrize("gathering", [", unit = module, prefetch_bucket = 50000000", ", prefetch = 2"])
def test_a_gathering_the_target_cannot_say_is_lost(target, gathering):
    plan = api.select_plan(api.loads(PLAN.format(gathering=gathering), path="p.plan"))
    lost = export_plan(plan, target).lost
    assert [d.code for d in lost] == ["E808"] and "gathering" in lost[0].message
    default = api.select_plan(api.loads(PLAN.format(gathering=""), path="p.plan"))
    assert not export_plan(default, target).lost
