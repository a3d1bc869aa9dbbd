"""Where each rank is (step, phase, pipeline action), and what the launcher says when a rank fails.

Stage: interpreter (rank side: a progress record and an error report; launcher side: the message).
Contract: a rank calls `at_step(job, step)` once per step (it installs the trackers on first use)
and `report_error(error)` when it raises; both write into `$PLANDSL_FAULT_DIR` when the launcher set
it (`rank{R}.progress`: 64 mmap'd bytes, readable after a SIGKILL; `rank{R}.json`: the error).
`read_records(directory)` collects them; `describe_failure` names each failed rank's position and
draws the plan schedule's step x rank grid with the failing action marked (`schedules.simulate`).
`$PLANDSL_FAULT_INJECT` is a test hook that makes one rank raise or SIGKILL itself (docs/running.md).
"""
from __future__ import annotations

import json
import mmap
import os
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from plandsl.syntax.files import read_bounded
from plandsl.cost.schedule import plan_schedule
from plandsl.schedules.simulate import format_grid, step_grid

DIR_ENV = "PLANDSL_FAULT_DIR"
INJECT_ENV = "PLANDSL_FAULT_INJECT"
_RECORD_LIMIT = 1 << 20  # a rank's JSON report: its error message and position, far below this
_SIZE = 64  # the progress file: step [0:12], action [12:28], phase [28:60], done flag [60]
_STEP, _ACTION, _PHASE, _DONE = slice(0, 12), slice(12, 28), slice(28, 60), slice(60, 61)
_KIND_PHASE = {"F": "forward", "B": "backward", "I": "backward", "W": "backward"}


# ---- the test hook -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Injection:
    """`rank=R,step=S[,action=1B0|,phase=backward][,kill]`: rank R raises (or SIGKILLs itself) on entering
    that action or phase of step S (1-based), or at the start of step S when neither is given."""

    rank: int
    step: int
    action: str | None = None
    phase: str | None = None
    kill: bool = False

    @classmethod
    def parse(cls, text: str) -> "Injection":
        fields: dict[str, Any] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, _, value = item.partition("=")
            if key == "kill" and not value:
                fields["kill"] = True
            elif key in ("rank", "step") and value.isdigit():
                fields[key] = int(value)
            elif key in ("action", "phase") and value:
                fields[key] = value
            else:
                raise ValueError(f"{INJECT_ENV}: cannot read '{item}' in '{text}' "
                                 "(expected rank=R,step=S[,action=1B0|,phase=forward][,kill])")
        if "rank" not in fields or "step" not in fields:
            raise ValueError(f"{INJECT_ENV}='{text}' needs rank=R and step=S")
        return cls(**fields)

    def fire(self) -> None:
        if self.kill:
            os.kill(os.getpid(), signal.SIGKILL)
        where = f"action {self.action}" if self.action else f"phase {self.phase}" if self.phase else "its start"
        raise RuntimeError(f"fault injected by {INJECT_ENV} at step {self.step}, {where}")


# ---- the rank side -------------------------------------------------------------------------------------
class Progress:
    """This rank's position: a few attribute writes per pipeline action, mirrored into a tiny mmap."""

    __slots__ = ("rank", "step", "phase", "action", "done", "job", "_map", "_inject")

    def __init__(self, rank: int, directory: str | None, inject: Injection | None):
        self.rank, self.step, self.phase, self.action, self.done = rank, 0, "building the job", "", True
        self.job = None
        self._inject = inject if inject is not None and inject.rank == rank else None
        self._map = None
        if directory:
            path = Path(directory) / f"rank{rank}.progress"
            with open(path, "w+b") as handle:
                handle.write(b" " * _SIZE)
                handle.flush()
                self._map = mmap.mmap(handle.fileno(), _SIZE)
            self._write(_PHASE, self.phase)

    def _write(self, where: slice, text: str) -> None:
        if self._map is not None:
            self._map[where] = text.encode()[: where.stop - where.start].ljust(where.stop - where.start)

    def at_step(self, step: int) -> None:
        self.step, self.action, self.done = step, "", True
        self._write(_STEP, str(step))
        self._write(_ACTION, "")
        self.set_phase("before the forward")
        if self._inject is not None and self._inject.step == step and not (self._inject.action or self._inject.phase):
            self._inject.fire()

    def set_phase(self, phase: str) -> None:
        self.phase = phase
        self._write(_PHASE, phase)
        if self._inject is not None and self._inject.phase == phase and self._inject.step == self.step:
            self._inject.fire()

    def enter(self, stage: int, kind: str, microbatch: int) -> None:
        self.action, self.done = f"{stage}{kind}{microbatch}", False
        self._write(_ACTION, self.action)
        self._write(_DONE, "0")
        self.set_phase(_KIND_PHASE[kind])
        if self._inject is not None and self._inject.action == self.action and self._inject.step == self.step:
            self._inject.fire()

    def leave(self) -> None:
        self.done = True
        self._write(_DONE, "1")

    def where(self) -> str:
        return describe_position(self.step, self.action, self.done, self.phase)


