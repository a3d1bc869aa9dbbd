"""What `--resume` reads before any tensor: the latest committed checkpoint of a folder and plandsl's record of it,
and why a plan cannot resume it (E721).

Stage: interpreter, without torch: the launcher asks `launch_refusal` before it starts any rank (a checkpoint of
another optimizer, of a format this plandsl does not read, or whose record cannot be read is refused there, once,
at the plan), and every rank asks `read_record` and `check_compatible` again (`runtime.checkpoint.restore`, where the
model's shapes are known); `refusal` is the Diagnostic either prints. Contract: `latest(directory) -> Path | None`
looks at no more than `MAX_ENTRIES` entries of the folder; `CheckpointError` is one line, with the part of the plan
it contradicts (`part`).
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

from plandsl import ir
from plandsl.diagnostics import Diagnostic, diag
from plandsl.syntax.files import read_bounded

RECORD = "plandsl.json"   # written last, by rank 0, inside the still-temporary directory
FORMAT = 1
RECORD_LIMIT = 1 << 20  # the record is a few hundred bytes of JSON; a larger one is not ours
MAX_ENTRIES = 1 << 20  # entries of a checkpoint folder looked at: a run writes one per checkpoint it keeps
_STEP_DIR = re.compile(r"step-(\d+)")


class CheckpointError(RuntimeError):
    """The checkpoint cannot be resumed under this plan: a different model or optimizer, or unreadable. `part`:
    the plan's part it contradicts ("model", "optimizer"), or None (the checkpoint itself is at fault)."""

    def __init__(self, message: str, part: str | None = None):
        super().__init__(message)
        self.part = part


