"""What `plandsl generate` reads and writes around the search: the model and cluster named on the
command line, the emitted `.plan` text, the JSON record of a candidate, the table and the *why*.

Stage: around `plandsl.search`. Contract: `resolve_problem(model, cluster, ...)` turns a model
expression (`gpt(layers=96, ...)`), a stdlib model name or `FILE.plan:NAME`, and a cluster (`dgx_a100
x 128`, a name) into a `Problem` and the import lines that define them, through the language itself;
`plan_text(scored, source)` writes a plan that `plandsl check` passes unchanged, with its predicted
figures as comments. Bad input raises `SearchError` with a plain message.
"""
from __future__ import annotations

from typing import Callable

import json
import math
import os
import re
import shlex
from dataclasses import dataclass, replace
from pathlib import Path

from plandsl import ir
from plandsl.ir.inspected import parse_source
from plandsl.ir.layers import layers_of, param_count
from plandsl.ir.placement import counted_split, split_evenly
from plandsl.schedules.registry import BUILTIN
from plandsl.search.problem import Candidate, Problem, Scored, SearchError, SearchResult
from plandsl.lower.units import format_bytes, format_count
from plandsl.check.analysis import analyze, checked_document
from plandsl.syntax.loader import include, include_flags, stdlib_files, stdlib_root
from plandsl.check.model import model_shapes
from plandsl.diagnostics import Note, PlanError, did_you_mean
from plandsl.syntax.format import format_text

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class Source:
    """How the emitted plan names its model and cluster: imports and two expressions."""

    imports: tuple[str, ...]
    model: str
    cluster: str


# ---- reading the command line ----------------------------------------------------------------------------
def _stdlib_names() -> dict[str, str]:
    """Name -> the stdlib file (`clusters/dgx_a100`) that defines it, for clusters and models."""
    found: dict[str, str] = {}
    for name in stdlib_files():
        if not name.startswith(("clusters/", "models/")):
            continue
        document = checked_document(analyze(str(stdlib_root() / f"{name}.plan")))
        local = [*document.devices, *document.nodes, *document.clusters, *document.models]
        for item in local:
            if item.name not in found and document.file.endswith(f"{name}.plan"):
                found.setdefault(item.name, name)
    return found


_STDLIB: dict[str, str] | None = None


def stdlib_names() -> dict[str, str]:
    global _STDLIB
    if _STDLIB is None:
        _STDLIB = _stdlib_names()
    return _STDLIB


