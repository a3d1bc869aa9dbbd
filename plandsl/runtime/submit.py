"""`plandsl launch`: a checked plan submitted to a cluster scheduler (Slurm, Kubernetes) through TorchX.

Stage: interpreter (the launcher side; TorchX is imported only to build and submit the job, torch not at all).
Contract: `refusals` is what `plandsl run` refuses and E707 for a mesh whose nodes TorchX cannot start as one
job; `app` builds the job with TorchX's own `dist.torchrun` component (a node per machine of the mesh: a plan
node, or each of its `hosts`, each running torchrun over `plandsl.run` with `runtime.launch.rank_command`'s
arguments, in the environment the plan needs);
`submit` hands it to TorchX's runner: its dry run (the sbatch script, the Volcano job) or its submission.
No launcher of our own: TorchX writes the scheduler's job, the scheduler starts the nodes, torchrun the ranks.
"""
from __future__ import annotations

import difflib
import importlib
import re
import subprocess
import warnings
from dataclasses import dataclass
from typing import Any

from plandsl import ir
from plandsl.diagnostics import Diagnostic, Note, diag
from plandsl.runtime import support
from plandsl.runtime.launch import LaunchError, LaunchOptions, OptionError, index_ranges, mesh_nodes, \
    rank_command, threads_per_process

SCHEDULERS = ("slurm", "kubernetes")
"""TorchX's schedulers `plandsl launch` submits to (`plandsl.api.launch_schedulers` repeats them for the CLI)."""
IMAGE = re.compile(r"[A-Za-z0-9_./:@#+=~-]{1,4096}")
"""A container image as `--image` takes it: a registry reference, enroot/pyxis's `nvcr.io#...`, a .sqsh path."""
EXTRA = "pip install 'plandsl[launch]'"
"""How to install TorchX (torchx-nightly: the 0.7.0 release pins urllib3<1.27; README, Install)."""


class JobError(ValueError):
    """TorchX refused the job or its scheduler options (E718), or could not hand it to the scheduler (E719); E717
    (`TorchXMissing`) when it is not installed. `.diagnostic` says which, with TorchX's own message in it."""

    def __init__(self, diagnostic: Diagnostic):
        super().__init__(diagnostic.message)
        self.diagnostic = diagnostic


class TorchXMissing(JobError):
    """TorchX (or the Kubernetes client its kubernetes scheduler needs) is not installed: E717."""


def _refused(scheduler: str, message: str, hint: str) -> JobError:
    """E718: TorchX refuses the scheduler or one of its options (`message` holds TorchX's own words)."""
    return JobError(diag("E718", message, hint=f"{hint}`torchx runopts {scheduler}` lists the scheduler's options, "
                                               "their types and defaults"))


def _unreached(job: JobOptions, what: str, error: Exception, caught) -> JobError:
    """E719: TorchX could not check the job with the scheduler or submit it (no `sbatch`, no cluster); what it
    warned of on the way (often the cause: no kubeconfig) as notes."""
    refused = job.scheduler == "slurm" and isinstance(error, subprocess.CalledProcessError)  # sbatch ran: said no
    where = ("sbatch ran here and refused the job (its own message is above): mend what it names (a --cfg option "
             "such as partition or time, --cpu, --mem-mb)" if refused else
             "run it where `sbatch` runs, a login node of the Slurm cluster" if job.scheduler == "slurm" else
             "check that the current kubeconfig (`kubectl config current-context`) reaches the cluster's API server "
             "and that Volcano runs there" if job.scheduler == "kubernetes" else
             f"check that TorchX's {job.scheduler} scheduler can reach its cluster from here")
    return JobError(diag("E719", f"TorchX could not {what} {job.scheduler}: {error}",
                         hint=f"{where}; --dryrun prints the job without handing it over",
                         notes=[Note(f"TorchX warned: {note}") for note in _notes(caught)]))


@dataclass(frozen=True)
class JobOptions:
    scheduler: str
    """slurm or kubernetes (`SCHEDULERS`)."""
    cfg: tuple[str, ...] = ()
    """The scheduler's options as TorchX takes them (`KEY=VALUE[,KEY=VALUE]`; `torchx runopts SCHEDULER`)."""
    image: str | None = None
    """The container every node runs (kubernetes; slurm runs in the submitting folder's environment)."""
    cpu: int = 2
    """CPUs per node; 2 and 1,024 MB are the defaults of TorchX's dist.torchrun."""
    mem_mb: int = 1024
    name: str | None = None
    """The job's name; None: the plan's."""
    dryrun: bool = False
    """Build the scheduler's job (TorchX's dry run) and return it as text; submit nothing."""


