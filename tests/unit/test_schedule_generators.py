"""The built-in schedule generators: torch's per-rank order where torch ships the schedule,
PipeDream-Flush for 1f1b, the papers' properties for the handcrafted ones (zb_h1, zb_h2,
chimera), structural invariants and deadlock freedom for every name, and the size errors.

Self-contained on purpose: the checker and the unit-time run below are local, not
`schedules.validate` / `schedules.simulate`, so these tests judge the generators alone.
"""
from __future__ import annotations

import re
import types
from collections import Counter
from dataclasses import replace

import pytest

from plandsl.schedules.generators import check_sizes, generate
from plandsl.schedules.program import Action, Kind, Schedule, format_rows, parse_action
from plandsl.schedules.registry import BUILTIN, microbatches_fit, min_microbatches

F, B, I, W = Kind.F, Kind.B, Kind.I, Kind.W  # noqa: E741

# ---- torch's order, built in-process without a process group ------------------------------------
# The multi-stage schedules compute `pipeline_order` in __init__ from stage objects, reading only
# num_stages, group_size, group_rank, stage_index and submod (torch.compile check); the lowering
# pass __init__ also runs needs nothing more. GPipe keeps a `pipeline_order` too (with idle steps
# and a REDUCE_GRAD per rank). Idle steps (None) and non-compute actions are dropped, and
# DualPipeV's OVERLAP_F_B is read as its sub-actions in order.
TORCH_MULTI = {"interleaved_1f1b": "ScheduleInterleaved1F1B", "looped_bfs": "ScheduleLoopedBFS",
               "interleaved_zero_bubble": "ScheduleInterleavedZeroBubble",
               "zbv": "ScheduleZBVZeroBubble", "dualpipev": "ScheduleDualPipeV"}


@pytest.fixture(scope="module")
def torch_schedules():
    return pytest.importorskip("torch.distributed.pipelining.schedules")


def stand_in_stages(ranks: int, virtual: int) -> list[types.SimpleNamespace]:
    """Rank 0's stages, as far as the schedule constructors look at them."""
    return [types.SimpleNamespace(num_stages=ranks * virtual, group_size=ranks, group_rank=0,
                                  stage_index=local * ranks, submod=None) for local in range(virtual)]


def compute_text(action) -> list[str]:
    if action is None:
        return []
    if action.sub_actions:
        return [text for sub in action.sub_actions for text in compute_text(sub)]
    if action.computation_type.value in "FBIW":
        return [f"{action.stage_index}{action.computation_type.value}{action.microbatch_index}"]
    return []


def rows_of(order: dict, ranks: int) -> list[list[str]]:
    return [[text for action in order[rank] for text in compute_text(action)] for rank in range(ranks)]


def torch_rows(cls, ranks: int, microbatches: int, virtual: int) -> list[list[str]]:
    return rows_of(cls(stand_in_stages(ranks, virtual), microbatches).pipeline_order, ranks)


def our_rows(schedule: Schedule) -> list[list[str]]:
    return [[str(action) for action in row] for row in schedule.actions]


def microbatch_sweep(ranks: int) -> list[int]:
    return sorted({1, 2, 3, ranks - 1, ranks, ranks + 1, 2 * ranks - 1, 2 * ranks, 2 * ranks + 1,
                   3 * ranks, 4 * ranks + 2} - {0})


@pytest.mark.parametrize("name", list(TORCH_MULTI))
@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 6])
def test_same_order_as_torch(torch_schedules, name, ranks):
    cls = getattr(torch_schedules, TORCH_MULTI[name])
    virtuals = (2,) if BUILTIN[name].virtual == "two" else (1, 2, 3)
    compared = 0
    for virtual in virtuals:
        for microbatches in microbatch_sweep(ranks):
            try:
                expected = torch_rows(cls, ranks, microbatches, virtual)
            except ValueError:  # torch refuses these sizes: so must we
                with pytest.raises(ValueError):
                    generate(name, ranks, microbatches, virtual)
                continue
            assert our_rows(generate(name, ranks, microbatches, virtual)) == expected, \
                f"{name} ranks={ranks} virtual={virtual} microbatches={microbatches}"
            compared += 1
    assert compared


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 8])
def test_gpipe_same_order_as_torch(torch_schedules, ranks):
    for microbatches in microbatch_sweep(ranks):
        stage = types.SimpleNamespace(num_stages=ranks, group_size=ranks, group_rank=0, stage_index=0)
        expected = rows_of(torch_schedules.ScheduleGPipe(stage, microbatches).pipeline_order, ranks)
        assert our_rows(generate("gpipe", ranks, microbatches)) == expected


