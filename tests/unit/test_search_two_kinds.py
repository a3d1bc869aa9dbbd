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
