"""GGUF block formats repacked at load into int8 codes (format ``i8``): the CPU's decode GEMV is bound by
decoding those codes, not by memory (issue 22: benchmarks/cpu_gemv_layout.py, benchmarks/README.md), so a weight
held in RAM (store ``ram``) is stored as one signed byte a value plus its block's scale (the file's f16 d for
Q4_0 / Q5_0 / Q8_0, kept as its bits; f32 for the K-quants, whose scales are products) and, for the formats with a
minimum (Q4_K, Q5_K), its f32 minimum:

    value = scale[block] x code - min[block]        (blocks of 32 values; Q6_K: 16, no minimum)

computed with the same f32 operations as ``lumen_cpu.fused``'s decoders (Q4_K: (d x sc) x q - dmin x m; Q6_K:
(d x sc) x q), so every dequantized value is bit for bit what the file's block holds. The products are C
(lumen_cpu/_native_i8.c through ``native``): ``gemv`` for 1-3 tokens (each block's code . x products, then its
scale; the minimums times x's block sums), ``gemm`` for more (rows dequantized exactly, then four rows by four
tokens), and ``gemv_q8`` with x quantized to 8 bits (``quantize_x``; cpu.compute-quantization "int8", opt-in). They
agree with the fused kernels within f32 reassociation (tests/test_int8_repack.py, tests/test_cpu_native.py).
It costs 1.5-2.2x the file's bytes (the plan counts them:
``CPUBackend.stored_nbytes``); store ``mmap`` keeps the file's bytes and the fused kernels. Q8_0's codes are bytes
already, but its 34-byte blocks leave them unaligned: repacked (the file's bytes: codes aligned, the f16 scales
apart) its GEMV runs ~15% faster (Gemma 3 270M's 178 MB lm_head: 9.4 against 10.9 ms on 2 cores with f32 scales,
2026-12-01).

``I8Data`` holds the three arrays and slices by rows like an array (a Gemma 4 expert's gate_up matrix is split
into its gate and up rows as a row view), so a ``Weight`` of format ``i8`` has ``scale`` None as the GGUF formats
do.
"""

from __future__ import annotations

import weakref

import numpy as np
from numba import get_num_threads, njit, prange, types
from numba.extending import overload

from lumen_core.backend import Weight

from . import native
from .bitcast import as_f32
from .fused import F16, PARALLEL_MIN_BYTES, _h, _scale_min_k4, gemv_or_gemm
from .gemm import FASTMATH, block4

# checkpoint format -> (values per scale, has a minimum)
FORMATS = {"q4_0": (32, False), "q5_0": (32, False), "q4_k": (32, True), "q5_k": (32, True), "q6_k": (16, False),
           "q8_0": (32, False)}
# The formats whose block scale is the file's f16 d: kept as its 16 bits (read exactly as f32 by ``scale_at``), half
# the bytes of an f32 scale (Q8_0 in RAM then takes the file's 34 bytes a block: Gemma 3 270M's 178 MB lm_head).
# K-quants' scales are products (d x sub-block scale) and stay f32.
F16_SCALES = ("q4_0", "q5_0", "q8_0")
_KIND = {f: i for i, f in enumerate(FORMATS)}


class I8Data:
    """The repacked matrix: ``q`` (R, C) int8 codes, ``s`` (R, C / bs) scales (f32, or the file's f16 bits as
    uint16 for ``F16_SCALES``), ``m`` (R, C / 32) f32 minimums or None. Indexing takes rows of all three. ``qx``:
    its GEMVs quantize x to 8 bits first (cpu.compute-quantization "int8": integer dot products, inexact)."""

    def __init__(self, q: np.ndarray, s: np.ndarray, m: np.ndarray | None, qx: bool = False):
        self.q, self.s, self.m, self.qx = q, s, m, qx

    def __getitem__(self, rows) -> I8Data:
        return I8Data(self.q[rows], self.s[rows], None if self.m is None else self.m[rows], self.qx)

    def __len__(self) -> int:
        return self.q.shape[0]

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.s.nbytes + (0 if self.m is None else self.m.nbytes)


