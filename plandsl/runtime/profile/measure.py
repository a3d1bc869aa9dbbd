"""The measurements of `plandsl profile`, through torch: GEMMs per dtype and shape, a memory copy, collectives.

Stage: interpreter (profile). Contract: `measure(settings, world, progress)` runs on every rank at once
(one process: `world` is `World()`, no process group) and returns the `Profile` on rank 0 (None on the
others). Every rank times the same GEMMs at the same time (a device is measured as loaded as a training
step loads it: on a CPU the processes share the cores and the memory bus), and rank 0 keeps every rank's
repeats. Every GEMM is timed twice: as a burst (short repeats after a warm-up call, as a benchmark times it) and
sustained (after the device was held busy back to back for `--sustain` seconds, each GEMM run back to back for a
settle and a timed window: a training run holds a GPU at its power limit, where its clocks are lower than a
burst's; docs/cli.md, profile). Work is bounded by the tables below and by `--sustain` (at most
`limits.MAX_SUSTAIN_SECONDS`): the shapes, sizes, repeats and a cap on calls per repeat and per window. Timing:
the timer's clock (`time.perf_counter`, injectable) on a CPU; CUDA events after a warm-up call on a GPU for
bursts (the events bracket `calls` launches, so one launch's overhead is amortised as in a training step), the
clock between synchronisations for the sustained windows.
"""
from __future__ import annotations

import contextlib
import datetime
import math
import os
import platform
import socket
import time
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from plandsl.diagnostics.limits import MAX_SUSTAIN_SECONDS
from plandsl.runtime.profile.results import CommTiming, DeviceState, GemmTiming, KernelTiming, Profile, Spread

Progress = Callable[[int, int], None]
Clock = Callable[[], float]


@dataclass(frozen=True)
class Settings:
    quick: bool = False
    nproc_per_node: int = 1
    nnodes: int = 1
    sustain: float | None = None
    """Seconds the device is held busy before the sustained timings; None: `HOLD_SECONDS` for the device."""


@dataclass(frozen=True)
class World:
    """This process's place: rank, world size, local rank, processes per node (one process: all defaults)."""
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1


# ---- what is measured (bounded: every loop below runs over these tables) ----------------------------------
CPU_SHAPES = ((128, 128, 128), (256, 256, 256), (512, 512, 512), (1024, 1024, 1024), (2048, 256, 512),
              (256, 2048, 512), (4096, 128, 1024))
CPU_SHAPES_QUICK = ((128, 128, 128), (256, 256, 256), (512, 512, 512))
CPU_SMALL_SHAPES = ((64, 64, 64), (128, 128, 128), (256, 256, 256))  # 16-bit on a CPU: ~1 GFLOP/s without AMX
CPU_SMALL_SHAPES_QUICK = ((64, 64, 64), (128, 128, 128))
CUDA_SHAPES = ((512, 512, 512), (1024, 1024, 1024), (2048, 2048, 2048), (4096, 4096, 4096), (8192, 8192, 8192),
               (4096, 14336, 4096), (16384, 4096, 4096), (8192, 1024, 8192), (2048, 8192, 1024))
CUDA_SHAPES_QUICK = ((1024, 1024, 1024), (4096, 4096, 4096), (8192, 8192, 8192))
CUDA_FP32_SHAPES = CUDA_SHAPES[:5]      # full fp32 (TF32 off) runs ~20x slower than bf16: the squares only

REPEATS, REPEATS_QUICK = 7, 3
REPEAT_SECONDS = {("cpu", False): 10e-3, ("cpu", True): 2e-3, ("cuda", False): 5e-3, ("cuda", True): 2e-3}
"""Each repeat times enough calls to last about this long (one call when one is longer)."""
MAX_CALLS = 200

