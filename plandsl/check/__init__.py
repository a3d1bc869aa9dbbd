"""The checker: a resolved `ir.Plan` -> every problem in it, as diagnostics.

One module per family (`mesh`, `model`, `placement`, `sharding`, `training`, `schedule`, `memory`); each
`check_*` yields diagnostics and never raises. Families that depend on another's result
(memory needs a valid placement) are skipped when that one failed, so a single mistake
is reported once, not as a cascade.
"""
from __future__ import annotations

from plandsl import ir
from plandsl.check.axis_sizes import suggest_axis_size
from plandsl.check.memory import check_memory
from plandsl.check.mesh import check_mesh
from plandsl.check.model import check_model
from plandsl.check.placement import check_placement
from plandsl.check.schedule import check_schedule
from plandsl.check.sharding import check_sharding
from plandsl.check.training import check_training
from plandsl.diagnostics import Diagnostic


def check_plan(plan: ir.Plan, suggest: bool = True) -> list[Diagnostic]:
    """Every problem of `plan`; with `suggest`, hints that offer a new value are confirmed by
    checking the plan with that value (`plandsl.check.axis_sizes`)."""
    found: list[Diagnostic] = list(check_mesh(plan))
    mesh_ok = not any(d.is_error for d in found)
    found += check_model(plan)
    placement = list(check_placement(plan))
    found += placement
    found += check_sharding(plan)
    training = list(check_training(plan))
    found += training
    if mesh_ok and not any(d.is_error for d in placement + training):
        found += check_schedule(plan)
        found += check_memory(plan)
    if suggest:
        found = [suggest_axis_size(plan, d, found) if d.code == "E406" else d for d in found]
    return found
