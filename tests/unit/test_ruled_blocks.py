"""A built-in block whose Megatron pair a shard rule breaks, counted as `plandsl run` lays it out
(`runtime.parallel.tensor_parallel._pair`: every member takes whole tensors and returns whole ones): which pairs are
broken (`ir.pairs`), what the block saves (`cost.memory._broken_terms`, by hand in Korthikanti's units; the trace:
tests/distributed/test_memtrace.py), its FLOPs and collectives (`cost.compute`, `cost.layer._broken_pair_comm`); and a
head or embedding whose rule keeps the vocabulary whole (`ir.pairs.table_split`)."""
from __future__ import annotations

import pytest

from plandsl import api
from plandsl.cost.memory import estimate_layer_activations
from plandsl.ir.pairs import block_pairs, broken
from plandsl.ir.placement import assign_stages

PLAN = """import "clusters/dgx_a100"
plan p {{
  model   = gpt(layers=4, hidden=512, heads=8, seq=256, vocab=8192)
  cluster = dgx_a100
  mesh    = [dp = 2, tp = 4]
  train   = {{ global_batch: 16, micro_batch: 2{train} }}
  data    = zero1 over dp
  tensor  = megatron over tp{sp}
{rules}
}}
"""
SBH = 256 * 2 * 512  # s·b·h of one microbatch; Korthikanti's terms are bytes per such element (bf16)
W1_OVER_DP = "  shard layers.*.mlp.w1 = { weight: Shard(0) @ dp, bias: Shard(0) @ dp }"


def _blocks(rules: str, sp: bool = False, train: str = "", text: str = PLAN):
    plan = api.select_plan(api.loads(text.format(rules=rules, sp=" with sequence_parallel" if sp else "",
                                                 train=train), path="p.plan"))
    assignment, _ = assign_stages(plan)
    return plan, [layer for layer in assignment.stage_layers[0] if layer.kind == "block"]


@pytest.mark.parametrize("rules, groups", [
    ("", set()),
    ("  shard layers.*.mlp.w1 = colwise over tp", set()),  # Megatron's own split, written
    ("  shard layers.*.mlp = replicate", {"mlp"}),
    (W1_OVER_DP, {"mlp"}),  # w1 whole over tp (split over dp only)
    ("  shard layers.*.mlp.w1 = { weight: Shard(0) @ tp }", {"mlp"}),  # its bias whole: PlacedParallel, not colwise
    ("  shard layers.*.attn.wq = replicate", {"attn"}),
    ("  shard layers.*.attn = replicate\n  shard layers.*.mlp.w2 = colwise over tp", {"attn", "mlp"}),
])
def test_a_pair_is_broken_where_a_rule_moves_a_member_off_megatrons_split(rules, groups):
    _, blocks = _blocks(rules)
    assert all(set(broken(block)) == groups for block in blocks)
    assert all(set(block_pairs(block)) == {"attn", "mlp"} for block in blocks)


# Korthikanti's gpt block at tp t (no sequence parallelism), bytes per s·b·h: 10 replicated (norm inputs 2 + 2, the
# q/k/v and MLP inputs 2 + 2, dropout masks 1 + 1), 8 of attention (Q 2, K 2, V 2, wo's input 2) and 16 of the MLP
# (w1's output 8, w2's input 8) split over t. A broken pair keeps the producers' outputs whole, and the consumer's
# input whole unless it is split along its input features (rowwise: its chunk), and flash attention keeps its whole
# output beside a chunking wo's chunk.
@pytest.mark.parametrize("rules, sp, terms", [
    ("", False, 10 + (8 + 16) / 4),
    ("  shard layers.*.mlp = replicate", False, 10 + 16 + 8 / 4),
    (W1_OVER_DP, False, 10 + 8 + (8 + 8) / 4),  # w1's output whole, w2 rowwise: its chunk
    ("  shard layers.*.mlp.w2 = colwise over tp", False, 10 + 16 + 8 / 4),  # w1 gathered, w2 reads it whole
    ("  shard layers.*.attn.wq = replicate", False, 10 + 6 + 2 + (2 + 16) / 4),  # Q, K, V whole; O whole, wo's chunk
    ("  shard layers.*.attn.wo = replicate", False, 10 + 8 + 16 / 4),
    # sequence parallelism: the replicated terms split along the sequence, but the gathered q/k/v and MLP inputs (4)
    ("", True, (6 + 8 + 16) / 4 + 4),
    ("  shard layers.*.mlp = replicate", True, (6 + 8) / 4 + 4 + 16),
    ("  shard layers.*.attn.wq = replicate", True, (6 + 2 + 16) / 4 + 4 + 8),
])
def test_a_broken_pair_keeps_its_tensors_whole(rules, sp, terms):
    plan, blocks = _blocks(rules, sp)
    assert all(estimate_layer_activations(plan, block) == pytest.approx(SBH * terms) for block in blocks)


