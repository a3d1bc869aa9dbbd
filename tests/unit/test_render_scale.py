"""`plandsl render` at cluster scale (issue 21): Llama 3 70B over 128 H100s (20 stages as 5 chunks of 4
ranks, 256 microbatches) and GPT-3 175B over 1,024 A100s. The schedule is an overview, not a barcode, and
its key names every stage chunk; the placement wraps into bands a page wide, its arrows' figures in the
tables; the mesh is coloured by the axis that tells nodes apart; memory ticks are round; hover titles are
sentences; images are measured (SVG width/height, PNG header) and the report stays small."""
from __future__ import annotations

import re
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest

from plandsl import api
from plandsl.render import render, render_bytes
from plandsl.render.output import graphviz_available, readable_titles
from plandsl.render.schedule import FILLS, chunk_fills
from tests.unit.test_render import LONG_PIPELINE  # 128 blocks over 64 pipeline ranks

ROOT = Path(__file__).resolve().parents[2]
STDLIB = ROOT / "stdlib_plans"
SVG = "{http://www.w3.org/2000/svg}"
needs_graphviz = pytest.mark.skipif(not graphviz_available(), reason="graphviz's dot is not installed")
LLAMA_128 = """\
import "clusters/dgx_h100"
import "models/llama3"
plan llama3_70b_128 {
  model    = llama3_70b
  cluster  = dgx_h100 x 16
  mesh     = [dp = 4, pp = 4, tp = 8]
  train    = { global_batch: 1024, micro_batch: 1, precision: bf16, recompute: full }
  data     = zero1 over dp
  tensor   = megatron over tp with sequence_parallel
  stages   = evenly over pp with virtual = 5, implementation = megatron
  schedule = interleaved_1f1b
}
"""  # Megatron-LM's pipeline, as the layout is its: torch's (`plandsl run`'s) holds a receive buffer per microbatch and
# `replicate`'s copy of the weights (`cost.memory.replicate_copy_bytes`): 78.6 GiB of an H100's 73.6 at 64 microbatches
PAGE_PIXELS = 1600   # a page (or screen) wide; graphviz draws 96 pixels an inch, SVG sizes are in points


@pytest.fixture(scope="module")
def llama():
    return api.loads(LLAMA_128).plans[0]


@pytest.fixture(scope="module")
def gpt3():
    return api.load_plan(STDLIB / "examples/gpt3_175b_3d.plan")


@pytest.fixture(scope="module")
def dots(llama, gpt3):
    return {(name, view): render(plan, view) for name, plan in (("llama", llama), ("gpt3", gpt3))
            for view in ("mesh", "placement", "schedule", "memory")}


def labels(text: str, prefix: str) -> dict[str, str]:
    """Node id -> label, for the nodes whose id starts with `prefix`."""
    return dict(re.findall(rf'^ *({prefix}\w*) \[.*?label="([^"]*)"', text, flags=re.M))


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def svg_pixels(svg: str) -> tuple[float, float]:
    """The SVG's width and height attributes (points) as pixels at 96 an inch."""
    width, height = re.search(r'<svg width="([\d.]+)pt" height="([\d.]+)pt"', svg).groups()
    return float(width) * 4 / 3, float(height) * 4 / 3


# ---- schedule ------------------------------------------------------------------------------------
@pytest.mark.parametrize("chunks", [1, 2, 3, 4, 5, 8, 12])
def test_every_stage_chunk_gets_a_colour_of_its_own(chunks):
    for kind in FILLS:
        fills = chunk_fills(kind, chunks)
        assert len(fills) == chunks and len(set(fills)) == chunks
    every = [fill for kind in FILLS for fill in chunk_fills(kind, chunks)]
    assert len(set(every)) == len(every), "no two kinds share a colour"


def test_the_key_names_every_stage_chunk(dots):
    for name, chunks in (("llama", 5), ("gpt3", 2)):
        text = dots[name, "schedule"]
        for kind in ("F", "B"):
            keys = re.findall(rf'^  key_{kind}(\d+) \[.*fillcolor="(#\w+)"', text, flags=re.M)
            assert [int(chunk) for chunk, _ in keys] == list(range(chunks)), (name, kind)
            assert len({fill for _, fill in keys}) == chunks
            # each block is drawn in its chunk's colour from the key
            used = set(re.findall(rf'^  b\d+_\d+ \[.*fillcolor="(#\w+)".*· {"forward" if kind == "F" else "backward"} ·',
                                  text, flags=re.M))
            assert used and used <= {fill for _, fill in keys}


