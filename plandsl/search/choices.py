"""What the search chooses among: layouts (the device count factorised into degrees), mesh orders,
and the built-in schedules with their virtual stages.

Stage: inside the search. Contract: pure functions of the problem and the pins. `layouts` lists the
(dp, tp, pp, cp, ep) the model and the pins allow, `mesh_orders` the orders of a layout's axes that
place its groups differently on the nodes, `schedule_choices` the (schedule, virtual) pairs the
generators accept; `stage_ranks` maps stages to pipeline ranks.
"""
from __future__ import annotations

import functools
import itertools
import math
from typing import Mapping, Sequence

from plandsl import ir
from plandsl.cost.comm import group_links
from plandsl.cost.layer import Links, mesh_links
from plandsl.cost.stage import slowest
from plandsl.ir.shapes import context_extents, expert_extents, indivisible, tensor_extents, tp_splits
from plandsl.ir.torch_plan import ties_across_layers, tp_splits as torch_tp_splits
from plandsl.schedules.registry import BUILTIN, megatron_microbatches_fit, microbatches_fit
from plandsl.search.problem import HYBRID_AXES

AXES = ("dp", "ep", "pp", "cp", "tp")  # the canonical mesh order, outermost first (Megatron's)
RECOMPUTE = ("none", "selective", "selective_op", "full")
VIRTUAL_CHOICES = (2, 3, 4, 6, 8)       # stages per rank tried for the looped schedules
MAX_MICRO_BATCH = 256

Layout = tuple[int, int, int, int, int]  # dp, tp, pp, cp, ep


def divisors(n: int) -> list[int]:
    """Every divisor of n, ascending, from its prime factors (trial division stops at the square
    root of what is left, so a power of two of any size costs its exponent, not sqrt(n))."""
    return list(_divisors(n))


@functools.lru_cache(maxsize=4096)
def _divisors(n: int) -> tuple[int, ...]:
    factors: dict[int, int] = {}
    rest, p = n, 2
    while p * p <= rest:
        while rest % p == 0:
            factors[p] = factors.get(p, 0) + 1
            rest //= p
        p += 1 if p == 2 else 2
    if rest > 1:
        factors[rest] = factors.get(rest, 0) + 1
    out = [1]
    for prime, power in factors.items():
        out = [d * prime ** k for d in out for k in range(power + 1)]
    return tuple(sorted(out))


def divisors_up_to(n: int, limit: int) -> list[int]:
    """The divisors of n that are at most `limit`, ascending, in O(limit)."""
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


