"""Routed experts on the CPU (``lumen_cpu.moe_fused``) against the per-expert path it replaced
(``ops.moe_experts_per_expert``: one registered ``linear`` per matrix), on one MoE layer of a real model's shape
with random fp8 / NVFP4 experts. Prints time per call, the experts' bytes read per second and the ratio.

    python benchmarks/cpu_moe.py [--shape 35b-a3b] [--formats fp8,fp8-bf16,nvfp4,nvfp4-int8,nvfp4-bf16,bf16]
                                 [--tokens 1,16,512] [--threads N] [--cold N]

nvfp4-int8 / nvfp4-bf16: NVFP4 experts marked for cpu.compute-quantization int8 (one token's rows: 8-bit
activations) / bf16 (several tokens' products in AMX bf16 tiles, where the CPU has AMX-BF16); fp8-bf16: fp8 experts
marked for bf16.
Shapes: 35b-a3b (Qwen3.5-35B-A3B: top 8 of 256 experts, H 2048, I 512), g4-26b-a4b (Gemma 4 26B-A4B).
The expert count is cut to --experts (default 64) to keep memory small: the work per token depends only on top-k.
"hot" repeats one call (the same experts: from the CPU caches when they fit); "cold" cycles through --cold copies of
the layer (default 8, each a different set of bytes) with new expert ids per call, as decode meets them: from DRAM.
The bound: the host's read bandwidth measured in the same run with the same threads (a parallel numba sum over
1 GiB, best of 5); "% of bound" is the cold figure's bytes per second against it.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
from _timing import read_bandwidth

SHAPES = {"35b-a3b": (2048, 512, 8), "g4-26b-a4b": (2816, 704, 8)}  # H, I, top-k


def experts(fmt: str, E: int, H: int, I: int):
    import ml_dtypes

    from lumen_core.backend import Weight, scale_block
    from lumen_core.quantize import quantize_nvfp4

    rng = np.random.default_rng(0)

    def one(N, K):
        if fmt == "bf16":
            return Weight((rng.normal(size=(N, K)) * 0.1).astype(ml_dtypes.bfloat16), "bf16", (N, K))
        if fmt in ("fp8", "fp8-bf16"):
            from lumen_cpu.fp8 import BF16Scale

            data = (rng.normal(size=(N, K)) * 0.5).astype(ml_dtypes.float8_e4m3fn)
            scale = rng.uniform(0.5, 2.0, size=(-(-N // 128), -(-K // 128))).astype(np.float32) * 0.01
            block = scale_block((N, K), scale.shape)
            return Weight(data, "fp8", (N, K), scale.view(BF16Scale) if fmt == "fp8-bf16" else scale, block)
        from lumen_cpu import nvfp4

        packed, bs, gs = quantize_nvfp4(rng.normal(size=(N, K)).astype(np.float32) * 0.1)
        return nvfp4.weight(packed, (bs, gs), (N, K), "ram", qx=fmt == "nvfp4-int8", bf16=fmt == "nvfp4-bf16")

    return [(one(I, H), one(I, H)) for _ in range(E)], [one(H, I) for _ in range(E)]


def derived(ws, i: int):
    """A copy of the Weights with other bytes (xor), the same format and scales: another layer's experts."""
    from lumen_core.backend import Weight

    def one(w):
        if w.format == "nvfp4":
            import copy

            c = copy.copy(w)
            c.data = np.asarray(w.data) ^ np.uint8(i % 7 + 1)
            return c
        raw = np.asarray(w.data)
        return Weight((raw.view(np.uint8) ^ np.uint8(i % 7 + 1)).view(raw.dtype), w.format, w.shape, w.scale, w.block)

    return [(one(g), one(u)) for g, u in ws[0]], [one(d) for d in ws[1]]


def cold_calls(layers, rng, E: int, k: int, T: int, w):
    """(ids, weights, gate_up, down) for the layers in turn, new random ids each call."""
    n = 0
    while True:
        g, d = layers[n % len(layers)]
        n += 1
        yield np.stack([rng.choice(E, size=k, replace=False) for _ in range(T)]), w, g, d


def timed_once(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def timed(fn, args, min_s: float = 1.0) -> float:
    fn(*args)  # compile / warm
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < min_s:
        fn(*args)
        n += 1
    return (time.perf_counter() - t0) / n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="35b-a3b", choices=sorted(SHAPES))
    p.add_argument("--formats", default="fp8,nvfp4,bf16")
    p.add_argument("--tokens", default="1,16,512")
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--threads", type=int, help="numba threads (default: numba's, the core count)")
    p.add_argument("--cold", type=int, default=8, help="copies of the layer cycled for the cold figure")
    args = p.parse_args()
    if args.threads:
        os.environ["NUMBA_NUM_THREADS"] = str(args.threads)
    import numba
    from lumen_cpu import moe_fused, ops

    H, I, k = SHAPES[args.shape]
    from lumen_cpu import native

    print(f"{args.shape}: H {H}, I {I}, top-{k}, {args.experts} experts; numba {numba.get_num_threads()} threads, "
          f"threading layer {numba.config.THREADING_LAYER}; C row kernels: "
          f"{native.level if native.available else 'off (numba kernels)'}")
    bound = read_bandwidth()
    print(f"read bandwidth (bound): {bound / 1e9:.1f} GB/s")
    print("| format | tokens | per-expert ms (hot) | fused ms (hot) | ratio | fused GB/s hot | fused ms (cold) | "
          "fused GB/s cold | % of bound |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for fmt in args.formats.split(","):
        gate_up, down = experts(fmt, args.experts, H, I)
        per_expert_bytes = sum(np.asarray(a).nbytes for a in (gate_up[0][0].data, gate_up[0][1].data, down[0].data))
        layers = [(gate_up, down)] + [derived((gate_up, down), i) for i in range(1, args.cold)]
        rng = np.random.default_rng(1)
        for T in (int(t) for t in args.tokens.split(",")):
            x = rng.normal(size=(T, H)).astype(np.float32)
            ids = np.stack([rng.choice(args.experts, size=k, replace=False) for _ in range(T)])
            w = rng.uniform(size=(T, k)).astype(np.float32)
            a = (x, ids, w, gate_up, down)

            cycle = cold_calls(layers, rng, args.experts, k, T, w)
            ref = timed(ops.moe_experts_per_expert, a)
            got = timed(moe_fused.experts, a)
            used = len(np.unique(ids))
            cold = timed(lambda x, cycle: moe_fused.experts(x, *next(cycle)), (x, cycle))
            print(f"| {fmt} | {T} | {ref * 1e3:.2f} | {got * 1e3:.2f} | {ref / got:.1f}x | "
                  f"{used * per_expert_bytes / got / 1e9:.1f} | {cold * 1e3:.2f} | "
                  f"{used * per_expert_bytes / cold / 1e9:.1f} | {100 * used * per_expert_bytes / cold / bound:.0f}% |")


if __name__ == "__main__":
    main()
