"""The `plandsl` command: a few lines per command over `plandsl.api`.

Exit status: 0 success, 1 the input has problems (diagnostics printed), 2 usage errors.
Heavy modules (pydantic, torch) are imported inside commands so `--help` starts fast.
"""
from __future__ import annotations

import json
import shlex
import sys

import click

from plandsl.diagnostics import limits


def _params(values: tuple[str, ...]) -> dict:
    from plandsl.runtime.options import parse_params
    try:
        return parse_params(values)
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="--param") from None


param_option = click.option("--param", "params", multiple=True, metavar="KEY=VALUE",
                            help="Set a `param` of the file (repeatable).")


def _include(ctx, param, values):
    if values:
        from plandsl.syntax.loader import include
        ctx.with_resource(include(values))  # for this command only
    return values


include_option = click.option("--include", multiple=True, metavar="DIR", expose_value=False, callback=_include,
                              type=click.Path(exists=True, file_okay=False), is_eager=True,
                              help="Imports may also come from DIR (repeatable; also PLANDSL_PATH).")


def _writable_file(ctx, param, value):
    """An output file: refused before any work starts when it cannot be written (exit 2, the option named)."""
    from plandsl.syntax.files import writable_file
    reason = writable_file(value) if value else None
    if reason:
        raise click.BadParameter(f"cannot write '{value}': {reason}")
    return value


def _writable_dir(ctx, param, value):
    from plandsl.syntax.files import writable_dir
    reason = writable_dir(value) if value else None
    if reason:
        raise click.BadParameter(f"cannot write into '{value}': {reason}")
    return value


def _write(path: str, data: bytes | str) -> None:
    """Write an output file; a failure the checks before the work could not see is exit 1, not a traceback."""
    try:
        with open(path, "wb") as handle:
            handle.write(data.encode("utf-8") if isinstance(data, str) else data)
    except OSError as error:
        click.echo(f"{path}: error: cannot write: {error.strerror or error}", err=True)
        sys.exit(1)


def _print_diagnostics(analysis, output_format: str) -> None:
    from plandsl.diagnostics import render_all, to_json_lines
    if not analysis.diagnostics:
        return
    if output_format == "json":
        click.echo(to_json_lines(analysis.diagnostics))
    else:
        click.echo(render_all(analysis.diagnostics, analysis.sources), err=True)
        errors = len(analysis.errors)
        warnings = len(analysis.diagnostics) - errors
        click.echo(f"{analysis.path}: {errors} error(s), {warnings} warning(s)", err=True)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="plandsl")
def main() -> None:
    """plandsl: write, check, generate, render and run distributed training plans."""


@main.command()
@click.argument("files", nargs=-1, required=True, type=click.Path())
@click.option("--format", "output_format", type=click.Choice(["text", "json"]), default="text",
              help="json: one object per diagnostic, one per line.")
@param_option
@include_option
def check(files, output_format, params):
    """Check plan FILES; exit 1 if any has an error."""
    from plandsl import api
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
def show(file, as_json, plan_name, params):
    """Show the resolved plan (imports and parameters applied)."""
    from plandsl import api
    from plandsl.diagnostics import PlanError
    analysis = api.check(file, _params(params))
    if not analysis.ok:
        _print_diagnostics(analysis, "text")
        sys.exit(1)
    document = analysis.document
    try:
        plans = [api_select(document, plan_name)] if plan_name else list(document.plans)
    except PlanError as error:
        click.echo(str(error), err=True)
        sys.exit(1)
    if as_json:
        payload = document.model_dump(mode="json") if plan_name is None else plans[0].model_dump(mode="json")
        click.echo(json.dumps(payload, indent=2))
        return
    from plandsl.render.summary import describe_document
    click.echo(describe_document(document, plans))


def api_select(document, name):
    from plandsl.ir.select import select_plan
    return select_plan(document, name)


@main.command()
def schema():
    """Print the JSON Schema of the resolved IR."""
    from plandsl import api
    click.echo(json.dumps(api.schema(), indent=2))


