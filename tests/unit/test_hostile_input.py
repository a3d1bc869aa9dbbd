"""Hostile files and paths for every command that reads or writes one: each ends in a diagnostic
(or a usage error naming the option), exit 1 or 2, within seconds of CPU, never a traceback, and never
with the contents of a file outside the checked tree in the output.

Most cases run the CLI in-process (click's CliRunner: fast); a few run it as a real process to
measure its CPU time and peak memory. Tests run as root, for whom chmod 000 files are readable: permission
errors are simulated by a path through a file (`file.plan/x`: ENOTDIR) and by monkeypatching
`os.open`/`os.access` inside plandsl.syntax.files.
"""
from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner

from plandsl.syntax import files
from plandsl.check.analysis import analyze
from plandsl.cli import main
from plandsl.syntax.files import FileProblem, read_bounded, read_stdin, writable_dir, writable_file
from plandsl.syntax.loader import MAX_FILES, MAX_IMPORT_DEPTH, include
from plandsl.syntax.parser import MAX_BYTES
from support import HANG_S, bounded
from tests.conftest import STDLIB

SECRET = "PLANDSL_SECRET_7f3a9c"
PIPELINE = str(STDLIB / "local" / "pp_1f1b.plan")  # a small valid plan with a pipeline
LIMIT_S = 10.0


@pytest.fixture(scope="module")
def hostile(tmp_path_factory) -> dict[str, str]:
    """name -> path of each hostile input, in a project folder with an out-of-tree secret beside it."""
    base = tmp_path_factory.mktemp("hostile")
    outside, tree = base / "outside", base / "tree"
    outside.mkdir()
    tree.mkdir()
    (outside / "secret.plan").write_text(f"{SECRET} = 1\n")
    (outside / "secret.txt").write_text(f"{SECRET}\n")
    os.mkfifo(tree / "fifo.plan")
    os.mkfifo(tree / "fifo.csv")
    (tree / "dir.plan").mkdir()
    (tree / "dir.csv").mkdir()
    (tree / "zero.plan").symlink_to("/dev/zero")
    (tree / "zero.csv").symlink_to("/dev/zero")
    (tree / "secret_link.plan").symlink_to(outside / "secret.plan")
    for name in ("big.plan", "big.csv"):
        with open(tree / name, "wb") as handle:
            handle.truncate(100 * 2**20)  # sparse: 100 MB that take no disk
    (tree / "binary.plan").write_bytes(bytes(range(256)) * 64)
    (tree / "binary.csv").write_bytes(b"0F0,\x00\xff\xfe\n" * 10)
    (tree / "file.plan").write_text("let x = 1\n")
    paths = {name: str(tree / name) for name in os.listdir(tree)}
    paths.update({"/dev/zero": "/dev/zero", "/dev/null": "/dev/null", "/dev/urandom": "/dev/urandom",
                  "missing.plan": str(tree / "missing.plan"), "too_long.plan": str(tree / ("a" * 300 + ".plan")),
                  "through_a_file": str(tree / "file.plan" / "x.plan"), "tree": str(tree),
                  "outside": str(outside)})
    return paths


def invoke(*args: str, stdin: bytes | None = None):
    """The CLI in-process; the checks every hostile case shares."""
    with bounded(LIMIT_S, f"{args}"):
        result = CliRunner().invoke(main, list(args), input=stdin)
    output = result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), \
        f"{args}: raised {result.exception!r}\n{output[-2000:]}"
    assert "Traceback" not in output, output[-2000:]
    assert result.exit_code in (1, 2), f"{args}: exit {result.exit_code}\n{output[-2000:]}"
    assert SECRET not in output
    return result


# ---- every command that reads a plan, on every hostile file ----------------------------------------------
PLAN_INPUTS = ["/dev/zero", "/dev/null", "/dev/urandom", "fifo.plan", "dir.plan", "zero.plan", "big.plan",
               "binary.plan", "missing.plan", "too_long.plan", "through_a_file"]
