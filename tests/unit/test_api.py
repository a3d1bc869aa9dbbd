"""`plandsl.api` is a library surface: each stage as a function returning data (IR, dataclasses, bytes),
exercised here on stdlib examples without the CLI."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from plandsl import api, ir
from plandsl.check.analysis import Analysis
from plandsl.cost.estimate import PlanEstimate
from plandsl.rewrite.generate import Generated
from plandsl.rewrite.shrink import Shrunk
from plandsl.schedules.program import Schedule
from plandsl.schedules.simulate import Simulation
from plandsl.syntax import Module

STDLIB = Path(__file__).resolve().parents[2] / "stdlib_plans"
GPT3 = STDLIB / "examples" / "gpt3_175b_3d.plan"
PP = STDLIB / "local" / "pp_1f1b.plan"


def test_importing_the_api_loads_no_stage():
    """The CLI imports `api` at start-up: pydantic, lark and torch load only when a function is called."""
    script = "import sys, plandsl.api\nprint(sorted(m for m in ('pydantic', 'lark', 'torch') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_load_and_check():
    assert isinstance(api.parse_file(GPT3), Module)
    assert isinstance(api.parse(GPT3.read_text()), Module)
    analysis = api.check(GPT3)
    assert isinstance(analysis, Analysis) and analysis.ok
    document = api.load(GPT3)
    assert isinstance(document, ir.Document)
    assert api.loads(GPT3.read_text(), path=str(GPT3)).plans[0].model_dump() == document.plans[0].model_dump()
    plan = api.load_plan(GPT3)
    assert isinstance(plan, ir.Plan) and plan == api.select_plan(document, "gpt3_megatron")
    with pytest.raises(api.PlanError):
        api.select_plan(document, "no_such_plan")
    assert api.run_refusals(api.load_runnable(PP)) == []
    bad = api.checks(GPT3.read_text().replace("gpt3_megatron {", "gpt3_megatron {{"), path="bad.plan")
    assert not bad.ok and all(isinstance(d, api.Diagnostic) for d in bad.diagnostics)
    with pytest.raises(api.PlanError):
        api.loads(GPT3.read_text().replace("gpt3_megatron {", "gpt3_megatron {{"), path="bad.plan")


def test_format_show_explain(tmp_path):
    data, text = api.format_file(str(GPT3))
    assert data == GPT3.read_bytes() and text == GPT3.read_text()  # the stdlib is in canonical layout
    messy = tmp_path / "messy.plan"
    messy.write_text(GPT3.read_text().replace("\n\n", "\n\n\n"))
    assert api.format_file(str(messy))[1] == text and api.format_text(messy.read_text()) == text
    with pytest.raises(api.PlanError, match="E10"):
        api.format_file(str(tmp_path))  # a directory
    assert "gpt3_megatron" in api.describe(api.load(GPT3))
    assert api.schema()["title"] == "Document"
    assert api.explain("e406").startswith("E406: ") and api.explain("E999") is None
    assert api.unknown_code("E999").startswith("unknown code 'E999'")


def test_schedule_simulate_estimate():
    found = api.schedule("1f1b", ranks=4, microbatches=8)
    assert isinstance(found, Schedule)
    assert json.loads(api.schedule_as(found, "json")) and "F" in api.schedule_as(found, "text")
    simulation = api.simulate_schedule(found, api.parse_costs("F=1,B=2"))
    assert isinstance(simulation, Simulation) and simulation.deadlock is None
    assert simulation.makespan == pytest.approx((8 + 3) * 3)  # 1f1b's bubble: (p - 1) forward+backward slots
    assert api.chrome_trace(simulation)["traceEvents"]
    plan = api.load_plan(GPT3)
    schedule, simulated = api.simulate(plan)
    assert isinstance(schedule, Schedule) and isinstance(simulated, Simulation) and simulated.makespan > 0
    assert "bubble" in api.simulation_report(schedule, simulated, " s", True)
    result = api.estimate(plan)
    assert isinstance(result, PlanEstimate) and result.time.step > 0
    assert "step" in api.format_estimate(result)


def test_generate_from_options_and_from_a_plan():
    request = api.generate_request(model="gpt(layers=8, hidden=1024, heads=16, seq=1024, vocab=51200)",
                                   cluster="dgx_a100 x 2", global_batch=32, top=2)
    calls = []
    generated = api.generate(request, lambda done, total: calls.append((done, total)))
    assert isinstance(generated, Generated) and 1 <= len(generated.texts) <= 2
    assert calls and calls[-1][0] == calls[-1][1]  # progress reached its total
    assert all(api.checks(text, path="generated.plan").ok for text in generated.texts)
    assert [c["plan"] for c in api.generate_json(generated)["candidates"]] == list(generated.texts)
    assert api.generate_report(generated).count("\n") >= 2
    usage_problem = api.generate_usage_error()
    with pytest.raises(usage_problem, match="--model, --cluster and --global-batch are required"):
        api.generate(api.generate_request(model="gpt2"))
    with pytest.raises(usage_problem, match="--model: the --from plan gives these"):
        api.generate(api.generate_request(model="gpt2", from_file=str(PP)))
    completed = api.generate(api.generate_request(from_file=str(PP), top=1))
    assert isinstance(completed, Generated) and api.checks(completed.texts[0], path=str(PP)).ok


def test_shrink_and_render():
    shrunk = api.shrink(GPT3, ranks=8)
    assert isinstance(shrunk, Shrunk) and shrunk.ranks <= 8 and isinstance(shrunk.plan, ir.Plan)
    assert api.checks(shrunk.text, path=str(GPT3)).ok
    plan = api.load_plan(GPT3)
    dot = api.render(plan, "mesh", "dot")
    assert isinstance(dot, bytes) and b"\ndigraph mesh {" in dot
    assert api.render_format(None, None, "all") == "html" and api.render_format("x.svg", None, "mesh") == "svg"
    assert api.render_format("x.unknown", None, "mesh") is None
    assert api.color_by_problem(plan, "tp") is None and "no axis 'zz'" in api.color_by_problem(plan, "zz")


def test_run_is_prepared():
    plan = api.load_runnable(PP)
    options = api.launch_options(steps=3)
    args = api.prepare_run(plan, str(PP), None, {"layers": 4}, options)
    assert args[0] == "--standalone" and args[args.index("-m") + 1] == "plandsl.run"
    assert args[args.index("--steps") + 1] == "3" and "layers=4" in args
    assert api.command_line(args).startswith("torchrun --standalone")
    with pytest.raises(api.option_error()) as error:
        api.check_launch_options(api.launch_options(nnodes=2, node_rank=2))
    assert error.value.option == "--node-rank"
    with pytest.raises(api.PlanError) as refused:
        api.prepare_run(api.load_plan(GPT3), str(GPT3), None, {}, options)  # 1,024 devices, one machine
    assert [d.code for d in refused.value.diagnostics] == ["E711"] and len(refused.value.sources) == 1


@pytest.mark.slow  # imports torch and builds every rank on the meta device (~10 s on 2 cores)
def test_dry_run_builds_every_rank_and_reports_progress():
    pytest.importorskip("torch")
    plan = api.load_runnable(PP)
    seen = []
    result = api.dry_run(plan, lambda done, total: seen.append((done, total)))
    assert result.world == plan.mesh.size and len(result.ranks) == plan.mesh.size
    assert seen[-1] == (plan.mesh.size, plan.mesh.size)
    assert "dry run of plan 'tiny_pp_1f1b'" in api.format_dry_run(result)
