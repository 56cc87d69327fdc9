"""NVFP4 (ModelOpt layout) on the CPU: weights stay packed, dequantized a slab of rows at a time on use.

``Weight.data`` is uint8 (N, K/2): two E2M1 codes a byte, element 2j in the low nibble, 2j+1 in the high one;
a code is sign << 3 | index into {0, 0.5, 1, 1.5, 2, 3, 4, 6}. ``Weight.scale`` is an ``NVFP4Scale``: the e4m3
scale of each 16 consecutive values of a row (N, K/16) and the f32 global scale. A value is
(e2m1 × block scale) × global scale; the first product is exact in f32, so only the second one rounds.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from lumen_core.backend import Weight

F32 = np.float32
GROUP = 16
SLAB_VALUES = 1 << 23  # f32 values dequantized at once by linear (32 MB)
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], F32)
# Both nibbles of every byte value at once: LUT[b] = (value of the low nibble, value of the high nibble).
PAIRS = np.stack([E2M1[np.arange(256) & 0x0F], E2M1[np.arange(256) >> 4]], axis=1)


@dataclass
class NVFP4Scale:
    block: np.ndarray  # float8_e4m3fn (N, K/16)
    global_scale: np.float32
    qx: bool = False  # cpu.compute-quantization "int8": one-token expert rows take 8-bit activations (moe_fused)
    bf16: bool = False  # cpu.compute-quantization "bf16": several tokens' expert products in bf16 AMX tiles

    @property
    def nbytes(self) -> int:
        return int(self.block.nbytes) + 4


def weight(array, scale, shape, store: str, qx: bool = False, bf16: bool = False) -> Weight:
    """A packed NVFP4 Weight from the checkpoint's arrays; ``scale`` = (block scales, global scale); ``qx``: see
    NVFP4Scale."""
    data = np.array(array) if store == "ram" else array
    block, global_scale = scale
    block = np.array(block, dtype=ml_dtypes.float8_e4m3fn) if store == "ram" else np.asarray(block)
    shape = tuple(shape or (data.shape[0], data.shape[1] * 2))
    n, k = shape
    if data.dtype != np.uint8 or data.shape != (n, k // 2) or block.shape != (n, k // GROUP):
        raise ValueError(f"nvfp4 weight {data.dtype} {data.shape} with scales {block.shape} does not make {shape}")
    gs = F32(np.asarray(global_scale, F32).reshape(()))
    return Weight(data, "nvfp4", shape, NVFP4Scale(block, gs, qx, bf16), (1, GROUP))


def dequantize_rows(data: np.ndarray, scale: NVFP4Scale, rows: slice | np.ndarray) -> np.ndarray:
    """f32 values of the given rows (R, K)."""
    packed = data[rows]
    vals = PAIRS[packed].reshape(packed.shape[0], -1, GROUP)  # (R, K/16, 16), low nibble first
    vals = vals * scale.block[rows].astype(F32)[..., None]
    return (vals * scale.global_scale).reshape(packed.shape[0], -1)


def dequantize(w: Weight) -> np.ndarray:
    """The whole f32 matrix (a fresh array, never cached)."""
    return dequantize_rows(w.data, w.scale, slice(None))


def linear_nvfp4(x, w: Weight):
    """x (..., K) @ W.T for W (N, K): one token through a fused GEMV (numba: codes and block scales decoded by
    table, the same f32 element values as ``dequantize``), more through tiles dequantized by numba and BLAS."""
    from . import nvfp4_fused

    rows, cols = w.shape
    x2 = np.ascontiguousarray(x, dtype=F32).reshape(-1, cols)
    out = np.empty((x2.shape[0], rows), dtype=F32)
    if x2.shape[0] == 1:
        nvfp4_fused.gemv(w, x2[0], out[0])
    else:
        step = max(1, nvfp4_fused.TILE_VALUES // cols)
        for r in range(0, rows, step):
            out[:, r:r + step] = x2 @ nvfp4_fused.dequantize_rows(w, r, min(r + step, rows)).T
    return out.reshape(*x.shape[:-1], rows)


def embedding_nvfp4(ids, w: Weight):
    """Rows ``ids`` of an NVFP4 table (vocab, H) -> (T, H) f32; only those rows are dequantized."""
    idx = np.asarray(ids, dtype=np.int64)
    return dequantize_rows(w.data, w.scale, idx.reshape(-1)).reshape(*idx.shape, w.shape[-1])


def table():
    return [("linear", linear_nvfp4, "nvfp4"), ("embedding", embedding_nvfp4, "nvfp4")]


__all__ = ["E2M1", "NVFP4Scale", "dequantize", "dequantize_rows", "embedding_nvfp4", "linear_nvfp4", "table",
           "weight"]
