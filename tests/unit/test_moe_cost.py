"""The mixture-of-experts terms of the cost model, each against a hand count: the dispatch and combine
all-to-alls of a known layout inside a node and across nodes, their overlap with the other microbatch's
computation (`experts = alltoall over ep with overlap`: combined 1F1B's three phases), the experts' grouped GEMM as
Transformer Engine runs it (one GEMM per local expert on four streams), the router outside FP8, and the FP8 padding
copies of the routed tokens (Megatron-Core's `TEGroupedMLP`)."""
from __future__ import annotations

import dataclasses

import pytest

from plandsl import api, ir
from plandsl.cost.comm import collective_seconds
from plandsl.cost.compute import (
    FP8_PADDING_COPIES,
    GROUPED_GEMM_STREAMS,
    SORT_CHUNKS_COPIES,
    Efficiency,
    LayerCompute,
    estimate_layer_compute,
)
from plandsl.cost.estimate import plan_work
from plandsl.cost.layer import combined_1f1b_exposed, estimate_layer_time, plan_links
from plandsl.interop import export_plan, import_text
from plandsl.ir.layers import layers_of

# Qwen3-30B-A3B's shapes on two DGX H100 nodes: 128 experts, top 8, hidden 2048, 768 wide
PLAN = """\
import "clusters/dgx_h100"
plan p {{
  model    = llama(layers=4, hidden=2048, heads=32, kv_heads=4, head_dim=128, ffn=768, experts=128, top_k=8,
                   vocab=151936, seq=4096)
  cluster  = dgx_h100 x 2
  mesh     = [{mesh}]
  train    = {{ global_batch: 64, micro_batch: 1, precision: {precision} }}
  data     = zero1 over dp
  experts  = {kind} over ep{overlap}
{extra}}}
"""


def _text(mesh="dp = 2, ep = 8", overlap=False, precision="bf16", extra="", kind="alltoall") -> str:
    """The plan's text; without a dp axis, without its data line (test_moe_dispatch writes other dispatchers)."""
    text = PLAN.format(mesh=mesh, overlap=" with overlap" if overlap else "", precision=precision, extra=extra,
                       kind=kind)
    return text if "dp" in mesh else text.replace("  data     = zero1 over dp\n", "")


def _plan(mesh="dp = 2, ep = 8", overlap=False, precision="bf16", extra="", kind="alltoall") -> ir.Plan:
    return api.loads(_text(mesh, overlap, precision, extra, kind)).plans[0]


def _block_time(plan: ir.Plan):
    block = next(layer for layer in layers_of(plan.model) if layer.kind == "block")
    device = plan.cluster.devices_in_order()[0]
    work = plan_work(plan)
    return (estimate_layer_time(plan.model, block, work, device, plan_links(plan)),
            estimate_layer_compute(plan.model, block, work, device))


def test_all_to_all_bytes_and_links_by_hand():
    """Each device dispatches its 4,096 tokens x top_k 8 x 2,048 x 2 bytes = 134 MB to the experts and combines as
    many back, twice each way: inside a node over NVLink (7/8 of it at the 360 GB/s NCCL reaches); over two nodes (ep = 16, 8 per
    node) 8/16 of the bytes leave the node at the NIC's 50 GB/s per GPU and 7/16 stay on NVLink."""
    routed = 4096 * 8 * 2048 * 2
    inside, _ = _block_time(_plan())
    assert inside.moved.expert == pytest.approx(4 * routed)
    links = plan_links(_plan())
    assert (links.ep.size, links.ep.local, links.ep.nodes) == (8, 8, 1)
    a2a = collective_seconds("all_to_all", routed, links.ep)
    assert a2a == pytest.approx(7 * 2e-6 + 7 / 8 * routed / 360e9)
    across = plan_links(_plan(mesh="ep = 16"))
    assert (across.ep.size, across.ep.local, across.ep.nodes) == (16, 8, 2)
    a2a_across = collective_seconds("all_to_all", routed, across.ep)
    nic = 400e9 / 8  # 8 x 400 Gb/s per node, one rail per GPU
    assert a2a_across == pytest.approx(7 * 2e-6 + 8 * across.ep.inter_latency + 7 / 16 * routed / 360e9
                                       + 8 / 16 * routed / nic)
    assert a2a_across > 4 * a2a  # 4.6x: half the bytes at the NIC's 50 GB/s against NVLink's 360 (5.8x at 450)


