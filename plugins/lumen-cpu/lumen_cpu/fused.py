"""Fused dequantizing matmuls for GGUF block formats (numba): weights stay quantized in memory.

Each kernel decodes a block into float32 exactly as ``gguf.quants.dequantize`` does (same operations in
the same order), then multiplies by the activations. One token (decode) runs a GEMV that reads every weight byte
once; more (prefill, a speculative verify) decode four rows at a time into f32 and multiply them by every token
(lumen_cpu.gemm). The only difference from dequantize-then-matmul is the summation order.
"""

from __future__ import annotations

import numpy as np
from numba import get_num_threads, njit, prange, set_num_threads

from lumen_core.backend import Weight

from .gemm import FASTMATH, block4, token_chunk

# Up to 3 tokens the GEMV (each row's bytes read once, decoded per token) beats the 4-row GEMM, whose 4 x 4 register
# block needs 4 tokens; from 4 on the GEMM wins (benchmarks/cpu_gemm.py).
GEMV_MAX_T = 3
# Below this many weight bytes a GEMV runs on one thread: waking the pool costs more than it saves, and on a
# busy machine a parallel region waits for its slowest (descheduled) thread.
PARALLEL_MIN_BYTES = 1 << 16


# float16 bit pattern -> float32: a 256 KB table is faster than decoding the bits per block in the kernels.
F16 = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)


@njit(cache=True, inline="always")
def _h(tab, lo, hi):
    return tab[np.int32(lo) | (np.int32(hi) << 8)]


