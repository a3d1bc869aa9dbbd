"""`plandsl diff`: golden text and JSON diffs, identical plans, plans over other models or clusters, bad input,
and the properties (a plan against itself is identical; A->B and B->A list the same fields, old and new swapped)."""
from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from plandsl import api
from plandsl.rewrite.diff import changes, diff_plans, moved_layers, predictions
from tests.support import cli_in_process

ROOT = Path(__file__).resolve().parents[2]
DP, ZERO1 = "stdlib_plans/local/dp.plan", "stdlib_plans/local/zero1.plan"
GPT3, GPT3_TP4_PP32 = "stdlib_plans/examples/gpt3_175b_3d.plan", "tests/golden/diff/gpt3_tp4_pp32.plan"


@cache
def _stdlib_plans() -> tuple:
    """Every plan of the standard library: (file, plan)."""
    found = []
    for path in sorted((ROOT / "stdlib_plans").rglob("*.plan")):
        found += [(str(path.relative_to(ROOT)), plan) for plan in api.load(path).plans]
    return tuple(found)


@cache
def _estimate(index: int):
    return api.estimate(_stdlib_plans()[index][1])


# ---- golden -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("a, b, name", [(DP, ZERO1, "dp_zero1"), (GPT3, GPT3_TP4_PP32, "gpt3_tp4_pp32")])
def test_golden_text_and_json(golden, a, b, name):
    text = cli_in_process("diff", a, b, cwd=ROOT)
    assert (text.returncode, text.stderr) == (0, "")
    golden(f"diff/{name}.txt", text.stdout)
    as_json = cli_in_process("diff", a, b, "--format", "json", cwd=ROOT)
    assert (as_json.returncode, as_json.stderr) == (0, "")
    golden(f"diff/{name}.json", as_json.stdout)


def test_dp_to_zero1_is_the_data_kind_and_saves_memory():
    found = json.loads(cli_in_process("diff", DP, ZERO1, "--format", "json", cwd=ROOT).stdout)
    assert found["changes"] == [{"section": "sharding", "field": "data.kind", "old": "replicate", "new": "zero1"}]
    assert found["moved_layers"] == [] and not found["identical"]
    memory = next(p for p in found["predictions"] if p["metric"] == "peak_memory_bytes")
    assert memory["new"] < memory["old"] and memory["comparable"]  # ZeRO-1 shards the optimizer states


def test_gpt3_repartition_moves_every_block_and_lists_each_degree_once():
    a, b = api.load_plan(ROOT / GPT3), api.load_plan(ROOT / GPT3_TP4_PP32)
    diff = diff_plans(a, b)
    fields = [c.field for c in diff.changes]
    assert fields == ["mesh.dp", "mesh.pp", "mesh.tp", "microbatches"]
    assert [(c.old, c.new) for c in diff.changes] == [(16, 8), (8, 32), (8, 4), (96, 192)]
    moved = {name: (m.old, m.new) for m in diff.moved for name in m.layers}
    assert moved["layers.2"] == ((0, 0), (1, 1)) and moved["head"] == ((15, 7), (63, 31))
    assert "embed" not in moved and "layers.0" not in moved  # stage 0 on rank 0 in both
    assert len([n for n in moved if n.startswith("layers.")]) == 94


# ---- identical, not comparable ------------------------------------------------------------------------
def test_identical_plans_say_so_and_exit_0():
    result = cli_in_process("diff", DP, DP, cwd=ROOT)
    assert result.returncode == 0
    assert result.stdout.startswith(f"plans 'tiny_dp' ({DP}) and 'tiny_dp' ({DP}) are identical")
    found = json.loads(cli_in_process("diff", DP, DP, "--format", "json", cwd=ROOT).stdout)
    assert found["identical"] and found["changes"] == [] and found["moved_layers"] == []
    assert all(p["change"] == 0 for p in found["predictions"])


