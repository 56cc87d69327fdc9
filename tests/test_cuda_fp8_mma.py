"""The fp8 tensor-core prefill GEMMs (kernels/gemm_fp8.cu, lumen_cuda.fp8_mma; opt-in LUMEN_CUDA_MMA_PREFILL=exact |
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
    assert mma._native()


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
    with pytest.raises(LumenError, match="LUMEN_CUDA_MMA_PREFILL"):
        gemv.linear_fp8(cp.asarray(x), w)
    monkeypatch.setenv(M.OPTION, "exact")
    assert mma.mode(Weight(w.data, "fp8", (N, K), w.scale, None)) == ""  # other scale layouts: gemm_split


@pytest.mark.parametrize("T", [8, 70, 300])
def test_routed_fp8_experts_on_the_tensor_cores_equal_the_grouped_reference(cp, mma, monkeypatch, T):
    """By default (and with LUMEN_CUDA_MMA_PREFILL=exact) moe.experts' grouped path (T >= GROUPED_MIN_T) runs fp8
    experts with 128 x 128 blocks through moe_fp8_x3 (asserted by a spy), equal to the CuPy reference
    (ops.moe_experts_grouped: dequantized f32 matmuls) within f32 rounding, with skewed routing (buckets of T slots)
    and token chunks too; LUMEN_CUDA_MMA_PREFILL=0 keeps the CUDA-core kernels."""
    from gpu_util import close
    from lumen_cuda import fp8_mma, moe, ops
    from test_cuda_moe import experts, routing

    from lumen_core.plugins import get_registry

    reg = get_registry()
    gpu = reg.backend_class("cuda")("cuda:0", reg)
    rng = np.random.default_rng(T)
    E, k, H, I = 16, 4, 256, 384
    gate_up, down = experts(gpu, rng, E, H, I, "fp8-block128")
    calls = []
    real = fp8_mma.moe_role
    monkeypatch.setattr(fp8_mma, "moe_role", lambda *a: calls.append((a[1], a[12])) or real(*a))
    monkeypatch.delenv("LUMEN_CUDA_MMA_PREFILL", raising=False)
    x = cp.asarray(rng.normal(size=(T, H)).astype(np.float32))
    ids, w = routing(cp, rng, E, k, np.int64, T)
    close(moe.experts(x, ids, w, gate_up, down, "silu"), ops.moe_experts_grouped(x, ids, w, gate_up, down, "silu"))
    assert calls == [(0, 2), (0, 1)]  # the default: gate and up in one launch (table rows 0, 1), down
    monkeypatch.setenv("LUMEN_CUDA_MMA_PREFILL", "exact")
    for act in ("silu", "gelu_tanh"):
        calls.clear()
        close(moe.experts(x, ids, w, gate_up, down, act), ops.moe_experts_grouped(x, ids, w, gate_up, down, act))
        assert calls == [(0, 2), (0, 1)]  # gate and up, then down, on the tensor cores
    skew = cp.asarray(np.tile(np.array([[5, 2, 9, 0]], np.int64), (T, 1)))
    close(moe.experts(x, skew, w, gate_up, down, "silu"), ops.moe_experts_grouped(x, skew, w, gate_up, down))
    monkeypatch.setattr(moe, "CHUNK_FLOATS", 8 * k * max(H, I))  # 8 tokens a launch
    close(moe.experts(x, ids, w, gate_up, down, "silu"), ops.moe_experts_grouped(x, ids, w, gate_up, down))
    monkeypatch.setenv("LUMEN_CUDA_MMA_PREFILL", "0")
    calls.clear()
    close(moe.experts(x, ids, w, gate_up, down, "silu"), ops.moe_experts_grouped(x, ids, w, gate_up, down))
    assert calls == []  # off: the CUDA-core grouped kernels


@pytest.mark.parametrize("packed", [False, True], ids=["lists", "packed"])
@pytest.mark.parametrize("T", [8, 100])
def test_routed_bf16_experts_on_the_tensor_cores_equal_the_grouped_reference(cp, mma, monkeypatch, T, packed):
    """By default: bf16 experts (lists, as Qwen's; packed (E, 2I, H), as Gemma 4's) through
    moe_bf16_x3 (a spy), equal to the CuPy reference within f32 rounding. I = 704 (Gemma-4-26B-A4B's), not a
    multiple of 128: the last column block is partial; H = 272 at T = 8: the last pipeline stage too (32 columns a
    stage with the deep pipeline)."""
    import ml_dtypes
    from gpu_util import close
    from lumen_cuda import fp8_mma, moe, ops
    from test_cuda_moe import experts, routing

    from lumen_core.plugins import get_registry

    reg = get_registry()
    gpu = reg.backend_class("cuda")("cuda:0", reg)
    rng = np.random.default_rng(T + packed)
    E, k, H, I = 8, 2, 272 if T == 8 else 256, 704
    calls = []
    real = fp8_mma.moe_role_bf16
    monkeypatch.setattr(fp8_mma, "moe_role_bf16", lambda *a: calls.append((a[4], a[14])) or real(*a))
    monkeypatch.delenv("LUMEN_CUDA_MMA_PREFILL", raising=False)  # the default
    x = cp.asarray(rng.normal(size=(T, H)).astype(np.float32))
    ids, w = routing(cp, rng, E, k, np.int64, T)
    if packed:
        gate_up = gpu.weight((rng.normal(size=(E, 2 * I, H)) * 0.05).astype(ml_dtypes.bfloat16), "bf16", "vram")
        down = gpu.weight((rng.normal(size=(E, H, I)) * 0.05).astype(ml_dtypes.bfloat16), "bf16", "vram")
        got = moe.experts_packed(x, ids, w, gate_up, down, "gelu_tanh")
        want = ops.moe_experts_packed_grouped(x, ids, w, gate_up, down, "gelu_tanh")
        assert calls == [(0, 2), (0, 1)]  # gate and up rows (row offset r I for role r) in one launch, down
    else:
        gate_up, down = experts(gpu, rng, E, H, I, "bf16")
        got = moe.experts(x, ids, w, gate_up, down, "silu")
        want = ops.moe_experts_grouped(x, ids, w, gate_up, down, "silu")
        assert calls == [(0, 2), (0, 1)]  # row offsets: none (table pointers)
    close(got, want)


@pytest.mark.parametrize("T,N,K", [(9, 130, 64), (9, 130, 96), (70, 300, 512), (70, 300, 416), (512, 4096, 4096)])
def test_nvfp4_exact_gemm_equals_the_f32_product(cp, mma, monkeypatch, T, N, K):
    """LUMEN_CUDA_MMA_PREFILL=exact on an NVFP4 weight: gemv.linear_nvfp4 takes gemm_nvfp4_x3 (e2m1 x block scale
    exact in bf16, three planes, the global scale after), equal to the f32 product of the dequantized weight."""
    from gpu_util import close
    from lumen_cuda import gemv
    from test_cuda_moe import nvfp4_host

    from lumen_core.plugins import get_registry

    reg = get_registry()
    gpu = reg.backend_class("cuda")("cuda:0", reg)
    rng = np.random.default_rng(T + N + K)
    packed, scale = nvfp4_host(rng, N, K)
    w = gpu.weight(packed, "nvfp4", "vram", scale=scale)
    x = cp.asarray(rng.normal(size=(T, K)).astype(F32))
    want = x @ gemv.dequantize_nvfp4(w).T
    monkeypatch.setenv("LUMEN_CUDA_MMA_PREFILL", "exact")
    assert mma.nvfp4_exact(w)
    calls = []
    real = mma.gemm_nvfp4_x3
    monkeypatch.setattr(mma, "gemm_nvfp4_x3", lambda *a: calls.append(1) or real(*a))
    close(gemv.linear_nvfp4(x, w), want, 2e-6)
    assert calls == [1]


@pytest.mark.parametrize("T", [8, 300])
def test_routed_nvfp4_experts_on_the_tensor_cores_equal_the_grouped_reference(cp, mma, monkeypatch, T):
    from gpu_util import close
    from lumen_cuda import fp8_mma, moe, ops
    from test_cuda_moe import experts, routing

    from lumen_core.plugins import get_registry

    reg = get_registry()
    gpu = reg.backend_class("cuda")("cuda:0", reg)
    rng = np.random.default_rng(T + 5)
    E, k, H, I = 16, 4, 256, 416 if T == 8 else 384  # 416: down's last stage half past K (64 columns a stage)
    gate_up, down = experts(gpu, rng, E, H, I, "nvfp4")
    calls = []
    real = fp8_mma.moe_role_nvfp4
    monkeypatch.setattr(fp8_mma, "moe_role_nvfp4", lambda *a: calls.append((*a[1:4], a[13])) or real(*a))
    monkeypatch.delenv("LUMEN_CUDA_MMA_PREFILL", raising=False)  # the default
    x = cp.asarray(rng.normal(size=(T, H)).astype(np.float32))
    ids, w = routing(cp, rng, E, k, np.int64, T)
    close(moe.experts(x, ids, w, gate_up, down, "silu"), ops.moe_experts_grouped(x, ids, w, gate_up, down, "silu"))
    assert calls == [(0, 2, 4, 2), (0, 1, 2, 1)]  # codes, block scales, global scales (+ r for role r); roles
