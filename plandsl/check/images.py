"""A model that takes images (`input = image(C, H, W)`: a CNN): what no plan over it may ask (E415, E506).

Stage: checker. Contract: `check_images(plan)` yields one diagnostic per request the plan makes that splits
or sizes one image as a sequence (E415: `context`, `sequence` shard rules, a train `seq` other than 1), each
at the attribute that asks. Such a model's figures are per sample (seq 1, docs/models.md); neither the cost
model nor `plandsl run` has a layout that splits a convolution within a sample. E506: a microbatch that gives
a BatchNorm one value per channel (any model from torch: `plandsl inspect` records the fewest it sees). (Tensor parallelism over a
CNN from torch is E413/E414, `check.sharding`: it has no tensor-parallel plan, and torch's styles take
Linear and Embedding modules, not convolutions.)
"""
from __future__ import annotations

from typing import Iterator

from plandsl import ir
from plandsl.diagnostics import Diagnostic, diag

# What spatial (height/width) sharding would need, and what torch 2.13's DTensor has (docs/models.md).
SPATIAL_MISSING = ("splitting an image's height or width needs each rank to exchange the rows at its border "
                   "(a halo) with its neighbours before every convolution and pooling, and BatchNorm's statistics "
                   "all-reduced over the split; DTensor's convolution rule shards the batch dim only (weights "
                   "replicated), and its experimental halo exchange (torch.distributed.tensor._tp_conv) splits the "
                   "width only, over the whole world, with stride 1 wherever there is padding")
_HINT = "use the axis for data parallelism (data = ... over the axes) or pipeline stages"


def image_model(plan: ir.Plan) -> tuple[int, ...] | None:
    """The shape of one sample when the plan's model takes images, else None."""
    return plan.model.image if isinstance(plan.model, ir.CustomModel) else None


def check_images(plan: ir.Plan) -> Iterator[Diagnostic]:
    model = plan.model
    norm_values = model.norm_values if isinstance(model, ir.CustomModel) else 0
    if norm_values and plan.train.micro_batch * norm_values < 2:
        yield diag("E506", f"micro_batch ({plan.train.micro_batch}) x {norm_values} value(s) per channel per sample = "
                           f"{plan.train.micro_batch * norm_values}: a BatchNorm of model '{model.name}' (where its "
                           "maps are smallest) would normalise each channel over one value, which torch refuses in "
                           "training ('Expected more than 1 value per channel')",
                   plan.train.span_of("micro_batch"), hint="micro_batch: 2 or more")
    image = image_model(plan)
    if image is None:
        return
    name = f"model '{plan.model.name}' takes images [{', '.join(map(str, image))}]"
    if plan.train.seq is not None and plan.train.seq != 1:
        yield diag("E415", f"train seq ({plan.train.seq}): {name}, whose figures are per sample (one image is one "
                           "'token', seq 1); a sequence length would multiply them", plan.train.span_of("seq"),
                   hint="remove `seq` from train")
    if plan.context is not None and plan.mesh.degree(plan.context.axis) > 1:
        yield diag("E415", f"context parallelism splits each sample; {name}, and {SPATIAL_MISSING}",
                   plan.context.span, hint=_HINT)
    for rule in plan.shard:
        if rule.style == "sequence":
            yield diag("E415", f"`sequence over {rule.axis}` splits a sample's activations; {name}, and "
                               f"{SPATIAL_MISSING}", rule.span, hint="shard the parameters (Shard(0) @ axis) or "
                                                                       "remove the rule")
