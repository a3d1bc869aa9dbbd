"""A user's torch module, run unchanged: a Hugging Face causal LM (`hf(...)`) or a factory's module
(`factory("pkg.mod:fn", ...)`), the models `plandsl inspect` reads.

Stage: interpreter. Contract: `build(model, seed)` returns a `TorchModel`: the user's module, built on the
CPU from the seed alone, behind the calling convention the trainer speaks (token ids -> logits,
`loss(outputs, targets)`, `make_batch`); its parameter names are the module's own fully qualified names
(`model.layers.3.self_attn.q_proj.weight`). `blocks(model)` is its block list (FSDP groups, recomputation);
`stage_modules` makes its pipeline stages (its tensor-parallel plan comes from `plandsl inspect`'s table,
`ir.CustomModel.tp_plan`).

How a Hugging Face model runs in stages is its own convention (transformers' `base_model_pp_plan`, and
what transformers' naive pipeline does): a stage after the first feeds what it receives as
`inputs_embeds`; the modules before the block list that it does not hold are replaced, the token
embedding by nothing, an additive one (GPT-2's positions) by a zero, one on the hidden states by a
pass-through; blocks and the modules after the list (final norm, head) by pass-throughs.
"""
from __future__ import annotations

import contextlib
import copy
import math
import os
import threading
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from plandsl import ir
from plandsl.ir import torch_plan
from plandsl.ir.inspected import parse_source
from plandsl.runtime.buffers import owned_buffers
from plandsl.runtime.inspect.stages import PassThrough, replace_outside
from plandsl.runtime.inspect.trace import has_submodule
from plandsl.runtime.cuts import stage_split_points, unfed_problem
from plandsl.runtime.data import synthetic_tokens
from plandsl.runtime.precision import copy_stream_casts


class ModelError(ValueError):
    """The user's module cannot be run as the plan asks (said before training starts)."""


