"""The search's leaf bounds for a transformer with two kinds of block (dense and MoE blocks, alternating or dense
first; windowed and full-attention blocks): `Bounds.busy_bound` and `Bounds.split_bound` are above zero and below
every leaf's exact bound, and branch and bound finds the brute-force optimum."""
import pytest

from plandsl import api
from plandsl.cost.compute import DEFAULT_EFFICIENCY
from plandsl.search import Problem, search
from plandsl.search.choices import stage_ranks
from plandsl.search.space import Space

HARDWARE = """
device gpu { memory = 16 GiB; bandwidth = 1000 GB/s; peak = { bf16: 200 TFLOP/s, fp32: 20 TFLOP/s } }
node box { devices = 2 x gpu; link = { bandwidth: 100 GB/s, latency: 2 us }; nic = { bandwidth: 20 GB/s, latency: 5 us } }
cluster pair = box x 2
"""
MOE = "llama(layers=6, hidden=512, heads=8, seq=512, vocab=4096, experts=4, top_k=2, ffn=256, dense_ffn=32768"
MODELS = {
    "alternating": MOE + ", moe_every=2)",
    "dense_first": MOE + ", dense_layers=2)",
    "windowed": "llama(layers=6, hidden=512, heads=8, kv_heads=2, seq=2048, vocab=4096, window=128, full_every=3)",
    # three kinds: windowed dense, windowed MoE and full-attention MoE blocks (0, 1, 0, 2, 0, 1)
    "three_kinds": "llama(layers=6, hidden=512, heads=8, kv_heads=2, seq=2048, vocab=4096, experts=4, top_k=2, "
                   "ffn=256, dense_ffn=8192, moe_every=2, window=128, full_every=4)",
    # four: two dense blocks first, then MoE blocks (DeepSeek's pattern), every other block windowed (GPT-OSS's)
    "four_kinds": "llama(layers=6, hidden=512, heads=8, kv_heads=2, seq=2048, vocab=4096, experts=4, top_k=2, "
                  "ffn=256, dense_ffn=8192, dense_layers=2, window=128, full_every=2)",
}


def _space(model: str, pins: dict) -> Space:
    document = api.loads(HARDWARE + f"model m = {MODELS[model]}\n")
    return Space(Problem(document.models[0], document.clusters[0], 8, None), pins, DEFAULT_EFFICIENCY)


@pytest.mark.parametrize("model", sorted(MODELS))
def test_two_kinds_bound_every_leaf_below_its_exact_bound_and_the_search_is_brute_force(model):
    pins = {"recompute": "none"}
    space = _space(model, pins)
    assert space.figures.dense_blocks, "two kinds of block"
    everything, busy, split = [], 0, 0
    for root in space.roots():
        for node in space.expand_root(root):
            node = space.tighten(node)
            pending = space.pending(node)
            while pending is not None:
                before = pending.bound  # the node's, raised by `busy_bound`
                leaf, pending = space.resolve(pending)
                if leaf is None:
                    continue
                ranks = stage_ranks(leaf.schedule, root.pp, leaf.virtual) if root.pp > 1 else (0,)
                stages = space.bounds.stage_times(node, leaf.zero, ranks, leaf.counts)
                exact = space.bounds.leaf_bound(node, leaf.schedule, ranks, stages, leaf.zero)
                by_split = space.bounds.split_bound(node, leaf.zero, leaf.schedule, ranks, leaf.counts)
                by_busy = space.bounds.busy_bound(node, leaf.zero, leaf.schedule, leaf.virtual)
                assert by_busy <= by_split * (1 + 1e-12) and by_split <= exact * (1 + 1e-12)
                assert space.bounds.compute_bound(node) <= exact * (1 + 1e-12)
                busy, split = busy + (by_busy > 0), split + (by_split > 0)
                scored = space.evaluate(leaf)
                if scored is not None:
                    assert before <= space.finish(leaf).bound <= scored.estimate.time.step * (1 + 1e-12)
                    everything.append(scored.estimate.time.step)
    assert everything and busy > 5 and split > 5
    found = search(space.problem, pins=pins, top=3)
    assert [s.estimate.time.step for s in found.candidates] == pytest.approx(sorted(everything)[:3], rel=1e-12)


