"""Expert parallelism: the plan's `experts = alltoall over ep`, every MoE layer's experts split over the axis,
and, under tensor parallelism, each expert's FFN split over the tensor axis (Megatron-Core's expert tensor
parallelism, its default equal to tp).

Stage: interpreter. Contract: `apply_ep(model, mesh, ep_axis, tp_axis)` changes each `MoE` layer in place:
rank r of the expert axis keeps experts [r*E/ep, (r+1)*E/ep) (Shard(0)) and rank t of the tensor axis the
t-th slice of their FFN (w1/w3 Shard(1), w2 Shard(2)), as DTensor shards, so names and global shapes stay the
catalogue's; the layer's `dispatch` exchanges its routed rows with `all_to_all_single` (autograd-aware) over
the expert axis, and the tensor ranks' partial outputs, once combined, are summed over the tensor axis (the
gradients of what meets them summed on the way back, the router's path left whole). Folded over the tensor axis
(`experts = alltoall over [ep, tp]`, `fold`), the experts are whole and split over the ep x tp ranks, and each
tensor rank routes its own consecutive share of the tokens through one all-to-all over them: its partial output
is summed over the tensor axis the same way. Routing and combining are the one-process model's, and no token is
dropped, so the layer computes what one process computes.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from plandsl.ir.torch_plan import matches
from plandsl.runtime.models import Experts, MoE, expert_mlps
from plandsl.runtime.parallel.mesh import submesh
from plandsl.runtime.parallel.tensor_parallel import _SumGradient

# The dim of each grouped expert weight [experts, out, in] that holds the FFN: w1 and w3 produce it
# (column-split over tp), w2 consumes it (row-split, its partial sums reduced over tp).
FFN_DIMS = {"w1": 1, "w3": 1, "w2": 2}


def apply_ep(model: nn.Module, mesh: DeviceMesh, ep_axis: str | None, tp_axis: str | None,
             whole: frozenset[str] = frozenset(), fold: bool = False) -> None:
    """Split every MoE layer's experts over `ep_axis` and their FFN over `tp_axis` (either None: not split
    that way) of `mesh`, the whole device mesh; the experts modules named in `whole` (a `replicate` shard
    rule) keep their FFN whole on every tensor rank. `fold` (`experts = alltoall over [ep, tp]`): the experts
    whole, spread over the ep x tp ranks, each tensor rank routing its own share of the tokens through one
    all-to-all over them (Megatron-Core's MoE parallel folding)."""
    for name, moe in model.named_modules():
        if not isinstance(moe, MoE):
            continue
        if fold and ep_axis is not None and tp_axis is not None:
            axes = tuple(axis for axis in mesh.mesh_dim_names if axis in (ep_axis, tp_axis))
            moe.experts = ExpertShards(moe.experts, mesh[axes], ep_axis, None, expert_axes=axes)
            moe.dispatch = AllToAllDispatch(submesh(mesh, axes))
            tp_index = mesh.mesh_dim_names.index(tp_axis)
            moe.keep = (mesh.get_local_rank(tp_axis), mesh.size(tp_index))
            # this rank's rows make a partial output (summed over the axis), and the gradients of what meets
            # them a partial gradient (summed on the way back): Megatron's `g` and `f`, as for split experts
            group = mesh[tp_axis].get_group()
            moe.sum_gradients = lambda x, group=group: _SumGradient.apply(x, group)
            moe.sum_partial = lambda x, group=group: _SumForward.apply(x, group)
            continue
        layer_tp = None if f"{name}.experts" in whole else tp_axis
        axes = tuple(axis for axis in mesh.mesh_dim_names if axis in (ep_axis, layer_tp))
        if not axes:
            continue
        moe.experts = ExpertShards(moe.experts, mesh[axes[0]] if len(axes) == 1 else mesh[axes], ep_axis, layer_tp)
        if ep_axis is not None:
            moe.dispatch = AllToAllDispatch(mesh[ep_axis])
        if layer_tp is not None:  # one reduction of the combined [tokens, hidden] each way, as Megatron's layer
            group = mesh[layer_tp].get_group()
            moe.sum_gradients = lambda x, group=group: _SumGradient.apply(x, group)
            moe.sum_partial = lambda x, group=group: _SumForward.apply(x, group)


def moe_layers(model: nn.Module) -> list[MoE]:
    return [module for module in model.modules() if isinstance(module, MoE)]


def expert_shards(model: nn.Module) -> list[nn.Module]:
    """The modules whose parameters differ between expert ranks (data parallelism must not reduce them over
    the expert axis): plandsl's `ExpertShards`, and a model from torch's experts that transformers' expert
    parallelism split (`_is_expert_parallel`, `apply_model_ep`)."""
    return [module for module in model.modules()
            if (isinstance(module, ExpertShards) and module.expert_parallel)
            or getattr(module, "_is_expert_parallel", False)]


def unscaled_expert_params(models: list[nn.Module]) -> list[nn.Parameter]:
    """The expert parameters whose gradients sum the expert axis's batch shares rather than average them
    (transformers' expert parallelism; plandsl's `ExpertShards` scale theirs inside): `train_step` scales
    them by 1/ep after the backward, which data parallelism's averaging over the other axes commutes with."""
    return [param for model in models for module in expert_shards(model) if not isinstance(module, ExpertShards)
            for param in module.parameters()]


@torch.no_grad()
def finish_expert_grads(params: list[nn.Parameter], ep: int, tp_group) -> None:
    """After the backward, transformers' expert gradients as the global batch's mean: summed over the tensor
    axis (`tp_group`; each of its ranks sent its own slice of their shared batch, AllToAllEP), then the ep
    batch shares they sum averaged (1/ep)."""
    for param in params:
        if param.grad is None:
            continue
        local = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
        if tp_group is not None:
            dist.all_reduce(local, group=tp_group)  # in place: a DTensor's local shard is its storage
        local.mul_(1.0 / ep)


def apply_model_ep(model: nn.Module, ep_mesh: DeviceMesh, batch_mesh: DeviceMesh | None, plan: dict[str, str]) -> None:
    """A model from torch's experts split as its own expert-parallel plan says, by transformers' own
    implementation (`transformers.distributed.expert_parallel.apply_expert_parallelism`, the model's library):
    `grouped_gemm` parameters Shard(0) over the expert axis (rank r keeps experts [r*E/ep, (r+1)*E/ep)),
    `ep_dispatch_experts` modules exchanging their routed tokens with all-to-all. `batch_mesh`: the ranks
    holding the same batch (the tensor axis; None: each rank alone). Patterns that match nothing in this
    (stage) module are left out."""
    from transformers.distributed.expert_parallel import apply_expert_parallelism  # lazy: the model's library
    if batch_mesh is None:  # a one-rank mesh per rank (created on every rank: meshes are collective)
        batch_mesh = init_device_mesh(ep_mesh.device_type, (dist.get_world_size(), 1),
                                      mesh_dim_names=("_world", "_alone"))["_alone"]
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    present = {name: style for pattern, style in plan.items() for name in [*modules, *params]
               if matches(pattern, name)}
    apply_expert_parallelism(model, ep_mesh, batch_mesh, present)


class ExpertShards(Experts):
    """This rank's experts of one layer, and of each its FFN slice. Each local expert sees the rows of every
    rank of the expert axis, so its gradient sums the ep batch shares; scaled by 1/ep it is their mean, as
    for replicated parameters (data parallelism then averages it over the data axes only). The ranks of the
    tensor axis see the same rows (they share a batch) and each computes its FFN slice: partial outputs,
    which the MoE layer sums over the axis once combined (`apply_ep`)."""

    def __init__(self, full: Experts, mesh: DeviceMesh, ep_axis: str | None, tp_axis: str | None,
                 expert_axes: tuple[str, ...] | None = None):
        nn.Module.__init__(self)
        expert_axes = expert_axes or (ep_axis,)  # the axes the experts' dim is split over, in the mesh's order
        self.expert_parallel = ep_axis is not None
        self.grad_scale = 1.0 / mesh.size(mesh.mesh_dim_names.index(ep_axis)) if ep_axis else 1.0
        for name in ("w1", "w2", "w3"):
            weight = getattr(full, name)
            if weight is None:
                self.register_parameter(name, None)
                continue
            local, placements = weight.detach(), []
            for axis in mesh.mesh_dim_names:
                dim = 0 if axis in expert_axes else FFN_DIMS[name]
                rank, size = mesh.get_local_rank(axis), mesh.size(mesh.mesh_dim_names.index(axis))
                local = local.chunk(size, dim=dim)[rank]
                placements.append(Shard(dim))
            shard = DTensor.from_local(local.clone(), mesh, placements, run_check=False)
            setattr(self, name, nn.Parameter(shard, requires_grad=weight.requires_grad))

    def forward(self, routed: torch.Tensor, counts: list[int]) -> torch.Tensor:
        weights = [None if w is None else _ScaleGrad.apply(_local(w), self.grad_scale)
                   for w in (self.w1, self.w2, self.w3)]
        return expert_mlps(routed, counts, *weights, getattr(self, "rerun_activation", False))


def _local(weight: torch.Tensor) -> torch.Tensor:
    return weight.to_local() if isinstance(weight, DTensor) else weight


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the backward multiplies the gradient by `scale`."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


class _SumForward(torch.autograd.Function):
    """All-reduce (sum) over `group` forward, identity backward (Megatron's `g` operator): the MoE layer's
    combined output, a partial sum on each tensor rank (its slice of every expert's FFN)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class AllToAllDispatch:
    """(rows grouped by global expert, rows per global expert, this rank's ExpertShards) -> their outputs,
    in the same order: rows go to the rank holding their expert and the outputs come back."""

    def __init__(self, ep_mesh: DeviceMesh):
        self.group = ep_mesh.get_group()
        self.size = ep_mesh.size()

    def __call__(self, routed: torch.Tensor, counts: torch.Tensor, experts: ExpertShards) -> torch.Tensor:
        local = counts.numel() // self.size
        send = counts.view(self.size, local)  # rows for rank s's experts, per expert
        received = torch.empty_like(send)     # received[s, j]: rows from rank s for local expert j
        dist.all_to_all_single(received, send, group=self.group)
        send_sizes, receive_sizes = send.sum(1).tolist(), received.sum(1).tolist()
        inbound = all_to_all_single_autograd(routed, receive_sizes, send_sizes, self.group)
        # Arrivals are grouped by source rank, then expert; the experts need them grouped by expert.
        expert_of_row = torch.arange(local, device=counts.device).repeat(self.size).repeat_interleave(
            received.flatten())
        by_expert = expert_of_row.argsort(stable=True)
        outputs = experts(inbound[by_expert], received.sum(0).tolist())
        outbound = torch.empty_like(outputs).index_copy(0, by_expert, outputs)  # back to arrival order
        return all_to_all_single_autograd(outbound, send_sizes, receive_sizes, self.group)
