"""How the CPU experts' prompt path scales with threads: one 35B-A3B layer's routed experts (256 experts of H 2048,
I 512, top 8) over ``--tokens`` tokens through ``lumen_cpu.moe_fused.experts``, fp8 and NVFP4, the default (exact)
mode and ``cpu.compute-quantization: bf16``, at each ``--threads`` count in one process (``numba.set_num_threads``),
best and median of ``--calls`` calls. The baseline is the smallest thread count: each row prints its speed-up over
it and the parallel efficiency (speed-up / thread ratio).

    NUMBA_NUM_THREADS=16 python benchmarks/cpu_moe_threads.py [--threads 2,4,8,16] [--formats fp8,nvfp4] [--tokens 512]

Random weights (fp8: normal(0, 0.5) rounded to e4m3, block scales ~0.01; NVFP4: random e2m1 codes, block scales
2^-3 .. 2^0, global scale 0.01), random routing.
"""

from __future__ import annotations

import argparse
import statistics
import time

import ml_dtypes
import numpy as np

E, H, I, K_TOP = 256, 2048, 512, 8


def weights(fmt: str, bf16: bool, rng):
    from lumen_core.backend import Weight, scale_block

    def fp8(N, K):
        from lumen_cpu.fp8 import BF16Scale

        # normal-valued codes (as benchmarks/cpu_moe.py): uniformly random codes would reach +-448, whose gate sums
        # make silu underflow to f32 subnormals, which slow the vector code and no model does
        codes = (rng.standard_normal(size=(N, K), dtype=np.float32) * 0.5).astype(ml_dtypes.float8_e4m3fn)
        scale = rng.uniform(0.5, 2.0, size=(N // 128, K // 128)).astype(np.float32) * 0.01
        return Weight(codes, "fp8", (N, K), scale.view(BF16Scale) if bf16 else scale,
                      scale_block((N, K), scale.shape))

    def nvfp4(N, K):
        from lumen_cpu import nvfp4 as nv

        packed = rng.integers(0, 256, size=(N, K // 2), dtype=np.uint8)
        block = rng.integers(0x28, 0x39, size=(N, K // 16), dtype=np.uint8)  # e4m3 2^-3 .. 2^0
        return nv.weight(packed, (block, np.float32(0.01)), (N, K), "ram", qx=False, bf16=bf16)

    one = fp8 if fmt == "fp8" else nvfp4
    return [(one(I, H), one(I, H)) for _ in range(E)], [one(H, I) for _ in range(E)]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", default="2,4,8,16", help="thread counts (comma-separated; capped at numba's)")
    p.add_argument("--formats", default="fp8,nvfp4")
    p.add_argument("--modes", default="exact,bf16", help="exact (the default mode) and / or bf16")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--calls", type=int, default=15, help="timed calls a row (best and median); 4 was too few on a "
                   "noisy machine: a row's best moved by ~30%%")
    args = p.parse_args(argv)
    import numba
    from lumen_cpu import moe_fused, native

    most = numba.config.NUMBA_NUM_THREADS
    counts = sorted({min(int(t), most) for t in args.threads.split(",")})
    print(f"native level {native.level if native.available else 'off'}; numba up to {most} threads "
          f"(NUMBA_NUM_THREADS), threading layer {numba.config.THREADING_LAYER}; {args.tokens} tokens")
    print("| experts | mode | threads | best ms | median ms | speed-up vs " f"{counts[0]} | efficiency |")
    print("|---|---|---:|---:|---:|---:|---:|")
    rng = np.random.default_rng(0)
    T = args.tokens
    x = rng.normal(size=(T, H)).astype(np.float32)
    ids = np.stack([rng.choice(E, size=K_TOP, replace=False) for _ in range(T)])
    w = rng.uniform(size=(T, K_TOP)).astype(np.float32)
    for fmt in args.formats.split(","):
        for mode in args.modes.split(","):
            gate_up, down = weights(fmt, mode == "bf16", rng)
            base = None
            for n in counts:
                numba.set_num_threads(n)
                moe_fused.experts(x, ids, w, gate_up, down)  # compile / warm
                times = []
                for _ in range(args.calls):
                    t0 = time.perf_counter()
                    moe_fused.experts(x, ids, w, gate_up, down)
                    times.append(time.perf_counter() - t0)
                best = min(times)
                base = base or (best, n)
                speed = base[0] / best
                print(f"| {fmt} | {mode} | {n} | {best * 1e3:.1f} | {statistics.median(times) * 1e3:.1f} | "
                      f"{speed:.2f}x | {speed / (n / base[1]):.0%} |", flush=True)
            del gate_up, down


if __name__ == "__main__":
    main()
