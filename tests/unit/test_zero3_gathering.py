"""ZeRO-2/3's gathering: `data = zero3 over dp with unit = module, prefetch = N | prefetch_bucket = N`.

The language (options, their errors, the dump), the cost model's pass over the units as they run
(`cost.stage.unit_pass`, `gather_units`), the memory the prefetched units hold, and the search pricing a
problem's gathering as `estimate` does.
"""
from __future__ import annotations

import textwrap

import pytest

from plandsl import ir
from tests.support import error_codes, lowered_plan

HEADER = 'import "clusters/dgx_a100"\n'
GPT = "gpt(layers=4, hidden=1024, heads=16, seq=1024, vocab=50304)"
# 16 nodes whose NIC is slow: ZeRO-3's gathers, not the GEMMs, decide the step
SLOW = """node slow {
  devices = 8 x a100_80g
  link    = { bandwidth: 300 GB/s, latency: 2 us }
  nic     = { bandwidth: 2 GB/s, latency: 5 us }
}
"""


def plan_text(data: str, model: str = GPT, cluster: str = "dgx_a100 x 1", mesh: str = "[dp = 8]",
              train: str = "{ global_batch: 64, micro_batch: 1 }") -> str:
    return HEADER + SLOW + textwrap.dedent(f"""\
        plan p {{
          model   = {model}
          cluster = {cluster}
          mesh    = {mesh}
          train   = {train}
          data    = {data}
        }}
        """)


def lowered(data: str, **kw) -> ir.Plan:
    return lowered_plan(plan_text(data, **kw))


def codes(data: str, **kw) -> list[str]:
    return error_codes(plan_text(data, **kw))


# ---- the language ----------------------------------------------------------------------------------------
def test_options_lower_and_dump_only_when_given():
    plain = lowered("zero3 over dp")
    assert plain.data.gathering == ir.FSDP_GATHERING and plain.data.gathering.default
    assert set(plain.data.model_dump()) == {"kind", "axes"}  # dumps and hashes as before the options
    deepspeed = lowered("zero3 over dp with unit = module, prefetch_bucket = 5e7")
    assert deepspeed.data.gathering == ir.Gathering(ir.GatherUnit.module, 1, 50_000_000)
    assert deepspeed.data.model_dump()["unit"] == "module" and deepspeed.data.model_dump()["prefetch_bucket"] == 50_000_000
    assert lowered("fsdp over dp with prefetch = 0").data.prefetch == 0
    assert lowered("zero2 over dp with unit = module").data.unit is ir.GatherUnit.module


@pytest.mark.parametrize("data, code", [
    ("zero3 over dp with prefetch = 2, prefetch_bucket = 1000", "E218"),  # two answers to one question
    ("zero1 over dp with unit = module", "E206"),                          # ZeRO-1 reduces no units
    ("zero2 over dp with prefetch = 2", "E206"),                           # ZeRO-2 gathers no parameters
    ("replicate over dp with prefetch_bucket = 10", "E206"),
    ("zero3 over dp with unit = layer", "E210"),                           # block or module
    ("zero3 over dp with prefetch = -1", "E205"),
    ("zero3 over dp with prefetch_bucket = 0", "E205"),
    ("zero3 over dp with prefetch = 1.5", "E211"),
    ("zero3 over dp with prefetch = 5000", "E505"),                        # beyond MAX_PREFETCH
    ("zero3 over dp with unit", "E205"),                                   # a value is needed
    ("zero3 over dp with prefetch = 1, prefetch = 2", "E213"),
])
def test_bad_options_are_errors(data, code):
    assert code in codes(data)


# ---- the pass over the units -----------------------------------------------------------------------------
def test_unit_pass_is_the_closed_form_for_equal_units_one_ahead():
    from plandsl.cost.stage import unit_pass
    for c, g in ((3.0, 1.0), (1.0, 3.0)):
        u = 5
        assert unit_pass([c] * u, [g] * u, [0.0] * u, [1] * u) == pytest.approx(g + (u - 1) * max(c, g) + c)


