"""The dtype the search's plans gather their parameters in (`search.problem.Problem.gather_dtype`): ZeRO-2/3 in the
compute precision over fp32 weights at bf16 or fp16, as torchtitan runs FSDP2 (`MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)`) and `plandsl run` applies it, so the written plan says `with gather = bf16` and its memory holds the
units in 16 bits and no autocast copy of the weights; ZeRO-1 the weights as they are kept; a given gathering as given.
The choice moves no second of the step: the time prices gathers without a dtype at the compute precision already."""
from __future__ import annotations

import textwrap

import pytest

from plandsl import api, ir
from plandsl.cost.compute import DEFAULT_EFFICIENCY
from plandsl.cost.estimate import estimate_plan
from plandsl.cost.memory import estimate_layer_activations
from plandsl.search import Problem, brute_force, build_plan, search
from plandsl.search.emit import Source, plan_text
from plandsl.search.space import Space
from plandsl.search.tree import candidate_of

HARDWARE = """
device gpu { memory = 16 GiB; bandwidth = 1000 GB/s; peak = { bf16: 200 TFLOP/s, fp16: 200 TFLOP/s, fp32: 20 TFLOP/s } }
node box { devices = 2 x gpu; link = { bandwidth: 100 GB/s, latency: 2 us }; nic = { bandwidth: 20 GB/s, latency: 5 us } }
cluster pair = box x 2
"""
GPT = "gpt(layers=4, hidden=1024, heads=16, seq=512, vocab=8192)"
MOE = "llama(layers=2, hidden=256, heads=4, kv_heads=2, seq=256, vocab=1024, experts=4, top_k=2)"
FSDP = {"dp": 4, "tp": 1, "pp": 1, "cp": 1, "ep": 1, "micro_batch_size": 1, "recompute": "none"}


def problem(model: str = GPT, **fields) -> Problem:
    document = api.loads(HARDWARE + f"model m = {model}\n")
    return Problem(document.models[0], document.clusters[0], 8, **fields)


def best(p: Problem, zero: int):
    return search(p, pins={**FSDP, "zero_stage": zero}, top=1).best


def test_a_zero3_bf16_plan_gathers_bf16_and_its_memory_is_the_lower_figure():
    chosen = best(problem(), 3)
    assert chosen.plan.data.gather is ir.Precision.bf16 and chosen.plan.run_gather is ir.Precision.bf16
    as_kept = best(problem(gathering=ir.FSDP_GATHERING), 3)  # FSDP gathering the fp32 weights: autocast's copies
    assert as_kept.plan.data.gather is None
    assert chosen.estimate.time.step == as_kept.estimate.time.step  # 16-bit gathers priced the same either way
    lower, higher = (max(m.total for m in s.estimate.memory) for s in (chosen, as_kept))
    # the 4 blocks' and head's linear weights' bf16 copies (2 bytes each) and the two gathered units at 2, not 4
    assert lower < higher
    copies = sum(m.activations for m in as_kept.estimate.memory) - sum(m.activations for m in chosen.estimate.memory)
    assert copies == pytest.approx(2 * (4 * 12 * 1024 ** 2 + 4 * 9 * 1024 + 8192 * 1024), rel=1e-9)
    text = plan_text(chosen, problem(), Source((), "m", "pair"))
    assert "  data    = zero3 over dp with gather = bf16\n" in text
    plan = api.select_plan(api.loads(HARDWARE + f"model m = {GPT}\n" + text))  # checks clean
    assert estimate_plan(plan).memory == chosen.estimate.memory  # the written plan is what was estimated


@pytest.mark.parametrize("zero, precision, extra, gather", [
    (3, "bf16", {}, ir.Precision.bf16),
    (2, "bf16", {}, ir.Precision.bf16),
    (3, "fp16", {}, ir.Precision.fp16),
    (1, "bf16", {}, None),  # ZeRO-1 gathers the weights as they are kept (fp32): no 16-bit gather
    (0, "bf16", {}, None),
    (3, "fp32", {}, None),  # nothing narrower to compute in
    (3, "bf16", {"param_dtype": ir.Precision.bf16}, None),  # 16-bit weights are gathered as they are
    (3, "bf16", {"gathering": ir.FSDP_GATHERING}, None),  # given: as given
    (3, "bf16", {"gathering": ir.Gathering(gather=ir.Precision.fp32)}, ir.Precision.fp32),
    (1, "bf16", {"gathering": ir.Gathering(gather=ir.Precision.bf16)}, None),  # not ZeRO-1's, fp32 weights (E515)
    (1, "bf16", {"gathering": ir.Gathering(gather=ir.Precision.bf16), "param_dtype": ir.Precision.bf16},
     ir.Precision.bf16),
], ids=["zero3", "zero2", "zero3_fp16", "zero1", "zero0", "fp32", "bf16_weights", "given_none", "given_fp32",
        "given_bf16_zero1", "given_bf16_zero1_bf16_weights"])
