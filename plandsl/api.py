"""plandsl as a library: one function per stage, like `json` (load/loads, dump/dumps).

No logic lives here; each function calls the module that owns its stage and returns what it returns
(IR, dataclasses, bytes), never printed text except where text is the stage's output (a format, a
report). Functions that need a checked plan raise `PlanError` (a ValueError) carrying every diagnostic.

The CLI imports this module at start-up, so it imports only `plandsl.diagnostics` (the error type, its
printing and the limits on counts) at the top: each stage is imported inside the functions that use it
(marked `# stage`), so `plandsl --help` loads neither pydantic nor lark, and torch only `run` loads.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Callable, ContextManager, Iterator

from plandsl.diagnostics import Diagnostic, PlanError, limits, render_all, to_json_lines
from plandsl.diagnostics.internal import guard, interruption
from plandsl.diagnostics.source import NO_SPAN

if TYPE_CHECKING:
    from plandsl import ir
    from plandsl.check.analysis import Analysis
    from plandsl.cost.estimate import PlanEstimate as Estimate
    from plandsl.cost.against import Against
    from plandsl.ir.inspected import CacheState, InspectedModel
    from plandsl.rewrite.generate import Generated, Request as GenerateRequest
    from plandsl.rewrite.diff import PlanDiff
    from plandsl.rewrite.shrink import Shrunk
    from plandsl.runtime.dryrun import DryRun
    from plandsl.runtime.memtrace import TracedMemory
    from plandsl.runtime.launch import LaunchOptions
    from plandsl.runtime.submit import JobOptions, Submitted
    from plandsl.runtime.profile.job import ProfileOptions
    from plandsl.runtime.profile.results import Profile
    from plandsl.schedules.program import Schedule
    from plandsl.cost.simulation import Outline, Replica
    from plandsl.interop.result import Exported, Imported
    from plandsl.diagnostics.source import Span
    from plandsl.schedules.simulate import Costs, Simulation
    from plandsl.syntax import Module

Progress = Callable[[int, int], None]
"""`progress(done, total)`, called as long work advances (the CLI draws a bar on a terminal)."""

__all__ = ["PlanError", "Diagnostic", "limits", "render_all", "to_json_lines", "guard", "interruption", "parse",
           "parse_file", "check",
           "checks", "load", "loads", "load_plan", "load_runnable", "select_plan", "run_refusals", "format_text",
           "format_bytes", "format_file", "describe", "schema", "explain", "unknown_code", "schedule",
           "schedule_as", "parse_costs", "simulate_schedule", "simulate_named", "simulate", "simulate_replicas", "replicas_report", "replicas_trace",
           "simulation_report", "chrome_trace",
           "estimate", "estimate_against", "format_against", "format_estimate", "inspect_model", "inspect_plan", "format_inspected", "write_inspected", "read_inspected",
           "generate", "generate_request", "generate_usage_error", "generate_json", "generate_report", "diff_plans", "format_diff", "diff_json", "render",
           "render_format", "color_by_problem", "shrink", "rank_options", "launch_options", "check_launch_options",
           "prepare_run", "option_error", "dry_run", "format_dry_run",
           "traced_memory", "format_traced_memory",
           "dry_run_commands", "launch", "command_line", "launch_schedulers", "job_options", "check_job_options",
           "load_launchable", "launch_refusals", "cluster_job", "submit_job", "exit_status", "export", "import_config", "import_name", "interop_targets", "args_text",
           "read_args_file", "profile_options", "profile_problems", "profile", "write_profile",
           "profile_report", "parse_params", "include", "writable_file", "write_output", "unwritable",
           "writable_dir", "regular_file_problem", "data_path_problem"]


# ---- load and check ---------------------------------------------------------------------------------------

def parse(text: str, path: str = "<string>") -> Module:
    """Text -> syntax tree (no imports, no meaning)."""
    from plandsl.syntax.parser import parse_text  # stage
    return parse_text(text, path)


def parse_file(path: str | Path) -> Module:
    from plandsl.syntax.loader import read_source  # stage
    from plandsl.syntax.parser import parse_source  # stage
    return parse_source(read_source(path))


def check(path: str | Path, params: dict[str, Any] | None = None) -> Analysis:
    """Every diagnostic of a file and what it imports; never raises (a plandsl bug is E108)."""
    from plandsl.check.analysis import Analysis, analyze  # stage
    with guard(str(path)) as bug:
        return analyze(str(path), params=params)
    return Analysis(str(path), None, [bug.diagnostic])


def checks(text: str, params: dict[str, Any] | None = None, path: str = "<string>") -> Analysis:
    from plandsl.check.analysis import Analysis, analyze  # stage
    with guard(path) as bug:
        return analyze(path, text=text, params=params)
    return Analysis(path, None, [bug.diagnostic])


def load(path: str | Path, params: dict[str, Any] | None = None) -> ir.Document:
    """A checked document; raises PlanError when the file has errors."""
    return _document(check(path, params))


def loads(text: str, params: dict[str, Any] | None = None, path: str = "<string>") -> ir.Document:
    return _document(checks(text, params, path))


def load_plan(path: str | Path, name: str | None = None, params: dict[str, Any] | None = None) -> ir.Plan:
    """The plan called `name` (or the file's only plan), checked."""
    from plandsl.check.analysis import load_plan as load_checked_plan  # stage
    return load_checked_plan(path, name, params)


def select_plan(document: ir.Document, name: str | None = None) -> ir.Plan:
    """The plan called `name` of a checked document (or its only plan); PlanError naming the plans otherwise."""
    from plandsl.ir.select import select_plan as select  # stage
    return select(document, name)


def load_runnable(path: str | Path, name: str | None = None, params: dict[str, Any] | None = None,
                  cuda: bool | None = None) -> ir.Plan:
    """`load_plan`, and what `plandsl run` needs on top: PlanError with the E7xx refusals when the
    interpreter cannot run the plan (`plandsl.runtime.support`); `cuda`: whether the ranks run on CUDA
    (None: whether this machine has it, as `run` without `--device` decides)."""
    from plandsl.runtime.support import model_import_problems, refusals  # stage
    return _load_unrefused(path, name, params, lambda plan: refusals(plan, cuda=cuda) + model_import_problems(plan))


def _load_unrefused(path, name, params, refusals: Callable[[ir.Plan], list[Diagnostic]]) -> ir.Plan:
    """The checked plan, or PlanError with what `refusals` finds in it (with the file's sources)."""
    analysis = check(path, params)
    plan = select_plan(_document(analysis), name)
    refused = refusals(plan)
    if refused:
        raise PlanError(refused, analysis.sources)
    return plan


def run_refusals(plan: ir.Plan, cuda: bool | None = False) -> list[Diagnostic]:
    """Every reason `plandsl run` refuses a checked plan (E7xx Diagnostics), empty when it runs; `cuda`:
    whether its ranks run on CUDA (default: as on this CPU machine; None: whether this machine has CUDA)."""
    from plandsl.runtime.support import refusals  # stage
    return refusals(plan, cuda=cuda)


def _document(analysis: Analysis) -> ir.Document:
    from plandsl.check.analysis import checked_document  # stage
    return checked_document(analysis)


# ---- format, show, explain ---------------------------------------------------------------------------------

def format_text(text: str, path: str = "<string>") -> str:
    """Canonical layout of a plan's text (comments kept)."""
    from plandsl.syntax.format import format_text as format_plan_text  # stage
    return format_plan_text(text, path)


def format_bytes(data: bytes, path: str = "<string>") -> str:
    """Canonical layout of a file's bytes; PlanError E105 when they are not UTF-8 text."""
    from plandsl.syntax.format import format_module  # stage
    from plandsl.syntax.parser import decode, parse_source  # stage
    return format_module(parse_source(decode(path, data)))


def format_file(path: str, stdin: BinaryIO | None = None) -> tuple[bytes, str]:
    """A plan file's bytes (`-`: `stdin`'s, bounded) and their canonical layout; PlanError when they cannot
    be read or parsed."""
    from plandsl.syntax.format import format_file as read_and_format  # stage
    return read_and_format(path, stdin)


def describe(document: ir.Document, plans: list[ir.Plan] | None = None) -> str:
    """`plandsl show`'s summary of a checked document (only `plans`, when given)."""
    from plandsl.render.summary import describe_document  # stage
    return describe_document(document, list(document.plans) if plans is None else plans)


def schema() -> dict:
    """JSON Schema of the resolved IR (`plandsl show --json`)."""
    from plandsl import ir  # stage
    return ir.Document.model_json_schema()


def explain(code: str) -> str | None:
    """What diagnostic `code` means, an example and its fix; None for an unknown code."""
    from plandsl.diagnostics.catalogue import explain as explain_code  # the catalogue: 1,300 lines, not at start-up
    return explain_code(code.upper())


def unknown_code(code: str) -> str:
    from plandsl.diagnostics.catalogue import unknown_code as unknown  # the catalogue, as `explain`
    return unknown(code)


# ---- schedules, simulation, cost -----------------------------------------------------------------------------

def schedule(name: str, ranks: int | None = None, microbatches: int | None = None,
             virtual: int | None = None) -> Schedule:
    """Schedule `name` (a built-in, FILE.csv or FILE.plan:NAME) at these sizes; PlanError otherwise."""
    from plandsl.lower.schedule_spec import load_schedule  # stage
    return load_schedule(name, ranks, microbatches, virtual)


def schedule_as(found: Schedule, fmt: str) -> str:
    """A schedule as text (the step x rank grid), csv (torch's), plan (a table schedule) or json."""
    from plandsl.schedules.resolve import to_format  # stage
    return to_format(found, fmt)


def parse_costs(text: str | None) -> Costs:
    """`F=1,B=2,P2P=0.1` -> seconds per action; PlanError naming a bad entry."""
    from plandsl.schedules.resolve import parse_costs as parse  # stage
    return parse(text)


def simulate_schedule(found: Schedule, costs: Costs) -> Simulation:
    from plandsl.schedules.simulate import simulate as run  # stage
    return run(found, costs)


def simulate_named(name: str, ranks: int | None, microbatches: int | None, virtual: int | None,
                   costs: Costs) -> tuple[Schedule | Outline, Simulation]:
    """`schedule(name, ...)` simulated; a built-in too large to lay out is simulated in bounded work
    (its steady state extrapolated, `Simulation.extrapolated`), with an `Outline` for the table."""
    from plandsl.cost.simulation import simulate_named as run  # stage
    return run(name, ranks, microbatches, virtual, costs)


def simulate(plan: ir.Plan, costs: Costs | None = None) -> tuple[Schedule | Outline, Simulation]:
    """A checked plan's pipeline schedule, simulated with its cost model's durations (or `costs`); a
    built-in too large to lay out is simulated in bounded work, as `estimate` does it. With `batch_shares`:
    the slowest replica's (`simulate_replicas` gives every one)."""
    from plandsl.cost.simulation import simulate_plan  # stage
    if plan.train.batch_shares is not None:
        slowest = simulate_replicas(plan, costs)[0]
        return slowest.schedule, slowest.simulation
    return simulate_plan(plan, costs)


def simulate_replicas(plan: ir.Plan, costs: Costs | None = None) -> list[Replica]:
    """Each distinct replica of a plan with `batch_shares` (its own share's microbatches on its own devices)
    simulated, slowest first; the plan's one simulation without shares."""
    from plandsl.cost.simulation import simulate_replicas as run  # stage
    return run(plan, costs)


def replicas_report(replicas: list[Replica], unit: str = "", memory_in_bytes: bool = False) -> str:
    from plandsl.cost.simulation import replicas_report as report  # stage
    return report(replicas, unit, memory_in_bytes)


def replicas_trace(replicas: list[Replica]) -> dict:
    """Every replica's simulation as one Chrome/Perfetto trace (a process per replica); E609 as `chrome_trace`."""
    from plandsl.cost.simulation import replicas_trace as trace, trace_problem  # stage
    for replica in replicas:
        problem = trace_problem(replica.simulation)
        if problem is not None:
            raise problem
    return trace(replicas)


def simulation_report(found: Schedule | Outline, simulation: Simulation, unit: str = "", memory_in_bytes: bool = False) -> str:
    from plandsl.cost.simulation import report  # stage
    return report(found, simulation, unit, memory_in_bytes)


def chrome_trace(simulation: Simulation, span: Span | None = None) -> dict:
    """A simulation as a Chrome/Perfetto trace; PlanError (E609, at `span`) for one whose steady state
    was extrapolated, which has no event for most of its actions."""
    from plandsl.cost.simulation import trace_problem  # stage
    from plandsl.schedules.simulate import to_chrome_trace  # stage
    problem = trace_problem(simulation, span)
    if problem is not None:
        raise problem
    return to_chrome_trace(simulation)


def estimate(plan: ir.Plan) -> Estimate:
    """A checked plan's predicted step time, throughput and memory per device (docs/cost-model.md)."""
    from plandsl.cost.estimate import estimate_plan  # stage
    return estimate_plan(plan)


def estimate_against(result: Estimate, metrics: str | Path) -> Against:
    """The estimate beside what a run measured (`plandsl run --metrics`'s JSON lines at `metrics`): step time,
    tokens/s and peak memory, the median over the steps after the first with their min and max;
    PlanError E809 when the file cannot be read or records no step, E810 at a line that is not a step's record."""
    from plandsl.cost.against import MetricsError, compare, read_metrics  # stage
    with _coded(MetricsError):
        records = read_metrics(str(metrics))
    return compare(result, records, str(metrics))


def format_against(against: Against) -> str:
    from plandsl.cost.against import format_against as format_result  # stage
    return format_result(against)


def format_estimate(result: Estimate) -> str:
    from plandsl.cost.estimate import format_estimate as format_result  # stage
    return format_result(result)


# ---- inspect: a user's torch module as a layer table ----------------------------------------------------

def inspect_model(source: str, seq: int | None = None, dtype: str = "bfloat16",
                  search_path: tuple[str, ...] = (".",)) -> InspectedModel:
    """`pkg.mod:fn(k=v)` or `hf("Class", k=v)` built on the meta device and read as a layer table (imports
    torch, transformers and the user's code, from `search_path` first), at `seq` (default 2048), or per
    sample for a source with `input=image(...)`; PlanError E901-E904. ValueError when `source` is not a
    model source, or `seq` is given for images."""
    from plandsl.ir.inspected import parse_source  # stage
    from plandsl.runtime.inspect import inspect_model as derive  # stage: torch
    parsed = parse_source(source)
    if parsed.image and seq not in (None, 1):
        raise ValueError(f"'{source}' takes images (input=image(...)): it is traced per sample, not at a sequence "
                         "length (leave out seq)")
    return derive(parsed, 2048 if seq is None else seq, dtype, search_path)


def inspect_plan(path: str | Path) -> list[tuple[InspectedModel, str]]:
    """Every `hf(...)`/`factory(...)` model a plan file writes, inspected at its seq and written where the plan
    reads it (`.plandsl/` beside it, created): (table, cache path) each. The file's folder and the current
    one are searched first for a factory's module. PlanError: the file's syntax, E905 (at the call) for a call
    whose arguments are not literals, E901-E904, E110 (at the model's call) for a table that cannot be written
    there (`.plandsl` a file, a full disk)."""
    from plandsl.runtime.inspect.plan import inspect_plan as inspect  # stage: torch
    return inspect(path)


def format_inspected(model: InspectedModel) -> str:
    from plandsl.ir.inspected import summary  # stage
    return summary(model)


def write_inspected(model: InspectedModel, path: str | Path) -> None:
    from plandsl.ir.inspected import write_cache  # stage
    write_cache(model, path)


def read_inspected(path: str | Path, source: str | None = None, seq: int | None = None,
                   dtype: str | None = None) -> CacheState:
    """The cache at `path` and whether it is fresh for `source` at `seq` and `dtype` and the installed
    torch, transformers and plandsl (torch is not imported)."""
    from plandsl.ir.inspected import parse_source, read_cache  # stage
    return read_cache(path, parse_source(source) if source else None, seq, dtype)


# ---- generate, shrink, render ------------------------------------------------------------------------------

def generate(request: GenerateRequest, progress: Progress | None = None) -> Generated:
    """The fastest plans for a model on a cluster, or a partial plan completed (`request.from_file`), each
    passing `plandsl check`; `generate_usage_error()` when options do not go together, PlanError otherwise (a
    search's SearchError as its Diagnostic: E804/E805 the flags and pins, E814 no plan that fits, the language's
    code for what it says of --model and --cluster)."""
    from plandsl.rewrite.generate import generate as run_generate  # stage
    from plandsl.search import SearchError  # stage
    with _coded(SearchError):
        return run_generate(request, progress)


def generate_request(**options) -> GenerateRequest:
    """A `generate` request from its options (`rewrite.generate.Request`'s fields)."""
    from plandsl.rewrite.generate import Request  # stage
    return Request(**options)


def generate_usage_error() -> type[Exception]:
    """`rewrite.generate.UsageProblem`: what `generate` raises besides PlanError, for options that do not go together
    (the CLI's usage error, exit 2; to catch without importing)."""
    from plandsl.rewrite.generate import UsageProblem  # stage
    return UsageProblem


def generate_json(generated: Generated) -> dict:
    """`generate --json`: each candidate's figures, plan text and whether `plandsl run` runs it."""
    from plandsl.rewrite.generate import candidates_json  # stage
    return candidates_json(generated, run_refusals)


def generate_report(generated: Generated) -> str:
    """`generate`'s table of candidates and why the best won."""
    from plandsl.rewrite.generate import report  # stage
    return report(generated, run_refusals)


def shrink(path: str | Path, name: str | None = None, params: dict[str, Any] | None = None, ranks: int = 8,
           precision: str | None = None, out_dir: str | Path | None = None) -> Shrunk:
    """The plan scaled down to at most `ranks` CPU processes on one machine (`plandsl shrink`)."""
    from plandsl.rewrite.shrink import shrink as shrink_plan  # stage
    return shrink_plan(path, name, params, ranks, precision, out_dir)


def diff_plans(a: ir.Plan, b: ir.Plan, files: tuple[str, str] | None = None) -> PlanDiff:
    """What differs from checked plan `a` to `b` (layout, moved layers, sharding, schedule, batch, training),
    each change once, with `estimate`'s predictions for both (`plandsl diff`); `files` name them in its text."""
    from plandsl.rewrite.diff import diff_plans as compare  # stage
    return compare(a, b, files)


def format_diff(diff: PlanDiff) -> str:
    from plandsl.rewrite.diff import format_diff as format_result  # stage
    return format_result(diff)


def diff_json(diff: PlanDiff) -> dict:
    """`diff --format json`: the stable structure of docs/cli.md's "diff"."""
    from plandsl.rewrite.diff import diff_json as to_json  # stage
    return to_json(diff)


def render(plan: ir.Plan, view: str, fmt: str = "dot", color_by: str | None = None) -> bytes:
    """One view of a checked plan (mesh, placement, schedule, memory; `all` as HTML) in `fmt`; PlanError E811 (at
    the plan) when the view does not apply, E812 when graphviz is not installed, E813 when it fails."""
    from plandsl.render import RenderError, refusal, render_bytes  # stage
    with _coded(RenderError, lambda error: refusal(error, plan)):
        return render_bytes(plan, view, fmt, color_by)


def render_format(output: str | None, fmt: str | None, view: str) -> str | None:
    from plandsl.render import output_format  # stage
    return output_format(output, fmt, view)


def color_by_problem(plan: ir.Plan, axis: str | None) -> str | None:
    from plandsl.render import color_by_problem as problem  # stage
    return problem(plan, axis)


# ---- export and import: other tools' configurations ------------------------------------------------------------

def interop_targets() -> tuple[str, ...]:
    """The tools `export` writes and `import_config` reads (`megatron`)."""
    return ("megatron", "torchtitan", "deepspeed", "torch-csv", "torch-csv-comms")  # plandsl.interop.TARGETS, kept here so that
    # `plandsl --help` imports no stage


def export(plan: ir.Plan, target: str) -> Exported:
    """A checked plan in `target`'s own format, with one E808 per part of it the target cannot express."""
    from plandsl.interop import export_plan  # stage
    return export_plan(plan, target)


def import_config(target: str, text: str, path: str, world_size: int | None = None, cluster: str | None = None,
                  name: str = "imported", plan_path: str = "imported.plan", model: str | None = None) -> Imported:
    """`target`'s configuration (Megatron-LM's or torchtitan's flags, DeepSpeed's JSON as `text`, read from `path`) as a formatted
    plan that passes `check`, or the diagnostics that stop it (E804-E807, or the checker's); ValueError for a
    --cluster that is no cluster or a --model the target needs or says itself."""
    from plandsl.interop import import_text  # stage
    return import_text(target, text, path, world_size, cluster, name, plan_path, model)


def import_name(output: str) -> str:
    """The plan's name `plandsl import -o OUTPUT` gives without --name: OUTPUT's stem as a name of the language."""
    from plandsl.interop import plan_name  # stage
    return plan_name(output)


def args_text(args) -> str:
    """Command-line arguments as the one shell line `import_config` reads (each quoted where needed)."""
    from plandsl.interop import args_text as line  # stage
    return line(args)


def read_args_file(path: str, schedule_csv: bool = False) -> str:
    """A file of flags (a launch script's arrays), or with `schedule_csv` a torch schedule CSV, read bounded;
    PlanError E105-E109 when it cannot be read."""
    if schedule_csv:
        from plandsl.schedules.resolve import read_csv  # stage
        return read_csv(path)
    from plandsl.syntax.loader import read_source  # stage
    return read_source(path, "args file").text  # not a "plan file": a launch script's flags, a DeepSpeed JSON


# ---- run -----------------------------------------------------------------------------------------------------

def rank_options() -> tuple:
    """The options every rank takes (`runtime.options.RankOption`s), which `plandsl run` accepts and forwards."""
    from plandsl.runtime.options import RANK_OPTIONS  # stage (argparse only: cheap at the CLI's start-up)
    return RANK_OPTIONS


def launch_options(**options) -> LaunchOptions:
    from plandsl.runtime.launch import LaunchOptions  # stage
    return LaunchOptions(**options)


def check_launch_options(options: LaunchOptions) -> None:
    """`option_error()` (with `.option`) for a value wrong before the plan is read."""
    from plandsl.runtime.launch import check_options  # stage
    check_options(options)


def prepare_run(plan: ir.Plan, path: str, name: str | None, params: dict[str, Any], options: LaunchOptions,
                dry_run: bool = False) -> list[str]:
    """torchrun's arguments for a runnable plan (`load_runnable`); PlanError when the options do not fit it
    (E710-E714: the mesh against the nodes and processes, a missing endpoint, options that need another, GPUs),
    `option_error()` for one option's usage error (`--data`, `--device cuda` without a GPU)."""
    from plandsl.runtime.launch import LaunchError, prepare  # stage
    with _coded(LaunchError):
        return prepare(plan, path, name, params, options, dry_run)


def resume_refusal(plan: ir.Plan, error: Exception) -> PlanError:
    """E721 for the CheckpointError a rank raised resuming `plan` (`runtime.resume.refusal`), with the plan's source
    for its caret (`plandsl.run` prints it on rank 0)."""
    from plandsl.runtime.resume import refusal  # stage
    found = refusal(plan, error)
    return PlanError([found], _sources_at(found))


def option_error() -> type[Exception]:
    """`runtime.launch.OptionError` (with `.option`, `.missing`): what `check_launch_options`, `check_job_options`
    and `prepare_run` raise for one option's usage error (the CLI's exit 2)."""
    from plandsl.runtime.launch import OptionError  # stage
    return OptionError


@contextlib.contextmanager
def _coded(errors: type[Exception] | tuple[type[Exception], ...],
           diagnostic: Callable[[Any], Diagnostic] = lambda error: error.diagnostic) -> Iterator[None]:
    """Within the block, a stage's error of type `errors` is raised as PlanError: its Diagnostic (`diagnostic(error)`,
    the error's own `.diagnostic` unless said), with the sources for its caret (the error's `.sources` where it has
    them, else the files the diagnostic points into). The one conversion every coded stage error takes here."""
    try:
        yield
    except errors as error:
        found = diagnostic(error)
        raise PlanError([found], getattr(error, "sources", None) or _sources_at(found)) from None


def _sources_at(*diagnostics: Diagnostic) -> dict:
    """The files the diagnostics point into, for their carets (a file that no longer reads: none)."""
    from plandsl.syntax.loader import read_source  # stage
    sources = {}
    for file in {d.span.file for d in diagnostics if d.span is not NO_SPAN}:
        try:
            sources[file] = read_source(file)
        except PlanError:
            pass
    return sources


def dry_run(plan: ir.Plan, progress: Progress | None = None) -> DryRun:
    """Every rank's share of a plan built in this process on the meta device (imports torch and the model's
    factory); PlanError E716 naming the rank that cannot be built."""
    from plandsl.runtime.dryrun import DryRunError, dry_run as build, rank_refusal  # stage: torch
    with _coded(DryRunError, lambda error: rank_refusal(plan, error)):
        return build(plan, progress=progress)


def traced_memory(plan: ir.Plan, rank: int = 0, steps: int = 2, progress: Progress | None = None) -> TracedMemory:
    """`rank`'s first `steps` training steps run on fake tensors in this process, every allocation recorded and
    replayed through the caching allocator's model (`runtime.memtrace`); PlanError with E709 where its steps cannot
    run on fake tensors (a step that reads its data, one past the events a trace records)."""
    from plandsl.runtime.memtrace import TraceError, trace_refusal, traced_memory as trace  # stage: torch
    with _coded(TraceError, lambda error: trace_refusal(plan, str(error))):
        return trace(plan, rank, steps, progress)


def format_traced_memory(result: TracedMemory) -> str:
    from plandsl.runtime.memtrace import format_traced_memory as format_result  # stage: torch
    return format_result(result)


def format_dry_run(result: DryRun) -> str:
    from plandsl.runtime.dryrun import format_dry_run as format_result  # stage: torch
    return format_result(result)


def dry_run_commands(plan: ir.Plan, args: list[str], options: LaunchOptions) -> str:
    """The torchrun command(s) `run --dry-run` prints: one, or one per node of a mesh over several."""
    from plandsl.runtime.launch import dry_run_commands as commands  # stage
    return commands(plan, args, options)


def command_line(args: list[str]) -> str:
    from plandsl.runtime.launch import command_line as line  # stage
    return line(args)


def launch(args: list[str]) -> int:
    """Start torchrun with `args` in this process; its exit status, failed ranks named on stderr; PlanError E722 for
    nodes that do not meet at the rendezvous."""
    from plandsl.runtime.launch import LaunchError, launch as start  # stage: torch
    with _coded(LaunchError):
        return start(args)


# ---- launch on a cluster's scheduler --------------------------------------------------------------------------

def precisions() -> tuple[str, ...]:
    """The training precisions `generate --precision` takes: `ir.Precision`'s values, kept here so that
    `plandsl --help` imports no stage (tests/unit/test_fp8.py holds them equal)."""
    return ("bf16", "fp16", "fp32", "fp8", "mxfp8", "nvfp4")


def launch_schedulers() -> tuple[str, ...]:
    """The schedulers `plandsl launch` submits to through TorchX."""
    return ("slurm", "kubernetes")  # plandsl.runtime.submit.SCHEDULERS, kept here so that `plandsl --help` imports
    # no stage


def job_options(**options) -> JobOptions:
    from plandsl.runtime.submit import JobOptions  # stage
    return JobOptions(**options)


def check_job_options(job: JobOptions) -> None:
    """`option_error()` (with `.option`) for an option the scheduler cannot do without."""
    from plandsl.runtime.submit import check_job_options as check_options  # stage
    check_options(job)


def load_launchable(path: str | Path, name: str | None = None, params: dict[str, Any] | None = None,
                    cuda: bool = True) -> ir.Plan:
    """`load_runnable` for `plandsl launch`: PlanError with the E7xx refusals when the ranks could not run the
    plan (`cuda`: whether they run on GPUs, as a cluster's nodes do), and E707 when one TorchX job cannot start
    its nodes."""
    from plandsl.runtime.submit import refusals  # stage
    return _load_unrefused(path, name, params, lambda plan: refusals(plan, cuda=cuda))


def launch_refusals(plan: ir.Plan, cuda: bool = True) -> list[Diagnostic]:
    """Every reason `plandsl launch` refuses a checked plan (E7xx), empty when it submits it."""
    from plandsl.runtime.submit import refusals  # stage
    return refusals(plan, cuda=cuda)


def cluster_job(plan: ir.Plan, path: str, name: str | None, params: dict[str, Any], ranks: LaunchOptions,
                job: JobOptions) -> Any:
    """A plan `load_launchable` passed as TorchX's `AppDef`, built by TorchX's `dist.torchrun` (imports TorchX):
    `plandsl.run` with the rank options on every node; PlanError for rank options that need another (E713), an
    argument TorchX would rewrite (E715) and TorchX missing (E717)."""
    from plandsl.runtime.launch import LaunchError  # stage
    from plandsl.runtime.submit import JobError, app  # stage
    with _coded((LaunchError, JobError)):
        return app(plan, path, name, params, ranks, job)


def submit_job(app: Any, job: JobOptions) -> Submitted:
    """TorchX's dry run of the job on `job.scheduler` (the sbatch script, the Volcano job), or its submission and
    handle; PlanError for TorchX missing (E717), a scheduler or scheduler option TorchX refuses (E718, TorchX's
    own message in it) and a scheduler that refuses the job or cannot be reached (E719)."""
    from plandsl.runtime.submit import JobError, submit  # stage
    with _coded(JobError):
        return submit(app, job)


USAGE_CODES = frozenset({"E717", "E815"})
"""Diagnostics the command line exits 2 for, as for a usage error (docs/cli.md): this machine lacks a package (TorchX
for `launch`, pygls for `lsp`)."""


def exit_status(error: PlanError) -> int:
    """The command line's exit status for `error`: 2 where each of its errors is one of `USAGE_CODES` (TorchX or pygls
    not installed), else 1."""
    errors = [d.code for d in error.diagnostics if d.is_error]
    return 2 if errors and all(code in USAGE_CODES for code in errors) else 1


# ---- profile -------------------------------------------------------------------------------------------------

def profile_options(**options) -> ProfileOptions:
    from plandsl.runtime.profile.job import ProfileOptions  # stage
    return ProfileOptions(**options)


def profile_problems(options: ProfileOptions) -> list[Diagnostic]:
    """E505 for every `plandsl profile` option past its cap (asks torch how many GPUs this machine has)."""
    from plandsl.runtime.profile.job import option_problems  # stage: torch
    return option_problems(options)


def profile(options: ProfileOptions, progress: Progress | None = None) -> Profile | None:
    """Measure this machine through torch (`plandsl profile`): its `Profile` on node 0, None on the other nodes;
    PlanError E720 when a rank fails or the nodes do not meet. Writes nothing."""
    from plandsl.runtime.profile.job import ProfileError, run_profile  # stage: torch
    with _coded(ProfileError):
        return run_profile(options, progress)


def write_profile(profile: Profile, path: str) -> str:
    """Write `profile` as a cluster file at `path` (atomically: the old file or the new one, never a part);
    the text written. PlanError E110 when it cannot."""
    from plandsl.runtime.profile.job import write_cluster  # stage
    return write_cluster(profile, path)


def profile_report(profile: Profile) -> str:
    """The measurements with their spread and the fitted figures, as `plandsl profile` prints them."""
    from plandsl.runtime.profile.write import report_text  # stage
    return report_text(profile)


# ---- what every command shares -----------------------------------------------------------------------------

def parse_params(items) -> dict:
    """`KEY=VALUE` items -> {key: value} (true/false, integers and floats typed); ValueError otherwise."""
    from plandsl.runtime.options import parse_params as parse  # stage
    return parse(items)


def model_imports() -> ContextManager[None]:
    """A context inside which a plan's missing or stale model table (`hf(...)`, `factory(...)`) is derived with
    `plandsl inspect` and written where the plan reads it, instead of E215 (`--allow-model-import`: imports
    torch, transformers and the model's code, searched first in the plan's folder and the current one)."""
    from plandsl.lower.inspected import model_imports as allowing  # stage

    def derive(source, seq: int, plan_file: str):
        from plandsl.runtime.inspect import inspect_model as derive_table  # stage: torch
        return derive_table(source, seq, "bfloat16", (os.path.dirname(plan_file) or ".", "."))
    return allowing(derive)


def include(folders) -> ContextManager[None]:
    """A context inside which imports may also come from `folders` (`--include`)."""
    from plandsl.syntax.loader import include as including  # stage
    return including(folders)


def writable_file(path: str) -> str | None:
    """Why an output file cannot be written, or None (checked before work starts)."""
    from plandsl.syntax.files import writable_file as problem  # stage
    return problem(path)


def include_flags(folders) -> str:
    """`--include DIR` for each folder, quoted for a POSIX shell."""
    from plandsl.syntax.loader import include_flags as flags  # stage
    return flags(folders)


def replace_file(path: str, text: str) -> None:
    """Write `text` over the file `path` atomically (`fmt`); PlanError E110 when it cannot."""
    from plandsl.syntax.files import replace_file as replace  # stage
    replace(path, text)


def write_output(path: str, data: bytes | str) -> None:
    """Write an output file the command was asked for (`-o`, `--trace`); PlanError E110 when it cannot (a full
    disk, a path changed since `writable_file` passed it)."""
    from plandsl.syntax.files import write_output as write  # stage
    write(path, data)


def unwritable(path: str, error: OSError | str, what: str = "") -> Diagnostic:
    """E110 for an output that could not be written (`path` "": standard output or error), with the reason."""
    from plandsl.syntax.files import unwritable as problem  # stage
    return problem(path, error, what)


def writable_dir(path: str) -> str | None:
    from plandsl.syntax.files import writable_dir as problem  # stage
    return problem(path)


def data_path_problem(path: str) -> str | None:
    """Why `plandsl run --data PATH` cannot read PATH (a token file or a Hugging Face dataset folder), or None."""
    from plandsl.runtime.tokens import data_path_problem as problem  # stage: numpy only
    return problem(path)


def regular_file_problem(path: str, what: str = "file") -> str | None:
    from plandsl.syntax.files import regular_file_problem as problem  # stage
    return problem(path, what)
