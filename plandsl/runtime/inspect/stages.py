"""A Hugging Face model's pipeline stage by its own convention (transformers' `base_model_pp_plan`), and whether
that convention computes what the whole model computes.

Stage: interpreter side (torch; transformers' modules). Contract: `replace_outside(module, block_list, keep,
replace)` swaps what a stage holding the layers `keep` (`embed`, block FQNs, `head`) does not hold for stand-ins
(`runtime.torch_model.TorchModel` builds its stages with it); `stage_convention_problem(model, block_list)` is
None when a stage holding no layer returns its input unchanged, else why not (`plandsl inspect` records it, and
`plandsl run` then refuses pipeline stages of the model, E704).
"""
from __future__ import annotations

import copy
from typing import Callable

import torch
from torch import nn


class PassThrough(nn.Module):
    """Stands for a module this pipeline stage does not hold: returns its first input unchanged."""

    def forward(self, *args, **kwargs):
        return args[0] if args else next(iter(kwargs.values()))


class Zero(nn.Module):
    """Stands for an additive module before the blocks (a position embedding read from position ids) on a later
    stage: what it adds was added on the first stage."""

    def forward(self, *args, **kwargs):
        return torch.zeros(())


class Absent(nn.Module):
    """Stands for the token embedding on a later stage, which feeds `inputs_embeds` instead."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("a later pipeline stage called the token embedding it does not hold")


STREAM = ("hidden_states", "inputs_embeds")
"""The names transformers' pipeline plans give the residual stream: a module before the blocks that reads it
(GPT-NeoX's `emb_dropout`, GPT-J's `drop`, Phi's `embed_dropout`) passes it on, on a later stage."""


def pp_plan(module: nn.Module) -> dict | None:
    """transformers' `base_model_pp_plan` of the model (module -> (inputs, outputs)), None without one."""
    config = getattr(module, "config", None)
    return getattr(config, "base_model_pp_plan", None) or None


def before_blocks(plan: dict, block_list: str, base: str) -> list[tuple[str, tuple[list, list]]]:
    names = list(plan)
    cut = names.index(block_list.removeprefix(f"{base}.")) if block_list.removeprefix(f"{base}.") in names else 0
    return [(f"{base}.{name}", plan[name]) for name in names[:cut]]


def after_blocks(plan: dict, block_list: str, base: str, cls: type) -> list[str]:
    names = list(plan)
    key = block_list.removeprefix(f"{base}.")
    after = [f"{base}.{name}" for name in names[names.index(key) + 1:]] if key in names else []
    return after + list(getattr(cls, "_pp_plan", None) or {})


def replace_outside(module: nn.Module, block_list: str, keep: set[str],
                    replace: Callable[[str, nn.Module], None]) -> None:
    """Call `replace(fqn, stand_in)` for each module of `module` (a Hugging Face model with a pipeline plan) that a
    stage holding the layers `keep` does not hold: the blocks outside it and, without `embed`, the modules before the
    block list (the token embedding by `Absent`, a module reading the stream by `PassThrough`, another by `Zero`),
    without `head` those after it (the final norm, the head) by `PassThrough`."""
    plan = pp_plan(module)
    base = module.base_model_prefix
    blocks = module.get_submodule(block_list)
    for index in range(len(blocks)):
        if f"{block_list}.{index}" not in keep:
            replace(f"{block_list}.{index}", PassThrough())
    if "embed" not in keep:
        for name, (inputs, _) in before_blocks(plan, block_list, base):
            replace(name, Absent() if "input_ids" in inputs else
                    PassThrough() if any(stream in inputs for stream in STREAM) else Zero())
    if "head" not in keep:
        for name in after_blocks(plan, block_list, base, type(module)):
            replace(name, PassThrough())


def _set(root: nn.Module, fqn: str, module: nn.Module) -> None:
    parent, _, child = fqn.rpartition(".")
    setattr(root.get_submodule(parent), child, module)


def stage_convention_problem(model: nn.Module, block_list: str) -> str | None:
    """Why the model's pipeline stages by its convention would compute something else than the whole model, or None:
    a stage holding no layer (every module of the plan a stand-in) must return what it is fed (the hidden states, as
    `inputs_embeds`) unchanged. A forward that scales the embeddings itself (Gemma's `hidden_size ** 0.5`, Granite's
    `embedding_multiplier`) or the logits after the head (Gemma 2's soft cap, Cohere's `logit_scale`) does it again
    on every later stage, and a stage before the head returns the hidden states so changed. `model`: on the meta
    device; the stage holds its buffers only (allocated on the CPU in fp32, zeros) and runs on 1 x 4 random states."""
    stage = copy.deepcopy(model)
    replace_outside(stage, block_list, set(), lambda fqn, module: _set(stage, fqn, module))
    try:
        stage = stage.to_empty(device="cpu").float()
        with torch.no_grad():
            for buffer in stage.buffers():
                buffer.zero_()
            states = torch.randn(1, 4, stage.config.hidden_size, generator=torch.Generator().manual_seed(0))
            out = stage(inputs_embeds=states, use_cache=False).logits
    except Exception as error:  # noqa: BLE001 - any failure of the stand-in stage is the model's
        return f"a stage holding no layer fails ({type(error).__name__}: {str(error).splitlines()[0][:200]})"
    if out.shape != states.shape or not torch.equal(out.float(), states):
        change = "changes their shape" if out.shape != states.shape else \
            f"changes them (by up to {(out.float() - states).abs().max().item():.3g})"
        return (f"a stage holding no layer, fed hidden states, {change}: its forward computes beside the modules "
                "a stage replaces (an embedding scale, a logit cap)")
    return None
