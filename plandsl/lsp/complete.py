"""Completion: what may be written at the cursor, from the tables the lowering checks against: the
grammar's keywords (`syntax.parser.keywords`), the attributes of the definition (or `{ }` value) around
the cursor, the words an attribute takes, names in scope, the plan's mesh axes (after `over`, in `with`),
schedule names (built-ins and the file's), and units after a number."""
from __future__ import annotations

import re
from collections.abc import Iterator

from lsprotocol import types

from plandsl import ir
from plandsl.ir.layers import layers_of
from plandsl.lower import (
    CLUSTER_ATTRS,
    DEVICE_ATTRS,
    EFFICIENCY_KEYS,
    LINK_KEYS,
    NODE_ATTRS,
    PRECISIONS,
)
from plandsl.lower.mesh import TRAIN_KEYS
from plandsl.lower.model import FAMILIES, LAYER_ATTRS, MODEL_ATTRS
from plandsl.lower.plan import (
    CLAUSE_OPTIONS,
    CONTEXT_KINDS,
    DATA_KINDS,
    EXPERT_KINDS,
    PLAN_ATTRS,
    TENSOR_STYLES,
)
from plandsl.lower.units import UNITS
from plandsl.lsp.document import Snapshot
from plandsl.schedules.registry import BUILTIN
from plandsl.syntax.parser import keywords

Kind = types.CompletionItemKind
TOP_LEVEL = ("import", "param", "let", "device", "node", "cluster", "model", "plan", "schedule")
STATEMENT_STARTS = ("layer", "shard", "rank", "for", "on", "if", "else", "in")  # keywords no value contains
BODIES: dict[str, tuple[str, ...]] = {  # a definition's kind -> what its body's statements start with
    "device": tuple(DEVICE_ATTRS), "node": tuple(NODE_ATTRS), "cluster": tuple(CLUSTER_ATTRS),
    "model": (*MODEL_ATTRS, "layer"), "plan": (*PLAN_ATTRS, "shard"), "layer": tuple(LAYER_ATTRS),
    "stages": ("axis", "virtual", "map", "implementation", "outputs"),
}
KEYS: dict[str, tuple[str, ...]] = {  # an attribute whose value is `{ }` -> its keys
    "train": tuple(TRAIN_KEYS), "peak": PRECISIONS, "efficiency": (*EFFICIENCY_KEYS, *PRECISIONS),
    "link": tuple(LINK_KEYS), "nic": tuple(LINK_KEYS), "fabric": tuple(LINK_KEYS),
}
WORDS: dict[str, tuple[str, ...]] = {  # an attribute or key -> the words it takes
    "data": tuple(DATA_KINDS), "tensor": TENSOR_STYLES, "context": CONTEXT_KINDS, "experts": EXPERT_KINDS,
    "precision": PRECISIONS, "recompute": tuple(r.value for r in ir.Recompute),
    "recompute_modules": tuple(m.value for m in ir.RecomputeModule),
    "optimizer": tuple(o.value for o in ir.Optimizer), "kernels": tuple(k.value for k in ir.Kernels),
    "attention": tuple(a.value for a in ir.Attention),
    "loss": tuple(l.value for l in ir.Loss), "fp8_recipe": tuple(r.value for r in ir.Fp8Recipe),
    "lr_schedule": ("constant", "cosine", "linear"),
    "model": tuple(FAMILIES), "stages": ("evenly",),
    "implementation": ir.PIPELINE_IMPLEMENTATIONS,  # a `stages { }` block's `implementation = |`: whose pipeline
    "outputs": ir.PIPELINE_OUTPUTS,  # a `stages { }` block's `outputs = |`: the last stage's outputs kept or not
    **dict.fromkeys((*ir.KEPT_DTYPE_KEYS, "param_dtype"), tuple(p.value for p in ir.KEPT_DTYPES)),
}
OPTION_WORDS: dict[str, tuple[str, ...]] = {  # `with unit = |`; `overlap = |` (the tensor clause's implementations)
    "unit": tuple(u.value for u in ir.GatherUnit), "overlap": tuple(o.value for o in ir.TensorOverlap),
    "gather": tuple(p.value for p in ir.GATHER_DTYPES),  # `with gather = |`: the data clause's gather dtype
    "stages.implementation": ir.PIPELINE_IMPLEMENTATIONS,  # whose pipeline; whose ring, below: the clause decides
    "account": ir.PIPELINE_ACCOUNTED,  # `with account = [|`: what the stages' split counts beside the blocks
    "stages.outputs": ir.PIPELINE_OUTPUTS,
    "context.implementation": ir.RING_IMPLEMENTATIONS,
    "tensor.implementation": ir.TENSOR_STACKS}  # whose tensor parallelism runs the layers
