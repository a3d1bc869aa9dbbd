"""The search chooses the experts' folding over tp and their dispatcher (issue 20): each variant's bounds stay
below its exact figures, the top plans are brute force's over all variants, pins select or exclude them, and the
plan written with them estimates as the search priced it."""
import dataclasses
import re

import pytest

from plandsl import api, ir
from plandsl.cost.compute import DEFAULT_EFFICIENCY
from plandsl.search import (
    Problem,
    SearchError,
    brute_force,
    experts_variants,
    parse_pins,
    search,
)
from plandsl.diagnostics import PlanError
from plandsl.search.space import Space
from tests.support import generated_plan
from tests.unit.test_search import problem

PINS = [{"zero_stage": 1}, {"zero_stage": 1, "tp": 2}, {"zero_stage": 0, "ep": 4, "recompute": "none"}]


def searched(batch=4):
    """The small MoE (4 experts) on two nodes of two devices, its experts' choices left to the search."""
    return dataclasses.replace(problem("moe", "pair", batch), search_experts=True)


@pytest.mark.parametrize("pins, overlap", [(pins, False) for pins in PINS] + [(PINS[2], True)])
def test_every_variant_bounds_its_plans_and_the_search_is_brute_force(pins, overlap):
    p, parsed = dataclasses.replace(searched(), overlap_experts=overlap), parse_pins(pins)
    variants = experts_variants(p, parsed)
    assert {(v.fold_experts, v.dispatcher) for v, _ in variants} == {
        (fold, kind) for fold in (False, True) for kind in ("alltoall", "deepep", "hybridep")}
    for variant, chosen in variants:
        space = Space(variant, parsed, DEFAULT_EFFICIENCY, chosen=chosen)
        for root in space.roots():
            assert not (variant.fold_experts and root.tp == 1)  # the unfolded variant's plan
            assert variant.dispatcher == "alltoall" or root.ep > 1  # without an expert group, the all-to-all's plan
            for node in space.expand_root(root):
                for leaf in space.expand(node):
                    scored = space.evaluate(leaf)
                    if scored is not None:
                        assert root.bound <= scored.estimate.time.step * (1 + 1e-12)
                        assert node.bound <= leaf.bound <= scored.estimate.time.step * (1 + 1e-12)
                        assert (scored.candidate.fold, scored.candidate.dispatcher) == \
                            (variant.fold_experts and root.tp > 1, variant.dispatcher)
    everything = brute_force(p, pins)
    assert {s.candidate.dispatcher for s in everything} == {"alltoall", "deepep", "hybridep"}
    found = search(p, pins=pins, top=3)
    assert [s.estimate.time.step for s in found.candidates] == \
        pytest.approx([s.estimate.time.step for s in everything[:3]], rel=1e-12)


HARDWARE = """
device g { memory = 16 GiB; bandwidth = 1000 GB/s; sms = 132; peak = { bf16: 200 TFLOP/s, fp8: 400 TFLOP/s, fp32: 20 TFLOP/s } }
node two { devices = 2 x g; link = { bandwidth: 100 GB/s, latency: 2 us }; nic = { bandwidth: 20 GB/s, latency: 5 us } }
node wide { devices = 16 x g; link = { bandwidth: 100 GB/s, latency: 2 us }; nic = { bandwidth: 160 GB/s, latency: 5 us } }
cluster pair = two x 2
cluster racks = wide x 2
"""


@pytest.mark.parametrize("cluster, precision, overlap, pins", [
    ("pair", "bf16", False, {"zero_stage": 1}),
    ("pair", "fp8", False, {"zero_stage": 1}),
    ("pair", "bf16", True, {"zero_stage": 1}),
    ("racks", "bf16", False, {"tp": 1, "pp": 1, "cp": 1, "zero_stage": 0, "recompute": "none"}),
])
def test_the_dispatcher_left_to_the_search_is_the_best_of_the_three_pinned(cluster, precision, overlap, pins):
    """Unpinned, the search's plans are the best of the searches that pin each dispatcher (whichever the cost model
    favours: the all-to-all's sorting copies, FP8 padding, the SMs beside an overlapped pass, HybridEP's routing map
    and NVLink domains wider than DeepEP's groups of 8)."""
    document = api.loads(HARDWARE + "model m = llama(layers=2, hidden=1024, heads=8, kv_heads=2, seq=2048, vocab=1024, "
                                    "experts=32, top_k=4)\n")
    chosen = next(c for c in document.clusters if c.name == cluster)
    p = Problem(document.models[0], chosen, 32, precision=ir.Precision(precision), overlap_experts=overlap,
                search_experts=True)
    pinned = sorted((s for kind in ("alltoall", "deepep", "hybridep")
                     for s in search(p, pins={**pins, "dispatcher": kind}, top=3).candidates),
                    key=lambda s: s.estimate.time.step)
    found = search(p, pins=pins, top=3).candidates
    assert [s.estimate.time.step for s in found] == pytest.approx([s.estimate.time.step for s in pinned[:3]],
                                                                  rel=1e-12)
    if cluster == "racks":  # an expert group over both 16-device NVLink domains: HybridEP's nodes, 4 of DeepEP's
        assert found[0].candidate.dispatcher == "hybridep" and found[0].candidate.ep == 32


