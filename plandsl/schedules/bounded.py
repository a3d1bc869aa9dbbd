"""A built-in schedule simulated for any microbatch count in bounded work.

Contract: `simulate_builtin(name, ranks, microbatches, virtual, costs) -> Simulation`, equal to
`simulate(generate(...), costs)` (to float rounding) but laying out at most a few multiples of
`ranks x virtual` microbatches, whatever `microbatches` is. Its `events` are those of the
smaller run, so it is for figures (makespan, bubble, busy, idle, peaks), not for timelines.

Why it holds. A built-in schedule is a warm-up, a steady state that repeats one pattern per
`period` microbatches (1; a round of `per_round` for the interleaved ones; a unit of `ranks`
for chimera), and a cool-down that depends only on ranks and virtual. Peaks (in-flight
microbatches, activation memory) depend on each rank's order only, not on durations: past
the warm-up they stay put, or for gpipe and looped_bfs grow by the same amount each period.
Busy time grows by each period's work. The makespan is a max-plus recurrence: past a transient
it repeats with some cycle of c periods (not always 1: 1F1B on 3 ranks with uneven stages
alternates two step lengths), each cycle adding the same time. So one run of a few rounds finds
the smallest c for which every action of period k + c starts a constant later than its twin of
period k, over a window; two runs of m0 and m0 + c periods (m0 = m modulo c periods) then give
the figures for m by extrapolation. Where no cycle shows, the look is doubled while the runs stay
under half the action cap; past that, the longest window laid out is taken as the cycle (peaks
stay exact, the makespan is then right to within one window's jitter, parts per million). tests/unit/test_hostile_sizes.py compares this with the full simulation for every
built-in, ranks and virtual in a small grid, unit and random per-stage costs: around where the
extrapolation starts and well past it, and (slow tier) every m up to 300.
"""
from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict

from plandsl.diagnostics.limits import MAX_ACTIONS

from .generators import TooLarge, check_sizes, count_actions, generate, generate_rounds, microbatches_per_round
from .program import Schedule
from .registry import BUILTIN
from .simulate import Costs, Extrapolation, RankStats, Simulation, bubble_seconds, held_profiles, simulate

WARMUP_PERIODS = 4
"""Microbatches laid out before extrapolating: this many times ranks x virtual, at least."""


