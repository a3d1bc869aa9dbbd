"""Every pipeline schedule the interpreter runs, on 2 ranks, against one process.

Each plan trains tiny.plan's GPT over `pp = 2` with 8 microbatches and `--check-equivalence`: the
built-ins torch ships run through torch's schedule classes, zb_h1/zb_h2, the stdlib templates and
written tables through torch's action runtime fed with the plan's lowered program (`runner` says
which ran). Stages interleaved (virtual 2, loop map), V-shaped and uneven by hand are covered;
chimera (two pipelines) is refused before any process starts.
"""
from __future__ import annotations

import re

import pytest
from click.testing import CliRunner

from plandsl.cli import main
from plandsl.runtime.support import refusals
from tests.distributed.harness import run_ranks
from tests.distributed.ranks import RANK_TIMEOUT_S, load

pytestmark = pytest.mark.dist

STEPS = 2

_HEADER = 'import "clusters/local"\nimport "local/tiny"\n'


def _plan(schedule: str, stages: str = "stages = evenly over pp", imports: str = "") -> str:
    return (_HEADER + imports + "plan p {\n  model = tiny_gpt\n  cluster = localhost\n"
            "  mesh = [pp = 2] over devices[0:2]\n  train = tiny_train\n"
            f"  {stages}\n  schedule = {schedule}\n}}\n")


_V2 = "stages = evenly over pp with virtual = 2"
_VSHAPE = "stages = evenly over pp with virtual = 2, map = vshape"
_UNEVEN = "stages {\n    0: embed, layers[0:1]\n    1: layers[1:4], norm, head\n  }"
_ACCOUNT = "stages = evenly over pp with virtual = 3, account = [embed, loss]"
_LOSS_ALONE = "stages {\n    0: embed, layers[0:4]\n    1: norm, head\n  }"
_TABLE = """schedule gpipe_table(ranks = 2, microbatches = 8) {
  rank 0: 0F0 0F1 0F2 0F3 0F4 0F5 0F6 0F7 _   _   _   _   _   _   _   _   _   0B7 0B6 0B5 0B4 0B3 0B2 0B1 0B0
  rank 1: _   1F0 1F1 1F2 1F3 1F4 1F5 1F6 1F7 1B7 1B6 1B5 1B4 1B3 1B2 1B1 1B0
}
"""

# (id, plan text, the runner that must run it)
CASES = [
    ("gpipe", _plan("gpipe"), "ScheduleGPipe"),
    ("1f1b", _plan("1f1b"), "Schedule1F1B"),
    ("interleaved_1f1b", _plan("interleaved_1f1b", _V2), "ScheduleInterleaved1F1B"),
    ("looped_bfs", _plan("looped_bfs", _V2), "ScheduleLoopedBFS"),
    ("interleaved_zero_bubble", _plan("interleaved_zero_bubble", _V2), "ScheduleInterleavedZeroBubble"),
    ("zbv", _plan("zbv", _VSHAPE), "ScheduleZBVZeroBubble"),
    ("dualpipev", _plan("dualpipev", _VSHAPE), "ScheduleDualPipeV"),
    ("zb_h1", _plan("zb_h1"), "_PipelineScheduleRuntime"),
    ("zb_h2", _plan("zb_h2"), "_PipelineScheduleRuntime"),
    ("template", _plan("one_f_one_b_template", imports='import "schedules/1f1b"\n'), "_PipelineScheduleRuntime"),
    ("table_reversed_backwards", _plan("gpipe_table", imports=_TABLE), "_PipelineScheduleRuntime"),
    ("uneven_1f1b", _plan("1f1b", _UNEVEN), "Schedule1F1B"),
    # the embedding and the loss as chunks of their own (Megatron-LM's --account-for-*-in-pipeline-split): 4 blocks,
    # the embedding and the loss over 2 x 3 stages, stage 0 the embedding alone, stage 5 the norm and head alone
    ("account_interleaved", _plan("interleaved_1f1b", _ACCOUNT), "ScheduleInterleaved1F1B"),
    ("loss_alone_1f1b", _plan("1f1b", _LOSS_ALONE), "Schedule1F1B"),
]


def _train_pipeline(rank: int, text: str) -> dict:
    """Train the plan; report the losses, the equivalence report and which torch runner ran it."""
    from dataclasses import asdict

    from plandsl.runtime.train import RunConfig, run
    status, job = run(load(text), RunConfig(steps=STEPS, check_equivalence=True, quiet=True, timeout_s=RANK_TIMEOUT_S))
    return {"status": status, "runner": job.pipeline.runner if job.pipeline else None,
            "stages": job.pipeline.stage_indices if job.pipeline else None,
            "losses": list(job.losses), "report": asdict(job.report) if job.report else None,
            "report_text": str(job.report) if job.report else None}


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_schedule_trains_like_one_process(case):
    _, text, runner = case
    assert refusals(load(text)) == []
    results = run_ranks(2, _train_pipeline, text, deadline_s=120)
    first = results[0]
    assert [r["status"] for r in results] == [0, 0], first["report_text"]
    assert [r["runner"] for r in results] == [runner, runner]
    report = first["report"]
    assert report["missing"] == () and len(first["losses"]) == STEPS
    assert report["loss_diff"] <= 1e-5 and report["tensor_diff"] <= 1e-5, first["report_text"]
    virtual = int(re.search(r"virtual = (\d+)", text).group(1)) if "virtual =" in text else 1
    held = sorted(s for r in results for s in r["stages"])
    assert held == list(range(2 * virtual))  # every stage on exactly one rank
    if "vshape" in text:
        assert [r["stages"] for r in results] == [(0, 3), (1, 2)]


def test_chimera_is_refused_before_any_process_starts(tmp_path):
    path = tmp_path / "chimera.plan"
    path.write_text(_plan("chimera"))
    (refused,) = refusals(load(path.read_text()))
    assert refused.code == "E701" and "two pipelines" in refused.message
    result = CliRunner().invoke(main, ["run", str(path), "--steps", "1"])
    assert result.exit_code == 1
    assert "error[E701]: schedule 'chimera' cannot run yet" in result.output
    assert "schedule = chimera" in result.output and "^^^^^^^" in result.output  # the source line, a caret
    assert "torchrun" not in result.output  # no launch command: nothing started
