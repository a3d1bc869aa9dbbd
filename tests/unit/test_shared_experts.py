"""`llama(..., experts=E, top_k=k, shared_experts=S)`: DeepSeekMoE's shared experts, one SwiGLU MLP of S x ffn that
every token runs through beside its top_k routed experts. Counted in the parameters, FLOPs, activations and
time as S more experts per token, dense (split by tp, replicated over ep); Megatron's
--moe-shared-expert-intermediate-size both ways; the interpreter adds the shared MLP's output."""
from __future__ import annotations

import pytest

from plandsl import api, ir
from plandsl.cost.estimate import estimate_plan
from plandsl.interop import export_plan, import_text
from plandsl.ir.layers import layers_of as model_layers
from tests.support import lazy

torch = lazy("torch")

PLAN = """\
import "clusters/dgx_a100"
plan p {{
  model    = llama(layers=4, hidden=1024, heads=16, kv_heads=4, seq=1024, vocab=32000, ffn=1024, experts=8,
                   top_k={top_k}{shared})
  cluster  = dgx_a100
  mesh     = [dp = 2, ep = 2, tp = 2]
  train    = {{ global_batch: 16, micro_batch: 2 }}
  data     = zero1 over dp
  experts  = alltoall over ep
  tensor   = megatron over tp
}}
"""


def _plan(shared: int = 0, top_k: int = 2) -> ir.Plan:
    return api.loads(PLAN.format(shared=f", shared_experts={shared}" if shared else "", top_k=top_k)).plans[0]


def test_shared_experts_are_a_dense_mlp_of_s_times_ffn():
    plan = _plan(2)
    block = next(layer for layer in model_layers(plan.model) if layer.kind == "block")
    shared = {p.name.split(".", 2)[2]: p.shape for p in block.params if ".shared." in p.name}
    assert shared == {"moe.shared.w1.weight": (2048, 1024), "moe.shared.w2.weight": (1024, 2048),
                      "moe.shared.w3.weight": (2048, 1024)}
    plain = next(layer for layer in model_layers(_plan().model) if layer.kind == "block")
    assert sum(p.numel for p in block.params) - sum(p.numel for p in plain.params) == 3 * 2048 * 1024
    # FLOPs per token: two shared experts cost what two more routed experts per token would
    assert block.flops_per_token == next(layer for layer in model_layers(_plan(top_k=4).model)
                                         if layer.kind == "block").flops_per_token


def test_estimate_counts_them_in_time_memory_and_flops():
    plain, shared, wider = (estimate_plan(p) for p in (_plan(), _plan(2), _plan(top_k=4)))
    assert shared.flops_per_step == pytest.approx(wider.flops_per_step)
    assert plain.time.compute < shared.time.compute
    assert plain.memory[0].params < shared.memory[0].params
    assert plain.memory[0].activations < shared.memory[0].activations


def test_shared_experts_need_routed_ones():
    text = ('import "clusters/dgx_a100"\nplan p {\n  model = llama(layers=4, hidden=1024, heads=16, seq=1024, '
            'vocab=32000, shared_experts=2)\n  cluster = dgx_a100\n  mesh = [dp = 8]\n  train = { global_batch: 16 }\n}\n')
    analysis = api.checks(text)
    assert [d.code for d in analysis.errors] == ["E225"], [str(d) for d in analysis.errors]


def test_megatron_shared_expert_size_both_ways():
    plan = _plan(2)
    exported = export_plan(plan, "megatron")
    assert "--moe-shared-expert-intermediate-size 2048" in exported.text
    imported = import_text("megatron", exported.text, "plan.args", world_size=plan.mesh.size, name=plan.name)
    assert imported.ok, [str(d) for d in imported.diagnostics]
    assert api.select_plan(api.loads(imported.text, path="back.plan")).model.shared_experts == 2
    odd = exported.text.replace("--moe-shared-expert-intermediate-size 2048", "--moe-shared-expert-intermediate-size 1500")
    assert "E807" in [d.code for d in import_text("megatron", odd, "plan.args", world_size=plan.mesh.size).diagnostics]


def test_megatron_core_takes_the_shared_expert_size():
    transformer = pytest.importorskip("megatron.core.transformer")
    import dataclasses
    assert "moe_shared_expert_intermediate_size" in {f.name for f in dataclasses.fields(transformer.TransformerConfig)}


def test_the_moe_layer_adds_the_shared_mlp_to_the_routed_experts():
    from plandsl.runtime.models import MoE
    torch.manual_seed(0)
    moe = MoE(16, 32, experts=4, top_k=2, gated=True, shared=2)
    with torch.no_grad():
        for param in moe.parameters():
            param.copy_(torch.randn_like(param) * 0.1)
    x = torch.randn(2, 5, 16)
    with_shared = moe(x)
    shared = moe.shared
    moe.shared = None
    assert torch.allclose(with_shared, moe(x) + shared(x))
    assert shared.w1.weight.shape == (64, 16)
