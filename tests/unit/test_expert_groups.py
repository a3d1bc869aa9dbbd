"""Group-limited routing (`llama(..., expert_groups=G, group_top_k=M)`: DeepSeek-V2's device-limited and DeepSeek-V3's
node-limited routing): the router against Megatron-Core's own `topk_routing_with_score_function`, the checker's
rules (E235), the flex dispatchers' network bytes against a simulation of the router, and the Megatron-LM flags
both ways."""
from __future__ import annotations

import pytest

from plandsl import api
from plandsl.cost.comm import nodes_reached, nodes_reached_grouped
from plandsl.cost.layer import estimate_layer_time, plan_links
from plandsl.cost.estimate import plan_work
from plandsl.ir.layers import layers_of
from tests.support import lazy

torch = lazy("torch")


def _route(logits, top_k: int, groups: int, group_top_k: int):
    """plandsl's MoE router on `logits`: (the chosen experts as a [tokens, experts] map, their weights in it)."""
    from plandsl.runtime.models import limit_groups
    if top_k == 1:  # the chosen expert's probability over all of them (Megatron's --moe-router-pre-softmax)
        weights, chosen = limit_groups(logits.softmax(dim=-1), 1, groups, group_top_k).topk(1, dim=-1)
    else:
        scores, chosen = limit_groups(logits, top_k, groups, group_top_k).topk(top_k, dim=-1)
        weights = scores.softmax(dim=-1)
    return torch.zeros_like(logits).scatter(1, chosen, weights)


@pytest.mark.parametrize("experts, top_k, groups, group_top_k", [
    (16, 4, 4, 2), (64, 8, 8, 4), (256, 8, 8, 4), (12, 3, 3, 3), (16, 1, 4, 1), (8, 2, 8, 2), (64, 6, 8, 3)])
def test_the_router_chooses_as_megatron_core_does(experts, top_k, groups, group_top_k):
    """The same experts and weights as megatron-core 0.16.1's `topk_routing_with_score_function` with `num_groups`
    and `group_topk` (softmax scores, the default; top-1 with --moe-router-pre-softmax, as `export` writes it)."""
    moe_utils = pytest.importorskip("megatron.core.transformer.moe.moe_utils")
    generator = torch.Generator().manual_seed(experts * 100 + top_k)
    logits = torch.randn(400, experts, generator=generator)
    probs, routing_map = moe_utils.topk_routing_with_score_function(
        logits, top_k, use_pre_softmax=top_k == 1, num_groups=groups, group_topk=group_top_k)
    mine = _route(logits, top_k, groups, group_top_k)
    assert torch.equal(mine != 0, routing_map)
    assert torch.allclose(mine, probs, atol=1e-6)
    ungrouped = _route(logits, top_k, 0, 0)
    if top_k > group_top_k and group_top_k < groups:  # else the best groups by their best score hold the top_k
        assert not torch.equal(ungrouped != 0, routing_map)  # the groups do limit the choice


def test_every_expert_a_token_chooses_lies_in_its_best_groups():
    from plandsl.runtime.models import MoE
    moe = MoE(hidden=16, ffn=8, experts=32, top_k=4, gated=True, groups=8, group_top_k=2)
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(0))
    chosen = _route(moe.router(x), 4, 8, 2) != 0
    groups_hit = chosen.view(64, 8, 4).any(dim=-1).sum(dim=-1)
    assert (groups_hit <= 2).all() and (chosen.sum(dim=-1) == 4).all()
    assert moe(x.view(4, 16, 16)).shape == (4, 16, 16)


@pytest.mark.parametrize("groups, group_top_k", [(5, 2), (4, 5), (4, 0), (16, 3)])
def test_the_module_refuses_groups_that_cannot_route(groups, group_top_k):
    from plandsl.runtime.models import MoE
    with pytest.raises(ValueError, match="cannot route"):
        MoE(hidden=16, ffn=8, experts=16, top_k=4, gated=True, groups=groups, group_top_k=group_top_k)


PLAN = """\
import "clusters/dgx_h100"
plan p {{
  model   = llama(layers=4, hidden=1024, heads=16, seq=256, vocab=1000, ffn=256, experts={experts}, top_k={top_k}{groups})
  cluster = dgx_h100 x 1
  mesh    = [dp = 8]
  train   = {{ global_batch: 64, micro_batch: 2 }}
}}
"""


