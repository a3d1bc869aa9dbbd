"""What the interpreter can run yet: one E7xx diagnostic per feature of a plan it refuses, before any process starts.

Stage: interpreter (imported by the CLI without torch; torch only for shard rules and ring context
parallelism). Contract: `refusals(plan, cuda=None)` returns
`Diagnostic`s (E701-E706, E708, catalogued in docs/errors.md) pointing at the plan's attribute that asks
for what cannot run, empty when the plan can run. A refused plan is never run some other way. `as_run(plan)` is the
plan as the interpreter runs it (torch's stacks where the plan names another's) and what that changes.
"""
from __future__ import annotations

import importlib.util
import os
import sys

from plandsl import ir
from plandsl.diagnostics import Diagnostic, diag
from plandsl.ir.inspected import parse_source
from plandsl.ir.placement import assign_stages
from plandsl.ir.shares import written_shares
from plandsl.runtime.cuts import stage_split_points
from plandsl.ir.torch_plan import matches
from plandsl.schedules.registry import BUILTIN
from plandsl.cost.estimate import data_shares
from plandsl.cost.schedule import plan_splits_backward
from plandsl.check.memory import check_memory

MAX_PIPELINE_MICROBATCHES = 65_536
"""The most microbatches a pipelined run takes per step: torch builds each rank's schedule as a list of actions
that grows with the count (65,536 over 2 stages: ~5 s to build; 2^31 would take days, in `run --dry-run` too)."""


def _multi_token_refusals(plan: ir.Plan) -> list[Diagnostic]:
    """Multi-token prediction runs under every parallelism (each depth's block split as the model's,
    `tensor_parallel.apply_tp`; on a pipeline's last stage, fed the tokens beside the targets, with a copy of the
    embedding, `pipeline.stage_part`; under context parallelism fed the whole rows, `models.Transformer._depth_loss`),
    but not beside uneven data shares over FSDP groups of modules (E703)."""
    found = []
    depths = f"multi-token prediction (mtp={plan.model.mtp})"
    if plan.train.batch_shares is not None and _groups_by_module(plan):
        found.append(diag("E703", f"{depths} together with batch_shares and `data = {plan.data.kind.value} ... with unit "
                                  "= module` cannot run: the output layer runs twice a microbatch (the model's loss and "
                                  "each depth's), an FSDP2 group of its own that reduces after each, and a data rank "
                                  "running a single microbatch falls out of step with one running several (their "
                                  "reduce-scatters mismatch and gloo aborts)", plan.train.span_of("batch_shares"),
                          hint="gather by `unit = block` (the output layer in the root's group), or give the data "
                               "ranks even shares"))
    return found


