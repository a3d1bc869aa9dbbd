"""A user's torch module as plandsl's layer table (`plandsl inspect`), and the model source it came from.

Stage: IR, torch-free. `runtime/inspect` derives an `InspectedModel` on the meta device; this module
parses a model source (`pkg.mod:fn(k=v)`, `hf("LlamaForCausalLM", k=v)`: literals only, nothing
evaluated; `input=image(C, H, W)` says the model takes images instead of token ids), writes and reads the JSON cache and says whether a cache is stale for a source, its
settings and the installed library versions (read from package metadata: torch is not imported).
"""
from __future__ import annotations

import ast
import functools
import hashlib
import importlib.metadata
import json
import math
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from plandsl.diagnostics.limits import MAX_LAYERS, MAX_SEQ
from plandsl.ir.fqn import naming_something
from plandsl.syntax.files import read_bounded, shown_path, write_through_temporary

MAX_TABLE_FILES = 16
"""Files a table's freshness reads (the factory's module: one), each at most `file_digest`'s bytes: a table edited
to name 100,000 (spellings of one big file) would keep `check` hashing for an hour."""

CACHE_VERSION = 7  # 2: the model's tensor-parallel plan (`tp_plan`); 3: whether torch's pipeline frontend cuts
# it (`traceable`), its expert-parallel plan and experts; 4: the values per channel its BatchNorms see (`norm_values`);
# 5: why a Hugging Face model's stages by its own convention would compute otherwise (`stage_problem`); 6: the
# positions a learned position embedding holds (`positions`); 7: whether the tensor-parallel plan is a transformers
# model's (`tp_plan_from_transformers`)
LIBRARIES = ("torch", "transformers", "plandsl")  # the versions a cache is keyed by

Literal_ = Union[int, float, str, bool, None]
_FACTORY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


INPUT_KEY = "input"  # `input=image(C, H, W)`: the model's input, not an argument of the factory or config
IMAGE_DIMS = (2, 4)  # image(C, L), image(C, H, W), image(C, D, H, W): channels, then 1 to 3 spatial dims
MAX_IMAGE_DIM = 1 << 16


def image_text(image: tuple[int, ...]) -> str:
    return f"image({', '.join(str(size) for size in image)})"


def check_image(sizes: tuple, where: str) -> tuple[int, ...]:
    """`image(...)`'s sizes: 2 to 4 positive integers (channels, then the spatial dims); ValueError naming
    what is wrong."""
    if not all(isinstance(size, int) and not isinstance(size, bool) for size in sizes):
        raise ValueError(f"{where}: image() takes integer sizes, e.g. image(3, 224, 224) for [channels, height, width]")
    if not IMAGE_DIMS[0] <= len(sizes) <= IMAGE_DIMS[1]:
        raise ValueError(f"{where}: image() takes the channels and 1 to 3 spatial sizes (image(3, 224, 224) is "
                         f"[channels, height, width]), not {len(sizes)} size(s)")
    if not all(0 < size <= MAX_IMAGE_DIM for size in sizes):
        raise ValueError(f"{where}: image() sizes must be between 1 and {MAX_IMAGE_DIM:,}, not {tuple(sizes)}")
    return tuple(sizes)


@dataclass(frozen=True)
class ModelSource:
    """What builds the model: a factory `module:function` called with `args`, or (`kind="hf"`) a Hugging
    Face model class built from its config class with `args` as config keys; `image`: the shape of one
    sample, [channels, *spatial], when the model takes images (None: token ids)."""

    kind: Literal["factory", "hf"]
    target: str  # "pkg.mod:fn" or the Hugging Face class name
    args: tuple[tuple[str, Literal_], ...] = ()
    image: Optional[tuple[int, ...]] = None

    @property
    def text(self) -> str:
        """The canonical spelling (arguments in the order written, strings in double quotes, the input last):
        the cache's key."""
        args = ", ".join([f"{key}={_shown(value)}" for key, value in self.args]
                         + ([f"{INPUT_KEY}={image_text(self.image)}"] if self.image else []))
        if self.kind == "hf":
            return f"hf({_shown(self.target)}{', ' + args if args else ''})"
        return f"{self.target}({args})"


