"""`experts = deepep | hybridep over ...`: Megatron-Core's flex dispatcher on DeepEP's (or HybridEP's) kernels, which
send a token over the network once per other node holding any of its experts and forward it over NVLink there
(DeepEP, docs/legacy.md, "Normal kernels with NVLink and RDMA forwarding"). The network bytes by hand, the same
time as the all-to-all inside a node, the SMs its kernels take beside an overlapped computation, and the kind through
the language, `show`, `diff`, the search's plans and
Megatron's flags both ways."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest

from plandsl import api
from plandsl.cost.comm import (DEEPEP_NVL_PEERS, collective_seconds, dispatch_seconds, node_dispatch_seconds,
                               nodes_reached, routing_map_seconds)
from plandsl.cost.compute import dispatcher_share
from plandsl.cost.layer import plan_links
from plandsl.interop import export_plan, import_text
from plandsl.render.summary import describe_plan
from plandsl.rewrite.diff import diff_plans
from plandsl.search import Problem, search
from plandsl.search.emit import Source, plan_text
from plandsl.search.partial import read_partial
from tests.unit.test_moe_cost import _block_time, _plan as moe_plan, _text


def _plan(kind="deepep", mesh="ep = 16"):
    """test_moe_cost's Qwen3-30B-A3B shapes on two DGX H100 nodes, with the dispatcher `kind`."""
    return moe_plan(mesh=mesh, kind=kind)


def _block_seconds(plan):
    return _block_time(plan)[0]


def test_a_token_crosses_the_network_once_per_node_it_reaches():
    """Over two nodes of 64 experts each, a token's 8 experts miss the other node with probability
    C(64, 8) / C(128, 8), so it crosses once (0.9967 times) where the all-to-all sends 8/16 of its 8 copies: the
    network carries 1/8 of the routed bytes; NVLink carries 7/16 of them for this node and 8/16 x 7/8 forwarded."""
    reached = nodes_reached(128, 8, 2)
    assert reached == pytest.approx(1 - math.comb(64, 8) / math.comb(128, 8))
    links = plan_links(_plan()).ep
    assert (links.size, links.local, links.nodes) == (16, 8, 2)
    routed = 4096 * 8 * 2048 * 2
    nvlink = (7 / 16 + 8 / 16 * 7 / 8) * routed / links.intra_bandwidth
    network = routed / 8 * reached / links.inter_bandwidth
    assert node_dispatch_seconds(routed, links, 128, 8) == pytest.approx(
        7 * links.intra_latency + links.inter_latency + max(nvlink, network))
    assert node_dispatch_seconds(routed, links, 128, 8) < collective_seconds("all_to_all", routed, links) / 4


def test_inside_one_node_it_is_the_all_to_all():
    """Inside one node DeepEP's dispatch costs what the all-to-all does; the block differs only by the alltoall
    dispatcher's second permutation and its inverse (cost.compute.SORT_CHUNKS_COPIES: 2 copies a pass of the
    4,096 x 8 x 2,048 routed elements, read and written at 2 bytes), which the flex dispatcher does not make."""
    deepep, alltoall = _block_seconds(_plan(mesh="dp = 2, ep = 8")), _block_seconds(_plan("alltoall", "dp = 2, ep = 8"))
    assert deepep.forward_comm == alltoall.forward_comm and deepep.backward_comm == alltoall.backward_comm
    sorting = 2 * 2 * 4096 * 8 * 2048 * 2 / 3350e9
    assert alltoall.forward - deepep.forward == pytest.approx(sorting)
    assert alltoall.backward - deepep.backward == pytest.approx(sorting)


