"""`plandsl schedule` and `plandsl simulate` through the real command (click's runner)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from plandsl.cli import main
from plandsl.schedules.generators import generate
from plandsl.schedules.resolve import to_torch_csv
from support import bounded

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_text_is_the_step_grid():
    result = run("schedule", "1f1b", "--ranks", "2", "--microbatches", "3")
    assert result.exit_code == 0
    lines = result.output.splitlines()
    assert lines[0].split() == ["Rank", "0", "Rank", "1"]
    assert lines[1].split() == ["Step", "0:", "0F0"]
    assert len(lines) == 1 + 8  # 2(m) + ... : makespan of 1F1B at unit time is 2(m + p - 1) = 8


def test_csv_round_trips_through_import(tmp_path):
    result = run("schedule", "interleaved_1f1b", "--ranks", "2", "--microbatches", "4", "--virtual", "2",
                 "--format", "csv")
    assert result.exit_code == 0
    assert result.output == to_torch_csv(generate("interleaved_1f1b", 2, 4, 2))
    path = tmp_path / "order.csv"
    path.write_text(result.output)
    back = json.loads(run("schedule", str(path), "--format", "json").output)
    original = generate("interleaved_1f1b", 2, 4, 2)
    assert back["actions"] == [[str(a) for a in row] for row in original.actions]
    assert back["stage_to_rank"] == [list(original.stage_to_rank[0])]


def test_plan_format_is_a_table_the_language_reads(tmp_path):
    table = run("schedule", "zb_h1", "--ranks", "3", "--microbatches", "4", "--format", "plan").output
    path = tmp_path / "mine.plan"
    path.write_text(table)
    assert run("check", str(path)).exit_code == 0
    back = json.loads(run("schedule", f"{path}:table_zb_h1", "--format", "json").output)
    assert back["actions"] == [[str(a) for a in row] for row in generate("zb_h1", 3, 4).actions]


def test_simulate_json_matches_the_closed_form():
    result = run("schedule", "1f1b", "--ranks", "4", "--microbatches", "8", "--simulate", "--costs", "F=1,B=2",
                 "--json")
    figures = json.loads(result.output)
    assert figures["makespan"] == pytest.approx((8 + 4 - 1) * 3)
    assert figures["bubble_fraction"] == pytest.approx(3 / 11)
    assert [r["peak_inflight_microbatches"] for r in figures["ranks"]] == [4, 3, 2, 1]
    assert set(figures["ranks"][0]) == {"rank", "busy", "idle", "peak_inflight_microbatches", "peak_memory_bytes"}


def test_trace_has_one_slice_per_action(tmp_path):
    trace = tmp_path / "trace.json"
    result = run("schedule", "gpipe", "--ranks", "2", "--microbatches", "2", "--simulate", "--trace", str(trace))
    assert result.exit_code == 0
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    assert len(events) == 2 * 2 * 2


def test_simulate_a_plan_uses_its_costs_and_memory():
    result = run("simulate", str(ROOT / "stdlib_plans/examples/gpt3_175b_3d.plan"), "--json")
    assert result.exit_code == 0
    figures = json.loads(result.output)
    assert len(figures["ranks"]) == 8 and 0 < figures["bubble_fraction"] < 0.2
    # the checker's and estimate's states (~22 GiB) plus the activations in flight, at most estimate's peak
    from plandsl.api import load_plan
    from plandsl.cost.estimate import estimate_plan
    memory = estimate_plan(load_plan(ROOT / "stdlib_plans/examples/gpt3_175b_3d.plan")).memory
    assert all(m.states < r["peak_memory_bytes"] <= m.total * (1 + 1e-9) and m.states > 20e9
               for r, m in zip(figures["ranks"], memory, strict=True))
    text = run("simulate", str(ROOT / "stdlib_plans/examples/gpt3_175b_3d.plan")).output
    assert "makespan" in text and "GiB" in text


def test_simulate_with_given_costs_keeps_the_plan_memory():
    result = run("simulate", str(ROOT / "stdlib_plans/local/pp_1f1b.plan"), "--costs", "F=1,B=2", "--json")
    figures = json.loads(result.output)
    m = 8  # tiny_train: global batch 8, micro-batch 1, no data parallel
    assert figures["makespan"] == pytest.approx((m + 2 - 1) * 3)
    assert figures["ranks"][0]["peak_memory_bytes"] > 1000


def test_simulate_without_a_pipeline_says_so():
    result = CliRunner().invoke(main, ["simulate", str(ROOT / "stdlib_plans/local/dp.plan")])
    assert result.exit_code == 1
    assert "no pipeline" in result.output


def test_a_deadlocking_csv_is_rejected(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("0F0,0B0,0F1,0B1\n1F1,1B1,1F0,1B0\n")
    result = CliRunner().invoke(main, ["schedule", str(path)])
    assert result.exit_code == 1
    assert "E606" in result.output


@pytest.mark.parametrize("text, code, words", [
    # a stage far past the others: its map and the missing stages were walked one by one (10^14: a hang, 2 GB)
    ("99999999999999F0,99999999999999B0\n", "E603", "no action runs stages 0-99999999999998"),
    ("0F0,0B0\n,,\n5F0,5B0\n", "E603", "no action runs stages 1-4"),
    ("0F" + "9" * 5000 + "\n", "E602", "a stage or microbatch number of more than 30 digits"),  # int()'s own words
    ("0F\u0663,0B\u0663\n", "E602", "is not an action like 2F0"),  # an Arabic-Indic 3 read as microbatch 3
])
def test_a_csv_naming_far_stages_or_odd_numbers_is_one_diagnostic(tmp_path, text, code, words):
    path = tmp_path / "odd.csv"
    path.write_text(text, encoding="utf-8")
    with bounded(5, "schedule odd.csv"):
        result = CliRunner().invoke(main, ["schedule", str(path)])
    assert result.exit_code == 1 and f"error[{code}]" in result.output and words in result.output, result.output
    assert result.output.count("error[") == 1 and len(result.output) < 1000, result.output
    assert f"{path}:" in result.output or f"{path} " in result.output, result.output  # the file read, directory too


@pytest.mark.parametrize("args, code", [
    (["schedule", "gpipee", "--ranks", "2", "--microbatches", "2"], "E601"),
    (["schedule", "1f1b"], "E207"),
    (["schedule", "zbv", "--ranks", "2", "--microbatches", "4", "--virtual", "3"], "E502"),
    (["schedule", "1f1b", "--ranks", "2", "--microbatches", "2", "--simulate", "--costs", "F=x"], "E205"),
    (["schedule", "1f1b", "--ranks", "2", "--microbatches", "2", "--simulate", "--costs", "Q=1"], "E206"),
    # nan, inf and 1e308 printed a makespan of inf or nan and bubbles of nan%; a key twice kept the last
    *[(["schedule", "1f1b", "--ranks", "2", "--microbatches", "2", "--simulate", "--costs", costs], code)
      for costs, code in (("F=nan,B=1", "E205"), ("F=inf,B=1", "E205"), ("F=1e308,B=1e308", "E205"),
                          ("F=1,B=1,P2P=1e13", "E205"), ("F=1,f=2", "E213"))],
])
def test_bad_requests_are_diagnostics(args, code):
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1
    assert code in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("fmt", ["csv", "plan"])
def test_a_table_of_a_schedule_with_a_stage_on_two_ranks_is_refused(tmp_path, fmt):
    """`schedule chimera --format csv` wrote a CSV that `import --from torch-csv` refused (E607: each of its
    stages on two ranks) and torch would read as another schedule; `--format plan` a table that a plan naming it
    refused; `export --to torch-csv` already said E808. Text and JSON still print it."""
    result = CliRunner().invoke(main, ["schedule", "chimera", "--ranks", "2", "--microbatches", "2", "--format", fmt])
    assert result.exit_code == 1 and "error[E808]" in result.output and "2 pipelines at once" in result.output, \
        result.output
    for shown in ("text", "json"):
        assert run("schedule", "chimera", "--ranks", "2", "--microbatches", "2", "--format", shown).exit_code == 0


@pytest.mark.parametrize("name, ranks, microbatches, virtual", [("zbv", 4, 8, None), ("interleaved_1f1b", 2, 4, 2),
                                                                  ("dualpipev", 2, 4, None)])
def test_a_table_of_several_stages_a_rank_reads_back_with_its_own_sizes(tmp_path, name, ranks, microbatches, virtual):
    """`--format plan` wrote `schedule table_zbv(ranks = 4, microbatches = 8)` for 8 stages: read back (`schedule
    FILE.plan:table_zbv`, docs: "a table brings its own sizes") it was one stage a rank, E602 "7F0 refers to stage
    7, but the schedule has 4 stages"; the header now says `virtual = 2`, and so does `import --from torch-csv`."""
    sizes = ["--ranks", str(ranks), "--microbatches", str(microbatches)] + (["--virtual", str(virtual)] if virtual else [])
    table = run("schedule", name, *sizes, "--format", "plan").output
    assert ", virtual = 2)" in table.splitlines()[0]
    path = tmp_path / "mine.plan"
    path.write_text(table)
    back = json.loads(run("schedule", f"{path}:table_{name}", "--format", "json").output)
    assert back["actions"] == [[str(a) for a in row] for row in generate(name, ranks, microbatches, virtual or 2).actions]
    csv = tmp_path / "order.csv"
    csv.write_text(run("schedule", name, *sizes, "--format", "csv").output)
    imported = run("import", "--from", "torch-csv", "--args-file", str(csv), "-o", str(tmp_path / "imported.plan"))
    assert imported.exit_code == 0 and ", virtual = 2) {" in (tmp_path / "imported.plan").read_text()


def test_a_csv_named_outside_ascii_gives_a_table_the_language_reads(tmp_path):
    """`schedule ordér.csv --format plan` wrote `schedule table_ordér(...)` (`\\W` is Unicode's), which no plan
    parses; `import --from torch-csv -o s_café.plan` was a usage error quoting the parser."""
    csv = tmp_path / "ordér.csv"
    csv.write_text(run("schedule", "1f1b", "--ranks", "2", "--microbatches", "2", "--format", "csv").output)
    table = run("schedule", str(csv), "--format", "plan").output
    assert table.startswith("schedule table_ord_r(")
    (tmp_path / "t.plan").write_text(table)
    assert run("check", str(tmp_path / "t.plan")).exit_code == 0
    imported = CliRunner().invoke(main, ["import", "--from", "torch-csv", "--args-file", str(csv), "-o",
                                         str(tmp_path / "s_café.plan")])
    assert imported.exit_code == 0 and "schedule 'table_s_caf_'" in imported.output, imported.output
