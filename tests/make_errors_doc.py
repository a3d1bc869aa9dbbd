"""Generate docs/errors.md from plandsl.diagnostics.catalogue: `python tests/make_errors_doc.py`.

Each example is written to a temporary directory and analysed like a user's file; the
rendered diagnostics are shown with the temporary directory removed from paths (so
they read `example.plan:5:21`) and the standard library's location as `<stdlib>`.
tests/unit/test_diagnostics.py checks that docs/errors.md equals `render_errors_doc()`.
"""
from __future__ import annotations

import os
import sys
import tempfile
import textwrap
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "errors.md"

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from plandsl.check.analysis import Analysis, analyze  # noqa: E402
from plandsl.diagnostics.catalogue import ENTRIES, Entry  # noqa: E402
from plandsl.diagnostics import render_all  # noqa: E402
from plandsl.syntax.loader import stdlib_root  # noqa: E402
from plandsl.runtime.support import refusals  # noqa: E402

STAGES = [
    ("E1", "E1xx: syntax and files", "The text is not a plan; nothing after the first syntax error is checked. "
     "E105-E109: a file that cannot be read; E110: an output file that cannot be written."),
    ("E2", "E2xx: names, types, units and imports", "Found while giving the text its meaning (lowering); "
     "E22x are the shapes a model needs to run, found by the checker."),
    ("E3", "E3xx: clusters and meshes", "The device mesh against the cluster it runs on."),
    ("E4", "E4xx: placement and sharding", "Layers onto pipeline stages, tensors onto mesh axes."),
    ("E5", "E5xx: training and memory", "The batch, the schedule's needs and the memory per device."),
    ("E6", "E6xx: schedules", "Pipeline schedules, built in and user-defined."),
    ("E7", "E7xx: what plandsl run refuses", "Valid plans (they check, estimate and render) that the interpreter "
     "cannot run; `plandsl run` refuses them before any process starts, and `plandsl launch` before it submits "
     "a job (with E707 for a mesh one cluster job cannot start). E710-E715 are options given to `run` or `launch` "
     "that do not fit the plan or this machine (their fix is the command with its options mended), E716 a rank "
     "`run --dry-run` cannot build, E717-E719 what stops `launch` handing the job to the scheduler through TorchX "
     "(TorchX not installed, a scheduler option it refuses, a scheduler it cannot reach); E720 a `plandsl profile` "
     "job whose ranks fail or whose nodes do not meet (the example is the cluster file it leaves as it was)."),
    ("E8", "E8xx: what generate --from cannot keep, shrink cannot do, import cannot read, export cannot write",
     "Reported by `plandsl generate --from` (a partial plan completed by the search), `plandsl shrink` (a plan "
     "scaled down to one machine), `plandsl import` (another tool's configuration; the example is its flags, as "
     "`--args-file`) and `plandsl export` (a plan in another tool's format), with the checker's codes for "
     "everything `plandsl check` itself reports; E809-E810 by `plandsl estimate --against` (a run's metrics; the "
     "example is the metrics file), E811-E813 by `plandsl render` (a view that does not apply, graphviz missing or "
     "failing), E814 by `plandsl generate` (no plan fits; E804-E805 are its flags' problems too), E815 by `plandsl lsp` "
     "(pygls not installed; the example is a plan an editor opens)."),
    ("E9", "E9xx: what plandsl inspect cannot derive", "Reported by `plandsl inspect` (a user's torch module, "
     "a factory or a Hugging Face config, built on the meta device and read as a layer table); the example "
     "is the user's Python file, but for E905 (`plandsl inspect FILE.plan`: a model call it cannot read)."),
    ("W", "Warnings", "The plan is valid, but probably not what was meant."),
]


def normalize(text: str, directory: str) -> str:
    """Paths as the user wrote them: the temporary directory and the stdlib location removed, the
    folder above the temporary directory (where `../` leads) shown as `<tmp>`."""
    text = text.replace(str(stdlib_root()), "<stdlib>")  # first: the stdlib may lie under the temporary folder's parent
    for prefix in (os.path.realpath(directory), directory):
        text = text.replace(prefix + os.sep, "")
    for prefix in (os.path.dirname(os.path.realpath(directory)), os.path.dirname(directory)):
        text = text.replace(prefix + os.sep, "<tmp>" + os.sep)
    return text.replace(str(stdlib_root()), "<stdlib>")


