"""Diagnostics end to end: the catalogue covers every code, every example produces its
code (and its fix does not), rendered output matches tests/golden/diagnostics/, docs
stay generated, the CLI explains and reports, and a file's problems come all at once."""
from __future__ import annotations

import importlib
import importlib.util
import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from plandsl.check.analysis import analyze
from plandsl.diagnostics.catalogue import ENTRIES, FAMILIES, explain
from plandsl.diagnostics.source import _columns
from plandsl.cli import main
from plandsl.diagnostics.codes import CODES
from plandsl.diagnostics import MAX_PER_FILE, render_all

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("make_errors_doc", ROOT / "tests" / "make_errors_doc.py")
make_errors_doc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_errors_doc)
run_example = make_errors_doc.run_example


# ---- (a) the catalogue and the registry agree ------------------------------------------
def test_every_code_has_an_entry_and_every_entry_a_code():
    assert set(ENTRIES) == set(CODES)
    for code, entry in ENTRIES.items():
        assert entry.code == code
        assert entry.title == CODES[code]
        assert entry.explanation and entry.fix and (entry.example.strip() or code == "E809")  # E809's: an empty file



# One module of plandsl/diagnostics/catalogue/ per family, named for what its codes are about.
FAMILY_MODULES = {"syntax": "E1", "names": "E2", "meshes": "E3", "placement": "E4", "training": "E5",
                  "schedules": "E6", "refusals": "E7", "rewrite": "E8", "models": "E9", "warnings": "W"}


def test_each_family_module_holds_exactly_its_family_and_together_they_hold_every_code():
    folder = ROOT / "plandsl" / "diagnostics" / "catalogue"
    assert {p.stem for p in folder.glob("*.py")} - {"__init__", "entry"} == set(FAMILY_MODULES)
    held: list[str] = []
    for name, prefix in FAMILY_MODULES.items():
        family = importlib.import_module(f"plandsl.diagnostics.catalogue.{name}").FAMILY
        assert family.prefix == prefix and family in FAMILIES
        codes = [entry.code for entry in family.entries]
        expected = {code for code in CODES if (code[:1] if code.startswith("W") else code[:2]) == prefix}
        assert sorted(codes) == sorted(expected), f"{name}.py must hold exactly the {prefix} codes"
        held += codes
    assert sorted(held) == sorted(CODES)
    assert len(FAMILIES) == len(FAMILY_MODULES)

# E705's example (a shard rule) makes `plandsl run`'s checks import torch (~3 CPU-s), E9xx's run
# `plandsl inspect` (torch and the example's module) and E412-E414's inspect their plan's Hugging Face model
# first: their cases run in the xdist group of the modules that import torch (tests/conftest.py), so only
# one worker pays for it
TORCH_CODES = {"E110", "E412", "E413", "E414", "E506", "E705", "E709", "E716", "E720", "E901", "E902", "E903", "E904", "E905"}
# E715 and E717-E719's commands (or their fixes) hand the job to TorchX, where the `launch` extra installed it (CI's
# interop extra does), on the worker of tests/unit/test_launch_torchx.py
TORCHX_CODES = {"E715", "E717", "E718", "E719"}
NO_TORCHX = importlib.util.find_spec("torchx") is None
NO_PYGLS = importlib.util.find_spec("pygls") is None
ALL_CODES = [pytest.param(code, marks=pytest.mark.xdist_group("torch")) if code in TORCH_CODES else
             pytest.param(code, marks=[pytest.mark.xdist_group("torchx"),
                                       pytest.mark.skipif(NO_TORCHX, reason="pip install 'plandsl[launch]'")])
             if code in TORCHX_CODES else
             pytest.param(code, marks=pytest.mark.skipif(NO_PYGLS, reason="pip install 'plandsl[lsp]'"))
             if code == "E815" else code  # its fix starts the language server: pygls installed
             for code in sorted(CODES)]


