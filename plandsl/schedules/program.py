"""The schedule IR: per pipeline rank, an ordered list of actions, and the stage -> rank map.

An action is (stage, kind, microbatch), printed in torch.distributed.pipelining's notation
(`2F0`: stage 2, forward, microbatch 0; `1I3`, `0W1`, `3SEND_F5`) and parsed back exactly.
Compute kinds are F, B (full backward), I (input gradient), W (weight gradient); the
communication kinds are added by `schedules.lower.add_send_recv`, never written by hand.
Schedules with two pipelines (Chimera) give each pipeline its own stage -> rank map and say
which pipeline each microbatch takes. Frozen, slotted dataclasses: programs can hold
hundreds of thousands of actions (actions are named tuples, for speed).
"""
from __future__ import annotations

from collections import Counter

import contextlib
import gc
import re
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple


class Kind(str, Enum):
    F = "F"
    B = "B"
    I = "I"  # noqa: E741 - the notation's own letter
    W = "W"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"

    __hash__ = str.__hash__  # C-level, and equal to the hash of the letter it equals

    @property
    def is_compute(self) -> bool:
        return self in COMPUTE


COMPUTE = frozenset({Kind.F, Kind.B, Kind.I, Kind.W})
_ACTION = re.compile(r"([0-9]+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)([0-9]+)")  # ASCII digits: \\d takes '٣'
_DIGITS = 30  # a stage or microbatch number's digits: past 10^30, no schedule (int() refuses 4,300 with its own words)


class Action(NamedTuple):
    """One step of a rank's program. A named tuple, like torch's `_Action`: hashing and
    comparing hundreds of thousands of them is the hot path of validation and simulation."""

    stage: int
    kind: Kind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    def __repr__(self) -> str:
        return f"Action({self})"


def _shown_cell(text: str) -> str:
    """A cell as a message quotes it: on one line, each character that does not print escaped as Python's repr
    escapes it, the backslash too (a CSV cell's tab, or a U+2028 the csv module breaks no line at, was printed raw and
    broke the message, as 192f6ec's DeepSpeed keys did); a long one its start and end."""
    def printed(part: str) -> str:
        return "".join(c if c.isprintable() and c != "\\" else repr(c)[1:-1] for c in part)
    return printed(text) if len(text) <= 40 else f"{printed(text[:20])}...{printed(text[-10:])} ({len(text):,} characters)"


def parse_action(text: str) -> Action:
    """`2F0` -> Action(2, F, 0); ValueError for anything else."""
    match = _ACTION.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"'{_shown_cell(text)}' is not an action like 2F0 (stage, F/B/I/W, microbatch)")
    if max(len(match.group(1)), len(match.group(3))) > _DIGITS:
        raise ValueError(f"'{_shown_cell(text)}': a stage or microbatch number of more than {_DIGITS} digits")
    return Action(int(match.group(1)), Kind(match.group(2)), int(match.group(3)))


@dataclass(frozen=True, slots=True)
class Schedule:
    """What each pipeline rank runs, in order.

    `stage_to_rank[p][s]` is the rank of stage `s` in pipeline `p` (one pipeline for all
    schedules but `chimera`); `microbatch_pipeline[m]` the pipeline microbatch `m` takes
    (empty: all take pipeline 0).
    """

    name: str
    ranks: int
    stages: int
    microbatches: int
    stage_to_rank: tuple[tuple[int, ...], ...]
    actions: tuple[tuple[Action, ...], ...]
    microbatch_pipeline: tuple[int, ...] = ()

    @property
    def virtual(self) -> int:
        return self.stages // self.ranks if self.ranks else 0

    def pipeline_of(self, microbatch: int) -> int:
        return self.microbatch_pipeline[microbatch] if self.microbatch_pipeline else 0

    def rank_of(self, action: Action) -> int:
        return self.stage_to_rank[self.pipeline_of(action.microbatch)][action.stage]

    @property
    def num_actions(self) -> int:
        return sum(len(row) for row in self.actions)

    def compute_only(self) -> "Schedule":
        """The same schedule without communication actions."""
        rows = tuple(tuple(a for a in row if a.kind.is_compute) for row in self.actions)
        return Schedule(self.name, self.ranks, self.stages, self.microbatches, self.stage_to_rank, rows,
                        self.microbatch_pipeline)


