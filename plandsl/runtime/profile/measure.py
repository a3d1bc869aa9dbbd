"""The measurements of `plandsl profile`, through torch: GEMMs per dtype and shape, a memory copy, collectives.

Stage: interpreter (profile). Contract: `measure(settings, world, progress)` runs on every rank at once
(one process: `world` is `World()`, no process group) and returns the `Profile` on rank 0 (None on the
others). Every rank times the same GEMMs at the same time (a device is measured as loaded as a training
step loads it: on a CPU the processes share the cores and the memory bus), and rank 0 keeps every rank's
repeats. Work is bounded by the tables below, never by a number a user gives: the shapes, sizes, repeats
and a cap on calls per repeat. Timing: `time.perf_counter` on a CPU; CUDA events after a warm-up call on
a GPU (the events bracket `calls` launches, so one launch's overhead is amortised as in a training step).
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

from plandsl.runtime.profile.results import CommTiming, GemmTiming, KernelTiming, Profile, Spread

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class Settings:
    quick: bool = False
    nproc_per_node: int = 1
    nnodes: int = 1


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


def measure(settings: Settings, world: World = World(), progress: Progress | None = None) -> Profile | None:
    started = time.perf_counter()
    cuda = torch.cuda.is_available()
    kind = "cuda" if cuda else "cpu"
    device = torch.device("cuda", world.local_rank) if cuda else torch.device("cpu")
    timer = _Timer(device, world)
    plan = _gemm_plan(kind, settings.quick, device)
    sizes = COMM_SIZES[(kind, settings.quick)] if world.size > 1 else ()
    # inside a node when it has several processes; across nodes when there are several
    scopes = ([False] if settings.nproc_per_node > 1 else []) + ([True] if settings.nnodes > 1 else [])
    total = len(plan) + 2 + len(sizes) * len(COLLECTIVES) * len(scopes)
    done = 0

    def step() -> None:
        nonlocal done
        done += 1
        if progress is not None and world.rank == 0:
            progress(done, total)

    notes: list[str] = []
    gemms: list[GemmTiming] = []
    for precision, shape, run in plan:
        samples = _gemm_samples(run, shape, timer, settings.quick, world)
        if samples is None:
            notes.append(f"{precision} {' x '.join(map(str, shape))}: skipped, out of device memory")
        else:
            gemms.append(GemmTiming(precision, *shape, Spread.of(samples)))
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
                   wall_seconds=time.perf_counter() - started, kernels=kernels)


# ---- timing -------------------------------------------------------------------------------------------
class _Timer:
    """Repeats of a callable on every rank at once, each rank's repeats gathered on every rank."""

    def __init__(self, device: torch.device, world: World):
        self.device, self.world = device, world
        self.cuda = device.type == "cuda"

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
        begin = time.perf_counter()
        for _ in range(calls):
            call()
        return (time.perf_counter() - begin) / calls

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


def _device_memory(device: torch.device, settings: Settings) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 4 * 2**30
    return int(total // settings.nproc_per_node)


__all__ = ["Settings", "World", "measure"]
