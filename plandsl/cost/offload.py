"""Activations offloaded to the host (`offload_layers`): the seconds their copies add to a stage's microbatch.

Stage: cost, beside `cost.memory` (which takes their bytes off the device). Contract: `offload_seconds(plan, layers,
times, device)` -> (forward, backward) seconds of the copies that the stage's compute does not hide, for one
microbatch of one stage (virtual chunk).

What Megatron-LM's --cpu-offloading-num-layers runs (megatron-core 0.16.1's transformer_block.py calls Transformer
Engine's `get_cpu_offload_context`) is, from TE 2.10 on, the `DefaultOffloadSynchronizer` of
`transformer_engine/pytorch/cpu_offload.py` (v2.10, lines 522-594): one offload stream of its own carries both
directions, one copy after another. Of a stage's L blocks, the first N are offloaded; block i's copy to the host is
issued at block i + 1's forward (`fwd_step` starts the previous layer's offload, each tensor's copy waiting for the
event its computation recorded) and the compute waits for it to end before block L - N + i's forward
(`finish_offload_map`, `release_activation_forward_gpu_memory`); its reload is issued at block L - 1 - N + i's
backward (`start_reload_map`, after the compute issued so far: `wait_stream`) and waited for when block i's backward
takes its tensors (`pop_tensor`). So a copy runs beside the compute of the blocks between its issue and its deadline,
and the copies queue behind each other on the one stream: with few offloaded blocks they hide behind the rest of the
stage, with N = L - 1 every one is waited for at once. `offload_seconds` replays that timeline. TE 2.9's handler
(`cpu_offload_v1.AsyncDoubleBufferGroupOffloadHandler`, only under NVTE_CPU_OFFLOAD_V1=1 since) is not modelled.
torch's `save_on_cpu(pin_memory=True)`, which `plandsl run` uses, copies on the compute stream and hides nothing
(docs/running.md): the model prices the recipes' synchronizer. The copies cross the device's host link,
`DeviceType.host_link` each way (PCIe, NVLink-C2C).
"""
from __future__ import annotations

import math
from typing import Sequence

from plandsl import ir
from plandsl.cost.layer import LayerTime
from plandsl.cost.memory import estimate_layer_activations, is_block, layer_offload, layer_recompute
from plandsl.ir.layers import Layer


def offloaded_bytes(plan: ir.Plan, layers: Sequence[Layer]) -> float:
    """Bytes one microbatch's offloaded blocks of one stage copy to the host (and back)."""
    return sum(estimate_layer_activations(plan, layer, recompute=mode)
               for layer, mode, away in zip(layers, layer_recompute(plan, layers), layer_offload(plan, layers))
               if away)


def host_capacity(plan: ir.Plan) -> float:
    """The host memory one device's offloaded activations may take: the least, over the cluster's node types that state
    `host_memory`, of a machine's memory over its devices (the check's E514 and the search's `fits`); inf when none
    states it."""
    return min((group.node.host_memory / group.node.host_devices for group in plan.cluster.groups
                if group.node.host_memory is not None), default=math.inf)


def offload_seconds(plan: ir.Plan, layers: Sequence[Layer], times: Sequence[LayerTime],
                    device: ir.DeviceType) -> tuple[float, float]:
    """(forward, backward) seconds the stage's copies to and from the host add to one microbatch, by Transformer
    Engine's default synchronizer (the module docstring): the compute's waits for the copies, never below 0."""
    if not plan.train.offload_layers:
        return 0.0, 0.0
    blocks = [(time, estimate_layer_activations(plan, layer, recompute=mode) / device.host_link if away else None)
              for layer, time, mode, away in zip(layers, times, layer_recompute(plan, layers),
                                                 layer_offload(plan, layers)) if is_block(plan, layer)]
    copies = [copy for _, copy in blocks]  # None: a block that keeps its activations
    if not any(copies):
        return 0.0, 0.0
    forward = [time.forward for time, _ in blocks]
    backward = [time.input_grad + time.weight_grad for time, _ in blocks]
    return _forward_waits(forward, copies), _backward_waits(backward, copies)


def _forward_waits(forward: Sequence[float], copies: Sequence[float | None]) -> float:
    """The forward's waits: block i's copy issued when its forward ends (at block i + 1's `fwd_step`), behind the
    copies before it, and waited for before block L - N + i's forward (at the forward's end where that is past the
    last block: a stage that offloads every block, torch's pipeline only)."""
    count = len(forward)
    offloaded = sum(1 for copy in copies if copy is not None)
    due: dict[int, list[int]] = {}
    for i, copy in enumerate(copies):
        if copy is not None:
            due.setdefault(max(count - offloaded + i, i + 1), []).append(i)
    clock = stream = 0.0
    done: dict[int, float] = {}
    for j in range(count + 1):
        if j >= 1 and copies[j - 1] is not None:
            stream = done[j - 1] = max(clock, stream) + copies[j - 1]
        clock = max([clock] + [done[i] for i in due.get(j, ())])
        if j < count:
            clock += forward[j]
    return max(0.0, clock - sum(forward))


def _backward_waits(backward: Sequence[float], copies: Sequence[float | None]) -> float:
    """The backward's waits, its blocks last to first: block i's reload issued at block L - 1 - N + i's backward
    (at its own where that is before it), behind the reloads before it, and waited for before block i's backward."""
    count = len(backward)
    offloaded = sum(1 for copy in copies if copy is not None)
    issued: dict[int, list[int]] = {}
    for i, copy in enumerate(copies):
        if copy is not None:
            issued.setdefault(max(count - 1 - offloaded + i, i), []).append(i)
    clock = stream = 0.0
    done: dict[int, float] = {}
    for j in reversed(range(count)):
        for i in sorted(issued.get(j, ()), reverse=True):
            stream = done[i] = max(clock, stream) + copies[i]
        if copies[j] is not None:
            clock = max(clock, done[j])
        clock += backward[j]
    return max(0.0, clock - sum(backward))


__all__ = ["host_capacity", "offload_seconds", "offloaded_bytes"]
