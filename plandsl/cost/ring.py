"""Ring attention on one context-parallel rank, step by step: the kernels, merges and accumulations each step runs
beyond one fused attention kernel, and the K/V and dK/dV traffic around the ring (`context = ring over cp`).

Stage: cost model. Contract: `estimate_ring(model, work, device, links, share, efficiency)` returns a `Ring`: the
seconds its steps add to the layer's forward and backward over the one kernel `cost.compute` prices, the exposed
communication, and the bytes sent. Pure; counted from the implementations' code, not fitted (docs/cost-model.md).

Both implementations load-balance a causal mask the same way (each rank holds sequence chunks r and 2cp - 1 - r of
2cp; torch's `_templated_ring_attention`, Transformer Engine's `AttnFuncWithCPAndKVP2P`): step 0 runs the rank's
own queries against its own keys under the causal mask; each later step one unmasked kernel, either all its
queries against the first half of the arriving chunk (the keys of a lower rank) or the second half of its queries
against the whole chunk (a higher rank's), the same FLOPs. `RING_STEPS` holds those shapes.
"""
from __future__ import annotations

from dataclasses import dataclass

from plandsl import ir
from plandsl.cost.comm import GroupLinks, beside, collective_seconds
from plandsl.cost.compute import (Efficiency, Work, attention_core_seconds, causal_fraction, device_efficiency,
                                  rank_attention)
from plandsl.ir.layers import attention_widths


@dataclass(frozen=True, slots=True)
class Step:
    """One kernel of a ring step on a rank: the fractions of the rank's queries and of one rank's key chunk it
    reads, and whether the causal mask applies (only step 0, the rank's own chunk pair)."""

    queries: float
    keys: float
    causal: bool = False


FIRST = Step(1.0, 1.0, causal=True)
LOWER = Step(1.0, 0.5)   # keys from a lower rank: all queries, the chunk's first half (torch: `i <= rank`)
HIGHER = Step(0.5, 1.0)  # keys from a higher rank: the second half of the queries, the whole chunk (`partial`)
RING_STEPS = (LOWER, HIGHER)
"""The two kernels a later step runs, one per rank side. The backward exchanges dK/dV every step (a collective over
the ring), so each step lasts as long as its slower side; the forward's last rank takes `LOWER` at every step, so
the per-step maximum is that rank's whole forward as well."""


@dataclass(frozen=True, slots=True)
class Merge:
    """Bytes per element a ring implementation moves beyond its kernels (`merge_bytes`). Forward: `out` per element
    of a later step's output, `out_partial` per element of the rank's whole output when a step writes only its
    second half (`HIGHER`), `kv_step` per element of the rank's K and V at every step but the last, `fixed_out` and
    `fixed_kv` once per pass. Backward (step 0 included): `dq` and `dkv` per element of the step's dQ and of its dK,
    dV, `grad_partial` per element of the whole buffer a step updates only half of (dQ on the `HIGHER` side, dK and
    dV on the `LOWER` side), `send_dkv` per element of dK and dV at every step, `kv_step` and `fixed_kv` as forward,
    and `fixed_dq`, `fixed_dkv` once per pass."""

    out: float
    out_partial: float
    kv_step: float
    fixed_out: float
    fixed_kv: float
    dq: float
    dkv: float
    grad_partial: float
    send_dkv: float
    fixed_dq: float
    fixed_dkv: float