@pytest.mark.parametrize("train, rules, terms", [
    # the core rerun: its output not kept beside wo's chunk
    (", recompute: selective", "  shard layers.*.attn.wq = replicate", 10 + 6 + (2 + 16) / 4),
    (", recompute: full", "  shard layers.*.mlp = replicate", 2),  # the block's input only
    # every other matmul's output: q whole (wq whole), the core's output whole; v's (wv split) its part
    (", recompute: selective_op", "  shard layers.*.attn.wq = replicate", 2 + 2 + 2 + (2 + 8) / 4),
])
def test_recomputation_keeps_what_it_keeps_of_a_broken_pair(train, rules, terms):
    plan, blocks = _blocks(rules, train=train)
    assert all(estimate_layer_activations(plan, block) == pytest.approx(SBH * terms) for block in blocks)


def _block_time(rules: str, sp: bool = False, train: str = "", text: str = PLAN):
    from plandsl.cost.estimate import pipeline_rank_device_types, plan_work, slowest
    from plandsl.cost.layer import estimate_layer_time, plan_links
    plan, blocks = _blocks(rules, sp, train, text)
    device = slowest(pipeline_rank_device_types(plan)[0], plan.train.precision)
    links = plan_links(plan)
    return estimate_layer_time(plan.model, blocks[-1], plan_work(plan), device, links), links


TOKENS, HIDDEN, FFN, TP = 512, 512, 2048, 4
ACTIVATION = TOKENS * HIDDEN * 2  # one [b, s, h] bf16 tensor
MLP_FLOPS = 2.0 * TOKENS * 2 * HIDDEN * FFN  # w1 and w2, whole
ATTENTION_FLOPS = 2.0 * TOKENS * 4 * HIDDEN * HIDDEN + 2.0 * 2 * 256 * 256 * 2 * HIDDEN  # q, k, v, o; the core (b s s (q + o))


def test_a_replicated_mlp_computes_its_whole_flops_and_has_no_tensor_parallel_pair():
    """`shard layers.*.mlp = replicate`: every tensor rank computes the whole MLP (tp x its FLOPs), and its half of the
    block has no collective without sequence parallelism (its input and output whole); the attention keeps its
    all-reduce each way."""
    from plandsl.cost.comm import collective_seconds
    default, links = _block_time("")
    ruled, _ = _block_time("  shard layers.*.mlp = replicate")
    assert ruled.flops - default.flops == pytest.approx(MLP_FLOPS * (1 - 1 / TP))
    reduce = collective_seconds("all_reduce", ACTIVATION, links.tp)
    assert default.forward_comm == pytest.approx(2 * reduce) and default.backward_comm == pytest.approx(2 * reduce)
    assert ruled.forward_comm == pytest.approx(reduce) and ruled.backward_comm == pytest.approx(reduce)
    assert ruled.moved.tensor == pytest.approx(2 * ACTIVATION)


def test_a_replicated_mlp_under_sequence_parallelism_gathers_its_input_and_its_outputs_gradient():
    """Under sequence parallelism the whole MLP reads its input gathered along the sequence (forward) and its output,
    chunked to the shards, has its gradient gathered (backward): one all-gather each way for the half, not Megatron's
    all-gather and reduce-scatter."""
    from plandsl.cost.comm import collective_seconds
    ruled, links = _block_time("  shard layers.*.mlp = replicate", sp=True)
    gather = collective_seconds("all_gather", ACTIVATION, links.tp)
    pair = gather + collective_seconds("reduce_scatter", ACTIVATION, links.tp)
    assert ruled.forward_comm == pytest.approx(pair + gather) and ruled.backward_comm == pytest.approx(pair + gather)


