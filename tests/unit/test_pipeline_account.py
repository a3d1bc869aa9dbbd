"""`stages = evenly over pp with account = [embed, loss]`: the embedding and the loss (final norm, head and loss) each
counted as a layer of the even split, as Megatron-LM's --account-for-embedding-in-pipeline-split and
--account-for-loss-in-pipeline-split do.

The split is held to megatron-core's own arithmetic (`get_num_layers_to_build` and `get_transformer_layer_offset`,
transcribed below from megatron/core/transformer/transformer_block.py and transformer_layer.py, core_v0.16.1) over
a grid of models and layouts; a split written this way is the same plan as the `stages { }` block that says it
(same placement, same estimate), and the checker's codes name what can go wrong.
"""
from __future__ import annotations

import itertools
import random

import pytest

from plandsl import api
from plandsl.cost.estimate import estimate_plan
from plandsl.interop import export_plan, import_text
from plandsl.ir.placement import assign_stages
from plandsl.search import SearchError, parse_pins, search
from plandsl.search.emit import plan_text, resolve_problem
from plandsl.search.partition import partition_blocks

PLAN = """\
import "clusters/dgx_a100"
plan p {{
  model    = llama(layers={blocks}, hidden=1024, heads=16, seq=1024, vocab=32000)
  cluster  = dgx_a100 x 2
  mesh     = [dp = {dp}, pp = {pp}]
  train    = {{ global_batch: 64, micro_batch: 1 }}
  {stages}
  schedule = {schedule}
}}
"""


def _plan(blocks: int, pp: int, virtual: int = 1, account: str = "", stages: str | None = None):
    options = ([f"virtual = {virtual}"] if virtual > 1 else []) + ([f"account = {account}"] if account else [])
    stages = stages or "stages   = evenly over pp" + (f" with {', '.join(options)}" if options else "")
    text = PLAN.format(blocks=blocks, dp=16 // pp, pp=pp, stages=stages,
                       schedule="interleaved_1f1b" if virtual > 1 else "1f1b")
    return text


def _names(plan) -> list[list[str]]:
    assignment, problems = assign_stages(plan)
    assert not problems
    return [[layer.name for layer in layers] for layers in assignment.stage_layers]