@pytest.mark.parametrize("model", ["three_kinds", "four_kinds"])
def test_more_kinds_split_in_order_with_the_estimates_stage_times(model):
    """More than two kinds of block: the kinds follow the model's order (the main kind the last block's), the leaf's
    split minimises the slowest stage over every split in order, each block at its own kind's seconds, and the
    search's stage times are the estimate's, block by block."""
    from plandsl.cost.estimate import estimate_stage_times
    from plandsl.ir.layers import figures_key, layers_of
    from plandsl.ir.placement import Assignment
    pins = {"pp": 2, "dp": 2, "tp": 1, "schedule": "1f1b", "virtual_stages": 1, "recompute": "none", "zero_stage": 1,
            "micro_batch_size": 1, "order": ("pp", "dp")}
    space = _space(model, pins)
    figures = space.figures
    blocks = [layer for layer in layers_of(figures.model) if layer.kind == "block"]
    keys = [figures_key(block) for block in blocks]
    assert len(set(keys)) == len(figures.kinds) - 3 and figures_key(figures.kinds[1][0]) == keys[-1]
    assert all(figures_key(figures.kinds[k][0]) == key for k, key in zip(figures.block_kind, keys))
    (root,) = space.roots()
    (node,) = space.expand_root(root)
    (leaf,) = space.expand(node)
    seconds = [t.forward + t.backward for t in figures.kind_times(node, root.rank_devices[0])]
    each = [seconds[k] for k in figures.block_kind]

    def slowest(counts):
        return max(seconds[0] + sum(each[:counts[0]]), sum(each[counts[0]:]) + seconds[2] + seconds[3])

    assert slowest(leaf.counts) == pytest.approx(min(slowest((n, len(each) - n)) for n in range(1, len(each))))
    assignment = Assignment(tuple(tuple(s) for s in figures.stage_layers(leaf.counts)), (0, 1), 1)
    exact = estimate_stage_times(space.evaluate(leaf).plan, assignment)
    searched = space.bounds.stage_times(node, 1, (0, 1), leaf.counts)
    for attribute in ("forward", "backward", "comm", "flops", "dense_params", "expert_params", "first_bucket"):
        assert [getattr(s, attribute) for s in searched] == pytest.approx([getattr(s, attribute) for s in exact],
                                                                          rel=1e-9)


def test_the_search_finds_the_brute_force_optimum_of_three_kinds_every_recomputation():
    """Three kinds of block, every recomputation the space has for them (`tests.support.assert_brute_force_optimum`)."""
    from tests.support import assert_brute_force_optimum
    assert_brute_force_optimum(_space("three_kinds", {}).problem, {"zero_stage": 1})


