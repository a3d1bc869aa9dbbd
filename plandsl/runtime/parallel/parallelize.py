"""Apply the plan's parallelisms to a model (or to one pipeline stage of it), in a fixed order.

Stage: interpreter. Contract: `parallelize(plan, model, mesh, device)` moves the model to `device`,
chains the `apply_*` verbs and returns the module to call (a DDP wrapper, or the model itself when
the wrappers are composable); parameter names stay the catalogue's, up to wrapper prefixes. A model on
the meta device (`models.build_meta_model`) is parallelized there and then allocated on `device`, each
rank's shards filled with the full model's values (`models.materialize`).
"""
from __future__ import annotations

import itertools
import math
from typing import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from plandsl import ir
from plandsl.runtime.models import is_meta, materialize
from plandsl.runtime.parallel.context_parallel import apply_cp
from plandsl.runtime.parallel.data_parallel import apply_dp, mixed_precision
from plandsl.runtime.parallel.expert_parallel import apply_ep, apply_model_ep
from plandsl.runtime.parallel.mesh import submesh
from plandsl.runtime.parallel.offload import apply_offload
from plandsl.runtime.parallel.recompute import apply_ac
from plandsl.runtime.parallel.tensor_parallel import apply_model_tp, apply_tp, tp_rules
from plandsl.runtime.torch_model import TorchModel


def data_mesh(plan: ir.Plan, mesh: DeviceMesh) -> DeviceMesh | None:
    """The mesh gradients are reduced over: `plan.reduce_axes()` (2-D for hsdp), None when they split nothing."""
    axes = plan.reduce_axes()
    if math.prod(plan.mesh.degree(axis) for axis in axes) == 1:
        return None
    if plan.data is not None and plan.data.hybrid:
        return mesh[tuple(plan.data.axes)]
    return submesh(mesh, axes)


def expert_data_mesh(plan: ir.Plan, mesh: DeviceMesh) -> DeviceMesh | None:
    """The mesh expert parameters are reduced over: `plan.reduce_axes()` without the expert axis (each expert
    rank holds other experts); None when those split nothing."""
    if plan.experts is None:
        return None
    axes = tuple(axis for axis in plan.reduce_axes() if axis != plan.experts.axis)
    if math.prod(plan.mesh.degree(axis) for axis in axes) == 1:
        return None
    return submesh(mesh, axes)


def move(module: nn.Module, device: torch.device) -> nn.Module:
    """`module.to(device)` where a parameter or buffer lies elsewhere; else `module` untouched (a model of fake tensors
    already there, `runtime.memtrace`, cannot have its parameters swapped for themselves; a model on the meta device,
    `models.build_meta_model`, is parallelized there and `models.materialize`d after)."""
    if is_meta(module):
        return module
    if any(t.device != torch.device(device) for t in itertools.chain(module.parameters(), module.buffers())):
        module.to(device)
    return module


def parallelize(plan: ir.Plan, model: nn.Module, mesh: DeviceMesh, device: torch.device) -> nn.Module:
    """`model` (the full model or one pipeline stage) parallelized as the plan says. A model on the meta device
    (`models.build_meta_model`) is parallelized there, its parameters shapes only, then allocated on `device` and
    filled with the values of `models.build_model(plan.model, plan.train.seed)` (`models.materialize`), each rank its
    own shards only: before DistributedDataParallel wraps it (DDP broadcasts at construction), else after every
    wrapper (FSDP2 and `replicate` take meta parameters). On the meta device itself (`runtime.dryrun`) it stays there,
    nothing drawn."""
    def materialize_model(module: nn.Module) -> nn.Module:  # fills a meta model (`materialize`: a no-op on others)
        return materialize(module, plan.model, plan.train.seed, device)

    model = _parallelize(plan, move(model, device), mesh, device, materialize_model)
    return materialize_model(model)


def _parallelize(plan: ir.Plan, model: nn.Module, mesh: DeviceMesh, device: torch.device,
                 materialize_model: Callable[[nn.Module], nn.Module]) -> nn.Module:
    # 1. Tensor parallelism first: it replaces parameters by DTensors that the later wrappers keep.
    rules = tp_rules(plan)[0]
    if plan.tensor is not None and plan.tp > 1 and isinstance(model, TorchModel):  # its own plan
        apply_model_tp(model, mesh[plan.tensor.axis], dict(plan.model.tp_plan), plan.tensor.sequence_parallel)
    elif plan.tensor is not None and plan.tp > 1:
        apply_tp(model, mesh[plan.tensor.axis], plan.tensor.sequence_parallel, rules)
    # 2. Expert parallelism: experts become DTensor shards over the expert axis, which data
    #    parallelism must then leave out of their reduction, and their FFNs over the tensor axis.
    tp_axis = plan.tensor.axis if plan.tensor is not None and plan.tp > 1 else None
    if plan.experts is not None and plan.ep > 1 and isinstance(model, TorchModel):  # its own plan
        apply_model_ep(model, mesh[plan.experts.axis], mesh[tp_axis] if tp_axis else None, dict(plan.model.ep_plan))
    elif not isinstance(model, TorchModel):
        folded = plan.expert_group > plan.ep  # experts whole over the expert and the tensor axis
        apply_ep(model, mesh, plan.experts.axis if plan.experts is not None and plan.ep > 1 else None, tp_axis,
                 frozenset(name for name, rule in rules.items() if rule.style == "replicate"), fold=folded)
    # 3. Context parallelism: positions and attention's K/V gather; parameters are untouched.
    if plan.context is not None and plan.cp > 1:
        apply_cp(model, plan.context.kind, mesh[plan.context.axis], plan.seq, device)
    # 4. Recomputation wraps blocks, so data parallelism sees (and shards) the wrapped blocks.
    apply_ac(model, plan.train.recompute, plan.train.recompute_layers,  # `model` is one stage (chunk) when pipelined
             plan.train.modules)
    #    Offloading hooks the first blocks (never recomputed ones: E512) without wrapping, so names stay the same.
    apply_offload(model, plan.train.offload_layers)
    # 5. Data parallelism last: it reduces (and for ZeRO-2/3 shards) whatever parameters remain.
    dp_mesh = data_mesh(plan, mesh)
    if dp_mesh is not None:
        kind = plan.data.kind if plan.data is not None else ir.DataKind.replicate  # expert axis alone: replicate
        return apply_dp(model, kind, dp_mesh, device, expert_data_mesh(plan, mesh), pipelined=plan.stages is not None,
                        data_shards={name: rule.data for name, rule in rules.items() if rule.data},
                        uneven=plan.train.batch_shares is not None,
                        gathering=plan.data.gathering if plan.data is not None else ir.FSDP_GATHERING,
                        mp_policy=mixed_precision(plan), before_ddp=materialize_model)
    return model
