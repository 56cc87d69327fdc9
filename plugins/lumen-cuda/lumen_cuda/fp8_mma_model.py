"""The fp8 tensor-core prefill GEMMs (kernels/gemm_fp8.cu) without a GPU: their option, where they apply, and their
arithmetic in numpy, so the CPU tests pin what the kernels must compute (lumen_cuda/fp8_mma.py launches them).

``LUMEN_CUDA_MMA_PREFILL`` picks where they run (``requested``, ``experts_requested``):

- unset or empty (the default): routed experts' grouped prefill (fp8, NVFP4, bf16) on the bf16 tensor cores with
  f32-exact products (``exact`` below), measured 2.06x the CUDA-core grouped kernels on the 35B-A3B fp8 prefill;
  dense GEMMs on ``gemv.gemm_split`` (three cuBLAS bf16 GEMMs over a dequantized bf16 hi + lo copy of each weight
  slab, ~f32 accurate), which beats these kernels on dense shapes (docs/cuda.md).
- ``0``: neither: the CUDA-core grouped experts and ``gemm_split``.
- ``exact``: the routed experts, and dense fp8 and NVFP4 GEMMs too, on the kernel below.
- ``e4m3``: the routed experts as by default; dense fp8 GEMMs on the e4m3 kernel (lossy).

``LUMEN_CUDA_X3_SLOTS`` (16, 32 or 64; unset: 32) sets the routed experts' block width in slots (``slot_block``).

The two kernels:

- ``exact``: the e4m3 weights are exact in bf16, and each activation goes in as three bf16 planes whose sum is its
  f32 value exactly (``x_planes``), so each product is exact in f32; a 128-column block's sum (f32, on the bf16
  tensor cores) is then scaled by the weight's block scale (``gemm_x3``). Accurate as the f32 path up to rounding
  order; no dequantized copy.
- ``e4m3``: the activations are quantized to e4m3 per token and 128 columns (``quantize_x``: scale = amax / 448 in
  f32, codes = nearest e4m3 of |x| / scale, ties to even, saturated at 448) and the codes' products summed on the
  e4m3 tensor cores, each block's sum times (weight block scale x token scale) (``gemm``). Lossy: an e4m3 activation
  keeps 4 significant bits, so an output moves by up to ~2.5% of the outputs' largest value (median 0.34%; 512
  Gaussian tokens x 4096 x 1024, tests/test_fp8_mma_model.py), as in vLLM's block-fp8 linear.
"""

from __future__ import annotations

import numpy as np

from .sm120_layout import E4M3, e4m3_rne

OPTION = "LUMEN_CUDA_MMA_PREFILL"  # exact | e4m3: prefill on the tensor cores (fp8_mma); 0 / unset: the defaults
MODES = ("exact", "e4m3")
BLOCK = 128  # the weight's block scales (rows and columns) and the activations' scale group
SLOT_DEFAULT = 32  # slot_block's width: fastest of 16 / 32 / 64 at every measured shape and T (docs/cuda.md)
MIN_CAPABILITY = 89  # mma.sync m16n8k32 .e4m3 and cvt .e4m3x2: Ada (8.9), Hopper (9.0), Blackwell (10.x, 12.x)
F32 = np.float32


def requested(environ) -> str:
    """``LUMEN_CUDA_MMA_PREFILL`` from ``environ`` for dense GEMMs: "" (``gemm_split``) where unset, empty or "0",
    else "exact" or "e4m3"; anything else is an error naming the choices (never a silent default)."""
    raw = environ.get(OPTION, "").strip()
    if raw in ("", "0"):
        return ""
    if raw in MODES:
        return raw
    from lumen_core.errors import LumenError

    raise LumenError(f"{OPTION}={raw!r}: expected unset (the default: routed experts' prefill on the bf16 tensor "
                     f"cores, f32-exact products; dense GEMMs on cuBLAS), exact (dense fp8 / NVFP4 GEMMs on the "
                     f"tensor cores too), e4m3 (dense fp8 GEMMs on the e4m3 tensor cores, activations quantized to "
                     f"e4m3: lossy) or 0 (no tensor-core kernels of this module); docs/cuda.md, tensor-core prefill")


def experts_requested(environ) -> bool:
    """Whether routed experts' grouped prefill may run on the tensor cores: every value but "0" (checked as
    ``requested``)."""
    requested(environ)
    return environ.get(OPTION, "").strip() != "0"


