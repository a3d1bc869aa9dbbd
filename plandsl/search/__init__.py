"""Search: the fastest plans for a model on a cluster under the cost model (`plandsl generate`).

Stage: after the cost model. Contract: `search(problem, pins, top)` returns the `top` candidates
with the lowest predicted step time that fit in memory, best first, each with its `PlanEstimate`
(`cost.estimate`, the same figures `plandsl estimate` prints for the emitted plan) and its
`ir.Plan`; a `SearchError` (a ValueError) with a plain message when nothing can run.

The space (`Candidate`): every factorisation of the device count into dp x tp x pp x cp x ep that
the model's shapes allow (tp divides heads, kv heads, hidden, ffn and vocabulary; cp the sequence;
ep the experts; pp at most the blocks; dp x ep the global batch), every order of the mesh axes that
places the groups differently on the nodes, micro-batch sizes dividing the per-replica batch, the
built-in schedules with their virtual stages (Chimera only when pinned: it holds two stages' weights
per rank, which the memory model does not count), ZeRO stages 0-3 over one data axis and hsdp (`data = hsdp over
[dp_rep, dp]`: ZeRO-3 within a shard axis of a node's data ranks or 2, 4, ... times that, replicas across; roots of
their own, `choices.hybrid_orders`), recomputation none/selective/selective_op/full,
and full for the first N blocks of each stage where memory binds (`recompute_layers`, N the least that fits), and
without a pipeline, where memory binds, the first N blocks' activations offloaded to the host instead (`offload_layers`,
N the least that fits, recompute none: Megatron's --cpu-offloading-num-layers); for a
mixture of experts whose problem leaves them to it (`Problem.search_experts`), the experts folded over tp or not and
the alltoall, deepep or hybridep dispatcher (`experts_variants`: one `Space` each, their roots under one heap).
Blocks go to stages by `partition_blocks` (the fewest seconds on the slowest stage, within memory).

Best-first branch and bound (Land & Doig 1960): a root (layout, mesh order) and a node (plus
micro-batch, recomputation) bound every plan below by the work spread perfectly over the ranks; a leaf (plus ZeRO stage
and schedule) by each rank's work after the first microbatch reached it and before the last
gradient flows back, plus its exposed reduction and optimizer step. Memory prunes before any
timing; a leaf is simulated only while its bound is below the k-th best simulated step, so the
result is the top k of brute force (tests/unit/test_search.py checks it).
"""
from __future__ import annotations

import dataclasses
import functools
import gc
import heapq
import itertools
import math
import time
from typing import Callable, Iterable, Mapping

from plandsl import ir
from plandsl.cost.compute import Efficiency
from plandsl.schedules.registry import BUILTIN
from plandsl.search.choices import AXES, RECOMPUTE, divisors, schedule_choices
from plandsl.search.emit import explain_empty, explain_stopped
from plandsl.search.problem import (CONTEXT, Candidate, Problem, Scored, SearchError, SearchResult, SearchStats,
                                    build_plan)
from plandsl.search.partition import partition_blocks, partition_layers
from plandsl.search.space import Space
from plandsl.search.tree import SAFE, Leaf, Node, Pending, Root, candidate_of
from plandsl.check.training import absent_module
from plandsl.diagnostics import did_you_mean, limits

PIN_KEYS = ("dp", "tp", "pp", "cp", "ep", "micro_batch_size", "num_microbatches", "schedule",
            "virtual_stages", "zero_stage", "recompute", "recompute_layers", "order", "tp_across_nodes", "fold",
            "dispatcher", "account", "offload_layers", "recompute_modules", "sequence_parallel", "data", "dp_shard")
DISPATCHERS = ("alltoall", "deepep", "hybridep")  # `experts = KIND over ...` (ir.ExpertParallel.kind)
# The search tries each unpinned, on every layout with an expert group (`Space.roots`); at equal figures it writes the
# one it reaches first.
SEARCHED_DISPATCHERS = DISPATCHERS
# Under a time limit, the first dive (no plan yet) a quarter of the way in and a dive every sixteenth of the limit after
# each plan found, timed as under at most this limit (the default): a longer limit runs the default's search first and
# then goes on, so it returns no slower plan than the default's for want of the same dives
DIVE_LIMIT = limits.GENERATE_SECONDS
# A dive leaves to the heap every child bounded at or above DIVE_SLACK x the heap's lowest bound (doubled each time
# that leaves it nothing before its first plan), or at or above the fastest plan simulated so far
DIVE_SLACK = 1.5
# Tensor parallelism stays inside a node unless pinned otherwise: its all-reduces sit on every layer's
# critical path (Narayanan et al. 2021, Sec. 3.3: "tensor model parallelism ... within a multi-GPU
# server"), where a node's link is an order of magnitude faster than the fabric.
PIN_ALIASES = {"mb": "micro_batch_size", "micro_batch": "micro_batch_size", "microbatches": "num_microbatches",
               "m": "num_microbatches", "virtual": "virtual_stages", "zero": "zero_stage", "shard": "dp_shard"}
