"""The microbatch counts each built-in schedule runs: the checker's rule (`registry.microbatches_fit`)
is the rule of torch's class where `plandsl run` uses one, and docs/language.md states it."""
from __future__ import annotations

import re
import types
from pathlib import Path

import pytest

from plandsl.check.analysis import analyze
from plandsl.schedules.registry import BUILTIN, microbatch_rule, microbatches_fit, nearest_fitting

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def torch_pipeline():
    return pytest.importorskip("plandsl.runtime.parallel.pipeline")


def _torch_accepts(cls, single: bool, ranks: int, microbatches: int, virtual: int) -> bool:
    stages = [types.SimpleNamespace(num_stages=ranks * virtual, group_size=ranks, group_rank=0,
                                    stage_index=local * ranks, submod=None, is_first=local == 0, is_last=False)
              for local in range(virtual)]
    try:
        cls(stages[0] if single else stages, microbatches)
    except ValueError:
        return False
    return True


def test_the_checker_accepts_the_microbatch_counts_torch_runs(torch_pipeline):
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle
    compared = 0
    for name, cls in torch_pipeline.TORCH_SCHEDULES.items():
        info = BUILTIN[name]
        single = issubclass(cls, PipelineScheduleSingle)
        virtual = 1 if single else 2
        for ranks in (1, 2, 3, 4, 6):
            for m in range(1, 3 * ranks + 3):
                torch_says = _torch_accepts(cls, single, ranks, m, virtual)
                assert microbatches_fit(info, ranks, m) == torch_says, \
                    f"{name} ({cls.__name__}), pp={ranks}, m={m}: torch {'runs' if torch_says else 'refuses'} it"
                compared += 1
    assert compared > 100


def test_docs_state_each_schedules_rule():
    text = (ROOT / "docs" / "language.md").read_text(encoding="utf-8")
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `(\w+)` \|[^\n]*\| ([^|\n]+) \|$", text, re.MULTILINE)
            if m.group(1) in BUILTIN}
    assert set(rows) == set(BUILTIN)
    for name, info in BUILTIN.items():
        assert rows[name] == microbatch_rule(info), f"docs/language.md's microbatch rule of {name}"


@pytest.mark.parametrize("name", sorted(BUILTIN))
@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_nearest_fitting_count_fits(name, ranks):
    info = BUILTIN[name]
    for m in range(1, 4 * ranks):
        fits = nearest_fitting(info, ranks, m)
        assert microbatches_fit(info, ranks, fits)
        assert fits == m or not microbatches_fit(info, ranks, m)


_INTERLEAVED = """\
import "clusters/dgx_a100"
plan p {{
  model    = gpt(layers=16, hidden=256, heads=8, seq=128, vocab=1024)
  cluster  = dgx_a100 x 1
  mesh     = [dp = 2, pp = 4]
  train    = {{ global_batch: {batch}, micro_batch: 1 }}
  stages   = evenly over pp with virtual = 2
  schedule = interleaved_1f1b
}}
"""


@pytest.mark.parametrize("microbatches,ok", [(3, True), (4, True), (6, True), (10, True), (9, False), (11, False)])
def test_interleaved_needs_its_rounds_to_divide_m_not_a_multiple_of_pp(microbatches, ok):
    problems = [d for d in analyze("i.plan", text=_INTERLEAVED.format(batch=2 * microbatches)).diagnostics
                if d.is_error]
    assert (problems == []) == ok, problems
    if not ok:
        (problem,) = problems
        assert problem.code == "E502" and "rounds" in problem.message, problem.message


def test_generate_offers_the_schedules_check_accepts():
    from plandsl.search.choices import schedule_choices
    for pp, m in [(4, 9), (4, 3), (4, 6), (8, 12), (2, 1)]:
        offered = {name for name, _ in schedule_choices(pp, m, 64, None, None)}
        for name, info in BUILTIN.items():
            if not info.searched or (info.pipelines == 2 and pp % 2):
                continue
            assert (name in offered) == microbatches_fit(info, pp, m), (name, pp, m)


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_the_registry_columns_describe_the_generated_table(name):
    """`split_backward` and `rank_map` are what the generator lays out (the table has I and W actions,
    its stages sit on the ranks of the map), for the few sizes every built-in runs."""
    from plandsl.schedules.generators import generate
    from plandsl.schedules.program import Kind, loop_map, vshape_map
    info = BUILTIN[name]
    for ranks, microbatches in ((2, 4), (4, 8)):
        table = generate(name, ranks, microbatches)
        assert any(a.kind is Kind.I for row in table.actions for a in row) == info.split_backward
        assert any(a.kind is Kind.W for row in table.actions for a in row) == info.split_backward
        expected = vshape_map(ranks) if info.rank_map == "vshape" else loop_map(ranks, table.stages)
        assert tuple(table.stage_to_rank[0]) == tuple(expected)