# ---- (b) examples produce their code; fixes remove it ---------------------------------------
@pytest.mark.parametrize("code", ALL_CODES)
def test_example_produces_exactly_its_code(code):
    analysis, _ = run_example(ENTRIES[code])
    assert [d.code for d in analysis.diagnostics] == [code], \
        f"{code}'s example should give one {code} and nothing else"


@pytest.mark.parametrize("code", ALL_CODES)
def test_fix_removes_the_problem(code):
    entry = ENTRIES[code]
    assert entry.edits or entry.encoding != entry.fixed_encoding or entry.internal or entry.fixed_command, (
        f"catalogue entry {code} has no machine-applicable fix: after the fix sentence, pass `(old, new)` "
        "pairs that turn the example into a plan without the problem, e.g. `_entry(\"E501\", ..., "
        "\"Make the batch divisible.\", (\"global_batch: 30\", \"global_batch: 32\"))`")
    for old, _ in entry.edits:
        assert entry.example.count(old) == 1, f"{code}: edit {old!r} must match the example exactly once"
    analysis, rendered = run_example(entry, fixed=True)
    assert code not in [d.code for d in analysis.diagnostics], f"{code}'s fix does not remove it:\n{rendered}"
    assert analysis.diagnostics == [], f"{code}'s fix leaves other problems:\n{rendered}"


# ---- (c) golden renderings ---------------------------------------------------------------------
@pytest.mark.parametrize("code", ALL_CODES)
def test_rendered_example_matches_golden(code, golden):
    _, rendered = run_example(ENTRIES[code])
    first = rendered.splitlines()[0]
    if ENTRIES[code].command_line:  # E712-E715: the options are wrong, not a line of the example: no location
        assert re.match(rf"error\[{code}\]: ", first) and "^" not in rendered, first
    else:
        assert re.match(rf"{re.escape(ENTRIES[code].file)}:\d+:\d+: (error|warning)\[{code}\]: ", first), first
        assert "^" in rendered or ENTRIES[code].internal, \
            "the rendering must show the source line with a caret under the span"
    golden(f"diagnostics/{code}.txt", rendered + "\n")


# ---- docs/errors.md is generated from the catalogue -----------------------------------------
@pytest.mark.xdist_group("torch")  # it runs every example, E705's too
def test_errors_doc_is_up_to_date():
    if NO_TORCHX:
        pytest.skip("E715, E717-E719's examples hand their jobs to TorchX: pip install 'plandsl[launch]'")
    if NO_PYGLS:
        pytest.skip("E815's fix starts the language server: pip install 'plandsl[lsp]'")
    expected = make_errors_doc.render_errors_doc()
    doc = ROOT / "docs" / "errors.md"
    assert doc.exists() and doc.read_text(encoding="utf-8") == expected, \
        "docs/errors.md is stale: run `python tests/make_errors_doc.py`"
    for code in CODES:
        assert f"### {code}: " in expected


# ---- (d) plandsl explain -------------------------------------------------------------------------
def test_explain_prints_the_entry():
    result = CliRunner().invoke(main, ["explain", "E501"])
    assert result.exit_code == 0, result.output
    entry = ENTRIES["E501"]
    assert result.output.startswith(f"E501: {CODES['E501']}\n")
    assert result.output.rstrip("\n") == explain("E501")
    for part in ("Example (example.plan):", "    plan p {", "Fix: ", "global_batch: 32", "same whole"):
        assert part in result.output
    assert entry.fix in result.output


def test_explain_is_case_insensitive():
    result = CliRunner().invoke(main, ["explain", "w302"])
    assert result.exit_code == 0 and result.output.startswith("W302: ")


def test_explain_unknown_code_is_a_usage_error():
    result = CliRunner().invoke(main, ["explain", "E999"])
    assert result.exit_code == 2
    assert explain("E999") is None


# ---- (e) JSON output -------------------------------------------------------------------------------
THREE_MISTAKES = """\
import "clusters/dgx_a100"
param step_time = 2 sec
plan p {
  model   = gpt(layers=4, hidden=384, heads=6, seq=128, vocab=1024)
  cluster = dgx_a100 x 1
  mesh    = [dp = 2, tp = 4]
  train   = { global_batch: 15, micro_batch: 1 }
}
"""


