"""The `plandsl` command: exit codes, output formats, --param, the frozen command surface.

Most tests use click's CliRunner (in-process, fast); a few run the real interpreter to
check the entry point, stream separation and what `--help` imports.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from plandsl.cli import main
from support import VALID_PLAN

VALID = VALID_PLAN
TWO_PLANS = VALID + VALID.replace('import "clusters/dgx_a100"\nparam nodes = 2\n', "").replace("plan p", "plan q") \
    .replace("pp = 2, tp = 2", "pp = 1, tp = 4").replace("stages  = evenly over pp\n  schedule = 1f1b\n", "")
BAD = VALID.replace("[dp = nodes * 8 / 4, pp = 2, tp = 2]", "[dp = nodes * 8 / 3, pp = 2, tp = 2]")
SYNTAX = "plan p {\n  model = \n}\n"


@pytest.fixture
def files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name, text in {"ok.plan": VALID, "two.plan": TWO_PLANS, "bad.plan": BAD, "syntax.plan": SYNTAX}.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    return tmp_path


def cli(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


# ---- interrupted ------------------------------------------------------------------------------
def test_ctrl_c_is_one_line_and_exit_130_not_clicks_aborted(files, monkeypatch):
    """Ctrl-C while a command works (here `check`, a plan read): click's `Aborted!`, exit 1, before, as a failure
    would exit; the signal by name and 128 + its number, as `plandsl run` and `profile` say it (docs/cli.md, Exit
    status), and nothing of the work's own output."""
    from plandsl import api

    def interrupted(path, params=None):
        raise KeyboardInterrupt
    monkeypatch.setattr(api, "check", interrupted)
    result = cli("check", "ok.plan")
    assert result.exit_code == 130, result.output
    assert result.stderr == "interrupted by SIGINT\n" and result.stdout == "", result.output


# ---- check ------------------------------------------------------------------------------------
def test_check_valid(files):
    result = cli("check", "ok.plan")
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == "ok.plan: ok"


def test_check_invalid(files):
    result = cli("check", "bad.plan")
    assert result.exit_code == 1
    assert "error[E211]" in result.stderr and "bad.plan:6:" in result.stderr
    assert "bad.plan: 1 error(s)" in result.stderr
    assert result.stdout == ""


def test_check_syntax_error(files):
    result = cli("check", "syntax.plan")
    assert result.exit_code == 1
    assert "error[E1" in result.stderr


@pytest.mark.parametrize("args, message", [
    ((), "Missing argument"),
    (("--nope", "ok.plan"), "No such option"),
    (("--param", "nodes", "ok.plan"), "KEY=VALUE"),
    (("--param", "=4", "ok.plan"), "KEY=VALUE"),
    (("--format", "xml", "ok.plan"), "xml"),
])
def test_check_usage_errors_exit_2(files, args, message):
    result = CliRunner().invoke(main, ["check", *args])
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_no_command_is_a_usage_error():
    result = CliRunner().invoke(main, [])
    assert result.exit_code in (0, 2)  # click prints the help; 2 since click 8.2
    assert "Usage:" in result.output
    assert CliRunner().invoke(main, ["frobnicate"]).exit_code == 2


def test_check_several_files_reports_all(files):
    result = cli("check", "ok.plan", "bad.plan", "syntax.plan")
    assert result.exit_code == 1
    assert "ok.plan: ok" in result.stdout
    assert "bad.plan: 1 error(s)" in result.stderr
    assert "syntax.plan: 1 error(s)" in result.stderr


def test_check_order_does_not_matter(files):
    assert cli("check", "bad.plan", "ok.plan").exit_code == 1
    assert cli("check", "ok.plan", "ok.plan").exit_code == 0


def test_check_json_one_object_per_line(files):
    result = cli("check", "--format", "json", "bad.plan", "syntax.plan", "ok.plan")
    assert result.exit_code == 1
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    records = [json.loads(line) for line in lines]
    assert {r["location"]["file"] for r in records} == {"bad.plan", "syntax.plan"}
    for r in records:
        assert set(r) >= {"code", "severity", "message", "location", "hint", "notes"}
        assert r["severity"] == "error"
    bad = next(r for r in records if r["location"]["file"] == "bad.plan")
    assert bad["code"] == "E211" and bad["location"]["line"] == 6


