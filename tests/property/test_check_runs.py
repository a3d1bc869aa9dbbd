"""`check` accepts only what runs: generated small plans, some with model shapes that cannot run.

The plans (hypothesis, derandomized so CI is deterministic) are tiny gpt, llama and mixture-of-experts
llama models with random heads, kv_heads, hidden, ffn, layers, seq, vocab, experts and top_k (invalid
combinations included), on meshes of dp/tp/pp/cp/ep axes of sizes 1-2 (at most 4 processes), with
every data kind (replicate = DDP, zero1, zero2, zero3), tensor and sequence parallelism, pipeline
schedules, context and expert parallelism, recomputation and precisions.

(a) one process, every example: where `check` refuses a model shape (E220-E224) the reference model
    fails to build or to run a forward pass (for rotary head dims 1 and 3, which would run but rotate
    nothing, it is the module's own guard that refuses); where it accepts the shapes, a training step
    of the reference model gives a finite loss (so the rules are neither too weak nor too strict);
(b) many processes (`dist`), 16 generated plans and one written (expert parallelism): a plan `check`
    accepts and `plandsl run` does not refuse (E7xx) trains one step on forked gloo ranks with a
    finite loss, each run within a deadline so a deadlock fails; `plandsl shrink` takes it too. The
    plan runs as generated: it is already one machine's size, and its shrunk copy would swap the very
    model under test for shrink's own. About 2 CPU-minutes: each rank imports its parallelisms.
"""
from __future__ import annotations

import math
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, assume, example, given, settings
from hypothesis import strategies as st

from plandsl import api, ir
from plandsl.runtime.support import refusals

