"""The hand-written CUDA kernels (plugins/lumen-cuda/lumen_cuda/kernels/*.cu, launched from lumen_cuda.gemv)
against the CPU backend's ops and float64 numpy references, on random inputs with odd sizes.

GPU tests carry the ``gpu`` marker and skip without CuPy or a CUDA device; the first test needs neither.
Alignment the GEMV kernels require (16-byte loads): K % 8 == 0 for bf16/f16, K % 16 == 0 for fp8, a 16-byte
aligned C-contiguous weight; otherwise ``linear`` falls back to the CuPy/cuBLAS path (tested here too).
Tolerance: f32 accumulation in another order than numpy's: ≤ 1e-5 × max(1, max |reference|).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from gpu_util import close, host

from lumen_core.backend import Weight
from lumen_core.plugins import get_registry

pytest.importorskip("lumen_cuda")

# (N, K): N never a multiple of the rows a block covers, K not a multiple of 128 (but of 8 / 16).
SHAPES16 = [(1000, 4104), (257, 136), (3, 8), (4099, 1032), (129, 2056)]
SHAPES8 = [(1000, 4112), (257, 144), (130, 16), (300, 1040), (129, 2064)]


def test_kernel_ops_are_registered_above_the_cupy_ops():
    reg = get_registry()
    assert reg.op("linear", "cuda", "bf16").__name__ == "cuda_kernel_linear_bf16"
    assert reg.op("linear", "cuda", "f16").__name__ == "cuda_kernel_linear_f16"
    assert reg.op("rms_norm", "cuda").__name__ == "cuda_kernel_rms_norm"
    assert reg.op("linear", "cuda", "fp8").__name__ == "cuda_kernel_linear_fp8"
    assert reg.op("linear", "cuda", "nvfp4").__name__ == "cuda_kernel_linear_nvfp4"
    assert reg.op("embedding", "cuda", "nvfp4").__name__ == "cuda_kernel_embedding_nvfp4"
    assert reg.op("linear", "cuda", "f32").__name__ == "cuda_kernel_linear_f32"  # GEMV for T <= 8, else cuBLAS
    for key in (("linear", "cuda", "bf16"), ("rms_norm", "cuda", None)):
        assert len(reg.ops[key]) == 2 and reg.ops[key][0].priority > reg.ops[key][1].priority


# -- fixtures and helpers --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gpu(cp):
    reg = get_registry()
    return reg.backend_class("cuda")("cuda:0", reg)


@pytest.fixture(scope="module")
def cpu():
    reg = get_registry()
    return reg.backend_class("cpu")("cpu", reg)


@pytest.fixture(scope="module")
def gemv(cp):
    from lumen_cuda import gemv

    return gemv


def poisoned(cp, T, N):
    return cp.full((T, N), np.nan, dtype=cp.float32)


def activations(rng, T, K, xdtype):
    """x (T, K) f32 on the host, and what the kernel is given: f32, or bf16 bits (uint16) of x rounded to bf16."""
    x = rng.normal(size=(T, K)).astype(np.float32)
    if xdtype == "bf16":
        xb = x.astype(ml_dtypes.bfloat16)
        return xb.astype(np.float32), xb.view(np.uint16)
    return x, x


def fp8_weight(rng, N, K, block=(128, 128)):
    """e4m3 values (N, K) (ml_dtypes), f32 scales (ceil(N/128), ceil(K/128)) like HF's weight_scale_inv."""
    w8 = (rng.normal(size=(N, K)) * 0.5).astype(ml_dtypes.float8_e4m3fn)
    scale = rng.uniform(0.5, 2.0, size=(-(-N // block[0]), -(-K // block[1]))).astype(np.float32)
    return w8, scale


# -- GEMV -----------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2, 4])
@pytest.mark.parametrize("xdtype", ["f32", "bf16"])
@pytest.mark.parametrize("fmt", ["bf16", "f16"])
def test_gemv16_against_numpy(cp, gemv, fmt, xdtype, rows):
    rng = np.random.default_rng(100 * len(fmt) + 10 * rows + (xdtype == "bf16"))
    for N, K in SHAPES16:
        w = rng.normal(size=(N, K)).astype(ml_dtypes.bfloat16 if fmt == "bf16" else np.float16)
        wd = cp.asarray(w.view(np.uint16) if fmt == "bf16" else w)
        for T in (1, 2, 3, 4):
            x, xk = activations(rng, T, K, xdtype)
            y = gemv.gemv16(cp.asarray(xk), wd, fmt, out=poisoned(cp, T, N), rows=rows)
            close(y, x.astype(np.float64) @ w.astype(np.float64).T)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [2, 4, 8])
@pytest.mark.parametrize("xdtype", ["f32", "bf16"])
@pytest.mark.parametrize("fmt", ["bf16", "f16"])
def test_wide_gemv16_against_numpy_and_one_token(cp, gemv, fmt, xdtype, rows):
    """The 5..8-token GEMV (a speculative verify) against numpy, and each of its rows bit for bit the one-token
    GEMV's (each row's sum runs in the same order whatever T and rows: the verify's logits are plain decode's)."""
    rng = np.random.default_rng(300 + 10 * rows + (xdtype == "bf16"))
    for N, K in SHAPES16:
        w = rng.normal(size=(N, K)).astype(ml_dtypes.bfloat16 if fmt == "bf16" else np.float16)
        wd = cp.asarray(w.view(np.uint16) if fmt == "bf16" else w)
        for T in (5, 6, 7, 8):
            x, xk = activations(rng, T, K, xdtype)
            y = gemv.gemv16(cp.asarray(xk), wd, fmt, out=poisoned(cp, T, N), rows=rows)
            close(y, x.astype(np.float64) @ w.astype(np.float64).T)
            for t in range(T):
                np.testing.assert_array_equal(y[t].get(), gemv.gemv16(cp.asarray(xk[t:t + 1]), wd, fmt)[0].get())


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2, 4])
@pytest.mark.parametrize("xdtype", ["f32", "bf16"])
def test_gemv_fp8_block_scales_against_the_cpu_op(cp, gemv, cpu, xdtype, rows):
    rng = np.random.default_rng(7 + rows + (xdtype == "bf16"))
    for N, K in SHAPES8:
        w8, scale = fp8_weight(rng, N, K)
        # The CPU backend infers the block from the scale's shape: (128, 16) for K = 16 (one column block: the
        # same matrix); the kernel is given HF's (128, 128).
        wc = cpu.weight(w8, "fp8", "ram", scale=scale)
        wd, sd = cp.asarray(w8.view(np.uint8)), cp.asarray(scale)
        for T in (1, 2, 3, 4):
            x, xk = activations(rng, T, K, xdtype)
            y = gemv.gemv_fp8(cp.asarray(xk), wd, sd, (128, 128), out=poisoned(cp, T, N), rows=rows)
            close(y, cpu.ops.linear(x, wc))


