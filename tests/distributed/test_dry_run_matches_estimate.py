"""One memory model: what `plandsl run --dry-run` builds is what `estimate`, `check` and `simulate` count.

For every stdlib example, one rank per pipeline stage is built on the meta device (`dry_run(plan, ranks)`),
at the coordinate the cost model calls the worst (every other axis at 0: uneven tensor and FSDP splits give
the first rank the larger share) and its parameter, gradient and optimizer-state bytes are compared with the
estimate for that pipeline rank, within 2 %: parameters and gradients fp32 and sharded as the interpreter
shards them, Adam's m and v fp32 over what the rank steps. ZeRO-1 assigns whole tensors to data ranks, so the
estimate is the most loaded rank of the group, which the dry run reads off the partition every rank computes.
The units ZeRO-2/3 gather during a step are not stored between steps: the estimate reports them apart.
"""
from __future__ import annotations

import re

import pytest

from plandsl.cost.memory import estimate_plan_memory
from plandsl.cost.estimate import estimate_plan
from plandsl.runtime.faults import mesh_rank
from plandsl.cost.simulation import simulate_plan
from plandsl.lower.units import format_bytes
from tests.conftest import STDLIB
from tests.distributed.ranks import load
from tests.support import lazy

dryrun = lazy("plandsl.runtime.dryrun")

EXAMPLES = sorted((STDLIB / "examples").glob("*.plan"))
TOLERANCE = 0.02


def _shows_the_estimate(result, estimate) -> None:
    """The dry run's table ends each rank's row with the estimate's activations, torch's pipeline buffers (a
    `pipeline` column, as `estimate` shows, where there are any) and the peak, their sum with the states."""
    text = dryrun.format_dry_run(result)
    buffers = any(m.other for m in estimate.memory)
    assert ("  pipeline  " in text.splitlines()[1]) == buffers
    rows = [line for line in text.splitlines()[2:2 + len(result.ranks)]]
    for row, built in zip(rows, result.ranks):
        p = built.predicted
        assert p.stored_states + p.gathered_params + p.gathered_grads + p.activations + p.other - p.apart \
            - p.moments == pytest.approx(p.total, rel=1e-12)  # less what is never alive at once
        assert ("never alive at once" in text) == any(m.apart or m.moments for m in estimate.memory)
        cells = [p.activations, p.other, p.total] if buffers else [p.activations, p.total]
        assert re.search(r"\s+".join(re.escape(format_bytes(c)) for c in cells) + "$", row), (row, cells)


def _first_rank_of_each_stage(plan) -> list[int]:
    zero = {axis.name: 0 for axis in plan.mesh.axes}
    if plan.stages is None:
        return [mesh_rank(plan, zero)]
    return [mesh_rank(plan, {**zero, plan.stages.axis: r}) for r in range(plan.pp)]


def test_every_example_is_compared():
    assert len(EXAMPLES) >= 10, EXAMPLES


def _few_microbatches(plan):
    """The plan with at most 2 microbatches per stage under a built-in schedule. The states compared here do
    not depend on the batch, while torch's schedule, which the dry run builds, takes time quadratic in the
    microbatches (zero_bubble_v's 256: ~40 CPU-s; 32: ~1)."""
    if plan.stages is None or plan.schedule is None or plan.schedule.definition is not None:
        return plan
    few = 2 * plan.pp * plan.stages.virtual
    if plan.num_microbatches <= few:
        return plan
    train = plan.train.model_copy(update={"global_batch": few * plan.dp * plan.train.micro_batch})
    smaller = plan.model_copy(update={"train": train})
    assert smaller.num_microbatches == few
    return smaller


