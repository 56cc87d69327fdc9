"""The CUDA implementation of the op contract (lumen_core.ops.CONTRACT) on CuPy, f32 compute.

Each op mirrors lumen_cpu's op of the same name step by step, so the two agree to f32 rounding; GEMMs go to
cuBLAS through ``cupy.matmul`` (CuPy leaves TF32 off unless CUPY_TF32=1, so f32 stays f32). No hand-written
kernels yet: this is the correct baseline the kernels will be checked against.
"""

from __future__ import annotations

import cupy as cp
import numpy as np

from lumen_core.backend import Weight

from . import attention as _attention
from . import delta as _delta
from . import graph
from .attention import kv_cache, sliding_kv_cache
from .delta import conv_state, delta_state
from .graph import device_ids, device_pos, require_host
from .vision_ops import bidirectional_attention, clamp, concat, gelu, gelu_tanh, layer_norm  # noqa: F401 (ops)

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
    return dense(w.data[device_ids(ids)], w.format)


# -- elementwise and norms ---------------------------------------------------------------------------------
def rms_norm(x, w, eps: float, offset: float = 0.0):  # x (..., D), w (D,) or None
    y = x * (1.0 / cp.sqrt(cp.mean(x * x, axis=-1, keepdims=True) + F32(eps)))
    return y if w is None else y * (w + F32(offset)) if offset else y * w


def rms_norm_gated(x, gate, w, eps: float):
    from . import gemv  # the fused RMSNorm kernel, then one elementwise kernel for the gate

    return _mul_silu(gemv.rms_norm(x, w, eps), gate)


def l2norm(x, eps: float = 1e-6):
    return x / cp.sqrt(cp.sum(x * x, axis=-1, keepdims=True) + F32(eps))


# One elementwise kernel each (CuPy would launch one per arithmetic step): the decode step is launch-bound.
# Same formulas, in f32, as the CPU backend (sigmoid through tanh, softplus as logaddexp(0, x)).
_SIGMOID = "0.5f * (tanhf(0.5f * x) + 1.0f)"
_sigmoid = cp.ElementwiseKernel("float32 x", "float32 y", f"y = {_SIGMOID}", "lumen_sigmoid")
_silu = cp.ElementwiseKernel("float32 x", "float32 y", f"y = x * ({_SIGMOID})", "lumen_silu")
_silu_mul = cp.ElementwiseKernel("float32 x, float32 u", "float32 y", f"y = x * ({_SIGMOID}) * u",
                                 "lumen_silu_mul")
_mul_silu = cp.ElementwiseKernel("float32 u, float32 x", "float32 y", f"y = u * (x * ({_SIGMOID}))",
                                 "lumen_mul_silu")
_softplus = cp.ElementwiseKernel("float32 x", "float32 y", "y = fmaxf(x, 0.0f) + log1pf(expf(-fabsf(x)))",
                                 "lumen_softplus")
_gelu_tanh_mul = cp.ElementwiseKernel(
    "float32 g, float32 u", "float32 y",
    "y = 0.5f * g * (1.0f + tanhf(0.7978845608028654f * (g + 0.044715f * (g * g * g)))) * u", "lumen_gelu_tanh_mul")


_gdn_gates = cp.ElementwiseKernel(
    "float32 a, float32 b, float32 neg_a, float32 dt_bias", "float32 g, float32 beta",
    "const float t = a + dt_bias; g = neg_a * (fmaxf(t, 0.0f) + log1pf(expf(-fabsf(t)))); "
    "beta = 0.5f * (tanhf(0.5f * b) + 1.0f)", "lumen_gdn_gates")


def _f32(x):
    return x if x.dtype == F32 else x.astype(F32)


def gdn_gates(a, b, neg_a, dt_bias):  # (T, Hv) x2, (Hv,) x2 -> g = neg_a * softplus(a + dt_bias), sigmoid(b)
    return _gdn_gates(_f32(a), _f32(b), _f32(neg_a), _f32(dt_bias))


def sigmoid(x):
    return _sigmoid(_f32(x))


def silu(x):
    return _silu(_f32(x))


def softplus(x):
    return _softplus(_f32(x))


def exp(x):
    return cp.exp(x)


def silu_mul(gate, up):
    return _silu_mul(_f32(gate), _f32(up))


def gelu_tanh_mul(gate, up):
    return _gelu_tanh_mul(_f32(gate), _f32(up))