def nbytes(fmt: str, shape) -> int:
    """Bytes an ``fmt`` matrix of ``shape`` takes once repacked."""
    bs, mins = FORMATS[fmt]
    n = int(np.prod(shape))
    return n + (2 if fmt in F16_SCALES else 4) * (n // bs) + (4 * (n // 32) if mins else 0)


def repack(raw: np.ndarray, fmt: str, shape, qx: bool = False) -> Weight:
    """A Weight of format ``i8`` from the file's blocks ``raw`` (R, bytes per row) of ``fmt`` and logical ``shape``
    (``qx``: see I8Data)."""
    R, C = (int(d) for d in shape)
    bs, mins = FORMATS[fmt]
    raw = np.ascontiguousarray(np.asarray(raw).reshape(R, -1))
    q = np.empty((R, C), np.int8)
    s = np.empty((R, C // bs), np.float32)
    m = np.empty((R, C // 32), np.float32) if mins else np.empty((R, 0), np.float32)
    _unpack(_KIND[fmt], raw, q, s, m, F16)
    if fmt in F16_SCALES:  # the file's f16 values, widened by _unpack: narrowing them back is exact
        s = s.astype(np.float16).view(np.uint16)
    return Weight(I8Data(q, s, m if mins else None, qx), "i8", (R, C), None, None)


def scale_at(s, r, b):
    """Block b's scale of row r as f32: ``s`` holds f32 scales or f16 bits (``F16_SCALES``); numba picks one at
    compile time (``_scale_at``)."""
    return np.float32(s[r, b]) if s.dtype != np.uint16 else np.float32(np.uint16(s[r, b]).view(np.float16))


@overload(scale_at, inline="always")
def _scale_at(s, r, b):
    if s.dtype == types.uint16:
        def f16(s, r, b):  # the 15 magnitude bits moved into an f32 and rescaled by 2^112 (exact: subnormals and
            h = np.uint32(s[r, b])  # zero too), the sign bit put back: no 256 KB table gather
            return as_f32(((h & np.uint32(0x7FFF)) << np.uint32(13)) | ((h & np.uint32(0x8000)) << np.uint32(16))) \
                * np.float32(5.192296858534828e33)
        return f16
    return lambda s, r, b: s[r, b]


# -- unpacking: one row's blocks -> codes, scales, minimums (the decoders of lumen_cpu.fused, stopped before the
#    multiply) --------------------------------------------------------------------------------------------------
@njit(cache=True, parallel=True)
def _unpack(kind, raw, q, s, m, tab):
    for r in prange(raw.shape[0]):
        row, qr, sr, mr = raw[r], q[r], s[r], m[r]
        if kind == 0:  # q4_0: 18-byte blocks: f16 d, 16 bytes of nibbles; code - 8
            for b in range(qr.shape[0] // 32):
                o = b * 18
                sr[b] = _h(tab, row[o], row[o + 1])
                for j in range(16):
                    byte = row[o + 2 + j]
                    qr[b * 32 + j] = np.int32(byte & 0x0F) - 8
                    qr[b * 32 + j + 16] = np.int32(byte >> 4) - 8
        elif kind == 1:  # q5_0: 22-byte blocks: f16 d, u32 high bits, 16 nibble bytes; code - 16
            for b in range(qr.shape[0] // 32):
                o = b * 22
                sr[b] = _h(tab, row[o], row[o + 1])
                qh = np.uint32(row[o + 2]) | (np.uint32(row[o + 3]) << 8) | (np.uint32(row[o + 4]) << 16) | \
                    (np.uint32(row[o + 5]) << 24)
                for j in range(16):
                    byte = row[o + 6 + j]
                    qr[b * 32 + j] = (np.int32(byte & 0x0F) | np.int32(((qh >> j) & 1) << 4)) - 16
                    qr[b * 32 + j + 16] = (np.int32(byte >> 4) | np.int32(((qh >> (j + 16)) & 1) << 4)) - 16
        elif kind == 2 or kind == 3:  # q4_k (144-byte super-blocks) / q5_k (176): d, dmin, 12 scale bytes, ...
            size = 144 if kind == 2 else 176
            for b in range(qr.shape[0] // 256):
                o = b * size
                d, dmin = _h(tab, row[o], row[o + 1]), _h(tab, row[o + 2], row[o + 3])
                sc6 = row[o + 4:o + 16]
                for j in range(8):
                    sc, mn = _scale_min_k4(sc6, j)
                    sr[b * 8 + j] = d * np.float32(sc)
                    mr[b * 8 + j] = dmin * np.float32(mn)
                    shift = 4 * (j % 2)
                    base = o + (16 if kind == 2 else 48) + (j // 2) * 32
                    for i in range(32):
                        code = (row[base + i] >> shift) & 0x0F
                        if kind == 3:
                            code |= ((row[o + 16 + i] >> j) & 0x01) << 4
                        qr[b * 256 + j * 32 + i] = code
        elif kind == 4:  # q6_k: 210-byte super-blocks: 128 ql, 64 qh, 16 int8 scales, f16 d; a scale per 16; code - 32
            for b in range(qr.shape[0] // 256):
                o = b * 210
                d = _h(tab, row[o + 208], row[o + 209])
                for v16 in range(16):
                    sr[b * 16 + v16] = d * np.float32((np.int32(row[o + 192 + v16]) ^ 0x80) - 0x80)
                for g in range(8):
                    h, c, shift, s2 = g // 4, g % 2, 4 * ((g // 2) % 2), 2 * (g % 4)
                    for p in range(32):
                        lo = (row[o + h * 64 + c * 32 + p] >> shift) & 0x0F
                        hi = (row[o + 128 + h * 32 + p] >> s2) & 0x03
                        qr[b * 256 + g * 32 + p] = np.int32(lo | (hi << 4)) - 32
        else:  # q8_0: 34-byte blocks: f16 d, 32 int8 codes (moved to 32-byte-aligned rows, d widened to f32)
            for b in range(qr.shape[0] // 32):
                o = b * 34
                sr[b] = _h(tab, row[o], row[o + 1])
                for i in range(32):
                    qr[b * 32 + i] = (np.int32(row[o + 2 + i]) ^ 0x80) - 0x80


# -- GEMV: x (T, C) f32 -> out (T, R) through the C rows (lumen_cpu/_native_i8.c, or native's numba cfunc) ---------
@njit(inline="always")
def _xsums(x, m):  # x's sums per 32 columns (T, C / 32), which the minimums multiply; (T, 0) where there are none
    if m.shape[1] == 0:
        return np.empty((x.shape[0], 0), np.float32)
    xs = np.empty((x.shape[0], x.shape[1] // 32), np.float32)
    for t in range(x.shape[0]):
        for c in range(xs.shape[1]):
            xs[t, c] = x[t, c * 32:c * 32 + 32].sum()
    return xs


@njit(inline="always")
def _rows(q, s, m, x, xs, out, r0, r1):  # out[:, r0:r1]; q, s, m rows of contiguous values; x, out C-contiguous
    native.i8_rows(q.ctypes.data, q.strides[0], s.ctypes.data, s.strides[0] // s.itemsize, np.int64(s.itemsize == 2),
                   q.shape[1] // s.shape[1], m.ctypes.data if m.shape[1] > 0 else 0, m.strides[0] // 4, r0, r1 - r0,
                   q.shape[1], x.ctypes.data, x.shape[1], xs.ctypes.data, x.shape[0], out.ctypes.data + 4 * r0,
                   out.shape[1])


@njit(cache=True, parallel=True)
def _rows_parallel(q, s, m, x, xs, out, nw):  # worker w: its contiguous share of the rows
    R = q.shape[0]
    for w in prange(nw):
        _rows(q, s, m, x, xs, out, w * R // nw, (w + 1) * R // nw)


@njit(cache=True)
def gemv(q, s, m, x, out, threads):
    """out (T, R) = x (T, C) @ W.T for W's codes q, scales s and minimums m ((R, 0): none), on up to ``threads``
    of numba's threads (one below PARALLEL_MIN_BYTES: waking the pool costs more than it saves)."""
    xs = _xsums(x, m)
    nw = min(threads, q.shape[0]) if q.size >= PARALLEL_MIN_BYTES else 1
    if nw <= 1:
        _rows(q, s, m, x, xs, out, 0, q.shape[0])
    else:
        _rows_parallel(q, s, m, x, xs, out, nw)


@njit(cache=True)
def quantize_x(x, bs):
    """x (T, C) to 8 bits a value (cpu.compute-quantization "int8"): per 32 columns d = max|x| / 127 and
    xq = round(x / d) in [-127, 127]; returns xq (T, C) int8, d (T, C / 32) f32 and xq's sums per ``bs`` columns
    (T, C / bs) as f32 (exact: |sum| <= 4064)."""
    T, C = x.shape
    xq = np.empty((T, C), np.int8)
    dx = np.empty((T, C // 32), np.float32)
    xsq = np.empty((T, C // bs), np.float32)
    for t in range(T):
        for c in range(C // 32):
            amax = np.float32(0)
            for k in range(c * 32, c * 32 + 32):
                amax = max(amax, abs(x[t, k]))
            d = amax / np.float32(127)
            inv = np.float32(127) / amax if amax > 0 else np.float32(0)
            dx[t, c] = d
            for k in range(c * 32, c * 32 + 32):
                xq[t, k] = np.int8(min(127.0, max(-127.0, np.floor(x[t, k] * inv + np.float32(0.5)))))
        for b in range(C // bs):
            acc = 0
            for k in range(b * bs, b * bs + bs):
                acc += np.int32(xq[t, k])
            xsq[t, b] = acc
    return xq, dx, xsq


@njit(inline="always")
def _rows_q8(q, s, m, xq, dx, xsq, xs, out, r0, r1):  # _rows with x quantized (quantize_x)
    native.i8_rows_q8(q.ctypes.data, q.strides[0], s.ctypes.data, s.strides[0] // s.itemsize,
                      np.int64(s.itemsize == 2), q.shape[1] // s.shape[1], m.ctypes.data if m.shape[1] > 0 else 0,
                      m.strides[0] // 4, r0, r1 - r0, q.shape[1], xq.ctypes.data, dx.ctypes.data, xsq.ctypes.data,
                      xs.ctypes.data, xq.shape[0], out.ctypes.data + 4 * r0, out.shape[1])


@njit(cache=True, parallel=True)
def _rows_q8_parallel(q, s, m, xq, dx, xsq, xs, out, nw):
    R = q.shape[0]
    for w in prange(nw):
        _rows_q8(q, s, m, xq, dx, xsq, xs, out, w * R // nw, (w + 1) * R // nw)


@njit(cache=True)
def gemv_q8(q, s, m, x, out, threads):
    """``gemv`` with x quantized to 8 bits (quantize_x) and integer dot products a block (opt-in, inexact)."""
    xs = _xsums(x, m)
    xq, dx, xsq = quantize_x(x, q.shape[1] // s.shape[1])
    nw = min(threads, q.shape[0]) if q.size >= PARALLEL_MIN_BYTES else 1
    if nw <= 1:
        _rows_q8(q, s, m, xq, dx, xsq, xs, out, 0, q.shape[0])
    else:
        _rows_q8_parallel(q, s, m, xq, dx, xsq, xs, out, nw)


@njit(cache=True)  # serial; no fastmath: no FMA, the exact values
def _dequant(q, s, m, out):  # -> out (R, C) f32: scale x code - min
    # The minimum's blocks through 1-D slices and a loop over their length: LLVM vectorizes that form (2.2x faster,
    # measured), not the same loop indexing the 2-D arrays, which it unrolls into scalar conversions.
    bs = q.shape[1] // s.shape[1]
    for r in range(q.shape[0]):
        qr, orow = q[r], out[r]
        if m.shape[1] > 0:
            for b in range(q.shape[1] // 32):
                d, dm = s[r, b], m[r, b]
                qb, ob = qr[b * 32:b * 32 + 32], orow[b * 32:b * 32 + 32]
                for i in range(qb.shape[0]):
                    ob[i] = d * np.float32(qb[i]) - dm
        else:  # (this form, 2-D indexing, vectorizes here: measured 1.5x faster than the slices for Q6_K's 16)
            for b in range(q.shape[1] // bs):
                d = scale_at(s, r, b)
                for i in range(bs):
                    out[r, b * bs + i] = d * np.float32(q[r, b * bs + i])


def dequantize_rows(w: Weight, start: int = 0, stop: int | None = None) -> np.ndarray:
    """Rows start:stop of an ``i8`` Weight as float32 (bit for bit the GGUF block's values)."""
    d = w.data[start:stop]
    out = np.empty(d.q.shape, np.float32)
    _dequant(d.q, d.s, d.m if d.m is not None else np.empty((d.q.shape[0], 0), np.float32), out)
    return out


def _gemv(d: I8Data, x, out, tab=None):
    (gemv_q8 if d.qx else gemv)(d.q, d.s, d.m if d.m is not None else np.empty((d.q.shape[0], 0), np.float32), x,
                                out, get_num_threads())


@njit(cache=True, parallel=True, fastmath=FASTMATH)
def _gemm_rows(q, s, m, x, out, chunk):  # rows decoded by _dequant (exact), four at a time
    R, C = q.shape
    for t0 in range(0, x.shape[0], chunk):
        t1 = min(x.shape[0], t0 + chunk)
        for quad in prange((R + 3) // 4):
            r = 4 * quad
            n = min(4, R - r)
            w = np.empty((4, C), np.float32)
            _dequant(q[r:r + n], s[r:r + n], m[r:r + n], w[:n])
            block4(w, n, x, t0, t1, out, r)


@njit(inline="always")
def _gemm_c(q, s, m, x, out, r0, r1, t0, t1):  # native.i8_gemm over rows r0:r1, tokens t0:t1; 0: not run here
    return native.i8_gemm(q.ctypes.data, q.strides[0], s.ctypes.data, s.strides[0] // s.itemsize,
                          np.int64(s.itemsize == 2), q.shape[1] // s.shape[1], m.ctypes.data if m.shape[1] > 0 else 0,
                          m.strides[0] // 4, r0, r1 - r0, q.shape[1], x.ctypes.data, x.shape[1], t0, t1,
                          out.ctypes.data + 4 * r0, out.shape[1])


@njit(cache=True, parallel=True)
def _gemm_c_parallel(q, s, m, x, out, chunk, nw):  # worker w: a contiguous range of rows (whole quads), every chunk
    quads = (q.shape[0] + 3) // 4
    for w in prange(nw):
        r0, r1 = 4 * (w * quads // nw), min(q.shape[0], 4 * ((w + 1) * quads // nw))
        for t0 in range(0, x.shape[0], chunk):
            if r1 > r0:
                _gemm_c(q, s, m, x, out, r0, r1, t0, min(x.shape[0], t0 + chunk))


@njit(cache=True)
def gemm(q, s, m, x, out, chunk, threads):
    """out (T, R) = x (T, C) @ W.T for many tokens, in token chunks of ``chunk``: the C kernel (lumen_i8_gemm:
    AVX-512, four rows by four tokens in registers) where this CPU has one, else _gemm_rows (numba). Both decode
    rows to the exact values of dequantize_rows."""
    if _gemm_c(q, s, m, x, out, 0, 0, 0, 0) == 0:
        _gemm_rows(q, s, m, x, out, chunk)
    else:
        _gemm_c_parallel(q, s, m, x, out, chunk, max(1, min(threads, (q.shape[0] + 3) // 4)))


def _gemm(d: I8Data, x, out, chunk):
    gemm(d.q, d.s, d.m if d.m is not None else np.empty((d.q.shape[0], 0), np.float32), x, out, chunk,
         get_num_threads())


def linear(x, w: Weight):  # x (T, C) f32, w (R, C) i8 -> (T, R)
    return gemv_or_gemm(x, w, _gemv, _gemm, w.data)


def linear_group(x, ws: list[Weight]) -> list[np.ndarray]:
    """``[linear(x, w) for w in ws]`` (the ``linear_group`` op: a layer's q/k/v, its gate/up). Where every weight is
    ``i8`` with the same layout, the matrices are joined on the first call (``_joined``) and each call is one
    ``linear`` over the joined rows: one parallel region reading one contiguous stream (a decode step's gate+up
    2.9 MB: 138 against 167 us as two calls, cold, 2 cores); the outputs are column views of its result, the same
    per-row sums. Otherwise each weight through the registered ``linear`` of its format."""
    joined = _joined(ws)
    if joined is None:
        from .ops import _lin

        return [_lin(x, w) for w in ws]
    y = linear(x, joined)
    out, r = [], 0
    for w in ws:
        out.append(y[:, r:r + w.shape[0]])
        r += w.shape[0]
    return out


_GROUPS = "_lumen_cpu_groups"  # the joined Weights of the groups a weight leads, kept on that weight


def _joined(ws: list[Weight]) -> Weight | None:
    """One ``i8`` Weight holding ws' rows in order, made on the group's first call: each w.data becomes a row view
    into it, so the matrices live once (the separate arrays are freed). None where they cannot join (formats,
    widths, scale layouts or minimums differ)."""
    groups = ws[0].__dict__.setdefault(_GROUPS, [])
    for refs, joined in groups:
        if len(refs) == len(ws) and all(r() is w for r, w in zip(refs, ws, strict=True)):
            return joined
    joined = _join(ws)
    groups.append((tuple(weakref.ref(w) for w in ws), joined))
    return joined


def _join(ws: list[Weight]) -> Weight | None:
    if len(ws) < 2 or any(w.format != "i8" for w in ws):
        return None
    d0 = ws[0].data
    if any(w.data.q.shape[1] != d0.q.shape[1] or w.data.s.shape[1] != d0.s.shape[1] or w.data.s.dtype != d0.s.dtype or
           (w.data.m is None) != (d0.m is None) or w.data.qx != d0.qx for w in ws):
        return None
    q = np.concatenate([w.data.q for w in ws])
    s = np.concatenate([w.data.s for w in ws])
    m = None if d0.m is None else np.concatenate([w.data.m for w in ws])
    data, r = I8Data(q, s, m, d0.qx), 0
    for w in ws:
        n = w.shape[0]
        w.data = data[r:r + n]
        r += n
    return Weight(data, "i8", q.shape, None, None, store=ws[0].store)


def embedding(ids, w: Weight):  # ids (T,), w (vocab, H) i8 -> (T, H): only the rows asked for
    idx = np.asarray(ids, dtype=np.int64)
    d = w.data[idx]
    out = np.empty(d.q.shape, np.float32)
    _dequant(d.q, d.s, d.m if d.m is not None else np.empty((d.q.shape[0], 0), np.float32), out)
    return out
