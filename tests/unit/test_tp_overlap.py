"""Tensor-parallel communication overlap, `tensor = megatron over tp with sequence_parallel, overlap`: the IR and
its dump, the checker (E417), `show`, and the cost model's decomposition (each sequence-parallel all-gather and
reduce-scatter chunked behind the GEMM it feeds or follows) against hand counts."""
from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from plandsl import api, ir
from plandsl.cli import main
from plandsl.cost.comm import collective_seconds
from plandsl.cost.compute import (
    OverlapGemm,
    Work,
    device_efficiency,
    overlap_gemms,
    userbuffers_share,
)
from plandsl.cost.estimate import plan_work
from plandsl.cost.layer import _exposed, estimate_layer_time, plan_links
from plandsl.ir.layers import layers_of
from plandsl.render.summary import describe_plan
from tests.support import generated_plan

PLAN = """\
import "clusters/dgx_h100"
plan p {{
  model   = llama(layers=4, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=32000, seq=8192{experts})
  cluster = dgx_h100 x 2
  mesh    = [dp = 2, tp = 8]
  train   = {{ global_batch: 16, micro_batch: 8{train} }}
  data    = zero3 over dp
  tensor  = megatron over tp{options}
}}
"""


def _plan(options=" with sequence_parallel, overlap", train="", experts="") -> ir.Plan:
    return api.loads(PLAN.format(options=options, train=train, experts=experts)).plans[0]


def _codes(options, train="") -> list[str]:
    return [d.code for d in api.checks(PLAN.format(options=options, train=train, experts="")).diagnostics]


def _block(plan: ir.Plan, work: Work | None = None):
    block = next(layer for layer in layers_of(plan.model) if layer.kind == "block")
    device = plan.cluster.devices_in_order()[0]
    return estimate_layer_time(plan.model, block, work or plan_work(plan), device, plan_links(plan))


def test_the_option_lowers_dumps_only_when_set_and_shows():
    plan = _plan()
    assert plan.tensor.overlap and plan.tensor.sequence_parallel
    assert plan.tensor.model_dump()["overlap"] is True
    plain = _plan(" with sequence_parallel")
    assert "overlap" not in plain.tensor.model_dump()  # plans without it dump and hash as before
    assert not _plan(" with sequence_parallel, overlap = false").tensor.overlap
    assert "megatron tp over tp + SP with overlap" in describe_plan(plan)
    assert "overlap" not in describe_plan(plain)


def test_E417_overlap_without_sequence_parallelism_or_under_eager_kernels():
    assert _codes(" with sequence_parallel, overlap") == []
    assert _codes(" with overlap") == ["E417"]
    assert _codes(" with sequence_parallel, overlap", ", kernels: eager") == ["E417"]
    text = PLAN.format(options=" with overlap", train="", experts="")
    found = api.checks(text).diagnostics
    assert "needs sequence parallelism" in found[0].message
    assert found[0].span.start == text.index("overlap")  # the option itself


def test_a_chunked_collective_exposes_one_chunk_and_what_it_exceeds_its_gemm_by():
    """Four chunks beside a GEMM of 1.0 s that takes 1.2 s as four: a 0.8 s collective (0.2 s a chunk, under the
    0.3 s GEMM chunk) leaves one chunk and the chunking's 0.2 s; a 2.0 s one (0.5 a chunk) also the three steps'
    excess of 0.2 s each."""
    gemm = OverlapGemm(whole=1.0, chunked=1.2, chunks=4)
    assert _exposed(0.8, gemm) == pytest.approx(0.2 + 0.2)
    assert _exposed(2.0, gemm) == pytest.approx(0.2 + 0.5 + 3 * 0.2)


