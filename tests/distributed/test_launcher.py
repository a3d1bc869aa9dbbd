"""`plandsl run` end to end: the real launcher (torch.distributed.run) in a subprocess.

Most multi-process tests fork their ranks (harness.py); these start `plandsl run` as a user would,
so they cover what forking skips: the command line, the check before launching (a bad or refused
plan never starts a process), torchrun's process management, the launcher's failure message
(the failed rank, its step and phase or pipeline action, the schedule grid), checkpoints left by a
killed job, two launchers joining as two nodes, and the dry run. Each torchrun start costs seconds
(each rank a fresh process importing torch: a launch of 2 ranks ~13-25 s of one worker), so two runs go
through the real torchrun: the killed pipeline rank (several ranks, a pipeline, the failure path, checkpoints)
and the two nodes (a run that trains to the end, a rendezvous, the equivalence report). The rank that raises
and the Hugging Face model run `plandsl run` in this process with torchrun's `run` stood in for by forked
ranks of `plandsl.run.main` (`torchrun_forking`): the command line, the check, the launcher's arguments, its
fault directory and its message are `plandsl run`'s own, only the rank processes are forked. Every subprocess
has a timeout, so a hang fails instead of blocking, and runs in a session of its own, so that its ranks are ended
with it (tests.support.run_group).
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from plandsl import api
from plandsl.cli import main
from tests.conftest import ROOT
from tests.distributed import ranks
from tests.distributed.harness import free_port, run_failing_ranks, run_ranks
from tests.support import group_alive, lazy, run_group, start_group, stop_group

checkpoint = lazy("plandsl.runtime.checkpoint")
runtime_reference = lazy("plandsl.runtime.reference")

# the 'torch' group (tests/conftest.py): seven of its ten tests import torch in this process (the one-process
# `reference`, torchrun's stand-in and its forked ranks, the checkpoint read back, the dry run), so its worker pays
# for torch, and the module-scoped `reference` is trained once, on that worker
pytestmark = [pytest.mark.dist, pytest.mark.xdist_group("torch")]

STEPS = 3
# hang guards only (a run that ends is judged by its output): one launch of 2 ranks takes ~10 s on the quiet
# 2-core machine, a command that only checks the plan ~1 s; with other runs or xdist workers sharing the
# cores both stretch several-fold
TIMEOUT_S = 300
CHECK_ONLY_S = 120
DP = "stdlib_plans/local/dp.plan"
PP = "stdlib_plans/local/pp_1f1b.plan"
METRIC_KEYS = {"step", "loss", "step_time_s", "tokens_per_s", "peak_memory_bytes"}


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PLANDSL_FAULT")}
    env.update(PYTHONUNBUFFERED="1", **extra)
    return env


def plandsl_run(*args, timeout: float = TIMEOUT_S, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`plandsl run ARGS` from the repository root; stdout and stderr together in `.output`."""
    command = [sys.executable, "-m", "plandsl.cli", "run", *map(str, args)]
    start = time.monotonic()
    try:
        done = run_group(command, cwd=ROOT, env=env or _env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, timeout=timeout)  # on the timeout, torchrun's ranks are ended with it
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"`plandsl run {' '.join(map(str, args))}` did not finish within {timeout} s:\n"
                    f"{error.output or ''}")
    done.output, done.elapsed = done.stdout, time.monotonic() - start
    return done


def _plan(path):
    (plan,) = api.load(ROOT / path).plans
    return plan


