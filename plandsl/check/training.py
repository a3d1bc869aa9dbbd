"""Training against the layout: batch divisibility (E501), the data ranks' shares of it (E507-E509),
microbatches for the schedule (E502), precision against the devices (E504; fp8, mxfp8 and nvfp4 need bf16 too), an FP8
recipe or bf16 layers the precision does not take (E510), weights gathered in FP8 without FP8 training (E511), or in a
16-bit dtype the data parallelism does not gather them in (E515), recompute_layers and master_dtype against the rest of
`train` (E205), offload_layers against the stages' blocks (E205), recomputation (E512) and Megatron-LM's pipeline (E513),
recompute_modules against the model (E516) and what Megatron-Core refuses with them (E517)."""
from __future__ import annotations

from typing import Iterator

from plandsl import ir
from plandsl.diagnostics import Diagnostic, Edit, Note, diag
from plandsl.cost.memory import is_block
from plandsl.ir import shares as batch
from plandsl.ir.placement import assign_stages
from plandsl.schedules.registry import BUILTIN, microbatches_fit, min_microbatches, nearest_fitting


def check_training(plan: ir.Plan) -> Iterator[Diagnostic]:
    train = plan.train
    dp = plan.dp
    axes = " * ".join(f"{a}({plan.mesh.degree(a)})" for a in plan.batch_axes()) or "dp(1)"
    per_step = dp * train.micro_batch
    info = BUILTIN.get(plan.schedule.name) if plan.stages and plan.schedule else None
    if batch.uneven(plan):
        yield from _batch_shares(plan, axes)
    elif train.global_batch % per_step:
        lower = train.global_batch // per_step * per_step
        options = [b for b in (lower, lower + per_step) if b > 0]
        best = _nearest_batch(plan, per_step)
        also = "" if best in options else f"; with the schedule, global_batch = {best} ({best // per_step} microbatches)"
        yield diag("E501", f"global batch {train.global_batch} is not divisible by {axes} * micro_batch("
                   f"{train.micro_batch}) = {per_step}", train.span_of("global_batch"),
                   hint=f"global_batch in {{{', '.join(map(str, options))}}} works with this layout{also}",
                   edits=_global_batch(train, best))
    elif info is not None and not microbatches_fit(info, plan.pp, train.global_batch // per_step):
        pp = plan.pp
        m = train.global_batch // per_step
        need = min_microbatches(info, pp)
        fits = nearest_fitting(info, pp, m)
        count = f"global_batch({train.global_batch}) / ({axes} * micro_batch({train.micro_batch})) = {m}"
        if m < need:
            message = f"schedule '{info.name}' needs at least {need} microbatches with {pp} pipeline ranks, but {count}"
        elif info.multiple_of_ranks and m % pp:
            message = f"schedule '{info.name}' needs a multiple of the {pp} pipeline ranks as microbatch count, but {count}"
        else:  # torch's rounds
            message = f"schedule '{info.name}' runs m microbatches in max(1, m // pp) rounds, which must divide m, " \
                      f"but {count} microbatches make {m // pp} rounds (pp = {pp})"
        yield diag("E502", message, plan.schedule.span,
                   hint=f"global_batch = {fits * per_step} gives {fits} microbatches, which it runs",
                   edits=_global_batch(train, fits * per_step))
    yield from _recompute_layers(plan)
    yield from _recompute_modules(plan)
    yield from _offload_layers(plan)
    yield from _fp8_recipe(plan)
    yield from _fp8_gather(plan)
    yield from _gather_dtype(plan)
    if train.master_dtype.bytes < train.precision.bytes:
        yield diag("E205", f"master_dtype {train.master_dtype.value} is narrower than precision "
                   f"{train.precision.value}: weights kept in {train.master_dtype.value} would make every matmul "
                   f"compute in {train.master_dtype.value}", train.span_of("master_dtype"),
                   hint=f"master_dtype: {train.precision.value} (or wider), or precision: {train.master_dtype.value}")
    if train.param_dtype is not None and train.param_dtype.bytes < train.precision.bytes:
        yield diag("E205", f"param_dtype {train.param_dtype.value} is narrower than precision {train.precision.value}: "
                   f"weights kept in {train.param_dtype.value} would make every matmul compute in "
                   f"{train.param_dtype.value}", train.span_of("param_dtype"),
                   hint=f"param_dtype: {train.precision.value}")
    elif train.param_dtype is not None and train.param_dtype.bytes > train.master_dtype.bytes:
        yield diag("E205", f"param_dtype {train.param_dtype.value} is wider than master_dtype "
                   f"{train.master_dtype.value}: the weights would hold more than the master copy they are made from",
                   train.span_of("param_dtype"),
                   hint=f"param_dtype: {train.master_dtype.value} (or narrower), or master_dtype: {train.param_dtype.value}")
    elif train.param_dtype is not None and train.param_dtype.bytes == train.master_dtype.bytes \
            and train.param_dtype is not train.master_dtype:
        yield diag("E205", f"param_dtype {train.param_dtype.value} is as wide as master_dtype {train.master_dtype.value} "
                   f"but another dtype: no master copy is kept apart from weights as wide as it, so the weights would "
                   f"be {train.param_dtype.value} and master_dtype ignored", train.span_of("param_dtype"),
                   hint=f"param_dtype: {train.master_dtype.value}, or master_dtype: fp32 for a master copy")
    start = plan.mesh.first_device
    used = {d.name: d for d in plan.cluster.devices_in_order()[start:start + plan.mesh.size]}
    needed = dict.fromkeys((train.precision, train.precision.unquantized))  # fp8, mxfp8, nvfp4: bf16 too (attention, head)
    for device in used.values():
        missing = [p for p in needed if p not in device.peak]
        if missing:
            why = "" if missing == [train.precision] else \
                f" ({train.precision.value} runs the blocks' linear layers in " \
                f"{'FP4' if train.precision is ir.Precision.nvfp4 else 'FP8'} and the attention core, embedding " \
                f"and head in {train.precision.unquantized.value})"
            hint = f"its peaks: {', '.join(p.value for p in device.peak)}; add `{missing[0].value}: ... TFLOP/s` " \
                   f"to its peak, or change precision"
            if ir.Precision.mxfp8 in missing and ir.Precision.fp8 in device.peak:
                hint = ("MXFP8 needs tensor cores that apply a scale per 32 elements (Blackwell); before Blackwell "
                        "(Hopper, Ada) there are none: `precision: fp8` (per-tensor scales) runs at its fp8 peak")
            elif ir.Precision.nvfp4 in missing and ir.Precision.fp8 in device.peak:
                hint = ("NVFP4 needs FP4 tensor cores that apply a scale per 16 elements (Blackwell); before "
                        "Blackwell there are none: `precision: fp8` runs at its fp8 peak")
            yield diag("E504", f"device '{device.name}' gives no peak for {' and '.join(p.value for p in missing)}"
                       f"{why}", train.span_of("precision"), hint=hint)
            break


def _batch_shares(plan: ir.Plan, axes: str) -> Iterator[Diagnostic]:
    """`batch_shares`: one per data rank (E507), summing to the global batch (E508), each a positive whole
    number of microbatches (E509); `speed` needs at least one microbatch per rank (E509). Whether the schedule
    runs each replica's count is the schedule check's (E502)."""
    train, dp = plan.train, batch.data_ranks(plan)
    span = train.span_of("batch_shares")
    mb = train.micro_batch
    if train.batch_shares == batch.SPEED:
        if train.global_batch % mb or train.global_batch // mb < dp:
            yield diag("E509", f"batch_shares: speed deals whole microbatches of micro_batch({mb}) to the {axes} = {dp} "
                       f"data ranks, at least one each, but global_batch({train.global_batch}) makes "
                       f"{train.global_batch / mb:g}", span,
                       hint=f"global_batch a multiple of {mb} and at least {dp * mb}")
            return
    else:
        shares = train.batch_shares
        if len(shares) != dp:
            yield diag("E507", f"batch_shares gives {len(shares)} shares, but the batch is split over {axes} = {dp} "
                       "data ranks: one share each, in data-rank order", span,
                       hint=f"write {dp} shares, or `batch_shares: speed`")
            return
        if sum(shares) != train.global_batch:
            terms = " + ".join(map(str, shares)) if len(shares) <= 8 else f"{len(shares)} shares"
            yield diag("E508", f"batch_shares sum to {terms} = {sum(shares)}, but "
                       f"global_batch is {train.global_batch}: each step trains on the global batch, cut into "
                       "these shares", span,
                       hint=f"shares that sum to {train.global_batch}, or global_batch: {sum(shares)}")
            return
        bad = [(rank, share) for rank, share in enumerate(shares) if share <= 0 or share % mb]
        if bad:
            rank, share = bad[0]
            more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
            yield diag("E509", f"data rank {rank}'s share, {share} sequences, is not a positive multiple of "
                       f"micro_batch({mb}){more}: each rank trains on whole microbatches, at least one", span,
                       hint=f"shares in multiples of {mb}, at least {mb} each")
            return


def absent_module(model: ir.Model, module: ir.RecomputeModule) -> str | None:
    """Why `module` has nothing to rerun in `model`'s blocks (Megatron-Core 0.16.1 refuses `mla_up_proj` without
    multi-latent attention and `moe_act` without grouped experts; `mlp`, `moe` and `shared_experts` without such a
    part do nothing there), or None."""
    if not isinstance(model, ir.TransformerModel):
        return f"model '{model.name}' has no transformer blocks"
    Module = ir.RecomputeModule
    blocks = [model.moe_block(index) for index in range(model.layers)]
    if module is Module.mla_up_proj and not model.latent_attention:
        return f"model '{model.name}' has no multi-head latent attention (q_lora_rank / kv_lora_rank)"
    if module in (Module.moe_act, Module.moe) and not any(blocks):
        return f"model '{model.name}' has no mixture-of-experts blocks"
    if module is Module.shared_experts and not (any(blocks) and model.shared_experts):
        return f"model '{model.name}' has no shared experts"
    if module is Module.mlp and all(blocks):
        return f"every block of model '{model.name}' is a mixture of experts; `mlp` reruns dense MLPs only (`moe` " \
               "reruns the experts)"
    return None


def _recompute_modules(plan: ir.Plan) -> Iterator[Diagnostic]:
    """Each of `recompute_modules` has a part of the model to rerun (E516), and the combinations Megatron-Core's
    TransformerConfig refuses are refused (E517)."""
    train = plan.train
    if train.recompute_modules is None:
        return
    span = train.span_of("recompute_modules")
    for module in train.recompute_modules:
        why = absent_module(plan.model, module)
        if why:
            yield diag("E516", f"recompute module {module.value} has nothing to rerun: {why}", span,
                       hint="drop it from recompute_modules")
    quantized = {ir.RecomputeModule.moe_act, ir.RecomputeModule.layernorm} & set(train.recompute_modules)
    if quantized and train.recipe is ir.Fp8Recipe.delayed:
        names = " and ".join(sorted(m.value for m in quantized))
        yield diag("E517", f"recompute module {names} under FP8 delayed scaling: Megatron-Core refuses it "
                   "(\"Delayed scaling does not support moe_act and layernorm recompute for fp8\"): the rerun "
                   "would quantize again with scales the step has since updated", span,
                   hint="fp8_recipe: current (or another recipe), or drop " + names,
                   notes=[Note("precision set here", train.field_spans["precision"])]
                   if train.field_spans.get("precision") else [])


def _recompute_layers(plan: ir.Plan) -> Iterator[Diagnostic]:
    """`recompute_layers` counts blocks that `recompute: full` reruns: it needs `full` and a model with blocks."""
    train, count = plan.train, plan.train.recompute_layers
    if count is None:
        return
    span = train.span_of("recompute_layers")
    if train.recompute is not ir.Recompute.full:
        yield diag("E205", f"recompute_layers counts the blocks of each stage that `recompute: full` reruns; "
                   f"with recompute {train.recompute.value} there are none to count", span,
                   hint="set `recompute: full`, or drop recompute_layers")
    elif isinstance(plan.model, ir.MLPModel):
        yield diag("E205", f"recompute_layers counts transformer blocks; mlp model '{plan.model.name}' has none",
                   span, hint="use `recompute: full` alone")
    elif isinstance(plan.model, ir.TransformerModel) and count > plan.model.layers:
        yield diag("E205", f"recompute_layers({count}) is more than the {plan.model.layers} blocks of model "
                   f"'{plan.model.name}'", span,
                   hint=f"recompute_layers: {plan.model.layers} recomputes every block, as `recompute: full` alone")


def _offload_layers(plan: ir.Plan) -> Iterator[Diagnostic]:
    """`offload_layers: N` counts the blocks of each stage whose saved activations go to the host: at most a stage's
    blocks (E205), without recomputation (E512: Megatron-LM's TransformerConfig refuses the two together, "CPU
    offloading does not work when activation recomputation is enabled") and not on Megatron-LM's pipeline (E513:
    "Currently there is no support for Pipeline parallelism with CPU offloading")."""
    train, count = plan.train, plan.train.offload_layers
    if not count:
        return
    span = train.span_of("offload_layers")
    if isinstance(plan.model, ir.MLPModel):
        yield diag("E205", f"offload_layers counts transformer blocks; mlp model '{plan.model.name}' has none", span,
                   hint="drop offload_layers")
        return
    if train.recompute is not ir.Recompute.none:
        what = "recompute: full, recompute_layers" if train.recompute_layers is not None else \
            f"recompute: {train.recompute.value}"
        yield diag("E512", f"offload_layers({count}) keeps blocks' saved activations in host memory, but the plan "
                   f"also recomputes them ({what}): Megatron-LM and Transformer Engine do one or the other",
                   span, hint="recompute: none, or drop offload_layers",
                   notes=[Note("recomputation set here", train.field_spans["recompute"])]
                   if train.field_spans.get("recompute") else [])
    if plan.stages is not None and plan.pp > 1 and plan.stages.implementation in ("megatron", "deepspeed", "dualpipe"):
        whose = {"megatron": "Megatron-LM's pipeline", "deepspeed": "DeepSpeed's pipeline engine (Megatron-DeepSpeed's)",
                 "dualpipe": "DualPipe's runtime (deepseek-ai/DualPipe)"}[plan.stages.implementation]
        why = {"megatron": "megatron-core offloads activations only without pipeline parallelism",
               "deepspeed": "its schedule runs no activation offloading (megatron-core's runs only without pipeline "
                            "parallelism)",
               "dualpipe": "its stages run no activation offloading (DeepSeek-V3 recomputes instead)"}[
            plan.stages.implementation]
        yield diag("E513", f"offload_layers({count}) on {whose} (pp = {plan.pp}): {why}", span,
                   hint="stages ... with implementation = torch (whose stages offload), or drop offload_layers",
                   notes=[Note(f"{whose} chosen here", plan.stages.span)] if plan.stages.span else [])
    assignment, _ = assign_stages(plan)
    if assignment is None:
        return  # the placement's own errors
    most = max(sum(is_block(plan, layer) for layer in layers) for layers in assignment.stage_layers)
    if count > most:
        chunk = "stage (virtual chunk)" if plan.stages is not None else "model (one stage)"
        yield diag("E205", f"offload_layers({count}) is more than the {most} blocks of the largest {chunk}",
                   span, hint=f"offload_layers: {most} offloads every block of it")


def _fp8_gather(plan: ir.Plan) -> Iterator[Diagnostic]:
    """`data = ... with gather = fp8` only where FP8 training has FP8 weights to gather: `precision: fp8` or `mxfp8`
    (E511)."""
    precision = plan.train.precision
    if plan.data is not None and plan.data.gather is ir.Precision.fp8 \
            and precision not in (ir.Precision.fp8, ir.Precision.mxfp8):
        why = "its weights are FP4, which no gather here moves" if precision.quantized else "nothing is cast to FP8"
        yield diag("E511", f"gather = fp8 all-gathers the FP8 weights of FP8 training; under precision "
                   f"{precision.value} {why}", plan.data.span_of("gather"),
                   hint=f"precision: fp8 (or mxfp8), or gather = {precision.unquantized.value}",
                   notes=[Note("precision given here", plan.train.span_of("precision"))]
                   if "precision" in plan.train.field_spans else [])


def _gather_dtype(plan: ir.Plan) -> Iterator[Diagnostic]:
    """`data = ... with gather = DTYPE` in a dtype the kind gathers in as the stacks run it (`ir.gathers_as_written`,
    E515): under zero2, zero3 and hsdp fp32 or the compute precision, FSDP2's param_dtype being the dtype the
    forward computes with; under zero1 the weights' own dtype, which ZeRO-1 all-gathers after the optimizer step."""
    data, train = plan.data, plan.train
    if data is None or ir.gathers_as_written(data.zero_stage, data.gather, train):
        return
    gather, precision, span = data.gather.value, train.precision, data.span_of("gather")
    if data.sharded:
        computes = precision.unquantized
        fix = f"gather = {computes.value}"
        layers = " its 16-bit layers" if precision.quantized else ""
        yield diag("E515", f"data = {data.kind} gathers the parameters in the dtype its forward computes with "
                   f"(FSDP2's MixedPrecisionPolicy param_dtype): gather = {gather} would compute in {gather}, but "
                   f"precision {precision.value} computes{layers} in {computes.value}", span,
                   hint=f"{fix}" + (f", or precision: {gather} to compute in {gather}"
                                    if computes is ir.Precision.fp32 else " (or fp32)"),
                   edits=(Edit(data.field_spans["gather"], fix),) if "gather" in data.field_spans else (),
                   notes=[Note("precision given here", train.span_of("precision"))]
                   if "precision" in train.field_spans else [])
        return
    weights = train.weights_dtype
    kept = "param_dtype" if train.param_dtype is not None else "master_dtype"
    narrower = data.gather is precision.unquantized and data.gather.bytes < train.master_dtype.bytes
    yield diag("E515", f"data = zero1 gathers the weights as they are kept after the optimizer step ({kept} "
               f"{weights.value}: torch's ZeroRedundancyOptimizer broadcasts them, Megatron-LM's distributed optimizer "
               f"all-gathers its parameter buffer), not in {gather}", span,
               hint=(f"param_dtype: {gather} keeps {gather} weights beside the {train.master_dtype.value} master copy, "
                     f"which zero1 gathers as they are; or " if narrower else "") + "drop `with gather`",
               notes=[Note(f"{kept} given here", train.span_of(kept))] if kept in train.field_spans else [])


def _fp8_recipe(plan: ir.Plan) -> Iterator[Diagnostic]:
    """`fp8_recipe` only with `precision: fp8` (E510); bf16 first and last blocks only under a quantized precision
    (E510), and no more of them than the model has (E205)."""
    train = plan.train
    if train.fp8_recipe is not None and train.precision is not ir.Precision.fp8:
        own = " (a block-scaling recipe of its own)" if train.precision.quantized else " (nothing is quantized)"
        yield diag("E510", f"fp8_recipe {train.fp8_recipe.value} scales the tensors of `precision: fp8`; precision "
                   f"{train.precision.value} takes no FP8 recipe{own}", train.span_of("fp8_recipe"),
                   hint=f"precision: fp8 with fp8_recipe: {train.fp8_recipe.value}, or drop fp8_recipe")
    kept = {key: getattr(train, key) for key in ("bf16_first_layers", "bf16_last_layers") if getattr(train, key)}
    if not kept:
        return
    key = next(iter(kept))
    if not train.precision.quantized:
        yield diag("E510", f"{key} keeps blocks in bf16 that an FP8 or FP4 precision would quantize; precision "
                   f"{train.precision.value} quantizes none", train.span_of(key),
                   hint="precision: fp8 (or mxfp8, nvfp4), or drop " + " and ".join(kept))
    elif not isinstance(plan.model, ir.TransformerModel):
        yield diag("E205", f"{key} counts transformer blocks; model '{plan.model.name}' has none", train.span_of(key),
                   hint="drop " + " and ".join(kept))
    elif sum(kept.values()) > plan.model.layers:
        yield diag("E205", f"bf16_first_layers({train.bf16_first_layers}) + bf16_last_layers({train.bf16_last_layers}) "
                   f"= {sum(kept.values())} is more than the {plan.model.layers} blocks of model '{plan.model.name}'",
                   train.span_of(key), hint=f"at most {plan.model.layers} in all (every block in bf16: precision: bf16)")


def _global_batch(train: ir.Training, value: int) -> tuple[Edit, ...]:
    """The edit setting `global_batch: value`, where the plan wrote it as a key of `train`."""
    span = train.field_spans.get("global_batch")
    return (Edit(span, f"global_batch: {value}"),) if span is not None else ()


def _nearest_batch(plan: ir.Plan, per_step: int) -> int:
    """The global batch nearest the plan's that the layout divides and the schedule runs (a written
    table runs the one microbatch count it was written for)."""
    schedule = plan.schedule if plan.stages else None
    definition = schedule.definition if schedule else None
    if definition is not None and definition.kind == "table" and "microbatches" in definition.sizes:
        return definition.sizes["microbatches"] * per_step
    info = BUILTIN.get(schedule.name) if schedule and definition is None else None
    m = max(1, round(plan.train.global_batch / per_step))
    return (m if info is None else nearest_fitting(info, plan.pp, m)) * per_step
