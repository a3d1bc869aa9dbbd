"""Data parallelism: the plan's `data = KIND over AXES` with torch's own wrappers.

Stage: interpreter. Contract: `apply_dp(model, kind, dp_mesh, device)` returns the module to run:
replicate -> DistributedDataParallel (torch's composable `replicate` for TP's DTensor parameters and for
pipeline stages: see `apply_ddp`), zero1 -> the same plus `build_dp_optimizer`'s ZeroRedundancyOptimizer
(`zero.Zero1Optimizer` for DTensor parameters), zero2 -> fully_shard(reshard_after_forward=False),
zero3 -> fully_shard, hsdp -> fully_shard on the 2-D (replicate, shard) mesh, each FSDP unit as the plan's
gathering says (`ir.Gathering`: a block, or each module that owns parameters; the units prefetched ahead),
every FSDP group with the plan's `mixed_precision` (`gather = DTYPE`: FSDP2's `MixedPrecisionPolicy`).
Parameter names are kept.
"""
from __future__ import annotations

import contextlib
import re
import warnings
from typing import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor, Shard
from torch.nn.parallel import DistributedDataParallel

from plandsl import ir
from plandsl.runtime.parallel.expert_parallel import expert_shards
from plandsl.runtime.optim import build_optimizer, optimizer_settings
from plandsl.runtime.precision import DTYPES
from plandsl.runtime.torch_model import blocks
from plandsl.runtime.parallel.zero import Zero1Optimizer

_RECOMPUTE_WRAPPER = re.compile(r"\._checkpoint_wrapped_module(?=\.|$)")  # checkpoint_wrapper's child
# FSDP2 warns when a wrapped module returns a view (the logits of `head`); nothing here edits it in place.
warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")


def apply_dp(model: nn.Module, kind: ir.DataKind | str, dp_mesh: DeviceMesh, device: torch.device,
             expert_mesh: DeviceMesh | None = None, pipelined: bool = False,
             data_shards: dict[str, dict[str, int]] | None = None, uneven: bool = False,
             gathering: ir.Gathering = ir.FSDP_GATHERING,
             mp_policy: MixedPrecisionPolicy | None = None,
             before_ddp: Callable[[nn.Module], nn.Module] | None = None) -> nn.Module:
    """`expert_mesh`: what expert-parallel shards are reduced over (see `_group_experts`); `pipelined`:
    `model` is a pipeline stage; `data_shards`: the modules shard rules split over the data axis
    (`shard_by_rules`); `uneven`: the data ranks run their own microbatch counts (`batch_shares`), so FSDP
    keeps the parameters gathered from a step's first forward to its last backward (`gradient_sync`): one
    all-gather and one reduce-scatter per unit and step on every rank, whatever its count; `gathering`: the
    plan's FSDP units and prefetch (`apply_fsdp`). A pipelined stage does the same: torch's pipeline schedules
    keep an FSDP stage's gradients unsharded, and its parameters gathered after each backward, until every
    microbatch has run (`backward_maybe_with_nosync`, `perform_reduce_grad`), and its parameters are not
    resharded after the forward either (torchtitan's default under pipelining): one all-gather per unit and
    step rather than one per microbatch. `mp_policy`: the dtypes every FSDP group (units, expert groups, shard
    rules) gathers the parameters and reduces the gradients in (`mixed_precision`; None: as they are kept)."""
    mp_policy = mp_policy or MixedPrecisionPolicy()
    if data_shards:
        shard_by_rules(model, data_shards, dp_mesh, mp_policy)
    kind = ir.DataKind(kind)
    if kind.sharded:  # ZeRO-2 keeps the parameters gathered between forward and backward, ZeRO-3 reshards
        model = apply_fsdp(model, dp_mesh, reshard_after_forward=kind.zero_stage == 3, expert_mesh=expert_mesh,
                           gathering=gathering, mp_policy=mp_policy)
    if uneven or pipelined:  # every FSDP unit, a shard rule's too
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_reshard_after_forward(False, recurse=False)
    return model if kind.sharded else apply_ddp(model, dp_mesh, device, expert_mesh, pipelined, before_ddp)