def test_torch_classes_are_named_in_the_registry(torch_pipeline):
    import torch.distributed.pipelining as pipelining
    named = {name: info.torch_class for name, info in BUILTIN.items() if info.torch_class}
    assert set(torch_pipeline.TORCH_SCHEDULES) == set(named) and "zb_h1" not in named and "chimera" not in named
    for name, cls in torch_pipeline.TORCH_SCHEDULES.items():
        assert cls is getattr(pipelining, named[name]) and cls.__name__ == named[name]


_MAPPED = """import "clusters/local"
plan p {{
  model    = llama(layers=8, hidden=64, heads=4, seq=32, vocab=256)
  cluster  = localhost
  mesh     = [pp = 2] over devices[0:2]
  train    = {{ global_batch: 8, micro_batch: 1 }}
  stages   = evenly over pp with virtual = {virtual}, map = {mapping}
  schedule = {name}
}}
"""


@pytest.mark.parametrize("name", sorted(name for name, info in BUILTIN.items() if info.pipelines == 1))
def test_a_builtin_runs_its_own_stage_map_and_check_refuses_another(torch_pipeline, name):
    """`plandsl run` lays a built-in's stages out on the schedule's own map (torch's class: s mod pp or the V;
    the generated table's alike), so a plan whose `map` lists another was accepted by `check` and refused by
    `run` with a PipelineError; check's E409 now holds it, and the map check accepts is the one run runs."""
    from plandsl.ir.placement import assign_stages
    info = BUILTIN[name]
    virtual = 1 if info.virtual == "one" else 2
    runs = [0, 1, 1, 0] if info.rank_map == "vshape" else [0, 1] * virtual
    other = [1, 0, 0, 1] if info.rank_map == "vshape" else [0, 1, 1, 0] if virtual == 2 else [1, 0]
    for mapping, ok in ((runs, True), (other, False)):
        text = _MAPPED.format(virtual=virtual, mapping=mapping, name=name)
        analysis = analyze("m.plan", text=text)
        problems = [d for d in analysis.diagnostics if d.is_error]
        if ok:
            assert problems == [], problems
            (plan,) = analysis.document.plans
            _, runner_map = torch_pipeline._program_and_map(plan, plan.num_microbatches, name)
            assert tuple(runner_map) == tuple(assign_stages(plan)[0].rank_of_stage) == tuple(runs)
        else:
            assert [d.code for d in problems] == ["E409"] and "the schedule's map is" in problems[0].message, problems


def test_the_search_offers_each_pipeline_only_the_schedules_it_runs():
    """`schedule_choices` takes the pipeline by name (`Problem.pipeline`), one at a time: on a pipeline other than
    torch's only the schedules its `ScheduleInfo` flag marks (the checker's E610); a name it does not know is refused."""
    from plandsl import ir
    from plandsl.search.choices import schedule_choices
    torchs = {name for name, _ in schedule_choices(4, 16, 64, None, None, pipeline="torch")}
    assert torchs == {name for name, _ in schedule_choices(4, 16, 64, None, None)}
    for pipeline in ir.PIPELINE_IMPLEMENTATIONS[1:]:
        offered = {name for name, _ in schedule_choices(4, 16, 64, None, None, pipeline=pipeline)}
        assert offered and offered == {name for name in torchs if getattr(BUILTIN[name], pipeline)}, pipeline
    with pytest.raises(ValueError, match="unknown pipeline implementation 'megatorn'"):
        schedule_choices(4, 16, 64, None, None, pipeline="megatorn")
    with pytest.raises(TypeError):  # no flag a caller could pass beside another
        schedule_choices(4, 16, 64, None, None, True)
