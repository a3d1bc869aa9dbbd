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


def test_a_token_outside_the_vocabulary_is_refused_before_launch_in_the_rows_training_reads(tmp_path, plan):
    """The vocab is 64: an id of 64 (or below 0) in a row long enough to be drawn is named with its row; the
    same id in a row too short to be drawn, or in a row a selected view leaves out, is never read."""
    from plandsl.runtime.tokens import token_file_problem
    good = list(range(20))
    bad = _save(tmp_path / "bad", [good, good[:10] + [64] + good[11:]])
    assert token_file_problem(bad, plan) == "row 1 of its `input_ids` holds token id 64, outside the model's vocab (64)"
    negative = _save(tmp_path / "negative", [[-1] + good[1:]])
    assert "holds token id -1" in token_file_problem(negative, plan)
    short = _save(tmp_path / "short", [good, [64, 65]])  # seq + 1 = 9 tokens: the short row is never drawn
    assert token_file_problem(short, plan) is None
    view = tmp_path / "view"
    datasets.load_from_disk(str(bad)).select([0]).save_to_disk(str(view))
    assert token_file_problem(view, plan) is None
    flattened = tmp_path / "flat"
    datasets.load_from_disk(str(bad)).select([1]).flatten_indices().save_to_disk(str(flattened))
    assert "holds token id 64" in token_file_problem(flattened, plan)


def test_a_selected_view_is_checked_on_the_rows_it_selects(tmp_path):
    """In memory, `select` keeps the table and an index mapping: the check reads the table's rows the view maps to."""
    from plandsl.runtime.tokens import _dataset_vocab_problem, dataset_rows
    good = list(range(20))
    data = datasets.load_from_disk(str(_save(tmp_path, [good, good[:10] + [64] + good[11:], good])))
    for selected, refused in (([2, 0], False), ([0, 2, 1], True), ([1, 0], True)):  # not contiguous: an index map
        view = data.select(selected)
        assert view._indices is not None
        problem = _dataset_vocab_problem(view, dataset_rows(view, 9), 64)
        assert (problem is not None) == refused, (selected, problem)
