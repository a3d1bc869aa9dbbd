"""A meta-device module -> plandsl's layer table: module tree, parameters (tied ones found), the block list,
and per block forward FLOPs (`FlopCounterMode`), bytes saved for backward (`saved_tensors_hooks`, unique
storages, parameters excluded) and boundary sizes. E903: the forward fails on meta tensors; E904: no block list.

Cheap for deep models: the block list is cut, for the trace, to the blocks up to the last first block of
each distinct shape (one block for a uniform model); blocks of one shape share its figures. Each trace
runs twice, at `seq` and `seq // 2`, to split the figures into parts linear and quadratic in the sequence.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from plandsl.ir.inspected import (Figures, InspectedBlock, InspectedModule, InspectedParam, ModelSource)
from plandsl.runtime.inspect.factory import Failure, definition, fail, user_frame


@dataclass
class BlockList:
    name: str  # FQN of the ModuleList
    found_by: str
    parent: nn.Module
    attribute: str
    blocks: nn.ModuleList


def parameters(model: nn.Module) -> tuple[tuple[InspectedParam, ...], tuple[InspectedModule, ...], int]:
    """Every parameter by FQN (a tied one names the first FQN of its tensor), each module's own count, the total."""
    first: dict[int, str] = {}
    params = []
    for name, param in model.named_parameters(remove_duplicate=False):
        tied = first.setdefault(id(param), name)
        params.append(InspectedParam(name=name, shape=tuple(param.shape), dtype=str(param.dtype).removeprefix("torch."),
                                     tied_to=None if tied == name else tied))
    counted: set[int] = set()
    modules = []
    for name, module in model.named_modules():
        own = 0
        for param in module.parameters(recurse=False):
            if id(param) not in counted:
                counted.add(id(param))
                own += param.numel()
        modules.append(InspectedModule(name=name, type=type(module).__name__, params=own))
    total = sum(p.numel for p in params if p.tied_to is None)
    return tuple(params), tuple(modules), total


def find_block_list(model: nn.Module, source: ModelSource) -> BlockList:
    """Hugging Face's `base_model_pp_plan` (its ModuleList entry), else a ModuleList named `layers`, else the
    largest ModuleList of blocks of one class; E904 when there is none."""
    names = {module: name for name, module in model.named_modules()}
    config = getattr(model, "config", None)
    plan = getattr(config, "base_model_pp_plan", None) or {}
    base = getattr(model, "base_model", model)
    for key in plan:
        found = base.get_submodule(key) if _has(base, key) else None
        if isinstance(found, nn.ModuleList) and len(found):
            return _block_list(model, names[found], "base_model_pp_plan")
    lists = [(name, module) for name, module in model.named_modules()
             if isinstance(module, nn.ModuleList) and len(module)]
    named = [name for name, _ in lists if name.rsplit(".", 1)[-1] == "layers"]
    if named:
        return _block_list(model, min(named, key=lambda n: n.count(".")), "layers")
    uniform = [(len(module), -name.count("."), name) for name, module in lists
               if len({type(child) for child in module}) == 1]
    if uniform:
        return _block_list(model, max(uniform)[2], "largest ModuleList")
    raise fail("E904", f"no block list found in {type(model).__name__}: no base_model_pp_plan, no ModuleList "
               "named 'layers', no ModuleList of blocks of one class",
               definition(type(model)) if source.kind == "factory" else None,
               hint="hold the repeated blocks in an nn.ModuleList (torchtitan and Hugging Face name it `layers`)")


def _has(root: nn.Module, key: str) -> bool:
    try:
        root.get_submodule(key)
    except AttributeError:
        return False
    return True


def _block_list(model: nn.Module, name: str, found_by: str) -> BlockList:
    parent_name, _, attribute = name.rpartition(".")
    parent = model.get_submodule(parent_name)
    return BlockList(name, found_by, parent, attribute, getattr(parent, attribute))


def shape_keys(blocks: nn.ModuleList) -> list[int]:
    """Equal keys for blocks of one class, parameter names, shapes and dtypes (and attention type, where a
    model alternates sliding and full attention): those are traced once."""
    seen: dict[tuple, int] = {}
    keys = []
    for block in blocks:
        signature = (type(block), getattr(block, "attention_type", None),
                     tuple((n, tuple(p.shape), p.dtype) for n, p in block.named_parameters()))
        keys.append(seen.setdefault(signature, len(seen)))
    return keys


@dataclass
class _Trace:
    """What one forward recorded: per traced block index, FLOPs, saved bytes and boundary bytes; what ran before
    the first block ("before") and after the last ("after")."""
    flops: dict[int | str, float] = field(default_factory=dict)
    saved: dict[int | str, dict[int, int]] = field(default_factory=dict)
    inputs: dict[int, int] = field(default_factory=dict)
    outputs: dict[int, int] = field(default_factory=dict)


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _tensors(item)]
    return [t for item in getattr(value, "__dict__", {}).values() if isinstance(item, torch.Tensor) for t in [item]]


