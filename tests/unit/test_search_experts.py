"""The search chooses the experts' folding over tp and their dispatcher (issue 20): each variant's bounds stay
below its exact figures, the top plans are brute force's over all variants, pins select or exclude them, and the
plan written with them estimates as the search priced it."""
import dataclasses

import pytest

from plandsl.cost.compute import DEFAULT_EFFICIENCY
from plandsl.search import (
    SearchError,
    brute_force,
    experts_variants,
    parse_pins,
    search,
)
from plandsl.search.space import Space
from tests.support import generated_plan
from tests.unit.test_search import problem

PINS = [{"zero_stage": 1}, {"zero_stage": 1, "tp": 2}, {"zero_stage": 0, "ep": 4, "recompute": "none"}]


def searched(batch=4):
    """The small MoE (4 experts) on two nodes of two devices, its experts' choices left to the search."""
    return dataclasses.replace(problem("moe", "pair", batch), search_experts=True)


@pytest.mark.parametrize("pins", PINS)
def test_every_variant_bounds_its_plans_and_the_search_is_brute_force(pins):
    p, parsed = searched(), parse_pins(pins)
    variants = experts_variants(p, parsed)
    assert {(v.fold_experts, v.dispatcher) for v, _ in variants} == {(False, "alltoall"), (False, "deepep"),
                                                                   (True, "alltoall"), (True, "deepep")}
    for variant, chosen in variants:
        space = Space(variant, parsed, DEFAULT_EFFICIENCY, chosen=chosen)
        for root in space.roots():
            assert not (variant.fold_experts and root.tp == 1)  # the unfolded variant's plan
            assert variant.dispatcher == "alltoall" or root.links.ep.nodes > 1  # priced as the all-to-all inside a node
            for node in space.expand_root(root):
                for leaf in space.expand(node):
                    scored = space.evaluate(leaf)
                    if scored is not None:
                        assert node.bound <= leaf.bound <= scored.estimate.time.step * (1 + 1e-12)
                        assert (scored.candidate.fold, scored.candidate.dispatcher) == \
                            (variant.fold_experts and root.tp > 1, variant.dispatcher)
    everything = brute_force(p, pins)
    assert {s.candidate.dispatcher for s in everything} == {"alltoall", "deepep"}
    found = search(p, pins=pins, top=3)
    assert [s.estimate.time.step for s in found.candidates] == \
        pytest.approx([s.estimate.time.step for s in everything[:3]], rel=1e-12)


def test_fold_counts_only_with_tensor_and_expert_axes():
    folded = [s for s in brute_force(searched(), {"zero_stage": 1, "tp": 2}) if s.candidate.fold]
    assert folded and all(s.candidate.tp == 2 and s.candidate.ep > 1 for s in folded)
    assert all(s.plan.experts.fold == ("tp",) for s in folded)


def test_pins_select_a_variant_and_a_given_problem_keeps_its_own():
    assert parse_pins(["fold=true", "dispatcher=hybridep"]) == {"fold": True, "dispatcher": "hybridep"}
    with pytest.raises(SearchError, match="dispatcher is one of alltoall, deepep, hybridep"):
        parse_pins(["dispatcher=nccl"])
    with pytest.raises(SearchError, match="fold=maybe: true or false"):
        parse_pins(["fold=maybe"])
    only = experts_variants(searched(), {"fold": False, "dispatcher": "hybridep"})
    assert [(v.fold_experts, v.dispatcher, chosen) for v, chosen in only] == [(False, "hybridep", (False, False))]
    given = problem("moe", "pair", 4)  # a problem that gives them (a partial plan, the bench's rows): not searched
    assert [v for v, _ in experts_variants(given, {})] == [given]
    with pytest.raises(SearchError, match="contradictory pins: dispatcher=deepep"):
        search(given, pins={"dispatcher": "deepep"})
    dense = dataclasses.replace(problem("gpt", "pair", 4), search_experts=True)
    assert [v for v, _ in experts_variants(dense, {})] == [dense]


def test_generate_writes_the_chosen_dispatcher_and_folding(tmp_path):
    """The written plan says `deepep over [ep, tp]` and estimates as the search priced it (`generated_plan`)."""
    text, plan = generated_plan(tmp_path, model="llama(layers=2, hidden=256, heads=4, kv_heads=2, seq=256, vocab=1024, "
                                "experts=16, top_k=2)", cluster="dgx_h100 x 2", global_batch=16,
                                pins=("fold=true", "dispatcher=deepep", "tp=2", "ep=16"), top=1)
    assert "experts = deepep over [ep, tp]" in text
    assert plan.experts.kind == "deepep" and plan.experts.fold == ("tp",)