def mixed_precision(plan: ir.Plan) -> MixedPrecisionPolicy | None:
    """What FSDP gathers the parameters and reduces the gradients in under the plan's `data ... with gather = DTYPE`
    (`ir.Plan.run_gather`: zero2, zero3 and hsdp, fp32 or the compute precision): `param_dtype` the gather's dtype,
    `reduce_dtype` the plan's `grad_dtype` (fp32 by default: torchtitan's `mixed_precision_reduce`), so the forward and
    backward compute with the gathered 16-bit weights (no autocast copy of them) and the fp32 shards take the reduced
    gradients; the units' floating inputs are cast to it (`cast_forward_inputs`, FSDP2's default: the residual stream
    is in the compute dtype already, `precision.keep_stream`). None (the weights' own dtype) without one, and under
    `gather = fp8`, torchao's FP8 all-gather, which run does not apply."""
    gather = plan.run_gather
    if gather is None:
        return None
    return MixedPrecisionPolicy(param_dtype=DTYPES[gather], reduce_dtype=DTYPES[plan.train.grad_dtype])


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, reshard_after_forward: bool,
               expert_mesh: DeviceMesh | None = None, gathering: ir.Gathering = ir.FSDP_GATHERING,
               mp_policy: MixedPrecisionPolicy | None = None) -> nn.Module:
    """One FSDP group per unit: each block (`unit = block`) or each module that owns parameters (`unit =
    module`: a block's norms and linear layers one by one, and the embedding's, norm's and head's), the rest in
    the root's group. FSDP2 gathers the next unit as the current one runs (its implicit prefetch, one ahead);
    a plan that prefetches further (`prefetch = N`, `prefetch_bucket = N`) names the units each one gathers
    ahead (`set_modules_to_forward_prefetch`, and backward in reverse order). Every group, the experts' too, takes
    `mp_policy` (`mixed_precision`)."""
    mp_policy = mp_policy or MixedPrecisionPolicy()
    ignored = _group_experts(model, expert_mesh, fully_shard, reshard_after_forward=reshard_after_forward,
                             mp_policy=mp_policy)
    units = _blocks(model) if gathering.unit is ir.GatherUnit.block else _parameter_modules(model, ignored)
    for index in reversed(range(len(units))):  # inner units first: a unit's group takes what they leave
        # The last unit's parameters are needed again at once by the backward: keep them gathered.
        last = index == len(units) - 1
        fully_shard(units[index], mesh=dp_mesh, reshard_after_forward=reshard_after_forward and not last,
                    ignored_params=ignored, mp_policy=mp_policy)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, ignored_params=ignored,
                mp_policy=mp_policy)
    _prefetch(units, gathering)
    return model


def _parameter_modules(model: nn.Module, ignored: set[nn.Parameter] | None) -> list[nn.Module]:
    """The modules below `model` that own parameters (of their own, not their children's), in the order they are
    registered, which is the order a block runs them. Left to the root's group: the experts' (grouped apart), a
    module a shard rule already made a group of its own, and one sharing a parameter with another module (a head
    tied to the embedding), which one group must hold."""
    ignored = ignored or set()
    owners: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners[id(param)] = owners.get(id(param), 0) + 1
    return [module for module in model.modules() if module is not model and not isinstance(module, FSDPModule)
            and any(p not in ignored for p in module.parameters(recurse=False))
            and all(owners[id(p)] == 1 for p in module.parameters(recurse=False))]


