"""`master_dtype`, `grad_dtype` and `optimizer_dtype`: the dtypes training keeps its weights, gradients and
optimizer states in (16-bit optimizer states: Nemotron-4's recipe, Megatron-Core's precision-aware optimizer).

Each halves its share of the memory model when 16-bit, the gradient reductions follow `grad_dtype`, the
search writes what it was given, Megatron's flags say it both ways, and the interpreter keeps the states in
`optimizer_dtype` with the update in fp32 (exactly torch's AdamW and SGD when the states are fp32).
"""
from __future__ import annotations

import dataclasses

import pytest

from plandsl import api, ir
from plandsl.cost.estimate import estimate_plan
from plandsl.interop import export_plan, import_text
from tests.support import lazy

torch = lazy("torch")

PLAN = """\
import "clusters/dgx_a100"
plan p {{
  model    = gpt(layers=16, hidden=1024, heads=16, seq=1024, vocab=51200)
  cluster  = dgx_a100 x 2
  mesh     = [dp = 4, pp = 2, tp = 2]
  train    = {{ global_batch: 64, micro_batch: 2, {train} }}
  data     = {data} over dp
  tensor   = megatron over tp with implementation = megatron
  stages   = evenly over pp
  schedule = 1f1b
}}
"""
# Megatron-LM's tensor parallelism: no whole-vocabulary embedding gradient, whose moment (torch's, in the weights'
# dtype: `cost.memory.whole_vocab_gradient_moment`) would move the activations with `master_dtype` too


def _plan(train: str = "", data: str = "zero1") -> ir.Plan:
    return api.loads(PLAN.format(train=train, data=data)).plans[0]


def test_defaults_are_fp32_and_the_memory_model_is_unchanged():
    plan = _plan()
    assert (plan.train.master_dtype, plan.train.grad_dtype, plan.train.optimizer_dtype) == (ir.Precision.fp32,) * 3
    written = _plan("master_dtype: fp32, grad_dtype: fp32, optimizer_dtype: fp32")
    assert estimate_plan(plan).memory == estimate_plan(written).memory


@pytest.mark.parametrize("data", ["replicate", "zero1", "zero3"])
def test_each_16_bit_dtype_halves_its_own_share(data):
    wide = estimate_plan(_plan(data=data)).memory
    for key, field in (("master_dtype", "params"), ("grad_dtype", "grads"), ("optimizer_dtype", "optimizer")):
        narrow = estimate_plan(_plan(f"{key}: bf16", data)).memory
        for w, n, held in zip(wide, narrow, _copies(_plan(data=data))):
            assert getattr(n, field) == pytest.approx(getattr(w, field) / 2)
            others = {"params", "grads", "optimizer"} - {field}
            assert all(getattr(n, o) == getattr(w, o) for o in others if not (data == "zero3" and o == "params"
                                                                                  and field == "master_dtype"))
            # 16-bit weights leave autocast nothing to copy (`cost.memory.autocast_weight_copies`), else as before
            assert n.activations == pytest.approx(w.activations - (held if key == "master_dtype" else 0.0))


def _copies(plan) -> float:
    """autocast's 16-bit copies of the fp32 weights each pipeline rank holds under `plandsl run`."""
    from plandsl.cost.memory import autocast_weight_copies
    from plandsl.ir.placement import assign_stages
    assignment, _ = assign_stages(plan)
    return [autocast_weight_copies(plan, [layer for s in stages for layer in assignment.stage_layers[s]])
            for stages in assignment.rank_stages()]


@pytest.mark.parametrize("zero_stage", [0, 1])
def test_gradients_travel_at_grad_dtype(zero_stage):
    """A rank's gradient reduction (nothing to hide it behind here) moves grad_dtype's bytes: bf16 half of fp32."""
    from plandsl.cost.estimate import plan_links
    from plandsl.cost.memory import StateBytes
    from plandsl.cost.stage import StageTime, rank_tail
    plan = _plan()
    stage = StageTime(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, dense_params=4e9, expert_params=0.0)
    device = plan.cluster.devices_in_order()[0]

    def exposed(grads: int) -> float:
        return rank_tail([stage], zero_stage, (4, 4), 2, plan_links(plan), device, ir.Optimizer.adam,
                         ir.Precision.bf16, StateBytes(4, grads, 4)).exposed
    gather = 0.0 if zero_stage == 0 else exposed(0)  # ZeRO-1 also gathers the parameters (at the compute dtype)
    assert exposed(2) - gather == pytest.approx((exposed(4) - gather) / 2, rel=0.01)


