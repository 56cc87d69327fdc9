"""Launchers for the hand-written decode kernels: GEMV for bf16 / f16 / FP8-E4M3 weights (``kernels/gemv.cu``,
``kernels/gemv_fp8.cu``) and the fused RMSNorm (``kernels/rms_norm.cu``); the prefill GEMMs on the tensor cores.

The ``linear_*`` and ``rms_norm`` functions here are what ``lumen_cuda/__init__.py`` registers above the CuPy
versions in ``ops.py``; each falls back to the CuPy reference ops (``cupy_ops``) where the kernel does not apply:

- GEMV: x (T, K) with T <= MAX_T (8) tokens; above that, cuBLAS (``cupy_ops.linear_dense``). fp8 / NVFP4 from
  5 tokens where the GEMV does not apply: ``gemm_split`` (the weight dequantized a slab at a time into bf16 hi + lo,
  ``kernels/dequant_split.cu``, then three bf16 GemmEx on the tensor cores with f32 accumulation; docs/cuda.md).
- Alignment (16-byte vector loads): bf16/f16 need K % 8 == 0, fp8 K % 16 == 0 (and a column block size that is
  a multiple of 16); the weight must be C-contiguous with a 16-byte aligned base. Otherwise: the fallback.
  x is made contiguous (and copied when its base is not 16-byte aligned).
- x is f32 (what the engine passes) or bf16 bits (uint16: CuPy has no bfloat16); y is always f32.
- RMSNorm: x f32 (..., D), w f32 (D,) or None; anything else goes to ``cupy_ops.rms_norm``.
- Fused projections (``linear_group``): the one matrix a group becomes is kept on the group's first Weight
  (lumen_cuda.state), so it lives and dies with the model.
"""

from __future__ import annotations

import os
import weakref

import cupy as cp
import numpy as np

from lumen_core.backend import Weight

from . import cupy_ops, fp8_mma, kernels, sm120
from .fuse_plan import fuse_group, partial_fusion
from .state import derived
from .step import device_ids

MAX_T = 8  # decode GEMV up to this many tokens (a verify of 7 drafts); the tensor-core GEMMs above
GEMM_MIN_T = 5  # fp8 / NVFP4: the tensor-core prefill GEMM from this many tokens where the GEMV does not apply
WARPS = 4  # warps per block (GEMV_WARPS in the .cu files)
# Rows per warp by format and T (index T - 1); 1, 2 and 4 are compiled. From the H200 sweep in docs/cuda.md:
# 2-byte weights read best with 2 rows at T = 1 and 4 rows at T >= 2; fp8 with 4 rows.
# T = 5..8 (a speculative verify): 2-byte weights are compiled with 2, 4 and 8 rows, 8 (each activation load feeds
# 8 rows' FMAs) measured best over the 9B layer's matrices at T = 5 and 7 (benchmarks/cuda_gemv.py --wide-sweep,
# docs/cuda.md); the other formats with 2 and 4 rows (4). LUMEN_CUDA_WIDE_ROWS overrides the 2-byte choice.
_WIDE16 = (int(os.environ.get("LUMEN_CUDA_WIDE_ROWS", "8")),) * 4
ROWS = {"bf16": (2, 4, 4, 4) + _WIDE16, "f16": (2, 4, 4, 4) + _WIDE16, "fp8": (4, 4, 4, 4) + (4,) * 4,
        "f32": (2, 4, 4, 4) + (4,) * 4, "nvfp4": (2, 4, 4, 4) + (4,) * 4}
ALIGN = {"bf16": 8, "f16": 8, "fp8": 16, "f32": 4, "nvfp4": 32}  # K % this == 0: one 16-byte load per lane per step

# 16-byte loads in flight per row and lane in the fp8 GEMV (GEMV_U in gemv_fp8.cu); LUMEN_CUDA_FP8_UNROLL
# overrides (benchmarks/cuda_gemv.py --fp8-sweep compares 2 and 4).
FP8_UNROLL = int(os.environ.get("LUMEN_CUDA_FP8_UNROLL", "2"))

def _fn(file: str, name: str, options: tuple[str, ...] = ()) -> cp.RawKernel:
    return kernels.function(file, name, options)


def _aligned(a) -> bool:
    return a.data.ptr % 16 == 0


def _prep_x(x):
    """x (T, K) f32 or bf16 bits (uint16), C-contiguous, 16-byte aligned."""
    if x.dtype != cp.float32 and x.dtype != cp.uint16:
        x = x.astype(cp.float32)
    if not x.flags.c_contiguous or not _aligned(x):
        x = cp.array(x, order="C", copy=True)
    return x