def _prefetch(units: list[nn.Module], gathering: ir.Gathering) -> None:
    """Past one unit ahead, each unit names those it gathers while it runs: `prefetch` units, or the fewest
    whose parameters reach `prefetch_bucket` elements (`ir.Gathering.ahead`, as the cost model counts them)."""
    if gathering.prefetch_bucket is None and gathering.prefetch <= 1:
        return  # FSDP2's own: the next unit, gathered as the current one runs (`prefetch = 0` runs as 1)
    sizes = [sum(p.numel() for p in unit.parameters()) for unit in units]
    for order in (units, units[::-1]):
        ordered = sizes if order is units else sizes[::-1]
        for index, unit in enumerate(order):
            ahead = gathering.ahead(ordered, index)
            if ahead > 1:
                set_prefetch = unit.set_modules_to_forward_prefetch if order is units else \
                    unit.set_modules_to_backward_prefetch
                set_prefetch(list(order[index + 1:index + 1 + ahead]))


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh, device: torch.device,
              expert_mesh: DeviceMesh | None = None, pipelined: bool = False,
              before_ddp: Callable[[nn.Module], nn.Module] | None = None) -> nn.Module:
    """DistributedDataParallel, except for DTensor parameters (DDP does not take them) and pipeline
    stages, which get torch's composable `replicate`: torch's stages run every forward under DDP's
    `no_sync` and sync in the last backward only, which DDP's reducer does not survive with every
    schedule (with GPipe's order its bucket rebuild fails on step 2, checked with torch 2.13), nor with
    several stages per rank or a split backward (I, W); `replicate` is the FSDP2 machinery torch's
    stages drive for every schedule. `before_ddp(model)`: what DDP wraps (a model on the meta device filled, which
    DDP, broadcasting its parameters as it is built, cannot take); `replicate` takes meta parameters."""
    if pipelined or any(isinstance(p, DTensor) for p in model.parameters()):  # tensor or expert parallel
        return apply_replicate(model, dp_mesh, expert_mesh)
    if before_ddp is not None:  # DDP broadcasts the parameters as it is built: a model on the meta device is filled
        model = before_ddp(model)
    device_ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, process_group=dp_mesh.get_group(), device_ids=device_ids)


def apply_replicate(model: nn.Module, dp_mesh: DeviceMesh, expert_mesh: DeviceMesh | None = None) -> nn.Module:
    """Replication for tensor- and expert-parallel (DTensor) parameters, which DistributedDataParallel does
    not take: torch's composable `replicate`, FSDP2's machinery without sharding, grouped like `apply_fsdp`."""
    from torch.distributed._composable.replicate_with_fsdp import replicate  # a private torch API, only for replicate
    ignored = _group_experts(model, expert_mesh, replicate)
    for block in _blocks(model):
        replicate(block, mesh=dp_mesh, ignored_params=ignored)
    replicate(model, mesh=dp_mesh, ignored_params=ignored)
    return model


def shard_by_rules(model: nn.Module, data_shards: dict[str, dict[str, int]], dp_mesh: DeviceMesh,
                   mp_policy: MixedPrecisionPolicy | None = None) -> None:
    """Each module a shard rule splits over the data axis (module -> parameter -> dim, from
    `tensor_parallel.tp_rules`) becomes an FSDP group of its own, every parameter sharded along its
    rule's dim (FSDP2's `shard_placement_fn`; on top of a tensor-parallel split of another dim): its
    storage is 1/N over the axis, gathered for compute and freed after (after its forward too: said, as a group
    that no FSDP group encloses is a root of its own, which FSDP2 would keep gathered to its backward; `apply_dp`
    keeps it gathered through the step under a pipeline or `batch_shares`), gradients reduce-scattered.
    The data-parallel groups built next leave it out, with the same `mp_policy`. Modules a pipeline stage lacks
    are skipped."""
    modules = {_RECOMPUTE_WRAPPER.sub("", name): module for name, module in model.named_modules()}
    for name, dims in data_shards.items():
        module = modules.get(name)
        if module is None:
            continue
        placements = {id(param): Shard(dims[param_name] % param.ndim)
                      for param_name, param in module.named_parameters(recurse=False)}
        fully_shard(module, mesh=dp_mesh, mp_policy=mp_policy or MixedPrecisionPolicy(), reshard_after_forward=True,
                    shard_placement_fn=lambda param, placements=placements: placements[id(param)])


