"""Golden files of `estimate --json` and `generate --from EXAMPLE --json` for every stdlib example
(tests/golden/estimate/, tests/golden/generate/; `pytest --update-golden` rewrites them).

The CLI runs in-process from the repository root on the relative path, so no absolute path enters
the output; neither command prints a timing. Floats are written to 10 significant digits: the
figures come from the cost model's arithmetic (logs, powers, sums in a fixed order), and a last-bit
difference between two libm builds is not a change of the model."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from plandsl.cli import main

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted(p.stem for p in (ROOT / "stdlib_plans" / "examples").glob("*.plan"))
COMMANDS = {"estimate": lambda path: ["estimate", path, "--json"],
            "generate": lambda path: ["generate", "--from", path, "--json"]}


def _rounded(value):
    if isinstance(value, float):
        return float(f"{value:.10g}")
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    return value


# `generate --json` reports whether `plandsl run` runs each candidate; for per-module shard rules it asks
# runtime/parallel/tensor_parallel, which imports torch (~3 CPU-s). Such cases join the xdist group of the
# modules that import torch (tests/conftest.py), so that one worker imports it, not both.
IMPORTS_TORCH = {("generate", "shard_rules")}


def _cases():
    for example in EXAMPLES:
        for command in COMMANDS:
            marks = [pytest.mark.xdist_group("torch")] if (command, example) in IMPORTS_TORCH else []
            yield pytest.param(command, example, marks=marks, id=f"{example}-{command}")


@pytest.mark.parametrize("command, example", list(_cases()))
def test_json_of_every_example(command, example, golden, monkeypatch):
    monkeypatch.chdir(ROOT)
    result = CliRunner().invoke(main, COMMANDS[command](f"stdlib_plans/examples/{example}.plan"))
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert str(ROOT) not in result.output
    golden(f"{command}/{example}.json", json.dumps(_rounded(data), indent=1) + "\n")


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_golden_has_an_example(command):
    """A golden file whose example was renamed or deleted is stale: delete it."""
    stale = sorted(p.stem for p in (ROOT / "tests" / "golden" / command).glob("*.json") if p.stem not in EXAMPLES)
    assert stale == [], f"stale golden files under tests/golden/{command}: {stale}"
