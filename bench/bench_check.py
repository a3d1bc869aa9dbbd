"""Benchmark: how long `plandsl check` takes, in-process and from the shell.

    python bench/bench_check.py            # prints a Markdown table for docs/benchmarks.md
    python bench/bench_check.py --torch    # a plan over a cached Hugging Face model against the same family

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


TORCH_PAIR = ("""import "clusters/dgx_a100"
plan p {{
  model   = {model}
  cluster = dgx_a100 x 8
  mesh    = [dp = 4, pp = 4, tp = 4]
  train   = {{ global_batch: 64, micro_batch: 1, seq: 8192, recompute: full }}
  data    = zero3 over dp
  tensor  = megatron over tp
  stages  = evenly over pp
  schedule = 1f1b
}}
""", 'hf("LlamaForCausalLM", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64, '
     'num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, tie_word_embeddings=false)',
     "llama(layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=128256, seq=8192)")


def torch_pair() -> None:
    """Issue 18: `check` of a plan over a cached model from torch (Llama-3-70B's shape through `hf(...)`,
    its table inspected once beforehand) against the same plan over plandsl's `llama(...)` family."""
    from plandsl import api
    text, hf, family = TORCH_PAIR
    with tempfile.TemporaryDirectory() as tmp:
        paths = {}
        for name, model in (("hf(...) from its cached table", hf), ("llama(...) family", family)):
            paths[name] = Path(tmp) / f"{len(paths)}.plan"
            paths[name].write_text(text.format(model=model))
        api.inspect_plan(paths["hf(...) from its cached table"])  # the table beside the plan, once
        print("| Llama-3-70B shape, 128 devices | check in process (s) | `plandsl check` wall (s) | diagnostics |")
        print("|---|---|---|---|")
        for name, path in paths.items():
            _, _, check, _, codes = case(name, path, repeat=10)
            command = shell([sys.executable, "-m", "plandsl.cli", "check", str(path)])
            print(f"| {name} | {check:.3f} | {command:.3f} | {', '.join(codes) or '-'} |")
    print(f"\nmachine: {os.cpu_count()} cores, Python {sys.version.split()[0]}")


def main() -> None:
    if "--torch" in sys.argv:
        torch_pair()
        return
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
