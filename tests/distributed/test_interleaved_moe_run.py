"""Mixture-of-experts blocks between dense ones (`moe_every`, `moe_offset`) against one process
(`--check-equivalence`): the experts over an expert axis with a pipeline whose stages each hold both kinds of block,
and with the tensor axis folded into the expert group; what `plandsl run --dry-run` builds on each pipeline rank is
what the memory model counts."""
from __future__ import annotations

import pytest

from plandsl.cost.estimate import estimate_plan
from plandsl.runtime.faults import mesh_rank
from tests.distributed.harness import run_ranks
from tests.distributed.ranks import load, train
from tests.support import lazy

dryrun = lazy("plandsl.runtime.dryrun")

pytestmark = pytest.mark.dist

# Llama 4 Maverick's shape at tiny widths: a shared expert beside the routed ones, the dense blocks wider
_INTERLEAVED = """import "clusters/local"
import "local/tiny"
model tiny_interleaved = llama(layers=4, hidden=64, heads=4, kv_heads=2, seq=32, vocab=256, ffn=32, experts=4,
                               top_k=2, shared_experts=1, moe_every={every}, {offset}dense_ffn=96)
plan p {{
  model   = tiny_interleaved
  cluster = localhost
{layout}
}}
"""
_LAYOUTS = {
    # Megatron-LM's --moe-layer-freq 2: blocks 0 and 2 MoE, each stage an MoE block then a dense one
    "pp_ep": ("moe_offset=0, ", """  mesh     = [pp = 2, ep = 2] over devices[0:4]
  train    = tiny_train
  experts  = alltoall over ep
  stages   = evenly over pp
  schedule = 1f1b""", 2),
    # the last block of every four MoE: the first stage holds dense blocks only, its expert ranks idle
    "pp_ep_dense_stage": ("", """  mesh     = [pp = 2, ep = 2] over devices[0:4]
  train    = tiny_train
  experts  = alltoall over ep
  stages   = evenly over pp
  schedule = 1f1b""", 4),
    # Hugging Face's: blocks 1 and 3 MoE
    "ep_tp_folded": ("", """  mesh    = [ep = 2, tp = 2] over devices[0:4]
  train   = tiny_train
  data    = zero2 over ep
  tensor  = megatron over tp with sequence_parallel
  experts = alltoall over [ep, tp]""", 2),
}


@pytest.mark.parametrize("layout", list(_LAYOUTS))
def test_interleaved_experts_match_one_process(layout):
    offset, body, every = _LAYOUTS[layout]
    plan = _INTERLEAVED.format(offset=offset, layout=body, every=every)
    results = run_ranks(4, train, plan, steps=2, check_equivalence=True, deadline_s=150)
    assert [r["status"] for r in results] == [0] * 4, results[0]["report_text"]
    report = results[0]["report"]
    assert report["loss_diff"] <= 1e-5 and report["tensor_diff"] <= 1e-5, results[0]["report_text"]


@pytest.mark.xdist_group("torch")
@pytest.mark.parametrize("layout", ["pp_ep", "pp_ep_dense_stage"])
def test_dry_run_states_are_the_estimates_block_by_block(layout):
    """Each pipeline rank's parameter, gradient and optimizer bytes as built (the experts over ep on the MoE blocks
    only, the dense blocks whole) equal the estimate's, which sizes each block as its kind."""
    offset, body, every = _LAYOUTS[layout]
    plan = load(_INTERLEAVED.format(offset=offset, layout=body, every=every))
    estimate = estimate_plan(plan)
    ranks = [mesh_rank(plan, {"pp": r, "ep": 0}) for r in range(plan.pp)]
    result = dryrun.dry_run(plan, ranks)
    for pipeline_rank, built in enumerate(result.ranks):
        predicted = estimate.memory[pipeline_rank]
        assert (built.param_bytes, built.grad_bytes, built.most_loaded_optimizer_bytes) == \
            (predicted.params - predicted.gathered_params, predicted.grads, predicted.optimizer), (layout, pipeline_rank)
        assert predicted.gathered_params > 0  # `replicate`'s copy of the stage (`cost.memory.replicate_copy_bytes`)
