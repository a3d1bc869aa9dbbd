"""The editor grammar (grammar/plan.tmLanguage.json) against the language's own tables, so the two cannot
drift: every keyword of grammar/plan.lark, every unit, built-in schedule and built-in function has a rule
that scopes it; the annotated samples (tests/tmgrammar/*.plan) pass `vscode-tmgrammar-test` (npm), run on
the grammar as editors/vscode/package.json wires it; and the samples are plans the parser accepts."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from plandsl import api
from plandsl.lower.evaluate import MATH
from plandsl.lower.inspected import SOURCES
from plandsl.lower.model import FAMILIES
from plandsl.lower.units import UNITS
from plandsl.schedules.registry import BUILTIN
from plandsl.syntax.parser import keywords

ROOT = Path(__file__).resolve().parents[2]
GRAMMAR = json.loads((ROOT / "grammar" / "plan.tmLanguage.json").read_text())
EXTENSION = ROOT / "editors" / "vscode"
SAMPLES = sorted((ROOT / "tests" / "tmgrammar").glob("*.plan"))
TOOL_VERSION = "0.1.3"  # .ci/run installs this version into .ci/node (git-ignored)


def rules() -> list[dict]:
    """Every rule of the grammar with a `match`, from the top-level patterns and the repository."""
    found, pending = [], list(GRAMMAR["patterns"]) + list(GRAMMAR["repository"].values())
    while pending:
        rule = pending.pop()
        if "match" in rule:
            found.append(rule)
        pending += rule.get("patterns", [])
    return found


def scopes_of(rule: dict, text: str) -> list[tuple[str, str]]:
    """(matched text, scope) for each scoped part of each match of `rule` in `text` (Python's `re` reads
    these patterns as Oniguruma does: they use nothing else)."""
    out = []
    for match in re.finditer(rule["match"], text):
        if "name" in rule:
            out.append((match.group(0), rule["name"]))
        for group, capture in rule.get("captures", {}).items():
            if match.group(int(group)) is not None:
                out.append((match.group(int(group)), capture["name"]))
    return out


def scoped(text: str, word: str, prefixes: tuple[str, ...]) -> bool:
    return any(part == word and scope.startswith(prefixes) for rule in rules() for part, scope in scopes_of(rule, text))


def test_every_keyword_of_the_grammar_has_a_rule():
    missing = [k for k in keywords() if not scoped(f"a {k} b", k, ("keyword.", "constant.language."))]
    assert not missing, f"grammar/plan.lark's keywords without a rule in plan.tmLanguage.json: {missing}"
    assert len(keywords()) >= 25  # the grammar's keywords were found at all


def test_units_schedules_and_builtins_have_rules():
    assert [u for u in UNITS if not scoped(f"= 1 {u}", u, ("keyword.other.unit.",))] == []
    assert [u for u in UNITS if not scoped(f"= 1{u}", u, ("keyword.other.unit.",))] == []
    assert [s for s in BUILTIN if not scoped(f"schedule = {s}", s, ("support.constant.schedule.",))] == []
    functions = {*FAMILIES, *MATH, *SOURCES, "image"}
    assert [f for f in functions if not scoped(f"= {f}(1)", f, ("support.function.",))] == []


def test_the_grammar_and_the_extension_agree():
    package = json.loads((EXTENSION / "package.json").read_text())
    (grammar,) = package["contributes"]["grammars"]
    assert (EXTENSION / grammar["path"]).resolve() == (ROOT / "grammar" / "plan.tmLanguage.json").resolve()
    assert grammar["scopeName"] == GRAMMAR["scopeName"] == "source.plandsl"
    (language,) = package["contributes"]["languages"]
    assert language["extensions"] == [".plan"] and language["id"] == grammar["language"]
    configuration = json.loads((EXTENSION / language["configuration"]).read_text())
    assert configuration["comments"]["lineComment"] == "#"
    assert "vscode-languageclient" in package["dependencies"]
    assert '"lsp"' in (EXTENSION / "extension.js").read_text()  # it starts `plandsl lsp`


def test_the_samples_are_plans():
    assert SAMPLES
    for sample in SAMPLES:
        api.parse(sample.read_text(), str(sample))  # raises PlanError on a sample that is not a plan
    shipped = ROOT / "tests" / "tmgrammar" / "gpt3_175b_3d.plan"  # the stdlib file, assertions interleaved
    lines = [line for line in shipped.read_text().splitlines()[1:] if not re.match(r"#\s*(\^|<-)", line)]
    assert lines == (ROOT / "stdlib_plans" / "examples" / "gpt3_175b_3d.plan").read_text().splitlines()


def _tool() -> list[str] | None:
    local = ROOT / ".ci" / "node" / "node_modules" / ".bin" / "vscode-tmgrammar-test"
    found = str(local) if local.exists() else shutil.which("vscode-tmgrammar-test")
    return [found] if found and shutil.which("node") else None


def test_the_samples_pass_vscode_tmgrammar_test():
    tool = _tool()
    if tool is None:
        pytest.skip("vscode-tmgrammar-test or node is missing: "
                    f"npm install --prefix .ci/node vscode-tmgrammar-test@{TOOL_VERSION} (see the README)")
    result = subprocess.run([*tool, "--config", str(EXTENSION / "package.json"), "tests/tmgrammar/*.plan"],
                            cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert len(re.findall(r"run successfuly|run successfully", result.stdout)) == len(SAMPLES), result.stdout
