"""Fuzzing the front end: whatever the text, `analyze` answers with diagnostics and never raises.

(a) token soup built from the grammar's own vocabulary, (b) mutations of valid plans,
(c) random but well-formed plans (codes registered, spans inside the file), and
(d) the formatter on valid plans raises nothing but PlanError.

Numbers are kept to realistic sizes (a few thousand at most): huge
numbers (overflow, the int-digit limit) and the time checks take for huge layer or
node counts are bounded; tests/unit/test_bad_input.py times them.
"""
from __future__ import annotations

import textwrap

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from plandsl.check.analysis import Analysis, analyze
from plandsl.diagnostics.codes import CODES
from plandsl.diagnostics import PlanError
from plandsl.diagnostics.source import NO_SPAN
from support import VALID_PLAN, example_tiers

# Examples are random (no database, not derandomized): each run tries new ones, so the counts are per run,
# 100-200 for the costliest (~2 CPU-ms per analysis), more where examples are cheap; the unit tier runs a
# quarter of them and the slow tier (in .ci/run) all of them (support.example_tiers; issue 17's 60 s unit tier).
SETTINGS = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
                    database=None)

KEYWORDS = ["import", "param", "let", "device", "node", "cluster", "model", "plan", "schedule", "layer",
            "shard", "over", "with", "rank", "for", "in", "on", "if", "else", "x", "and", "or", "not",
            "true", "false"]
NAMES = ["p", "q", "dp", "tp", "pp", "cp", "ep", "nodes", "gpt", "llama", "mlp", "dgx_a100", "a100_80g",
         "localhost", "cpu", "zero1", "zero3", "fsdp", "hsdp", "replicate", "megatron", "evenly", "1f1b",
         "gpipe", "interleaved_1f1b", "Shard", "Replicate", "Partial", "layers", "embed", "head", "mesh",
         "train", "data", "tensor", "context", "experts", "stages", "global_batch", "micro_batch",
         "precision", "bf16", "recompute", "selective", "memory", "bandwidth", "peak", "devices", "link",
         "latency", "sequence_parallel", "virtual", "map", "min", "max", "ceil", "floor", "abs", "colwise",
         "rowwise", "ranks", "microbatches", "m", "i", "_", "layers", "hidden", "heads", "seq", "vocab"]
# At most a few thousand: layer and node counts are walked one by one by the checks (see the module doc).
NUMBERS = ["0", "1", "2", "3", "4", "8", "16", "64", "1024", "4096", "1_000", "0.5", "2.5", "1e3", "1.5e-3",
           "-1"]
UNITS = ["GiB", "GB", "MiB", "B", "GB/s", "Gb/s", "TFLOP/s", "FLOP", "us", "ms", "s", "min", "Gbps", "foo",
         "GiBs", "b"]
PUNCTUATION = ["=", "{", "}", "(", ")", "[", "]", ",", ":", ".", "..", "@", "+", "-", "*", "/", "//", "%",
               "==", "!=", "<", "<=", ">", ">=", ";", ".*", "0F1", "1B0", "_"]
STRINGS = ['"clusters/dgx_a100"', '"clusters/local"', '"p"', '"layers.*.mlp"', '"pkg.mod:f"', '"\\"esc\\""',
           '"unterminated']
LAYOUT = ["\n", "\n\n", "\r\n", "\t", "# comment\n", "\\\n", "    "]
SEPARATORS = [" ", " ", " ", "", "\n", "\t"]

