"""A node that recomputes part of its blocks or offloads them is not given up for a kept node the exact estimate
refuses. The search skips the partly recomputed node (`Splits.partial_partition`, `mixed_partial_partition`) and the
offloading one (`Space._offloaded`, `Splits.mixed_offloaded`) where the kept node (recompute none, the same root and
micro-batch) holds every block within its caps, as the faster of the two. The caps count no more than the exact
estimate, and some less (ZeRO-1's shards of whole tensors, counted even); on a device between the two, the kept node's
plan is refused by the exact estimate and neither of the others was tried, though the exact estimate fits them: the
search missed the plan it should find, or found none. Brute force over the one-stage plans of each space on a device
just below the kept plan's exact estimate: wherever the exact estimate fits a plan recomputing its first N blocks (or
offloading them), the search's node for it settles to a plan that fits."""
from dataclasses import replace

import pytest
from test_search_caps_one_backward import SPACES, _exact

from plandsl.cost.compute import DEFAULT_EFFICIENCY
from plandsl.cost.estimate import estimate_plan
from plandsl.ir.placement import Assignment
from plandsl.search.problem import build_plan
from plandsl.search.space import Space
from plandsl.search.tree import _IDENT, candidate_of


def _fits(space, node, zero, capacity, **layers) -> bool:
    """Whether the exact estimate fits the node's one-stage plan (with `recompute_layers` or `offload_layers`)."""
    plan = build_plan(space.base, candidate_of(node, "", 1, zero, **layers))
    blocks = tuple(space.figures.stage_layers((space.blocks,))[0])
    estimate = estimate_plan(plan, DEFAULT_EFFICIENCY, Assignment((blocks,), (0,), 1))
    return estimate.memory[0].total <= capacity and estimate.memory[0].host <= estimate.host_capacity


def _settles(space, node, zero) -> bool:
    """Whether the search's node yields a leaf at ZeRO `zero` that the exact estimate accepts (`Space.settle`)."""
    pending = space.pending(node)
    for _, _, z, schedule, virtual in (pending.leaves if pending else []):
        if z != zero:
            continue
        leaf = space._leaf(node, zero, schedule, virtual, pending.memory[zero])
        if leaf is not None and space.settle(leaf) is not None:
            return True
    return False


@pytest.mark.parametrize("name", ["gpt", "tied", "moe", "two_kinds"])
def test_a_partly_recomputed_or_offloading_node_is_kept_where_the_exact_estimate_refuses_the_kept_one(name):
    space = Space(SPACES[name](), {}, DEFAULT_EFFICIENCY)
    checked = 0
    for root in space.roots():
        if root.pp != 1:
            continue
        nodes = space.expand_root(root)
        for kept in nodes:
            if kept.recompute != "none" or kept.kept is not None or kept.offload:
                continue
            others = [n for n in nodes if n.micro_batch == kept.micro_batch and (n.offload or n.kept is not None)]
            zeros = (3,) if root.shard else (0,) if root.data_ranks == 1 else (0, 1, 2, 3)
            for zero in zeros:
                total = _exact(space, kept, zero)[0].total
                tight = replace(root, capacity=(total * (1 - 1e-9),))  # the kept plan just refused
                for other in others:
                    at = replace(other, root=tight, ident=next(_IDENT),
                                 kept=replace(other.kept, root=tight, ident=next(_IDENT)) if other.kept else None)
                    key = "offload_layers" if other.offload else "recompute_layers"
                    if not any(_fits(space, at, zero, tight.capacity[0], **{key: n}) for n in range(1, space.blocks)):
                        continue
                    assert _settles(space, at, zero), (root, other, zero, total)
                    checked += 1
    assert checked, "no space without a fitting plan of N blocks"
