"""The search's memory caps against the exact estimate: the moments a schedule's simulation may peak at
(`schedules.simulate.held_profiles`), each rank's cap B (its blocks split evenly over its stages, the earlier ones one
more: `Splits.transformer_partition`) fitting the exact estimate where B + 1 does not, across schedules, stages per
rank and recomputation, and the search's best equal to the best over every N of `recompute_layers` on a problem where
caps that counted the in-flight rule alone (not the simulated peak the estimate takes where higher) made them differ."""
import collections
import random

import numpy as np
import pytest
from test_search import MODELS, problem  # the search tests' small problems

from plandsl import api
from plandsl.cost.compute import DEFAULT_EFFICIENCY
from plandsl.cost.estimate import estimate_plan
from plandsl.ir.placement import Assignment
from plandsl.schedules.bounded import builtin_profiles, simulate_builtin
from plandsl.schedules.generators import check_sizes
from plandsl.schedules.simulate import Costs
from plandsl.search import Problem, brute_force, search
from plandsl.search.caps import _ROWS, Caps
from plandsl.search.choices import stage_ranks
from plandsl.search.problem import build_plan
from plandsl.search.space import Space
from plandsl.search.tree import Leaf, candidate_of

SCHEDULES = [("1f1b", 1), ("gpipe", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 3), ("looped_bfs", 2),
             ("zb_h1", 1), ("zb_h2", 1), ("interleaved_zero_bubble", 2), ("zbv", 2), ("dualpipev", 2)]


@pytest.mark.parametrize("schedule, virtual", SCHEDULES)
@pytest.mark.parametrize("pp, microbatches", [(2, 4), (4, 8), (4, 9), (2, 64)])
def test_the_simulated_peak_is_the_largest_sum_over_the_held_moments(schedule, virtual, pp, microbatches):
    """For any stages' bytes, `simulate_builtin`'s peak on a rank (what `cost.estimate` takes where above the in-flight
    rule) is the largest sum of held microbatches x bytes over the moments `builtin_profiles` lists for that rank (64
    microbatches on 2 ranks: past `extrapolated_past`, from the runs it extrapolates)."""
    try:
        profiles = builtin_profiles(schedule, pp, microbatches, virtual)
    except ValueError:  # sizes the schedule does not run
        pytest.skip(f"{schedule} does not run {microbatches} microbatches on {pp} ranks")
    rng = random.Random(f"{schedule}{pp}{microbatches}{virtual}")
    ranks = stage_ranks(schedule, pp, virtual)
    for _ in range(5):
        stored = [rng.choice([0.0, 1.0, rng.uniform(0.1, 5.0)]) for _ in ranks]
        peaks = simulate_builtin(schedule, pp, microbatches, virtual, Costs(activation_bytes=tuple(stored)))
        for rank, moments in enumerate(profiles):
            own = [stored[s] for s, r in enumerate(ranks) if r == rank]
            expected = max(sum(h * b for h, b in zip(moment, own)) for moment in moments)
            assert peaks.ranks[rank].peak_memory_bytes == pytest.approx(expected, rel=1e-9, abs=1e-9)


def _leaves(space):
    """Every leaf of the space (brute force), each with its node."""
    for root in space.roots():
        for node in space.expand_root(root):
            yield from space.expand(node)


def _fits(space, leaf, counts, recomputed):
    """The exact estimate of the leaf with `counts` blocks per stage and `recompute_layers` N: per pipeline rank,
    whether its memory fits its devices."""
    node = leaf.node
    ranks = stage_ranks(leaf.schedule, node.root.pp, leaf.virtual)
    plan = build_plan(space.base, candidate_of(node, leaf.schedule, leaf.virtual, leaf.zero, recomputed))
    stages = Assignment(tuple(tuple(s) for s in space.figures.stage_layers(counts)), ranks, leaf.virtual)
    estimate = estimate_plan(plan, DEFAULT_EFFICIENCY, stages)
    return [m.total <= c for m, c in zip(estimate.memory, estimate.capacity)]


