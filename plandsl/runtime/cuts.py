"""Where torch's pipeline frontend cuts a module from torch traced into pipeline stages.

Stage: interpreter (torch-free: `runtime.support` asks it before any process starts, `runtime.torch_model` when it
traces). Contract: `stage_split_points(order, stages)` maps block FQNs to "beginning" or "end", one cut per stage
boundary, or None when the blocks offer too few cuts; `unfed_inputs(pipe)` names the inputs of a traced stage that
the split feeds it nothing for (`unfed_problem(pipe)` says so in words).
"""
from __future__ import annotations


def stage_split_points(order: list[str], stages: list[set[str]]) -> dict[str, str] | None:
    """Where torch's pipeline frontend cuts a module traced into `stages` (each the layer names it holds, in order):
    block FQN -> "beginning" or "end" (`SplitPoint`), one point per stage boundary; None when the boundaries are more
    than the points the blocks offer. A stage starts at the beginning of its first block, or, when that point is
    taken (a stage that holds only the head cuts at the end of the last block, and a stage holding only that last
    block would start there too), at the end of the block before it, which cuts at the same place unless the
    module's forward computes something between the two blocks (it then runs on the stage before). `order`: every
    block's FQN in forward order (`runtime.torch_model.TorchModel.all_block_names`)."""
    where = {name: index for index, name in enumerate(order)}
    starts = []  # each later stage's boundary: the index of the block it starts at, len(order) for the head alone
    for layers in stages[1:]:
        first = min((where[name] for name in layers if name in where), default=None)
        if first is None and "head" in layers and order:
            first = len(order)
        if first is not None:
            starts.append(first)
    points: dict[str, str] = {}
    for start in sorted(set(starts), reverse=True):
        if start < len(order) and order[start] not in points:
            points[order[start]] = "beginning"
        elif start >= 1 and order[start - 1] not in points:
            points[order[start - 1]] = "end"
        else:
            return None
    return points


def unfed_problem(pipe) -> str | None:
    """What `unfed_inputs` finds, in words (the first stage fed too little), or None."""
    unfed = unfed_inputs(pipe)
    if not unfed:
        return None
    stage, names = next(iter(unfed.items()))
    return f"torch.export lifted {', '.join(names[:3])} to inputs of stage {stage}, which its pipeline frontend feeds nothing"


def unfed_inputs(pipe) -> dict[int, list[str]]:
    """Stage index -> the inputs of its module that torch's pipeline frontend's split (`Pipe.split_gm`) passes it
    nothing for: a parameter torch.export lifted to an input of the stage's graph (torchtitan's fused `wqkv`
    projection) is fed by no stage, and every rank fails at its first step ("forward() missing 2 required positional
    arguments"). Empty when each stage is fed all it takes."""
    found: dict[int, list[str]] = {}
    stages = [node for node in pipe.split_gm.graph.nodes if node.op == "call_module"]
    for index, node in enumerate(stages):
        graph = getattr(pipe.split_gm.get_submodule(node.target), "graph", None)
        wanted = [n.name for n in graph.nodes if n.op == "placeholder"] if graph is not None else []
        fed = len(node.args) + len(node.kwargs)
        if len(wanted) > fed:
            found[index] = wanted[fed:]
    return found