# ---- pins -------------------------------------------------------------------------------------------------
def parse_pins(pins: Mapping[str, object] | Iterable[str] | None) -> dict[str, object]:
    """`{"tp": "8", ...}` or `["tp=8", ...]` -> typed pins; SearchError for unknown keys or values."""
    if pins is None:
        return {}
    items = pins.items() if isinstance(pins, Mapping) else (_split_pin(p) for p in pins)
    items = [(k, ",".join(v) if isinstance(v, (tuple, list)) else v) for k, v in items]
    typed: dict[str, object] = {}
    for raw_key, raw in items:
        key = PIN_ALIASES.get(str(raw_key).strip(), str(raw_key).strip())
        if key not in PIN_KEYS:
            hint = did_you_mean(key, PIN_KEYS, "pins")
            raise SearchError(f"unknown pin '{raw_key}'" + (f"; {hint}" if hint else "")
                              + f" (pins: {', '.join(PIN_KEYS)})", code="E804")
        value = str(raw).strip()
        if key == "schedule":
            if value not in BUILTIN and value != "none":
                raise SearchError(f"unknown schedule '{value}' in --pin schedule; the built-in ones are "
                                  f"{', '.join(BUILTIN)}", code="E804")
        elif key == "recompute":
            if value not in RECOMPUTE:
                raise SearchError(f"--pin recompute={value}: recompute is one of {', '.join(RECOMPUTE)}", code="E804")
        elif key in ("tp_across_nodes", "fold", "sequence_parallel"):
            if value.lower() not in ("true", "false", "yes", "no", "1", "0"):
                raise SearchError(f"--pin {key}={raw}: true or false", code="E804")
            value = value.lower() in ("true", "yes", "1")
        elif key == "dispatcher":
            if value not in DISPATCHERS:
                raise SearchError(f"--pin dispatcher={raw}: the experts' dispatcher is one of {', '.join(DISPATCHERS)}",
                                  code="E804")
        elif key == "account":  # the parts counted as layers of the split (`stages = evenly ... with account`)
            named = {a.strip() for a in value.split(",") if a.strip()}
            parts = named - {"none"}
            if not parts <= set(ir.PIPELINE_ACCOUNTED) or (named and named != (parts or {"none"})):  # "": none
                raise SearchError(f"--pin account={raw}: the parts the stages' split counts as layers, among "
                                  f"{', '.join(ir.PIPELINE_ACCOUNTED)} (comma-separated), or none", code="E804")
            value = tuple(part for part in ir.PIPELINE_ACCOUNTED if part in parts)
        elif key == "recompute_modules":  # what `recompute: selective` reruns (Megatron's --recompute-modules)
            value = tuple(dict.fromkeys(m.strip() for m in value.split(",") if m.strip()))
            known = tuple(m.value for m in ir.RecomputeModule)
            if not value or not set(value) <= set(known):
                raise SearchError(f"--pin recompute_modules={raw}: comma-separated modules among {', '.join(known)}",
                                  code="E804")
        elif key == "data":  # the data clause's kind (`ir.DataKind`, or a spelling the language takes: ddp, fsdp)
            kind = ir.DATA_KIND_SPELLINGS.get(value) or next((k for k in ir.DataKind if k.value == value), None)
            if kind is None:
                raise SearchError(f"--pin data={raw}: the data-parallel kind is one of "
                                  f"{', '.join(k.value for k in ir.DataKind)}", code="E804")
            value = kind.value
        elif key == "order":
            value = tuple(a.strip() for a in value.split(",") if a.strip())
            if len(set(value)) != len(value) or not set(value) <= set(AXES):
                raise SearchError(f"--pin order={raw}: a comma-separated order of distinct axes among "
                                  f"{', '.join(AXES)}, outermost first", code="E804")
        else:
            try:
                value = int(value)
            except ValueError:
                raise SearchError(f"--pin {key}={raw}: {key} is a whole number", code="E804") from None
            stages = ir.ZERO_STAGES
            least = 0 if key == "offload_layers" else 2 if key == "dp_shard" else 1  # offload_layers=0: never offload
            if (key == "zero_stage" and value not in stages) or (key != "zero_stage" and value < least):
                raise SearchError(f"--pin {key}={raw}: {key} is " + (
                    f"{', '.join(map(str, stages[:-1]))} or {stages[-1]}" if key == "zero_stage" else
                    f"at least {least}"), code="E804")
        if key in typed and typed[key] != value:
            raise SearchError(f"contradictory pins: {key}={typed[key]} and {key}={raw}", code="E805")
        typed[key] = value
    return _data_pins(typed)


