"""A token file checked against a plan before any rank starts (numpy only: the launcher does not import torch).

Stage: interpreter (launcher side and each rank). Contract: `token_file_problem(path, plan)` is None when
`plan` can train on the nanoGPT-style uint16 file, else the reason, found in constant memory.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from plandsl import ir
from plandsl.syntax.files import FileProblem, check_regular


def token_file_problem(token_file: str | Path, plan: ir.Plan) -> str | None:
    """Why `plan` cannot train on `token_file`, or None: it must be a regular file (checked first, so a
    device or FIFO is never mapped) of more than seq + 1 uint16 tokens, each below the model's vocab
    (read through a memory map in bounded chunks: constant memory whatever its size)."""
    try:
        size = check_regular(token_file, "token file").st_size
    except FileProblem as problem:
        return problem.message
    count, seq = size // 2, plan.seq or 0
    if count <= seq + 1:
        return f"{count} tokens, fewer than seq + 2 ({seq + 2}): a sequence and its next token"
    vocab = getattr(plan.model, "vocab", None)
    if vocab is None or vocab > 2**16:
        return None
    tokens = np.memmap(token_file, dtype=np.uint16, mode="r", shape=(count,))
    for start in range(0, count, _SCAN):
        largest = int(tokens[start:start + _SCAN].max())
        if largest >= vocab:
            return f"token id {largest} is outside the model's vocab ({vocab})"
    return None


_SCAN = 1 << 24  # tokens per chunk of the vocab check (32 MiB)
