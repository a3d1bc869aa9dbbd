"""`plandsl render`: golden DOT text for every stdlib plan and view, real SVG/PNG through graphviz
(skipped without it), the views that do not apply, a missing graphviz, determinism, large meshes
and schedules within the benchmark budget, the critical path, memory against the simulator."""
from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
import hashlib
import html
from html.parser import HTMLParser
from pathlib import Path

import pytest
from click.testing import CliRunner

from plandsl import api
from plandsl.cli import main
from plandsl.render import VIEWS, GraphvizMissing, NotApplicable, engine, render, render_bytes, render_file
from plandsl.render.output import graphviz_available, to_image
from plandsl.cost.estimate import estimate_plan
from plandsl.lower.units import format_bytes

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden"
STDLIB = ROOT / "stdlib_plans"
FILES = sorted((STDLIB / "examples").glob("*.plan")) + sorted((STDLIB / "local").glob("*.plan"))
PIPELINED = {"gpt3_175b_3d", "heterogeneous", "moe_expert_parallel", "schedule_table", "schedule_template",
             "uneven_pipeline", "zero_bubble_v", "3d", "dp_pp", "pp_1f1b", "pp_custom_schedule",
             "pp_interleaved", "tp_pp", "megatron", "hetero"}
needs_graphviz = pytest.mark.skipif(not graphviz_available(), reason="graphviz's dot is not installed")
SVG = "{http://www.w3.org/2000/svg}"

BIG_MESH = """\
import "clusters/dgx_h100"
model big = gpt(layers=64, hidden=4096, heads=32, seq=2048, vocab=50304)
plan big_mesh {
  model    = big
  cluster  = dgx_h100 x 512
  mesh     = [dp = 64, pp = 8, tp = 8]
  train    = { global_batch: 512, micro_batch: 1, precision: bf16, recompute: full }
  data     = zero1 over dp
  tensor   = megatron over tp with sequence_parallel
  stages   = evenly over pp
  schedule = 1f1b
}
"""
LONG_PIPELINE = """\
import "clusters/dgx_h100"
model deep = gpt(layers=128, hidden=2048, heads=16, seq=1024, vocab=50304)
plan long_pipeline {
  model    = deep
  cluster  = dgx_h100 x 8
  mesh     = [pp = 64]
  train    = { global_batch: 256, micro_batch: 1, precision: bf16, recompute: full }
  stages   = evenly over pp
  schedule = 1f1b
}
"""


def _id(path: Path) -> str:
    return f"{path.parent.name}/{path.stem}"


def _cases():
    for path in FILES:
        for view in VIEWS:
            yield pytest.param(path, view, id=f"{_id(path)}-{view}")


@functools.cache  # a plan per file, for its views' tests (plans are frozen)
def _load(path: Path):
    return api.load_plan(path)


def _applies(path: Path, view: str) -> bool:
    return view in ("mesh", "placement") or path.stem in PIPELINED


def node_ids(dot_text: str) -> set[str]:
    """Ids of the visible nodes a DOT text of ours declares (statements `id [..]`, not edges, not
    `style=invis`: graphviz leaves invisible nodes out of SVG)."""
    ids, hidden = set(), set()
    for line in dot_text.splitlines():
        match = re.match(r'\s*("(?:[^"\\]|\\.)*"|[A-Za-z_][A-Za-z0-9_]*)\s*(\[|$)', line)
        if match and match.group(1) not in ("graph", "node", "edge") and "->" not in line:
            (hidden if "style=invis" in line else ids).add(match.group(1).strip('"'))
    return ids - hidden


# ---- golden DOT text --------------------------------------------------------------------------
@pytest.mark.parametrize("path, view", list(_cases()))
def test_golden_dot(path, view, golden):
    plan = _load(path)
    if not _applies(path, view):
        with pytest.raises(NotApplicable, match="no pipeline in this plan"):
            render(plan, view)
        return
    golden(f"render/{plan.name}/{view}.dot", render(plan, view))


def test_every_stdlib_example_and_local_plan_is_covered():
    assert {p.stem for p in FILES} >= PIPELINED
    assert len(FILES) >= 24  # the glob found the stdlib (plans get added; each gets its goldens)


