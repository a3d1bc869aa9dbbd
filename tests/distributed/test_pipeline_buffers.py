"""What torch's `PipelineStage` keeps between steps under `plandsl run`, against what the memory model counts for it
(`cost.memory.torch_stage_bytes`): a receive buffer per microbatch for activations on every stage after the first and
one for gradients on every stage before the last, each a boundary's bytes (`cost.memory.torch_stage_sizes`); and the
caches the model counts only during a step (`fwd_cache`, the input gradients of `bwd_cache`) empty after it (the first
stage's `bwd_cache` keeps a None per microbatch: its input, the tokens, has no gradient and nothing sends it). At
`precision: bf16` over fp32 weights the buffers are bf16, the activations' width the model counts
(`runtime.precision.keep_stream`)."""
from __future__ import annotations

import pytest

from plandsl.cost.memory import torch_stage_sizes
from tests.distributed.harness import run_ranks
from tests.distributed.ranks import RANK_TIMEOUT_S, load

pytestmark = pytest.mark.dist

_PLAN = ('import "clusters/local"\nimport "local/tiny"\nplan p {{\n  model = tiny_gpt\n  cluster = localhost\n'
         "  mesh = [pp = 2] over devices[0:2]\n  train = {train}\n  {stages}\n  schedule = {schedule}\n}}\n")
_BF16 = "{ global_batch: 8, micro_batch: 1, precision: bf16, optimizer: adam, lr: 1e-3, seed: 0 }"


def _buffers(rank: int, text: str) -> list[dict]:
    """One step; per stage of this rank: its index and the bytes of each receive buffer it keeps."""
    from plandsl.runtime.train import RunConfig, run
    status, job = run(load(text), RunConfig(steps=1, quiet=True, timeout_s=RANK_TIMEOUT_S))
    assert status == 0
    out = []
    for index, stage in zip(job.pipeline.stage_indices, job.pipeline.stages):
        activations = [info.buffer.numel() * info.buffer.element_size() for infos in stage.args_recv_info.values()
                       for info in infos if not info.is_root_arg and info.buffer is not None]
        gradients = [info.buffer.numel() * info.buffer.element_size() for infos in stage.grad_recv_info.values()
                     for info in infos if info.buffer is not None]
        kept = [t for grads in stage.bwd_cache.values() for t in grads if t is not None]  # the first's: None each
        dtypes = {str(info.buffer.dtype) for infos in (*stage.args_recv_info.values(), *stage.grad_recv_info.values())
                  for info in infos if not getattr(info, "is_root_arg", False) and info.buffer is not None}
        out.append({"stage": index, "activations": activations, "gradients": gradients,
                    "cached": len(stage.fwd_cache) + len(kept), "dtypes": dtypes})
    return out


@pytest.mark.parametrize("schedule, stages, train", [
    ("1f1b", "stages = evenly over pp", "tiny_train"),
    ("interleaved_1f1b", "stages = evenly over pp with virtual = 2", "tiny_train"),
    ("1f1b", "stages = evenly over pp", _BF16),  # fp32 weights under autocast: the stream is bf16 all the same
], ids=["1f1b", "interleaved", "1f1b_bf16"])
def test_a_receive_buffer_per_microbatch_is_what_the_model_counts(schedule, stages, train):
    text = _PLAN.format(schedule=schedule, stages=stages, train=train)
    plan = load(text)
    boundary, _, microbatches = torch_stage_sizes(plan)
    last = 2 * (2 if "virtual" in stages else 1) - 1
    found = [stage for rank in run_ranks(2, _buffers, text, deadline_s=120) for stage in rank]
    assert sorted(s["stage"] for s in found) == list(range(last + 1))
    for s in found:
        assert s["activations"] == ([] if s["stage"] == 0 else [boundary] * microbatches), s
        assert s["gradients"] == ([] if s["stage"] == last else [boundary] * microbatches), s
        assert s["cached"] == 0  # outputs and input gradients live only during a step
        assert s["dtypes"] <= {"torch.bfloat16" if train == _BF16 else "torch.float32"}, s
