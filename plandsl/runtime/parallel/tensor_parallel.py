"""Megatron tensor parallelism (and sequence parallelism) with DTensor's `parallelize_module`, and the
plan's `shard` rules on top of it.

Stage: interpreter. Contract: `apply_tp(model, tp_mesh, sequence_parallel, rules)` shards a `Transformer`
in place: attention heads and the MLP (Shoeybi et al. 2019) and the vocabulary of the embedding and head;
with sequence parallelism the norms work on sequence shards (Korthikanti et al. 2022). `rules` (from
`tp_rules(plan)`) override that per module. Every linear returns plain local tensors; the model code sees a DTensor
activation as the input of an intact pair's half (one Replicate DTensor its producers read, so their input gradients
are reduced once: `_block_tp`), as a norm's output under sequence parallelism (torch's `SequenceParallel`, sharded
along the sequence), and from the head whose logits go to the cross entropy: it returns them split over the
vocabulary, a DTensor, for torch's loss parallel (`splits_logits`, `loss_context`). `rule_problems(plan)` says which rules cannot run, and why.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (DTensor, Partial, Placement, Replicate, Shard, distribute_module,
                                      distribute_tensor)
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, PrepareModuleInput,
                                               PrepareModuleInputOutput, PrepareModuleOutput, RowwiseParallel,
                                               SequenceParallel, loss_parallel, parallelize_module)

from plandsl.ir.pairs import PAIRS
from plandsl.ir.torch_plan import matches
from plandsl.ir.shard_rules import ModuleRule, pair_intact, rule_problems, tp_rules  # noqa: F401 (re-exported)

# Megatron's pairs in a block (`ir.pairs.PAIRS`): producers split their output features over tp, the consumer its
# input features, so what passes between them (attention heads, the MLP's hidden) stays split locally; the cost
# model reads the same pairs from the parameters' roles (`ir.pairs.block_pairs`)


class _SumGradient(torch.autograd.Function):
    """Identity forward, gradient summed over `group` backward (Megatron's `f` operator): MLA's shared rotary key,
    which each tensor-parallel rank's heads use, so each rank holds a part of its gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


# ---- torch --------------------------------------------------------------------------------------
class PlacedParallel(ParallelStyle):
    """A module whose parameters take explicit placements (`distribute_tensor`): DTensor's sharding
    propagation computes it, and the plain tensors around it are read as `input_layout` and returned
    redistributed to `output_layout`, the layouts its neighbours use."""

    def __init__(self, placements: dict[str, int | None], input_layout: Placement, output_layout: Placement):
        super().__init__()
        self.placements, self.input_layout, self.output_layout = placements, input_layout, output_layout

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        if name:  # the module's own parameters only
            return
        for param_name, param in list(module.named_parameters(recurse=False)):
            dim = self.placements.get(param_name)
            placement = Replicate() if dim is None else Shard(dim % param.ndim)
            module.register_parameter(param_name, nn.Parameter(distribute_tensor(param, mesh, [placement])))

    def _input(self, module: nn.Module, inputs, mesh: DeviceMesh):
        return tuple(DTensor.from_local(x, mesh, (self.input_layout,), run_check=False)
                     if not isinstance(x, DTensor) else x for x in inputs)

    def _output(self, module: nn.Module, output: DTensor, mesh: DeviceMesh):
        return output.redistribute(mesh, (self.output_layout,)).to_local()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, self._partition, self._input, self._output)


class VocabParallelLoss(ParallelStyle):
    """The head under `loss: fused` (`runtime.loss`): its weight split by vocabulary rows (`Shard(0)`: the default,
    and `colwise`), else as its rule places it; its input, the final hidden states in the stream's layout, made
    whole on every rank (all-gathered along the sequence under sequence parallelism). With the vocabulary split,
    each rank's gradient of that input is its slice's part, summed as it goes back (an all-reduce, or a
    reduce-scatter to the sequence shards: Megatron's `f` and its sequence-parallel form); with the weight whole
    on every rank it is the whole gradient already. The loss the head returns is the same on every rank."""

    def __init__(self, weight_dim: int | None, stream: Placement):
        super().__init__()
        self.weight_dim, self.stream = weight_dim, stream

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        if name:
            return
        for param_name, param in list(module.named_parameters(recurse=False)):
            dim = self.weight_dim if param_name == "weight" else None
            placement = Replicate() if dim is None else Shard(dim % param.ndim)
            module.register_parameter(param_name, nn.Parameter(distribute_tensor(param, mesh, [placement])))

    def _input(self, module: nn.Module, inputs, mesh: DeviceMesh):
        hidden = inputs[0]
        if not isinstance(hidden, DTensor):
            hidden = DTensor.from_local(hidden, mesh, (self.stream,), run_check=False)
        parts = (Partial(),) if self.weight_dim == 0 else (Replicate(),)
        return (hidden.redistribute(mesh, (Replicate(),)).to_local(grad_placements=parts), *inputs[1:])

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, self._partition, self._input)


