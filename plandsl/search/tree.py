"""The records of the search tree: a root (layout and mesh order), a node (plus micro-batch size and
recomputation), a node's leaves before their partition (`Pending`) and a leaf (plus ZeRO stage, schedule
and virtual stages), each with its lower bound; a node's leaf as the `Candidate` it stands for.

Stage: inside the search, below the space. Contract: plain records, no logic beyond `candidate_of`.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from plandsl.search.problem import Candidate

SAFE = 1 - 1e-9  # bounds add in another order than the exact figures: keep them strictly below


@dataclass
class Root:
    """A layout (degrees) and a mesh order, i.e. where every group sits on the nodes; with `shard`, hsdp's split
    of the data axis into replicas outside shards (`choices.hybrid_axes`)."""

    dp: int
    tp: int
    pp: int
    cp: int
    ep: int
    order: tuple[str, ...]
    links: object
    rank_devices: tuple
    capacity: tuple
    sequence_parallel: bool
    micro_batches: tuple[int, ...]
    bound: float = 0.0
    shard: int = 0  # hsdp: ZeRO-3 over a shard axis of this many data ranks, replicated over dp / shard (`Candidate`)
    # whether `bound` counts the links' communication and the layout's model states were found to fit
    # (`Space.tighten_root`); before, `bound` is the compute alone, which the layout's mesh orders share
    tight: bool = False

    @property
    def data_ranks(self) -> int:
        """The data, expert and context axes' ranks: what ZeRO shards over (`cost.memory.zero_degrees`), hsdp aside."""
        return self.dp * self.ep * self.cp

    @property
    def degrees(self) -> tuple[int, int]:
        """(dense, expert) parameters' shard degrees (`cost.memory.zero_degrees`): hsdp's shard axis (it runs with no
        expert or context axis), else the data ranks and those over the expert axis."""
        if self.shard:
            return self.shard, self.shard
        return self.data_ranks, self.data_ranks // self.ep


_IDENT = itertools.count()


@dataclass
class Node:
    root: Root
    micro_batch: int
    microbatches: int
    recompute: str
    times: dict = field(default_factory=dict)   # device name -> per kind LayerTime
    bound: float = 0.0
    ident: int = field(default_factory=lambda: next(_IDENT))
    # recompute_layers: `full` for the first N blocks of each stage (N per leaf), the kept blocks' node
    # (recompute none, same root and micro-batch) for the others' seconds and bytes
    kept: Node | None = None
    # offloading (`offload_layers`): recompute none, the first N blocks' activations on the host (N per leaf, pp = 1)
    offload: bool = False
    tight: bool = False  # whether `bound` counts `Bounds.compute_bound` yet (`Space.tighten`)


@dataclass(slots=True)
class Leaf:
    node: Node
    schedule: str
    virtual: int
    zero: int
    counts: tuple[int, ...]
    bound: float
    recompute_layers: int | None = None  # a partly recomputed node's N (`Splits.partial_partition`)
    offload_layers: int = 0  # an offloading node's N (`Space._offloaded`)
    # whether `bound` is the leaf's exact bound (`Space.finish`), or the cheaper one of its split (`Space.resolve`)
    exact: bool = True


@dataclass(slots=True)
class Pending:
    """A node's leaves before their partition, best bound first: the search holds one entry per node, for
    the next leaf (`bound`), and partitions them one at a time (`Space.resolve`)."""

    node: Node
    leaves: list            # (bound, index, zero, schedule, virtual), ascending
    memory: dict            # ZeRO stage -> `Figures.layer_memory`
    next: int = 0

    @property
    def bound(self) -> float:
        return self.leaves[self.next][0]


def candidate_of(node: Node, schedule: str, virtual: int, zero: int, recompute_layers: int | None = None,
                 offload_layers: int = 0) -> Candidate:
    r = node.root
    return Candidate(r.dp, r.tp, r.pp, r.cp, r.ep, r.order, node.micro_batch, node.microbatches, schedule, virtual,
                     zero, node.recompute, r.sequence_parallel, recompute_layers, offload_layers=offload_layers,
                     shard=r.shard)


__all__ = ["SAFE", "Root", "Node", "Leaf", "Pending", "candidate_of"]
