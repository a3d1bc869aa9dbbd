"""ZeRO-1 (`data = zero1`) with every parallelism it composes with, against one process.

Plain parameters go to torch's ZeroRedundancyOptimizer, DTensors (tensor-parallel and expert shards,
pipeline stages on composable `replicate`) to `runtime.zero.Zero1Optimizer`. Each case trains with
`--check-equivalence` and reports which parameters each rank's optimizer steps: among the ranks that
hold a parameter identically (its ZeRO group: the data axes; for expert shards the data axes but the
expert axis), exactly one steps it, the states are spread evenly (up to the largest tensor), and
Adam keeps two states per element it steps. A checkpoint of DTensor states resumes, resharded, under
plain ZeRO-1 on another mesh.
"""
from __future__ import annotations

import math
from collections import defaultdict

import pytest

from tests.conftest import STDLIB
from tests.distributed.harness import run_ranks
from tests.distributed.ranks import RANK_TIMEOUT_S, load, train
from tests.support import lazy

torch = lazy("torch")
zero = lazy("plandsl.runtime.parallel.zero")

pytestmark = pytest.mark.dist

STEPS = 2

_PLAN = """import "clusters/local"
import "local/tiny"
{header}
plan p {{
  model   = {model}
  cluster = localhost
  mesh    = {mesh} over devices[0:4]
  train   = tiny_train
  data    = zero1 over {data}
  {lines}
}}
"""
_MOE = "model tiny_moe = llama(layers=2, hidden=64, heads=4, kv_heads=2, seq=32, vocab=256, ffn=64, experts=4, top_k=2)"

# (id, plan text, the axes a parameter's ZeRO group spans: name -> axes)
CASES = [
    ("tp_sp", _PLAN.format(header="", model="tiny_gpt", mesh="[dp = 2, tp = 2]", data="dp",
                           lines="tensor  = megatron over tp with sequence_parallel"), lambda name: ("dp",)),
    ("pp_zbv", _PLAN.format(header="", model="tiny_gpt", mesh="[dp = 2, pp = 2]", data="dp",
                            lines="stages  = evenly over pp with virtual = 2, map = vshape\n  schedule = zbv"),
     lambda name: ("dp",)),
    ("ep", _PLAN.format(header=_MOE, model="tiny_moe", mesh="[dp = 2, ep = 2]", data="dp",
                        lines="experts = alltoall over ep"),
     lambda name: ("dp",) if ".experts." in name else ("dp", "ep")),
]


def _train_zero1(rank: int, source, **config) -> dict:
    """`ranks.train`, plus what this rank's optimizer steps: parameter names, local elements and states."""
    from plandsl.runtime.faults import mesh_coordinate
    from plandsl.runtime.train import RunConfig, run
    plan = load(source)
    status, job = run(plan, RunConfig(steps=STEPS, check_equivalence=True, quiet=True, timeout_s=RANK_TIMEOUT_S,
                                      **config))
    names = {id(p): name for model in job.models for name, p in model.named_parameters()}
    local = {name: (p.to_local() if hasattr(p, "to_local") else p).numel()
             for model in job.models for name, p in model.named_parameters()}
    inner = job.optimizer.optim
    stepped = [names[id(p)] for group in inner.param_groups for p in group["params"]]
    states = sum(value.to_local().numel() if hasattr(value, "to_local") else value.numel()
                 for state in inner.state.values() for value in state.values()
                 if isinstance(value, torch.Tensor) and value.ndim > 0)
    return {"status": status, "optimizer": type(job.optimizer).__name__, "coordinate": mesh_coordinate(plan, rank),
            "held": local, "stepped": stepped, "states": states, "losses": list(job.losses),
            "report": job.report.__dict__ if job.report else None, "report_text": str(job.report) if job.report else None}


