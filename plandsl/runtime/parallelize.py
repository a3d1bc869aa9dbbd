"""Apply the plan's parallelisms to a model (or to one pipeline stage of it), in a fixed order.

Stage: interpreter. Contract: `parallelize(plan, model, mesh, device)` moves the model to `device`,
chains the `apply_*` verbs and returns the module to call (a DDP wrapper, or the model itself when
the wrappers are composable); parameter names stay the catalogue's, up to wrapper prefixes.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from plandsl import ir
from plandsl.runtime.data_parallel import apply_dp
from plandsl.runtime.mesh import submesh
from plandsl.runtime.recompute import apply_ac
from plandsl.runtime.tensor_parallel import apply_tp


def data_mesh(plan: ir.Plan, mesh: DeviceMesh) -> DeviceMesh | None:
    """The mesh gradients are reduced over: the data axes (2-D for hsdp), None without data parallelism."""
    if plan.data is None or plan.dp == 1:
        return None
    if plan.data.kind == "hsdp":
        return mesh[tuple(plan.data.axes)]
    return submesh(mesh, tuple(plan.data.axes))


def parallelize(plan: ir.Plan, model: nn.Module, mesh: DeviceMesh, device: torch.device) -> nn.Module:
    model.to(device)
    # 1. Tensor parallelism first: it replaces parameters by DTensors that the later wrappers keep.
    if plan.tensor is not None and plan.tp > 1:
        apply_tp(model, mesh[plan.tensor.axis], plan.tensor.sequence_parallel)
    # 2. Recomputation wraps blocks, so data parallelism sees (and shards) the wrapped blocks.
    apply_ac(model, plan.train.recompute)
    # 3. Data parallelism last: it reduces (and for ZeRO-2/3 shards) whatever parameters remain.
    dp_mesh = data_mesh(plan, mesh)
    if dp_mesh is not None:
        return apply_dp(model, plan.data.kind, dp_mesh, device)
    return model