def test_other_model_and_cluster_are_diffed_and_predictions_marked_not_comparable():
    diff = diff_plans(api.load_plan(ROOT / DP), api.load_plan(ROOT / GPT3))
    fields = {c.field for c in diff.changes}
    assert {"model", "cluster", "mesh.order", "mesh.dp", "mesh.pp", "mesh.tp", "data.kind"} <= fields
    assert all(not p.comparable and p.why == "the plans train different models" for p in diff.predictions)
    plan = api.load_plan(ROOT / DP)
    other = plan.model_copy(update={"cluster": api.load_plan(ROOT / GPT3).cluster})
    marked = {p.metric: p.comparable for p in diff_plans(plan, other).predictions}
    assert marked == {"step_time_s": False, "tokens_per_s": False, "peak_memory_bytes": True, "exposed_comm_s": False,
                      "comm_bytes": True}


def test_a_model_of_the_same_name_lists_the_fields_that_differ():
    plan = api.load_plan(ROOT / DP)
    wider = plan.model_copy(update={"model": plan.model.model_copy(update={"hidden": 128})})
    diff = diff_plans(plan, wider)
    assert [(c.field, c.old, c.new) for c in diff.changes] == [("model.hidden", 64, 128)]
    assert not any(p.comparable for p in diff.predictions)



def test_the_implementation_keys_are_changes():
    """`train.kernels`, `train.attention` and `experts ... with overlap` change the step a plan is priced at: a diff
    lists them (it said "1 change(s)", the model's head_dim, for a plan that also turned all three on)."""
    text = """import "clusters/dgx_h100"
plan p {
  model    = llama(layers=2, hidden=256, heads=8, seq=256, vocab=1024, ffn=128, experts=8, top_k=2)
  cluster  = dgx_h100
  mesh     = [ep = 8]
  train    = { global_batch: 16, micro_batch: 1 }
  experts  = alltoall over ep
}
"""
    plain = api.loads(text).plans[0]
    other = api.loads(text.replace("micro_batch: 1 }", "micro_batch: 1, kernels: eager, attention: materialized }")
                      .replace("over ep\n", "over ep with overlap\n")).plans[0]
    assert [(c.field, c.old, c.new) for c in diff_plans(plain, other).changes] == \
        [("experts.overlap", False, True), ("train.kernels", "fused", "eager"), ("train.attention", "flash",
                                                                               "materialized")]
    assert not diff_plans(plain, plain).changes
    dense = text.replace("experts=8, top_k=2", "").replace(", ffn=128, ", ", ffn=128").replace("[ep = 8]", "[tp = 8]") \
        .replace("experts  = alltoall over ep", "tensor   = megatron over tp with sequence_parallel")
    overlapped = dense.replace("sequence_parallel\n", "sequence_parallel, overlap\n")
    assert [(c.field, c.old, c.new) for c in diff_plans(api.loads(dense).plans[0],
                                                        api.loads(overlapped).plans[0]).changes] == \
        [("tensor.overlap", False, True)]
    # whose tensor parallelism runs the layers changes what a block saves under sequence parallelism (it diffed as
    # identical); userbuffers' overlap implies Megatron-LM's
    megatron = dense.replace("sequence_parallel\n", "sequence_parallel, implementation = megatron\n")
    assert [(c.field, c.old, c.new) for c in diff_plans(api.loads(dense).plans[0],
                                                        api.loads(megatron).plans[0]).changes] == \
        [("tensor.stack", "torch", "megatron")]
    userbuffers = dense.replace("sequence_parallel\n", "sequence_parallel, overlap = userbuffers\n")
    assert ("tensor.stack", "torch", "megatron") in [(c.field, c.old, c.new) for c in diff_plans(
        api.loads(dense).plans[0], api.loads(userbuffers).plans[0]).changes]
    assert not diff_plans(api.loads(megatron).plans[0], api.loads(megatron).plans[0]).changes