CLAUSE = re.compile(r"^\s*(\w+)\s*=")  # `stages = evenly over pp with ...`: the attribute whose clause it is
AFTER_NUMBER = re.compile(r"(?<![A-Za-z_])[0-9][0-9_]*(\.[0-9_]+)?([eE][+-]?[0-9]+)?\s*$")
DEFINITION = re.compile(r"^\s*(device|node|cluster|model|plan|schedule)\s+[A-Za-z_]\w*")
OPENED_BY = re.compile(r"(?:^|[\s{,])(\w+)\s*[=:]\s*$")  # `train = {` or `peak: {`
ASSIGNED = re.compile(r"(?:^|[\s{,])(\w+)\s*[=:]\s*[^=:{}]*$")  # the attribute or key whose value is being written


def completions(snapshot: Snapshot, offset: int, previous: Snapshot | None = None) -> list[types.CompletionItem]:
    """Completion items at character `offset`; `previous`: the last version that lowered, for the names and
    axes of a file being edited into a state that does not parse."""
    text = snapshot.text
    line_start = text.rfind("\n", 0, offset) + 1
    before = text[line_start:offset]
    word = re.search(r"\w*$", before).group()
    head = before[:len(before) - len(word)]
    if AFTER_NUMBER.search(head) and not word[:1].isdigit():
        return [_item(unit, Kind.Unit, f"{dimension.name} x {factor:g}") for unit, (dimension, factor) in UNITS.items()]
    opener, definition = _context(text, offset - len(word))
    items: list[types.CompletionItem] = []
    starts = head.strip() == "" or opener in KEYS and head.rstrip().endswith(("{", ","))  # a statement or a key
    if starts:
        if opener is None:
            return [_item(k, Kind.Keyword) for k in TOP_LEVEL]
        items += [_item(name, Kind.Property) for name in BODIES.get(opener, KEYS.get(opener, ()))]
        if opener in BODIES or opener in KEYS:  # a body's statement or a `{ }` value's key: nothing else fits
            return items
    assigned = ASSIGNED.search(head)
    key = assigned.group(1) if assigned else None
    if key == "schedule":
        items += [_item(name, Kind.Function, info.summary, "0") for name, info in BUILTIN.items()]
    clause = re.search(r"\b(over|with)\b", head)  # `data = zero1 over |`: axes now, not the attribute's words
    if not clause:
        items += [_item(word_, Kind.EnumMember, None, "0") for word_ in WORDS.get(key or "", ())]
    elif re.search(r"\bwith\b", head):  # `tensor = megatron over tp with |`: the clause's options
        items += [_item(option, Kind.EnumMember, f"option of {key}", "0") for option in CLAUSE_OPTIONS.get(key or "", ())]
        clause_of = CLAUSE.match(head)
        words = OPTION_WORDS.get(f"{clause_of.group(1) if clause_of else ''}.{key}", OPTION_WORDS.get(key or "", ()))
        items += [_item(word_, Kind.EnumMember, None, "0") for word_ in words]
    plan = _plan(snapshot, previous, definition)
    if plan is not None and (clause or key == "axis"):
        items += [_item(axis.name, Kind.Variable, f"mesh axis of size {axis.size}", "0") for axis in plan.mesh.axes]
    if plan is not None and opener == "stages":  # `0: embed, layers[0:8]`: the model's layers, by group
        groups = dict.fromkeys(layer.name.split(".")[0] for layer in layers_of(plan.model))
        items += [_item(group, Kind.Field, f"layers of {plan.model.name}", "0") for group in groups]
    names = snapshot.names or (previous.names if previous else None)
    if names is not None:
        for name in sorted(names.scope.visible_names()):
            found = names.find(name)
            node = found[1] if found else None
            kind = getattr(node, "kind", None) or type(node).__name__.lower()
            items.append(_item(name, Kind.Function if kind == "schedule" else Kind.Variable, kind, "1"))
    statement = starts and opener not in KEYS
    items += [_item(k, Kind.Keyword, None, "2") for k in keywords()
              if k not in TOP_LEVEL and (statement or k not in STATEMENT_STARTS)]
    return list({item.label: item for item in reversed(items)}.values())[::-1]  # the first of each label


