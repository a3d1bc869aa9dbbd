"""`plandsl generate` on a cluster that mixes device types: replicas on different devices get uneven shares,
and the result says what the mix gains over the faster devices alone.

Stage: rewrite, above the search (which times every data-parallel replica on the slowest device of each
pipeline rank, so it never proposes `batch_shares`). Contract: `mixed_plans(result, texts, ...)` takes the
search's checked candidates and adds, for each with data parallelism, the same layout with the data axis
outermost (its replicas on whole node groups, so on one device type each where the groups allow it); every
candidate whose replicas sit on different devices is estimated with even shares (the search's figure) and
with the shares `batch_shares: speed` resolves to (`cost.estimate.data_shares`: the slowest replica sets the
step), and takes the shares where they are faster and fit, written out as `batch_shares: [..]` (editable;
`speed` re-balances); `Shared` keeps both figures. `faster_alone(problem, ...)` searches the cluster's fastest
node groups alone: `Gain` holds both best plans and their ratio of tokens/s.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace

from plandsl import ir
from plandsl.check.analysis import analyze
from plandsl.cost.compute import peak_of
from plandsl.cost.estimate import PlanEstimate, estimate_plan, share_runs
from plandsl.ir import shares as batch
from plandsl.search import SearchError, parse_pins, search
from plandsl.search.emit import Source, outside, plan_text, written_from
from plandsl.search.problem import Problem, Scored, SearchResult
from plandsl.syntax.format import format_text
from plandsl.syntax.loader import include

SHARES = "batch_shares: speed"
SPEED_COMMENT = "# batch_shares: speed resolves to these (the replicas' predicted steps even); edit, or write speed"


@dataclass(frozen=True)
class Shared:
    """A candidate whose plan takes uneven shares, beside the same layout with even shares."""
    even: PlanEstimate                 # global_batch / dp on every data rank (the search's figure)
    shares: tuple[int, ...]            # sequences per data rank, as the plan writes them

    def line(self, shared: PlanEstimate) -> str:
        return (f"batch shares: {share_runs(self.shares)} sequences per data rank run {shared.time.step:.4g} s a step "
                f"against {self.even.time.step:.4g} s with {sum(self.shares) // len(self.shares)} each "
                f"({self.even.time.step / shared.time.step:.2f}x the tokens/s)")


@dataclass(frozen=True)
class Gain:
    """The best plan on the whole mixed cluster against the best on its fastest device type alone."""
    device: str                        # the fastest device type (by its peak at the plan's precision)
    devices: int                       # how many of them the cluster holds
    mixed: PlanEstimate                # the best plan on every device
    alone: PlanEstimate | None         # the best on the fastest devices alone; None: nothing fits on them
    reason: str = ""                   # why `alone` is None
    subject: str = "the best plan"     # what `mixed` is (`generate --from`: the best completion of the plan)

    @property
    def ratio(self) -> float | None:
        """tokens/s of the mix over tokens/s of the faster devices alone."""
        return self.mixed.tokens_per_s / self.alone.tokens_per_s if self.alone and self.alone.tokens_per_s else None

    def to_json(self) -> dict:
        return {"faster_device": self.device, "faster_devices": self.devices,
                "mixed_step_time_s": self.mixed.time.step, "mixed_tokens_per_s": self.mixed.tokens_per_s,
                "alone_step_time_s": self.alone.time.step if self.alone else None,
                "alone_tokens_per_s": self.alone.tokens_per_s if self.alone else None,
                "gain": self.ratio, **({"reason": self.reason} if self.reason else {})}

    def line(self) -> str:
        if self.alone is None:
            return (f"heterogeneity: on its {self.devices} {self.device} devices alone no plan runs ({self.reason}); "
                    f"the mix runs {self.mixed.tokens_per_s:,.0f} tokens/s")
        slower = "" if self.ratio >= 1 else f": the {self.device} devices alone are faster (generate on them)"
        return (f"heterogeneity: {self.subject} on all {self.mixed.devices} devices runs {self.ratio:.2f}x the "
                f"tokens/s of the best on the {self.devices} {self.device} devices alone ({self.mixed.tokens_per_s:,.0f} "
                f"against {self.alone.tokens_per_s:,.0f}; {self.mixed.time.step:.4g} s against "
                f"{self.alone.time.step:.4g} s a step){slower}")


def mixed_plans(result: SearchResult, texts: list[str], problem: Problem, source: Source, path: str | None,
                pins, top: int, time_limit: float | None) -> tuple[SearchResult, list[str], list[Shared | None]]:
    """The search's candidates, with data-outermost variants and uneven shares where they are faster,
    best first, at most `top` (see the module docstring)."""
    where = str(path) if path else os.path.join(os.getcwd(), "generated.plan")
    source = written_from(source, where)
    found = list(zip(result.candidates, texts))
    pinned = parse_pins(pins or ())  # every variant keeps them (`_user`'s would drop a pinned degree: dp=16 gave dp=64)
    for scored in variants(result.candidates, problem, pinned, pinned, top, time_limit):
        text = plan_text(scored, problem, source)
        if _checked(text, where, source) is not None:
            found.append((scored, text))
    better = [_with_shares(scored, text, problem, source, where) for scored, text in found]
    better.sort(key=lambda found: found[0].estimate.time.step)
    better = better[:top]
    return SearchResult(tuple(s for s, _, _ in better), result.stats), [t for _, t, _ in better], \
        [shared for _, _, shared in better]


def variants(candidates, problem: Problem, kept: dict, pinned: dict, top: int,
             time_limit: float | None) -> list[Scored]:
    """Candidates the search's even-share ranking passes over that uneven shares may make the fastest, new to
    `candidates`: without a pipeline (unless `pinned` fixes pp), at smaller microbatches (more of them to deal
    unevenly), and each candidate's layout with the data axis outermost (unless the order is pinned). `kept`:
    the pins every variant keeps."""
    seen = {s.candidate for s in candidates}
    found: list[Scored] = []

    def add(pins: dict, count: int = 1) -> list[Scored]:
        try:
            new = [s for s in search(problem, pins, count, explain=False, time_limit=time_limit).candidates
                   if s.candidate not in seen]
        except SearchError:
            return []
        seen.update(s.candidate for s in new)
        found.extend(new)
        return new

    if "pp" not in pinned:  # without a pipeline, a replica is one tensor group: the most to share
        for scored in add({**kept, "pp": 1}, top):
            c = scored.candidate
            if "micro_batch_size" not in pinned:  # an even split favours the largest microbatch
                for mb in [d for d in range(c.micro_batch_size - 1, 0, -1) if c.micro_batch_size % d == 0][:3]:
                    add({**kept, **c.pins(), "micro_batch_size": mb})
    if "order" not in pinned:
        for scored in [*candidates, *found]:
            c = scored.candidate
            if c.dp > 1 and not (c.order and c.order[0] == "dp"):
                order = ("dp",) + tuple(a for a in c.order if a != "dp")
                add({**kept, **c.pins(), "order": ",".join(order)})
    return found


def faster_alone(problem: Problem, mixed: PlanEstimate, pins, time_limit: float | None,
                 subject: str = "the best plan") -> Gain | None:
    """The best plan on the cluster's fastest node groups alone (None for a cluster of one device type), under
    the pins that do not fix the layout."""
    cluster = problem.cluster
    if not cluster.heterogeneous:
        return None
    peak = {g.node.device.name: peak_of(g.node.device, problem.precision) for g in cluster.groups}
    fastest = max(peak, key=lambda name: (peak[name], name))
    groups = tuple(g for g in cluster.groups if g.node.device.name == fastest)
    alone = cluster.model_copy(update={"name": f"{cluster.name}'s {fastest} nodes", "groups": groups})
    devices = alone.num_devices
    try:
        # hsdp's shard axis is a degree too (a pinned dp_shard of 32 leaves no two replicas on 32 devices); the
        # variants of the same cluster keep it (`variants`), the fastest devices alone search their own
        kept = {k: v for k, v in _user(pins).items() if k != "dp_shard"}
        # and a `stages { }` block's blocks per stage (`Problem.split`), written for the mixed cluster's pipeline ranks
        # as its pipeline degree is: the fastest devices alone split the blocks as they run them
        split = None if isinstance(problem.split, tuple) else problem.split
        best = search(replace(problem, cluster=alone, split=split), kept, 1, explain=False, time_limit=time_limit).best
    except SearchError as error:
        return Gain(fastest, devices, mixed, None, str(error), subject)
    return Gain(fastest, devices, mixed, best.estimate, subject=subject)


def _user(pins) -> dict:
    """The user's pins that a search of another layout may keep (none of the degrees or the order)."""
    return {k: v for k, v in parse_pins(pins).items() if k not in ("dp", "tp", "pp", "cp", "ep", "order")} \
        if pins else {}