CPU_COPY_BYTES, CUDA_COPY_BYTES = 64 * 2**20, 1 * 2**30
COMM_SIZES = {("cpu", False): (4 * 2**10, 64 * 2**10, 1 * 2**20, 8 * 2**20),
              ("cpu", True): (4 * 2**10, 1 * 2**20),
              ("cuda", False): (64 * 2**10, 1 * 2**20, 16 * 2**20, 128 * 2**20, 512 * 2**20),
              ("cuda", True): (1 * 2**20, 64 * 2**20)}
COMM_BYTES_PER_REPEAT = {"cpu": 4 * 2**20, "cuda": 1 * 2**30}
"""Collectives per repeat: enough to move about this much, at most `MAX_CALLS`, at least one."""
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")

# ---- sustained: the device held busy ----------------------------------------------------------------------
HOLD_SECONDS = {("cuda", False): 30.0, ("cuda", True): 5.0, ("cpu", False): 2.0, ("cpu", True): 0.5}
"""Seconds of back-to-back GEMMs (the largest of the first precision) before the sustained timings, `--sustain`'s
default. On a GPU the power limit binds within a fraction of a second of back-to-back tensor-core work
(flashinfer-ai/flashinfer#2899: a B200 throttled from 1965 to ~1580 MHz, -15 % TFLOP/s, within ~100 iterations
of a ~1.5 ms kernel, with 5 ms of work already enough to start it), while the temperature that lowers the clock
further at the same power settles over tens of seconds (soumith/convnet-benchmarks#71: a Titan X throttled after
"tens of seconds"; triton-lang/triton#4493: H100 kernels' TFLOP/s cycles before a steady state): 30 s, then every
GEMM of the sweep back to back (~25 s more on an H100). On a CPU, short, to keep `profile` under 2 minutes."""
SETTLE_SECONDS = {("cuda", False): 0.2, ("cuda", True): 0.1, ("cpu", False): 0.0, ("cpu", True): 0.0}
"""Each GEMM back to back, untimed, before its window: the power limit's controller settling on its draw."""
WINDOW_SECONDS = {("cuda", False): 0.5, ("cuda", True): 0.2, ("cpu", False): 0.25, ("cpu", True): 0.1}
"""Each GEMM's timed window, split into `WINDOW_PARTS` back-to-back parts (the sustained spread)."""
WINDOW_PARTS = 5
SYNCS_PER_PART = 4
"""Synchronisations per part: the calls between two are about a quarter of a part (the GPU never waits on them)."""
MAX_SUSTAIN_CALLS = 1_000_000
"""Calls of one hold or one window part at most, whatever the clock says (a clock that stands still still ends)."""
STATE_EVERY_S = 1.0
"""Seconds between two readings of the SM clock and power during the hold."""


