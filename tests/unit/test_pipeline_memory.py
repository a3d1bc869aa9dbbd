"""Whose pipeline runs a plan (`stages = ... with implementation = torch | megatron`) and what torch's does with the last
stage's outputs (`outputs = dropped | returned`): the lowering, the checker's E610, and what torch's `PipelineStage`
holds beside the layers (`cost.memory.torch_stage_bytes`), counted here buffer by buffer from torch 2.13's
`torch/distributed/pipelining/stage.py`; none of it on Megatron-LM's pipeline."""
import pytest
from test_search import problem  # the search tests' small problems

from plandsl import api, ir
from plandsl.cost.compute import DEFAULT_EFFICIENCY
from plandsl.cost.estimate import estimate_plan
from plandsl.cost.memory import (
    estimate_plan_memory,
    head_inflight,
    inflight_microbatches,
    returned_merge_bytes,
    torch_stage_bytes,
    torch_stage_sizes,
)
from plandsl.search.choices import stage_ranks
from plandsl.search.figures import Figures
from plandsl.search.problem import build_plan
from plandsl.search.space import Space
from plandsl.search.tree import candidate_of
from tests.support import EIGHT_GPU_NODE

E = 2  # bf16
HIDDEN, VOCAB, SEQ = 1024, 32000, 2048
PLAN = EIGHT_GPU_NODE + """plan p {{
  model    = llama(layers=16, hidden={hidden}, heads=8, seq={seq}, vocab={vocab})
  cluster  = n
  mesh     = [pp = {pp}, tp = {tp}]
  train    = {{ global_batch: {batch}, micro_batch: 2, recompute: full{loss} }}
  {tensor}
  stages   = {stages}
  schedule = {schedule}
}}
"""


def _plan(pp=4, tp=1, batch=16, stages="evenly over pp", schedule="1f1b", sequence_parallel=False, loss=""):
    tensor = "tensor = megatron over tp" + (" with sequence_parallel" if sequence_parallel else "") if tp > 1 else ""
    text = PLAN.format(hidden=HIDDEN, vocab=VOCAB, seq=SEQ, pp=pp, tp=tp, batch=batch, stages=stages,
                       schedule=schedule, tensor=tensor, loss=loss)
    return api.select_plan(api.loads(text, path="p.plan"))


def _block_plan(attribute: str) -> ir.Plan:
    """The plan with a `stages { }` block of pp 4 that sets `attribute`."""
    block = "stages {\n    0: embed, layers[0:4]\n    1..3: layers[4:12]\n    3: layers[12:16], norm, head\n" \
            f"    {attribute}\n  }}"
    text = PLAN.format(hidden=HIDDEN, vocab=VOCAB, seq=SEQ, pp=4, tp=1, batch=16, tensor="", loss="", stages="",
                       schedule="1f1b").replace("stages   = \n", block + "\n")
    return api.select_plan(api.loads(text, path="p.plan"))


def test_the_clause_and_the_block_say_whose_pipeline():
    assert _plan().stages.implementation == "torch"
    assert "implementation" not in _plan().stages.model_dump()  # a plan without it dumps as before
    said = _plan(stages="evenly over pp with implementation = megatron")
    assert said.stages.implementation == "megatron" and said.stages.model_dump()["implementation"] == "megatron"
    assert _block_plan("implementation = megatron").stages.implementation == "megatron"


def test_an_unknown_pipeline_is_refused():
    analysis = api.checks(PLAN.format(hidden=HIDDEN, vocab=VOCAB, seq=SEQ, pp=4, tp=1, batch=16, tensor="", loss="",
                                      stages="evenly over pp with implementation = colossalai", schedule="1f1b"),
                          path="p.plan")
    assert [d.code for d in analysis.diagnostics] == ["E210"]
    assert "megatron" in analysis.diagnostics[0].hint


