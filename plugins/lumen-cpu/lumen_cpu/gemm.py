"""Many-token products x (T, C) @ W.T for quantized W, without a dequantized copy: each thread decodes four rows of
W into f32 (they stay in L1) and multiplies them by the tokens four at a time, sixteen f32 accumulators that LLVM
keeps in vector registers (a 4 x 4 register block: 8 loads for 16 FMAs of 16 lanes). Tokens go in chunks whose
activations fit in L2.

Measured on 2 Zen 4 cores (2026-12-01, Gemma 3 270M's shapes, `python benchmarks/cpu_gemm.py`): 120-180 GFLOP/s
from 16 tokens on, 1.5-5x the serial dequantize + OpenBLAS SGEMM tiles this replaces (which also wrote every
weight to memory as f32 first); at 2 tokens 3-10x.

Each format's kernel (lumen_cpu.int8, lumen_cpu.fused) only decodes rows: ``block4`` does the multiply. The row
decoders are compiled without fast-math, so every decoded value is the one ``dequantize_rows`` gives; the sums are
reassociated (lanes, then a tree), as any BLAS does.
"""

from __future__ import annotations

import numpy as np
from numba import njit

# Fast-math without nnan/ninf: a NaN (a corrupt weight) must still reach the logits, where the engine reports it.
FASTMATH = {"reassoc", "contract", "nsz", "arcp"}
CHUNK_FLOATS = 1 << 16  # activations per token chunk: 256 KB, within a Zen 4 / recent Intel core's L2


def token_chunk(cols: int) -> int:
    """Tokens a chunk holds for rows of ``cols`` values (a multiple of 4, at least 4)."""
    return max(4, CHUNK_FLOATS // max(cols, 1) // 4 * 4)


@njit(fastmath=FASTMATH, cache=True)
def block4(w, n, x, t0, t1, out, r):
    """out[t0:t1, r:r + n] = x[t0:t1] @ w[:n].T, for n <= 4 decoded rows w (4, C) f32."""
    C = x.shape[1]
    if n < 4:
        for k in range(n):
            for t in range(t0, t1):
                acc = np.float32(0.0)
                for i in range(C):
                    acc += w[k, i] * x[t, i]
                out[t, r + k] = acc
        return
    w0, w1, w2, w3 = w[0], w[1], w[2], w[3]
    t = t0
    while t + 4 <= t1:
        x0, x1, x2, x3 = x[t], x[t + 1], x[t + 2], x[t + 3]
        a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = np.float32(0.0)
        c0 = c1 = c2 = c3 = d0 = d1 = d2 = d3 = np.float32(0.0)
        for i in range(C):
            y0, y1, y2, y3 = x0[i], x1[i], x2[i], x3[i]
            u = w0[i]
            a0 += u * y0
            a1 += u * y1
            a2 += u * y2
            a3 += u * y3
            u = w1[i]
            b0 += u * y0
            b1 += u * y1
            b2 += u * y2
            b3 += u * y3
            u = w2[i]
            c0 += u * y0
            c1 += u * y1
            c2 += u * y2
            c3 += u * y3
            u = w3[i]
            d0 += u * y0
            d1 += u * y1
            d2 += u * y2
            d3 += u * y3
        out[t, r], out[t, r + 1], out[t, r + 2], out[t, r + 3] = a0, b0, c0, d0
        out[t + 1, r], out[t + 1, r + 1], out[t + 1, r + 2], out[t + 1, r + 3] = a1, b1, c1, d1
        out[t + 2, r], out[t + 2, r + 1], out[t + 2, r + 2], out[t + 2, r + 3] = a2, b2, c2, d2
        out[t + 3, r], out[t + 3, r + 1], out[t + 3, r + 2], out[t + 3, r + 3] = a3, b3, c3, d3
        t += 4
    while t < t1:
        xt = x[t]
        a0 = b0 = c0 = d0 = np.float32(0.0)
        for i in range(C):
            y = xt[i]
            a0 += w0[i] * y
            b0 += w1[i] * y
            c0 += w2[i] * y
            d0 += w3[i] * y
        out[t, r], out[t, r + 1], out[t, r + 2], out[t, r + 3] = a0, b0, c0, d0
        t += 1
