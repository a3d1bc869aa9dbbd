"""The schedule simulator: closed-form bubbles and makespans, memory, deadlocks, grids, traces."""
import importlib.util
import json

import pytest

from plandsl.schedules.lower import add_send_recv
from plandsl.schedules.program import Action, Kind, Schedule, loop_map, parse_action, to_csv
from plandsl.schedules.simulate import (Costs, Deadlock, format_grid, simulate, step_grid,
                                        to_chrome_trace)
from support import pipedream_flush as one_f_one_b

HAVE_GENERATORS = importlib.util.find_spec("plandsl.schedules.generators") is not None
needs_generators = pytest.mark.skipif(
    not HAVE_GENERATORS, reason="plandsl.schedules.generators (another engineer's file) not written yet")


def acts(text: str) -> tuple[Action, ...]:
    return tuple(parse_action(t) for t in text.split())


def table(name: str, stage_map, *rows: str, microbatches: int) -> Schedule:
    ranks = max(stage_map) + 1
    return Schedule(name, ranks, len(stage_map), microbatches, (tuple(stage_map),),
                    tuple(acts(r) for r in rows))


def gpipe(p: int, m: int) -> Schedule:
    rows = tuple(tuple(Action(r, Kind.F, i) for i in range(m)) + tuple(Action(r, Kind.B, i) for i in range(m))
                 for r in range(p))
    return Schedule("gpipe", p, p, m, (loop_map(p, p),), rows)




def check_dependencies(schedule: Schedule, result, p2p: float = 0.0) -> None:
    """Every event starts after its rank's previous one and after its inputs (+p2p across ranks)."""
    end = {(e.action.stage, e.action.kind, e.action.microbatch): e.end for e in result.events}
    by_rank: dict[int, float] = {}
    for e in result.events:
        assert e.start >= by_rank.get(e.rank, 0.0) - 1e-9
        by_rank[e.rank] = e.end
        s, k, m = e.action.stage, e.action.kind, e.action.microbatch
        inputs = []
        if k is Kind.F and s > 0:
            inputs = [(s - 1, Kind.F)]
        elif k in (Kind.B, Kind.I):
            inputs = [(s, Kind.F)] + ([(s + 1, Kind.B), (s + 1, Kind.I)] if s < schedule.stages - 1 else [])
        elif k is Kind.W:
            inputs = [(s, Kind.I)]
        for stage, kind in inputs:
            if (stage, kind, m) in end:
                cross = schedule.rank_of(Action(stage, kind, m)) != e.rank
                assert e.start >= end[(stage, kind, m)] + (p2p if cross else 0.0) - 1e-9


# ---- closed forms, uniform costs F=1, B=2, p2p=0 ---------------------------------------------
@pytest.mark.parametrize("build", [gpipe, one_f_one_b])
@pytest.mark.parametrize("p, m", [(1, 1), (2, 1), (2, 3), (4, 4), (4, 8), (8, 3), (8, 32), (16, 64)])
def test_gpipe_and_1f1b_bubble_and_makespan(build, p, m):
    schedule = build(p, m)
    result = simulate(schedule)
    assert result.deadlock is None
    assert result.makespan == (m + p - 1) * (1 + 2)
    assert result.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
    for stats in result.ranks:
        assert stats.busy == 3 * m and stats.idle == 3 * (p - 1)
    assert len(result.events) == schedule.num_actions
    check_dependencies(schedule, result)


@pytest.mark.parametrize("p, m", [(2, 3), (4, 2), (4, 4), (4, 16), (8, 5)])
def test_1f1b_holds_min_p_m_microbatches_gpipe_all_m(p, m):
    assert simulate(one_f_one_b(p, m)).ranks[0].peak_inflight_microbatches == min(p, m)
    assert simulate(gpipe(p, m)).ranks[0].peak_inflight_microbatches == m
    last = simulate(one_f_one_b(p, m)).ranks[p - 1]
    assert last.peak_inflight_microbatches == 1 and last.peak_memory_bytes == 1.0


# ---- costs: p2p, per-stage costs, split backward ----------------------------------------------
@pytest.mark.parametrize("p, m, d", [(2, 3, 0.5), (4, 8, 0.25), (3, 1, 1.0)])
def test_p2p_adds_two_transfers_per_boundary_to_gpipe(p, m, d):
    result = simulate(gpipe(p, m), Costs(p2p=d))
    assert result.makespan == pytest.approx((m + p - 1) * 3 + 2 * (p - 1) * d)
    check_dependencies(gpipe(p, m), result, p2p=d)


