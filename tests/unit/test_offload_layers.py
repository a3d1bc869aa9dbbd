"""`offload_layers: N` (Megatron's --cpu-offloading-num-layers N, Transformer Engine's offload handler, torch's
save_on_cpu): the first N blocks of each stage keep their saved activations in host memory.

The language (a train key, 0 by default and then out of the dump), the checker (a stage's blocks, E205; beside
recomputation E512, on Megatron-LM's pipeline E513, beyond a node's host memory E514: the catalogue's cases),
memory (each offloaded block leaves the device but one, which its host holds), time (the copies over the device's
host link, exposed only beyond the compute of the stage's other blocks), `show`, and Megatron-LM's flag both ways."""
from __future__ import annotations

import pytest

from plandsl import api, ir
from plandsl.cost.estimate import estimate_plan
from plandsl.cost.layer import LayerTime
from plandsl.cost.memory import estimate_layer_activations, estimate_plan_memory, layer_offload
from plandsl.cost.offload import _backward_waits, _forward_waits, offload_seconds, offloaded_bytes
from plandsl.interop import export_plan, import_text
from plandsl.ir.layers import layers_of
from plandsl.ir.placement import assign_stages

PLAN = """\
device gpu {{
  memory         = 80 GB
  bandwidth      = 2000 GB/s
  peak           = {{ bf16: 300 TFLOP/s, fp32: 20 TFLOP/s }}
  {host}
}}
node box {{
  devices = 8 x gpu
  link    = {{ bandwidth: 300 GB/s }}
}}
plan p {{
  model   = llama(layers=8, hidden=1024, heads=16, kv_heads=8, seq=2048, vocab=32000)
  cluster = box x 1
  mesh    = [{mesh}]
  train   = {{ global_batch: 32, micro_batch: 2, {train} }}
  data    = fsdp over dp
{extra}}}
"""


def _plan(train: str = "", host: str = "", mesh: str = "dp = 8", extra: str = "") -> ir.Plan:
    return api.select_plan(api.loads(PLAN.format(train=train, host=host, mesh=mesh, extra=extra)))


def test_offload_layers_is_a_train_key_out_of_the_dump_when_zero():
    plain, none, some = _plan(), _plan("offload_layers: 0"), _plan("offload_layers: 3")
    assert plain.train.offload_layers == none.train.offload_layers == 0 and some.train.offload_layers == 3
    assert "offload_layers" not in plain.train.model_dump() and plain.model_dump() == none.model_dump()
    assert some.train.model_dump()["offload_layers"] == 3
    assert [some.train.block_offloaded(i) for i in range(5)] == [True] * 3 + [False] * 2


def test_host_bandwidth_and_host_memory_are_optional_and_dump_only_when_given():
    plain = _plan()
    assert plain.cluster.groups[0].node.device.host_link == ir.DEFAULT_HOST_BANDWIDTH
    assert "host_bandwidth" not in plain.cluster.groups[0].node.device.model_dump()
    assert "host_memory" not in plain.cluster.groups[0].node.model_dump()
    fast = _plan(host="host_bandwidth = 450 GB/s")
    assert fast.cluster.groups[0].node.device.host_link == 450e9


@pytest.mark.parametrize("train, code, words", [
    ("offload_layers: 9", "E205", "8 blocks"),
    ("offload_layers: -1", "E205", "at least 0"),
    ("recompute: selective, offload_layers: 2", "E512", "recompute: selective"),
    ("recompute: full, recompute_layers: 2, offload_layers: 2", "E512", "recompute_layers"),
    ("offload_layer: 2", "E206", "offload_layers"),
])
def test_bad_offload_layers_are_diagnostics(train, code, words):
    analysis = api.checks(PLAN.format(train=train, host="", mesh="dp = 8", extra=""))
    assert [d.code for d in analysis.errors] == [code], [str(d) for d in analysis.errors]
    assert words in analysis.errors[0].message + (analysis.errors[0].hint or "")


def test_a_stage_counts_its_own_blocks():
    """With 4 stages of 2 blocks, 2 is every block of a stage and 3 is more than any stage has (E205)."""
    stages = "  stages  = evenly over pp\n  schedule = 1f1b\n"
    assert not api.checks(PLAN.format(train="offload_layers: 2", host="", mesh="pp = 4, dp = 2", extra=stages)).errors
    analysis = api.checks(PLAN.format(train="offload_layers: 3", host="", mesh="pp = 4, dp = 2", extra=stages))
    assert [d.code for d in analysis.errors] == ["E205"] and "2 blocks of the largest stage" in analysis.errors[0].message
    plan = _plan("offload_layers: 1", mesh="pp = 4, dp = 2", extra=stages)
    assignment, _ = assign_stages(plan)
    assert [layer_offload(plan, layers) for layers in assignment.stage_layers] == \
        [[False, True, False], [True, False], [True, False], [True, False, False, False]]