EXPECTED_CODE = {"/dev/zero": "E107", "/dev/null": "E107", "/dev/urandom": "E107", "fifo.plan": "E107",
                 "dir.plan": "E107", "zero.plan": "E107", "big.plan": "E106", "binary.plan": "E105",
                 "missing.plan": "E208", "too_long.plan": "E109", "through_a_file": "E208"}
COMMANDS = {
    "check": lambda p: ["check", p],
    "check json": lambda p: ["check", "--format", "json", p],
    "show": lambda p: ["show", p],
    "fmt": lambda p: ["fmt", "--check", p],
    "simulate": lambda p: ["simulate", p],
    "estimate": lambda p: ["estimate", p],
    "render": lambda p: ["render", p, "--view", "mesh"],
    "generate --from": lambda p: ["generate", "--from", p],
    "shrink": lambda p: ["shrink", p],
    "run": lambda p: ["run", p],
    "run --dry-run": lambda p: ["run", "--dry-run", p],
    "schedule FILE.plan:NAME": lambda p: ["schedule", p + ":s"],
}


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("name", PLAN_INPUTS)
def test_every_command_refuses_every_hostile_plan_file(hostile, command, name):
    result = invoke(*COMMANDS[command](hostile[name]))
    expected = EXPECTED_CODE[name]
    if command.startswith("schedule") and not hostile[name].endswith(".plan"):
        expected = "E601"  # not FILE.plan:NAME: an unknown built-in schedule
    if name == "dir.plan" and result.exit_code == 2:  # click refuses a directory for a FILE argument
        assert "is a directory" in result.output
        return
    assert f"[{expected}]" in result.output or f'"code": "{expected}"' in result.output, result.output[-1500:]


@pytest.mark.parametrize("name", ["fifo.csv", "dir.csv", "zero.csv", "big.csv", "binary.csv", "missing.csv"])
def test_schedule_refuses_every_hostile_csv(hostile, name):
    path = hostile.get(name) or str(Path(hostile["tree"]) / name)
    result = invoke("schedule", path)
    expected = {"fifo.csv": "E107", "dir.csv": "E107", "zero.csv": "E107", "big.csv": "E106",
                "binary.csv": "E105", "missing.csv": "E208"}[name]
    assert result.exit_code == 1 and f"[{expected}]" in result.output, result.output


def test_fmt_stdin_reads_at_most_the_limit():
    result = invoke("fmt", "-", stdin=b"# " + b"x" * (MAX_BYTES + 10))
    assert result.exit_code == 1 and "[E106]" in result.output and "standard input" in result.output


def test_check_goes_on_after_a_bad_file_and_json_says_so(hostile):
    result = invoke("check", "--format", "json", hostile["dir.plan"], hostile["/dev/zero"], PIPELINE)
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["code"] for r in records if r["severity"] == "error"] == ["E107", "E107"]
    # each line names the file it is about, as every other diagnostic does
    assert [r["location"]["file"] for r in records] == [hostile["dir.plan"], hostile["/dev/zero"]]
    missing = invoke("check", "--format", "json", hostile["missing.plan"], hostile["too_long.plan"])
    (found, too_long) = [json.loads(line) for line in missing.stdout.splitlines()]
    assert found["code"] == "E208" and found["location"]["file"] == hostile["missing.plan"]
    assert too_long["code"] == "E109" and too_long["location"] is None  # the path itself is the problem: not echoed
    result = invoke("check", hostile["big.plan"], PIPELINE)
    assert "[E106]" in result.output and "pp_1f1b.plan: ok" in result.output, result.output


# ---- imports -----------------------------------------------------------------------------------------------
def _importing(tree: str, name: str, target: str) -> str:
    path = Path(tree) / f"{name}.plan"
    path.write_text(f'import "clusters/local"\nimport "{target}"\nlet y = 1\n')
    return str(path)