@main.command()
@click.argument("code")
def explain(code):
    """Explain a diagnostic CODE (E101 ... W501): what it means, an example, the fix."""
    from plandsl.diagnostics.catalogue import explain as explain_code
    text = explain_code(code.upper())
    if text is None:
        from plandsl.diagnostics.codes import CODES
        from plandsl.diagnostics import did_you_mean
        suggestion = did_you_mean(code.upper(), CODES, "codes")
        click.echo(f"unknown code '{code}'" + (f"; {suggestion}" if suggestion else "; see docs/errors.md"), err=True)
        sys.exit(2)
    click.echo(text)


@main.command()
@click.argument("files", nargs=-1, required=True, type=click.Path(allow_dash=True))
@click.option("--check", "check_only", is_flag=True, help="Change nothing; exit 1 if a file would change.")
def fmt(files, check_only):
    """Rewrite plan FILES in canonical layout (comments kept); `-` reads stdin."""
    from plandsl import api
    from plandsl.diagnostics import PlanError
    from plandsl.syntax.files import FileProblem, read_bounded, read_stdin
    from plandsl.syntax.parser import MAX_BYTES
    would_change = failed = False
    for file in files:
        try:
            data = read_stdin(sys.stdin.buffer, MAX_BYTES) if file == "-" else read_bounded(file, MAX_BYTES,
                                                                                             "plan file")
            formatted = api.format_bytes(data, "<stdin>" if file == "-" else file)
        except FileProblem as problem:
            click.echo(PlanError([problem.diagnostic()]), err=True)
            failed = True
            continue
        except PlanError as error:
            click.echo(str(error), err=True)
            failed = True
            continue
        if file == "-":
            click.echo(formatted, nl=False)
        elif formatted.encode("utf-8") != data:
            would_change = True
            if check_only:
                click.echo(f"{file}: would reformat")
            else:
                _write(file, formatted)
                click.echo(f"{file}: reformatted")
    sys.exit(1 if failed or (check_only and would_change) else 0)


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
def schedule(name, ranks, microbatches, virtual, output_format, run_simulation, costs, as_json, trace):
    """Print schedule NAME (a built-in, FILE.csv or FILE.plan:NAME) for the given sizes."""
    from plandsl.diagnostics import PlanError
    from plandsl.schedules import resolve
    from plandsl.lower.schedule_spec import load_schedule
    try:
        found = load_schedule(name, ranks, microbatches, virtual)
        if run_simulation:
            _simulated(found, resolve.parse_costs(costs), as_json, trace, memory_in_bytes=False)
            return
    except PlanError as error:
        _fail(error)
    writers = {"text": resolve.to_text, "csv": resolve.to_torch_csv, "plan": resolve.to_plan,
               "json": lambda s: json.dumps(resolve.to_json(s), indent=1)}
    click.echo(writers[output_format](found).rstrip("\n"))


@main.command()
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--plan", "plan_name", help="The plan of the file to simulate.")
@click.option("--costs", help="Seconds per action instead of the plan's cost model, e.g. F=1,B=2,P2P=0.1.")
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON.")
@click.option("--trace", type=click.Path(dir_okay=False), callback=_writable_file,
              help="Write a Chrome/Perfetto trace with real durations.")
@param_option
@include_option
def simulate(file, plan_name, costs, as_json, trace, params):
    """Simulate the pipeline schedule of a plan: makespan, bubbles, memory per rank."""
    from plandsl import api
    from plandsl.diagnostics import PlanError
    from plandsl.schedules.resolve import parse_costs
    from plandsl.cost.simulation import simulate_plan
    try:
        plan = api.load_plan(file, plan_name, _params(params))
        schedule_, simulation = simulate_plan(plan, parse_costs(costs) if costs else None)
    except PlanError as error:
        _fail(error)
    _emit_simulation(schedule_, simulation, as_json, trace, memory_in_bytes=True,
                     unit="" if costs else " s")


def _simulated(found, costs, as_json, trace, memory_in_bytes):
    from plandsl.schedules.simulate import simulate as run
    _emit_simulation(found, run(found, costs), as_json, trace, memory_in_bytes)


def _emit_simulation(found, simulation, as_json, trace, memory_in_bytes, unit=""):
    from plandsl.schedules.simulate import to_chrome_trace
    from plandsl.cost.simulation import report
    if trace:
        _write(trace, json.dumps(to_chrome_trace(simulation)))
    click.echo(json.dumps(simulation.to_json(), indent=1) if as_json else report(found, simulation, unit, memory_in_bytes))
    if simulation.deadlock is not None:
        sys.exit(1)


