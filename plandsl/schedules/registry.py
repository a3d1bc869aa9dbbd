"""The built-in pipeline schedules by name, with what each needs of a plan.

Names are the surface syntax used everywhere (language, CLI, docs). `min_microbatches`
is the fewest microbatches the schedule can run with; `virtual` says how many stages a
rank runs ("two" for chimera means one stage of each of its two pipelines, while the
model itself is split into `ranks` stages); `multiple_of_ranks` whether the microbatch
count must be a multiple of the pipeline ranks; `rounds` whether it runs in torch's rounds
(ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble: max(1, m // ranks) rounds, which
must divide m; fewer microbatches than ranks is one round). `microbatches_fit` is the rule,
`microbatch_rule` its wording in docs/language.md (a test keeps the two in step); the
generators refuse the same sizes, as torch does (`generators.check_sizes` reads these columns;
tests/unit/test_schedule_generators.py), except below `min_microbatches` where `lays_out_fewer` (1F1B's
table is drawn for any m, while torch's class refuses m < pp, and so does the checker).

Every other fact about a built-in schedule is a column here too, and its consumers read it rather
than a list of names of their own: `split_backward` (the table runs backwards as input-gradient I
then weight-gradient W actions: the generators' action count, the interpreter's refusals of
selective_op recomputation and DDP stages, the search's step time), `torch_class` (the
torch.distributed.pipelining class `plandsl run` builds, by name so that nothing here imports
torch; "" when the interpreter feeds the generated table to torch's `_PipelineScheduleRuntime`),
`rank_map` (the stage -> rank map the schedule runs: `loop`, stage s on rank s mod pp, or `vshape`,
rank r holding stages r and 2pp-1-r; chimera's second pipeline is `generators.pipeline_maps`),
`searched` (whether `generate` tries it without a pin) and `inflight` (which rule the memory model,
`cost.memory.inflight_microbatches`, applies for the microbatches whose activations a rank holds).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

InflightRule = Literal["every", "depth", "interleaved", "double_depth", "full_depth", "two_pipelines"]
"""Peak microbatches in flight on pipeline rank r of p with m microbatches (`cost.memory` has the
formulas and their sources): `every`: m; `depth`: min(p - r, m); `interleaved`: Megatron-LM's
warm-up over v virtual stages (`depth` when v = 1); `double_depth`: min(2(p - r) - 1, m);
`full_depth`: min(p, m) on every rank; `two_pipelines`: chimera's, in units of the rank's two stages."""

DEFAULT_SCHEDULE = "1f1b"
"""The schedule of a plan with stages that names none, and of the search's pipelines when unpinned."""


@dataclass(frozen=True, slots=True)
class ScheduleInfo:
    name: str
    summary: str
    virtual: str = "one"          # "one": exactly 1 stage per rank; "any": >= 1; "two": exactly 2 (V-shape)
    min_microbatches: str = "1"   # "1", "ranks" (m >= p) or "2*ranks"
    lays_out_fewer: bool = False  # the generator lays out fewer microbatches than that (the minimum is torch's class's)
    multiple_of_ranks: bool = False
    rounds: bool = False
    pipelines: int = 1
    refused: str = ""             # why the interpreter cannot run it yet (E701); "" when it runs
    split_backward: bool = False  # backwards are I (input gradients) then W (weight gradients)
    torch_class: str = ""         # torch.distributed.pipelining class run uses; "" = _PipelineScheduleRuntime
    rank_map: Literal["loop", "vshape"] = "loop"  # the stage -> rank map, as `stages ... map =` writes it
    searched: bool = True         # `generate` tries it unpinned
    inflight: InflightRule = "depth"  # the memory model's in-flight microbatches (`InflightRule`)
    megatron: bool = False        # Megatron-LM's pipeline runs it (`stages ... with implementation = megatron`, E610)
    deepspeed: bool = False       # DeepSpeed's pipeline engine runs it (`implementation = deepspeed`, E610): its
    #                               TrainSchedule (deepspeed/runtime/pipe/schedule.py), a 1F1B
    dualpipe: bool = False        # DeepSeek's DualPipe runs it (`implementation = dualpipe`, E610): its `DualPipeV`
    #                               (deepseek-ai/DualPipe, dualpipe/dualpipev.py)


