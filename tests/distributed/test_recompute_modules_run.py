"""`recompute: selective, recompute_modules: [...]` (Megatron-Core's --recompute-modules) against one process
(`--check-equivalence`): every module on a tiny DeepSeek-style model (MLA, a dense block before the MoE ones, routed
and shared experts) over a pipeline with an expert axis, over tensor parallelism with sequence parallelism (the norms'
and up-projections' outputs DTensor shards), the whole MoE rerun under FSDP, and the norms rerun where each is an FSDP unit of its own (`unit = module`)."""
from __future__ import annotations

import pytest

from tests.distributed.harness import run_ranks
from tests.distributed.ranks import train

pytestmark = [pytest.mark.dist, pytest.mark.xdist_group("torch")]

_PLAN = """import "clusters/local"
model tiny_deepseek = llama(layers=4, hidden=64, heads=4, seq=32, vocab=256, kv_lora_rank=32, q_lora_rank=24,
                            qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, experts=4, top_k=2,
                            shared_experts=1, ffn=32, dense_layers=1, dense_ffn=96)
plan p {{
  model   = tiny_deepseek
  cluster = localhost
  train   = {{ global_batch: 8, micro_batch: 1, precision: fp32, optimizer: adam, lr: 1e-3, seed: 0,
              recompute: selective, recompute_modules: [{modules}] }}
{layout}
}}
"""
_LAYOUTS = {
    "pp_ep": ("core_attn, layernorm, moe_act, mla_up_proj, mlp, shared_experts", """  mesh     = [pp = 2, ep = 2] over devices[0:4]
  experts  = alltoall over ep
  stages   = evenly over pp
  schedule = 1f1b"""),
    "zero_bubble": ("core_attn, mlp, shared_experts", """  mesh     = [pp = 2] over devices[0:2]
  stages   = evenly over pp
  schedule = zb_h1"""),
    "tp_sequence_parallel": ("layernorm, moe_act, mla_up_proj", """  mesh    = [dp = 2, tp = 2] over devices[0:4]
  data    = zero2 over dp
  tensor  = megatron over tp with sequence_parallel"""),
    "context_ring": ("layernorm, moe_act, mla_up_proj", """  mesh    = [dp = 2, cp = 2] over devices[0:4]
  data    = zero2 over dp
  context = ring over cp"""),
    "fsdp_moe": ("moe, layernorm", """  mesh    = [dp = 2, ep = 2] over devices[0:4]
  data    = zero3 over dp
  experts = alltoall over ep"""),
    # each norm an FSDP unit of its own, resharded after its forward: the rebuild ran the norm on its shard of the
    # weight before the norm's own pre-backward gathered it ("mixed torch.Tensor and DTensor"); a plan check accepted
    "fsdp_module_units": ("layernorm, moe_act", """  mesh    = [dp = 2, cp = 2] over devices[0:4]
  data    = zero3 over dp with unit = module
  context = allgather over cp"""),
}


@pytest.mark.parametrize("layout", list(_LAYOUTS))
def test_recompute_modules_match_one_process(layout):
    modules, body = _LAYOUTS[layout]
    ranks = 2 if layout == "zero_bubble" else 4
    results = run_ranks(ranks, train, _PLAN.format(modules=modules, layout=body), steps=2, check_equivalence=True,
                        deadline_s=150)
    assert [r["status"] for r in results] == [0] * ranks, results[0]["report_text"]
    report = results[0]["report"]
    assert report["loss_diff"] <= 1e-5 and report["tensor_diff"] <= 1e-5, results[0]["report_text"]
