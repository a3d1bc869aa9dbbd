"""A resolved plan -> a short human-readable description (`plandsl show` without --json)."""
from __future__ import annotations

from plandsl import ir
from plandsl.cost.estimate import data_shares, format_shares
from plandsl.cost.memory import estimate_plan_memory
from plandsl.ir import shares as batch
from plandsl.ir.placement import pipeline_rank_devices
from plandsl.ir.layers import layers_of, param_count
from plandsl.ir.placement import assign_stages, compress_names
from plandsl.lower.units import format_bytes, format_count


def describe_plan(plan: ir.Plan) -> str:
    model, cluster, mesh, train = plan.model, plan.cluster, plan.mesh, plan.train
    lines = [f"plan {plan.name}"]
    lines.append(f"  model     {model.name} ({_model_text(model)})")
    lines.append(f"  cluster   {cluster.name}: {cluster.num_nodes} node(s), {cluster.num_devices} devices"
                 + (" (heterogeneous)" if cluster.heterogeneous else ""))
    axes = " x ".join(f"{a.name}={a.size}" for a in mesh.axes)
    where = f" on devices [{mesh.first_device}:{mesh.first_device + mesh.size}]" if mesh.part is not None else ""
    lines.append(f"  mesh      {axes} = {mesh.size} devices{where}")
    parts = []
    if plan.data:
        parts.append(f"{plan.data.kind} over {', '.join(plan.data.axes)}"
                     + ir.gathering_text(plan.data.gathering, plan.data.zero_stage))
    if plan.tensor:
        parts.append(f"{plan.tensor.style} tp over {plan.tensor.axis}" + (" + SP" if plan.tensor.sequence_parallel else "")
                     + (" with overlap" if plan.tensor.overlap else "")
                     + (" (userbuffers" + ("" if plan.tensor.sm_margin else ", no SM margin") + ")"
                        if plan.tensor.userbuffers else "")
                     + (f", {'Megatron-LM' if plan.tensor.stack == 'megatron' else plan.tensor.stack}'s layers"
                        if plan.tensor.stack != plan.tensor.default_stack else ""))
    if plan.context:
        parts.append(f"{plan.context.kind} cp over {plan.context.axis}")
    if plan.experts:
        kind = "" if plan.experts.kind == "alltoall" else f"{plan.experts.kind} "
        parts.append((f"{kind}experts over {plan.experts.axis}" if not plan.experts.fold else
                      f"{kind}experts whole over [{', '.join(plan.experts.axes)}] ({plan.expert_group})")
                     + (" with overlap" if plan.experts.overlap else ""))
    lines.append(f"  parallel  {'; '.join(parts) or 'none'}")
    shares = data_shares(plan) if batch.uneven(plan) else None
    split = f"dp {plan.dp} x micro-batch {train.micro_batch} x {plan.num_microbatches} microbatch(es)" if shares is None \
        else f"per data rank {format_shares(plan, shares)}"
    lines.append(f"  train     global batch {train.global_batch} = {split}; seq {plan.seq}; {train.precision.value}{_recipe(train)}; "
                 f"recompute {train.recompute.value}"
                 f"{'' if train.recompute_layers is None else f' (first {train.recompute_layers} blocks per stage)'}"
                 f"{'' if train.recompute_modules is None else ' (' + ', '.join(m.value for m in train.recompute_modules) + ')'}; "
                 f"{_offload(train)}"
                 f"{'eager kernels; ' if train.kernels is ir.Kernels.eager else ''}"
                 f"{'materialized attention; ' if train.attention is ir.Attention.materialized else ''}"
                 f"{'' if train.loss is ir.Loss.standard else f'{train.loss.value} loss; '}"
                 f"{train.optimizer.value}{_dtypes(train)}")
    assignment, _ = assign_stages(plan)
    if plan.stages and assignment:
        lines.append(f"  pipeline  {assignment.num_stages} stages over '{plan.stages.axis}' ({plan.pp} ranks x "
                     f"virtual {plan.stages.virtual}), schedule {plan.schedule.name if plan.schedule else '-'}")
        for stage, layers in enumerate(assignment.stage_layers):
            lines.append(f"    stage {stage:>3} on rank {assignment.rank_of_stage[stage]:>3}: "
                         f"{compress_names([layer.name for layer in layers])}")
    most = batch.replica_plan(plan, max(shares)) if shares else plan  # the most microbatches in flight
    held = bool(shares) and plan.data is not None  # gradients accumulated unreduced, FSDP units gathered
    estimates = estimate_plan_memory(most, assignment, held=held) if assignment else None
    if estimates:
        whose = f" of data rank {shares.index(max(shares))}, the most microbatches, on its own devices" if shares else ""
        buffers = any(estimate.other for estimate in estimates)  # torch's pipeline stage's (`cost.memory`)
        apart = any(estimate.apart or estimate.moments for estimate in estimates)  # `MemoryEstimate.total`'s less
        lines.append(f"  memory    per device (estimate{whose}): rank: parameters + gradients + optimizer + activations "
                     + ("+ pipeline buffers " if buffers else "")
                     + ("- what of them is never alive at once " if apart else "") + "= total / capacity")
        devices_of = batch.replica_device_types(plan)[shares.index(max(shares))] if shares \
            else pipeline_rank_devices(plan)
        for rank, (estimate, devices) in enumerate(zip(estimates, devices_of)):
            capacity = min((d.usable_memory for d in devices), default=0)
            other = f" + {format_bytes(estimate.other)}" if buffers else ""
            other += f" - {format_bytes(estimate.apart + estimate.moments)}" if apart else ""
            lines.append(f"    {rank:>3}: {format_bytes(estimate.params)} + {format_bytes(estimate.grads)} + "
                         f"{format_bytes(estimate.optimizer)} + {format_bytes(estimate.activations)}{other} = "
                         f"{format_bytes(estimate.total)} / {format_bytes(capacity)}")
    return "\n".join(lines)


