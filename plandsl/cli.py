"""The `plandsl` command: a few lines per command over `plandsl.api`.

Exit status: 0 success, 1 the input has problems (diagnostics printed), 2 usage errors.
It imports only click, the standard library and `plandsl.api` (pyproject's import-linter contract), which
loads each stage inside the function that calls it: `--help` loads neither pydantic nor torch.
"""
from __future__ import annotations

import contextlib
import errno
import functools
import io
import json
import math
import os
import re
import shlex
import sys

import click

from plandsl import api
from plandsl.api import limits


def _params(values: tuple[str, ...]) -> dict:
    try:
        return api.parse_params(values)
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="--param") from None


param_option = click.option("--param", "params", multiple=True, metavar="KEY=VALUE",
                            help="Set a `param` of the file (repeatable).")


def _include(ctx, param, values):
    if values:
        ctx.with_resource(api.include(values))  # for this command only
    return values


include_option = click.option("--include", multiple=True, metavar="DIR", expose_value=False, callback=_include,
                              type=click.Path(exists=True, file_okay=False), is_eager=True,
                              help="Imports may also come from DIR (repeatable; also PLANDSL_PATH).")


def _model_imports(ctx, param, value):
    if value:
        ctx.with_resource(api.model_imports())  # for this command only
    return value


model_import_option = click.option(
    "--allow-model-import", is_flag=True, expose_value=False, callback=_model_imports, is_eager=True,
    help="Inspect a model from torch whose layer table is missing or stale (imports its code) instead of E215.")


def _a_number(ctx, param, value):
    """Refuse NaN, which every range admits (no comparison with it is true)."""
    if value is not None and math.isnan(value):
        raise click.BadParameter("not a number", ctx, param)
    return value


def _writable_file(ctx, param, value):
    """An output file: refused before any work starts when it cannot be written (exit 2, the option named)."""
    reason = api.writable_file(value) if value else None
    if reason:
        raise click.BadParameter(f"cannot write '{value}': {reason}")
    return value


def _writable_dir(ctx, param, value):
    reason = api.writable_dir(value) if value else None
    if reason:
        raise click.BadParameter(f"cannot write into '{value}': {reason}")
    return value


def _write(path: str, data: bytes | str) -> None:
    """Write an output file; a failure the checks before the work could not see is E110, exit 1 (the command's
    boundary prints it, as JSON with `--format json`), not a traceback."""
    api.write_output(path, data)


@contextlib.contextmanager
def _progress(label: str):
    """The one progress display of long work: yields `progress(done, total)` for the stage to call; click's
    bar on stderr when stderr is a terminal (drawn from the first call that knows the total), else nothing."""
    bar = None

    def progress(done: int, total: int) -> None:
        nonlocal bar
        if bar is None and total and sys.stderr.isatty():
            bar = click.progressbar(length=total, label=label, file=sys.stderr).__enter__()
        if bar is not None:
            bar.update(done - bar.pos)
    try:
        yield progress
    finally:
        if bar is not None:
            bar.__exit__(None, None, None)


def _print_diagnostics(analysis, output_format: str) -> None:
    if not analysis.diagnostics:
        return
    if output_format == "json":
        click.echo(api.to_json_lines(analysis.diagnostics))
    else:
        click.echo(api.render_all(analysis.diagnostics, analysis.sources), err=True)
        errors = len(analysis.errors)
        warnings = len(analysis.diagnostics) - errors
        click.echo(f"{analysis.path}: {errors} error(s), {warnings} warning(s)", err=True)


class _Command(click.Command):
    """Every command runs inside the boundary (`diagnostics.internal.guard`): an exception nothing
    expected is printed as E108 for the command's file (JSON with `--format json`), exit 1. An interruption the
    command did not report itself (Ctrl-C) is one line, `interrupted by SIGINT`, exit 130 (128 + the signal's
    number), not click's `Aborted!` with exit 1."""

    def invoke(self, ctx: click.Context):
        expected = (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort, api.PlanError)
        if sys.stdout is None:  # standard output closed as plandsl started (`>&-`): click.echo drops every line
            sys.stdout = _ClosedOutput()
        try:
            with api.guard(ctx.params.get("file"), expected) as bug:
                try:
                    return super().invoke(ctx)
                except OSError as error:
                    _output_problem(error)  # exits where the output could not be written; else a bug (E108)
                    raise
        except api.PlanError as error:  # a stage's diagnostics that the command did not print itself
            _fail(error, ctx.params.get("output_format") or "text")
        except KeyboardInterrupt as error:
            name, status = api.interruption(error)
            click.echo(f"interrupted by {name}", err=True)
            sys.exit(status)
        _fail(api.PlanError([bug.diagnostic]), ctx.params.get("output_format") or "text")


class _ClosedOutput(io.TextIOBase):
    """Standard output where it was closed before plandsl started (Python's `sys.stdout` is then None, and
    `click.echo` returns without writing, so a command printed nothing and exited 0): writing fails as writing to a
    closed descriptor does (EBADF), and `_output_problem` says E110, exit 1; a command that prints nothing still
    succeeds."""

    def writable(self) -> bool:
        return True

    def write(self, text) -> int:
        raise OSError(errno.EBADF, "standard output is closed")


def _output_problem(error: OSError) -> None:
    """Exit 1 saying why, where `error` came from writing standard output or error (`click.echo`: a full disk,
    `> /dev/full`, a closed pipe), which is this machine's problem, not a plandsl bug (E108)."""
    frames, trace = set(), error.__traceback__
    while trace is not None:
        frames.add(trace.tb_frame.f_code)
        trace = trace.tb_next
    if click.echo.__code__ not in frames:
        return
    with contextlib.suppress(OSError):  # stdout's buffer would fail again as the interpreter exits
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    with contextlib.suppress(OSError):  # standard error may be where it failed
        click.echo(api.render_all([api.unwritable("", error)], {}), err=True)  # E110, at no place
    sys.exit(1)


