"""Megatron-LM's command-line arguments (megatron-core 0.16.1) -> a formatted plan that passes `plandsl check`.

Stage: interop, beside render. Contract: `import_flags(text, path, world_size, cluster)` reads the flags as a
launch script spells them (`interop.flags`), and returns the plan's text, or Diagnostics naming the offending
flag with a caret under it: E804 (unknown, missing or malformed), E805 (contradictory), E806 (a world size the
degrees do not divide), E807 (a setting plandsl has no word for); else the checker's diagnostics on the plan
written. It never raises on flags. The facts (flag names, rank order, defaults) are `interop.megatron`'s.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from plandsl import ir
from plandsl.diagnostics import Diagnostic, did_you_mean, diag, limits
from plandsl.diagnostics.source import SourceFile, Span
from plandsl.interop import megatron as facts
from plandsl.interop.flags import WHOLE_DIGITS, Flag, read_flags, shown_value, too_long, whole_number
from plandsl.interop.result import Capped, Imported, checked, left_out
from plandsl.interop.cluster import cluster_devices, cluster_lines
from plandsl.ir.placement import counted_split
from plandsl.schedules.registry import BUILTIN, megatron_microbatch_group, microbatches_fit

KNOWN = (*facts.INT_FLAGS, *facts.FLOAT_FLAGS, *facts.CHOICE_FLAGS, *facts.TEXT_FLAGS, *facts.SWITCHES,
         *facts.LIST_FLAGS)
ZERO_OK = ("--lr-warmup-iters", "--seed", "--num-layers-at-start-in-bf16", "--num-layers-at-end-in-bf16",
           "--cpu-offloading-num-layers")
"""The integer flags that take 0 (no warmup, seed 0, no block kept in bf16 at that end, no block offloaded); the others count things."""


@dataclass
class _Read:
    """The flags' values by name (the flag that gave each, for spans) and the problems found so far."""
    values: dict[str, object]
    given: dict[str, Flag]
    problems: list[Diagnostic]
    ignored: list[str]
    source: SourceFile
    capped: dict[str, Capped] = field(default_factory=dict)   # the problems reported MAX_REPORTED of a kind at most

    def report(self, code: str, what: str, flag: Flag) -> bool:
        """Whether to report this problem of its kind (`what`: "unknown flags") one by one (`result.Capped`)."""
        return self.capped.setdefault(what, Capped(code, what)).report(flag.name, flag.span)

    def summaries(self) -> None:
        """The problems counted past each kind's first MAX_REPORTED, one diagnostic a kind, after the others."""
        for capped in self.capped.values():
            self.problems += capped.summary()

    def get(self, name: str, default=None):
        return self.values.get(name, default)

    def span(self, *names: str) -> Span:
        for name in names:
            if name in self.given:
                return self.given[name].span
        return self.source.span(0, max(0, min(len(self.source.text.rstrip()), 1)))

    def problem(self, code: str, message: str, *names: str, hint: str | None = None) -> None:
        self.problems.append(diag(code, message, self.span(*names), hint=hint))


def import_flags(text: str, path: str, world_size: int | None = None, cluster: str | None = None,
                 name: str = "megatron", plan_path: str = "megatron.plan") -> Imported:
    """The plan Megatron-LM's arguments `text` (read from `path`) describe, on `world_size` devices of
    `cluster` (a cluster expression, as `generate --cluster`; default: nodes of 8 H100s); `plan_path` is
    where the plan will be written (its imports resolve from there). ValueError for a `cluster` that is no
    cluster (it is the caller's option, not a flag)."""
    if cluster is not None:
        cluster_devices(cluster)
    source, flags = read_flags(text, path)
    read = _read(flags, source)
    sources = {path: source}
    if read.problems:
        return Imported(None, tuple(read.problems), sources, tuple(read.ignored))
    plan = _plan_text(read, world_size, cluster, name)
    if read.problems or plan is None:
        return Imported(None, tuple(read.problems), sources, tuple(read.ignored))
    return checked(plan, plan_path, sources, read.ignored)


# ---- reading the flags ----------------------------------------------------------------------------------------
def _read(flags: list[Flag], source: SourceFile) -> _Read:
    read = _Read({}, {}, [], [], source)
    for flag in flags:
        value = _value(flag, read)
        if value is None:
            continue
        earlier = read.given.get(flag.name)
        if earlier is not None and read.values[flag.name] != value and read.report("E805", "flags given twice", flag):
            read.problems.append(diag("E805", f"{flag.name} is given twice, as `{earlier.text}` and `{flag.text}` "
                                      "(Megatron-LM would keep the last silently)", flag.span,
                                      hint=f"keep one {flag.name}"))
        read.values[flag.name], read.given[flag.name] = value, flag
    read.summaries()
    return read


def _value(flag: Flag, read: _Read):
    """The typed value of one flag (True for a switch), None when it is reported or left out."""
    name, values = flag.name, flag.values
    if not name.startswith("--"):
        if read.report("E804", "words that are not flags", flag):
            read.problems.append(diag("E804", f"`{name}` is not a flag (Megatron-LM's flags start with --)", flag.span,
                                      hint="give flags and their values only, as after `pretrain_gpt.py`"))
        return None
    if name in facts.IGNORED:
        read.ignored.append(flag.text)
        return None
    if name not in KNOWN:
        if read.report("E804", "unknown flags", flag):
            suggestion = did_you_mean(name, (*KNOWN, *facts.IGNORED), "flags")
            read.problems.append(diag("E804", f"unknown flag {name}", flag.span,
                                      hint=suggestion or "plandsl reads Megatron-LM's parallelism, model shape, "
                                      "batch, precision and recompute flags (docs/interop.md)"))
        return None
    if name in facts.SWITCHES:
        if values:
            read.problems.append(diag("E804", f"{name} is a switch and takes no value, found `{' '.join(values)}`",
                                      flag.value_span, hint=f"write {name} alone"))
            return None
        return True
    if name in facts.LIST_FLAGS:  # one or more words, each a choice (argparse nargs="+")
        choices = facts.LIST_FLAGS[name]
        wrong = [value for value in values if value not in choices]
        if not values or wrong:
            read.problems.append(diag("E804", f"{name} takes one or more of {', '.join(choices)}"
                                      + (f", found `{wrong[0]}`" if wrong else ""),
                                      flag.value_span if values else flag.span,
                                      hint=(did_you_mean(wrong[0], choices, "values") if wrong else None)
                                      or f"write {name} {choices[0]}"))
            return None
        return tuple(values)
    if name == "--cp-comm-type" and len(values) > 1:  # one type per layer (arguments.py: nargs='+')
        if len(set(values)) == 1:
            values = values[:1]
        else:
            read.problems.append(diag("E807", f"--cp-comm-type gives layers different types ({' '.join(values)}): "
                                      "a plan's context parallelism is one kind for every layer", flag.value_span))
            return None
    if len(values) != 1:
        read.problems.append(diag("E804", f"{name} takes one value, found {len(values)}",
                                  flag.value_span if values else flag.span, hint=f"write {name} VALUE"))
        return None
    text = values[0]
    if name in facts.INT_FLAGS:
        number = whole_number(text)
        if number is None or number < 1 and name not in ZERO_OK:
            accepted = "an integer of zero or more" if name in ZERO_OK else "a positive integer"
            read.problems.append(diag("E804", f"{name} takes {accepted}{too_long(text)}, found {shown_value(text)}",
                                      flag.value_span))
            return None
        return number
    if name in facts.FLOAT_FLAGS:
        try:
            number = float(text)
        except ValueError:
            number = math.nan
        if not math.isfinite(number) or number < 0:
            read.problems.append(diag("E804", f"{name} takes a number of zero or more, found `{text}`",
                                      flag.value_span))
            return None
        return number
    if name in facts.CHOICE_FLAGS:
        choices = facts.CHOICE_FLAGS[name]
        if text not in choices:
            nearest = did_you_mean(text, choices, "values")
            read.problems.append(diag("E804", f"{name} {text}: not one of {', '.join(choices)}", flag.value_span,
                                      hint=nearest or f"one of {', '.join(choices)}"))
            return None
    return text