def test_a_roots_bound_allows_the_experts_overlap_a_smaller_micro_batch_buys():
    """With the experts' overlap, the all-to-alls hide only behind another microbatch, so the largest micro-batch
    (one microbatch a step) is not the cheapest per token: a root's bound takes the largest size that leaves two as
    well. Here the best plan (ep 4, micro-batch 4 of 8, HybridEP) lies under a root whose largest size leaves one
    microbatch; bounded by that size alone the root was pruned behind a slower pipelined plan. Every root's bound is
    at most each of its plans' steps, and the search finds brute force's best."""
    document = api.loads(HARDWARE + "model m = llama(layers=2, hidden=1024, heads=8, kv_heads=2, seq=2048, vocab=1024, "
                                    "experts=32, top_k=4)\n")
    p = Problem(document.models[0], next(c for c in document.clusters if c.name == "pair"), 32,
                overlap_experts=True, search_experts=True)
    parsed = parse_pins({"zero_stage": 1})
    for variant, chosen in experts_variants(p, parsed):
        space = Space(variant, parsed, DEFAULT_EFFICIENCY, chosen=chosen)
        for root in space.roots():
            for node in space.expand_root(root):
                for leaf in space.expand(node):
                    scored = space.evaluate(leaf)
                    assert scored is None or root.bound <= scored.estimate.time.step * (1 + 1e-12)
    best = brute_force(p, parsed)[0]
    found = search(p, pins={"zero_stage": 1}, top=1).best
    assert found.estimate.time.step == pytest.approx(best.estimate.time.step, rel=1e-12)
    assert (found.candidate.ep, found.candidate.micro_batch_size, found.candidate.pp) == (4, 4, 1)


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


PARTIAL = """import "clusters/dgx_h100"
plan r {{
  model   = llama(layers=2, hidden=256, heads=4, kv_heads=2, seq=256, vocab=1024, experts=16, top_k=2)
  cluster = dgx_h100 x 2
  train   = {{ global_batch: 16 }}
{lines}}}
"""
MODEL = "llama(layers=2, hidden=256, heads=4, kv_heads=2, seq=256, vocab=1024, experts=16, top_k=2)"


def _partial(tmp_path, lines=""):
    path = tmp_path / "partial.plan"
    path.write_text(PARTIAL.format(lines=lines))
    return path


@pytest.mark.parametrize("pins", [("ep=16",), ("ep=16", "tp=2"), ("ep=8", "zero_stage=1")])
def test_generate_from_a_partial_plan_without_an_experts_line_searches_the_clause(tmp_path, pins):
    """`generate --from` a mixture of experts whose plan writes no `experts` line chooses the clause as `generate`
    does without `--from` (folded over tp or not, the dispatcher): the same best plan under the same pins, and the
    completed file writes the clause chosen."""
    from plandsl.rewrite.complete import generate_from
    completed = generate_from(_partial(tmp_path), pins=pins, top=1)
    full = api.generate(api.generate_request(model=MODEL, cluster="dgx_h100 x 2", global_batch=16, pins=pins, top=1))
    ours, theirs = completed.result.best, full.result.best
    assert ours.estimate.time.step == pytest.approx(theirs.estimate.time.step, rel=1e-12)
    assert (ours.candidate.degrees(), ours.candidate.fold, ours.candidate.dispatcher) == \
        (theirs.candidate.degrees(), theirs.candidate.fold, theirs.candidate.dispatcher)
    c = ours.candidate
    over = "[ep, tp]" if c.fold else "ep"
    assert re.search(rf"\n  experts += {c.dispatcher} over {re.escape(over)}\n", completed.texts[0])
    assert api.loads(completed.texts[0]).plans[0].experts.kind == c.dispatcher
    if pins == ("ep=16",):  # a group across the two nodes: DeepEP's dispatch, once per node
        assert c.dispatcher == "deepep"


