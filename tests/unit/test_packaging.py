"""The built wheel is complete: grammar, standard library and every sub-package ship, and an
installed copy parses and checks a plan from outside the repository.

The wheel is built from a scratch copy of the repository (so concurrent builds never share
`build/`), installed with `pip --no-deps --no-index` into a fresh venv that sees the system
site-packages for the dependencies, and imported there with the editable install's finder
switched off, so a file missing from the wheel cannot be picked up from the checkout.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from importlib import resources
from pathlib import Path

import pytest

from support import VALID_PLAN

# one worker builds the wheel (module-scoped) and runs every test that installs it
pytestmark = pytest.mark.xdist_group("packaging")

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))

JUNK = (".git", "build", "dist", "*.egg-info", "__pycache__", ".hypothesis", ".pytest_cache", ".venv", "venv",
        "*.pyc")

PLAN = VALID_PLAN

# Run inside the venv: switch off the editable install of the checkout, then import from the wheel.
PROBE = r"""
import json, sys
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f)]
sys.path_hooks[:] = [h for h in sys.path_hooks if "editable" not in repr(h)]
sys.path[:] = [p for p in sys.path if "__editable__" not in p]
sys.path_importer_cache.clear()

import plandsl.api as a, plandsl
from importlib import resources
from plandsl.syntax.loader import stdlib_files, stdlib_root

module = a.parse(open("plan.plan", encoding="utf-8").read(), "plan.plan")
document = a.load("plan.plan", {"nodes": 4})
analysis = a.check("plan.plan")
grammar = resources.files("plandsl.grammar").joinpath("plan.lark")
files = {name: getattr(m, "__file__", None) for name, m in sys.modules.items() if name.split(".")[0] == "plandsl"}
print(json.dumps({
    "items": len(module.items),
    "plans": [p.name for p in document.plans],
    "dp": document.plans[0].mesh.axis("dp").size,
    "ok": analysis.ok,
    "package_path": list(plandsl.__path__),
    "grammar": str(grammar),
    "stdlib_root": str(stdlib_root()),
    "stdlib_files": stdlib_files(),
    "module_files": files,
}))
"""


def _package_dirs() -> dict[str, Path]:
    """Import package -> source directory, from pyproject's explicit packages and package-dir."""
    tool = PYPROJECT["tool"]["setuptools"]
    mapping = tool.get("package-dir", {})
    return {name: ROOT / mapping.get(name, name.replace(".", "/")) for name in tool["packages"]}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("wheel")
    source = work / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*JUNK), symlinks=True)
    out = work / "dist"
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
         "-w", str(out), str(source)],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (built,) = out.glob("plandsl-*.whl")
    return built


@pytest.fixture(scope="module")
def wheel_names(wheel) -> set[str]:
    with zipfile.ZipFile(wheel) as archive:
        return set(archive.namelist())


@pytest.mark.slow
def test_wheel_has_grammar_and_stdlib(wheel_names):
    assert "plandsl/grammar/plan.lark" in wheel_names
    assert "plandsl/stdlib_plans/clusters/dgx_a100.plan" in wheel_names
    assert "plandsl/stdlib_plans/clusters/local.plan" in wheel_names
    for plan in (ROOT / "stdlib_plans").rglob("*.plan"):
        name = "plandsl/stdlib_plans/" + plan.relative_to(ROOT / "stdlib_plans").as_posix()
        assert name in wheel_names, f"{plan} is not in the wheel"


@pytest.mark.slow
def test_wheel_has_every_sub_package(wheel_names):
    source = {"plandsl." + d.relative_to(ROOT / "plandsl").as_posix().replace("/", ".")
              for d in (ROOT / "plandsl").rglob("*") if d.is_dir() and (d / "__init__.py").exists()}
    source |= {name for name, path in _package_dirs().items() if (path / "__init__.py").exists()}
    in_wheel = {name.rsplit("/", 1)[0].replace("/", ".") for name in wheel_names if name.endswith("/__init__.py")}
    assert in_wheel == source, "a package under plandsl/ is missing from [tool.setuptools] packages"


@pytest.mark.slow
def test_wheel_has_every_module(wheel_names):
    missing = []
    for name, directory in _package_dirs().items():
        prefix = name.replace(".", "/")
        for module in directory.glob("*.py"):
            if f"{prefix}/{module.name}" not in wheel_names:
                missing.append(f"{prefix}/{module.name}")
    for module in (ROOT / "plandsl").rglob("*.py"):  # also .py files in directories nobody listed
        if "__pycache__" not in module.parts:
            name = "plandsl/" + module.relative_to(ROOT / "plandsl").as_posix()
            if name not in wheel_names:
                missing.append(name)
    assert missing == []