def test_each_offloaded_block_leaves_the_device_but_the_one_reloaded_where_none_is_kept():
    """Transformer Engine's default synchronizer (TE 2.10 on, what megatron-core 0.16.1 runs) frees block i's device
    copy at block L - N + i's forward and reloads it at block L - 1 - N + i's backward: L - N blocks' activations at
    every moment, none in flight beyond them (its v1 handler, before, held one more). Offloading all 8 blocks, the
    block the backward reloads is on the device: 7 fewer, as with 7."""
    plan = _plan()
    block = estimate_layer_activations(plan, next(layer for layer in layers_of(plan.model) if layer.kind == "block"))
    kept = [estimate_plan_memory(_plan(f"offload_layers: {n}"))[0] for n in range(0, 9)]
    assert kept[0].host == 0 and "host" not in kept[0].to_json()
    for n in range(1, 9):  # n blocks on the host; n blocks' fewer on the device (7 where all 8 are: one reloaded)
        assert kept[n].host == pytest.approx(n * block)
        assert kept[0].activations - kept[n].activations == pytest.approx(min(n, 7) * block)
        assert (kept[n].params, kept[n].grads, kept[n].optimizer) == (kept[0].params, kept[0].grads, kept[0].optimizer)


def test_copies_cost_only_what_the_other_blocks_compute_does_not_hide():
    """With 2 of 8 blocks offloaded, each copy runs beside the blocks between its issue and its deadline; one so fast
    that it hides behind them costs nothing."""
    plan = _plan("offload_layers: 2", "host_bandwidth = 1 GB/s")
    layers = list(layers_of(plan.model))
    copy = estimate_layer_activations(plan, layers[1]) / 1e9
    assert offloaded_bytes(plan, layers) / 1e9 == pytest.approx(2 * copy)
    block = copy / 8  # each block's forward an eighth of one copy, its backward a quarter
    times = [LayerTime(forward=block, input_grad=block, weight_grad=block, forward_comm=0.0, backward_comm=0.0,
                       flops=0.0, recompute_flops=0.0) for _ in layers]
    device = plan.cluster.groups[0].node.device
    forward, backward = offload_seconds(plan, layers, times, device)
    # forward: copy 0 from block 0's end, copy 1 behind it, waited for before block 7 (L - N + 1): 2 copies less
    # blocks 1..6; backward: reload 1 at block 6's backward (L - 1 - N + 1), reload 0 behind it, waited for at
    # block 0: 2 copies less blocks 6..1's backward
    assert forward == pytest.approx(2 * copy - 6 * block)
    assert backward == pytest.approx(2 * copy - 6 * 2 * block)
    fast = _plan("offload_layers: 2", "host_bandwidth = 10000 TB/s")
    assert offload_seconds(fast, layers, times, fast.cluster.groups[0].node.device) == (0, 0)


@pytest.mark.parametrize("copies, waits", [
    ([2.0, None, None, None], 0.0),    # issued at 1, due before block 3 (L - N + 0) at 3: hidden
    ([2.5, None, None, None], 0.5),
    ([0.5, 0.5, 0.5, None], 1.5),      # N = L - 1: each due before the next block: every copy waited for
    ([1.0, 1.0, None, None], 0.0),     # done at 2 and 3, due before blocks 2 and 3
    ([1.5, 1.5, None, None], 1.0),     # the second queues behind the first: done at 4, due at 3 (+0.5 before)
    ([0.5, 0.5, 0.5, 0.5], 2.0),       # every block (torch's pipeline): each before the next, the last at the end
])
def test_the_forward_waits_for_each_copy_by_its_deadline(copies, waits):
    """Transformer Engine's DefaultOffloadSynchronizer (v2.10 cpu_offload.py): block i's copy issued at block
    i + 1's forward, on one stream behind the copies before it, waited for before block L - N + i's forward."""
    assert _forward_waits([1.0] * 4, copies) == pytest.approx(waits)


@pytest.mark.parametrize("copies, waits", [
    ([3.0, None, None, None], 0.0),    # reload 0 issued at block 2's backward (t 2), needed at block 0's (t 6)
    ([5.0, None, None, None], 1.0),
    ([0.5, 0.5, 0.5, None], 1.5),      # N = L - 1: each reload issued at its own block's backward
    ([2.0, 2.0, None, None], 0.0),     # reload 1 at block 2 (t 2, done 4), reload 0 at block 1 (t 4, done 6)
    ([3.0, 3.0, None, None], 2.0),     # reload 1 done 5 (+1 at block 1), reload 0 from 5 done 8 (+1 at block 0)
])
def test_the_backward_waits_for_each_reload(copies, waits):
    """Reload i issued at block L - 1 - N + i's backward, on the same stream, waited for at block i's backward."""
    assert _backward_waits([2.0] * 4, copies) == pytest.approx(waits)


