"""What the interpreter can run yet: one reason per unsupported feature of a plan, before any process starts.

Stage: interpreter (imported by the CLI without torch). Contract: `unsupported(plan)` returns messages,
empty when the plan can run; pipelines become runnable once `plandsl.runtime.pipeline` provides
`build_pipeline`.
"""
from __future__ import annotations

import importlib.util

from plandsl import ir


def pipeline_available() -> bool:
    if importlib.util.find_spec("plandsl.runtime.pipeline") is None:
        return False
    from plandsl.runtime import pipeline
    return hasattr(pipeline, "build_pipeline")


def unsupported(plan: ir.Plan) -> list[str]:
    reasons = []
    if plan.stages is not None and not pipeline_available():
        reasons.append(f"pipeline stages (over '{plan.stages.axis}') are not supported by `plandsl run` yet")
    if plan.context is not None:
        reasons.append(f"context parallelism (`context = {plan.context.kind} over {plan.context.axis}`) is not "
                       "supported by `plandsl run` yet: it would use torch's context_parallel (ring attention over "
                       "SDPA), which needs CUDA with NCCL (torch has no context-parallel rule for the CPU attention "
                       "kernels, so a gloo run on CPU fails), and that CUDA path is not written yet")
    reasons += _expert_reasons(plan)
    if plan.shard:  # the rules DTensor cannot run as written (torch is imported only for such plans)
        from plandsl.runtime.tensor_parallel import rule_problems
        reasons += rule_problems(plan)
    if plan.tensor is not None and plan.tp > 1 and not isinstance(plan.model, ir.TransformerModel):
        reasons.append(f"tensor parallelism needs a gpt or llama model, not '{plan.model.kind}'")
    if plan.data is not None and plan.data.kind == "zero1" and plan.tp > 1:
        reasons.append("zero1 together with tensor parallelism is not supported by `plandsl run` yet: "
                       "ZeroRedundancyOptimizer does not take DTensor parameters; use zero2, zero3 (fsdp, as "
                       "stdlib_plans/local/3d.plan does) or replicate")
    if isinstance(plan.model, ir.CustomModel) and not plan.model.factory:
        reasons.append(f"model '{plan.model.name}' has no `factory`, so there is no torch module to run "
                       "(see docs/models.md)")
    return reasons


def _expert_reasons(plan: ir.Plan) -> list[str]:
    """Expert parallelism runs with every data kind but zero1 and hsdp, with tensor parallelism and pipelines."""
    if plan.experts is None or plan.ep == 1:
        return []
    what = f"expert parallelism (`experts = {plan.experts.kind} over {plan.experts.axis}`)"
    reasons = []
    for other, axis in (("tensor", plan.tensor.axis if plan.tensor else None),
                        ("stages", plan.stages.axis if plan.stages else None),
                        ("context", plan.context.axis if plan.context else None)):
        if axis == plan.experts.axis:
            reasons.append(f"{what} runs over the same axis as `{other}`; each needs an axis of its own")
    kind = plan.data.kind if plan.data is not None else None
    if kind == "zero1":
        reasons.append(f"zero1 together with {what} is not supported by `plandsl run` yet: ZeroRedundancyOptimizer "
                       "broadcasts plain tensors and expert shards are DTensors; use zero2, zero3 or replicate")
    if kind == "hsdp":
        reasons.append(f"hsdp together with {what} is not supported by `plandsl run` yet: the other parameters "
                       "would need a 2-D mesh replicated over the expert axis too; use zero3 or replicate")
    return reasons