class _Group(click.Group):
    command_class = _Command


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="plandsl")
def main() -> None:
    """plandsl: write, check, generate, render and run distributed training plans."""


@main.command()
@click.argument("files", nargs=-1, required=True, type=click.Path())
@click.option("--format", "output_format", type=click.Choice(["text", "json"]), default="text",
              help="json: one object per diagnostic, one per line.")
@param_option
@include_option
@model_import_option
def check(files, output_format, params):
    """Check plan FILES; exit 1 if any has an error."""
    overrides = _params(params)
    failed = False
    for file in files:
        analysis = api.check(file, overrides)
        _print_diagnostics(analysis, output_format)
        failed |= not analysis.ok
        if analysis.ok and output_format == "text":
            click.echo(f"{analysis.path}: ok" + (f" ({len(analysis.diagnostics)} warning(s))" if analysis.diagnostics else ""))
    sys.exit(1 if failed else 0)


@main.command()
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the resolved IR as JSON.")
@click.option("--plan", "plan_name", help="Only this plan of the file.")
@param_option
@include_option
@model_import_option
def show(file, as_json, plan_name, params):
    """Show the resolved plan (imports and parameters applied)."""
    analysis = api.check(file, _params(params))
    if not analysis.ok:
        _print_diagnostics(analysis, "text")
        sys.exit(1)
    document = analysis.document
    try:
        plans = [api.select_plan(document, plan_name)] if plan_name else list(document.plans)
    except api.PlanError as error:
        click.echo(str(error), err=True)
        sys.exit(1)
    if as_json:
        payload = document.model_dump(mode="json") if plan_name is None else plans[0].model_dump(mode="json")
        click.echo(json.dumps(payload, indent=2))
        return
    click.echo(api.describe(document, plans))


@main.command()
def schema():
    """Print the JSON Schema of the resolved IR."""
    click.echo(json.dumps(api.schema(), indent=2))


@main.command()
@click.argument("code")
def explain(code):
    """Explain a diagnostic CODE (E101 ... W501): what it means, an example, the fix."""
    text = api.explain(code)
    if text is None:
        click.echo(api.unknown_code(code), err=True)
        sys.exit(2)
    click.echo(text)


@main.command()
@click.option("--stdio", is_flag=True, help="Talk over stdin/stdout (the only transport; clients often pass it).")
def lsp(stdio):
    """Serve the language server on stdin/stdout for an editor: diagnostics, hover, completion, go to
    definition, formatting, quick fixes (needs the `lsp` extra: pygls)."""
    from plandsl.lsp import load_server  # lazy: pygls and the stages only for the language server
    load_server()()  # E815 (exit 2) where pygls is not installed


@main.command()
@click.argument("files", nargs=-1, required=True, type=click.Path(allow_dash=True))
@click.option("--check", "check_only", is_flag=True, help="Change nothing; exit 1 if a file would change.")
def fmt(files, check_only):
    """Rewrite plan FILES in canonical layout (comments kept); `-` reads stdin.

    Each file on its own: one that cannot be read, parsed or written is reported and the next is formatted."""
    outcomes = set()
    for file in files:
        with api.guard(None if file == "-" else file) as bug:  # a plandsl bug on this file: E108, then the next
            try:
                outcomes.add(_format_one(file, check_only))
            except OSError as error:
                _output_problem(error)  # exits where the output could not be written (this guard would say E108)
                raise
        if bug.diagnostic is not None:
            click.echo(api.render_all([bug.diagnostic], {}), err=True)
            outcomes.add("failed")
    sys.exit(1 if outcomes & {"failed", "would change"} else 0)


def _format_one(file: str, check_only: bool) -> str:
    """Format (or with `check_only`, compare) one file: "failed", "would change", "changed" or "same"."""
    try:
        data, formatted = api.format_file(file, sys.stdin.buffer if file == "-" else None)
    except api.PlanError as error:
        click.echo(str(error), err=True)
        return "failed"
    if file == "-":
        click.echo(formatted, nl=False)
        return "same"
    if formatted.encode("utf-8") == data:
        return "same"
    if check_only:
        click.echo(f"{file}: would reformat")
        return "would change"
    try:
        api.replace_file(file, formatted)
    except api.PlanError as error:  # E110: the file is left as it was
        click.echo(str(error), err=True)
        return "failed"
    click.echo(f"{file}: reformatted")
    return "changed"


@main.command()
@click.argument("name")
@click.option("--ranks", type=click.IntRange(min=1, max=limits.MAX_STAGES), help="Pipeline ranks.")
@click.option("--microbatches", type=click.IntRange(min=1, max=limits.MAX_MICROBATCHES), help="Microbatches per step.")
@click.option("--virtual", type=click.IntRange(min=1, max=limits.MAX_VIRTUAL),
              help="Stages per rank (interleaved, V-shape).")
@click.option("--format", "output_format", type=click.Choice(["text", "csv", "json", "plan"]), default="text",
              help="text: the step x rank grid; csv: torch's compute-only CSV; plan: a table schedule.")
@click.option("--simulate", "run_simulation", is_flag=True, help="Simulate it with --costs instead.")
@click.option("--costs", help="Seconds per action, e.g. F=1,B=2 or F=1,I=1,W=1,P2P=0.1.")
@click.option("--json", "as_json", is_flag=True, help="With --simulate: the figures as JSON.")
@click.option("--trace", type=click.Path(dir_okay=False), callback=_writable_file,
              help="With --simulate: write a Chrome/Perfetto trace.")
