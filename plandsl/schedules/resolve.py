"""A schedule named on the command line -> the schedule IR (PlanError on problems), and the
schedule IR -> its exported forms (JSON, torch CSV, a table in the language).

A name is a built-in (`1f1b`), a torch CSV file (`order.csv`: one row per rank) or a
schedule written in a plan file (`my.plan:NAME`). Costs are written `F=1,B=2,I=1,W=1,P2P=0.1`.
"""
from __future__ import annotations

import json
from pathlib import Path
import re

from plandsl.diagnostics import PlanError, did_you_mean, diag
from plandsl.diagnostics.source import SourceFile
from plandsl.schedules.program import (CellError, Schedule, derive_stage_map, format_rows, from_csv, line_number,
                                      to_csv)
from plandsl.schedules.simulate import Costs, GridTooLarge, format_grid, step_grid
from plandsl.schedules.generators import TooLarge, generate
from plandsl.schedules.registry import BUILTIN
from plandsl.syntax.files import FileProblem, read_bounded
from plandsl.syntax.parser import MAX_BYTES, decode
from plandsl.schedules.validate import validate

COST_KEYS = {"F": "F", "B": "B", "I": "I", "W": "W", "P2P": "p2p"}


def parse_costs(text: str | None) -> Costs:
    """`F=1,B=2` -> Costs; communication is free unless P2P is given."""
    if not text:
        return Costs()
    values = {}
    for item in text.split(","):
        key, sep, raw = item.partition("=")
        key = key.strip().upper()
        if not sep or key not in COST_KEYS:
            raise PlanError([diag("E206", f"--costs: '{item.strip()}' is not KEY=SECONDS",
                                  hint=f"keys: {', '.join(COST_KEYS)}; e.g. F=1,B=2 or F=1,I=1,W=1,P2P=0.1")])
        try:
            seconds = float(raw)
        except ValueError:
            raise PlanError([diag("E205", f"--costs: '{raw.strip()}' is not a number (in {key}={raw.strip()})")]) \
                from None
        if seconds < 0:
            raise PlanError([diag("E205", f"--costs: {key} = {seconds:g} must not be negative")])
        if not seconds <= MAX_COST_SECONDS:  # nan, inf, 1e308: the makespan and bubbles printed inf and nan
            raise PlanError([diag("E205", f"--costs: {key} = {raw.strip()[:40]} is not a number of seconds from 0 to "
                                          f"{MAX_COST_SECONDS:g}")])
        if COST_KEYS[key] in values:
            raise PlanError([diag("E213", f"--costs: {key} is given twice", hint=f"keep one {key}=SECONDS")])
        values[COST_KEYS[key]] = seconds
    return Costs(**values)


MAX_COST_SECONDS = 1e12
"""An action's seconds in --costs: 30,000 years, and a rank's at most MAX_ACTIONS of them sum far below the largest
float."""


def load_schedule(spec: str, ranks: int | None, microbatches: int | None, virtual: int | None) -> Schedule:
    """A built-in or a `.csv` file, for the given sizes (`file.plan:NAME`: `lower.schedule_spec`)."""
    if spec.endswith(".csv"):
        return schedule_from_csv(read_csv(spec), Path(spec).stem, spec)
    if spec not in BUILTIN:
        raise PlanError([diag("E601", f"unknown schedule '{spec}'", hint=did_you_mean(spec, BUILTIN, "schedules"))])
    if ranks is None or microbatches is None:
        raise PlanError([diag("E207", f"schedule '{spec}' needs --ranks and --microbatches")])
    try:
        return generate(spec, ranks, microbatches, virtual)
    except TooLarge as error:
        raise PlanError([diag("E609", str(error), hint="to print the table, lower --microbatches (or --ranks, --virtual); "
                                                    "`--simulate` gives the figures at this size")]) from None
    except ValueError as error:
        raise PlanError([diag("E502", str(error))]) from None


