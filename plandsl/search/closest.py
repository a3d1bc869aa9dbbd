"""What came closest to fitting among the candidates memory ruled out: the figure behind the search's "the closest".

Stage: inside the search, beside the space. Contract: `Closest` takes each candidate memory rules out with a
figure, its need over its devices' capacity, either exact (its plan estimated) or a lower bound (model states
alone, the node's states and activations over its stages, or "above the capacity"), and keeps the least in the
search's `SearchStats.memory_example*`. Since every figure is at most its candidate's need, an exact least is
the candidate closest to fitting; a bound least is only the lowest bound. `settle` estimates, lowest first,
the bounds of one-stage candidates (whose plan has one split, so its estimate is their need) until the least
is exact or a bound no estimate can settle, so that an empty search names the plan that really came closest.
"""
from __future__ import annotations

import heapq
import itertools
import math

from plandsl.cost.compute import Efficiency
from plandsl.cost.estimate import estimate_plan
from plandsl.lower.units import format_bytes
from plandsl.search.problem import NOTHING_KEPT, Candidate, Kept, SearchStats, build_plan

SETTLE_LIMIT = 32  # estimates `settle` may make (each ~ms; a search that found nothing spends them once)


class Closest:
    def __init__(self, stats: SearchStats, base, efficiency: Efficiency | None, kept: Kept = NOTHING_KEPT):
        self.stats, self.base, self.efficiency, self.kept = stats, base, efficiency, kept
        self._bounds: list = []            # heap of (ratio, order, text, candidate or None)
        self._order = itertools.count()
        self._exact: tuple[float, str] | None = None
        self._estimated: set[str] = set()  # candidates (by description) estimated, or bounded, once

    def bound(self, text: str, ratio: float, candidate: Candidate | None = None) -> None:
        """A lower bound on a candidate's need; `candidate` when one estimate of its plan gives its need (one
        stage), which `settle` may then make."""
        if candidate is not None:
            key = candidate.describe()
            if key in self._estimated:  # another mesh order of the same layout: memory does not depend on it
                return
            self._estimated.add(key)
        heapq.heappush(self._bounds, (ratio, next(self._order), text, candidate))
        self._publish()

    def estimated(self, candidate: Candidate, estimate) -> None:
        """A candidate whose plan's estimate does not fit: its need at its fullest pipeline rank, exact."""
        need, capacity = max(((m.total, c) for m, c in zip(estimate.memory, estimate.capacity)),
                             key=lambda pair: pair[0] / pair[1])
        ratio, where = need / capacity, ""
        host, room = max((getattr(m, "host", 0.0) for m in estimate.memory), default=0.0), \
            getattr(estimate, "host_capacity", math.inf)  # a figure without them offloads nothing
        if host / room > ratio:  # its offloaded activations past the host's memory (E514)
            need, capacity, ratio, where = host, room, host / room, " of host memory"
        if self._exact is None or ratio < self._exact[0]:
            self._exact = (ratio, f"{candidate.describe()} needs {format_bytes(need)}{where} per device "
                                  f"(of {format_bytes(capacity)})")
            self._publish()

    def above(self, candidate: Candidate, capacity: float) -> None:
        """A one-stage candidate whose blocks do not fit its rank: its need is above `capacity`, and its estimate
        says by how much (`settle`)."""
        self.bound(f"{candidate.describe()} needs more than {format_bytes(capacity)} per device", 1.0, candidate)

    def settle(self, limit: int = SETTLE_LIMIT) -> None:
        """Estimate the lowest bounds that one estimate settles, until the least figure is exact (or a bound
        that none settles is lowest, or `limit` estimates were made)."""
        for _ in range(limit):
            if not self._bounds or (self._exact is not None and self._exact[0] <= self._bounds[0][0]):
                break
            ratio, _, _, candidate = self._bounds[0]
            if candidate is None:
                break
            heapq.heappop(self._bounds)
            estimate = estimate_plan(build_plan(self.base, candidate, self.kept), self.efficiency)
            if not estimate.fits:  # (a candidate the caps refuse that its estimate fits is no closer than any)
                self.estimated(candidate, estimate)
        self._publish()

    def least(self) -> float:
        """The least figure `_publish` gives the stats (inf without any): the closest of several spaces'."""
        exact = [self._exact[0]] if self._exact is not None else []
        return min(exact + ([self._bounds[0][0]] if self._bounds else []), default=math.inf)

    def _publish(self) -> None:
        """The least figure into the stats; an exact one before a bound equal to it."""
        low = self._bounds[0] if self._bounds else None
        stats = self.stats
        if self._exact is not None and (low is None or self._exact[0] <= low[0]):
            stats.memory_example_ratio, stats.memory_example = self._exact
            stats.memory_example_exact = True
        elif low is not None:
            stats.memory_example_ratio, stats.memory_example, stats.memory_example_exact = low[0], low[2], False


__all__ = ["Closest", "SETTLE_LIMIT"]
