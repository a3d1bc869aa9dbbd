"""The plan's precision as an autocast context: parameters and optimizer states stay fp32 (master weights).

Stage: interpreter. Contract: `autocast(plan, device_type)` is a no-op for fp32 and autocasts matmuls to
bf16 otherwise; fp16 (which needs dynamic loss scaling) is refused before a run starts (`runtime.support`).
"""
from __future__ import annotations

import contextlib

import torch

from plandsl import ir


def autocast(plan: ir.Plan, device_type: str):
    if plan.train.precision is ir.Precision.fp32:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=torch.bfloat16)
