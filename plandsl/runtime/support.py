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
        reasons.append(f"context parallelism (`context = {plan.context.kind} over {plan.context.axis}`) "
                       "is not supported by `plandsl run` yet")
    if plan.experts is not None:
        reasons.append(f"expert parallelism (`experts = {plan.experts.kind} over {plan.experts.axis}`) "
                       "is not supported by `plandsl run` yet")
    if plan.shard:
        rules = ", ".join(rule.target.text for rule in plan.shard)
        reasons.append(f"shard rules ({rules}) are not supported by `plandsl run` yet; "
                       "`tensor = megatron` alone shards every block")
    if plan.train.precision is ir.Precision.fp16:
        reasons.append("precision fp16 (dynamic loss scaling) is not supported by `plandsl run` yet; use bf16 or fp32")
    if plan.tensor is not None and plan.tp > 1 and not isinstance(plan.model, ir.TransformerModel):
        reasons.append(f"tensor parallelism needs a gpt or llama model, not '{plan.model.kind}'")
    if plan.data is not None and plan.data.kind == "zero1" and plan.tp > 1:
        reasons.append("zero1 together with tensor parallelism is not supported by `plandsl run` yet; "
                       "use zero2, zero3 or replicate")
    if isinstance(plan.model, ir.CustomModel) and not plan.model.factory:
        reasons.append(f"model '{plan.model.name}' has no `factory`, so there is no torch module to run "
                       "(see docs/models.md)")
    return reasons
