"""Schedules written in the language: tables and templates -> the schedule IR (plandsl.lower.schedule_template)."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import pytest
from click.testing import CliRunner

from plandsl import api, syntax
from plandsl.cli import main
from plandsl.schedules.program import Action, Kind, parse_action
from plandsl.lower.schedule_template import expand, instantiate
from support import bounded

ROOT = Path(__file__).resolve().parents[2]
SCHEDULES = ROOT / "stdlib_plans" / "schedules"
FILES = sorted(SCHEDULES.glob("*.plan"))
PATH = "<test>"


def definition(text: str, name: str | None = None, keep_syntax: bool = True):
    """The ScheduleDef called `name` (or the first) of `text`, with its syntax as the lowering keeps it."""
    document = api.loads(text, path=PATH)
    defn = next(d for d in document.schedules if name is None or d.name == name)
    if keep_syntax:
        module = api.parse(text, PATH)
        node = next(i for i in module.items if isinstance(i, syntax.Definition) and i.name == defn.name)
        defn = defn.model_copy(update={"syntax": node})
    return defn


def rows(schedule) -> list[list[str]]:
    return [[str(a) for a in row] for row in schedule.actions]


@lru_cache(maxsize=None)
def stdlib(stem: str):  # the IR is frozen: one load per file
    return api.load(SCHEDULES / f"{stem}.plan").schedules[0]


@lru_cache(maxsize=None)
def library(stem: str, p: int, m: int, v: int = 1):
    """`instantiate` of the stdlib's template `stem`, once per size: three tests compare the same
    instances (valid, torch's order, the built-in generator's); interleaved_1f1b's ~300 cost ~0.8 CPU-s."""
    schedule, problems = instantiate(stdlib(stem), None, p, m, v)
    return schedule, tuple(problems)


def one_f_one_b(p: int, m: int) -> list[list[str]]:
    """PipeDream-Flush as written in Narayanan et al. 2021: min(p - r - 1, m) warm-up forwards, 1F1B, drain."""
    out = []
    for r in range(p):
        w = min(p - r - 1, m)
        row = [f"{r}F{i}" for i in range(w)]
        for i in range(m - w):
            row += [f"{r}F{w + i}", f"{r}B{i}"]
        row += [f"{r}B{i}" for i in range(m - w, m)]
        out.append(row)
    return out


TABLE = """\
schedule t(ranks = 2, microbatches = 2) {
  rank 0: 0F0 0F1 _   0B0 0B1
  rank 1: _   1F0 1B0 1F1 1B1
}
"""

TEMPLATE = """\
schedule t(p: ranks, m: microbatches) {
  for r in 0..p on rank r {
    let w = min(p - r - 1, m)
    for i in 0..w { F(r, i) }
    for i in 0..m - w {
      F(r, w + i)
      B(r, i)
    }
    for i in m - w..m { B(r, i) }
  }
}
"""


# ---- tables ---------------------------------------------------------------------------
@pytest.mark.parametrize("keep_syntax", [True, False])
def test_table_rows_are_the_actions_without_idle_cells(keep_syntax):
    schedule, problems = instantiate(definition(TABLE, keep_syntax=keep_syntax), None, 2, 2)
    assert problems == []
    assert rows(schedule) == [["0F0", "0F1", "0B0", "0B1"], ["1F0", "1B0", "1F1", "1B1"]]
    assert (schedule.ranks, schedule.stages, schedule.microbatches) == (2, 2, 2)
    assert schedule.stage_to_rank == ((0, 1),)


def test_table_spans_point_at_cells():
    instance = expand(definition(TABLE), None, 2, 2)
    span = instance.spans[(1, 0)]  # rank 1's first action, 1F0, after an idle cell
    assert (span.line, span.column) == (3, 15)
    assert TABLE.splitlines()[span.line - 1][span.column - 1:span.end_column - 1] == "1F0"


@pytest.mark.parametrize("plan_sizes, written", [((2, 3), "microbatches = 2"), ((3, 2), "ranks = 2")])
def test_table_size_mismatch(plan_sizes, written):
    schedule, problems = instantiate(definition(TABLE), None, *plan_sizes)
    assert schedule is None
    assert [d.code for d in problems] == ["E608"]
    message = problems[0].message
    assert written in message
    other = "microbatches = 3" if plan_sizes == (2, 3) else "ranks = 3"
    assert other in message
    assert problems[0].span.line == 1


