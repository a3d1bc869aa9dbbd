"""What several test files share: a valid plan to mutate, reference schedules written from their
papers' definitions (independent of plandsl.schedules.generators), `bounded` for "this input
costs little work", `cpu_ratio` for "this input costs what its peer costs", `lazy` for modules
that import torch, `cli_in_process` for the command line without a new interpreter,
`example_tiers` for a property test's example count in each tier, `generated_plan` for what
`generate` writes, read back, `lowered_plan` / `error_codes` for a plan's text, and
`space_leaves` for every leaf of a search space, `PipelinePlan` for a plan on a pipeline other than
torch's (`stages = ... with implementation = ...`) and what every such pipeline is asked, `run_group` /
`start_group` / `stop_group` for a command that starts processes of its own (torchrun and its ranks), ended whole."""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
import signal
import subprocess
import time
import traceback
import types
from contextlib import contextmanager
from pathlib import Path

import pytest

from plandsl.schedules.program import Action, Kind, Schedule, loop_map

VALID_PLAN = """\
import "clusters/dgx_a100"
param nodes = 2
plan p {
  model   = gpt(layers=8, hidden=1024, heads=16, seq=1024, vocab=50304)
  cluster = dgx_a100 x nodes
  mesh    = [dp = nodes * 8 / 4, pp = 2, tp = 2]
  train   = { global_batch: 64, micro_batch: 2, precision: bf16, recompute: selective }
  data    = zero1 over dp
  tensor  = megatron over tp with sequence_parallel
  stages  = evenly over pp
  schedule = 1f1b
}
"""


def pipedream_flush(p: int, m: int) -> Schedule:
    """1F1B as PipeDream-Flush defines it: rank r runs min(p-r-1, m) warm-up forwards, then one
    forward and one backward at a time, then the remaining backwards."""
    rows = []
    for r in range(p):
        warm = min(p - r - 1, m)
        row = [Action(r, Kind.F, i) for i in range(warm)]
        for i in range(m):
            if warm + i < m:
                row.append(Action(r, Kind.F, warm + i))
            row.append(Action(r, Kind.B, i))
        rows.append(tuple(row))
    return Schedule("1f1b", p, p, m, (loop_map(p, p),), tuple(rows))


class lazy(types.ModuleType):  # noqa: N801 - used like the module it stands for
    """`torch = lazy("torch")`: the module, imported on first attribute access.

    pytest imports every test module to collect it, in each xdist worker, before `-m` deselects
    anything; a module-level `import torch` (or of a plandsl.runtime module, which imports torch,
    torch.distributed.checkpoint or torch._dynamo) costs 2-4 s of CPU there even when no test of
    the module runs. With `lazy` only the tests that touch torch pay for it."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.__dict__["_lazy_name"] = name

    def __getattr__(self, attr: str):
        if attr.startswith("_"):  # pytest probes every module global (`__test__`, fixture markers):
            raise AttributeError(attr)  # answering those must not import the module
        return getattr(importlib.import_module(self.__dict__["_lazy_name"]), attr)


HANG_S = 300.0  # wall clock: only a hang or a blocking wait comes near it, however loaded the machine


@contextmanager
def bounded(cpu_s: float, what: str = "the block"):
    """Fail if the block used more than `cpu_s` seconds of CPU time (this process's and that of the
    children it waited for, e.g. a `subprocess.run` of the CLI) or more than HANG_S of wall time.

    CPU time, not wall time, judges how much work an input bought: with other test runs sharing the
    2 cores (or pytest-xdist's workers) wall time stretches several-fold while the work does not.
    A wall-clock bound that tight once failed clean-clone CI runs on a loaded machine (issue 17).

    The objects earlier tests left are frozen out of the collector's reach for the block (`gc.freeze`): a full
    collection in the block walked all of them, which is not the block's work (import --from torchtitan of 20,000
    escaped subcommands, 0.4 s alone, took 1.1-1.5 s of CPU after the Megatron-LM and torchtitan test files)."""
    import gc
    gc.freeze()  # no collection first: that would cost each bounded block a walk of the whole heap
    before, start = os.times(), time.monotonic()
    try:
        yield
    finally:
        after, wall = os.times(), time.monotonic() - start
        gc.unfreeze()
    cpu = sum(getattr(after, f) - getattr(before, f) for f in ("user", "system", "children_user", "children_system"))
    if cpu >= cpu_s:  # judged again on this machine's speed now: a slow machine is not more work
        slower = max(1.0, reference_cpu_s() / REFERENCE_CPU_S)
        assert cpu < cpu_s * slower, (f"{what} used {cpu:.1f} s of CPU (bound {cpu_s:g} s, x {slower:.2f} for this "
                                      "machine's speed now, by tests/support.py's reference_cpu_s)")
    assert wall < HANG_S, f"{what} took {wall:.0f} s of wall time (a hang?)"


# What reference_cpu_s() takes on the machine the bounds above were set on (the 2-core CI machine; 0.0121-0.0128 s
# quiet and beside two busy loops on 2026-12-07, a day bench case 10 ran 35 % slower than the week before; 0.021-0.024
# beside forked torch ranks at load 5). The machine runs 30-40 % slower on some days (issue 20's notes: case 10 at
# 10.2 and at 13.6-14.7 CPU-s for the same work), and its caches are shared with the ranks a test forks: a bound that
# fails is judged again at its bound times how much slower the reference runs now, so that it fails for more work,
# not for a slower machine. A quadratic blow-up is still 3-10x its bound, and the message gives the factor.
REFERENCE_CPU_S = 0.0125


def reference_cpu_s() -> float:
    """CPU seconds of a fixed pure-Python workload (string keys, a dict, a sort: what the bounded blocks do), the
    median of five runs."""
    runs = []
    for _ in range(5):
        start = time.process_time()
        table: dict[str, int] = {}
        for i in range(40_000):
            key = f"key{i % 4099}"
            table[key] = table.get(key, 0) + len(key)
        sorted(table.items(), key=lambda item: (-item[1], item[0]))
        runs.append(time.process_time() - start)
    return sorted(runs)[2]


def cpu_ratio(work, peer, repeat: int = 3) -> float:
    """CPU seconds of `work()` over those of `peer()`, each the least of `repeat` runs taken in turn (so that a burst of
    load on the machine falls on both), the collector's objects frozen as in `bounded`: for "this input costs what its
    peer of the same size costs" or "twice the input costs twice", a ratio that a slower machine does not change."""
    import gc

    def run(function) -> float:
        gc.freeze()
        start = time.process_time()
        try:
            function()
            return time.process_time() - start
        finally:
            gc.unfreeze()
    runs: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeat):
        runs[0].append(run(work))
        runs[1].append(run(peer))
    return min(runs[0]) / max(min(runs[1]), 1e-6)