def _megatron_chunks(blocks: int, pp: int, vp: int | None, embedding: bool, loss: bool):
    """(offset, blocks built) of each virtual stage, stage `v * pp + r` on pp rank r, as megatron-core computes them
    with --account-for-*-in-pipeline-split (no layout, no --decoder-first/last-pipeline-num-layers); None where it
    asserts."""
    total = blocks + embedding + loss
    if total % pp:
        return None  # "num_layers=... should be divisible by config.pipeline_model_parallel_size"
    per_rank = total // pp
    if vp is not None and per_rank % vp:
        return None  # "num_layers_per_pipeline_rank ... should be divisible by vp_size"
    chunks = []
    for v in range(vp or 1):
        for r in range(pp):
            build = per_rank // vp if vp is not None else per_rank
            first, last = v == 0 and r == 0, v == (vp or 1) - 1 and r == pp - 1
            build -= (embedding and first) + (loss and last)
            if build < 0:
                return None  # "Not enough layers in the first/last virtual pipeline stage"
            if vp is not None:  # get_transformer_layer_offset
                offset = v * (total // vp) + r * (per_rank // vp)
            else:
                offset = r * per_rank
            if embedding and not first:
                offset -= 1
            chunks.append((offset, build))
    return chunks


GRID = [(blocks, pp, vp, e, lo) for blocks, pp, vp, e, lo in itertools.product(
    (4, 6, 7, 14, 30), (2, 4, 8), (None, 2, 4), (False, True), (False, True))
    if (e or lo) and _megatron_chunks(blocks, pp, vp, e, lo) is not None]  # what megatron-core builds: 36 layouts


@pytest.mark.parametrize("blocks,pp,vp,embedding,loss", GRID)
def test_the_split_is_megatron_cores(blocks, pp, vp, embedding, loss):
    expected = _megatron_chunks(blocks, pp, vp, embedding, loss)
    account = "[" + ", ".join(p for p, on in (("embed", embedding), ("loss", loss)) if on) + "]"
    plan = api.loads(_plan(blocks, pp, vp or 1, account)).plans[0]
    names = _names(plan)
    offset = 0
    for index, (layers, (start, build)) in enumerate(zip(names, expected)):
        held = [name for name in layers if name.startswith("layers.")]
        assert held == [f"layers.{i}" for i in range(start, start + build)], index
        assert ("embed" in layers) == (index == 0) and (("head" in layers) == ("norm" in layers)
                                                        == (index == len(names) - 1))
        offset += build
    assert offset == blocks


def test_405b_at_pp16_vp8_gives_the_embedding_and_the_loss_chunks_of_their_own():
    """Megatron-Bridge's Llama 3.1 405B recipe (account_for_embedding/loss = True) at PP 16 x VP 8: 126 blocks, the
    embedding and the loss over 128 chunks, one each."""
    plan = api.loads(_plan(126, 16, 8, "[embed, loss]")).plans[0]
    names = _names(plan)
    assert len(names) == 128 and names[0] == ["embed"] and names[-1] == ["norm", "head"]
    assert all(layers == [f"layers.{i - 1}"] for i, layers in enumerate(names[1:-1], start=1))


def test_uneven_counts_split_as_evenly_does_the_first_stages_one_more():
    """Where the items do not divide (Megatron-LM would run it only as a layout), the first stages take one more."""
    plan = api.loads(_plan(7, 4, 1, "[embed, loss]")).plans[0]  # 9 items over 4 stages: 3, 2, 2, 2
    assert _names(plan) == [["embed", "layers.0", "layers.1"], ["layers.2", "layers.3"], ["layers.4", "layers.5"],
                            ["layers.6", "norm", "head"]]
    plan = api.loads(_plan(7, 4, 1, "embed")).plans[0]  # 8 items: 2 each, the loss joining the last
    assert _names(plan)[0] == ["embed", "layers.0"] and _names(plan)[-1] == ["layers.5", "layers.6", "norm", "head"]


def test_same_plan_as_the_stages_block_that_says_it():
    block = """stages {
    0: embed
    1..7: layers[0:6]
    7: norm, head
    virtual = 2
  }"""
    counted = api.loads(_plan(6, 4, 2, "[embed, loss]")).plans[0]
    written = api.loads(_plan(6, 4, 2, stages=block)).plans[0]
    assert _names(counted) == _names(written)
    a, b = estimate_plan(counted), estimate_plan(written)
    assert (a.time.step, a.peak_memory_bytes) == (b.time.step, b.peak_memory_bytes)


def test_without_account_the_plan_dumps_as_before():
    plan = api.loads(_plan(8, 4)).plans[0]
    assert "account" not in plan.stages.model_dump()
    counted = api.loads(_plan(6, 4, 1, "[loss, embed]")).plans[0]
    assert counted.stages.account == ("embed", "loss")  # model order, whatever order it was written in


def _codes(text: str) -> list[str]:
    return [d.code for d in api.checks(text).errors]


def test_too_few_items_for_the_stages_is_e403():
    analysis = api.checks(_plan(4, 4, 2, "[embed, loss]"))  # 6 items over 8 stages
    assert [d.code for d in analysis.errors] == ["E403"]
    assert "6 items (4 blocks, embed and loss)" in analysis.errors[0].message


def test_counting_what_the_model_does_not_have_apart_is_e405():
    text = _plan(4, 2, 1, "[embed]").replace("llama(layers=4, hidden=1024, heads=16, seq=1024, vocab=32000)",
                                              "mlp(layers=4, hidden=1024, input=784, output=10)")
    assert _codes(text) == ["E405"]


def test_counted_twice_is_e213_and_an_unknown_part_e210():
    assert _codes(_plan(6, 4, 1, "[embed, embed]")) == ["E213"]
    assert _codes(_plan(6, 4, 1, "[embed, head]")) == ["E210"]


def test_formatting_keeps_it():
    formatted = api.format_text(_plan(6, 4, 2, "[embed, loss]"))
    assert "with virtual = 2, account = [embed, loss]" in formatted
    assert api.format_text(formatted) == formatted


# ---- Megatron-LM's flags -------------------------------------------------------------------------------------------
FLAGS = ("--num-layers {blocks} --hidden-size 256 --num-attention-heads 8 --seq-length 128 --max-position-embeddings 128 "
         "--padded-vocab-size 1024 --micro-batch-size 1 --global-batch-size 64 --pipeline-model-parallel-size {pp} {more}")
BOTH = "--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split"


def _imported(blocks: int, pp: int, more: str):
    return import_text("megatron", FLAGS.format(blocks=blocks, pp=pp, more=more) + "\n", "flags", world_size=8)


def test_import_reads_the_account_flags_as_account():
    imported = _imported(6, 4, BOTH + " --num-virtual-stages-per-pipeline-rank 2")
    assert imported.ok, [str(d) for d in imported.diagnostics]
    assert "evenly over pp with virtual = 2, implementation = megatron, account = [embed, loss]" in imported.text
    [plan] = api.loads(imported.text).plans
    assert _names(plan)[0] == ["embed"] and _names(plan)[-1] == ["norm", "head"]
    only = _imported(7, 4, "--account-for-embedding-in-pipeline-split")
    assert only.ok and "account = [embed]" in only.text
    per_stage = _imported(6, 4, BOTH + " --num-layers-per-virtual-pipeline-stage 1")  # (6 + 2) / 4 / 1: 2 virtual
    assert per_stage.ok and "virtual = 2" in per_stage.text and "account = [embed, loss]" in per_stage.text


@pytest.mark.parametrize("more, shown", [
    (BOTH, "--num-layers"),  # 8 + 2 over 4: megatron-core asserts num_layers (+ 2) divisible by pp
    (BOTH + " --pipeline-model-parallel-layout Et*4|t*4|L", "--pipeline-model-parallel-layout"),
    ("--account-for-loss-in-pipeline-split --decoder-first-pipeline-num-layers 2", "--decoder-first-pipeline-num-layers"),
])
def test_import_refuses_what_megatron_core_refuses_with_them(more, shown):
    text = FLAGS.format(blocks=8, pp=4 if "layout" not in more else 2, more=more) + "\n"
    imported = import_text("megatron", text, "flags", world_size=8)
    assert [d.code for d in imported.diagnostics] == ["E805"]
    span = imported.diagnostics[0].span
    assert text[span.start:].startswith(shown)


def test_export_writes_the_flags_and_imports_back():
    [plan] = api.loads(_plan(6, 4, 2, "[embed, loss]")).plans
    exported = export_plan(plan, "megatron")
    assert BOTH.split()[0] in exported.text and BOTH.split()[1] in exported.text
    assert "--pipeline-model-parallel-layout" not in exported.text
    again = import_text("megatron", exported.text, "plan.args", world_size=plan.mesh.size, name=plan.name)
    assert again.ok, [str(d) for d in again.diagnostics]
    assert _names(api.loads(again.text).plans[0]) == _names(plan)


# ---- the search ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("blocks, fixed, per_block, caps", [
    (5, [3.0, 0.0, 0.0, 4.0], [1.0, 1.0, 1.0, 1.0], None),  # heavy ends: the embedding or the head alone
    (2, [0.5, 0.0, 0.0, 0.5], [1.0, 1.0, 1.0, 1.0], None),  # more stages than blocks
    (7, [1.0, 0.0, 0.0, 2.5], [1.0, 1.0, 1.0, 1.0], [3, 2, 3, 1]),
])
def test_partition_with_free_ends_is_the_minimax_of_all_compositions(blocks, fixed, per_block, caps):
    least = [0, 1, 1, 0]
    limits = caps or [blocks] * 4
    best = min(max(f + n * b for f, n, b in zip(fixed, counts, per_block))
               for counts in itertools.product(range(blocks + 1), repeat=4)
               if sum(counts) == blocks and all(lo <= n <= c for n, lo, c in zip(counts, least, limits)))
    counts = partition_blocks(blocks, fixed, per_block, caps, least)
    assert sum(counts) == blocks and all(n >= lo for n, lo in zip(counts, least))
    assert max(f + n * b for f, n, b in zip(fixed, counts, per_block)) == pytest.approx(best)


