"""Checkpoints of `plandsl run`: torch.distributed.checkpoint (DCP) shards plus plandsl's record of the plan.

Stage: interpreter (every rank calls `save` and `restore`; both are collective). Contract: `save(job,
directory, step, steps)` writes `directory/step-NNNNNN` and commits it by renaming a finished temporary
directory, so a job dying mid-write never leaves a half-written checkpoint as the latest; `latest`
finds the highest committed step (`runtime.resume`, without torch, as the launcher reads it); `restore` loads the
latest into any layout of the same model and optimizer (DCP reshards by parameter name) and raises `CheckpointError`
(one line, `runtime.resume.refusal` makes it E721) for any other.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)
from torch.distributed.optim import ZeroRedundancyOptimizer

from plandsl import ir
from plandsl.runtime.parallel.zero import Zero1Optimizer
from plandsl.runtime.resume import FORMAT, RECORD, CheckpointError, check_compatible, latest, read_record, step_dir

# Optimizer state keyed `state.<fqn>.exp_avg`, `param_groups.<fqn>.lr`: ranks holding different
# parameters (pipeline stages, ZeRO-1 partitions) then write disjoint keys (torchtitan's choice).
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def plan_hash(plan: ir.Plan) -> str:
    """sha256 of the plan's IR (its JSON dump; source positions are not part of it)."""
    return hashlib.sha256(plan.model_dump_json().encode()).hexdigest()


def is_due(step: int, every: int | None, steps: int) -> bool:
    """Save after step `step` (1-based): every `every` steps, and after the run's last step."""
    return step == steps or (every is not None and step % every == 0)


# ---- state ----------------------------------------------------------------------------
TWIN = "~copy"
"""What a second copy of a module on one rank is held under (`_union`): `embed~copy.tok.weight`."""


def _union(models: list[nn.Module]) -> nn.Module:
    """One module holding every model part of this rank under its catalogue name.

    A pipeline rank holds one copy of the model per stage, each without the other stages' top-level
    modules; `layers` dicts are merged, so `layers.3.attn.wq.weight` keeps its name. A rank holding the first
    stage and the last of a model with multi-token prediction holds two copies of `embed`, kept equal
    (`pipeline.TiedEmbeddings`): the last stage's is held as `embed~copy` (`TWIN`), never saved, and restored
    from the embedding's entries (`_aliases`)."""
    if len(models) == 1:
        return models[0]
    union = nn.Module()
    for model in models:
        for name, buffer in model.named_buffers(recurse=False):  # a model from torch's root buffers (`TorchModel`)
            if name not in union._buffers:
                union.register_buffer(name, buffer, persistent=name not in model._non_persistent_buffers_set)
        for name, child in model.named_children():
            held = union._modules.get(name)
            if held is None:
                union.add_module(name, nn.ModuleDict(child) if isinstance(child, nn.ModuleDict) else child)
            elif isinstance(held, nn.ModuleDict) and isinstance(child, nn.ModuleDict):
                held.update(child)
            elif name == "embed" and name + TWIN not in union._modules:
                union._modules[name + TWIN] = child  # add_module refuses the name, which no attribute can have
            elif held is not child:
                union._modules[name] = _merged(name, held, child)
    return union


def _holds_parameters(module: nn.Module, recurse: bool = True) -> bool:
    return next(iter(module.parameters(recurse=recurse)), None) is not None


def _merged(name: str, held: nn.Module, child: nn.Module) -> nn.Module:
    """Two stages' modules of one name, merged: a model from torch's stages are each the whole module with the other
    stages' parts replaced by stand-ins holding nothing (`runtime.inspect.stages`) or cut out by torch's pipeline
    frontend, so the union takes the module that holds parameters, and merges, into a new container, the children of
    two that both hold some; two holding parameters of their own are two copies of one module, which no stage split
    makes but a tied module's (`_union`)."""
    if held is child or not _holds_parameters(child):
        return held
    if not _holds_parameters(held):
        return child
    if _holds_parameters(held, recurse=False) or _holds_parameters(child, recurse=False):
        raise RuntimeError(f"two pipeline stages on this rank both hold module '{name}'")  # a plandsl bug
    merged = nn.Module()
    for part in (held, child):
        for key, sub in part.named_children():
            found = merged._modules.get(key)
            merged._modules[key] = sub if found is None else _merged(f"{name}.{key}", found, sub)
    return merged


def _saved(state: dict[str, Any]) -> dict[str, Any]:
    """The state without a second copy's entries (`TWIN`), which equal the first's."""
    return {section: {key: value for key, value in entries.items() if TWIN not in key}
            for section, entries in state.items()}


