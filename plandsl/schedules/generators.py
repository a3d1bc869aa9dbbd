"""The built-in pipeline schedules: name and sizes -> what each rank computes, in order.

Contract: `generate(name, ranks, microbatches, virtual=None) -> Schedule` holds compute actions
only (F, then B or I and W) and never communication, which `schedules.lower` derives; it raises
ValueError, with the numbers, for an unknown name or sizes the schedule cannot run
(`check_sizes`, which lays nothing out), and TooLarge past `MAX_ACTIONS` actions. Where
torch.distributed.pipelining ships the schedule (GPipe, Interleaved1F1B, LoopedBFS,
InterleavedZeroBubble, ZBVZeroBubble, DualPipeV) each rank's order is torch's, idle steps left
out and DualPipeV's OVERLAP_F_B read as its forward then its backward; so are its size rules.
"""
from __future__ import annotations

import functools
from collections import deque

from plandsl.diagnostics.limits import MAX_ACTIONS

from .program import Action, Kind, Schedule, gc_paused, loop_map, vshape_map
from .registry import BUILTIN, min_microbatches, pipelines_of, splits_backward

F, B, I, W = Kind.F, Kind.B, Kind.I, Kind.W  # noqa: E741 - the notation's letters


# `generate` lays out at most `limits.MAX_ACTIONS` actions (TooLarge past it, E609). Checking and
# estimating never lay one out (`check_sizes`, `schedules.bounded`).


class TooLarge(ValueError):
    """The schedule's table would hold more than `MAX_ACTIONS` actions."""


def generate(name: str, ranks: int, microbatches: int, virtual: int | None = None) -> Schedule:
    """The built-in schedule `name` for `ranks` x `microbatches` and `virtual` stages per rank.

    None for `virtual` means the schedule's usual count: 2 for the looped and V-shape schedules
    and for chimera (one stage of each pipeline per rank), 1 for the others. ValueError when the
    sizes do not fit the schedule (`check_sizes`), TooLarge past `MAX_ACTIONS` actions."""
    virtual = check_sizes(name, ranks, microbatches, virtual)
    actions = count_actions(name, ranks, microbatches, virtual)
    if actions > MAX_ACTIONS:
        raise TooLarge(f"schedule '{name}' for {ranks} ranks x {microbatches:,} microbatches"
                       f"{f' x {virtual} stages per rank' if virtual > 1 else ''} is {actions:,} actions, more than "
                       f"the {MAX_ACTIONS:,} a whole table is laid out with")
    with gc_paused():
        if BUILTIN[name].virtual == "any":
            return _GENERATORS[name](ranks, microbatches, virtual)
        return _GENERATORS[name](ranks, microbatches)


def generate_rounds(name: str, ranks: int, microbatches: int, virtual: int, per_round: int) -> Schedule:
    """A built-in that runs in rounds (`ScheduleInfo.rounds`) with `per_round` microbatches a round,
    whatever m's own rounds would be (`schedules.bounded` lays out fewer rounds of the full schedule)."""
    return _GENERATORS[name](ranks, microbatches, virtual, per_round=per_round)


def count_actions(name: str, ranks: int, microbatches: int, virtual: int) -> int:
    """Compute actions of the table, at most: F and B (or F, I and W) per stage and microbatch."""
    return ranks * virtual * microbatches * (3 if splits_backward(name) else 2)


