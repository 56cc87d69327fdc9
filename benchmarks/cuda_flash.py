"""Prefill attention kernels on the GPU at the real models' shapes: the f32 flash kernel (``flash.attend``, the
default; the named baseline) against the tensor-core kernel (``flash.attend_mma``, ``LUMEN_CUDA_FLASH=mma``) over a
bf16 KV cache, one layer's attention, causal from position 0. Prints ms (median of --reps after a warm-up), TFLOP/s
over the attended pairs (4 x heads x D x the causal or windowed pairs), the ratio, and the largest
difference between the two outputs relative to max(1, max |f32 kernel|).

    python benchmarks/cuda_flash.py [--tokens 512,4096] [--reps 5] [--json out.json]

Shapes: Qwen3.5-9B full attention (16 heads / 4 kv of 256), Gemma-4-26B-A4B sliding (16 / 8 of 256, window 1024)
and global (16 / 2 of 512). Dev tool: cupy.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

SHAPES = {  # name: (Hq, Hkv, D, window)
    "qwen3.5-9b full": (16, 4, 256, None),
    "gemma4-26b sliding": (16, 8, 256, 1024),
    "gemma4-26b global": (16, 2, 512, None),
}


def pairs(T: int, window: int | None) -> int:
    """Attended (query, key) pairs of a causal prefill of T tokens from position 0."""
    if window is None or window >= T:
        return T * (T + 1) // 2
    return window * (window + 1) // 2 + (T - window) * window


def time_ms(cp, fn, args, reps: int) -> float:
    fn(*args)
    cp.cuda.Device().synchronize()
    times = []
    for _ in range(reps):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        fn(*args)
        b.record()
        b.synchronize()
        times.append(cp.cuda.get_elapsed_time(a, b))
    return float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="512,4096", help="prefill lengths (comma-separated)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    import cupy as cp
    from lumen_cuda import attention, flash, fp8_mma

    print(f"device: {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}")
    print(f"{'shape':<22} {'T':>5} {'f32 ms':>8} {'TFLOP/s':>8} {'mma ms':>8} {'TFLOP/s':>8} {'speedup':>8} "
          f"{'max rel diff':>12}  kernel")
    rows = []
    rng = np.random.default_rng(0)
    for name, (Hq, Hkv, D, window) in SHAPES.items():
        for T in (int(t) for t in args.tokens.split(",")):
            q = cp.asarray(rng.normal(size=(T, Hq, D)).astype(np.float32))
            kb = fp8_mma.bf16_round(cp.asarray(rng.normal(size=(Hkv, T, D)).astype(np.float32)))
            vb = fp8_mma.bf16_round(cp.asarray(rng.normal(size=(Hkv, T, D)).astype(np.float32)))
            kf, vf = attention.decode(kb), attention.decode(vb)
            scale = D ** -0.5
            base = flash.attend(q, kf, vf, 0, 0, scale, window, None)
            mma = flash.attend_mma(q, kb, vb, 0, 0, scale, window, None)
            if base is None or mma is None:
                print(f"{name:<22} {T:>5} declined (f32 {base is not None}, mma {mma is not None})")
                continue
            diff = float(cp.abs(mma - base).max() / max(1.0, float(cp.abs(base).max())))
            t_f32 = time_ms(cp, flash.attend, (q, kf, vf, 0, 0, scale, window, None), args.reps)
            t_mma = time_ms(cp, flash.attend_mma, (q, kb, vb, 0, 0, scale, window, None), args.reps)
            flops = 4 * Hq * D * pairs(T, window)
            kernel = flash.mma_kernel(D, D, flash._smem_limit())[0]
            print(f"{name:<22} {T:>5} {t_f32:>8.3f} {flops / t_f32 / 1e9:>8.1f} {t_mma:>8.3f} "
                  f"{flops / t_mma / 1e9:>8.1f} {t_f32 / t_mma:>7.2f}x {diff:>12.2e}  {kernel}")
            rows.append(dict(shape=name, tokens=T, f32_ms=t_f32, mma_ms=t_mma, speedup=t_f32 / t_mma, max_rel_diff=diff,
                             kernel=kernel))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
