"""The CUDA implementation of the op contract (lumen_core.ops.CONTRACT) on CuPy, f32 compute.

Each op mirrors lumen_cpu's op of the same name step by step, so the two agree to f32 rounding. This module is
the top of the compute modules: it routes each op to the hand-written kernels (gemv, moe, decode, gdn_prefill,
flash through attention) or to the CuPy reference ops (cupy_ops), and imports them; none of them imports it.

Ops do not know their backend (one registration serves every device): what belongs to a model is found on its
Weights (lumen_cuda.state), the decode step being captured through lumen_cuda.step. The one exception is streamed
experts, whose VRAM cache belongs to the backend instance: ``moe_experts`` / ``moe_experts_packed`` take it as
``backend=`` (lumen_cuda/__init__.py binds it for each backend's op set).
"""

from __future__ import annotations

import sys

import cupy as cp
import numpy as np

from lumen_core.backend import Weight

from . import attention as _attention
from . import decode, gdn_prefill, gemv, kernels, moe, step
from . import delta as _delta
from .cupy_ops import (  # noqa: F401 (ops, and names the tests read)
    F32,
    bf16_to_f32,
    dense,
    gdn_gates,
    gelu_tanh_mul,
    mul_silu,
    sigmoid,
    silu,
    silu_mul,
    softplus,
)
from .cupy_ops import rms_norm as _rms_norm_cupy
from .delta import conv_state, delta_state
from .step import device_ids, device_pos, require_host
from .vision_ops import bidirectional_attention, clamp, concat, gelu, gelu_tanh, layer_norm  # noqa: F401 (ops)

QUANTIZED = ("fp8", "nvfp4")  # formats whose linear / embedding live in gemv.py (a scale beside the data)
# the CuPy references of the MoE ops (host syncs: not capturable), kept under their ops names
moe_route_cupy = moe.route_cupy
moe_experts_grouped = moe.experts_grouped
moe_experts_packed_grouped = moe.experts_packed_grouped


# -- weights -----------------------------------------------------------------------------------------------
def linear(x, w: Weight):  # x (T, in), w (out, in) -> (T, out)
    return gemv.linear(x, w)  # fp8 / nvfp4: their launchers; dense formats: cuBLAS on the f32 matrix


def embedding(ids, w: Weight):  # ids list[int] (T,) -> (T, H)
    if w.format in QUANTIZED:
        return getattr(gemv, f"embedding_{w.format}")(ids, w)
    return dense(w.data[device_ids(ids)], w.format)


# -- elementwise and norms ---------------------------------------------------------------------------------
def rms_norm(x, w, eps: float, offset: float = 0.0):  # x (..., D), w (D,) or None
    return _rms_norm_cupy(x, w, eps, offset)


def rms_norm_gated(x, gate, w, eps: float):
    if kernels.decode_fusion():
        return gemv.rms_norm_gated(x, gate, w, eps)  # one kernel: the norm and the gate
    return mul_silu(gemv.rms_norm(x, w, eps), gate)  # the fused RMSNorm kernel, then one elementwise kernel


def l2norm(x, eps: float = 1e-6):
    return x / cp.sqrt(cp.sum(x * x, axis=-1, keepdims=True) + F32(eps))


def exp(x):
    return cp.exp(x)


def softcap(x, cap: float):
    return cp.tanh(x / F32(cap)) * F32(cap)


# -- rotary embeddings -------------------------------------------------------------------------------------
def rope_tables(positions, inv_freq, mrope_section=None, interleaved=False):
    """cos/sin (T, rot) in one launch from the positions and frequencies (a few KB uploaded): each angle is the
    CPU backend's f32 product (position × inverse frequency, the M-RoPE axis per frequency as the CPU picks it), its
    cos / sin within 2 ulp of the CPU's (CUDA's cosf / sinf against numpy's); the host no longer computes T × rot
    of them while the GPU waits. In a captured decode step (lumen_cuda.step) the position comes from the step."""
    pos = np.asarray(positions, dtype=np.float32)
    current = step.current()
    if current is not None:
        return _step_rope(current, pos, inv_freq)
    inv = np.asarray(inv_freq, dtype=np.float32).ravel()
    half = inv.shape[0]
    if pos.ndim == 1:
        rows, axes = pos[None], np.zeros(half, np.int32)
    else:  # the axis each frequency takes: _mrope_freqs on positions that are their own axis' number
        rows = pos
        axes = _mrope_freqs(np.arange(3, dtype=np.float32)[:, None], np.ones(half, np.float32), mrope_section,
                            interleaved)[0].astype(np.int32)
    T = rows.shape[-1]
    cos, sin = cp.empty((T, 2 * half), F32), cp.empty((T, 2 * half), F32)
    if T and half:
        _rope_kernel(cp.asarray(np.ascontiguousarray(rows)), cp.asarray(axes), cp.asarray(inv), np.int32(T),
                     np.int32(half), cos, sin)
    return cos, sin


