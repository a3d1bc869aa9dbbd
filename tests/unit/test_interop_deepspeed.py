"""`plandsl export --to deepspeed` and `plandsl import --from deepspeed`: DeepSpeed's JSON config (0.19.8). Every
stdlib plan's export (golden files for those DeepSpeed expresses; E808 for the rest), round trips, keys DeepSpeed
would silently ignore as E804, and the exports held against DeepSpeed's own DeepSpeedConfig (the `interop` extra
installs it; skipped without it)."""
from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import pytest
from click.testing import CliRunner

from plandsl import api, ir
from plandsl.cli import main
from plandsl.interop import deepspeed, export_plan, import_text
from test_interop_megatron import ALL, stdlib_plan  # the stdlib plans, found by name

# The stdlib plans DeepSpeed's config expresses whole: data parallelism alone, no recomputation, a constant
# learning rate, seed 0 (the rest of a plan lives in DeepSpeed's training script).
EXPRESSED = {"gpt2_medium_ddp", "tiny_dp", "tiny_fsdp", "tiny_zero1", "tiny_zero2"}
WHOLE = [param for param in ALL if param.values[1] in EXPRESSED]
MODELS = {"gpt2_medium_ddp": "gpt2_medium", "tiny_dp": "gpt(layers=4, hidden=64, heads=4, seq=32, vocab=256)"}


def test_deepspeed_expresses_exactly_the_data_parallel_plans():
    whole = {name for path, name in (p.values for p in ALL) if not export_plan(stdlib_plan(path, name), "deepspeed").lost}
    assert whole == EXPRESSED


@pytest.mark.parametrize("path, name", WHOLE)
def test_exported_config_matches_golden(path, name, golden):
    golden(f"interop/deepspeed/{name}.json", export_plan(stdlib_plan(path, name), "deepspeed").text)


@pytest.mark.parametrize("path, name", WHOLE)
def test_import_of_the_export_is_the_plan(path, name):
    plan = stdlib_plan(path, name)
    exported = export_plan(plan, "deepspeed")
    model = MODELS.get(name, MODELS["tiny_dp"])
    imported = import_text("deepspeed", exported.text, "ds.json", world_size=plan.mesh.size, name=name, model=model)
    assert imported.ok, api.render_all(imported.diagnostics, imported.sources)
    back = api.select_plan(api.loads(imported.text, path="back.plan"))
    # DeepSpeed keeps 16-bit weights beside an fp32 master: the plan comes back saying so (param_dtype)
    weights = plan.train.precision if plan.train.precision is not ir.Precision.fp32 else None
    assert back.train.param_dtype is weights
    sent = plan.train.model_copy(update={"param_dtype": weights})
    assert back.train == sent.model_copy(update={"seq": None}) or back.train.model_dump() == sent.model_dump()
    assert (back.dp, back.data.zero_stage) == (plan.dp, plan.data.zero_stage)
    assert export_plan(back, "deepspeed").text == exported.text


def test_what_deepspeed_cannot_express_is_listed():
    plan = stdlib_plan(str(Path(__file__).resolve().parents[2] / "stdlib_plans/examples/gpt3_175b_3d.plan"), "gpt3_megatron")
    lost = [d.message.removeprefix("DeepSpeed's config cannot express ") for d in export_plan(plan, "deepspeed").lost]
    assert [m.split(" (")[0] for m in lost] == ["tensor parallelism", "pipeline parallelism", "recompute: full"]


BASE = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2},
        "bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
MODEL = "gpt(layers=4, hidden=256, heads=8, seq=128, vocab=1024)"