@pytest.mark.gpu
@pytest.mark.parametrize("partial", ["1", "0"])
def test_linear_group_fuses_what_agrees_and_equals_each_linear(cp, gemv, monkeypatch, partial):
    """The Gated-DeltaNet's input projections as a 35B-A3B fp8 checkpoint has them (qkv and z of whole 128-row scale
    blocks, b and a of 32 rows), here at K = 256 beside bf16 and per-tensor members: the fp8 ones become one matrix
    (b padded to a's block, lumen_cuda.fuse_plan), the bf16 ones another; every output equals its own linear
    (bit-equal for the GEMVs, to the GEMM's rounding for 40 tokens), also on the second call (the kept parts).
    LUMEN_CUDA_PARTIAL_FUSION=0 (the default): such a group is not fused at all."""
    monkeypatch.setenv("LUMEN_CUDA_PARTIAL_FUSION", partial)
    rng = np.random.default_rng(11)

    def make():
        r = np.random.default_rng(12)
        ws = []
        for n in (256, 128, 32, 32):
            w8, scale = fp8_weight(r, n, 256)
            ws.append(Weight(cp.asarray(w8.view(np.uint8)), "fp8", (n, 256), cp.asarray(scale), (128, 128),
                             store="vram"))
        bf = (r.normal(size=(48, 256)) * 0.1).astype(ml_dtypes.bfloat16).view(np.uint16)
        ws.insert(1, Weight(cp.asarray(bf[:16]), "bf16", (16, 256), store="vram"))
        ws.append(Weight(cp.asarray(bf[16:]), "bf16", (32, 256), store="vram"))
        w8, _ = fp8_weight(r, 64, 256)
        ws.append(Weight(cp.asarray(w8.view(np.uint8)), "fp8", (64, 256), cp.ones(1, cp.float32), None, store="vram"))
        return ws

    grouped, single = make(), make()
    for _ in range(2):
        for T in (1, 3, 40):
            x = cp.asarray(rng.normal(size=(T, 256)).astype(np.float32))
            ys = gemv.linear_group(x, grouped)
            for y, w in zip(ys, single, strict=True):
                ref = gemv.linear_any(x, w)
                assert y.shape == ref.shape
                if T <= 4:
                    cp.testing.assert_array_equal(y, ref)
                else:
                    close(y, ref)
    parts = gemv._group(grouped)
    if partial == "0":
        assert [m for _, m in parts] == [[(i, 0, w.shape[0])] for i, w in enumerate(single)]
        assert all(f is None for f, _ in parts)
        return
    assert [m for _, m in parts] == [[(0, 0, 256), (2, 256, 128), (3, 384, 32), (4, 512, 32)],
                                     [(1, 0, 16), (5, 16, 32)], [(6, 0, 64)]]
    assert parts[0][0].shape == (544, 256) and parts[2][0] is None


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["per-channel", "per-tensor"])
def test_gemv_fp8_per_channel_and_per_tensor_scales(cp, gemv, cpu, kind):
    rng = np.random.default_rng(11)
    N, K = 333, 528
    w8 = (rng.normal(size=(N, K)) * 0.5).astype(ml_dtypes.float8_e4m3fn)
    scale = rng.uniform(0.5, 2.0, size=(N, 1) if kind == "per-channel" else (1,)).astype(np.float32)
    wc = cpu.weight(w8, "fp8", "ram", scale=scale)
    assert wc.block is None
    for T in (1, 4):
        x = rng.normal(size=(T, K)).astype(np.float32)
        y = gemv.gemv_fp8(cp.asarray(x), cp.asarray(w8.view(np.uint8)), cp.asarray(scale), None,
                          out=poisoned(cp, T, N))
        close(y, cpu.ops.linear(x, wc))


