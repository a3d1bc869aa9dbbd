"""The files plandsl reads besides plans, at hostile sizes: the work follows the file's size, never its square.

Each case gives one of them (another tool's flags or config for `plandsl import`, a torch schedule CSV, a layer table
written by hand) many of one thing (values, keys, ranks, plan entries) and bounds the CPU time (`bounded`): the
quadratic each fixed took several times the bound at these sizes, the linear reading a fraction of it.
tests/unit/test_hostile_input.py holds the files that are no files (devices, fifos, links, 100 MB) and
tests/unit/test_bad_input.py the plans.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from plandsl.diagnostics import render
from plandsl.interop import import_text
from plandsl.interop.flags import read_flags
from support import bounded

MEGATRON = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 128 --max-position-embeddings 128 "
            "--padded-vocab-size 512 --micro-batch-size 1 --global-batch-size 8 ")


def test_a_flag_with_50000_values_is_read_in_one_pass():
    """`--seed 1 1 1 ...`: each value rebuilt the flag with a tuple one longer (3 s for 50,000 words, 12 s for
    100,000); now 0.2 s."""
    text = "--seed " + " ".join(["1"] * 50_000) + " --lr 0.1"
    with bounded(1.5, "read_flags"):
        _, flags = read_flags(text, "<flags>")
    assert [(f.name, len(f.values)) for f in flags] == [("--seed", 50_000), ("--lr", 1)]
    assert text[flags[0].value_span.start:flags[0].value_span.end] == " ".join(["1"] * 50_000)


def test_a_quoted_value_of_a_megabyte_is_read_in_one_pass():
    """shlex added a character at a time to a string its object held, copying it each time: one quoted value of
    400,000 characters took 1.7 s, of 1,000,000 12 s (an args file may hold 2 MB); now milliseconds."""
    for quote in "'\"":
        text = f"--seed {quote}{'a b' * 333_333}{quote} --lr 0.1"
        with bounded(1.0, f"read_flags of {quote}...{quote}"):
            _, flags = read_flags(text, "<flags>")
        assert [(f.name, f.values) for f in flags] == [("--seed", ("a b" * 333_333,)), ("--lr", ("0.1",))]


def test_words_are_unquoted_as_shlex_unquotes_them():
    """Random words of quotes, escapes, `#`, `$` and spaces, each as `read_flags` reads it against shlex's POSIX split
    of the same word."""
    import random
    import shlex

    from plandsl.interop.flags import _WORD, _unquoted
    rng = random.Random(5)
    pieces = [" ", "\t", "\n", "'", '"', "\\", "#", "a", "$", "é", "=", "-", '\\"', "\\'", "\u00a0"]
    for _ in range(3_000):
        text, at = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 12))), 0
        while at < len(text):
            word = _WORD.match(text, at)
            if word is None:
                at += 1
                continue
            at = word.end()
            if word.group(0).strip():
                assert _unquoted(word.group(0)) == shlex.split(word.group(0))[0], word.group(0)


def test_a_subcommand_written_30000_times_is_one_diagnostic_in_bounded_work():
    """torchtitan's import splits the activation checkpointing subcommand off a switch's values: 30,000 of them took
    2 s (the values, read one at a time into a tuple one longer)."""
    flags = ("--module llama3 --config llama3_debugmodel --compile.enable "
             + " ".join(["activation-checkpoint:full"] * 30_000))
    # 0.63-0.78 CPU-s here after a first call of the same size, 1.1-1.3 as the first (the heap grown for 20,000
    # flags) and 1.3 in a clean clone's CI on a slow day, against 1.0: bound 2, where the scan of the rest took 3 s
    with bounded(2.0, "import --from torchtitan"):
        imported = import_text("torchtitan", flags, "<flags>", world_size=8)
    assert not imported.ok and len(imported.diagnostics) == 1, [d.message[:80] for d in imported.diagnostics]


def test_subcommands_written_with_an_escape_are_found_among_their_flags_values():
    """Where a subcommand is written was searched for from its flag to the end of the text: one written with an escape
    (not found as read) made that a scan of the rest of the text for each, 20,000 of them 3 s."""
    flags = ("--module llama3 --config llama3_debugmodel "
             + " ".join(["--compile.enable activation-checkpoint:fu\\ll"] * 20_000))
    # 0.63-0.78 CPU-s here after a first call of the same size, 1.1-1.3 as the first (the heap grown for 20,000
    # flags) and 1.3 in a clean clone's CI on a slow day, against 1.0: bound 2, where the scan of the rest took 3 s
    with bounded(2.0, "import --from torchtitan"):
        imported = import_text("torchtitan", flags, "<flags>", world_size=8)
    assert not imported.ok and len(imported.diagnostics) == 1


def test_thousands_of_unknown_names_are_twenty_diagnostics_and_a_count():
    """Each import reports the first MAX_REPORTED unknown flags or keys with their hints and counts the rest in one
    diagnostic: 50,000 unknown keys were 50,000 diagnostics, each with a nearest-name search (DeepSpeed's 2 s,
    Megatron-LM's 10 s), of which `render` shows 100."""
    from plandsl.interop.result import MAX_REPORTED
    many = 5_000
    cases = {"deepspeed": json.dumps({"train_batch_size": 8, **{f"key{i}": i for i in range(many)}}),
             "megatron": MEGATRON + " ".join(f"--flag{i}" for i in range(many)),
             "torchtitan": "--module llama3 --config llama3_debugmodel " + " ".join(f"--flag{i}" for i in range(many))}
    for target, text in cases.items():
        model = "gpt(layers=2, hidden=64, heads=4, seq=128, vocab=512)" if target == "deepspeed" else None
        with bounded(0.5, target):
            imported = import_text(target, text, "<flags>", world_size=8, model=model)
        *each, summary = imported.diagnostics
        assert len(each) == MAX_REPORTED and all(d.message.startswith("unknown") for d in each), target
        what, first, second = ("keys", "key20", "key21") if target == "deepspeed" else ("flags", "--flag20", "--flag21")
        assert summary.code == "E804" and summary.message.startswith(
            f"and {many - MAX_REPORTED:,} more unknown {what} ({first}, {second}, "), summary.message
        assert text[summary.span.start:summary.span.end].strip('"') == first
        # for machines, the count is a field, not prose: the 21 JSON lines are not all there was
        assert summary.to_json()["capped"] == {"shown": MAX_REPORTED, "total": many}, target
        assert not any("capped" in d.to_json() for d in each)


def test_the_json_of_an_import_says_how_many_problems_it_left_unlisted(tmp_path):
    """`plandsl import --format json`: one object per diagnostic, and the one that counts the rest says `"capped":
    {"shown": 20, "total": N}` (it had the count in its message's words alone, so a consumer reading 21 lines took
    them for every problem); text output stays capped as it was."""
    from click.testing import CliRunner
    from plandsl.cli import main
    flags = tmp_path / "many.args"
    flags.write_text(MEGATRON + " ".join(f"--flag{i} 1" for i in range(25)) + "\n")
    out = CliRunner().invoke(main, ["import", "--from", "megatron", "--world-size", "8", "--args-file", str(flags),
                                    "-o", str(tmp_path / "m.plan"), "--format", "json"])
    assert out.exit_code == 1, out.output
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert [line.get("capped") for line in lines] == [None] * 20 + [{"shown": 20, "total": 25}]
    assert lines[-1]["message"].startswith("and 5 more unknown flags (--flag20, ")


def test_words_that_are_no_flags_and_flags_given_twice_are_capped_each_on_its_own():
    from plandsl.interop.result import MAX_REPORTED
    text = "stray " * 30 + MEGATRON + " ".join(f"--micro-batch-size {1 + i % 2}" for i in range(100)) + " --nope"
    imported = import_text("megatron", text, "<flags>", world_size=8)
    codes = [(d.code, d.message.split(" (")[0]) for d in imported.diagnostics]
    twice = "--micro-batch-size is given twice, as `--micro-batch-size {}` and `--micro-batch-size {}`"
    assert codes.count(("E805", twice.format(1, 2))) + codes.count(("E805", twice.format(2, 1))) == MAX_REPORTED
    assert codes.count(("E804", "`stray` is not a flag")) == MAX_REPORTED
    assert codes[-3:] == [("E804", "unknown flag --nope"), ("E804", "and 10 more words that are not flags"),
                          ("E805", "and 79 more flags given twice")]
    assert [d.capped for d in imported.diagnostics[-2:]] == [(MAX_REPORTED, 30), (MAX_REPORTED, 99)]


def test_a_schedule_csv_whose_grid_is_its_square_is_refused_before_it_is_laid_out():
    """2,000 ranks of one forward and backward each, in a chain (a 30 KB CSV), run 4,000 unit-time steps: 8,000,000
    cells, which the import wrote as a 42 MB table (8.5 s) before the parser refused it (E106 on a file never
    written)."""
    from plandsl.diagnostics.limits import MAX_GRID_CELLS
    text = "\n".join(f"{rank}F0,{rank}B0" for rank in range(2000)) + "\n"
    with bounded(1.0, "import --from torch-csv"):
        imported = import_text("torch-csv", text, "chain.csv")
    assert [d.code for d in imported.diagnostics] == ["E609"], imported.diagnostics
    assert f"a grid of 8,000,000 cells, more than the {MAX_GRID_CELLS:,}" in imported.diagnostics[0].message
    # at the cell of the action that runs last (0B0, step 4,000), whose step makes the grid that long (it had no place)
    assert str(imported.diagnostics[0].span) == "chain.csv:1:5" and "chain.csv" in imported.sources


def test_a_schedule_csvs_table_too_large_is_reported_at_its_last_action():
    """Under the grid's cap, a table of more cells than a plan's tokens (420 such rows, 264,810 cells) is E609 at the
    cell that runs last, known before it is written (the import had raised the parser's E106 at `<string>:386:2083`, a
    text never written); in a lowered CSV the cell is found among its sends and receives, at its own column."""
    text = "\n".join(f"{rank}F0,{rank}B0" for rank in range(420)) + "\n"
    with bounded(1.0, "import --from torch-csv"):
        imported = import_text("torch-csv", text, "chain.csv")
    (found,) = imported.diagnostics
    assert (found.code, str(found.span)) == ("E609", "chain.csv:1:5"), found
    assert found.message == "schedule 'imported' as a table has 264,810 cells, more than the 250,000 tokens of a " \
                            "plan (420 ranks of 840 unit-time steps)"
    rows = [f"{rank}F0,{rank}SEND_F0,{rank}RECV_B0,{rank}B0" for rank in range(1200)]
    rows[0] = '"\n0RECV_F0", 0F0,0SEND_F0,0RECV_B0,  0B0'  # its first cell's line break (quoted): the row on 2 lines
    imported = import_text("torch-csv-comms", "\n".join(rows) + "\n", "lowered.csv")  # (a blank line is a rank: E603)
    (found,) = imported.diagnostics
    assert (found.code, str(found.span), found.span.end_column - found.span.column) == ("E609", "lowered.csv:2:36", 3)
    # lines broken by a lone CR, as torch's csv module reads them: the same cell (it was put on line 1, column 37: its offset)
    rows[0] = rows[0].replace("\n", "\r")
    imported = import_text("torch-csv-comms", "\r".join(rows) + "\r", "lowered.csv")
    (found,) = imported.diagnostics
    assert (found.code, str(found.span), found.span.end_column - found.span.column) == ("E609", "lowered.csv:2:36", 3)
    assert '2 | 0RECV_F0", 0F0,0SEND_F0,0RECV_B0,  0B0' in render(found, imported.sources)


def test_printing_a_schedule_lays_out_a_bounded_grid():
    """`schedule gpipe --ranks 3000 --microbatches 1` (6,000 actions) laid out 18,000,000 cells: 7 s and 570 MB, and at
    100,000 ranks more memory than a machine has; E609 now, and json still lists the actions."""
    from plandsl import api
    from plandsl.diagnostics import PlanError
    found = api.schedule("gpipe", 3000, 1, None)
    with bounded(1.0, "schedule --format text"):
        for fmt in ("text", "csv", "plan"):
            with pytest.raises(PlanError) as error:
                api.schedule_as(found, fmt)
            assert [d.code for d in error.value.diagnostics] == ["E609"]
    assert len(json.loads(api.schedule_as(found, "json"))["actions"]) == 3000


def _layer_table(folder: Path, tp_plan: list, modules: list) -> Path:
    """A plan over a factory's model, and its layer table written by hand (as anyone may edit one): three blocks of
    two Linears, `tp_plan` its tensor-parallel plan, `modules` more modules of the tree; no torch."""
    (folder / "tiny_model.py").write_text("def build():\n    raise SystemExit('the table is written by hand')\n")
    plan = folder / "m.plan"
    plan.write_text('import "clusters/local"\nplan p {\n  model = factory("tiny_model:build")\n  cluster = localhost\n'
                    '  mesh = [dp = 1, tp = 2]\n  train = { global_batch: 2, micro_batch: 1, seq: 16 }\n'
                    '  tensor = megatron over tp\n}\n')
    from plandsl import api
    from plandsl.ir.inspected import CACHE_VERSION, file_digest, library_versions, portable_path
    missing = api.check(str(plan), {}).diagnostics[0]
    assert missing.code == "E215", missing.message
    figures = {"flops": 8192.0, "flops_per_position": 0.0, "activation_bytes": 264.0,
               "activation_bytes_per_position": 0.0}
    linear = [("up", [64, 32]), ("down", [32, 64])]
    table = {"version": CACHE_VERSION, "source": "tiny_model:build()", "seq": 2048, "output_shape": [2048, 100],
             "dtype": "bfloat16", "versions": library_versions(), "model_type": "Tiny", "params": 15488,
             "files": {portable_path(str(folder / "tiny_model.py")): file_digest(folder / "tiny_model.py")},
             "param_list": [{"name": "tok.weight", "shape": [100, 32], "dtype": "bfloat16"}] + [
                 {"name": f"layers.{i}.{name}.weight", "shape": shape, "dtype": "bfloat16"}
                 for i in range(3) for name, shape in linear],
             "modules": [{"name": "", "type": "Tiny", "params": 0}, {"name": "tok", "type": "Embedding", "params": 3200},
                         {"name": "layers", "type": "ModuleList", "params": 0}] + [
                 module for i in range(3) for module in [{"name": f"layers.{i}", "type": "Block", "params": 0}] + [
                     {"name": f"layers.{i}.{name}", "type": "Linear", "params": 2048} for name, _ in linear]] + modules,
             "block_list": "layers", "containers": ["layers"], "block_list_from": "layers",
             "blocks": [{"name": f"layers.{i}", "type": "Block", "shape_key": 0, "params": 4096, "figures": figures,
                         "input_bytes": 64.0, "output_bytes": 64.0} for i in range(3)],
             "before": {**figures, "flops": 0.0}, "after": figures, "before_params": 3200, "after_params": 0,
             "traced_blocks": 1, "tp_plan": tp_plan, "traceable": True}
    (Path(missing.hint.rsplit("-o ", 1)[1].rstrip(")"))).parent.mkdir(exist_ok=True)
    Path(missing.hint.rsplit("-o ", 1)[1].rstrip(")")).write_text(json.dumps(table))
    return plan


def test_a_layer_tables_tensor_parallel_plan_is_matched_against_its_modules_in_one_pass(tmp_path):
    """Each entry of a table's tensor-parallel plan was matched against every module (and, naming none, its hint
    searched every module's name): 4,000 entries over 4,000 more modules took 3.7 s of `check`, 2,000 entries
    naming nothing 11 s, 8,000 three minutes. Now an index of the names by component (`ir.fqn.Names`), and the
    nearest-name search for the first 20 entries naming nothing."""
    from plandsl import api
    from plandsl.check.torch_model import NEAREST_HINTS
    many = 2_000
    plan = _layer_table(tmp_path, [["layers.*.up", "colwise"], ["layers.*.down", "rowwise"]]
                        + [[f"extra{i}.proj", "colwise"] for i in range(many)]
                        + [[f"nothing{i}.proj", "colwise"] for i in range(many)],
                        [{"name": f"extra{i}.proj", "type": "Linear", "params": 0} for i in range(many)])
    with bounded(2.5, "check"):  # ~1.0 CPU-s here quiet, 1.8 with four processes on the 2 cores (before: 11 s)
        analysis = api.check(str(plan), {})
    unmatched = [d for d in analysis.diagnostics if d.code == "E405"]
    assert len(unmatched) == many and [d.code for d in analysis.errors] == ["E405"] * many
    assert all(d.hint.startswith("modules look like ") for d in unmatched)
    assert unmatched[NEAREST_HINTS].hint == "modules look like tok, layers, layers.*"


def test_the_index_of_names_matches_what_a_scan_of_them_matches():
    from plandsl.ir.fqn import Names, matching
    fqns = ["", "tok", "layers", "layers.0", "layers.0.up", "layers.10.up", "layers.0.down", "a..b", "a.b.c", "x.up",
            "layers.0.up.weight", "layers.up"]
    patterns = ["", "*", "*.*", "*.*.*", "layers.*.up", "*.0.*", "layers.*", "a..b", "a.*.b", "*.up", "layers.0.up",
                "layers.1*.up", "nothing", "layers.*.*.weight", "*.*.*.*", ".", "a.."]
    names = Names(fqns)
    for pattern in patterns:
        assert names.matching(pattern) == matching(pattern, fqns), pattern


def test_what_an_import_leaves_out_is_named_on_one_comment_line_of_bounded_length():
    """A flag's value or a DeepSpeed key holding a line break wrote the rest of it into the plan as plan text
    (`let q = 2` became the plan's; a key `"b\\n}"` made it E101); 150,000 keys left out made a comment of 3.8 MB,
    a plan too large to read back (E106 on a file never written). Now the first 50, escaped, and a count."""
    imported = import_text("megatron", MEGATRON + "--log-interval '1\nlet q = 2'", "<flags>", world_size=8)
    assert imported.ok and not any(line.startswith("let q") for line in imported.text.splitlines()), imported.text
    assert "# Left out (a plan does not hold them): --log-interval 1\\nlet q = 2\n" in imported.text
    model = "gpt(layers=2, hidden=64, heads=4, seq=128, vocab=512)"
    keys = {"train_batch_size": 8, "zero_optimization": {"stage": 1, "a\n}": 1}}
    imported = import_text("deepspeed", json.dumps(keys), "ds.json", world_size=8, model=model)
    assert imported.ok and "zero_optimization.a\\n}" in imported.text.splitlines()[1], imported.diagnostics
    from plandsl.interop.result import MAX_LEFT_OUT
    many = {**keys, "optimizer": {"type": "Adam", "params": {f"k{i}": 0 for i in range(150_000)}}}
    with bounded(1.0, "import --from deepspeed"):
        imported = import_text("deepspeed", json.dumps(many), "ds.json", world_size=8, model=model)
    assert imported.ok, [d.message for d in imported.diagnostics]
    comment = imported.text.splitlines()[1]
    assert comment.endswith(f"optimizer.params.k{MAX_LEFT_OUT - 1}, ... and {150_000 + 1 - MAX_LEFT_OUT:,} more")
    assert imported.left_out(", ") == comment.removeprefix("# Left out (a plan does not hold them): ")


def test_a_layer_table_is_read_bounded_whatever_replaced_the_file_stat_saw(tmp_path, monkeypatch):
    """`read_cache` stat the path, then read it whole: a FIFO put there after the stat (here: a stat that says a
    regular file) was opened for reading and waited for a writer for ever."""
    import os
    import threading

    from plandsl.ir import inspected
    regular = tmp_path / "table.json"
    regular.write_text("{}")
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    real_stat = os.stat
    monkeypatch.setattr(inspected.os, "stat",
                        lambda path, *args, **kwargs: real_stat(regular if str(path) == str(fifo) else path))
    states = []
    reader = threading.Thread(target=lambda: states.append(inspected.read_cache(fifo)), daemon=True)
    reader.start()
    reader.join(10)
    assert states and not states[0].fresh and "missing" in states[0].problem, states


def test_what_is_left_out_is_cut_at_whole_escapes_and_says_it_is_cut():
    """The escaped text was cut at 80 characters: a value of line separators ended on half an escape (`\\u20`, which
    reads as other text) and lost its end without `...`."""
    from plandsl.interop.result import MAX_LEFT_OUT_CHARS, left_out
    shown = left_out(["--log-dir " + "\u2028" * 30], " ")
    assert shown == "--log-dir " + "\\u2028" * ((MAX_LEFT_OUT_CHARS - 10) // 6) + "...", shown
    assert left_out(["--log-dir " + "a" * 70], " ") == "--log-dir " + "a" * 70
    assert left_out(["--log-dir " + "a" * 71], " ") == "--log-dir " + "a" * 70 + "..."


def test_a_backslash_left_out_is_told_apart_from_an_escape():
    """A value holding a backslash and an n (`'a\\nb'` in the flags) and one holding a line break were both shown
    `a\\nb`: the backslash is escaped too now, as repr does, and the plan's comment still reads back."""
    from plandsl.interop.result import left_out
    assert left_out(["--log-dir a\\nb", "--log-dir a\nb", "--log-dir C:\\data"], " ") == \
        "--log-dir a\\\\nb --log-dir a\\nb --log-dir C:\\\\data"
    imported = import_text("megatron", MEGATRON + "--tensorboard-dir 'a\\nb' --wandb-project 'a\nb'", "<flags>",
                           world_size=8)
    assert imported.ok, imported.diagnostics
    assert "# Left out (a plan does not hold them): --tensorboard-dir a\\\\nb --wandb-project a\\nb\n" in imported.text


def test_a_schedule_csv_of_random_actions_is_checked_in_time_its_size_sets():
    """A 1.1 MB CSV of 160,000 random actions (8 ranks, 10,000 microbatches): every problem of the schedule (stages on
    several ranks, actions missing or twice) is found and each carries a window of the step grid. Each diagnostic formatted
    the whole grid (20,000 steps, 68 times) and the missing actions were subtracted from the ones already reported range
    by range against every value, quadratic (a 2.4 MB file: 100 s); now about 2 s, the grid 25 steps around the problem."""
    import random
    generator = random.Random(0)
    rows = [",".join(f"{generator.randrange(8)}{generator.choice('FB')}{generator.randrange(10_000)}" for _ in range(20_000))
            for _ in range(8)]
    with bounded(8, "import --from torch-csv of 160,000 random actions"):
        imported = import_text("torch-csv", "\n".join(rows) + "\n", "random.csv")
    assert {d.code for d in imported.diagnostics} >= {"E607", "E604"}, {d.code for d in imported.diagnostics}
    gridded = [d for d in imported.diagnostics if d.grid]
    assert gridded and all(len(d.grid.splitlines()) <= 2 * 12 + 1 + 3 for d in gridded)
    assert any("<-- here" in d.grid and "  ..." in d.grid for d in gridded)


def test_diagnostics_on_one_long_line_lay_out_only_the_columns_they_show():
    """100 diagnostics on one line of 300,000 characters (a plan written on one line, a dict of 40,000 unknown keys):
    each excerpt shows the line's first 200 columns, but laid the whole line out, character by character, to find its
    caret (100 x the line: 9 s here, 17.6 of `check`'s 26 CPU-s on a 440 kB `train = {...}` line); now the characters up
    to the columns shown. A span past them was shown at the columns' edge, the caret under whatever the line had there;
    now a window of the line around it (`...` for the characters before), the caret under the span."""
    from plandsl.diagnostics import Diagnostic, render_all
    from plandsl.diagnostics.source import SourceFile
    line = "train = {" + ", ".join(f"zz{i}: 1" for i in range(30_000)) + "}"
    source = SourceFile("long.plan", line + "\n")
    columns = [line.index(f"zz{i}:") for i in range(0, 30_000, 300)]
    diagnostics = [Diagnostic("E206", "no key", source.span(start, start + 4)) for start in columns]
    with bounded(1.0, "render_all of 100 diagnostics on a 300,000-character line"):
        text = render_all(diagnostics, {"long.plan": source})
    blocks = text.split("\n\n")
    assert len(blocks) == 100
    assert blocks[0].splitlines()[3] == "  | " + " " * 9 + "^^^^"  # a caret in the columns shown: under its span
    for block, start in zip(blocks, columns):  # each caret under its own span, the shown lines within 200 columns
        shown, caret = block.splitlines()[2:4]
        at = caret.index("^")
        assert shown[at:at + 4] == line[start:start + 4] and caret.count("^") == 4, block
        assert len(shown) <= 4 + 200
    assert blocks[-1].splitlines()[2].startswith("1 | ...")
