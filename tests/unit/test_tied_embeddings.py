"""`TiedEmbeddings.sum_grads`: the two copies of a tied embedding on one rank (embed and head on two of its pipeline
stages) sum their gradients, under the plan's autocast as `step` runs it."""
from __future__ import annotations

from support import lazy

torch = lazy("torch")
pipeline = lazy("plandsl.runtime.parallel.pipeline")


def test_bf16_copies_sum_under_an_fp16_autocast():
    # Drawn by tests/property/test_check_runs.py: `precision: fp16, param_dtype: bf16` with `tied=true` over `zbv`
    # (embed and head on one rank) raised "Unexpected floating ScalarType in at::autocast::prioritize" at the stack
    embed, head = (torch.nn.Parameter(torch.zeros(4, 2, dtype=torch.bfloat16)) for _ in range(2))
    embed.grad, head.grad = torch.ones(4, 2, dtype=torch.bfloat16), torch.full((4, 2), 2.0, dtype=torch.bfloat16)
    tied = pipeline.TiedEmbeddings(params=[embed, head], group=None, duplicates=[head])
    with torch.autocast("cpu", dtype=torch.float16):
        tied.sum_grads()
    three = torch.full((4, 2), 3.0, dtype=torch.bfloat16)
    assert all(param.grad.dtype == torch.bfloat16 and torch.equal(param.grad, three) for param in (embed, head))