def _assert_partitioned(results: list[dict], group_axes) -> None:
    stepping: dict[tuple, list[int]] = defaultdict(list)
    for rank, result in enumerate(results):
        for name in result["stepped"]:
            key = tuple(sorted((axis, index) for axis, index in result["coordinate"].items()
                               if axis not in group_axes(name)))
            stepping[name, key].append(rank)
    for rank, result in enumerate(results):
        for name in result["held"]:
            key = tuple(sorted((axis, index) for axis, index in result["coordinate"].items()
                               if axis not in group_axes(name)))
            assert len(stepping[name, key]) == 1, (name, key, stepping[name, key])  # exactly one owner
    sizes = {axis: len({r["coordinate"][axis] for r in results}) for axis in results[0]["coordinate"]}
    for result in results:
        held, stepped = result["held"], result["stepped"]
        share = sum(held[n] / math.prod(sizes[a] for a in group_axes(n)) for n in held)
        assert sum(held[n] for n in stepped) <= share + max(held.values())  # balanced up to one tensor
        assert result["states"] == 2 * sum(held[n] for n in stepped)       # Adam: m and v of what it steps


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_zero1_over_dtensors_matches_one_process_and_partitions_the_states(case):
    _, text, group_axes = case
    results = run_ranks(4, _train_zero1, text, deadline_s=150)
    first = results[0]
    assert [r["status"] for r in results] == [0] * 4, first["report_text"]
    assert {r["optimizer"] for r in results} == {"Zero1Optimizer"}
    assert first["report"]["loss_diff"] <= 1e-5 and first["report"]["tensor_diff"] <= 1e-5, first["report_text"]
    _assert_partitioned(results, group_axes)


def test_plain_zero1_is_torchs_zero_redundancy_optimizer():
    results = run_ranks(2, _train_zero1, STDLIB / "local" / "zero1.plan", deadline_s=90)
    assert [r["status"] for r in results] == [0, 0], results[0]["report_text"]
    assert {r["optimizer"] for r in results} == {"ZeroRedundancyOptimizer"}
    _assert_partitioned(results, lambda name: ("dp",))


def test_dtensor_states_resume_resharded_under_plain_zero1(tmp_path):
    """Trained 2 steps as ZeRO-1 over tp-sharded DTensors (4 ranks), resumed for 2 more as plain ZeRO-1
    on 2 ranks: DCP reads the DTensor states by name into whole tensors; the 4 losses are dp.plan's."""
    directory = tmp_path / "ck"
    first = run_ranks(4, train, CASES[0][1], steps=STEPS, checkpoint_dir=directory, deadline_s=150)
    assert [r["status"] for r in first] == [0] * 4
    second = run_ranks(2, train, STDLIB / "local" / "zero1.plan", steps=2 * STEPS, checkpoint_dir=directory,
                       resume=True, check_equivalence=True, deadline_s=120)
    assert [r["status"] for r in second] == [0, 0], second[0]["report_text"]
    assert second[0]["first_step"] == STEPS
    whole = run_ranks(2, train, STDLIB / "local" / "dp.plan", steps=2 * STEPS, deadline_s=90)[0]["losses"]
    for got, want in zip(first[0]["losses"] + second[0]["losses"], whole):
        assert abs(got - want) <= 1e-5 * abs(want), (got, want)


def test_assign_gives_the_largest_first_to_the_least_loaded_rank():
    assert zero.assign([10, 1, 7, 3, 3], 2) == [0, 1, 1, 1, 0]  # 10 -> 0; 7 -> 1; 3 -> 1 (7+3 = 10); 3 -> 0; 1 -> 1
    assert zero.assign([5, 5, 5], 4) == [0, 1, 2]                # more ranks than tensors: some step nothing
    assert zero.assign([], 3) == []


_LONE = _PLAN.format(header="model tiny_llama = llama(layers=2, hidden=64, heads=4, kv_heads=2, seq=32, vocab=256)",
                     model="tiny_llama", mesh="[dp = 2, pp = 2]", data="dp",
                     lines="stages {\n    0: embed\n    1: layers[0:2], norm, head\n  }\n  schedule = 1f1b")


def test_a_rank_that_owns_no_parameter_checkpoints_and_resumes(tmp_path):
    """Stage 0 holds one tensor (llama's embedding) for two ZeRO-1 ranks: one of them steps nothing, and
    torch's get_state_dict refuses an optimizer without parameters; that rank saves and loads its model only."""
    directory = tmp_path / "ck"
    first = run_ranks(4, _train_zero1, _LONE, checkpoint_dir=directory, deadline_s=150)
    assert [r["status"] for r in first] == [0] * 4, first[0]["report_text"]
    assert sorted(len(r["stepped"]) for r in first if r["coordinate"]["pp"] == 0) == [0, 1]  # stage 0's ranks
    second = run_ranks(4, train, _LONE, steps=2 * STEPS, checkpoint_dir=directory, resume=True,
                       check_equivalence=True, deadline_s=150)
    assert [r["status"] for r in second] == [0] * 4, second[0]["report_text"]
    assert second[0]["first_step"] == STEPS and second[0]["report"]["tensor_diff"] <= 1e-5