@pytest.mark.slow
def test_wheel_metadata(wheel, wheel_names):
    assert not any(name.startswith(("tests/", "bench/", "docs/")) for name in wheel_names)
    with zipfile.ZipFile(wheel) as archive:
        (entry_points,) = [n for n in wheel_names if n.endswith(".dist-info/entry_points.txt")]
        text = archive.read(entry_points).decode()
        (metadata,) = [n for n in wheel_names if n.endswith(".dist-info/METADATA")]
        meta = archive.read(metadata).decode()
    assert "plandsl = plandsl.cli:main" in text
    for dependency in ("lark", "pydantic", "click"):
        assert f"Requires-Dist: {dependency}" in meta


def _venv(tmp_path: Path) -> Path:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)],
                   check=True, timeout=120)
    python = venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    if subprocess.run([str(python), "-m", "pip", "--version"], capture_output=True).returncode != 0:
        shutil.rmtree(venv)  # no pip to borrow from the system site-packages: let venv install one
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True,
                       timeout=300)
    return python


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    env["PYTHONNOUSERSITE"] = "1"
    return env


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """A venv with the wheel installed (once for the module: the tests only read it); its python."""
    home = tmp_path_factory.mktemp("installed")
    python = _venv(home)
    install = subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel)],
                             capture_output=True, text=True, timeout=300, env=_clean_env())
    assert install.returncode == 0, install.stderr
    return python


@pytest.mark.slow
def test_installed_wheel_works_outside_the_repo(installed, tmp_path):
    python = installed
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "plan.plan").write_text(PLAN, encoding="utf-8")
    result = subprocess.run([str(python), "-c", PROBE], cwd=outside, capture_output=True, text=True,
                            timeout=120, env=_clean_env())
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    venv = str(python.parent.parent)

    assert report["ok"] and report["plans"] == ["p"] and report["dp"] == 8 and report["items"] == 3
    assert [p for p in report["package_path"] if not p.startswith(venv)] == [], report["package_path"]
    assert report["grammar"].startswith(venv)
    assert report["stdlib_root"].startswith(venv)
    assert "clusters/dgx_a100" in report["stdlib_files"]
    expected = sorted(str(p.relative_to(ROOT / "stdlib_plans").with_suffix("")).replace(os.sep, "/")
                      for p in (ROOT / "stdlib_plans").rglob("*.plan"))
    assert report["stdlib_files"] == expected
    outside_venv = {name: path for name, path in report["module_files"].items()
                    if path is not None and not path.startswith(venv)}
    assert outside_venv == {}, "imported from outside the installed wheel"
    assert str(ROOT) not in result.stdout.replace(venv, "")


@pytest.mark.slow
def test_installed_console_script(installed, tmp_path):
    script = installed.parent / ("plandsl.exe" if os.name == "nt" else "plandsl")
    assert script.exists()
    (tmp_path / "plan.plan").write_text(PLAN, encoding="utf-8")
    (tmp_path / "bad.plan").write_text(PLAN.replace("/ 4", "/ 3"), encoding="utf-8")
    good = subprocess.run([str(script), "check", "plan.plan"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env=_clean_env())
    assert good.returncode == 0 and "plan.plan: ok" in good.stdout, good.stderr
    bad = subprocess.run([str(script), "check", "bad.plan"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120, env=_clean_env())
    assert bad.returncode == 1 and "E211" in bad.stderr and "Traceback" not in bad.stderr


def test_editable_install_loads_grammar_and_stdlib():
    import plandsl.syntax.parser
    if not Path(plandsl.syntax.parser.__file__).resolve().is_relative_to(ROOT):
        pytest.skip("plandsl is not installed from this checkout")
    grammar = resources.files("plandsl.grammar").joinpath("plan.lark")
    assert grammar.read_text(encoding="utf-8") == (ROOT / "grammar" / "plan.lark").read_text(encoding="utf-8")
    from plandsl.syntax.loader import stdlib_root
    assert stdlib_root().resolve() == (ROOT / "stdlib_plans").resolve()
    assert (stdlib_root() / "clusters" / "dgx_a100.plan").is_file()


def test_pyproject_lists_every_package_dir():
    """Cheap, no build: every directory with __init__.py under plandsl/ is a listed package."""
    listed = set(_package_dirs())
    found = {"plandsl." + d.relative_to(ROOT / "plandsl").as_posix().replace("/", ".")
             for d in (ROOT / "plandsl").rglob("*") if d.is_dir() and (d / "__init__.py").exists()
             and "__pycache__" not in d.parts}
    assert found <= listed, sorted(found - listed)
