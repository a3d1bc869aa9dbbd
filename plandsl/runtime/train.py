"""The per-rank training loop: build the job from a checked plan, run `train_step`s, write metrics.

Stage: interpreter (one OS process per rank, started by torchrun or a test). Contract:
`run(plan, config)` joins the process group, trains `config.steps` steps and returns the exit status
(0, or 1 when `--check-equivalence` finds the run differs from the one-process reference) and the job.
"""
from __future__ import annotations

import math
import os
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from plandsl import ir
from plandsl.runtime.data import Batches, microbatches
from plandsl.runtime.parallel.data_parallel import build_dp_optimizer, gradient_sync
from plandsl.runtime.parallel.mesh import DEFAULT_TIMEOUT_S, build_mesh, coordinate, init_distributed
from plandsl.runtime.loss import DepthsLoss, HeadLoss, fused_loss
from plandsl.runtime.models import build_meta_model, build_model, loss_fn
from plandsl.runtime.optim import build_lr_scheduler
from plandsl.runtime.parallel.context_parallel import sequence_columns
from plandsl.runtime.parallel.expert_parallel import finish_expert_grads, unscaled_expert_params
from plandsl.runtime.parallel.parallelize import data_mesh, expert_data_mesh, parallelize
from plandsl.runtime.parallel.tensor_parallel import loss_context
from plandsl.runtime.precision import LossScaler, autocast, keep_weights, loss_scaler
from plandsl.runtime import checkpoint, faults
from plandsl.runtime.progress import Reporter
from plandsl.runtime.equivalence import buffers_comparable, compare, gather_buffers, gather_params, tolerance
from plandsl.runtime.reference import RunResult, run_reference
from plandsl.runtime.faults import report_error


@dataclass
class RunConfig:
    steps: int = 10
    """The step to stop at (counted from the start of training, also when resuming)."""
    metrics: str | Path | None = None
    """JSON-lines file rank 0 writes, one object per step; None: none."""
    check_equivalence: bool = False
    """After training, compare losses and parameters with the one-process reference (rank 0)."""
    token_file: str | Path | None = None
    """A uint16 token file (nanoGPT's train.bin) instead of synthetic tokens."""
    timeout_s: float = DEFAULT_TIMEOUT_S
    """A collective waiting longer than this fails the job."""
    quiet: bool = False
    """No per-step line (or progress bar) on stdout."""
    checkpoint_dir: str | Path | None = None
    """Where checkpoints go (`step-NNNNNN` directories) and come from; None: none written or read."""
    checkpoint_every: int | None = None
    """Write a checkpoint every this many steps; with `checkpoint_dir` one is always written after the last step."""
    resume: bool = False
    """Continue from the latest checkpoint in `checkpoint_dir` (from step 1 when there is none)."""
    device: str | None = None
    """cpu, cuda, or None: cuda where this machine has it (`parallel.mesh.resolve_device`)."""


@dataclass
class Job:
    """Everything the loop needs, built once by `build_job`."""

    plan: ir.Plan
    mesh: DeviceMesh
    device: torch.device
    parts: list[nn.Module]   # what runs: the (wrapped) model, or this rank's pipeline stages
    models: list[nn.Module]  # the same, unwrapped: parameter names as the catalogue gives them
    optimizer: torch.optim.Optimizer
    scheduler: Any
    batches: Batches
    dp_rank: int
    dp: int
    loss_weight: float       # this rank's share when averaging the loss over the world
    grad_weight: float = 1.0  # batch_shares: local share x dp / global batch, so the data-parallel mean is the global one
    loss_scale: float = 1.0   # what a pipeline's loss function multiplies each microbatch's loss by (fp16's scale aside)
    columns: torch.Tensor | None = None  # context parallelism: the positions of each sequence this rank holds
    loss: Any = loss_fn
    pipeline: Any = None     # a torch.distributed.pipelining schedule, or None
    has_first: bool = True
    has_last: bool = True
    losses: list[float] = field(default_factory=list)  # of the steps this run trained
    first_step: int = 0      # steps done before this run (restored from a checkpoint)
    report: Any = None       # rank 0, after `check_equivalence`: an equivalence.Report
    scaler: LossScaler = field(default_factory=lambda: LossScaler(enabled=False))  # fp16: dynamic loss scaling
    expert_grads_summed: list = field(default_factory=list)  # expert parameters train_step scales by 1/ep