def test_each_zero_stage_gathers_as_the_stack_does(zero, precision, extra, gather):
    p = problem(precision=ir.Precision(precision), **extra)
    chosen = best(p, zero)
    assert (chosen.plan.data.gather if chosen.plan.data is not None else None) is gather
    text = plan_text(chosen, p, Source((), "m", "pair"))
    assert ("with gather" in text) is (gather is not None)
    plan = api.select_plan(api.loads(HARDWARE + f"model m = {GPT}\n" + text))  # E515 never: it checks clean
    assert plan.data is None or plan.data.gather is gather


def test_the_caps_count_the_chosen_gather_as_the_estimate_does():
    """Every stage searched, branch and bound against brute force, for an MoE model whose grouped experts' copies
    autocast saves per microbatch (`cost.memory.expert_weight_copies`): held under ZeRO-0/1, none under ZeRO-2/3."""
    p = problem(MOE)
    pins = {"recompute": "none", "pp": 1}  # one stage: the plans estimate without the search's split
    everything = brute_force(p, pins)
    found = search(p, pins=pins, top=3)
    assert [s.estimate.time.step for s in found.candidates] == pytest.approx(
        [s.estimate.time.step for s in everything[:3]], rel=1e-12)
    for scored in everything:
        assert scored.estimate.memory == estimate_plan(scored.plan).memory
        stage = scored.plan.data.zero_stage if scored.plan.data is not None else 0
        assert (scored.plan.run_gather is ir.Precision.bf16) is (stage >= 2)


def test_generate_writes_the_gather_and_from_keeps_a_written_data_clause(tmp_path):
    generated = api.generate(api.generate_request(model=GPT, cluster="dgx_a100 x 1", global_batch=16,
                                                  pins=("dp=8", "zero_stage=3"), top=1))
    assert "  data    = zero3 over dp with gather = bf16\n" in generated.texts[0]
    partial = textwrap.dedent(f"""\
        import "clusters/dgx_a100"
        plan p {{
          model   = {GPT}
          cluster = dgx_a100 x 1
          train   = {{ global_batch: 16 }}
        }}
        """)
    free = tmp_path / "free.plan"
    free.write_text(partial, encoding="utf-8")
    completed = api.generate(api.generate_request(from_file=str(free), pins=("dp=8", "zero_stage=3"), top=1))
    assert "data = zero3 over dp with gather = bf16" in " ".join(completed.texts[0].split())
    written = tmp_path / "written.plan"
    written.write_text(partial.replace("  train", "  data    = fsdp over dp\n  train"), encoding="utf-8")
    kept = api.generate(api.generate_request(from_file=str(written), pins=("dp=8",), top=1))
    assert "gather" not in kept.texts[0] and kept.result.best.plan.data.gather is None


def test_the_layers_activations_follow_the_zero_stage_whose_gather_drops_the_copies():
    """A grouped expert's bf16 copies are saved per microbatch where autocast casts the weights (ZeRO-0/1) and not
    where FSDP gathers them in bf16 (ZeRO-2/3): the per-layer figures the caps read are those of each stage's own
    plan, whichever stage the search asked for first."""
    space = Space(problem(MOE), {"recompute": "none", "pp": 1, "tp": 1, "ep": 1}, DEFAULT_EFFICIENCY)
    figures, compared = space.figures, 0
    for root in space.roots():
        for node in space.expand_root(root):
            for zero in (1, 3, 0, 2):
                plan = build_plan(figures.base, candidate_of(node, "", 1, zero))
                per_kind = figures.layer_memory(node, zero)[0]
                for (layer, _), figure in zip(figures.kinds, per_kind):
                    assert figure[1] == estimate_layer_activations(plan, layer)
                    compared += layer.kind == "block"
    assert compared >= 4
