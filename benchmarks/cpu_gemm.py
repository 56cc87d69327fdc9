"""Many-token products over int8-repacked weights on the CPU: Lumen's kernels (the GEMV up to
``fused.GEMV_MAX_T`` tokens, the 4-row GEMM of ``lumen_cpu.gemm`` from there) against the baseline they replaced,
dequantize to f32 + OpenBLAS SGEMM (numpy ``@``), on Gemma 3 270M's layer shapes (random Q4_K-like codes: int8
codes, a scale and a minimum per 32).

    python benchmarks/cpu_gemm.py [--threads 2] [--tokens 1 2 3 4 8 16 64 128 512] [--repeat 15]

Prints, per shape and token count, the median time of each, GFLOP/s (2 x rows x cols x tokens) and the ratio.
Each is timed after a 0.3 s pause: OpenBLAS's threads keep spinning after a call and slow whatever runs next on the
same cores (in a model, Lumen's CPU forward makes no BLAS call on quantized weights, for that reason).
The baseline dequantizes serially (as the replaced path did, between BLAS calls), its SGEMM on OpenBLAS's threads.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from _timing import limit_threads, machine

SHAPES = {"q": (1024, 640), "k/v": (256, 640), "o": (640, 1024), "gate/up": (2048, 640), "down": (640, 2048)}


def median_time(fn, repeat: int) -> float:
    time.sleep(0.3)  # OpenBLAS's threads spin for a while after a call and would slow the next kernel's threads
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 3, 4, 8, 16, 64, 128, 512])
    p.add_argument("--repeat", type=int, default=15)
    args = p.parse_args()
    limit_threads(args.threads)
    import numba

    numba.set_num_threads(min(args.threads, numba.config.NUMBA_NUM_THREADS))
    from lumen_cpu import int8
    from lumen_cpu.int8 import I8Data

    from lumen_core.backend import Weight

    rng = np.random.default_rng(0)
    mach = machine()
    print(f"{mach['cpu']}, {mach['cores']} cores, {args.threads} threads; median of {args.repeat}\n")
    print("| matrix | tokens | Lumen us | GFLOP/s | dequantize + SGEMM us | GFLOP/s | Lumen / baseline |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, (R, C) in SHAPES.items():
        data = I8Data(rng.integers(0, 16, (R, C), dtype=np.int8), rng.uniform(0, 0.01, (R, C // 32)).astype(np.float32),
                      rng.uniform(0, 0.01, (R, C // 32)).astype(np.float32))
        w = Weight(data, "i8", (R, C), None, None)
        for T in args.tokens:
            x = rng.normal(size=(T, C)).astype(np.float32)
            ours = median_time(lambda x=x, w=w: int8.linear(x, w), args.repeat)
            base = median_time(lambda x=x, w=w: x @ int8.dequantize_rows(w).T, args.repeat)
            flop = 2 * R * C * T
            print(f"| {name} {R}x{C} | {T} | {ours * 1e6:.0f} | {flop / ours / 1e9:.1f} | {base * 1e6:.0f} | "
                  f"{flop / base / 1e9:.1f} | {base / ours:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