@pytest.mark.gpu
def test_linear_fp8_falls_back_above_four_tokens_and_on_unaligned_k(cp, gemv, cpu):
    rng = np.random.default_rng(12)
    for N, K, T in [(200, 272, 9), (130, 40, 2), (130, 272, 1)]:  # T > 8 (gemm_split); K % 16 != 0; GEMV
        w8, scale = fp8_weight(rng, N, K)
        wc = cpu.weight(w8, "fp8", "ram", scale=scale)
        wg = Weight(cp.asarray(w8.view(np.uint8)), "fp8", (N, K), cp.asarray(scale), wc.block)
        x = rng.normal(size=(T, K)).astype(np.float32)
        close(gemv.linear_fp8(cp.asarray(x), wg), cpu.ops.linear(x, wc), 2e-5 if T > 4 else 1e-5)
    assert not gemv.gemv_supported("fp8", wg.data, 9, 272) and gemv.gemv_supported("fp8", wg.data, 8, 272)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", "f16"])
def test_linear_dispatch_kernel_and_fallbacks_against_the_cpu_op(cp, gpu, cpu, gemv, fmt):
    """Through the backend's op table: T <= MAX_T (8) runs the kernel, T > 8 and K % 8 != 0 fall back to cuBLAS."""
    rng = np.random.default_rng(3)
    dtype = ml_dtypes.bfloat16 if fmt == "bf16" else np.float16
    assert gpu.ops.resolve("linear", fmt).__name__ == f"cuda_kernel_linear_{fmt}"
    for N, K, T in [(515, 1032, 1), (515, 1032, 2), (515, 1032, 3), (515, 1032, 4), (515, 1032, 5),
                    (515, 1032, 8), (515, 1032, 9), (64, 100, 1), (64, 100, 9), (7, 8, 4)]:
        w = rng.normal(size=(N, K)).astype(dtype)
        wc, wg = cpu.weight(w, fmt, "ram"), gpu.weight(w, fmt, "vram")
        assert gemv.gemv_supported(fmt, wg.data, T, K) == (T <= gemv.MAX_T and K % 8 == 0)
        x = rng.normal(size=(T, K)).astype(np.float32)
        close(gpu.ops.linear(gpu.tensor(x), wg), cpu.ops.linear(x, wc))


