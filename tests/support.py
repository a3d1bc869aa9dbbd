"""What several test files share: a valid plan to mutate, and reference schedules written from
their papers' definitions (independent of plandsl.schedules.generators)."""
from __future__ import annotations

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
