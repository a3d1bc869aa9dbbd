"""Communication: alpha-beta times of collectives over the links a group of devices really uses.

Stage: cost model. Contract: `group_links(cluster, axes, members)` places a communication group
(the devices that differ only in some mesh axes) on the cluster's nodes; `estimate_collective`
returns a `CommEstimate` (latency and bandwidth terms, intra- and inter-node) for all-reduce,
reduce-scatter, all-gather, all-to-all or point-to-point. Every figure comes from the cluster
description: a group inside one node uses the node's `link` (per device, each direction); a group
with one member per node uses the NIC (per node, shared by the node's devices, which all run the
same collective at once) capped by the fabric; a group with several members in each of several
nodes runs hierarchically (inside the node, then across nodes on 1/k of the data).
"""
from __future__ import annotations

import bisect
import functools
import itertools
import math
from collections import Counter
from dataclasses import dataclass, replace
from typing import Sequence

from plandsl import ir
from plandsl.cost.measured import ratio_at

COLLECTIVES = ir.COLLECTIVES


@dataclass(frozen=True, slots=True)
class GroupLinks:
    """Where a group of `size` devices sits: `local` members per node over `nodes` nodes, and the
    per-device bandwidth (bytes/s, each direction) and latency (s) of each level."""

    size: int
    local: int
    nodes: int
    intra_bandwidth: float
    intra_latency: float
    inter_bandwidth: float
    inter_latency: float
    intra_measured: tuple[tuple[str, tuple[tuple[float, float], ...]], ...] = ()
    """Per collective, (ln bytes, measured / modelled seconds) of the intra-node link's `measured` table, by
    bytes (`measured_ratios`); empty: the alpha-beta model as it is."""
    inter_measured: tuple[tuple[str, tuple[tuple[float, float], ...]], ...] = ()
    """The same for the link between nodes (the NIC's table)."""
    host: int = 0
    """Devices per machine where a node spans several (`hosts`: a GB200 NVL72's trays of 4), the fewest of the
    cluster's nodes; 0: a node is one machine. What reaches another device's memory through CUDA IPC alone
    (`dispatch_seconds`: DeepEP's NVLink level)."""

    @property
    def kind(self) -> str:
        if self.size <= 1:
            return "none"
        if self.nodes == 1:
            return "intra-node"
        return "inter-node" if self.local == 1 else "hierarchical"


@dataclass(frozen=True, slots=True)
class CommEstimate:
    """Seconds of one collective, split into latency (alpha) and bandwidth (beta) terms."""

    collective: str
    bytes: float
    latency: float
    intra: float
    inter: float

    @property
    def seconds(self) -> float:
        return self.latency + self.intra + self.inter


NO_COMM = GroupLinks(1, 1, 1, 1.0, 0.0, 1.0, 0.0)


# ---- placement of a group on the nodes --------------------------------------------------------------
def group_links(cluster: ir.Cluster, axes: Sequence[tuple[str, int]], members: Sequence[str],
                first_device: int = 0) -> GroupLinks:
    """Links of the group of devices that differ only in the axes `members` of a mesh `axes`
    ((name, size) outermost first; the last axis varies fastest over device indices)."""
    sizes = tuple(size for _, size in axes)
    chosen = tuple(i for i, (name, _) in enumerate(axes) if name in members)
    key = (id(cluster), sizes, chosen, first_device)
    found = _CACHE.get(key)
    if found is None or found[0] is not cluster:
        if len(_CACHE) > 65536:
            _CACHE.clear()
        found = _CACHE[key] = (cluster, _group_links(cluster, sizes, chosen, first_device))
    return found[1]


_CACHE: dict[tuple, tuple[ir.Cluster, GroupLinks]] = {}  # the IR holds dicts: not hashable, keyed by id


