"""Semantics of the lowering (syntax tree -> ir.Document): units, parameters, expressions,
macros, clusters, meshes, defaults by axis name, models, shard rules, schedules, names and imports.
"""
from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from plandsl import ir
from plandsl.check.analysis import Analysis, analyze

HEADER = 'import "clusters/dgx_a100"\nimport "clusters/local"\n'
GPT = "gpt(layers=8, hidden=1024, heads=16, seq=1024, vocab=50304)"


def run(text: str, params: dict | None = None) -> Analysis:
    return analyze(text=textwrap.dedent(text), params=params)


def ok(text: str, params: dict | None = None) -> ir.Document:
    analysis = run(text, params)
    assert analysis.ok, [(d.code, d.message) for d in analysis.diagnostics]
    return analysis.document


def errors(text: str, params: dict | None = None) -> list:
    analysis = run(text, params)
    assert not analysis.ok, "expected an error"
    return analysis.errors


def one(text: str, code: str, params: dict | None = None):
    found = [d for d in errors(text, params) if d.code == code]
    assert found, [(d.code, d.message) for d in errors(text, params)]
    return found[0]


def plan(mesh: str = "[dp = 8]", extra: str = "", model: str = GPT, cluster: str = "dgx_a100 x 1",
         pre: str = "", train: str = "{ global_batch: 64 }") -> str:
    return HEADER + pre + (
        "plan p {\n"
        f"  model   = {model}\n"
        f"  cluster = {cluster}\n"
        f"  mesh    = {mesh}\n"
        f"  train   = {train}\n"
        f"{extra}\n"
        "}\n")


def the_plan(text: str, params: dict | None = None) -> ir.Plan:
    (p,) = ok(text, params).plans
    return p


# ---- units --------------------------------------------------------------------------------
DEVICE = """\
device d {
  memory    = MEMORY
  bandwidth = BANDWIDTH
  peak      = { bf16: 312 TFLOP/s, fp32: 19.5 TFLOP/s }
}
node n {
  devices = 4 x d
  link    = { bandwidth: LINK, latency: LATENCY }
}
"""


def device(memory="80 GiB", bandwidth="2039 GB/s", link="200 Gb/s", latency="5 us") -> str:
    return (DEVICE.replace("MEMORY", memory).replace("BANDWIDTH", bandwidth)
            .replace("LINK", link).replace("LATENCY", latency))


def test_units_to_si():
    doc = ok(device())
    (d,) = doc.devices
    assert d.memory == 80 * 2**30
    assert d.bandwidth == 2039e9
    assert d.peak == {ir.Precision.bf16: 312e12, ir.Precision.fp32: 19.5e12}
    (n,) = doc.nodes
    assert n.link.bandwidth == 25e9  # 200 Gb/s: bits, /8
    assert n.link.latency == 5e-6    # exactly, not 4.9999999999999996e-06
    assert n.devices == 4 and n.device == d


@pytest.mark.parametrize("written, value", [
    ("1 KiB", 1024), ("1 MiB", 2**20), ("2 TiB", 2 * 2**40), ("1 KB", 1e3), ("3 GB", 3e9),
    ("8 Gb", 1e9), ("80GiB", 80 * 2**30), ("1.5 GiB", 1.5 * 2**30), ("2 * 40 GiB", 80 * 2**30),
    ("40 GiB + 40 GiB", 80 * 2**30), ("160 GiB / 2", 80 * 2**30),
])
def test_memory_units(written, value):
    (d,) = ok(device(memory=written)).devices
    assert d.memory == value


@pytest.mark.parametrize("written, value", [
    ("1 s", 1.0), ("2 ms", 2e-3), ("5 us", 5e-6), ("7 ns", 7e-9), ("1 min", 60.0), ("1 h", 3600.0),
])
def test_time_units(written, value):
    (n,) = ok(device(latency=written)).nodes
    assert n.link.latency == value


def test_latency_defaults_to_zero():
    (n,) = ok(DEVICE.replace(", latency: LATENCY", "").replace("MEMORY", "80 GiB")
              .replace("BANDWIDTH", "2039 GB/s").replace("LINK", "200 Gb/s")).nodes
    assert n.link.latency == 0.0


def test_zero_latency_can_be_written():
    (n,) = ok(device(latency="0 s")).nodes
    assert n.link.latency == 0.0


@pytest.mark.parametrize("written, value", [
    ("200 Gb/s", 25e9), ("200 Gbps", 25e9), ("600 GB/s", 600e9), ("1 GiB/s", 2**30), ("8 b/s", 1.0),
])
def test_bandwidth_units(written, value):
    (n,) = ok(device(link=written)).nodes
    assert n.link.bandwidth == value


@pytest.mark.parametrize("field, written", [
    ("memory", "80 GB/s"), ("memory", "5 us"), ("memory", "80"), ("bandwidth", "80 GiB"),
    ("latency", "200 Gb/s"), ("link", "5 us"), ("memory", "40 GiB + 5 us"),
])
def test_wrong_unit_is_E203(field, written):
    d = one(device(**{field: written}), "E203")
    assert d.span.line >= 1


def test_infinite_quantity_is_an_error():
    analysis = run(device(memory="1e400 GiB"))
    assert not analysis.ok


def test_wrong_unit_message_names_both_dimensions():
    d = one(device(memory="80 GB/s"), "E203")
    assert "bytes" in d.message and "bandwidth" in d.message
    assert d.hint and "GiB" in d.hint