@pytest.mark.parametrize("experts, top_k, groups, message", [
    (16, 4, "expert_groups=5, group_top_k=2", "expert_groups (5) does not divide experts (16)"),
    (16, 4, "expert_groups=4", "expert_groups=4 without group_top_k"),
    (16, 4, "group_top_k=2", "group_top_k=2 without expert_groups"),
    (16, 4, "expert_groups=4, group_top_k=5", "group_top_k (5) exceeds expert_groups (4)"),
    (16, 2, "expert_groups=4, group_top_k=3", "group_top_k (3) exceeds top_k (2)"),
    (16, 4, "expert_groups=8, group_top_k=1", "hold 2 experts (16 / 8 a group), fewer than top_k (4)"),
    (0, 0, "expert_groups=4, group_top_k=2", "which has no experts"),
])
def test_e235_says_which_rule_the_groups_break(experts, top_k, groups, message):
    moe = f"experts={experts}, top_k={top_k}, " if experts else ""
    text = PLAN.format(experts=experts, top_k=top_k, groups=", " + groups).replace(
        f"experts={experts}, top_k={top_k}, ", moe)
    analysis = api.checks(text, path="groups.plan")
    found = [d for d in analysis.diagnostics if d.severity == "error"]
    assert [d.code for d in found] == ["E235"], [str(d) for d in found]
    assert message in found[0].message


def test_a_model_with_groups_checks_and_dumps_them():
    plan = api.loads(PLAN.format(experts=256, top_k=8, groups=", expert_groups=8, group_top_k=4")).plans[0]
    assert (plan.model.expert_groups, plan.model.group_top_k) == (8, 4)
    dense = api.loads(PLAN.format(experts=256, top_k=8, groups="")).plans[0].model
    assert "expert_groups" not in dense.model_dump_json()  # a model without groups dumps as before they existed