def _loss_weight_dim(rule: ModuleRule | None) -> int | None:
    """The dim of the head's weight a rule splits over the tensor axis (None: whole); no rule: the vocabulary (0)."""
    if rule is None or rule.style == "colwise":
        return 0
    if rule.style == "rowwise":
        return 1
    dim = rule.placements.get("weight")
    return None if dim is None else dim % 2


def splits_logits(model: nn.Module, rules: dict[str, ModuleRule]) -> bool:
    """Does the head leave its logits split over the vocabulary, a DTensor `Shard(-1)` on the tensor axis, for
    torch's loss parallel (`loss_context`)? Where the model's logits go to the plain token cross entropy
    (`models.loss_fn`, not `loss: fused`, whose head computes the loss; multi-token prediction's model calls it
    inside its forward for the main loss and each depth's, `Transformer._loss`, which `loss_context` covers too) and
    the head's rule splits the vocabulary (none, or `colwise`): torchtitan's
    output layer (`ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)`),
    the loss the cost model counts (`cost.memory.loss_backward_bytes`: 4sbV/t of log-probabilities per rank). A
    tied head's too: its weight is the embedding's table, split by vocabulary rows (`Shard(0)`) by default, and
    `ColwiseParallel` redistributes the logits to `Shard(-1)` whatever the table's split."""
    rule = rules.get("head")
    return (getattr(model, "head", None) is not None and hasattr(model, "loss_in_head") and not model.loss_in_head
            and (rule is None or rule.style == "colwise"))


@contextlib.contextmanager
def loss_context(models) -> Iterator[None]:
    """torch's `loss_parallel()` where one of `models` (a rank's model or pipeline stages) has its head's logits
    split over the vocabulary (`splits_logits`), else nothing: the cross entropy of those logits, its forward and
    its backward alike, runs under it (each rank the log-softmax of its slice, the per-token max, sum of
    exponentials and target logit all-reduced over the tensor axis; torch 2.13, tensor/parallel/loss.py)."""
    if any(getattr(model, "vocab_parallel_logits", False) for model in models):
        with loss_parallel():
            yield
    else:
        yield


def _style(rule: ModuleRule, given: Placement, wanted: Placement) -> ParallelStyle | None:
    """`rule` for a module whose plain input arrives as `given` and whose output must leave as `wanted`."""
    if rule.style == "colwise":
        return ColwiseParallel(input_layouts=given, output_layouts=wanted)
    if rule.style == "rowwise":
        return RowwiseParallel(input_layouts=given, output_layouts=wanted)
    if rule.style == "placements":
        return PlacedParallel(rule.placements, given, wanted)
    if isinstance(given, Replicate) and isinstance(wanted, Replicate):
        return None  # replicate: a plain module on full tensors
    return PrepareModuleInputOutput(input_layouts=given, desired_input_layouts=Replicate(), use_local_input=True,
                                    output_layouts=Replicate(), desired_output_layouts=wanted)


def _members(block: nn.Module, prefix: str, group: str, rules: dict[str, ModuleRule]
             ) -> tuple[dict[str, ModuleRule | None], dict[str, ModuleRule], bool]:
    """A pair's members in `block` (group `attn`, `mlp` or `shared`), producers first: each one's rule (None: none),
    Megatron's default style for each, and whether the pair is intact (`ir.shard_rules.pair_intact`, as the count
    reads it)."""
    producers, consumer = PAIRS[group]
    producers = [name for name in producers if getattr(getattr(block, group), name, None) is not None]
    style = {name: rules.get(f"{prefix}{group}.{name}") for name in (*producers, consumer)}
    default = {**{name: ModuleRule("colwise") for name in producers}, consumer: ModuleRule("rowwise")}
    return style, default, pair_intact(rules, f"{prefix}{group}", group)


