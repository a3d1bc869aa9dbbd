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


def test_a_rule_over_the_plans_own_axis_names_is_searched_as_over_the_conventional_ones(tmp_path):
    """The candidates lay out `dp` and `tp`; a plan naming its axes `data` and `model` has its rules (`over model`)
    read on them as on its own axes: before, `over model` matched no candidate axis, the rule fell back to the default
    split, and the search returned what the default splits fit (10.69 s at micro-batch 2, 2 candidates, against 10.57
    s at micro-batch 4, 5 candidates, for the same plan written with `dp` and `tp`)."""
    written = {}
    for data, model in (("dp", "tp"), ("data", "model")):
        text = (PARTIAL.replace("layers=16", "layers=32").replace("[dp = 2, tp = 4]", f"[{data} = 2, {model} = 4]")
                .replace("zero1 over dp", f"zero1 over {data}").replace("megatron over tp", f"megatron over {model}")
                .replace("shard layers.*.mlp = replicate", f"shard layers.*.mlp.w2 = colwise over {model}"))
        path = tmp_path / f"{model}.plan"
        path.write_text(text)
        partial = read_partial(str(path))
        assert [rule.axis for rule in partial.problem.shard] == ["tp"]
        found = search(partial.problem, partial.pins, 5).candidates
        written[model] = [(s.candidate.micro_batch_size, s.estimate.time.step) for s in found]
        completed = generate_from(str(path), top=1)
        assert f"shard layers.*.mlp.w2 = colwise over {model}" in completed.texts[0]
    assert written["model"] == written["tp"]


def test_a_rule_over_an_axis_no_parallelism_runs_over_is_not_read_on_a_candidates_axis(tmp_path):
    """A size-1 axis named `tp` beside the plan's tensor axis `model` carries nothing, as an axis named `x` would:
    the candidates' `tp` is the tensor axis, so the rule over the plan's `tp` is renamed apart (before, the search
    counted it on the candidates' tensor axis: 0.0638 s, 8.56 GiB at the top against 0.0558 s, 7.56 GiB for `x`)."""
    found = {}
    for axis in ("tp", "x"):
        text = (PARTIAL.replace("layers=16, hidden=4096, heads=32, seq=4096", "layers=8, hidden=1024, heads=16, seq=1024")
                .replace("[dp = 2, tp = 4]", f"[data = 4, model = 2, {axis} = 1]").replace("zero1 over dp", "zero1 over data")
                .replace("megatron over tp with sequence_parallel", "megatron over model")
                .replace("shard layers.*.mlp = replicate", f"shard layers.*.mlp.w2 = colwise over {axis}"))
        path = tmp_path / f"{axis}.plan"
        path.write_text(text)
        partial = read_partial(str(path))
        assert partial.problem.shard[0].axis not in ("dp", "tp", "cp", "ep", "pp")
        found[axis] = [(s.candidate.micro_batch_size, s.estimate.time.step) for s in
                       search(partial.problem, partial.pins, 5).candidates]
    assert found["tp"] == found["x"]