_PROGRESS: Progress | None = None


def progress() -> Progress:
    """This process's record (made on first use from RANK, $PLANDSL_FAULT_DIR and the test hook)."""
    global _PROGRESS
    if _PROGRESS is None:
        import torch.distributed as dist  # lazy: the launcher imports this module without torch
        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
        text = os.environ.get(INJECT_ENV)
        _PROGRESS = Progress(rank, os.environ.get(DIR_ENV), Injection.parse(text) if text else None)
    return _PROGRESS


def at_step(job, step: int) -> None:
    """Step `step` (1-based) begins; the first call for a job installs the trackers on it."""
    record = progress()
    if record.job is not job:
        record.job = job
        track_job(job, record)
    record.at_step(step)


def track_job(job, record: Progress) -> None:
    """Phases by hooks (optimizer step; forward and backward of a non-pipeline model) and pipeline
    actions by wrapping this rank's `PipelineStage` methods."""
    job.optimizer.register_step_pre_hook(lambda *_: record.set_phase("optimizer"))
    job.optimizer.register_step_post_hook(lambda *_: record.set_phase("after the optimizer step"))
    if job.pipeline is not None:
        for stage in getattr(job.pipeline, "stages", ()):
            track_stage(stage, record)
        return

    def on_output(module, inputs, output) -> None:
        if getattr(output, "requires_grad", False):
            output.register_hook(lambda grad: record.set_phase("backward"))
    job.parts[0].register_forward_pre_hook(lambda *_: record.set_phase("forward"))
    job.parts[0].register_forward_hook(on_output)


def track_stage(stage, record: Progress | None = None) -> None:
    """Wrap `forward_one_chunk`, `backward_one_chunk` and `backward_weight_one_chunk` of one
    `PipelineStage` so each action records itself (`1F3`, `1B3`, `1I3`, `1W3`: torch's notation)."""
    record = record or progress()
    index = stage.stage_index
    forward, backward, weight = stage.forward_one_chunk, stage.backward_one_chunk, stage.backward_weight_one_chunk

    def forward_one_chunk(chunk, *args, **kwargs):
        record.enter(index, "F", chunk)
        result = forward(chunk, *args, **kwargs)
        record.leave()
        return result

    def backward_one_chunk(chunk, *args, **kwargs):
        full = kwargs.get("full_backward", args[1] if len(args) > 1 else True)
        record.enter(index, "B" if full else "I", chunk)
        result = backward(chunk, *args, **kwargs)
        record.leave()
        return result

    def backward_weight_one_chunk(chunk, *args, **kwargs):
        record.enter(index, "W", chunk)
        result = weight(chunk, *args, **kwargs)
        record.leave()
        return result

    stage.forward_one_chunk = forward_one_chunk
    stage.backward_one_chunk = backward_one_chunk
    stage.backward_weight_one_chunk = backward_weight_one_chunk


def report_error(error: BaseException) -> str:
    """Write this rank's `rank{R}.json` (when the launcher gave a directory); returns where it was."""
    try:
        record = progress()
    except ValueError:  # a malformed test hook: reported by `at_step`, never instead of `error`
        return "before step 1"
    _write_record({"rank": record.rank, "step": record.step, "action": record.action, "done": record.done,
                   "phase": record.phase, "error": f"{type(error).__name__}: {error}", "time": time.time()})
    return record.where()


def report_refusal(code: str) -> None:
    """Write this rank's `rank{R}.json` saying it refused the job before training with diagnostic `code` (printed by
    the rank itself), so that the launcher says so rather than that the job failed (`launch.failure_message`)."""
    _write_record({"rank": int(os.environ.get("RANK", "0")), "step": 0, "action": "", "done": True, "phase": "",
                   "error": f"refused ({code})", "time": time.time(), "refused": code})


def _write_record(data: dict) -> None:
    """`data` as `rank{R}.json` in the launcher's directory (none given: nothing); a failure to write is the
    launcher's loss only (the rank's own stderr line or diagnostic still says it)."""
    directory = os.environ.get(DIR_ENV)
    if not directory:
        return
    path = Path(directory) / f"rank{data['rank']}.json"
    try:
        path.with_suffix(".tmp").write_text(json.dumps(data))
        path.with_suffix(".tmp").replace(path)
    except OSError:
        pass


def describe_position(step: int, action: str, done: bool, phase: str) -> str:
    if step == 0:
        return "before step 1 (building the job)"
    if action and not done:
        return f"step {step}, action {action}"
    if action and phase in ("forward", "backward"):
        return f"step {step}, after action {action}"
    return f"step {step}, {phase}" + (f" (last action {action})" if action else "")


