"""Choose the sweeps' cases the README's test command runs; write the others to tests/sweep_cases.txt.

The parametrized multi-process and slow tests (the sweeps: every layout, model, schedule or example against a
one-process run, or against the memory model) are most of the suite's time. Run in full
(`python -m pytest -q --full`) the suite takes ~1.7x the README's command. This script keeps, of each sweep, the cases
that add the most of plandsl's branches per second of their run, and lists the rest, which tests/conftest.py leaves
out unless `--full` is given.

    pip install coverage          # coverage.py >= 7.10 (its `patch = fork, _exit` measures the forked ranks)
    python tests/select_cases.py measure [PYTEST ARGS]   # the sweeps under coverage: .select_cases/
    python tests/select_cases.py select                  # writes tests/sweep_cases.txt from that measurement

`measure` runs every case (`--full`) of the tests it is given (by default every parametrized test marked `dist`
or `slow`) under coverage.py with branch measurement, in the test process, its xdist workers, the ranks they fork
and the processes they start, each arc labelled with the test's node id; and each case's time. `select` then takes
each test on its own (a case's branches count for its own test only: another test asserts something else on
them) and orders its cases greedily, the one adding the most branches not yet covered per second first; a case
runs while it adds more than PER_SECOND branches a second (the first one whatever it adds), and a kept case the
others cover is dropped. A case that did not pass in the measurement, or whose arcs coverage did not see, runs.
The branches are plandsl's (`source = plandsl`): what the run does, not what torch does beneath it. Coverage.py
loses a test process's own arcs after the first fork of an xdist worker (the ranks' are kept): `measure` given a
file of node ids (`measure @FILE`) runs each case in a process of its own, for the tests whose arcs are in that
process (a trace in the test process: tests/distributed/test_memtrace.py).

`measure` given node ids (`measure 'tests/x.py::test_y[a]' ...`) measures those cases only: `select` then decides
among them alone (a test's greedy order over its measured cases) and leaves every case listed before and not
measured as it was; the blocks of the list written by hand (a comment starting "# By hand") stay as written. To raise
the threshold without measuring everything again, measure the cases the suite runs now (the listed ones would be left
out at the higher threshold anyway: the greedy order stops earlier, never later).
"""
from __future__ import annotations

import collections
import os
import sqlite3
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / ".select_cases"
LIST = ROOT / "tests" / "sweep_cases.txt"
# A case runs where it adds more than this many branches a second (of its run under coverage, here) to what its
# test's cases run before it cover: the knob between the README command's time and its share of the sweeps'
# branches (`select` prints both; docs/benchmarks.md has the figures this value gave).
PER_SECOND = 20.0
RCFILE = """[run]
source = plandsl
branch = True
parallel = True
patch = subprocess, fork, _exit
data_file = {data}
"""


# ---- the pytest plugin `measure` loads (-p tests.select_cases) ------------------------------------------------
def pytest_runtest_protocol(item, nextitem):
    """Label what the test runs with its node id: here (a dynamic context), and in the ranks it forks and the
    processes it starts (coverage's configuration they inherit, whose static context is the label)."""
    import coverage
    cov = coverage.Coverage.current()
    if cov is not None:
        label = _case(item.nodeid)
        cov.config.context = label
        cov.switch_context(label)
        os.environ["COVERAGE_PROCESS_CONFIG"] = cov.config.serialize()


def pytest_runtest_logreport(report):
    with open(OUT / f"durations.{os.getpid()}.tsv", "a", encoding="utf-8") as out:
        out.write(f"{_case(report.nodeid)}\t{report.when}\t{report.duration:.3f}\t{report.outcome}\n")


def _case(nodeid: str) -> str:
    return nodeid.split("@")[0]  # pytest-xdist's loadgroup suffix


# ---- measure ----------------------------------------------------------------------------------------------
def marked_cases() -> set[str]:
    """The parametrized cases marked `dist` or `slow`, by collecting the suite: the only ones a sweep leaves out (a
    test's unmarked cases, such as test_hostile_sizes' bounded simulations at a few ranks beside its slow ones, are the
    unit tier's and always run; tests/conftest.py leaves out no other)."""
    listing = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "0", "--collect-only", "--full", "-m", "dist or slow"],
        cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return {_case(line) for line in listing.splitlines() if "::" in line and "[" in line}


def sweeps(marked: set[str] | None = None) -> list[str]:
    """The parametrized tests with two cases or more marked `dist` or `slow`."""
    cases = collections.Counter(case.split("[")[0] for case in (marked if marked is not None else marked_cases()))
    return sorted(test for test, count in cases.items() if count >= 2)


