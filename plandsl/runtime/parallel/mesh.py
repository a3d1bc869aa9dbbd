"""The process group and the plan's mesh: `init_device_mesh` with the plan's axis names, outermost first.

Stage: interpreter. Contract: `init_distributed(timeout_s, device_kind)` joins the job torchrun (or a
test) started, with nccl on CUDA and gloo on the CPU (`resolve_device`: CUDA when present unless
`--device` says); `build_mesh(plan, device)` raises `RuntimeError` showing the arithmetic when the plan's
mesh does not cover WORLD_SIZE processes.
"""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from plandsl import ir

DEFAULT_TIMEOUT_S = 300  # a collective that waits longer than this fails the job instead of hanging


def resolve_device(device: str | None = None) -> str:
    """`--device`: cpu or cuda as given; None: cuda where torch has it, else cpu."""
    return device or ("cuda" if torch.cuda.is_available() else "cpu")


def init_distributed(timeout_s: float = DEFAULT_TIMEOUT_S, device_kind: str | None = None) -> torch.device:
    """Join the process group (unless the caller already did) and return this rank's device: with CUDA
    (`device_kind` cuda, or None on a machine with it) cuda:LOCAL_RANK and nccl, else the CPU and gloo."""
    use_cuda = resolve_device(device_kind) == "cuda"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return device


def build_mesh(plan: ir.Plan, device: torch.device) -> DeviceMesh:
    world = dist.get_world_size()
    if plan.mesh.size != world:
        product = " * ".join(f"{a.name}({a.size})" for a in plan.mesh.axes)
        raise RuntimeError(f"plan '{plan.name}': mesh {product} = {plan.mesh.size} != WORLD_SIZE({world}); "
                           f"start {plan.mesh.size} processes (`plandsl run` does so by default)")
    return init_device_mesh(device.type, tuple(a.size for a in plan.mesh.axes),
                            mesh_dim_names=tuple(a.name for a in plan.mesh.axes))


def submesh(mesh: DeviceMesh, axes: tuple[str, ...]) -> DeviceMesh:
    """The mesh over `axes` (in any order); several axes are flattened into one, taken in the mesh's
    order (torch slices only that way) and named by joining them with '_'."""
    if len(axes) == 1:
        return mesh[axes[0]]
    ordered = tuple(sorted(axes, key=mesh.mesh_dim_names.index))
    return mesh[ordered]._flatten("_".join(ordered))


def coordinate(mesh: DeviceMesh, axes: tuple[str, ...]) -> tuple[int, int]:
    """(this rank's index, the count) along `axes` taken together, outermost first; (0, 1) for no axes."""
    index, count = 0, 1
    for axis in axes:
        size = mesh.size(mesh.mesh_dim_names.index(axis))
        index = index * size + mesh.get_local_rank(axis)
        count *= size
    return index, count