@include_option
@model_import_option
def schedule(name, ranks, microbatches, virtual, output_format, run_simulation, costs, as_json, trace):
    """Print schedule NAME (a built-in, FILE.csv or FILE.plan:NAME) for the given sizes."""
    try:
        if run_simulation:
            found, simulation = api.simulate_named(name, ranks, microbatches, virtual, api.parse_costs(costs))
            _emit_simulation(found, simulation, as_json, trace, memory_in_bytes=False)
            return
        found = api.schedule(name, ranks, microbatches, virtual)
    except api.PlanError as error:
        _fail(error)
    click.echo(api.schedule_as(found, output_format))


@main.command()
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--plan", "plan_name", help="The plan of the file to simulate.")
@click.option("--costs", help="Seconds per action instead of the plan's cost model, e.g. F=1,B=2,P2P=0.1.")
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON.")
@click.option("--trace", type=click.Path(dir_okay=False), callback=_writable_file,
              help="Write a Chrome/Perfetto trace with real durations.")
@param_option
@include_option
@model_import_option
def simulate(file, plan_name, costs, as_json, trace, params):
    """Simulate the pipeline schedule of a plan: makespan, bubbles, memory per rank."""
    try:
        plan = api.load_plan(file, plan_name, _params(params))
        if plan.train.batch_shares is not None:  # each replica its own microbatches on its own devices
            replicas = api.simulate_replicas(plan, api.parse_costs(costs) if costs else None)
            if trace:
                _write(trace, json.dumps(api.replicas_trace(replicas)))
        else:
            schedule_, simulation = api.simulate(plan, api.parse_costs(costs) if costs else None)
    except api.PlanError as error:
        _fail(error)
    if plan.train.batch_shares is not None:
        unit = "" if costs else " s"
        click.echo(json.dumps({**replicas[0].simulation.to_json(), "replicas": [r.to_json() for r in replicas]},
                              indent=1) if as_json else api.replicas_report(replicas, unit, memory_in_bytes=True))
        if any(r.simulation.deadlock is not None for r in replicas):
            sys.exit(1)
        return
    _emit_simulation(schedule_, simulation, as_json, trace, memory_in_bytes=True,
                     unit="" if costs else " s", span=plan.schedule.span)


def _emit_simulation(found, simulation, as_json, trace, memory_in_bytes, unit="", span=None):
    if trace:
        try:
            _write(trace, json.dumps(api.chrome_trace(simulation, span)))
        except api.PlanError as error:
            _fail(error)
    click.echo(json.dumps(simulation.to_json(), indent=1) if as_json
               else api.simulation_report(found, simulation, unit, memory_in_bytes))
    if simulation.deadlock is not None:
        sys.exit(1)


def _token_file(ctx, param, value):
    problem = api.data_path_problem(value) if value else None
    if problem:
        raise click.BadParameter(problem)
    return value


def _fail(error, output_format: str = "text") -> None:
    if output_format == "json":
        click.echo(api.to_json_lines(error.diagnostics))
    else:
        click.echo(api.render_all(error.diagnostics, error.sources), err=True)
    sys.exit(api.exit_status(error))  # 1; 2 for E717, TorchX not installed (docs/cli.md)


def _rank_option(option, local: bool = True):
    """`plandsl run`'s click option for one option of the ranks' table (`runtime.options.RANK_OPTIONS`);
    `local=False` (`plandsl launch`): its paths are the cluster's, so this machine does not check them."""
    kwargs = {"help": option.help, "metavar": option.metavar}
    if option.kind == "flag":
        return click.option(option.flag, option.dest, is_flag=True, help=option.help)
    if option.kind in ("int", "float"):
        kind = click.IntRange if option.kind == "int" else click.FloatRange
        kwargs["type"] = kind(min=option.minimum, max=option.maximum) \
            if (option.minimum, option.maximum) != (None, None) else {"int": int, "float": float}[option.kind]
        if option.kind == "float":
            kwargs["callback"] = _a_number
    paths = {"out_file": (click.Path(dir_okay=False), _writable_file),
             "out_dir": (click.Path(file_okay=False), _writable_dir),
             "token_file": (click.Path(exists=True), _token_file)}
    if option.path and local:
        kwargs["type"], kwargs["callback"] = paths[option.path]
    elif option.path:
        kwargs["type"] = paths[option.path][0] if option.path != "token_file" else click.Path()
    if option.choices:
        kwargs["type"] = click.Choice(option.choices)
    if option.default is not None:
        kwargs.update(default=option.default, show_default=True)
    return click.option(option.flag, option.dest, **kwargs)


def _rank_options(command, local: bool = True):
    """Every option of the ranks' table but --param and --include, which every command that loads a plan takes."""
    for option in reversed([o for o in api.rank_options() if not o.each_command]):
        command = _rank_option(option, local)(command)
    return command


@main.command("run")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--nproc-per-node", type=click.IntRange(min=1, max=limits.MAX_LOCAL_RANKS),
              help=f"Processes on this node (default: mesh size / nnodes; at most {limits.MAX_LOCAL_RANKS}).")
@click.option("--nnodes", type=click.IntRange(min=1, max=limits.MAX_NODES), default=1, show_default=True,
              help="Machines taking part.")
@click.option("--node-rank", type=click.IntRange(min=0), default=0, show_default=True, help="This machine's index.")
@click.option("--rdzv-endpoint", metavar="HOST:PORT", help="Node 0's address, with several nodes.")
@_rank_options
@click.option("--dry-run", is_flag=True, help="Build every rank's share in this process on the meta device (this "
              "imports and calls the model's factory), print its parameters and memory, and the torchrun command "
              "for every node; no rank is started, nothing trained or allocated.")
