"""Benchmark: what `plandsl run` adds to a training step, and its start-up time.

    python bench/bench_run.py                 # per-step overhead table (DDP, 1F1B pipeline, TP, ZeRO-1; a Hugging
                                              # Face Llama under DDP, FSDP and its own TP plan)
    python bench/bench_run.py --startup       # time from the command to the first step

Overhead. For each configuration, 2 gloo ranks are forked; each builds the job twice in the same
process group: once from a plan through plandsl's interpreter (`runtime.train.build_job`, stepped by
`train_step` plus the per-step metrics `train` records), once written by hand in the style of a torch
tutorial with the same torch APIs (DistributedDataParallel; `PipelineStage` + `Schedule1F1B`;
`parallelize_module` with Colwise/Rowwise styles; DDP with ZeroRedundancyOptimizer), the same model class, sizes, optimizer and LR
scheduler, and the loss all-reduced for logging as any real loop does. The two loops alternate
step by step (`--block`, default 1; the order flips each round) so that drift on a shared machine
hits both alike; blocks of 5 steps left 5-10 % between runs here. The table reports each side's
median step and the ratio. The issue's bound: overhead <= 3 %. `zero1_impl` compares two optimizers
instead of two loops: plandsl's `Zero1Optimizer` (what ZeRO-1 runs on for DTensors) against torch's
ZeroRedundancyOptimizer, both in the hand-written DDP loop over plain tensors.

Start-up. `plandsl run stdlib_plans/local/dp.plan` (checks the plan, launches torchrun, every rank
loads the plan, builds mesh and model) against `torchrun` of this file's hand-written DDP loop, both
measured from the command to the first step's end minus that step's time.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from ranks import fork_ranks

ROOT = Path(__file__).resolve().parent.parent

PLAN = """\
import "clusters/local"
model bench_gpt = gpt(layers=4, hidden=256, heads=8, seq=128, vocab=2048)
plan bench {{
  model   = bench_gpt
  cluster = localhost
  mesh    = {mesh}
  train   = {{ global_batch: 8, micro_batch: {micro}, precision: fp32, optimizer: adam, lr: 1e-4, seed: 0, grad_clip: none }}
{body}
}}
"""

CONFIGS = {
    "ddp": dict(mesh="[dp = 2] over devices[0:2]", micro=4, body="  data = ddp over dp"),
    "1f1b": dict(mesh="[pp = 2] over devices[0:2]", micro=2, body="  stages = evenly over pp\n  schedule = 1f1b"),
    "tp": dict(mesh="[tp = 2] over devices[0:2]", micro=8, body="  tensor = megatron over tp"),
    "zero1": dict(mesh="[dp = 2] over devices[0:2]", micro=4, body="  data = zero1 over dp"),
    # not a plan against a hand loop: the same hand-written DDP loop with plandsl's ZeRO-1 for DTensors
    # (`runtime.zero.Zero1Optimizer`, here over plain tensors) against torch's ZeroRedundancyOptimizer
    "zero1_impl": dict(mesh="[dp = 2] over devices[0:2]", micro=4, body="  data = zero1 over dp"),
}


# A Hugging Face Llama (transformers' own module, unchanged) against the same module driven by hand
HF_MODEL = ('hf("LlamaForCausalLM", hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8, '
            'num_key_value_heads=4, vocab_size=2048, max_position_embeddings=128, tie_word_embeddings=false)')
CONFIGS["hf_ddp"] = dict(CONFIGS["ddp"], model=HF_MODEL)
CONFIGS["hf_fsdp"] = dict(mesh="[dp = 2] over devices[0:2]", micro=4, body="  data = zero3 over dp", model=HF_MODEL)
CONFIGS["hf_tp"] = dict(CONFIGS["tp"], model=HF_MODEL)
HF_FOLDER = Path(tempfile.gettempdir()) / "plandsl-bench-hf"  # the plan and its layer table (`plandsl inspect`)


def load(config: str):
    from plandsl import api
    settings = CONFIGS[config]
    text = PLAN.format(**settings)
    if "model" not in settings:
        return api.loads(text, path=str(ROOT / "bench" / "bench_run.plan")).plans[0]
    text = text.replace("model   = bench_gpt", f"model   = {settings['model']}")
    HF_FOLDER.mkdir(exist_ok=True)
    path = HF_FOLDER / f"{config}.plan"
    if not path.exists() or path.read_text(encoding="utf-8") != text:  # the parent writes it; the ranks read it
        path.write_text(text, encoding="utf-8")
    if not api.check(path).ok:  # the table is missing (inspected once, in the parent before the ranks fork)
        api.inspect_plan(path)
    return api.load_plan(path)


# ---- the hand-written loops ------------------------------------------------------------------
def _optimizer(model_params, plan):
    optimizer = torch.optim.AdamW(model_params, lr=plan.train.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)


def _tokens(plan, rows: int, step: int):
    generator = torch.Generator().manual_seed(step)
    vocab = getattr(plan.model, "vocab", 2048)  # a model from torch: HF_MODEL's vocab_size
    tokens = torch.randint(vocab, (rows, plan.seq + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def _cross_entropy(logits, targets):
    return torch.nn.functional.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())


def _zero_redundancy(params, plan):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    optimizer = ZeroRedundancyOptimizer(list(params), optimizer_class=torch.optim.AdamW, lr=plan.train.lr,
                                        betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)


def _zero1_plandsl(params, plan):
    from plandsl.runtime.parallel.zero import Zero1Optimizer
    optimizer = Zero1Optimizer([(list(params), dist.group.WORLD)], torch.optim.AdamW, lr=plan.train.lr,
                               betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)


def hand_ddp(plan, model, make_optimizer=_optimizer):
    from torch.nn.parallel import DistributedDataParallel
    ddp = DistributedDataParallel(model)
    optimizer, scheduler = make_optimizer(ddp.parameters(), plan)
    rows = plan.train.global_batch // dist.get_world_size()

    def step(index: int) -> float:
        inputs, targets = _tokens(plan, rows, index)
        optimizer.zero_grad()
        loss = _cross_entropy(ddp(inputs), targets)
        loss.backward()
        optimizer.step()
        scheduler.step()
        logged = loss.detach().clone()
        dist.all_reduce(logged)
        return logged.item() / dist.get_world_size()
    return step


def hand_1f1b(plan, model):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    rank, world = dist.get_rank(), dist.get_world_size()
    stage = copy.deepcopy(model)
    half = plan.model.layers // 2
    for index in range(plan.model.layers):
        if (index < half) != (rank == 0):
            del stage.layers[str(index)]
    if rank == 0:
        stage.norm, stage.head = None, None
    else:
        stage.embed = None
    pipeline_stage = PipelineStage(stage, rank, world, torch.device("cpu"))
    schedule = Schedule1F1B(pipeline_stage, plan.train.global_batch // plan.train.micro_batch, loss_fn=_cross_entropy)
    optimizer, scheduler = _optimizer(stage.parameters(), plan)

    def step(index: int) -> float:
        inputs, targets = _tokens(plan, plan.train.global_batch, index)
        optimizer.zero_grad()
        losses: list = []
        if rank == 0:
            schedule.step(inputs)
        else:
            schedule.step(target=targets, losses=losses)
        optimizer.step()
        scheduler.step()
        logged = torch.stack(losses).mean().detach() if losses else torch.zeros(())
        dist.all_reduce(logged)
        return logged.item()
    return step


def hand_tp(plan, model):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    parallelize_module(model, mesh, {"embed.tok": RowwiseParallel(input_layouts=Replicate()),
                                     "head": ColwiseParallel(output_layouts=Replicate())})
    for block in model.layers.values():
        parallelize_module(block, mesh, {"attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(),
                                         "attn.wv": ColwiseParallel(), "attn.wo": RowwiseParallel(),
                                         "mlp.w1": ColwiseParallel(), "mlp.w2": RowwiseParallel()})
    optimizer, scheduler = _optimizer(model.parameters(), plan)

    def step(index: int) -> float:
        inputs, targets = _tokens(plan, plan.train.global_batch, index)
        optimizer.zero_grad()
        loss = _cross_entropy(model(inputs), targets)
        loss.backward()
        optimizer.step()
        scheduler.step()
        return loss.item()
    return step


def hand_hf_tp(plan, module):
    """transformers' module split by its own plan with torch's styles, written out by hand."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    parallelize_module(module, mesh, {"lm_head": ColwiseParallel(output_layouts=Replicate()),
                                      **{f"model.layers.*.{name}": ColwiseParallel() for name in (
                                          "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                          "mlp.gate_proj", "mlp.up_proj")},
                                      "model.layers.*.self_attn.o_proj": RowwiseParallel(),
                                      "model.layers.*.mlp.down_proj": RowwiseParallel()})
    optimizer, scheduler = _optimizer(module.parameters(), plan)

    def step(index: int) -> float:
        inputs, targets = _tokens(plan, plan.train.global_batch, index)
        optimizer.zero_grad()
        loss = _hf_loss(module, module(input_ids=inputs, use_cache=False).logits, targets)
        loss.backward()
        optimizer.step()
        scheduler.step()
        return loss.item()
    return step


