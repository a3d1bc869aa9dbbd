"""`plandsl run --dry-run --memory`: one rank's training steps run on fake tensors, every allocation and free of
device memory recorded in order, for the model of torch's caching allocator (`cost.allocator`).

Stage: interpreter, in the launching process (no rank is started; no tensor of the model's size is allocated).
Contract: `trace_rank(plan, rank, steps)` joins torch's fake process group as `rank` (`FakeStore`: collectives are
no-ops), builds that rank's job with the interpreter's own `train.build_job` around a model whose tensors are fake
(`FakeTensorMode`: shapes, dtypes and storages' sizes, no data), runs `train.train_step` `steps` times and returns
every storage the build and the steps made and freed, in order (`MemoryTrace`): what `plandsl run` would hold on
that rank's device, tensor by tensor, where the cost model counts terms. `TraceError` (one line) where a plan cannot
be traced: what its step reads from the data (a mixture of experts' routing, fp16's loss scaling, the shapes a
pipeline of a model other than a built-in transformer exchanges at its first step), or a trace past `MAX_EVENTS`.

What a trace sees: the storage of every tensor an operator returns, recorded by the fake mode itself
(`_RecordingFakeMode`, so also the operators DTensor runs inside its handler: loss parallel's temporaries, the
optimizer's steps on shards), freed when the last reference to it goes (a weak reference's callback); not a view's
(it allocates nothing), not what the fake mode runs to compute another operator (a decomposition's steps, which a
device kernel does not allocate), not DTensor's shape inference on fake tensors of the global shapes; and the
unsharded parameters FSDP2 allocates and frees by resizing their storages, which no operator shows (its
`alloc_storage`/`free_storage`, wrapped while tracing). Tensors outside the fake mode (the mesh's, small ones the
build makes on the host) are not device memory here. A pipeline's stages are given their shapes (`_static_stages`).
The CPU's kernels run: scaled-dot-product attention takes the CPU's flash kernel, which keeps what the CUDA one
keeps (the output and a row's log-sum-exp); autocast is the CPU's.
Private torch API used (torch 2.13): `torch.testing._internal.distributed.fake_pg.FakeStore`; FSDP2's
`_fully_shard._fsdp_param.alloc_storage`/`free_storage` (and `_fsdp_param_group`'s import of the first); DTensor's
`_sharding_prop.ShardingPropagator._propagate_tensor_meta_non_cached`, wrapped to leave its shape inference out;
torch's pipelining `schedules._PipelineSchedule._warmup_p2p`, replaced while tracing, and `_utils.InferenceMode`,
`_StageMeta`, `extract_tensor_metas`, with which a stage is given its shapes (`_static_stages`).
"""
from __future__ import annotations

import contextlib
import sys
import warnings
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensor, \
    FakeTensorMode
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from plandsl import ir
from plandsl.diagnostics import Diagnostic, diag
from plandsl.cost.allocator import Replay, replay
from plandsl.cost.memory import MemoryEstimate
from plandsl.ir.layers import layers_of
from plandsl.lower.units import format_bytes
from plandsl.runtime import train
from plandsl.runtime.dryrun import _ddp_on_meta, _forget_rank, _predicted
from plandsl.runtime.faults import mesh_coordinate
from plandsl.runtime.models import build_model
from plandsl.runtime.torch_model import ModelError
from plandsl.runtime.precision import DTYPES
from plandsl.runtime.parallel.mesh import build_mesh

MAX_EVENTS = 4_000_000
"""The most allocations and frees one trace records (about 100 bytes each here; a few thousand a second): a plan whose
step makes more (very many microbatches or layers) is refused rather than traced without bound."""
EVENTS_PER_BLOCK_PASS = 2 * 400
"""What `traceable` reckons a block's forward and backward of one microbatch make, for the two steps a trace runs
(llama's and gpt's blocks make 150-300 here, with recomputation and FSDP's gathers): a plan past `MAX_EVENTS` by it
is refused before anything runs."""


class TraceError(RuntimeError):
    """The plan's step cannot be run on fake tensors, or is too long to trace; one line."""