SHAPE_CODES = {"E220", "E221", "E222", "E223", "E224"}
MAX_RANKS = 4  # the CI machine has 2 cores
COMMON = dict(deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@st.composite
def small_plans(draw) -> str:
    """The text of a small plan on `localhost` (module docstring); valid or not."""
    family = draw(st.sampled_from(["gpt", "llama", "moe"]))
    axes = ["dp", "tp", "pp", "cp"] + (["ep"] if family == "moe" else [])
    roles = draw(st.lists(st.sampled_from(axes), unique=True, min_size=1, max_size=3))
    sizes = {role: draw(st.sampled_from([2, 2, 2, 1])) for role in roles}
    for role in reversed(roles):  # at most MAX_RANKS processes
        if math.prod(sizes.values()) > MAX_RANKS:
            sizes[role] = 1
    heads = draw(st.sampled_from([1, 2, 2, 3, 4, 4, 6]))
    layers = draw(st.integers(2, 4) if "pp" in sizes else st.integers(1, 4))
    args = [f"layers={layers}", f"hidden={draw(st.sampled_from([6, 8, 12, 16, 24, 32, 48]))}",
            f"heads={heads}", f"seq={draw(st.sampled_from([4, 8, 8, 12, 16]))}",
            f"vocab={draw(st.sampled_from([16, 24, 64]))}"]
    if family != "gpt" and draw(st.booleans()):
        args.append(f"kv_heads={draw(st.sampled_from([1, 2, 3, 4, 8]))}")
    if draw(st.booleans()):
        args.append(f"ffn={draw(st.sampled_from([8, 12, 32]))}")
    if family == "moe":
        args.append(f"experts={draw(st.sampled_from([2, 4, 4, 1]))}")
        top_k = draw(st.sampled_from([None, None, 1, 2, 0, 3]))
        if top_k is not None:
            args.append(f"top_k={top_k}")
    if draw(st.booleans()):
        args.append("tied=true")
    model = f"{'gpt' if family == 'gpt' else 'llama'}({', '.join(args)})"

    batch_degree = sizes.get("dp", 1) * sizes.get("ep", 1)
    micro_batch = draw(st.sampled_from([1, 2]))
    microbatches = draw(st.sampled_from([1, 2, 4]))
    train = [f"global_batch: {batch_degree * micro_batch * microbatches}", f"micro_batch: {micro_batch}",
             f"precision: {draw(st.sampled_from(['fp32', 'fp32', 'bf16']))}",
             f"recompute: {draw(st.sampled_from(['none', 'selective', 'full', 'selective_op']))}", "lr: 1e-3"]
    seq = draw(st.sampled_from([None, None, 4, 8, 16]))
    if seq is not None:
        train.append(f"seq: {seq}")

    mesh = ", ".join(f"{role} = {size}" for role, size in sizes.items()) or "dp = 1"
    lines = [f"  model   = {model}", "  cluster = localhost",
             f"  mesh    = [{mesh}] over devices[0:{math.prod(sizes.values())}]",
             f"  train   = {{ {', '.join(train)} }}"]
    if "dp" in sizes:
        lines.append(f"  data    = {draw(st.sampled_from(['replicate', 'zero1', 'zero2', 'zero3']))} over dp")
    if "tp" in sizes:
        lines.append("  tensor  = megatron over tp" + (" with sequence_parallel" if draw(st.booleans()) else ""))
    if "pp" in sizes:
        schedule = draw(st.sampled_from(["gpipe", "1f1b", "interleaved_1f1b"]))
        virtual = " with virtual = 2" if schedule == "interleaved_1f1b" else ""
        lines += [f"  stages  = evenly over pp{virtual}", f"  schedule = {schedule}"]
    if "cp" in sizes:
        lines.append(f"  context = {draw(st.sampled_from(['allgather', 'ring']))} over cp")
    if "ep" in sizes:
        lines.append("  experts = alltoall over ep")
    return 'import "clusters/local"\n\nplan p {\n' + "\n".join(lines) + "\n}\n"


def _check(text: str):
    analysis = api.checks(text, path=str(Path(tempfile.gettempdir()) / "generated.plan"))
    plan = analysis.document.plans[0] if analysis.document is not None and analysis.document.plans else None
    return analysis, plan


def _one_step(model: ir.Model, seq: int) -> float:
    """Build the reference model and train one step on one sequence of `seq` tokens; the loss."""
    import torch  # here, not at the top: collecting the module must not import torch

    from plandsl.runtime.models import build_model, loss_fn
    module = build_model(model, seed=0)
    tokens = torch.randint(model.vocab, (1, seq + 1), generator=torch.Generator().manual_seed(0))
    loss = loss_fn(module(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    return loss.item()


# ---- (a) one process: the shape rules against the reference model ---------------------------------------
@pytest.mark.slow  # 150 models built and stepped: ~25 CPU-s quiet, the largest test of the unit tier
@settings(max_examples=150, **COMMON)
@given(small_plans())
def test_the_shape_rules_are_exactly_what_the_model_needs(text):
    analysis, plan = _check(text)
    if plan is None:
        return  # refused while lowering (E2xx), before any shape is known
    refused = {d.code for d in analysis.errors} & SHAPE_CODES
    if refused:
        with pytest.raises((ValueError, RuntimeError, IndexError)):
            _one_step(plan.model, plan.seq)
    else:
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
@settings(max_examples=16, phases=[Phase.explicit, Phase.generate], **COMMON)  # no shrinking: each run is seconds
@given(small_plans())
@example(EXPERT_PARALLEL)  # the 16 generated plans hold none (they are derandomized: the same in every run)
def test_a_plan_check_accepts_trains_one_step(text):
    from plandsl.rewrite.shrink import shrink
    from tests.distributed.harness import run_ranks
    from tests.distributed.ranks import train
    analysis, plan = _check(text)
    assume(analysis.ok and not refusals(plan, cuda=False))  # 16 plans that check and that run does not refuse
    with tempfile.TemporaryDirectory(prefix="plandsl-generated-") as directory:
        path = Path(directory) / "generated.plan"
        path.write_text(text)
        assert shrink(path, out_dir=directory).plan is not None  # shrink takes every plan check accepts
        results = run_ranks(plan.mesh.size, train, str(path), steps=1, deadline_s=60 + 30 * plan.mesh.size)
    assert [r["status"] for r in results] == [0] * plan.mesh.size, text
    assert len(results[0]["losses"]) == 1 and math.isfinite(results[0]["losses"][0]), (text, results[0]["losses"])