VALID_PLANS = [
    VALID_PLAN,
    """\
    import "clusters/local"
    let width = 256
    model net {
      seq = 16
      layer embed { params = 100 }
      layer blocks[0:4] {
        params = width * width
        flops = 2 * width * width
        activations = 1 KiB
        output = width
      }
      layer head { params = 5 }
    }
    schedule tiny(ranks = 2, microbatches = 2) {
      rank 0: 0F0 0F1 _ 0B0 0B1
      rank 1: _ 1F0 1F1 1B0 1B1
    }
    plan q {
      model   = net
      cluster = localhost x 1
      mesh    = [dp = 4, pp = 2] over devices[0:8]
      train   = { global_batch: 8 }
      stages {
        0: embed, blocks[0:2]
        1: blocks[2:4], head
      }
      schedule = tiny
    }
    """,
    """\
    import "clusters/dgx_a100"
    device fast {
      memory    = 80 GiB
      bandwidth = 2039 GB/s
      peak      = { bf16: 312 TFLOP/s }
    }
    node box {
      devices = 8 x fast
      link    = { bandwidth: 300 GB/s, latency: 2 us }
    }
    cluster mixed = [dgx_a100 x 1, box x 1]
    plan r {
      model   = llama(layers=4, hidden=512, heads=8, kv_heads=2, seq=256, vocab=1000)
      cluster = mixed
      mesh    = [rep = 2, shard = 8]
      train   = { global_batch: 32, lr: 1e-4 }
      data    = hsdp over [rep, shard]
      shard layers.*.mlp.w1 = { weight: [Shard(0) @ shard, Replicate @ rep] }
      shard embed = replicate
    }
    """,
]
VALID_PLANS = [textwrap.dedent(text) for text in VALID_PLANS]  # VALID_PLAN has no indent to remove


def check_analysis(text: str) -> Analysis:
    """The property: analyze returns (no exception), codes are registered, spans lie in the text."""
    analysis = analyze(text=text)  # any exception, RecursionError included, fails the test
    lines = text.lstrip("\ufeff").count("\n") + 1
    for d in analysis.diagnostics:
        assert d.code in CODES, d
        assert d.severity in ("error", "warning")
        assert isinstance(d.message, str) and d.message
        if d.span is not NO_SPAN and d.span.file == "<string>":
            assert 1 <= d.span.line <= lines, (d, lines)
            assert d.span.column >= 1, d
            assert d.span.line <= d.span.end_line <= lines, (d, lines)
        for note in d.notes:
            if note.span is not None and note.span is not NO_SPAN and note.span.file == "<string>":
                assert 1 <= note.span.line <= lines, (note, lines)
    if analysis.ok:
        assert analysis.document is not None
    return analysis


# ---- (a) token soup ------------------------------------------------------------------------------
tokens = st.one_of(
    st.sampled_from(KEYWORDS), st.sampled_from(NAMES), st.sampled_from(NUMBERS),
    st.builds(lambda n, u, sep: n + sep + u, st.sampled_from(NUMBERS), st.sampled_from(UNITS),
              st.sampled_from(["", " "])),
    st.sampled_from(PUNCTUATION), st.sampled_from(STRINGS), st.sampled_from(LAYOUT),
)


SOUP_PREFIXES = ["", "", "let x = ", 'import "clusters/dgx_a100"\nplan p {\n  ', "plan p {\n  mesh = [",
                 "model m {\n  layer ", "schedule s(ranks = 2) {\n  ", "device d {\n  memory = "]
SOUP_SUFFIXES = ["", "\n}\n", "]\n}\n", ")"]


@st.composite
def token_soup(draw) -> str:
    parts = draw(st.lists(tokens, max_size=60))
    separators = draw(st.lists(st.sampled_from(SEPARATORS), min_size=len(parts), max_size=len(parts)))
    soup = "".join(p + s for p, s in zip(parts, separators))
    return draw(st.sampled_from(SOUP_PREFIXES)) + soup + draw(st.sampled_from(SOUP_SUFFIXES))


@pytest.mark.parametrize("examples", example_tiers(200))
def test_token_soup_only_gives_diagnostics(examples):
    @settings(SETTINGS, max_examples=examples)
    @given(token_soup())
    def check(text):
        check_analysis(text)
    check()