def check_sizes(name: str, ranks: int, microbatches: int, virtual: int | None = None) -> int:
    """The stages per rank `name` runs for these sizes (None: its usual count); ValueError, with
    the numbers, when the schedule cannot run them. The rules are the columns of its `ScheduleInfo`
    (`registry`), so a new schedule needs no edit here. Constant time: nothing is laid out."""
    if name not in _GENERATORS:
        raise ValueError(f"unknown schedule '{name}'; the built-in ones are {', '.join(_GENERATORS)}")
    if ranks < 1 or microbatches < 1:
        raise ValueError(f"schedule '{name}' needs at least 1 rank and 1 microbatch, "
                         f"got ranks = {ranks}, microbatches = {microbatches}")
    info = BUILTIN[name]
    wanted = info.virtual
    if wanted == "any":
        virtual = 2 if virtual is None else virtual
        if virtual < 1:
            raise ValueError(f"schedule '{name}' needs at least 1 stage per rank, got virtual = {virtual}")
    else:
        needed = 2 if wanted == "two" else 1
        if virtual not in (None, needed):
            each = " (one of each pipeline)" if info.pipelines == 2 else ""
            raise ValueError(f"schedule '{name}' runs exactly {needed} stage{'s' if needed > 1 else ''} per rank"
                             f"{each}, got virtual = {virtual}")
        virtual = needed
    need = min_microbatches(info, ranks)
    if not info.lays_out_fewer:
        written = {"1": "1", "ranks": "ranks", "2*ranks": "2 * ranks"}[info.min_microbatches]
        _need(microbatches >= need, f"{name} needs at least {written} microbatches, "
                                    f"got microbatches = {microbatches} < {written} = {need}")
    if info.pipelines == 2:
        _need(ranks % 2 == 0, f"{name} needs an even number of ranks (two pipelines of p stages, "
                              f"p/2 microbatches each per unit), got ranks = {ranks}")
    if info.multiple_of_ranks:
        _need(microbatches % ranks == 0, f"{name} runs whole units of p microbatches: m must be a multiple of "
                                         f"ranks = {ranks}, got microbatches = {microbatches}")
    if info.rounds:
        microbatches_per_round(name, ranks, microbatches)
    return virtual


def _schedule(name: str, ranks: int, stages: int, microbatches: int, rows: list[list[Action]],
              stage_to_rank: tuple[int, ...]) -> Schedule:
    return Schedule(name, ranks, stages, microbatches, (stage_to_rank,), tuple(map(tuple, rows)))


