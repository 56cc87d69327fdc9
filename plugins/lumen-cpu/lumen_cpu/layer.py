"""The optional op ``sandwich_layer`` (Gemma 3's decoder layer) as one compiled call.

A decode step of Gemma 3 270M made ~14 op calls a layer (6 norms, 2 ropes, 2 linear groups, 2 linears, attention,
the activation), each a Python call, a numba dispatch and its array allocations: ~60 us of a layer's ~270 us on 2
cores (issue 22). Here the layer's whole sequence runs in one numba function that calls the same kernels (the
int8 GEMVs of ``lumen_cpu.int8``, ``_rms_rows``, ``_rope_rows``, ``_attend_kernel``, the gated activation) in the
same order, so its output is bit for bit the op-by-op composite's (``lumen_core.ops._sandwich_layer``, which the
tests compare it with).

It takes any number of tokens whose matrices are all ``i8`` (GGUF blocks held in RAM, repacked by ``lumen_cpu.int8``;
q/k/v and gate/up joined as ``linear_group`` joins them), f32 norms and an f32 KV cache (full or ring). Anything else
(other formats or cache types) runs the composite over the CPU's registered ops.
"""

from __future__ import annotations

import numpy as np
from numba import get_num_threads, njit

from lumen_core.ops import _sandwich_layer
from lumen_core.plugins import get_registry

from .activations import PARALLEL_MIN as _ACT_PARALLEL_MIN
from .activations import _parallel, _serial
from .attention import KVCache, RingKVCache, _attend_kernel
from .fused import GEMV_MAX_T
from .gemm import CHUNK_FLOATS
from .int8 import _joined, gemm, gemv, gemv_q8
from .ops import _rms_rows, _rope_rows

F32 = np.float32
ACTS = {"gelu_tanh": 0, "silu": 1}  # activations._gate's kinds