def resolve_problem(model: str, cluster: str, global_batch: int, seq_len: int | None = None,
                    precision: str = "bf16", plan_file: str | None = None,
                    kernels: str = "fused", attention: str = "flash", loss: str = "standard",
                    tensor_overlap: str | None = None, fp8_recipe: str | None = None,
                    pipeline: str = "torch", tensor_implementation: str | None = None) -> tuple[Problem, Source]:
    """The model and the cluster, resolved by the language (so they mean what they mean in a plan).
    `tensor_overlap`: which implementation overlaps the tensor-parallel collectives (`ir.TensorOverlap`'s words;
    None: none), priced and written wherever a candidate has sequence parallelism. `tensor_implementation`: whose
    tensor parallelism runs the layers (`ir.TENSOR_STACKS`; None: as the overlap implies). `pipeline`: whose pipeline runs
    the stages (`ir.PIPELINE_IMPLEMENTATIONS`), its schedules alone searched and written where a candidate has stages.
    `plan_file`: where the plan will be written; a model from torch (`hf(...)`, `pkg.mod:fn(...)`) is read
    from the layer table `plandsl inspect` wrote beside it (`.plandsl/`), as the plan will read it."""
    names = stdlib_names()
    imports: list[str] = []
    model_text, cluster_text = model.strip(), cluster.strip()
    if not model_text or not cluster_text:
        raise SearchError("--model and --cluster must not be empty", code="E804")
    torch_call = torch_model_call(model_text)
    if torch_call is not None:
        model_text = torch_call
    elif ":" in model_text and "(" not in model_text:
        path, _, name = model_text.rpartition(":")
        if not os.path.isfile(path):  # never raises (a name too long, a NUL)
            raise SearchError(f"cannot read model file '{path}' (from --model {model}; a factory is written "
                              "pkg.module:function(...))", code="E804")
        imports.append(str(Path(path).resolve()))
        model_text = name
    for text in (model_text, cluster_text):
        for word in _NAME.findall(text):
            if word in names and names[word] not in imports:
                imports.append(names[word])
    _known(model_text, "model", [n for n, f in names.items() if f.startswith("models/")], imports)
    _known(cluster_text, "cluster", [n for n, f in names.items() if f.startswith("clusters/")], imports)
    found_model = _resolve(imports, f"model __model = {model_text}", "--model", model, plan_file)
    found_cluster = _resolve(imports, f"cluster __cluster = {cluster_text}", "--cluster", cluster)
    found_precision = _choice(ir.Precision, precision, "--precision")
    needed = dict.fromkeys((found_precision, found_precision.unquantized))  # fp8: bf16 too (check's E504)
    lacking = {d.name: [p.value for p in needed if p not in d.peak] for d in found_cluster.devices_in_order()}
    missing = sorted(name for name, precisions in lacking.items() if precisions)
    if missing:
        absent = list(dict.fromkeys(p for name in missing for p in lacking[name]))
        hint = "; `--precision fp8` runs at a Hopper's fp8 peak" if {"mxfp8", "nvfp4"} & set(absent) else ""
        raise SearchError(f"device(s) {', '.join(missing)} of cluster '{cluster}' give no peak for "
                          f"{' and '.join(absent)}{hint}", code="E504")
    if global_batch < 1:
        raise SearchError(f"--global-batch must be at least 1, got {global_batch}", code="E804")
    # Name them as the user did (the plan writes the expressions, not these names).
    found_model = found_model.model_copy(update={"name": model_text if _NAME.fullmatch(model_text) else "model"})
    found_cluster = found_cluster.model_copy(update={"name": cluster_text})
    _runnable(found_model, model, seq_len)
    problem = Problem(found_model, found_cluster, global_batch, seq_len, found_precision,
                      kernels=_choice(ir.Kernels, kernels, "--kernels"),
                      attention=_choice(ir.Attention, attention, "--attention"), loss=_choice(ir.Loss, loss, "--loss"),
                      overlap_tensor=tensor_overlap is not None, search_experts=True,
                      tensor_overlap=_choice(ir.TensorOverlap, tensor_overlap or "async_tp", "--tensor-overlap"),
                      fp8_recipe=_choice(ir.Fp8Recipe, fp8_recipe, "--fp8-recipe") if fp8_recipe else None,
                      pipeline=_word(pipeline, ir.PIPELINE_IMPLEMENTATIONS, "--pipeline"),
                      tensor_stack=_word(tensor_implementation, ir.TENSOR_STACKS, "--tensor-implementation")
                      if tensor_implementation else None)
    return problem, Source(tuple(imports), model_text, cluster_text)


def _choice(kind, value: str, option: str):
    """`value` as the language's word of `kind` (an `ir` enum), or a SearchError naming `option` and the words."""
    try:
        return kind(value)
    except ValueError:
        raise SearchError(f"{option} {value}: one of {', '.join(word.value for word in kind)}", code="E804") from None


def _word(value: str, words: tuple[str, ...], option: str) -> str:
    """`value` if one of the language's `words` (a tuple of them, as `ir.PIPELINE_IMPLEMENTATIONS`), or a SearchError."""
    if value not in words:
        raise SearchError(f"{option} {value}: one of {', '.join(words)}", code="E804")
    return value


def _resolve(imports: list[str], line: str, option: str, given: str, plan_file: str | None = None):
    """One definition checked by the language (as if in `plan_file`); its first error as a plain message."""
    header = "".join(f'import "{i}"\n' for i in imports)
    with include(os.path.dirname(i) for i in imports if os.path.isabs(i)):  # a file named by --model
        analysis = analyze(plan_file or "<generate>", text=header + line + "\n")
    if not analysis.ok or analysis.document is None:
        first = analysis.errors[0]
        hint = f" ({first.hint})" if first.hint and "names in scope" not in first.hint else ""
        if first.code == "E215" and first.hint and "(or: " in first.hint:  # the one command that writes it
            hint = f" (E215; run: {first.hint.split('(or: ', 1)[1].removesuffix(')')})"
        raise SearchError(f"{option} {given}: {first.message}{hint}", code=first.code)  # the language's own code
    document = analysis.document
    found = [*document.models, *document.clusters]
    return next(item for item in found if item.name in ("__model", "__cluster"))