def _xname(x) -> str:
    return "bf16" if x.dtype == cp.uint16 else "f32"


def _out(out, T, N):
    if out is None:
        return cp.empty((T, N), dtype=cp.float32)
    assert out.shape == (T, N) and out.dtype == cp.float32 and out.flags.c_contiguous
    return out


def gemv_supported(fmt: str, data, T: int, K: int, block=None) -> bool:
    """Whether the decode kernel applies: T tokens, weight array ``data`` (N, K), fp8 block (BR, BC)."""
    if not 1 <= T <= MAX_T or K % ALIGN[fmt] or data.ndim != 2 or not data.flags.c_contiguous:
        return False
    if not _aligned(data):
        return False
    return not (fmt == "fp8" and block is not None and block[1] % 16)


def gemv16(x, w, fmt: str, out=None, rows: int | None = None, warps: int = WARPS, unroll: int | None = None):
    """y (T, N) f32 = x (T, K) @ w.T for w (N, K) bf16 bits (uint16) or f16; 1 <= T <= 8, K % 8 == 0.
    ``rows`` per warp (1, 2, 4; 8 from T = 5), ``warps`` per block and ``unroll`` (16-byte loads in flight per row
    and lane) override the defaults (benchmarks/cuda_gemv.py --wide-sweep)."""
    x = _prep_x(x)
    T, K = x.shape
    N = w.shape[0]
    assert w.shape == (N, K) and fmt in ("bf16", "f16") and gemv_supported(fmt, w, T, K), (fmt, w.shape, x.shape)
    rows = rows or ROWS[fmt][T - 1]
    y = _out(out, T, N)
    options = (() if warps == WARPS else (f"-DGEMV_WARPS={warps}",))
    options += () if unroll is None else (f"-DGEMV_U={unroll}",)
    fn = _fn("gemv", f"gemv_{fmt}_x{_xname(x)}_t{T}_r{rows}", options)
    fn(((N + rows * warps - 1) // (rows * warps),), (warps * 32,), (w, x, y, np.int32(N), np.int32(K)))
    return y


def gemv32(x, w, out=None, rows: int | None = None):
    """y (T, N) f32 = x (T, K) f32 @ w.T for w (N, K) f32; 1 <= T <= 8, K % 4 == 0 (no cuBLAS: capturable)."""
    if x.dtype == cp.uint16:
        raise ValueError("this GEMV takes f32 activations, not bf16 bits")
    x = _prep_x(x)
    T, K = x.shape
    N = w.shape[0]
    assert w.shape == (N, K) and w.dtype == cp.float32 and gemv_supported("f32", w, T, K), (w.shape, x.shape)
    rows = rows or ROWS["f32"][T - 1]
    y = _out(out, T, N)
    _fn("gemv", f"gemv_f32_xf32_t{T}_r{rows}")(((N + rows * WARPS - 1) // (rows * WARPS),), (WARPS * 32,),
                                               (w, x, y, np.int32(N), np.int32(K)))
    return y


def linear_f32(x, w: Weight):  # x (..., K), w (N, K) f32 -> (..., N): the GEMV for T <= 8, else cuBLAS
    K = w.shape[-1]
    x2 = x.reshape(-1, K) if x.ndim != 2 else x
    if isinstance(x, cp.ndarray) and w.data.dtype == cp.float32 and gemv_supported("f32", w.data, x2.shape[0], K):
        y = gemv32(x2, w.data)
        return y if x.ndim == 2 else y.reshape(*x.shape[:-1], y.shape[-1])
    return cupy_ops.linear_dense(x, w)


def fp8_block(shape, scale, block=None) -> tuple[int, int, int]:
    """(BR, BC, SK) for a scale array: 128x128-style blocks, per-channel (N,)/(N, 1) or per-tensor (one value)."""
    N, K = shape
    kpad = (K + 15) // 16 * 16  # a column block covering every column, a multiple of 16
    if block is not None:
        return int(block[0]), int(block[1]), int(scale.shape[-1])
    if scale.size == 1:
        return N, kpad, 1
    assert scale.size == N, f"fp8 scale of shape {scale.shape} for a ({N}, {K}) weight"
    return 1, kpad, 1


def gemv_fp8(x, w, scale, block=(128, 128), out=None, rows: int | None = None, unroll: int | None = None):
    """y (T, N) f32 = x (T, K) @ (w * scale).T for w (N, K) e4m3 bytes (uint8), scale (ceil(N/BR), ceil(K/BC))
    f32 (HF ``weight_scale_inv``), per-channel (N,) or per-tensor (1,) with block None; K % 16 == 0."""
    x = _prep_x(x)
    T, K = x.shape
    N = w.shape[0]
    assert w.shape == (N, K) and gemv_supported("fp8", w, T, K, block), (w.shape, x.shape, block)
    br, bc, sk = fp8_block((N, K), scale, block)
    s = cp.ascontiguousarray(scale, dtype=cp.float32)
    rows = rows or ROWS["fp8"][T - 1]
    y = _out(out, T, N)
    unroll = FP8_UNROLL if unroll is None else unroll
    fn = _fn("gemv_fp8", f"gemv_fp8_x{_xname(x)}_t{T}_r{rows}", (f"-DGEMV_U={unroll}",))
    fn(((N + rows * WARPS - 1) // (rows * WARPS),), (WARPS * 32,),
       (w, s, x, y, np.int32(N), np.int32(K), np.int32(br), np.int32(bc), np.int32(sk)))
    return y


# -- the registered ops ----------------------------------------------------------------------------------------
def _linear16(x, w: Weight):  # x (..., K), w (N, K) bf16 bits / f16 -> (..., N) f32
    K = w.shape[-1]
    x2 = x.reshape(-1, K) if x.ndim != 2 else x
    if isinstance(x, cp.ndarray) and gemv_supported(w.format, w.data, x2.shape[0], K):
        y = gemv16(x2, w.data, w.format)
        return y if x.ndim == 2 else y.reshape(*x.shape[:-1], y.shape[-1])
    if isinstance(x, cp.ndarray) and w.format == "bf16" and w.data.ndim == 2 and w.data.flags.c_contiguous:
        y = gemm_bf16(x2, w.data, w.activations == "bf16")
        return y if x.ndim == 2 else y.reshape(*x.shape[:-1], y.shape[-1])
    return cupy_ops.linear_dense(x, w)


_bf16_split = cp.ElementwiseKernel(
    "float32 x", "uint16 hi, uint16 lo",
    """
    const unsigned int u = __float_as_uint(x);
    const unsigned int h = (u + (((u >> 16) & 1u) + 0x7FFFu)) >> 16;
    const float rest = x - __uint_as_float(h << 16);
    const unsigned int r = __float_as_uint(rest);
    hi = (unsigned short)h;
    lo = (unsigned short)((r + (((r >> 16) & 1u) + 0x7FFFu)) >> 16);
    """, "lumen_bf16_split")


def bf16_split(x):
    """x f32 -> (hi, lo) bf16 bits with hi + lo = x to ~2^-17 relative (each rounded to nearest even): one
    kernel."""
    x = cp.ascontiguousarray(x, dtype=cp.float32)
    hi, lo = cp.empty(x.shape, cp.uint16), cp.empty(x.shape, cp.uint16)
    _bf16_split(x, hi, lo)
    return hi, lo


_CUDA_R_32F, _CUDA_R_16BF, _COMPUTE_32F, _GEMM_DEFAULT = 0, 14, 68, -1


def _gemms_bf16(y, parts, K: int, col0: int = 0, n: int | None = None):
    """y[:, col0:col0 + n] = the sum over ``parts`` [(w, x), ...] of x @ w.T, one cuBLAS GemmEx per part (bf16
    inputs, f32 output and accumulation; beta 0 for the first, 1 after). y (T, N) f32 C-contiguous; each w holds
    n rows of K bf16 bits, each x (T, K) bf16 bits, both C-contiguous (w may be a larger buffer: n rows are read).
    Column-major view: y^T (N, T) with ld N, so output columns col0 .. col0 + n are rows col0.. of y^T: the
    pointer moves by col0 and ldc stays N."""
    from cupy_backends.cuda.libs import cublas

    T, N = y.shape
    n = N - col0 if n is None else n
    one, zero = np.ones(1, np.float32), np.zeros(1, np.float32)
    handle = cp.cuda.device.get_cublas_handle()
    # CuPy's shared handle keeps the stream its last user set: ours is the current one (where x's split and the
    # weight's dequant_split ran), as CuPy's own cuBLAS calls do
    cublas.setStream(handle, cp.cuda.get_current_stream().ptr)
    out = y.data.ptr + 4 * col0
    for i, (w, part) in enumerate(parts):
        # y^T (n, T) = w (n, K) . part^T (K, T); w's row-major bytes are w^T (K, n), ld K
        cublas.gemmEx(handle, 1, 0, n, T, K, one.ctypes.data, w.data.ptr, _CUDA_R_16BF, K, part.data.ptr,
                      _CUDA_R_16BF, K, (one if i else zero).ctypes.data, out, _CUDA_R_32F, N, _COMPUTE_32F,
                      _GEMM_DEFAULT)


def gemm_bf16(x, w, bf16_x: bool = False):
    """y (T, N) f32 = x (T, K) f32 @ w.T for w (N, K) bf16 bits, on the tensor cores (cuBLAS GemmEx, bf16 inputs,
    f32 accumulation). x is split into two bf16 halves (hi + lo) and multiplied twice, so the result keeps f32
    activations' accuracy (~1e-5 relative) at twice the FLOPs of one bf16 GEMM: prefill stays compute-bound.
    ``bf16_x`` (cuda.compute-quantization bf16): x rounded to bf16 (its hi half), one GEMM."""
    T, K = x.shape
    N = w.shape[0]
    y = cp.empty((T, N), dtype=cp.float32)
    if bf16_x:
        _gemms_bf16(y, [(w, fp8_mma.bf16_round(x))], K)
        return y
    hi, lo = bf16_split(x)
    _gemms_bf16(y, [(w, hi), (w, lo)], K)
    return y


# -- prefill for quantized weights on the tensor cores (kernels/dequant_split.cu) --------------------------------
SPLIT_SLAB = 1 << 25  # weight values dequantized into bf16 W_hi + W_lo at once (two 64 MB buffers)


def _slab_rows(N: int, K: int) -> int:
    """Weight rows a slab: SPLIT_SLAB values, a multiple of 128 rows when that many fit (aligned output columns)."""
    step = max(1, SPLIT_SLAB // max(K, 1))
    if step >= 128:
        step -= step % 128
    return min(step, N)


def _split_out(out, rows: int, K: int):
    """(hi, lo) (rows, K) uint16 views: of the given flat buffers (at least rows * K values each), or fresh."""
    if out is None:
        return cp.empty((rows, K), cp.uint16), cp.empty((rows, K), cp.uint16)
    assert all(b.dtype == cp.uint16 and b.flags.c_contiguous and b.size >= rows * K for b in out)
    return tuple(b.reshape(-1)[:rows * K].reshape(rows, K) for b in out)


def _grid(n: int) -> tuple[int]:
    return (min((n + 255) // 256, 65536),)


def fp8_split(data, scale, block=None, row0: int = 0, rows: int | None = None, out=None):
    """(W_hi, W_lo), each (rows, K) bf16 bits, for rows row0 .. row0 + rows of the fp8 weight W = e4m3(data) x
    scale (one f32 multiply, as ``dequantize_fp8``; every layout of ``fp8_block``): W_hi = bf16(W), W_lo =
    bf16(W - W_hi), rounded to nearest even. data (N, K) e4m3 bytes, C-contiguous; out: optional flat uint16
    buffers (hi, lo) of at least rows * K values to write into."""
    N, K = data.shape
    rows = N - row0 if rows is None else rows
    assert data.dtype == cp.uint8 and data.flags.c_contiguous and 0 <= row0 and row0 + rows <= N, (
        data.dtype, data.shape, row0, rows)
    br, bc, sk = fp8_block((N, K), scale, block)
    s = cp.ascontiguousarray(cp.asarray(scale, dtype=cp.float32))
    hi, lo = _split_out(out, rows, K)
    vec = (K % 8 == 0 and bc % 8 == 0 and data.data.ptr % 8 == 0 and hi.data.ptr % 16 == 0
           and lo.data.ptr % 16 == 0 and N < 2**31)
    if rows * K and vec:  # 8 values a thread (the usual case)
        _fn("dequant_split", "dequant_split_fp8_v8")((-(-K // 1024), min(rows, 65535)), (128,), (
            data, s, hi, lo, np.int32(row0), np.int32(rows), np.int32(K), np.int32(br), np.int32(bc),
            np.int32(sk)))
    elif rows * K:
        _fn("dequant_split", "dequant_split_fp8")(_grid(rows * K), (256,), (
            data, s, hi, lo, np.int64(row0), np.int64(rows), np.int32(K), np.int32(br), np.int32(bc),
            np.int32(sk)))
    return hi, lo


def nvfp4_split(data, block, global_scale, row0: int = 0, rows: int | None = None, out=None):
    """(W_hi, W_lo), each (rows, K) bf16 bits, for rows row0 .. row0 + rows of an NVFP4 weight: W as
    ``nvfp4_dequantize`` computes it ((e2m1 x block scale) x global scale), W_hi = bf16(W), W_lo = bf16(W - W_hi).
    data (N, K/2) packed codes, block (N, K/16) e4m3 bytes; out as for ``fp8_split``."""
    N, half = data.shape
    K = 2 * half
    rows = N - row0 if rows is None else rows
    assert data.dtype == cp.uint8 and block.dtype == cp.uint8 and block.shape == (N, K // 16), (data.shape,
                                                                                              block.shape)
    assert data.flags.c_contiguous and 0 <= row0 and row0 + rows <= N, (row0, rows, N)
    hi, lo = _split_out(out, rows, K)
    vec = (K % 16 == 0 and data.data.ptr % 8 == 0 and hi.data.ptr % 16 == 0 and lo.data.ptr % 16 == 0
           and N < 2**31)
    if rows * half and vec:  # 16 values a thread (the usual case)
        _fn("dequant_split", "dequant_split_nvfp4_v16")((-(-K // 2048), min(rows, 65535)), (128,), (
            data, cp.ascontiguousarray(block), hi, lo, np.int32(row0), np.int32(rows), np.int32(K),
            np.float32(global_scale)))
    elif rows * half:
        _fn("dequant_split", "dequant_split_nvfp4")(_grid(rows * half), (256,), (
            data, cp.ascontiguousarray(block), hi, lo, np.int64(row0), np.int64(rows), np.int32(K),
            np.float32(global_scale)))
    return hi, lo


def prefill_supported(x, data, T: int, N: int, K: int) -> bool:
    """Whether the tensor-core prefill path applies: device x with T >= GEMM_MIN_T tokens, a C-contiguous 2-D byte
    weight, nothing empty."""
    return (isinstance(x, cp.ndarray) and T >= GEMM_MIN_T and N > 0 and K > 0 and data.ndim == 2 and
            data.dtype == cp.uint8 and data.flags.c_contiguous)


def gemm_split(x, N: int, split, bf16_x: bool = False):
    """y (T, N) f32 = x (T, K) @ W.T on the tensor cores, for a quantized W (N, K) given slab by slab as
    ``split(row0, rows, out) -> (W_hi, W_lo)`` bf16 bits: y = x_hi.W_hi^T + x_lo.W_hi^T + x_hi.W_lo^T (three
    GemmEx per slab into the slab's output columns; x_lo.W_lo^T, ~2^-18 relative, is dropped). The two bf16
    buffers hold at most SPLIT_SLAB values each and are reused from slab to slab (same stream: ordered).
    ``bf16_x`` (cuda.compute-quantization bf16): x rounded to bf16, y = x_hi.W_hi^T + x_hi.W_lo^T (two GemmEx)."""
    T, K = x.shape
    xh, xl = (fp8_mma.bf16_round(x), None) if bf16_x else bf16_split(x)
    y = cp.empty((T, N), dtype=cp.float32)
    step = _slab_rows(N, K)
    bufs = (cp.empty(step * K, cp.uint16), cp.empty(step * K, cp.uint16))
    for r in range(0, N, step):
        n = min(step, N - r)
        wh, wl = split(r, n, bufs)
        _gemms_bf16(y, [(wh, xh), (wl, xh)] if bf16_x else [(wh, xh), (wh, xl), (wl, xh)], K, r, n)
    return y


def linear_bf16(x, w: Weight):
    return _linear16(x, w)


def linear_f16(x, w: Weight):
    return _linear16(x, w)


def _e4m3_table() -> np.ndarray:
    """The f32 value of each e4m3fn byte (NaN at 0x7f / 0xff)."""
    b = np.arange(256)
    e, m = (b >> 3) & 15, (b & 7).astype(np.float64)
    v = np.where(e == 0, m / 8 * 2.0**-6, (1 + m / 8) * 2.0 ** (e - 7))
    v = np.where((e == 15) & (m == 7), np.nan, v) * np.where(b >> 7, -1.0, 1.0)
    return v.astype(np.float32)


def e4m3_to_f32(data):
    """uint8 e4m3fn bytes (any shape) -> f32, through a 256-entry table (a device constant: kernels.constant)."""
    return kernels.constant("e4m3", _e4m3_table)[data]


def dequantize_fp8(w: Weight):
    """The f32 matrix (N, K) an fp8 Weight stands for: value x scale per block / channel / tensor."""
    N, K = w.shape
    data = e4m3_to_f32(w.data)
    br, bc, sk = fp8_block((N, K), w.scale, w.block)
    s = cp.asarray(w.scale, dtype=cp.float32).reshape(-1, sk)
    s = cp.repeat(cp.repeat(s, br, axis=0)[:N], bc, axis=1)[:, :K] if sk > 1 or s.shape[0] > 1 else s
    return data * s


def linear_fp8(x, w: Weight):  # x (..., K), w (N, K) e4m3 + scale -> (..., N) f32
    """The fp8 GEMV for T <= 8 (aligned); else from T = 5: the tensor-core prefill GEMM (``gemm_split``, or with
    LUMEN_CUDA_MMA_PREFILL one of ``fp8_mma``'s); else the dequantized f32 matrix through cuBLAS SGEMM."""
    K = w.shape[-1]
    x2 = x.reshape(-1, K) if x.ndim != 2 else x
    T, N = x2.shape[0], w.shape[0]
    if isinstance(x, cp.ndarray) and gemv_supported("fp8", w.data, T, K, w.block):
        y = gemv_fp8(x2, w.data, w.scale, w.block)
    elif prefill_supported(x, w.data, T, N, K) and (how := fp8_mma.mode(w)):  # LUMEN_CUDA_MMA_PREFILL only
        y = fp8_mma.linear(x2, w, how)
    elif prefill_supported(x, w.data, T, N, K):
        y = gemm_split(x2.astype(cp.float32, copy=False), N,
                       lambda r, n, out: fp8_split(w.data, w.scale, w.block, r, n, out), w.activations == "bf16")
    else:  # fallback where neither applies (T <= 4 with an unaligned weight, a strided weight): f32 SGEMM
        y = cp.matmul(x2.astype(cp.float32, copy=False), dequantize_fp8(w).T)
    return y if x.ndim == 2 else y.reshape(*x.shape[:-1], y.shape[-1])


def embedding_fp8(ids, w: Weight):  # ids (T,) -> (T, H) f32: the rows, times their scales (as the CPU op)
    idx = device_ids(ids)
    N, K = w.shape
    br, bc, sk = fp8_block((N, K), w.scale, w.block)
    s = cp.asarray(w.scale, dtype=cp.float32).reshape(-1, sk)
    if s.shape[0] == 1 and sk == 1:  # per-tensor
        rs = s.reshape(1, 1)
    else:  # per-channel (one column block) or blocks: the scale row of each id, widened over its columns
        rs = cp.repeat(s[idx // br], bc, axis=1)[:, :K]
    return e4m3_to_f32(w.data[idx]) * rs


# -- NVFP4 ------------------------------------------------------------------------------------------------------
NVFP4_SLAB = 1 << 25  # f32 values dequantized at once by linear_nvfp4's SGEMM fallback (128 MB)


def nvfp4_dequantize(data, block, global_scale, out=None):
    """f32 (R, K) from packed E2M1 bytes ``data`` (R, K/2) and e4m3 bytes ``block`` (R, K/16) (kernels/nvfp4.cu):
    (e2m1 × block scale) × global scale, bit-identical to the CPU's ``dequantize_rows``."""
    R, half = data.shape
    K = 2 * half
    assert block.shape == (R, K // 16) and data.dtype == cp.uint8 and block.dtype == cp.uint8, (data.shape,
                                                                                              block.shape)
    data, block = cp.ascontiguousarray(data), cp.ascontiguousarray(block)
    y = cp.empty((R, K), dtype=cp.float32) if out is None else out
    n = R * half
    if n:
        grid = min((n + 255) // 256, 65536)
        _fn("nvfp4", "nvfp4_dequantize")((grid,), (256,), (data, block, y, np.int64(R), np.int32(K),
                                                            np.float32(global_scale)))
    return y


def dequantize_nvfp4(w: Weight):
    """The whole f32 matrix (N, K) an NVFP4 Weight stands for (a fresh array)."""
    return nvfp4_dequantize(w.data, w.scale.block, w.scale.global_scale)


def gemv_nvfp4(x, data, block, global_scale, out=None, rows: int | None = None):
    """y (T, N) f32 = x (T, K) f32 @ W.T for an NVFP4 W: packed codes ``data`` (N, K/2), e4m3 ``block`` scales
    (N, K/16), f32 ``global_scale``; dequantized in registers (kernels/gemv_nvfp4.cu); 1 <= T <= 8, K % 32 == 0."""
    if x.dtype == cp.uint16:
        raise ValueError("this GEMV takes f32 activations, not bf16 bits")
    x = _prep_x(x)
    T, K = x.shape
    N = data.shape[0]
    assert data.shape == (N, K // 2) and block.shape == (N, K // 16) and gemv_supported("nvfp4", data, T, K), (
        data.shape, block.shape, x.shape)
    rows = rows or ROWS["nvfp4"][T - 1]
    y = _out(out, T, N)
    _fn("gemv_nvfp4", f"gemv_nvfp4_t{T}_r{rows}")(((N + rows * WARPS - 1) // (rows * WARPS),), (WARPS * 32,),
                                                  (data, cp.ascontiguousarray(block), x, y, np.int32(N),
                                                   np.int32(K), np.float32(global_scale)))
    return y


def linear_nvfp4(x, w: Weight):  # x (..., K), w (N, K) NVFP4 -> (..., N) f32
    """T <= 8 (aligned): the NVFP4 GEMV (no cuBLAS: capturable); else from T = 5: the tensor-core prefill GEMM
    (``gemm_split``; opt-in: ``sm120``'s or ``fp8_mma``'s); where neither applies, dequantize a slab of rows at a time
    to f32 (kernels/nvfp4.cu), then cuBLAS SGEMM."""
    N, K = w.shape
    x2 = x.reshape(-1, K) if x.ndim != 2 else x
    x2 = x2.astype(cp.float32, copy=False)
    if gemv_supported("nvfp4", w.data, x2.shape[0], K):
        y = gemv_nvfp4(x2, w.data, w.scale.block, w.scale.global_scale)
        return y if x.ndim == 2 else y.reshape(*x.shape[:-1], N)
    if prefill_supported(x, w.data, x2.shape[0], N, K):
        terms = sm120.available()  # SM120 + LUMEN_CUDA_SM120_MMA only (lossy, opt-in: docs/cuda.md issue 21)
        if terms:
            y = sm120.linear_nvfp4(x2, w, terms)
        elif fp8_mma.nvfp4_exact(w):  # LUMEN_CUDA_MMA_PREFILL=exact only
            y = fp8_mma.linear_nvfp4(x2, w)
        else:
            y = gemm_split(x2, N, lambda r, n, out: nvfp4_split(w.data, w.scale.block, w.scale.global_scale, r, n,
                                                                out), w.activations == "bf16")
        return y if x.ndim == 2 else y.reshape(*x.shape[:-1], N)
    # fallback where neither applies (T <= 4 with K % 32 != 0, a strided weight): f32 slabs through SGEMM
    step = max(1, NVFP4_SLAB // max(K, 1))
    if step >= N:
        y = cp.matmul(x2, dequantize_nvfp4(w).T)
    else:
        y = cp.empty((x2.shape[0], N), dtype=cp.float32)
        for r in range(0, N, step):
            wr = nvfp4_dequantize(w.data[r:r + step], w.scale.block[r:r + step], w.scale.global_scale)
            y[:, r:r + step] = cp.matmul(x2, wr.T)
    return y if x.ndim == 2 else y.reshape(*x.shape[:-1], N)


def embedding_nvfp4(ids, w: Weight):  # ids (T,) -> (T, H): only those rows are dequantized
    idx = device_ids(list(np.asarray(ids).reshape(-1)))
    y = nvfp4_dequantize(w.data[idx], w.scale.block[idx], w.scale.global_scale)
    return y.reshape(*np.shape(ids), w.shape[-1])


def rms_norm(x, w, eps: float, offset: float = 0.0):  # x (..., D) f32, w (D,) f32 or None
    D = x.shape[-1]
    ok = isinstance(x, cp.ndarray) and x.dtype == cp.float32 and x.size > 0 and (
        w is None or (isinstance(w, cp.ndarray) and w.dtype == cp.float32 and w.shape == (D,)))
    if not ok:
        return cupy_ops.rms_norm(x, w, eps, offset)
    xc = cp.ascontiguousarray(x)
    y = cp.empty_like(xc)
    rows = xc.size // D
    threads = min(1024, max(32, ((D + 3) // 4 + 31) // 32 * 32))
    wc = cp.ascontiguousarray(w) if w is not None else np.uint64(0)  # a null pointer: no weight
    _fn("rms_norm", "rms_norm_f32")((rows,), (threads,), (xc, wc, y, np.int32(D), np.float32(eps),
                                                       np.float32(offset)))
    return y


def add_rms_norm(x, r, w, eps: float, offset: float = 0.0):
    """``ops.add_rms_norm`` in one launch (``add_rms_norm_f32``): (x + r, rms_norm(x + r)), the bits of the add and
    of ``rms_norm`` over its result. Other dtypes or shapes, or with LUMEN_CUDA_DECODE_FUSION=0: the two ops."""
    D = x.shape[-1]
    ok = (kernels.decode_fusion() and isinstance(x, cp.ndarray) and isinstance(r, cp.ndarray)
          and x.dtype == r.dtype == cp.float32 and x.size > 0 and r.shape == x.shape
          and (w is None or (isinstance(w, cp.ndarray) and w.dtype == cp.float32 and w.shape == (D,))))
    if not ok:
        s = x + r
        return s, rms_norm(s, w, eps, offset)
    xc, rc = cp.ascontiguousarray(x), cp.ascontiguousarray(r)
    s, y = cp.empty_like(xc), cp.empty_like(xc)
    threads = min(1024, max(32, ((D + 3) // 4 + 31) // 32 * 32))
    wc = cp.ascontiguousarray(w) if w is not None else np.uint64(0)
    _fn("rms_norm", "add_rms_norm_f32")((xc.size // D,), (threads,), (xc, rc, wc, s, y, np.int32(D), np.float32(eps),
                                                                     np.float32(offset)))
    return s, y


def rms_norm_gated(x, gate, w, eps: float):
    """``ops.rms_norm_gated`` in one launch (``rms_norm_gated_f32``): the same bits as ``rms_norm`` then
    ``cupy_ops.mul_silu``, which took two. Other dtypes or shapes: those two."""
    D = x.shape[-1]
    ok = (isinstance(x, cp.ndarray) and isinstance(gate, cp.ndarray) and x.dtype == gate.dtype == cp.float32
          and x.size > 0 and gate.shape == x.shape and isinstance(w, cp.ndarray) and w.dtype == cp.float32
          and w.shape == (D,))
    if not ok:
        return cupy_ops.mul_silu(rms_norm(x, w, eps), gate)
    xc, gc, wc = cp.ascontiguousarray(x), cp.ascontiguousarray(gate), cp.ascontiguousarray(w)
    y = cp.empty_like(xc)
    threads = min(1024, max(32, ((D + 3) // 4 + 31) // 32 * 32))
    _fn("rms_norm", "rms_norm_gated_f32")((xc.size // D,), (threads,), (xc, gc, wc, y, np.int32(D), np.float32(eps)))
    return y


# -- the contract's linear and fused projections ----------------------------------------------------------------
def linear(x, w: Weight):
    """The contract's ``linear`` without the GEMV kernels for dense formats (cuBLAS on the f32 matrix: the
    reference the kernels are checked against); fp8 / nvfp4 through their launchers above. ``ops.linear``."""
    if w.format in ("fp8", "nvfp4"):
        return linear_fp8(x, w) if w.format == "fp8" else linear_nvfp4(x, w)
    return cupy_ops.linear_dense(x, w)


def linear_any(x, w: Weight):
    """``linear`` through the fastest launcher for w's format (what the registered ops pick)."""
    if w.format in ("bf16", "f16"):
        return _linear16(x, w)
    if w.format == "f32":
        return linear_f32(x, w)
    return linear(x, w)


def _group(ws):
    """The parts of the projection group ``ws``: [(fused Weight, or None for a member alone, [(member index, first
    row, rows)])], made on its first call and kept on its first Weight (lumen_cuda.state): freed with the model,
    never seen by another engine."""
    groups = derived(ws[0]).setdefault("linear_groups", [])
    for refs, parts in groups:
        if len(refs) == len(ws) and all(r() is w for r, w in zip(refs, ws, strict=True)):
            return parts
    parts = fuse_group(ws, cp, partial_fusion())
    groups.append((tuple(weakref.ref(w) for w in ws), parts))
    return parts


def linear_group(x, ws):
    """[x @ w.T for w in ws] with one GEMV / GEMM per part of the group (the registered ``linear_group``: one read
    of x and one launch for q/k/v, gate/up, the Gated-DeltaNet input projections). Members that can share a matrix
    are fused on the first call; with LUMEN_CUDA_PARTIAL_FUSION=1 also where others of the group cannot, padding
    fp8 members to whole scale blocks (``fuse_plan``): the Gated-DeltaNet's fp8 qkv, z, b and a (b and a of 32 rows)
    are then one launch, not four."""
    out = [None] * len(ws)
    for w, members in _group(ws):
        if w is None:
            out[members[0][0]] = linear_any(x, ws[members[0][0]])
            continue
        y = linear_any(x, w)
        for i, r, n in members:
            out[i] = y[..., r:r + n]
    return out