def _optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer whose state this rank holds: ZeRO-1's local one over this rank's partition."""
    return optimizer.optim if isinstance(optimizer, (ZeroRedundancyOptimizer, Zero1Optimizer)) else optimizer


def _state(job) -> tuple[nn.Module, torch.optim.Optimizer, dict[str, Any]]:
    model, optimizer = _union(job.models), _optimizer(job.optimizer)
    if not _steps_anything(optimizer):  # ZeRO-1 with more ranks than tensors: this rank owns none
        return model, optimizer, {"model": get_model_state_dict(model, options=_OPTIONS), "optimizer": {}}
    model_state, optimizer_state = get_state_dict(model, optimizer, options=_OPTIONS)
    return model, optimizer, {"model": model_state, "optimizer": optimizer_state}


def _steps_anything(optimizer: torch.optim.Optimizer) -> bool:
    """torch's get_state_dict and set_state_dict refuse an optimizer without parameters."""
    return any(group["params"] for group in optimizer.param_groups)


def fingerprint(model_state: dict[str, Any]) -> dict[str, list[int]]:
    """Every tensor of the model, by name, with its full shape, gathered over the ranks (collective:
    a pipeline rank holds only its stages; a DTensor's shape is already the global one)."""
    local = {name: list(value.shape) for name, value in model_state.items() if isinstance(value, torch.Tensor)}
    gathered: list[dict] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, local)
    merged: dict[str, list[int]] = {}
    for shapes in gathered:
        merged.update(shapes)
    return dict(sorted(merged.items()))


# ---- save -----------------------------------------------------------------------------
def save(job, directory: str | Path, step: int, steps: int) -> Path:
    """Write the job's state after `step` steps of a `steps`-step run; every rank calls it."""
    final = step_dir(directory, step)
    partial = final.with_name(final.name + ".partial")
    _, _, state = _state(job)
    state = _saved(state)
    shapes = fingerprint(state["model"])
    rank0 = dist.get_rank() == 0
    if rank0:
        final.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)  # left by a job that died while writing
    dist.barrier()
    dcp.save(state, checkpoint_id=partial)  # returns on every rank once every shard and DCP's metadata are written
    if rank0:
        plan = job.plan
        record = {"format": FORMAT, "step": step, "steps": steps, "plan": plan.name, "plan_hash": plan_hash(plan),
                  "optimizer": plan.train.optimizer.value, "lr_schedule": plan.train.lr_schedule,
                  "scheduler": _jsonable(job.scheduler.state_dict()), "loss_scale": _loss_scale(job),
                  "world_size": dist.get_world_size(),
                  "torch": torch.__version__, "model": shapes}
        _write_durably(partial / RECORD, json.dumps(record, indent=1))
        commit(partial, final)
    dist.barrier()  # nobody goes on (or exits) before the checkpoint is committed
    return final


def _loss_scale(job) -> dict | None:
    """fp16's dynamic loss scale (`precision.LossScaler`); None without one."""
    scaler = getattr(job, "scaler", None)
    return scaler.state_dict() if scaler is not None and scaler.enabled else None


def commit(partial: Path, final: Path) -> None:
    """Make the finished `partial` directory the checkpoint `final` by renames only: a crash at any point
    leaves either the old complete `final`, or no `final` (the previous step is then the latest)."""
    old = final.with_name(final.name + ".old")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(partial, final)
    _fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def _write_durably(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _jsonable(state: dict) -> dict:
    return {key: value for key, value in state.items() if _is_json(value)}


def _is_json(value) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


# ---- restore --------------------------------------------------------------------------
@dataclass(frozen=True)
class Restored:
    step: int
    """Steps done before this run (0: no checkpoint found)."""
    note: str
    """What rank 0 tells the user."""


def restore(job, directory: str | Path, steps: int) -> Restored:
    """Load the latest checkpoint of `directory` into `job` (every rank calls it); the step it reached.

    Rank 0 picks the checkpoint and reads its record, so every rank takes the same decision; a
    checkpoint of another model or optimizer raises CheckpointError on every rank, before any load."""
    path, record = _pick(directory)
    if path is None:
        return Restored(0, f"--resume: no checkpoint in {directory}: starting at step 1")
    model, optimizer, state = _state(job)
    check_compatible(record, job.plan, fingerprint(_saved(state)["model"]), path)
    _load(state, path, tied=getattr(job.plan.model, "tied_embeddings", False))
    if _steps_anything(optimizer):
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                       options=_OPTIONS)
    else:
        set_model_state_dict(model, state["model"], options=_OPTIONS)
    _restore_schedule(job.scheduler, job.optimizer, record)
    scaler = getattr(job, "scaler", None)
    if record.get("loss_scale") and scaler is not None and scaler.enabled:
        scaler.load_state_dict(record["loss_scale"])  # fp16: the scale and its growth count go on
    return Restored(record["step"], _resume_note(record, job.plan, steps, path))