@pytest.mark.parametrize("kind, sms", [("deepep", 20), ("hybridep", 16)])
def test_the_flex_dispatchers_kernels_take_their_own_sms_beside_the_overlapped_computation(kind, sms):
    """Megatron-Core runs DeepEP on 20 SMs (moe_deepep_num_sms) and HybridEP on 16 (moe_hybridep_num_sms), not NCCL's
    24 channels: of an H100's 132, or that many 24ths of a device's comm_share where it states no SM count. Under
    combined 1F1B an all-to-all shorter than the sub-module beside it costs that sub-module this share of its length
    (each of the three phases; the middle one holds two all-to-alls)."""
    plan = _plan(kind, "dp = 2, ep = 8")
    device = plan.cluster.devices_in_order()[0]
    assert device.sms == 132 and dispatcher_share(device, kind) == pytest.approx(sms / 132)
    assert dispatcher_share(device, "alltoall") == device.contention == pytest.approx(24 / 132)
    unstated = device.model_copy(update={"sms": None, "comm_share": 0.3})
    assert dispatcher_share(unstated, kind) == pytest.approx(0.3 * sms / 24)
    overlapped = _block_seconds(moe_plan(mesh="dp = 2, ep = 8", kind=kind, overlap=True))
    a2a = collective_seconds("all_to_all", 4096 * 8 * 2048 * 2, plan_links(plan).ep)  # inside a node: the all-to-all
    # HybridEP's forward dispatch first all-gathers its routing map: the middle phase, split between the passes
    routing = routing_map_seconds(4096, 128, plan_links(plan).ep) if kind == "hybridep" else 0.0
    assert overlapped.forward_comm == pytest.approx(sms / 132 * (2 * a2a + routing / 2))  # every one hidden, each
    assert overlapped.backward_comm == pytest.approx(sms / 132 * (2 * a2a + routing / 2))  # costing its share


@pytest.mark.parametrize("kind", ["deepep", "hybridep"])
def test_across_nodes_the_block_waits_less(kind):
    flex, alltoall = _block_seconds(_plan(kind)), _block_seconds(_plan("alltoall"))
    assert flex.forward < alltoall.forward and flex.backward < alltoall.backward


def test_the_kind_in_show_diff_and_the_search():
    plan = _plan()
    assert plan.experts.kind == "deepep"
    assert "deepep experts over ep" in describe_plan(plan)
    changes = diff_plans(_plan("alltoall"), plan).changes
    assert [(c.field, c.old, c.new) for c in changes] == [("experts.kind", "alltoall", "deepep")]
    problem = Problem(plan.model, plan.cluster, 64, dispatcher="hybridep")
    best = search(problem, pins={"ep": 16, "tp": 1, "pp": 1, "cp": 1}, top=1).best
    text = plan_text(best, problem, Source(('clusters/dgx_h100',), "llama(layers=4, hidden=2048, heads=32, kv_heads=4, "
                     "head_dim=128, ffn=768, experts=128, top_k=8, vocab=151936, seq=4096)", "dgx_h100 x 2"))
    assert "experts = hybridep over ep" in text
    written = api.loads(text).plans[0]
    assert written.experts.kind == "hybridep"
    assert api.estimate(written).time.step == pytest.approx(best.estimate.time.step)


@pytest.mark.parametrize("kind", ["deepep", "hybridep"])
def test_megatron_flags_both_ways(kind):
    exported = export_plan(_plan(kind), "megatron")
    assert "--moe-token-dispatcher-type flex" in exported.text
    assert f"--moe-flex-dispatcher-backend {kind}" in exported.text
    imported = import_text("megatron", exported.text, "plan.args", world_size=16)
    assert imported.ok and f"experts = {kind} over ep" in imported.text
    plain = export_plan(_plan("alltoall"), "megatron")
    assert "--moe-token-dispatcher-type" not in plain.text  # as before: Megatron's default dispatcher


def test_generate_from_a_partial_plan_keeps_the_dispatcher(tmp_path):
    """`generate --from`: a partial plan's `experts = hybridep over ep` is the problem's dispatcher, priced and
    written back."""
    path = tmp_path / "partial.plan"
    path.write_text(_text(kind="hybridep", mesh="ep = 16").replace("  mesh     = [ep = 16]\n", ""))
    partial = read_partial(path)
    assert partial.problem.dispatcher == "hybridep"


