"""`--resume` before any tensor (`runtime.resume`): the latest committed checkpoint of a folder, its record, and E721
for a checkpoint the plan cannot resume: refused by the launcher before any rank starts where the record says so
(another optimizer or format, a record that cannot be read), and printed by rank 0 as the same Diagnostic where only
the ranks can tell (the model's shapes). The resumed runs themselves: tests/distributed/test_checkpoint.py."""
from __future__ import annotations

import json
import textwrap

import pytest
from click.testing import CliRunner

from plandsl import api
from plandsl.cli import main
from plandsl.runtime import resume

PLAN = textwrap.dedent("""\
    import "clusters/local"
    plan p {
      model   = gpt(layers=2, hidden=64, heads=4, seq=32, vocab=256)
      cluster = localhost
      mesh    = [dp = 2] over devices[0:2]
      train   = { global_batch: 8, micro_batch: 1, optimizer: sgd }
      data    = ddp over dp
    }
    """)
RECORD = {"format": 1, "step": 2, "steps": 4, "plan": "p", "plan_hash": "0" * 64, "optimizer": "sgd",
          "scheduler": {"last_epoch": 2, "lr_lambdas": [None]}, "loss_scale": None, "model": {"w": [2, 2]}}


def _plan(tmp_path):
    path = tmp_path / "p.plan"
    path.write_text(PLAN, encoding="utf-8")
    return path, api.load_runnable(str(path))


def _checkpoint(directory, step: int, record: dict | str):
    folder = resume.step_dir(directory, step)
    folder.mkdir(parents=True)
    (folder / resume.RECORD).write_text(record if isinstance(record, str) else json.dumps(record), encoding="utf-8")
    return folder


def test_no_checkpoint_yet_is_no_refusal(tmp_path):
    _, plan = _plan(tmp_path)
    assert resume.launch_refusal(plan, tmp_path / "missing") is None
    (tmp_path / "empty").mkdir()
    assert resume.launch_refusal(plan, tmp_path / "empty") is None
    _checkpoint(tmp_path / "ok", 2, RECORD)
    assert resume.launch_refusal(plan, tmp_path / "ok") is None  # the same optimizer: the ranks check the shapes


@pytest.mark.parametrize("record, words, line", [
    ({**RECORD, "optimizer": "adam"}, "holds adam optimizer state, but plan 'p' trains with sgd", 6),
    ({**RECORD, "format": 2}, "has format 2; this plandsl reads 1", 2),
    ('{"format": 1, "optimizer": ', "cannot read checkpoint", 2),
    ("[1, 2]", "has format a JSON list; this plandsl reads 1", 2),
    ("[" * 100_000, "cannot read checkpoint", 2),  # json's RecursionError: was E108 in the ranks
    # a record of format 1 without what the ranks read of it, or of another type: was a KeyError or TypeError in
    # every rank ('the job failed', a traceback per rank), or the launcher's 'holds None optimizer state'
    ({key: value for key, value in RECORD.items() if key != "scheduler"},
     'plandsl.json lacks "scheduler" (a learning-rate scheduler\'s state)', 2),
    ({key: value for key, value in RECORD.items() if key != "optimizer"}, 'lacks "optimizer"', 2),
    ({**RECORD, "step": "2"}, 'has "2" as "step", not a step count', 2),
    ({**RECORD, "model": [[2, 2]]}, 'as "model", not parameters\' names and shapes', 2),
    ({**RECORD, "model": {"w": 2}}, 'as "model"', 2),
    ({**RECORD, "scheduler": {"last_epoch": 2}}, 'as "scheduler"', 2),
    ({**RECORD, "loss_scale": 1.0}, 'as "loss_scale"', 2),
], ids=["optimizer", "format", "truncated", "not_an_object", "nested", "no_scheduler", "no_optimizer", "step_type",
        "model_list", "model_shape", "lr_lambdas", "loss_scale"])
def test_what_the_record_refuses_is_e721_before_any_rank(tmp_path, record, words, line):
    """Before: the launcher started every rank, each built its share and then refused with an uncoded
    `plandsl run: error: ...` line (rank 0's), or an internal error for a record json cannot parse."""
    _, plan = _plan(tmp_path)
    _checkpoint(tmp_path / "ckpt", 1, {**RECORD, "optimizer": "sgd"})
    _checkpoint(tmp_path / "ckpt", 3, record)  # the latest is the one read
    refused = resume.launch_refusal(plan, tmp_path / "ckpt")
    assert refused is not None and refused.code == "E721" and words in refused.message, refused
    assert refused.span.line == line  # the optimizer's, or the plan's where the checkpoint itself is at fault


def test_the_latest_committed_step_is_read_and_a_huge_folder_is_refused(tmp_path, monkeypatch):
    _checkpoint(tmp_path, 2, RECORD)
    _checkpoint(tmp_path, 10, RECORD)
    (tmp_path / "step-000011.partial").mkdir()  # a step being written: no record
    resume.step_dir(tmp_path, 12).mkdir()
    assert resume.latest(tmp_path) == resume.step_dir(tmp_path, 10)
    monkeypatch.setattr(resume, "MAX_ENTRIES", 3)  # the folder holds 4 entries
    with pytest.raises(resume.CheckpointError, match="more than 3 entries"):
        resume.latest(tmp_path)


