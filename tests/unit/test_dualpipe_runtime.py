"""DeepSeek's DualPipe (`stages = ... with implementation = dualpipe`: deepseek-ai/DualPipe's `DualPipeV`, as
DeepSeek-V3 ran it): the checker (E610: its DualPipeV alone, at torch's sizes; E206: its outputs are not modelled;
E513: no activation offloading), the search's choices, and the memory counted as Megatron-LM's pipeline's (a chunk
received into a tensor of its own, an output freed once sent, one copy of the parameters beside the data-parallel
buffers) where torch's keeps a receive buffer per microbatch and `replicate`'s copy of the weights."""
import pytest

from plandsl import api
from plandsl.cost.memory import estimate_plan_memory, replicates_units, torch_stage_bytes
from tests.support import PipelinePlan

MODEL = "llama(layers=8, hidden=1024, heads=16, kv_heads=4, seq=1024, vocab=32000)"
PIPE = PipelinePlan("dualpipe", "dualpipev", model=MODEL, stages="virtual = 2, map = vshape, ")
_text, _plan, _errors = PIPE.text, PIPE.plan, PIPE.codes


def test_the_language_says_dualpipes_runtime_and_checks_it():
    PIPE.assert_checked(refused="zbv")  # DualPipeV lays out its own
    few = _text().replace("global_batch: 64", "global_batch: 28")  # 7 microbatches a pipeline: DualPipeV asks 2 x pp
    assert "E502" in _errors(few)
    offload = _text().replace("precision: bf16", "precision: bf16, offload_layers: 1")
    assert "E513" in _errors(offload) and "E513" not in _errors(offload.replace("= dualpipe", "= torch"))


def test_the_search_offers_it_only_dualpipev():
    PIPE.assert_searched(microbatches=16, virtual=2)
    generated = api.generate(api.generate_request(model=MODEL, cluster="dgx_a100 x 2", global_batch=64,
                                                  pipeline="dualpipe", pins=("pp=4",), top=3))
    assert generated.texts and all("schedule = dualpipev" in text and "implementation = dualpipe" in text
                                   for text in generated.texts)
    assert all(api.checks(text, path="generated.plan").ok for text in generated.texts)
    with pytest.raises(api.PlanError, match="DualPipe's runtime does not run it"):
        api.generate(api.generate_request(model=MODEL, cluster="dgx_a100 x 2", global_batch=64, pipeline="dualpipe",
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
    plan = _plan(implementation="megatron", schedule="1f1b", stages="")
    same = plan.model_copy(update={"stages": plan.stages.model_copy(update={"implementation": "dualpipe"})})
    assert [r.total for r in estimate_plan_memory(same)] == [r.total for r in estimate_plan_memory(plan)]
    assert torch_stage_bytes(dual, 8, (0, 7), 4.0, 1.0) == 0.0


def test_torchtitans_export_says_the_pipeline_the_plan_names():
    """torchtitan runs torch's pipeline: `export --to torchtitan` loses the stages' implementation (E808), and its hint
    names the word the plan wrote, which dropping gives torch's pipeline (not Megatron-LM's, which it does not name)."""
    for implementation in ("dualpipe", "deepspeed"):
        plan = _plan() if implementation == "dualpipe" else \
            _plan(implementation=implementation, schedule="1f1b", stages="")
        lost = [d for d in api.export(plan, "torchtitan").lost if "stages with implementation" in d.message]
        assert len(lost) == 1 and f"implementation = {implementation} (" in lost[0].message
        assert lost[0].hint.startswith(f"drop `implementation = {implementation}`"), lost[0].hint