@pytest.mark.parametrize("train, code, words", [
    ("precision: bf16, master_dtype: bf16, optimizer_dtype: fp8", "E210", "not a valid dtype"),
    ("precision: fp32, master_dtype: bf16", "E205", "narrower than precision"),
    ("grad_dtypes: bf16", "E206", "grad_dtype"),
])
def test_bad_dtypes_are_diagnostics(train, code, words):
    analysis = api.checks(PLAN.format(train=train, data="zero1"))
    assert [d.code for d in analysis.errors] == [code], [str(d) for d in analysis.errors]
    assert words in analysis.errors[0].message + (analysis.errors[0].hint or "")


def test_megatron_precision_aware_optimizer_both_ways():
    plan = _plan("grad_dtype: bf16, optimizer_dtype: bf16")
    exported = export_plan(plan, "megatron")
    assert not exported.lost, [str(d) for d in exported.lost]
    text = " ".join(line.strip() for line in exported.text.splitlines() if not line.startswith("#"))
    for flag in ("--use-precision-aware-optimizer", "--main-grads-dtype bf16", "--exp-avg-dtype bf16",
                 "--exp-avg-sq-dtype bf16"):
        assert flag in text
    assert "--main-params-dtype" not in text  # fp32: Megatron's default
    imported = import_text("megatron", exported.text, "plan.args", world_size=plan.mesh.size, name=plan.name)
    assert imported.ok, [str(d) for d in imported.diagnostics]
    back = api.select_plan(api.loads(imported.text, path="back.plan"))
    assert (back.train.grad_dtype, back.train.optimizer_dtype, back.train.master_dtype) == \
        (ir.Precision.bf16, ir.Precision.bf16, ir.Precision.fp32)


@pytest.mark.parametrize("train, data, words", [
    ("optimizer_dtype: bf16", "replicate", "sharded optimizer"),
    ("optimizer: sgd, optimizer_dtype: bf16", "zero1", "sharded optimizer"),
    ("precision: bf16, master_dtype: bf16", "zero1", "--main-params-dtype takes fp32, fp16"),
])
def test_megatron_export_says_what_it_cannot_keep(train, data, words):
    exported = export_plan(_plan(train, data), "megatron")
    assert [d.code for d in exported.lost] == ["E808"] and words in exported.lost[0].message


@pytest.mark.parametrize("flags, code", [
    ("--main-grads-dtype bf16", "E805"),
    ("--use-precision-aware-optimizer --exp-avg-dtype bf16", "E805"),
    ("--use-precision-aware-optimizer --use-distributed-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype fp32", "E807"),
    ("--use-precision-aware-optimizer --use-distributed-optimizer --exp-avg-dtype fp8 --exp-avg-sq-dtype fp8", "E807"),
])
def test_megatron_import_refuses_dtype_flags_it_cannot_read(flags, code):
    base = ("--tensor-model-parallel-size 1 --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
            "--max-position-embeddings 32 --micro-batch-size 1 --global-batch-size 8 --padded-vocab-size 256 --bf16 ")
    imported = import_text("megatron", base + flags, "plan.args", world_size=8, name="p")
    assert code in [d.code for d in imported.diagnostics], [str(d) for d in imported.diagnostics]