@pytest.mark.slow
@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_dry_run_states_match_the_estimate(path):
    plan = _few_microbatches(load(path))
    estimate = estimate_plan(plan)
    result = dryrun.dry_run(plan, _first_rank_of_each_stage(plan))
    assert len(result.ranks) == max(1, plan.pp)
    for pipeline_rank, built in enumerate(result.ranks):
        predicted = estimate.memory[pipeline_rank]
        assert built.predicted == predicted
        pairs = {"parameters": (built.param_bytes, predicted.params - predicted.gathered_params),
                 "gradients": (built.grad_bytes, predicted.grads - predicted.gathered_grads),
                 "optimizer": (built.most_loaded_optimizer_bytes, predicted.optimizer)}
        for what, (got, want) in pairs.items():
            assert got == pytest.approx(want, rel=TOLERANCE), (path.stem, pipeline_rank, what, got, want)
        assert built.optimizer_bytes <= built.most_loaded_optimizer_bytes
    _shows_the_estimate(result, estimate)


@pytest.mark.xdist_group("torch")
@pytest.mark.parametrize("implementation", ["torch", "megatron"])
def test_dry_run_shows_torchs_pipeline_buffers_as_the_estimate(implementation):
    """`plandsl run --dry-run` predicts each pipeline rank's peak as `estimate` does, torch's pipeline stage's
    buffers (`cost.memory.torch_stage_bytes`) included in a `pipeline` column, which Megatron-LM's pipeline has not."""
    plan = load(STDLIB / "local" / "pp_1f1b.plan")
    if implementation == "megatron":
        plan = plan.model_copy(update={"stages": plan.stages.model_copy(update={"implementation": "megatron"})})
    estimate = estimate_plan(plan)
    assert all(m.other > 0 for m in estimate.memory) == (implementation == "torch")
    result = dryrun.dry_run(plan)
    assert [built.predicted for built in result.ranks] == list(estimate.memory)
    _shows_the_estimate(result, estimate)


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_check_estimate_and_simulate_count_the_same_states(path):
    """`check` (E503), `estimate` and `simulate` share `estimate_plan_memory`: the same states per rank (and
    simulate holds torch's pipeline buffers beside them, as estimate counts them: `MemoryEstimate.held`)."""
    plan = load(path)
    states = [m.states for m in estimate_plan(plan).memory]
    assert states == [m.states for m in estimate_plan_memory(plan)]
    if plan.stages is not None and plan.schedule is not None:
        from plandsl.cost.pipeline import estimate_stage_costs
        from plandsl.ir.placement import assign_stages
        assignment, _ = assign_stages(plan)
        held = [m.states + m.other for m in estimate_plan_memory(plan)]
        assert list(estimate_stage_costs(plan, assignment).static_bytes) == held
        _, simulation = simulate_plan(plan)
        assert all(r.peak_memory_bytes >= s for r, s in zip(simulation.ranks, held))


_TINY_MOE = ('import "clusters/local"\nimport "local/tiny"\nplan p {\n'
             '  model = llama(layers=2, hidden=32, heads=4, kv_heads=2, seq=16, vocab=128, ffn=32, experts=4, top_k=2%s)\n'
             '  cluster = localhost x %d\n  mesh = %s over devices[0:%d]\n  train = tiny_train\n  %s\n}\n')