def test_a_dense_block_hides_its_collectives_behind_the_four_gemms_by_hand():
    """tp 8 inside a DGX H100: the forward's four collectives (all-gather, reduce-scatter, twice) become what
    `_exposed` leaves beside the fused q/k/v, wo, fc1 and fc2; the backward's all-gathers what it leaves beside
    wo's and fc2's input gradients (an all-gather: nothing to sum), and its reduce-scatters (of the sums of q/k/v's
    and of w1/w3's input gradients, which torch's pass does not fuse) stay whole; the bytes moved do not change. A
    reduce-scatter's chunks are summed after they arrive: a pass over the block's [tokens, hidden] partial sums."""
    plain, overlapped = _block(_plan(" with sequence_parallel")), _block(_plan())
    plan = _plan()
    work, links = plan_work(plan), plan_links(plan)
    block = next(layer for layer in layers_of(plan.model) if layer.kind == "block")
    qkv, wo, fc1, fc2 = overlap_gemms(plan.model, work, plan.cluster.devices_in_order()[0])
    activation = work.tokens * 4096 * 2
    gather = collective_seconds("all_gather", activation, links.tp)
    scatter = collective_seconds("reduce_scatter", activation, links.tp)
    assert plain.forward_comm == pytest.approx(2 * (gather + scatter))
    assert overlapped.forward_comm == pytest.approx(_exposed(gather, qkv) + _exposed(scatter, wo)
                                                    + _exposed(gather, fc1) + _exposed(scatter, fc2))
    no_sum = [OverlapGemm(g.whole, g.chunked, g.chunks) for g in (wo, fc2)]  # the backward's all-gathers sum nothing
    assert overlapped.backward_comm == pytest.approx(_exposed(gather, no_sum[0]) + _exposed(gather, no_sum[1])
                                                     + 2 * scatter)
    assert _exposed(gather, wo) > _exposed(gather, no_sum[0])  # until 2026-12-05 they were charged the forward's sum
    assert overlapped.forward_comm < plain.forward_comm / 2 and overlapped.moved == plain.moved
    assert qkv.chunks == 8 and qkv.chunked > qkv.whole  # eight smaller GEMMs, each paying the kernel's fixed time
    device = plan.cluster.devices_in_order()[0]
    assert wo.reduction == fc2.reduction == pytest.approx(activation * (1 + 1 / 8) / device.bandwidth)
    assert qkv.reduction == fc1.reduction == 0.0
    assert block.kind == "block"


def test_full_recomputation_reruns_the_overlapped_forward():
    plain = _block(_plan(" with sequence_parallel", ", recompute: full"))
    overlapped = _block(_plan(train=", recompute: full"))
    assert overlapped.backward_comm - overlapped.forward_comm == pytest.approx(_block(_plan()).backward_comm)
    assert plain.backward_comm - plain.forward_comm == pytest.approx(_block(_plan(" with sequence_parallel")).backward_comm)


def test_small_microbatches_lose_to_the_chunked_gemms():
    """At one sequence of 512 tokens a chunk is 64 tokens: eight GEMMs each paying the kernel's fixed time cost more
    than the collectives they hide, and the cost model says so rather than hiding them anyway."""
    text = PLAN.format(options=" with sequence_parallel", train="", experts="").replace("seq=8192", "seq=512") \
        .replace("micro_batch: 8", "micro_batch: 1")
    plain = _block(api.loads(text).plans[0])
    overlapped = _block(api.loads(text.replace("sequence_parallel\n", "sequence_parallel, overlap\n")).plans[0])
    assert overlapped.forward_comm > plain.forward_comm


def test_experts_hide_only_the_attention_half():
    """The MoE dispatcher's all-gather and reduce-scatter are not Transformer Engine's linear layers: only the
    attention half's pair is chunked behind q/k/v and wo."""
    moe = _plan(experts=", experts=8, top_k=2")
    assert len(overlap_gemms(moe.model, plan_work(moe), moe.cluster.devices_in_order()[0])) == 2
    plain = _block(_plan(" with sequence_parallel", experts=", experts=8, top_k=2"))
    assert 0 < plain.forward_comm - _block(moe).forward_comm < plain.forward_comm


def test_nothing_overlaps_without_sequence_parallelism_or_a_tensor_axis():
    plan = _plan(" with sequence_parallel")
    work = plan_work(plan)
    without_sp = Work(work.micro_batch, work.seq, work.tp, sequence_parallel=False, overlap_tensor=True)
    assert _block(plan, without_sp) == _block(plan, Work(work.micro_batch, work.seq, work.tp))


