"""DeepSpeed's pipeline engine (`stages = ... with implementation = deepspeed`, deepspeed v0.5.8's
`deepspeed/runtime/pipe`, as Megatron-DeepSpeed ran BLOOM and MT-NLG): the lowering, the checker (E610: its
TrainSchedule's 1F1B alone; E611: ZeRO 0 or 1; E206: no outputs), the search's choices, and its time
(`cost.estimate.deepspeed_exchanges`, `cost.stage.rank_tail(after_schedule=True)`) against the same plan on
Megatron-LM's pipeline, whose memory it shares."""
import dataclasses

import pytest

from plandsl.cost.comm import collective_seconds
from plandsl.cost.estimate import estimate_plan, pipeline_p2p_seconds, plan_work
from plandsl.cost.layer import plan_links
from tests.support import PipelinePlan

PIPE = PipelinePlan("deepspeed", "1f1b", model="gpt(layers=8, hidden=1024, heads=16, seq=1024, vocab=50304)",
                    train=", recompute: full")
_text, _plan, _errors = PIPE.text, PIPE.plan, PIPE.codes


def test_the_language_says_deepspeeds_pipeline_and_checks_it():
    PIPE.assert_checked(refused="gpipe")  # TrainSchedule is a 1F1B
    assert _errors(_text(schedule="interleaved_1f1b", stages="virtual = 2, ")) == ["E610"]
    found = PIPE.errors(_text(data="zero2"))
    assert [d.code for d in found] == ["E611"] and "zero2" in found[0].message
    assert _errors(_text(data="zero2", implementation="megatron")) == []


def test_it_runs_no_sequence_parallelism():
    """Its tensor-parallel ranks send 1/tp of a boundary and gather it whole on arrival (`PartitionedTensor`): a
    sequence-parallel tensor axis beside it is E611; Megatron-LM's and torch's pipelines take it."""
    sequence = _text().replace("tensor   = megatron over tp", "tensor   = megatron over tp with sequence_parallel")
    found = PIPE.errors(sequence)
    assert [d.code for d in found] == ["E611"] and "sequence parallelism" in found[0].message
    assert _errors(sequence.replace("implementation = deepspeed", "implementation = megatron")) == []
    assert _errors(sequence.replace("implementation = deepspeed", "implementation = torch")) == []


def test_the_search_offers_it_only_its_schedule():
    PIPE.assert_searched(microbatches=8)


def test_its_transfers_block_the_stages_and_its_reduction_follows_the_schedule():
    """Per microbatch, a stage after the first spends two transfers and one all-gather over tp in its forward, a
    stage before the last two transfers and two all-gathers in its backward (TrainSchedule's steps); nothing else
    of the stage changes. After the schedule ZeRO-1 all-reduces the gradients and all-gathers the updated
    parameters, neither beside any computation; its memory is Megatron-LM's pipeline's."""
    deepspeed, megatron = _plan(), _plan(implementation="megatron")
    ds, mg = estimate_plan(deepspeed), estimate_plan(megatron)
    links, work = plan_links(deepspeed), plan_work(deepspeed)
    transfer = pipeline_p2p_seconds(deepspeed.model, work, links)
    gather = collective_seconds("all_gather", work.tokens * deepspeed.model.hidden * work.precision.bytes, links.tp)
    assert transfer > 0 and gather > 0
    last = len(ds.stage_times) - 1
    for stage, (d, m) in enumerate(zip(ds.stage_times, mg.stage_times)):
        assert d.forward == pytest.approx(m.forward + (2 * transfer + gather if stage > 0 else 0.0))
        assert d.backward == pytest.approx(m.backward + (2 * transfer + 2 * gather if stage < last else 0.0))
        assert dataclasses.replace(d, forward=m.forward, input_grad=m.input_grad, comm=m.comm) == m
    grads, element = deepspeed.train.grad_dtype.bytes, deepspeed.train.precision.bytes
    exposed = max(collective_seconds("all_reduce", s.dense_params * grads, links.data)
                  + collective_seconds("all_gather", s.dense_params * element, links.data) for s in ds.stage_times)
    tail = ds.time.step - ds.time.pipeline
    assert tail == pytest.approx(exposed + ds.time.optimizer)  # the first stage's: it holds the embedding too
    assert tail > mg.time.step - mg.time.pipeline
    assert ds.time.step > mg.time.step
    assert [m.total for m in ds.memory] == [m.total for m in mg.memory]


def test_its_1f1b_meets_the_sizes_torchs_runs_also_for_each_data_ranks_share():
    """`plandsl run` runs the plan on torch's pipeline (docs/running.md), whose 1F1B refuses fewer microbatches than
    stages: a data rank's share of one microbatch over 4 stages is E502 as on the other pipelines (the checker
    returned after E610/E611 and passed it; run then failed building the job)."""
    shares = _text().replace("recompute: full", "recompute: full, batch_shares: [62, 2]")
    for implementation in ("deepspeed", "megatron", "torch"):
        assert _errors(shares.replace("implementation = deepspeed", f"implementation = {implementation}")) == \
            ["E502"], implementation
    assert _errors(_text().replace("global_batch: 64", "global_batch: 4")) == ["E502"]