@pytest.mark.parametrize("schedule, virtual", [("gpipe", ""), ("zb_h1", ""), ("interleaved_zero_bubble", ", virtual = 2")])
def test_E610_megatron_runs_only_its_two_schedules(schedule, virtual):
    text = PLAN.format(hidden=HIDDEN, vocab=VOCAB, seq=SEQ, pp=4, tp=1, batch=16, tensor="", loss="",
                       stages=f"evenly over pp with implementation = megatron{virtual}", schedule=schedule)
    found = [d for d in api.checks(text, path="p.plan").diagnostics if d.severity == "error"]
    assert [d.code for d in found] == ["E610"] and f"'{schedule}'" in found[0].message
    fixed = text.replace(f"schedule = {schedule}", "schedule = " + ("interleaved_1f1b" if virtual else "1f1b"))
    assert not [d for d in api.checks(fixed, path="p.plan").diagnostics if d.severity == "error"]


def test_megatrons_interleaved_1f1b_needs_pp_microbatches():
    """Megatron-LM's interleaved schedule runs its microbatches in groups of pp to m per virtual stage
    (forward_backward_pipelining_with_interleaving), so with virtual stages fewer than pp are E502 on its pipeline
    (torch's runs them: one round); one stage per rank, or pp of them, pass; and `generate --pipeline megatron` proposes
    none."""
    def codes(batch, virtual, implementation="megatron", schedule="interleaved_1f1b"):
        text = PLAN.format(hidden=HIDDEN, vocab=VOCAB, seq=SEQ, pp=4, tp=1, batch=batch, tensor="", loss="",
                           stages=f"evenly over pp with virtual = {virtual}, implementation = {implementation}",
                           schedule=schedule)
        return [d.code for d in api.checks(text, path="p.plan").diagnostics if d.severity == "error"]
    assert codes(batch=6, virtual=2) == ["E502"]  # 3 microbatches of 2 over 4 ranks
    assert codes(batch=6, virtual=2, implementation="torch") == codes(batch=8, virtual=2) == []
    assert codes(batch=6, virtual=1) == []
    from plandsl.search.choices import schedule_choices
    assert ("interleaved_1f1b", 2) in schedule_choices(4, 3, 16, None, None) and \
        schedule_choices(4, 3, 16, None, None, pipeline="megatron") == []  # nor 1f1b: torch's needs pp microbatches
    assert ("interleaved_1f1b", 2) in schedule_choices(4, 4, 16, None, None, pipeline="megatron")


def test_torchs_stage_buffers_by_hand():
    """pp 4, 1F1B, 8 microbatches of 2 x 2048 tokens, bf16: b = 2 * 2048 * 1024 * 2 bytes a boundary. Rank r has
    min(4 - r, 8) microbatches in flight. Rank 0 (first stage): 8 gradient receive buffers and 4 cached outputs;
    rank 1, 2: 8 activation receive buffers of which 3, 2 are the in-flight inputs counted with the layers, 8
    gradient buffers, 3, 2 outputs; rank 3 (last): 8 - 1 activation buffers and one microbatch's 16-bit logits."""
    plan = _plan()
    b = 2 * 2048 * HIDDEN * E
    logits = 2 * 2048 * VOCAB * E
    assert inflight_microbatches("1f1b", 4, 8, 1) == [4, 3, 2, 1]
    expected = [(8 + 4) * b, (8 - 3) * b + (8 + 3) * b, (8 - 2) * b + (8 + 2) * b, (8 - 1) * b + logits]
    memory = estimate_plan_memory(plan)
    assert [m.other for m in memory] == expected
    megatron = estimate_plan_memory(_plan(stages="evenly over pp with implementation = megatron"))
    assert [m.other for m in megatron] == [0.0] * 4
    assert [m.total - m.other for m in memory] == [m.total for m in megatron]


