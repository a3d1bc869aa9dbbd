#!/usr/bin/env bash
# The distributed tests on another torch (the GPU machine's), on its CPUs: each test in a pytest process
# of its own (a forked rank fails when its parent already ran autograd on a CUDA build of torch), at most
# JOBS at once. Run from the repository root after bench/gpu/env.sh:
#   bash bench/gpu/compat.sh OUT.log [TEST_ID ...]     (no ids: every test of tests/distributed)
set -u
log=$1; shift
jobs=${JOBS:-12}
export CUDA_VISIBLE_DEVICES=  # gloo on the CPU, as on the development machine
if [ $# -eq 0 ]; then
  mapfile -t ids < <(python3 -m pytest -q --collect-only -p no:cacheprovider -m "dist or slow" tests/distributed \
                     | grep '::')
else
  ids=("$@")
fi
printf '%s\n' "${ids[@]}" | xargs -P "$jobs" -I{} sh -c \
  'out=$(python3 -m pytest -q -n 0 -p no:cacheprovider "$1" 2>&1); rc=$?; echo "rc=$rc $1"; [ $rc -eq 0 ] || echo "$out" | tail -25' _ {} > "$log"
grep -c '^rc=0 ' "$log" | sed 's/^/passed: /'; grep '^rc=[^0]' "$log" || true
