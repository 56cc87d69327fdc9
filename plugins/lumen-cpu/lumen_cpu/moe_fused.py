"""Routed experts with fp8, NVFP4 or bf16 weights on the CPU (numba): a layer's routed experts in two parallel kernels,
for any number of tokens, with no dequantized copy of any matrix.

The (token, slot) pairs are sorted by expert. Kernel 1 runs tasks of (expert, CHUNK rows of gate/up) in parallel,
each thread a contiguous range of tasks of about equal estimated cost (``_bounds``) with its scratch allocated once
(long sequential reads; per-task scratch and interleaved gate/up rows cost ~1/3 of the time): each row of gate and
up is decoded once into an f32 buffer (the values ``fp8.dequantize_rows`` / ``nvfp4_fused.dequantize_rows`` give)
and dotted with every token routed to that expert, giving h = act(gate . x) * (up . x) per slot (a single token's
rows are decoded and dotted in one pass). Kernel 2 does the same for (expert, CHUNK rows of down) into one output
row per slot. The weighted sum over a token's slots is then taken in slot order (j = 0 .. k-1) by numba.

One token (decode) reads each routed expert's bytes once, spread over every core: what ``experts: {compute: cpu}``
placements spend most of their time on. With the C kernels built, one token's fp8 / NVFP4 experts skip the two
kernels: ``_one_token`` runs them in one parallel region (``native.moe_token``: C workers claiming tasks, rows read
``PREFETCH`` bytes ahead; NVFP4 with 8-bit activations under cpu.compute-quantization int8). Where the CPU has AMX,
NVFP4, fp8 and bf16 rows shared by several tokens are multiplied in AMX bf16 tiles (lumen_cpu/_native_amx.c): exact
bf16 rows (bf16 ones read in place), the tokens as three bf16 planes summing to their f32 values (exact), or one
rounded under bf16; fp8's block scales multiply each column block's tile sums, and the products go token-major
straight into the output rows.
The per-expert path it replaces (``ops.moe_experts``: a parallel GEMV
launch per matrix, ~24 launches a layer, or a serial tile dequantization per expert in prefill) stays the
reference and the fallback (mixed formats or shapes, other formats).
"""

from __future__ import annotations

import threading
import weakref

import numpy as np
from numba import get_num_threads, njit, prange
from numba.typed import List

from . import fp8, hostjob, native
from .activations import moe_act as _act
from .bitcast import as_f32
from .fp8 import decode_dot, decode_row, dot, expand_scales, scale_x
from .native import (
    amx_dots,
    bf16_from_pairs,
    f32_dots,
    f32_pairs,
    fp8_decode_rows_bf16,
    nvfp4_decode_rows,
    nvfp4_decode_rows_bf16,
)
from .nvfp4_fused import dot_bits, e2m1, split

F32 = np.float32
CHUNK = 64  # rows per parallel task (a worker's range of tasks is contiguous: long sequential reads)
PAD = 32  # the AMX path's bf16 rows K + PAD apart: K * 2 bytes a multiple of 4 KB put a tile's 16 rows in one L1 set
MAX_SLOTS = 8192  # (token, expert) pairs per kernel call: bounds the (slots, H) f32 scratch (64 MiB at H = 2048)
ACTS = {"silu": 0, "gelu_tanh": 1}
E4M3 = fp8.E4M3  # NVFP4 block scales decode through this table


@njit(inline="always", fastmath=True)
def _row(row, kind, sexp, buf):  # kind 0: e4m3 bytes (decode_row); 1: bf16 (uint16) - exact widening
    if kind == 0:
        decode_row(row, sexp, buf)
    else:
        for k in range(buf.shape[0]):
            buf[k] = as_f32(np.uint32(row[k]) << np.uint32(16)) * sexp[k]


@njit(inline="always", fastmath=True)
def _row_nvfp4(row, sexp, gs, buf):  # packed E2M1 codes row (K/2,) -> buf (K,) f32
    """E2M1 codes (``nvfp4_fused.e2m1``), low nibble first; the value is (e2m1 x block scale) x global scale, the
    same f32 as ``nvfp4.dequantize``; ``sexp`` holds each column's decoded e4m3 block scale."""
    for i in range(row.shape[0]):
        b = np.uint32(row[i])
        buf[2 * i] = (e2m1(b) * sexp[2 * i]) * gs
        buf[2 * i + 1] = (e2m1(b >> np.uint32(4)) * sexp[2 * i + 1]) * gs


@njit(inline="always", fastmath=True)
def _row_dot(row, kind, xs):  # _row(row) . x in one pass, xs = x x the row's scales (fp8.scale_x)
    if kind == 0:
        return decode_dot(row, xs)
    acc = F32(0.0)
    for k in range(xs.shape[0]):
        acc += as_f32(np.uint32(row[k]) << np.uint32(16)) * xs[k]
    return acc


