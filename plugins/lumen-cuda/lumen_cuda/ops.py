"""The CUDA implementation of the op contract (lumen_core.ops.CONTRACT) on CuPy, f32 compute.

Each op mirrors lumen_cpu's op of the same name step by step, so the two agree to f32 rounding; GEMMs go to
cuBLAS through ``cupy.matmul`` (CuPy leaves TF32 off unless CUPY_TF32=1, so f32 stays f32). No hand-written
kernels yet: this is the correct baseline the kernels will be checked against.
"""

from __future__ import annotations

import cupy as cp
import numpy as np

from lumen_core.backend import Weight

from .attention import attention, attention_shared, kv_cache, sliding_kv_cache
from .delta import causal_conv1d, conv_state, delta_state, gated_delta_rule

F32 = cp.float32
QUANTIZED = ("fp8", "nvfp4")  # formats whose linear / embedding live in gemv.py (a scale beside the data)


# -- weights -----------------------------------------------------------------------------------------------
def bf16_to_f32(bits):
    """uint16 bf16 bits (any shape) -> f32: the bits are the high half of an f32."""
    return (bits.astype(cp.uint32) << 16).view(F32)


def dense(data, fmt: str):
    """A Weight's array (or a slice of it) in f32."""
    if fmt == "bf16":
        return bf16_to_f32(data)
    return data if data.dtype == F32 else data.astype(F32)


def linear(x, w: Weight):  # x (T, in), w (out, in) -> (T, out)
    # bf16/f16 widen the whole matrix per call (a transient f32 copy): correct, not yet fast.
    if w.format in QUANTIZED:  # fp8 / nvfp4 (MoE experts call this op directly)
        from . import gemv

        return getattr(gemv, f"linear_{w.format}")(x, w)
    return cp.matmul(x, dense(w.data, w.format).T)


def embedding(ids, w: Weight):  # ids list[int] (T,) -> (T, H)
    if w.format in QUANTIZED:
        from . import gemv

        return getattr(gemv, f"embedding_{w.format}")(ids, w)
    idx = cp.asarray(np.asarray(ids, dtype=np.int64))
    return dense(w.data[idx], w.format)


# -- elementwise and norms ---------------------------------------------------------------------------------
def rms_norm(x, w, eps: float, offset: float = 0.0):  # x (..., D), w (D,) or None
    y = x * (1.0 / cp.sqrt(cp.mean(x * x, axis=-1, keepdims=True) + F32(eps)))
    return y if w is None else y * (w + F32(offset)) if offset else y * w


def rms_norm_gated(x, gate, w, eps: float):
    return rms_norm(x, w, eps) * silu(gate)


def l2norm(x, eps: float = 1e-6):
    return x / cp.sqrt(cp.sum(x * x, axis=-1, keepdims=True) + F32(eps))


def sigmoid(x):
    return 0.5 * (cp.tanh(0.5 * x) + 1.0)


def silu(x):
    return x * sigmoid(x)


def softplus(x):
    return cp.logaddexp(F32(0), x).astype(F32, copy=False)


def exp(x):
    return cp.exp(x)


def silu_mul(gate, up):
    return silu(gate) * up


def gelu_tanh_mul(gate, up):
    g = 0.5 * gate * (1.0 + cp.tanh(F32(0.7978845608028654) * (gate + F32(0.044715) * (gate * gate * gate))))
    return g * up


def softcap(x, cap: float):
    return cp.tanh(x / F32(cap)) * F32(cap)


# -- rotary embeddings -------------------------------------------------------------------------------------
def rope_tables(positions, inv_freq, mrope_section=None, interleaved=False):
    """cos/sin (T, rot). Built on the host exactly as the CPU backend builds them (a few KB), then uploaded:
    the tables then agree bit for bit, and positions arrive as host lists anyway."""
    pos = np.asarray(positions, dtype=np.float32)
    inv = np.asarray(inv_freq, dtype=np.float32)
    freqs = pos[:, None] * inv[None, :] if pos.ndim == 1 else _mrope_freqs(pos, inv, mrope_section, interleaved)
    emb = np.concatenate([freqs, freqs], axis=-1)
    return cp.asarray(np.cos(emb)), cp.asarray(np.sin(emb))


