"""Sliding-window attention and attention sinks (`window`, `full_every`, `sinks`): the language and the IR, the
checker's codes (E231, E232, W203, E420), the time model's band of tiles, the catalogue's sinks, the search's two
kinds of block and Megatron-LM's flags both ways."""
from __future__ import annotations

import pytest

from plandsl import api, ir
from plandsl.cost.compute import FLASH_TILE, Work, causal_fraction, estimate_layer_compute, window_band
from plandsl.interop import export_plan
from plandsl.interop.megatron_import import import_flags
from plandsl.ir.layers import block_model, layers_of

_PLAN = """import "clusters/dgx_h100"
plan p {{
  model   = llama(layers=4, hidden=512, heads=8, kv_heads=2, seq=4096, vocab=1024{args})
  cluster = dgx_h100
  mesh    = [dp = {dp}{cp}]
  train   = {{ global_batch: 16, micro_batch: 1 }}
{extra}}}
"""


def _plan(args: str = "", dp: int = 8, cp: str = "", extra: str = ""):
    return _PLAN.format(args=args, dp=dp, cp=cp, extra=extra)


def _codes(text: str) -> list[str]:
    return [d.code for d in api.checks(text).diagnostics]


def test_window_arguments_lower_and_leave_other_dumps_unchanged():
    model = api.loads(_plan(", window=128, full_every=2, sinks=true")).plans[0].model
    assert (model.window, model.full_every, model.sinks) == (128, 2, True)
    assert [model.window_of(i) for i in range(4)] == [128, 0, 128, 0]
    plain = api.loads(_plan()).plans[0].model
    assert not {"window", "full_every", "sinks"} & set(plain.model_dump())


def test_full_every_without_window_is_e231():
    assert _codes(_plan(", full_every=2")) == ["E231"]


@pytest.mark.parametrize("every", [1, 5])
def test_full_every_leaving_no_windowed_or_no_full_block_is_e232(every):
    assert _codes(_plan(f", window=128, full_every={every}")) == ["E232"]


def test_window_no_shorter_than_the_sequence_warns_w203():
    assert _codes(_plan(", window=4096")) == ["W203"]
    assert _codes(_plan(", window=4095")) == []


def test_ring_context_over_a_window_or_sinks_is_e420():
    ring = "  context = ring over cp\n"
    assert _codes(_plan(", window=128", dp=4, cp=", cp = 2", extra=ring)) == ["E420"]
    assert _codes(_plan(", sinks=true", dp=4, cp=", cp = 2", extra=ring)) == ["E420"]
    assert _codes(_plan(", window=128", dp=4, cp=", cp = 2", extra="  context = allgather over cp\n")) == []


def test_window_band_counts_the_tiles_a_band_reaches():
    tiles = 4096 // FLASH_TILE
    assert window_band(4096, 128) * tiles * (tiles + 1) / 2 == pytest.approx(63)  # 1 + 31 x 2
    assert window_band(4096, 129) == window_band(4096, 128)  # still one tile below the diagonal
    assert window_band(4096, 130) * tiles * (tiles + 1) / 2 == pytest.approx(1 + 2 + 30 * 3)
    assert window_band(4096, 0) == window_band(4096, 4096) == window_band(4096, 4096 - FLASH_TILE + 1) == 1.0
    assert window_band(4096, 1) * tiles * (tiles + 1) / 2 == pytest.approx(tiles)


def test_a_windowed_block_runs_its_band_and_counts_full_model_flops():
    plan = api.loads(_plan(", window=128, full_every=2")).plans[0]
    device = plan.cluster.devices_in_order()[0]
    blocks = [layer for layer in layers_of(plan.model) if layer.kind == "block"]
    windowed, full = (estimate_layer_compute(plan.model, blocks[i], Work(1, 4096), device) for i in (0, 1))
    assert windowed.flops == full.flops  # model FLOPs: the whole s x s, as torchtitan counts
    assert windowed.attention < full.attention * (2 * window_band(4096, 128) + 0.2)
    materialized = Work(1, 4096, attention=ir.Attention.materialized)
    assert estimate_layer_compute(plan.model, blocks[0], materialized, device).attention == \
        estimate_layer_compute(plan.model, blocks[1], materialized, device).attention
    assert block_model(plan.model, 1).window == 0 and block_model(plan.model, 0).window == 128
    assert causal_fraction(4096) * window_band(4096, 128) == pytest.approx(63 / 1024)


def test_sinks_are_one_parameter_per_head_split_by_heads():
    model = api.loads(_plan(", sinks=true")).plans[0].model
    sinks = [p for p in layers_of(model)[1].params if p.name.endswith("attn.sinks")]
    assert [(p.name, p.shape, p.dims) for p in sinks] == [("layers.0.attn.sinks", (8,), ("heads",))]


def test_the_search_partitions_windowed_and_full_blocks_in_order():
    from plandsl.search.figures import Figures
    from plandsl.search.emit import resolve_problem
    problem, _ = resolve_problem("gpt_oss_20b", "dgx_h100", 64, plan_file=None)
    figures = Figures(problem, None)
    assert figures.dense_blocks == 12 and figures.interleaved
    assert list(figures.dense_before[:5]) == [0, 1, 1, 2, 2]  # blocks 0, 2, ... windowed: the second kind
    assert figures.dense_order(1, 2) == (False, True)