def _exact_caps(space, leaf, ranks, caps, recomputed) -> tuple[int, int]:
    """(splits checked, of them refused): each rank's cap, split evenly over its stages, fits the exact estimate and
    one block more does not (where the rest of the model can be split over the other stages)."""
    checked = below = 0
    for rank, cap in enumerate(caps):
        for held, fits in ((cap, True), (cap + 1, False)):
            counts = _split(space.blocks, ranks, rank, held)
            if counts is None or (not fits and cap >= space.blocks):
                continue
            assert _fits(space, leaf, counts, recomputed)[rank] is fits, (leaf.node, leaf.zero, recomputed, rank, cap)
            checked += 1
            below += not fits
    return checked, below


def _fully_recomputed_memories(space, schedule, virtual):
    """(root, its stages' ranks, node, in flight, ZeRO stage, the node's memory) for every node of `space` that
    recomputes all or none of its blocks, at the sizes `schedule` runs, under ZeRO 0 and 3."""
    for root in space.roots():
        ranks = stage_ranks(schedule, root.pp, virtual)
        for node in space.expand_root(root):
            if node.kept is not None:
                continue
            try:
                check_sizes(schedule, root.pp, node.microbatches, virtual)
            except ValueError:
                continue
            inflight = space.figures.inflight(schedule, root.pp, node.microbatches, virtual)
            for zero in (0, 3):
                yield root, ranks, node, inflight, zero, space.figures.layer_memory(node, zero)


def _split(blocks, ranks, rank, held):
    """Blocks per stage with `held` on `rank`, its stages' even split (the earlier ones one more), and the others'
    blocks as even over the other stages (at least one each); None where they cannot be."""
    own = [s for s, r in enumerate(ranks) if r == rank]
    others = [s for s, r in enumerate(ranks) if r != rank]
    rest = blocks - held
    if held < len(own) or rest < len(others) or (not others and rest):
        return None
    counts = [0] * len(ranks)
    for j, s in enumerate(own):
        counts[s] = held // len(own) + (j < held % len(own))
    for j, s in enumerate(others):
        counts[s] = rest // len(others) + (j < rest % len(others))
    return tuple(counts)


@pytest.mark.slow
@pytest.mark.parametrize("schedule, virtual", [s for s in SCHEDULES if s[0] not in ("gpipe", "looped_bfs")])
def test_each_ranks_cap_is_the_most_blocks_the_exact_estimate_fits(schedule, virtual):
    """On 7.25 GiB devices where memory binds, for every node (recomputation none, selective, full and the first N of
    each stage) at ZeRO 0 and 3 and each rank: the cap's blocks, split evenly over the rank's stages, fit the exact
    estimate, and one block more does not (where the rest of the model can be split over the other stages) — by the
    simulated peak of zero-bubble schedules and of uneven stages, which the in-flight rule alone misses."""
    space = Space(problem("long", "tight", 8), {"schedule": schedule, "virtual_stages": virtual}, DEFAULT_EFFICIENCY)
    checked = below = 0
    for root in space.roots():
        if root.pp == 1:
            continue
        ranks = stage_ranks(schedule, root.pp, virtual)
        for node in space.expand_root(root):
            try:
                check_sizes(schedule, root.pp, node.microbatches, virtual)
            except ValueError:  # too few microbatches for the schedule
                continue
            inflight = space.figures.inflight(schedule, root.pp, node.microbatches, virtual)
            for zero in (0, 3):
                memory = space.figures.layer_memory(node, zero)
                choices = [(None, memory, 0.0)]
                if node.kept is not None:  # recompute_layers: N = 1, 2
                    partial, kept = space.caps.partial_memory(memory, space.figures.layer_memory(node.kept, zero))
                    choices = [(n, partial, kept) for n in (1, 2)]
                for recomputed, figures, kept in choices:
                    caps = space.caps.rank_caps(root, ranks, inflight, figures, recomputed, kept, held=True).tolist()
                    leaf = Leaf(node, schedule, virtual, zero, (), 0.0, recomputed)
                    fitting, refused = _exact_caps(space, leaf, ranks, caps, recomputed)
                    checked, below = checked + fitting, below + refused
    assert checked > 20 and below > 5


