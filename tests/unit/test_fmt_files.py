"""`plandsl fmt FILE...`: each file on its own. A file that cannot be read (missing, a directory),
parsed, written, or on which plandsl itself fails (E108) is reported, and the later files are still
formatted (or compared, with `--check`); the exit status is the worst outcome (1 when any file failed
or, with `--check`, would change)."""
from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from plandsl import api
from plandsl.cli import main
from plandsl.syntax import format as syntax_format
from support import VALID_PLAN

TIDY = api.format_text(VALID_PLAN)
MESSY = TIDY.replace("model    = ", "model=").replace("mesh     = ", "mesh =  ")
assert MESSY != TIDY


@pytest.fixture
def files(tmp_path: Path) -> dict[str, str]:
    """One bad file of each kind, then two messy plans and a formatted one after them."""
    (tmp_path / "parse_error.plan").write_text("plan x {\n  bad bad\n")
    (tmp_path / "a_directory.plan").mkdir()
    (tmp_path / "binary.plan").write_bytes(b"\xff\xfe\x00plan")
    for name in ("messy1", "messy2", "bug"):
        (tmp_path / f"{name}.plan").write_text(MESSY.replace("plan p {", f"plan {name} {{"))
    (tmp_path / "tidy.plan").write_text(TIDY)
    names = ["parse_error", "a_directory", "missing", "binary", "messy1", "bug", "messy2", "tidy"]
    return {name: str(tmp_path / f"{name}.plan") for name in names}


def _run(*args: str):
    result = CliRunner().invoke(main, list(args))
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    return result


def test_a_bad_file_does_not_stop_formatting_the_later_ones(files):
    bad = [files[name] for name in ("parse_error", "a_directory", "missing", "binary")]
    result = _run("fmt", *bad, files["messy1"], files["messy2"], files["tidy"])
    assert result.exit_code == 1
    assert "E101" in result.output and "E107" in result.output and "E208" in result.output
    assert "E105" in result.output  # not UTF-8
    assert Path(files["messy1"]).read_text() == TIDY.replace("plan p {", "plan messy1 {")
    assert Path(files["messy2"]).read_text() == TIDY.replace("plan p {", "plan messy2 {")
    assert f"{files['messy1']}: reformatted" in result.output
    assert f"{files['tidy']}: reformatted" not in result.output


def test_check_compares_every_file_and_fails_on_the_worst(files):
    result = _run("fmt", "--check", files["missing"], files["messy1"], files["tidy"])
    assert result.exit_code == 1
    assert "E208" in result.output and f"{files['messy1']}: would reformat" in result.output
    assert Path(files["messy1"]).read_text() == MESSY.replace("plan p {", "plan messy1 {")  # unchanged
    assert _run("fmt", "--check", files["missing"], files["tidy"]).exit_code == 1  # a failure alone: 1
    assert _run("fmt", "--check", files["tidy"]).exit_code == 0


def test_a_plandsl_bug_on_one_file_is_e108_for_it_and_the_others_are_formatted(files, monkeypatch):
    real = syntax_format.format_module

    def format_module(module):
        if "bug.plan" in module.file:
            raise RuntimeError("boom in the formatter")
        return real(module)
    monkeypatch.setattr(syntax_format, "format_module", format_module)
    result = _run("fmt", files["messy1"], files["bug"], files["messy2"])
    assert result.exit_code == 1
    assert f"{files['bug']}:1:1: error[E108]: internal error: RuntimeError: boom in the formatter" in result.output
    assert Path(files["bug"]).read_text() == MESSY.replace("plan p {", "plan bug {")  # left as it was
    for name in ("messy1", "messy2"):
        assert Path(files[name]).read_text() == TIDY.replace("plan p {", f"plan {name} {{")
    check = _run("fmt", "--check", files["bug"], files["tidy"])
    assert check.exit_code == 1 and "E108" in check.output


def test_a_file_that_cannot_be_written_is_reported_and_the_next_is_written(files, monkeypatch):
    real_mkstemp = tempfile.mkstemp

    def refusing_mkstemp(*args, prefix="", **kwargs):  # fmt writes through a temporary file beside the plan
        if prefix.startswith(".messy1.plan"):
            raise PermissionError(13, "Permission denied", prefix)
        return real_mkstemp(*args, prefix=prefix, **kwargs)
    monkeypatch.setattr(tempfile, "mkstemp", refusing_mkstemp)
    result = _run("fmt", files["messy1"], files["messy2"])
    assert result.exit_code == 1
    assert f"{files['messy1']}:1:1: error[E110]: cannot write {files['messy1']}: Permission denied" in result.output
    assert "= hint: the system refuses to write there" in result.output
    assert Path(files["messy2"]).read_text() == TIDY.replace("plan p {", "plan messy2 {")


# ---- the rewrite is atomic: a temporary file beside the plan, fsynced, then os.replace over it ---------------
def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_a_failure_between_write_and_replace_leaves_the_original(files, monkeypatch):
    messy = MESSY.replace("plan p {", "plan messy1 {")

    def failing_replace(source, target):
        assert Path(source).read_text() == TIDY.replace("plan p {", "plan messy1 {")  # written in full, then
        raise OSError(28, "No space left on device")                                    # the rename fails
    monkeypatch.setattr(os, "replace", failing_replace)
    result = _run("fmt", files["messy1"], files["tidy"])
    assert result.exit_code == 1
    assert f"{files['messy1']}:1:1: error[E110]: cannot write {files['messy1']}: No space left on device" \
        in result.output and "= hint: the disk (or your quota) is full" in result.output
    assert Path(files["messy1"]).read_text() == messy  # untouched
    assert _leftovers(Path(files["messy1"]).parent) == []  # and no temporary file left behind


def test_the_rewritten_file_keeps_its_permission_bits(files):
    os.chmod(files["messy1"], 0o640)
    os.chmod(files["messy2"], 0o604 | stat.S_ISGID)
    assert _run("fmt", files["messy1"], files["messy2"]).exit_code == 0
    assert stat.S_IMODE(os.stat(files["messy1"]).st_mode) == 0o640
    assert stat.S_IMODE(os.stat(files["messy2"]).st_mode) == 0o604 | stat.S_ISGID
    assert Path(files["messy1"]).read_text() == TIDY.replace("plan p {", "plan messy1 {")
    assert _leftovers(Path(files["messy1"]).parent) == []


def test_a_symlinked_plan_stays_a_link_and_its_target_is_rewritten(files, tmp_path):
    (tmp_path / "elsewhere").mkdir()
    link = tmp_path / "elsewhere" / "link.plan"
    link.symlink_to(files["messy1"])
    result = _run("fmt", str(link))
    assert result.exit_code == 0 and f"{link}: reformatted" in result.output
    assert link.is_symlink() and os.readlink(link) == files["messy1"]
    assert Path(files["messy1"]).read_text() == TIDY.replace("plan p {", "plan messy1 {")
    assert _leftovers(tmp_path / "elsewhere") == [] and _leftovers(tmp_path) == []