def _shown(value) -> str:
    if isinstance(value, str):
        return json.dumps(value)  # a Python string literal too
    if isinstance(value, tuple):
        return "[" + ", ".join(_shown(item) for item in value) + "]"
    return repr(value)


def parse_source(text: str) -> ModelSource:
    """`pkg.mod:fn`, `pkg.mod:fn(k=v, ...)` or `hf("Class", k=v, ...)`, keyword arguments of literals only
    (numbers, strings, booleans, None, and tuples/lists of those), and `input=image(C, H, W)`; ValueError
    saying what is wrong."""
    text = text.strip()
    if _FACTORY.fullmatch(text):
        return ModelSource("factory", text)
    head, paren, _ = text.partition("(")
    if not paren or not (head == "hf" or _FACTORY.fullmatch(head)):
        raise ValueError(f"'{text}' is not a model source: write pkg.module:function(key=value, ...) "
                         'or hf("LlamaForCausalLM", key=value, ...)')
    try:  # the call with its head replaced by a plain name: Python's parser, then literals only
        call = ast.parse("f" + text[len(head):], mode="eval").body
    except SyntaxError as error:
        raise ValueError(f"'{text}' does not parse: {error.msg}") from None
    if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name):
        raise ValueError(f"'{text}' is not one call")
    positional = [_literal(arg, text) for arg in call.args]
    args, image = [], None
    for keyword in call.keywords:
        if keyword.arg is None:
            raise ValueError(f"'{text}': ** arguments are not allowed, write each key=value")
        if keyword.arg in dict(args) or (keyword.arg == INPUT_KEY and image):
            raise ValueError(f"'{text}': argument '{keyword.arg}' is given twice")
        if keyword.arg == INPUT_KEY and isinstance(keyword.value, ast.Call):
            image = _image(keyword.value, text)
        else:
            args.append((keyword.arg, _literal(keyword.value, text)))
    if head == "hf":
        if len(positional) != 1 or not isinstance(positional[0], str):
            raise ValueError(f"'{text}': hf() takes the model class name first, "
                             'e.g. hf("LlamaForCausalLM", hidden_size=4096)')
        return ModelSource("hf", positional[0], tuple(args), image)
    if positional:
        raise ValueError(f"'{text}': a factory takes keyword arguments only (key=value)")
    return ModelSource("factory", head, tuple(args), image)


def _image(call: ast.Call, text: str) -> tuple[int, ...]:
    """`input=image(3, 224, 224)`: the one input kind besides token ids."""
    if not (isinstance(call.func, ast.Name) and call.func.id == "image") or call.keywords:
        raise ValueError(f"'{text}': {INPUT_KEY}= takes image(channels, height, width), "
                         f"found '{ast.unparse(call)}'")
    return check_image(tuple(_literal(arg, text) for arg in call.args), f"'{text}'")


_PLAN_WORDS = {"true": True, "false": False}  # the plan language's booleans, as a plan's hf(...) writes them


def _literal(node: ast.expr, text: str) -> Literal_:
    if isinstance(node, ast.Name) and node.id in _PLAN_WORDS:
        return _PLAN_WORDS[node.id]
    try:
        value = ast.literal_eval(node)
    except ValueError:
        raise ValueError(f"'{text}': arguments must be literals (numbers, strings, booleans, None), "
                         f"found '{ast.unparse(node)}'") from None
    if isinstance(value, list):
        value = tuple(value)
    if isinstance(value, tuple):
        if not all(isinstance(item, (int, float, str, bool)) or item is None for item in value):
            raise ValueError(f"'{text}': a list argument may hold only numbers, strings and booleans")
        return value
    if not (isinstance(value, (int, float, str, bool)) or value is None) or (
            isinstance(value, float) and not math.isfinite(value)):
        raise ValueError(f"'{text}': arguments must be finite numbers, strings, booleans or None, "
                         f"found '{ast.unparse(node)}'")
    return value


def portable_path(path: str) -> str:
    """A file's path as the table's JSON holds it: as it is, or, where its name holds bytes that are not UTF-8
    (Python keeps them as lone surrogates, which JSON writes as U+FFFD: the table then named another file and
    stayed stale for ever), `hex:` and its bytes in hex. `file_digest` reads either."""
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        return "hex:" + os.fsencode(path).hex()
    return path