@pytest.mark.slow
def test_every_leaf_the_caps_admit_fits_at_its_least_n():
    """Every leaf of a 32-block model on 7.25 GiB devices, at one microbatch (302 before the caps' splits were held to
    the simulated peak, 98 of them partly recomputed leaves whose N was too small, by 1 to 5, and 8 refused whatever
    N): the exact estimate accepts its split, and a partly recomputed one's N is the least with a split that fits,
    the rule's split refused and the simulated peak's caps admitting none at N - 1."""
    from dataclasses import replace
    MODELS["wide"] = "gpt(layers=32, hidden=1024, heads=16, seq=8192, vocab=4096)"
    space = Space(problem("wide", "tight", 4), {"micro_batch_size": 1}, DEFAULT_EFFICIENCY)
    leaves = partial = 0
    for leaf in _leaves(space):
        leaves += 1
        assert space.evaluate(leaf) is not None, leaf
        n = leaf.recompute_layers
        if n is None or n == 1:
            continue
        partial += 1
        node, ranks = leaf.node, stage_ranks(leaf.schedule, leaf.node.root.pp, leaf.virtual)
        memory = space.figures.layer_memory(node, leaf.zero)
        figures, kept = space.caps.partial_memory(memory, space.figures.layer_memory(node.kept, leaf.zero))
        inflight = space.figures.inflight(leaf.schedule, node.root.pp, node.microbatches, leaf.virtual)
        rule = space.caps.caps(node.root, ranks, inflight, figures, leaf.virtual, n - 1, kept)  # the rule's split
        counts = rule and space.splits.transformer_partition(node, ranks, inflight, figures, leaf.virtual, rule)
        assert not counts or space.evaluate(replace(leaf, counts=counts, recompute_layers=n - 1)) is None
        assert space.splits.fitted_partition(node, ranks, inflight, figures, leaf.virtual, n - 1, kept) is None
    assert leaves > 250 and partial > 20


def test_the_search_finds_the_best_over_every_n():
    """pp 2 x cp 2 on 7.25 GiB devices: the best plan under ZeRO-1 recomputed 2 of each stage's 8 blocks under
    interleaved zero bubble (0.5542 s a step); with caps by the in-flight rule alone its leaf took N = 1 at a split of
    7, 9, 7, 9 blocks, which the exact estimate refused (the simulated peak of its uneven stages), and the search
    returned interleaved 1F1B with selective_op (0.5544 s). Since `replicate`'s copies of the stages' weights are
    counted (`cost.memory.replicate_copy_bytes`) ZeRO-1's best recomputes nothing (0.5794 s); under ZeRO-0 (the
    optimizer states whole too) the best recomputes 5 blocks of each stage. The best of brute force over every leaf at
    every N with its caps' split is the search's, both ways."""
    MODELS["wide"] = "gpt(layers=32, hidden=1024, heads=16, seq=8192, vocab=4096)"
    p = problem("wide", "tight", 4)
    for zero, best in ((1, (("interleaved_1f1b", None), 0.57937)), (0, (("interleaved_zero_bubble", 5), 0.6242))):
        assert _best_over_every_n(p, {"pp": 2, "cp": 2, "micro_batch_size": 1, "zero_stage": zero}) == best


def _best_over_every_n(p, pins):
    """The search's best's (schedule, N) and step, once checked against brute force at every N."""
    space = Space(p, pins, DEFAULT_EFFICIENCY)
    steps = []
    for root in space.roots():
        for node in space.expand_root(root):
            pending = space.pending(node)
            for _, _, zero, schedule, virtual in pending.leaves if pending is not None else ():
                if node.kept is None:
                    leaf = space._leaf(node, zero, schedule, virtual, pending.memory[zero])
                    scored = leaf and space.evaluate(leaf)
                    steps += [scored.estimate.time.step] if scored else []
                    continue
                ranks = stage_ranks(schedule, root.pp, virtual)
                inflight = space.figures.inflight(schedule, root.pp, node.microbatches, virtual)
                figures, kept = space.caps.partial_memory(pending.memory[zero],
                                                          space.figures.layer_memory(node.kept, zero))
                for n in range(1, space.blocks):  # every N, each at the split its caps give
                    caps = space.caps.caps(root, ranks, inflight, figures, virtual, n, kept)
                    counts = caps and space.splits.transformer_partition(node, ranks, inflight, figures, virtual, caps)
                    scored = counts and n < max(counts) and space.evaluate(Leaf(node, schedule, virtual, zero, counts,
                                                                                0.0, n))
                    steps += [scored.estimate.time.step] if scored else []
    best = search(p, pins=pins, top=1).best
    assert best.estimate.time.step == pytest.approx(min(steps), rel=1e-12)
    return (best.candidate.schedule, best.candidate.recompute_layers), round(best.estimate.time.step, 5)