def test_overlap_speeds_up_a_step_as_torchtitan_measured_async_tp():
    """Llama 3 70B's shapes at tp 8 with full recomputation: the step gains about what torchtitan's async TP
    benchmark measured (1.09x at 70B), not the whole tensor-parallel communication. The bound was 1.15 until NVLink
    was priced at the 360 GB/s NCCL reaches (2026-12-05, fifth session): the collectives the overlap hides are 25 %
    longer, 1.156x here (the torchtitan 70B row's modelled gain 1.14x against its measured 1.09x)."""
    text = PLAN.format(options=" with sequence_parallel", train=", recompute: full, param_dtype: bf16",
                       experts="").replace("layers=4, hidden=4096, heads=32, kv_heads=8, ffn=14336",
                                           "layers=8, hidden=8192, heads=64, kv_heads=8, ffn=28672")
    plain = api.estimate(api.loads(text).plans[0]).time.step
    overlapped = api.estimate(api.loads(text.replace("sequence_parallel\n", "sequence_parallel, overlap\n"))
                              .plans[0]).time.step
    assert 1.05 < plain / overlapped < 1.17


def test_generate_with_tensor_overlap_writes_it_and_estimates_what_it_predicted(tmp_path):
    """`generate --tensor-overlap`: a candidate with sequence parallelism is priced and written with overlap, and
    the written plan checks and estimates to the search's figure; `--from` that plan keeps it."""
    target = tmp_path / "best.plan"
    model = "llama(layers=4, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=32000, seq=8192)"
    out = CliRunner().invoke(main, ["generate", "--model", model, "--cluster", "dgx_h100", "--global-batch", "8",
                                    "--pin", "tp=8", "--tensor-overlap", "--top", "1", "-o", str(target)])
    assert out.exit_code == 0, out.output
    text = target.read_text(encoding="utf-8")
    assert "tensor  = megatron over tp with sequence_parallel, overlap" in text
    plan = api.load_plan(target)
    predicted = float(text.split("#   step ")[1].split(" s")[0])
    assert api.estimate(plan).time.step == pytest.approx(predicted, rel=1e-3)
    partial = tmp_path / "partial.plan"
    partial.write_text(text.replace("  data    = zero3 over dp\n", ""), encoding="utf-8")
    again = CliRunner().invoke(main, ["generate", "--from", str(partial), "--top", "1", "-o", str(tmp_path / "c.plan")])
    assert again.exit_code == 0, again.output
    assert "with sequence_parallel, overlap" in (tmp_path / "c.plan").read_text(encoding="utf-8")


def test_generate_with_tensor_overlap_userbuffers_prices_and_writes_transformer_engines(tmp_path):
    """`generate --tensor-overlap userbuffers`: the search prices Transformer Engine's overlap (not async TP's) and
    writes `overlap = userbuffers`, which checks clean and estimates to the search's figure; under `kernels:
    eager` too, which E417 refuses for async TP only."""
    model = "llama(layers=4, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=32000, seq=8192)"
    request = {"model": model, "cluster": "dgx_h100", "global_batch": 8, "pins": ("tp=8",), "top": 1, "time_limit": 0}
    text, plan = generated_plan(tmp_path, tensor_overlap="userbuffers", **request)
    assert "tensor  = megatron over tp with sequence_parallel, overlap = userbuffers\n" in text
    assert plan.tensor.userbuffers and plan.tensor.sequence_parallel and plan.tensor.sm_margin
    assert api.check(tmp_path / "generated.plan").diagnostics == []
    as_async = api.loads(text.replace("overlap = userbuffers", "overlap"), path=str(tmp_path / "a.plan")).plans[0]
    assert api.estimate(as_async).time.step != pytest.approx(api.estimate(plan).time.step, rel=1e-6)
    text, plan = generated_plan(tmp_path, tensor_overlap="userbuffers", kernels="eager", **request)
    assert "kernels: eager" in text and plan.tensor.userbuffers
    assert api.check(tmp_path / "generated.plan").diagnostics == []


