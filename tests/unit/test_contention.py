"""Compute beside a collective (docs/cost-model.md, "Compute beside a collective"): a collective in flight takes the
device's `comm_share` of the computation it overlaps (NCCL: its channels' SMs), and a GEMM decomposed beside a
tensor-parallel collective re-reads its weight at no cost while each chunk has the math to hide it. Expected
figures are worked out here from the rates, not read back from the model."""
from __future__ import annotations

import pytest

from plandsl import api, ir
from plandsl.cost.comm import beside, collective_seconds
from plandsl.cost.compute import Efficiency, Work, overlap_gemms
from plandsl.cost.layer import estimate_layer_time, mesh_links
from plandsl.cost.stage import unit_pass, zero_traffic
from plandsl.ir.layers import layers_of

H100 = ir.DeviceType(name="h", memory=80 * 2**30, bandwidth=3.35e12, peak={"bf16": 989e12})


def _progress(collective: float, compute: float, share: float, step: float = 1e-4) -> float:
    """The pair's seconds by stepping time: the computation advances at 1 - share while the collective runs."""
    done, clock = 0.0, 0.0
    while done < compute - 1e-12:
        done += step * ((1 - share) if clock < collective else 1.0)
        clock += step
    return max(clock, collective)


@pytest.mark.parametrize("collective, compute, share", [(1.0, 2.0, 0.25), (4.0, 2.0, 0.25), (2.0, 1.8, 0.2),
                                                        (0.5, 3.0, 24 / 132), (1.0, 2.0, 0.0), (3.0, 2.0, 0.0)])
def test_a_collective_beside_compute_costs_its_share_of_its_own_seconds(collective, compute, share):
    """A 1 s collective beside 2 s of compute at share 1/4: for that second the compute does 0.75 s of its work, the
    other 1.25 s at full speed: 2.25 s, 0.25 more than alone. A 4 s one outlasts the slowed compute (2 / 0.75 =
    2.67 s): the pair is the collective's 4 s. Share 0 is the perfect overlap, max(0, C - X)."""
    assert compute + beside(collective, compute, share) == pytest.approx(_progress(collective, compute, share),
                                                                         abs=2e-4)
    assert beside(1.0, 2.0, 0.25) == pytest.approx(0.25) and beside(4.0, 2.0, 0.25) == pytest.approx(2.0)
    assert beside(collective, compute, 0.0) == pytest.approx(max(0.0, collective - compute))
    assert beside(0.0, compute, share) == 0.0


def test_units_computing_beside_their_neighbours_gathers_by_hand():
    """Three units of 1 s, each gathered in 0.5 s one ahead, share 0.2: the first gather is exposed (0.5), the two
    units computing beside the next gather take 0.5 at 0.8 (0.4 done) + 0.6 = 1.1 s each, the last 1.0: 3.7 s."""
    assert unit_pass([1.0] * 3, [0.5] * 3, [0.0] * 3, [1] * 3, share=0.2) == pytest.approx(0.5 + 2 * 1.1 + 1.0)
    assert unit_pass([1.0] * 3, [0.5] * 3, [0.0] * 3, [1] * 3) == pytest.approx(0.5 + 2 * 1.0 + 1.0)
    # a gather longer than the slowed unit: 2 s beside 1 s of compute (done at 1 / 0.8 = 1.25 s) waits for it
    assert unit_pass([1.0] * 2, [2.0] * 2, [0.0] * 2, [1] * 2, share=0.2) == pytest.approx(2.0 + 2.0 + 1.0)


def test_zero3s_closed_form_is_the_unit_pass_with_the_same_share():
    """u equal units one ahead: g + (u - 1)·max(c + share·g, g) + c, in the closed form and unit by unit."""
    links = mesh_links(_plan().cluster, (("dp", 16),), 0, ("dp",), ir.DataKind.zero3, None, None, None, None)
    u, c, dense, share = 8, 0.02, 8e9, 24 / 132
    stage = zero_traffic(u * c, u * c, u * c, 0.0, 1.0, 0.0, dense, 0.0, 3, 2, links, units=u, share=share)
    g = collective_seconds("all_gather", dense / u * 2, links.data)
    assert stage.forward == pytest.approx(g + (u - 1) * max(c + share * g, g) + c)
    assert stage.forward == pytest.approx(unit_pass([c] * u, [g] * u, [0.0] * u, [1] * u, share))
    perfect = zero_traffic(u * c, u * c, u * c, 0.0, 1.0, 0.0, dense, 0.0, 3, 2, links, units=u)
    assert stage.forward > perfect.forward == pytest.approx(g + (u - 1) * max(c, g) + c)


DEVICE = """\
device g {{ memory = 80 GiB; bandwidth = 2 TB/s; peak = {{ bf16: 312 TFLOP/s }}{extra} }}
"""