IMPORTS = {  # import "..." -> the code it gives
    "/proc/self/environ": "E214", "/etc/shadow": "E214", "/etc/passwd.plan": "E214", "../../../etc/x": "E214",
    "../outside/secret": "E214", "secret_link": "E214", "zero": "E214", "fifo": "E107", "dir": "E107",
    "big": "E106", "a" * 300: "E109", "file.plan/x": "E208", "/dev/zero": "E214",
}


@pytest.mark.parametrize("target", list(IMPORTS), ids=lambda t: t[:20])
def test_imports_outside_the_tree_or_not_files_are_refused_at_the_import_line(hostile, target):
    path = _importing(hostile["tree"], "importer", target)
    result = invoke("check", path)
    code = IMPORTS[target]
    assert f"importer.plan:2:1: error[{code}]" in result.output, result.output
    assert f'2 | import "{target[:60]}' in result.output  # the import line is shown, never the target's
    if code == "E214":
        assert "--include" in result.output


def test_include_and_plandsl_path_open_a_folder(hostile, monkeypatch):
    path = _importing(hostile["tree"], "uses_outside", "secret.plan")
    assert [d.code for d in analyze(path).errors] == ["E208"]  # not in the tree, not looked up elsewhere
    with include([hostile["outside"]]):
        analysis = analyze(path)
    assert analysis.errors and analysis.errors[0].code == "E101"  # now read: the secret file is no plan
    monkeypatch.setenv("PLANDSL_PATH", os.pathsep.join(["/nonexistent", hostile["outside"]]))
    assert analyze(path).errors[0].code == "E101"
    monkeypatch.delenv("PLANDSL_PATH")
    result = CliRunner().invoke(main, ["check", path, "--include", hostile["outside"]])
    assert result.exit_code == 1 and "[E101]" in result.output


def test_a_link_inside_the_tree_to_a_file_inside_is_fine(tmp_path):
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "sizes.plan").write_text("let width = 64\n")
    (tmp_path / "sizes.plan").symlink_to(tmp_path / "lib" / "sizes.plan")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.plan").write_text('import "../sizes"\nlet y = width\n')
    (tmp_path / "main.plan").write_text('import "sub/a"\nimport "sizes"\nlet z = width\n')
    assert analyze(str(tmp_path / "main.plan")).ok
    # the same subfolder file checked on its own: its parent is outside its tree
    assert [d.code for d in analyze(str(tmp_path / "sub" / "a.plan")).errors][:1] == ["E214"]


def test_an_import_chain_of_500_files_is_bounded(tmp_path):
    for i in range(500):
        (tmp_path / f"f{i}.plan").write_text(f'import "f{i + 1}"\n' if i < 499 else "let x = 1\n")
    with bounded(LIMIT_S, "analyze"):
        analysis = analyze(str(tmp_path / "f0.plan"))
    assert [d.code for d in analysis.errors] == ["E106"]
    assert f"more than {MAX_IMPORT_DEPTH} deep" in analysis.errors[0].message


def test_too_many_files_is_reported_once(tmp_path):
    count = MAX_FILES + 10
    (tmp_path / "root.plan").write_text("".join(f'import "w{i}"\n' for i in range(count)))
    for i in range(count):
        (tmp_path / f"w{i}.plan").write_text(f"let x{i} = 1\n")
    errors = analyze(str(tmp_path / "root.plan")).errors
    assert [d.code for d in errors] == ["E106"] and f"more than {MAX_FILES} files" in errors[0].message


# ---- outputs and launch arguments: refused before any work, naming the option -----------------------------
def _outputs(hostile) -> dict[str, str]:
    return {"through a file": str(Path(hostile["file.plan"]) / "out"), "a directory": hostile["dir.plan"],
            "missing folder": str(Path(hostile["tree"]) / "no" / "such" / "out"),
            "too long": str(Path(hostile["tree"]) / ("o" * 300))}