def test_run_takes_the_plan_and_computes_the_same_step(tmp_path, monkeypatch):
    """`plandsl run` refuses nothing for the option: the interpreter's tensor parallelism computes the same step
    with or without it (overlap changes when collectives run, not what they compute; `plandsl run
    stdlib_plans/local/tp_sp.plan` with `overlap` added passes --check-equivalence)."""
    local = Path(__file__).resolve().parents[2] / "stdlib_plans" / "local"
    text = (local / "tp_sp.plan").read_text(encoding="utf-8")
    path = tmp_path / "tp_sp_overlap.plan"
    path.write_text(text.replace("with sequence_parallel", "with sequence_parallel, overlap"), encoding="utf-8")
    monkeypatch.setenv("PLANDSL_PATH", str(local))
    plan = api.load_runnable(path, cuda=False)
    assert plan.tensor.overlap and plan.tensor.sequence_parallel


def test_every_row_parallel_gemm_feeds_a_summed_reduce_scatter_whatever_its_width():
    """wo and fc2 (the odd entries) end in the reduce-scatter whose chunks torch then sums; a GPT's fc2 at tp = 4
    reads ffn / tp = h features, which a test by width would miss."""
    from plandsl import ir
    from plandsl.cost.compute import Work, overlap_gemms
    device = ir.DeviceType(name="h", memory=80 * 2**30, bandwidth=3.35e12, peak={"bf16": 989e12, "fp32": 67e12})
    gpt = ir.TransformerModel(kind="gpt", name="g", layers=2, hidden=6144, heads=48, kv_heads=48, ffn_hidden=24576,
                              seq=4096, vocab=1000)
    for tp in (2, 4):
        reductions = [g.reduction for g in overlap_gemms(gpt, Work(1, 4096, tp=tp, sequence_parallel=True), device)]
        assert reductions[0] == reductions[2] == 0.0 and reductions[1] == reductions[3] > 0.0, (tp, reductions)


# ---- which implementation overlaps: torch's async TP or Transformer Engine's userbuffers -------------------------
def test_the_implementation_lowers_dumps_only_when_not_async_tp_and_shows():
    """`overlap` alone is async TP (and dumps as before); `overlap = userbuffers` and its `sm_margin = false` dump;
    `sm_margin` without userbuffers is E206; userbuffers compiles nothing, so `kernels: eager` is no E417."""
    assert _plan(" with sequence_parallel, overlap = async_tp").tensor.model_dump() == _plan().tensor.model_dump()
    ub = _plan(" with sequence_parallel, overlap = userbuffers").tensor
    assert ub.userbuffers and ub.sm_margin and ub.model_dump()["implementation"] == ir.TensorOverlap.userbuffers
    assert "sm_margin" not in ub.model_dump()
    plain = _plan(" with sequence_parallel, overlap = userbuffers, sm_margin = false").tensor
    assert plain.model_dump()["sm_margin"] is False \
        and plain.options_text() == " with sequence_parallel, overlap = userbuffers, sm_margin = false"
    assert "with overlap (userbuffers, no SM margin)" in describe_plan(
        _plan(" with sequence_parallel, overlap = userbuffers, sm_margin = false"))
    assert _codes(" with sequence_parallel, sm_margin = false") == ["E206"]
    assert _codes(" with sequence_parallel, overlap, sm_margin = false") == ["E206"]
    assert _codes(" with sequence_parallel, overlap = userbuffers", ", kernels: eager") == []
    assert _codes(" with overlap = userbuffers") == ["E417"]  # still the sequence-parallel collectives