@pytest.mark.parametrize("pins", [{"zero_stage": 0, "recompute": "none", "pp": 1},
                                  {"zero_stage": 1, "recompute": "none", "micro_batch_size": 1, "cp": 1}])
def test_a_partial_plans_search_of_the_clause_is_brute_force(tmp_path, pins):
    """The partial plan's problem searches every variant (`experts_variants`), and its top plans are brute force's."""
    from plandsl.search.partial import read_partial
    problem = read_partial(_partial(tmp_path)).problem
    assert problem.search_experts
    everything = brute_force(problem, pins)
    assert {s.candidate.dispatcher for s in everything} == {"alltoall", "deepep", "hybridep"}
    found = search(problem, pins=pins, top=3)
    assert [s.estimate.time.step for s in found.candidates] == \
        pytest.approx([s.estimate.time.step for s in everything[:3]], rel=1e-12)


def test_a_written_experts_line_is_a_pin_and_a_written_mesh_leaves_the_dispatcher(tmp_path):
    """`experts = alltoall over ep` written is kept, and a pin that contradicts it is E803; under a written mesh with
    an expert axis and no experts line, the search chooses the dispatcher and writes it."""
    from plandsl.rewrite.complete import generate_from
    from plandsl.search.partial import read_partial
    path = _partial(tmp_path, "  experts = alltoall over ep\n")
    assert not read_partial(path).problem.search_experts
    completed = generate_from(path, pins=("ep=16",), top=1)
    assert completed.result.best.candidate.dispatcher == "alltoall" and "  experts = alltoall over ep\n" in \
        completed.texts[0]
    with pytest.raises(PlanError) as raised:
        generate_from(path, pins=("ep=16", "dispatcher=deepep"), top=1)
    assert [d.code for d in raised.value.diagnostics] == ["E803"]
    meshed = _partial(tmp_path, "  mesh    = [ep = 16]\n")
    partial = read_partial(meshed)
    assert partial.problem.search_experts and not partial.decided
    completed = generate_from(meshed, top=1)
    assert "  experts = deepep over ep\n" in completed.texts[0] and "  mesh    = [ep = 16]\n" in completed.texts[0]
    folded_out = _partial(tmp_path, "  tensor  = megatron over tp\n")  # no sequence parallelism: nothing to fold into
    assert read_partial(folded_out).pins["fold"] is False



@pytest.mark.parametrize("pin, gives", [("dispatcher=deepep", "dispatcher=alltoall"), ("fold=true", "fold=false")])
def test_a_pin_against_a_written_experts_line_is_refused_at_it(tmp_path, pin, gives):
    """A written `experts` line is kept as it is, so a --pin of another dispatcher or folding is E803 at that line,
    naming the pin, as against any written line (it was E803 at the plan's name, from the search's own check)."""
    from plandsl.rewrite.complete import generate_from
    path = _partial(tmp_path, "  experts = alltoall over ep\n")
    with pytest.raises(PlanError) as raised:
        generate_from(path, pins=("ep=16", pin), top=1)
    (found,) = raised.value.diagnostics
    line = path.read_text().splitlines().index("  experts = alltoall over ep") + 1
    assert (found.code, found.span.line, found.span.column) == ("E803", line, 3), found
    assert found.message == f"--pin {pin} contradicts the plan's `experts = alltoall over ep`, which gives {gives}"
    assert generate_from(path, pins=("ep=16", "dispatcher=alltoall", "fold=false"), top=1).texts  # its own words

def test_memory_does_not_depend_on_the_dispatcher():
    """The spaces of the three dispatchers share their memory figures (`Figures`' memory caches, `Caps`), which holds
    while the memory model prices every dispatcher's plan alike: each plan's memory, whatever its dispatcher."""
    by_plan: dict = {}
    for scored in brute_force(dataclasses.replace(searched(), overlap_experts=True), PINS[2]):
        c = scored.candidate
        key = (tuple(c.degrees().items()), c.order, c.micro_batch_size, c.schedule, c.virtual_stages, c.zero_stage,
               c.recompute, c.fold)
        by_plan.setdefault(key, {})[c.dispatcher] = [m.total for m in scored.estimate.memory]
    assert any(len(found) == 3 for found in by_plan.values())
    assert all(len({tuple(memory) for memory in found.values()}) == 1 for found in by_plan.values())