def test_table_row_for_a_rank_the_plan_lacks():
    text = "schedule t(microbatches = 1) {\n  rank 0: 0F0 0B0\n  rank 1: 1F0 1B0\n  rank 2: 2F0 2B0\n}\n"
    schedule, problems = instantiate(definition(text), None, 2, 1)
    assert schedule is None
    assert [d.code for d in problems] == ["E608"]
    assert "rank 2" in problems[0].message and "2 pipeline ranks" in problems[0].message
    assert problems[0].span.line == 4


def test_table_with_a_missing_row_is_validated():
    text = "schedule t(ranks = 2, microbatches = 1) {\n  rank 0: 0F0 0B0\n}\n"
    schedule, problems = instantiate(definition(text), None, 2, 1)
    assert schedule is not None and rows(schedule) == [["0F0", "0B0"], []]
    assert [d.code for d in problems] == ["E603"]
    assert "stage 1" in problems[0].message


def test_table_with_virtual_stages():
    text = ("schedule t(ranks = 2, microbatches = 1, virtual = 2) {\n"
            "  rank 0: 0F0 2F0 _   _   _   _   2B0 0B0\n"
            "  rank 1: _   1F0 _   3F0 3B0 1B0\n"
            "}\n")
    schedule, problems = instantiate(definition(text), None, 2, 1, virtual=2)
    assert problems == []
    assert schedule.stages == 4 and schedule.stage_to_rank == ((0, 1, 0, 1),)


# ---- templates ------------------------------------------------------------------------
@pytest.mark.parametrize("keep_syntax", [True, False])
@pytest.mark.parametrize("p, m", [(1, 1), (2, 1), (4, 2), (4, 8), (3, 5)])
def test_template_runs_its_body(keep_syntax, p, m):
    schedule, problems = instantiate(definition(TEMPLATE, keep_syntax=keep_syntax), None, p, m)
    assert problems == []
    assert rows(schedule) == one_f_one_b(p, m)
    assert schedule.stage_to_rank == (tuple(range(p)),)


def test_template_spans_point_at_action_statements():
    instance = expand(definition(TEMPLATE), None, 4, 4)
    lines = TEMPLATE.splitlines()
    for (rank, index), span in instance.spans.items():
        action = instance.schedule.actions[rank][index]
        written = lines[span.line - 1][span.column - 1:span.end_column - 1]
        assert written.startswith(action.kind.value + "(")
    assert len(instance.spans) == instance.schedule.num_actions


def test_template_binds_every_dimension_and_runs_if_else():
    text = """\
schedule t(p: ranks, m: microbatches, v: virtual, s: stages) {
  for r in 0..p {
    on rank r {
      for c in 0..v {
        for i in 0..m {
          if c == 0 and i == 0 { F(r + c * p, i) } else { F(r + c * p, i) }
        }
      }
    }
  }
  for r in 0..p on rank p - 1 - r {
    for c in 0..v {
      let stage = p - 1 - r + (s // p - 1 - c) * p
      for i in 0..m { B(stage, i) }
    }
  }
}
"""
    instance = expand(definition(text), None, 2, 2, virtual=2, validate=False)
    assert instance.diagnostics == []
    assert rows(instance.schedule)[0][:4] == ["0F0", "0F1", "2F0", "2F1"]
    assert rows(instance.schedule)[1][-4:] == ["3B0", "3B1", "1B0", "1B1"]
    assert instance.schedule.stages == 4 and instance.schedule.stage_to_rank == ((0, 1, 0, 1),)


def test_template_let_is_local_to_its_block():
    text = ("schedule t(p: ranks, m: microbatches) {\n  for r in 0..p on rank r {\n"
            "    for i in 0..m { let x = i }\n    F(r, x)\n  }\n}\n")
    schedule, problems = instantiate(definition(text), None, 2, 2)
    assert schedule is None and [d.code for d in problems] == ["E608"]
    assert "unknown name 'x'" in problems[0].message


def test_template_uses_the_files_params():
    text = "param warm = 1\n" + TEMPLATE.replace("min(p - r - 1, m)", "min(p - r - warm, m)")
    schedule, problems = instantiate(definition(text), None, 3, 4)
    assert schedule is None and "unknown name 'warm'" in problems[0].message  # no scope: numbers only


