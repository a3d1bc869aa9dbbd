"""The search's memos and shortcuts change no answer (11d088c ... 5c88b13): on 54 small problems (seeded: each model at
each pipeline degree twice, the rest drawn) every leaf a brute force resolves (its split, N, bound and exact bound), the
search's best three plans with their step times and memory, and its counters are the same with the memos and shortcuts
as with each memo defeated and each shortcut replaced by what it stands for (`_plain`).

Defeated: the caps, the splits' fit, the least N and `_held_room` never found in their caches (keyed by
`Figures.memory_class`, what they read of a memory: a field missing from that key lets two memories share caps), nor
ZeRO's gathered units, torch's buffers, their plan per microbatch shape and the held arrays in the figures'; the rule's
caps by `rank_caps`' general path, not `_rule_caps`, and lowered where the rule admits no split, every row of N at once
(`rank_caps`' `virtual` not given); `partition_blocks`' greedy from the least blocks on, not past
`_below`; no leaf refused by `Caps.may_admit` before its caps; the stages' ends per rank map uncached; a split's seconds and caps stage by stage, as before `Splits._seconds`;
the interleaved rows from torch's step-by-step loop with counters, not the walk; `held_profiles` and `figures._beyond` as
their loops were; the schedules' layouts laid out again. The problems: one, two and three kinds of block, tied, MoE, a
head of many blocks, not a transformer; one or two device types; memory from tight (the caps bind: partial recomputation
and offloading) to loose; ZeRO 0-3, every schedule family on 2 and 4 ranks (microbatches a multiple of them or not), cp,
ep, recomputation, param_dtype, torch's or Megatron-LM's pipeline, outputs returned or dropped, a fused loss.

It found `rank_caps`' general path giving a rank that gathers ZeRO's units apart (no pipeline) the blocks one unit
leaves room for where two blocks and two units do not fit (`_rule_caps` and the rows of every N hold it to one):
`test_a_rank_that_gathers_two_units_where_they_do_not_fit_holds_one_block`. Of the caps' keys, the stage map and the
kept block's bytes follow from `id(inflight)` and the class; of `memory_class`'s, the head's copy of the embedding and
ZeRO's gathering plan followed from the per-kind figures here (dropping either changed no answer), torch's buffers'
sizes do not: ZeRO-0 memories of pp 2 and 4 at the same tokens a microbatch differ in them alone (the last test)."""
from __future__ import annotations

import collections
import dataclasses
import random

import numpy as np
import pytest
from test_schedule_generators import _interleaved_by_counters  # torch's loop, a counter per stage's microbatches
from test_search import MODELS as SEARCH_MODELS
from test_search_two_kinds import MODELS as KINDS_MODELS

from plandsl import api, ir
from plandsl.cost.compute import DEFAULT_EFFICIENCY
from plandsl.cost.estimate import estimate_plan
from plandsl.cost.memory import torch_stage_sizes
from plandsl.ir.placement import Assignment
from plandsl.schedules import bounded, generators
from plandsl.schedules.program import Kind
from plandsl.search import Problem, SearchError, parse_pins, search, with_modules
from plandsl.search import figures as figures_module
from plandsl.search import partition
from plandsl.search.caps import Caps
from plandsl.search.figures import Figures
from plandsl.search.problem import build_plan
from plandsl.search.space import Space
from plandsl.search.splits import Splits
from plandsl.search.tree import candidate_of
from tests.support import space_leaves