def test_interleaved_ranks_count_each_of_their_stages():
    """pp 2, virtual 2 (stages 0, 2 on rank 0; 1, 3 on rank 1), 8 microbatches: rank 0's in-flight count is
    ceil((2 * 1 + 2 + 1) / 2) = 3, rank 1's ceil((0 + 2 + 1) / 2) = 2 (`inflight_microbatches`). Rank 0: stage 0 sends
    (8 gradient buffers, 3 outputs), stage 2 receives and sends (8 - 3, 8 + 3); rank 1: stage 1 (8 - 2, 8 + 2),
    stage 3, the last, receives (8 - 2) and holds one microbatch's logits (`head_inflight`)."""
    plan = _plan(pp=2, stages="evenly over pp with virtual = 2", schedule="interleaved_1f1b")
    b = 2 * 2048 * HIDDEN * E
    logits = 2 * 2048 * VOCAB * E
    assert inflight_microbatches("interleaved_1f1b", 2, 8, 2) == [3, 2]
    assert [m.other for m in estimate_plan_memory(plan)] == [
        (8 + 3) * b + (8 - 3) * b + (8 + 3) * b, (8 - 2) * b + (8 + 2) * b + (8 - 2) * b + logits]


def test_sequence_parallel_boundaries_are_the_local_shard():
    """With sequence parallelism torch sends the local shard (s/t tokens); the logits are vocabulary-sharded; under a
    fused loss (`plandsl run`'s schedule calls the head in its loss function) the last stage's output is its hidden
    states, which the loss saves (counted with the head)."""
    plan = _plan(pp=2, tp=2, batch=8, sequence_parallel=True)
    b = 2 * 2048 * HIDDEN * E / 2
    logits = 2 * 2048 * VOCAB * E / 2
    assert [m.other for m in estimate_plan_memory(plan)] == [(4 + 2) * b, (4 - 1) * b + logits]
    fused = _plan(pp=2, tp=2, batch=8, sequence_parallel=True, loss=", loss: fused")
    assert [m.other for m in estimate_plan_memory(fused)] == [(4 + 2) * b, (4 - 1) * b]
    whole = _plan(pp=2, tp=2, batch=8)  # without sequence parallelism each tensor rank holds the whole boundary
    assert estimate_plan_memory(whole)[0].other == (4 + 2) * 2 * b


def test_the_estimate_counts_them_beside_the_simulated_peak():
    """`estimate_plan` may replace a rank's activations by the simulated peak; torch's buffers stay in `other`."""
    plan = _plan()
    estimate = estimate_plan(plan)
    assert [m.other for m in estimate.memory] == [m.other for m in estimate_plan_memory(plan)]
    assert all(m.total == m.params + m.grads + m.optimizer + m.activations + m.other for m in estimate.memory)


def test_simulate_counts_them_as_estimate_does():
    """`plandsl simulate`'s per-rank peak holds torch's pipeline buffers beside the states, as `estimate`, `run --dry-run`
    and `render --view memory` count them (`MemoryEstimate.held`, one figure): on local/pp_1f1b it is estimate's peak
    on rank 0 (it was 80 KiB short) and short of it on the last rank by the loss's backward alone, which estimate adds
    and the report says; on Megatron-LM's pipeline there are none either way."""
    from pathlib import Path
    from plandsl.cost.memory import beyond_layers
    from plandsl.ir.placement import assign_stages
    plan = api.load_plan(Path(__file__).resolve().parents[2] / "stdlib_plans" / "local" / "pp_1f1b.plan")
    for implementation, buffers in (("torch", True), ("megatron", False)):
        plan = plan.model_copy(update={"stages": plan.stages.model_copy(update={"implementation": implementation})})
        estimate = estimate_plan(plan)
        _, simulation = api.simulate(plan)
        assignment, _ = assign_stages(plan)
        stages = assignment.rank_stages()
        assert all((m.other > 0) == buffers for m in estimate.memory)
        for rank, (memory, simulated) in enumerate(zip(estimate.memory, simulation.ranks)):
            working = beyond_layers(plan, [assignment.stage_layers[s] for s in stages[rank]])
            assert simulated.peak_memory_bytes + working == pytest.approx(memory.total, rel=1e-12)
        assert simulation.ranks[0].peak_memory_bytes == estimate.memory[0].total and estimate.memory[0].other == \
            (80 * 1024 if buffers else 0)