class TorchModel(nn.Module):
    """The user's module behind the trainer's calling convention. Its children are the module's own (so
    parameter names are the module's), and `inner` (not a child) is the module itself, whose `forward`
    runs: a Hugging Face model with `input_ids` (or, on a later pipeline stage, `inputs_embeds`) and
    `use_cache=False`, returning `.logits`; a factory's module with the token ids, returning its output."""

    def __init__(self, module: nn.Module, source: str, block_list: str | None, hf: bool,
                 block_names: tuple[str, ...] = (), image: tuple[int, ...] | None = None):
        super().__init__()
        own = [name for name, _ in module.named_parameters(recurse=False)]
        if own:  # `plandsl run` refuses such a model first (E704, runtime.support)
            raise ModelError(f"{source}: the model's root holds '{own[0]}' itself; plandsl runs modules whose "
                             "parameters live in submodules (wrap it in a module that holds it)")
        for name, child in module.named_children():
            self.add_module(name, child)
        # the root's own buffers (a causal mask) are held here too, under their names, and handed back to the
        # module whenever a move replaces them (`_apply`: .to(), to_empty): the module's forward reads its own
        for name, buffer in module.named_buffers(recurse=False):
            self.register_buffer(name, buffer, persistent=name not in module._non_persistent_buffers_set)
        self.__dict__["inner"] = module  # shared children; deep-copied along with them
        self.source, self.block_list, self.hf = source, block_list, hf
        self.block_names = block_names  # every block's FQN, for a model whose blocks sit in several containers
        self.first = self.last = True  # which ends of the model this (stage) module holds
        self.image = image  # the shape of one sample of a model that takes images (a CNN), else None: token ids
        self.vocab = None if image else _vocab(module, hf)
        self.classes = _classes(module, image) if image else None

    def _apply(self, fn, recurse: bool = True):
        result = super()._apply(fn, recurse)
        for name, buffer in self._buffers.items():
            self.inner._buffers[name] = buffer
        return result

    def train(self, mode: bool = True):
        self.inner.training = mode  # transformers reads the root's flag (its own checkpointing)
        return super().train(mode)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.hf:
            out = self.inner(x)
        elif self.image:  # a Hugging Face vision model (ViT, ResNet): images as `pixel_values`, one stage (no pp plan)
            return self.inner(pixel_values=x).logits
        else:
            out = self.inner(**{"input_ids" if self.first else "inputs_embeds": x}, use_cache=False).logits
        # a stage before the head may return a view: a Hugging Face stage the hidden states its pass-through head got
        # (transformers slices them for `logits_to_keep`), a traced stage whatever its last op gives (a block ending in
        # a reshape); torch's split backward (zbv, the zero-bubble schedules) detaches a stage's output in place, which
        # a view refuses: a copy of its own, as plandsl's own stages return
        return out.clone() if not self.last and isinstance(out, torch.Tensor) and out._is_view() else out

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The model's own loss: a Hugging Face model's `loss_function` (its causal-LM cross entropy, told the
        targets are already shifted), a factory module's `loss(outputs, targets)`, else mean cross entropy of its
        output (of the first tensor it returns, as `plandsl inspect` reads it: `(logits, aux)`, a dict of them)."""
        if self.hf and not self.image:  # a vision model's loss is its classes' cross entropy (below)
            return self.inner.loss_function(logits=outputs, labels=None, vocab_size=self.vocab,
                                             shift_labels=targets.contiguous())
        own = getattr(self.inner, "loss", None)
        if callable(own):
            return own(outputs, targets)
        return F.cross_entropy(first_tensor(outputs).flatten(0, -2).float(), targets.flatten())

    def make_batch(self, batch: int, seq: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """The module's own `make_batch` when it has one, else synthetic token sequences over its vocabulary."""
        own = getattr(self.inner, "make_batch", None)
        if callable(own):
            return own(batch, seq, generator)
        if self.image:  # random images and labels of the right shape: a smoke run (the module's own data: make_batch)
            return (torch.randn(batch, *self.image, generator=generator),
                    torch.randint(self.classes, (batch,), generator=generator))
        if self.vocab is None:
            raise ModelError(f"{self.source}: the model has no token embedding to size synthetic token ids by; "
                             "give it a `make_batch(batch, seq, generator)` method")
        tokens = synthetic_tokens(batch, seq + 1, self.vocab, generator)
        return tokens[:, :-1], tokens[:, 1:]

    # ---- what the parallelisms need -----------------------------------------------------------------
    def block_container(self) -> nn.Module:
        """The module holding the blocks: the block list, or (blocks in several containers) the model itself."""
        return self.get_submodule(self.block_list) if self.block_list else self

    def stage_modules(self, stages: list[set[str]], wanted: list[int], example: torch.Tensor) -> dict[int, "TorchModel"]:
        """The stage modules `wanted` of the split into `stages` (each the layer names it holds, in order): a
        Hugging Face model by its own convention (`_hf_stage`); any other module traced by torch's pipeline
        frontend (`torch.distributed.pipelining.pipeline`, torch.export) on `example` (one microbatch) and cut
        at the first block of each stage (`SplitPoint.BEGINNING`; after the last block when a stage holds only
        the head), so its own forward, including what it computes between blocks, is what runs."""
        if self.hf:
            return {index: self._hf_stage(stages[index]) for index in wanted}
        from torch.distributed.pipelining import SplitPoint, pipeline  # lazy: torch's pipelining takes seconds
        points = stage_split_points(self.all_block_names(), stages)
        if points is None:  # `plandsl run` refuses such stages first (E704, runtime.support)
            raise ModelError(f"{self.source}: its blocks give too few points to cut it into {len(stages)} stages")
        spec = {name: SplitPoint.BEGINNING if point == "beginning" else SplitPoint.END for name, point in points.items()}
        full = copy.deepcopy(self.inner)  # the trace's stages share its parameters: never the caller's module
        try:
            pipe = pipeline(full, mb_args=(example,), split_spec=spec)
        except Exception as error:  # torch.export could not capture the forward
            raise ModelError(f"{self.source}: torch's pipeline frontend cannot trace the module's forward to split it "
                             f"into stages ({type(error).__name__}: {str(error).splitlines()[0][:300]})") from error
        if pipe.num_stages != len(stages):
            raise ModelError(f"{self.source}: the trace cut the module into {pipe.num_stages} stages, not {len(stages)}")
        unfed = unfed_problem(pipe)  # `plandsl inspect` records such a module as one it cannot trace (E704)
        if unfed:
            raise ModelError(f"{self.source}: {unfed}")
        found = {}
        for index in wanted:
            module = pipe.get_stage_module(index)
            copy_stream_casts(self.inner, module)  # a 16-bit residual stream (traced outside autocast, without it)
            keep_untouched_buffers(module, full, self.all_block_names(), stages[index])
            stage = TorchModel(module, self.source, self.block_list, False,
                               tuple(name for name in self.block_names if has_submodule(module, name)))
            stage.first, stage.last = index == 0, index == len(stages) - 1
            stage.image, stage.vocab, stage.classes = self.image, self.vocab, self.classes
            found[index] = stage
        return found

    def all_block_names(self) -> list[str]:
        """Every block's FQN in forward order."""
        if not self.block_list:
            return list(self.block_names)
        return [f"{self.block_list}.{name}" for name, _ in self.block_container().named_children()]

    def _hf_stage(self, keep: set[str]) -> "TorchModel":
        """A Hugging Face model's stage: a deep copy holding only the layers in `keep` (`embed`, block FQNs,
        `head`), the rest replaced by transformers' convention (the module docstring)."""
        pp_plan = self.pp_plan()
        if pp_plan is None:
            raise ModelError(f"{self.source}: {type(self.inner).__name__} declares no `base_model_pp_plan`, so "
                             "plandsl does not know which of its modules run before the blocks")
        stage = copy.deepcopy(self)
        stage.first, stage.last = "embed" in keep, "head" in keep
        replace_outside(stage.inner, self.block_list, keep, stage._replace)
        _refuse_split_ties(self, stage)
        return stage

    def _replace(self, fqn: str, module: nn.Module) -> None:
        parent_name, _, child = fqn.rpartition(".")
        setattr(self.inner.get_submodule(parent_name), child, module)
        if not parent_name:  # a child of the root: ours too
            setattr(self, child, module)

    def pp_plan(self) -> dict | None:
        """transformers' `base_model_pp_plan` of the model (module -> (inputs, outputs)), None without one."""
        config = getattr(self.inner, "config", None)
        return getattr(config, "base_model_pp_plan", None) or None