@pytest.mark.gpu
def test_gemv_alignment_fallbacks(cp, gpu, cpu, gemv):
    """A weight whose base is not 16-byte aligned falls back; x that is a strided / misaligned view is copied."""
    rng = np.random.default_rng(4)
    N, K = 96, 264
    w = rng.normal(size=(N, K)).astype(ml_dtypes.bfloat16)
    wc = cpu.weight(w, "bf16", "ram")
    flat = cp.zeros(N * K + 1, dtype=cp.uint16)
    flat[1:] = cp.asarray(w.view(np.uint16).ravel())
    shifted = flat[1:].reshape(N, K)  # contiguous, base 2 bytes past an aligned address
    assert not gemv.gemv_supported("bf16", shifted, 1, K)
    x = rng.normal(size=(2, K + 1)).astype(np.float32)
    xv = cp.asarray(x)[:, 1:]  # strided view, misaligned base
    close(gemv.linear_bf16(xv, Weight(shifted, "bf16", (N, K))), cpu.ops.linear(x[:, 1:], wc))
    close(gemv.linear_bf16(xv, Weight(cp.asarray(w.view(np.uint16)), "bf16", (N, K))),
          cpu.ops.linear(x[:, 1:], wc))


# -- RMSNorm ----------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 4096), (3, 1000), (5, 3, 17), (2, 1), (4, 12288), (7, 256)])
def test_rms_norm_against_the_cpu_op(cp, gpu, cpu, shape):
    assert gpu.ops.resolve("rms_norm").__name__ == "cuda_kernel_rms_norm"
    rng = np.random.default_rng(shape[-1])
    x = (rng.normal(size=shape) * 3).astype(np.float32)
    w = rng.normal(size=shape[-1]).astype(np.float32)
    for args in [(w, 1e-6), (w, 1e-6, 1.0), (None, 1e-5), (None, 1e-6, 1.0), (w, 1e-2, 0.5)]:
        wg = None if args[0] is None else gpu.tensor(args[0])
        got = gpu.ops.rms_norm(gpu.tensor(x), wg, *args[1:])
        close(got, cpu.ops.rms_norm(x, *args))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 32, 128), (5, 16, 128), (3, 1000), (2, 5000)])
def test_rms_norm_gated_is_the_two_ops_in_one_launch(cp, gpu, cpu, gemv, shape, monkeypatch):
    """The fused kernel gives the bits of the fused RMSNorm kernel followed by the mul_silu elementwise kernel
    (the ops it replaces), and the CPU op's values to f32 rounding."""
    from lumen_cuda import cupy_ops

    monkeypatch.setenv("LUMEN_CUDA_DECODE_FUSION", "1")
    rng = np.random.default_rng(shape[-1] + len(shape))
    x, g = ((rng.normal(size=shape) * 3).astype(np.float32) for _ in range(2))
    w = rng.normal(size=shape[-1]).astype(np.float32)
    xg, gg, wg = gpu.tensor(x), gpu.tensor(g), gpu.tensor(w)
    got = gpu.ops.rms_norm_gated(xg, gg, wg, 1e-6)
    np.testing.assert_array_equal(host(got), host(cupy_ops.mul_silu(gemv.rms_norm(xg, wg, 1e-6), gg)))
    close(got, cpu.ops.rms_norm_gated(x, g, w, 1e-6))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 2048), (5, 4096), (3, 1000), (2, 12288), (7, 17)])
