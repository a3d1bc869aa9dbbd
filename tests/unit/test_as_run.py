"""`runtime.support.as_run`: the plan as `plandsl run` runs it, torch's stack where the plan names another's, and
E708 where only the named stack fits the devices (the run would stop out of memory in its first step)."""
from __future__ import annotations

import pytest

from plandsl import api, ir
from plandsl.cost.estimate import estimate_plan
from plandsl.runtime.support import as_run, refusals

_PLAN = """import "clusters/local"
device small_cpu {{
  memory    = {memory}
  bandwidth = 50 GB/s
  peak      = {{ fp32: 1 TFLOP/s, bf16: 1 TFLOP/s, fp8: 2 TFLOP/s }}
}}
node small_box {{
  devices = 8 x small_cpu
  link    = {{ bandwidth: 5 GB/s, latency: 20 us }}
}}
plan p {{
  model   = gpt(layers=4, hidden=512, heads=8, seq=128, vocab=8192)
  cluster = small_box
  mesh    = {mesh} over devices[0:{size}]
  train   = {{ global_batch: 8, micro_batch: 1 }}
{lines}
}}
"""


def _plan(lines: str, mesh: str = "[dp = 2, tp = 2]", memory: str = "64 GiB"):
    size = 1
    for part in mesh.strip("[]").split(","):
        size *= int(part.split("=")[1])
    return api.select_plan(api.loads(_PLAN.format(memory=memory, mesh=mesh, size=size, lines=lines)))


@pytest.mark.parametrize("lines,mesh,changed", [
    ("  data = replicate over dp\n  tensor = megatron over tp with implementation = megatron", "[dp = 2, tp = 2]",
     "torch's tensor parallelism where the plan names Megatron-LM's"),
    ("  stages = evenly over pp with implementation = deepspeed\n  schedule = 1f1b", "[pp = 2]",
     "torch's pipeline where the plan names DeepSpeed's"),
    ("  context = ring over cp", "[cp = 2]", "torch's ring attention where the plan names Transformer Engine's"),
])
def test_as_run_names_each_stack_run_replaces(lines, mesh, changed):
    plan = _plan(lines, mesh)
    run_plan, changes = as_run(plan)
    assert [what for what, _ in changes] == [changed] and all(span is not None for _, span in changes)
    assert as_run(run_plan)[1] == []  # the plan as run runs it is run as it is
    assert run_plan.train == plan.train and run_plan.mesh == plan.mesh


def test_as_run_computes_torchs_loss_and_the_fused_attention_core():
    """`loss: megatron` is counted with Megatron-LM's in-place backward, which run does not run (a refusal's
    reason); `attention: materialized` counts the s x s scores, which run never holds (no refusal of its own)."""
    plan = _plan("  data = replicate over dp").model_copy()
    train = plan.train.model_copy(update={"loss": ir.Loss.megatron, "attention": ir.Attention.materialized})
    run_plan, changes = as_run(plan.model_copy(update={"train": train}))
    assert run_plan.train.loss is ir.Loss.standard and run_plan.train.attention is ir.Attention.flash
    assert [what for what, _ in changes] == ["torch's cross entropy where the plan names Megatron-LM's"]
    flash_only = as_run(plan.model_copy(update={"train": plan.train.model_copy(
        update={"attention": ir.Attention.materialized})}))
    assert flash_only[1] == [] and flash_only[0].train.attention is ir.Attention.flash


def test_torchs_pipeline_runs_a_stage_even_at_one_pipeline_rank():
    plan = _plan("  data = replicate over dp\n  tensor = megatron over tp\n"
                 "  stages = evenly over pp with implementation = megatron\n  schedule = 1f1b", "[dp = 2, pp = 1, tp = 2]")
    run_plan, changes = as_run(plan)
    assert run_plan.stages.implementation == "torch" and [what for what, _ in changes] == [
        "torch's pipeline where the plan names Megatron-LM's"]


def test_a_plan_on_torchs_stack_is_run_as_it_is():
    plan = _plan("  data = replicate over dp\n  tensor = megatron over tp with sequence_parallel")
    assert as_run(plan) == (plan, [])


def test_torchs_tensor_parallelism_counts_the_copies_the_named_stack_does_not():
    """Megatron-LM's DDP keeps one copy of the parameters; torch's composable `replicate` a second while a unit
    computes: the count as run runs it is larger by those copies."""
    plan = _plan("  data = replicate over dp\n  tensor = megatron over tp with implementation = megatron")
    named, run = estimate_plan(plan).memory[0], estimate_plan(as_run(plan)[0]).memory[0]
    assert run.total > named.total and run.params > named.params


def test_only_a_plan_that_fits_just_on_its_named_stack_is_refused():
    lines = "  data = replicate over dp\n  tensor = megatron over tp with implementation = megatron"
    refused = [d for d in refusals(_plan(lines, memory="256 MiB"), cuda=False) if d.code == "E708"]
    assert len(refused) == 1 and "Megatron-LM's" in refused[0].message and "241.5 MiB" in refused[0].message
    assert not [d for d in refusals(_plan(lines, memory="320 MiB"), cuda=False) if d.code == "E708"]
    torch_stack = "  data = replicate over dp\n  tensor = megatron over tp"
    assert not [d for d in refusals(_plan(torch_stack, memory="320 MiB"), cuda=False) if d.code == "E708"]