def softcap(x, cap: float):
    return cp.tanh(x / F32(cap)) * F32(cap)


# -- rotary embeddings -------------------------------------------------------------------------------------
def rope_tables(positions, inv_freq, mrope_section=None, interleaved=False):
    """cos/sin (T, rot). Built on the host exactly as the CPU backend builds them (a few KB), then uploaded:
    the tables then agree bit for bit, and positions arrive as host lists anyway. In a captured decode step
    (graph.STEP) they are computed on the device from the step's position instead."""
    pos = np.asarray(positions, dtype=np.float32)
    if graph.STEP is not None:
        return _step_rope(pos, inv_freq)
    inv = np.asarray(inv_freq, dtype=np.float32)
    freqs = pos[:, None] * inv[None, :] if pos.ndim == 1 else _mrope_freqs(pos, inv, mrope_section, interleaved)
    emb = np.concatenate([freqs, freqs], axis=-1)
    return cp.asarray(np.cos(emb)), cp.asarray(np.sin(emb))


_INV: dict[tuple, cp.ndarray] = {}


def _step_rope(pos, inv_freq):
    """cos/sin (1, rot) of the captured step's position. Text positions are equal on every M-RoPE axis, so the
    sections do not matter; the inverse frequencies are uploaded once (in the warm-up, before capture)."""
    if pos.size != 1 and not (pos.ndim == 2 and pos.shape[1] == 1 and (pos == pos[0, 0]).all()):
        raise graph.NotCapturable(f"a captured decode step takes one text position, not {pos.shape}")
    key = (cp.cuda.runtime.getDevice(), tuple(float(f) for f in np.asarray(inv_freq).ravel()))
    inv = _INV.get(key)
    if inv is None:
        inv = _INV[key] = cp.asarray(np.asarray(inv_freq, dtype=np.float32))
    half = inv.shape[0]
    cos, sin = cp.empty((1, 2 * half), F32), cp.empty((1, 2 * half), F32)
    _step_rope_kernel(graph.STEP.pos, inv, np.int32(half), cos, sin)
    return cos, sin


_step_rope_kernel = cp.ElementwiseKernel(
    "raw int32 pos, raw float32 inv, int32 half", "float32 c, float32 s",
    "const float f = (float)pos[0] * inv[i % half]; c = cosf(f); s = sinf(f)", "lumen_step_rope")
_apply_rope = cp.ElementwiseKernel(
    "raw float32 x, raw float32 cos, raw float32 sin, int32 H, int32 D, int32 rot", "float32 y",
    """
    const int d = i % D, t = i / (H * D);
    if (d < rot) {
      const int half = rot / 2;
      const float r = d < half ? -x[i + half] : x[i - half];
      y = x[i] * cos[t * rot + d] + r * sin[t * rot + d];
    } else {
      y = x[i];
    }
    """, "lumen_apply_rope")


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
    """One kernel: y = x * cos + rotate_half(x) * sin on the first rot dims, the rest copied."""
    T, H, D = x.shape
    rot = cos.shape[-1]
    if x.dtype == F32 and cos.dtype == F32 and sin.dtype == F32 and cos.shape == (T, rot) and rot % 2 == 0:
        y = cp.empty((T, H, D), F32)
        _apply_rope(cp.ascontiguousarray(x), cp.ascontiguousarray(cos), cp.ascontiguousarray(sin), np.int32(H),
                    np.int32(D), np.int32(rot), y)
        return y
    return _apply_rope_cupy(x, cos, sin)


def _apply_rope_cupy(x, cos, sin):
    rot = cos.shape[-1]
    xr, rest = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = cp.concatenate([-xr[..., half:], xr[..., :half]], axis=-1)
    out = xr * cos[:, None, :] + rotated * sin[:, None, :]
    return cp.concatenate([out, rest], axis=-1) if rest.shape[-1] else out


# -- attention and Gated-DeltaNet: one-token decode through the kernels of lumen_cuda.decode ------------------
def attention(q, k, v, cache, start: int, scale: float, window: int | None = None, softcap: float | None = None,
              blocks=None):
    """q (T, Hq, D), k (T, Hkv, D), v (T, Hkv, Dv) at start.. -> (T, Hq, Dv); writes k, v to the cache first.
    One token: the decode kernel (position from device memory, full or ring cache); otherwise the CuPy op.
    ``blocks`` (an image's tokens that see each other, Gemma): the CuPy path with that mask."""
    if q.shape[0] == 1 and not blocks:
        out = _decode_attention(q, k, v, cache, start, scale, window, softcap)
        if out is not None:
            return out
    require_host("attention over several tokens")
    return _attention.attention(q, k, v, cache, start, scale, window, softcap, blocks)