def keep_untouched_buffers(stage: nn.Module, full: nn.Module, block_names: list[str], layers: set[str]) -> None:
    """Give a traced `stage` the persistent buffers of `full` (the module it was cut from) that its `layers` hold and
    its trace left out: torch.export keeps only the state the forward reads or writes, so a buffer it never touches
    (a format version) was in no stage's state dict, and a checkpoint of the stages was refused by another layout
    ("holds a different model: ... is only here") and `--check-equivalence` failed, naming it missing. Each under its
    FQN in `full` (containers made where the stage has none), on the stage holding its module's layer
    (`ir.torch_plan.layer_index`: a block by its FQN, `embed` before the blocks, `head` after)."""
    held = set(dict(stage.named_buffers()))
    layer_of = torch_plan.layer_index(tuple(block_names), tuple(name for name, _ in full.named_modules()))
    for entry in list(owned_buffers(full)):
        if layer_of.get(entry.path) not in layers or not entry.persistent or entry.fqn in held:
            continue
        parent = stage
        for part in entry.path.split(".") if entry.path else ():
            if not isinstance(parent._modules.get(part), nn.Module):
                parent.add_module(part, nn.Module())
            parent = parent._modules[part]
        parent.register_buffer(entry.name, entry.buffer)


def _vocab(module: nn.Module, hf: bool) -> int | None:
    if hf:
        return getattr(getattr(module, "config", None), "vocab_size", None)
    embedding = next((m for m in module.modules() if isinstance(m, nn.Embedding)), None)
    return embedding.num_embeddings if embedding is not None else None


def _classes(module: nn.Module, image: tuple[int, ...]) -> int:
    """The number of classes an image model outputs: its output's last size on one sample (evaluation mode,
    so batch statistics are not needed; on the meta device in a dry run)."""
    training = module.training
    module.eval()
    try:
        with torch.no_grad():
            output = module(torch.zeros(1, *image))
    finally:
        module.train(training)
    logits = getattr(output, "logits", output)
    if not isinstance(logits, torch.Tensor) or logits.ndim != 2:
        raise ModelError(f"an image model must return logits [batch, classes]; it returned "
                         f"{tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__}")
    return logits.shape[-1]


