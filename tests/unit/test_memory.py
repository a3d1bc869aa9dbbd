"""Memory model: ZeRO's worked example, Korthikanti's activation table, in-flight microbatches."""
import pytest

from plandsl import ir
from plandsl.cost.memory import (autocast_weight_copies, estimate_layer_activations, estimate_memory, gathered_bytes,
                                 head_inflight, held_stages, inflight_microbatches, optimizer_bytes_per_param,
                                 unit_moments, zero_one_elements)
from plandsl.schedules.generators import generate
from plandsl.schedules.simulate import simulate
from plandsl.ir.layers import layers_of, param_count


def cluster(devices):
    device = ir.DeviceType(name="d", memory=80 * 2**30, bandwidth=2e12, peak={"bf16": 312e12})
    node = ir.NodeType(name="n", device=device, devices=8,
                       link=ir.Link(bandwidth=300e9, latency=2e-6))
    return ir.Cluster(name="c", groups=(ir.NodeGroup(node=node, count=max(1, devices // 8)),))


def plan(model, axes, *, data=None, tensor=None, stages=None, experts=None, context=None, schedule=None,
         precision="bf16", recompute="none", optimizer="adam", micro_batch=1, global_batch=64):
    mesh = ir.Mesh(axes=tuple(ir.Axis(name=n, size=s) for n, s in axes))
    return ir.Plan(name="p", model=model, cluster=cluster(mesh.size), mesh=mesh,
                   train=ir.Training(global_batch=global_batch, micro_batch=micro_batch,
                                     precision=precision, recompute=recompute, optimizer=optimizer),
                   data=data, tensor=tensor, stages=stages, experts=experts, context=context, schedule=schedule)


GPT3 = ir.TransformerModel(kind="gpt", name="g", layers=96, hidden=12288, heads=96, kv_heads=96,
                           ffn_hidden=4 * 12288, seq=2048, vocab=51200)
GPT2_SMALL = ir.TransformerModel(kind="gpt", name="g", layers=12, hidden=768, heads=12,
                                 kv_heads=12, ffn_hidden=3072, seq=1024, vocab=50257,
                                 tied_embeddings=True)


# ---- ZeRO (Rajbhandari et al. 2020, Figure 1: 7.5B params, N_d = 64, Adam, fp16) ------------
# The paper counts Megatron's layout, 2 + 2 + 12 bytes per parameter: 120, 31.4, 16.6, 1.9 GB. The
# interpreter keeps fp32 parameters and gradients and Adam's m and v, 4 + 4 + 8 (cost.memory.STATE_BYTES):
# the same 120 GB replicated and 1.9 GB under ZeRO-3, but ZeRO-1 shards 8 bytes, not 12: (4 + 4)Ψ + 8Ψ/64 =
# 60.9 GB. Its ZeRO-2 (FSDP2 without resharding after the forward, `cost.memory.gathers_whole`) keeps all 16
# bytes sharded at rest, 1.9 GB, and gathers the parameters whole for the step: 4Ψ more, where the paper's
# ZeRO-2 keeps them whole throughout (4Ψ + 12Ψ/64 = 31.4 GB stored, 0.5 GB less than the interpreter holds).
@pytest.mark.parametrize("kind, gigabytes", [
    ("replicate", 120.0), ("zero1", 60.9), ("zero2", 1.9), ("zero3", 1.9)])
def test_zero_paper_example(kind, gigabytes):
    model = ir.CustomModel(kind="custom", name="c", layers=(
        ir.CustomLayer(name="all", params=7_500_000_000, flops=0, activations=0, output=1),))
    p = plan(model, [("dp", 64)], data=ir.DataParallel(kind=kind, axes=("dp",)), precision="fp16")
    [estimate] = estimate_memory(p, [layers_of(model)], [[0]], [1])
    states = estimate.params + estimate.grads + estimate.optimizer
    # The paper's figure counts the shards; ZeRO-2/3 also hold the unit being reduced and gathered, fp32.
    unit = 7_500_000_000 * 4
    gathered = {"zero2": (unit, unit), "zero3": (unit, unit)}.get(kind, (0, 0))
    assert gathered_bytes(p, layers_of(model)) == gathered
    assert (estimate.gathered_params, estimate.gathered_grads) == gathered
    assert (states - sum(gathered)) / 1e9 == pytest.approx(gigabytes, rel=0.02)
    assert estimate.stored_states == pytest.approx(states - sum(gathered)) and estimate.states == states
    assert estimate.activations == 0 and estimate.other == 0
    assert estimate.to_json()["total"] == estimate.total == states


@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp32"])
def test_states_are_fp32_whatever_the_precision(precision):
    """The interpreter autocasts the compute and keeps fp32 parameters, gradients and Adam states."""
    model = ir.CustomModel(kind="custom", name="c", layers=(
        ir.CustomLayer(name="all", params=1000, flops=0, activations=0, output=1),))
    for optimizer, states in (("adam", 8), ("sgd", 4)):
        p = plan(model, [("dp", 1)], precision=precision, optimizer=optimizer)
        [estimate] = estimate_memory(p, [layers_of(model)], [[0]], [1])
        assert (estimate.params, estimate.grads, estimate.optimizer) == (4000, 4000, 1000 * states)


def test_zero1_partitions_whole_tensors_like_the_interpreter():
    """ZeRO-1 gives each tensor whole to one data rank (runtime.zero.assign, torch's
    ZeroRedundancyOptimizer): the estimate is the most loaded rank's share, not 1/N_d."""
    from plandsl.runtime.parallel.zero import assign
    p = plan(GPT2_SMALL, [("dp", 16)], data=ir.DataParallel(kind="zero1", axes=("dp",)), optimizer="adam")
    layers = layers_of(GPT2_SMALL)
    [estimate] = estimate_memory(p, [layers], [[0]], [1])
    sizes = [param.numel for layer in layers for param in layer.params]
    load = [0] * 16
    for size, owner in zip(sizes, assign(sizes, 16)):
        load[owner] += size
    assert estimate.optimizer == 8 * max(load) > 8 * sum(sizes) / 16
    assert zero_one_elements(sizes, 16) == max(load)
    assert zero_one_elements([5, 3], 4) == 5 and zero_one_elements([5, 3], 1) == 8 and zero_one_elements([], 3) == 0


def test_hsdp_shards_over_last_axis_only():
    model = ir.CustomModel(kind="custom", name="c", layers=(
        ir.CustomLayer(name="all", params=8_000, flops=0, activations=0, output=1),))
    p = plan(model, [("replicas", 4), ("shard", 8)],
             data=ir.DataParallel(kind="hsdp", axes=("replicas", "shard")))
    [estimate] = estimate_memory(p, [layers_of(model)], [[0]], [1])
    gathered = 8_000 * 4  # the one unit, gathered whole (parameters) and reduced whole (gradients), fp32
    assert (estimate.params, estimate.grads, estimate.optimizer) == (4000 + gathered, 4000 + gathered, 8000)


def test_optimizer_bytes():
    """The interpreter's optimizers (runtime.optim): AdamW's m and v, SGD's momentum buffer, fp32."""
    assert optimizer_bytes_per_param(ir.Optimizer.adam) == 8
    assert optimizer_bytes_per_param(ir.Optimizer.sgd) == 4


def test_tensor_parallel_shards_only_sharded_params():
    t = 4
    p = plan(GPT2_SMALL, [("tp", t)], tensor=ir.TensorParallel(axis="tp"))
    [estimate] = estimate_memory(p, [layers_of(GPT2_SMALL)], [[0]], [0])
    h, f, v, L = 768, 3072, 50257, 12
    replicated = L * (4 * h + h + h) + 2 * h + 1024 * h  # norms, wo/w2 biases, final norm, positions
    sharded = L * (4 * h * h + 3 * h + 2 * h * f + f) + v * h
    assert replicated + sharded == param_count(GPT2_SMALL)
    expected = replicated + sharded // t + (-(-v // t) * h - v * h // t)  # vocab rounds up
    assert estimate.params == 4 * expected and estimate.optimizer == 8 * expected


def test_expert_params_divided_by_ep():
    model = ir.TransformerModel(kind="llama", name="m", layers=1, hidden=64, heads=4, kv_heads=4,
                                ffn_hidden=128, seq=16, vocab=100, experts=8, top_k=2)
    dense = plan(model, [("dp", 4)], data=ir.DataParallel(kind="replicate", axes=("dp",)))
    split = plan(model, [("ep", 4)], experts=ir.ExpertParallel(axis="ep"))
    [a] = estimate_memory(dense, [layers_of(model)], [[0]], [0])
    [b] = estimate_memory(split, [layers_of(model)], [[0]], [0])
    experts = 3 * 8 * 64 * 128
    # `replicate`'s copy of the expert-parallel model's other parameters (its experts, replicated over no other axis,
    # are left to themselves: `cost.memory.replicate_copy_bytes`); none for DDP's plain ones
    assert a.gathered_params == 0 and b.gathered_params == 4 * (sum(x.param_count for x in layers_of(model)) - experts)
    assert (a.params - a.gathered_params) - (b.params - b.gathered_params) == 4 * (experts - experts // 4)


def test_pipeline_ranks_hold_their_layers_and_a_tied_head_copy():
    layers = layers_of(GPT2_SMALL)
    stage_layers = [layers[:7], layers[7:]]
    p = plan(GPT2_SMALL, [("pp", 2)], stages=ir.Stages(axis="pp"))
    first, last = estimate_memory(p, stage_layers, [[0], [1]], [2, 1])
    embed = 50257 * 768
    held = [sum(layer.param_count for layer in stage) for stage in stage_layers]
    assert first.params == 4 * held[0]
    assert last.params == 4 * (held[1] + embed)  # the tied head keeps its own copy


# ---- ZeRO-2/3: the units held unsharded while gathering and reducing ----------------------
GPT3_BLOCK = 12 * 12288**2 + 13 * 12288  # QKV, out, MLP weights and biases, two LayerNorms


@pytest.mark.parametrize("kind, params_units, grads_units", [("zero3", 2, 2), ("zero2", 3, 2), ("zero1", 0, 0)])
def test_fsdp_gathers_two_units(kind, params_units, grads_units):
    """ZeRO-3 gathers two units' parameters at a time; ZeRO-2 (FSDP2 without resharding after the forward) keeps
    every unit's whole from its forward to its backward, beside the shards; both reduce two units' gradients."""
    layers = layers_of(GPT3)
    stage = [layers[1], layers[2], layers[3]]  # three blocks: the current one and the prefetched one
    p = plan(GPT3, [("dp", 8)], data=ir.DataParallel(kind=kind, axes=("dp",)))
    assert layers[1].param_count == GPT3_BLOCK
    assert gathered_bytes(p, stage) == (4 * params_units * GPT3_BLOCK, 4 * grads_units * GPT3_BLOCK)
    [estimate] = estimate_memory(p, [stage], [[0]], [0])
    shard = -(-3 * GPT3_BLOCK // 8)
    expected_params = 4 * (shard if kind != "zero1" else 3 * GPT3_BLOCK) + 4 * params_units * GPT3_BLOCK
    assert estimate.params == expected_params


def test_fsdp_root_unit_is_embedding_norm_and_head():
    # A rank with the embedding, one block, the final norm and the head: two units, root and block.
    layers = layers_of(GPT3)
    h, v, s = 12288, 51200, 2048
    p = plan(GPT3, [("dp", 8), ("tp", 8)], data=ir.DataParallel(kind="zero3", axes=("dp",)),
             tensor=ir.TensorParallel(axis="tp"))
    stage = [layers[0], layers[1], layers[-2], layers[-1]]
    # tp 8 splits the vocabulary and the blocks' heads/ffn dims, not positions, norms or row biases.
    block_local = (12 * h * h) // 8 + (3 * h + 4 * h) // 8 + 6 * h
    root_local = 2 * (v // 8) * h + s * h + 2 * h
    embed_local = (v // 8) * h + s * h  # its gradients made after the block's backward, when the block's are reduced
    # the parameters of both gathered in the block's backward, the gradients of the head, the norm and the block; or,
    # at the embedding's backward, the root's gradients beside the one over the whole vocabulary that torch's tensor
    # parallel embedding makes (`whole_vocab_gradient_moment`), the larger here
    assert gathered_bytes(p, stage) == (4 * (root_local + block_local),
                                        max(4 * (root_local - embed_local + block_local), 4 * (root_local + v * h)))
    # at the loss's backward the root twice (gathered again for the head's backward: the all-gather's output beside
    # the parameters copied out of it) once torch's loss parallel has freed its three fp32 temporaries of the
    # vocabulary-sharded logits but the logits' gradient (fp32, and its bf16 copy), and the fp32 log-probabilities the
    # cross entropy saved (the head's 4sbV/t)
    released = (3 * 4 + 4 - 4 - 2) * s * (v // 8)
    assert unit_moments(p, stage) == (4 * (2 * root_local + block_local) - released,
                                      max(4 * (2 * root_local - embed_local + 2 * block_local),
                                          4 * (2 * root_local + block_local + v * h)))


def test_chimera_ranks_hold_two_stages():
    model = ir.TransformerModel(kind="llama", name="m", layers=4, hidden=64, heads=4, kv_heads=4,
                                ffn_hidden=128, seq=16, vocab=100)
    layers = layers_of(model)
    stage_layers = [layers[:2], layers[2:3], layers[3:4], layers[4:]]  # embed+block, block, block, block+norm+head
    p = plan(model, [("pp", 4)], stages=ir.Stages(axis="pp"),
             schedule=ir.ScheduleRef(name="chimera"), global_batch=8)
    assert held_stages(p, [[0], [1], [2], [3]]) == [(0, 3), (1, 2), (1, 2), (0, 3)]
    estimates = estimate_memory(p, stage_layers, [[0], [1], [2], [3]], [1, 1, 1, 1])
    held = [sum(layer.param_count for layer in stage_layers[a] + stage_layers[b]) for a, b in ((0, 3), (1, 2))]
    assert [e.params for e in estimates] == [4 * held[0], 4 * held[1], 4 * held[1], 4 * held[0]]
    assert [e.optimizer for e in estimates] == [8 * held[0], 8 * held[1], 8 * held[1], 8 * held[0]]
    one_pipeline = plan(model, [("pp", 4)], stages=ir.Stages(axis="pp"), schedule=ir.ScheduleRef(name="1f1b"))
    assert held_stages(one_pipeline, [[0], [1], [2], [3]]) == [(0,), (1,), (2,), (3,)]


@pytest.mark.parametrize("p", [2, 4, 6, 8])
def test_inflight_chimera_matches_its_simulated_schedule(p):
    # In units of the rank's two stages: the simulated count of stage-microbatches, halved.
    for m in (p, 2 * p):
        simulated = [r.peak_inflight_microbatches for r in simulate(generate("chimera", p, m)).ranks]
        assert inflight_microbatches("chimera", p, m, 1) == [count / 2 for count in simulated]
    # Li & Hoefler 2021, Table 2: (p/2 + 1) stage-microbatches on the end ranks, p in the middle.
    counts = inflight_microbatches("chimera", p, p, 1)
    assert 2 * counts[0] == p // 2 + 1 and 2 * max(counts) == p


# ---- activations (Korthikanti et al. 2022, Table 2) --------------------------------------
S, B, H, A = 2048, 1, 12288, 96
SBH = S * B * H


@pytest.mark.parametrize("t, sequence_parallel, recompute, expected", [
    (1, False, "none", SBH * (34 + 5 * A * S / H)),
    (8, False, "none", SBH * (10 + 24 / 8 + 5 * A * S / (H * 8))),
    (8, True, "none", SBH * (34 / 8 + 5 * A * S / (H * 8))),
    (8, False, "selective", SBH * (10 + 24 / 8)),
    (8, True, "selective", SBH * 34 / 8),
    (8, False, "full", SBH * 2),
    (8, True, "full", SBH * 2 / 8),
    # selective_op: input 2 (÷t with SP), q 2, v 2, core output 2, w1's output 2·4 (÷t), with SP the
    # two reduce-scatters' outputs (2/t each); the score matrix is never kept (an SDPA kernel's, or rerun)
    (1, False, "selective_op", SBH * 16),
    (8, False, "selective_op", SBH * (2 + 14 / 8)),
    (8, True, "selective_op", SBH * 20 / 8),
])
def test_korthikanti_per_layer(t, sequence_parallel, recompute, expected):
    """The paper's table is Megatron-LM's tensor parallelism (its column-parallel layers save their sequence shard)."""
    p = plan(GPT3, [("tp", t)], recompute=recompute,
             tensor=ir.TensorParallel(axis="tp", sequence_parallel=sequence_parallel, stack="megatron"))
    block = layers_of(GPT3)[1]
    assert estimate_layer_activations(p, block, attention_matrix=True) == pytest.approx(expected, rel=1e-12)
    # Fused attention (the default) stores no score matrix: the same as selective recompute.
    if recompute == "none":
        selective = plan(GPT3, [("tp", t)], recompute="selective",
                         tensor=ir.TensorParallel(axis="tp", sequence_parallel=sequence_parallel, stack="megatron"))
        assert estimate_layer_activations(p, block) == estimate_layer_activations(selective, block)


@pytest.mark.parametrize("t, sequence_parallel, recompute, expected", [
    # torch's tensor parallelism (the default) saves the gathered q/k/v input and MLP input (2 + 2) whole under
    # sequence parallelism: the rest of Korthikanti's 34 split over t
    (8, True, "none", SBH * ((34 - 4) / 8 + 4 + 5 * A * S / (H * 8))),
    (8, True, "selective", SBH * ((34 - 4) / 8 + 4)),
    (8, True, "full", SBH * 2 / 8),  # the block's input alone, on its shard, as Megatron's
    (8, True, "selective_op", SBH * 20 / 8),  # torchtitan's op-level checkpointing reruns the gathers
    (8, False, "none", SBH * (10 + 24 / 8 + 5 * A * S / (H * 8))),  # no gather to save without sequence parallelism
])
def test_torchs_sequence_parallelism_keeps_the_gathered_inputs(t, sequence_parallel, recompute, expected):
    p = plan(GPT3, [("tp", t)], recompute=recompute, tensor=ir.TensorParallel(axis="tp", sequence_parallel=sequence_parallel))
    assert p.tensor.stack == "torch"
    assert estimate_layer_activations(p, layers_of(GPT3)[1], attention_matrix=True) == pytest.approx(expected, rel=1e-12)
    if sequence_parallel:  # the head's input: gathered for the output layer, whole; Megatron's, its shard
        head = layers_of(GPT3)[-1]
        megatron = plan(GPT3, [("tp", t)], recompute=recompute,
                        tensor=ir.TensorParallel(axis="tp", sequence_parallel=True, stack="megatron"))
        assert estimate_layer_activations(p, head) - estimate_layer_activations(megatron, head) == \
            pytest.approx(2 * SBH * (1 - 1 / t), rel=1e-12)


def test_fp32_doubles_and_context_parallel_splits_sequence():
    block = layers_of(GPT3)[1]
    base = estimate_layer_activations(plan(GPT3, [("dp", 1)]), block)
    assert estimate_layer_activations(plan(GPT3, [("dp", 1)], precision="fp32"), block) == 2 * base
    ring = plan(GPT3, [("cp", 4)], context=ir.ContextParallel(kind="ring", axis="cp"))
    assert estimate_layer_activations(ring, block) == base / 4
    # allgather keeps K and V of the whole sequence for the attention backward: 2 x 2sbh (MHA), not 2 x 2sbh/4
    gather = plan(GPT3, [("cp", 4)], context=ir.ContextParallel(kind="allgather", axis="cp"))
    assert estimate_layer_activations(gather, block) == base / 4 + 4 * (SBH / 4) * (4 - 1)
    # selective recomputation reruns the core with its gather: only the local K and V are kept
    selective = {kind: plan(GPT3, [("cp", 4)], context=ir.ContextParallel(kind=kind, axis="cp"),
                            recompute="selective") for kind in ("ring", "allgather")}
    assert estimate_layer_activations(selective["allgather"], block) == estimate_layer_activations(
        selective["ring"], block) == estimate_layer_activations(plan(GPT3, [("dp", 1)], recompute="selective"), block) / 4


def test_selective_op_keeps_llamas_w2_output_whole():
    """llama (GQA, SwiGLU) keeps w2's output too, before its reduction: whole, not ÷t; with sequence
    parallelism also the two reduce-scatters' (÷t)."""
    llama = ir.TransformerModel(kind="llama", name="l", layers=2, hidden=4096, heads=32, kv_heads=8,
                                seq=2048, vocab=128256, ffn_hidden=14336)
    block = layers_of(llama)[1]
    sbh = 2048 * 1 * 4096
    for t, sp, expected in ((1, False, 2 + 2 + 0.5 + 2 + 7 + 2), (4, False, 2 + 11.5 / 4 + 2),
                            (4, True, 2 / 4 + 11.5 / 4 + 2 + 4 / 4)):
        p = plan(llama, [("tp", t)], recompute="selective_op",
                 tensor=ir.TensorParallel(axis="tp", sequence_parallel=sp) if t > 1 else None)
        assert estimate_layer_activations(p, block) == pytest.approx(sbh * expected, rel=1e-12), (t, sp)


def test_logits_and_inflight_scale():
    layers = layers_of(GPT3)
    # Megatron-LM's tensor parallelism: no whole-vocabulary embedding gradient (torch's: a moment of its own,
    # `whole_vocab_gradient_moment`, larger than this head's loss, below)
    p = plan(GPT3, [("tp", 8)], tensor=ir.TensorParallel(axis="tp", stack="megatron"))
    head = estimate_layer_activations(p, layers[-1])
    assert head == 2 * SBH + 4 * S * B * 51200 / 8
    one, three = (estimate_memory(p, [layers], [[0]], [n])[0] for n in (1, 3))
    # the loss's backward: over vocabulary-sharded logits (tp 8) torch's loss_parallel holds three more fp32 tensors
    # of the logits' shape (test_loss_parallel_backward_holds_three_fp32_temporaries), once, whatever is in flight
    # beside them, once too, autocast's bf16 copies of the fp32 weights (`plandsl run`, test_autocast_copies.py)
    loss, copies = 12 * S * B * 51200 / 8, autocast_weight_copies(p, layers)
    assert three.activations - loss - copies == pytest.approx(3 * (one.activations - loss - copies))
    assert one.params == three.params
    without_head = estimate_memory(p, [layers[:-1]], [[0]], [1])[0]
    assert one.activations - without_head.activations == pytest.approx(head + loss + autocast_weight_copies(p, layers[-1:]))


def test_the_loss_backward_and_the_recomputed_block_are_peaks_of_different_moments():
    """A rank counts the larger of the two, not their sum: small blocks and a large vocabulary make the
    loss's backward the larger; large blocks with full recomputation the rebuilt block."""
    small = ir.TransformerModel(kind="llama", name="l", layers=4, hidden=256, heads=4, kv_heads=4,
                                ffn_hidden=512, seq=1024, vocab=128256)
    wide = ir.TransformerModel(kind="gpt", name="w", layers=4, hidden=12288, heads=96, kv_heads=96,
                               ffn_hidden=4 * 12288, seq=2048, vocab=8192)
    for model, larger in ((small, "loss"), (wide, "block")):
        layers = layers_of(model)
        full, none = plan(model, [("dp", 1)], recompute="full"), plan(model, [("dp", 1)])
        [estimate] = estimate_memory(full, [layers], [[0]], [1])
        stored = sum(estimate_layer_activations(full, layer) for layer in layers)
        block = estimate_layer_activations(none, layers[1]) - estimate_layer_activations(full, layers[1])
        loss = 8.0 * model.seq * model.vocab
        assert (loss > block) == (larger == "loss")
        assert estimate.activations == pytest.approx(stored + max(block, loss) + autocast_weight_copies(full, layers))


@pytest.mark.parametrize("recompute, kept", [("full", 2), ("selective_op", 16)])
def test_recompute_adds_one_layer_working_set(recompute, kept):
    layers = layers_of(GPT3)
    rerun = plan(GPT3, [("dp", 1)], recompute=recompute)
    none = plan(GPT3, [("dp", 1)])
    [estimate] = estimate_memory(rerun, [layers], [[0]], [1])
    stored = sum(estimate_layer_activations(rerun, layer) for layer in layers)
    working = estimate_layer_activations(none, layers[1]) - kept * SBH
    loss = 8 * S * B * 51200  # the loss's backward, a peak of another moment (the larger of the two counts)
    assert estimate.activations == pytest.approx(stored + max(working, loss) + autocast_weight_copies(rerun, layers))


# ---- in-flight microbatches --------------------------------------------------------------
def test_inflight_1f1b_and_gpipe():
    assert inflight_microbatches("1f1b", 4, 8, 1) == [4, 3, 2, 1]
    assert inflight_microbatches("1f1b", 4, 2, 1) == [2, 2, 2, 1]
    assert inflight_microbatches("zb_h1", 4, 8, 1) == [4, 3, 2, 1]
    assert inflight_microbatches("no-such-schedule", 4, 8, 1) == [4, 3, 2, 1]
    assert inflight_microbatches("gpipe", 4, 8, 1) == [8, 8, 8, 8]
    assert inflight_microbatches("zb_h2", 4, 8, 1) == [7, 5, 3, 1]


def test_inflight_interleaved_matches_megatron():
    p, v = 4, 2
    counts = inflight_microbatches("interleaved_1f1b", p, 16, v)
    # Rank 0: p·(1 + (p-1)/(p·v)) = 5.5 full-rank microbatches (Korthikanti Sec. 4.2.3), rounded up.
    assert counts == [6, 5, 4, 3]
    assert inflight_microbatches("interleaved_1f1b", p, 16, 1) == [4, 3, 2, 1]
    assert inflight_microbatches("interleaved_1f1b", p, 4, v) == [4, 4, 4, 3]


def test_rank_count_mismatch_is_an_error():
    with pytest.raises(ValueError, match="2 entries for 1 pipeline ranks"):
        estimate_memory(plan(GPT3, [("dp", 1)]), [layers_of(GPT3)], [[0]], [1, 1])


# ---- what torch's tensor parallelism and pipelining keep (torchtitan's published runs) ----------------------
# A llama small enough to count by hand: s = 1024 tokens, b = 2 sequences, h = 512, V = 32,000, t = 4.
SMALL = ir.TransformerModel(kind="llama", name="s", layers=4, hidden=512, heads=8, kv_heads=8,
                            ffn_hidden=1024, seq=1024, vocab=32000)


def _tp_plan(axes, **kwargs):
    return plan(SMALL, axes, tensor=ir.TensorParallel(axis="tp", sequence_parallel=True), micro_batch=2, **kwargs)


def test_loss_parallel_backward_holds_three_fp32_temporaries():
    """torch's cross entropy over vocabulary-sharded logits (`loss_parallel`) makes, in `_nll_loss_and_log_softmax_
    backward`, zeros_like(x), exp(x), their sum and the product with the incoming gradient: three fp32 tensors of
    the logits' shape alive at once beside the saved log-probabilities. Per rank 2 x 1024 tokens x 32,000 / 4 =
    16,384,000 logits, so 3 x 4 x 16,384,000 = 196,608,000 bytes; unsharded (tp 1) torch's log_softmax backward makes
    two, 2 x 4 x 2,048 x 32,000 = 524,288,000; Megatron's in-place loss only the 16-bit gradient, 2 x 16,384,000."""
    head = layers_of(SMALL)[-1]
    sharded = _tp_plan([("tp", 4)])
    # and autocast's bf16 copy of the head's fp32 weight (`plandsl run`, test_autocast_copies.py), 2 x 32,000 x h / t
    copy = autocast_weight_copies(sharded, [head])
    assert copy == 2 * 32_000 * SMALL.hidden / 4
    assert estimate_memory(sharded, [[head]], [[0]], [0])[0].activations == 196_608_000 + copy
    whole = plan(SMALL, [("dp", 1)], micro_batch=2)
    assert estimate_memory(whole, [[head]], [[0]], [0])[0].activations == 524_288_000 + 4 * copy
    megatron = sharded.model_copy(update={"train": sharded.train.model_copy(update={"loss": ir.Loss.megatron})})
    assert estimate_memory(megatron, [[head]], [[0]], [0])[0].activations == 32_768_000 + copy


def test_tensor_parallel_head_keeps_the_gathered_sequence():
    """Under sequence parallelism torch's `ColwiseParallel(input_layouts=Shard(1))` output layer all-gathers the
    sequence and saves that [b, s, h] input for its weight gradient: 2 bytes x 2 x 1024 x 512 = 2,097,152 bytes, not
    its quarter (Korthikanti's 2sbh/t, Megatron's re-gather); beside it the fp32 logits, 4 x 2 x 1024 x 8,000 =
    65,536,000. The final norm's input stays a shard: 2,097,152 / 4 = 524,288."""
    layers = layers_of(SMALL)
    sharded = _tp_plan([("tp", 4)])
    assert estimate_layer_activations(sharded, layers[-1]) == 2_097_152 + 65_536_000
    assert estimate_layer_activations(sharded, layers[-2]) == 524_288


def test_last_stage_holds_one_microbatch_of_its_head():
    """Interleaved 1F1B on 2 ranks with 2 virtual stages and 4 microbatches: the last rank averages
    ceil(((v - 1)·p + 1)/v) = ceil(3/2) = 2 microbatches through its layers, but its last virtual stage runs each
    microbatch's backward right after its forward, so its norm and head are held for one, its two blocks for two.
    GPipe holds every microbatch everywhere, the head's too (4). Per microbatch a block keeps its [b, s/t, h] input,
    2 x 2 x 1024 / 4 x 512 = 524,288 bytes (full recomputation), the final norm its input (the same), the head
    2,097,152 + 65,536,000 (test_tensor_parallel_head_keeps_the_gathered_sequence); the loss's backward
    3 x 4 x 2 x 1024 x 8,000 bytes once."""
    layers = layers_of(SMALL)  # embed, 4 blocks, norm, head: four stages of one block, the last with norm and head
    stage_layers = [layers[:2], layers[2:3], layers[3:4], layers[4:]]
    block, norm, head, loss = 524_288, 524_288, 2_097_152 + 65_536_000, 3 * 4 * 2 * 1024 * 8000
    for schedule, blocks_inflight, head_held in (("interleaved_1f1b", 2, 1), ("gpipe", 4, 4)):
        p = _tp_plan([("pp", 2), ("tp", 4)], stages=ir.Stages(axis="pp", virtual=2),
                     schedule=ir.ScheduleRef(name=schedule), recompute="full")
        inflight = inflight_microbatches(schedule, 2, 4, 2)
        assert inflight[1] == blocks_inflight
        last = estimate_memory(p, stage_layers, [[0, 2], [1, 3]], inflight)[1]
        copies = autocast_weight_copies(p, stage_layers[1] + stage_layers[3])  # bf16 copies of its fp32 weights, once
        assert last.activations == blocks_inflight * 2 * block + head_held * (norm + head) + loss + copies


@pytest.mark.parametrize("schedule, virtual", [("1f1b", 1), ("zb_h1", 1), ("zb_h2", 1), ("gpipe", 1), ("looped_bfs", 2),
                                               ("interleaved_1f1b", 2), ("interleaved_zero_bubble", 2), ("zbv", 2),
                                               ("dualpipev", 2)])
def test_head_inflight_is_what_the_generated_schedule_holds_on_its_last_stage(schedule, virtual):
    """`head_inflight` against the schedule tables themselves: walking the generated actions of the last stage
    (4 ranks, 8 microbatches), +1 for each forward and -1 for each backward (B, or I for the split ones), the most
    microbatches that stage holds at once is 1 for the 1F1B family, the zero-bubble and V-shape ones, and all 8 for
    GPipe and looped BFS."""
    pp, m = 4, 8
    table = generate(schedule, pp, m, virtual)
    last = pp * virtual - 1
    held = []
    for rank, actions in enumerate(table.actions):
        inflight = most = 0
        for action in actions:
            if action is None or action.stage != last:
                continue
            inflight += {"F": 1, "B": -1, "I": -1}.get(action.kind.name, 0)
            most = max(most, inflight)
        if most:
            held.append((rank, most))
    [(rank, most)] = held
    assert head_inflight(schedule, inflight_microbatches(schedule, pp, m, virtual)[rank]) == most


# torch's sequence parallelism beyond the dense block: MLA's duplicated down-projections, a MoE block's router input
MLA = ir.TransformerModel(kind="llama", name="m", layers=4, hidden=1024, heads=8, kv_heads=8, ffn_hidden=2816,
                          seq=2048, vocab=32000, q_lora_rank=768, kv_lora_rank=512, qk_rope_head_dim=64,
                          qk_nope_head_dim=128, v_head_dim=128)
MOE = ir.TransformerModel(kind="llama", name="e", layers=4, hidden=1024, heads=8, kv_heads=8, ffn_hidden=2816,
                          seq=2048, vocab=32000, experts=8, top_k=2)


def _stacks_apart(model, t=4, precision="bf16", modules=None, recompute="none"):
    """A block's activations on torch's tensor parallelism less Megatron-LM's, sequence parallelism on, per s·b·h."""
    counts = []
    for stack in ("torch", "megatron"):
        p = plan(model, [("tp", t)], recompute=recompute, precision=precision,
                 tensor=ir.TensorParallel(axis="tp", sequence_parallel=True, stack=stack))
        if modules is not None:
            p = p.model_copy(update={"train": p.train.model_copy(update={"recompute_modules": tuple(modules)})})
        block = next(layer for layer in layers_of(model) if layer.kind == "block")
        counts.append(estimate_layer_activations(p, block))
    return (counts[0] - counts[1]) / (model.seq * model.hidden) / (1 - 1 / t)


def test_torchs_mla_keeps_its_latents_whole_under_sequence_parallelism():
    """`plandsl run` keeps MLA's down-projections whole on every rank (`tensor_parallel.PAIRS`), on the gathered
    input: each latent as its norm's input and as the up-projections' input (4 bytes a latent element) and the shared
    rotary key (2) are whole, beside the gathered attention and MLP inputs (2 + 2); Megatron-LM runs them on the
    sequence shard (Korthikanti's 1/t). They were counted 1/t on torch's too: measured on `plandsl run` (fp32, tp = 4,
    a 2-block MLA llama) the run saved 1.38 of the count, 1.04 with the latents whole."""
    latents = (MLA.q_lora_rank + MLA.kv_lora_rank) / MLA.hidden
    assert _stacks_apart(MLA) == pytest.approx(4 + 4 * latents + 2 * MLA.qk_rope_head_dim / MLA.hidden, rel=1e-12)
    # `mla_up_proj` frees the up-projections' inputs (rebuilt in the backward): their whole copies too
    assert _stacks_apart(MLA, modules=("core_attn", "mla_up_proj"), recompute="selective") == \
        pytest.approx(4 + 2 * latents + 2 * MLA.qk_rope_head_dim / MLA.hidden, rel=1e-12)
    # `layernorm` frees the attention norm's output, a shard no layer saves on torch's: the gathered copy stays
    with_norm = _stacks_apart(MLA, modules=("core_attn", "layernorm"), recompute="selective")
    assert with_norm == pytest.approx(_stacks_apart(MLA, modules=("core_attn",), recompute="selective") + 2 / 4 * 4 / 3,
                                      rel=1e-12)  # Megatron's count drops its 2/t: torch's keeps its 2 whole


def test_torchs_moe_block_keeps_its_router_input_whole_in_16_bits_unless_the_moe_layer_reruns():
    """A MoE block's gathered MLP input is the router's, which stays 16-bit under FP8 (`_fp8_saved_terms`): the FP8
    saving applies to the attention's input alone (it took both); `recompute_modules: [moe]` checkpoints the MoE
    layer with its gather inside, as `mlp` does a dense one, so its input kept is the shard (it kept the gathered
    copy)."""
    assert _stacks_apart(MOE) == pytest.approx(4, rel=1e-12)
    recipe = ir.Training(global_batch=1, micro_batch=1, precision="fp8").recipe
    saving = 2 - (recipe.saved_bytes if recipe else ir.Precision.fp8.gemm_bytes)
    assert _stacks_apart(MOE, precision="fp8") == pytest.approx(4 - saving, rel=1e-12)
    assert _stacks_apart(MOE, modules=("core_attn", "moe"), recompute="selective") == pytest.approx(2, rel=1e-12)
    dense = MOE.model_copy(update={"experts": 0, "top_k": 0})
    assert _stacks_apart(dense, precision="fp8") == pytest.approx(4 - 2 * saving, rel=1e-12)
    assert _stacks_apart(dense, modules=("core_attn", "mlp"), recompute="selective") == pytest.approx(2, rel=1e-12)


# ---- torch's vocabulary-parallel embedding: its gradient over the whole vocabulary -----------------------
SMALL_LLAMA = ir.TransformerModel(kind="llama", name="m", layers=2, hidden=64, heads=4, kv_heads=4, ffn_hidden=128,
                                  seq=16, vocab=1000)


@pytest.mark.parametrize("data, pp, mtp, accumulates", [
    (None, 1, 0, True),            # no data parallelism: the `.grad` kept till the next zero_grad
    ("replicate", 1, 0, False),    # each microbatch reduces it (torch's `replicate`)
    ("zero3", 1, 0, False),        # FSDP2 reduces it after each microbatch's backward (its moment with the units)
    ("zero3", 2, 0, True),         # a pipeline's stage accumulates it till its last backward
    ("replicate", 2, 0, True),
    (None, 2, 1, True),            # and multi-token prediction's copy of the embedding on the head's stage
])
def test_torchs_tensor_parallel_embedding_gradient_is_whole_vocabulary(data, pp, mtp, accumulates):
    """Under torch's tensor parallelism every tensor rank makes the embedding's gradient over the whole vocabulary
    (DTensor's `embedding_dense_backward`: a `Partial` [vocab, hidden], traced in `plandsl run`, test_memtrace.py):
    counted beyond the vocabulary shard, with the unsharded gradients (not the stored states), where the step
    accumulates it; not under Megatron-LM's vocabulary-parallel embedding, which makes its rows' only."""
    t, v, h = 4, SMALL_LLAMA.vocab, SMALL_LLAMA.hidden
    model = SMALL_LLAMA.model_copy(update={"mtp": mtp})
    axes = ([("dp", 2)] if data else []) + ([("pp", pp)] if pp > 1 else []) + [("tp", t)]
    layers = layers_of(model)
    stage_layers = [layers[:2], layers[2:]] if pp > 1 else [layers]
    ranks = [[stage] for stage in range(len(stage_layers))]

    def counted(stack):
        p = plan(model, axes, data=ir.DataParallel(kind=data, axes=("dp",)) if data else None,
                 tensor=ir.TensorParallel(axis="tp", stack=stack), global_batch=8,
                 stages=ir.Stages(axis="pp") if pp > 1 else None,
                 schedule=ir.ScheduleRef(name="1f1b") if pp > 1 else None)
        return estimate_memory(p, stage_layers, ranks, [2, 1][:len(ranks)])

    beyond = (v - -(-v // t)) * h * 4  # fp32 gradients
    for torch_rank, megatron_rank in zip(counted("torch"), counted("megatron")):
        assert torch_rank.stored_states == megatron_rank.stored_states
        assert torch_rank.grads - megatron_rank.grads == torch_rank.gathered_grads - megatron_rank.gathered_grads
    extra = [t.grads - m.grads for t, m in zip(counted("torch"), counted("megatron"))]
    if data == "zero3" and pp == 1:  # FSDP2's units placed by moment: the gradient as the embedding's backward makes
        # it, before its reduction to the rank's rows, where that moment holds the most units (`unit_moments`)
        assert 0 < extra[0] <= v * h * 4
    else:
        assert extra[0] == (beyond if accumulates else 0)
    if len(extra) > 1:  # the head's stage: the embedding's copy, which multi-token prediction's depths embed with
        assert extra[1] == (beyond if mtp else 0)


@pytest.mark.parametrize("data", ["replicate", "zero1", "fsdp"])
def test_a_batch_shares_replica_accumulates_the_whole_vocabulary_gradient_under_every_data_kind(data):
    """With `batch_shares` every replica reduces its gradients after its last microbatch only
    (`runtime.parallel.data_parallel.gradient_sync(every_microbatch=False)`), under FSDP2 and under `replicate`, which
    replicate and zero1 run for tensor-parallel DTensor parameters: the [vocab, hidden] `Partial` gradient accumulates
    across the replica's microbatches (a trace of `[dp = 2, tp = 2]` with `batch_shares: [6, 2]` holds two at once
    under replicate and zero1 as under fsdp). The count held it for ZeRO-2/3 only."""
    from plandsl import api
    from plandsl.cost.compute import DEFAULT_EFFICIENCY
    from plandsl.cost.estimate import estimate_plan

    def counted(stack):
        document = api.loads(f"""
import "clusters/local"
plan shares {{
  model    = llama(layers=2, hidden=32, heads=4, seq=16, vocab=4096)
  cluster  = localhost x 4
  mesh     = [dp = 2, tp = 2] over devices[0:4]
  train    = {{ global_batch: 8, micro_batch: 1, precision: fp32, optimizer: adam, lr: 1e-3, seed: 0,
               batch_shares: [6, 2] }}
  data     = {data} over dp
  tensor   = megatron over tp with sequence_parallel, implementation = {stack}
}}
""")
        return estimate_plan(document.plans[0], DEFAULT_EFFICIENCY).memory[0].gathered_grads

    beyond = (4096 - 4096 // 2) * 32 * 4
    assert counted("torch") - counted("megatron") == beyond


@pytest.mark.parametrize("data, tp, stack, microbatches, peaks_before", [
    (None, 1, "torch", 1, True),         # a plain parameter's `.grad`, made by the backward
    (None, 4, "torch", 1, True),         # with the embedding's whole-vocabulary `.grad`
    ("zero3", 1, "torch", 1, False),     # FSDP2's sharded gradients, kept (`one_backward_makes_gradients`)
    ("zero1", 4, "torch", 1, True),      # `replicate`'s, over tensor-parallel DTensors
    ("replicate", 1, "torch", 1, False),  # DistributedDataParallel's buckets (plain parameters), made with it
    ("zero1", 4, "megatron", 1, False),  # Megatron-LM's gradient buffer, zeroed in place
    (None, 1, "torch", 2, False),        # the first microbatch's gradients beside the second's activations
])
def test_a_step_of_one_microbatch_peaks_before_its_backward_makes_the_gradients(data, tp, stack, microbatches,
                                                                             peaks_before):
    """`zero_grad` frees the last step's gradients at the step's start, so a step of one microbatch peaks at its
    loss's backward without any (`cost.memory.one_backward_apart`; traced, tests/distributed/test_memtrace.py): its
    total leaves out its stored gradients and a rank without data parallelism its whole-vocabulary embedding `.grad`,
    where its activations outweigh them; a step whose gradients outweigh its activations (a short sequence) keeps the
    count, which peaks after its backward."""
    from plandsl.check.memory import _parts
    from plandsl.cost.memory import whole_vocab_gradient_bytes
    axes = ([("dp", 2)] if data else []) + ([("tp", tp)] if tp > 1 else [])
    for model, outweighed in ((SMALL_LLAMA.model_copy(update={"seq": 4096}), False),
                              (SMALL_LLAMA.model_copy(update={"seq": 4, "hidden": 256, "ffn_hidden": 1024}), True)):
        p = plan(model, axes, data=ir.DataParallel(kind=data, axes=("dp",)) if data else None,
                 tensor=ir.TensorParallel(axis="tp", stack=stack) if tp > 1 else None, micro_batch=2,
                 global_batch=2 * microbatches * (2 if data else 1))
        layers = layers_of(model)
        [estimate] = estimate_memory(p, [layers], [[0]], [1])
        made = estimate.grads - estimate.gathered_grads + whole_vocab_gradient_bytes(p, layers)
        assert p.num_microbatches == microbatches and made > 0
        assert (made > estimate.activations) == outweighed
        assert estimate.apart == (made if peaks_before and not outweighed else 0)
        assert estimate.total == estimate.params + estimate.grads + estimate.optimizer + estimate.activations \
            - estimate.apart - estimate.moments  # FSDP's units by moment (`cost.memory.fsdp_apart`)
        assert estimate.to_json()["total"] == estimate.total and ("apart" in estimate.to_json()) == bool(estimate.apart)
        assert ("has not made" in _parts(estimate)) == bool(estimate.apart)  # E503's arithmetic says so


@pytest.mark.parametrize("layers, hidden, seq, devices, mesh, batch, train, body, after", [
    (2, 256, 192, 1, "dp = 1", 1, "", "", "step"),  # Adam's step beside the gradients
    (2, 256, 192, 1, "dp = 1", 1, ", optimizer_dtype: bf16", "", "kept"),  # AdamWStates' fp32 copies
    (2, 256, 128, 8, "dp = 2, tp = 4", 2, "", "  data = zero1 over dp\n  tensor = megatron over tp\n", "embedding"),
    (4, 512, 2048, 1, "dp = 1", 1, ", recompute: full", "", "rebuilt"),  # a rebuilt block beside gradients
    (2, 256, 512, 1, "dp = 1", 1, ", offload_layers: 1", "", "rebuilt"),  # activations back at the backward's end
    (2, 256, 2048, 1, "dp = 1", 1, ", loss: fused", "", "head"),  # the fused loss's backward makes the head's
])
def test_a_step_of_one_microbatch_leaves_out_no_gradient_alive_at_its_later_moments(layers, hidden, seq, devices, mesh,
                                                                                    batch, train, body, after):
    """What a step of one microbatch leaves out (`one_backward_apart`) stays within what its activations hold beyond
    the moments where its gradients are alive: the optimizer's step's temporaries (`optimizer_step_bytes`), the
    embedding's whole-vocabulary gradient at the backward's end (`whole_vocab_gradient_moment`); nothing where those
    temporaries outweigh the activations (16-bit states: fp32 copies of a [16384, 256] table's weight, its states and
    Adam's two), nor where a block is rebuilt (or offloaded activations brought back) inside the backward; nor the
    head's gradient, which a fused loss's backward makes at the peak (`fused_head_gradient_bytes`; `memtrace` cannot
    trace a fused loss). Traced, MiB (`memtrace.trace_rank`), and counted less all the gradients (now): one device
    184.9 in Adam's step, 157.5 (191.1); optimizer_dtype bf16 178.6 in Adam's step, 119.3 (157.5, the count of before:
    the optimizer's temporaries are counted nowhere else); dp 2 x tp 4 under zero1 53.8 at the embedding's backward,
    49.2 (54.6); `recompute: full` 336.5 at a rebuilt block's gelu_backward, 326.3 (394.4)."""
    from plandsl import api
    from tests.support import ONE_MICROBATCH
    from plandsl.cost.memory import (estimate_plan_memory, optimizer_step_bytes, whole_vocab_gradient_bytes,
                                     whole_vocab_gradient_moment)
    p = api.loads(ONE_MICROBATCH.format(layers=layers, hidden=hidden, seq=seq, devices=devices, mesh=mesh,
                                        batch=batch, train=train, body=body)).plans[0]
    [estimate, *_] = estimate_plan_memory(p)
    layers_ = layers_of(p.model)
    made = estimate.grads - estimate.gathered_grads + whole_vocab_gradient_bytes(p, layers_)
    assert p.num_microbatches == 1 and estimate.activations >= made  # the commit's rule left all of them out
    states = estimate.params + estimate.optimizer
    if after == "step":
        step = optimizer_step_bytes(p, [q for layer in layers_ for q in layer.params], estimate.optimizer)
        assert step >= 2 * 16384 * hidden * 4  # the CPU's: two of the [16384, hidden] tables' size at once
        assert estimate.total >= states + made + step
        from plandsl.cost.estimate import estimate_plan, format_estimate
        from plandsl.lower.units import format_bytes
        assert f"less {format_bytes(estimate.apart)} of the gradients" in format_estimate(estimate_plan(p))  # the footer
    elif after == "embedding":
        moment = whole_vocab_gradient_moment(p, layers_)
        assert moment == 16384 * hidden * 4 and estimate.total >= states + made + moment
    elif after == "head":  # `ChunkedCrossEntropy.backward`'s fp32 [16384, 256] gradient, untied or tied
        assert estimate.apart == made - 16384 * hidden * 4
        tied = p.model_copy(update={"model": p.model.model_copy(update={"tied_embeddings": True})})
        [estimate] = estimate_plan_memory(tied)
        assert estimate.apart == estimate.grads - 16384 * hidden * 4 > 0
    else:
        assert estimate.apart == 0
    assert estimate.apart < made


_MOE = ir.TransformerModel(kind="llama", name="m", layers=4, hidden=64, heads=4, kv_heads=2, ffn_hidden=128, seq=16,
                           vocab=100, experts=8, top_k=2)


@pytest.mark.parametrize("model, axes, fields", [
    (GPT2_SMALL, [("dp", 2)], {"data": ir.DataParallel(kind="zero3", axes=("dp",))}),
    (GPT2_SMALL, [("tp", 2)], {"tensor": ir.TensorParallel(axis="tp", sequence_parallel=True), "recompute": "full"}),
    (GPT2_SMALL, [("tp", 2)], {"tensor": ir.TensorParallel(axis="tp"), "recompute": "selective", "precision": "fp8"}),
    (GPT3, [("dp", 2)], {"data": ir.DataParallel(kind="zero1", axes=("dp",)), "micro_batch": 2}),
    (_MOE, [("ep", 4)], {"experts": ir.ExpertParallel(axis="ep"), "recompute": "full"}),
], ids=["zero3", "tp_sp_full", "tp_selective_fp8", "gpt3_zero1", "moe_full"])
def test_a_stage_of_one_layer_without_microbatches_in_flight_holds_its_working_set_alone(model, axes, fields):
    """The search takes a kind of layer's recompute working set as `beyond_layers` of its layer alone
    (`search.figures.Figures._activations`), for `estimate_memory`'s activations of a stage of that layer with no
    microbatch in flight, which adds 0 x its stored bytes to it: the two the same, to the bit."""
    from plandsl.cost.memory import beyond_layers
    p = plan(model, axes, **fields)
    working = {}
    for layer in {layer.kind: layer for layer in layers_of(model)}.values():
        [estimate] = estimate_memory(p, [[layer]], [[0]], [0])
        working[layer.kind] = beyond_layers(p, [[layer]])
        assert estimate.activations == working[layer.kind], layer.kind
    assert working["head"] > 0.0, working  # the loss's backward at least
