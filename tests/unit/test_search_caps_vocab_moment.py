"""The caps against the exact estimate where the embedding's whole-vocabulary gradient's moment
(`cost.memory.whole_vocab_gradient_moment`) is the largest of a rank's moments: a wide vocabulary over short sequences
(a 1 GiB fp32 [131,072, 2,048] gradient), so that it is above the rebuilt block's and, at one microbatch of 256
tokens, above the loss's backward too, on a first rank that holds the last stage as well (no pipeline, zbv's V) and
on one that does not (1F1B). Each rank's cap, split evenly over its stages, fits the exact estimate and one block
more does not; without a pipeline, the exact estimate fits every block where the cap holds them all. And the search's
figures hold the moment in the dtype of the node's own ZeRO stage (its `gather`), whichever stage was asked first."""
import pytest
from test_search_caps import _exact_caps, _fits, _fully_recomputed_memories

from plandsl import api, ir
from plandsl.cost.compute import DEFAULT_EFFICIENCY
from plandsl.cost.memory import whole_vocab_gradient_moment
from plandsl.ir.layers import layers_of
from plandsl.search import Problem
from plandsl.search.problem import build_plan
from plandsl.search.space import Space
from plandsl.search.tree import Leaf, candidate_of

WIDE = "llama(layers=16, hidden=2048, heads=16, kv_heads=4, seq=256, vocab=131072)"


@pytest.mark.parametrize("schedule, virtual, pp, memory", [("1f1b", 1, 1, "7.5 GiB"), ("1f1b", 1, 2, "10 GiB"),
                                                           ("zbv", 2, 2, "10 GiB")])
def test_caps_are_exact_where_the_embeddings_moment_is_the_largest(schedule, virtual, pp, memory):
    from test_search import HARDWARE
    document = api.loads(HARDWARE.replace("memory = 7.25 GiB", f"memory = {memory}") + f"model m = {WIDE}\n")
    problem = Problem(document.models[0], next(c for c in document.clusters if c.name == "tight"), 8, None)
    space = Space(problem, {"schedule": schedule, "virtual_stages": virtual, "pp": pp}, DEFAULT_EFFICIENCY)
    checked = below = above_loss = 0
    for root, ranks, node, inflight, zero, memory in _fully_recomputed_memories(space, schedule, virtual):
        (_, _, moment), (_, _, working), _, (_, _, loss) = memory[0][:4]
        if moment <= working:
            continue
        above_loss += moment > loss > working
        caps = space.caps.rank_caps(root, ranks, inflight, memory, held=True).tolist()
        leaf = Leaf(node, schedule, virtual, zero, (), 0.0, None)
        if root.pp == 1:  # one rank holds every block: it fits them where its cap does
            fits = _fits(space, leaf, (space.blocks,), None)[0]
            assert fits is (caps[0] >= space.blocks), (node, zero, caps)
            checked, below = checked + 1, below + (not fits)
        else:
            fitting, refused = _exact_caps(space, leaf, ranks, caps, None)
            checked, below = checked + fitting, below + refused
    assert checked > 10 and below > 3 and above_loss > 5, (checked, below, above_loss)


@pytest.mark.parametrize("order", [(0, 3), (3, 0)])
def test_the_embeddings_moment_is_in_the_gather_dtype_of_the_nodes_own_zero_stage(order):
    """Under FP8 training with `gather = fp8`, ZeRO-3 makes the embedding's gradient in the 16-bit dtype its unquantized
    weights are gathered in and ZeRO-0 in the weights' fp32, with no autocast copies either way: the figures' working
    sets (cached per micro-batch, recomputation and split, not per ZeRO stage) hold each stage's own."""
    hardware = """
device gpu { memory = 16 GiB; bandwidth = 1000 GB/s; peak = { fp8: 400 TFLOP/s, bf16: 200 TFLOP/s, fp32: 20 TFLOP/s } }
node box { devices = 2 x gpu; link = { bandwidth: 100 GB/s, latency: 2 us }; nic = { bandwidth: 20 GB/s, latency: 5 us } }
cluster pair = box x 2
"""
    document = api.loads(hardware + "model m = llama(layers=4, hidden=1024, heads=8, seq=256, vocab=65536)\n")
    problem = Problem(document.models[0], document.clusters[0], 8, None, precision=ir.Precision.fp8,
                      gathering=ir.Gathering(gather=ir.Precision.fp8))
    space = Space(problem, {"tp": 2, "dp": 2, "pp": 1, "recompute": "none", "micro_batch_size": 1},
                  DEFAULT_EFFICIENCY)
    root = next(iter(space.roots()))
    node = next(iter(space.expand_root(root)))
    seen = set()
    for zero in order:
        plan = build_plan(space.base, candidate_of(node, "", 1, zero))
        moment = whole_vocab_gradient_moment(plan, [layer for layer in layers_of(plan.model) if layer.kind == "embed"])
        assert space.figures.layer_memory(node, zero)[0][0][2] == moment > 0
        seen.add(moment)
    assert len(seen) == 2  # 2 bytes an element under ZeRO-3's gather, 4 under ZeRO-0's none
