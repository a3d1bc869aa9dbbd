"""Shared test options: `--update-golden` rewrites golden files instead of comparing."""
from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "golden"
STDLIB = ROOT / "stdlib_plans"


def pytest_addoption(parser):
    parser.addoption("--update-golden", action="store_true", default=False,
                     help="rewrite golden files from the current output (review the diff like code)")


@pytest.fixture
def golden(request):
    """`golden(path, text)`: compare `text` with tests/golden/<path>, or rewrite it with --update-golden."""
    update = request.config.getoption("--update-golden")

    def compare(relative: str, text: str) -> None:
        path = GOLDEN / relative
        if update or not path.exists():
            if not update:
                pytest.fail(f"golden file {path} is missing: run pytest --update-golden and review it")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            return
        expected = path.read_text(encoding="utf-8")
        assert text == expected, f"output differs from {path}; if the change is intended, run --update-golden"

    return compare