def test_closed_form_partition_with_free_ends_is_the_greedy(monkeypatch):
    from plandsl.search import partition
    rng = random.Random(11)
    for _ in range(500):
        stages = rng.randint(2, 8)
        blocks = rng.randint(stages - 2, 90)
        fixed = [rng.choice([0.0, 1.0, rng.uniform(0, 5)]) for _ in range(stages)]
        per_block = [rng.choice([0.0, 0.5, rng.uniform(0, 2)]) for _ in range(stages)]
        caps = None if rng.random() < 0.5 else [rng.randint(1, max(1, blocks)) for _ in range(stages)]
        least = [0] + [1] * (stages - 2) + [0]
        monkeypatch.setattr(partition, "GREEDY_STEPS", 10**9)
        greedy = partition_blocks(blocks, fixed, per_block, caps, least)
        monkeypatch.setattr(partition, "GREEDY_STEPS", -1)
        assert partition_blocks(blocks, fixed, per_block, caps, least) == greedy, (blocks, fixed, per_block, caps)


MODEL = "llama(layers={blocks}, hidden=4096, heads=32, seq=4096, vocab=128256)"
PINS = ["pp=4", "virtual_stages=2", "schedule=interleaved_1f1b", "tp=2"]


def _searched(blocks: int, *pins: str):
    problem, source = resolve_problem(MODEL.format(blocks=blocks), "dgx_a100 x 2", 64, pipeline="megatron")
    best = search(problem, pins=PINS + list(pins), top=1).best
    [plan] = api.loads(plan_text(best, problem, source), path="generated.plan").plans
    return best, plan