def test_overlap_hides_each_all_to_all_behind_the_sub_module_combined_1f1b_pairs_it_with():
    """Without overlap the forward waits for dispatch and combine (2 all-to-alls), the backward for their
    gradients (2). With it, Megatron-Core's combined 1F1B runs three phases per layer (`TransformerLayerSchedulePlan
    .run`): the backward's combine beside the forward's attention, the forward's and then the backward's dispatch
    beside the experts' backward, weight gradients and forward, the forward's combine beside the backward's
    attention; each phase as long as its longer stream, the middle one's exposure split between the passes."""
    mesh = "ep = 16"
    plain, compute = _block_time(_plan(mesh))
    overlapped, _ = _block_time(_plan(mesh, overlap=True))
    a2a = collective_seconds("all_to_all", 4096 * 8 * 2048 * 2, plan_links(_plan(mesh)).ep)
    assert plain.forward_comm == pytest.approx(2 * a2a) and plain.backward_comm == pytest.approx(2 * a2a)
    plan = _plan(mesh, overlap=True)
    block = next(layer for layer in layers_of(plan.model) if layer.kind == "block")
    device = plan.cluster.devices_in_order()[0]
    perfect = estimate_layer_time(plan.model, block, plan_work(plan), device.model_copy(update={"comm_share": 0.0}),
                                  plan_links(plan))  # all-to-alls that take nothing from the computation beside them
    experts_f, experts_i, experts_w = compute.experts_forward, compute.experts_input_grad, compute.experts_weight_grad
    attention_f, attention_b = compute.forward - experts_f, compute.backward - experts_i - experts_w
    assert 0 < experts_f < compute.forward and 0 < experts_i + experts_w < compute.backward
    first, last = max(0.0, a2a - attention_f), max(0.0, a2a - attention_b)
    # comp: experts' dgrad, wgrad, then their forward once its dispatch is in; comm: the forward's dispatch, then
    # the backward's once the dgrad is done
    end = max(max(experts_i + experts_w, a2a) + experts_f, max(a2a, experts_i) + a2a)
    middle = end - (experts_i + experts_w + experts_f)
    assert perfect.forward_comm == pytest.approx(last + middle / 2)
    assert perfect.backward_comm == pytest.approx(first + middle / 2)
    # by default they take the device's share of it while they run (cost.comm.beside), phase by phase
    share = device.contention
    assert overlapped.forward_comm == pytest.approx(max(a2a - attention_b, share * a2a)
                                                    + max(middle, share * 2 * a2a) / 2)
    assert overlapped.backward_comm == pytest.approx(max(a2a - attention_f, share * a2a)
                                                     + max(middle, share * 2 * a2a) / 2)
    assert overlapped.forward_comm < plain.forward_comm and overlapped.moved == plain.moved


def test_combined_1f1b_phases_by_hand():
    """A layer of forward 3 ms (experts 1) and backward 6 ms (experts' input gradients 1, weight gradients 1), its
    all-to-alls 2.5 ms each, no SMs taken: the backward's combine waits 2.5 - 2 = 0.5 beyond the forward's attention;
    the forward's combine hides behind the backward's 4 of attention; in the middle phase the backward's dispatch
    starts at 2.5 (after the forward's, the dgrad long done) and ends at 5, where the experts' 3 ms of compute end
    at 2.5 + 1 = 3.5: 2 exposed, half to each pass. With all-to-alls of 0.1 ms and share 0.2 every one hides, each
    costing the computation beside it 0.2 of its length."""
    layer = LayerCompute(2e-3, 1e-3, 4e-3, 2e-3, 0.0, experts_forward=1e-3, experts_input_grad=1e-3,
                         experts_weight_grad=1e-3)
    assert (layer.forward, layer.backward) == pytest.approx((3e-3, 6e-3))
    assert combined_1f1b_exposed(2.5e-3, layer, 0.0) == pytest.approx((0.0 + 1e-3, 0.5e-3 + 1e-3))
    assert combined_1f1b_exposed(0.1e-3, layer, 0.2) == pytest.approx((0.02e-3 + 0.02e-3, 0.02e-3 + 0.02e-3))
    assert combined_1f1b_exposed(0.0, layer, 0.2) == (0.0, 0.0)


