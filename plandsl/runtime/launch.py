"""`plandsl run`: turn a checked plan into torchrun's argument list and launch it in this process.

Stage: interpreter (the launcher side; torch is imported only to launch). Contract: `torchrun_args`
builds the arguments `torchrun` itself would take (one process per device of the mesh, `-m plandsl.run`);
`launch` runs them through `torch.distributed.run` and returns the exit status, naming failed ranks.
"""
from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass

from plandsl import ir


class LaunchError(ValueError):
    """The options do not fit the plan (e.g. the process count)."""


@dataclass(frozen=True)
class LaunchOptions:
    nproc_per_node: int | None = None
    """Processes on this node; default: the mesh's size divided by `nnodes`."""
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    """HOST:PORT of node 0 (several nodes); one node uses a private local rendezvous."""
    steps: int = 10
    metrics: str | None = None
    check_equivalence: bool = False
    data: str | None = None


def torchrun_args(plan: ir.Plan, plan_file: str, plan_name: str | None, params: dict, options: LaunchOptions) -> list[str]:
    size = plan.mesh.size
    nproc = options.nproc_per_node or size // options.nnodes
    if nproc * options.nnodes != size:
        raise LaunchError(f"plan '{plan.name}': mesh has {size} devices, but nnodes({options.nnodes}) * "
                          f"nproc-per-node({nproc}) = {nproc * options.nnodes}")
    if options.nnodes > 1:
        if not options.rdzv_endpoint:
            raise LaunchError(f"--nnodes {options.nnodes} needs --rdzv-endpoint HOST:PORT (node 0's address)")
        args = ["--nnodes", str(options.nnodes), "--node-rank", str(options.node_rank),
                "--rdzv-endpoint", options.rdzv_endpoint]
    else:
        args = ["--standalone"]
    args += ["--nproc-per-node", str(nproc), "-m", "plandsl.run", plan_file, "--steps", str(options.steps)]
    if plan_name:
        args += ["--plan", plan_name]
    for key, value in params.items():
        args += ["--param", f"{key}={str(value).lower() if isinstance(value, bool) else value}"]
    if options.metrics:
        args += ["--metrics", options.metrics]
    if options.check_equivalence:
        args.append("--check-equivalence")
    if options.data:
        args += ["--data", options.data]
    return args


def command_line(args: list[str]) -> str:
    """The same launch as a shell command (what `--dry-run` prints)."""
    return shlex.join(["torchrun", *args])


def launch(args: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run
    nproc = int(args[args.index("--nproc-per-node") + 1])
    # torchrun would set 1 thread per process (and warn); share this machine's cores out instead.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    try:
        run(parse_args(args))
    except ChildFailedError as error:
        print(failure_message(error), file=sys.stderr, flush=True)
        return 1
    return 0


def failure_message(error) -> str:
    """One line per failed rank, the root cause first; torchrun stopped the other ranks."""
    cause = root_cause(error)
    lines = ["plandsl run: the job failed; the other ranks were stopped"]
    for rank in sorted(error.failures, key=lambda r: (r != cause, r)):
        failure = error.failures[rank]
        how = (f"killed by {failure.signal_name()}" if failure.exitcode < 0
               else f"exited with status {failure.exitcode}")
        label = " (root cause)" if rank == cause else ""
        lines.append(f"  rank {rank}{label}: {how} (local rank {failure.local_rank}, pid {failure.pid})")
    return "\n".join(lines)


def root_cause(error) -> int:
    """The rank that failed first. A rank killed by a signal the launcher does not send (it sends
    SIGTERM) comes before ranks that exited with an error: those usually only saw their peer vanish
    (`Connection reset by peer`), and may have reported it before the launcher noticed the death."""
    killed = [rank for rank, failure in error.failures.items()
              if failure.exitcode < 0 and failure.signal_name() != "SIGTERM"]
    if killed:
        return min(killed, key=lambda rank: error.failures[rank].timestamp)
    return error.get_first_failure()[0]