def _pair(block: nn.Module, prefix: str, group: str, rules: dict[str, ModuleRule], stream: Placement) -> dict:
    """Megatron's split for an intact pair; else every member takes full tensors and returns full ones
    (the consumer: the stream's layout), each as its own rule or default says."""
    style, default, intact = _members(block, prefix, group, rules)
    consumer = PAIRS[group][1]
    if intact:
        return {**{f"{group}.{name}": ColwiseParallel() for name in style if name != consumer},
                f"{group}.{consumer}": RowwiseParallel(output_layouts=stream)}
    out = {}
    for name in style:
        chosen = _style(style[name] or default[name], Replicate(), stream if name == consumer else Replicate())
        if chosen is not None:
            out[f"{group}.{name}"] = chosen
    return out


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool,
             rules: dict[str, ModuleRule] | None = None) -> None:
    # Between blocks the residual stream is replicated, or with sequence parallelism split along
    # the sequence (dim 1); each block gathers it before attention and the MLP and scatters after.
    rules = rules or {}
    stream = Shard(1) if sequence_parallel else Replicate()
    tied = model.head is not None and model.embed is not None and model.head.weight is model.embed.tok.weight
    split = splits_logits(model, rules)
    top: dict = {}
    if model.embed is not None:
        positions = model.embed.pos is not None  # gpt adds positions to the full, replicated embedding
        tok_out = Replicate() if positions else stream
        top["embed.tok"] = (_style(rules["embed.tok"], Replicate(), tok_out) if "embed.tok" in rules
                            else RowwiseParallel(input_layouts=Replicate(), output_layouts=tok_out))
        if positions and "embed.pos" in rules:
            top["embed.pos"] = _style(rules["embed.pos"], Replicate(), Replicate())
        if positions and sequence_parallel:
            top["embed"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=stream)
    if model.norm is not None and sequence_parallel:  # a norm's rule (replicate, sequence) is this default
        top["norm"] = SequenceParallel()
    if model.head is not None and getattr(model, "loss_in_head", False):  # the head computes the loss (runtime.loss)
        top["head"] = VocabParallelLoss(_loss_weight_dim(rules.get("head")), stream)
    elif model.head is not None and split:  # torch's loss parallel over the vocab's slices
        top["head"] = ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1), use_local_output=False)
    elif model.head is not None:  # the logits whole on every rank (multi-token prediction's depths, a rule)
        top["head"] = (_style(rules["head"], stream, Replicate()) if "head" in rules
                       else ColwiseParallel(input_layouts=stream, output_layouts=Replicate()))
    parallelize_module(model, tp_mesh, {name: style for name, style in top.items() if style is not None})
    model.vocab_parallel_logits = split  # `loss_context`
    if tied:  # both sides shard the vocabulary (dim 0): point the head at the embedding's DTensor again
        model.head.weight = model.embed.tok.weight

    for index, block in model.layers.items():
        _block_tp(block, f"layers.{index}.", tp_mesh, sequence_parallel, rules, stream)
    # multi-token prediction's depths (`mtp`): each block as the model's, its norms and `eh_proj` whole on every rank
    # of the group; under sequence parallelism the norms on the stream's shards (`SequenceParallel`, their weights'
    # gradients summed over the group) and `eh_proj` on the whole sequence, gathered before it and scattered after
    # (megatron-core 0.16.1 multi_token_prediction.py:726-747 gathers and scatters around its projection likewise)
    for index, depth in (getattr(model, "mtp", None) or {}).items():
        _block_tp(depth.block, f"mtp.{index}.block.", tp_mesh, sequence_parallel, rules, stream)
        if sequence_parallel:
            whole = PrepareModuleInputOutput(input_layouts=(stream,), desired_input_layouts=(Replicate(),),
                                             use_local_input=True, output_layouts=(Replicate(),),
                                             desired_output_layouts=(stream,), use_local_output=True)
            parallelize_module(depth, tp_mesh, {"enorm": SequenceParallel(), "hnorm": SequenceParallel(),
                                                "eh_proj": whole, "norm": SequenceParallel()})