# ---- the plan ---------------------------------------------------------------------------------------------------
def _plan_text(read: _Read, world_size: int | None, cluster: str | None, name: str) -> str | None:
    model = _model(read)
    degrees = _degrees(read, world_size, cluster)
    train = _train(read)
    if model is None or degrees is None or train is None:
        return None
    tp, pp, cp, ep, dp, world, fold = degrees
    layers = read.get("--num-layers")
    stages = _stages(read, layers, pp)
    if stages is None or not _microbatch_group(read, stages, pp, dp):
        return None
    data = _data_kind(read)
    if data is None:
        return None
    gather = _gather(read, data)
    if gather is None:
        return None
    if read.get("--tp-comm-overlap") and not (read.get("--sequence-parallel") and tp > 1):
        # validate_args: sequence parallelism is turned off at tensor parallelism 1, then asserted for the overlap
        read.problem("E805", "--tp-comm-overlap " + ("without --sequence-parallel" if tp > 1 else
                                                     "at --tensor-model-parallel-size 1, where Megatron-LM turns "
                                                     "sequence parallelism off") +
                     " (Megatron-LM: 'Tensor parallel communication/GEMM overlap can happen only when sequence "
                     "parallelism is enabled')", "--tp-comm-overlap",
                     hint="add --sequence-parallel" if tp > 1 else "leave out --tp-comm-overlap")
        return None
    if read.get("--overlap-moe-expert-parallel-comm"):  # TransformerConfig.__post_init__'s other refusals (E419)
        virtual = any(flag in read.values for flag in ("--num-virtual-stages-per-pipeline-rank",
                                                       "--num-layers-per-virtual-pipeline-stage",
                                                       "--pipeline-model-parallel-layout"))
        refused = ("a pipeline without virtual stages ('virtual_pipeline_model_parallel_size must be specified when "
                   "pipeline_model_parallel_size > 1')" if pp > 1 and not virtual else
                   "--expert-model-parallel-size 1 ('only supported with expert model parallelism')"
                   if ep == 1 and not fold else
                   "an fp32 model ('only supported with bf16 or fp16 model')"
                   if not (read.get("--bf16") or read.get("--fp16")) else None)
        if refused:
            read.problem("E805", f"--overlap-moe-expert-parallel-comm with {refused}", "--overlap-moe-expert-parallel-comm",
                         hint="drop --overlap-moe-expert-parallel-comm, or give it what megatron-core asks")
            return None
    mapped = bool(read.get("--use-tp-pp-dp-mapping"))
    if mapped and ep > 1 and pp > 1:  # initialize_model_parallel's assertion (parallel_state.py)
        read.problem("E805", "--use-tp-pp-dp-mapping with expert parallelism and a pipeline: Megatron-LM needs the "
                     "pp-last order, or one data-parallel size for attention and MoE layers", "--use-tp-pp-dp-mapping",
                     hint="leave out --use-tp-pp-dp-mapping")
        return None
    # Megatron's order, innermost first; a plandsl mesh lists axes outermost first. The data axis keeps size 1
    # when ZeRO is asked for (its axis names where the optimizer states are sharded).
    order = facts.ORDER_TP_PP_DP if mapped else facts.ORDER
    sizes = {"tp": tp, "cp": cp, "ep": ep, "dp": dp // ep, "pp": pp}
    axes = [role for role in reversed(order) if sizes[role] > 1 or role == "dp" and data is not ir.DataKind.replicate
            or role == "ep" and fold]
    if not axes:
        axes = ["dp"]
    mesh = "[" + ", ".join(f"{role} = {sizes[role]}" for role in axes) + "]"
    cluster_text, imports, part = cluster_lines(cluster, world)
    lines = [f"# Imported from Megatron-LM arguments ({facts.VERSION}) by `plandsl import --from megatron`."]
    if read.ignored:
        lines.append("# Left out (a plan does not hold them): " + left_out(read.ignored, " "))
    lines += [f'import "{i}"' for i in imports] + ["", f"plan {name} {{", f"  model = {model}",
                                                    f"  cluster = {cluster_text}",
                                                    f"  mesh = {mesh}" + (f" over devices[0:{world}]" if part else ""),
                                                    f"  train = {train}"]
    if "dp" in axes:
        lines.append(f"  data = {data.value} over dp{gather}")
    elif data is not ir.DataKind.replicate and ep > 1:
        lines.append(f"  data = {data.value} over ep{gather}")
    if tp > 1:
        parallel = " with sequence_parallel" if read.get("--sequence-parallel") else ""
        # --tp-comm-overlap is Transformer Engine's userbuffers (`initialize_ub`), at its defaults without a
        # --tp-comm-overlap-cfg: the margin TE 2.x sets (`sm_margin`'s default)
        # Megatron-LM's column-parallel layers save their sequence shard (`implementation = megatron`, implied by
        # userbuffers' overlap; written otherwise under sequence parallelism, where it counts)
        userbuffers = bool(read.get("--tp-comm-overlap"))
        lines.append("  tensor = megatron over tp" + parallel + (", overlap = userbuffers" if userbuffers else "")
                     + (", implementation = megatron" if parallel and not userbuffers else ""))
    if cp > 1:
        kind = {v: k for k, v in facts.CONTEXT_COMM.items()}[read.get("--cp-comm-type", "p2p")]
        lines.append(f"  context = {kind} over cp")
    if ep > 1 or fold:
        flex = read.get("--moe-token-dispatcher-type") == "flex" or read.get("--moe-enable-deepep")
        kind = read.get("--moe-flex-dispatcher-backend", "deepep") if flex else "alltoall"
        lines.append(f"  experts = {kind} over {'[ep, tp]' if fold else 'ep'}" + (" with overlap" if read.get("--overlap-moe-expert-parallel-comm")
                                                       else ""))
    lines += stages
    return "\n".join(lines + ["}"]) + "\n"


def _model(read: _Read) -> str | None:
    # validate_args' required_args (num_layers, hidden_size, num_attention_heads, max_position_embeddings), and
    # the sequence length it asserts
    missing = [flag for flag in ("--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length",
                                 "--max-position-embeddings") if flag not in read.values]
    if "--padded-vocab-size" not in read.values and "--vocab-size" not in read.values:
        missing.append("--padded-vocab-size")
    if missing:
        read.problem("E804", f"missing {', '.join(missing)} (Megatron-LM requires them, or reads the vocabulary from "
                     "a tokenizer file plandsl does not open)", hint=f"add {' '.join(f'{m} N' for m in missing)}")
        return None
    if read.get("--num-layers") > limits.MAX_LAYERS:  # the layer patterns below are walked block by block
        read.problem("E505", f"--num-layers must be at most {limits.MAX_LAYERS:,}, found {read.get('--num-layers'):,}",
                     "--num-layers", hint="plandsl caps every count far beyond today's largest runs: see Limits in "
                     "docs/language.md")
        return None
    hidden, heads = read.get("--hidden-size"), read.get("--num-attention-heads")
    seq = read.get("--max-position-embeddings")
    if read.get("--seq-length") > seq:  # validate_args
        read.problem("E805", f"--seq-length {read.get('--seq-length')} is longer than --max-position-embeddings {seq}",
                     "--seq-length", "--max-position-embeddings")
        return None
    vocab = _vocab(read)
    if vocab is None:
        return None
    position = read.get("--position-embedding-type", "rope" if read.get("--use-rotary-position-embeddings")
                        else "learned_absolute")
    llama = read.get("--normalization") == "RMSNorm"
    family = {"--normalization": ("RMSNorm" if llama else "LayerNorm"),
              "--swiglu": read.get("--swiglu", False), "--position-embedding-type": position,
              "--disable-bias-linear": read.get("--disable-bias-linear", False)}
    wanted = {"--normalization": "RMSNorm", "--swiglu": True, "--position-embedding-type": "rope",
              "--disable-bias-linear": True} if llama else {
        "--normalization": "LayerNorm", "--swiglu": False, "--position-embedding-type": "learned_absolute",
        "--disable-bias-linear": False}
    odd = [flag for flag in family if family[flag] != wanted[flag]]
    if odd:
        kind = "llama(...) (RMSNorm, SwiGLU, rotary positions, no biases)" if llama else \
            "gpt(...) (LayerNorm, GELU, learned positions, biases)"
        read.problem("E807", f"{odd[0]}{'' if family[odd[0]] is True else ' ' + str(family[odd[0]])} does not fit "
                     f"the other flags' model: plandsl's {kind}", odd[0], "--normalization", hint=" ".join(
                         f"{f}" if wanted[f] is True else f"{f} {wanted[f]}" for f in odd if wanted[f] is not False)
                     or f"leave out {' '.join(odd)}")
        return None
    ffn = read.get("--ffn-hidden-size")
    if ffn is None:  # validate_args: int((4h * 2/3) / 64) * 64 with --swiglu, else 4h
        ffn = int((4 * hidden * 2 / 3) / 64) * 64 if llama else 4 * hidden
    args = [f"layers={read.get('--num-layers')}", f"hidden={hidden}", f"heads={heads}"]
    if read.get("--group-query-attention"):  # core_transformer_config_from_args: num_query_groups only with it
        args.append(f"kv_heads={read.get('--num-query-groups', 1)}")
    elif "--num-query-groups" in read.values:
        read.problem("E805", "--num-query-groups without --group-query-attention (Megatron-LM then ignores it)",
                     "--num-query-groups", hint="add --group-query-attention")
        return None
    channels = read.get("--kv-channels")  # validate_args: hidden_size // num_attention_heads when not given
    if channels is None and hidden % heads:
        channels = hidden // heads  # the floor Megatron takes: a head width a plan must write, hidden / heads is none
    if channels is not None and channels * heads != hidden:
        if not llama or read.get("--multi-latent-attention"):
            read.problem("E807", f"--kv-channels {channels} is not --hidden-size / --num-attention-heads "
                         f"({hidden // heads}): only plandsl's llama(...) with grouped-query attention has a head_dim of "
                         "its own", "--kv-channels", hint=f"--kv-channels {hidden // heads}, or leave it out")
            return None
        args.append(f"head_dim={channels}")
    latent = _latent_attention(read)
    if latent is None:
        return None
    args += latent
    if read.get("--num-experts") and read.get("--moe-ffn-hidden-size"):
        dense_ffn, ffn = ffn, read.get("--moe-ffn-hidden-size")  # --ffn-hidden-size is then the dense layers'
    else:
        dense_ffn = None
    args += [f"ffn={ffn}", f"seq={seq}", f"vocab={vocab}"]
    if read.get("--num-experts"):
        if not llama:
            read.problem("E807", "--num-experts with a gpt(...) model: plandsl's mixtures of experts are llama(...) "
                         "models", "--num-experts", hint="add --normalization RMSNorm --swiglu "
                         "--position-embedding-type rope --disable-bias-linear")
            return None
        args += [f"experts={read.get('--num-experts')}", f"top_k={read.get('--moe-router-topk', 2)}"]
        groups, group_top_k = read.get("--moe-router-num-groups"), read.get("--moe-router-group-topk")
        if groups and not group_top_k:  # moe_utils' _compute_topk groups only with group_topk: routed ungrouped
            read.ignored.append(read.given["--moe-router-num-groups"].text)
        elif group_top_k and not groups:  # group_limited_topk would view the scores in no number of groups
            read.problem("E805", "--moe-router-group-topk without --moe-router-num-groups: Megatron-Core's "
                         "group-limited routing needs the number of groups", "--moe-router-group-topk",
                         hint="add --moe-router-num-groups N, or drop --moe-router-group-topk")
            return None
        elif groups:  # E235 checks them as the model's (the groups dividing the experts, ...)
            args += [f"expert_groups={groups}", f"group_top_k={group_top_k}"]
        shared = read.get("--moe-shared-expert-intermediate-size")
        if shared:
            if shared % ffn:
                read.problem("E807", f"--moe-shared-expert-intermediate-size {shared}: a plan's shared experts are a "
                             f"whole number of experts of --ffn-hidden-size {ffn}", "--moe-shared-expert-intermediate-size",
                             hint=f"--moe-shared-expert-intermediate-size {max(1, round(shared / ffn)) * ffn}")
                return None
            args.append(f"shared_experts={shared // ffn}")
        kinds = _block_kinds(read, read.get("--num-layers"))
        if kinds is None:
            return None
        if kinds:
            args += kinds + [f"dense_ffn={dense_ffn or ffn}"]
    elif any(flag in read.values for flag in MOE_ONLY):
        given = next(flag for flag in MOE_ONLY if flag in read.values)
        read.problem("E805", f"{given} without --num-experts", given, hint="add --num-experts N")
        return None
    window = _window(read, read.get("--num-layers"))
    if window is None:
        return None
    args += window
    args.append(f"tied={'false' if read.get('--untie-embeddings-and-output-weights') else 'true'}")
    if read.get("--mtp-num-layers"):  # multi-token prediction's depths (the checker's E233 refuses them on a gpt)
        args.append(f"mtp={read.get('--mtp-num-layers')}")
    return f"{'llama' if llama else 'gpt'}({', '.join(args)})"


def _window(read: _Read, layers: int) -> list[str] | None:
    """--window-size LEFT,0 (LEFT + 1 keys: window=LEFT+1), --window-attn-skip-freq N or a list that is every N-th layer
    full (full_every=N), --softmax-type learnable (sinks=true). A window with a right side, a list of another pattern
    and the off-by-one softmax (a fixed offset, no parameter) are E807."""
    args = []
    text = read.get("--window-size")
    sides = re.fullmatch(r"\(?\s*(-?[0-9]{1,%d})\s*,\s*(-?[0-9]{1,%d})\s*\)?" % (WHOLE_DIGITS, WHOLE_DIGITS), text) \
        if text is not None else None
    if text is not None and sides is None:
        read.problem("E804", f"--window-size {text}: two integers LEFT,RIGHT", "--window-size", hint="--window-size 127,0")
        return None
    if sides is not None:
        left, right = int(sides[1]), int(sides[2])
        if right != 0 or left < 0:
            read.problem("E807", f"--window-size {text}: a plan's sliding window is causal, (window - 1, 0)",
                         "--window-size", hint=f"--window-size {left},0" if left >= 0 else
                         "leave --window-size out for full causal attention (Transformer Engine reads a left of -1 as "
                         "unbounded), or --window-size W-1,0 for a window of W")
            return None
        args.append(f"window={left + 1}")
    skip = read.get("--window-attn-skip-freq")
    if skip is not None:
        every = whole_number(skip)
        if every is not None:  # is_layer_window_attention: layer_number % N != 0 is windowed
            pattern = [int((i + 1) % every != 0) for i in range(layers)] if every > 0 else None
        else:
            pattern = _layer_pattern(skip, layers)
        # the one N that could give it: the first full layer's number (N > layers: none full), then checked whole,
        # in one pass however many layers (trying every N was quadratic: minutes at 100,000 layers)
        every = None if pattern is None else next((i + 1 for i, windowed in enumerate(pattern) if not windowed),
                                                  layers + 1)
        if every is not None and pattern != [int((i + 1) % every != 0) for i in range(layers)]:
            every = None
        if sides is None or every is None:
            read.problem("E807" if pattern is not None else "E804",
                         f"--window-attn-skip-freq {skip}: " + ("a plan's full-attention layers are every N-th, the "
                         "others windowed" if sides is not None else "without --window-size"),
                         "--window-attn-skip-freq", hint="--window-attn-skip-freq 2" if sides is not None
                         else "add --window-size LEFT,0")
            return None
        if every <= layers:  # a pattern with no full layer is a window on every layer
            args.append(f"full_every={every}")
    softmax = read.get("--softmax-type")
    if softmax == "off-by-one":
        read.problem("E807", "--softmax-type off-by-one: a fixed offset in the softmax; a plan's sinks are learned "
                     "(learnable)", "--softmax-type", hint="--softmax-type learnable")
        return None
    if softmax == "learnable":
        args.append("sinks=true")
    return args


LATENT_FLAGS = {"--q-lora-rank": "q_lora_rank", "--kv-lora-rank": "kv_lora_rank", "--qk-head-dim": "qk_nope_head_dim",
                "--qk-pos-emb-head-dim": "qk_rope_head_dim", "--v-head-dim": "v_head_dim"}
# Megatron-LM's defaults of the MLA flags (arguments.py, _add_mla_args): no query latent, 32, 128, 64, 128
LATENT_DEFAULTS = {"--q-lora-rank": None, "--kv-lora-rank": 32, "--qk-head-dim": 128, "--qk-pos-emb-head-dim": 64,
                   "--v-head-dim": 128}


def _latent_attention(read: _Read) -> list[str] | None:
    """--multi-latent-attention and its shapes as llama()'s MLA arguments (Megatron-LM's defaults where not
    given; its YaRN positions are plain rotary ones in a plan: no parameter or FLOP differs)."""
    given = [flag for flag in LATENT_FLAGS if flag in read.values]
    if not read.get("--multi-latent-attention"):
        if given:
            read.problem("E805", f"{given[0]} without --multi-latent-attention (Megatron-LM then ignores it)",
                         given[0], hint="add --multi-latent-attention")
            return None
        return []
    if read.get("--normalization") != "RMSNorm":
        read.problem("E807", "--multi-latent-attention with a gpt(...) model: plandsl's multi-head latent attention "
                     "is llama(...)'s", "--multi-latent-attention", hint="add --normalization RMSNorm --swiglu "
                     "--position-embedding-type rope --disable-bias-linear")
        return None
    if read.get("--group-query-attention"):
        read.problem("E807", "--group-query-attention with --multi-latent-attention: every MLA head has its own keys "
                     "and values", "--group-query-attention", hint="leave out --group-query-attention")
        return None
    values = {flag: read.get(flag, default) for flag, default in LATENT_DEFAULTS.items()}
    return [f"{LATENT_FLAGS[flag]}={value}" for flag, value in values.items() if value is not None]


MOE_ONLY = ("--moe-router-topk", "--moe-layer-freq", "--moe-ffn-hidden-size", "--moe-router-num-groups",
            "--moe-router-group-topk")
"""Flags that mean something only beside --num-experts (E805 without it)."""


def _block_kinds(read: _Read, layers: int) -> list[str] | None:
    """--moe-layer-freq as llama()'s dense_layers, moe_every and moe_offset (none written: every layer MoE): an
    integer N (MoE where i % N == 0: moe_every=N, moe_offset=0) or a list of 0 (dense) and 1 (MoE) per layer whose
    MoE layers are every N-th from the first to the last period (D zeros then ones: dense_layers=D); another
    pattern (MoE layers at uneven steps, or none) is E807."""
    text = read.get("--moe-layer-freq")
    if text is None:
        return []
    pattern = _layer_pattern(text, layers)
    if pattern is None:
        read.problem("E804", f"--moe-layer-freq {text}: an integer or a list of 0 (dense) and 1 (MoE) per layer, "
                     f"{layers} long", "--moe-layer-freq", hint=f"--moe-layer-freq \"([0]*1+[1]*{layers - 1})\"")
        return None
    moe = [i for i, kind in enumerate(pattern) if kind]
    first = moe[0] if moe else layers
    every = moe[1] - moe[0] if len(moe) > 1 else 1 if first == layers - 1 else layers - first
    if not moe or moe != list(range(first, layers, every)):
        read.problem("E807", f"--moe-layer-freq {text}: a plan's mixture-of-experts layers are every N-th layer after "
                     "its first dense ones, to the last (dense_layers, moe_every, moe_offset)", "--moe-layer-freq",
                     hint=f"--moe-layer-freq \"([0]*{min(first, layers - 1)}+[1]*{layers - min(first, layers - 1)})\"")
        return None
    offset = first % every
    dense = 0 if first < every else first - every + 1  # the fewest leading dense layers that leave `first` the first
    kinds = [f"dense_layers={dense}"] if dense else []
    if every > 1:
        kinds.append(f"moe_every={every}")
        if offset != every - 1:  # llama()'s default: the last of every N (Hugging Face's)
            kinds.append(f"moe_offset={offset}")
    return kinds


def _layer_pattern(text: str, layers: int) -> list[int] | None:
    """Megatron-LM's moe_freq_type without eval: an integer N (layer i is MoE when i % N == 0), or an expression of
    list literals of 0 and 1, `*` by integers and `+` (at most `layers` entries, as the pattern must have)."""
    import ast  # lazy: only a --moe-layer-freq pattern parses Python
    every = whole_number(text)
    if every is not None:
        return [1 if i % every == 0 else 0 for i in range(layers)] if every > 0 else None

    def value(node):
        if isinstance(node, ast.List) and all(isinstance(e, ast.Constant) and e.value in (0, 1) and
                                              type(e.value) is int for e in node.elts):
            return [e.value for e in node.elts]
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Add) and isinstance(left, list) and isinstance(right, list):
                return left + right
            if isinstance(node.op, ast.Mult) and {type(left), type(right)} == {list, int}:
                items, times = (left, right) if isinstance(left, list) else (right, left)
                return items * times if 0 <= times and len(items) * times <= layers else None
        return None

    try:
        found = value(ast.parse(text.strip(), mode="eval").body)
    except (SyntaxError, ValueError, RecursionError):
        return None
    return found if isinstance(found, list) and len(found) == layers else None


