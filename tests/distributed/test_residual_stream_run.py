"""`plandsl run` at `precision: bf16` over fp32 weights keeps the residual stream in bf16 (`runtime.precision.
keep_stream`), whatever wraps the blocks: every block's input under FSDP and under a pipeline with full
recomputation (the inputs it saves), and the boundary a traced user module's pipeline stage receives (torch's
tracer drops the embedding's cast, which `torch_model.stage_modules` puts back). fp32 stays fp32."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.harness import run_ranks
from tests.distributed.ranks import RANK_TIMEOUT_S, load

pytestmark = pytest.mark.dist

BF16 = "{ global_batch: 8, micro_batch: 2, precision: bf16, lr: 1e-3, seed: 0%s }"
_PLAN = ('import "clusters/local"\nimport "local/tiny"\nplan p {{\n  model = {model}\n  cluster = localhost\n'
         "  mesh = [{axis} = 2] over devices[0:2]\n  train = {train}\n  {lines}\n}}\n")


def _dtypes(rank: int, source) -> dict:
    """One step; the dtypes of every block's input and of torch's pipeline receive buffers."""
    import torch

    from plandsl.runtime.models import Block
    from plandsl.runtime.train import RunConfig, run
    seen: set[str] = set()

    def record(module, args):
        if isinstance(module, Block) and args and isinstance(args[0], torch.Tensor):
            seen.add(str(args[0].dtype))

    handle = torch.nn.modules.module.register_module_forward_pre_hook(record)
    try:
        status, job = run(load(source), RunConfig(steps=1, quiet=True, timeout_s=RANK_TIMEOUT_S))
    finally:
        handle.remove()
    stages = job.pipeline.stages if job.pipeline is not None else []
    buffers = {str(info.buffer.dtype) for stage in stages
               for infos in (*stage.args_recv_info.values(), *stage.grad_recv_info.values())
               for info in infos if not getattr(info, "is_root_arg", False) and info.buffer is not None}
    return {"status": status, "blocks": sorted(seen), "buffers": sorted(buffers)}


@pytest.mark.parametrize("axis, lines, train, dtype", [
    ("dp", "data = zero3 over dp", BF16 % "", "torch.bfloat16"),
    ("pp", "stages = evenly over pp\n  schedule = 1f1b", BF16 % ", recompute: full", "torch.bfloat16"),
    ("dp", "data = zero3 over dp", BF16.replace("bf16", "fp32") % "", "torch.float32"),
], ids=["fsdp_bf16", "pipeline_recompute_bf16", "fsdp_fp32"])
def test_every_block_input_is_in_the_compute_dtype(axis, lines, train, dtype):
    text = _PLAN.format(model="tiny_gpt", axis=axis, train=train, lines=lines)
    results = run_ranks(2, _dtypes, text, deadline_s=120)
    assert [r["status"] for r in results] == [0, 0]
    for result in results:
        assert result["blocks"] == [dtype], result
        assert set(result["buffers"]) <= {dtype}, result
    if axis == "pp":
        assert all(r["buffers"] == [dtype] for r in results), results


def test_a_traced_user_modules_stage_boundary_is_bf16(tmp_path, monkeypatch):
    from tests.distributed.test_torch_models import _write
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "unit"))  # the factory's package
    plan = _write(tmp_path, "factory_bf16", 'factory("inspect_models.tiny:build", depth=4, tied=false)', "[pp = 2]",
                  "stages = evenly over pp\nschedule = gpipe", BF16 % "")
    results = run_ranks(2, _dtypes, str(plan), deadline_s=120)
    assert [r["status"] for r in results] == [0, 0]
    assert [r["buffers"] for r in results] == [["torch.bfloat16"]] * 2, results