def test_check_json_prints_one_object_per_line(tmp_path):
    path = tmp_path / "bad.plan"
    path.write_text(THREE_MISTAKES, encoding="utf-8")
    result = CliRunner().invoke(main, ["check", "--format", "json", str(path)])
    assert result.exit_code == 1
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 3
    objects = [json.loads(line) for line in lines]
    for obj in objects:
        assert {"code", "severity", "message", "location", "hint", "notes"} <= set(obj)
        assert obj["severity"] == "error"
        assert isinstance(obj["notes"], list)
    located = [o for o in objects if o["location"] is not None]
    assert located, "at least the unit and batch errors have a location"
    for obj in located:
        assert {"file", "line", "column"} <= set(obj["location"])
        assert obj["location"]["file"].endswith("bad.plan")
    unit = next(o for o in objects if o["code"] == "E204")
    assert unit["location"]["line"] == 2 and unit["location"]["column"] == 19
    assert "'sec'" in unit["message"]


def test_docs_cli_md_lists_every_key_of_a_diagnostics_json():
    """docs/cli.md's table of a diagnostic's JSON keys is the schema consumers read: every key `to_json` writes is
    in it, `capped` too (9fa8bfc wrote it on an import's counting diagnostic, documented in the import's prose only)."""
    from plandsl.diagnostics import diag
    text = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    table = text[text.index("`--format json` prints one JSON object per diagnostic"):].split("\n\n")[1]
    listed = re.findall(r"^ *\| `(\w+)` \|", table, re.M)
    assert listed == list(diag("E804", "and 5 more unknown flags", capped=(20, 25)).to_json())


# ---- (f) every problem at once, no follow-on noise -------------------------------------------------
def test_independent_mistakes_are_all_reported_in_one_run():
    analysis = analyze("three.plan", text=THREE_MISTAKES)
    assert sorted(d.code for d in analysis.diagnostics) == ["E204", "E406", "E501"]
    by_code = {d.code: d for d in analysis.diagnostics}
    assert "heads (6)" in by_code["E406"].message and "'tp' (4)" in by_code["E406"].message
    assert "global batch 15" in by_code["E501"].message


def test_an_error_in_one_attribute_stops_later_checks_of_that_plan():
    text = THREE_MISTAKES.replace("vocab=1024)", "vocab=1024, dropout=0.1)").replace("param step_time = 2 sec\n", "")
    analysis = analyze("one.plan", text=text)
    # the model is unknown, so neither the tp split of its heads nor anything else about it is judged
    assert [d.code for d in analysis.diagnostics] == ["E212"]


def test_a_broken_definition_is_reported_once_however_often_it_is_used():
    text = """\
device v100 {
  memory    = 32 Gib
  bandwidth = 900 GB/s
  peak      = { fp32: 15.7 TFLOP/s, fp16: 125 TFLOP/s }
}
node dgx1 {
  devices = 8 x v100
  link    = { bandwidth: 150 GB/s }
}
plan a {
  model = gpt(layers=4, hidden=256, heads=8, seq=128, vocab=1024)
  cluster = dgx1 x 1
  mesh = [dp = 8]
  train = { global_batch: 16 }
}
plan b {
  model = gpt(layers=4, hidden=256, heads=8, seq=128, vocab=1024)
  cluster = dgx1 x 2
  mesh = [dp = 16]
  train = { global_batch: 17 }
}
"""
    analysis = analyze("two.plan", text=text)
    assert [d.code for d in analysis.diagnostics] == ["E204"]


# ---- (g) at most 100 problems shown per file -------------------------------------------------------
def test_more_than_100_problems_are_capped_with_a_count():
    text = "".join(f"param p{i} = {i} foo\n" for i in range(120))
    analysis = analyze("many.plan", text=text)
    assert len(analysis.diagnostics) == 120
    assert [d.code for d in analysis.diagnostics] == ["E204"] * 120
    assert len({d.span.line for d in analysis.diagnostics}) == 120, "one diagnostic per line"
    rendered = render_all(analysis.diagnostics, analysis.sources)
    assert rendered.count("error[E204]") == MAX_PER_FILE == 100
    assert "many.plan:100:" in rendered and "many.plan:101:" not in rendered
    assert rendered.splitlines()[-1] == "many.plan: ... and 20 more problems not shown"


