"""Run a function on N gloo ranks forked from the test process (or, on a CUDA build of torch, from a
forkserver: `start_method`), with a deadline.

Forking from a process that has already imported torch and the runtime (run_ranks imports them first)
starts a rank in ~0.2 s (spawn and torchrun take 4-17 s), so most multi-process tests fork; a few go
through the real launcher (test_launcher.py).
Each rank gets the environment torchrun would give it (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT), one intra-op thread, and leaves with `os._exit` after writing its result: destroying a
gloo group at exit can deadlock in torch 2.13 (plandsl.run.entry does the same). A rank that raises
fails the test with its traceback; ranks still running at the deadline are killed and named, so a
deadlock fails instead of hanging.
"""
from __future__ import annotations

import importlib
import multiprocessing
import os
import pickle
import signal
import socket
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest

ERROR_GRACE_S = 3.0  # after a rank raises, how long the others get to finish (they are then killed)
STOP_WAIT_S = 10.0  # `run_failing_ranks`: how long a rank sent SIGTERM gets to exit before SIGKILL (torchrun's
# agent waits 30 s; a rank with Python's default SIGTERM disposition exits at once)
# `deadline_s` is what a run may take on the quiet 2-core machine; the harness waits LOAD_MARGIN times that
# before calling it a deadlock, because other test runs (or pytest-xdist workers) sharing the cores stretch
# wall time several-fold: the deadline is for hangs, not for speed
LOAD_MARGIN = 3.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, out: Path, env: dict[str, str],
               fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0", **env)
    status = 0
    try:
        import torch
        torch.set_num_threads(1)  # the parent's OpenMP pool does not survive fork; 2 cores anyway
        outcome = (True, fn(rank, *args, **kwargs))
    except BaseException:  # noqa: BLE001 - the traceback goes to the test
        outcome, status = (False, traceback.format_exc()), 1
    try:
        (out / f"rank{rank}.tmp").write_bytes(pickle.dumps(outcome))
        (out / f"rank{rank}.tmp").rename(out / f"rank{rank}.pkl")
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


# What ranks import beyond the trainer's own imports, lazily, while they build and train: torch._dynamo
# (torch's tensor-parallel styles and FSDP import it on first use, ~1 CPU-s), the pipelining package,
# DCP's filesystem layer (fsspec). Measured by listing the modules a forked rank added to sys.modules:
# 56 of 92 ranks of a sample of 21 multi-process tests imported ~220 modules each, ~1 CPU-s per rank.
PRELOAD = ("torch", "torch._dynamo", "torch.distributed.tensor.parallel", "torch.distributed.pipelining",
           "torch.distributed.checkpoint", "fsspec", "numpy.random",
           "plandsl.runtime.equivalence", "plandsl.runtime.train", "plandsl.runtime.parallel.pipeline")


def _import_what_ranks_import() -> None:
    """Import torch, the runtime and what ranks import on first use here, once per test process, before
    forking: a rank forked from a process that has them starts with them, while each rank importing them
    itself costs ~4 s of CPU (torch, torch.distributed, the checkpoint and dynamo modules the trainer
    pulls in), per rank and test."""
    for name in PRELOAD:
        importlib.import_module(name)


def start_method() -> str:
    """fork, or forkserver on a CUDA build of torch (PLANDSL_TEST_START overrides). A CUDA build's autograd
    starts its device threads at a process's first backward, and a rank forked after that fails its own
    backward ("Unable to handle autograd's threading in combination with fork-based multiprocessing"):
    seen with torch 2.11+cu130 on the GPU machine once an earlier test in the same pytest worker had
    trained in-process. The forkserver forks ranks from a clean process that only imported what ranks
    import (`_import_what_ranks_import`'s modules, preloaded), so they still start in a fraction of a second."""
    import torch
    method = os.environ.get("PLANDSL_TEST_START") or ("forkserver" if torch.version.cuda else "fork")
    if method == "forkserver":
        multiprocessing.set_forkserver_preload(list(PRELOAD))
    return method


def run_ranks(world: int, fn: Callable[..., Any], *args: Any, deadline_s: float = 90.0,
              rank_env: dict[str, str] | None = None, **kwargs: Any) -> list[Any]:
    """`fn(rank, *args, **kwargs)` on `world` forked ranks; their return values, rank 0 first.

    The results must be picklable (they travel back through files); `rank_env` is added to each
    rank's environment. Two failures of the machine, not of `fn`, run the ranks again (`PORT_TRIES` runs at most):
    the port `free_port` found free taken by another process before rank 0's store binds it (other test runs on the
    machine: EADDRINUSE at `init_process_group`, before `fn` did anything past it), on another port; and, once, a
    rank that died by a signal the harness did not send (a forked rank aborted by glibc's heap check, "malloc():
    unaligned tcache chunk detected", once in a `.ci/run` on a loaded machine, the same test passing alone), which
    is said on stderr. A rank that dies so twice fails the test."""
    _import_what_ranks_import()
    context = multiprocessing.get_context(start_method())
    deadline_s *= LOAD_MARGIN
    crashed_before = False
    for attempt in range(PORT_TRIES):
        port = free_port()  # the OS picks a free port: distinct across concurrent xdist workers
        outcomes, stuck, codes, _ = _run_once(context, world, port, deadline_s, rank_env or {}, fn, args, kwargs)
        failures = [value for ok, value in filter(None, outcomes.values()) if not ok]
        crashed = {rank: codes[rank] for rank, outcome in outcomes.items()
                   if outcome is None and rank not in stuck and codes[rank] is not None and codes[rank] < 0}
        last = attempt + 1 == PORT_TRIES
        if not last and any(_port_taken(value) for value in failures):
            continue
        if not last and crashed and not crashed_before:
            crashed_before = True
            sys.stderr.write(f"run_ranks: ranks {sorted(crashed)} died by signals {crashed} (not the harness's); "
                             f"running the {world} ranks again once\n")
            continue
        break
    errors = [f"rank {rank} raised:\n{value}" for rank, (ok, value) in
              ((r, o) for r, o in outcomes.items() if o is not None) if not ok]
    if crashed:
        errors.append(f"ranks {sorted(crashed)} died by signals {crashed} without a result"
                      + (" (twice: a run before died so too)" if crashed_before else ""))
    if errors:
        pytest.fail("\n".join(errors) + (f"\n(ranks {stuck} were still running and were killed)" if stuck else ""))
    if stuck:
        pytest.fail(f"ranks {stuck} of {world} did not finish within {deadline_s:g} s (a deadlock?); killed")
    silent = [rank for rank, outcome in outcomes.items() if outcome is None]
    if silent:
        exits = {rank: codes[rank] for rank in silent}
        pytest.fail(f"ranks {silent} died without a result (exit codes {exits})")
    return [outcomes[rank][1] for rank in range(world)]


