"""A token file checked against a plan before any rank starts (numpy only: the launcher does not import torch).

Stage: interpreter (launcher side and each rank). Contract: `token_file_problem(path, plan)` is None when
`plan` can train on the nanoGPT-style uint16 file, else the reason, found in constant memory.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from plandsl import ir
from plandsl.ir.inspected import parse_source
from plandsl.syntax.files import FileProblem, check_regular, regular_file_problem


DATASET_FILES = ("dataset_info.json", "state.json")  # what `datasets.Dataset.save_to_disk` writes
TOKENS_COLUMN = "input_ids"


def is_dataset(path: str | Path) -> bool:
    """Whether `path` is a Hugging Face `datasets` dataset saved to disk (a folder with its two JSON files)."""
    return Path(path).is_dir() and all((Path(path) / name).is_file() for name in DATASET_FILES)


def load_dataset(path: str | Path):
    """The dataset at `path` (`datasets.load_from_disk`: memory-mapped Arrow files, read lazily), ValueError
    saying what is wrong with it: not a single split, no `input_ids` column."""
    try:
        import datasets  # lazy: only for a dataset on disk
    except ImportError:
        raise ValueError(f"{path} is a Hugging Face dataset, and the `datasets` package is not installed "
                         "(python -m pip install datasets)") from None
    data = datasets.load_from_disk(str(path))
    if not isinstance(data, datasets.Dataset):
        raise ValueError(f"{path} holds several splits ({', '.join(data)}); give the folder of one, e.g. {path}/train")
    if TOKENS_COLUMN not in data.column_names:
        raise ValueError(f"{path} has no `{TOKENS_COLUMN}` column (its columns: {', '.join(data.column_names)}); "
                         "tokenize it first (`dataset.map(tokenizer)`)")
    return data


def dataset_rows(data, length: int):
    """The indices of the rows holding at least `length` tokens (numpy, int64), computed from the Arrow
    list offsets without reading the tokens."""
    column = data.data.column(TOKENS_COLUMN).combine_chunks()
    offsets = np.asarray(column.offsets)
    lengths = offsets[1:] - offsets[:-1]
    if data._indices is not None:  # a selected or shuffled view: its rows in its order
        lengths = lengths[np.asarray(data._indices.column(0))]
    return np.flatnonzero(lengths >= length)


def _dataset_vocab_problem(data, rows, vocab: int) -> str | None:
    """A token id outside [0, vocab) in a row training draws from (`rows`: long enough), or None. One Arrow
    chunk of the column at a time: memory is a chunk's tokens, whatever the dataset's size; rows too short
    to be drawn are not read into the verdict."""
    import pyarrow.compute as pc  # lazy: with `datasets` only
    used = rows if data._indices is None else np.asarray(data._indices.column(0))[rows]
    first = 0
    for chunk in data.data.column(TOKENS_COLUMN).chunks:
        values = np.asarray(pc.list_flatten(chunk))
        outside = (values < 0) | (values >= vocab)
        if outside.any():
            parents = np.asarray(pc.list_parent_indices(chunk))[outside] + first
            drawn = np.isin(parents, used)
            if drawn.any():
                return (f"row {int(parents[drawn][0])} of its `{TOKENS_COLUMN}` holds token id "
                        f"{int(values[outside][drawn][0])}, outside the model's vocab ({vocab})")
        first += len(chunk)
    return None


def data_path_problem(path: str | Path) -> str | None:
    """Why `--data PATH` cannot be read at all (before the plan is known), or None: a regular file (a token
    file) or a Hugging Face dataset folder."""
    return None if is_dataset(path) else regular_file_problem(path, "token file")


def model_vocab(model: ir.Model) -> int | None:
    """The vocabulary token ids must be below: a family's `vocab`; for a model from torch (`hf(...)`, `factory(...)`)
    its config's `vocab_size` where the source gives it, else the most rows of any embedding in the module tree (a
    position table may come first; `runtime.torch_model` sizes synthetic tokens by the first); None when unknown."""
    vocab = getattr(model, "vocab", None)
    if vocab is not None or not isinstance(model, ir.CustomModel) or not model.source:
        return vocab
    given = dict(parse_source(model.source).args).get("vocab_size")
    if isinstance(given, int) and not isinstance(given, bool) and given > 0:
        return given
    shapes = dict(model.parameters)
    # the table does not say which embedding reads the token ids (a position embedding may come first): the most rows
    # of any, so that no id the module can look up is refused
    rows = [shape[0] for name, cls in model.modules
            if cls.endswith("Embedding") and (shape := shapes.get(f"{name}.weight")) is not None and len(shape) == 2]
    return max(rows, default=None)


def token_file_problem(token_file: str | Path, plan: ir.Plan) -> str | None:
    """Why `plan` cannot train on `token_file`, or None: it must be a regular file (checked first, so a
    device or FIFO is never mapped) of more than seq + 1 uint16 tokens, each below the model's vocab
    (read in bounded chunks: constant memory whatever its size); or a Hugging Face
    dataset saved to disk whose `input_ids` rows include one of at least seq + 1 tokens, and whose rows that
    long hold only ids below the vocab (read one Arrow chunk at a time)."""
    model = plan.model
    if isinstance(model, ir.CustomModel) and model.image:
        return (f"model '{model.name}' takes images ({model.source}): a token file holds token ids, which it does not "
                "read (it trains on random images of its shape, or its module's own make_batch)")
    if is_dataset(token_file):
        try:
            data = load_dataset(token_file)
        except ValueError as error:
            return str(error)
        rows = dataset_rows(data, (plan.seq or 0) + 1)
        if not len(rows):
            return f"no row of its `{TOKENS_COLUMN}` holds seq + 1 ({(plan.seq or 0) + 1}) tokens: a sequence and its next token"
        vocab = model_vocab(plan.model)
        return _dataset_vocab_problem(data, rows, vocab) if vocab is not None else None
    try:
        size = check_regular(token_file, "token file").st_size
    except FileProblem as problem:
        return problem.message
    count, seq = size // 2, plan.seq or 0
    if count <= seq + 1:
        return f"{count} tokens, fewer than seq + 2 ({seq + 2}): a sequence and its next token"
    vocab = model_vocab(plan.model)
    if vocab is None or vocab > 2**16:
        return None
    # read, not mapped: a map of the whole file takes its size in address space (a 10 GB file under `ulimit -v 4000000`
    # was OSError ENOMEM, an internal error)
    with open(token_file, "rb") as handle:
        for start in range(0, count, _SCAN):
            chunk = np.fromfile(handle, dtype=np.uint16, count=min(_SCAN, count - start))
            if not chunk.size:
                break
            largest = int(chunk.max())
            if largest >= vocab:
                return f"token id {largest} is outside the model's vocab ({vocab})"
    return None


_SCAN = 1 << 24  # tokens per chunk of the vocab check (32 MiB)