def test_the_pin_account_gives_megatrons_split_and_the_plan_says_it():
    best, plan = _searched(6, "account=embed,loss")  # 8 items over 8 stages: the embedding and the loss alone
    assert best.blocks == (0, 1, 1, 1, 1, 1, 1, 0)
    assert plan.stages.account == ("embed", "loss") and _names(plan)[0] == ["embed"]
    assert estimate_plan(plan).time.step == pytest.approx(best.estimate.time.step, rel=1e-9)
    best, plan = _searched(14, "account=embed,loss")  # 16 items: the ends one block each, a `stages { }` block
    assert best.blocks == (1, 2, 2, 2, 2, 2, 2, 1) and [len(s) for s in _names(plan)] == [2, 2, 2, 2, 2, 2, 2, 3]


def test_the_search_gives_an_end_stage_the_loss_alone_where_it_pays_and_not_when_pinned_none():
    """A 128k vocabulary's head costs more than a block: unpinned, the last stage holds it alone (Megatron-LM's
    --account-for-loss-in-pipeline-split), faster than any split with a block on every stage; `account=none` is that
    split, as before. Six blocks over eight stages only the counted ends can split."""
    free, plan = _searched(14)
    none, _ = _searched(14, "account=none")
    assert 0 in (free.blocks[0], free.blocks[-1]) and min(none.blocks) >= 1
    assert free.estimate.time.step < none.estimate.time.step
    assert plan.stages.account and api.checks(api.format_text(plan_text(free, *resolve_problem(
        MODEL.format(blocks=14), "dgx_a100 x 2", 64, pipeline="megatron")))).ok
    assert _searched(6)[0].blocks.count(0) == 2
    with pytest.raises(SearchError):
        _searched(6, "account=none")