def read_csv(path: str) -> str:
    """A schedule CSV's text, read bounded like a plan (PlanError: E208 missing, E107 not a regular file,
    E106 too large, E109 unreadable, E105 binary or not UTF-8)."""
    try:
        data = read_bounded(path, MAX_BYTES, "schedule CSV")
    except FileProblem as problem:
        raise PlanError([problem.diagnostic(file=path)]) from None
    source = decode(path, data)
    nul = source.text.find("\x00")
    if nul != -1:
        raise PlanError([diag("E105", f"{path} contains a NUL byte at offset {nul}: it is binary, not a CSV",
                              hint="a schedule CSV is text: one row per rank, actions like 0F1 in its cells")])
    return source.text


def csv_source(path: str, text: str) -> SourceFile:
    """A schedule CSV as the source diagnostics quote, its lines counted as the csv module breaks them (`csv_lines`:
    a lone \\r breaks a line too; it stands for \\n here, the offsets unchanged)."""
    return SourceFile(path, re.sub(r"\r(?!\n)", "\n", text))


def schedule_from_csv(text: str, name: str = "csv", path: str | None = None) -> Schedule:
    """torch's compute-only CSV (rank rows, empty cells idle) -> a validated schedule named `name`; problems name
    the file `path` (default `NAME.csv`; `load_schedule` gives the path it read)."""
    label = path or f"{name}.csv"
    try:
        records = from_csv(text)
    except CellError as error:  # at the cell, in the file read (a text given without a path has no place)
        source = csv_source(path, text) if path else None
        raise PlanError([diag("E602", f"{label}: {error}", source.span(error.start, error.end) if source else None)],
                        {path: source} if source else None) from None
    rows = tuple(tuple(a for a in row if a is not None) for _, _, row in records)
    actions = [a for row in rows for a in row]
    if not actions:
        raise PlanError([diag("E603", f"{label} holds no action")])
    named = sorted({a.stage for a in actions})
    stages = named[-1] + 1
    if len(named) < stages:  # stages no action names: said once, not stage by stage (up to 10^30 of them)
        gaps = [(low + 1, high - 1) for low, high in zip([-1, *named], named) if high - low > 1]
        shown = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in gaps[:5]) + (", ..." if len(gaps) > 5 else "")
        raise PlanError([diag("E603", f"{label} names stage {named[-1]}, so its schedule has {stages:,} stages, "
                                      f"but no action runs stage{'s' if stages - len(named) > 1 else ''} {shown}",
                              hint="a schedule's stages are 0..N-1, each running F and B (or I then W) for every "
                                   "microbatch")])
    idle = next((rank for rank, row in enumerate(rows) if not row), None)
    if idle is not None:
        offset, line, _ = records[idle]
        raise idle_rank(label, path, text, offset, line, idle, len(rows))
    microbatches = max(a.microbatch for a in actions) + 1
    ranks = len(rows)
    schedule = Schedule(name, ranks, stages, microbatches, (derive_stage_map(rows, ranks, stages),), rows)
    problems = validate(schedule)
    if problems:
        raise PlanError(problems)
    return schedule


def idle_rank(label: str, path: str | None, text: str, offset: int, line: str, rank: int, ranks: int) -> PlanError:
    """E603 for the record at `offset` of a torch CSV, rank `rank`'s row of `ranks`, that holds no action: torch's
    loader (`_load_csv`, csv.reader) reads every line as a rank's row, a blank one too, and refuses the CSV, at the
    number of ranks its rows hold (a rank without a compute action: "len(compute_actions[rank])=0"; a lowered CSV:
    an idle cell, or a rank that does nothing) or at the number the others hold ("Schedule has incorrect number of
    ranks")."""
    source = csv_source(path, text) if path else None
    span = source.span(offset, max(offset + len(line), offset + 1)) if source else None
    where = f"{label}: line {line_number(text, offset)}"
    if not line.strip():
        after = ("" if rank == ranks - 1 else f", and the row after it as rank {rank + 1}" if rank == ranks - 2 else
                 f", and the rows after it as ranks {rank + 1}..{ranks - 1}")
        message = (f"{where} is blank, and torch reads every line as a rank's row: this one as rank {rank}, with no "
                   f"action{after} ({ranks} ranks in all); torch refuses a rank without one")
        hint = "remove the line: each line of a schedule CSV is one rank's row"
    else:
        message = f"{where}, rank {rank}'s row, has no compute action (F, B, I, W); torch refuses a rank without one"
        hint = "each rank's row holds its actions, like 0F0,,0B0 (an empty cell an idle step)"
    return PlanError([diag("E603", message, span, hint=hint)], {path: source} if source else None)