def test_no_pipeline_no_buffers():
    plan = _plan(pp=1, stages="evenly over pp")
    assert [m.other for m in estimate_plan_memory(plan)] == [0.0]
    assert torch_stage_bytes(plan, 1, (0,), 1, 1) == 0.0


def test_megatron_imports_its_own_pipeline_and_torchtitan_torchs():
    """Megatron-LM's flags import as Megatron-LM's pipeline, evenly or by a layout; its export writes the same flags
    for a plan on either; torchtitan's export of Megatron-LM's pipeline is lost (E808), its import torch's."""
    from plandsl.interop import (  # lazy: keeps this module's collection light
        export_plan,
        import_text,
    )
    flags = ("--num-layers 16 --hidden-size 1024 --num-attention-heads 8 --seq-length 2048 --max-position-embeddings "
             "2048 --padded-vocab-size 32000 --micro-batch-size 2 --global-batch-size 16 --bf16 "
             "--pipeline-model-parallel-size 4")
    for extra in ("", " --pipeline-model-parallel-layout Et*3|t*5|t*5|t*3L"):
        imported = import_text("megatron", flags + extra, "x.args", world_size=4, name="p")
        assert imported.ok, api.render_all(imported.diagnostics, imported.sources)
        plan = api.select_plan(api.loads(imported.text, path="p.plan"))
        assert plan.stages.implementation == "megatron" and all(m.other == 0 for m in estimate_plan_memory(plan))
        torch = plan.model_copy(update={"stages": plan.stages.model_copy(update={"implementation": "torch"})})
        assert export_plan(torch, "megatron").text == export_plan(plan, "megatron").text
        assert not export_plan(plan, "megatron").lost
        lost = export_plan(plan, "torchtitan").lost
        assert any("implementation = megatron" in d.message for d in lost)
        assert not any("implementation" in d.message for d in export_plan(torch, "torchtitan").lost)


def test_the_search_caps_count_the_same_buffers():
    """`search.Figures.stage_buffers`, which the caps take off each rank's room, is `torch_stage_bytes` rank by rank
    with the last stage's logits for its microbatches in flight (`head_inflight`: all of them under GPipe): the leaf's
    exact estimate's."""
    compared = 0
    for figures, node, memory, plan in _pipelined_nodes():
        pp = node.root.pp
        for schedule, virtual in (("1f1b", 1), ("gpipe", 1), ("interleaved_1f1b", 2), ("zbv", 2)):
            ranks = stage_ranks(schedule, pp, virtual)
            inflight = figures.inflight(schedule, pp, node.microbatches, virtual)
            expected = [torch_stage_bytes(plan, len(ranks), _own(ranks, r), float(inflight[r]),
                                          head_inflight(schedule, float(inflight[r]))) for r in range(pp)]
            assert figures.stage_buffers(memory, ranks, inflight).tolist() == pytest.approx(expected, rel=1e-12)
            compared += any(expected)
    assert compared > 5


def _pipelined_nodes(per_root: int | None = None):
    """(figures, node, its memory figures at ZeRO-0, its plan) of the `long` model's search on the `tight` cluster,
    for every pipelined root and its first `per_root` nodes (all of them by default)."""
    space = Space(problem("long", "tight", 8), {}, DEFAULT_EFFICIENCY)
    figures: Figures = space.figures
    for root in space.roots():
        if root.pp == 1:
            continue
        for node in space.expand_root(root)[:per_root]:
            yield figures, node, figures.layer_memory(node, 0), build_plan(figures.base, candidate_of(node, "", 1, 0))


def _own(ranks, rank: int) -> list[int]:
    """The stages `ranks` (a stage-to-rank map) puts on `rank`."""
    return [s for s, on in enumerate(ranks) if on == rank]