def measure(settings: Settings, world: World = World(), progress: Progress | None = None,
            clock: Clock = time.perf_counter) -> Profile | None:
    started = time.perf_counter()
    cuda = torch.cuda.is_available()
    kind = "cuda" if cuda else "cpu"
    device = torch.device("cuda", world.local_rank) if cuda else torch.device("cpu")
    timer = _Timer(device, world, clock)
    plan = _gemm_plan(kind, settings.quick, device)
    sizes = COMM_SIZES[(kind, settings.quick)] if world.size > 1 else ()
    # inside a node when it has several processes; across nodes when there are several
    scopes = ([False] if settings.nproc_per_node > 1 else []) + ([True] if settings.nnodes > 1 else [])
    total = 2 * len(plan) + 3 + len(sizes) * len(COLLECTIVES) * len(scopes)
    done = 0

    def step() -> None:
        nonlocal done
        done += 1
        if progress is not None and world.rank == 0:
            progress(done, total)

    notes: list[str] = []
    bursts: list[tuple[str, tuple[int, int, int], Callable, Spread]] = []
    for precision, shape, run in plan:  # bursts first, on a device not yet held busy
        samples = _gemm_samples(run, shape, timer, settings.quick, world)
        if samples is None:
            notes.append(f"{precision} {' x '.join(map(str, shape))}: skipped, out of device memory")
        else:
            bursts.append((precision, shape, run, Spread.of(samples)))
        step()
    hold = settings.sustain if settings.sustain is not None else HOLD_SECONDS[(kind, settings.quick)]
    window = Sustain(SETTLE_SECONDS[(kind, settings.quick)], WINDOW_SECONDS[(kind, settings.quick)])
    states = _hold(bursts, hold, timer, world) if bursts else ()
    step()
    gemms: list[GemmTiming] = []
    for precision, shape, run, burst in bursts:  # then each held back to back, the device busy throughout
        sustained = _sustained_samples(run, shape, burst.median, window, timer, world)
        state = _state(device)
        gemms.append(GemmTiming(precision, *shape, burst, Spread.of(sustained) if sustained else None,
                                state.sm_clock_mhz, state.power_w))
        step()
    for _ in range(len(plan) - len(bursts)):  # the shapes out of device memory: no sustained timing either
        step()
    notes += [note for note in _skipped(kind, device)]
    copy_bytes = CUDA_COPY_BYTES if cuda else CPU_COPY_BYTES
    memory = Spread.of(timer.repeat(_copy(copy_bytes, device), settings.quick))
    step()
    kernels = tuple(KernelTiming(name, moved, Spread.of(timer.repeat(call, settings.quick)))
                    for name, moved, call in _memory_bound(device))
    step()
    comms: list[CommTiming] = []
    for across in scopes:
        group, size = _group(world, settings, across)
        for collective in COLLECTIVES:
            for nbytes in sizes:
                samples = _time_collective(collective, nbytes, group, size, world, settings, across, device, timer)
                comms.append(CommTiming(collective, 2 if collective == "p2p" else size, nbytes, across,
                                        Spread.of(samples)))
                step()
    if world.rank != 0:
        return None
    return Profile(host=socket.gethostname(), date=_now(), torch=torch.__version__,
                   backend=dist.get_backend() if world.size > 1 else "", kind=kind,
                   device_name=_device_name(device), device_memory=_device_memory(device, settings),
                   threads=torch.get_num_threads(), nproc_per_node=settings.nproc_per_node, nnodes=settings.nnodes,
                   quick=settings.quick, memory_copy_bytes=2 * copy_bytes, memory_seconds=memory,
                   gemms=tuple(gemms), comms=tuple(comms), notes=tuple(notes),
                   wall_seconds=time.perf_counter() - started, kernels=kernels, hold_seconds=hold if bursts else 0.0,
                   window_seconds=window.window if bursts else 0.0, hold_states=states, sms=_sms(device))


# ---- timing -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Sustain:
    """One GEMM's sustained timing: `settle` seconds back to back untimed, then `window` seconds timed in `parts`."""
    settle: float
    window: float
    parts: int = WINDOW_PARTS


