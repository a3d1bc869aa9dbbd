"""`plandsl export --to torch-csv|torch-csv-comms` and `import --from torch-csv`, held against torch's own
`_PipelineScheduleRuntime`: it loads every exported built-in on a fake process group (compute-only: it lowers
it itself; lowered: as written) and its simulator runs the lowered schedule to the end, without a deadlock."""
from __future__ import annotations

import re

import pytest
from click.testing import CliRunner

from plandsl import api
from plandsl.cli import main
from plandsl.diagnostics import render
from plandsl.interop.torch_csv import import_csv
from plandsl.schedules.registry import BUILTIN
from tests.support import lazy

torch = lazy("torch")

PLAN = """\
import "clusters/local"
model m = gpt(layers=16, hidden=32, heads=4, seq=16, vocab=64)
plan p {{
  model    = m
  cluster  = localhost
  mesh     = [pp = 4] over devices[0:4]
  train    = {{ global_batch: 8, micro_batch: 1 }}
  stages   = evenly over pp{virtual}
  schedule = {schedule}
}}
"""
STAGES_PER_RANK = {"interleaved_1f1b": "2", "looped_bfs": "2", "interleaved_zero_bubble": "2", "zbv": "2, map = vshape",
                   "dualpipev": "2, map = vshape"}
RUNS_IN_TORCH = sorted(name for name in BUILTIN if name != "chimera")  # chimera: two pipelines, below


def _plan(schedule: str):
    virtual = STAGES_PER_RANK.get(schedule)
    text = PLAN.format(schedule=schedule, virtual=f" with virtual = {virtual}" if virtual else "")
    return api.select_plan(api.loads(text, path="p.plan"))


