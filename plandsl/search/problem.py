"""What the search works on and hands back: the `Problem` (a model, a cluster, a batch), one point of
its space (`Candidate`), a candidate with its estimate and plan (`Scored`), the counters of a run
(`SearchStats`), the result, and a candidate written as an `ir.Plan` (`build_plan`). Below the space,
the search and the emitter, which all use them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

from plandsl import ir
from plandsl.diagnostics import Diagnostic, diag
from plandsl.cost.estimate import PlanEstimate
from plandsl.cost.memory import StateBytes
from plandsl.schedules.registry import BUILTIN, DEFAULT_SCHEDULE

# Context parallelism as the search proposes it: K and V all-gathered (Llama 3's choice), which
# `plandsl run` runs on CPU and CUDA; `ring` is costed when a plan asks for it (it runs on CPU, E702 on CUDA).
CONTEXT = "allgather"
# hsdp's two data axes as the search writes them, outermost first: the replicas, then the shard axis (ZeRO-3 within it)
HYBRID_AXES = ("dp_rep", "dp")


class SearchError(ValueError):
    """Nothing in the space can run (with the reason and, where it helps, what would). `code` (required: every one is
    a Diagnostic, `.diagnostic`; tests/unit/test_search_generate.py holds every raise to one): E804 a flag's value
    (`--pin`, `--model`, `--cluster`, `--precision`, ...) malformed or unknown, E805 flags or pins that contradict
    each other or what the problem runs, E814 a search that finds no plan that fits; where the language says what is
    wrong with `--model` or `--cluster`, its own code (E201 an unknown name, E212, E22x, E215, E504, ...)."""

    def __init__(self, message: str, code: str, hint: str | None = None):
        super().__init__(message)
        self.code, self.hint = code, hint

    @property
    def diagnostic(self) -> Diagnostic:
        """The error as the command line shows it: no location (the command's flags, or the search's problem)."""
        return diag(self.code, str(self), hint=self.hint)


class Kept(NamedTuple):
    """What `build_plan` writes beyond a candidate's degrees (`Problem.kept`): a kept stages line at pp 1, a kept data
    line where the candidate has no data axis."""
    stages: bool = False
    data: bool = False


NOTHING_KEPT = Kept()


@dataclass(frozen=True, slots=True)
class Problem:
    model: ir.Model
    cluster: ir.Cluster
    global_batch: int
    seq: int | None = None                     # None: the model's
    precision: ir.Precision = ir.Precision.bf16
    optimizer: ir.Optimizer = ir.Optimizer.adam
    master_dtype: ir.Precision = ir.Precision.fp32    # the kept weights, gradients and optimizer states:
    grad_dtype: ir.Precision = ir.Precision.fp32      # given, as `precision` is, not searched
    optimizer_dtype: ir.Precision = ir.Precision.fp32
    param_dtype: ir.Precision | None = None           # the weights kept narrower than the master copy; None: master
    kernels: ir.Kernels = ir.Kernels.fused            # the implementation's element-wise kernels: given, not searched
    overlap_experts: bool = False                     # given, not searched: `experts = alltoall over ep with overlap`
    fold_experts: bool = False                        # given, not searched: `experts = alltoall over [ep, tp]`, each
    #                                                   expert whole; the pin `ep` then counts the group, ep x tp
    attention: ir.Attention = ir.Attention.flash      # the implementation's attention core: given, not searched
    loss: ir.Loss = ir.Loss.standard                  # the implementation's cross entropy: given, not searched
    overlap_tensor: bool = False                      # given, not searched: `tensor = ... with sequence_parallel,
    #                                                   overlap` wherever a candidate has sequence parallelism
    tensor_overlap: ir.TensorOverlap = ir.TensorOverlap.async_tp  # given: which implementation overlaps (`overlap =`)
    sm_margin: bool = True                            # given: userbuffers' `sm_margin`
    tensor_stack: str | None = None                   # given: `tensor = ... with implementation = megatron` (what a
    #                                                   column-parallel linear saves under sequence parallelism:
    #                                                   cost.memory); None: the line's own default (`stack_of_tensor`)
    gathering: ir.Gathering | None = None             # given, not searched: `data = zero3 ... with unit, prefetch,
    #                                                   gather` (a written data clause, a recipe); None: FSDP's blocks
    #                                                   one ahead, in the dtype the stack gathers in (`gather_dtype`)
    dispatcher: str = "alltoall"                      # given, not searched: `experts = deepep over ep` (ir.ExpertParallel)
    search_experts: bool = False                      # searched instead: the experts' folding over tp and their
    #                                                   dispatcher (`plandsl generate` from a model; `experts_variants`)
    fp8_recipe: ir.Fp8Recipe | None = None            # given, not searched: `precision: fp8`'s scaling (None: delayed)
    recompute_modules: tuple[ir.RecomputeModule, ...] | None = None  # pinned, not searched: what `selective` reruns
    bf16_first_layers: int = 0                        # given, not searched: blocks an FP8 or FP4 recipe keeps in bf16
    bf16_last_layers: int = 0
    context: str = CONTEXT                            # given, not searched: `context = ring over cp` (ir.ContextParallel)
    ring: str = "te"                                  # given: `context = ring over cp with implementation = torch`
    pipeline: str = "torch"                           # given: `stages = ... with implementation = megatron` (or
    #                                                   deepspeed, dualpipe: only its schedules, none of torch's stage
    #                                                   buffers: cost.memory)
    outputs: str = "dropped"                          # given: `stages = ... with outputs = returned` (torch's pipeline
    #                                                   keeps the last stage's outputs to the step's end: cost.memory)
    shard: tuple[ir.ShardRule, ...] = ()              # given: the `shard` rules a `generate --from` plan keeps (every
    #                                                   candidate carries them; the figures place the layers by them)
    hybrid: bool = True                               # whether the search may lay out hsdp (`data = hsdp over
    #                                                   [dp_rep, dp]`); not where a `generate --from` plan writes a mesh
    #                                                   or a data line of one data axis
    stages_kept: bool = False                         # a `generate --from` plan's stages line or block, kept in every
    #                                                   candidate at any pp, 1 too: its pipeline's engine runs there
    data_kept: bool = False                           # a `generate --from` plan's data line (not `none`), kept at
    #                                                   dp 1 too (over an axis of size 1): ZeRO-2/3's units held there
    stage_map: str | tuple[int, ...] | None = None     # given: that kept line's map of stages to ranks (`loop`,
    #                                                   `vshape` or a list): a schedule the search writes beside it must
    #                                                   place the stages so (the checker's E409), `Problem.runs_map`
    stages_block: bool = False                        # given: whether that kept placement is a `stages { }` block,
    #                                                   not a `stages = ...` line (what the messages call it)
    split: str | tuple[int, ...] | None = None        # given: the split of that kept line, which its completion writes
    #                                                   whatever the search would choose: "evenly" (`stages = evenly
    #                                                   over pp`, its `account` the pin's), a `stages { }` block's blocks
    #                                                   (layers, of a model of layers) per stage; None: the search's own
    #                                                   (`Splits.fixes`)

    def deepspeed_engine(self, pp: int | None) -> bool:
        """Whether DeepSpeed's pipeline engine runs a layout of `pp` stages (None: any the search lays out), which
        takes ZeRO 0 or 1 and no sequence parallelism (the checker's E611): `--pipeline deepspeed` past one stage, and
        at one too where the plan's stages line is kept (`stages_kept`: the engine is built whatever its stage count)."""
        return self.pipeline == "deepspeed" and ((pp or 1) > 1 or self.stages_kept)

    @property
    def kept(self) -> Kept:
        """The written lines of a `generate --from` plan that its completion keeps whatever the degrees (`build_plan`
        writes them where the search's candidate alone would not)."""
        return Kept(self.stages_kept, self.data_kept)

    def pipelined(self, pp: int) -> bool:
        """Whether a layout of `pp` stages runs on a pipeline's runtime: past one stage, and at one too where the
        plan's stages line is kept (`plandsl run` builds its stages and schedule at pp 1 as well: `build_plan`
        writes them, and the exact estimate counts ZeRO-2/3's gradients whole to the step's end there)."""
        return pp > 1 or self.stages_kept

    def runs_map(self, schedule: str, pp: int, virtual: int) -> bool:
        """Whether a built-in `schedule` over `pp` ranks of `virtual` stages each places its stages on the ranks as the
        kept stages line's map does (`stage_map`; any where none is kept, or at pp 1, where no schedule is chosen):
        `stages = evenly over pp with virtual = 2` maps them in a loop, and a V-shape schedule beside it (zbv,
        dualpipev) is the checker's E409, as a loop's beside `map = vshape` or a list that says another."""
        if self.stage_map is None or pp == 1:
            return True
        def ranks(rank_map) -> tuple[int, ...]:  # as `choices.stage_ranks` places a built-in schedule's
            if isinstance(rank_map, tuple):
                return rank_map
            if rank_map == "vshape":
                return tuple(s if s < pp else 2 * pp - 1 - s for s in range(2 * pp))
            return tuple(s % pp for s in range(pp * virtual))
        info = BUILTIN.get(schedule)
        return ranks(info.rank_map if info is not None else "loop") == ranks(self.stage_map)

    @property
    def stack_of_tensor(self) -> str:
        """Whose tensor parallelism runs the layers: the given one, else as a tensor line without `implementation`
        says (`ir.TensorParallel.default_stack`: Megatron's under Transformer Engine's userbuffers, else torch's)."""
        if self.tensor_stack is not None:
            return self.tensor_stack
        return ir.overlap_stack(self.tensor_overlap if self.overlap_tensor else None) or "torch"

    @property
    def sequence(self) -> int:
        return self.seq or getattr(self.model, "seq", 1)

    @property
    def states(self) -> StateBytes:
        """The bytes of what training keeps per parameter, by `StateBytes.of`'s rule for the problem's `train`."""
        return StateBytes.of(self.training())

    @property
    def priced_gathering(self) -> ir.Gathering:
        """The gathering as the time's closed forms and unit passes read it (`search.bounds`, `Figures.element`): as
        given, else FSDP's blocks one ahead with no gather dtype, whose gathers the time prices at the compute
        precision's bytes (`cost.stage`): what the one `gather_dtype` chooses moves."""
        return self.gathering if self.gathering is not None else ir.FSDP_GATHERING

    @property
    def gather_dtype(self) -> ir.Precision | None:
        """The dtype the problem's ZeRO-2/3 candidates gather the parameters in (`build_plan` gives ZeRO-1 its own,
        `_gathering_fields`): the given one; else the compute precision where it is 16-bit and the weights are wider,
        as torchtitan runs FSDP (FSDP2's `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`, its
        `mixed_precision_param` default) and `plandsl run` applies it (`ir.Plan.run_gather`): the units gathered and
        held in 16 bits and no autocast copy of the fp32 weights (`cost.memory`). Its gathers move what the time
        prices a plan without one at (`priced_gathering`), so the choice changes the memory alone. None: the weights'
        own dtype (16-bit weights; fp32, FP8 and FP4 precisions)."""
        if self.gathering is not None:
            return self.gathering.gather
        precision = self.precision
        wider = self.training().weights_dtype.bytes > precision.bytes
        return precision if precision in (ir.Precision.bf16, ir.Precision.fp16) and wider else None

    def training(self, **fields) -> ir.Training:
        """The problem's `train` (its batch, precision, optimizer and kept dtypes), with `fields` added."""
        return ir.Training(global_batch=self.global_batch, seq=self.seq, precision=self.precision,
                           optimizer=self.optimizer, master_dtype=self.master_dtype, grad_dtype=self.grad_dtype,
                           optimizer_dtype=self.optimizer_dtype, param_dtype=self.param_dtype, kernels=self.kernels,
                           attention=self.attention, loss=self.loss, fp8_recipe=self.fp8_recipe,
                           bf16_first_layers=self.bf16_first_layers, bf16_last_layers=self.bf16_last_layers,
                           recompute_modules=self.recompute_modules, **fields)

    def given_items(self) -> list[str]:
        """The train items the problem fixes to other than their defaults (the kept dtypes, `kernels`,
        `attention`, `loss`, the FP8 recipe and the bf16 blocks), as a plan writes them."""
        items = [f"{key}: {value.value}" for key, value in self.training().given_dtypes().items()]
        items += [f"fp8_recipe: {self.fp8_recipe.value}"] if self.fp8_recipe is not None else []
        items += [f"{key}: {getattr(self, key)}" for key in ("bf16_first_layers", "bf16_last_layers") if getattr(self, key)]
        items += [f"kernels: {self.kernels.value}"] if self.kernels is not ir.Kernels.fused else []
        items += [f"recompute_modules: [{', '.join(m.value for m in self.recompute_modules)}]"] \
            if self.recompute_modules is not None else []
        items += [f"attention: {self.attention.value}"] if self.attention is not ir.Attention.flash else []
        return items + ([f"loss: {self.loss.value}"] if self.loss is not ir.Loss.standard else [])


@dataclass(frozen=True, slots=True)
class Candidate:
    """One point of the space: a small frozen record, printable as the pins that select it."""

    dp: int
    tp: int
    pp: int
    cp: int
    ep: int
    order: tuple[str, ...]      # mesh axes of size > 1, outermost first (the last is innermost)
    micro_batch_size: int
    num_microbatches: int
    schedule: str               # "" without a pipeline
    virtual_stages: int
    zero_stage: int
    recompute: str
    sequence_parallel: bool
    recompute_layers: int | None = None  # with recompute full: the first N blocks of each stage (None: every block)
    fold: bool = False                   # the experts folded over tp (`experts = ... over [ep, tp]`), with tp > 1
    dispatcher: str = "alltoall"         # the experts' dispatcher (`experts = deepep over ep`), with ep > 1
    offload_layers: int = 0              # blocks whose activations go to the host (`offload_layers`), with pp = 1
    # hsdp (`data = hsdp over [dp_rep, dp]`, zero_stage 3): ZeRO-3 over a shard axis `dp` of this many data ranks,
    # replicated over `dp_rep` (dp / shard), just outside it in the mesh; 0: one data axis of dp ranks
    shard: int = 0

    def degrees(self) -> dict[str, int]:
        return {"dp": self.dp, "tp": self.tp, "pp": self.pp, "cp": self.cp, "ep": self.ep}

    def axis_sizes(self) -> dict[str, int]:
        """The size of each axis of `mesh_order`: the degrees, hsdp's dp split into dp_rep x dp (its shard axis)."""
        sizes = self.degrees()
        return {**sizes, "dp_rep": self.dp // self.shard, "dp": self.shard} if self.shard else sizes

    @property
    def data_kind(self) -> ir.DataKind:
        """The data clause's kind: hsdp, else the kind of the ZeRO stage over one axis."""
        return ir.DataKind.hsdp if self.shard else ir.DataKind.of_zero_stage(self.zero_stage)

    @property
    def data_axes(self) -> tuple[str, ...]:
        """The axes `data = ...` is over: hsdp's [dp_rep, dp], else `data_axis` (none without one)."""
        if self.shard:
            return HYBRID_AXES
        return (self.data_axis,) if self.data_axis else ()

    @property
    def data_axis(self) -> str | None:
        """The axis `data = ...` is over: dp; else the expert axis (which splits the batch); else, with ZeRO and a
        context axis, dp of size 1, since ZeRO shards over the data and context axes together (torchtitan's FSDP
        over dp_shard x cp, "FSDP 1, CP 8"; `cost.memory.zero_degrees`); else none."""
        if self.dp > 1:
            return "dp"
        if self.ep > 1:
            return "ep"
        return "dp" if self.cp > 1 and self.zero_stage > 0 else None

    @property
    def mesh_order(self) -> tuple[str, ...]:
        """The mesh's axes outermost first: `order`, and dp of size 1 first when it carries ZeRO (`data_axis`)."""
        order = self.order or ("dp",)
        if self.shard:  # hsdp's replicas just outside its shards (`choices.hybrid_axes`)
            return tuple(a for axis in order for a in (HYBRID_AXES if axis == "dp" else (axis,)))
        return order if self.data_axis in (None, *order) else ("dp", *order)

    def pins(self) -> dict[str, object]:
        return {**self.degrees(), "micro_batch_size": self.micro_batch_size, "schedule": self.schedule or "none",
                "virtual_stages": self.virtual_stages, "zero_stage": self.zero_stage, "recompute": self.recompute,
                "order": ",".join(self.order)} | ({} if self.recompute_layers is None else
                                                 {"recompute_layers": self.recompute_layers}) | (
            {"fold": self.fold, "dispatcher": self.dispatcher} if self.ep > 1 else {}) | (
            {"offload_layers": self.offload_layers} if self.offload_layers else {}) | (
            {"data": "hsdp", "dp_shard": self.shard} if self.shard else {})

    def describe(self) -> str:
        axes = " ".join(f"{k}={v}" for k, v in self.degrees().items() if v > 1) or "1 device"
        pipeline = f" {self.schedule}" + (f" v={self.virtual_stages}" if self.virtual_stages > 1 else "") \
            if self.pp > 1 and self.schedule else ""  # a node's record has no schedule yet
        return (f"{axes} mb={self.micro_batch_size} m={self.num_microbatches}{pipeline} "
                + (f"hsdp {self.dp // self.shard}x{self.shard}" if self.shard else f"zero{self.zero_stage}")
                + f" recompute={self.recompute}"
                + (f" recompute_layers={self.recompute_layers}" if self.recompute_layers is not None else "")
                + (f" offload_layers={self.offload_layers}" if self.offload_layers else "")
                + (f" experts={self.dispatcher}" + (" over [ep, tp]" if self.fold else "")
                   if self.ep > 1 and (self.fold or self.dispatcher != "alltoall") else ""))


@dataclass(frozen=True, slots=True)
class Scored:
    candidate: Candidate
    blocks: tuple[int, ...]     # layers per stage
    estimate: PlanEstimate
    plan: ir.Plan = field(repr=False)


@dataclass
class SearchStats:
    roots: int = 0              # layouts x mesh orders
    nodes: int = 0              # ... x micro-batch sizes x recomputation, expanded from the roots
    expanded: int = 0
    leaves: int = 0             # ... x ZeRO stages x schedules, with a bound
    simulated: int = 0
    memory_pruned: int = 0
    invalid: int = 0
    tp_across_nodes: int = 0    # mesh orders left out because a tensor-parallel group would span nodes
    seconds: float = 0.0
    # Of the candidates memory ruled out, the one with the least figure (its need over its devices' capacity):
    # an exact need (the plan estimated) or a lower bound on it. Every candidate ruled out has a figure no larger
    # than its need, so an exact least is the closest to fitting; a bound is only the lowest bound.
    memory_example: str = ""
    memory_example_ratio: float = math.inf
    memory_example_exact: bool = False
    memory_unsplit: int = 0     # ruled out with no figure: over several stages, no split of the blocks fits
    time_limit: float | None = None  # seconds the search may take (None: until it is done)
    stopped: bool = False       # the time limit ended it: the candidates are the best found, not proven the best
    roots_open: int = 0         # layouts x mesh orders not yet expanded when it stopped
    lower_bound: float = 0.0    # when it stopped: no plan left unsearched takes less (s per step)


@dataclass(frozen=True)
class SearchResult:
    candidates: tuple[Scored, ...]
    stats: SearchStats

    @property
    def best(self) -> Scored:
        return self.candidates[0]


def build_plan(base: ir.Plan, c: Candidate, kept: Kept = NOTHING_KEPT) -> ir.Plan:
    """The candidate as an `ir.Plan` (what `search_emit.plan_text` writes, once lowered); the
    layers of its stages are given to `cost.estimate` as an assignment. Every node is given its (empty)
    `field_spans` (`_node`). `kept` (`Problem.kept`): the lines of a `generate --from` plan its completion keeps
    whatever the degrees (`rewrite.complete`), each over an axis of size 1 where the candidate has none: its stages
    line at pp 1 (the default schedule; `plandsl run` builds the pipeline's stages there as well), its data line at
    dp 1 (ZeRO-2/3's units gathered whole beside their shards there too)."""
    sizes = c.axis_sizes()
    data_kept = kept.data and not c.data_axis
    order = c.mesh_order + (("pp",) if kept.stages and "pp" not in c.mesh_order else ()) \
        + (("dp",) if data_kept and "dp" not in c.mesh_order else ())
    mesh = _node(ir.Mesh, axes=tuple(_node(ir.Axis, name=a, size=sizes[a]) for a in order), first_device=0,
                 part=None)
    gathering = base.data.gathering if base.data is not None else ir.FSDP_GATHERING  # the problem's, its
    # `gather_dtype` with it (search.figures)
    data = _node(ir.DataParallel, kind=c.data_kind, axes=c.data_axes if c.data_axis else ("dp",),
                 **_gathering_fields(gathering, c.zero_stage, base.train)) if c.data_axis or data_kept else None
    tensor = _node(ir.TensorParallel, style="megatron", axis="tp", sequence_parallel=c.sequence_parallel,
                   overlap=bool(base.tensor and base.tensor.overlap) and c.sequence_parallel,
                   **({"implementation": base.tensor.implementation, "sm_margin": base.tensor.sm_margin,
                       "stack": base.tensor.stack} if base.tensor is not None else {})) \
        if c.tp > 1 else None  # overlap: the problem's `overlap_tensor` (search.figures), with sequence parallelism
    context = _node(ir.ContextParallel, kind=base.context.kind, axis="cp", implementation=base.context.implementation) \
        if c.cp > 1 and base.context is not None else _node(ir.ContextParallel, kind=CONTEXT, axis="cp") if c.cp > 1 \
        else None  # the problem's `context` and `ring` (search.figures), else the search's kind
    overlap = bool(base.experts and base.experts.overlap)  # the problem's `overlap_experts` (search.figures)
    fold = ("tp",) if base.experts is not None and base.experts.fold and c.tp > 1 else ()  # its `fold_experts`
    kind = base.experts.kind if base.experts is not None else "alltoall"  # the problem's `dispatcher`
    experts = _node(ir.ExpertParallel, kind=kind, axis="ep", overlap=overlap, fold=fold) if c.ep > 1 else None
    stages = schedule = None
    if c.pp > 1 or kept.stages:
        name = c.schedule or DEFAULT_SCHEDULE
        stages = _node(ir.Stages, axis="pp", mode="explicit" if c.pp > 1 else "evenly", virtual=c.virtual_stages,
                       rank_map=BUILTIN[name].rank_map, groups=(),  # whose pipeline: the problem's (search.figures);
                       # one stage of every layer at pp 1 (its even split), as `cost.estimate` assigns it without an
                       # assignment (`Closest.settle`)
                       implementation=base.stages.implementation if base.stages is not None else "torch",
                       outputs=base.stages.outputs if base.stages is not None else "dropped")
        schedule = _node(ir.ScheduleRef, name=name, options={}, definition=None)
    train = base.train.model_copy(update={"micro_batch": c.micro_batch_size, "recompute": ir.Recompute(c.recompute),
                                        "recompute_layers": c.recompute_layers, "offload_layers": c.offload_layers})
    return base.model_copy(update={"mesh": mesh, "train": train, "data": data, "tensor": tensor, "context": context,
                                   "experts": experts, "stages": stages, "schedule": schedule})


def _gathering_fields(gathering: ir.Gathering, zero_stage: int, train: ir.Training) -> dict:
    """The data clause's gathering options for a candidate's ZeRO stage: the gather dtype from ZeRO-1, where that
    stage gathers in it (`ir.gathers_as_written`: ZeRO-1 the weights as they are kept, so a 16-bit gather of fp32
    weights is ZeRO-2/3's alone), the unit from ZeRO-2, the prefetch from ZeRO-3 (what the lowering accepts on each
    kind), the defaults below."""
    unit = gathering.unit if zero_stage >= 2 else ir.GatherUnit.block
    gather = gathering.gather if zero_stage >= 1 and ir.gathers_as_written(zero_stage, gathering.gather, train) \
        else None
    if zero_stage >= 3:
        return {"unit": unit, "prefetch": gathering.prefetch, "prefetch_bucket": gathering.prefetch_bucket,
                "gather": gather}
    return {"unit": unit, "prefetch": 1, "prefetch_bucket": None, "gather": gather}


def _node(model: type, **values):
    """`model.model_construct(**values)` with its (empty) `field_spans` given: pydantic resolves a default
    factory by inspecting its signature on each construction (~20 µs, most of a search's plan)."""
    return model.model_construct(field_spans={}, **values)