def merge_bytes(implementation: str, kernels: ir.Kernels, e: float) -> Merge:
    """What each implementation's code moves beyond its kernels, per element (`Merge`; `e`: the activations' bytes).

    `torch` (torch.distributed.tensor.experimental's `context_parallel`: `_templated_ring_attention`, `_SDPAMerger`,
    `_templated_ring_attention_backward`, with `convert_to_f32` and load balance on, the same code from torch 2.6 to
    2.13), op by op (`kernels: eager`): each later step converts its output to fp32 (read e, write 4) and merges it,
    `out - sigmoid(lse_i - lse) * (out - out_i)`: a subtraction (read 8, write 4), a product (read 4, write 4), a
    subtraction (read 8, write 4): 36 + e; a `partial` step then rebuilds the whole output with `torch.cat` (read 4,
    write 4). Step 0 converts its output (e + 4), the end casts it back (4 + e). K and V are made contiguous (read e,
    write e) and, at every step but the last, concatenated for the rotater (read e, write e; the all-gather uses the
    first). Backward: dQ, dK and dV start as fp32 zeros (write 4) and end cast to 16 bits (read 4, write e); each step
    adds the kernel's 16-bit gradients into fp32 (read 4 + e, write 4), where only half is updated through
    `_partial_update`'s `torch.cat` (read 4, write 4 of the whole), and concatenates dK and dV into the fp32 buffer it
    sends (read 4, write 4). Compiled (`kernels: fused`: torch.compile traces the ring through DTensor's dispatch,
    the reason for `_maybe_wait`), inductor fuses each step's pointwise ops into one kernel: a merge or an
    accumulation reads the fp32 buffer and the step's 16-bit result and writes fp32 (8 + e), into the send buffer
    directly; a half update copies the other half (read 4, write 4 of half the whole); the conversions, the zeros and
    the all-gather's unused concatenations go, the first one stays.

    `te` (Transformer Engine's `AttnFuncWithCPAndKVP2P`, Megatron-Core's `--cp-comm-type p2p`): K and V stacked into
    one send buffer once per pass (read e, write e); the first step's output scaled into the result (read e, write e),
    then one fused correction per step (`flash_attn_fwd_out_correction`, jit-fused) that adds the step's output,
    scaled by its log-sum-exp correction, into it (read 2e, write e); backward, each step adds its dQ and its dK, dV
    into 16-bit buffers (read 2e, write e), which go round the ring in 16 bits."""
    if implementation == "te":
        return Merge(out=3 * e, out_partial=0.0, kv_step=0.0, fixed_out=2 * e, fixed_kv=2 * e,
                     dq=3 * e, dkv=3 * e, grad_partial=0.0, send_dkv=0.0, fixed_dq=0.0, fixed_dkv=0.0)
    if kernels is ir.Kernels.eager:
        return Merge(out=36 + e, out_partial=8.0, kv_step=2 * e, fixed_out=(e + 4) + (4 + e), fixed_kv=2 * e,
                     dq=8 + e, dkv=8 + e, grad_partial=8.0, send_dkv=8.0, fixed_dq=4 + (4 + e), fixed_dkv=4 + (4 + e))
    return Merge(out=8 + e, out_partial=4.0, kv_step=0.0, fixed_out=0.0, fixed_kv=2 * e,
                 dq=8 + e, dkv=8 + e, grad_partial=4.0, send_dkv=0.0, fixed_dq=0.0, fixed_dkv=0.0)


@dataclass(frozen=True, slots=True)
class Ring:
    """What the ring adds to one layer per microbatch on one rank over the single fused kernel `cost.compute` prices:
    compute seconds (forward; backward, its rerun not in it) and exposed communication, and the bytes the rank sends
    (forward pass; backward pass)."""

    forward: float
    backward: float
    forward_comm: float
    backward_comm: float
    forward_sent: float
    backward_sent: float


NO_RING = Ring(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)


def _kernel(step: Step, tokens: int, work: Work, widths: tuple[float, float, float], device: ir.DeviceType,
            efficiency: Efficiency) -> tuple[float, float]:
    """(forward, backward) seconds of one step's attention kernel: its queries against its keys (`widths`: q + o, and
    the k + v the kernel reads), at the device's attention figures (causal tiles skipped on step 0), or as a batched
    GEMM over its whole rectangle, backward twice, as `cost.compute` prices the core without them."""
    queries, keys = step.queries * tokens, step.keys * tokens
    flops = 2.0 * work.micro_batch * queries * keys * widths[0] / work.tp
    moved = work.micro_batch * (queries * widths[0] + keys * widths[1]) / work.tp * work.precision.unquantized.bytes
    fraction = causal_fraction(int(queries)) if step.causal else 1.0
    return attention_core_seconds(flops, moved, fraction, work, device, efficiency, seq=int(keys))


def single_kernel(model: ir.TransformerModel, work: Work, device: ir.DeviceType,
                  efficiency: Efficiency) -> tuple[float, float]:
    """(forward, backward) seconds of the one kernel `cost.compute` prices for the rank's attention core
    (`_transformer_layer`), which the ring's steps replace: its s/cp queries against all s keys, at the whole
    sequence's causal share (`causal_fraction(seq)`: the load-balanced chunks give every rank the same share)."""
    return attention_core_seconds(*rank_attention(attention_widths(model), work), causal_fraction(work.seq), work,
                                  device, efficiency, seq=work.seq)


