"""Shared test options: `--update-golden` rewrites golden files instead of comparing; hypothesis's
profile."""
from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import settings

# No per-example wall-clock deadline (hypothesis's default is 200 ms): with other runs or xdist
# workers sharing the cores, or a first example that imports torch, a correct example takes longer,
# and hypothesis then reports it as a flaky failure. Work is bounded where it matters by
# tests/support.py's `bounded` (CPU time); a hang still fails through the tests' own deadlines.
settings.register_profile("plandsl", deadline=None)
settings.load_profile("plandsl")

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
