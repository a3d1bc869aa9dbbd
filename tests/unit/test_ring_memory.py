"""What torch's ring attention holds in a block's backward (`cost.memory.ring_backward_bytes`, `context = ring over cp
with implementation = torch`), counted here buffer by buffer from `_templated_ring_attention_backward`, and how a rank
keeps it beside the block its recomputation rebuilt (`cost.memory.beyond_layers`)."""
import pytest

from plandsl import api
from plandsl.cost.memory import (
    autocast_weight_copies,
    beyond_layers,
    estimate_layer_activations,
    ring_backward_bytes,
)
from plandsl.ir.layers import layers_of
from tests.support import EIGHT_GPU_NODE

E = 2  # bf16
PLAN = EIGHT_GPU_NODE + """plan p {{
  model   = llama(layers=2, hidden=1024, heads=8, kv_heads=2, seq=8192, vocab=1000)
  cluster = n
  mesh    = [cp = {cp}, tp = {tp}]
  train   = {{ global_batch: 1, micro_batch: 1, recompute: {recompute} }}
  {tensor}
  context = {context}
}}
"""


def _plan(cp=4, tp=1, recompute="full", context="ring over cp with implementation = torch"):
    tensor = "tensor = megatron over tp" if tp > 1 else ""
    return api.select_plan(api.loads(PLAN.format(cp=cp, tp=tp, recompute=recompute, tensor=tensor, context=context),
                                     path="p.plan"))


def _block(plan):
    return next(layer for layer in layers_of(plan.model) if layer.kind == "block")


@pytest.mark.parametrize("cp, tp", [(4, 1), (2, 2), (8, 1)])
def test_the_rings_backward_buffers_one_by_one(cp, tp):
    """A rank's 8192 / cp tokens; Q 8 heads x 128 = 1024 wide, K and V repeated to the query heads as torchtitan's
    Llama hands them to SDPA (`repeat_kv`: 2 K/V heads become 8), each 1024 wide; tp splits the heads."""
    tokens = 8192 // cp
    queries = tokens * 1024 // tp
    keys = 2 * tokens * 1024 // tp  # K and V together
    buffers = {
        "_AllGatherRotater._aggregated_buffer: K, V of every rank": cp * keys * E,
        "next_kv = torch.cat([key, value]) for the rotater": keys * E,
        "grad_query = zeros_like(query, dtype=float32)": 4 * queries,
        "grad_key, grad_value accumulated in fp32": 4 * keys,
        "next_grad_kv = torch.cat([grad_key, grad_value]), sent": 4 * keys,
        "permute_tensor's output: the next rank's dK, dV arriving": 4 * keys,
        "grad_query_, grad_key_, grad_value_: the step kernel's 16-bit gradients": E * (queries + keys),
    }
    plan = _plan(cp, tp)
    assert ring_backward_bytes(plan, _block(plan)) == sum(buffers.values())


def test_only_torchs_ring_over_more_than_one_rank_holds_them():
    for plan in (_plan(context="ring over cp"), _plan(context="allgather over cp"), _plan(cp=1)):
        assert ring_backward_bytes(plan, _block(plan)) == 0.0
    plan = _plan()
    assert all(ring_backward_bytes(plan, layer) == 0.0 for layer in layers_of(plan.model) if layer.kind != "block")


def test_a_rank_keeps_the_ring_beside_the_attention_half_its_recomputation_rebuilt():
    """Under full recomputation the ring's backward runs after the MLP's has freed the MLP's rebuilt tensors: the
    attention half is rebuilt, less the block input the recomputation kept. Korthikanti's attention half of a llama
    block, per token and hidden element in 16 bits: its norm's input 2, the q/k/v input 2, Q 2, the out-projection
    input 2, K and V 2 each at 256 of 1024 wide (0.5 + 0.5); 9 in all, the kept input 2. Without recomputation the
    block's own microbatch keeps all of it already: the ring alone."""
    tokens = 8192 // 4
    sbh = tokens * 1024
    full, none = _plan(), _plan(recompute="none")
    ring = ring_backward_bytes(full, _block(full))
    rebuilt_attention = (2 + 2 + 2 + 2 + 0.5 + 0.5) * sbh - 2 * sbh
    copies = autocast_weight_copies(full, [_block(full)])  # autocast's bf16 copies of the fp32 weights, held beside
    assert beyond_layers(full, [[_block(full)]]) == pytest.approx(ring + rebuilt_attention + copies, rel=1e-12)
    assert beyond_layers(none, [[_block(none)]]) == ring + copies
    # the whole block rebuilt is less here than the ring with the attention half: the larger is kept
    rebuilt = estimate_layer_activations(none, _block(none)) - estimate_layer_activations(full, _block(full))
    assert rebuilt < ring + rebuilt_attention
    te = _plan(context="ring over cp")
    assert beyond_layers(te, [[_block(te)]]) == pytest.approx(rebuilt + autocast_weight_copies(te, [_block(te)]),
                                                              rel=1e-12)


def test_the_estimate_holds_it_once_per_rank():
    torch, te = _plan(), _plan(context="ring over cp")
    more = beyond_layers(torch, [[_block(torch)]]) - beyond_layers(te, [[_block(te)]])
    [with_ring], [without] = api.estimate(torch).memory, api.estimate(te).memory
    assert with_ring.activations - without.activations == pytest.approx(more, rel=1e-9)