@njit(inline="always")
def _linear(q, s, m, x, out, threads, qx):  # int8.linear's choice, compiled: out (T, R) = x (T, C) @ W.T
    if x.shape[0] <= GEMV_MAX_T:
        if qx:
            gemv_q8(q, s, m, x, out, threads)
        else:
            gemv(q, s, m, x, out, threads)
    else:
        gemm(q, s, m, x, out, max(4, CHUNK_FLOATS // x.shape[1] // 4 * 4), threads)  # gemm.token_chunk


@njit(inline="always")
def _rms(x, w, eps, off):  # rms_norm of each row of x (N, D) (a copy of a view first, as rms_norm makes one)
    rows = np.ascontiguousarray(x)
    out = np.empty_like(rows)
    _rms_rows(rows, w, True, eps, off, out)
    return out


@njit(cache=True)
def _layer(x, n_in, n_pa, n_pf, n_pff, eps, off, qq, qs, qm, oq, os_, om, gq, gs, gm, dq, ds, dm, q_norm, k_norm,
           H, KV, D, cos, sin, kc, vc, ring, start, lo, window, scale, act, keys, vals, threads, qx):
    """x (T, C) -> (T, C): the composite's ops in its order (see _sandwich_layer), attention as ``attention`` does
    it: the new keys and values go to their cache slots (a ring's: position % its size) and the kernel reads the
    cache in place -- except a ring and several tokens, where the window's past and the new entries are first
    gathered into ``keys`` / ``vals`` (KV, start - lo + T, D), as ``_ring_update`` does (the caller keeps them)."""
    T, C = x.shape
    y = np.empty((T, qq.shape[0]), F32)
    _linear(qq, qs, qm, _rms(x, n_in, eps, off), y, threads, qx)
    qh = _rms(np.ascontiguousarray(y[:, :H * D]).reshape(T * H, D), q_norm, eps, off).reshape(T, H, D)
    kh = _rms(np.ascontiguousarray(y[:, H * D:(H + KV) * D]).reshape(T * KV, D), k_norm, eps, off).reshape(T, KV, D)
    v = np.ascontiguousarray(y[:, (H + KV) * D:]).reshape(T, KV, D)
    qr = np.empty((T, H, D), F32)
    kr = np.empty((T, KV, D), F32)
    _rope_rows(qh, cos, sin, qr)
    _rope_rows(kh, cos, sin, kr)
    cap = kc.shape[1]
    att = np.empty((T, H, D), F32)
    if keys.shape[1] > 0:  # a ring, several tokens
        past = start - lo
        for h in range(KV):
            for j in range(past):
                keys[h, j] = kc[h, (lo + j) % cap]
                vals[h, j] = vc[h, (lo + j) % cap]
            for t in range(T):
                keys[h, past + t] = kr[t, h]
                vals[h, past + t] = v[t, h]
        for t in range(max(0, T - cap), T):
            for h in range(KV):
                kc[h, (start + t) % cap] = kr[t, h]
                vc[h, (start + t) % cap] = v[t, h]
        _attend_kernel(qr, keys, vals, lo, keys.shape[1] + 1, start, lo, window, scale, F32(0.0), att)
    else:
        for t in range(T):
            slot = (start + t) % cap if ring else start + t
            for h in range(KV):
                kc[h, slot] = kr[t, h]
                vc[h, slot] = v[t, h]
        # a full cache: positions never wrap (p % (start + T + 1) == p for p < start + T)
        _attend_kernel(qr, kc, vc, 0, cap if ring else start + T + 1, start, lo, window, scale, F32(0.0), att)
    h1 = np.empty((T, oq.shape[0]), F32)
    _linear(oq, os_, om, att.reshape(T, H * D), h1, threads, qx)
    x = x + _rms(h1, n_pa, eps, off)
    g = np.empty((T, gq.shape[0]), F32)
    _linear(gq, gs, gm, _rms(x, n_pf, eps, off), g, threads, qx)
    inner = gq.shape[0] // 2
    gate = np.ascontiguousarray(g[:, :inner]).reshape(T * inner)
    up = np.ascontiguousarray(g[:, inner:]).reshape(T * inner)
    a = np.empty(T * inner, F32)
    if T * inner < _ACT_PARALLEL_MIN:
        _serial(gate, up, a, act)
    else:
        _parallel(gate, up, a, act)
    h2 = np.empty((T, dq.shape[0]), F32)
    _linear(dq, ds, dm, a.reshape(T, inner), h2, threads, qx)
    return x + _rms(h2, n_pff, eps, off)


def _arrays(d) -> tuple:  # an I8Data's codes, scales and minimums ((rows, 0) where the format has none)
    return d.q, d.s, d.m if d.m is not None else np.empty((d.q.shape[0], 0), F32)


def _f32(*arrays) -> bool:
    return all(type(a) is np.ndarray and a.dtype == F32 and a.flags.c_contiguous for a in arrays)


def _compiled_args(x, norms, attn, mlp, cache, start, rope, dims, scale, window, eps, offset, act):
    """The arguments of ``_layer``, or None where the compiled path does not apply. Records what a ring's
    ``attention`` records (``cache.recent``, for KV-sharing readers)."""
    wq, wk, wv, q_norm, k_norm, wo = attn
    gate, up, down = mlp
    cos, sin = rope
    H, KV, D = dims
    T = x.shape[0]
    if act not in ACTS or not _f32(x, *norms, q_norm, k_norm, cos, sin) or cos.shape[0] != T or x.ndim != 2:
        return None
    if any(w.format != "i8" for w in (wq, wk, wv, wo, gate, up, down)):
        return None
    if type(cache) not in (KVCache, RingKVCache) or not _f32(cache.k, cache.v) or cache.v.shape[2] != D:
        return None
    qkv, gu = _joined([wq, wk, wv]), _joined([gate, up])
    if qkv is None or gu is None or qkv.shape[0] != (H + 2 * KV) * D or wo.shape[1] != H * D:
        return None
    lo = 0 if window is None else max(0, start - window + 1)
    ring = type(cache) is RingKVCache
    keys = vals = np.empty((KV, 0, D), F32)
    if ring:
        if window is None or window > cache.capacity:
            return None  # the composite's attention names the mismatch
        if T == 1:
            cache.recent = (lo, None, start + 1 - lo)  # read from the ring itself (_decode_step)
        else:
            keys, vals = np.empty((KV, start - lo + T, D), F32), np.empty((KV, start - lo + T, D), F32)
            cache.recent = (lo, keys, vals)  # _ring_update's record, filled by _layer
    elif start + T > cache.capacity:
        return None
    return (x, *norms, F32(eps), F32(offset), *_arrays(qkv.data), *_arrays(wo.data), *_arrays(gu.data),
            *_arrays(down.data), q_norm, k_norm, H, KV, D, cos, sin, cache.k, cache.v, ring, start, lo, window or 0,
            F32(scale), ACTS[act], keys, vals, get_num_threads(), qkv.data.qx)


class _CPUOps:
    """The CPU's registered ops as an OpSet sees a backend (for the composite)."""

    name = "cpu"

    @property
    def registry(self):
        return get_registry()


_ops: list = []


def _composite_ops():
    """An OpSet over the CPU's registered ops (made once; it holds no state)."""
    if not _ops:
        from lumen_core.backend import OpSet

        _ops.append(OpSet(_CPUOps()))
    return _ops[0]


enabled = True  # False: every call runs the composite (benchmarks/cpu_gemma3.py's lumen-ops engine compares them)


def sandwich_layer(x, norms, attn, mlp, cache, start, rope, dims, scale, window, eps, offset, act="gelu_tanh"):
    args = enabled and _compiled_args(x, norms, attn, mlp, cache, start, rope, dims, scale, window, eps, offset, act)
    if args:
        return _layer(*args)
    return _sandwich_layer(_composite_ops(), x, norms, attn, mlp, cache, start, rope, dims, scale, window, eps,
                           offset, act)