def test_a_whole_w1_before_a_rowwise_w2_gathers_the_hidden_gradient():
    """w1 whole over tp, w2 rowwise (`run`: w2 reads its chunk of w1's whole output): the forward keeps w2's
    all-reduce; the backward all-gathers w2's input gradient ([tokens, ffn]) where Megatron all-reduced w1's input's,
    and w1 computes its whole FLOPs."""
    from plandsl.cost.comm import collective_seconds
    ruled, links = _block_time(W1_OVER_DP)
    default, _ = _block_time("")
    reduce = collective_seconds("all_reduce", ACTIVATION, links.tp)
    assert ruled.forward_comm == pytest.approx(default.forward_comm)
    assert ruled.backward_comm == pytest.approx(reduce + collective_seconds("all_gather", TOKENS * FFN * 2, links.tp))
    assert ruled.flops - default.flops == pytest.approx(MLP_FLOPS / 2 * (1 - 1 / TP))


def test_a_replicated_attention_runs_every_head_on_every_rank():
    """`shard layers.*.attn = replicate`: q, k, v, o and the attention core whole on every tensor rank."""
    default, _ = _block_time("")
    ruled, _ = _block_time("  shard layers.*.attn = replicate")
    assert ruled.flops - default.flops == pytest.approx(ATTENTION_FLOPS * (1 - 1 / TP))
    assert ruled.moved.tensor == pytest.approx(2 * ACTIVATION)  # the MLP's all-reduces only


def _layer(rules: str, kind: str, sp: bool = False):
    from plandsl.cost.estimate import pipeline_rank_device_types, plan_work, slowest
    from plandsl.cost.layer import estimate_layer_time, plan_links
    plan = api.select_plan(api.loads(PLAN.format(rules=rules, sp=" with sequence_parallel" if sp else "", train=""),
                                     path="p.plan"))
    layers = assign_stages(plan)[0].stage_layers[0]
    layer = next(layer for layer in layers if layer.kind == kind)
    device = slowest(pipeline_rank_device_types(plan)[0], plan.train.precision)
    return plan, layers, layer, estimate_layer_time(plan.model, layer, plan_work(plan), device, plan_links(plan))


VOCAB = 8192


@pytest.mark.parametrize("rules, split", [("", 0), ("  shard head = replicate", None),
                                          ("  shard head = rowwise over tp", 1), ("  shard head = colwise over tp", 0)])
def test_a_head_whose_rule_keeps_the_vocabulary_whole_makes_the_whole_logits(rules, split):
    """`run` splits the logits over the vocabulary (torch's loss parallel) only where the head's weight is split along
    it; otherwise every rank makes all the logits, their fp32 log-probabilities (4 bytes each) and the backward's two
    fp32 temporaries of plain cross entropy (loss parallel's three over its slice)."""
    from plandsl.cost.memory import loss_backward_bytes
    from plandsl.ir.pairs import table_split
    plan, layers, head, _ = _layer(rules, "head")
    assert table_split(head) == split
    vocab = VOCAB // TP if split == 0 else VOCAB
    assert estimate_layer_activations(plan, head) == pytest.approx(2 * SBH + 4 * TOKENS * vocab)
    assert loss_backward_bytes(plan, layers) == (3 if split == 0 else 2) * 4.0 * TOKENS * vocab


def test_a_replicated_head_computes_every_logit_and_reduces_nothing():
    """A whole head: tp x the default's FLOPs on every rank, no loss-parallel reductions, no input-gradient
    reduction (without sequence parallelism nothing over the tensor axis)."""
    _, _, _, default = _layer("", "head")
    _, _, _, ruled = _layer("  shard head = replicate", "head")
    assert ruled.flops == pytest.approx(TP * default.flops) == pytest.approx(2.0 * TOKENS * VOCAB * HIDDEN)
    assert default.forward_comm > 0 and default.backward_comm > 0
    assert ruled.forward_comm == ruled.backward_comm == ruled.moved.tensor == 0.0