def test_megatron_flags_carry_the_window_both_ways():
    text = _plan(", window=128, full_every=2, sinks=true")
    exported = export_plan(api.loads(text).plans[0], "megatron")
    assert "--window-size 127,0" in exported.text and "--window-attn-skip-freq 2" in exported.text
    assert "--softmax-type learnable" in exported.text
    flags = [line.strip() for line in exported.text.splitlines()[3:-1]]
    imported = import_flags(" ".join(flags), "flags.sh", 8, "dgx_h100")
    assert "window=128" in imported.text and "full_every=2" in imported.text and "sinks=true" in imported.text
    six = import_flags(" ".join(flags).replace("--window-attn-skip-freq 2", "--window-attn-skip-freq 4"), "flags.sh",
                       8, "dgx_h100")
    assert "full_every=4" in six.text


def test_shrink_keeps_a_band_and_torchtitan_loses_the_window(tmp_path):
    from plandsl.rewrite.shrink import shrink
    path = tmp_path / "oss.plan"
    path.write_text('import "clusters/dgx_h100"\nimport "models/gpt_oss"\nplan p {\n  model = gpt_oss_20b\n'
                    '  cluster = dgx_h100 x 2\n  mesh = [pp = 2, dp = 2, ep = 4]\n'
                    '  train = { global_batch: 64, micro_batch: 1 }\n  data = zero1 over dp\n'
                    '  experts = alltoall over ep\n  stages = evenly over pp\n  schedule = 1f1b\n}\n')
    small = shrink(path).plan.model
    assert (small.window, small.full_every, small.sinks) == (16, 2, True)  # half the 32 tokens: still a band
    lost = export_plan(api.loads(_plan(", window=128")).plans[0], "torchtitan").lost
    assert any("sliding-window" in d.message for d in lost)


def test_megatron_loses_sinks_under_context_parallelism():
    text = _plan(", sinks=true", dp=4, cp=", cp = 2", extra="  context = allgather over cp\n")
    assert _codes(text) == []  # plandsl run gathers K and V and runs the sinks (tests/distributed/test_window_run.py)
    lost = export_plan(api.loads(text).plans[0], "megatron").lost
    assert [d.code for d in lost if "sinks under context parallelism" in d.message] == ["E808"]


def test_tensor_parallelism_splits_the_sinks_by_heads():
    from plandsl.cost.memory import local_numel
    sinks = next(p for p in layers_of(api.loads(_plan(", sinks=true")).plans[0].model)[1].params
                 if p.name.endswith("attn.sinks"))
    assert [local_numel(sinks, tp, 1) for tp in (1, 2, 8)] == [8, 4, 1]  # 8 heads over the tensor axis


def test_megatron_skip_freq_of_many_layers_imports_in_one_pass():
    """--window-attn-skip-freq as a list over 20,000 layers that is no every-N-th pattern: refused (E807) after
    one look at the pattern, where trying every N against it took ~35 s of CPU (minutes at 100,000 layers)."""
    from support import bounded
    flags = ("--num-layers 20000 --hidden-size 512 --num-attention-heads 8 --seq-length 4096 "
             "--max-position-embeddings 4096 --micro-batch-size 1 --global-batch-size 16 --bf16 "
             "--padded-vocab-size 1024 --window-size 127,0 --window-attn-skip-freq ")
    with bounded(3, "import of a 20,000-layer window pattern"):
        refused = import_flags(flags + "[0]+[1]*19999", "flags.sh", 8, "dgx_h100")
    assert [d.code for d in refused.diagnostics] == ["E807"]
    with bounded(3, "import of a 20,000-layer window pattern"):
        every = import_flags(flags.replace("20000", "24") + "([1]*5+[0])*4", "flags.sh", 8, "dgx_h100")
    assert "full_every=6" in every.text


def test_window_and_full_every_of_zero_are_their_defaults():
    """docs/language.md gives `window` and `full_every` the default 0 (the whole causal sequence; every block
    windowed), so writing it means that, as `experts=0` does, rather than E205's 'must be at least 1'."""
    assert _codes(_plan(", window=0")) == [] and _codes(_plan(", window=0, sinks=true")) == []
    assert api.loads(_plan(", window=0")).plans[0].model.model_dump() == api.loads(_plan()).plans[0].model.model_dump()
    windowed = api.loads(_plan(", window=128, full_every=0")).plans[0].model
    assert [windowed.window_of(i) for i in range(4)] == [128] * 4
    assert _codes(_plan(", window=0, full_every=2")) == ["E231"]


def test_megatron_window_with_an_unbounded_left_side_hints_no_window():
    """--window-size -1,0 is Transformer Engine's unbounded causal attention, not a window: refused (E807) with a hint
    to leave the flag out, not `--window-size 0,0` (a window of one key, each token attending only to itself)."""
    flags = ("--num-layers 4 --hidden-size 512 --num-attention-heads 8 --seq-length 4096 --max-position-embeddings "
             "4096 --micro-batch-size 1 --global-batch-size 16 --bf16 --padded-vocab-size 1024 --window-size ")
    unbounded = import_flags(flags + "-1,0", "flags.sh", 8, "dgx_h100").diagnostics
    assert [d.code for d in unbounded] == ["E807"] and "0,0" not in unbounded[0].hint
    assert "leave --window-size out" in unbounded[0].hint
    right = import_flags(flags + "127,3", "flags.sh", 8, "dgx_h100").diagnostics
    assert [d.code for d in right] == ["E807"] and right[0].hint == "--window-size 127,0"


def test_w203_on_a_one_token_sequence_offers_no_window_of_zero():
    """W203's hint halves the sequence for a band; of one token that is window=0, which is no window at all."""
    found = api.checks(_plan(", window=1").replace("seq=4096", "seq=1")).diagnostics
    assert [d.code for d in found] == ["W203"] and "window=0" not in found[0].hint
    assert "window=2048 or less" in api.checks(_plan(", window=4096")).diagnostics[0].hint
