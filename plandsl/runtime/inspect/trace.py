"""A meta-device module -> plandsl's layer table: module tree, parameters (tied ones found), the block list,
and per block forward FLOPs (`FlopCounterMode`), bytes saved for backward (`saved_tensors_hooks`, unique
storages, parameters and buffers excluded) and boundary sizes. E903: the forward fails on meta tensors; E904: no block list.

Cheap for deep models: the block list is cut, for the trace, to the blocks up to the last first block of
each distinct shape (one block for a uniform model); blocks of one shape share its figures. Each trace of
token ids runs twice, at `seq` and `seq // 2`, to split the figures into parts linear and quadratic in the
sequence. A model that takes images runs once, on a batch of 2 (BatchNorm in training mode needs more than
one value per channel), every block traced (its blocks' shapes change from stage to stage), per sample.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from plandsl.ir.inspected import (Figures, InspectedBlock, InspectedModule, InspectedParam, ModelSource, image_text)
from plandsl.runtime.inspect.factory import Failure, definition, fail, user_frame

IMAGE_BATCH = 2


# The containers a model's blocks sit in, one after another: a ModuleList, or torchtitan's ModuleDict keyed "0" ..
# "N-1" (a pipeline stage deletes the blocks it does not hold and keeps the others' names), iterated in its order
BLOCK_LISTS = (nn.ModuleList, nn.ModuleDict)


@dataclass
class BlockList:
    """The pipeline units: `blocks` (FQN, module) in forward order, the children of `containers` (FQNs);
    `name` is the one ModuleList's (or ModuleDict's) FQN when there is one container (None for a CNN's several
    stages)."""
    name: str | None
    found_by: str
    containers: tuple[str, ...]
    blocks: list[tuple[str, nn.Module]]

    @property
    def modules(self) -> list[nn.Module]:
        return [module for _, module in self.blocks]


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
    """Hugging Face's `base_model_pp_plan` (its ModuleList entry), else a ModuleList or ModuleDict (torchtitan's
    layout: blocks `layers.0` .. by its keys, in its order) named `layers`, else the largest such container of
    blocks of one class (a ModuleDict keyed "0" .. "N-1", `_indexed`), else the children of the longest run of nn.Sequential siblings (a ResNet's `layer1` ..
    `layer4`: blocks `layer1.0` .. `layer4.1`); E904 when there is none."""
    names = {module: name for name, module in model.named_modules()}
    config = getattr(model, "config", None)
    plan = getattr(config, "base_model_pp_plan", None) or {}
    base = getattr(model, "base_model", model)
    for key in plan:
        found = base.get_submodule(key) if has_submodule(base, key) else None
        if isinstance(found, nn.ModuleList) and len(found):
            return _block_list(model, names[found], "base_model_pp_plan")
    lists = [(name, module) for name, module in model.named_modules()
             if isinstance(module, BLOCK_LISTS) and len(module)]
    named = [name for name, _ in lists if name.rsplit(".", 1)[-1] == "layers"]
    if named:
        return _block_list(model, min(named, key=lambda n: n.count(".")), "layers")
    uniform = [(len(module), -name.count("."), name) for name, module in lists
               if len({type(child) for child in module.children()}) == 1 and _indexed(module)]
    if uniform:
        largest = max(uniform)[2]
        kind = "ModuleDict" if isinstance(model.get_submodule(largest), nn.ModuleDict) else "ModuleList"
        return _block_list(model, largest, f"largest {kind}")
    stages = _sequential_stages(model)
    if stages:
        return BlockList(None, "nn.Sequential", tuple(stages),
                         [(_join(stage, child), module) for stage in stages
                          for child, module in model.get_submodule(stage).named_children()])
    raise fail("E904", f"no block list found in {type(model).__name__}: no base_model_pp_plan, no ModuleList or "
               "ModuleDict named 'layers' or holding blocks of one class, no nn.Sequential of blocks",
               definition(type(model)) if source.kind == "factory" else None,
               hint="hold the repeated blocks in an nn.ModuleList (Hugging Face names it `layers`), an nn.ModuleDict "
                    "keyed \"0\", \"1\", ... (torchtitan's `layers`) or nn.Sequential stages (torchvision's ResNet: "
                    "layer1 .. layer4)")


def _indexed(container: nn.Module) -> bool:
    """Whether a container is a list of blocks by its keys: a ModuleList, or a ModuleDict keyed "0" .. "N-1" in order
    (torchtitan's); a ModuleDict keyed otherwise is a set of named parts (a multi-task model's heads, keyed by task)."""
    return not isinstance(container, nn.ModuleDict) or list(container.keys()) == [str(i) for i in range(len(container))]


def _join(parent: str, child: str) -> str:
    return f"{parent}.{child}" if parent else child


def _sequential_stages(model: nn.Module) -> list[str]:
    """The FQNs of the run of consecutive nn.Sequential children of one module (the root itself when it is
    one) holding the most blocks: children that have children and parameters of their own (a BasicBlock, not
    a Conv2d or a ReLU: a Sequential of layers is one block's insides); the shallowest run on a tie. Sequentials
    without blocks at either end of the run are left out (a classifier head after the features, a stem before
    them). Empty when there is none."""
    best: tuple[int, int, list[str]] = (0, 0, [])
    candidates = [("", [("", model)])] if isinstance(model, nn.Sequential) else []
    for name, module in model.named_modules():
        run: list[tuple[str, nn.Module]] = []
        for child, sub in list(module.named_children()) + [("", None)]:
            if isinstance(sub, nn.Sequential) and len(sub):
                run.append((_join(name, child), sub))
                continue
            if run:
                candidates.append((name, run))
            run = []
    for parent, run in candidates:  # (blocks, -depth) decides: most blocks, then the shallowest
        counts = [_blocks_in(stage) for _, stage in run]
        if not any(counts):
            continue
        first = next(index for index, count in enumerate(counts) if count)
        last = max(index for index, count in enumerate(counts) if count)
        depth = -parent.count(".") - bool(parent)
        if (sum(counts), depth) > best[:2]:
            best = (sum(counts), depth, [stage for stage, _ in run[first:last + 1]])
    return best[2]


def _blocks_in(stage: nn.Module) -> int:
    return sum(1 for block in stage.children()
               if any(True for _ in block.children()) and any(True for _ in block.parameters()))


def has_submodule(root: nn.Module, key: str) -> bool:
    """Whether `root.get_submodule(key)` finds a module."""
    try:
        root.get_submodule(key)
    except AttributeError:
        return False
    return True


def _block_list(model: nn.Module, name: str, found_by: str) -> BlockList:
    blocks = model.get_submodule(name)  # a ModuleList's children are named by index, a ModuleDict's by key
    return BlockList(name, found_by, (name,), [(f"{name}.{key}", block) for key, block in blocks.named_children()])


def shape_keys(blocks: list[nn.Module]) -> list[int]:
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
    the first block ("before") and after the last ("after"); the first tensor the model returned."""
    flops: dict[int | str, float] = field(default_factory=dict)
    saved: dict[int | str, dict[int, int]] = field(default_factory=dict)
    inputs: dict[int, int] = field(default_factory=dict)
    outputs: dict[int, int] = field(default_factory=dict)
    result: tuple[int, ...] = ()
    norm_values: int = 0  # the fewest values per channel a BatchNorm saw, per sample (0: none ran)


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


@dataclass(frozen=True)
class Inputs:
    """What the forward is called on: token ids [1, seq], or a batch of `IMAGE_BATCH` images; `per` is how many
    tokens (samples, for images) the measured figures are for."""
    source: ModelSource
    seq: int
    dtype: torch.dtype

    @property
    def per(self) -> int:
        return IMAGE_BATCH if self.source.image else self.seq

    def describe(self) -> str:
        if self.source.image:
            return f"images [{IMAGE_BATCH}, {', '.join(map(str, self.source.image))}] ({image_text(self.source.image)})"
        return f"token ids [1, {self.seq}]"

    def example(self) -> torch.Tensor:
        """What a factory's module is called on, on the meta device (its one positional input)."""
        if self.source.image:
            return torch.zeros(IMAGE_BATCH, *self.source.image, dtype=self.dtype, device="meta")
        return torch.zeros(1, self.seq, dtype=torch.long, device="meta")

    def call(self, model: nn.Module):
        if self.source.image:
            images = torch.zeros(IMAGE_BATCH, *self.source.image, dtype=self.dtype, device="meta")
            return model(pixel_values=images) if self.source.kind == "hf" else model(images)
        tokens = torch.zeros(1, self.seq, dtype=torch.long, device="meta")
        return model(input_ids=tokens, use_cache=False) if self.source.kind == "hf" else model(tokens)


def cuttable(blocks: BlockList, inputs: Inputs) -> bool:
    """Whether the trace may run a prefix of the blocks: one ModuleList (or ModuleDict) the forward loops over, on
    token ids (a decoder, whose blocks keep the hidden size). A model that takes images is traced whole: its stages change
    the shape the layers after them take, and blocks of one shape cost more at a higher resolution."""
    return blocks.name is not None and blocks.found_by != "nn.Sequential" and not inputs.source.image


def trace(model: nn.Module, blocks: BlockList, traced: int, inputs: Inputs) -> _Trace:
    """One forward of `model` with its block list cut to the first `traced` blocks (when `cuttable`)."""
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

    buffers = {id(buffer) for buffer in model.buffers()}

    def pack(tensor):
        base = tensor if tensor._base is None else tensor._base
        # a parameter (or a view of one) is no activation, nor is a buffer (BatchNorm's running statistics)
        if not (base.is_leaf and base.requires_grad) and id(base) not in buffers:
            storage = tensor.untyped_storage()
            record.saved.setdefault(current[0], {})[storage._cdata] = storage.nbytes()
        return tensor

    def batch_norm(module, args):
        first = next(iter(_tensors(args)), None)
        if module.training and first is not None and first.dim() >= 2 and first.shape[1]:
            values = first.numel() // (first.shape[1] * (IMAGE_BATCH if inputs.source.image else 1))
            record.norm_values = min(record.norm_values or values, values)

    run = blocks.modules[:traced]
    handles = [module.register_forward_pre_hook(batch_norm) for module in model.modules()
               if isinstance(module, nn.modules.batchnorm._BatchNorm)]
    handles += [hook for index, block in enumerate(run) for hook in (
        block.register_forward_pre_hook(before(index), with_kwargs=True),
        block.register_forward_hook(after(index), with_kwargs=True))]
    cut = cuttable(blocks, inputs) and traced < len(blocks.blocks)
    if cut:
        parent_name, _, attribute = blocks.name.rpartition(".")
        parent = model.get_submodule(parent_name)
        whole = parent._modules[attribute]
        parent._modules[attribute] = nn.ModuleDict(dict(list(whole.named_children())[:traced])) \
            if isinstance(whole, nn.ModuleDict) else nn.ModuleList(run)
    try:
        with fake, counter, torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            result = next(iter(_tensors(inputs.call(model))), None)
            record.result = tuple(result.shape[1:]) if result is not None and result.dim() else ()
    except Failure:
        raise
    except (Exception, SystemExit) as error:  # the model's forward failing on meta tensors is E903 (sys.exit too)
        reason = (f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
                  if "DataDependent" not in type(error).__name__ else "it reads a tensor's value, which meta tensors lack")
        hint = ("inspect calls the model on the images input=image(...) gives, a batch of "
                f"{IMAGE_BATCH} [{IMAGE_BATCH}, channels, height, width]: give the shape the model takes"
                if inputs.source.image else
                "inspect calls the model on token ids [batch, seq] (a model that takes images: add "
                "input=image(channels, height, width) to its source)")
        raise fail("E903", f"the forward of {type(model).__name__} fails on meta tensors ({inputs.describe()}): {reason}",
                   user_frame(error), hint=hint + "; avoid reading tensor values (.item(), data-dependent shapes) "
                                                  "in forward") from error
    finally:
        if cut:
            parent._modules[attribute] = whole
        for handle in handles:
            handle.remove()
    blocks_flops = sum(value for key, value in record.flops.items() if isinstance(key, int))
    record.flops["after"] = counter.get_total_flops() - blocks_flops - record.flops.get("before", 0.0)
    return record
def figures(at_seq: tuple[float, float], at_half: tuple[float, float] | None, seq: int, half: int) -> Figures:
    """Per-token figures at two sequence lengths -> their linear and per-position (quadratic) parts; from one
    measurement (`at_half` None: images), all linear."""
    parts = []
    for index, full in enumerate(at_seq):
        per_full = full / seq
        per_half = at_half[index] / half if at_half is not None else per_full
        slope = max(0.0, (per_full - per_half) / (seq - half)) if seq != half else 0.0
        parts += [max(0.0, per_full - slope * seq), slope]
    return Figures(flops=parts[0], flops_per_position=parts[1], activation_bytes=parts[2],
                   activation_bytes_per_position=parts[3])


@dataclass(frozen=True)
class Table:
    """`block_table`'s result: every block's row, what runs before and after, blocks traced, output per sample."""
    rows: tuple[InspectedBlock, ...]
    before: Figures
    after: Figures
    traced: int
    output_shape: tuple[int, ...]
    norm_values: int


def block_table(model: nn.Module, blocks: BlockList, inputs: Inputs) -> Table:
    """Every block's row and the figures of what runs before and after the blocks, from traces of one block
    per shape key (every block when the list cannot be cut)."""
    modules = blocks.modules
    keys = shape_keys(modules)
    first = {key: keys.index(key) for key in dict.fromkeys(keys)}
    traced = max(first.values()) + 1 if cuttable(blocks, inputs) else len(modules)
    half = max(1, inputs.seq // 2)
    lengths = (inputs,) if inputs.source.image else (inputs, Inputs(inputs.source, half, inputs.dtype))
    try:
        runs = [trace(model, blocks, traced, length) for length in lengths]
    except Failure as failure:
        if traced == len(modules):
            raise
        try:  # a forward that needs every block (indexes the list by config.num_hidden_layers): all of them
            traced = len(modules)
            runs = [trace(model, blocks, traced, length) for length in lengths]
        except Failure:
            raise failure from None

    def measured(run: _Trace, index: int | str) -> tuple[float, float]:
        return run.flops.get(index, 0.0), float(sum(run.saved.get(index, {}).values()))

    def row_figures(index: int | str) -> Figures:
        return figures(measured(runs[0], index), measured(runs[1], index) if len(runs) > 1 else None,
                       inputs.per, half if len(runs) > 1 else inputs.per)

    per = inputs.per
    rows = []
    for index, (name, block) in enumerate(blocks.blocks):
        traced_index = index if index < traced else first[keys[index]]
        rows.append(InspectedBlock(
            name=name, type=type(block).__name__, shape_key=keys[index],
            params=sum(p.numel() for p in block.parameters()), figures=row_figures(traced_index),
            input_bytes=runs[0].inputs.get(traced_index, 0) / per, output_bytes=runs[0].outputs.get(traced_index, 0) / per))
    return Table(tuple(rows), row_figures("before"), row_figures("after"), traced, runs[0].result, runs[0].norm_values)


def split_parameters(model: nn.Module, blocks: BlockList) -> tuple[int, int]:
    """Parameters outside the blocks, (before, after) the first block in the module tree's order (a tied one
    counted where it first appears: GPT-2's head in its embedding)."""
    inside = {id(p) for block in blocks.modules for p in block.parameters()}
    seen, counts, part = set(inside), [0, 0], 0
    first = blocks.containers[0] if blocks.name is None else blocks.name
    for name, module in model.named_modules():
        if name == first:
            part = 1
        for param in module.parameters(recurse=False):
            if id(param) not in seen:
                seen.add(id(param))
                counts[part] += param.numel()
    return counts[0], counts[1]