def refusals(plan: ir.Plan, cuda: bool | None = None) -> list[Diagnostic]:
    """Every reason `plandsl run` refuses the plan (a checked plan), in the order of the plan's attributes.
    `cuda`: whether the ranks will run on CUDA (None: whether this machine has it, as `runtime.mesh` decides)."""
    found = []
    if plan.train.precision.quantized:
        cores, scaling = {ir.Precision.fp8: ("FP8", "per-tensor scaling"),
                          ir.Precision.mxfp8: ("FP8", "a scale per 32 elements (MXFP8, Blackwell)"),
                          ir.Precision.nvfp4: ("FP4", "a scale per 16 elements (NVFP4, Blackwell)")}[plan.train.precision]
        found.append(diag("E706", f"precision {plan.train.precision.value} cannot run yet: its GEMMs need a GPU with "
                                  f"{cores} tensor cores and {scaling} (Transformer Engine's recipe), which no run of the "
                                  "interpreter has checked; check, estimate and generate model it",
                          plan.train.span_of("precision"), hint="run it with `precision: bf16`"))
    if plan.train.optimizer_dtype is ir.Precision.fp16:
        found.append(diag("E706", "optimizer_dtype fp16 cannot run yet: Adam's second moment (about 0.05 g^2) flushes "
                                  "to zero in fp16 for gradients below ~2e-4 unless each state tensor keeps a scale "
                                  "(Transformer Engine's FusedAdam does), which the interpreter's optimizer does not",
                          plan.train.span_of("optimizer_dtype"), hint="run it with `optimizer_dtype: bf16`"))
    if isinstance(plan.model, ir.CustomModel) and plan.model.source:
        found += _torch_model_refusals(plan, plan.model)
    elif isinstance(plan.model, ir.CustomModel) and not plan.model.factory:
        found.append(diag("E704", f"model '{plan.model.name}' has no `factory`, so there is no torch module to run",
                          plan.model.span, hint='add `factory = "package.module:function"` to the model '
                                                      "(docs/models.md)"))
    if isinstance(plan.model, ir.TransformerModel) and plan.model.mtp:
        found += _multi_token_refusals(plan)
    if plan.tensor is not None and plan.tp > 1 and not isinstance(plan.model, ir.TransformerModel) and not (
            isinstance(plan.model, ir.CustomModel) and plan.model.source):
        found.append(diag("E704", f"tensor parallelism needs a gpt or llama model; '{plan.model.name}' is "
                                  f"'{plan.model.kind}', whose modules have no tensor-parallel layout",
                          plan.tensor.span, hint="use the tensor axis for data parallelism instead"))
    if plan.train.recompute is ir.Recompute.selective_op and (
            not isinstance(plan.model, ir.TransformerModel) or plan.model.experts or plan.model.latent_attention):
        why = f"'{plan.model.kind}', which has no transformer blocks"
        if isinstance(plan.model, ir.TransformerModel) and plan.model.experts:
            why = ("an MoE model, whose blocks run a matmul per local expert, so the count the policy keeps "
                   "every other one of depends on the experts a rank holds")
        elif isinstance(plan.model, ir.TransformerModel):
            why = ("multi-head latent attention, whose down- and up-projections put other outputs at the places "
                   "the policy keeps (the latents, not q and v)")
        found.append(diag("E704", f"`recompute: selective_op` needs a dense gpt or llama model: it keeps a block's "
                                  f"q, v and w1 (and llama's w2) outputs by their place among its matmuls; "
                                  f"'{plan.model.name}' is {why}", plan.train.span_of("recompute"),
                          hint="use `recompute: selective` or `recompute: full`"))
    discarding = sorted(m.value for m in plan.train.modules & DISCARDING_MODULES)
    if discarding and plan_splits_backward(plan):
        found.append(diag("E703", f"recompute module {', '.join(discarding)} together with schedule "
                                  f"'{plan.schedule.name}' cannot run: the schedule splits the backward into input and "
                                  "weight gradients, and the outputs these modules free are rebuilt by a hook that "
                                  "serves one backward pass (megatron-core's CheckpointWithoutOutput)",
                          plan.train.span_of("recompute_modules"),
                          hint="rerun core_attn, mlp, moe or shared_experts with this schedule, or a schedule without "
                               "split backward passes"))
    if plan.train.recompute is ir.Recompute.selective_op and plan_splits_backward(plan):
        found.append(diag("E703", f"`recompute: selective_op` together with schedule '{plan.schedule.name}' cannot "
                                  "run: the schedule computes each backward in two passes (input gradients, then "
                                  "weight gradients), and torch's selective checkpointing serves the outputs it "
                                  "kept to one pass only", plan.train.span_of("recompute"),
                          hint="use `recompute: full` or `selective` with this schedule, or a schedule without "
                               "I and W actions (1f1b, interleaved_1f1b)"))
    if plan.train.recompute is ir.Recompute.selective_op and _groups_by_module(plan):
        found.append(diag("E703", f"`recompute: selective_op` together with `data = {plan.data.kind.value} ... with unit = "
                                  "module` cannot run: each of a block's modules is then an FSDP2 group inside the "
                                  "block torch's selective checkpointing replays, and FSDP2's hooks run other ops in "
                                  "the backward's rerun (gathers, record_function) than in the forward, which the "
                                  "policy's saved outputs are counted by", plan.train.span_of("recompute"),
                          hint="gather by `unit = block` (FSDP2's groups around the blocks), or use `recompute: full` "
                               "or `selective`"))
    weights = plan.train.param_dtype or plan.train.master_dtype
    gather = plan.run_gather
    if plan.stages is not None and gather is weights and plan.train.grad_dtype.bytes < weights.bytes \
            and plan.num_microbatches == 1:
        found.append(diag("E703", f"grad_dtype {plan.train.grad_dtype.value} together with `data = "
                                  f"{plan.data.kind.value} ... with gather = {gather.value}` and torch's pipeline "
                                  "stages cannot run at one microbatch a step: torch's stage runs that backward "
                                  "without FSDP2's reduction and then reduces by hand, and a parameter whose gradient "
                                  f"came after its group's hook keeps it in {weights.value} beside the others' "
                                  f"{plan.train.grad_dtype.value} (FSDP2's reduce-scatter takes one dtype)",
                          plan.train.span_of("grad_dtype"),
                          hint="give each step two microbatches or more (a larger global_batch or a smaller "
                               "micro_batch), or reduce in the weights' dtype (drop grad_dtype)"))
    found += _context_refusals(plan, cuda)
    found += _expert_refusals(plan)
    if plan.shard and not (isinstance(plan.model, ir.CustomModel) and plan.model.source):
        # the rules DTensor cannot run as written (torch is imported only for such plans)
        found += _shard_refusals(plan)
    if plan.schedule is not None and plan.schedule.definition is None and BUILTIN[plan.schedule.name].refused:
        name = plan.schedule.name
        found.append(diag("E701", f"schedule '{name}' cannot run yet: {BUILTIN[name].refused}",
                          plan.schedule.span, hint="estimate and render it; run 1f1b, zbv or interleaved_1f1b"))
    if plan.stages is not None:  # at pp 1 too: run builds torch's stages and schedule there as well
        train = plan.train
        shares = written_shares(plan)  # None for `speed`: resolved by the cost model only past the cap
        count = max(shares) // train.micro_batch if shares else train.global_batch // train.micro_batch
        if shares is None and count > MAX_PIPELINE_MICROBATCHES:
            count = max(data_shares(plan) or (train.global_batch,)) // train.micro_batch
        if count > MAX_PIPELINE_MICROBATCHES:
            found.append(diag("E701", f"{count:,} microbatches per step cannot run on a pipeline: torch builds each "
                                      f"rank's schedule as a list of actions that grows with the count (at most "
                                      f"{MAX_PIPELINE_MICROBATCHES:,})", train.span_of("global_batch"),
                              hint="a larger micro_batch, or fewer sequences per step; estimate takes any count"))
    if not plan.train.precision.quantized:  # FP8 does not run at all (E706)
        found += _memory_as_run(plan)
    return found


