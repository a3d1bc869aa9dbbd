"""`plandsl run --dry-run`: build every rank's share of a plan in this process, on the meta device.

Stage: interpreter, in the launching process (no rank is started, nothing is trained or allocated).
Contract: `dry_run(plan)` joins torch's fake process group once per rank (`FakeStore`: collectives
are no-ops), builds that rank's model, parallelisms and optimizer with the interpreter's own
functions on meta tensors, and returns its parameter, gradient and optimizer-state figures next to
the cost model's prediction (`cost.estimate`); `dry_run_report(plan)` is that as a table.
Private torch API used (torch 2.13): `torch.testing._internal.distributed.fake_pg.FakeStore`,
ZeroRedundancyOptimizer's `_partition_parameters` (every rank's ZeRO-1 partition), and
DistributedDataParallel's `_verify_param_shape_across_processes`, skipped while a rank is built, and
DTensor's sharding-propagation, redistribution and planner caches, cleared after each rank (`_forget_rank`).
"""
from __future__ import annotations

import contextlib
import copy
import itertools
import math
import sys
import traceback
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer

from plandsl import ir
from plandsl.ir.shares import uneven
from plandsl.cost.memory import MemoryEstimate
from plandsl.runtime.parallel.zero import Zero1Optimizer, local as _local  # a DTensor's shard, else the tensor
from plandsl.lower.units import format_bytes
from plandsl.runtime.loss import fused_loss
from plandsl.runtime.models import build_model
from plandsl.runtime.precision import keep_weights
from plandsl.runtime.optim import optimizer_settings
from plandsl.runtime.faults import mesh_coordinate, mesh_rank
from plandsl.runtime.parallel.data_parallel import build_dp_optimizer
from plandsl.runtime.parallel.mesh import build_mesh
from plandsl.runtime.parallel.parallelize import data_mesh, expert_data_mesh, parallelize
from plandsl.cost.estimate import data_shares, estimate_plan
from plandsl.diagnostics import Diagnostic, Note, PlanError, diag
from plandsl.diagnostics.internal import DEBUG, MAX_MESSAGE, debugging

MAX_RANKS = 64  # larger meshes: one rank per distinct (pipeline, tensor) coordinate
META = torch.device("meta")


class DryRunError(RuntimeError):
    """A rank's share could not be built (the real run would fail there too); names the rank (None: the model
    every rank starts from, before any rank's share) and keeps the exception (`cause`). `rank_refusal` is it as
    the user sees it (E716)."""

    def __init__(self, rank: int | None, cause: BaseException):
        super().__init__(f"{'the model' if rank is None else f'rank {rank}'}: {type(cause).__name__}: {cause}")
        self.rank = rank
        self.cause = cause


def rank_refusal(plan: ir.Plan, error: DryRunError) -> Diagnostic:
    """E716 at the plan: a plan that passed `plandsl check` and `run`'s own refusals (E7xx) whose rank `error.rank`
    still cannot be built. Not E108: the same plan fails the same way every time, at the rank named (most likely in
    that rank of the real run too), and the exception may be the model's own code (a factory's, a Hugging Face
    model's) as well as plandsl's."""
    text = " ".join(str(error.cause).split())
    if len(text) > MAX_MESSAGE:
        text = text[:MAX_MESSAGE] + "..."
    what = f"{type(error.cause).__name__}: {text}" if text else type(error.cause).__name__
    notes = [Note("traceback:\n" + "".join(traceback.format_exception(error.cause)).rstrip())] if debugging() else []
    what_fails = f"rank {error.rank}" if error.rank is not None else f"its model '{plan.model.name}'"
    where = plan.span if error.rank is not None else plan.model.span or plan.span  # a factory's fault: the model
    return diag("E716", f"plan '{plan.name}': {what_fails} cannot be built (`run --dry-run`, on the meta "
                        f"device): {what}", where,
                hint="the plan passes `plandsl check` and what `plandsl run` refuses, so its ranks should build: "
                     "where the error comes from the model's own code (a factory, a Hugging Face model) fix it "
                     "there; else it is a bug in plandsl: please report it with the plan file(s) and this message"
                     f"{'' if debugging() else f' ({DEBUG}=1 adds the traceback)'}", notes=notes)


