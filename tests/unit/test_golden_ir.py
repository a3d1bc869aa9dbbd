"""Golden resolved IR of every standard-library file that defines a plan.

`analysis.document.model_dump(mode="json")`, as `json.dumps(indent=1, sort_keys=True)`, must
equal tests/golden/ir/<path under stdlib_plans>.json. Files are discovered at test time;
after an intended change run `pytest tests/unit/test_golden_ir.py --update-golden` and
review the diff like code. Also: every stdlib document survives a model_validate round trip.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from plandsl import ir
from plandsl.check.analysis import analyze

ROOT = Path(__file__).resolve().parents[2]
STDLIB = ROOT / "stdlib_plans"
GOLDEN_IR = ROOT / "tests" / "golden" / "ir"

ALL_FILES = sorted(p.relative_to(STDLIB).as_posix() for p in STDLIB.rglob("*.plan"))


def _analyze(relative: str, monkeypatch):
    # The IR records the file as given; analyze from the repository root with a relative path
    # so the golden text does not depend on where the checkout lives.
    monkeypatch.chdir(ROOT)
    analysis = analyze(f"stdlib_plans/{relative}")
    assert analysis.ok, [(d.code, str(d.span), d.message) for d in analysis.diagnostics]
    assert analysis.document is not None
    return analysis


def _ir_text(document: ir.Document) -> str:
    return json.dumps(document.model_dump(mode="json"), indent=1, sort_keys=True) + "\n"


def _defines_a_plan(relative: str) -> bool:
    from plandsl.api import parse_file
    from plandsl.syntax import Definition
    try:
        module = parse_file(STDLIB / relative)
    except ValueError:
        return True  # a broken stdlib file must fail loudly below, not be skipped
    return any(isinstance(item, Definition) and item.kind == "plan" for item in module.items)


PLAN_FILES = [f for f in ALL_FILES if _defines_a_plan(f)]


def test_stdlib_has_plans_to_check():
    assert ALL_FILES, f"no .plan files under {STDLIB}"
    assert "clusters/dgx_a100.plan" in ALL_FILES


@pytest.mark.parametrize("relative", PLAN_FILES)
def test_golden_ir(relative, golden, monkeypatch):
    analysis = _analyze(relative, monkeypatch)
    assert analysis.document.plans, f"{relative} defines no plan"
    assert analysis.document.file == f"stdlib_plans/{relative}"
    golden(f"ir/{relative}.json", _ir_text(analysis.document))


def test_every_golden_has_a_stdlib_plan():
    """A golden file whose plan file was renamed or deleted is stale: delete it."""
    stale = sorted(p.relative_to(GOLDEN_IR).as_posix() for p in GOLDEN_IR.rglob("*.json")
                   if p.relative_to(GOLDEN_IR).as_posix()[:-len(".json")] not in PLAN_FILES)
    assert stale == [], f"stale golden files under {GOLDEN_IR}: {stale}"


@pytest.mark.parametrize("relative", ALL_FILES)
def test_ir_round_trip(relative, monkeypatch):
    document = _analyze(relative, monkeypatch).document
    dump = document.model_dump()
    assert ir.Document.model_validate(dump).model_dump() == dump
    as_json = document.model_dump(mode="json")
    again = ir.Document.model_validate(as_json)
    assert again.model_dump(mode="json") == as_json
    assert again.model_dump() == dump
    assert ir.Document.model_validate_json(document.model_dump_json()).model_dump() == dump


@pytest.mark.parametrize("relative", PLAN_FILES)
def test_ir_is_deterministic(relative, monkeypatch):
    first = _ir_text(_analyze(relative, monkeypatch).document)
    assert _ir_text(_analyze(relative, monkeypatch).document) == first