# `run_ranks`: the runs at most, again on a fresh port where the one found free was taken before rank 0's store
# bound it, or once where a rank died by a signal the harness did not send
PORT_TRIES = 3


def _port_taken(traceback_text: str) -> bool:
    """Whether a rank's traceback is its store's bind failing on a port another process took (EADDRINUSE)."""
    return "EADDRINUSE" in traceback_text or "address already in use" in traceback_text


def _run_once(context, world: int, port: int, deadline_s: float, rank_env: dict[str, str], fn, args, kwargs,
              stop: signal.Signals = signal.SIGKILL):
    """One run of `run_ranks`' ranks on `port`: (each rank's outcome or None, the ranks killed at the deadline or
    `ERROR_GRACE_S` after a peer failed, each rank's exit code, each rank's pid). Those stopped after a peer failed get
    `stop` (SIGTERM: `run_failing_ranks`, as torchrun's agent stops them) and SIGKILL `STOP_WAIT_S` later; those
    still running at the deadline, SIGKILL."""
    with tempfile.TemporaryDirectory(prefix="plandsl-ranks-") as directory:
        out = Path(directory)
        processes = [context.Process(target=_rank_main, args=(rank, world, port, out, rank_env, fn, args, kwargs),
                                     daemon=True) for rank in range(world)]
        for process in processes:
            process.start()
        deadline, failed_at = time.monotonic() + deadline_s, None
        while any(p.is_alive() for p in processes) and time.monotonic() < deadline:
            if failed_at is None and any(p.exitcode not in (None, 0) for p in processes):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > ERROR_GRACE_S:
                break
            time.sleep(0.02)
        stuck = [rank for rank, p in enumerate(processes) if p.is_alive()]
        if stuck and stop != signal.SIGKILL and failed_at is not None and time.monotonic() < deadline:
            for process in processes:
                if process.is_alive():
                    os.kill(process.pid, stop)
            stopped_by = time.monotonic() + STOP_WAIT_S
            for process in processes:
                process.join(max(0.0, stopped_by - time.monotonic()))
        for process in processes:
            if process.is_alive():
                os.kill(process.pid, signal.SIGKILL)
            process.join()
        outcomes = {}
        for rank in range(world):
            path = out / f"rank{rank}.pkl"
            outcomes[rank] = pickle.loads(path.read_bytes()) if path.exists() else None
    return outcomes, stuck, {rank: p.exitcode for rank, p in enumerate(processes)}, [p.pid for p in processes]


@dataclass(frozen=True)
class RankEnd:
    """How a rank of `run_failing_ranks` ended: `raised` (its traceback in `value`) or returned `value`; or neither
    (`value` None, `raised` False): it left the process itself (`os._exit`), or the harness stopped it (SIGTERM,
    `ERROR_GRACE_S` after a peer failed) or killed it (SIGKILL, at the deadline): `exitcode` says which."""

    rank: int
    pid: int
    exitcode: int | None
    raised: bool
    value: Any


def run_failing_ranks(world: int, fn: Callable[..., Any], *args: Any, deadline_s: float = 90.0,
                      rank_env: dict[str, str] | None = None, **kwargs: Any) -> list[RankEnd]:
    """`run_ranks` for ranks that are meant to fail: how each ended, rank 0 first, instead of failing the test. The
    ranks still running `ERROR_GRACE_S` after one raised or exited non-zero are stopped as torchrun's agent stops the
    others of a job whose rank failed: SIGTERM (exit code -15, which `runtime.launch.root_cause` knows as the
    launcher's own signal), SIGKILL `STOP_WAIT_S` later (tests/distributed/test_launcher.py: the launcher's message
    built from such a run); those still running at the deadline, SIGKILL. Run once:
    a port taken before rank 0's store bound it shows as every rank raising EADDRINUSE, and the caller asserts
    what it expected."""
    _import_what_ranks_import()
    context = multiprocessing.get_context(start_method())
    outcomes, _, codes, pids = _run_once(context, world, free_port(), deadline_s * LOAD_MARGIN, rank_env or {}, fn,
                                         args, kwargs, stop=signal.SIGTERM)
    return [RankEnd(rank, pids[rank], codes[rank], outcomes[rank] is not None and not outcomes[rank][0],
                    None if outcomes[rank] is None else outcomes[rank][1]) for rank in range(world)]
