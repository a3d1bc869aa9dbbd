"""Benchmark: hostile input read through the bounded reader, as a real `plandsl` process.

    python bench/bench_input.py            # prints a Markdown table for docs/benchmarks.md

Each case runs the CLI in a child process and reports its exit status, wall time, CPU time (user +
system, which a loaded machine does not inflate) and peak resident memory (getrusage(RUSAGE_CHILDREN)
of a fresh wrapper process, so only that child counts; not RLIMIT_AS: torch maps much virtual memory). Target (issue 16): a diagnostic and exit 1 or 2 within
10 s and under 1 GB, whatever the input.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_MEASURE = """
import resource, subprocess, sys, time
stdin = open(sys.argv[1], "rb") if sys.argv[1] != "-" else subprocess.DEVNULL
start = time.perf_counter()
done = subprocess.run([sys.executable, "-m", "plandsl.cli", *sys.argv[2:]], stdin=stdin, capture_output=True)
usage = resource.getrusage(resource.RUSAGE_CHILDREN)
print(done.returncode, time.perf_counter() - start, usage.ru_utime + usage.ru_stime, usage.ru_maxrss)
"""


def measure(directory: str, stdin: str, *args: str) -> tuple[int, float, float, float]:
    out = subprocess.run([sys.executable, "-c", _MEASURE, stdin, *args], cwd=directory, capture_output=True,
                         text=True, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout.split()
    return int(out[0]), float(out[1]), float(out[2]), int(out[3]) / 1024


def main() -> None:
    with tempfile.TemporaryDirectory() as directory:
        base = Path(directory)
        with open(base / "big.plan", "wb") as handle:
            handle.truncate(100 * 2**20)
        (base / "zero.plan").symlink_to("/dev/zero")
        os.mkfifo(base / "fifo.plan")
        (base / "lets.plan").write_text("".join(f"let a{i} = {i}\n" for i in range(52_000)))  # > 250,000 tokens
        (base / "proc.plan").write_text('import "/proc/self/environ"\n')
        cases = [
            ("`plandsl check /dev/zero`", "-", ["check", "/dev/zero"]),
            ("`plandsl check zero.plan` (a link to /dev/zero)", "-", ["check", "zero.plan"]),
            ("`plandsl check fifo.plan` (a FIFO, no writer)", "-", ["check", "fifo.plan"]),
            ("`plandsl estimate big.plan` (100 MB, sparse)", "-", ["estimate", "big.plan"]),
            ("`plandsl fmt - < /dev/zero`", "/dev/zero", ["fmt", "-"]),
            ("`plandsl schedule zero.plan.csv` (a link to /dev/zero)", "-", ["schedule", "zero.plan.csv"]),
            ('`plandsl check proc.plan` (`import "/proc/self/environ"`)', "-", ["check", "proc.plan"]),
            ("`plandsl check lets.plan` (52,000 `let` lines: stops at 250,000 tokens)", "-", ["check", "lets.plan"]),
        ]
        (base / "zero.plan.csv").symlink_to("/dev/zero")
        print("| case | exit | wall (s) | CPU (s) | peak RSS (MiB) |")
        print("|---|---:|---:|---:|---:|")
        for name, stdin, args in cases:
            status, seconds, cpu, peak = measure(directory, stdin, *args)
            print(f"| {name} | {status} | {seconds:.2f} | {cpu:.2f} | {peak:.0f} |")
    print(f"\nmachine: {os.cpu_count()} cores, Python {sys.version.split()[0]}, load average "
          f"{' / '.join(f'{x:.1f}' for x in os.getloadavg())} (1 / 5 / 15 min) at the end")


if __name__ == "__main__":
    main()