class _Timer:
    """Repeats of a callable on every rank at once, each rank's repeats gathered on every rank; and the device
    held busy by a callable for a time `clock` measures (`busy`, `sustained`)."""

    def __init__(self, device: torch.device, world: World, clock: Clock = time.perf_counter):
        self.device, self.world, self.clock = device, world, clock
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def busy(self, call: Callable[[], object], seconds: float, batch: int) -> tuple[int, float]:
        """Run `call` back to back, `batch` calls between synchronisations, until `seconds` have passed on the
        clock (at least one batch, at most `MAX_SUSTAIN_CALLS` calls); the calls made and the seconds they took."""
        self.sync()
        begin, calls = self.clock(), 0
        while True:
            for _ in range(batch):
                call()
            calls += batch
            self.sync()
            spent = self.clock() - begin
            if spent >= seconds or calls >= MAX_SUSTAIN_CALLS:
                return calls, spent

    def sustained(self, call: Callable[[], object], per_call: float, sustain: Sustain) -> list[float]:
        """Seconds per call of each part of `call`'s sustained window on each rank: after `sustain.settle` seconds
        back to back, `sustain.parts` parts of `sustain.window` / parts seconds each, back to back with no gap
        but a synchronisation every quarter part (`per_call`, the burst's, sizes the batches)."""
        part = sustain.window / sustain.parts
        batch = max(1, min(MAX_CALLS, math.floor(part / SYNCS_PER_PART / max(per_call, 1e-9))))
        self.barrier()
        if sustain.settle > 0:
            self.busy(call, sustain.settle, batch)
        mine = []
        for _ in range(sustain.parts):
            calls, spent = self.busy(call, part, batch)
            mine.append(spent / calls)
        return self.gather(mine)

    def elapsed(self, call: Callable[[], object], calls: int) -> float:
        """Seconds per call over `calls` calls."""
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                call()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / calls
        begin = self.clock()
        for _ in range(calls):
            call()
        return (self.clock() - begin) / calls

    def calls_for(self, call: Callable[[], object], quick: bool) -> int:
        """Calls one repeat makes: after a warm-up call, enough to last `REPEAT_SECONDS`, the same on every rank
        (the slowest rank's count) so that the ranks stay in step."""
        self.elapsed(call, 1)  # warm-up: allocation, the library's kernel choice, lazy initialisation
        one = self.elapsed(call, 1)
        calls = max(1, min(MAX_CALLS, math.ceil(REPEAT_SECONDS[(self.device.type, quick)] / max(one, 1e-9))))
        return int(self.gather([float(calls)], op="min")[0])

    def repeat(self, call: Callable[[], object], quick: bool) -> list[float]:
        """Seconds per call of each repeat on each rank."""
        calls = self.calls_for(call, quick)
        mine = []
        for _ in range(REPEATS_QUICK if quick else REPEATS):
            self.barrier()
            mine.append(self.elapsed(call, calls))
        return self.gather(mine)

    def barrier(self) -> None:
        if self.world.size > 1:
            dist.barrier()

    def gather(self, values: list[float], op: str | None = None) -> list[float]:
        """Every rank's `values` (equal lengths), or their elementwise minimum with `op="min"`."""
        if self.world.size == 1:
            return values
        mine = torch.tensor(values, dtype=torch.float64, device=self.device)
        if op == "min":
            dist.all_reduce(mine, op=dist.ReduceOp.MIN)
            return mine.tolist()
        everyone = [torch.empty_like(mine) for _ in range(self.world.size)]
        dist.all_gather(everyone, mine)
        return [v for tensor in everyone for v in tensor.tolist()]


# ---- GEMMs --------------------------------------------------------------------------------------------
def _gemm_plan(kind: str, quick: bool, device: torch.device) -> list[tuple[str, tuple[int, int, int], Callable]]:
    """(precision, (m, n, k), factory of the call) for every GEMM measured on this kind of device."""
    if kind == "cpu":
        big = CPU_SHAPES_QUICK if quick else CPU_SHAPES
        small = CPU_SMALL_SHAPES_QUICK if quick else CPU_SMALL_SHAPES
        return ([("fp32", s, _matmul(torch.float32, device)) for s in big]
                + [("bf16", s, _matmul(torch.bfloat16, device)) for s in small]
                + [("fp16", s, _matmul(torch.float16, device)) for s in small])
    shapes = CUDA_SHAPES_QUICK if quick else CUDA_SHAPES
    fp32 = CUDA_SHAPES_QUICK[:2] if quick else CUDA_FP32_SHAPES
    plan = ([("bf16", s, _matmul(torch.bfloat16, device)) for s in shapes]
            + [("fp16", s, _matmul(torch.float16, device)) for s in shapes])
    if _fp32_problem() is None:
        plan += ([("fp32", s, _matmul(torch.float32, device, tf32=False)) for s in fp32]
                 + [("tf32", s, _matmul(torch.float32, device, tf32=True)) for s in fp32])
    if _fp8_problem(device) is None:
        plan += [("fp8", s, _scaled_mm(device)) for s in shapes]
    return plan