@click.option("--memory", is_flag=True, help="With --dry-run: run rank 0's first two training steps on fake tensors "
              "(nothing allocated), record every allocation and free, and replay them through a model of torch's "
              "caching allocator: the most bytes of tensors alive and the peak reserved memory, with and without "
              "expandable segments, beside the cost model's count.")
@param_option
@include_option
@model_import_option
def run_command(file, nproc_per_node, nnodes, node_rank, rdzv_endpoint, dry_run, memory, params, plan_name, **ranks):
    """Check plan FILE, then train it on torch.distributed (one process per device of its mesh)."""
    overrides = _params(params)
    options = api.launch_options(nproc_per_node=nproc_per_node, nnodes=nnodes, node_rank=node_rank,
                                 rdzv_endpoint=rdzv_endpoint, **ranks)
    option_error = api.option_error()
    try:
        api.check_launch_options(options)
    except option_error as error:
        raise click.BadParameter(str(error), param_hint=error.option) from None
    if memory and not dry_run:
        raise click.BadParameter("traces a dry run's steps: give --dry-run too", param_hint="--memory")
    try:
        plan = api.load_runnable(file, plan_name, overrides,  # checked, and runnable (E7xx otherwise)
                                 cuda=ranks["device"] and ranks["device"] == "cuda")
    except api.PlanError as error:
        _fail(error)
    try:
        args = api.prepare_run(plan, file, plan_name, overrides, options, dry_run)
    except option_error as error:
        raise click.BadParameter(str(error), param_hint=error.option) from None
    except api.PlanError as error:  # E710-E714: the options do not fit the plan or this machine
        _fail(error)
    if dry_run:  # every rank built here on the meta device, its figures, then the command; nothing starts
        try:
            with _progress("building ranks") as progress:
                result = api.dry_run(plan, progress)
        except api.PlanError as error:  # E716: a rank cannot be built
            _fail(error)
        click.echo(api.format_dry_run(result))
        if memory:
            try:
                with _progress("tracing rank 0's steps") as progress:
                    traced = api.traced_memory(plan, progress=progress)
            except api.PlanError as error:  # E709: its steps cannot run on fake tensors
                _fail(error)
            click.echo(api.format_traced_memory(traced))
        click.echo(api.dry_run_commands(plan, args, options))
        sys.exit(0)
    click.echo(api.command_line(args))
    sys.exit(api.launch(args))


@main.command("launch")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--scheduler", type=click.Choice(api.launch_schedulers()), required=True,
              help="The cluster's scheduler, which TorchX writes the job for and submits it to.")
@click.option("--dryrun", "--dry-run", "dryrun", is_flag=True, help="Print the job TorchX would submit (slurm: "
              "the sbatch script; kubernetes: the Volcano job as YAML) and submit nothing.")
@click.option("--cfg", multiple=True, metavar="KEY=VALUE[,KEY=VALUE]", help="The scheduler's options as TorchX "
              "takes them (repeatable; `torchx runopts SCHEDULER` lists them): slurm partition=, time=, account=, "
              "qos=, ...; kubernetes queue= (required), namespace=, ...")
@click.option("--image", help="The container image every node runs (kubernetes; it holds plandsl, torch and the "
              "plan's files).")
@click.option("--cpu", type=click.IntRange(min=1, max=limits.MAX_NODE_CPUS), help="CPUs per node for the job (required to submit; a dry run "
              "shows TorchX's default, 2).")
@click.option("--mem-mb", type=click.IntRange(min=1, max=limits.MAX_NODE_MEMORY_MB), help="Host memory per node for the job, in MB (required to "
              "submit: every rank builds the model on the host before sharding it; a dry run shows TorchX's "
              "default, 1024).")
@click.option("--name", help="The job's name (default: the plan's).")
@functools.partial(_rank_options, local=False)
@param_option
@include_option
@model_import_option
def launch_command(file, scheduler, dryrun, cfg, image, cpu, mem_mb, name, params, plan_name, **ranks):
    """Check plan FILE, then submit it to a Slurm or Kubernetes cluster through TorchX: a node per node of its
    mesh, each running torchrun over `plandsl run`'s ranks (docs/running.md, Cluster schedulers)."""
    overrides = _params(params)
    if not dryrun and (cpu is None or mem_mb is None):
        raise click.UsageError("give the nodes' --cpu and --mem-mb to submit: TorchX's defaults (2 CPUs, 1024 MB "
                               "per node) would start every node's ranks in too little host memory")
    sizes = {key: value for key, value in (("cpu", cpu), ("mem_mb", mem_mb)) if value is not None}
    job = api.job_options(scheduler=scheduler, cfg=cfg, image=image, name=name, dryrun=dryrun, **sizes)
    option_error = api.option_error()
    try:
        api.check_job_options(job)
    except option_error as error:
        if error.missing:
            raise click.UsageError(f"Missing option '{error.option}': {error}") from None
        raise click.BadParameter(str(error), param_hint=error.option) from None
    try:
        plan = api.load_launchable(file, plan_name, overrides, cuda=ranks["device"] != "cpu")
    except api.PlanError as error:
        _fail(error)
    try:
        submitted = api.submit_job(api.cluster_job(plan, file, plan_name, overrides, api.launch_options(**ranks),
                                                   job), job)
    except api.PlanError as error:  # E713, E715: the rank options; E717-E719: TorchX missing, refusing, unreached
        _fail(error)
    for warning in submitted.warnings:
        click.echo(f"note: TorchX: {warning}", err=True)
    click.echo(submitted.text)
    if submitted.handle:
        click.echo(f"follow it: torchx status {submitted.handle}; torchx log {submitted.handle}", err=True)


