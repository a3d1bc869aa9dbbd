"""How a rank process ends (plandsl.runtime.leave.run_then_leave), in a fresh process: without torch."""
from __future__ import annotations

import signal
import subprocess
import sys

from tests.conftest import ROOT

# a rank as torchrun starts it: Ctrl-C's handler Python's own (the launcher's handler is not inherited across exec);
# its main gets SIGINT, from the terminal's process group or sent on by the launcher, while it works
RANK = """\
import os, signal, time
from plandsl.runtime.leave import run_then_leave
signal.signal(signal.SIGINT, signal.default_int_handler)
def main():
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(30)
    return 0
run_then_leave(main, "rank 0 failed:")
"""


def test_ctrl_c_ends_a_rank_at_once_without_a_traceback():
    """Ctrl-C reaches every rank of `plandsl run` (the terminal's process group, and torch's launcher sends it on):
    each printed a KeyboardInterrupt traceback and exited 1, its peers a `Connection reset by peer` error and
    traceback, above the launcher's `interrupted by SIGINT`. A rank now ends by the signal at once, as the launcher's
    SIGTERM ends it, and prints nothing: the launcher says what happened."""
    done = subprocess.run([sys.executable, "-c", RANK], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == -signal.SIGINT, (done.returncode, done.stderr)
    assert done.stdout == "" and done.stderr == "", done.stderr
