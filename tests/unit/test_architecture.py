"""The package's layout is its architecture (docs/architecture.md): one folder per stage, imports
that point one way, torch only in the interpreter. `lint-imports` checks pyproject's contracts."""
from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "plandsl"


def test_the_layers_contract_holds():
    """Every contract of `[tool.importlinter]`: stages import downward only, torch only under runtime/,
    no cycles between the modules of one stage. A failure prints the offending import chains."""
    # imported here, not at collection, where every xdist worker paid for it (~0.4 CPU-s with its imports)
    importlinter = pytest.importorskip("importlinter.cli", reason="import-linter is in the `test` extra")
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


def _function_level_imports():
    """(file, line, statement text, reason) of every import inside a function or method of plandsl/."""
    import ast
    for path in sorted(PACKAGE.rglob("*.py")):
        if {"grammar", "stdlib_plans"} & set(path.relative_to(PACKAGE).parts):
            continue
        lines = path.read_text().splitlines()
        # The imports under a function: a walk of the statements only (an import is one, and so is every
        # block that holds one), not of every expression node (~1 CPU-s less over the package)
        inside, pending = [], [(node, False) for node in ast.parse("\n".join(lines)).body]
        while pending:
            node, in_function = pending.pop()
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                if in_function:
                    inside.append(node)
                continue
            in_function = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            for field in ("body", "orelse", "finalbody", "handlers", "cases"):  # blocks, except clauses, match cases
                body = getattr(node, field, ())
                pending.extend((child, in_function) for child in (body if isinstance(body, list) else ()))
        seen = set()
        for node in sorted(inside, key=lambda node: node.lineno):
            if node.lineno not in seen:
                seen.add(node.lineno)
                comments = [line.partition("#")[2].strip() for line in
                            (lines[node.lineno - 1], lines[node.end_lineno - 1])]
                above = lines[node.lineno - 2].strip()
                comments.append(above[1:].strip() if above.startswith("#") else "")
                reason = next((c for c in comments if c and not c.startswith(("noqa", "type:", "pragma"))), "")
                yield path.relative_to(ROOT), node.lineno, lines[node.lineno - 1].strip(), reason


def test_every_import_inside_a_function_says_why():
    """Imports go at the top of a module; one inside a function keeps torch (or another slow module) out of
    `plandsl --help`, `check` and `import plandsl.api`, or a torch internal out of the import, and says so
    in a comment on its line or the line above (`# lazy: ...`; api.py's `# stage`, see its docstring)."""
    imports = list(_function_level_imports())
    assert any(path.name == "api.py" for path, *_ in imports), "the walk found no function-level import at all"
    silent = [f"{path}:{line}: {text}" for path, line, text, reason in imports if not reason]
    assert silent == [], "move these to the module's top, or say why they cannot be there:\n" + "\n".join(silent)


def test_no_import_cycle_runs_through_a_package_init():
    """`lint-imports`' acyclic_siblings contract looks at the modules of a package, not at the package's
    `__init__`: a module importing its own package's `__init__`, which imports it back, passes it. Here no
    module of plandsl may reach itself through any import (inside functions too; imports only for type
    checkers left out)."""
    import grimp
    graph = grimp.build_graph("plandsl", cache_dir=None, exclude_type_checking_imports=True)
    cycles = []
    for module in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(module)):
            chain = graph.find_shortest_chain(importer=imported, imported=module)
            if chain is not None:
                cycles.append(" -> ".join((module, *chain)))
    assert cycles == [], "import cycles:\n" + "\n".join(cycles)


def test_check_loads_no_torch_and_no_later_stage(tmp_path):
    """`plandsl check` imports the stages it runs (syntax, lower, ir, check and the parts of schedules and
    cost the checker uses), not torch, numpy, graphviz's caller, the search, the rewriters or the
    interpreter (only `runtime.options`, from which the CLI builds `run`'s options)."""
    import subprocess
    import sys
    plan = ROOT / "stdlib_plans" / "examples" / "gpt3_175b_3d.plan"
    script = ("import runpy, sys\nsys.argv = ['plandsl', 'check', sys.argv[1]]\n"
              "try:\n    runpy.run_module('plandsl.cli', run_name='__main__')\nexcept SystemExit as done:\n"
              "    code = done.code\nprint(code, *sorted(sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", script, str(plan)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    code, *modules = done.stdout.splitlines()[-1].split()
    assert code in ("0", "None") and "plandsl.check" in modules
    heavy = [m for m in modules if m.split(".")[0] in ("torch", "numpy")
             or m.startswith(("plandsl.search", "plandsl.rewrite", "plandsl.render"))
             or (m.startswith("plandsl.runtime.") and m != "plandsl.runtime.options")]
    assert heavy == []
