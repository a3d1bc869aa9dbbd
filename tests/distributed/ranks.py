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


def build_on_meta(rank: int, source) -> dict:
    """Build the job as `plandsl run` does, watching what `parallelize` is given (tests/distributed/test_meta_init.py):
    every parameter gathered in full, and on rank 0 `build_model`'s full model, the one-process reference's."""
    import torch
    import torch.distributed as dist

    from plandsl.runtime import train
    from plandsl.runtime.equivalence import gather_params
    from plandsl.runtime.models import build_model
    from plandsl.runtime.parallel import pipeline
    from plandsl.runtime.parallel.mesh import build_mesh, init_distributed
    from plandsl.runtime.precision import keep_weights

    plan = load(source)
    device = init_distributed(RANK_TIMEOUT_S, "cpu")
    seen = []
    inner = train.parallelize  # pipeline.parallelize_plan is the same function

    def watched(plan, model, *args, **kwargs):
        seen.append([(name, param.device.type) for name, param in model.named_parameters()])
        return inner(plan, model, *args, **kwargs)

    def refused(*args, **kwargs):
        raise AssertionError("build_job built the full model")

    train.parallelize, pipeline.parallelize_plan, train.build_model = watched, watched, refused
    try:
        job = train.build_job(plan, build_mesh(plan, device), device, train.RunConfig(steps=1))
    finally:
        train.parallelize, pipeline.parallelize_plan, train.build_model = inner, inner, build_model
    params = [p for part in job.models for p in part.parameters()]
    result = {"seen": seen, "meta_left": sum(p.is_meta or getattr(p, "_local_tensor", p).is_meta for p in params),
              "local_elements": sum(getattr(p, "_local_tensor", p).numel() for p in params),
              "dtypes": sorted({str(p.dtype) for p in params}),
              # one parameter, or under a split backward the copy multi-token prediction's stage keeps apart
              # (`pipeline.stage_part`), equal to it
              "tied": [part.head.weight is part.embed.tok.weight
                       or (plan.model.mtp and torch.equal(part.head.weight.detach(), part.embed.tok.weight.detach()))
                       for part in job.models
                       if getattr(plan.model, "tied_embeddings", False) and getattr(part, "head", None) is not None
                       and getattr(part, "embed", None) is not None],
              "gathered": gather_params(job.models)}
    if dist.get_rank() == 0:
        full = keep_weights(plan, build_model(plan.model, plan.train.seed))
        result["full"] = {name: p.detach().clone() for name, p in full.named_parameters(remove_duplicate=False)}
    return result
