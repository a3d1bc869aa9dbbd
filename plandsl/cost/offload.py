"""Activations offloaded to the host (`offload_layers`): the seconds their copies add to a stage's microbatch.

Stage: cost, beside `cost.memory` (which takes their bytes off the device). Contract: `offload_seconds(plan, layers,
times, device)` -> (forward, backward) seconds of the copies that the stage's compute does not hide, for one
microbatch of one stage (virtual chunk).

Transformer Engine's handler, which Megatron's --cpu-offloading-num-layers runs (`cpu_offload_v1.
AsyncDoubleBufferGroupOffloadHandler`), copies on streams of their own (`d2h_stream`, `h2d_stream`) beside the
compute: the first offloaded block's copy starts once its forward is done, and its `layer_window_map` spreads the N
copies over the stage's blocks so that the last is waited for at the end of the last block's forward; in the
backward it reloads each block that many blocks ahead of its gradient, the last wait before the first block's.
So the copies of one direction overlap the compute of every block of the stage but the first, and are exposed only
where they take longer: D2H against the forward, H2D against the backward. torch's `save_on_cpu(pin_memory=True)`,
which `plandsl run` uses, copies on the compute stream and hides nothing (docs/running.md): the model prices the
recipes' handler. The copies cross the device's host link, `DeviceType.host_link` each way (PCIe, NVLink-C2C).
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
    """(forward, backward) seconds the stage's copies to and from the host add to one microbatch: each
    direction's copies at `device.host_link`, less the compute of the stage's blocks after its first (which they
    run beside), never below 0."""
    if not plan.train.offload_layers:
        return 0.0, 0.0
    copy = offloaded_bytes(plan, layers) / device.host_link
    if not copy:
        return 0.0, 0.0
    blocks = [time for layer, time in zip(layers, times) if is_block(plan, layer)][1:]
    forward = sum(time.forward for time in blocks)
    backward = sum(time.input_grad + time.weight_grad for time in blocks)
    return max(0.0, copy - forward), max(0.0, copy - backward)


__all__ = ["host_capacity", "offload_seconds", "offloaded_bytes"]
