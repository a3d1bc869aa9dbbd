"""Realistic one-mistake plans: each stdlib example with one mistake a user makes (a typo in a keyword,
attribute, axis or name, a wrong unit, a mesh that does not multiply to the devices, stages against pp,
microbatches that do not divide, a missing import or bracket, a wrong schedule name, tp against the heads,
a name given twice, ...). Each must end in a coded diagnostic at the line of the mistake (or at the line
named in `also`, where the rule it breaks is stated), with no traceback, within seconds.

The table holds edits, not plans: (example, old text, new text, code, also). `old` must occur in the
example; the mistake's line is the line where `old` starts; `also` names other acceptable lines by a
piece of their text in the edited plan (the line where the broken rule is written, e.g. the `train`
line for microbatches that do not divide a mesh axis that changed).
"""
from __future__ import annotations

from pathlib import Path

import pytest

from plandsl.check.analysis import analyze
from plandsl.diagnostics import render_all
from plandsl.diagnostics.codes import CODES
from support import bounded, cli_in_process

EXAMPLES = Path(__file__).resolve().parents[2] / "stdlib_plans" / "examples"

# (example, old, new, code, also)
MISTAKES = [
    # ---- typos in keywords, attributes, options, values ------------------------------------------------
    ("gpt3_175b_3d", 'import "clusters/dgx_a100"', 'improt "clusters/dgx_a100"', "E101", ()),
    ("gpt3_175b_3d", "plan gpt3_megatron {", "plna gpt3_megatron {", "E101", ()),
    ("gpt3_175b_3d", "model    = gpt3_175b", "model    gpt3_175b", "E101", ()),
    ("gpt3_175b_3d", "zero1 over dp", "zero1 ovr dp", "E101", ()),
    ("gpt3_175b_3d", "model    = gpt3_175b", "modle    = gpt3_175b", "E206", ()),
    ("gpt3_175b_3d", "cluster  = dgx_a100", "clutser  = dgx_a100", "E206", ()),
    ("gpt3_175b_3d", "with sequence_parallel", "with sequence_paralel", "E206", ()),
    ("gpt3_175b_3d", "with virtual = 2", "with virtaul = 2", "E206", ()),
    ("gpt3_175b_3d", "recompute: full", "recompute: ful", "E210", ()),
    ("gpt3_175b_3d", "recompute: full", "recompute: true", "E205", ()),
    ("gpt3_175b_3d", "global_batch: 1536", "global_bacth: 1536", "E206", ()),
    ("data_parallel", "data    = ddp over dp", "data    = dpp over dp", "E210", ()),
    ("data_parallel", "precision: bf16", "precision: bfloat16", "E210", ()),
    ("data_parallel", "optimizer: adam", "optimizer: adamw", "E210", ()),
    ("data_parallel", "plan gpt2_medium_ddp {", "plan gpt2-medium-ddp {", "E101", ()),
    ("fsdp", "lr_schedule: cosine", "lr_schedule: cosin", "E210", ()),
    ("long_context", "allgather over cp", "allgater over cp", "E210", ()),
    ("moe_expert_parallel", "experts = alltoall", "expert  = alltoall", "E206", ()),
    ("zero_bubble_v", "map = vshape", "map = vshap", "E210", ()),
    ("shard_rules", "rowwise over tp", "rowwize over tp", "E408", ()),
    ("shard_rules", "{ weight: Shard(0) @ tp }", "{ wieght: Shard(0) @ tp }", "E408", ()),
    ("schedule_table", "rank 2: _   _   2F0", "rank 2: _   _   2X0", "E101", ()),
    ("schedule_table", "rank 0: 0F0", "rank 0: 0f0", "E101", ()),
    ("schedule_template", "(p: ranks, m: microbatches)", "(p: rank, m: microbatches)", "E210", ()),
    ("schedule_template", "let w = min(p - r - 1, m)", "let w = mn(p - r - 1, m)", "E608", ()),
    # ---- names: misspelt, dashed, not imported, defined twice ---------------------------------------------
    ("gpt3_175b_3d", "model    = gpt3_175b", "model    = gpt3_175", "E201", ()),
    ("zero_bubble_v", "model    = llama2_70b", "model    = llama2_70B", "E201", ()),
    ("zero_bubble_v", "model    = llama2_70b", "model    = llama2-70b", "E201", ()),
    ("zero_bubble_v", "model    = llama2_70b", "model    = llama2_70b()", "E212", ()),
    ("data_parallel", 'import "models/gpt2"\n', "", "E201", ("model   = gpt2_medium",)),
    ("gpt3_175b_3d", 'import "clusters/dgx_a100"\n', "", "E201", ("cluster  =",)),
    ("gpt3_175b_3d", 'import "clusters/dgx_a100"', 'import "clusters/dgx_a10"', "E208", ()),
    ("heterogeneous", "cluster = mixed_a100_h100", "cluster = mixed_a100_h10", "E201", ()),
    ("schedule_table", "plan gpt3_6_7b_table", "plan one_f_one_b_4x8", "E202", ()),
    ("gpt3_175b_3d", "data     = zero1 over dp\n", "data     = zero1 over dp\n  data     = zero2 over dp\n", "E213",
     ("zero2 over dp",)),
    ("gpt3_175b_3d", "tp = 8]", "tp = 8, dp = 1]", "E304", ()),
    ("hsdp", "hsdp over [replica, shard]", "hsdp over [replica, replica]", "E303", ()),
    # ---- mesh axes: misspelt, moved, forgotten -----------------------------------------------------------
    ("gpt3_175b_3d", "megatron over tp", "megatron over tpp", "E302", ()),
    ("fsdp", "fsdp over dp", "fsdp over dq", "E302", ()),
    ("hsdp", "hsdp over [replica, shard]", "hsdp over [replica, shrad]", "E302", ()),
    ("moe_expert_parallel", "alltoall over ep", "alltoall over ep2", "E302", ()),
    ("shard_rules", "colwise over tp", "colwise over tq", "E302", ()),
    ("shard_rules", "Shard(0) @ tp }", "Shard(0) @ tpp }", "E302", ()),
    ("gpt3_175b_3d", "evenly over pp", "evenly over dp", "E307", ()),
    ("gpt3_175b_3d", "megatron over tp", "megatron over dp", "E307", ()),
    ("gpt3_175b_3d", "zero1 over dp", "zero1 over pp", "E307", ()),  # at the data line, not the stages line
    ("long_context", "context = allgather over cp", "context = allgather over dp", "E307", ()),
    ("moe_expert_parallel", "experts = alltoall over ep", "experts = alltoall over dp", "E306", ("mesh    =",)),
    ("fsdp", "data    = fsdp over dp", "data    = fsdp", "E306", ()),
    ("hsdp", "hsdp over [replica, shard]", "hsdp over shard", "E205", ()),
    ("gpt3_175b_3d", "tensor   = megatron over tp", "tensor   = megatron over [dp, tp]", "E205", ()),
    # ---- sizes: the mesh against the devices, the batch against the mesh, tp against the heads ----------
    ("gpt3_175b_3d", "tp = 8]", "tp = 16]", "E301", ()),
    ("gpt3_175b_3d", "dgx_a100 x 128", "dgx_a100 x 64", "E301", ("mesh     =",)),
    ("data_parallel", "dgx_a100 x 2", "dgx_a100 x 1", "E301", ("mesh    =",)),
    ("fsdp", "nodes * 8]", "nodes * 9]", "E301", ()),
    ("hsdp", "[replica = 4, shard = 8]", "[replica = 4, shard = 8, tp = 2]", "E301", ()),
    ("moe_expert_parallel", "ep = 8]", "ep = 16]", "E301", ()),
    ("data_parallel", "mesh    = [dp = 16]", "mesh    = [dp = 12]", "E501", ("train   =",)),
    ("hsdp", "[replica = 4, shard = 8]", "[replica = 4, shard = 6]", "E501", ("train   =",)),
    ("data_parallel", "micro_batch: 8", "micro_batch: 7", "E501", ()),
    ("gpt3_175b_3d", "global_batch: 1536", "global_batch: 1500", "E501", ()),
    ("gpt3_175b_3d", "micro_batch: 1,", "micro_batch: 2048,", "E501", ()),
    ("gpt3_175b_3d", "tp = 8]", "tp = 6]", "E406", ("tensor   =",)),
    ("shard_rules", "mesh    = [dp = 2, tp = 4]", "mesh    = [dp = 2, tp = 3]", "E406", ("tensor  =",)),
    ("long_context", "seq: 131072", "seq: 131073", "E406", ("tensor  =", "context =")),
    ("long_context", "cp = 4", "cp = 3", "E406", ("context =",)),
    ("moe_expert_parallel", "ep = 8]", "ep = 3]", "E406", ("train   =", "experts =")),
    ("uneven_pipeline", "global_batch: 256", "global_batch: 8", "E502", ("schedule =",)),
    ("long_context", "[dp = 2, cp = 4, tp = 8]", "[dp = 1, cp = 4, tp = 16]", "E406", ("tensor  =",)),
    # ---- a model written in the plan instead of the library's ---------------------------------------------
    ("zero_bubble_v", "model    = llama2_70b", "model    = llama(layers=16, hidden=1024, haeds=8, seq=512, vocab=32000)",
     "E212", ()),
    ("zero_bubble_v", "model    = llama2_70b", "model    = llama(layers=16, hidden=1000, heads=16, seq=512, vocab=32000)",
     "E220", ()),
    ("zero_bubble_v", "model    = llama2_70b",
     "model    = llama(layers=16, hidden=1024, heads=8, seq=512, vocab=32000, experts=8, top_k=9)", "E223", ()),
    ("zero_bubble_v", "model    = llama2_70b",
     "model    = llama(layers=16, hidden=1024, heads=8, seq=512, vocab=32000, top_k=2)", "W202", ()),
    # ---- wrong units and kinds of number -------------------------------------------------------------------
    ("data_parallel", "global_batch: 512", "global_batch: 512k", "E204", ()),
    ("gpt3_175b_3d", "global_batch: 1536", "global_batch: 1.5k", "E204", ()),
    ("long_context", "seq: 131072", "seq: 128k", "E204", ()),
    ("long_context", "seq: 131072", "seq: 131072 tokens", "E204", ()),
    ("fsdp", "lr: 3e-4", "lr: 3e-4 GB", "E205", ()),
    ("fsdp", "warmup_steps: 2000", "warmup_steps: 2000 s", "E205", ()),
    ("gpt3_175b_3d", "dp = 16,", "dp = 16 GB,", "E205", ()),
    ("gpt3_175b_3d", "micro_batch: 1,", "micro_batch: 1.5,", "E211", ()),
    ("fsdp", "warmup_steps: 2000,", "warmup_steps: 2000.5,", "E211", ()),
    ("gpt3_175b_3d", "dgx_a100 x 128", "dgx_a100 x 128.5", "E211", ()),
    ("gpt3_175b_3d", "micro_batch: 1,", "micro_batch: 0,", "E205", ()),
    ("gpt3_175b_3d", "micro_batch: 1,", "micro_batch: -1,", "E205", ()),
    ("gpt3_175b_3d", "dgx_a100 x 128", "dgx_a100 x 0", "E205", ()),
    ("gpt3_175b_3d", "dgx_a100 x 128", "dgx_a100 * 128", "E205", ()),
    ("gpt3_175b_3d", "virtual = 2", "virtual = 0", "E205", ()),
    ("fsdp", "grad_clip: 1.0,", "grad_clip: -1.0,", "E205", ()),
    ("fsdp", "lr: 3e-4,", "lr: 0,", "E205", ()),
    ("fsdp", "param nodes = 8", "param nodes = 0", "E205", ("cluster =",)),
    ("long_context", "seq: 131072", "seq: 0", "E205", ()),
    # ---- brackets ----------------------------------------------------------------------------------------
    ("gpt3_175b_3d", "[dp = 16, pp = 8, tp = 8]", "[dp = 16, pp = 8, tp = 8", "E101", ()),
    ("gpt3_175b_3d", "recompute: full }", "recompute: full", "E101", ()),
    ("hsdp", "hsdp over [replica, shard]", "hsdp over [replica, shard", "E101", ()),
    ("gpt3_175b_3d", "[dp = 16, pp = 8, tp = 8]", "(dp = 16, pp = 8, tp = 8)", "E101", ()),
    ("gpt3_175b_3d", "[dp = 16, pp = 8, tp = 8]", "[dp = 16, pp = 8 tp = 8]", "E101", ()),
    ("gpt3_175b_3d", "= { global_batch", "= {{ global_batch", "E101", ()),
    ("gpt3_175b_3d", "schedule = interleaved_1f1b\n}", "schedule = interleaved_1f1b\n", "E102", ("schedule =",)),
    # ---- stages and schedules --------------------------------------------------------------------------------
    ("gpt3_175b_3d", "interleaved_1f1b", "interleaved_1fb1", "E601", ()),
    ("zero_bubble_v", "schedule = zbv", "schedule = zb_v", "E601", ()),
    ("schedule_template", "schedule = pipedream_flush", "schedule = pipedream_flsh", "E601", ()),
    ("uneven_pipeline", "schedule = 1f1b", "schedule = 1f1", "E205", ()),
    ("gpt3_175b_3d", "schedule = interleaved_1f1b", "schedule = 1f1b", "E409", ()),
    ("gpt3_175b_3d", "schedule = interleaved_1f1b", "schedule = zbv", "E409", ()),
    ("zero_bubble_v", "virtual = 2", "virtual = 1", "E409", ()),
    ("zero_bubble_v", "map = vshape", "map = [0, 1]", "E409", ()),
    ("heterogeneous", "1: layers[12:40]", "1: layers[13:40]", "E402", ("0: embed",)),
    ("uneven_pipeline", "7:    layers[72:80]", "7:    layers[72:79]", "E402", ()),
    ("heterogeneous", "0: embed, layers[0:12]", "0: embed, layers[0:13]", "E401", ("1: layers",)),
    ("uneven_pipeline", "1..7: layers[9:72]", "1..7: layers[9:73]", "E401", ("7:    layers",)),
    ("heterogeneous", "1: layers[12:40]", "2: layers[12:40]", "E403", ()),
    ("uneven_pipeline", "1..7: layers[9:72]", "1..6: layers[9:72]", "E403", ()),
    ("heterogeneous", "mesh    = [pp = 2, dp = 4, tp = 8]", "mesh    = [pp = 4, dp = 2, tp = 8]", "E404",
     ("stages {",)),
    ("heterogeneous", "norm, head", "norm, haed", "E405", ()),
    ("uneven_pipeline", "0:    embed, layers[0:9]", "0:    embd, layers[0:9]", "E405", ()),
    ("shard_rules", "shard layers.0.mlp.w2", "shard layers.0.mlp.w5", "E405", ()),
    ("shard_rules", "shard head ", "shard hed  ", "E405", ()),
    ("shard_rules", "Shard(0) @ tp, bias", "Shard(2) @ tp, bias", "E408", ()),
    ("shard_rules", "Shard(1) @ dp]", "Shard(1) @ dp, Shard(0) @ dp]", "E303", ()),
    ("uneven_pipeline", "0:    embed", "-1:    embed", "E205", ()),
    ("uneven_pipeline", "1..7:", "7..1:", "E205", ()),
    ("schedule_table", "rank 3: _   _   _   3F0", "rank 3: _   _   _   3F1", "E604", ()),
    ("schedule_table", "0B6 _   0B7", "0B6 _   _  ", "E603", ()),
    ("schedule_table", "rank 3: _", "rank 4: _", "E608", ()),
    ("schedule_table", "global_batch: 128", "global_batch: 256", "E608", ()),
    ("schedule_table", "mesh     = [dp = 4, pp = 4, tp = 2]", "mesh     = [dp = 4, pp = 2, tp = 4]", "E608", ()),
    ("schedule_template", "for i in m - w..m { B(r, i) }", "for i in m - w..m { B(r, i + 1) }", "E602", ()),
    ("schedule_template", "F(r, w + i); B(r, i)", "F(r, w + i); B(r, i); B(r, i)", "E604", ()),
    ("schedule_template", "for i in 0..w { F(r, i) }", "for i in 0..w { F(r + 1, i) }", "E607", ()),
    ("schedule_template", "on rank r", "on rank r + 1", "E608", ()),
]


