"""Communication cost terms: alpha-beta closed forms and the links a group really uses."""
import pytest

from plandsl import ir
from plandsl.cost.comm import GroupLinks, estimate_collective, group_links

GPU = ir.DeviceType(name="g", memory=80 * 2**30, bandwidth=2e12, peak={"bf16": 312e12})
OTHER = ir.DeviceType(name="h", memory=80 * 2**30, bandwidth=3e12, peak={"bf16": 989e12})
NVLINK = ir.Link(bandwidth=300e9, latency=2e-6)
NIC = ir.Link(bandwidth=200e9, latency=5e-6)


def cluster(nodes=4, devices=8, nic=NIC, fabric=None):
    node = ir.NodeType(name="n", device=GPU, devices=devices, link=NVLINK, nic=nic)
    return ir.Cluster(name="c", groups=(ir.NodeGroup(node=node, count=nodes),), fabric=fabric)


LINKS = GroupLinks(size=8, local=8, nodes=1, intra_bandwidth=100e9, intra_latency=1e-6,
                   inter_bandwidth=10e9, inter_latency=1e-5)
S = 1e9


@pytest.mark.parametrize("collective, latency_steps, fraction", [
    ("all_reduce", 14, 2 * 7 / 8), ("reduce_scatter", 7, 7 / 8), ("all_gather", 7, 7 / 8)])
def test_ring_collectives_inside_a_node(collective, latency_steps, fraction):
    result = estimate_collective(collective, S, LINKS)
    assert result.latency == pytest.approx(latency_steps * 1e-6)
    assert result.intra == pytest.approx(fraction * S / 100e9)
    assert result.inter == 0.0
    assert result.seconds == pytest.approx(result.latency + result.intra)


def test_point_to_point_is_alpha_plus_size_over_beta():
    assert estimate_collective("p2p", S, LINKS).seconds == pytest.approx(1e-6 + S / 100e9)
    across = GroupLinks(2, 1, 2, 100e9, 1e-6, 10e9, 1e-5)
    assert estimate_collective("p2p", S, across).seconds == pytest.approx(1e-5 + S / 10e9)


def test_all_to_all_sends_n_minus_1_over_n_split_by_where_peers_are():
    links = GroupLinks(size=8, local=4, nodes=2, intra_bandwidth=100e9, intra_latency=1e-6,
                       inter_bandwidth=10e9, inter_latency=1e-5)
    result = estimate_collective("all_to_all", S, links)
    assert result.intra == pytest.approx(3 / 8 * S / 100e9)
    assert result.inter == pytest.approx(4 / 8 * S / 10e9)
    assert result.latency == pytest.approx(3 * 1e-6 + 4 * 1e-5)


def test_hierarchical_all_reduce_crosses_nodes_with_one_kth_of_the_data():
    links = GroupLinks(size=32, local=8, nodes=4, intra_bandwidth=100e9, intra_latency=1e-6,
                       inter_bandwidth=10e9, inter_latency=1e-5)
    result = estimate_collective("all_reduce", S, links)
    assert result.intra == pytest.approx(2 * 7 / 8 * S / 100e9)
    assert result.inter == pytest.approx(2 * 3 / 4 * (S / 8) / 10e9)
    # NCCL's ring passes all 32 ranks: 2·31 steps, 2·3 of them between nodes (tuning.cc).
    assert result.latency == pytest.approx(2 * (28 * 1e-6 + 3 * 1e-5))
    gather = estimate_collective("all_gather", S, links)
    assert gather.latency == pytest.approx(28 * 1e-6 + 3 * 1e-5)
    assert gather.inter == pytest.approx(3 / 4 * (S / 8) / 10e9)


def test_no_communication_for_one_device_or_no_bytes():
    assert estimate_collective("all_reduce", S, GroupLinks(1, 1, 1, 1, 0, 1, 0)).seconds == 0.0
    assert estimate_collective("all_reduce", 0, LINKS).seconds == 0.0
    with pytest.raises(ValueError, match="unknown collective"):
        estimate_collective("broadcast", S, LINKS)


def test_innermost_axis_stays_in_the_node_and_uses_the_node_link():
    links = group_links(cluster(), [("dp", 4), ("tp", 8)], ["tp"])
    assert (links.size, links.local, links.nodes, links.kind) == (8, 8, 1, "intra-node")
    assert links.intra_bandwidth == NVLINK.bandwidth


def test_outer_axis_crosses_nodes_on_the_nic_shared_by_the_node():
    links = group_links(cluster(), [("dp", 4), ("tp", 8)], ["dp"])
    assert (links.size, links.local, links.nodes, links.kind) == (4, 1, 4, "inter-node")
    assert links.inter_bandwidth == pytest.approx(NIC.bandwidth / 8)  # 8 devices share the node's NIC
    assert links.inter_latency == NIC.latency


def test_axis_straddling_nodes_is_hierarchical():
    links = group_links(cluster(), [("dp", 2), ("tp", 16)], ["tp"])
    assert (links.local, links.nodes, links.kind) == (8, 2, "hierarchical")
    both = group_links(cluster(), [("pp", 2), ("dp", 4), ("tp", 4)], ["dp"])  # stride 4: two per node
    assert (both.local, both.nodes) == (2, 2)


def test_fabric_caps_the_nic():
    links = group_links(cluster(fabric=ir.Link(bandwidth=80e9, latency=1e-6)), [("dp", 4), ("tp", 8)], ["dp"])
    assert links.inter_bandwidth == pytest.approx(80e9 / 8)
    assert links.inter_latency == pytest.approx(NIC.latency + 1e-6)


def test_uneven_node_sizes_are_enumerated():
    small = ir.NodeType(name="s", device=OTHER, devices=4, link=NVLINK, nic=NIC)
    big = ir.NodeType(name="b", device=GPU, devices=8, link=NVLINK, nic=NIC)
    mixed = ir.Cluster(name="m", groups=(ir.NodeGroup(node=big, count=1), ir.NodeGroup(node=small, count=2)))
    links = group_links(mixed, [("dp", 2), ("tp", 8)], ["tp"])  # devices 0-7: the big node
    assert (links.local, links.nodes) == (8, 1)
    links = group_links(mixed, [("tp", 8), ("dp", 2)], ["tp"])  # stride 2 over 16 devices: 4 + 2 + 2
    assert (links.local, links.nodes) == (4, 3)
