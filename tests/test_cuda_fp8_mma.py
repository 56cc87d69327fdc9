"""The fp8 tensor-core prefill GEMMs (kernels/gemm_fp8.cu, lumen_cuda.fp8_mma; opt-in LUMEN_CUDA_FP8_MMA=exact |
e4m3) on a GPU of capability 8.9 or later (the H200 included), against their numpy model (lumen_cuda.fp8_mma_model;
the model's own checks, CPU only: tests/test_fp8_mma_model.py).

Written in a session without GPU time: these have not run yet (docs/cuda.md). They check that the module has the
e4m3 instructions compiled in; that the e4m3 quantizer's codes and scales and the exact path's planes are
bit-identical to the model's; that each GEMM equals its model within an f32 summation bound (the MMA's internal order
is not specified), at padded and real shapes; and that ``gemv.linear_fp8`` takes a kernel only with the option.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

pytestmark = pytest.mark.gpu
F32 = np.float32


@pytest.fixture(scope="module")
def mma(cp):
    from lumen_cuda import fp8_mma, fp8_mma_model

    if not fp8_mma_model.capable(cp.cuda.Device().compute_capability):
        pytest.skip("needs a GPU of compute capability 8.9 or later (e4m3 MMA)")
    return fp8_mma


def weight(rng, N, K):
    codes = (rng.normal(size=(N, K)) * 0.5).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    return codes, rng.uniform(0.5, 2.0, size=(-(-N // 128), K // 128)).astype(F32) * 0.01


def test_module_has_the_mma(cp, mma):
    assert mma._native(cp.cuda.runtime.getDevice())


@pytest.mark.parametrize("T,K", [(1, 128), (37, 512), (512, 4096)])
def test_quantizer_equals_the_model_bit_for_bit(cp, mma, T, K):
    from lumen_cuda import fp8_mma_model as M

    rng = np.random.default_rng(T + K)
    x = (rng.normal(size=(T, K)) * rng.uniform(1e-3, 1e3, size=(T, 1))).astype(F32)
    x[0, :128] = 0.0
    xq, sx = mma.quantize_x(cp.asarray(x))
    mq, ms = M.quantize_x(x)
    np.testing.assert_array_equal(cp.asnumpy(sx), ms)
    np.testing.assert_array_equal(cp.asnumpy(xq), mq)


@pytest.mark.parametrize("T,N,K", [(5, 130, 256), (70, 260, 384), (64, 128, 128), (512, 4096, 4096)])
def test_exact_gemm_equals_the_model_and_the_f32_product(cp, mma, T, N, K):
    from lumen_cuda import fp8_mma_model as M

    rng = np.random.default_rng(T + N + K + 1)
    x = rng.normal(size=(T, K)).astype(F32)
    codes, scale = weight(rng, N, K)
    xp = mma.x_planes(cp.asarray(x))
    np.testing.assert_array_equal(cp.asnumpy(xp), M.x_planes(x))
    y = cp.asnumpy(mma.gemm_x3(xp, cp.asarray(codes), cp.asarray(scale)))
    want = M.gemm_x3(M.x_planes(x), codes, scale)
    assert y.shape == (T, N) and np.isfinite(y).all()
    assert np.abs(y - want).max() <= 2e-6 * np.abs(want).max()


@pytest.mark.parametrize("T,N,K", [(5, 130, 256), (70, 260, 384), (64, 128, 128), (512, 4096, 4096)])
def test_gemm_equals_the_model(cp, mma, T, N, K):
    from lumen_cuda import fp8_mma_model as M

    rng = np.random.default_rng(T + N + K)
    x = rng.normal(size=(T, K)).astype(F32)
    codes, scale = weight(rng, N, K)
    xq, sx = M.quantize_x(x)
    y = cp.asnumpy(mma.gemm(cp.asarray(xq), cp.asarray(sx), cp.asarray(codes), cp.asarray(scale)))
    want = M.gemm(xq, sx, codes, scale)
    assert y.shape == (T, N) and np.isfinite(y).all()
    assert np.abs(y - want).max() <= 2e-5 * np.abs(want).max()


def test_linear_fp8_takes_a_kernel_only_with_the_option(cp, mma, monkeypatch):
    from lumen_cuda import fp8_mma_model as M
    from lumen_cuda import gemv

    from lumen_core.backend import Weight
    from lumen_core.errors import LumenError

    rng = np.random.default_rng(3)
    T, N, K = 40, 384, 512
    x = rng.normal(size=(T, K)).astype(F32)
    codes, scale = weight(rng, N, K)
    w = Weight(cp.asarray(codes), "fp8", (N, K), cp.asarray(scale), (128, 128))
    monkeypatch.delenv(M.OPTION, raising=False)
    assert mma.mode(w) == ""
    split = cp.asnumpy(gemv.linear_fp8(cp.asarray(x), w))
    f32 = x.astype(np.float64) @ (M.E4M3[codes].astype(np.float64) * np.repeat(np.repeat(scale, 128, 0), 128, 1)).T
    monkeypatch.setenv(M.OPTION, "exact")
    assert mma.mode(w) == "exact"
    exact = cp.asnumpy(gemv.linear_fp8(cp.asarray(x), w))
    assert np.abs(exact - f32).max() <= 2e-6 * np.abs(f32).max()
    assert np.abs(split - f32).max() <= 2e-5 * np.abs(f32).max()
    monkeypatch.setenv(M.OPTION, "e4m3")
    assert mma.mode(w) == "e4m3"
    lossy = cp.asnumpy(gemv.linear_fp8(cp.asarray(x), w))
    want = M.linear(x, codes, scale)
    assert np.abs(lossy - want).max() <= 2e-5 * np.abs(want).max()
    assert np.abs(lossy - f32).max() > 1e-4 * np.abs(f32).max()  # not an exact path
    monkeypatch.setenv(M.OPTION, "bad")
    with pytest.raises(LumenError, match="LUMEN_CUDA_FP8_MMA"):
        gemv.linear_fp8(cp.asarray(x), w)
    monkeypatch.setenv(M.OPTION, "exact")
    assert mma.mode(Weight(w.data, "fp8", (N, K), w.scale, None)) == ""  # other scale layouts: gemm_split
