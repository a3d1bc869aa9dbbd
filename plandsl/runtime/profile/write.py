"""A `Profile` -> the cluster file `plandsl profile` writes, and the report it prints.

Stage: interpreter (profile; pure, no torch). Contract: `fit_profile(profile)` derives the figures the
cost model takes (per precision: the peak, the GEMM knobs fitted by `cost.fit.fit_gemm` to the sustained
GEMM times (the burst ones where none was measured), and the measured GEMM table when the two knobs miss a
measured point by more than `TABLE_ABOVE`; the knobs of the bursts beside them; the memory bandwidth; the
node's link and NIC fitted by `cost.fit.fit_link`); `cluster_text(profile, name)` writes them in the plan
language (docs/language.md, "Measured clusters") with every measurement's spread, the bursts and their ratio to
the sustained figures as comments; `report_text(profile)` is the same as a table for the terminal.
"""
from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass

from plandsl import ir
from plandsl.cost.fit import CommSample, GemmFit, GemmSample, LinkFit, fit_gemm, fit_link
from plandsl.syntax.format import format_text
from plandsl.runtime.profile.results import CommTiming, GemmTiming, Profile, Spread

PRECISIONS = tuple(p.value for p in ir.Precision)
"""The language's precisions (`ir.Precision`), in the order the file lists them."""
ELEMENT_BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
TABLE_ABOVE = 0.10
"""The measured GEMMs are written as a table the cost model interpolates (`measured: [...]`) when the
fitted two-knob curve misses one of them by more than this fraction."""
KEYWORDS = frozenset("import param let device node cluster model plan schedule layer shard over with rank for in "
                     "on if else x true false or and not".split())


@dataclass(frozen=True)
class PrecisionFit:
    precision: str
    peak: float
    fit: GemmFit                           # to the sustained times (the bursts' where none was measured)
    timings: tuple[GemmTiming, ...]
    burst: GemmFit | None = None           # to the bursts, where sustained times were measured

    @property
    def table(self) -> bool:
        return self.fit.worst > TABLE_ABOVE

    @property
    def ratios(self) -> list[float]:
        """Sustained over burst throughput of each GEMM measured both ways."""
        return [g.ratio for g in self.timings if g.ratio is not None]


@dataclass(frozen=True)
class Fitted:
    precisions: tuple[PrecisionFit, ...]
    extras: tuple[GemmTiming, ...]         # tf32: comments only
    bandwidth: float
    link: LinkFit | None                   # None: one process per node, nothing measured
    nic: LinkFit | None                    # per device (the file writes it per node)


def round_up(value: float, digits: int = 3) -> float:
    """`value` rounded up to `digits` significant digits (a peak never below a measured rate)."""
    if value <= 0 or not math.isfinite(value):
        return value
    scale = 10 ** (digits - 1 - math.floor(math.log10(value)))
    rounded = math.ceil(value * scale - 1e-9) / scale
    return rounded if rounded >= value else math.ceil(value * scale) / scale


def fit_profile(profile: Profile) -> Fitted:
    bandwidth = device_bandwidth(profile)
    first: dict[tuple, GemmTiming] = {}
    for g in profile.gemms:  # a shape measured twice: its first timing (a table gives each shape once)
        first.setdefault((g.precision, g.m, g.n, g.k), g)
    gemms = tuple(first.values())
    fits = []
    for precision in PRECISIONS:
        timings = tuple(g for g in gemms if g.precision == precision)
        if not timings:
            continue
        # at least every rate the table states: its times are written to 4 significant digits, so a written
        # time may be 5e-4 below the measured one (a rate that much above), and the checker holds each row to
        # the peak (E217); the fastest of bursts and sustained windows alike
        peak = round_up(max(g.flops / min(g.seconds.median, g.held.median) for g in timings) * (1 + 5e-4))
        held = [GemmSample(g.m, g.n, g.k, g.held.median, ELEMENT_BYTES[precision]) for g in timings]
        bursts = [GemmSample(g.m, g.n, g.k, g.seconds.median, ELEMENT_BYTES[precision]) for g in timings]
        sustained = any(g.sustained is not None for g in timings)
        fits.append(PrecisionFit(precision, peak, fit_gemm(held, peak, bandwidth), timings,
                                 fit_gemm(bursts, peak, bandwidth) if sustained else None))
    extras = tuple(g for g in gemms if g.precision not in PRECISIONS)
    return Fitted(tuple(fits), extras, bandwidth, _link(profile.comms, False), _link(profile.comms, True))