@pytest.mark.parametrize("change, code, key", [
    ({"train_batch_sise": 16}, "E804", '"train_batch_sise"'),
    ({"train_micro_batch_size_per_gpu": 0}, "E804", '"train_micro_batch_size_per_gpu"'),
    ({"gradient_accumulation_steps": 4}, "E805", '"gradient_accumulation_steps"'),
    ({"train_batch_size": 12}, "E806", '"train_batch_size"'),
    ({"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 10}}}, "E807", '"scheduler"'),
    ({"fp16": {"enabled": True}}, "E805", '"fp16"'),
    # a list DeepSpeed's config refuses was read as stage 0 (an empty one) or 1 (any other)
    ({"zero_optimization": []}, "E804", '"zero_optimization"'),
    ({"zero_optimization": [2]}, "E804", '"zero_optimization"'),
])
def test_bad_configs_are_diagnostics_naming_the_key(change, code, key):
    text = json.dumps({**BASE, **change}, indent=1)
    imported = import_text("deepspeed", text, "ds.json", world_size=8, model=MODEL)
    assert [d.code for d in imported.diagnostics] == [code]
    span = imported.diagnostics[0].span
    assert text[span.start:span.end] == key


@pytest.mark.parametrize("change, key, words", [
    # an optimizer type that is a list or an object was unhashable: E108
    ({"optimizer": {"type": ["Adam"]}}, '"optimizer"', "optimizer [\"Adam\"]"),
    ({"optimizer": {"type": {"a": 1}}}, '"optimizer"', "a plan's optimizer is adam or sgd"),
    # an integer past float's range overflowed float() as the plan was written: E108
    ({"optimizer": {"type": "Adam", "params": {"lr": 10**400}}}, '"optimizer"', "must be a number of zero or more"),
    ({"gradient_clipping": 10**400}, '"gradient_clipping"', "must be a number of zero or more"),
    # a stage DeepSpeed's pydantic model refuses (1.0 indexed a tuple, E108, and is read now as DeepSpeed reads it)
    ({"zero_optimization": {"stage": 1.5}}, '"zero_optimization"', "stage 1.5: one of 0, 1, 2, 3"),
    ({"zero_optimization": {"stage": "x"}}, '"zero_optimization"', "stage \"x\": one of 0, 1, 2, 3"),
    # 1e300 was written into the plan as 301 digits, which the import then failed to parse (exit 2)
    ({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 1e300}}, '"stage3_prefetch_bucket_size"',
     "must be a whole number of elements up to"),
    # an "enabled" DeepSpeed (pydantic) refuses; `true` as the section was read as off
    ({"bf16": {"enabled": "maybe"}}, '"bf16"', "\"enabled\" is true or false, found {\"enabled\": \"maybe\"}"),
    ({"bf16": True}, '"bf16"', "must be an object"),
    ({"fp16": {"enabled": [1]}}, '"fp16"', "must be an object"),
])
def test_hostile_values_are_diagnostics_naming_the_key(change, key, words):
    text = json.dumps({**BASE, **change}, indent=1)
    imported = import_text("deepspeed", text, "ds.json", world_size=8, model=MODEL)
    assert len(imported.diagnostics) == 1 and words in imported.diagnostics[0].message, \
        [d.message for d in imported.diagnostics]
    assert imported.diagnostics[0].code in ("E804", "E807")
    span = imported.diagnostics[0].span
    assert text[span.start:span.end] == key


def test_a_key_written_twice_is_refused_as_deepspeed_refuses_it():
    """json keeps the last of two equal keys; DeepSpeed reads with dict_raise_error_on_duplicate_keys and stops
    (the import took train_batch_size 16 without a word)."""
    text = '{"train_batch_size": 8,\n "zero_optimization": {"stage": 1},\n "train_batch_size": 16}'
    imported = import_text("deepspeed", text, "ds.json", world_size=8, model=MODEL)
    assert [d.code for d in imported.diagnostics] == ["E804"] and "written twice" in imported.diagnostics[0].message
    assert imported.diagnostics[0].span.start == text.rindex('"train_batch_size"')
    nested = '{"train_batch_size": 8, "zero_optimization": {"stage": 1, "stage": 2}}'
    assert "\"stage\" written twice" in import_text("deepspeed", nested, "ds.json", world_size=8,
                                                    model=MODEL).diagnostics[0].message
    many = json.dumps({**BASE, **{f"k{i}": i for i in range(50_000)}})  # no duplicate, no quadratic look
    assert "written twice" not in import_text("deepspeed", many, "ds.json", world_size=8,
                                              model=MODEL).diagnostics[0].message


def test_an_unknown_key_is_pointed_at_as_written_escapes_included():
    """The spans come from one pass over the text (a search per key was quadratic); a key written with an escape is
    found by its escaped spelling, and a string value followed by a colon-like text is no key."""
    text = '{"note": "a\\": b", "train_batch_size": 8, "k\\"q": 1, "zero_optimization": {"stage": 1}}'
    imported = import_text("deepspeed", text, "ds.json", world_size=8, model=MODEL)
    spans = [text[d.span.start:d.span.end] for d in imported.diagnostics if "unknown key" in d.message]
    assert spans == ['"note"', '"k\\"q"']


def test_a_key_holding_a_line_break_is_named_on_one_line():
    """A key holding a line break (`"b\\n}"` in the JSON) or a backslash is named in E804 with them escaped, as the
    plan's comment of what was left out names it (`result.left_out`): the message was broken over two lines, its second
    a `}` that reads as the end of something; twice written, or past the reported ones, the same."""
    text = '{"train_batch_size": 8, "b\\n}": 1, "c\\\\n": 2, "zero_optimization": {"stage": 1}}'
    imported = import_text("deepspeed", text, "ds.json", world_size=8, model=MODEL)
    messages = [d.message for d in imported.diagnostics]
    assert messages[:2] == ['unknown key "b\\n}" (DeepSpeed would ignore it without a word)',
                            'unknown key "c\\\\n" (DeepSpeed would ignore it without a word)'], messages
    twice = '{"train_batch_size": 8, "b\\n": 1, "b\\n": 2}'
    [found] = import_text("deepspeed", twice, "ds.json", world_size=8, model=MODEL).diagnostics
    assert found.message.startswith('key "b\\n" written twice') and "\n" not in found.message, found.message
    many = json.dumps({**BASE, **{f"k{i}\n": i for i in range(30)}})
    summary = import_text("deepspeed", many, "ds.json", world_size=8, model=MODEL).diagnostics[-1]
    assert summary.capped and "k20\\n, k21\\n" in summary.message and "\n" not in summary.message, summary.message


def test_keys_are_found_string_by_string_from_the_texts_start():
    """A search for `"...":` anywhere could begin at a value's closing quote: `"x", ":b": 1` read `, ` as a key and
    lost ":b" (its E804 pointed at the file's start); a key written with a \\u escape of a plain letter was not
    found; a top-level key was pointed at where an object inside another held the same name first; a key written
    twice in an inner object was pointed at where the outer one wrote it."""
    def spans(text: str) -> list[tuple[int, str]]:
        imported = import_text("deepspeed", text, "ds.json", world_size=8, model=MODEL)
        return [(d.span.start, text[d.span.start:d.span.end]) for d in imported.diagnostics]
    base = '"train_batch_size": 8, "zero_optimization": {"stage": 1}'
    text = '{"wandb": "x", ":b": 1, ' + base + '}'
    assert spans(text) == [(text.index('":b"'), '":b"')]
    text = '{"gr\\u0061dient_cliping": 1, ' + base + '}'
    assert spans(text) == [(1, '"gr\\u0061dient_cliping"')]
    text = '{"wandb": {"train_batch_size": 1}, "train_batch_size": 0, "zero_optimization": {"stage": 1}}'
    assert spans(text) == [(text.rindex('"train_batch_size"'), '"train_batch_size"')]
    text = '{"zero_optimization": {"stage": 1, "stage": 2}, "train_batch_size": 8, "stage": 1}'
    [found] = import_text("deepspeed", text, "ds.json", world_size=8, model=MODEL).diagnostics
    assert "\"stage\" written twice" in found.message and found.span.start == text.index('"stage": 2')


def test_each_top_level_key_is_pointed_at_where_it_is_written():
    """Random configs (keys of quotes, colons, backslashes, brackets, line breaks, characters past the BMP; values
    nested), written with and without escapes: each top-level key's span is that key as written at the top level
    (the search for `"...":` pointed 3,315 of 20,000 such configs' keys elsewhere or at the file's start)."""
    import random

    from plandsl.diagnostics.source import SourceFile
    from plandsl.interop.deepspeed import _Keys
    rng = random.Random(3)
    alphabet = ["a", ":", '"', "\\", " ", "{", "}", "[", "]", ",", "é", "\U0001F600", "\n"]

    def key() -> str:
        return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 4)))

    def value(depth: int):
        roll = rng.random()
        if depth < 3 and roll < 0.3:
            return {key(): value(depth + 1) for _ in range(rng.randint(0, 3))}
        if depth < 3 and roll < 0.5:
            return [value(depth + 1) for _ in range(rng.randint(0, 3))]
        return key() if roll < 0.8 else 1

    for _ in range(2_000):
        config = {key(): value(1) for _ in range(rng.randint(1, 4))}
        text = json.dumps(config, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 1]))
        keys = _Keys(SourceFile("ds.json", text))
        for name in config:
            span = keys.span(name)
            decoder = json.JSONDecoder()
            assert decoder.decode(text[span.start:span.end]) == name, (text, name)
            depth = sum(1 if c in "{[" else -1 if c in "}]" else 0
                        for c in re.sub(r'"(?:[^"\\]|\\.)*"', "", text[:span.start]))
            assert depth == 1, (text, name)


