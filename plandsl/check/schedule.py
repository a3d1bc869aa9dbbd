"""The plan's schedule for the plan's sizes: a built-in must be able to run them (E502, its size
rules only: nothing is laid out, whatever the microbatch count), a written schedule is
instantiated and validated (E602-E608) and must put stages on the ranks the plan's stage map
says (E409). The table itself is laid out by `cost.schedule.plan_schedule`. With `batch_shares` each
replica runs its own microbatch count: every distinct one is checked."""
from __future__ import annotations

from dataclasses import replace
from typing import Iterator

from plandsl import ir
from plandsl.diagnostics import Diagnostic, Edit, Note, diag
from plandsl.ir import shares as batch
from plandsl.ir.placement import rank_map
from plandsl.schedules.registry import BUILTIN, megatron_microbatches_fit, microbatches_fit, min_microbatches
from plandsl.cost.estimate import data_shares, format_shares
from plandsl.cost.schedule import builtin_sizes, plan_schedule


def check_schedule(plan: ir.Plan) -> Iterator[Diagnostic]:
    if plan.schedule is None or plan.stages is None:
        return
    if plan.stages.implementation == "deepspeed":
        if plan.data is not None and plan.data.zero_stage >= 2:  # deepspeed/runtime/pipe/engine.py (v0.5.8): 72
            span = plan.stages.span_of("implementation")
            yield diag("E611", f"DeepSpeed's pipeline engine takes ZeRO 0 or 1 (`assert self.zero_optimization_stage() "
                       f"< 2`, deepspeed/runtime/pipe/engine.py): data = {plan.data.kind} is ZeRO-"
                       f"{plan.data.zero_stage}", plan.data.span,
                       hint="data = zero1 (or replicate) over the data axes, or torch's pipeline: drop "
                       "`implementation = deepspeed`",
                       notes=[Note("DeepSpeed's pipeline engine said here", span)] if span else [])
        if plan.tensor is not None and plan.tensor.sequence_parallel:  # engine.py (v0.5.8): 131, 619, 711, 725
            span = plan.stages.span_of("implementation")
            yield diag("E611", "DeepSpeed's pipeline engine sends each boundary split over the tensor-parallel ranks "
                       "and gathers it whole on arrival (`PartitionedTensor`, deepspeed/runtime/pipe/engine.py, "
                       "v0.5.8): it runs no sequence parallelism, which the plan's tensor axis says", plan.tensor.span,
                       hint="drop `sequence_parallel` from the tensor attribute, or torch's or Megatron-LM's "
                       "pipeline: `implementation = torch | megatron`",
                       notes=[Note("DeepSpeed's pipeline engine said here", span)] if span else [])
        refused = _not_run(plan, "deepspeed", "its TrainSchedule, "
                           "deepspeed/runtime/pipe/schedule.py", "schedule = 1f1b")  # train_batch runs TrainSchedule
        if refused is not None:
            yield refused
            return
        # its 1F1B then meets the sizes torch's runs (below), as `plandsl run` runs it on torch's pipeline
    if plan.stages.implementation == "dualpipe":
        refused = _not_run(plan, "dualpipe", "`DualPipeV.step`, deepseek-ai/DualPipe's "
                           "dualpipe/dualpipev.py, lays out its own order", "schedule = dualpipev")
        if refused is not None:
            yield refused
            return
        # DualPipeV then meets the sizes torch's ScheduleDualPipeV takes (below: at least 2 x pp microbatches), as
        # DualPipeV's own `num_chunks >= num_ranks * 2` asks
    if plan.stages.implementation == "megatron":
        refused = _not_run(plan, "megatron", "forward_backward_pipelining_without_"
                           "interleaving, _with_interleaving", "schedule = 1f1b (or interleaved_1f1b with virtual "
                           "stages)")  # megatron.core.pipeline_parallel.schedules' two functions
        if refused is not None:
            yield refused
            return
        m, virtual = plan.num_microbatches, plan.stages.virtual
        if not batch.uneven(plan) and not megatron_microbatches_fit(plan.pp, m, virtual):
            span = plan.stages.span_of("implementation")
            yield diag("E502", f"Megatron-LM's interleaved 1F1B needs at least pp ({plan.pp}) microbatches: it runs "
                       f"them in groups of pp to m per virtual stage (forward_backward_pipelining_with_interleaving), "
                       f"and global_batch {plan.train.global_batch} / (dp {plan.dp} x micro_batch "
                       f"{plan.train.micro_batch}) = {m}", plan.schedule.span,
                       hint=f"a global_batch of at least {plan.pp * plan.dp * plan.train.micro_batch}, a smaller "
                       "micro_batch, or one stage per rank (schedule = 1f1b)",
                       notes=[Note("Megatron-LM's pipeline said here", span)] if span else [])
            return
    if batch.uneven(plan):  # each replica's own microbatch count (the training check passed: shares are valid)
        shares = data_shares(plan)
        info = BUILTIN.get(plan.schedule.name) if plan.schedule.definition is None else None
        for share in sorted(set(shares or ())):
            m = share // plan.train.micro_batch
            found = [diag("E502", f"schedule '{info.name}' needs at least {min_microbatches(info, plan.pp)} "
                          f"microbatches with {plan.pp} pipeline ranks, or a count it runs", plan.schedule.span)] \
                if info is not None and not microbatches_fit(info, plan.pp, m) else \
                list(check_schedule(batch.replica_plan(plan, share)))
            if found:
                rank = shares.index(share)
                yield replace(found[0], message=f"data rank {rank}'s share ({share} sequences, {share // plan.train.micro_batch} "
                              f"microbatches; batch_shares: {format_shares(plan, shares)}): {found[0].message}",
                              hint="batch shares whose microbatch counts the schedule runs", edits=())
                return
        return
    if plan.schedule.definition is None:
        yield from builtin_sizes(plan)
        return
    schedule, problems = plan_schedule(plan)
    yield from (_at_the_plan(plan, problem) for problem in problems)
    if schedule is None or problems:
        return
    expected, _ = rank_map(plan.stages, plan.pp)
    derived = schedule.stage_to_rank[0]
    if expected and tuple(derived) != tuple(expected):
        wrong = [s for s, (a, b) in enumerate(zip(derived, expected)) if a != b]
        yield diag("E409", f"schedule '{plan.schedule.name}' runs stage {wrong[0]} on rank {derived[wrong[0]]}, but the "
                   f"plan's stage map puts it on rank {expected[wrong[0]]}", plan.schedule.span,
                   hint=f"the schedule's map is {list(derived)}: set `map = {list(derived)}` in the stages, or "
                   "change the schedule")