@contextlib.contextmanager
def gc_paused():
    """Pause the cyclic garbage collector while a pass builds hundreds of thousands of tuples.

    Programs are acyclic (tuples of named tuples), so the collector's passes over them free
    nothing; on a 262k-action schedule they cost ~40% of generate + simulate + validate."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def loop_map(ranks: int, stages: int) -> tuple[int, ...]:
    """Stage s on rank s mod ranks: contiguous for one stage per rank, looped/interleaved beyond."""
    return tuple(s % ranks for s in range(stages))


def vshape_map(ranks: int) -> tuple[int, ...]:
    """Two stages per rank in a V: rank r holds stages r and 2p-1-r."""
    return tuple(s if s < ranks else 2 * ranks - 1 - s for s in range(2 * ranks))


def format_rows(schedule: Schedule) -> list[str]:
    """One line per rank: `rank r: 0F0 0F1 ...` (order only, no time alignment)."""
    width = len(str(schedule.ranks - 1))
    return [f"rank {r:>{width}}: " + " ".join(map(str, row)) for r, row in enumerate(schedule.actions)]


def to_csv(grid: list[list[Action | None]]) -> str:
    """torch's compute-only CSV: one row per rank, one action per cell, an idle step an empty cell."""
    return "".join(",".join("" if a is None else str(a) for a in row) + "\n" for row in grid)


class CellError(ValueError):
    """A CSV cell that is not an action: the message says its line; `start`, `end` are its offsets in the text."""

    def __init__(self, message: str, start: int, end: int):
        super().__init__(message)
        self.start, self.end = start, end


_LINE_BREAK = re.compile(r"\r\n|\r|\n")
_RECORD_TOKENS = re.compile(r'\r\n|[\r\n,"]')


def csv_lines(text: str) -> list[tuple[int, str]]:
    """The CSV's records as (offset of the record, its text), broken as the csv module breaks them (torch reads the
    file with it, excel's dialect): at \\r\\n, \\r or \\n alone, nothing else (`str.splitlines` also breaks at form feeds
    and the like), and not inside a quoted cell (`"0F0"`, as a spreadsheet may write every cell: a cell opens a quote
    with its first character, `""` inside is a quote, and the quote's cell runs to its closing quote, line breaks and
    commas included)."""
    lines, start = [], 0
    if '"' not in text:
        for match in _LINE_BREAK.finditer(text):
            lines.append((start, text[start:match.start()]))
            start = match.end()
    else:
        field, closed, quoted = 0, -2, False  # where the cell starts; the last closing quote; inside a quoted cell
        for match in _RECORD_TOKENS.finditer(text):
            token, at = match.group(), match.start()
            if token == '"':
                if quoted:
                    quoted, closed = False, at
                elif at == field or at == closed + 1:  # a cell's opening quote, or the second of a doubled one
                    quoted = True
            elif quoted:
                continue
            elif token == ",":
                field = at + 1
            else:
                lines.append((start, text[start:at]))
                start = field = match.end()
    if start < len(text):
        lines.append((start, text[start:]))
    return lines