def test_a_typo_is_named_with_the_nearest_key():
    imported = import_text("deepspeed", json.dumps({**BASE, "gradient_cliping": 1.0}), "ds.json", world_size=8,
                           model=MODEL)
    assert "did you mean 'gradient_clipping'" in (imported.diagnostics[0].hint or "")


def test_not_json_is_a_diagnostic():
    imported = import_text("deepspeed", '{"train_batch_size": 16,', "ds.json", world_size=8, model=MODEL)
    assert [d.code for d in imported.diagnostics] == ["E804"] and "not JSON" in imported.diagnostics[0].message


@pytest.mark.parametrize("text, words", [
    ("[" * 100_000, "nested too deeply"),  # json's RecursionError escaped as a traceback
    ('{"a": ' * 100_000, "nested too deeply"),
    ('{"train_batch_size": 1' + "0" * 5000 + "}", "an integer of more than 4,300 digits"),  # not int()'s words
])
def test_json_too_deep_or_too_long_to_read_is_a_diagnostic(text, words):
    imported = import_text("deepspeed", text, "ds.json", world_size=8, model=MODEL)
    assert [d.code for d in imported.diagnostics] == ["E804"] and words in imported.diagnostics[0].message


WARMUP = {"type": "WarmupLR", "params": {"warmup_type": "linear", "warmup_min_lr": 0, "warmup_max_lr": 1e-4,
                                         "warmup_num_steps": 10}}


