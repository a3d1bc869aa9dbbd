"""tests/support.py's CPU bound: more work fails it on any machine; a slower machine is judged at its speed."""
from __future__ import annotations

import time

import pytest

from tests import support


def _busy(seconds: float) -> None:
    start = time.process_time()
    while time.process_time() - start < seconds:
        pass


def test_a_block_over_its_bound_fails_however_slow_the_machine_now():
    with pytest.raises(AssertionError, match=r"used 0\.\d s of CPU \(bound 0\.01 s, x \d+\.\d\d for this"):
        with support.bounded(0.01, "the busy loop"):
            _busy(0.3)  # 30x its bound: a slow day is 1.3-1.4x


def test_a_block_over_its_bound_on_a_slower_machine_is_judged_at_that_speed(monkeypatch):
    monkeypatch.setattr(support, "reference_cpu_s", lambda: support.REFERENCE_CPU_S * 4)
    with support.bounded(0.05, "the busy loop"):  # 0.1 s: twice its bound, on a machine 4x slower
        _busy(0.1)
    monkeypatch.setattr(support, "reference_cpu_s", lambda: support.REFERENCE_CPU_S / 4)  # faster: bound stands
    with pytest.raises(AssertionError, match=r"x 1\.00"):
        with support.bounded(0.05, "the busy loop"):
            _busy(0.1)