def _group_links(cluster: ir.Cluster, sizes: tuple[int, ...], chosen: tuple[int, ...],
                 first_device: int) -> GroupLinks:
    size = math.prod(sizes[i] for i in chosen)
    if size <= 1:
        return NO_COMM
    strides = [math.prod(sizes[i + 1:]) for i in range(len(sizes))]
    per_node = {g.node.devices for g in cluster.groups}
    local = nodes = None
    if len(per_node) == 1 and first_device % next(iter(per_node)) == 0:
        node = next(iter(per_node))
        # Nested sizes (each stride divides the node or the node divides it): a member axis of
        # stride t < node keeps min(size, node / t) of its members inside one node.
        if all(node % strides[i] == 0 or strides[i] % node == 0 for i in chosen):
            local = math.prod(min(sizes[i], max(1, node // strides[i])) for i in chosen)
    if local is None:
        local, nodes = _local_members(cluster, [(sizes[i], strides[i]) for i in chosen], first_device)
    else:
        nodes = -(-size // local)
    links = [g.node.link for g in cluster.groups]
    intra = min(links, key=lambda link: link.bandwidth)
    inter_bandwidth, inter_latency = _inter_link(cluster)
    host = min(g.node.host_devices for g in cluster.groups) if any(g.node.hosts > 1 for g in cluster.groups) else 0
    found = GroupLinks(size, local, nodes, intra.bandwidth, max(link.latency for link in links),
                       inter_bandwidth, inter_latency, host=host)
    nic = min((g.node.nic or g.node.link for g in cluster.groups), key=lambda link: link.bandwidth)
    if not (intra.measured or nic.measured):
        return found
    return replace(found, intra_measured=measured_ratios(intra, found, False),
                   inter_measured=measured_ratios(nic, found, True))


_MOST_LOG_RATIO = 700.0


def measured_ratios(link: ir.Link, found: GroupLinks, across_nodes: bool) -> tuple:
    """For each collective of the link's `measured` table, (ln bytes, measured / modelled seconds) by bytes:
    the model of the row's own group (its ranks inside one node, or one per node across nodes) on the
    figures `found` holds. Rows of equal bytes (other group sizes): the geometric mean of their ratios."""
    tables = []
    for collective, points in link.measured.items():
        logs: dict[float, list[float]] = {}
        for point in points:
            n = point.ranks
            unit = GroupLinks(n, 1, n, 1.0, 0.0, found.inter_bandwidth, found.inter_latency) if across_nodes else \
                GroupLinks(n, n, 1, found.intra_bandwidth, found.intra_latency, 1.0, 0.0)
            modelled = estimate_collective(collective, point.bytes, unit).seconds
            if modelled > 0:  # in logs: seconds / modelled underflows to 0 (1e-300 s against 1e290 s modelled)
                logs.setdefault(math.log(point.bytes), []).append(math.log(point.seconds) - math.log(modelled))
        # exp overflows past e^709: the ratio is held below it (a measured time that far past its model is a time
        # a step spends there all the same)
        ratios = tuple((x, math.exp(min(sum(v) / len(v), _MOST_LOG_RATIO))) for x, v in sorted(logs.items()))
        if ratios:
            tables.append((collective, ratios))
    return tuple(tables)


def _ratio(tables: tuple, collective: str, size_bytes: float) -> float:
    """The measured / modelled ratio of `collective` at `size_bytes`, interpolated linearly in ln bytes between
    the table's rows (beyond them, the end's); 1 without a row for the collective."""
    return ratio_at(next((ratios for name, ratios in tables if name == collective), ()), size_bytes)


def _local_members(cluster: ir.Cluster, axes: list[tuple[int, int]], first_device: int) -> tuple[int, int]:
    """(most members sharing a node, nodes touched) of the group of device `first_device`, enumerated."""
    members = [first_device]
    for size, stride in axes:
        members = [m + c * stride for m in members for c in range(size)]
    last = cluster.num_devices - 1
    per_node = {g.node.devices for g in cluster.groups}
    if len(per_node) == 1 and all(g.count <= _NODES_LISTED for g in cluster.groups):  # nodes alike: a division
        node_devices = per_node.pop()
        nodes = Counter((m if m < last else last) // node_devices for m in members)
    else:
        node_of = _node_index(cluster)
        nodes = Counter(node_of(min(m, last)) for m in members)
    return max(nodes.values()), len(nodes)


_NODES_LISTED = 1_000_000  # nodes per group `_node_index` lists (bounded work on any cluster)


def _node_index(cluster: ir.Cluster):
    starts, total = [], 0
    for group in cluster.groups:
        for _ in range(min(group.count, _NODES_LISTED)):
            starts.append(total)
            total += group.node.devices
    return lambda device: bisect.bisect_right(starts, device) - 1


def _inter_link(cluster: ir.Cluster) -> tuple[float, float]:
    """Per-device bandwidth and the latency between nodes.

    The NIC figure is per node and every device of the node drives the same collective at once
    (all groups of an axis run together), so a device gets nic / devices; a cluster `fabric` (per
    node) caps it. A node without a NIC talks over its intra-node link (one-node clusters)."""
    bandwidth, latency = math.inf, 0.0
    for group in cluster.groups:
        node = group.node
        link = node.nic or node.link
        per_node = min(link.bandwidth, cluster.fabric.bandwidth) if cluster.fabric else link.bandwidth
        bandwidth = min(bandwidth, per_node / (node.devices if node.nic else 1))
        latency = max(latency, link.latency + (cluster.fabric.latency if cluster.fabric else 0.0))
    return bandwidth, latency


# ---- alpha-beta collectives ----------------------------------------------------------------------------
def estimate_collective(collective: str, size_bytes: float, links: GroupLinks) -> CommEstimate:
    """One collective on a buffer of `size_bytes` (the full buffer: the all-reduced tensor, the
    gathered output, the input of a reduce-scatter, everything one device sends in an all-to-all).

    Ring algorithms (Thakur et al. 2005, "Optimization of Collective Communication Operations in
    MPICH"; Patarasuk & Yuan 2009 for the bandwidth-optimal all-reduce), n = group size:
      all-reduce      2(n-1)·alpha + 2(n-1)/n · S/beta
      reduce-scatter   (n-1)·alpha +  (n-1)/n · S/beta, all-gather the same
      all-to-all       (n-1)·alpha +  (n-1)/n · S/beta  (pairwise exchange)
      point-to-point        alpha +          S/beta
    A group over several nodes with k members in each moves its bytes hierarchically (the
    intra-node collective over k, then the inter-node one over n/k on S/k per device, as NCCL's
    rings over NVLink + one NIC per rail and Megatron's 2-D reductions do); with k = 1 only the
    inter-node term is left. The latency is that of NCCL's ring, which still passes all n ranks:
    n - 1 steps (2(n - 1) for all-reduce), of which N - 1 (2(N - 1)) cross nodes, over N nodes
    (NCCL `src/graph/tuning.cc`: `(nsteps - nInterSteps)·intraLat + nInterSteps·interLat`).
    """
    if collective not in COLLECTIVES:
        raise ValueError(f"unknown collective '{collective}'; one of {', '.join(COLLECTIVES)}")
    if links.intra_measured or links.inter_measured:
        return _measured_collective(collective, size_bytes, links)
    n, k, nodes = links.size, links.local, links.nodes
    if n <= 1 or size_bytes <= 0:
        return CommEstimate(collective, float(size_bytes), 0.0, 0.0, 0.0)
    s = float(size_bytes)
    a_in, a_out = links.intra_latency, links.inter_latency
    b_in, b_out = links.intra_bandwidth, links.inter_bandwidth
    if collective == "p2p":
        if nodes > 1:
            return CommEstimate(collective, s, a_out, 0.0, s / b_out)
        return CommEstimate(collective, s, a_in, s / b_in, 0.0)
    if collective == "all_to_all":
        # Each device keeps 1/n, sends (k-1)/n of S inside its node and (n-k)/n across nodes.
        latency = (k - 1) * a_in + (n - k) * a_out
        return CommEstimate(collective, s, latency, (k - 1) / n * s / b_in, (n - k) / n * s / b_out)
    steps = 2 if collective == "all_reduce" else 1
    intra = steps * (k - 1) / k * s / b_in if k > 1 else 0.0
    inter = steps * (nodes - 1) / nodes * (s / k) / b_out if nodes > 1 else 0.0
    latency = steps * ((n - nodes) * a_in + (nodes - 1) * a_out)
    return CommEstimate(collective, s, latency, intra, inter)


def _measured_collective(collective: str, size_bytes: float, links: GroupLinks) -> CommEstimate:
    """`estimate_collective` on links with measured tables: the intra-node terms (latency steps inside nodes,
    bytes over the node's link) scaled by the intra-node table's ratio at the bytes that level moves, the
    inter-node terms by the NIC table's."""
    plain = replace(links, intra_measured=(), inter_measured=())
    inside = replace(plain, inter_latency=0.0)                     # the latency steps inside nodes only
    estimate = estimate_collective(collective, size_bytes, plain)
    if estimate.seconds == 0:
        return estimate
    latency_in = estimate_collective(collective, size_bytes, inside).latency
    latency_out = estimate.latency - latency_in
    r_in = _ratio(links.intra_measured, collective, size_bytes)
    r_out = _ratio(links.inter_measured, collective, size_bytes / max(1, links.local))
    return CommEstimate(collective, estimate.bytes, latency_in * r_in + latency_out * r_out,
                        estimate.intra * r_in, estimate.inter * r_out)


def collective_seconds(collective: str, size_bytes: float, links: GroupLinks) -> float:
    return estimate_collective(collective, size_bytes, links).seconds


def beside(collective: float, compute: float, share: float) -> float:
    """Seconds a collective of `collective` seconds, issued as `compute` seconds of computation start, adds to
    them when the computation runs at (1 - `share`) of its speed while the collective is in flight (`share`:
    the device's `comm_share`, what the collective's kernel takes of it; docs/cost-model.md, "Compute beside a
    collective"). Together they take max(collective, compute + share·collective): a collective longer than the
    computation's slowed length is exposed by what it exceeds the computation by, a shorter one costs the
    computation `share` of its own seconds. `share = 0` is the perfect overlap, max(0, collective - compute)."""
    if collective <= 0.0:
        return 0.0
    return max(collective - compute, share * collective)


__all__ = ["GroupLinks", "CommEstimate", "NO_COMM", "group_links", "estimate_collective", "beside",
           "collective_seconds", "COLLECTIVES", "dispatch_seconds", "routing_map_seconds", "DEEPEP_NVL_PEERS"]


def nodes_reached(experts: int, top_k: int, nodes: int) -> float:
    """Expected number of other nodes a token's `top_k` distinct experts sit on, its experts spread evenly over
    `nodes` nodes and chosen uniformly (balanced routing): each other node holds `experts / nodes` of them and is
    missed with probability C(E - E/N, k) / C(E, k)."""
    if nodes <= 1:
        return 0.0
    per_node = experts / nodes
    missed = 1.0
    for i in range(min(top_k, experts)):
        missed *= max(0.0, (experts - per_node - i) / (experts - i))
    return (nodes - 1) * (1.0 - missed)


def _log_comb(n: int, k: int) -> float:
    """log C(n, k) (the counts can be far past a float); -inf where it is 0."""
    if k < 0 or k > n:
        return -math.inf
    return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)


@functools.lru_cache(maxsize=4096)
def nodes_reached_grouped(experts: int, top_k: int, nodes: int, groups: int, group_top_k: int) -> float:
    """`nodes_reached` under group-limited routing (`expert_groups`, `group_top_k`; Megatron-Core's
    `group_limited_topk`): each token's experts lie in `group_top_k` of the `groups` groups of consecutive experts,
    chosen uniformly (balanced routing), about `top_k / group_top_k` of them in each chosen group (a group is chosen
    for the sum of its best `top_k // group_top_k` scores: with Megatron's selection over random logits nearly every
    chosen group holds one of the token's experts where `group_top_k` divides `top_k`, 3.97 of DeepSeek-V3's 4; fewer
    where it does not, 3.71 of 4 for 5 of 256 inside 4 of 8, tests/unit/test_expert_groups.py), uniformly among its
    experts; never more than without the groups (`nodes_reached`), which it is where every group is chosen. A node
    holding a block of `experts / nodes` consecutive experts is missed where no chosen group puts an expert on it:
    with q_g the chance a chosen group g misses the node's part of it, the mean over the chosen sets of the product
    of their q_g: the groups wholly on the node share one q, its two edge groups have their own, so the mean is a sum
    over how many of each are chosen (multivariate hypergeometric), at most group_top_k + 1 terms a node whatever
    the numbers. Node-limited routing as
    DeepSeek-V3 deploys it (groups = the expert group's nodes) reaches at most `group_top_k` nodes."""
    if nodes <= 1:
        return 0.0
    free = nodes_reached(experts, top_k, nodes)
    if group_top_k >= groups:  # every group chosen: the routing is the ungrouped one
        return free
    per_group, per_node = experts / groups, experts / nodes
    draws = top_k / group_top_k
    low, share = int(draws), draws - int(draws)  # groups holding floor or ceil of the token's experts

    def miss(overlap: float, count: int) -> float:  # a chosen group's `count` experts all off the node's `overlap`
        missed = 1.0
        for i in range(count):
            missed *= max(0.0, (per_group - overlap - i) / (per_group - i))
        return missed

    log_all = _log_comb(groups, group_top_k)
    reached = 0.0
    for node in range(nodes):
        start, end = node * per_node, (node + 1) * per_node
        first, last = int(start // per_group), min(groups - 1, int(-(-end // per_group)) - 1)
        inside, q_inside, edges = 0, 1.0, []  # the groups wholly on the node (one chance to miss), the partial ones
        for group in (first, last) if last > first else (first,):
            overlap = min(end, (group + 1) * per_group) - max(start, group * per_group)
            q = (1 - share) * miss(overlap, low) + (share * miss(overlap, low + 1) if share else 0.0)
            if overlap >= per_group:
                inside, q_inside = inside + 1, q
            elif overlap > 0:
                edges.append(q)
        if last - first > 1:  # the groups between the node's first and last lie wholly on it
            inside += last - first - 1
            q_inside = (1 - share) * miss(per_group, low) + (share * miss(per_group, low + 1) if share else 0.0)
        # P(missed) = E[prod of the chosen groups' q]: the chosen set of group_top_k of the groups is uniform, so the
        # numbers of edge groups (a, b) and inside groups (t) among them are multivariate hypergeometric
        rest = groups - inside - len(edges)
        missed = 0.0
        for picked in itertools.product((0, 1), repeat=len(edges)):
            weight = math.prod(q if take else 1.0 for q, take in zip(edges, picked))
            left = group_top_k - sum(picked)
            for t in range(max(0, left - rest), min(inside, left) + 1):
                missed += weight * q_inside ** t * math.exp(_log_comb(inside, t) + _log_comb(rest, left - t) - log_all)
        reached += 1.0 - missed
    # the token's own node, any of them alike, is not crossed to; never above the ungrouped count (a chosen group
    # need not hold one of the token's experts where top_k // group_top_k < top_k / group_top_k)
    return min(free, reached * (nodes - 1) / nodes)


def node_dispatch_seconds(size_bytes: float, links: GroupLinks, experts: int, top_k: int, groups: int = 0,
                          group_top_k: int = 0) -> float:
    """One dispatch (or combine) of `size_bytes` routed copies (`top_k` per token) per device by DeepEP's normal
    kernels (HybridEP's the same way, its nodes being NVLink domains): a token crosses the network once per other
    node holding any of its experts, to the device of its own local index there, which forwards it over NVLink to
    each expert's device (DeepEP, docs/legacy.md: "NVLink and RDMA forwarding"; HybridEP,
    docs/Hybrid-EP_Implementation.md on its hybrid-ep branch: "Similar to DeepEP, Hybrid-EP first performs IB
    communication between peer GPUs, then each rank distributes the received inter-node data locally"); both levels
    run at once in one kernel, so the slower one bounds it. Network bytes: `size / top_k` per reached node
    (`nodes_reached`; under group-limited routing, `groups` and `group_top_k`, `nodes_reached_grouped`); NVLink: the
    copies for this node's other devices, (k - 1)/n of the bytes, and the forwarding of those that arrived for other
    nodes' devices,
    (n - k)/n · (k - 1)/k. Inside one node it is the all-to-all's (k - 1)/n. Latency: the all-to-all's steps inside
    the node, one network step per other node."""
    n, k, nodes = links.size, links.local, links.nodes
    if n <= 1 or size_bytes <= 0:
        return 0.0
    if nodes <= 1:
        return collective_seconds("all_to_all", size_bytes, links)
    s = float(size_bytes)
    nvlink = ((k - 1) / n + (n - k) / n * (k - 1) / k) * s / links.intra_bandwidth
    reached = nodes_reached_grouped(experts, top_k, nodes, groups, group_top_k) if groups \
        else nodes_reached(experts, top_k, nodes)
    network = s / top_k * reached / links.inter_bandwidth
    return (k - 1) * links.intra_latency + (nodes - 1) * links.inter_latency + max(nvlink, network)


# ---- the experts' dispatchers as Megatron-Core runs them (`experts = alltoall | deepep | hybridep`) --------------
DEEPEP_NVL_PEERS = 8
"""The most ranks DeepEP's normal kernels reach over NVLink (`NUM_MAX_NVL_PEERS`, csrc/kernels/configs.cuh, V1): a
larger expert group is `num_ranks / 8` RDMA ranks of 8 NVLink peers each, which exchange tokens through NVSHMEM over
the NIC (Megatron-Core's `Buffer(group, nvl_bytes, rdma_bytes)` leaves `allow_mnnvl` off, so NVSHMEM does not use a
multi-node NVLink domain). Its NVLink peers open each other's buffers by CUDA IPC handles (`use_fabric` off too),
which reach only the devices of one machine: on a node of several machines (`GroupLinks.host`) its NVLink level is
one machine's devices at most. HybridEP's nodes are whole NVLink domains (`num_of_nodes`: "Number of NVLink domains (not
OS nodes/containers)", its allocator's `detect_accessible_ranks` and fabric handles on MNNVL systems): a cluster node
of the language, 72 GPUs on a GB200 NVL72, 8 on a DGX H100, where the two see the same nodes."""


def dispatch_seconds(kind: str, size_bytes: float, links: GroupLinks, experts: int, top_k: int, groups: int = 0,
                     group_top_k: int = 0) -> float:
    """One dispatch (or combine) of `size_bytes` routed copies per device by the dispatcher `kind`: NCCL's
    all-to-all (`alltoall`), or once per node (`node_dispatch_seconds`) over the nodes each flex backend sees: DeepEP's
    groups of at most `DEEPEP_NVL_PEERS` ranks on one machine, HybridEP's NVLink domains (the cluster's nodes)."""
    if kind == "alltoall":
        return collective_seconds("all_to_all", size_bytes, links)
    peers = min(DEEPEP_NVL_PEERS, links.host or DEEPEP_NVL_PEERS)
    if kind == "deepep" and links.local > peers:  # RDMA between its NVLink groups inside one NVLink domain
        links = replace(links, local=peers, nodes=-(-links.size // peers))
    return node_dispatch_seconds(size_bytes, links, experts, top_k, groups, group_top_k)


def routing_map_seconds(tokens: float, experts: int, links: GroupLinks) -> float:
    """HybridEP's all-gather of the routing map before each dispatch that builds a new handle (once per layer's
    forward; its combine and the backward reuse the handle): each rank's `bool[tokens, experts]` gathered over the
    expert group by NCCL (`torch.distributed.all_gather_into_tensor`, deep_ep/hybrid_ep_buffer.py on the hybrid-ep
    branch from 2025-12, `Executor::allgather_routing_map` since), which its metadata kernel reads to lay out every
    rank's tokens. DeepEP counts its layout locally (`get_dispatch_layout`) and exchanges only counts."""
    return collective_seconds("all_gather", links.size * tokens * experts, links)