# ---- the launcher side ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class RankRecord:
    """What one rank left: its last position, and its error when it raised."""

    rank: int
    step: int
    action: str = ""
    done: bool = True
    phase: str = ""
    error: str | None = None
    time: float | None = None
    refused: str | None = None  # the code of the diagnostic the rank refused the job with, before training

    def where(self) -> str:
        return describe_position(self.step, self.action, self.done, self.phase)


def read_records(directory: str | Path) -> dict[int, RankRecord]:
    """Every rank's record in `directory`: its JSON report, else its progress file."""
    records: dict[int, RankRecord] = {}
    directory = Path(directory)
    for path in sorted(directory.glob("rank*.progress")):
        try:
            data = read_bounded(path, _SIZE, "progress file").decode(errors="replace")
            rank = int(path.stem[4:])
            step = int(data[_STEP].strip() or 0)
        except (OSError, ValueError):
            continue
        records[rank] = RankRecord(rank, step, data[_ACTION].strip(), data[_DONE].strip() != "0",
                                   data[_PHASE].strip())
    for path in sorted(directory.glob("rank*.json")):
        try:
            data = json.loads(read_bounded(path, _RECORD_LIMIT, "rank record"))
            records[data["rank"]] = RankRecord(data["rank"], data["step"], data["action"], data["done"],
                                               data["phase"], data["error"], data["time"], data.get("refused"))
        except (OSError, ValueError, KeyError, TypeError):  # FileProblem is a ValueError
            continue
    return records


_SOURCE = re.compile(r"\[[^\]]*\.(?:cc|cpp|h):\d+\] ")  # gloo's "[.../pair.cc:553] " prefix
ERROR_CHARS = 160  # of a rank's error in the launcher's message (its own stderr has all of it)
WINDOW = 12  # grid rows shown either side of the failing step when the grid is longer


def mesh_coordinate(plan, rank: int) -> dict[str, int]:
    """Rank -> {axis: index}: `init_device_mesh` numbers the devices row-major, outermost axis first."""
    coordinate = {}
    for axis in reversed(plan.mesh.axes):
        coordinate[axis.name] = rank % axis.size
        rank //= axis.size
    return dict(reversed(coordinate.items()))


def mesh_rank(plan, coordinate: dict[str, int]) -> int:
    """{axis: index} -> rank, the inverse of `mesh_coordinate`."""
    rank = 0
    for axis in plan.mesh.axes:
        rank = rank * axis.size + coordinate[axis.name]
    return rank


def pipeline_grid(plan, records: dict[int, RankRecord], cause: int) -> str | None:
    """The plan schedule's step x rank grid (its program for the plan's sizes, unit-time steps) with
    rank `cause`'s action as `[1B3]` on the row marked `<-- here`, and the other ranks of its pipeline
    at theirs as `(0F4)`; None without a pipeline or when `cause` recorded no action."""
    record = records.get(cause)
    if plan is None or plan.stages is None or record is None or not record.action:
        return None
    program, _ = plan_schedule(plan)
    try:
        grid = [list(row) for row in step_grid(program)] if program is not None else None
    except ValueError:
        grid = None
    if not grid:
        return None
    axis = plan.stages.axis
    coordinate = mesh_coordinate(plan, cause)
    members = {mesh_rank(plan, {**coordinate, axis: p}): p for p in range(plan.pp)}
    mark, placed = None, []
    for rank, column in members.items():
        found = records.get(rank)
        if found is None or not found.action or column >= len(grid):
            continue
        step = next((i for i, cell in enumerate(grid[column]) if cell is not None and str(cell) == found.action), None)
        if step is None:
            continue
        grid[column][step] = f"[{found.action}]" if rank == cause else f"({found.action})"
        placed.append(rank)
        mark = step if rank == cause else mark
    lines = format_grid(grid, mark_step=mark, window=WINDOW if mark is not None else None).splitlines()
    columns = "" if list(members) == list(range(plan.pp)) else \
        f"; columns are pipeline ranks along '{axis}' (global ranks {', '.join(map(str, members))})"
    title = (f"schedule '{program.name}', {program.ranks} pipeline ranks x {program.microbatches} microbatches, one "
             f"unit-time step per row{columns}; [..]: rank {cause}'s action"
             + ("" if mark is not None else f" ({record.action} is not in the plan's program)")
             + ("; (..): where the other ranks of its pipeline were" if len(placed) > (mark is not None) else ""))
    return "\n".join([title, *lines])


def record_text(record: RankRecord | None) -> str:
    """' at step 2, action 1B0: RuntimeError: ...' for a failed rank's line, '' without a record."""
    if record is None:
        return ""
    error = _SOURCE.sub("", record.error.strip().splitlines()[0]) if record.error else ""
    if len(error) > ERROR_CHARS:
        error = error[:ERROR_CHARS - 3] + "..."
    return f" at {record.where()}" + (f": {error}" if error else "")