@pytest.mark.parametrize("experts, top_k, groups, group_top_k, nodes", [
    (256, 8, 8, 4, 8),    # DeepSeek-V3 as deployed: a group a node
    (256, 8, 8, 4, 4),    # two groups a node
    (256, 8, 32, 4, 8),   # four groups a node
    (160, 6, 8, 3, 4),
    (64, 6, 8, 3, 3),     # groups and nodes out of step
    (96, 6, 6, 3, 4),
    (256, 8, 8, 4, 16),   # a group over two nodes: the token's experts bunch inside a group more than uniformly
    (256, 8, 8, 8, 8),    # every group chosen: the ungrouped routing
    (256, 8, 64, 2, 8),   # the chosen groups hold exactly top_k experts
    (256, 8, 256, 8, 8),  # a group an expert
    (256, 5, 8, 4, 8),    # top_k // group_top_k < top_k / group_top_k: a chosen group may hold none
])
def test_the_nodes_a_token_reaches_match_the_router(experts, top_k, groups, group_top_k, nodes):
    """The other nodes a token's copies cross to (`nodes_reached_grouped`), against plandsl's router run on random
    logits with the experts in consecutive blocks of experts / nodes per node and the token's own node at random;
    fewer than without groups (`nodes_reached`)."""
    from plandsl.runtime.models import limit_groups
    generator = torch.Generator().manual_seed(nodes * 1000 + experts)
    tokens = 20_000
    logits = torch.randn(tokens, experts, generator=generator)
    chosen = limit_groups(logits, top_k, groups, group_top_k).topk(top_k, dim=-1).indices
    hit = torch.zeros(tokens, nodes).scatter_(1, chosen * nodes // experts, 1)
    own = torch.randint(0, nodes, (tokens,), generator=generator)
    simulated = (hit.sum(dim=1) - hit[torch.arange(tokens), own]).mean().item()
    modelled = nodes_reached_grouped(experts, top_k, nodes, groups, group_top_k)
    assert modelled == pytest.approx(simulated, rel=0.07)
    assert modelled <= nodes_reached(experts, top_k, nodes) + 1e-9
    if groups % nodes == 0 or groups == nodes:
        assert modelled <= group_top_k * (nodes - 1) / nodes + 1e-9


def test_huge_group_counts_stay_finite():
    assert 0 < nodes_reached_grouped(65536, 64, 64, 32768, 64) < 64


def test_many_groups_a_node_sum_one_term_per_chosen_count():
    """16,384 groups on each of 2 nodes, 16,384 of them chosen: the mean over the chosen sets sums over how many
    of the node's groups are chosen (at most group_top_k + 1 terms, milliseconds), where an elementary symmetric sum
    over the node's groups took minutes (the counts E235 and the limits allow)."""
    assert 0 < nodes_reached_grouped(65536, 64, 2, 32768, 64) <= 1
    assert 0 < nodes_reached_grouped(65536, 32768, 2, 32768, 16384) <= 1


def test_shrink_keeps_the_groups(tmp_path):
    from plandsl.rewrite.shrink import shrink
    path = tmp_path / "g.plan"
    path.write_text(PLAN.format(experts=64, top_k=4, groups=", expert_groups=16, group_top_k=2"))
    model = shrink(path).plan.model
    assert (model.experts, model.top_k, model.expert_groups, model.group_top_k) == (8, 4, 4, 2)


DISPATCH = """\
import "clusters/dgx_h100"
plan p {{
  model   = llama(layers=4, hidden=2048, heads=16, seq=4096, vocab=1000, ffn=1024, experts=256, top_k=8{groups})
  cluster = dgx_h100 x 8
  mesh    = [ep = 64]
  train   = {{ global_batch: 64, micro_batch: 1 }}
  experts = {kind} over ep
}}
"""


@pytest.mark.parametrize("kind", ["deepep", "hybridep", "alltoall"])
def test_node_limited_routing_cuts_what_the_flex_dispatchers_send_over_the_network(kind):
    """Over 8 nodes, 4 of 8 groups (a group a node) take a token's copies to at most 4 nodes: DeepEP and HybridEP,
    which cross to a node once per token, move fewer bytes (3.5 other nodes where 4.6 without groups); NCCL's
    all-to-all sends each copy to its expert's device whatever the groups."""
    def comm(groups):
        plan = api.loads(DISPATCH.format(groups=groups, kind=kind)).plans[0]
        block = next(layer for layer in layers_of(plan.model) if layer.kind == "block")
        time = estimate_layer_time(plan.model, block, plan_work(plan), plan.cluster.devices_in_order()[0],
                                   plan_links(plan))
        return time.forward_comm + time.backward_comm
    grouped, free = comm(", expert_groups=8, group_top_k=4"), comm("")
    if kind == "alltoall":
        assert grouped == free
    else:
        assert grouped < free


def test_megatron_flags_carry_the_groups_both_ways():
    from plandsl.interop import export_plan, import_text
    text = PLAN.format(experts=64, top_k=8, groups=", expert_groups=8, group_top_k=4").replace(
        "mesh    = [dp = 8]", "mesh    = [dp = 8]\n  data    = zero1 over dp")
    plan = api.loads(text).plans[0]
    exported = export_plan(plan, "megatron")
    assert "--moe-router-num-groups 8" in exported.text and "--moe-router-group-topk 4" in exported.text
    imported = import_text("megatron", exported.text, "run.args", world_size=8, cluster="dgx_h100 x 1")
    assert imported.ok, [str(d) for d in imported.diagnostics]
    back = api.select_plan(api.loads(imported.text, path="back.plan")).model
    assert (back.expert_groups, back.group_top_k) == (8, 4)
    # the number of groups alone: megatron-core routes without groups (left out); the chosen groups alone: E805
    ungrouped = import_text("megatron", exported.text.replace("--moe-router-group-topk 4", ""), "run.args",
                            world_size=8, cluster="dgx_h100 x 1")
    assert ungrouped.ok and "expert_groups" not in ungrouped.text and "--moe-router-num-groups 8" in ungrouped.text
    alone = import_text("megatron", exported.text.replace("--moe-router-num-groups 8", ""), "run.args", world_size=8,
                        cluster="dgx_h100 x 1")
    assert not alone.ok and [d.code for d in alone.diagnostics if d.severity == "error"] == ["E805"]


def test_show_says_what_a_token_runs_through_and_how_it_routes():
    """`plandsl show`'s model line for a mixture of experts: Mixtral 8x7B's published 46.7B parameters and 12.9B
    active a token (Jiang et al. 2024), and the groups a token's experts come from."""
    mixtral = """import "clusters/dgx_h100"
import "models/mixtral"
plan p {
  model   = mixtral_8x7b
  cluster = dgx_h100 x 8
  mesh    = [dp = 8, ep = 8]
  train   = { global_batch: 256, micro_batch: 1, recompute: full }
  data    = zero3 over dp
  experts = alltoall over ep
}
"""
    document = api.loads(mixtral)
    assert "(llama, 46.7B parameters, 12.9B active a token; top 2 of 8 experts)" in api.describe(document)
    grouped = api.loads(PLAN.format(experts=64, top_k=8, groups=", expert_groups=8, group_top_k=4"))
    assert "top 8 of 64 experts inside 4 of 8 groups)" in api.describe(grouped)


@pytest.mark.parametrize("experts, top_k, written, completed", [
    (256, 8, "expert_groups=8", "expert_groups=8, group_top_k=4"),   # half the groups: DeepSeek-V3's 4 of 8
    (64, 8, "group_top_k=2", "group_top_k=2, expert_groups=4"),      # twice the chosen groups
    (64, 8, "expert_groups=64", "expert_groups=64, group_top_k=8"),  # a group an expert: the top 8 groups
])
def test_e235_completes_a_half_written_grouping_into_one_that_limits_the_routing(experts, top_k, written, completed):
    text = PLAN.format(experts=experts, top_k=top_k, groups=", " + written)
    found = [d for d in api.checks(text, path="half.plan").errors if d.code == "E235"]
    assert [e.text for e in found[0].edits] == [completed]
    assert not api.checks(text.replace(written, completed), path="whole.plan").errors