def test_a_refused_partly_recomputed_leaf_is_tried_at_the_next_n(monkeypatch):
    """Where the exact estimate still refuses a leaf the caps admit (the caps leave out the merge of returned outputs
    at the step's end), the search asks for it again at N + 1 (`Space.retry`) rather than dropping it, as brute force
    does (`Space.settle`): here with every leaf at N = 1 refused."""
    p = problem("long", "tight", 4)
    evaluate, tried = Space.evaluate, set()

    def refuse_one(self, leaf):
        tried.add(leaf.recompute_layers)
        return None if leaf.recompute_layers == 1 else evaluate(self, leaf)

    monkeypatch.setattr(Space, "evaluate", refuse_one)
    ranked = brute_force(p, pins={"pp": 4})
    assert {1, 2} <= tried and any(s.candidate.recompute_layers == 2 for s in ranked)
    assert all(s.candidate.recompute_layers != 1 for s in ranked)
    found = search(p, pins={"pp": 4}, top=3)
    assert [s.estimate.time.step for s in found.candidates] == \
        pytest.approx([s.estimate.time.step for s in ranked[:3]], rel=1e-12)


def test_an_interleaved_ranks_caps_count_one_open_stages_gradients():
    """ZeRO-3 under torch's interleaved 1F1B over one round (m = pp): a rank frees each stage's unsharded gradients after
    its last backward, and holds one stage's at a time (`cost.memory.open_gradient_stages`), so its caps admit more
    blocks than counting every stage's gradients at once (as the caps did before) and the exact estimate fits them."""
    schedule, virtual = "interleaved_1f1b", 2
    pins = {"schedule": schedule, "virtual_stages": virtual, "zero_stage": 3}
    space = Space(problem("long", "tight", 8), pins, DEFAULT_EFFICIENCY)
    before = Space(problem("long", "tight", 8), pins, DEFAULT_EFFICIENCY)
    before.figures.gradients = lambda memory: None  # every stage's gradients at once, as before
    more = 0
    for root in space.roots():
        if root.pp == 1 or root.dp == 1:  # no pipeline, or nothing to shard
            continue
        ranks = stage_ranks(schedule, root.pp, virtual)
        for node in space.expand_root(root):
            if node.microbatches != root.pp or node.kept is not None:
                continue
            caps = []
            for each in (space, before):
                inflight = each.figures.inflight(schedule, root.pp, node.microbatches, virtual)
                memory = each.figures.layer_memory(node, 3)
                caps.append(each.caps.rank_caps(root, ranks, inflight, memory, held=True).tolist())
                assert (each.figures.gradients(memory) is None) is (each is before)
                assert each.figures.open_stages(inflight) is not None
            leaf = Leaf(node, schedule, virtual, 3, (), 0.0, None)
            for rank, (cap, was) in enumerate(zip(*caps)):
                assert cap >= was
                counts = _split(space.blocks, ranks, rank, cap)
                if cap > was and counts is not None:
                    assert _fits(space, leaf, counts, None)[rank]  # what the old count refused, the estimate fits
                    more += 1
    assert more > 0


