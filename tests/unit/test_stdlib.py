"""The standard library of .plan files and the examples of docs/language.md: all of them check clean."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from plandsl import api
from plandsl.cli import main

ROOT = Path(__file__).resolve().parents[2]
STDLIB = ROOT / "stdlib_plans"
DOC = ROOT / "docs" / "language.md"

PLANS = sorted(STDLIB.rglob("*.plan"))
LOCAL = sorted((STDLIB / "local").glob("*.plan"))


def _id(path: Path) -> str:
    return str(path.relative_to(STDLIB))


def _render(analysis) -> str:
    return "\n".join(f"{d.code} {d.message}" for d in analysis.diagnostics)


def test_the_library_has_its_files():
    names = {_id(p) for p in PLANS}
    for expected in ("clusters/dgx_a100.plan", "clusters/dgx_h100.plan", "clusters/mixed_a100_h100.plan",
                     "clusters/dgx_b300.plan", "clusters/gb300_nvl72.plan",
                     "models/gpt2.plan", "models/gpt3.plan", "models/llama2.plan", "models/llama3.plan",
                     "models/mixtral.plan", "examples/gpt3_175b_3d.plan", "local/tiny.plan"):
        assert expected in names
    local = {p.stem for p in LOCAL}
    assert {"dp", "zero1", "fsdp", "tp_sp", "pp_1f1b", "pp_interleaved", "pp_custom_schedule", "dp_tp",
            "dp_pp", "tp_pp", "3d", "cp"} <= local


def test_stdlib_imports_resolve_to_this_tree():
    from plandsl.syntax.loader import stdlib_files
    assert "clusters/dgx_h100" in stdlib_files()
    assert "models/llama3" in stdlib_files()


@pytest.mark.parametrize("path", PLANS, ids=_id)
def test_checks_clean(path):
    analysis = api.check(path)
    assert analysis.document is not None
    assert not analysis.diagnostics, _render(analysis)


@pytest.mark.parametrize("path", PLANS, ids=_id)
def test_show_json(path):
    result = CliRunner().invoke(main, ["show", "--json", str(path)])
    assert result.exit_code == 0, result.output
    document = json.loads(result.output)
    assert document["version"] == 1
    if path.parent.name in ("examples", "local"):
        assert document["plans"], f"{path} defines no plan"


@pytest.mark.parametrize("path", PLANS, ids=_id)
def test_has_a_comment_header(path):
    first = path.read_text(encoding="utf-8").splitlines()[0]
    assert first.startswith("#"), f"{path} should start with a comment saying what it is"


# ---- examples -----------------------------------------------------------------------------
def test_gpt3_example_is_short():
    path = STDLIB / "examples" / "gpt3_175b_3d.plan"
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    assert len(lines) <= 16, f"{len(lines)} non-blank lines"
    (plan,) = api.load(path).plans
    assert plan.model.layers == 96 and plan.model.hidden == 12288
    assert plan.mesh.size == plan.cluster.num_devices == 1024
    assert (plan.dp, plan.pp, plan.tp) == (16, 8, 8)
    assert plan.stages.virtual > 1 and plan.schedule.name == "interleaved_1f1b"


def test_examples_cover_the_features():
    plans = {p.stem: api.load(p).plans for p in (STDLIB / "examples").glob("*.plan")}
    everything = [plan for group in plans.values() for plan in group]
    assert any(p.data and p.data.kind == "replicate" and p.mesh.size == p.dp for p in everything)
    assert any(p.data and p.data.kind == "zero3" for p in everything)
    assert any(p.stages and p.stages.mode == "explicit" for p in everything)
    assert any(p.cluster.heterogeneous for p in everything)
    assert any(p.experts and p.model.experts for p in everything)
    assert any(p.context and p.tensor for p in everything)
    user = {s.kind for group in (api.load(p).schedules for p in (STDLIB / "examples").glob("*.plan"))
            for s in group}
    assert user == {"table", "template"}


def test_heterogeneous_example_gives_the_h100s_more_layers():
    from plandsl.ir.placement import pipeline_rank_devices
    from plandsl.ir.placement import assign_stages
    (plan,) = api.load(STDLIB / "examples" / "heterogeneous.plan").plans
    devices = pipeline_rank_devices(plan)
    assert {d.name for d in devices[0]} == {"a100_80g"} and {d.name for d in devices[1]} == {"h100_80g"}
    assignment, _ = assign_stages(plan)
    first, second = assignment.stage_layers
    assert len(second) > len(first)


# ---- the local plans ----------------------------------------------------------------------
def _local_plans():
    return [(path, plan) for path in LOCAL for plan in api.load(path).plans]


def test_local_plans_train_the_same_model_the_same_way():
    """Every dense local plan trains tiny.plan's GPT; expert parallelism needs experts, so ep.plan's
    MoE Llama and deepseek.plan's tiny DeepSeek are the other models. All train with the same settings
    (hetero.plan cuts the same batch into uneven shares)."""
    plans = _local_plans()
    dense = [(path, plan) for path, plan in plans if plan.model.experts == 0]
    moe = [(path, plan) for path, plan in plans if plan.model.experts > 0]
    assert len(dense) >= 11 and sorted(path.name for path, _ in moe) == ["deepseek.plan", "ep.plan"]
    (tiny,) = api.load(STDLIB / "local" / "tiny.plan").plans
    for path, plan in dense:
        assert plan.model.model_dump() == tiny.model.model_dump(), path
    for path, plan in plans:
        assert plan.train.model_dump(exclude={"batch_shares"}) == tiny.train.model_dump(), path


@pytest.mark.parametrize("path", LOCAL, ids=_id)
def test_local_plan_runs_on_2_to_8_processes(path):
    for plan in api.load(path).plans:
        assert 2 <= plan.mesh.size <= 8
        assert plan.mesh.part == plan.mesh.size and plan.mesh.first_device == 0
        assert [g.node.name for g in plan.cluster.groups] in (["localhost"], ["fast_cpus", "slow_cpus"])  # local_mixed


@pytest.mark.parametrize("path", LOCAL, ids=_id)
def test_local_plan_says_how_to_run_it(path):
    text = path.read_text(encoding="utf-8")
    assert f"plandsl run stdlib_plans/local/{path.name} --steps 5 --check-equivalence" in text


_ACTION = re.compile(r"(\d+)([FBIW])(\d+)")


def validate_table(schedule, stages: int, microbatches: int) -> None:
    """Every (stage, microbatch) has one F and one B, and running the rows in order never waits
    forever: F(s, i) after F(s-1, i); B(s, i) after F(s, i) and B(s+1, i)."""
    rows = [[cell for cell in row if cell != "_"] for row in schedule.rows]
    actions = [cell for row in rows for cell in row]
    wanted = {f"{s}{kind}{i}" for s in range(stages) for kind in "FB" for i in range(microbatches)}
    assert sorted(actions) == sorted(wanted), "each (stage, microbatch) needs exactly one F and one B"
    done: set[str] = set()
    position = [0] * len(rows)
    while any(position[r] < len(rows[r]) for r in range(len(rows))):
        ready = []
        for r, row in enumerate(rows):
            if position[r] == len(row):
                continue
            stage, kind, mb = _ACTION.fullmatch(row[position[r]]).groups()
            stage, mb = int(stage), int(mb)
            needs = [f"{stage - 1}F{mb}"] if kind == "F" and stage else []
            if kind == "B":
                needs = [f"{stage}F{mb}"] + ([f"{stage + 1}B{mb}"] if stage + 1 < stages else [])
            if all(n in done for n in needs):
                ready.append(r)
        assert ready, f"deadlock after {sorted(done)}"
        for r in ready:
            done.add(rows[r][position[r]])
            position[r] += 1


@pytest.mark.parametrize("path", [STDLIB / "local" / "pp_custom_schedule.plan",
                                  STDLIB / "examples" / "schedule_table.plan"], ids=_id)
def test_table_schedules_are_valid_for_their_plan(path):
    from plandsl.ir.placement import assign_stages
    document = api.load(path)
    tables = {s.name: s for s in document.schedules if s.kind == "table"}
    (plan,) = document.plans
    schedule = tables[plan.schedule.name]
    assignment, _ = assign_stages(plan)
    assert schedule.sizes == {"ranks": plan.pp, "microbatches": plan.num_microbatches}
    assert len(schedule.rows) == plan.pp
    for rank, row in enumerate(schedule.rows):  # a rank only runs its own stages
        stages = set(assignment.rank_stages()[rank])
        assert {int(_ACTION.fullmatch(c).group(1)) for c in row if c != "_"} <= stages
    validate_table(schedule, assignment.num_stages, plan.num_microbatches)


# ---- docs/language.md -----------------------------------------------------------------------
def doc_blocks() -> list[tuple[int, str]]:
    """(line, text) of every ```plan block: each is a complete file that must check."""
    text = DOC.read_text(encoding="utf-8")
    blocks = []
    for match in re.finditer(r"^```plan[ \t]*\n(.*?)^```[ \t]*$", text, flags=re.M | re.S):
        blocks.append((text.count("\n", 0, match.start()) + 1, match.group(1)))
    return blocks


def test_doc_has_examples():
    assert len(doc_blocks()) >= 20


@pytest.mark.parametrize("line, text", doc_blocks(), ids=[f"line{line}" for line, _ in doc_blocks()])
def test_doc_example_checks(line, text):
    analysis = api.checks(text, path=f"<docs/language.md:{line}>")
    assert analysis.ok, f"docs/language.md block at line {line}:\n{_render(analysis)}"
    assert analysis.document is not None
    assert not analysis.diagnostics, f"docs/language.md block at line {line} warns:\n{_render(analysis)}"


def test_doc_limits_table_names_every_model_argument():
    """docs/language.md's Limits table lists every model argument `plandsl/diagnostics/limits.py` caps (E505)."""
    from plandsl.diagnostics.limits import MODEL_ARGUMENTS
    text = DOC.read_text(encoding="utf-8")
    table = text[text.index("### Limits"):]
    table = table[:table.index("\n\n", table.index("| Count |"))]
    named = set(re.findall(r"`(\w+)`", table))
    assert set(MODEL_ARGUMENTS) - named == set()