@pytest.mark.parametrize("value", ["head", "embed,embed,foo", "none,loss"])
def test_a_bad_account_pin_is_a_search_error(value):
    with pytest.raises(SearchError, match="account"):
        parse_pins([f"account={value}"])


def test_generate_from_a_plan_that_counts_them_searches_that_split(tmp_path):
    """`generate --from` keeps a written `account` as a pin: the completed plan's split is Megatron's."""
    from plandsl.search.partial import read_partial
    path = tmp_path / "partial.plan"
    path.write_text(_plan(6, 4, 2, "[embed, loss]"))
    assert read_partial(str(path)).pins["account"] == ("embed", "loss")


# ---- the cost model ------------------------------------------------------------------------------------------------
def test_a_stage_holding_the_embedding_or_the_loss_alone_is_priced_as_what_it_holds():
    """The embedding's stage costs the embedding (no block's FLOPs, parameters or activations), the loss's the norm and
    head; each block's stage what one block costs; their sum is the whole model's, the same as one stage holding it
    all; and the pipeline's transfer is the same `[b, s, h]` microbatch between every pair of stages."""
    from plandsl.cost.estimate import estimate_stage_times, pipeline_p2p, plan_work
    from plandsl.cost.layer import plan_links
    from plandsl.cost.memory import estimate_layer_activations
    counted = api.loads(_plan(6, 4, 2, "[embed, loss]")).plans[0]
    plain = api.loads(_plan(8, 4, 2)).plans[0]  # 8 blocks, a block a stage, the embedding and the loss beside them
    times = estimate_stage_times(counted, assign_stages(counted)[0])
    blocks = estimate_stage_times(plain, assign_stages(plain)[0])
    layers = {layer.name: layer for stage in assign_stages(counted)[0].stage_layers for layer in stage}
    block = times[1]
    assert all(t.forward == pytest.approx(block.forward) and t.flops == block.flops for t in times[1:7])
    assert times[0].flops < block.flops / 10 and times[0].forward < block.forward  # a lookup: no GEMM
    assert times[7].flops == pytest.approx(blocks[7].flops - block.flops)  # stage 7 of `plain`: a block and the loss
    assert times[0].dense_params == layers["embed"].param_count and times[7].dense_params == \
        layers["norm"].param_count + layers["head"].param_count
    assert estimate_layer_activations(counted, layers["embed"]) < estimate_layer_activations(counted, layers["layers.0"])
    assert pipeline_p2p(counted, plan_links(counted), plan_work(counted)) == \
        pipeline_p2p(plain, plan_links(plain), plan_work(plain)) > 0


def test_a_dense_then_moe_partition_with_free_ends_is_the_minimax_of_all_compositions():
    """`partition_prefixed(free_ends=True)` (blocks that differ: a transformer's dense ones, then its MoE ones): the
    first and the last stage may hold none."""
    from plandsl.search.partition import partition_prefixed
    rng = random.Random(5)
    for _ in range(200):
        stages, layers = rng.randint(2, 4), rng.randint(1, 6)
        costs = [[rng.uniform(0.1, 2.0) for _ in range(layers)] for _ in range(stages)]
        fixed = [rng.choice([0.0, rng.uniform(0, 3)]) for _ in range(stages)]
        prefix = [list(itertools.accumulate(row, initial=0.0)) for row in costs]
        best = min((max(fixed[s] + sum(costs[s][a:a + n]) for s, (a, n) in enumerate(
            zip(itertools.accumulate(counts, initial=0), counts)))
            for counts in itertools.product(range(layers + 1), repeat=stages)
            if sum(counts) == layers and all(n >= 1 for n in counts[1:-1])), default=None)
        counts = partition_prefixed(prefix, None, None, fixed, free_ends=True)
        if best is None:
            assert counts is None
            continue
        starts = list(itertools.accumulate(counts, initial=0))
        assert sum(counts) == layers and all(n >= 1 for n in counts[1:-1])
        assert max(fixed[s] + prefix[s][starts[s + 1]] - prefix[s][starts[s]] for s in range(stages)) == \
            pytest.approx(best)