@dataclass(frozen=True)
class MemoryTrace:
    """A rank's build and steps: `events` in order, each allocation under a key of its own; `steps[i]` the index of
    the first event of step i; `labels[key]` the operator that made the allocation, with its first tensor's shape
    and dtype."""

    plan: str
    rank: int
    events: tuple[tuple[int, int, int], ...]   # (+1 alloc | -1 free, key, bytes)
    steps: tuple[int, ...]
    labels: dict[int, str]

    def live_before(self, index: int) -> dict[int, int]:
        """The storages alive before event `index`, with their bytes."""
        live: dict[int, int] = {}
        for op, key, size in self.events[:index]:
            if op > 0:
                live[key] = size
            else:
                live.pop(key, None)
        return live

    def largest(self, index: int, count: int = 8) -> list[tuple[int, str]]:
        """The `count` largest storages alive after event `index`: (bytes, label)."""
        live = self.live_before(index + 1)
        return sorted(((size, self.labels.get(key, "?")) for key, size in live.items()), reverse=True)[:count]

    def peak_allocated(self, start: int = 0) -> tuple[int, int]:
        """(bytes, event index) of the most alive at once from event `start` on."""
        now = sum(self.live_before(start).values())
        peak, at = now, start
        for index in range(start, len(self.events)):
            op, _, size = self.events[index]
            now += size if op > 0 else -size
            if now > peak:
                peak, at = now, index
        return peak, at


class _Recorder(TorchDispatchMode):
    """Records the storage of every fake tensor an operator returns, and its end."""

    def __init__(self, fake: bool = True):
        super().__init__()
        self.kind = FakeTensor if fake else torch.Tensor  # what is device memory: fake tensors, or (a real run) all
        self.events: list[tuple[int, int, int]] = []
        self.live: dict[int, list[int]] = {}   # id(storage) -> [serial, bytes now (0: FSDP resized it away)]
        self.labels: dict[int, str] = {}     # serial -> the first tensor seen on the storage
        self.serial = 0
        self.full = False  # MAX_EVENTS reached
        self.paused = 0    # inside DTensor's shape inference: its tensors are no allocation of the run

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.check()
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, DTensor):  # its handler ran the local op with this mode off: the local result
                leaf = leaf._local_tensor
            if isinstance(leaf, self.kind) and leaf.device.type != "meta":
                self.see(leaf, func.__name__)
        return out

    def see(self, tensor: torch.Tensor, label: str) -> None:
        if self.paused:
            return
        storage = tensor.untyped_storage()
        key = id(storage)  # a storage keeps its Python object while it lives: the id is the storage's till then
        if key in self.live:
            return
        self.serial += 1
        size = storage.nbytes()
        self.live[key] = [self.serial, size]
        self.labels[self.serial] = f"{label}{list(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')}"
        if size:
            self._add(1, self.serial, size)
        weakref.finalize(storage, self._gone, key)

    def _gone(self, key: int) -> None:
        serial, size = self.live.pop(key, (0, 0))
        if size:
            self._add(-1, serial, size)

    def resized(self, tensor: torch.Tensor, before: int) -> None:
        """FSDP2 or `runtime.discard` resized `tensor`'s storage from `before` bytes: an allocation or a free."""
        storage = tensor.untyped_storage()
        key, after = id(storage), storage.nbytes()
        if key not in self.live:
            if isinstance(tensor, self.kind):
                self.see(tensor, "unsharded")
            return
        self.sized(tensor, after, before)

    def sized(self, tensor: torch.Tensor, after: int, before: int | None = None) -> None:
        """`tensor`'s storage holds `after` bytes now (`before` before: what the recorder last knew, by default): an
        allocation, a free or nothing. A storage the recorder never saw is left alone."""
        entry = self.live.get(id(tensor.untyped_storage()))
        if entry is None:
            return
        before = entry[1] if before is None else before
        if before and not after:
            self._add(-1, entry[0], entry[1])
        elif after and not before:
            self.serial += 1  # a new allocation in the same storage object
            self.labels[self.serial] = self.labels[entry[0]]
            entry[0] = self.serial
            self._add(1, entry[0], after)
        entry[1] = after

    def _add(self, op: int, key: int, size: int) -> None:
        if len(self.events) >= MAX_EVENTS:  # raised by the next operator (a free's callback cannot raise)
            self.full = True
            return
        self.events.append((op, key, size))

    def check(self) -> None:
        if self.full:
            raise TraceError(f"the step makes more than {MAX_EVENTS:,} allocations and frees; not traced further")