def test_the_plan_says_whether_the_last_stage_returns_its_outputs():
    """`stages = ... with outputs = returned`, in the clause or the block; `dropped` by default and left out of the dump
    (plans without it dump and hash as before); Megatron-LM's pipeline returns no outputs (E206); a word torch's does
    not take is E210."""
    assert _plan().stages.outputs == "dropped" and "outputs" not in _plan().stages.model_dump()
    said = _plan(stages="evenly over pp with outputs = returned")
    assert said.stages.outputs == "returned" and said.stages.model_dump()["outputs"] == "returned"
    assert _block_plan("outputs = returned").stages.outputs == "returned"
    for options, code in (("implementation = megatron, outputs = returned", "E206"), ("outputs = kept", "E210")):
        analysis = api.checks(PLAN.format(hidden=HIDDEN, vocab=VOCAB, seq=SEQ, pp=4, tp=1, batch=16, tensor="",
                                          loss="", stages=f"evenly over pp with {options}", schedule="1f1b"),
                              path="p.plan")
        assert [d.code for d in analysis.diagnostics] == [code], options
    from plandsl.interop import export_plan  # lazy: keeps this module's collection light
    assert any("outputs = returned" in d.message for d in export_plan(said, "torchtitan").lost)  # return_outputs=False
    assert not any("outputs" in d.message for d in export_plan(_plan(), "torchtitan").lost)


def test_returned_outputs_by_hand():
    """`outputs = returned` (torch's `step(return_outputs=True)`): the last stage keeps all 8 microbatches' logits, 7
    beyond the one in flight, at its last backward; the other ranks hold what they held. At the step's end
    `_merge_outputs` concatenates them beside the stored states and the receive buffers (8 activation buffers, 8
    logits and their merge), the layers' activations gone: here (16 small layers, 32,000 words) that moment is the
    last rank's peak, 2 x 8 logits against the step's 8 beside the activations."""
    b = 2 * 2048 * HIDDEN * E
    logits = 2 * 2048 * VOCAB * E
    plan = _plan(stages="evenly over pp with outputs = returned")
    dropped, returned = estimate_plan_memory(_plan()), estimate_plan_memory(plan)
    assert [m.other for m in returned[:3]] == [m.other for m in dropped[:3]]
    last = returned[3]
    assert last.activations == dropped[3].activations
    assert returned_merge_bytes(plan, 4, (3,)) == 8 * b + 16 * logits
    step, merge = (8 - 1) * b + 8 * logits, 8 * b + 16 * logits - last.activations
    assert merge > step and last.other == merge
    assert last.total == last.stored_states + returned_merge_bytes(plan, 4, (3,))
    assert returned_merge_bytes(_plan(), 4, (3,)) == 0.0 and returned_merge_bytes(plan, 4, (2,)) == 0.0
    fewer = estimate_plan_memory(_plan(batch=8, stages="evenly over pp with outputs = returned"))[3]  # 4 microbatches
    assert 4 * b + 8 * logits - fewer.activations < (4 - 1) * b + 4 * logits == fewer.other  # the step's peak


