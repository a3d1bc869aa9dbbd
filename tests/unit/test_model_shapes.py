"""The model shapes `check` requires (E220-E224, plandsl.check.model): each rule fires with its numbers at
the argument that breaks it, following its hint gives a plan that checks clean, and the reference model
refuses the same shapes (so `check` and `run` agree; tests/property/test_check_runs.py runs them)."""
from __future__ import annotations

import re

import pytest

from plandsl import ir
from plandsl.check.analysis import analyze
from plandsl.diagnostics import apply_edits
from support import bounded

HEADER = 'import "clusters/dgx_a100"\n'


def plan_text(model: str, mesh: str = "[dp = 8]", extra: str = "", train: str = "global_batch: 64") -> str:
    return HEADER + (f"plan p {{\n  model   = {model}\n  cluster = dgx_a100 x 1\n  mesh    = {mesh}\n"
                     f"  train   = {{ {train} }}\n{extra}\n}}\n")


def errors(text: str):
    return [d for d in analyze("shapes.plan", text=text).diagnostics if d.is_error]


# (model, mesh, extra, train, code, fragments of the message that show the numbers)
TP = "  tensor  = megatron over tp"
CASES = {
    "hidden not divisible by heads": ("gpt(layers=2, hidden=768, heads=10, seq=128, vocab=512)", "[dp = 8]", "",
                                      "global_batch: 64", "E220", ["hidden (768)", "heads (10)", "76.8"]),
    "llama hidden under tp": ("llama(layers=2, hidden=1000, heads=16, seq=128, vocab=512)", "[dp = 4, tp = 2]", TP,
                              "global_batch: 64", "E220", ["hidden (1000)", "heads (16)"]),
    "gqa kv_heads does not divide": ("llama(layers=2, hidden=1024, heads=16, kv_heads=6, seq=128, vocab=512)",
                                     "[dp = 4, tp = 2]", TP, "global_batch: 64", "E221", ["heads (16)", "kv_heads (6)"]),
    "kv_heads above heads": ("llama(layers=2, hidden=512, heads=8, kv_heads=16, seq=128, vocab=512)", "[dp = 8]", "",
                             "global_batch: 64", "E221", ["kv_heads (16)", "heads (8)"]),
    "odd rotary head dim": ("llama(layers=2, hidden=1800, heads=24, seq=128, vocab=512)", "[dp = 8]", "",
                            "global_batch: 64", "E222", ["1800/24 = 75"]),
    "rotary head dim 1": ("llama(layers=2, hidden=8, heads=8, kv_heads=2, seq=128, vocab=512)", "[dp = 8]", "",
                          "global_batch: 64", "E222", ["8/8 = 1"]),
    "top_k 0": ("llama(layers=2, hidden=512, heads=8, seq=128, vocab=512, experts=8, top_k=0)", "[dp = 8]", "",
                "global_batch: 64", "E223", ["top_k (0)", "experts (8)"]),
    "top_k above experts": ("llama(layers=2, hidden=512, heads=8, seq=128, vocab=512, experts=2, top_k=4)",
                            "[dp = 8]", "", "global_batch: 64", "E223", ["top_k (4)", "experts (2)"]),
    "gpt trains past its positions": ("gpt(layers=2, hidden=512, heads=8, seq=128, vocab=512)", "[dp = 8]", "",
                                      "global_batch: 64, seq: 256", "E224", ["train seq (256)", "128 learned"]),
}


@pytest.mark.parametrize("case", CASES)
def test_the_rule_fires_with_its_numbers_at_the_argument(case):
    model, mesh, extra, train, code, fragments = CASES[case]
    text = plan_text(model, mesh, extra, train)
    found = [d for d in errors(text) if d.code.startswith("E22")]
    assert [d.code for d in found] == [code], found
    (d,) = found
    for fragment in fragments:
        assert fragment in d.message, d.message
    written = text[d.span.start:d.span.end]
    argument = {"E220": "heads=", "E221": "kv_heads=", "E222": "hidden=", "E223": "top_k=", "E224": "seq: "}[code]
    assert written.startswith(argument), written
    assert d.hint and d.notes and d.notes[0].span is not None


def _follow(text: str, option: str) -> str:
    """The plan with one hint option applied: `name=N` sets the model argument, `name: N` the train key."""
    name, sep, value = re.fullmatch(r"`?(\w+)(=|: )(\d+)`?", option).groups()
    if sep == "=":
        return re.sub(rf"\b{name}=\d+", f"{name}={value}", text, count=1)
    return re.sub(rf"\b{name}: \d+", f"{name}: {value}", text, count=1)


def _options(hint: str) -> list[str]:
    return re.findall(r"`?\b\w+(?:=|: )\d+`?", hint)