def _mrope_freqs(pos, inv, section, interleaved):
    per_axis = pos[:, :, None] * inv[None, None, :]  # (3, T, rot/2)
    out = per_axis[0].copy()
    if interleaved:  # frequency i takes axis i % 3 while that axis' section lasts
        for axis in (1, 2):
            idx = np.arange(axis, section[axis] * 3, 3)
            out[:, idx] = per_axis[axis][:, idx]
        return out
    start = 0
    for axis, n in enumerate(section):
        out[:, start:start + n] = per_axis[axis][:, start:start + n]
        start += n
    return out


def apply_rope(x, cos, sin):  # x (T, heads, D); cos/sin (T, rot), rotate-half pairing on dims [:rot]
    rot = cos.shape[-1]
    xr, rest = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = cp.concatenate([-xr[..., half:], xr[..., :half]], axis=-1)
    out = xr * cos[:, None, :] + rotated * sin[:, None, :]
    return cp.concatenate([out, rest], axis=-1) if rest.shape[-1] else out


# -- mixture of experts ------------------------------------------------------------------------------------
def moe_route(logits, k: int, normalize: bool = True):  # logits (T, E) -> weights (T, k) f32, ids (T, k) int64
    z = logits - logits.max(axis=-1, keepdims=True)
    p = cp.exp(z)
    p /= p.sum(axis=-1, keepdims=True)
    ids = cp.argsort(-p, axis=-1)[:, :k]  # CuPy's sort is stable, like the CPU's kind="stable"
    w = cp.take_along_axis(p, ids, axis=-1)
    if normalize:
        w = w / w.sum(axis=-1, keepdims=True)
    return w.astype(F32, copy=False), ids


def _groups(ids):
    """Per routed expert e: (e, token rows, slots) — one host sync for the (T, k) ids, then device indices."""
    host = cp.asnumpy(ids).astype(np.int64) if isinstance(ids, cp.ndarray) else np.asarray(ids, np.int64)
    for e in np.unique(host):
        tok, slot = np.nonzero(host == e)
        yield int(e), cp.asarray(tok), cp.asarray(slot)


def moe_experts(x, ids, weights, gate_up, down, act: str = "silu"):
    """x (T, H); ids, weights (T, k); gate_up: per expert (gate, up) Weights (I, H); down: per expert (H, I)."""
    out = cp.zeros_like(x)
    mul = silu_mul if act == "silu" else gelu_tanh_mul
    for e, tok, slot in _groups(ids):
        h = x[tok]
        g, u = gate_up[e]
        y = linear(mul(linear(h, g), linear(h, u)), down[e])
        out[tok] += y * weights[tok, slot][:, None]  # a token picks an expert once: rows are distinct
    return out


def moe_experts_packed(x, ids, weights, gate_up: Weight, down: Weight, act: str = "gelu_tanh"):
    """gate_up (E, 2I, H): each expert's gate rows then up rows; down (E, H, I)."""
    out = cp.zeros_like(x)
    mul = silu_mul if act == "silu" else gelu_tanh_mul
    for e, tok, slot in _groups(ids):
        h = x[tok]
        gu = cp.matmul(h, dense(gate_up.data[e], gate_up.format).T)  # (n, 2I)
        half = gu.shape[-1] // 2
        y = cp.matmul(mul(gu[:, :half], gu[:, half:]), dense(down.data[e], down.format).T)
        out[tok] += y * weights[tok, slot][:, None]
    return out


def gather(table, ids):  # table (N, ...), ids int (...) -> table[ids]
    idx = ids.astype(cp.int64, copy=False) if isinstance(ids, cp.ndarray) else cp.asarray(np.asarray(ids, np.int64))
    return table[idx]


__all__ = [
    "apply_rope", "attention", "attention_shared", "causal_conv1d", "conv_state", "delta_state", "embedding", "exp",
    "gated_delta_rule", "gather", "gelu_tanh_mul", "kv_cache", "l2norm", "linear", "moe_experts",
    "moe_experts_packed", "moe_route", "rms_norm", "rms_norm_gated", "rope_tables", "sigmoid", "silu", "silu_mul",
    "sliding_kv_cache", "softcap", "softplus",
]