@pytest.mark.parametrize("examples", example_tiers(150))
def test_shuffled_words_of_a_plan(examples):
    @settings(SETTINGS, max_examples=examples)
    @given(st.lists(st.sampled_from(VALID_PLANS[0].split()), max_size=80).map(" ".join))
    def check(text):
        check_analysis(text)
    check()


# ---- (b) mutations of valid plans ---------------------------------------------------------------------
def _tokenize(text: str) -> list[str]:
    """Split into words and single punctuation, keeping whitespace as tokens (so joining restores it)."""
    import re
    return re.findall(r"\s+|[A-Za-z_0-9.]+|\"[^\"\n]*\"|.", text)


MUTATIONS = ["delete_token", "duplicate_token", "swap_tokens", "insert_token", "change_number", "truncate",
             "delete_line", "duplicate_line", "swap_lines", "replace_token"]


@st.composite
def mutated_plan(draw) -> str:
    text = draw(st.sampled_from(VALID_PLANS))
    for _ in range(draw(st.integers(min_value=1, max_value=3))):
        kind = draw(st.sampled_from(MUTATIONS))
        if kind == "truncate":
            text = text[:draw(st.integers(min_value=0, max_value=len(text)))]
            continue
        if kind.endswith("line"):
            lines = text.split("\n")
            if not lines:
                continue
            i = draw(st.integers(min_value=0, max_value=len(lines) - 1))
            if kind == "delete_line":
                del lines[i]
            elif kind == "duplicate_line":
                lines.insert(i, lines[i])
            text = "\n".join(lines)
            continue
        if kind == "swap_lines":
            lines = text.split("\n")
            i, j = (draw(st.integers(min_value=0, max_value=len(lines) - 1)) for _ in range(2))
            lines[i], lines[j] = lines[j], lines[i]
            text = "\n".join(lines)
            continue
        parts = _tokenize(text)
        if not parts:
            continue
        i = draw(st.integers(min_value=0, max_value=len(parts) - 1))
        if kind == "delete_token":
            del parts[i]
        elif kind == "duplicate_token":
            parts.insert(i, parts[i])
        elif kind == "swap_tokens":
            j = draw(st.integers(min_value=0, max_value=len(parts) - 1))
            parts[i], parts[j] = parts[j], parts[i]
        elif kind == "insert_token":
            parts.insert(i, draw(tokens) + draw(st.sampled_from(SEPARATORS)))
        elif kind == "replace_token":
            parts[i] = draw(tokens)
        elif kind == "change_number":
            numbers = [k for k, p in enumerate(parts) if p[:1].isdigit()]
            if numbers:
                k = draw(st.sampled_from(numbers))
                parts[k] = draw(st.sampled_from(NUMBERS + ["7", "0.0", "2e3", "3.0"]))
        text = "".join(parts)
    return text


@pytest.mark.parametrize("examples", example_tiers(200))
def test_mutated_plans_only_give_diagnostics(examples):
    @settings(SETTINGS, max_examples=examples)
    @given(mutated_plan())
    def check(text):
        check_analysis(text)
    check()


def test_the_seed_plans_are_valid():
    for text in VALID_PLANS:
        analysis = check_analysis(text)
        assert analysis.ok, [(d.code, d.message) for d in analysis.diagnostics]
        assert len(analysis.document.plans) == 1


# ---- (c) structurally valid plans with random numbers ------------------------------------------------------
AXIS_NAMES = ["dp", "tp", "pp", "cp", "ep", "fsdp", "rep", "shard", "a"]