def _token_file(ctx, param, value):
    from plandsl.syntax.files import FileProblem, check_regular
    if value:
        try:
            check_regular(value, "token file")
        except FileProblem as problem:
            raise click.BadParameter(problem.message) from None
    return value


def _endpoint_problem(endpoint: str) -> str | None:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return "expected HOST:PORT with a port from 1 to 65535"
    return None


def _fail(error, output_format: str = "text") -> None:
    from plandsl.diagnostics import render_all, to_json_lines
    if output_format == "json":
        click.echo(to_json_lines(error.diagnostics))
    else:
        click.echo(render_all(error.diagnostics, error.sources), err=True)
    sys.exit(1)


@main.command("run")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--plan", "plan_name", help="The plan of the file to run.")
@click.option("--nproc-per-node", type=click.IntRange(min=1, max=limits.MAX_LOCAL_RANKS),
              help=f"Processes on this node (default: mesh size / nnodes; at most {limits.MAX_LOCAL_RANKS}).")
@click.option("--nnodes", type=click.IntRange(min=1, max=limits.MAX_NODES), default=1, show_default=True,
              help="Machines taking part.")
@click.option("--node-rank", type=click.IntRange(min=0), default=0, show_default=True, help="This machine's index.")
@click.option("--rdzv-endpoint", metavar="HOST:PORT", help="Node 0's address, with several nodes.")
@click.option("--steps", type=click.IntRange(min=1, max=limits.MAX_STEPS), default=10, show_default=True,
              help="The step to stop at, counted from the start of training (also with --resume).")
@click.option("--metrics", type=click.Path(dir_okay=False), callback=_writable_file,
              help="Write one JSON object per step here.")
@click.option("--check-equivalence", is_flag=True, help="Compare losses and parameters with one process.")
@click.option("--data", type=click.Path(exists=True, dir_okay=False), callback=_token_file,
              help="A uint16 token file (nanoGPT .bin).")
@click.option("--checkpoint-dir", type=click.Path(file_okay=False), callback=_writable_dir,
              help="Write checkpoints here (step-NNNNNN directories), always after the last step.")
@click.option("--checkpoint-every", type=click.IntRange(min=1), metavar="K", help="A checkpoint every K steps.")
@click.option("--resume", is_flag=True, help="Continue from the latest checkpoint in --checkpoint-dir.")
@click.option("--dry-run", is_flag=True, help="Build every rank's share in this process on the meta device (this "
              "imports and calls the model's factory), print its parameters and memory, and the torchrun command "
              "for every node; no rank is started, nothing trained or allocated.")
@param_option
@include_option
def run_command(file, plan_name, nproc_per_node, nnodes, node_rank, rdzv_endpoint, steps, metrics,
                check_equivalence, data, checkpoint_dir, checkpoint_every, resume, dry_run, params):
    """Check plan FILE, then train it on torch.distributed (one process per device of its mesh)."""
    from plandsl import api
    from plandsl.diagnostics import PlanError
    from plandsl.runtime import launch
    overrides = _params(params)
    if node_rank >= nnodes:
        raise click.BadParameter(f"{node_rank} is not below --nnodes ({nnodes}): nodes are numbered 0 to "
                                 f"{nnodes - 1}", param_hint="--node-rank")
    if rdzv_endpoint is not None and _endpoint_problem(rdzv_endpoint):
        raise click.BadParameter(f"'{rdzv_endpoint}': {_endpoint_problem(rdzv_endpoint)}",
                                 param_hint="--rdzv-endpoint")
    try:
        plan = api.load_runnable(file, plan_name, overrides)  # checked, and runnable (E7xx otherwise)
    except PlanError as error:
        _fail(error)
    options = launch.LaunchOptions(nproc_per_node, nnodes, node_rank, rdzv_endpoint, steps, metrics,
                                   check_equivalence, data, checkpoint_dir, checkpoint_every, resume)
    if data:
        from plandsl.runtime.tokens import token_file_problem
        problem = token_file_problem(data, plan)
        if problem:
            raise click.BadParameter(problem, param_hint="--data")
    try:
        args = launch.torchrun_args(plan, file, plan_name, overrides, options)
        if not dry_run:  # a dry run builds the ranks here and starts nothing
            launch.check_fits(plan, options)
    except launch.LaunchError as error:
        click.echo(f"{file}: error: {error}", err=True)
        sys.exit(1)
    if dry_run:  # every rank built here on the meta device, its figures, then the command; nothing starts
        from plandsl.runtime.dryrun import DryRunError, dry_run_report
        try:
            click.echo(dry_run_report(plan))
        except DryRunError as error:
            click.echo(f"{file}: error: plan '{plan.name}': {error}", err=True)
            sys.exit(1)
        click.echo(launch.dry_run_commands(plan, args, options))
        sys.exit(0)
    click.echo(launch.command_line(args))
    sys.exit(launch.launch(args))


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
def shrink(file, plan_name, ranks, precision, output, output_format, params):
    """Scale plan FILE down to one machine: the same layout on at most --ranks CPU processes, a tiny model.

    Then `plandsl run OUT.plan --check-equivalence` trains it here against one process."""
    import os
    from plandsl.diagnostics import PlanError
    from plandsl.rewrite.shrink import shrink as shrink_plan
    try:
        shrunk = shrink_plan(file, plan_name, _params(params), ranks, precision,
                             os.path.dirname(os.path.abspath(output)) if output else None)
    except PlanError as error:
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
    folders = "".join(f" --include {shlex.quote(folder)}" for folder in shrunk.include)
    click.echo(f"run it: plandsl run {shlex.quote(output)}{folders} --check-equivalence", err=True)