@main.command()
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--plan", "plan_name", help="The plan of the file to scale down.")
@click.option("--ranks", type=click.IntRange(min=1, max=8), default=8, show_default=True,
              help="At most this many processes (devices of the scaled-down mesh; localhost has 8).")
@click.option("--precision", type=click.Choice(["fp32", "bf16", "fp16"]),
              help="Train in this precision instead of the plan's (fp32: equivalence holds to 1e-5).")
@click.option("-o", "--output", type=click.Path(dir_okay=False), callback=_writable_file,
              help="Write the plan here (default: print it).")
@click.option("--format", "output_format", type=click.Choice(["text", "json"]), default="text",
              help='json: diagnostics one object per line; the result as {"plan": ..., "changes": [...]}.')
@param_option
@include_option
@model_import_option
def shrink(file, plan_name, ranks, precision, output, output_format, params):
    """Scale plan FILE down to one machine: the same layout on at most --ranks CPU processes, a tiny model.

    Then `plandsl run OUT.plan --check-equivalence` trains it here against one process."""
    try:
        shrunk = api.shrink(file, plan_name, _params(params), ranks, precision,
                            os.path.dirname(os.path.abspath(output)) if output else None)
    except api.PlanError as error:
        _fail(error, output_format)
    if output:
        _write(output, shrunk.text)
    if output_format == "json":
        click.echo(json.dumps({"plan": shrunk.text, "name": shrunk.plan.name, "ranks": shrunk.ranks,
                               "changes": list(shrunk.changes), "output": output}, indent=1))
        return
    if not output:
        click.echo(shrunk.text, nl=False)
        return
    click.echo(f"wrote {output}: plan '{shrunk.plan.name}' on {shrunk.ranks} process(es)", err=True)
    for line in shrunk.changes:
        click.echo(f"  {line}", err=True)
    folders = api.include_flags(shrunk.include)
    click.echo(f"run it: plandsl run {shlex.quote(output)}{' ' + folders if folders else ''} --check-equivalence",
               err=True)


@main.command("render")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--plan", "plan_name", help="The plan of the file to render.")
@click.option("--view", type=click.Choice(["mesh", "placement", "schedule", "memory", "all"]), default="all",
              show_default=True, help="What to draw; all: every view on one HTML page.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), callback=_writable_file,
              help="Write here (.dot .svg .png .pdf .html).")
@click.option("--format", "output_format", type=click.Choice(["dot", "svg", "png", "pdf", "html"]),
              help="Default: from -o's suffix; DOT text (HTML for --view all) without -o.")
@click.option("--color-by", metavar="AXIS", help="Mesh view: colour devices by this mesh axis (default: the one that "
              "tells the drawn nodes apart).")
@param_option
@include_option
@model_import_option
def render_command(file, plan_name, view, output, output_format, color_by, params):
    """Draw a plan with graphviz: its mesh, placement, schedule or memory, or all on one HTML page."""
    fmt = api.render_format(output, output_format, view)
    if fmt is None:
        raise click.BadParameter(f"cannot tell the format from '{output}'; add --format", param_hint="-o")
    if (view == "all") != (fmt == "html"):
        raise click.UsageError("--view all writes one HTML page; the other views write dot, svg, png or pdf")
    try:
        plan = api.load_plan(file, plan_name, _params(params))
    except api.PlanError as error:
        _fail(error)
    problem = api.color_by_problem(plan, color_by)
    if problem:
        raise click.BadParameter(problem, param_hint="--color-by")
    try:
        data = api.render(plan, view, fmt, color_by)
    except api.PlanError as error:  # E811-E813 too: a view that does not apply, graphviz missing or failing
        _fail(error)
    if output:
        _write(output, data)
    else:
        click.echo(data, nl=False)  # bytes to the binary stream; through echo, as every output (_output_problem)

@main.command()
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--plan", "plan_name", help="The plan of the file to estimate.")
@click.option("--json", "as_json", is_flag=True, help="Print the breakdown as JSON.")
@click.option("--against", type=click.Path(dir_okay=False), metavar="METRICS.jsonl",
              help="A run's metrics (`plandsl run --metrics`): the prediction beside what was measured.")
@param_option
@include_option
@model_import_option
def estimate(file, plan_name, as_json, against, params):
    """Predict a plan's step time, throughput and memory per device (docs/cost-model.md)."""
    try:
        result = api.estimate(api.load_plan(file, plan_name, _params(params)))
        compared = api.estimate_against(result, against) if against else None  # E809-E810: the metrics
    except api.PlanError as error:
        _fail(error)
    if as_json:
        click.echo(json.dumps({**result.to_json(), **({"against": compared.to_json()} if compared else {})}, indent=1))
        return
    click.echo(api.format_estimate(result))
    if compared:
        click.echo(api.format_against(compared))


@main.command("inspect")
@click.argument("source")
@click.option("--seq", type=click.IntRange(min=2, max=limits.MAX_SEQ), default=2048, show_default=True,
              help="Sequence length the model is traced at (token ids; a source with input=image(...) is traced "
                   "per sample).")
@click.option("--dtype", type=click.Choice(["bfloat16", "float16", "float32"]), default="bfloat16", show_default=True,
              help="Default dtype the model is built under.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), callback=_writable_file,
              help="Write the table (the JSON cache) to this file.")
