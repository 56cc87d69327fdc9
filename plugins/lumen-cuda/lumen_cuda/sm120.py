"""The SM120 native NVFP4 prefill GEMM (kernels/mma_sm120.cu): selection, weight packing, launch. COMPILED, NEVER RUN:
no SM120 GPU was available when it was written (docs/cuda.md, "SM120 native MMA (issue 21): compiled, not run").

Opt-in, because it is lossy: the generic prefill (gemv.gemm_split) keeps activations at ~f32 accuracy, this path
quantizes them to NVFP4 (``LUMEN_CUDA_SM120_MMA`` = number of residual planes, 1..3; 0 / unset = off; read at each
call). ``available()`` is true only on a compute capability 12.x device with the option set; everywhere else
``gemv.linear_nvfp4`` runs its generic path unchanged.

- The weight is packed into the A-fragment layout (sm120_layout.pack_weight, on the device with CuPy) on its first
  native prefill and kept on the Weight (lumen_cuda.state): that copy costs the weight's size again in VRAM (the
  GEMV decode kernels keep reading the original layout).
- The module is compiled by NVRTC for ``-arch=sm_120a`` (``sm_121a`` on 12.1) here, not through
  ``kernels.module``: CuPy appends the plain device arch (``sm_120``) to every RawModule's options, and the
  block-scaled MMA needs the arch-specific target. The compiled module is cached per device by ``_module``
  (functools.cache: process-wide, like the caches of lumen_cuda.kernels, holding only compiled code). Before the
  first launch the module's ``sm120_native`` kernel must report that the MMA was compiled in; otherwise this
  raises instead of launching a trapping kernel.
"""

from __future__ import annotations

import functools
import os

import cupy as cp
import numpy as np

from lumen_core.backend import Weight

from .kernels import KERNEL_DIR, include_dirs
from .sm120_layout import MAX_TERMS, pack_weight, padded, use_native
from .state import derived

WARPS = 4  # SM120_WARPS in the .cu file: 16-row weight tiles per block
TOKENS = 32  # tokens per block (4 tiles of 8)


def available(device: int | None = None) -> int:
    """The number of activation planes to use (1..3) where the native path applies on ``device`` (the current one by
    default): compute capability 12.x and ``LUMEN_CUDA_SM120_MMA`` set; else 0. A bad option value raises."""
    if not os.environ.get("LUMEN_CUDA_SM120_MMA"):  # the common case: no device query
        return 0
    return use_native(cp.cuda.Device(device).compute_capability, os.environ)


@functools.cache
def _module(device: int):
    """kernels/mma_sm120.cu compiled by NVRTC for ``sm_<cc>a`` (sm_120a, sm_121a) and loaded on ``device``; raises
    where the MMA did not compile in."""
    from cupy_backends.cuda.libs import nvrtc

    arch = f"sm_{cp.cuda.Device(device).compute_capability}a"
    src = (KERNEL_DIR / "mma_sm120.cu").read_text()
    prog = nvrtc.createProgram(src, "mma_sm120.cu", (), ())
    try:
        options = (f"-arch={arch}", "-std=c++17", *(f"-I{d}" for d in include_dirs()))
        try:
            nvrtc.compileProgram(prog, options)
        except nvrtc.NVRTCError as e:
            raise RuntimeError(f"mma_sm120.cu does not compile for {arch}: {nvrtc.getProgramLog(prog)}") from e
        cubin = nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)
    with cp.cuda.Device(device):
        mod = cp.cuda.function.Module()
        mod.load(cubin)
        flag = cp.zeros(1, dtype=cp.int32)
        mod.get_function("sm120_native")((1,), (32,), (flag,))
        if int(flag.get()[0]) != 1:
            raise RuntimeError(f"mma_sm120.cu was compiled for {arch} without the block-scaled MMA")
    return mod


def _fn(name: str):
    return _module(cp.cuda.runtime.getDevice()).get_function(name)


def packed_weight(w: Weight):
    """(wq, ws) of an NVFP4 Weight in the A-fragment layout, made on first use and kept on the Weight."""
    d = derived(w)
    entry = d.get("sm120_nvfp4")
    if entry is None or entry[0] is not w.data:
        wq, ws = pack_weight(cp.ascontiguousarray(w.data), cp.ascontiguousarray(w.scale.block), xp=cp)
        entry = d["sm120_nvfp4"] = (w.data, wq, ws)
    return entry[1], entry[2]


def quantize_x(x, terms: int):
    """x (T, K) f32 device -> (xq, xs, gx): ``terms`` NVFP4 planes in the B-fragment layout (sm120_quantize_x;
    sm120_layout.quantize_x + pack_x is its model)."""
    T, K = x.shape
    Tp, KT = padded(T, 8), padded(K, 64) // 64
    xq = cp.zeros((terms, Tp // 8, KT, 32, 8), dtype=cp.uint8)
    xs = cp.zeros((terms, Tp // 8, KT, 8, 4), dtype=cp.uint8)
    gx = cp.zeros((terms, Tp), dtype=cp.float32)
    _fn("sm120_quantize_x")((T,), (256,), (x, xq, xs, gx, np.int32(T), np.int32(K), np.int32(Tp), np.int32(KT),
                                            np.int32(terms)))
    return xq, xs, gx


def gemm_nvfp4(x, wq, ws, global_scale: float, N: int, terms: int, planes=None):
    """y (T, N) f32 = x (T, K) . W^T for a packed NVFP4 weight, activations quantized to ``terms`` planes (or the
    given ``planes`` = (xq, xs, gx) from ``quantize_x``)."""
    T, K = x.shape
    xq, xs, gx = quantize_x(x, terms) if planes is None else planes
    NT, KT = wq.shape[:2]
    Tp = gx.shape[1]
    y = cp.empty((T, N), dtype=cp.float32)
    grid = (-(-NT // WARPS), -(-Tp // TOKENS))
    _fn(f"sm120_gemm_nvfp4_t{terms}")(grid, (WARPS * 32,), (wq, ws, xq, xs, gx, y, np.int32(N), np.int32(T),
                                                            np.int32(NT), np.int32(KT), np.int32(Tp),
                                                            np.float32(global_scale)))
    return y


def linear_nvfp4(x2, w: Weight, terms: int):
    """The native prefill for ``gemv.linear_nvfp4``: x2 (T, K) f32 device, w an NVFP4 Weight (N, K)."""
    if not 1 <= terms <= MAX_TERMS:
        raise ValueError(f"terms must be 1..{MAX_TERMS}, not {terms}")
    N, K = w.shape
    wq, ws = packed_weight(w)
    return gemm_nvfp4(cp.ascontiguousarray(x2, dtype=cp.float32), wq, ws, float(w.scale.global_scale), N, terms)