def device_bandwidth(profile: Profile) -> float:
    """The device's `bandwidth`: the copy's. The memory-bound kernels of a step (a norm, an activation, an
    add) are written beside it as comments only: on a CPU they range over ten times (GeLU computes its erf,
    an add streams) and the cost model moves every byte outside the GEMMs, the optimizer step's included,
    at one bandwidth."""
    return profile.memory_bandwidth


def _link(comms: tuple[CommTiming, ...], across_nodes: bool) -> LinkFit | None:
    samples = [CommSample(c.collective, c.size, c.bytes, c.seconds.median) for c in comms
               if c.across_nodes == across_nodes]
    return fit_link(samples, across_nodes) if samples else None


# ---- numbers with units, as the language reads them ------------------------------------------------------
def quantity(value: float, units: tuple[tuple[str, float], ...], digits: int = 4) -> str:
    """`value` in the largest unit it is at least 1 of, `digits` significant digits: `61.23 us`."""
    for unit, factor in units:
        if abs(value) >= factor or factor == units[-1][1]:
            return f"{_significant(value / factor, digits)} {unit}"
    raise AssertionError("unreachable: the last unit always matches")


def _significant(value: float, digits: int) -> str:
    """`value` to `digits` significant digits as a plain decimal (no exponent, no trailing zeros)."""
    if value == 0 or not math.isfinite(value):
        return "0"
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(value))))
    text = f"{value:.{decimals}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


TIME_UNITS = (("s", 1.0), ("ms", 1e-3), ("us", 1e-6), ("ns", 1e-9))
FLOPS_UNITS = (("PFLOP/s", 1e15), ("TFLOP/s", 1e12), ("GFLOP/s", 1e9), ("MFLOP/s", 1e6), ("FLOP/s", 1.0))
BANDWIDTH_UNITS = (("TB/s", 1e12), ("GB/s", 1e9), ("MB/s", 1e6), ("KB/s", 1e3), ("B/s", 1.0))
SIZE_UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1))


def seconds(value: float) -> str:
    return quantity(value, TIME_UNITS)


def spread(s: Spread, unit=seconds) -> str:
    """`61.23 us (60.10-63.02 us, 7 runs)`: the median, then the fastest and slowest repeat."""
    return f"{unit(s.median)} (min {unit(s.low)}, max {unit(s.high)}, {s.count} run{'s' if s.count != 1 else ''})"


def _rate_spread(flops: float, s: Spread) -> str:
    rate = lambda t: quantity(flops / t, FLOPS_UNITS, 3)  # noqa: E731 - three uses below
    return f"{rate(s.median)} (min {rate(s.high)}, max {rate(s.low)})"


def identifier(stem: str) -> str:
    """A file stem as a name of the language: `my-box.2` -> `my_box_2`."""
    name = re.sub(r"[^A-Za-z0-9_]", "_", stem) or "profiled"
    if name[0].isdigit():
        name = "m_" + name
    return name + "_host" if name in KEYWORDS else name


