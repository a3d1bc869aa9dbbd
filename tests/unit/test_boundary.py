"""The API/CLI boundary: a plandsl bug in one file's work is E108 for that file, never a traceback.

A stage is made to raise (monkeypatched) and the real commands run in process: `check` reports
E108 for that file and goes on with the others (text and `--format json`), exit 1; every other
command goes through the same boundary; PLANDSL_DEBUG=1 adds the traceback as a note.
"""
from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path

import pytest
from click.testing import CliRunner

from plandsl import api
from plandsl.check import analysis
from plandsl.cli import main
from plandsl.cost import estimate
from support import VALID_PLAN


def _files(tmp_path: Path) -> list[str]:
    paths = []
    for name in ("a", "b", "c"):
        path = tmp_path / f"{name}.plan"
        path.write_text(VALID_PLAN.replace("plan p {", f"plan {name} {{"))
        paths.append(str(path))
    return paths


@pytest.fixture
def broken_b(monkeypatch):
    """The checker raises, as a bug would, on plan `b` only."""
    real = analysis.check_plan

    def check_plan(plan):
        if plan.name == "b":
            raise RuntimeError("boom in the checker")
        return real(plan)
    monkeypatch.setattr(analysis, "check_plan", check_plan)


def test_check_reports_the_bug_for_its_file_and_checks_the_others(tmp_path, broken_b):
    a, b, c = _files(tmp_path)
    result = CliRunner().invoke(main, ["check", a, b, c])
    assert result.exit_code == 1
    assert f"{a}: ok" in result.output and f"{c}: ok" in result.output
    assert f"{b}:1:1: error[E108]: internal error: RuntimeError: boom in the checker" in result.output
    assert "report it" in result.output and "Traceback" not in result.output


def test_check_json_has_the_bug_as_one_line(tmp_path, broken_b):
    a, b, c = _files(tmp_path)
    result = CliRunner().invoke(main, ["check", "--format", "json", a, b, c])
    assert result.exit_code == 1
    (line,) = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
    assert line["code"] == "E108" and line["location"]["file"] == b
    assert "RuntimeError: boom in the checker" in line["message"]
    assert all("Traceback" not in note["message"] for note in line["notes"])


def test_plandsl_debug_adds_the_traceback(tmp_path, broken_b, monkeypatch):
    monkeypatch.setenv("PLANDSL_DEBUG", "1")
    _, b, _ = _files(tmp_path)
    result = CliRunner().invoke(main, ["check", "--format", "json", b])
    (line,) = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
    assert "Traceback" in line["notes"][0]["message"] and "boom in the checker" in line["notes"][0]["message"]


def test_the_api_never_raises_on_a_bug(tmp_path, broken_b):
    _, b, _ = _files(tmp_path)
    checked = api.check(b)
    assert [d.code for d in checked.diagnostics] == ["E108"] and not checked.ok
    assert [d.code for d in api.checks(Path(b).read_text()).diagnostics] == ["E108"]


def test_every_command_goes_through_the_boundary(tmp_path, monkeypatch):
    def broken(plan):
        raise ZeroDivisionError("in the cost model")
    monkeypatch.setattr(estimate, "estimate_plan", broken)
    a, _, _ = _files(tmp_path)
    result = CliRunner().invoke(main, ["estimate", a])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert f"{a}:1:1: error[E108]: internal error: ZeroDivisionError: in the cost model" in result.output
    assert not isinstance(result.exception, ZeroDivisionError)


def test_a_command_without_a_file_reports_the_bug_without_a_location(monkeypatch):
    from plandsl.schedules import resolve

    def broken(*args, **kwargs):
        raise KeyError("ranks")
    monkeypatch.setattr(resolve, "load_schedule", broken)
    result = CliRunner().invoke(main, ["schedule", "1f1b", "--ranks", "4", "--microbatches", "8"])
    assert result.exit_code == 1
    assert result.output.startswith("error[E108]: internal error: KeyError: 'ranks'")


def test_usage_errors_and_exits_pass_through(tmp_path):
    result = CliRunner().invoke(main, ["schedule", "1f1b", "--ranks", "0"])
    assert result.exit_code == 2 and "E108" not in result.output
    a, _, _ = _files(tmp_path)
    assert CliRunner().invoke(main, ["check", a]).exit_code == 0


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs Linux's /dev/full")
@pytest.mark.parametrize("args", [["schema"], ["check", "p.plan"], ["render", "p.plan", "--view", "mesh", "--format", "dot"],
                                  ["fmt", "--check", "p.plan"], ["fmt", "-"]],
                         ids=["schema", "check", "render-bytes", "fmt-check", "fmt-stdin"])
