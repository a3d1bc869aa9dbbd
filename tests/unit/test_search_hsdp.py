"""The search proposes hybrid-sharded data parallelism (`data = hsdp over [dp_rep, dp]`: ZeRO-3 within a shard axis,
replicas across, MiCS and FSDP's HYBRID_SHARD) where it is the fastest plan: against brute force, its emitted plan
checks and estimates to the search's figures, its pins, and `generate --from` keeps a written hsdp."""
import json
import re

import pytest
from click.testing import CliRunner

from plandsl import api
from plandsl.cli import main
from plandsl.cost.estimate import estimate_plan
from plandsl.search import Problem, SearchError, brute_force, search
from plandsl.search.emit import Source, plan_text
from plandsl.search.partial import read_partial

# Four nodes of eight on a slow fabric (100 GB/s a node, 12.5 GB/s: a p4d's EFA shared by its eight GPUs), a model
# whose states fit ZeRO-2 over every data rank only with offloading: ZeRO-3 over all 32 gathers across the fabric,
# hsdp over 16 (two nodes) gathers half the ring there and reduces 1/16 of the gradients over two replicas.
HARDWARE = """
device gpu { memory = 16 GiB; bandwidth = 1000 GB/s; peak = { bf16: 200 TFLOP/s, fp32: 20 TFLOP/s } }
node octo { devices = 8 x gpu; link = { bandwidth: 100 GB/s, latency: 2 us }; nic = { bandwidth: 12.5 GB/s, latency: 10 us } }
cluster slow = octo x 4
"""
MODEL = "gpt(layers=16, hidden=4096, heads=32, seq=1024, vocab=32000)"
DATA_ONLY = {"tp": 1, "pp": 1, "cp": 1}


def problem(batch: int = 256) -> Problem:
    document = api.loads(HARDWARE + f"model m = {MODEL}\n")
    return Problem(document.models[0], document.clusters[0], batch)