# ---- the cluster file ---------------------------------------------------------------------------------
def cluster_text(profile: Profile, name: str) -> str:
    """The cluster file: a device `<name>_<cpu|gpu>`, a node `<name>` of `nproc_per_node` of them, and with
    several nodes a cluster `<name>_cluster`. Names are `identifier(name)`."""
    fitted = fit_profile(profile)
    name = identifier(name)
    device = f"{name}_{'gpu' if profile.kind == 'cuda' else 'cpu'}"
    out = [f"# Measured by `plandsl profile` on {profile.host}, {profile.date} (torch {profile.torch}"
           + (f", {profile.backend}" if profile.backend else "") + f", {profile.nproc_per_node} process(es) per node"
           + (f" x {profile.nnodes} nodes" if profile.nnodes > 1 else "") + ("; --quick" if profile.quick else "") + ").",
           f"# Device: {profile.device_name}" + (f", {profile.threads} thread(s) per process" if profile.kind == "cpu" else "")
           + ". Every figure is the median of repeated runs; the min and max are in the comments.",
           *_sustained_header(profile),
           *(f"# note: {note}" for note in profile.notes),
           f"device {device} {{",
           f"  memory    = {quantity(profile.device_memory, SIZE_UNITS)}"
           + ("  # the machine's memory / processes per node" if profile.kind == "cpu" else ""),
           f"  bandwidth = {quantity(fitted.bandwidth, BANDWIDTH_UNITS)}  # {_bandwidth_comment(profile)}",
           *([f"  sms       = {profile.sms}  # multi_processor_count: NCCL's and userbuffers' shares follow from it"]
             if profile.sms else []),
           "  peak      = { " + ", ".join(f"{p.precision}: {quantity(p.peak, FLOPS_UNITS, 3)}" for p in fitted.precisions)
           + " }  # the fastest GEMM measured in each precision",
           "  # The GEMM model's knobs per precision, fitted to the GEMMs below"
           + (" as sustained" if _sustained(profile) else "") + " (docs/cost-model.md): t = "
           "2mnk / (matmul * peak) + bytes / bandwidth + kernel_latency;",
           f"  # where they miss a GEMM by more than {TABLE_ABOVE:.0%}, the measured times (m, n, k, seconds) are "
           "given too and the cost model interpolates them.",
           "  efficiency = {"]
    for p in fitted.precisions:
        fit = p.fit
        if p.burst is not None:
            out.append(f"    # {p.precision} as bursts: {_knobs(p.burst)}; sustained / burst throughput {_ratios(p)}")
        head = f"    {p.precision}: {{ matmul: {_significant(fit.peak_fraction, 3)}, " \
               f"kernel_latency: {seconds(fit.kernel_seconds) if fit.kernel_seconds else '0 us'}"
        misses = f"  # the fit misses the GEMMs by {fit.typical:.0%} (median), {fit.worst:.0%} (max)"
        if not p.table:
            out.append(head + " }" + misses)
            continue
        out.append(head + "," + misses)
        rows = sorted(p.timings, key=lambda g: (g.flops, g.m, g.n, g.k))
        out.append("      measured: [" + ", ".join(f"[{g.m}, {g.n}, {g.k}, {seconds(g.held.median)}]"
                                                  for g in rows) + "]")
        out.append("    }")
    out.append("  }")
    out.append("}")
    out += _gemm_comments(fitted, profile)
    out.append("")
    out += _node(profile, fitted, name, device)
    return format_text("\n".join(out) + "\n", f"{name}.plan")  # laid out as `plandsl fmt` lays it out


def _bandwidth_comment(profile: Profile) -> str:
    copy = (f"a copy of {quantity(profile.memory_copy_bytes / 2, SIZE_UNITS)}: "
            f"{quantity(profile.memory_bandwidth, BANDWIDTH_UNITS)}, {spread(profile.memory_seconds)}")
    if not profile.kernels:
        return copy
    kernels = "; ".join(f"{k.name} {quantity(k.bandwidth, BANDWIDTH_UNITS)}, {spread(k.seconds)}"
                        for k in profile.kernels)
    return f"{copy}; a step's memory-bound kernels: {kernels}"


def _sustained(profile: Profile) -> bool:
    return any(g.sustained is not None for g in profile.gemms)


