"""The fp8 tensor-core prefill GEMMs (kernels/gemm_fp8.cu; opt-in LUMEN_CUDA_MMA_PREFILL=exact | e4m3) on the CPU: numpy
only.

What the kernels must compute is pinned here through lumen_cuda.fp8_mma_model: for ``exact``, the three bf16 planes
sum to each activation exactly and the block-scaled sum equals the dequantized product to f32 rounding; for
``e4m3``, the activation quantizer's codes (nearest e4m3, ties to even, saturated; as ml_dtypes rounds), the
block-scaled sum (against dequantize-then-matmul) and the error the quantization adds against the exact product at a
real shape (the bound docs/cuda.md states); and the option and capability checks. The kernels against this model on
a GPU: tests/test_cuda_fp8_mma.py.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from lumen_cuda import fp8_mma_model as M

from lumen_core.errors import LumenError

F32 = np.float32


def fp8_weight(rng, N, K):
    codes = (rng.normal(size=(N, K)) * 0.5).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    scale = rng.uniform(0.5, 2.0, size=(-(-N // 128), K // 128)).astype(F32) * 0.01
    return codes, scale


def dequantize(codes, scale):
    s = np.repeat(np.repeat(scale, 128, axis=0), 128, axis=1)[:codes.shape[0], :codes.shape[1]]
    return M.E4M3[codes].astype(np.float64) * s


def test_quantizer_rounds_as_ml_dtypes_and_saturates():
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(7, 512)) * rng.uniform(1e-3, 1e3, size=(7, 1))).astype(F32)
    x[0, :128] = 0.0  # an all-zero group: scale 1, codes 0
    x[1, 5] = -x[1, :128].__abs__().max() * 1.0  # the group's amax negative
    x[2, 130:140] = [1e-30, -1e-30, 0.0, -0.0, 3e-38, 1e-8, -1e-8, 2.0, -2.0, 0.5]  # subnormal-range values
    q, s = M.quantize_x(x)
    assert q.dtype == np.uint8 and q.shape == x.shape and s.shape == (7, 4) and s.dtype == F32
    assert s[0, 0] == 1.0 and not q[0, :128].any()
    groups = np.abs(x.reshape(7, 4, 128))
    amax = groups.max(axis=2)
    np.testing.assert_array_equal(s[amax > 0], (amax / F32(448))[amax > 0])
    mag = np.minimum(groups / s[:, :, None], F32(448)).astype(F32)
    want = mag.astype(ml_dtypes.float8_e4m3fn).view(np.uint8).reshape(7, 512)
    want = want | np.where(x < 0, 0x80, 0).astype(np.uint8)
    want = np.where(M.E4M3[want] == 0, want & 0x7F, want)  # -0 codes: the kernel writes +0 for values that round to 0
    got = np.where(M.E4M3[q] == 0, q & 0x7F, q)
    np.testing.assert_array_equal(got, want)
    assert q.max() & 0x7F <= 0x7E  # never NaN (0x7f)
    assert (np.abs(M.E4M3[q]).max(axis=1) <= 448).all()


def test_gemm_model_is_the_block_scaled_product():
    rng = np.random.default_rng(1)
    for T, N, K in [(5, 130, 256), (64, 256, 384)]:
        x = rng.normal(size=(T, K)).astype(F32)
        codes, scale = fp8_weight(rng, N, K)
        xq, sx = M.quantize_x(x)
        xd = M.E4M3[xq].astype(np.float64) * np.repeat(sx, 128, axis=1)
        want = xd @ dequantize(codes, scale).T
        got = M.gemm(xq, sx, codes, scale)
        assert np.abs(got - want).max() <= 1e-6 * np.abs(want).max()


def test_quantization_error_against_the_exact_product_at_a_real_shape():
    """512 tokens x 4096 x 4096 (a 9B projection's shape): the relative error the e4m3 activations add, as a
    fraction of the output's largest value, stays under the bound docs/cuda.md states (measured 2026-12-05 with this
    seed: 2.5% largest, 0.34% median, per element against |y|'s max)."""
    rng = np.random.default_rng(2)
    T, N, K = 512, 1024, 4096  # N cut to 1024 to keep the test under a few seconds; the error is per output
    x = rng.normal(size=(T, K)).astype(F32)
    codes, scale = fp8_weight(rng, N, K)
    exact = x.astype(np.float64) @ dequantize(codes, scale).T
    got = M.linear(x, codes, scale)
    err = np.abs(got - exact) / np.abs(exact).max()
    assert err.max() < 0.04 and np.median(err) < 0.006, (err.max(), np.median(err))
    assert err.max() > 1e-4  # lossy, as documented: not the exact path


def test_planes_sum_to_the_activations_and_the_exact_model_is_the_f32_product():
    rng = np.random.default_rng(3)
    x = (rng.normal(size=(9, 256)) * rng.uniform(1e-6, 1e6, size=(9, 1))).astype(F32)
    x[0, :5] = [0.0, -0.0, 1e-30, 3.0e38, -2.5]  # (f32 subnormals, below 2^-126, are not kept exactly)
    p = M.x_planes(x)
    assert p.shape == (3, 9, 256) and p.dtype == np.uint16
    total = M.bf16_value(p[0]).astype(np.float64) + M.bf16_value(p[1]) + M.bf16_value(p[2])
    np.testing.assert_array_equal(total, x.astype(np.float64))  # exact, not approximately
    T, N, K = 64, 256, 512
    x = rng.normal(size=(T, K)).astype(F32)
    codes, scale = fp8_weight(rng, N, K)
    exact = x.astype(np.float64) @ dequantize(codes, scale).T
    got = M.gemm_x3(M.x_planes(x), codes, scale)
    assert np.abs(got - exact).max() <= 1e-12 * np.abs(exact).max()


def test_option_and_capability():
    assert M.requested({}) == "" and M.requested({M.OPTION: "0"}) == "" and M.requested({M.OPTION: " "}) == ""
    assert M.requested({M.OPTION: "exact"}) == "exact" and M.requested({M.OPTION: "e4m3"}) == "e4m3"
    with pytest.raises(LumenError, match=r"LUMEN_CUDA_MMA_PREFILL='1'.*exact .*e4m3 .*0 \(no tensor-core"):
        M.requested({M.OPTION: "1"})
    assert M.experts_requested({}) and M.experts_requested({M.OPTION: ""})  # routed experts: the default
    assert M.experts_requested({M.OPTION: "exact"}) and M.experts_requested({M.OPTION: "e4m3"})
    assert not M.experts_requested({M.OPTION: "0"}) and not M.experts_requested({M.OPTION: " 0 "})
    with pytest.raises(LumenError, match="LUMEN_CUDA_MMA_PREFILL='off'"):
        M.experts_requested({M.OPTION: "off"})
    assert M.capable("90") and M.capable("89") and M.capable((12, 0)) and M.capable("100")
    assert not M.capable("86") and not M.capable((8, 0))
    assert M.applies((4096, 4096), (128, 128)) and M.applies((130, 256), (128, 128))
    assert not M.applies((4096, 4096), None) and not M.applies((256, 200), (128, 128))
    assert not M.applies((256, 256), (1, 256))


def test_slot_block_option_and_default():
    """The routed experts' block width: the option where set, else 32."""
    for v in ("16", "32", "64", " 32 "):
        assert M.slot_block({M.SLOTS_OPTION: v}) == int(v.strip())
    assert M.slot_block({}) == M.slot_block({M.SLOTS_OPTION: ""}) == M.SLOT_DEFAULT == 32
    for bad in ("8", "128", "wide", "-16"):
        with pytest.raises(LumenError, match=rf"LUMEN_CUDA_X3_SLOTS='{bad}'.*16, 32 or 64"):
            M.slot_block({M.SLOTS_OPTION: bad})


def test_x3_pipeline_fits_each_device_twice_an_sm():
    """The x3 kernels' dynamic shared memory (gemm_fp8.cu's X3 per stage: padded weight rows and three plane rows)
    and the pipeline each device gets: the deep one where two of its largest blocks fit an SM (H100 / H200), the
    two-stage geometry of before on a 100 KB-an-SM card (SM120, Ada), never more than a block may opt in to."""
    assert M.x3_smem("fp8", 128, 64, (2, 1)) == 2 * (128 * 48 + 3 * 64 * 80)  # the old static arrays: 43008
    assert M.x3_smem("bf16", 256, 32, (2, 1)) == 2 * (256 * 48 + 3 * 32 * 48)
    assert M.x3_smem("nvfp4", 256, 32, (2, 1)) == 2 * (256 * 32 + 3 * 32 * 80 + 256 * 2 * 4)  # + scale words
    assert M.x3_smem("fp8", 256, 32, (3, 2)) == 3 * (256 * 80 + 3 * 32 * 144)
    assert M.x3_smem("fp8", 256, 32, (3, 2), planes=1) == 3 * (256 * 80 + 32 * 144)  # bf16 activations: one plane
    assert M.x3_smem("nvfp4", 256, 16, (3, 2)) == 3 * (256 * 48 + 3 * 16 * 144 + 256 * 4 * 4)
    hopper = (232448, 233472, 1024)  # cudaDevAttrMaxSharedMemoryPerBlockOptin, ...PerMultiprocessor, Reserved...
    sm120 = (101376, 102400, 1024)
    assert M.x3_pipe(*hopper) == (3, 2)
    assert M.x3_pipe(*sm120) == (2, 1)
    assert M.x3_pipe(48 * 1024, 64 * 1024, 1024) == (2, 1)  # nothing fits: the smallest, under the 48 KB default
    for dev in (hopper, sm120):
        pipe = M.x3_pipe(*dev)
        worst = max(M.x3_smem(f, r, s, pipe) for f in ("fp8", "bf16", "nvfp4") for r, s in M.X3_GEOMETRIES)
        assert worst <= dev[0] and 2 * (worst + M.X3_STATIC_SMEM + dev[2]) <= dev[1]
    assert max(M.x3_smem(f, r, s, (2, 1)) for f in ("fp8", "bf16", "nvfp4") for r, s in M.X3_GEOMETRIES) <= 48 * 1024
