"""Achieved GEMM throughput on one CUDA GPU across shapes and dtypes, and its copy bandwidth: the figures
the cost model's GEMM efficiency (plandsl/cost/compute.py) is compared with (docs/benchmarks.md).

    python3 bench/gpu/gemm.py OUT.json

Each point: an m x k by k x n product (A row-major, B column-major as a Linear's weight), 3 warm-ups,
then timed repeats with CUDA events until 25 ms or 20 repeats; median, min and max seconds. fp32 is
run with TF32 off (`fp32`) and on (`tf32`); fp8 is e4m3 x e4m3 -> bf16 through `torch._scaled_mm`
with unit scales, where this torch and GPU have it."""
import json
import statistics
import sys
import time

import torch

SQUARE = [256, 512, 1024, 2048, 4096, 8192, 16384]
# transformer shapes: tokens per microbatch (m) x hidden-derived (n, k), e.g. QKV / MLP of 4k-16k hidden
# models, whole and split 2-8 ways by tensor parallelism
TOKENS = [2048, 8192, 16384]
LINEAR = [(4096, 4096), (12288, 4096), (4096, 11008), (11008, 4096), (1536, 4096), (8192, 8192),
          (28672, 8192), (8192, 3584), (16384, 16384), (2048, 16384), (16384, 2048), (6144, 18432)]
DTYPES = ["bf16", "fp16", "tf32", "fp32", "fp8"]


def operands(dtype: str, m: int, n: int, k: int):
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "tf32": torch.float32, "fp32": torch.float32,
                   "fp8": torch.bfloat16}[dtype]
    a = torch.randn(m, k, device="cuda", dtype=torch_dtype)
    b = torch.randn(n, k, device="cuda", dtype=torch_dtype)
    if dtype == "fp8":
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
        one = torch.ones((), device="cuda")
        return lambda: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    return lambda: a @ b.t()


def measure(fn) -> list[float]:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times, spent = [], 0.0
    while len(times) < 20 and (spent < 0.025 or len(times) < 5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
        spent += times[-1]
    return times


def main(path: str) -> None:
    points = []
    shapes = [(s, s, s) for s in SQUARE] + [(m, n, k) for m in TOKENS for n, k in LINEAR]
    began = time.time()
    for dtype in DTYPES:
        torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
        for m, n, k in shapes:
            if dtype in ("fp32", "tf32") and m * n * k > 8192 ** 3:
                continue
            try:
                times = measure(operands(dtype, m, n, k))
            except (RuntimeError, AttributeError) as error:  # fp8 where torch or the GPU lacks it
                points.append({"dtype": dtype, "m": m, "n": n, "k": k, "error": str(error)[:200]})
                break
            median = statistics.median(times)
            points.append({"dtype": dtype, "m": m, "n": n, "k": k, "median_s": median, "min_s": min(times),
                           "max_s": max(times), "repeats": len(times), "tflops": 2 * m * n * k / median / 1e12})
            torch.cuda.empty_cache()
        best = max((p["tflops"] for p in points if p["dtype"] == dtype and "tflops" in p), default=0)
        print(f"{dtype}: best {best:.1f} TFLOP/s ({time.time() - began:.0f} s so far)", flush=True)
    size = 4 << 30  # bytes per buffer
    src = torch.empty(size, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy = measure(lambda: dst.copy_(src))
    bandwidth = {"bytes_read_and_written": 2 * size, "median_s": statistics.median(copy),
                 "gb_per_s": 2 * size / statistics.median(copy) / 1e9}
    print(f"copy: {bandwidth['gb_per_s']:.0f} GB/s read+written")
    props = torch.cuda.get_device_properties(0)
    result = {"device": props.name, "memory_bytes": props.total_memory, "sms": props.multi_processor_count,
              "torch": torch.__version__, "cuda": torch.version.cuda, "points": points, "copy": bandwidth}
    with open(path, "w") as out:
        json.dump(result, out, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
