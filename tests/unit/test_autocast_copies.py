"""The memory model's term for autocast's 16-bit copies of fp32 weights (`cost.memory.autocast_weight_copies`,
`expert_weight_copies`): what `plandsl run` holds at bf16/fp16 without `param_dtype` (tests/distributed/
test_autocast_copies.py holds the dense copies against a run); nothing where the weights are 16-bit already or
gathered 16-bit, so those plans' figures (every bench row's) are unchanged; and the grouped experts' copies, which
autocast does not cache, once per microbatch, measured here on one process as a pipeline runs them (one context)."""
from __future__ import annotations

import pytest

from plandsl import api
from plandsl.check.analysis import analyze
from plandsl.cost.memory import autocast_weight_copies, estimate_plan_memory, expert_weight_copies, local_numel
from plandsl.ir.layers import layers_of
from tests.support import lazy

torch = lazy("torch")

_PLAN = """import "clusters/local"
plan p {{
  model   = {model}
  cluster = localhost
  mesh    = [dp = 2] over devices[0:2]
  train   = {{ global_batch: 8, micro_batch: 2, precision: {precision}, lr: 1e-3, seed: 0{extra} }}
  data    = {data} over dp
}}
"""
GPT = "gpt(layers=2, hidden=64, heads=4, seq=16, vocab=256)"
MOE = "llama(layers=2, hidden=32, heads=4, kv_heads=2, seq=16, vocab=64, ffn=32, experts=4, top_k=2)"


def _plan(model=GPT, precision="bf16", extra="", data="zero3"):
    return api.select_plan(api.loads(_PLAN.format(model=model, precision=precision, extra=extra, data=data)))


def test_two_bytes_per_linear_element_once_and_none_where_the_weights_are_16_bit():
    plan = _plan()
    layers = layers_of(plan.model)
    # the linear weights and biases of the blocks and the head; not the embeddings' tables nor the norms
    linear = sum(p.numel for layer in layers if layer.kind in ("block", "head") for p in layer.params
                 if "norm" not in p.module)
    assert autocast_weight_copies(plan, layers) == 2 * linear
    assert autocast_weight_copies(_plan(precision="fp16"), layers) == 2 * linear
    tied = _plan(model=GPT.replace(")", ", tied=true)"))  # the head reads the embedding's table: copied on its rank
    head = next(p for layer in layers_of(tied.model) if layer.kind == "embed" for p in layer.params if "tok" in p.name)
    assert autocast_weight_copies(tied, layers_of(tied.model)) == 2 * (linear - 256 * 64 + head.numel)
    fused = _plan(extra=", loss: fused")  # the chunked loss casts the head's weight itself, chunk by chunk
    assert autocast_weight_copies(fused, layers) == 2 * (linear - 256 * 64)
    for plan in (_plan(precision="fp32"), _plan(extra=", param_dtype: bf16"), _plan(extra=", master_dtype: bf16"),
                 api.select_plan(api.loads(_PLAN.format(model=GPT, precision="bf16", extra="", data="zero3")
                                           .replace("over dp\n", "over dp with gather = bf16\n")))):
        assert autocast_weight_copies(plan, layers) == 0.0
        assert all(expert_weight_copies(plan, layer, plan.train.recompute) == 0.0 for layer in layers)


def _gathered(data: str, precision: str = "bf16", extra: str = ""):
    text = _PLAN.format(model=GPT, precision=precision, extra=extra, data="zero3").replace("zero3 over dp", data)
    if "dp2" in data:
        text = text.replace("[dp = 2] over devices[0:2]", "[dp = 2, dp2 = 2] over devices[0:4]")
    analysis = analyze(text=text)
    if [d.code for d in analysis.errors] == ["E515"]:  # a gather no stack gathers in: the checker refuses it; the
        # memory model still counts a plan built unchecked (as the search's candidates are) as run would hold it
        (plan,) = analysis.document.plans
        return plan
    return api.select_plan(api.loads(text))