def _sustained_header(profile: Profile) -> list[str]:
    """How the sustained figures were taken, and the clock and power on the way where they were read."""
    if not _sustained(profile):
        return []
    lines = [f"# GEMMs sustained: the device held busy with back-to-back GEMMs for {profile.hold_seconds:g} s, then "
             f"each GEMM back to back, timed over {profile.window_seconds:g} s in parts; inputs drawn from a normal "
             "distribution.",
             "# The knobs below are the sustained ones (a training run holds the device busy); the bursts (a warm-up "
             "call and short repeats, as a benchmark times them) and the ratio are comments."]
    if profile.hold_states:
        first, last = profile.hold_states[0], profile.hold_states[-1]
        lines.append(f"# SM clock and board power during the hold: {_state(first)} at the start, {_state(last)} at "
                     f"{last.at_seconds:.0f} s.")
    return lines


def _state(state) -> str:
    clock = f"{state.sm_clock_mhz:.0f} MHz" if state.sm_clock_mhz is not None else "clock not read"
    power = f"{state.power_w:.0f} W" if state.power_w is not None else "power not read"
    return f"{clock}, {power}"


def _knobs(fit: GemmFit) -> str:
    return (f"matmul {_significant(fit.peak_fraction, 3)}, kernel_latency "
            f"{seconds(fit.kernel_seconds) if fit.kernel_seconds else '0 us'}")


def _ratios(p: PrecisionFit) -> str:
    """`0.962 (median over 7 GEMMs; min 0.931, max 0.99)`: sustained over burst throughput."""
    ratios = p.ratios
    return (f"{statistics.median(ratios):.3g} (median over {len(ratios)} GEMMs; min {min(ratios):.3g}, "
            f"max {max(ratios):.3g})")


def _gemm_line(g: GemmTiming) -> str:
    """`m x n x k: median (min, max, runs), FLOP/s`: sustained, then its burst and their ratio, where both were
    measured; else the burst alone."""
    shape = f"{g.m:>6} x {g.n:>6} x {g.k:>6}"
    if g.sustained is None:
        return f"{shape}: {spread(g.seconds)}, {quantity(g.rate, FLOPS_UNITS, 3)}"
    clock = f", {_state(g)}" if g.sm_clock_mhz is not None or g.power_w is not None else ""
    return (f"{shape}: {spread(g.sustained)}, {quantity(g.flops / g.sustained.median, FLOPS_UNITS, 3)}{clock}; "
            f"burst {spread(g.seconds)}, {quantity(g.rate, FLOPS_UNITS, 3)}; sustained / burst {g.ratio:.3f}")


def _gemm_comments(fitted: Fitted, profile: Profile) -> list[str]:
    held = "sustained " if _sustained(profile) else ""
    lines = [f"# GEMMs measured (m x n x k: {held}median time, min and max over the runs; FLOP/s at the median"
             + ("; the burst and sustained / burst throughput" if held else "") + "; the fitted curve's error):"]
    for p in fitted.precisions:
        for g, error in zip(p.timings, p.fit.errors):
            lines.append(f"#   {p.precision:5} {_gemm_line(g)}, fit {error:+.0%}")
    for g in fitted.extras:
        lines.append(f"#   {g.precision:5} {_gemm_line(g)} (no precision of the language: a comment only)")
    return lines


