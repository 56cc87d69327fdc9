"""NVFP4 kernels for the CPU (numba), kept apart from ``nvfp4.py`` so that loading an NVFP4 checkpoint does not import
numba (~0.5 s) before a matmul needs it. Values are those of ``nvfp4.dequantize``: (e2m1 x e4m3 block scale) x
global scale. The one-token GEMV (``dot_bits``, shared with ``moe_fused``) decodes the E2M1 codes arithmetically
(~1.8x a 16-entry table, which keeps LLVM from vectorising); tiles for BLAS go through the tables.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
from numba import get_num_threads, njit, prange, set_num_threads

from lumen_core.backend import Weight

from .bitcast import as_f32
from .nvfp4 import E2M1

F32 = np.float32
TILE_VALUES = 1 << 22  # f32 values dequantized per BLAS call (16 MB)
PARALLEL_MIN_BYTES = 1 << 16
CHUNK = 16  # rows per parallel task of the GEMV
E4M3 = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(F32)


@njit(inline="always", fastmath=True)
def e2m1(c):  # the low 4 bits of c (uint32), an E2M1 code -> its f32 value
    """Exponent and mantissa go into an f32 with the exponent rebased (+126), the subnormal code (0.5) fixed up,
    the sign applied: exact, no table (a gather keeps LLVM from vectorising)."""
    f = as_f32(((c & np.uint32(7)) << np.uint32(22)) + np.uint32(0x3F000000))
    v = (f - F32(0.5)) * F32(2.0) if (c & np.uint32(6)) == 0 else f
    return -v if (c & np.uint32(8)) else v


@njit(inline="always", fastmath=True)
def dot_bits(row, brow, gs, xe, xo, e4m3, sb):
    """One NVFP4 row . x without a table: each byte's two codes decoded by ``e2m1`` (one loop; vectorises), the low
    codes dotted with x's even columns ``xe``, the high with the odd ``xo``; sb holds the row's (e4m3 block scale x
    global scale) per byte."""
    for g in range(brow.shape[0]):
        s = e4m3[brow[g]] * gs
        for j in range(8):
            sb[g * 8 + j] = s
    acc = F32(0.0)
    for i in range(row.shape[0]):
        b = np.uint32(row[i])
        acc += (e2m1(b) * xe[i] + e2m1(b >> np.uint32(4)) * xo[i]) * sb[i]
    return acc


@njit(inline="always")
def split(x, xe, xo):  # x's even and odd columns
    for i in range(xe.shape[0]):
        xe[i] = x[2 * i]
        xo[i] = x[2 * i + 1]


@njit(cache=True, parallel=True, fastmath=True)
def _gemv(packed, block, gs, x, out, e4m3):  # packed (N, K/2) u8, block (N, K/16) u8, x (K,) -> out (N,)
    N, n = packed.shape
    xe, xo = np.empty(n, F32), np.empty(n, F32)
    split(x, xe, xo)
    for c in prange((N + CHUNK - 1) // CHUNK):
        sb = np.empty(n, F32)
        for r in range(c * CHUNK, min(N, (c + 1) * CHUNK)):
            out[r] = dot_bits(packed[r], block[r], gs, xe, xo, e4m3, sb)


@njit(cache=True)
def _dequant(packed, block, gs, out, tab, e4m3):  # serial: it runs between BLAS calls (see fused.py)
    for i in range(packed.shape[0]):
        for g in range(out.shape[1] // 16):
            sc = e4m3[block[i, g]]
            for j in range(8):
                b = packed[i, g * 8 + j]
                out[i, g * 16 + 2 * j] = (tab[b & 15] * sc) * gs
                out[i, g * 16 + 2 * j + 1] = (tab[b >> 4] * sc) * gs


def _parts(w: Weight):
    return (np.ascontiguousarray(w.data).view(np.uint8), np.ascontiguousarray(w.scale.block).view(np.uint8),
            np.float32(w.scale.global_scale))


def gemv(w: Weight, x: np.ndarray, out: np.ndarray) -> None:
    """out (N,) = W x for one token x (K,) f32."""
    packed, block, gs = _parts(w)
    threads = get_num_threads()
    from . import native

    if native.available:  # the compiled rows (lumen_cpu/_native.c), on numba's threads
        native.gemv_nvfp4(packed, block, gs, np.ascontiguousarray(x, dtype=F32), out, CHUNK,
                          1 if packed.nbytes < PARALLEL_MIN_BYTES else threads)
        return
    if packed.nbytes < PARALLEL_MIN_BYTES:
        set_num_threads(1)
    try:
        _gemv(packed, block, gs, x, out, E4M3)
    finally:
        set_num_threads(threads)


def dequantize_rows(w: Weight, start: int, stop: int) -> np.ndarray:
    """Rows start:stop as f32, equal to ``nvfp4.dequantize_rows``."""
    packed, block, gs = _parts(w)
    out = np.empty((stop - start, w.shape[1]), F32)
    _dequant(packed[start:stop], block[start:stop], gs, out, E2M1, E4M3)
    return out