def attention_shared(q, cache, start: int, scale: float, window: int | None = None, softcap: float | None = None,
                     blocks=None):
    """Attention over keys another layer wrote (KV sharing); one token reads that layer's cache directly."""
    if q.shape[0] == 1 and not blocks:
        out = _decode_attention(q, None, None, cache, start, scale, window, softcap)
        if out is not None:
            return out
    require_host("attention over another layer's KV cache for several tokens")
    return _attention.attention_shared(q, cache, start, scale, window, softcap, blocks)


def _decode_attention(q, k, v, cache, start, scale, window, softcap):
    """lumen_cuda.decode.attention_decode, or None where it does not apply (outside a captured step only)."""
    from . import decode

    try:
        return decode.attention_decode(q, k, v, cache, device_pos(start), scale, window, softcap)
    except ValueError as exc:
        require_host(f"this attention ({exc})")
        return None


def gated_delta_rule(q, k, v, g, beta, state):
    """One token: the fused recurrent step (lumen_cuda.decode); more: the two-launch chunked kernels
    (lumen_cuda.gdn_prefill), or the CuPy op where those refuse the shapes."""
    if q.shape[0] == 1:
        from . import decode

        return decode.gated_delta_step(q, k, v, g, beta, state)
    from . import gdn_prefill

    try:
        return gdn_prefill.gated_delta_chunked(q, k, v, g, beta, state)
    except ValueError:
        return _delta.gated_delta_rule(q, k, v, g, beta, state)


def causal_conv1d(x, w, state):
    if x.shape[0] == 1:
        from . import decode

        return decode.causal_conv1d_step(x, w, state)
    return _delta.causal_conv1d(x, w, state)


# -- mixture of experts ------------------------------------------------------------------------------------
def moe_route(logits, k: int, normalize: bool = True):  # logits (T, E) -> weights (T, k) f32, ids (T, k) int64
    from . import moe

    return moe.route(logits, k, normalize)


def moe_route_cupy(logits, k: int, normalize: bool = True):
    """The CuPy reference of ``moe_route`` (argsort: not capturable)."""
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
    require_host("MoE over several tokens (expert ids grouped on the host)")
    host = cp.asnumpy(ids).astype(np.int64) if isinstance(ids, cp.ndarray) else np.asarray(ids, np.int64)
    for e in np.unique(host):
        tok, slot = np.nonzero(host == e)
        yield int(e), cp.asarray(tok), cp.asarray(slot)


def moe_experts(x, ids, weights, gate_up, down, act: str = "silu"):
    """x (T, H); ids, weights (T, k); gate_up: per expert (gate, up) Weights (I, H); down: per expert (H, I).
    The device kernels of lumen_cuda.moe for any T (no host sync); they fall back to ``moe_experts_grouped``."""
    from . import moe

    return moe.experts(x, ids, weights, gate_up, down, act)


def moe_experts_grouped(x, ids, weights, gate_up, down, act: str = "silu"):
    """``moe_experts`` by groups of tokens per expert (the ids go to the host once): any T, not capturable."""
    out = cp.zeros_like(x)
    mul = silu_mul if act == "silu" else gelu_tanh_mul
    for e, tok, slot in _groups(ids):
        h = x[tok]
        g, u = gate_up[e]
        y = linear(mul(linear(h, g), linear(h, u)), down[e])
        out[tok] += y * weights[tok, slot][:, None]  # a token picks an expert once: rows are distinct
    return out


def moe_experts_packed(x, ids, weights, gate_up: Weight, down: Weight, act: str = "gelu_tanh"):
    """gate_up (E, 2I, H): each expert's gate rows then up rows; down (E, H, I). lumen_cuda.moe's kernels."""
    from . import moe

    return moe.experts_packed(x, ids, weights, gate_up, down, act)


def moe_experts_packed_grouped(x, ids, weights, gate_up: Weight, down: Weight, act: str = "gelu_tanh"):
    """``moe_experts_packed`` by groups of tokens per expert (host sync): any T, not capturable."""
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