def test_the_estimate_adds_the_exposed_copies_to_the_stage():
    base = estimate_plan(_plan())
    fast = estimate_plan(_plan("offload_layers: 4", "host_bandwidth = 10000 GB/s"))
    slow = estimate_plan(_plan("offload_layers: 4", "host_bandwidth = 5 GB/s"))
    assert fast.time.step == pytest.approx(base.time.step)  # hidden behind 7 blocks' compute
    stage, plain = slow.stage_times[0], base.stage_times[0]
    forward, backward = stage.forward - plain.forward, stage.backward - plain.backward
    assert forward > backward > 0  # the backward, twice the forward's compute, hides more of the same bytes
    assert stage.comm - plain.comm == pytest.approx(forward + backward)
    assert slow.time.step > base.time.step


def test_show_says_which_blocks_offload():
    text = api.describe(api.loads(PLAN.format(train="offload_layers: 2", host="", mesh="dp = 8", extra="")))
    assert "activations of the first 2 blocks per stage offloaded to the host" in text


def test_megatron_flag_both_ways():
    plan = _plan("offload_layers: 3")
    exported = export_plan(plan, "megatron")
    assert not exported.lost and "--cpu-offloading-num-layers 3" in " ".join(exported.text.split())
    imported = import_text("megatron", exported.text, "plan.args", world_size=plan.mesh.size, name=plan.name)
    assert imported.ok, [str(d) for d in imported.diagnostics]
    assert api.select_plan(api.loads(imported.text, path="back.plan")).train.offload_layers == 3
    assert "--cpu-offloading" not in export_plan(_plan(), "megatron").text


@pytest.mark.parametrize("tool, words", [("torchtitan", "torchtitan keeps every saved activation"),
                                         ("deepspeed", "cpu_checkpointing")])
def test_the_other_tools_lose_offloading_on_export(tool, words):
    exported = export_plan(_plan("offload_layers: 2"), tool)
    assert any(words in lost.message for lost in exported.lost), [lost.message for lost in exported.lost]
    assert not any("offload" in lost.message for lost in export_plan(_plan(), tool).lost)


@pytest.mark.parametrize("train, mesh, extra, words", [
    ("offload_layers: 8", "dp = 8", "", "fewer than num_layers"),
    ("offload_layers: 1", "pp = 2, dp = 4", "  stages  = evenly over pp\n  schedule = 1f1b\n", "pipeline parallelism"),
])
def test_what_megatron_refuses_is_lost_on_export(train, mesh, extra, words):
    exported = export_plan(_plan(train, mesh=mesh, extra=extra), "megatron")
    assert any(words in lost.message for lost in exported.lost), [lost.message for lost in exported.lost]


def _space(pins):
    from plandsl.cost.compute import DEFAULT_EFFICIENCY
    from plandsl.search.space import Space
    from dataclasses import replace
    from test_search import problem  # its `long` gpt on 7.25 GiB devices: activations bind
    # with Megatron's 16-bit weights, as test_the_search_writes_what_it_chose_and_takes_pins says why
    return Space(replace(problem("long", "tight", 4), param_dtype=ir.Precision.bf16), pins, DEFAULT_EFFICIENCY)


@pytest.mark.slow  # every offloading leaf of the space evaluated four times: about 3.5 s
def test_the_search_offloads_the_least_that_fits_and_only_where_the_blocks_do_not_fit_otherwise():
    """Every offloading leaf (no pipeline): one block fewer offloaded does not fit, one more is no faster, and the
    node that keeps every block does not fit that leaf (else offloading only adds copies)."""
    from dataclasses import replace
    space = _space({"pp": 1})
    checked = 0
    for root in space.roots():
        for node in space.expand_root(root):
            if not node.offload:
                continue
            for leaf in space.expand(node):
                n = leaf.offload_layers
                scored = space.evaluate(leaf)
                if scored is None:
                    continue
                assert n >= 1 and space.evaluate(replace(leaf, offload_layers=n - 1)) is None
                assert space.evaluate(replace(leaf, offload_layers=0)) is None
                more = space.evaluate(replace(leaf, offload_layers=n + 1)) if n < space.blocks else None
                assert more is None or more.estimate.time.step >= scored.estimate.time.step
                assert scored.plan.train.offload_layers == n and scored.estimate.fits
                checked += 1
    assert checked > 10


