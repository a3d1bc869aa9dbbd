"""Checkpoints (plandsl.runtime.checkpoint): interrupted and resumed equals uninterrupted, resharding, refusals.

The promises of docs/running.md, "Checkpoints": a run interrupted and resumed gives the same losses and
parameters as an uninterrupted one (same plan: exactly, since the same layout reduces in the same order and
DCP stores fp32 as it is), the learning-rate schedule goes on where it was, `step` counts from the start of
training, a checkpoint of one layout resumes under another of the same model and optimizer (within the
documented 1e-5 of equivalence), another model or optimizer is refused on every rank before any step, and a
half-written `.partial` directory never counts. The helpers are tested in this process, without ranks.

A job that dies during step 3 leaves `step-000001` and `step-000002` (with --checkpoint-every 1): where the
interruption must not change the schedule's horizon, the test removes the later checkpoints of a complete run,
which leaves exactly that directory.
"""
from __future__ import annotations

import json
import shutil

import pytest

from tests.conftest import STDLIB
from tests.distributed.harness import run_ranks
from tests.distributed.ranks import load, train
from tests.support import lazy

torch = lazy("torch")
checkpoint = lazy("plandsl.runtime.checkpoint")

pytestmark = [pytest.mark.dist, pytest.mark.xdist_group("checkpoint")]  # one worker: `uninterrupted` is cached per module

LOCAL = STDLIB / "local"
STEPS = 4
CUT = 2  # the interrupted run stops after this step
WORLD = 2
DEADLINE_S = 120.0

# tiny.plan's GPT on dp.plan's layout, with warm-up then cosine decay instead of the constant rate.
COSINE = """
import "clusters/local"
import "local/tiny"

plan tiny_dp_cosine {
  model   = tiny_gpt
  cluster = localhost
  mesh    = [dp = 2] over devices[0:2]
  train   = { global_batch: 8, micro_batch: 1, precision: fp32, optimizer: adam, lr: 1e-3,
              lr_schedule: cosine, warmup_steps: 3, seed: 0 }
  data    = ddp over dp
}
"""

# dp.plan with one more block: the same tensor names plus layers.4.*
DEEPER = """
import "clusters/local"
import "local/tiny"

model tiny_gpt_5 = gpt(layers=5, hidden=64, heads=4, seq=32, vocab=256)

plan tiny_deeper {
  model   = tiny_gpt_5
  cluster = localhost
  mesh    = [dp = 2] over devices[0:2]
  train   = tiny_train
  data    = ddp over dp
}
"""

# dp.plan training with SGD: the same model, another optimizer.
SGD = """
import "clusters/local"
import "local/tiny"

plan tiny_sgd {
  model   = tiny_gpt
  cluster = localhost
  mesh    = [dp = 2] over devices[0:2]
  train   = { global_batch: 8, micro_batch: 1, precision: fp32, optimizer: sgd, lr: 1e-3, seed: 0 }
  data    = ddp over dp
}
"""


def _run(source, **config) -> dict:
    """`ranks.train` on 2 ranks; rank 0's result, after checking every rank succeeded and agrees on the losses."""
    results = run_ranks(WORLD, train, source, deadline_s=DEADLINE_S, **config)
    assert [r["status"] for r in results] == [0] * WORLD
    assert all(r["losses"] == results[0]["losses"] for r in results)
    assert all(r["first_step"] == results[0]["first_step"] for r in results)
    return results[0]


def _attempt(rank: int, source, **config):
    """`ranks.train`, returning a CheckpointError's message instead of raising it."""
    try:
        return "trained", train(rank, source, **config)
    except checkpoint.CheckpointError as error:
        return "refused", str(error)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _assert_params(got: dict, want: dict, tolerance: float) -> None:
    """The same tensor names and shapes; values equal (tolerance 0) or within `tolerance` relative (per tensor)."""
    assert sorted(got) == sorted(want)
    for name, reference in want.items():
        assert got[name].shape == reference.shape, name
        if tolerance == 0:
            assert torch.equal(got[name], reference), (name, _relative(got[name], reference))
        else:
            assert _relative(got[name], reference) <= tolerance, (name, _relative(got[name], reference))