def test_a_long_schedule_is_an_overview_with_a_zoomed_window(dots):
    text = dots["llama", "schedule"]  # 2,560 actions a rank: block by block it was ten lines of barcode
    blocks = re.findall(r'^  b\d+_\d+ \[pos="[\d.]+,[\d.]+!", width=([\d.]+),(?:.*?label=(\w+))?', text, flags=re.M)
    assert 4 * 20 < len(blocks) < 4 * 60, "one window of about 32 actions a rank"
    numbered = [(float(width) * 72, label) for width, label in blocks if label]
    assert len(numbered) > len(blocks) * 0.8 and all(width >= len(label) * 4.2 for width, label in numbered)
    window = re.search(r'^  window \[pos="([\d.]+),[\d.]+!", width=([\d.]+),.*tooltip="the window drawn below: '
                       r'([\d.]+) s to ([\d.]+) s"', text, flags=re.M)
    centre, width, begin, end = (float(value) for value in window.groups())
    bars = re.search(r'^  urow0 \[pos="([\d.]+),[\d.]+!", width=([\d.]+)', text, flags=re.M)
    left = float(bars.group(1)) - float(bars.group(2)) * 36
    makespan = api.simulate(api.loads(LLAMA_128).plans[0])[1].makespan  # the timeline the renderer draws
    assert 40 < begin < end < 70, "the steady state, in the middle of the step"
    assert centre == pytest.approx(left + float(bars.group(2)) * 72 * (begin + end) / 2 / makespan, abs=2)
    assert width * 72 == pytest.approx(float(bars.group(2)) * 72 * (end - begin) / makespan, abs=2)
    assert len(re.findall(r'^  urow\d+ ', text, flags=re.M)) == 4
    assert "busy 100%" in text
    zbv = render(api.load_plan(STDLIB / "examples/zero_bubble_v.plan"), "schedule")  # a window at 10.4-10.9 s
    for dot in (text, zbv):
        ticks = re.findall(r'^  z-?\d+ \[.*label="([^"]*)"', dot, flags=re.M)
        assert ticks and all(re.fullmatch(r"\d+(\.\d+)? m?s", tick) for tick in ticks), ticks
    short = render(api.load_plan(STDLIB / "local/pp_1f1b.plan"), "schedule")
    assert "window" not in short and "urow" not in short, "a short schedule is still drawn whole"


def test_hover_titles_say_rank_stage_microbatch_and_time(dots):
    tips = re.findall(r'^  b\d+_\d+ \[.*tooltip="([^"]*)"', dots["llama", "schedule"], flags=re.M)
    assert tips
    for tip in tips:
        assert re.fullmatch(r"rank \d · stage \d+ \(chunk \d of 5\) · (forward|backward) · (microbatch \d+|\d+ "
                            r"microbatches \d+-\d+) · [\d.]+ s-[\d.]+ s \([\d.]+ m?s\)", tip), tip


# ---- placement -----------------------------------------------------------------------------------
def test_placement_wraps_its_columns_into_bands(dots):
    text = dots["llama", "placement"]  # 4 ranks x 5 stage chunks: 3 columns, then 2 under them
    assert re.findall(r'subgraph (row\d+_\d+)', text) == [f"row{band}_{rank}" for band in (0, 1) for rank in range(4)]
    assert "rank0_1 [" in text and "rank3_1 [" in text, "each band names its ranks"
    first_band = re.findall(r'subgraph row0_0 \{\n(?:.*\n)*?  \}', text)[0]
    assert re.findall(r'stage(\d+) \[label', first_band) == ["0", "4", "8"]
    gpt3 = dots["gpt3", "placement"]
    assert "row1_0" not in gpt3, "two columns fit one band"


# ---- mesh ----------------------------------------------------------------------------------------
def test_mesh_is_coloured_by_the_axis_that_tells_nodes_apart(dots):
    # gpt3: [dp=16, pp=8, tp=8], 8 devices a node: the drawn nodes 0-7 are pp 0-7 (dp is 0 on all of them)
    assert "colour by pp" in dots["gpt3", "mesh"].splitlines()[0]
    # llama: [dp=4, pp=4, tp=8]: dp and pp each take 4 values over the 16 nodes; the outer one wins
    assert "colour by dp" in dots["llama", "mesh"].splitlines()[0]
    for name in ("gpt3", "llama"):
        fills = re.findall(r'^  n(\d+)_d0 \[.*fillcolor="(#\w+)"', dots[name, "mesh"], flags=re.M)
        assert len({fill for _, fill in fills}) >= 4, f"{name}: the nodes' first devices look alike"


