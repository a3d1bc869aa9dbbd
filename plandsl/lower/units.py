"""Units of quantities (`80 GiB`, `312 TFLOP/s`, `600 GB/s`, `5 us`) -> SI values.

Each unit has a dimension and a factor to the base unit of that dimension: bytes,
bytes/s, FLOP, FLOP/s, seconds. Bits (`b`, `Gb/s`) are converted to bytes.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Dimension:
    name: str
    example: str


BYTES = Dimension("bytes", "80 GiB")
BANDWIDTH = Dimension("bandwidth", "600 GB/s")
FLOPS = Dimension("FLOP/s", "312 TFLOP/s")
FLOP = Dimension("FLOP", "3.1e23 FLOP")
TIME = Dimension("time", "5 us")

_DECIMAL = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18}
_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50}


def _table() -> dict[str, tuple[Dimension, float]]:
    units: dict[str, tuple[Dimension, float]] = {}
    for prefix, factor in _DECIMAL.items():
        units[f"{prefix}B"] = (BYTES, factor)
        units[f"{prefix}b"] = (BYTES, factor / 8)
        units[f"{prefix}B/s"] = (BANDWIDTH, factor)
        units[f"{prefix}b/s"] = (BANDWIDTH, factor / 8)
        units[f"{prefix}FLOP"] = (FLOP, factor)
        units[f"{prefix}FLOP/s"] = (FLOPS, factor)
    for prefix, factor in _BINARY.items():
        units[f"{prefix}B"] = (BYTES, factor)
        units[f"{prefix}B/s"] = (BANDWIDTH, factor)
    units.update({"bps": (BANDWIDTH, 1 / 8), "Gbps": (BANDWIDTH, 1e9 / 8),
                  "s": (TIME, 1.0), "ms": (TIME, 1e-3), "us": (TIME, 1e-6), "ns": (TIME, 1e-9),
                  "min": (TIME, 60.0), "h": (TIME, 3600.0)})
    return units


UNITS = _table()


def lookup(unit: str) -> tuple[Dimension, float] | None:
    return UNITS.get(unit)


_SYNONYMS = {"sec": "s", "secs": "s", "second": "s", "seconds": "s", "msec": "ms", "usec": "us", "nsec": "ns",
             "GBps": "GB/s", "MBps": "MB/s", "TBps": "TB/s", "FLOPS": "FLOP/s", "flops": "FLOP/s",
             "TFLOPS": "TFLOP/s", "TFLOPs": "TFLOP/s", "GFLOPS": "GFLOP/s", "PFLOPS": "PFLOP/s",
             "Gbit/s": "Gb/s", "Gbits": "Gb", "bytes": "B", "byte": "B"}


def suggest(unit: str) -> str | None:
    """The unit someone writing `unit` most likely meant: synonyms, then case, then spelling."""
    if unit in _SYNONYMS:
        return _SYNONYMS[unit]
    folded = [u for u in UNITS if u.lower() == unit.lower()]
    if folded:
        return folded[0] if len(folded) == 1 else next((u for u in folded if "i" in u), folded[0])
    import difflib  # lazy: difflib only for a misspelt name, never on a clean check
    close = difflib.get_close_matches(unit, list(UNITS), n=1, cutoff=0.6)
    return close[0] if close else None


def units_of(dimension: Dimension) -> list[str]:
    return [u for u, (d, _) in UNITS.items() if d == dimension]


def format_bytes(value: float) -> str:
    for unit, factor in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(value) >= factor:
            return f"{value / factor:.1f} {unit}"
    return f"{value:.0f} B"


_COUNT_SUFFIXES = (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3))


def format_count(value: float) -> str:
    """A count (parameters, tokens) for people: 3 significant digits and a suffix (`235K`, `175B`, `100T`);
    past 999T, which no real model reaches, plain scientific notation (`1.2e15`), never `1e+05B`."""
    n = abs(float(value))
    sign = "-" if value < 0 else ""
    if n >= 999.5e12:
        mantissa, exponent = f"{n:.2e}".split("e")
        return f"{sign}{float(mantissa):.3g}e{int(exponent)}"
    for suffix, factor in _COUNT_SUFFIXES:
        if float(f"{n / factor:.3g}") >= 1:
            return f"{sign}{float(f'{n / factor:.3g}'):g}{suffix}"
    return f"{sign}{n:.3g}" if n != int(n) else f"{sign}{int(n)}"
