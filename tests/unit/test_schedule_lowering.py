"""add_send_recv: exact lowered rows, V-shape tips need no transfer, purity, round trips."""
import copy
import importlib.util

import pytest

from plandsl.schedules.lower import add_send_recv
from plandsl.schedules.registry import BUILTIN
from plandsl.schedules.program import (Action, Kind, Schedule, format_rows, loop_map, parse_action,
                                       vshape_map)
from support import pipedream_flush as one_f_one_b

HAVE_GENERATORS = importlib.util.find_spec("plandsl.schedules.generators") is not None


def breadth_first(name: str, ranks: int, stage_map: tuple[int, ...], m: int) -> Schedule:
    """Every rank: all forwards of its stages in stage order, then all backwards in reverse."""
    rows = []
    for r in range(ranks):
        mine = [s for s, owner in enumerate(stage_map) if owner == r]
        row = [Action(s, Kind.F, i) for s in mine for i in range(m)]
        row += [Action(s, Kind.B, i) for s in reversed(mine) for i in range(m)]
        rows.append(tuple(row))
    return Schedule(name, ranks, len(stage_map), m, (stage_map,), tuple(rows))


def test_1f1b_two_ranks_lowered_rows():
    lowered = add_send_recv(one_f_one_b(2, 3))
    assert format_rows(lowered) == [
        "rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0F2 0SEND_F2 0RECV_B1 0B1 0RECV_B2 0B2",
        "rank 1: 1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1 1RECV_F2 1F2 1B2 1SEND_B2",
    ]


def test_split_backward_sends_after_input_grad_not_weight_grad():
    rows = ((Action(0, Kind.F, 0), Action(0, Kind.I, 0), Action(0, Kind.W, 0)),
            (Action(1, Kind.F, 0), Action(1, Kind.I, 0), Action(1, Kind.W, 0)))
    lowered = add_send_recv(Schedule("s", 2, 2, 1, (loop_map(2, 2),), rows))
    assert format_rows(lowered) == ["rank 0: 0F0 0SEND_F0 0RECV_B0 0I0 0W0",
                                    "rank 1: 1RECV_F0 1F0 1I0 1SEND_B0 1W0"]


def test_every_send_has_its_receive_and_vice_versa():
    lowered = add_send_recv(breadth_first("loop", 3, loop_map(3, 6), 4))
    kinds = {k: {(a.stage, a.microbatch) for row in lowered.actions for a in row if a.kind is k}
             for k in Kind}
    assert {(s + 1, m) for s, m in kinds[Kind.SEND_F]} == kinds[Kind.RECV_F]
    assert {(s - 1, m) for s, m in kinds[Kind.SEND_B]} == kinds[Kind.RECV_B]
    assert len(kinds[Kind.SEND_F]) == 5 * 4 and len(kinds[Kind.SEND_B]) == 5 * 4


@pytest.mark.parametrize("p", [2, 3, 4])
def test_vshape_tip_needs_no_communication(p):
    schedule = breadth_first("v", p, vshape_map(p), 2)
    lowered = add_send_recv(schedule)
    comm = {(a.kind, a.stage) for row in lowered.actions for a in row if not a.kind.is_compute}
    assert (Kind.SEND_F, p - 1) not in comm and (Kind.RECV_F, p) not in comm
    assert (Kind.SEND_B, p) not in comm and (Kind.RECV_B, p - 1) not in comm
    # every other stage boundary crosses ranks
    assert {s for k, s in comm if k is Kind.SEND_F} == set(range(2 * p - 1)) - {p - 1}


def test_chimera_like_two_pipelines_use_each_microbatch_pipeline():
    # pipeline 0: stages 0,1 on ranks 0,1; pipeline 1 (microbatch 1): stages 0,1 on ranks 1,0
    rows = ((Action(0, Kind.F, 0), Action(1, Kind.F, 1), Action(1, Kind.B, 1), Action(0, Kind.B, 0)),
            (Action(0, Kind.F, 1), Action(1, Kind.F, 0), Action(1, Kind.B, 0), Action(0, Kind.B, 1)))
    schedule = Schedule("c", 2, 2, 2, ((0, 1), (1, 0)), rows, microbatch_pipeline=(0, 1))
    assert format_rows(add_send_recv(schedule)) == [
        "rank 0: 0F0 0SEND_F0 1RECV_F1 1F1 1B1 1SEND_B1 0RECV_B0 0B0",
        "rank 1: 0F1 0SEND_F1 1RECV_F0 1F0 1B0 1SEND_B0 0RECV_B1 0B1",
    ]


def test_pass_does_not_mutate_and_is_idempotent():
    schedule = one_f_one_b(4, 6)
    before = copy.deepcopy(schedule)
    lowered = add_send_recv(schedule)
    assert schedule == before and lowered is not schedule
    assert add_send_recv(lowered) == lowered


@pytest.mark.parametrize("schedule", [one_f_one_b(2, 3), one_f_one_b(4, 8), one_f_one_b(3, 1),
                                      breadth_first("loop", 2, loop_map(2, 4), 3),
                                      breadth_first("v", 3, vshape_map(3), 3)],
                         ids=lambda s: f"{s.name}-{s.ranks}x{s.microbatches}")
def test_compute_only_inverts_add_send_recv(schedule):
    assert add_send_recv(schedule).compute_only() == schedule


@pytest.mark.parametrize("kind", list(Kind))
@pytest.mark.parametrize("stage, microbatch", [(0, 0), (3, 12), (127, 1023)])
def test_action_text_round_trips(kind, stage, microbatch):
    action = Action(stage, kind, microbatch)
    assert parse_action(str(action)) == action


@pytest.mark.skipif(not HAVE_GENERATORS, reason="plandsl.schedules.generators not written yet")
@pytest.mark.parametrize("name, p, m", [("zbv", 4, 8), ("dualpipev", 4, 8)])
def test_generated_vshape_needs_no_communication_at_the_tip(name, p, m):
    from plandsl.schedules.generators import generate
    schedule = generate(name, p, m)
    lowered = add_send_recv(schedule)
    assert lowered.compute_only() == schedule.compute_only()
    comm = {(a.kind, a.stage) for row in lowered.actions for a in row if not a.kind.is_compute}
    assert (Kind.SEND_F, p - 1) not in comm and (Kind.RECV_B, p - 1) not in comm


@pytest.mark.skipif(not HAVE_GENERATORS, reason="plandsl.schedules.generators not written yet")
@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv"])
def test_generated_schedules_round_trip_through_lowering(name):
    from plandsl.schedules.generators import generate
    schedule = generate(name, 4, 8)
    assert add_send_recv(schedule).compute_only() == schedule.compute_only()


@pytest.mark.skipif(not HAVE_GENERATORS, reason="plandsl.schedules.generators is not available")
@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_lowered_builtin_golden(name, golden):
    """Every built-in on 4 ranks x 8 microbatches (its usual stages per rank), lowered, as torch's
    lowered CSV (`_dump_csv` of `pipeline_order_with_comms`): one row per rank, one action a cell,
    in order. The file reads back to the same rows (tests/golden/schedules/lowered/)."""
    from plandsl.schedules.generators import generate
    lowered = add_send_recv(generate(name, 4, 8))
    text = "".join(",".join(str(a) for a in row) + "\n" for row in lowered.actions)
    assert [tuple(parse_action(cell) for cell in line.split(",")) for line in text.splitlines()] == \
        [tuple(row) for row in lowered.actions]
    golden(f"schedules/lowered/{name}_p4_m8.csv", text)
