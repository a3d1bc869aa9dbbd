"""Forked gloo ranks for the benchmarks that run a plan's processes in one script (bench_run, bench_build)."""
from __future__ import annotations

import torch.multiprocessing as mp


def fork_ranks(target, world: int, args: tuple, timeout_s: float, what: str) -> None:
    """Fork `world` processes running `target(rank, *args)` and wait for them; a rank that fails or outlives
    `timeout_s` ends the benchmark, naming `what`."""
    context = mp.get_context("fork")
    procs = [context.Process(target=target, args=(rank, *args)) for rank in range(world)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=timeout_s)
        if proc.exitcode != 0:
            raise SystemExit(f"{what}: rank exited with {proc.exitcode}")