def test_the_search_writes_what_it_chose_and_takes_pins():
    from plandsl.search import SearchError, search
    from plandsl.search.emit import Source, plan_text
    from dataclasses import replace
    from test_search import problem
    # Megatron's 16-bit weights (--cpu-offloading-num-layers is Megatron's): fp32 ones would hold autocast's bf16
    # copies of them under `plandsl run` (cost.memory.autocast_weight_copies), which no offloading plan fits beside
    p = replace(problem("long", "tight", 4), param_dtype=ir.Precision.bf16)
    best = search(p, {"pp": 1}, top=1).best
    assert best.candidate.offload_layers == 7 and "offload_layers=7" in best.candidate.describe()
    text = plan_text(best, p, Source(("clusters/local",), "m", "tight"))
    assert "offload_layers: 7" in text
    pinned = search(p, {"pp": 1, "offload_layers": 12}, top=3)
    assert {s.candidate.offload_layers for s in pinned.candidates} == {12}
    assert all(s.candidate.offload_layers == 0 for s in search(p, {"pp": 1, "offload_layers": 0}, top=3).candidates)
    for pins, words in (({"offload_layers": 2, "recompute": "full"}, "recomputes them"),
                        ({"offload_layers": 2, "pp": 2}, "without a pipeline"),
                        ({"offload_layers": 17}, "16 blocks")):
        with pytest.raises(SearchError, match=words):
            search(p, pins, top=1)


def test_an_estimate_past_the_hosts_memory_does_not_fit():
    host = "host_bandwidth = 50 GB/s"
    plan = _plan("offload_layers: 8", host)
    estimate = estimate_plan(plan)
    assert estimate.fits and estimate.host_capacity == float("inf")
    node = plan.cluster.groups[0].node
    small = node.model_copy(update={"host_memory": node.host_devices * estimate.memory[0].host * 0.99})
    tight = plan.model_copy(update={"cluster": plan.cluster.model_copy(update={
        "groups": (plan.cluster.groups[0].model_copy(update={"node": small}),)})})
    assert not estimate_plan(tight).fits
    from plandsl.cost.estimate import format_estimate
    assert "offloaded to the host" in format_estimate(estimate) and "DOES NOT FIT" not in format_estimate(estimate)
    assert format_estimate(estimate_plan(tight)).splitlines()[-1].endswith("DOES NOT FIT")
    assert "offloaded to the host" not in format_estimate(estimate_plan(_plan()))


def _offloading_leaves(host: str = ""):
    """The offloading leaves (no pipeline) of test_search's `long` gpt on its tight cluster, whose two-device nodes
    state `host`, with the exact estimate of each."""
    from dataclasses import replace
    from plandsl.cost.compute import DEFAULT_EFFICIENCY
    from plandsl.search import Problem
    from plandsl.search.space import Space
    from test_search import HARDWARE, MODELS
    hardware = HARDWARE.replace("node tight_box { devices = 2 x small;", f"node tight_box {{ devices = 2 x small; {host}")
    document = api.loads(hardware + f"model m = {MODELS['long']}\n")
    cluster = next(c for c in document.clusters if c.name == "tight")
    problem = replace(Problem(document.models[0], cluster, 4, None), param_dtype=ir.Precision.bf16)
    space = Space(problem, {"pp": 1}, DEFAULT_EFFICIENCY)
    leaves = [leaf for root in space.roots() for node in space.expand_root(root) if node.offload
              for leaf in space.expand(node)]
    return space, [(leaf, space.evaluate(leaf)) for leaf in leaves]


def test_the_search_proposes_no_offloading_the_device_or_the_host_cannot_hold():
    """Offloading every block holds as much on the device as all but one (the block the backward reloads), so an
    unpinned search stops at L - 1; and a device's offloaded blocks must fit its share of the host's memory (E514),
    which more blocks only fill: no offloading leaf the search proposes is refused by the exact estimate."""
    space, evaluated = _offloading_leaves()
    assert evaluated and all(leaf.offload_layers < space.blocks for leaf, _ in evaluated)
    assert all(scored is not None for _, scored in evaluated)
    needs = sorted(scored.estimate.memory[0].host for _, scored in evaluated)
    # host memory for the two devices of a node below the least that any of those leaves offloads: none proposed
    _, none = _offloading_leaves(f"host_memory = {2 * needs[0] / 2**30 * 0.99} GiB;")
    assert none == []
    # room for the leaves that offload least: only leaves within it, each fitting
    _, some = _offloading_leaves(f"host_memory = {2 * needs[len(needs) // 2] / 2**30 * 1.001} GiB;")
    assert some and all(scored is not None and scored.estimate.memory[0].host <= needs[len(needs) // 2] * 1.001
                        for _, scored in some)
