"""`plandsl run`: turn a checked plan into torchrun's argument list and launch it in this process.

Stage: interpreter (the launcher side; torch is imported only to launch). Contract: `torchrun_args`
builds the arguments `torchrun` itself would take (one process per device of the mesh, `-m plandsl.run`:
`rank_command`, which `plandsl launch` hands TorchX too, as it does `mesh_nodes`); `check_fits` refuses a mesh larger than one node when one node is all the options give;
what does not fit is a `LaunchError` carrying its Diagnostic (E710-E714), `OptionError` one option's usage error; `dry_run_commands`
is what `--dry-run` prints instead (the command for every node of such a mesh); `launch`
runs them through `torch.distributed.run` and returns the exit status, naming failed ranks and where
they were (`runtime.faults`), or, when a signal stopped the launcher (`launcher_signals`), the signal and the
checkpoint `--resume` continues from, with the status 128 + the signal's number.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import re
import shlex
import shutil
import signal
import sys
import tempfile
import threading
from dataclasses import dataclass

from plandsl import ir
from plandsl.diagnostics import Diagnostic, diag
from plandsl.diagnostics.internal import Interrupted, interruption
from plandsl.diagnostics.limits import MAX_LOCAL_RANKS
from plandsl.runtime import faults
from plandsl.runtime.options import format_params, forward, option_problem, parse_args, parse_params
from plandsl.runtime.resume import CheckpointError, latest, launch_refusal
from plandsl.syntax.loader import included
from plandsl.check.analysis import load_plan


class LaunchError(ValueError):
    """The options do not fit the plan (e.g. the process count): `diagnostic` says how, with its code (E710-E715;
    `plandsl.api` raises it as a PlanError), at the plan's mesh where the mesh is what they do not fit."""

    def __init__(self, diagnostic: Diagnostic):
        super().__init__(diagnostic.message)
        self.diagnostic = diagnostic


class OptionError(ValueError):
    """One option's value is wrong on its own, or (`missing`) an option needed is not given (the CLI's usage
    error, exit 2, naming `option`): no diagnostic, so not a LaunchError."""

    def __init__(self, option: str, message: str, missing: bool = False):
        super().__init__(message)
        self.option = option
        self.missing = missing


@dataclass(frozen=True)
class LaunchOptions:
    nproc_per_node: int | None = None
    """Processes on this node; default: the mesh's size divided by `nnodes`."""
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    """HOST:PORT of node 0 (several nodes); one node uses a private local rendezvous."""
    # What the ranks take (`runtime.options.RANK_OPTIONS`, by `dest`; tests/unit/test_launch.py checks that
    # every option of the table but --plan/--param/--include, which come with the plan, is a field here).
    steps: int = 10
    metrics: str | None = None
    check_equivalence: bool = False
    data: str | None = None
    timeout: float | None = None
    """Seconds a collective may wait; None: the ranks' default (`parallel.mesh.DEFAULT_TIMEOUT_S`)."""
    checkpoint_dir: str | None = None
    """Checkpoints go here (docs/running.md, Checkpoints); None: none."""
    checkpoint_every: int | None = None
    resume: bool = False
    device: str | None = None
    """cpu, cuda, or None: cuda where this machine has a GPU (`parallel.mesh.resolve_device`)."""


def check_options(options: LaunchOptions) -> None:
    """OptionError for a value wrong before any plan is read: a node rank past --nnodes, a malformed endpoint."""
    if options.node_rank >= options.nnodes:
        raise OptionError("--node-rank", f"{options.node_rank} is not below --nnodes ({options.nnodes}): nodes are "
                                         f"numbered 0 to {options.nnodes - 1}")
    if options.rdzv_endpoint is not None and endpoint_problem(options.rdzv_endpoint):
        raise OptionError("--rdzv-endpoint", f"'{options.rdzv_endpoint}': {endpoint_problem(options.rdzv_endpoint)}")