_FACTORY_CALL = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_.]*\(")


def torch_model_call(text: str) -> str | None:
    """`hf("LlamaForCausalLM", k=v, ...)` or `pkg.mod:fn(k=v, ...)` (a model source, as `plandsl inspect`
    takes it) as the plan language writes it: `hf(...)`, `factory("pkg.mod:fn", ...)`; None for any other
    --model; SearchError for a source that does not parse or an argument the language cannot write."""
    if not (text.startswith("hf(") or _FACTORY_CALL.match(text)):
        return None
    try:
        source = parse_source(text)
    except ValueError as error:
        raise SearchError(f"--model {text}: {error}", code="E804") from None
    args = [json.dumps(source.target, ensure_ascii=False)]
    for key, value in source.args:
        if isinstance(value, bool):
            args.append(f"{key}={'true' if value else 'false'}")
        elif isinstance(value, (int, float)):
            args.append(f"{key}={value!r}")
        elif isinstance(value, str) and not any(ord(c) < 32 and c not in "\n\t" for c in value):
            args.append(f"{key}={json.dumps(value, ensure_ascii=False)}")
        else:
            raise SearchError(f"--model {text}: argument '{key}' ({value!r}) cannot be written in a plan: "
                              "numbers, strings and booleans only", code="E804")
    return f"{'hf' if source.kind == 'hf' else 'factory'}({', '.join(args)})"


def _runnable(model: ir.Model, given: str, seq_len: int | None) -> None:
    """The shapes a model needs to run (E220-E224, as `check` has them): no plan is searched for one that has none."""
    for problem in model_shapes(model, seq=seq_len):
        hint = f"--seq-len {model.seq} or less" if problem.code == "E224" else problem.hint
        raise SearchError(f"--model {given}: {problem.message} ({problem.code}; {hint})", code=problem.code)


def _known(text: str, what: str, options: list[str], imports: list[str]) -> None:
    """A bare name must be a stdlib name (or come from an imported file)."""
    if not _NAME.fullmatch(text) or any(not i.startswith(("clusters/", "models/")) for i in imports):
        return
    names = stdlib_names()
    if text not in names:
        hint = did_you_mean(text, options, f"{what}s")
        raise SearchError(f"unknown {what} '{text}'" + (f"; {hint}" if hint else "")
                          + f" (standard {what}s: {', '.join(sorted(options))})", code="E201")


# ---- writing the plan ------------------------------------------------------------------------------------
def _tensor_options(problem: Problem, sequence_parallel: bool) -> str:
    """The tensor clause's options (`ir.TensorParallel.options_text`): sequence parallelism, the problem's overlap
    where it has one, and whose tensor parallelism runs the layers where it is not what the line implies."""
    overlap = sequence_parallel and problem.overlap_tensor
    return ir.TensorParallel.model_construct(sequence_parallel=sequence_parallel, overlap=overlap,
                                             implementation=problem.tensor_overlap, sm_margin=problem.sm_margin,
                                             stack=problem.stack_of_tensor).options_text()


def _gathering(scored: Scored, problem: Problem) -> ir.Gathering:
    """How the candidate's data clause gathers, as its plan was estimated: the problem's units and prefetch, in the
    dtype the search gave its ZeRO stage (`Problem.gather_dtype`, `build_plan`)."""
    return scored.plan.data.gathering if scored.plan.data is not None else problem.priced_gathering


def plan_text(scored: Scored, problem: Problem, source: Source, name: str = "generated",
              train_extra: tuple[str, ...] = (), train_text: str | None = None) -> str:
    """The candidate as a plan; `train_extra`: more `key: value` items for its train dict (the settings
    the search does not choose, from a partial plan: `search_from`); `train_text`: the train expression
    to write instead (a partial plan's own, when it fixed what the search would choose)."""
    c = scored.candidate
    sizes = c.axis_sizes()
    mesh = ", ".join(f"{a} = {sizes[a]}" for a in c.mesh_order)
    train = [f"global_batch: {problem.global_batch}", f"micro_batch: {c.micro_batch_size}"]
    if problem.seq:
        train.append(f"seq: {problem.seq}")
    train += [f"precision: {problem.precision.value}", f"recompute: {c.recompute}",
              *([f"recompute_layers: {c.recompute_layers}"] if c.recompute_layers is not None else []),
              *([f"offload_layers: {c.offload_layers}"] if c.offload_layers else []),
              *problem.given_items(), *train_extra]
    lines = [f'import "{i}"' for i in source.imports]
    lines += ["", *header(scored.estimate), "", f"plan {name} {{", f"  model    = {source.model}",
              f"  cluster  = {source.cluster}", f"  mesh     = [{mesh}]",
              f"  train    = {train_text or '{ ' + ', '.join(train) + ' }'}"]
    if c.data_axis:
        over = c.data_axes[0] if len(c.data_axes) == 1 else f"[{', '.join(c.data_axes)}]"  # hsdp's two
        lines.append(f"  data     = {c.data_kind} over {over}"
                     + ir.gathering_text(_gathering(scored, problem), c.zero_stage))
    if c.tp > 1:
        lines.append("  tensor   = megatron over tp" + _tensor_options(problem, c.sequence_parallel))
    if c.cp > 1:
        lines.append(f"  context  = {problem.context} over cp" + (f" with implementation = {problem.ring}"
                                                                  if problem.context == "ring" and problem.ring != "te"
                                                                  else ""))
    if c.ep > 1:
        over = "[ep, tp]" if c.fold and c.tp > 1 else "ep"  # the candidate's: the problem's, or the search's choice
        lines.append(f"  experts  = {c.dispatcher} over {over}" + (" with overlap" if problem.overlap_experts else ""))
    if c.pp > 1:
        lines += stage_lines(scored, problem)
        lines.append(f"  schedule = {c.schedule}")
    elif c.schedule:
        lines.append(f"  # schedule {c.schedule} was pinned; with pp = 1 there is no pipeline to schedule")
    lines.append("}")
    return format_text("\n".join(lines).lstrip("\n") + "\n", "<generate>")


def written_from(source: Source, path: str | os.PathLike) -> Source:
    """The imports as the file `path` must spell them: a model file given by its path (`--model
    DIR/x.plan:m`) is named relative to the file's folder when it lies in that folder's tree, so the
    written plan checks as it is and moves with its folder; elsewhere it stays absolute (`outside`)."""
    base = Path(os.path.abspath(path)).parent.resolve()
    imports = []
    for name in source.imports:
        found = Path(name)
        if found.is_absolute() and found.resolve().is_relative_to(base):
            name = found.resolve().relative_to(base).with_suffix("").as_posix()
        imports.append(name)
    return Source(tuple(imports), source.model, source.cluster)


def outside(source: Source) -> tuple[str, ...]:
    """The folders of the imports a written plan reads only when they are named with `--include`."""
    return tuple(dict.fromkeys(os.path.dirname(i) for i in source.imports if os.path.isabs(i)))


def include_note(source: Source) -> str | None:
    """What to pass to check or run the written plan, when its model file lies outside its folder tree."""
    folders = outside(source)
    return (f"the plan imports from {', '.join(shlex.quote(f) for f in folders)}, outside its folder: check or "
            f"run it with {include_flags(folders)}") if folders else None


def checked_texts(result: SearchResult, problem: Problem, source: Source,
                  path: str | None = None) -> tuple[SearchResult, list[str]]:
    """The candidates whose plan text passes `plandsl check` (checked as the file `path` would be, with
    `--include` for the folders `include_note` names), and their texts (already in `plandsl fmt`'s
    layout); PlanError with the first one's diagnostics, marked as a bug, when none does."""
    where = str(path) if path else os.path.join(os.getcwd(), "generated.plan")
    source = written_from(source, where)
    kept, failure = [], None
    for scored in result.candidates:
        text = plan_text(scored, problem, source)
        with include(outside(source)):
            analysis = analyze(where, text=text)
        if analysis.ok:
            kept.append((scored, text))
        elif failure is None:
            failure = analysis
    if not kept:
        bug = Note("this is a bug of `plandsl generate`: the plan it wrote should check; please report it")
        raise PlanError([replace(d, notes=d.notes + (bug,)) for d in failure.errors], failure.sources)
    return SearchResult(tuple(s for s, _ in kept), result.stats), [t for _, t in kept]


def header(estimate) -> list[str]:
    """The predicted figures of a plan, as the comment lines above it (replaced when it is generated again)."""
    t, e = estimate.time, estimate
    capacity = min(e.capacity) if e.capacity else 0
    return ["# Generated by `plandsl generate` (cost model: docs/cost-model.md). Predicted:",
            f"#   step {t.step:.4g} s = compute {t.compute:.4g} + exposed communication {t.communication:.4g} "
            f"+ bubble {t.bubble:.4g} + optimizer {t.optimizer:.4g}",
            f"#   {e.tokens_per_s:,.0f} tokens/s, {e.tflops_per_device:.1f} TFLOP/s per device, MFU {e.mfu:.1%}",
            f"#   peak memory {format_bytes(e.peak_memory_bytes)} per device (of {format_bytes(capacity)})",
            *([f"#   batch shares: data rank {max(range(len(e.shares)), key=e.replica_steps.__getitem__)} the "
               f"slowest ({max(e.replica_steps):.4g} s with its tail), the fastest {min(e.replica_steps):.4g} s"]
              if e.shares else [])]


def stage_lines(scored: Scored, problem: Problem, axis: str = "pp") -> list[str]:
    """The candidate's stages (over `axis`) as plan lines: `stages = evenly ...` or a `stages { }` block."""
    c, counts = scored.candidate, scored.blocks
    info = BUILTIN[c.schedule]
    vshape = info.rank_map == "vshape"
    options = []
    if c.virtual_stages > 1:
        options.append(f"virtual = {c.virtual_stages}")
    if vshape:
        options.append("map = vshape")
    if problem.pipeline != "torch":  # whose pipeline, as the problem says it (torch's unless written)
        options.append(f"implementation = {problem.pipeline}")
    if problem.outputs != "dropped":  # what torch's pipeline does with the last stage's outputs, as the problem says
        options.append(f"outputs = {problem.outputs}")
    layers = layers_of(problem.model)
    transformer = isinstance(problem.model, ir.TransformerModel)
    if transformer and list(counts) == [len(p) for p in split_evenly(list(range(sum(counts))), len(counts))]:
        return [f"  stages   = evenly over {axis}" + (f" with {', '.join(options)}" if options else "")]
    # Megatron's split counting the embedding or the loss as a layer, where an end stage holds it alone (where every
    # stage holds a block, a `stages { }` block says it as before)
    counted = counted_split(counts) if transformer else None
    if counted:
        options.append(f"account = {'[' + ', '.join(counted) + ']' if len(counted) > 1 else counted[0]}")
        return [f"  stages   = evenly over {axis} with {', '.join(options)}"]
    lines = ["  stages {"] + ([f"    axis = {axis}"] if axis != "pp" else [])  # the options close the block
    if transformer:
        start = 0
        spans = []
        for count in counts:
            spans.append((start, start + count))
            start += count
        last = len(counts) - 1
        s = 0
        while s <= last:
            a, b = spans[s]
            held = [f"layers[{a}:{b}]"] if b > a else []  # none: the embedding or the norm and head alone
            if s == 0:
                lines.append("    0: " + ", ".join(["embed", *held] + (["norm", "head"] if last == 0 else [])))
                s += 1
                continue
            if s == last:
                lines.append(f"    {s}: " + ", ".join([*held, "norm", "head"]))
                break
            run = s
            while run + 1 < last and counts[run + 1] == counts[s]:
                run += 1
            if run > s:
                lines.append(f"    {s}..{run + 1}: layers[{a}:{spans[run][1]}]")
            else:
                lines.append(f"    {s}: layers[{a}:{b}]")
            s = run + 1
    else:
        start = 0
        for s, count in enumerate(counts):
            lines.append(f"    {s}: {', '.join(layer.name for layer in layers[start:start + count])}")
            start += count
    lines += [f"    {option}" for option in options] + ["  }"]
    return lines


# ---- JSON and text -----------------------------------------------------------------------------------------
Refusals = Callable[[ir.Plan], list]
"""Why `plandsl run` would refuse a plan (Diagnostics, empty when it runs): the interpreter's own rule,
`runtime.support.refusals`, which the caller passes in (the search sits below the interpreter). The cost
model ranks every plan; the interpreter runs most of them (docs/running.md, "Not supported yet")."""


def run_refusals(scored: Scored, refusals: Refusals) -> list[str]:
    """Why `plandsl run` would refuse the candidate's plan ("E703: ..."), empty when it runs."""
    return [f"{d.code}: {d.message}" for d in refusals(scored.plan)]


def candidate_json(scored: Scored, text: str, refusals: Refusals) -> dict:
    c, e = scored.candidate, scored.estimate
    refused = run_refusals(scored, refusals)
    return {"runs": not refused, "refused": refused, "degrees": c.degrees(), **c.degrees(), "mesh_order": list(c.mesh_order),
            "micro_batch_size": c.micro_batch_size, "num_microbatches": c.num_microbatches,
            "schedule": c.schedule or None, "virtual_stages": c.virtual_stages, "zero_stage": c.zero_stage,
            "data": c.data_kind.value if c.data_axis else None, **({"dp_shard": c.shard} if c.shard else {}),
            "recompute": c.recompute, "recompute_layers": c.recompute_layers,
            **({"offload_layers": c.offload_layers} if c.offload_layers else {}), "sequence_parallel": c.sequence_parallel,
            "fold": c.fold and c.tp > 1 and c.ep > 1, "dispatcher": c.dispatcher if c.ep > 1 else None,
            "layers_per_stage": list(scored.blocks),
            "step_time_s": e.time.step, "tokens_per_s": e.tokens_per_s, "tflops_per_device": e.tflops_per_device,
            "mfu": e.mfu, "peak_memory_bytes": e.peak_memory_bytes,
            "time": {"compute_s": e.time.compute, "communication_s": e.time.communication,
                     "bubble_s": e.time.bubble, "optimizer_s": e.time.optimizer},
            "plan": text}


def format_table(result: SearchResult) -> str:
    head = (f"{'#':>2} {'step s':>9} {'tokens/s':>11} {'TFLOP/s':>8} {'MFU':>6} {'memory':>10}  "
            f"{'dp':>4} {'tp':>3} {'pp':>3} {'cp':>3} {'ep':>3} {'mb':>3} {'m':>5}  {'schedule':<24} "
            f"{'zero':>4} {'recompute':<12} mesh")
    rows = [head]
    for i, s in enumerate(result.candidates, 1):
        c, e = s.candidate, s.estimate
        schedule = (c.schedule + (f" v={c.virtual_stages}" if c.virtual_stages > 1 else "")) if c.pp > 1 else "-"
        rows.append(f"{i:>2} {e.time.step:>9.4g} {e.tokens_per_s:>11,.0f} {e.tflops_per_device:>8.1f} "
                    f"{e.mfu:>6.1%} {format_bytes(e.peak_memory_bytes):>10}  {c.dp:>4} {c.tp:>3} {c.pp:>3} "
                    f"{c.cp:>3} {c.ep:>3} {c.micro_batch_size:>3} {_microbatches(s):>5}  {schedule:<24} "
                    f"{'hsdp' if c.shard else c.zero_stage:>4} {_recompute(c):<12} [{', '.join(c.mesh_order)}]")
    return "\n".join(rows)


def _described(scored: Scored) -> str:
    """The candidate's `describe()`, its `m=` the microbatches per data rank (`m=1-4` with uneven shares)."""
    text = scored.candidate.describe()
    return text.replace(f" m={scored.candidate.num_microbatches}", f" m={_microbatches(scored)}", 1) \
        if scored.estimate.shares else text


def _microbatches(scored: Scored) -> str:
    """The table's `m`: microbatches per data rank, `1-4` (fewest-most) with uneven `batch_shares`."""
    shares, mb = scored.estimate.shares, scored.candidate.micro_batch_size
    return f"{min(shares) // mb}-{max(shares) // mb}" if shares else str(scored.candidate.num_microbatches)


def _recompute(c: Candidate) -> str:
    """The recomputation as the table shows it: `full 3/st` recomputes the first 3 blocks of each stage, `none off
    40/st` offloads the first 40 blocks' activations to the host."""
    if c.offload_layers:
        return f"none off {c.offload_layers}/st"
    return c.recompute if c.recompute_layers is None else f"full {c.recompute_layers}/st"


_PARTS = (("compute", "compute"), ("communication", "communication"), ("bubble", "pipeline bubble"),
          ("optimizer", "optimizer step"))


def _closest(stats) -> str:
    """What came closest to fitting among the candidates memory ruled out (`SearchStats.memory_example`): the
    closest when its need is exact, else the lowest bound on any need; of those measured when some, over
    several stages, fit no split and have no figure."""
    if not stats.memory_example:
        return ""
    which = "the closest" if stats.memory_example_exact else "the lowest bound"
    if stats.memory_unsplit:
        return (f"; {which} of those measured: {stats.memory_example} ({stats.memory_unsplit:,} more fit no split of "
                "their blocks over their stages)")
    return f"; {which}: {stats.memory_example}"


def explain(result: SearchResult, refusals: Refusals) -> str:
    """Why the winner won: its own breakdown, what bounded the runners-up, what memory ruled out."""
    best = result.best
    t = best.estimate.time
    share = ", ".join(f"{label} {getattr(t, part) / t.step:.0%}" for part, label in _PARTS if t.step)
    lines = [f"why #1: {_described(best)}: {share} of its {t.step:.4g} s step."]
    for i, other in enumerate(result.candidates[1:], 2):
        o = other.estimate.time
        if o.step <= t.step * (1 + 1e-9):
            lines.append(f"  #{i} ties with #1 ({_described(other)}); it holds "
                         f"{format_bytes(other.estimate.peak_memory_bytes)} per device")
            continue
        worse = max(_PARTS, key=lambda p: getattr(o, p[0]) - getattr(t, p[0]))
        delta = getattr(o, worse[0]) - getattr(t, worse[0])
        lines.append(f"  #{i} is {o.step / t.step - 1:+.1%}: bounded by {worse[1]} "
                     f"({getattr(o, worse[0]):.4g} s against {getattr(t, worse[0]):.4g} s, {delta:+.3g} s)")
    refused = refusals(best.plan)
    if refused:
        runs = next((i for i, other in enumerate(result.candidates[1:], 2) if not run_refusals(other, refusals)), None)
        # none runs: the refusal's own remedy (a precision, a schedule), not a pin that need not touch it
        remedy = f": {refused[0].hint}" if refused[0].hint else ""
        lines.append(f"  note: `plandsl run` refuses #1 ({refused[0].code}: {refused[0].message})"
                     + (f"; #{runs} runs ({result.candidates[runs - 1].estimate.time.step / t.step - 1:+.1%})"
                        if runs else f"; none of the top runs{remedy}"))
    stats = result.stats
    if stats.memory_pruned:
        lines.append(f"  memory ruled out {stats.memory_pruned:,} candidate(s)"
                     + _closest(stats))
    lines.append(f"  searched {stats.roots:,} layouts x mesh orders, {stats.nodes:,} micro-batch/recompute "
                 f"choices, bounded {stats.leaves:,} schedules/ZeRO stages, simulated {stats.simulated} "
                 f"in {stats.seconds:.2f} s")
    if stats.stopped:
        lines.append(f"  note: the search stopped at its time limit ({stats.time_limit:g} CPU s) with "
                     f"{stats.roots_open:,} of {stats.roots:,} layouts x mesh orders not yet searched: these are the "
                     "fastest plans it simulated, not proven the fastest"
                     + (f" (no plan it left takes less than {stats.lower_bound:.4g} s a step)" if stats.lower_bound else "")
                     + "; --time-limit 0 searches to the end")
    return "\n".join(lines)


def explain_stopped(problem: Problem, stats) -> str:
    """No plan simulated before the time limit: what was searched, the closest, how to search on."""
    return (f"no plan of '{problem.model.name}' on '{problem.cluster.name}' found within the time limit "
            f"({stats.time_limit:g} CPU s): {stats.roots - stats.roots_open:,} of {stats.roots:,} layouts x mesh orders "
            f"searched, {stats.leaves:,} schedules/ZeRO stages bounded, none simulated that fits"
            + _closest(stats)
            + "; search longer with --time-limit SECONDS (0: until the search is done)")


# ---- when nothing runs ------------------------------------------------------------------------------------------
def explain_empty(problem: Problem, pins: dict, space) -> str:
    """A plain message: which constraint left nothing, and what would work."""
    model, cluster = problem.model, problem.cluster
    n = cluster.num_devices
    if not space.layouts():
        if any(k in pins for k in ("dp", "tp", "pp", "cp", "ep")):
            shown = ", ".join(f"{k}={v}" for k, v in pins.items() if k in ("dp", "tp", "pp", "cp", "ep"))
            return (f"no layout of the {n} devices of '{cluster.name}' matches the pins {shown} for model "
                    f"'{model.name}' and global batch {problem.global_batch} (tp must divide the heads, hidden, "
                    "ffn and vocabulary; cp the sequence; ep the experts; pp at most the blocks and the parts a pinned "
                    "account counts; dp x ep the "
                    "global batch)")
        replicas = sorted({dp * ep for dp, _, _, _, ep in space.layouts(check_batch=False)})
        shown = ", ".join(map(str, replicas[:8])) + (", ..." if len(replicas) > 8 else "")
        smallest = replicas[0] if replicas else n
        return (f"global batch {problem.global_batch} is not divisible by any data-parallel degree the layouts of "
                f"'{model.name}' on {n} devices allow (dp x ep in {{{shown}}}); use a global batch that is a "
                f"multiple of {smallest}, e.g. {smallest * max(1, -(-problem.global_batch // smallest))}")
    stats = space.stats
    if pins.get("data") == "hsdp" and not stats.roots:  # no layout left to split into replicas x shards
        shown = ", ".join(f"{k}={','.join(v) if isinstance(v, tuple) else v}" for k, v in pins.items())
        if not problem.hybrid:  # a `generate --from` plan's written mesh or data line of one data axis
            return (f"the plan writes one data axis (in its mesh or its data line), and hsdp (the pins {shown}) needs "
                    "two, its replicas and its shard axis (`data = hsdp over [replicas, shard]`): write both, or leave "
                    "the mesh and the data line to the search")
        shard = f"dp_shard={pins['dp_shard']}" if "dp_shard" in pins else "a shard axis"
        return (f"no layout of '{model.name}' on the {n} devices of '{cluster.name}' runs hsdp under the pins "
                f"({shown}): hsdp splits a data degree of 4 or more, with no "
                f"context or expert axis, into {shard} that divides it and two replicas or more, whose model states "
                "fit; pin a smaller tp or pp, or leave `data` to the search")
    if stats.tp_across_nodes and not stats.roots:
        detail = ", ".join(f"{k}={','.join(v) if isinstance(v, tuple) else v}" for k, v in pins.items())
        return (f"every mesh order the pins ({detail}) leave puts a tensor-parallel group across nodes of "
                f"'{cluster.name}', and tensor parallelism stays inside a node (its all-reduces are on every "
                "layer's critical path): put tp innermost in the order, or allow it with --pin tp_across_nodes=true")
    fold = space.problem.fold_experts  # a searched folding's variant roots only ep > 1 (`Space.roots`)
    if problem.overlap_experts and not stats.roots and all(ep * (tp if fold else 1) == 1
                                                           for _, tp, _, _, ep in space.layouts()):
        detail = ", ".join(f"{k}={','.join(v) if isinstance(v, tuple) else v}" for k, v in pins.items()) or "none"
        experts, plural = getattr(model, "experts", 0), lambda count: "" if count == 1 else "s"
        return (f"`experts = ... with overlap` needs an expert group of more than one rank (E419: Megatron-Core's "
                "overlap is 'only supported with expert model parallelism'), and every layout of "
                f"'{model.name}' ({experts} expert{plural(experts)}) on the {n} device{plural(n)} of '{cluster.name}' "
                f"under the pins ({detail}) has one expert rank (ep divides the experts and the devices the other "
                "degrees leave): free a degree pin to leave room for ep, or drop `with overlap`")
    if stats.memory_pruned and not stats.invalid:
        states = _states_bytes(problem)
        capacity = sum(d.usable_memory for d in cluster.devices_in_order())
        pinned = f" with the pins {', '.join(f'{k}={v}' for k, v in pins.items())}" if pins else ""
        what = f"its weights, gradients and {'Adam' if problem.optimizer is ir.Optimizer.adam else 'SGD'} states"
        head = (f"model '{model.name}' ({format_count(param_count(model))} parameters) does not fit on cluster "
                f"'{cluster.name}' ({n} x {format_bytes(cluster.devices_in_order()[0].memory)}){pinned} in any layout: ")
        if states <= capacity:  # the states fit over every device: what a step holds beside them does not
            return (head + f"{what} need {format_bytes(states)} of the {format_bytes(capacity)} its devices hold for "
                    "tensors (ZeRO-3 over all of them), and no layout holds them with what training keeps beside them "
                    "(activations, the working set, gathered units)" + _closest(stats)
                    + f". Run generate on a larger cluster ({_smallest_cluster(problem, states)[1]} or more)"
                    + (" or with fewer pins" if pins else ""))
        text, _ = _smallest_cluster(problem, states)
        return (head + f"{what} alone need {format_bytes(states)}" + _closest(stats)
                + f". {text}; on this cluster a model of at most "
                f"~{format_count(capacity / problem.states.per_param(problem.optimizer))} parameters could hold its states")
    detail = ", ".join(f"{k}={v}" for k, v in pins.items()) or "none"
    return (f"no plan of '{model.name}' on '{cluster.name}' satisfies the pins ({detail}): the schedules need "
            "enough microbatches (1f1b-like: any; zb_h1/zb_h2/zbv: >= pp; dualpipev: >= 2 pp; chimera: an even pp "
            "and a multiple of pp; interleaved: rounds of pp), and stages need blocks")


def _states_bytes(problem: Problem) -> float:
    """Weights, gradients and optimizer states of the whole model at the problem's dtypes (16 bytes a
    parameter for fp32 Adam: `cost.memory.StateBytes`)."""
    return param_count(problem.model) * problem.states.per_param(problem.optimizer)


def _smallest_cluster(problem: Problem, states: float) -> tuple[str, str]:
    """The fewest nodes (of this cluster's largest node type), and more than it has, whose memory holds the model
    states with ZeRO-3 over every device: arithmetic, not a search of larger clusters in turn (which took
    seconds to minutes). Activations need more, so it is a lower bound, said as one. (The sentence, the cluster.)"""
    cluster = problem.cluster
    group = max(cluster.groups, key=lambda g: g.node.devices * g.node.device.usable_memory)
    node = group.node
    least = max(cluster.num_nodes + 1, math.ceil(states / (node.devices * node.device.usable_memory)))
    return (f"Its states alone need at least {node.name} x {least:,} ({least * node.devices:,} devices, ZeRO-3 over "
            f"all of them); activations need more: run generate on a cluster at least that large",
            f"{node.name} x {least:,}")


__all__ = ["Source", "resolve_problem", "plan_text", "checked_texts", "written_from", "include_note", "header", "stage_lines", "candidate_json", "format_table", "explain", "explain_empty",
           "explain_stopped",
           "stdlib_names"]
