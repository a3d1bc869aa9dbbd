"""The mixture-of-experts terms of the cost model, each against a hand count: the dispatch and combine
all-to-alls of a known layout inside a node and across nodes, their overlap with the other microbatch's
computation (`experts = alltoall over ep with overlap`), the experts' grouped GEMM as Transformer Engine runs it
(one GEMM per local expert on four streams), and the router outside FP8."""
from __future__ import annotations

import pytest

from plandsl import api, ir
from plandsl.cost.comm import collective_seconds
from plandsl.cost.compute import GROUPED_GEMM_STREAMS, Efficiency, estimate_layer_compute
from plandsl.cost.estimate import plan_work
from plandsl.cost.layer import estimate_layer_time, plan_links
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
    many back, twice each way: inside a node over NVLink (7/8 of it at 450 GB/s); over two nodes (ep = 16, 8 per
    node) 8/16 of the bytes leave the node at the NIC's 50 GB/s per GPU and 7/16 stay on NVLink."""
    routed = 4096 * 8 * 2048 * 2
    inside, _ = _block_time(_plan())
    assert inside.moved.expert == pytest.approx(4 * routed)
    links = plan_links(_plan())
    assert (links.ep.size, links.ep.local, links.ep.nodes) == (8, 8, 1)
    a2a = collective_seconds("all_to_all", routed, links.ep)
    assert a2a == pytest.approx(7 * 2e-6 + 7 / 8 * routed / 450e9)
    across = plan_links(_plan(mesh="ep = 16"))
    assert (across.ep.size, across.ep.local, across.ep.nodes) == (16, 8, 2)
    a2a_across = collective_seconds("all_to_all", routed, across.ep)
    nic = 400e9 / 8  # 8 x 400 Gb/s per node, one rail per GPU
    assert a2a_across == pytest.approx(7 * 2e-6 + 8 * across.ep.inter_latency + 7 / 16 * routed / 450e9
                                       + 8 / 16 * routed / nic)
    assert a2a_across > 5 * a2a


def test_overlap_hides_the_all_to_alls_behind_the_other_pass():
    """Without overlap the forward waits for dispatch and combine (2 all-to-alls), the backward for their
    gradients (2); with it, each pass's all-to-alls run behind the other pass's computation of the layer, so only
    what exceeds it waits: max(0, 2·a2a − backward compute) and max(0, 2·a2a − forward compute)."""
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
    assert perfect.forward_comm == pytest.approx(max(0.0, 2 * a2a - compute.backward))
    assert perfect.backward_comm == pytest.approx(max(0.0, 2 * a2a - compute.forward))
    # by default they take the device's share of it while they run (cost.comm.beside)
    share = device.contention
    assert overlapped.forward_comm == pytest.approx(max(2 * a2a - compute.backward, share * 2 * a2a))
    assert overlapped.backward_comm == pytest.approx(max(2 * a2a - compute.forward, share * 2 * a2a))
    assert overlapped.forward_comm < plain.forward_comm and overlapped.moved == plain.moved


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
    # megatron-core refuses it with one virtual stage per pipeline rank: lost, said so
    piped = _plan(mesh="pp = 2, ep = 8", overlap=True, extra="  stages   = evenly over pp\n")
    lost = export_plan(piped, "megatron")
    assert "--overlap-moe-expert-parallel-comm" not in lost.text
    assert any("overlap" in d.message for d in lost.lost)


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
