"""How much memory and time a rank process takes to build its share of a model: `plandsl run`'s meta build (a
built-in family built on the meta device, parallelized there, each rank's shards allocated and filled:
`runtime.models.materialize`) against the whole-model build it replaced (`build_model` on the CPU, then sharded),
the same plan, layout and process count, in this one script; `--hf` builds transformers' LlamaForCausalLM of the
same shape instead (built with its parameters on the meta device and filled from its own `_init_weights`, against
its whole build on the CPU: `runtime.torch_model.build`).

Each (layout, build) forks its own gloo ranks (peak RSS is a process's high-water mark, so each build gets fresh
processes); every rank reports its peak RSS (`ru_maxrss`), its RSS before the build, the bytes of its parameters'
local shards and the seconds `build_job` took. The whole-model build is `build_job(make_model=...)` with
`build_model`, the path `run` took before the meta build (and still takes for models from torch and factories).

    python bench/bench_build.py            # tp2 fsdp2 pp2
    python bench/bench_build.py fsdp4
    python bench/bench_build.py --hf tp2 fsdp2 pp2
"""
from __future__ import annotations

import json
import os
import resource
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ranks import fork_ranks

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODEL = "llama(layers=16, hidden=2048, heads=16, kv_heads=8, seq=256, vocab=32000, ffn=5632)"  # 3.3 GiB of fp32
HF_MODEL = ('hf("LlamaForCausalLM", hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, '
            'num_attention_heads=16, num_key_value_heads=8, vocab_size=32000, max_position_embeddings=256, '
            'tie_word_embeddings=false)')  # the same shape
HF_FOLDER = Path(tempfile.gettempdir()) / "plandsl-bench-build-hf"  # the plans and their layer tables
PLAN = """\
import "local/tiny"
device bigcpu {{ memory = 64 GiB; bandwidth = 20 GB/s; peak = {{ fp32: 50 GFLOP/s, bf16: 50 GFLOP/s }}; reserve = 0 GiB }}
node bighost {{ devices = 8 x bigcpu; link = {{ bandwidth: 5 GB/s, latency: 20 us }} }}
plan p {{
  model   = {model}
  cluster = bighost
  mesh    = {mesh} over devices[0:{world}]
  train   = tiny_train
{body}
}}
"""
LAYOUTS = {
    "tp2": ("[tp = 2]", 2, "  tensor = megatron over tp"),
    "fsdp2": ("[dp = 2]", 2, "  data = zero3 over dp"),
    "fsdp4": ("[dp = 4]", 4, "  data = zero3 over dp"),
    "pp2": ("[pp = 2]", 2, "  stages = evenly over pp\n  schedule = 1f1b"),
}
GiB = 2**30


def _plan(layout: str, hf: bool = False):
    from plandsl import api
    mesh, world, body = LAYOUTS[layout]
    text = PLAN.format(model=HF_MODEL if hf else MODEL, mesh=mesh, world=world, body=body)
    if not hf:
        return api.select_plan(api.loads(text))
    path = HF_FOLDER / f"{layout}.plan"  # a model from torch reads its layer table beside the plan file
    if not path.exists():
        from plandsl.ir.inspected import write_cache
        from plandsl.lower.inspected import written_sources
        HF_FOLDER.mkdir(exist_ok=True)
        path.write_text(text, encoding="utf-8")
        for source, seq, cache in written_sources(api.parse_file(path)):
            Path(cache).parent.mkdir(exist_ok=True)
            write_cache(api.inspect_model(source.text, seq=seq), Path(cache))
    return api.load_plan(str(path))


def _rank(rank: int, world: int, layout: str, whole: bool, hf: bool, store_dir: str, out: str) -> None:
    torch.set_num_threads(1)
    rss = lambda: int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")  # noqa: E731
    start = rss()
    store = dist.FileStore(os.path.join(store_dir, "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=600))
    from plandsl.runtime import train
    from plandsl.runtime.models import build_model
    from plandsl.runtime.parallel.mesh import build_mesh
    from plandsl.runtime.torch_model import build as build_torch_model
    plan = _plan(layout, hf)
    device = torch.device("cpu")
    whole_model = build_torch_model if hf else build_model  # a Hugging Face model's whole build: its own, seeded
    make = (lambda: whole_model(plan.model, plan.train.seed)) if whole else None
    began = time.perf_counter()
    job = train.build_job(plan, build_mesh(plan, device), device, train.RunConfig(steps=1), make_model=make)
    seconds = time.perf_counter() - began
    local = sum(getattr(p, "_local_tensor", p).numel() * p.element_size() for m in job.models for p in m.parameters())
    result = {"rank": rank, "start": start / GiB, "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
              "local": local / GiB, "seconds": seconds}
    Path(f"{out}.{rank}").write_text(json.dumps(result))
    os._exit(0)  # see plandsl.run.entry: no gloo teardown


def build(layout: str, whole: bool, hf: bool = False) -> list[dict]:
    world = LAYOUTS[layout][1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank")
        fork_ranks(_rank, world, (world, layout, whole, hf, tmp, out), 900, layout)
        return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(world)]


def main() -> None:
    hf = "--hf" in sys.argv[1:]
    layouts = [arg for arg in sys.argv[1:] if arg != "--hf"] or ["tp2", "fsdp2", "pp2"]
    for layout in layouts:  # checked (and a model from torch inspected) once in the parent before the ranks fork
        _plan(layout, hf)
    print(f"model {HF_MODEL if hf else MODEL}, gloo on the CPU, {os.cpu_count()} cores, torch {torch.__version__}")
    print("| layout | build | peak RSS a rank (GiB) | its shards (GiB) | build_job (s) |")
    print("|---|---|---|---|---|")
    for layout in layouts:
        for whole in (True, False):
            ranks = build(layout, whole, hf)
            peak = max(r["peak"] for r in ranks)
            print(f"| {layout} | {'whole model, then sharded' if whole else 'meta, shards filled'} | {peak:.2f} | "
                  f"{max(r['local'] for r in ranks):.2f} | {max(r['seconds'] for r in ranks):.1f} |", flush=True)


if __name__ == "__main__":
    main()