class _RecordingFakeMode(FakeTensorMode):
    """The fake mode itself records: every operator on fake tensors reaches it, also those a tensor subclass runs
    inside its own handler (DTensor's local operators: loss parallel's temporaries, a redistribution's buffers,
    the optimizer's steps on shards), where no dispatch mode above sees them."""

    def __init__(self, recorder: _Recorder):
        super().__init__(allow_non_fake_inputs=True)
        self.recorder = recorder
        self.depth = 0

    def __deepcopy__(self, memo):  # a pipeline stage is a deep copy of the model (`pipeline.split_stage`): its fake
        return self                # tensors must stay in this mode, recorded here, not in a copy of the recorder

    def dispatch(self, func, types, args=(), kwargs=None):
        if not self.depth and func.namespace == "aten":  # raised where Python called: not from inside torch's C++
            self.recorder.check()
        self.depth += 1
        try:
            out = super().dispatch(func, types, args, kwargs)
        finally:
            self.depth -= 1
        if self.depth or func.is_view:  # an operator the fake mode runs to compute another's result (a decomposition's
            return out  # steps, which a device kernel does not allocate), or a view (it allocates nothing; a fake view
        # of a parameter made outside the mode can come back on a storage object of its own)
        for leaf in tree_leaves(out):  # not DTensor's meta tensors of global shapes (its sharding propagation's)
            if isinstance(leaf, FakeTensor) and leaf.device.type != "meta":
                self.recorder.see(leaf, func.__name__)
        return out


@contextlib.contextmanager
def recording(fake: bool = True):
    """A recorder of the storages tensors take (`fake`: only fake tensors'; else every tensor's, as in a real run on
    this machine, which the tests compare with a trace): enter it as a dispatch mode around what to record, above any
    fake mode; its `events` and `labels` are a `MemoryTrace`'s. FSDP2's resizes are recorded while this is open."""
    recorder = _Recorder(fake)
    with _fsdp_resizes(recorder), _discard_resizes(recorder), _shape_inference(recorder):
        yield recorder


@contextlib.contextmanager
def _shape_inference(recorder: _Recorder):
    """DTensor infers an operator's output shapes by running it on fake tensors of the global shapes, under the fake
    mode of the moment (`ShardingPropagator._propagate_tensor_meta_non_cached`): not the run's tensors, so the
    recorder pauses there."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator  # torch internals (module docstring)
    infer = ShardingPropagator._propagate_tensor_meta_non_cached

    def paused(self, *args, **kwargs):
        recorder.paused += 1
        try:
            return infer(self, *args, **kwargs)
        finally:
            recorder.paused -= 1

    ShardingPropagator._propagate_tensor_meta_non_cached = paused
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = infer


@contextlib.contextmanager
def _discard_resizes(recorder: _Recorder):
    """Recomputation modules that run without output (`runtime.discard`: `recompute_modules` mla_up_proj, layernorm,
    moe_act) free their outputs' storage after the layer that reads them and refill it in the backward by resizing
    it, which no operator shows: both wrapped while tracing."""
    from plandsl.runtime import discard  # the interpreter's own (lazy as the FSDP internals above: tracing only)
    free, refill = discard.free_storage, discard.refill_storage
    # On fake tensors nothing is resized, only recorded: a fake storage resized away and back is never released when
    # its tensors die (no free would follow), and a fake tensor's values are none to keep
    fake = recorder.kind is not torch.Tensor

    def free_storage(output):
        local = discard.local_tensor(output)
        before = local.untyped_storage().nbytes()
        if not fake:
            free(output)
        recorder.sized(local, 0, before)

    def refill_storage(output, again):
        local = discard.local_tensor(output)
        if not fake:
            refill(output, again)
        recorder.sized(local, discard.local_tensor(again).untyped_storage().nbytes(), 0)

    discard.free_storage, discard.refill_storage = free_storage, refill_storage
    try:
        yield
    finally:
        discard.free_storage, discard.refill_storage = free, refill


@contextlib.contextmanager
def _fsdp_resizes(recorder: _Recorder):
    """FSDP2 allocates and frees the unsharded parameters by resizing their storages (`alloc_storage`,
    `free_storage`), which no operator shows: both wrapped while tracing."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group  # torch internals (above)
    alloc, free = _fsdp_param.alloc_storage, _fsdp_param.free_storage

    def alloc_storage(tensor):
        before = tensor.untyped_storage().nbytes()
        alloc(tensor)
        recorder.resized(tensor, before)

    def free_storage(tensor):
        before = tensor.untyped_storage().nbytes()
        free(tensor)
        recorder.resized(tensor, before)

    _fsdp_param.alloc_storage = _fsdp_param_group.alloc_storage = alloc_storage
    _fsdp_param.free_storage = free_storage
    try:
        yield
    finally:
        _fsdp_param.alloc_storage = _fsdp_param_group.alloc_storage = alloc
        _fsdp_param.free_storage = free


