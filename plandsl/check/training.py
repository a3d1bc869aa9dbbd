"""Training against the layout: batch divisibility (E501), microbatches for the schedule
(E502), precision against the devices (E504)."""
from __future__ import annotations

from typing import Iterator

from plandsl import ir
from plandsl.diagnostics import Diagnostic, diag
from plandsl.schedules.registry import BUILTIN, min_microbatches


def check_training(plan: ir.Plan) -> Iterator[Diagnostic]:
    train = plan.train
    dp = plan.dp
    axes = " * ".join(f"{a}({plan.mesh.degree(a)})" for a in plan.batch_axes()) or "dp(1)"
    per_step = dp * train.micro_batch
    if train.global_batch % per_step:
        lower = train.global_batch // per_step * per_step
        options = [b for b in (lower, lower + per_step) if b > 0]
        yield diag("E501", f"global batch {train.global_batch} is not divisible by {axes} * micro_batch("
                   f"{train.micro_batch}) = {per_step}", train.span_of("global_batch"),
                   hint=f"global_batch in {{{', '.join(map(str, options))}}} works with this layout")
    if plan.stages and plan.schedule and plan.schedule.name in BUILTIN and not train.global_batch % per_step:
        info = BUILTIN[plan.schedule.name]
        pp = plan.pp
        m = train.global_batch // per_step
        need = min_microbatches(info, pp)
        if m < need:
            yield diag("E502", f"schedule '{info.name}' needs at least {need} microbatches with {pp} pipeline "
                       f"ranks, but global_batch({train.global_batch}) / ({axes} * micro_batch({train.micro_batch}))"
                       f" = {m}", plan.schedule.span,
                       hint=f"raise global_batch to {need * per_step} or lower micro_batch")
        elif info.multiple_of_ranks and m % pp:
            yield diag("E502", f"schedule '{info.name}' needs a multiple of the {pp} pipeline ranks as microbatch "
                       f"count, found {m}", plan.schedule.span,
                       hint=f"global_batch = {(m // pp + 1) * pp * per_step} gives {(m // pp + 1) * pp} microbatches")
    start = plan.mesh.first_device
    used = {d.name: d for d in plan.cluster.devices_in_order()[start:start + plan.mesh.size]}
    for device in used.values():
        if train.precision not in device.peak:
            yield diag("E504", f"device '{device.name}' gives no peak for {train.precision.value}",
                       train.span_of("precision"),
                       hint=f"its peaks: {', '.join(p.value for p in device.peak)}; add "
                       f"`{train.precision.value}: ... TFLOP/s` to its peak, or change precision")
            break
