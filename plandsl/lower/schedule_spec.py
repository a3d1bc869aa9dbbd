"""A schedule named on the command line -> the schedule IR (PlanError on problems): a built-in (`1f1b`),
a torch CSV file (`order.csv`: one row per rank; both `schedules.resolve`) or a schedule written in a
plan file (`my.plan:NAME`, lowered and instantiated here)."""
from __future__ import annotations

from plandsl.diagnostics import PlanError, did_you_mean, diag
from plandsl.lower import lower_file
from plandsl.lower.schedule_template import instantiate
from plandsl.schedules import resolve
from plandsl.schedules.program import Schedule


def load_schedule(spec: str, ranks: int | None, microbatches: int | None, virtual: int | None) -> Schedule:
    """A built-in, a `.csv` file or `file.plan:NAME`, for the given sizes."""
    if ".plan:" in spec and not spec.endswith(".csv"):
        return _from_plan(spec, ranks, microbatches, virtual)
    return resolve.load_schedule(spec, ranks, microbatches, virtual)


def _from_plan(spec: str, ranks, microbatches, virtual) -> Schedule:
    path, _, name = spec.rpartition(":")
    lowered = lower_file(path)
    errors = [d for d in lowered.diagnostics if d.is_error]
    if errors or lowered.document is None:
        raise PlanError(errors, lowered.sources)
    definitions = {d.name: d for d in lowered.document.schedules}
    if name not in definitions:
        raise PlanError([diag("E601", f"{path} defines no schedule '{name}'",
                              hint=did_you_mean(name, definitions, "schedules"))])
    definition = definitions[name]
    ranks = ranks or definition.sizes.get("ranks")
    microbatches = microbatches or definition.sizes.get("microbatches")
    if ranks is None or microbatches is None:
        raise PlanError([diag("E207", f"template '{name}' needs --ranks and --microbatches")])
    virtual = virtual or definition.sizes.get("virtual") or 1  # a table's header may say its stages per rank
    schedule, problems = instantiate(definition, definition.scope, ranks, microbatches, virtual)
    if problems:
        raise PlanError(problems, lowered.sources)
    return schedule