def _data_pins(typed: dict[str, object]) -> dict[str, object]:
    """The data pins made one: `dp_shard` (hsdp's shard axis) is `data` hsdp, and `data` its ZeRO stage (hsdp's 3);
    SearchError where they contradict. A pinned `zero_stage` alone is the kind of that stage over one data axis
    (`ir.DataKind.of_zero_stage`: 3 is zero3, not hsdp); hsdp is searched where `data` is pinned to it or neither is
    pinned (`Space._hybrid`)."""
    if "dp_shard" in typed:
        if typed.setdefault("data", "hsdp") != "hsdp":
            raise SearchError(f"contradictory pins: dp_shard={typed['dp_shard']} is hsdp's shard axis, "
                              f"data={typed['data']}", code="E805")
    if "data" in typed:
        stage = ir.DataKind(typed["data"]).zero_stage
        if typed.setdefault("zero_stage", stage) != stage:
            raise SearchError(f"contradictory pins: data={typed['data']} is ZeRO stage {stage}, "
                              f"zero_stage={typed['zero_stage']}", code="E805")
    return typed


def with_modules(problem: Problem, pins: dict[str, object]) -> tuple[Problem, dict[str, object]]:
    """The pin `recompute_modules` as the problem's (every plan then writes it, as `kernels`) and `recompute` pinned
    to selective, the only mode that reruns by module; SearchError where the plan it would write is refused (E516,
    E517). The search does not choose modules itself."""
    modules = pins.get("recompute_modules")
    if modules is None:
        return problem, pins
    if pins.get("recompute", "selective") != "selective" or "recompute_layers" in pins:
        raise SearchError(f"contradictory pins: recompute_modules={','.join(modules)} names what `recompute: selective` "
                          f"reruns, recompute={pins.get('recompute', 'full')}", code="E805")
    problem = dataclasses.replace(problem, recompute_modules=tuple(ir.RecomputeModule(m) for m in modules))
    for module in problem.recompute_modules:
        why = absent_module(problem.model, module)
        if why:
            raise SearchError(f"--pin recompute_modules: {module.value} has nothing to rerun: {why} (E516)",
                              code="E805")
    if {"layernorm", "moe_act"} & set(modules) and problem.training(recompute=ir.Recompute.selective).recipe \
            is ir.Fp8Recipe.delayed:
        raise SearchError("--pin recompute_modules: layernorm and moe_act under FP8 delayed scaling, which "
                          "Megatron-Core refuses (E517); give the plan fp8_recipe: current", code="E805")
    return problem, {**pins, "recompute": "selective"}


def _split_pin(text: str) -> tuple[str, str]:
    key, sep, value = str(text).partition("=")
    if not sep or not key.strip():
        raise SearchError(f"pin '{text}' is not KEY=VALUE (e.g. tp=8)", code="E804")
    return key, value


def fixed_virtual(schedule: str) -> int | None:
    """The stages per rank a built-in schedule runs where it fixes them (1F1B and GPipe one, the V-shapes two, a
    schedule of two pipelines one each), else None (the looped schedules take any count)."""
    info = BUILTIN[schedule]
    return 1 if info.pipelines == 2 else {"one": 1, "two": 2}.get(info.virtual)


def pins_conflict(problem: Problem, pins: Mapping[str, object] | Iterable[str] | None) -> SearchError | None:
    """The SearchError the pins raise before any search (`search` checks them first: their values, the runtimes'
    refusals, `check_pins` against each experts' variant), else None; cheap, no space is built."""
    try:
        pins = parse_pins(pins)
        problem, pins = with_modules(problem, pins)
        _megatron_runs(problem, pins)
        _overlap_recomputes(problem, pins)
        _variants(problem, pins)
    except SearchError as error:
        return error
    return None


def _variants(problem: Problem, pins: Mapping[str, object]) -> list[tuple[Problem, tuple[bool, bool]]]:
    """The experts' variants (`experts_variants`) the pins do not contradict (`check_pins`); the first's SearchError
    where they contradict every one."""
    kept, errors = [], []
    for variant, chosen in experts_variants(problem, pins):
        try:
            check_pins(variant, pins)
        except SearchError as error:
            errors.append(error)
            continue
        kept.append((variant, chosen))
    if not kept:
        raise errors[0]
    return kept


def _placed(rank_map) -> str:
    """How a map places the stages on the ranks, in words: `loop`, `vshape`, or a list of each stage's rank."""
    if isinstance(rank_map, tuple):
        return f"as [{', '.join(map(str, rank_map))}]"
    return "in a V" if rank_map == "vshape" else "in a loop"


def _stages_written(problem: Problem) -> str:
    """What the plan's kept placement is, as the user wrote it: a `stages { }` block or a `stages = ...` line."""
    return "block" if problem.stages_block else "line"