@pytest.mark.parametrize("stage_costs", [
    ((1, 2, 1, 1), (2, 4, 2, 2)),
    ((1, 2, 1, 1), (3, 1, 1, 1), (1, 5, 1, 1)),
    ((0.5, 1, 1, 1), (0.5, 1, 1, 1), (0.5, 1, 1, 1), (2, 3, 1, 1)),
])
@pytest.mark.parametrize("m", [1, 4, 9])
def test_per_stage_costs_bottleneck_gpipe(stage_costs, m):
    # A flow line of identical jobs: sum of stage times + (m-1) x the slowest stage, once forward
    # (stage 0 -> p-1) and once backward (p-1 -> 0).
    p = len(stage_costs)
    f = [c[0] for c in stage_costs]
    b = [c[1] for c in stage_costs]
    expected = sum(f) + (m - 1) * max(f) + sum(b) + (m - 1) * max(b)
    result = simulate(gpipe(p, m), Costs(stage_costs=stage_costs))
    assert result.makespan == pytest.approx(expected)
    assert [r.busy for r in result.ranks] == pytest.approx([m * (f[s] + b[s]) for s in range(p)])


def test_stage_costs_must_cover_every_stage():
    with pytest.raises(ValueError, match="stage_costs has 1 entries but the schedule has 2 stages"):
        simulate(gpipe(2, 2), Costs(stage_costs=((1, 2, 1, 1),)))
    with pytest.raises(ValueError, match=r"cost F of stage 0 \(-1\) must be >= 0"):
        simulate(gpipe(2, 2), Costs(F=-1))


def test_sizes_that_do_not_fit_the_schedule_are_value_errors():
    with pytest.raises(ValueError, match="activation_bytes has 1 entries but the schedule has 2 stages"):
        simulate(gpipe(2, 2), Costs(activation_bytes=(1.0,)))
    with pytest.raises(ValueError, match="static_bytes has 3 entries but the schedule has 2 ranks"):
        simulate(gpipe(2, 2), Costs(static_bytes=(1.0, 1.0, 1.0)))
    with pytest.raises(ValueError, match=r"stages 0\.\.2, outside 0\.\.1"):
        simulate(table("bad", [0, 1], "0F0 2F0", "1F0", microbatches=1))


def test_split_backward_defaults_to_half_of_b_each():
    schedule = table("split", [0], "0F0 0I0 0W0", microbatches=1)
    assert simulate(schedule, Costs(F=1, B=3)).makespan == 4.0
    assert simulate(schedule, Costs(F=1, B=3, I=2, W=0.25)).makespan == 3.25


# ---- memory ----------------------------------------------------------------------------------
def test_activation_bytes_and_static_bytes():
    result = simulate(gpipe(2, 3), Costs(activation_bytes=(10.0, 7.0), static_bytes=(100.0, 200.0)))
    assert [r.peak_memory_bytes for r in result.ranks] == [130.0, 221.0]
    assert [r.peak_inflight_microbatches for r in result.ranks] == [3, 3]


@pytest.mark.parametrize("row, peak_bytes, peak_inflight", [
    ("0F0 0F1 0I0 0I1 0W0 0W1", 20.0, 2),
    # after I0, 30% of microbatch 0 is held until W0, so microbatch 0 is still in flight at F1
    ("0F0 0I0 0F1 0I1 0W0 0W1", 13.0, 2),
    ("0F0 0I0 0W0 0F1 0I1 0W1", 10.0, 1),
])
def test_split_backward_holds_weight_grad_share_until_w(row, peak_bytes, peak_inflight):
    costs = Costs(activation_bytes=(10.0,), weight_grad_fraction=0.3, static_bytes=(5.0,))
    [stats] = simulate(table("split", [0], row, microbatches=2), costs).ranks
    assert stats.peak_memory_bytes == pytest.approx(5.0 + peak_bytes)
    assert stats.peak_inflight_microbatches == peak_inflight


def test_inflight_counts_microbatches_not_stages():
    # a V on one rank: stages 0 and 1 of a microbatch are one microbatch in flight, two in bytes
    schedule = table("v", [0, 0], "0F0 1F0 0F1 1F1 1B1 0B1 1B0 0B0", microbatches=2)
    [stats] = simulate(schedule).ranks
    assert stats.peak_inflight_microbatches == 2 and stats.peak_memory_bytes == 4.0