def test_hybridep_gathers_its_routing_map_before_each_forward_dispatch():
    """HybridEP dispatches as DeepEP does where both see the same nodes (8-GPU NVLink domains), and all-gathers each
    rank's bool[4,096 tokens, 128 experts] routing map over the 16 ranks before the forward's dispatch (its combine
    and the backward reuse the handle): the block waits that all-gather longer forward, nothing more backward."""
    hybrid, deepep = _block_seconds(_plan("hybridep")), _block_seconds(_plan("deepep"))
    links = plan_links(_plan("hybridep")).ep
    gather = collective_seconds("all_gather", 16 * 4096 * 128, links)
    assert hybrid.forward_comm - deepep.forward_comm == pytest.approx(gather)
    assert hybrid.backward_comm == pytest.approx(deepep.backward_comm)
    assert hybrid.moved.expert - deepep.moved.expert == pytest.approx(16 * 4096 * 128)
    assert routing_map_seconds(4096, 128, links) == gather


GB200 = """import "clusters/gb200_nvl72"
plan p {{
  model    = llama(layers=4, hidden=2048, heads=32, kv_heads=4, head_dim=128, ffn=768, experts=144, top_k=8,
                   vocab=151936, seq=4096)
  cluster  = gb200_nvl72 x {racks}
  mesh     = [{mesh}]{part}
  train    = {{ global_batch: {batch}, micro_batch: 1, recompute: none }}
  experts  = {kind} over ep
}}
"""


def test_on_an_nvlink_domain_wider_than_a_machine_hybridep_spans_it_and_deepep_does_not():
    """On a GB200 NVL72 (a node of the language: 72 GPUs in one NVLink domain, on 18 trays of 4) DeepEP's normal
    kernels reach over NVLink only the peers whose buffers CUDA IPC opens, one tray's 4 (and never more than 8,
    NUM_MAX_NVL_PEERS), and send the rest over the NIC, where HybridEP's node is the whole domain: an expert group of
    16 in one rack dispatches for HybridEP as the all-to-all over NVLink does, for DeepEP as four groups of 4; one of
    144 over two racks crosses the NIC once per rack for HybridEP and once per tray for DeepEP."""
    routed = 4096 * 8 * 2048 * 2
    one = plan_links(api.loads(GB200.format(racks=1, mesh="dp = 4, ep = 16", part=" over devices[0:64]", batch=64,
                                                   kind="alltoall"))
                     .plans[0]).ep
    assert (one.size, one.local, one.nodes) == (16, 16, 1)
    assert dispatch_seconds("hybridep", routed, one, 144, 8) == collective_seconds("all_to_all", routed, one)
    assert one.host == 4 < DEEPEP_NVL_PEERS
    trays = replace(one, local=4, nodes=4)
    assert dispatch_seconds("deepep", routed, one, 144, 8) == node_dispatch_seconds(routed, trays, 144, 8)
    assert dispatch_seconds("deepep", routed, one, 144, 8) > dispatch_seconds("hybridep", routed, one, 144, 8)
    two = plan_links(api.loads(GB200.format(racks=2, mesh="ep = 144", part="", batch=144, kind="hybridep")).plans[0]).ep
    assert (two.size, two.local, two.nodes) == (144, 72, 2)
    assert dispatch_seconds("hybridep", routed, two, 144, 8) == node_dispatch_seconds(routed, two, 144, 8)
    assert dispatch_seconds("deepep", routed, two, 144, 8) == \
        node_dispatch_seconds(routed, replace(two, local=4, nodes=36), 144, 8)
    assert dispatch_seconds("hybridep", routed, two, 144, 8) < dispatch_seconds("deepep", routed, two, 144, 8)
    steps = {kind: api.estimate(api.loads(GB200.format(racks=2, mesh="ep = 144", part="", batch=144, kind=kind)).plans[0])
             .time.step for kind in ("alltoall", "deepep", "hybridep")}
    assert steps["hybridep"] < min(steps["alltoall"], steps["deepep"])