def _node(profile: Profile, fitted: Fitted, name: str, device: str) -> list[str]:
    lines = [f"node {name} {{", f"  devices = {profile.nproc_per_node} x {device}"]
    if fitted.link is None:
        lines.append(f"  link    = {{ bandwidth: {quantity(fitted.bandwidth, BANDWIDTH_UNITS)}, latency: 0 us }}"
                     "  # not measured: one process per node (the memory bandwidth stands in; no plan on one "
                     "device uses it)")
    else:
        lines.append(f"  link    = {_link_text(fitted.link, 1, _ordered(profile.comms, False))}  # {profile.backend}, "
                     f"fitted to every collective inside the node: misses by {fitted.link.typical:.0%} (median), "
                     f"{fitted.link.worst:.0%} (max)")
    if fitted.nic is not None:
        lines.append(f"  nic     = {_link_text(fitted.nic, profile.nproc_per_node, _ordered(profile.comms, True))}  "
                     f"# per node: every local rank at once across nodes; misses by {fitted.nic.typical:.0%} "
                     f"(median), {fitted.nic.worst:.0%} (max)")
    lines.append("}")
    if profile.nnodes > 1:
        lines += ["", f"cluster {name}_cluster {{", f"  nodes = [{name} x {profile.nnodes}]", "}"]
    if profile.comms:
        lines.append("# Collectives measured (bytes as the cost model counts them: median time, min and max; the "
                     "fitted link's error):")
        for comm, error in zip(_ordered(profile.comms, False), fitted.link.errors if fitted.link else ()):
            lines.append(_comm_comment(comm, error))
        for comm, error in zip(_ordered(profile.comms, True), fitted.nic.errors if fitted.nic else ()):
            lines.append(_comm_comment(comm, error))
    else:
        lines.append("# Collectives: not measured (world size 1: give --nproc-per-node 2 or more).")
    return lines


def _ordered(comms: tuple[CommTiming, ...], across_nodes: bool) -> list[CommTiming]:
    """The samples in the order `_link` fitted them (so the errors line up)."""
    return [c for c in comms if c.across_nodes == across_nodes]


def _comm_comment(comm: CommTiming, error: float) -> str:
    where = "across nodes" if comm.across_nodes else "in the node"
    return (f"#   {comm.collective:14} {quantity(comm.bytes, SIZE_UNITS, 3):>9} over {comm.size} {where}: "
            f"{spread(comm.seconds)}, fit {error:+.0%}")


def _link_text(fit: LinkFit, devices: int, comms: list[CommTiming] = ()) -> str:
    """`{ bandwidth, latency }`, and the measured collectives (`measured: { all_reduce: [[ranks, bytes, time],
    ...], ... }`) when the fitted pair misses one of `comms` by more than `TABLE_ABOVE`."""
    text = (f"{{ bandwidth: {quantity(fit.bandwidth * devices, BANDWIDTH_UNITS)}, "
            f"latency: {seconds(fit.latency) if fit.latency else '0 us'}")
    if comms and fit.worst > TABLE_ABOVE:
        tables = []
        for collective in dict.fromkeys(c.collective for c in comms):
            rows = sorted((c for c in comms if c.collective == collective), key=lambda c: (c.bytes, c.size))
            tables.append(f"{collective}: [" + ", ".join(f"[{c.size}, {quantity(c.bytes, SIZE_UNITS)}, "
                                                          f"{seconds(c.seconds.median)}]" for c in rows) + "]")
        text += ", measured: { " + ", ".join(tables) + " }"
    return text + " }"


