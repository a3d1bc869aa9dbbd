"""What a forked rank runs in these tests (harness.run_ranks): load a plan, train it, report back."""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from plandsl import api

RANK_TIMEOUT_S = 180.0  # a collective waiting longer fails the rank (the harness's deadline is longer); a
# peer still importing or building its model on a loaded machine can keep a healthy rank waiting a minute


def load(source: str | Path, name: str | None = None, params: dict | None = None):
    """A plan from a file, or from plan text (which may import the stdlib, e.g. "local/tiny")."""
    if isinstance(source, str) and "\n" in source:
        document = api.loads(source, params)
        plans = [p for p in document.plans if name is None or p.name == name]
        assert len(plans) == 1, [p.name for p in document.plans]
        return plans[0]
    return api.load_plan(source, name, params)


def train(rank: int, source, name: str | None = None, params: dict | None = None,
          gather: bool = False, **config) -> dict:
    """Train the plan with `RunConfig(**config)`; rank 0 returns losses, the equivalence report (with
    `check_equivalence=True`) and, with `gather`, the final parameters in full."""
    from plandsl.runtime.equivalence import gather_params
    from plandsl.runtime.train import RunConfig, run
    plan = load(source, name, params)
    config.setdefault("quiet", True)
    config.setdefault("timeout_s", RANK_TIMEOUT_S)
    status, job = run(plan, RunConfig(**config))
    result = {"status": status, "losses": list(job.losses), "first_step": job.first_step,
              "report": asdict(job.report) if job.report is not None else None,
              "report_text": str(job.report) if job.report is not None else None}
    if gather:
        result["params"] = gather_params(job.models)
    return result