@click.option("--json", "as_json", is_flag=True, help="Print the table as JSON.")
def inspect_command(source, seq, dtype, output, as_json):
    """Build SOURCE on the meta device and print its layer table: pkg.module:function(key=value, ...)
    or hf("LlamaForCausalLM", hidden_size=..., ...) (config only, no download); the current folder is
    searched first for the module (docs/models.md). The model runs on token ids [1, seq], or with
    input=image(C, H, W) among the arguments on images, figures per sample. Given FILE.plan, every
    hf()/factory() model it writes, at its own seq, each table written where the plan reads it
    (.plandsl/ beside it)."""
    if source.endswith(".plan"):
        try:
            written = api.inspect_plan(source)
        except api.PlanError as error:  # E905: a call whose arguments are not literals; E901-E904, E110
            _fail(error)
        for model, path in written:
            click.echo(api.format_inspected(model) + f"\nwrote {path}")
        if not written:
            click.echo(f"{source}: no hf(...) or factory(...) model")
        return
    given = click.get_current_context().get_parameter_source("seq") is not click.core.ParameterSource.DEFAULT
    try:
        model = api.inspect_model(source, seq=seq if given else None, dtype=dtype)
    except api.PlanError as error:
        _fail(error)
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="SOURCE") from None
    text = model.model_dump_json(indent=1) + "\n"
    if output:
        _write(output, text)
    click.echo(text.rstrip("\n") if as_json else api.format_inspected(model))


@main.command("profile")
@click.option("-o", "--output", type=click.Path(dir_okay=False), callback=_writable_file, required=True,
              help="Write the cluster file here (its name, less .plan, names the node); on node 0 only.")
@click.option("--nproc-per-node", type=click.IntRange(min=1), default=1, show_default=True,
              help="Processes on this node, one per device (a GPU each on CUDA); 2 or more measure the collectives "
                   f"(at most {limits.MAX_LOCAL_RANKS}, and the GPUs of the machine).")
@click.option("--nnodes", type=click.IntRange(min=1), default=1, show_default=True,
              help=f"Machines taking part, each running this command (at most {limits.MAX_PROFILE_NODES}).")
@click.option("--node-rank", type=click.IntRange(min=0), default=0, show_default=True, help="This machine's index.")
@click.option("--rdzv-endpoint", metavar="HOST:PORT", help="Node 0's address, with several nodes.")
@click.option("--quick", is_flag=True, help="Fewer shapes, sizes and repeats: seconds instead of tens of seconds.")
@click.option("--sustain", type=float, metavar="SECONDS",
              help="Hold the device busy this long before the sustained timings (default: 30 on a GPU, 2 on a CPU; "
                   f"--quick 5 and 0.5; at most {limits.MAX_SUSTAIN_SECONDS:g}).")
def profile_command(output, nproc_per_node, nnodes, node_rank, rdzv_endpoint, quick, sustain):
    """Measure this machine through torch (GEMMs per precision and shape, memory bandwidth, collectives) and
    write it as a cluster file that check, estimate and generate read (docs/cli.md, profile)."""
    options = api.profile_options(nproc_per_node=nproc_per_node, nnodes=nnodes, node_rank=node_rank,
                                  rdzv_endpoint=rdzv_endpoint, quick=quick, sustain=sustain)
    problems = api.profile_problems(options)
    if problems:
        _fail(api.PlanError(problems))
    try:
        with _progress("profiling") as progress:
            measured = api.profile(options, progress)
    except api.PlanError as error:  # E720: a rank failed, or the nodes did not meet
        _fail(error)
    except KeyboardInterrupt as error:  # Ctrl-C; or a signal that stopped torch's launcher (Interrupted)
        name, status = api.interruption(error)
        click.echo(f"interrupted by {name}: nothing written to {output}", err=True)
        sys.exit(status)
    if measured is None:
        click.echo(f"node {node_rank}: measured with the others; node 0 writes the cluster file", err=True)
        return
    click.echo(api.profile_report(measured))
    api.write_profile(measured, output)  # E110 when it cannot (the boundary prints it, exit 1)
    click.echo(f"wrote {output}")


@main.command()
@click.option("--model", help="gpt(layers=96, ...), a stdlib model name or FILE.plan:NAME.")
@click.option("--cluster", help="`dgx_a100 x 128`, a stdlib node or cluster name.")
@click.option("--global-batch", type=click.IntRange(min=1, max=limits.MAX_GLOBAL_BATCH), help="Sequences per step.")
@click.option("--seq-len", type=click.IntRange(min=1, max=limits.MAX_SEQ), help="Sequence length (default: the model's).")
@click.option("--precision", type=click.Choice(api.precisions()), help="[default: bf16]")
@click.option("--fp8-recipe", type=click.Choice(["delayed", "current", "tensorwise", "blockwise"]),
              help="With --precision fp8, how the stack scales its tensors: Transformer Engine's delayed or current "
                   "scaling, torchao's tensorwise, blockwise (docs/language.md, \"FP8 recipes\"). [default: delayed]")
@click.option("--kernels", type=click.Choice(["fused", "eager"]),
              help="The implementation's element-wise kernels: fused (Transformer Engine, torch.compile) or eager "
                   "(PyTorch eager mode). [default: fused]")
@click.option("--attention", type=click.Choice(["flash", "materialized"]),
              help="The implementation's attention core: flash (fused) or materialized (s x s scores through "
                   "memory, Megatron-LM before 2022). [default: flash]")
@click.option("--loss", type=click.Choice(["standard", "fused", "megatron"]),
              help="The implementation's cross entropy: standard (over an fp32 copy of the logits), fused (one "
                   "kernel over the 16-bit logits, gradient in place) or megatron (standard, op by op as "
                   "Megatron-LM's default runs it). [default: standard]")