def _item(label: str, kind: types.CompletionItemKind, detail: str | None = None,
          rank: str = "1") -> types.CompletionItem:
    """`rank` orders the list: "0" what the position takes (words, axes, schedules), "1" names, "2" keywords."""
    return types.CompletionItem(label=label, kind=kind, detail=detail, sort_text=f"{rank}{label}")


def _context(text: str, end: int) -> tuple[str | None, str | None]:
    """What the innermost `{` open before `end` belongs to (a definition's kind, `layer`, `stages`, or the
    attribute whose value it opens) and the name of the top-level definition it is in."""
    depth, opener_at = 0, None
    for position in _braces_before(text, end):
        if text[position] == "}":
            depth += 1
        elif depth:
            depth -= 1
        else:
            opener_at = position
            break
    if opener_at is None:
        return None, None
    line_start = text.rfind("\n", 0, opener_at) + 1
    lead = text[line_start:opener_at]
    top = _top_level(text, opener_at)
    definition = top.group(0).split()[-1] if top else None
    if DEFINITION.match(lead):
        return DEFINITION.match(lead).group(1), definition
    if re.match(r"^\s*layer\b", lead):
        return "layer", definition
    if re.match(r"^\s*stages\s*$", lead):
        return "stages", definition
    opened = OPENED_BY.search(lead)
    return (opened.group(1) if opened else None), definition


def _top_level(text: str, offset: int) -> re.Match | None:
    """The last top-level definition line that starts before `offset`."""
    found = None
    for match in re.finditer(r"^(device|node|cluster|model|plan|schedule)\s+[A-Za-z_]\w*", text[:offset], re.MULTILINE):
        found = match
    return found


_MARKS = re.compile(r'[{}"#]')


def _braces_before(text: str, end: int) -> Iterator[int]:
    """The positions of the braces before `end` that are in no comment (a `#` before the line's first quote) and no
    string (after an odd number of the line's quotes), last first. Each line holding a brace is read once, and each
    kind of brace is looked for again only past where it was last found: a brace's line was sliced and split for each
    brace and each look-up of the other kind read back to its last one (a completion after 40,000 braces on one line
    took 0.8 s, 4x per doubling; after as many lines of `}` below one `{`, each step read back to the `{`)."""
    last = {"{": -1, "}": -1}
    for brace in last:
        last[brace] = text.rfind(brace, 0, end)
    position = end
    while True:
        for brace in last:
            if last[brace] >= position:
                last[brace] = text.rfind(brace, 0, position)
        at = max(last.values())
        if at < 0:
            return
        line_start = text.rfind("\n", 0, at) + 1
        found, quotes = [], 0
        for mark in _MARKS.finditer(text, line_start, at + 1):
            if mark.group() == '"':
                quotes += 1
            elif mark.group() == "#":
                if not quotes:  # a comment to the end of the line
                    break
            elif quotes % 2 == 0:
                found.append(mark.start())
        yield from reversed(found)
        position = line_start


def _plan(snapshot: Snapshot, previous: Snapshot | None, name: str | None) -> ir.Plan | None:
    for version in (snapshot, previous):
        plan = version.plan(name) if version is not None and name else None
        if plan is not None:
            return plan
    return None
