"""CPU ops added for vision towers (issue 17): layer norm with bias, the two GELUs, bidirectional attention within
one image, and a concatenation of rows (image embeddings spliced between text embeddings)."""

from __future__ import annotations

import math

import numpy as np

F32 = np.float32
_ATTENTION_BYTES = 1 << 27  # the score block a bidirectional attention call holds at once (128 MiB)


def layer_norm(x, w, b, eps: float):  # x (..., D), w (D,) | None, b (D,) | None
    mean = x.mean(axis=-1, keepdims=True, dtype=F32)
    d = x - mean
    var = np.einsum("...i,...i->...", d, d)[..., None] * F32(1.0 / x.shape[-1])
    y = d * (1.0 / np.sqrt(var + F32(eps)))
    if w is not None:
        y = y * w
    return y if b is None else y + b


_GELU_ERF = []  # the numba ufunc, compiled on first use (not when the plugin loads)


def _gelu_erf():
    from numba import vectorize

    @vectorize(["float32(float32)"], cache=True)
    def gelu_erf(x):
        return F32(0.5) * x * (F32(1.0) + F32(math.erf(x * F32(0.7071067811865476))))

    _GELU_ERF.append(gelu_erf)
    return gelu_erf


def gelu(x):  # x * Φ(x), the erf form (torch's nn.GELU())
    fn = _GELU_ERF[0] if _GELU_ERF else _gelu_erf()
    return fn(np.asarray(x, dtype=F32))


def gelu_tanh(x):  # the tanh approximation (gelu_pytorch_tanh)
    return F32(0.5) * x * (F32(1.0) + np.tanh(F32(0.7978845608028654) * (x + F32(0.044715) * (x * x * x))))


def bidirectional_attention(q, k, v, scale: float):
    """softmax(q kᵀ · scale) v with every query over every key: q (T, H, D), k (S, Hkv, D), v (S, Hkv, Dv), Hkv
    dividing H (query head h reads KV head h // (H / Hkv)) -> (T, H, Dv). Queries go in blocks so the scores held
    at once stay under ``_ATTENTION_BYTES``."""
    T, H, _ = q.shape
    S, Hkv, Dv = v.shape
    group = H // Hkv
    qg = q.reshape(T, Hkv, group, -1).transpose(1, 2, 0, 3)  # (Hkv, group, T, D)
    kt = k.transpose(1, 2, 0)  # (Hkv, D, S)
    vt = v.transpose(1, 0, 2)  # (Hkv, S, Dv)
    out = np.empty((Hkv, group, T, Dv), dtype=F32)
    rows = max(1, _ATTENTION_BYTES // (4 * S * H))
    for a in range(0, T, rows):
        s = np.matmul(qg[:, :, a:a + rows], kt[:, None]) * F32(scale)  # (Hkv, group, rows, S)
        s -= s.max(axis=-1, keepdims=True)
        np.exp(s, out=s)
        s /= s.sum(axis=-1, keepdims=True)
        out[:, :, a:a + rows] = np.matmul(s, vt[:, None])
    return out.transpose(2, 0, 1, 3).reshape(T, H, Dv)


def concat(xs):  # [(T_i, ...)] -> (sum T_i, ...)
    return np.concatenate(xs, axis=0)


def clamp(x, lo: float, hi: float):  # min(max(x, lo), hi)
    return np.clip(x, F32(lo), F32(hi))


def table():
    """(op, function, variant) rows, appended to ``ops.table()``."""
    return [(f.__name__, f, None) for f in (layer_norm, gelu, gelu_tanh, bidirectional_attention, concat, clamp)]
