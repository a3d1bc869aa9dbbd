"""The one timing helper of the benchmarks: best of several runs, with the last result."""
from __future__ import annotations

import time


def best(function, repeat: int = 3) -> tuple[float, object]:
    """(fastest wall time in seconds, the result of the last run)."""
    times, result = [], None
    for _ in range(repeat):
        start = time.perf_counter()
        result = function()
        times.append(time.perf_counter() - start)
    return min(times), result