def measure(args: list[str]) -> None:
    OUT.mkdir(exist_ok=True)
    rcfile = OUT / "coveragerc"
    rcfile.write_text(RCFILE.format(data=OUT / ".coverage"), encoding="utf-8")
    env = dict(os.environ, COVERAGE_RCFILE=str(rcfile))
    run = [sys.executable, "-m", "coverage", "run", f"--rcfile={rcfile}", "-m", "pytest", "-q", "--full",
           "-p", "tests.select_cases", "-p", "no:cacheprovider"]
    if args[:1] and args[0].startswith("@"):  # each case in a process of its own, added to the measurement
        cases = [line.strip() for line in Path(args[0][1:]).read_text(encoding="utf-8").splitlines() if line.strip()]
        with ThreadPoolExecutor(os.cpu_count()) as pool:
            list(pool.map(lambda case: subprocess.run([*run, "-n", "0", _case(case)], cwd=ROOT, env=env,
                                                      capture_output=True, check=False), cases))
    else:
        for old in [*OUT.glob(".coverage*"), *OUT.glob("durations.*.tsv")]:
            old.unlink()
        subprocess.run([*run, *(args or sweeps())], cwd=ROOT, env=env, check=False)
    subprocess.run([sys.executable, "-m", "coverage", "combine", "--append", f"--rcfile={rcfile}", "-q"], cwd=ROOT,
                   env=env, check=True)


# ---- select -----------------------------------------------------------------------------------------------
def branches(data: Path) -> dict[str, frozenset]:
    """Each case's (file, from, to) arcs: what coverage labelled with its node id, here and in its processes."""
    by_context: dict[str, set] = collections.defaultdict(set)
    with sqlite3.connect(data) as db:
        contexts = dict(db.execute("select id, context from context"))
        for file_id, context_id, start, end in db.execute("select file_id, context_id, fromno, tono from arc"):
            label = contexts[context_id].split("|")[-1]
            if label:
                by_context[label].add((file_id, start, end))
    return {case: frozenset(arcs) for case, arcs in by_context.items()}


def durations(folder: Path) -> tuple[dict[str, float], set[str]]:
    """Each case's seconds (setup, call and teardown; of a case measured twice, each phase's longer) and the cases
    that did not pass."""
    phases: dict[str, dict[str, float]] = collections.defaultdict(dict)
    failed: set[str] = set()
    for path in folder.glob("durations.*.tsv"):
        for line in path.read_text(encoding="utf-8").splitlines():
            case, when, duration, outcome = line.split("\t")
            case = _case(case)
            phases[case][when] = max(phases[case].get(when, 0.0), float(duration))
            if outcome not in ("passed", "skipped") or (outcome == "skipped" and when == "call"):
                failed.add(case)
    return {case: sum(each.values()) for case, each in phases.items()}, failed


def cover(cases: dict[str, frozenset], seconds: dict[str, float], per_second: float = 0.0) -> list[str]:
    """The cases to run: greedily, the case adding the most branches not yet covered per second of its run first,
    each while it adds more than `per_second` branches a second (the first whatever it adds); then without any kept
    case the others cover (the dearest first). With `per_second` 0: every branch any case exercises."""
    kept: list[str] = []
    covered: set = set()

    def gain(case: str) -> float:
        return len(cases[case] - covered) / max(seconds.get(case, 1.0), 0.01)

    while len(kept) < len(cases):
        best = max((case for case in cases if case not in kept), key=lambda case: (gain(case), -seconds.get(case, 1.0),
                                                                                   case))
        if kept and gain(best) <= per_second:
            break
        kept.append(best)
        covered |= cases[best]
    for case in sorted(kept, key=lambda case: -seconds.get(case, 1.0)):  # then drop what the others cover, dearest first
        rest = [other for other in kept if other != case]
        if rest and frozenset().union(*(cases[other] for other in rest)) >= cases[case]:
            kept = rest
    return kept


def select(folder: Path = OUT) -> tuple[list[str], dict]:
    arcs = branches(folder / ".coverage")
    seconds, failed = durations(folder)
    tests: dict[str, list[str]] = collections.defaultdict(list)
    for case in seconds:
        if "[" in case:
            tests[case.split("[")[0]].append(case)
    left_out: list[str] = []
    unseen: list[str] = []  # passed, but coverage saw no arc of theirs: they run, and `measure @FILE` measures them
    summary: dict[str, Sweep] = {}
    marked = marked_cases()
    sweeping = set(sweeps(marked))
    for test, cases in sorted(tests.items()):
        if test not in sweeping:  # measured, but not a sweep (no longer, or given to `measure` by hand)
            continue
        cases = [case for case in cases if case in marked]  # the unit tier's cases of a sweep always run
        measured = {case: arcs[case] for case in cases if case in arcs and case not in failed}
        unseen += [case for case in cases if case not in arcs and case not in failed]
        if len(measured) < 2:
            continue
        kept = cover(measured, seconds, PER_SECOND)
        out = sorted(set(measured) - set(kept))
        left_out += out
        every = frozenset().union(*measured.values())
        summary[test] = Sweep(len(cases), len(out), sum(seconds[c] for c in cases), sum(seconds[c] for c in out),
                              len(every), len(frozenset().union(*(measured[c] for c in kept))))
    (folder / "unseen.txt").write_text("".join(f"{case}\n" for case in sorted(unseen)), encoding="utf-8")
    return sorted(left_out), summary