@st.composite
def generated_plan(draw) -> str:
    cluster = draw(st.sampled_from(["dgx_a100", "localhost"]))
    nodes = draw(st.integers(min_value=1, max_value=8))
    axes = draw(st.lists(st.sampled_from(AXIS_NAMES), min_size=1, max_size=4, unique=True))
    fits = draw(st.integers(0, 3)) > 0  # mostly: the axes multiply to exactly the cluster's devices
    if fits:
        remaining, sizes = nodes * 8, []
        for _ in axes[:-1]:
            size = draw(st.sampled_from([d for d in range(1, remaining + 1) if remaining % d == 0]))
            sizes.append(size)
            remaining //= size
        sizes.append(remaining)
    else:
        sizes = [draw(st.sampled_from([1, 2, 3, 4, 8, 16, 5])) for _ in axes]
    mesh = ", ".join(f"{a} = {s}" for a, s in zip(axes, sizes))
    if fits or draw(st.booleans()):
        mesh = f"[{mesh}]"
    else:
        first = draw(st.integers(min_value=0, max_value=8))
        mesh = f"[{mesh}] over devices[{first}:{first + draw(st.integers(min_value=1, max_value=64))}]"
    family = draw(st.sampled_from(["gpt", "llama", "mlp"]))
    layers = draw(st.integers(min_value=1, max_value=48))
    hidden = draw(st.sampled_from([64, 128, 256, 1000, 1024, 4096]))
    heads = draw(st.sampled_from([1, 2, 3, 8, 16, 32]))
    if family == "mlp":
        model = f"mlp(layers={layers}, hidden={hidden}, input=32, output=10)"
    else:
        extra = ""
        if family == "llama" and draw(st.booleans()):
            extra = f", kv_heads={draw(st.sampled_from([1, 2, 4, 8]))}"
        if family == "llama" and draw(st.booleans()):
            extra += f", experts={draw(st.sampled_from([0, 2, 8]))}"
        seq, vocab = draw(st.sampled_from([128, 1024, 4096])), draw(st.sampled_from([1000, 50304]))
        model = f"{family}(layers={layers}, hidden={hidden}, heads={heads}, seq={seq}, vocab={vocab}{extra})"
    train = {"global_batch": draw(st.sampled_from([1, 8, 32, 64, 100, 512]))}
    if draw(st.booleans()):
        train["micro_batch"] = draw(st.sampled_from([1, 2, 4, 3]))
    if draw(st.booleans()):
        train["precision"] = draw(st.sampled_from(["bf16", "fp16", "fp32"]))
    if draw(st.booleans()):
        train["recompute"] = draw(st.sampled_from(["none", "selective", "full"]))
    if draw(st.booleans()):
        train["seq"] = draw(st.sampled_from([64, 2048]))
    lines = [
        f"  model   = {model}",
        f"  cluster = {cluster} x {nodes}",
        f"  mesh    = {mesh}",
        "  train   = { " + ", ".join(f"{k}: {v}" for k, v in train.items()) + " }",
    ]
    if draw(st.booleans()):
        kind = draw(st.sampled_from(["replicate", "zero1", "zero2", "zero3", "fsdp", "hsdp", "none"]))
        over = draw(st.sampled_from(axes + ["nope"]))
        lines.append(f"  data    = {kind} over {over}" if kind != "hsdp" or len(axes) < 2
                     else f"  data    = hsdp over [{axes[0]}, {axes[1]}]")
    if draw(st.booleans()):
        lines.append(f"  tensor  = megatron over {draw(st.sampled_from(axes))}"
                     + (" with sequence_parallel" if draw(st.booleans()) else ""))
    if draw(st.booleans()):
        virtual = draw(st.sampled_from([1, 2, 3]))
        lines.append(f"  stages  = evenly over {draw(st.sampled_from(axes))} with virtual = {virtual}")
    if draw(st.booleans()):
        lines.append(f"  schedule = {draw(st.sampled_from(['1f1b', 'gpipe', 'interleaved_1f1b', 'zb_h1', 'nope']))}")
    if draw(st.booleans()):
        lines.append(f"  shard layers.*.mlp.w1 = colwise over {draw(st.sampled_from(axes))}")
    header = 'import "clusters/dgx_a100"\nimport "clusters/local"\n'
    return header + "plan gen {\n" + "\n".join(lines) + "\n}\n"