def _assert_losses(got: list[float], want: list[float], tolerance: float) -> None:
    assert len(got) == len(want), (got, want)
    if tolerance == 0:
        assert got == want
    for step, (a, b) in enumerate(zip(got, want), start=1):
        assert abs(a - b) <= tolerance * abs(b), (step, a, b)


def _record(path) -> dict:
    return json.loads((path / checkpoint.RECORD).read_text(encoding="utf-8"))


def _steps_in(directory) -> list[str]:
    return sorted(entry.name for entry in directory.iterdir())


@pytest.fixture(scope="module")
def uninterrupted():
    """`uninterrupted(source, steps)`: a run of that many steps without checkpoints, with its final
    parameters (cached: several tests compare with the same run)."""
    cache: dict = {}

    def get(source, steps: int = STEPS) -> dict:
        key = (str(source), steps)
        if key not in cache:
            cache[key] = _run(source, steps=steps, gather=True)
        return cache[key]

    return get


@pytest.fixture(scope="module")
def dp_checkpoint(tmp_path_factory):
    """dp.plan trained to step CUT with a checkpoint after every step; tests resume from copies of it."""
    directory = tmp_path_factory.mktemp("dp-checkpoint") / "ck"
    result = _run(LOCAL / "dp.plan", steps=CUT, checkpoint_dir=directory, checkpoint_every=1)
    assert result["first_step"] == 0 and len(result["losses"]) == CUT
    assert _steps_in(directory) == ["step-000001", "step-000002"]
    return directory, result["losses"]


def _copy(dp_checkpoint, tmp_path):
    directory = tmp_path / "ck"
    shutil.copytree(dp_checkpoint[0], directory)
    return directory


# ---- interrupted and resumed == uninterrupted ---------------------------------------------------
@pytest.mark.parametrize("name", ["dp", "fsdp", "pp_1f1b"])
def test_interrupted_and_resumed_equals_uninterrupted(name, tmp_path, uninterrupted):
    path = LOCAL / f"{name}.plan"
    plan = load(path)
    directory, metrics = tmp_path / "ck", tmp_path / "metrics.jsonl"
    first = _run(path, steps=CUT, checkpoint_dir=directory, checkpoint_every=1, metrics=metrics)
    assert first["first_step"] == 0 and len(first["losses"]) == CUT
    assert _steps_in(directory) == ["step-000001", "step-000002"]
    record = _record(directory / "step-000002")
    assert (record["step"], record["steps"], record["plan"]) == (CUT, CUT, plan.name)
    assert record["plan_hash"] == checkpoint.plan_hash(plan) and record["world_size"] == WORLD
    assert record["optimizer"] == "adam" and record["scheduler"]["last_epoch"] == CUT

    second = _run(path, steps=STEPS, checkpoint_dir=directory, checkpoint_every=1, resume=True,
                  metrics=metrics, gather=True)
    assert second["first_step"] == CUT  # steps done before it: the first step it trains is CUT + 1 = 3
    assert len(second["losses"]) == STEPS - CUT
    assert _steps_in(directory) == [f"step-{s:06d}" for s in range(1, STEPS + 1)]
    assert _record(directory / "step-000004")["step"] == STEPS

    whole = uninterrupted(path)
    _assert_losses(first["losses"] + second["losses"], whole["losses"], 0)  # the same layout: exactly
    _assert_params(second["params"], whole["params"], 0)

    # The metrics file: the first run's steps 1..2, then the resumed run's 3..4, counted from the start.
    lines = [json.loads(line) for line in metrics.read_text(encoding="utf-8").splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3, 4]
    assert [line["loss"] for line in lines] == first["losses"] + second["losses"]


