"""fp8 prefill GEMMs on the GPU at Qwen3.5-9B shapes: the path Lumen takes by default (``gemv.gemm_split``: the
weight dequantized into bf16 hi + lo, three cuBLAS bf16 GEMMs, ~f32 accurate) against the opt-in kernels of
``lumen_cuda.fp8_mma`` (LUMEN_CUDA_MMA_PREFILL=exact: bf16 tensor cores, activations as three bf16 planes, f32-exact
products; =e4m3: e4m3 tensor cores, activations quantized to e4m3, lossy), with one cuBLAS bf16 GEMM of the same
shape (x and W rounded to bf16) as the named baseline. CUDA events, median of --reps
calls after a warm-up; TFLOP/s counts 2 T N K; "% peak" is against the datasheet's dense rates (fp8 1979, bf16
990 TFLOP/s for the H100 / H200 SXM: leads, not measurements).

    python benchmarks/cuda_fp8_gemm.py [--tokens 512,4096] [--reps 20] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics

import cupy as cp
import ml_dtypes
import numpy as np
from lumen_cuda import fp8_mma, gemv

from lumen_core.backend import Weight

SHAPES = [("attn q/o 4096x4096", 4096, 4096), ("mlp up 12288x4096", 12288, 4096),
          ("mlp down 4096x12288", 4096, 12288)]
PEAK = {"fp8": 1979e12, "bf16": 990e12}


def timed(fn, reps: int) -> float:
    fn()
    cp.cuda.Device().synchronize()
    times = []
    for _ in range(reps):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(cp.cuda.get_elapsed_time(a, b) / 1e3)
    return statistics.median(times)


def measure(name: str, codes, scale, x_host, reps: int) -> dict:
    """One row: the four GEMMs of x (T, K) against the fp8 weight (codes, block scales), printed and returned."""
    (N, K), T = codes.shape, x_host.shape[0]
    w = Weight(cp.asarray(codes), "fp8", (N, K), cp.asarray(scale), (128, 128))
    wb = cp.asarray(codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32).astype(ml_dtypes.bfloat16).view(np.uint16))
    x = cp.asarray(x_host)
    xq, sx = fp8_mma.quantize_x(x)
    xb = gemv.bf16_split(x)[0]
    y = cp.empty((T, N), cp.float32)

    def split(r, n, out):
        return gemv.fp8_split(w.data, w.scale, w.block, r, n, out)

    split_s = timed(lambda: gemv.gemm_split(x, N, split), reps)
    x3 = timed(lambda: fp8_mma.linear(x, w, "exact"), reps)
    mma_all = timed(lambda: fp8_mma.linear(x, w, "e4m3"), reps)
    mma = timed(lambda: fp8_mma.gemm(xq, sx, w.data, w.scale), reps)
    bf16 = timed(lambda: gemv._gemms_bf16(y, [(wb, xb)], K), reps)
    flop = 2.0 * T * N * K

    def tf(sec):
        return flop / sec / 1e12

    print(f"| {name} | {T} | {split_s * 1e3:.3f} | {x3 * 1e3:.3f} | {mma_all * 1e3:.3f} ({mma * 1e3:.3f}) | "
          f"{bf16 * 1e3:.3f} | {tf(split_s):.0f} | {tf(x3):.0f} | {tf(mma_all):.0f} "
          f"({100 * flop / mma_all / PEAK['fp8']:.1f}%) | {split_s / x3:.2f}x | {split_s / mma_all:.2f}x | "
          f"{bf16 / x3:.2f}x |", flush=True)
    return {"shape": name, "T": T, "gemm_split_ms": split_s * 1e3, "exact_ms": x3 * 1e3, "e4m3_ms": mma_all * 1e3,
            "e4m3_gemm_ms": mma * 1e3, "cublas_bf16_ms": bf16 * 1e3}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="512,4096")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--json")
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    print(f"device: {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}, cc "
          f"{cp.cuda.Device().compute_capability}")
    print("| shape | T | gemm_split ms | exact kernel ms | e4m3 kernel ms (gemm only) | cuBLAS bf16 ms | gemm_split "
          "TFLOP/s | exact TFLOP/s | e4m3 TFLOP/s (% fp8 peak) | exact / gemm_split | e4m3 / gemm_split | "
          "exact / cuBLAS bf16 |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows = []
    for name, N, K in SHAPES:
        codes = (rng.normal(size=(N, K)) * 0.5).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
        scale = rng.uniform(0.5, 2.0, size=(N // 128, K // 128)).astype(np.float32) * 0.01
        for T in (int(t) for t in args.tokens.split(",")):
            rows.append(measure(name, codes, scale, rng.normal(size=(T, K)).astype(np.float32), args.reps))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
