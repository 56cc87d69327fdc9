"""The CPU implementation of the op contract (docs/ops.md). numpy, f32 compute.

Activations are float32 numpy arrays; weights are ``Weight`` objects in their storage format.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from lumen_core import rope as _rope
from lumen_core.backend import Weight

from .activations import gated
from .attention import KVCache, attention, kv_cache
from .delta import causal_conv1d, conv_state, delta_state, gated_delta_rule

F32 = np.float32


# -- weights -----------------------------------------------------------------------------------------------
def dequantize(w: Weight) -> np.ndarray:
    """The f32 matrix a Weight stands for. fp8: value × scale per block / channel / tensor."""
    data = w.data.astype(F32)
    if w.scale is None:
        return data
    if w.block is None:  # per-tensor () / (1,) or per-channel (out,) / (out, 1)
        return data * w.scale.reshape(-1, 1) if w.scale.size > 1 else data * F32(w.scale.reshape(()))
    br, bc = w.block
    s = np.repeat(np.repeat(w.scale, br, axis=0), bc, axis=1)
    return data * s[: data.shape[0], : data.shape[1]]


def linear_f32(x, w: Weight):  # x (T, in), w (out, in) -> (T, out)
    return x @ w.data.T


def linear_any(x, w: Weight):  # bf16 / f16 / fp8 storage: dequantize on use, compute in f32
    return x @ dequantize(w).T


def embedding(ids, w: Weight):  # ids list[int] (T,), w (vocab, H) -> (T, H)
    idx = np.asarray(ids, dtype=np.int64)
    if w.scale is None:
        return w.data[idx].astype(F32)
    return dequantize(w)[idx]  # quantized embeddings are rare: dequantize the table on use


# -- elementwise and norms ---------------------------------------------------------------------------------
def rms_norm(x, w, eps: float, offset: float = 0.0):  # x (..., D), w (D,) or None
    # One compiled kernel: ~100 norms a token on Gemma 3 270M, 3 us each where numpy's einsum + 3 ufuncs took 24.
    if x.dtype != F32 or (w is not None and w.dtype != F32):
        mean_sq = np.mean(x.astype(F32) ** 2, axis=-1, keepdims=True)
        y = (x * (1.0 / np.sqrt(mean_sq + F32(eps)))).astype(F32)
        return y if w is None else y * (w + F32(offset)) if offset else y * w
    rows = np.ascontiguousarray(x).reshape(-1, x.shape[-1])
    out = np.empty_like(rows)
    _rms_rows(rows, _NO_WEIGHT if w is None else w, w is not None, F32(eps), F32(offset), out)
    return out.reshape(x.shape)


_NO_WEIGHT = np.empty(0, F32)


@njit(cache=True, fastmath={"reassoc", "contract", "nsz", "arcp"})  # no nnan: a NaN must reach the logits
def _rms_rows(x, w, weighted, eps, offset, out):  # x (N, D) -> out: x / sqrt(mean(x^2) + eps) * (w + offset)
    for r in range(x.shape[0]):
        acc = np.float32(0.0)
        for i in range(x.shape[1]):
            acc += x[r, i] * x[r, i]
        inv = np.float32(1.0) / np.sqrt(acc * np.float32(1.0 / x.shape[1]) + eps)
        if weighted:
            for i in range(x.shape[1]):
                out[r, i] = x[r, i] * inv * (w[i] + offset)
        else:
            for i in range(x.shape[1]):
                out[r, i] = x[r, i] * inv


def rms_norm_gated(x, gate, w, eps: float):  # norm(x) * w * silu(gate); x, gate (..., D)
    return rms_norm(x, w, eps) * silu(gate)


def l2norm(x, eps: float = 1e-6):  # (..., D)
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + F32(eps))


def sigmoid(x):
    return (0.5 * (np.tanh(0.5 * x) + 1.0)).astype(F32)


def silu(x):
    return x * sigmoid(x)


def softplus(x):
    with np.errstate(invalid="ignore"):  # NaN in (a corrupt weight): NaN out, which the engine reports; no warning
        return np.logaddexp(F32(0), x).astype(F32)


def exp(x):
    return np.exp(x)


def silu_mul(gate, up):  # f32: one compiled pass (lumen_cpu.activations)
    out = gated(gate, up, 1)
    return silu(gate) * up if out is None else out


def gelu_tanh_mul(gate, up):  # f32: one compiled pass, g / (1 + exp(-2y)) (lumen_cpu.activations)
    out = gated(gate, up, 0)
    if out is not None:
        return out
    # gate * gate * gate, not gate**3: numpy's float32 power is ~100x slower (94 us on 2048 values)
    g = 0.5 * gate * (1.0 + np.tanh(F32(0.7978845608028654) * (gate + F32(0.044715) * (gate * gate * gate))))
    return g * up


def softcap(x, cap: float):
    return np.tanh(x / F32(cap)) * F32(cap)


# -- rotary embeddings -------------------------------------------------------------------------------------
rope_tables = _rope.rope_tables  # the host math every backend shares (lumen_core.rope)


def apply_rope(x, cos, sin):  # x (T, heads, D); cos/sin (T, rot) with rot <= D, rotate-half pairing
    # One compiled kernel for f32 (~2 us a call, where numpy's slices and concatenations took ~30: two calls a
    # layer per token); the same products and sums as the numpy form below, so the same bits (no FMA contraction).
    if x.dtype == F32 and cos.dtype == F32 and sin.dtype == F32 and x.ndim == 3 and cos.shape[0] == x.shape[0]:
        out = np.empty(x.shape, F32)
        _rope_rows(x, np.ascontiguousarray(cos), np.ascontiguousarray(sin), out)
        return out
    rot = cos.shape[-1]
    xr, rest = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = np.concatenate([-xr[..., half:], xr[..., :half]], axis=-1)
    out = xr * cos[:, None, :] + rotated * sin[:, None, :]
    return np.concatenate([out, rest], axis=-1) if rest.shape[-1] else out


@njit(cache=True)  # no fastmath: x1 cos - x2 sin rounded as numpy rounds it (two products, then the sum)
def _rope_rows(x, cos, sin, out):  # x (T, H, D), cos / sin (T, rot) -> out
    T, H, D = x.shape
    rot = cos.shape[1]
    half = rot // 2
    for t in range(T):
        c, s = cos[t], sin[t]
        for h in range(H):
            xv, ov = x[t, h], out[t, h]
            for i in range(half):
                a, b = xv[i], xv[i + half]
                ov[i] = a * c[i] + (-b) * s[i]
                ov[i + half] = b * c[i + half] + a * s[i + half]
            for i in range(rot, D):
                ov[i] = xv[i]


# -- mixture of experts ------------------------------------------------------------------------------------
def moe_route(logits, k: int, normalize: bool = True):  # logits (T, E) -> weights (T, k), ids (T, k)
    z = logits - logits.max(axis=-1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=-1, keepdims=True)
    ids = np.argsort(-p, axis=-1, kind="stable")[:, :k]
    w = np.take_along_axis(p, ids, axis=-1)
    if normalize:
        w = w / w.sum(axis=-1, keepdims=True)
    return w.astype(F32), ids


def moe_experts(x, ids, weights, gate_up, down, act: str = "silu"):
    """Sum over each token's routed experts of weight × down(act(gate) × up).

    x (T, H); ids, weights (T, k); gate_up: per expert a (gate, up) pair of Weights (I, H);
    down: per expert a Weight (H, I). Tokens are grouped by expert so each expert runs once. fp8, NVFP4 and bf16
    experts run in lumen_cpu.moe_fused (two parallel numba kernels a layer); the rest, one expert at a time.
    """
    if len(gate_up) and gate_up[0][0].format in ("fp8", "nvfp4", "bf16"):
        from . import moe_fused

        y = moe_fused.experts(x, ids, weights, gate_up, down, act)
        if y is not None:
            return y
    return moe_experts_per_expert(x, ids, weights, gate_up, down, act)


def moe_experts_per_expert(x, ids, weights, gate_up, down, act: str = "silu"):
    """``moe_experts`` one expert at a time through the registered ``linear`` (the reference of moe_fused)."""
    out = np.zeros_like(x)
    mul = silu_mul if act == "silu" else gelu_tanh_mul
    for e in np.unique(ids):
        tok, slot = np.nonzero(ids == e)
        h = x[tok]
        g, u = gate_up[e]
        y = _lin(mul(_lin(h, g), _lin(h, u)), down[e])
        np.add.at(out, tok, y * weights[tok, slot][:, None])
    return out


def _lin(x, w: Weight):
    """The registered CPU linear for this weight's format (fused GGUF kernels included)."""
    from lumen_core.plugins import get_registry

    return get_registry().op("linear", "cpu", w.format)(x, w)


def table():
    """(op, function, variant) for everything this backend implements."""
    plain = [
        embedding, rms_norm, rms_norm_gated, l2norm, sigmoid, silu, softplus, exp, silu_mul,
        gelu_tanh_mul, softcap, rope_tables, apply_rope, moe_route, moe_experts, kv_cache, attention,
        conv_state, causal_conv1d, delta_state, gated_delta_rule,
    ]
    rows = [(f.__name__, f, None) for f in plain]
    rows.append(("linear", linear_f32, "f32"))
    rows += [("linear", linear_any, v) for v in ("bf16", "f16", "fp8")]
    rows.append(("linear", linear_any, None))
    from . import gemma_ops  # imports this module: loaded here, not at the top

    rows += gemma_ops.table()
    from . import quant  # GGUF block formats (q4_k, q8_0...): linear and embedding

    rows += quant.table()
    from . import nvfp4  # ModelOpt NVFP4: packed E2M1 pairs, e4m3 scale per 16 values, f32 global scale

    rows += nvfp4.table()
    from . import vision_ops  # vision towers: layer norm, GELU, bidirectional attention, concat

    rows += vision_ops.table()
    return rows


__all__ = ["KVCache", "table", "dequantize"]