def check_pins(problem: Problem, pins: Mapping[str, object]) -> None:
    """Contradictions the pins carry on their own (before any search)."""
    n = problem.cluster.num_devices
    degrees = {k: pins[k] for k in ("dp", "tp", "pp", "cp", "ep") if k in pins}
    if problem.fold_experts and "ep" in degrees:  # the pinned expert group counts the tensor axis folded into it
        axis, rest = divmod(degrees["ep"], degrees.get("tp", 1))
        degrees.pop("ep") if rest else degrees.update(ep=axis)
    product = math.prod(degrees.values()) if degrees else 1
    shown = " * ".join(f"{k}({v})" for k, v in degrees.items())
    if degrees and (n % product or (len(degrees) == 5 and product != n)):
        raise SearchError(f"contradictory pins: {shown} = {product}, which "
                          + (f"does not divide the {n} devices" if n % product else f"!= {n} devices")
                          + f" of cluster '{problem.cluster.name}'", code="E805")
    if pins.get("data") == "hsdp":  # over [replica, shard] axes alone: no context or expert axis (the checker's)
        shard, dp = pins.get("dp_shard"), pins.get("dp")
        if pins.get("cp", 1) > 1 or pins.get("ep", 1) > 1:
            raise SearchError(f"contradictory pins: data=hsdp runs with no context or expert axis, "
                              f"{'cp' if pins.get('cp', 1) > 1 else 'ep'}={pins.get('cp', 1) * pins.get('ep', 1)}",
                              code="E805")
        if shard is not None and dp is not None and (dp % shard or shard >= dp):
            raise SearchError(f"contradictory pins: dp_shard={shard} is hsdp's shard axis, which divides dp={dp} and "
                              "leaves at least two replicas", code="E805")
    smallest_node = min(group.node.devices for group in problem.cluster.groups)
    if pins.get("tp", 1) > smallest_node and not pins.get("tp_across_nodes"):
        raise SearchError(f"--pin tp={pins['tp']}: tensor parallelism stays inside a node (its all-reduces are on "
                          f"every layer's critical path), and the nodes of cluster '{problem.cluster.name}' hold "
                          f"{smallest_node} devices; pin tp to at most {smallest_node}, or allow it with "
                          "--pin tp_across_nodes=true", code="E805")
    schedule = pins.get("schedule")
    virtual = pins.get("virtual_stages")
    if schedule and schedule != "none" and virtual is not None:
        wanted = fixed_virtual(schedule)
        if wanted is not None and virtual != wanted:
            raise SearchError(f"contradictory pins: schedule {schedule} runs {wanted} stage(s) per rank, "
                              f"virtual_stages={virtual}", code="E805")
    if schedule in BUILTIN and pins.get("pp", 2) > 1 and problem.stage_map is not None:
        # a kept stages line's or block's map (`Problem.runs_map`): a schedule that places the stages otherwise is the
        # checker's E409 beside it (it was every layout's "the schedules need enough microbatches", `explain_empty`)
        stage_map = problem.stage_map
        pp = max(stage_map) + 1 if isinstance(stage_map, tuple) else pins.get("pp", 2)
        count = len(stage_map) // pp if isinstance(stage_map, tuple) else 2 if stage_map == "vshape" else \
            virtual or fixed_virtual(schedule) or 2
        if not problem.runs_map(schedule, pp, count):
            raise SearchError(f"contradictory pins: schedule={schedule} places the stages on the ranks "
                              f"{_placed(BUILTIN[schedule].rank_map)}, and the kept stages "
                              f"{_stages_written(problem)}'s map places them "
                              f"{_placed(stage_map)} (the checker's E409)", code="E805")
    if all(k in pins for k in ("micro_batch_size", "num_microbatches")):
        per_replica = pins["micro_batch_size"] * pins["num_microbatches"]
        if problem.global_batch % per_replica:
            raise SearchError(f"contradictory pins: micro_batch_size({pins['micro_batch_size']}) * "
                              f"num_microbatches({pins['num_microbatches']}) = {per_replica} does not divide "
                              f"the global batch {problem.global_batch}", code="E805")
    if "recompute_layers" in pins and pins.get("recompute", "full") != "full":
        raise SearchError(f"contradictory pins: recompute_layers={pins['recompute_layers']} counts the blocks of each "
                          f"stage that `recompute: full` reruns, recompute={pins['recompute']}", code="E805")
    if pins.get("sequence_parallel") and pins.get("tp", 1) > 1 and problem.deepspeed_engine(pins.get("pp")):
        # every layout left out: the reason was said as the schedules'
        beside = f" beside pp={pins['pp']}" if pins.get("pp", 1) > 1 else \
            f", at any pp where the plan's stages {_stages_written(problem)} names it"
        raise SearchError(f"contradictory pins: sequence_parallel=true, and DeepSpeed's pipeline engine (--pipeline "
                          f"deepspeed) runs no sequence parallelism{beside} (E611)", code="E805")
    if problem.stages_kept and pins.get("virtual_stages", 1) > 1 and pins.get("pp") == 1:  # (`Space.roots`)
        raise SearchError(f"contradictory pins: virtual_stages={pins['virtual_stages']} of a kept stages "
                          f"{_stages_written(problem)} needs a schedule that runs them, which pp=1 lays out none of",
                          code="E805")
    stages = pins.get("pp", 1) * pins.get("virtual_stages", 1)
    if problem.split == "evenly" and "pp" in pins and not pins.get("account") \
            and isinstance(problem.model, ir.TransformerModel) and stages > problem.model.layers:
        # a kept `evenly` line gives every stage a block (`Splits.fixed`): else every schedule is left out, unsaid
        raise SearchError(f"contradictory pins: pp={pins['pp']} with virtual_stages={pins.get('virtual_stages', 1)} is "
                          f"{stages} stages, more than the model's {problem.model.layers} blocks, and the kept "
                          "`evenly` line gives each stage one at least", code="E805")
    if isinstance(problem.model, ir.TransformerModel) and pins.get("recompute_layers", 0) > problem.model.layers:
        # the plan written would be the checker's E205 (and past MAX_LAYERS its E505)
        raise SearchError(f"contradictory pins: recompute_layers={pins['recompute_layers']} is more than the model's "
                          f"{problem.model.layers} blocks", code="E805")
    if pins.get("offload_layers"):  # megatron-core offloads without recomputation and without a pipeline (E512, E513)
        offloaded = pins["offload_layers"]
        if pins.get("recompute", "none") != "none" or "recompute_layers" in pins:
            raise SearchError(f"contradictory pins: offload_layers={offloaded} keeps the blocks' activations on the "
                              f"host, recompute={pins.get('recompute', 'full')} recomputes them", code="E805")
        if pins.get("pp", 1) > 1:
            raise SearchError(f"contradictory pins: offload_layers={offloaded} is searched without a pipeline "
                              f"(as megatron-core offloads), pp={pins['pp']}", code="E805")
        if problem.stages_kept and pins.get("virtual_stages", 1) > 1:  # a pipeline of two ranks or more (`Space.roots`)
            raise SearchError(f"contradictory pins: offload_layers={offloaded} is searched without a pipeline "
                              f"(as megatron-core offloads), and virtual_stages={pins['virtual_stages']} of a kept "
                              f"stages {_stages_written(problem)} needs one", code="E805")
        blocks = getattr(problem.model, "layers", None)
        if isinstance(problem.model, ir.TransformerModel) and offloaded > blocks:
            raise SearchError(f"contradictory pins: offload_layers={offloaded} is more than the model's {blocks} "
                              f"blocks", code="E805")
    if "order" in pins:
        named = [a for a in pins["order"]]
        for axis in named:  # dp of size 1 may lead the order: it carries ZeRO over a context axis (`mesh_order`)
            if axis in pins and pins[axis] == 1 and not (axis == "dp" and pins.get("cp", 1) > 1):
                raise SearchError(f"contradictory pins: order names '{axis}', pinned to size 1 "
                                  "(the order lists the axes of size > 1)", code="E805")


