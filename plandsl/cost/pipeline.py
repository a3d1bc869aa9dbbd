"""Plan -> per-stage action durations and memory for the schedule simulator (`schedules.simulate.Costs`).

Stage: cost model, read by `plandsl.cost.simulation`. Contract: `estimate_stage_costs(plan, assignment)`
returns the `Costs` of the plan's own cost model (`cost.estimate`): per stage, one microbatch's F,
B, and the split backward's I and W, each its compute (`cost.compute`: GEMMs at an efficiency that
depends on their size, other work at the memory bandwidth, recomputation inside the backward) plus
the communication on the critical path (`cost.comm` over the links each group uses); the
stage-to-stage transfer; activation bytes per stage and, per rank, the model states and torch's pipeline stage's
buffers it holds through the step (`cost.memory`, `MemoryEstimate.held`).
"""
from __future__ import annotations

from plandsl import ir
from plandsl.cost.memory import estimate_plan_memory
from plandsl.cost.estimate import estimate_stage_times, plan_work, schedule_p2p
from plandsl.cost.layer import plan_links
from plandsl.cost.memory import estimate_layer_activations, layer_offload, layer_recompute
from plandsl.ir.placement import Assignment
from plandsl.schedules.simulate import Costs


def estimate_stage_costs(plan: ir.Plan, assignment: Assignment, rank_devices=None, held: bool = False) -> Costs:
    """`rank_devices`: the device each pipeline rank is timed on (None: its slowest over the mesh; one
    replica of a plan with `batch_shares`: the replica's own); `held`: ZeRO-2/3 units kept gathered through
    the step (such a replica's, `cost.memory.gathered_bytes`)."""
    links = plan_links(plan)
    stages = estimate_stage_times(plan, assignment, links=links, rank_devices=rank_devices)
    memory = estimate_plan_memory(plan, assignment, held=held) or []
    static = tuple(m.held for m in memory)  # the states and torch's pipeline buffers, as `estimate` counts them
    activations = tuple(sum(estimate_layer_activations(plan, layer, recompute=mode)
                            for layer, mode, away in zip(layers, layer_recompute(plan, layers),
                                                         layer_offload(plan, layers)) if not away)
                        for layers in assignment.stage_layers)
    return Costs(stage_costs=tuple((s.forward, s.backward, s.input_grad, s.weight_grad) for s in stages),
                 p2p=schedule_p2p(plan, links, plan_work(plan)), activation_bytes=activations,
                 static_bytes=static)