@pytest.mark.parametrize("written, suggestion", [("80 GiBs", "GiB"), ("80 Gib", "G"), ("5 usec", "us"),
                                                 ("80 gb", "")])
def test_unknown_unit_is_E204_with_hint(written, suggestion):
    d = one(device(memory=written), "E204")
    unit = written.split()[-1]
    assert f"'{unit}'" in d.message
    assert d.hint and d.hint.startswith(("did you mean", "units")), d.hint
    assert suggestion in d.hint
    assert d.span.line == 2


def test_unknown_unit_did_you_mean_exact():
    d = one(device(memory="80 GiBs"), "E204")
    assert d.hint in ("did you mean 'GiB'?", "did you mean 'GiB/s'?")


# ---- parameters and expressions -----------------------------------------------------------------
PARAM_PLAN = plan(pre="param nodes = 2\nparam tp = 2\n", cluster="dgx_a100 x nodes",
                  mesh="[dp = nodes * 8 / tp, tp = tp]")


def test_param_expressions():
    p = the_plan(PARAM_PLAN)
    assert [(a.name, a.size) for a in p.mesh.axes] == [("dp", 8), ("tp", 2)]
    assert p.cluster.num_nodes == 2


@pytest.mark.parametrize("params, dp, nodes", [({"nodes": 4}, 16, 4), ({"nodes": 1, "tp": 8}, 1, 1),
                                               ({"tp": 4}, 4, 2)])
def test_param_overrides(params, dp, nodes):
    doc = ok(PARAM_PLAN, params)
    (p,) = doc.plans
    assert p.mesh.axis("dp").size == dp
    assert p.cluster.num_nodes == nodes
    assert doc.params == {"nodes": 2, "tp": 2, **params}


def test_unknown_param_override_is_E201():
    d = one(PARAM_PLAN, "E201", params={"node": 4})
    assert "node" in d.message
    assert d.hint.startswith("did you mean 'nodes'?")


def test_param_refers_to_param():
    p = the_plan(plan(pre="param nodes = 2\nparam gpus = nodes * 8\n", cluster="dgx_a100 x nodes",
                      mesh="[dp = gpus]"))
    assert p.mesh.axis("dp").size == 16


@pytest.mark.parametrize("expr, size", [
    ("2 + 3 * 2", 8), ("(2 + 2) * 2", 8), ("17 // 2", 8), ("16 / 2", 8), ("18 % 10", 8),
    ("max(2, 8)", 8), ("min(8, 99)", 8), ("abs(-8)", 8), ("ceil(7.5)", 8), ("floor(8.9)", 8),
    ("- -8", 8), ("8.0", 8), ("1_0 - 2", 8), ("2 * 2 * 2", 8),
])
def test_integer_expressions(expr, size):
    p = the_plan(plan(mesh=f"[dp = {expr}]"))
    assert p.mesh.axis("dp").size == size
    assert isinstance(p.mesh.axis("dp").size, int)


@pytest.mark.parametrize("expr, shown", [("8 / 3", "2.66667"), ("nodes / 4", "1.5"), ("2.5", "2.5")])
def test_non_integer_axis_size_is_E211_showing_the_value(expr, shown):
    d = one(plan(pre="param nodes = 6\n", mesh=f"[dp = {expr}]", cluster="dgx_a100 x 1"), "E211")
    assert shown in d.message
    assert "dp" in d.message
    assert d.span.line == 7  # the mesh line: 2 imports, 1 param, plan, model, cluster, mesh


def test_non_integer_names_the_param():
    d = one(plan(pre="param half = 4.5\n", mesh="[dp = half]"), "E211")
    assert "half" in d.message and "4.5" in d.message


def test_division_by_zero_is_E211():
    d = one(plan(mesh="[dp = 8 / (4 - 4)]"), "E211")
    assert "zero" in d.message


def test_self_reference_is_E211():
    one(plan(pre="param a = a + 1\n", mesh="[dp = a]"), "E211")
    one(plan(pre="let a = b\nlet b = a\n", mesh="[dp = a]"), "E211")


def test_unknown_name_is_E201_with_hint():
    d = one(plan(pre="param nodes = 1\n", mesh="[dp = node * 8]"), "E201")
    assert "'node'" in d.message and d.hint.startswith("did you mean 'nodes'?")


# ---- let macros ------------------------------------------------------------------------------
def test_let_macros_substitute_expressions():
    p = the_plan(plan(pre="let m = gpt(layers=4, hidden=256, heads=4, seq=128, vocab=1000)\n"
                          "let t = 2\nlet axes = [dp = 8 / t, tp = t]\nlet cl = dgx_a100 x 1\n",
                      model="m", mesh="axes", cluster="cl"))
    assert (p.model.layers, p.model.hidden) == (4, 256)
    assert [(a.name, a.size) for a in p.mesh.axes] == [("dp", 4), ("tp", 2)]
    assert p.tensor.axis == "tp"


def test_let_word_macro():
    p = the_plan(plan(pre="let sharding = zero3\n", extra="  data = sharding over dp"))
    assert p.data.kind == "zero3"


def test_let_error_shows_the_value():
    d = one(plan(pre="let bad = 8 / 3\n", mesh="[dp = bad]"), "E211")
    assert "2.66667" in d.message
    assert d.span.line in (3, 7)  # where `8 / 3` was written, or where `bad` is used


