"""The Markdown tables bench/bench_search.py prints for docs/benchmarks.md."""
import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "bench_search.py"


def _cells(row: str) -> int:
    return row.count("|") - 1


def test_the_limited_table_has_a_delimiter_cell_under_each_header_cell(monkeypatch):
    """`--limited --peer` printed 12 header cells over 11 delimiter cells (the count of " | " in the header, which
    misses one), and GitHub's Markdown renders no table then; so did `timings`, whose tables docs/benchmarks.md
    holds."""
    spec = importlib.util.spec_from_file_location("bench_search", BENCH)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench)  # its dataclasses look their module up
    spec.loader.exec_module(bench)
    limited_cases = bench.limited_cases
    monkeypatch.setattr(bench, "limited_cases", lambda: limited_cases()[:1])
    monkeypatch.setattr(bench, "_child", lambda index, root, limit=None, steps=False: {"cpu": 1.0, "step": 2.0})
    for peer in (None, "peer"):
        head, rule, row = bench.limited(peer).splitlines()
        assert _cells(rule) == _cells(head) == _cells(row) and set(rule) == {"|", "-"}
