"""Benchmark: `plandsl inspect` of a Llama-3-70B-shaped Hugging Face model on the meta device (issue 18: < 10 s).

    python bench/bench_inspect.py            # prints a Markdown table for docs/benchmarks.md

Each case runs the real command in a fresh interpreter (`python -m plandsl.cli inspect ...`), so the figures
include importing torch and transformers; reported as wall time and CPU time (user + sys of the child),
best of `--repeat` runs. The in-process figure (imports already paid) splits off what the build and the
trace take.
"""
from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from timing import best  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
LLAMA3_70B = ('hf("LlamaForCausalLM", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, '
              'num_attention_heads=64, num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, '
              'rope_theta=500000.0)')
CASES = [("Llama-3-70B (HF, 80 layers)", LLAMA3_70B, 8192)]


def child(source: str, seq: int) -> tuple[float, float]:
    """(wall, CPU) seconds of `python -m plandsl.cli inspect SOURCE --seq SEQ` in a new process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    subprocess.run([sys.executable, "-m", "plandsl.cli", "inspect", source, "--seq", str(seq)], check=True,
                   capture_output=True, env=env)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from plandsl import api
    print("| model | seq | command, wall | command, CPU | in process (imports paid) | params | traced blocks |")
    print("|---|---|---|---|---|---|---|")
    for name, source, seq in CASES:
        runs = [child(source, seq) for _ in range(args.repeat)]
        wall, cpu = min(r[0] for r in runs), min(r[1] for r in runs)
        api.inspect_model(source, seq=seq)  # warm: torch and transformers imported
        inside, table = best(lambda source=source, seq=seq: api.inspect_model(source, seq=seq), args.repeat)
        print(f"| {name} | {seq:,} | {wall:.2f} s | {cpu:.2f} s | {inside:.2f} s | {table.params:,} | "
              f"{table.traced_blocks} of {len(table.blocks)} |")


if __name__ == "__main__":
    main()