# ---- whose tensor parallelism runs the layers: `implementation = torch | megatron` ------------------------------------
def test_the_stack_is_torchs_unless_userbuffers_or_written_and_dumps_only_when_written_otherwise():
    """Not written, a tensor line is torch's (DTensor's styles, as `plandsl run` and torchtitan split a block), or
    Megatron-LM's where `overlap = userbuffers` (Transformer Engine's) says so; the plan dumps `stack` only where it
    is written otherwise, so that existing plans dump (and hash) as before; `options_text` writes it back."""
    for options, stack in ((" with sequence_parallel", "torch"), (" with sequence_parallel, overlap", "torch"),
                           (" with sequence_parallel, overlap = userbuffers", "megatron")):
        tensor = _plan(options).tensor
        assert tensor.stack == stack and "stack" not in tensor.model_dump(), options
        assert tensor.options_text() == options
    for options in (" with sequence_parallel, overlap = userbuffers", " with sequence_parallel",
                    " with sequence_parallel, implementation = megatron"):  # a dump reads back as the line said
        tensor = _plan(options).tensor
        for mode in ("python", "json"):
            assert ir.TensorParallel.model_validate(tensor.model_dump(mode=mode)).stack == tensor.stack, (options, mode)
    written = _plan(" with sequence_parallel, implementation = megatron").tensor
    assert written.stack == "megatron" and written.model_dump()["stack"] == "megatron" and not written.saves_gathered
    assert written.options_text() == " with sequence_parallel, implementation = megatron"
    assert "+ SP, Megatron-LM's layers" in describe_plan(_plan(" with sequence_parallel, implementation = megatron"))
    assert _plan(" with sequence_parallel, implementation = torch").tensor.model_dump() == \
        _plan(" with sequence_parallel").tensor.model_dump()
    assert _plan(" with implementation = megatron").tensor.options_text() == " with implementation = megatron"
    assert _plan(" with sequence_parallel").tensor.saves_gathered and not _plan("").tensor.saves_gathered
    text = PLAN.format(options=" with sequence_parallel,  implementation=megatron", train="", experts="")
    assert "tensor  = megatron over tp with sequence_parallel, implementation = megatron" in api.format_text(text)


def test_an_overlap_says_whose_tensor_parallelism_and_a_contrary_implementation_is_e206():
    assert _codes(" with sequence_parallel, overlap, implementation = megatron") == ["E206"]  # async TP is torch's
    assert _codes(" with sequence_parallel, overlap = userbuffers, implementation = torch") == ["E206"]
    assert _codes(" with sequence_parallel, overlap = userbuffers, implementation = megatron") == []
    assert _codes(" with sequence_parallel, implementation = jax") != []


