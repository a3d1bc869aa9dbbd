"""`parallel=true` on gpt and llama: GPT-NeoX's parallel residual, x + attn(norm1 x) + mlp(norm2 x) (Black et
al. 2022). The same parameters and FLOPs as the sequential block; one block input kept for both norms
(2·s·b·h bytes less per block), and one tensor-parallel reduction in the forward instead of two (the backward
still reduces each branch's input gradient)."""
from __future__ import annotations

import pytest

from plandsl import api, ir
from plandsl.cost.estimate import estimate_plan
from plandsl.cost.memory import transformer_block_activations
from plandsl.interop import export_plan
from tests.support import lazy

torch = lazy("torch")

PLAN = """\
import "clusters/dgx_a100"
plan p {{
  model    = {family}(layers=8, hidden=1024, heads=16, seq=1024, vocab=51200{parallel})
  cluster  = dgx_a100
  mesh     = [dp = 2, tp = 4]
  train    = {{ global_batch: 16, micro_batch: 2 }}
  data     = zero1 over dp
  tensor   = megatron over tp{sp}
}}
"""


def _plan(family: str = "llama", parallel: bool = False, sp: bool = False) -> ir.Plan:
    return api.loads(PLAN.format(family=family, parallel=", parallel=true" if parallel else "",
                                 sp=" with sequence_parallel" if sp else "")).plans[0]


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_parallel_is_a_family_argument(family):
    assert _plan(family, True).model.parallel_blocks and not _plan(family).model.parallel_blocks
    off = api.loads(PLAN.format(family=family, parallel=", parallel=false", sp="")).plans[0]
    assert not off.model.parallel_blocks


@pytest.mark.parametrize("sp", [False, True])
def test_one_block_input_less_and_one_forward_reduction(sp):
    sequential, parallel = estimate_plan(_plan(sp=sp)), estimate_plan(_plan(parallel=True, sp=sp))
    assert parallel.flops_per_step == pytest.approx(sequential.flops_per_step)
    assert [m.params for m in parallel.memory] == [m.params for m in sequential.memory]
    plan = _plan(sp=sp)
    kept = [transformer_block_activations(p.model, 1024, 2, 4, sp, ir.Recompute.none, ir.Precision.bf16)
            for p in (plan, _plan(parallel=True, sp=sp))]
    assert kept[0] - kept[1] == pytest.approx(2 * 1024 * 2 * 1024 * (1 / 4 if sp else 1))
    assert parallel.time.communication < sequential.time.communication
    from plandsl.cost.estimate import plan_work
    from plandsl.cost.layer import estimate_layer_time, plan_links
    from plandsl.ir.placement import assign_stages
    times = []
    for p in (plan, _plan(parallel=True, sp=sp)):
        block = next(layer for layer in assign_stages(p)[0].stage_layers[0] if layer.kind == "block")
        times.append(estimate_layer_time(p.model, block, plan_work(p), p.cluster.devices_in_order()[0],
                                         plan_links(p)))
    assert times[1].forward_comm == pytest.approx(times[0].forward_comm / 2) and times[1].forward_comm > 0
    assert times[1].backward_comm == pytest.approx(times[0].backward_comm)  # each branch's input gradient reduced


def test_megatron_export_says_it_loses_parallel_blocks():
    lost = export_plan(_plan(parallel=True), "megatron").lost
    assert [d.code for d in lost] == ["E808"] and "parallel blocks" in lost[0].message


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_the_block_adds_both_branches_to_its_input(family):
    from plandsl.runtime.models import Block
    model = _plan(family, True).model.model_copy(update={"hidden": 32, "heads": 4, "kv_heads": 4, "ffn_hidden": 64})
    torch.manual_seed(0)
    block = Block(model)
    x = torch.randn(2, 8, 32)
    ffn = block.mlp
    assert torch.allclose(block(x), x + block.attn(block.norm1(x)) + ffn(block.norm2(x)))
    block.parallel = False
    assert not torch.allclose(block(x), x + block.attn(block.norm1(x)) + ffn(block.norm2(x)))
