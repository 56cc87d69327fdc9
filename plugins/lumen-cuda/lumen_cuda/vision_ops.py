"""CUDA ops for vision towers (issue 17), in CuPy, f32: layer norm with bias, the two GELUs, bidirectional
attention within one image (no mask, no cache), and a concatenation of rows. The CPU backend's
(lumen_cpu.vision_ops) are the reference; tests/test_cuda_vision_ops.py compares them."""

from __future__ import annotations

import cupy as cp
import numpy as np

F32 = np.float32
_ATTENTION_BYTES = 1 << 30  # the (H, rows, S) f32 scores held at once: 1 GiB

_gelu_erf = cp.ElementwiseKernel("float32 x", "float32 y", "y = 0.5f * x * (1.0f + erff(x * 0.70710678118654752f))",
                                 "lumen_gelu_erf")
_gelu_tanh = cp.ElementwiseKernel(
    "float32 x", "float32 y",
    "y = 0.5f * x * (1.0f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)))", "lumen_gelu_tanh")


def _f32(x):
    return x if x.dtype == F32 else x.astype(F32)


def layer_norm(x, w, b, eps: float):  # x (..., D), w (D,) | None, b (D,) | None
    x = _f32(x)
    mean = x.mean(axis=-1, keepdims=True)
    d = x - mean
    var = (d * d).mean(axis=-1, keepdims=True)
    y = d * cp.reciprocal(cp.sqrt(var + F32(eps)))
    if w is not None:
        y = y * w
    return y if b is None else y + b


def gelu(x):
    return _gelu_erf(_f32(x))


def gelu_tanh(x):
    return _gelu_tanh(_f32(x))


def bidirectional_attention(q, k, v, scale: float):
    """softmax(q kᵀ · scale) v, every query over every key: q (T, H, D), k (S, Hkv, D), v (S, Hkv, Dv) -> (T, H, Dv);
    query head h reads KV head h // (H / Hkv). The flash kernel (lumen_cuda.flash) with the queries placed after
    every key, so its causal mask hides none; where it declines, cuBLAS batched GEMMs with the queries in blocks
    under ``_ATTENTION_BYTES``."""
    from . import flash

    q, k, v = _f32(q), _f32(k), _f32(v)
    T, H, _ = q.shape
    S, Hkv, Dv = v.shape
    out = flash.attend(q, k.transpose(1, 0, 2), v.transpose(1, 0, 2), S, 0, scale, None, None)
    if out is not None:
        return out
    return _bidirectional_cublas(q, k, v, scale)


def _bidirectional_cublas(q, k, v, scale: float):
    T, H, _ = q.shape
    S, Hkv, Dv = v.shape
    group = H // Hkv
    qg = q.reshape(T, Hkv, group, -1).transpose(1, 2, 0, 3)  # (Hkv, group, T, D)
    kt = k.transpose(1, 2, 0)[:, None]  # (Hkv, 1, D, S)
    vt = v.transpose(1, 0, 2)[:, None]  # (Hkv, 1, S, Dv)
    out = cp.empty((Hkv, group, T, Dv), dtype=F32)
    rows = max(1, _ATTENTION_BYTES // (4 * S * H))
    for a in range(0, T, rows):
        s = cp.matmul(qg[:, :, a:a + rows], kt) * F32(scale)  # (Hkv, group, rows, S)
        s -= s.max(axis=-1, keepdims=True)
        cp.exp(s, out=s)
        s /= s.sum(axis=-1, keepdims=True)
        out[:, :, a:a + rows] = cp.matmul(s, vt)
    return out.transpose(2, 0, 1, 3).reshape(T, H, Dv)


def clamp(x, lo, hi):  # Gemma 4's clipped linears; a bound may be None
    return cp.clip(_f32(x), lo, hi)


def concat(xs):  # [(T_i, ...)] -> (sum T_i, ...)
    return cp.concatenate([cp.asarray(x) for x in xs], axis=0)