def model_import_problems(plan: ir.Plan) -> list[Diagnostic]:
    """E901 where `plandsl run`'s ranks could not import the code of a model from torch: a factory's module that is
    not found from the plan's folder and the current one (where `runtime.torch_model.build` searches, as each rank
    will), or transformers for `hf(...)`. `check` reads the model's table only, so a plan whose package is not on the
    path (PYTHONPATH) checked ok and then every rank failed to build the job. Finds the module without running it (its
    parent packages are imported); not part of `refusals`, which `generate` asks without importing user code."""
    model = plan.model
    if not isinstance(model, ir.CustomModel) or not model.source:
        return []
    source = parse_source(model.source)
    name = source.target.partition(":")[0] if source.kind == "factory" else "transformers"
    folders = [os.path.dirname(model.span.file) if model.span and model.span.file else "", "."]
    saved = list(sys.path)
    sys.path[:0] = [folder or "." for folder in dict.fromkeys(folders) if (folder or ".") not in sys.path]
    try:
        found, why = importlib.util.find_spec(name) is not None, "no such module"
    except (Exception, SystemExit) as error:  # a parent package that raises as it is imported
        found, why = False, f"{type(error).__name__}: {error}"
    finally:
        sys.path[:] = saved
    if found:
        return []
    return [diag("E901", f"the ranks of plandsl run cannot import '{name}' for model '{source.target}' ({why}): `check` "
                         "read its layer table, but every rank builds the module from its code", model.span,
                 hint="run plandsl where the package is importable (the plan's folder and the current one are "
                      "searched first; PYTHONPATH for the others)")]


