"""Tensor dims against the axes they are split over (E406, E411), shard rules against the model's modules
(E405, E407, E408), and the parallelisms' options against what the stacks that run them take (E416-E420).""" 
from __future__ import annotations

import math
from typing import Iterator
import re

from plandsl import ir
from plandsl.diagnostics import Diagnostic, Note, diag
from plandsl.ir.layers import layers_of
from plandsl.ir.selectors import NameIndex, precision
from plandsl.ir.shapes import context_extents, expert_extents, indivisible, tensor_extents


def divisors(n: int, up_to: int) -> list[int]:
    """The divisors of `n` that are at most `up_to`, ascending: at most min(sqrt(n), up_to) steps."""
    found: set[int] = set()
    d = 1
    while d * d <= n and d <= up_to:
        if n % d == 0:
            found.add(d)
            if n // d <= up_to:
                found.add(n // d)
        d += 1
    return sorted(found)


def _axis_divides(dims: dict[str, int], axis: str, size: int, span, devices: int) -> Diagnostic | None:
    """One diagnostic for every dim an axis fails to divide (one cause, one report). Its hint
    (the sizes that divide all of `dims`) is refined by `plandsl.check.axis_sizes`."""
    failing = indivisible(dims, size)
    if not failing:
        return None
    if len(failing) == 1:
        ((name, value),) = failing.items()
        message = f"{name} ({value}) is not divisible by axis '{axis}' ({size})"
    else:
        message = f"axis '{axis}' ({size}) divides none of " + ", ".join(f"{n} ({v})" for n, v in failing.items())
    common = divisors(math.gcd(*dims.values()), devices)
    return diag("E406", message, span, hint=f"'{axis}' in {{{', '.join(map(str, common[:12]))}"
                f"{', ...' if len(common) > 12 else ''}}} divides all of {', '.join(dims)}")


def _not_divisible(what: str, value: int, axis: str, size: int, span, devices: int) -> Diagnostic:
    return _axis_divides({what: value}, axis, size, span, devices)


def tensor_dims(plan: ir.Plan) -> dict[str, int]:
    """Every extent the tensor-parallel axis splits, by name (`ir.shapes.tensor_extents`, the search's rule too)."""
    return tensor_extents(plan.model, plan.seq if plan.tensor.sequence_parallel else None, plan.cp)


def split_extents(plan: ir.Plan, axis: str) -> dict[str, int]:
    """The extents the built-in parallelisms split over `axis` (shard rules' dims are not listed:
    `plandsl.check.axis_sizes` confirms every size it offers by checking the whole plan)."""
    dims: dict[str, int] = {}
    if plan.tensor and plan.tensor.axis == axis:
        dims.update(tensor_dims(plan))
    if plan.context and plan.context.axis == axis:
        dims.update(context_extents(plan.seq))
    if plan.experts and plan.experts.axis == axis:
        dims.update(expert_extents(plan.model))
    return dims


def axis_at(plan: ir.Plan, span) -> str | None:
    """The mesh axis an E406 at `span` is about (the line of the parallelism or placement that splits)."""
    for part in (plan.tensor, plan.context, plan.experts):
        if part is not None and part.span == span:
            return part.axis
    for rule in plan.shard:
        for param_rule in rule.params:
            for placement in param_rule.placements:
                if placement.span == span:
                    return placement.axis
    return None


def check_sharding(plan: ir.Plan) -> Iterator[Diagnostic]:
    model = plan.model
    devices = min(plan.cluster.num_devices, ir.MAX_MESH_DEVICES)
    if plan.tensor:
        problem = _axis_divides(tensor_dims(plan), plan.tensor.axis, plan.tp, plan.tensor.span, devices)
        if problem:
            yield problem
        yield from _check_tensor_overlap(plan)
    if plan.context:
        problem = _axis_divides(context_extents(plan.seq), plan.context.axis, plan.cp, plan.context.span, devices)
        if problem:
            yield problem
        yield from _check_ring_window(plan)
    if plan.experts:
        experts = expert_extents(model)
        if not experts:
            yield diag("E411", f"expert parallel over '{plan.experts.axis}', but model '{model.name}' has no experts",
                       plan.experts.span, hint="give the model `experts=` (llama) or drop the experts line")
        else:
            group = " x ".join(plan.experts.axes)
            problem = _axis_divides(experts, group, plan.expert_group, plan.experts.span, devices)
            if problem:
                yield problem
        yield from _check_fold(plan)
        yield from _check_experts_overlap(plan)
        yield from _check_experts_overlap_needs(plan)
    yield from _check_rules(plan)


def _check_ring_window(plan: ir.Plan) -> Iterator[Diagnostic]:
    """`context = ring over cp` on a model with a sliding window or attention sinks (E420), which no ring runs:
    Transformer Engine 2.9 asserts its p2p ring (Megatron-Core's `--cp-comm-type p2p`) takes no window
    ("Context parallelism does not support sliding window attention with cp_comm_type=p2p",
    dot_product_attention/context_parallel.py) and runs learnable sinks under context parallelism only over a2a
    (`get_attention_backend`, "Filter: Softmax type"); torch's ring attention (`_templated_ring_attention`, what
    `plandsl run` runs) takes a causal flag and no mask or sinks. `allgather` runs both: each rank's queries see
    every key, under the banded mask."""
    model = plan.model
    if plan.context.kind != "ring" or plan.cp == 1 or not isinstance(model, ir.TransformerModel) or \
            not (model.window or model.sinks):
        return
    what = f"a sliding window ({model.window} keys)" if model.window else "attention sinks"
    yield diag("E420", f"`context = ring over {plan.context.axis}` on model '{model.name}', which has {what}: no ring "
               "attention runs it (Transformer Engine's p2p ring and torch's take the causal mask alone)",
               plan.context.span, hint=f"`context = allgather over {plan.context.axis}` (each rank gathers K and V "
               "and bands its own queries' mask), as Megatron-Core's --cp-comm-type all_gather",
               notes=[Note(f"model argument {'window' if model.window else 'sinks'}",
                           model.span_of("window" if model.window else "sinks"))])


def _check_tensor_overlap(plan: ir.Plan) -> Iterator[Diagnostic]:
    """`tensor = megatron over tp with sequence_parallel, overlap` (E417), as the stacks that run it refuse it:
    Megatron-LM asserts sequence parallelism for --tp-comm-overlap (megatron/training/arguments.py), whose
    all-gathers and reduce-scatters are what is split and overlapped; torchtitan's async TP is a torch.compile
    pass and refuses to run without compiling the model (CompileConfig: "Async TP requires 'model' in
    --compile.components and --compile.enable"), which `kernels: eager` says the plan does not (Transformer
    Engine's userbuffers, `overlap = userbuffers`, compiles nothing)."""
    tensor = plan.tensor
    if not tensor.overlap:
        return
    where = tensor.span_of("overlap")
    if not tensor.sequence_parallel:
        yield diag("E417", f"tensor parallelism over '{tensor.axis}' with overlap needs sequence parallelism: what "
                   "is split into chunks behind the GEMMs is its all-gather before each column-parallel GEMM and its "
                   "reduce-scatter after each row-parallel one (Megatron-LM: 'Tensor parallel communication/GEMM "
                   "overlap can happen only when sequence parallelism is enabled')", where,
                   hint=f"`tensor = megatron over {tensor.axis} with sequence_parallel, overlap`")
    if plan.train.kernels is ir.Kernels.eager and not tensor.userbuffers:
        yield diag("E417", "tensor parallelism with overlap under `kernels: eager`: torch's async tensor "
                   "parallelism is a torch.compile pass (torchtitan: 'Async TP requires 'model' in "
                   "--compile.components and --compile.enable'), and eager kernels say the model is not compiled",
                   where, hint="drop `kernels: eager` (compiled, fused kernels), or drop `overlap` (or overlap as Transformer "
                   "Engine does: `overlap = userbuffers`)",
                   notes=[Note("kernels: eager here", plan.train.span_of("kernels"))]
                   if plan.train.span_of("kernels") else [])


def _check_experts_overlap(plan: ir.Plan) -> Iterator[Diagnostic]:
    """`experts = ... with overlap` beside `recompute: full` (E418), as Megatron-Core refuses it: its combined 1F1B
    all-to-all overlap (--overlap-moe-expert-parallel-comm) runs one microbatch's forward inside another's backward
    layer by layer, and TransformerConfig.__post_init__ (megatron/core/transformer/transformer_config.py, core_v0.16.1)
    asserts "disable full recomputation when enabling overlap_moe_expert_parallel_comm" (and no recompute method or
    recompute_num_layers). `recompute_layers: 0` reruns no block and writes none of them: it passes."""
    train = plan.train
    if not plan.experts.overlap or train.recompute is not ir.Recompute.full or train.recompute_layers == 0:
        return
    what = "full recomputation" if train.recompute_layers is None else \
        f"full recomputation of {train.recompute_layers} block(s) per stage (recompute_layers)"
    where = plan.train.span_of("recompute")
    yield diag("E418", f"experts = {plan.experts.kind} with overlap beside {what}: Megatron-Core's expert all-to-all "
               "overlap (--overlap-moe-expert-parallel-comm) runs each block's forward inside another microbatch's "
               "backward and refuses full recomputation ('disable full recomputation when enabling "
               "overlap_moe_expert_parallel_comm', TransformerConfig)", where,
               hint="`recompute: selective` (the attention core; Megatron-Core overlaps beside it) or `none`, or drop "
               "`with overlap` from the experts line",
               notes=[Note("`with overlap` on the experts line", plan.experts.span_of("overlap"))]
               if plan.experts.span_of("overlap") else [])



def _check_experts_overlap_needs(plan: ir.Plan) -> Iterator[Diagnostic]:
    """`experts = ... with overlap` where Megatron-Core's combined 1F1B overlap does not run (E419): TransformerConfig
    .__post_init__ (megatron/core/transformer/transformer_config.py, core_v0.16.1) asserts, beside E418's full
    recomputation, "virtual_pipeline_model_parallel_size must be specified when pipeline_model_parallel_size > 1"
    (the overlap pairs one microbatch's forward with another's backward inside the interleaved schedule),
    "overlap_moe_expert_parallel_comm is only supported with expert model parallelism" (more than one expert rank)
    and "... only supported with bf16 or fp16 model" (an FP8 or FP4 plan's model is bf16: it passes)."""
    if not plan.experts.overlap:
        return
    needs = []
    if plan.stages is not None and plan.pp > 1 and plan.stages.virtual == 1:
        needs.append((f"a pipeline over {plan.pp} ranks without virtual stages: Megatron-Core asserts "
                      "'virtual_pipeline_model_parallel_size must be specified when pipeline_model_parallel_size > 1'",
                      "give the stages virtual stages (`stages = evenly over pp with virtual = 2`, schedule "
                      "interleaved_1f1b)", plan.stages.span))
    if plan.expert_group == 1:
        needs.append(("one expert rank: Megatron-Core asserts 'overlap_moe_expert_parallel_comm is only supported "
                      "with expert model parallelism' (no all-to-all to overlap)", "spread the experts over more than "
                      "one rank, or drop `with overlap`", plan.experts.span))
    if plan.train.precision is ir.Precision.fp32:
        needs.append(("precision fp32: Megatron-Core asserts 'overlap_moe_expert_parallel_comm is only supported with "
                      "bf16 or fp16 model'", "`precision: bf16` (or an FP8 precision, whose model is bf16)",
                      plan.train.span_of("precision") or plan.train.span))
    overlap = plan.experts.span_of("overlap")
    for what, hint, where in needs:
        yield diag("E419", f"experts = {plan.experts.kind} with overlap beside {what}", where, hint=hint,
                   notes=[Note("`with overlap` on the experts line", overlap)] if overlap and where != overlap else [])

def _check_fold(plan: ir.Plan) -> Iterator[Diagnostic]:
    """`experts = alltoall over [ep, tp]` (E416): Megatron-Core's MoE parallel folding draws an expert group from
    the ranks of one pipeline stage that attention splits the tokens or the weights over, ep x expert_tp x
    expert_dp = tp x cp x dp; plandsl folds the tensor axis (expert_tp 1), whose ranks then dispatch their own
    sequence shards, so sequence parallelism must split the tokens over it."""
    tensor = plan.tensor.axis if plan.tensor is not None else None
    roles = plan.axis_roles()
    names = {"pp": "the pipeline stages", "cp": "the sequence", "dp": "the batch", "ep": "the experts"}
    for index, axis in enumerate(plan.experts.fold):
        if axis == tensor:
            continue
        size = plan.mesh.degree(axis)
        splits = f"splits {names[roles[axis]]}" if axis in roles else "no parallelism uses"
        yield diag("E416", f"experts fold axis '{axis}' ({size}), which {splits}, into their group: an expert "
                   f"group is made of one pipeline stage's tensor-parallel ranks (ep x expert_tp x expert_dp = "
                   f"tp x cp x dp), and only the tensor axis{f' {tensor!r}' if tensor else ''} can be folded",
                   plan.experts.span_of(f"fold.{index}"),
                   hint=f"`experts = alltoall over [{plan.experts.axis}, {tensor}]`" if tensor
                   else f"`experts = alltoall over {plan.experts.axis}`")
    if tensor in plan.experts.fold and plan.tp > 1 and not plan.tensor.sequence_parallel:
        yield diag("E416", f"experts folded over the tensor axis '{tensor}' ({plan.tp}) need sequence parallelism: "
                   f"without it the {plan.tp} tensor-parallel ranks hold the same tokens, and each would dispatch "
                   "them to the experts (Megatron-Core requires it for experts with tensor parallelism)",
                   plan.experts.span, notes=[Note("tensor parallelism here", plan.tensor.span)] if plan.tensor.span
                   else [], hint=f"`tensor = megatron over {tensor} with sequence_parallel`")


def _check_rules(plan: ir.Plan) -> Iterator[Diagnostic]:
    if not plan.shard:
        return
    params = [p for layer in layers_of(plan.model) for p in layer.params]
    modules: dict[str, list] = {}
    for param in params:
        modules.setdefault(param.module, []).append(param)
    winners: dict[str, ir.ShardRule] = {}
    index = NameIndex(list(modules))
    for rule in plan.shard:
        hit = [index.names[i] for i in index.select(rule.target, prefix=True)]
        if not hit:
            yield diag("E405", f"'{rule.target.text}' matches no module of model '{plan.model.name}'",
                       rule.target.span, hint=_module_hint(rule.target.text, modules))
            continue
        for module in hit:
            other = winners.get(module)
            if other is None or precision(rule.target) > precision(other.target):
                winners[module] = rule
            elif precision(rule.target) == precision(other.target) and _setting(rule) != _setting(other):
                yield diag("E407", f"'{rule.target.text}' and '{other.target.text}' both set module '{module}' "
                           "differently, and neither names it more precisely", rule.span,
                           notes=[Note("the other rule", other.span)],
                           hint="an exact name beats a range, a range beats a glob: make one rule more precise")
                break
        for param_rule in rule.params:
            yield from _check_param_rule(plan, rule, param_rule, [p for m in hit for p in modules[m]])


def _setting(rule: ir.ShardRule):
    return rule.model_dump(exclude={"target"})


def _check_param_rule(plan: ir.Plan, rule: ir.ShardRule, param_rule: ir.ParamRule, params) -> Iterator[Diagnostic]:
    names = {p.name.rsplit(".", 1)[-1] for p in params}
    chosen = [p for p in params if param_rule.param in ("*", p.name.rsplit(".", 1)[-1])]
    if not chosen:
        yield diag("E408", f"modules matched by '{rule.target.text}' have no parameter '{param_rule.param}'",
                   param_rule.span, hint=f"their parameters: {', '.join(sorted(names))}")
        return
    for placement in param_rule.placements:
        if placement.kind != "shard":
            continue
        size = plan.mesh.degree(placement.axis)
        for param in chosen:
            if placement.dim is None or not -len(param.shape) <= placement.dim < len(param.shape):
                yield diag("E408", f"Shard({placement.dim}) on '{param.name}', which has {len(param.shape)} dims "
                           f"{list(param.shape)}", placement.span, hint=f"dims are 0..{len(param.shape) - 1}")
                break
            extent = param.shape[placement.dim]
            if extent % size:
                yield _not_divisible(f"dim {placement.dim} of '{param.name}'", extent, placement.axis, size,
                                     placement.span, min(plan.cluster.num_devices, ir.MAX_MESH_DEVICES))
                break


def _module_hint(text: str, modules) -> str:
    """The module patterns closest to a selector that matched nothing (`layers.*.mlp.w1`, ...)."""
    import difflib  # lazy: difflib only for a misspelt name, never on a clean check
    patterns = list(dict.fromkeys(re.sub(r"\.\d+(?=\.|$)", ".*", m) for m in modules))
    wanted = re.sub(r"\[[^]]*\]|\.\d+(?=\.|$)", ".*", text)
    close = difflib.get_close_matches(wanted, patterns, n=4, cutoff=0.4) or patterns[:4]
    return "modules look like " + ", ".join(close)