# ---- bad input ----------------------------------------------------------------------------------------
def test_a_file_that_does_not_check_is_the_checkers_diagnostics(tmp_path):
    bad = tmp_path / "bad.plan"
    bad.write_text('import "clusters/local"\nplan p {\n  model = nothing\n}\n')
    result = cli_in_process("diff", str(bad), str(ROOT / DP))
    assert result.returncode == 1 and "error[E" in result.stderr and "Traceback" not in result.stderr
    lines = cli_in_process("diff", str(ROOT / DP), str(bad), "--format", "json").stdout.splitlines()
    assert lines and all(json.loads(line)["code"].startswith("E") for line in lines)


def test_a_missing_plan_name_is_a_diagnostic():
    result = cli_in_process("diff", DP, ZERO1, "--plan-b", "nope", cwd=ROOT)
    assert result.returncode == 1 and "nope" in result.stderr and "tiny_zero1" in result.stderr
    assert "Traceback" not in result.stderr
    missing = cli_in_process("diff", DP, "no/such.plan", cwd=ROOT)
    assert missing.returncode == 1 and "Traceback" not in missing.stderr and "error[E" in missing.stderr


def test_plan_options_pick_plans():
    result = cli_in_process("diff", DP, ZERO1, "--plan-a", "tiny_dp", "--plan-b", "tiny_zero1", cwd=ROOT)
    assert result.returncode == 0 and "data.kind" in result.stdout


# ---- properties ---------------------------------------------------------------------------------------
def test_every_stdlib_plan_against_itself_is_identical():
    plans = _stdlib_plans()
    assert len(plans) >= 20
    for index, (path, plan) in enumerate(plans):
        diff = diff_plans(plan, plan)
        assert diff.identical, (path, plan.name, diff.changes, diff.moved)
        assert all(p.change == 0 and p.comparable for p in diff.predictions), (path, plan.name)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_diff_is_antisymmetric(data):
    """diff(B, A) lists the same fields and moved layers as diff(A, B), old and new swapped, and the same
    predictions swapped (estimates cached per plan: the property is the comparison's, not the cost model's)."""
    count = len(_stdlib_plans())
    i, j = data.draw(st.integers(0, count - 1)), data.draw(st.integers(0, count - 1))
    a, b = _stdlib_plans()[i][1], _stdlib_plans()[j][1]
    forward = {c.field: (c.section, c.old, c.new) for c in changes(a, b)}
    backward = {c.field: (c.section, c.new, c.old) for c in changes(b, a)}
    assert forward == backward
    ahead = {(name, m.old, m.new) for m in moved_layers(a, b) for name in m.layers}
    back = {(name, m.new, m.old) for m in moved_layers(b, a) for name in m.layers}
    assert ahead == back
    there = predictions(a, b, _estimate(i), _estimate(j))
    again = predictions(b, a, _estimate(j), _estimate(i))
    assert [(p.metric, p.old, p.new, p.comparable, p.why) for p in there] == \
           [(p.metric, p.new, p.old, p.comparable, p.why) for p in again]
    assert (i == j) <= (not forward and not ahead)



# ---- the documentation ----------------------------------------------------------------------------------
def test_the_cli_doc_names_every_field_and_metric_and_quotes_the_golden_figures():
    from plandsl.rewrite.diff import FIELDS, METRICS
    doc = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    section = doc[doc.index("## `plandsl diff"):doc.index("## `plandsl inspect")]
    for _, field, _ in FIELDS:
        assert f"`{field}`" in section, field
    for metric, *_ in METRICS:
        assert f'"{metric}"' in section, metric
    golden = (ROOT / "tests" / "golden" / "diff" / "gpt3_tp4_pp32.txt").read_text(encoding="utf-8")
    assert "28.52 s -> 33.87 s" in golden and "28.52 s -> 33.87 s" in section
    small = (ROOT / "tests" / "golden" / "diff" / "dp_zero1.txt").read_text(encoding="utf-8")
    assert "4.2 MiB -> 3.3 MiB" in small and "4.2 MiB -> 3.3 MiB" in section