def _vocab(read: _Read) -> int | None:
    padded, raw = read.get("--padded-vocab-size"), read.get("--vocab-size")
    if raw is None:
        return padded
    # tokenizer._vocab_size_with_padding: up to a multiple of make_vocab_size_divisible_by x tp
    multiple = read.get("--make-vocab-size-divisible-by", 128) * read.get("--tensor-model-parallel-size", 1)
    rounded = -(-raw // multiple) * multiple
    if padded is not None and padded != rounded:
        read.problem("E805", f"--padded-vocab-size {padded} but --vocab-size {raw} pads to {rounded}",
                     "--padded-vocab-size", hint="keep one of them")
        return None
    return rounded


def _dtypes(read: _Read) -> list[str] | None:
    """The precision-aware optimizer's dtype flags as the plan's master_dtype, grad_dtype, optimizer_dtype."""
    given = [name for names in facts.DTYPE_FLAGS.values() for name in names if read.get(name) is not None]
    if not read.get("--use-precision-aware-optimizer"):
        if given:
            read.problem("E805", f"{given[0]} without --use-precision-aware-optimizer, which Megatron-LM's optimizer "
                         "reads it with", given[0], hint="add --use-precision-aware-optimizer, or drop the dtype flags")
            return None
        return []
    if not (read.get("--use-distributed-optimizer") or read.get("--use-megatron-fsdp")):
        read.problem("E805", "--use-precision-aware-optimizer without the distributed optimizer (Megatron-Core: "
                     "\"only supported with distributed optimizer\")", "--use-precision-aware-optimizer",
                     hint="add --use-distributed-optimizer")
        return None
    average, square = read.get("--exp-avg-dtype", "fp32"), read.get("--exp-avg-sq-dtype", "fp32")
    if average != square:
        read.problem("E807", f"--exp-avg-dtype {average} and --exp-avg-sq-dtype {square}: a plan keeps Adam's m and v "
                     "in one optimizer_dtype", "--exp-avg-sq-dtype", hint=f"--exp-avg-sq-dtype {average}")
        return None
    if average == "fp8":
        read.problem("E807", "--exp-avg-dtype fp8: a plan's optimizer_dtype is fp32, bf16 or fp16", "--exp-avg-dtype")
        return None
    values = {"master_dtype": read.get("--main-params-dtype", "fp32"), "grad_dtype": read.get("--main-grads-dtype", "fp32"),
              "optimizer_dtype": average}
    return [f"{key}: {value}" for key, value in values.items() if value != "fp32"]


def _bf16_layers(read: _Read, precision: str) -> list[str] | None:
    """--first-last-layers-bf16 with --num-layers-at-start-in-bf16 / --num-layers-at-end-in-bf16 (1 each by default,
    TransformerConfig) as the train items `bf16_first_layers` and `bf16_last_layers`; the counts without the switch
    mean nothing to Megatron-LM and are read as nothing; the switch without FP8 or FP4 is E807, and so is it with
    delayed scaling (--fp8-recipe delayed, the default), which megatron-core's TransformerConfig refuses ("Delayed
    scaling does not support first / last layer in BF16.")."""
    if not read.get("--first-last-layers-bf16"):
        return []
    if precision not in ("fp8", "mxfp8", "nvfp4"):
        read.problem("E807", f"--first-last-layers-bf16 with {precision}: it keeps blocks in bf16 that FP8 or FP4 would "
                     "quantize", "--first-last-layers-bf16", hint="add --fp8-format, or remove --first-last-layers-bf16")
        return None
    if precision == "fp8" and read.get("--fp8-recipe", "delayed") == "delayed":
        read.problem("E807", "--first-last-layers-bf16 with delayed scaling: megatron-core refuses it (\"Delayed scaling "
                     "does not support first / last layer in BF16.\")", "--first-last-layers-bf16",
                     hint="--fp8-recipe tensorwise (current scaling), or remove --first-last-layers-bf16")
        return None
    counts = (read.get("--num-layers-at-start-in-bf16", 1), read.get("--num-layers-at-end-in-bf16", 1))
    return [f"{key}: {count}" for key, count in zip(("bf16_first_layers", "bf16_last_layers"), counts) if count]


def _train(read: _Read) -> str | None:
    micro = read.get("--micro-batch-size")
    if micro is None:
        read.problem("E804", "missing --micro-batch-size (Megatron-LM requires it)", hint="add --micro-batch-size N")
        return None
    if read.get("--bf16") and read.get("--fp16"):
        read.problem("E805", "both --bf16 and --fp16", "--fp16", hint="keep one")
        return None
    precision = "bf16" if read.get("--bf16") else "fp16" if read.get("--fp16") else "fp32"
    fp8_recipe = None
    if read.get("--fp8-format") is not None:
        if precision != "bf16":
            read.problem("E807", f"--fp8-format with {precision}: a plan's fp8 runs the matmuls it leaves out of FP8 in "
                         "bf16", "--fp8-format", hint="add --bf16")
            return None
        recipe = read.get("--fp8-recipe", "delayed")
        if recipe == "custom":
            read.problem("E807", "--fp8-recipe custom: a plan's FP8 is per-tensor (fp8) or MXFP8 block scaling (mxfp8)",
                         "--fp8-recipe", hint="--fp8-recipe mxfp8, or delayed")
            return None
        # either format; delayed, tensorwise (TE's current scaling) and blockwise scaling are the plan's fp8 with
        # that recipe (`facts.FP8_RECIPES`), mxfp8 its mxfp8
        precision = "mxfp8" if recipe == "mxfp8" else "fp8"
        if read.get("--fp8-recipe") is not None and recipe != "mxfp8":
            fp8_recipe = next(ours for ours, theirs in facts.FP8_RECIPES.items() if theirs == recipe)
    elif read.get("--fp8-recipe") is not None:
        read.problem("E807", "--fp8-recipe without --fp8-format: Megatron-LM trains without FP8 then", "--fp8-recipe",
                     hint="add --fp8-format e4m3, or remove --fp8-recipe")
        return None
    if read.get("--fp4-format") is not None:
        if precision != "bf16" or read.get("--fp8-format") is not None:
            why = "--fp8-format too" if read.get("--fp8-format") is not None else precision
            read.problem("E807", f"--fp4-format with {why}: a plan's nvfp4 runs the blocks' linear layers in FP4 "
                         "and the rest in bf16", "--fp4-format", hint="--bf16, without --fp8-format")
            return None
        if read.get("--fp4-recipe", "nvfp4") != "nvfp4":
            read.problem("E807", "--fp4-recipe custom: a plan's FP4 is NVFP4 block scaling (nvfp4)", "--fp4-recipe",
                         hint="--fp4-recipe nvfp4")
            return None
        precision = "nvfp4"
    elif read.get("--fp4-recipe") is not None:
        read.problem("E807", "--fp4-recipe without --fp4-format: Megatron-LM trains without FP4 then", "--fp4-recipe",
                     hint="add --fp4-format e2m1, or remove --fp4-recipe")
        return None
    recompute = _recompute(read)
    if recompute is None:
        return None
    bf16_layers = _bf16_layers(read, precision)
    if bf16_layers is None:
        return None
    items = [f"global_batch: {read.get('--global-batch-size', 0)}", f"micro_batch: {micro}",
             f"precision: {precision}", *([f"fp8_recipe: {fp8_recipe.value}"] if fp8_recipe else []), *bf16_layers,
             *recompute]
    if read.get("--cpu-offloading-num-layers", 0):  # > 0 turns cpu_offloading on (validate_args)
        items.append(f"offload_layers: {read.get('--cpu-offloading-num-layers')}")
    if read.get("--attention-backend") in facts.MATERIALIZED_BACKENDS:
        items.append("attention: materialized")
    # Megatron's own cross entropy op by op (`ir.Loss.megatron`); --cross-entropy-loss-fusion: its jit-fused one, read
    # as `standard` (the export's spelling of it), or with --cross-entropy-fusion-impl te Transformer Engine's (`fused`)
    if not read.get("--cross-entropy-loss-fusion"):
        items.append("loss: megatron")
    elif read.get("--cross-entropy-fusion-impl") == "te":
        items.append("loss: fused")
    if precision != "fp32":  # Megatron keeps the weights 16-bit (bf16 under FP8) beside its fp32 main params
        items.append(f"param_dtype: {'bf16' if precision in ('fp8', 'mxfp8', 'nvfp4') else precision}")
    seq, positions = read.get("--seq-length"), read.get("--max-position-embeddings")
    if positions is not None and seq != positions:
        items.append(f"seq: {seq}")
    optimizer = read.get("--optimizer", "adam")
    if optimizer not in ("adam", "sgd"):
        read.problem("E807", f"--optimizer {optimizer}: a plan's optimizer is adam or sgd", "--optimizer")
        return None
    style = read.get("--lr-decay-style", "linear")  # SchedulerConfig.lr_decay_style defaults to linear
    if style not in facts.LR_STYLES:
        read.problem("E807", f"--lr-decay-style {style}: a plan's lr_schedule is constant, cosine or linear",
                     "--lr-decay-style")
        return None
    dtypes = _dtypes(read)
    if dtypes is None:
        return None
    items += dtypes
    clip = read.get("--clip-grad", 1.0)
    items += [f"optimizer: {optimizer}", f"lr: {read.get('--lr', 3e-4)!r}", f"lr_schedule: {style}",
              f"warmup_steps: {read.get('--lr-warmup-iters', 0)}",
              f"grad_clip: {repr(clip) if clip > 0 else 'none'}", f"seed: {read.get('--seed', 1234)}"]
    return "{ " + ", ".join(items) + " }"


def _recompute(read: _Read) -> list[str] | None:
    """The plan's recompute items: `recompute: MODE`, and `recompute_layers: N` for the block method."""
    granularity = read.get("--recompute-granularity", "selective" if read.get("--recompute-activations") else None)
    method, count = read.get("--recompute-method"), read.get("--recompute-num-layers")
    if granularity != "selective" and read.get("--recompute-modules") is not None:
        # TransformerConfig reads recompute_modules under selective granularity only
        read.ignored.append(read.given["--recompute-modules"].text)
    if granularity is None:
        if method is not None or count is not None:
            read.problem("E805", "--recompute-method or --recompute-num-layers without --recompute-granularity",
                         "--recompute-method", "--recompute-num-layers", hint="add --recompute-granularity full")
            return None
        return ["recompute: none"]
    if granularity == "selective":
        if method is not None or count is not None:  # validate_args / TransformerConfig: selective takes neither
            read.problem("E805", "--recompute-granularity selective takes no --recompute-method or "
                         "--recompute-num-layers", "--recompute-method", "--recompute-num-layers")
            return None
        modules = read.get("--recompute-modules")
        if modules is None:
            return ["recompute: selective"]
        if "moe_act" in modules and not any(text.split()[0] == "--moe-grouped-gemm" for text in read.ignored):
            read.problem("E805", "--recompute-modules moe_act without --moe-grouped-gemm (megatron-core: \"moe_act in "
                         "recompute_modules is only supported with moe_grouped_gemm\")", "--recompute-modules",
                         hint="add --moe-grouped-gemm")
            return None
        return ["recompute: selective", f"recompute_modules: [{', '.join(dict.fromkeys(modules))}]"]
    if read.get("--overlap-moe-expert-parallel-comm"):  # TransformerConfig.__post_init__ refuses it (E418)
        read.problem("E805", "--overlap-moe-expert-parallel-comm with --recompute-granularity full (megatron-core: "
                     "\"disable full recomputation when enabling overlap_moe_expert_parallel_comm\")",
                     "--recompute-granularity", hint="--recompute-granularity selective, or drop "
                     "--overlap-moe-expert-parallel-comm")
        return None
    if method is None or count is None:  # TransformerConfig.__post_init__: full needs a method and a count
        read.problem("E804", "--recompute-granularity full needs --recompute-method and --recompute-num-layers",
                     "--recompute-granularity", hint="add --recompute-method uniform --recompute-num-layers 1")
        return None
    if method == "block":  # the first N blocks of each stage (virtual chunk) from their inputs
        return ["recompute: full", f"recompute_layers: {count}"]
    if method != "uniform" or count != 1:
        read.problem("E807", f"--recompute-method {method} --recompute-num-layers {count}: a plan recomputes every "
                     "block from its own input (uniform, 1), the first N of each stage (block, N) or none",
                     "--recompute-method", hint="use --recompute-method uniform --recompute-num-layers 1")
        return None
    return ["recompute: full"]


def _degrees(read: _Read, world_size: int | None, cluster: str | None):
    tp, pp = read.get("--tensor-model-parallel-size", 1), read.get("--pipeline-model-parallel-size", 1)
    cp, ep = read.get("--context-parallel-size", 1), read.get("--expert-model-parallel-size", 1)
    # MoE parallel folding: --expert-tensor-parallel-size 1 beside tensor parallelism folds the tensor axis into
    # the expert group (`experts = alltoall over [ep, tp]`), whose ep axis is then the group over tp
    group, rest = divmod(ep, tp)  # the expert group holds whole tensor groups
    fold = tp > 1 and read.get("--expert-tensor-parallel-size", tp) == 1 and not rest
    if fold:
        ep = group
    for flag in ("--expert-tensor-parallel-size", "--num-distributed-optimizer-instances"):
        default = (1 if fold else tp) if flag == "--expert-tensor-parallel-size" else 1
        if read.get(flag, default) != default:
            read.problem("E807", f"{flag} {read.get(flag)}: a plan splits experts over the whole tensor axis or folds "
                         "it into an expert group of a multiple of its size (--expert-tensor-parallel-size 1), and "
                         "shards optimizer states over the whole data axis", flag)
            return None
    comm = read.get("--cp-comm-type", "p2p")
    if cp > 1 and comm not in facts.CONTEXT_COMM.values():
        read.problem("E807", f"--cp-comm-type {comm}: a plan's context parallelism gathers K and V (all_gather) or "
                     "passes them around a ring (p2p)", "--cp-comm-type", hint="use --cp-comm-type all_gather or p2p")
        return None
    if cp > 1 and (ep > 1 or fold):
        read.problem("E807", "--context-parallel-size with --expert-model-parallel-size: Megatron-LM folds the expert "
                     "axis into context x data, which a plan's separate axes do not say",
                     "--expert-model-parallel-size")
        return None
    world = world_size if world_size is not None else cluster_devices(cluster)
    if world is None:
        return None
    model = tp * pp * cp
    if world % model:  # validate_args: world size divisible by tp x pp x cp
        read.problem("E806", f"world size {world} is not divisible by tensor({tp}) x pipeline({pp}) x context({cp}) "
                     f"= {model}", *[flag for flag, degree in (("--tensor-model-parallel-size", tp),
                                                               ("--pipeline-model-parallel-size", pp),
                                                               ("--context-parallel-size", cp)) if degree > 1],
                     hint=f"a world size that is a multiple of {model}")
        return None
    dp = world // model
    if dp % ep:  # initialize_model_parallel: expert data parallel = world / (tp x ep x pp)
        read.problem("E806", f"data-parallel size {dp} (world {world} / {model}) is not divisible by "
                     f"--expert-model-parallel-size {ep}", "--expert-model-parallel-size",
                     hint=f"a world size that is a multiple of {model * ep}")
        return None
    if "--global-batch-size" not in read.values:  # validate_args: micro x data parallel
        read.values["--global-batch-size"] = read.get("--micro-batch-size", 1) * dp
    return tp, pp, cp, ep, dp, world, fold


def _gather(read: _Read, data: ir.DataKind) -> str | None:
    """`--fp8-param-gather` -> the data line's ` with gather = fp8` ("" without it); E805 without the distributed
    optimizer or Megatron-FSDP (validate_args: "--fp8-param-gather only supported with distributed optimizer, torch
    fsdp2, megatron fsdp, or inference mode") or without FP8 weights to gather (no --fp8-format)."""
    if not read.get("--fp8-param-gather"):
        return ""
    if data is ir.DataKind.replicate:
        read.problem("E805", "--fp8-param-gather without --use-distributed-optimizer or --use-megatron-fsdp (Megatron-LM: "
                     "\"--fp8-param-gather only supported with distributed optimizer, torch fsdp2, megatron fsdp, or "
                     "inference mode\")", "--fp8-param-gather", hint="add --use-distributed-optimizer")
        return None
    if read.get("--fp8-format") is None:
        read.problem("E805", "--fp8-param-gather without --fp8-format: without FP8 training there are no FP8 weights to "
                     "gather", "--fp8-param-gather", hint="add --fp8-format hybrid, or leave out --fp8-param-gather")
        return None
    return " with gather = fp8"


def _data_kind(read: _Read) -> ir.DataKind | None:
    optimizer, fsdp = read.get("--use-distributed-optimizer"), read.get("--use-megatron-fsdp")
    strategy = read.get("--data-parallel-sharding-strategy")
    if fsdp:
        if read.get("--ckpt-format") != "fsdp_dtensor":  # validate_args
            read.problem("E805", "--use-megatron-fsdp needs --ckpt-format fsdp_dtensor (Megatron-LM: \"Megatron FSDP "
                         "only supports fsdp_dtensor checkpoint format\")", "--use-megatron-fsdp",
                         hint="add --ckpt-format fsdp_dtensor")
            return None
        return facts.SHARDING_KIND[strategy or "no_shard"]
    if strategy not in (None, "no_shard"):
        read.problem("E805", f"--data-parallel-sharding-strategy {strategy} without --use-megatron-fsdp "
                     "(Megatron-LM's DDP ignores it)", "--data-parallel-sharding-strategy",
                     hint="add --use-megatron-fsdp --ckpt-format fsdp_dtensor")
        return None
    return ir.DataKind.zero1 if optimizer else ir.DataKind.replicate


def _stages(read: _Read, layers: int, pp: int) -> list[str] | None:
    """The plan's `stages` and `schedule` lines (none without a pipeline)."""
    chosen = [flag for flag in ("--pipeline-model-parallel-layout", "--num-virtual-stages-per-pipeline-rank",
                                "--num-layers-per-virtual-pipeline-stage") if flag in read.values]
    chosen.sort(key=lambda flag: read.given[flag].span.start)  # the caret under the one written later
    if len(chosen) > 1:  # validate_args: "No more than one of the following arguments can be set at the same time"
        read.problem("E805", f"both {chosen[0]} and {chosen[1]}: Megatron-LM takes at most one of them", chosen[1],
                     hint=f"keep {chosen[0]} or {chosen[1]}")
        return None
    first, last = read.get("--decoder-first-pipeline-num-layers"), read.get("--decoder-last-pipeline-num-layers")
    counted = [(part, flag) for part, flag in (("embed", "--account-for-embedding-in-pipeline-split"),
                                               ("loss", "--account-for-loss-in-pipeline-split")) if read.get(flag)]
    if counted:  # TransformerConfig.__post_init__ refuses them beside an uneven first/last stage or a layout
        beside = [flag for flag in ("--pipeline-model-parallel-layout", "--decoder-first-pipeline-num-layers",
                                    "--decoder-last-pipeline-num-layers") if flag in read.values]
        if beside:
            read.problem("E805", f"{counted[0][1]} beside {beside[0]}: megatron-core takes no other pipeline layout "
                         "argument with it (TransformerConfig)", beside[0], counted[0][1],
                         hint=f"keep {beside[0]} or {counted[0][1]}")
            return None
    if "--pipeline-model-parallel-layout" in read.values:
        counts = _layout(read, layers, pp)
    elif first is not None or last is not None:
        counts = _first_last(read, layers, pp, first, last)
    else:
        virtual = read.get("--num-virtual-stages-per-pipeline-rank", 1)
        per_stage = read.get("--num-layers-per-virtual-pipeline-stage")
        items = layers + len(counted)  # validate_args, get_num_layers_to_build: the embedding and the loss as layers
        if per_stage is not None:
            if items % (pp * per_stage):  # validate_args
                read.problem("E805", f"--num-layers {layers}{' + ' + str(len(counted)) if counted else ''} is not "
                             f"pipeline({pp}) x --num-layers-per-virtual-pipeline-stage({per_stage}) x virtual stages",
                             "--num-layers-per-virtual-pipeline-stage")
                return None
            virtual = items // (pp * per_stage)
        if items % (pp * virtual):  # get_num_layers_to_build: an even split
            what = f"--num-layers {layers}" + "".join(f" + 1 ({flag})" for _, flag in counted)
            read.problem("E805", f"{what} is not divisible by pipeline({pp}) x virtual stages({virtual})"
                         " (Megatron-LM splits blocks evenly unless --pipeline-model-parallel-layout says how)",
                         "--num-layers", *(flag for _, flag in counted), hint="give --pipeline-model-parallel-layout")
            return None
        if pp == 1:
            return []
        # Megatron-LM's own pipeline (`implementation = megatron`): its memory, not torch's stage buffers
        options = ([f"virtual = {virtual}"] if virtual > 1 else []) + ["implementation = megatron"] + (
            [f"account = [{', '.join(part for part, _ in counted)}]"] if counted else [])
        lines = ["  stages = evenly over pp with " + ", ".join(options)]
        return lines + [f"  schedule = {'interleaved_1f1b' if virtual > 1 else '1f1b'}"]
    if counts is None:
        return None
    if pp == 1:
        return []
    virtual = len(counts) // pp
    schedule = f"  schedule = {'interleaved_1f1b' if virtual > 1 else '1f1b'}"
    blocks = tuple(count for _, count, _ in counts)
    counted = counted_split(blocks)
    if counted:  # `E|t*2|...|L`: the split `account` says
        options = ([f"virtual = {virtual}"] if virtual > 1 else []) + [
            "implementation = megatron", f"account = [{', '.join(counted)}]"]
        return ["  stages = evenly over pp with " + ", ".join(options), schedule]
    return stages_lines(counts, virtual) + ["    implementation = megatron", "  }", schedule]


GROUP = "--microbatch-group-size-per-virtual-pipeline-stage"


def _microbatch_group(read: _Read, stages: list[str], pp: int, dp: int) -> bool:
    """Megatron-LM's interleaved 1F1B runs its m microbatches per virtual stage in groups of --microbatch-group-size-
    per-virtual-pipeline-stage (default pp) and refuses a group outside [pp, m] or a last one shorter than pp
    (forward_backward_pipelining_with_interleaving): E805; plandsl's `interleaved_1f1b` groups them as torch's rounds,
    m // max(1, m // pp) each (`megatron_microbatch_group`), and another group is E807. Megatron reads it only with
    virtual stages."""
    batch, micro = read.get("--global-batch-size"), read.get("--micro-batch-size")
    if not any("interleaved_1f1b" in line for line in stages) or not micro or batch % (micro * dp):
        return True  # no virtual stages, or a batch the checker refuses (E501)
    m, given = batch // (micro * dp), read.get(GROUP)
    group = pp if given is None else given
    if not pp <= group <= m or 0 < m % group < pp:
        said = f"{GROUP} {group}" if given is not None else f"the default group, pp ({GROUP})"
        why = f"a group between pp ({pp}) and m ({m})" if not pp <= group <= m else \
            f"a last group (m % group = {m % group}) of none or at least pp ({pp})"
        read.problem("E805", f"{m} microbatches (--global-batch-size {batch} / (data parallel {dp} x --micro-batch-size "
                     f"{micro})) in groups of {group} per virtual stage ({said}): Megatron-LM's interleaved schedule "
                     f"needs {why}",
                     GROUP if given is not None else "--global-batch-size",
                     hint=f"a multiple of pp x data parallel x micro-batch ({pp * dp * micro}) for --global-batch-size"
                     + (f", or {GROUP} {m}" if m >= pp else ""))
        return False
    if group != megatron_microbatch_group(pp, m) or not microbatches_fit(BUILTIN["interleaved_1f1b"], pp, m):
        read.problem("E807", f"{GROUP} {group} over {m} microbatches: plandsl's interleaved_1f1b runs torch's rounds, "
                     f"max(1, m // pp) of them, which must divide m, of m // max(1, m // pp) microbatches each "
                     f"({megatron_microbatch_group(pp, m)} here)", GROUP if given is not None else "--global-batch-size")
        return False
    return True


def stages_lines(counts: list[tuple[bool, int, bool]], virtual: int) -> list[str]:
    """A `stages { ... }` block's opening and entries for stages that hold (the embedding, blocks, the norm
    and head) in order, runs of equal block-only stages as one `FIRST..END: layers[a:b]` entry; the caller
    closes it (and may add `map = vshape` first)."""
    lines, start, index = ["  stages {"], 0, 0
    while index < len(counts):
        embed, blocks, head = counts[index]
        end = _even_run(counts, index) if blocks and not embed and not head else index + 1
        total = sum(count for _, count, _ in counts[index:end])
        parts = (["embed"] if embed else []) + ([f"layers[{start}:{start + total}]"] if total else []) \
            + (["norm", "head"] if head else [])
        lines.append(f"    {index}{f'..{end}' if end > index + 1 else ''}: {', '.join(parts)}")
        start, index = start + total, end
    if virtual > 1:
        lines.append(f"    virtual = {virtual}")
    return lines


def _even_run(counts: list[tuple[bool, int, bool]], first: int) -> int:
    """The end of the longest run of block-only stages from `first` that `FIRST..END: layers[a:b]` writes: the
    language splits a range evenly, the first stages taking one block more (ir.placement.split_evenly)."""
    best = first + 1
    for end in range(first + 2, len(counts) + 1):
        run = counts[first:end]
        if any(embed or head or not blocks for embed, blocks, head in run):
            break
        base, extra = divmod(sum(blocks for _, blocks, _ in run), len(run))
        if [blocks for _, blocks, _ in run] == [base + (i < extra) for i in range(len(run))]:
            best = end
    return best


LAYOUT_CHARS = 2 * (limits.MAX_LAYERS + limits.MAX_MTP + limits.MAX_STAGES)
"""Characters --pipeline-model-parallel-layout may unroll to: a block (t) or depth (m) each, a `|` between stages, E
and L, with room for stages of several letters."""


def _layout(read: _Read, layers: int, pp: int) -> list[tuple[bool, int, bool]] | None:
    """(embedding, blocks, loss) per stage of --pipeline-model-parallel-layout, read as
    PipelineParallelLayerLayout.parse_str_to_list does (commas dropped, `(...)*n` and `x*n` unrolled)."""
    text = read.get("--pipeline-model-parallel-layout").replace(",", "")
    most = LAYOUT_CHARS
    for pattern in (r"\(([^)]+)\)\*([0-9]+)", r"(.)\*([0-9]+)"):
        parts = re.split(pattern, text)  # [text, unit, times, text, unit, times, ..., text]
        # the unrolled length before unrolling: `Et*99999999999` asked for a string of 10^11 characters
        length = sum(map(len, parts[::3])) + sum(len(unit) * int(times) if len(times) <= WHOLE_DIGITS else most + 1
                                                 for unit, times in zip(parts[1::3], parts[2::3]))
        if length > most:
            read.problem("E805", f"--pipeline-model-parallel-layout unrolls to {length:,} characters, past the "
                         f"{most:,} of a layout of at most {limits.MAX_LAYERS:,} blocks over {limits.MAX_STAGES:,} stages",
                         "--pipeline-model-parallel-layout")
            return None
        text = re.sub(pattern, lambda m: m.group(1) * int(m.group(2)), text)
    stages = text.split("|")
    bad = sorted({c for c in text if c not in "ELtm|"})
    problem = None
    if bad:
        problem = f"it holds `{bad[0]}`, not one of E (embedding), t (block), L (loss), m (MTP)"
    elif text.count("m") != (read.get("--mtp-num-layers") or 0):
        problem = f"it places {text.count('m')} MTP layers (m), but --mtp-num-layers is " \
                  f"{read.get('--mtp-num-layers') or 'not given'} (validate_layer_layout: as many)"
    elif "m" in text and not re.search(r"m+L$", text):
        problem = "it places MTP layers (m) other than together just before the loss (L): a plan's depths sit on " \
                  "the head's stage, after its blocks"
    elif len(stages) % pp:
        problem = f"its {len(stages)} stages are not a multiple of --pipeline-model-parallel-size {pp}"
    elif text.count("t") != layers:
        problem = f"it places {text.count('t')} blocks, but --num-layers is {layers}"
    elif text.count("E") != 1 or text.count("L") != 1 or not text.startswith("E") or not text.endswith("L"):
        problem = "it must start with E and end with L, each once (validate_layer_layout)"
    if problem:
        read.problem("E805", f"--pipeline-model-parallel-layout: {problem}", "--pipeline-model-parallel-layout")
        return None
    return [("E" in stage, stage.count("t"), "L" in stage) for stage in stages]


def _first_last(read: _Read, layers: int, pp: int, first: int | None, last: int | None):
    """Per-stage counts of --decoder-first/last-pipeline-num-layers (get_num_layers_to_build's uneven split)."""
    if read.get("--num-virtual-stages-per-pipeline-rank", 1) > 1:
        read.problem("E807", "--decoder-first/last-pipeline-num-layers with virtual stages: write the split as "
                     "--pipeline-model-parallel-layout", "--num-virtual-stages-per-pipeline-rank")
        return None
    middle = layers - (first or 0) - (last or 0)
    left = pp - (first is not None) - (last is not None)
    if middle < 0 or (left > 0 and middle % left) or (left == 0 and middle):
        read.problem("E805", f"--num-layers {layers} leaves {middle} blocks for {left} middle stages "
                     "(get_num_layers_to_build: they must divide evenly)", "--decoder-first-pipeline-num-layers",
                     "--decoder-last-pipeline-num-layers")
        return None
    each = middle // left if left else 0
    counts = [each] * pp
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return [(s == 0, count, s == pp - 1) for s, count in enumerate(counts)]