def build_job(plan: ir.Plan, mesh: DeviceMesh, device: torch.device, config: RunConfig,
              make_model: Callable[[], nn.Module] | None = None) -> Job:
    """`make_model`: builds the full model in place of `build_model` (`runtime.memtrace`: on fake tensors)."""
    # The full model, initialised from the seed alone, so every layout starts from the same values: a built-in
    # family's or a Hugging Face model's on the meta device, which `parallelize` fills with `build_model`'s values
    # once it is split, each rank allocating its own shards only (`models.materialize`); a factory's on the CPU.
    if make_model is not None:
        model = make_model()
    else:
        model = build_meta_model(plan.model)
        model = build_model(plan.model, plan.train.seed) if model is None else model
    model = keep_weights(plan, model)  # the plan's master_dtype
    batches = Batches(plan, config.token_file, model)
    # `loss: fused`: the model returns its final hidden states and the head computes the loss chunk by chunk
    # (runtime.loss); set before parallelizing, which splits the head for it. Else torch's cross entropy.
    head_loss = fused_loss(plan, model)
    loss = head_loss or getattr(model, "loss", loss_fn)
    scaler = loss_scaler(plan, device)
    dp_rank, dp = coordinate(mesh, plan.batch_axes())
    share = batches.shares[dp_rank] if batches.shares is not None else plan.train.global_batch // dp
    # Data parallelism averages gradients over the dp ranks (DDP, FSDP2, replicate; ZeRO-1 steps the mean), each
    # the mean over its own share: weighting rank r by share_r * dp / G makes that average the global batch's mean.
    grad_weight = share * dp / plan.train.global_batch
    pipeline, has_first, has_last, loss_scale = None, True, True, 1.0
    if plan.stages is not None:
        # The one call into pipeline parallelism: plandsl.runtime.parallel.pipeline splits the model into this
        # rank's stages (applying `parallelize` to each) and returns a torch pipelining schedule, which runs
        # this replica's own microbatch count (its share: `batch_shares`).
        # lazy: torch's pipelining takes seconds to import; only a pipelined plan needs it
        from plandsl.runtime.parallel.pipeline import build_pipeline
        microbatches = share // plan.train.micro_batch
        # torch divides the gradients by the microbatch count after the data-parallel reduction; with counts
        # that differ between replicas each divides its own loss instead, before the reduction
        own = plan.train.batch_shares is not None
        loss_scale = grad_weight / microbatches if own else 1.0
        pipeline, parts, has_first, has_last = build_pipeline(
            plan, model, mesh, device, loss_fn=scaler.scaled(_weighted(loss, loss_scale)), microbatches=microbatches,
            scale_grads=not own)
        models = list(parts)
        if head_loss is not None:  # the head of this rank's copy of the last stage, if it holds it
            head_loss.bind(models)
    else:
        parts = [parallelize(plan, model, mesh, device)]
        models = [model]
    optimizer = build_dp_optimizer(plan, models, data_mesh(plan, mesh), expert_data_mesh(plan, mesh))
    scheduler = build_lr_scheduler(plan, optimizer, config.steps)
    columns = None
    if plan.context is not None and plan.cp > 1:  # this rank's tokens of each sequence
        columns = sequence_columns(plan.seq, mesh.get_local_rank(plan.context.axis), plan.cp)
    # One rank per replica and sequence share reports the loss: the last pipeline stage, coordinate 0 elsewhere.
    shared = plan.reduce_axes()
    others = [a.name for a in plan.mesh.axes if a.name not in shared and a.name != _pp_axis(plan)]
    owner = has_last and all(mesh.get_local_rank(axis) == 0 for axis in others)
    reporters = math.prod(plan.mesh.degree(axis) for axis in shared)
    return Job(plan, mesh, device, parts, models, optimizer, scheduler, batches, dp_rank, dp,
               loss_weight=grad_weight / reporters if owner else 0.0, grad_weight=grad_weight,
               loss_scale=loss_scale, loss=loss,
               pipeline=pipeline,
               has_first=has_first, has_last=has_last, scaler=scaler, columns=columns,
               expert_grads_summed=unscaled_expert_params(models) if plan.ep > 1 else [])