BUILTIN: dict[str, ScheduleInfo] = {s.name: s for s in (
    ScheduleInfo("gpipe", "all forwards, then all backwards (Huang et al. 2019)",
                 torch_class="ScheduleGPipe", inflight="every"),
    # torch's Schedule1F1B, which `plandsl run` uses, refuses fewer microbatches than stages
    ScheduleInfo("1f1b", "PipeDream-Flush: warm-up forwards, then one forward one backward (Narayanan et al. 2021)",
                 min_microbatches="ranks", lays_out_fewer=True, torch_class="Schedule1F1B", megatron=True,
                 deepspeed=True),
    ScheduleInfo("interleaved_1f1b", "1F1B over several stages per rank (Megatron-LM, Narayanan et al. 2021)",
                 virtual="any", rounds=True, torch_class="ScheduleInterleaved1F1B", inflight="interleaved",
                 megatron=True),
    ScheduleInfo("looped_bfs", "breadth-first over looped stages (Lamy-Poirier 2023)", virtual="any",
                 torch_class="ScheduleLoopedBFS", inflight="every"),
    # torch ships no class for H1 and H2: the interpreter runs the generated table
    ScheduleInfo("zb_h1", "zero bubble H1: backward split into input and weight gradients (Qi et al. 2024)",
                 min_microbatches="ranks", split_backward=True),
    ScheduleInfo("zb_h2", "zero bubble H2: more warm-up forwards to fill the bubble (Qi et al. 2024)",
                 min_microbatches="ranks", split_backward=True, inflight="double_depth"),
    # the memory model has counted 1F1B's depth for it, not the interleaved warm-up (the estimate
    # takes the simulated peak where the table holds more: cost.estimate)
    ScheduleInfo("interleaved_zero_bubble", "zero bubble over several stages per rank (torch)",
                 virtual="any", rounds=True, split_backward=True, torch_class="ScheduleInterleavedZeroBubble"),
    ScheduleInfo("zbv", "zero bubble V-shape: two stages per rank (Qi et al. 2024)", virtual="two",
                 split_backward=True, torch_class="ScheduleZBVZeroBubble", rank_map="vshape", inflight="full_depth"),
    ScheduleInfo("dualpipev", "DualPipe on a V-shape with overlapped forward/backward (DeepSeek-V3)",
                 virtual="two", min_microbatches="2*ranks", split_backward=True, torch_class="ScheduleDualPipeV",
                 rank_map="vshape", dualpipe=True),
    # Chimera keeps the weights of two stages per rank (one per pipeline) and all-reduces them between
    # its pipelines: the memory model counts both (`cost.memory.held_stages`), but the partition's
    # per-rank caps and the step time do not model the second copy, so the search tries it only when pinned.
    ScheduleInfo("chimera", "two pipelines in opposite directions (Li & Hoefler 2021)", virtual="two",
                 min_microbatches="ranks", multiple_of_ranks=True, pipelines=2, searched=False,
                 inflight="two_pipelines",
                 refused="it runs two pipelines in opposite directions (each rank holds one stage of each, and "
                         "each microbatch takes one of them), while torch.distributed.pipelining runs one chain "
                         "of stages"),
)}


def pipelines_of(name: str) -> int:
    """How many pipelines the built-in `name` runs (1 for other names)."""
    info = BUILTIN.get(name)
    return 1 if info is None else info.pipelines


def splits_backward(name: str) -> bool:
    """Whether `name` is a built-in whose table runs backwards as I then W (False for other names)."""
    info = BUILTIN.get(name)
    return info is not None and info.split_backward


def min_microbatches(info: ScheduleInfo, ranks: int) -> int:
    return {"1": 1, "ranks": ranks, "2*ranks": 2 * ranks}[info.min_microbatches]


def microbatches_fit(info: ScheduleInfo, ranks: int, microbatches: int) -> bool:
    """Whether the schedule runs `microbatches` per step on `ranks` pipeline ranks."""
    m = microbatches
    return m >= min_microbatches(info, ranks) and not (info.multiple_of_ranks and m % ranks) \
        and not (info.rounds and m % max(1, m // ranks))


def megatron_microbatches_fit(ranks: int, microbatches: int, virtual: int) -> bool:
    """Whether Megatron-LM's pipeline runs `microbatches` per step over `ranks` ranks of `virtual` stages each: with
    virtual stages its interleaved 1F1B runs them in groups per virtual stage (`microbatch_group_size_per_vp_stage`,
    default pp) that must lie in [pp, m] (megatron.core.pipeline_parallel.schedules, core_v0.16.1:
    forward_backward_pipelining_with_interleaving), so at least pp of them; one stage per rank runs any count."""
    return virtual == 1 or microbatches >= ranks


def megatron_microbatch_group(ranks: int, microbatches: int) -> int:
    """The microbatches Megatron-LM's interleaved 1F1B runs per virtual stage in turn to run the order of
    `interleaved_1f1b` (torch's rounds: m // max(1, m // p) each), its --microbatch-group-size-per-virtual-pipeline-stage
    (Megatron's default, pp, where pp divides m)."""
    return microbatches // max(1, microbatches // ranks)


def microbatch_rule(info: ScheduleInfo) -> str:
    """The rule of `microbatches_fit` in words, as the table of docs/language.md section 13 has it."""
    parts = {"1": [], "ranks": ["`m >= pp`"], "2*ranks": ["`m >= 2 * pp`"]}[info.min_microbatches]
    if info.multiple_of_ranks:
        parts.append("a multiple of `pp`")
    if info.rounds:
        parts.append("`max(1, m // pp)` (the rounds) divides `m`")
    return ", ".join(parts) or "any"


def nearest_fitting(info: ScheduleInfo, ranks: int, microbatches: int) -> int:
    """The microbatch count closest to `microbatches` (the larger on a tie) that the schedule runs."""
    need = min_microbatches(info, ranks)
    if microbatches < need:
        microbatches = need
    for step in range(0, 2 * ranks + 1):  # a multiple of ranks is always within ranks, and fits every rule
        for m in (microbatches + step, microbatches - step):
            if m >= 1 and microbatches_fit(info, ranks, m):
                return m
    return (microbatches // ranks + 1) * ranks