def test_unused_let_and_param_warn_W201():
    analysis = run(plan(pre="let unused = 1\nparam spare = 2\n"))
    assert analysis.ok
    assert sorted(d.message for d in analysis.diagnostics if d.code == "W201") == [
        "definition 'unused' is never used", "parameter 'spare' is never used"]


def test_long_let_alias_chain_is_not_a_cycle():
    lets = "let a0 = [dp = 8]\n" + "".join(f"let a{i} = a{i - 1}\n" for i in range(1, 80))
    p = the_plan(plan(pre=lets, mesh="a79"))
    assert p.mesh.axis("dp").size == 8


# ---- clusters -------------------------------------------------------------------------------
def test_homogeneous_cluster():
    p = the_plan(plan(cluster="dgx_a100 x 2", mesh="[dp = 16]"))
    assert p.cluster.name == "dgx_a100 x 2"
    ((g,),) = (p.cluster.groups,)
    assert (g.node.name, g.count, g.node.devices, g.node.device.name) == ("dgx_a100", 2, 8, "a100_80g")
    assert p.cluster.num_devices == 16 and not p.cluster.heterogeneous


def test_count_may_come_first():
    p = the_plan(plan(cluster="2 x dgx_a100", mesh="[dp = 16]"))
    assert p.cluster.num_devices == 16


def test_heterogeneous_cluster_list():
    # full recomputation: the model fits the CPU devices beside autocast's copies of its fp32 weights
    p = the_plan(plan(cluster="[dgx_a100 x 1, localhost x 2]", mesh="[dp = 24]",
                      train="{ global_batch: 48, recompute: full }"))
    assert [(g.node.name, g.count) for g in p.cluster.groups] == [("dgx_a100", 1), ("localhost", 2)]
    assert p.cluster.num_devices == 24 and p.cluster.heterogeneous
    assert p.cluster.name == "dgx_a100 x 1 + localhost x 2"
    order = [d.name for d in p.cluster.devices_in_order()]
    assert order == ["a100_80g"] * 8 + ["cpu"] * 16


def test_named_cluster_definitions():
    doc = ok(HEADER + "cluster pod = dgx_a100 x 4\n"
             "cluster fab {\n  nodes = [dgx_a100 x 2, localhost]\n  fabric = { bandwidth: 400 Gb/s }\n}\n")
    by_name = {c.name: c for c in doc.clusters}
    assert by_name["pod"].num_nodes == 4
    assert by_name["fab"].num_devices == 24
    assert by_name["fab"].fabric.bandwidth == 50e9 and by_name["fab"].fabric.latency == 0


def test_cluster_of_wrong_kind_is_an_error():
    one(plan(cluster="a100_80g x 4"), "E205")
    one(plan(cluster="dgx_a10 x 4"), "E201")


# ---- meshes -----------------------------------------------------------------------------------
def test_mesh_over_devices_slice():
    p = the_plan(plan(mesh="[dp = 2] over devices[0:2]"))
    assert (p.mesh.first_device, p.mesh.part, p.mesh.size) == (0, 2, 2)
    p = the_plan(plan(mesh="[dp = 4] over devices[4:8]"))
    assert (p.mesh.first_device, p.mesh.part) == (4, 4)


def test_mesh_over_nodes_slice():
    p = the_plan(plan(cluster="dgx_a100 x 4", mesh="[dp = 16] over nodes[2:4]"))
    assert (p.mesh.first_device, p.mesh.part) == (16, 16)


def test_mesh_over_empty_or_bad_range():
    one(plan(mesh="[dp = 2] over devices[2:2]"), "E205")
    one(plan(mesh="[dp = 2] over devices[0:]"), "E205")
    one(plan(mesh="[dp = 2] over gpus[0:2]"), "E205")
    one(plan(mesh="[dp = 8] over nodes[0:3]"), "E301")


def test_mesh_axis_problems():
    d = one(plan(mesh="[dp = 4, dp = 2]"), "E304")
    assert d.notes and d.notes[0].message == "first here"
    one(plan(mesh="[dp = 0]"), "E305")
    one(plan(mesh="[dp = -2]"), "E305")
    one(plan(mesh="[8]"), "E205")
    one(plan(mesh="[]"), "E205")
    one(plan(mesh="8"), "E205")


# ---- defaults by axis name ---------------------------------------------------------------------
def test_defaults_by_axis_name():
    p = the_plan(plan(mesh="[dp = 2, pp = 2, tp = 2]"))
    has(p.data, kind="replicate", axes=("dp",))
    has(p.tensor, style="megatron", axis="tp", sequence_parallel=False)
    has(p.stages, axis="pp", mode="evenly", virtual=1, rank_map="loop", groups=())
    has(p.schedule, name="1f1b", options={})
    assert p.context is None and p.experts is None


def has(node, **expected) -> None:
    """The IR node's fields include `expected` (a subset check that survives new fields)."""
    dump = node.model_dump()
    assert {k: dump.get(k) for k in expected} == expected, dump


def test_no_defaults_for_other_axis_names():
    p = the_plan(plan(mesh="[a = 2, b = 4]", extra="  data = zero1 over a\n  tensor = megatron over b"))
    assert (p.data.axes, p.tensor.axis) == (("a",), "b")
    assert (p.context, p.experts, p.stages, p.schedule) == (None, None, None, None)