STACKS = {"megatron": "Megatron-LM's", "deepspeed": "DeepSpeed's", "dualpipe": "DualPipe's",
          "te": "Transformer Engine's"}


def as_run(plan: ir.Plan) -> tuple[ir.Plan, list[tuple[str, ir.Span | None]]]:
    """The plan as `plandsl run` runs it, and what that changes (what, where the plan says otherwise): torch's
    tensor parallelism, pipeline and ring attention where the plan names another stack's (`implementation = ...`:
    the cost model counts that stack's memory, its buffers and copies), torch's cross entropy where it names
    Megatron-LM's (`loss: megatron`), and the fused attention core run always computes (`attention: materialized`,
    the s x s scores in memory: `run` holds less, so it adds no change of its own to say). The plan itself where it
    names torch's throughout. (FP8 gathers need FP8 training, which `run` refuses first: E706.)"""
    update, changes, train = {}, [], {}
    if plan.train.loss is ir.Loss.megatron:  # counted with its in-place backward (2 bytes a logit); run's is torch's
        train["loss"] = ir.Loss.standard
        changes.append(("torch's cross entropy where the plan names Megatron-LM's", plan.train.span_of("loss")))
    if plan.train.attention is ir.Attention.materialized:  # run's attention core is SDPA's fused one
        train["attention"] = ir.Attention.flash
    if train:
        update["train"] = plan.train.model_copy(update=train)
    if plan.tensor is not None and plan.tp > 1 and plan.tensor.stack != "torch":
        update["tensor"] = plan.tensor.model_copy(update={"stack": "torch"})
        changes.append((f"torch's tensor parallelism where the plan names {STACKS[plan.tensor.stack]}", plan.tensor.span))
    if plan.stages is not None and plan.stages.implementation != "torch":  # run builds torch's stages at pp 1 too
        update["stages"] = plan.stages.model_copy(update={"implementation": "torch"})
        changes.append((f"torch's pipeline where the plan names {STACKS[plan.stages.implementation]}", plan.stages.span))
    if plan.context is not None and plan.cp > 1 and plan.context.kind == "ring" and plan.context.implementation != "torch":
        update["context"] = plan.context.model_copy(update={"implementation": "torch"})
        changes.append((f"torch's ring attention where the plan names {STACKS[plan.context.implementation]}",
                        plan.context.span))
    return (plan.model_copy(update=update) if update else plan), changes


def _memory_as_run(plan: ir.Plan) -> list[Diagnostic]:
    """E708 where the plan fits its devices as the stack it names holds it (`check` passed) but not as `run` runs it
    (`as_run`): the memory check of the plan run, its first excess."""
    run_plan, changes = as_run(plan)
    if not changes:
        return []
    over = next((d for d in check_memory(run_plan) if d.code == "E503"), None)
    if over is None:
        return []
    stack = "; ".join(what for what, _ in changes)
    return [diag("E708", f"plandsl run runs this plan on torch's stack ({stack}), where {over.message}; the plan's "
                         "own count is the stack's it names", changes[0][1] or over.span,
                 hint="run it on devices with more memory, or lower what a device holds (a smaller micro_batch, "
                      "recomputation, a ZeRO stage); `estimate` counts it as run holds it once the plan names "
                      "torch's stack (`implementation = torch`, `loss: standard`)")]