def test_generate_writes_megatrons_tensor_parallelism_and_counts_its_shards(tmp_path):
    """`generate --tensor-implementation megatron` searches and writes Megatron-LM's tensor parallelism: the plan says
    `implementation = megatron` (which sequence parallelism alone would not) and holds less activation memory than
    the same plan as torch's, by the two gathered inputs per block the shards leave out; torch's also holds the
    embedding's gradient over the whole vocabulary (no data parallelism: kept till the next step's zero_grad,
    `cost.memory.whole_vocab_gradient_bytes`), Megatron-LM's its rows' only."""
    model = "llama(layers=4, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=32000, seq=8192)"
    request = {"model": model, "cluster": "dgx_h100", "global_batch": 8, "pins": ("tp=8", "sequence_parallel=true"),
               "top": 1, "time_limit": 0}
    text, plan = generated_plan(tmp_path, tensor_implementation="megatron", **request)
    assert "with sequence_parallel, implementation = megatron\n" in text and plan.tensor.stack == "megatron"
    as_torch = api.loads(text.replace(", implementation = megatron", ""), path=str(tmp_path / "t.plan")).plans[0]
    megatron, torch_ = api.estimate(plan).memory[0], api.estimate(as_torch).memory[0]
    assert torch_.activations > megatron.activations and torch_.stored_states == megatron.stored_states
    assert torch_.states - megatron.states == (32000 - 32000 // 8) * 4096 * 4
    with pytest.raises(api.generate_usage_error()):
        api.generate(api.generate_request(tensor_implementation="torch", tensor_overlap="userbuffers", **request))


def _ub_by_hand(margin: bool):
    """A dense block under userbuffers priced from TE's defaults: 16 of the H100's 132 SMs (NCCL's 24 channels are
    its comm_share, 24/132), the forward's reduce-scatters pipelined in 4 chunks on 3 streams, the all-gathers
    ring-exchanged in tp chunks on the copy engines, the backward's column-parallel GEMMs beside the bulk all-gather
    and reduce-scatter."""
    plan = _plan(" with sequence_parallel, overlap = userbuffers" + ("" if margin else ", sm_margin = false"))
    work, links, device = plan_work(plan), plan_links(plan), plan.cluster.devices_in_order()[0]
    efficiency = device_efficiency(device)
    share = 16 / 132
    assert userbuffers_share(device) == pytest.approx(share)
    tokens, h, tp, precision = work.tokens, 4096, 8, work.precision
    shapes = [((4096 + 2 * 1024) / tp, h), (h, 4096 / tp), (2 * 14336 / tp, h), (h, 14336 / tp)]
    gather = collective_seconds("all_gather", tokens * h * 2, links.tp)
    scatter = collective_seconds("reduce_scatter", tokens * h * 2, links.tp)
    forward = backward = 0.0
    for (qkv_out, qkv_in), (row_out, row_in) in (shapes[:2], shapes[2:]):
        column = efficiency.gemm_seconds(tokens, qkv_out, qkv_in, device, precision)
        ring = OverlapGemm(column, efficiency.chunked_gemm_seconds(tokens, qkv_out, qkv_in, device, precision, tp, 3), tp)
        row = efficiency.gemm_seconds(tokens, row_out, row_in, device, precision)
        split = efficiency.chunked_gemm_seconds(row_out, tokens, row_in, device, precision, 4, 3)
        pipelined = OverlapGemm(row, split / (1 - share), 4) if margin else OverlapGemm(row, split, 4, share=share)
        row_ring = OverlapGemm(row, efficiency.chunked_gemm_seconds(tokens, row_out, row_in, device, precision, tp, 3), tp)
        forward += _exposed(gather, ring) + _exposed(scatter, pipelined)
        if margin:  # the input and weight gradients at 116/132 of their speed, each collective beside one
            slowed = column * 132 / 116
            bulk = 2 * (slowed - column) + max(0.0, gather - slowed) + max(0.0, scatter - slowed)
        else:  # all SMs, but the 16 the collective holds while it runs
            bulk = max(gather - column, share * gather) + max(scatter - column, share * scatter)
        backward += _exposed(gather, row_ring) + bulk
    return plan, forward, backward


@pytest.mark.parametrize("margin", [True, False])
def test_userbuffers_prices_its_sms_and_hides_the_backward_reduce_scatter_by_hand(margin):
    plan, forward, backward = _ub_by_hand(margin)
    block = _block(plan)
    assert block.forward_comm == pytest.approx(forward, rel=1e-9)
    assert block.backward_comm == pytest.approx(backward, rel=1e-9)
    assert block.moved == _block(_plan()).moved  # the bytes moved do not change


def test_the_margin_costs_what_its_sms_are_and_async_tp_takes_none():
    """With the margin the column-parallel input and weight gradients run at 116/132 of their speed; of each pair at
    least one's 16/116 more seconds is exposed (both while the GEMMs outlast the bulk collectives beside them, one
    where a collective outlasts its slowed GEMM and hides the other's: at NVLink's 360 GB/s the all-gathers do here,
    and the bound, 2 x 0.5 of both before, is 0.9 of one);
    async TP's copy engines slow no GEMM (its backward reduce-scatters stay whole instead)."""
    margin, no_margin = _block(_ub_by_hand(True)[0]), _block(_ub_by_hand(False)[0])
    assert margin.backward_comm > no_margin.backward_comm and margin.forward_comm > no_margin.forward_comm
    plan = _plan()
    qkv, _, fc1, _ = overlap_gemms(plan.model, plan_work(plan), plan.cluster.devices_in_order()[0])
    # 0.99x here: without the margin a collective shorter than its GEMM still takes its own SMs (share x its seconds)
    assert margin.backward_comm - no_margin.backward_comm > (qkv.whole + fc1.whole) * (16 / 116) * 0.9
    assert OverlapGemm(1.0, 1.0, 4).share == 0.0 and qkv.share == 0.0