def _block_compute(precision: str, kind: str, mesh: str = "ep = 16"):
    plan = _plan(mesh=mesh, precision=precision, kind=kind)
    layer = next(layer for layer in layers_of(plan.model) if layer.kind == "block")
    return estimate_layer_compute(plan.model, layer, plan_work(plan), plan.cluster.devices_in_order()[0])


# 2 copies a pass of 4,096 tokens x top_k 8 x 2,048, each read and written at 2 bytes: 537 MB, 160 us at 3.35 TB/s
COPIES = 2 * 2 * 4096 * 8 * 2048 * 2 / 3350e9


def test_fp8_pads_the_routed_tokens_unless_the_dispatcher_does():
    """Under FP8, TEGroupedMLP pads each local expert's rows (Fp8Padding) and unpads the output (Fp8Unpadding), and
    the backward copies the gradients back: 2 copies a pass (DeepEP's tokens too); HybridEP pads inside its dispatch
    (no copy); bf16 pads nothing."""
    assert FP8_PADDING_COPIES == 2 and COPIES == pytest.approx(160.3e-6, rel=1e-3)
    padded, unpadded = _block_compute("fp8", "deepep"), _block_compute("fp8", "hybridep")
    assert padded.forward_other - unpadded.forward_other == pytest.approx(COPIES)
    assert padded.backward_other - unpadded.backward_other == pytest.approx(COPIES)
    assert padded.experts_forward - unpadded.experts_forward == pytest.approx(COPIES)
    assert padded.experts_input_grad - unpadded.experts_input_grad == pytest.approx(COPIES)
    assert padded.forward_matmul == unpadded.forward_matmul
    assert _block_compute("bf16", "deepep") == _block_compute("bf16", "hybridep")


def test_the_alltoall_dispatcher_sorts_the_tokens_by_local_expert_and_back():
    """With 8 local experts (ep 16) Megatron-Core's alltoall dispatcher sorts the tokens the all-to-all brought by
    local expert and back (sort_chunks_by_idxs), and the backward copies the gradients the same two ways: 2 copies a
    pass more than the flex dispatcher's; with one local expert (ep 128 over 16 nodes) there is nothing to sort."""
    assert SORT_CHUNKS_COPIES == 2
    sorted_, flex = _block_compute("bf16", "alltoall"), _block_compute("bf16", "deepep")
    assert sorted_.forward_other - flex.forward_other == pytest.approx(COPIES)
    assert sorted_.backward_other - flex.backward_other == pytest.approx(COPIES)
    assert sorted_.experts_forward - flex.experts_forward == pytest.approx(COPIES)
    one = _text(mesh="ep = 128").replace("dgx_h100 x 2", "dgx_h100 x 16").replace("global_batch: 64", "global_batch: 128")
    plan = api.loads(one).plans[0]
    layer = next(layer for layer in layers_of(plan.model) if layer.kind == "block")
    device = plan.cluster.devices_in_order()[0]
    alone = estimate_layer_compute(plan.model, layer, plan_work(plan), device)
    flex_plan = api.loads(one.replace("alltoall over ep", "deepep over ep")).plans[0]
    assert alone == estimate_layer_compute(flex_plan.model, layer, plan_work(flex_plan), device)


def test_the_experts_share_of_the_layer_is_their_grouped_gemms_and_element_wise_work():
    """The experts' weight-gradient seconds are their two grouped GEMMs' (fc1 768 x 2 wide, fc2), 8 local experts of
    4,096 x 8 x 16 / 128 = 4,096 routed tokens each at ep 16; the forward adds the SwiGLU's 3 x 768 elements of each
    of the 8 routed copies per token (read 2, write 1) at 2 bytes, the input gradients twice that, and each pass the
    alltoall dispatcher's two sorting copies."""
    plan = _plan(mesh="ep = 16")
    layer = next(layer for layer in layers_of(plan.model) if layer.kind == "block")
    device = plan.cluster.devices_in_order()[0]
    compute = estimate_layer_compute(plan.model, layer, plan_work(plan), device)
    knobs = Efficiency(0.75, 20e-6)
    own = estimate_layer_compute(plan.model, layer, plan_work(plan), device, knobs)
    gemms = knobs.grouped_gemm_seconds(4096, 2 * 768, 2048, device, ir.Precision.bf16, 8) \
        + knobs.grouped_gemm_seconds(4096, 2048, 768, device, ir.Precision.bf16, 8)
    assert own.experts_weight_grad == pytest.approx(gemms)
    swiglu = 4096 * 8 * 3 * 768 * 2 / 3350e9
    assert own.experts_forward == pytest.approx(gemms + swiglu + COPIES)  # and the dispatcher's sorting copies
    assert own.experts_input_grad == pytest.approx(gemms + 2 * swiglu + COPIES)
    assert compute.experts_forward < compute.forward


