"""Megatron-Core's MoE parallel folding, `experts = alltoall over [ep, tp]`: the IR and the checker (E416), the cost
model against hand counts (each expert whole, the all-to-all over the ep x tp ranks inside a node, no tensor-parallel
pair in the MoE half, the experts' parameters per device), `run` taking it (tests/distributed/
test_model_variants_run.py runs it against one process) and Megatron's flags both ways
(--expert-tensor-parallel-size 1)."""
from __future__ import annotations

import pytest

from plandsl import api, ir
from plandsl.cost.comm import collective_seconds
from plandsl.cost.layer import plan_links
from plandsl.cost.memory import local_numel, model_state_bytes
from plandsl.interop import export_plan, import_text
from plandsl.ir.layers import layers_of
from plandsl.rewrite.complete import generate_from
from plandsl.runtime.support import refusals
from plandsl.search import Problem, SearchError, search
from test_moe_cost import _block_time  # the block's time and compute on the plan's first device

# Qwen3-30B-A3B's block shapes on one DGX H100 node: 128 experts, top 8, hidden 2048, experts 768 wide
PLAN = """\
import "clusters/dgx_h100"
plan p {{
  model   = llama(layers=4, hidden=2048, heads=32, kv_heads=4, head_dim=128, ffn=768, experts=128, top_k=8,
                  vocab=151936, seq=4096{shared})
  cluster = dgx_h100 x 1
  mesh    = [ep = 4, tp = 2]
  train   = {{ global_batch: 16, micro_batch: 1 }}
  tensor  = megatron over tp{sp}
  experts = alltoall over {over}
}}
"""


def _plan(over="[ep, tp]", sp=True, shared=0) -> ir.Plan:
    text = PLAN.format(over=over, sp=" with sequence_parallel" if sp else "",
                       shared=f", shared_experts={shared}" if shared else "")
    return api.loads(text).plans[0]


def test_the_folded_group_in_the_ir_and_unfolded_dumps_unchanged():
    folded, split = _plan(), _plan(over="ep")
    assert (folded.experts.axis, folded.experts.fold, folded.experts.axes) == ("ep", ("tp",), ("ep", "tp"))
    assert (folded.ep, folded.expert_group, folded.expert_tp, folded.dp) == (4, 8, 1, 4)
    assert (split.ep, split.expert_group, split.expert_tp) == (4, 4, 2)
    assert folded.model_dump()["experts"]["fold"] == ("tp",)
    assert "fold" not in split.model_dump()["experts"]  # plans without folding dump and hash as before
    assert api.format_text(PLAN.format(over="[ep, tp]", sp=" with sequence_parallel", shared="")).count(
        "experts = alltoall over [ep, tp]") == 1


def _codes(text: str) -> list[str]:
    return [d.code for d in api.checks(text).diagnostics if d.severity == "error"]


def test_e416_folding_needs_the_tensor_axis_and_sequence_parallelism():
    assert _codes(PLAN.format(over="[ep, tp]", sp=" with sequence_parallel", shared="")) == []
    assert _codes(PLAN.format(over="[ep, tp]", sp="", shared="")) == ["E416"]
    stages = PLAN.replace("[ep = 4, tp = 2]", "[pp = 2, ep = 2, tp = 2]").replace(
        "  experts", "  stages  = evenly over pp\n  experts")
    found = [d for d in api.checks(stages.format(over="[ep, pp]", sp=" with sequence_parallel", shared="")).diagnostics
             if d.severity == "error"]
    assert [d.code for d in found] == ["E416"] and "'pp' (2), which splits the pipeline stages" in found[0].message


def test_e406_counts_the_folded_group():
    text = PLAN.format(over="[ep, tp]", sp=" with sequence_parallel", shared="").replace("experts=128", "experts=4")
    found = [d for d in api.checks(text).diagnostics if d.code == "E406"]
    assert len(found) == 1 and "experts (4) is not divisible by axis 'ep x tp' (8)" in found[0].message


def test_folded_experts_by_hand():
    """Each of the 2 tensor ranks dispatches its own 2,048 of the 4,096 tokens (sequence parallel), 8 copies of each,
    2,048 x 2 bytes: 67 MB per all-to-all over the node's 8 ranks (4 times a step), the same bytes as when the
    experts split over tp; 16 local experts whole (768 wide) instead of 32 half-experts (384 wide), the same
    FLOPs; and the MoE half's sequence-parallel all-gather + reduce-scatter of 8 x [b, s, h] is gone, leaving the
    attention half's [b, s, h] pair, once forward and once backward (2 x 16.8 MB each); split over tp, the MoE half
    gathers and scatters the 8 routed copies both ways instead."""
    folded, split = _plan(), _plan(over="ep")
    (time_f, compute_f), (time_s, compute_s) = _block_time(folded), _block_time(split)
    routed = 4096 // 2 * 8 * 2048 * 2
    assert time_f.moved.expert == pytest.approx(4 * routed) == time_s.moved.expert
    links = plan_links(folded)
    assert (links.ep.size, links.ep.local, links.ep.nodes) == (8, 8, 1)
    assert (plan_links(split).ep.size, links.tp.size, links.expert_data.size) == (4, 2, 1)
    assert compute_f.flops == pytest.approx(compute_s.flops)
    activation = 4096 * 2048 * 2
    assert time_f.moved.tensor == pytest.approx(2 * 2 * activation)
    assert time_s.moved.tensor == pytest.approx(2 * 2 * activation + 2 * 2 * 8 * activation)
    a2a_f = collective_seconds("all_to_all", routed, links.ep)
    pair = collective_seconds("all_gather", activation, links.tp) + collective_seconds("reduce_scatter", activation,
                                                                                      links.tp)
    assert time_f.forward_comm == pytest.approx(pair + 2 * a2a_f)
    assert time_f.backward_comm == pytest.approx(pair + 2 * a2a_f)


