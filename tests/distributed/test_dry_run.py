"""`dry_run(plan)` (plandsl.runtime.dryrun) in this process, without ranks, on the local plans.

What must hold of the figures, whatever the layout: every rank holds whole modules (`parameters`, before
sharding) and stores a share of them (`local`, after tensor, expert and FSDP sharding); across the ranks the
shares add up to the model, counting what each layout replicates once per copy: dp replicates everything,
FSDP splits every tensor over dp, Megatron TP splits all but the norms, the row-parallel biases and the
position embedding, expert parallelism splits the experts, a pipeline partitions the layers. Bytes are
fp32 (4 per element), gradients shaped like the local parameters, AdamW two states per element of what the
rank's optimizer steps (ZeRO-1: its partition). The cost model's prediction agrees with the built states,
and reports FSDP's gathered parameters and gradients apart. Afterwards the process belongs to no process group and
torch's excepthook wrapping is undone, so later tests (which fork ranks from this process) are unaffected.
"""
from __future__ import annotations

import sys

import pytest

from plandsl.cost.memory import replicate_copy_bytes, whole_vocab_gradient_bytes
from plandsl.ir.layers import layers_of
from tests.conftest import STDLIB
from tests.distributed.harness import run_ranks
from tests.distributed.ranks import load, train
from tests.support import lazy

torch = lazy("torch")
dist = lazy("torch.distributed")
dryrun = lazy("plandsl.runtime.dryrun")
models = lazy("plandsl.runtime.models")
pipeline = lazy("plandsl.runtime.parallel.pipeline")
runtime_reference = lazy("plandsl.runtime.reference")

pytestmark = pytest.mark.dist

LOCAL = STDLIB / "local"
PLANS = ["dp", "fsdp", "tp_sp", "pp_1f1b", "zero1", "ep", "cp"]
FP32 = 4
ADAM_STATES = 2
# What torch's Megatron styles leave whole on every tensor rank (docs/running.md, "What runs"): the norms
# (SequenceParallel replicates their parameters), the biases of the row-parallel wo and w2 (added after the
# reduction) and the position embedding (only the token embedding and the head split over the vocabulary).
TP_REPLICATED = ("norm", "attn.wo.bias", "mlp.w2.bias", "embed.pos.")


def _model_params(plan) -> dict[str, int]:
    with torch.device("meta"):
        model = models.build_model(plan.model, plan.train.seed)
    return {name: param.numel() for name, param in model.named_parameters()}


def _dry_run(plan) -> dryrun.DryRun:
    """dry_run, checking it leaves this process as it found it."""
    hook = sys.excepthook
    assert not dist.is_initialized()
    result = dryrun.dry_run(plan)
    assert not dist.is_initialized(), "dry_run left a default process group behind"
    assert sys.excepthook is hook, "dry_run left torch's '[rankN]:' excepthook wrapper(s) installed"
    return result