# -- block decoders: raw row bytes -> float32 row (cols,) -------------------------------------------------
@njit(cache=True, inline="always")
def _row_q8_0(raw, out, tab):  # 34-byte blocks: f16 d, 32 x int8
    for b in range(out.shape[0] // 32):
        o = b * 34
        d = _h(tab, raw[o], raw[o + 1])
        for i in range(32):
            q = (np.int32(raw[o + 2 + i]) ^ 0x80) - 0x80  # the byte as int8, without a branch
            out[b * 32 + i] = np.float32(q) * d


@njit(cache=True, inline="always")
def _row_q5_0(raw, out, tab):  # 22-byte blocks: f16 d, u32 high bits, 16 bytes of low nibbles
    for b in range(out.shape[0] // 32):
        o = b * 22
        d = _h(tab, raw[o], raw[o + 1])
        qh = np.uint32(raw[o + 2]) | (np.uint32(raw[o + 3]) << 8) | (np.uint32(raw[o + 4]) << 16) | \
            (np.uint32(raw[o + 5]) << 24)
        for j in range(16):
            byte = raw[o + 6 + j]
            lo = np.int32(byte & 0x0F) | np.int32(((qh >> j) & 1) << 4)
            hi = np.int32(byte >> 4) | np.int32(((qh >> (j + 16)) & 1) << 4)
            out[b * 32 + j] = d * np.float32(lo - 16)
            out[b * 32 + j + 16] = d * np.float32(hi - 16)


@njit(cache=True, inline="always")
def _row_q4_0(raw, out, tab):  # 18-byte blocks: f16 d, 16 bytes of nibbles
    for b in range(out.shape[0] // 32):
        o = b * 18
        d = _h(tab, raw[o], raw[o + 1])
        for j in range(16):
            byte = raw[o + 2 + j]
            out[b * 32 + j] = d * np.float32(np.int32(byte & 0x0F) - 8)
            out[b * 32 + j + 16] = d * np.float32(np.int32(byte >> 4) - 8)


@njit(cache=True, inline="always")
def _scale_min_k4(s, j):
    """The 6-bit scale and min of sub-block j from the 12 packed bytes of a Q4_K/Q5_K super-block."""
    if j < 4:
        return np.int32(s[j] & 0x3F), np.int32(s[j + 4] & 0x3F)
    sc = np.int32(s[j + 4] & 0x0F) | np.int32((s[j - 4] >> 2) & 0x30)
    mn = np.int32(s[j + 4] >> 4) | np.int32((s[j] >> 2) & 0x30)
    return sc, mn


@njit(cache=True, inline="always")
def _row_q4_k(raw, out, tab):  # 144-byte super-blocks of 256: f16 d, dmin, 12 scale bytes, 128 nibble bytes
    for b in range(out.shape[0] // 256):
        o = b * 144
        d = _h(tab, raw[o], raw[o + 1])
        dmin = _h(tab, raw[o + 2], raw[o + 3])
        s = raw[o + 4:o + 16]
        for j in range(8):
            sc, mn = _scale_min_k4(s, j)
            ds = d * np.float32(sc)
            dm = dmin * np.float32(mn)
            base = o + 16 + (j // 2) * 32
            shift = 4 * (j % 2)
            for i in range(32):
                q = np.float32((raw[base + i] >> shift) & 0x0F)
                out[b * 256 + j * 32 + i] = ds * q - dm


@njit(cache=True, inline="always")
def _row_q5_k(raw, out, tab):  # 176-byte super-blocks: d, dmin, 12 scale bytes, 32 high-bit bytes, 128 nibbles
    for b in range(out.shape[0] // 256):
        o = b * 176
        d = _h(tab, raw[o], raw[o + 1])
        dmin = _h(tab, raw[o + 2], raw[o + 3])
        s = raw[o + 4:o + 16]
        for j in range(8):
            sc, mn = _scale_min_k4(s, j)
            ds = d * np.float32(sc)
            dm = dmin * np.float32(mn)
            base = o + 48 + (j // 2) * 32
            shift = 4 * (j % 2)
            for i in range(32):
                lo = (raw[base + i] >> shift) & 0x0F
                hi = (raw[o + 16 + i] >> j) & 0x01
                out[b * 256 + j * 32 + i] = ds * np.float32(lo | (hi << 4)) - dm


@njit(cache=True, inline="always")
def _row_q6_k(raw, out, tab):  # 210-byte super-blocks: 128 ql, 64 qh, 16 int8 scales, f16 d
    for b in range(out.shape[0] // 256):
        o = b * 210
        d = _h(tab, raw[o + 208], raw[o + 209])
        for g in range(8):  # eight groups of 32 values
            h, c, shift, s2 = g // 4, g % 2, 4 * ((g // 2) % 2), 2 * (g % 4)
            for p in range(32):
                v = g * 32 + p
                sc = (np.int32(raw[o + 192 + v // 16]) ^ 0x80) - 0x80
                lo = (raw[o + h * 64 + c * 32 + p] >> shift) & 0x0F
                hi = (raw[o + 128 + h * 32 + p] >> s2) & 0x03
                q = np.int32(lo | (hi << 4)) - 32
                out[b * 256 + v] = (d * np.float32(sc)) * np.float32(q)


FORMATS = ("q8_0", "q5_0", "q4_0", "q4_k", "q5_k", "q6_k")  # index = the kind code the kernels take


@njit(cache=True, inline="always")
def _decode_row(kind, raw, out, tab):
    # One kernel per op with a per-row dispatch (not one closure per format): numba's on-disk cache keys
    # functions by name, so closures over different decoders would share (and clobber) cache entries.
    if kind == 0:
        _row_q8_0(raw, out, tab)
    elif kind == 1:
        _row_q5_0(raw, out, tab)
    elif kind == 2:
        _row_q4_0(raw, out, tab)
    elif kind == 3:
        _row_q4_k(raw, out, tab)
    elif kind == 4:
        _row_q5_k(raw, out, tab)
    else:
        _row_q6_k(raw, out, tab)


# GEMV kernels: raw (R, bytes/row) u8, x (T, C) f32, out (T, R) f32. fastmath lets LLVM vectorise; each
# keeps a 32-lane accumulator per row and reduces it once at the end, instead of a horizontal sum per block
# (that change alone took the Q8_0 lm_head of Gemma 3 270M from 25 ms to 6 ms on 2 cores).
@njit(cache=True, parallel=True, fastmath=True)
def _gemv_q8_0(raw, x, out, tab):  # raw viewed as int8: the 32 values load as signed bytes directly
    for r in prange(raw.shape[0]):
        row = raw[r]
        for t in range(x.shape[0]):
            acc = np.zeros(32, np.float32)
            for b in range(x.shape[1] // 32):
                o = b * 34
                d = _h(tab, np.uint8(row[o]), np.uint8(row[o + 1]))
                for i in range(32):
                    acc[i] += np.float32(row[o + 2 + i]) * (d * x[t, b * 32 + i])
            out[t, r] = acc.sum()


@njit(cache=True, parallel=True, fastmath=True)
def _gemv_q5_0(raw, x, out, tab):
    for r in prange(raw.shape[0]):
        row = raw[r]
        for t in range(x.shape[0]):
            acc = np.zeros(32, np.float32)
            for b in range(x.shape[1] // 32):
                o = b * 22
                d = _h(tab, row[o], row[o + 1])
                qh = np.uint32(row[o + 2]) | (np.uint32(row[o + 3]) << 8) | (np.uint32(row[o + 4]) << 16) | \
                    (np.uint32(row[o + 5]) << 24)
                for j in range(16):
                    byte = row[o + 6 + j]
                    lo = np.int32(byte & 0x0F) | np.int32(((qh >> j) & 1) << 4)
                    hi = np.int32(byte >> 4) | np.int32(((qh >> (j + 16)) & 1) << 4)
                    acc[j] += np.float32(lo - 16) * (d * x[t, b * 32 + j])
                    acc[j + 16] += np.float32(hi - 16) * (d * x[t, b * 32 + j + 16])
            out[t, r] = acc.sum()


@njit(cache=True, parallel=True, fastmath=True)
def _gemv_q4_0(raw, x, out, tab):
    for r in prange(raw.shape[0]):
        row = raw[r]
        for t in range(x.shape[0]):
            acc = np.zeros(32, np.float32)
            for b in range(x.shape[1] // 32):
                o = b * 18
                d = _h(tab, row[o], row[o + 1])
                for j in range(16):
                    byte = row[o + 2 + j]
                    acc[j] += np.float32(np.int32(byte & 0x0F) - 8) * (d * x[t, b * 32 + j])
                    acc[j + 16] += np.float32(np.int32(byte >> 4) - 8) * (d * x[t, b * 32 + j + 16])
            out[t, r] = acc.sum()


@njit(cache=True, parallel=True, fastmath=True)
def _gemv_q4_k(raw, x, out, tab):
    for r in prange(raw.shape[0]):
        row = raw[r]
        for t in range(x.shape[0]):
            acc = np.zeros(32, np.float32)
            for b in range(x.shape[1] // 256):
                o = b * 144
                d, dmin = _h(tab, row[o], row[o + 1]), _h(tab, row[o + 2], row[o + 3])
                s = row[o + 4:o + 16]
                for j in range(8):
                    sc, mn = _scale_min_k4(s, j)
                    ds, dm = d * np.float32(sc), dmin * np.float32(mn)
                    base, shift, xo = o + 16 + (j // 2) * 32, 4 * (j % 2), b * 256 + j * 32
                    for i in range(32):
                        q = np.float32((row[base + i] >> shift) & 0x0F)
                        acc[i] += (ds * q - dm) * x[t, xo + i]
            out[t, r] = acc.sum()


@njit(cache=True, parallel=True, fastmath=True)
def _gemv_q5_k(raw, x, out, tab):
    for r in prange(raw.shape[0]):
        row = raw[r]
        for t in range(x.shape[0]):
            acc = np.zeros(32, np.float32)
            for b in range(x.shape[1] // 256):
                o = b * 176
                d, dmin = _h(tab, row[o], row[o + 1]), _h(tab, row[o + 2], row[o + 3])
                s = row[o + 4:o + 16]
                for j in range(8):
                    sc, mn = _scale_min_k4(s, j)
                    ds, dm = d * np.float32(sc), dmin * np.float32(mn)
                    base, shift, xo = o + 48 + (j // 2) * 32, 4 * (j % 2), b * 256 + j * 32
                    for i in range(32):
                        q = ((row[base + i] >> shift) & 0x0F) | (((row[o + 16 + i] >> j) & 0x01) << 4)
                        acc[i] += (ds * np.float32(q) - dm) * x[t, xo + i]
            out[t, r] = acc.sum()


@njit(cache=True, parallel=True, fastmath=True)
def _gemv_q6_k(raw, x, out, tab):
    for r in prange(raw.shape[0]):
        row = raw[r]
        for t in range(x.shape[0]):
            acc = np.zeros(32, np.float32)
            for b in range(x.shape[1] // 256):
                o = b * 210
                d = _h(tab, row[o + 208], row[o + 209])
                for g in range(8):
                    h, c, shift, s2 = g // 4, g % 2, 4 * ((g // 2) % 2), 2 * (g % 4)
                    d0 = d * np.float32((np.int32(row[o + 192 + 2 * g]) ^ 0x80) - 0x80)
                    d1 = d * np.float32((np.int32(row[o + 193 + 2 * g]) ^ 0x80) - 0x80)
                    for p in range(32):
                        lo = (row[o + h * 64 + c * 32 + p] >> shift) & 0x0F
                        hi = (row[o + 128 + h * 32 + p] >> s2) & 0x03
                        q = np.float32(np.int32(lo | (hi << 4)) - 32)
                        acc[p] += (d0 if p < 16 else d1) * q * x[t, b * 256 + g * 32 + p]
            out[t, r] = acc.sum()


GEMV = {"q8_0": _gemv_q8_0, "q5_0": _gemv_q5_0, "q4_0": _gemv_q4_0, "q4_k": _gemv_q4_k,
        "q5_k": _gemv_q5_k, "q6_k": _gemv_q6_k}


# Serial on purpose: it runs between BLAS calls (prefill), and an OpenMP pool spinning after a parallel
# region steals the cores OpenBLAS needs (measured: a 16-token Gemma 3 270M prefill took 1.09 s, 0.08 s
# with the pool asleep).
@njit(cache=True)
def _dequant(kind, raw, out, tab):  # raw (R, bytes/row) u8 -> out (R, C) f32
    for r in range(raw.shape[0]):
        _decode_row(kind, raw[r], out[r], tab)


def _one_thread(kernel, raw, x, out):
    threads = get_num_threads()
    set_num_threads(1)
    try:
        kernel(raw, x, out, F16)
    finally:
        set_num_threads(threads)


def dequantize_rows(w: Weight, start: int = 0, stop: int | None = None) -> np.ndarray:
    """Rows start:stop of a block-quantized Weight as float32 (bit-equal to gguf.quants.dequantize)."""
    raw = w.data[start:stop]
    out = np.empty((raw.shape[0], w.shape[1]), np.float32)
    _dequant(FORMATS.index(w.format), raw, out, F16)
    return out


def gemv_or_gemm(x, w: Weight, gemv, gemm, data) -> np.ndarray:
    """x (T, C) @ w.T: up to GEMV_MAX_T tokens ``gemv(data, x, out, F16)`` (on one thread for a small ``data``),
    more ``gemm(data, x, out, tokens a chunk)``. Shared by the fused GGUF kernels and the int8 layout
    (lumen_cpu.int8)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    T, R = x.shape[0], w.shape[0]
    out = np.empty((T, R), np.float32)
    if T <= GEMV_MAX_T:
        if data.nbytes >= PARALLEL_MIN_BYTES:
            gemv(data, x, out, F16)
        else:
            _one_thread(gemv, data, x, out)
    else:
        gemm(data, x, out, token_chunk(x.shape[1]))
    return out


@njit(cache=True, parallel=True, fastmath=FASTMATH)
def _gemm_blocks(kind, raw, x, out, chunk, tab):  # rows decoded by _dequant (exact), four at a time
    R, C = raw.shape[0], x.shape[1]
    for t0 in range(0, x.shape[0], chunk):
        t1 = min(x.shape[0], t0 + chunk)
        for quad in prange((R + 3) // 4):
            r = 4 * quad
            n = min(4, R - r)
            w = np.empty((4, C), np.float32)
            _dequant(kind, raw[r:r + n], w[:n], tab)
            block4(w, n, x, t0, t1, out, r)


def linear(x, w: Weight):  # x (T, C) f32, w (R, C) block-quantized -> (T, R)
    raw = w.data.view(np.int8) if w.format == "q8_0" else w.data
    kind = FORMATS.index(w.format)
    return gemv_or_gemm(x, w, GEMV[w.format],
                        lambda data, x, out, chunk: _gemm_blocks(kind, w.data, x, out, chunk, F16), raw)


def embedding(ids, w: Weight):  # ids (T,), w (vocab, H) quantized -> (T, H): only the rows asked for
    idx = np.asarray(ids, dtype=np.int64)
    raw = np.ascontiguousarray(w.data[idx])
    out = np.empty((len(idx), w.shape[1]), np.float32)
    _dequant(FORMATS.index(w.format), raw, out, F16)
    return out
