"""DeepSeek's DualPipe (`stages = ... with implementation = dualpipe`: deepseek-ai/DualPipe's `DualPipeV`, as
DeepSeek-V3 ran it): the checker (E610: its DualPipeV alone, at torch's sizes; E206: its outputs are not modelled;
E513: no activation offloading), the search's choices, and the memory counted as Megatron-LM's pipeline's (a chunk
received into a tensor of its own, an output freed once sent, one copy of the parameters beside the data-parallel
buffers) where torch's keeps a receive buffer per microbatch and `replicate`'s copy of the weights."""
import pytest

from plandsl import api
from plandsl.cost.memory import estimate_plan_memory, replicates_units, torch_stage_bytes
from plandsl.search.choices import schedule_choices

PLAN = """import "clusters/dgx_a100"
plan p {{
  model    = llama(layers=8, hidden=1024, heads=16, kv_heads=4, seq=1024, vocab=32000)
  cluster  = dgx_a100 x 2
  mesh     = [dp = 2, pp = 4, tp = 2]
  train    = {{ global_batch: 64, micro_batch: 2, precision: bf16 }}
  tensor   = megatron over tp
  data     = {data} over dp
  stages   = evenly over pp with virtual = 2, map = vshape, implementation = {implementation}
  schedule = {schedule}
}}
"""


def _text(implementation="dualpipe", schedule="dualpipev", data="zero1"):
    return PLAN.format(implementation=implementation, schedule=schedule, data=data)


def _errors(text):
    return [d.code for d in api.checks(text, path="p.plan").diagnostics if d.severity == "error"]


def _plan(**kwargs):
    return api.select_plan(api.loads(_text(**kwargs), path="p.plan"))


def test_the_language_says_dualpipes_runtime_and_checks_it():
    assert _plan().stages.implementation == "dualpipe"
    assert _errors(_text()) == [] and _errors(_text(data="replicate")) == []
    found = [d for d in api.checks(_text(schedule="zbv"), path="p.plan").diagnostics if d.severity == "error"]
    assert [d.code for d in found] == ["E610"] and "it runs dualpipev" in found[0].message  # DualPipeV lays out its own
    assert _errors(_text(schedule="zbv", implementation="torch")) == []
    few = _text().replace("global_batch: 64", "global_batch: 28")  # 7 microbatches a pipeline: DualPipeV asks 2 x pp
    assert "E502" in _errors(few)
    outputs = _text().replace("implementation = dualpipe", "implementation = dualpipe, outputs = returned")
    assert _errors(outputs) == ["E206"]
    offload = _text().replace("precision: bf16", "precision: bf16, offload_layers: 1")
    assert "E513" in _errors(offload) and "E513" not in _errors(offload.replace("= dualpipe", "= torch"))


def test_the_search_offers_it_only_dualpipev():
    assert {name for name, _ in schedule_choices(4, 16, 16, None, None, pipeline="dualpipe")} == {"dualpipev"}
    assert ("gpipe", 1) in schedule_choices(4, 16, 16, None, None)
    model = "llama(layers=8, hidden=1024, heads=16, kv_heads=4, seq=1024, vocab=32000)"
    generated = api.generate(api.generate_request(model=model, cluster="dgx_a100 x 2", global_batch=64,
                                                  pipeline="dualpipe", pins=("pp=4",), top=3))
    assert generated.texts and all("schedule = dualpipev" in text and "implementation = dualpipe" in text
                                   for text in generated.texts)
    assert all(api.checks(text, path="generated.plan").ok for text in generated.texts)
    with pytest.raises(api.PlanError, match="DualPipe's runtime does not run it"):
        api.generate(api.generate_request(model=model, cluster="dgx_a100 x 2", global_batch=64, pipeline="dualpipe",
                                          pins=("pp=4", "schedule=zbv"), top=1))


def test_its_memory_is_megatrons_not_torchs_buffers_and_copies():
    """Against the same plan on torch's pipeline: no stage receive buffers (`other`), no `replicate` copy of the
    weights; everything else counted alike, as on Megatron-LM's pipeline (the same plan with 1F1B on both)."""
    dual, torch_ = _plan(), _plan(implementation="torch")
    assert not replicates_units(dual) and replicates_units(torch_)
    ours, theirs = estimate_plan_memory(dual), estimate_plan_memory(torch_)
    assert all(rank.other == 0.0 for rank in ours) and all(rank.other > 0.0 for rank in theirs)
    for mine, other in zip(ours, theirs):  # torch's: `replicate`'s copy of the weights among the parameters
        assert (mine.grads, mine.optimizer, mine.activations) == (other.grads, other.optimizer, other.activations)
        assert mine.params == pytest.approx(other.params / 2)  # bf16 weights, and their copy
    # on Megatron-LM's pipeline (1F1B, which DualPipe does not run: E610 above), the same count to the byte
    plan = api.select_plan(api.loads(_text(implementation="megatron", schedule="1f1b").replace(
        "virtual = 2, map = vshape, ", ""), path="p.plan"))
    same = plan.model_copy(update={"stages": plan.stages.model_copy(update={"implementation": "dualpipe"})})
    assert [r.total for r in estimate_plan_memory(same)] == [r.total for r in estimate_plan_memory(plan)]
    assert torch_stage_bytes(dual, 8, (0, 7), 4.0, 1.0) == 0.0


def test_torchtitans_export_says_the_pipeline_the_plan_names():
    """torchtitan runs torch's pipeline: `export --to torchtitan` loses the stages' implementation (E808), and its hint
    names the word the plan wrote, which dropping gives torch's pipeline (not Megatron-LM's, which it does not name)."""
    for implementation in ("dualpipe", "deepspeed"):
        text = _text(implementation=implementation) if implementation == "dualpipe" else \
            _text(implementation=implementation, schedule="1f1b").replace("virtual = 2, map = vshape, ", "")
        plan = api.select_plan(api.loads(text, path="p.plan"))
        lost = [d for d in api.export(plan, "torchtitan").lost if "stages with implementation" in d.message]
        assert len(lost) == 1 and f"implementation = {implementation} (" in lost[0].message
        assert lost[0].hint.startswith(f"drop `implementation = {implementation}`"), lost[0].hint
