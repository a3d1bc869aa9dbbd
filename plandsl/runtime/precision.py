"""The plan's precision: an autocast context, the residual stream in the compute dtype, and dynamic loss scaling for fp16.

Stage: interpreter. Contract: `autocast(plan, device_type)` is a no-op for fp32 and autocasts matmuls to
bf16 or fp16; parameters are the master weights, fp32 unless the plan's `master_dtype` says otherwise,
or kept in `param_dtype` beside an optimizer-held master copy (`keep_weights`), and gradients take their dtype
(a narrower `grad_dtype` is the cost model's only). Under autocast the embeddings' outputs are cast to its
dtype (`keep_weights`, `keep_stream`), so the residual stream, every block's input and every pipeline boundary
are 16-bit, as with 16-bit weights (Megatron-LM, torchtitan). `loss_scaler(plan, ...)` is a `LossScaler`,
enabled for fp16 only, that every rank (and the one-process reference) steps alike.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from plandsl import ir

# torch.amp.GradScaler's defaults (its documentation; Micikevicius et al. 2018, section 3.2).
INIT_SCALE = 2.0 ** 16
GROWTH_FACTOR = 2.0
BACKOFF_FACTOR = 0.5
GROWTH_INTERVAL = 2000

DTYPES = {ir.Precision.fp32: torch.float32, ir.Precision.bf16: torch.bfloat16, ir.Precision.fp16: torch.float16}


def keep_weights(plan: ir.Plan, model: torch.nn.Module) -> torch.nn.Module:
    """`model` with its parameters in the plan's `param_dtype`, else `master_dtype` (fp32 by default: left as
    built; buffers keep their dtype), and its residual stream in the compute dtype (`keep_stream`). Applied to
    the full model before any parallelism, in the reference and every rank alike."""
    dtype = DTYPES[plan.train.weights_dtype]
    if dtype is not torch.float32:  # the parameters only: buffers (a torch model's rotary inv_freq) keep theirs
        for param in model.parameters():
            param.data = param.data.to(dtype)
    return keep_stream(plan, model)


def keep_stream(plan: ir.Plan, model: torch.nn.Module) -> torch.nn.Module:
    """`model` whose embeddings (every `nn.Embedding`: tokens, gpt's learned positions, a torch model's own) return
    autocast's dtype while autocast runs, at a 16-bit precision over wider weights. autocast computes matmuls in 16
    bits but leaves an embedding's lookup in its weight's dtype, so with fp32 weights the stream they start, and
    every residual addition after it, would stay fp32: each block's input, the inputs recomputation saves and every
    pipeline boundary twice what Megatron-LM (16-bit parameters, no `--fp32-residual-connection`) and torchtitan
    (bf16 FSDP weights) hold, and what the memory model counts. The cast is what a 16-bit copy of the weight would
    look up; the blocks' additions then stay 16-bit (the models' norms return their input's dtype). fp32: unchanged."""
    if plan.train.precision not in (ir.Precision.bf16, ir.Precision.fp16):
        return model
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding) and module.weight.dtype != DTYPES[plan.train.precision]:
            module.register_forward_hook(_to_autocast_dtype)
    return model


def copy_stream_casts(source: torch.nn.Module, target: torch.nn.Module) -> None:
    """The casts `keep_stream` put on `source`'s embeddings, put on `target`'s submodules of the same names: a stage
    module torch's pipeline frontend traced from `source` (outside autocast, so the trace dropped them)."""
    for name, module in source.named_modules():
        if name and _to_autocast_dtype in module._forward_hooks.values():
            try:
                found = target.get_submodule(name)
            except AttributeError:  # not on this stage
                continue
            found.register_forward_hook(_to_autocast_dtype)


def _to_autocast_dtype(module: torch.nn.Module, args: tuple, output):
    """A forward hook: a floating-point output in autocast's dtype while autocast runs on its device."""
    if isinstance(output, torch.Tensor) and output.is_floating_point() and output.device.type != "meta" \
            and torch.is_autocast_enabled(output.device.type):
        return output.to(torch.get_autocast_dtype(output.device.type))
    return None


def autocast(plan: ir.Plan, device_type: str):
    if plan.train.precision is ir.Precision.fp32:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=DTYPES[plan.train.precision])


class LossScaler:
    """Dynamic loss scaling (Micikevicius et al. 2018), the scheme of torch's GradScaler, over a group.

    The backward sees the loss times `scale`, so small fp16 gradients do not flush to zero.
    `unscale_` divides the gradients by `scale` before clipping and reports whether any of them, on
    any rank of `group` (all-reduced: tensor, data and pipeline ranks hold different gradients), is
    inf or nan; the caller then skips the optimizer step on every rank. `update` halves the scale
    after such a step and doubles it after `growth_interval` good steps in a row. torch's own
    scalers are not used: GradScaler decides per process, and ShardedGradScaler unscales each
    optimizer's gradients as one list, which DTensor refuses when it mixes DTensors and plain tensors
    (tensor parallelism leaves some modules plain: gpt's positions, replicated shard rules); here
    every gradient is unscaled through its local shard, with the same kernel.
    Disabled (fp32, bf16), it scales nothing, finds nothing and never communicates.
    """

    def __init__(self, enabled: bool = True, *, distributed: bool = True, group: dist.ProcessGroup | None = None,
                 device: torch.device | str = "cpu", init_scale: float = INIT_SCALE,
                 growth_factor: float = GROWTH_FACTOR, backoff_factor: float = BACKOFF_FACTOR,
                 growth_interval: int = GROWTH_INTERVAL):
        self.enabled = enabled
        self.distributed = distributed
        self.group = group
        self.device = torch.device(device)
        self.scale = float(init_scale) if enabled else 1.0
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.good_steps = 0
        """Steps without an inf or nan gradient since the scale last changed."""

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale if self.enabled else loss

    def scaled(self, loss_fn: Callable) -> Callable:
        """`loss_fn` whose result the backward sees scaled (a pipeline schedule's loss function)."""
        if not self.enabled:
            return loss_fn
        return lambda outputs, targets: self.scale_loss(loss_fn(outputs, targets))

    @torch.no_grad()
    def unscale_(self, params: Iterable[torch.Tensor]) -> bool:
        """Divide every gradient by the scale; True when a gradient of any rank is inf or nan (collective)."""
        if not self.enabled:
            return False
        found = torch.zeros(1, dtype=torch.float32, device=self.device)
        inverse = torch.full((1,), 1.0 / self.scale, dtype=torch.float32, device=self.device)
        by_kind: dict[tuple, list[torch.Tensor]] = {}
        for param in params:
            if param.grad is not None:
                grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
                by_kind.setdefault((grad.device, grad.dtype), []).append(grad)
        for grads in by_kind.values():  # torch's GradScaler kernel: unscale in place, flag inf/nan
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inverse)
        if self.distributed and dist.is_initialized():
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self.group)
        return bool(found.item())

    def update(self, found_inf: bool) -> None:
        if not self.enabled:
            return
        if found_inf:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])


def loss_scaler(plan: ir.Plan, device: torch.device | str = "cpu", distributed: bool = True) -> LossScaler:
    """The plan's scaler: enabled for fp16; `distributed` reduces the inf/nan flag over the world."""
    return LossScaler(plan.train.precision is ir.Precision.fp16, distributed=distributed, device=device)