# ---- real rendering ---------------------------------------------------------------------------
@needs_graphviz
@pytest.mark.parametrize("view", VIEWS)
def test_svg_renders_and_parses_back(view):
    """Every example's DOT text of the view (the golden file: what render() gives, test_golden_dot) through
    graphviz with the view's engine, as render_bytes runs it (`to_image`), and every visible node drawn. All
    the examples' graphs go through one graphviz process, which lays out each graph of its input in turn and
    writes one SVG document per graph: a process per example cost ~65 ms of CPU each (82 of them); the
    render_bytes path itself, per view, is test_png_renders."""
    paths = [path for path in FILES if _applies(path, view)]
    texts = [(GOLDEN / f"render/{_load(path).name}/{view}.dot").read_text(encoding="utf-8") for path in paths]
    svg = to_image("".join(texts), "svg", engine(view)).decode("utf-8")
    documents = ["<?xml" + part for part in svg.split("<?xml")[1:]]
    assert len(documents) == len(paths), f"{len(paths)} graphs in, {len(documents)} SVG documents out"
    problems = {}
    for path, text, document in zip(paths, texts, documents):
        root = ElementTree.fromstring(document.encode("utf-8"))
        assert root.tag == f"{SVG}svg", _id(path)
        drawn = [g for g in root.iter(f"{SVG}g") if g.get("class") == "node"]
        titles = {g.find(f"{SVG}title").text for g in drawn}
        if len(drawn) != len(node_ids(text)) or titles != node_ids(text):
            problems[_id(path)] = (f"{len(drawn)} drawn of {len(node_ids(text))}: missing "
                                   f"{sorted(node_ids(text) - titles)[:5]}, extra {sorted(titles - node_ids(text))[:5]}")
    assert problems == {}


PNG_CASES = [("examples/gpt3_175b_3d", v) for v in VIEWS] + [("examples/heterogeneous", "mesh"),
                                                             ("examples/zero_bubble_v", "placement"),
                                                             ("local/dp", "mesh"), ("examples/shard_rules", "placement")]


@needs_graphviz
@pytest.mark.parametrize("name, view", PNG_CASES, ids=[f"{n}-{v}" for n, v in PNG_CASES])
def test_png_renders(name, view, tmp_path):
    plan = api.load_plan(STDLIB / f"{name}.plan")
    path = render_file(plan, view, tmp_path / f"{view}.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert 200 < width < 20000 and 100 < height < 20000


@needs_graphviz
def test_pdf_renders(tmp_path):
    plan = api.load_plan(STDLIB / "local/3d.plan")
    assert render_file(plan, "placement", tmp_path / "p.pdf").read_bytes().startswith(b"%PDF")


VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}
LOADING = {"src", "href", "xlink:href", "action", "data", "poster", "srcset", "background"}