def test_comm_share_lowers_defaults_and_is_a_fraction():
    [device] = api.loads(DEVICE.format(extra="; comm_share = 0.1")).devices
    assert device.comm_share == 0.1 and device.contention == 0.1
    [device] = api.loads(DEVICE.format(extra="")).devices
    assert device.comm_share is None and device.contention == pytest.approx(ir.DEFAULT_COMM_SHARE)
    assert ir.DEFAULT_COMM_SHARE == pytest.approx(24 / 132)  # NCCL's 24 channels of an H100's 132 SMs
    [device] = api.loads(DEVICE.format(extra="; comm_share = 0")).devices
    assert device.contention == 0.0
    found = api.checks(DEVICE.format(extra="; comm_share = 1.5")).diagnostics
    assert [d.code for d in found] == ["E205"] and "comm_share" in found[0].message
    node = api.loads('import "clusters/dgx_a100"\nplan p { model = gpt(layers=2, hidden=64, heads=2, seq=64, '
                     'vocab=128)\n cluster = dgx_a100 x 1\n mesh = [dp = 8]\n train = { global_batch: 8 }\n'
                     ' data = zero3 over dp\n}\n').plans[0].cluster.groups[0].node
    assert node.device.contention == pytest.approx(24 / 108)  # the A100's 108 SMs


PLAN = """\
import "clusters/dgx_h100"
device h0 {{ memory = 80 GiB; bandwidth = 3350 GB/s; peak = {{ bf16: 989 TFLOP/s }}
  efficiency = {{ matmul: 0.75, kernel_latency: 0 us }}{share} }}
node n0 {{ devices = 8 x h0; link = {{ bandwidth: 450 GB/s, latency: 2 us }}; nic = {{ bandwidth: 400 GB/s }} }}
plan p {{
  model   = gpt(layers=4, hidden={hidden}, heads=128, seq=4096, vocab=32000)
  cluster = n0 x 2
  mesh    = [dp = 2, tp = 8]
  train   = {{ global_batch: {batch}, micro_batch: {micro} }}
  data    = zero3 over dp
  tensor  = megatron over tp{options}
}}
"""


def _plan(hidden=16384, options=" with sequence_parallel, overlap", share="", micro=1) -> ir.Plan:
    return api.loads(PLAN.format(hidden=hidden, options=options, share=share, batch=2 * micro, micro=micro)).plans[0]


def test_a_chunk_rereads_its_weight_only_beyond_its_math():
    """A GEMM of 4,096 x 16,384 by 16,384 x 6,144 in 8 chunks of 512 rows: each chunk's math (2·512·16384·6144 /
    (0.75 · 989 TFLOP/s) = 139 µs) outlasts its weight's re-read (201 MB at 3.35 TB/s = 60 µs), so the chunks
    together take the whole GEMM's time (no fixed time per kernel here). Rows of 8 tokens leave the re-read
    exposed: each further chunk pays what it exceeds its math by."""
    knobs = Efficiency(0.75, 0.0)
    precision = ir.Precision.bf16
    whole = knobs.gemm_seconds(4096, 6144, 16384, H100, precision)
    assert knobs.chunked_gemm_seconds(4096, 6144, 16384, H100, precision, 8, 2) == pytest.approx(whole)
    math = 2 * 8 * 6144 * 16384 / (0.75 * 989e12)
    weight = 16384 * 6144 * 2 / 3.35e12
    own = (8 * 16384 + 8 * 6144) * 2 / 3.35e12
    first = math + own + weight
    assert weight > math
    assert knobs.chunked_gemm_seconds(64, 6144, 16384, H100, precision, 8, 2) == pytest.approx(
        first + 7 * (own + max(math, weight)))


def test_overlap_is_never_slower_than_none_where_the_chunks_cost_nothing_more():
    """h 16,384 at tp 8, 4,096 tokens, no fixed time per kernel: every chunk is compute bound, so the decomposed GEMMs
    take what the whole ones take and the overlap can only hide communication (before, each chunk was charged
    its weight's bytes again and this block came out slower with the overlap than without)."""
    for share in ("", "\n  comm_share = 0"):
        plain, overlapped = _plan(options=" with sequence_parallel", share=share), _plan(share=share)
        device = overlapped.cluster.devices_in_order()[0]
        block = next(layer for layer in layers_of(plain.model) if layer.kind == "block")
        work = Work(1, 4096, tp=8, sequence_parallel=True, overlap_tensor=True)
        for gemm in overlap_gemms(overlapped.model, work, device):
            assert gemm.chunked == pytest.approx(gemm.whole)
        links = mesh_links(plain.cluster, (("dp", 2), ("tp", 8)), 0, ("dp",), ir.DataKind.zero3, "tp", None, None,
                           None)
        without = estimate_layer_time(plain.model, block, Work(1, 4096, tp=8, sequence_parallel=True), device, links)
        with_overlap = estimate_layer_time(overlapped.model, block, work, device, links)
        assert with_overlap.forward + with_overlap.backward <= without.forward + without.backward
        assert api.estimate(overlapped).time.step <= api.estimate(plain).time.step


def test_a_plans_step_grows_with_its_devices_share():
    """ZeRO-3 over two nodes, microbatches of 8 sequences: the gathers and reductions hidden beside every block cost
    the blocks their share (at one sequence they outlast the blocks, exposed whatever the share)."""
    steps = [api.estimate(_plan(share=f"\n  comm_share = {share}", micro=8)).time.step for share in (0, 0.1, 0.3)]
    assert steps[0] < steps[1] < steps[2]