@pytest.mark.parametrize("case", CASES)
def test_every_option_of_the_hint_gives_a_plan_that_checks(case):
    model, mesh, extra, train, code, _ = CASES[case]
    text = plan_text(model, mesh, extra, train)
    (d,) = [d for d in errors(text) if d.code == code]
    options = _options(d.hint)
    assert options, d.hint
    assert d.edits and errors(apply_edits(text, d.edits)) == [], d.edits  # the first option, as edits
    for option in options:
        fixed = _follow(text, option)
        assert fixed != text, option
        assert errors(fixed) == [], f"{code}: following '{option}' of '{d.hint}' still fails: {errors(fixed)}"


def test_the_hint_keeps_kv_heads_divisible_by_tp():
    text = plan_text("llama(layers=2, hidden=2048, heads=16, kv_heads=3, seq=128, vocab=512)", "[dp = 2, tp = 4]", TP)
    assert sorted(d.code for d in errors(text)) == ["E221", "E406"]  # 3 kv heads split over tp = 4, too
    (d,) = [d for d in errors(text) if d.code == "E221"]
    assert _options(d.hint) == ["kv_heads=4", "kv_heads=8"], d.hint
    assert all(errors(_follow(text, option)) == [] for option in _options(d.hint))


def test_an_explicit_top_k_is_kept_and_the_default_is_min_2_experts():
    one = analyze("a.plan", text=plan_text("llama(layers=2, hidden=512, heads=8, seq=128, vocab=512, experts=1)"))
    assert one.ok and one.document.plans[0].model.top_k == 1
    refused = analyze("a.plan", text=plan_text(CASES["top_k 0"][0]))
    assert [d.code for d in refused.errors] == ["E223"]
    assert refused.document.plans[0].model.top_k == 0  # as written, not silently made 2 (as before)


def test_models_that_run_are_not_refused():
    """The edges: head dim 1 and odd head dims without rotary (gpt), 2 with it, kv_heads = 1 (multi-query),
    one expert, a llama trained past its nominal seq (rotary has no table), vocab 1."""
    for model, train in [("gpt(layers=2, hidden=8, heads=8, seq=128, vocab=1)", "global_batch: 64"),
                         ("gpt(layers=2, hidden=72, heads=8, seq=128, vocab=512)", "global_batch: 64, seq: 128"),
                         ("llama(layers=2, hidden=16, heads=8, kv_heads=1, seq=128, vocab=512)", "global_batch: 64"),
                         ("llama(layers=2, hidden=64, heads=4, seq=16, vocab=512, experts=1)", "global_batch: 64, seq: 64")]:
        assert errors(plan_text(model, train=train)) == [], model


@pytest.mark.parametrize("case", [c for c in CASES if CASES[c][4] != "E224"])
def test_the_reference_model_refuses_the_same_shapes(case):
    from plandsl.runtime.models import build_model
    model = ir.TransformerModel.model_validate(_model_fields(CASES[case][0]))
    with pytest.raises(ValueError, match=r"E22|top_k"):
        build_model(model.model_copy(update={"layers": 1}), seed=0)


def _model_fields(call: str) -> dict:
    kind, args = re.fullmatch(r"(\w+)\((.*)\)", call).groups()
    values = {k: int(v) for k, v in (a.split("=") for a in args.split(", "))}
    values.setdefault("kv_heads", values["heads"])
    values["ffn_hidden"] = values.pop("ffn", 4 * values["hidden"])
    return {"kind": kind, "name": "m", **values}


def test_huge_numbers_answer_at_once():
    with bounded(10, "analyze"):
        text = plan_text(f"llama(layers=2, hidden={10**18 + 1}, heads={10**9 + 7}, kv_heads={10**9}, seq=128, "
                         f"vocab=512, experts={10**12}, top_k={10**13})")
        codes = {d.code for d in errors(text)}
    assert {"E220", "E221", "E223"} <= codes, codes


def test_generate_refuses_a_model_that_cannot_run():
    """`generate --model` searches no layout for a model `check` would refuse in any plan."""
    from plandsl.search.emit import SearchError, resolve_problem
    with pytest.raises(SearchError, match=r"E220; hidden=760 .* heads=8 or heads=12"):
        resolve_problem("gpt(layers=2, hidden=768, heads=10, seq=128, vocab=512)", "dgx_a100", 64)
    with pytest.raises(SearchError, match=r"E224; --seq-len 128 or less"):
        resolve_problem("gpt(layers=2, hidden=768, heads=12, seq=128, vocab=512)", "dgx_a100", 64, seq_len=256)
    resolve_problem("llama(layers=2, hidden=768, heads=12, seq=128, vocab=512)", "dgx_a100", 64, seq_len=256)
