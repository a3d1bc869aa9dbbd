"""Model shapes (E220-E235): the sizes a gpt or llama model needs for its torch module to run.

Stage: checker. Contract: `check_model(plan)` yields one diagnostic per shape rule the plan's model
breaks, each at the argument that breaks it, with a hint whose numbers give a model that obeys every
rule here, its first option also as `edits` (the axes that split the model are `check.sharding`'s, E406). The rules are the
reference model's own requirements (`plandsl.runtime.models`, whose constructors refuse the same):

- E220 `hidden` divisible by `heads`: attention views q, k, v as [batch, seq, heads, hidden/heads];
- E221 `heads` divisible by `kv_heads` (so `kv_heads <= heads`): grouped-query attention gives
  each key/value head an equal group of query heads (SDPA's `enable_gqa`);
- E222 llama's head dimension even: rotary embeddings rotate each head's two halves together;
- E223 `1 <= top_k <= experts` in a mixture of experts: each token picks its top_k experts (`topk`);
- E224 a gpt's training sequence no longer than its `seq`: learned positions hold one row each;
- E225 `shared_experts` only beside routed `experts` (they join a mixture-of-experts layer);
- E226 multi-head latent attention's other arguments only with `kv_lora_rank` (which turns it on); under it the
  head dims are its own (E220 does not apply) and E222 asks for an even `qk_rope_head_dim`;
- E227 under MLA `kv_heads` equal to `heads`: each head up-projects its own keys and values from the latent;
- E228 `dense_layers` fewer than `layers`, and with `moe_every` some block left a mixture of experts;
- E229 `dense_layers`, `moe_every`, `moe_offset` and `dense_ffn` only on a mixture of experts, and `dense_ffn` only
  where some block is dense;
- E230 `moe_offset` below `moe_every` (the MoE blocks are those at moe_offset of every moe_every).
- E231 `full_every` only with a `window` (it says which blocks attend beyond the window);
- E232 a `full_every` of 2 to `layers`: 1 leaves no block windowed, more than `layers` no block full;
- W203 a `window` shorter than the training sequence: one as long attends to every key, as full attention does.
- E233 `mtp` only on a llama (rotary positions): Megatron-Core builds multi-token prediction with rope or no position
  embedding only (megatron/training/arguments.py:1229-1233 at core_v0.16.1), and a gpt's learned positions are its own;
- E234 `mtp` below the training sequence: depth k predicts the token k + 1 ahead, and a sample holds seq + 1 tokens
  (the inputs and the last target), so the deepest needs a sequence of at least mtp + 1 tokens for any position to
  have a target (Megatron rolls the labels and their mask one place a depth: seq - k positions are left);
- E235 group-limited routing as Megatron-Core's `group_limited_topk` routes (`runtime.models.MoE`): `expert_groups`
  and `group_top_k` together, on a mixture of experts, the groups dividing the experts, `group_top_k` from 1 to
  `expert_groups` and to `top_k` (a group is scored by the sum of its best `top_k // group_top_k` logits), and the
  chosen groups holding at least `top_k` experts.
"""
from __future__ import annotations

from typing import Iterator

from plandsl import ir
from plandsl.diagnostics import Diagnostic, Edit, Note, diag
from plandsl.ir.shapes import tp_splits


def check_model(plan: ir.Plan) -> Iterator[Diagnostic]:
    tp = plan.tp if plan.tensor is not None else 1
    yield from model_shapes(plan.model, tp, plan.seq, plan.train.span_of("seq"), plan.train.field_spans.get("seq"))