def cli_in_process(*args, cwd: str | Path | None = None, stdin: str | None = None) -> subprocess.CompletedProcess:
    """`python -m plandsl.cli *args` run from `cwd`, in this process (click's CliRunner): the same
    exit code, stdout and stderr as the real process, without its ~1 s of interpreter start and
    imports. An exception that escapes the command is in stderr as its traceback, as Python would
    print it. tests/unit/test_cli.py keeps real processes for the entry point and the streams."""
    from click.testing import CliRunner

    from plandsl.cli import main
    with contextlib.chdir(cwd) if cwd is not None else contextlib.nullcontext():
        result = CliRunner().invoke(main, [str(a) for a in args], input=stdin, prog_name="plandsl")
    stderr = result.stderr
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        stderr += "Traceback (most recent call last):\n" + "".join(traceback.format_exception(result.exception))
    return subprocess.CompletedProcess(["plandsl", *map(str, args)], result.exit_code, result.stdout, stderr)


def full_run() -> bool:
    """Whether pytest runs with `--full` (every case of the sweeps: tests/conftest.py), for a property test whose
    examples, not its parameters, are its cases: set by conftest before the test modules are imported."""
    return os.environ.get("PLANDSL_TESTS_FULL") == "1"


def example_tiers(full: int) -> list:
    """`@pytest.mark.parametrize("examples", example_tiers(200))` over a property test: the unit tier
    runs a quarter of its examples (at least 20), the slow tier (which `.ci/run` runs) all of them.
    Examples are drawn anew every run, so the unit tier still fuzzes, in a quarter of the CPU time."""
    fast = max(20, full // 4)
    return [pytest.param(fast, id=f"{fast}-examples"),
            pytest.param(full, id=f"{full}-examples", marks=pytest.mark.slow)]


def generated_plan(tmp_path: Path, **request):
    """`api.generate(api.generate_request(**request))`'s best plan written to a file and loaded back, with the text it
    wrote: the loaded plan is estimated as the search priced it (the written text says everything the search
    took as given)."""
    from plandsl import api
    generated = api.generate(api.generate_request(**request))
    path = tmp_path / "generated.plan"
    path.write_text(generated.texts[0])
    plan = api.load_plan(path)
    assert api.estimate(plan).time.step == pytest.approx(generated.result.best.estimate.time.step, rel=1e-9)
    return generated.texts[0], plan


def lowered_plan(text: str):
    """The one plan of `text`, checked and lowered (the test fails with every diagnostic when it is not ok)."""
    from plandsl.check.analysis import analyze
    analysis = analyze(text=text)
    assert analysis.ok, [(d.code, d.message) for d in analysis.diagnostics]
    (plan,) = analysis.document.plans
    return plan


def error_codes(text: str) -> list[str]:
    """The codes of the errors `text` has, in order."""
    from plandsl.check.analysis import analyze
    return [d.code for d in analyze(text=text).errors]


def space_leaves(space):
    """Every (root, node, leaf) of a search `Space`, each leaf with its split resolved, in the order the space gives
    them."""
    for root in space.roots():
        for node in space.expand_root(root):
            pending = space.pending(node)
            while pending is not None:
                leaf, pending = space.resolve(pending)
                if leaf is not None:
                    yield root, node, leaf


def assert_brute_force_optimum(problem, pins: dict) -> None:
    """Every leaf of the search's space evaluated (`Space.settle`): each leaf's bound at most its exact step, and the search's three
    best the three fastest of them (the search over models of several kinds of block: test_deepseek,
    test_interleaved_moe, test_search_two_kinds)."""
    import pytest
    from plandsl.cost.compute import DEFAULT_EFFICIENCY
    from plandsl.search import search
    from plandsl.search.space import Space
    space = Space(problem, pins, DEFAULT_EFFICIENCY)
    everything = []
    for root in space.roots():
        for node in space.expand_root(root):
            for leaf in space.expand(node):
                scored = space.settle(leaf)  # a partly recomputed or offloading leaf at its least N that fits
                if scored is not None:
                    assert leaf.bound <= scored.estimate.time.step * (1 + 1e-12)
                    everything.append(scored.estimate.time.step)
    found = search(problem, pins=pins, top=3)
    assert [s.estimate.time.step for s in found.candidates] == pytest.approx(sorted(everything)[:3], rel=1e-12)


# One node of 8 devices of 80 GiB at 1,000 bf16 TFLOP/s on a 100 GB/s link: the hardware of the memory tests' plan
# templates (test_pipeline_memory, test_ring_memory), braces doubled for their `str.format`.
EIGHT_GPU_NODE = """
device g {{
  memory = 80 GiB
  bandwidth = 1 TB/s
  peak = {{ bf16: 1000 TFLOP/s }}
}}
node n {{ devices = 8 x g; link = {{ bandwidth: 100 GB/s, latency: 0 us }} }}
"""


# a gpt, one microbatch a rank a step: tests/unit/test_memory.py, tests/distributed/test_memtrace.py
ONE_MICROBATCH = """
import "clusters/local"
plan one {{
  model    = gpt(layers={layers}, hidden={hidden}, heads=8, seq={seq}, vocab=16384)
  cluster  = localhost x {devices}
  mesh     = [{mesh}] over devices[0:{devices}]
  train    = {{ global_batch: {batch}, micro_batch: 1, precision: fp32, optimizer: adam, lr: 1e-3, seed: 0{train} }}
{body}}}
"""


# A plan on two DGX A100 nodes whose stages run on a pipeline other than torch's (`PipelinePlan`), braces doubled for
# its `str.format`.
OTHER_PIPELINE_PLAN = """import "clusters/dgx_a100"
plan p {{
  model    = {model}
  cluster  = dgx_a100 x 2
  mesh     = [dp = 2, pp = 4, tp = 2]
  train    = {{ global_batch: 64, micro_batch: 2, precision: bf16{train} }}
  tensor   = megatron over tp
  data     = {data} over dp
  stages   = evenly over pp with {stages}implementation = {implementation}
  schedule = {schedule}
}}
"""


@dataclasses.dataclass(frozen=True)
class PipelinePlan:
    """`OTHER_PIPELINE_PLAN` with its stages on `implementation`'s pipeline running `schedule`, the one schedule that
    pipeline runs: its text with any field changed, the plan loaded, its error codes, and what every pipeline other
    than torch's is asked (`assert_checked`, `assert_searched`): tests/unit/test_deepspeed_pipeline.py,
    tests/unit/test_dualpipe_runtime.py."""
    implementation: str
    schedule: str
    model: str
    data: str = "zero1"
    train: str = ""   # after `precision: bf16` (", recompute: full")
    stages: str = ""  # before `implementation = ...` ("virtual = 2, map = vshape, ")

    def text(self, **changes) -> str:
        return OTHER_PIPELINE_PLAN.format(**dataclasses.asdict(dataclasses.replace(self, **changes)))

    def plan(self, **changes):
        from plandsl import api
        return api.select_plan(api.loads(self.text(**changes), path="p.plan"))

    @staticmethod
    def errors(text: str) -> list:
        """The errors `text` has (api.checks'), each a Diagnostic."""
        from plandsl import api
        return [d for d in api.checks(text, path="p.plan").diagnostics if d.severity == "error"]

    @classmethod
    def codes(cls, text: str) -> list[str]:
        return [d.code for d in cls.errors(text)]

    def assert_checked(self, refused: str) -> None:
        """The language says the pipeline and the checker takes the plan, with ZeRO-1 or plain replicas; `refused`, a
        schedule torch's pipeline runs here, is E610 naming the schedule this one runs; its outputs, which are not
        modelled, are E206."""
        assert self.plan().stages.implementation == self.implementation
        assert self.codes(self.text()) == [] and self.codes(self.text(data="replicate")) == []
        found = self.errors(self.text(schedule=refused))
        assert [d.code for d in found] == ["E610"] and f"it runs {self.schedule} (" in found[0].message, found
        assert self.codes(self.text(schedule=refused, implementation="torch")) == []
        said = f"implementation = {self.implementation}"
        assert self.codes(self.text().replace(said, f"{said}, outputs = returned")) == ["E206"]

    def assert_searched(self, microbatches: int, virtual: int = 1) -> None:
        """The search offers on this pipeline only its schedule (at `virtual` stages a rank) for 4 ranks and
        `microbatches`, where on torch's it offers gpipe among others."""
        from plandsl.search.choices import schedule_choices
        assert schedule_choices(4, microbatches, 16, None, None, pipeline=self.implementation) == \
            [(self.schedule, virtual)]
        assert ("gpipe", 1) in schedule_choices(4, microbatches, 16, None, None)


# ---- commands that start processes of their own ----------------------------------------------------------------
# A test that runs torchrun (`plandsl run`, `plandsl profile`) in a subprocess and times out must not leave its ranks
# running (killing torchrun alone orphans them, still holding their ports and cores): the command runs in a session
# of its own, and its whole process group is ended.
KILL_GRACE_S = 10.0
"""Seconds the group has to end after SIGTERM (torchrun's agent forwards it to the ranks) before SIGKILL."""


def start_group(command, **popen) -> subprocess.Popen:
    """`subprocess.Popen(command, **popen)` in a session of its own: it and every process it starts that does not
    leave (torchrun's ranks) are one process group, whose id is its pid, for `stop_group`."""
    return subprocess.Popen(command, start_new_session=True, **popen)


def group_alive(pgid: int) -> bool:
    """Whether a process of group `pgid` still runs (a zombie, dead but not yet reaped, does not)."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after the command's name, which may hold spaces
        except (OSError, IndexError):
            continue  # ended while read
        if int(fields[2]) == pgid and fields[0] not in "ZX":  # state, ppid, pgrp
            return True
    return False


def stop_group(process: subprocess.Popen, grace_s: float = KILL_GRACE_S) -> None:
    """End every process of `process`'s group (`start_group`): SIGTERM, then SIGKILL to what is left after
    `grace_s`; returns once none runs (or a SIGKILL has had `grace_s` more). `process` is reaped."""
    pgid = process.pid
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            pass  # none left, the leader reaped
        if _group_ends(process, grace_s):
            break
    process.wait(timeout=grace_s)


def _group_ends(process: subprocess.Popen, seconds: float) -> bool:
    """Whether no process of `process`'s group runs within `seconds` (the leader reaped as it ends)."""
    deadline = time.monotonic() + seconds
    while True:
        process.poll()
        if not group_alive(process.pid):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def run_group(command, *, timeout: float, input=None, grace_s: float = KILL_GRACE_S,
              **popen) -> subprocess.CompletedProcess:
    """`subprocess.run(command, timeout=timeout, input=input, **popen)` with the command in a session of its own
    (`start_group`): on the timeout (or an interrupt) its whole process group is ended (`stop_group`), not the
    command alone, and TimeoutExpired is raised with the output so far (`.output`, `.stderr`). Processes of the
    group still running when the command ends are ended too."""
    if input is not None:
        popen.setdefault("stdin", subprocess.PIPE)
    with start_group(command, **popen) as process:
        try:
            stdout, stderr = process.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired as error:
            stop_group(process, grace_s)
            try:  # the rest of the output, every writer now gone
                error.output, error.stderr = process.communicate(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
            raise
        except BaseException:
            stop_group(process, grace_s)
            raise
        if group_alive(process.pid):
            stop_group(process, grace_s)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