# ---- (g) one role per mesh axis; context parallelism's share of the sequence ---------------------------
_ROLES = """\
import "clusters/dgx_a100"
plan p {{
  model   = {model}
  cluster = dgx_a100 x 1
  mesh    = [{mesh}]
  train   = {{ global_batch: 16, micro_batch: 1 }}
  {lines}
}}
"""
_LLAMA_MOE = "llama(layers=4, hidden=256, heads=8, kv_heads=2, seq=128, vocab=1024, experts=4)"


@pytest.mark.parametrize("mesh,lines,codes", [
    ("dp = 2, cp = 4", "data = replicate over cp\n  context = allgather over cp", ["E307"]),  # E307 names dp
    ("dp = 2, tp = 4", "data = zero1 over dp\n  stages = evenly over dp\n  tensor = megatron over tp", ["E307"]),
    ("dp = 2, ep = 4", "data = zero3 over [dp, ep]\n  experts = alltoall over ep", []),  # ep splits the batch too
], ids=["data_and_context", "data_and_stages", "data_and_experts"])
def test_each_mesh_axis_has_one_role(mesh, lines, codes):
    model = _LLAMA_MOE if "experts" in lines else "gpt(layers=4, hidden=256, heads=8, seq=128, vocab=1024)"
    analysis = analyze("roles.plan", text=_ROLES.format(model=model, mesh=mesh, lines=lines))
    assert sorted(d.code for d in analysis.diagnostics if d.code.startswith("E")) == codes, analysis.diagnostics


def test_sequence_parallel_splits_each_context_ranks_share():
    lines = "tensor = megatron over tp with sequence_parallel\n  context = allgather over cp"
    text = _ROLES.format(model="gpt(layers=4, hidden=256, heads=8, seq={seq}, vocab=1024)", mesh="cp = 2, tp = 4",
                         lines=lines)
    (problem,) = analyze("sp.plan", text=text.replace("{seq}", "12")).diagnostics  # 12 / 2 = 6 tokens, tp 4
    assert problem.code == "E406" and "seq / cp (6)" in problem.message, problem.message
    assert analyze("sp.plan", text=text.replace("{seq}", "16")).diagnostics == []


@pytest.mark.parametrize("line, under, columns", [
    ("let 名前 = [dp = 3]", "[dp = 3]", 11),  # two CJK characters, two columns each
    ("let ｘ = [dp = 3]", "[dp = 3]", 9),  # a fullwidth letter
    ("let ＡＢ = 名前", "名前", 11),  # the span itself wide: a caret under each of its columns
    ("let e\u0301 = [dp = 3]", "[dp = 3]", 8),  # a combining accent takes no column of its own
    ("let \u0e01\u0e31 = [dp = 3]", "[dp = 3]", 8),  # a Thai vowel sign: a nonspacing mark of combining class 0
    ("let \u0915\u0947 = [dp = 3]", "[dp = 3]", 8),  # a Devanagari vowel sign, the same
    ("let \u2764\ufe0f = [dp = 3]", "[dp = 3]", 8),  # an emoji's variation selector (wcwidth: no column)
    ("let 1\u20dd = [dp = 3]", "[dp = 3]", 8),  # an enclosing mark
])
def test_the_caret_counts_the_columns_a_terminal_gives_each_character(line, under, columns):
    """A wide character before the span takes two columns on a terminal; counted one, the caret sat a column short
    for each (under `= [dp = 3` for the first line); a combining mark takes none, and put it a column past."""
    from plandsl.diagnostics.source import SourceFile
    source = SourceFile("wide.plan", line + "\n")
    start = line.index(under)
    shown, caret = source.excerpt(source.span(start, start + len(under)))[1:]
    prefix = "1 | "
    assert shown == prefix + line
    assert caret.index("^") - len(prefix) == columns, (shown, caret)
    assert caret.count("^") == sum(2 if "\u3000" <= c <= "\uffe5" else 1 for c in under), caret


