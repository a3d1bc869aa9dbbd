"""Is a schedule runnable? E602-E607, each with the step x rank grid, the failing step marked.

Checks, in the order they are reported:

- E602 an action refers to a stage or microbatch outside the schedule's sizes;
- E607 an action of a stage runs on a rank other than the stage's (a stage on two ranks);
- E604 an action appears twice, or a backward is computed twice (B and I/W of one pair);
- E603 a (stage, microbatch) lacks its F, or its backward (B, or I and W), reported per stage;
- E605 on one rank, an action comes before one it needs: B/I before the F of its pair, W
  before its I, F before the previous stage's F, B/I before the next stage's B/I;
- E606 the ranks wait on each other forever (run by the simulator, every stuck rank named).

All problems are reported at once, but without cascades: an action already reported by an
earlier check is left out of the later ones, and the deadlock check only runs on a schedule
with none of the others. "Step" in messages is a row of the grid shown: the unit-time
simulation of the schedule (`simulate.step_grid`) when it runs to the end, else the position
of each action in its rank's order.
"""
from __future__ import annotations

import bisect

from dataclasses import dataclass, replace

from plandsl.diagnostics import Diagnostic, Note
from plandsl.schedules.program import COMPUTE, Action, Kind, Schedule, gc_paused
from plandsl.diagnostics.source import NO_SPAN, Span
from plandsl.schedules.simulate import Costs, format_grid, simulate, step_grid

LIMIT = 20  # diagnostics of one code per schedule; the last one says how many more there were
GRID_WINDOW = 12  # grid rows shown either side of a problem's step (`format_grid`): the whole grid up to 25 steps
_BACKWARD = (Kind.B, Kind.I)


def validate(schedule: Schedule, spans: dict[tuple[int, int], Span] | None = None,
             default_span: Span | None = None, simulation=None) -> list[Diagnostic]:
    """Every problem of `schedule`; `spans[(rank, index)]` is where that action was written.

    `simulation`: a `simulate(schedule, ...)` result to reuse for the deadlock check (whether a
    schedule deadlocks depends on its order only, not on the costs it was simulated with)."""
    with gc_paused():
        return _Validator(schedule, spans or {}, default_span or NO_SPAN, simulation).run()


@dataclass(frozen=True, slots=True)
class _Problem:
    code: str
    message: str
    rank: int | None
    at: tuple | None  # (rank, index) of the action to mark, or ("step", n)
    span: Span
    hint: str | None = None
    notes: tuple[Note, ...] = ()


