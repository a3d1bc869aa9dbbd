"""Plan -> per-stage action durations and memory for the schedule simulator (`schedules.simulate.Costs`).

A first, ideal model: a stage's forward takes its FLOPs at the device's peak for the plan's
precision (no efficiency factor yet: the cost-model issue adds achievable efficiency and
communication over the real topology); backward is 2x forward (Narayanan et al. 2021: the
backward pass computes gradients for inputs and weights, each as costly as the forward), plus
one forward under full recomputation; with a split backward, input and weight gradients take
half each. A stage-to-stage transfer moves one microbatch's activations over the link between
neighbouring pipeline ranks. Memory per stage and microbatch comes from `cost.memory`.
"""
from __future__ import annotations

from plandsl import ir
from plandsl.check.memory import estimate_plan_memory, pipeline_rank_devices
from plandsl.cost.memory import estimate_layer_activations
from plandsl.placement import Assignment
from plandsl.schedules.simulate import Costs


def estimate_stage_costs(plan: ir.Plan, assignment: Assignment) -> Costs:
    devices = pipeline_rank_devices(plan)
    tokens = plan.train.micro_batch * -(-plan.seq // plan.cp)
    precision = plan.train.precision
    recompute = plan.train.recompute is ir.Recompute.full
    table = []
    for stage, layers in enumerate(assignment.stage_layers):
        rank = assignment.rank_of_stage[stage]
        peak = min(d.peak.get(precision, min(d.peak.values())) for d in devices[rank])
        forward = sum(layer.flops_per_token for layer in layers) * tokens / plan.tp / peak
        backward = 2 * forward + (forward if recompute else 0.0)
        table.append((forward, backward, backward / 2, backward / 2))
    memory = estimate_plan_memory(plan, assignment) or []
    static = tuple(m.params + m.grads + m.optimizer for m in memory)
    activations = tuple(sum(estimate_layer_activations(plan, layer) for layer in layers)
                        for layers in assignment.stage_layers)
    return Costs(stage_costs=tuple(table), p2p=_p2p_seconds(plan, assignment, tokens),
                 activation_bytes=activations, static_bytes=static)


def _p2p_seconds(plan: ir.Plan, assignment: Assignment, tokens: int) -> float:
    """One microbatch's boundary activations between neighbouring pipeline ranks."""
    if plan.stages is None or plan.pp == 1:
        return 0.0
    width = max((layer.output_width for layers in assignment.stage_layers[:-1] for layer in layers[-1:]), default=0)
    sequence_parallel = plan.tensor is not None and plan.tensor.sequence_parallel
    size = tokens * width * plan.train.precision.bytes / (plan.tp if sequence_parallel else 1)
    names = [a.name for a in plan.mesh.axes]
    stride = 1
    for axis in plan.mesh.axes[names.index(plan.stages.axis) + 1:]:
        stride *= axis.size
    group = plan.cluster.groups[0]
    per_node = min(g.node.devices for g in plan.cluster.groups)
    if stride < per_node:
        link = group.node.link
    else:
        nics = [g.node.nic for g in plan.cluster.groups if g.node.nic] + ([plan.cluster.fabric] if plan.cluster.fabric else [])
        link = min(nics, key=lambda l: l.bandwidth) if nics else group.node.link
    return link.latency + size / link.bandwidth