@njit(inline="always")
def _expand_nvfp4(brow, e4m3, sexp):  # one row of e4m3 block-scale bytes (K/16,) -> a scale per column
    for b in range(brow.shape[0]):
        s = e4m3[brow[b]]
        for j in range(16):
            sexp[b * 16 + j] = s


@njit(inline="always")
def _bounds(offs, nch, parts, nw):
    """The workers' task ranges (task j nch + c: expert j's row chunk c): contiguous (consecutive row chunks: long
    sequential reads; an expert's tokens laid out once a worker) and of about equal estimated cost, not equal counts.
    A chunk costs ~3 to decode plus its products: in the AMX tiles ~`parts` a block of 16 tokens (3 planes cost about
    what decoding does), on the f32 path ~3 a 16 tokens. Equal counts left the busiest of 16 workers 6-12% above the
    mean at 512 tokens with uniform routing (this model), more where routing is skewed; worker w runs tasks
    bounds[w] .. bounds[w + 1]."""
    n = offs.shape[0] - 1
    cum = np.zeros(n * nch + 1)
    for j in range(n):
        m = offs[j + 1] - offs[j]
        cost = 3.0 + (parts * ((m + 15) // 16) if parts and m > 1 else 3.0 * m / 16)
        for c in range(nch):
            cum[j * nch + c + 1] = cum[j * nch + c] + cost
    bounds = np.empty(nw + 1, np.int64)
    for w in range(nw + 1):
        bounds[w] = np.searchsorted(cum, cum[n * nch] * w / nw) if 0 < w < nw else (0 if w == 0 else n * nch)
    return bounds


@njit(inline="always", fastmath=True)
def _dots(B, R, X, idx, i0, n, C):
    """C[r, m] = B[r] . X[idx[i0 + m]] for r < R, m < n: the C kernel (lumen_f32_dots) where there is one, else
    4 rows x 4 tokens at a time (16 accumulators, each loaded value used 4 times: ~1.8x a dot per pair with the
    operands in cache), the edges a dot each."""
    if f32_dots(B.ctypes.data, R, B.shape[1], X.ctypes.data, X.shape[1], idx[i0:].ctypes.data, n, C.ctypes.data,
                C.shape[1]):
        return
    r = 0
    while r + 4 <= R:
        b0, b1, b2, b3 = B[r], B[r + 1], B[r + 2], B[r + 3]
        m = 0
        while m + 4 <= n:
            x0, x1, x2, x3 = X[idx[i0 + m]], X[idx[i0 + m + 1]], X[idx[i0 + m + 2]], X[idx[i0 + m + 3]]
            a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = F32(0.0)
            a20 = a21 = a22 = a23 = a30 = a31 = a32 = a33 = F32(0.0)
            for k in range(B.shape[1]):
                p, q, u, v = b0[k], b1[k], b2[k], b3[k]
                y0, y1, y2, y3 = x0[k], x1[k], x2[k], x3[k]
                a00 += p * y0
                a01 += p * y1
                a02 += p * y2
                a03 += p * y3
                a10 += q * y0
                a11 += q * y1
                a12 += q * y2
                a13 += q * y3
                a20 += u * y0
                a21 += u * y1
                a22 += u * y2
                a23 += u * y3
                a30 += v * y0
                a31 += v * y1
                a32 += v * y2
                a33 += v * y3
            C[r, m], C[r, m + 1], C[r, m + 2], C[r, m + 3] = a00, a01, a02, a03
            C[r + 1, m], C[r + 1, m + 1], C[r + 1, m + 2], C[r + 1, m + 3] = a10, a11, a12, a13
            C[r + 2, m], C[r + 2, m + 1], C[r + 2, m + 2], C[r + 2, m + 3] = a20, a21, a22, a23
            C[r + 3, m], C[r + 3, m + 1], C[r + 3, m + 2], C[r + 3, m + 3] = a30, a31, a32, a33
            m += 4
        for mm in range(m, n):
            xv = X[idx[i0 + mm]]
            C[r, mm], C[r + 1, mm] = dot(b0, xv), dot(b1, xv)
            C[r + 2, mm], C[r + 3, mm] = dot(b2, xv), dot(b3, xv)
        r += 4
    for rr in range(r, R):
        for mm in range(n):
            C[rr, mm] = dot(B[rr], X[idx[i0 + mm]])


@njit(inline="always", fastmath=True)
def _gate_up_tokens(bg, bu, r0, r1, x, toks, i0, m, cg, cu, h, act):
    """Rows r0..r1 of gate and up, decoded into bg / bu, against the m tokens of slots i0..: h = act(gate) * up."""
    _dots(bg, r1 - r0, x, toks, i0, m, cg)
    _dots(bu, r1 - r0, x, toks, i0, m, cu)
    for r in range(r0, r1):
        for i in range(m):
            h[i0 + i, r] = _act(cg[r - r0, i], act) * cu[r - r0, i]


@njit(inline="always", fastmath=True)
def _down_tokens(buf, r0, r1, h, slots, i0, m, cd, ys):
    """Rows r0..r1 of down, decoded into buf, against the h rows of slots i0..i0+m: their outputs."""
    _dots(buf, r1 - r0, h, slots, i0, m, cd)
    for r in range(r0, r1):
        for i in range(m):
            ys[i0 + i, r] = cd[r - r0, i]


@njit(inline="always")
def _rows16(w, kind, r0, r1, buf):
    """Rows r0 .. r1 of an fp8 (kind 0) or bf16 (kind 1) matrix as bf16 rows for lumen_amx_dots: (address, values
    apart). fp8 rows decoded into buf (exact; the block scales are applied to the tile sums); bf16 rows read in place
    where a whole CHUNK of them exists (the tiles read 64 rows: never past the matrix), else copied into buf."""
    N, K = w.shape
    if kind == 0:
        fp8_decode_rows_bf16(w.ctypes.data, K, r0, r1 - r0, K, N, buf.ctypes.data, K + PAD)
        return np.int64(buf.ctypes.data), K + PAD  # (int64 throughout: uint64 and int64 would unify to a float)
    if r1 - r0 == CHUNK:
        return np.int64(w.ctypes.data) + r0 * K * 2, K
    for i in range(r1 - r0):
        buf[i, :K] = w[r0 + i]
    return np.int64(buf.ctypes.data), K + PAD


@njit(inline="always")
def _srow(S, rb, kind):  # lumen_amx_dots' row of column-block scales: fp8's row block rb; none for bf16 (0)
    return np.int64(S[rb].ctypes.data) if kind == 0 else np.int64(0)


@njit(cache=True, fastmath=False)  # not inlined into the fastmath kernels: vectorized there, silu(-5000) gave NaN
def _h_rows(tg, tu, r0, r1, h, s0, m, act):  # h of slots s0 .. s0 + m, rows r0 .. r1, from token-major gate and up
    for i in range(m):
        for r in range(r0, r1):
            h[s0 + i, r] = _act(tg[i, r - r0], act) * tu[i, r - r0]


@njit(inline="always")
def _pairs_scratch(parts, K, most):  # the AMX path's tokens in f32 pairs (lumen_f32_pairs)
    return np.empty((most + 15) // 16 * (K // 2) * 32 if parts else 1, F32)


@njit(cache=True, parallel=True, fastmath=True)
def _gate_up_scaled(G, U, SG, SU, br, bc, kind, x, experts, offs, toks, h, act, threads, most, parts):
    n, I, K = experts.shape[0], h.shape[1], x.shape[1]
    nch = (I + CHUNK - 1) // CHUNK
    ntask = n * nch
    nw = min(ntask, threads)  # numba.get_num_threads() inside would stop the compiled kernel being cached
    bounds = _bounds(offs, nch, parts, nw)
    for w in prange(nw):  # one worker a thread: its scratch allocated once, not per task
        bg, bu, eg, eu = np.empty((CHUNK, K), F32), np.empty((CHUNK, K), F32), np.empty(K, F32), np.empty(K, F32)
        gate, cg, cu = np.empty(CHUNK, F32), np.empty((CHUNK, most), F32), np.empty((CHUNK, most), F32)
        bg16, bu16, pg = _amx_scratch(parts, K, most)
        pf, tg, tu = _pairs_scratch(parts, K, most), cg.reshape(most, CHUNK), cu.reshape(most, CHUNK)
        paired = -1  # the slot group whose tokens pg holds
        t0, t1 = bounds[w], bounds[w + 1]
        for task in range(t0, t1):
            j, r0 = task // nch, (task % nch) * CHUNK
            r1 = min(r0 + CHUNK, I)
            e = experts[j]
            g, u, sg, su = G[e], U[e], SG[e], SU[e]
            m = offs[j + 1] - offs[j]
            if parts and m > 1:  # AMX tiles (_native_amx.c): exact bf16 rows, the tokens as `parts` bf16 planes, each
                rb = r0 // br  # column block's sums times the chunk's row of block scales (it lies in one row block)
                ag, ldw = _rows16(g, kind, r0, r1, bg16)
                au, _ = _rows16(u, kind, r0, r1, bu16)
                if paired != j:  # a worker's tasks are consecutive chunks: the tokens' planes made once an expert
                    f32_pairs(x.ctypes.data, K, toks[offs[j]:].ctypes.data, m, K, pf.ctypes.data)
                    bf16_from_pairs(pf.ctypes.data, m, K, parts, pg.ctypes.data)
                    paired = j
                amx_dots(ag, ldw, r1 - r0, K, pg.ctypes.data, m, parts, _srow(sg, rb, kind), bc,
                         tg.ctypes.data, CHUNK, 1, F32(1))
                amx_dots(au, ldw, r1 - r0, K, pg.ctypes.data, m, parts, _srow(su, rb, kind), bc,
                         tu.ctypes.data, CHUNK, 1, F32(1))
                _h_rows(tg, tu, r0, r1, h, offs[j], m, act)
                continue
            if offs[j + 1] - offs[j] == 1:  # one token: decode and dot in one pass, the gate rows then the up
                xt = x[toks[offs[j]]]       # rows (one sequential stream at a time: ~1.6x faster than both)
                last = -1
                for r in range(r0, r1):
                    if r // br != last:
                        last = r // br
                        scale_x(sg[last], bc, xt, eg)
                    gate[r - r0] = _row_dot(g[r], kind, eg)
                last = -1
                for r in range(r0, r1):
                    if r // br != last:
                        last = r // br
                        scale_x(su[last], bc, xt, eu)
                    h[offs[j], r] = _act(gate[r - r0], act) * _row_dot(u[r], kind, eu)
                continue
            last = -1  # several tokens: the chunk's rows decoded once, then (rows x tokens) in 4 x 4 blocks
            for r in range(r0, r1):
                if r // br != last:
                    last = r // br
                    expand_scales(sg[last], bc, eg)
                    expand_scales(su[last], bc, eu)
                _row(g[r], kind, eg, bg[r - r0])
                _row(u[r], kind, eu, bu[r - r0])
            _gate_up_tokens(bg, bu, r0, r1, x, toks, offs[j], offs[j + 1] - offs[j], cg, cu, h, act)


@njit(cache=True, parallel=True, fastmath=True)
def _down_scaled(D, SD, br, bc, kind, h, experts, offs, ys, threads, most, parts):
    n, H, I = experts.shape[0], ys.shape[1], h.shape[1]
    nch = (H + CHUNK - 1) // CHUNK
    ntask = n * nch
    nw = min(ntask, threads)  # numba.get_num_threads() inside would stop the compiled kernel being cached
    bounds = _bounds(offs, nch, parts, nw)
    slots = np.arange(h.shape[0])
    for w in prange(nw):
        buf, ed, cd = np.empty((CHUNK, I), F32), np.empty(I, F32), np.empty((CHUNK, most), F32)
        bd16, _, pb = _amx_scratch(parts, I, most)
        pf = _pairs_scratch(parts, I, most)
        paired = -1
        t0, t1 = bounds[w], bounds[w + 1]
        for task in range(t0, t1):
            j, r0 = task // nch, (task % nch) * CHUNK
            e = experts[j]
            d, sd = D[e], SD[e]
            m = offs[j + 1] - offs[j]
            if parts and m > 1:  # as _gate_up_scaled's
                r1, rb = min(r0 + CHUNK, H), r0 // br
                ad, ldw = _rows16(d, kind, r0, r1, bd16)
                if paired != j:
                    f32_pairs(h.ctypes.data, I, slots[offs[j]:].ctypes.data, m, I, pf.ctypes.data)
                    bf16_from_pairs(pf.ctypes.data, m, I, parts, pb.ctypes.data)
                    paired = j
                amx_dots(ad, ldw, r1 - r0, I, pb.ctypes.data, m, parts, _srow(sd, rb, kind), bc,
                         np.int64(ys.ctypes.data) + (offs[j] * H + r0) * 4, H, 1, F32(1))  # into ys: token-major
                continue
            single, last = offs[j + 1] - offs[j] == 1, -1
            for r in range(r0, min(r0 + CHUNK, H)):
                if r // br != last:
                    last = r // br
                    if single:  # ed = the token's h x the scales
                        scale_x(sd[last], bc, h[offs[j]], ed)
                    else:
                        expand_scales(sd[last], bc, ed)
                if single:
                    ys[offs[j], r] = _row_dot(d[r], kind, ed)
                    continue
                _row(d[r], kind, ed, buf[r - r0])
            if not single:
                _down_tokens(buf, r0, min(r0 + CHUNK, H), h, slots, offs[j], offs[j + 1] - offs[j], cd, ys)


@njit(inline="always")
def _dot_bits_scratch(K):  # dot_bits' scratch for rows of K values: x's even and odd columns, scales per byte
    K2 = K // 2
    return np.empty(K2, F32), np.empty(K2, F32), np.empty(K2, F32)


@njit(inline="always")
def _amx_scratch(parts, K, most):  # the AMX path's buffers: two chunks of bf16 rows, the tokens' bf16 planes
    if not parts:
        return np.zeros((1, 1), np.uint16), np.zeros((1, 1), np.uint16), np.empty(1, np.uint16)
    return (np.zeros((CHUNK, K + PAD), np.uint16), np.zeros((CHUNK, K + PAD), np.uint16),
            np.empty(parts * ((most + 15) // 16) * (K // 2) * 32, np.uint16))


@njit(cache=True, parallel=True, fastmath=True)
def _gate_up_nvfp4(G, U, BG, BU, gsg, gsu, e4m3, x, experts, offs, toks, h, act, threads, most, compiled, parts):
    n, I, K = experts.shape[0], h.shape[1], x.shape[1]
    nch = (I + CHUNK - 1) // CHUNK
    ntask = n * nch
    nw = min(ntask, threads)  # numba.get_num_threads() inside would stop the compiled kernel being cached
    bounds = _bounds(offs, nch, parts, nw)
    for w in prange(nw):
        bg, bu, eg, eu = np.empty((CHUNK, K), F32), np.empty((CHUNK, K), F32), np.empty(K, F32), np.empty(K, F32)
        gate = np.empty(CHUNK, F32)
        cg, cu = np.empty((CHUNK, most), F32), np.empty((CHUNK, most), F32)
        xe, xo, sb = _dot_bits_scratch(K)
        bg16, bu16, pb = _amx_scratch(parts, K, most)
        pf, tg, tu = _pairs_scratch(parts, K, most), cg.reshape(most, CHUNK), cu.reshape(most, CHUNK)
        packed = -1  # the slot group whose tokens pb holds
        t0, t1 = bounds[w], bounds[w + 1]
        for task in range(t0, t1):
            j, r0 = task // nch, (task % nch) * CHUNK
            e = experts[j]
            g, u, bgs, bus = G[e], U[e], BG[e], BU[e]
            if offs[j + 1] - offs[j] == 1:  # one token: decode and dot in one pass, the gate rows, then the up
                split(x[toks[offs[j]]], xe, xo)  # rows
                r1 = min(r0 + CHUNK, I)
                for r in range(r0, r1):
                    gate[r - r0] = dot_bits(g[r], bgs[r], gsg[e], xe, xo, e4m3, sb)
                for r in range(r0, r1):
                    h[offs[j], r] = _act(gate[r - r0], act) * dot_bits(u[r], bus[r], gsu[e], xe, xo, e4m3, sb)
                continue
            r1, m = min(r0 + CHUNK, I), offs[j + 1] - offs[j]
            if parts:  # AMX tiles (_native_amx.c): exact bf16 rows, the tokens as `parts` bf16 planes
                nvfp4_decode_rows_bf16(g.ctypes.data, K // 2, bgs.ctypes.data, K // 16, r0, r1 - r0, K, I,
                                       bg16.ctypes.data, K + PAD)
                nvfp4_decode_rows_bf16(u.ctypes.data, K // 2, bus.ctypes.data, K // 16, r0, r1 - r0, K, I,
                                       bu16.ctypes.data, K + PAD)
                if packed != j:  # a worker's tasks are consecutive chunks: an expert's tokens are packed once
                    f32_pairs(x.ctypes.data, K, toks[offs[j]:].ctypes.data, m, K, pf.ctypes.data)
                    bf16_from_pairs(pf.ctypes.data, m, K, parts, pb.ctypes.data)
                    packed = j
                amx_dots(bg16.ctypes.data, K + PAD, r1 - r0, K, pb.ctypes.data, m, parts, 0, 0, tg.ctypes.data,
                         CHUNK, 1, gsg[e])
                amx_dots(bu16.ctypes.data, K + PAD, r1 - r0, K, pb.ctypes.data, m, parts, 0, 0, tu.ctypes.data,
                         CHUNK, 1, gsu[e])
                _h_rows(tg, tu, r0, r1, h, offs[j], m, act)
                continue
            if compiled:  # the C decoder (lumen_cpu.native; same values): ~4x faster than _row_nvfp4
                nvfp4_decode_rows(g.ctypes.data, K // 2, bgs.ctypes.data, K // 16, r0, r1 - r0, K, gsg[e],
                                  bg.ctypes.data, K)
                nvfp4_decode_rows(u.ctypes.data, K // 2, bus.ctypes.data, K // 16, r0, r1 - r0, K, gsu[e],
                                  bu.ctypes.data, K)
            else:
                for r in range(r0, r1):
                    _expand_nvfp4(bgs[r], e4m3, eg)
                    _expand_nvfp4(bus[r], e4m3, eu)
                    _row_nvfp4(g[r], eg, gsg[e], bg[r - r0])
                    _row_nvfp4(u[r], eu, gsu[e], bu[r - r0])
            _gate_up_tokens(bg, bu, r0, r1, x, toks, offs[j], m, cg, cu, h, act)


@njit(cache=True, parallel=True, fastmath=True)
def _down_nvfp4(D, BD, gsd, e4m3, h, experts, offs, ys, threads, most, compiled, parts):
    n, H, I = experts.shape[0], ys.shape[1], h.shape[1]
    nch = (H + CHUNK - 1) // CHUNK
    ntask = n * nch
    nw = min(ntask, threads)  # numba.get_num_threads() inside would stop the compiled kernel being cached
    bounds = _bounds(offs, nch, parts, nw)
    slots = np.arange(h.shape[0])
    for w in prange(nw):
        buf, ed, cd = np.empty((CHUNK, I), F32), np.empty(I, F32), np.empty((CHUNK, most), F32)
        he, ho, sb = _dot_bits_scratch(I)
        bd16, _, pb = _amx_scratch(parts, I, most)
        pf = _pairs_scratch(parts, I, most)
        packed = -1
        t0, t1 = bounds[w], bounds[w + 1]
        for task in range(t0, t1):
            j, r0 = task // nch, (task % nch) * CHUNK
            e = experts[j]
            d, bd = D[e], BD[e]
            if offs[j + 1] - offs[j] == 1:
                split(h[offs[j]], he, ho)
                for r in range(r0, min(r0 + CHUNK, H)):
                    ys[offs[j], r] = dot_bits(d[r], bd[r], gsd[e], he, ho, e4m3, sb)
                continue
            r1, m = min(r0 + CHUNK, H), offs[j + 1] - offs[j]
            if parts:
                nvfp4_decode_rows_bf16(d.ctypes.data, I // 2, bd.ctypes.data, I // 16, r0, r1 - r0, I, H,
                                       bd16.ctypes.data, I + PAD)
                if packed != j:
                    f32_pairs(h.ctypes.data, I, slots[offs[j]:].ctypes.data, m, I, pf.ctypes.data)
                    bf16_from_pairs(pf.ctypes.data, m, I, parts, pb.ctypes.data)
                    packed = j
                amx_dots(bd16.ctypes.data, I + PAD, r1 - r0, I, pb.ctypes.data, m, parts, 0, 0,
                         np.int64(ys.ctypes.data) + (offs[j] * H + r0) * 4, H, 1, gsd[e])
                continue
            if compiled:
                nvfp4_decode_rows(d.ctypes.data, I // 2, bd.ctypes.data, I // 16, r0, r1 - r0, I, gsd[e],
                                  buf.ctypes.data, I)
            else:
                for r in range(r0, r1):
                    _expand_nvfp4(bd[r], e4m3, ed)
                    _row_nvfp4(d[r], ed, gsd[e], buf[r - r0])
            _down_tokens(buf, r0, r1, h, slots, offs[j], m, cd, ys)


# -- per layer: the expert matrices as numba lists, made once -----------------------------------------------------
def _typed(arrays) -> List:
    out = List()
    for a in arrays:
        out.append(a)
    return out


def _raw(w) -> np.ndarray:
    """The stored bits: e4m3 / packed E2M1 as uint8, bf16 as uint16."""
    return np.asarray(w.data).view(np.uint16 if w.format == "bf16" else np.uint8)


FORMATS = ("fp8", "nvfp4", "bf16")
KIND = {"fp8": 0, "bf16": 1}  # _row's decoder for the scaled kernels


class _Layer:
    """A layer's expert matrices as numba lists (views of the Weights' arrays, no copies); ``mats``: per role
    (gate, up, down) the E Weights."""

    def __init__(self, mats: list[list]):
        first = mats[0][0]
        self.fmt, (self.I, self.H) = first.format, tuple(first.shape)
        self.qx = self.bf16 = False
        shapes = [(self.I, self.H), (self.I, self.H), (self.H, self.I)]
        ok = self.fmt in FORMATS and len(mats[0]) == len(mats[2]) and all(
            w.format == self.fmt and tuple(w.shape) == shape and np.asarray(w.data).flags.c_contiguous
            for role, shape in zip(mats, shapes, strict=True) for w in role)
        if ok and self.fmt in KIND:
            if self.fmt == "fp8":
                sc = [[fp8.scales(w) for w in role] for role in mats]
            else:  # bf16: unscaled (a scale of 1 covering the matrix: x 1 is exact)
                one = np.ones((1, 1), F32)
                sc = [[(one, max(shape[0], 1), max(shape[1], 1)) for _ in role]
                      for role, shape in zip(mats, shapes, strict=True)]
            self.blocks = [(role[0][1], role[0][2]) for role in sc]
            ok = all((s[1], s[2]) == b for role, b in zip(sc, self.blocks, strict=True) for s in role)
            if ok:
                self.data = [_typed(_raw(w) for w in role) for role in mats]
                self.scales = [_typed(s[0] for s in role) for role in sc]
                self.bf16 = self.fmt == "fp8" and bool(getattr(first.scale, "bf16", False))  # as NVFP4's, below
        elif ok:  # nvfp4
            ok = self.H % 16 == 0 and self.I % 16 == 0
            if ok:
                self.data = [_typed(_raw(w) for w in role) for role in mats]
                self.scales = [_typed(np.asarray(w.scale.block).view(np.uint8) for w in role) for role in mats]
                self.gs = [np.array([np.float32(w.scale.global_scale) for w in role], F32) for role in mats]
                # cpu.compute-quantization "int8" (nvfp4.NVFP4Scale.qx): one token's rows take 8-bit activations
                self.qx = bool(getattr(first.scale, "qx", False))
                self.bf16 = bool(getattr(first.scale, "bf16", False))  # "bf16": several tokens' products in AMX
        self.ok = ok
        self.addresses = self.native = None  # _one_token's, made on its first call
        # every matrix and scale array's rows one after another (what lumen_cpu.native's C rows need)
        self.dense = ok and all(a.flags.c_contiguous for role in (*self.data, *self.scales) for a in role)


_LAYERS: dict[int, _Layer] = {}


def _layer(key, mats) -> _Layer:
    """The _Layer of the experts whose first Weight is ``key``; ``mats()`` gives the role lists on first use."""
    hit = _LAYERS.get(id(key))
    if hit is None:
        hit = _LAYERS[id(key)] = _Layer(mats())
        weakref.finalize(key, _LAYERS.pop, id(key), None)
    return hit


def experts(x, ids, weights, gate_up, down, act: str = "silu"):
    """``ops.moe_experts`` for lists of fp8, NVFP4 or bf16 experts; None where this path does not apply."""
    if act not in ACTS or not len(gate_up) or gate_up[0][0].format not in FORMATS:
        return None
    L = _layer(gate_up[0][0], lambda: [[g for g, _ in gate_up], [u for _, u in gate_up], list(down)])
    return _call(L, x, ids, weights, act)


def experts_packed(x, ids, weights, gate_up, down, act: str = "gelu_tanh"):
    """``moe_experts_packed`` (gate_up (E, 2I, H): gate rows then up rows; down (E, H, I)) for bf16 experts; None
    where this path does not apply."""
    if act not in ACTS or gate_up.format != "bf16" or down.format != "bf16" or gate_up.scale is not None \
            or getattr(gate_up.data, "ndim", 0) != 3 or getattr(down.data, "ndim", 0) != 3:
        return None
    E, I2, H = gate_up.data.shape
    I = I2 // 2

    def mats():
        from lumen_core.backend import Weight

        g, d = gate_up.data, down.data
        return [[Weight(g[e, :I], "bf16", (I, H)) for e in range(E)], [Weight(g[e, I:], "bf16", (I, H))
                for e in range(E)], [Weight(d[e], "bf16", tuple(d.shape[1:])) for e in range(E)]]

    return _call(_layer(gate_up, mats), x, ids, weights, act)


def _call(L: _Layer, x, ids, weights, act: str):
    if not L.ok:
        return None
    x = np.ascontiguousarray(x, dtype=F32)
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    T, k = ids.shape
    if T == 1 and L.fmt in NATIVE:
        out = _one_token(L, x, ids, np.ascontiguousarray(weights, dtype=F32), ACTS[act])
        if out is not None:
            return out
    out = np.zeros((T, L.H), F32)
    step = max(1, MAX_SLOTS // max(k, 1))
    for t0 in range(0, T, step):
        _run(L, x, ids[t0:t0 + step], np.asarray(weights[t0:t0 + step], F32), out[t0:t0 + step], t0, ACTS[act])
    return out


@njit(cache=True)
def _sort_slots(flat, E, k, t0):
    """Slots (t k + j) with a valid expert, sorted by expert (a counting sort: slot order kept within one):
    (order, the experts used, offsets into order per used expert, each slot's token index + t0)."""
    counts = np.zeros(E + 1, np.int64)
    for e in flat:
        if 0 <= e < E:
            counts[e + 1] += 1
    for e in range(E):
        counts[e + 1] += counts[e]
    S = counts[E]
    order = np.empty(S, np.int64)
    fill = counts[:E].copy()
    for s in range(flat.shape[0]):
        e = flat[s]
        if 0 <= e < E:
            order[fill[e]] = s
            fill[e] += 1
    n = 0
    for e in range(E):
        n += counts[e + 1] > counts[e]
    experts, offs = np.empty(n, np.int64), np.zeros(n + 1, np.int64)
    i = 0
    for e in range(E):
        if counts[e + 1] > counts[e]:
            experts[i] = e
            offs[i + 1] = counts[e + 1]
            i += 1
    toks = order // k + t0
    return order, experts, offs, toks


@njit(cache=True, fastmath=False, parallel=True)
def _combine(ys, order, weights, k, out):
    """out[t] += sum over j = 0 .. k-1 (in that order) of weights[t, j] * the output row of slot t k + j; the tokens in
    parallel (serial, it took 3.4 ms of a 157 ms call of 512 tokens on 2 threads: a larger share on 16)."""
    row = np.full(weights.size, -1, np.int64)
    for i in range(order.shape[0]):
        row[order[i]] = i
    T, H = out.shape
    for t in prange(T):
        acc = np.zeros(H, np.float32)
        for j in range(k):
            i = row[t * k + j]
            if i >= 0:
                w = weights[t, j]
                for c in range(H):
                    acc[c] += ys[i, c] * w
        for c in range(H):
            out[t, c] += acc[c]


NATIVE = ("fp8", "nvfp4")  # formats with compiled row kernels (lumen_cpu.native), used for one token


CGU, CD = 64, 128  # one-token tasks: rows of gate and up, of down (multiples of 16: the NVFP4 block); best of
# 16/32, 32/64 and 64/128 for fp8, NVFP4 and NVFP4 8-bit on the H200 host (16 threads) and a 2-core Xeon
PREFETCH = 4096  # bytes the one-token row kernels read ahead (measured: lumen_cpu/_native.h)


def _one_token(L: _Layer, x, ids, weights, act: int):
    """One token's experts in one compiled call (lumen_cpu.native.moe_token); None where that path does not
    apply."""
    if not native.available:
        return None
    if not L.dense:  # the C rows step by whole rows
        return None
    if L.addresses is None:  # the arrays' addresses (the _Layer holds the arrays): no typed list to unbox
        L.addresses = np.array([[a.ctypes.data for a in role] for role in (*L.data, *L.scales)], np.int64)
        if L.fmt == "fp8":
            (bg, cg), _, (bd, cd) = L.blocks
            L.native = (native.FP8, np.zeros((3, 1), F32),
                        np.array([L.scales[0][0].shape[1], L.scales[2][0].shape[1], bg, cg, bd, cd], np.int64))
        else:
            L.native = (native.NVFP4_Q8 if L.qx else native.NVFP4, np.stack(L.gs), np.zeros(6, np.int64))
    fmt, gs, blk = L.native
    rec = hostjob.recorder()
    if rec is not None:  # a GPU step asks what this call is (lumen_cpu.hostjob): note it instead of computing
        return rec.note(L, fmt, gs, blk, act, L.H, ids.shape[1], get_num_threads(), CGU, CD, PREFETCH)
    return native.moe_token(fmt, L.addresses, gs, blk, L.I, x, ids, weights, act, get_num_threads(), CGU, CD, PREFETCH)


EXACT_PARTS = 3  # the default AMX prefill: tokens as hi + mid + lo bf16 planes, exact (_native_amx.c)


def _parts(L: _Layer) -> int:
    """The tokens' bf16 planes in the AMX tiles: 1 under cpu.compute-quantization bf16 (rounded), else 3 (exact)."""
    return 1 if L.bf16 else EXACT_PARTS


_local = threading.local()


def _scratch(S: int, I: int, H: int):
    """h (S, I) and ys (S, H), kept per thread and shape between calls: fresh ones (tens of MB at 512 tokens) were
    paged in by the kernels' first writes at every call."""
    cache = _local.__dict__.setdefault("scratch", {})
    h, ys = cache.get((I, H), (None, None))
    if h is None or h.shape[0] < S:
        h, ys = cache[(I, H)] = np.empty((S, I), F32), np.empty((S, H), F32)
    return h[:S], ys[:S]


def _run(L: _Layer, x, ids, weights, out, t0: int, act: int) -> None:
    T, k = ids.shape
    order, experts, offs, toks = _sort_slots(np.ascontiguousarray(ids).reshape(-1), len(L.data[0]), k, t0)
    h, ys = _scratch(len(order), L.I, L.H)
    threads = get_num_threads()
    most = max(1, int(np.diff(offs).max())) if len(offs) > 1 else 1  # tokens of the busiest expert
    if L.fmt in KIND:
        (bg, cg), _, (bd, cd) = L.blocks
        kind = KIND[L.fmt]
        # fp8 / bf16 experts in AMX tiles where this CPU and process have them, a chunk of CHUNK rows lies in one
        # row block of scales and a column block is whole k steps of the tiles (32 columns) (else the f32 path)
        amx = (native.available and native.level == "amx" and L.dense and L.H % 32 == 0
               and L.I % 32 == 0 and (bg % CHUNK == 0 or bg >= L.I) and (bd % CHUNK == 0 or bd >= L.H)
               and cg % 32 == 0 and cd % 32 == 0)
        parts = _parts(L) if amx else 0
        _gate_up_scaled(L.data[0], L.data[1], L.scales[0], L.scales[1], bg, cg, kind, x, experts, offs, toks, h,
                        act, threads, most, parts)
        _down_scaled(L.data[2], L.scales[2], bd, cd, kind, h, experts, offs, ys, threads, most, parts)
    else:
        compiled = native.available and L.dense  # the C decoder steps by whole rows
        # AMX tiles where this CPU and process have them (else the f32 path)
        amx = compiled and native.level == "amx" and L.H % 32 == 0 and L.I % 32 == 0
        parts = _parts(L) if amx else 0
        _gate_up_nvfp4(L.data[0], L.data[1], L.scales[0], L.scales[1], L.gs[0], L.gs[1], E4M3, x, experts,
                       offs, toks, h, act, threads, most, compiled, parts)
        _down_nvfp4(L.data[2], L.scales[2], L.gs[2], E4M3, h, experts, offs, ys, threads, most, compiled, parts)
    _combine(ys, order, np.ascontiguousarray(weights, dtype=F32), k, out)
