"""The SM120 native NVFP4 prefill GEMM (kernels/mma_sm120.cu, lumen_cuda.sm120) on a real SM120 GPU.

NEVER RUN: written without an SM120 (RTX 50-series) GPU; every test here skips with "needs an SM120 GPU" elsewhere
(the H200 included). The CPU side (packing, fragment tables, numerics model, selection) is tests/test_sm120_mma.py.
What these check on an SM120 device: the module compiles for sm_<cc>a with the MMA in; the activation quantizer's
planes are bit-identical to the numpy model's; the GEMM equals the model (the MMA's internal summation order is
not specified, so within an f32 bound, not bitwise); ``linear_nvfp4`` takes the native path only with the option.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_sm120_mma import dequantize_weight, nvfp4_weight

from lumen_core.plugins import get_registry

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def sm120():
    try:
        import cupy
    except ImportError:
        pytest.skip("needs an SM120 GPU (CuPy is not installed)")
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception:  # CuPy without a driver or device
        n = 0
    from lumen_cuda import sm120_layout

    if n == 0 or not sm120_layout.native_capability(cupy.cuda.Device().compute_capability):
        pytest.skip("needs an SM120 GPU")
    from lumen_cuda import sm120 as mod

    return mod


SHAPES = [(40, 208, 13), (130, 1040, 37), (4096, 4096, 512), (16, 64, 5)]


def test_the_module_compiles_with_the_mma(sm120):
    import cupy as cp

    flag = cp.zeros(1, dtype=cp.int32)
    sm120._fn("sm120_native")((1,), (32,), (flag,))
    assert int(flag.get()[0]) == 1


@pytest.mark.parametrize("T,K,terms", [(13, 208, 1), (37, 1040, 2), (512, 4096, 3)])
def test_quantizer_planes_equal_the_model_bitwise(sm120, T, K, terms):
    import cupy as cp
    from lumen_cuda import sm120_layout as L

    x = (np.random.default_rng(T).standard_normal((T, K)) * 3).astype(np.float32)
    xq, xs, gx = sm120.quantize_x(cp.asarray(x), terms)
    codes, scales, gxm = L.quantize_x(x, terms)
    mq, ms = L.pack_x(codes, scales)
    np.testing.assert_array_equal(xq.get(), mq)
    np.testing.assert_array_equal(xs.get(), ms)
    np.testing.assert_array_equal(gx.get()[:, :T], gxm)


def test_weight_packing_on_the_device_equals_numpy(sm120):
    import cupy as cp
    from lumen_cuda import sm120_layout as L

    codes, data, block = nvfp4_weight(np.random.default_rng(5), 130, 1040, negative=[(2, 3)])
    wq, ws = L.pack_weight(cp.asarray(data), cp.asarray(block), xp=cp)
    nq, ns = L.pack_weight(data, block)
    np.testing.assert_array_equal(wq.get(), nq)
    np.testing.assert_array_equal(ws.get(), ns)


@pytest.mark.parametrize("N,K,T", SHAPES)
@pytest.mark.parametrize("terms", [1, 2, 3])
def test_gemm_equals_the_numerics_model(sm120, N, K, T, terms):
    import cupy as cp
    from lumen_cuda import sm120_layout as L

    rng = np.random.default_rng(N + T)
    codes, data, block = nvfp4_weight(rng, N, K)
    gw = np.float32(0.0123)
    x = rng.standard_normal((T, K)).astype(np.float32)
    wq, ws = L.pack_weight(data, block)
    qc, qs, gx = L.quantize_x(x, terms)
    want = L.mma_model(wq, ws, gw, *L.pack_x(qc, qs), gx, N, T)
    got = sm120.gemm_nvfp4(cp.asarray(x), cp.asarray(wq), cp.asarray(ws), float(gw), N, terms).get()
    X = L.dequantize_x(qc, qs, gx)
    bound = 2 * (L.padded(K, 64) // 64 + 4) * 2.0**-24 * (np.abs(X) @ np.abs(dequantize_weight(codes, block, gw)).T)
    assert (np.abs(got - want) <= bound + 1e-30).all(), np.abs(got - want).max()


def test_linear_nvfp4_takes_the_native_path_only_with_the_option(sm120, monkeypatch):
    import cupy as cp
    from lumen_cuda import gemv
    from lumen_cuda import sm120_layout as L

    rng = np.random.default_rng(6)
    N, K, T = 256, 512, 64
    codes, data, block = nvfp4_weight(rng, N, K)
    reg = get_registry()
    w = reg.backend_class("cuda")("cuda:0", reg).weight(data, "nvfp4", "vram", scale=(block, np.float32(0.5)))
    x = rng.standard_normal((T, K)).astype(np.float32)
    monkeypatch.delenv(L.OPTION, raising=False)
    generic = gemv.linear_nvfp4(cp.asarray(x), w).get()
    assert np.abs(generic - x @ dequantize_weight(codes, block, 0.5).T).max() < 1e-3
    monkeypatch.setenv(L.OPTION, "2")
    native = gemv.linear_nvfp4(cp.asarray(x), w).get()
    qc, qs, gx = L.quantize_x(x, 2)
    wq, ws = L.pack_weight(data, block)
    want = L.mma_model(wq, ws, 0.5, *L.pack_x(qc, qs), gx, N, T)
    assert np.abs(native - want).max() <= 1e-5 * np.abs(want).max()
    assert not np.array_equal(native, generic)  # the lossy path really ran
