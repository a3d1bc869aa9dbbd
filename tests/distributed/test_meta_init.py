"""`plandsl run` builds a built-in family's model on the meta device and allocates only each rank's shards.

`build_job` never builds the full model (`models.build_model`): the model `parallelize` takes holds meta parameters
only, and once split each rank's parameters hold exactly (bit for bit) the values of the full model `build_model`
gives from the seed, cut as the layout cuts them: tensor parallelism, FSDP2 (over tensor parallelism: `_StridedShard`),
HSDP, DDP (filled before it wraps), expert parallelism, pipeline stages with a tied head, bf16 weights, parameters
large enough to be drawn tile by tile (`models.ParameterValues`).
"""
from __future__ import annotations

import math
import textwrap

import pytest

from tests.distributed.harness import run_ranks
from tests.distributed.ranks import build_on_meta, load
from tests.support import lazy

torch = lazy("torch")

pytestmark = pytest.mark.dist

_HEADER = 'import "clusters/local"\nimport "local/tiny"\n'
_GPT = "gpt(layers=2, hidden=32, heads=4, seq=16, vocab=128)"
_TIED = "gpt(layers=4, hidden=32, heads=4, seq=16, vocab=128, tied=true)"
_MOE = "llama(layers=2, hidden=32, heads=4, kv_heads=2, seq=16, vocab=128, ffn=32, experts=4, top_k=2)"
_MTP = "llama(layers=4, hidden=32, heads=4, kv_heads=2, seq=16, vocab=128, ffn=64, mtp=2, tied=true)"
_RULES = """data   = zero1 over dp
tensor = megatron over tp with sequence_parallel
shard layers.1.mlp.w1 = { weight: [Shard(0) @ tp, Shard(1) @ dp], bias: [Shard(0) @ tp, Shard(0) @ dp] }
shard head            = [Shard(0) @ tp, Shard(1) @ dp]"""
_LARGE = "gpt(layers=2, hidden=256, heads=4, seq=16, vocab=4100)"  # [4100, 256]: above models.LARGE, uneven tiles
_RECOMPUTE = "{ global_batch: 8, micro_batch: 1, precision: fp32, lr: 1e-3, seed: 0, recompute: full }"
_BF16 = "{ global_batch: 8, micro_batch: 2, precision: bf16, master_dtype: bf16, lr: 1e-3, seed: 3 }"


def _plan(mesh: str, lines: str, model: str = _GPT, train: str = "tiny_train") -> str:
    size = math.prod(int(part.split("=")[1]) for part in mesh.strip("[]").split(","))
    body = textwrap.indent(textwrap.dedent(lines).strip(), "  ")
    return (_HEADER + f"plan p {{\n  model = {model}\n  cluster = localhost\n"
            f"  mesh = {mesh} over devices[0:{size}]\n  train = {train}\n{body}\n}}\n")


CASES = [
    ("tp", "[tp = 2]", "tensor = megatron over tp with sequence_parallel", _GPT, "tiny_train"),
    ("tp_tied", "[tp = 2]", "tensor = megatron over tp", _TIED, "tiny_train"),
    ("fsdp", "[dp = 2]", "data = zero3 over dp", _GPT, "tiny_train"),
    ("fsdp_tp", "[dp = 2, tp = 2]", "data = zero3 over dp\ntensor = megatron over tp", _GPT, "tiny_train"),
    ("fsdp_tp_uneven", "[dp = 2, tp = 2]", "data = zero3 over dp\ntensor = megatron over tp",
     "gpt(layers=2, hidden=32, heads=4, seq=16, vocab=130, ffn=54)", "tiny_train"),
    ("hsdp", "[rep = 2, shard = 2]", "data = hsdp over [rep, shard]", _GPT, "tiny_train"),
    ("ddp", "[dp = 2]", "data = ddp over dp", _GPT, "tiny_train"),
    ("ddp_tied", "[dp = 2]", "data = ddp over dp", _TIED, "tiny_train"),
    ("fsdp_tied", "[dp = 2]", "data = zero3 over dp", _TIED, "tiny_train"),
    ("ddp_bf16", "[dp = 2]", "data = ddp over dp", _GPT, _BF16),
    ("ddp_tp", "[dp = 2, tp = 2]", "data = ddp over dp\ntensor = megatron over tp", _GPT, _RECOMPUTE),
    ("rules_zero1_tp", "[dp = 2, tp = 2]", _RULES, _GPT, "tiny_train"),
    ("cp", "[cp = 2]", "context = allgather over cp", _GPT, "tiny_train"),
    ("ep_tp", "[ep = 2, tp = 2]", "experts = alltoall over ep\ntensor = megatron over tp", _MOE, "tiny_train"),
    ("pp_tied", "[pp = 2]", "stages = evenly over pp\nschedule = 1f1b", _TIED, "tiny_train"),
    ("fsdp_pp_tied_bf16", "[dp = 2, pp = 2]", "data = zero3 over dp\nstages = evenly over pp\nschedule = 1f1b",
     _TIED, _BF16),
    ("ddp_pp", "[dp = 2, pp = 2]", "data = ddp over dp\nstages = evenly over pp\nschedule = 1f1b", _TIED,
     "tiny_train"),
    ("mtp_zbv_tied", "[pp = 2]", "stages = evenly over pp with virtual = 2, map = vshape\nschedule = zbv", _MTP,
     "tiny_train"),
    ("mlp_fsdp", "[dp = 2]", "data = zero3 over dp", "mlp(layers=3, input=8, hidden=16, output=4)", "tiny_train"),
    # an embedding and a head of LARGE elements: drawn tile by tile, each rank its shards' tiles (`ParameterValues`)
    ("tiled_fsdp_tp", "[dp = 2, tp = 2]", "data = zero3 over dp\ntensor = megatron over tp", _LARGE, "tiny_train"),
    ("tiled_pp", "[pp = 2]", "stages = evenly over pp\nschedule = 1f1b", _LARGE, "tiny_train"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_run_builds_on_meta_and_fills_each_shard_with_the_full_models_values(case):
    _, mesh, lines, model, train = case
    text = _plan(mesh, lines, model, train)
    world = load(text).mesh.size
    results = run_ranks(world, build_on_meta, text, deadline_s=60 + 20 * world)
    for result in results:
        assert result["seen"], "parallelize was never called"
        for part in result["seen"]:  # what parallelize took: shapes only
            assert part and {device for _, device in part} == {"meta"}, part
        assert result["meta_left"] == 0
        assert all(result["tied"])
    first = results[0]
    full, gathered = first["full"], first["gathered"]
    assert set(gathered) <= set(full)
    for name, tensor in gathered.items():
        assert tensor.dtype == full[name].dtype, name
        assert torch.equal(tensor, full[name]), name  # bit for bit: the one-process reference's values
    assert set(full) - set(gathered) <= {"head.weight"}  # a tied head, one parameter with the embedding
    full_elements = sum(t.numel() for name, t in full.items() if name in gathered)
    if any(axis in mesh for axis in ("dp", "tp", "shard", "ep")) and "data = ddp" not in lines:
        assert all(r["local_elements"] < full_elements for r in results)  # each rank holds its shards only