@pytest.mark.parametrize("changed, words", [
    # a string was written into the plan as it stood: `warmup_steps: 0 }` ... closed the train block
    ({"scheduler": {**WARMUP, "params": {**WARMUP["params"], "warmup_num_steps": "0 }\n  data = zero1 over dp"}}},
     "WarmupLR's \"warmup_num_steps\" must be a whole number of zero or more, found \"0 }"),
    ({"scheduler": {**WARMUP, "params": {**WARMUP["params"], "warmup_max_lr": float("nan")}}}, "found NaN"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": "fast"}}}, "must be a number of zero or more, found \"fast\""),
    ({"gradient_clipping": [1.0]}, "\"gradient_clipping\" must be a number of zero or more, found [1.0]"),  # TypeError
    ({"gradient_clipping": "1.0"}, "found \"1.0\""),  # ValueError: float() of the plan's number
    ({"optimizer": {"type": "AdamW", "params": [1e-4]}}, "optimizer's \"params\" must be an object"),  # AttributeError
])
def test_a_number_the_plan_writes_must_be_a_finite_number(changed, words):
    imported = import_text("deepspeed", json.dumps({**BASE, **changed}), "ds.json", world_size=8, model=MODEL)
    assert [d.code for d in imported.diagnostics] == ["E804"] and words in imported.diagnostics[0].message, \
        [d.message for d in imported.diagnostics]
    assert import_text("deepspeed", json.dumps({**BASE, "scheduler": WARMUP}), "ds.json", world_size=8,
                       model=MODEL).ok