def test_a_tied_head_apart_from_multi_token_predictions_copy_is_counted_twice_by_the_caps():
    """A tied head with multi-token prediction under a schedule that splits the backward (zbv) holds its own weight
    beside the depths' copy of the embedding (`cost.memory.head_weight_apart`): two tables on the head's stage in the
    exact estimate. The caps counted one (`Figures._states` is built without a schedule), so a rank's cap was a block
    or two past what the exact estimate fits, the split it made was refused, and on 8 GiB devices the search found no
    plan at all for pp = 2 under zbv. Each cap is now the most blocks the exact estimate fits, and the search finds
    the plan (on 9 GiB devices since the embedding's and its copy's gradients over the whole vocabulary under torch's
    tensor parallelism are counted, `cost.memory.whole_vocab_gradient_bytes`: 0.5 GiB more on the first rank at tp 2)."""
    from test_search import HARDWARE

    from plandsl import api
    from plandsl.search import Problem
    model = "llama(layers=16, hidden=2048, heads=16, kv_heads=4, seq=4096, vocab=65536, mtp=1, tied=true)"

    def mtp_problem(memory):
        document = api.loads(HARDWARE.replace("memory = 7.25 GiB", f"memory = {memory}") + f"model m = {model}\n")
        return Problem(document.models[0], next(c for c in document.clusters if c.name == "tight"), 8, None)

    schedule, virtual = "zbv", 2
    space = Space(mtp_problem("7.25 GiB"), {"schedule": schedule, "virtual_stages": virtual, "pp": 2},
                  DEFAULT_EFFICIENCY)
    checked = below = 0
    for root in space.roots():
        ranks = stage_ranks(schedule, root.pp, virtual)
        for node in space.expand_root(root):
            if node.kept is not None:
                continue
            inflight = space.figures.inflight(schedule, root.pp, node.microbatches, virtual)
            assert space.figures.tied_copies(inflight) == 2
            for zero in (0, 3):
                memory = space.figures.layer_memory(node, zero)
                caps = space.caps.rank_caps(root, ranks, inflight, memory, held=True).tolist()
                leaf = Leaf(node, schedule, virtual, zero, (), 0.0, None)
                fitting, refused = _exact_caps(space, leaf, ranks, caps, None)
                checked, below = checked + fitting, below + refused
    assert checked > 20 and below > 5
    best = search(mtp_problem("9 GiB"), pins={"schedule": schedule, "pp": 2}, top=1).best
    assert all(m.total <= c for m, c in zip(best.estimate.memory, best.estimate.capacity))


class _EveryRowLowered(Caps):
    """`Caps` whose `rank_caps` is never given `virtual`: every caps lowered by `_held_caps`, every row of N at once."""

    def rank_caps(self, root, ranks, inflight, memory, recomputed=None, kept=0.0, held=False, virtual=None):
        return Caps.rank_caps(self, root, ranks, inflight, memory, recomputed, kept, held)


def _own_caches(caps: Caps) -> Caps:
    caps._caps_cache, caps._held_cache, caps._bound_cache = {}, {}, {}  # not the figures' shared ones
    return caps


@pytest.mark.slow
@pytest.mark.parametrize("cluster, pp, memory, deeper", [("pair", 2, 3.5, False), ("eight", 4, 2.0, False),
                                                         ("pair", 2, 4.5, True)])