def _model_text(model: ir.Model) -> str:
    """The family and the parameters; of a mixture of experts also those a token runs through (top_k of each layer's
    routed experts) and how it routes."""
    count = param_count(model)
    text = f"{model.kind}, {format_count(count)} parameters"
    if isinstance(model, ir.TransformerModel) and model.experts:
        routed = sum(p.numel for layer in layers_of(model) for p in layer.params if ".experts." in p.name)
        active = count - routed + routed * model.top_k // model.experts
        routing = f"top {model.top_k} of {model.experts} experts" \
            + (f" inside {model.group_top_k} of {model.expert_groups} groups" if model.expert_groups else "") \
            + (f", {model.shared_experts} shared" if model.shared_experts else "")
        text += f", {format_count(active)} active a token; {routing}"
    return text


def describe_document(document: ir.Document, plans: list[ir.Plan]) -> str:
    if not plans:
        names = [f"{len(getattr(document, k))} {k}" for k in ("devices", "nodes", "clusters", "models", "schedules")
                 if getattr(document, k)]
        return f"{document.file}: no plan; defines {', '.join(names) or 'nothing'}"
    return "\n\n".join(describe_plan(plan) for plan in plans)


def _offload(train: ir.Training) -> str:
    """`offload_layers` as `show` says it, or nothing."""
    return f"activations of the first {train.offload_layers} blocks per stage offloaded to the host; " \
        if train.offload_layers else ""


def _recipe(train: ir.Training) -> str:
    """` (current scaling, first 1 and last 1 blocks in bf16)`: the FP8 recipe the plan names, the blocks it keeps in bf16."""
    parts = [f"{train.fp8_recipe.value} scaling"] if train.fp8_recipe is not None else []
    if train.bf16_first_layers or train.bf16_last_layers:
        parts.append(f"first {train.bf16_first_layers} and last {train.bf16_last_layers} blocks in bf16")
    return f" ({', '.join(parts)})" if parts else ""


def _dtypes(train: ir.Training) -> str:
    """` (states bf16, grads bf16)`: the kept dtypes that are not the default fp32, and a master copy apart from
    the weights (`param_dtype`)."""
    named = [(word, getattr(train, key)) for word, key in (("weights", "weights_dtype"), ("grads", "grad_dtype"),
                                                           ("states", "optimizer_dtype"))]
    given = [f"{word} {dtype.value}" for word, dtype in named if dtype is not ir.Precision.fp32]
    if train.master_copy:
        given.append(f"master {train.master_dtype.value}")
    return f" ({', '.join(given)})" if given else ""