@pytest.mark.parametrize("ranks", [1, 2, 4, 8])
def test_zb_h1_is_torchs_zb1p_with_one_stage_per_rank(torch_schedules, ranks):
    for microbatches in (ranks, ranks + 1, 2 * ranks, 4 * ranks):
        if microbatches % max(1, microbatches // ranks):
            continue  # torch's rounds rule, meaningless with one stage per rank
        expected = torch_rows(torch_schedules.ScheduleInterleavedZeroBubble, ranks, microbatches, 1)
        assert our_rows(generate("zb_h1", ranks, microbatches)) == expected


# ---- 1f1b: PipeDream-Flush (torch's Schedule1F1B order is wrong for the last rank) ----------------
def pipedream_flush(ranks: int, microbatches: int) -> list[list[str]]:
    rows = []
    for rank in range(ranks):
        warmup = min(ranks - rank - 1, microbatches)
        forwards = [f"{rank}F{m}" for m in range(microbatches)]
        backwards = [f"{rank}B{m}" for m in range(microbatches)]
        row = forwards[:warmup]
        for step in range(microbatches - warmup):
            row += [forwards[warmup + step], backwards[step]]
        rows.append(row + backwards[microbatches - warmup:])
    return rows


@pytest.mark.parametrize("ranks", range(1, 9))
def test_1f1b_is_pipedream_flush(ranks):
    for microbatches in range(1, 2 * ranks + 4):
        assert our_rows(generate("1f1b", ranks, microbatches)) == pipedream_flush(ranks, microbatches)


def test_1f1b_agrees_with_torch_where_torch_names_real_microbatches(torch_schedules):
    for ranks in (2, 4, 8):
        for microbatches in (ranks, 2 * ranks + 1):
            stage = types.SimpleNamespace(num_stages=ranks, group_size=ranks, group_rank=0, stage_index=0)
            theirs = rows_of(torch_schedules.Schedule1F1B(stage, microbatches).pipeline_order, ranks)
            ours = our_rows(generate("1f1b", ranks, microbatches))
            for rank in range(ranks):
                if all(parse_action(text).microbatch < microbatches for text in theirs[rank]):
                    assert ours[rank] == theirs[rank]


# ---- structural invariants and deadlock freedom, every built-in name ---------------------------
def check_structure(schedule: Schedule) -> None:
    """Sizes and maps agree; each (pipeline stage, microbatch) has one F and one B or one I and one
    W, on the stage's rank; on that rank F comes before B/I, I before W."""
    assert len(schedule.actions) == schedule.ranks
    assert all(len(mapping) == schedule.stages and set(mapping) <= set(range(schedule.ranks))
               for mapping in schedule.stage_to_rank)
    assert len(schedule.microbatch_pipeline) in (0, schedule.microbatches)
    assert set(schedule.microbatch_pipeline) <= set(range(len(schedule.stage_to_rank)))
    counts = Counter()
    for rank, row in enumerate(schedule.actions):
        position = {}
        for index, action in enumerate(row):
            assert action.kind in (F, B, I, W), action
            assert 0 <= action.stage < schedule.stages and 0 <= action.microbatch < schedule.microbatches, action
            assert schedule.rank_of(action) == rank, f"{action} on rank {rank}, not {schedule.rank_of(action)}"
            position[action] = index
            counts[action] += 1
        for action, index in position.items():
            if action.kind in (B, I):
                assert position[Action(action.stage, F, action.microbatch)] < index, f"{action} before its F"
            if action.kind is W:
                assert position[Action(action.stage, I, action.microbatch)] < index, f"{action} before its I"
    assert set(counts.values()) == {1}, [a for a, n in counts.items() if n > 1]
    for stage in range(schedule.stages):
        for microbatch in range(schedule.microbatches):
            kinds = {kind for kind in (F, B, I, W) if Action(stage, kind, microbatch) in counts}
            assert kinds in ({F, B}, {F, I, W}), f"stage {stage} microbatch {microbatch}: {sorted(kinds)}"


def unit_time_run(schedule: Schedule) -> list[list[int]]:
    """Each rank runs its row in order, one action per step; F(s,m) waits for F(s-1,m) of the
    microbatch's pipeline, B/I(s,m) for B/I(s+1,m) (the last stage for its F), W(s,m) for I(s,m).
    Returns each action's step; fails naming every stuck rank if the ranks wait forever."""
    finished: dict[Action, int] = {}
    heads = [0] * schedule.ranks
    steps: list[list[int]] = [[] for _ in range(schedule.ranks)]
    last, now = schedule.stages - 1, 0

    def ready(action: Action) -> bool:
        s, m = action.stage, action.microbatch
        if action.kind is F:
            needs = [] if s == 0 else [Action(s - 1, F, m)]
        elif action.kind is W:
            needs = [Action(s, I, m)]
        else:
            needs = [Action(s, F, m)] if s == last else []
            if s < last:
                needs = [Action(s + 1, B, m) if Action(s + 1, B, m) in finished else Action(s + 1, I, m)]
        return all(finished.get(need, now) < now for need in needs)

    while any(head < len(row) for head, row in zip(heads, schedule.actions)):
        done = [(rank, schedule.actions[rank][head]) for rank, head in enumerate(heads)
                if head < len(schedule.actions[rank]) and ready(schedule.actions[rank][head])]
        stuck = {rank: str(schedule.actions[rank][head]) for rank, head in enumerate(heads)
                 if head < len(schedule.actions[rank])}
        assert done, f"{schedule.name}: deadlock at step {now}, ranks waiting on {stuck}"
        for rank, action in done:
            finished[action] = now
            steps[rank].append(now)
            heads[rank] += 1
        now += 1
    return steps


def sizes(name: str) -> list[tuple[int, int, int | None]]:
    """(ranks, microbatches, virtual) the schedule accepts, edges included."""
    info, found = BUILTIN[name], []
    virtuals = (1, 2, 3) if info.virtual == "any" else (None,)
    for ranks in (1, 2, 3, 4, 6, 8):
        for microbatches in microbatch_sweep(ranks) + [8 * ranks] * (ranks <= 4):
            for virtual in virtuals:
                try:
                    generate(name, ranks, microbatches, virtual)
                except ValueError:
                    continue
                found.append((ranks, microbatches, virtual))
    return found


@pytest.mark.parametrize("name", list(BUILTIN))
def test_every_schedule_is_well_formed_and_finishes(name):
    accepted = sizes(name)
    assert len(accepted) > 10
    for ranks, microbatches, virtual in accepted:
        schedule = generate(name, ranks, microbatches, virtual)
        assert (schedule.name, schedule.ranks, schedule.microbatches) == (name, ranks, microbatches)
        check_structure(schedule)
        unit_time_run(schedule)


def test_the_deadlock_check_catches_an_impossible_order():
    # each row is fine alone, but rank 0 waits on rank 1's backward of microbatch 0, which rank 1
    # runs only after microbatch 1, whose forward rank 0 sends after that backward
    rows = ((Action(0, F, 0), Action(0, B, 0), Action(0, F, 1), Action(0, B, 1)),
            (Action(1, F, 1), Action(1, B, 1), Action(1, F, 0), Action(1, B, 0)))
    schedule = Schedule("broken", 2, 2, 2, ((0, 1),), rows)
    check_structure(schedule)
    with pytest.raises(AssertionError, match="deadlock at step 1"):
        unit_time_run(schedule)


# ---- the papers' properties of the handcrafted schedules ------------------------------------------
def peak_in_flight(row: tuple[Action, ...]) -> int:
    """Microbatches whose forward ran and whose last backward pass (B or W) did not yet."""
    held = peak = 0
    for action in row:
        held += {F: 1, B: -1, W: -1}.get(action.kind, 0)
        peak = max(peak, held)
    return peak


def spans(schedule: Schedule) -> list[int]:
    return [row[-1] - row[0] + 1 for row in unit_time_run(schedule)]


@pytest.mark.parametrize("ranks, microbatches", [(2, 4), (4, 8), (4, 13), (8, 16), (8, 40)])
def test_zb_h1_keeps_1f1b_memory_and_cuts_the_bubble_to_a_third(ranks, microbatches):
    # Qi et al. 2024 section 2.1: every rank holds p microbatches (1F1B's first rank);
    # with T_F = T_I = T_W the idle time is (p - 1) instead of 1F1B's 3 (p - 1).
    schedule = generate("zb_h1", ranks, microbatches)
    assert [peak_in_flight(row) for row in schedule.actions] == [ranks] * ranks
    assert max(peak_in_flight(row) for row in generate("1f1b", ranks, microbatches).actions) == ranks
    assert max(max(row) for row in unit_time_run(schedule)) + 1 == 3 * microbatches + ranks - 1


@pytest.mark.parametrize("ranks, microbatches", [(2, 3), (2, 8), (4, 7), (4, 8), (4, 20), (8, 15), (8, 33)])
def test_zb_h2_is_a_bubble_free_parallelogram_with_twice_the_memory(ranks, microbatches):
    # Qi et al. 2024 section 2.2: rank r runs 2(p - r) - 1 forwards before its first I, so rank 0
    # holds 2p - 1 microbatches (the tail's deferred W passes bring every rank there); with
    # T_F = T_I = T_W each rank is busy from its first action to its last, the ranks starting one
    # step apart: that skew is the only idle time left (ZB-H1 keeps p - 1 steps inside each row).
    schedule = generate("zb_h2", ranks, microbatches)
    warmups = [[a.kind for a in row].index(I) for row in schedule.actions]
    assert warmups == [2 * (ranks - r) - 1 for r in range(ranks)]
    assert [peak_in_flight(row) for row in schedule.actions] == [2 * ranks - 1] * ranks
    assert spans(schedule) == [3 * microbatches] * ranks
    assert [row[0] for row in unit_time_run(schedule)] == list(range(ranks))
    assert spans(generate("zb_h1", ranks, microbatches))[0] == 3 * microbatches + ranks - 1


def test_zb_h2_with_fewer_microbatches_than_it_can_fill():
    for ranks in (3, 4, 8):
        for microbatches in range(ranks, 2 * ranks - 1):
            schedule = generate("zb_h2", ranks, microbatches)
            assert peak_in_flight(schedule.actions[0]) == microbatches
            unit_time_run(schedule)


@pytest.mark.parametrize("ranks", [2, 4, 6, 8])
@pytest.mark.parametrize("units", [1, 2, 3])
def test_chimera_two_opposite_pipelines_leave_p_minus_2_bubbles(ranks, units):
    # Li & Hoefler 2021 section 3.2: with unit-time forward and backward slots, every worker
    # idles D - 2 slots, the two pipelines and whole units of D microbatches tiling the rest.
    microbatches = units * ranks
    schedule = generate("chimera", ranks, microbatches)
    assert schedule.stage_to_rank == (tuple(range(ranks)), tuple(reversed(range(ranks))))
    assert Counter(schedule.microbatch_pipeline) == {0: microbatches // 2, 1: microbatches // 2}
    steps = unit_time_run(schedule)
    makespan = max(max(row) for row in steps) + 1
    assert all(makespan - len(row) == ranks - 2 for row in steps)
    # each rank holds one stage of each pipeline: s on rank s, and p - 1 - s
    for rank, row in enumerate(schedule.actions):
        assert {(schedule.pipeline_of(a.microbatch), a.stage) for a in row} == {(0, rank), (1, ranks - 1 - rank)}


@pytest.mark.parametrize("name", ["zb_h1", "zb_h2", "chimera"])
def test_handcrafted_schedules_golden(name, golden):
    golden(f"schedules/{name}_p4_m8.txt", "\n".join(format_rows(generate(name, 4, 8))) + "\n")


# ---- what the generators accept and refuse ---------------------------------------------------------
@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv"])
def test_fewer_microbatches_than_ranks_where_the_schedule_allows(name):
    schedule = generate(name, 4, 1)
    check_structure(schedule)
    unit_time_run(schedule)


def test_defaults_for_virtual():
    assert generate("interleaved_1f1b", 4, 8).stages == 8
    assert generate("zbv", 4, 8, 2).stages == generate("zbv", 4, 8).stages == 8
    assert generate("1f1b", 4, 8, 1).stages == 4
    assert generate("chimera", 4, 8, 2).stages == 4  # two stage replicas per rank, p stages a pipeline


@pytest.mark.parametrize("name, ranks, microbatches, virtual, words", [
    ("zb_h3", 4, 8, None, "unknown schedule 'zb_h3'"),
    ("1f1b", 0, 8, None, "ranks = 0"),
    ("gpipe", 4, 0, None, "microbatches = 0"),
    ("gpipe", 4, 8, 2, "exactly 1 stage per rank, got virtual = 2"),
    ("1f1b", 4, 8, 3, "virtual = 3"),
    ("zbv", 4, 8, 3, "exactly 2 stages per rank, got virtual = 3"),
    ("dualpipev", 4, 8, 1, "virtual = 1"),
    ("interleaved_1f1b", 4, 8, 0, "virtual = 0"),
    ("interleaved_1f1b", 4, 9, 2, "2 rounds, which must divide m = 9"),
    ("interleaved_zero_bubble", 4, 14, 2, "3 rounds, which must divide m = 14"),
    ("dualpipev", 4, 7, None, "microbatches = 7 < 2 * ranks = 8"),
    ("zb_h1", 4, 3, None, "microbatches = 3 < ranks = 4"),
    ("zb_h2", 8, 7, None, "microbatches = 7 < ranks = 8"),
    ("chimera", 3, 6, None, "got ranks = 3"),
    ("chimera", 4, 6, None, "multiple of ranks = 4, got microbatches = 6"),
    ("chimera", 4, 8, 1, "exactly 2 stages per rank"),
])
def test_sizes_the_schedule_cannot_run(name, ranks, microbatches, virtual, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        generate(name, ranks, microbatches, virtual)


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_the_sizes_refused_are_the_tables(name):
    """check_sizes reads the schedule's ScheduleInfo: it refuses what `microbatches_fit` refuses (below the
    minimum only where the table is not laid out for fewer), and two pipelines need an even rank count."""
    info = BUILTIN[name]
    for ranks in (1, 2, 3, 4):
        for microbatches in range(1, 4 * ranks + 3):
            fits = microbatches_fit(info, ranks, microbatches) or (
                info.lays_out_fewer and microbatches < min_microbatches(info, ranks))
            fits = fits and not (info.pipelines == 2 and ranks % 2)
            try:
                check_sizes(name, ranks, microbatches)
            except ValueError:
                assert not fits, (name, ranks, microbatches)
            else:
                assert fits, (name, ranks, microbatches)


def test_a_new_column_value_needs_no_edit_of_check_sizes(monkeypatch):
    monkeypatch.setitem(BUILTIN, "gpipe", replace(BUILTIN["gpipe"], min_microbatches="2*ranks", multiple_of_ranks=True))
    with pytest.raises(ValueError, match=re.escape("gpipe needs at least 2 * ranks microbatches, got microbatches = "
                                                   "7 < 2 * ranks = 8")):
        check_sizes("gpipe", 4, 7)
    with pytest.raises(ValueError, match="m must be a multiple of ranks = 4, got microbatches = 10"):
        check_sizes("gpipe", 4, 10)
    assert check_sizes("gpipe", 4, 12) == 1


def test_every_builtin_name_has_a_generator():
    for name in BUILTIN:
        assert generate(name, 2, 4).name == name


def _interleaved_by_counters(rank, ranks, microbatches, virtual, per_round, zero_bubble):
    """torch's `_get_1f1b_rank_ops` step by step, each local stage's next microbatch from a counter (what
    `generators._interleaved_rank` computes from the walk over the local stages)."""
    from collections import deque
    F, B, I, W = Kind.F, Kind.B, Kind.I, Kind.W  # noqa: E741 - the notation's letters
    total = microbatches * virtual
    warmup = min((virtual - 1) * per_round + (1 if zero_bubble else 2) * (ranks - 1 - rank), total)
    backward = I if zero_bubble else B
    counters = {(s, kind): 0 for s in range(rank, ranks * virtual, ranks) for kind in (F, backward)}
    pending, row = deque(), []

    def add(stage, kind):
        row.append(Action(stage, kind, counters[stage, kind]))
        counters[stage, kind] += 1

    for step in range(total + warmup):
        if step < total:
            add((step // per_round) % virtual * ranks + rank, F)
        if step >= warmup:
            add((virtual - 1 - (step - warmup) // per_round % virtual) * ranks + rank, backward)
            if zero_bubble:
                pending.append(row[-1])
                if step - warmup >= rank:
                    row.append(Action(pending[0].stage, W, pending.popleft().microbatch))
    return row + [Action(a.stage, W, a.microbatch) for a in pending]


def test_an_interleaved_rank_from_its_walk_is_the_counters_loop():
    """The interleaved schedules' rows, each pass's stage and microbatch from the walk over the local stages, are
    the step-by-step loop's, rounds of any size (whole or not) included."""
    from plandsl.schedules.generators import _interleaved_rank
    cases = 0
    for ranks in range(1, 7):
        for virtual in range(1, 4):
            for per_round in sorted({1, ranks, ranks + 1, 2 * ranks}):
                for microbatches in sorted({1, per_round, per_round + 1, 3 * per_round}):
                    for zero_bubble in (False, True):
                        for rank in range(ranks):
                            row = _interleaved_rank(rank, ranks, microbatches, virtual, per_round, zero_bubble)
                            assert row == _interleaved_by_counters(rank, ranks, microbatches, virtual, per_round,
                                                                   zero_bubble)
                            assert all(type(action) is Action for action in row)
                            cases += 1
    assert cases > 1000