OUTPUT_OPTIONS = {
    "render -o": (["render", PIPELINE, "--view", "mesh", "-o"], "-o"),
    "generate -o": (["generate", "--from", PIPELINE, "-o"], "-o"),
    "shrink -o": (["shrink", PIPELINE, "-o"], "-o"),
    "profile -o": (["profile", "--quick", "-o"], "-o"),
    "simulate --trace": (["simulate", PIPELINE, "--trace"], "--trace"),
    "schedule --trace": (["schedule", "1f1b", "--ranks", "2", "--microbatches", "4", "--simulate", "--trace"],
                         "--trace"),
    "run --metrics": (["run", PIPELINE, "--metrics"], "--metrics"),
    "run --checkpoint-dir": (["run", PIPELINE, "--checkpoint-dir"], "--checkpoint-dir"),
}


@pytest.mark.parametrize("option", list(OUTPUT_OPTIONS))
@pytest.mark.parametrize("where", ["through a file", "a directory", "missing folder", "too long"])
def test_unwritable_outputs_are_usage_errors_before_work(hostile, option, where):
    args, name = OUTPUT_OPTIONS[option]
    target = _outputs(hostile)[where]
    if option == "run --checkpoint-dir" and where in ("a directory", "missing folder"):
        target = str(Path(hostile["binary.plan"]) / "ck")  # a directory is what it wants, a missing one is made
    result = invoke(*args, target)
    assert result.exit_code == 2 and f"'{name}'" in result.output, result.output


RUN_ARGUMENTS = {
    "node rank past the nodes": (["--nnodes", "2", "--node-rank", "5", "--rdzv-endpoint", "h:1"], "--node-rank"),
    "endpoint without a port": (["--nnodes", "2", "--rdzv-endpoint", "host"], "--rdzv-endpoint"),
    "endpoint port out of range": (["--nnodes", "2", "--rdzv-endpoint", "host:70000"], "--rdzv-endpoint"),
    # these passed the check and torchrun refused them: E108 (ValueError), or its own usage error for "-x:5"
    "endpoint a port of other digits": (["--nnodes", "2", "--rdzv-endpoint", "host:\u00b2"], "--rdzv-endpoint"),
    "endpoint bracket unclosed": (["--nnodes", "2", "--rdzv-endpoint", "[::1"], "--rdzv-endpoint"),
    "endpoint host with a space": (["--nnodes", "2", "--rdzv-endpoint", "x y:5"], "--rdzv-endpoint"),
    "endpoint host an option": (["--nnodes", "2", "--rdzv-endpoint", "-x:5"], "--rdzv-endpoint"),
    # these started the ranks, which failed building the job: ValueError (nan), OverflowError (inf), c10's timeout (-5)
    **{f"timeout {value}": (["--timeout", value], "--timeout") for value in ("nan", "inf", "1e400", "-5", "0")},
    "data a device": (["--data", "/dev/zero"], "--data"),
    "data a FIFO": (["--data", "fifo.plan"], "--data"),
    "data a directory": (["--data", "dir.plan"], "--data"),
    "data too short": (["--data", "file.plan"], "--data"),
    "data out of vocab": (["--data", "binary.plan"], "--data"),
    "include missing": (["--include", "no/such/dir"], "--include"),
}


@pytest.mark.parametrize("case", list(RUN_ARGUMENTS))
@pytest.mark.parametrize("dry", [False, True])
def test_run_refuses_bad_launch_arguments_before_starting(hostile, case, dry):
    args, name = RUN_ARGUMENTS[case]
    args = [hostile.get(a, a) if a in ("fifo.plan", "dir.plan", "file.plan", "binary.plan") else a for a in args]
    result = invoke("run", PIPELINE, *args, *(["--dry-run"] if dry else []))
    assert result.exit_code == 2 and name in result.output, result.output