def endpoint_problem(endpoint: str) -> str | None:
    """What torchrun would refuse in HOST:PORT (torch.distributed.elastic.rendezvous.utils.parse_rendezvous_endpoint's
    rules, the endpoint stripped of surrounding whitespace first as it strips it, and no leading '-', which its argument
    parser reads as an option), or None."""
    host, sep, port = endpoint.strip().rpartition(":")
    if not sep or not host or not re.fullmatch(r"[0-9]{1,5}", port) or not 0 < int(port) < 65536:
        return "expected HOST:PORT with a port from 1 to 65535"
    name = host[1:-1] if len(host) > 1 and host[0] == "[" and host[-1] == "]" else host  # [::1]:29500
    if not re.fullmatch(r"[\w.:-]+", name) or host.startswith("-"):
        return ("expected HOST:PORT with HOST a host name, an IPv4 address or an IPv6 address in brackets "
                "([::1]:29500)")
    return None


def prepare(plan: ir.Plan, plan_file: str, plan_name: str | None, params: dict, options: LaunchOptions,
            dry_run: bool = False) -> list[str]:
    """torchrun's arguments for a checked, runnable plan: OptionError when `--data` does not fit the plan,
    LaunchError when the options do not fit its mesh, or (unless `dry_run`, which starts nothing here) when
    the mesh is larger than this machine and the options do not say how (`check_fits`); and, a dry run too, when
    `--resume` names a checkpoint the plan cannot resume (E721, `resume.launch_refusal`)."""
    if options.data:
        from plandsl.runtime.tokens import token_file_problem  # lazy: numpy, only when a token file is given
        problem = token_file_problem(options.data, plan)
        if problem:
            raise OptionError("--data", problem)
    args = torchrun_args(plan, plan_file, plan_name, params, options)
    if not dry_run:
        check_fits(plan, options)
        check_devices(int(args[args.index("--nproc-per-node") + 1]), options.device, plan.mesh.size)
    # E721: before any rank starts (the ranks check the model's shapes too); in a dry run too, as it only reads the
    # record, and a folder this machine does not see (the cluster's) is no refusal
    refused = launch_refusal(plan, options.checkpoint_dir) if options.resume and options.checkpoint_dir else None
    if refused is not None:
        raise LaunchError(refused)
    return args


def torchrun_args(plan: ir.Plan, plan_file: str, plan_name: str | None, params: dict, options: LaunchOptions) -> list[str]:
    command = rank_command(plan_file, plan_name, params, options)
    size = plan.mesh.size
    nproc = options.nproc_per_node or size // options.nnodes
    if nproc * options.nnodes != size:
        raise LaunchError(diag("E710", f"plan '{plan.name}': mesh has {size} devices, but nnodes({options.nnodes}) "
                                       f"* nproc-per-node({nproc}) = {nproc * options.nnodes}",
                               plan.mesh.span or plan.span, hint=_count_hint(plan, options)))
    if options.nnodes > 1:
        if not options.rdzv_endpoint:
            raise LaunchError(diag("E712", f"--nnodes {options.nnodes} needs --rdzv-endpoint HOST:PORT (node 0's "
                                           "address)", hint=ENDPOINT_HINT))
        args = ["--nnodes", str(options.nnodes), "--node-rank", str(options.node_rank),
                "--rdzv-endpoint", options.rdzv_endpoint]
    else:
        args = ["--standalone"]
    return args + ["--nproc-per-node", str(nproc), *command]


ENDPOINT_HINT = ("give every node the same --rdzv-endpoint HOST:PORT: node 0's host name or address and a free port, "
                 "where the nodes meet before training (docs/running.md); `plandsl run --dry-run` prints each node's "
                 "command")


