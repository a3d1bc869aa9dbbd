"""A plan's pipeline schedule <-> torch's schedule CSV (`_PipelineScheduleRuntime._load_csv`, torch 2.13).

Stage: interop, beside render. Contract: `export_plan(plan)` writes the compute-only CSV (`torch-csv`: one
row per pipeline rank, one action a cell, `0F1` = stage 0's forward of microbatch 1, an empty cell an idle
step, what `_load_csv(format="compute_only")` reads and lowers itself) and `export_comms(plan)` the lowered
one (`torch-csv-comms`: the same with the send/recv actions `schedules.lower.add_send_recv` places, what
`_load_csv(format="compute_comms")` reads as written), each for the plan's own sizes (ranks, microbatches,
stages per rank), with an E808 when the plan has no pipeline or its schedule runs a stage on two ranks
(Chimera's two pipelines: torch maps each stage to one rank). The CSV says the schedule only; the rest of
the plan (model, mesh, sharding) is not its to say, and is not reported lost. `import_csv(text, path, name)`
reads either CSV (send/recv actions are dropped: `plandsl run` lowers the compute again) as a file holding
one `schedule table_NAME(ranks, microbatches) { ... }` table, checked, that plans import and name
(`schedule = table_NAME`), or E602/E603 and the schedule rules' diagnostics. tests/unit/test_interop_torch_csv.py
loads the exports into torch's own `_PipelineScheduleRuntime` on a fake process group and runs its simulator.
"""
from __future__ import annotations

from plandsl import ir
from plandsl.check.analysis import analyze
from plandsl.cost.schedule import plan_schedule
from plandsl.diagnostics import PlanError, diag
from plandsl.interop.result import Exported, Imported
from plandsl.schedules.lower import add_send_recv
from plandsl.schedules.program import cell_error, cell_span, csv_cells, csv_lines, parse_action, to_csv
from plandsl.schedules.resolve import csv_source, idle_rank, schedule_from_csv, to_plan, to_torch_csv
from plandsl.schedules.simulate import GridTooLarge, step_grid
from plandsl.diagnostics.source import SourceFile, Span
from plandsl.syntax.parser import MAX_BYTES, MAX_TOKENS
from plandsl.syntax.files import shown_path
from plandsl.syntax.format import format_text

TARGET = "torch-csv"
COMMS = "torch-csv-comms"


def _schedule(plan: ir.Plan):
    """(the plan's laid-out schedule or None, its E808s)."""
    field = "schedule" if plan.schedule is not None else "stages"
    span = getattr(getattr(plan, field, None), "span", None) or plan.span_of(field) or plan.span
    if plan.stages is None or plan.schedule is None:
        return None, (diag("E808", f"torch's schedule CSV holds a pipeline schedule, and plan '{plan.name}' has "
                                   "no pipeline", span, hint="export a plan with `stages` over a pipeline axis"),)
    schedule, problems = plan_schedule(plan)
    if schedule is None:
        return None, tuple(problems)
    if len(schedule.stage_to_rank) > 1:  # Chimera: a pipeline in each direction, each stage on two ranks
        return None, (diag("E808", f"torch's schedule runtime maps each stage to one rank; schedule "
                                   f"'{plan.schedule.name}' runs its stages on {len(schedule.stage_to_rank)} "
                                   "pipelines at once", span),)
    return schedule, ()


def export_plan(plan: ir.Plan) -> Exported:
    schedule, lost = _schedule(plan)
    try:
        return Exported(TARGET, to_torch_csv(schedule) if schedule is not None else "", lost)
    except GridTooLarge as error:
        return Exported(TARGET, "", (*lost, diag("E609", str(error), plan.span_of("schedule") or plan.span,
                                                 hint="torch's compute-only CSV writes every step of every rank, idle "
                                                      "ones too; --to torch-csv-comms writes each rank's actions")))


def export_comms(plan: ir.Plan) -> Exported:
    schedule, lost = _schedule(plan)
    if schedule is None:
        return Exported(COMMS, "", lost)
    lowered = add_send_recv(schedule)
    return Exported(COMMS, to_csv(lowered.actions), lost)  # each rank's actions in order, no idle cells