@pytest.mark.parametrize("examples", example_tiers(100))
def test_generated_plans_diagnostics_are_well_formed(examples):
    @settings(SETTINGS, max_examples=examples)
    @given(generated_plan())
    def check(text):
        analysis = check_analysis(text)
        if analysis.ok:
            (plan,) = analysis.document.plans
            assert plan.mesh.size == eval_mesh_size(text)
    check()


def eval_mesh_size(text: str) -> int:
    import re
    mesh = re.search(r"mesh\s+= \[([^\]]*)\]", text).group(1)
    size = 1
    for part in mesh.split(","):
        size *= int(part.split("=")[1])
    return size


@pytest.mark.parametrize("examples", example_tiers(100))
def test_param_overrides_of_any_type_only_give_diagnostics(examples):
    @settings(SETTINGS, max_examples=examples)
    @given(generated_plan(), st.dictionaries(st.sampled_from(["nodes", "n", "x"]),
                                             st.one_of(st.integers(-2, 64), st.floats(-4, 64),
                                                       st.sampled_from([float("nan"), float("inf"), -float("inf")]),
                                                       st.text(max_size=4), st.booleans()), max_size=2))
    def check(text, params):
        text = text.replace("plan gen {", "param n = 2\nparam nodes = 1\nplan gen {").replace(" x 1\n", " x nodes\n")
        analysis = analyze(text=text, params=params)
        for d in analysis.diagnostics:
            assert d.code in CODES
    check()


# ---- (d) the formatter ---------------------------------------------------------------------------------
def _format_text():
    try:
        import plandsl.syntax.format  # noqa: F401
        from plandsl.api import format_text
    except ImportError:
        pytest.skip("plandsl.syntax.format is not available")
    try:
        format_text(VALID_PLANS[0])
    except NotImplementedError:
        pytest.skip("plandsl.syntax.format is not implemented yet")
    return format_text


@st.composite
def valid_text(draw) -> str:
    """A plan that parses: a seed plan or a generated one, maybe with comments and odd spacing."""
    text = draw(st.one_of(st.sampled_from(VALID_PLANS), generated_plan()))
    if draw(st.booleans()):
        text = text.replace(" = ", draw(st.sampled_from(["=", "   =  ", "\t=\t"])))
    if draw(st.booleans()):
        lines = text.split("\n")
        i = draw(st.integers(min_value=0, max_value=len(lines) - 1))
        lines.insert(i, "# " + draw(st.text(alphabet="abc #{}\"é", max_size=10)))
        text = "\n".join(lines)
    if draw(st.booleans()):
        text = text.replace("\n", "\r\n")
    return text


@pytest.mark.parametrize("examples", example_tiers(120))
def test_formatter_raises_only_plan_error(examples):
    @settings(SETTINGS, max_examples=examples)
    @given(valid_text())
    def check(text):
        format_text = _format_text()
        try:
            formatted = format_text(text)
        except PlanError as error:
            assert error.diagnostics and all(d.code in CODES for d in error.diagnostics)
            return
        assert isinstance(formatted, str)
    check()


@pytest.mark.parametrize("examples", example_tiers(100))
def test_formatter_on_mutated_plans_raises_only_plan_error(examples):
    @settings(SETTINGS, max_examples=examples)
    @given(mutated_plan())
    def check(text):
        format_text = _format_text()
        try:
            format_text(text)
        except PlanError:
            pass
    check()


@pytest.mark.parametrize("examples", example_tiers(60))
def test_formatting_keeps_the_meaning(examples):
    @settings(SETTINGS, max_examples=examples)
    @given(valid_text())
    def check(text):
        format_text = _format_text()
        before = analyze(text=text)
        assume(before.document is not None)
        formatted = format_text(text)
        after = analyze(text=formatted)
        assert after.document is not None, [(d.code, d.message) for d in after.diagnostics]
        assert after.document.model_dump() == before.document.model_dump()
        assert [d.code for d in after.diagnostics] == [d.code for d in before.diagnostics]
    check()