def test_cli_imports_a_config_with_its_model(tmp_path):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps(BASE))
    runner = CliRunner()
    result = runner.invoke(main, ["import", "--from", "deepspeed", "--world-size", "8", "--args-file", str(config),
                                  "-o", str(tmp_path / "ds.plan")])
    assert result.exit_code == 2 and "--model is needed" in result.output
    result = runner.invoke(main, ["import", "--from", "deepspeed", "--world-size", "8", "--model", MODEL,
                                  "--args-file", str(config), "-o", str(tmp_path / "ds.plan")])
    assert result.exit_code == 0, result.output
    assert "data    = zero2 over dp" in (tmp_path / "ds.plan").read_text()


# ---- against DeepSpeed's own code ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ds_config():
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install -e .[deepspeed])")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import deepspeed
        from deepspeed.runtime import config
    assert deepspeed.__version__ == "0.19.8", deepspeed.__version__
    return config


class _DataParallel:
    """The `mpu` DeepSpeedConfig asks for the data-parallel world size."""
    def __init__(self, size: int):
        self.size = size

    def get_data_parallel_world_size(self) -> int:
        return self.size


@pytest.mark.parametrize("path, name", ALL)
def test_deepspeed_config_accepts_every_export(ds_config, monkeypatch, path, name):
    plan = stdlib_plan(path, name)
    config = json.loads(export_plan(plan, "deepspeed").text)
    monkeypatch.setattr(ds_config.dist, "get_rank", lambda: 0)
    parsed = ds_config.DeepSpeedConfig(config, mpu=_DataParallel(plan.dp))
    assert (parsed.train_batch_size, parsed.train_micro_batch_size_per_gpu, parsed.gradient_accumulation_steps) == \
           (plan.train.global_batch, plan.train.micro_batch, plan.num_microbatches)
    assert parsed.zero_optimization_stage == (plan.data.zero_stage if plan.data else 0)
    assert (parsed.bfloat16_config.enabled, parsed.float16_config.enabled) == (plan.train.precision.value == "bf16",
                                                              plan.train.precision.value == "fp16")
    assert parsed.gradient_clipping == (plan.train.grad_clip or 0.0)
    assert parsed.optimizer_name == ("adam" if plan.train.optimizer.value == "adam" else "sgd")


def test_deepspeed_silently_accepts_the_typo_the_import_refuses(ds_config, monkeypatch):
    monkeypatch.setattr(ds_config.dist, "get_rank", lambda: 0)
    ds_config.DeepSpeedConfig({**BASE, "gradient_cliping": 1.0}, mpu=_DataParallel(16))  # no complaint
    assert not import_text("deepspeed", json.dumps({**BASE, "gradient_cliping": 1.0}), "ds.json", world_size=16,
                           model=MODEL).ok


def test_every_key_the_import_knows_is_deepspeeds(ds_config):
    package = Path(ds_config.__file__).resolve().parents[1]
    source = "".join(p.read_text(encoding="utf-8", errors="replace") for p in package.rglob("*.py"))
    for key in deepspeed.READ + deepspeed.IGNORED:
        assert f'"{key}"' in source or f"'{key}'" in source, key


def _zero3_plan(data: str) -> ir.Plan:
    text = ('import "clusters/dgx_a100"\nplan p {\n  model = gpt(layers=4, hidden=64, heads=4, seq=32, vocab=256)\n'
            f'  cluster = dgx_a100 x 2\n  mesh = [dp = 16]\n  train = {{ global_batch: 16 }}\n  data = {data}\n}}\n')
    return api.select_plan(api.loads(text, path="z3.plan"))


