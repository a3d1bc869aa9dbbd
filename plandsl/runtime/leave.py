"""How a rank process ends: its entry point's status, then `os._exit`, without tearing torch.distributed down.

Stage: interpreter (rank side). Contract: `run_then_leave(main, failure_header)` runs `main()` (an int
status; `sys.exit`'s code counts too), prints the traceback of anything else it raises (after
`failure_header`, when given) with status 1, flushes stdout and stderr and leaves the process at once.
Destroying a gloo process group from Python joins its worker threads while holding the GIL; a worker
still releasing its last collective's tensors needs the GIL, and the rank hangs (seen with torch 2.13 at
the end of a run, e.g. DDP's Reducer dropping its group). The rank is done, so it exits at once; the
launcher and peers see a clean exit. `plandsl.run` (training) and `runtime.profile.rank` end this way.
Ctrl-C (SIGINT: the terminal's process group, or torch's launcher sending it on) ends a rank at once by the signal,
as the launcher's SIGTERM does, not as a KeyboardInterrupt: each rank printed its traceback, and a peer blocked in a
collective its `Connection reset by peer` error, above the launcher's own `interrupted by SIGINT` (`runtime.launch`).
"""
from __future__ import annotations

import os
import signal
import sys
import traceback
from typing import Callable, NoReturn


def run_then_leave(main: Callable[[], int], failure_header: str | None = None) -> NoReturn:
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C ends the rank by the signal, as SIGTERM does (above)
    status = 1
    try:
        status = main()
    except SystemExit as error:
        status = error.code if isinstance(error.code, int) else 1
    except BaseException:  # noqa: BLE001 - printed like Python would, then exit 1
        if failure_header:
            print(failure_header, file=sys.stderr)
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