def test_a_large_unit_after_a_small_one_waits_for_its_gather():
    from plandsl.cost.stage import unit_pass
    # the same compute and traffic in total, in two shapes: equal units hide every gather after the first;
    # a small unit (1 s) before a large gather (4 s) leaves 3 s of it exposed
    equal = unit_pass([2.5, 2.5], [2.5, 2.5], [0.0, 0.0], [1, 1])
    uneven = unit_pass([1.0, 4.0], [1.0, 4.0], [0.0, 0.0], [1, 1])
    assert equal == pytest.approx(2.5 + 2.5 + 2.5)
    assert uneven == pytest.approx(1.0 + 4.0 + 4.0)
    # gathered two ahead, the large gather starts with the first unit's own
    assert unit_pass([1.0, 1.0, 4.0], [1.0, 1.0, 4.0], [0.0] * 3, [2, 2, 2]) == pytest.approx(1 + 5 + 4)
    # nothing ahead: every gather waits, then its compute
    assert unit_pass([1.0, 1.0], [1.0, 1.0], [0.0, 0.0], [0, 0]) == pytest.approx(4.0)
    # a reduce-scatter delays the gathers issued after it on the one communication stream: the first unit's
    # (2 s from t = 2) holds the third gather back to t = 5, and the pass waits for the second unit's (5 to 7;
    # the last unit's runs behind later work); without reduce-scatters the pass takes 4 s
    assert unit_pass([1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [1, 1, 1]) == pytest.approx(4.0)
    assert unit_pass([1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [2.0, 2.0, 2.0], [1, 1, 1]) == pytest.approx(7.0)


def test_bucket_gathers_the_fewest_units_that_reach_it():
    from plandsl.cost.layer import LayerTime
    from plandsl.cost.stage import gather_units
    from plandsl.ir.layers import layers_of
    p = lowered("zero3 over dp with unit = module, prefetch_bucket = 2_000_000")
    layers = [layer for layer in layers_of(p.model) if layer.kind == "block"][:1]
    time = LayerTime(1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0)
    params = [(sum(q.numel for q in layers[0].params), 0)]
    units = gather_units(layers, [time], params, p.data.gathering, 1, 1)
    # a block's modules: norm1, wq, wk, wv, wo, norm2, w1, w2 (1M, 1M, 1M, 1M elements for q, k, v, o)
    assert [round(u.dense) for u in units] == [2048, 1049600, 1049600, 1049600, 1049600, 2048, 4198400, 4195328]
    assert [u.ahead for u in units] == [2, 2, 2, 3, 2, 1, 1, 1]  # wv: wo, norm2 and w1 to reach 2M
    assert sum(u.forward for u in units) == pytest.approx(1.0)  # the block's compute, shared by parameters


def step(data: str, **kw) -> float:
    from plandsl.cost.estimate import estimate_plan
    return estimate_plan(lowered(data, **kw)).time.step


@pytest.mark.parametrize("train", ["{ global_batch: 128, micro_batch: 1 }", "{ global_batch: 512, micro_batch: 4 }"])
def test_the_plan_gathering_changes_its_step(train):
    kw = {"cluster": "slow x 16", "mesh": "[dp = 128]", "train": train}
    blocks = step("zero3 over dp", **kw)
    modules = step("zero3 over dp with unit = module", **kw)
    deepspeed = step("zero3 over dp with unit = module, prefetch_bucket = 50_000_000", **kw)
    none_ahead = step("zero3 over dp with unit = module, prefetch = 0", **kw)
    assert modules != pytest.approx(blocks)  # the pass over the modules, not the equal units' closed form
    assert none_ahead > modules         # every gather waits
    assert deepspeed <= modules + 1e-9  # a bucket gathers at least the one unit ahead
    assert step("zero2 over dp with unit = module", **kw) != step("zero2 over dp", **kw)


def test_prefetched_units_are_held_in_memory():
    from plandsl.cost.memory import gathered_bytes
    from plandsl.ir.layers import layers_of
    p = lowered("zero3 over dp")
    layers = layers_of(p.model)
    fsdp, _ = gathered_bytes(p, layers)
    module, _ = gathered_bytes(lowered("zero3 over dp with unit = module"), layers)
    two_ahead, _ = gathered_bytes(lowered("zero3 over dp with prefetch = 2"), layers)
    assert module < fsdp < two_ahead  # a module and the next, two blocks, three blocks


def test_the_search_prices_a_problem_gathering_as_estimate_does():
    from plandsl.cost.estimate import estimate_plan
    from plandsl.search import Problem, search
    p = lowered("zero3 over dp with unit = module, prefetch_bucket = 3_000_000", cluster="slow x 2",
                mesh="[dp = 16]", train="{ global_batch: 64, micro_batch: 2 }")
    problem = Problem(p.model, p.cluster, 64, gathering=p.data.gathering)
    pins = {"dp": 16, "tp": 1, "pp": 1, "cp": 1, "ep": 1, "zero_stage": 3, "micro_batch_size": 2, "recompute": "none"}
    best = search(problem, pins=pins, top=1).best
    assert best.plan.data.gathering == p.data.gathering
    assert best.estimate.time.step == pytest.approx(estimate_plan(best.plan).time.step)
    plain = search(Problem(p.model, p.cluster, 64), pins=pins, top=1).best
    assert best.estimate.time.step != pytest.approx(plain.estimate.time.step)


def test_diff_lists_the_gathering_options_only_where_written():
    from plandsl.rewrite.diff import changes
    fsdp, zero2 = lowered("zero3 over dp"), lowered("zero2 over dp")
    deepspeed = lowered("zero3 over dp with unit = module, prefetch_bucket = 5e7")
    assert {c.field for c in changes(fsdp, deepspeed)} == {"data.unit", "data.prefetch_bucket"}
    assert {c.field for c in changes(fsdp, zero2)} == {"data.kind"}  # the defaults show as none on both
    assert {c.field for c in changes(fsdp, lowered("zero3 over dp with prefetch = 0"))} == {"data.prefetch"}


def test_show_names_the_gathering_where_written():
    from plandsl.render.summary import describe_plan
    shown = describe_plan(lowered("zero3 over dp with unit = module, prefetch_bucket = 5e7"))
    assert "parallel  zero3 over dp with unit = module, prefetch_bucket = 50000000\n" in shown
    assert "parallel  zero3 over dp\n" in describe_plan(lowered("zero3 over dp"))  # as before the options


def test_shows_a_memory_sum_that_adds_up_where_units_are_placed_by_moment():
    """`show`'s memory line states its parts' sum: with FSDP's units placed by moment (`MemoryEstimate.moments`, less
    in the total) it subtracts them, which its line said nothing of (the parts summed to more than the total)."""
    from plandsl.cost.memory import estimate_plan_memory
    from plandsl.lower.units import format_bytes
    from plandsl.render.summary import describe_plan
    plan = lowered("zero3 over dp")
    estimate = estimate_plan_memory(plan)[0]
    assert estimate.moments
    shown = describe_plan(plan)
    assert "- what of them is never alive at once = total / capacity" in shown
    assert f" + {format_bytes(estimate.activations)} - {format_bytes(estimate.moments)} = " \
           f"{format_bytes(estimate.total)} / " in shown


def test_the_html_page_says_its_peak_is_less_than_the_sum_where_units_are_placed_by_moment():
    from plandsl.render.output import graphviz_available
    if not graphviz_available():
        pytest.skip("graphviz's dot is not installed")
    from plandsl.render.html import render_html
    page = render_html(lowered("zero3 over dp"))
    assert "peak: their sum less what of them is never alive at once" in page