def _block_tp(block: nn.Module, prefix: str, tp_mesh: DeviceMesh, sequence_parallel: bool,
              rules: dict[str, ModuleRule], stream) -> None:
    """One transformer block's attention and MLP (or its shared experts) split over the group, Megatron's pairs."""
    plan = _pair(block, prefix, "attn", rules, stream)
    ffn = "moe" if hasattr(block, "moe") else "mlp"
    if ffn == "mlp":
        plan.update(_pair(block, prefix, "mlp", rules, stream))
    elif block.moe.shared is not None:  # inside the MoE layer, whose input and output are whole
        plan.update({f"moe.{name}": style for name, style in
                     _pair(block.moe, f"{prefix}moe.", "shared", rules, Replicate()).items()})
    # An intact pair's producers read their input as one Replicate DTensor (torchtitan's `use_local_output=False`), so
    # their input gradients meet as one partial sum, reduced once (reduce-scattered to the shards under sequence
    # parallelism: Megatron's pair), not all-reduced by each producer apart; a pair a rule breaks (plain modules among
    # its members) and MLA's attention (its down-projections plain) read a plain tensor, as does the MoE layer (its
    # router), whose intact shared experts read it as one Replicate DTensor again
    intact = {half: pair_intact(rules, f"{prefix}{half}", half) for half in ("attn", ffn) if half != "moe"}
    for half in ("attn", ffn):
        dtensor = intact.get(half, False) and not (half == "attn" and hasattr(block.attn, "wkv_b"))
        if sequence_parallel or dtensor:
            plan[half] = PrepareModuleInput(input_layouts=(stream,), desired_input_layouts=(Replicate(),),
                                            use_local_output=not dtensor)
    if ffn == "moe" and block.moe.shared is not None and pair_intact(rules, f"{prefix}moe.shared", "shared"):
        plan["moe.shared"] = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),),
                                                use_local_output=False)
    if sequence_parallel:
        plan.update({"norm1": SequenceParallel(), "norm2": SequenceParallel()})
    parallelize_module(block, tp_mesh, plan)
    if getattr(block.attn, "sinks", None) is not None and intact["attn"]:
        # attention sinks, one logit per head: split as an intact pair splits the heads; a pair a rule breaks runs
        # every head on every rank (its producers return whole outputs), so the sinks stay whole
        block.attn.sinks = nn.Parameter(distribute_tensor(block.attn.sinks.data, tp_mesh, [Shard(0)]))
    if hasattr(block.attn, "reduce_rope_key") and intact["attn"]:
        # MLA's shared rotary key: each rank's heads make part of its gradient, summed over the group; a pair a rule
        # breaks runs every head on every rank, where that gradient is whole already
        group = tp_mesh.get_group()
        block.attn.reduce_rope_key = lambda x, group=group: _SumGradient.apply(x, group)
    if sequence_parallel and ffn == "moe":  # the layer's output is whole (expert_parallel): scatter to shards
        parallelize_module(block.moe, tp_mesh, PrepareModuleOutput(
            output_layouts=Replicate(), desired_output_layouts=stream, use_local_output=True))


# ---- a model from torch: its own plan ---------------------------------------------------------
# transformers' style names (`base_model_tp_plan`, a class's `_tp_plan`) -> torch's styles: the styles
# `plandsl run` runs; the others (the packed and local ones) are refused before any process starts
# (runtime.support).
MODEL_STYLES = {
    "colwise": lambda: ColwiseParallel(),
    "rowwise": lambda: RowwiseParallel(),
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
    "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),  # the vocabulary split, output summed
    "replicated_with_grad_allreduce": lambda: PerHeadReplicated(),
}


class PerHeadReplicated(SequenceParallel):
    """transformers' `replicated_with_grad_allreduce` (Qwen3's `q_norm`, `k_norm`): a module inside attention
    whose input a colwise projection has split by heads ([..., heads, head_dim], the heads dim -2) and whose
    weight is whole on every rank: torch's `SequenceParallel` over that dim, so the weight is a Replicate
    DTensor and its gradient, summed over each rank's heads, is all-reduced."""

    def __init__(self):
        super().__init__(sequence_dim=-2, use_local_output=True)

    def _prepare_input_fn(self, sequence_sharding, mod, inputs, device_mesh):  # the heads dim of this input
        x = inputs[0]
        if isinstance(x, DTensor):
            return inputs
        return (DTensor.from_local(x, device_mesh, (Shard(x.ndim - 2),), run_check=False), *inputs[1:])


def model_tp_problems(plan_styles: dict[str, str]) -> list[str]:
    """The entries of a model's tensor-parallel plan the interpreter cannot run (style names it does not map)."""
    return [f"'{pattern}': {style}" for pattern, style in plan_styles.items() if style not in MODEL_STYLES]