@dataclass(frozen=True)
class Submitted:
    text: str
    """The dry run as TorchX prints it (the sbatch script, the Volcano job as YAML), or the job's handle."""
    handle: str | None
    """The job's TorchX handle (`slurm://torchx/1234`) when it was submitted; None for a dry run."""
    warnings: tuple[str, ...] = ()
    """What TorchX warned of on the way (no `sinfo` on this machine, ...)."""


JOB_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,62}")
"""A job's name: TorchX writes it unquoted into the sbatch script's `#SBATCH --job-name=` lines (a newline added a
directive of its own, a space split it into options), into each node's log file names (`/` named a folder) and
reads `a/b` as experiment `a`, run `b`; Kubernetes names are at most 63 characters."""
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def check_job_options(job: JobOptions) -> None:
    """OptionError for an option the scheduler cannot do without (kubernetes runs every node in a container), a
    `--name` that is not one word of letters, digits, `_`, `.` and `-`, and an image or scheduler option holding
    a control character (a newline ends the line TorchX writes it on)."""
    if job.scheduler == "kubernetes" and not job.image:
        raise OptionError("--image", "kubernetes runs every node in a container: give the image, one with plandsl "
                                     "and torch installed and the plan's files at the path given", missing=True)
    if job.name is not None and not JOB_NAME.fullmatch(job.name):
        raise OptionError("--name", f"{job.name!r}: a job's name is one word of letters, digits, `_`, `.` and `-` "
                                    "(at most 63, not starting with `.` or `-`)")
    for option, values in (("--image", [job.image] if job.image else []), ("--cfg", job.cfg)):
        for value in values:
            if _CONTROL.search(value) or (option == "--image" and value != value.strip()):
                raise OptionError(option, f"{value!r} holds a control character or edge space (a newline ends the "
                                          "line of the job TorchX writes it on)")
    if job.image is not None and not IMAGE.fullmatch(job.image):
        # TorchX fills `${img_root}` with the image inside the node's already quoted command (slurm without a
        # workspace): a quote in it would end the quoting and run what follows on every node
        raise OptionError("--image", f"{job.image!r}: an image is letters, digits and `_./:@#+=~-` (a registry "
                                     "reference, enroot's `nvcr.io#...`, a .sqsh path)")


def refusals(plan: ir.Plan, cuda: bool = True) -> list[Diagnostic]:
    """Every reason `plandsl launch` refuses a checked plan: what `plandsl run` refuses with ranks on CUDA
    (`cuda`, the default: a cluster's nodes compute on their GPUs), then E707 for its nodes."""
    return support.refusals(plan, cuda=cuda) + node_refusals(plan)


