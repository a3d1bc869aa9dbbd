"""Simulation of a schedule without GPUs: schedule + costs -> timeline, bubble, memory, deadlock.

Contract: `simulate(schedule, costs) -> Simulation`. A schedule that cannot finish comes back
with `deadlock` set (every stuck rank and what it waits for) and the time reached as makespan;
ValueError only when costs or actions do not fit the schedule's sizes. `step_grid` is the
unit-time grid torch prints; `format_grid` and `to_chrome_trace` render results.

Model. Each rank runs its row in order, one action at a time. A compute action starts when its
rank is free and its inputs exist: F(s,m) needs F(s-1,m) of the microbatch's pipeline; B(s,m)
and I(s,m) need B/I(s+1,m) and F(s,m); W(s,m) needs I(s,m). An input made on another rank
arrives `Costs.p2p` seconds after it is made. A compute-only schedule gets these dependencies
derived; a lowered one (see `lower.add_send_recv`) is run as written: a send is posted without
waiting (torch's isend) once the rank reaches it, and a receive blocks the rank until that send
was posted plus `p2p`; communication takes no compute time.

Event-driven without a clock queue: a rank runs until its next action lacks an input, and the
action that makes that input wakes it. As each rank's order is fixed, an action starts at
max(rank free, inputs ready + p2p) whatever order ranks are visited in, so a time-ordered heap
would only add log n: every action is visited once.

Memory. F(s,m) holds `activation_bytes[s]` on its rank (1.0 by default: counts); B frees it;
with the backward split, I frees (1 - weight_grad_fraction) of it and W the rest. A microbatch
is *in flight* on a rank while any of its stages there holds activations, i.e. from its first F
until its last B (or W). Peaks are taken over the rank's action order.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Iterable, NamedTuple
from operator import attrgetter

from plandsl.diagnostics.limits import MAX_GRID_CELLS

from .program import COMPUTE, Action, Kind, Schedule, gc_paused

# What an action makes available, as a tag in an integer key (stage, microbatch, tag).
_F, _GRAD, _I, _SENT_F, _SENT_B, _RECV_F, _RECV_B, _W = range(8)
_TAGS = 8


BUBBLE_DEFINITION = "idle time of the busiest rank / makespan"
"""What `bubble` means wherever plandsl prints one (`simulate`, `estimate`, `render`): `bubble_seconds`."""


def bubble_seconds(makespan: float, busy: Iterable[float]) -> float:
    """The pipeline bubble of a step: the busiest rank's idle time, makespan minus its busy (compute) time.

    The step can be no shorter than the busiest rank's work; the bubble is what the schedule adds to it
    (filling and draining the pipeline, waiting on transfers and on slower neighbours). A rank with less
    work idles longer than that, which is imbalance between stages, not bubble: each rank's own idle
    share is reported beside it. With balanced stages every rank idles alike and this is the textbook
    (p - 1) / (m + p - 1) of GPipe and 1F1B (Narayanan et al. 2021, Sec. 2.2)."""
    return max(0.0, makespan - max(busy, default=0.0))


@dataclass(frozen=True, slots=True)
class Costs:
    """Seconds per action and bytes per activation; uniform unless `stage_costs` says otherwise."""

    F: float = 1.0
    B: float = 2.0
    I: float | None = None  # noqa: E741 - the notation's letter; None: B / 2
    W: float | None = None  # None: B / 2
    p2p: float = 0.0
    """Seconds for one stage-to-stage transfer (latency + size / bandwidth)."""
    stage_costs: tuple[tuple[float, float, float, float], ...] = ()
    """Per stage (F, B, I, W), overriding the uniform figures above."""
    activation_bytes: tuple[float, ...] = ()
    """Per stage: bytes held per in-flight microbatch (empty: 1.0 each, so peaks are counts)."""
    weight_grad_fraction: float = 0.5
    """With a split backward: the share of a microbatch's activations still held after I until W."""
    static_bytes: tuple[float, ...] = ()
    """Per rank: bytes held through the step, added to `peak_memory_bytes` (a plan's: its parameters, gradients and
    optimizer states and torch's pipeline stage's buffers, `cost.memory.MemoryEstimate.held`)."""

    def per_stage(self, stages: int) -> list[tuple[float, float, float, float]]:
        """(F, B, I, W) seconds for each stage; ValueError on a wrong length or a negative cost."""
        if self.stage_costs:
            if len(self.stage_costs) != stages:
                raise ValueError(f"stage_costs has {len(self.stage_costs)} entries but the schedule "
                                 f"has {stages} stages")
            table = [tuple(map(float, c)) for c in self.stage_costs]
        else:
            half = self.B / 2
            table = [(self.F, self.B, half if self.I is None else self.I,
                      half if self.W is None else self.W)] * stages
        if any(len(c) != 4 for c in table):
            raise ValueError("each stage_costs entry is (F, B, I, W)")
        if self.p2p < 0:
            raise ValueError(f"p2p ({self.p2p}) must be >= 0")
        for stage, entry in enumerate(table):
            for kind, seconds in zip("FBIW", entry):
                if seconds < 0:
                    raise ValueError(f"cost {kind} of stage {stage} ({seconds}) must be >= 0")
        return table