def _command(entry: Entry, path: Path, command: tuple[str, ...], fixed: bool = False) -> Analysis:
    """What `plandsl generate --from`, `plandsl shrink`, `plandsl inspect`, `plandsl launch` or `plandsl run`
    (`command`: the entry's, or its fix's, `fixed`) reports on the example."""
    from plandsl.diagnostics import PlanError
    if command == ("inspect",):
        return _inspect_plan(path)
    if command[0] == "inspect":
        return _inspect(entry, path)
    if command[0] in ("import", "export"):
        return _interop(entry, path)
    if command[0] == "launch":
        return _launch(path, command, "" if fixed else entry.lacks)
    if command[0] == "estimate":
        return _estimate(path)
    if command[0] == "render":
        return _render(path, command, "failing" if entry.internal and not fixed else
                       "missing" if entry.lacks and not fixed else "stub")
    if command[0] == "profile":
        return _profile(path, failing=False)
    if command[0] == "lsp":
        return _lsp(path, "" if fixed else entry.lacks)
    if command[0] == "run" and "--memory" in command:
        return _traced(path)
    if command[0] == "run" and "--dry-run" in command:
        return _dry_run(path)
    if command[0] == "run":
        return _run(path, command, entry.gpus)
    from plandsl.rewrite.complete import generate_from
    from plandsl.rewrite.shrink import shrink
    if command[0] == "generate" and command[-1] == "--model":
        return _generate(path, command)
    try:
        if entry.command[0] == "generate":
            generate_from(path, top=1)
        else:
            ranks = int(entry.command[entry.command.index("--ranks") + 1]) if "--ranks" in entry.command else 8
            shrink(path, ranks=ranks)
    except PlanError as error:
        return Analysis(str(path), None, list(error.diagnostics), dict(error.sources))
    return Analysis(str(path), None, [], {})


TRAIN = """import "clusters/local"
plan p {
  model   = gpt(layers=2, hidden=64, heads=4, seq=32, vocab=256)
  cluster = localhost
  mesh    = [dp = 2] over devices[0:2]
  train   = { global_batch: 8, micro_batch: 1 }
  data    = ddp over dp
}
"""
"""E809-E810's train.plan, written beside the metrics: any plan (the metrics are read before they are compared)."""


def _estimate(path: Path) -> Analysis:
    """`plandsl estimate train.plan --against EXAMPLE` (train.plan: `TRAIN`, written beside it): what
    `api.estimate_against` says of the metrics (E809-E810)."""
    from plandsl import api
    from plandsl.diagnostics import PlanError
    plan_file = path.parent / "train.plan"
    plan_file.write_text(TRAIN, encoding="utf-8")
    try:
        api.estimate_against(api.estimate(api.load_plan(plan_file)), path)
    except PlanError as error:
        return Analysis(str(path), None, list(error.diagnostics), dict(error.sources))
    return Analysis(str(path), None, [], {})


def _render(path: Path, command: tuple[str, ...], graphviz: str) -> Analysis:
    """`plandsl render --view VIEW [--format FMT] EXAMPLE` (`api.render`, E811-E813) on a machine whose graphviz is
    `missing` (a PATH without `dot` and `neato`), `failing` (both stubs exiting 1 with graphviz's message of a
    syntax error) or a `stub` (both print an empty SVG picture), whatever graphviz this machine has."""
    from plandsl import api
    from plandsl.diagnostics import PlanError
    analysis = analyze(str(path))
    if not analysis.ok:
        return analysis
    options = _options(command)
    saved_path = os.environ.get("PATH", "")
    with tempfile.TemporaryDirectory() as bin_dir:
        script = {"failing": "#!/bin/sh\necho 'Error: <stdin>: syntax error in line 1 near ]' >&2\nexit 1\n",
                  "stub": "#!/bin/sh\ncat >/dev/null\necho '<svg xmlns=\"http://www.w3.org/2000/svg\"></svg>'\n"}
        for program in ("dot", "neato") if graphviz in script else ():
            stub = Path(bin_dir) / program
            stub.write_text(script[graphviz])
            stub.chmod(0o755)
        os.environ["PATH"] = bin_dir
        try:
            api.render(analysis.document.plans[0], options["view"], options.get("format", "dot"))
        except PlanError as error:
            return Analysis(str(path), None, list(error.diagnostics), dict(error.sources))
        finally:
            os.environ["PATH"] = saved_path
    return Analysis(str(path), None, [], dict(analysis.sources))


