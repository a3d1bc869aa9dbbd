#!/usr/bin/env bash
# profile -> estimate -> run on one GPU: measure the machine (`plandsl profile`), estimate the 1.4B gpt of
# single.plan on the measured cluster file instead of the datasheet's, run it, and put the two side by side
# (`estimate --against`). Run from the repository root: bash bench/gpu/loop.sh OUTDIR
set -u
out=${1:-/tmp/gpu-loop}; mkdir -p "$out"
source bench/gpu/env.sh
plandsl() { python3 -m plandsl.cli "$@"; }
t0=$(date +%s)
plandsl profile -o "$out/h200_profiled.plan" || exit 1
echo "--- profile: $(( $(date +%s) - t0 )) s"
node=$(grep -m1 -o '^node [a-zA-Z0-9_]*' "$out/h200_profiled.plan" | cut -d' ' -f2)
cat > "$out/gpt_1b_profiled.plan" <<PLAN
import "h200_profiled"
model gpt_1b = gpt(layers=16, hidden=2048, heads=16, seq=2048, vocab=32000)
plan gpt_1b_bf16 {
  model   = gpt_1b
  cluster = $node
  mesh    = [dp = 1] over devices[0:1]
  train   = { global_batch: 16, micro_batch: 4, precision: bf16, optimizer: adam, lr: 1e-4, seed: 0 }
}
PLAN
plandsl check "$out/gpt_1b_profiled.plan"
plandsl run "$out/gpt_1b_profiled.plan" --steps 12 --metrics "$out/gpt_1b_profiled.jsonl" | tail -3
plandsl estimate "$out/gpt_1b_profiled.plan" --against "$out/gpt_1b_profiled.jsonl"
plandsl estimate bench/gpu/single.plan --plan gpt_1b_bf16 --against "$out/gpt_1b_profiled.jsonl"