def _step_rope(current, pos, inv_freq):
    """cos/sin (1, rot) of the captured step's position. Text positions are equal on every M-RoPE axis, so the
    sections do not matter; the inverse frequencies are uploaded once per step (in the first warm-up, before
    capture) and kept with it (``StepInputs.constants``)."""
    T = current.pos.size
    text = pos.ndim == 1 or (pos.ndim == 2 and (pos == pos[:1]).all())  # M-RoPE text: every axis alike
    if not text or pos.shape[-1] != T:
        raise step.NotCapturable(f"a captured step of {T} token(s) takes {T} text position(s), not {pos.shape}")
    key = ("rope", tuple(float(f) for f in np.asarray(inv_freq).ravel()))
    inv = current.constants.get(key)
    if inv is None:
        inv = current.constants[key] = cp.asarray(np.asarray(inv_freq, dtype=np.float32))
    half = inv.shape[0]
    cos, sin = cp.empty((T, 2 * half), F32), cp.empty((T, 2 * half), F32)
    _step_rope_kernel(current.pos, inv, np.int32(half), cos, sin)
    return cos, sin


_step_rope_kernel = cp.ElementwiseKernel(  # row t: the step's position pos[t]
    "raw int32 pos, raw float32 inv, int32 half", "float32 c, float32 s",
    "const float f = (float)pos[i / (2 * half)] * inv[i % half]; c = cosf(f); s = sinf(f)", "lumen_step_rope")
_rope_kernel = cp.ElementwiseKernel(  # element (t, j) of (T, 2 half): frequency j % half on its axis' position
    "raw float32 pos, raw int32 axes, raw float32 inv, int32 T, int32 half", "float32 c, float32 s",
    "const int t = i / (2 * half), j = i % half; const float f = pos[axes[j] * T + t] * inv[j]; "
    "c = cosf(f); s = sinf(f)", "lumen_rope_tables")
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
def kv_cache(context: int, kv_heads: int, head_dim: int, type_k: str = "f32", type_v: str | None = None,
             head_dim_v: int | None = None, backend=None):
    """A full KV cache; made under ``backend`` configured for fp8 attention, its several-token attention runs in
    FP8 MMA (attention.KVCache.fp8_attention)."""
    return _attention.kv_cache(context, kv_heads, head_dim, type_k, type_v, head_dim_v,
                               fp8_attention=getattr(backend, "fp8_attention", False))


def sliding_kv_cache(window: int, kv_heads: int, head_dim: int, type_k: str = "f32", type_v: str | None = None,
                     head_dim_v: int | None = None, backend=None):
    """A sliding-window ring KV cache, as ``kv_cache``."""
    return _attention.sliding_kv_cache(window, kv_heads, head_dim, type_k, type_v, head_dim_v,
                                       fp8_attention=getattr(backend, "fp8_attention", False))