def apply_model_tp(model: nn.Module, tp_mesh: DeviceMesh, plan_styles: dict[str, str],
                   sequence_parallel: bool = False) -> None:
    """A model from torch split as its own plan says (FQN pattern -> style): Megatron's pairs, as
    transformers writes them (q, k, v and the MLP's gate and up colwise, o and down rowwise, the head's
    output gathered). Patterns that match no module with parameters of this (stage) module are left out
    (a pipeline stage holds pass-throughs for the modules of other stages).

    With `sequence_parallel` (Korthikanti et al. 2022) the residual stream between the first and the last
    block this module holds is split along the sequence (dim 1): the first block scatters its input (a
    local chunk), the modules holding a colwise projection (attention, MLP) all-gather theirs, the rowwise
    projections reduce-scatter their output, and the blocks' norms (modules outside the plan whose
    parameters are all 1-D) run on sequence shards as torch's `SequenceParallel`; the last block gathers
    its output, so the model's own code around the blocks (masks and rotary positions from the full
    shape, the final norm, a pipeline stage's boundary) sees whole sequences."""
    problems = model_tp_problems(plan_styles)
    if problems:
        raise ValueError(f"the model's tensor-parallel plan has styles plandsl cannot run: {', '.join(problems)}")
    holders = {name: module for name, module in model.named_modules()
               if next(module.parameters(recurse=False), None) is not None}
    hits = {pattern: [name for name in holders if matches(pattern, name)] for pattern in plan_styles}
    matched = {name: plan_styles[pattern] for pattern, names in hits.items() for name in names}
    present = {pattern: MODEL_STYLES[plan_styles[pattern]]() for pattern, names in hits.items() if names}
    if sequence_parallel:
        present = {pattern: RowwiseParallel(output_layouts=Shard(1)) if plan_styles[pattern] == "rowwise" else style
                   for pattern, style in present.items()}
    ties = _ties(model)
    parallelize_module(model, tp_mesh, present)
    for (module, attr), (owner, owner_attr) in ties:  # each side was distributed apart: one tensor again
        shared, copy = getattr(owner, owner_attr), getattr(module, attr)
        if isinstance(shared, DTensor) != isinstance(copy, DTensor) or (
                isinstance(shared, DTensor) and tuple(shared.placements) != tuple(copy.placements)):
            raise ValueError(f"a tied parameter ({attr}) is split one way by the model's tensor-parallel plan and "
                             "another way where it is tied: untie it or give both the same style")
        setattr(module, attr, shared)
    if sequence_parallel:
        _sequence_parallel_blocks(model, tp_mesh, holders, matched)


def _ties(model: nn.Module) -> list[tuple[tuple[nn.Module, str], tuple[nn.Module, str]]]:
    """Each later holder of a tied parameter, with the first: ((module, attribute), (module, attribute))."""
    first: dict[int, tuple[nn.Module, str]] = {}
    found = []
    for module in model.modules():
        for attr, param in module.named_parameters(recurse=False):
            if id(param) in first:
                found.append(((module, attr), first[id(param)]))
            else:
                first[id(param)] = (module, attr)
    return found


def _sequence_parallel_blocks(model: nn.Module, mesh: DeviceMesh, holders: dict[str, nn.Module],
                              matched: dict[str, str]) -> None:
    from plandsl.runtime.torch_model import ModelError, block_list_name, blocks  # the model's block list
    container, names = blocks(model)
    if container is None or not names:
        return
    prefix = block_list_name(model)
    for name in names:
        block_prefix = f"{prefix}.{name}." if prefix else f"{name}."
        for module_name, module in holders.items():
            if not module_name.startswith(block_prefix) or module_name in matched:
                continue
            odd = [f"{param_name} {tuple(param.shape)}" for param_name, param in module.named_parameters(recurse=False)
                   if param.ndim != 1]
            if odd:
                raise ModelError(f"sequence parallelism: '{module_name}' holds {', '.join(odd)}, which the model's "
                                 "tensor-parallel plan does not split and a sequence shard cannot train alone")
            parallelize_module(module, mesh, SequenceParallel(use_local_output=True))
        gathering = {module_name.rpartition(".")[0] for module_name, style in matched.items()
                     if module_name.startswith(block_prefix) and style.startswith("colwise")}
        for module_name in gathering:
            model.get_submodule(module_name).register_forward_pre_hook(
                _on_hidden_states(mesh, Shard(1), Replicate()), with_kwargs=True)
    first, last = container.get_submodule(names[0]), container.get_submodule(names[-1])
    first.register_forward_pre_hook(_on_hidden_states(mesh, Replicate(), Shard(1)), with_kwargs=True)
    last.register_forward_hook(lambda module, args, output: _relayout(output, mesh, Shard(1), Replicate()))


def _on_hidden_states(mesh: DeviceMesh, given: Placement, wanted: Placement):
    """A forward pre-hook that re-lays out a module's hidden states (its first positional argument, or
    `hidden_states=`) from `given` to `wanted` over `mesh`, differentiably."""
    def hook(module, args, kwargs):
        if args:
            return (_relayout(args[0], mesh, given, wanted), *args[1:]), kwargs
        if "hidden_states" in kwargs:
            return args, {**kwargs, "hidden_states": _relayout(kwargs["hidden_states"], mesh, given, wanted)}
        return None
    return hook


def _relayout(tensor, mesh: DeviceMesh, given: Placement, wanted: Placement):
    return DTensor.from_local(tensor, mesh, [given], run_check=False).redistribute(mesh, [wanted]).to_local()
