"""`loss: megatron`: Megatron-LM's default cross entropy (`vocab_parallel_cross_entropy` over an fp32 copy of the
logits, a pass per op, beside fused blocks). The bytes against megatron-core's own ops, counted as they run, the
time they add to the head, the key in the language and in `generate --from`."""
import importlib.util

import pytest

from plandsl import api, ir
from plandsl.cost.compute import MEGATRON_LOSS_BYTES, Efficiency, Work, estimate_layer_compute
from plandsl.ir.layers import layers_of
from tests.support import generated_plan

H100 = ir.DeviceType(name="h100", memory=80 * 2**30, bandwidth=3.35e12, peak={"bf16": 989e12})
EFF = Efficiency(peak_fraction=0.75, kernel_seconds=14e-6)
GPT = ir.TransformerModel(kind="gpt", name="g", layers=24, hidden=2048, heads=16, kv_heads=16, ffn_hidden=8192,
                          seq=4096, vocab=131072)


def head(work):
    return estimate_layer_compute(GPT, next(x for x in layers_of(GPT) if x.kind == "head"), work, H100, EFF)


@pytest.mark.slow  # imports megatron-core (~4 CPU-s)
@pytest.mark.xdist_group("torch")
@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed")
def test_the_bytes_are_megatrons_ops_over_the_fp32_copy(monkeypatch):
    """megatron-core's own `vocab_parallel_cross_entropy` (tp = 1) run on bf16 logits under a dispatch mode that
    adds up, per op, the bytes it reads and writes of tensors of the logits' size: the views move nothing, the
    indexing ops (the target logit, the gradient's -1) one element per token. Per logit, beyond the GEMM's write of
    the logits: forward and backward, the latter with autograd's cast of the gradient back to 16 bits."""
    import warnings

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed"
        from megatron.core.tensor_parallel import cross_entropy
    for name, value in (("group", None), ("rank", 0), ("world_size", 1)):  # one tensor-parallel rank
        monkeypatch.setattr(cross_entropy, f"get_tensor_model_parallel_{name}", lambda value=value: value)
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda *args, **kwargs: None)  # over one rank: nothing
    tokens, vocab = 64, 4096
    logits = tokens * vocab
    moved = {"forward": 0, "backward": 0}
    indexing = {torch.ops.aten.index.Tensor, torch.ops.aten.index_put_.default}

    class Bytes(TorchDispatchMode):
        phase = "forward"

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            results = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            inputs = [t for t in tree_leaves(args) if isinstance(t, torch.Tensor)]
            storages = {t.untyped_storage().data_ptr() for t in inputs}
            view = not func._schema.is_mutable and any(t.untyped_storage().data_ptr() in storages for t in results)
            if not view and func not in indexing:  # whole tensors, read and written
                moved[Bytes.phase] += sum(t.numel() * t.element_size() for t in inputs + results if t.numel() >= logits)
            return out

    scores = torch.randn(tokens, 1, vocab, dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, vocab, (tokens, 1))
    with Bytes():
        loss = cross_entropy.vocab_parallel_cross_entropy(scores, target)
        Bytes.phase = "backward"
        loss.sum().backward()
    assert (moved["forward"] / logits, moved["backward"] / logits) == MEGATRON_LOSS_BYTES


def test_the_head_moves_them_at_the_memory_bandwidth_beside_the_same_gemm():
    standard, megatron = head(Work(1, 4096, tp=2)), head(Work(1, 4096, tp=2, loss=ir.Loss.megatron))
    logits = 4096 * 131072 / 2
    assert megatron.forward_matmul == standard.forward_matmul and megatron.flops == standard.flops
    assert megatron.forward_other == pytest.approx(logits * (2 + 38) / 3.35e12, rel=1e-12)
    assert megatron.backward_other == pytest.approx(logits * 14 / 3.35e12, rel=1e-12)
    assert standard.forward_other == pytest.approx(logits * 8 / 3.35e12, rel=1e-12)  # 16-bit write, read, fp32 write
    # 32 + 8 bytes per logit more than standard's: unsplit (tp 1), 6.4 ms per 4,096-token sequence of 131,072 words
    extra = megatron.forward + megatron.backward - standard.forward - standard.backward
    assert extra == pytest.approx(logits * (32 + 8) / 3.35e12, rel=1e-9)
    assert 2 * extra == pytest.approx(6.41e-3, rel=1e-3)
    # whatever the blocks' kernels: Megatron's loss is the same ops under eager blocks
    assert head(Work(1, 4096, tp=2, loss=ir.Loss.megatron, kernels=ir.Kernels.eager)) == megatron


PLAN = """
import "clusters/dgx_h100.plan"
plan p {
  model   = gpt(layers=4, hidden=2048, heads=16, seq=4096, vocab=131072)
  cluster = dgx_h100
  mesh    = [dp = 8]
  train   = { global_batch: 32, micro_batch: 1%s }
}
"""


def test_the_key_parses_dumps_only_when_set_shows_and_slows_the_step():
    from plandsl.render.summary import describe_plan
    plan = api.select_plan(api.loads(PLAN % ", loss: megatron", path="p.plan"))
    plain = api.select_plan(api.loads(PLAN % "", path="p.plan"))
    assert plan.train.loss is ir.Loss.megatron and plan.train.model_dump()["loss"] == "megatron"
    assert "loss" not in plain.train.model_dump()
    assert "megatron loss; " in describe_plan(plan) and "loss; " not in describe_plan(plain)
    assert api.estimate(plan).time.step > api.estimate(plain).time.step * 1.02
    assert api.estimate(plan).peak_memory_bytes < api.estimate(plain).peak_memory_bytes  # its backward works in place
    result = api.checks(PLAN % ", loss: eager", path="bad.plan")
    assert [d.code for d in result.errors] == ["E210"]
    assert result.errors[0].hint == "valid loss kernels: fused, megatron, standard"


def test_generate_from_a_partial_plan_keeps_and_prices_the_loss(tmp_path):
    partial = tmp_path / "p.plan"
    partial.write_text(PLAN.replace("  mesh    = [dp = 8]\n", "") % ", loss: megatron")
    text, plan = generated_plan(tmp_path, from_file=str(partial), pins=("dp=8",), top=1, time_limit=0)
    assert "loss: megatron" in text and plan.train.loss is ir.Loss.megatron