def _refuse_split_ties(full: TorchModel, stage: TorchModel) -> None:
    """A parameter the stage holds that is also used by a module it left out (a tied embedding and head on
    two stages) would train as two copies; the checker refuses such plans, and so does this."""
    kept = {id(p) for p in stage.parameters()}
    if not kept or (stage.first and stage.last):
        return
    names = {id(p): name for name, p in full.named_parameters(remove_duplicate=False)}
    by_name = {name: p for name, p in full.named_parameters(remove_duplicate=False)}
    stage_names = {name for name, _ in stage.named_parameters(remove_duplicate=False)}
    for name, param in by_name.items():
        first = names[id(param)]
        if first != name and (first in stage_names) != (name in stage_names):
            raise ModelError(f"{full.source}: '{name}' is tied to '{first}', and the plan puts them on different "
                             "pipeline stages; untie them (e.g. `tie_word_embeddings=false`) or keep both on one stage")


def build(model: ir.CustomModel, seed: int, parameters_on_meta: bool = False) -> TorchModel:
    """The model's module in float32 on the default device (the CPU; the meta device in a dry run), its
    parameters drawn from `seed` alone (the module's own initialisation under `torch.manual_seed`), in
    training mode, without a key/value cache. `parameters_on_meta`: every parameter on the meta device instead,
    nothing drawn, the buffers built where they are (`meta_parameters`; `build_meta`)."""
    from plandsl.runtime.inspect.factory import Failure, build as build_module  # the same builder as inspect
    source = parse_source(model.source)
    search = tuple(dict.fromkeys((os.path.dirname(model.span.file) if model.span else "", ".")))
    with torch.random.fork_rng(devices=[]), meta_parameters(parameters_on_meta):
        torch.manual_seed(seed)
        try:
            module, _ = build_module(source, "float32", tuple(folder or "." for folder in search),
                                     device=str(torch.get_default_device()))  # the dry run's meta device
        except Failure as failure:
            raise ModelError(f"{failure.diagnostic.code}: {failure.diagnostic.message}") from None
    config = getattr(module, "config", None)
    if config is not None and hasattr(config, "use_cache"):
        config.use_cache = False
    wrapped = TorchModel(module, source.text, model.block_list, source.kind == "hf", tuple(model.blocks),
                         source.image)
    wrapped.train()
    return wrapped


def first_tensor(outputs):
    """The first tensor of a module's output (itself, or the first of a tuple, list or dict, depth first): what
    `plandsl inspect` records as its output and the default loss reads; TypeError when it holds none."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    items = outputs.values() if isinstance(outputs, dict) else outputs if isinstance(outputs, (tuple, list)) else ()
    for item in items:
        try:
            return first_tensor(item)
        except TypeError:
            continue
    raise TypeError(f"the model's output holds no tensor for the loss ({type(outputs).__name__}); give its module "
                    "a `loss(outputs, targets)` method")


def block_list_name(model: nn.Module) -> str:
    """The FQN of a model's block list: a `TorchModel`'s ("" when its blocks sit in several containers and
    are named in full), else plandsl's `layers`."""
    return (model.block_list or "") if isinstance(model, TorchModel) else "layers"


def blocks(model: nn.Module) -> tuple[nn.Module | None, list[str]]:
    """The container of a model's blocks and the names of the blocks it still holds: a `TorchModel`'s block
    list (without the pass-throughs of a stage), else plandsl's `layers` ModuleDict."""
    if isinstance(model, TorchModel) and not model.block_list:  # blocks in several containers: by their FQNs
        return model, [name for name in model.block_names if not isinstance(model.get_submodule(name), PassThrough)]
    if isinstance(model, TorchModel):
        if not has_submodule(model, model.block_list):  # a traced stage of the head alone holds no block list
            return None, []
        container = model.block_container()
        return container, [name for name, block in container.named_children() if not isinstance(block, PassThrough)]
    layers = getattr(model, "layers", None)
    return (layers, list(layers.keys())) if isinstance(layers, nn.ModuleDict) else (None, [])


