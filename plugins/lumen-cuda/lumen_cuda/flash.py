"""Causal prefill attention in one kernel launch (``kernels/flash_attention.cu``): FlashAttention-2 style, f32 SIMT,
online softmax, the (T, S) scores never written to memory. ``attend`` has the semantics of ``attention._attend``
(which calls it first for T > 1) and matches it to 1e-5 relative; it returns None for what it does not support, and
the caller then runs the CuPy path. ``LUMEN_CUDA_FLASH=0`` turns it off (read at every call). It also declines a
few queries over a long cache (more than LONG_KEYS keys and fewer than half as many blocks as SMs): there each
block would walk every key alone, and the CuPy path's small score matrix is cheaper (a split-K variant is not
written yet).

Launch configuration: ``flash_fwd_v<DV>_n<BN>`` grid (Hkv, ceil(T * G / 32)), 256 threads, G = Hq / Hkv,
DV = 128 / 256 / 512, the smallest >= Dv; BN = keys per tile, the largest of 64 / 32 / 16 whose shared memory
4 * (32 * (D + 4) + BN * (max(D, Dv) + 4) + 32 * BN + 32) bytes fits the device's per-block opt-in limit
(H200, 227 KB: BN = 64 for every D <= 512; 99 KB parts: BN = 32 at D = 256, 16 at D = 512).

The tensor-core kernel (``kernels/flash_mma.cu``, ``attend_mma``; the default since the twenty-fifth session where
measured faster, ``mma_wanted``; ``LUMEN_CUDA_FLASH=mma`` everywhere, ``=1`` never): keys and values that are bf16
values (a bf16 or fp8 KV cache), the queries and the probabilities as three bf16 planes that sum to them exactly, so
every MMA product is exact and only the f32 sums differ from the f32 kernel's order. ``flash_mma_w<W>_n<BN>_c<DVC>``:
grid (Hkv, ceil(T G / 16W), ceil(Dv / DVC)), 32W threads, W warps of 16 rows, BN keys a tile, DVC value columns a block
(a wider head computes its scores once a chunk); ``mma_kernel`` takes the first of MMA_VARIANTS whose ``mma_smem`` fits
the device (a 99 KB SM120 part runs D = 512 on the f32 kernel).
"""

from __future__ import annotations

import os

import cupy as cp
import numpy as np

from . import kernels

F32 = cp.float32
FILE = "flash_attention"
THREADS = 256
ROWS = 32  # FA_R: (query, head-of-group) rows per block
TILES = (64, 32, 16)  # keys per tile, largest first
MAX_DIM = 512  # D and Dv
DV_CLASSES = (128, 256, 512)  # kernel variants by value head dim
MAX_ROW_BLOCKS = 65535  # grid.y
LONG_KEYS = 2048  # above this many keys, decline a grid of fewer than half as many blocks as the device has SMs

_ATTR_SMEM_OPTIN = 97  # cudaDevAttrMaxSharedMemoryPerBlockOptin
_ATTR_SMS = 16  # cudaDevAttrMultiProcessorCount


MMA_FILE = "flash_mma"
MMA_VARIANTS = ((4, 64), (4, 32), (2, 64), (2, 32))  # (warps, keys per tile), preferred first


MMA_WIDE_MIN_KEYS = 2048  # the default's rule: value heads wider than 256 take the tensor-core kernel from here on


def mode(env=None) -> str:
    """``LUMEN_CUDA_FLASH``: unset (the default: the tensor-core kernel where it is measured faster, else the f32
    kernel), ``mma`` (the tensor-core kernel wherever it applies), ``1`` (the f32 kernel), ``0`` (no flash kernel:
    the CuPy path). Read at each call; anything else is an error naming it."""
    v = (os.environ if env is None else env).get("LUMEN_CUDA_FLASH", "")
    if v not in ("", "0", "1", "mma"):
        raise ValueError(f"LUMEN_CUDA_FLASH={v!r}: use mma (tensor-core flash kernel), 1 (the f32 kernel), 0 (neither) "
                         "or leave it unset (tensor cores where measured faster)")
    return v


def enabled() -> bool:
    return mode() != "0"


def mma_wanted(keys: int, dv: int) -> bool:
    """Whether a prefill over ``keys`` cached positions with value heads of ``dv`` tries the tensor-core kernel:
    always with ``mma``; by default except for heads wider than 256 over fewer than MMA_WIDE_MIN_KEYS keys, where
    the H100 measured the f32 kernel faster (Gemma-4 global layers, D = 512: 0.396 vs 0.470 ms at 512 tokens, 24.1
    vs 18.5 ms at 4096; docs/cuda.md)."""
    m = mode()
    return m == "mma" or (m == "" and (dv <= 256 or keys >= MMA_WIDE_MIN_KEYS))


