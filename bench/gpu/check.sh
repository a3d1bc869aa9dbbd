#!/usr/bin/env bash
# The interpreter's GPU checks, on a machine with one CUDA GPU (the device tool's H200; see
# docs/benchmarks.md for what they gave). Run from the repository root:
#   bash bench/gpu/check.sh OUTDIR
# Without the package installed there, bench/gpu/env.sh installs its wheels from .whl/ first.
set -u
out=${1:-/tmp/gpu-check}; mkdir -p "$out"
source bench/gpu/env.sh
plandsl() { python3 -m plandsl.cli "$@"; }
step() {  # step NAME COMMAND...: the command's output, exit status and seconds
  local name=$1; shift
  echo "=== $name: $*"
  local t0=$(date +%s%N)
  "$@"; local rc=$?
  echo "--- $name: rc=$rc, $(( ($(date +%s%N) - t0) / 1000000 )) ms"
}
step env python3 -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0), torch.cuda.device_count())"
step probe python3 bench/gpu/probe.py
# Sustained GEMM and attention throughput with the SM clock and board power, 30 s per kernel (about a minute in all),
# before the runs below warm the GPU, so that its first window is the burst figure the last one is compared with.
step sustained python3 bench/gpu/sustained.py "$out/sustained.json" --seconds 30
# plandsl profile's own sustained sweep on CUDA (--quick: a 5 s hold, 3 shapes per precision; the full one holds 30 s
# and times 37 GEMMs, ~1.5 min): the file states sms, the sustained knobs, the bursts and the SM clock and power read.
step profile plandsl profile --quick -o "$out/profile.plan"
step check plandsl check bench/gpu/single.plan
step fp32 plandsl run bench/gpu/single.plan --plan tiny_fp32 --steps 5 --check-equivalence
step bf16 plandsl run bench/gpu/single.plan --plan tiny_bf16 --steps 5 --check-equivalence
step fsdp plandsl run bench/gpu/single.plan --plan tiny_fsdp --steps 5 --check-equivalence
step selective plandsl run bench/gpu/single.plan --plan tiny_selective --steps 5 --check-equivalence
step save plandsl run bench/gpu/single.plan --plan tiny_fsdp --steps 3 --checkpoint-dir "$out/ckpt"
step resume plandsl run bench/gpu/single.plan --plan tiny_fsdp --steps 5 --checkpoint-dir "$out/ckpt" --resume --check-equivalence
rm -rf "$out/ckpt"
step hf plandsl run bench/gpu/hf.plan --allow-model-import --steps 3 --check-equivalence
step too_many_ranks plandsl run stdlib_plans/local/dp.plan --steps 2   # refused: 2 ranks, 1 GPU (exit 1)
step cpu_ranks plandsl run stdlib_plans/local/dp.plan --steps 2 --device cpu --check-equivalence
step gpt_1b_estimate plandsl estimate bench/gpu/single.plan --plan gpt_1b_bf16 --json > "$out/gpt_1b_estimate.json"
step gpt_1b plandsl run bench/gpu/single.plan --plan gpt_1b_bf16 --steps 12 --metrics "$out/gpt_1b.jsonl"
exit 0
