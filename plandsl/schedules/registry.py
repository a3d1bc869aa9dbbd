"""The built-in pipeline schedules by name, with what each needs of a plan.

Names are the surface syntax used everywhere (language, CLI, docs). `min_microbatches`
is the fewest microbatches the schedule can run with; `virtual` says how many stages a
rank runs ("two" for chimera means one stage of each of its two pipelines, while the
model itself is split into `ranks` stages); `multiple_of_ranks` whether the microbatch
count must be a multiple of the pipeline ranks. The generators hold the exact rules;
these give early, plain messages.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ScheduleInfo:
    name: str
    summary: str
    virtual: str = "one"          # "one": exactly 1 stage per rank; "any": >= 1; "two": exactly 2 (V-shape)
    min_microbatches: str = "1"   # "1", "ranks" (m >= p) or "2*ranks"
    multiple_of_ranks: bool = False
    pipelines: int = 1


BUILTIN: dict[str, ScheduleInfo] = {s.name: s for s in (
    ScheduleInfo("gpipe", "all forwards, then all backwards (Huang et al. 2019)"),
    ScheduleInfo("1f1b", "PipeDream-Flush: warm-up forwards, then one forward one backward (Narayanan et al. 2021)"),
    ScheduleInfo("interleaved_1f1b", "1F1B over several stages per rank (Megatron-LM, Narayanan et al. 2021)",
                 virtual="any"),
    ScheduleInfo("looped_bfs", "breadth-first over looped stages (Lamy-Poirier 2023)", virtual="any"),
    ScheduleInfo("zb_h1", "zero bubble H1: backward split into input and weight gradients (Qi et al. 2024)",
                 min_microbatches="ranks"),
    ScheduleInfo("zb_h2", "zero bubble H2: more warm-up forwards to fill the bubble (Qi et al. 2024)",
                 min_microbatches="ranks"),
    ScheduleInfo("interleaved_zero_bubble", "zero bubble over several stages per rank (torch)",
                 virtual="any"),
    ScheduleInfo("zbv", "zero bubble V-shape: two stages per rank (Qi et al. 2024)", virtual="two"),
    ScheduleInfo("dualpipev", "DualPipe on a V-shape with overlapped forward/backward (DeepSeek-V3)",
                 virtual="two", min_microbatches="2*ranks"),
    ScheduleInfo("chimera", "two pipelines in opposite directions (Li & Hoefler 2021)", virtual="two",
                 min_microbatches="ranks", multiple_of_ranks=True, pipelines=2),
)}


def min_microbatches(info: ScheduleInfo, ranks: int) -> int:
    return {"1": 1, "ranks": ranks, "2*ranks": 2 * ranks}[info.min_microbatches]
