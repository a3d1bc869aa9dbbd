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