def test_an_output_that_cannot_be_written_is_said_not_a_bug(tmp_path, args):
    """`plandsl schema > /dev/full` (a full disk) was E108, "internal error: OSError: [Errno 28] No space left on
    device ... this is a bug in plandsl": the machine's problem, said as one line, exit 1."""
    import os
    import subprocess
    import sys
    (tmp_path / "p.plan").write_text(VALID_PLAN.replace("\n", "\n\n"))  # unformatted: `fmt --check` says so
    with open("/dev/full", "w") as full:  # `fmt`, which guards each file on its own, said E108 after the fix for others
        done = subprocess.run([sys.executable, "-m", "plandsl.cli", *args], cwd=tmp_path, stdout=full,
                              input=VALID_PLAN if args == ["fmt", "-"] else None,
                              stderr=subprocess.PIPE, text=True, timeout=120,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 1, done.stderr
    assert "error[E110]: cannot write the output: No space left on device" in done.stderr, done.stderr
    assert "= hint: standard output or error went to a full disk" in done.stderr, done.stderr
    assert "E108" not in done.stderr and "Traceback" not in done.stderr and "Exception ignored" not in done.stderr


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs Linux's /dev/full")
def test_an_output_file_that_cannot_be_written_is_E110_at_its_path(tmp_path):
    """`-o /dev/full` passes the check before the work (a device is written as asked) and fails as it is written: an
    uncoded `/dev/full: error: cannot write: ...` line before; E110 at the path with the system's reason and a hint,
    exit 1, and as JSON with `--format json`."""
    (tmp_path / "p.plan").write_text(VALID_PLAN)
    plan = str(tmp_path / "p.plan")
    result = CliRunner().invoke(main, ["render", plan, "--view", "mesh", "--format", "dot", "-o", "/dev/full"])
    assert result.exit_code == 1, result.output
    assert result.output.startswith("/dev/full:1:1: error[E110]: cannot write /dev/full: No space left on device\n"
                                    "  = hint: the disk (or your quota) is full"), result.output
    shrunk = CliRunner().invoke(main, ["shrink", plan, "--format", "json", "-o", "/dev/full"])
    assert shrunk.exit_code == 1, shrunk.output
    [problem] = [json.loads(line) for line in shrunk.stdout.splitlines()]
    assert problem["code"] == "E110" and problem["location"]["file"] == "/dev/full", problem


@pytest.mark.parametrize("args, status", [(["schema"], 1), (["check", "p.plan"], 1), (["check", "--format", "json", "p.plan"], 0)],
                         ids=["schema", "check", "check-json-silent"])
def test_standard_output_closed_is_E110_where_something_is_written(tmp_path, args, status):
    """`plandsl schema >&-`: Python starts with sys.stdout None, and click.echo dropped every line, exit 0 with the
    output lost; now writing to it is E110 on standard error, exit 1, and a command that prints nothing still
    succeeds (`check --format json` of a valid plan)."""
    import os
    import subprocess
    import sys
    (tmp_path / "p.plan").write_text(VALID_PLAN)
    done = subprocess.run(["sh", "-c", 'exec "$0" -m plandsl.cli "$@" >&-', sys.executable, *args], cwd=tmp_path,
                          stderr=subprocess.PIPE, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == status, done.stderr
    if status:
        assert "error[E110]: cannot write the output: standard output is closed" in done.stderr, done.stderr
    assert "E108" not in done.stderr and "Traceback" not in done.stderr and "Exception ignored" not in done.stderr


def test_an_output_that_fails_midway_leaves_the_file_that_was_there(tmp_path):
    """`-o`/`--trace` wrote in place: a write that failed midway (a full disk) left the file before it cut off, its
    old content gone (a 4,096-byte trace on a full tmpfs). Now a regular file is replaced through a temporary file
    beside it: on failure the old file stays whole and no temporary file is left. The disk is made full by the
    process's file size limit (RLIMIT_FSIZE: a write past it fails with EFBIG, SIGXFSZ ignored)."""
    import resource
    import signal
    from plandsl.diagnostics import PlanError
    from plandsl.syntax import files
    out = tmp_path / "out.svg"
    out.write_text("old picture")
    limits, handler = resource.getrlimit(resource.RLIMIT_FSIZE), signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, limits[1]))
        with pytest.raises(PlanError) as error:
            files.write_output(str(out), "new picture " * 1000)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, handler)
    assert error.value.diagnostics[0].code == "E110" and "too large" in error.value.diagnostics[0].message
    assert out.read_text() == "old picture" and sorted(p.name for p in tmp_path.iterdir()) == ["out.svg"]


def test_an_output_or_a_formatted_plan_of_the_longest_name_is_written(tmp_path):
    """A file name of up to 255 bytes may be written; its temporary file `.NAME.XXXXXXXX.tmp` beside it was longer
    than that, so `-o` to such a name (new or there) was E110 'the path is too long for the file system' (with
    b1de3bc, which wrote in place before), and `fmt` of such a plan failed alike: the temporary file's name is cut."""
    from plandsl.syntax import files
    for name in ("a" * 250 + ".dot", "é" * 125 + ".dot"):  # 254 and 254 bytes
        out = tmp_path / name
        files.write_output(str(out), "new")
        files.write_output(str(out), "again")
        assert out.read_text() == "again"
        files.replace_file(str(out), "formatted")
        assert out.read_text() == "formatted"
    assert not [path.name for path in tmp_path.iterdir() if path.name.startswith(".")]


def test_an_output_keeps_its_links_bits_and_devices(tmp_path, monkeypatch):
    """Replaced through a temporary file: a link's target is replaced (the link kept), an existing file keeps its
    permission bits, a FIFO or device is written through (not replaced by a file), and a folder where no temporary
    file can be made (the user may write the file, not the folder) is written in place."""
    from plandsl.syntax import files
    target = tmp_path / "real.dot"
    target.write_text("old")
    target.chmod(0o640)
    link = tmp_path / "link.dot"
    link.symlink_to(target)
    files.write_output(str(link), "new")
    assert link.is_symlink() and target.read_text() == "new" and stat.S_IMODE(target.stat().st_mode) == 0o640
    fresh = tmp_path / "fresh.dot"
    files.write_output(str(fresh), b"bytes")
    assert fresh.read_bytes() == b"bytes"
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        files.write_output(str(fifo), "through")
        assert stat.S_ISFIFO(fifo.stat().st_mode) and os.read(reader, 100) == b"through"
    finally:
        os.close(reader)

    def refused(*args, **kwargs):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
    monkeypatch.setattr("tempfile.mkstemp", refused)
    files.write_output(str(target), "in place")
    assert target.read_text() == "in place"
    with pytest.raises(Exception) as error:  # a new file in such a folder cannot be made at all
        files.write_output(str(tmp_path / "new.dot"), "x")
    assert error.value.diagnostics[0].code == "E110"
