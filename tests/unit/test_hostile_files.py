"""The files plandsl reads besides plans, at hostile sizes: the work follows the file's size, never its square.

Each case gives one of them (another tool's flags or config for `plandsl import`, a schedule table, a metrics file, a
layer table, a cluster file) many of one thing (values, keys, rows) and bounds the CPU time (`bounded`): a quadratic
takes ten to a hundred times the bound at these sizes, the linear reading a tenth of it. tests/unit/test_hostile_input.py
holds the files that are no files (devices, fifos, links, 100 MB) and tests/unit/test_bad_input.py the plans.
"""
from __future__ import annotations

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


def test_a_subcommand_written_30000_times_is_one_diagnostic_in_bounded_work():
    """torchtitan's import splits the activation checkpointing subcommand off a switch's values: 30,000 of them took
    2 s (the values, read one at a time into a tuple one longer)."""
    flags = ("--module llama3 --config llama3_debugmodel --compile.enable "
             + " ".join(["activation-checkpoint:full"] * 30_000))
    with bounded(1.0, "import --from torchtitan"):
        imported = import_text("torchtitan", flags, "<flags>", world_size=8)
    assert not imported.ok and len(imported.diagnostics) == 1, [d.message[:80] for d in imported.diagnostics]
