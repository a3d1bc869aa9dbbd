"""The parser's fast paths give exactly what lark's own tree building and Transformer give.

`syntax.build.build` walks the tree with an explicit stack instead of `Builder().transform`;
`parser._pass_children_through` skips lark's position pass where a `?rule` hands its one child
up. Both are checked against plain lark on every standard-library plan and on a generated file
that uses every expression level, spans included (spans are kept out of node equality).
"""
from __future__ import annotations

from dataclasses import fields, is_dataclass
from importlib import resources
from pathlib import Path

import pytest
from lark import Lark

from plandsl.diagnostics import PlanError
from plandsl.syntax.parser import _parser, _PostLex, parse_source
from plandsl.diagnostics.source import SourceFile
from plandsl.syntax.build import MAX_DEPTH, Builder, build

ROOT = Path(__file__).resolve().parents[2]
PLANS = sorted((ROOT / "stdlib_plans").rglob("*.plan"))
EVERY_LEVEL = """\
let a = not (1 + 2 * 3 - 4 / 5 // 6 % 7 < 8 and true or false)
let b = [dp = 2, pp = a..3 x 4 @ c]
let c = f(x = 1, 2)[0:3].y.*
let d = { "k": 80GiB, q: -3.5e2 }
"""


def _spans(node, out: list) -> list:
    """Every span in a syntax tree, in a fixed order."""
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, tuple):
            stack.extend(item)
        elif is_dataclass(item):
            for field in fields(item):
                value = getattr(item, field.name)
                if field.name.endswith("span") or field.name.endswith("spans"):
                    out.append((type(item).__name__, field.name, value))
                else:
                    stack.append(value)
    return out


@pytest.fixture(scope="module")
def plain():
    """lark as configured by the parser, without the pass-through callbacks."""
    grammar = resources.files("plandsl.grammar").joinpath("plan.lark").read_text(encoding="utf-8")
    return Lark(grammar, parser="lalr", lexer="contextual", postlex=_PostLex(), propagate_positions=True,
                maybe_placeholders=True)


@pytest.mark.parametrize("path", [pytest.param(p, id=p.name) for p in PLANS] + [pytest.param(None, id="every level")])
def test_fast_parse_equals_lark(plain, path):
    text = path.read_text() if path else EVERY_LEVEL
    fast = _parser()
    tree = fast.lark.parse(text)
    assert tree == plain.parse(text)
    builder = Builder()
    builder.file = "f.plan"
    expected = builder.transform(plain.parse(text))
    fast.builder.file = "f.plan"
    got = build(fast.builder, tree)
    assert got == expected
    assert _spans(got, []) == _spans(expected, [])


def test_more_operators_in_a_row_than_the_limit_are_refused_as_read():
    """The parse stops at the operator past the limit (not 200,000 tokens later); separators reset it."""
    text = "let x = " + " + ".join(["1"] * 100_000) + "\n"
    with pytest.raises(PlanError) as caught:
        parse_source(SourceFile("long.plan", text))
    (error,) = caught.value.diagnostics
    assert error.code == "E106" and error.span.column == len("let x = ") + 4 * MAX_DEPTH + 3
    # past the limit in all (2 operators an item), never in a row: parses (60,000 tokens cost ~3 CPU-s more)
    parse_source(SourceFile("list.plan", "let x = [" + ", ".join(["1 + 2 * 3"] * (MAX_DEPTH // 2 + 1)) + "]\n"))


def test_a_tree_deeper_than_the_limit_is_E106_not_a_recursion_error():
    """Chains under the limit, one inside the other, still make a tree too deep: refused as it is built."""
    chain = " + ".join(["1"] * (MAX_DEPTH * 3 // 4))
    with pytest.raises(PlanError) as caught:
        parse_source(SourceFile("deep.plan", f"let x = ({chain}) + {chain}\n"))
    (error,) = caught.value.diagnostics
    assert error.code == "E106" and f"{MAX_DEPTH:,}" in error.message


def test_operators_just_under_the_limit_parse():
    parse_source(SourceFile("ok.plan", "let x = " + " + ".join(["1"] * (MAX_DEPTH - 10)) + "\n"))


def test_a_kept_tree_is_the_one_of_its_path_and_text():
    """parse_source keeps small files' trees: the same path and text give the same tree, another path
    gives spans in that file, another text a new parse."""
    text = (ROOT / "stdlib_plans" / "clusters" / "dgx_a100.plan").read_text(encoding="utf-8")
    first = parse_source(SourceFile("a.plan", text))
    assert parse_source(SourceFile("a.plan", text)) is first
    other = parse_source(SourceFile("b.plan", text))
    assert other.items == first.items and other.file == "b.plan" and {i.span.file for i in other.items} == {"b.plan"}
    edited = parse_source(SourceFile("a.plan", text + "\nlet kept_tree_probe = 1\n"))
    assert len(edited.items) == len(first.items) + 1
    with pytest.raises(PlanError):  # a file that does not parse is refused every time, not kept
        parse_source(SourceFile("a.plan", text + "\nlet = \n"))
    with pytest.raises(PlanError):
        parse_source(SourceFile("a.plan", text + "\nlet = \n"))