@dataclass(frozen=True)
class RankFigures:
    """One rank as built: element counts, and bytes at the dtype the tensors have (fp32 parameters
    under bf16 autocast)."""

    rank: int
    coordinate: tuple[tuple[str, int], ...]
    stages: tuple[int, ...]        # pipeline stages it holds; () without a pipeline
    parameters: int                # elements of the modules it holds, before sharding
    local_parameters: int          # elements it stores, after tensor and FSDP sharding
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    predicted: MemoryEstimate | None  # the cost model, for its pipeline rank's worst coordinate
    ranks_like_it: int = 1         # ranks this one stands for (meshes over MAX_RANKS)
    most_loaded_optimizer_bytes: int = 0  # ZeRO-1: what the most loaded rank of its data group(s) steps;
    # every rank computes the whole partition, so this is known without building that rank (else = optimizer_bytes)

    @property
    def states_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    def to_json(self) -> dict:
        data = asdict(self)
        data["coordinate"] = dict(self.coordinate)
        data["states_bytes"] = self.states_bytes
        data["predicted"] = None if self.predicted is None else self.predicted.to_json()
        return data


@dataclass(frozen=True)
class DryRun:
    plan: str
    world: int
    ranks: tuple[RankFigures, ...]
    optimizer: str                 # "AdamW, 2 states per element", ...
    summary: str = ""              # how a large mesh was summarised; "" when every rank was built

    def to_json(self) -> dict:
        return {"plan": self.plan, "world": self.world, "optimizer": self.optimizer, "summary": self.summary,
                "ranks": [r.to_json() for r in self.ranks]}