def _torch_model_refusals(plan: ir.Plan, model: ir.CustomModel) -> list[Diagnostic]:
    """What a model from torch (`hf(...)`, `factory(...)`), run unchanged, cannot do yet: tensor parallelism
    other than the model's own plan, pipeline stages without the model's stage convention, recomputation of
    parts of a block."""
    found = []
    hf = model.source.startswith("hf(")
    own = [name for name, _ in model.parameters if "." not in name]
    if own:
        found.append(diag("E704", f"'{model.source}' holds {', '.join(repr(name) for name in own[:3])} at its root: "
                                  "plandsl runs a module's children behind its own wrapper, and the parallelisms "
                                  "replace a parameter where its module holds it, which the root's own forward "
                                  "would not see", model.span,
                          hint="move the parameter into a submodule (a module holding it), as the blocks hold theirs"))
    if plan.tensor is not None and plan.tp > 1:
        styles = dict(model.tp_plan)
        sequence = _sequence_parallel_problem(plan, model, styles) if plan.tensor.sequence_parallel else None
        if not styles:
            found.append(diag("E704", f"tensor parallelism of '{model.source}' needs the model's own tensor-parallel "
                                      "plan (transformers' `base_model_tp_plan`), and it has none",
                              plan.tensor.span, hint="use the tensor axis for data parallelism (or FSDP) instead"))
        elif sequence:
            found.append(diag("E704", f"sequence parallelism of '{model.source}' cannot run: {sequence}",
                              plan.tensor.span, hint=f"drop `with sequence_parallel`: `tensor = megatron over "
                                                     f"{plan.tensor.axis}` runs the model's own plan"))
        else:
            from plandsl.runtime.parallel.tensor_parallel import MODEL_STYLES, model_tp_problems  # lazy: torch
            odd = model_tp_problems(styles)
            if odd:
                found.append(diag("E704", f"the tensor-parallel plan of '{model.source}' has styles plandsl cannot run "
                                          f"yet: {', '.join(odd)}", plan.tensor.span,
                                  hint=f"plandsl runs {', '.join(MODEL_STYLES)}; use the tensor axis for data "
                                       "parallelism instead"))
            elif (alone := _unpaired(styles)) is not None:
                found.append(diag("E704", f"the tensor-parallel plan of '{model.source}' gives '{alone[0]}' the style "
                                          f"{alone[1]} with no {'rowwise' if alone[1] == 'colwise' else 'colwise'} "
                                          "projection beside it: torch's styles leave a colwise output split over the "
                                          "axis for a rowwise projection to sum, and the model's own code between "
                                          "them (a residual add, the loss) would read a slice", plan.tensor.span,
                                  hint="pair each colwise projection with a rowwise one in the same module (Megatron's "
                                       "pairs), give a lone output layer `colwise_gather_output`, or use the tensor "
                                       "axis for data parallelism instead"))
        if plan.stages is not None and model.stages_by == "trace":
            found.append(diag("E704", f"tensor parallelism of '{model.source}' on pipeline stages cannot run: torch's "
                                      "pipeline frontend rebuilds each stage's modules from its trace (torch.export), "
                                      "whose linear layers are no longer nn.Linear, which torch's tensor-parallel "
                                      "styles take", plan.tensor.span,
                              hint="use the pipeline axis or the tensor axis for data parallelism (or FSDP) instead"))
    if plan.stages is not None and not model.stages_by:  # at pp = 1 too: `run` builds torch's stages for any `stages`
        why = ("torch's pipeline frontend (torch.export) could not cut its forward at its blocks when `plandsl "
               "inspect` tried (data-dependent control flow, code export does not capture, blocks called other "
               "than once each in their list's order, or a weight export lifts to an input of a stage, which the "
               "split feeds nothing: torchtitan's fused `wqkv`)"
               if not hf else f"a stage would compute otherwise than the whole model: {model.stage_problem}"
               if model.stage_problem
               else "its class declares no `base_model_pp_plan` (which modules run before the blocks)")
        found.append(diag("E704", f"'{model.source}' cannot be split into pipeline stages: {why}",
                          plan.stages.span, hint="use the pipeline axis for data parallelism (or FSDP) instead"))
    elif plan.stages is not None and not hf and model.blocks:
        assignment, _ = assign_stages(plan)
        if assignment is not None and stage_split_points(
                list(model.blocks), [{layer.name for layer in layers} for layers in assignment.stage_layers]) is None:
            found.append(diag("E704", f"'{model.source}' cannot be cut into these {assignment.num_stages} pipeline "
                                      "stages: torch's pipeline frontend cuts a module at the beginning or the end of "
                                      f"a block, and its {len(model.blocks)} blocks give too few such points for a "
                                      "stage of the embedding alone, one per block and one of the head alone",
                              plan.stages.span, hint="put the embedding or the head on a stage with a block"))
    weights = [dtype for dtype in (plan.train.param_dtype or plan.train.master_dtype, plan.run_gather)
               if dtype is not None and dtype.bytes == 2]
    if model.norm_values and weights:
        what = (f"`gather = {plan.run_gather.value}`" if plan.run_gather in weights
                else f"{'param_dtype' if plan.train.param_dtype else 'master_dtype'} {weights[0].value}")
        found.append(diag("E704", f"'{model.source}' holds BatchNorm layers, and {what} makes their weights "
                                  f"{weights[0].value} beside running statistics kept in fp32 (buffers are not cast), "
                                  "which torch's batch_norm refuses ('expected scalar type BFloat16 but found Float' "
                                  "on every rank)", plan.train.span_of("param_dtype") or plan.train.span_of("master_dtype")
                          or (plan.data.span if plan.data is not None else plan.train.span),
                          hint="keep the weights fp32 (autocast computes in the precision all the same): drop "
                               "param_dtype/master_dtype or `gather`"))
    if plan.train.recompute is ir.Recompute.selective:
        found.append(diag("E704", "`recompute: selective` recomputes plandsl's own attention core; the blocks of a "
                                  f"model from torch ('{model.source}') are recomputed whole",
                          plan.train.span_of("recompute"), hint="use `recompute: full`"))
    if plan.shard:
        found.append(diag("E704", f"shard rules on a model from torch ('{model.source}') cannot run yet: its tensor "
                                  "parallelism is the model's own plan", plan.shard[0].span,
                          hint="remove the shard rules; `tensor = megatron over AXIS` runs the model's plan"))
    return found