def _interop(entry: Entry, path: Path) -> Analysis:
    """`plandsl import --from TOOL --world-size N --args-file EXAMPLE` (its diagnostics, or the checker's on the plan
    written), or `plandsl export EXAMPLE --to TOOL` (what the tool cannot express)."""
    from plandsl import api
    tool = entry.command[2]
    if entry.command[0] == "import":
        world = int(entry.command[entry.command.index("--world-size") + 1])
        imported = api.import_config(tool, path.read_text(encoding="utf-8"), str(path), world_size=world,
                                     name="imported", plan_path=str(path.parent / "imported.plan"))
        return Analysis(str(path), None, list(imported.diagnostics), dict(imported.sources))
    analysis = analyze(str(path))
    if not analysis.ok:
        return analysis
    lost = [d for plan in analysis.document.plans for d in api.export(plan, tool).lost]
    return Analysis(str(path), None, lost, dict(analysis.sources))


JOB_OPTIONS = ("scheduler", "dryrun", "cfg", "image", "cpu", "mem_mb", "name")
"""`plandsl launch`'s own options (`api.job_options`); the others are the ranks'."""


def _launch(path: Path, command: tuple[str, ...], lacks: str = "") -> Analysis:
    """`plandsl launch EXAMPLE --scheduler ... [--dryrun] [rank options]` as the CLI does it: the checker's
    diagnostics, else what launch refuses of the plan, else of the nodes' command (E713, E715), else what TorchX
    says of the job (E717-E719: `api.cluster_job`, `api.submit_job`) on a machine that `lacks` TorchX or
    `sbatch` (the fix's command, run with `lacks` "": TorchX as installed, `sbatch` a stub printing a job id)."""
    from plandsl import api
    from plandsl.diagnostics import PlanError
    from plandsl.runtime.launch import LaunchError, LaunchOptions
    from plandsl.runtime.submit import node_command, refusals as launch_refusals
    analysis = analyze(str(path))
    if not analysis.ok:
        return analysis
    refused = [d for plan in analysis.document.plans for d in launch_refusals(plan)]
    if refused:
        return Analysis(str(path), None, refused, dict(analysis.sources))
    options = _options(command)
    ranks = {key: value for key, value in options.items() if key not in JOB_OPTIONS}
    try:
        node_command(str(path), None, {}, LaunchOptions(**ranks))
    except LaunchError as error:
        return Analysis(str(path), None, [error.diagnostic], dict(analysis.sources))
    job = api.job_options(**{key: (value,) if key == "cfg" else value
                             for key, value in options.items() if key in JOB_OPTIONS})
    with _machine(lacks, job.dryrun), tempfile.TemporaryDirectory() as elsewhere:
        cwd = os.getcwd()
        os.chdir(elsewhere)  # where TorchX writes what it writes (its log folders)
        try:
            plan = analysis.document.plans[0]
            api.submit_job(api.cluster_job(plan, str(path), None, {}, api.launch_options(**ranks), job), job)
        except PlanError as error:
            return Analysis(str(path), None, list(error.diagnostics), dict(error.sources))
        finally:
            os.chdir(cwd)
    return Analysis(str(path), None, [], dict(analysis.sources))