def experts_variants(problem: Problem, pins: Mapping[str, object]) -> list[tuple[Problem, tuple[bool, bool]]]:
    """The problems the search runs for the experts' choices, each with whether the search chose its (fold,
    dispatcher) (`Space`'s `chosen`): for a mixture of experts whose problem searches them (`search_experts`),
    the experts folded over tp or not (Megatron-Core's MoE parallel folding) and each searched dispatcher, unless
    pinned; else the problem's own, which a pin must agree with (SearchError)."""
    if not getattr(problem.model, "experts", 0):
        return [(problem, (False, False))]
    if not problem.search_experts:
        for key, given in (("fold", problem.fold_experts), ("dispatcher", problem.dispatcher)):
            if key in pins and pins[key] != given:
                raise SearchError(f"contradictory pins: {key}={str(pins[key]).lower()}, where the plan's experts "
                                  f"clause gives {str(given).lower()}", code="E805")
        return [(problem, (False, False))]
    folds = [pins["fold"]] if "fold" in pins else [False, True]
    kinds = [pins["dispatcher"]] if "dispatcher" in pins else list(SEARCHED_DISPATCHERS)
    return [(dataclasses.replace(problem, fold_experts=fold, dispatcher=kind, search_experts=False),
             ("fold" not in pins, "dispatcher" not in pins)) for fold in folds for kind in kinds]


def _spaces(problem: Problem, pins: Mapping[str, object], efficiency: Efficiency | None) -> list[Space]:
    """One space per experts' variant (`experts_variants`), sharing their counters; the pins checked against each
    (a pinned ep counts the folded group): a variant they contradict is left out, and if every one is, the first's
    SearchError is raised."""
    stats, shared = SearchStats(), {}
    return [Space(variant, pins, efficiency, stats, chosen, shared) for variant, chosen in _variants(problem, pins)]