def test_resume_continues_the_lr_schedule(tmp_path, uninterrupted):
    """Warm-up over steps 1..3, then cosine decay to step 6; interrupted after step 2 (inside the warm-up).
    A scheduler restarted at step 1 would take the rate of warm-up step 1 at step 3, and the losses of
    steps 4.. would differ."""
    steps, directory = 6, tmp_path / "ck"
    whole = _run(COSINE, steps=steps, checkpoint_dir=directory, checkpoint_every=1, gather=True)
    assert len(whole["losses"]) == steps
    # The schedule matters: from step 2 on the losses are not those of dp.plan's constant rate.
    constant = uninterrupted(LOCAL / "dp.plan")["losses"]
    assert whole["losses"][0] == constant[0]
    assert all(abs(a - b) > 1e-4 for a, b in zip(whole["losses"][1:STEPS], constant[1:STEPS]))
    record = _record(directory / "step-000002")
    assert (record["lr_schedule"], record["steps"], record["scheduler"]["last_epoch"]) == ("cosine", steps, CUT)

    for step in range(CUT + 1, steps + 1):  # the job died during step 3
        shutil.rmtree(checkpoint.step_dir(directory, step))
    assert checkpoint.latest(directory) == checkpoint.step_dir(directory, CUT)
    resumed = _run(COSINE, steps=steps, checkpoint_dir=directory, resume=True, gather=True)
    assert resumed["first_step"] == CUT
    _assert_losses(resumed["losses"], whole["losses"][CUT:], 0)
    _assert_params(resumed["params"], whole["params"], 0)


# ---- resharding -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["fsdp", "tp_sp", "cp"])
def test_dp_checkpoint_resumes_resharded(name, dp_checkpoint, tmp_path, uninterrupted):
    """DCP loads dp.plan's replicated tensors by name into FSDP shards and tensor-parallel DTensors, and
    into a context-parallel layout (whose ranks hold every parameter and split each sequence)."""
    directory = _copy(dp_checkpoint, tmp_path)
    plan = load(LOCAL / f"{name}.plan")
    resumed = _run(LOCAL / f"{name}.plan", steps=STEPS, checkpoint_dir=directory, resume=True, gather=True)
    assert resumed["first_step"] == CUT
    whole = uninterrupted(LOCAL / "dp.plan")
    _assert_losses(dp_checkpoint[1] + resumed["losses"], whole["losses"], 1e-5)
    _assert_params(resumed["params"], whole["params"], 1e-5)
    # The checkpoint it wrote after its last step is its own plan's.
    record = _record(directory / "step-000004")
    assert (record["plan"], record["plan_hash"], record["step"]) == (plan.name, checkpoint.plan_hash(plan), STEPS)
    assert record["model"] == _record(directory / "step-000002")["model"]  # full shapes, whatever the layout


# GPT-2 ties the head to the embedding: one module holds both without a pipeline, two stages hold a
# copy each with one (pipeline.TiedEmbeddings); a checkpoint of either resumes under the other.
TIED = """
import "clusters/local"
import "local/tiny"

model tiny_tied = gpt(layers=4, hidden=64, heads=4, seq=32, vocab=256, tied=true)

plan tied_{name} {{
  model   = tiny_tied
  cluster = localhost
  mesh    = [{axis} = 2] over devices[0:2]
  train   = tiny_train
  {lines}
}}
"""
TIED_DP = TIED.format(name="dp", axis="dp", lines="data = ddp over dp")
TIED_PP = TIED.format(name="pp", axis="pp", lines="stages = evenly over pp\n  schedule = 1f1b")


@pytest.mark.parametrize("first, then", [(TIED_DP, TIED_PP), (TIED_PP, TIED_DP)], ids=["dp_to_pp", "pp_to_dp"])
def test_tied_embeddings_resume_across_a_pipeline_split(first, then, tmp_path):
    directory = tmp_path / "ckpt"
    _run(first, steps=CUT, checkpoint_dir=directory, checkpoint_every=1)
    resumed = _run(then, steps=STEPS, checkpoint_dir=directory, resume=True, check_equivalence=True, gather=True)
    assert resumed["first_step"] == CUT
    report = resumed["report"]  # steps 3-4 and the final weights against one process trained from step 1
    assert report["missing"] == () and report["loss_diff"] <= 1e-5 and report["tensor_diff"] <= 1e-5, \
        resumed["report_text"]
    if "head.weight" in resumed["params"]:  # the pipeline's head copy came back equal to the embedding
        assert torch.equal(resumed["params"]["head.weight"], resumed["params"]["embed.tok.weight"])