def test_context_and_expert_defaults():
    p = the_plan(plan(mesh="[dp = 2, cp = 2, ep = 2]",
                      model="llama(layers=2, hidden=512, heads=8, seq=256, vocab=1000, experts=4)"))
    has(p.context, kind="allgather", axis="cp")  # the kind that runs on every backend
    has(p.experts, kind="alltoall", axis="ep")


def test_explicit_settings_override_defaults():
    p = the_plan(plan(mesh="[dp = 2, pp = 2, tp = 2]", extra=textwrap.dedent("""\
        data = fsdp over dp
        tensor = megatron over tp with sequence_parallel
        stages = evenly over pp with virtual = 2
        schedule = interleaved_1f1b""")))
    assert p.data.kind == "zero3"  # fsdp is zero3
    assert p.tensor.sequence_parallel is True
    assert p.stages.virtual == 2
    assert p.schedule.name == "interleaved_1f1b"


def test_none_turns_a_default_off():
    p = the_plan(plan(mesh="[dp = 4, tp = 2]", extra="  data = zero1 over [dp, tp]\n  tensor = none"))
    assert p.tensor is None and p.data.axes == ("dp", "tp")
    p = the_plan(plan(mesh="[dp = 8]", extra="  data = none\n  tensor = megatron over dp"))
    assert p.data is None and p.tensor.axis == "dp"


def test_hsdp_needs_two_axes():
    d = one(plan(extra="  data = hsdp over dp"), "E205")
    assert "two axes" in d.message and "found 1" in d.message
    p = the_plan(plan(mesh="[rep = 2, shard = 4]", extra="  data = hsdp over [rep, shard]"))
    has(p.data, kind="hsdp", axes=("rep", "shard"))
    assert p.data.zero_stage == 3


def test_unknown_axis_is_E302_with_hint():
    d = one(plan(mesh="[dp = 8]", extra="  data = zero1 over dpp"), "E302")
    assert "'dpp'" in d.message
    assert d.hint.startswith("did you mean 'dp'?")
    assert d.notes and d.notes[0].message == "mesh declared"


def test_axis_used_twice_is_E303():
    one(plan(mesh="[a = 2, b = 4]", extra="  data = zero1 over [a, a]"), "E303")


def test_parallelism_without_axis_is_E306():
    one(plan(extra="  data = zero1"), "E306")


def test_bad_kind_words_are_E210():
    d = one(plan(extra="  data = zero4 over dp"), "E210")
    assert d.hint and "zero" in d.hint
    one(plan(train="{ global_batch: 64, precision: bf17 }"), "E210")


# ---- models -------------------------------------------------------------------------------------
def test_llama_defaults():
    p = the_plan(plan(model="llama(layers=2, hidden=4096, heads=32, seq=2048, vocab=32000)"))
    m = p.model
    assert (m.kind, m.kv_heads, m.ffn_hidden) == ("llama", 32, 11008)  # 2/3 * 4h rounded up to 256
    assert (m.experts, m.top_k, m.tied_embeddings) == (0, 0, False)


@pytest.mark.parametrize("hidden, ffn", [(4096, 11008), (5120, 13824), (8192, 22016), (256, 768), (100, 512)])
def test_llama_ffn_from_hidden(hidden, ffn):
    p = the_plan(plan(model=f"llama(layers=2, hidden={hidden}, heads=2, seq=128, vocab=1000)"))  # head dim even (E222)
    assert p.model.ffn_hidden == ffn
    assert p.model.ffn_hidden % 256 == 0


def test_llama_explicit_and_moe():
    m = the_plan(plan(model="llama(layers=2, hidden=4096, heads=32, kv_heads=8, ffn=14336, seq=2048, "
                            "vocab=32000, experts=8)")).model
    assert (m.kv_heads, m.ffn_hidden, m.experts, m.top_k) == (8, 14336, 8, 2)


def test_gpt_defaults():
    m = the_plan(plan()).model
    assert (m.kind, m.name, m.kv_heads, m.ffn_hidden) == ("gpt", "gpt", 16, 4096)


def test_model_family_errors_are_E212():
    d = one(plan(model="gtp(layers=1)"), "E212")
    assert d.hint.startswith("did you mean 'gpt'?")
    d = one(plan(model="gpt(layers=8, hidden=1024, heads=16, seq=1024)"), "E212")
    assert "vocab" in d.message
    d = one(plan(model="gpt(layers=8, hidden=1024, heads=16, seq=1024, vocab=1, layer=2)"), "E212")
    assert d.hint.startswith("did you mean 'layers'?")
    one(plan(model="gpt"), "E212")
    # top_k beyond experts is a shape the checker refuses (E223, tests/unit/test_model_shapes.py)
    one(plan(model="llama(layers=2, hidden=512, heads=8, seq=128, vocab=100, experts=2, top_k=4)"), "E223")


def test_named_model_takes_its_name():
    doc = ok(HEADER + f"model small = {GPT}\n" + plan(model="small").replace(HEADER, ""))
    assert [m.name for m in doc.models] == ["small"]
    assert doc.plans[0].model.name == "small"


CUSTOM = """\
model net {
  seq = 16
  layer embed { params = 100 }
  layer blocks[0:3] {
    params = 10
    flops = 20
    activations = 1 KiB
    output = 8
  }
  layer head { params = 5; output = 4 }
}
"""