@pytest.mark.parametrize("before", [
    "x" * 250,  # past the 200 columns shown
    "x" * 170,  # within them, but too near their edge for the span (40 columns kept for it)
    "名" * 150 + " = ",  # 300 columns of wide characters: the window's 60 characters before it, 120 columns
    "\x07" * 100,  # escaped, 4 columns each: 60 of them fill the window, which starts at the span instead
])
def test_a_span_past_the_columns_shown_is_shown_in_a_window_of_its_line(before):
    """An excerpt shows a line's first 200 columns; a span that started past them had its caret at their edge, under
    whatever the line had there (a `train = {...}` key at column 286 underlined a space). The line is shown in a window
    around the span now, `...` for the characters left out before it."""
    from plandsl.diagnostics.source import SourceFile
    line = before + "bogus_key: 3, " + "y" * 300
    source = SourceFile("far.plan", line + "\n")
    start = len(before)
    shown, caret = source.excerpt(source.span(start, start + len("bogus_key")))[1:]
    under = shown.index("bogus_key")  # the caret in the columns a terminal gives the shown characters before it
    assert shown.startswith("1 | ...") and _columns(shown[:under]) == caret.index("^"), (shown, caret)
    assert caret.count("^") == 9
    assert _columns(shown) <= 4 + 200


def test_a_span_within_the_columns_shown_keeps_the_line_from_its_start():
    from plandsl.diagnostics.source import SourceFile
    line = "x" * 100 + "bogus_key: 3, " + "y" * 300
    source = SourceFile("near.plan", line + "\n")
    shown, caret = source.excerpt(source.span(100, 109))[1:]
    assert shown == "1 | " + line[:200] and caret == "  | " + " " * 100 + "^" * 9


@pytest.mark.parametrize("text, path, under", [
    # a plan indented with tabs (the parser takes them as spacing): the mesh's value after a tab
    ('import "clusters/dgx_a100"\nplan p {\n\tmodel   = gpt(layers=2, hidden=64, heads=2, seq=32, vocab=100)\n'
     '\tcluster = dgx_a100\n\tmesh    =\t[dp = 3]\n\ttrain   = { global_batch: 6 }\n}\n', "tab.plan", "[dp = 3]"),
    ("0F0,0F1,0B0,0B1\n1F0,\t1X1\n", "c.csv", "1X1"),  # a schedule CSV's cell after a tab
    ('{"train_batch_size": 8,\r"a\\rb": 1}', "ds.json", '"a\\rb"'),  # a JSON whose lone CR json reads as a space
])
def test_the_caret_is_under_the_span_as_the_line_is_shown(text, path, under):
    """The excerpt expands tabs, but the caret was placed by characters: a tab before the span left it 3 columns short
    (`mesh    =\\t[dp = 3]` underlined `=   [dp = ` , a CSV's cell after a tab its spaces); and a character that does
    not print (a lone CR, which sends a terminal back to the line's start) was shown raw. It is escaped now, the caret
    under the span's text as shown."""
    from plandsl.diagnostics import render
    from plandsl.diagnostics.source import SourceFile
    from plandsl.interop import import_text
    if path.endswith(".plan"):
        found = [d for d in analyze(path, text=text).diagnostics if d.code == "W301"]
        sources = {path: SourceFile(path, text)}
    elif path.endswith(".csv"):
        imported = import_text("torch-csv", text, path)
        found, sources = imported.diagnostics, imported.sources
    else:
        imported = import_text("deepspeed", text, path, world_size=8,
                               model="gpt(layers=4, hidden=256, heads=4, seq=128, vocab=1000)")
        found, sources = imported.diagnostics, imported.sources
    rendered = render(found[0], sources).splitlines()
    shown, caret = rendered[2], rendered[3]
    assert "\t" not in shown and "\r" not in shown, rendered
    start = caret.index("^")
    assert shown[start:start + caret.count("^")] == under, rendered