@contextlib.contextmanager
def _static_stages(plan: ir.Plan, recorder: _Recorder):
    """torch's pipeline stages, built without example tensors, learn their shapes at the first step from what their
    neighbours send (a vote and metadata over point-to-point, `_PipelineSchedule._warmup_p2p` and the metadata
    inference after it), which a fake process group does not carry. Here each stage is given its shapes instead and
    runs in torch's static mode: a stage's input is the microbatch's token ids (the first stage) or the residual
    stream the blocks pass on (FSDP's gather dtype where it gathers, else `precision.keep_stream`'s: the compute dtype
    at 16 bits, else the weights'), [micro batch,
    sequence / cp (/ tp under sequence parallelism), hidden]; its output is what its module returns for that input,
    run once here with the recorder paused. A built-in transformer's stages only (`traceable`)."""
    # lazy: torch's pipelining takes seconds to import, and only a pipelined plan needs it; torch internals (docstring)
    from torch.distributed.pipelining import schedules  # lazy (above)
    from torch.distributed.pipelining._utils import InferenceMode, _StageMeta, extract_tensor_metas  # lazy (above)
    warmup = schedules._PipelineSchedule._warmup_p2p
    train_ = plan.train
    stream = DTYPES[plan.run_gather] if plan.run_gather is not None \
        else DTYPES[train_.precision] if train_.precision in (ir.Precision.bf16, ir.Precision.fp16) \
        else DTYPES[train_.weights_dtype]  # FSDP casts each unit's input to the gathered dtype (`cast_forward_inputs`)
    seq = plan.seq // plan.cp
    if plan.tensor is not None and plan.tp > 1 and plan.tensor.sequence_parallel:
        seq //= plan.tp

    def static(self, stages, has_backward, p2p_done):
        for stage in stages:
            if stage.is_first:
                example = torch.zeros(train_.micro_batch, plan.seq // plan.cp, dtype=torch.long)
            else:
                example = torch.zeros(train_.micro_batch, seq, plan.model.hidden, dtype=stream, requires_grad=True)
            recorder.paused += 1
            try:
                out = stage.submod(example)
            finally:
                recorder.paused -= 1
            outputs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
            grads = tuple(o.detach() for o in outputs)
            stage._user_meta = _StageMeta(inputs=extract_tensor_metas((example,)),
                                          outputs=extract_tensor_metas(grads),
                                          input_grads=None if stage.is_first else extract_tensor_metas((example,)),
                                          output_grads=extract_tensor_metas(grads))
            stage._inference_mode = InferenceMode.STATIC

    schedules._PipelineSchedule._warmup_p2p = static
    try:
        yield
    finally:
        schedules._PipelineSchedule._warmup_p2p = warmup


TRACE_HINT = ("`plandsl run --dry-run` without --memory and `plandsl estimate` still count its memory (the cost "
              "model's); the trace runs plans whose steps read no values from their data")


def trace_refusal(plan: ir.Plan, why: str) -> Diagnostic:
    """E709 at the plan: its steps cannot run on fake tensors (`why`, `traceable`'s or a `TraceError`'s)."""
    why = why.removeprefix("cannot be traced: ")
    return diag("E709", f"plan '{plan.name}' cannot be traced on fake tensors (`run --dry-run --memory`): {why}",
                plan.span, hint=TRACE_HINT)


def trace_refusals(plan: ir.Plan) -> list[Diagnostic]:
    """What `run --dry-run --memory` refuses before tracing (`traceable`): E709, or nothing."""
    why = traceable(plan)
    return [] if why is None else [trace_refusal(plan, why)]


def traceable(plan: ir.Plan) -> str | None:
    """Why `plan`'s step cannot run on fake tensors (what it reads from the data), or None."""
    if plan.stages is not None and not isinstance(plan.model, ir.TransformerModel):
        return ("a pipeline of a model other than a built-in transformer: its stages learn their shapes at the first "
                "step from what their neighbours send, which a fake process group does not carry")
    if plan.experts is not None or getattr(plan.model, "experts", 0):
        return "a mixture of experts routes each token by its values, which fake tensors do not have"
    if plan.train.precision is ir.Precision.fp16:
        return "fp16's loss scaling reads the gradients to skip a step"
    if plan.train.loss is ir.Loss.fused:
        return "`loss: fused` finds this rank's targets by their values"
    passes = plan.num_microbatches * sum(1 for layer in layers_of(plan.model) if layer.kind in ("block", "custom"))
    if passes * EVENTS_PER_BLOCK_PASS > MAX_EVENTS:
        return (f"{plan.num_microbatches:,} microbatches a step through {passes // max(plan.num_microbatches, 1):,} "
                f"blocks would make about {passes * EVENTS_PER_BLOCK_PASS:,} allocations and frees, past the "
                f"{MAX_EVENTS:,} a trace records")
    return None


def trace_rank(plan: ir.Plan, rank: int = 0, steps: int = 2, progress=None) -> MemoryTrace:
    """`rank`'s build and `steps` training steps on fake tensors (module docstring); `progress(done, steps)` after
    each step. FP8 plans run their 16-bit precision: the interpreter does not run FP8 (`plandsl run` refuses it)."""
    why = traceable(plan)
    if why is not None:
        raise TraceError(f"cannot be traced: {why}")
    if dist.is_initialized():
        raise RuntimeError("a memory trace joins a fake process group of its own; this process already belongs to a "
                           "process group")
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if plan.train.precision is ir.Precision.fp8:
        plan = plan.model_copy(update={"train": plan.train.model_copy(update={"precision": ir.Precision.bf16})})
    def make_model():
        with fake:
            try:
                return build_model(plan.model, plan.train.seed)
            except ModelError as error:  # a model from torch whose construction reads values (ViT's initialisation)
                raise TraceError(f"cannot be traced: the model cannot be built on fake tensors ({error})") from None

    hook = sys.excepthook  # init_process_group wraps it ("[rankN]: " on each line), once per call
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=plan.mesh.size)
    marks = []
    try:
        mesh = build_mesh(plan, torch.device("cpu"))
        with recording() as recorder, _ddp_on_meta(), _static_stages(plan, recorder), warnings.catch_warnings():
            # torch's pipelining reads a tensor's data pointer (to tell its buffers apart): a fake one has none
            warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
            fake = _RecordingFakeMode(recorder)  # ops on its tensors reach it, inside its context or not
            job = train.build_job(plan, mesh, torch.device("cpu"), train.RunConfig(steps=steps, quiet=True),
                                  make_model=make_model)
            if any(isinstance(part, DistributedDataParallel) for part in job.parts):
                raise TraceError("cannot be traced: DistributedDataParallel's reducer reads its "
                                 "gradient buckets' order from the ranks at the second step")
            with fake:
                for step in range(steps):
                    marks.append(len(recorder.events))
                    train.train_step(job, step, report=False)
                    if progress is not None:
                        progress(step + 1, steps)
            del job
        recorder.check()
    except (DataDependentOutputException, DynamicOutputShapeException) as error:
        raise TraceError(f"cannot be traced: its step reads values from the data "
                         f"({error.func})") from None
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook
        _forget_rank()
    return MemoryTrace(plan.name, rank, tuple(recorder.events), tuple(marks), dict(recorder.labels))