def test_add_rms_norm_is_the_add_and_the_norm_in_one_launch(cp, gpu, cpu, gemv, shape, monkeypatch):
    """(x + r, rms_norm(x + r)): the bits of the add and of the RMSNorm kernel over its result (rows in registers
    and, at D = 12288 > 8 x 1024, the re-reading path); the CPU composite's values to f32 rounding."""
    assert gpu.ops.has("add_rms_norm")
    monkeypatch.setenv("LUMEN_CUDA_DECODE_FUSION", "1")
    rng = np.random.default_rng(shape[-1])
    x, r = ((rng.normal(size=shape) * 3).astype(np.float32) for _ in range(2))
    w = rng.normal(size=shape[-1]).astype(np.float32)
    xg, rg, wg = gpu.tensor(x), gpu.tensor(r), gpu.tensor(w)
    for args in [(wg, 1e-6, 1.0), (wg, 1e-6), (None, 1e-5)]:
        s, y = gpu.ops.add_rms_norm(xg, rg, *args)
        np.testing.assert_array_equal(host(s), host(xg + rg))
        np.testing.assert_array_equal(host(y), host(gemv.rms_norm(xg + rg, *args)))
        s_cpu, y_cpu = cpu.ops.add_rms_norm(x, r, None if args[0] is None else w, *args[1:])
        close(y, y_cpu)


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", ["1", "noprefetch", "late"])
def test_a_chain_captured_with_programmatic_dependent_launch_equals_eager(cp, gpu, gemv, monkeypatch, pdl):
    """64 dependent launches (each reads what the one before wrote: GEMV, then add + norm) captured with
    LUMEN_CUDA_PDL (each mode) through kernels.Launcher (cuLaunchKernelEx), replayed three times: the bits of the
    same chain run eagerly. A kernel reading before its producer finished would differ."""
    from lumen_cuda import kernels

    monkeypatch.setenv("LUMEN_CUDA_DECODE_FUSION", "1")
    rng = np.random.default_rng(2)
    H = 2048
    w = gpu.weight((rng.normal(size=(H, H)) * 0.02).astype(ml_dtypes.bfloat16), "bf16", "vram")
    nw = cp.asarray(rng.normal(size=H).astype(np.float32))
    x0 = cp.asarray(rng.normal(size=(1, H)).astype(np.float32))

    def chain(x):
        for _ in range(32):
            s, x = gpu.ops.add_rms_norm(x, gpu.ops.linear(x, w), nw, 1e-6, 1.0)
        return x

    want = host(chain(x0))
    monkeypatch.setenv("LUMEN_CUDA_PDL", pdl)
    assert isinstance(kernels.function("rms_norm", "add_rms_norm_f32"), kernels.Launcher)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        chain(x0)  # warm-up on the stream, outside the capture: compiles, and leaves the pool its blocks
        stream.synchronize()
        stream.begin_capture()
        y = chain(x0)
        graph = stream.end_capture()
    for _ in range(3):
        y.fill(np.nan)
        cp.cuda.Device().synchronize()
        graph.launch(stream)
        stream.synchronize()
        np.testing.assert_array_equal(host(y), want)


# -- prefill GEMM on the tensor cores (bf16 weights, x split into two bf16 halves) ----------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("T,N,K", [(5, 300, 264), (37, 1000, 4104), (512, 257, 136), (64, 3, 8)])
def test_gemm_bf16_keeps_f32_accuracy(cp, gemv, T, N, K):
    rng = np.random.default_rng(T + N + K)
    w = rng.normal(size=(N, K)).astype(ml_dtypes.bfloat16)
    x = rng.normal(size=(T, K)).astype(np.float32)
    y = gemv.gemm_bf16(cp.asarray(x), cp.asarray(w.view(np.uint16)))
    close(y, x.astype(np.float64) @ w.astype(np.float64).T, 2e-5)
    hi, lo = gemv.bf16_split(cp.asarray(x))
    back = (hi.astype(cp.uint32) << 16).view(cp.float32) + (lo.astype(cp.uint32) << 16).view(cp.float32)
    close(back, x, 1e-5)


# -- prefill GEMM for fp8 / NVFP4 weights (dequantized into bf16 hi + lo, three bf16 GEMMs: gemv.gemm_split) ----
SPLIT_SHAPES = [(300, 272), (257, 1040), (4096, 4096)]
SPLIT_CASES = ["fp8-128x128", "fp8-32x32", "fp8-per-channel", "fp8-per-tensor", "nvfp4"]