def _load(state: dict[str, Any], path: Path, tied: bool) -> None:
    """DCP's load into this job's shards (each rank reads the pieces it needs).

    A tied head saved in the same module as the embedding (one stage, or no pipeline) has optimizer
    state only under `embed.tok.weight`; a plan that puts the head on another stage holds its own copy
    (`pipeline.TiedEmbeddings`), whose state is then read from the embedding's entries; a second copy of the
    embedding (`TWIN`) reads its parameters and state from the embedding's likewise."""
    saved = set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    aliases = {section: _aliases(entries, section, saved, tied) for section, entries in state.items()}
    if not any(aliases.values()):
        dcp.load(state, checkpoint_id=path)
        return
    loading = {section: {key: value for key, value in entries.items() if key not in aliases[section]}
               for section, entries in state.items()}
    for section, pairs in aliases.items():
        for key, twin in pairs.items():
            loading[section].setdefault(twin, state[section][key])  # only the copy here: load into its tensors
    dcp.load(loading, checkpoint_id=path)
    for section, entries in state.items():
        for key, twin in aliases[section].items():
            value = loading[section][twin]
            entries[key] = value.clone() if twin in entries and isinstance(value, torch.Tensor) else value
        for key in entries.keys() - aliases[section].keys():
            entries[key] = loading[section][key]


def _aliases(entries: dict[str, Any], section: str, saved: set[str], tied: bool) -> dict[str, str]:
    """This rank's keys of `section` ("model" or "optimizer") that the checkpoint lacks -> the embedding's keys
    holding their values: a tied head copy's optimizer state, a second copy's (`TWIN`) parameters and state."""
    aliases = {}
    for key in entries:
        if f"{section}.{key}" in saved:
            continue
        candidate = key.replace(TWIN, "")
        if tied and section == "optimizer":
            for part in ("state.", "param_groups."):
                head, embed = part + "head.weight.", part + "embed.tok.weight."
                if key.startswith(head):
                    candidate = embed + key[len(head):]
        if candidate != key and f"{section}.{candidate}" in saved:
            aliases[key] = candidate
    return aliases


def _pick(directory: str | Path) -> tuple[Path | None, dict | None]:
    """Rank 0's latest checkpoint and its record, the same on every rank (its error too: every rank refuses alike)."""
    chosen: list = [None, None, None]
    if dist.get_rank() == 0:
        try:
            path = latest(directory)
            chosen = [None if path is None else str(path), None if path is None else read_record(path), None]
        except CheckpointError as error:
            chosen = [None, None, (str(error), error.part)]
    dist.broadcast_object_list(chosen, src=0)
    path, record, error = chosen
    if error is not None:
        raise CheckpointError(*error)
    return (None if path is None else Path(path)), record


def _restore_schedule(scheduler, optimizer: torch.optim.Optimizer, record: dict) -> None:
    """The learning rate is a function of the plan and the step: take the checkpoint's step (the
    scheduler's `last_epoch`), keep this plan's base rate, and set the rate of the next step."""
    scheduler.load_state_dict({**record["scheduler"], "base_lrs": scheduler.base_lrs})
    rates = [base * factor(scheduler.last_epoch) for base, factor in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, rate in zip(optimizer.param_groups, rates):
        group["lr"] = rate
    scheduler._last_lr = rates


def _resume_note(record: dict, plan: ir.Plan, steps: int, path: Path) -> str:
    here = plan_hash(plan)
    if record["plan_hash"] == here:
        note = f"resuming from step {record['step']} ({path})"
    else:
        note = (f"resuming from step {record['step']} saved under plan '{record['plan']}' "
                f"({record['plan_hash'][:12]}): resharding to plan '{plan.name}' ({here[:12]})")
    if plan.train.lr_schedule != "constant" and record["steps"] != steps:
        note += (f"\nnote: the {plan.train.lr_schedule} learning-rate schedule decays over --steps; the checkpoint "
                 f"was written by a run of {record['steps']} steps, this run has {steps}")
    return note

