"""Benchmark: how long `plandsl check` takes, in-process and from the shell.

    python bench/bench_check.py            # prints a Markdown table for docs/benchmarks.md

Cases (issue 2's speed targets): a generated plan with 10,000 layers on a 16,384-device mesh
(< 1 s), a typical 50-line plan after start-up (< 50 ms), `plandsl --help` start-up (< 0.5 s).
Each in-process figure is the best of several runs, reported with the parse-only time of the same
text as a peer in the same process, so the ratio says what lowering and checking add.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from timing import best  # noqa: E402
from gen_plans import big_custom_plan, big_gpt_explicit_plan, grouped_custom_plan  # noqa: E402

from plandsl.check.analysis import analyze  # noqa: E402
from plandsl.syntax.parser import decode, parse_source  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def case(name: str, path: Path, repeat: int = 5) -> tuple[str, int, float, float, list[str]]:
    text = path.read_text()
    analysis = analyze(str(path))  # warm: the parser is built once per process
    check = best(lambda: analyze(str(path)), repeat)[0]
    parse = best(lambda: parse_source(decode(str(path), text.encode())), repeat)[0]
    codes = sorted({d.code for d in analysis.diagnostics})
    return name, len(text.splitlines()), check, parse, codes


def shell(args: list[str], repeat: int = 5) -> float:
    return best(lambda: subprocess.run(args, capture_output=True, check=False), repeat)[0]


def main() -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        files = {
            "gpt(layers=10000), explicit 32-stage placement, dgx_a100 x 2048 (16,384 devices)": big_gpt_explicit_plan(),
            "custom model, 10,000 layers in 100 range declarations, 16,384 devices": grouped_custom_plan(),
            "custom model, 10,000 layers one per line (1 MB), 16,384 devices": big_custom_plan(),
        }
        for name, text in files.items():
            path = Path(tmp) / f"plan{len(rows)}.plan"
            path.write_text(text)
            rows.append(case(name, path, repeat=3 if len(text) > 100_000 else 5))
        for example in ("examples/gpt3_175b_3d.plan", "examples/heterogeneous.plan"):
            path = ROOT / "stdlib_plans" / example
            if path.exists():
                rows.append(case(f"stdlib_plans/{example}", path, repeat=20))
    print("| plan | lines | check (s) | parse only (s) | check / parse | diagnostics |")
    print("|---|---|---|---|---|---|")
    for name, lines, check, parse, codes in rows:
        print(f"| {name} | {lines:,} | {check:.3f} | {parse:.3f} | {check / parse:.2f} | {', '.join(codes) or '-'} |")
    plandsl = [sys.executable, "-m", "plandsl.cli"]
    python = shell([sys.executable, "-c", "pass"])
    helptime = shell(plandsl + ["--help"])
    example = ROOT / "stdlib_plans" / "examples" / "gpt3_175b_3d.plan"
    checktime = shell(plandsl + ["check", str(example)]) if example.exists() else float("nan")
    print()
    print("| command | wall time (s) | minus bare `python -c pass` (s) |")
    print("|---|---|---|")
    print(f"| `python -c pass` | {python:.3f} | - |")
    print(f"| `plandsl --help` | {helptime:.3f} | {helptime - python:.3f} |")
    print(f"| `plandsl check stdlib_plans/examples/gpt3_175b_3d.plan` | {checktime:.3f} | {checktime - python:.3f} |")
    print(f"\nmachine: {os.cpu_count()} cores, Python {sys.version.split()[0]}")


if __name__ == "__main__":
    main()
