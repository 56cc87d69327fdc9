"""The optional op ``sandwich_layer`` (Gemma 3's decoder layer) for one token as one compiled call.

A decode step of Gemma 3 270M made ~14 op calls a layer (6 norms, 2 ropes, 2 linear groups, 2 linears, attention,
the activation), each a Python call, a numba dispatch and its array allocations: ~60 us of a layer's ~270 us on 2
cores (issue 22). Here the layer's whole sequence runs in one numba function that calls the same kernels (the
int8 GEMVs of ``lumen_cpu.int8``, ``_rms_rows``, ``_rope_rows``, ``_attend_kernel``, the gated activation) in the
same order, so its output is bit for bit the op-by-op composite's (``lumen_core.ops._sandwich_layer``, which the
tests compare it with).

It takes one token whose matrices are all ``i8`` (GGUF blocks held in RAM, repacked by ``lumen_cpu.int8``; q/k/v and
gate/up joined as ``linear_group`` joins them), f32 norms and an f32 KV cache (full or ring). Anything else (several
tokens, other formats or cache types) runs the composite over the CPU's registered ops.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from lumen_core.ops import _sandwich_layer
from lumen_core.plugins import get_registry

from .activations import PARALLEL_MIN as _ACT_PARALLEL_MIN
from .activations import _parallel, _serial
from .attention import KVCache, RingKVCache, _attend_kernel
from .int8 import _gemv16, _gemv32, _gemv32_min, _joined
from .ops import _rms_rows, _rope_rows

F32 = np.float32
ACTS = {"gelu_tanh": 0, "silu": 1}  # activations._gate's kinds


@njit(inline="always")
def _gemv(q, s, m, x, out):  # int8._gemv's choice, compiled: out (1, R) = x (1, C) @ W.T
    if m.shape[1] > 0:
        _gemv32_min(q, s, m, x, out)
    elif s.shape[1] * 16 == q.shape[1]:
        _gemv16(q, s, x, out)
    else:
        _gemv32(q, s, x, out)


@njit(cache=True)
def _layer(x, n_in, n_pa, n_pf, n_pff, eps, off, qq, qs, qm, oq, os_, om, gq, gs, gm, dq, ds, dm, q_norm, k_norm,
           H, KV, D, cos, sin, kc, vc, slot, cap, start, lo, window, scale, act):
    """x (1, C) -> (1, C): the composite's ops in its order (see _sandwich_layer). The new key and value are
    written at ``slot``; attention reads positions as _decode_step does (``cap``: the ring's size, or start + 2)."""
    C = x.shape[1]
    xn = np.empty((1, C), F32)
    _rms_rows(x, n_in, True, eps, off, xn)
    y = np.empty((1, qq.shape[0]), F32)
    _gemv(qq, qs, qm, xn, y)
    qh = np.empty((H, D), F32)
    kh = np.empty((KV, D), F32)
    _rms_rows(y[0, :H * D].reshape(H, D), q_norm, True, eps, off, qh)
    _rms_rows(y[0, H * D:(H + KV) * D].reshape(KV, D), k_norm, True, eps, off, kh)
    qr = np.empty((1, H, D), F32)
    kr = np.empty((1, KV, D), F32)
    _rope_rows(qh.reshape(1, H, D), cos, sin, qr)
    _rope_rows(kh.reshape(1, KV, D), cos, sin, kr)
    v0 = (H + KV) * D
    for h in range(KV):
        kc[h, slot] = kr[0, h]
        vc[h, slot] = y[0, v0 + h * D:v0 + (h + 1) * D]
    att = np.empty((1, H, vc.shape[2]), F32)
    _attend_kernel(qr, kc, vc, 0, cap, start, lo, window, scale, F32(0.0), att)
    h1 = np.empty((1, oq.shape[0]), F32)
    _gemv(oq, os_, om, att.reshape(1, H * vc.shape[2]), h1)
    t = np.empty((1, C), F32)
    _rms_rows(h1, n_pa, True, eps, off, t)
    x = x + t
    _rms_rows(x, n_pf, True, eps, off, xn)
    g = np.empty((1, gq.shape[0]), F32)
    _gemv(gq, gs, gm, xn, g)
    inner = gq.shape[0] // 2
    a = np.empty(inner, F32)
    if inner < _ACT_PARALLEL_MIN:
        _serial(g[0, :inner], g[0, inner:], a, act)
    else:
        _parallel(g[0, :inner], g[0, inner:], a, act)
    h2 = np.empty((1, dq.shape[0]), F32)
    _gemv(dq, ds, dm, a.reshape(1, inner), h2)
    _rms_rows(h2, n_pff, True, eps, off, t)
    return x + t


def _arrays(d) -> tuple:  # an I8Data's codes, scales and minimums ((rows, 0) where the format has none)
    return d.q, d.s, d.m if d.m is not None else np.empty((d.q.shape[0], 0), F32)


def _f32(*arrays) -> bool:
    return all(type(a) is np.ndarray and a.dtype == F32 and a.flags.c_contiguous for a in arrays)


def _compiled_args(x, norms, attn, mlp, cache, start, rope, dims, scale, window, eps, offset, act):
    """The arguments of ``_layer``, or None where the compiled path does not apply."""
    wq, wk, wv, q_norm, k_norm, wo = attn
    gate, up, down = mlp
    cos, sin = rope
    H, KV, D = dims
    if x.shape[0] != 1 or act not in ACTS or not _f32(x, *norms, q_norm, k_norm, cos, sin):
        return None
    if any(w.format != "i8" for w in (wq, wk, wv, wo, gate, up, down)):
        return None
    if type(cache) not in (KVCache, RingKVCache) or not _f32(cache.k, cache.v) or cache.v.shape[2] != D:
        return None
    qkv, gu = _joined([wq, wk, wv]), _joined([gate, up])
    if qkv is None or gu is None or qkv.shape[0] != (H + 2 * KV) * D or wo.shape[1] != H * D:
        return None
    lo = 0 if window is None else max(0, start - window + 1)
    if type(cache) is RingKVCache:
        cap = cache.capacity
        if window is None or window > cap:
            return None  # the composite's attention names the mismatch
        slot = start % cap
        cache.recent = (lo, None, start + 1 - lo)  # as attention's _decode_step records it (attention_shared)
    else:
        if start >= cache.capacity:
            return None
        slot, cap = start, start + 2  # positions never wrap: p % cap == p for p <= start
    return (x, *norms, F32(eps), F32(offset), *_arrays(qkv.data), *_arrays(wo.data), *_arrays(gu.data),
            *_arrays(down.data), q_norm, k_norm, H, KV, D, cos, sin, cache.k, cache.v, slot, cap, start, lo,
            window or 0, F32(scale), ACTS[act])


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


def sandwich_layer(x, norms, attn, mlp, cache, start, rope, dims, scale, window, eps, offset, act="gelu_tanh"):
    args = _compiled_args(x, norms, attn, mlp, cache, start, rope, dims, scale, window, eps, offset, act)
    if args is not None:
        return _layer(*args)
    return _sandwich_layer(_composite_ops(), x, norms, attn, mlp, cache, start, rope, dims, scale, window, eps,
                           offset, act)