def test_returned_outputs_under_a_fused_loss_are_the_final_hidden_states():
    """Under `loss: fused` the last stage returns its final hidden states (`runtime.loss.fused_loss`: the loss calls the
    head on them), so `outputs = returned` keeps m of those, a boundary each, not nothing: 7 beyond the one in flight
    (which the head's activations hold) at the last backward, and at the step's end the 8 with their merge beside the
    receive buffers; the search's caps count the ones beyond those in flight and stay under the estimate."""
    b = 2 * 2048 * HIDDEN * E
    fused = ", loss: fused"
    dropped = estimate_plan_memory(_plan(loss=fused))[3]
    plan = _plan(loss=fused, stages="evenly over pp with outputs = returned")
    returned = estimate_plan_memory(plan)[3]
    assert dropped.other == (8 - 1) * b and returned.activations == dropped.activations
    assert returned_merge_bytes(plan, 4, (3,)) == 8 * b + 2 * 8 * b
    assert returned.other == max((8 - 1) * b + (8 - 1) * b, 8 * b + 16 * b - returned.activations)
    assert returned.total > dropped.total
    compared = 0
    for figures, node, memory, built in _pipelined_nodes(per_root=2):
        train = built.train.model_copy(update={"loss": ir.Loss.fused})
        built = built.model_copy(update={"train": train, "stages": built.stages.model_copy(
            update={"outputs": "returned"})})
        figures._buffer_plans[id(memory)] = (built, torch_stage_sizes(built))
        for schedule, virtual in (("1f1b", 1), ("gpipe", 1)):
            ranks = stage_ranks(schedule, node.root.pp, virtual)
            inflight = figures.inflight(schedule, node.root.pp, node.microbatches, virtual)
            last = float(inflight[ranks[-1]])
            head = last if schedule == "gpipe" else min(1.0, last)
            exact = torch_stage_bytes(built, len(ranks), _own(ranks, ranks[-1]), last, head)
            caps = figures.stage_buffers(memory, ranks, inflight)[ranks[-1]]
            assert caps <= exact * (1 + 1e-12)
            dropped = built.model_copy(update={"stages": built.stages.model_copy(update={"outputs": "dropped"})})
            compared += exact > torch_stage_bytes(dropped, len(ranks), _own(ranks, ranks[-1]), last, head)
    assert compared


@pytest.mark.slow  # imports torch
def test_run_steps_torchs_schedule_as_the_plan_says():
    """`plandsl run` passes `return_outputs` as the plan's `outputs` says (False unless `outputs = returned`)."""
    torch = pytest.importorskip("torch")
    from types import SimpleNamespace

    from plandsl.runtime.parallel.pipeline import Pipeline

    for stages, expected in (("evenly over pp", False), ("evenly over pp with outputs = returned", True)):
        seen = {}

        def step(*args, target=None, losses=None, return_outputs=True):
            seen["return_outputs"] = return_outputs
            losses.append(torch.tensor(1.0))

        stage = SimpleNamespace(device=torch.device("cpu"), is_first=True, is_last=True)
        pipeline = Pipeline(SimpleNamespace(step=step), [stage], [], [], (0,), 2, None, "stub",
                            _plan(stages=stages))
        pipeline.step(torch.zeros(2, 4, dtype=torch.long), target=torch.zeros(2, 4, dtype=torch.long))
        assert seen == {"return_outputs": expected}, stages


def test_a_problem_whose_outputs_are_returned_writes_them_and_counts_them(tmp_path):
    """The search's problem carries `outputs` (the bench's torchtitan rows of late 2024 say it): the plan it writes says
    `outputs = returned`, checks clean, and estimates to the search's memory, which counts the kept logits."""
    from dataclasses import replace as with_

    from plandsl.search import search
    from plandsl.search.emit import plan_text, resolve_problem

    problem, source = resolve_problem("gpt(layers=8, hidden=1024, heads=16, seq=1024, vocab=51200)", "dgx_a100 x 2", 32)
    returned = with_(problem, outputs="returned")
    pins = {"pp": 2, "tp": 1, "micro_batch_size": 1, "schedule": "1f1b"}
    best, dropped = search(returned, pins=pins, top=1).best, search(problem, pins=pins, top=1).best
    text = plan_text(best, returned, source)
    assert "outputs = returned" in text and "outputs" not in plan_text(dropped, problem, source)
    (plan,) = api.loads(text, path=str(tmp_path / "c.plan")).plans
    assert plan.stages.outputs == "returned"
    assert estimate_plan(plan).peak_memory_bytes == pytest.approx(best.estimate.peak_memory_bytes, rel=1e-9)
    assert best.estimate.peak_memory_bytes > dropped.estimate.peak_memory_bytes
