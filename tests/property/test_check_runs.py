"""`check` accepts only what runs: generated small plans, some with model shapes that cannot run.

The plans (hypothesis, derandomized so CI is deterministic) are tiny gpt, llama, mixture-of-experts llama and
DeepSeek-style llama models with random heads, kv_heads, head_dim, hidden, ffn, layers, seq, vocab, experts and
top_k, group-limited routing, shared experts, dense first layers, MoE every k-th layer (`moe_every`, `moe_offset`,
`dense_ffn`), multi-head latent attention, parallel blocks, sliding windows (`window`, `full_every`), sinks and multi-token
prediction (`mtp`), invalid combinations included, on meshes of dp/tp/pp/cp/ep axes of sizes 1-2 (at most 4
processes) over `clusters/local` or straddling `clusters/local_mixed`'s two device types, with every data kind
(replicate = DDP, zero1, zero2, zero3; `gather`, `unit`, `prefetch`), tensor and sequence parallelism, pipeline
schedules (with `outputs`, `implementation` of torch, Megatron-LM, DeepSpeed or DualPipe, `account`), context (allgather, both rings) and expert parallelism (folded
over [ep, tp] too), recomputation (`selective` with `recompute_modules`, `recompute_layers`), activation
offloading, `batch_shares`, precisions, the state dtypes, the loss, kernel and attention keys and the optimizer.

(a) one process, 300 examples: `check`, `show`, `estimate`, `render` (every view) and `run`'s refusals, through
    the API as the commands call them, answer every problem with a coded Diagnostic and raise nothing else;
    where `check` refuses a model shape (E220-E224, or a multi-token prediction depth past the sample's tokens,
    E234; and no argument combination, E225-E233) the reference model fails to build or to run a forward pass
    (for rotary head dims 1 and 3, which would run but rotate nothing, and for a depth past the sample's tokens, which
    would run on tokens rolled round, it is the module's own guard that refuses; the depths run given the targets); where it accepts the model, a training step of the reference model gives a
    finite loss (so the rules are neither too weak nor too strict);
(b) many processes (`dist`), GENERATED_RUNS generated plans and one written (expert parallelism), drawn
    `tame` (values check mostly accepts, so the examples run rather than refuse): a plan `check` accepts and
    `plandsl run` does not refuse (E7xx) trains one step on forked gloo ranks with a finite loss, each run
    within a deadline so a deadlock fails, and an fp32 one equals the one-process reference
    (`--check-equivalence`, runtime.equivalence's bound); `plandsl shrink` takes it too. The plan runs as
    generated: it is already one machine's size, and its shrunk copy would swap the very model under test
    for shrink's own. About a CPU-minute (forked ranks; (a) ~8 CPU-s): each rank imports its parallelisms.
"""
from __future__ import annotations

import math
import random
import re
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, assume, example, given, settings
from hypothesis import strategies as st

from plandsl import api, ir
from plandsl.render import VIEWS
from plandsl.runtime.support import refusals
from tests.support import full_run