# ---- the report ---------------------------------------------------------------------------------------
def _gemm_report(fitted: Fitted, profile: Profile) -> list[str]:
    """The GEMMs as bursts and sustained, each with its spread, their ratio and the fit's error; each precision's
    knobs (the sustained ones, and the bursts' beside them)."""
    if not _sustained(profile):
        lines = ["GEMM   m x n x k               median time (min, max)                   FLOP/s (min, max)         fit"]
        for p in fitted.precisions:
            for g, error in zip(p.timings, p.fit.errors):
                lines.append(f"{p.precision:5} {g.m:>5} x {g.n:>5} x {g.k:>5}  {spread(g.seconds):44} "
                             f"{_rate_spread(g.flops, g.seconds):26} {error:+.0%}")
            lines.append(_precision_summary(p))
        for g in fitted.extras:
            lines.append(f"{g.precision:5} {g.m:>5} x {g.n:>5} x {g.k:>5}  {spread(g.seconds):44} "
                         f"{_rate_spread(g.flops, g.seconds)}")
        return lines
    lines = [f"GEMMs as bursts, then sustained: the device held busy {profile.hold_seconds:g} s, each GEMM back to back "
             f"and timed over {profile.window_seconds:g} s" + (f"; SM clock and power {_state(profile.hold_states[0])} "
                                                                f"-> {_state(profile.hold_states[-1])} over the hold"
                                                                if profile.hold_states else ""),
             "GEMM   m x n x k      burst FLOP/s (min, max)        sustained FLOP/s (min, max)    sustained/burst  fit"]
    for p in fitted.precisions:
        for g, error in zip(p.timings, p.fit.errors):
            lines.append(_gemm_row(p.precision, g) + f" {error:+.0%}")
        lines.append(_precision_summary(p))
    lines += [_gemm_row(g.precision, g) for g in fitted.extras]
    return lines


def _gemm_row(precision: str, g: GemmTiming) -> str:
    held = _rate_spread(g.flops, g.sustained) if g.sustained is not None else "not measured"
    ratio = f"{g.ratio:.3f}" if g.ratio is not None else ""
    return (f"{precision:5} {g.m:>5} x {g.n:>5} x {g.k:>5}  {_rate_spread(g.flops, g.seconds):30} {held:30} "
            f"{ratio:>15}")


def _precision_summary(p: PrecisionFit) -> str:
    line = (f"  {p.precision}: peak {quantity(p.peak, FLOPS_UNITS, 3)}, matmul {p.fit.peak_fraction:.3g}, "
            f"kernel_latency {seconds(p.fit.kernel_seconds)}; misses by {p.fit.typical:.0%} (median), "
            f"{p.fit.worst:.0%} (max)" + ("; the measured table is written" if p.table else ""))
    if p.burst is not None:
        line += f"; as bursts {_knobs(p.burst)}; sustained / burst throughput {_ratios(p)}"
    return line


def report_text(profile: Profile) -> str:
    """What `plandsl profile` prints: every measurement with its spread, and the fitted figures."""
    fitted = fit_profile(profile)
    lines = [f"{profile.host}: {profile.device_name}, {profile.nproc_per_node} process(es) per node"
             + (f" x {profile.nnodes} nodes" if profile.nnodes > 1 else "") + f", torch {profile.torch}"
             + (f", {profile.backend}" if profile.backend else "") + f"; measured in {profile.wall_seconds:.1f} s",
             f"memory bandwidth  {quantity(fitted.bandwidth, BANDWIDTH_UNITS)}  ({_bandwidth_comment(profile)})",
             *_gemm_report(fitted, profile)]
    for across, fit in ((False, fitted.link), (True, fitted.nic)):
        comms = _ordered(profile.comms, across)
        if not comms:
            continue
        lines.append(f"collective ({'across nodes' if across else 'inside the node'})   bytes  ranks  median time "
                     "(min, max)                     fit")
        for comm, error in zip(comms, fit.errors):
            lines.append(f"{comm.collective:14} {quantity(comm.bytes, SIZE_UNITS, 3):>9} {comm.size:6}  "
                         f"{spread(comm.seconds):44} {error:+.0%}")
        scale = profile.nproc_per_node if across else 1
        lines.append(f"  {'nic (per node)' if across else 'link'}: {_link_text(fit, scale)}; misses by "
                     f"{fit.typical:.0%} (median), {fit.worst:.0%} (max)"
                     + ("; the measured table is written" if fit.worst > TABLE_ABOVE else ""))
    if not profile.comms:
        lines.append("collectives: skipped (world size 1)")
    lines += [f"note: {note}" for note in profile.notes]
    return "\n".join(lines)


__all__ = ["Fitted", "PrecisionFit", "fit_profile", "cluster_text", "report_text", "identifier", "round_up",
           "TABLE_ABOVE"]
