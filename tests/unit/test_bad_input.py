"""Hostile and malformed input: every case ends in diagnostics, quickly, never in a traceback.

In-process cases go through `plandsl.check.analysis.analyze` (which must never raise) and
`plandsl.api.loads` (which must raise only `PlanError`); file cases also go through the
real `plandsl check` command in a subprocess (exit 1, no "Traceback" on stderr).
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest

from plandsl import api
from plandsl.check.analysis import Analysis, analyze
from plandsl.diagnostics.codes import CODES
from plandsl.diagnostics import PlanError
from plandsl.syntax.parser import MAX_BYTES, MAX_NESTING, decode
from support import HANG_S, VALID_PLAN, bounded, cli_in_process

ROOT = Path(__file__).resolve().parents[2]

VALID = VALID_PLAN


def _plan_with_mesh(mesh: str) -> str:
    return VALID.replace("[dp = nodes * 8 / 4, pp = 2, tp = 2]", mesh)


def diagnosed(text: str, *codes: str, limit: float = 15.0) -> Analysis:
    """analyze(text) returns errors (one of `codes` if given) within `limit` CPU seconds, never raises."""
    with bounded(limit, "analyze"):
        analysis = analyze(text=text)
    assert not analysis.ok, "expected an error"
    assert analysis.document is None or analysis.errors
    for d in analysis.diagnostics:
        assert d.code in CODES
    if codes:
        assert {d.code for d in analysis.errors} & set(codes), [(d.code, d.message) for d in analysis.errors]
    with pytest.raises(PlanError) as caught:
        api.loads(text)
    assert caught.value.diagnostics
    return analysis


def run_check(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`plandsl check *args` in `cwd` (in this process; test_cli_missing_file_and_directory starts a real one)."""
    result = cli_in_process("check", *args, cwd=cwd)
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "Traceback" not in result.stdout, result.stdout[-3000:]
    return result


_fresh = 0


def assert_parser_still_works() -> None:
    """After a RecursionError deep in lark, the shared parser must still parse normally (a text never
    seen before: the parser keeps the trees of small files it parsed, which would answer without it)."""
    global _fresh
    _fresh += 1
    analysis = analyze(text=VALID + f"# fresh text {_fresh}\n")
    assert analysis.ok, analysis.diagnostics
    assert [p.name for p in analysis.document.plans] == ["p"]


# ---- files that are not plans --------------------------------------------------------------
NOT_PLANS = {
    "python": "import os\n\n\ndef main(argv):\n    return {'a': [1, 2]}\n\nif __name__ == '__main__':\n    main()\n",
    "json": json.dumps({"plan": {"mesh": [1, 2, 3], "nested": {"a": None, "b": True}}}, indent=2),
    "markdown": "# Title\n\nSome *text* with `code`.\n\n- item\n- item\n\n```python\nx = 1\n```\n",
    "yaml": "plan:\n  mesh:\n    - dp: 8\n  train: {global_batch: 64}\n",
    "html": "<!doctype html><html><body><p>hello</p></body></html>\n",
}


@pytest.mark.parametrize("kind", sorted(NOT_PLANS))
def test_file_that_is_not_a_plan(kind):
    analysis = diagnosed(NOT_PLANS[kind], "E101", "E102", "E103", "E104")
    assert all(d.code.startswith("E1") for d in analysis.errors)
    assert analysis.errors[0].span.line >= 1


def test_binary_garbage_in_process():
    rng = random.Random(1234)
    for _ in range(20):
        data = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 2000)))
        with pytest.raises(PlanError) as caught:
            decode("garbage.plan", data)  # random bytes are almost never UTF-8
        assert caught.value.diagnostics[0].code == "E105"


def test_nul_byte_in_valid_utf8():
    diagnosed(VALID.replace("plan p", "plan\x00p"), "E105")
    diagnosed("\x00" * 100, "E105")


def test_non_utf8_byte_points_at_it():
    with pytest.raises(PlanError) as caught:
        decode("bad.plan", b"param a = 1\n\xff\n")
    (d,) = caught.value.diagnostics
    assert d.code == "E105"
    assert "0xff" in d.message and "offset 12" in d.message
    assert (d.span.line, d.span.column) == (2, 1)


def test_unterminated_string():
    analysis = diagnosed('import "clusters/dgx_a100\nparam n = 1\n', "E103")
    assert analysis.errors[0].span.line == 1
    diagnosed('let s = "never closed', "E103")


