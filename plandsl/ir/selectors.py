"""Selectors over dotted names (`layers[0:8].mlp`, `layers.*.attn.wq`): which names a selector matches (`matches`,
`NameIndex`, in time proportional to what it matches) and how precise it is (`precision`: exact beats a range beats a
glob), for stage placement (`ir.placement`) and shard rules (`ir.shard_rules`, `check.sharding`).

Stage: IR. Contract: functions of the selector and the names.
"""
from __future__ import annotations

import bisect

from plandsl import ir


def matches(selector: ir.Selector, name: str, prefix: bool = False) -> bool:
    """Does `selector` match the dotted `name` (or, with `prefix`, a module under it)?"""
    return _match_components(selector.parts, name.split("."), prefix)


def _match_components(parts, components: list[str], prefix: bool) -> bool:
    if len(components) < len(parts) or (not prefix and len(components) != len(parts)):
        return False
    for part, component in zip(parts, components):
        if part.kind == "any":
            continue
        if part.kind == "name":
            if part.name != component:
                return False
        else:
            if not component.isdigit():
                return False
            index = int(component)
            if index < part.lo or (part.hi is not None and index >= part.hi):
                return False
    return True


class NameIndex:
    """Dotted names (layers or modules) in order, for fast selector lookups."""

    def __init__(self, names: list[str]):
        self.names = names
        self.position = {name: i for i, name in enumerate(names)}
        self._sorted: list[tuple[str, int]] | None = None
        self._keys: list[str] = []
        self._last_index: dict[str, int | None] = {}  # `past_the_end`'s, per head

    def select(self, selector: ir.Selector, prefix: bool = False) -> list[int]:
        """Positions of the names `selector` matches, in order."""
        parts = selector.parts
        if not prefix and all(p.kind == "name" for p in parts):
            found = self.position.get(".".join(p.name for p in parts))
            return [] if found is None else [found]
        last = parts[-1]
        if not prefix and last.kind == "range" and last.hi is not None and all(p.kind == "name" for p in parts[:-1]):
            return sorted(self._range_positions(".".join(p.name for p in parts[:-1]), last.lo, last.hi).values())
        candidates = self._candidates(parts)
        return [i for i in candidates if _match_components(parts, self.names[i].split("."), prefix)]

    def _range_positions(self, head: str, lo: int, hi: int) -> dict[int, int]:
        """{index: position} of the names `head.i` for lo <= i < hi: by the range when it is no longer than
        the names, else by the names (work bounded by the model, not by a range's end: `layers[0:10**12]`)."""
        if hi - lo <= len(self.names):
            found = ((i, self.position.get(f"{head}.{i}" if head else str(i))) for i in range(lo, hi))
            return {i: position for i, position in found if position is not None}
        prefix = f"{head}." if head else ""
        out = {}
        for name, position in self.position.items():
            rest = name[len(prefix):] if name.startswith(prefix) else None
            if rest is not None and rest.isdigit() and lo <= int(rest) < hi and rest == str(int(rest)):
                out[int(rest)] = position
        return out

    def past_the_end(self, selector: ir.Selector) -> tuple[int, int] | None:
        """For `head[lo:hi]` whose head names some layers `head.i`: (the count of those, hi) when the range
        reaches past the last of them (a plan written for a deeper model), else None."""
        parts = selector.parts
        last = parts[-1]
        if last.kind != "range" or last.hi is None or not all(p.kind == "name" for p in parts[:-1]):
            return None
        head = ".".join(p.name for p in parts[:-1])
        if head not in self._last_index:  # once per head: a stages block of many ranges reads the names once
            indices = self._range_positions(head, 0, 1 << 62)  # > len(names): by the names
            self._last_index[head] = max(indices) if indices else None
        last_index = self._last_index[head]
        if last_index is None or last.hi <= last_index + 1:
            return None
        return last_index + 1, last.hi

    def _candidates(self, parts) -> list[int]:
        """Positions of names that start with the selector's literal head (names and closed ranges)."""
        heads = [""]
        for part in parts:
            if part.kind == "name":
                heads = [f"{h}.{part.name}" if h else part.name for h in heads]
            elif part.kind == "range" and part.hi is not None and len(heads) * (part.hi - part.lo) <= 100_000:
                heads = [f"{h}.{i}" if h else str(i) for h in heads for i in range(part.lo, part.hi)]
            else:
                break
        if heads == [""]:
            return list(range(len(self.names)))
        if self._sorted is None:
            self._sorted = sorted((name, i) for i, name in enumerate(self.names))
            self._keys = [name for name, _ in self._sorted]
        found: list[int] = []
        for head in heads:
            start = bisect.bisect_left(self._keys, head)
            for name, i in self._sorted[start:]:
                if name != head and not name.startswith(head + "."):
                    if not name.startswith(head):
                        break
                    continue
                found.append(i)
        return sorted(found)


def precision(selector: ir.Selector) -> int:
    """How precisely a selector names things: exact 3, ranges 2, globs 1."""
    kinds = {p.kind for p in selector.parts}
    return 1 if "any" in kinds else 2 if "range" in kinds else 3
