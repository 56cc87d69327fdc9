"""NVFP4 kernels for the CPU (numba), kept apart from ``nvfp4.py`` so that loading an NVFP4 checkpoint does not import
numba (~0.5 s) before a matmul needs it. Values are those of ``nvfp4.dequantize``: (e2m1 x e4m3 block scale) x
global scale, decoded through 16- and 256-entry tables.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
from numba import get_num_threads, njit, prange, set_num_threads

from lumen_core.backend import Weight

from .nvfp4 import E2M1

F32 = np.float32
TILE_VALUES = 1 << 22  # f32 values dequantized per BLAS call (16 MB)
PARALLEL_MIN_BYTES = 1 << 16
E4M3 = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(F32)


@njit(cache=True, parallel=True, fastmath=True)
def _gemv(packed, block, gs, x, out, e2m1, e4m3):  # packed (N, K/2) u8, block (N, K/16) u8, x (K,) -> out (N,)
    groups = x.shape[0] // 16
    for r in prange(packed.shape[0]):
        row, brow = packed[r], block[r]
        acc = np.zeros(16, np.float32)
        for g in range(groups):
            sc = e4m3[brow[g]]
            for j in range(8):
                b = row[g * 8 + j]
                acc[2 * j] += ((e2m1[b & 15] * sc) * gs) * x[g * 16 + 2 * j]
                acc[2 * j + 1] += ((e2m1[b >> 4] * sc) * gs) * x[g * 16 + 2 * j + 1]
        out[r] = acc.sum()


@njit(cache=True)
def _dequant(packed, block, gs, out, e2m1, e4m3):  # serial: it runs between BLAS calls (see fused.py)
    for i in range(packed.shape[0]):
        for g in range(out.shape[1] // 16):
            sc = e4m3[block[i, g]]
            for j in range(8):
                b = packed[i, g * 8 + j]
                out[i, g * 16 + 2 * j] = (e2m1[b & 15] * sc) * gs
                out[i, g * 16 + 2 * j + 1] = (e2m1[b >> 4] * sc) * gs


def _parts(w: Weight):
    return (np.ascontiguousarray(w.data).view(np.uint8), np.ascontiguousarray(w.scale.block).view(np.uint8),
            np.float32(w.scale.global_scale))


def gemv(w: Weight, x: np.ndarray, out: np.ndarray) -> None:
    """out (N,) = W x for one token x (K,) f32."""
    packed, block, gs = _parts(w)
    threads = get_num_threads()
    if packed.nbytes < PARALLEL_MIN_BYTES:
        set_num_threads(1)
    try:
        _gemv(packed, block, gs, x, out, E2M1, E4M3)
    finally:
        set_num_threads(threads)


def dequantize_rows(w: Weight, start: int, stop: int) -> np.ndarray:
    """Rows start:stop as f32, equal to ``nvfp4.dequantize_rows``."""
    packed, block, gs = _parts(w)
    out = np.empty((stop - start, w.shape[1]), F32)
    _dequant(packed[start:stop], block[start:stop], gs, out, E2M1, E4M3)
    return out