@pytest.mark.parametrize("data, precision, gathered, held", [
    ("zero3 over dp with gather = bf16", "bf16", "bf16", False),  # FSDP2 gathers bf16: nothing for autocast to cast
    ("zero2 over dp with gather = fp16", "fp16", "fp16", False),
    ("hsdp over [dp, dp2] with gather = bf16", "bf16", "bf16", False),
    ("zero1 over dp with gather = bf16", "bf16", None, True),  # ZeroRedundancyOptimizer: the weights stay fp32 (E515)
    ("zero3 over dp with gather = fp32", "bf16", "fp32", True),  # gathered fp32: autocast casts them
    ("zero3 over dp with gather = fp16", "bf16", None, True),  # not the compute precision: run gathers fp32 (E515)
], ids=["zero3_bf16", "zero2_fp16", "hsdp_bf16", "zero1_bf16", "zero3_fp32", "zero3_fp16_at_bf16"])
def test_autocast_copies_are_left_out_only_where_run_gathers_in_the_compute_precision(data, precision, gathered, held):
    plan = _gathered(data, precision)
    assert plan.run_gather == (gathered and plan.data.gather)
    assert (autocast_weight_copies(plan, layers_of(plan.model)) > 0) is held


def test_16_bit_weights_gathered_fp32_are_cast_by_autocast():
    layers = layers_of(_plan().model)
    assert autocast_weight_copies(_gathered("zero3 over dp", extra=", param_dtype: bf16"), layers) == 0.0
    assert autocast_weight_copies(_gathered("zero3 over dp with gather = fp32", extra=", param_dtype: bf16"),
                                  layers) > 0


def test_the_copies_are_part_of_every_ranks_peak():
    with_copies = estimate_plan_memory(_plan())
    without = estimate_plan_memory(_plan(extra=", master_dtype: bf16, optimizer_dtype: fp32"))
    copies = autocast_weight_copies(_plan(), layers_of(_plan().model))
    assert with_copies[0].activations == pytest.approx(without[0].activations + copies)


def test_the_experts_copies_are_one_per_microbatch_and_the_dense_ones_one_per_weight():
    """Two microbatches in one autocast context, as a pipeline runs them: every copy the matmuls save, traced to
    the parameter it was cast from; kept to the end, two copies never share an address."""
    from plandsl.runtime.models import build_model, loss_fn
    from plandsl.runtime.precision import autocast, keep_weights
    plan = _plan(model=MOE)
    model = keep_weights(plan, build_model(plan.model, 0))
    names = {id(p): name for name, p in model.named_parameters()}
    saved = []

    views = ("TBackward0", "ViewBackward0", "TransposeBackward0", "SelectBackward0", "UnsafeViewBackward0")

    def through_views(node):
        while node is not None and type(node).__name__ in views:
            node = node.next_functions[0][0]
        return node

    def pack(tensor):  # a view of a cast of a view of a parameter: the copy of (a slice of) a weight
        node = through_views(tensor.grad_fn)
        if tensor.dtype == torch.bfloat16 and type(node).__name__ == "ToCopyBackward0":
            source = through_views(node.next_functions[0][0])
            if type(source).__name__ == "AccumulateGrad" and source.variable.dim() >= 2:
                saved.append((names[id(source.variable)], tensor))
        return tensor

    tokens = torch.randint(0, 64, (2, 2, 17), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), autocast(plan, "cpu"):
        for microbatch in tokens:
            loss_fn(model(microbatch[:, :-1]), microbatch[:, 1:]).backward()
    copies: dict[str, set] = {}
    for name, tensor in saved:
        copies.setdefault(name, set()).add((tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes()))
    experts = {name: found for name, found in copies.items() if ".experts." in name}
    dense = {name: found for name, found in copies.items() if ".experts." not in name}
    layers = layers_of(plan.model)
    assert set(map(len, dense.values())) == {1}, dense  # cached: one copy for both microbatches
    assert sum(size for found in dense.values() for _, size in found) == autocast_weight_copies(plan, layers)
    # each expert's slice is cast per use: a copy per expert and microbatch, all of them the per-microbatch term
    per_microbatch = sum(expert_weight_copies(plan, layer, plan.train.recompute) for layer in layers)
    assert per_microbatch == 2 * sum(local_numel(p, 1, 1) for layer in layers for p in layer.params
                                     if ".experts." in p.name)
    assert sum(size for found in experts.values() for _, size in found) == 2 * per_microbatch