@click.option("--tensor-overlap", type=click.Choice(["async_tp", "userbuffers"]), is_flag=False,
              flag_value="async_tp", default=None,
              help="The implementation overlaps tensor-parallel collectives with their GEMMs: async_tp (torch's async "
                   "TP, the option alone) or userbuffers (Transformer Engine's, Megatron-LM's --tp-comm-overlap); plans "
                   "with sequence parallelism say `overlap` (`overlap = userbuffers`).")
@click.option("--tensor-implementation", type=click.Choice(["torch", "megatron"]),
              help="Whose tensor parallelism runs the layers: torch's (DTensor's styles, what torchtitan and `plandsl "
                   "run` run: under sequence parallelism each column-parallel linear saves its gathered input) or "
                   "megatron (Megatron-LM's: the sequence shard saved, gathered again in the backward), written "
                   "`tensor = ... with implementation = megatron`. [default: megatron with --tensor-overlap "
                   "userbuffers, else torch]")
@click.option("--pipeline", type=click.Choice(["torch", "megatron", "deepspeed", "dualpipe"]),
              help="Whose pipeline runs the stages: torch's (torch.distributed.pipelining, what `plandsl run` runs; "
                   "its stage buffers counted), megatron (Megatron-LM's: only 1f1b and interleaved_1f1b, none of "
                   "torch's buffers) or deepspeed (DeepSpeed's pipeline engine: only 1f1b, ZeRO 0 or 1, blocking "
                   "transfers, the gradients reduced after the schedule) or dualpipe (DeepSeek's DualPipe: only "
                   "dualpipev, Megatron-LM's memory), written `stages = ... with implementation = megatron` (or "
                   "deepspeed, dualpipe). [default: torch]")
@click.option("--from", "from_file", type=click.Path(dir_okay=False),
              help="A partial plan: its model, cluster and train are the problem, what else it writes is pinned.")
@click.option("--plan", "plan_name", help="The plan of the --from file.")
@click.option("--top", type=click.IntRange(min=1, max=100), default=5, show_default=True, help="Candidates to list.")
@click.option("--pin", "pins", multiple=True, metavar="KEY=VALUE",
              help="Fix a choice: dp, tp, pp, cp, ep, micro_batch_size, num_microbatches, schedule, "
                   "virtual_stages, zero_stage, recompute, recompute_layers, offload_layers, account (embed,loss), "
                   "order, tp_across_nodes, sequence_parallel, fold (the experts over [ep, tp]), "
                   "dispatcher (alltoall, deepep, hybridep), recompute_modules (comma-separated, Megatron's "
                   "--recompute-modules: recompute selective with them), data (replicate, zero1, zero2, zero3, "
                   "hsdp), dp_shard (hsdp's shard axis) (repeatable).")
@click.option("--time-limit", type=click.FloatRange(min=0, max=limits.MAX_GENERATE_SECONDS),
              default=limits.GENERATE_SECONDS, show_default=True, metavar="SECONDS", callback=_a_number,
              help="CPU seconds, after which the search stops with the fastest plans found (said so); 0: none.")
@click.option("--json", "as_json", is_flag=True, help='Print {"candidates": [...]}, best first.')
@click.option("--format", "output_format", type=click.Choice(["text", "json"]), default="text",
              help="json: as --json, and diagnostics one object per line.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), callback=_writable_file,
              help="Write the best plan to this file.")
@param_option
@include_option
@model_import_option
def generate(model, cluster, global_batch, seq_len, precision, fp8_recipe, kernels, attention, loss, tensor_overlap,
             tensor_implementation, pipeline, from_file,
             plan_name, top, pins,
             time_limit, as_json,
             output_format, output, params):
    """Search the fastest plans for MODEL on CLUSTER under the cost model and write the best.

    With --from, a partial plan gives the model, cluster and training settings, every decision it
    writes is kept (its lines stay as written), and the search adds what it leaves out; -o writes
    the file completed. The result passes `plandsl check` and `plandsl fmt --check`."""
    as_json = as_json or output_format == "json"
    request = api.generate_request(model=model, cluster=cluster, global_batch=global_batch, seq_len=seq_len,
                                   precision=precision, fp8_recipe=fp8_recipe, kernels=kernels, attention=attention,
                                   loss=loss,
                                   tensor_overlap=tensor_overlap, tensor_implementation=tensor_implementation,
                                   pipeline=pipeline, from_file=from_file,
                                   plan_name=plan_name,
                                   params=_params(params), pins=pins, top=top, output=output,
                                   time_limit=time_limit or None)
    usage_problem = api.generate_usage_error()
    try:
        with _progress("searching") as progress:
            generated = api.generate(request, progress)
    except usage_problem as error:
        raise click.UsageError(str(error)) from None
    except api.PlanError as error:  # E804/E805 the flags and pins, E814 no plan fits, E803 (--from), the language's
        _fail(error, output_format)
    for note in generated.notes:
        click.echo(f"note: {note}", err=True)
    if output:
        _write(output, generated.texts[0])
    if as_json:
        click.echo(json.dumps(api.generate_json(generated), indent=1))
        return
    click.echo(api.generate_report(generated))
    click.echo(f"wrote {output}" if output else "\n" + generated.texts[0].rstrip("\n"))


@main.command("diff")
@click.argument("file", type=click.Path(dir_okay=False))
@click.argument("other", type=click.Path(dir_okay=False))
@click.option("--plan-a", "plan_a", help="The plan of FILE (default: its only plan).")
@click.option("--plan-b", "plan_b", help="The plan of OTHER (default: its only plan).")
@click.option("--format", "output_format", type=click.Choice(["text", "json"]), default="text",
              help="json: the diff as one object (docs/cli.md); diagnostics one object per line.")
