"""`loss: fused` under `plandsl run`: the chunked cross entropy (runtime.loss) trained on forked gloo ranks with
`--check-equivalence`, whose one-process reference computes torch's standard cross entropy over the whole logits:
losses and final parameters within the fp32 tolerance (1e-5; bf16 2e-2). Cases: the vocabulary split over the
tensor axis with sequence parallelism and FSDP, a rule that keeps the head whole, the last pipeline stage (tied
embeddings across stages, a split backward), the head as an FSDP unit of its own, DDP in bf16, fp16's loss scale
on a pipeline."""
from __future__ import annotations

import pytest

from tests.distributed.harness import run_ranks
from tests.distributed.ranks import RANK_TIMEOUT_S, load

pytestmark = pytest.mark.dist

STEPS = 2
_LLAMA = "llama(layers=2, hidden=64, heads=4, kv_heads=2, seq=32, vocab=256)"
_GPT = "gpt(layers=2, hidden=64, heads=4, seq=32, vocab=256)"
_TRAIN = "{ global_batch: 8, micro_batch: %d, precision: %s, lr: 1e-3, seed: 0, loss: fused }"


def _plan(mesh: str, lines: str, model: str = _GPT, micro_batch: int = 1, precision: str = "fp32") -> str:
    size = 1
    for part in mesh.strip("[]").split(","):
        size *= int(part.split("=")[1])
    body = "\n".join(f"  {line.strip()}" for line in lines.strip().splitlines())
    return (f'import "clusters/local"\nplan p {{\n  model = {model}\n  cluster = localhost\n'
            f"  mesh = {mesh} over devices[0:{size}]\n  train = {_TRAIN % (micro_batch, precision)}\n{body}\n}}\n")


def _train(rank: int, text: str) -> dict:
    from dataclasses import asdict

    from plandsl.runtime.loss import HeadLoss
    from plandsl.runtime.train import RunConfig, run
    status, job = run(load(text), RunConfig(steps=STEPS, check_equivalence=True, quiet=True, timeout_s=RANK_TIMEOUT_S))
    head = job.loss.head if isinstance(job.loss, HeadLoss) else None
    weight = head.weight if head is not None else None
    return {"status": status, "report": asdict(job.report) if job.report else None,
            "report_text": str(job.report) if job.report else None,
            "fused": isinstance(job.loss, HeadLoss) and all(m.loss_in_head for m in job.models),
            "head": head is not None,
            "tensor_placement": _over(weight, "tp")}


def _over(weight, axis: str) -> str | None:
    """How a DTensor weight is placed over `axis` (None: not over it)."""
    from torch.distributed.tensor import DTensor
    names = weight.device_mesh.mesh_dim_names or () if isinstance(weight, DTensor) else ()
    return str(weight.placements[names.index(axis)]) if axis in names else None


CASES = [
    # the vocabulary split over tp (each rank its slice, the max, sum and target all-reduced), the final hidden
    # states all-gathered from sequence shards, FSDP over dp gathering the head's weight for the call
    ("llama_fsdp_x_tp_sp", _plan("[dp = 2, tp = 2]", """
        data   = zero3 over dp
        tensor = megatron over tp with sequence_parallel""", model=_LLAMA), 1e-5, "S(0)"),
    # a rule keeps the head whole on every tensor rank: the loss is computed whole on each
    ("head_replicated_tp", _plan("[tp = 2]", """
        tensor = megatron over tp
        shard head = replicate"""), 1e-5, "R"),
    # the last stage holds the head, tied to the first stage's embedding (split over tp), two microbatches
    ("tied_pp_x_tp", _plan("[pp = 2, tp = 2]", """
        tensor   = megatron over tp
        stages   = evenly over pp
        schedule = 1f1b""", model=_GPT.replace("vocab=256", "vocab=256, tied=true"), micro_batch=2),
     1e-5, "S(0)"),
    # a split backward (input, then weights): the chunks recomputed once for each
    ("zb_h1_pp", _plan("[pp = 2]", """
        stages   = evenly over pp
        schedule = zb_h1""", micro_batch=1), 1e-5, None),
    # two stages per rank: the head is on the last rank's second stage
    ("interleaved_pp", _plan("[pp = 2]", """
        stages   = evenly over pp
        schedule = interleaved_1f1b""", model=_GPT.replace("layers=2", "layers=4"), micro_batch=2), 1e-5, None),
    ("fsdp_module_units", _plan("[dp = 2]", "data = zero3 over dp with unit = module"), 1e-5, None),
    # FSDP on pipeline stages: the last stage's parameters stay gathered after its forward for the head's call
    ("fsdp_x_pp", _plan("[dp = 2, pp = 2]", """
        data     = zero3 over dp
        stages   = evenly over pp
        schedule = gpipe""", micro_batch=2), 1e-5, None),
    ("ddp_bf16", _plan("[dp = 2]", "data = replicate over dp", precision="bf16"), 2e-2, None),
    # fp16's loss scale through the pipeline's loss function into the chunks' gradients
    ("fp16_pp", _plan("[pp = 2]", """
        stages   = evenly over pp
        schedule = 1f1b""", micro_batch=2, precision="fp16"), 2e-2, None),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_the_fused_loss_trains_like_the_standard_one_in_one_process(case):
    name, text, tolerance, placement = case
    plan = load(text)
    results = run_ranks(plan.mesh.size, _train, text, deadline_s=60 + 20 * plan.mesh.size)
    first = results[0]
    assert [r["status"] for r in results] == [0] * len(results), first["report_text"]
    assert all(r["fused"] for r in results)
    report = first["report"]
    assert report["missing"] == () and report["tolerance"] == tolerance
    assert report["loss_diff"] <= tolerance and report["tensor_diff"] <= tolerance, first["report_text"]
    holders = [r for r in results if r["head"]]
    assert holders and all(r["tensor_placement"] == placement for r in holders), results
