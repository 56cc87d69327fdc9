"""FP8 E4M3 weights (HF ``weight_scale_inv`` layout) on the CPU without a dequantized copy (numba).

``Weight.data`` is (N, K) e4m3 bytes; ``Weight.scale`` f32 with ``Weight.block`` (BR, BC) block scales (the value
of w[n, k] is e4m3(w[n, k]) × S[n // BR, k // BC]), or block None with a per-channel (N,) / (N, 1) or per-tensor
scale. Each weight is decoded through a 256-entry f32 table and multiplied by its scale: the same f32 value
``ops.dequantize`` gives, so only the summation order differs from dequantize-then-matmul.

- ``linear`` for one token: a GEMV over the rows in parallel (prange) (decode, and each routed expert of a token
  on the CPU);
- above: tiles of TILE_ROWS rows dequantized (serially: an OpenMP pool spinning after a parallel region starves
  OpenBLAS, see ``fused.py``) and multiplied by BLAS.
The old path (``ops.dequantize``: an f32 copy of the whole matrix plus a full-size repeated scale array, per call)
took ~6 ms for a 1024×2048 expert matrix.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
from numba import get_num_threads, njit, prange, set_num_threads

from lumen_core.backend import Weight

F32 = np.float32
GEMV_MAX_T = 1  # measured (2 cores): from 2 tokens on, the tiled BLAS path is faster
PARALLEL_MIN_BYTES = 1 << 16
TILE_ROWS = 2048
E4M3 = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(F32)  # byte -> value (NaN codes too)


def scales(w: Weight) -> tuple[np.ndarray, int, int]:
    """(S (rows of blocks, columns of blocks) f32, BR, BC) for every scale layout the CPU backend keeps."""
    n, k = w.shape
    s = np.asarray(w.scale, dtype=F32)
    if w.block is not None:
        br, bc = w.block
        return np.ascontiguousarray(s.reshape(-(-n // br), -(-k // bc))), br, bc
    if s.size > 1:  # per channel
        return np.ascontiguousarray(s.reshape(n, 1)), 1, max(k, 1)
    return s.reshape(1, 1), max(n, 1), max(k, 1)  # per tensor


@njit(cache=True, parallel=True, fastmath=True)
def _gemv(raw, x, out, s, br, bc, tab):  # raw (N, K) u8, x (K,) f32, out (N,): one token
    K = x.shape[0]
    for r in prange(raw.shape[0]):
        row, srow = raw[r], s[r // br]
        acc = np.zeros(16, np.float32)
        for k0 in range(0, K, bc):
            sc = srow[k0 // bc]
            k1 = min(k0 + bc, K)
            k = k0
            while k + 16 <= k1:  # 16 lanes: LLVM vectorises the table gathers and FMAs
                for i in range(16):
                    acc[i] += (tab[row[k + i]] * sc) * x[k + i]
                k += 16
            for j in range(k, k1):
                acc[0] += (tab[row[j]] * sc) * x[j]
        out[r] = acc.sum()


@njit(cache=True)
def _dequant(raw, out, s, br, bc, r0, tab):  # rows r0.. of raw (R, K) u8 -> out (R, K) f32
    K = raw.shape[1]
    for i in range(raw.shape[0]):
        srow = s[(r0 + i) // br]
        for k0 in range(0, K, bc):
            sc = srow[k0 // bc]
            for k in range(k0, min(k0 + bc, K)):
                out[i, k] = tab[raw[i, k]] * sc


def dequantize_rows(w: Weight, start: int = 0, stop: int | None = None) -> np.ndarray:
    """Rows start:stop of an fp8 Weight as f32 (the values ``ops.dequantize`` gives)."""
    raw = np.ascontiguousarray(w.data[start:stop]).view(np.uint8)
    s, br, bc = scales(w)
    out = np.empty(raw.shape, F32)
    _dequant(raw, out, s, br, bc, start, E4M3)
    return out


def linear(x, w: Weight):  # x (T, K) f32, w (N, K) fp8 -> (T, N)
    x = np.ascontiguousarray(x, dtype=F32)
    T, N = x.shape[0], w.shape[0]
    out = np.empty((T, N), F32)
    if T <= GEMV_MAX_T:
        raw = np.ascontiguousarray(w.data).view(np.uint8)
        s, br, bc = scales(w)
        threads = get_num_threads()
        if raw.nbytes < PARALLEL_MIN_BYTES:
            set_num_threads(1)
        try:
            for t in range(T):
                _gemv(raw, x[t], out[t], s, br, bc, E4M3)
        finally:
            set_num_threads(threads)
        return out
    for r in range(0, N, TILE_ROWS):
        out[:, r:r + TILE_ROWS] = x @ dequantize_rows(w, r, r + TILE_ROWS).T
    return out