def test_a_rowwise_head_all_reduces_its_partial_logits():
    """A head split along the hidden dim (RowwiseParallel): its FLOPs split, its partial [tokens, vocab] logits
    all-reduced forward, its input's gradient all-gathered backward."""
    from plandsl.cost.comm import collective_seconds
    from plandsl.cost.layer import plan_links
    _, _, _, default = _layer("", "head")
    plan, _, _, ruled = _layer("  shard head = rowwise over tp", "head")
    links = plan_links(plan)
    assert ruled.flops == pytest.approx(default.flops)
    assert ruled.forward_comm == pytest.approx(collective_seconds("all_reduce", TOKENS * VOCAB * 2, links.tp))
    assert ruled.backward_comm == pytest.approx(collective_seconds("all_gather", ACTIVATION, links.tp))


@pytest.mark.parametrize("sp", [False, True])
def test_a_replicated_embedding_reduces_nothing_forward(sp):
    """A whole embedding's output is whole on every rank: no reduction of partial sums; under sequence parallelism its
    output is chunked to the shards and their gradient all-gathered in the backward."""
    from plandsl.cost.comm import collective_seconds
    from plandsl.cost.layer import plan_links
    plan, _, _, ruled = _layer("  shard embed.tok = replicate", "embed", sp)
    assert ruled.forward_comm == 0.0
    assert ruled.backward_comm == pytest.approx(
        collective_seconds("all_gather", ACTIVATION, plan_links(plan).tp) if sp else 0.0)


MLA_PLAN = PLAN.replace("gpt(layers=4, hidden=512, heads=8, seq=256, vocab=8192)",
                        "llama(layers=2, hidden=512, heads=8, seq=256, vocab=8192, q_lora_rank=128, kv_lora_rank=64, "
                        "qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=64)")


def _mla_block_time(rules: str):
    from plandsl.cost.estimate import pipeline_rank_device_types, plan_work, slowest
    from plandsl.cost.layer import estimate_layer_time, plan_links
    plan = api.select_plan(api.loads(MLA_PLAN.format(rules=rules, sp="", train=""), path="p.plan"))
    block = next(layer for layer in assign_stages(plan)[0].stage_layers[0] if layer.kind == "block")
    links = plan_links(plan)
    device = slowest(pipeline_rank_device_types(plan)[0], plan.train.precision)
    return estimate_layer_time(plan.model, block, plan_work(plan), device, links), links


def test_a_whole_latent_attention_has_no_tensor_parallel_collective():
    """Multi-head latent attention replicated over tp: its up-projections' latent gradients are whole (no all-reduce),
    wo's output whole (no reduction); the MLP keeps its all-reduce each way."""
    from plandsl.cost.comm import collective_seconds
    ruled, links = _mla_block_time("  shard layers.*.attn = replicate")
    reduce = collective_seconds("all_reduce", ACTIVATION, links.tp)
    assert ruled.forward_comm == pytest.approx(reduce) and ruled.backward_comm == pytest.approx(reduce)


def test_a_whole_query_up_projection_gathers_the_key_value_heads():
    """wq_b whole, wkv_b still split: wkv_b's output all-gathered forward ([tokens, heads x (nope + v)]) and its latent
    gradient all-reduced backward, wo (rowwise) reading its chunk: its input gradient all-gathered; no all-reduce of
    the query latent's gradient."""
    from plandsl.cost.comm import collective_seconds
    ruled, links = _mla_block_time("  shard layers.*.attn.wq_b = replicate")

    def seconds(kind, width):  # a [tokens, width] bf16 collective
        return collective_seconds(kind, TOKENS * width * 2, links.tp)

    assert ruled.forward_comm == pytest.approx(seconds("all_gather", 8 * (32 + 64)) + 2 * seconds("all_reduce", 512))
    assert ruled.backward_comm == pytest.approx(seconds("all_reduce", 64) + seconds("all_gather", 8 * 64)
                                                + seconds("all_reduce", 512))


