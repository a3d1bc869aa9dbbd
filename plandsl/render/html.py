"""Plan -> one self-contained HTML page: the estimate first (`plandsl estimate`'s step time, tokens/s,
TFLOP/s per device, MFU, memory per device and bubble, then memory per pipeline rank against capacity
beside the simulated peak), the plan's summary, and every view inlined as <svg>.

Contract: `render_html(plan, color_by=None) -> str`; needs graphviz (`GraphvizMissing` without
it). Views that do not apply are named with the reason instead of a picture. No scripts, no
external files: the page opens from disk in any browser; a wide view fits the page width until
its checkbox is unticked (CSS only).
"""
from __future__ import annotations

import html
import re

from plandsl import ir
from plandsl.render.dot import NotApplicable
from plandsl.lower.units import format_bytes
from plandsl.render.views import VIEWS, engine, render
from plandsl.render.output import readable_titles, to_image
from plandsl.render.summary import describe_plan
from plandsl.ir.placement import pipeline_rank_devices
from plandsl.cost.estimate import estimate_plan
from plandsl.diagnostics import PlanError
from plandsl.schedules.simulate import BUBBLE_DEFINITION
from plandsl.render.schedule import simulated

STYLE = """
body { font-family: Helvetica, Arial, sans-serif; margin: 2em; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 2em; border-bottom: 1px solid #ccc; }
pre { background: #f6f6f6; padding: 1em; overflow-x: auto; font-size: 0.85em; }
table.estimate { border-collapse: collapse; font-size: 0.9em; }
table.estimate th, table.estimate td { border: 1px solid #ccc; padding: 0.3em 0.6em; text-align: right; }
table.estimate th { background: #f0f0f0; } td.over { color: #b00; font-weight: bold; }
table.headline th { text-align: left; } table.headline td { text-align: left; font-weight: bold; }
div.view { overflow: auto; border: 1px solid #ddd; padding: 0.5em; }
input.fit:checked + label + div.view svg { max-width: 100%; height: auto; }
label { font-size: 0.85em; color: #444; }
p.note { color: #666; font-style: italic; }
nav a { margin-right: 1em; }
"""


def render_html(plan: ir.Plan, color_by: str | None = None, timings: dict | None = None) -> str:
    sections = []
    for view in VIEWS:
        try:
            text = render(plan, view, color_by)
        except NotApplicable as reason:
            sections.append((view, f'<p class="note">{html.escape(str(reason))}</p>'))
            continue
        svg = readable_titles(to_image(text, "svg", engine(view), timings).decode("utf-8"))
        # a checkbox, not a script, switches between the whole picture and its real size
        toggle = (f'<input type="checkbox" class="fit" id="fit_{view}" checked>'
                  f'<label for="fit_{view}">fit to the page width (untick for full size)</label>')
        sections.append((view, f'{toggle}\n<div class="view">{inline_svg(svg, view)}</div>'))
    title = f"plandsl: plan {plan.name}"
    parts = ["<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
             f"<title>{html.escape(title)}</title>", f"<style>{STYLE}</style>", "</head>", "<body>",
             f"<h1>{html.escape(title)}</h1>",
             "<nav>" + "".join(f'<a href="#{v}">{v}</a>' for v in ("estimate", "summary", *VIEWS)) + "</nav>",
             '<h2 id="estimate">estimate</h2>', estimate_table(plan),
             '<h2 id="summary">summary</h2>', f"<pre>{html.escape(describe_plan(plan))}</pre>"]
    for view, body in sections:
        parts += [f'<h2 id="{view}">{view}</h2>', body]
    parts += ["</body>", "</html>"]
    return "\n".join(parts) + "\n"


def inline_svg(svg: str, prefix: str) -> str:
    """Graphviz's SVG file as an element of a page: no XML prolog or doctype, ids made unique."""
    start = svg.find("<svg")
    body = svg[start:] if start >= 0 else svg
    body = re.sub(r'\bid="', f'id="{prefix}_', body)
    return re.sub(r'(xlink:href|href)="#', rf'\1="#{prefix}_', body).strip()


