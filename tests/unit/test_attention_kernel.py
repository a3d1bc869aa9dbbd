"""`attention: materialized`: the attention core of Megatron-LM before flash attention, which writes each block's
s x s scores and probabilities through memory and keeps them for the backward. The bytes against a hand count
of its kernels, the time and memory they add, the key in the language and in `generate`."""
import pytest

from plandsl import api, ir
from plandsl.cost.compute import Efficiency, Work, estimate_layer_compute, materialized_attention_bytes
from plandsl.ir.layers import layers_of
from tests.support import generated_plan

A100 = ir.DeviceType(name="a100", memory=80 * 2**30, bandwidth=2.0e12, peak={"bf16": 312e12, "fp32": 19.5e12})
EFF = Efficiency(peak_fraction=0.8, kernel_seconds=10e-6)
GPT = ir.TransformerModel(kind="gpt", name="g", layers=4, hidden=2304, heads=24, kv_heads=24, ffn_hidden=9216,
                          seq=2048, vocab=51200)
LLAMA = ir.TransformerModel(kind="llama", name="l", layers=4, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336,
                            seq=8192, vocab=128256)


def block(model):
    return next(x for x in layers_of(model) if x.kind == "block")


def test_bytes_are_the_kernels_reads_and_writes_of_each_score():
    b, s, t, cp = 2, 2048, 4, 2
    scores = b * (GPT.heads / t) * (s / cp) * s
    # forward: scores written (2), softmax read + write (4), dropout read + write + mask (5), P·V reads (2)
    # backward: P read, dP written (4), dropout backward (5), softmax backward (6), both gradient GEMMs read dS (4)
    assert materialized_attention_bytes(GPT, Work(b, s, tp=t, cp=cp)) == (scores * 13, scores * 19)
    # llama has no attention dropout; fp32 doubles the 2-byte elements
    llama_scores = 1 * LLAMA.heads * 8192 * 8192
    assert materialized_attention_bytes(LLAMA, Work(1, 8192)) == (llama_scores * 8, llama_scores * 14)
    fp32 = materialized_attention_bytes(LLAMA, Work(1, 8192, precision=ir.Precision.fp32))
    assert fp32 == (llama_scores * 16, llama_scores * 28)


def test_the_core_takes_the_flash_time_plus_the_scores_at_the_memory_bandwidth():
    work = Work(micro_batch=4, seq=2048, tp=2)
    flash = estimate_layer_compute(GPT, block(GPT), work, A100, EFF)
    kept = Work(micro_batch=4, seq=2048, tp=2, attention=ir.Attention.materialized)
    materialized = estimate_layer_compute(GPT, block(GPT), kept, A100, EFF)
    forward, backward = materialized_attention_bytes(GPT, kept)
    assert materialized.attention == pytest.approx(flash.attention + forward / 2.0e12, rel=1e-12)
    assert materialized.forward_matmul == pytest.approx(flash.forward_matmul + forward / 2.0e12, rel=1e-12)
    assert materialized.backward_matmul == pytest.approx(flash.backward_matmul + backward / 2.0e12, rel=1e-12)
    assert materialized.flops == flash.flops  # the same arithmetic
    # selective recomputation reruns exactly the core, scores included (Korthikanti et al. 2022)
    selective = estimate_layer_compute(GPT, block(GPT), Work(4, 2048, tp=2, recompute=ir.Recompute.selective,
                                                            attention=ir.Attention.materialized), A100, EFF)
    assert selective.recompute == pytest.approx(materialized.attention, rel=1e-12)
    # small models pay most: a share of the block that falls as heads·s/h² does
    big = GPT.model_copy(update={"hidden": 12288, "heads": 96, "kv_heads": 96, "ffn_hidden": 49152})
    share = {m.hidden: (estimate_layer_compute(m, block(m), kept, A100, EFF).forward
                        / estimate_layer_compute(m, block(m), work, A100, EFF).forward) for m in (GPT, big)}
    assert share[2304] > share[12288] > 1.0


PLAN = """
import "clusters/dgx_a100.plan"
plan p {
  model   = gpt(layers=4, hidden=2304, heads=24, seq=2048, vocab=51200)
  cluster = dgx_a100
  mesh    = [dp = 8]
  train   = { global_batch: 32, micro_batch: 4, recompute: %s%s }
}
"""


def _plan(recompute, extra=""):
    return api.select_plan(api.loads(PLAN % (recompute, extra), path="p.plan"))


def test_memory_keeps_the_softmax_output_and_the_dropout_unless_recomputed():
    from plandsl.cost.memory import estimate_layer_activations
    layer = block(GPT)
    for recompute, extra_bytes in (("none", 5 * 4 * 24 * 2048 * 2048), ("selective", 0), ("full", 0)):
        flash = estimate_layer_activations(_plan(recompute), layer)
        materialized = estimate_layer_activations(_plan(recompute, ", attention: materialized"), layer)
        assert materialized - flash == pytest.approx(extra_bytes, rel=1e-12), recompute  # 5as²b (Korthikanti)
    slower = api.estimate(_plan("none", ", attention: materialized")).time.step / api.estimate(_plan("none")).time.step
    assert slower > 1.1


def test_the_key_parses_dumps_only_when_set_and_rejects_other_words():
    plan = _plan("none", ", attention: materialized")
    assert plan.train.attention is ir.Attention.materialized and plan.train.model_dump()["attention"] == "materialized"
    assert "attention" not in _plan("none").train.model_dump()
    result = api.checks(PLAN % ("none", ", attention: eager"), path="bad.plan")
    assert [d.code for d in result.errors] == ["E210"]
    assert result.errors[0].hint == "valid attention kernels: flash, materialized"


def test_generate_writes_the_attention_it_was_given(tmp_path):
    text, plan = generated_plan(tmp_path, model="gpt(layers=4, hidden=2304, heads=24, seq=2048, vocab=51200)",
                                cluster="dgx_a100", global_batch=32, attention="materialized", top=1,
                                output=str(tmp_path / "p.plan"))
    assert "attention: materialized" in text and plan.train.attention is ir.Attention.materialized


def test_show_says_the_implementation_it_prices():
    """`plandsl show` names the non-default kernels, attention core and overlapped expert all-to-alls, which
    change the memory it prints and the estimate; a plan without them reads as before."""
    from plandsl.render.summary import describe_plan
    plain = describe_plan(_plan("none"))
    assert "materialized" not in plain and "eager" not in plain
    shown = describe_plan(_plan("none", ", attention: materialized, kernels: eager"))
    assert "eager kernels; materialized attention; " in shown
    from tests.unit.test_moe_cost import _plan as moe_plan
    assert "experts over ep with overlap" in describe_plan(moe_plan(overlap=True))
    assert "overlap" not in describe_plan(moe_plan())


def test_op_level_recomputation_reruns_a_materialized_core():
    """`recompute: selective_op` keeps a flash core's output, but never a materialized core's s x s scores
    (cost.memory counts none: tests/unit/test_memory.py), so the backward reruns that core, scores included."""
    def layer(attention):
        work = Work(micro_batch=4, seq=2048, tp=2, recompute=ir.Recompute.selective_op, attention=attention)
        return estimate_layer_compute(GPT, block(GPT), work, A100, EFF)
    flash, materialized = layer(ir.Attention.flash), layer(ir.Attention.materialized)
    assert materialized.recompute == pytest.approx(flash.recompute + materialized.attention, rel=1e-12)
    core_flops = 2.0 * 4 * 2048 * 2048 * 2 * 2304 / 2
    assert materialized.recompute_flops == pytest.approx(flash.recompute_flops + core_flops, rel=1e-12)