def test_hsdp_is_the_fastest_plan_on_a_slow_fabric_as_brute_force_finds_it():
    p = problem()
    everything = brute_force(p, pins=DATA_ONLY)
    found = search(p, pins=DATA_ONLY, top=3)
    assert [s.estimate.time.step for s in found.candidates] == \
        pytest.approx([s.estimate.time.step for s in everything[:3]], rel=1e-12)
    best = found.best.candidate
    assert (best.shard, best.dp // best.shard, best.zero_stage) == (16, 2, 3)
    # the shard degrees: a node's eight data ranks and twice that (32, every rank, is zero3 over one axis)
    assert {s.candidate.shard for s in everything} == {0, 8, 16}
    # 1.940 s, 1.9 % faster than ZeRO-2 over all 32 (1.977 s; 1.985 against 2.131 while FSDP's units were counted
    # beside the loss's activations, which made both offload more blocks: `cost.memory.unit_moments`; 1.903, 3.7 %,
    # before the root's second gather at the loss's backward was counted; now 10 blocks offloaded)
    one_axis = min(s.estimate.time.step for s in everything if not s.candidate.shard)
    assert found.best.estimate.time.step < 0.985 * one_axis


def test_the_emitted_hsdp_plan_checks_and_estimates_to_the_searchs_figures():
    p = problem()
    best = search(p, pins=DATA_ONLY, top=1).best
    text = plan_text(best, p, Source((), MODEL, "slow"))
    assert "  mesh    = [dp_rep = 2, dp = 16]\n" in text and "  data    = hsdp over [dp_rep, dp]" in text
    [plan] = api.loads(HARDWARE + text).plans  # checks clean: raises otherwise
    estimate = estimate_plan(plan)
    assert estimate.time.step == pytest.approx(best.estimate.time.step, rel=1e-9)
    assert estimate.peak_memory_bytes == pytest.approx(best.estimate.peak_memory_bytes, rel=1e-9)
    assert best.candidate.describe().startswith("dp=32 ") and " hsdp 2x16 " in best.candidate.describe()


def test_hsdp_under_a_pipeline_is_searched_and_estimates_to_its_figures():
    p = problem()
    pins = {"tp": 1, "cp": 1, "pp": 2, "data": "hsdp"}
    found = search(p, pins=pins, top=2)
    assert [s.estimate.time.step for s in found.candidates] == \
        pytest.approx([s.estimate.time.step for s in brute_force(p, pins=pins)[:2]], rel=1e-12)
    for scored in found.candidates:
        assert scored.candidate.shard and scored.plan.data.kind == "hsdp" and scored.candidate.pp == 2
        [plan] = api.loads(HARDWARE + plan_text(scored, p, Source((), MODEL, "slow"))).plans  # its stages written
        assert estimate_plan(plan).time.step == pytest.approx(scored.estimate.time.step, rel=1e-9)


def test_pins_choose_hsdp_its_shard_axis_or_one_data_axis():
    p = problem()
    hsdp = search(p, pins={**DATA_ONLY, "data": "hsdp"}, top=5)
    assert all(s.candidate.shard for s in hsdp.candidates)
    assert {s.candidate.shard for s in search(p, pins={**DATA_ONLY, "dp_shard": 8}, top=3).candidates} == {8}
    for pins in ({"data": "zero3"}, {"zero_stage": 3}, {"data": "fsdp"}):  # a ZeRO stage: over one data axis
        found = search(p, pins={**DATA_ONLY, **pins}, top=3)
        assert all(s.candidate.shard == 0 and s.candidate.zero_stage == 3 for s in found.candidates)
    best = hsdp.best  # its own pins select it again
    again = search(p, pins=best.candidate.pins(), top=1).best
    assert again.candidate == best.candidate and again.estimate.time.step == best.estimate.time.step


@pytest.mark.parametrize("pins, message", [
    ({"dp_shard": 8, "data": "zero2"}, "dp_shard=8 is hsdp's shard axis, data=zero2"),
    ({"data": "hsdp", "zero_stage": 1}, "data=hsdp is ZeRO stage 3, zero_stage=1"),
    ({"dp_shard": 5, "dp": 32}, "dp_shard=5 is hsdp's shard axis, which divides dp=32"),
    ({"data": "hsdp", "cp": 2}, "data=hsdp runs with no context or expert axis"),
    ({"dp_shard": 1}, "dp_shard is at least 2"),
    ({"data": "zero4"}, "the data-parallel kind is one of replicate, zero1, zero2, zero3, hsdp"),
])
def test_contradictory_data_pins_say_why(pins, message):
    with pytest.raises(SearchError, match=message.replace("(", r"\(").replace(")", r"\)")):
        search(problem(), pins=pins)


@pytest.mark.parametrize("pins", [{"data": "hsdp", "tp": 8, "pp": 2}, {"dp_shard": 64}, {"data": "hsdp", "pp": 16}])
def test_hsdp_pins_no_layout_can_split_say_so(pins):
    """Where no layout has a data degree hsdp can split (the pins leave dp below 4, or a shard axis it cannot hold),
    the error says what hsdp needs (it named tensor groups across nodes, which the pins did not ask for)."""
    with pytest.raises(SearchError, match="runs hsdp under the pins .*: hsdp splits a data degree of 4 or more"):
        search(problem(), pins=pins)


def test_a_data_pin_deepspeeds_pipeline_cannot_run_is_named_as_given():
    """On DeepSpeed's pipeline engine (ZeRO 0 or 1) the error names the pin given, `data=hsdp`, not the
    `zero_stage=3` it implies (which no one wrote)."""
    from dataclasses import replace
    with pytest.raises(SearchError, match=r"^--pin data=hsdp \(ZeRO-3\): DeepSpeed's pipeline engine takes ZeRO 0 or 1"):
        search(replace(problem(), pipeline="deepspeed"), pins={"data": "hsdp", "pp": 2})


PARTIAL = HARDWARE + f"""
model m = {MODEL}
plan mine {{
  model   = m
  cluster = slow
"""


def test_generate_from_keeps_a_written_hsdp_and_writes_the_one_it_chooses(tmp_path):
    written = tmp_path / "written.plan"
    written.write_text(PARTIAL + "  mesh    = [r = 2, s = 16]\n  train   = { global_batch: 256, precision: bf16 }\n"
                                 "  data    = hsdp over [r, s]\n}\n")
    assert {k: v for k, v in read_partial(written).pins.items() if k in ("dp", "data", "dp_shard", "zero_stage")} \
        == {"dp": 32, "data": "hsdp", "dp_shard": 16, "zero_stage": 3}
    out = CliRunner().invoke(main, ["generate", "--from", str(written), "--top", "3", "--json"])
    assert out.exit_code == 0, out.output
    for candidate in json.loads(out.output)["candidates"]:  # the written layout, the rest searched
        assert (candidate["data"], candidate["dp_shard"], candidate["dp"]) == ("hsdp", 16, 32)
    free = tmp_path / "free.plan"  # no mesh, no data line: the search lays out hsdp's two axes
    free.write_text(PARTIAL + "  train   = { global_batch: 256, precision: bf16 }\n}\n")
    done = tmp_path / "done.plan"
    out = CliRunner().invoke(main, ["generate", "--from", str(free), "--pin", "tp=1", "--pin", "pp=1",
                                    "--pin", "cp=1", "-o", str(done)])
    assert out.exit_code == 0, out.output
    text = done.read_text()
    assert re.search(r"\n  mesh +=  ?\[dp_rep = 2, dp = 16\]\n", text) and re.search(r"\n  data +=  ?hsdp over \[dp_rep, dp\]", text), text
    analysis = api.check(done)
    assert analysis.ok, [d.message for d in analysis.diagnostics]
    one_axis = tmp_path / "one_axis.plan"  # a written mesh of one data axis: no hsdp
    one_axis.write_text(PARTIAL + "  mesh    = [dp = 32]\n  train   = { global_batch: 256, precision: bf16 }\n}\n")
    out = CliRunner().invoke(main, ["generate", "--from", str(one_axis), "--top", "3", "--json"])
    assert out.exit_code == 0, out.output
    assert all(c["data"] != "hsdp" for c in json.loads(out.output)["candidates"])
    # ... and hsdp pinned over it is E803 at the mesh, the line it contradicts (it said no layout could split dp=32, and
    # to pin a smaller tp or pp; then that the plan writes one data axis, at the plan's name)
    for pin in ("data=hsdp", "dp_shard=8"):
        out = CliRunner().invoke(main, ["generate", "--from", str(one_axis), "--pin", pin])
        assert out.exit_code == 1 and f"one_axis.plan:10:3: error[E803]: --pin {pin} contradicts the plan's " \
            "`mesh = [dp = 32]`, which gives one data axis, no dp_shard" in out.output, out.output
    # a written data line of one axis, without a mesh: the pin contradicts the line, E803 at it (it had completed the
    # search's hsdp mesh around the written line, `mesh = [dp_rep = 2, dp = 16]`, `data = zero1 over dp`: E306, 'a bug
    # of plandsl generate --from'; then said "the plan writes one data axis" with no place)
    one_line = tmp_path / "one_line.plan"
    one_line.write_text(PARTIAL + "  train   = { global_batch: 256, precision: bf16 }\n  data    = zero1 over dp\n}\n")
    for pin in ("data=hsdp", "dp_shard=8"):
        out = CliRunner().invoke(main, ["generate", "--from", str(one_line), "--pin", pin])
        assert out.exit_code == 1 and "E306" not in out.output and \
            f"one_line.plan:11:3: error[E803]: --pin {pin} contradicts the plan's `data = zero1 over dp`" in out.output, \
            out.output




@pytest.mark.parametrize("mesh", ["[r = 1, s = 32]", "[r = 32, s = 1]"])
def test_generate_from_a_written_hsdp_with_an_axis_of_one_rank(tmp_path, mesh):
    """hsdp whose written replicas (or shard axis) are one rank checks; the search lays out no such split
    (`Candidate.shard`), so the plan pins its ZeRO stage alone and its lines stay: it pinned dp_shard=32 with dp=32
    (E803 'contradictory pins', a plan that checks) or dp_shard=1 ('--pin dp_shard=1: dp_shard is at least 2')."""
    written = tmp_path / "written.plan"
    written.write_text(PARTIAL + f"  mesh    = {mesh}\n  train   = {{ global_batch: 256, precision: bf16 }}\n"
                                 "  data    = hsdp over [r, s]\n}\n")
    pins = read_partial(written).pins
    assert pins["zero_stage"] == 3 and "data" not in pins and "dp_shard" not in pins, pins
    # a --pin of the shard axis the mesh writes agrees with it; another is E803 at the mesh, which sizes the shard axis
    # (the data line names it): dp_shard=32 was 'contradictory pins' at the plan's name, dp_shard=16 ran and was lost
    shard = 32 if mesh == "[r = 1, s = 32]" else 1
    for other in (16, 2):
        out = CliRunner().invoke(main, ["generate", "--from", str(written), "--pin", f"dp_shard={other}"])
        assert out.exit_code == 1 and f"written.plan:10:3: error[E803]: --pin dp_shard={other} contradicts the plan's " \
            f"`mesh = {mesh}`, which gives dp_shard={shard}" in out.output, out.output
    if mesh == "[r = 1, s = 32]":  # [32, 1] does not fit these devices (E503 as written, `check` says so too)
        out = CliRunner().invoke(main, ["generate", "--from", str(written), "--top", "1", "--json"])
        assert out.exit_code == 0, out.output
        [candidate] = json.loads(out.output)["candidates"]
        assert candidate["data"] == "hsdp" and "data    = hsdp over [r, s]\n" in candidate["plan"]
        for pin in ("dp_shard=32", "data=hsdp"):  # what the written lines say: the same search, the same plan
            out = CliRunner().invoke(main, ["generate", "--from", str(written), "--pin", pin, "--top", "1", "--json"])
            assert out.exit_code == 0 and json.loads(out.output)["candidates"] == [candidate], out.output


def test_a_shard_pin_against_a_written_hsdp_mesh_is_refused_at_the_mesh(tmp_path):
    """hsdp's shard axis is sized by the mesh (the data line names it): a --pin dp_shard that agrees with it runs, one that
    does not is E803 at the mesh line (it was at the data line, which says nothing of the degree)."""
    written = tmp_path / "written.plan"
    written.write_text(PARTIAL + "  mesh    = [r = 2, s = 16]\n  train   = { global_batch: 256, precision: bf16 }\n"
                                 "  data    = hsdp over [r, s]\n}\n")
    out = CliRunner().invoke(main, ["generate", "--from", str(written), "--pin", "dp_shard=8"])
    assert out.exit_code == 1 and "written.plan:10:3: error[E803]: --pin dp_shard=8 contradicts the plan's " \
        "`mesh = [r = 2, s = 16]`, which gives dp_shard=16" in out.output, out.output
    out = CliRunner().invoke(main, ["generate", "--from", str(written), "--pin", "dp_shard=16", "--top", "1", "--json"])
    assert out.exit_code == 0 and json.loads(out.output)["candidates"][0]["dp_shard"] == 16, out.output


def test_the_faster_devices_alone_are_searched_without_a_pinned_shard_axis():
    """On a mixed cluster `generate` searches the fastest devices alone under the pins that do not fix the layout:
    hsdp's shard axis is a degree (dp_shard=32 leaves no two replicas on 32 H100s), dropped there as dp is (it said
    'on its 32 h100_80g devices alone no plan runs'); every candidate on the mix keeps it, uneven shares' variants too."""
    request = api.generate_request(model="gpt(layers=2, hidden=256, heads=4, seq=128, vocab=1024)",
                                   cluster="mixed_a100_h100", global_batch=64, pins=["dp_shard=32"], top=3)
    found = api.generate_json(api.generate(request))
    assert {(c["data"], c["dp_shard"]) for c in found["candidates"]} == {("hsdp", 32)}
    gain = found["heterogeneity"]
    assert gain["faster_devices"] == 32 and gain["alone_step_time_s"] is not None, gain