def diff_command(file, other, plan_a, plan_b, output_format):
    """What differs from plan FILE to plan OTHER, each change with the predicted step time, memory per device
    and exposed communication of both (docs/cli.md)."""
    try:
        a, b = api.load_plan(file, plan_a), api.load_plan(other, plan_b)
        diff = api.diff_plans(a, b, (file, other))
    except api.PlanError as error:
        _fail(error, output_format)
    if output_format == "json":
        click.echo(json.dumps(api.diff_json(diff), indent=1))
    else:
        click.echo(api.format_diff(diff))


@main.command("export")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--to", "target", type=click.Choice(api.interop_targets()), required=True, help="The tool to write for.")
@click.option("--plan", "plan_name", help="The plan of the file to export.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), callback=_writable_file,
              help="Write here (default: print it).")
@click.option("--lossy", is_flag=True, help="Write it even where the tool cannot express part of the plan "
              "(what is lost is listed on stderr).")
@param_option
@include_option
@model_import_option
def export_command(file, target, plan_name, output, lossy, params):
    """Write plan FILE in another tool's format (Megatron-LM's or torchtitan's arguments, DeepSpeed's JSON, torch's
    pipeline schedule CSV); exit 1, writing nothing, when the tool cannot express part of the plan, unless --lossy
    (docs/interop.md)."""
    analysis = api.check(file, _params(params))
    if not analysis.ok:
        _print_diagnostics(analysis, "text")
        sys.exit(1)
    try:
        plan = api.select_plan(analysis.document, plan_name)
    except api.PlanError as error:
        _fail(error)
    exported = api.export(plan, target)
    if exported.lost and (not lossy or exported.empty):
        click.echo(api.render_all(exported.lost, analysis.sources), err=True)
        click.echo(f"{file}: plan '{plan.name}' has nothing {target}'s format holds; nothing written" if exported.empty
                   else f"{file}: {len(exported.lost)} part(s) of plan '{plan.name}' lost in {target}'s format; "
                   "nothing written (--lossy writes it anyway)", err=True)
        sys.exit(1)
    for lost in exported.lost:
        click.echo(f"{lost.span}: lost: {lost.message}", err=True)
    if output:
        _write(output, exported.text)
        click.echo(f"wrote {output}", err=True)
    else:
        click.echo(exported.text, nl=False)


@main.command("import", context_settings={"ignore_unknown_options": True})
@click.option("--from", "source", type=click.Choice(api.interop_targets()), required=True, help="The tool whose "
              "configuration to read: megatron reads Megatron-LM's flags, torchtitan torchtitan's (after `--` or "
              "--args-file), deepspeed "
              "its JSON config (--args-file), torch-csv / torch-csv-comms torch's schedule CSV (--args-file; -o "
              "then holds a schedule table).")
@click.option("--world-size", type=click.IntRange(min=1, max=limits.MAX_MESH_DEVICES),
              help="Devices the configuration runs on (default: those of --cluster).")
@click.option("--cluster", help="The cluster, as `generate --cluster`: `dgx_a100 x 16`, a stdlib name "
              "(default: nodes of 8 H100s, dgx_h100).")
@click.option("--args-file", type=click.Path(dir_okay=False), help="Read the flags from FILE (a launch script's "
              "bash arrays, comments and \\-continued lines allowed).")
@click.option("--model", help="deepspeed: the model, as `generate --model` (its config does not say it).")
@click.option("--name", help="The plan's name (default: the output file's).")
@click.option("-o", "--output", type=click.Path(dir_okay=False), callback=_writable_file, required=True,
              help="Write the plan here.")
@click.option("--format", "output_format", type=click.Choice(["text", "json"]), default="text",
              help="json: diagnostics one object per line.")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def import_command(source, world_size, cluster, args_file, model, name, output, output_format, args):
    """Read another tool's configuration as a plan (-o OUT.plan) that passes `plandsl check`:
    `plandsl import --from megatron --world-size 64 -o my.plan -- --tensor-model-parallel-size 8 ...`."""
    if bool(args) == bool(args_file):
        raise click.UsageError("give the flags after `--`, or --args-file FILE (one of them)")
    schedule_only = source.startswith("torch-csv")  # a schedule CSV: no devices, no model
    if world_size is None and cluster is None and not schedule_only:
        raise click.UsageError("--world-size N or --cluster CLUSTER: the flags do not say how many devices")
    if (source == "deepspeed") != (model is not None):
        raise click.UsageError("--model is needed for deepspeed (its config does not say the model), and only there")
    if args_file:
        try:
            text, path = api.read_args_file(args_file, schedule_csv=schedule_only), args_file
        except api.PlanError as error:
            _fail(error, output_format)
    else:
        text, path = api.args_text(args), "<flags>"
    if name is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):  # the language's NAME
        raise click.UsageError(f"--name {name!r}: a name the language reads (letters, digits and _, not starting "
                               "with a digit)")
    name = name or api.import_name(output)
    try:
        imported = api.import_config(source, text, path, world_size, cluster, name, output, model)
    except ValueError as error:
        raise click.UsageError(str(error)) from None
    if not imported.ok:
        _fail(api.PlanError(imported.diagnostics, imported.sources), output_format)
    if imported.ignored:
        click.echo(f"note: left out (a plan does not hold them): {imported.left_out()}", err=True)
    _write(output, imported.text)
    if schedule_only:  # the table's name as written (`table_NAME`: never a built-in's), which plans name
        name = re.search(r"(?m)^schedule\s+(\w+)", imported.text).group(1)
    click.echo(f"wrote {output}: {'schedule' if schedule_only else 'plan'} '{name}'"
               + (f" ({len(imported.diagnostics)} warning(s))"
                                                    if imported.diagnostics else ""), err=True)


if __name__ == "__main__":
    main()
