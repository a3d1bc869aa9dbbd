"""Measured / modelled ratios: how a profile's measurements correct the cost model's formulas.

Stage: cost model. Contract: `ratio_at(points, value)` is the ratio a table of (ln value, ratio) points,
sorted by ln value, gives at `value`: interpolated linearly in ln value between the points, the end's
beyond them, 1 for no points. GEMMs (`cost.compute`, by FLOPs) and collectives (`cost.comm`, by bytes)
read their measured tables through it.
"""
from __future__ import annotations

import bisect
import math
from typing import Sequence


def ratio_at(points: Sequence[tuple[float, float]], value: float) -> float:
    if not points or value <= 0:
        return 1.0
    x = math.log(value)
    if x <= points[0][0]:
        return points[0][1]
    if x >= points[-1][0]:
        return points[-1][1]
    i = bisect.bisect_right(points, (x, math.inf))
    (x0, r0), (x1, r1) = points[i - 1], points[i]
    return r0 + (r1 - r0) * (x - x0) / (x1 - x0)


__all__ = ["ratio_at"]