# 896 MiB (768 before `replicate`'s copies of the stages' weights were counted: `cost.memory.replicate_copy_bytes`)
@pytest.mark.parametrize("memory, pins", [("1536 MiB", {"zero_stage": 1, "pp": 1}), ("896 MiB", {"zero_stage": 1, "pp": 2})])
def test_several_kinds_recompute_the_first_blocks_of_each_stage_where_memory_binds(memory, pins):
    """Three kinds of block on devices whose memory binds: the space holds `recompute_layers` (the first N blocks of each
    stage, their kinds in the model's order, `Splits.mixed_partial_partition`), every leaf's bound is at most its step,
    and the search's three best are brute force's, a partly recomputed plan among its best (one stage: the best; two
    pipeline ranks: the eighth, 30.36 ms, after a ZBV plan of 789 MiB on a rank whose two stages differ in bytes, which
    an even share of the rank's room pruned: `Splits._shared_split`, and, since that split counts the simulated peak
    (`_moved_split`), two tp=2 interleaved zero bubble plans of blocks (1, 2, 2, 1), 28.16 and 28.90 ms, 810 / 796 MiB,
    whose even shares' split (1, 2, 1, 2) the exact estimate refused: it was the fourth of four, after 29.27 ms; and,
    since a split a block or a few moved from the even one is tried where that one overfills a rank, a tp=2 ZBV plan of
    blocks (0, 2, 1, 3), 30.19 ms, 693 / 814 MiB, which the even shares pruned and the even split (2, 2, 1, 1) overfills)."""
    from tests.support import assert_brute_force_optimum
    document = api.loads(HARDWARE.replace("memory = 16 GiB", f"memory = {memory}") + f"model m = {MODELS['three_kinds']}\n")
    problem = Problem(document.models[0], document.clusters[0], 8, None)
    assert_brute_force_optimum(problem, pins)
    best = search(problem, pins=pins, top=4 if pins["pp"] == 1 else 8).candidates
    partly = [s.candidate for s in best if s.candidate.recompute_layers]
    assert partly and all(c.recompute == "full" and 0 < c.recompute_layers < 6 for c in partly)
    assert (best[0].candidate.recompute_layers is not None) == (pins["pp"] == 1)


def test_several_kinds_partly_recomputed_stage_times_are_the_estimates():
    """A pinned `recompute_layers` over three kinds of block: each stage's first N blocks, whatever their kinds, at
    full recomputation's seconds and the others at the kept node's, as the estimate times them."""
    from plandsl.cost.estimate import estimate_stage_times
    from plandsl.ir.placement import Assignment
    pins = {"pp": 2, "dp": 2, "tp": 1, "schedule": "1f1b", "virtual_stages": 1, "recompute": "full",
            "recompute_layers": 2, "zero_stage": 1, "micro_batch_size": 1, "order": ("pp", "dp")}
    space = _space("three_kinds", pins)
    (root,) = space.roots()
    (node,) = [node for node in space.expand_root(root) if node.kept is not None]
    (leaf,) = space.expand(node)
    assert leaf.recompute_layers == 2
    assignment = Assignment(tuple(tuple(s) for s in space.figures.stage_layers(leaf.counts)), (0, 1), 1)
    exact = estimate_stage_times(space.evaluate(leaf).plan, assignment)
    searched = space.bounds.stage_times(node, 1, (0, 1), leaf.counts, leaf.recompute_layers)
    for attribute in ("forward", "backward", "comm", "flops", "recompute_flops", "dense_params", "expert_params"):
        assert [getattr(s, attribute) for s in searched] == pytest.approx([getattr(s, attribute) for s in exact],
                                                                          rel=1e-9)
    kept = space.bounds.stage_times(node.kept, 1, (0, 1), leaf.counts)
    assert all(s.backward > k.backward for s, k in zip(searched, kept))  # the recomputed blocks rerun their forward


def test_several_kinds_offload_the_first_blocks_where_memory_binds():
    """Three kinds of block on one stage whose memory binds, recomputing nothing: the space holds `offload_layers` (the
    first N blocks' activations on the host, their kinds in the model's order, `Splits.mixed_offloaded`, at the next N
    where the estimate refuses one), and the search's three best are brute force's, offloading plans the first two (on
    1064 MiB devices: 1 GiB before `replicate`'s copies of the experts' weights were counted, `cost.memory.
    replicate_copy_bytes`)."""
    from tests.support import assert_brute_force_optimum
    document = api.loads(HARDWARE.replace("memory = 16 GiB", "memory = 1064 MiB") + f"model m = {MODELS['three_kinds']}\n")
    problem = Problem(document.models[0], document.clusters[0], 8, None)
    pins = {"zero_stage": 1, "pp": 1, "recompute": "none"}
    assert_brute_force_optimum(problem, pins)
    best = search(problem, pins=pins, top=3).candidates
    assert [bool(s.candidate.offload_layers) for s in best] == [True, True, False]