def _gemm_samples(run, shape: tuple[int, int, int], timer: "_Timer", quick: bool, world: World) -> list[float] | None:
    """Every rank's repeats of one GEMM, or None on every rank when one of them ran out of device memory for
    its operands (a small GPU: the shape is skipped with a note, the profile goes on)."""
    try:
        call = run(*shape)
        failed = 0.0
    except torch.cuda.OutOfMemoryError:
        call, failed = None, 1.0
    if world.size > 1 or failed:
        failed = max(timer.gather([failed]))  # every rank takes the same branch (they time in step)
    if failed:
        del call
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return None
    return timer.repeat(call, quick)


def _hold(bursts, seconds: float, timer: _Timer, world: World) -> tuple[DeviceState, ...]:
    """Hold the device busy for `seconds` with the largest GEMM of the first precision measured, back to back
    (every rank at once); the SM clock and power read every `STATE_EVERY_S` on the way."""
    _, shape, run, burst = max((b for b in bursts if b[0] == bursts[0][0]), key=lambda b: math.prod(b[1]))
    call = run(*shape)
    batch = max(1, min(MAX_CALLS, math.floor(0.05 / max(burst.median, 1e-9))))  # a synchronisation every ~50 ms
    timer.barrier()
    states = [_state(timer.device, 0.0)]
    held = 0.0
    while held < seconds and len(states) <= math.ceil(MAX_SUSTAIN_SECONDS / STATE_EVERY_S):
        _, spent = timer.busy(call, min(STATE_EVERY_S, seconds - held), batch)
        held += spent
        states.append(_state(timer.device, held))
    del call
    return tuple(states) if any(s.sm_clock_mhz is not None or s.power_w is not None for s in states) else ()


def _sustained_samples(run, shape: tuple[int, int, int], per_call: float, sustain: Sustain, timer: _Timer,
                       world: World) -> list[float] | None:
    """Every rank's sustained parts of one GEMM, or None on every rank when one ran out of device memory."""
    try:
        call, failed = run(*shape), 0.0
    except torch.cuda.OutOfMemoryError:
        call, failed = None, 1.0
    if world.size > 1 or failed:
        failed = max(timer.gather([failed]))
    if failed:
        del call
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return None
    return timer.sustained(call, per_call, sustain)


def _state(device: torch.device, at_seconds: float = 0.0) -> DeviceState:
    """The SM clock and board power of a CUDA device where torch reads them (`torch.cuda.clock_rate`, `power_draw`:
    NVML through pynvml, optional); None each elsewhere."""
    readings: dict[str, float | None] = {"sm_clock_mhz": None, "power_w": None}
    if device.type == "cuda":
        for name, read, scale in (("sm_clock_mhz", "clock_rate", 1.0), ("power_w", "power_draw", 1e-3)):
            with contextlib.suppress(Exception):  # no NVML, no pynvml, an older torch: the throughput alone
                readings[name] = float(getattr(torch.cuda, read)(device)) * scale
    return DeviceState(at_seconds, **readings)


def _skipped(kind: str, device: torch.device) -> list[str]:
    if kind != "cuda":
        return ["fp8 and tf32 not measured on a CPU"]
    notes = [f"fp8 not measured: {problem}"] if (problem := _fp8_problem(device)) else []
    return notes + ([f"fp32 and tf32 not measured: {problem}"] if (problem := _fp32_problem()) else [])


def _matmul(dtype: torch.dtype, device: torch.device, tf32: bool | None = None):
    """`make(m, n, k)` -> the call of one GEMM (`out=`: no allocation in the timed loop). `tf32` (float32 on
    CUDA): the call runs with TF32 tensor cores on or off (`_fp32_mode`), whatever the process's setting."""
    def make(m: int, n: int, k: int) -> Callable[[], object]:
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        out = torch.empty(m, n, device=device, dtype=dtype)
        if tf32 is None:
            return lambda: torch.matmul(a, b, out=out)

        def call():
            with _fp32_mode(tf32):
                return torch.matmul(a, b, out=out)
        return call
    return make