@pytest.mark.parametrize("text", ["@", "let x = $", "plan p { ` }", "let x = 1 ? 2", "let é = 1"])
def test_invalid_characters(text):
    diagnosed(text, "E101", "E104")


def test_truncated_plan():
    for cut in (10, 40, len(VALID) // 2, len(VALID) - 3):
        diagnosed(VALID[:cut])


# ---- deep nesting and long chains ------------------------------------------------------------
def test_deep_parentheses_at_top_level():
    # `x = ...` is not a statement at all: a syntax error at `x`, whatever follows.
    diagnosed("x = " + "(" * 10000 + "1" + ")" * 10000, "E101", "E106")


@pytest.mark.parametrize("open_, close", [("(", ")"), ("[", "]"), ("{a: ", "}")])
def test_deep_brackets_hit_the_nesting_guard(open_, close):
    text = "let x = " + open_ * 10000 + "1" + close * 10000
    analysis = diagnosed(text, "E106")
    assert str(MAX_NESTING) in analysis.errors[0].message
    assert_parser_still_works()


def test_nesting_just_under_the_guard_is_fine():
    text = "let x = " + "(" * (MAX_NESTING - 1) + "1" + ")" * (MAX_NESTING - 1) + "\n"
    analysis = analyze(text=text)
    assert analysis.ok, analysis.diagnostics


@pytest.mark.parametrize("name, text", [pytest.param(*case, id=case[0]) for case in [
    ("sum of 100k terms", "let x = " + "+".join(["1"] * 100_000)),
    ("20k unary minus", "let x = " + "- " * 20_000 + "1"),
    ("20k minus no spaces", "let x = " + "-" * 20_000 + "1"),
    ("20k not", "let x = " + "not " * 20_000 + "true"),
    ("20k member accesses", "let x = a" + ".b" * 20_000),
    ("20k calls", "let x = f" + "()" * 20_000),
]])
def test_long_chains_get_a_diagnostic(name, text):
    diagnosed(text, "E106")
    assert_parser_still_works()


def test_deep_let_chain_in_evaluation():
    """A long chain of `let`s is evaluated from a bounded stack (no E106): see test_hostile_sizes."""
    lets = "let a0 = 1\n" + "".join(f"let a{i} = a{i - 1} + 0\n" for i in range(1, 3001))
    analysis = analyze(text=lets + _plan_with_mesh("[dp = 4 * a3000, pp = 2, tp = 2]"))
    assert analysis.ok, analysis.diagnostics
    assert analysis.document.plans[0].dp == 4


def test_deep_expressions_in_a_let_chain_point_at_a_let():
    """Sums thousands of operators deep, in `let`s that use one another: E106 at a `let`, not at line 1."""
    terms = " + 1" * 2000
    lets = "let a0 = 1\n" + "".join(f"let a{i} = a{i - 1}{terms}\n" for i in range(1, 8))
    analysis = diagnosed(lets + _plan_with_mesh("[dp = a7 - a7 + 4, pp = 2, tp = 2]"), "E106")
    (error,) = analysis.errors
    assert "nested too deeply" in error.message and 2 <= error.span.line <= 8
    assert_parser_still_works()


def test_too_large_in_process():
    text = "# " + "x" * (MAX_BYTES + 10)
    analysis = diagnosed(text, "E106", limit=5)
    assert f"{MAX_BYTES:,}" in analysis.errors[0].message


# ---- arithmetic edge cases -----------------------------------------------------------------
@pytest.mark.parametrize("mesh, code", [
    ("[dp = 8 / 0, pp = 2, tp = 2]", "E211"),
    ("[dp = 8 // 0, pp = 2, tp = 2]", "E211"),
    ("[dp = 8 % 0, pp = 2, tp = 2]", "E211"),
    ("[dp = 1e400, pp = 2, tp = 2]", "E211"),          # inf is not a whole number
    ("[dp = 1e308 * 1e308, pp = 2, tp = 2]", "E211"),
    ("[dp = min(), pp = 2, tp = 2]", "E205"),
    ("[dp = 0, pp = 2, tp = 2]", "E305"),
    ("[dp = true, pp = 2, tp = 2]", "E205"),
    ("[dp = 4 GiB, pp = 2, tp = 2]", "E205"),
    ("[dp = 99999999999999999999999999, pp = 2, tp = 2]", "E301"),
])
def test_arithmetic_problems_are_diagnostics(mesh, code):
    diagnosed(_plan_with_mesh(mesh), code)


@pytest.mark.parametrize("call", ["ceil(1e400)", "floor(-1e400)", "ceil(1e308 * 10)", "floor(1e400 - 1e400)"])
def test_ceil_of_infinity(call):
    diagnosed(_plan_with_mesh(f"[dp = {call}, pp = 2, tp = 2]"), "E211")


@pytest.mark.parametrize("call, code", [("min(4)", None), ("max(4)", None), ("abs(4, 2)", "E205"), ("ceil(4, 2)", "E205"),
                                        ("floor()", "E205"), ("max(dp=4)", "E205")])
def test_a_function_given_the_wrong_count_of_numbers(call, code):
    """`min(4)` was E211 "min(): 'int' object is not iterable" (Python's words, for a call language.md writes as
    `min(a, b, ...)`); `abs(4, 2)` "abs() takes exactly one argument (2 given)". A min or max of one number is that
    number; the others take one number, E205 saying so."""
    text = _plan_with_mesh(f"[dp = {call}, pp = 2, tp = 2]")
    analysis = diagnosed(text, code) if code else analyze(text=text)
    assert code or analysis.ok, [(d.code, d.message) for d in analysis.errors]
    assert not any("iterable" in d.message or "argument" in d.message for d in analysis.diagnostics), \
        [d.message for d in analysis.diagnostics]
    if code == "E205" and call.startswith(("abs", "ceil", "floor")):
        assert any("takes one number" in d.message for d in analysis.errors), [d.message for d in analysis.errors]


BIG = "1" + "0" * 200  # 1e200: a legal literal, but its square does not fit a float


@pytest.mark.parametrize("expr", [f"{BIG} * {BIG} / 3", f"{BIG} * {BIG} + 0.5", f"{BIG} * {BIG} * 1.0",
                                  f"ceil({BIG} * {BIG} / 7)"], ids=["div", "add-float", "mul-float", "ceil"])
def test_integers_too_large_for_a_float(expr):
    diagnosed(_plan_with_mesh(f"[dp = {expr}, pp = 2, tp = 2]"), "E211")


@pytest.mark.parametrize("digits", [301, 401, 5000, 100_000])
def test_integer_literal_with_too_many_digits(digits):
    analysis = diagnosed("let x = " + "9" * digits + "\n", "E106")
    assert str(digits) in analysis.errors[0].message
    assert_parser_still_works()


@pytest.mark.parametrize("rank, code", [("1_", None), ("0_1", None), ("9" * 5000, "E106")])
def test_a_schedule_tables_rank_is_read_as_every_integer_is(rank, code):
    """`rank 1_ : ...` (the grammar's INT takes underscores, a trailing one too) was E108, "ValueError: invalid literal
    for int()", and a rank of 5,000 digits too (Python's int() refuses past 4,300): a table's rank number was read
    with int() alone. Now as every integer literal: underscores dropped, past 300 digits E106."""
    text = f"schedule t(ranks = 2, microbatches = 1) {{\n  rank 0: 0F0 _ 0B0\n  rank {rank}: _ 1F0 1B0\n}}\n"
    analysis = diagnosed(text, code) if code else analyze(text=text)
    assert "E108" not in {d.code for d in analysis.diagnostics}, [(d.code, d.message) for d in analysis.diagnostics]
    assert code or analysis.ok, [(d.code, d.message) for d in analysis.diagnostics]


def test_huge_integer_literal_in_a_mesh():
    diagnosed(_plan_with_mesh("[dp = " + "1" + "0" * 400 + ", pp = 2, tp = 2]"), "E106", "E211")


@pytest.mark.parametrize("text", ['let x = "\ud800"\n', "\udcff", 'param a = 1\n# \udfff\n'])
def test_lone_surrogate_in_text(text):
    analysis = diagnosed(text, "E105")
    assert analysis.errors[0].span.line >= 1


def test_huge_layer_count_is_refused_quickly():
    diagnosed(VALID.replace("layers=8", "layers=1000000000"), limit=3)


# A dozen characters that set a count should not buy hours of work. Each case runs in its own
# process; all start together (one shared deadline), so the group costs seconds, not minutes. The
# processes are forked from the test process, which has plandsl imported: a new interpreter would
# spend ~0.5 s of CPU on imports before the work the test judges.
_SLOW_PLAN = _plan_with_mesh("[dp = 4, pp = 2, tp = 2]").replace("  stages  = evenly over pp\n", "")
SLOW_CASES = {
    "nodes": VALID.replace("param nodes = 2", "param nodes = 1000000000"),
    "custom_layer_range": "model net {\n  layer b[0:1000000000] { params = 1 }\n}\n",
    "schedule_rank_row": "schedule s(ranks = 2, microbatches = 2) {\n  rank 1000000000: 0F0\n}\n",
    "stage_range": _SLOW_PLAN.replace("  schedule = 1f1b\n", "  stages {\n    0..1000000000: layers\n  }\n"),
    "stage_range_100k": _SLOW_PLAN.replace("  schedule = 1f1b\n", "  stages {\n    0..100000: layers\n  }\n"),
    "virtual": _SLOW_PLAN.replace("  schedule = 1f1b\n", "  stages = evenly over pp with virtual = 1000000000\n"),
}
SLOW_REASONS = {  # what made each case slow before it was bounded
    "nodes": "ir.Cluster.devices_in_order lists every device (check/training.py, check/memory.py)",
    "custom_layer_range": "lower_plan.layer_names expands `layer b[0:N]` into N layers",
    "schedule_rank_row": "lower_model.schedule_def builds a row for every rank up to the highest one",
    "stage_range": "a `0..N:` stage group materialises N stages (ir.StageGroup.stages)",
    "stage_range_100k": "placement._explicit reports E403 once per empty stage and placement._stage_span "
                        "scans every group's stage tuple for each: quadratic (30,000 stages take ~4 s)",
    "virtual": "`virtual = N` is walked stage by stage by the checks",
}
SLOW_DEADLINE = 5.0


SLOW_WALL_S = HANG_S  # a hang is killed here; the verdict is each process's own CPU time (SLOW_DEADLINE)


class _Analysis:
    """`analyze(text=...)` in a child forked from this process: exit status 0, or 1 with the traceback in
    `stderr`. The child leaves with `os._exit`, running none of the parent's (pytest's) exit code."""

    def __init__(self, text: str, stderr: Path) -> None:
        self.stderr, self.returncode = stderr, None
        self.pid = os.fork()
        if self.pid == 0:  # the child
            status = 1
            try:
                analyze(text=text)
                status = 0
            except BaseException:  # noqa: BLE001 - reported to the test through the file
                stderr.write_text(traceback.format_exc())
            finally:
                os._exit(status)

    def kill(self) -> None:
        if self.returncode is None:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
            self.returncode = -signal.SIGKILL


@pytest.fixture(scope="module")
def slow_runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("slow")
    procs = {name: _Analysis(text, folder / f"{name}.err") for name, text in SLOW_CASES.items()}
    yield time.monotonic() + SLOW_WALL_S, procs
    for proc in procs.values():
        proc.kill()


def _reap(proc: _Analysis, deadline: float) -> tuple[int, float] | None:
    """(exit status, CPU seconds the child used) once it ends, or None past `deadline` (killed).

    CPU time rather than wall time: the cases start together on a machine that may be busy with
    other work, and what the test judges is how much work the input bought, not how loaded we are."""
    while time.monotonic() < deadline:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid == proc.pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return proc.returncode, usage.ru_utime + usage.ru_stime
        time.sleep(0.02)
    proc.kill()
    return None


@pytest.mark.xdist_group("slow_runs")  # one worker starts the processes, once
@pytest.mark.parametrize("name", list(SLOW_REASONS))
def test_huge_counts_are_quick(slow_runs, name):
    deadline, procs = slow_runs
    proc = procs[name]
    reaped = _reap(proc, deadline)
    if reaped is None:
        pytest.fail(f"analyze did not finish within {SLOW_WALL_S} s (wall)")
    returncode, cpu = reaped
    stderr = proc.stderr.read_text(errors="replace") if proc.stderr.exists() else ""
    assert returncode == 0 and "Traceback" not in stderr, stderr[-2000:]
    assert cpu < SLOW_DEADLINE, f"analyze used {cpu:.1f} s of CPU ({SLOW_REASONS[name]})"


# ---- inputs that are fine ---------------------------------------------------------------------
def _ok(text: str) -> Analysis:
    analysis = analyze(text=text)
    assert analysis.ok, [(d.code, d.message) for d in analysis.diagnostics]
    return analysis


def test_empty_file_is_valid_with_no_plans():
    analysis = _ok("")
    assert analysis.document.plans == ()
    assert analysis.diagnostics == []


@pytest.mark.parametrize("text", ["\n", "\n\n\n", "   \n\t\n", ";", "# only\n# comments\n", "# no newline at end"])
def test_blank_and_comment_only_files(text):
    analysis = _ok(text)
    assert analysis.document.plans == ()


def _dump(analysis: Analysis) -> dict:
    dump = analysis.document.model_dump(mode="json")
    dump.pop("file")
    return dump


def test_crlf_line_endings_parse_the_same():
    expected = _dump(_ok(VALID))
    assert _dump(_ok(VALID.replace("\n", "\r\n"))) == expected


def test_bom_is_ignored():
    expected = _dump(_ok(VALID))
    source = decode("bom.plan", b"\xef\xbb\xbf" + VALID.encode())
    assert not source.text.startswith("\ufeff")
    assert _dump(_ok("\ufeff" + VALID)) == expected


def test_tabs_and_odd_spacing():
    expected = _dump(_ok(VALID))
    tabbed = VALID.replace("  ", "\t").replace(" = ", "\t=\t")
    assert _dump(_ok(tabbed)) == expected
    spaced = VALID.replace(" = ", "   =   ").replace(", ", " ,  ")
    assert _dump(_ok(spaced)) == expected


def test_line_continuation_and_semicolons():
    text = VALID.replace("schedule = 1f1b", "schedule = \\\n    1f1b").replace(
        "param nodes = 2", "param nodes = 2; param unused = 1")
    analysis = analyze(text=text)
    assert analysis.ok
    assert {d.code for d in analysis.diagnostics} == {"W201"}


# ---- through the real CLI --------------------------------------------------------------------
def _write(tmp_path: Path, name: str, data: bytes | str) -> str:
    path = tmp_path / name
    path.write_bytes(data if isinstance(data, bytes) else data.encode("utf-8"))
    return name


CLI_BAD = {
    "script.py": NOT_PLANS["python"],
    "data.json": NOT_PLANS["json"],
    "README.md": NOT_PLANS["markdown"],
    "garbage.plan": bytes(random.Random(7).randrange(256) for _ in range(4096)) + b"\x00",
    "nul.plan": b"param n = 1\n\x00\n",
    "latin1.plan": b"param n = 1\n\xff\n",
    "deep.plan": "let x = " + "(" * 10000 + "1" + ")" * 10000 + "\n",
    "lists.plan": "let x = " + "[" * 10000 + "1" + "]" * 10000 + "\n",
    "chain.plan": "let x = " + "+".join(["1"] * 100_000) + "\n",
    "string.plan": 'import "clusters/dgx_a100\n',
}


def test_cli_rejects_every_bad_file(tmp_path):
    names = [_write(tmp_path, name, data) for name, data in CLI_BAD.items()]
    result = run_check(*names, cwd=tmp_path)
    assert result.returncode == 1
    for name in names:  # every file is reported, not only the first bad one
        assert f"{name}:" in result.stderr, name
    assert "error[E1" in result.stderr


def test_cli_json_output_for_bad_files(tmp_path):
    names = [_write(tmp_path, name, data) for name, data in CLI_BAD.items() if name != "chain.plan"]
    result = run_check("--format", "json", *names, cwd=tmp_path)
    assert result.returncode == 1
    records = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
    assert {r["location"]["file"] for r in records} == set(names)
    assert all(r["code"].startswith("E1") and r["severity"] == "error" for r in records)


def test_cli_ten_megabyte_file_is_rejected_quickly(tmp_path):
    line = "# " + "x" * 97 + "\n"
    _write(tmp_path, "big.plan", line * (10 * 1024 * 1024 // len(line)))
    with bounded(10, "plandsl check"):
        result = run_check("big.plan", cwd=tmp_path)
    assert result.returncode == 1
    assert "E106" in result.stderr


def test_cli_missing_file_and_directory(tmp_path):
    result = run_check("nope.plan", cwd=tmp_path)
    assert result.returncode == 1
    assert "E208" in result.stderr
    (tmp_path / "adir.plan").mkdir()
    result = subprocess.run([sys.executable, "-m", "plandsl.cli", "check", "adir.plan"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode in (1, 2)  # click refuses a directory: a usage error
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("name, data", [pytest.param(*case, id=case[0]) for case in [
    ("empty.plan", ""), ("comments.plan", "# a\n# b\n"), ("crlf.plan", VALID.replace("\n", "\r\n")),
    ("bom.plan", b"\xef\xbb\xbf" + VALID.encode()), ("tabs.plan", VALID.replace("  ", "\t")),
]])
def test_cli_accepts_harmless_oddities(tmp_path, name, data):
    _write(tmp_path, name, data)
    result = run_check(name, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert f"{name}: ok" in result.stdout