class Event(NamedTuple):
    """One action's run; a named tuple: a simulation makes one per action."""
    rank: int
    action: Action
    start: float
    end: float


@dataclass(frozen=True, slots=True)
class RankStats:
    rank: int
    busy: float
    idle: float
    peak_inflight_microbatches: int
    peak_memory_bytes: float


@dataclass(frozen=True, slots=True)
class Deadlock:
    """Where a schedule got stuck: (rank, the action it is stuck at, the action it waits for)."""

    time: float
    waiting: tuple[tuple[int, Action, Action], ...]

    def __str__(self) -> str:
        stuck = ", ".join(f"rank {r} at {a} waits for {w}" for r, a, w in self.waiting)
        return f"deadlock at t={self.time:g}: {stuck}"


@dataclass(frozen=True, slots=True)
class Extrapolation:
    """How a bounded simulation (`schedules.bounded`) got its figures: runs of `first` and
    `first + cycle` microbatches laid out and simulated, and what the second adds to the first (one
    cycle of the steady state, `periods` repeats of the schedule's pattern) added `repeats` more times."""

    microbatches: int
    first: int
    cycle: int
    periods: int
    repeats: int

    def __str__(self) -> str:
        return (f"steady state extrapolated: runs of {self.first:,} and {self.first + self.cycle:,} microbatches "
                f"simulated, their difference (one cycle: {self.cycle:,} microbatch{'es' if self.cycle != 1 else ''}, {self.periods:,} period"
                f"{'s' if self.periods != 1 else ''} of the schedule) added {self.repeats:,} more times for "
                f"{self.microbatches:,}")

    def to_json(self) -> dict:
        return {"microbatches": self.microbatches, "first": self.first, "cycle": self.cycle,
                "periods": self.periods, "repeats": self.repeats}


@dataclass(frozen=True, slots=True)
class Simulation:
    makespan: float
    bubble_fraction: float  # bubble_seconds / makespan: BUBBLE_DEFINITION
    ranks: tuple[RankStats, ...]
    events: tuple[Event, ...]  # with `extrapolated`, those of the first run only
    deadlock: Deadlock | None = None
    extrapolated: Extrapolation | None = None  # None: every action was laid out and simulated

    @property
    def bubble(self) -> float:
        """Seconds of bubble (`bubble_seconds`): the busiest rank's idle time."""
        return bubble_seconds(self.makespan, (r.busy for r in self.ranks))

    def to_json(self) -> dict:
        deadlock = None if self.deadlock is None else {
            "time": self.deadlock.time,
            "waiting": [{"rank": r, "action": str(a), "waits_for": str(w)}
                        for r, a, w in self.deadlock.waiting]}
        return {"makespan": self.makespan, "bubble_fraction": self.bubble_fraction,
                "ranks": [{"rank": s.rank, "busy": s.busy, "idle": s.idle,
                           "peak_inflight_microbatches": s.peak_inflight_microbatches,
                           "peak_memory_bytes": s.peak_memory_bytes} for s in self.ranks],
                "deadlock": deadlock,
                **({"extrapolated": self.extrapolated.to_json()} if self.extrapolated is not None else {})}


def simulate(schedule: Schedule, costs: Costs = Costs()) -> Simulation:
    """Run the schedule under `costs` (see the module docstring for the model)."""
    with gc_paused():
        return _simulate(schedule, costs)