# ---- refusals ---------------------------------------------------------------------------------
@pytest.mark.parametrize("source, words", [
    (DEEPER, ["holds a different model than plan 'tiny_deeper'", "plan 'tiny_dp'", "layers.4.", "is only here"]),
    (SGD, ["holds adam optimizer state", "plan 'tiny_sgd' trains with sgd"]),
], ids=["more_layers", "sgd"])
def test_resume_refuses_another_model_or_optimizer(source, words, dp_checkpoint, tmp_path):
    directory = _copy(dp_checkpoint, tmp_path)
    before = {name: _record(directory / name) for name in _steps_in(directory)}
    metrics = tmp_path / "metrics.jsonl"
    outcomes = run_ranks(WORLD, _attempt, source, steps=STEPS, checkpoint_dir=directory, resume=True,
                         metrics=metrics, deadline_s=DEADLINE_S)
    assert [kind for kind, _ in outcomes] == ["refused"] * WORLD, outcomes  # every rank, the same decision
    message = outcomes[0][1]
    assert all(text == message for _, text in outcomes)
    assert "\n" not in message and str(checkpoint.step_dir(directory, CUT)) in message, message
    for word in words:
        assert word in message, message
    # Refused before any step: no metrics file was opened, no checkpoint written or changed.
    assert not metrics.exists()
    assert {name: _record(directory / name) for name in _steps_in(directory)} == before


# ---- what counts as a checkpoint ---------------------------------------------------------------
def test_partial_checkpoint_is_ignored(dp_checkpoint, tmp_path, uninterrupted):
    """A job that died while writing step 2 left `step-000002.partial` (here even with its record):
    the resumed run continues from step 1, and its save of step 2 replaces the partial directory."""
    directory = _copy(dp_checkpoint, tmp_path)
    (directory / "step-000002").rename(directory / "step-000002.partial")
    assert (directory / "step-000002.partial" / checkpoint.RECORD).is_file()
    assert checkpoint.latest(directory) == directory / "step-000001"
    resumed = _run(LOCAL / "dp.plan", steps=STEPS, checkpoint_dir=directory, checkpoint_every=1, resume=True,
                   gather=True)
    assert resumed["first_step"] == 1
    whole = uninterrupted(LOCAL / "dp.plan")
    _assert_losses(resumed["losses"], whole["losses"][1:], 0)
    _assert_params(resumed["params"], whole["params"], 0)
    assert _steps_in(directory) == [f"step-{s:06d}" for s in range(1, STEPS + 1)]


def test_resume_from_an_empty_directory_starts_at_step_1(tmp_path, uninterrupted):
    directory = tmp_path / "ck"
    directory.mkdir()
    result = _run(LOCAL / "dp.plan", steps=CUT, checkpoint_dir=directory, resume=True)
    assert result["first_step"] == 0
    _assert_losses(result["losses"], uninterrupted(LOCAL / "dp.plan")["losses"][:CUT], 0)
    assert _steps_in(directory) == ["step-000002"]  # written after the last step only


# ---- the helpers, in this process ---------------------------------------------------------------
def _commit_dir(path, record: bool = True):
    path.mkdir(parents=True)
    if record:
        (path / checkpoint.RECORD).write_text("{}", encoding="utf-8")
    return path


def test_latest_takes_the_highest_committed_step(tmp_path):
    assert checkpoint.latest(tmp_path / "missing") is None
    assert checkpoint.latest(tmp_path) is None
    _commit_dir(tmp_path / "step-000001")
    _commit_dir(tmp_path / "step-000002")
    _commit_dir(tmp_path / "step-000009", record=False)  # DCP's files, no record: never committed
    _commit_dir(tmp_path / "step-000007.partial")
    _commit_dir(tmp_path / "step-000008.old")
    _commit_dir(tmp_path / "other-000010")
    (tmp_path / "step-000011").write_text("a file, not a checkpoint", encoding="utf-8")
    assert checkpoint.latest(tmp_path) == tmp_path / "step-000002"
    _commit_dir(tmp_path / "step-999999")
    _commit_dir(tmp_path / "step-1000000")  # past six digits: ordered by number, not by name
    assert checkpoint.latest(tmp_path) == tmp_path / "step-1000000"