def _metrics(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _assert_close(got: list[float], want: list[float], what: str) -> None:
    assert len(got) == len(want), (what, got, want)
    for step, (a, b) in enumerate(zip(got, want), start=1):
        assert abs(a - b) <= 1e-5 * abs(b), (what, step, a, b)


@pytest.fixture(scope="module")
def reference():
    """The tiny GPT trained in this process; every local dense plan gives these losses."""
    return runtime_reference.run_reference(_plan(DP), STEPS)


@pytest.fixture(scope="module")
def reference_losses(reference):
    return reference.losses


def _rank_runs(rank: int, argv: list[str], output: str) -> None:
    """A forked rank of `torchrun_forking`: what `python -m plandsl.run ARGV` runs on each rank torchrun starts
    (`plandsl.run.entry`: `main`, then the process left with its status, a traceback printed and status 1 where it
    raised), its stdout and stderr into OUTPUT/rank{R}.out and .err (a rank forked from a forkserver has the
    server's, not this test's; CliRunner's streams, which a fork copied, would keep it), its progress record made in
    it (`faults.progress`: from RANK, the launcher's fault directory and the test hook), not one the test process
    made, and SIGTERM (the launcher's stop) ending it as it ends a fresh process."""
    import sys

    from plandsl import run
    from plandsl.runtime import faults
    from plandsl.runtime.leave import run_then_leave
    for fd, stream in ((1, "out"), (2, "err")):
        file = os.open(os.path.join(output, f"rank{rank}.{stream}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(file, fd)
        os.close(file)
    sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    faults._PROGRESS = None
    run_then_leave(lambda: run.main(argv))


_RANK_ENV = {"MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK"}
"""What the harness sets on each rank, as torchrun does (`harness._rank_main`), not taken from the launcher's."""


@pytest.fixture
def torchrun_forking(monkeypatch):
    """`torch.distributed.run.run`, which `launch.launch` calls with torchrun's parsed arguments, stood in for by
    `--nproc-per-node` forked ranks of the module's arguments (`_rank_runs`, which leaves each rank's process with
    its exit status as `plandsl.run.entry` does); a rank that exited non-zero fails the job as torchrun's agent says
    it: the others still running stopped by SIGTERM (`harness.run_failing_ranks`, `ERROR_GRACE_S` later), then
    `ChildFailedError` naming every rank that did not exit 0 (the stopped ones too, killed by SIGTERM), its local
    rank, pid and exit status. The ranks' outputs are written to this process's stdout and stderr once they ended
    (capfd); the launches it stood in for are recorded (their argv)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
    launched = []

    def run(config):
        assert config.module and config.training_script == "plandsl.run", config
        argv = list(config.training_script_args)
        launched.append(argv)
        # the ranks get the launcher's environment as it is now, as torchrun's do (the fault directory `launch` set,
        # the test hook): given, since a forkserver's ranks (`harness.start_method`) would have the server's
        environment = {name: value for name, value in os.environ.items() if name not in _RANK_ENV}
        world = int(config.nproc_per_node)
        with tempfile.TemporaryDirectory(prefix="plandsl-torchrun-") as output:
            ends = run_failing_ranks(world, _rank_runs, argv, output, deadline_s=TIMEOUT_S / 3, rank_env=environment)
            for rank in range(world):  # where torchrun's ranks print: the launcher's stdout and stderr (capfd)
                for stream, fd in (("out", 1), ("err", 2)):
                    path = Path(output) / f"rank{rank}.{stream}"
                    with open(fd, "wb", closefd=False) as launcher:
                        launcher.write(path.read_bytes() if path.exists() else b"")
        # the agent's order: the ranks that failed, then those it stopped (ChildFailedError's first failure, the
        # earliest timestamp, in whole seconds, and the first of equal ones)
        failed = sorted((end for end in ends if end.exitcode != 0), key=lambda end: end.exitcode == -signal.SIGTERM)
        failures = {end.rank: ProcessFailure(end.rank, end.pid, end.exitcode, "") for end in failed}
        if failures:
            raise ChildFailedError("plandsl.run", failures)

    monkeypatch.setattr("torch.distributed.run.run", run)
    return launched


@pytest.fixture
def nothing_launched(monkeypatch):
    """`plandsl run` in this process must not start ranks: a launch fails the test at once instead of starting the
    real torchrun in the test process, with no timeout (E711's 1,024 ranks)."""
    def launch(args):
        pytest.fail(f"`plandsl run` launched torchrun {' '.join(args)}", pytrace=False)

    monkeypatch.setattr("plandsl.runtime.launch.launch", launch)


def _assert_not_started(result, *artefacts) -> None:
    """Nothing was launched: no torchrun command echoed, no step trained, no file written."""
    assert "torchrun" not in result.output and not re.search(r"^step \d", result.output, re.M), result.output
    assert "Traceback" not in result.output, result.output
    for path in artefacts:
        assert not path.exists(), path


# ---- plans that never start -----------------------------------------------------------------------------
BAD_PLAN = """\
import "clusters/local"
import "local/tiny"

plan tiny_bad {
  model   = tiny_gtp
  cluster = localhost
  mesh    = [dp = 2] over devices[0:2]
  train   = tiny_train
  data    = ddp over dp
}
"""

CP_PLAN = """\
import "clusters/local"

plan mlp_cp {
  model   = mlp(layers=2, hidden=16, input=8, output=4)
  cluster = localhost
  mesh    = [r = 2, s = 2, cp = 2] over devices[0:8]
  train   = { global_batch: 8, micro_batch: 1, seq: 8 }
  data    = hsdp over [r, s]
  context = allgather over cp
}
"""


def test_plan_with_an_error_is_reported_and_never_launched(tmp_path):
    plan, metrics = tmp_path / "bad.plan", tmp_path / "bad.jsonl"
    plan.write_text(BAD_PLAN)
    result = plandsl_run(plan, "--steps", 1, "--metrics", metrics, timeout=CHECK_ONLY_S)
    assert result.returncode == 1, result.output
    # rendered like `plandsl check`: file:line:col, the code, the name; the model line is line 5
    assert re.search(rf"{re.escape(str(plan))}:5:13: error\[E201\]: unknown name 'tiny_gtp'", result.output), \
        result.output
    assert "did you mean 'tiny_gpt'" in result.output
    _assert_not_started(result, metrics)


def test_plan_the_runtime_cannot_run_is_refused_before_launch(tmp_path, nothing_launched):
    """A valid plan the interpreter refuses: every reason reported at its attribute, nothing started. The command in
    this process (the command line's own way, a `plandsl` process, is the test above's: ~1.3 s a process)."""
    plan, metrics = tmp_path / "cp.plan", tmp_path / "cp.jsonl"
    plan.write_text(CP_PLAN)
    result = CliRunner().invoke(main, ["run", str(plan), "--steps", "1", "--metrics", str(metrics)])
    assert result.exit_code == 1, result.output
    where = re.escape(str(plan))
    assert re.search(rf"^{where}:9:13: error\[E704\]: context parallelism needs a gpt or llama model",
                     result.output, re.M), result.output
    assert re.search(rf"^{where}:8:13: error\[E703\]: hsdp together with context parallelism",
                     result.output, re.M), result.output
    _assert_not_started(result, metrics)


def test_a_mesh_larger_than_one_node_is_not_started_on_one_machine_unasked(tmp_path, nothing_launched):
    """GPT-3 175B's 1,024 ranks started here by mistake would fork 1,024 processes: `run` names the
    multi-node command instead, and --dry-run still builds the ranks and prints it."""
    metrics = tmp_path / "m.jsonl"
    result = CliRunner().invoke(main, ["run", str(ROOT / "stdlib_plans/examples/gpt3_175b_3d.plan"), "--steps", "1",
                                       "--metrics", str(metrics)])  # in this process, as the test above
    assert result.exit_code == 1, result.output
    assert ("error[E711]: plan 'gpt3_megatron': its mesh spans 1024 devices, 128 nodes of cluster 'dgx_a100 x 128' "
            "(8 devices each)" in result.output), result.output
    assert "= hint: start it on every node with --nnodes 128 --node-rank R --rdzv-endpoint HOST:PORT" \
        in result.output, result.output
    # past limits.MAX_LOCAL_RANKS (256) one machine is not offered at all (3aef30a)
    assert "--nproc-per-node 1024" not in result.output, result.output
    _assert_not_started(result, metrics)


# ---- failures ---------------------------------------------------------------------------------------------
def test_killed_pipeline_rank_is_named_with_its_action_and_leaves_the_last_checkpoint(tmp_path, reference_losses,
                                                                                        capfd):
    directory = tmp_path / "ck"
    env = _env(PLANDSL_FAULT_INJECT="rank=0,step=2,action=0F5,kill")
    result = plandsl_run(PP, "--steps", STEPS, "--checkpoint-dir", directory, "--checkpoint-every", 1, env=env)
    assert result.returncode != 0, result.output
    out = result.output
    assert "torchrun --standalone --nproc-per-node 2 -m plandsl.run" in out, out  # the command, echoed
    assert "plandsl run: the job failed; the other ranks were stopped" in out, out
    assert re.search(r"^  rank 0 \(root cause\): killed by SIGKILL \(local rank 0, pid \d+\) at step 2, action 0F5$",
                     out, re.M), out
    assert re.search(r"^  .*rank 1\b.* at step 2", out, re.M), out  # the stopped peer, with where it was
    # the 1F1B grid: rank 0's action in brackets on the row marked `<-- here`, rank 1's beside it
    assert "schedule '1f1b', 2 pipeline ranks x 8 microbatches" in out, out
    marked = [line for line in out.splitlines() if line.endswith("<-- here")]
    assert len(marked) == 1 and re.match(r"Step \d+: \[0F5\] +\(1[FB]\d\) <-- here$", marked[0]), marked or out
    assert re.search(r"^Step 00: 0F0$", out, re.M), out  # the grid is drawn from the start
    # step 1's checkpoint is the latest and is complete: its record, and every model tensor equal to
    # one process trained for one step; step 2's was never begun, nothing half-written is left
    assert "checkpoint: step 1 ->" in out, out
    assert sorted(p.name for p in directory.iterdir()) == ["step-000001"]
    latest = checkpoint.latest(directory)
    assert latest == checkpoint.step_dir(directory, 1)
    record = json.loads((latest / checkpoint.RECORD).read_text())
    assert record["step"] == 1 and record["steps"] == STEPS and record["plan"] == "tiny_pp_1f1b"
    assert record["world_size"] == 2
    reference = runtime_reference.run_reference(_plan(PP), 1).params
    assert set(record["model"]) == set(reference)
    saved = _load_model_state(latest)
    assert set(saved) == set(reference)
    for name, want in reference.items():
        assert list(want.shape) == record["model"][name], name
        diff = float((saved[name] - want).norm() / want.norm().clamp_min(1e-30))
        assert diff <= 1e-5, (name, diff)
    # ... and the job resumes from it: steps 2 and 3 as an uninterrupted run gives them. Its ranks are forked
    # (harness.py): torchrun's start is the killed run's above, and `--resume`'s way from the command line to the
    # ranks is tests/unit/test_launch.py's (every rank option forwarded); a second launch cost ~15 s
    metrics = tmp_path / "resumed.jsonl"
    capfd.readouterr()
    resumed = run_ranks(2, ranks.train, str(ROOT / PP), steps=STEPS, checkpoint_dir=str(directory), resume=True,
                        metrics=str(metrics), quiet=False)[0]
    output = capfd.readouterr().out
    assert resumed["status"] == 0 and resumed["first_step"] == 1, resumed
    assert f"resuming from step 1 ({latest})" in output, output
    lines = _metrics(metrics)
    assert [line["step"] for line in lines] == [2, 3], lines
    _assert_close([line["loss"] for line in lines], reference_losses[1:], "resumed")
    assert checkpoint.latest(directory) == checkpoint.step_dir(directory, STEPS)


def _load_model_state(path) -> dict:
    """The model tensors of a DCP checkpoint, read in this process (no process group)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    metadata = dcp.FileSystemReader(path).read_metadata()
    model = {key[len("model."):]: torch.empty(value.size, dtype=value.properties.dtype)
             for key, value in metadata.state_dict_metadata.items()
             if key.startswith("model.") and isinstance(value, TensorStorageMetadata)}
    dcp.load({"model": model}, checkpoint_id=path, no_dist=True)
    return model


def test_rank_that_raises_is_named_with_its_step_phase_and_error(tmp_path, torchrun_forking, monkeypatch, capfd):
    """`plandsl run` in this process, its ranks forked (`torchrun_forking`): the killed pipeline rank's run above
    goes through the real torchrun to the same message (a launch of 2 ranks cost ~13 s here)."""
    monkeypatch.setenv("PLANDSL_FAULT_INJECT", "rank=1,step=2,phase=backward")  # the forked ranks inherit it
    metrics = tmp_path / "dp.jsonl"
    capfd.readouterr()
    result = CliRunner().invoke(main, ["run", str(ROOT / DP), "--steps", str(STEPS), "--metrics", str(metrics)])
    ranks_output = capfd.readouterr()
    assert result.exit_code == 1, result.output
    out = result.output
    assert re.search(rf"^torchrun --standalone --nproc-per-node 2 -m plandsl.run {re.escape(str(ROOT / DP))} ", out,
                     re.M), out
    assert len(torchrun_forking) == 1, torchrun_forking
    error = "RuntimeError: fault injected by PLANDSL_FAULT_INJECT at step 2, phase backward"
    assert f"plandsl run: rank 1: step 2, backward: {error}" in ranks_output.err, ranks_output  # the rank's own line
    assert "plandsl run: the job failed; the other ranks were stopped" in out, out
    assert re.search(rf"^  rank 1 \(root cause\): exited with status 1 \(local rank 1, pid \d+\) at step 2, "
                     rf"backward: {re.escape(error)}$", out, re.M), out
    assert "<-- here" not in out  # no pipeline, no grid
    assert [line["step"] for line in _metrics(metrics)] == [1]  # step 2 never finished


def _fails_on_rank_1(how: str):
    """`plandsl.run.main` of a job whose rank 1 fails (`how`: raises, or returns status 1) while rank 0, busy outside
    any collective, runs on until the launcher stops it."""
    def main(argv):
        if os.environ["RANK"] == "1":
            if how == "raises":
                raise RuntimeError("rank 1 failed")
            return 1
        time.sleep(30)
        return 0
    return main


@pytest.mark.parametrize("how", ["raises", "returns 1"])
def test_torchrun_forking_stops_and_reports_ranks_as_torchrun_does(torchrun_forking, monkeypatch, capfd, how):
    """The stand-in's job as torchrun's agent ends it: the failed rank's exit status (1, raised or returned, as
    `plandsl.run.entry` leaves), the rank still running stopped by SIGTERM and named so, which `launch.root_cause`
    knows as the launcher's own signal: the failed rank is the root cause, not the one stopped (a SIGKILL would be)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    from plandsl.runtime import launch
    from tests.distributed.harness import start_method
    if start_method() != "fork":
        pytest.skip("plandsl.run.main is replaced in this process: a forkserver's ranks would not see it")
    monkeypatch.setattr("plandsl.run.main", _fails_on_rank_1(how))
    start = time.monotonic()
    with pytest.raises(ChildFailedError) as failed:
        run(parse_args(["--standalone", "--nproc-per-node", "2", "-m", "plandsl.run", "x.plan"]))
    assert time.monotonic() - start < 25, "rank 0 was not stopped when rank 1 failed"
    failures = failed.value.failures
    assert sorted(failures) == [0, 1] and failures[1].exitcode == 1, failures
    assert failures[0].signal_name() == "SIGTERM", failures
    assert launch.root_cause(failed.value) == 1
    message = launch.failure_message(failed.value)
    assert re.search(r"^  rank 1 \(root cause\): exited with status 1 \(local rank 1, pid \d+\)$", message,
                     re.M), message
    assert re.search(r"^  rank 0: killed by SIGTERM \(local rank 0, pid \d+\)$", message, re.M), message
    if how == "raises":
        assert "RuntimeError: rank 1 failed" in capfd.readouterr().err  # its traceback, as `entry` prints it


# ---- a launcher stopped by a signal ----------------------------------------------------------------------------
def test_a_launcher_stopped_by_sigterm_names_the_signal_and_the_checkpoint_and_leaves_no_rank(tmp_path):
    """`kill PID` (a scheduler's time limit, a timeout) of `plandsl run` while its ranks train: torch's agent sends the
    signal on to the ranks, waits for them and raises SignalException, which was E108 (`internal error:
    SignalException: Process N got signal: 15`, a plandsl bug, exit 1). The launcher says which signal stopped it and
    the checkpoint `--resume` continues from, exits 128 + 15 = 143 as a process the signal ends does, and no rank
    outlives it. The one real launch of this case; the other signals and checkpoint states are the next test's."""
    directory, metrics, log = tmp_path / "ck", tmp_path / "dp.jsonl", tmp_path / "run.log"
    command = [sys.executable, "-m", "plandsl.cli", "run", DP, "--steps", "100000", "--metrics", str(metrics),
               "--checkpoint-dir", str(directory), "--checkpoint-every", "2"]
    with open(log, "w") as out:
        process = start_group(command, cwd=ROOT, env=_env(), stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while checkpoint.latest(directory) is None:  # the ranks train: step 2's checkpoint committed
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, f"no checkpoint within {TIMEOUT_S} s:\n{log.read_text()}"
            time.sleep(0.1)
        os.kill(process.pid, signal.SIGTERM)  # the launcher alone, as `kill PID` does
        try:
            status = process.wait(timeout=CHECK_ONLY_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"`plandsl run` still running {CHECK_ONLY_S} s after SIGTERM:\n{log.read_text()}")
        gone = time.monotonic() + 5  # the agent waited for its ranks before it raised: none may be left
        while group_alive(process.pid) and time.monotonic() < gone:
            time.sleep(0.05)
        assert not group_alive(process.pid), "a rank outlived its launcher"
    finally:
        stop_group(process)
    out = log.read_text()
    assert status == 128 + signal.SIGTERM, (status, out)
    assert "E108" not in out and "SignalException" not in out and "Traceback" not in out, out
    latest = checkpoint.latest(directory)  # the ranks are gone: what the message named is still the latest
    step = json.loads((latest / checkpoint.RECORD).read_text())["step"]
    assert re.search(r"^plandsl run: interrupted by SIGTERM; the ranks were stopped\n"
                     rf"  latest checkpoint: step {step} \({re.escape(str(latest))}\); the same command with --resume "
                     r"continues from it$", out, re.M), out


def _signalled_launcher(monkeypatch, sig: signal.Signals) -> None:
    """`torch.distributed.run.run` (which `launch.launch` calls) as torch's runs when the launcher gets `sig`: its
    handlers for the four signals installed (it never puts the old ones back), then SignalException."""
    from torch.distributed.elastic.multiprocessing.api import SignalException, _terminate_process_handler

    def run(config):
        for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT"):
            signal.signal(getattr(signal, name), _terminate_process_handler)
        raise SignalException(f"Process {os.getpid()} got signal: {sig}", sigval=sig)

    monkeypatch.setattr("torch.distributed.run.run", run)


@pytest.mark.parametrize("sig, saved", [(signal.SIGTERM, 4), (signal.SIGINT, 0), (signal.SIGHUP, None)])
def test_a_signalled_launcher_exits_128_plus_the_signal_and_says_what_resumes(tmp_path, monkeypatch, sig, saved):
    """In this process, torch's launcher raising SignalException as the real one does when `plandsl run` gets Ctrl-C
    (SIGINT), SIGTERM or SIGHUP: E108 before, exit 1. Now the signal by name, the latest checkpoint of
    `--checkpoint-dir` and `--resume` (none written: so it says; no `--checkpoint-dir`: no line of it), exit
    128 + the signal's number, and the signal handlers torch left put back as they were."""
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)}
    _signalled_launcher(monkeypatch, sig)
    directory = tmp_path / "ck"
    directory.mkdir()
    if saved:
        for step in (2, saved):
            (directory / f"step-{step:06d}").mkdir()
            (directory / f"step-{step:06d}" / "plandsl.json").write_text(json.dumps({"format": 1, "step": step}))
        (directory / "step-000006.partial").mkdir()  # a checkpoint begun, not committed, does not count
    argv = ["run", str(ROOT / DP), "--steps", "8"] + (["--checkpoint-dir", str(directory)] if saved is not None else [])
    try:
        result = CliRunner().invoke(main, argv)
        after = {s: signal.getsignal(s) for s in before}
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
    out = result.output
    assert result.exit_code == 128 + sig, out
    assert "E108" not in out and "SignalException" not in out, out
    lines = out.splitlines()
    first = lines.index(f"plandsl run: interrupted by {sig.name}; the ranks were stopped")
    if saved:
        assert lines[first + 1:] == [f"  latest checkpoint: step {saved} ({directory / f'step-{saved:06d}'}); the same "
                                     "command with --resume continues from it"], out
    elif saved == 0:
        assert lines[first + 1:] == [f"  no checkpoint in {directory}: none was written before the signal; the same "
                                     "command starts again at step 1"], out
    else:
        assert lines[first + 1:] == [], out
    assert after == before, "the launcher left torch's signal handlers in place"


@pytest.mark.parametrize("kind, message, argv", [
    ("DistNetworkError", "The client socket has timed out after 900000ms while trying to connect to (node0, 29500).",
     ["--nnodes", "2", "--nproc-per-node", "1", "--node-rank", "1", "--rdzv-endpoint", "node0:29500"]),
    ("DistStoreError", "Timed out after 901 seconds waiting for clients. 1/2 clients joined.",
     ["--nnodes", "2", "--nproc-per-node", "1", "--node-rank", "0", "--rdzv-endpoint", "node0:29500"]),
    ("RendezvousConnectionError", "the connection to the C10d store has failed", []),
])
def test_nodes_that_do_not_meet_are_e722_not_a_bug(monkeypatch, kind, message, argv):
    """torch's launcher failing its rendezvous (node 0 not reached, node 0 waiting for the others; on one machine its
    standalone store) escaped as E108, "a bug in plandsl": now E722 naming the endpoint, exit 1, no rank started."""
    import torch.distributed
    from torch.distributed.elastic.rendezvous import api as rendezvous
    error = getattr(rendezvous, kind, None) or getattr(torch.distributed, kind)

    def run(args):
        raise error(message)
    monkeypatch.setattr("torch.distributed.run.run", run)
    result = CliRunner().invoke(main, ["run", str(ROOT / DP), "--steps", "2", *argv])
    assert result.exit_code == 1, result.output
    assert "E108" not in result.output and "Traceback" not in result.output, result.output
    where = "the 2 nodes did not meet at --rdzv-endpoint node0:29500" if argv else \
        "the processes of this machine did not meet (torch's standalone rendezvous on this host"
    assert f"error[E722]: {where}" in result.output and f"{kind}: {message}" in result.output, result.output
    assert "= hint: give every node the same --rdzv-endpoint" in result.output or not argv


def test_torchs_lines_that_the_failure_message_says_again_are_left_out(monkeypatch, capsys):
    """torch's launcher logged `E1208 02:24:46 ... failed (exitcode: 1) local_rank: 0 (pid: 4428) of binary: ...`
    (which reads like one of plandsl's codes) and `Sending process N closing signal SIGTERM` above plandsl's own
    message saying the same; its other lines are kept, and nothing is filtered once the launch is over."""
    import logging
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
    from plandsl.runtime import launch
    seen = []

    class Seen(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())
    logger = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    handler = Seen()
    logger.addHandler(handler)

    def run(args):
        logger.warning("Sending process %s closing signal %s", 4429, "SIGTERM")
        logger.error("Process %s did not exit after %s within %ss;", 4430, "SIGTERM", 30)
        logger.error("failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s", 1, 0, 4428, "python")
        raise ChildFailedError("plandsl.run", {0: ProcessFailure(local_rank=0, pid=4428, exitcode=1, error_file="")})
    monkeypatch.setattr("torch.distributed.run.run", run)
    try:
        assert launch.launch(["--standalone", "--nproc-per-node", "2", "-m", "plandsl.run", "p.plan"]) == 1
        logger.error("failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s", 1, 0, 1, "python")
    finally:
        logger.removeHandler(handler)
    assert seen == ["Process 4430 did not exit after SIGTERM within 30s;",
                    "failed (exitcode: 1) local_rank: 0 (pid: 1) of binary: python"], seen
    assert "plandsl run: the job failed" in capsys.readouterr().err


# ---- a plan that runs, on two nodes ----------------------------------------------------------------------------
def test_two_launchers_join_as_two_nodes(tmp_path, reference_losses):
    """The DP plan's two ranks started by two launchers (one a node) train it as one process does: the metrics, the
    printed steps and the equivalence report of global rank 0. One launch: the single-node launch (`--standalone`)
    through the real torchrun is the killed pipeline rank's, and a run that trains to the end and checks its
    equivalence is this one (through `plandsl run` with forked ranks also the Hugging Face model's), so a separate
    launch of this plan on one node covered nothing more (~18 CPU-s)."""
    endpoint = f"127.0.0.1:{free_port()}"
    env = _env(OMP_NUM_THREADS="1")  # both "nodes" share this machine's cores
    processes, logs = [], []
    try:
        for node in (0, 1):
            log = open(tmp_path / f"node{node}.log", "w")
            logs.append(log)
            command = [sys.executable, "-m", "plandsl.cli", "run", DP, "--steps", str(STEPS), "--nnodes", "2",
                       "--node-rank", str(node), "--rdzv-endpoint", endpoint, "--nproc-per-node", "1",
                       "--metrics", str(tmp_path / f"node{node}.jsonl"), "--check-equivalence"]
            processes.append(start_group(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 2 * TIMEOUT_S
        codes = []
        for process in processes:
            try:
                codes.append(process.wait(timeout=max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
    finally:
        for process in processes:  # each launcher with its ranks, whether it ended or not
            stop_group(process)
        for log in logs:
            log.close()
    output = [(tmp_path / f"node{node}.log").read_text() for node in (0, 1)]
    assert codes == [0, 0], f"exit codes {codes} (None: still running after {2 * TIMEOUT_S} s)\n" + \
        "\n".join(f"--- node {n}:\n{text}" for n, text in enumerate(output))
    assert f"--nnodes 2 --node-rank 1 --rdzv-endpoint {endpoint} --nproc-per-node 1" in output[1]
    # global rank 0 runs on node 0 and alone writes the metrics; its losses are one process's
    lines = _metrics(tmp_path / "node0.jsonl")
    assert [line["step"] for line in lines] == [1, 2, 3], lines
    for line in lines:
        assert METRIC_KEYS <= set(line), line
        assert line["step_time_s"] > 0 and line["tokens_per_s"] > 0 and line["peak_memory_bytes"] > 0, line
    _assert_close([line["loss"] for line in lines], reference_losses, "two nodes vs one process")
    assert not (tmp_path / "node1.jsonl").exists()
    # the printed per-step lines show the same losses, and the equivalence report follows them
    printed = [float(x) for x in re.findall(r"^step \d+: loss ([0-9.]+)", output[0], re.M)]
    _assert_close(printed, reference_losses, "printed losses")
    report = re.search(r"equivalence with one process: (\w+) \(tolerance 1e-05 relative\)\n"
                       r"  losses: +max relative difference (\S+) \(step \d+\)\n"
                       r"  parameters: +relative difference (\S+) \(all together\)", output[0])
    assert report, output[0]
    assert report[1] == "ok" and float(report[2]) <= 1e-5 and float(report[3]) <= 1e-5, report[0]


# ---- dry run -------------------------------------------------------------------------------------------------
def test_dry_run_prints_per_rank_figures_and_the_command_and_starts_nothing(tmp_path, reference, monkeypatch,
                                                                             nothing_launched):
    """In this process (nothing is launched: a subprocess only imported torch again, ~5 s); the command line's way
    to `run` is the subprocesses' above."""
    metrics, directory = tmp_path / "dry.jsonl", tmp_path / "ck"
    path = "stdlib_plans/local/tp_pp.plan"
    monkeypatch.chdir(ROOT)
    result = CliRunner().invoke(main, ["run", path, "--dry-run", "--metrics", str(metrics), "--checkpoint-dir",
                                       str(directory)])
    assert result.exit_code == 0, result.output
    out = result.output
    assert "dry run of plan 'tiny_tp_pp': 4 of 4 ranks built on the meta device" in out, out
    rows = {int(m[1]): m for m in re.finditer(
        r"^ +(\d) +(pp=\d,tp=\d) +(\d) +([\d,]+) +([\d,]+) +[\d.]+ \w?i?B .*\| +[\d.]+ \w?i?B", out, re.M)}
    assert sorted(rows) == [0, 1, 2, 3], out
    assert [rows[r][2] for r in range(4)] == ["pp=0,tp=0", "pp=0,tp=1", "pp=1,tp=0", "pp=1,tp=1"]
    assert [rows[r][3] for r in range(4)] == ["0", "0", "1", "1"]
    count = {r: (int(rows[r][4].replace(",", "")), int(rows[r][5].replace(",", ""))) for r in rows}
    # the two stages hold the whole model between them; tensor parallelism halves what each rank stores
    total = sum(t.numel() for t in reference.params.values())  # the same tiny GPT
    assert count[0][0] + count[2][0] == total, (count, total)
    assert count[0] == count[1] and count[2] == count[3], count
    assert all(local < held for held, local in count.values()), count
    assert re.search(rf"^torchrun --standalone --nproc-per-node 4 -m plandsl.run {re.escape(path)} --steps 10 "
                     rf"--metrics {re.escape(str(metrics))} --checkpoint-dir {re.escape(str(directory))}$", out, re.M), out
    assert not re.search(r"^step \d", out, re.M) and "Traceback" not in out, out
    assert not metrics.exists() and not directory.exists()


def test_a_hugging_face_model_runs_through_the_launcher_as_written(tmp_path, torchrun_forking, capfd):
    """A plan over `hf(...)`: inspected once (the table beside it), then `plandsl run` trains the transformers
    module on 2 pipeline stages and compares with one process; `recompute: selective` (plandsl's own
    attention core) is refused before launch (E704). Two ranks: FSDP x pipeline of the same module, forked, is
    test_torch_models' llama_gqa_3d; here `plandsl run`'s way is what is tested, its ranks forked
    (`torchrun_forking`: each rank the real torchrun starts imports torch and transformers, ~5 CPU-s, and the launch
    cost ~25 s here; the real torchrun is the killed pipeline rank's and the two nodes' above). The ranks read the
    table from the plan's folder as a rank torchrun started does (`.plandsl/`, written by the inspection)."""
    plan = tmp_path / "llama.plan"
    model = ('hf("LlamaForCausalLM", hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, '
             'num_key_value_heads=2, vocab_size=128, max_position_embeddings=16, tie_word_embeddings=false)')
    plan.write_text(f'import "clusters/local"\nplan p {{\n  model = {model}\n  cluster = localhost\n'
                    "  mesh = [pp = 2] over devices[0:2]\n"
                    "  train = { global_batch: 4, micro_batch: 2, precision: fp32, lr: 1e-3, seed: 0 }\n"
                    "  stages = evenly over pp\n  schedule = 1f1b\n}\n", encoding="utf-8")
    api.inspect_plan(plan)
    capfd.readouterr()
    done = CliRunner().invoke(main, ["run", str(plan), "--steps", "2", "--check-equivalence"])
    ranks_output = capfd.readouterr().out
    assert done.exit_code == 0, done.output + ranks_output
    assert "torchrun --standalone --nproc-per-node 2 -m plandsl.run" in done.output, done.output
    assert len(torchrun_forking) == 1 and "--check-equivalence" in torchrun_forking[0], torchrun_forking
    assert "equivalence with one process: ok" in ranks_output and "step 2: loss" in ranks_output, ranks_output
    # the report names the module's own parameters (transformers' `model.*` and `lm_head.*`, not plandsl's
    # `embed.tok`, `layers.N`, `head`); which one is largest depends on the run (two fp32 pipeline stages may
    # match the one process exactly, and then the first tensor is named)
    named = re.search(r"largest in one tensor \S+ \((\S+)\)", ranks_output)
    assert named and named[1].startswith(("model.", "lm_head.")), ranks_output

    # refused before any launch (a subprocess would import torch and transformers again, ~5 CPU-s, for what
    # test_plan_the_runtime_cannot_run_is_refused_before_launch covers through one)
    plan.write_text(plan.read_text(encoding="utf-8").replace("seed: 0", "seed: 0, recompute: selective"),
                    encoding="utf-8")
    refused = CliRunner().invoke(main, ["run", str(plan), "--steps", "1"])
    assert refused.exit_code == 1 and "error[E704]: `recompute: selective`" in refused.output \
        and "torchrun" not in refused.output and len(torchrun_forking) == 1, refused.output