def _bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def trace(model: nn.Module, blocks: BlockList, traced: int, seq: int, source: ModelSource) -> _Trace:
    """One forward of `model` with its block list cut to the first `traced` blocks, at batch 1 and `seq`."""
    record = _Trace()
    current: list[int | str] = ["before"]
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    counter = FlopCounterMode(display=False)
    start: list[float] = [0.0]

    def before(index):
        def hook(module, args, kwargs):
            current[0] = index
            start[0] = counter.get_total_flops()
            if index == 0:
                record.flops["before"] = start[0]
            first = next(iter(_tensors(list(args) + list(kwargs.values()))), None)
            record.inputs[index] = _bytes(first) if first is not None else 0
        return hook

    def after(index):
        def hook(module, args, kwargs, output):
            record.flops[index] = counter.get_total_flops() - start[0]
            record.outputs[index] = sum(_bytes(t) for t in _tensors(output))
            current[0] = "after"
        return hook

    def pack(tensor):
        base = tensor if tensor._base is None else tensor._base
        if not (base.is_leaf and base.requires_grad):  # a parameter (or a view of one) is no activation
            storage = tensor.untyped_storage()
            record.saved.setdefault(current[0], {})[storage._cdata] = storage.nbytes()
        return tensor

    kept = nn.ModuleList(list(blocks.blocks)[:traced])
    handles = [hook for index, block in enumerate(kept) for hook in (
        block.register_forward_pre_hook(before(index), with_kwargs=True),
        block.register_forward_hook(after(index), with_kwargs=True))]
    blocks.parent._modules[blocks.attribute] = kept
    try:
        with fake, counter, torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            tokens = torch.zeros(1, seq, dtype=torch.long, device="meta")
            if source.kind == "hf":
                model(input_ids=tokens, use_cache=False)
            else:
                model(tokens)
    except Failure:
        raise
    except Exception as error:  # the model's forward failing on meta tensors is E903
        reason = (f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
                  if "DataDependent" not in type(error).__name__ else "it reads a tensor's value, which meta tensors lack")
        raise fail("E903", f"the forward of {type(model).__name__} fails on meta tensors (token ids [1, {seq}]): {reason}",
                   user_frame(error),
                   hint="inspect calls the model on token ids [batch, seq]; avoid reading tensor values "
                        "(.item(), data-dependent shapes) in forward") from error
    finally:
        blocks.parent._modules[blocks.attribute] = blocks.blocks
        for handle in handles:
            handle.remove()
    blocks_flops = sum(value for key, value in record.flops.items() if isinstance(key, int))
    record.flops["after"] = counter.get_total_flops() - blocks_flops - record.flops.get("before", 0.0)
    return record


def figures(at_seq: tuple[float, float], at_half: tuple[float, float], seq: int, half: int) -> Figures:
    """Per-token figures at two sequence lengths -> their linear and per-position (quadratic) parts."""
    parts = []
    for full, short in zip(at_seq, at_half, strict=True):
        per_full, per_half = full / seq, short / half
        slope = max(0.0, (per_full - per_half) / (seq - half)) if seq != half else 0.0
        parts += [max(0.0, per_full - slope * seq), slope]
    return Figures(flops=parts[0], flops_per_position=parts[1], activation_bytes=parts[2],
                   activation_bytes_per_position=parts[3])


def block_table(model: nn.Module, blocks: BlockList, seq: int, source: ModelSource
                ) -> tuple[tuple[InspectedBlock, ...], Figures, Figures, int]:
    """Every block's row and the figures of what runs before and after the blocks, from traces of one block
    per shape key."""
    keys = shape_keys(blocks.blocks)
    first = {key: keys.index(key) for key in dict.fromkeys(keys)}
    traced = max(first.values()) + 1
    half = max(1, seq // 2)
    try:
        runs = [trace(model, blocks, traced, length, source) for length in (seq, half)]
    except Failure as failure:
        if traced == len(blocks.blocks):
            raise
        try:  # a forward that needs every block (indexes the list by config.num_hidden_layers): all of them
            traced = len(blocks.blocks)
            runs = [trace(model, blocks, traced, length, source) for length in (seq, half)]
        except Failure:
            raise failure from None

    def measured(run: _Trace, index: int | str) -> tuple[float, float]:
        return run.flops.get(index, 0.0), float(sum(run.saved.get(index, {}).values()))

    rows = []
    for index, block in enumerate(blocks.blocks):
        traced_index = index if index < traced else first[keys[index]]
        rows.append(InspectedBlock(
            name=f"{blocks.name}.{index}", type=type(block).__name__, shape_key=keys[index],
            params=sum(p.numel() for p in block.parameters()),
            figures=figures(measured(runs[0], traced_index), measured(runs[1], traced_index), seq, half),
            input_bytes=runs[0].inputs.get(traced_index, 0) / seq, output_bytes=runs[0].outputs.get(traced_index, 0) / seq))
    before, after = (figures(measured(runs[0], part), measured(runs[1], part), seq, half) for part in ("before", "after"))
    return tuple(rows), before, after, traced


def split_parameters(model: nn.Module, blocks: BlockList) -> tuple[int, int]:
    """Parameters outside the blocks, (before, after) the block list in the module tree's order (a tied one
    counted where it first appears: GPT-2's head in its embedding)."""
    inside = {id(p) for p in blocks.blocks.parameters()}
    seen, counts, part = set(inside), [0, 0], 0
    for name, module in model.named_modules():
        if name == blocks.name:
            part = 1
        for param in module.parameters(recurse=False):
            if id(param) not in seen:
                seen.add(id(param))
                counts[part] += param.numel()
    return counts[0], counts[1]