def test_check_json_valid_file_prints_nothing(files):
    result = cli("check", "--format", "json", "ok.plan")
    assert result.exit_code == 0
    assert result.stdout.strip() == ""


def test_check_param_override(files):
    assert cli("check", "--param", "nodes=4", "ok.plan").exit_code == 0
    # nodes=3: dp = 3 * 8 / 4 = 6; 64 is not divisible by 6 * 2.
    result = cli("check", "--param", "nodes=3", "ok.plan")
    assert result.exit_code == 1
    assert "E501" in result.stderr


def test_check_param_fixes_a_bad_file(files):
    text = BAD.replace("param nodes = 2", "param nodes = 2\nparam div = 3").replace("8 / 3", "8 / div")
    (files / "div.plan").write_text(text)
    assert cli("check", "div.plan").exit_code == 1
    assert cli("check", "--param", "div=4", "div.plan").exit_code == 0


def test_check_unknown_param_is_an_error(files):
    result = cli("check", "--param", "foo=1", "ok.plan")
    assert result.exit_code == 1
    assert "E201" in result.stderr and "foo" in result.stderr


def test_check_param_value_types(files):
    result = cli("check", "--param", "nodes=2.5", "ok.plan")
    assert result.exit_code == 1  # 2.5 nodes is not a whole number
    assert "error[E" in result.stderr
    result = cli("check", "--param", "nodes=two", "ok.plan")
    assert result.exit_code == 1


@pytest.mark.parametrize("value", ["\u0661", "\u0968", "nan", "inf", "Infinity", "0x4"])
def test_a_param_number_is_one_the_language_reads(files, value):
    """int() took `nodes=\u0661` (an Arabic-Indic digit one) as 1 and the plan checked with one node; a plan
    reads only ASCII digits as a number (grammar INT, FLOAT), and nan/inf are no numbers of its either."""
    result = cli("check", "--param", f"nodes={value}", "ok.plan")
    assert result.exit_code == 1 and "error[E" in result.stderr, result.stderr


def test_a_param_number_the_language_reads_is_typed(files):
    from plandsl.runtime.options import parse_params
    assert parse_params(["a=8", "b=-2", "c=1_000", "d=2.5", "e=1e-4", "f=true", "g=x", "h=1_", "i=2_.5"]) == \
        {"a": 8, "b": -2, "c": 1000, "d": 2.5, "e": 1e-4, "f": True, "g": "x", "h": 1, "i": 2.5}
    # `1_` is a number of the grammar's (int() refused it: exit 2 with Python's message, a traceback in plandsl.run)
    assert cli("check", "--param", "nodes=2_", "ok.plan").exit_code == 0


def test_check_warnings_only_is_ok(files):
    (files / "warn.plan").write_text(VALID.replace("param nodes = 2", "param nodes = 2\nparam spare = 1"))
    result = cli("check", "warn.plan")
    assert result.exit_code == 0
    assert "W201" in result.stderr
    assert "warn.plan: ok (1 warning(s))" in result.stdout


# ---- show ------------------------------------------------------------------------------------
def test_show_text(files):
    result = cli("show", "ok.plan")
    assert result.exit_code == 0, result.output
    assert "plan p" in result.stdout
    assert "dp=4" in result.stdout and "pp=2" in result.stdout and "tp=2" in result.stdout


def test_show_json_applies_params(files):
    result = cli("show", "--json", "--param", "nodes=4", "ok.plan")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["params"] == {"nodes": 4}
    (plan,) = doc["plans"]
    assert {a["name"]: a["size"] for a in plan["mesh"]["axes"]} == {"dp": 8, "pp": 2, "tp": 2}
    assert plan["cluster"]["groups"][0]["count"] == 4