def smem_bytes(D: int, Dv: int, bn: int) -> int:
    return 4 * (ROWS * (D + 4) + bn * (max(D, Dv) + 4) + ROWS * bn + ROWS)


def _smem_limit() -> int:
    return kernels.device_attribute(_ATTR_SMEM_OPTIN, kernels.DEFAULT_SMEM)


def _sm_count() -> int:
    return kernels.device_attribute(_ATTR_SMS, 1)


def _fn(name: str, smem: int) -> cp.RawKernel:
    return kernels.function(FILE, name, smem=smem)


def _ptr(x) -> int:
    return x.data.ptr


def _rows(x, width: int, dtype=F32):
    """x (H, S, width) as (array, head stride in elements) with contiguous 16-byte aligned rows of ``dtype`` (a view
    sliced along S is kept; anything else is copied)."""
    st, size = x.strides, np.dtype(dtype).itemsize
    if x.dtype != dtype or st[2] != size or st[1] != size * width or st[0] < 0 or st[0] % 16 or _ptr(x) % 16:
        x = cp.ascontiguousarray(x, dtype=dtype)
    if x.shape[0] > 1:
        return x, x.strides[0] // size
    return x, x.shape[1] * width


def _shapes(q, keys, vals, start: int, lo: int, window, dtype, d_mult: int, dv_mult: int):
    """(T, Hq, D, Hkv, S, Dv) when q (T, Hq, D), keys (Hkv, S, D) and vals (Hkv, S, Dv) are device arrays a flash
    kernel takes (keys / values of ``dtype``, or any dtype for None; D and Dv multiples of d_mult / dv_mult, at most
    MAX_DIM; sane positions and window), else None."""
    if not all(isinstance(a, cp.ndarray) for a in (q, keys, vals)) or q.ndim != 3 or keys.ndim != 3 or vals.ndim != 3:
        return None
    if dtype is not None and (keys.dtype != dtype or vals.dtype != dtype):
        return None
    T, Hq, D = q.shape
    Hkv, S, Dk = keys.shape
    Dv = vals.shape[2]
    if Dk != D or vals.shape[:2] != (Hkv, S) or Hkv == 0 or Hq % Hkv or T < 1 or S < 1:
        return None
    if not (0 < D <= MAX_DIM and 0 < Dv <= MAX_DIM and D % d_mult == 0 and Dv % dv_mult == 0):
        return None
    if start < 0 or lo < 0 or start + T >= 2 ** 30 or (window is not None and window < 1):
        return None
    return T, Hq, D, Hkv, S, Dv


def kernel_name(D: int, Dv: int, limit: int | None = None):
    """(kernel name, shared memory bytes) for head dims D, Dv, or None when no variant fits."""
    dv = next(c for c in DV_CLASSES if Dv <= c)
    for bn in TILES:
        smem = smem_bytes(D, Dv, bn)
        if limit is None or smem <= limit:
            return f"flash_fwd_v{dv}_n{bn}", smem
    return None


