"""Sustained kernel throughput on one CUDA GPU: one training-shaped GEMM, and SDPA's causal attention, run back to
back for `--seconds` each, with the achieved TFLOP/s, the SM clock and the board power sampled every `--every`
seconds. What `bench/gpu/gemm.py` measures is a burst (3 warm-ups, up to 20 repeats, a cool GPU at full boost); a
training run holds the GPU at its power limit for hours. The ratio of the last window's throughput to the first's is
what a burst figure over-states for a training run (docs/validation.md, "Issue 20's targets": every H100 row
over-predicted with the burst knobs).

    python3 bench/gpu/sustained.py OUT.json [--seconds 60] [--every 2]

Each kernel: FLOPs counted as the cost model counts them (GEMM 2mnk; attention's executed FLOPs under the causal
mask, forward only: 4·b·h·s²·d / 2); clocks and power through `torch.cuda.clock_rate` and `torch.cuda.power_draw`
(NVML), absent where NVML is. On a machine without CUDA it runs the same loop on the CPU at a toy size for a few
seconds (a smoke test of the script, not a measurement)."""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F


def gemm(device: str, small: bool):
    m, n, k = (256, 256, 256) if small else (16384, 8192, 8192)  # a 70B-class MLP GEMM's tokens x features
    dtype = torch.float32 if small else torch.bfloat16
    a = torch.randn(m, k, device=device, dtype=dtype)
    b = torch.randn(n, k, device=device, dtype=dtype)
    return (lambda: a @ b.t()), 2.0 * m * n * k


def attention(device: str, small: bool):
    batch, heads, seq, dim = (1, 2, 128, 32) if small else (1, 32, 8192, 128)  # Llama's head dim, 8K tokens
    dtype = torch.float32 if small else torch.bfloat16
    q, k, v = (torch.randn(batch, heads, seq, dim, device=device, dtype=dtype) for _ in range(3))
    return (lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)), 4.0 * batch * heads * seq * seq * dim / 2


def sample(device: str) -> dict:
    if device != "cuda":
        return {}
    out = {}
    for name, read in (("sm_clock_mhz", torch.cuda.clock_rate), ("power_mw", torch.cuda.power_draw)):
        try:
            out[name] = read()
        except Exception:  # no NVML (pynvml) on this machine: the throughput alone
            pass
    return out


def run(fn, flops: float, device: str, seconds: float, every: float) -> list[dict]:
    """Windows of `every` seconds: kernels launched in batches, synchronised at each window's end."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(3):
        fn()
    sync()
    windows, began = [], time.perf_counter()
    while time.perf_counter() - began < seconds:
        start, calls = time.perf_counter(), 0
        while time.perf_counter() - start < every:
            for _ in range(8):
                fn()
            calls += 8
            sync()
        spent = time.perf_counter() - start
        windows.append({"at_s": round(start - began, 3), "tflops": flops * calls / spent / 1e12, **sample(device)})
    return windows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--every", type=float, default=2.0)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    small = device != "cuda"
    seconds, every = (2.0, 0.5) if small else (args.seconds, args.every)
    result = {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu (smoke test)",
              "torch": torch.__version__, "seconds": seconds, "kernels": {}}
    for name, make in (("gemm_bf16", gemm), ("attention_causal_bf16", attention)):
        fn, flops = make(device, small)
        windows = run(fn, flops, device, seconds, every)
        first, last = windows[0]["tflops"], windows[-1]["tflops"]
        result["kernels"][name] = {"flops_per_call": flops, "windows": windows, "first_tflops": first,
                                   "last_tflops": last, "sustained_over_first": last / first}
        print(f"{name}: first window {first:.1f} TFLOP/s, last {last:.1f} ({last / first:.3f} of the first)")
    with open(args.out, "w", encoding="utf-8") as out:
        json.dump(result, out, indent=1)


if __name__ == "__main__":
    main()