def _simulate(schedule: Schedule, costs: Costs) -> Simulation:
    cost_f, cost_b, cost_i, cost_w = zip(*costs.per_stage(schedule.stages)) or ((), (), (), ())
    activation, static = _memory_inputs(schedule, costs)
    kinds = _check_actions(schedule)
    lowered = not kinds <= COMPUTE
    p2p, share = float(costs.p2p), costs.weight_grad_fraction
    release = {Kind.B: 1.0, Kind.I: 1.0 - share, Kind.W: share}
    rows, maps, pipes = schedule.actions, schedule.stage_to_rank, schedule.microbatch_pipeline
    stages, last_stage, single = schedule.stages, schedule.stages - 1, maps[0] if maps else ()
    # (stage, microbatch, tag) is the key (microbatch * stages + stage) * _TAGS + tag
    step = _TAGS  # the key distance between stage s and s + 1
    F, B, I, W = Kind.F, Kind.B, Kind.I, Kind.W

    done: dict[int, float] = {}          # key -> time the thing exists on its own rank
    waiters: dict[int, list[int]] = {}   # key -> ranks blocked on it
    blocked: dict[int, tuple[int, int]] = {}  # rank -> (key it waits on, index of its action)
    # per rank: next index, clock, busy, activation level, peak level, in-flight count per
    # microbatch, peak in-flight, events
    state = [[0, 0.0, 0.0, 0.0, 0.0, {}, 0, []] for _ in rows]
    ready = list(range(schedule.ranks - 1, -1, -1))
    while ready:
        rank = ready.pop()
        row, own = rows[rank], state[rank]
        i, t, busy, level, peak, inflight, peak_inflight, events = own
        n = len(row)
        while i < n:
            action = row[i]
            stage, kind, mb = action
            base = (mb * stages + stage) * _TAGS
            ranks = maps[pipes[mb]] if pipes else single
            # What it needs: `need` (+ `delay`), made upstream or received, then `local`, made
            # earlier on this rank; upstream first, so that a deadlock names the remote action.
            need, delay, local = None, 0.0, None
            if kind is F:
                duration, makes = cost_f[stage], _F
                if stage > 0:
                    if ranks[stage - 1] == rank:
                        need = base - step + _F
                    elif lowered:
                        need = base + _RECV_F
                    else:
                        need, delay = base - step + _F, p2p
            elif kind is B or kind is I:
                duration, makes, local = (cost_b if kind is B else cost_i)[stage], _GRAD, base + _F
                if stage < last_stage:
                    if ranks[stage + 1] == rank:
                        need = base + step + _GRAD
                    elif lowered:
                        need = base + _RECV_B
                    else:
                        need, delay = base + step + _GRAD, p2p
            elif kind is W:
                duration, makes, local = cost_w[stage], _W, base + _I
            elif kind is Kind.SEND_F:
                duration, makes, local = 0.0, _SENT_F, base + _F
            elif kind is Kind.SEND_B:
                duration, makes, local = 0.0, _SENT_B, base + _GRAD
            elif kind is Kind.RECV_F:
                duration, makes, need, delay = 0.0, _RECV_F, base - step + _SENT_F, p2p
            else:  # RECV_B
                duration, makes, need, delay = 0.0, _RECV_B, base + step + _SENT_B, p2p
            start = t
            if need is not None:
                when = done.get(need)
                if when is None:
                    blocked[rank] = (need, i)
                    waiters.setdefault(need, []).append(rank)
                    break
                if when + delay > start:
                    start = when + delay
            if local is not None:
                when = done.get(local)
                if when is None:
                    blocked[rank] = (local, i)
                    waiters.setdefault(local, []).append(rank)
                    break
                if when > start:
                    start = when
            t = start + duration
            done[base + makes] = t
            if kind is I:
                done[base + _I] = t
            woken = waiters.pop(base + makes, None)
            if woken:
                ready.extend(woken)
            i += 1
            if makes > _GRAD and makes != _W:  # communication: no work, no memory
                continue
            busy += duration
            events.append(Event(rank, action, start, t))
            if kind is F:
                level += activation[stage]
                inflight[mb] = inflight.get(mb, 0) + 1
                if level > peak:
                    peak = level
                if len(inflight) > peak_inflight:
                    peak_inflight = len(inflight)
            else:
                level -= activation[stage] * release[kind]
                if kind is not I and mb in inflight:
                    if inflight[mb] == 1:
                        del inflight[mb]
                    else:
                        inflight[mb] -= 1
        own[:] = i, t, busy, level, peak, inflight, peak_inflight, events
        if i == n:
            blocked.pop(rank, None)

    makespan = max((own[1] for own in state), default=0.0)
    stats = tuple(RankStats(rank, own[2], makespan - own[2], own[6], static[rank] + own[4])
                  for rank, own in enumerate(state))
    bubble = bubble_seconds(makespan, (s.busy for s in stats)) / makespan if makespan > 0 else 0.0
    deadlock = None
    if blocked:
        deadlock = Deadlock(makespan, tuple(
            (rank, rows[rank][index], _waited_action(schedule, key, kinds))
            for rank, (key, index) in sorted(blocked.items())))
    events = tuple(itertools.chain.from_iterable(own[7] for own in state))
    return Simulation(makespan, bubble, stats, events, deadlock)