def estimate_table(plan: ir.Plan) -> str:
    """The estimate's figures first (`plandsl estimate`: step time, tokens/s, TFLOP/s per device, MFU,
    memory per device, bubble), then per pipeline rank its memory against the smallest device and the
    simulated figures."""
    try:
        estimate = estimate_plan(plan)
    except PlanError:
        return '<p class="note">no estimate: the plan does not check (run `plandsl check`)</p>'
    t = estimate.time
    peak = max(range(len(estimate.memory)), key=lambda r: estimate.memory[r].total, default=None)
    memory = "-" if peak is None else (f"{format_bytes(estimate.memory[peak].total)} of "
                                        f"{format_bytes(estimate.capacity[peak])}"
                                        + (f" (pipeline rank {peak})" if plan.stages else "")
                                        + ("" if estimate.fits else ", DOES NOT FIT"))
    headline = [("step time", f"{t.step:.4g} s"), ("tokens/s", f"{estimate.tokens_per_s:,.0f}"),
                ("TFLOP/s per device", f"{estimate.tflops_per_device:.4g} (executed, with recomputation)"),
                ("MFU", f"{estimate.mfu:.1%}"), ("memory per device (peak)", memory),
                ("bubble", f"{t.bubble:.4g} s, {t.bubble_fraction:.1%} ({BUBBLE_DEFINITION})")]
    parts = ['<table class="estimate headline">' + "".join(
        f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in headline) + "</table>",
        f'<p>{estimate.devices:,} devices, {estimate.microbatches} microbatches per step; step = compute '
        f'{t.compute:.4g} s + exposed communication {t.communication:.4g} s + bubble {t.bubble:.4g} s + '
        f'optimizer {t.optimizer:.4g} s (the busiest pipeline rank).</p>']
    simulation = None
    if plan.stages is not None and plan.schedule is not None:
        _, simulation, _ = simulated(plan)
    buffers = any(m.other for m in estimate.memory)  # torch's pipeline stage's (`cost.memory.torch_stage_bytes`)
    head = ["rank", "devices", "parameters", "gradients", "optimizer", "activations"] + (["pipeline"] if buffers else []) \
        + ["peak", "capacity", "use"]
    if simulation:
        head += ["simulated peak", "busy", "idle"]
    rows = ["<tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>"]
    for rank, (m, devices) in enumerate(zip(estimate.memory, pipeline_rank_devices(plan))):
        capacity = estimate.capacity[rank]
        use = m.total / capacity if capacity else 0.0
        kinds = ", ".join(dict.fromkeys(d.name for d in devices))
        cells = [str(rank) if plan.stages else "all", f"{len(devices):,} × {kinds}", format_bytes(m.params),
                 format_bytes(m.grads), format_bytes(m.optimizer), format_bytes(m.activations)] \
            + ([format_bytes(m.other)] if buffers else []) + [format_bytes(m.total), format_bytes(capacity)]
        row = "".join(f"<td>{html.escape(c)}</td>" for c in cells)
        row += ('<td class="over">' if use > 1 else "<td>") + f"{use:.0%}</td>"
        if simulation and rank < len(simulation.ranks):
            stats = simulation.ranks[rank]
            row += "".join(f"<td>{html.escape(c)}</td>" for c in (
                format_bytes(stats.peak_memory_bytes), f"{stats.busy:.4g} s", f"{stats.idle:.4g} s"))
        rows.append(f"<tr>{row}</tr>")
    parts.append('<table class="estimate">' + "".join(rows) + "</table>")
    parts.append("<p>parameters, gradients, optimizer: fp32 as <code>plandsl run</code> keeps them, ZeRO-sharded, "
                 "with the units ZeRO-2/3 gather; activations: the schedule's in-flight bound or the simulated "
                 "peak, whichever is higher, plus the recomputation working set; "
                 + ("pipeline: torch's pipeline stages' receive buffers and cached outputs; " if buffers else "")
                 + ("peak: their sum less what of them is never alive at once (a step of one microbatch's gradients "
                    "not made yet at its peak, ZeRO-2/3's units placed by moment), as "
                    if any(m.apart or m.moments for m in estimate.memory) else "peak: their sum, as ")
                 + "<code>plandsl estimate</code> prints it."
                 + (" Simulated peak: the states" + (" and the pipeline's buffers" if buffers else "") + " plus the "
                    "activations the simulated order holds at once; busy and "
                    "idle: each rank's compute and waiting in the simulated step." if simulation else "") + "</p>")
    return "\n".join(parts)