# ---- the search ---------------------------------------------------------------------------------------------------
def _collector_paused(function: Callable) -> Callable:
    """`function` with Python's cyclic garbage collector paused (and restored after): a search makes
    ~10^5 acyclic records (nodes, stage times, heap entries) that live until it returns, and the
    collector's passes over them took 13 % of a 6,144-GPU search. Reference counting still frees
    everything else as it goes; anything cyclic is collected after."""
    @functools.wraps(function)
    def paused(*args, **kwargs):
        enabled = gc.isenabled()
        gc.disable()
        try:
            return function(*args, **kwargs)
        finally:
            if enabled:
                gc.enable()
    return paused


@_collector_paused
def search(problem: Problem, pins: Mapping[str, object] | Iterable[str] | None = None, top: int = 5,
           efficiency: Efficiency | None = None,
           progress: Callable[[int, int], None] | None = None, explain: bool = True,
           first: bool = False, time_limit: float | None = None) -> SearchResult:
    """The `top` fastest candidates that fit, best first (exactly those brute force ranks first);
    `first`: the first candidate found that fits, not the best (whether any does). SearchError when
    none does, saying why (`explain`; without it, only that none does).

    `time_limit`: CPU seconds after which the search stops where it is (`stats.stopped`) and returns the
    fastest plans it has simulated, which fit but are not proven the fastest; with none simulated
    yet, a SearchError saying so. The work of a step is bounded (one root, node or leaf), so the
    search ends within the limit plus one step, whatever the model, cluster or batch."""
    started = time.perf_counter()
    # The limit counts this process's CPU seconds, not the wall clock: on a machine shared with other
    # jobs, the same search stops at the same place (it is the wall time on an idle one).
    cpu = time.process_time()
    deadline = cpu + time_limit if time_limit else math.inf
    pins = parse_pins(pins)
    problem, pins = with_modules(problem, pins)
    _megatron_runs(problem, pins)
    _overlap_recomputes(problem, pins)
    spaces = _spaces(problem, pins, efficiency)
    space = spaces[0]  # the problem's own (or its first variant's): what an empty search explains
    space.stats.time_limit = time_limit or None
    rooted = [(root, each) for each in spaces for root in each.roots()]
    roots = [root for root, _ in rooted]
    space.stats.roots = len(roots)
    counter = itertools.count()
    # The roots' bounds count their compute alone until the search reaches them (`Space.tighten_root` then adds their
    # links' communication and drops a layout whose model states cannot fit): they wait in `loose`, and the lowest is
    # tightened into the heap whenever it sits below the heap's lowest, so the heap pops in the order it would with
    # every root tight, and the dives (which read the heap's lowest bound) see tight bounds only.
    loose: list = [(root.bound, next(counter), root, each) for root, each in rooted]
    heapq.heapify(loose)
    heap: list = []
    results: list[Scored] = []
    done = 0
    # Under a time limit, a search that has simulated no plan a quarter of the way in (of `DIVE_LIMIT` at most)
    # dives: it takes the lowest-bound child of what it expanded last (depth first) until a plan fits, so the
    # limit finds it with a plan to show. Each plan that fits schedules the next dive a sixteenth of the limit
    # later.
    # Where the bounds sit far below the steps (a mixture of experts' all-to-alls), best-first order
    # reaches no other plan within the limit, and the dives sample the space's most promising parts in
    # turn: they start in turn from the heap's lowest entry (a part of the space not yet reached, as a rule)
    # and from the lowest-bound leaf or node's pending leaves that the search has made (`deep`; their
    # bounds count ZeRO's traffic, the schedule and the split, where a root's and a node's count the
    # compute alone: the most promising of the parts reached), and a dive leaves to the heap every child
    # that cannot beat the fastest plan simulated, or that sits far above the heap's lowest bound
    # (`DIVE_SLACK`): a layout whose memory leaves it only ZeRO-3's traffic every microbatch is not
    # simulated for want of a better one. Every child also stays on the heap (an entry taken by a
    # dive is skipped when popped), so the order changes and the result of a finished search does not.
    dive_at = cpu + min(time_limit, DIVE_LIMIT) / 4 if time_limit else math.inf
    stack: list = []
    deep: list = []  # under a time limit, the Pending and Leaf entries also on the heap: where dives start
    taken: set[int] = set()  # under a time limit, the entries popped or dived into (by their counters)
    slack = DIVE_SLACK
    dives = 0
    fastest = math.inf  # the fastest plan simulated so far
    clock = _cpu_clock(cpu) if time_limit else lambda: cpu  # without a limit nothing reads it
    while (heap or stack or loose) and len(results) < top:
        now = clock()
        if now > deadline:
            _stop(space.stats, heap + loose, results, top, taken)
            break
        diving = now > dive_at
        if loose and not (diving and stack) and (not heap or loose[0][0] < heap[0][0]):
            _, count, root, each = heapq.heappop(loose)
            if each.tighten_root(root) is not None:
                heapq.heappush(heap, (root.bound, count, root, each))
            continue
        if diving and not stack:  # a dive starts: every other one from the most promising partitioned entry
            while heap and heap[0][1] in taken:  # (what a dive took: not a start)
                heapq.heappop(heap)
            dives += 1
            while deep and deep[0][1] in taken:
                heapq.heappop(deep)
            if dives % 2 == 0 and deep and deep[0][0] < fastest:
                stack.append(heapq.heappop(deep))
        if diving and stack:
            entry = stack.pop()
            taken.add(entry[1])
        elif heap:
            entry = heapq.heappop(heap)
            if entry[1] in taken:
                continue
            if time_limit:
                taken.add(entry[1])
        else:
            break
        item, space = entry[2], entry[3]
        if isinstance(item, Root):
            done += 1
            if progress:
                progress(done, len(roots))
            children = space.expand_root(item)
        elif isinstance(item, Node) and not item.tight:
            children = [space.tighten(item)]
        elif isinstance(item, Node):
            pending = space.pending(item)
            children = [pending] if pending is not None else []
        elif isinstance(item, Pending):
            children = [child for child in space.resolve(item) if child is not None]
        elif isinstance(item, Leaf) and not item.exact:
            children = [space.finish(item)]
        elif isinstance(item, Leaf):
            scored = space.evaluate(item)
            children = []
            if scored is not None and first:
                results.append(scored)
                break
            if scored is not None:
                fastest = min(fastest, scored.estimate.time.step)
                stack.clear()
                dive_at = now + min(time_limit, DIVE_LIMIT) / 16 if time_limit else math.inf  # the next dive
                heapq.heappush(heap, (scored.estimate.time.step, next(counter), scored, space))
            else:  # a partly recomputed leaf the exact estimate refused: at its next N, bounded anew (`Space.retry`)
                children = [child for child in (space.retry(item),) if child is not None]
        else:
            results.append(item)
            continue
        entries = [(child.bound, next(counter), child, space) for child in children]
        for child_entry in entries:
            heapq.heappush(heap, child_entry)
            if time_limit and isinstance(child_entry[2], (Pending, Leaf)):
                heapq.heappush(deep, child_entry)
        if diving:  # the lowest bound on top
            ceiling = min(fastest, slack * heap[0][0]) if heap else fastest
            kept = [e for e in entries if e[0] < ceiling]
            if entries and not kept and not stack and fastest == math.inf:
                slack *= 2  # nothing left to dive into before a first plan: dive wider
            stack.extend(sorted(kept, key=lambda e: (e[0], e[1]), reverse=True))
    if progress:
        progress(len(roots), len(roots))
    space = spaces[0]
    if explain:  # what memory ruled out that came closest, by its estimate where the lowest figures were bounds
        for each in spaces:  # each publishes its least figure into the shared counters; the least of them last
            each.closest.settle()
        if len(spaces) > 1:
            min(spaces, key=lambda each: each.closest.least()).closest._publish()
    space.stats.seconds = time.perf_counter() - started
    if not results:
        if not explain:
            raise SearchError(f"no plan of '{problem.model.name}' on '{problem.cluster.name}'", code="E814",
                              hint=NOTHING_FITS)
        if space.stats.stopped:
            raise SearchError(explain_stopped(problem, space.stats), code="E814", hint=STOPPED)
        raise SearchError(explain_empty(problem, pins, space), code="E814", hint=NOTHING_FITS)
    return SearchResult(tuple(results), space.stats)