def to_json(schedule: Schedule) -> dict:
    return {"name": schedule.name, "ranks": schedule.ranks, "stages": schedule.stages,
            "microbatches": schedule.microbatches, "stage_to_rank": [list(m) for m in schedule.stage_to_rank],
            "microbatch_pipeline": list(schedule.microbatch_pipeline),
            "actions": [[str(a) for a in row] for row in schedule.actions]}


def to_text(schedule: Schedule) -> str:
    return format_grid(step_grid(schedule))


def to_torch_csv(schedule: Schedule) -> str:
    return to_csv(step_grid(schedule))


def to_plan(schedule: Schedule, grid: list | None = None) -> str:
    """The schedule as a table in the language, one column per unit-time step (`_` idle), its header giving its
    sizes: ranks, microbatches and, past one, stages per rank (`virtual`); `grid`: its `step_grid`, when made."""
    grid = step_grid(schedule) if grid is None else grid
    width = max((len(str(a)) for row in grid for a in row if a is not None), default=1)
    # its stages per rank, where a rank holds several: without them the table read back as one stage a rank
    # (`schedule FILE.plan:table_zbv` said "7F0 refers to stage 7, but the schedule has 4 stages")
    virtual = schedule.stages // schedule.ranks
    many = f", virtual = {virtual}" if virtual > 1 and schedule.stages == virtual * schedule.ranks else ""
    lines = [f"schedule {_identifier(schedule.name)}(ranks = {schedule.ranks}, "
             f"microbatches = {schedule.microbatches}{many}) {{"]
    for rank, row in enumerate(grid):
        while row and row[-1] is None:
            row = row[:-1]
        cells = " ".join(("_" if a is None else str(a)).ljust(width) for a in row).rstrip()
        lines.append(f"  rank {rank}: {cells}")
    return "\n".join(lines + ["}", ""])


WRITERS = {"text": to_text, "csv": to_torch_csv, "plan": to_plan,
           "json": lambda schedule: json.dumps(to_json(schedule), indent=1)}
"""`plandsl schedule --format`: text (the step x rank grid), csv (torch's), plan (a table schedule), json."""


def to_format(schedule: Schedule, fmt: str) -> str:
    """The schedule written in one of `WRITERS`' formats, without a trailing newline. PlanError E808 for a table
    (`csv`, `plan`) of a schedule that runs a stage on two ranks (Chimera's two pipelines): a table, torch's as the
    language's, maps each stage to one rank, so what was written was read back as another schedule (torch) or
    refused (`plandsl import --from torch-csv`, a plan naming the table: E607), as `export --to torch-csv` says."""
    if fmt in ("csv", "plan") and len(schedule.stage_to_rank) > 1:
        what = "torch's schedule CSV" if fmt == "csv" else "a table schedule"
        raise PlanError([diag("E808", f"{what} maps each stage to one rank; schedule '{schedule.name}' runs its "
                                      f"stages on {len(schedule.stage_to_rank)} pipelines at once, each stage on "
                                      f"{len(schedule.stage_to_rank)} ranks",
                              hint="--format text or json print it")])
    try:
        return WRITERS[fmt](schedule).rstrip("\n")
    except GridTooLarge as error:  # json lists each rank's actions: no grid
        raise PlanError([diag("E609", str(error), hint="--format json lists each rank's actions; --simulate gives "
                                                       "the figures")]) from None


def _identifier(name: str) -> str:
    """A table's name in a plan: `table_` + the name made an identifier (`1f1b` -> `table_1f1b`,
    `my-order` -> `table_my_order`), so it never shadows the built-in it came from. ASCII only, as the language's
    names: `\\W` kept `é`, and `schedule café.csv --format plan` wrote a table no plan parses."""
    return "table_" + re.sub(r"[^A-Za-z0-9_]", "_", name)


__all__ = ["parse_costs", "load_schedule", "schedule_from_csv", "to_json", "to_text", "to_torch_csv", "to_plan",
           "format_rows"]
