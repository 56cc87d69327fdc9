"""Prefill attention kernels on the GPU at the real models' shapes, one layer's attention, causal from position 0: the
f32 flash kernel (``flash.attend``: f32 caches, ``LUMEN_CUDA_FLASH=1``; the named baseline) against the tensor-core
kernel over a bf16 cache (``flash.attend_mma``: bf16 / fp8 caches by default, ``flash.mma_wanted``) and FP8 attention
over an fp8 cache (``flash.attend_fp8``, ``attention.compute-quantization: fp8``, its V layout pass included). Prints ms
(median of --reps after a warm-up), TFLOP/s over the attended pairs (4 x heads x D x the causal or windowed pairs), the
ratio to the baseline, and the largest difference from the f32 kernel over the same cache's values, relative to max(1,
max |f32 kernel|) (FP8 attention's is its quantization: ~1e-2 expected).

    python benchmarks/cuda_flash.py [--tokens 512,4096] [--reps 5] [--json out.json]
    python benchmarks/cuda_flash.py --tokens 32768 --reps 2   # long context (issue 21: FP8 attention at 32k)

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
    print(f"{'shape':<20} {'T':>6} {'f32 ms':>9} {'TF/s':>6} | {'mma ms':>8} {'TF/s':>6} {'x':>6} {'diff':>8} | "
          f"{'fp8 ms':>8} {'TF/s':>6} {'x':>6} {'diff':>8}")
    rows = []
    rng = np.random.default_rng(0)
    for name, (Hq, Hkv, D, window) in SHAPES.items():
        for T in (int(t) for t in args.tokens.split(",")):
            q = cp.asarray(rng.normal(size=(T, Hq, D)).astype(np.float32))
            kv = [cp.asarray(rng.normal(size=(Hkv, T, D)).astype(np.float32)) for _ in range(2)]
            kb, vb = (fp8_mma.bf16_round(x) for x in kv)  # a bf16 cache's rows
            k8, v8 = (attention.encode(x, cp.uint8) for x in kv)  # an fp8 cache's rows
            kf, vf = attention.decode(kb), attention.decode(vb)
            scale = D ** -0.5
            flops = 4 * Hq * D * pairs(T, window)
            row = dict(shape=name, tokens=T)
            base = flash.attend(q, kf, vf, 0, 0, scale, window, None)
            if base is None:
                print(f"{name:<20} {T:>6} the f32 kernel declined")
                continue
            row["f32_ms"] = time_ms(cp, flash.attend, (q, kf, vf, 0, 0, scale, window, None), args.reps)
            cells = []
            for key, fn, args_, ref in (
                    ("mma", flash.attend_mma, (q, kb, vb, 0, 0, scale, window, None), base),
                    ("fp8", flash.attend_fp8, (q, k8, v8, 0, 0, scale, window, None),
                     flash.attend(q, attention.decode(k8), attention.decode(v8), 0, 0, scale, window, None))):
                got = fn(*args_)
                if got is None:
                    cells.append(f"{'declined':>8} {'':>6} {'':>6} {'':>8}")
                    continue
                diff = float(cp.abs(got - ref).max()) / max(1.0, float(cp.abs(ref).max()))
                ms = time_ms(cp, fn, args_, args.reps)
                row.update({f"{key}_ms": ms, f"{key}_speedup": row["f32_ms"] / ms, f"{key}_max_rel_diff": diff})
                cells.append(f"{ms:>8.3f} {flops / ms / 1e9:>6.1f} {row['f32_ms'] / ms:>5.2f}x {diff:>8.1e}")
            print(f"{name:<20} {T:>6} {row['f32_ms']:>9.3f} {flops / row['f32_ms'] / 1e9:>6.1f} | {cells[0]} | "
                  f"{cells[1]}")
            rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
