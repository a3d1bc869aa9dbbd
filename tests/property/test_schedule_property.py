"""The validator agrees with the simulator: mutate valid schedules (swap two actions on a rank, drop
one, duplicate one, move one to another rank) and check that the schedule has a validation error
exactly when it is not complete, not on the right ranks, or deadlocks when simulated."""
from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from plandsl.schedules.program import Action, Kind, Schedule, loop_map
from plandsl.schedules.simulate import simulate
from plandsl.schedules.validate import validate
from support import example_tiers

F, B, I, W = Kind.F, Kind.B, Kind.I, Kind.W  # noqa: E741 - the notation's letters


# ---- valid schedules from their definitions (PipeDream-Flush, GPipe, Megatron) -------------------
def _make(name, p, v, m, rows) -> Schedule:
    return Schedule(name, p, p * v, m, (loop_map(p, p * v),), tuple(tuple(r) for r in rows))


def gpipe(p: int, m: int) -> Schedule:
    return _make("gpipe", p, 1, m, [[Action(r, F, i) for i in range(m)] + [Action(r, B, i) for i in range(m)]
                                    for r in range(p)])


def one_f_one_b(p: int, m: int, split: bool = False) -> Schedule:
    """PipeDream-Flush; `split`: each B as I then W right after it (a valid zero-bubble-like order)."""
    rows = []
    for r in range(p):
        w = min(p - r - 1, m)
        row = [Action(r, F, i) for i in range(w)]
        for i in range(m - w):
            row += [Action(r, F, w + i), Action(r, B, i)]
        row += [Action(r, B, i) for i in range(m - w, m)]
        if split:
            row = [x for a in row for x in ((a,) if a.kind is F else (Action(r, I, a.microbatch),
                                                                     Action(r, W, a.microbatch)))]
        rows.append(row)
    return _make("1f1b", p, 1, m, rows)


def interleaved(p: int, m: int, v: int) -> Schedule:
    """Megatron's interleaved 1F1B (torch's rounds when m is not a multiple of p)."""
    n = m // max(1, m // p)
    total, rows = m * v, []
    for r in range(p):
        warmup = min((p - r - 1) * 2 + (v - 1) * n, total)
        fwd = [Action((k // n) % v * p + r, F, k // (n * v) * n + k % n) for k in range(total)]
        bwd = [Action((v - 1 - (k // n) % v) * p + r, B, k // (n * v) * n + k % n) for k in range(total)]
        row = fwd[:warmup]
        for k in range(total - warmup):
            row += [fwd[warmup + k], bwd[k]]
        rows.append(row + bwd[total - warmup:])
    return _make("interleaved_1f1b", p, v, m, rows)


@st.composite
def valid_schedules(draw) -> Schedule:
    p = draw(st.integers(1, 4))
    m = draw(st.integers(1, 6))
    family = draw(st.sampled_from(["gpipe", "1f1b", "split", "interleaved", "builtin"]))
    if family == "gpipe":
        return gpipe(p, m)
    if family in ("1f1b", "split"):
        return one_f_one_b(p, m, split=family == "split")
    if family == "interleaved":
        m = draw(st.sampled_from([x for x in range(1, 3 * p + 1) if x % max(1, x // p) == 0]))
        return interleaved(p, m, draw(st.integers(1, 3)))
    try:
        from plandsl.schedules.generators import generate
        from plandsl.schedules.registry import BUILTIN
    except ImportError:
        return one_f_one_b(p, m)
    name = draw(st.sampled_from(sorted(BUILTIN)))
    try:
        return generate(name, p, m, draw(st.sampled_from([None, 1, 2])) if BUILTIN[name].virtual == "any" else None)
    except ValueError:
        return one_f_one_b(p, m)


# ---- mutations ------------------------------------------------------------------------------------
@st.composite
def mutated(draw):
    base = draw(valid_schedules())
    rows = [list(r) for r in base.actions]
    for _ in range(draw(st.integers(0, 3))):
        busy = [r for r in range(len(rows)) if rows[r]]
        if not busy:
            break
        rank = draw(st.sampled_from(busy))
        row = rows[rank]
        kind = draw(st.sampled_from(["swap", "swap_near", "drop", "duplicate", "move"]))
        i = draw(st.integers(0, len(row) - 1))
        if kind == "swap":
            j = draw(st.integers(0, len(row) - 1))
            row[i], row[j] = row[j], row[i]
        elif kind == "swap_near" and i + 1 < len(row):
            row[i], row[i + 1] = row[i + 1], row[i]
        elif kind == "drop":
            del row[i]
        elif kind == "duplicate":
            row.insert(draw(st.integers(0, len(row))), row[i])
        elif kind == "move" and len(rows) > 1:
            other = draw(st.sampled_from([r for r in range(len(rows)) if r != rank]))
            rows[other].insert(draw(st.integers(0, len(rows[other]))), row.pop(i))
    schedule = Schedule(base.name, base.ranks, base.stages, base.microbatches, base.stage_to_rank,
                        tuple(map(tuple, rows)), base.microbatch_pipeline)
    return base, schedule


def runs_cleanly(base: Schedule, schedule: Schedule) -> bool:
    """The oracle: every action of the valid schedule exactly once, each on its stage's rank, and
    the simulator finishes without a deadlock."""
    actions = Counter(a for row in schedule.actions for a in row)
    if actions != Counter(a for row in base.actions for a in row):
        return False
    if any(schedule.rank_of(a) != rank for rank, row in enumerate(schedule.actions) for a in row):
        return False
    return simulate(schedule).deadlock is None


@pytest.mark.parametrize("examples", example_tiers(300))
def test_validator_agrees_with_the_simulator(examples):
    @settings(deadline=None, suppress_health_check=[HealthCheck.too_slow], max_examples=examples)
    @given(mutated())
    def check(case):
        base, schedule = case
        assert validate(base) == []
        problems = validate(schedule)
        clean = runs_cleanly(base, schedule)
        assert (not problems) == clean, [f"{d.code} {d.message}" for d in problems]
        for d in problems:
            assert d.code in {"E602", "E603", "E604", "E605", "E606", "E607"}
            assert "rank" in d.message
            assert d.grid is None or "Rank 0" in d.grid
        if not clean:
            assert problems
    check()


@pytest.mark.parametrize("examples", example_tiers(100))
def test_valid_schedules_validate_clean(examples):
    @settings(deadline=None, max_examples=examples)
    @given(valid_schedules())
    def check(schedule):
        assert validate(schedule) == []
        assert simulate(schedule).deadlock is None
    check()
