"""`plandsl profile`: check the options, measure (in this process, or on ranks torch's launcher starts), write.

Stage: interpreter (profile). Contract: `option_problems(options)` lists the Diagnostics of options past
their caps (E505) before anything starts; `run_profile(options, progress)` measures and returns the
`Profile` on node 0 (None on the other nodes, which only take part); `write_cluster(profile, path)` writes
the cluster file through a temporary file renamed over `path`, so an interrupted profile (Ctrl-C, a rank
that fails: the launcher stops the others) leaves `path` as it was. One process measures here, in this
process; several are started by `torch.distributed.run` (as `plandsl run` starts its ranks) running
`plandsl.runtime.profile.rank`, and rank 0 hands its `Profile` back through a file.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from plandsl.diagnostics import Diagnostic, PlanError, diag
from plandsl.diagnostics.limits import MAX_LOCAL_RANKS, MAX_PROFILE_NODES, MAX_SUSTAIN_SECONDS
from plandsl.runtime.launch import cuda_device_count as _cuda_devices, endpoint_problem  # as `run` counts them
from plandsl.runtime.launch import launcher_signals, quiet_agent
from plandsl.runtime.profile.results import Profile
from plandsl.runtime.profile.write import cluster_text
from plandsl.syntax.files import unwritable, write_through_temporary

Progress = Callable[[int, int], None]
TIMEOUT_S = 300
"""Seconds a rank waits for the others in one collective before the job fails (a lost peer)."""


@dataclass(frozen=True)
class ProfileOptions:
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    quick: bool = False
    sustain: float | None = None
    """Seconds the device is held busy before the sustained timings; None: the default for the device."""


def option_problems(options: ProfileOptions, cuda_devices: int | None = None) -> list[Diagnostic]:
    """E505 for every option past its cap: processes per node (at most `MAX_LOCAL_RANKS`, and on a machine
    with CUDA at most its GPUs: `cuda_devices`, None to ask torch), nodes (`MAX_PROFILE_NODES`), the hold
    (`--sustain`, 0 to `MAX_SUSTAIN_SECONDS`); E505 too for
    a node rank outside the nodes, an endpoint that is not HOST:PORT, or several nodes without --rdzv-endpoint
    (what node 0's address is)."""
    problems = []
    if options.nproc_per_node > MAX_LOCAL_RANKS:
        problems.append(diag("E505", f"--nproc-per-node {options.nproc_per_node} is above plandsl's limit of "
                                     f"{MAX_LOCAL_RANKS} processes per node", hint="a node holds 8 to 16 "
                                     "accelerators today; give the processes of one node"))
    if cuda_devices is None:
        cuda_devices = _cuda_devices()
    if cuda_devices and options.nproc_per_node > cuda_devices:
        problems.append(diag("E505", f"--nproc-per-node {options.nproc_per_node} is above the {cuda_devices} CUDA "
                                     f"device(s) of this machine (one process per GPU)",
                             hint=f"--nproc-per-node {cuda_devices}"))
    if options.nnodes > MAX_PROFILE_NODES:
        problems.append(diag("E505", f"--nnodes {options.nnodes} is above plandsl profile's limit of "
                                     f"{MAX_PROFILE_NODES} nodes", hint="two nodes measure the links between "
                                     "nodes; more add time, not figures"))
    if options.sustain is not None and not 0 <= options.sustain <= MAX_SUSTAIN_SECONDS:
        problems.append(diag("E505", f"--sustain {options.sustain:g} is outside plandsl profile's range of 0 to "
                                     f"{MAX_SUSTAIN_SECONDS:g} seconds", hint="a GPU reaches its power-limited "
                                     "steady state in tens of seconds (the default on a GPU: 30)"))
    if options.node_rank >= options.nnodes:
        problems.append(diag("E505", f"--node-rank {options.node_rank} is not below --nnodes ({options.nnodes}): "
                                     f"nodes are numbered 0 to {options.nnodes - 1}"))
    if options.rdzv_endpoint is not None and endpoint_problem(options.rdzv_endpoint):
        problems.append(diag("E505", f"--rdzv-endpoint '{options.rdzv_endpoint}': "
                                     f"{endpoint_problem(options.rdzv_endpoint)}"))
    if options.nnodes > 1 and not options.rdzv_endpoint:
        problems.append(diag("E505", f"--nnodes {options.nnodes} needs --rdzv-endpoint HOST:PORT (node 0's "
                                     "address, the same on every node)"))
    return problems


def run_profile(options: ProfileOptions, progress: Progress | None = None) -> Profile | None:
    """Measure this machine (and with --nnodes the others, which run the same command); the `Profile` on
    node 0, None on the others. `ProfileError` (E720) when a rank fails or the nodes do not meet; KeyboardInterrupt on
    Ctrl-C, `Interrupted` (one, naming the signal: `launch.launcher_signals`) where a signal stopped torch's launcher
    and its ranks."""
    if options.nproc_per_node == 1 and options.nnodes == 1:
        from plandsl.runtime.profile.measure import Settings, measure  # lazy: torch
        return measure(Settings(quick=options.quick, sustain=options.sustain), progress=progress)
    return _launch(options, progress)


class ProfileError(RuntimeError):
    """The job's ranks failed or its nodes did not meet; nothing was written. `.diagnostic`: E720, built where it is
    raised, with the hint."""

    def __init__(self, message: str, hint: str):
        super().__init__(message)
        self.diagnostic = diag("E720", message, hint=hint)


def _failed_ranks(ranks: list[int], options: ProfileOptions) -> ProfileError:
    """E720 for ranks that failed (each printed its own error above, as torch's launcher lets it)."""
    shown = ", ".join(str(rank) for rank in sorted(ranks))
    return ProfileError(f"rank(s) {shown} failed (their errors above); nothing was written",
                        "the rank's own error above says why: a device that fails or runs out of memory, a peer lost "
                        f"(a collective waits {TIMEOUT_S} s for the others); mend that and run it again (`--quick` "
                        "tries it in seconds" + (", `--nproc-per-node 1` without the collectives)"
                                                 if options.nproc_per_node > 1 and options.nnodes == 1 else ")"))


def _nodes_apart(error: Exception, options: ProfileOptions) -> ProfileError:
    """E720 for nodes that did not meet at node 0's address (torch's rendezvous failing); on one machine, for its
    processes that did not meet at the local address torch's standalone rendezvous chose."""
    if options.nnodes == 1:
        return ProfileError(f"the {options.nproc_per_node} processes of this machine did not meet (torch's standalone "
                            f"rendezvous on this host; {type(error).__name__}: {error}); nothing was written",
                            "the processes meet over a local TCP port: check that this host's name resolves and that "
                            "nothing (a firewall on the loopback interface, a proxy setting) refuses the connection; "
                            "`--nproc-per-node 1` measures without the collectives")
    return ProfileError(f"the {options.nnodes} nodes did not meet at --rdzv-endpoint {options.rdzv_endpoint} "
                        f"({type(error).__name__}: {error}); nothing was written",
                        "run the same command on every node, each with its own --node-rank, and node 0's address "
                        "as --rdzv-endpoint on all of them; that address and port must be reachable from every node "
                        "(start node 0 first, open the port in a firewall)")


def _launch(options: ProfileOptions, progress: Progress | None) -> Profile | None:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError  # lazy: torch
    from torch.distributed import DistError  # lazy: torch
    from torch.distributed.elastic.rendezvous.api import RendezvousError  # lazy: torch
    from torch.distributed.run import parse_args, run  # lazy: torch
    directory = tempfile.mkdtemp(prefix="plandsl-profile-")
    try:
        job = os.path.join(directory, "job.json")
        output, progress_file = os.path.join(directory, "profile.json"), os.path.join(directory, "progress")
        Path(job).write_text(json.dumps({"quick": options.quick, "sustain": options.sustain, "output": output,
                                         "progress": progress_file, "timeout_s": TIMEOUT_S}), encoding="utf-8")
        if options.nnodes > 1:
            where = ["--nnodes", str(options.nnodes), "--node-rank", str(options.node_rank),
                     "--rdzv-endpoint", options.rdzv_endpoint]
        else:
            where = ["--standalone"]
        args = where + ["--nproc-per-node", str(options.nproc_per_node), "-m", "plandsl.runtime.profile.rank", job]
        # torchrun would set 1 thread per process (and warn); share this machine's cores out instead.
        threads = str(max(1, (os.cpu_count() or 1) // options.nproc_per_node))
        with _environment("OMP_NUM_THREADS", threads), _polling(progress_file, progress):
            try:
                with launcher_signals(), quiet_agent():  # the launcher's own Ctrl-C or SIGTERM, which stopped the
                    # ranks: Interrupted; its log lines E720 says again left out
                    run(parse_args(args))
            except ChildFailedError as error:
                raise _failed_ranks(list(error.failures), options) from None
            except (RendezvousError, DistError) as error:  # the nodes did not meet: node 0 unreachable, or not
                # started; the static rendezvous (--rdzv-endpoint without --rdzv-backend, as here) raises the store's
                # DistNetworkError (a node not reaching node 0) or DistStoreError (node 0 waiting for the others)
                raise _nodes_apart(error, options) from None
        if not os.path.exists(output):
            return None  # not node 0: rank 0 wrote it on its own machine
        return Profile.from_json(Path(output).read_text(encoding="utf-8"))
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@contextlib.contextmanager
def _environment(name: str, value: str):
    previous = os.environ.get(name)
    os.environ.setdefault(name, value)
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)


@contextlib.contextmanager
def _polling(path: str, progress: Progress | None, every_s: float = 0.2):
    """Call `progress(done, total)` from what rank 0 writes to `path`, in a thread, while the ranks run."""
    if progress is None:
        yield
        return
    stop = threading.Event()

    def poll() -> None:
        seen = None
        while not stop.wait(every_s):
            with contextlib.suppress(OSError, ValueError):
                done, total = (int(part) for part in Path(path).read_text(encoding="utf-8").split())
                if (done, total) != seen:
                    seen = (done, total)
                    progress(done, total)
    thread = threading.Thread(target=poll, name="plandsl-profile-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def write_cluster(profile: Profile, path: str) -> str:
    """Write the cluster file for `profile` to `path` (its stem names the node) through a temporary file beside
    it, renamed over `path` at the end; the text written. PlanError E110 when it cannot (the old file left)."""
    text = cluster_text(profile, Path(path).stem)
    try:
        write_through_temporary(path, text)
    except OSError as error:
        raise PlanError([unwritable(path, error, "the cluster file")]) from None
    return text


__all__ = ["ProfileOptions", "ProfileError", "option_problems", "run_profile", "write_cluster", "TIMEOUT_S"]