class _Validator:
    def __init__(self, schedule: Schedule, spans: dict[tuple[int, int], Span], default_span: Span, simulation=None):
        self.schedule = schedule
        self.spans = spans
        self.default = default_span
        # (rank, index, action) of every compute action, index into schedule.actions[rank]
        self.entries = [[(i, a) for i, a in enumerate(row) if a.kind in COMPUTE] for row in schedule.actions]
        self.problems: list[_Problem] = []
        self.excluded: set[tuple[int, int]] = set()  # (rank, index) already reported
        self._steps: dict[tuple[int, int], int] | None = None
        self._grid = None
        self._reported: dict[int, set] | None = None
        self.simulation = simulation

    # ---- helpers -------------------------------------------------------------------
    def span(self, rank: int, index: int) -> Span:
        return self.spans.get((rank, index), self.default)

    def note(self, message: str, rank: int | None = None, index: int | None = None) -> Note:
        span = self.span(rank, index) if rank is not None and index is not None else None
        return Note(message, None if span is NO_SPAN else span)

    def expected_rank(self, action: Action) -> int | None:
        schedule = self.schedule
        try:
            return schedule.rank_of(action)
        except IndexError:
            return None

    def in_range(self, action: Action) -> bool:
        return 0 <= action.stage < self.schedule.stages and 0 <= action.microbatch < self.schedule.microbatches

    def add(self, code, message, rank, at, span, hint=None, notes=()) -> None:
        self.problems.append(_Problem(code, message, rank, at, span, hint, tuple(notes)))

    # step numbers: the unit-time grid if the schedule runs, else the order on each rank
    def grid(self):
        if self._grid is None:
            grid = None
            if all(self.in_range(a) for entries in self.entries for _, a in entries):
                try:
                    grid = step_grid(self.schedule)
                except Exception:  # noqa: BLE001 - a broken schedule falls back to its order
                    grid = None
            steps: dict[tuple[int, int], int] = {}
            if grid is not None:
                for rank, entries in enumerate(self.entries):
                    cells = [step for step, cell in enumerate(grid[rank]) if cell is not None] \
                        if rank < len(grid) else []
                    if len(cells) != len(entries):
                        grid = None
                        break
                    for (index, _), step in zip(entries, cells):
                        steps[(rank, index)] = step
            if grid is None:
                grid = [[a for _, a in entries] for entries in self.entries]
                steps = {(rank, index): position for rank, entries in enumerate(self.entries)
                         for position, (index, _) in enumerate(entries)}
            self._grid, self._steps = grid, steps
        return self._grid

    def step(self, rank: int, index: int) -> int:
        self.grid()
        return self._steps.get((rank, index), index)

    def last_step(self, rank: int) -> int:
        entries = self.entries[rank] if rank < len(self.entries) else []
        return self.step(rank, entries[-1][0]) if entries else 0

    def where(self, rank: int, index: int) -> str:
        return f"rank {rank}, step {self.step(rank, index)}"

    # ---- the checks ----------------------------------------------------------------
    def run(self) -> list[Diagnostic]:
        self.check_range()
        self.check_ranks()
        present = self.check_duplicates()
        self.check_missing(present)
        self.check_order()
        if not self.problems:
            self.check_deadlock()
        return self.render()

    def check_range(self) -> None:
        s = self.schedule
        for rank, entries in enumerate(self.entries):
            bad = [(i, a) for i, a in entries if not self.in_range(a)]
            if not bad:
                continue
            self.excluded |= {(rank, i) for i, _ in bad}
            index, action = bad[0]
            reasons = []
            if not 0 <= action.stage < s.stages:
                reasons.append(f"stage {action.stage}, but the schedule has {s.stages} stages (0..{s.stages - 1})")
            if not 0 <= action.microbatch < s.microbatches:
                reasons.append(f"microbatch {action.microbatch}, but the schedule has {s.microbatches} "
                               f"microbatches (0..{s.microbatches - 1})")
            notes = [self.note(f"also {a} at {self.where(rank, i)}", rank, i) for i, a in bad[1:6]]
            if len(bad) > 6:
                notes.append(Note(f"and {len(bad) - 6} more actions out of range on rank {rank}"))
            self.add("E602", f"{self.where(rank, index)}: {action} refers to " + " and to ".join(reasons),
                     rank, (rank, index), self.span(rank, index),
                     hint=f"stages are 0..{s.stages - 1} and microbatches 0..{s.microbatches - 1}" if s.stages
                     and s.microbatches else None, notes=notes)

    def check_ranks(self) -> None:
        wrong: dict[tuple[int, int, int], list[tuple[int, Action]]] = {}
        for rank, entries in enumerate(self.entries):
            for index, action in entries:
                if self.excluded and (rank, index) in self.excluded:
                    continue
                home = self.expected_rank(action)
                if home is not None and home != rank:
                    wrong.setdefault((action.stage, home, rank), []).append((index, action))
        for (stage, home, rank), found in wrong.items():
            self.excluded |= {(rank, i) for i, _ in found}
            index, action = found[0]
            more = f" (and {len(found) - 1} more of its actions: " + \
                   ", ".join(str(a) for _, a in found[1:6]) + (", ..." if len(found) > 6 else "") + ")" \
                if len(found) > 1 else ""
            self.add("E607", f"{self.where(rank, index)}: {action} runs stage {stage} on rank {rank}, but stage "
                             f"{stage} runs on rank {home}{more}",
                     rank, (rank, index), self.span(rank, index),
                     hint="each stage lives on one rank: its weights are there; move the action to "
                          f"rank {home}'s row")

    def check_duplicates(self) -> set[Action]:
        """The set of actions kept for the later checks (first copies; none already reported)."""
        seen: dict[Action, tuple[int, int]] = {}
        excluded = self.excluded
        for rank, entries in enumerate(self.entries):
            for index, action in entries:
                if excluded and (rank, index) in excluded:
                    continue
                first = seen.setdefault(action, (rank, index))
                if first != (rank, index):
                    excluded.add((rank, index))
                    self.add("E604", f"{self.where(rank, index)}: {action} runs a second time (first at "
                                     f"{self.where(*first)})", rank, (rank, index), self.span(rank, index),
                             hint="each stage runs each kind of action once per microbatch",
                             notes=[self.note("first here", *first)])
        split = [a for a in seen if a.kind is Kind.I or a.kind is Kind.W]
        for stage, microbatch in dict.fromkeys((a.stage, a.microbatch) for a in split):
            backward = Action(stage, Kind.B, microbatch)
            if backward not in seen:
                continue
            both = [seen.pop(a) for a in (Action(stage, Kind.I, microbatch), Action(stage, Kind.W, microbatch))
                    if a in seen]
            excluded.update(both)
            rank, index = both[0]
            names = " and ".join(str(self.schedule.actions[r][i]) for r, i in both)
            b_rank, b_index = seen[backward]
            self.add("E604", f"{self.where(rank, index)}: {names} compute{'s' if len(both) == 1 else ''} a "
                             f"backward that {stage}B{microbatch} (at {self.where(b_rank, b_index)}) "
                             "already computes", rank, (rank, index), self.span(rank, index),
                     hint="run either B, or I and then W, for each stage and microbatch",
                     notes=[self.note(f"{stage}B{microbatch} here", b_rank, b_index)])
        return set(seen)

    def check_missing(self, present: set[Action]) -> None:
        """E603 per stage. Work is proportional to the actions written, not to the microbatch count:
        what is missing is kept as ranges (a table declaring 10^12 microbatches and holding 8 says so
        in one line)."""
        s = self.schedule
        by_stage: dict[int, dict[Kind, set[int]]] = {}
        for stage, kind, microbatch in present:
            by_stage.setdefault(stage, {}).setdefault(kind, set()).add(microbatch)
        for stage in range(s.stages):
            written = by_stage.get(stage, {})
            f, b, i, w = (written.get(k, set()) for k in (Kind.F, Kind.B, Kind.I, Kind.W))
            missing = {"F": _absent(f, s.microbatches), "B": _absent(b | i | w, s.microbatches),
                       "I": _ranges(sorted(w - i - b)), "W": _ranges(sorted(i - w - b))}
            missing = {k: v for k, v in missing.items() if v}
            missing = self._unexplained(stage, missing)
            if not missing:
                continue
            home = self.expected_rank(Action(stage, Kind.F, 0))
            if home is not None and not 0 <= home < len(self.entries):
                home = None
            what = " and ".join(f"{kind} for microbatch{'es' if _count(ranges) > 1 else ''} {_describe(ranges)}"
                                for kind, ranges in missing.items())
            span, at = self.default, None
            if home is None:
                where = f"stage {stage} has no rank"
            elif not self.entries[home]:
                where = f"rank {home}, step 0: rank {home} runs nothing, so"
            else:
                letter = next(iter(missing))
                same = [i for i, a in self.entries[home] if a.stage == stage and a.kind.value == letter]
                last = self.entries[home][-1][0]
                span, at = self.span(home, same[-1] if same else last), (home, last)
                where = f"rank {home}, step {self.step(home, last)}: rank {home} ends, but"
            self.add("E603", f"{where} stage {stage} never runs {what}", home, at, span,
                     hint="every stage runs F and B (or I then W) once for each microbatch "
                          f"0..{s.microbatches - 1}")

    def _unexplained(self, stage: int, missing: dict[str, list[tuple[int, int]]]) -> dict[str, list[tuple[int, int]]]:
        """`missing` (ranges) less the actions that were written but already reported (on another rank,
        twice)."""
        if self._reported is None:  # stage -> {(kind, microbatch)} of the excluded actions, built once
            self._reported = {}
            for rank, index in self.excluded:
                action = self.schedule.actions[rank][index]
                self._reported.setdefault(action.stage, set()).add((action.kind.value, action.microbatch))
        written = self._reported.get(stage, set())
        out = {}
        for kind, ranges in missing.items():
            also = ("I", "W") if kind == "B" else ()
            cut = sorted({mb for k, mb in written if k == kind or k in also})
            left = _subtract(ranges, cut)
            if left:
                out[kind] = left
        return out

    def check_order(self) -> None:
        s = self.schedule
        F, B, I, W = Kind.F, Kind.B, Kind.I, Kind.W  # noqa: E741 - the notation's letters
        for rank, entries in enumerate(self.entries):
            excluded = {i for r, i in self.excluded if r == rank}
            position: dict[tuple, int] = {}
            for index, action in entries:
                if index not in excluded:
                    position.setdefault(action, index)
            for index, action in entries:
                if excluded and index in excluded:
                    continue
                stage, kind, mb = action
                # (what must come earlier on this rank, if it is on this rank, and why)
                if kind is B or kind is I:
                    needs = [((stage, F, mb), "the forward it differentiates")]
                    if stage + 1 < s.stages:
                        needs += [((stage + 1, B, mb), "the gradient of the next stage"),
                                  ((stage + 1, I, mb), "the gradient of the next stage")]
                elif kind is W:
                    needs = [((stage, I, mb), "the input gradient it follows")]
                elif stage > 0:
                    needs = [((stage - 1, F, mb), "the previous stage's output")]
                else:
                    continue
                for key, why in needs:
                    later = position.get(key)
                    if later is not None and later > index:
                        need = Action(*key)
                        self.add("E605", f"{self.where(rank, index)}: {action} runs before {need} (at "
                                         f"{self.where(rank, later)}), {why}; both are on rank {rank}",
                                 rank, (rank, index), self.span(rank, index),
                                 hint=f"move {need} before {action} on rank {rank}",
                                 notes=[self.note(f"{need} here", rank, later)])
                        break

    def check_deadlock(self) -> None:
        unit = Costs(F=1.0, B=1.0, I=1.0, W=1.0, p2p=0.0)
        if self.simulation is not None and self.simulation.deadlock is None:
            return
        try:
            result = simulate(self.schedule, unit)  # unit time: step numbers for the grid
        except Exception:  # noqa: BLE001 - the checks above should have caught what breaks it
            return
        if result.deadlock is None:
            return
        s = self.schedule
        steps = int(result.makespan)
        grid: list[list[Action | None]] = [[None] * (steps + 1) for _ in range(s.ranks)]
        clock = [0] * s.ranks
        for event in result.events:
            if event.rank < s.ranks and int(event.start) < steps:
                grid[event.rank][int(event.start)] = event.action
                clock[event.rank] = max(clock[event.rank], int(event.end))
        stuck_lines, notes, first_span = [], [], None
        for rank, action, waited in result.deadlock.waiting:
            owner = self.expected_rank(waited)
            index = next((i for i, a in enumerate(s.actions[rank]) if a == action), None)
            span = self.span(rank, index) if index is not None else self.default
            first_span = first_span or span
            owner_text = f" (rank {owner})" if owner is not None else ""
            stuck_lines.append(f"rank {rank} waits at {action} (step {clock[rank]}) for {waited}{owner_text}")
            notes.append(self.note(f"rank {rank} is stuck at {action}, waiting for {waited}{owner_text}",
                                   rank, index))
        rank0 = result.deadlock.waiting[0][0] if result.deadlock.waiting else None
        self._grid = grid  # the partial run, with the step where everything stops
        self._steps = {}
        self.add("E606", f"the schedule deadlocks at step {steps}: " + "; ".join(stuck_lines),
                 rank0, ("step", steps), first_span or self.default,
                 hint="each rank waits for an action another rank runs only later: reorder the rows so "
                      "every dependency can run first", notes=notes)

    # ---- output --------------------------------------------------------------------
    def render(self) -> list[Diagnostic]:
        if not self.problems:
            return []
        out: list[Diagnostic] = []
        counts: dict[str, int] = {}
        skipped: dict[str, int] = {}
        order = {"E602": 0, "E607": 1, "E604": 2, "E603": 3, "E605": 4, "E606": 5}
        for problem in sorted(self.problems, key=lambda p: order.get(p.code, 9)):
            counts[problem.code] = counts.get(problem.code, 0) + 1
            if counts[problem.code] > LIMIT:
                skipped[problem.code] = skipped.get(problem.code, 0) + 1
                continue
            grid = self.grid()
            if problem.at is None:
                mark = None
            elif problem.at[0] == "step":
                mark = problem.at[1]
            else:
                mark = self.step(*problem.at)
            try:
                text = format_grid(grid, mark_step=mark, window=GRID_WINDOW)
            except Exception:  # noqa: BLE001 - a grid is a courtesy, never a crash
                text = None
            out.append(Diagnostic(problem.code, problem.message, problem.span, problem.hint, problem.notes, text))
        for code, count in skipped.items():
            index = max(i for i, d in enumerate(out) if d.code == code)
            out[index] = replace(out[index], notes=out[index].notes + (
                Note(f"and {count} more problem{'s' if count > 1 else ''} like this ({code}) not shown"),))
        return out


