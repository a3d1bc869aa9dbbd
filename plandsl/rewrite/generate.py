"""`plandsl generate`: a request (a model on a cluster, or a partial plan) -> the fastest checked plans.

Stage: rewrite (from scratch it runs the search; with a partial plan, `complete.generate_from` keeps what
the plan writes). Contract: `generate(request, progress)` refuses arguments that do not go together
(`UsageProblem`, naming the options; before any work), resolves the problem, searches, and returns the
candidates with their plan texts, each passing `plandsl check`; `candidates_json` and `report` are what
`generate --json` and `generate` print, given the interpreter's refusals (`api.run_refusals`, from above
this layer). SearchError or PlanError otherwise.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Mapping

from plandsl import ir
from plandsl.rewrite.complete import generate_from
from plandsl.rewrite.mixed import Gain, Shared, faster_alone, mixed_plans
from plandsl.search import SearchResult, parse_pins, search, with_modules
from plandsl.search.emit import (Refusals, candidate_json, checked_texts, explain, format_table, include_note,
                                 resolve_problem, written_from)


class UsageProblem(ValueError):
    """Options that do not go together (the CLI's exit 2)."""


@dataclass(frozen=True)
class Request:
    """What `plandsl generate` was asked: the problem by options, or `from_file` (a partial plan)."""
    model: str | None = None
    cluster: str | None = None
    global_batch: int | None = None
    seq_len: int | None = None
    precision: str | None = None
    fp8_recipe: str | None = None
    """With precision fp8: `delayed` (the default), `current`, `tensorwise` or `blockwise` (`ir.Fp8Recipe`)."""
    kernels: str | None = None
    """`fused` (the default) or `eager`: the element-wise kernels the implementation runs (`ir.Kernels`)."""
    attention: str | None = None
    """`flash` (the default) or `materialized`: the implementation's attention core (`ir.Attention`)."""
    loss: str | None = None
    """`standard` (the default), `fused` or `megatron`: the implementation's cross entropy (`ir.Loss`)."""
    tensor_overlap: str | None = None
    """Which implementation overlaps the tensor-parallel collectives with their GEMMs (`ir.TensorOverlap`): `async_tp`
    (torch's async TP) or `userbuffers` (Transformer Engine's, Megatron-LM's --tp-comm-overlap); candidates with
    sequence parallelism are priced so and written `with sequence_parallel, overlap` (`overlap = userbuffers`).
    None: no overlap."""
    tensor_implementation: str | None = None
    """Whose tensor parallelism runs the layers (`ir.TENSOR_STACKS`): `torch` or `megatron`, what a column-parallel
    linear saves under sequence parallelism (its gathered input, its shard), written `tensor = ... with
    implementation = megatron` where the line does not imply it. None: as `tensor_overlap` implies (megatron under
    userbuffers, else torch)."""
    pipeline: str | None = None
    """Whose pipeline runs the stages (`ir.PIPELINE_IMPLEMENTATIONS`): `torch` (the default), `megatron`, `deepspeed`
    or `dualpipe`, whose schedules alone are searched and whose memory and time counted, and written `stages = ...
    with implementation = megatron` (or deepspeed, dualpipe)."""
    from_file: str | None = None
    plan_name: str | None = None
    params: Mapping[str, object] = field(default_factory=dict)
    pins: tuple[str, ...] = ()
    top: int = 5
    output: str | None = None
    """Where the best plan will be written (relative imports resolve from there)."""
    time_limit: float | None = None
    """Seconds the search may take (`search.search`); None or 0: until it is done."""


@dataclass(frozen=True)
class Generated:
    result: SearchResult
    texts: tuple[str, ...]
    """The candidates' plan texts, best first, in `plandsl fmt`'s layout."""
    notes: tuple[str, ...] = ()
    """What the user should know about a completed plan (`note: ...` lines)."""
    gain: Gain | None = None
    """On a cluster of several device types: the best plan against the best on its fastest devices alone."""
    shared: tuple[Shared | None, ...] = ()
    """Per candidate: its even-share figures where it takes uneven `batch_shares` (rewrite.mixed), else None."""


def usage_problem(request: Request) -> str | None:
    given = [f"--{name}" for name, value in (("model", request.model), ("cluster", request.cluster),
                                             ("global-batch", request.global_batch), ("seq-len", request.seq_len),
                                             ("precision", request.precision), ("fp8-recipe", request.fp8_recipe),
                                             ("kernels", request.kernels),
                                             ("attention", request.attention), ("loss", request.loss),
                                             ("tensor-overlap", request.tensor_overlap),
                                             ("tensor-implementation", request.tensor_implementation),
                                             ("pipeline", request.pipeline))
             if value is not None]
    if request.from_file and given:
        return f"{', '.join(given)}: the --from plan gives these (edit the plan instead)"
    if not request.from_file and (request.model is None or request.cluster is None or request.global_batch is None):
        return "--model, --cluster and --global-batch are required (or --from PLAN)"
    if (request.plan_name or request.params) and not request.from_file:
        return f"{'--plan' if request.plan_name else '--param'} is for the --from file"
    if request.fp8_recipe and request.precision != "fp8":  # E510: the recipe scales fp8's tensors only
        return f"--fp8-recipe with --precision {request.precision or 'bf16'}: a recipe of FP8 training (E510)"
    if request.tensor_overlap == "async_tp" and request.kernels == "eager":  # E417: async TP is torch.compile's pass
        return ("--tensor-overlap with --kernels eager: torch's async tensor parallelism (async_tp) is a torch.compile "
                "pass (E417); Transformer Engine's `--tensor-overlap userbuffers` compiles nothing")
    overlaps = {overlap.value: overlap for overlap in ir.TensorOverlap}
    implied = ir.overlap_stack(overlaps.get(request.tensor_overlap or ""))
    if request.tensor_implementation and implied and request.tensor_implementation != implied:  # lowering's E206
        return (f"--tensor-implementation {request.tensor_implementation} with --tensor-overlap "
                f"{request.tensor_overlap}, which only {implied}'s tensor parallelism runs")
    return None


def generate(request: Request, progress: Callable[[int, int], None] | None = None) -> Generated:
    problem = usage_problem(request)
    if problem:
        raise UsageProblem(problem)
    if request.from_file:
        completed = generate_from(request.from_file, request.plan_name, dict(request.params), request.pins,
                                  request.top, progress, request.output, time_limit=request.time_limit)
        gain = None
        if completed.problem is not None and completed.problem.cluster.heterogeneous:  # what the mix gains
            gain = faster_alone(completed.problem, completed.result.best.estimate, completed.pins, request.time_limit,
                                subject="the completed plan")
        return Generated(completed.result, tuple(completed.texts), tuple(completed.notes), gain, completed.shared)
    problem_, source = resolve_problem(request.model, request.cluster, request.global_batch, request.seq_len,
                                       request.precision or "bf16",
                                       str(request.output or os.path.join(os.getcwd(), "generated.plan")),
                                       kernels=request.kernels or "fused", attention=request.attention or "flash",
                                       loss=request.loss or "standard", tensor_overlap=request.tensor_overlap,
                                       fp8_recipe=request.fp8_recipe, pipeline=request.pipeline or "torch",
                                       tensor_implementation=request.tensor_implementation)
    problem_, _ = with_modules(problem_, parse_pins(request.pins))  # pinned modules: in every plan written
    result, texts = checked_texts(search(problem_, request.pins, request.top, progress=progress,
                                           time_limit=request.time_limit), problem_, source,
                                  request.output)
    gain, shared = None, ()
    if problem_.cluster.heterogeneous:  # uneven data-parallel shares, and what the mix gains (rewrite.mixed)
        result, texts, shared = mixed_plans(result, texts, problem_, source, request.output, request.pins,
                                            request.top, request.time_limit)
        gain = faster_alone(problem_, result.best.estimate, request.pins, request.time_limit)
    note = include_note(written_from(source, request.output or "generated.plan"))
    if note:  # said in the file too, where whoever checks or runs it later reads it
        texts = [f"# {note[0].upper()}{note[1:]}\n" + text for text in texts]
    return Generated(result, tuple(texts), (note,) if note else (), gain, tuple(shared))


def candidates_json(generated: Generated, refusals: Refusals) -> dict:
    """`generate --json`: {"candidates": [...]}, best first."""
    found = {"candidates": [candidate_json(s, t, refusals) for s, t in zip(generated.result.candidates,
                                                                           generated.texts)]}
    shared = generated.shared or (None,) * len(found["candidates"])
    for scored, record, even in zip(generated.result.candidates, found["candidates"], shared):
        if scored.estimate.shares:  # uneven batch_shares (rewrite.mixed)
            record["batch_shares"] = list(scored.estimate.shares)
            record["replica_step_time_s"] = list(scored.estimate.replica_steps)
        if even is not None:
            record["even_shares_step_time_s"] = even.even.time.step
    if generated.gain is not None:
        found["heterogeneity"] = generated.gain.to_json()
    return found


def report(generated: Generated, refusals: Refusals) -> str:
    """`generate`'s table of candidates and why the best won (and whether `plandsl run` runs it)."""
    text = format_table(generated.result) + "\n" + explain(generated.result, refusals)
    best = generated.shared[0] if generated.shared else None
    if best is not None:  # the winner's uneven shares against even ones on the same layout
        text += "\n" + best.line(generated.result.best.estimate)
    return text + ("\n" + generated.gain.line() if generated.gain is not None else "")
