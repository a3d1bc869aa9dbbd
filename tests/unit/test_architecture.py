"""The package's layout is its architecture (docs/architecture.md): one folder per stage, imports
that point one way, torch only in the interpreter. `lint-imports` checks pyproject's contracts."""
from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "plandsl"

importlinter = pytest.importorskip("importlinter.cli", reason="import-linter is in the `test` extra")


def test_the_layers_contract_holds():
    """Every contract of `[tool.importlinter]`: stages import downward only, torch only under runtime/,
    no cycles between the modules of one stage. A failure prints the offending import chains."""
    assert importlinter.lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True,
                                     no_logo=True) == 0


def test_the_root_holds_only_the_api_the_cli_and_stage_folders():
    modules = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert modules == ["__init__.py", "api.py", "cli.py", "run.py"]
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert {"diagnostics", "syntax", "ir", "schedules", "lower", "check", "cost", "search", "rewrite", "render",
            "runtime"} <= folders


def test_the_architecture_doc_lists_every_stage_folder_in_the_contract_order():
    """docs/architecture.md's tree and the layers contract name the same packages in the same order."""
    import tomllib
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    layers = next(c["layers"] for c in config["contracts"] if c["type"] == "layers")
    stages = [layer.removeprefix("plandsl.") for layer in layers if layer.count(".") == 1
              and (PACKAGE / layer.removeprefix("plandsl.")).is_dir()]
    doc = (ROOT / "docs" / "architecture.md").read_text()
    tree = doc[doc.index("plandsl/\n"):]
    positions = [tree.index(f"  {stage}/") for stage in stages]
    assert positions == sorted(positions, reverse=True), "the tree lists stages bottom-up, the contract top-down"