def test_show_json_default(files):
    doc = json.loads(cli("show", "--json", "ok.plan").stdout)
    assert doc["version"] == 1 and doc["file"] == "ok.plan"
    assert {a["name"]: a["size"] for a in doc["plans"][0]["mesh"]["axes"]} == {"dp": 4, "pp": 2, "tp": 2}


def test_show_plan_by_name(files):
    result = cli("show", "--json", "--plan", "q", "two.plan")
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    assert plan["name"] == "q"
    assert {a["name"]: a["size"] for a in plan["mesh"]["axes"]} == {"dp": 4, "pp": 1, "tp": 4}
    text = cli("show", "--plan", "p", "two.plan")
    assert text.exit_code == 0 and "plan p" in text.stdout and "plan q" not in text.stdout


def test_show_unknown_plan(files):
    result = cli("show", "--plan", "r", "two.plan")
    assert result.exit_code == 1
    assert "E201" in result.stderr and "'r'" in result.stderr


def test_show_invalid_file(files):
    result = cli("show", "bad.plan")
    assert result.exit_code == 1
    assert "E211" in result.stderr and result.stdout == ""


def test_show_usage_errors(files):
    assert CliRunner().invoke(main, ["show"]).exit_code == 2
    assert CliRunner().invoke(main, ["show", "ok.plan", "two.plan"]).exit_code == 2
    assert CliRunner().invoke(main, ["show", "--param", "x", "ok.plan"]).exit_code == 2


# ---- schema, explain, help ---------------------------------------------------------------------------
def test_schema_is_json_schema():
    result = cli("schema")
    assert result.exit_code == 0
    schema = json.loads(result.stdout)
    assert "$defs" in schema or "properties" in schema
    assert schema["title"] == "Document"
    assert {"plans", "version", "file"} <= set(schema["properties"])
    assert "Plan" in schema["$defs"]


def test_explain_a_code():
    pytest.importorskip("plandsl.diagnostics.catalogue")
    result = cli("explain", "E203")
    assert result.exit_code == 0
    assert result.stdout.startswith("E203")
    assert cli("explain", "e203").stdout == result.stdout  # case-insensitive


def test_explain_every_registered_code():
    pytest.importorskip("plandsl.diagnostics.catalogue")
    from plandsl.diagnostics.codes import CODES
    for code in CODES:
        result = cli("explain", code)
        assert result.exit_code == 0, code
        assert code in result.stdout


def test_explain_unknown_code():
    pytest.importorskip("plandsl.diagnostics.catalogue")
    result = CliRunner().invoke(main, ["explain", "E999"])
    assert result.exit_code == 2
    assert "E999" in result.stderr


def test_lsp_without_pygls_says_what_to_install(monkeypatch):
    """`plandsl lsp` where pygls is not installed (simulated: importing it fails): exit 2 and the extra to install."""
    monkeypatch.setitem(sys.modules, "pygls", None)  # `import pygls...` raises ImportError, as when it is missing
    for name in [m for m in sys.modules if m.startswith("pygls.")]:  # and `from pygls.x import y` where an earlier
        monkeypatch.setitem(sys.modules, name, None)  # test of this worker imported pygls.x (found by its full name)
    for name in [m for m in sys.modules if m.startswith("plandsl.lsp.")]:
        monkeypatch.delitem(sys.modules, name)
    result = CliRunner().invoke(main, ["lsp"])
    assert result.exit_code == 2
    # E815 with its hint (an uncoded `error: plandsl lsp needs pygls: ...` line before), exit 2 as before
    assert result.stderr.startswith("error[E815]: plandsl lsp needs pygls, which is not installed here ("), result.stderr
    assert "= hint: pip install 'plandsl[lsp]' where the editor starts `plandsl lsp`" in result.stderr


def test_help_lists_the_commands():
    result = cli("--help")
    assert result.exit_code == 0
    for command in EXPECTED_SURFACE:
        assert command in result.stdout
    assert cli("-h").stdout == result.stdout


def test_every_command_has_help():
    for name in EXPECTED_SURFACE:
        result = cli(name, "--help")
        assert result.exit_code == 0 and "Usage:" in result.stdout