class _Page(HTMLParser):
    """The page's tags, ids, links and problems: tags closed out of order, and anything that would
    load from outside the page (a non-fragment link, a script, a stylesheet link, a CSS url)."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.tags: list[str] = []
        self.ids: list[str] = []
        self.fragments: list[str] = []
        self.problems: list[str] = []
        self.stack: list[str] = []
        self.section = ""
        self.svgs: dict[str, int] = {}
        self.in_style = False

    def handle_starttag(self, tag, attrs):
        self._start(tag, attrs)
        if tag not in VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):  # <path ... />, as SVG writes it
        self._start(tag, attrs)

    def _start(self, tag, attrs):
        self.tags.append(tag)
        values = dict(attrs)
        self.ids += [value for key, value in attrs if key == "id"]
        if tag == "h2":
            self.section = values.get("id", "")
        if tag == "svg":
            self.svgs[self.section] = self.svgs.get(self.section, 0) + 1
        if tag in ("script", "link", "iframe", "object", "img", "base"):
            self.problems.append(f"<{tag}> in a self-contained page")
        self.in_style = tag == "style"
        for key, value in attrs:
            if key in LOADING and value is not None:
                if value.startswith("#"):
                    self.fragments.append(value[1:])
                else:
                    self.problems.append(f"<{tag} {key}={value!r}> loads from outside the page")
            if key == "style" and value and "url(" in value and "url(#" not in value:
                self.problems.append(f"<{tag} style={value!r}> loads from outside the page")

    def handle_endtag(self, tag):
        self.in_style = False
        if tag in VOID:
            return
        if not self.stack or self.stack[-1] != tag:
            self.problems.append(f"</{tag}> closes <{self.stack[-1] if self.stack else 'nothing'}>")
            if tag in self.stack:
                del self.stack[len(self.stack) - 1 - self.stack[::-1].index(tag):]
            return
        self.stack.pop()

    def handle_data(self, data):
        if self.in_style and ("url(" in data or "@import" in data):
            self.problems.append("the stylesheet loads from outside the page")


@needs_graphviz
@pytest.mark.parametrize("name, global_batch", [
    ("examples/heterogeneous", None),
    # ZB-V's V-shaped placement and split backward with 16 microbatches (2 x pp, as the example's own
    # 256 would be) in the fast tier; its 256 (a 4 MB page, ~3 CPU-s to render and parse) in the slow one.
    ("examples/zero_bubble_v", 32),
    pytest.param("examples/zero_bubble_v", None, marks=pytest.mark.slow),
])
def test_html_report_is_well_formed_and_self_contained(name, global_batch, tmp_path):
    text = (STDLIB / f"{name}.plan").read_text(encoding="utf-8")
    if global_batch is not None:
        assert "global_batch: 512," in text
        text = text.replace("global_batch: 512,", f"global_batch: {global_batch},")
    plan = api.loads(text, path=str(STDLIB / f"{name}.plan")).plans[0]
    page = render_file(plan, "all", tmp_path / "report.html").read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>")
    parser = _Page()
    parser.feed(page)
    parser.close()
    assert parser.problems == []
    assert parser.stack == [], f"left open: {parser.stack}"
    assert parser.svgs == {view: 1 for view in VIEWS}, "each view inlined once, as <svg>, in its own section"
    assert len(parser.ids) == len(set(parser.ids)), "ids of the inlined SVGs must not clash"
    assert set(parser.fragments) <= set(parser.ids), "every #link points into the page"
    assert "<?xml" not in page and "<!DOCTYPE svg" not in page
    assert 'class="estimate"' in page and "simulated peak" in page
    assert re.findall(r'\bid="(summary|estimate|mesh|placement|schedule|memory)"', page) == \
        ["estimate", "summary", *VIEWS]  # the estimate's figures lead
    for block in re.findall(r"<svg.*?</svg>", page, flags=re.S):
        ElementTree.fromstring(block)
    outside = re.findall(r'(?<!xmlns)(?<!xmlns:xlink)="(?:https?:|file:|//)[^"]*"', page)
    assert outside == [], "only namespace names may be URLs"


@pytest.mark.parametrize("name", ["examples/gpt3_175b_3d", "examples/fsdp"])
def test_html_report_leads_with_the_estimates_figures(name):
    """Step time, tokens/s, TFLOP/s per device, MFU, memory per device and the bubble, as `plandsl estimate`
    computes them, in that order, before the per-rank table."""
    from plandsl.cost.estimate import estimate_plan
    from plandsl.render.html import estimate_table
    plan = api.load_plan(STDLIB / f"{name}.plan")
    estimate = estimate_plan(plan)
    section = estimate_table(plan)
    headline = re.findall(r"<tr><th>([^<]*)</th><td>([^<]*)</td></tr>", section)
    assert [k for k, _ in headline] == ["step time", "tokens/s", "TFLOP/s per device", "MFU",
                                       "memory per device (peak)", "bubble"]
    values = dict(headline)
    assert values["step time"] == f"{estimate.time.step:.4g} s"
    assert values["tokens/s"] == f"{estimate.tokens_per_s:,.0f}"
    assert values["TFLOP/s per device"].startswith(f"{estimate.tflops_per_device:.4g} ")
    assert values["MFU"] == f"{estimate.mfu:.1%}"
    assert values["memory per device (peak)"].startswith(format_bytes(estimate.peak_memory_bytes))
    assert "idle time of the busiest rank / makespan" in html.unescape(values["bubble"])
    assert section.index("step time") < section.index("<th>rank</th>")


BROWSERS = ("chromium", "chromium-headless-shell", "google-chrome", "chrome")
BROWSER = next((found for found in map(shutil.which, BROWSERS) if found), None)
PROBE = """<script>
const views = [...document.querySelectorAll("h2")].map(h => {
  let el = h.nextElementSibling, svg = null;
  while (el && el.tagName !== "H2" && !svg) {
    svg = el.matches("svg") ? el : el.querySelector("svg");
    el = el.nextElementSibling;
  }
  const box = svg ? svg.getBoundingClientRect() : {width: 0, height: 0};
  return [h.id, Math.round(box.width), Math.round(box.height)];
});
console.log("probe " + JSON.stringify({views, resources: performance.getEntriesByType("resource").length,
                                       overflow: document.documentElement.scrollWidth - window.innerWidth}));
