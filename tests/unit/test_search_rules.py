"""`generate --from` a plan that keeps `shard` rules: the search's figures, its memory caps and its exact estimate of
each candidate place the layers as the rules do (`search.figures.Figures._ruled`), as the completed plan's estimate
does (`ir.placement.assign_stages`), so no candidate it returns is one that only the default splits fit."""
from plandsl.cost.estimate import estimate_plan
from plandsl.rewrite.complete import generate_from
from plandsl.search import search
from plandsl.search.partial import read_partial

PARTIAL = """
import "clusters/dgx_a100"
plan ruled {
  model   = gpt(layers=16, hidden=4096, heads=32, seq=4096, vocab=32000)
  cluster = dgx_a100 x 1
  mesh    = [dp = 2, tp = 4] over devices[0:8]
  train   = { global_batch: 64, precision: bf16, optimizer: adam }
  data    = zero1 over dp
  tensor  = megatron over tp with sequence_parallel
  shard layers.*.mlp = replicate
}
"""


def test_the_search_counts_a_plans_shard_rules_as_its_estimate_does(tmp_path):
    """A replicated MLP keeps its whole [tokens, 4h] tensors on every tensor rank: with the default splits the search
    took micro-batches of 16 and 8 without recomputation as the fastest (69.3 and 42.1 GiB a device counted, 4.55 s a
    step), which the rules make 144.3 and 93.1 GiB on an 80 GB A100; now each candidate is searched, capped and
    estimated with the rules (11.21 s, 67.4 GiB at a micro-batch of 4), the figures its completed plan's estimate
    shows."""
    path = tmp_path / "ruled.plan"
    path.write_text(PARTIAL)
    partial = read_partial(str(path))
    assert partial.problem.shard == partial.plan.shard
    found = search(partial.problem, partial.pins, 5).candidates
    assert found
    for scored in found:
        assert scored.plan.shard == partial.plan.shard
        exact = estimate_plan(scored.plan)  # the layers placed by `assign_stages`, not by the search's figures
        assert exact.fits and scored.estimate.fits
        assert exact.time.step == scored.estimate.time.step
        assert [m.total for m in exact.memory] == [m.total for m in scored.estimate.memory]
    completed = generate_from(str(path), top=2)
    assert "shard layers.*.mlp = replicate" in completed.texts[0]
    assert all(scored.estimate.fits for scored in completed.result.candidates)
    assert completed.result.candidates[0].estimate.time.step == found[0].estimate.time.step