def test_caps_left_unlowered_where_no_split_fits_change_no_answer(monkeypatch, cluster, pp, memory, deeper):
    """`Caps.caps` and `least_recomputed` give `rank_caps` `virtual`: caps that admit no split by the rule are not
    lowered by `_held_caps` (it only lowers them), and the rows of N are lowered `_ROWS` at a time from the first the
    rule admits up to a window holding one the lowered caps admit, the rows past it -1 and not cached (5cbaddd). Where
    they are lowered (torch's interleaved 1F1B and looped BFS under ZeRO-3: a rank holds its open stages' gradients),
    on a 32-block model: the least N of every partly recomputed and offloading memory, and its caps at every N (the
    rule's and held), are those of caps lowered everywhere, every row at once; each row a window lowers is that row
    lowered with all the others, to the bit; no row before the least N admits a split. `deeper`: each cap lowered 8
    blocks more (whatever `_held_caps` lowers by, row by row), so that the least N lies windows past the first row the
    rule admits. (tests/unit/test_search_memos.py's problems lower 13 rows at most, one window.)"""
    hardware = f"""
device gpu {{ memory = {memory} GiB; bandwidth = 1000 GB/s; peak = {{ bf16: 200 TFLOP/s, fp32: 20 TFLOP/s }} }}
node box {{ devices = 2 x gpu; link = {{ bandwidth: 100 GB/s, latency: 2 us }}; nic = {{ bandwidth: 20 GB/s, latency: 5 us }} }}
cluster {cluster} = box x {4 if cluster == "eight" else 2}
"""
    document = api.loads(hardware + "model m = gpt(layers=32, hidden=1024, heads=16, seq=4096, vocab=4096)\n")
    space = Space(Problem(document.models[0], document.clusters[0], 8), {"pp": pp, "zero_stage": 3},
                  DEFAULT_EFFICIENCY)
    figures = space.figures
    if deeper:
        held_caps = Caps._held_caps
        monkeypatch.setattr(Caps, "_held_caps", lambda *args: np.maximum(held_caps(*args) - 8.0, 0.0))
    lowering, lowered = Caps._held_caps, []  # the rows each `_held_caps` call of the windowed rows lowers

    def counted(self, root, ranks, inflight, memory, caps, *args):
        lowered.append(len(caps))
        return lowering(self, root, ranks, inflight, memory, caps, *args)

    seen = collections.Counter()
    for root in space.roots():
        for node in space.expand_root(root):
            memory = figures.layer_memory(node, 3)
            for schedule, virtual in (("interleaved_1f1b", 2), ("interleaved_1f1b", 4), ("looped_bfs", 2)):
                try:
                    check_sizes(schedule, root.pp, node.microbatches, virtual)
                except ValueError:
                    continue
                ranks = stage_ranks(schedule, root.pp, virtual)
                inflight = figures.inflight(schedule, root.pp, node.microbatches, virtual)
                short, every = _own_caches(Caps(figures)), _own_caches(_EveryRowLowered(figures))
                apart = [short.offload_memory(memory)]
                if node.kept is not None:
                    apart.append(short.partial_memory(memory, figures.layer_memory(node.kept, 3)))
                for partial, kept in apart:
                    if short._released(partial, inflight) is None:  # every stage's gradients held: not lowered
                        continue
                    high = space.blocks - len(ranks) + 1
                    found = short.least_recomputed(root, ranks, inflight, partial, virtual, kept)
                    assert found == every.least_recomputed(root, ranks, inflight, partial, virtual, kept)
                    for n in range(1, high + 1):
                        for held in (False, True):
                            assert short.caps(root, ranks, inflight, partial, virtual, n, kept, held) == \
                                every.caps(root, ranks, inflight, partial, virtual, n, kept, held), (n, held)
                    choices = np.arange(1.0, high + 1)
                    lowered.clear()
                    with monkeypatch.context() as patch:
                        patch.setattr(Caps, "_held_caps", counted)
                        windowed = short.rank_caps(root, ranks, inflight, partial, choices, kept, virtual=virtual)
                    rows = every.rank_caps(root, ranks, inflight, partial, choices, kept)
                    given = windowed[:, 0] >= 0  # the rows not left out
                    least = found - 1 if found is not None else high
                    assert not short._admit(windowed[:least], virtual).any() and given[:least].all()
                    assert np.array_equal(windowed[least:][given[least:]], rows[least:][given[least:]])
                    assert (windowed[~given] == -1).all() and all(n <= _ROWS for n in lowered)
                    seen["found" if found is not None else "none"] += 1
                    seen["windows", min(len(lowered), 2)] += 1
                    seen["found past a window"] += found is not None and len(lowered) > 1
                    seen["left out"] += not given.all()
    # the rule admitting none (no row lowered), the rows lowered past every window, the least N past the first window
    assert seen["found"] > 50 and seen["left out"] > 50, seen
    assert (seen["found past a window"] > 10) if deeper else (seen["windows", 0] > 10 and seen["windows", 2] > 3), seen
