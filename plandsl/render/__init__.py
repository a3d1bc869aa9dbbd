"""Rendering: meshes, placements, schedules and memory as graphviz DOT, SVG/PNG/PDF and HTML.

Stage: after checking (and simulating, for schedule and memory). Contract: `render(plan, view)`
returns DOT text, deterministic for golden tests and needing no graphviz; `render_bytes` and
`render_file` run graphviz for images (`GraphvizMissing` when it is not installed) and write the
`all` view as one self-contained HTML page. A view that does not apply raises `NotApplicable`; `refusal` turns
each of `RenderError` into its Diagnostic (E811 a view that does not apply, at the plan; E812 graphviz not
installed, E813 graphviz failing), which `plandsl.api.render` raises as a PlanError.
One module per view: `mesh`, `placement`, `schedule`, `memory` (`views` picks one by name); `dot` writes
DOT text, `output` runs graphviz, `html` assembles the report.
"""
from __future__ import annotations

from pathlib import Path

from plandsl.diagnostics import Diagnostic, diag
from plandsl.render.dot import NotApplicable
from plandsl.render.output import (FORMATS, MISSING, GraphvizFailed, GraphvizMissing, format_of, graphviz_hint,
                                   readable_titles, to_image)
from plandsl.render.views import VIEWS, engine, render

RenderError = (NotApplicable, GraphvizMissing, GraphvizFailed)

__all__ = ["VIEWS", "FORMATS", "NotApplicable", "GraphvizMissing", "GraphvizFailed", "RenderError", "render",
           "engine", "refusal", "render_bytes", "render_file", "format_of", "output_format", "color_by_problem"]


def render_bytes(plan, view: str, fmt: str = "dot", color_by: str | None = None,
                 timings: dict | None = None) -> bytes:
    """One view (or `all`, as HTML) in format `fmt`: dot, svg, png, pdf or html."""
    if view == "all" or fmt == "html":
        if view != "all":
            raise ValueError("HTML is the format of --view all (every view on one page)")
        if fmt not in ("html", None):
            raise ValueError(f"--view all writes one HTML page, not {fmt}")
        from plandsl.render.html import render_html  # lazy: the report pulls the estimate; `show` imports this package
        return render_html(plan, color_by, timings=timings).encode("utf-8")
    text = render(plan, view, color_by)
    if fmt == "dot":
        return text.encode("utf-8")
    image = to_image(text, fmt, engine(view), timings)
    return readable_titles(image.decode("utf-8")).encode("utf-8") if fmt == "svg" else image


def refusal(error: Exception, plan) -> Diagnostic:
    """The Diagnostic of one of `RenderError` raised drawing `plan`: E811 (at the plan) for a view that does not
    apply, E812 for graphviz not installed, E813 for graphviz failing (its own first line of error in the message)."""
    if isinstance(error, NotApplicable):
        return diag("E811", str(error), plan.span,
                    hint="--view mesh and --view placement draw any plan; schedule and memory need stages over a "
                         "pipeline axis (--view all draws the views that apply, saying why the others do not)")
    if isinstance(error, GraphvizMissing):
        return diag("E812", MISSING, hint=graphviz_hint())
    return diag("E813", str(error), hint="`--format dot` writes the DOT text plandsl made, without graphviz: run the "
                                         "program named on it to see its whole message; where graphviz refuses the "
                                         "text (not memory or time running out), report it with the plan")


def output_format(output: str | None, fmt: str | None, view: str) -> str | None:
    """`render`'s format: `fmt`, else `output`'s suffix; without -o, HTML for `all` and DOT text for a view;
    None when `output`'s suffix does not tell it."""
    return format_of(output, fmt) or ("html" if view == "all" else None if output else "dot")


def color_by_problem(plan, axis: str | None) -> str | None:
    """Why the mesh view cannot colour devices by `axis` (the plan's mesh has no such axis), or None."""
    if axis and plan.mesh.axis(axis) is None:
        return f"the mesh has no axis '{axis}' (its axes: {', '.join(a.name for a in plan.mesh.axes)})"
    return None


def render_file(plan, view: str, out_path: str | Path, fmt: str | None = None,
                color_by: str | None = None) -> Path:
    """Write the view to `out_path`; the format is `fmt`, else the path's suffix."""
    path = Path(out_path)
    chosen = format_of(str(path), fmt) or ("html" if view == "all" else None)
    if chosen is None:
        raise ValueError(f"cannot tell the format from '{path.name}': use a suffix "
                         f"({', '.join('.' + f for f in FORMATS)}) or give the format")
    path.write_bytes(render_bytes(plan, view, chosen, color_by))
    return path
