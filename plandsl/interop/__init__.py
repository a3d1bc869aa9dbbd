"""Other tools' configurations in and out: `plandsl export --to TARGET` and `plandsl import --from TARGET`.

Stage: interop, beside render and rewrite, below the API (no torch: each adapter writes and reads the target's
own text, and the tests hold it against the target's installed code). One module per target:
`megatron` (Megatron-LM's arguments, megatron-core 0.16.1; `megatron_import` reads them back), `torchtitan`
(torchtitan 0.3.0's arguments; `torchtitan_import` reads them back), `deepspeed`
(DeepSpeed's JSON config, 0.19.8; the model comes from `--model`, the config does not name it), and
`torch_csv` (torch's pipeline schedule CSV, compute-only or lowered: a plan's schedule out, a schedule table in). Results are
`result.Exported` and `result.Imported`; `cluster` reads the cluster an import is given.
"""
from __future__ import annotations

import os
import re

from plandsl import ir
from plandsl.interop import deepspeed, megatron, megatron_import, torch_csv, torchtitan, torchtitan_import
from plandsl.interop.flags import args_text
from plandsl.interop.result import Exported, Imported

EXPORTERS = {megatron.TARGET: megatron.export_plan, torchtitan.TARGET: torchtitan.export_plan,
             deepspeed.TARGET: deepspeed.export_plan,
             torch_csv.TARGET: torch_csv.export_plan, torch_csv.COMMS: torch_csv.export_comms}
IMPORTERS = {megatron.TARGET: megatron_import.import_flags, torchtitan.TARGET: torchtitan_import.import_flags,
             deepspeed.TARGET: deepspeed.import_json,
             torch_csv.TARGET: torch_csv.import_csv, torch_csv.COMMS: torch_csv.import_csv}
TARGETS = tuple(EXPORTERS)

__all__ = ["EXPORTERS", "IMPORTERS", "TARGETS", "Exported", "Imported", "args_text", "export_plan", "import_text",
           "plan_name"]


def export_plan(plan: ir.Plan, target: str) -> Exported:
    """A checked plan in `target`'s format, with what it cannot express; KeyError for an unknown target."""
    return EXPORTERS[target](plan)


def import_text(target: str, text: str, path: str, world_size: int | None = None, cluster: str | None = None,
                name: str = "imported", plan_path: str = "imported.plan", model: str | None = None) -> Imported:
    """`target`'s configuration `text` (read from `path`) as a checked plan called `name`; ValueError for a
    `cluster` that is no cluster, or a `model` the target needs (deepspeed) or says itself (megatron)."""
    options = dict(world_size=world_size, cluster=cluster, name=name, plan_path=plan_path)
    if target in (torch_csv.TARGET, torch_csv.COMMS):
        if model is not None or world_size is not None or cluster is not None:
            raise ValueError("--model, --world-size, --cluster: a schedule CSV says the schedule only; import it "
                             "into a plan's file and name it there (`schedule = NAME`)")
        return IMPORTERS[target](text, path, name=name, plan_path=plan_path)
    if target in (megatron.TARGET, torchtitan.TARGET):
        if model is not None:
            raise ValueError("--model: Megatron-LM's flags say the model (--num-layers, --hidden-size, ...)"
                             if target == megatron.TARGET else "--model: torchtitan's --config says the model")
        return IMPORTERS[target](text, path, **options)
    return IMPORTERS[target](text, path, model=model, **options)


def plan_name(output: str) -> str:
    """The name an import gives its plan when --name does not: the output file's stem as a name of the language
    (ASCII letters, digits and _, not starting with a digit; `imported` if nothing is left). str.isalnum() kept
    `é` and `٣`, and the plan written (`plan café {`) did not parse (E104, or for a schedule CSV a usage error)."""
    stem = os.path.splitext(os.path.basename(output))[0]
    return re.sub(r"[^A-Za-z0-9_]", "_", stem).lstrip("0123456789") or "imported"