def _unpaired(styles: dict[str, str]) -> tuple[str, str] | None:
    """A `colwise` or `rowwise` entry of a model's tensor-parallel plan with no partner of the other kind near it (one
    sharing its pattern's parent, or its grandparent for a projection wrapped in a module of its own): a colwise
    output left split over the axis, or a rowwise input nothing split. None when every one is paired."""
    for pattern, style in styles.items():
        if style not in ("colwise", "rowwise"):
            continue
        parts = pattern.split(".")
        need = max(1, len(parts) - 2)
        other = "rowwise" if style == "colwise" else "colwise"
        if not any(kind == other and len(os.path.commonprefix([parts, candidate.split(".")])) >= need
                   for candidate, kind in styles.items()):
            return pattern, style
    return None


def _sequence_parallel_problem(plan: ir.Plan, model: ir.CustomModel, styles: dict[str, str]) -> str | None:
    """Why a model from torch cannot split its residual stream along the sequence over the tensor axis
    (`runtime.parallel.tensor_parallel.apply_model_tp`), or None: the sequence must split evenly, and every
    parameter inside a block that the model's plan does not split must be 1-D (a norm's, whose gradient the
    shards sum), not a router's or an expert's matrix, which a sequence shard cannot train alone."""
    if plan.seq % plan.tp:
        return f"its sequence ({plan.seq}) does not split evenly over {plan.tp} ranks"
    for pattern, style in styles.items():  # the module holding a colwise projection gathers its input
        holder = pattern.rpartition(".")[0]
        if style.startswith("colwise") and holder and any(matches(holder, block) for block in model.blocks):
            return (f"the block '{holder}' holds its colwise projection '{pattern}' itself, so the input it gathers "
                    "whole is the one its residual adds to the rowwise projection's sequence shard (plandsl gathers "
                    "at the module holding the projections, a block's attention or MLP)")
    prefixes = tuple(f"{block}." for block in model.blocks)
    for name, shape in model.parameters:
        owner = name.rpartition(".")[0]
        if not name.startswith(prefixes) or len(shape) == 1 or any(matches(pattern, owner) for pattern in styles):
            continue
        return (f"'{name}' {list(shape)} sits in a block outside the model's tensor-parallel plan, and a sequence "
                "shard cannot train it alone (only 1-D parameters, a norm's, run on sequence shards)")
    return None


DISCARDING_MODULES = frozenset((ir.RecomputeModule.layernorm, ir.RecomputeModule.moe_act,
                                ir.RecomputeModule.mla_up_proj))
"""The recompute modules that free their outputs and rebuild them from a gradient hook (`runtime.discard`)."""


def _groups_by_module(plan: ir.Plan) -> bool:
    """Whether ZeRO-2/3 makes each module of a block an FSDP2 group of its own (`data = ... with unit = module`)."""
    return plan.data is not None and plan.data.sharded and plan.data.unit is ir.GatherUnit.module