HARDWARE = """
device gpu {{ memory = {memory} GiB; bandwidth = 1000 GB/s; peak = {{ bf16: 200 TFLOP/s, fp32: 20 TFLOP/s }} }}
device fast {{ memory = {fast} GiB; bandwidth = 2000 GB/s; peak = {{ bf16: 600 TFLOP/s, fp32: 60 TFLOP/s }} }}
node box {{ devices = 2 x gpu; link = {{ bandwidth: 100 GB/s, latency: 2 us }}; nic = {{ bandwidth: 20 GB/s, latency: 5 us }} }}
node quick {{ devices = 2 x fast; link = {{ bandwidth: 200 GB/s, latency: 2 us }}; nic = {{ bandwidth: 40 GB/s, latency: 5 us }} }}
cluster pair = box x 2
cluster mixed = [box x 1, quick x 1]
cluster eight = box x 4
cluster mixed_eight = [box x 2, quick x 2]
"""
# each model and the memory (GiB) at which its plans start to fit on `pair` at a batch of 8: the problems' memory is a
# multiple of it, from tight (the caps bind, partial recomputation and offloading) to loose
MODELS = {"gpt": (SEARCH_MODELS["gpt"], 0.15), "tied": (SEARCH_MODELS["tied"], 0.3),
          "moe": (SEARCH_MODELS["moe"], 0.06), "long": (SEARCH_MODELS["long"], 6.0), "mlp": (SEARCH_MODELS["mlp"], 0.1),
          "alternating": (KINDS_MODELS["alternating"], 1.5), "windowed": (KINDS_MODELS["windowed"], 0.35),
          "three_kinds": (KINDS_MODELS["three_kinds"], 0.5),
          # a head of many blocks' seconds and bytes: splits with end stages of few blocks or none
          "vocab": ("gpt(layers=8, hidden=256, heads=4, seq=256, vocab=32000, tied=true)", 0.25)}
SCHEDULES = ["1f1b", "gpipe", "interleaved_1f1b", "looped_bfs", "zb_h1", "zb_h2", "interleaved_zero_bubble", "zbv",
             "dualpipev", "chimera"]


class _Never(dict):
    """A cache that never holds anything: every lookup misses, every store is dropped."""

    def get(self, key, default=None):
        return default

    def __contains__(self, key) -> bool:
        return False

    def __setitem__(self, key, value) -> None:
        pass


def _held_profiles_loop(schedule, weight_grad_fraction: float = 0.5) -> tuple:
    """`simulate.held_profiles` as it was before ad6efee: each rank's stages by a scan of the stage map."""
    change = {Kind.F: 1.0, Kind.B: -1.0, Kind.I: weight_grad_fraction - 1.0, Kind.W: -weight_grad_fraction}
    single = schedule.stage_to_rank[0]
    out = []
    for rank, row in enumerate(schedule.actions):
        own = [s for s, r in enumerate(single) if r == rank]
        column = {s: j for j, s in enumerate(own)}
        held, seen, rising = [0.0] * len(own), set(), False
        for stage, kind, _ in row:
            delta = change.get(kind)
            if delta is None:
                continue
            if rising and kind is not Kind.F:
                seen.add(tuple(held))
            held[column[stage]] += delta
            rising = kind is Kind.F
        if rising:
            seen.add(tuple(held))
        out.append(tuple(sorted(seen)) or ((0.0,) * len(own),))
    return tuple(out)


def _beyond_loop(profiles, inflight, last_rank: int, head: float) -> bool:
    """`figures._beyond` as it was before 5c88b13: every moment looked at."""
    beyond = False
    for rank, moments in enumerate(profiles):
        rule = float(inflight[rank])
        for moment in moments:
            if any(h > rule * (1 + 1e-12) for h in moment) or \
                    (rank == last_rank and moment[-1] > head * (1 + 1e-12)):
                beyond = True
    return beyond


def _transformer_partition_loop(self, node, ranks, inflight, memory, virtual, rank_caps=None):
    """`Splits.transformer_partition` as it was before 9e75a3b: each stage's seconds and caps one at a time."""
    root = node.root
    stages = len(ranks)
    rank_caps = rank_caps or self.caps.caps(root, ranks, inflight, memory, virtual)
    if rank_caps is None:
        return None
    key = (node.ident, ranks, tuple(rank_caps))
    found = self._partition_cache.get(key, False)
    if found is not False:
        return found
    costs = {}
    fixed, per_block, caps, seen = [], [], [], [0] * root.pp
    for s, r in enumerate(ranks):
        device = root.rank_devices[r]
        cost = costs.get(device.name)
        if cost is None:
            embed, block, norm, head = self.figures.kind_times(node.kept or node, device)[:4]
            cost = costs[device.name] = (embed.forward + embed.backward, block.forward + block.backward,
                                         norm.forward + norm.backward + head.forward + head.backward)
        fixed.append((cost[0] if s == 0 else 0.0) + (cost[2] if s == stages - 1 else 0.0))
        per_block.append(cost[1])
        base, more = divmod(rank_caps[r], virtual)
        caps.append(base + (1 if seen[r] < more else 0))
        seen[r] += 1
    found = self._partition_cache[key] = self._blocks_split(fixed, per_block, caps, ranks, rank_caps)
    return found