def test_zero3_import_gathers_as_deepspeed_does():
    """DeepSpeed's ZeRO-3 gathers each sub-module and prefetches by elements: stage 3 imports as `unit = module`
    with the config's stage3_prefetch_bucket_size (5e7 when it is not given; 0 prefetches nothing)."""
    def data_line(zero: dict) -> str:
        imported = import_text("deepspeed", json.dumps({**BASE, "zero_optimization": zero}), "ds.json", world_size=16,
                               model=MODEL)
        assert imported.ok, api.render_all(imported.diagnostics, imported.sources)
        return next(line.strip() for line in imported.text.splitlines() if line.strip().startswith("data"))
    assert data_line({"stage": 3}) == "data    = zero3 over dp with unit = module, prefetch_bucket = 50000000"
    assert data_line({"stage": 3, "stage3_prefetch_bucket_size": 1000}).endswith("prefetch_bucket = 1000")
    # written as DeepSpeed's docs write it, a float that is whole (its config parser takes it)
    assert data_line({"stage": 3, "stage3_prefetch_bucket_size": 5e7}).endswith("prefetch_bucket = 50000000")
    assert data_line({"stage": 3, "stage3_prefetch_bucket_size": 0}).endswith("with unit = module, prefetch = 0")
    assert data_line({"stage": 2, "stage3_prefetch_bucket_size": 1000}) == "data    = zero2 over dp"
    bad = import_text("deepspeed", json.dumps({**BASE, "zero_optimization": {"stage": 3,
                      "stage3_prefetch_bucket_size": "big"}}), "ds.json", world_size=16, model=MODEL)
    assert [d.code for d in bad.diagnostics] == ["E804"]


def test_zero3_export_writes_the_bucket():
    def zero(data: str) -> tuple[dict, list[str]]:
        exported = export_plan(_zero3_plan(data), "deepspeed")
        return json.loads(exported.text)["zero_optimization"], [d.message for d in exported.lost]
    assert zero("zero3 over dp") == ({"stage": 3}, [])  # DeepSpeed's own default bucket
    assert zero("zero3 over dp with unit = module, prefetch_bucket = 1000") == (
        {"stage": 3, "stage3_prefetch_bucket_size": 1000}, [])
    assert zero("zero3 over dp with unit = module, prefetch = 0") == ({"stage": 3, "stage3_prefetch_bucket_size": 0}, [])
    config, lost = zero("zero3 over dp with prefetch = 2")
    assert config == {"stage": 3} and lost and "prefetch = 2" in lost[0]


def test_deepspeed_reads_the_bucket_the_export_writes(ds_config, monkeypatch):
    monkeypatch.setattr(ds_config.dist, "get_rank", lambda: 0)
    config = json.loads(export_plan(_zero3_plan("zero3 over dp with unit = module, prefetch_bucket = 1234"),
                                    "deepspeed").text)
    parsed = ds_config.DeepSpeedConfig(config, mpu=_DataParallel(16))
    assert parsed.zero_config.prefetch_bucket_size == 1234
    assert type(parsed.zero_config).model_fields["prefetch_bucket_size"].default == deepspeed.PREFETCH_BUCKET_DEFAULT


def test_an_imported_plan_that_does_not_parse_is_a_diagnostic_not_a_usage_error():
    """`result.checked` raised the parser's PlanError, which `plandsl import` printed as a usage error (exit 2)
    about a file it never wrote (a 301-digit prefetch bucket did that); now the parser's diagnostics on the text."""
    from plandsl.interop.result import checked
    text = "plan p {\n  train = { global_batch: 1" + "0" * 400 + " }\n}\n"
    imported = checked(text, "p.plan", {})
    assert not imported.ok and [d.code for d in imported.diagnostics] == ["E106"]
    assert imported.sources["p.plan"].text == text