@contextmanager
def _machine(lacks: str, dryrun: bool):
    """This process as a machine without TorchX (`lacks` "TorchX": importing it fails as where it is not
    installed), and, for a submission, with a PATH holding no `sbatch` (`lacks` "sbatch") or only a stub `sbatch`
    that prints job id 1234 (no `sinfo` either way: TorchX then warns that it assumes Slurm 24.05, as off the
    cluster; its cached version is cleared, so that it warns whatever ran before in this process)."""
    saved_path = os.environ.get("PATH", "")
    hidden = {name: module for name, module in sys.modules.items() if name == "torchx" or name.startswith("torchx.")}
    blocker = _NoTorchX()
    with tempfile.TemporaryDirectory() as bin_dir:
        if not dryrun:
            if lacks != "sbatch":
                stub = Path(bin_dir) / "sbatch"
                stub.write_text("#!/bin/sh\necho 1234\n")
                stub.chmod(0o755)
            os.environ["PATH"] = bin_dir
        if lacks == "TorchX":
            for name in hidden:
                del sys.modules[name]
            sys.meta_path.insert(0, blocker)
        else:
            _forget_slurm_version()
        try:
            yield
        finally:
            os.environ["PATH"] = saved_path
            if lacks == "TorchX":
                sys.meta_path.remove(blocker)
                sys.modules.update(hidden)
            else:
                _forget_slurm_version()