def held_profiles(schedule: Schedule, weight_grad_fraction: float = 0.5) -> tuple:
    """Per rank, the microbatches each of its stages (in stage order) holds at the moments that can be its peak, as
    `simulate` counts them (F holds one, B frees it, I frees 1 - `weight_grad_fraction`, `Costs`' default, and W the
    rest): after each forward that a release follows (those before it hold no more). The rank's simulated peak of
    activation bytes is the largest sum(held x bytes) over them, for any stages' bytes, as memory changes only by the
    rank's own actions in their fixed order. One pipeline's schedules only (each rank's stages from
    `stage_to_rank[0]`)."""
    change = {Kind.F: 1.0, Kind.B: -1.0, Kind.I: weight_grad_fraction - 1.0, Kind.W: -weight_grad_fraction}
    forward = Kind.F
    single = schedule.stage_to_rank[0]
    owned: list[list[int]] = [[] for _ in schedule.actions]
    for s, r in enumerate(single):
        owned[r].append(s)
    out = []
    for own, row in zip(owned, schedule.actions):
        column = {s: j for j, s in enumerate(own)}
        held, seen, rising = [0.0] * len(own), set(), False
        add = seen.add
        for stage, kind, _ in row:
            delta = change.get(kind)
            if delta is None:
                continue
            if rising and kind is not forward:  # the last forward before a release: those before it hold no more
                add(tuple(held))
            held[column[stage]] += delta
            rising = kind is forward
        if rising:
            add(tuple(held))
        out.append(tuple(sorted(seen)) or ((0.0,) * len(own),))
    return tuple(out)


def _memory_inputs(schedule: Schedule, costs: Costs) -> tuple[tuple[float, ...], tuple[float, ...]]:
    activation = costs.activation_bytes or (1.0,) * schedule.stages
    static = costs.static_bytes or (0.0,) * schedule.ranks
    if len(activation) != schedule.stages:
        raise ValueError(f"activation_bytes has {len(activation)} entries but the schedule has "
                         f"{schedule.stages} stages")
    if len(static) != schedule.ranks:
        raise ValueError(f"static_bytes has {len(static)} entries but the schedule has "
                         f"{schedule.ranks} ranks")
    if not 0.0 <= costs.weight_grad_fraction <= 1.0:
        raise ValueError(f"weight_grad_fraction ({costs.weight_grad_fraction}) is not in [0, 1]")
    return tuple(map(float, activation)), tuple(map(float, static))


def _check_actions(schedule: Schedule) -> set[Kind]:
    """The kinds used; ValueError for a stage or microbatch outside the schedule's sizes."""
    if len(schedule.actions) != schedule.ranks:
        raise ValueError(f"the schedule has {len(schedule.actions)} rows for {schedule.ranks} ranks")
    everything = list(itertools.chain.from_iterable(schedule.actions))
    stages = set(map(attrgetter("stage"), everything))
    microbatches = set(map(attrgetter("microbatch"), everything))
    if stages and (min(stages) < 0 or max(stages) >= schedule.stages):
        raise ValueError(f"actions name stages {min(stages)}..{max(stages)}, outside "
                         f"0..{schedule.stages - 1}")
    bound = len(schedule.microbatch_pipeline) if schedule.microbatch_pipeline else None
    if microbatches and (min(microbatches) < 0 or (bound is not None and max(microbatches) >= bound)):
        raise ValueError(f"actions name microbatches {min(microbatches)}..{max(microbatches)}, "
                         f"outside the schedule's {bound or schedule.microbatches}")
    return set(map(attrgetter("kind"), everything))


def _waited_action(schedule: Schedule, key: int, kinds: set[Kind]) -> Action:
    position, tag = divmod(key, _TAGS)
    microbatch, stage = divmod(position, schedule.stages)
    kind = {_F: Kind.F, _GRAD: Kind.I if Kind.I in kinds else Kind.B, _I: Kind.I, _W: Kind.W,
            _SENT_F: Kind.SEND_F, _SENT_B: Kind.SEND_B, _RECV_F: Kind.RECV_F,
            _RECV_B: Kind.RECV_B}[tag]
    return Action(stage, kind, microbatch)