def test_version():
    result = cli("--version")
    assert result.exit_code == 0 and "0.1.0" in result.stdout


# ---- the frozen surface ------------------------------------------------------------------------------
# Changing the CLI is a deliberate act: update this table in the same change.
EXPECTED_SURFACE = {
    "check": {"arguments": ["files"], "options": {"--format", "--param", "--include", "--allow-model-import"}},
    "show": {"arguments": ["file"], "options": {"--json", "--plan", "--param", "--include", "--allow-model-import"}},
    "schema": {"arguments": [], "options": set()},
    "explain": {"arguments": ["code"], "options": set()},
    "fmt": {"arguments": ["files"], "options": {"--check"}},
    "lsp": {"arguments": [], "options": {"--stdio"}},
    "schedule": {"arguments": ["name"], "options": {"--costs", "--format", "--json", "--microbatches", "--ranks",
                                                    "--simulate", "--trace", "--virtual", "--include", "--allow-model-import"}},
    "simulate": {"arguments": ["file"], "options": {"--costs", "--json", "--param", "--plan", "--trace",
                                                    "--include", "--allow-model-import"}},
    "run": {"arguments": ["file"], "options": {"--check-equivalence", "--checkpoint-dir", "--checkpoint-every",
                                               "--data", "--device", "--dry-run", "--memory", "--metrics", "--nnodes",
                                               "--node-rank", "--nproc-per-node", "--param", "--plan", "--rdzv-endpoint",
                                               "--resume", "--steps", "--timeout", "--include", "--allow-model-import"}},
    "launch": {"arguments": ["file"], "options": {"--scheduler", "--dryrun", "--dry-run", "--cfg", "--image", "--cpu",
                                                  "--mem-mb", "--name", "--check-equivalence", "--checkpoint-dir",
                                                  "--checkpoint-every", "--data", "--device", "--metrics", "--param",
                                                  "--plan", "--resume", "--steps", "--timeout", "--include",
                                                  "--allow-model-import"}},
    "render": {"arguments": ["file"], "options": {"--color-by", "--format", "--output", "--param", "--plan", "--view",
                                                  "-o", "--include", "--allow-model-import"}},
    "shrink": {"arguments": ["file"], "options": {"--format", "--output", "--param", "--plan", "--precision", "--ranks", "-o",
                                                  "--include", "--allow-model-import"}},
    "estimate": {"arguments": ["file"], "options": {"--json", "--param", "--plan", "--include", "--allow-model-import",
                                                    "--against"}},
    "profile": {"arguments": [], "options": {"--nnodes", "--node-rank", "--nproc-per-node", "--output", "--quick", "--sustain",
                                             "--rdzv-endpoint", "-o"}},
    "inspect": {"arguments": ["source"], "options": {"--dtype", "--json", "--output", "--seq", "-o"}},
    "generate": {"arguments": [], "options": {"--cluster", "--format", "--global-batch", "--json", "--model", "--output", "--pin",
                                              "--precision", "--fp8-recipe", "--kernels", "--attention", "--loss", "--tensor-overlap", "--tensor-implementation", "--pipeline", "--seq-len", "--top", "-o", "--from", "--plan", "--param",
                                              "--include", "--time-limit", "--allow-model-import"}},
    "diff": {"arguments": ["file", "other"], "options": {"--plan-a", "--plan-b", "--format"}},
    "export": {"arguments": ["file"], "options": {"--to", "--plan", "--output", "-o", "--lossy", "--param", "--include",
                                                  "--allow-model-import"}},
    "import": {"arguments": ["args"], "options": {"--from", "--world-size", "--cluster", "--args-file", "--name", "--model",
                                                  "--output", "-o", "--format"}},
}
EXPECTED_GROUP_OPTIONS = {"--version", "--help", "-h"}


def _surface(command: click.Command) -> dict:
    return {
        "arguments": [p.name for p in command.params if isinstance(p, click.Argument)],
        "options": {opt for p in command.params if isinstance(p, click.Option)
                    for opt in p.opts + p.secondary_opts},
    }