# ---- microbatch ranges: (first, last) inclusive, sorted, disjoint ------------------------------
def _ranges(ordered: list[int]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for value in ordered:
        if out and value == out[-1][1] + 1:
            out[-1] = (out[-1][0], value)
        else:
            out.append((value, value))
    return out


def _absent(values: set[int], total: int) -> list[tuple[int, int]]:
    """The ranges of 0..total-1 not in `values` (in time proportional to len(values))."""
    out, next_free = [], 0
    for first, last in _ranges(sorted(v for v in values if 0 <= v < total)):
        if first > next_free:
            out.append((next_free, first - 1))
        next_free = last + 1
    if next_free < total:
        out.append((next_free, total - 1))
    return out


def _subtract(ranges: list[tuple[int, int]], cut: list[int]) -> list[tuple[int, int]]:
    """`ranges` (sorted, disjoint) without the sorted values `cut`, in one pass over both (each range tried every
    value of `cut` before: 75 s of a 2.4 MB CSV's import)."""
    out, at = [], 0
    for first, last in ranges:
        at = bisect.bisect_left(cut, first, at)
        while at < len(cut) and cut[at] <= last:
            if cut[at] > first:
                out.append((first, cut[at] - 1))
            first = cut[at] + 1
            at += 1
        if first <= last:
            out.append((first, last))
    return out


def _count(ranges: list[tuple[int, int]]) -> int:
    return sum(last - first + 1 for first, last in ranges)


def _describe(ranges: list[tuple[int, int]]) -> str:
    """[(0, 2), (5, 5)] -> '0..2, 5' (as `diagnostics.describe_numbers`)."""
    return ", ".join(str(first) if first == last else f"{first}..{last}" for first, last in ranges)
