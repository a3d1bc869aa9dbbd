"""Lowering passes over the schedule IR: compute-only schedule -> schedule with communication.

`add_send_recv(schedule) -> schedule` adds the point-to-point actions a compute-only schedule
implies, in torch.distributed.pipelining's notation (`0SEND_F1` on the sender, `1RECV_F1` on the
receiver). Passes never mutate their input; `add_send_recv(s).compute_only() == s.compute_only()`.
"""
from __future__ import annotations

from dataclasses import replace

from .program import Action, Kind, Schedule

_BACKWARD = (Kind.B, Kind.I)


def add_send_recv(schedule: Schedule) -> Schedule:
    """Derive the sends and receives of a compute-only schedule.

    After F(s, m) on rank r, when stage s+1 of the microbatch's pipeline lives on another rank:
    `sSEND_Fm` right after it on r, and `s+1RECV_Fm` right before F(s+1, m) on the receiver.
    After B or I of (s, m), when stage s-1 lives elsewhere: `sSEND_Bm` right after it, and
    `s-1RECV_Bm` right before B/I(s-1, m). W sends nothing; neighbours on the same rank (the tip
    of a V) need no communication.

    Same meaning and notation as torch's `_add_send_recv`, with one difference in placement: torch
    appends a receive to the receiver's list as soon as its send is scheduled (receives as early
    as possible, which torch's `_defer_recv_ops` later moves back), whereas here every receive sits
    right before the compute action that consumes it. Sends are posted asynchronously and
    receives block, so this placement never adds a wait the compute order does not already have
    and is independent of any simulated interleaving. Communication already in the input is
    dropped and derived again, so the pass is idempotent.
    """
    last_stage = schedule.stages - 1
    maps, pipes = schedule.stage_to_rank, schedule.microbatch_pipeline
    F, RECV_F, SEND_F, RECV_B, SEND_B = Kind.F, Kind.RECV_F, Kind.SEND_F, Kind.RECV_B, Kind.SEND_B
    rows = []
    for rank, row in enumerate(schedule.actions):
        lowered: list[Action] = []
        append = lowered.append
        for action in row:
            kind = action.kind
            if kind is F:
                stage, microbatch = action.stage, action.microbatch
                ranks = maps[pipes[microbatch] if pipes else 0]
                if stage > 0 and ranks[stage - 1] != rank:
                    append(Action(stage, RECV_F, microbatch))
                append(action)
                if stage < last_stage and ranks[stage + 1] != rank:
                    append(Action(stage, SEND_F, microbatch))
            elif kind in _BACKWARD:
                stage, microbatch = action.stage, action.microbatch
                ranks = maps[pipes[microbatch] if pipes else 0]
                if stage < last_stage and ranks[stage + 1] != rank:
                    append(Action(stage, RECV_B, microbatch))
                append(action)
                if stage > 0 and ranks[stage - 1] != rank:
                    append(Action(stage, SEND_B, microbatch))
            elif kind is Kind.W:
                append(action)  # communication already present is derived again
        rows.append(tuple(lowered))
    return replace(schedule, actions=tuple(rows))