def test_cli_surface_is_frozen():
    actual = {name: _surface(command) for name, command in main.commands.items()}
    assert actual == EXPECTED_SURFACE


def test_generate_tensor_overlap_takes_the_languages_implementations():
    """The option's words are `ir.TensorOverlap`'s (the CLI spells them out so that `--help` imports no stage); the
    option alone means async_tp, as before; another word is a usage error."""
    from plandsl import ir
    option = next(p for p in main.commands["generate"].params if p.name == "tensor_overlap")
    assert list(option.type.choices) == [o.value for o in ir.TensorOverlap] and option.flag_value == "async_tp"
    out = cli("generate", "--model", "llama3_8b", "--cluster", "dgx_h100", "--global-batch", "8",
              "--tensor-overlap", "nccl")
    assert out.exit_code == 2 and "'nccl' is not one of 'async_tp', 'userbuffers'" in out.output
    pipeline = next(p for p in main.commands["generate"].params if p.name == "pipeline")
    assert tuple(pipeline.type.choices) == ir.PIPELINE_IMPLEMENTATIONS  # whose pipeline: the language's words


def test_group_options_are_frozen():
    ctx = click.Context(main, **main.context_settings)  # as the command line makes it (help option names)
    options = {opt for p in main.get_params(ctx) for opt in p.opts + p.secondary_opts}
    assert options == EXPECTED_GROUP_OPTIONS


def test_commands_accept_short_help_flag():
    for name in EXPECTED_SURFACE:
        assert cli(name, "-h").exit_code == 0


# ---- a real process ----------------------------------------------------------------------------------
def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "plandsl.cli", *args], cwd=cwd, capture_output=True,
                            text=True, timeout=60)
    assert "Traceback" not in result.stderr, result.stderr
    return result


def test_subprocess_check_exit_codes_and_streams(files):
    ok = _run("check", "ok.plan", cwd=files)
    assert (ok.returncode, ok.stdout.strip(), ok.stderr) == (0, "ok.plan: ok", "")
    bad = _run("check", "ok.plan", "bad.plan", cwd=files)
    assert bad.returncode == 1
    assert "ok.plan: ok" in bad.stdout and "error[E211]" in bad.stderr
    usage = _run("check", cwd=files)
    assert usage.returncode == 2 and "Usage:" in usage.stderr


def test_subprocess_show_json(files):
    result = _run("show", "--json", "--param", "nodes=8", "ok.plan", cwd=files)
    assert result.returncode == 0
    doc = json.loads(result.stdout)
    assert doc["plans"][0]["mesh"]["axes"][0] == {"name": "dp", "size": 16}


def test_console_script_entry_point(files):
    import shutil
    exe = shutil.which("plandsl") or str(Path(sys.executable).parent / "plandsl")
    if not Path(exe).exists():
        pytest.skip("the plandsl console script is not on PATH")
    result = subprocess.run([exe, "check", "ok.plan"], cwd=files, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "ok.plan: ok" in result.stdout


def test_help_does_not_import_torch(tmp_path):
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "plandsl.cli", "--help"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    imported = [line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if "|" in line]
    assert imported, "no -X importtime output"
    # cli.py promises: heavy modules (pydantic, torch) are imported inside commands only.
    heavy = [name for name in imported if name.split(".")[0] in ("torch", "pydantic")]
    assert heavy == []


def test_help_through_main_leaves_torch_unimported(tmp_path):
    script = ("import sys\nfrom click.testing import CliRunner\nimport plandsl.cli\n"
              "result = CliRunner().invoke(plandsl.cli.main, ['--help'])\n"
              "assert result.exit_code == 0\n"
              "print('torch' in sys.modules)\n")
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_generate_pin_help_names_every_pin():
    """--pin's help lists every key the search takes (recompute_layers, offload_layers, account and
    sequence_parallel were missing from it)."""
    from plandsl.search import PIN_KEYS
    option = next(p for p in main.commands["generate"].params if p.name == "pins")
    assert [key for key in PIN_KEYS if key not in option.help] == []