def _group_experts(model: nn.Module, expert_mesh: DeviceMesh | None, wrap, **options) -> set[nn.Parameter] | None:
    """Expert-parallel shards differ between expert ranks, so the groups over the batch axes (which include
    the expert axis) must leave them out: each layer's experts get a group of their own over `expert_mesh`
    (the other batch axes; wrapped first, so the enclosing groups skip them), or, with no such axes, no
    group: the returned parameters, for the other groups to ignore. Their gradients come already scaled
    (`ExpertShards`), so the groups' mean over `expert_mesh` gives the global-batch mean."""
    shards = expert_shards(model)
    if not shards:
        return None
    if expert_mesh is None:
        return {param for module in shards for param in module.parameters()}
    for module in shards:
        wrap(module, mesh=expert_mesh, **options)
    return None


def _blocks(model: nn.Module) -> list[nn.Module]:
    container, names = blocks(model)
    return [container.get_submodule(name) for name in names]


def build_dp_optimizer(plan: ir.Plan, models: list[nn.Module], dp_mesh: DeviceMesh | None,
                       expert_mesh: DeviceMesh | None = None) -> torch.optim.Optimizer:
    """The optimizer over every parameter of this rank's model parts (each once). ZeRO-1 partitions its
    states over the data ranks: with torch's ZeroRedundancyOptimizer for plain parameters, with
    `zero.Zero1Optimizer` for DTensors (tensor-parallel and expert shards, pipeline stages), where the
    expert shards are partitioned over `expert_mesh` only (the ranks holding the same experts)."""
    params = list({id(p): p for model in models for p in model.parameters()}.values())
    if plan.data is None or plan.data.zero_stage != 1 or dp_mesh is None:
        return build_optimizer(plan, params)
    cls, kwargs = optimizer_settings(plan)
    if not any(isinstance(p, DTensor) for p in params):
        return ZeroRedundancyOptimizer(params, optimizer_class=cls, process_group=dp_mesh.get_group(), **kwargs)
    experts = {id(p) for model in models for module in expert_shards(model) for p in module.parameters()}
    shared, own, expert = [], [], []  # own: a shard rule's `Shard(d) @ dp`, held by no other rank
    for p in params:
        (expert if id(p) in experts else own if _split_over(p, dp_mesh) else shared).append(p)
    partitions = [(shared, dp_mesh.get_group()), (own, None),
                  (expert, expert_mesh.get_group() if expert_mesh else None)]
    return Zero1Optimizer(partitions, cls, **kwargs)


def _split_over(param: torch.Tensor, mesh: DeviceMesh) -> bool:
    """Whether a DTensor parameter is split (not replicated) over a dimension of `mesh`."""
    if not isinstance(param, DTensor) or param.device_mesh.mesh_dim_names is None:
        return False
    return any(name in mesh.mesh_dim_names and not placement.is_replicate()
               for name, placement in zip(param.device_mesh.mesh_dim_names, param.placements))


def gradient_sync(module: nn.Module, enabled: bool, every_microbatch: bool = True):
    """A context in which the backward does (or, to accumulate locally, does not) reduce gradients.

    DDP skips its all-reduce inside `no_sync`; FSDP modules (and composable `replicate`) reduce-scatter every
    microbatch, as torchtitan does, so gradients stay sharded while they accumulate, unless
    `every_microbatch` is False: replicas with their own microbatch counts (`batch_shares`) would call a
    different number of collectives, so they accumulate and reduce once, after the last, and FSDP keeps
    the parameters gathered from the first forward on (`apply_dp(uneven=True)`).
    """
    if isinstance(module, DistributedDataParallel) and not enabled:
        return module.no_sync()
    if not every_microbatch and any(isinstance(m, FSDPModule) for m in module.modules()):
        return _fsdp_sync(module, enabled)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _fsdp_sync(module: nn.Module, enabled: bool):
    """Every FSDP (or `replicate`) unit inside `module` reduces and reshards after this backward only if
    `enabled` (the last microbatch); their parameters stay gathered until then (`apply_dp(uneven=True)`)."""
    units = [m for m in module.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.set_requires_gradient_sync(enabled, recurse=False)
        unit.set_reshard_after_backward(enabled, recurse=False)
    try:
        yield
    finally:
        for unit in units:
            unit.set_requires_gradient_sync(True, recurse=False)
            unit.set_reshard_after_backward(True, recurse=False)