</script>"""


def _console(page: Path) -> list[str]:
    """What headless chromium's console said while loading `page`."""
    result = subprocess.run([BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--window-size=1280,2000",
                             "--enable-logging=stderr", "--v=0", "--dump-dom", page.as_uri()],
                            capture_output=True, text=True, timeout=90, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "</html>" in result.stdout, "the browser did not load the page"
    return re.findall(r':CONSOLE[^\]]*\] "(.*)", source: ', result.stderr)


@needs_graphviz
@pytest.mark.skipif(BROWSER is None, reason="no headless chromium on this machine (apt-get install chromium-headless-shell)")
def test_html_report_opens_in_chromium_without_console_errors(tmp_path):
    plan = api.load_plan(STDLIB / "examples/gpt3_175b_3d.plan")
    page = render_file(plan, "all", tmp_path / "report.html")
    probed = tmp_path / "probed.html"  # the page and, at its end, the probe: one browser start, not two
    probed.write_text(page.read_text(encoding="utf-8").replace("</body>", PROBE + "\n</body>"), encoding="utf-8")
    said = _console(probed)
    assert [line for line in said if not line.startswith("probe ")] == [], "the page logged errors"
    assert len(said) == 1 and said[0].startswith("probe "), said
    report = json.loads(said[0][len("probe "):].replace('\\"', '"'))
    sizes = {view: (width, height) for view, width, height in report["views"]}
    for view in VIEWS:  # drawn, and fitted to the 1280-pixel window
        width, height = sizes[view]
        assert 100 < width <= 1280 and height > 50, (view, sizes[view])
    assert report["resources"] == 0, "the page loaded something from outside"
    assert report["overflow"] <= 0, "a view is wider than the page"


@needs_graphviz
def test_html_report_names_the_views_that_do_not_apply(tmp_path):
    plan = api.load_plan(STDLIB / "examples/data_parallel.plan")
    page = render_bytes(plan, "all", "html").decode("utf-8")
    assert page.count("<svg") == 2
    assert page.count("no pipeline in this plan") == 2


# ---- views that do not apply, graphviz missing ------------------------------------------------
def test_no_pipeline_is_e811_at_the_plan_and_exit_1():
    """An uncoded `FILE: error: ...` line before: E811 at the plan, the views that do apply as the hint."""
    path = STDLIB / "examples/data_parallel.plan"
    for view in ("schedule", "memory"):
        result = CliRunner().invoke(main, ["render", str(path), "--view", view])
        assert result.exit_code == 1
        first = result.output.splitlines()[0]
        assert re.match(r"\S*data_parallel\.plan:\d+:1: error\[E811\]: no pipeline in this plan", first), first
        assert "^" in result.output and "= hint: --view mesh and --view placement draw any plan" in result.output
    with pytest.raises(api.PlanError) as error:
        api.render(api.load_plan(path), "schedule")
    assert [d.code for d in error.value.diagnostics] == ["E811"]


def test_memory_view_without_pipeline_says_so():
    with pytest.raises(NotApplicable, match="no pipeline in this plan"):
        render(api.load_plan(STDLIB / "local/tp_sp.plan"), "memory")


@pytest.fixture
def no_graphviz(tmp_path, monkeypatch):
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))


def test_missing_graphviz_says_how_to_install(no_graphviz):
    plan = api.load_plan(STDLIB / "local/3d.plan")
    with pytest.raises(GraphvizMissing) as error:
        render_bytes(plan, "mesh", "svg")
    assert "apt-get install graphviz" in str(error.value) and "brew install graphviz" in str(error.value)
    result = CliRunner().invoke(main, ["render", str(STDLIB / "local/3d.plan"), "--view", "mesh", "--format", "png"])
    assert result.exit_code == 1  # as before; an uncoded `FILE: error: ...` line before, E812 now
    assert result.output.startswith("error[E812]: graphviz's `dot` is not installed\n"), result.output
    assert "= hint: apt-get install graphviz (Debian/Ubuntu) or brew install graphviz; `--format dot`" in result.output