def test_the_older_bfloat16_key_is_read_as_deepspeed_reads_it():
    """DeepSpeed reads "bfloat16" where "bf16" is not written (precision_config.get_bfloat16_config); the import
    called it an unknown key DeepSpeed would ignore (E804) and refused the config."""
    config = {key: value for key, value in BASE.items() if key != "bf16"}
    imported = import_text("deepspeed", json.dumps({**config, "bfloat16": {"enabled": True}}), "ds.json",
                           world_size=8, model=MODEL)
    assert imported.ok, [d.message for d in imported.diagnostics]
    assert api.select_plan(api.loads(imported.text, path="ds.plan")).train.precision is ir.Precision.bf16
    both = import_text("deepspeed", json.dumps({**config, "bf16": {"enabled": False}, "bfloat16": {"enabled": True}}),
                       "ds.json", world_size=8, model=MODEL)
    assert both.ok and "bfloat16" in both.ignored  # "bf16" wins, as in DeepSpeed
    assert api.select_plan(api.loads(both.text, path="ds.plan")).train.precision is ir.Precision.fp32
    # a null "bf16" is DeepSpeed's get("bf16", None) of None: the older key is read (it imported fp32)
    null = import_text("deepspeed", json.dumps({**config, "bf16": None, "bfloat16": {"enabled": True}}), "ds.json",
                       world_size=8, model=MODEL)
    assert null.ok and api.select_plan(api.loads(null.text, path="ds.plan")).train.precision is ir.Precision.bf16


def test_the_prefetch_bucket_is_read_by_either_of_its_names():
    """DeepSpeed's ZeRO config takes `prefetch_bucket_size` as well as its alias `stage3_prefetch_bucket_size`; the
    import listed the first as left out and gave the plan DeepSpeed's default bucket, 5e7, instead."""
    config = {**BASE, "zero_optimization": {"stage": 3, "prefetch_bucket_size": 1000}}
    imported = import_text("deepspeed", json.dumps(config), "ds.json", world_size=8, model=MODEL)
    assert imported.ok, [d.message for d in imported.diagnostics]
    assert "prefetch_bucket = 1000" in imported.text and not any("prefetch" in i for i in imported.ignored)
    both = {**BASE, "zero_optimization": {"stage": 3, "prefetch_bucket_size": 1000,
                                          "stage3_prefetch_bucket_size": 2000}}
    refused = import_text("deepspeed", json.dumps(both), "ds.json", world_size=8, model=MODEL)
    assert [d.code for d in refused.diagnostics] == ["E804"] and "both given" in refused.diagnostics[0].message


@pytest.mark.parametrize("zero, bf16, stage, precision", [
    ({"stage": 1.0}, {"enabled": "false"}, 1, "fp32"), ({"stage": True}, {"enabled": "yes"}, 1, "bf16"),
    ({"stage": "3"}, {"enabled": 1}, 3, "bf16"), ({"stage": False}, {"enabled": "off"}, 0, "fp32"),
])
def test_values_deepspeeds_pydantic_reads_are_read_as_it_reads_them(zero, bf16, stage, precision):
    """DeepSpeed 0.19.8's configs are pydantic models in lax mode: a stage of 1.0, true or "3", an "enabled" of
    "yes", 1 or "off" run; the import refused them (E804), and bool("false") had imported bf16 before that."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install -e .[deepspeed])")
    from deepspeed.runtime.precision_config import get_bfloat16_config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    assert int(DeepSpeedZeroConfig(**zero).stage) == stage
    assert get_bfloat16_config({"bf16": bf16}).enabled == (precision == "bf16")
    imported = import_text("deepspeed", json.dumps({**BASE, "zero_optimization": zero, "bf16": bf16}), "ds.json",
                           world_size=8, model=MODEL)
    assert imported.ok, [d.message for d in imported.diagnostics]
    plan = api.select_plan(api.loads(imported.text, path="ds.plan"))
    assert (plan.data.zero_stage if plan.data else 0, plan.train.precision.value) == (stage, precision)
