"""Choosing one plan out of a document by name (E201 when absent or ambiguous)."""
from __future__ import annotations

from plandsl import ir
from plandsl.diagnostics import PlanError, did_you_mean, diag


def select_plan(document: ir.Document, name: str | None = None) -> ir.Plan:
    plans = {p.name: p for p in document.plans}
    if name is not None and name in plans:
        return plans[name]
    if name is None and len(plans) == 1:
        return next(iter(plans.values()))
    if name is None:
        message = f"{document.file} defines {len(plans)} plans; name one with --plan" if plans else \
            f"{document.file} defines no plan"
        raise PlanError([diag("E201", message, hint=", ".join(plans) or "add `plan NAME { ... }`")])
    raise PlanError([diag("E201", f"{document.file} has no plan '{name}'",
                          hint=did_you_mean(name, plans, "plans"))])