def test_shared_experts_keep_their_tensor_pair():
    time_f, _ = _block_time(_plan(shared=1))
    activation = 4096 * 2048 * 2
    assert time_f.moved.tensor == pytest.approx(4 * 2 * activation)  # both halves' pairs, as a dense block


def test_expert_parameters_per_device_whole():
    """128 experts x 3 x 768 x 2,048 per block, 4 blocks: over 8 ranks whole (16 each) = over 4 ranks split over 2
    (32 halves each); the dense parameters split over tp either way: the same bytes."""
    folded, split = _plan(), _plan(over="ep")
    blocks = [layer for layer in layers_of(folded.model) if layer.kind == "block"]
    params_f, _, _ = model_state_bytes(folded, blocks)
    params_s, _, _ = model_state_bytes(split, blocks)
    assert params_f == pytest.approx(params_s)
    expert = next(p for p in blocks[0].params if len(p.dims) == 3)
    assert local_numel(expert, 2, 8, 1) == expert.shape[0] // 8 * expert.shape[1] * expert.shape[2]
    assert local_numel(expert, 2, 4) == expert.shape[0] // 4 * expert.shape[1] // 2 * expert.shape[2]


def test_run_takes_the_folded_layout():
    assert [d.code for d in refusals(_plan(), cuda=False)] == []


def test_megatron_flags_both_ways():
    exported = export_plan(_plan(), "megatron")
    assert not exported.lost
    assert "--expert-model-parallel-size 8" in exported.text and "--expert-tensor-parallel-size 1" in exported.text
    assert "--expert-tensor-parallel-size" not in export_plan(_plan(over="ep"), "megatron").text
    imported = import_text("megatron", exported.text, "plan.args", world_size=8)
    assert imported.ok
    plan = api.loads(imported.text).plans[0]
    assert (plan.experts.axes, plan.expert_group, plan.expert_tp) == (("ep", "tp"), 8, 1)


def test_the_search_pins_the_expert_group_over_the_tensor_axis():
    """On 32 H100s with tp 2 and pp 2 the batch axes hold 8 ranks: an expert group of 16 exists only folded over tp
    (ep 8 x tp 2, Megatron's EP 16 beside TP 2), and the search prices it as `estimate` prices the plan written so."""
    document = api.loads('import "clusters/dgx_h100"\n'
                         "model m = llama(layers=4, hidden=2048, heads=16, kv_heads=4, ffn=768, experts=64, top_k=4, "
                         "vocab=32000, seq=4096)\ncluster c = dgx_h100 x 4\n")
    model, cluster = document.models[0], document.clusters[-1]
    pins = {"tp": 2, "pp": 2, "ep": 16, "cp": 1, "micro_batch_size": 1, "schedule": "1f1b", "zero_stage": 1,
            "recompute": "none"}
    with pytest.raises(SearchError, match="does not divide the 32 devices"):
        search(Problem(model, cluster, 64), pins, top=1)
    best = search(Problem(model, cluster, 64, fold_experts=True), pins, top=1).best
    c = best.candidate
    assert (c.dp, c.tp, c.pp, c.ep) == (1, 2, 2, 8)
    mesh = ", ".join(f"{axis} = {c.degrees()[axis]}" for axis in c.order)
    plan = api.loads(f"""import "clusters/dgx_h100"
plan p {{
  model    = llama(layers=4, hidden=2048, heads=16, kv_heads=4, ffn=768, experts=64, top_k=4, vocab=32000, seq=4096)
  cluster  = dgx_h100 x 4
  mesh     = [{mesh}]
  train    = {{ global_batch: 64, micro_batch: 1, recompute: none }}
  data     = zero1 over ep
  tensor   = megatron over tp with sequence_parallel
  experts  = alltoall over [ep, tp]
  stages   = evenly over pp
  schedule = 1f1b
}}
""").plans[0]
    assert api.estimate(plan).time.step == pytest.approx(best.estimate.time.step, rel=1e-9)


def test_generate_from_keeps_folded_experts_without_a_mesh(tmp_path):
    """A partial plan that folds its experts over its tensor line's axis leaves the search the mesh: it lays out ep
    and tp (an expert axis to fold into), prices the experts folded, and the completed file checks as written; with
    the tensor axis at 1 the fold is the plain layout; `run` takes both."""
    path = tmp_path / "partial.plan"
    path.write_text('import "clusters/dgx_h100"\nplan r {\n'
                    "  model   = llama(layers=8, hidden=2048, heads=16, kv_heads=4, seq=4096, vocab=32000, experts=16)\n"
                    "  cluster = dgx_h100 x 2\n  train   = { global_batch: 32 }\n"
                    "  tensor  = megatron over tp with sequence_parallel\n  experts = alltoall over [ep, tp]\n}\n")
    for pins, refused in (({"tp": "2"}, []), ({"tp": "1"}, [])):
        text = generate_from(path, top=1, pins=pins).texts[0]
        assert "experts = alltoall over [ep, tp]" in text
        plan = api.loads(text).plans[0]
        assert (plan.tp, plan.expert_group) == (int(pins["tp"]), plan.ep * int(pins["tp"])) and plan.ep > 1
        assert [d.code for d in refusals(plan, cuda=False)] == refused