NOTHING_FITS = ("every plan of the space was ruled out for the reason said: free a pin, or change the problem (more "
                "devices, a smaller global batch, a model that fits)")
STOPPED = ("the search stopped at its time limit before any plan it simulated fitted: search longer (--time-limit "
           "SECONDS, 0 until it is done), or pin decisions to narrow it")
"""E814's hints: nothing fits, and nothing found within the time limit."""


def _cpu_clock(start: float) -> Callable[[], float]:
    """This process's CPU seconds, read at most once per millisecond of wall time: `time.process_time` is
    a system call (~4 µs here, 5 % of a 6,144-GPU search when read at every step), `time.perf_counter`
    is not. A thread's CPU seconds never run ahead of the wall clock, so the value returned is at most
    1 ms behind (a few ms with numpy's threads), and the limit is met as late as that."""
    last = [time.perf_counter(), start]

    def now() -> float:
        wall = time.perf_counter()
        if wall - last[0] >= 1e-3:
            last[0], last[1] = wall, time.process_time()
        return last[1]
    return now


def _stop(stats: SearchStats, heap: list, results: list[Scored], top: int, taken: set[int]) -> None:
    """At the time limit: after the proven best (`results`), the fastest plans simulated so far; the least bound of
    what is still open (not what a dive took, whose children are on the heap)."""
    stats.stopped = True
    stats.roots_open = sum(1 for _, _, item, _ in heap if isinstance(item, Root))  # (a dive expands none)
    open_bounds = [bound for bound, count, item, _ in heap if not isinstance(item, Scored) and count not in taken]
    stats.lower_bound = min(open_bounds) / SAFE if open_bounds else 0.0
    found = sorted((item for _, _, item, _ in heap if isinstance(item, Scored)), key=lambda s: s.estimate.time.step)
    results.extend(found[:top - len(results)])


