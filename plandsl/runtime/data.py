"""Training batches: the same global batch for a step whatever the layout, each data rank its own share.

Stage: interpreter. Contract: `Batches.global_batch(step)` depends only on the plan's seed, the step
and the source (synthetic tokens, or a nanoGPT-style uint16 `.bin` token file); `local_batch` is the
contiguous rows `[r * G/dp, (r+1) * G/dp)` of data rank r, or with `batch_shares` the rows after the
shares of ranks 0..r-1 (of each, a context rank's positions); `microbatches` splits rows in order.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from plandsl import ir
from plandsl.cost.estimate import data_shares
from plandsl.runtime.tokens import dataset_rows, is_dataset, load_dataset, token_file_problem

MAX_STRIDE = 8  # synthetic sequences are arithmetic progressions mod vocab with strides 1..7


class Batches:
    """Step -> (inputs, targets) for the whole global batch; see the module docstring."""

    def __init__(self, plan: ir.Plan, token_file: str | Path | None = None, model: torch.nn.Module | None = None):
        self.plan = plan
        self.size = plan.train.global_batch
        self.shares = data_shares(plan)  # sequences per data rank (the checker made them valid)
        self.seq = plan.seq
        self.tokens = None
        self.dataset, self.rows = None, None
        if token_file:
            problem = token_file_problem(token_file, plan)
            if problem:
                raise ValueError(f"{token_file}: {problem}")
            if is_dataset(token_file):  # a Hugging Face dataset on disk: rows of token ids
                self.dataset = load_dataset(token_file)
                self.rows = dataset_rows(self.dataset, plan.seq + 1)
            else:
                self.tokens = np.memmap(token_file, dtype=np.uint16, mode="r")
        self.custom = model if isinstance(plan.model, ir.CustomModel) else None
        # a model from torch that takes token ids (plandsl.runtime.torch_model) reads a token file like a family
        self.vocab = getattr(plan.model, "vocab", None) or getattr(model, "vocab", None)

    def _generator(self, step: int) -> torch.Generator:
        # modulo 2^64, the generator's seed range: a seed up to the cap (limits.MAX_SEED) overflowed it at step 0
        return torch.Generator().manual_seed((self.plan.train.seed * 1_000_003 + step) % 2**64)

    def global_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every sequence of step `step` (0-based): inputs and targets, `global_batch` rows each."""
        generator = self._generator(step)
        model = self.plan.model
        reads_tokens = self.tokens is not None or self.dataset is not None
        if self.custom is not None and (not reads_tokens or not self.vocab):
            return self.custom.make_batch(self.size, self.seq, generator)
        if isinstance(model, ir.MLPModel):
            inputs = torch.randn(self.size, model.input, generator=generator)
            return inputs, torch.randn(self.size, model.output, generator=generator)
        if self.dataset is not None:  # a random row of at least seq + 1 tokens, from a random start in it
            picks = self.rows[torch.randint(len(self.rows), (self.size,), generator=generator).numpy()]
            rows = []
            for index in picks.tolist():
                ids = self.dataset[index]["input_ids"]
                start = int(torch.randint(len(ids) - self.seq, (1,), generator=generator))
                rows.append(np.asarray(ids[start:start + self.seq + 1], dtype=np.int64))
            tokens = torch.from_numpy(np.stack(rows))
        elif self.tokens is not None:
            starts = torch.randint(len(self.tokens) - self.seq - 1, (self.size,), generator=generator).tolist()
            rows = np.stack([self.tokens[s:s + self.seq + 1].astype(np.int64) for s in starts])
            tokens = torch.from_numpy(rows)
        else:
            tokens = synthetic_tokens(self.size, self.seq + 1, self.vocab, generator)
        return tokens[:, :-1], tokens[:, 1:]

    def local_batch(self, step: int, dp_rank: int, dp: int,
                    columns: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Data rank `dp_rank`'s contiguous share of the global batch of `step`; of each sequence only the
        positions `columns` when given (context parallelism); with `batch_shares`, its own share."""
        shares = self.shares if self.shares is not None and len(self.shares) == dp else (self.size // dp,) * dp
        inputs, targets = self.global_batch(step)
        first = sum(shares[:dp_rank])
        rows = slice(first, first + shares[dp_rank])
        if columns is None:
            return inputs[rows], targets[rows]
        return inputs[rows][:, columns], targets[rows][:, columns]


def synthetic_tokens(rows: int, length: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    """Learnable synthetic text: token t of a row is (start + stride * t) mod vocab, start and stride random."""
    start = torch.randint(vocab, (rows, 1), generator=generator)
    stride = torch.randint(1, MAX_STRIDE, (rows, 1), generator=generator)
    return (start + stride * torch.arange(length)) % vocab


def microbatches(inputs: torch.Tensor, targets: torch.Tensor, size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Consecutive chunks of `size` rows."""
    return list(zip(inputs.split(size), targets.split(size)))


def write_token_file(path: str | Path, tokens) -> None:
    """Write tokens as the flat uint16 array nanoGPT's prepare scripts produce (`train.bin`)."""
    array = np.asarray(tokens)
    if array.size and (array.min() < 0 or array.max() >= 2**16):
        raise ValueError("token ids must fit in uint16 (0..65535)")
    array.astype(np.uint16).tofile(path)