class Sweep(NamedTuple):
    """What `select` did to one test: its cases, those left out, their seconds, and its branches, all and kept."""
    cases: int
    out: int
    seconds: float
    out_seconds: float
    branches: int
    kept_branches: int


def listed() -> tuple[list[str], list[list[str]], list[str]]:
    """tests/sweep_cases.txt as `select` wrote it: its cases; after them the blocks written by hand (a comment
    starting "# By hand", then its cases), which `select` keeps as they are; and its header's lines on the
    measurements its cases come from ("# Measured: ...", "# Before that, measured: ...")."""
    cases: list[str] = []
    by_hand: list[list[str]] = []
    measurements: list[str] = []
    lines = LIST.read_text(encoding="utf-8").splitlines() if LIST.exists() else []
    for line in lines:
        if line.startswith("# By hand"):
            by_hand.append([line])
        elif by_hand:
            by_hand[-1].append(line)
        elif line.startswith(("# Measured: ", "# Before that, measured: ")):
            measurements.append(line.split("measured: ", 1)[1] if line.startswith("# Before") else line[12:])
        elif line.strip() and not line.startswith("#"):
            cases.append(line.strip())
    return cases, by_hand, measurements


def write(left_out: list[str], summary: dict[str, Sweep], total_s: float, measured_cases: set[str],
          marked: set[str] | None = None) -> str:
    """Write the list: the measured cases `select` leaves out, the cases listed before that this measurement did not
    run (a measurement of some cases only, `measure` given node ids, leaves the others as they were listed; of them
    only those `marked` dist or slow, where given), then the blocks written by hand."""
    before, by_hand, measurements = listed()
    hand = {line.strip() for block in by_hand for line in block if line.strip() and not line.startswith("#")}
    kept_before = sorted(case for case in before if case not in measured_cases and case not in hand
                         and (marked is None or case in marked))
    cases = sum(each.cases for each in summary.values())
    saved = sum(each.out_seconds for each in summary.values())
    branches = sum(each.branches for each in summary.values())
    kept = sum(each.kept_branches for each in summary.values())
    measured = (f"{len(summary)} tests, {cases} cases, {len(left_out)} of them listed here: {saved:.0f} of the "
                f"measured {total_s:.0f} s (under coverage), keeping {kept} of their {branches} branches (each "
                f"test's own, summed), at {PER_SECOND:g} branches a second")
    header = [
        "# The sweeps' cases the README's test command leaves out; `python -m pytest -q --full` runs them too.",
        "# Written by `python tests/select_cases.py select` (its docstring says how they are chosen): of each",
        "# parametrized multi-process or slow test, the cases that add few plandsl branches a second to its others'.",
        f"# Measured: {measured}.",
    ]
    if kept_before:
        header.append(f"# Listed before and not measured this time (as they were): {len(kept_before)} cases.")
        # the measurements before this one (the one written last time is this one where `select` runs again on it)
        header += [f"# Before that, measured: {each}" for each in dict.fromkeys(measurements) if each != f"{measured}."]
    body = sorted((set(left_out) | set(kept_before)) - hand)  # a block written by hand names its cases itself
    LIST.write_text("\n".join(header + body + [line for block in by_hand for line in block]) + "\n",
                    encoding="utf-8")
    return measured


def main(argv: list[str]) -> None:
    if argv[:1] == ["measure"]:
        measure(argv[1:])
    elif argv[:1] == ["select"]:
        folder = Path(argv[1]) if len(argv) > 1 else OUT
        left_out, summary = select(folder)
        seconds, _ = durations(folder)
        for test, each in sorted(summary.items(), key=lambda item: -item[1].out_seconds):
            print(f"{each.out_seconds:7.1f} of {each.seconds:7.1f} s  {each.out:3d} of {each.cases:3d} cases out  "
                  f"{each.kept_branches:5d} of {each.branches:5d} branches kept  {test}")
        print(write(left_out, summary, sum(seconds.values()), set(seconds), marked_cases()))
        unseen = (folder / "unseen.txt").read_text(encoding="utf-8").splitlines()
        if unseen:
            print(f"{len(unseen)} cases had no arc measured (they run): `python tests/select_cases.py measure "
                  f"@{folder / 'unseen.txt'}` measures each in a process of its own, then select again")
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