# ---- built on the meta device ------------------------------------------------------------------------
# A Hugging Face model's parameters are defined by its own `_init_weights(module)`, which transformers applies to
# every module, children before their parent (`PreTrainedModel.initialize_weights`, the sub-model's own function
# for a sub-model's modules), so a parent may overwrite what its children set (GPT-2 scales its blocks' `c_proj`).
# `build_meta` builds the model with its parameters on the meta device (its buffers, small, where they are: rotary
# frequencies), so `plandsl run`'s ranks can split it before anything is allocated, and reads on it, where nothing
# is drawn, which parameters each module's `_init_weights` writes (`_writers`); `initial_values` then gives the
# values `initialize_weights` gives from the seed, one module's parameters at a time, or one subtree's where a module
# writes its descendants', a tie transformers makes after the draws drawn apart (`_ties`). A model that cannot be
# filled so (construction fails with meta parameters, a parameter only its constructor sets, a module writing outside
# its subtree, a parameter two modules write that is no such tie) is built whole, as before.


_META = threading.local()  # whether this thread builds parameters on the meta device (`meta_parameters`)
_PATCH = threading.Lock()
_register = nn.Module.register_parameter


def _register_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
    _register(module, name, param)
    param = module._parameters.get(name)
    if getattr(_META, "depth", 0) and param is not None and not param.is_meta:
        module._parameters[name] = type(param)(param.to("meta"), requires_grad=param.requires_grad)


@contextlib.contextmanager
def meta_parameters(enabled: bool = True):
    """Every parameter a module registers in this thread, in this context, is put on the meta device (its buffers
    are not): the module's own initialisation then draws nothing. A parameter already there (a tie) is kept as it is.
    Other threads build as they would (the hook, installed once, acts for threads inside the context only)."""
    if not enabled:
        yield
        return
    with _PATCH:
        nn.Module.register_parameter = _register_parameter  # idempotent: the same function every time
    _META.depth = getattr(_META, "depth", 0) + 1
    try:
        yield
    finally:
        _META.depth -= 1


def meta_buildable(model: ir.CustomModel) -> bool:
    """Can `plandsl run` build this model with its parameters on the meta device? A Hugging Face language model:
    its `_init_weights` says every parameter's initial values (`initial_values`; `build_meta` finds out whether it
    says all of them). A factory's module, whose values its own code sets however it likes, and an image model (its
    classes are read from a forward) are built whole."""
    source = parse_source(model.source)
    return source.kind == "hf" and not source.image


def build_meta(model: ir.CustomModel) -> TorchModel | None:
    """`build(model, ...)` with every parameter on the meta device (`meta_parameters`): shapes only, with the modules
    whose `_init_weights` writes a descendant's parameters (`TorchModel.subtrees`, read by `_writers`) and the ties
    transformers makes after the draws (`TorchModel.tied`, `_ties`). None where it cannot be filled from its
    `_init_weights` module by module: its construction fails with meta parameters (an `_init_weights` in `post_init`
    that assigns a CPU tensor's data), a parameter no `_init_weights` writes (only its constructor sets it), a module
    writing outside its subtree, a parameter two modules write that is not such a tie."""
    try:
        skeleton = build(model, 0, parameters_on_meta=True)
    except ModelError:
        return None  # the whole build says what is wrong, if anything is
    skeleton.tied = _ties(skeleton)
    subtrees = _writers(skeleton)
    if subtrees is None:
        return None
    skeleton.subtrees = subtrees
    return skeleton