def dry_run(plan: ir.Plan, ranks: list[int] | None = None, progress=None) -> DryRun:
    """Every rank's share (meshes over MAX_RANKS: `representative_ranks`), or only `ranks`; `progress(done,
    total)` is called after each rank is built."""
    if dist.is_initialized():
        raise RuntimeError("a dry run builds every rank with its own fake process group; this process "
                           "already belongs to a process group")
    world = plan.mesh.size
    if ranks is None:
        ranks, summary = representative_ranks(plan)
    else:
        summary = f"built ranks {', '.join(map(str, ranks))} only"
    predicted = _predicted(plan)
    cls, kwargs = optimizer_settings(plan)
    states = _states_per_element(cls, kwargs)
    # state bytes per parameter byte: the states are kept in optimizer_dtype (a master copy in master_dtype),
    # the parameters in param_dtype or master_dtype
    train = plan.train
    state_bytes = (states * train.optimizer_dtype.bytes + (train.master_dtype.bytes if train.master_copy else 0)) \
        / train.weights_dtype.bytes
    try:  # the model's own code (a factory, a Hugging Face model) runs here, before any rank's share
        with META:  # built once: initialising meta tensors costs time and sets nothing
            model = keep_weights(plan, build_model(plan.model, plan.train.seed))
        fused_loss(plan, model)  # `loss: fused`: the head laid out for the loss, as `run` builds it (runtime.loss)
    except Exception as error:  # noqa: BLE001 - every rank would fail here: E716 naming the model, not E108
        raise DryRunError(None, error) from error
    built = []
    for rank in ranks:
        try:
            built.append(_build_rank(plan, copy.deepcopy(model), rank, world, state_bytes, predicted, world // len(ranks)))
        except Exception as error:  # noqa: BLE001 - one message naming the rank, as a running rank reports it
            raise DryRunError(rank, error) from error
        if progress is not None:
            progress(len(built), len(ranks))
    return DryRun(plan.name, world, tuple(built), f"{cls.__name__}, {states} state{'s' if states != 1 else ''} "
                                             "per parameter element", summary)


def representative_ranks(plan: ir.Plan) -> tuple[list[int], str]:
    """Every rank, or for meshes over MAX_RANKS one per (pipeline, tensor) coordinate, the other
    axes at 0 (ranks differing only along data axes hold equal shares, up to uneven FSDP shards and ZeRO-1's
    whole-tensor partitions, whose first rank gets the largest tensor)."""
    world = plan.mesh.size
    if world <= MAX_RANKS:
        return list(range(world)), ""
    kept = [axis.name for axis in plan.mesh.axes
            if axis.name in {plan.stages.axis if plan.stages else None, plan.tensor.axis if plan.tensor else None}]
    sizes = {axis.name: axis.size for axis in plan.mesh.axes}
    if math.prod(sizes[name] for name in kept) > MAX_RANKS:
        kept = [name for name in kept if plan.stages is not None and name == plan.stages.axis]
    zero = {axis.name: 0 for axis in plan.mesh.axes}
    ranks = [mesh_rank(plan, {**zero, **dict(zip(kept, index))})
             for index in itertools.product(*(range(sizes[name]) for name in kept))]
    along = " x ".join(f"'{name}'" for name in kept) or "no axis"
    return ranks, (f"the mesh has {world} devices (over {MAX_RANKS}): built one rank per coordinate along {along}, "
                   f"the other axes at 0; each stands for {world // len(ranks)} ranks (equal shares, up to "
                   "uneven FSDP shards and ZeRO-1's whole-tensor partitions)")


def _build_rank(plan: ir.Plan, model: torch.nn.Module, rank: int, world: int, states: float, predicted,
                like: int) -> RankFigures:
    """`states`: optimizer-state bytes per byte of a stepped parameter."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    hook = sys.excepthook  # init_process_group wraps it ("[rankN]: " on each line), once per call
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        mesh = build_mesh(plan, torch.device("cpu"))
        with _ddp_on_meta():
            if plan.stages is not None:
                # lazy: torch's pipelining takes seconds to import; only a pipelined plan needs it
                from plandsl.runtime.parallel.pipeline import build_pipeline
                shares = data_shares(plan) if uneven(plan) else None  # any replica's count builds the same stages
                pipeline = build_pipeline(plan, model, mesh, META,
                                          microbatches=max(shares) // plan.train.micro_batch if shares else None)
                models, stages = pipeline.models, pipeline.stage_indices
            else:
                parallelize(plan, model, mesh, META)
                models, stages = [model], ()
        params = list({id(p): p for part in models for p in part.parameters()}.values())
        optimizer = build_dp_optimizer(plan, models, data_mesh(plan, mesh), expert_data_mesh(plan, mesh))
        local_optimizer = getattr(optimizer, "optim", optimizer)  # ZeRO-1: this rank's partition
        stepped = [p for group in local_optimizer.param_groups for p in group["params"]]
        most_loaded = round(states * _most_loaded_partition(optimizer, sum(_bytes(p) for p in stepped)))
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook
        _forget_rank()
    local = sum(_local(p).numel() for p in params)
    param_bytes = sum(_bytes(p) for p in params)
    grad_bytes = sum(_bytes(p) for p in params if p.requires_grad)
    coordinate = tuple(mesh_coordinate(plan, rank).items())
    pipeline_rank = dict(coordinate)[plan.stages.axis] if plan.stages is not None else 0
    return RankFigures(rank, coordinate, tuple(stages), sum(p.numel() for p in params), local, param_bytes,
                       grad_bytes, round(states * sum(_bytes(p) for p in stepped)),
                       predicted[pipeline_rank] if predicted else None, like, most_loaded)


def _most_loaded_partition(optimizer: torch.optim.Optimizer, own: int) -> int:
    """Parameter bytes the most loaded rank of each ZeRO-1 group steps, summed over the groups (`own`, what
    this rank steps, without ZeRO-1). Both ZeRO-1 optimizers compute every rank's partition on each rank."""

    if isinstance(optimizer, Zero1Optimizer):
        return sum(max(loads) for loads in optimizer.partition_bytes)
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        return max(sum(_bytes(p) for group in groups for p in group["params"])
                   for groups in optimizer._partition_parameters())
    return own


def _forget_rank() -> None:
    """Empty DTensor's caches of sharding propagation and redistribution plans. They are keyed by
    DeviceMesh equality, which ignores the rank, and their entries hold the mesh (with its rank's
    coordinate) or plans computed from it: left filled, the next rank built here, and ranks forked from
    this process later (tests), would get this fake rank's shard offsets (DCP then saves overlapping
    chunks: "Failed to validate global plan")."""
    # torch internals, only for this workaround: a torch without them fails here, not at import
    from torch.distributed.tensor import _redistribute
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache  # torch internals (as above)
    _clear_sharding_prop_cache()
    _redistribute._gen_transform_infos.cache_clear()
    _redistribute.clear_redistribute_planner_cache()  # its planners hold the mesh and read its coordinate


def _bytes(param: torch.Tensor) -> int:
    local = _local(param)
    return local.numel() * local.element_size()


def _states_per_element(cls: type, kwargs: dict) -> int:
    """State tensors the optimizer keeps per parameter, each its shape and dtype: Adam(W) m and v;
    SGD its momentum buffer (none without momentum). The scalar `step` tensors are left out."""
    if issubclass(cls, (torch.optim.Adam, torch.optim.AdamW)):
        return 2
    if issubclass(cls, torch.optim.SGD):
        return 1 if kwargs.get("momentum") else 0
    raise ValueError(f"the dry run does not know the states of {cls.__name__}")


def _predicted(plan: ir.Plan) -> list[MemoryEstimate] | None:
    try:
        return list(estimate_plan(plan).memory)
    except PlanError:
        return None


@contextlib.contextmanager
def _ddp_on_meta():
    """DistributedDataParallel compares parameter shapes across ranks (`.item()` on a count): with
    meta tensors and a fake group there is nothing to compare, so that one check is skipped."""
    # torch internals, only for this workaround: a torch without them fails here, not at import
    import torch.nn.parallel.distributed as ddp
    saved = ddp._verify_param_shape_across_processes
    ddp._verify_param_shape_across_processes = lambda *args, **kwargs: None
    try:
        yield
    finally:
        ddp._verify_param_shape_across_processes = saved


# ---- the text -------------------------------------------------------------------------------------------
_HEAD = ("rank", "mesh", "stages", "parameters", "local", "params", "grads", "optimizer", "states", "|",
         "predicted states", "gathered", "activations", "pipeline", "peak")
PIPELINE_COLUMN = _HEAD.index("pipeline")  # shown where torch's pipeline stage holds buffers (`estimate`'s column)


def dry_run_report(plan: ir.Plan) -> str:
    return format_dry_run(dry_run(plan))


def format_dry_run(result: DryRun) -> str:
    rows = [_HEAD]
    for r in result.ranks:
        p = r.predicted
        rows.append((str(r.rank), ",".join(f"{axis}={index}" for axis, index in r.coordinate),
                     ",".join(map(str, r.stages)) or "-", f"{r.parameters:,}", f"{r.local_parameters:,}",
                     format_bytes(r.param_bytes), format_bytes(r.grad_bytes), format_bytes(r.optimizer_bytes),
                     format_bytes(r.states_bytes), "|",
                     format_bytes(p.stored_states) if p else "-",
                     format_bytes(p.gathered_params + p.gathered_grads) if p else "-",
                     format_bytes(p.activations) if p else "-", format_bytes(p.other) if p else "-",
                     format_bytes(p.total) if p else "-"))
    # torch's pipeline stage's buffers (`cost.memory.torch_stage_bytes`), as `estimate` shows them: where there are
    buffers = any(r.predicted is not None and r.predicted.other for r in result.ranks)
    if not buffers:
        rows = [row[:PIPELINE_COLUMN] + row[PIPELINE_COLUMN + 1:] for row in rows]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    left = {1, 2, 9}
    table = ["  ".join(cell.ljust(w) if i in left else cell.rjust(w) for i, (cell, w) in
                       enumerate(zip(row, widths))).rstrip() for row in rows]
    lines = [f"dry run of plan '{result.plan}': {len(result.ranks)} of {result.world} ranks built on the meta device "
             "with torch's fake process group (nothing trained, no memory allocated)", *table,
             "parameters: elements of the modules a rank holds; local: what it stores after tensor and FSDP "
             "sharding; params, grads: their bytes (gradients shaped like the local parameters)",
             f"optimizer: {result.optimizer} of the parameters it steps (ZeRO-1: its partition of whole tensors), "
             "created at the first step",
             "predicted: the cost model (`plandsl estimate`, `plandsl check`) for the worst rank of the pipeline stage, "
             "at the same dtypes: the states it stores (parameters + gradients + optimizer states, fp32), the "
             "parameters and gradients ZeRO-2/3 hold unsharded while gathering and reducing, the activations of its "
             "in-flight microbatches, "
             + ("what torch's pipeline stage keeps beside the layers (a receive buffer per microbatch for activations "
                "and for gradients, each output until its backward; `plandsl run` runs torch's pipeline), "
                if buffers else "") + "and the peak, their sum"
             + ("" if not any(r.predicted is not None and (r.predicted.apart or r.predicted.moments)
                              for r in result.ranks)
                else " less what of it is never alive at once (`plandsl estimate`'s total: a step of one microbatch's "
                     "gradients not made yet at its peak; ZeRO-2/3's units in a block's backward beside the "
                     "activations at the loss's)")]
    loaded = [r for r in result.ranks if r.most_loaded_optimizer_bytes > r.optimizer_bytes]
    if loaded:
        worst = max(loaded, key=lambda r: r.most_loaded_optimizer_bytes - r.optimizer_bytes)
        lines.append(f"ZeRO-1 gives each tensor whole to one data rank: the most loaded rank of rank {worst.rank}'s "
                     f"data group steps {format_bytes(worst.most_loaded_optimizer_bytes)} of optimizer states, "
                     f"rank {worst.rank} {format_bytes(worst.optimizer_bytes)}; the prediction counts the most loaded")
    if result.summary:
        lines.append(f"note: {result.summary}")
    return "\n".join(lines)