@main.command("render")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--plan", "plan_name", help="The plan of the file to render.")
@click.option("--view", type=click.Choice(["mesh", "placement", "schedule", "memory", "all"]), default="all",
              show_default=True, help="What to draw; all: every view on one HTML page.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), callback=_writable_file,
              help="Write here (.dot .svg .png .pdf .html).")
@click.option("--format", "output_format", type=click.Choice(["dot", "svg", "png", "pdf", "html"]),
              help="Default: from -o's suffix; DOT text (HTML for --view all) without -o.")
@click.option("--color-by", metavar="AXIS", help="Mesh view: colour devices by this mesh axis.")
@param_option
@include_option
def render_command(file, plan_name, view, output, output_format, color_by, params):
    """Draw a plan with graphviz: its mesh, placement, schedule or memory, or all on one HTML page."""
    from plandsl import api
    from plandsl.diagnostics import PlanError
    from plandsl.render import RenderError, format_of, render_bytes
    fmt = format_of(output, output_format) or ("html" if view == "all" else None if output else "dot")
    if fmt is None:
        raise click.BadParameter(f"cannot tell the format from '{output}'; add --format", param_hint="-o")
    if (view == "all") != (fmt == "html"):
        raise click.UsageError("--view all writes one HTML page; the other views write dot, svg, png or pdf")
    try:
        plan = api.load_plan(file, plan_name, _params(params))
    except PlanError as error:
        _fail(error)
    if color_by and plan.mesh.axis(color_by) is None:
        raise click.BadParameter(f"the mesh has no axis '{color_by}' (its axes: "
                                 f"{', '.join(a.name for a in plan.mesh.axes)})", param_hint="--color-by")
    try:
        data = render_bytes(plan, view, fmt, color_by)
    except PlanError as error:
        _fail(error)
    except RenderError as error:
        click.echo(f"{file}: error: {error}", err=True)
        sys.exit(1)
    if output:
        _write(output, data)
    else:
        sys.stdout.buffer.write(data)

@main.command()
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--plan", "plan_name", help="The plan of the file to estimate.")
@click.option("--json", "as_json", is_flag=True, help="Print the breakdown as JSON.")
@param_option
@include_option
def estimate(file, plan_name, as_json, params):
    """Predict a plan's step time, throughput and memory per device (docs/cost-model.md)."""
    from plandsl import api
    from plandsl.cost.estimate import estimate_plan, format_estimate
    from plandsl.diagnostics import PlanError
    try:
        result = estimate_plan(api.load_plan(file, plan_name, _params(params)))
    except PlanError as error:
        _fail(error)
    click.echo(json.dumps(result.to_json(), indent=1) if as_json else format_estimate(result))


