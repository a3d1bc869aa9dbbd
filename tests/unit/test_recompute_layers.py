"""`recompute_layers: N` (Megatron's --recompute-method block --recompute-num-layers N): the first N blocks
of each stage (virtual chunk) are recomputed in full, the others keep their activations.

Against the two modes it lies between: N = 0 gives `recompute: none`'s memory, time and FLOPs, N = the
blocks of a stage gives `recompute: full`'s, and in between the recomputed FLOPs grow by one block's
forward per stage for each N while the activations kept shrink by one block's difference per stage.
"""
from __future__ import annotations

import pytest

from plandsl import api, ir
from plandsl.cost.estimate import estimate_plan
from plandsl.cost.memory import layer_recompute
from plandsl.interop import export_plan, import_text
from plandsl.ir.placement import assign_stages

PLAN = """\
import "clusters/dgx_a100"
plan p {{
  model    = gpt(layers=16, hidden=1024, heads=16, seq=1024, vocab=51200)
  cluster  = dgx_a100 x 2
  mesh     = [dp = 2, pp = 4, tp = 2]
  train    = {{ global_batch: 64, micro_batch: 2, {train} }}
  data     = zero1 over dp
  stages   = evenly over pp{virtual}
  schedule = {schedule}
}}
"""
PER_STAGE = {"": 4, " with virtual = 2": 2}  # blocks per stage (virtual chunk): 16 blocks over 4 or 8 stages
SCHEDULES = {"": "1f1b", " with virtual = 2": "interleaved_1f1b"}


def _estimate(train: str, virtual: str = ""):
    plan = api.loads(PLAN.format(train=train, virtual=virtual, schedule=SCHEDULES[virtual])).plans[0]
    return plan, estimate_plan(plan)


def _figures(e) -> tuple:
    return (e.flops_per_step, e.time.step, *(m.activations for m in e.memory),
            *(t for s in e.stage_times for t in (s.forward, s.backward)))


@pytest.mark.parametrize("virtual", list(PER_STAGE))
def test_zero_layers_is_none_and_all_layers_is_full(virtual):
    none = _figures(_estimate("recompute: none", virtual)[1])
    full = _figures(_estimate("recompute: full", virtual)[1])
    assert none != full
    assert _figures(_estimate("recompute: full, recompute_layers: 0", virtual)[1]) == pytest.approx(none)
    per_stage = PER_STAGE[virtual]
    assert _figures(_estimate(f"recompute: full, recompute_layers: {per_stage}", virtual)[1]) == pytest.approx(full)
    # more than a stage holds recomputes every block, as Megatron's loop does
    assert _figures(_estimate(f"recompute: full, recompute_layers: {per_stage + 1}", virtual)[1]) == pytest.approx(full)


@pytest.mark.parametrize("virtual", list(PER_STAGE))
def test_each_layer_moves_one_block_per_stage_from_kept_to_recomputed(virtual):
    per_stage = PER_STAGE[virtual]
    none = _estimate("recompute: none", virtual)[1]
    full = _estimate("recompute: full", virtual)[1]
    for n in range(per_stage + 1):
        plan, e = _estimate(f"recompute: full, recompute_layers: {n}", virtual)
        share = n / per_stage
        # FLOPs: linear in n, one block's forward per stage per layer
        assert e.flops_per_step == pytest.approx(none.flops_per_step + share * (full.flops_per_step
                                                                               - none.flops_per_step), rel=1e-12)
        for stage, nn_, ff in zip(e.stage_times, none.stage_times, full.stage_times):
            assert stage.forward == pytest.approx(nn_.forward)  # the forward pass is the same
            assert stage.backward == pytest.approx(nn_.backward + share * (ff.backward - nn_.backward))
        # memory: the kept activations fall linearly (no working set for n = 0, one block's otherwise)
        for mem, mn, mf in zip(e.memory, none.memory, full.memory):
            assert mf.activations <= mem.activations <= mn.activations
        assert all(m.params == mn.params for m, mn in zip(e.memory, none.memory))
        assignment, _ = assign_stages(plan)
        for layers in assignment.stage_layers:
            modes = [mode for layer, mode in zip(layers, layer_recompute(plan, layers)) if layer.kind == "block"]
            assert modes == [ir.Recompute.full] * n + [ir.Recompute.none] * (per_stage - n)


def test_the_kept_activations_fall_by_one_block_per_layer():
    # rank 0 of 1f1b keeps pp microbatches in flight: every step of n frees pp x (block none - block full)
    steps = [_estimate(f"recompute: full, recompute_layers: {n}")[1].memory[0].activations for n in range(1, 5)]
    drops = [a - b for a, b in zip(steps, steps[1:])]
    assert drops[0] > 0 and drops == pytest.approx([drops[0]] * 3)


@pytest.mark.parametrize("train, code, words", [
    ("recompute: selective, recompute_layers: 2", "E205", "recompute: full"),
    ("recompute_layers: 2", "E205", "with recompute none"),
    ("recompute: full, recompute_layers: -1", "E205", "at least 0"),
    ("recompute: full, recompute_layers: 1000000", "E505", "at most"),
    ("recompute: full, recompute_layers: 17", "E205", "16 blocks"),
    ("recompute: full, recompute_layer: 2", "E206", "recompute_layers"),
])
def test_bad_recompute_layers_are_diagnostics(train, code, words):
    analysis = api.checks(PLAN.format(train=train, virtual="", schedule="1f1b"))
    assert [d.code for d in analysis.errors] == [code], [str(d) for d in analysis.errors]
    assert words in analysis.errors[0].message + (analysis.errors[0].hint or "")


def test_show_says_which_blocks_recompute():
    plan = _estimate("recompute: full, recompute_layers: 2")[0]
    assert "recompute full (first 2 blocks per stage)" in api.describe(api.loads(
        PLAN.format(train="recompute: full, recompute_layers: 2", virtual="", schedule="1f1b")), [plan])


@pytest.mark.parametrize("count, flags", [(2, "--recompute-granularity full --recompute-method block "
                                              "--recompute-num-layers 2"), (0, None)])
def test_megatron_block_method_both_ways(count, flags):
    plan = _estimate(f"recompute: full, recompute_layers: {count}")[0]
    exported = export_plan(plan, "megatron")
    assert not exported.lost
    text = " ".join(line.strip() for line in exported.text.splitlines() if not line.startswith("#"))
    if flags is None:  # none recomputed: Megatron's default, no flag
        assert "--recompute" not in text
        return
    assert flags in text
    imported = import_text("megatron", exported.text, "plan.args", world_size=plan.mesh.size, name=plan.name)
    assert imported.ok, [str(d) for d in imported.diagnostics]
    back = api.select_plan(api.loads(imported.text, path="back.plan"))
    assert (back.train.recompute, back.train.recompute_layers) == (ir.Recompute.full, count)


def test_diff_names_the_change():
    from plandsl.rewrite.diff import changes
    a = _estimate("recompute: full")[0]
    b = _estimate("recompute: full, recompute_layers: 2")[0]
    assert [(c.field, c.old, c.new) for c in changes(a, b)] == [("train.recompute_layers", None, 2)]