def _shard_refusals(plan: ir.Plan) -> list[Diagnostic]:
    """One E705 per shard rule that cannot run, at the rule (its first problem; how many more, e.g. per module)."""
    from plandsl.runtime.parallel.tensor_parallel import rule_problems  # lazy: torch; refusals come before it loads
    by_rule: dict[str | None, list[str]] = {}
    for rule, problem in rule_problems(plan):
        by_rule.setdefault(rule, []).append(problem)
    found = []
    for rule, problems in by_rule.items():
        span = next((r.span for r in plan.shard if r.target.text == rule), plan.shard[0].span)
        more = f" (and {len(problems) - 1} more like it)" if len(problems) > 1 else ""
        found.append(diag("E705", problems[0] + more, span, hint="docs/running.md lists the rules that run"))
    return found


def _context_refusals(plan: ir.Plan, cuda: bool | None) -> list[Diagnostic]:
    """Context parallelism runs for gpt and llama, with every data kind but hsdp: `allgather` on CPU and
    CUDA, `ring` on CPU (runtime.context_parallel)."""
    if plan.context is None or plan.cp == 1:
        return []
    what = f"context parallelism (`context = {plan.context.kind} over {plan.context.axis}`)"
    span = plan.context.span
    found = []
    if plan.context.kind == "ring" and (_has_cuda() if cuda is None else cuda):
        found.append(diag("E702", f"{what} cannot run on CUDA yet: torch's ring attention runs here over the CPU "
                                  "flash-attention kernel, and the path over the CUDA kernels is not written", span,
                          hint=f"`context = allgather over {plan.context.axis}` computes the same on CPU and CUDA "
                               "(each layer all-gathers K and V, as Llama 3 does)"))
    if not isinstance(plan.model, ir.TransformerModel):
        found.append(diag("E704", f"context parallelism needs a gpt or llama model; '{plan.model.name}' is "
                                  f"'{plan.model.kind}', which has no attention to split the sequence for",
                          span, hint="use the context axis for data parallelism instead"))
    model = plan.model
    if plan.context.kind == "ring" and isinstance(model, ir.TransformerModel) and model.latent_attention and \
            model.v_head_dim > model.qk_nope_head_dim + model.qk_rope_head_dim:
        found.append(diag("E704", f"{what} cannot run multi-head latent attention whose values ({model.v_head_dim} "
                                  f"per head) are wider than its queries and keys ({model.qk_nope_head_dim} + "
                                  f"{model.qk_rope_head_dim}): the CPU flash-attention kernel each ring step calls "
                                  "takes one head size, and the interpreter pads narrower values only", span,
                          hint=f"`context = allgather over {plan.context.axis}` runs it"))
    if plan.data is not None and plan.data.hybrid:
        found.append(diag("E703", f"hsdp together with {what} cannot run: the context axis would have to join "
                                  "hsdp's shard dimension", plan.data.span,
                          hint="use zero3 (fsdp) or replicate over the data axis"))
    return found


def _has_cuda() -> bool:
    import torch  # lazy: torch only for plans that ask for a ring
    return torch.cuda.is_available()


def _expert_refusals(plan: ir.Plan) -> list[Diagnostic]:
    """Expert parallelism runs with every data kind but hsdp, with tensor parallelism and pipelines."""
    if plan.experts is None or plan.expert_group == 1:
        return []
    what = f"expert parallelism (`experts = {plan.experts.kind} over {plan.experts.axis}`)"
    found = []
    if plan.data is not None and plan.data.hybrid:
        found.append(diag("E703", f"hsdp together with {what} cannot run: the other parameters would need a 2-D "
                                  "mesh replicated over the expert axis too", plan.data.span,
                          hint="use zero3 or replicate"))
    if plan.train.batch_shares is not None:
        found.append(diag("E703", f"batch_shares together with {what} cannot run: each expert's gradient sums the "
                                  "tokens of every expert rank and is scaled by 1/ep as if their shares were equal",
                          plan.train.span_of("batch_shares"),
                          hint="split the batch evenly, or keep the expert axis out of a plan with batch_shares"))
    return found
