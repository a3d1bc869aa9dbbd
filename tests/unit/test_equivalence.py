"""`compare`: the equivalence verdict on all parameters together, the worst tensor shown beside it; buffers (BatchNorm's
running statistics) by the worst one."""
from __future__ import annotations

from support import lazy

torch = lazy("torch")
equivalence = lazy("plandsl.runtime.equivalence")
runtime_reference = lazy("plandsl.runtime.reference")


def _reference() -> runtime_reference.RunResult:
    generator = torch.Generator().manual_seed(0)
    return runtime_reference.RunResult([2.0, 1.5], {"w": torch.randn(128, 128, generator=generator),
                                                    "bias": torch.full((64,), 1e-3)})


def _run(reference: runtime_reference.RunResult, **changes) -> runtime_reference.RunResult:
    params = {name: tensor.clone() for name, tensor in reference.params.items()}
    for name, change in changes.items():
        change(params[name])
    return runtime_reference.RunResult(list(reference.losses), params)


def test_the_same_parameters_pass():
    reference = _reference()
    report = equivalence.compare(_run(reference), reference, 1e-5)
    assert report.ok and report.param_diff == report.tensor_diff == 0.0 and "note" not in str(report)


def test_one_element_of_a_small_tensor_moves_that_tensor_only():
    # What Adam does with an element whose gradient is near its eps: one step of about lr differs.
    reference = _reference()
    report = equivalence.compare(_run(reference, bias=lambda b: b.__setitem__(3, b[3] + 1e-5)), reference, 1e-5)
    assert report.tensor_name == "bias" and report.tensor_diff > 1e-3
    assert report.param_diff < 1e-5 and report.ok
    assert "largest in one tensor 1.250e-03 (bias)" in str(report) and "note: bias alone" in str(report)


def test_a_tensor_off_by_a_learning_rate_step_fails():
    # What a layout bug does (a gradient not reduced, a shard not broadcast): the whole tensor moves.
    reference = _reference()
    report = equivalence.compare(_run(reference, w=lambda w: w.add_(3e-4 * torch.sign(w))), reference, 1e-5)
    assert not report.ok and report.tensor_name == "w" and report.param_diff > 1e-5
    assert str(report).startswith("equivalence with one process: FAILED")


def test_the_whole_model_ratio_never_exceeds_the_worst_tensor():
    reference = _reference()
    run = _run(reference, w=lambda w: w.mul_(1 + 1e-6), bias=lambda b: b.mul_(1 + 3e-4))
    report = equivalence.compare(run, reference, 1e-5)
    assert report.param_diff <= report.tensor_diff


def test_a_loss_that_differs_fails_and_a_missing_parameter_fails():
    reference = _reference()
    run = _run(reference)
    run.losses[1] *= 1 + 1e-4
    report = equivalence.compare(run, reference, 1e-5)
    assert not report.ok and report.loss_step == 2
    run = _run(reference)
    del run.params["bias"]
    report = equivalence.compare(run, reference, 1e-5)
    assert not report.ok and report.missing == ("bias",)


def test_buffers_are_compared_where_the_run_sees_the_references_batches():
    """BatchNorm's running statistics updated a second time by a recomputation (the parameters equal): a failure;
    under data parallelism (each replica's statistics its own share's) not compared, and said so."""
    reference = _reference()
    reference.buffers = {"bn.running_mean": torch.full((8,), 0.19), "bn.num_batches_tracked": torch.tensor(2)}
    run = _run(reference)
    run.buffers = {"bn.running_mean": torch.full((8,), 0.19 * (1 + 0.9)), "bn.num_batches_tracked": torch.tensor(4)}
    report = equivalence.compare(run, reference, 1e-5)
    assert not report.ok and report.param_diff == 0.0 and report.buffer_name == "bn.num_batches_tracked"
    assert "buffers:    largest relative difference 1.000e+00 (bn.num_batches_tracked)" in str(report)
    run.buffers = {name: tensor.clone() for name, tensor in reference.buffers.items()}
    assert equivalence.compare(run, reference, 1e-5).ok
    del run.buffers["bn.running_mean"]
    assert equivalence.compare(run, reference, 1e-5).missing == ("bn.running_mean",)
    apart = equivalence.compare(run, reference, 1e-5, buffers=False)
    assert apart.ok and "buffers:    not compared" in str(apart)
    # a model with no persistent buffer (a transformer's rotary tables are not) under data parallelism: no line
    # saying what was not compared ('not compared (... running statistics ...)' before, of statistics it has none of)
    bare = _reference()
    assert "buffers" not in str(equivalence.compare(_run(bare), bare, 1e-5, buffers=False))


def test_a_run_that_reduces_its_gradients_in_bf16_is_held_to_the_16_bit_bound():
    # FSDP2's reduce_dtype is the plan's grad_dtype under a gather the run applies (data_parallel.mixed_precision):
    # the fp32 reference cannot round its gradients so, whatever the precision
    from plandsl import api
    text = """import "clusters/local"
import "local/tiny"
plan p {
  model   = tiny_gpt
  cluster = localhost
  mesh    = [dp = 2] over devices[0:2]
  train   = { global_batch: 8, micro_batch: 2, precision: fp32, grad_dtype: bf16 }
  data    = zero3 over dp%s
}
"""
    cpu = torch.device("cpu")
    assert equivalence.tolerance(api.loads(text % " with gather = fp32").plans[0], cpu) == 2e-2
    assert equivalence.tolerance(api.loads(text % "").plans[0], cpu) == 1e-5  # gradients in the weights' fp32
    assert equivalence.tolerance(api.loads(text.replace(", grad_dtype: bf16", "") % " with gather = fp32").plans[0],
                                 cpu) == 1e-5


def test_buffers_are_compared_unless_an_axis_of_more_than_one_rank_splits_the_batch_or_the_sequence():
    """A data axis of one rank splits nothing: every rank sees the reference's batches (the buffers were left
    uncompared there, as under real data parallelism)."""
    from plandsl import api
    text = """import "clusters/local"
import "local/tiny"
plan p {
  model   = tiny_gpt
  cluster = localhost
  mesh    = [dp = %d, pp = 2] over devices[0:%d]
  train   = { global_batch: 8, micro_batch: 2, precision: fp32 }
  data    = replicate over dp
  stages  = evenly over pp
}
"""
    assert equivalence.buffers_comparable(api.loads(text % (1, 2)).plans[0])
    assert not equivalence.buffers_comparable(api.loads(text % (2, 4)).plans[0])
    context = text.replace("dp = %d", "cp = %d").replace("data    = replicate over dp", "context = ring over cp")
    assert not equivalence.buffers_comparable(api.loads(context % (2, 4)).plans[0])