def hand_hf_data(plan, module, shard: bool):
    """DDP, or FSDP2 per decoder layer then the root, around transformers' module, by hand."""
    if shard:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for index, layer in enumerate(module.model.layers):
            fully_shard(layer, mesh=mesh, reshard_after_forward=index < len(module.model.layers) - 1)
        wrapped = fully_shard(module, mesh=mesh)
    else:
        from torch.nn.parallel import DistributedDataParallel
        wrapped = DistributedDataParallel(module)
    optimizer, scheduler = _optimizer(wrapped.parameters(), plan)
    rows = plan.train.global_batch // dist.get_world_size()

    def step(index: int) -> float:
        inputs, targets = _tokens(plan, rows, index)
        optimizer.zero_grad()
        loss = _hf_loss(module, wrapped(input_ids=inputs, use_cache=False).logits, targets)
        loss.backward()
        optimizer.step()
        scheduler.step()
        logged = loss.detach().clone()
        dist.all_reduce(logged)
        return logged.item() / dist.get_world_size()
    return step


def _hf_loss(module, logits, targets):
    return module.loss_function(logits=logits, labels=None, vocab_size=module.config.vocab_size,
                                shift_labels=targets.contiguous())


HAND = {"ddp": hand_ddp, "1f1b": hand_1f1b, "tp": hand_tp,
        "hf_ddp": lambda plan, model: hand_hf_data(plan, model.inner, shard=False),
        "hf_fsdp": lambda plan, model: hand_hf_data(plan, model.inner, shard=True),
        "hf_tp": lambda plan, model: hand_hf_tp(plan, model.inner),
        "zero1": lambda plan, model: hand_ddp(plan, model, _zero_redundancy)}