def estimate_ring(model: ir.TransformerModel, work: Work, device: ir.DeviceType, links: GroupLinks,
                  share: float = 0.0, efficiency: Efficiency | None = None) -> Ring:
    """The ring's `work.cp` steps on the rank (step 0, then per later step the slower of `RING_STEPS`), each kernel
    priced on its own, plus what the implementation moves (`merge_bytes`), less the one kernel `cost.compute` already
    prices (the rank's queries against all s keys at its causal share); and the traffic. `te` sends its K, V chunk on
    at every step but the last (p2p, beside that step's kernel), and in the backward K, V and the dK, dV accumulated so
    far, beside each step's kernel. `torch` (rotate method `allgather`, torchtitan's default) all-gathers K and V once
    per pass, beside step 0's kernel (waited for at step 1), and in the backward sends dK, dV in fp32 after every step
    (an all-to-all that moves the buffer to the next rank), beside the next step's kernel, the last one waited for
    after the loop. torch's ring takes K and V as the model hands them to SDPA: torchtitan's Llama repeats them to the
    query heads first (`repeat_kv`), so they are as wide as the queries; Transformer Engine's take the `kv_heads`."""
    cp = work.cp
    if cp <= 1:
        return NO_RING
    efficiency = efficiency or device_efficiency(device)
    torch = work.ring == "torch"
    tokens = -(-work.seq // cp)
    w = attention_widths(model)
    kv = w.q + w.o if torch and not model.latent_attention else w.k + w.v
    widths = (w.q + w.o, kv)
    e = work.precision.unquantized.bytes
    out = work.micro_batch * tokens * w.o / work.tp                # the rank's output elements (its dQ: w.q wide)
    dq = work.micro_batch * tokens * w.q / work.tp
    keys = work.micro_batch * tokens * kv / work.tp                # its K and V together
    merge = merge_bytes(work.ring, work.kernels, e)
    bandwidth = device.bandwidth
    first = _kernel(FIRST, tokens, work, widths, device, efficiency)
    forward = first[0] + (merge.fixed_out * out + merge.fixed_kv * keys + merge.kv_step * keys) / bandwidth
    backward = first[1] + (merge.fixed_dq * dq + merge.fixed_dkv * keys + merge.fixed_kv * keys + merge.kv_step * keys
                           + merge.dq * dq + (merge.dkv + merge.send_dkv) * keys) / bandwidth
    kernels_forward, kernels_backward = [first[0]], [first[1]]
    for index in range(1, cp):
        kv_step = merge.kv_step * keys if index < cp - 1 else 0.0
        sides = []
        for step in RING_STEPS:
            kernel = _kernel(step, tokens, work, widths, device, efficiency)
            merged = merge.out * step.queries * out + (merge.out_partial * out if step.queries < 1 else 0.0) + kv_step
            accumulated = (merge.dq * step.queries * dq + merge.dkv * step.keys * keys + merge.send_dkv * keys
                           + merge.grad_partial * (dq if step.queries < 1 else keys) + kv_step)
            sides.append((kernel[0], kernel[1], merged / bandwidth, accumulated / bandwidth))
        kernel_forward, kernel_backward, merged, accumulated = (max(side[i] for side in sides) for i in range(4))
        kernels_forward.append(kernel_forward)
        kernels_backward.append(kernel_backward)
        forward += kernel_forward + merged
        backward += kernel_backward + accumulated
    single = single_kernel(model, work, device, efficiency)
    chunk = keys * e  # the rank's K and V in 16 bits; dK, dV go in fp32 (torch) or 16 bits (te)
    if torch:
        gather = collective_seconds("all_gather", cp * chunk, links)
        grads = collective_seconds("p2p", keys * 4, links)
        forward_comm = beside(gather, kernels_forward[0], share)
        backward_comm = beside(gather, kernels_backward[0], share) \
            + sum(beside(grads, kernel, share) for kernel in kernels_backward[1:]) + grads
        sent = ((cp - 1) * chunk, (cp - 1) * chunk + cp * keys * 4)
    else:
        send = collective_seconds("p2p", chunk, links)
        both = collective_seconds("p2p", 2 * chunk, links)
        forward_comm = sum(beside(send, kernel, share) for kernel in kernels_forward[:-1])
        backward_comm = beside(send, kernels_backward[0], share) + beside(send, kernels_backward[-1], share) \
            + sum(beside(both, kernel, share) for kernel in kernels_backward[1:-1])
        sent = ((cp - 1) * chunk, 2 * (cp - 1) * chunk)
    return Ring(forward - single[0], backward - single[1], forward_comm, backward_comm, *sent)


__all__ = ["Step", "FIRST", "LOWER", "HIGHER", "RING_STEPS", "Merge", "merge_bytes", "Ring", "NO_RING",
           "estimate_ring"]