def test_a_token_file_larger_than_the_address_space_left_is_checked_in_pieces(tmp_path):
    """A sparse 2 GiB token file under `ulimit -v 1500000`: the vocab check mapped it whole (OSError ENOMEM, E108);
    read in 32 MiB pieces it is a valid file, and one out-of-vocab id at its end is still found."""
    tokens = tmp_path / "big.bin"
    with open(tokens, "wb") as handle:
        handle.truncate(2 * 2**30)  # token id 0 throughout: no disk taken
    check = (f"from plandsl import api; from plandsl.runtime.tokens import token_file_problem; "
             f"print(token_file_problem({str(tokens)!r}, api.load_plan({PIPELINE!r})))")
    result = subprocess.run(["bash", "-c", f"ulimit -v 1500000; exec {sys.executable} -c \"$0\"", check],
                            capture_output=True, text=True, timeout=HANG_S, cwd=tmp_path)
    assert result.returncode == 0 and result.stdout.strip() == "None", result.stderr[-2000:]
    with open(tokens, "r+b") as handle:
        handle.seek(2 * 2**30 - 2)
        handle.write((60000).to_bytes(2, "little"))
    result = subprocess.run(["bash", "-c", f"ulimit -v 1500000; exec {sys.executable} -c \"$0\"", check],
                            capture_output=True, text=True, timeout=HANG_S, cwd=tmp_path)
    assert "token id 60000 is outside the model's vocab" in result.stdout, result.stderr[-2000:]


# ---- the reader itself --------------------------------------------------------------------------------------
def test_kernel_files_that_report_size_zero_are_refused(monkeypatch):
    # /proc files are "regular" and report size 0: only the read tells their length and that they have content
    with pytest.raises(FileProblem) as caught:
        read_bounded("/proc/self/status", 10)
    assert caught.value.code == "E106"  # stopped at the limit
    monkeypatch.setenv(SECRET, SECRET)
    with pytest.raises(FileProblem) as caught:
        read_bounded("/proc/self/environ", 1 << 20)
    assert caught.value.code == "E107" and SECRET not in str(caught.value)
    result = invoke("check", "/proc/self/environ")  # named on the command line: refused all the same, unquoted
    assert "[E107]" in result.output