@pytest.mark.parametrize("body, message, where", [
    ("for r in 0..p on rank r { F(r, 1 // (r - 1)) }", "division by zero", "1 // (r - 1)"),
    ("for r in 0..p on rank r { F(r, q) }", "unknown name 'q'", "q"),
    ("F(0, 0)", "not inside an `on rank`", "F(0, 0)"),
    ("on rank p { F(0, 0) }", "rank 2 does not exist", "p"),
    ("for r in 0..p on rank r { F(r, 1 / 2) }", "whole number", "1 / 2"),
    ("for r in 0..p on rank r { G(r, 0) }", "an action is F(stage, microbatch)", "G(r, 0)"),
    ("for r in 0..p on rank r { F(r) }", "an action is F(stage, microbatch)", "F(r)"),
    ("for r in p on rank r { F(r, 0) }", "a loop runs over a range", "p"),
    ("for r in 0..p on rank r { F(r, 0 < 1) }", "expected a number", "0 < 1"),
    ("if p { F(0, 0) }", "not inside an `on rank`", "F(0, 0)"),
    ("for r in 0..p on rank r { for i in 0..1000000000 { F(r, i) } }", "runs 1,000,000,000 times",
     "0..1000000000"),
    # a range past 2^63 has no len(): counted, not an OverflowError (E108)
    (f"for r in 0..p on rank r {{ for i in 0..{10**40} {{ F(r, i) }} }}", f"runs {10**40:,} times", f"0..{10**40}"),
    (f"for r in 0..p on rank r {{ for i in -{10**40}..m {{ F(r, i) }} }}", f"runs {10**40 + 2:,} times",
     f"-{10**40}..m"),
    ("for r in 0..p on rank r { for i in 0..100000 { for j in 0..100000 { } } }", "more than", None),
])
def test_template_runtime_errors_are_E608_with_a_span(body, message, where):
    text = f"schedule t(p: ranks, m: microbatches) {{\n  {body}\n}}\n"
    schedule, problems = instantiate(definition(text), None, 2, 2)
    assert schedule is None
    assert [d.code for d in problems] == ["E608"]
    assert message in problems[0].message
    assert "p = 2, m = 2" in problems[0].message
    span = problems[0].span
    assert span.line == 2
    if where is not None:
        assert text.splitlines()[1][span.column - 1:span.end_column - 1] == where


def test_runaway_template_is_stopped_quickly():
    text = ("schedule t(p: ranks, m: microbatches) {\n  for r in 0..p on rank r {\n"
            "    for i in 0..5000 { for j in 0..5000 { F(r, i) } }\n  }\n}\n")
    with bounded(10, "instantiate"):
        schedule, problems = instantiate(definition(text), None, 2, 2)
    assert schedule is None and [d.code for d in problems] == ["E608"]
    assert "more than" in problems[0].message and problems[0].span.line == 3


def test_stage_on_two_ranks_is_E607():
    text = ("schedule t(p: ranks, m: microbatches) {\n  for r in 0..p on rank r {\n"
            "    for i in 0..m { F(r, i) }\n    for i in 0..m { B(r, i) }\n  }\n"
            "  on rank 0 { F(1, 0) }\n}\n")
    schedule, problems = instantiate(definition(text), None, 2, 1)
    assert schedule is not None
    assert [d.code for d in problems] == ["E607"]
    assert "rank 0" in problems[0].message and "stage 1" in problems[0].message
    assert problems[0].span.line == 6


def test_template_validation_points_at_the_statement():
    text = TEMPLATE.replace("for i in m - w..m { B(r, i) }", "for i in m - w..m - 1 { B(r, i) }")
    schedule, problems = instantiate(definition(text), None, 2, 3)
    assert [d.code for d in problems] == ["E603"]
    assert "stage 0 never runs B for microbatch 2" in problems[0].message
    line = text.splitlines()[problems[0].span.line - 1]
    assert line[problems[0].span.column - 1:].startswith("B(r, i)")  # the statement that emits its Bs


# ---- the standard library's templates ----------------------------------------------------------
def test_library_has_the_templates():
    assert {p.stem for p in FILES} >= {"gpipe", "1f1b", "interleaved_1f1b"}
    names = {stdlib(p.stem).name for p in FILES}
    assert names == {"gpipe_template", "one_f_one_b_template", "interleaved_1f1b_template"}
    from plandsl.schedules.registry import BUILTIN
    assert not names & set(BUILTIN)


def test_library_schedule_files_check_clean():
    result = CliRunner().invoke(main, ["check", *map(str, FILES)])
    assert result.exit_code == 0, result.output
    for path in FILES:
        analysis = api.check(path)
        assert analysis.ok and not analysis.diagnostics