def _count_hint(plan: ir.Plan, options: LaunchOptions) -> str:
    """What makes nodes x processes per node the mesh's size: the processes for these nodes, the nodes for these
    processes, and the fewest nodes of at most a machine's devices each (`even_nodes`), which `--nnodes` alone
    gives."""
    size, nodes = plan.mesh.size, even_nodes(plan)
    fits = []
    if options.nproc_per_node and size % options.nnodes == 0 and size // options.nnodes <= MAX_LOCAL_RANKS:
        fits.append(f"--nproc-per-node {size // options.nnodes}"
                    + (" (its default)" if options.nnodes == 1 and nodes == 1 else ""))
    if options.nproc_per_node and size % options.nproc_per_node == 0 and size // options.nproc_per_node > 1:
        fits.append(f"--nnodes {size // options.nproc_per_node} with --nproc-per-node {options.nproc_per_node}")
    even = (f"--nnodes {nodes} with --nproc-per-node {size // nodes}" if nodes > 1 else
            f"--nnodes 1 (--nproc-per-node {size}, its default)")
    if even not in fits and (nodes > 1 or not fits):
        fits.append(even)
    return (f"a node starts one process per device of the mesh on it: give {' or '.join(fits)}, so that every "
            "device has its rank")


def even_nodes(plan: ir.Plan) -> int:
    """The fewest nodes `plandsl run` starts the mesh on, each the same number of processes (`--nnodes N`, the
    mesh's size over N on every node), none more than a machine of the plan's cluster has devices (or
    MAX_LOCAL_RANKS): the least divisor of the size not below the size over that, rounded up. A prime size
    larger than a machine is one process per node."""
    size = plan.mesh.size
    least = -(-size // min(max(group.node.host_devices for group in plan.cluster.groups), MAX_LOCAL_RANKS))
    divisors = {d for i in range(1, math.isqrt(size) + 1) if size % i == 0 for d in (i, size // i)}
    return min(d for d in divisors if d >= least)


def rank_command(plan_file: str, plan_name: str | None, params: dict, options: LaunchOptions) -> list[str]:
    """What torchrun starts on every rank, the same on every node: `-m plandsl.run PLAN` and the rank options
    given (`runtime.options.forward`); LaunchError E713 for options that need another (`option_problem`)."""
    values = dataclasses.asdict(options)
    problem = option_problem(values)
    if problem:
        raise LaunchError(diag("E713", problem, hint="give --checkpoint-dir D, the folder each rank writes its "
                                                     "checkpoints to and resumes from (docs/running.md, Checkpoints)"))
    values.update(plan_name=plan_name, param=format_params(params),  # the ranks read the plan's imports
                  include=[os.path.abspath(folder) for folder in included()])  # from the same folders
    return ["-m", "plandsl.run", plan_file, *forward(values)]


def check_fits(plan: ir.Plan, options: LaunchOptions) -> None:
    """Refuse to start, on this machine alone, a mesh larger than one node of the plan's cluster, unless
    `--nproc-per-node` or `--nnodes` says how: a 1,024-device plan started by mistake would fork 1,024 ranks
    here (E711, at the mesh). The suggested node count is `even_nodes`, which `torchrun_args` takes."""
    per_node = max(group.node.host_devices for group in plan.cluster.groups)
    if options.nnodes > 1 or options.nproc_per_node is not None or plan.mesh.size <= per_node:
        return
    nodes, even = -(-plan.mesh.size // per_node), even_nodes(plan)
    here = (f", or give --nproc-per-node {plan.mesh.size} to start all {plan.mesh.size} ranks on this machine"
            if plan.mesh.size <= MAX_LOCAL_RANKS else "")
    what = "nodes" if all(group.node.hosts == 1 for group in plan.cluster.groups) else "machines"
    raise LaunchError(diag(
        "E711", f"plan '{plan.name}': its mesh spans {plan.mesh.size} devices, {nodes} {what} of cluster "
                f"'{plan.cluster.name}' ({per_node} devices each), and nothing says how to start them: this machine "
                f"alone would start all {plan.mesh.size} ranks", plan.mesh.span or plan.span,
        hint=f"start it on every {what[:-1]} with --nnodes {even} --node-rank R --rdzv-endpoint HOST:PORT "
             + (f"(`plandsl run --dry-run` prints each one's command; docs/running.md){here}" if even == nodes else
                f"({plan.mesh.size // even} process{'es' if plan.mesh.size // even > 1 else ''} on each: `plandsl "
                f"run` starts as many on every {what[:-1]}, and {plan.mesh.size} does not split evenly over {nodes}; "
                f"docs/running.md), or on each of its {nodes} {what} the torchrun command `plandsl run --dry-run` "
                f"prints{here}")))


def check_devices(nproc: int, device: str | None, size: int | None = None) -> None:
    """Refuse, before any rank starts, ranks this machine has no device for: with CUDA each of the node's
    `nproc` processes takes its own GPU (cuda:LOCAL_RANK, nccl), so a node with fewer GPUs than processes
    would fail in every rank at once (E714: its hint the processes per node and nodes that start the mesh's `size`
    on such nodes); `--device cuda` on a machine without one likewise (OptionError)."""
    gpus = cuda_device_count()
    if device == "cuda" and gpus == 0:
        raise OptionError("--device", "cuda: this machine has no CUDA device torch can use; give --device cpu")
    if device != "cpu" and 0 < gpus < nproc:
        raise LaunchError(diag("E714", f"this node starts {nproc} processes and each takes a GPU of its own, but "
                                       f"torch sees {gpus} (CUDA_VISIBLE_DEVICES may narrow them)",
                               hint=f"give {_fewer_per_node(gpus, size)}, or --device cpu to run the ranks on the CPU "
                                    "with gloo"))


def _fewer_per_node(gpus: int, size: int | None) -> str:
    """At most `gpus` processes on each node, as many on every node: the largest divisor of the mesh's `size` not
    above `gpus`, with the nodes that makes (`plandsl run` starts the same number on every node)."""
    if size is None:
        return f"at most --nproc-per-node {gpus} with more nodes"
    nproc = max(d for d in range(1, gpus + 1) if size % d == 0)
    return f"--nproc-per-node {nproc} with --nnodes {size // nproc} (and --rdzv-endpoint)" if size > nproc \
        else f"--nproc-per-node {nproc}"


def cuda_device_count() -> int:
    """GPUs torch can use here; 0 without CUDA."""
    import torch  # lazy: torch only to launch (see `launch`)
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def command_line(args: list[str]) -> str:
    """The same launch as a shell command."""
    return shlex.join(["torchrun", *args])


NODE_RANK, ENDPOINT = "NODE_RANK", "HOST:PORT"  # placeholders of the commands `dry_run_commands` prints


def dry_run_commands(plan: ir.Plan, args: list[str], options: LaunchOptions) -> str:
    """What `run --dry-run` prints after its table: the launch `args` as a command, as the options give it;
    or, when they say nothing of nodes and the mesh spans more than one node of the plan's cluster (so that
    `check_fits` would refuse to start it here), the command for every node: `--nnodes N --node-rank
    NODE_RANK --rdzv-endpoint HOST:PORT --nproc-per-node D` (D: the devices of a node), with a line that says
    what to put for the placeholders. Nodes holding different numbers of the mesh's devices (node types of
    several sizes, a mesh ending inside a node) get one command per size, naming the nodes."""
    if options.nnodes > 1 or options.nproc_per_node is not None or \
            plan.mesh.size <= max(group.node.host_devices for group in plan.cluster.groups):
        return command_line(args)
    tail = args[args.index("-m"):]  # `-m plandsl.run PLAN ...`: the same on every node
    nodes = _devices_per_node(plan)
    lines = [f"# on each of the {len(nodes)} nodes, NODE_RANK its index (0 to {len(nodes) - 1}, node 0 first) and "
             f"{ENDPOINT} node 0's address and a free port (docs/running.md, several machines):"]
    for count in sorted(set(nodes)):
        which = "" if len(set(nodes)) == 1 else \
            f"# nodes {index_ranges([i for i, n in enumerate(nodes) if n == count])} ({count} devices each):\n"
        lines.append(which + command_line(["--nnodes", str(len(nodes)), "--node-rank", NODE_RANK,
                                           "--rdzv-endpoint", ENDPOINT, "--nproc-per-node", str(count), *tail]))
    return "\n".join(lines)


def _devices_per_node(plan: ir.Plan) -> list[int]:
    return [count for _, count in mesh_nodes(plan)]


def mesh_nodes(plan: ir.Plan) -> list[tuple[ir.NodeType, int]]:
    """Each machine the mesh uses (torchrun's node: a plan's node, or one of its `hosts` when its devices span
    several, as a GB200 NVL72's 18 trays of 4), in the cluster's order, with its node type and how many of the
    mesh's devices it holds (the mesh takes `mesh.size` devices from `mesh.first_device` on). Counted per node
    group, not per device."""
    start, end = plan.mesh.first_device, plan.mesh.first_device + plan.mesh.size
    nodes: list[tuple[ir.NodeType, int]] = []
    first = 0
    for group in plan.cluster.groups:
        devices = group.node.host_devices
        last = first + group.count * group.node.devices
        low, high = max(start, first), min(end, last)
        for node in range((low - first) // devices, (high - 1 - first) // devices + 1) if low < high else ():
            nodes.append((group.node, min(high, first + (node + 1) * devices) - max(low, first + node * devices)))
        first = last
    return nodes


def index_ranges(indices: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    parts, start = [], None
    for i, value in enumerate(indices):
        if start is None:
            start = value
        if i + 1 == len(indices) or indices[i + 1] != value + 1:
            parts.append(str(start) if start == value else f"{start}-{value}")
            start = None
    return ", ".join(parts)


def threads_per_process(cores: int, nproc: int) -> int:
    """OMP_NUM_THREADS for each of a node's `nproc` ranks: its `cores` shared out (torchrun would give 1)."""
    return max(1, cores // nproc)


def launch(args: list[str]) -> int:
    """torchrun with `args` in this process: 0, 1 with the failed ranks named on stderr (`failure_message`), 128 + N
    for a signal that stopped it (`interrupted_message`); LaunchError E722 for nodes that did not meet."""
    # lazy: torch only to launch; `plandsl run` checks the plan and its options without it
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError  # lazy: torch (as above)
    from torch.distributed.elastic.rendezvous.api import RendezvousError  # lazy: torch (as above)
    from torch.distributed.run import parse_args, run  # lazy: torch (as above)
    nproc = int(args[args.index("--nproc-per-node") + 1])
    # torchrun would set 1 thread per process (and warn); share this machine's cores out instead.
    os.environ.setdefault("OMP_NUM_THREADS", str(threads_per_process(os.cpu_count() or 1, nproc)))
    # Each rank keeps its position (and its error, when it raises) in this directory (runtime.faults).
    directory = tempfile.mkdtemp(prefix="plandsl-run-")
    previous = os.environ.get(faults.DIR_ENV)
    os.environ[faults.DIR_ENV] = directory
    try:
        with launcher_signals(), quiet_agent():
            run(parse_args(args))
    except ChildFailedError as error:
        print(failure_message(error, faults.read_records(directory), _plan_of(args)), file=sys.stderr, flush=True)
        return 1
    except Interrupted as error:  # Ctrl-C, a scheduler's SIGTERM: torch's agent sent it on and stopped the ranks
        print(interrupted_message(error.signum, _checkpoint_dir(args)), file=sys.stderr, flush=True)
        return interruption(error)[1]
    except (RendezvousError, DistError) as error:  # the nodes did not meet before any rank started: node 0
        # unreachable or not started (torch's static rendezvous, --rdzv-endpoint without --rdzv-backend, raises its
        # store's DistNetworkError or DistStoreError; the c10d one a RendezvousError)
        raise LaunchError(nodes_apart(args, error)) from None
    finally:
        if previous is None:
            os.environ.pop(faults.DIR_ENV, None)
        else:
            os.environ[faults.DIR_ENV] = previous
        shutil.rmtree(directory, ignore_errors=True)
    return 0


def nodes_apart(args: list[str], error: Exception) -> Diagnostic:
    """E722: the launch's nodes did not meet at the rendezvous (`--rdzv-endpoint`), so no rank started."""
    endpoint = args[args.index("--rdzv-endpoint") + 1] if "--rdzv-endpoint" in args else None
    if endpoint is None:  # one machine: torch's standalone rendezvous on a local port
        return diag("E722", f"the processes of this machine did not meet (torch's standalone rendezvous on this host; "
                            f"{type(error).__name__}: {error}); no rank started",
                    hint="the processes meet over a local TCP port: check that this host's name resolves and that "
                         "nothing (a firewall on the loopback interface, a proxy setting) refuses the connection")
    nodes = args[args.index("--nnodes") + 1]
    return diag("E722", f"the {nodes} nodes did not meet at --rdzv-endpoint {endpoint} ({type(error).__name__}: "
                        f"{error}); no rank started", hint=ENDPOINT_HINT + "; start node 0 first, and open its port "
                                                                       "in a firewall")


SAID_AGAIN = ("failed (exitcode", "Sending process %s closing signal")
"""The log lines of torch's launcher (`torch.distributed.elastic.multiprocessing.api`, at ERROR and WARNING: `E1208
02:24:46 ... failed (exitcode: 1) local_rank: 0 (pid: 4428) of binary: ...`, which reads like one of plandsl's codes)
that plandsl's own message says again: the failed ranks with their exit status and pid, the others stopped
(`failure_message`, `interrupted_message`, profile's E720)."""


class _SaidAgain(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(record.msg, str) and record.msg.startswith(SAID_AGAIN))


@contextlib.contextmanager
def quiet_agent():
    """Around `torch.distributed.run.run`: its launcher's lines that plandsl's own message says again left out
    (`SAID_AGAIN`); every other line of it (a rank that does not exit when told, its own warnings) kept."""
    logger = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    said = _SaidAgain()
    logger.addFilter(said)
    try:
        yield
    finally:
        logger.removeFilter(said)


STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
"""The signals torch's launcher takes over while its ranks run (TORCHELASTIC_SIGNALS_TO_HANDLE's default)."""


@contextlib.contextmanager
def launcher_signals():
    """Around `torch.distributed.run.run` (`launch`, and `plandsl profile`'s ranks): its SignalException as
    `Interrupted` (`diagnostics.internal`), and the handlers it sets for `STOP_SIGNALS` (which it leaves in place)
    put back as they were, so that a signal once it returned ends this process as before, not as a SignalException
    nothing expects (E108)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException  # lazy: torch, only to launch
    saved = {sig: signal.getsignal(sig) for sig in (getattr(signal, name, None) for name in STOP_SIGNALS) if sig}
    try:
        yield
    except SignalException as error:
        raise Interrupted(error.sigval) from None
    finally:
        if threading.current_thread() is threading.main_thread():  # torch sets them only there, as it may
            for sig, handler in saved.items():
                if handler is not None:  # None: not set from Python, nothing to put back
                    signal.signal(sig, handler)


def interrupted_message(signum: int, checkpoint_dir: str | None) -> str:
    """What `plandsl run` prints when a signal stopped its launcher (`Interrupted`): the signal by name and, with
    `--checkpoint-dir`, the latest checkpoint there, which the same command with `--resume` continues from, or that
    none was written (a checkpoint begun but not committed does not count: `resume.latest`)."""
    lines = [f"plandsl run: interrupted by {signal.Signals(signum).name}; the ranks were stopped"]
    if checkpoint_dir is not None:
        try:
            path = latest(checkpoint_dir)
        except (CheckpointError, OSError) as error:  # a folder of too many entries, or one that cannot be listed
            lines.append(f"  cannot tell which checkpoint --resume continues from: {error}")
            return "\n".join(lines)
        if path is None:
            lines.append(f"  no checkpoint in {checkpoint_dir}: none was written before the signal; the same command "
                         "starts again at step 1")
        else:
            lines.append(f"  latest checkpoint: step {int(path.name.split('-')[1])} ({path}); the same command with "
                         "--resume continues from it")
    return "\n".join(lines)


def _checkpoint_dir(args: list[str]) -> str | None:
    """The ranks' `--checkpoint-dir`, from their arguments; None without one."""
    return parse_args(args[args.index("plandsl.run") + 1:]).checkpoint_dir


def _plan_of(args: list[str]) -> ir.Plan | None:
    """The plan the ranks ran, from their arguments (for the schedule grid); None if it will not load."""
    try:
        ranks = parse_args(args[args.index("plandsl.run") + 1:])
        return load_plan(ranks.plan, ranks.plan_name, parse_params(ranks.param))
    except (Exception, SystemExit):  # noqa: BLE001 - the message is still given, without the grid
        return None


def failure_message(error, records: dict | None = None, plan: ir.Plan | None = None) -> str:
    """One line per failed rank, the root cause first, each with where it was (`records`: what the ranks
    left, `faults.read_records`); where the stopped ranks were; the pipeline's step x rank grid. Where every failed
    rank refused the job before training (its diagnostic printed, `faults.report_refusal`), one line saying so."""
    records = records or {}
    refused = sorted({records[rank].refused for rank in error.failures if rank in records and records[rank].refused})
    if refused and all(rank in records and records[rank].refused for rank in error.failures):
        return (f"plandsl run: the ranks refused the job before training ({', '.join(refused)}, above): no step was "
                "trained, nothing written")
    cause = root_cause(error, records)
    lines = ["plandsl run: the job failed; the other ranks were stopped"]
    for rank in sorted(error.failures, key=lambda r: (r != cause, r)):
        failure = error.failures[rank]
        how = (f"killed by {failure.signal_name()}" if failure.exitcode < 0
               else f"exited with status {failure.exitcode}")
        label = " (root cause)" if rank == cause else ""
        lines.append(f"  rank {rank}{label}: {how} (local rank {failure.local_rank}, pid {failure.pid})"
                     + faults.record_text(records.get(rank)))
    stopped = [f"rank {rank} at {records[rank].where()}" for rank in sorted(records) if rank not in error.failures]
    if stopped:
        lines.append("  stopped by the launcher: " + "; ".join(stopped))
    grid = faults.pipeline_grid(plan, records, cause)
    if grid:
        lines.append(grid)
    return "\n".join(lines)


def root_cause(error, records: dict | None = None) -> int:
    """The rank that failed first. A rank killed by a signal the launcher does not send (it sends
    SIGTERM) comes before ranks that exited with an error: those usually only saw their peer vanish
    (`Connection reset by peer`), and may have reported it before the launcher noticed the death.
    Among ranks that raised, the earliest report wins (torchrun's timestamps are whole seconds)."""
    killed = [rank for rank, failure in error.failures.items()
              if failure.exitcode < 0 and failure.signal_name() != "SIGTERM"]
    if killed:
        return min(killed, key=lambda rank: error.failures[rank].timestamp)
    reported = [rank for rank in error.failures if records and rank in records and records[rank].time is not None]
    if reported:
        return min(reported, key=lambda rank: records[rank].time)
    return error.get_first_failure()[0]
