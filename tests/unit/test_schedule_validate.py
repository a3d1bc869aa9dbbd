"""Schedule validation (plandsl.schedules.validate): one minimal bad schedule per code, E602-E607."""
from __future__ import annotations

import re

import pytest

from plandsl.schedules.program import Schedule, loop_map, parse_action
from plandsl.diagnostics import describe_numbers as describe_microbatches
from plandsl.schedules.validate import LIMIT, validate
from plandsl.diagnostics.source import Span


def schedule(*rows: str, microbatches: int = 2, virtual: int = 1, stage_to_rank=None) -> Schedule:
    ranks = len(rows)
    actions = tuple(tuple(parse_action(cell) for cell in row.split()) for row in rows)
    stage_map = stage_to_rank or loop_map(ranks, ranks * virtual)
    return Schedule("test", ranks, ranks * virtual, microbatches, (tuple(stage_map),), actions)


def marked_step(grid: str) -> int:
    marked = [line for line in grid.splitlines() if line.endswith("<-- here")]
    assert len(marked) == 1, grid
    return int(re.match(r"\s*Step 0*(\d+):", marked[0]).group(1))


def only(problems, code):
    assert [d.code for d in problems] == [code], [f"{d.code} {d.message}" for d in problems]
    return problems[0]


GOOD = ("0F0 0F1 0B0 0B1", "1F0 1B0 1F1 1B1")


def test_a_valid_schedule_has_no_problems():
    assert validate(schedule(*GOOD)) == []
    split = schedule("0F0 0F1 0I0 0W0 0I1 0W1", "1F0 1I0 1W0 1F1 1I1 1W1")
    assert validate(split) == []


def test_E602_stage_or_microbatch_out_of_range():
    d = only(validate(schedule("0F0 0F1 0B0 0B1 0F2", "1F0 1B0 1F1 1B1")), "E602")
    assert "rank 0, step 4" in d.message and "0F2" in d.message and "microbatch 2" in d.message
    assert "2 microbatches (0..1)" in d.message
    assert marked_step(d.grid) == 4
    d = only(validate(schedule("0F0 0F1 0B0 0B1", "1F0 1B0 1F1 1B1 5F0")), "E602")
    assert "rank 1, step 4" in d.message and "stage 5" in d.message and "2 stages (0..1)" in d.message
    assert marked_step(d.grid) == 4


def test_E603_missing_action_reported_per_stage():
    d = only(validate(schedule("0F0 0F1 0B0", "1F0 1B0 1F1 1B1")), "E603")
    assert "rank 0, step 3" in d.message  # the unit-time grid: rank 0 waits for 1B0
    assert "stage 0 never runs B for microbatch 1" in d.message
    assert marked_step(d.grid) == 3


def test_E603_is_compact():
    d = only(validate(schedule("0F0 0F1 0F2 0F3 0F4", "1F0 1F1 1F2 1F3 1F4 1F5 1B0 1B1 1B2 1B3 1B4 1B5",
                               microbatches=6)), "E603")
    assert "stage 0 never runs F for microbatch 5 and B for microbatches 0..5" in d.message
    assert "rank 0" in d.message and "step" in d.message


def test_E603_missing_half_of_a_split_backward():
    d = only(validate(schedule("0F0 0I0 0W0 0F1 0I1", "1F0 1I0 1W0 1F1 1I1 1W1")), "E603")
    assert "W for microbatch 1" in d.message and "rank 0" in d.message


def test_E604_duplicated_action():
    d = only(validate(schedule("0F0 0F1 0B0 0B1 0B1", "1F0 1B0 1F1 1B1")), "E604")
    assert "rank 0, step 6" in d.message and "0B1" in d.message and "step 5" in d.message
    assert marked_step(d.grid) == 6


def test_E604_backward_computed_twice():
    d = only(validate(schedule("0F0 0F1 0B0 0I1 0W1 0B1", "1F0 1B0 1F1 1B1")), "E604")
    assert "0I1 and 0W1" in d.message and "0B1" in d.message and "rank 0, step" in d.message
    assert d.grid is not None and "<-- here" in d.grid


def test_E605_backward_before_its_forward():
    d = only(validate(schedule("0F0 0B1 0F1 0B0", "1F0 1B0 1F1 1B1")), "E605")
    assert "rank 0, step 1" in d.message and "0B1 runs before 0F1" in d.message
    assert marked_step(d.grid) == 1