def _megatron_runs(problem: Problem, pins: Mapping[str, object]) -> None:
    """A pinned schedule on Megatron-LM's pipeline, DeepSpeed's engine or DualPipe is one it runs (the checker's E610), and a
    pinned ZeRO stage on DeepSpeed's pipelined engine one it takes (E611), else a SearchError saying so rather than an
    empty search."""
    pinned = pins.get("schedule")
    whose = ir.PIPELINE_RUNTIMES.get(problem.pipeline)
    if whose is not None and pinned not in (None, "none") and not getattr(BUILTIN[pinned], problem.pipeline):
        runs = ", ".join(name for name, info in BUILTIN.items() if getattr(info, problem.pipeline))
        raise SearchError(f"--pin schedule={pinned}: {whose} does not run it (E610); it runs {runs}, or torch's "
                          "pipeline runs every schedule", code="E805")
    if pins.get("zero_stage") is not None and int(pins["zero_stage"]) >= 2 and problem.deepspeed_engine(pins.get("pp")):
        pinned = f"data={pins['data']} (ZeRO-{pins['zero_stage']})" if "data" in pins else \
            f"zero_stage={pins['zero_stage']}"  # the pin as given (`_data_pins` derives the stage of a `data` pin)
        raise SearchError(f"--pin {pinned}: DeepSpeed's pipeline engine takes ZeRO 0 or 1 (E611)", code="E805")


def _overlap_recomputes(problem: Problem, pins: Mapping[str, object]) -> None:
    """Pinned full recomputation beside the experts' overlap (the checker's E418: Megatron-Core refuses it), its
    overlap at fp32, a pinned pipeline without virtual stages or a pinned expert group of one rank (E419) are
    SearchErrors saying so rather than an empty
    search."""
    if problem.overlap_experts and problem.precision is ir.Precision.fp32:
        raise SearchError("the experts' overlap (Megatron-Core's --overlap-moe-expert-parallel-comm) runs only for a bf16 "
                          "or fp16 model, not at fp32 (E419); choose a 16-bit or FP8 precision, or drop the overlap",
                          code="E805")
    if problem.overlap_experts and pins.get("pp", 1) > 1 and pins.get("virtual_stages") == 1:
        raise SearchError("--pin virtual_stages=1: the experts' overlap under a pipeline needs virtual stages (E419)",
                          code="E805")
    if problem.overlap_experts and pins.get("ep") == 1:  # a pinned ep counts the folded group too (`check_pins`)
        raise SearchError("--pin ep=1: the experts' overlap (Megatron-Core's --overlap-moe-expert-parallel-comm) needs "
                          "more than one expert rank (E419: 'only supported with expert model parallelism'); pin ep "
                          "of 2 or more, or drop the overlap", code="E805")
    layers = pins.get("recompute_layers")
    if problem.overlap_experts and (pins.get("recompute") == "full" and layers != 0 or layers):
        pinned = f"recompute_layers={layers}" if layers else "recompute=full"
        raise SearchError(f"--pin {pinned}: the experts' overlap (Megatron-Core's --overlap-moe-expert-parallel-comm) "
                          "refuses full recomputation (E418); pin recompute=selective or none, or drop the overlap",
                          code="E805")


@_collector_paused
def brute_force(problem: Problem, pins: Mapping[str, object] | Iterable[str] | None = None,
                efficiency: Efficiency | None = None) -> list[Scored]:
    """Every candidate of the space that fits, simulated, sorted by step time (for tests: small spaces only)."""
    pins = parse_pins(pins)
    problem, pins = with_modules(problem, pins)
    out = []
    for space, root in [(each, root) for each in _spaces(problem, pins, efficiency) for root in each.roots()]:
        if space.tighten_root(root) is None:
            continue
        for node in space.expand_root(root):
            for leaf in space.expand(node):
                scored = space.settle(leaf)
                if scored is not None:
                    out.append(scored)
    return sorted(out, key=lambda s: s.estimate.time.step)


__all__ = ["CONTEXT", "Problem", "Candidate", "Scored", "SearchResult", "SearchStats", "SearchError", "search",
           "brute_force", "parse_pins", "with_modules", "check_pins", "partition_blocks", "partition_layers", "build_plan", "candidate_of",
           "schedule_choices", "PIN_KEYS", "DISPATCHERS", "divisors", "experts_variants", "fixed_virtual",
           "pins_conflict"]