def test_selective_op_reruns_a_whole_projection_whole():
    """`selective_op` reruns wk, wo (and SwiGLU's w3): a replicated attention's at their whole FLOPs."""
    from plandsl.cost.compute import estimate_layer_compute
    from plandsl.cost.estimate import pipeline_rank_device_types, plan_work, slowest

    def rerun(rules):
        plan, blocks = _blocks(rules, train=", recompute: selective_op")
        device = slowest(pipeline_rank_device_types(plan)[0], plan.train.precision)
        return estimate_layer_compute(plan.model, blocks[0], plan_work(plan), device).recompute_flops
    assert rerun("  shard layers.*.attn = replicate") - rerun("") == pytest.approx(
        2.0 * TOKENS * 2 * HIDDEN * HIDDEN * (1 - 1 / TP))  # wk and wo whole
    assert rerun("  shard layers.*.mlp = replicate") == pytest.approx(rerun(""))  # gpt reruns no MLP GEMM


LLAMA_PLAN = PLAN.replace("gpt(layers=4, hidden=512, heads=8, seq=256, vocab=8192)",
                          "llama(layers=4, hidden=512, heads=8, kv_heads=4, seq=256, vocab=8192)")


@pytest.mark.parametrize("sp", [False, True])
def test_selective_op_gathers_a_kept_producers_output_again(sp):
    """`selective_op` keeps w1's output (every other matmul), but where a rule breaks the MLP's pair (w3 whole) `run`
    all-gathers that output after w1, and the rerun, up to w2, gathers it again: [tokens, ffn] more bytes rerun than
    Megatron's pair, per block and microbatch (the trace: tests/distributed/test_memtrace.py's harness, +24 MiB over
    4 blocks x 4 microbatches of this plan, 1.5 MiB each)."""
    def moved(rules, train):
        return _block_time(rules, sp, train, LLAMA_PLAN)[0].moved.tensor
    w3 = "  shard layers.*.mlp.w3 = replicate"
    ffn = _blocks("", text=LLAMA_PLAN)[0].model.ffn_hidden
    rerun = moved(w3, ", recompute: selective_op") - moved("", ", recompute: selective_op")
    assert rerun - (moved(w3, "") - moved("", "")) == pytest.approx(TOKENS * ffn * 2)


SHARED_PLAN = PLAN.replace("gpt(layers=4, hidden=512, heads=8, seq=256, vocab=8192)",
                           "llama(layers=4, hidden=512, heads=8, kv_heads=4, seq=256, vocab=8192, ffn=512, experts=4, "
                           "top_k=2, shared_experts=2)")
SHARED = TOKENS * 2 * 512 * 2  # one [tokens, shared_experts x ffn] bf16 tensor


def test_replicated_shared_experts_drop_their_pairs_collectives():
    """`shard layers.*.moe.shared = replicate`: the shared experts whole on every rank inside the MoE layer, whose
    input and output are whole (`_block_tp`): without sequence parallelism their pair's all-reduce each way is gone;
    with it the MoE layer's input is gathered and its output's gradient gathered, not Megatron's pair."""
    from plandsl.cost.comm import collective_seconds
    rule = "  shard layers.*.moe.shared = replicate"
    default, links = _block_time("", text=SHARED_PLAN)
    ruled, _ = _block_time(rule, text=SHARED_PLAN)
    reduce = collective_seconds("all_reduce", ACTIVATION, links.tp)
    assert ruled.forward_comm == pytest.approx(default.forward_comm - reduce)
    assert ruled.backward_comm == pytest.approx(default.backward_comm - reduce)
    assert ruled.moved.tensor == pytest.approx(default.moved.tensor - 2 * ACTIVATION)
    default, _ = _block_time("", True, text=SHARED_PLAN)
    ruled, _ = _block_time(rule, True, text=SHARED_PLAN)
    gather = collective_seconds("all_gather", ACTIVATION, links.tp)
    scatter = collective_seconds("reduce_scatter", ACTIVATION, links.tp)
    # Megatron's pair (an all-gather and a reduce-scatter) out, the MoE layer's all-gather each way in
    assert ruled.forward_comm == pytest.approx(default.forward_comm - (gather + scatter) + gather)
    assert ruled.backward_comm == pytest.approx(default.backward_comm - (gather + scatter) + gather)