@pytest.mark.xdist_group("torch")  # `run` counts the GPUs torch sees before the launch
def test_run_refuses_another_optimizer_before_launching(tmp_path, monkeypatch):
    path, _ = _plan(tmp_path)
    _checkpoint(tmp_path / "ckpt", 2, {**RECORD, "optimizer": "adam"})
    monkeypatch.setattr("plandsl.runtime.launch.launch",
                        lambda args: pytest.fail("`plandsl run` launched torchrun", pytrace=False))
    result = CliRunner().invoke(main, ["run", str(path), "--checkpoint-dir", str(tmp_path / "ckpt"), "--resume",
                                       "--device", "cpu"])
    assert result.exit_code == 1, result.output
    assert "p.plan:6:48: error[E721]: plan 'p' cannot resume: checkpoint " in result.output, result.output
    assert "= hint: resume with the optimizer the checkpoint was written with" in result.output
    assert "Traceback" not in result.output


def test_a_dry_run_refuses_what_the_run_would(tmp_path, monkeypatch):
    """`run --dry-run --resume` printed the torchrun command for a checkpoint of another optimizer, which the run then
    refused at once (review rev56c): the dry run asks the record too, and builds no rank."""
    path, _ = _plan(tmp_path)
    _checkpoint(tmp_path / "ckpt", 2, {**RECORD, "optimizer": "adam"})
    monkeypatch.setattr("plandsl.api.dry_run", lambda *args, **kwargs: pytest.fail("a rank was built"))
    result = CliRunner().invoke(main, ["run", str(path), "--dry-run", "--checkpoint-dir", str(tmp_path / "ckpt"),
                                       "--resume"])
    assert result.exit_code == 1 and "error[E721]: plan 'p' cannot resume" in result.output, result.output
    assert "torchrun" not in result.output


@pytest.mark.xdist_group("torch")  # the rank's entry imports torch
def test_a_rank_prints_the_models_refusal_as_e721_at_the_model(tmp_path, monkeypatch, capsys):
    """What the ranks find (the model's shapes, after building their share): rank 0 prints E721 at the model line,
    the others nothing; every rank exits 1. Before: `plandsl run: error: checkpoint ...`, no code, no place."""
    from plandsl import run as rank_entry
    from plandsl.runtime import train
    path, plan = _plan(tmp_path)

    def refused(plan, config):
        resume.check_compatible(RECORD, plan, {"w": [2, 3]}, tmp_path / "ckpt" / "step-000002")
    monkeypatch.setattr(train, "run", refused)
    monkeypatch.setattr(rank_entry.faulthandler, "register", lambda *args, **kwargs: None)  # needs a real stderr
    for rank, printed in (("0", True), ("1", False)):
        monkeypatch.setenv("RANK", rank)
        assert rank_entry.main([str(path)]) == 1
        err = capsys.readouterr().err
        assert ("p.plan:3:13: error[E721]: plan 'p' cannot resume: checkpoint " in err) is printed, err
        assert ("w is [2, 2] there, [2, 3] here" in err) is printed
        assert "hint: resume with the plan whose model wrote the checkpoint" in err or not printed


@pytest.mark.xdist_group("torch")  # the rank's entry and torch's launcher errors
def test_ranks_that_refuse_are_said_to_refuse_not_that_the_job_failed(tmp_path, monkeypatch, capsys):
    """Every rank refusing before training (E721 above, printed by rank 0) was followed by the launcher's "the job
    failed; the other ranks were stopped" and a root cause: each refusing rank now leaves a record saying so, and the
    launcher says the ranks refused; a rank that failed otherwise still makes it the job's failure."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
    from plandsl import run as rank_entry
    from plandsl.runtime import faults, launch, train
    path, _ = _plan(tmp_path)

    def refused(plan, config):
        resume.check_compatible(RECORD, plan, {"w": [2, 3]}, tmp_path / "ckpt" / "step-000002")
    monkeypatch.setattr(train, "run", refused)
    monkeypatch.setattr(rank_entry.faulthandler, "register", lambda *args, **kwargs: None)
    monkeypatch.setenv(faults.DIR_ENV, str(tmp_path))
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        assert rank_entry.main([str(path)]) == 1
    capsys.readouterr()
    records = faults.read_records(tmp_path)
    assert {rank: record.refused for rank, record in records.items()} == {0: "E721", 1: "E721"}
    failures = {rank: ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=1, error_file="") for rank in (0, 1)}
    message = launch.failure_message(ChildFailedError("plandsl.run", failures), records)
    assert message == ("plandsl run: the ranks refused the job before training (E721, above): no step was trained, "
                       "nothing written"), message
    del records[1]  # rank 1 failed without refusing: the job's failure, as before
    message = launch.failure_message(ChildFailedError("plandsl.run", failures), records)
    assert message.startswith("plandsl run: the job failed; the other ranks were stopped"), message
