"""The caps against the exact estimate where torch's vocabulary-parallel embedding's whole-vocabulary gradient is
counted (`cost.memory.whole_vocab_gradient_bytes`): tensor parallelism under a pipeline, with multi-token
prediction's copy of the embedding on the head's stage (first and last ranks apart, and a V-shape's the same), ZeRO 0
and 3. Each cap, split evenly over its rank's stages, fits the exact estimate and one block more does not. Dropping
`Figures.copy_vocab` or the embedding's term in `Figures._states` fails it (test_search_caps.py's MTP test passes either
way)."""
import pytest
from test_search_caps import _exact_caps, _fully_recomputed_memories

from plandsl.cost.compute import DEFAULT_EFFICIENCY
from plandsl.search import Problem
from plandsl.search.problem import build_plan
from plandsl.search.space import Space
from plandsl.search.tree import Leaf, candidate_of


@pytest.mark.parametrize("tied", ["false", "true"])
@pytest.mark.parametrize("schedule, virtual", [("1f1b", 1), ("interleaved_1f1b", 2), ("zbv", 2)])
def test_caps_are_the_exact_estimates_with_the_whole_vocabulary_gradient(schedule, virtual, tied):
    from test_search import HARDWARE

    from plandsl import api
    model = f"llama(layers=16, hidden=2048, heads=16, kv_heads=4, seq=4096, vocab=65536, mtp=1, tied={tied})"
    document = api.loads(HARDWARE.replace("memory = 7.25 GiB", "memory = 8 GiB") + f"model m = {model}\n")
    problem = Problem(document.models[0], next(c for c in document.clusters if c.name == "tight"), 8, None)
    space = Space(problem, {"schedule": schedule, "virtual_stages": virtual, "pp": 2}, DEFAULT_EFFICIENCY)
    checked = below = counted = 0
    for root, ranks, node, inflight, zero, memory in _fully_recomputed_memories(space, schedule, virtual):
        plan = build_plan(space.base, candidate_of(node, schedule, virtual, zero, None))
        if plan.tp > 1 and plan.tensor.stack == "torch" and space.figures.copy_vocab(memory) > 0:
            counted += 1
        caps = space.caps.rank_caps(root, ranks, inflight, memory, held=True).tolist()
        leaf = Leaf(node, schedule, virtual, zero, (), 0.0, None)
        fitting, refused = _exact_caps(space, leaf, ranks, caps, None)
        checked, below = checked + fitting, below + refused
    assert counted > 0 and checked > 20 and below > 5, (counted, checked, below)