def test_megatron_core_names_and_rules_are_its_optimizer_configs():
    """The flags' fields exist in megatron-core's OptimizerConfig, and it refuses what the export refuses:
    the precision-aware optimizer without Adam or without the distributed optimizer."""
    optimizer_config = pytest.importorskip("megatron.core.optimizer.optimizer_config")
    fields = {f.name for f in dataclasses.fields(optimizer_config.OptimizerConfig)}
    assert {"main_params_dtype", "main_grads_dtype", "exp_avg_dtype", "exp_avg_sq_dtype",
            "use_precision_aware_optimizer"} <= fields
    for kwargs in ({"optimizer": "sgd", "use_distributed_optimizer": True}, {"optimizer": "adam"}):
        with pytest.raises(AssertionError, match="only supported with"):
            optimizer_config.OptimizerConfig(use_precision_aware_optimizer=True, **kwargs)


def test_generate_writes_the_dtypes_it_was_given(tmp_path):
    partial = tmp_path / "partial.plan"
    partial.write_text('import "clusters/dgx_a100"\nplan p {\n  model = gpt(layers=8, hidden=1024, heads=16, seq=1024, '
                       'vocab=51200)\n  cluster = dgx_a100\n  train = { global_batch: 64, grad_dtype: bf16, '
                       'optimizer_dtype: bf16 }\n}\n')
    result = api.generate(api.generate_request(from_file=str(partial), top=1))
    plan = api.select_plan(api.loads(result.texts[0], path=str(tmp_path / "out.plan")))
    assert (plan.train.grad_dtype, plan.train.optimizer_dtype) == (ir.Precision.bf16, ir.Precision.bf16)


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_fp32_states_are_torchs_optimizer_exactly_and_16_bit_states_stay_16_bit(optimizer):
    from plandsl.runtime.optim import AdamWStates, SGDStates
    cls, base, kwargs = ((AdamWStates, torch.optim.AdamW, dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1))
                         if optimizer == "adam" else (SGDStates, torch.optim.SGD, dict(lr=1e-2, momentum=0.9)))
    generator = torch.Generator().manual_seed(0)
    ours = torch.nn.Parameter(torch.randn(5, 4, generator=generator))
    theirs = torch.nn.Parameter(ours.detach().clone())
    narrow = torch.nn.Parameter(ours.detach().clone())
    steppers = (cls([ours], state_dtype=torch.float32, **kwargs), base([theirs], foreach=False, **kwargs),
                cls([narrow], state_dtype=torch.bfloat16, **kwargs))
    for _ in range(3):
        grad = torch.randn(5, 4, generator=generator)
        for param, stepper in zip((ours, theirs, narrow), steppers):
            param.grad = grad.clone()
            stepper.step()
    assert torch.equal(ours, theirs)
    assert 0 < (narrow - theirs).abs().max() < 1e-3
    states = steppers[2].state[narrow]
    assert {key: value.dtype for key, value in states.items() if key != "step"} == \
        dict.fromkeys([k for k in states if k != "step"], torch.bfloat16)
    # torch's load_state_dict casts floating states to the parameter's dtype; the optimizer's hooks keep its own
    saved = steppers[2].state_dict()
    resumed = cls([narrow], state_dtype=torch.bfloat16, **kwargs)
    resumed.load_state_dict(saved)
    assert all(v.dtype == torch.bfloat16 and torch.equal(v, states[k])
               for k, v in resumed.state[narrow].items() if k != "step")


