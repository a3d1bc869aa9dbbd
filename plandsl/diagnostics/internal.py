"""The last resort at the API/CLI boundary: an exception nothing expected becomes E108.

`with guard(file) as bug:` around one file's work (`api.check`) or a whole command (`cli`): an
`Exception` escaping the block is kept as `bug.diagnostic` (E108: a plandsl bug, the exception's
type and message, how to report it), so the caller reports it like any problem of that file and
goes on. No traceback is shown unless PLANDSL_DEBUG=1, which adds it as a note. Nor is an interruption a bug:
Ctrl-C's KeyboardInterrupt, or `Interrupted` where a signal stopped torch's launcher, passes through the guard, and
`interruption` names the signal and the exit status (128 + its number) the command line leaves with.
"""
from __future__ import annotations

import os
import signal
import traceback
from types import TracebackType

from plandsl.diagnostics import Diagnostic, Note, diag
from plandsl.diagnostics.source import NO_SPAN, Span

DEBUG = "PLANDSL_DEBUG"
MAX_MESSAGE = 300  # characters of the exception's message shown


def internal_error(error: BaseException, file: str | None = None) -> Diagnostic:
    """E108 for `error`, raised by plandsl itself while it worked on `file`."""
    text = " ".join(str(error).split())
    if len(text) > MAX_MESSAGE:
        text = text[:MAX_MESSAGE] + "..."
    what = f"{type(error).__name__}: {text}" if text else type(error).__name__
    span = Span(file, 1, 1, 1, 1) if file else NO_SPAN
    notes = [Note("traceback:\n" + "".join(traceback.format_exception(error)).rstrip())] if debugging() else []
    return diag("E108", f"internal error: {what}", span,
                hint=f"this is a bug in plandsl, not a problem of the plan: please report it to the plandsl "
                     f"maintainers with the command, the plan file(s) and this message"
                     f"{'' if debugging() else f'; {DEBUG}=1 adds the traceback'}", notes=notes)


class Interrupted(KeyboardInterrupt):
    """torch's launcher got a signal (Ctrl-C's SIGINT, SIGTERM, SIGHUP, SIGQUIT), sent it on to the ranks and
    stopped them (its SignalException, `runtime.launch.launcher_signals`): `signum`. A KeyboardInterrupt, as
    Ctrl-C's own, so that no boundary takes it for a plandsl bug (E108)."""

    def __init__(self, signum: int):
        self.signum = signal.Signals(signum)
        super().__init__(self.signum.name)


def interruption(error: KeyboardInterrupt) -> tuple[str, int]:
    """The signal that interrupted a command, by name (`Interrupted`'s; else Ctrl-C's SIGINT), and the exit status a
    shell reports for a process that signal ends: 128 + its number (130 for Ctrl-C, 143 for SIGTERM)."""
    signum = error.signum if isinstance(error, Interrupted) else signal.SIGINT
    return signum.name, 128 + signum


def debugging() -> bool:
    return os.environ.get(DEBUG, "") not in ("", "0")


class guard:  # noqa: N801 - used as `with guard(file) as bug:`
    """Keeps an unexpected exception of the block as `self.diagnostic` (E108) instead of raising it.
    `expected`: exception types that pass through (a CLI's usage errors and exits)."""

    def __init__(self, file: str | None = None, expected: tuple[type[BaseException], ...] = ()):
        self.file = file
        self.expected = expected
        self.diagnostic: Diagnostic | None = None

    def __enter__(self) -> "guard":
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> bool:
        if error is None or not isinstance(error, Exception) or isinstance(error, self.expected):
            return False  # KeyboardInterrupt, SystemExit and the expected ones go on
        self.diagnostic = internal_error(error, self.file)
        return True