def _sizes(stem: str):
    for p in range(1, 7):
        for m in range(1, 3 * p + 2):
            if stem != "interleaved_1f1b":
                yield p, m, 1
                continue
            for v in (1, 2, 3):
                if m % max(1, m // p) == 0:
                    yield p, m, v


@pytest.mark.parametrize("stem", ["gpipe", "1f1b", "interleaved_1f1b"])
def test_library_templates_are_valid(stem):
    for p, m, v in _sizes(stem):
        schedule, problems = library(stem, p, m, v)
        assert problems == (), (p, m, v, [d.message for d in problems])
        assert schedule.stage_to_rank == (tuple(s % p for s in range(p * v)),)


def test_library_1f1b_and_gpipe_are_the_textbook_orders():
    for p, m, _ in _sizes("1f1b"):
        assert rows(library("1f1b", p, m)[0]) == one_f_one_b(p, m)
        expected = [[f"{r}F{i}" for i in range(m)] + [f"{r}B{i}" for i in range(m)] for r in range(p)]
        assert rows(library("gpipe", p, m)[0]) == expected


def _torch_interleaved(p: int, m: int, v: int) -> list[list[str]]:
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    cls = schedules.ScheduleInterleaved1F1B
    out = []
    for rank in range(p):
        runner = cls.__new__(cls)  # only the order computation, no process group
        runner.n_local_stages, runner.pp_group_size, runner._n_microbatches = v, p, m
        runner.number_of_rounds = max(1, m // p)
        runner.microbatches_per_round = m // runner.number_of_rounds
        try:
            ops = runner._calculate_single_rank_operations(rank)
        except AttributeError as error:  # a private API: torch may change it
            pytest.skip(f"torch's interleaved order is not reachable: {error}")
        out.append([str(a) for a in ops if a is not None])
    return out


def test_library_interleaved_is_torchs_order():
    for p, m, v in _sizes("interleaved_1f1b"):
        mine = rows(library("interleaved_1f1b", p, m, v)[0])
        assert mine == _torch_interleaved(p, m, v), (p, m, v)


@pytest.mark.parametrize("stem, builtin", [("gpipe", "gpipe"), ("1f1b", "1f1b"),
                                           ("interleaved_1f1b", "interleaved_1f1b")])
def test_library_templates_equal_the_builtin_generators(stem, builtin):
    generators = pytest.importorskip("plandsl.schedules.generators")
    checked = 0
    for p, m, v in _sizes(stem):
        try:
            expected = generators.generate(builtin, p, m, virtual=v if stem == "interleaved_1f1b" else None)
        except ValueError:
            continue  # sizes the built-in refuses
        mine, problems = library(stem, p, m, v)
        assert problems == ()
        assert [[str(a) for a in row if a.kind.is_compute] for row in expected.actions] == rows(mine), (p, m, v)
        assert expected.stage_to_rank == mine.stage_to_rank
        checked += 1
    assert checked


def test_actions_and_kinds():
    text = ("schedule t(p: ranks, m: microbatches) {\n  for r in 0..p on rank r {\n"
            "    for i in 0..m { F(r, i) }\n    for i in 0..m {\n      I(r, i)\n      W(r, i)\n    }\n  }\n}\n")
    schedule, problems = instantiate(definition(text), None, 2, 1)
    assert problems == []
    assert schedule.actions[0] == (Action(0, Kind.F, 0), Action(0, Kind.I, 0), Action(0, Kind.W, 0))
    assert parse_action("1W0") in schedule.actions[1]


def test_with_the_lowering_scope():
    """Given the file's scope (as `plandsl check` would pass it), templates see its params, and tables
    get the spans of their cells even where the IR keeps no syntax."""
    from plandsl.syntax.loader import Loader
    from plandsl.lower import Lowering
    text = "param warm = 1\n" + TEMPLATE.replace("schedule t(", "schedule u(").replace(
        "min(p - r - 1, m)", "min(p - r - warm, m)") + "\n" + TABLE
    loader = Loader()
    root = loader.load_text(text, PATH)
    lowering = Lowering(loader.modules, None)
    document = lowering.document(root)
    scope = lowering.scopes[root.path]
    template, table = (next(d for d in document.schedules if d.name == n) for n in ("u", "t"))
    schedule, problems = instantiate(template, scope, 3, 4)
    assert problems == [] and rows(schedule) == one_f_one_b(3, 4)
    instance = expand(table, scope, 2, 2)
    assert instance.diagnostics == []
    span = instance.spans[(1, 0)]
    assert text[span.start:span.end] == "1F0"
    broken = text.replace("B(r, i) }", "B(r, i // 0) }")
    loader = Loader()
    root = loader.load_text(broken, PATH)
    lowering = Lowering(loader.modules, None)
    document = lowering.document(root)
    schedule, problems = instantiate(document.schedules[0], lowering.scopes[root.path], 3, 4)
    assert schedule is None and [d.code for d in problems] == ["E608"]
    assert broken[problems[0].span.start:problems[0].span.end] == "i // 0"
    assert lowering.diagnostics == []  # the error is the template's, not the lowering's