def test_custom_model_layer_ranges():
    (m,) = ok(CUSTOM).models
    assert m.kind == "custom" and m.seq == 16
    assert [l.name for l in m.layers] == ["embed", "blocks.0", "blocks.1", "blocks.2", "head"]
    b = m.layers[1]
    assert (b.params, b.flops, b.activations, b.output) == (10, 20.0, 1024.0, 8)
    assert (m.layers[0].flops, m.layers[0].output) == (0.0, 0)


def test_custom_model_nested_names_and_factory():
    (m,) = ok('model net {\n  factory = "pkg.mod:build"\n  args = { width: 4, act: "gelu" }\n'
              "  layer stack[0:2].mlp { params = 1 }\n}\n").models
    assert [l.name for l in m.layers] == ["stack.0.mlp", "stack.1.mlp"]
    assert m.factory == "pkg.mod:build" and m.factory_args == {"width": 4, "act": "gelu"}


def test_custom_model_errors():
    one(CUSTOM.replace("layer head { params = 5; output = 4 }", "layer blocks[2:4] { params = 1 }"), "E202")
    one("model net {\n  layer x { flops = 1 }\n}\n", "E207")
    one("model net {\n  seq = 4\n}\n", "E207")
    one("model net {\n  layer x[0:] { params = 1 }\n}\n", "E205")
    one("model net {\n  layer x { params = 1; weight = 2 }\n}\n", "E206")


# ---- shard rules --------------------------------------------------------------------------------
SHARD = plan(mesh="[dp = 2, tp = 4]", extra=textwrap.dedent("""\
    shard layers.*.mlp.w1 = colwise over tp
    shard layers.*.mlp.w2 = rowwise over tp
    shard embed = replicate
    shard layers[0:2].attn.wq = { weight: [Shard(0) @ tp, Replicate @ dp], bias: Shard(0) @ tp }
    shard head = Shard(1) @ tp
    shard norm = [Partial @ tp]"""))


def test_shard_rules_styles():
    rules = the_plan(SHARD).shard
    assert [(r.target.text, r.style, r.axis) for r in rules[:3]] == [
        ("layers.*.mlp.w1", "colwise", "tp"), ("layers.*.mlp.w2", "rowwise", "tp"), ("embed", "replicate", None)]
    assert all(r.params == () for r in rules[:3])
    parts = rules[0].target.parts
    assert [(p.kind, p.name) for p in parts] == [("name", "layers"), ("any", None), ("name", "mlp"), ("name", "w1")]


def test_shard_rules_placements():
    rules = the_plan(SHARD).shard
    wq = rules[3]
    assert wq.style is None and wq.target.text == "layers[0:2].attn.wq"
    has(wq.target.parts[1], kind="range", lo=0, hi=2)
    weight, bias = wq.params
    assert weight.param == "weight"
    assert [(p.kind, p.axis, p.dim) for p in weight.placements] == [("shard", "tp", 0), ("replicate", "dp", None)]
    assert bias.param == "bias" and [(p.kind, p.axis, p.dim) for p in bias.placements] == [("shard", "tp", 0)]
    (head,) = rules[4].params
    assert head.param == "*" and [(p.kind, p.axis, p.dim) for p in head.placements] == [("shard", "tp", 1)]
    (norm,) = rules[5].params
    assert [(p.kind, p.axis) for p in norm.placements] == [("partial", "tp")]


def test_shard_rule_errors():
    one(plan(mesh="[dp = 2, tp = 4]", extra="  shard head = [Shard(0) @ tp, Shard(1) @ tp]"), "E303")
    d = one(plan(mesh="[dp = 2, tp = 4]", extra="  shard head = Shrd(0) @ tp"), "E408")
    assert d.hint.startswith("did you mean 'Shard'?")
    one(plan(mesh="[dp = 2, tp = 4]", extra="  shard head = Shard(0)"), "E408")
    one(plan(mesh="[dp = 2, tp = 4]", extra="  shard head = colwise over tpp"), "E302")


# ---- schedules -----------------------------------------------------------------------------------
TABLE = """\
schedule tiny(ranks = 2, microbatches = 2) {
  rank 0: 0F0 0F1 _ 0B0 0B1
  rank 1: _ 1F0 1F1 1B0 1B1
}
"""


def test_schedule_table_rows():
    (s,) = ok(TABLE).schedules
    assert (s.name, s.kind) == ("tiny", "table")
    assert s.sizes == {"ranks": 2, "microbatches": 2}
    assert s.rows == (("0F0", "0F1", "_", "0B0", "0B1"), ("_", "1F0", "1F1", "1B0", "1B1"))


def test_schedule_table_rows_in_rank_order():
    (s,) = ok(TABLE.replace("rank 0: 0F0 0F1 _ 0B0 0B1\n  rank 1: _ 1F0 1F1 1B0 1B1",
                            "rank 1: _ 1F0\n  rank 0: 0F0 _")).schedules
    assert s.rows == (("0F0", "_"), ("_", "1F0"))


def test_schedule_errors():
    one(TABLE.replace("rank 1:", "rank 0:"), "E202")
    one(TABLE.replace("ranks = 2", "rank = 2"), "E210")
    d = one(plan(mesh="[dp = 4, pp = 2]", extra="  schedule = gpipee"), "E601")
    assert d.hint.startswith("did you mean 'gpipe'?")


