"""Megatron tensor parallelism (and sequence parallelism) with DTensor's `parallelize_module`.

Stage: interpreter. Contract: `apply_tp(model, tp_mesh, sequence_parallel)` shards a `Transformer` in
place: attention heads and the MLP (Shoeybi et al. 2019) and the vocabulary of the embedding and head;
with sequence parallelism the norms work on sequence shards (Korthikanti et al. 2022). Every module
returns plain local tensors, so the model code never sees a DTensor activation.
"""
from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                               RowwiseParallel, SequenceParallel, parallelize_module)


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    # Between blocks the residual stream is replicated, or with sequence parallelism split along
    # the sequence (dim 1); each block gathers it before attention and the MLP and scatters after.
    stream = Shard(1) if sequence_parallel else Replicate()
    tied = model.head is not None and model.embed is not None and model.head.weight is model.embed.tok.weight
    top: dict = {}
    if model.embed is not None:
        positions = model.embed.pos is not None  # gpt adds positions to the full, replicated embedding
        top["embed.tok"] = RowwiseParallel(input_layouts=Replicate(),
                                           output_layouts=Replicate() if positions else stream)
        if positions and sequence_parallel:
            top["embed"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=stream)
    if model.norm is not None and sequence_parallel:
        top["norm"] = SequenceParallel()
    if model.head is not None:
        top["head"] = ColwiseParallel(input_layouts=stream, output_layouts=Replicate())
    parallelize_module(model, tp_mesh, top)
    if tied:  # both sides shard the vocabulary (dim 0): point the head at the embedding's DTensor again
        model.head.weight = model.embed.tok.weight

    for block in model.layers.values():
        plan: dict = {
            "attn.wq": ColwiseParallel(),
            "attn.wk": ColwiseParallel(),
            "attn.wv": ColwiseParallel(),
            "attn.wo": RowwiseParallel(output_layouts=stream),
        }
        ffn = "moe" if hasattr(block, "moe") else "mlp"
        if ffn == "mlp":
            plan.update({"mlp.w1": ColwiseParallel(), "mlp.w2": RowwiseParallel(output_layouts=stream)})
            if block.mlp.w3 is not None:
                plan["mlp.w3"] = ColwiseParallel()
        if sequence_parallel:
            gather = PrepareModuleInput(input_layouts=(stream,), desired_input_layouts=(Replicate(),),
                                        use_local_output=True)
            plan.update({"norm1": SequenceParallel(), "attn": gather, "norm2": SequenceParallel(), ffn: gather})
        parallelize_module(block, tp_mesh, plan)
        if sequence_parallel and ffn == "moe":  # experts stay replicated over tp: scatter back to shards
            parallelize_module(block.moe, tp_mesh, PrepareModuleOutput(
                output_layouts=Replicate(), desired_output_layouts=stream, use_local_output=True))
