"""A transformer of several kinds of block (`moe_every`, `dense_layers`: DeepSeek's dense-then-MoE) whose pipeline rank
runs several stages (interleaved 1F1B, looped BFS, ZBV, DualPipeV, ...) shares the rank's room over its stages as their
blocks need it, not evenly: a rank whose stages differ in bytes (a dense stage and an MoE one, the V's first rank with
the embedding's stage and the head's) holds the split where the exact estimate does. `Splits.mixed_partition` (and the
partly recomputed `mixed_partial_partition`) gave each stage an even share of its rank's room (`_mixed_room`), so a
stage of heavier blocks than its rank's others did not fit its share though the rank held them, and plans that fit
were pruned. Brute force over the leaves whose ranks hold several stages of such spaces (each root's first node, ZeRO-0
and 2, for time: the whole spaces take ~10 times as long and lost 80 and 932 of 932 alike): a split of equal stages,
each rank's device just its exact estimate, keeps its leaf, and the split the search makes fits those devices by the
exact estimate. Before, 16 of 152 (`moe_every`: ZBV and DualPipeV, a rank's two stages one dense and one MoE block)
and 152 of 152 (`dense_layers`: a rank's dense stage and MoE stage, every schedule of several stages a rank) were
pruned though the exact estimate fits them."""
from dataclasses import replace

import pytest
from test_search_caps_open_gradients import _estimate, _space

from plandsl.search.tree import _IDENT


@pytest.mark.parametrize("name", ["moe_every", "dense_layers"])
def test_a_ranks_stages_share_its_room_as_their_blocks_need_it(name):
    space = _space(name)
    blocks = sum(1 for layer in space.layers if layer.kind == "block")
    checked, lost = 0, []
    for root in space.roots():
        if root.pp == 1:
            continue
        nodes = [node for node in space.expand_root(root) if node.kept is None and not node.offload]
        for node in nodes[:1]:
            pending = space.pending(node)
            for _, _, zero, schedule, virtual in (pending.leaves if pending else []):
                stages = root.pp * virtual
                if virtual == 1 or blocks % stages or zero not in (0, 2):
                    continue
                counts = (blocks // stages,) * stages
                memory = _estimate(space, node, schedule, virtual, zero, counts)
                capacity = tuple(m.total * (1 + 1e-9) for m in memory)  # a part in 10**9: sums in another order
                at = replace(node, root=replace(root, capacity=capacity), ident=next(_IDENT))
                leaf = space._leaf(at, zero, schedule, virtual, pending.memory[zero])
                checked += 1
                if leaf is None or not all(m.total <= c for m, c in zip(
                        _estimate(space, at, schedule, virtual, zero, leaf.counts), capacity)):
                    lost.append((root.pp, root.dp, node.microbatches, zero, schedule, virtual,
                                 leaf.counts if leaf else None))
    assert checked
    assert not lost, f"{len(lost)} of {checked} pruned though the exact estimate fits: {lost[:4]}"