# ---- memory --------------------------------------------------------------------------------------
def test_memory_axis_has_round_ticks(dots):
    for name in ("llama", "gpt3"):
        ticks = [label[:-2] for label in labels(dots[name, "memory"], "ylabel0_").values()]
        assert ticks[0] == "0" and all(t.endswith(" GiB") for t in ticks[1:]), ticks
        values = [0.0] + [float(t.split()[0]) for t in ticks[1:]]
        assert all(value % 20 == 0 for value in values), ticks  # 80 GiB devices: steps of 20 GiB
        assert "86.4" not in dots[name, "memory"]


# ---- images, measured ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reports(llama, gpt3):
    if not graphviz_available():
        pytest.skip("graphviz's dot is not installed")
    return {name: render_bytes(plan, "all", "html").decode("utf-8") for name, plan in (("llama", llama),
                                                                                        ("gpt3", gpt3))}


@needs_graphviz
def test_reports_stay_small_and_every_view_fits_a_screen(reports):
    for name, page in reports.items():
        assert len(page.encode("utf-8")) < 2_000_000, f"{name}: {len(page):,} bytes"
        sizes = {view: svg_pixels(tag) for view, tag in zip(("mesh", "placement", "schedule", "memory"),
                                                           re.findall(r'<svg width="[^>]*>', page))}
        assert len(sizes) == 4
        for view, (width, height) in sizes.items():
            limit = 1920 if view == "mesh" else PAGE_PIXELS  # the mesh: eight node boxes a row
            assert width <= limit and height <= 1400, f"{name} {view}: {width:.0f} x {height:.0f} px"


@needs_graphviz
def test_svg_hover_titles_are_readable(reports):
    for name, page in reports.items():
        titles = re.findall(r"<title>([^<]*)</title>", page)
        assert titles
        ids = [t for t in titles if re.fullmatch(r"[\w]+(&#45;&gt;|-&gt;|--)[\w]+|[a-z]+\d+(_\d+)*", t)]
        assert ids == [], f"{name}: internal ids as titles: {ids[:5]}"
        assert sum("microbatch" in t and "stage" in t and "rank" in t for t in titles) > 100
        chunks = 5 if name == "llama" else 2
        assert len(set(re.findall(r"<title>forward, stage chunk (\d+) of \d+</title>", page))) == chunks


@needs_graphviz
def test_png_of_the_long_schedule_and_wide_placement_fit_a_page(llama):
    for view in ("schedule", "placement"):
        width, height = png_size(render_bytes(llama, view, "png"))
        assert 600 < width <= PAGE_PIXELS and height <= 1400, f"{view}: {width} x {height}"


def test_readable_titles_replace_ids_with_tooltips():
    svg = ('<!-- a -->\n<g id="node1" class="node">\n<title>b0_1</title>\n<g id="a_node1"><a xlink:title="rank 0 · '
           'stage 1">\n<polygon/>\n</a>\n</g>\n</g>\n<!-- t0_0_a&#45;&gt;t0_0_b -->\n<g id="edge1" class="edge">\n'
           '<title>t0_0_a&#45;&gt;t0_0_b</title>\n<path/>\n</g>\n')
    out = readable_titles(svg)
    assert "<title>rank 0 · stage 1</title>" in out and "b0_1" not in out and "t0_0" not in out
    ElementTree.fromstring(f'<svg xmlns="http://www.w3.org/2000/svg" xmlns:xlink="http://www.w3.org/1999/xlink">'
                           f'{out}</svg>')


def test_a_64_rank_overview_draws_16_ranks_of_the_window_and_stays_small():
    text = render(api.loads(LONG_PIPELINE).plans[0], "schedule")
    assert len(re.findall(r'^  urow\d+ ', text, flags=re.M)) == 64, "every rank's utilisation"
    assert sorted(int(r) for r in re.findall(r'^  zrow(\d+) ', text, flags=re.M)) == \
        list(range(12)) + list(range(60, 64))
    assert "ranks 12..59 (48) not drawn" in text and "ranks 12..59 left out" in text
    assert len(text) < 400_000, f"{len(text):,} bytes of DOT"