def test_reader_never_blocks_on_a_fifo(tmp_path):
    """Opening a FIFO that no one writes blocks for ever: the reader must refuse it without opening it.
    Judged by whether the read returns at all (in a thread, given HANG_S of wall time, however loaded
    the machine), not by how fast it does."""
    os.mkfifo(tmp_path / "p")
    outcome: list[BaseException] = []

    def read() -> None:
        try:
            read_bounded(tmp_path / "p", 100)
        except BaseException as error:  # noqa: BLE001 - handed to the test
            outcome.append(error)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(HANG_S)
    if reader.is_alive():  # blocked in open(): a writer end releases it, then the test fails
        os.close(os.open(tmp_path / "p", os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail(f"reading a FIFO blocked for {HANG_S:g} s")
    (error,) = outcome
    assert isinstance(error, FileProblem), error
    assert error.code == "E107" and "FIFO" in error.message


def test_permission_errors_are_E109(tmp_path, monkeypatch):
    (tmp_path / "a.plan").write_text("let x = 1\n")

    def refuse(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")
    monkeypatch.setattr(files.os, "open", refuse)
    with pytest.raises(FileProblem) as caught:
        read_bounded(tmp_path / "a.plan", 100, "plan file")
    assert caught.value.code == "E109" and "Permission denied" in caught.value.message
    assert [d.code for d in analyze(str(tmp_path / "a.plan")).errors] == ["E109"]


def test_unwritable_paths_say_why(tmp_path, monkeypatch):
    (tmp_path / "f").write_text("")
    assert writable_file(str(tmp_path / "new.txt")) is None
    assert writable_file("/dev/null") is None  # devices are written as asked
    assert "directory" in writable_file(str(tmp_path))
    assert "is a file" in writable_file(str(tmp_path / "f" / "x"))
    assert writable_dir(str(tmp_path / "a" / "b")) is None  # made when needed
    assert "not a directory" in writable_dir(str(tmp_path / "f"))
    monkeypatch.setattr(files.os, "access", lambda *a, **k: False)
    assert "not writable" in writable_file(str(tmp_path / "f"))
    assert "not writable" in writable_dir(str(tmp_path))


def test_stdin_is_read_bounded():
    class Endless:
        def __init__(self):
            self.given = 0

        def read(self, size):
            self.given += size
            return b"x" * size
    stream = Endless()
    with pytest.raises(FileProblem):
        read_stdin(stream, 1000)
    assert stream.given == 1001


# ---- a few real processes: exit status, CPU time and peak memory -------------------------------------------
# The child's own CPU time and peak resident memory (its rusage, from the measuring process, which has no
# other child), not wall time: with other test runs sharing the cores a quick process can take many times
# its CPU time in wall time. The wall-clock timeout only stops a hang.
_MEASURE = textwrap.dedent(f"""
    import resource, subprocess, sys
    stdin = open(sys.argv[1], "rb") if sys.argv[1] != "-" else subprocess.DEVNULL
    done = subprocess.run([sys.executable, "-m", "plandsl.cli", *sys.argv[2:]], stdin=stdin,
                          capture_output=True, text=True, timeout={HANG_S})
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(done.returncode, usage.ru_maxrss, usage.ru_utime + usage.ru_stime)  # KiB on Linux, CPU seconds
    sys.stderr.write(done.stdout + done.stderr)
""")


@pytest.mark.parametrize("stdin, args", [
    ("-", ["check", "/dev/zero"]),
    ("-", ["check", "zero.plan"]),
    ("-", ["estimate", "big.plan"]),
    ("/dev/zero", ["fmt", "-"]),
    ("-", ["schedule", "zero.csv"]),
    ("-", ["run", "--dry-run", "importer_proc.plan"]),
], ids=["check-dev-zero", "check-link-to-zero", "estimate-100MB", "fmt-stdin-zero", "schedule-csv-zero",
        "run-dry-run-proc-import"])
def test_real_processes_answer_quickly_in_little_memory(hostile, stdin, args):
    tree = hostile["tree"]
    _importing(tree, "importer_proc", "/proc/self/environ")
    result = subprocess.run([sys.executable, "-c", _MEASURE, stdin, *args], cwd=tree, capture_output=True,
                            text=True, timeout=HANG_S + 60, env={**os.environ, SECRET: SECRET})
    status, peak_kib, cpu_s = result.stdout.split()
    assert int(status) in (1, 2), result.stderr
    assert "Traceback" not in result.stderr and SECRET not in result.stderr, result.stderr[-2000:]
    assert "error[E" in result.stderr, result.stderr[-2000:]
    assert float(cpu_s) < LIMIT_S, f"the process used {float(cpu_s):.1f} s of CPU"
    assert int(peak_kib) < 2**20, f"peak {int(peak_kib) / 1024:.0f} MiB"  # under 1 GiB


def test_generate_reads_a_model_file_named_on_the_command_line_wherever_it_is(tmp_path, monkeypatch):
    from plandsl.search.emit import resolve_problem
    (tmp_path / "models").mkdir()
    (tmp_path / "work").mkdir()
    (tmp_path / "models" / "m.plan").write_text("model mm = gpt(layers=4, hidden=256, heads=8, seq=128, vocab=1024)\n")
    monkeypatch.chdir(tmp_path / "work")  # the file is outside the working directory's tree: named, so read
    problem, _ = resolve_problem(f"{tmp_path / 'models' / 'm.plan'}:mm", "dgx_a100 x 1", 8)
    assert problem.model.layers == 4
    result = invoke("generate", "--model", f"{'a' * 300}.plan:mm", "--cluster", "dgx_a100 x 1", "--global-batch", "8")
    assert result.exit_code == 1 and "cannot read model file" in result.output


def test_the_parse_stops_at_the_token_limit(monkeypatch):
    from plandsl.syntax import parser
    monkeypatch.setattr(parser, "MAX_TOKENS", 1000)
    analysis = analyze(text="let x = [" + "1, " * 600 + "1]\n")
    (error,) = analysis.errors
    assert error.code == "E106" and "more than 1,000 tokens" in error.message and error.span.column > 1000
    assert analyze(text="let x = [" + "1, " * 400 + "1]\n").ok


@pytest.mark.parametrize("option", ["--metrics", "--checkpoint-dir"])
def test_the_rank_entry_point_refuses_unwritable_outputs_too(hostile, option, capsys):
    from plandsl.runtime.options import parse_args
    with pytest.raises(SystemExit) as caught:
        parse_args([PIPELINE, option, str(Path(hostile["file.plan"]) / "out")])
    assert caught.value.code == 2 and f"{option} " in capsys.readouterr().err


@pytest.mark.parametrize("value", ["nan", "inf", "-5", "0"])
def test_the_rank_entry_point_refuses_a_timeout_that_is_no_wait(value, capsys):
    """The ranks' own parser (`python -m plandsl.run`, what torchrun starts) refuses what `plandsl run` does."""
    from plandsl.runtime.options import parse_args
    with pytest.raises(SystemExit) as caught:
        parse_args([PIPELINE, "--timeout", value])
    assert caught.value.code == 2 and "--timeout" in capsys.readouterr().err
    assert parse_args([PIPELINE, "--timeout", "600"]).timeout == 600


def test_run_passes_include_folders_on_to_the_ranks(tmp_path):
    from plandsl import api
    from plandsl.runtime.options import parse_args
    from plandsl.runtime.launch import LaunchOptions, torchrun_args
    plan = api.load_plan(PIPELINE)
    with include([tmp_path]):
        args = torchrun_args(plan, PIPELINE, None, {}, LaunchOptions())
    assert args[args.index("--include") + 1] == str(tmp_path)
    assert parse_args(args[args.index("plandsl.run") + 1:]).include == [str(tmp_path)]


@pytest.mark.parametrize("source", ["megatron", "torchtitan", "deepspeed"])
def test_an_args_file_that_cannot_be_read_is_named_as_one_not_as_a_plan_file(tmp_path, source):
    """`import --args-file /dev/zero` said "plan file /dev/zero is a character device": it is the flags (or the
    DeepSpeed config) the import reads."""
    model = ["--model", "gpt2_medium"] if source == "deepspeed" else []
    for path, words in (("/dev/zero", "args file /dev/zero is a character device"),
                        (str(tmp_path / "missing.sh"), "cannot read args file")):
        result = CliRunner().invoke(main, ["import", "--from", source, "--world-size", "8", *model, "--args-file", path,
                                           "-o", str(tmp_path / "x.plan")])
        assert result.exit_code == 1 and words in result.output and "plan file" not in result.output, result.output


@pytest.mark.parametrize("command", [["render", "stdlib_plans/examples/fsdp.plan", "--view", "mesh", "--format", "dot"],
                                     ["export", "stdlib_plans/examples/fsdp.plan", "--to", "megatron"]])
def test_an_output_named_by_non_utf8_bytes_is_written(tmp_path, monkeypatch, command):
    """`-o $'\\xff.svg'` (a name of bytes that are not UTF-8, which Python's argv holds as surrogates) raised
    UnicodeEncodeError in the option's check, a traceback before any command ran; the name is its bytes."""
    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    out = os.fsdecode(os.fsencode(str(tmp_path)) + b"/\xff.out")
    result = CliRunner().invoke(main, [*command, "-o", out])
    assert result.exit_code == 0 and result.exception is None, result.output
    assert (tmp_path / os.fsdecode(b"\xff.out")).exists()


def test_a_plan_or_csv_at_a_non_utf8_path_is_written_about_in_escapes(tmp_path):
    """`shrink` of a plan whose path holds bytes that are not UTF-8 wrote the path into its header comment and
    failed to parse its own text (E108 UnicodeEncodeError); `import --from torch-csv` of such a CSV was a usage
    error quoting the codec. Their headers now write the bytes as \\xNN."""
    folder = os.fsdecode(os.fsencode(str(tmp_path)) + b"/s\xffd")
    os.mkdir(folder)
    plan = os.path.join(folder, os.fsdecode(b"t\xfe.plan"))
    Path(plan).write_text('import "clusters/local"\nplan p {\n  model = gpt(layers=2, hidden=64, heads=4, seq=32, '
                          'vocab=256)\n  cluster = localhost\n  mesh = [dp = 2] over devices[0:2]\n'
                          '  train = { global_batch: 4, micro_batch: 1, precision: fp32 }\n}\n')
    out = tmp_path / "small.plan"
    result = CliRunner().invoke(main, ["shrink", plan, "-o", str(out)])
    assert result.exit_code == 0 and "E108" not in result.output, result.output
    assert "s\\xffd/t\\xfe.plan" in out.read_text()
    csv = os.path.join(folder, os.fsdecode(b"c\xfe.csv"))
    Path(csv).write_text("0F0,0B0\n")
    result = CliRunner().invoke(main, ["import", "--from", "torch-csv", "--args-file", csv, "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "c\\xfe.csv" in out.read_text()


def test_text_no_utf8_file_holds_is_e105_when_parsed():
    from plandsl.diagnostics import PlanError
    from plandsl.syntax.parser import parse_text
    with pytest.raises(PlanError) as raised:
        parse_text('# from /tmp/\udcff\nplan p { }\n')
    assert [d.code for d in raised.value.diagnostics] == ["E105"]


def test_a_message_quoting_a_huge_value_shows_its_start_and_how_much_more():
    """An unknown flag of 100,000 characters: the text rendering shows the message's first 1,000 characters and
    says how many more there are (it echoed all of them, and as much again in the hint's and the line's), while
    `--format json` keeps the whole message."""
    from plandsl.diagnostics import MAX_SHOWN_TEXT, Diagnostic, render
    from plandsl.interop import import_text
    flag = "--unknown-" + "x" * 100_000
    imported = import_text("megatron", f"{flag} 3\n", "long.args", world_size=8, cluster="dgx_a100 x 1")
    found = next(d for d in imported.diagnostics if d.code == "E804")
    assert isinstance(found, Diagnostic) and flag in found.message  # whole, as the JSON form carries it
    shown = render(found, imported.sources)
    assert len(shown) < 3 * MAX_SHOWN_TEXT and f"({len(found.message) - MAX_SHOWN_TEXT:,} more characters)" in shown


def test_a_path_with_a_line_break_stays_in_its_comment(tmp_path):
    """A CSV named `b<newline>param evil = 1<newline>#.csv` made `import --from torch-csv` write `param evil = 1` as
    a line of the plan (exit 0), and an `-o` name with a newline did the same through the header's import line;
    `shrink` of a plan at such a path failed on its own text (E101). Line breaks and control characters in a path
    are now written as escapes, as non-UTF-8 bytes are."""
    csv = tmp_path / "b\nparam evil = 1\n#.csv"
    csv.write_text("0F0,0B0\n")
    out = tmp_path / "o.plan"
    result = CliRunner().invoke(main, ["import", "--from", "torch-csv", "--args-file", str(csv), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "\nparam evil" not in out.read_text() and "b\\x0aparam evil = 1\\x0a#.csv" in out.read_text()
    named = tmp_path / "r\nparam z = 2\n#.plan"
    result = CliRunner().invoke(main, ["import", "--from", "torch-csv", "--args-file", str(tmp_path / "ok.csv"),
                                       "-o", str(named)]) if (tmp_path / "ok.csv").write_text("0F0,0B0\n") else None
    assert result.exit_code == 0 and "\nparam z" not in named.read_text(), result.output
    folder = tmp_path / "sh\ny"
    folder.mkdir()
    plan = folder / "x.plan"
    plan.write_text('import "clusters/local"\nplan p {\n  model = gpt(layers=2, hidden=64, heads=4, seq=32, '
                    'vocab=256)\n  cluster = localhost\n  mesh = [dp = 2] over devices[0:2]\n'
                    '  train = { global_batch: 4, micro_batch: 1, precision: fp32 }\n}\n')
    result = CliRunner().invoke(main, ["shrink", str(plan), "-o", str(tmp_path / "small.plan")])
    assert result.exit_code == 0 and "sh\\x0ay/x.plan" in (tmp_path / "small.plan").read_text(), result.output
