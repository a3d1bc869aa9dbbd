"""torch 2.13's pipeline schedules infer each stage's shapes at the first step by running its forward and backward once
more; `runtime.parallel.pipeline._inference_keeps_buffers` puts the buffers of a rank's stages back after it. Held here
against torch's own schedule on a fake one-rank group holding every stage (nothing is sent): after one step a stage's
count of its forwards is one per microbatch, as on one process."""
from __future__ import annotations

import pytest

from tests.support import lazy

torch = lazy("torch")

MICROBATCHES = 2


def _stage(counted, held=None):
    """A linear stage whose forward adds 1 to its buffer `counted`; `held`: a buffer it holds too, untouched."""

    class Counting(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)
            self.register_buffer("counted", counted)
            if held is not None:
                self.register_buffer("held", held)

        def forward(self, x):
            self.counted.add_(1)
            return self.linear(x)

    return Counting()


@pytest.mark.xdist_group("torch")
def test_the_buffers_of_a_ranks_stages_are_put_back_after_the_shape_inference():
    """One step of torch's interleaved 1F1B, both stages on fake rank 0 of 1: both stages' forward inference runs before
    either is cleaned up, each puts back its own buffers. Stage 0 counts its forwards into a tensor stage 1 holds too
    (torch's pipeline frontend gives each traced stage the buffers it reads: the same tensor); stage 1's inference saved
    it after stage 0's had added 1, and each stage putting back its own saving left that 1 (3 after 2 microbatches)."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from plandsl.runtime.parallel.pipeline import _inference_keeps_buffers
    shared, own = torch.zeros(()), torch.zeros(())
    modules = [_stage(shared), _stage(own, held=shared)]
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    try:
        stages = _inference_keeps_buffers([PipelineStage(module, index, len(modules), torch.device("cpu"))
                                           for index, module in enumerate(modules)])
        schedule = ScheduleInterleaved1F1B(stages, MICROBATCHES, loss_fn=lambda out, target: out.sum())
        schedule.step(torch.randn(MICROBATCHES, 4), target=torch.zeros(MICROBATCHES, 4))
    finally:
        dist.destroy_process_group()
    assert (float(shared), float(own)) == (MICROBATCHES, MICROBATCHES)