def _need(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


# ---- one stage per rank ------------------------------------------------------------------------
def gpipe(ranks: int, microbatches: int) -> Schedule:
    """GPipe (Huang et al. 2019, "GPipe: Efficient Training of Giant Neural Networks using Pipeline
    Parallelism"): all forwards, then all backwards, both in microbatch order, as torch's ScheduleGPipe."""
    rows = [[Action(rank, F, m) for m in range(microbatches)] + [Action(rank, B, m) for m in range(microbatches)]
            for rank in range(ranks)]
    return _schedule("gpipe", ranks, ranks, microbatches, rows, loop_map(ranks, ranks))


def one_f_one_b(ranks: int, microbatches: int) -> Schedule:
    """PipeDream-Flush (Narayanan et al. 2021, "Memory-Efficient Pipeline-Parallel DNN Training"):
    rank r runs min(p - r - 1, m) warm-up forwards, then one forward and one backward while
    forwards remain, then the remaining backwards."""
    rows = []
    for rank in range(ranks):
        warmup = min(ranks - rank - 1, microbatches)
        row = [Action(rank, F, m) for m in range(warmup)]
        for m in range(microbatches - warmup):
            row += [Action(rank, F, warmup + m), Action(rank, B, m)]
        row += [Action(rank, B, m) for m in range(microbatches - warmup, microbatches)]
        rows.append(row)
    return _schedule("1f1b", ranks, ranks, microbatches, rows, loop_map(ranks, ranks))


def zb_h1(ranks: int, microbatches: int) -> Schedule:
    """ZB-H1 (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", section 2.1, Figure 3 top): 1F1B
    with each backward split into I and W; rank r holds back its first r W passes so that every
    rank has p microbatches in flight (the peak of 1F1B's first rank) and the held-back W passes
    fill the cool-down bubble. The same order as torch's ScheduleInterleavedZeroBubble (ZB1P) with
    one stage per rank."""
    rows = [_interleaved_rank(rank, ranks, microbatches, 1, microbatches, zero_bubble=True)
            for rank in range(ranks)]
    return _schedule("zb_h1", ranks, ranks, microbatches, rows, loop_map(ranks, ranks))


def zb_h2(ranks: int, microbatches: int) -> Schedule:
    """ZB-H2 (Qi et al. 2024, section 2.2, Figure 3 bottom), derived from its stated properties:
    rank r runs 2(p - 1 - r) + 1 warm-up forwards, as many as fit before its first I arrives (rank
    0 then holds 2p - 1 microbatches, about twice 1F1B); then I, W, F for each of the first
    m - 2p + 1 microbatches; after each later I a single action, a forward while any remain, else
    a W; the W passes left (2r + 1 on rank r) close the row. The pipeline is a parallelogram:
    with T_F = T_I = T_W and m >= 2p - 1, every rank is busy from its first to its last action."""
    steady = max(0, microbatches - 2 * ranks + 1)  # I, W, F steps; the other I's get one action after them
    rows = []
    for rank in range(ranks):
        forwards = min(2 * (ranks - 1 - rank) + 1, microbatches)
        weights = 0
        row = [Action(rank, F, m) for m in range(forwards)]
        for m in range(microbatches):
            row.append(Action(rank, I, m))
            if m == microbatches - 1:
                break
            if m < steady:
                row += [Action(rank, W, weights), Action(rank, F, forwards)]
                weights, forwards = weights + 1, forwards + 1
            elif forwards < microbatches:
                row.append(Action(rank, F, forwards))
                forwards += 1
            else:
                row.append(Action(rank, W, weights))
                weights += 1
        row += [Action(rank, W, m) for m in range(weights, microbatches)]
        rows.append(row)
    return _schedule("zb_h2", ranks, ranks, microbatches, rows, loop_map(ranks, ranks))


# ---- several stages per rank, looped (stage s on rank s mod p) --------------------------------------
def looped_bfs(ranks: int, microbatches: int, virtual: int = 2) -> Schedule:
    """Breadth-first looping (Lamy-Poirier 2023, "Breadth-First Pipeline Parallelism"), as torch's
    ScheduleLoopedBFS: each local stage forwards every microbatch before the next stage; backwards
    run stage by stage from the last, microbatches in reverse."""
    rows = []
    for rank in range(ranks):
        local = range(rank, ranks * virtual, ranks)
        row = [Action(s, F, m) for s in local for m in range(microbatches)]
        row += [Action(s, B, m) for s in reversed(local) for m in reversed(range(microbatches))]
        rows.append(row)
    return _schedule("looped_bfs", ranks, ranks * virtual, microbatches, rows, loop_map(ranks, ranks * virtual))


def interleaved_1f1b(ranks: int, microbatches: int, virtual: int = 2, per_round: int | None = None) -> Schedule:
    """Interleaved 1F1B (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
    Clusters Using Megatron-LM", section 2.2), as torch's ScheduleInterleaved1F1B: microbatches go
    in rounds of about p through the local stages depth-first. Like torch, and unlike Megatron, m
    need not be a multiple of p: there are max(1, m // p) rounds, which must divide m."""
    per_round = per_round or microbatches_per_round("interleaved_1f1b", ranks, microbatches)
    rows = [_interleaved_rank(rank, ranks, microbatches, virtual, per_round, zero_bubble=False)
            for rank in range(ranks)]
    return _schedule("interleaved_1f1b", ranks, ranks * virtual, microbatches, rows,
                     loop_map(ranks, ranks * virtual))


def interleaved_zero_bubble(ranks: int, microbatches: int, virtual: int = 2, per_round: int | None = None) -> Schedule:
    """Interleaved zero bubble, torch's ScheduleInterleavedZeroBubble (the ZB1P schedule of Qi et al.
    2024 over looped stages): interleaved 1F1B with half the warm-up, each backward split into I and
    W, rank r holding back its first r W passes to fill the cool-down."""
    per_round = per_round or microbatches_per_round("interleaved_zero_bubble", ranks, microbatches)
    rows = [_interleaved_rank(rank, ranks, microbatches, virtual, per_round, zero_bubble=True)
            for rank in range(ranks)]
    return _schedule("interleaved_zero_bubble", ranks, ranks * virtual, microbatches, rows,
                     loop_map(ranks, ranks * virtual))


def microbatches_per_round(name: str, ranks: int, microbatches: int) -> int:
    rounds = max(1, microbatches // ranks)
    if microbatches % rounds:
        near = range(max(1, microbatches - min(ranks, 64)), microbatches + min(ranks, 64) + 1)  # bounded
        fits = [m for m in near if m % max(1, m // ranks) == 0] or [rounds * ranks, (rounds + 1) * ranks]
        raise ValueError(f"{name} runs microbatches in max(1, m // ranks) = {rounds} rounds, which must divide "
                         f"m = {microbatches} (ranks = {ranks}); m in {{{', '.join(map(str, fits))}}} works")
    return microbatches // rounds


def _interleaved_rank(rank: int, ranks: int, microbatches: int, virtual: int, per_round: int,
                      zero_bubble: bool) -> list[Action]:
    """One rank of torch's interleaved schedules (`_get_1f1b_rank_ops`): warm-up forwards, then one
    forward and one backward per step, then the remaining backwards; the stage of each step's
    forward (backward) walks the local stages up (down) every `per_round` microbatches. With
    `zero_bubble`, backwards are I and each I after the rank's first `rank` ones is followed by the
    oldest pending W; the W passes still pending close the row.

    Each kind's n-th pass goes to local stage (n // per_round) % virtual (from the last down for the backwards) and
    is that stage's ((n // (per_round x virtual)) x per_round + n % per_round)-th microbatch: the passes it had
    before, a round of `per_round` each time the walk came by."""
    spread = 1 if zero_bubble else 2  # extra warm-up forwards per hop from the last rank
    total = microbatches * virtual
    warmup = min((virtual - 1) * per_round + spread * (ranks - 1 - rank), total)
    backward = I if zero_bubble else B
    walk = _interleaved_walk(total, virtual, per_round)
    forwards = [_action(Action, (chunk * ranks + rank, F, microbatch)) for chunk, microbatch in walk]
    backwards = [_action(Action, ((virtual - 1 - chunk) * ranks + rank, backward, microbatch))
                 for chunk, microbatch in walk]
    row: list[Action] = forwards[:warmup]
    if not zero_bubble:
        for forward, back in zip(forwards[warmup:], backwards):  # one forward and one backward a step
            row += (forward, back)
        row += backwards[total - warmup:]
        return row
    weights = [_action(Action, (stage, W, microbatch)) for stage, _, microbatch in backwards]  # each I's, in order
    for n, back in enumerate(backwards):  # the steps from the warm-up's end: a forward while any is left, an I, a W
        if n < total - warmup:
            row.append(forwards[warmup + n])
        row.append(back)
        if n >= rank:
            row.append(weights[n - rank])
    row += weights[max(0, total - rank):]
    return row


_action = tuple.__new__  # an Action from its three fields without the named tuple's own __new__ (half the time)


@functools.lru_cache(maxsize=256)
def _interleaved_walk(total: int, virtual: int, per_round: int) -> tuple[tuple[int, int], ...]:
    """(local stage, microbatch) of a kind's n-th pass on an interleaved rank (`_interleaved_rank`), n < `total`."""
    cycle = per_round * virtual
    return tuple(((n // per_round) % virtual, n // cycle * per_round + n % per_round) for n in range(total))


# ---- two stages per rank in a V: rank r holds stages r and 2p - 1 - r ------------------------------
def zbv(ranks: int, microbatches: int) -> Schedule:
    """ZB-V (Qi et al. 2024, section 6), as torch's ScheduleZBVZeroBubble. Like torch, it
    lays out max(2p - 1, m) microbatches and drops those past m, so any m >= 1 runs."""
    padded = max(2 * ranks - 1, microbatches)
    rows = []
    for rank in range(ranks):
        first, second = rank, 2 * ranks - 1 - rank
        count = {(s, kind): 0 for s in (first, second) for kind in (F, I, W)}
        row: list[Action] = []

        def add(stage: int, kind: Kind) -> None:
            row.append(Action(stage, kind, count[stage, kind]))
            count[stage, kind] += 1

        for _ in range(2 * (ranks - rank) - 1):
            add(first, F)
        for _ in range(rank):
            add(second, F)
            add(first, F)
        for _ in range(ranks - rank):
            add(second, F)
            add(second, I)
            add(second, W)
        while count[second, F] < count[first, F] or count[first, F] < padded:
            if count[first, F] < padded:
                add(first, F)
            add(first, I)
            add(first, W)
            add(second, F)
            add(second, I)
            add(second, W)
        for _ in range(rank):
            add(first, I)
            add(second, I)
        for _ in range(ranks - rank):
            add(first, I)
            add(first, W)
        for stage in (second, first):
            while count[stage, W] < count[stage, I]:
                add(stage, W)
        rows.append([a for a in row if a.microbatch < microbatches])
    return _schedule("zbv", ranks, 2 * ranks, microbatches, rows, vshape_map(ranks))


def dualpipev(ranks: int, microbatches: int) -> Schedule:
    """DualPipeV, torch's ScheduleDualPipeV: DualPipe (DeepSeek-AI 2024, "DeepSeek-V3 Technical
    Report", section 3.2.1) folded onto a V, after deepseek-ai/DualPipe. An overlapped pair
    (OVERLAP_F_B in torch) is written as its forward then its full backward. Needs m >= 2p."""
    rows = []
    for rank in range(ranks):
        first, second = rank, 2 * ranks - 1 - rank
        forwards = {first: 0, second: 0}
        backwards = {first: 0, second: 0}  # B and I share the count
        pending: deque[Action] = deque()
        row: list[Action] = []

        def forward(stage: int) -> None:
            row.append(Action(stage, F, forwards[stage]))
            forwards[stage] += 1

        def backward(stage: int, kind: Kind = B) -> None:
            row.append(Action(stage, kind, backwards[stage]))
            backwards[stage] += 1
            if kind is I:
                pending.append(row[-1])

        def weight() -> None:
            if pending:
                row.append(Action(pending[0].stage, W, pending.popleft().microbatch))

        for _ in range(2 * (ranks - rank - 1)):            # 1: F of the first stage
            forward(first)
        for _ in range(rank + 1):                          # 2: F of both stages
            forward(first)
            forward(second)
        for _ in range(ranks - rank - 1):                  # 3: I W F on the second stage
            backward(second, I)
            weight()
            forward(second)
        for _ in range(microbatches - 2 * ranks + rank + 1):     # 4: overlapped F and B
            forward(first)      # the last rank's first pair is not overlapped in torch; same order
            backward(second)
            forward(second)
            backward(first)
        for _ in range(ranks - rank - 1):                  # 5: B, then an overlapped pair
            backward(second)
            forward(second)
            backward(first)
        half = (rank + 1) // 2
        for step in range(rank + 1):                       # 6: backwards, the later ones split
            backward(second, I if step > half or (step == half and rank % 2 == 1) else B)
            backward(first, I if step >= half else B)
        for _ in range(ranks - rank - 1):                  # 7: W, then I
            weight()
            backward(first, I)
        for _ in range(rank + 1):                          # 8: the pending W passes
            weight()
        rows.append(row)
    return _schedule("dualpipev", ranks, 2 * ranks, microbatches, rows, vshape_map(ranks))


# ---- two pipelines in opposite directions --------------------------------------------------------
def chimera(ranks: int, microbatches: int) -> Schedule:
    """Chimera (Li & Hoefler 2021, "Chimera: Efficiently Training Large-Scale Neural Networks with
    Bidirectional Pipelines", section 3: the basic scheduling unit as drawn, and direct
    concatenation of units for more microbatches). Pipeline 0 puts stage s on rank s, pipeline 1
    on rank p - 1 - s. A unit is p microbatches: the first p/2 take pipeline 0, the others
    pipeline 1; each pipeline injects one every 2 steps, and a microbatch moves one stage per step
    forward, then back (the figure's unit-time slots). Unit u starts 2p steps after unit u - 1,
    into the bubbles that one leaves. Each rank runs its actions in the order of those steps (no
    two share a step), which leaves each rank p - 2 idle steps in all. Needs an even p and m a
    multiple of p (whole units)."""
    half = ranks // 2
    timed: list[list[tuple[int, Action]]] = [[] for _ in range(ranks)]
    pipelines = []
    for microbatch in range(microbatches):
        unit, place = divmod(microbatch, ranks)
        pipeline, order = divmod(place, half)
        pipelines.append(pipeline)
        start = 2 * ranks * unit + 2 * order
        for stage in range(ranks):
            rank = stage if pipeline == 0 else ranks - 1 - stage
            timed[rank].append((start + stage, Action(stage, F, microbatch)))
            timed[rank].append((start + 2 * ranks - 1 - stage, Action(stage, B, microbatch)))
    rows = [[action for _, action in sorted(row, key=lambda entry: entry[0])] for row in timed]
    maps = pipeline_maps("chimera", ranks)
    return Schedule("chimera", ranks, ranks, microbatches, maps, tuple(map(tuple, rows)), tuple(pipelines))


def pipeline_maps(name: str, ranks: int) -> tuple[tuple[int, ...], ...]:
    """The stage -> rank map of each pipeline of a schedule with two (chimera: stage s on rank s
    down, on rank p - 1 - s up); () for the others. Closed form: nothing is laid out."""
    if pipelines_of(name) != 2:
        return ()
    return tuple(range(ranks)), tuple(reversed(range(ranks)))


_GENERATORS = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved_1f1b": interleaved_1f1b,
    "looped_bfs": looped_bfs,
    "zb_h1": zb_h1,
    "zb_h2": zb_h2,
    "interleaved_zero_bubble": interleaved_zero_bubble,
    "zbv": zbv,
    "dualpipev": dualpipev,
    "chimera": chimera,
}
