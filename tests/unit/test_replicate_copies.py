"""`replicate`'s copies of the parameters (`cost.memory.replicates_units`, `replicate_copy_bytes`): where `plandsl run`
replicates with torch's composable `replicate` (FSDP2's machinery over a mesh it does not shard), each unit's
parameters are copied before its forward and kept to its backward. Which parameters, and where none are: the cases a
review of the first count found wrong (the traces are tests/distributed/test_memtrace.py's)."""
from __future__ import annotations

import pytest

from plandsl import api
from plandsl.cost.memory import estimate_plan_memory, local_numel, replicate_copy_bytes, replicates_units
from plandsl.ir.layers import layers_of
from plandsl.ir.shard_rules import ruled_layers

PLAN = """import "clusters/dgx_h100"
plan p {{
  model   = {model}
  cluster = dgx_h100
  mesh    = {mesh}
  train   = {{ global_batch: 16, micro_batch: 2{train} }}
{lines}
}}
"""
DENSE = "llama(layers=2, hidden=256, heads=4, seq=64, vocab=512)"
MOE = "llama(layers=2, hidden=256, heads=4, seq=64, vocab=512, experts=4, top_k=2)"


def _plan(model=DENSE, mesh="[dp = 2, tp = 2]", lines="  data = zero1 over dp\n  tensor = megatron over tp", train=""):
    return api.select_plan(api.loads(PLAN.format(model=model, mesh=mesh, lines=lines, train=train), path="p.plan"))


def _weights(plan, keep=lambda p: True) -> float:
    """The rank's parameters' bytes, fp32, as tensor (and expert) parallelism and the shard rules split them."""
    return 4.0 * sum(local_numel(p, plan.tp, plan.expert_group, plan.expert_tp)
                     for layer in ruled_layers(plan, layers_of(plan.model)) for p in layer.params if keep(p))


def test_without_an_expert_axis_the_experts_are_copied_with_their_block():
    """No `experts =` line: the experts are plain parameters of their block, which `replicate` copies whole (the first
    count left them out: 2.5 MiB counted where run copies 8.5)."""
    plan = _plan(MOE)
    assert replicates_units(plan) and estimate_plan_memory(plan)[0].gathered_params == _weights(plan)


def test_experts_replicated_over_no_other_axis_are_not_copied():
    """Experts split over an expert axis that is the only one the gradients are reduced over: `replicate` ignores
    them (`data_parallel._group_experts`), and copies the rest."""
    plan = _plan(MOE, "[ep = 2, tp = 2]", "  tensor = megatron over tp\n  experts = alltoall over ep")
    copies = estimate_plan_memory(plan)[0].gathered_params
    assert copies == _weights(plan, lambda p: len(p.dims) != 3) and 0 < copies < _weights(plan)


def test_an_fp8_parameter_gather_copies_nothing():
    """`zero1 ... with gather = fp8` is Megatron's `--fp8-param-gather` (`cost.memory.model_state_bytes`), which
    `plandsl run` does not run: no `replicate` copy is counted on top of its FP8 weights."""
    plan = _plan(DENSE, lines="  data = zero1 over dp with gather = fp8\n  tensor = megatron over tp",
                 train=", precision: fp8")
    assert not replicates_units(plan) and estimate_plan_memory(plan)[0].gathered_params == 0
    assert replicates_units(_plan(DENSE))


def test_modules_split_over_the_data_axis_are_gathered_apart():
    """A shard rule's split over the data axis makes the module an FSDP group of its own (`data_parallel.
    shard_by_rules`): `replicate` does not copy it; it is gathered apart (`data_split_gathered`)."""
    rule = "\n  shard layers.*.attn.wq = { weight: Shard(0) @ dp }"
    plain, ruled = _plan(), _plan(lines="  data = zero1 over dp\n  tensor = megatron over tp" + rule)
    wq = _weights(ruled, lambda p: p.module.endswith("attn.wq"))
    layers = ruled_layers(ruled, layers_of(ruled.model))
    assert replicate_copy_bytes(plain, layers) - replicate_copy_bytes(ruled, layers) == pytest.approx(wq) and wq > 0


def test_a_shares_overflow_under_zero1_does_not_blame_zero2_or_3():
    """E503's hint for `batch_shares` names ZeRO-2/3's units held through the step only under ZeRO-2/3, not where
    the gathered parameters are replication's copies."""
    text = PLAN.format(model=DENSE, mesh="[dp = 2, tp = 2]", train=", batch_shares: [12, 4]",
                       lines="  data = zero1 over dp\n  tensor = megatron over tp").replace(
        'import "clusters/dgx_h100"', 'import "clusters/local"').replace("dgx_h100", "localhost x 4")
    plan = api.select_plan(api.loads(text, path="p.plan"))
    memory = estimate_plan_memory(plan)[0]
    room = memory.total - memory.gathered_params / 2  # the copies are what overflows
    tight = text.replace("import \"clusters/local\"", f"""device tight {{
  memory = {room / 2**20:.3f} MiB; bandwidth = 10 GB/s; peak = {{ fp32: 1 TFLOP/s, bf16: 1 TFLOP/s }}; reserve = 0 GiB
}}
node box {{ devices = 4 x tight; link = {{ bandwidth: 10 GB/s, latency: 5 us }} }}""").replace("localhost x 4", "box")
    errors = [d for d in api.checks(tight).diagnostics if d.is_error]
    assert [d.code for d in errors] == ["E503"] and "ZeRO-2/3" not in (errors[0].hint or "")


def test_a_split_over_the_data_axis_replicates_without_tensor_parallelism():
    """At tp 1 a shard rule's split over the data axis still makes DTensors of the module's parameters, so `run`
    replicates the rest with `replicate` (the count said DistributedDataParallel: 74 MiB under the trace of a small
    gpt)."""
    rule = "\n  shard layers.*.mlp.w1 = { weight: Shard(0) @ dp }"
    plan = _plan(mesh="[dp = 2, tp = 1]", lines="  data = zero1 over dp\n  tensor = megatron over tp" + rule)
    assert replicates_units(plan) and not replicates_units(_plan(mesh="[dp = 2, tp = 1]"))


def test_under_shares_a_module_split_over_the_data_axis_is_gathered_once():
    """With `batch_shares` FSDP keeps the module gathered through the step: counted whole once (`data_split_gathered`),
    not also among `replicate`'s copies (the first count held it there too)."""
    from plandsl.cost.memory import data_split_gathered
    rule = "\n  shard layers.*.attn.wq = { weight: Shard(0) @ dp }"
    lines = "  data = zero1 over dp\n  tensor = megatron over tp" + rule
    plan = _plan(lines=lines, train=", batch_shares: [12, 4]")
    layers = ruled_layers(plan, layers_of(plan.model))  # wq whole over tp, halved over dp
    wq = _weights(plan, lambda p: p.module.endswith("attn.wq"))
    assert replicate_copy_bytes(plan, layers) == _weights(plan) - wq
    assert data_split_gathered(plan, layers, held=True) == (wq, wq)
    assert estimate_plan_memory(plan)[0].gathered_params == _weights(plan)  # every parameter gathered once
