"""`plandsl run --data FOLDER`: a Hugging Face `datasets` dataset saved to disk as the source of token ids
(`runtime.tokens`, `runtime.data.Batches`), next to nanoGPT token files; checked before launch."""
from __future__ import annotations

import pytest

from plandsl import api
from tests.support import lazy

datasets = pytest.importorskip("datasets")  # the `test` extra installs it
torch = lazy("torch")

PLAN = """\
import "clusters/local"
plan p {
  model   = gpt(layers=2, hidden=32, heads=4, seq=8, vocab=64)
  cluster = localhost
  mesh    = [dp = 2] over devices[0:2]
  train   = { global_batch: 4, micro_batch: 1, seed: 3 }
  data    = replicate over dp
}
"""


@pytest.fixture
def plan():
    return api.loads(PLAN).plans[0]


def _save(tmp_path, rows, column="input_ids"):
    folder = tmp_path / "tokens"
    datasets.Dataset.from_dict({column: rows, "text": ["x"] * len(rows)}).save_to_disk(str(folder))
    return folder


def test_sequences_come_from_rows_long_enough(tmp_path, plan):
    from plandsl.runtime.data import Batches
    long_rows = [list(range(start, start + 20)) for start in (0, 30)]
    folder = _save(tmp_path, [[1, 2, 3]] + long_rows + [[4] * 5])  # rows 0 and 3 are shorter than seq + 1 = 9
    assert api.data_path_problem(str(folder)) is None
    batches = Batches(plan, folder)
    assert batches.rows.tolist() == [1, 2]
    inputs, targets = batches.global_batch(0)
    assert inputs.shape == targets.shape == (4, 8) and torch.equal(inputs[:, 1:], targets[:, :-1])
    for row in torch.cat([inputs, targets[:, -1:]], 1).tolist():  # 9 consecutive tokens of one long row
        assert any(row == full[i:i + 9] for full in long_rows for i in range(12))
    again, _ = Batches(plan, folder).global_batch(0)
    assert torch.equal(inputs, again)  # the seed and the step alone
    assert not torch.equal(inputs, Batches(plan, folder).global_batch(1)[0])
    share, _ = batches.local_batch(0, 1, 2)
    assert torch.equal(share, inputs[2:])


def test_a_dataset_that_cannot_feed_the_plan_is_refused_before_launch(tmp_path, plan):
    from plandsl.runtime.tokens import token_file_problem
    short = _save(tmp_path, [[1, 2, 3], [4, 5]])
    assert "no row of its `input_ids` holds seq + 1 (9) tokens" in token_file_problem(short, plan)
    untokenized = _save(tmp_path / "u", [[1] * 20], column="ids")
    assert "has no `input_ids` column (its columns: ids, text)" in token_file_problem(untokenized, plan)
    splits = tmp_path / "splits"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"input_ids": [[1] * 20]})}).save_to_disk(str(splits))
    assert api.data_path_problem(str(splits)) is not None  # a DatasetDict folder is not one dataset
    assert "is not a regular file" in api.data_path_problem(str(tmp_path)) or api.data_path_problem(str(tmp_path))
