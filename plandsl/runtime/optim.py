"""The plan's optimizer and learning-rate schedule, shared by the reference and the distributed run.

Stage: interpreter. Contract: `build_optimizer(plan, params)` and `build_lr_scheduler(plan, optimizer,
steps)` depend on the plan only, so every layout and the single-process reference step alike. A
`master_dtype` or `optimizer_dtype` other than fp32 keeps the weights and states in those dtypes between
steps and updates in fp32 (`AdamWStates`, `SGDStates`), as Transformer Engine's FusedAdam does with
Megatron's `--exp-avg-dtype` (16-bit arithmetic would lose Adam's eps: 1e-8 is 0 in fp16). fp16 states
need a per-tensor scale, which these do not keep: `plandsl run` refuses them (E706). A `param_dtype`
narrower than `master_dtype` keeps the weights in it and the master copy as one more state ("master", in
`master_dtype`): each step updates the master and copies it into the weight, as Megatron-LM's
Float16OptimizerWithFloat16Params and DeepSpeed's bf16 optimizer do (Micikevicius et al. 2018, Sec. 3.1);
ZeRO shards it with the other states.
"""
from __future__ import annotations

import math

import torch
from torch.optim.adam import adam
from torch.optim.sgd import sgd

from plandsl import ir
from plandsl.runtime.precision import DTYPES

ADAM_BETAS = (0.9, 0.95)  # GPT-3 (Brown et al. 2020, Appendix B) and Llama
ADAM_EPS = 1e-8
WEIGHT_DECAY = 0.0  # the plan has no weight-decay key yet: `adam` is Adam (AdamW with no decay)
SGD_MOMENTUM = 0.9


def optimizer_settings(plan: ir.Plan) -> tuple[type[torch.optim.Optimizer], dict]:
    """The optimizer class and its keyword arguments (ZeroRedundancyOptimizer takes them apart)."""
    train = plan.train
    wide = (train.master_dtype, train.optimizer_dtype) == (ir.Precision.fp32, ir.Precision.fp32) \
        and not train.master_copy
    states = {} if wide else {"state_dtype": DTYPES[train.optimizer_dtype]}
    if train.master_copy:
        states["master_dtype"] = DTYPES[train.master_dtype]
    if train.optimizer is ir.Optimizer.sgd:
        return (SGDStates if states else torch.optim.SGD), dict(lr=train.lr, momentum=SGD_MOMENTUM, **states)
    return (AdamWStates if states else torch.optim.AdamW), dict(lr=train.lr, betas=ADAM_BETAS, eps=ADAM_EPS,
                                                              weight_decay=WEIGHT_DECAY, **states)


def _wide(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` in fp32: itself when it is fp32 (updated in place), else an fp32 copy to write back."""
    return tensor.float()


def _kept(state: dict, key: str, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`state[key]` in `dtype`, created as zeros like `like` (a DTensor stays one) or re-cast after a
    `load_state_dict`, which casts floating states to the parameter's dtype."""
    value = state.get(key)
    if value is None:
        value = state[key] = torch.zeros_like(like, dtype=dtype, memory_format=torch.preserve_format)
    elif value.dtype != dtype:
        value = state[key] = value.to(dtype)
    return value


class _StatesIn:
    """An optimizer whose states are kept in `state_dtype` between steps while each update runs in fp32
    through torch's own functional step on fp32 views (`_update`, per parameter), as Transformer Engine's
    FusedAdam does with Megatron's --exp-avg-dtype; weights and states are written back in their dtypes."""

    def __init__(self, params, *, state_dtype: torch.dtype, master_dtype: torch.dtype | None = None, **kwargs):
        super().__init__(params, **kwargs)
        self.state_dtype = state_dtype
        self.master_dtype = master_dtype  # None: the weights are the master copy
        # torch's load_state_dict casts every floating state to its parameter's dtype: the hooks keep the
        # states' own dtype through a checkpoint's resume (fp32 states of bf16 weights are not rounded, bf16
        # states of fp32 weights not widened)
        self.register_load_state_dict_pre_hook(_StatesIn._stash)
        self.register_load_state_dict_post_hook(_StatesIn._restore)

    @staticmethod
    def _stash(optimizer, state_dict):
        # the saved groups name their parameters (indices, or the FQNs DCP's set_state_dict writes) in the
        # order of the optimizer's own groups, as torch's load_state_dict pairs them
        keys = [key for group in state_dict["param_groups"] for key in group["params"]]
        optimizer._loading = (keys, {key: dict(state) for key, state in state_dict["state"].items()})
        return None

    @staticmethod
    def _restore(optimizer) -> None:
        keys, loading = optimizer.__dict__.pop("_loading", ((), {}))
        params = dict(zip(keys, (param for group in optimizer.param_groups for param in group["params"])))
        for key, values in loading.items():
            state = optimizer.state[params[key]]
            for name, value in values.items():
                if name != "step" and torch.is_tensor(value) and value.is_floating_point():
                    dtype = optimizer.master_dtype if name == "master" else optimizer.state_dtype
                    restored = value.to(dtype=dtype)  # a DTensor stays on its mesh
                    if restored.device != state[name].device:
                        restored = restored.to(state[name].device)
                    state[name] = restored

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    state = self.state[param]
                    if self.master_dtype is not None:  # the master copy, made from the weight at the first step
                        if "master" not in state:
                            state["master"] = param.detach().to(self.master_dtype, copy=True)
                        master = state["master"]
                        weight = _wide(master)
                        self._update(group, state, param, weight, _wide(param.grad))
                        if weight is not master:
                            master.copy_(weight)
                        param.copy_(master)
                        continue
                    weight = _wide(param)
                    self._update(group, state, param, weight, _wide(param.grad))
                    if weight is not param:
                        param.copy_(weight)
        return loss

    @staticmethod
    def _write_back(kept: list[torch.Tensor], wide: list[torch.Tensor]) -> None:
        for target, value in zip(kept, wide):
            if value is not target:
                target.copy_(value)


class AdamWStates(_StatesIn, torch.optim.AdamW):
    """AdamW with m and v kept in `state_dtype` (16-bit optimizer states), updated by torch's `adam` in fp32."""

    def _update(self, group: dict, state: dict, param, weight, grad) -> None:
        if "step" not in state:
            state["step"] = torch.tensor(0.0)
        kept = [_kept(state, key, param, self.state_dtype) for key in ("exp_avg", "exp_avg_sq")]
        wide = [_wide(t) for t in kept]
        beta1, beta2 = group["betas"]
        adam([weight], [grad], wide[:1], wide[1:], [], [state["step"]], foreach=False, decoupled_weight_decay=True,
             amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
             eps=group["eps"], maximize=False)
        self._write_back(kept, wide)


class SGDStates(_StatesIn, torch.optim.SGD):
    """SGD with momentum whose buffer is kept in `state_dtype`, updated by torch's `sgd` in fp32."""

    def _update(self, group: dict, state: dict, param, weight, grad) -> None:
        fresh = "momentum_buffer" not in state
        kept = _kept(state, "momentum_buffer", param, self.state_dtype)
        buffers = [None if fresh else _wide(kept)]  # None: torch starts it as a copy of the gradient
        sgd([weight], [grad], buffers, foreach=False, weight_decay=group["weight_decay"],
            momentum=group["momentum"], lr=group["lr"], dampening=group["dampening"],
            nesterov=group["nesterov"], maximize=False)
        self._write_back([kept], buffers)


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