# ---- lowered schedules -----------------------------------------------------------------------
@pytest.mark.parametrize("build, p, m", [(gpipe, 4, 6), (one_f_one_b, 4, 6), (one_f_one_b, 3, 1)])
@pytest.mark.parametrize("d", [0.0, 0.3])
def test_lowered_schedule_simulates_like_its_compute_only_form(build, p, m, d):
    schedule = build(p, m)
    plain, lowered = simulate(schedule, Costs(p2p=d)), simulate(add_send_recv(schedule), Costs(p2p=d))
    assert lowered.events == plain.events and lowered.makespan == plain.makespan
    assert lowered.ranks == plain.ranks


def test_early_receive_blocks_the_rank():
    # rank 1 posts the receive of microbatch 1's forward before running microbatch 0's forward
    early = table("early", [0, 1], "0F0 0SEND_F0 0F1 0SEND_F1",
                  "1RECV_F0 1RECV_F1 1F0 1F1", microbatches=2)
    late = table("late", [0, 1], "0F0 0SEND_F0 0F1 0SEND_F1",
                 "1RECV_F0 1F0 1RECV_F1 1F1", microbatches=2)
    assert simulate(early, Costs(p2p=0.5, B=0)).makespan == 4.5
    assert simulate(late, Costs(p2p=0.5, B=0)).makespan == 3.5


# ---- deadlocks -------------------------------------------------------------------------------
def test_cyclic_wait_is_reported_with_every_stuck_rank():
    # rank 0 waits for microbatch 0's backward before it runs microbatch 0's forward
    bad = table("bad", [0, 1], "0B0 0F0", "1F0 1B0", microbatches=1)
    result = simulate(bad)
    assert result.deadlock == Deadlock(0.0, ((0, Action(0, Kind.B, 0), Action(1, Kind.B, 0)),
                                             (1, Action(1, Kind.F, 0), Action(0, Kind.F, 0))))
    assert result.makespan == 0.0 and result.events == ()
    assert result.to_json()["deadlock"] == {"time": 0.0, "waiting": [
        {"rank": 0, "action": "0B0", "waits_for": "1B0"},
        {"rank": 1, "action": "1F0", "waits_for": "0F0"}]}


def test_lowered_receive_before_send_deadlocks():
    # rank 0 blocks on the gradient of microbatch 0 before posting its activation
    bad = table("bad", [0, 1], "0F0 0RECV_B0 0SEND_F0 0B0", "1RECV_F0 1F0 1B0 1SEND_B0",
                microbatches=1)
    result = simulate(bad)
    assert result.deadlock is not None and result.deadlock.time == 1.0
    assert [(r, str(a), str(w)) for r, a, w in result.deadlock.waiting] == [
        (0, "0RECV_B0", "1SEND_B0"), (1, "1RECV_F0", "0SEND_F0")]
    assert result.makespan == 1.0 and [str(e.action) for e in result.events] == ["0F0"]


def test_deadlock_after_progress_reports_time_reached():
    bad = table("bad", [0, 1], "0F0 0B0 0F1 0B1", "1F1 1F0 1B0 1B1", microbatches=2)
    result = simulate(bad)
    assert result.deadlock == Deadlock(1.0, ((0, Action(0, Kind.B, 0), Action(1, Kind.B, 0)),
                                             (1, Action(1, Kind.F, 1), Action(0, Kind.F, 1))))
    assert result.makespan == 1.0


def test_missing_action_is_a_deadlock():
    bad = table("missing", [0, 1], "0F0 0B0", "1B0", microbatches=1)
    result = simulate(bad)
    assert [(r, str(a), str(w)) for r, a, w in result.deadlock.waiting] == [
        (0, "0B0", "1B0"), (1, "1B0", "1F0")]
    with pytest.raises(ValueError, match="rank 1 at 1B0 waits for 1F0"):
        step_grid(bad)


# ---- step grid, text, trace, JSON ------------------------------------------------------------
def test_step_grid_1f1b_two_ranks_three_microbatches():
    expected = [
        ["0F0", "0F1", None, "0B0", "0F2", "0B1", None, "0B2"],
        [None, "1F0", "1B0", "1F1", "1B1", "1F2", "1B2", None],
    ]
    grid = step_grid(one_f_one_b(2, 3))
    assert [[None if a is None else str(a) for a in row] for row in grid] == expected
    assert to_csv(grid) == "0F0,0F1,,0B0,0F2,0B1,,0B2\n,1F0,1B0,1F1,1B1,1F2,1B2,\n"


