"""Benchmark: the parser on big files, against lark's own tree building and Transformer.

    python bench/bench_parse.py            # prints a Markdown table for docs/benchmarks.md

Each file is parsed by `syntax.parser.parse_source` (pass-through callbacks, the stack walk of
`syntax.build.build`) and, in the same process, the way the parser did before: a plain lark
parser and `Builder().transform` of its tree. Both give equal syntax trees, spans included
(tests/unit/test_parser.py). Figures are CPU seconds, best of 3, so other work on the machine
counts less than in wall time.
"""
from __future__ import annotations

import os
import sys
import time
from importlib import resources
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from gen_plans import big_custom_plan  # noqa: E402

from lark import Lark  # noqa: E402

from plandsl.diagnostics import PlanError  # noqa: E402
from plandsl.diagnostics.source import SourceFile  # noqa: E402
from plandsl.syntax.build import Builder  # noqa: E402
from plandsl.syntax.parser import MAX_TOKENS, _PostLex, deep_recursion, parse_source  # noqa: E402


def cpu(function, repeat: int = 3) -> tuple[float, str]:
    times, outcome = [], "ok"
    for _ in range(repeat):
        start = time.process_time()
        try:
            function()
        except PlanError as error:
            outcome = error.diagnostics[0].code
        except Exception as error:  # noqa: BLE001 - lark's own path raises its own exceptions at the cap
            outcome = type(error).__name__
        times.append(time.process_time() - start)
    return min(times), outcome


def main() -> None:
    grammar = resources.files("plandsl.grammar").joinpath("plan.lark").read_text(encoding="utf-8")
    plain = Lark(grammar, parser="lalr", lexer="contextual", postlex=_PostLex(), propagate_positions=True,
                 maybe_placeholders=True)

    def before(text: str) -> None:
        with deep_recursion():
            Builder().transform(plain.parse(text))

    chain = "let a0 = 1\n" + "".join(f"let a{i} = a{i - 1} + a{i - 1}\n" for i in range(1, 10_001))
    cases = [
        ("custom model, 10,000 layers one per line (1 MB, 220,000 tokens)", big_custom_plan()),
        ("10,000-link `let a(i) = a(i-1) + a(i-1)` chain (260 KB, 70,000 tokens)", chain),
        (f"52,000 `let` lines (1 MB): refused at {MAX_TOKENS:,} tokens", "".join(f"let a{i} = {i}\n" for i in range(52_000))),
        ("one list of 124,000 numbers (250,000 tokens, 0.7 MB)", "let x = [" + ", ".join(["12345"] * 124_000) + "]\n"),
    ]
    parse_source(SourceFile("warm.plan", "let x = 1\n"))
    print("| file | before (s CPU) | now (s CPU) | now / before | outcome |")
    print("|---|---:|---:|---:|---|")
    for name, text in cases:
        old, _ = cpu(lambda: before(text))
        new, outcome = cpu(lambda: parse_source(SourceFile("big.plan", text)))
        print(f"| {name} | {old:.2f} | {new:.2f} | {new / old:.2f} | {outcome} |")
    print(f"\nmachine: {os.cpu_count()} cores, Python {sys.version.split()[0]}")


if __name__ == "__main__":
    main()
