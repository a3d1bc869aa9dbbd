"""One divisibility rule (`ir.shapes`): the search proposes exactly the tensor- and context-parallel
degrees, and the sequence parallelism, that the checker accepts (E406), for a few models."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

import plandsl

from plandsl.check.analysis import analyze
from plandsl.ir.shapes import indivisible, tensor_extents
from plandsl.search.choices import layouts, sequence_parallel, tp_divides

HEADER = 'import "clusters/dgx_a100"\n'
MODELS = {
    "gpt": "gpt(layers=2, hidden=96, heads=6, seq=48, vocab=1000)",       # vocab 1000 refuses tp 3, 6
    "gqa": "llama(layers=2, hidden=256, heads=8, kv_heads=2, seq=64, vocab=1024)",  # kv_heads 2 caps tp at 2
    "moe": "llama(layers=2, hidden=128, heads=4, seq=36, vocab=512, experts=6)",
    "mlp": "mlp(layers=2, hidden=48, input=16, output=10)",
}
DEGREES = range(1, 17)


def _plan(model: str, mesh: str, extra: str) -> str:
    return HEADER + ("plan p {\n"
                     f"  model   = {model}\n"
                     "  cluster = dgx_a100 x 2\n"
                     f"  mesh    = [{mesh}]\n"
                     "  train   = { global_batch: 16 }\n"
                     f"{extra}\n"
                     "}\n")


def _refused(text: str, line: str) -> bool:
    """Whether the checker reports E406 at the plan's `line` (tensor or context)."""
    analysis = analyze("p.plan", text=text)
    assert not [d for d in analysis.diagnostics if d.is_error and d.code != "E406"], analysis.diagnostics
    return any(d.code == "E406" and d.span is not None and text.splitlines()[d.span.line - 1].lstrip()
               .startswith(line) for d in analysis.diagnostics)


def _model(name: str):
    (plan,) = analyze("p.plan", text=_plan(MODELS[name], "tp = 1", "")).document.plans
    return plan.model


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_search_offers_the_tensor_parallel_degrees_the_checker_accepts(name):
    model = _model(name)
    accepted = {tp for tp in DEGREES
                if not _refused(_plan(MODELS[name], f"tp = {tp}", "  tensor  = megatron over tp"), "tensor")}
    offered = {tp for tp in DEGREES if layouts(model, tp, getattr(model, "seq", 1), 16, 2, {"tp": tp}, check_batch=False)}
    assert offered == {tp for tp in DEGREES if tp_divides(model, tp)}
    if name == "mlp":  # the checker accepts an MLP's tp; the search keeps it at 1 (the interpreter refuses, E704)
        assert offered == {1} and accepted == {1, 2, 3, 4, 6, 8, 12, 16}
    else:
        assert offered == accepted and 1 in offered and len(offered) < len(DEGREES)


@pytest.mark.parametrize("name", ["gpt", "moe"])
def test_the_search_offers_the_context_degrees_and_sequence_parallelism_the_checker_accepts(name):
    """`moe`'s seq 36: over cp 2 each context rank holds 18, which tp 4 does not split although 4 divides
    36; over cp 4, 9, which neither tp splits; cp 5 does not divide 36."""
    model = _model(name)
    for cp in (1, 2, 3, 4, 5):
        context = "  context = allgather over cp"
        offered = bool(layouts(model, cp, model.seq, 16, 2, {"cp": cp}, check_batch=False))
        assert offered == (cp == 1 or not _refused(_plan(MODELS[name], f"cp = {cp}", context), "context"))
        if not offered:
            continue
        for tp in (t for t in (2, 4) if tp_divides(model, t)):
            text = _plan(MODELS[name], f"cp = {cp}, tp = {tp}",
                         context + "\n  tensor  = megatron over tp with sequence_parallel")
            assert sequence_parallel(model, model.seq, tp, cp) == (not _refused(text, "tensor")), (cp, tp)


def test_sequence_parallel_splits_each_context_ranks_share():
    model = _model("moe")  # seq 36: tp 4 divides it, not the 18 each of 2 context ranks holds
    assert indivisible(tensor_extents(model, 36, 2), 4) == {"seq / cp": 18}
    assert not sequence_parallel(model, 36, 4, 2) and sequence_parallel(model, 36, 4, 1)


def test_the_tensor_parallel_divisibility_rule_has_one_home():
    """`% tp` is written only in ir/shapes: E406, the checker's model hints (E220, E221) and the search ask it."""
    root = Path(plandsl.__file__).parent
    written = [f"{path.relative_to(root)}:{number}" for path in sorted(root.rglob("*.py")) if path.name != "shapes.py"
               for number, line in enumerate(path.read_text().splitlines(), 1) if re.search(r"%\s*tp\b", line)]
    assert written == []