def test_a_v_shapes_first_rank_keeps_the_tied_heads_copy_in_the_splits_room(monkeypatch):
    """A V-shape puts the first and the last stage on rank 0, and the head's stage there keeps its copy of a tied
    embedding as the exact estimate counts it (`cost.memory.estimate_memory`: each stage a model chunk of its own) and
    the caps do (`Caps`, `len(ranks) > 1`): the splits' room takes it too (it took it only where the first and last
    stages were on different ranks)."""
    from plandsl.search.choices import stage_ranks
    model = MODELS["three_kinds"][:-1] + ", tied=true)"
    document = api.loads(HARDWARE + f"model m = {model}\n")
    space = Space(Problem(document.models[0], document.clusters[0], 8, None),
                  {"pp": 2, "schedule": "zbv", "virtual_stages": 2, "zero_stage": 1, "recompute": "none",
                   "micro_batch_size": 1}, DEFAULT_EFFICIENCY)
    root = next(iter(space.roots()))
    node = next(iter(space.expand_root(root)))
    memory, ranks = space.figures.layer_memory(node, 1), stage_ranks("zbv", root.pp, 2)
    inflight = space.figures.inflight("zbv", root.pp, node.microbatches, 2)
    assert ranks[0] == ranks[-1] == 0 and memory[1] > 0
    rooms = []
    for copies in (0.0, 2.0**30):
        monkeypatch.setattr(type(space.figures), "head_copies", lambda self, memory, inflight, copies=copies: copies)
        rooms.append(space.splits._mixed_room(root, ranks, inflight, memory)[0])
    assert [a - b for a, b in zip(*rooms)] == [2.0**30 if rank == 0 else 0.0 for rank in ranks]


def test_a_schedule_with_a_simulated_peak_takes_no_split_found_without_it():
    """1F1B's and zero bubble H1's leaves of a node (pp=2, virtual 1) hold the same microbatches in flight by the rule,
    so `Splits` keys their splits alike; H1's simulation holds more (`Figures.held`: the W-deferred activations), 1F1B's
    none. Where the split is fixed (the pin `account`: `_fixed_fits`) 1F1B's was found without a peak to ask for, and
    was cached for every schedule of those figures (`_by_schedule`): an H1 leaf after 1F1B's took it, which the exact
    estimate refused (32 of these 360 H1 leaves: (3, 3) at dp=2 selective_op ZeRO-1, 0.387 GiB on rank 1 of 0.38; N=1
    of `recompute_layers` where alone it finds N=2, or N=2 where alone none). Each H1 leaf is now the same after 1F1B's
    as alone, and fits."""
    from plandsl.search import parse_pins
    from test_search_caps_open_gradients import _estimate
    document = api.loads(HARDWARE.replace("memory = 16 GiB", "memory = 0.38 GiB") + f"model m = {MODELS['windowed']}\n")
    problem = Problem(document.models[0], document.clusters[0], 8, None)
    pins = parse_pins(["pp=2", "account=embed,loss"])
    after, alone = Space(problem, pins, DEFAULT_EFFICIENCY), Space(problem, pins, DEFAULT_EFFICIENCY)

    def leaf(space, node, zero, schedule):
        found = space._leaf(node, zero, schedule, 1, space.figures.layer_memory(node, zero))
        return None if found is None else (found.counts, found.recompute_layers)

    compared = fitting = partly = 0
    for root in after.roots():
        for node in after.expand_root(root):
            if node.offload:
                continue
            for zero in range(4):
                leaf(after, node, zero, "1f1b")
                found = leaf(after, node, zero, "zb_h1")
                assert found == leaf(alone, node, zero, "zb_h1"), (node, zero)
                compared += 1
                if found is not None:
                    memory = _estimate(after, node, "zb_h1", 1, zero, *found)
                    assert all(m.total <= c for m, c in zip(memory, root.capacity)), (node, zero, found)
                    fitting += 1
                    partly += found[1] is not None
    assert compared > 100 and fitting > 20 and partly > 5