def csv_cells(offset: int, line: str) -> list[tuple[int, str]]:
    """A CSV record's cells as (offset of the cell's text, its text), read as the csv module reads them: a quoted
    cell's text without its quotes (from the offset after the opening one), `""` inside it read as `"`, anything
    written after its closing quote up to the next comma kept, as the module keeps it; an unterminated quote runs to
    the record's end."""
    if '"' not in line:
        cells = []
        for cell in line.split(","):
            cells.append((offset, cell))
            offset += len(cell) + 1
        return cells
    cells, start, size = [], 0, len(line)
    while True:
        if line.startswith('"', start):
            parts, at = [], start + 1
            while True:
                close = line.find('"', at)
                if close < 0:
                    parts.append(line[at:])
                    at = size
                    break
                parts.append(line[at:close])
                if line.startswith('"', close + 1):  # a doubled quote: one quote of the text
                    parts.append('"')
                    at = close + 2
                    continue
                at = close + 1
                break
            comma = line.find(",", at)
            end = size if comma < 0 else comma
            parts.append(line[at:end])
            cells.append((offset + start + 1, "".join(parts)))
        else:
            comma = line.find(",", start)
            end = size if comma < 0 else comma
            cells.append((offset + start, line[start:end]))
        if comma < 0:
            return cells
        start = comma + 1


def cell_error(text: str, at: int, cell: str, error: ValueError) -> CellError:
    """`error` of the cell `cell` at offset `at` of the CSV `text`, located at the cell's text (its spaces left out),
    the message naming its line as the source is quoted (`csv_lines`' breaks, counted inside a quoted cell too: a record
    after a quoted cell that holds a line break starts on a later line than its number)."""
    start, end = cell_span(text, at, cell)
    return CellError(f"line {line_number(text, at)}: {error}", start, max(end, start + 1))


def cell_span(text: str, at: int, cell: str) -> tuple[int, int]:
    """Where the cell `cell` at offset `at` of the CSV `text` (`csv_cells`' pair) is written, its spaces left out: a
    quoted cell's text read back to the file's characters, its `""` two of them for the one `"` it reads as, its
    closing quote and what follows it up to the comma included where the cell's text goes on past them (`"0F""1"`:
    `0F""1`, not the four characters `0F"1` counts from the opening quote)."""
    lead, stripped = len(cell) - len(cell.lstrip()), cell.strip()
    if at == 0 or text[at - 1] != '"':  # unquoted: as written
        return at + lead, at + lead + len(stripped)
    starts, ends, j, inside, size = [], [], at, True, len(text)
    while len(starts) < len(cell) and j < size:  # each character of the cell's text: where it is written
        if inside and text[j] == '"':
            if not text.startswith('"', j + 1):  # the closing quote: no character of the text
                inside = False
                j += 1
                continue
            width = 2  # a doubled quote, one `"` of the text
        else:
            width = 1
        starts.append(j)
        ends.append(j + width)
        j += width
    if not stripped or lead + len(stripped) > len(starts):
        return at + lead, at + lead + len(stripped)
    return starts[lead], ends[lead + len(stripped) - 1]


def line_number(text: str, at: int) -> int:
    """The line of offset `at` of the CSV `text`, its lines broken as `csv_lines` breaks them."""
    return len(_LINE_BREAK.findall(text, 0, at)) + 1


def from_csv(text: str) -> list[tuple[int, str, list[Action | None]]]:
    """Records of a torch CSV back to actions, as torch reads them (`csv.reader`, each record a rank's row): (offset
    of the record, its text, its row: empty cells are idle steps, a blank line a row of none); CellError (a
    ValueError) on bad cells."""
    rows = []
    for offset, line in csv_lines(text):
        row = []
        for at, cell in csv_cells(offset, line):
            try:
                row.append(parse_action(cell) if cell.strip() else None)
            except ValueError as error:
                raise cell_error(text, at, cell, error) from None
        rows.append((offset, line, row))
    return rows


def derive_stage_map(rows, ranks: int, stages: int) -> tuple[int, ...]:
    """Stage s -> the rank that runs most of its actions (the lowest on a tie; the loop map
    for a stage that never runs)."""
    counts: dict[int, Counter] = {}
    for rank, row in enumerate(rows):
        for action in row:
            counts.setdefault(action.stage, Counter())[rank] += 1
    default = loop_map(ranks, stages)
    result = []
    for stage in range(stages):
        found = counts.get(stage)
        result.append(min(found, key=lambda r: (-found[r], r)) if found else default[stage])
    return tuple(result)
