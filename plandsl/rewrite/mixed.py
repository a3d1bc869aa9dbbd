"""`plandsl generate` on a cluster that mixes device types: replicas on different devices get uneven shares,
and the result says what the mix gains over the faster devices alone.

Stage: rewrite, above the search (which times every data-parallel replica on the slowest device of each
pipeline rank, so it never proposes `batch_shares`). Contract: `mixed_plans(result, texts, ...)` takes the
search's checked candidates and adds, for each with data parallelism, the same layout with the data axis
outermost (its replicas on whole node groups, so on one device type each where the groups allow it); every
candidate whose replicas sit on different devices is estimated again with `batch_shares: speed`
(`cost.estimate.data_shares`) and takes it where that is faster. `faster_alone(problem, ...)` searches the
cluster's fastest node groups alone: `Gain` holds both best plans and their ratio of tokens/s.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace

from plandsl import ir
from plandsl.check.analysis import analyze
from plandsl.cost.compute import peak_of
from plandsl.cost.estimate import PlanEstimate, estimate_plan
from plandsl.ir import shares as batch
from plandsl.search import SearchError, parse_pins, search
from plandsl.search.emit import Source, outside, plan_text, written_from
from plandsl.search.problem import Problem, Scored, SearchResult
from plandsl.syntax.loader import include

SHARES = "batch_shares: speed"


@dataclass(frozen=True)
class Gain:
    """The best plan on the whole mixed cluster against the best on its fastest device type alone."""
    device: str                        # the fastest device type (by its peak at the plan's precision)
    devices: int                       # how many of them the cluster holds
    mixed: PlanEstimate                # the best plan on every device
    alone: PlanEstimate | None         # the best on the fastest devices alone; None: nothing fits on them
    reason: str = ""                   # why `alone` is None

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
        return (f"heterogeneity: the best plan on all {self.mixed.devices} devices runs {self.ratio:.2f}x the "
                f"tokens/s of the best on the {self.devices} {self.device} devices alone ({self.mixed.tokens_per_s:,.0f} "
                f"against {self.alone.tokens_per_s:,.0f}; {self.mixed.time.step:.4g} s against "
                f"{self.alone.time.step:.4g} s a step){slower}")


def mixed_plans(result: SearchResult, texts: list[str], problem: Problem, source: Source, path: str | None,
                pins, top: int, time_limit: float | None) -> tuple[SearchResult, list[str]]:
    """The search's candidates, with data-outermost variants and `batch_shares: speed` where it is faster,
    best first, at most `top` (see the module docstring)."""
    where = str(path) if path else os.path.join(os.getcwd(), "generated.plan")
    source = written_from(source, where)
    found = list(zip(result.candidates, texts))
    seen = {s.candidate for s, _ in found}
    user = _user(pins)
    if "pp" not in parse_pins(pins or ()):  # without a pipeline, a replica is one tensor group: the most to share
        try:
            flat = search(problem, {**user, "pp": 1}, top, explain=False, time_limit=time_limit).candidates
        except SearchError:
            flat = ()
        for scored in flat:
            found += _new(scored, problem, source, where, seen)
            # smaller microbatches: more of them to deal unevenly (an even split favours the largest)
            c = scored.candidate
            for mb in [d for d in range(c.micro_batch_size - 1, 0, -1) if c.micro_batch_size % d == 0][:3]:
                if "micro_batch_size" in user:
                    break
                try:
                    smaller = search(problem, {**user, **c.pins(), "micro_batch_size": mb}, 1, explain=False,
                                     time_limit=time_limit).best
                except SearchError:
                    continue
                found += _new(smaller, problem, source, where, seen)
    for scored, _ in list(found):
        c = scored.candidate
        if c.dp == 1 or (c.order and c.order[0] == "dp"):
            continue
        order = ("dp",) + tuple(a for a in c.order if a != "dp")
        try:
            variant = search(problem, {**user, **c.pins(), "order": ",".join(order)}, 1, explain=False,
                             time_limit=time_limit).best
        except SearchError:
            continue
        found += _new(variant, problem, source, where, seen)
    better = [_with_shares(scored, text, problem, source, where) for scored, text in found]
    better.sort(key=lambda pair: pair[0].estimate.time.step)
    better = better[:top]
    return SearchResult(tuple(s for s, _ in better), result.stats), [t for _, t in better]


def faster_alone(problem: Problem, mixed: PlanEstimate, pins, time_limit: float | None) -> Gain | None:
    """The best plan on the cluster's fastest node groups alone (None for a cluster of one device type)."""
    cluster = problem.cluster
    if not cluster.heterogeneous:
        return None
    peak = {g.node.device.name: peak_of(g.node.device, problem.precision) for g in cluster.groups}
    fastest = max(peak, key=lambda name: (peak[name], name))
    groups = tuple(g for g in cluster.groups if g.node.device.name == fastest)
    alone = cluster.model_copy(update={"name": f"{cluster.name}'s {fastest} nodes", "groups": groups})
    devices = alone.num_devices
    try:
        best = search(replace(problem, cluster=alone), _user(pins), 1, explain=False, time_limit=time_limit).best
    except SearchError as error:
        return Gain(fastest, devices, mixed, None, str(error))
    return Gain(fastest, devices, mixed, best.estimate)


def _user(pins) -> dict:
    """The user's pins that a search of another layout may keep (none of the degrees or the order)."""
    return {k: v for k, v in parse_pins(pins).items() if k not in ("dp", "tp", "pp", "cp", "ep", "order")} \
        if pins else {}


def _new(scored: Scored, problem: Problem, source: Source, where: str, seen: set) -> list[tuple[Scored, str]]:
    """[(the candidate, its text)] when it is not in `seen` and its text checks, else []."""
    if scored.candidate in seen:
        return []
    seen.add(scored.candidate)
    text = plan_text(scored, problem, source)
    return [(scored, text)] if _checked(text, where, source) is not None else []


def _with_shares(scored: Scored, text: str, problem: Problem, source: Source, where: str) -> tuple[Scored, str]:
    """The candidate with `batch_shares: speed` when its replicas sit on different devices and that is faster."""
    plan = _checked(text, where, source)
    if plan is None or (plan.data is not None and plan.data.sharded) or \
            len({tuple(tuple(d.name for d in types) for types in ranks)
                 for ranks in batch.replica_device_types(plan)}) < 2:
        return scored, text  # FSDP with shares holds every unit gathered through the step, which the memory model does not count
    first = plan_text(scored, problem, source, train_extra=(SHARES,))
    shared = _checked(first, where, source)
    if shared is None:
        return scored, text
    estimate = estimate_plan(shared)
    if estimate.time.step >= scored.estimate.time.step or not estimate.fits:
        return scored, text
    improved = Scored(scored.candidate, scored.blocks, estimate, shared)
    final = plan_text(improved, problem, source, train_extra=(SHARES,))  # its header says the new figures
    return (improved, final) if _checked(final, where, source) is not None else (scored, text)


def _checked(text: str, where: str, source: Source) -> ir.Plan | None:
    with include(outside(source)):
        analysis = analyze(where, text=text)
    if not analysis.ok or analysis.document is None or not analysis.document.plans:
        return None
    return analysis.document.plans[0]


__all__ = ["Gain", "faster_alone", "mixed_plans"]
