"""When nothing fits, what the search says came closest (E803 under `generate --from`, the same message without it):
held against every candidate's own estimate. A 36B GPT on one DGX A100 pinned to dp = 8: its states fit over the
8 devices, no micro-batch size, recomputation or ZeRO stage fits what a step holds beside them. The message once
named the micro-batch whose lower bound was lowest (mb=4, "at least 75.0 GiB": it needs 90.5) rather than the
plan that needs least (mb=1, 82.6), and said its states alone needed a second node."""
from __future__ import annotations

import itertools
from dataclasses import replace
from types import SimpleNamespace

import pytest

from plandsl import api, ir
from plandsl.cost.estimate import estimate_plan
from plandsl.lower.units import format_bytes
from plandsl.search import Candidate, Problem, SearchError, build_plan, search
from plandsl.search.choices import RECOMPUTE
from plandsl.search.closest import Closest
from plandsl.search.problem import SearchStats

TEXT = """
import "clusters/dgx_a100"
model m = gpt(layers=44, hidden=8192, heads=64, seq=2048, vocab=51200)
cluster one = dgx_a100 x 1
"""


@pytest.fixture(scope="module")
def problem():
    document = api.loads(TEXT, path="m.plan")  # FSDP gathering the fp32 weights as they are: autocast's copies held
    return Problem(document.models[0], document.clusters[0], 64, gathering=ir.FSDP_GATHERING)


def _needs(problem):
    """Every candidate the pin dp=8 leaves (one stage; recomputing N blocks needs at least recomputing all),
    estimated: (need over capacity, its description, its need)."""
    from plandsl.search.figures import Figures
    base = Figures(problem, None).base
    found = []
    for micro_batch, recompute, zero in itertools.product((1, 2, 4, 8), RECOMPUTE, range(4)):
        candidate = Candidate(8, 1, 1, 1, 1, ("dp",), micro_batch, 8 // micro_batch, "", 1, zero, recompute, False)
        estimate = estimate_plan(build_plan(base, candidate), None)
        need, capacity = max((m.total, c) for m, c in zip(estimate.memory, estimate.capacity))
        found.append((need / capacity, candidate.describe(), need, estimate.fits))
    return sorted(found)


def test_the_closest_is_the_plan_that_needs_least_and_the_states_fit(problem):
    needs = _needs(problem)
    assert not any(fits for *_, fits in needs)
    _, closest, need, _ = needs[0]
    with pytest.raises(SearchError) as raised:
        search(problem, ["dp=8"], top=1, time_limit=0)
    message = str(raised.value)
    assert f"the closest: {closest} needs {format_bytes(need)} per device" in message, message
    # 86.2 GiB and autocast's bf16 copies of the 35.9B fp32 weights its matmuls read, gathered whole (66.8 GiB); 149.4
    # while a block's backward was counted with one block's units (`cost.memory.unit_moments`: two, FSDP2's prefetch
    # and the reduce-scatter's input it keeps till the next block's)
    assert closest == "dp=8 mb=1 m=8 zero3 recompute=full" and format_bytes(need) == "153.0 GiB"
    # 540.8 GiB of states over 8 x 73.6 GiB: they fit; what a step holds beside them does not
    assert "states need 540.8 GiB of the 588.8 GiB its devices hold" in message
    assert "alone need" not in message and "could hold its states" not in message
    assert "dgx_a100 x 2 or more" in message


def test_gathered_in_bf16_as_the_search_chooses_the_closest_needs_less(problem):
    """The search's own gathering (`Problem.gather_dtype`): ZeRO-2/3 gather bf16, so the same closest plan holds
    neither autocast's copies nor fp32 units: 81.7 GiB (79.5 with one block's units in a block's backward), still
    more than a device."""
    chosen = replace(problem, gathering=None)
    _, closest, need, _ = _needs(chosen)[0]
    assert closest == "dp=8 mb=1 m=8 zero3 recompute=full" and format_bytes(need) == "81.7 GiB"
    with pytest.raises(SearchError) as raised:
        search(chosen, ["dp=8"], top=1, time_limit=0)
    assert f"the closest: {closest} needs {format_bytes(need)} per device" in str(raised.value)


def test_a_lower_bound_is_never_called_the_closest():
    stats = SearchStats()
    closest = Closest(stats, None, None)
    closest.bound("a needs at least 90 GiB", 1.2)  # no estimate settles it (model states alone)
    estimate = SimpleNamespace(memory=[SimpleNamespace(total=100.0)], capacity=[80.0])  # 1.25 of its device
    closest.estimated(Candidate(8, 1, 1, 1, 1, ("dp",), 1, 8, "", 1, 3, "full", False), estimate)
    assert stats.memory_example == "a needs at least 90 GiB" and not stats.memory_example_exact  # 1.2 < 1.25
    closest.settle()  # nothing to settle: the least stays a bound
    assert not stats.memory_example_exact
    from plandsl.search.emit import _closest
    assert _closest(stats) == "; the lowest bound: a needs at least 90 GiB"
