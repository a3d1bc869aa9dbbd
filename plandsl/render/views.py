"""The four views (`mesh`, `placement`, `schedule`, `memory`) by name: a view's DOT text and the graphviz
program that lays it out. Each view's module is imported when that view is drawn, not before.
"""
from __future__ import annotations

VIEWS = ("mesh", "placement", "schedule", "memory")


def _module(view: str):
    if view not in VIEWS:
        raise ValueError(f"unknown view '{view}': choose one of {', '.join(VIEWS)} or all")
    from plandsl.render import memory, mesh, placement, schedule  # lazy: `show` (its summary) loads no view
    return {"mesh": mesh, "placement": placement, "schedule": schedule, "memory": memory}[view]


def render(plan, view: str, color_by: str | None = None) -> str:
    """DOT text of one view of a checked plan (`color_by`: the mesh view's colouring axis)."""
    module = _module(view)
    if view == "mesh":
        return module.render_mesh(plan, color_by)
    return getattr(module, f"render_{view}")(plan)


def engine(view: str) -> tuple[str, ...]:
    """The graphviz program (and flags) that lays out the view's DOT text."""
    return _module(view).ENGINE
