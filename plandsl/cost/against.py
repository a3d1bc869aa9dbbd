"""A plan's estimate against what a run of it measured: `plandsl estimate PLAN --against METRICS.jsonl`.

Stage: cost model. Contract: `read_metrics(path)` reads the JSON lines `plandsl run --metrics` writes (one
per step: `step`, `step_time_s`, `tokens_per_s`, `peak_memory_bytes`), bounded, refusing a file it cannot read or
that records no step (`MetricsError` carrying E809) and a malformed line (E810, at the line: its file and number,
the column where json names one); `compare(estimate, records)` sets each figure the cost
model predicts beside the measured one, as the median over the steps after the first `warmup` (the first
step allocates and warms caches) with their min and max, and the error; `format_against` prints it.
The metrics hold a step's totals only: its compute, communication and bubble cannot be told apart.
"""
from __future__ import annotations

import json
import math
import re
import statistics
from dataclasses import dataclass

from plandsl.cost.estimate import PlanEstimate
from plandsl.diagnostics import Diagnostic, diag
from plandsl.diagnostics.source import SourceFile
from plandsl.lower.units import format_bytes
from plandsl.syntax.files import FileProblem, read_bounded

MAX_METRICS_BYTES = 64 * 2**20
"""A metrics line is ~150 bytes: 64 MiB holds ~400,000 steps."""
WARMUP_STEPS = 1


class MetricsError(ValueError):
    """The metrics file cannot be read or records no step (E809), or a line of it is not a step's record (E810, at
    the line); `.diagnostic` says which, `.sources` holds the file's text for the caret (E810)."""

    def __init__(self, diagnostic: Diagnostic, sources: dict[str, SourceFile] | None = None):
        super().__init__(diagnostic.message)
        self.diagnostic = diagnostic
        self.sources = dict(sources or {})


RECORD = ("each line is one step's JSON object, as `plandsl run --metrics` writes it: \"step\" (a number at least 0), "
          "\"step_time_s\" and \"tokens_per_s\" (finite numbers above 0), and optionally \"peak_memory_bytes\" and "
          "\"peak_reserved_bytes\" (at least 0); other keys are ignored")
"""E810's hint: what a step's record must hold."""


def _unread(message: str) -> MetricsError:
    return MetricsError(diag("E809", message, hint="give the JSON lines `plandsl run --metrics FILE` wrote (one per "
                                                   "step; a run stopped before its first step writes none)"))


@dataclass(frozen=True, slots=True)
class Row:
    name: str
    predicted: float
    measured: float      # the median over the steps compared
    low: float
    high: float
    note: str = ""

    @property
    def error(self) -> float | None:
        """(predicted - measured) / measured; None where it is no number: a measured peak of 0, or a measurement so
        small that the quotient overflows (a time of 1e-320 s), which JSON cannot write and text would print as inf."""
        error = (self.predicted - self.measured) / self.measured if self.measured else math.inf
        return error if math.isfinite(error) else None


@dataclass(frozen=True, slots=True)
class Against:
    path: str
    steps: tuple[int, ...]        # the steps compared
    skipped: int                  # the warm-up steps left out
    rows: tuple[Row, ...]

    def to_json(self) -> dict:
        return {"metrics": self.path, "steps": list(self.steps), "warmup_steps_skipped": self.skipped,
                "rows": [{"name": r.name, "predicted": r.predicted, "measured_median": r.measured,
                          "measured_min": r.low, "measured_max": r.high, "error": r.error, "note": r.note}
                         for r in self.rows]}


OPTIONAL = ("peak_memory_bytes", "peak_reserved_bytes")
"""A record's figures that may be absent: the peak allocation (or resident set), the allocator's peak reserve (CUDA)."""


_LONE_CR = re.compile(r"\r(?!\n)")


def read_metrics(path: str) -> list[dict]:
    try:
        data = read_bounded(path, MAX_METRICS_BYTES, "metrics file")
    except FileProblem as problem:
        raise _unread(str(problem)) from None
    # Lines end at \n, \r\n or a lone \r (universal newlines, as `open` reads them), made \n one for one so that
    # offsets and E810's line numbers stay the file's; not at what else `str.splitlines` breaks at (U+2028, \x0c,
    # \x1c-\x1e, \x85), which a JSON string may hold unescaped.
    text = _LONE_CR.sub("\n", data.decode("utf-8-sig", errors="replace"))
    records, offset = [], 0
    for piece in text.split("\n"):  # the line's offset kept: E810's span
        start, offset = offset, offset + len(piece) + 1
        line = piece.removesuffix("\r")
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise ValueError("not an object")
            for key in ("step", "step_time_s", "tokens_per_s") + OPTIONAL:
                if key in record or key not in OPTIONAL:
                    figure = _measured(record.get(key), key)
                    record[key] = record[key] if key == "step" else figure  # steps printed as written
        except RecursionError:  # json's decoder recurses once per nested array or object
            raise _bad_line(path, text, start, line, "nested too deeply") from None
        except json.JSONDecodeError as error:  # at the character json stopped at
            raise _bad_line(path, text, start, line, error.msg, error.pos) from None
        except ValueError as error:
            raise _bad_line(path, text, start, line, str(error)) from None
        records.append(record)
    if not records:
        raise _unread(f"{path}: no step recorded")
    return records