def test_shared_experts_run_on_the_experts_side():
    """A shared expert (one MLP of 768 over every token) is in combined 1F1B's `mlp` node with the routed experts
    (`submodule_moe_forward`: `shared_experts_compute`): its two GEMMs join the experts' seconds, weight gradients
    included, and its SwiGLU's 3 x 768 elements per token their element-wise work."""
    knobs = Efficiency(0.75, 20e-6)
    def block(extra):
        plan = api.loads(_text(mesh="ep = 16").replace("top_k=8,", "top_k=8," + extra)).plans[0]
        layer = next(layer for layer in layers_of(plan.model) if layer.kind == "block")
        return estimate_layer_compute(plan.model, layer, plan_work(plan), plan.cluster.devices_in_order()[0], knobs)
    routed, shared = block(""), block(" shared_experts=1,")
    device = _plan().cluster.devices_in_order()[0]
    gemms = knobs.gemm_seconds(4096, 2 * 768, 2048, device, ir.Precision.bf16) \
        + knobs.gemm_seconds(4096, 2048, 768, device, ir.Precision.bf16)
    assert shared.experts_weight_grad - routed.experts_weight_grad == pytest.approx(gemms)
    assert shared.experts_forward - routed.experts_forward == pytest.approx(gemms + 4096 * 3 * 768 * 2 / 3350e9)
    assert shared.forward - routed.forward == pytest.approx(shared.experts_forward - routed.experts_forward)


def test_grouped_gemm_pays_the_kernel_time_once_per_round_of_streams():
    """16 local experts on 4 streams: 16 GEMMs' FLOPs and bytes, 4 kernel times (not 1, as one batched kernel;
    not 16, as one stream)."""
    knobs = Efficiency(0.75, 20e-6)
    device = _plan().cluster.devices_in_order()[0]
    one = knobs.gemm_seconds(2048, 1536, 2048, device, ir.Precision.bf16)
    grouped = knobs.grouped_gemm_seconds(2048, 1536, 2048, device, ir.Precision.bf16, 16)
    assert GROUPED_GEMM_STREAMS == 4
    assert grouped == pytest.approx(16 * (one - 20e-6) + 4 * 20e-6)
    assert knobs.grouped_gemm_seconds(2048, 1536, 2048, device, ir.Precision.bf16, 5) == \
        pytest.approx(5 * (one - 20e-6) + 2 * 20e-6)


class _Recording:
    """An efficiency that records the precision of every GEMM it prices, by its (m, n, k)."""

    def __init__(self):
        self.knobs, self.calls = Efficiency(0.75, 20e-6), []

    def gemm_seconds(self, m, n, k, device, precision, count=1.0):
        self.calls.append(((m, n, k), precision))
        return self.knobs.gemm_seconds(m, n, k, device, precision, count)

    def grouped_gemm_seconds(self, m, n, k, device, precision, count):
        self.calls.append(((m, n, k), precision))
        return self.knobs.grouped_gemm_seconds(m, n, k, device, precision, count)

    def kernel(self, *args):
        return self.knobs.kernel(*args)

    def attention_seconds(self, *args):
        return self.knobs.attention_seconds(*args)


def test_the_router_stays_out_of_fp8():
    """Transformer Engine's FP8 covers its own linear layers; the router is a plain one: its GEMM (4,096 tokens x
    2,048 -> 128 experts) runs in bf16 under `precision: fp8`, the experts' grouped GEMMs in FP8."""
    plan = _plan(precision="fp8")
    block = next(layer for layer in layers_of(plan.model) if layer.kind == "block")
    recording = _Recording()
    estimate_layer_compute(plan.model, block, plan_work(plan), plan.cluster.devices_in_order()[0], recording)
    by_shape = dict(recording.calls)
    assert by_shape[(4096, 128, 2048)] is ir.Precision.bf16
    routed = 4096 * 8 * 8 / 128  # tokens per local expert
    assert by_shape[(routed, 2 * 768, 2048)] is ir.Precision.fp8 and by_shape[(routed, 2048, 768)] is ir.Precision.fp8


