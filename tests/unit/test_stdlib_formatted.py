"""Every plan of the standard library is in canonical layout: `plandsl fmt` leaves it unchanged."""
from __future__ import annotations

from pathlib import Path

import pytest

from plandsl import api

ROOT = Path(__file__).resolve().parents[2]
STDLIB = ROOT / "stdlib_plans"
PLANS = sorted(STDLIB.rglob("*.plan"))


def _id(path: Path) -> str:
    return str(path.relative_to(STDLIB))


def test_there_are_plans():
    assert PLANS


@pytest.mark.parametrize("path", PLANS, ids=_id)
def test_is_a_fixed_point_of_the_formatter(path):
    text = path.read_text(encoding="utf-8")
    assert api.format_text(text, str(path)) == text, (
        f"{path.relative_to(ROOT)} is not formatted: run `plandsl fmt {path.relative_to(ROOT)}`")
