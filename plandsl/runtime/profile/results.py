"""What `plandsl profile` measured, as plain frozen records that travel as JSON from rank 0 to the command.

Stage: interpreter (profile). Contract: `Profile` holds every timing with its spread over repeats
(`Spread`: median, min, max; over every rank too when several measured at once; a GEMM's as a burst and
sustained) and the facts about the machine the cluster file states; `to_json`/`from_json` round-trip it. No torch here.
"""
from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from typing import Sequence


@dataclass(frozen=True, slots=True)
class Spread:
    """Seconds of one repeated measurement: the median, the fastest and the slowest repeat, and how many."""

    median: float
    low: float
    high: float
    count: int

    @staticmethod
    def of(values: Sequence[float]) -> "Spread":
        if not values:
            raise ValueError("a spread of no values")
        return Spread(statistics.median(values), min(values), max(values), len(values))


@dataclass(frozen=True, slots=True)
class GemmTiming:
    """m x k by k x n in `precision` (fp32 with TF32 off; tf32 is an extra row the language has no precision
    for, written as a comment): `seconds` a burst (short repeats, as a benchmark times it), `sustained` the same
    GEMM timed with the device held busy back to back (None: not measured), and the SM clock (MHz) and board
    power (W) at the end of its sustained window where torch reads them (CUDA with NVML)."""

    precision: str
    m: int
    n: int
    k: int
    seconds: Spread
    sustained: Spread | None = None
    sm_clock_mhz: float | None = None
    power_w: float | None = None

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k

    @property
    def rate(self) -> float:
        """FLOP/s of the burst, at its median."""
        return self.flops / self.seconds.median

    @property
    def held(self) -> Spread:
        """The seconds the cost model's knobs are fitted to: the sustained ones, else the burst's."""
        return self.sustained if self.sustained is not None else self.seconds

    @property
    def ratio(self) -> float | None:
        """Sustained over burst throughput at the medians (below 1: the held device is slower), None unmeasured."""
        return self.seconds.median / self.sustained.median if self.sustained is not None else None


@dataclass(frozen=True, slots=True)
class DeviceState:
    """The SM clock (MHz) and board power (W) `at_seconds` into the hold, each None where torch cannot read it."""

    at_seconds: float
    sm_clock_mhz: float | None
    power_w: float | None


@dataclass(frozen=True, slots=True)
class CommTiming:
    """A collective (`cost.comm.COLLECTIVES`) of `bytes` (as the cost model counts them) over `size` ranks,
    inside one node (`across_nodes` False: every rank of a node) or across nodes (one rank of each node per
    group, every local rank's group at once)."""

    collective: str
    size: int
    bytes: int
    across_nodes: bool
    seconds: Spread


@dataclass(frozen=True, slots=True)
class KernelTiming:
    """A memory-bound kernel of a training step (`layer_norm`, `gelu`, `add`) that moves `bytes` (reads and
    writes) per call, in `seconds`: the bandwidth the work outside the GEMMs gets."""

    name: str
    bytes: int
    seconds: Spread

    @property
    def bandwidth(self) -> float:
        return self.bytes / self.seconds.median


@dataclass(frozen=True, slots=True)
class Profile:
    host: str
    date: str                       # ISO 8601, UTC
    torch: str
    backend: str                    # gloo or nccl ("" with one process: no collectives)
    kind: str                       # cpu or cuda
    device_name: str                # the CPU model or the GPU's name
    device_memory: int              # bytes per device (a CPU process: the machine's memory / processes per node)
    threads: int                    # CPU threads per process (torch.get_num_threads)
    nproc_per_node: int
    nnodes: int
    quick: bool
    memory_copy_bytes: int          # bytes of the copy that measured the memory bandwidth (read + write counted)
    memory_seconds: Spread
    gemms: tuple[GemmTiming, ...]
    comms: tuple[CommTiming, ...] = ()
    notes: tuple[str, ...] = field(default=())
    wall_seconds: float = 0.0
    kernels: tuple[KernelTiming, ...] = ()
    hold_seconds: float = 0.0               # the device held busy before the sustained timings (0: none taken)
    window_seconds: float = 0.0             # each GEMM's timed sustained window (after its settle)
    hold_states: tuple[DeviceState, ...] = ()  # the SM clock and power during the hold (CUDA with NVML)
    sms: int | None = None                  # streaming multiprocessors of a GPU (None on a CPU)

    @property
    def kernel_bandwidth(self) -> float | None:
        """bytes/s the memory-bound kernels reach (the median over them), None when none was timed."""
        if not self.kernels:
            return None
        return statistics.median(k.bandwidth for k in self.kernels)

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    @property
    def memory_bandwidth(self) -> float:
        """bytes/s at the median copy: read and write both move `memory_copy_bytes` / 2."""
        return self.memory_copy_bytes / self.memory_seconds.median

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @staticmethod
    def from_json(text: str) -> "Profile":
        data = json.loads(text)
        data["memory_seconds"] = Spread(**data["memory_seconds"])
        data["gemms"] = tuple(GemmTiming(**{**g, "seconds": Spread(**g["seconds"]),
                                            "sustained": Spread(**g["sustained"]) if g.get("sustained") else None})
                              for g in data["gemms"])
        data["hold_states"] = tuple(DeviceState(**state) for state in data.get("hold_states", ()))
        data["comms"] = tuple(CommTiming(**{**c, "seconds": Spread(**c["seconds"])}) for c in data["comms"])
        data["notes"] = tuple(data["notes"])
        data["kernels"] = tuple(KernelTiming(**{**k, "seconds": Spread(**k["seconds"])}) for k in data.get("kernels", ()))
        return Profile(**data)


__all__ = ["Spread", "GemmTiming", "DeviceState", "CommTiming", "KernelTiming", "Profile"]