@main.command()
@click.option("--model", help="gpt(layers=96, ...), a stdlib model name or FILE.plan:NAME.")
@click.option("--cluster", help="`dgx_a100 x 128`, a stdlib node or cluster name.")
@click.option("--global-batch", type=click.IntRange(min=1, max=limits.MAX_GLOBAL_BATCH), help="Sequences per step.")
@click.option("--seq-len", type=click.IntRange(min=1, max=limits.MAX_SEQ), help="Sequence length (default: the model's).")
@click.option("--precision", type=click.Choice(["bf16", "fp16", "fp32"]), help="[default: bf16]")
@click.option("--from", "from_file", type=click.Path(dir_okay=False),
              help="A partial plan: its model, cluster and train are the problem, what else it writes is pinned.")
@click.option("--plan", "plan_name", help="The plan of the --from file.")
@click.option("--top", type=click.IntRange(min=1, max=100), default=5, show_default=True, help="Candidates to list.")
@click.option("--pin", "pins", multiple=True, metavar="KEY=VALUE",
              help="Fix a choice: dp, tp, pp, cp, ep, micro_batch_size, num_microbatches, schedule, "
                   "virtual_stages, zero_stage, recompute, order, tp_across_nodes (repeatable).")
@click.option("--json", "as_json", is_flag=True, help='Print {"candidates": [...]}, best first.')
@click.option("--format", "output_format", type=click.Choice(["text", "json"]), default="text",
              help="json: as --json, and diagnostics one object per line.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), callback=_writable_file,
              help="Write the best plan to this file.")
@param_option
@include_option
def generate(model, cluster, global_batch, seq_len, precision, from_file, plan_name, top, pins, as_json,
             output_format, output, params):
    """Search the fastest plans for MODEL on CLUSTER under the cost model and write the best.

    With --from, a partial plan gives the model, cluster and training settings, every decision it
    writes is kept (its lines stay as written), and the search adds what it leaves out; -o writes
    the file completed. The result passes `plandsl check` and `plandsl fmt --check`."""
    from plandsl import api
    from plandsl.diagnostics import PlanError
    from plandsl.search import SearchError, search
    from plandsl.rewrite.complete import generate_from
    from plandsl.search.emit import candidate_json, checked_texts, explain, format_table, resolve_problem
    as_json = as_json or output_format == "json"
    given = [f"--{name}" for name, value in (("model", model), ("cluster", cluster), ("global-batch", global_batch),
                                             ("seq-len", seq_len), ("precision", precision)) if value is not None]
    if from_file and given:
        raise click.UsageError(f"{', '.join(given)}: the --from plan gives these (edit the plan instead)")
    if not from_file and (model is None or cluster is None or global_batch is None):
        raise click.UsageError("--model, --cluster and --global-batch are required (or --from PLAN)")
    if (plan_name or params) and not from_file:
        raise click.UsageError(f"{'--plan' if plan_name else '--param'} is for the --from file")
    bar = None

    def progress(done, total):
        nonlocal bar
        if bar is None and sys.stderr.isatty() and total:
            bar = click.progressbar(length=total, label="searching", file=sys.stderr).__enter__()
        if bar is not None:
            bar.update(done - bar.pos)
    try:
        if from_file:
            completed = generate_from(from_file, plan_name, _params(params), pins, top, progress, output)
            for note in completed.notes:
                click.echo(f"note: {note}", err=True)
            result, texts = completed.result, list(completed.texts)
        else:
            problem, source = resolve_problem(model, cluster, global_batch, seq_len, precision or "bf16")
            result, texts = checked_texts(search(problem, pins, top, progress=progress), problem, source, output)
    except PlanError as error:
        _fail(error, output_format)
    except SearchError as error:
        click.echo(f"error: {error}", err=True)
        sys.exit(1)
    finally:
        if bar is not None:
            bar.__exit__(None, None, None)
    if output:
        _write(output, texts[0])
    if as_json:
        click.echo(json.dumps({"candidates": [candidate_json(s, t, api.run_refusals)
                                              for s, t in zip(result.candidates, texts)]},
                              indent=1))
        return
    click.echo(format_table(result))
    click.echo(explain(result, api.run_refusals))
    click.echo(f"wrote {output}" if output else "\n" + texts[0].rstrip("\n"))


if __name__ == "__main__":
    main()