def _plain(monkeypatch) -> None:
    """Every memo of the search's memory figures defeated and every shortcut replaced by what it stands for."""
    figures_init, caps_init, rank_caps = Figures.__init__, Caps.__init__, Caps.rank_caps

    def figures(self, *args, **kwargs):
        figures_init(self, *args, **kwargs)
        for name in ("_gathered_cache", "_buffers_cache", "_buffer_shapes", "_held_cache", "_open_cache",
                     "_gradients_cache"):
            setattr(self, name, _Never())

    def caps(self, *args, **kwargs):
        caps_init(self, *args, **kwargs)
        self._caps_cache, self._held_cache, self._bound_cache = _Never(), _Never(), _Never()

    def general(self, root, ranks, inflight, memory, recomputed=None, kept=0.0, held=False, virtual=None):
        if recomputed is not None or held:  # every caps lowered, every row of N (without `virtual`)
            return rank_caps(self, root, ranks, inflight, memory, recomputed, kept, held)
        self.figures.held = lambda inflight: None  # `_held_caps` then leaves the general path's caps as they are
        try:
            return rank_caps(self, root, ranks, inflight, memory, None, kept, True)
        finally:
            del self.figures.held

    monkeypatch.setattr(Figures, "__init__", figures)
    monkeypatch.setattr(Caps, "__init__", caps)
    monkeypatch.setattr(Caps, "rank_caps", general)
    monkeypatch.setattr(Caps, "may_admit", lambda *args: True)  # every leaf's caps computed
    monkeypatch.setattr(Splits, "transformer_partition", _transformer_partition_loop)
    monkeypatch.setattr(partition, "_below", lambda blocks, fixed, per_block, caps, least: list(least))
    monkeypatch.setattr(figures_module, "_stage_ends", figures_module._stage_ends.__wrapped__)
    monkeypatch.setattr(figures_module, "_beyond", _beyond_loop)
    monkeypatch.setattr(generators, "_interleaved_rank", _interleaved_by_counters)
    monkeypatch.setattr(bounded, "held_profiles", _held_profiles_loop)
    monkeypatch.setattr(bounded, "_layouts", collections.OrderedDict())  # laid out again, by the loop above
    monkeypatch.setattr(bounded, "_held", [0])


def _answers(problem: Problem, pins: dict):
    """Every leaf of the space as brute force resolves it, and the search's best three with its counters."""
    try:
        given, parsed = with_modules(problem, parse_pins(pins))
        space = Space(given, parsed, DEFAULT_EFFICIENCY)
        leaves = [(root.dp, root.tp, root.pp, root.cp, root.ep, root.order, node.micro_batch, node.recompute,
                   node.offload, node.bound, leaf.schedule, leaf.virtual, leaf.zero, leaf.counts, leaf.recompute_layers,
                   leaf.offload_layers, leaf.bound, space.finish(leaf).bound)
                  for root, node, leaf in space_leaves(space)]
    except SearchError as error:
        leaves = str(error)
    try:
        found = search(problem, pins=pins, top=3)
    except SearchError as error:
        return leaves, str(error)
    stats = dataclasses.asdict(found.stats)
    del stats["seconds"]
    return leaves, [(s.candidate, s.blocks, s.estimate.time.step, s.estimate.memory)
                    for s in found.candidates], stats


