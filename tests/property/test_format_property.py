"""Property tests of plandsl.syntax.format: formatting round-trips the syntax tree and is a fixed point."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from plandsl.syntax.format import format_module, format_source
from plandsl.syntax.parser import parse_source
from plandsl.diagnostics.source import SourceFile
from plandsl.syntax import (Attr, BinOp, Binding, Bool, Call, Definition, DictExpr, DictItem, Float,
                            Int, KwArg, ListExpr, Member, Module, Name, Quantity, Slice, Str,
                            Subscript, Unary)
from support import example_tiers

# 100 random examples a run in .ci/run (each run draws new ones): ~0.6 CPU-s a property; a quarter in the
# unit tier (support.example_tiers)
SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])

NAMES = ["a", "b", "tp", "dp", "layers", "weight_1", "_hidden", "a_rather_long_name_to_fill_lines"]
UNITS = ["GiB", "GB/s", "TFLOP/s", "us", "ms", "B", "tok", "f2b", "f1b", "steps"]
BINARY_OPERATORS = ["@", "or", "and", "==", "!=", "<", "<=", ">", ">=", "..", "x",
                    "+", "-", "*", "/", "//", "%"]


def _parse(text: str) -> Module:
    return parse_source(SourceFile("p.plan", text))


names = st.sampled_from(NAMES).map(Name)
integers = st.integers(min_value=0, max_value=10**12).map(Int)
floats = st.floats(min_value=0, max_value=1e20, allow_nan=False, allow_infinity=False).map(Float)
quantities = st.builds(
    lambda value, unit, adjacent: Quantity(value, unit, adjacent=adjacent),
    st.one_of(st.integers(min_value=0, max_value=4096),
              st.floats(min_value=0, max_value=1e6, allow_nan=False)),
    st.sampled_from(UNITS), st.booleans())
strings = st.text(alphabet=st.sampled_from(list('ab "\\\n\tzé#{}')), max_size=8).map(Str)
leaves = st.one_of(names, integers, floats, quantities, strings, st.booleans().map(Bool))


def _extend(children):
    keys = st.sampled_from(NAMES + ["x", "true", "rank", "with space", "1f1b", ""])
    return st.one_of(
        st.builds(BinOp, st.sampled_from(BINARY_OPERATORS), children, children),
        st.builds(Unary, st.sampled_from(["-", "not"]), children),
        st.builds(Member, children, st.sampled_from(["name", "mlp", "3", "*"])),
        st.builds(Subscript, children,
                  st.one_of(children, st.builds(Slice, st.none() | children, st.none() | children))),
        st.builds(lambda func, args, kwargs: Call(func, tuple(args), tuple(kwargs)), children,
                  st.lists(children, max_size=3),
                  st.lists(st.builds(KwArg, st.sampled_from(NAMES), children), max_size=2)),
        st.lists(st.one_of(children, st.builds(Binding, st.sampled_from(NAMES), children)),
                 max_size=4).map(lambda items: ListExpr(tuple(items))),
        st.lists(st.builds(DictItem, keys, children), max_size=4).map(lambda items: DictExpr(tuple(items))),
    )


expressions = st.recursive(leaves, _extend, max_leaves=12)


def _plan(expression) -> Module:
    return Module("p.plan", (Definition("plan", "p", body=(Attr("x", expression),)),))


@pytest.mark.parametrize("examples", example_tiers(100))
def test_expressions_round_trip(examples):
    @settings(SETTINGS, max_examples=examples)
    @given(expressions)
    def check(expression):
        module = _plan(expression)
        text = format_module(module)
        reparsed = _parse(text)
        assert reparsed.items == module.items, text
        assert format_module(reparsed) == text
    check()


# ---- whole plans with comments in random places ----------------------------------------------
VALUES = ["1", "2 GiB", "f( a , b = 3 )", "(a - b) - c", "a x 8", "{ k: 1, j: 2 }", "[dp = 2, tp = 4]",
          "{\n k: 1,\n j: [1, 2]\n}", "f(a,\n b = [1,\n 2])", "(1 +\n 2) + [3,\n 4]",
          "gpt(layers=12, hidden=768, heads=12, seq=1024, vocab=50257, tied=true, a_rather_long_name=1)"]
attr_lines = st.one_of(
    st.builds(lambda name, value: f"{name} = {value}", st.sampled_from(NAMES), st.sampled_from(VALUES)),
    st.builds(lambda target, value: f"shard {target} = {value}",
              st.sampled_from(["embed.tok", "layers.*.attn.wq", "layers[0:4].mlp.*", "head"]),
              st.sampled_from(VALUES + ["colwise over tp"])),
    st.builds(lambda entries: "stages {\n" + "\n".join(entries) + "\n}",
              st.lists(st.sampled_from(["0: embed, layers[0:9]", "1..7: layers[9:72]", "12 : head",
                                        "virtual = 2"]), min_size=1, max_size=4)),
)
comment_texts = st.sampled_from(["# note", "# TODO: more", "#", "# x = 1 {"])


@st.composite
def plans_with_comments(draw):
    lines: list[str] = []
    comments: list[str] = []

    def maybe_comment(line: str) -> str:
        choice = draw(st.integers(0, 3))
        if choice == 1:
            comments.append(draw(comment_texts))
            return f"{line}  {comments[-1]}"
        if choice == 2:
            comments.append(draw(comment_texts))
            lines.append(comments[-1])
        return line

    for index in range(draw(st.integers(1, 3))):
        lines.append(maybe_comment(f"plan p{index} {{"))
        for _ in range(draw(st.integers(0, 4))):
            for piece in draw(attr_lines).split("\n"):
                lines.append(maybe_comment("  " * draw(st.integers(0, 2)) + piece))
            if draw(st.booleans()):
                lines.append("")
        lines.append(maybe_comment("}"))
    return "\n".join(lines) + "\n"


def _comments_survive(text: str) -> None:
    original = _parse(text)
    formatted = format_source(SourceFile("p.plan", text))
    reparsed = _parse(formatted)
    assert reparsed.items == original.items
    assert [c.text for c in reparsed.comments] == [c.text.rstrip() for c in original.comments]
    assert format_source(SourceFile("p.plan", formatted)) == formatted


@pytest.mark.parametrize("examples", example_tiers(100))
def test_comments_survive(examples):
    settings(SETTINGS, max_examples=examples)(given(plans_with_comments())(_comments_survive))()


@st.composite
def schedules_with_comments(draw):
    """A schedule of nested for / on / if-else bodies, a comment possibly on every line."""
    lines: list[str] = []

    def line(text: str) -> None:
        choice = draw(st.integers(0, 3))
        if choice == 2:
            lines.append("# own line")
        lines.append(f"{text}  # trailing" if choice == 1 else text)

    def body(depth: int) -> None:
        for _ in range(draw(st.integers(0, 3))):
            kind = draw(st.sampled_from(["action", "let", "row", "for", "on", "if", "if-else"]
                                        if depth < 3 else ["action", "let"]))
            if kind == "action":
                line(draw(st.sampled_from(["F(r, i)", "B(r, i); W(r, i)", "F(r, w + i)"])))
            elif kind == "let":
                line("let w = min(p - r - 1, m)")
            elif kind == "row":
                line("rank 0: 0F0 _ 0B0")
            elif draw(st.booleans()) and kind in ("for", "on"):
                line(f"{'for i in 0..m' if kind == 'for' else 'on rank 0'} {{ F(r, i) }}")
            else:
                line({"for": "for i in 0..m on rank r {", "on": "on rank r + 1 {"}.get(kind, "if r == 0 {"))
                body(depth + 1)
                if kind == "if-else":
                    line("} else {")
                    body(depth + 1)
                line("}")

    line("schedule s(p: ranks, m: microbatches) {")
    body(0)
    line("}")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("examples", example_tiers(100))
def test_schedule_comments_survive(examples):
    settings(SETTINGS, max_examples=examples)(given(schedules_with_comments())(_comments_survive))()