def _native_path(name: str) -> str:
    if name.startswith("hex:"):  # a module's path is absolute: no other starts so
        try:
            return os.fsdecode(bytes.fromhex(name[4:]))
        except ValueError:
            return ""
    return name


MAX_DIGEST_BYTES = 64 << 20
"""The largest file `file_digest` reads: a factory's module is source text of kilobytes."""


def file_digest(path: str | Path) -> str:
    """sha256 of a regular file's bytes ("" when it cannot be read, is no regular file or holds more than
    `MAX_DIGEST_BYTES`): a factory's module changing makes its cache stale. The paths come from the cache's
    `files`, which anyone can write: one naming /dev/zero was read until memory ran out (E108), a FIFO waited
    for a writer for ever; opened without blocking, checked to be a regular file, read bounded."""
    try:
        handle = os.open(_native_path(os.fspath(path)), os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except (OSError, ValueError):  # ValueError: a NUL byte in the path
        return ""
    try:
        if not stat.S_ISREG(os.fstat(handle).st_mode):
            return ""
        digest, left = hashlib.sha256(), MAX_DIGEST_BYTES + 1
        while left > 0:
            piece = os.read(handle, min(left, 1 << 20))
            if not piece:
                return digest.hexdigest()
            digest.update(piece)
            left -= len(piece)
        return ""  # past the bound: no module of anyone's
    except OSError:
        return ""
    finally:
        os.close(handle)


@functools.lru_cache(maxsize=1)
def library_versions() -> dict[str, str]:
    """The installed versions a cache is keyed by, from package metadata ("" when not installed); read once
    per process (the metadata files are parsed as email headers: ~3 ms a library)."""
    found = {}
    for name in LIBRARIES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = ""
    return found


# ---- the table --------------------------------------------------------------------------------------------
TABLE_COUNT = 10**15
"""The most any count of a table may be (parameters, elements of a shape, a dimension): a 1T-parameter model has
10^12. The table is a JSON file anyone can edit; past this (10^400 parameters, a shape of 10^80) its figures
overflowed float() in the checker (E108 OverflowError)."""
TABLE_AMOUNT = 1e18
"""The most a figure per token may be (FLOPs, bytes): ~6e12 FLOPs a token for a 1T model. NaN and infinity are
refused too: an inf figure became a layer's inf FLOPs, which the model's own validation then refused (E108)."""
Count = Annotated[int, Field(ge=0, le=TABLE_COUNT)]
Amount = Annotated[float, Field(ge=0, le=TABLE_AMOUNT, allow_inf_nan=False)]


class _Frozen(BaseModel):
    """A part of the table: a cache that breaks these bounds is no cache of this plandsl (stale: E215)."""
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class InspectedModule(_Frozen):
    """One module of the tree, by its fully qualified name ("" is the root)."""
    name: str
    type: str  # the class name, e.g. "LlamaDecoderLayer"
    params: Count = Field(description="parameters held directly (not by children); a tied one counted once")


class InspectedParam(_Frozen):
    name: str  # fully qualified, as `named_parameters()` names it
    shape: tuple[Count, ...] = Field(max_length=16)
    dtype: str
    tied_to: Optional[str] = Field(default=None, description="the first name of the same tensor, when tied")

    @field_validator("shape")
    @classmethod
    def _bounded_numel(cls, shape: tuple[int, ...]) -> tuple[int, ...]:
        if math.prod(shape) > TABLE_COUNT:
            raise ValueError(f"a parameter of more than {TABLE_COUNT:.0e} elements")
        return shape

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class Figures(_Frozen):
    """Measured per token at the table's `seq`: forward FLOPs and bytes saved for backward, each split into
    a part linear in the sequence (per token) and one quadratic in it (per token per position: attention
    scores), so that figures at another sequence length s are `linear + per_position * s`. For a model that
    takes images the "token" is one sample (an image; `seq` is 1, nothing is per position)."""
    flops: Amount
    flops_per_position: Amount
    activation_bytes: Amount
    activation_bytes_per_position: Amount

    def flops_at(self, seq: int) -> float:
        return self.flops + self.flops_per_position * seq

    def activation_bytes_at(self, seq: int) -> float:
        return self.activation_bytes + self.activation_bytes_per_position * seq


class InspectedBlock(_Frozen):
    """One entry of the block list (a pipeline unit): its parameters, its figures and its boundary."""
    name: str  # e.g. "model.layers.3"
    type: str  # the block's class name
    shape_key: Count = Field(description="blocks with equal keys have equal parameters and were traced once")
    params: Count
    figures: Figures
    input_bytes: Amount = Field(description="bytes per token (per sample for images) of the tensor entering "
                                "the block")
    output_bytes: Amount = Field(description="bytes per token (per sample for images) of the tensors leaving "
                                 "the block")


class InspectedModel(_Frozen):
    """A torch module as the table the rest of plandsl speaks, and the key it was derived under."""
    version: Literal[7] = CACHE_VERSION
    source: str  # `ModelSource.text`
    seq: int = Field(gt=0, le=MAX_SEQ, description="the sequence length traced at; 1 for a model that takes images")
    image: Optional[tuple[Count, ...]] = Field(default=None, max_length=16, description="the shape of one sample, "
                                               "[channels, *spatial], for a model that takes images; None: token ids "
                                               "[1, seq]")
    output_shape: tuple[Count, ...] = Field(default=(), max_length=16, description="the model's output per sample "
                                            "(the first tensor it returns, without the batch dim): [seq, vocab], "
                                            "[classes]")
    norm_values: Count = Field(default=0, description="the fewest values per channel per sample any BatchNorm "
                             "normalises (its input's height x width: 1 for a ResNet's last stage at 32x32); 0: no "
                             "BatchNorm. A training microbatch must give each more than one")
    dtype: str  # the default dtype the model was built under ("bfloat16")
    versions: dict[str, str]
    files: dict[str, str] = Field(default_factory=dict, max_length=MAX_TABLE_FILES,
                                  description="the factory's module file -> its sha256")
    model_type: str
    params: Count = Field(description="every parameter, a tied one counted once")
    param_list: tuple[InspectedParam, ...]
    modules: tuple[InspectedModule, ...]
    block_list: Optional[str] = Field(description="FQN of the one ModuleList (or ModuleDict, torchtitan's "
                                      "`layers`) holding the blocks; None when the blocks are the children of "
                                      "several containers (`containers`)")
    containers: tuple[str, ...] = Field(default=(), description="FQNs of the containers whose children are the "
                                        "blocks, in forward order: (`model.layers`,); a ResNet's nn.Sequential "
                                        "stages (`layer1`, ..., `layer4`)")
    block_list_from: Literal["base_model_pp_plan", "layers", "largest ModuleList", "largest ModuleDict",
                             "nn.Sequential"]
    blocks: tuple[InspectedBlock, ...] = Field(max_length=MAX_LAYERS)  # in forward order; each `name` its FQN
    before: Figures  # what runs before the first block (the embedding)
    after: Figures  # what runs after the last block (final norm, head; no loss)
    before_params: Count = Field(description="parameters outside the blocks, before the block list in the tree")
    after_params: Count = Field(description="parameters outside the blocks, after the block list (a tied head: 0)")
    traced_blocks: int = Field(ge=1, le=TABLE_COUNT, description="blocks actually traced: one per distinct shape key")
    tp_plan: tuple[tuple[str, str], ...] = Field(default=(), description="the model's own tensor-parallel plan, "
                                                 "(FQN pattern, style): a Hugging Face model's `tp_plan`, else a "
                                                 "`tp_plan`/`_tp_plan` dict the module has")
    tp_plan_from_transformers: bool = Field(default=False, description="`tp_plan` is a transformers model's (its "
                                            "class's `_tp_plan` and its config's `base_model_tp_plan`): its entries "
                                            "naming nothing in the model are skipped, as transformers skips them; a "
                                            "module's own dict is its author's, and such an entry is a mistake (E405)")
    ep_plan: tuple[tuple[str, str], ...] = Field(default=(), description="the model's own expert-parallel plan, "
                                                 "(FQN pattern, style): transformers' `ep_plan` (`grouped_gemm` "
                                                 "parameters split by expert, `ep_dispatch_experts` modules)")
    experts: Count = Field(default=0, description="experts per MoE layer (0: a dense model), the first dim of "
                         "the parameters the expert-parallel plan splits")
    traceable: bool = Field(default=False, description="a factory's module that torch's pipeline frontend "
                            "(torch.export) cut at its second block on the meta device: `plandsl run` can split it "
                            "into pipeline stages at its blocks")
    positions: Optional[Count] = Field(default=None, description="the positions a learned position embedding of "
                                       "the model holds (GPT-2's `wpe`, OPT's `embed_positions`: the config's "
                                       "`n_positions` or `max_position_embeddings`), None without one (rotary "
                                       "positions have no table): a longer train seq looks up rows that do not exist")
    stage_problem: Optional[str] = Field(default=None, description="a Hugging Face model with a "
                                         "`base_model_pp_plan`: why its stages by that convention would compute "
                                         "otherwise than the whole model (a stage holding no layer changed the hidden "
                                         "states it was fed: an embedding scale or a logit cap in its forward), else "
                                         "None; `plandsl run` then refuses pipeline stages of it")

    @property
    def tied(self) -> tuple[tuple[str, str], ...]:
        return tuple((p.name, p.tied_to) for p in self.param_list if p.tied_to)

    def flops_per_token(self) -> float:
        """Forward FLOPs per token of the whole model at its `seq`."""
        return (self.before.flops_at(self.seq) + self.after.flops_at(self.seq)
                + sum(b.figures.flops_at(self.seq) for b in self.blocks))

    def activation_bytes_per_token(self) -> float:
        """Bytes saved for backward per token of the whole model at its `seq` (no recomputation)."""
        return (self.before.activation_bytes_at(self.seq) + self.after.activation_bytes_at(self.seq)
                + sum(b.figures.activation_bytes_at(self.seq) for b in self.blocks))


def write_cache(model: InspectedModel, path: str | Path) -> None:
    """The table written to `path` through a temporary file renamed over it (`write_through_temporary`: a FIFO or a
    link to /dev/full at `path` is replaced, not written through). OSError when it cannot be."""
    write_through_temporary(os.fspath(path), model.model_dump_json(indent=1) + "\n")


@dataclass(frozen=True)
class CacheState:
    """A cache read for a source: `model` when it is there and fresh, else why not (`missing`/`stale`)."""
    model: Optional[InspectedModel]
    problem: Optional[str] = None  # None: fresh

    @property
    def fresh(self) -> bool:
        return self.problem is None


MAX_CACHE_BYTES = 256 << 20  # a 100k-block model's table is a few MB
_PARSED: dict[tuple, "InspectedModel"] = {}


def _written_version(text: str) -> int | None:
    """The `version` a table's JSON says it is, where it says one (a whole number), else None."""
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        return None
    version = data.get("version") if isinstance(data, dict) else None
    return version if isinstance(version, int) and not isinstance(version, bool) else None


def read_cache(path: str | Path, source: ModelSource | None = None, seq: int | None = None,
               dtype: str | None = None, versions: dict[str, str] | None = None) -> CacheState:
    """The cache at `path`, and whether it is stale for this source, settings and library versions (the
    installed ones unless given); never raises for a missing or unreadable file. A regular file of at most
    `MAX_CACHE_BYTES` is read; its table is parsed once per (path, modification time, size)."""
    try:
        status = os.stat(path)
        if not stat.S_ISREG(status.st_mode):
            return CacheState(None, "missing: not a regular file")
        if status.st_size > MAX_CACHE_BYTES:
            return CacheState(None, f"stale: {status.st_size:,} bytes, more than a table holds ({MAX_CACHE_BYTES:,})")
        key = (os.fspath(path), status.st_mtime_ns, status.st_size)
        model = _PARSED.get(key)
        # read bounded, as what stat saw (a regular file of at most MAX_CACHE_BYTES) may no longer be what is there:
        # a FIFO put in its place was opened for reading and waited for a writer for ever
        text = read_bounded(path, MAX_CACHE_BYTES, "layer table").decode("utf-8") if model is None else None
    except (OSError, ValueError, UnicodeDecodeError) as error:
        return CacheState(None, "missing" if isinstance(error, FileNotFoundError) else
                          f"missing: {getattr(error, 'strerror', None) or error}")
    if model is None:
        try:
            model = InspectedModel.model_validate_json(text)
        except ValidationError as error:
            written = _written_version(text)
            if written is not None and written != CACHE_VERSION:  # the common case after an upgrade: say so
                return CacheState(None, f"stale: table version {written}, written by "
                                        f"{'an older' if written < CACHE_VERSION else 'a newer'} plandsl (this one "
                                        f"reads {CACHE_VERSION})")
            return CacheState(None, f"stale: not a cache of this plandsl ({error.error_count()} problem(s))")
        _PARSED[key] = model
        while len(_PARSED) > 16:  # the tables of the last few plans
            _PARSED.pop(next(iter(_PARSED)))
    if source is not None and model.source != source.text:
        return CacheState(model, f"stale: made for {model.source}")
    if seq is not None and model.seq != seq:
        return CacheState(model, f"stale: made for seq {model.seq}, not {seq}")
    if dtype is not None and model.dtype != dtype:
        return CacheState(model, f"stale: made for dtype {model.dtype}, not {dtype}")
    versions = library_versions() if versions is None else versions
    changed = [f"{name} {model.versions.get(name, '')!r} -> {versions.get(name, '')!r}" for name in LIBRARIES
               if model.versions.get(name, "") != versions.get(name, "")]
    if changed:
        return CacheState(model, f"stale: {', '.join(changed)}")
    edited = next((name for name, digest in model.files.items() if file_digest(name) != digest), None)  # the first
    if edited is not None:
        return CacheState(model, f"stale: {shown_path(_native_path(edited))} changed since it was inspected")
    return CacheState(model)


def summary(model: InspectedModel) -> str:
    """`plandsl inspect`'s text: the model, its parameters, and one row per run of blocks of one shape; the entries of
    its tensor-parallel plan that name nothing in it, which `plandsl check` and `run` skip."""
    seq, unit = model.seq, "sample" if model.image else "token"
    runs: list[list[InspectedBlock]] = []
    for block in model.blocks:
        if runs and runs[-1][-1].shape_key == block.shape_key:
            runs[-1].append(block)
        else:
            runs.append([block])
    rows = [("before the blocks", model.before_params, model.before.flops_at(seq), model.before.activation_bytes_at(seq), "")]
    for run in runs:
        first, last = run[0], run[-1]
        label = first.name if len(run) == 1 else f"{first.name}..{last.name.rsplit('.', 1)[-1]} x{len(run)} ({first.type})"
        rows.append((label, first.params, first.figures.flops_at(seq), first.figures.activation_bytes_at(seq),
                     f"{first.output_bytes:,.0f}" + (" each" if len(run) > 1 else "")))
    rows.append(("after the blocks", model.after_params, model.after.flops_at(seq), model.after.activation_bytes_at(seq), ""))
    rows.append(("total", model.params, model.flops_per_token(), model.activation_bytes_per_token(), ""))
    width = max(len(row[0]) for row in rows) + 2
    traced = f"input {image_text(model.image)} per sample" if model.image else f"seq {seq:,}"
    lines = [f"{model.model_type} from {model.source} ({traced}, {model.dtype})",
             f"parameters: {model.params:,}" + "".join(f"; {a} tied to {b}" for a, b in model.tied),
             f"block list: {model.block_list or ', '.join(model.containers)} (from {model.block_list_from}), "
             f"{len(model.blocks)} blocks, {model.traced_blocks} traced",
             f"{'':<{width}}{'params':>16}{'FLOPs/' + unit:>18}{'saved B/' + unit:>16}{'boundary B/' + unit:>22}"]
    lines += [f"{label:<{width}}{params:>16,}{flops:>18,.0f}{saved:>16,.0f}{boundary:>22}"
              for label, params, flops, saved, boundary in rows]
    names = [m.name for m in model.modules] + [p.name for p in model.param_list]
    kept = {pattern for pattern, _ in naming_something(model.tp_plan, names)}
    skipped = [pattern for pattern, _ in model.tp_plan if pattern not in kept] if model.tp_plan_from_transformers else []
    if skipped:  # transformers warns so too: "rules [...] match nothing in ... and will not be applied"
        lines.append(f"tensor-parallel plan: {len(skipped)} of its {len(model.tp_plan)} entries name nothing in the "
                     f"model and are skipped, as transformers skips them: {', '.join(skipped[:6])}"
                     + (", ..." if len(skipped) > 6 else ""))
    return "\n".join(lines)
