"""The `plandsl` command: a few lines per command over `plandsl.api`.

Exit status: 0 success, 1 the input has problems (diagnostics printed), 2 usage errors.
Heavy modules (pydantic, torch) are imported inside commands so `--help` starts fast.
"""
from __future__ import annotations

import json
import sys

import click


def _params(values: tuple[str, ...]) -> dict:
    params = {}
    for item in values:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"'{item}' is not KEY=VALUE", param_hint="--param")
        params[key.strip()] = _scalar(raw.strip())
    return params


def _scalar(raw: str):
    if raw in ("true", "false"):
        return raw == "true"
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            pass
    return raw


param_option = click.option("--param", "params", multiple=True, metavar="KEY=VALUE",
                            help="Set a `param` of the file (repeatable).")


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
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("--format", "output_format", type=click.Choice(["text", "json"]), default="text",
              help="json: one object per diagnostic, one per line.")
@param_option
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
    from plandsl.summary import describe_document
    click.echo(describe_document(document, plans))


def api_select(document, name):
    from plandsl.select import select_plan
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
    from plandsl.catalogue import explain as explain_code
    text = explain_code(code.upper())
    if text is None:
        from plandsl.codes import CODES
        from plandsl.diagnostics import did_you_mean
        suggestion = did_you_mean(code.upper(), CODES, "codes")
        click.echo(f"unknown code '{code}'" + (f"; {suggestion}" if suggestion else "; see docs/errors.md"), err=True)
        sys.exit(2)
    click.echo(text)


@main.command()
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=False, allow_dash=True))
@click.option("--check", "check_only", is_flag=True, help="Change nothing; exit 1 if a file would change.")
def fmt(files, check_only):
    """Rewrite plan FILES in canonical layout (comments kept); `-` reads stdin."""
    from pathlib import Path
    from plandsl import api
    from plandsl.diagnostics import PlanError
    would_change = failed = False
    for file in files:
        data = sys.stdin.buffer.read() if file == "-" else Path(file).read_bytes()
        try:
            formatted = api.format_bytes(data, "<stdin>" if file == "-" else file)
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
                Path(file).write_text(formatted, encoding="utf-8")
                click.echo(f"{file}: reformatted")
    sys.exit(1 if failed or (check_only and would_change) else 0)


@main.command()
@click.argument("name")
@click.option("--ranks", type=click.IntRange(min=1), help="Pipeline ranks.")
@click.option("--microbatches", type=click.IntRange(min=1), help="Microbatches per step.")
@click.option("--virtual", type=click.IntRange(min=1), help="Stages per rank (interleaved, V-shape).")
@click.option("--format", "output_format", type=click.Choice(["text", "csv", "json", "plan"]), default="text",
              help="text: the step x rank grid; csv: torch's compute-only CSV; plan: a table schedule.")
@click.option("--simulate", "run_simulation", is_flag=True, help="Simulate it with --costs instead.")
@click.option("--costs", help="Seconds per action, e.g. F=1,B=2 or F=1,I=1,W=1,P2P=0.1.")
@click.option("--json", "as_json", is_flag=True, help="With --simulate: the figures as JSON.")
@click.option("--trace", type=click.Path(dir_okay=False), help="With --simulate: write a Chrome/Perfetto trace.")
def schedule(name, ranks, microbatches, virtual, output_format, run_simulation, costs, as_json, trace):
    """Print schedule NAME (a built-in, FILE.csv or FILE.plan:NAME) for the given sizes."""
    from plandsl.diagnostics import PlanError
    from plandsl.schedules import resolve
    try:
        found = resolve.load_schedule(name, ranks, microbatches, virtual)
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
@click.option("--trace", type=click.Path(dir_okay=False), help="Write a Chrome/Perfetto trace with real durations.")
@param_option
def simulate(file, plan_name, costs, as_json, trace, params):
    """Simulate the pipeline schedule of a plan: makespan, bubbles, memory per rank."""
    from plandsl import api
    from plandsl.diagnostics import PlanError
    from plandsl.schedules.resolve import parse_costs
    from plandsl.simulation import simulate_plan
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
    from plandsl.simulation import report
    if trace:
        with open(trace, "w", encoding="utf-8") as handle:
            json.dump(to_chrome_trace(simulation), handle)
    click.echo(json.dumps(simulation.to_json(), indent=1) if as_json else report(found, simulation, unit, memory_in_bytes))
    if simulation.deadlock is not None:
        sys.exit(1)


def _fail(error) -> None:
    from plandsl.diagnostics import render_all
    click.echo(render_all(error.diagnostics, error.sources), err=True)
    sys.exit(1)


if __name__ == "__main__":
    main()