def test_overlap_is_written_exported_and_imported():
    plan = _plan(mesh="dp = 2, ep = 8", overlap=True)
    assert plan.experts.overlap and not _plan().experts.overlap
    exported = export_plan(plan, "megatron")
    assert "--overlap-moe-expert-parallel-comm" in exported.text and "--delay-wgrad-compute" in exported.text
    imported = import_text("megatron", exported.text, "plan.args", world_size=16)
    assert imported.ok and "with overlap" in imported.text
    # megatron-core refuses it with one virtual stage per pipeline rank: check refuses such a plan (E419), and the
    # import refuses the flags (E805)
    piped = _plan(mesh="pp = 2, ep = 8", overlap=True,
                  extra="  stages   = evenly over pp with virtual = 2\n  schedule = interleaved_1f1b\n")
    args = export_plan(piped, "megatron").text
    assert "--overlap-moe-expert-parallel-comm" in args and "--num-virtual-stages-per-pipeline-rank 2" in args
    assert import_text("megatron", args, "plan.args", world_size=16).ok
    unpaired = args.replace("--num-virtual-stages-per-pipeline-rank 2", "")
    assert [d.code for d in import_text("megatron", unpaired, "plan.args", world_size=16).diagnostics] == ["E805"]


@pytest.mark.parametrize("shared", [0, 1])
def test_expert_tensor_parallelism_gathers_the_routed_copies(shared):
    """Experts split over the tensor axis under sequence parallelism: Megatron-Core's alltoall dispatcher
    all-gathers the top_k routed copies of each token over the axis and reduce-scatters them back, so a block moves
    the attention half's [b, s, h] pair and 8 times that for the experts, each way (shared experts: their own
    [b, s, h] pair besides)."""
    text = _text(mesh="tp = 2", extra="  tensor   = megatron over tp with sequence_parallel\n")
    text = text.replace("  experts  = alltoall over ep\n", "")
    if shared:
        text = text.replace("top_k=8,", "top_k=8, shared_experts=1,")
    plan = api.loads(text).plans[0]
    time, _ = _block_time(plan)
    activation = 4096 * 2048 * 2
    pairs = 2 * (2 + 2 * 8 + 2 * shared)  # forward and backward: (attention + routed copies + shared) x (AG + RS)
    assert time.moved.tensor == pytest.approx(pairs * activation)
    links = plan_links(plan)

    def pair(size):
        return collective_seconds("all_gather", size, links.tp) + collective_seconds("reduce_scatter", size, links.tp)
    assert time.forward_comm == pytest.approx(pair(activation) * (1 + shared) + pair(8 * activation))


def test_one_microbatch_has_no_other_pass_to_hide_behind():
    """`with overlap` hides one microbatch's all-to-alls behind another's computation: with one microbatch per step
    there is none, so they wait in full, in the estimate and in the search alike."""
    from plandsl.search import Problem, parse_pins, search
    text = _text(overlap=True)
    one = api.loads(text.replace("global_batch: 64", "global_batch: 16")).plans[0]
    plain = api.loads(text.replace("global_batch: 64", "global_batch: 16").replace(" with overlap", "")).plans[0]
    assert one.num_microbatches == 1 and _plan().num_microbatches == 4
    assert _block_time(one)[0].forward_comm == pytest.approx(_block_time(plain)[0].forward_comm)
    assert _block_time(_plan(overlap=True))[0].forward_comm < _block_time(_plan())[0].forward_comm  # 4: hidden
    pins = parse_pins(["dp=2", "ep=8", "mb=1", "pp=1", "tp=1", "cp=1", "zero=1", "recompute=none"])
    steps = [search(Problem(one.model, one.cluster, 16, one.seq, overlap_experts=overlap), pins=pins, top=1)
             .best.estimate.time.step for overlap in (True, False)]
    assert steps[0] == pytest.approx(steps[1], rel=1e-12)