def _weighted(loss: Any, weight: float) -> Any:
    """`loss` times `weight` (1: `loss` itself), for a pipeline schedule, which scales no loss of its own."""
    if weight == 1.0:
        return loss
    return lambda outputs, targets: loss(outputs, targets) * weight


def _pp_axis(plan: ir.Plan) -> str | None:
    return plan.stages.axis if plan.stages is not None else None


# ---- the step -------------------------------------------------------------------------
def forward_backward_step(job: Job, inputs: torch.Tensor, targets: torch.Tensor, scale: float) -> torch.Tensor:
    """One microbatch through the model; the backward sees the loss times `scale` (1 / microbatches, times
    the rank's share weight with `batch_shares`), and times the loss scale with fp16."""
    # logits split over the vocabulary by tensor parallelism: torch's loss parallel, forward and backward
    with loss_context(job.models):
        with autocast(job.plan, job.device.type):
            if isinstance(job.loss, HeadLoss):  # the model's head computes it, inside the model's call (runtime.loss)
                loss = job.parts[0](inputs, targets)
            else:
                loss = job.loss(job.parts[0](inputs), targets)
        job.scaler.scale_loss(loss * scale).backward()
    return loss.detach()


def pipeline_forward_backward_step(job: Job, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The rank's local batch through the pipeline schedule (it splits the microbatches itself); its loss
    function returns the loss times the loss scale (`build_job`), which the mean here divides out."""
    losses: list[torch.Tensor] | None = [] if job.has_last else None
    target = targets if job.has_last else None
    if target is not None and isinstance(job.loss, DepthsLoss) and target.dim() == 2:  # the depths read the tokens
        target = DepthsLoss.sample(inputs, targets)
    # the schedule calls the loss function and runs its backward inside `step`: loss parallel around it all
    with loss_context(job.models), autocast(job.plan, job.device.type):
        if job.has_first:
            job.pipeline.step(inputs, target=target, losses=losses)
        else:
            job.pipeline.step(target=target, losses=losses)
    if not losses:
        return torch.zeros((), device=job.device)
    return torch.stack(losses).mean().detach() / (job.scaler.scale * job.loss_scale)


def train_step(job: Job, step: int, report: bool = True) -> float:
    """One optimizer step on the global batch of `step` (0-based); returns its mean loss over the replicas, or
    with `report` False nan (no collective, no value read: `runtime.memtrace` runs it on fake tensors)."""
    inputs, targets = job.batches.local_batch(step, job.dp_rank, job.dp, job.columns)
    if job.columns is not None and isinstance(job.loss, DepthsLoss):  # the depths read tokens k ahead: whole rows
        targets = DepthsLoss.sample(*job.batches.local_batch(step, job.dp_rank, job.dp))
    # contiguous: a batch is two overlapping views of seq + 1 tokens, and torch's pipelining (2.11) refuses
    # a stage input whose strides differ from the (contiguous) example it was built with
    inputs, targets = inputs.to(job.device).contiguous(), targets.to(job.device).contiguous()
    job.optimizer.zero_grad()
    if job.pipeline is not None:
        loss = pipeline_forward_backward_step(job, inputs, targets)
    else:
        # Gradient accumulation: each microbatch's loss is scaled so the sum is the batch mean.
        chunks = microbatches(inputs, targets, job.plan.train.micro_batch)
        loss = torch.zeros((), device=job.device)
        for index, (x, y) in enumerate(chunks):
            with gradient_sync(job.parts[0], enabled=index == len(chunks) - 1,
                               every_microbatch=job.plan.train.batch_shares is None):
                loss += forward_backward_step(job, x, y, job.grad_weight / len(chunks)) / len(chunks)
    if job.expert_grads_summed:  # transformers' expert parallelism: the ep shares' sum, per tensor rank's slice
        tp_group = job.mesh[job.plan.tensor.axis].get_group() if job.plan.tensor and job.plan.tp > 1 else None
        finish_expert_grads(job.expert_grads_summed, job.plan.ep, tp_group)
    params = [p for part in job.models for p in part.parameters()]
    found_inf = job.scaler.unscale_(params)  # fp16: an inf or nan gradient on any rank skips the step
    job.scaler.update(found_inf)
    if found_inf:
        return global_loss(job, loss) if report else math.nan
    if job.plan.train.grad_clip is not None:
        pp_mesh = job.mesh[_pp_axis(job.plan)] if job.pipeline is not None else None
        tied = job.pipeline.tied if job.pipeline is not None else None
        clip_grad_norm_(params, job.plan.train.grad_clip, pp_mesh, tied.duplicates if tied else ())
    job.optimizer.step()
    job.scheduler.step()
    return global_loss(job, loss) if report else math.nan


def clip_grad_norm_(params: list[torch.Tensor], max_norm: float, pp_mesh: DeviceMesh | None = None,
                    counted_elsewhere: Iterable[torch.Tensor] = ()) -> torch.Tensor:
    """Clip by the norm of all gradients of the model, across tensor, data and pipeline shards.

    Parameters here mix plain tensors (replicated) and DTensors of several meshes (TP, FSDP, both,
    expert shards), so each group (one mesh and placement) is reduced on its own and the squares
    summed (torchtitan's recipe, per group): a DTensor group's squares are summed over its local
    shards, then over the mesh dimensions it is sharded on (`get_total_norm` redistributes instead,
    which fails on a mesh flattened from axes that are not neighbours, e.g. FSDP over dp x cp of
    experts split over an ep between them); pipeline stages sum theirs over the pipeline axis. `counted_elsewhere` are clipped but left out of the norm: the head's
    copy of a tied embedding, whose gradient equals the embedding's (`pipeline.TiedEmbeddings`).
    """
    skip = {id(p) for p in counted_elsewhere}
    groups: dict[Any, list[torch.Tensor]] = {}
    for param in params:
        if param.grad is not None:
            grad = param.grad
            key = (grad.device_mesh, grad.placements) if isinstance(grad, DTensor) else None
            groups.setdefault(key, []).append(param)
    squares = []
    for group in groups.values():
        counted = [p.grad for p in group if id(p) not in skip]
        if counted:
            squares.append(_squared_norm(counted))
    total = torch.stack(squares).sum() if squares else torch.zeros(())
    if pp_mesh is not None:
        dist.all_reduce(total, group=pp_mesh.get_group())
    total = total.sqrt()
    for group in groups.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


def _squared_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The sum of squares of every element of gradients of one group (plain tensors, or DTensors of one
    mesh and placement): of the local shards, then summed over the mesh dimensions they are split on."""
    if not isinstance(grads[0], DTensor) or any(p.is_partial() for p in grads[0].placements):
        # plain tensors, or sums not yet reduced (sequence parallelism's norm weights): torch's own
        norm = torch.nn.utils.get_total_norm(grads)
        return (norm.full_tensor() if isinstance(norm, DTensor) else norm).float() ** 2
    # Per tensor, as DTensor's own norm does it: the squares of each local shard's norm, summed over
    # the shards; then over the tensors.
    local = torch.stack([torch.linalg.vector_norm(g.to_local()).float() ** 2 for g in grads])
    mesh = grads[0].device_mesh
    for dim, placement in enumerate(grads[0].placements):
        if not placement.is_replicate():  # Shard, or FSDP's _StridedShard of a tensor-parallel dim
            dist.all_reduce(local, group=mesh.get_group(dim))
    return local.sum()


def global_loss(job: Job, loss: torch.Tensor) -> float:
    """The step's loss averaged over the data-parallel replicas (each counted once)."""
    value = (loss.float() * job.loss_weight).reshape(1)
    dist.all_reduce(value)
    return value.item()


def peak_memory(device: torch.device) -> tuple[int, int | None]:
    """(peak, reserved), each the largest over all ranks, in one all-reduce: the peak is allocated CUDA memory, or on
    CPU the process's peak resident set; reserved, on CUDA, what torch's caching allocator reserved at its peak (what
    torchtitan reports as a run's memory: the tensors and what the allocator holds beside them), None on CPU."""
    if device.type == "cuda":
        peaks = [torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)]
    else:
        peaks = [resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024]  # Linux reports KiB
    value = torch.tensor(peaks, dtype=torch.float64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    allocated, *reserved = (int(v) for v in value.tolist())
    return allocated, reserved[0] if reserved else None


# ---- the run --------------------------------------------------------------------------
def run(plan: ir.Plan, config: RunConfig) -> tuple[int, Job]:
    """Train on this rank; (exit status, the job). The process group stays up: see `plandsl.run.entry`."""
    device = init_distributed(config.timeout_s, config.device)
    torch.manual_seed(plan.train.seed)
    job = build_job(plan, build_mesh(plan, device), device, config)
    train(job, config)
    return (check_equivalence(job, config) if config.check_equivalence else 0), job


def train(job: Job, config: RunConfig) -> None:
    """Steps `job.first_step + 1 .. config.steps` (after restoring the latest checkpoint with `resume`)."""
    rank0 = dist.get_rank() == 0
    note = ""
    if config.resume:
        restored = checkpoint.restore(job, config.checkpoint_dir, config.steps)
        job.first_step, note = restored.step, restored.note
    reporter = Reporter(config.steps, job.first_step, config.metrics, config.quiet) if rank0 else None
    tokens = job.plan.train.global_batch * job.plan.seq
    try:
        if reporter and note:
            reporter.note(note)
        for step in range(job.first_step, config.steps):
            faults.at_step(job, step + 1)  # where this rank is, should it fail (runtime.faults)
            start = time.perf_counter()
            loss = train_step(job, step)
            elapsed = time.perf_counter() - start
            job.losses.append(loss)
            record = {"step": step + 1, "loss": loss, "step_time_s": elapsed,
                      "tokens_per_s": tokens / elapsed}
            record["peak_memory_bytes"], reserved = peak_memory(job.device)
            if reserved is not None:
                record["peak_reserved_bytes"] = reserved
            if job.scaler.enabled:  # after the step: halved when it was skipped
                record["loss_scale"] = job.scaler.scale
            if reporter:
                reporter.step(record)
            if config.checkpoint_dir and checkpoint.is_due(step + 1, config.checkpoint_every, config.steps):
                path = checkpoint.save(job, config.checkpoint_dir, step + 1, config.steps)
                if reporter:
                    reporter.note(f"checkpoint: step {step + 1} -> {path}")
    finally:
        if reporter:
            reporter.close()


def check_equivalence(job: Job, config: RunConfig) -> int:
    """Rank 0 compares with the reference run in-process; every rank returns the verdict (0 or 1)."""
    params, buffers = gather_params(job.models), gather_buffers(job.models)
    verdict = [0]
    if dist.get_rank() == 0:
        reference = run_reference(job.plan, config.steps, config.token_file, job.device)
        reference.losses = reference.losses[job.first_step:]  # a resumed run trained only the steps after
        report = compare(RunResult(job.losses, params, buffers), reference, tolerance(job.plan, job.device),
                         buffers=buffers_comparable(job.plan))
        report.loss_step += job.first_step
        print(report, flush=True)
        verdict = [0 if report.ok else 1]
        job.report = report
    dist.broadcast_object_list(verdict, src=0)
    return verdict[0]


def main_error(error: BaseException) -> None:
    """How a rank reports a failure before exiting non-zero (torchrun then stops the others)."""
    rank = dist.get_rank() if dist.is_initialized() else os.environ.get("RANK", "?")
    where = report_error(error)  # rank R's JSON for the launcher's message; where it was
    print(f"plandsl run: rank {rank}: {where}: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