def quantized_case(cpu, gpu, rng, case, N, K):
    """(CPU Weight, GPU Weight, the f32 matrix (N, K) the CPU backend dequantizes it to) for a SPLIT_CASES case."""
    from lumen_cpu import nvfp4
    from lumen_cpu.ops import dequantize

    if case == "nvfp4":  # every nibble (-0 included), e4m3 block scales, a global scale
        packed = rng.integers(0, 256, size=(N, K // 2), dtype=np.uint8)
        scales = rng.uniform(0.25, 4.0, size=(N, K // 16)).astype(ml_dtypes.float8_e4m3fn)
        scale = (scales, np.float32(0.37))
        wc, wg = cpu.weight(packed, "nvfp4", "ram", scale=scale), gpu.weight(packed, "nvfp4", "vram", scale=scale)
        return wc, wg, nvfp4.dequantize(wc)
    w8 = (rng.normal(size=(N, K)) * 0.5).astype(ml_dtypes.float8_e4m3fn)
    kind = case.removeprefix("fp8-")
    if kind == "per-channel":
        shape = (N, 1)
    elif kind == "per-tensor":
        shape = (1,)
    else:
        b = int(kind.split("x")[0])
        shape = (-(-N // b), -(-K // b))
    scale = rng.uniform(0.5, 2.0, size=shape).astype(np.float32)
    wc, wg = cpu.weight(w8, "fp8", "ram", scale=scale), gpu.weight(w8, "fp8", "vram", scale=scale)
    assert wg.block == wc.block == (None if len(shape) < 2 or shape[1] == 1 else (b, b))
    return wc, wg, dequantize(wc)


def split_rows(gemv, wg, row0, rows):
    """(W_hi, W_lo) bf16 bits of rows row0 .. row0 + rows of a GPU Weight, from the dequant_split kernels."""
    if wg.format == "nvfp4":
        return gemv.nvfp4_split(wg.data, wg.scale.block, wg.scale.global_scale, row0, rows)
    return gemv.fp8_split(wg.data, wg.scale, wg.block, row0, rows)


def bf16_bits_to_f64(b):
    return (host(b).astype(np.uint32) << 16).view(np.float32).astype(np.float64)


@pytest.fixture
def no_f32_fallback(gemv, monkeypatch):
    """Makes the old dequantize-to-f32 + SGEMM paths raise: a test using this runs the tensor-core path only."""

    def refuse(*args, **kwargs):
        raise AssertionError("the f32 dequantization fallback ran instead of gemm_split")

    for name in ("dequantize_fp8", "dequantize_nvfp4", "nvfp4_dequantize"):
        monkeypatch.setattr(gemv, name, refuse)


def linear_q(gemv, x, wg):
    return gemv.linear_nvfp4(x, wg) if wg.format == "nvfp4" else gemv.linear_fp8(x, wg)


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", SPLIT_SHAPES)
@pytest.mark.parametrize("case", SPLIT_CASES)
def test_dequant_split_is_bf16_hi_lo_of_the_f32_dequantization(cp, gemv, gpu, cpu, case, N, K):
    """The dequant_split kernels: W_hi is exactly bf16(W) (round to nearest even, ml_dtypes) of the CPU backend's
    f32 dequantization W, and W_hi + W_lo (summed in float64) is W to within 2^-16 relative per element; for the
    whole matrix and for a slab of rows that starts and ends inside a scale block."""
    rng = np.random.default_rng(N + K + len(case))
    wc, wg, W = quantized_case(cpu, gpu, rng, case, N, K)
    for row0, rows in [(0, N), (N // 3, N - N // 3 - 1)]:
        hi, lo = split_rows(gemv, wg, row0, rows)
        assert hi.shape == lo.shape == (rows, K) and hi.dtype == lo.dtype == cp.uint16
        Wr = W[row0:row0 + rows]
        np.testing.assert_array_equal(host(hi), Wr.astype(ml_dtypes.bfloat16).view(np.uint16))
        err = np.abs(bf16_bits_to_f64(hi) + bf16_bits_to_f64(lo) - Wr.astype(np.float64))
        assert (err <= 2.0**-16 * np.abs(Wr.astype(np.float64))).all(), err.max()


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", SPLIT_SHAPES)
@pytest.mark.parametrize("case", SPLIT_CASES)
def test_linear_quantized_prefill_keeps_f32_accuracy(cp, gemv, gpu, cpu, no_f32_fallback, case, N, K):
    """linear_fp8 / linear_nvfp4 for T > 4 (the tensor-core path; the f32 fallback is made to raise) against a
    float64 numpy product with the CPU backend's f32 dequantized matrix, T = 5, 64, 513. Tolerance: max |Δ| <=
    2e-5 × max(1, max |reference|): x and W each split into bf16 hi + lo (2^-16 relative each at worst), the
    dropped x_lo.W_lo term (~2^-18 relative, 2^-16 at worst), f32 accumulation on the tensor cores."""
    rng = np.random.default_rng(N * K + len(case))
    wc, wg, W = quantized_case(cpu, gpu, rng, case, N, K)
    W64 = W.astype(np.float64)
    assert gemv._slab_rows(N, K) == N  # one slab at these sizes (slabs: the next test)
    for T in (5, 64, 513):
        x = rng.normal(size=(T, K)).astype(np.float32)
        ref = x.astype(np.float64) @ W64.T
        close(linear_q(gemv, cp.asarray(x), wg), ref, 2e-5)
    close(linear_q(gemv, cp.asarray(x).reshape(1, T, K), wg), ref.reshape(1, T, N), 2e-5)  # (..., K) input
    close(gpu.ops.linear(gpu.tensor(x), wg), ref, 2e-5)  # through the registered op


@pytest.mark.gpu
@pytest.mark.parametrize("slab_rows", [3, 130])
@pytest.mark.parametrize("case", SPLIT_CASES)
def test_linear_quantized_prefill_in_slabs(cp, gemv, gpu, cpu, monkeypatch, no_f32_fallback, case, slab_rows):
    """SPLIT_SLAB forced small (3 rows a slab; 130 rows, rounded down to 128): every slab's output columns are
    written from the right weight rows and scales, and the result matches the one-slab result (f32 rounding:
    1e-5 × max(1, max |Δ|)) and the float64 reference (2e-5, as above)."""
    rng = np.random.default_rng(slab_rows + len(case))
    for N, K in [(300, 272), (257, 1040)]:
        wc, wg, W = quantized_case(cpu, gpu, rng, case, N, K)
        x = rng.normal(size=(37, K)).astype(np.float32)
        ref = x.astype(np.float64) @ W.astype(np.float64).T
        whole = linear_q(gemv, cp.asarray(x), wg)
        with monkeypatch.context() as m:  # (an undo() would also lift no_f32_fallback)
            m.setattr(gemv, "SPLIT_SLAB", slab_rows * K)
            assert gemv._slab_rows(N, K) == (3 if slab_rows == 3 else 128)
            y = linear_q(gemv, cp.asarray(x), wg)
        assert gemv._slab_rows(N, K) == N
        close(y, whole)
        close(y, ref, 2e-5)



# -- f32 and NVFP4 decode GEMVs -----------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2, 4])
def test_gemv_f32_against_numpy(cp, gemv, rows):
    rng = np.random.default_rng(40 + rows)
    for N, K in [(1000, 4100), (257, 132), (3, 4), (129, 2052)]:
        w = rng.normal(size=(N, K)).astype(np.float32)
        wd = cp.asarray(w)
        for T in (1, 2, 3, 4):
            x = rng.normal(size=(T, K)).astype(np.float32)
            y = gemv.gemv32(cp.asarray(x), wd, out=poisoned(cp, T, N), rows=rows)
            close(y, x.astype(np.float64) @ w.astype(np.float64).T)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2, 4])
def test_gemv_nvfp4_against_the_cpu_op(cp, gemv, gpu, cpu, rows):
    """Random packed codes (every nibble, -0 included) and e4m3 block scales: the in-register dequantization
    GEMV against the CPU backend's NVFP4 linear (which dequantizes the matrix, then multiplies)."""
    rng = np.random.default_rng(70 + rows)
    for N, K in [(1000, 4096), (257, 160), (3, 32), (129, 2080)]:
        packed = rng.integers(0, 256, size=(N, K // 2), dtype=np.uint8)
        scales = rng.uniform(0.25, 4.0, size=(N, K // 16)).astype(ml_dtypes.float8_e4m3fn)
        scale = (scales, np.float32(0.37))
        wc, wg = cpu.weight(packed, "nvfp4", "ram", scale=scale), gpu.weight(packed, "nvfp4", "vram", scale=scale)
        for T in (1, 2, 3, 4):
            x = rng.normal(size=(T, K)).astype(np.float32)
            y = gemv.gemv_nvfp4(cp.asarray(x), wg.data, wg.scale.block, wg.scale.global_scale,
                                out=poisoned(cp, T, N), rows=rows)
            close(y, cpu.ops.linear(x, wc))
        close(gpu.ops.linear(gpu.tensor(x[:1]), wg), cpu.ops.linear(x[:1], wc))  # through the registered op