def attend(q, keys, vals, start: int, lo: int, scale: float, window: int | None, softcap: float | None):
    """q (T, Hq, D) at start.., keys (Hkv, S, D) / vals (Hkv, S, Dv) at lo.. -> (T, Hq, Dv) f32, as
    ``attention._attend``; None where unsupported or disabled."""
    shapes = _shapes(q, keys, vals, start, lo, window, None, 4, 4) if enabled() else None
    if shapes is None:
        return None
    T, Hq, D, Hkv, S, Dv = shapes
    G = Hq // Hkv
    nrb = -(-T * G // ROWS)
    if nrb > MAX_ROW_BLOCKS:
        return None
    if S > LONG_KEYS and 2 * Hkv * nrb < _sm_count():
        return None  # a few queries over a long cache: a block per 32 rows walks every key alone (no split-K yet)
    choice = kernel_name(D, Dv, _smem_limit())
    if choice is None:
        return None
    name, smem = choice
    win = 0 if window is None or window >= start + T else int(window)  # a window reaching past position 0: none
    cap = float(softcap) if softcap else 0.0
    qc = cp.ascontiguousarray(q, dtype=F32)
    kc, k_hs = _rows(keys, D)
    vc, v_hs = _rows(vals, Dv)
    out = cp.empty((T, Hq, Dv), dtype=F32)
    _fn(name, smem)((Hkv, nrb), (THREADS,),
                    (qc, kc, vc, out, np.int32(T), np.int32(Hq), np.int32(G), np.int32(S), np.int32(D),
                     np.int32(Dv), np.int64(k_hs), np.int64(v_hs), np.int32(start), np.int32(lo),
                     np.float32(scale), np.float32(cap), np.int32(win)),
                    shared_mem=smem)
    return out


def mma_smem(D: int, dvc: int, warps: int, bn: int) -> int:
    """Shared memory bytes of flash_mma_w<warps>_n<bn>_c<dvc> at head dim D: three query planes, a K and a V tile."""
    return 2 * (3 * 16 * warps * (D + 8) + bn * (D + 8) + bn * (dvc + 8))


def mma_kernel(D: int, Dv: int, limit: int | None = None):
    """(kernel name, shared memory bytes, warps, value columns a block) of the tensor-core kernel for head dims D, Dv,
    or None when no variant fits ``limit``."""
    for dvc in ((128,) if Dv <= 128 else (256, 128)):
        for warps, bn in MMA_VARIANTS:
            smem = mma_smem(D, dvc, warps, bn)
            if limit is None or smem <= limit:
                return f"flash_mma_w{warps}_n{bn}_c{dvc}", smem, warps, dvc
    return None


def attend_mma(q, keys, vals, start: int, lo: int, scale: float, window: int | None, softcap: float | None):
    """``attend`` on the tensor cores for keys / values given as bf16 bits (uint16, (Hkv, S, D) / (Hkv, S, Dv)):
    the same result to f32 rounding; None where unsupported (then the caller decodes them for ``attend``)."""
    shapes = _shapes(q, keys, vals, start, lo, window, cp.uint16, 16, 8)
    if shapes is None:
        return None
    T, Hq, D, Hkv, S, Dv = shapes
    choice = mma_kernel(D, Dv, _smem_limit())
    if choice is None:
        return None
    name, smem, warps, dvc = choice
    G = Hq // Hkv
    nrb, nz = -(-T * G // (16 * warps)), -(-Dv // dvc)
    if nrb > MAX_ROW_BLOCKS:
        return None
    if S > LONG_KEYS and 2 * Hkv * nrb * nz < _sm_count():
        return None  # a few queries over a long cache: each block would walk every key alone
    win = 0 if window is None or window >= start + T else int(window)
    cap = float(softcap) if softcap else 0.0
    qc = cp.ascontiguousarray(q, dtype=F32)
    kc, k_hs = _rows(keys, D, cp.uint16)
    vc, v_hs = _rows(vals, Dv, cp.uint16)
    out = cp.empty((T, Hq, Dv), dtype=F32)
    kernels.function(MMA_FILE, name, smem=smem)(
        (Hkv, nrb, nz), (32 * warps,),
        (qc, kc, vc, out, np.int32(T), np.int32(Hq), np.int32(G), np.int32(S), np.int32(D), np.int32(Dv),
         np.int64(k_hs), np.int64(v_hs), np.int32(start), np.int32(lo), np.float32(scale), np.float32(cap),
         np.int32(win)),
        shared_mem=smem)
    return out


FP8_CHUNKS = (128, 256)  # value columns a block of flash_fp8_w4_n64_c<DVC>
FP8_ROWS = 64  # (query, head-of-group) rows a block
FP8_TILE = 64  # keys a tile


def fp8_smem(D: int, dvc: int) -> int:
    """Shared memory bytes of flash_fp8_w4_n64_c<dvc>: query codes, K tile, V^T tile, row scales."""
    return FP8_ROWS * (D + 16) + FP8_TILE * (D + 16) + dvc * (FP8_TILE + 16) + 4 * FP8_ROWS


def fp8_native() -> bool:
    """Whether the module was compiled with the e4m3 MMA (sm_89 and later), asked of the device once
    (``kernels.device_fact``)."""

    def ask() -> int:
        flag = cp.zeros(1, dtype=cp.int32)
        kernels.function(MMA_FILE, "flash_fp8_native")((1,), (1,), (flag,))
        return int(flag.get()[0])

    return kernels.device_fact("flash_fp8_native", ask) == 1


def fp8_vt(vals):
    """vals (Hkv, S, Dv) e4m3 bytes -> (Hkv, Dv, S16) as ``kernels/flash_mma.cu``'s ``fp8_vt`` lays them out for the
    FP8 kernel's P V (S16 = S rounded up to 16; the keys of each 16 permuted; zero past S)."""
    Hkv, S, Dv = vals.shape
    vc, v_hs = _rows(vals, Dv, cp.uint8)
    S16 = -(-S // 16) * 16
    vt = cp.empty((Hkv, Dv, S16), dtype=cp.uint8)
    kernels.function(MMA_FILE, "fp8_vt")((S16 // 16, Hkv), (256,),
                                         (vc, vt, np.int32(S), np.int32(S16), np.int32(Dv), np.int64(v_hs)))
    return vt


def attend_fp8(q, keys, vals, start: int, lo: int, scale: float, window: int | None, softcap: float | None,
               checked: bool = False):
    """FP8 attention (``attention.compute-quantization: fp8``) for q (T, Hq, D) f32 over an fp8 cache's keys / values
    (Hkv, S, D) / (Hkv, S, Dv) e4m3 bytes: ``fp8_attention_model.attend_tiled``'s arithmetic on the e4m3 MMA; None
    where it does not apply (then the caller runs the f32 path over the same fp8 values)."""
    shapes = _shapes(q, keys, vals, start, lo, window, cp.uint8, 32, 16)
    if shapes is None:
        return None
    T, Hq, D, Hkv, S, Dv = shapes
    dvc = 128 if Dv <= 128 else 256
    smem = fp8_smem(D, dvc)
    if smem > _smem_limit() or not fp8_native() or (not checked and fp8_check() is not None):
        return None
    G = Hq // Hkv
    nrb, nz = -(-T * G // FP8_ROWS), -(-Dv // dvc)
    if nrb > MAX_ROW_BLOCKS:
        return None
    win = 0 if window is None or window >= start + T else int(window)
    cap = float(softcap) if softcap else 0.0
    qc = cp.ascontiguousarray(q, dtype=F32)
    kc, k_hs = _rows(keys, D, cp.uint8)
    vt = fp8_vt(vals)
    out = cp.empty((T, Hq, Dv), dtype=F32)
    kernels.function(MMA_FILE, f"flash_fp8_w4_n64_c{dvc}", smem=smem)(
        (Hkv, nrb, nz), (128,),
        (qc, kc, vt, out, np.int32(T), np.int32(Hq), np.int32(G), np.int32(S), np.int32(vt.shape[2]), np.int32(D),
         np.int32(Dv), np.int64(k_hs), np.int32(start), np.int32(lo), np.float32(scale), np.float32(cap),
         np.int32(win)),
        shared_mem=smem)
    return out


FP8_PROBLEMS = {1: "this GPU has no e4m3 MMA (FP8 attention needs compute capability 8.9 or later)",
                2: "the FP8 attention kernel declined its own check case",
                3: "the FP8 attention kernel disagreed with its model (fp8_attention_model.attend_tiled) on this GPU"}


def fp8_check() -> str | None:
    """Once per device (``kernels.device_fact``), before a model uses FP8 attention: why it cannot run here (a device
    without the e4m3 MMA), or the FP8 kernel on a small case disagreeing with ``fp8_attention_model.attend_tiled``
    (the same arithmetic up to the MMA's own sums, which move a few p across an e4m3 rounding step: the mean |diff|
    within 1e-3 of the scale, none beyond 5%, as tests/test_cuda_flash.py asks); None when it agrees. The cuda
    backend refuses the setting with this reason instead of computing wrong attention."""
    return FP8_PROBLEMS.get(kernels.device_fact("flash_fp8_check", _fp8_check_code))


def _fp8_check_code() -> int:
    import ml_dtypes

    from . import fp8_attention_model

    if not fp8_native():
        return 1
    rng = np.random.default_rng(21)
    T, Hq, Hkv, D, start = 40, 4, 2, 64, 30
    q = rng.normal(size=(T, Hq, D)).astype(np.float32)
    k8 = rng.normal(size=(Hkv, start + T, D)).astype(ml_dtypes.float8_e4m3fn)
    v8 = (rng.normal(size=(Hkv, start + T, D)) * 2).astype(ml_dtypes.float8_e4m3fn)
    got = attend_fp8(cp.asarray(q), cp.asarray(k8.view(np.uint8)), cp.asarray(v8.view(np.uint8)), start, 0,
                     D ** -0.5, None, None, checked=True)
    if got is None:
        return 2
    want = fp8_attention_model.attend_tiled(q, k8.astype(np.float32), v8.astype(np.float32), start, 0, D ** -0.5,
                                            bn=FP8_TILE, rows=FP8_ROWS)
    diff = np.abs(got.get().astype(np.float64) - want)
    scale = max(1.0, float(np.abs(want).max()))
    if not np.isfinite(diff).all() or diff.max() > 0.05 * scale or diff.mean() > 1e-3 * scale:
        return 3
    return 0
