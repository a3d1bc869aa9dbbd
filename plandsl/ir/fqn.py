"""A model written in torch, by its own names: which fully qualified names (FQNs) a pattern names, and which entries
of a model's own tensor-parallel plan name something in it.

Stage: IR, torch-free, below `ir.torch_plan` and `ir.inspected` (which both read it). Patterns are Hugging Face's:
dotted FQNs where `*` is any one name component (`model.layers.*.self_attn.q_proj`).
"""
from __future__ import annotations

import functools
import re


def matches(pattern: str, fqn: str) -> bool:
    """Does the pattern name the module `fqn` exactly (`*`: one name component)?"""
    return _compiled(pattern).fullmatch(fqn) is not None


def matching(pattern: str, fqns) -> list[str]:
    """The FQNs the pattern names exactly, in their order (for one pattern; `Names` for each of a plan's)."""
    if isinstance(fqns, Names):
        return fqns.matching(pattern)
    match = _compiled(pattern).fullmatch
    return [fqn for fqn in fqns if match(fqn)]


class Names:
    """FQNs indexed for the patterns of a plan: a pattern names only FQNs of as many components as it has, each of its
    written components at its place (`*` is one component, never a dot), so its candidates are those of the FQNs
    sharing its rarest written component there, found by a dictionary lookup a component. A scan of every FQN for
    each pattern was the patterns times the FQNs: a table of 4,000 plan entries over 4,000 more modules took 3.7 s
    of `check`, 50,000 of each ten minutes."""

    def __init__(self, fqns):
        self.fqns = list(fqns)
        self._count: dict[int, list[int]] = {}
        self._part: dict[tuple[int, int, str], list[int]] = {}
        for index, fqn in enumerate(self.fqns):
            parts = fqn.split(".")
            self._count.setdefault(len(parts), []).append(index)
            for place, part in enumerate(parts):
                self._part.setdefault((len(parts), place, part), []).append(index)

    def matching(self, pattern: str) -> list[str]:
        """The FQNs the pattern names exactly, in their order."""
        parts = pattern.split(".")
        written = [self._part.get((len(parts), place, part), ()) for place, part in enumerate(parts) if part != "*"]
        candidates = min(written, key=len) if written else self._count.get(len(parts), ())
        match = _compiled(pattern).fullmatch
        return [self.fqns[index] for index in candidates if match(self.fqns[index])]


def naming_something(tp_plan, names) -> tuple[tuple[str, str], ...]:
    """The entries of a model's own tensor-parallel plan that name one of `names` (the FQNs of its modules and
    parameters). transformers skips an entry that names nothing (`_validate_parallel_plan`: "rules ... match
    nothing in Qwen2MoeForCausalLM and will not be applied"; Qwen2-MoE's class plan names a dense MLP's
    `mlp.gate_proj` where its layers hold experts), and so does plandsl for a transformers model's plan: `lower`
    keeps only these (a module's own plan is its author's: `check` says E405 of such an entry)."""
    indexed = Names(names)
    return tuple((pattern, style) for pattern, style in tp_plan if indexed.matching(pattern))


@functools.lru_cache(maxsize=1024)
def _compiled(pattern: str) -> re.Pattern:
    """The pattern as a regular expression: each component literally, `*` any one component."""
    return re.compile(r"\.".join("[^.]+" if part == "*" else re.escape(part) for part in pattern.split(".")))
