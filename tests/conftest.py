"""Shared test options: `--update-golden` rewrites golden files instead of comparing; hypothesis's
profile."""
from __future__ import annotations

import gc
import importlib
import os
import sys
import warnings
from pathlib import Path

import pytest


def _import_unrewritten(*names: str) -> None:
    """Import `names` with pytest's assertion rewriter off the import path.

    pytest rewrites the asserts of every module of an installed plugin's distribution when it is first
    imported; hypothesis is one (a pytest11 entry point), so its ~75 modules were parsed and rewritten in each
    of pytest's processes (the xdist controller and both workers), ~0.9 CPU-s each, every run (nothing is
    cached where bytecode is not written). Only the tests' own asserts need rewriting."""
    rewriters = [finder for finder in sys.meta_path if type(finder).__name__ == "AssertionRewritingHook"]
    for finder in rewriters:
        sys.meta_path.remove(finder)
    try:
        for name in names:
            importlib.import_module(name)
    finally:
        sys.meta_path[:0] = rewriters


# Bytecode is cached (in __pycache__ folders, git-ignored) even where PYTHONDONTWRITEBYTECODE is set, as it is
# in the environment CI runs in. Without a cache, every pytest process rewrote the asserts of every test module
# again (pytest caches the rewritten modules only where bytecode is written: ~3 CPU-s per xdist worker, at
# collection, every run), and every `plandsl` subprocess a test starts compiled the package again (~0.2 CPU-s
# each; they read the bytecode the workers write, though the variable still keeps them from writing any).
# The suite writes beside the sources already (.hypothesis/, .pytest_cache/).
sys.dont_write_bytecode = False

_import_unrewritten("hypothesis", "hypothesis.strategies")
from hypothesis import settings  # noqa: E402 - after the import above

# One intra-op thread for torch in the test processes (and the CLI processes and ranks they start), set
# before anything imports torch: pytest-xdist already runs one worker per core, and torch's second
# OpenMP thread there only contends for the other worker's core. test_recompute's tiny blocks took
# ~4x the CPU with two threads (6 of the unit tier's ~150 CPU-s). An OMP_NUM_THREADS given is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# No per-example wall-clock deadline (hypothesis's default is 200 ms): with other runs or xdist
# workers sharing the cores, or a first example that imports torch, a correct example takes longer,
# and hypothesis then reports it as a flaky failure. Work is bounded where it matters by
# tests/support.py's `bounded` (CPU time); a hang still fails through the tests' own deadlines.
settings.register_profile("plandsl", deadline=None)
settings.load_profile("plandsl")

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "golden"
STDLIB = ROOT / "stdlib_plans"


# The modules whose tests import torch in the test process (through `support.lazy`, on first use). Under
# pytest-xdist they are one group, so one worker imports torch and the runtime (~3-5 s of CPU), not each.
# A single test elsewhere that imports torch joins the group with @pytest.mark.xdist_group("torch")
# (test_diagnostics: E705's example; test_golden_json: shard_rules' generate), a module with
# `pytestmark = pytest.mark.xdist_group("torch")` (test_inspect_cnn) or here. A test outside the group
# that imports torch is named in the warnings summary (`pytest_runtest_teardown` below).
TORCH_MODULES = {"test_context_columns.py", "test_equivalence.py", "test_launch.py", "test_memory.py",
                 "test_model_shapes.py", "test_recompute.py", "test_schedule_generators.py", "test_inspect.py",
                 "test_schedule_rules.py", "test_schedule_templates.py", "test_torch_model.py", "test_state_dtypes.py",
                 "test_torch_model_refusals.py", "test_parallel_blocks.py", "test_shared_experts.py",
                 "test_interop_deepspeed.py", "test_deepseek.py",
                 "test_eager_bytes.py", "test_interleaved_moe.py", "test_chunked_loss.py", "test_residual_stream.py", "test_autocast_copies.py",
                 "test_window_attention.py", "test_check_runs.py", "test_tied_embeddings.py", "test_materialize.py",
                 "test_expert_groups.py"}


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist names each test's group (its nodeid's @suffix)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in TORCH_MODULES and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group("torch"))
    _leave_out_the_sweeps_cases(config, items)


# The sweeps' cases the README's command leaves out (`--full` runs them): tests/sweep_cases.txt, written by
# tests/select_cases.py. Each parametrized multi-process or slow test keeps the cases that add the most of plandsl's
# branches per second of their run (measured by coverage, in the test process and its forked ranks), while they add
# more than a threshold; the others are listed there. A test or case not listed runs: a new or renamed case runs
# until the list is written again.
SWEEP_CASES = ROOT / "tests" / "sweep_cases.txt"


def sweep_cases() -> set[str]:
    lines = SWEEP_CASES.read_text(encoding="utf-8").splitlines() if SWEEP_CASES.exists() else []
    return {line.strip() for line in lines if line.strip() and not line.startswith("#")}