def model_shapes(model: ir.Model, tp: int = 1, seq: int | None = None, seq_span=None,
                 seq_item=None) -> Iterator[Diagnostic]:
    """The rules on their own: `tp` only shapes the hints, `seq` is the training sequence (None: the model's),
    `seq_span` where it is set and `seq_item` the `seq: N` item that sets it, when written."""
    if not isinstance(model, ir.TransformerModel):
        return
    if model.latent_attention:
        yield from _latent_attention(model)
        if model.head_dim:
            yield diag("E226", f"head_dim={model.head_dim} with kv_lora_rank: under multi-head latent attention a head "
                       "is qk_nope_head_dim + qk_rope_head_dim wide (v_head_dim for values); head_dim is grouped-query "
                       "attention's", model.span_of("head_dim"),
                       hint="drop head_dim, or set qk_nope_head_dim and v_head_dim")
    else:
        if model.hidden % model.heads and not model.head_dim:
            yield _hidden_heads(model, tp)
        elif model.kind == "llama" and model.head_width % 2:
            yield _odd_head_dim(model, tp)
        if model.heads % model.kv_heads:
            yield _kv_heads(model, tp)
        written = [key for key in LATENT_ARGUMENTS if getattr(model, key)]
        if written:
            yield diag("E226", f"{', '.join(f'{key}={getattr(model, key)}' for key in written)} without kv_lora_rank: "
                       "multi-head latent attention is on only with a key/value latent", model.span_of(written[0]),
                       hint="add kv_lora_rank=N (DeepSeek-V3: 512), or drop "
                            f"{' and '.join(written)} for grouped-query attention")
    if model.experts and not 1 <= model.top_k <= model.experts:
        yield _top_k(model)
    if model.shared_experts and not model.experts:
        yield diag("E225", f"shared_experts ({model.shared_experts}) on model '{model.name}', which has no experts: "
                   "shared experts sit beside routed ones in a mixture-of-experts layer", model.span_of("shared_experts"),
                   hint="add experts=N (and top_k), or drop shared_experts and widen ffn")
    if model.expert_groups or model.group_top_k:
        yield from _expert_groups(model)
    yield from _dense_layers(model)
    yield from _window(model, model.seq if seq is None else seq, seq_span)
    yield from _multi_token(model, model.seq if seq is None else seq, seq_span)
    if model.kind == "gpt" and seq is not None and seq > model.seq:
        yield _positions(model, seq, seq_span, seq_item)