def test_plan_uses_a_user_schedule():
    p = the_plan(plan(pre=TABLE, mesh="[dp = 4, pp = 2]", extra="  schedule = tiny",
                      train="{ global_batch: 8 }"))
    assert p.schedule.name == "tiny"


# ---- duplicate definitions ---------------------------------------------------------------------
@pytest.mark.parametrize("text", [
    "param n = 1\nparam n = 2\n",
    "let a = 1\nlet a = 2\n",
    "param a = 1\nlet a = 2\n",
    f"model m = {GPT}\nmodel m = {GPT}\n",
    "device d { memory = 1 GiB\n bandwidth = 1 GB/s\n peak = {bf16: 1 TFLOP/s} }\n"
    "node d { devices = 1 x d\n link = {bandwidth: 1 GB/s} }\n",
])
def test_duplicate_definition_is_E202_with_note(text):
    d = one(text, "E202")
    assert "defined twice" in d.message
    (note,) = d.notes
    assert note.message == "first defined" and note.span is not None and note.span.line == 1
    assert d.span.line > note.span.line


def test_duplicate_attribute_is_E213():
    d = one(plan(train="{ global_batch: 64, global_batch: 32 }"), "E213")
    assert d.notes
    one(device().replace("  memory    = 80 GiB\n", "  memory = 80 GiB\n  memory = 40 GiB\n"), "E213")


def test_missing_and_unknown_attributes():
    one(HEADER + "plan p {\n  model = " + GPT + "\n}\n", "E207")
    d = one(plan(extra="  tensr = megatron over tp"), "E206")
    assert d.hint.startswith("did you mean 'tensor'?")


# ---- imports -----------------------------------------------------------------------------------
def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text), encoding="utf-8")


def test_imports_relative_to_the_file_and_from_stdlib(tmp_path, monkeypatch):
    _write(tmp_path, {
        "proj/main.plan": plan(model="m", pre='import "lib/models"\n'),
        "proj/lib/models.plan": 'import "sizes.plan"\n'
                                'model m = gpt(layers=L, hidden=1024, heads=16, seq=1024, vocab=50304)\n',
        "proj/lib/sizes.plan": "param L = 6\n",
    })
    monkeypatch.chdir(tmp_path / "proj" / "lib")  # resolution must not depend on the working directory
    analysis = analyze(str(tmp_path / "proj" / "main.plan"))
    assert analysis.ok, [(d.code, d.message) for d in analysis.diagnostics]
    (p,) = analysis.document.plans
    assert p.model.name == "m" and p.model.layers == 6
    assert p.cluster.groups[0].node.name == "dgx_a100"  # from the standard library
    files = sorted(Path(f).name for f in analysis.sources)
    assert files == ["dgx_a100.plan", "local.plan", "main.plan", "models.plan", "sizes.plan"]


def test_a_local_file_shadows_the_stdlib(tmp_path):
    _write(tmp_path, {
        "clusters/dgx_a100.plan": "node dgx_a100 {\n  devices = 2 x cpu\n  link = { bandwidth: 1 GB/s }\n}\n"
                                  'import "clusters/local"\n',
        "main.plan": 'import "clusters/dgx_a100"\n' + plan(mesh="[dp = 2]", train="{ global_batch: 64, recompute: full }")
        .replace(HEADER, ""),  # full recomputation: it fits the CPU devices beside autocast's copies of the weights
    })
    analysis = analyze(str(tmp_path / "main.plan"))
    assert analysis.ok, [(d.code, d.message) for d in analysis.diagnostics]
    assert analysis.document.plans[0].cluster.num_devices == 2


def test_import_is_loaded_once(tmp_path):
    _write(tmp_path, {"a.plan": 'import "c"\nimport "b"\n', "b.plan": 'import "c"\n', "c.plan": "let x = 1\n"})
    analysis = analyze(str(tmp_path / "a.plan"))
    assert analysis.ok
    assert len(analysis.sources) == 3


def test_import_cycle_is_E209(tmp_path):
    _write(tmp_path, {"a.plan": 'import "b"\nlet x = 1\n', "b.plan": 'import "c.plan"\n',
                      "c.plan": 'import "a"\n'})
    analysis = analyze(str(tmp_path / "a.plan"))
    (d,) = [d for d in analysis.errors if d.code == "E209"]
    names = [Path(part.strip()).name for part in d.message.split(":", 1)[1].split("->")]
    assert names == ["a.plan", "b.plan", "c.plan", "a.plan"]
    assert Path(d.span.file).name == "c.plan"
    assert len(d.notes) == 2


def test_self_import_is_E209(tmp_path):
    _write(tmp_path, {"a.plan": 'import "a"\n'})
    one_analysis = analyze(str(tmp_path / "a.plan"))
    assert [d.code for d in one_analysis.errors] == ["E209"]


def test_missing_import_is_E208(tmp_path):
    _write(tmp_path, {"a.plan": 'import "nothere"\n'})
    analysis = analyze(str(tmp_path / "a.plan"))
    (d,) = analysis.errors
    assert d.code == "E208" and '"nothere"' in d.message
    assert d.span.line == 1 and Path(d.span.file).name == "a.plan"
    assert d.notes and "standard library" in d.notes[0].message


def test_misspelled_stdlib_import_gets_a_hint():
    d = one('import "clusters/dgx_a10"\n', "E208")
    assert d.hint and d.hint.startswith("did you mean 'clusters/"), d.hint
    d = one('import "dgx_a100"\n', "E208")
    assert d.hint.startswith("did you mean 'clusters/dgx_a100'?")


