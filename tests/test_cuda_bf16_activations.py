"""``cuda.compute-quantization: bf16`` on the GPU: a cuda backend so configured marks its weights
(``Weight.activations == "bf16"``), and their several-token products then equal the exact products of the
activations rounded to bf16 (nearest even): the dense bf16 GEMM (one cuBLAS product where exact runs two), fp8 and
NVFP4 through ``gemm_split`` (two where exact runs three) or the tensor-core x3 kernels with one plane
(``LUMEN_CUDA_MMA_PREFILL=exact``), and the routed experts' x3 kernels (fp8, NVFP4, bf16 tables, packed bf16), whose
h is rounded too. Each result also differs from the exact path's, so the mode is seen to apply; up to eight tokens
keep the f32 GEMV.

Tolerances (x max(1, max |reference|)): dense 1e-5 (f32 accumulation in another order; gemm_split drops
x_hi (W - W_hi - W_lo), ~2^-17 relative); experts 2e-3 (h is rounded to bf16 from gate / up values that differ from
the reference's by f32 rounding, so a rounding may go the other way: one h value one bf16 step off).
GPU tests carry the ``gpu`` marker and skip without CuPy or a CUDA device.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from gpu_util import close, host
from test_cuda_moe import matrix, routing

from lumen_core.plugins import get_registry

pytest.importorskip("lumen_cuda")


@pytest.fixture(scope="module")
def gpu(cp):
    reg = get_registry()
    backend = reg.backend_class("cuda")("cuda:0", reg)
    backend.configure_compute_quantization("bf16")
    return backend


@pytest.fixture(scope="module")
def exact(cp):
    reg = get_registry()
    return reg.backend_class("cuda")("cuda:0", reg)


def bf16(a):
    """f32 values rounded to bf16 (nearest even) and back."""
    return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def dense(w) -> np.ndarray:
    """The f32 matrix a cuda Weight stands for (host)."""
    from lumen_cuda import gemv

    if w.format == "fp8":
        return host(gemv.dequantize_fp8(w))
    if w.format == "nvfp4":
        return host(gemv.dequantize_nvfp4(w))
    return (host(w.data).astype(np.uint32) << 16).view(np.float32)


def linear(w, x):
    from lumen_cuda import gemv

    return {"bf16": gemv.linear_bf16, "fp8": gemv.linear_fp8, "nvfp4": gemv.linear_nvfp4}[w.format](x, w)


@pytest.mark.gpu
def test_the_configured_backend_marks_its_weights(cp, gpu, exact):
    rng = np.random.default_rng(0)
    for kind in ("bf16", "fp8-block128", "nvfp4"):
        assert matrix(gpu, rng, 32, 64, kind).activations == "bf16"
        assert matrix(exact, rng, 32, 64, kind).activations == "f32"
    with pytest.raises(ValueError, match="int8"):
        exact.configure_compute_quantization("int8")


@pytest.mark.gpu
@pytest.mark.parametrize("mma", ["", "exact"])
@pytest.mark.parametrize("kind", ["bf16", "fp8-block128", "nvfp4"])
@pytest.mark.parametrize("T", [9, 37, 130])  # above gemv.MAX_T: the GEMMs
def test_dense_products_take_the_activations_rounded_to_bf16(cp, gpu, monkeypatch, kind, T, mma):
    from lumen_cuda import gemv

    assert T > gemv.MAX_T
    monkeypatch.setenv("LUMEN_CUDA_MMA_PREFILL", mma)
    rng = np.random.default_rng(T + len(kind) + len(mma))
    N, K = 256, 384
    w = matrix(gpu, rng, N, K, kind)
    x = rng.normal(size=(T, K)).astype(np.float32)
    y = linear(w, cp.asarray(x))
    W = dense(w).astype(np.float64)
    close(y, bf16(x).astype(np.float64) @ W.T, 1e-5)
    w.activations = "f32"
    exact_y = host(linear(w, cp.asarray(x)))
    close(exact_y, x.astype(np.float64) @ W.T, 1e-5)
    assert np.abs(host(y) - exact_y).max() > 1e-4 * np.abs(exact_y).max()  # the mode applied


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["bf16", "fp8-block128", "nvfp4"])
@pytest.mark.parametrize("T", [1, 5, 8])
def test_up_to_eight_tokens_keep_the_f32_gemv(cp, gpu, kind, T):
    """Decode and short verifies (T <= gemv.MAX_T, aligned weights) run the GEMV on f32 activations: the mode does
    not touch them (found on the GPU: the first version of the test above expected bf16 at T = 5)."""
    rng = np.random.default_rng(T + len(kind))
    w = matrix(gpu, rng, 256, 384, kind)
    x = rng.normal(size=(T, 384)).astype(np.float32)
    y = host(linear(w, cp.asarray(x)))
    close(y, x.astype(np.float64) @ dense(w).astype(np.float64).T, 1e-5)
    w.activations = "f32"
    assert np.array_equal(y, host(linear(w, cp.asarray(x))))


def experts_reference(x, ids, w, gates, ups, downs, act: str) -> np.ndarray:
    """Host f64 routed experts with x and h rounded to bf16 (h from the f32 act(g) * u)."""
    xr = bf16(x).astype(np.float64)
    y = np.zeros((x.shape[0], downs[0].shape[0]))
    for t in range(x.shape[0]):
        for e, wt in zip(ids[t], w[t], strict=True):
            g, u = xr[t] @ gates[e].T, xr[t] @ ups[e].T
            a = g / (1 + np.exp(-g)) if act == "silu" else 0.5 * g * (1 + np.tanh(0.7978845608028654 *
                                                                                     (g + 0.044715 * g ** 3)))
            y[t] += wt * (bf16(a * u).astype(np.float64) @ downs[e].T)
    return y


@pytest.mark.gpu
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("kind", ["bf16", "fp8-block128", "nvfp4", "packed"])
def test_routed_experts_take_the_activations_rounded_to_bf16(cp, gpu, monkeypatch, kind, act):
    from lumen_cuda import fp8_mma, moe

    if not fp8_mma.exact_experts("bf16", (128, 256), (256, 128)):
        pytest.fail("the routed experts' tensor-core kernels do not apply on this device")
    monkeypatch.delenv("LUMEN_CUDA_MMA_PREFILL", raising=False)
    rng = np.random.default_rng(len(kind) + len(act))
    E, k, H, I, T = 16, 4, 256, 128, 64
    if kind == "packed":
        gu = gpu.weight((rng.normal(size=(E, 2 * I, H)) * 0.05).astype(ml_dtypes.bfloat16), "bf16", "vram")
        dn = gpu.weight((rng.normal(size=(E, H, I)) * 0.05).astype(ml_dtypes.bfloat16), "bf16", "vram")
        both = (host(gu.data).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        gates, ups = both[:, :I], both[:, I:]
        downs = (host(dn.data).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        run = lambda x, ids, w: moe.experts_packed(x, ids, w, gu, dn, act)  # noqa: E731
        mark = lambda a: [setattr(m, "activations", a) for m in (gu, dn)]  # noqa: E731
    else:
        gate_up = [(matrix(gpu, rng, I, H, kind), matrix(gpu, rng, I, H, kind)) for _ in range(E)]
        down = [matrix(gpu, rng, H, I, kind) for _ in range(E)]
        gates = [dense(g).astype(np.float64) for g, _ in gate_up]
        ups = [dense(u).astype(np.float64) for _, u in gate_up]
        downs = [dense(d).astype(np.float64) for d in down]
        run = lambda x, ids, w: moe.experts(x, ids, w, gate_up, down, act)  # noqa: E731
        mark = lambda a: [setattr(m, "activations", a) for pair in gate_up for m in pair] + [  # noqa: E731
            setattr(m, "activations", a) for m in down]
    x = rng.normal(size=(T, H)).astype(np.float32)
    ids, w = routing(cp, rng, E, k, np.int64, T)
    y = host(run(cp.asarray(x), ids, w))
    close(y, experts_reference(x, host(ids), host(w), gates, ups, downs, act), 2e-3)
    mark("f32")
    exact_y = host(run(cp.asarray(x), ids, w))
    assert np.abs(y - exact_y).max() > 1e-4 * np.abs(exact_y).max()  # the mode applied