def _ties(skeleton: TorchModel) -> frozenset[tuple[int, str]]:
    """The (module id, parameter name) entries transformers ties to another parameter after the weights are drawn
    (`init_weights` runs `initialize_weights`, then `tie_weights`): each target of the model's
    `all_tied_weights_keys` (a head, a decoder's embedding or bias) that holds its source's parameter now, in a
    module other than the source's; without the mapping (transformers 4), an output embedding holding the input
    embedding's weight. While drawn, each such entry holds a parameter of its own, whose values are dropped: the
    source's stay."""
    model = skeleton.inner
    mapping = dict(getattr(model, "all_tied_weights_keys", None) or {})
    if not mapping:
        try:
            head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
        except (AttributeError, NotImplementedError):
            return frozenset()
        names = {id(module): name for name, module in model.named_modules(remove_duplicate=False)}
        if head is None or embedding is None or id(head) not in names or id(embedding) not in names:
            return frozenset()
        mapping = {f"{names[id(head)]}.weight".lstrip("."): f"{names[id(embedding)]}.weight".lstrip(".")}
    tied = set()
    for target, source in mapping.items():
        target_path, _, target_name = target.rpartition(".")
        source_path, _, source_name = source.rpartition(".")
        try:
            target_module, source_module = model.get_submodule(target_path), model.get_submodule(source_path)
        except AttributeError:
            continue
        held = target_module._parameters.get(target_name)
        if held is not None and target_module is not source_module \
                and held is source_module._parameters.get(source_name):
            tied.add((id(target_module), target_name))
    return frozenset(tied)


def _children_first(module: nn.Module, owner: nn.Module, done: set[int]):
    """(module, the `PreTrainedModel` whose `_init_weights` it takes) in `initialize_weights`' order, each module once
    (`done`, shared by a walk: a module reached again, held in two places, is skipped as transformers skips it,
    `_is_hf_initialized`)."""
    from transformers import PreTrainedModel  # lazy: only a Hugging Face model is built on the meta device
    if id(module) in done:
        return
    for child in module.children():
        yield from _children_first(child, child if isinstance(child, PreTrainedModel) else owner, done)
    done.add(id(module))
    yield module, owner


class _Writes(TorchDispatchMode):
    """Records the storages of the meta tensors every operator in its context writes (its schema's mutable
    arguments): an in-place initialisation through the parameter, a view of it or its `.data` alike."""

    def __init__(self):
        super().__init__()
        self.storages: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for index, argument in enumerate(func._schema.arguments):
            if argument.alias_info is not None and argument.alias_info.is_write:
                value = args[index] if index < len(args) else kwargs.get(argument.name)
                if isinstance(value, torch.Tensor) and value.is_meta:
                    self.storages.add(value.untyped_storage()._cdata)
        return func(*args, **kwargs)


@torch.no_grad()
def _writers(skeleton: TorchModel) -> frozenset[int] | None:
    """The modules (ids) whose `_init_weights` writes parameters of their descendants, read on the meta skeleton
    (nothing is drawn there) by the storages its operators write (`_Writes`), each tie of `skeleton.tied` held apart
    as while drawn (`_apart`); None when a module's `_init_weights` fails there, writes a parameter outside its
    subtree, a parameter is written by none, or one of its own was written by another module before (one shared at
    construction: transformers keeps the last draw, or skips a module held twice)."""
    storage = {id(p): p.untyped_storage()._cdata for p in skeleton.inner.parameters()}
    first: dict[int, int] = {}  # each parameter's storage -> the first module writing it
    subtrees = set()
    for module, owner in _children_first(skeleton.inner, skeleton.inner, set()):
        writes = _Writes()
        try:
            with _apart(skeleton, list(module.modules()), "meta"), writes:
                owner._init_weights(module)
        except Exception:  # noqa: BLE001 - the model's own code on meta tensors: it is built whole instead
            return None
        own = {storage[id(p)] for p in module.parameters(recurse=False)}
        below = {storage[id(p)] for p in module.parameters()}
        changed = writes.storages & set(storage.values())
        if changed - below:
            return None
        if changed - own:
            subtrees.add(id(module))
        for written in changed:
            if first.setdefault(written, id(module)) != id(module) and written in own:
                return None  # its own, written before by another module: which draw stays depends on how the model
                # was put together (a descendant's, rewritten by this module, is filled with its subtree at once)
    if set(storage.values()) - set(first):
        return None
    return frozenset(subtrees)