def test_syntax_error_in_an_import_is_reported_in_that_file(tmp_path):
    _write(tmp_path, {"a.plan": 'import "b"\n', "b.plan": "plan {\n"})
    analysis = analyze(str(tmp_path / "a.plan"))
    (d,) = analysis.errors
    assert d.code.startswith("E1") and Path(d.span.file).name == "b.plan"


# ---- device efficiency (the cost model's GEMM knobs) ----------------------------------------------------
EFF_DEVICE = "device g {{ memory = 80 GiB; bandwidth = 2 TB/s; peak = {{ bf16: 312 TFLOP/s }}{extra} }}\n"


NO_TABLES = {"measured": (), "precisions": {}, "attention": None, "attention_backward": None}  # all optional


def test_device_efficiency_keys_and_defaults():
    [device] = ok(EFF_DEVICE.format(extra="; efficiency = { matmul: 0.5, kernel_latency: 30 us }")).devices
    assert device.efficiency.model_dump() == {"matmul": 0.5, "kernel_latency": 30e-6, **NO_TABLES}
    [device] = ok(EFF_DEVICE.format(extra="; efficiency = { matmul: 0.5 }")).devices
    assert device.efficiency.model_dump() == {"matmul": 0.5, "kernel_latency": 18e-6, **NO_TABLES}
    [device] = ok(EFF_DEVICE.format(extra="")).devices
    assert device.efficiency is None  # the cost model uses ir.DeviceEfficiency()'s defaults
    # the fused attention kernel's two fractions, each optional; per precision like the GEMM knobs
    [device] = ok(EFF_DEVICE.format(extra="; efficiency = { attention: 0.337, attention_backward: 0.322 }")).devices
    assert (device.efficiency.attention, device.efficiency.attention_backward, device.efficiency.matmul) == \
        (0.337, 0.322, 0.64)
    [device] = ok(EFF_DEVICE.format(extra="; efficiency = { attention: 0.5, bf16: { matmul: 0.7 } }")).devices
    assert device.efficiency.precisions[ir.Precision.bf16].attention == 0.5
    # the kernel's speed by sequence, as ratios to those fractions, sorted by tokens, inherited as the other keys
    [device] = ok(EFF_DEVICE.format(extra="; efficiency = { attention: 0.3, attention_by_sequence: [[8192, 1], "
                                          "[2048, 0.8]], bf16: { matmul: 0.7 } }")).devices
    assert [(p.tokens, p.ratio) for p in device.efficiency.attention_by_sequence] == [(2048, 0.8), (8192, 1.0)]
    assert device.efficiency.precisions[ir.Precision.bf16].attention_by_sequence == \
        device.efficiency.attention_by_sequence
    assert "attention_by_sequence" not in ok(EFF_DEVICE.format(extra="; efficiency = { attention: 0.3 }")) \
        .devices[0].efficiency.model_dump()  # without it a device dumps (and hashes) as before it existed
    # The stdlib's A100 states the fit it was calibrated with.
    cluster = ok(plan()).plans[0].cluster
    assert cluster.groups[0].node.device.efficiency.model_dump() == {"matmul": 0.64, "kernel_latency": 18e-6, **NO_TABLES}


@pytest.mark.parametrize("value, code, words", [
    ("{ matmul: 1.2 }", "E205", "in (0, 1], found 1.2"),
    ("{ matmul: 0 }", "E205", "in (0, 1], found 0"),
    ("{ matmul: -0.5 }", "E205", "in (0, 1], found -0.5"),
    ("{ attention: 1.5 }", "E205", "attention is a fraction of the peak in (0, 1], found 1.5"),
    ("{ attention_backward: 0 }", "E205", "attention_backward is a fraction of the peak in (0, 1], found 0"),
    ("{ kernel_latency: -5 us }", "E205", "kernel_latency must be zero or more"),
    ("{ kernel_latency: 5 GB }", "E203", "takes a time quantity"),
    ("{ matmull: 0.5 }", "E206", "no key 'matmull'"),
    ("0.5", "E205", "takes `{ key: value, ... }`"),
    ("{ attention: 0.3, attention_by_sequence: 2 }", "E205", "takes 1 to 256 rows [tokens, ratio]"),
    ("{ attention: 0.3, attention_by_sequence: [[2048]] }", "E205", "row is [tokens, ratio], found `[2048]`"),
    ("{ attention: 0.3, attention_by_sequence: [[0.5, 1]] }", "E205", "tokens is a positive whole number"),
    ("{ attention: 0.3, attention_by_sequence: [[2048, 0]] }", "E205", "ratio is above 0, found 0"),
    ("{ attention: 0.3, attention_by_sequence: [[2048, 1], [2048, 0.9]] }", "E205", "2,048 tokens twice"),
    ("{ attention: 0.6, attention_by_sequence: [[2048, 2]] }", "E205", "to 1.2 of the peak, above 1"),
    ("{ attention_by_sequence: [[2048, 1]] }", "E207", "the device states no `attention`"),
    ("{ bf16: { attention_by_sequence: [[2048, 1]] } }", "E207", "bf16 has no `attention`"),
])
def test_bad_device_efficiency_is_a_coded_error(value, code, words):
    diagnostic = one(EFF_DEVICE.format(extra=f"; efficiency = {value}"), code)
    assert words in diagnostic.message