def _with_shares(scored: Scored, text: str, problem: Problem, source: Source,
                 where: str) -> tuple[Scored, str, Shared | None]:
    """The candidate with the shares `batch_shares: speed` resolves to, written out, when its replicas sit on
    different devices and that is faster and fits; else as it was (and None)."""
    plan = _checked(text, where, source)
    if plan is None or not batch.mixed_replicas(plan):
        return scored, text, None
    shared = _checked(plan_text(scored, problem, source, train_extra=(SHARES,)), where, source)
    if shared is None:
        return scored, text, None
    estimate = estimate_plan(shared)
    if estimate.time.step >= scored.estimate.time.step or not estimate.fits:
        return scored, text, None
    improved = Scored(scored.candidate, scored.blocks, estimate, shared)
    final = written_shares(plan_text(improved, problem, source, train_extra=(SHARES,)), estimate.shares, where)
    written = _checked(final, where, source)  # its header says the new figures
    if written is None or estimate_plan(written).time.step != estimate.time.step:
        return scored, text, None
    return Scored(scored.candidate, scored.blocks, estimate, written), final, Shared(scored.estimate, estimate.shares)


def written_shares(text: str, shares: tuple[int, ...], where: str = "generated.plan") -> str:
    """`text` with its `batch_shares: speed` item written out as the list of `shares`, a comment above it."""
    line = next(line for line in text.splitlines(keepends=True) if line.strip().startswith(SHARES))
    indent = line[:len(line) - len(line.lstrip())]
    listed = f"{indent}{SPEED_COMMENT}\n{indent}batch_shares: [{', '.join(map(str, shares))}],\n"
    return format_text(text.replace(line, listed, 1), where)


def _checked(text: str, where: str, source: Source) -> ir.Plan | None:
    with include(outside(source)):
        analysis = analyze(where, text=text)
    if not analysis.ok or analysis.document is None or not analysis.document.plans:
        return None
    return analysis.document.plans[0]


__all__ = ["Gain", "Shared", "faster_alone", "mixed_plans", "variants", "written_shares"]