def test_format_grid_like_torch_with_marker():
    text = format_grid(step_grid(one_f_one_b(2, 3)), mark_step=2)
    assert text == (
        "        Rank 0 Rank 1\n"
        "Step 0: 0F0\n"
        "Step 1: 0F1    1F0\n"
        "Step 2:        1B0 <-- here\n"
        "Step 3: 0B0    1F1\n"
        "Step 4: 0F2    1B1\n"
        "Step 5: 0B1    1F2\n"
        "Step 6:        1B2\n"
        "Step 7: 0B2\n")


def test_step_grid_gpipe_is_m_plus_p_minus_1_steps_each_way():
    grid = step_grid(gpipe(3, 4))
    assert all(len(row) == 2 * (4 + 3 - 1) for row in grid)
    assert sum(a is not None for row in grid for a in row) == 3 * 4 * 2


def test_chrome_trace_one_x_event_per_action_with_durations():
    schedule = one_f_one_b(3, 4)
    result = simulate(schedule, Costs(F=1.5, B=2.5))
    trace = json.loads(json.dumps(to_chrome_trace(result, time_unit_seconds=1e-3)))
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == schedule.num_actions
    assert {e["pid"] for e in trace["traceEvents"]} == {0}
    assert {e["tid"] for e in spans} == {0, 1, 2}
    for e in spans:
        assert e["dur"] == pytest.approx({"F": 1500.0, "B": 2500.0}[e["name"][1]])
        assert e["tid"] == parse_action(e["name"]).stage
    assert max(e["ts"] + e["dur"] for e in spans) == pytest.approx(result.makespan * 1000)
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert names == {"rank 0", "rank 1", "rank 2"}


def test_to_json_keys():
    data = simulate(one_f_one_b(2, 2)).to_json()
    assert json.loads(json.dumps(data)) == data
    assert set(data) == {"makespan", "bubble_fraction", "ranks", "deadlock"}
    assert data["deadlock"] is None
    assert set(data["ranks"][0]) == {"rank", "busy", "idle", "peak_inflight_microbatches",
                                     "peak_memory_bytes"}


def test_large_looped_schedule_runs_to_the_end():
    # 32 ranks x 256 microbatches x 2 looped stages = 32k actions; timings are in bench/bench_schedules.py
    p, m = 32, 256
    stage_map = loop_map(p, 2 * p)
    rows = []
    for r in range(p):
        mine = [r, r + p]
        rows.append(tuple(Action(s, Kind.F, i) for s in mine for i in range(m))
                    + tuple(Action(s, Kind.B, i) for s in reversed(mine) for i in range(m)))
    schedule = Schedule("looped_bfs", p, 2 * p, m, (stage_map,), tuple(rows))
    result = simulate(schedule)
    assert result.deadlock is None and len(result.events) == 4 * p * m


# ---- closed forms of the generated schedules -------------------------------------------------
def generate(name, p, m, virtual=None):
    from plandsl.schedules.generators import generate as generate_schedule
    return generate_schedule(name, p, m, virtual)


@needs_generators
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (8, 16)])
def test_generated_gpipe_1f1b_closed_form(name, p, m):
    result = simulate(generate(name, p, m))
    assert result.deadlock is None
    assert result.makespan == (m + p - 1) * 3
    assert result.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))


@needs_generators
@pytest.mark.parametrize("p, v, m", [(2, 2, 4), (4, 2, 8), (4, 4, 8), (8, 2, 16)])
def test_interleaved_1f1b_bubble_shrinks_by_v(p, v, m):
    # Narayanan et al. 2021: with chunks costing F/v and B/v, the bubble is (p-1)(F+B)/v
    result = simulate(generate("interleaved_1f1b", p, m, v), Costs(F=1 / v, B=2 / v))
    assert result.deadlock is None
    assert result.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1))
    assert result.makespan == pytest.approx(3 * m + 3 * (p - 1) / v)