class _NoTorchX:
    """An import finder for which TorchX is not installed."""

    def find_spec(self, name, path=None, target=None):
        if name == "torchx" or name.startswith("torchx."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


def _forget_slurm_version() -> None:
    try:
        from torchx.schedulers import slurm_scheduler
    except ImportError:
        return
    slurm_scheduler.version.cache_clear()


def _options(command: tuple[str, ...], skipped: tuple[str, ...] = ()) -> dict:
    """`plandsl run`'s (or launch's) options in `command`, as `LaunchOptions` takes them (the words as a shell
    splits them; flags True, whole numbers ints); `skipped` options are not the launch's."""
    import shlex
    words, options = shlex.split(" ".join(command[1:])), {}
    while words:
        option = words.pop(0)
        value: object = True
        if words and not words[0].startswith("--"):
            value = words.pop(0)
            value = int(value) if value.isdigit() else value
        if option not in skipped:
            options[option.removeprefix("--").replace("-", "_")] = value
    return options


def _run(path: Path, command: tuple[str, ...], gpus: int) -> Analysis:
    """`plandsl run [options] EXAMPLE` on a machine where torch sees `gpus` GPUs, up to the launch, as the CLI
    does it: the checker's diagnostics, else what run refuses (`api.load_runnable`), else what the options do not
    fit (`api.prepare_run`, E710-E714). Nothing is started."""
    from unittest import mock
    from plandsl import api
    from plandsl.diagnostics import PlanError
    options = _options(command)
    if "checkpoint_dir" in options:  # a folder beside the example
        options["checkpoint_dir"] = str(path.parent / options["checkpoint_dir"])
    options = api.launch_options(**options)
    try:
        plan = api.load_runnable(path, cuda=gpus > 0)
        with mock.patch("plandsl.runtime.launch.cuda_device_count", return_value=gpus):
            api.prepare_run(plan, str(path), None, {}, options)
    except PlanError as error:
        return Analysis(str(path), None, list(error.diagnostics), dict(error.sources))
    return Analysis(str(path), None, [], {})


def _apart(path: Path, command: tuple[str, ...]) -> Analysis:
    """`plandsl run [options] EXAMPLE` launched (`api.launch`) with torch's launcher raising what its static
    rendezvous raises when node 0 cannot be reached (E722's example: no machine here is node 0)."""
    from unittest import mock
    from plandsl import api
    from plandsl.diagnostics import PlanError
    from torch.distributed import DistNetworkError
    options = api.launch_options(**_options(command))

    def launcher(args):
        raise DistNetworkError("The client socket has timed out after 900000ms while trying to connect to "
                               "(node0, 29500).")
    try:
        plan = api.load_runnable(path)
        args = api.prepare_run(plan, str(path), None, {}, options)
        with mock.patch("torch.distributed.run.run", launcher):
            api.launch(args)
    except PlanError as error:
        return Analysis(str(path), None, list(error.diagnostics), dict(error.sources))
    return Analysis(str(path), None, [], {})


def _dry_run(path: Path, failing_rank: int | None = None) -> Analysis:
    """`plandsl run --dry-run EXAMPLE`: every rank built on the meta device (`api.dry_run`); with `failing_rank`,
    that rank's build raises KeyError('tp') (E716's example: no plan known fails there)."""
    from unittest import mock
    from plandsl import api
    from plandsl.diagnostics import PlanError
    from plandsl.runtime import dryrun
    build = dryrun._build_rank

    def failing(plan, model, rank, *args):
        if rank == failing_rank:
            raise KeyError("tp")
        return build(plan, model, rank, *args)
    try:
        plan = api.load_runnable(path, cuda=False)
        with mock.patch.object(dryrun, "_build_rank", failing):
            api.dry_run(plan)
    except PlanError as error:
        return Analysis(str(path), None, list(error.diagnostics), dict(error.sources))
    return Analysis(str(path), None, [], {})


def _traced(path: Path) -> Analysis:
    """`plandsl run EXAMPLE --dry-run --memory`: the checker's diagnostics, else what the trace refuses before it
    runs (`runtime.memtrace.trace_refusals`)."""
    from plandsl.runtime.memtrace import trace_refusals
    analysis = analyze(str(path))
    if not analysis.ok:
        return analysis
    refused = [d for plan in analysis.document.plans for d in trace_refusals(plan)]
    return Analysis(str(path), None, refused, dict(analysis.sources))


def _inspect(entry: Entry, path: Path) -> Analysis:
    """`plandsl inspect SOURCE` run in the example's folder (the module it imports forgotten afterwards)."""
    from plandsl.diagnostics import PlanError
    from plandsl.ir.inspected import parse_source
    from plandsl.runtime.inspect import inspect_model
    try:
        inspect_model(parse_source(entry.command[1]), seq=16, search_path=(str(path.parent),))
    except PlanError as error:
        return Analysis(str(path), None, list(error.diagnostics), dict(error.sources))
    finally:
        sys.modules.pop(path.stem, None)
    return Analysis(str(path), None, [], {})


def _generate(path: Path, command: tuple[str, ...]) -> Analysis:
    """`plandsl generate --cluster ... --global-batch N --model EXAMPLE:STEM` (E814: the model, named by the example
    file and its stem, fits no plan): what `api.generate` raises."""
    from plandsl import api
    from plandsl.diagnostics import PlanError
    options = _options(command[:-1])
    try:
        api.generate(api.generate_request(model=f"{path}:{path.stem}", cluster=options["cluster"],
                                          global_batch=options["global_batch"], top=1))
    except PlanError as error:
        return Analysis(str(path), None, list(error.diagnostics), dict(error.sources))
    return Analysis(str(path), None, [], {})


def _lsp(path: Path, lacks: str) -> Analysis:
    """`plandsl lsp --stdio` (E815) as far as it starts: `plandsl.lsp.load_server()` imports the server, on a machine
    where importing pygls fails (`lacks` "pygls": the server's modules forgotten first) or with pygls as installed."""
    from plandsl import lsp
    from plandsl.diagnostics import PlanError
    hidden = {name: module for name, module in sys.modules.items()
              if name.split(".")[0] == "pygls" or name.startswith("plandsl.lsp.")} if lacks else {}
    blocker = _NoPackage("pygls")
    for name in hidden:
        del sys.modules[name]
    if lacks:
        sys.meta_path.insert(0, blocker)
    try:
        lsp.load_server()
    except PlanError as error:
        return Analysis(str(path), None, list(error.diagnostics), dict(error.sources))
    finally:
        if lacks:
            sys.meta_path.remove(blocker)
            for name in [m for m in sys.modules if m.split(".")[0] == "pygls" or m.startswith("plandsl.lsp.")]:
                del sys.modules[name]
            sys.modules.update(hidden)
    return Analysis(str(path), None, [], {})


class _NoPackage:
    """An import finder for which `package` is not installed."""

    def __init__(self, package: str):
        self.package = package

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == self.package:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


def _profile(path: Path, failing: bool) -> Analysis:
    """`plandsl profile --nproc-per-node 2 --quick -o EXAMPLE` (`api.profile`, E720) with torch's launcher made to
    report rank 1 failed (`failing`), or to succeed at once (no rank writes a profile: as on a node but node 0)."""
    from unittest import mock
    from plandsl import api
    from plandsl.diagnostics import PlanError
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    def launcher(args):
        if failing:
            raise ChildFailedError("plandsl.runtime.profile.rank",
                                   {1: ProcessFailure(local_rank=1, pid=1, exitcode=1, error_file="")})
    with mock.patch("torch.distributed.run.run", launcher):
        try:
            api.profile(api.profile_options(nproc_per_node=2, quick=True))
        except PlanError as error:
            return Analysis(str(path), None, list(error.diagnostics), dict(error.sources))
    return Analysis(str(path), None, [], {})


def _inspect_plan(path: Path) -> Analysis:
    """`plandsl inspect EXAMPLE.plan` (`api.inspect_plan`): every model's table written where the plan reads it."""
    from plandsl import api
    from plandsl.diagnostics import PlanError
    try:
        api.inspect_plan(path)
    except PlanError as error:
        return Analysis(str(path), None, list(error.diagnostics), dict(error.sources))
    return Analysis(str(path), None, [], {})


def _internal(entry: Entry, path: Path) -> Analysis:
    """`plandsl check` of the example (api.check, the boundary) while the checker raises KeyError('tp'); E716's
    `plandsl run --dry-run` while rank 1's build raises it."""
    from unittest import mock
    from plandsl import api
    if entry.command[:1] == ("render",):  # E813: graphviz fails
        return _render(path, entry.command, "failing")
    if entry.command[:1] == ("profile",):  # E720: rank 1 fails
        return _profile(path, failing=True)
    if entry.command[:1] == ("run",) and "--rdzv-endpoint" in entry.command:  # E722: the nodes do not meet
        return _apart(path, entry.command)
    if entry.command:
        return _dry_run(path, failing_rank=1)
    with mock.patch("plandsl.check.analysis.check_plan", side_effect=KeyError("tp")):
        return api.check(path)


_TABLES: dict = {}  # (source, seq) -> its table: each model of E412-E414's examples is built once per process


def _write_tables(path: Path) -> None:
    """What `plandsl inspect FILE.plan` writes beside the example (its models' tables), each built once."""
    from plandsl import api
    from plandsl.lower.inspected import written_sources
    for source, seq, cache in written_sources(api.parse_file(path)):
        key = (source.text, seq)
        if key not in _TABLES:
            _TABLES[key] = api.inspect_model(source.text, seq=seq)
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        api.write_inspected(_TABLES[key], cache)


@lru_cache(maxsize=None)
def run_example(entry: Entry, fixed: bool = False) -> tuple[Analysis, str]:
    """Analyse the entry's example (or its fix) as a file; (analysis, normalized rendering). Kept per
    process (entries are frozen; callers only read the result): test_diagnostics' example and golden
    tests and docs/errors.md's test analyse the same examples."""
    text = entry.fixed if fixed else entry.example
    encoding = entry.fixed_encoding if fixed else entry.encoding
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / entry.file
        path.write_bytes(text.encode(encoding))
        for folder in entry.folders:
            (Path(directory) / folder).mkdir()
        for name in () if fixed else entry.files:
            (Path(directory) / name).write_bytes(b"")
        if entry.checkpoint:  # E721: a run's checkpoint (its record: what `--resume` reads before any tensor)
            step = Path(directory) / "checkpoints" / "step-000002"
            step.mkdir(parents=True)
            (step / "plandsl.json").write_text(textwrap.dedent(entry.checkpoint), encoding="utf-8")
        if entry.inspect:  # the tables of its hf()/factory() models, where the plan reads them
            _write_tables(path)
        command = entry.fixed_command if fixed and entry.fixed_command else entry.command
        if entry.internal and not fixed:
            analysis = _internal(entry, path)
        else:
            analysis = _command(entry, path, command, fixed) if command else analyze(str(path))
        if entry.stage == "E7" and analysis.ok and analysis.document is not None:
            for plan in analysis.document.plans:  # what `plandsl run` adds (api.load_runnable)
                analysis.diagnostics += refusals(plan, cuda=entry.on_cuda)
        rendered = render_all(analysis.diagnostics, analysis.sources)
        return analysis, normalize(rendered, directory)


def _code(text: str, language: str = "") -> list[str]:
    shown = text.rstrip("\n")
    fence = "````" if "```" in shown else "```"
    return [f"{fence}{language}", shown, fence]


def _section(entry: Entry) -> list[str]:
    _, rendered = run_example(entry)
    saved = f" (saved as {entry.encoding})" if entry.encoding != "utf-8" else ""
    beside = f" (beside it, `{'`, `'.join(entry.folders)}` is a folder)" if entry.folders else \
        f" (beside it, `{'`, `'.join(entry.files)}` is a file)" if entry.files else ""
    lines = [f"### {entry.code}: {entry.title}", "", entry.explanation, "",
             f"Example, `{entry.file}`{saved}{beside}:", ""]
    command = "plandsl run" if entry.stage == "E7" else "plandsl check"
    if entry.inspect:
        lines[-2] = lines[-2].rstrip(":") + f" (`plandsl inspect {entry.file}` wrote its model's table first):"
    if entry.command:
        command = f"plandsl {' '.join(entry.command)}{entry.named_file}"
    where = " on a machine with CUDA" if entry.on_cuda else ""
    if entry.gpus:
        where = f" on a machine where torch sees {entry.gpus} GPU{'s' if entry.gpus > 1 else ''}"
    fixed_where = where
    if entry.lacks:
        lacks = entry.lacks if entry.lacks[:1].isupper() else f"`{entry.lacks}`"  # a package, or a command
        where, fixed_where = f" on a machine without {lacks}", f" on one with {lacks}"
    language = "python" if entry.file.endswith(".py") else "bash" if entry.file.endswith(".args") else \
        "json" if entry.file.endswith(".jsonl") else "plan"
    if entry.command[:1] == ("import",):
        command = f"plandsl {' '.join(entry.command)} --args-file {entry.file} -o imported.plan"
    if entry.command[:1] == ("generate",) and entry.command[-1] == "--model":  # E814: the file names the model
        command = f"plandsl {' '.join(entry.command)} {entry.file}:{Path(entry.file).stem}"
    if entry.command[:1] == ("inspect",) and len(entry.command) > 1:
        command = f"plandsl inspect '{entry.command[1]}'"
    lines += _code(entry.example, language) + ["", f"`{command}`{where} reports:", ""]
    lines += _code(rendered, "text") + ["", f"**Fix:** {entry.fix}", ""]
    if entry.fixed_command:
        lines += [f"`plandsl {' '.join(entry.fixed_command)}{entry.named_file}`{fixed_where} is not refused.", ""]
    if entry.edits:
        lines += _code(entry.fixed, language) + [""]
    return lines


def render_errors_doc() -> str:
    lines = ["# Diagnostics", "",
             "<!-- Generated by tests/make_errors_doc.py from plandsl/diagnostics/catalogue/; do not edit. -->", "",
             "Every problem `plandsl check` reports has a stable code, and so has every reason `plandsl run`",
             "(or `plandsl launch`) refuses a valid plan (E7xx), and what `generate --from` or `shrink` cannot do (E8xx).",
             "`plandsl explain CODE` prints the entry below for one code. Each example is a complete file",
             "(apart from standard-library imports); the output under it is what checking (or, for E7xx,",
             "running; for E8xx, the command named) that file prints, and the fix is a version that checks",
             "(or runs) clean.", ""]
    for prefix, heading, _ in STAGES:
        codes = [c for c in ENTRIES if c.startswith(prefix)]
        lines.append(f"- [{heading}](#{_anchor(heading)}): " + ", ".join(
            f"[{c}](#{_anchor(f'{c}: {ENTRIES[c].title}')})" for c in codes))
    lines.append("")
    for prefix, heading, blurb in STAGES:
        lines += [f"## {heading}", "", blurb, ""]
        for code, entry in ENTRIES.items():
            if code.startswith(prefix):
                lines += _section(entry)
    return "\n".join(lines).rstrip("\n") + "\n"


def _anchor(heading: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces to dashes."""
    kept = "".join(ch for ch in heading.lower() if ch.isalnum() or ch in " -_")
    return kept.replace(" ", "-")


if __name__ == "__main__":
    DOC.parent.mkdir(parents=True, exist_ok=True)
    DOC.write_text(render_errors_doc(), encoding="utf-8")
    print(f"wrote {DOC.relative_to(ROOT)}")
