"""Fits of the cost model's hardware knobs to measured timings (`plandsl profile`), as pure functions.

Stage: cost model. Contract: `fit_gemm(samples, peak, bandwidth)` returns the `GemmFit` (`peak_fraction`,
`kernel_seconds`) of `cost.compute`'s GEMM model that best explains measured GEMM times;
`fit_link(samples, ...)` the bandwidth and latency of `cost.comm`'s alpha-beta collectives that best
explain measured collective times. Both minimise the squared *relative* error (a 10 us GEMM weighs as
much as a 10 ms one: the curve must hold for small shards too) by least squares on a model that is
linear in its two unknowns, under the knobs' physical bounds. No torch: the tests feed synthetic timings.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Sequence

from plandsl.cost.comm import GroupLinks, estimate_collective


@dataclass(frozen=True, slots=True)
class GemmSample:
    """One measured GEMM: m x k by k x n, with elements of `element_bytes`, in `seconds` (the median)."""

    m: int
    n: int
    k: int
    seconds: float
    element_bytes: int

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k

    @property
    def moved(self) -> float:
        """Bytes of A, B and C, as `cost.compute.Efficiency.gemm_seconds` counts them."""
        return (self.m * self.k + self.k * self.n + self.m * self.n) * self.element_bytes


class _Errors:
    """What a fit's per-sample relative errors (`errors`: (model - measured) / measured) say."""

    __slots__ = ()
    errors: tuple[float, ...]

    @property
    def worst(self) -> float:
        return max((abs(e) for e in self.errors), default=0.0)

    @property
    def typical(self) -> float:
        return statistics.median(abs(e) for e in self.errors) if self.errors else 0.0


@dataclass(frozen=True, slots=True)
class GemmFit(_Errors):
    peak_fraction: float
    kernel_seconds: float
    errors: tuple[float, ...]
    """Per sample, (model - measured) / measured."""


def gemm_model(sample: GemmSample, peak: float, bandwidth: float, peak_fraction: float, kernel_seconds: float) -> float:
    """`cost.compute`'s GEMM time: 2mnk / (peak_fraction · peak) + bytes / bandwidth + kernel_seconds."""
    return sample.flops / (peak_fraction * peak) + sample.moved / bandwidth + kernel_seconds


def fit_gemm(samples: Sequence[GemmSample], peak: float, bandwidth: float) -> GemmFit:
    """The knobs under which `gemm_model` comes closest to `samples` (relative least squares), with
    0 < peak_fraction <= 1 and kernel_seconds >= 0. t - bytes/bw = a · 2mnk/peak + c is linear in
    a = 1/peak_fraction and c = kernel_seconds."""
    if not samples:
        raise ValueError("fit_gemm needs at least one sample")
    rows = [(s.flops / peak, 1.0, s.seconds - s.moved / bandwidth, s.seconds) for s in samples]
    a, c = _bounded_least_squares(rows, lower=(1.0, 0.0))
    fit = GemmFit(1.0 / a, c, ())
    errors = tuple((gemm_model(s, peak, bandwidth, fit.peak_fraction, c) - s.seconds) / s.seconds for s in samples)
    return GemmFit(fit.peak_fraction, c, errors)


@dataclass(frozen=True, slots=True)
class CommSample:
    """One measured collective (`cost.comm.COLLECTIVES`) over a group of `size` devices, `bytes` as
    `cost.comm.estimate_collective` counts them, in `seconds` (the median)."""

    collective: str
    size: int
    bytes: float
    seconds: float


@dataclass(frozen=True, slots=True)
class LinkFit(_Errors):
    bandwidth: float
    """bytes/s per device, each direction"""
    latency: float
    """seconds per step of a ring"""
    errors: tuple[float, ...]


def _coefficients(sample: CommSample, across_nodes: bool) -> tuple[float, float]:
    """(latency steps, bytes at the bandwidth) of `cost.comm`'s model for the sample: its seconds are
    steps · latency + moved / bandwidth. Inside a node every member shares it; across nodes, one member
    per node (the inter-node link)."""
    n = sample.size
    unit = GroupLinks(n, 1, n, 1.0, 1.0, 1.0, 1.0) if across_nodes else GroupLinks(n, n, 1, 1.0, 1.0, 1.0, 1.0)
    estimate = estimate_collective(sample.collective, sample.bytes, unit)
    return estimate.latency, estimate.intra + estimate.inter


def fit_link(samples: Sequence[CommSample], across_nodes: bool = False) -> LinkFit:
    """The bandwidth and latency under which `cost.comm.estimate_collective` comes closest to the samples
    (relative least squares; latency >= 0, bandwidth > 0)."""
    if not samples:
        raise ValueError("fit_link needs at least one sample")
    rows = []
    for sample in samples:
        steps, moved = _coefficients(sample, across_nodes)
        rows.append((moved, steps, sample.seconds, sample.seconds))
    inverse, latency = _bounded_least_squares(rows, lower=(1e-30, 0.0))
    bandwidth = 1.0 / inverse
    errors = []
    for sample in samples:
        steps, moved = _coefficients(sample, across_nodes)
        errors.append((steps * latency + moved / bandwidth - sample.seconds) / sample.seconds)
    return LinkFit(bandwidth, latency, tuple(errors))


def _bounded_least_squares(rows, lower: tuple[float, float]) -> tuple[float, float]:
    """min over (p, q) >= lower of sum(((p·x + q·z - y) / w)^2) for rows (x, z, y, w): the unconstrained
    solution when it is inside the bounds, else the best point on a bound (the problem is convex, so the
    optimum lies on the boundary when not inside)."""
    scaled = [(x / w, z / w, y / w) for x, z, y, w in rows if w > 0]

    def loss(p: float, q: float) -> float:
        return sum((p * x + q * z - y) ** 2 for x, z, y in scaled)

    def best_p(q: float) -> float:
        xx = sum(x * x for x, _, _ in scaled)
        return max(lower[0], sum(x * (y - q * z) for x, z, y in scaled) / xx) if xx > 0 else lower[0]

    def best_q(p: float) -> float:
        zz = sum(z * z for _, z, _ in scaled)
        return max(lower[1], sum(z * (y - p * x) for x, z, y in scaled) / zz) if zz > 0 else lower[1]

    candidates = [(best_p(lower[1]), lower[1]), (lower[0], best_q(lower[0]))]
    sxx = sum(x * x for x, _, _ in scaled)
    szz = sum(z * z for _, z, _ in scaled)
    sxz = sum(x * z for x, z, _ in scaled)
    sxy = sum(x * y for x, _, y in scaled)
    szy = sum(z * y for _, z, y in scaled)
    determinant = sxx * szz - sxz * sxz
    if abs(determinant) > 1e-12 * max(sxx * szz, 1e-300):
        p = (sxy * szz - sxz * szy) / determinant
        q = (sxx * szy - sxz * sxy) / determinant
        if p >= lower[0] and q >= lower[1] and math.isfinite(p) and math.isfinite(q):
            candidates.append((p, q))
    return min(candidates, key=lambda pq: loss(*pq))


__all__ = ["GemmSample", "GemmFit", "gemm_model", "fit_gemm", "CommSample", "LinkFit", "fit_link"]
