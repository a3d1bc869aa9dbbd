"""The host's time per MoE layer (`cost.compute.MOE_HOST_OPS`, `HOST_SECONDS_PER_OP`): the op counts recounted from
megatron-core's real `MoELayer` on CPU (bench/moe_host.py, in a process of its own), and a layer whose device work
is shorter than its host's takes the host's time, forward and backward, while a large one keeps its device time."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from plandsl import api
from plandsl.cost.compute import (
    HOST_SECONDS_PER_OP,
    MOE_HOST_OPS,
    estimate_layer_compute,
)
from plandsl.cost.estimate import plan_work
from plandsl.ir.layers import layers_of

ROOT = Path(__file__).resolve().parents[2]

PLAN = """\
import "clusters/dgx_h100"
plan p {{
  model    = llama(layers=2, hidden={hidden}, heads=8, kv_heads=8, ffn={ffn}, experts=8, top_k=2, vocab=512,
                   seq={seq})
  cluster  = dgx_h100 x 1
  mesh     = [ep = 8]
  train    = {{ global_batch: 8, micro_batch: 1, precision: bf16 }}
  experts  = alltoall over ep
}}
"""


def _block(hidden, ffn, seq, experts=True):
    text = PLAN.format(hidden=hidden, ffn=ffn, seq=seq)
    if not experts:
        text = text.replace(", experts=8, top_k=2", "").replace("  experts  = alltoall over ep\n", "") \
            .replace("[ep = 8]", "[dp = 8]").replace("bf16 }", "bf16 }\n  data     = ddp over dp")
    plan = api.loads(text).plans[0]
    block = next(layer for layer in layers_of(plan.model) if layer.kind == "block")
    return estimate_layer_compute(plan.model, block, plan_work(plan), plan.cluster.devices_in_order()[0])


def _device_only(monkeypatch, *shape):
    """The block's figures with no host time at all (its device work alone)."""
    from plandsl.cost import compute
    with monkeypatch.context() as patch:
        patch.setattr(compute, "HOST_SECONDS_PER_OP", 0.0)
        return _block(*shape)


def test_a_small_moe_layer_takes_its_hosts_time(monkeypatch):
    """hidden 128, 8 experts 64 wide, 128 tokens: microseconds of device work, so forward and backward are the
    host's 28 and 33 ops at 10.7 us each; the same block dense is not held to it."""
    small = _block(128, 64, 128)
    device = _device_only(monkeypatch, 128, 64, 128)
    assert device.forward < MOE_HOST_OPS[0] * HOST_SECONDS_PER_OP  # the host is the longer, so it sets the time
    assert device.backward < MOE_HOST_OPS[1] * HOST_SECONDS_PER_OP
    assert small.forward == pytest.approx(MOE_HOST_OPS[0] * HOST_SECONDS_PER_OP)
    assert small.backward == pytest.approx(MOE_HOST_OPS[1] * HOST_SECONDS_PER_OP)
    assert small.forward_matmul == device.forward_matmul  # the wait is outside the GEMMs
    dense = _block(128, 64, 128, experts=False)
    assert dense.forward < MOE_HOST_OPS[0] * HOST_SECONDS_PER_OP / 2


def test_a_large_moe_layer_keeps_its_device_time(monkeypatch):
    """hidden 4096, experts 14336 wide, 4096 tokens: milliseconds of GEMMs, far above the host's 0.3 ms, so the
    host adds nothing: every figure, forward and backward, is the one the layer has with no host time at all
    (not the device's time plus the host's)."""
    large = _block(4096, 14336, 4096)
    assert large.forward > 10 * MOE_HOST_OPS[0] * HOST_SECONDS_PER_OP
    assert large.forward_other < large.forward_matmul  # no host wait added to the element-wise work
    assert large == _device_only(monkeypatch, 4096, 14336, 4096)


def _count(rank: int) -> dict:
    """bench/moe_host.py's op counts of megatron-core's MoELayer with 2 and 4 experts, in a process forked from this
    worker (`harness.run_ranks`): megatron-core keeps its parallel state in globals, and the bench patches torch.cuda."""
    spec = importlib.util.spec_from_file_location("moe_host", ROOT / "bench" / "moe_host.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.count([2, 4], runs=1)


@pytest.mark.slow  # megatron-core and torch in a process of its own: forked from the "torch" group's worker, which
# has torch and megatron-core's modules (test_interop_megatron_core); a child interpreter imported them, ~9 CPU-s
@pytest.mark.xdist_group("torch")
@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed")
def test_megatron_cores_moe_layer_issues_the_counted_ops():
    """22 + 6 per expert forward, 20 + 13 backward (its SequentialMLP: one MLP per expert); with the experts as one
    grouped call per projection (Transformer Engine's GroupedLinear) the cost model's 28 and 33."""
    from tests.distributed.harness import run_ranks
    [counts] = run_ranks(1, _count, deadline_s=60)
    per_expert = [(counts[4][pass_] - counts[2][pass_]) // 2 for pass_ in ("forward", "backward")]
    fixed = [counts[2][pass_] - 2 * per for pass_, per in zip(("forward", "backward"), per_expert)]
    assert per_expert == [6, 13] and fixed == [22, 20]
    assert tuple(f + p for f, p in zip(fixed, per_expert)) == MOE_HOST_OPS