def _problem(seed: int) -> tuple[Problem, dict]:
    """A small problem and pins: the model and the pipeline's degree by the seed (each pair in turn), the rest drawn
    from it."""
    rng = random.Random(seed)
    model, fits = MODELS[sorted(MODELS)[seed % len(MODELS)]]
    memory = round(fits * rng.choice([0.8, 1.0, 1.0, 1.25, 1.6, 3.0]), 3)
    text = HARDWARE.format(memory=memory, fast=round(memory * rng.choice([1.0, 1.5]), 3))
    document = api.loads(text + f"model m = {model}\n")
    pp = (1, 2, 4)[seed // len(MODELS) % 3]  # each model at each degree
    chosen = rng.choice(["pair", "mixed"] + (["eight", "mixed_eight"] if pp == 4 else []))  # pp 4 beside dp 2
    cluster = next(c for c in document.clusters if c.name == chosen)
    fields = {key: value for key, value in (("param_dtype", ir.Precision.bf16), ("pipeline", "megatron"),
                                            ("outputs", "returned"), ("loss", ir.Loss.fused)) if rng.random() < 0.25}
    problem = Problem(document.models[0], cluster, rng.choice([4, 6, 8]), **fields)
    # the pipeline's degree and the micro-batch pinned, at times one more: a brute force of each space in a second
    schedules = ["1f1b", "interleaved_1f1b"] if problem.pipeline == "megatron" else SCHEDULES
    pins = {"pp": pp, "micro_batch_size": rng.choice([1, 2])}
    more = rng.choice([None, None, "zero_stage", "recompute", "schedule"] +
                      (["cp", "ep"] if cluster.num_devices > pp else []))
    if more is not None:
        pins[more] = {"zero_stage": rng.randint(0, 3), "recompute": rng.choice(["none", "full", "selective"]),
                      "schedule": rng.choice(schedules), "cp": 2, "ep": 2}[more]
    return problem, pins


@pytest.mark.parametrize("seed", range(54))
def test_the_search_answers_alike_with_its_memos_and_shortcuts_and_without(seed):
    problem, pins = _problem(seed)
    fast = _answers(problem, pins)
    with pytest.MonkeyPatch.context() as monkeypatch:
        _plain(monkeypatch)
        plain = _answers(problem, pins)
    assert fast == plain


def test_a_rank_that_gathers_two_units_where_they_do_not_fit_holds_one_block():
    """Without a pipeline ZeRO-2/3 gathers a block's units apart from the states (`Figures.gathered`): a rank with two
    or more blocks gathers two, one with a block one. Where two blocks do not fit beside two units the rank holds one
    block at most, whatever one unit leaves room for: `Caps.rank_caps` says so by the rule (`_rule_caps`), with the
    simulated peak (held=True; nothing is held without a schedule) and for each N of recompute_layers and
    offload_layers alone, as in `least_recomputed`'s rows of every N; and where its caps admit the model's blocks the
    exact estimate fits them. (Its rank-by-rank path gave the room one unit leaves: 2 blocks of this 2-block model on
    45 MiB devices at ZeRO-2 and 3, which the exact estimate refuses.)"""
    model, _ = MODELS["moe"]
    document = api.loads(HARDWARE.format(memory=0.048, fast=0.048) + f"model m = {model}\n")
    space = Space(Problem(document.models[0], document.clusters[0], 4), {"pp": 1}, DEFAULT_EFFICIENCY)
    caps, one, blocks = space.caps, np.ones(1), space.blocks
    compared = bound = 0
    for root in space.roots():
        for node in space.expand_root(root):
            for zero in (2, 3) if root.data_ranks > 1 else ():
                memory = space.figures.layer_memory(node, zero)
                rule = caps.rank_caps(root, (0,), one, memory).tolist()
                assert caps.rank_caps(root, (0,), one, memory, held=True).tolist() == rule
                plan = build_plan(space.base, candidate_of(node, "", 1, zero))
                whole = Assignment((tuple(space.figures.stage_layers((blocks,))[0]),), (0,), 1)
                estimate = estimate_plan(plan, DEFAULT_EFFICIENCY, whole)
                assert rule[0] < blocks or estimate.memory[0].total <= estimate.capacity[0]
                unit, units = (space.figures.gathered(memory, True, True, n) for n in (1, 2))
                bound += rule[0] == 1 and unit < units
                apart = [caps.offload_memory(memory)]
                if node.kept is not None:
                    apart.append(caps.partial_memory(memory, space.figures.layer_memory(node.kept, zero)))
                for figures, kept in apart:
                    rows = caps.rank_caps(root, (0,), one, figures, np.arange(1.0, blocks + 1), kept).tolist()
                    for n, row in enumerate(rows, start=1):
                        assert caps.rank_caps(root, (0,), one, figures, n, kept).tolist() == row
                        assert caps.rank_caps(root, (0,), one, figures, n, kept, held=True).tolist() == row
                compared += 1
    assert compared > 20 and bound > 5


@pytest.mark.parametrize("model, outputs", [("long", "dropped"), ("vocab", "returned")])
def test_torch_buffers_plan_of_a_microbatch_shape_sizes_each_memory_as_its_own(model, outputs):
    """`Figures.layer_memory` builds the plan that torch's pipeline buffers are counted for once per shape of the
    microbatches (degrees, micro-batch, sequence parallelism; c34d762): its sizes are those of each memory's own plan
    (its ZeRO stage and recomputation), as `stage_buffers` reads them. And the memories one `Figures.memory_class`
    names (d58a426: the caps, the splits' fit and the least N shared by them) are alike in all the caps read: the
    per-kind figures, the head's copy of the embedding, ZeRO's gathered units and torch's buffers' sizes, partly
    recomputed and offloading memories included, over pipelines of 1, 2, 4 and 8 ranks (the buffers alone tell apart
    ZeRO-0 memories of pp 2 and 4 at the same tokens a microbatch: m differs)."""
    text, fits = MODELS[model]
    document = api.loads(HARDWARE.format(memory=fits, fast=fits) + f"model m = {text}\n")
    cluster = next(c for c in document.clusters if c.name == "eight")
    space = Space(Problem(document.models[0], cluster, 8, outputs=outputs), {}, DEFAULT_EFFICIENCY)
    figures, compared, read = space.figures, 0, {}

    def reads(memory):
        plan, sizes = figures._buffer_plans.get(id(memory), (None, None))
        return (memory[0], memory[1], [figures.gathered(memory, first, last, n) for first in (False, True)
                                       for last in (False, True) for n in (1, 2)],
                None if sizes is None else (sizes, plan.stages.outputs, plan.train.loss))

    for root in space.roots():
        for node in space.expand_root(root):
            for zero in (0, 1, 2, 3) if root.data_ranks > 1 else (0,):
                memory = figures.layer_memory(node, zero)
                memories = [memory, space.caps.offload_memory(memory)[0]]
                if node.kept is not None:
                    memories.append(space.caps.partial_memory(memory, figures.layer_memory(node.kept, zero))[0])
                for each in memories:
                    read.setdefault(figures.memory_class(each), []).append(reads(each))
                if root.pp > 1:
                    plan, sizes = figures._buffer_plans[id(memory)]
                    own = build_plan(space.base, candidate_of(node, "", 1, zero))
                    assert sizes == torch_stage_sizes(own) is not None
                    assert (plan.stages.outputs, plan.train.loss) == (own.stages.outputs, own.train.loss)
                    compared += 1
    assert all(alike == found[0] for found in read.values() for alike in found)
    assert compared > 100 and sum(len(found) > 1 for found in read.values()) > 10


def test_caps_refused_before_their_terms_are_caps_that_admit_no_split():
    """`Caps.may_admit` refuses a leaf's caps before `rank_caps` computes them (each rank's capacity less the working set
    over a block's states and in-flight activations: caps at least `rank_caps`' own): wherever it refuses, `rank_caps`
    admits no split either, on the seeded problems above (it refuses some on each of several of them; the search's
    answers with and without it are the test above's)."""
    refused = []
    may_admit = Caps.may_admit

    def spy(self, root, ranks, inflight, memory, virtual):
        found = may_admit(self, root, ranks, inflight, memory, virtual)
        if not found:
            refused.append(bool(self._admit(self.rank_caps(root, ranks, inflight, memory, virtual=virtual), virtual)))
        return found

    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(Caps, "may_admit", spy)
        problems = 0
        for seed in (10, 11, 13, 40, 46):  # those where it refuses some
            before = len(refused)
            problem, pins = _problem(seed)
            _answers(problem, pins)
            problems += len(refused) > before
    assert refused and not any(refused) and problems >= 3