def test_a_dense_then_moe_model_with_more_stages_than_blocks_gives_the_ends_the_embedding_and_the_loss():
    model = "llama(layers=6, hidden=1024, heads=16, seq=1024, vocab=32000, experts=8, top_k=2, dense_layers=1)"
    problem, source = resolve_problem(model, "dgx_a100 x 1", 64)
    best = search(problem, pins=["pp=4", "virtual_stages=2", "schedule=interleaved_1f1b", "ep=1", "tp=1"], top=1).best
    assert best.blocks == (0, 1, 1, 1, 1, 1, 1, 0)
    [plan] = api.loads(plan_text(best, problem, source), path="generated.plan").plans
    assert plan.stages.account == ("embed", "loss")


def test_a_layout_that_gives_the_embedding_and_the_loss_chunks_of_their_own_imports_as_account():
    """`--pipeline-model-parallel-layout "E|t|t|t|t|t|t|L"` (Megatron-Bridge's DeepSeek and Llama layouts are written
    so) is the split `account = [embed, loss]` says: imported as it, the same stages."""
    imported = _imported(6, 4, "--pipeline-model-parallel-layout 'E|t|t|t|t|t|t|L'")
    assert imported.ok, [str(d) for d in imported.diagnostics]
    assert "evenly over pp with virtual = 2, implementation = megatron, account = [embed, loss]" in imported.text
    assert _names(api.loads(imported.text).plans[0]) == _names(api.loads(_plan(6, 4, 2, "[embed, loss]")).plans[0])
    other = _imported(7, 4, "--pipeline-model-parallel-layout 'E|t*2|t|t|t|t|t|L'")  # not that split: a block
    assert other.ok and "account" not in other.text and "  stages {" in other.text


def test_the_pin_account_gives_megatrons_split_of_a_dense_then_moe_model():
    model = "llama(layers=14, hidden=1024, heads=16, seq=1024, vocab=32000, experts=8, top_k=2, dense_layers=1)"
    problem, _ = resolve_problem(model, "dgx_a100 x 1", 64)
    pins = ["pp=4", "virtual_stages=2", "schedule=interleaved_1f1b", "ep=1", "tp=1"]
    assert search(problem, pins=pins + ["account=embed,loss"], top=1).best.blocks == (1, 2, 2, 2, 2, 2, 2, 1)
    assert search(problem, pins=pins + ["account=loss"], top=1).best.blocks == (2, 2, 2, 2, 2, 2, 2, 0)


@pytest.mark.parametrize("counts, counted", [((0, 1, 1, 0), ("embed", "loss")), ((1, 2, 2, 0), ("embed", "loss")),
                                             ((0, 1, 1, 1), ("embed",)), ((2, 2, 2, 0), ("loss",)),
                                             ((0, 2, 2, 1), None), ((0, 2, 2, 2), None), ((1, 1, 1, 1), None), ((), None)])
def test_the_split_account_says_is_named_once_for_generate_and_import(counts, counted):
    """`counted_split`: the parts whose `account` split block counts with an end stage free of blocks are, the one rule
    `generate` writes (`search.emit.stage_lines`) and `import --from megatron` reads a layout by; None where every
    stage holds a block or no account gives the counts."""
    from plandsl.ir.placement import counted_split
    assert counted_split(counts) == counted