def test_E605_weight_before_input_gradient():
    d = only(validate(schedule("0F0 0I0 0W0", "1F0 1W0 1I0", microbatches=1)), "E605")
    assert "rank 1, step 1" in d.message and "1W0 runs before 1I0" in d.message
    assert marked_step(d.grid) == 1


def test_E605_across_stages_on_one_rank():
    # a V: rank 1 holds stages 1 and 2, so stage 2's forward needs stage 1's, on the same rank
    vshape = (0, 1, 1, 0)
    rows = ("0F0 3F0 3B0 0B0", "2F0 1F0 2B0 1B0")
    d = only(validate(schedule(*rows, microbatches=1, virtual=2, stage_to_rank=vshape)), "E605")
    assert "rank 1, step 0" in d.message and "2F0 runs before 1F0" in d.message
    assert marked_step(d.grid) == 0
    rows = ("0F0 3F0 3B0 0B0", "1F0 2F0 1B0 2B0")
    d = only(validate(schedule(*rows, microbatches=1, virtual=2, stage_to_rank=vshape)), "E605")
    assert "rank 1, step 2" in d.message and "1B0 runs before 2B0" in d.message
    assert marked_step(d.grid) == 2
    # stages on different ranks in an impossible order are a deadlock, not E605
    rows = ("2F0 0F0 0B0 2B0", "1F0 3F0 3B0 1B0")
    assert [d.code for d in validate(schedule(*rows, microbatches=1, virtual=2))] == ["E606"]


def test_E606_deadlock_names_every_stuck_rank():
    d = only(validate(schedule("0F0 0B0 0F1 0B1", "1F0 1F1 1B0 1B1")), "E606")
    assert "deadlocks at step 2" in d.message
    assert "rank 0 waits at 0B0" in d.message and "for 1B0 (rank 1)" in d.message
    assert "rank 1 waits at 1F1" in d.message and "for 0F1 (rank 0)" in d.message
    assert marked_step(d.grid) == 2
    assert len(d.notes) == 2


def test_E607_stage_on_two_ranks():
    d = only(validate(schedule("0F0 0F1 0B0 0B1 1F0", "1B0 1F1 1B1")), "E607")
    assert "rank 0, step 4" in d.message and "stage 1" in d.message and "runs on rank 1" in d.message
    assert marked_step(d.grid) == 4


def test_spans_locate_the_problem():
    where = {(0, 4): Span("f.plan", 7, 3, 7, 6)}
    default = Span("f.plan", 1, 1, 1, 10)
    d = only(validate(schedule("0F0 0F1 0B0 0B1 0F2", "1F0 1B0 1F1 1B1"), where, default), "E602")
    assert (d.span.line, d.span.column) == (7, 3)
    d = only(validate(schedule("0F0 0F1 0B0", "1F0 1B0 1F1 1B1"), {}, default), "E603")
    assert d.span == default


def test_all_problems_at_once_without_cascades():
    rows = ("0F0 0F1 0B0 0B1 0B1 0F7", "1B0 1F0 1F1 1B1")  # E604, E602 on rank 0; E605 on rank 1
    codes = sorted(d.code for d in validate(schedule(*rows)))
    assert codes == ["E602", "E604", "E605"]  # not E606 (not simulated), not E603


def test_an_action_on_the_wrong_rank_is_not_also_missing():
    codes = [d.code for d in validate(schedule("0F0 0F1 0B0 0B1 1F1", "1F0 1B0 1B1"))]
    assert codes == ["E607"]


def test_many_problems_are_capped():
    rows = (" ".join(f"0F{i} 0F{i}" for i in range(30)) + " " + " ".join(f"0B{i}" for i in range(30)),
            " ".join(f"1F{i} 1B{i}" for i in range(30)))
    problems = validate(schedule(*rows, microbatches=30))
    assert [d.code for d in problems] == ["E604"] * LIMIT
    assert "10 more problems" in problems[-1].notes[-1].message


def test_describe_microbatches():
    assert describe_microbatches([5, 0, 1, 2, 7, 8]) == "0..2, 5, 7..8"
    assert describe_microbatches([3]) == "3"


def test_the_builtin_schedules_are_valid():
    generators = pytest.importorskip("plandsl.schedules.generators")
    from plandsl.schedules.registry import BUILTIN
    for name, info in BUILTIN.items():
        checked = 0
        for p in range(1, 6):
            for m in range(1, 2 * p + 2):
                for v in ((1, 2, 3) if info.virtual == "any" else (None,)):
                    try:
                        built = generators.generate(name, p, m, v)
                    except ValueError:
                        continue
                    assert validate(built) == [], (name, p, m, v)
                    checked += 1
        assert checked, name