@pytest.mark.xdist_group("torch")
@pytest.mark.parametrize("mesh, world, lines, extra", [
    ("[ep = 2, tp = 2]", 4, "tensor = megatron over tp\n  experts = alltoall over ep", ""),
    ("[ep = 2, tp = 2]", 4, "tensor = megatron over tp\n  experts = alltoall over ep", "shared_experts=1"),
    ("[dp = 2, pp = 2, ep = 2, tp = 2]", 16,
     ("data = zero1 over dp\n  tensor = megatron over tp with sequence_parallel\n  experts = alltoall over ep\n"
      "  stages = evenly over pp"), ""),
    ("[dp = 2, tp = 2]", 4, "data = zero3 over dp\n  tensor = megatron over tp", ""),
], ids=["ep_x_tp", "ep_x_tp_shared", "dp_pp_ep_tp_zero1", "moe_fsdp_x_tp"])
def test_routed_experts_split_over_tp_as_the_estimate_counts(mesh, world, lines, extra):
    """Under tensor parallelism each routed expert's FFN is split over tp (Megatron-Core's expert tensor
    parallelism), and the shared experts' as a dense MLP's, in the interpreter as in the memory model: with
    them whole on every tensor rank the [ep = 2, tp = 2] rank held 79,488 parameter bytes against the 54,912
    estimated, and a shared expert kept whole 12,288 bytes more."""
    plan = load(_TINY_MOE % (extra and f", {extra}", -(-world // 8), mesh, world, lines))
    estimate = estimate_plan(plan)
    result = dryrun.dry_run(plan, _first_rank_of_each_stage(plan))
    for pipeline_rank, built in enumerate(result.ranks):
        predicted = estimate.memory[pipeline_rank]
        pairs = {"parameters": (built.param_bytes, predicted.params - predicted.gathered_params),
                 "gradients": (built.grad_bytes, predicted.grads - predicted.gathered_grads),
                 "optimizer": (built.most_loaded_optimizer_bytes, predicted.optimizer)}
        for what, (got, want) in pairs.items():
            assert got == pytest.approx(want, rel=TOLERANCE), (mesh, pipeline_rank, what, got, want)


_RULED = """import "clusters/dgx_a100"
plan p {{
  model   = gpt(layers=4, hidden=512, heads=8, seq=256, vocab=8192)
  cluster = dgx_a100
  mesh    = [dp = 2, tp = 4]
  train   = {{ global_batch: 16, micro_batch: 2 }}
  data    = zero1 over dp
  tensor  = megatron over tp
{rules}
}}
"""


@pytest.mark.xdist_group("torch")
@pytest.mark.parametrize("rules, states", [
    ("  shard layers.*.mlp = replicate\n  shard embed.tok = replicate", 2.75),
    ("  shard embed.tok = colwise over tp\n  shard layers[0:2].attn.wo = { weight: Shard(0) @ tp }", 1.0),
    ("  shard layers.*.attn = replicate\n  shard layers.1.attn.wq = colwise over tp", 1.55),
    ("  shard layers.*.mlp.w1 = { weight: Shard(0) @ dp, bias: Shard(0) @ dp }", 1.32),
], ids=["replicated_mlp_and_embedding", "hidden_split_embedding", "replicated_attention_but_one", "split_over_dp"])
def test_the_estimate_places_parameters_as_the_shard_rules_do(rules, states):
    """A plan's shard rules move parameters off Megatron's default splits; the count places them as `plandsl run`
    does (`ir.shard_rules.ruled_layers`): the dry run's built states are the estimate's, `states` times those of the
    default splits (which the count held before: replicated MLPs and embedding, 2.75x). An embedding split along its
    hidden dim (colwise) makes its own rows' gradient: no whole-vocabulary one (`cost.memory.whole_vocab_gradient`),
    whose moment the default split's activations hold. A split over the data axis (w1 whole over tp, halved over dp):
    an FSDP group of its own, each of its states 1/dp, which ZeRO-1 steps as held, apart from its partition
    (`cost.memory.model_state_bytes`; counted whole over dp and in ZeRO-1's partition before)."""
    plan = load(_RULED.format(rules=rules))
    default = estimate_plan_memory(load(_RULED.format(rules="")))[0]
    predicted = estimate_plan(plan).memory[0]
    built = dryrun.dry_run(plan, [0]).ranks[0]
    assert built.predicted == predicted
    pairs = {"parameters": (built.param_bytes, predicted.params - predicted.gathered_params),
             "gradients": (built.grad_bytes, predicted.grads - predicted.gathered_grads),
             "optimizer": (built.most_loaded_optimizer_bytes, predicted.optimizer)}
    for what, (got, want) in pairs.items():
        assert got == pytest.approx(want, rel=TOLERANCE), (what, got, want)
    assert predicted.stored_states / default.stored_states == pytest.approx(states, abs=0.05)
    assert (predicted.activations < default.activations) == ("embed.tok = colwise" in rules)