SLOTS_OPTION = "LUMEN_CUDA_X3_SLOTS"  # 16 | 32 | 64: the routed experts' slots a tensor-core block; unset: 32
SLOT_BLOCKS = (16, 32, 64)  # slots a block: 16 / 32 with 256 weight rows, 64 with 128 (kernels/gemm_fp8.cu, X3)


def slot_block(environ) -> int:
    """The routed experts' tensor-core block width in slots (``moe_*_x3_s32``: 32 slots x 256 weight rows, the
    default; ``moe_*_x3``: 64 x 128; ``*_s16``: 16 x 256): ``LUMEN_CUDA_X3_SLOTS`` where set. 32 was the fastest at
    every shape and T measured (H100, 35B-A3B and Gemma-4-26B-A4B experts, 512-4096 tokens: 64 computes a small
    bucket's padding, 16's warps of 32 x 16 do less work a weight fragment). A bad value raises, naming the
    choices."""
    raw = environ.get(SLOTS_OPTION, "").strip()
    if not raw:
        return SLOT_DEFAULT
    if raw.isdigit() and int(raw) in SLOT_BLOCKS:
        return int(raw)
    from lumen_core.errors import LumenError

    raise LumenError(f"{SLOTS_OPTION}={raw!r}: expected 16, 32 or 64 (the routed experts' slots a tensor-core "
                     f"block; unset: {SLOT_DEFAULT}); docs/cuda.md, tensor-core prefill")


# The x3 kernels' pipeline (kernels/gemm_fp8.cu's X3_STAGES, X3_KMUL): (stages in flight, columns a stage as a
# multiple of the format's base of 16 bf16 / 32 fp8 or NVFP4 columns), preferred first (docs/cuda.md, "A deeper
# pipeline"); the last is the geometry before it (two static stages, under 48 KB).
PIPES = ((3, 2), (2, 2), (2, 1))
X3_GEOMETRIES = ((128, 64), (256, 32), (256, 16))  # (weight rows, slots) of the x3 blocks (SLOT_BLOCKS, the GEMMs)
X3_STATIC_SMEM = 2 * 64 * 4  # a block's static shared memory at most (its slot rows, src and dst)