def test_graphviz_failing_is_e813_with_its_message(tmp_path, monkeypatch):
    """An uncoded `FILE: error: ...` line before: E813, graphviz's first line of error in the message."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for program in ("dot", "neato"):
        (bin_dir / program).write_text("#!/bin/sh\necho 'Error: out of memory' >&2\nexit 3\n")
        (bin_dir / program).chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    result = CliRunner().invoke(main, ["render", str(STDLIB / "local/3d.plan"), "--view", "mesh", "--format", "svg"])
    assert result.exit_code == 1
    assert re.match(r"error\[E813\]: (dot|neato) failed \(exit 3\): Error: out of memory\n", result.output), \
        result.output
    assert "= hint: `--format dot` writes the DOT text plandsl made" in result.output


def test_dot_text_needs_no_graphviz(no_graphviz, tmp_path):
    out = tmp_path / "mesh.dot"
    result = CliRunner().invoke(main, ["render", str(STDLIB / "local/3d.plan"), "--view", "mesh", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert out.read_text(encoding="utf-8").startswith("// plandsl render --view mesh")


# ---- the command ------------------------------------------------------------------------------
def test_dot_goes_to_stdout_without_output():
    result = CliRunner().invoke(main, ["render", str(STDLIB / "local/pp_1f1b.plan"), "--view", "schedule"])
    assert result.exit_code == 0, result.output
    assert result.output == render(api.load_plan(STDLIB / "local/pp_1f1b.plan"), "schedule")


@needs_graphviz
def test_format_comes_from_the_suffix(tmp_path):
    out = tmp_path / "mesh.svg"
    result = CliRunner().invoke(main, ["render", str(STDLIB / "local/3d.plan"), "--view", "mesh", "-o", str(out),
                                       "--color-by", "dp"])
    assert result.exit_code == 0, result.output
    assert ElementTree.fromstring(out.read_bytes()).tag == f"{SVG}svg"


@pytest.mark.parametrize("args", [
    ["--view", "mesh", "-o", "x.txt"],             # unknown suffix
    ["--view", "mesh", "--format", "html"],        # html is the format of --view all
    ["--view", "all", "--format", "svg"],
    ["--view", "mesh", "--color-by", "nope"],      # no such axis
])
def test_usage_errors_exit_2(args, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["render", str(STDLIB / "local/3d.plan"), *args])
    assert result.exit_code == 2, result.output


def test_color_by_changes_the_fills():
    plan = api.load_plan(STDLIB / "local/3d.plan")
    assert render(plan, "mesh", "dp") != render(plan, "mesh", "tp")
    assert "colour by dp" in render(plan, "mesh", "dp").splitlines()[0]


# ---- determinism ------------------------------------------------------------------------------
@pytest.mark.parametrize("view", VIEWS)
def test_render_is_deterministic(view):
    plan = api.load_plan(STDLIB / "examples/gpt3_175b_3d.plan")
    assert render(plan, view) == render(plan, view)


def test_render_is_the_same_in_another_process():
    """Across interpreters with other hash seeds (set and dict orders must not leak into DOT)."""
    code = ("import sys, hashlib; from plandsl import api; from plandsl.render import render, VIEWS; "
            "p = api.load_plan(sys.argv[1]); "
            "print(hashlib.sha256(''.join(render(p, v) for v in VIEWS).encode()).hexdigest())")
    path = str(STDLIB / "examples/heterogeneous.plan")
    here = hashlib.sha256("".join(render(api.load_plan(path), v) for v in VIEWS).encode()).hexdigest() + "\n"
    seed = "2" if os.environ.get("PYTHONHASHSEED") == "1" else "1"  # not this process's (random, unless set)
    there = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout
    assert there == here


# ---- scale ------------------------------------------------------------------------------------
def test_a_4096_device_mesh_is_summarised_fast():
    plan = api.loads(BIG_MESH).plans[0]
    assert plan.mesh.size == 4096
    start = time.process_time()  # this process's CPU time: other work on the machine does not count
    text = render(plan, "mesh")
    assert time.process_time() - start < 2.0
    assert "4,096 devices: showing 9 nodes; 503 identical nodes collapsed (nodes 8..510)" in text
    assert len(node_ids(text)) < 200


def test_a_64_rank_256_microbatch_schedule_fast():
    plan = api.loads(LONG_PIPELINE).plans[0]
    start = time.process_time()  # CPU time, not wall time: a loaded machine must not fail the test
    text = render(plan, "schedule")
    assert time.process_time() - start < 4.0  # simulation included; bench/bench_render.py times DOT alone
    assert "64 ranks, 64 stages, 256 microbatches" in text


@needs_graphviz
def test_the_4096_device_mesh_really_renders():
    plan = api.loads(BIG_MESH).plans[0]
    svg = render_bytes(plan, "mesh", "svg")
    assert len([g for g in ElementTree.fromstring(svg).iter(f"{SVG}g") if g.get("class") == "node"]) == \
        len(node_ids(render(plan, "mesh")))


# ---- what the pictures say -------------------------------------------------------------------
def test_critical_path_runs_from_start_to_makespan():
    from plandsl.render.schedule import critical_path, simulated
    for name in ("examples/schedule_table", "examples/zero_bubble_v", "local/pp_interleaved"):
        schedule, simulation, p2p = simulated(api.load_plan(STDLIB / f"{name}.plan"))
        path = critical_path(schedule, simulation, p2p)
        events = [simulation.events[i] for i in path]
        assert events[0].start == 0
        assert events[-1].end == pytest.approx(simulation.makespan)
        for before, after in zip(events, events[1:]):
            delay = p2p if before.rank != after.rank else 0.0
            assert after.start == pytest.approx(before.end + delay, abs=1e-9 * simulation.makespan)


def test_critical_path_of_unit_1f1b():
    """1F1B, 2 ranks, 2 microbatches, F = B = 1: 0F0 1F0 1B0 1F1 1B1 0B1 (the bottleneck runs on rank 1)."""
    from plandsl.render.schedule import critical_path
    from plandsl.schedules.generators import generate
    from plandsl.schedules.simulate import Costs, simulate
    schedule = generate("1f1b", 2, 2, None)
    simulation = simulate(schedule, Costs(F=1.0, B=1.0))
    path = [str(simulation.events[i].action) for i in critical_path(schedule, simulation)]
    assert path == ["0F0", "1F0", "1B0", "1F1", "1B1", "0B1"]


@pytest.mark.parametrize("name", ["examples/gpt3_175b_3d", "examples/zero_bubble_v", "examples/heterogeneous",
                                  "local/3d"])
def test_memory_peaks_are_the_simulators(name):
    from plandsl.render.memory import memory_over_time
    plan = api.load_plan(STDLIB / f"{name}.plan")
    ranks, simulation = memory_over_time(plan)
    estimate = estimate_plan(plan)
    for memory in ranks:
        # torch's pipeline stage's buffers, as `estimate` counts them, which the simulator's peak holds too
        assert memory.pipeline == estimate.memory[memory.rank].other > 0
        assert memory.peak == pytest.approx(simulation.ranks[memory.rank].peak_memory_bytes, rel=1e-9)
        assert memory.steps[0] == (0.0, 0.0) and memory.steps[-1][1] == pytest.approx(0.0, abs=1e-6 * memory.peak)


def test_megatrons_pipeline_draws_no_pipeline_band():
    """Megatron-LM's pipeline holds none of torch's stage buffers (`estimate` counts none): no band, no key."""
    from plandsl.render.memory import memory_over_time
    plan = api.load_plan(STDLIB / "local/pp_1f1b.plan")
    plan = plan.model_copy(update={"stages": plan.stages.model_copy(update={"implementation": "megatron"})})
    ranks, simulation = memory_over_time(plan)
    assert [memory.pipeline for memory in ranks] == [0.0] * len(ranks)
    assert [memory.peak for memory in ranks] == pytest.approx([r.peak_memory_bytes for r in simulation.ranks])
    text = render(plan, "memory")
    assert 'label="pipeline' not in text and "pipeline0 [" not in text
    assert 'label="pipeline' in render(api.load_plan(STDLIB / "local/pp_1f1b.plan"), "memory")


def test_placement_shows_sharding_and_maps():
    shard = render(api.load_plan(STDLIB / "examples/shard_rules.plan"), "placement")
    assert "Shard(0)@tp, Shard(1)@dp: head" in shard               # the 2-D rule
    assert "layers.0" in shard and "layers[1:4]" in shard          # the exact rule splits the range
    vshape = render(api.load_plan(STDLIB / "examples/zero_bubble_v.plan"), "placement")
    assert "stage 15</b> · rank 0" in vshape and "same rank: no transfer" in vshape
    interleaved = render(api.load_plan(STDLIB / "local/pp_interleaved.plan"), "placement")
    assert "stage 2</b> · rank 0" in interleaved


def test_mesh_distinguishes_device_types():
    text = render(api.load_plan(STDLIB / "examples/heterogeneous.plan"), "mesh")
    assert "a100_80g" in text and "h100_80g" in text
    assert 'style="filled,diagonals"' in text and 'style="rounded,filled"' in text


def test_engines():
    assert engine("placement") == ("dot",)
    assert engine("schedule") == engine("memory") == engine("mesh") == ("neato", "-n2")


def test_groups_across_distant_nodes_are_one_arc_per_pair_of_nodes():
    # pp groups of the mixed cluster pair node i with node i + 4: per-device lines would cross
    # three node boxes each (32 of them); one labelled arc per pair of nodes does not
    text = render(api.load_plan(STDLIB / "examples/heterogeneous.plan"), "mesh", "pp")
    labels = re.findall(r'^  bundle(\d+)_(\d+) \[.*label="([^"]*)"', text, flags=re.M)
    assert [(int(a), int(b)) for a, b, _ in labels] == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert {label for _, _, label in labels} == {"8 'pp' links, 200 GB/s"}
    assert not re.search(r'^  n[0-3]_d\d+ -> n[4-7]_d\d+', text, flags=re.M)
    tops = [float(y) for y in re.findall(r'^  bundle\d+_\d+ \[pos="[-\d.]+,([-\d.]+)!"', text, flags=re.M)]
    assert len(set(tops)) == 4, "overlapping arcs get heights of their own"


def test_groups_across_collapsed_nodes_and_rows_say_what_they_skip():
    text = render(api.loads(BIG_MESH).plans[0], "mesh", "dp")
    assert re.findall(r'^  bundle(\d+_\d+) \[.*label="([^"]*)"', text, flags=re.M) == \
        [("7_9", "8 'dp' links, 400 GB/s, via 62 hidden each")]
    assert 'tooltip="\'dp\' links between these nodes: d56-d4088, d57-d4089' in text


def test_many_coordinates_get_colours_that_neighbours_do_not_share():
    from plandsl.render.dot import categorical
    for count in (11, 16, 64):
        fills = categorical(count)
        assert len(set(fills)) == count
        rgb = [tuple(int(f[i:i + 2], 16) for i in (1, 3, 5)) for f in fills]
        close = [i for i in range(count) if sum(abs(a - b) for a, b in zip(rgb[i], rgb[(i + 1) % count])) < 60]
        assert close == [], f"coordinates {close} look like the next one (and the last like the first)"
        assert all(sum(channel) / 3 > 150 for channel in rgb), "black text stays readable"


def test_memory_grid_lines_stay_off_the_bands():
    # a grid line through the bands would strike out their labels ("parameters 5.3 GiB")
    text = render(api.load_plan(STDLIB / "examples/gpt3_175b_3d.plan"), "memory")
    band_tops = {rank: float(y) + float(height) * 36 for rank, y, height in re.findall(
        r'^  optimizer(\d+) \[pos="[\d.]+,([\d.]+)!", width=[\d.]+, height=([\d.]+)', text, flags=re.M)}
    bottoms = re.findall(r'^  grid(\d+)_\d+_a \[pos="[\d.]+,([\d.]+)!"', text, flags=re.M)
    assert len(band_tops) == 8 and len(bottoms) > 8 * 4
    for rank, bottom in bottoms:  # the top band ends where the grid begins (positions to 0.1 pt)
        assert float(bottom) >= band_tops[rank] - 0.2


def test_placement_labels_stay_with_their_arrows():
    # what crosses a boundary is the last row of the sending stage's table, where its arrow leaves: an
    # edge label drifted away from its arrow in `dot`'s layout (issue 21)
    text = render(api.load_plan(STDLIB / "local/pp_interleaved.plan"), "placement")
    edges = [edge for edge in re.findall(r'^  stage(\d+) -> stage(\d+) \[(.*)\]$', text, flags=re.M)
             if "style=invis" not in edge[2]]
    assert [(int(a), int(b)) for a, b, _ in edges] == [(0, 1), (1, 2), (2, 3)]
    for tail, head, attrs in edges:
        assert "label=" not in attrs and f'tooltip="stage {tail} -> stage {head}: ' in attrs
        table = re.search(rf'^ +stage{tail} \[label=<(.*)>, tooltip', text, flags=re.M).group(1)
        assert re.search(rf"&#8594; to stage {head} \(rank \d\)[^<]*<br align='left'/>[^<]*microbatch", table)
