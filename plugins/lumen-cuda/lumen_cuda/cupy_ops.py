"""The CuPy reference ops the kernel modules fall back to: dense weights in f32, the cuBLAS linear, RMSNorm, and
the elementwise kernels (one launch each). They use nothing else of lumen_cuda, so gemv.py and moe.py can fall
back to them without importing ops.py (which imports those modules: the cycle this module breaks).

Each mirrors lumen_cpu's op of the same name step by step, in f32 (CuPy leaves TF32 off unless CUPY_TF32=1).
"""

from __future__ import annotations

import cupy as cp

F32 = cp.float32


# -- weights -----------------------------------------------------------------------------------------------
def bf16_to_f32(bits):
    """uint16 bf16 bits (any shape) -> f32: the bits are the high half of an f32."""
    return (bits.astype(cp.uint32) << 16).view(F32)


def dense(data, fmt: str):
    """A Weight's array (or a slice of it) in f32."""
    if fmt == "bf16":
        return bf16_to_f32(data)
    return data if data.dtype == F32 else data.astype(F32)


def linear_dense(x, w):  # x (T, in), w (out, in) f32 / f16 / bf16 -> (T, out) through cuBLAS
    # bf16/f16 widen the whole matrix per call (a transient f32 copy): correct, not yet fast.
    return cp.matmul(x, dense(w.data, w.format).T)


def rms_norm(x, w, eps: float, offset: float = 0.0):  # x (..., D), w (D,) or None
    y = x * (1.0 / cp.sqrt(cp.mean(x * x, axis=-1, keepdims=True) + F32(eps)))
    return y if w is None else y * (w + F32(offset)) if offset else y * w


# -- elementwise: one kernel each (CuPy would launch one per arithmetic step; the decode step is launch-bound) ------
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


def f32(x):
    return x if x.dtype == F32 else x.astype(F32)


def gdn_gates(a, b, neg_a, dt_bias):  # (T, Hv) x2, (Hv,) x2 -> g = neg_a * softplus(a + dt_bias), sigmoid(b)
    return _gdn_gates(f32(a), f32(b), f32(neg_a), f32(dt_bias))


def sigmoid(x):
    return _sigmoid(f32(x))


def silu(x):
    return _silu(f32(x))


def softplus(x):
    return _softplus(f32(x))


def silu_mul(gate, up):
    return _silu_mul(f32(gate), f32(up))


def mul_silu(u, x):
    """u * silu(x) (the gate of ``rms_norm_gated``)."""
    return _mul_silu(f32(u), f32(x))


def gelu_tanh_mul(gate, up):
    return _gelu_tanh_mul(f32(gate), f32(up))
