"""The torchrun entry point of `plandsl profile` with several processes: `-m plandsl.runtime.profile.rank JOB.json`.

Stage: interpreter (profile). Contract: every rank joins the process group (NCCL on CUDA, one GPU per local
rank; gloo on a CPU), runs `measure.measure` with the others, and rank 0 writes the `Profile` as JSON where
the job file says (a temporary name renamed at the end, so the command reads a whole file or none) and
its progress, `done total`, to the job's progress file. Exit status 0, or 1 with the rank's error.
"""
from __future__ import annotations

import json
import os
import sys

import torch.distributed as dist

from plandsl.runtime.leave import run_then_leave
from plandsl.runtime.parallel.mesh import init_distributed
from plandsl.runtime.profile.measure import Settings, World, measure


def main(job_file: str) -> int:
    with open(job_file, encoding="utf-8") as handle:
        job = json.load(handle)
    world = World(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"]),
                  int(os.environ["LOCAL_WORLD_SIZE"]))
    init_distributed(job["timeout_s"])  # as `plandsl run`'s ranks: cuda:LOCAL_RANK and nccl, else gloo
    settings = Settings(quick=job["quick"], nproc_per_node=world.local_size, nnodes=world.size // world.local_size,
                        sustain=job["sustain"])

    def progress(done: int, total: int) -> None:
        _write(job["progress"], f"{done} {total}\n")
    profile = measure(settings, world, progress)
    if profile is not None:
        _write(job["output"], profile.to_json())
    dist.barrier()
    return 0


def _write(path: str, text: str) -> None:
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "w", encoding="utf-8") as handle:
        handle.write(text)
    os.replace(temporary, path)


def entry() -> None:
    """`main`, then leave without tearing the process group down (`runtime.leave` says why); the launcher
    sees the status, and a failure is printed with the rank's number."""
    run_then_leave(lambda: main(sys.argv[1]), f"plandsl profile: rank {os.environ.get('RANK', '?')} failed:")


if __name__ == "__main__":
    entry()