def test_step_dir_is_what_latest_finds(tmp_path):
    assert checkpoint.step_dir(tmp_path, 40) == tmp_path / "step-000040"
    _commit_dir(checkpoint.step_dir(tmp_path, 7))
    assert checkpoint.latest(tmp_path) == checkpoint.step_dir(tmp_path, 7)


def test_is_due():
    assert [s for s in range(1, 11) if checkpoint.is_due(s, 3, 10)] == [3, 6, 9, 10]
    assert [s for s in range(1, 11) if checkpoint.is_due(s, None, 10)] == [10]
    assert [s for s in range(1, 5) if checkpoint.is_due(s, 1, 4)] == [1, 2, 3, 4]


def test_commit_replaces_by_renames(tmp_path):
    final = tmp_path / "step-000003"
    _commit_dir(final)
    (final / "old-shard").write_text("old", encoding="utf-8")
    partial = _commit_dir(tmp_path / "step-000003.partial")
    (partial / "new-shard").write_text("new", encoding="utf-8")
    checkpoint.commit(partial, final)
    assert _steps_in(tmp_path) == ["step-000003"]
    assert _steps_in(final) == ["new-shard", checkpoint.RECORD]


def test_plan_hash_is_the_plan_not_its_text():
    dp = load(LOCAL / "dp.plan")
    assert checkpoint.plan_hash(dp) == checkpoint.plan_hash(load(LOCAL / "dp.plan"))
    assert len(checkpoint.plan_hash(dp)) == 64
    text = (LOCAL / "dp.plan").read_text(encoding="utf-8").replace('import "tiny"', 'import "local/tiny"')
    assert "\n" in text and 'import "local/tiny"' in text
    reformatted = "# another comment\n\n" + text.replace("  model", "\n\n  model")
    assert checkpoint.plan_hash(load(reformatted)) == checkpoint.plan_hash(dp)
    changed = {
        "lr": text.replace("train   = tiny_train", "train   = { global_batch: 8, micro_batch: 1, precision: fp32, "
                                                   "optimizer: adam, lr: 2e-3, seed: 0 }"),
        "data": text.replace("ddp over dp", "fsdp over dp"),
        "name": text.replace("plan tiny_dp", "plan tiny_dp_renamed"),
    }
    hashes = {key: checkpoint.plan_hash(load(source)) for key, source in changed.items()}
    hashes["fsdp.plan"] = checkpoint.plan_hash(load(LOCAL / "fsdp.plan"))
    hashes["deeper"] = checkpoint.plan_hash(load(DEEPER))
    assert checkpoint.plan_hash(dp) not in hashes.values(), hashes
    assert len(set(hashes.values())) == len(hashes), hashes


def test_check_compatible_names_the_difference(tmp_path):
    plan = load(LOCAL / "dp.plan")
    shapes = {"embed.tok.weight": [256, 64], "head.weight": [256, 64], "norm.weight": [64]}
    record = {"model": dict(shapes), "optimizer": "adam", "plan": "tiny_other"}
    checkpoint.check_compatible(record, plan, dict(shapes), tmp_path)  # the same: no error
    narrower = {**shapes, "embed.tok.weight": [256, 32]}
    with pytest.raises(checkpoint.CheckpointError,
                       match=r"plan 'tiny_other'\) holds a different model than plan 'tiny_dp': "
                             r"embed\.tok\.weight is \[256, 64\] there, \[256, 32\] here"):
        checkpoint.check_compatible(record, plan, narrower, tmp_path)
    fewer = {name: shape for name, shape in shapes.items() if name != "norm.weight"}
    with pytest.raises(checkpoint.CheckpointError, match=r"norm\.weight is only there"):
        checkpoint.check_compatible(record, plan, fewer, tmp_path)
    many = {**shapes, **{f"layers.{i}.w": [1] for i in range(4)}}
    with pytest.raises(checkpoint.CheckpointError,
                       match=r"only here; layers\.\d\.w is only here \(and 2 more differences\)"):
        checkpoint.check_compatible(record, plan, many, tmp_path)
    with pytest.raises(checkpoint.CheckpointError,
                       match=r"holds sgd optimizer state, but plan 'tiny_dp' trains with adam"):
        checkpoint.check_compatible({**record, "optimizer": "sgd"}, plan, dict(shapes), tmp_path)
