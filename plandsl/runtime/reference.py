"""The single-process reference every distributed run is compared with.

Stage: interpreter. Contract: `run_reference(plan, steps)` trains the full model on one device with the
plan's seed, data, optimizer, LR schedule, clipping, microbatches (their losses averaged, so a step
equals one step on the whole global batch) and fp16 loss scaling (the same `LossScaler`, in this process
only); it returns the loss of every step, the final parameters and the persistent buffers (BatchNorm's running statistics).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from plandsl import ir
from plandsl.runtime.buffers import owned_buffers
from plandsl.runtime.data import Batches, microbatches
from plandsl.runtime.models import build_model, loss_fn
from plandsl.runtime.optim import build_lr_scheduler, build_optimizer
from plandsl.runtime.precision import autocast, keep_weights, loss_scaler


@dataclass
class RunResult:
    """Per-step losses (step 1 first), the final parameters and persistent buffers by name, as full CPU tensors."""

    losses: list[float] = field(default_factory=list)
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)


def persistent_buffers(module: nn.Module):
    """(name, buffer) of each buffer of `module` that its state dict holds (BatchNorm's running statistics; not a
    rotary table built from the config), each once, by the name its module path gives."""
    seen = set()
    for entry in owned_buffers(module):
        if entry.persistent and id(entry.buffer) not in seen:
            seen.add(id(entry.buffer))
            yield entry.fqn, entry.buffer


def run_reference(plan: ir.Plan, steps: int, token_file: str | Path | None = None,
                  device: torch.device | str = "cpu") -> RunResult:
    device = torch.device(device)
    model = keep_weights(plan, build_model(plan.model, plan.train.seed)).to(device)
    batches = Batches(plan, token_file, model)
    optimizer = build_optimizer(plan, model.parameters())
    scheduler = build_lr_scheduler(plan, optimizer, steps)
    compute_loss = getattr(model, "loss", loss_fn)
    scaler = loss_scaler(plan, device, distributed=False)
    result = RunResult()
    for step in range(steps):
        chunks = microbatches(*batches.global_batch(step), plan.train.micro_batch)
        step_loss = 0.0
        for inputs, targets in chunks:
            with autocast(plan, device.type):
                if getattr(model, "mtp", None) is not None:  # multi-token prediction: the model computes its loss
                    loss = model(inputs.to(device), targets.to(device)) / len(chunks)
                else:
                    loss = compute_loss(model(inputs.to(device)), targets.to(device)) / len(chunks)
            scaler.scale_loss(loss).backward()
            step_loss += loss.item()
        found_inf = scaler.unscale_(model.parameters())
        scaler.update(found_inf)
        if not found_inf:  # fp16: a step with an inf or nan gradient is skipped, as in the distributed run
            if plan.train.grad_clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), plan.train.grad_clip)
            optimizer.step()
            scheduler.step()
        optimizer.zero_grad()
        result.losses.append(step_loss)
    result.params = {name: param.detach().to("cpu", copy=True) for name, param in model.named_parameters()}
    result.buffers = {name: buffer.detach().to("cpu", copy=True) for name, buffer in persistent_buffers(model)}
    return result