LATENT_ARGUMENTS = ("q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
"""MLA's arguments besides kv_lora_rank, which turns it on (`lower.model.LATENT_ATTENTION`)."""


def _latent_attention(model: ir.TransformerModel) -> Iterator[Diagnostic]:
    if model.qk_rope_head_dim % 2:
        rope = model.qk_rope_head_dim + 1
        yield diag("E222", f"qk_rope_head_dim ({model.qk_rope_head_dim}) is odd: the rotary embedding rotates each "
                   "head's rotary part's first half with its second, so they must be equally wide",
                   model.span_of("qk_rope_head_dim"), hint=f"qk_rope_head_dim={rope} or {rope - 2}" if rope > 2
                   else f"qk_rope_head_dim={rope}", edits=_edit(model, "qk_rope_head_dim", rope))
    if model.kv_heads != model.heads:
        yield diag("E227", f"kv_heads ({model.kv_heads}) differs from heads ({model.heads}) under multi-head latent "
                   "attention: every head up-projects its own keys and values from the shared latent, so there are "
                   "as many key/value heads as heads", model.span_of("kv_heads"),
                   hint=f"kv_heads={model.heads}, or drop kv_heads (MLA saves on keys and values by their latent, kv_lora_rank)", notes=_note(model, "kv_lora_rank"),
                   edits=[Edit(model.field_spans["kv_heads"], f"kv_heads={model.heads}")]
                   if "kv_heads" in model.field_spans else [])


def _expert_groups(model: ir.TransformerModel) -> Iterator[Diagnostic]:
    """E235: the first rule of group-limited routing the model breaks (the others' hints assume it)."""
    groups, chosen, experts, top_k = model.expert_groups, model.group_top_k, model.experts, model.top_k
    written = "expert_groups" if groups else "group_top_k"
    span = model.span_of(written)
    if not experts:
        yield diag("E235", f"{written}={getattr(model, written)} on model '{model.name}', which has no experts: "
                   "group-limited routing chooses each token's experts from some groups of them", span,
                   hint="add experts=N and top_k, or drop expert_groups and group_top_k")
        return
    if not groups or not chosen:
        other = "group_top_k" if groups else "expert_groups"
        # a choice that limits the routing (half the groups, DeepSeek-V3's 4 of 8; twice the chosen groups), where
        # it can: choosing every group routes as no groups do
        if groups:
            value = max(-(-top_k // max(1, experts // groups)), min(groups // 2, top_k)) if experts % groups == 0 \
                else min(groups, top_k)
        else:
            fits = [g for g in range(chosen, experts + 1) if experts % g == 0 and chosen * (experts // g) >= top_k]
            value = next((g for g in fits if g >= 2 * chosen), fits[0] if fits else experts)
        at = model.field_spans.get(written)
        yield diag("E235", f"{written}={getattr(model, written)} without {other}: group-limited routing needs both "
                   "the groups and how many of them each token's experts come from", span,
                   hint=f"{other}={value}, or drop {written}",
                   edits=[Edit(at, f"{written}={getattr(model, written)}, {other}={value}")] if at is not None else [])
        return
    options = [g for g in range(1, experts + 1) if experts % g == 0]
    if experts % groups:
        near = min(options, key=lambda g: (abs(g - groups), g))
        yield diag("E235", f"expert_groups ({groups}) does not divide experts ({experts}): the experts form equal "
                   "groups of consecutive ones", span, hint=f"expert_groups={near}",
                   notes=_note(model, "experts"), edits=_edit(model, "expert_groups", near))
        return
    best = max(1, min(groups, top_k))
    if chosen > groups or chosen > top_k:
        bound = f"expert_groups ({groups})" if chosen > groups else f"top_k ({top_k})"
        yield diag("E235", f"group_top_k ({chosen}) exceeds {bound}: each token's experts come from group_top_k of "
                   f"the {groups} groups, each group scored by the sum of its best top_k // group_top_k logits",
                   model.span_of("group_top_k"), hint=f"group_top_k={best}",
                   notes=_note(model, "expert_groups" if chosen > groups else "top_k"),
                   edits=_edit(model, "group_top_k", best))
        return
    per_group = experts // groups
    if chosen * per_group < top_k:
        need = -(-top_k // per_group)
        hint = f"group_top_k={need}" if need <= min(groups, top_k) else \
            f"fewer groups (expert_groups={max(1, experts // top_k)})"
        yield diag("E235", f"the {chosen} group(s) each token chooses (group_top_k) hold {chosen * per_group} "
                   f"experts ({experts} / {groups} a group), fewer than top_k ({top_k}): each token's top_k experts "
                   "are chosen inside its groups",
                   model.span_of("group_top_k"), hint=hint, notes=_note(model, "top_k"),
                   edits=_edit(model, "group_top_k", need) if need <= min(groups, top_k) else [])


def _dense_layers(model: ir.TransformerModel) -> Iterator[Diagnostic]:
    interleaved = [key for key in ("moe_every", "moe_offset") if key in model.field_spans]
    if not model.dense_layers and not model.dense_ffn and not interleaved:
        return
    if not model.experts:
        written = "dense_layers" if model.dense_layers else interleaved[0] if interleaved else "dense_ffn"
        yield diag("E229", f"{written}={getattr(model, written)} on model '{model.name}', which has no experts: "
                   "dense layers come before or between the mixture-of-experts layers of a model that has them",
                   model.span_of(written), hint="add experts=N (and top_k), or drop dense_layers, moe_every, "
                   "moe_offset and dense_ffn: every block of a dense model is dense")
    elif model.moe_offset >= model.moe_every:
        every = model.moe_every
        yield diag("E230", f"moe_offset ({model.moe_offset}) is not below moe_every ({every}): block i is a "
                   f"mixture of experts where i % {every} == moe_offset, so no block would be one",
                   model.span_of("moe_offset"),
                   hint=f"moe_offset={every - 1} (the last block of every {every}, Hugging Face's) or moe_offset=0 "
                        "(the first, Megatron-LM's --moe-layer-freq)" if every > 1 else "drop moe_offset",
                   notes=_note(model, "moe_every"), edits=_edit(model, "moe_offset", every - 1))
    elif model.dense_ffn and not model.mixed_blocks:
        yield diag("E229", f"dense_ffn={model.dense_ffn} without dense layers: no block of model '{model.name}' is "
                   "dense", model.span_of("dense_ffn"),
                   hint="add dense_layers=N (DeepSeek-V3: 3) or moe_every=N (Llama 4 Maverick: 2), or drop dense_ffn")
    elif _first_moe_block(model) >= model.layers:
        fewer = model.layers - 1
        if model.moe_every == 1:
            yield diag("E228", f"dense_layers ({model.dense_layers}) leaves none of the {model.layers} layers a "
                       "mixture of experts", model.span_of("dense_layers"),
                       hint=f"dense_layers={fewer} or fewer" if fewer else "drop dense_layers, or add layers",
                       notes=_note(model, "layers"), edits=_edit(model, "dense_layers", fewer) if fewer else [])
        else:
            yield diag("E228", f"with dense_layers={model.dense_layers}, moe_every={model.moe_every} and "
                       f"moe_offset={model.moe_offset} the first mixture-of-experts block would be block "
                       f"{_first_moe_block(model)}, past the model's {model.layers} layers",
                       model.span_of("moe_every"), hint="fewer dense_layers, a smaller moe_every or moe_offset, "
                       "or more layers", notes=_note(model, "layers"))


def _first_moe_block(model: ir.TransformerModel) -> int:
    """The index of the first block `ir.TransformerModel.moe_block` makes a mixture of experts (past the layers: none)."""
    start = model.dense_layers
    return start + (model.moe_offset - start) % model.moe_every


def _window(model: ir.TransformerModel, seq: int, seq_span) -> Iterator[Diagnostic]:
    """Sliding-window attention's pattern (E231, E232) and its window against the sequence trained on (W203)."""
    if model.full_every and not model.window:
        yield diag("E231", f"full_every={model.full_every} on model '{model.name}', which has no window: full_every "
                   "says which blocks attend beyond a sliding window", model.span_of("full_every"),
                   hint="add window=N (GPT-OSS: 128, Gemma 2: 4096), or drop full_every: every block attends the "
                        "whole causal sequence")
    elif model.full_every == 1 or model.full_every > model.layers:
        which = "every block attends the whole sequence: none is windowed" if model.full_every == 1 else \
            f"block {model.full_every - 1} would be the first with full attention, but there are {model.layers}: " \
            "every block is windowed"
        options = [f"full_every={k}" for k in (2, model.layers) if 2 <= k <= model.layers]
        yield diag("E232", f"full_every={model.full_every} with {model.layers} layers: {which}",
                   model.span_of("full_every"),
                   hint=(" or ".join(dict.fromkeys(options)) + " (every k-th block full), or " if options else "")
                   + ("drop window" if model.full_every == 1 else "drop full_every: every block windowed"),
                   notes=_note(model, "layers"), edits=_edit(model, "full_every", 2) if model.layers >= 2 else [])
    if model.window and model.window >= seq:
        yield diag("W203", f"window ({model.window}) is not shorter than the {seq}-token sequence trained on: every "
                   "query attends to all the keys before it, as full causal attention does", model.span_of("window"),
                   hint=(f"window={seq // 2} or less bands the attention; " if seq >= 2 else "")  # window=0: none
                   + "drop window for full attention",
                   notes=[Note(f"training sequence {seq}", seq_span)] if seq_span is not None else [])


def _multi_token(model: ir.TransformerModel, seq: int, seq_span) -> Iterator[Diagnostic]:
    """Multi-token prediction's depths (E233, E234): on rotary positions, and each with a token to predict."""
    if not model.mtp:
        return
    if model.kind == "gpt":
        yield diag("E233", f"mtp={model.mtp} on gpt model '{model.name}': multi-token prediction embeds the tokens k "
                   "ahead at their own positions, which Megatron-Core builds with rotary or no position embeddings "
                   "only, not a gpt's learned ones", model.span_of("mtp"),
                   hint="write the model as llama(...) (rotary positions), or drop mtp")
    elif model.mtp >= seq:
        deepest = max(0, seq - 1)
        yield diag("E234", f"mtp={model.mtp} on sequences of {seq} tokens: depth {model.mtp} predicts the token "
                   f"{model.mtp + 1} ahead of each position, past the {seq + 1} tokens a sample holds",
                   model.span_of("mtp"),
                   hint=(f"mtp={deepest} or less" if deepest else "drop mtp") + f", or train on at least "
                   f"{model.mtp + 1} tokens",
                   notes=[Note(f"training sequence {seq}", seq_span)] if seq_span is not None else [],
                   edits=_edit(model, "mtp", deepest) if deepest else [])


def _shape_options(model: ir.TransformerModel, tp: int) -> tuple[str, list[int], list[int]]:
    """Models next to this one that obey E220-E222 (and keep heads divisible by tp, E406): the multiples
    of heads (of 2·heads for llama: an even head dim) nearest hidden, and the head counts nearest heads
    that divide hidden (multiples of kv_heads under grouped-query attention, which keep kv_heads valid).
    (the hint, the hidden sizes, the head counts nearest first)."""
    even = 2 if model.kind == "llama" else 1
    step = model.heads * even
    lower = model.hidden // step * step
    hiddens = [h for h in (lower + step, lower) if h > 0 and h != model.hidden]
    options = [" or ".join(f"hidden={h} (head dim {h // model.heads})" for h in sorted(hiddens))
               + f" with {model.heads} heads"]
    gqa = model.kv_heads != model.heads  # else kv_heads follows heads (gpt; llama without kv_heads)
    heads = _nearest(model.heads, lambda d: model.hidden % d == 0 and (model.hidden // d) % even == 0
                     and (not gqa or d % model.kv_heads == 0) and _splits(model, tp, heads=d))
    if heads:
        options.append(" or ".join(f"heads={d}" for d in sorted(heads)) + f" with hidden {model.hidden}")
    return "; ".join(options), hiddens, heads


WINDOW = 4096  # how far from the written value hints look (bounded work whatever the numbers)


def _nearest(value: int, fits, count: int = 2) -> list[int]:
    """Up to `count` positive integers other than `value` that `fits`, within WINDOW of it, nearest first."""
    found = []
    for distance in range(1, WINDOW + 1):
        for candidate in (value - distance, value + distance):
            if candidate > 0 and len(found) < count and fits(candidate):
                found.append(candidate)
        if len(found) == count:
            break
    return found


def _splits(model: ir.TransformerModel, tp: int, **changed: int) -> bool:
    """Whether tp splits what the hint changes of `model` (E406's rule, `ir.shapes.tp_splits`); kv_heads
    follows heads without grouped queries, and equal to heads it is heads (one extent)."""
    if "heads" in changed and model.kv_heads == model.heads:
        changed["kv_heads"] = changed["heads"]
    changed_model = model.model_copy(update=changed)
    same = ("heads",) if changed_model.kv_heads == changed_model.heads else ()
    return tp_splits(changed_model, tp, only=tuple(changed) + same)


def _edit(model: ir.TransformerModel, field: str, value: int) -> list[Edit]:
    """The hint's first option as a replacement of the argument as written (none when it was not)."""
    span = model.field_spans.get(field)
    return [Edit(span, f"{field}={value}")] if span is not None else []


def _hidden_heads(model: ir.TransformerModel, tp: int) -> Diagnostic:
    hint, hiddens, heads = _shape_options(model, tp)
    edits = _edit(model, "heads", heads[0]) if heads else _edit(model, "hidden", hiddens[0])
    return diag("E220", f"hidden ({model.hidden}) is not divisible by heads ({model.heads}): each attention head "
                f"would be {model.hidden}/{model.heads} = {model.hidden / model.heads:g} wide",
                model.span_of("heads"), hint=hint, notes=_note(model, "hidden"), edits=edits)


def _odd_head_dim(model: ir.TransformerModel, tp: int) -> Diagnostic:
    if model.head_dim:
        return diag("E222", f"head_dim ({model.head_dim}) is odd: llama's rotary embedding rotates each head's first "
                    "half with its second, so they must be equally wide", model.span_of("head_dim"),
                    hint=f"head_dim={model.head_dim + 1}", edits=_edit(model, "head_dim", model.head_dim + 1))
    head_dim = model.hidden // model.heads
    hint, hiddens, _ = _shape_options(model, tp)
    return diag("E222", f"head dim hidden/heads = {model.hidden}/{model.heads} = {head_dim} is odd: llama's rotary "
                "embedding rotates each head's first half with its second, so they must be equally wide",
                model.span_of("hidden"), hint=hint, notes=_note(model, "heads"),
                edits=_edit(model, "hidden", hiddens[0]))


def _kv_heads(model: ir.TransformerModel, tp: int) -> Diagnostic:
    """The hint: the kv_heads nearest the written one that divide heads and that tp divides (E406)."""
    fit = _nearest(model.kv_heads, lambda d: model.heads % d == 0 and d <= model.heads and _splits(model, tp, kv_heads=d))
    if not fit and _splits(model, tp, kv_heads=model.heads):
        fit = [model.heads]  # multi-head attention
    why = (f"kv_heads ({model.kv_heads}) is more than heads ({model.heads})" if model.kv_heads > model.heads
           else f"heads ({model.heads}) is not divisible by kv_heads ({model.kv_heads})")
    where = f"divides heads ({model.heads})" + (f" and tp ({tp}) divides it" if tp > 1 else "")
    return diag("E221", f"{why}: grouped-query attention gives each key/value head an equal group of query heads",
                model.span_of("kv_heads"), hint=" or ".join(f"kv_heads={d}" for d in sorted(fit)) + f" {where}"
                if fit else f"kv_heads must divide heads ({model.heads})", notes=_note(model, "heads"),
                edits=_edit(model, "kv_heads", fit[0]) if fit else [])


def _top_k(model: ir.TransformerModel) -> Diagnostic:
    top_k = min(2, model.experts)
    return diag("E223", f"top_k ({model.top_k}) must be 1 to experts ({model.experts}): each token is routed to "
                f"top_k different experts", model.span_of("top_k"),
                hint=f"top_k={top_k}" + (f" (any of 1..{model.experts})" if model.experts > 2 else ""),
                notes=_note(model, "experts"), edits=_edit(model, "top_k", top_k))


def _positions(model: ir.TransformerModel, seq: int, span, item) -> Diagnostic:
    return diag("E224", f"train seq ({seq}) is longer than the {model.seq} learned positions of model "
                f"'{model.name}': a gpt model's position embedding has one row per position (seq)", span,
                hint=f"`seq: {model.seq}` in train (or less), or seq={seq} in the model",
                notes=_note(model, "seq"), edits=[Edit(item, f"seq: {model.seq}")] if item is not None else [])


def _note(model: ir.TransformerModel, field: str) -> list[Note]:
    """Where the other number of the rule was written (a model argument)."""
    span = model.field_spans.get(field)
    return [Note(f"model argument {field}={getattr(model, field)}", span)] if span is not None else []