def _leave_out_the_sweeps_cases(config, items) -> None:
    listed = sweep_cases()
    collected = {item.nodeid.split("@")[0]: item for item in items}
    if _collects_everything(config):  # a listed case of a module collected here that names no test
        files = {nodeid.split("::")[0] for nodeid in collected}
        stale = sorted(case for case in listed - collected.keys() if case.split("::")[0] in files)
        if stale:
            raise pytest.UsageError(
                f"{SWEEP_CASES.name} names {len(stale)} case(s) no test has (renamed or removed), e.g. {stale[0]}: "
                "remove them from it, or measure and select again (tests/select_cases.py)")
    if config.getoption("--full"):
        return
    # a listed case is left out only where it is a sweep's (marked dist or slow): a test's unmarked cases beside its
    # slow ones are the unit tier's, and run (tests/select_cases.py measures and lists only the marked ones)
    out = [item for item in items if item.nodeid.split("@")[0] in listed
           and (item.get_closest_marker("dist") is not None or item.get_closest_marker("slow") is not None)]
    if out:
        config.hook.pytest_deselected(items=out)
        dropped = set(map(id, out))
        items[:] = [item for item in items if id(item) not in dropped]


def _collects_everything(config) -> bool:
    """Whether this run collected the whole suite (no paths, `-k` or `-m` given): then every listed case exists."""
    given = [arg for arg in config.args if Path(arg).resolve() != ROOT / "tests"]
    return not given and not config.getoption("keyword") and not config.getoption("markexpr")


class HeavyImport(UserWarning):
    """torch or transformers imported where every xdist worker may pay for it: at collection, or by a test
    outside the 'torch' group."""


def pytest_collection_finish(session):
    """Collecting imports every test module in each xdist worker, before `-m` deselects anything: a
    module-level `import torch` or `pytest.importorskip("transformers")` costs ~1-4 CPU-s there per worker."""
    heavy = [name for name in ("torch", "transformers") if name in sys.modules]
    if heavy:
        warnings.warn(HeavyImport(
            f"collecting the tests imported {' and '.join(heavy)}: import it inside the tests (support.lazy), and "
            "skip without it by `pytest.mark.skipif(importlib.util.find_spec(...) is None, ...)`, not importorskip"))


_TORCH_BEFORE = pytest.StashKey[bool]()


def _in_torch_group(item) -> bool:
    marker = item.get_closest_marker("xdist_group")
    return marker is not None and (marker.args[:1] == ("torch",) or marker.kwargs.get("name") == "torch")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    item.stash[_TORCH_BEFORE] = "torch" in sys.modules


@pytest.hookimpl(trylast=True)  # after the test's fixtures are torn down
def pytest_runtest_teardown(item, nextitem):
    if not item.stash.get(_TORCH_BEFORE, True) and "torch" in sys.modules and not _in_torch_group(item):
        warnings.warn(HeavyImport(
            f"{item.nodeid} imported torch outside the 'torch' xdist group: add its module to "
            "tests/conftest.py's TORCH_MODULES or mark it @pytest.mark.xdist_group('torch')"))
    _freeze_between_tests(item, nextitem)


# The cyclic collector's full collections (of its oldest generation) walk every object the process holds: with torch,
# the runtime and the tests' module-scoped results loaded, 400-600k objects, 0.3-0.6 s each, and a worker ran
# hundreds (tests/unit/test_inspect.py, test_deepseek.py, test_memory.py and test_model_shapes.py together: 23 of
# them, 13.5 s of their ~43 CPU-s). So, between two tests of a module, what survived a full collection is frozen
# (`gc.freeze`: left out of the walks, still freed by its reference counts), and at each module's end thawed
# (`gc.unfreeze`), so that the next full collection walks it all once and collects a cycle the module left (its
# module-scoped fixtures', say). Nothing is frozen while a test runs: what a test makes and drops is collected as
# before (a memory trace's frees included); `support.bounded` freezes and thaws as it did.
_FULL_COLLECTIONS = [0]


def _count_full_collections(phase: str, info: dict) -> None:
    if phase == "stop" and info["generation"] == 2:
        _FULL_COLLECTIONS[0] += 1


gc.callbacks.append(_count_full_collections)


def _freeze_between_tests(item, nextitem) -> None:
    if nextitem is None or getattr(nextitem, "module", None) is not getattr(item, "module", None):
        gc.unfreeze()
        _FULL_COLLECTIONS[0] = 0
    elif _FULL_COLLECTIONS[0]:  # a full collection ran since the last freeze: its survivors are long-lived
        gc.freeze()
        _FULL_COLLECTIONS[0] = 0


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """No test runs after this: freeze the heap, so that the collections the process still makes while it
    ends (xdist's and execnet's teardown, the interpreter's finalization) skip it. A worker that ran
    thousands of tests, torch's modules among them, spent ~2-4 CPU-s there, each run, after its last test."""
    gc.freeze()


def pytest_configure(config):
    if config.getoption("--full"):  # tests/support.py: full_run, read as the test modules are imported
        os.environ["PLANDSL_TESTS_FULL"] = "1"


def pytest_addoption(parser):
    parser.addoption("--update-golden", action="store_true", default=False,
                     help="rewrite golden files from the current output (review the diff like code)")
    parser.addoption("--full", action="store_true", default=False,
                     help="run every case of the sweeps, also those tests/sweep_cases.txt leaves out")


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