def attention(q, k, v, cache, start: int, scale: float, window: int | None = None, softcap: float | None = None,
              blocks=None):
    """q (T, Hq, D), k (T, Hkv, D), v (T, Hkv, Dv) at start.. -> (T, Hq, Dv); writes k, v to the cache first.
    One token: the decode kernel (position from device memory, full or ring cache); otherwise the CuPy op.
    ``blocks`` (an image's tokens that see each other, Gemma): the CuPy path with that mask."""
    if q.shape[0] == 1 and not blocks:
        out = _decode_attention(q, k, v, cache, start, scale, window, softcap)
        if out is not None:
            return out
    current = step.current()
    if current is not None and q.shape[0] == current.pos.size and not blocks:
        # a captured speculative verify (lumen_cuda.verify): a full cache takes the T rows first and every token
        # attends up to its own position in one launch; a ring token by token through the decode kernel (each
        # writing its row at pos[t] and attending up to it: a later row may take a slot an earlier token reads)
        try:
            if isinstance(cache, _attention.KVCache):
                return decode.attention_verify(q, k, v, cache, current.pos, scale, window, softcap)
            return cp.concatenate([decode.attention_decode(q[t:t + 1], k[t:t + 1], v[t:t + 1], cache,
                                                           current.pos[t:t + 1], scale, window, softcap)
                                   for t in range(q.shape[0])])
        except ValueError as exc:
            raise step.NotCapturable(f"this attention ({exc})") from None
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
    try:
        return decode.attention_decode(q, k, v, cache, device_pos(start), scale, window, softcap)
    except ValueError as exc:
        require_host(f"this attention ({exc})")
        return None


def gated_delta_rule(q, k, v, g, beta, state):
    """One token: the fused recurrent step (lumen_cuda.decode); more: the two-launch chunked kernels
    (lumen_cuda.gdn_prefill), or the CuPy op where those refuse the shapes."""
    if q.shape[0] == 1:
        return decode.gated_delta_step(q, k, v, g, beta, state)
    try:
        return gdn_prefill.gated_delta_chunked(q, k, v, g, beta, state)
    except ValueError:
        return _delta.gated_delta_rule(q, k, v, g, beta, state)


def gated_delta_rule_gates(q, k, v, a, b, neg_a, dt_bias, state):
    """``ops.gated_delta_rule_gates``: one token, the step kernel computing the gates itself; more: the gates, then
    ``gated_delta_rule``."""
    if q.shape[0] == 1 and kernels.decode_fusion():
        return decode.gated_delta_step(q, k, v, a, b, state, gates=(neg_a, dt_bias))
    g, beta = gdn_gates(a, b, neg_a, dt_bias)
    return gated_delta_rule(q, k, v, g, beta, state)


def gated_delta_net(qkv, conv_w, conv_state, a, b, neg_a, dt_bias, delta_state, z, norm_w, eps: float, dims):
    """``ops.gated_delta_net``: with LUMEN_CUDA_GDN_DECODE=1 a one-token call is one kernel
    (``decode.gated_delta_net_step``: conv, step and gated norm); otherwise, and where that kernel does not apply,
    lumen_core's composite over this module's ops (``causal_conv1d``, ``gated_delta_rule_gates``,
    ``rms_norm_gated``): the same numbers either way."""
    from lumen_core.ops import COMPOSITES

    if qkv.shape[0] == 1 and kernels.decode_fusion() and decode.gdn_decode():
        y = decode.gated_delta_net_step(qkv, conv_w, conv_state, a, b, neg_a, dt_bias, delta_state, z, norm_w, eps,
                                        dims)
        if y is not None:
            return y
    return COMPOSITES["gated_delta_net"](sys.modules[__name__], qkv, conv_w, conv_state, a, b, neg_a, dt_bias,
                                         delta_state, z, norm_w, eps, dims)


def causal_conv1d(x, w, state):
    """One token: the fused step; more: the prefill kernel (lumen_cuda.decode), or the CuPy op where it refuses."""
    if x.shape[0] == 1:
        return decode.causal_conv1d_step(x, w, state)
    try:
        return decode.causal_conv1d_prefill(x, w, state)
    except ValueError:
        return _delta.causal_conv1d(x, w, state)


def causal_conv1d_kept(x, w, state):
    """A speculative verify's conv over T tokens in one launch, the state after each kept (lumen_cuda.decode)."""
    return decode.causal_conv1d_kept(x, w, state)


def gated_delta_rule_kept(q, k, v, g, beta, state):
    """A speculative verify's recurrence over T tokens in one launch, the state after each kept."""
    return decode.gated_delta_rule_kept(q, k, v, g, beta, state)


# -- mixture of experts ------------------------------------------------------------------------------------
def moe_route(logits, k: int, normalize: bool = True):  # logits (T, E) -> weights (T, k) f32, ids (T, k) int64
    return moe.route(logits, k, normalize)