def node_refusals(plan: ir.Plan) -> list[Diagnostic]:
    """E707 when the nodes the mesh spans differ in how many of its devices they hold, or in their type:
    TorchX's dist.torchrun is one role, the same node type and process count on every node."""
    nodes = mesh_nodes(plan)
    counts = [count for _, count in nodes]
    kinds = sorted({node.name for node, _ in nodes})
    span = plan.mesh.span or plan.span
    yourself = "or start each node yourself: `plandsl run --dry-run` prints its command"
    if len(set(counts)) > 1:
        per = max(node.host_devices for node, _ in nodes)
        whole = sorted({size for size in (plan.mesh.size // per * per, -(-plan.mesh.size // per) * per) if size})
        hint = f"give the mesh whole nodes ({' or '.join(map(str, whole))} devices, {per} a node), {yourself}"
        held = ", ".join(f"{'node' if len(at) == 1 else 'nodes'} {index_ranges(at)}: {count}"
                         for count in sorted(set(counts), reverse=True)
                         for at in [[i for i, c in enumerate(counts) if c == count]])
        return [diag("E707", f"plan '{plan.name}': its {plan.mesh.size} devices fill the {len(nodes)} nodes they "
                             f"span unevenly ({held}); a TorchX job starts the same number of processes on every "
                             "node", span, hint=hint)]
    if len(kinds) > 1:
        return [diag("E707", f"plan '{plan.name}': its mesh spans nodes of {len(kinds)} types ({', '.join(kinds)}); "
                             "a TorchX job asks the scheduler for nodes of one kind", span,
                     hint=f"keep the mesh on nodes of one type (`over nodes[a:b]`), {yourself}")]
    return []


def environment(plan: ir.Plan, cuda: bool, cpu: int, nproc: int) -> dict[str, str]:
    """What every node's torchrun starts in, besides what TorchX sets:

    1. OMP_NUM_THREADS: the node's CPUs shared out among its ranks, as `plandsl run` does on one machine
       (`launch.threads_per_process`; torchrun alone would set 1).
    2. CUDA_DEVICE_MAX_CONNECTIONS=1 where Megatron-LM requires it: tensor or context parallelism (degree > 1)
       on GPUs, unless the data axis is sharded with FSDP (ZeRO-2/3, hsdp), which wants several hardware
       queues (Megatron-LM's `validate_args`: one queue makes the kernels start in the order they are issued,
       so each layer's communication goes ahead of the computation it overlaps; with FSDP it only warns)."""
    env = {"OMP_NUM_THREADS": str(threads_per_process(cpu, nproc))}
    fsdp = plan.data is not None and plan.data.kind.sharded
    if cuda and (plan.tp > 1 or plan.cp > 1) and not fsdp:
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    return env


def node_command(plan_file: str, plan_name: str | None, params: dict, ranks: LaunchOptions) -> list[str]:
    """`rank_command` as every node of the job runs it (`-m plandsl.run PLAN [rank options]`): LaunchError E713 for
    rank options that need another, E715 for an argument holding `$`, which TorchX would fill in."""
    command = rank_command(plan_file, plan_name, params, ranks)
    for argument in command[2:]:
        if "$" in argument:  # TorchX's string.Template runs over the quoted command: $$ -> $, ${img_root} -> the image
            raise LaunchError(diag("E715", f"{argument!r}: TorchX substitutes `$` in a job's arguments "
                                           "(`${img_root}`, `${app_id}`, `$$`), so a node would read another value",
                                   hint="rename the file or folder, or give the value without `$` (the plan file, an "
                                        "--include folder, --metrics, --checkpoint-dir, --data, a --param)"))
    return command


def app(plan: ir.Plan, plan_file: str, plan_name: str | None, params: dict, ranks: LaunchOptions, job: JobOptions):
    """The job as TorchX's `AppDef`, built by its `dist.torchrun` component: `nodes x processes` from the mesh
    (a plan `refusals` passed), GPUs per node as many as processes unless the ranks run on the CPU, each node
    running `torchrun ... -m plandsl.run PLAN [rank options]` (`node_command`'s LaunchError otherwise)."""
    command = node_command(plan_file, plan_name, params, ranks)  # ["-m", "plandsl.run", PLAN, ...]
    nodes = mesh_nodes(plan)
    nproc, cuda = nodes[0][1], ranks.device != "cpu"
    dist = _torchx("torchx.components.dist")
    name = job.name or plan.name
    options: dict[str, Any] = {"image": job.image} if job.image else {}
    application = dist.torchrun(*command[2:], m=command[1], name=name, j=f"{len(nodes)}x{nproc}", cpu=job.cpu,
                                memMB=job.mem_mb, gpu=nproc if cuda else 0,
                                env=environment(plan, cuda, job.cpu, nproc), **options)
    application.roles[0].name = name  # the scheduler's name for each node's part (`squeue`), not `run`
    return application


def submit(application, job: JobOptions) -> Submitted:
    """TorchX's dry run of `application` on `job.scheduler` with its options: the scheduler's job as text
    (`job.dryrun`), or that job submitted and its handle. JobError for options TorchX refuses (named, with the
    options it knows; E718), an unknown scheduler (E718) and a scheduler that refuses the job or cannot be
    reached (E719); TorchXMissing (E717) when TorchX or the Kubernetes client is not installed. The job is first
    dry-run without asking the cluster (kubernetes' `validate_spec` off): an exception there other than TorchX's
    refusal is a bug, raised as it is (E108), whether the job is then submitted or not."""
    runner_api = _torchx("torchx.runner")
    specs = _torchx("torchx.specs")
    with warnings.catch_warnings(record=True) as caught, runner_api.get_runner() as runner:
        warnings.simplefilter("always")
        factories = _torchx("torchx.schedulers").get_scheduler_factories
        cfg = _cfg(runner, job, specs.InvalidRunConfigException, factories)
        offline, validated = _offline(runner.scheduler_run_opts(job.scheduler), cfg)
        try:  # the job as TorchX writes it, asking no cluster: what fails here fails in a dry run too
            info = runner.dryrun(application, job.scheduler, cfg=offline)
        except (specs.InvalidRunConfigException, ValueError) as error:
            raise _refused(job.scheduler, f"TorchX's {job.scheduler} scheduler: {error}", _required(str(error))) \
                from None
        except ImportError as error:
            raise TorchXMissing(_missing(error)) from None
        # any other exception is a bug (plandsl's job, or TorchX): E108, submitted or not
        if validated:  # kubernetes' validate_spec: the API server checks the job (no kubeconfig, no server, refused)
            try:
                info = runner.dryrun(application, job.scheduler, cfg=cfg)
            except ImportError as error:
                raise TorchXMissing(_missing(error)) from None
            except ValueError as error:
                if error.__cause__ is None:  # TorchX's own check on the way (a pod name past 63 characters)
                    raise _refused(job.scheduler, f"TorchX's {job.scheduler} scheduler: {error}", "") from None
                raise _unreached(job, "check the job with", error, caught) from None  # the API server refused it
            except Exception as error:  # noqa: BLE001 - the cluster's answer: only this differs from `offline`
                raise _unreached(job, "check the job with", error, caught) from None
        handle = None
        if not job.dryrun:
            try:
                handle = runner.schedule(info)
            except _scheduler_failures() as error:  # the scheduler's own (no sbatch, no cluster); else a bug: E108
                raise _unreached(job, "submit the job to", error, caught) from None
    return Submitted(handle if handle else str(info), handle, _notes(caught))


def _scheduler_failures() -> tuple[type[BaseException], ...]:
    """What a scheduler's own failure to take the job raises through TorchX's `schedule`: `sbatch` missing or failing
    (OSError, subprocess's errors), the Kubernetes API server refusing the job or not reached (the client's
    OpenApiException and ConfigException, urllib3's HTTPError), TorchX's ValueError for a job that exists. Anything
    else is a bug in the job plandsl built or in TorchX (E108), not E719, whose hint (where to submit from) would not
    help."""
    failures: list[type[BaseException]] = [OSError, subprocess.SubprocessError, ValueError]
    for module, name in (("kubernetes.client.exceptions", "OpenApiException"),
                         ("kubernetes.config.config_exception", "ConfigException"), ("urllib3.exceptions", "HTTPError")):
        try:
            failures.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):  # the kubernetes extra not installed: slurm's failures only
            continue
    return tuple(failures)


def _offline(options, cfg: dict) -> tuple[dict, bool]:
    """`cfg` with the scheduler's check of the job by its cluster turned off (kubernetes' `validate_spec`), and
    whether `cfg` asks for that check (given, or by default): TorchX's dry run without the cluster is what plandsl
    and TorchX build; the check is the cluster's, which a failure of is E719, not a bug."""
    option = options.get("validate_spec")
    if option is None:
        return cfg, False
    given = [value for key, value in cfg.items() if options.canonical_key(key) == "validate_spec"]
    if not (given[-1] if given else option.default):
        return cfg, False
    offline = {key: value for key, value in cfg.items() if options.canonical_key(key) != "validate_spec"}
    return {**offline, "validate_spec": False}, True


def _notes(caught) -> tuple[str, ...]:
    return tuple(dict.fromkeys(str(warning.message) for warning in caught))


def _required(message: str) -> str:
    """How to give a required option TorchX found missing (`Required run option: queue, ...`)."""
    missing = re.match(r"Required run option: (\S+?),", message)
    return f"give it: --cfg {missing.group(1)}=VALUE; " if missing else ""


def _cfg(runner, job: JobOptions, invalid: type[Exception], factories) -> dict:
    """The `--cfg` items parsed by the scheduler's own run options (types cast, unknown keys refused with the
    nearest one named); a dry run does not ask a Kubernetes API server to validate the job unless told to. E718
    for a scheduler TorchX does not have (`factories`: TorchX's scheduler factories) and an option it refuses."""
    cfg: dict = {}
    known = sorted(factories())
    if job.scheduler not in known:
        raise JobError(diag("E718", f"TorchX has no scheduler {job.scheduler!r} (it has {', '.join(known)})",
                            hint=f"plandsl launch submits to {' or '.join(SCHEDULERS)}: give --scheduler "
                                 f"{' or --scheduler '.join(SCHEDULERS)}"))
    options = runner.scheduler_run_opts(job.scheduler)
    for item in job.cfg:
        try:
            parsed = options.cfg_from_str(item)
        except invalid as error:  # an option it does not have (the nearest named), one given twice
            raise _refused(job.scheduler, f"--cfg {item}: TorchX's {job.scheduler} scheduler: {error}",
                           _nearest(item, options)) from None
        except ValueError as error:  # a value of the wrong type (at its option), or no KEY=VALUE at all
            raise _wrong_value(job.scheduler, item, options, error) from None
        for key, value in parsed.items():
            # slurm: TorchX writes the nodes' options unquoted on `#SBATCH` lines, which sbatch splits at spaces
            # (`partition=a --exclusive` asked for whole nodes); only the job's own go to sbatch's argument list
            if job.scheduler == "slurm" and isinstance(value, str) and re.search(r"\s", value) \
                    and key.replace("_", "-") not in SLURM_JOB_OPTIONS:
                raise _refused(job.scheduler, f"--cfg {item}: {key}'s value {value!r} holds a space: TorchX writes it "
                                              "unquoted into the sbatch script, where it would read as more than one "
                                              "option", f"give {key} one word; ")
        cfg.update(parsed)
    if job.dryrun and options.get("validate_spec") is not None and \
            not any(options.canonical_key(key) == "validate_spec" for key in cfg):
        cfg["validate_spec"] = False
    return cfg


SLURM_JOB_OPTIONS = ("comment", "mail-user", "mail-type", "account", "job-dir", "workspace-type", "image-repo")
"""TorchX's slurm options passed as `sbatch` arguments (a list: any value) or used on this machine, not written
into the script's `#SBATCH` lines."""


def _wrong_value(scheduler: str, item: str, options, error: ValueError) -> JobError:
    """E718 for a `--cfg` item TorchX cannot cast: at the option whose value is not of its type (`KEY=VALUE`, the type
    named), else (no `KEY=VALUE` pair) the item as given, with TorchX's message."""
    try:
        pairs = _torchx("torchx.specs.api").to_dict(item)
    except ValueError:
        pairs = {}
    for key, value in pairs.items():
        option = options.get(options.canonical_key(key) or key)
        if option is None:
            continue
        try:
            option.cast_to_type(value)
        except (ValueError, TypeError):
            kind = getattr(option.opt_type, "__name__", str(option.opt_type))
            return _refused(scheduler, f"--cfg {key}={value}: TorchX's {scheduler} scheduler takes {kind} for {key} "
                                       f"({error})", f"give {key} a value of type {kind}; ")
    return _refused(scheduler, f"--cfg {item}: TorchX's {scheduler} scheduler: {error}", "")


def _nearest(item: str, options) -> str:
    """' (did you mean `namespace`?)' for the first key of `item` that is no option of the scheduler."""
    known = [name for name, _ in options]
    for key in re.findall(r"(?:^|[,;])\s*([^=,;]+?)\s*=", item):
        if options.canonical_key(key) is None:
            close = difflib.get_close_matches(key, known, n=1)
            return f"did you mean `{close[0]}`? " if close else ""
    return ""


def _torchx(module: str):
    """A TorchX module, or TorchXMissing saying how to install it."""
    try:
        return importlib.import_module(module)  # TorchX only for `plandsl launch`, and only when it runs
    except ImportError as error:
        raise TorchXMissing(_missing(error)) from None


def _missing(error: ImportError) -> Diagnostic:
    """E717: what is missing (the ImportError's words) and the extra that installs it."""
    return diag("E717", f"plandsl launch needs TorchX and the Kubernetes client: {error}",
                hint=f"{EXTRA} (TorchX's nightly build and the Kubernetes client; README, Install)")
