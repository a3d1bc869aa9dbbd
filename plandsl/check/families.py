"""Every family of checks on one plan, in order: the mesh, the model, placement, sharding, training, then
the schedule and memory when what they need passed. No hints are confirmed here (`plandsl.check.check_plan`
adds them), so `axis_sizes` can re-check a resized plan with it.
"""
from __future__ import annotations

from plandsl import ir
from plandsl.check.memory import check_memory
from plandsl.check.images import check_images
from plandsl.check.mesh import check_mesh
from plandsl.check.model import check_model
from plandsl.check.placement import check_placement
from plandsl.check.schedule import check_schedule
from plandsl.check.sharding import check_sharding
from plandsl.check.torch_model import check_torch_model
from plandsl.check.training import check_training
from plandsl.diagnostics import Diagnostic


def check_families(plan: ir.Plan) -> list[Diagnostic]:
    """Every problem of `plan`, family by family; the schedule and memory only when the mesh, the
    placement and the training settings passed (one mistake is reported once, not as a cascade)."""
    found: list[Diagnostic] = list(check_mesh(plan))
    mesh_ok = not any(d.is_error for d in found)
    found += check_model(plan)
    found += check_images(plan)
    placement = list(check_placement(plan))
    found += placement
    found += check_sharding(plan)
    found += check_torch_model(plan, placement_ok=not any(d.is_error for d in placement))
    training = list(check_training(plan))
    found += training
    if mesh_ok and not any(d.is_error for d in placement + training):
        found += check_schedule(plan)
        found += check_memory(plan)
    return found
