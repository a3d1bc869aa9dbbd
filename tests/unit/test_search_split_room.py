"""`Caps.split_room`, what `Splits._kept_split_fits` trusts without the exact estimate (4bc7e06), counts each pipeline
rank's bytes as the exact estimate does: to the byte (a relative 1e-9) at ZeRO-0, 2 and 3, and at ZeRO-1 no more than
it and at most `Figures.caps_gap` less (the exact estimate partitions ZeRO-1's optimizer states as whole tensors, the
caps evenly). The shortcut admits a kept split without asking the exact estimate where every rank's room is at least
that gap: if the caps' count fell below the exact estimate's by more (a term added to `cost.memory` and not to the caps),
the search would give up a partly recomputed node for a kept one the exact estimate refuses. Over the pipeline leaves of
the MoE test space's kept nodes (each root's first; its ZeRO-1 gaps are the largest of the spaces measured)."""
import numpy as np
from test_search import problem

from plandsl.cost.compute import DEFAULT_EFFICIENCY
from plandsl.cost.estimate import estimate_plan
from plandsl.ir.placement import Assignment
from plandsl.search.choices import stage_ranks
from plandsl.search.problem import build_plan
from plandsl.search.space import Space
from plandsl.search.tree import candidate_of


def test_split_room_counts_each_ranks_bytes_as_the_exact_estimate():
    space = Space(problem("moe", "pair", 8), {}, DEFAULT_EFFICIENCY)
    checked = {0: 0, 1: 0, 2: 0, 3: 0}
    for root in space.roots():
        if root.pp == 1:
            continue
        nodes = [n for n in space.expand_root(root) if n.recompute == "none" and n.kept is None and not n.offload]
        for node in nodes[:1]:
            pending = space.pending(node)
            for _, _, zero, schedule, virtual in (pending.leaves if pending else []):
                ranks = stage_ranks(schedule, root.pp, virtual)
                inflight = space.figures.inflight(schedule, root.pp, node.microbatches, virtual)
                memory = pending.memory[zero]
                leaf = space._leaf(node, zero, schedule, virtual, memory)
                if leaf is None:
                    continue
                capacity = space.figures.capacity(root)
                counted = capacity - space.caps.split_room(root, ranks, inflight, memory, leaf.counts)
                plan = build_plan(space.base, candidate_of(node, schedule, virtual, zero))
                assignment = Assignment(tuple(tuple(s) for s in space.figures.stage_layers(leaf.counts)), ranks,
                                        virtual)
                exact = np.array([m.total for m in estimate_plan(plan, DEFAULT_EFFICIENCY, assignment).memory])
                below = exact - counted  # what the caps count less than the exact estimate, per rank
                slack = exact * 1e-9
                where = (root.pp, root.dp, root.ep, node.microbatches, zero, schedule, virtual, leaf.counts)
                if zero == 1:
                    gap = space.figures.caps_gap(node, zero, ranks)
                    assert (below >= -slack).all() and (below <= gap + slack).all(), (where, below, gap)
                else:
                    assert (np.abs(below) <= slack).all(), (where, below)
                checked[zero] += 1
    assert all(checked.values()), checked