HAND["zero1_impl"] = HAND["zero1"]


# ---- plandsl's loop --------------------------------------------------------------------------
def plandsl_loop(plan):
    from plandsl.runtime.parallel.mesh import build_mesh
    from plandsl.runtime.train import RunConfig, build_job, peak_memory, train_step
    device = torch.device("cpu")
    job = build_job(plan, build_mesh(plan, device), device, RunConfig(steps=1000, quiet=True))

    def step(index: int) -> float:
        loss = train_step(job, index)
        peak_memory(device)  # what `train` records per step besides the loss
        return loss
    return step


# ---- the overhead measurement ----------------------------------------------------------------
def _rank(rank: int, world: int, config: str, store_dir: str, blocks: int, block: int, out: str) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(store_dir, "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=120))
    from plandsl.runtime.models import build_model
    plan = load(config)
    ours = hand_ddp(plan, build_model(plan.model, 0), _zero1_plandsl) if config == "zero1_impl" else plandsl_loop(plan)
    loops = {"plandsl": ours, "hand": HAND[config](plan, build_model(plan.model, 0))}
    times: dict[str, list[float]] = {name: [] for name in loops}
    index = 0
    for round_ in range(blocks + 1):  # the first round warms both up and is not counted
        for name, loop in (loops.items() if round_ % 2 == 0 else reversed(loops.items())):
            for _ in range(block):
                dist.barrier()
                start = time.perf_counter()
                loop(index)
                elapsed = time.perf_counter() - start
                index += 1
                if round_:
                    times[name].append(elapsed)
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    os._exit(0)  # see plandsl.run.entry: no gloo teardown


def overhead(config: str, blocks: int, block: int) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.json")
        fork_ranks(_rank, 2, (2, config, tmp, blocks, block, out), 600, config)
        times = json.loads(Path(out).read_text())
    return statistics.median(times["plandsl"]), statistics.median(times["hand"])


# ---- start-up --------------------------------------------------------------------------------
def _first_step_s(command: list[str], metrics: Path) -> float:
    """Seconds from starting `command` until its first step ended, minus that step's own time."""
    start = time.perf_counter()
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    while True:
        if metrics.exists() and metrics.read_text().strip():
            seen = time.perf_counter()
            first = json.loads(metrics.read_text().splitlines()[0])
            break
        if proc.poll() is not None:
            raise SystemExit(f"{' '.join(command)} ended without a step:\n{proc.stderr.read()}")
        time.sleep(0.005)
    proc.wait(timeout=120)
    return seen - start - first["step_time_s"]


def hand_main(steps: int, metrics: str) -> None:
    """The hand-written DDP loop under torchrun (`--worker`): what start-up is compared with."""
    dist.init_process_group("gloo")
    from plandsl.runtime.models import build_model
    plan = load("ddp")
    step = hand_ddp(plan, build_model(plan.model, 0))
    for index in range(steps):
        start = time.perf_counter()
        loss = step(index)
        elapsed = time.perf_counter() - start
        if dist.get_rank() == 0:
            with open(metrics, "a", encoding="utf-8") as handle:
                handle.write(json.dumps({"step": index + 1, "loss": loss, "step_time_s": elapsed}) + "\n")
    sys.stdout.flush()
    os._exit(0)


def startup(repeat: int) -> list[tuple[str, float]]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        commands = {
            "plandsl run stdlib_plans/local/dp.plan": lambda m: [
                sys.executable, "-m", "plandsl.cli", "run", "stdlib_plans/local/dp.plan", "--steps", "2",
                "--metrics", str(m)],
            "torchrun --standalone --nproc-per-node 2 (hand-written DDP)": lambda m: [
                sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                str(Path(__file__).resolve()), "--worker", "--metrics", str(m)],
        }
        for name, command in commands.items():
            samples = []
            for attempt in range(repeat):
                metrics = Path(tmp) / f"{len(rows)}-{attempt}.jsonl"
                samples.append(_first_step_s(command(metrics), metrics))
            rows.append((name, min(samples)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--startup", action="store_true", help="measure start-up instead of per-step overhead")
    parser.add_argument("--blocks", type=int, default=80, help="alternating blocks per side (default 80)")
    parser.add_argument("--block", type=int, default=1, help="steps per block (default 1: alternate every step)")
    parser.add_argument("--repeat", type=int, default=3, help="start-up runs per command (best counts)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--metrics", help=argparse.SUPPRESS)
    parser.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    args = parser.parse_args()
    if args.worker:
        hand_main(2, args.metrics)
    if args.startup:
        print("| command (2 ranks, gloo, CPU) | start-up to first step (s) |")
        print("|---|---|")
        for name, seconds in startup(args.repeat):
            print(f"| `{name}` | {seconds:.2f} |")
        return
    print("| configuration (2 ranks, gloo, CPU) | plandsl step (ms) | hand-written step (ms) | overhead |")
    print("|---|---|---|---|")
    for config in args.configs:
        if "model" in CONFIGS[config]:
            load(config)  # inspect the model once, here, before the ranks fork
        ours, hand = overhead(config, args.blocks, args.block)
        print(f"| {config} | {ours * 1e3:.1f} | {hand * 1e3:.1f} | {(ours / hand - 1) * 100:+.1f} % |", flush=True)


if __name__ == "__main__":
    main()
