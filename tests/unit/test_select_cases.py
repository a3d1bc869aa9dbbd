"""tests/select_cases.py: the cases a sweep keeps exercise every branch its cases exercise, cheapest first."""
from __future__ import annotations

from tests.conftest import sweep_cases
from tests.select_cases import cover


def test_the_kept_cases_cover_every_branch_and_prefer_the_cheap_ones():
    cases = {"t[a]": frozenset({1, 2, 3}), "t[b]": frozenset({1, 2}), "t[c]": frozenset({3, 4}),
             "t[d]": frozenset({4})}
    seconds = {"t[a]": 30.0, "t[b]": 1.0, "t[c]": 2.0, "t[d]": 1.0}
    kept = cover(cases, seconds)
    assert frozenset().union(*(cases[case] for case in kept)) == {1, 2, 3, 4}
    assert kept == ["t[b]", "t[c]"]  # t[a] adds its branches at 30 s, t[d] nothing once t[c] is kept


def test_a_case_that_adds_nothing_is_left_out_and_one_is_always_kept():
    assert cover({"t[a]": frozenset({1}), "t[b]": frozenset({1})}, {"t[a]": 2.0, "t[b]": 1.0}) == ["t[b]"]
    assert cover({"t[a]": frozenset(), "t[b]": frozenset()}, {"t[a]": 2.0, "t[b]": 1.0}) == ["t[b]"]


def test_the_list_names_cases_of_parametrized_tests_only():
    listed = sweep_cases()
    assert all("::" in case and case.endswith("]") and "@" not in case for case in listed)


def test_a_case_adding_few_branches_a_second_is_left_out_at_a_threshold():
    cases = {"t[a]": frozenset(range(100)), "t[b]": frozenset(range(90, 130)), "t[c]": frozenset(range(95, 103))}
    seconds = {"t[a]": 10.0, "t[b]": 10.0, "t[c]": 1.0}
    assert cover(cases, seconds) == ["t[a]", "t[b]"]  # t[c]'s branches are the others'
    assert cover(cases, seconds, per_second=2.0) == ["t[a]", "t[b]"]  # t[b] adds 3 a second
    assert cover(cases, seconds, per_second=3.0) == ["t[a]"]  # the first whatever the others add


def test_select_writes_what_it_measured_and_keeps_what_it_did_not(tmp_path, monkeypatch):
    """A measurement of some cases only: of those, the list names the ones left out; a case listed before and not
    measured stays listed, one measured and now kept leaves the list, and a block written by hand stays as it was."""
    from tests import select_cases
    path = tmp_path / "sweep_cases.txt"
    path.write_text("# header\n# Measured: before.\nt.py::a[1]\nt.py::a[2]\nt.py::b[1]\n"
                    "# By hand, not by select: why.\nt.py::c[1]\n", encoding="utf-8")
    monkeypatch.setattr(select_cases, "LIST", path)
    summary = {"t.py::a": select_cases.Sweep(3, 1, 30.0, 10.0, 100, 90)}
    select_cases.write(["t.py::a[3]"], summary, 30.0, {"t.py::a[1]", "t.py::a[3]", "t.py::a[4]"})
    lines = path.read_text(encoding="utf-8").splitlines()
    cases = [line for line in lines if line and not line.startswith("#")]
    assert cases == ["t.py::a[2]", "t.py::a[3]", "t.py::b[1]", "t.py::c[1]"]  # a[1] measured and kept: it runs
    assert lines[-2:] == ["# By hand, not by select: why.", "t.py::c[1]"]
    assert any(line.startswith("# Listed before and not measured this time") and "2 cases" in line for line in lines)
    assert "# Before that, measured: before." in lines  # where the cases kept from before come from


def test_select_again_on_the_same_measurement_writes_the_same_list(tmp_path, monkeypatch):
    """`select` run twice on one measurement writes the file it wrote: the measurement it wrote is not carried again
    as the one before it, and a case of a block written by hand that the measurement leaves out is listed once, in
    its block."""
    from tests import select_cases
    path = tmp_path / "sweep_cases.txt"
    path.write_text("# header\n# Measured: before.\nt.py::a[1]\nt.py::a[2]\nt.py::b[1]\n"
                    "# By hand, not by select: why.\nt.py::c[1]\n", encoding="utf-8")
    monkeypatch.setattr(select_cases, "LIST", path)
    summary = {"t.py::a": select_cases.Sweep(3, 1, 30.0, 10.0, 100, 90)}
    measured = {"t.py::a[1]", "t.py::a[3]", "t.py::c[1]"}
    select_cases.write(["t.py::a[3]", "t.py::c[1]"], summary, 30.0, measured)
    first = path.read_text(encoding="utf-8")
    select_cases.write(["t.py::a[3]", "t.py::c[1]"], summary, 30.0, measured)
    assert path.read_text(encoding="utf-8") == first
    lines = first.splitlines()
    assert [line for line in lines if line.startswith("# Before that")] == ["# Before that, measured: before."]
    assert [line for line in lines if not line.startswith("#")].count("t.py::c[1]") == 1



def test_a_listed_case_runs_where_it_is_not_marked_dist_or_slow(monkeypatch):
    """tests/conftest.py leaves out only sweeps' cases: a listed case marked dist or slow, not an unmarked one (a
    test's unit-tier cases beside its slow ones: test_hostile_sizes' bounded simulations at 2 and 3 ranks, 15 of which
    were listed from 2026-12-07's first selection until the review of 0ba7c37), and the list names none of those."""
    import subprocess
    import sys
    from types import SimpleNamespace

    import tests.conftest as conftest
    from tests.conftest import ROOT

    def item(nodeid, *markers):
        return SimpleNamespace(nodeid=nodeid, get_closest_marker=lambda name: name if name in markers else None)

    items = [item("t.py::a[1]", "slow"), item("t.py::a[2]"), item("t.py::b[1]", "dist"), item("t.py::c[1]")]
    deselected = []
    config = SimpleNamespace(getoption=lambda name: False, hook=SimpleNamespace(
        pytest_deselected=lambda items: deselected.extend(items)))
    monkeypatch.setattr(conftest, "sweep_cases", lambda: {"t.py::a[1]", "t.py::a[2]", "t.py::b[1]"})
    monkeypatch.setattr(conftest, "_collects_everything", lambda config: False)
    conftest._leave_out_the_sweeps_cases(config, items)
    assert [i.nodeid for i in items] == ["t.py::a[2]", "t.py::c[1]"]
    assert [i.nodeid for i in deselected] == ["t.py::a[1]", "t.py::b[1]"]
    unit = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "--collect-only", "--full", "-m",
                           "not slow and not dist", "tests/unit/test_hostile_sizes.py"], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout
    cases = {line.strip().split("@")[0] for line in unit.splitlines() if "::" in line and "[" in line}
    assert cases and not cases & sweep_cases()