@contextlib.contextmanager
def _fp32_mode(tf32: bool):
    """float32 GEMMs on TF32 tensor cores or in full fp32 ("ieee", what the language's fp32 means), through
    torch's setting since 2.9 (`torch.backends.cuda.matmul.fp32_precision`) or the one before it; restored."""
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):
        previous = matmul.fp32_precision
        matmul.fp32_precision = "tf32" if tf32 else "ieee"
        try:
            yield
        finally:
            matmul.fp32_precision = previous
        return
    previous = matmul.allow_tf32
    matmul.allow_tf32 = tf32
    try:
        yield
    finally:
        matmul.allow_tf32 = previous


def _fp32_problem() -> str | None:
    """Why float32 GEMMs cannot be pinned to TF32 on or off here (both are then skipped), or None."""
    try:
        with _fp32_mode(True), _fp32_mode(False):
            pass
    except Exception as error:  # noqa: BLE001 - a torch without either setting: say why and skip
        return f"{type(error).__name__}: {str(error)[:120]}"
    return None


def _fp8_problem(device: torch.device) -> str | None:
    """Why FP8 GEMMs cannot be measured here, or None (torch._scaled_mm with float8_e4m3fn: sm_89 and later)."""
    if device.type != "cuda":
        return "no CUDA device"
    if not hasattr(torch, "float8_e4m3fn") or not hasattr(torch, "_scaled_mm"):
        return f"torch {torch.__version__} has no float8_e4m3fn or _scaled_mm"
    if torch.cuda.get_device_capability(device) < (8, 9):
        return f"compute capability {torch.cuda.get_device_capability(device)} is below 8.9"
    try:
        _scaled_mm(device)(32, 32, 32)()
    except Exception as error:  # noqa: BLE001 - any refusal of the kernel: say why and skip
        return f"torch._scaled_mm failed: {type(error).__name__}: {str(error)[:120]}"
    return None


def _scaled_mm(device: torch.device):
    def make(m: int, n: int, k: int) -> Callable[[], object]:
        a = torch.randn(m, k, device=device).to(torch.float8_e4m3fn)
        b = torch.randn(n, k, device=device).to(torch.float8_e4m3fn).t()  # column-major, as cuBLASLt wants
        scale = torch.ones((), device=device, dtype=torch.float32)
        return lambda: torch._scaled_mm(a, b, scale_a=scale, scale_b=scale, out_dtype=torch.bfloat16)
    return make


ELEMENTWISE_SHAPE = {"cpu": (1024, 4096), "cuda": (32768, 4096)}
"""[rows, hidden] of the memory-bound kernels: 16 MiB in fp32 on a CPU, 256 MiB in bf16 on a GPU (past the caches)."""


