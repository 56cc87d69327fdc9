"""FP8 E4M3 weights (HF ``weight_scale_inv`` layout) on the CPU without a dequantized copy (numba).

``Weight.data`` is (N, K) e4m3 bytes; ``Weight.scale`` f32 with ``Weight.block`` (BR, BC) block scales (the value
of w[n, k] is e4m3(w[n, k]) × S[n // BR, k // BC]), or block None with a per-channel (N,) / (N, 1) or per-tensor
scale. ``decode_row`` turns a row of bytes into f32 by moving each byte's exponent and mantissa into an f32 (no
table: a gather keeps LLVM from vectorising) and multiplies by the scales expanded to one per column: the same f32
values ``ops.dequantize`` gives (NaN codes, which no quantizer writes, excepted), so only the summation order
differs from dequantize-then-matmul.

- ``linear`` for one token: a GEMV over chunks of CHUNK rows in parallel (prange) (decode);
- above: tiles of TILE_ROWS rows dequantized (serially: an OpenMP pool spinning after a parallel region starves
  OpenBLAS, see ``fused.py``) and multiplied by BLAS.
``moe_fused`` uses the same row decoder for routed experts.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
from numba import get_num_threads, njit, prange, set_num_threads

from lumen_core.backend import Weight

from .bitcast import as_f32

F32 = np.float32
GEMV_MAX_T = 1  # measured (2 cores): from 2 tokens on, the tiled BLAS path is faster
PARALLEL_MIN_BYTES = 1 << 16
TILE_ROWS = 2048
CHUNK = 16, 64  # rows per parallel task of the GEMV: at least, at most (4 tasks a thread in between)
E4M3 = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(F32)  # byte -> value (NaN codes too)


class BF16Scale(np.ndarray):
    """An fp8 weight's f32 scales, marked for cpu.compute-quantization "bf16" (the CPU backend's ``weight``): several
    tokens' routed-expert products in AMX bf16 tiles (moe_fused). Otherwise the plain array (``np.asarray`` of it is
    the unmarked one)."""

    bf16 = True


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


@njit(inline="always", fastmath=True)
def decode(b):  # one e4m3 byte (as uint32) -> its f32 value
    """The byte's exponent and mantissa go into an f32 with the exponent rebased (+120); subnormal codes
    (exponent 0) are fixed up and the sign applied: the exact e4m3 value, without a table gather (which keeps
    LLVM from vectorising: ~4x slower); x scale gives the same f32 as ``tab[b] * scale``. NaN codes, which no
    quantizer writes, decode to a finite value here. (Multiplying the unbiased bits by 2^120 instead, with no
    fix-up, reads subnormal f32s: 1.4-1.8x faster on an AMD core, 7-15x slower on a Xeon, whose subnormal inputs
    take microcode assists; not used.)"""
    f = as_f32(((b & np.uint32(0x7F)) << np.uint32(20)) + np.uint32(0x3C000000))
    v = (f - F32(0.0078125)) * F32(2.0) if (b & np.uint32(0x78)) == 0 else f
    return -v if (b & np.uint32(0x80)) else v


@njit(inline="always", fastmath=True)
def decode_row(row, sexp, buf):  # e4m3 bytes row (K,) x per-column scales sexp (K,) -> buf (K,) f32
    for k in range(buf.shape[0]):
        buf[k] = decode(np.uint32(row[k])) * sexp[k]


@njit(inline="always", fastmath=True)
def decode_dot(row, xs):  # decode_row(row) . x in one pass, xs = x x the scales (scale_x); no buffer written
    acc = F32(0.0)
    for k in range(xs.shape[0]):
        acc += decode(np.uint32(row[k])) * xs[k]
    return acc


@njit(inline="always", fastmath=True)
def scale_x(srow, bc, x, xs):  # x times one row of block scales, per column: the rows of a block share it
    K = xs.shape[0]
    for b in range(srow.shape[0]):
        s = srow[b]
        for k in range(b * bc, min(K, (b + 1) * bc)):
            xs[k] = x[k] * s


@njit(inline="always")
def expand_scales(srow, bc, sexp):  # one row of block scales -> a scale per column
    K = sexp.shape[0]
    for b in range(srow.shape[0]):
        sexp[b * bc:min(K, (b + 1) * bc)] = srow[b]


@njit(inline="always", fastmath=True)
def dot(a, b):
    acc = F32(0.0)
    for k in range(a.shape[0]):
        acc += a[k] * b[k]
    return acc


@njit(cache=True, parallel=True, fastmath=True)
def _gemv(raw, x, out, s, br, bc, rows):  # raw (N, K) u8, x (K,) f32, out (N,): one token, ``rows`` rows a task
    N, K = raw.shape
    nch = (N + rows - 1) // rows
    for c in prange(nch):
        xs, last = np.empty(K, F32), -1
        for r in range(c * rows, min(N, (c + 1) * rows)):
            if r // br != last:
                last = r // br
                scale_x(s[last], bc, x, xs)
            out[r] = decode_dot(raw[r], xs)


@njit(cache=True)
def _dequant(raw, out, s, br, bc, r0):  # rows r0.. of raw (R, K) u8 -> out (R, K) f32
    K = raw.shape[1]
    sexp, last = np.empty(K, F32), -1
    for i in range(raw.shape[0]):
        if (r0 + i) // br != last:
            last = (r0 + i) // br
            expand_scales(s[last], bc, sexp)
        decode_row(raw[i], sexp, out[i])


def dequantize_rows(w: Weight, start: int = 0, stop: int | None = None) -> np.ndarray:
    """Rows start:stop of an fp8 Weight as f32 (the values ``ops.dequantize`` gives)."""
    raw = np.ascontiguousarray(w.data[start:stop]).view(np.uint8)
    s, br, bc = scales(w)
    out = np.empty(raw.shape, F32)
    _dequant(raw, out, s, br, bc, start)
    return out


def linear(x, w: Weight):  # x (T, K) f32, w (N, K) fp8 -> (T, N)
    x = np.ascontiguousarray(x, dtype=F32)
    T, N = x.shape[0], w.shape[0]
    out = np.empty((T, N), F32)
    if T <= GEMV_MAX_T:
        raw = np.ascontiguousarray(w.data).view(np.uint8)
        s, br, bc = scales(w)
        threads = get_num_threads()
        rows = min(CHUNK[1], max(CHUNK[0], N // (4 * threads)))  # long tasks (sequential reads), enough of them
        from . import native

        if native.available:  # the compiled rows (lumen_cpu/_native.c), on numba's threads
            use = 1 if raw.nbytes < PARALLEL_MIN_BYTES else threads
            for t in range(T):
                native.gemv_fp8(raw, x[t], out[t], s, br, bc, rows, use)
            return out
        if raw.nbytes < PARALLEL_MIN_BYTES:
            set_num_threads(1)
        try:
            for t in range(T):
                _gemv(raw, x[t], out[t], s, br, bc, rows)
        finally:
            set_num_threads(threads)
        return out
    for r in range(0, N, TILE_ROWS):
        out[:, r:r + TILE_ROWS] = x @ dequantize_rows(w, r, r + TILE_ROWS).T
    return out