_UNIT = Costs(F=1.0, B=1.0, I=1.0, W=1.0, p2p=0.0)


class GridTooLarge(ValueError):
    """The step x rank grid would hold more than `limits.MAX_GRID_CELLS` cells; `last`: (rank, action) of the action
    that runs last, whose step makes the grid that long (where an input wrote it, the place to point at)."""

    def __init__(self, message: str, last: tuple[int, Action] | None = None):
        super().__init__(message)
        self.last = last


def step_grid(schedule: Schedule) -> list[list[Action | None]]:
    """Unit-time simulation: `grid[rank][step]`, the compute action or None for an idle step.

    Every compute action takes one step and transfers are free; an action runs the step after
    its inputs were made. Rows are padded with None to the same number of steps; rank-major like
    torch's pipeline order and `program.to_csv`. ValueError if the schedule deadlocks, GridTooLarge
    (a ValueError) past `MAX_GRID_CELLS` cells, before any is laid out.
    """
    result = simulate(schedule.compute_only(), _UNIT)
    if result.deadlock is not None:
        raise ValueError(str(result.deadlock))
    steps = int(result.makespan)
    if schedule.ranks * steps > MAX_GRID_CELLS:
        last = min(result.events, key=lambda event: (-event.start, event.rank), default=None)
        raise GridTooLarge(f"schedule '{schedule.name}' runs {schedule.ranks:,} ranks for {steps:,} unit-time steps: "
                           f"a grid of {schedule.ranks * steps:,} cells, more than the {MAX_GRID_CELLS:,} one is laid "
                           "out with", (last.rank, last.action) if last is not None else None)
    grid: list[list[Action | None]] = [[None] * steps for _ in range(schedule.ranks)]
    for event in result.events:
        grid[event.rank][int(event.start)] = event.action
    return grid


def format_grid(grid: list[list[Action | None]], mark_step: int | None = None, window: int | None = None) -> str:
    """`grid[rank][step]` as text, steps as rows and ranks as columns (torch's layout). `window`: where the grid has more
    than 2 x window + 1 steps, only the steps within `window` of `mark_step` (the first 2 x window + 1 without one),
    a `  ...` line where steps are left out: the work and the text are the window's, whatever the grid's length (a
    schedule's diagnostics each carried the whole grid, 10,000 steps of a 540 KB CSV 68 times over: 28 s)."""
    steps = max((len(row) for row in grid), default=0)
    first, last = 0, steps - 1
    if window is not None and steps > 2 * window + 1:
        centre = window if mark_step is None else min(max(mark_step, 0), steps - 1)
        first, last = max(0, centre - window), min(steps - 1, centre + window)
    digits = len(str(max(steps - 1, 0)))
    shown = range(first, last + 1)
    columns = [[f"Rank {r}"] + ["" if i >= len(row) or row[i] is None else str(row[i]) for i in shown]
               for r, row in enumerate(grid)]
    widths = [max(map(len, column)) for column in columns]
    indent = len(f"Step {0:0{digits}d}") + 2 if steps else 0
    lines = [(" " * indent + " ".join(c[0].ljust(w) for c, w in zip(columns, widths))).rstrip()]
    if first > 0:
        lines.append("  ...")
    for row, i in enumerate(shown, 1):
        cells = " ".join(c[row].ljust(w) for c, w in zip(columns, widths))
        lines.append(f"Step {i:0{digits}d}: {cells}".rstrip() + (" <-- here" if i == mark_step else ""))
    if last < steps - 1:
        lines.append("  ...")
    return "\n".join(lines) + "\n"


def to_chrome_trace(simulation: Simulation, time_unit_seconds: float = 1.0) -> dict:
    """Chrome/Perfetto trace JSON: one process, a thread per rank, an "X" event per action (µs)."""
    scale = time_unit_seconds * 1e6
    ranks = len(simulation.ranks)
    meta = [{"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": "pipeline"}}]
    meta += [{"name": "thread_name", "ph": "M", "pid": 0, "tid": r, "args": {"name": f"rank {r}"}}
             for r in range(ranks)]
    events = [{"name": str(e.action), "cat": e.action.kind.value, "ph": "X", "pid": 0,
               "tid": e.rank, "ts": e.start * scale, "dur": (e.end - e.start) * scale,
               "args": {"stage": e.action.stage, "microbatch": e.action.microbatch}}
              for e in simulation.events]
    return {"traceEvents": meta + events, "displayTimeUnit": "ms"}