SHAPE_CODES = {"E220", "E221", "E222", "E223", "E224", "E234"}  # E234: a depth past the sample's tokens
ARGUMENT_CODES = {"E225", "E226", "E227", "E228", "E229", "E230", "E231", "E232", "E233", "E235"}  # combinations
# the multi-process test's generated plans that run: 24 with `--full` (as the README's command ran until 2026-12-07;
# 48, then 32, before the CI's time reached its limit), 8 without (tests/select_cases.py's sweeps, which this is one
# of, by its examples; derandomized, so the same 8 every run)
GENERATED_RUNS = 24 if full_run() else 8
MAX_RANKS = 4  # the CI machine has 2 cores
COMMON = dict(deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


MODULES = ["core_attn", "layernorm", "moe_act", "mla_up_proj", "mlp", "moe", "shared_experts"]


class _Draw:
    """Draws for one plan: `pick(wild, tame)` samples `wild` (every value, invalid ones included) or, for the
    multi-process test, `tame` (values that `check` mostly accepts, so its few examples run rather than refuse).
    Wild draws are hypothesis's own (it shrinks them to a small failing plan); tame ones come from one drawn seed,
    because hypothesis leans to each list's first values and a few dozen examples would repeat them."""

    def __init__(self, draw, tame: bool):
        self.draw, self.tame = draw, tame
        self.random = random.Random(draw(st.integers(0, 2**32 - 1))) if tame else None

    def _one(self, values: list):
        return self.random.choice(values) if self.random else self.draw(st.sampled_from(values))

    def pick(self, wild: list, tame: list | None = None):
        return self._one(tame if self.tame and tame is not None else wild)

    def maybe(self, values: list, none: int = 2, tame: list | None = None):
        """One of `values` (`tame`), or None `none` times as often as each of them (half as often when tame:
        the few multi-process examples should each hold several constructs)."""
        if self.tame:
            return self._one([None] * max(1, none // 2) + (values if tame is None else tame))
        return self._one([None] * none + values)

    def sometimes(self, one_in: int) -> bool:
        return self._one([True] + [False] * ((one_in if not self.tame else (one_in + 1) // 2) - 1))

    def some(self, values: list, most: int, unique: bool) -> list:
        """One to `most` of `values`, each once if `unique`."""
        if self.random:
            count = self.random.randint(1, min(most, len(values)) if unique else most)
            return self.random.sample(values, count) if unique else self.random.choices(values, k=count)
        return self.draw(st.lists(st.sampled_from(values), min_size=1, max_size=most, unique=unique))


def _model(d: _Draw, family: str, sizes: dict[str, int]) -> tuple[str, dict]:
    """The model call (gpt, llama, llama with experts, DeepSeek-style llama) and what the rest of a tame plan
    needs to know of it."""
    moe = family in ("moe", "deepseek")
    mla = family == "deepseek" and d.pick([True, True, False])
    heads = d.pick([1, 2, 2, 3, 4, 4, 6], [2, 2, 4])
    layers = d.pick([2, 3, 4] if "pp" in sizes else [1, 2, 3, 4], [4] if "pp" in sizes else None)  # virtual 2: E403
    args = [f"layers={layers}", f"hidden={d.pick([6, 8, 12, 16, 24, 32, 48], [16, 32])}", f"heads={heads}",
            f"seq={d.pick([4, 8, 8, 12, 16], [8, 16])}", f"vocab={d.pick([16, 24, 64])}"]
    if family != "gpt" and d.pick([True, False]):
        kv_heads = d.pick([1, 2, 3, 4, 8, heads] if mla else [1, 2, 3, 4, 8], [heads] if mla else [1, 2])  # MLA: E227
        args.append(f"kv_heads={kv_heads}")
    if family in ("llama", "moe") and d.sometimes(3):
        args.append(f"head_dim={d.pick([2, 4, 4, 6, 3], [4, 6])}")  # hidden need not be heads x head_dim
    if d.pick([True, False]):
        args.append(f"ffn={d.pick([8, 12, 32])}")
    if moe:
        experts = d.pick([2, 4, 4, 1], [2, 4])
        args.append(f"experts={experts}")
        top_k = d.maybe([1, 2, 0, 3], tame=[1, 2])
        if top_k is not None:
            args.append(f"top_k={top_k}")
        if d.sometimes(4):  # group-limited routing; groups not dividing the experts, or too few chosen: E235
            groups = d.pick([2, 4, 3, 1], [g for g in (2, 4) if experts % g == 0] or [1])
            k = top_k or min(2, experts)  # lowering's default top_k
            chosen = d.pick([1, 2, 3], [1] if experts // groups >= k else [k])  # k <= groups where tame
            args.append(f"expert_groups={groups}, group_top_k={chosen}")
    if family == "deepseek" or (family == "llama" and not d.tame and d.sometimes(8)):
        # shared experts, the first blocks dense, every k-th block a mixture of experts (on a dense llama: E225, E229)
        shared = d.maybe([1, 2])
        if shared:
            args.append(f"shared_experts={shared}")
        dense_layers = d.maybe([1, 2, layers], 1, tame=[1]) or 0  # all of them: E228
        if dense_layers and (dense_layers < layers or not d.tame):
            args.append(f"dense_layers={dense_layers}")
        moe_every = d.maybe([2, 3], 1) or 1
        if moe_every > 1:
            args.append(f"moe_every={moe_every}")
            offset = d.maybe([0, 1, 2, 3], 3, tame=[0, 1])  # not below moe_every: E230
            if offset is not None:
                args.append(f"moe_offset={offset}")
        if d.pick([True, False], [bool(dense_layers or moe_every > 1)]):  # with neither: E229
            args.append(f"dense_ffn={d.pick([8, 16, 24])}")
    if mla or (family != "gpt" and not d.tame and d.sometimes(12)):
        # multi-head latent attention; its other arguments without kv_lora_rank are E226
        if mla:
            args.append(f"kv_lora_rank={d.pick([4, 8])}")
        for name, values, tame in [("q_lora_rank", [0, 6, 8], [0, 8]), ("qk_nope_head_dim", [4, 6], None),
                                   ("qk_rope_head_dim", [2, 4, 3], [2, 4]), ("v_head_dim", [4, 6], None)]:
            value = d.maybe(values, 1, tame=tame)
            if value is not None:
                args.append(f"{name}={value}")
    if d.sometimes(3):
        args.append("parallel=true")
    window = d.maybe([2, 3, 5, 16], 6)  # 16: no shorter than the sequence, W203
    if window is not None:
        args.append(f"window={window}")
    full_every = d.maybe([1, 2, 3, 5], 2 if window else 16, tame=[2] if window and layers > 1 else [])  # E231, E232
    if full_every is not None:
        args.append(f"full_every={full_every}")
    if d.sometimes(5):
        args.append("sinks=true")
    if d.pick([True, False]):
        args.append("tied=true")
    # multi-token prediction: on a gpt E233, past the sequence E234
    if d.sometimes(8) and (not d.tame or family != "gpt"):
        args.append(f"mtp={d.pick([1, 2, 15], [1, 2])}")
    modules = {"gpt": ["core_attn", "layernorm", "mlp"], "llama": ["core_attn", "layernorm", "mlp"]}.get(
        family, ["core_attn", "layernorm", "moe_act", "moe"])  # a module the model lacks: E516
    return f"{'gpt' if family == 'gpt' else 'llama'}({', '.join(args)})", {
        "family": family, "layers": layers, "windowed": window is not None or "sinks=true" in args, "modules": modules}


def _train(d: _Draw, sizes: dict[str, int], shape: dict, hetero: bool) -> tuple[list[str], str]:
    """The `train` block's entries and the precision."""
    layers = shape["layers"]
    micro_batch, microbatches = d.pick([1, 2]), d.pick([1, 2, 4], [2, 4] if "pp" in sizes else None)  # E502
    global_batch = sizes.get("dp", 1) * sizes.get("ep", 1) * micro_batch * microbatches
    recompute = d.pick(["none", "selective", "full", "selective_op"],  # selective_op on MoE or MLA: E704 (run)
                       ["none", "none", "selective", "full"] + ["selective_op"] * (shape["family"] in ("gpt", "llama")))
    precision = d.pick(["fp32", "fp32", "fp32", "bf16", "bf16", "fp16", "fp8"], ["fp32", "fp32", "bf16", "fp16"])
    train = [f"global_batch: {global_batch}", f"micro_batch: {micro_batch}", f"precision: {precision}",
             f"recompute: {recompute}", "lr: 1e-3"]
    seq = d.maybe([4, 8, 16], tame=[4, 8])  # longer than gpt's positions: E224
    if seq is not None:
        train.append(f"seq: {seq}")
    if d.pick([recompute == "selective", False, False], [recompute == "selective"]):  # without selective: E205
        modules = d.some(shape["modules"] if d.tame else MODULES, 3, unique=d.tame)  # twice: E205
        train.append(f"recompute_modules: [{', '.join(modules)}]")
    if d.pick([recompute == "full", False, False, False], [recompute == "full", False]):  # without full: E205
        train.append(f"recompute_layers: {d.pick([0, 1, 2, layers + 1], [1, 2])}")  # more than the layers: E205
    offload = d.maybe([1, 2, layers + 1], 6, tame=[1] if recompute == "none" else [])  # beside recompute: E512
    if offload is not None:
        train.append(f"offload_layers: {offload}")
    narrow = precision in ("bf16", "fp16") or not d.tame  # 16-bit weights under fp32 matmuls: E205
    for key, values, none in [("loss", ["standard", "fused", "fused", "megatron"], 3), ("kernels", ["eager"], 5),
                              ("attention", ["materialized"], 5), ("optimizer", ["sgd"], 5),
                              ("master_dtype", ["fp32", "bf16"] if narrow else ["fp32"], 5),
                              ("grad_dtype", ["bf16"], 5), ("optimizer_dtype", ["bf16"] + ["fp16"] * (not d.tame), 5),
                              ("param_dtype", ["bf16"] if narrow else [], 5)]:  # optimizer_dtype fp16: E706 (run)
        value = d.maybe(values, none) if values else None
        if value is not None:
            train.append(f"{key}: {value}")
    if sizes.get("dp", 1) == 2 and d.pick([hetero, False, False], [hetero, True]):
        share = global_batch // 2
        train.append("batch_shares: " + d.pick(
            ["speed", f"[{share}, {share}]", f"[{global_batch - micro_batch}, {micro_batch}]", f"[{global_batch}]"],
            ["speed", f"[{global_batch - micro_batch}, {micro_batch}]"]))  # [global_batch]: one share, E507
    return train, precision


@st.composite
def small_plans(draw, tame: bool = False) -> str:
    """The text of a small plan on `localhost` or the two-device-type `local_mixed` (module docstring); valid
    or not (`tame`: mostly valid)."""
    d = _Draw(draw, tame)
    family = d.pick(["gpt", "llama", "moe", "deepseek"])
    axes = ["dp", "tp", "pp", "cp"] + (["ep"] if family in ("moe", "deepseek") else [])
    roles = d.some(axes, 3, unique=True)
    sizes = {role: d.pick([2, 2, 2, 1]) for role in roles}
    for role in reversed(roles):  # at most MAX_RANKS processes
        if math.prod(sizes.values()) > MAX_RANKS:
            sizes[role] = 1
    model, shape = _model(d, family, sizes)
    hetero = d.sometimes(5)  # clusters/local_mixed: devices 0-3 fast, 4-7 slow; the mesh straddles the two
    size = math.prod(sizes.values())
    first = 4 - size // 2 if hetero else 0
    mesh = ", ".join(f"{role} = {n}" for role, n in sizes.items())
    train, precision = _train(d, sizes, shape, hetero)
    lines = [f"  model   = {model}", f"  cluster = {'local_mixed' if hetero else 'localhost'}",
             f"  mesh    = [{mesh}] over devices[{first}:{first + size}]", f"  train   = {{ {', '.join(train)} }}"]
    kind, sequence_parallel = None, False
    if "dp" in sizes:
        kind = d.pick(["replicate", "zero1", "zero2", "zero3", "zero3"])
        options = []
        gather = d.maybe(["fp32", "bf16", "fp16"], 3, tame=["fp32", precision] if kind in ("zero2", "zero3") else [])
        # on replicate: E206; under ZeRO-2/3 neither fp32 nor the compute precision, under ZeRO-1 not the weights': E515
        if gather is not None and (kind != "replicate" or not tame):
            options.append(f"gather = {gather}")
        if kind in ("zero2", "zero3") and d.sometimes(3):
            options.append("unit = module")
        if kind == "zero3" and d.sometimes(3):
            options.append(f"prefetch = {d.pick([0, 2])}")
        lines.append(f"  data    = {kind} over dp" + (f" with {', '.join(options)}" if options else ""))
    folded = "ep" in sizes and "tp" in sizes and d.pick([True, False])  # experts over [ep, tp]
    if "tp" in sizes:  # folding the tensor axis into the experts' without sequence parallelism: E416
        sequence_parallel = d.pick([True, False], [True] if folded else None)
        lines.append("  tensor  = megatron over tp" + (" with sequence_parallel" if sequence_parallel else ""))
    if "pp" in sizes:
        schedule = d.pick(["gpipe", "1f1b", "1f1b", "interleaved_1f1b", "zb_h1", "looped_bfs", "zbv", "dualpipev"])
        options = {"interleaved_1f1b": ["virtual = 2"], "looped_bfs": ["virtual = 2"],
                   "zbv": ["virtual = 2", "map = vshape"], "dualpipev": ["virtual = 2", "map = vshape"]}.get(schedule, [])
        # whose pipeline: Megatron-LM's runs 1f1b and interleaved_1f1b, DeepSpeed's 1f1b (ZeRO 0 or 1, no sequence
        # parallelism: E611), DualPipe's dualpipev; any other schedule beside one: E610; outputs beside one: E206
        runs = {"megatron": ("1f1b", "interleaved_1f1b"), "deepspeed": ("1f1b",), "dualpipe": ("dualpipev",)}
        for option in ["outputs = returned", "implementation", "account = [embed, loss]"]:
            if not d.sometimes(4):
                continue
            if option == "implementation":
                whose = d.pick(list(runs))
                if tame and ("outputs = returned" in options or schedule not in runs[whose] or whose == "deepspeed"
                             and (kind in ("zero2", "zero3") or sequence_parallel)):
                    continue
                option = f"implementation = {whose}"
            options.append(option)
        lines += ["  stages  = evenly over pp" + (f" with {', '.join(options)}" if options else ""),
                  f"  schedule = {schedule}"]
    if "cp" in sizes:
        rings = [] if shape["windowed"] else ["ring over cp", "ring over cp with implementation = torch"]
        context = d.pick(["allgather over cp"] + (rings or ["ring over cp"]), ["allgather over cp"] + rings)  # E420
        lines.append(f"  context = {context}")
    if "ep" in sizes:
        lines.append(f"  experts = {d.pick(['alltoall', 'alltoall', 'deepep'])} over {'[ep, tp]' if folded else 'ep'}")
    return f'import "clusters/{"local_mixed" if hetero else "local"}"\n\nplan p {{\n' + "\n".join(lines) + "\n}\n"


def _check(text: str):
    analysis = api.checks(text, path=str(Path(tempfile.gettempdir()) / "generated.plan"))
    plan = analysis.document.plans[0] if analysis.document is not None and analysis.document.plans else None
    return analysis, plan


def _coded(diagnostics, code: str = r"[EW]\d{3}") -> None:
    for diagnostic in diagnostics:
        assert re.fullmatch(code, diagnostic.code or ""), diagnostic


def _commands_answer_with_diagnostics(analysis, plan) -> None:
    """`check`, `show`, `estimate`, `render` (every view) and `run`'s refusals through the API, as the commands
    call them: every problem is a Diagnostic with a code, never another exception."""
    _coded(analysis.diagnostics)
    if not analysis.ok:
        return
    _coded(refusals(plan, cuda=False), r"E7\d\d")
    api.describe(analysis.document, [plan])
    try:
        api.format_estimate(api.estimate(plan))
    except api.PlanError as error:
        _coded(error.diagnostics)
    for view in VIEWS:
        try:
            api.render(plan, view, "dot")
        except api.PlanError as error:  # E811 where the view does not apply (a NotApplicable before)
            _coded(error.diagnostics)


def _one_step(model: ir.Model, seq: int) -> float:
    """Build the reference model and train one step on one sequence of `seq` tokens; the loss (with multi-token
    prediction's depths, which the model computes only given the targets)."""
    import torch  # here, not at the top: collecting the module must not import torch

    from plandsl.runtime.models import build_model, loss_fn
    module = build_model(model, seed=0)
    tokens = torch.randint(model.vocab, (1, seq + 1), generator=torch.Generator().manual_seed(0))
    if getattr(model, "mtp", 0):
        loss = module(tokens[:, :-1], tokens[:, 1:])
    else:
        loss = loss_fn(module(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    return loss.item()


# ---- (a) one process: every command answers, and the shape rules against the reference model ------------
@pytest.mark.slow  # 300 plans checked, estimated and drawn, their models built and stepped: ~8 CPU-s quiet
@settings(max_examples=300, **COMMON)
@given(small_plans())
def test_the_shape_rules_are_exactly_what_the_model_needs(text):
    analysis, plan = _check(text)
    _commands_answer_with_diagnostics(analysis, plan)
    if plan is None:
        return  # refused while lowering (E2xx), before any shape is known
    refused = {d.code for d in analysis.errors}
    if refused & SHAPE_CODES and not refused & ARGUMENT_CODES:
        with pytest.raises((ValueError, RuntimeError, IndexError)):
            _one_step(plan.model, plan.seq)
    elif not refused & ARGUMENT_CODES:  # E225-E233 may or may not leave a model torch builds
        assert math.isfinite(_one_step(plan.model, plan.seq)), text


# ---- (b) many processes: what check accepts, trains ------------------------------------------------------
EXPERT_PARALLEL = """import "clusters/local"

plan p {
  model   = llama(layers=2, hidden=16, heads=4, kv_heads=2, seq=8, vocab=24, experts=4, top_k=3)
  cluster = localhost
  mesh    = [ep = 2] over devices[0:2]
  train   = { global_batch: 4, micro_batch: 1, precision: fp32, recompute: selective, lr: 1e-3 }
  experts = alltoall over ep
}
"""


@pytest.mark.dist
@settings(max_examples=GENERATED_RUNS, phases=[Phase.explicit, Phase.generate], **COMMON)  # no shrinking
@given(small_plans(tame=True))
@example(EXPERT_PARALLEL)  # the generated plans hold none (they are derandomized: the same in every run)
def test_a_plan_check_accepts_trains_one_step(text):
    from plandsl.rewrite.shrink import shrink
    from tests.distributed.harness import run_ranks
    from tests.distributed.ranks import train
    analysis, plan = _check(text)
    assume(analysis.ok and not refusals(plan, cuda=False))  # plans that check and that run does not refuse
    equivalence = plan.train.precision is ir.Precision.fp32  # a 16-bit run is not the fp32 reference's to 1e-5
    with tempfile.TemporaryDirectory(prefix="plandsl-generated-") as directory:
        path = Path(directory) / "generated.plan"
        path.write_text(text)
        assert shrink(path, out_dir=directory).plan is not None  # shrink takes every plan check accepts
        results = run_ranks(plan.mesh.size, train, str(path), steps=1, check_equivalence=equivalence,
                            deadline_s=60 + 30 * plan.mesh.size)
    assert [r["status"] for r in results] == [0] * plan.mesh.size, (text, results[0]["report_text"])
    assert len(results[0]["losses"]) == 1 and math.isfinite(results[0]["losses"][0]), (text, results[0]["losses"])
    if equivalence:  # the run's loss and updated parameters are one process's (runtime.equivalence's bound)
        report = results[0]["report"]
        assert not report["missing"] and max(report["loss_diff"], report["param_diff"]) <= report["tolerance"], \
            (text, results[0]["report_text"])