def moe_experts(x, ids, weights, gate_up, down, act: str = "silu", backend=None):
    """x (T, H); ids, weights (T, k); gate_up: per expert (gate, up) Weights (I, H); down: per expert (H, I).
    The device kernels of lumen_cuda.moe for any T (no host sync); they fall back to ``moe_experts_grouped``.
    Experts kept in host RAM (store 'ram') stream through ``backend``'s expert cache (lumen_cuda.stream)."""
    if len(gate_up) and gate_up[0][0].store == "ram":
        return _streamed(backend, x, ids, weights, gate_up, down, act, False)
    return moe.experts(x, ids, weights, gate_up, down, act)


def moe_shared(x, logits, shared_logit, k: int, gate_up, down, normalize: bool = True, act: str = "silu",
               backend=None):
    """``ops.moe_shared``: the shared expert (the lists' last item) as one more slot of the routed experts'
    kernels. The routing kernel writes k + 1 columns (the last: id E, weight sigmoid(shared_logit)) and
    ``moe.experts`` runs the E + 1 experts' table: at T = 1 two launches for routed and shared experts together,
    where the composite adds a gate/up product, the activation, the down product, the sigmoid, a product and a
    sum. Where the table cannot hold the shared expert with the routed ones (another format or shape, experts in
    host RAM) or with LUMEN_CUDA_DECODE_FUSION=0, the composite of lumen_core.ops, over ``backend``'s ops. With
    LUMEN_CUDA_ROUTE_IN_EXPERTS=1 a one-token call routes inside the gate/up kernel (``moe.experts_routed``): the
    same ids and weights, one launch fewer."""
    from lumen_core.ops import COMPOSITES

    E = len(gate_up) - 1
    fused = (kernels.decode_fusion() and E >= 1 and len(down) == E + 1 and act in moe.ACTS and isinstance(x, cp.ndarray)
             and not any(w.store == "ram" for w in (gate_up[0][0], gate_up[E][0], down[E]))
             and moe.fits_one_table(gate_up, down))
    if not fused:
        return COMPOSITES["moe_shared"](backend.ops, x, logits, shared_logit, k, gate_up, down, normalize, act)
    if moe.route_in_experts():  # one token: the gate/up kernel routes (one launch fewer), where it applies
        y = moe.experts_routed(x, logits, shared_logit, k, gate_up, down, act, normalize)
        if y is not None:
            return y
    weights, ids = moe.route(logits, k, normalize, shared=shared_logit)
    return moe.experts(x, ids, weights, gate_up, down, act)


def moe_experts_packed(x, ids, weights, gate_up: Weight, down: Weight, act: str = "gelu_tanh", backend=None):
    """gate_up (E, 2I, H): each expert's gate rows then up rows; down (E, H, I). lumen_cuda.moe's kernels; store
    'ram': streamed, as ``moe_experts``."""
    if gate_up.store == "ram":
        return _streamed(backend, x, ids, weights, gate_up, down, act, True)
    return moe.experts_packed(x, ids, weights, gate_up, down, act)


def _streamed(backend, x, ids, weights, gate_up, down, act, packed):
    from . import stream

    streams = getattr(backend, "expert_streams", None)
    if streams is None:
        raise ValueError("routed experts in host RAM (store 'ram') stream through their CUDA backend's expert cache: "
                         "call them through that backend's ops (backend.ops.moe_experts), not the bare function")
    return stream.experts(streams, x, ids, weights, gate_up, down, act, packed=packed)


def gather(table, ids):  # table (N, ...), ids int (...) -> table[ids]
    idx = ids.astype(cp.int64, copy=False) if isinstance(ids, cp.ndarray) else cp.asarray(np.asarray(ids, np.int64))
    return table[idx]


__all__ = [
    "apply_rope", "attention", "attention_shared", "causal_conv1d", "conv_state", "delta_state", "embedding", "exp",
    "gated_delta_rule", "gather", "gelu_tanh_mul", "kv_cache", "l2norm", "linear", "moe_experts",
    "moe_experts_packed", "moe_route", "moe_shared", "rms_norm", "rms_norm_gated", "rope_tables", "sigmoid", "silu",
    "silu_mul", "sliding_kv_cache", "softcap", "softplus",
]