def simulate_builtin(name: str, ranks: int, microbatches: int, virtual: int | None, costs: Costs,
                     start: int | None = None) -> Simulation:
    """The simulation of the built-in `name` for these sizes; ValueError for sizes it cannot run,
    TooLarge when even the bounded runs would exceed `limits.MAX_ACTIONS` actions.
    `start`: the microbatches laid out before the steady state is looked for (None: 2 x
    `WARMUP_PERIODS` x ranks x virtual where that stays small); the tests use less."""
    virtual = check_sizes(name, ranks, microbatches, virtual)
    period, base, longest, tail, probe = _sizes(name, ranks, microbatches, virtual, start)
    if microbatches <= probe + longest * period:
        return simulate(_layout(name, ranks, microbatches, virtual, period), costs)
    # One run long enough to see the steady state: the smallest c such that every action of
    # period k + c starts a constant later than its twin of period k, over a window of periods.
    # A long transient (cycles of nearly equal means) needs a longer look: double the run and the
    # cycles looked for while the runs stay within half the action cap.
    cycle = None
    while True:
        probed = simulate(_layout(name, ranks, probe, virtual, period), costs)
        cycle = _cycle(probed, period, base // period, probe // period - tail, longest)
        grown = probe + (3 * longest + tail) * period + base
        if cycle is not None or microbatches <= 2 * grown \
                or count_actions(name, ranks, 2 * grown, virtual) > MAX_ACTIONS // 2:
            break
        base, longest, probe = 2 * base, 2 * longest, grown
    if cycle is None:
        if microbatches <= 2 * probe:  # short enough to lay out in full
            return simulate(_layout(name, ranks, microbatches, virtual, period), costs)
        # No exact cycle within the budget: extrapolate over the longest window laid out. The
        # figures are then exact up to the jitter of one window (a few parts per million of a step).
        cycle = longest
    step = cycle * period
    first = base + (microbatches - base) % step  # = microbatches (mod step)
    a = simulate(_layout(name, ranks, first, virtual, period), costs)
    b = simulate(_layout(name, ranks, first + step, virtual, period), costs)
    if a.deadlock is not None or b.deadlock is not None:
        return a if a.deadlock is not None else b
    repeats = (microbatches - first) // step
    return dataclasses.replace(extrapolate(a, b, repeats),
                               extrapolated=Extrapolation(microbatches, first, step, cycle, repeats))


def builtin_profiles(name: str, ranks: int, microbatches: int, virtual: int | None) -> tuple:
    """`simulate.held_profiles` of `builtin_layout`'s layout for these sizes."""
    return held_profiles(builtin_layout(name, ranks, microbatches, virtual))


def builtin_layout(name: str, ranks: int, microbatches: int, virtual: int | None, peaks: bool = True) -> Schedule:
    """The layout `simulate_builtin` simulates for these sizes: the whole schedule, or past `extrapolated_past` a run
    of the same microbatches modulo the steady state's period from its look-ahead on (each rank's order repeats,
    period after period, and so do its peaks: what it extrapolates) but, for the `peaks`, where a stage holds every
    microbatch (GPipe's, BFS's peaks grow with them; their order repeats all the same); ValueError, TooLarge as
    there."""
    virtual = check_sizes(name, ranks, microbatches, virtual)
    period, base, longest, _, probe = _sizes(name, ranks, microbatches, virtual, None)
    if microbatches > probe + longest * period and not (peaks and BUILTIN[name].inflight == "every"):
        microbatches = base + (microbatches - base) % period
    return _layout(name, ranks, microbatches, virtual, period)


def extrapolated_past(name: str, ranks: int, microbatches: int, virtual: int | None, start: int | None = None) -> int:
    """The microbatch count past which `simulate_builtin` extrapolates (for this m's period)."""
    virtual = check_sizes(name, ranks, microbatches, virtual)
    period, _, longest, _, probe = _sizes(name, ranks, microbatches, virtual, start)
    return probe + longest * period


def _sizes(name: str, ranks: int, microbatches: int, virtual: int, start: int | None):
    """(period, base, longest, tail, probe): microbatches per period; laid out before the steady
    state is looked for; the longest cycle looked for and the periods the cool-down changes, in
    periods; the microbatches of the run that looks."""
    period = _period(name, ranks, microbatches)
    depth = ranks * virtual
    if start is None:
        start = 2 * WARMUP_PERIODS * depth
        if count_actions(name, ranks, start + 6 * depth + 4 * period, virtual) > MAX_ACTIONS // 2:
            start = WARMUP_PERIODS * depth
    base = max(period, -(-start // period) * period)  # a whole number of periods
    longest = max(1, -(-2 * depth // period))
    tail = -(-(3 * depth + 2 * period) // period)
    probe = base + (3 * longest + tail) * period
    return period, base, longest, tail, probe


def _cycle(simulation: Simulation, period: int, first: int, end: int, longest: int) -> int | None:
    """The smallest c <= longest (in periods) such that, for every period k in the window
    [end - 2 longest - c, end - c), each action of period k + c starts a constant later than the
    same action of period k (max-plus recurrences settle into such a cycle); None if none does."""
    starts: dict[tuple, float] = {}
    for event in simulation.events:
        action = event.action
        starts[(action.stage, action.kind, action.microbatch)] = event.start
    for c in range(1, longest + 1):
        low = max(first, end - 2 * longest - c)
        shift = c * period
        gap = None
        ok = True
        for (stage, kind, microbatch), when in starts.items():
            if not low * period <= microbatch < (end - c) * period:
                continue
            later = starts.get((stage, kind, microbatch + shift))
            if later is None:
                ok = False
                break
            if gap is None:
                gap = later - when
            elif not math.isclose(later - when, gap, rel_tol=1e-12, abs_tol=1e-9):
                ok = False
                break
        if ok and gap is not None:
            return c
    return None


def extrapolate(a: Simulation, b: Simulation, periods: int) -> Simulation:
    """Figures `periods` periods past `a`, each period adding what `b` adds to `a`."""
    def step(x, y):
        return x + periods * (y - x)

    makespan = step(a.makespan, b.makespan)
    ranks = tuple(RankStats(s.rank, step(s.busy, t.busy), 0.0,
                            step(s.peak_inflight_microbatches, t.peak_inflight_microbatches),
                            step(s.peak_memory_bytes, t.peak_memory_bytes))
                  for s, t in zip(a.ranks, b.ranks))
    ranks = tuple(RankStats(s.rank, s.busy, makespan - s.busy, s.peak_inflight_microbatches, s.peak_memory_bytes)
                  for s in ranks)
    bubble = bubble_seconds(makespan, (s.busy for s in ranks)) / makespan if makespan > 0 else 0.0
    return Simulation(makespan, bubble, ranks, a.events, None)


def _period(name: str, ranks: int, microbatches: int) -> int:
    """Microbatches per repeat of the schedule's steady state."""
    info = BUILTIN[name]
    if info.rounds:
        return microbatches_per_round(name, ranks, microbatches)
    if info.pipelines == 2:  # chimera: whole units of `ranks` microbatches
        return ranks
    return 1


LAYOUT_CACHE_ACTIONS = 250_000
"""Actions of the layouts kept for reuse: a layout depends on its sizes only, not on the costs, and the
search simulates the same few sizes thousands of times with other costs (~25 MB at most)."""
_layouts: OrderedDict[tuple, tuple[Schedule, int]] = OrderedDict()  # sizes -> (layout, its actions)
_held = [0]  # actions in `_layouts`


def _layout(name: str, ranks: int, microbatches: int, virtual: int, period: int) -> Schedule:
    key = (name, ranks, microbatches, virtual, period)
    found = _layouts.get(key)
    if found is not None:
        _layouts.move_to_end(key)
        return found[0]
    schedule = _lay_out(name, ranks, microbatches, virtual, period)
    size = sum(len(actions) for actions in schedule.actions)
    if size <= LAYOUT_CACHE_ACTIONS // 4:
        _layouts[key] = (schedule, size)
        _held[0] += size
        while _held[0] > LAYOUT_CACHE_ACTIONS:
            _held[0] -= _layouts.popitem(last=False)[1][1]
    return schedule


def _lay_out(name: str, ranks: int, microbatches: int, virtual: int, period: int) -> Schedule:
    actions = count_actions(name, ranks, microbatches, virtual)
    if actions > MAX_ACTIONS:
        raise TooLarge(f"schedule '{name}' for {ranks} ranks{f' x {virtual} stages per rank' if virtual > 1 else ''}"
                       f" is simulated over {microbatches:,} microbatches ({actions:,} actions) before its "
                       f"figures repeat, more than the {MAX_ACTIONS:,} a simulation lays out")
    if BUILTIN[name].rounds:  # the rounds of the full schedule, fewer of them
        return generate_rounds(name, ranks, microbatches, virtual, period)
    return generate(name, ranks, microbatches, virtual)