@dataclass(frozen=True)
class TracedMemory:
    """A rank's traced steps replayed through the caching allocator's model, from the first step on (the states the
    build left placed first: `plandsl run` builds a factory's model whole before sharding it, and fills a built-in
    family's or a Hugging Face model's shards with one full parameter at a time beside them, `models.materialize`: a
    peak of its own that is not the step's). `peak_allocated`: the most bytes of tensors alive at once; `largest`: the largest alive then;
    `expandable`, `classic`: the allocator with `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` and with its
    default segments; `predicted`: the cost model's count for the rank (`cost.estimate`), None where it has none."""

    trace: MemoryTrace
    peak_allocated: int
    peak_step: int
    largest: tuple[tuple[int, str], ...]
    expandable: Replay
    classic: Replay
    predicted: MemoryEstimate | None
    fp8: bool = False  # the plan trains in FP8, traced in its 16-bit precision

    def to_json(self) -> dict:
        return {"plan": self.trace.plan, "rank": self.trace.rank, "steps": len(self.trace.steps),
                "events": len(self.trace.events), "peak_allocated_bytes": self.peak_allocated,
                "peak_step": self.peak_step,
                "largest": [{"bytes": size, "tensor": label} for size, label in self.largest],
                "reserved_bytes": {"expandable_segments": self.expandable.peak_reserved,
                                   "segments": self.classic.peak_reserved},
                "predicted_bytes": None if self.predicted is None else self.predicted.total}