# ---- layouts ---------------------------------------------------------------------------------------------------
def layouts(model: ir.Model, devices: int, sequence: int, global_batch: int, blocks: int, pins: Mapping,
            check_batch: bool = True, fold: bool = False) -> list[Layout]:
    """Every (dp, tp, pp, cp, ep) with dp·tp·pp·cp·ep = devices that the model and the pins allow: tp
    divides the heads and widths, cp the sequence, ep the experts, pp at most `blocks` (and the parts a pinned
    `account` counts, which the caller adds), and dp·ep
    the global batch (unless `check_batch` is off). `fold`: the experts fold the tensor axis into their group
    (`experts = alltoall over [ep, tp]`), so ep·tp divides the experts, a pinned `ep` is that group, and tp > 1
    needs sequence parallelism (E416)."""
    transformer = isinstance(model, ir.TransformerModel)
    experts = expert_extents(model)
    one_stage = ties_across_layers(model)  # a tensor two stages would share (E412)
    out = []
    for tp in divisors(devices):
        if not tp_divides(model, tp):
            continue
        for cp in divisors(devices // tp):
            if cp > 1 and (not transformer or indivisible(context_extents(sequence), cp)):
                continue
            for ep in divisors(devices // (tp * cp)):
                group = ep * tp if fold and ep > 1 and tp > 1 else ep
                if ep > 1 and (not experts or indivisible(experts, group)):
                    continue
                if fold and tp > 1 and ep == 1:
                    continue  # experts folded over tp need an expert axis to fold it into (the plan's `over [ep, tp]`)
                if group > ep and not sequence_parallel(model, sequence, tp, cp):
                    continue
                for pp in divisors(devices // (tp * cp * ep)):
                    dp = devices // (tp * cp * ep * pp)
                    layout = {"dp": dp, "tp": tp, "pp": pp, "cp": cp, "ep": group}
                    if any(k in pins and pins[k] != v for k, v in layout.items()):
                        continue
                    if pp > blocks or (pp > 1 and one_stage) or (check_batch and global_batch % (dp * ep)):
                        continue
                    out.append((dp, tp, pp, cp, ep))
    return out


def tp_divides(model: ir.Model, tp: int) -> bool:
    """Whether tensor parallelism of degree tp splits the model's heads and widths evenly: the checker's
    rule (E406, `ir.shapes`). For gpt and llama, and for a model from torch with its own tensor-parallel plan
    (`ir.torch_plan.tp_splits`): the interpreter has no tensor-parallel layout for other models (E704), so
    the search keeps their tp at 1."""
    if tp == 1:
        return True
    return (isinstance(model, ir.TransformerModel) and tp_splits(model, tp)) or torch_tp_splits(model, tp)


def sequence_parallel(model: ir.Model, sequence: int, tp: int, cp: int) -> bool:
    """Whether the search turns on sequence parallelism: tp > 1 splits each context rank's share of the
    sequence evenly too (the checker's rule, E406)."""
    if isinstance(model, ir.CustomModel):
        return False  # a torch model's own plan says nothing of its norms' sequence (E704 at run)
    return tp > 1 and not indivisible(tensor_extents(model, sequence, cp), tp)


def mesh_orders(cluster: ir.Cluster, layout: Layout, pins: Mapping, devices: Sequence[ir.DeviceType],
                precision: ir.Precision, fold: bool = False) -> tuple[list[tuple[tuple[str, ...], Links, tuple, tuple]], int]:
    """The orders of the axes of size > 1 that place the groups differently, each once, as
    (order, links, slowest device per pipeline rank, smallest memory per rank); and how many orders
    were left out for putting a tensor-parallel group across nodes (unless pinned `tp_across_nodes`)."""
    dp, tp, pp, cp, ep = layout
    sizes = {"dp": dp, "ep": ep, "pp": pp, "cp": cp, "tp": tp}
    used = [a for a in AXES if sizes[a] > 1]
    pinned = pins.get("order")
    if pinned is not None:  # an axis of size 1 in it (a mesh's dp carrying ZeRO, `Candidate.mesh_order`) orders nothing
        pinned = tuple(a for a in pinned if sizes.get(a, 0) != 1)
        permutations = [tuple(pinned)] if set(pinned) == set(used) else []
    else:
        permutations = list(itertools.permutations(used)) or [()]
    seen, out, across = set(), [], 0
    uniform = len({g.node.device.name for g in cluster.groups}) == 1
    for order in permutations:
        axes = tuple((a, sizes[a]) for a in order) or (("dp", 1),)
        # tensor-parallel groups stay inside a node (search.PIN_KEYS): the tp group's links (`mesh_links`'
        # links.tp) first, before the rest of the mesh's (two in three orders of a large cluster end here)
        if tp > 1 and not pins.get("tp_across_nodes") and group_links(cluster, axes, ["tp"], 0).nodes > 1:
            across += 1
            continue
        data = ("dp",) if dp > 1 else (("ep",) if ep > 1 else ())
        links = mesh_links(cluster, axes, 0, data, ir.DataKind.zero1, "tp" if tp > 1 else None,
                           "cp" if cp > 1 else None, "ep" if ep > 1 else None, "pp" if pp > 1 else None,
                           ("tp",) if fold and ep > 1 and tp > 1 else ())
        ranks, capacity = rank_devices(devices, axes, pp, precision, uniform)
        key = (links, tuple(d.name for d in ranks), capacity)
        if key not in seen:
            seen.add(key)
            out.append((order, links, ranks, capacity))
    return out, across


def hybrid_axes(order: Sequence[str], sizes: Mapping[str, int], shard: int) -> tuple[tuple[str, int], ...]:
    """The mesh's (axis, size) of an order whose data axis hsdp splits into replicas outside `shard` data ranks
    (`problem.HYBRID_AXES`: dp_rep, then dp, torchtitan's dp_replicate x dp_shard)."""
    out: list[tuple[str, int]] = []
    for axis in order:
        out += [(HYBRID_AXES[0], sizes["dp"] // shard), (HYBRID_AXES[1], shard)] if axis == "dp" else [(axis, sizes[axis])]
    return tuple(out)


def shard_degrees(cluster: ir.Cluster, layout: Layout, order: tuple[str, ...], pinned: int | None = None) -> list[int]:
    """hsdp's shard degrees for a layout in a mesh order (ZeRO-3 within a shard group, replicas across: MiCS, Zhang et
    al. 2022; PyTorch FSDP's HYBRID_SHARD): the data ranks one node holds of a data group (n, the largest divisor s of
    dp whose shard group, dp split into dp / s x s, lies in one node; 1 where none does) and n times each power of two,
    those that divide dp and leave at least two replicas: at most log2(dp / n) of them (n x 2^k <= dp / 2); under a
    pipeline the first alone (its ZeRO-3 gathers each unit once a step, not every microbatch,
    `cost.memory.pipelined_shards`, and its stages hold 1/pp of the states; with every multiple there too, Nemotron-4
    340B's 6,144-GPU search bounded 20 % more leaves than without hsdp, with the first alone 2 %). `pinned`: that one
    alone, where it divides dp below it."""
    dp = layout[0]
    if pinned is not None:
        return [pinned] if 1 < pinned < dp and dp % pinned == 0 else []
    sizes = dict(zip(("dp", "tp", "pp", "cp", "ep"), layout))
    inside = [s for s in divisors(dp)[1:-1]
              if group_links(cluster, hybrid_axes(order, sizes, s), [HYBRID_AXES[1]], 0).nodes == 1]
    n = inside[-1] if inside else 1
    out, shard = [], n
    while shard < dp:
        if shard > 1 and dp % shard == 0:
            out.append(shard)
        shard *= 2
    return out[:1] if layout[2] > 1 else out


def hybrid_orders(cluster: ir.Cluster, layout: Layout, orders, pinned: int | None = None) -> list[tuple]:
    """hsdp's roots of a layout with no context or expert axis (`plandsl run` runs hsdp with neither, E703) from
    its mesh orders (`mesh_orders`' (order, links, devices, capacity)): per order each shard degree
    (`shard_degrees`), as (order, links, devices, capacity, shard), each placement once."""
    dp, tp, pp, cp, ep = layout
    if dp < 4 or cp > 1 or ep > 1:
        return []
    sizes = {"dp": dp, "tp": tp, "pp": pp, "cp": cp, "ep": ep}
    seen, out = set(), []
    for order, _, devices, capacity in orders:
        for shard in shard_degrees(cluster, layout, order, pinned):
            links = mesh_links(cluster, hybrid_axes(order, sizes, shard), 0, HYBRID_AXES, ir.DataKind.hsdp,
                               "tp" if tp > 1 else None, None, None, "pp" if pp > 1 else None)
            key = (links, tuple(d.name for d in devices), capacity, shard)
            if key not in seen:
                seen.add(key)
                out.append((order, links, devices, capacity, shard))
    return out


def rank_devices(devices: Sequence[ir.DeviceType], axes: Sequence[tuple[str, int]], pp: int,
                 precision: ir.Precision, uniform: bool | None = None) -> tuple[tuple, tuple]:
    """(slowest device, smallest memory) per pipeline rank of a mesh `axes` over `devices` in order;
    `uniform`: whether all devices are of one type, if the caller knows (else the list is walked)."""
    if uniform if uniform is not None else len({d.name for d in devices}) == 1:
        return (devices[0],) * pp, (devices[0].usable_memory,) * pp
    names = [a for a, _ in axes]
    stride = math.prod(size for _, size in axes[names.index("pp") + 1:]) if "pp" in names else 1
    groups = [[d for i, d in enumerate(devices) if (i // stride) % pp == r] for r in range(pp)]
    return tuple(slowest(g, precision) for g in groups), tuple(min(d.usable_memory for d in g) for g in groups)


# ---- schedules -------------------------------------------------------------------------------------------------
def schedule_choices(pp: int, m: int, blocks: int, pinned: str | None, virtual_pin: int | None, *,
                     pipeline: str = "torch", virtual_needed: bool = False):
    """(schedule, virtual) pairs the generators accept for pp ranks and m microbatches on the pipeline `pipeline`
    (`Problem.pipeline`, one of `ir.PIPELINE_IMPLEMENTATIONS`): on torch's, every schedule searched; on another,
    only the schedules it runs (its `ScheduleInfo` flag of the same name, the checker's E610): Megatron-LM's
    (`megatron`) at the counts it runs them (`megatron_microbatches_fit`, the checker's E502), DeepSpeed's pipeline
    engine (`deepspeed`) only its TrainSchedule's 1F1B, DeepSeek's DualPipe (`dualpipe`) only its DualPipeV.
    `virtual_needed` (the experts' overlap, which Megatron-Core runs under a pipeline only with virtual stages: the
    checker's E419) keeps only those with more than one stage a rank."""
    if pipeline not in ir.PIPELINE_IMPLEMENTATIONS:
        raise ValueError(f"unknown pipeline implementation {pipeline!r}: one of {ir.PIPELINE_IMPLEMENTATIONS}")
    megatron = pipeline == "megatron"
    if pp == 1:
        return [(pinned if pinned and pinned != "none" else "", 1)]
    out = []
    for name, info in BUILTIN.items():
        if (pinned and name != pinned) or (not pinned and not info.searched):  # chimera: when pinned only
            continue
        if pipeline != "torch" and not getattr(info, pipeline):
            continue
        if not microbatches_fit(info, pp, m):  # the checker's rule (E502): torch's, where run uses torch
            continue
        if info.pipelines == 2:
            virtuals = (1,)
            if pp % 2:
                continue
        elif info.virtual == "two":
            virtuals = (2,)
        elif info.virtual == "any":
            virtuals = VIRTUAL_CHOICES if virtual_pin is None else (virtual_pin,)  # a plan's own, as check takes it
        else:
            virtuals = (1,)
        out += [(name, v) for v in virtuals if (virtual_pin is None or v == virtual_pin) and pp * v <= blocks
                and not (megatron and not megatron_microbatches_fit(pp, m, v)) and not (virtual_needed and v == 1)]
    return out


@functools.lru_cache(maxsize=4096)
def stage_ranks(name: str, pp: int, virtual: int) -> tuple[int, ...]:
    """Stage -> pipeline rank: a V for the V-shape schedules, a loop otherwise (`ScheduleInfo.rank_map`)."""
    info = BUILTIN.get(name)
    if info is not None and info.rank_map == "vshape":
        return tuple(s if s < pp else 2 * pp - 1 - s for s in range(2 * pp))
    return tuple(s % pp for s in range(pp * virtual))


@functools.lru_cache(maxsize=4096)
def stages_by_rank(ranks: tuple[int, ...], pp: int) -> tuple[tuple[int, ...], ...]:
    """The stages each pipeline rank holds, from `stage_ranks`."""
    return tuple(tuple(s for s, r in enumerate(ranks) if r == rank) for rank in range(pp))


__all__ = ["AXES", "RECOMPUTE", "VIRTUAL_CHOICES", "MAX_MICRO_BATCH", "Layout",
           "divisors", "layouts", "tp_divides", "sequence_parallel", "mesh_orders", "hybrid_axes", "shard_degrees",
           "hybrid_orders", "rank_devices", "schedule_choices", "stage_ranks",
           "stages_by_rank"]
