"""`--check-equivalence`: a distributed run's losses, final parameters and buffers (BatchNorm's running statistics)
against the one-process reference.

Stage: interpreter. Contract: `gather_params(parts)` and `gather_buffers(parts)` are collective (every rank calls
them) and return the full parameters (the persistent buffers) on rank 0; `compare(run, reference)` measures relative
differences (see `Report`); `tolerance(plan, device)` is the documented bound (docs/running.md);
`buffers_comparable(plan)` whether the run's buffers can equal the reference's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from plandsl import ir
from plandsl.runtime.models import clean_name
from plandsl.runtime.reference import RunResult, persistent_buffers

# Relative bounds by precision; fp32 on CPU is the 1e-5. CUDA kernels and bf16 rounding
# differ more between layouts (reduction orders change), hence the looser figures.
TOLERANCE = {("cpu", "fp32"): 1e-5, ("cuda", "fp32"): 1e-4}
LOW_PRECISION_TOLERANCE = 2e-2


def tolerance(plan: ir.Plan, device: torch.device) -> float:
    """The bound for the plan's precision; the 16-bit one also where the run reduces its gradients in 16 bits
    (`grad_dtype` under a `gather` the run applies: FSDP2's `reduce_dtype`, `data_parallel.mixed_precision`),
    which the fp32 reference cannot: each step's update then differs by the gradients' bf16 rounding."""
    if plan.run_gather is not None and plan.train.grad_dtype is not ir.Precision.fp32:
        return LOW_PRECISION_TOLERANCE
    return TOLERANCE.get((device.type, plan.train.precision.value), LOW_PRECISION_TOLERANCE)


def buffers_comparable(plan: ir.Plan) -> bool:
    """Whether every rank's buffers see the reference's batches: no axis of more than one rank splits the batch or
    the sequence (`reduce_axes`). Each data-parallel replica's BatchNorm keeps the statistics of its own share of the
    batch (torch's DDP broadcasts rank 0's; plandsl converts no BatchNorm to SyncBatchNorm), which no one process
    computes."""
    return plan.dp == 1 and plan.cp == 1  # an axis of one rank splits nothing


def gather_params(parts: list[nn.Module]) -> dict[str, torch.Tensor] | None:
    """Every parameter in full on rank 0 (None elsewhere); DTensors (TP, FSDP) are gathered first."""
    return _gather(parts, lambda part: part.named_parameters())


def gather_buffers(parts: list[nn.Module]) -> dict[str, torch.Tensor] | None:
    """Every persistent buffer on rank 0 (None elsewhere), a pipeline's stages' merged."""
    return _gather(parts, persistent_buffers)


def _gather(parts: list[nn.Module], named) -> dict[str, torch.Tensor] | None:
    local = {}
    for part in parts:
        part = part.module if isinstance(part, DistributedDataParallel) else part
        for name, tensor in named(part):
            full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            local.setdefault(clean_name(name), full.detach().to("cpu", copy=True))
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(local, gathered, dst=0)
    if gathered is None:
        return None
    merged: dict[str, torch.Tensor] = {}
    for tensors in gathered:  # a pipeline's stages hold different parameters; merge them
        for name, tensor in tensors.items():
            merged.setdefault(name, tensor)
    return merged


@dataclass
class Report:
    """Largest relative differences. Losses: |a - b| / |b| per step. Parameters: ||a - b|| / ||b|| over
    all of them as one vector (`param_diff`, the verdict), and per tensor (`tensor_diff`, the worst one,
    shown to say where). Per tensor is not the verdict: Adam divides each gradient element by its own
    magnitude, so an element whose gradient is near Adam's eps (1e-8) turns a layout's reordered sums
    into a step up to lr that differs, and one such element of a small tensor moves that tensor's ratio
    past the bound while the model computes the same thing (docs/running.md has the figures). Buffers: the largest
    relative difference of one (`buffer_diff`, BatchNorm's running statistics: updated once per forward of each
    microbatch, never by a gradient), part of the verdict where `buffers_comparable` (else NaN: not compared, said only of a model that has some)."""

    loss_diff: float
    loss_step: int
    param_diff: float
    tensor_diff: float
    tensor_name: str
    missing: tuple[str, ...]
    tolerance: float
    buffer_diff: float = 0.0
    buffer_name: str = "-"

    @property
    def ok(self) -> bool:
        buffers = 0.0 if math.isnan(self.buffer_diff) else self.buffer_diff
        return not self.missing and max(self.loss_diff, self.param_diff, buffers) <= self.tolerance

    def __str__(self) -> str:
        verdict = "ok" if self.ok else "FAILED"
        lines = [f"equivalence with one process: {verdict} (tolerance {self.tolerance:.0e} relative)",
                 f"  losses:     max relative difference {self.loss_diff:.3e} (step {self.loss_step})",
                 f"  parameters: relative difference {self.param_diff:.3e} (all together); "
                 f"largest in one tensor {self.tensor_diff:.3e} ({self.tensor_name})"]
        if math.isnan(self.buffer_diff):
            lines.append("  buffers:    not compared (each rank's running statistics are those of its own share of the "
                         "batch or sequence: data or context parallelism)")
        elif self.buffer_name != "-":
            lines.append(f"  buffers:    largest relative difference {self.buffer_diff:.3e} ({self.buffer_name})")
        if self.ok and self.tensor_diff > self.tolerance:
            lines.append(f"  note: {self.tensor_name} alone is past the tolerance; Adam turns reordered sums into "
                         "different steps where a gradient is near its eps (docs/running.md)")
        if self.missing:
            lines.append(f"  missing or misshapen parameters or buffers: {', '.join(self.missing)}")
        return "\n".join(lines)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(torch.finfo(torch.float32).tiny))


def compare(run: RunResult, reference: RunResult, limit: float, buffers: bool = True) -> Report:
    """`buffers`: compare the persistent buffers too (`buffers_comparable`)."""
    loss_diffs = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(run.losses, reference.losses)]
    loss_step = max(range(len(loss_diffs)), key=loss_diffs.__getitem__, default=0)
    missing = tuple(name for name, ref in reference.params.items()
                    if name not in run.params or run.params[name].shape != ref.shape)
    common = [name for name in reference.params if name not in missing]
    tensor_diffs = {name: _relative(run.params[name], reference.params[name]) for name in common}
    tensor_name = max(tensor_diffs, key=tensor_diffs.__getitem__, default="-")
    differences = sum(float((run.params[n].double() - reference.params[n].double()).norm() ** 2) for n in common)
    norms = sum(float(reference.params[n].double().norm() ** 2) for n in common)
    total = math.sqrt(differences / max(norms, torch.finfo(torch.float32).tiny ** 2)) if common else 0.0
    if len(run.losses) != len(reference.losses):
        missing += (f"losses ({len(run.losses)} steps, reference {len(reference.losses)})",)
    buffer_diff, buffer_name = (math.nan if reference.buffers else 0.0), "-"  # a model with none: nothing to say
    if buffers:
        missing += tuple(name for name, ref in reference.buffers.items()
                         if name not in run.buffers or run.buffers[name].shape != ref.shape)
        buffer_diffs = {name: _relative(run.buffers[name], ref) for name, ref in reference.buffers.items()
                        if name in run.buffers and run.buffers[name].shape == ref.shape}
        buffer_name = max(buffer_diffs, key=buffer_diffs.__getitem__, default="-")
        buffer_diff = buffer_diffs.get(buffer_name, 0.0)
    return Report(max(loss_diffs, default=0.0), loss_step + 1, total, tensor_diffs.get(tensor_name, 0.0),
                  tensor_name, missing, limit, buffer_diff, buffer_name)