def _torch_loads(path, ranks: int, stages: int, rank_stages, microbatches: int, fmt: str):
    """torch's runtime on fake rank 0 of `ranks` loads the CSV; its lowered order, simulated."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime, _simulate_comms_compute
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=ranks)
    try:
        held = [PipelineStage(torch.nn.Linear(4, 4), s, stages, torch.device("cpu")) for s in rank_stages]
        runtime = _PipelineScheduleRuntime(held, microbatches)
        runtime._load_csv(str(path), format=fmt)
        order = runtime.pipeline_order_with_comms
        assert sorted(order) == list(range(ranks))
        mapping = dict(runtime.stage_index_to_group_rank)
        # its simulator follows compute and send/recv; the rank-local FSDP actions its lowering adds (UNSHARD,
        # RESHARD, REDUCE_GRAD) wait for nobody, and it does not know them
        local = ("UNSHARD", "RESHARD", "REDUCE_GRAD")
        _simulate_comms_compute({r: [a for a in actions if a is None or a.computation_type.name not in local]
                                 for r, actions in order.items()}, lambda s: mapping[s], stages)
        return order
    finally:
        dist.destroy_process_group()


@pytest.mark.xdist_group("torch")
@pytest.mark.parametrize("schedule", RUNS_IN_TORCH)
@pytest.mark.parametrize("target, fmt", [("torch-csv", "compute_only"), ("torch-csv-comms", "compute_comms")])
def test_torch_loads_and_simulates_every_exported_builtin(schedule, target, fmt, tmp_path):
    plan = _plan(schedule)
    exported = api.export(plan, target)
    assert exported.lost == () and exported.text
    path = tmp_path / "schedule.csv"
    path.write_text(exported.text)
    from plandsl.cost.schedule import plan_schedule
    program, _ = plan_schedule(plan)
    rank0 = sorted(s for s, r in enumerate(program.stage_to_rank[0]) if r == 0)
    order = _torch_loads(path, 4, program.stages, rank0, plan.num_microbatches, fmt)
    compute = ("FORWARD", "FULL_BACKWARD", "BACKWARD_INPUT", "BACKWARD_WEIGHT")
    computed = [[a for a in order[r] if a is not None and a.computation_type.name in compute] for r in range(4)]
    assert [len(row) for row in computed] == [len(row) for row in program.compute_only().actions]


@pytest.mark.parametrize("schedule", RUNS_IN_TORCH)
@pytest.mark.parametrize("target", ["torch-csv", "torch-csv-comms"])
def test_import_of_an_export_names_the_same_schedule(schedule, target, tmp_path):
    """export -> import -> a plan over the imported table -> export again: the same compute-only CSV."""
    plan = _plan(schedule)
    imported = api.import_config(target, api.export(plan, target).text, "schedule.csv", name="mine",
                                 plan_path=str(tmp_path / "mine.plan"))
    assert imported.ok, imported.diagnostics
    (tmp_path / "mine.plan").write_text(imported.text)
    virtual = STAGES_PER_RANK.get(schedule)
    again = PLAN.format(schedule="table_mine", virtual=f" with virtual = {virtual}" if virtual else "")
    (tmp_path / "p.plan").write_text(again.replace('import "clusters/local"', 'import "clusters/local"\nimport "mine"'))
    reloaded = api.load_plan(tmp_path / "p.plan")
    assert api.export(reloaded, "torch-csv").text == api.export(plan, "torch-csv").text


def test_what_a_schedule_csv_cannot_say_is_lost():
    chimera = api.export(_plan("chimera"), "torch-csv")
    assert [d.code for d in chimera.lost] == ["E808"] and "2 pipelines" in chimera.lost[0].message
    from tests.conftest import STDLIB
    flat = api.load_plan(STDLIB / "local" / "dp.plan")
    [lost] = api.export(flat, "torch-csv-comms").lost
    assert lost.code == "E808" and "has no pipeline" in lost.message


def test_the_cli_reads_a_csv_without_devices_and_refuses_them(tmp_path):
    csv = tmp_path / "s.csv"
    csv.write_text(api.export(_plan("1f1b"), "torch-csv").text)
    runner = CliRunner()
    out = runner.invoke(main, ["import", "--from", "torch-csv", "--args-file", str(csv), "-o", str(tmp_path / "s.plan")])
    assert out.exit_code == 0, out.output
    assert "schedule table_s(ranks = 4, microbatches = 8)" in (tmp_path / "s.plan").read_text()
    # the name said is the one written, which plans name (it said 'pipe' of a file holding `table_pipe`), and a name
    # the language cannot read is a usage error (it wrote `table_bad_name_` and said 'bad name!')
    named = runner.invoke(main, ["import", "--from", "torch-csv", "--args-file", str(csv), "--name", "pipe",
                                 "-o", str(tmp_path / "n.plan")])
    assert named.exit_code == 0 and "schedule 'table_pipe'" in named.output, named.output
    odd = runner.invoke(main, ["import", "--from", "torch-csv", "--args-file", str(csv), "--name", "bad name!",
                               "-o", str(tmp_path / "o.plan")])
    assert odd.exit_code == 2 and "--name 'bad name!'" in odd.output and not (tmp_path / "o.plan").exists()
    refused = runner.invoke(main, ["import", "--from", "torch-csv", "--world-size", "4", "--args-file", str(csv),
                                   "-o", str(tmp_path / "t.plan")])
    assert refused.exit_code == 2 and "a schedule CSV says the schedule only" in refused.output
    bad = tmp_path / "bad.csv"
    bad.write_text("0F0,0X1\n")
    broken = runner.invoke(main, ["import", "--from", "torch-csv", "--args-file", str(bad), "-o", str(tmp_path / "b.plan")])
    assert broken.exit_code == 1 and "E602" in broken.output and "Traceback" not in broken.output
    # the problem names the file read, not one named after -o (it said `b.csv: line 1: ...`)
    assert f"{bad}: line 1" in broken.output and "b.csv" not in broken.output.replace(str(bad), ""), broken.output
    (tmp_path / "empty.csv").write_text(",,\n")
    empty = runner.invoke(main, ["import", "--from", "torch-csv", "--args-file", str(tmp_path / "empty.csv"),
                                 "-o", str(tmp_path / "e.plan")])
    assert empty.exit_code == 1 and f"{tmp_path / 'empty.csv'} holds no action" in empty.output, empty.output


def test_a_comms_csvs_send_and_receive_cells_are_read_before_they_are_dropped(tmp_path):
    """`torch-csv-comms`: the send/recv cells are dropped (the plan's schedule is its computation), but only once each
    reads as one; a mangled one (`0SEND_Fx1`) was dropped unread and the import said nothing."""
    good = api.export(_plan("1f1b"), "torch-csv-comms").text
    assert import_csv(good, "c.csv", "c").ok
    line = good.splitlines()[0].split(",")
    sent = next(i for i, cell in enumerate(line) if "SEND_F" in cell)
    line[sent] = line[sent].replace("SEND_F", "SEND_Fx")
    bad = "\n".join([",".join(line), *good.splitlines()[1:]]) + "\n"
    imported = import_csv(bad, "c.csv", "c")
    assert [d.code for d in imported.diagnostics] == ["E602"] and "c.csv: line 1" in imported.diagnostics[0].message


@pytest.mark.parametrize("text, where, end", [
    ("0F0,0X1\n", "c.csv:1:5", 8),                 # a compute cell that is no action
    ("0F0, 1F0\r0B0,  0X1 ,1B0\r", "c.csv:2:7", 10),  # lines a lone CR breaks, as the csv module reads them
    ("0F0,0SEND_F0\r\n0RECV_B0, 0Bx0\r\n", "c.csv:2:11", 15),  # a compute cell among a lowered CSV's transfers
    ("0F0,0SEND_Fx0\n0B0\n", "c.csv:1:5", 14),     # a mangled transfer
])
def test_a_cell_that_is_no_action_is_E602_at_the_cell(text, where, end):
    """E602 for a cell that does not read as an action had no place (`line N` in its message alone): it is at the
    cell, its line counted as torch's csv module counts them (a lone CR breaks a line), with the line quoted."""
    imported = import_csv(text, "c.csv", "c")
    (found,) = imported.diagnostics
    assert (found.code, str(found.span), found.span.end_column) == ("E602", where, end), found
    rendered = render(found, imported.sources)
    assert f"{where}: error[E602]" in rendered and "^" in rendered, rendered
    line = int(where.split(":")[1])
    assert re.split(r"\r\n|\r|\n", text)[line - 1] in rendered, rendered


@pytest.mark.parametrize("target", ["torch-csv", "torch-csv-comms"])
def test_a_lossy_export_of_a_plan_without_a_pipeline_writes_nothing(tmp_path, target):
    """`export --to torch-csv --lossy` of a plan without a pipeline wrote an empty CSV, which `import --from
    torch-csv` refuses (E603 holds no action): everything is lost, so there is nothing to write."""
    out = tmp_path / "order.csv"
    from tests.conftest import STDLIB
    plan = str(STDLIB / "examples" / "fsdp.plan")
    result = CliRunner().invoke(main, ["export", plan, "--to", target, "--lossy", "-o", str(out)])
    assert result.exit_code == 1 and not out.exists(), result.output
    assert "error[E808]" in result.output and f"has nothing {target}'s format holds; nothing written" in result.output
    piped = CliRunner().invoke(main, ["export", str(STDLIB / "examples" / "gpt3_175b_3d.plan"), "--to", target, "--lossy",
                                      "-o", str(out)])
    assert piped.exit_code == 0 and out.read_text().strip()  # a pipeline's schedule is still written


@pytest.mark.parametrize("cell, shown", [("\t1X1", "\\t1X1"), ("0F\u20281", "0F\\u20281"), ("0F\\1", "0F\\\\1")])
def test_a_cell_that_is_no_action_is_quoted_on_one_line(cell, shown):
    """E602 quoted the cell raw: a tab, or a U+2028 (no line break to the csv module, so inside the cell), printed as
    such broke the message; they are escaped as Python's repr escapes them, the backslash too (as 192f6ec's keys)."""
    imported = import_csv(f"0F0,0B0\n1F0,{cell}\n", "c.csv", "c")
    (found,) = imported.diagnostics
    assert found.code == "E602" and f"'{shown}' is not an action" in found.message, found.message


@pytest.mark.parametrize("target", ["torch-csv", "torch-csv-comms"])
def test_a_csv_with_quoted_cells_reads_as_torchs_csv_module_reads_it(target):
    """torch reads a schedule CSV with the csv module, which takes `"0F0"` (a spreadsheet's export quotes cells) as
    0F0; the import split lines at commas and read the quotes as part of the action (E602 `'"0F0"' is not an
    action`). Every cell quoted, the import is the unquoted one's."""
    import csv
    import io
    plain = api.export(_plan("interleaved_1f1b"), target).text
    out = io.StringIO()
    csv.writer(out, quoting=csv.QUOTE_ALL).writerows(csv.reader(io.StringIO(plain, newline="")))
    assert out.getvalue().startswith('"0F0",')
    quoted = import_csv(out.getvalue(), "q.csv", "q")
    assert quoted.ok and quoted.text == import_csv(plain, "q.csv", "q").text, quoted.diagnostics
    bad = import_csv('0F0,"0B0"\r\n"1F0","0X1"\r\n', "c.csv", "c")  # a quoted cell that is no action: at its text
    (found,) = bad.diagnostics
    assert (found.code, str(found.span), found.span.end_column) == ("E602", "c.csv:2:8", 11), found


@pytest.mark.parametrize("text, written", [
    ('0F0,"0F""1"\n', '0F""1'),            # a doubled quote: two characters of the file
    ('0F0," 0F""1 " \n', '0F""1'),         # spaces inside and after the quotes left out
    ('"0F""""1",0F0\n', '0F""""1'),        # two of them, in the first cell
    ('0F0,"0F"x1\n', '0F"x1'),             # text after the closing quote: the cell reads on to the comma
    ('0F0,0SEND_F0\n0B0,"0""F1"\n', '0""F1'),  # among a lowered CSV's transfers
])
def test_e602_of_a_quoted_cell_underlines_the_cell_as_written(text, written):
    """E602 underlined a quoted cell's text by its length as read (`"0F""1"` reads as the four characters 0F"1) from
    after its opening quote: `0F""`, short of the cell; now the cell's characters in the file, each `""` two."""
    (found,) = import_csv(text, "c.csv", "c").diagnostics
    assert found.code == "E602" and text[found.span.start:found.span.end] == written, found
    assert found.span.end_column - found.span.column == len(written)


@pytest.mark.xdist_group("torch")
@pytest.mark.parametrize("where, row", [(2, ""), (4, ""), (0, ""), (2, "  "), (2, ",,")],
                         ids=["blank", "blank last", "blank first", "spaces", "idle cells"])
@pytest.mark.parametrize("target, fmt", [("torch-csv", "compute_only"), ("torch-csv-comms", "compute_comms")])
def test_a_row_without_an_action_is_refused_as_torch_refuses_it(tmp_path, where, row, target, fmt):
    """torch's `_load_csv` reads the CSV with csv.reader, which gives a blank line as a row: a rank with no action,
    the rows after it a rank further on. torch refuses it at the 4 ranks the other rows hold ("incorrect number of
    ranks") and, compute-only, at 5 too (a rank without a compute action; lowered, an idle cell). The import skipped
    a blank line and read the CSV as 4 ranks; a row of idle cells was a rank of nothing. Now both are E603 at the
    line, saying what torch reads."""
    plan = _plan("interleaved_1f1b")
    lines = api.export(plan, target).text.split("\n")[:-1]  # 4 rows, each ending in a line break
    text = "\n".join(lines[:where] + [row] + lines[where:]) + "\n"
    path = tmp_path / "order.csv"
    path.write_text(text)
    from plandsl.cost.schedule import plan_schedule
    program, _ = plan_schedule(plan)
    rank0 = sorted(s for s, r in enumerate(program.stage_to_rank[0]) if r == 0)
    with pytest.raises(AssertionError, match="incorrect number of ranks - expected 4, actual 5"):
        _torch_loads(path, 4, program.stages, rank0, plan.num_microbatches, fmt)
    if fmt == "compute_only" or row:
        with pytest.raises(AssertionError, match=r"len\(compute_actions\[rank\]\)=0|to be not None"):
            _torch_loads(path, 5, program.stages, rank0, plan.num_microbatches, fmt)
    imported = import_csv(text, "c.csv", "c")
    (found,) = imported.diagnostics
    assert found.code == "E603" and (found.span.line, found.span.column) == (where + 1, 1), found
    blank = f"line {where + 1} is blank, and torch reads every line as a rank's row: this one as rank {where}"
    assert (blank if not row.strip() else f"line {where + 1}, rank {where}'s row, has no compute action") \
        in found.message, found.message


def test_csv_records_and_cells_are_the_csv_modules():
    """`csv_lines` and `csv_cells` (the offsets E602 needs, which the csv module does not give) read any text as
    `csv.reader` does: quotes, doubled quotes, commas and line breaks inside them, text after a closing quote, an
    unterminated quote (random texts over those characters)."""
    import csv
    import io
    import random
    from plandsl.schedules.program import csv_cells, csv_lines
    generator = random.Random(20)
    texts = ['"0F0","0F1"\n', ' "0F0",0F1\n', '"0F0"x,0F1\n', '"0""F0",1\n', '"0F0\n1F0",2\n', '"a,b",c\r\nd\re\n\nf']
    texts += ["".join(generator.choice('",\n\r a0') for _ in range(generator.randint(0, 14))) for _ in range(5000)]
    for text in texts:
        records = csv_lines(text)
        assert all(text[at:at + len(record)] == record for at, record in records), text
        ours = [[cell for _, cell in csv_cells(at, record)] if record else [] for at, record in records]
        assert ours == list(csv.reader(io.StringIO(text, newline=""))), repr(text)


def test_a_quoted_cells_line_break_is_no_rows_end_and_moves_the_line_an_error_names():
    """torch strips each cell (`_Action.from_str`), so a quoted cell `"\n1F0"` is 1F0 in its row; the comms CSV's
    import rebuilt the text from the cells unstripped and broke the row there (E607, a fifth rank). A cell past a
    quoted line break is a line further down than its record's number: the message's line is the span's."""
    plain = api.export(_plan("1f1b"), "torch-csv-comms").text
    first, rest = plain.split("\n", 1)
    cells = first.split(",")
    at = next(i for i, cell in enumerate(cells) if i and cell and "SEND" not in cell and "RECV" not in cell)
    cells[at] = f'"\n{cells[at]}"'  # a compute cell the import keeps
    quoted = import_csv(",".join(cells) + "\n" + rest, "q.csv", "q")
    assert quoted.ok and quoted.text == import_csv(plain, "q.csv", "q").text, quoted.diagnostics
    for text in ('0F0,"0B0\n"\r\n1F0,0X1\r\n', '0F0,"0B0\n",0SEND_F0\r\n1F0,0X1\r\n'):
        (found,) = import_csv(text, "c.csv", "c").diagnostics
        assert (found.code, str(found.span)) == ("E602", "c.csv:3:5") and "line 3: '0X1'" in found.message, found