def traced_memory(plan: ir.Plan, rank: int = 0, steps: int = 2, progress=None) -> TracedMemory:
    """`trace_rank`, replayed through `cost.allocator` both ways, beside the cost model's count for the rank."""
    trace = trace_rank(plan, rank, steps, progress)
    start = trace.steps[0]
    placed = [(1, key, size) for key, size in trace.live_before(start).items()]
    events = placed + list(trace.events[start:])
    peak, at = trace.peak_allocated(start)
    step = max(index for index, first in enumerate(trace.steps) if first <= at) if at >= start else 0
    return TracedMemory(trace, peak, step, tuple(trace.largest(at)), replay(events, expandable=True),
                        replay(events, expandable=False), _predicted_for(plan, rank),
                        fp8=plan.train.precision is ir.Precision.fp8)


def _predicted_for(plan: ir.Plan, rank: int) -> MemoryEstimate | None:
    """The cost model's count for `rank`'s pipeline rank, as the dry run shows it (`dryrun._predicted`)."""
    memory = _predicted(plan)
    stage = mesh_coordinate(plan, rank)[plan.stages.axis] if plan.stages is not None else 0
    return memory[stage] if memory and stage < len(memory) else None


def format_traced_memory(result: TracedMemory) -> str:
    trace, gib = result.trace, format_bytes
    lines = [f"memory of rank {trace.rank}, traced: {len(trace.steps)} training steps of plan '{trace.plan}' run on "
             f"fake tensors ({len(trace.events):,} allocations and frees), replayed through torch's caching allocator "
             "(`cost.allocator`)",
             f"  tensors, at most alive at once:  {gib(result.peak_allocated)} (step {result.peak_step + 1})"
             + (f"; the cost model counts {gib(result.predicted.total)} for this rank" if result.predicted else ""),
             f"  reserved, expandable segments:   {gib(result.expandable.peak_reserved)}"
             "  (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)",
             f"  reserved, segments:              {gib(result.classic.peak_reserved)}  (torch's default)"]
    own = [gib(replayed.peak_reserved - result.peak_allocated) for replayed in (result.expandable, result.classic)]
    lines.append(f"  the allocator's own (reserved beyond the tensors): {own[0]} with expandable segments, {own[1]} "
                 "without: blocks freed where no later request fitted, segments and pages rounded up")
    lines.append("  largest tensors alive at the most: " + "; ".join(f"{gib(size)} {label}"
                                                                      for size, label in result.largest[:6]))
    lines.append("  not traced: the CUDA context, NCCL's buffers and symmetric memory (outside the allocator), "
                 "an operator's own workspace" + ("; FP8, which `plandsl run` does not run (traced in bf16)"
                                                  if result.fp8 else ""))
    return "\n".join(lines)


__all__ = ["TracedMemory", "traced_memory", "format_traced_memory", "MemoryTrace", "recording", "TraceError", "trace_rank", "traceable", "MAX_EVENTS"]