def test_fp32_states_of_bf16_weights_resume_unrounded():
    from plandsl.runtime.optim import AdamWStates
    weight = torch.nn.Parameter(torch.randn(6, 5).to(torch.bfloat16))
    kwargs = dict(state_dtype=torch.float32, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    first = AdamWStates([weight], **kwargs)
    for _ in range(3):
        weight.grad = torch.randn(6, 5).to(torch.bfloat16)
        first.step()
    resumed = AdamWStates([weight], **kwargs)
    resumed.load_state_dict(first.state_dict())
    for key in ("exp_avg", "exp_avg_sq"):
        assert resumed.state[weight][key].dtype == torch.float32
        assert torch.equal(resumed.state[weight][key], first.state[weight][key])


@pytest.mark.parametrize("dtypes, refused", [("optimizer_dtype: fp16", True), ("optimizer_dtype: bf16", False),
                                             ("master_dtype: fp16, precision: fp16", False)])
def test_run_refuses_fp16_states_only(dtypes, refused):
    codes = [d.code for d in api.run_refusals(_plan(dtypes))]
    assert codes == (["E706"] if refused else [])


# ---- param_dtype: 16-bit weights beside an fp32 master copy the optimizer keeps (Megatron's, DeepSpeed's layout) --
@pytest.mark.parametrize("data", ["replicate", "zero1", "zero3"])
def test_a_master_copy_counts_with_the_optimizer_and_is_sharded_as_it_is(data):
    """param_dtype: bf16 with an fp32 master: the weights take 2 bytes, the optimizer 8 + 4 (ZeRO's K = 12,
    Rajbhandari et al. 2020, Sec. 3.1), each sharded by its own ZeRO stage; gradients as before."""
    wide = estimate_plan(_plan(data=data)).memory
    kept = estimate_plan(_plan("param_dtype: bf16", data)).memory
    for w, k, held in zip(wide, kept, _copies(_plan(data=data))):
        assert k.params == pytest.approx(w.params / 2)
        assert k.optimizer == pytest.approx(w.optimizer * 12 / 8)
        # activations as before, less autocast's copies of the fp32 weights: 16-bit weights need none
        assert (k.grads, k.activations) == (w.grads, pytest.approx(w.activations - held))
    if data == "zero1":  # the master copy is sharded, the weights are not: less than the fp32 weights' layout
        assert all(k.total < w.total for k, w in zip(kept, wide))
    same = _plan("param_dtype: fp32", data)  # the weights are the master copy: nothing apart
    assert estimate_plan(same).memory == wide and not same.train.master_copy


@pytest.mark.parametrize("train, words", [
    ("precision: bf16, param_dtype: fp8", "not a valid dtype"),
    ("precision: fp32, param_dtype: bf16", "narrower than precision"),
    ("precision: bf16, master_dtype: bf16, param_dtype: fp32", "wider than master_dtype"),
    # as wide as the master but another dtype: no copy is kept apart, so master_dtype would be ignored
    ("precision: bf16, master_dtype: fp16, param_dtype: bf16", "as wide as master_dtype"),
])
def test_bad_param_dtypes_are_diagnostics(train, words):
    analysis = api.checks(PLAN.format(train=train, data="zero1"))
    assert len(analysis.errors) == 1 and words in analysis.errors[0].message, [str(d) for d in analysis.errors]


@pytest.mark.parametrize("target", ["megatron", "deepspeed"])
def test_exports_keep_their_own_layout_and_refuse_another(target):
    """Megatron and DeepSpeed keep the weights in the compute precision beside an fp32 master: param_dtype equal
    to `precision` is their layout; other weights are not."""
    def refused(train: str) -> list[str]:  # (DeepSpeed's JSON also loses this plan's tensor and pipeline axes)
        return [d.code for d in export_plan(_plan(train), target).lost if "_dtype" in d.message]
    assert refused("precision: bf16, param_dtype: bf16") == []
    assert set(refused("precision: bf16, param_dtype: bf16, master_dtype: bf16")) == {"E808"}


def test_generate_and_show_carry_param_dtype(tmp_path):
    partial = tmp_path / "partial.plan"
    partial.write_text('import "clusters/dgx_a100"\nplan p {\n  model = gpt(layers=8, hidden=1024, heads=16, seq=1024, '
                       'vocab=51200)\n  cluster = dgx_a100\n  train = { global_batch: 64, param_dtype: bf16 }\n}\n')
    result = api.generate(api.generate_request(from_file=str(partial), top=1))
    plan = api.select_plan(api.loads(result.texts[0], path=str(tmp_path / "out.plan")))
    assert (plan.train.param_dtype, plan.train.master_dtype, plan.train.master_copy) == \
        (ir.Precision.bf16, ir.Precision.fp32, True)
    assert "(weights bf16, master fp32)" in api.describe(api.loads(result.texts[0], path=str(tmp_path / "o.plan")))


def test_the_master_copy_is_updated_in_fp32_and_resumes_unrounded():
    """The optimizer steps the fp32 master (torch's AdamW on it, exactly) and writes it into the bf16 weight; a
    resume brings the master back in fp32, though torch's load casts every state to its parameter's dtype."""
    from plandsl.runtime.optim import AdamWStates
    torch.manual_seed(0)
    start = torch.randn(6, 5)
    weight = torch.nn.Parameter(start.to(torch.bfloat16))
    reference = torch.nn.Parameter(start.to(torch.bfloat16).float())  # the master starts from the bf16 weight
    kwargs = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    ours = AdamWStates([weight], state_dtype=torch.bfloat16, master_dtype=torch.float32, **kwargs)
    torchs = torch.optim.AdamW([reference], **kwargs)
    for _ in range(3):
        grad = torch.randn(6, 5).to(torch.bfloat16)
        weight.grad, reference.grad = grad, grad.float()
        ours.step()
        torchs.step()
    master = ours.state[weight]["master"]
    assert master.dtype == torch.float32 and weight.dtype == torch.bfloat16
    assert torch.equal(weight, master.to(torch.bfloat16))
    assert torch.allclose(master, reference, rtol=0, atol=1e-2 * 3 / 128)  # bf16 m and v: close, not equal
    resumed = AdamWStates([weight], state_dtype=torch.bfloat16, master_dtype=torch.float32, **kwargs)
    resumed.load_state_dict(ours.state_dict())
    assert resumed.state[weight]["master"].dtype == torch.float32
    assert torch.equal(resumed.state[weight]["master"], master)
    assert resumed.state[weight]["exp_avg"].dtype == torch.bfloat16


_ONE_MICROBATCH = """
import "clusters/local"
plan p {
  model    = gpt(layers=2, hidden=32, heads=2, seq=8, vocab=64)
  cluster  = localhost
  mesh     = [pp = 1, dp = 2] over devices[0:2]
  train    = { global_batch: BATCH, micro_batch: 2, precision: fp16, grad_dtype: GRAD, lr: 1e-3 }
  data     = zero2 over dp with gather = GATHER
  stages   = evenly over pp
  schedule = 1f1b
}
"""


@pytest.mark.parametrize("batch, grad, gather, refused", [(4, "bf16", "fp32", True), (4, "fp16", "fp32", True),
                                                          (8, "bf16", "fp32", False), (4, "fp32", "fp32", False),
                                                          (4, "bf16", "fp16", False)])
def test_run_refuses_a_narrower_reduce_on_one_pipelined_microbatch_E703(batch, grad, gather, refused):
    """Drawn by tests/property/test_check_runs.py's ranks (seed 23): `grad_dtype: bf16` beside ZeRO-2 gathering the
    fp32 weights as they are, under torch's pipeline stages with one microbatch a step, checked ok and `run` stopped
    at the first backward ("FSDP reduce-scatter expects uniform gradient dtype but got {bf16, fp32}"): torch's stage
    runs the backward without FSDP2's reduction and reduces by hand after it, and a parameter whose gradient came after
    its group's hook keeps the weights' dtype. Two microbatches, one dtype, or a 16-bit gather run (each ran)."""
    text = _ONE_MICROBATCH.replace("BATCH", str(batch)).replace("GRAD", grad).replace("GATHER", gather)
    codes = [d.code for d in api.run_refusals(api.select_plan(api.loads(text, path="p.plan")))]
    assert codes == (["E703"] if refused else [])


def test_a_wider_reduce_of_16_bit_weights_on_one_pipelined_microbatch_runs():
    """bf16 weights gathered as they are and reduced in fp32 (the default grad_dtype) at one microbatch a step run (the
    mismatch E703 refuses is a narrower reduce of fp32 weights only)."""
    text = _ONE_MICROBATCH.replace("BATCH", "4").replace("precision: fp16, grad_dtype: GRAD",
                                                        "precision: bf16, param_dtype: bf16").replace("GATHER", "bf16")
    assert api.run_refusals(api.select_plan(api.loads(text, path="p.plan"))) == []
