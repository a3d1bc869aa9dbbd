"""`plandsl inspect`: a user's torch module (a factory or a Hugging Face config) built on the meta device and
read as plandsl's layer table (`plandsl.ir.inspected.InspectedModel`); nothing allocated, no weights read.

Stage: interpreter side (imports torch, transformers and the user's code); its result is torch-free, so the
checker and the cost model read the cache without importing any of them.
"""
from __future__ import annotations


import contextlib
import io
import logging

import torch

from plandsl.ir.inspected import InspectedModel, ModelSource, file_digest, library_versions, portable_path
from plandsl.ir.torch_plan import matches
from plandsl.runtime.cuts import unfed_problem
from plandsl.runtime.inspect.factory import DTYPES, Failure, build
from plandsl.runtime.inspect.stages import stage_convention_problem
from plandsl.runtime.inspect.trace import BlockList, Inputs, block_table, find_block_list, parameters, split_parameters

__all__ = ["DTYPES", "inspect_model"]


def inspect_model(source: ModelSource, seq: int = 2048, dtype: str = "bfloat16",
                  search_path: tuple[str, ...] = (".",)) -> InspectedModel:
    """The table of `source` at sequence length `seq` (per sample, seq 1, for a source with `input=image(...)`);
    PlanError (E901-E904) when it cannot be derived. `search_path`: folders searched first for a factory's module."""
    seq = 1 if source.image else seq
    try:
        model, files = build(source, dtype, search_path)
        params, modules, total = parameters(model)
        blocks = find_block_list(model, source)
        traceable = source.kind == "factory" and stage_trace_problem(model, blocks, Inputs(source, seq, DTYPES[dtype])) is None
        table = block_table(model, blocks, Inputs(source, seq, DTYPES[dtype]))
        stage_problem = stage_convention_problem(model, blocks.name) \
            if source.kind == "hf" and blocks.found_by == "base_model_pp_plan" else None
    except Failure as failure:
        raise failure.error() from None
    before_params, after_params = split_parameters(model, blocks)
    return InspectedModel(source=source.text, seq=seq, image=source.image, output_shape=table.output_shape,
                          norm_values=table.norm_values,
                          dtype=dtype, versions=library_versions(),
                          files={portable_path(path): file_digest(path) for path in files},
                          model_type=type(model).__name__, params=total, param_list=params, modules=modules,
                          block_list=blocks.name, containers=blocks.containers, block_list_from=blocks.found_by,
                          blocks=table.rows, before=table.before, after=table.after, before_params=before_params,
                          after_params=after_params, traced_blocks=table.traced, tp_plan=tp_plan(model),
                          tp_plan_from_transformers=from_transformers(model),
                          traceable=traceable, stage_problem=stage_problem, positions=learned_positions(model),
                          ep_plan=tp_plan(model, ("ep_plan",)),
                          experts=experts(params, tp_plan(model, ("ep_plan",))))


def learned_positions(model) -> int | None:
    """The positions a learned position embedding of a Hugging Face model holds: its config's `n_positions` or
    `max_position_embeddings` where the model has an `nn.Embedding` besides its token embedding with that many rows
    (OPT's two more: its offset), else None (rotary or relative positions, no table)."""
    from torch import nn  # lazy: as the rest of inspect, torch is imported by the builder first
    config = getattr(model, "config", None)
    limit = next((value for key in ("n_positions", "max_position_embeddings")
                  if isinstance(value := getattr(config, key, None), int) and value > 0), None)
    if limit is None:
        return None
    try:
        token = model.get_input_embeddings()
    except Exception:  # noqa: BLE001 - a model without the accessor: no token embedding to tell apart
        token = None
    for module in model.modules():
        if isinstance(module, nn.Embedding) and module is not token and limit <= module.num_embeddings <= limit + 2:
            return limit
    return None


def experts(params, plan: tuple[tuple[str, str], ...]) -> int:
    """The experts per MoE layer: the first dim of the parameters the expert-parallel plan splits by expert
    (`grouped_gemm`: one [experts, out, in] tensor per projection); 0 without such a plan."""
    patterns = [pattern for pattern, style in plan if style == "grouped_gemm"]
    for param in params:
        if param.shape and any(matches(pattern, param.name) for pattern in patterns):
            return param.shape[0]
    return 0


def stage_trace_problem(model, blocks: BlockList, inputs: Inputs) -> str | None:
    """Why torch's pipeline frontend (`torch.distributed.pipelining.pipeline`, through torch.export) cannot cut
    the module at its second block on the meta device, or None when it can: what `plandsl run` does to split
    a factory's module into pipeline stages (`runtime.torch_model.TorchModel.stage_modules`)."""
    if len(blocks.blocks) < 2:
        return "it has fewer than two blocks"
    order = _call_order(model, blocks, inputs)
    if order != [name for name, _ in blocks.blocks]:  # the cuts are placed by the list's order (runtime.cuts)
        return (f"its forward does not call its blocks once each in the order of its block list (it called "
                f"{', '.join(order[:4])}{', ...' if len(order) > 4 else ''})")
    from torch.distributed.pipelining import SplitPoint, pipeline  # lazy: seconds to import, factories only
    example = inputs.example()
    torch_log = logging.getLogger("torch")
    level = torch_log.level
    torch_log.setLevel(logging.ERROR)  # a failed export logs and prints the graph it got: not the user's output
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            pipe = pipeline(model, mb_args=(example,), split_spec={blocks.blocks[1][0]: SplitPoint.BEGINNING})
    except (Exception, SystemExit) as error:  # torch.export cannot capture the forward (data-dependent control flow, ...)
        return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    finally:
        torch_log.setLevel(level)
    return unfed_problem(pipe)


def _call_order(model, blocks: BlockList, inputs: Inputs) -> list[str]:
    """The blocks' FQNs in the order one forward on the meta device calls them."""
    called: list[str] = []
    handles = [block.register_forward_pre_hook(lambda module, args, name=name: called.append(name))
               for name, block in blocks.blocks]
    try:
        with torch.no_grad():
            inputs.call(model)
    except (Exception, SystemExit):  # noqa: BLE001 - the table's own trace says why the forward fails (E903)
        return [name for name, _ in blocks.blocks]
    finally:
        for handle in handles:
            handle.remove()
    return called


def from_transformers(model) -> bool:
    """Whether the module is a transformers model (a class of its MRO defined in transformers), whose `tp_plan` is
    transformers' (`InspectedModel.tp_plan_from_transformers`)."""
    return any(cls.__module__.split(".")[0] == "transformers" for cls in type(model).__mro__)


def tp_plan(model, names: tuple[str, ...] = ("tp_plan", "_tp_plan")) -> tuple[tuple[str, str], ...]:
    """The module's own tensor-parallel plan by FQN pattern: a Hugging Face model's `tp_plan` (its class's
    `_tp_plan` and its config's `base_model_tp_plan`, merged by transformers under each module's prefix),
    else a `tp_plan` or `_tp_plan` dict of the module; entries that are not (str, str) are left out. With
    `names=("ep_plan",)`, its expert-parallel plan likewise (transformers' `base_model_ep_plan`)."""
    for name in names:
        try:
            found = getattr(model, name, None)
        except Exception:  # a property of the user's class that raises: no plan
            found = None
        if isinstance(found, dict) and found:
            return tuple((k, v) for k, v in found.items() if isinstance(k, str) and isinstance(v, str))
    return ()