def import_csv(text: str, path: str, name: str = "imported", plan_path: str = "imported.plan") -> Imported:
    """Either torch CSV as a checked file holding the schedule `name` (its communication actions dropped). A table
    too large to write (E609: more cells than a grid is laid out with, more characters or tokens than a plan holds) is
    reported at the cell of the action that runs last: its step is the table's length."""
    try:
        schedule = schedule_from_csv(_compute_cells(text, path), name, path).compute_only()
    except PlanError as error:
        return Imported(None, tuple(error.diagnostics), error.sources)
    source = csv_source(path, text)

    def too_large(message: str, last: tuple[int, object] | None) -> Imported:
        return Imported(None, (diag("E609", message, _cell(source, *last) if last is not None else None,
                                    hint="a table writes every step of every rank, idle ones too"),), {path: source})

    try:
        grid = step_grid(schedule)
    except GridTooLarge as error:  # a grid is not bounded by the CSV's actions (n ranks of an F and a B: n x 2n cells)
        return too_large(str(error), error.last)
    rank = next((r for r, row in enumerate(grid) if row and row[-1] is not None), None)
    last = (rank, grid[rank][-1]) if rank is not None else None
    sizes = f"({schedule.ranks:,} ranks of {len(grid[0]) if grid else 0:,} unit-time steps)"
    written_cells = sum(len(row) - next((i for i, a in enumerate(reversed(row)) if a is not None), len(row))
                        for row in grid)  # what `to_plan` writes, a token or more each (trailing idle steps left out)
    if written_cells > MAX_TOKENS:  # known before the table is written and parsed (~5 s at the limit)
        return too_large(f"schedule '{name}' as a table has {written_cells:,} cells, more than the {MAX_TOKENS:,} "
                         f"tokens of a plan {sizes}", last)
    body = to_plan(schedule, grid)
    if len(body) > MAX_BYTES:  # what a plan may hold: no parser would read it back
        return too_large(f"schedule '{name}' as a table is {len(body):,} characters, more than the {MAX_BYTES:,} of a "
                         f"plan {sizes}", last)
    written_name = body.split("(", 1)[0].removeprefix("schedule ").strip()  # `table_NAME`: never a built-in's
    header = (f"# Imported from {shown_path(path)} (torch's schedule CSV): {schedule.ranks} pipeline ranks, "
              f"{schedule.microbatches} microbatches, {schedule.stages} stages.\n"
              f"# A plan uses it with `import \"{shown_path(plan_path.rsplit('/', 1)[-1].removesuffix('.plan'))}\"` and "
              f"`schedule = {written_name}`.\n")
    try:
        written = format_text(header + body)
    except PlanError as error:  # more tokens than a plan may hold (E106, under MAX_BYTES: an idle cell is two bytes)
        if [d.code for d in error.diagnostics] != ["E106"]:
            raise
        return too_large(f"schedule '{name}' as a table has more than the {MAX_TOKENS:,} tokens of a plan {sizes}", last)
    analysis = analyze(plan_path, text=written)
    return Imported(written if analysis.ok else None, tuple(analysis.diagnostics), analysis.sources)


def _cell(source: SourceFile, rank: int, action) -> Span | None:
    """Where the CSV writes `action` in `rank`'s row: the rank-th row `from_csv` reads (a line with a cell
    `_compute_cells` keeps), the cell that parses to it; None if not found. Reads lines up to that row."""
    text, comms = source.text, any(kind in source.text for kind in _COMMS)
    row = -1
    for offset, line in csv_lines(text):
        cells = csv_cells(offset, line)
        kept = [(at, cell) for at, cell in cells if cell.strip() and not any(k in cell for k in _COMMS)]
        if not (kept if comms else line.strip()):
            continue
        row += 1
        if row < rank:
            continue
        for at, cell in kept:
            try:
                if parse_action(cell.strip()) == action:
                    return source.span(*cell_span(text, at, cell))
            except ValueError:
                continue
        return None
    return None


_COMMS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")  # a lowered CSV's transfers, which the import drops


def _compute_cells(text: str, path: str) -> str:
    """The CSV with its send/recv cells removed (a lowered CSV: each row's actions in order, no idle steps), each
    checked to be one, and every other cell (`0SEND_Fx1`: PlanError E602 at the cell, located in the text read, not in
    the rows left)."""
    comms = _COMMS
    if not any(kind in text for kind in comms):
        return text
    rows, idle = [], None  # idle: the first record with no compute action, torch's rank with none (a blank line too)
    for offset, line in csv_lines(text):
        cells = []
        for at, cell in csv_cells(offset, line):
            try:  # a send or receive is dropped once it reads as one; a compute cell is read here, where it is
                if cell.strip():
                    parse_action(cell.strip())
            except ValueError as error:
                bad = cell_error(text, at, cell, error)
                source = csv_source(path, text)
                raise PlanError([diag("E602", f"{path}: {bad}", source.span(bad.start, bad.end))],
                                {path: source}) from None
            if cell.strip() and not any(k in cell for k in comms):
                cells.append(cell.strip())  # as torch reads it: a quoted cell's line break is no row's end here
        if not cells and idle is None:
            idle = (offset, line, len(rows))
        rows.append(",".join(cells))
    if idle is not None and any(rows):  # none at all: E603 `holds no action`, from the rows
        raise idle_rank(path, path, text, *idle, len(rows))
    return "\n".join(rows) + "\n"
