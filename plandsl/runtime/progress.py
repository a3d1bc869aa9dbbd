"""What rank 0 reports while training: the metrics file, and one line per step or a progress bar.

Stage: interpreter (rank 0 only). Contract: `Reporter.step(record)` appends the step's JSON line to the
metrics file and shows it: a progress bar redrawn in place when the stream is a terminal, else one
line per step; `note(text)` prints between steps; `close()` ends both. A resumed run keeps the file's
lines up to the step it resumes from, so the file stays one line per step.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import sys
from pathlib import Path
from typing import TextIO

BAR_WIDTH = 24
_LINE = 1 << 16  # a metrics line is ~200 bytes; a longer one is read in pieces and dropped
_CLEAR = "\r\x1b[K"  # back to the start of the line, erase it


class Reporter:
    def __init__(self, steps: int, first_step: int = 0, metrics: str | Path | None = None,
                 quiet: bool = False, stream: TextIO | None = None):
        self.steps, self.first_step = steps, first_step
        self.stream = sys.stdout if stream is None else stream
        self.quiet = quiet
        self.bar = not quiet and self.stream.isatty()
        self.drawn = ""  # the bar's current text, "" when none is on screen
        self.elapsed: list[float] = []
        self.metrics = _open_metrics(Path(metrics), first_step) if metrics else None

    def step(self, record: dict) -> None:
        if self.metrics is not None:
            self.metrics.write(json.dumps(record) + "\n")
            self.metrics.flush()
        self.elapsed.append(record["step_time_s"])
        if self.bar:
            # Cut to the terminal's width: a wrapped line would not be redrawn in place.
            self.drawn = bar_line(record, self.steps, self.elapsed)[:shutil.get_terminal_size().columns - 1]
            self.stream.write(_CLEAR + self.drawn)
            self.stream.flush()
        elif not self.quiet:
            print(f"step {record['step']}: loss {record['loss']:.6f}, {record['step_time_s']:.3f} s, "
                  f"{record['tokens_per_s']:.0f} tokens/s", file=self.stream, flush=True)

    def note(self, text: str) -> None:
        if self.quiet:
            return
        if self.drawn:
            self.stream.write(_CLEAR + text + "\n" + self.drawn)
            self.stream.flush()
        else:
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        if self.drawn:
            self.stream.write("\n")
            self.stream.flush()
            self.drawn = ""
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None


def bar_line(record: dict, steps: int, elapsed: list[float]) -> str:
    """`step 3/10 [#######.................]  30% | loss 5.123456 | 6275 tokens/s | eta 0:07`
    (the time left: this run's mean step time so far times the steps left)."""
    step = record["step"]
    filled = round(BAR_WIDTH * step / steps) if steps else BAR_WIDTH
    left = (steps - step) * sum(elapsed) / len(elapsed)
    minutes, seconds = divmod(math.ceil(left), 60)
    return (f"step {step}/{steps} [{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {100 * step // steps:3d}% | "
            f"loss {record['loss']:.6f} | {record['tokens_per_s']:.0f} tokens/s | eta {minutes}:{seconds:02d}")


def _open_metrics(path: Path, first_step: int) -> TextIO:
    """The metrics file, emptied; when resuming after step `first_step`, with its lines up to that step."""
    kept = []
    if first_step and os.path.isfile(path):  # a regular file only, read a line at a time (a line at most _LINE)
        with open(path, "rb") as handle:
            while len(kept) < first_step and (line := handle.readline(_LINE)):
                try:
                    if json.loads(line)["step"] <= first_step:
                        kept.append(line.decode("utf-8").rstrip("\r\n") + "\n")
                except (ValueError, KeyError, TypeError):
                    continue
    handle = open(path, "w", encoding="utf-8")
    handle.writelines(kept)
    handle.flush()
    return handle