@pytest.mark.parametrize("name", PLANS)
def test_dry_run_figures_add_up(name):
    plan = load(LOCAL / f"{name}.plan")
    params = _model_params(plan)
    total = sum(params.values())
    result = _dry_run(plan)
    world = plan.mesh.size
    ranks = result.ranks
    assert (result.plan, result.world, result.summary) == (plan.name, world, "")
    assert [r.rank for r in ranks] == list(range(world))
    assert all(r.ranks_like_it == 1 for r in ranks)
    axes = [axis.name for axis in plan.mesh.axes]
    assert sorted(r.coordinate for r in ranks) == sorted(tuple(zip(axes, (i,))) for i in range(world))  # 1-D meshes
    assert result.optimizer.startswith("AdamW, 2 states")
    local = [r.local_parameters for r in ranks]

    # ---- elements: who holds and stores what
    if name == "pp_1f1b":
        assignment, problems = pipeline.assign_stages(plan)
        assert not problems
        assert [r.stages for r in ranks] == [(0,), (1,)]
        for r in ranks:
            (stage,) = r.stages
            held = [layer.name for layer in assignment.stage_layers[stage]]
            want = sum(n for p, n in params.items() if any(p == h or p.startswith(h + ".") for h in held))
            assert r.parameters == r.local_parameters == want, (r.rank, held)
            assert 0 < r.parameters < total
        assert sum(r.parameters for r in ranks) == total  # the stages partition the model
    else:
        assert all(r.stages == () for r in ranks)
        assert all(r.parameters == total for r in ranks)  # every rank holds every module
    if name in ("dp", "zero1", "cp"):  # cp: the context axis holds the whole model, as a data axis does
        assert local == [total] * world
    elif name == "fsdp":
        assert sum(local) == total  # every tensor split over dp, nothing stored twice
        assert all(abs(n - total / world) <= 0.01 * total for n in local), local
    elif name == "tp_sp":
        replicated = sum(n for p, n in params.items() if any(part in p for part in TP_REPLICATED))
        assert 0 < replicated < total / 10
        assert local == [replicated + (total - replicated) // world] * world
        assert sum(local) == total + (world - 1) * replicated
    elif name == "ep":
        experts = sum(n for p, n in params.items() if ".moe.experts." in p)
        assert experts > total / 2
        assert local == [total - experts + experts // world] * world
        assert sum(local) == total + (world - 1) * (total - experts)  # all but the experts replicated over ep

    # ---- bytes
    for r in ranks:
        assert r.param_bytes == FP32 * r.local_parameters > 0
        assert r.grad_bytes == r.param_bytes  # everything trains; gradients shaped like the local parameters
        assert r.states_bytes == r.param_bytes + r.grad_bytes + r.optimizer_bytes
        if name != "zero1":
            assert r.optimizer_bytes == ADAM_STATES * r.param_bytes
        figures = r.to_json()
        assert figures["states_bytes"] == r.states_bytes and figures["coordinate"] == dict(r.coordinate)
    if name == "zero1":  # optimizer states partitioned (whole tensors) over dp, each element once
        assert sum(r.optimizer_bytes for r in ranks) == ADAM_STATES * FP32 * total
        assert all(0 < r.optimizer_bytes < ADAM_STATES * FP32 * total for r in ranks)

    # ---- the cost model's prediction for the same ranks
    for r in ranks:
        p = r.predicted
        # FSDP's units at the moments it holds them: `moments` leaves out what is not alive at the larger of the two
        # (never more than the units gathered), `apart` a one-microbatch step's gradients not yet made
        assert p is not None and p.activations > 0 and 0 <= p.moments <= p.gathered_params + p.gathered_grads
        assert p.total >= p.params + p.grads + p.optimizer + p.activations - p.apart - p.moments
        if name == "fsdp":  # it also counts the parameters and gradients gathered during a step, apart
            assert p.gathered_params > 0 and p.gathered_grads > 0 and p.states > p.stored_states
        else:  # but the embedding's gradient over the whole vocabulary under torch's tensor parallelism, kept till
            # the next step without data parallelism (`cost.memory.whole_vocab_gradient_bytes`), beyond its rows'
            # the next step without data parallelism (`cost.memory.whole_vocab_gradient_bytes`), beyond its rows'; and
            # `replicate`'s copy of the parameters an expert axis replicates (`cost.memory.replicate_copy_bytes`)
            whole = whole_vocab_gradient_bytes(plan, layers_of(plan.model)) if plan.stages is None else 0.0
            copies = replicate_copy_bytes(plan, layers_of(plan.model)) if plan.stages is None else 0.0
            assert p.gathered_params == copies and (copies > 0) == (name == "ep")
            assert p.gathered_grads == whole and (whole > 0) == (plan.tp > 1)
        # ZeRO-1: the most loaded rank of the data group, which every rank's partition names
        assert r.optimizer_bytes <= r.most_loaded_optimizer_bytes
        assert (p.params - p.gathered_params, p.grads - p.gathered_grads, p.optimizer) == \
            pytest.approx((r.param_bytes, r.grad_bytes, r.most_loaded_optimizer_bytes))

    text = dryrun.format_dry_run(result)
    assert text.startswith(f"dry run of plan '{plan.name}': {world} of {world} ranks built")
    rows = [line.split() for line in text.splitlines() if line.split() and line.split()[0].isdigit()]
    assert [int(row[0]) for row in rows] == list(range(world))


def test_dry_run_refuses_inside_a_process_group():
    from torch.testing._internal.distributed.fake_pg import FakeStore
    hook = sys.excepthook
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match="already belongs to a process group"):
            dryrun.dry_run(load(LOCAL / "dp.plan"))
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook


def test_a_rank_that_cannot_be_built_is_e716_at_the_plan(monkeypatch):
    """`plandsl run --dry-run` of a plan whose rank 1 cannot be built: error E716 at the plan's line, naming the
    rank and the exception, with a hint (exit 1), not an uncoded `FILE: error: plan 'p': rank 1: ...` line; the
    process belongs to no group afterwards."""
    from click.testing import CliRunner

    from plandsl.cli import main
    from plandsl.runtime import dryrun as module  # the module itself, to patch (`dryrun` is a lazy proxy)
    build = module._build_rank

    def failing(plan, model, rank, *args):
        if rank == 1:
            raise ValueError("no shard for this rank")
        return build(plan, model, rank, *args)
    monkeypatch.setattr(module, "_build_rank", failing)
    result = CliRunner().invoke(main, ["run", str(LOCAL / "dp.plan"), "--dry-run"])
    assert result.exit_code == 1, result.output
    first = result.output.splitlines()[0]
    assert "dp.plan:" in first and "error[E716]: plan 'tiny_dp': rank 1 cannot be built" in first, result.output
    assert first.endswith("ValueError: no shard for this rank") and "^" in result.output
    assert "= hint: " in result.output and "Traceback" not in result.output and not dist.is_initialized()


def test_a_model_whose_factory_raises_is_e716_at_the_model(tmp_path, monkeypatch):
    """`plandsl run --dry-run` of a plan whose model factory raises (or cannot be imported): E716 at the model's
    line, naming the model and the exception (exit 1); before, the model was built outside the ranks' guard and
    the boundary reported E108, `a bug in plandsl, not a problem of the plan`, at 1:1."""
    from click.testing import CliRunner

    from plandsl.cli import main
    monkeypatch.syspath_prepend(str(tmp_path))  # the factory's module, importable as on every machine (PYTHONPATH)
    (tmp_path / "r55_raising_factory.py").write_text("def build(**kwargs):\n    raise RuntimeError('no weights here')\n")
    plan = ('import "clusters/local"\n\nmodel mine {\n  factory = "r55_raising_factory:build"\n  seq = 16\n'
            '  layer layers[0:2] {\n    params = 72\n    output = 8\n  }\n}\n\nplan p {\n  model   = mine\n'
            '  cluster = localhost\n  mesh    = [dp = 2] over devices[0:2]\n'
            '  train   = { global_batch: 8, micro_batch: 1 }\n  data    = ddp over dp\n}\n')
    (tmp_path / "fac.plan").write_text(plan)
    (tmp_path / "missing.plan").write_text(plan.replace("r55_raising_factory:build", "r55_no_such_module:build"))
    for name, raised in (("fac.plan", "RuntimeError: no weights here"), ("missing.plan", "cannot import factory")):
        result = CliRunner().invoke(main, ["run", str(tmp_path / name), "--dry-run"])
        assert result.exit_code == 1, result.output
        first = result.output.splitlines()[0]
        assert f"{name}:3:1: error[E716]: plan 'p': its model 'mine' cannot be built" in first, result.output
        assert raised in first and "^" in result.output and "E108" not in result.output, result.output
    assert not dist.is_initialized()


def test_training_after_dry_runs_is_unaffected(tmp_path):
    """Ranks forked after dry runs of DTensor layouts train and checkpoint as ever: no group, hook or
    DTensor cache entry of a fake rank is inherited (a cached sharding spec holding fake rank 0's mesh
    gave every rank rank 0's shard offsets, and DCP refused the overlapping chunks)."""
    for name in ("tp_sp", "fsdp"):
        _dry_run(load(LOCAL / f"{name}.plan"))
    steps = 2
    results = run_ranks(2, train, LOCAL / "fsdp.plan", steps=steps, checkpoint_dir=tmp_path, deadline_s=90)
    assert [r["status"] for r in results] == [0, 0]
    assert (tmp_path / "step-000002" / "plandsl.json").is_file()
    reference = runtime_reference.run_reference(load(LOCAL / "fsdp.plan"), steps).losses
    for got, want in zip(results[0]["losses"], reference, strict=True):
        assert abs(got - want) <= 1e-5 * abs(want), (got, want)
    assert not dist.is_initialized()