def test_E418_full_recomputation_beside_the_experts_overlap():
    """Megatron-Core refuses `--overlap-moe-expert-parallel-comm` with full recomputation (TransformerConfig: 'disable
    full recomputation when enabling overlap_moe_expert_parallel_comm'): E418 at the recompute key, for every block or
    some; selective recomputation, or full of none (`recompute_layers: 0`), passes, and is exported with the overlap."""
    def codes(recompute, overlap=True):
        text = _text(overlap=overlap).replace("precision: bf16", f"precision: bf16, recompute: {recompute}")
        return [d.code for d in api.checks(text).diagnostics]
    assert codes("full") == ["E418"] and codes("full, recompute_layers: 2") == ["E418"]
    assert codes("full", overlap=False) == codes("selective") == codes("full, recompute_layers: 0") == []
    plan = api.loads(_text(overlap=True).replace("precision: bf16", "precision: bf16, recompute: selective")).plans[0]
    exported = export_plan(plan, "megatron")
    assert not exported.lost and "--overlap-moe-expert-parallel-comm" in exported.text
    full = exported.text.replace("--recompute-granularity selective", "--recompute-granularity full --recompute-method "
                                 "uniform --recompute-num-layers 1")
    assert [d.code for d in import_text("megatron", full, "plan.args", world_size=16).diagnostics] == ["E805"]


def test_the_search_proposes_no_full_recomputation_beside_the_experts_overlap():
    """With `overlap_experts` the search leaves full recomputation out (E418), even where memory would want it, and a
    pin of it is a SearchError naming E418; without the overlap the same search recomputes in full."""
    from plandsl.search import Problem, SearchError, search
    plan = _plan(overlap=True)
    pins = ["dp=2", "ep=8", "pp=1", "tp=1", "cp=1", "zero=1", "mb=4"]
    problem = Problem(plan.model, plan.cluster, 64, plan.seq, overlap_experts=True)
    chosen = {s.candidate.recompute for s in search(problem, pins=pins, top=8).candidates}
    without = {s.candidate.recompute
               for s in search(dataclasses.replace(problem, overlap_experts=False), pins=pins, top=8).candidates}
    assert "full" in without and "full" not in chosen
    for pin in ("recompute=full", "recompute_layers=1"):
        with pytest.raises(SearchError, match="E418"):
            search(problem, pins=[*pins, pin], top=1)


def test_E419_the_experts_overlap_where_megatron_core_does_not_run_it():
    """Megatron-Core's TransformerConfig runs `--overlap-moe-expert-parallel-comm` under a pipeline only with virtual
    stages, only with more than one expert rank and only for a bf16 or fp16 model: E419 for each, at what breaks it;
    the same plans without the overlap, an interleaved pipeline and FP8 (a bf16 model) pass. The search keeps to it:
    every pipelined candidate it proposes under the overlap has virtual stages, and fp32 is a SearchError naming E419."""
    from plandsl.search import Problem, SearchError, search
    stages = "  stages   = evenly over pp{virtual}\n  schedule = {schedule}\n"

    def codes(mesh="dp = 2, ep = 8", overlap=True, precision="bf16", virtual="", schedule="1f1b"):
        extra = stages.format(virtual=virtual, schedule=schedule) if "pp" in mesh else ""
        return [d.code for d in api.checks(_text(mesh, overlap, precision, extra)).diagnostics]
    assert codes("pp = 2, ep = 8") == ["E419"]
    assert codes("pp = 2, ep = 8", virtual=" with virtual = 2", schedule="interleaved_1f1b") == []
    assert codes("pp = 2, ep = 8", overlap=False) == []
    assert codes("dp = 16, ep = 1") == ["E419"] and codes("dp = 16, ep = 1", overlap=False) == []
    assert codes(precision="fp32") == ["E419"] and codes(precision="fp8") == [] and codes(precision="fp16") == []
    plan = _plan("dp = 2, ep = 8")
    problem = Problem(plan.model, plan.cluster, 64, plan.seq, overlap_experts=True)
    found = search(problem, pins=["cp=1", "tp=1", "zero=1"], top=20).candidates
    pipelined = [s.candidate for s in found if s.candidate.pp > 1]
    assert all(c.virtual_stages > 1 for c in pipelined) and all(s.candidate.ep > 1 for s in found)
    with pytest.raises(SearchError, match="E419") as raised:
        search(dataclasses.replace(problem, precision=ir.Precision.fp32), pins=["pp=1"], top=1)
    assert raised.value.code == "E805"  # --precision fp32 against the overlap: contradictory flags (was uncoded)
    with pytest.raises(SearchError, match="E419"):
        search(problem, pins=["pp=2", "virtual_stages=1"], top=1)