def _memory_bound(device: torch.device) -> list[tuple[str, int, Callable[[], object]]]:
    """(name, bytes moved per call, call) of the kernels outside the GEMMs a training step runs most: a norm
    (read, write), an activation (read, write), a residual add (read two, write one), in the training dtype
    (bf16 on a GPU, fp32 on a CPU)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows, hidden = ELEMENTWISE_SHAPE[device.type]
    x = torch.randn(rows, hidden, device=device, dtype=dtype)
    y, out = torch.randn_like(x), torch.empty_like(x)
    weight, bias = torch.ones(hidden, device=device, dtype=dtype), torch.zeros(hidden, device=device, dtype=dtype)
    size = x.numel() * x.element_size()
    return [("layer_norm", 2 * size, lambda: torch.nn.functional.layer_norm(x, (hidden,), weight, bias)),
            ("gelu", 2 * size, lambda: torch.nn.functional.gelu(x)),
            ("add", 3 * size, lambda: torch.add(x, y, out=out))]


def _copy(nbytes: int, device: torch.device) -> Callable[[], object]:
    source = torch.ones(nbytes // 4, device=device, dtype=torch.float32)
    target = torch.empty_like(source)
    return lambda: target.copy_(source)


# ---- collectives --------------------------------------------------------------------------------------
def _group(world: World, settings: Settings, across: bool):
    """This rank's group: the ranks of its node, or (`across`) the ranks of its local index on every node.
    Every rank creates every group (torch.distributed requires it), in the same order."""
    per_node, nodes = settings.nproc_per_node, settings.nnodes
    if not across:
        groups = [list(range(n * per_node, (n + 1) * per_node)) for n in range(nodes)]
        mine = world.rank // per_node
        if nodes == 1:
            return None, per_node  # the default group
    else:
        groups = [list(range(local, per_node * nodes, per_node)) for local in range(per_node)]
        mine = world.rank % per_node
    made = [dist.new_group(ranks) for ranks in groups]
    return made[mine], len(groups[mine])


def _time_collective(collective: str, nbytes: int, group, size: int, world: World, settings: Settings,
                     across: bool, device: torch.device, timer: _Timer) -> list[float]:
    """Seconds of one collective of `nbytes` (as `cost.comm` counts them) per repeat, every rank's repeats.
    Point-to-point is a ping-pong between the group's first two ranks (half a round trip each), while
    the other ranks wait."""
    elements = max(size, nbytes // 4 // size * size)
    calls = max(1, min(MAX_CALLS, COMM_BYTES_PER_REPEAT[device.type] // max(nbytes, 1)))
    call = _collective(collective, elements, group, size, world, settings, across, device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # all_gather_into_tensor's rename in torch 2.13
        timer.barrier()
        if call is not None:
            timer.elapsed(call, 1)  # warm-up: the communicator's connections and buffers
        samples = []
        for _ in range(REPEATS_QUICK if settings.quick else REPEATS):
            timer.barrier()
            samples.append(timer.elapsed(call, calls) if call is not None else math.nan)
    everyone = timer.gather(samples)
    if collective == "p2p":  # half a round trip, as seen by the ranks that took part
        everyone = [t / 2 for t in everyone if not math.isnan(t)]
    return everyone


def _collective(collective: str, elements: int, group, size: int, world: World, settings: Settings,
                across: bool, device: torch.device) -> Callable[[], object] | None:
    data = torch.ones(elements, device=device, dtype=torch.float32)
    if collective == "all_reduce":
        return lambda: dist.all_reduce(data, group=group)
    if collective == "all_gather":  # `nbytes` is the gathered output
        shard = data[: elements // size].clone()
        return lambda: dist.all_gather_into_tensor(data, shard, group=group)
    if collective == "reduce_scatter":  # `nbytes` is the input
        shard = torch.empty(elements // size, device=device, dtype=torch.float32)
        return lambda: dist.reduce_scatter_tensor(shard, data, group=group)
    if collective == "all_to_all":  # `nbytes` is what one rank sends (and receives)
        received = torch.empty_like(data)
        return lambda: dist.all_to_all_single(received, data, group=group)
    # p2p: the first two ranks of this rank's group (in the node: local ranks 0 and 1; across nodes: local
    # rank 0 of nodes 0 and 1); global ranks, as send/recv take them
    per_node = settings.nproc_per_node
    first = 0 if across else (world.rank // per_node) * per_node
    second = first + (per_node if across else 1)
    if world.rank not in (first, second):
        return None
    peer = second if world.rank == first else first

    def ping_pong() -> None:
        if world.rank == first:
            dist.send(data, peer)
            dist.recv(data, peer)
        else:
            dist.recv(data, peer)
            dist.send(data, peer)
    return ping_pong


# ---- facts about the machine ----------------------------------------------------------------------------
def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()} ({os.cpu_count()} cores)"


def _sms(device: torch.device) -> int | None:
    """A GPU's streaming multiprocessors, as the cluster file's `sms` states them; None on a CPU."""
    return int(torch.cuda.get_device_properties(device).multi_processor_count) if device.type == "cuda" else None


def _device_memory(device: torch.device, settings: Settings) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 4 * 2**30
    return int(total // settings.nproc_per_node)


__all__ = ["Settings", "World", "measure"]