def test_full_recomputation_reruns_broken_shared_experts_up_to_their_consumer():
    """Full recomputation reruns a block under torch's checkpoint, which stops once it has remade what the backward
    needs; the MoE layer runs its shared experts last, so where a rule breaks their pair (w1 whole, w3 colwise, w2
    rowwise) the rerun gathers the layer's input and w3's output again, not w2's reduction (forked gloo ranks, a llama
    with 4 experts and one shared at tp 2 with sequence parallelism: per block and microbatch the same collectives
    rerun as with the pair intact but w3's all-gather). Against Megatron's intact pair, whose reentrant rerun the
    count keeps (an all-gather and a reduce-scatter): one [b, s, h] less, w3's [tokens, shared x ffn] more (the
    consumer's reduction was rerun before: [b, s, h] more)."""
    rule = "  shard layers.*.moe.shared.w1 = replicate"

    def rerun(rules):
        full, _ = _block_time(rules, True, train=", recompute: full", text=SHARED_PLAN)
        none, _ = _block_time(rules, True, text=SHARED_PLAN)
        return full.moved.tensor - none.moved.tensor
    assert rerun(rule) - rerun("") == pytest.approx(SHARED - ACTIVATION)  # w3's output gathered whole


def test_a_whole_shared_w1_gathers_the_shared_width():
    """`shard layers.*.moe.shared.w1 = replicate`: w3 stays colwise, so its output ([tokens, shared_experts x ffn])
    is all-gathered for the whole gate, and w2 (rowwise) reads its chunk: its input's gradient all-gathered back."""
    from plandsl.cost.comm import collective_seconds
    default, links = _block_time("", text=SHARED_PLAN)
    ruled, _ = _block_time("  shard layers.*.moe.shared.w1 = replicate", text=SHARED_PLAN)
    gather = collective_seconds("all_gather", SHARED, links.tp)
    assert ruled.forward_comm == pytest.approx(default.forward_comm + gather)
    assert ruled.backward_comm == pytest.approx(default.backward_comm + gather)
    assert ruled.moved.tensor == pytest.approx(default.moved.tensor + 2 * SHARED)


MTP_PLAN = PLAN.replace("gpt(layers=4, hidden=512, heads=8, seq=256, vocab=8192)",
                        "llama(layers=4, hidden=512, heads=8, kv_heads=4, seq=256, vocab=8192, mtp=2)")


@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("group", ["attn", "mlp", "mlp.w3"])
def test_a_rule_on_a_multi_token_prediction_block_is_priced_as_on_a_block(group, sp):
    """`run` lays out a multi-token prediction depth's block (`mtp.N.block`) as a block (`_block_tp`), so a rule that
    breaks one of its pairs costs the head (which runs the depths, `cost.layer.mtp_time`) what the same rule costs the
    last block (`ir.pairs.mtp_blocks`): its FLOPs, collectives and activations, once per depth it reaches."""
    from plandsl.cost.estimate import pipeline_rank_device_types, plan_work, slowest
    from plandsl.cost.layer import estimate_layer_time, plan_links

    def figures(rules, kind):
        plan = api.select_plan(api.loads(MTP_PLAN.format(rules=rules, sp=" with sequence_parallel" if sp else "",
                                                         train=""), path="p.plan"))
        layer = [layer for layer in assign_stages(plan)[0].stage_layers[0] if layer.kind == kind][-1]
        device = slowest(pipeline_rank_device_types(plan)[0], plan.train.precision)
        time = estimate_layer_time(plan.model, layer, plan_work(plan), device, plan_links(plan))
        return (time.flops, time.forward_comm, time.backward_comm, time.moved.tensor,
                estimate_layer_activations(plan, layer))

    def delta(rules, kind):
        return [ruled - default for ruled, default in zip(figures(rules, kind), figures("", kind))]
    block = delta(f"  shard layers.3.{group} = replicate", "block")
    assert block[0] > 0
    assert delta(f"  shard mtp.*.block.{group} = replicate", "head") == pytest.approx([2 * d for d in block])
    assert delta(f"  shard mtp.1.block.{group} = replicate", "head") == pytest.approx(block)