@contextlib.contextmanager
def _apart(skeleton: TorchModel, modules: list[nn.Module], device: str):
    """Inside: each tie of `skeleton.tied` among `modules` holds a new parameter of its own (NaN, on `device`) in place
    of its source's, as transformers draws it before tying it; the source's back after."""
    saved = []
    for module in modules:
        for name, param in list(module._parameters.items()):
            if param is not None and (id(module), name) in skeleton.tied:
                saved.append((module, name, param))
                module._parameters[name] = nn.Parameter(torch.full(param.shape, math.nan, dtype=param.dtype,
                                                                   device=device), requires_grad=False)
    try:
        yield
    finally:
        for module, name, param in saved:
            module._parameters[name] = param


def initial_values(skeleton: TorchModel, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full value) of every parameter of `skeleton` (`build_meta`'s, never parallelized), in turn: what
    transformers' `initialize_weights` gives from the global generator seeded with `seed`, each module's
    `_init_weights` (a sub-model's for its modules) applied children first to the module itself holding new CPU
    tensors in place of its own meta parameters for the call (`_on_cpu`: the model's own code may find the module by
    identity), or, for a module that writes its descendants' (`skeleton.subtrees`), to its whole subtree so, each of
    its modules in the same order. A tie transformers makes after the draws (`skeleton.tied`: a head) is drawn as a
    parameter of its own and dropped (`_apart`): its source's values are its value. `ModelError` when a parameter is
    left unset (each is filled with NaN first)."""
    from transformers import PreTrainedModel  # lazy: only a Hugging Face model is built on the meta device
    names = {id(module): name for name, module in skeleton.inner.named_modules(remove_duplicate=False)}
    seen: set[int] = set()

    def given(prefix: str, module: nn.Module, values: dict[int, torch.Tensor], recurse: bool):
        """(name, value) of `module`'s parameters (its subtree's) not seen yet, their values in `values`; a tie's
        target (`skeleton.tied`) is its source's, given where the source is."""
        holders = module.named_modules(remove_duplicate=False) if recurse else [("", module)]
        for path, holder in holders:
            for name, param in holder._parameters.items():
                if param is None or id(param) in seen or (id(holder), name) in skeleton.tied:
                    continue
                seen.add(id(param))
                full_name = ".".join(part for part in (prefix, path, name) if part)
                value = values[id(param)]
                if value.is_floating_point() and torch.isnan(value).any():
                    raise ModelError(f"{skeleton.source}: the model's _init_weights leaves '{full_name}' unset, so "
                                     "plandsl cannot give it initial values on each rank")
                yield full_name, value

    done: set[int] = set()  # the modules filled (one held in two places once, as `_children_first` walks)

    def walk(module: nn.Module, owner: nn.Module):
        if id(module) in done:
            return
        if id(module) in skeleton.subtrees:  # its `_init_weights` writes its descendants': the subtree at once
            order = list(_children_first(module, owner, done))
            modules = [each for each, _ in order]
            with _apart(skeleton, modules, "cpu"), _on_cpu(modules) as values:
                for each, its_owner in order:
                    its_owner._init_weights(each)
            yield from given(names[id(module)], module, values, recurse=True)
            return
        for child in module.children():
            yield from walk(child, child if isinstance(child, PreTrainedModel) else owner)
        done.add(id(module))
        with _apart(skeleton, [module], "cpu"), _on_cpu([module]) as values:
            owner._init_weights(module)
        yield from given(names[id(module)], module, values, recurse=False)

    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        yield from walk(skeleton.inner, skeleton.inner)


@contextlib.contextmanager
def _on_cpu(modules: list[nn.Module]):
    """Inside: each of `modules` holds new CPU parameters filled with NaN in place of its own (meta) ones, one per
    parameter (a tie stays one); gives {id of the meta parameter: its CPU values}, kept after the meta ones return."""
    values: dict[int, torch.Tensor] = {}
    saved, swapped = [], {}
    for module in modules:
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) not in values:
                values[id(param)] = torch.full(param.shape, math.nan, dtype=param.dtype)
                swapped[id(param)] = nn.Parameter(values[id(param)], requires_grad=False)
            saved.append((module, name, param))
    for module, name, param in saved:
        module._parameters[name] = swapped[id(param)]
    try:
        yield values
    finally:
        for module, name, param in saved:
            module._parameters[name] = param
