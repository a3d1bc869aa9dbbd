"""tests/support.py's CPU bound: more work fails it on any machine; a slower machine is judged at its speed."""
from __future__ import annotations

import os
import subprocess
import time

import pytest

from tests import support


def _busy(seconds: float) -> None:
    start = time.process_time()
    while time.process_time() - start < seconds:
        pass


def test_a_block_over_its_bound_fails_however_slow_the_machine_now():
    with pytest.raises(AssertionError, match=r"used 0\.\d s of CPU \(bound 0\.01 s, x \d+\.\d\d for this"):
        with support.bounded(0.01, "the busy loop"):
            _busy(0.3)  # 30x its bound: a slow day is 1.3-1.4x


def test_a_block_over_its_bound_on_a_slower_machine_is_judged_at_that_speed(monkeypatch):
    monkeypatch.setattr(support, "reference_cpu_s", lambda: support.REFERENCE_CPU_S * 4)
    with support.bounded(0.05, "the busy loop"):  # 0.1 s: twice its bound, on a machine 4x slower
        _busy(0.1)
    monkeypatch.setattr(support, "reference_cpu_s", lambda: support.REFERENCE_CPU_S / 4)  # faster: bound stands
    with pytest.raises(AssertionError, match=r"x 1\.00"):
        with support.bounded(0.05, "the busy loop"):
            _busy(0.1)


# ---- run_group: a command's processes ended with it ------------------------------------------------------------
# `sh` starts at once and its background `sleep` is a grandchild of the test in the command's group (a rank under
# torchrun); `trap "" TERM` has both ignore SIGTERM (an ignored signal stays ignored across fork and exec).
_SPAWNS = 'sleep 600 & echo $$ $!; wait'
_procs = pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads process states from /proc")


def _running(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in "ZX"  # a zombie has ended: only its parent (or init) has yet to reap it


def _pids(output: str) -> list[int]:
    pids = [int(word) for word in output.split()]
    assert len(pids) == 2, output
    return pids


@_procs
def test_a_command_that_times_out_is_ended_with_the_processes_it_started():
    """subprocess.run's timeout kills the command alone and leaves its children running (torchrun's ranks);
    run_group's ends the command's whole process group, with SIGTERM, and keeps the output so far."""
    with pytest.raises(subprocess.TimeoutExpired) as timed_out:
        support.run_group(["sh", "-c", _SPAWNS], timeout=2, stdout=subprocess.PIPE, text=True)
    child, grandchild = _pids(timed_out.value.output)
    assert not _running(child) and not _running(grandchild)


@_procs
def test_processes_that_ignore_sigterm_are_killed_after_the_grace():
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired) as timed_out:
        support.run_group(["sh", "-c", f'trap "" TERM; {_SPAWNS}'], timeout=2, grace_s=0.5, stdout=subprocess.PIPE,
                          text=True)
    child, grandchild = _pids(timed_out.value.output)
    assert not _running(child) and not _running(grandchild)
    assert time.monotonic() - start < 2 + 3 * 0.5 + 5  # the grace, not KILL_GRACE_S, nor forever


@_procs
def test_processes_left_by_a_command_that_ended_are_ended(tmp_path):
    done = support.run_group(["sh", "-c", "sleep 600 >/dev/null 2>&1 & echo $$ $!"], timeout=60,
                             stdout=subprocess.PIPE, text=True)
    assert done.returncode == 0
    child, grandchild = _pids(done.stdout)
    assert not _running(child) and not _running(grandchild)


def test_a_command_that_ends_in_time_is_run_as_subprocess_runs_it():
    done = support.run_group(["sh", "-c", "cat; echo err >&2; exit 3"], timeout=60, input="in\n",
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert (done.returncode, done.stdout, done.stderr) == (3, "in\n", "err\n")