def step_dir(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"step-{step:06d}"


def latest(directory: str | Path) -> Path | None:
    """The committed checkpoint of the highest step (`step-NNNNNN` holding a record), or None.
    Temporary directories (`.partial`, `.old`) and directories without a record never count; a folder of
    more than `MAX_ENTRIES` entries is not a run's checkpoints (CheckpointError)."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    found = []
    with os.scandir(directory) as entries:
        for count, entry in enumerate(entries):
            if count >= MAX_ENTRIES:
                raise CheckpointError(f"checkpoint folder {directory} holds more than {MAX_ENTRIES:,} entries; "
                                      "a run writes one folder per checkpoint")
            match = _STEP_DIR.fullmatch(entry.name)
            if match and (directory / entry.name / RECORD).is_file():
                found.append((int(match[1]), directory / entry.name))
    return max(found)[1] if found else None


def read_record(path: Path) -> dict:
    """The record of the checkpoint at `path`; CheckpointError where it cannot be read or is of another format."""
    try:
        record = json.loads(read_bounded(path / RECORD, RECORD_LIMIT, "checkpoint record"))
    except (OSError, ValueError, RecursionError) as error:  # FileProblem and JSONDecodeError are ValueErrors
        raise CheckpointError(f"cannot read checkpoint {path / RECORD}: {error}") from None
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        found = record.get("format") if isinstance(record, dict) else f"a JSON {type(record).__name__}"
        raise CheckpointError(f"checkpoint {path} has format {found}; this plandsl reads {FORMAT}")
    for key, (kind, wanted) in _FIELDS.items():
        if key not in record or not kind(record[key]):
            found = (f"lacks \"{key}\" ({wanted})" if key not in record
                     else f"has {json.dumps(record[key])[:60]} as \"{key}\", not {wanted}")
            raise CheckpointError(f"checkpoint record {path / RECORD} {found}")
    return record


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


# What the ranks read of a record (`runtime.checkpoint.restore`): a record of format 1 without one of them, or with
# one of another type, cannot be resumed (was a KeyError or TypeError in every rank: the job failed).
_FIELDS = {
    "step": (_count, "a step count"), "steps": (_count, "a step count"),
    "plan": (lambda v: isinstance(v, str), "a plan's name"), "plan_hash": (lambda v: isinstance(v, str), "a hash"),
    "optimizer": (lambda v: isinstance(v, str), "an optimizer's name"),
    "model": (lambda v: isinstance(v, dict) and all(isinstance(shape, list) and all(map(_count, shape))
                                                    for shape in v.values()), "parameters' names and shapes"),
    "scheduler": (lambda v: isinstance(v, dict) and _count(v.get("last_epoch"))  # a lambda's state is null
                  and isinstance(v.get("lr_lambdas"), list) and all(fn is None for fn in v["lr_lambdas"]),
                  "a learning-rate scheduler's state"),
    "loss_scale": (lambda v: v is None or isinstance(v, dict), "a loss scale's state or null"),
}


def check_optimizer(record: dict, plan: ir.Plan, path: Path) -> None:
    if record.get("optimizer") != plan.train.optimizer.value:
        raise CheckpointError(f"checkpoint {path} holds {record.get('optimizer')} optimizer state, but plan "
                              f"'{plan.name}' trains with {plan.train.optimizer.value}", "optimizer")


def check_compatible(record: dict, plan: ir.Plan, shapes: dict[str, list[int]], path: Path) -> None:
    """CheckpointError where the checkpoint holds another model (its parameters' names and shapes) or optimizer."""
    saved = record.get("model")
    if saved != shapes:
        raise CheckpointError(f"checkpoint {path} (plan '{record.get('plan')}') holds a different model than plan "
                              f"'{plan.name}': {_model_difference(saved if isinstance(saved, dict) else {}, shapes)}",
                              "model")
    check_optimizer(record, plan, path)


def _model_difference(saved: dict[str, list[int]], shapes: dict[str, list[int]]) -> str:
    problems = [f"{name} is {saved[name]} there, {shapes[name]} here"
                for name in saved if name in shapes and saved[name] != shapes[name]]
    problems += [f"{name} is only there" for name in saved if name not in shapes]
    problems += [f"{name} is only here" for name in shapes if name not in saved]
    more = f" (and {len(problems) - 2} more differences)" if len(problems) > 2 else ""
    return "; ".join(problems[:2]) + more


def launch_refusal(plan: ir.Plan, directory: str | Path) -> Diagnostic | None:
    """E721 for `--resume` from `directory` where what the launcher can see refuses it before any rank starts: a
    checkpoint folder it cannot list, a record it cannot read, of another format or another optimizer. None where
    there is no checkpoint yet (the run starts at step 1) or where only the ranks can tell (the model's shapes)."""
    try:
        path = latest(directory)
        if path is not None:
            check_optimizer(read_record(path), plan, path)
    except CheckpointError as error:
        return refusal(plan, error)
    except OSError as error:  # the folder cannot be listed
        return refusal(plan, CheckpointError(f"cannot list checkpoint folder {directory}: {error.strerror or error}"))
    return None


def refusal(plan: ir.Plan, error: CheckpointError) -> Diagnostic:
    """E721: at the plan's model or optimizer where the checkpoint holds another, at the plan where the checkpoint
    itself cannot be read."""
    span = {"model": plan.model.span, "optimizer": plan.train.span_of("optimizer")}.get(error.part) or plan.span
    hint = {"model": "resume with the plan whose model wrote the checkpoint (the record names it), or start this one "
                     "afresh: another --checkpoint-dir, or the run without --resume",
            "optimizer": "resume with the optimizer the checkpoint was written with, or start afresh: another "
                         "--checkpoint-dir, or the run without --resume"}.get(
        error.part, "give the --checkpoint-dir a `plandsl run --checkpoint-dir` of this plandsl wrote, or start "
                    "afresh without --resume; a checkpoint folder whose last step is damaged resumes from an "
                    "earlier one once that step's folder is removed")
    return diag("E721", f"plan '{plan.name}' cannot resume: {error}", span, hint=hint)


__all__ = ["CheckpointError", "RECORD", "FORMAT", "RECORD_LIMIT", "MAX_ENTRIES", "step_dir", "latest", "read_record",
           "check_optimizer", "check_compatible", "launch_refusal", "refusal"]
