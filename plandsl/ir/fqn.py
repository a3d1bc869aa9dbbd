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
    """The FQNs the pattern names exactly, in their order."""
    match = _compiled(pattern).fullmatch
    return [fqn for fqn in fqns if match(fqn)]


def naming_something(tp_plan, names) -> tuple[tuple[str, str], ...]:
    """The entries of a model's own tensor-parallel plan that name one of `names` (the FQNs of its modules and
    parameters). transformers skips an entry that names nothing (`_validate_parallel_plan`: "rules ... match
    nothing in Qwen2MoeForCausalLM and will not be applied"; Qwen2-MoE's class plan names a dense MLP's
    `mlp.gate_proj` where its layers hold experts), and so does plandsl for a transformers model's plan: `lower`
    keeps only these (a module's own plan is its author's: `check` says E405 of such an entry)."""
    names = tuple(names)
    return tuple((pattern, style) for pattern, style in tp_plan
                 if any(map(_compiled(pattern).fullmatch, names)))


@functools.lru_cache(maxsize=1024)
def _compiled(pattern: str) -> re.Pattern:
    """The pattern as a regular expression: each component literally, `*` any one component."""
    return re.compile(r"\.".join("[^.]+" if part == "*" else re.escape(part) for part in pattern.split(".")))