@needs_generators
@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (4, 16), (8, 16)])
def test_zb_h1_bubble_is_a_third_of_1f1b(p, m):
    # Qi et al. 2024 (Zero Bubble Pipeline Parallelism, section 2.1): with T_F = T_B = T_W (their
    # B is our I), 1F1B idles (p-1)(T_F+T_B+T_W) per rank and ZB-H1 (p-1)(T_F+T_B-T_W), a third:
    # bubble rates (idle / m(T_F+T_B+T_W)) of (p-1)/m and (p-1)/3m.
    costs = Costs(F=1, B=2, I=1, W=1)
    zb, baseline = simulate(generate("zb_h1", p, m), costs), simulate(generate("1f1b", p, m), costs)
    assert zb.deadlock is None
    assert [r.idle for r in baseline.ranks] == [(p - 1) * (1 + 1 + 1)] * p
    assert [r.idle for r in zb.ranks] == [(p - 1) * (1 + 1 - 1)] * p
    assert zb.ranks[0].idle / (m * 3) == pytest.approx((p - 1) / (3 * m))
    assert baseline.ranks[0].idle / (m * 3) == pytest.approx((p - 1) / m)
    assert zb.makespan == 3 * m + (p - 1)
    # same peak in-flight microbatches as 1F1B on the first rank (the paper's memory claim)
    assert zb.ranks[0].peak_inflight_microbatches == baseline.ranks[0].peak_inflight_microbatches


def busy_span_gaps(result) -> list[float]:
    """Per rank: idle time between its first start and its last end."""
    first, last = {}, {}
    for e in result.events:
        first[e.rank] = min(first.get(e.rank, e.start), e.start)
        last[e.rank] = max(last.get(e.rank, e.end), e.end)
    return [last[r.rank] - first[r.rank] - r.busy for r in result.ranks]


@needs_generators
@pytest.mark.parametrize("name", ["zb_h2", "zbv"])
@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (4, 64), (8, 16), (8, 128)])
def test_zero_bubble_schedules_idle_only_at_the_parallelogram_edges(name, p, m):
    # Qi et al. 2024: with T_F = T_B = T_W, ZB-H2 and ZB-V have zero bubble: every rank works
    # without a gap from its first forward (rank r starts r x T_F late) to its end, so the only
    # idle is the (p-1) T_F skew of the parallelogram, whatever m: the bubble fraction -> 0.
    costs = Costs(F=1, B=2, I=1, W=1)
    result = simulate(generate(name, p, m), costs)
    assert result.deadlock is None
    assert busy_span_gaps(result) == [0.0] * p
    chunks = 2 if name == "zbv" else 1
    assert [r.idle for r in result.ranks] == [(p - 1) * 1.0] * p
    assert result.makespan == chunks * 3 * m + (p - 1)
    assert result.bubble_fraction == pytest.approx((p - 1) / (chunks * 3 * m + p - 1))
    if m >= 16 * p:
        assert result.bubble_fraction < 0.02
    # 1F1B and ZB-H1 do have gaps inside the parallelogram
    assert sum(busy_span_gaps(simulate(generate("zb_h1", p, m), costs))) == p * (p - 1) / 2


@needs_generators
@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "zb_h1", "zb_h2",
                                  "interleaved_zero_bubble", "zbv", "dualpipev", "chimera"])
def test_every_generated_schedule_runs_and_its_lowering_runs_the_same(name):
    p, m = 4, 8
    schedule = generate(name, p, m)
    costs = Costs(F=1, B=2, p2p=0.25)
    plain, lowered = simulate(schedule, costs), simulate(add_send_recv(schedule), costs)
    assert plain.deadlock is None and len(plain.events) == schedule.num_actions
    assert lowered.events == plain.events and lowered.ranks == plain.ranks
    check_dependencies(schedule, plain, p2p=0.25)
    grid = step_grid(schedule)
    assert sum(a is not None for row in grid for a in row) == schedule.num_actions


def test_format_grid_shows_a_window_around_the_marked_step():
    """`window`: a long grid is shown for the steps within `window` of the mark, `  ...` where steps are left out, its
    columns as wide as the window's cells (a schedule's diagnostics each carried every step)."""
    grid = step_grid(one_f_one_b(2, 6))  # 14 steps
    assert format_grid(grid, mark_step=2, window=20) == format_grid(grid, mark_step=2)  # short enough: all of it
    text = format_grid(grid, mark_step=7, window=2)
    assert text == (
        "         Rank 0 Rank 1\n"
        "  ...\n"
        "Step 05: 0B1    1F2\n"
        "Step 06: 0F3    1B2\n"
        "Step 07: 0B2    1F3 <-- here\n"
        "Step 08: 0F4    1B3\n"
        "Step 09: 0B3    1F4\n"
        "  ...\n"), text
    first = format_grid(grid, window=1).splitlines()
    assert first[1].startswith("Step 00:") and first[-1] == "  ..." and len(first) == 5  # no mark: the first steps