def _case_id(case) -> str:
    example, old, new, code, _ = case
    return f"{example}:{code}:{old.strip()[:18]}->{new.strip()[:18]}"


def _mistake(case) -> tuple[str, str, set[int]]:
    """(the example's name, its text with the mistake, the lines a diagnostic of it may point at)."""
    example, old, new, _, also = case
    text = (EXAMPLES / f"{example}.plan").read_text(encoding="utf-8")
    assert old in text, f"{example}.plan no longer contains {old!r}: update the table"
    at = text.index(old)
    edited = text[:at] + new + text[at + len(old):]
    lines = {text[:at].count("\n") + 1}
    for anchor in also:
        assert anchor in edited, (example, anchor)
        lines.add(edited[:edited.index(anchor)].count("\n") + 1)
    return example, edited, lines


@pytest.mark.parametrize("case", MISTAKES, ids=[_case_id(c) for c in MISTAKES])
def test_one_mistake_is_one_coded_diagnostic_at_its_line(case, tmp_path):
    example, text, lines = _mistake(case)
    code = case[3]
    path = tmp_path / f"{example}.plan"
    path.write_text(text, encoding="utf-8")
    with bounded(10, "analyze"):  # CPU time: a loaded machine must not fail it
        analysis = analyze(str(path))
    rendered = render_all(analysis.diagnostics, analysis.sources)
    assert all(d.code in CODES for d in analysis.diagnostics), rendered
    assert code.startswith("W") or any(d.is_error for d in analysis.diagnostics), f"no error for the mistake:\n{text}"
    mine = [d for d in analysis.diagnostics if d.code == code]
    assert mine, f"expected {code}:\n{rendered}"
    assert any(d.span.file == str(path) and d.span.line in lines for d in mine), \
        f"{code} should point at line {sorted(lines)}:\n{rendered}"


def test_the_command_line_reports_every_mistake_without_a_traceback(tmp_path):
    """`plandsl check` on all the edited plans at once: exit 1, a coded error per file, no traceback."""
    files = []
    for i, case in enumerate(MISTAKES):
        example, text, _ = _mistake(case)
        path = tmp_path / f"{i:03d}_{example}.plan"
        path.write_text(text, encoding="utf-8")
        files.append(str(path))
    result = cli_in_process("check", *files, cwd=Path(__file__).resolve().parents[2])
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-2000:]
    assert "Traceback" not in output, output[-4000:]
    for path in files:
        assert f"{path}:" in output and f"{Path(path).name}: " in output, f"nothing said about {path}"