def _not_run(plan: ir.Plan, implementation: str, where: str, instead: str) -> Diagnostic | None:
    """E610 where the plan's schedule is not one `implementation`'s pipeline runs (`ScheduleInfo.<implementation>`):
    a built-in it does not run, or a written one."""
    whose = ir.PIPELINE_RUNTIMES[implementation]
    info = BUILTIN.get(plan.schedule.name) if plan.schedule.definition is None else None
    if info is not None and getattr(info, implementation):
        return None
    runs = ", ".join(name for name, known in BUILTIN.items() if getattr(known, implementation))
    what = "a written schedule" if info is None else f"schedule '{plan.schedule.name}'"
    span = plan.stages.span_of("implementation")
    return diag("E610", f"{whose} does not run {what}: it runs {runs} ({where})", plan.schedule.span,
                hint=f"{instead}, or torch's pipeline: drop `implementation = {implementation}`",
                notes=[Note(f"{whose} said here", span)] if span else [])

def _at_the_plan(plan: ir.Plan, problem: Diagnostic) -> Diagnostic:
    """A table written for other sizes than the plan's (E608) is reported at the plan's line that sets
    the size (the global batch for microbatches, the pipeline axis for ranks): a one-size table is
    usually right and the plan changed; the table's header becomes a note."""
    words = problem.message.split()
    if problem.code != "E608" or len(words) < 8 or words[2:5] != ["is", "written", "for"] or \
            words[5] not in ("microbatches", "ranks"):
        return problem
    size, declared = words[5], words[7].rstrip(",")
    if size == "microbatches":
        span = plan.train.span_of("global_batch")
        why = (f"global_batch {plan.train.global_batch} / (dp {plan.dp} x micro_batch {plan.train.micro_batch}) = "
               f"{plan.num_microbatches} microbatches")
        fit = int(declared) * plan.dp * plan.train.micro_batch
        hint = f"global_batch: {fit} gives the table's {declared} microbatches"
        item = plan.train.field_spans.get("global_batch")
        edits = (Edit(item, f"global_batch: {fit}"),) if item is not None else ()
    else:
        axis = plan.mesh.axis(plan.stages.axis)
        span = axis.span if axis is not None else plan.mesh.span
        why = f"the pipeline axis '{plan.stages.axis}' has {plan.pp} ranks"
        hint = f"{plan.stages.axis} = {declared} (and the other axes to match), or write the table for {plan.pp} ranks"
        edits = ()
    if span is None:
        return problem
    return replace(problem, message=f"{why}, but schedule '{plan.schedule.name}' is written for {size} = {declared}",
                   span=span, hint=f"{hint}; or make the schedule a template (`schedule name(p: ranks, m: "
                   "microbatches) { ... }`), which fits any size", edits=edits,
                   notes=(Note(f"'{plan.schedule.name}' declares {size} = {declared}", problem.span),) + problem.notes)
