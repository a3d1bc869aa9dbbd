"""The plan's optimizer and learning-rate schedule, shared by the reference and the distributed run.

Stage: interpreter. Contract: `build_optimizer(plan, params)` and `build_lr_scheduler(plan, optimizer,
steps)` depend on the plan only, so every layout and the single-process reference step alike.
"""
from __future__ import annotations

import math

import torch

from plandsl import ir

ADAM_BETAS = (0.9, 0.95)  # GPT-3 (Brown et al. 2020, Appendix B) and Llama
ADAM_EPS = 1e-8
WEIGHT_DECAY = 0.0  # the plan has no weight-decay key yet: `adam` is Adam (AdamW with no decay)
SGD_MOMENTUM = 0.9


def optimizer_settings(plan: ir.Plan) -> tuple[type[torch.optim.Optimizer], dict]:
    """The optimizer class and its keyword arguments (ZeroRedundancyOptimizer takes them apart)."""
    train = plan.train
    if train.optimizer is ir.Optimizer.sgd:
        return torch.optim.SGD, dict(lr=train.lr, momentum=SGD_MOMENTUM)
    return torch.optim.AdamW, dict(lr=train.lr, betas=ADAM_BETAS, eps=ADAM_EPS, weight_decay=WEIGHT_DECAY)


def build_optimizer(plan: ir.Plan, params) -> torch.optim.Optimizer:
    cls, kwargs = optimizer_settings(plan)
    return cls(params, **kwargs)


def lr_factor(plan: ir.Plan, step: int, steps: int) -> float:
    """Multiplier of `lr` at optimizer step `step` (0-based) of `steps`: linear warm-up, then the decay.

    Warm-up ramps (step + 1) / (warmup + 1) as torchtitan does; `linear` and `cosine` then decay to 0
    at step `steps` (Loshchilov & Hutter 2017 for cosine); `constant` stays at 1.
    """
    warmup, schedule = plan.train.warmup_steps, plan.train.lr_schedule
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if schedule == "constant":
        return 1.0
    progress = (step - warmup) / max(1, steps - warmup)
    if schedule == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def build_lr_scheduler(plan: ir.Plan, optimizer: torch.optim.Optimizer, steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(plan, step, steps))