def _bad_line(path: str, text: str, start: int, line: str, why: str, at: int | None = None) -> MetricsError:
    """E810 at the line (from `start`, its offset in `text`; at its character `at` where json names one)."""
    source = SourceFile(path, text)
    span = source.span(start + at, start + at + 1) if at is not None else source.span(start, start + len(line))
    return MetricsError(diag("E810", f"not a step's record of `plandsl run --metrics` ({why})", span, hint=RECORD),
                        {path: source})


def _measured(value: object, key: str) -> float:
    """A record's figure as a finite number, positive for a time and a rate (json reads NaN, Infinity and integers of
    any size, which compare() would turn into nan and inf errors, or overflow dividing)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"no number '{key}'")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    least, words = (0.0, "at least 0") if key in ("step", *OPTIONAL) else (math.ulp(0.0), "above 0")
    if not math.isfinite(number) or number < least:
        raise ValueError(f"'{key}' is {value if isinstance(value, float) else _short(value)}, not a finite number "
                         f"{words}")
    return number


def _short(value: int) -> str:
    return str(value) if abs(value) < 10**30 else f"an integer of {len(str(abs(value)))} digits"


def compare(estimate: PlanEstimate, records: list[dict], path: str = "", warmup: int = WARMUP_STEPS) -> Against:
    ordered = sorted(records, key=lambda r: r["step"])
    skipped = min(warmup, len(ordered) - 1)
    kept = ordered[skipped:]

    def row(name: str, predicted: float, values: list[float], note: str = "") -> Row:
        return Row(name, predicted, statistics.median(values), min(values), max(values), note)

    rows = [row("step time (s)", estimate.time.step, [r["step_time_s"] for r in kept],
                "the metrics give a step's total: compute, communication and bubble are not told apart"),
            row("tokens/s", estimate.tokens_per_s, [r["tokens_per_s"] for r in kept])]
    memory = [r["peak_memory_bytes"] for r in kept if isinstance(r.get("peak_memory_bytes"), (int, float))]
    if memory:
        rows.append(row("peak memory (bytes)", estimate.peak_memory_bytes, memory,
                        "CUDA: allocated by torch; CPU: the process's resident set, the interpreter and torch included"))
    reserved = [r["peak_reserved_bytes"] for r in kept if isinstance(r.get("peak_reserved_bytes"), (int, float))]
    if reserved:
        rows.append(row("peak reserved (bytes)", estimate.peak_memory_bytes, reserved,
                        "CUDA: what torch's caching allocator reserved (torchtitan's reported memory); the model counts "
                        "tensors, so the error beyond the allocated row's is the allocator's"))
    return Against(path, tuple(r["step"] for r in kept), skipped, tuple(rows))


def format_against(against: Against) -> str:
    lines = [f"against {against.path}: steps {against.steps[0]}-{against.steps[-1]} ({len(against.steps)}; the first "
             f"{against.skipped} left out as warm-up)" if against.skipped else
             f"against {against.path}: steps {against.steps[0]}-{against.steps[-1]} ({len(against.steps)})",
             f"  {'':20} {'predicted':>12} {'measured':>12} {'(min':>12} {'max)':>12} {'error':>8}"]
    for r in against.rows:
        show = format_bytes if "bytes" in r.name else (lambda v: f"{v:.4g}")
        lines.append(f"  {r.name:20} {show(r.predicted):>12} {show(r.measured):>12} {show(r.low):>12} "
                     f"{show(r.high):>12} {'n/a' if r.error is None else format(r.error, '+.1%'):>8}")
    lines += [f"  note: {r.name}: {r.note}" for r in against.rows if r.note]
    return "\n".join(lines)


__all__ = ["Against", "Row", "MetricsError", "read_metrics", "compare", "format_against", "MAX_METRICS_BYTES"]