def x3_smem(fmt: str, rows: int, slots: int, pipe: tuple[int, int], planes: int = 3) -> int:
    """Dynamic shared memory bytes of an x3 block of ``rows`` weight rows x ``slots`` tokens: per stage, the rows'
    weight bytes and ``planes`` bf16 plane rows (3: exact; 1: bf16 activations), each padded by 16 bytes, and for
    NVFP4 the rows' block scales as bf16 pairs, a 4-byte word a 16 columns (gemm_fp8.cu's X3: SW + SX + SS)."""
    stages, kmul = pipe
    bk = (16 if fmt == "bf16" else 32) * kmul
    wb = bk // 2 if fmt == "nvfp4" else 2 * bk if fmt == "bf16" else bk
    scales = rows * (bk // 16) * 4 if fmt == "nvfp4" else 0
    return stages * (rows * (wb + 16) + planes * slots * (2 * bk + 16) + scales)


def x3_pipe(smem_block: int, smem_sm: int, smem_kept: int) -> tuple[int, int]:
    """The first of ``PIPES`` whose largest block fits a device's shared memory (``smem_block`` bytes a block may
    opt in to, ``smem_sm`` an SM, ``smem_kept`` the runtime keeps a block) twice an SM, the kernels'
    ``__launch_bounds__(256, 2)``: H100 / H200 (227 KB a block, 228 KB an SM) take (3, 2), ~114 KB a block; an
    SM120 or Ada card (99 / 100 KB) takes (2, 1), ~43 KB."""
    for pipe in PIPES:
        need = max(x3_smem(f, rows, slots, pipe) for f in ("fp8", "bf16", "nvfp4") for rows, slots in X3_GEOMETRIES)
        if need <= smem_block and 2 * (need + X3_STATIC_SMEM + smem_kept) <= smem_sm:
            return pipe
    return PIPES[-1]


def capable(cc) -> bool:
    """Whether a device of compute capability ``cc`` (CuPy's string, e.g. "90"; or a (major, minor) pair) has the
    e4m3 MMA: 8.9 and later."""
    if isinstance(cc, tuple):
        cc = f"{cc[0]}{cc[1]}"
    return int(cc) >= MIN_CAPABILITY


def applies(shape, block) -> bool:
    """Whether an fp8 weight of ``shape`` (N, K) and scale ``block`` takes the kernel: 128 x 128 block scales (the
    checkpoints' layout) and K a multiple of 128."""
    N, K = shape
    return tuple(block or ()) == (BLOCK, BLOCK) and K % BLOCK == 0 and N > 0 and K > 0


def quantize_x(x) -> tuple[np.ndarray, np.ndarray]:
    """x (T, K) f32 -> (codes (T, K) uint8 e4m3fn, scales (T, K/128) f32), as ``fp8_quantize_x``."""
    x = np.asarray(x, F32)
    T, K = x.shape
    blocks = x.reshape(T, K // BLOCK, BLOCK)
    amax = np.abs(blocks).max(axis=2)
    s = np.where(amax > 0, amax / F32(448.0), F32(1.0)).astype(F32)  # one IEEE f32 division, as __fdiv_rn
    mag = (np.abs(blocks) / s[:, :, None]).astype(F32)
    codes = e4m3_rne(mag) | np.where(blocks < 0, 0x80, 0).astype(np.uint8)
    return codes.reshape(T, K).astype(np.uint8), s


def gemm(xq, sx, wq, sw) -> np.ndarray:
    """y (T, N) float64 = sum over 128-column blocks kb of (codes' products summed) x f32(sw[n/128, kb] x sx[t, kb]),
    the kernel's arithmetic (its block sums and accumulation in f32; here exact, so compare to ~1e-5)."""
    xq, wq = np.asarray(xq, np.uint8), np.asarray(wq, np.uint8)
    T, K = xq.shape
    N = wq.shape[0]
    xv, wv = E4M3[xq].astype(np.float64), E4M3[wq].astype(np.float64)
    sw, sx = np.asarray(sw, F32), np.asarray(sx, F32)
    y = np.zeros((T, N))
    rows = np.arange(N) // BLOCK
    for kb in range(K // BLOCK):
        cols = slice(kb * BLOCK, (kb + 1) * BLOCK)
        blk = xv[:, cols] @ wv[:, cols].T
        scale = (sw[rows, kb][None, :] * sx[:, kb][:, None]).astype(F32)  # one f32 multiply, as the kernel
        y += blk * scale
    return y


def linear(x, wq, sw) -> np.ndarray:
    """The whole e4m3 path: x (T, K) f32 against an fp8 weight (codes (N, K), block scales (N/128, K/128))."""
    xq, sx = quantize_x(x)
    return gemm(xq, sx, wq, sw)


def bf16_rne(v) -> np.ndarray:
    """f32 -> bf16 bits, nearest even (finite values), as ``fp8_bf16_rne``."""
    u = np.asarray(v, F32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_value(h) -> np.ndarray:
    return (np.asarray(h, np.uint16).astype(np.uint32) << 16).view(F32)


def x_planes(x) -> np.ndarray:
    """x (T, K) f32 -> (3, T, K) bf16 bits: hi, mid, lo with hi + mid + lo = x exactly, as ``fp8_x_planes``."""
    x = np.asarray(x, F32)
    hi = bf16_rne(x)
    r = (x - bf16_value(hi)).astype(F32)
    mid = bf16_rne(r)
    lo = bf16_rne((r - bf16_value(mid)).astype(F32))
    return np.stack([hi, mid, lo])


def gemm_x3(planes, wq, sw) -> np.ndarray:
    """y (T, N) float64 = sum over 128-column blocks kb of sw[n/128, kb] x (codes . (hi + mid + lo)), the exact
    kernel's arithmetic (its block sums and accumulation in f32; here exact, so compare to ~1e-6)."""
    xv = sum(bf16_value(p).astype(np.float64) for p in np.asarray(planes, np.uint16))
    wv = E4M3[np.asarray(wq, np.uint8)].astype(np.float64)
    sw = np.asarray(sw, F32).astype(np.float64)
    T, K = xv.shape
    y = np.zeros((T, wv.shape[0]))
    rows = np.arange(wv.shape[0]) // BLOCK
    for kb in range(K // BLOCK):
        cols = slice(kb * BLOCK, (kb + 1) * BLOCK)
        y += (xv[:, cols] @ wv[:, cols].T) * sw[rows, kb][None, :]
    return y