# ---- the data-parallel kind: one enum, its ZeRO stage, its spellings ---------------------------
@pytest.mark.parametrize("written,kind,stage", [("replicate", "replicate", 0), ("ddp", "replicate", 0),
                                                ("zero1", "zero1", 1), ("zero2", "zero2", 2), ("zero3", "zero3", 3),
                                                ("fsdp", "zero3", 3)])
def test_a_data_kind_lowers_to_the_enum_with_its_zero_stage(written, kind, stage):
    data = the_plan(plan(extra=f"  data    = {written} over dp")).data
    assert data.kind is ir.DataKind(kind) and data.zero_stage == stage and f"{data.kind}" == kind
    assert ir.DataKind.of_zero_stage(stage) is data.kind  # what the search writes for the stage reads back
    assert data.sharded == (stage >= 2) and not data.hybrid


def test_hsdp_is_zero3_over_its_shard_axis():
    data = the_plan(plan(mesh="[dp = 2, shard = 4]", extra="  data    = hsdp over [dp, shard]")).data
    assert data.kind is ir.DataKind.hsdp and data.zero_stage == 3 and data.hybrid and data.sharded
    assert ir.ZERO_STAGES == tuple(sorted({k.zero_stage for k in ir.DataKind})) == (0, 1, 2, 3)


def test_a_built_in_schedule_takes_no_options():
    """`interleaved_1f1b(virtual = 5)` used to lower with the option recorded and then ignored (the stages kept
    virtual 1, the schedule ran as 1F1B): now E206, whose hint says where virtual stages are set."""
    text = plan(mesh="[dp = 2, pp = 4]", extra="  schedule = interleaved_1f1b(virtual = 5)")
    error = one(text, "E206")
    assert "takes no options" in error.message and "with virtual = N" in error.hint
    other = one(plan(mesh="[dp = 2, pp = 4]", extra="  schedule = 1f1b(microbatches = 8)"), "E206")
    assert "'microbatches' would be ignored" in other.message and "schedule = 1f1b`" in other.hint
    assert the_plan(plan(mesh="[dp = 2, pp = 4]", extra="  stages = evenly over pp with virtual = 2\n"
                                                        "  schedule = interleaved_1f1b")).stages.virtual == 2


def test_a_schedule_takes_no_positional_arguments():
    """`interleaved_1f1b(5)` lowered with the 5 dropped, as the named option was before E206 held it."""
    error = one(plan(mesh="[dp = 2, pp = 4]", extra="  schedule = interleaved_1f1b(5)"), "E206")
    assert "'5' would be ignored" in error.message and "with virtual = N" in error.hint


def test_a_written_schedule_takes_no_options():
    """`gpipe_template(virtual = 2)` lowered with the option recorded and never read: the template's variables are
    bound to the plan's sizes."""
    text = plan(mesh="[dp = 2, pp = 4]", extra="  stages = evenly over pp\n  schedule = gpipe_template(virtual = 2)",
                pre='import "schedules/gpipe"\n')
    error = one(text, "E206")
    assert "written schedule 'gpipe_template' takes no options ('virtual' would be ignored)" in error.message
    assert "`NAME: ranks`" in error.hint


def test_an_option_given_twice_is_E213_and_none_takes_no_options():
    """`with overlap, overlap` kept the last silently, and `experts = none with overlap` (or `tensor = none with
    sequence_parallel`) dropped the option without a word: the kind `none` has nothing to set it on."""
    twice = one(plan(mesh="[dp = 2, tp = 4]", extra="  tensor = megatron over tp with sequence_parallel, "
                                                     "sequence_parallel"), "E213")
    assert twice.message == "option 'sequence_parallel' is given twice" and twice.notes[0].message == "first given"
    dropped = one(plan(mesh="[dp = 2, tp = 4]", extra="  tensor = none with sequence_parallel"), "E206")
    assert "tensor = none takes no options ('sequence_parallel' would set nothing)" in dropped.message
    assert the_plan(plan(mesh="[dp = 2, tp = 4]", extra="  tensor = megatron over tp with sequence_parallel")) \
        .tensor.sequence_parallel


def test_a_precisions_own_curve_needs_an_attention_for_that_precision():
    """A precision's own `attention_by_sequence` scales that precision's `attention` (its own, or the device's it
    inherits): with neither, the curve scaled nothing and was dropped without a word while another precision stated
    an `attention` (the device-wide E207 only asked for one anywhere); now E207 at the precision's key."""
    device = ("device g {{ memory = 80 GiB; bandwidth = 2 TB/s; peak = {{ bf16: 312 TFLOP/s, fp16: 312 TFLOP/s }}; "
              "efficiency = {{ {body} }} }}\n")
    diagnostic = one(device.format(body="bf16: { attention: 0.5 }, fp16: { attention_by_sequence: [[2048, 0.5]] }"),
                     "E207")
    assert "attention_by_sequence for fp16" in diagnostic.message and "no `attention`" in diagnostic.message
    for body in ("attention: 0.5, fp16: { attention_by_sequence: [[2048, 0.5]] }",
                 "fp16: { attention: 0.5, attention_by_sequence: [[2048, 0.5]] }",
                 "attention_by_sequence: [[2048, 0.5]], bf16: { attention: 0.5 }"):  # the device's: bf16 reads it
        [found] = ok(device.format(body=body)).devices
        assert found.efficiency is not None, body
