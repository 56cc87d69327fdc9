"""GGUF block formats on the CPU: the reference path. Dequantize on use, compute in f32.

A GGUF weight arrives as raw blocks: ``Weight.data`` is uint8, shape (rows, bytes per row), ``Weight.shape`` the
logical (rows, cols). ``gguf.quants.dequantize`` expands the blocks exactly as transformers does. Nothing is
cached: ``linear`` expands a slab of rows at a time (a few tens of MB), multiplies and drops it, and
``embedding`` expands only the rows of the requested ids, so a quantized weight costs its stored size and no more.

Every format keeps a plain ``linear_<fmt>_reference`` here, the baseline a faster (fused) kernel is checked
against; faster implementations register over these with a higher priority.
"""

from __future__ import annotations

import numpy as np

from lumen_core.backend import Weight

F32 = np.float32
SLAB_VALUES = 1 << 23  # f32 values dequantized at once by linear (32 MB)

# lower-case GGML type name -> (ggml type id, values per block, bytes per block)
FORMATS: dict[str, tuple[int, int, int]] = {
    "q4_0": (2, 32, 18), "q4_1": (3, 32, 20), "q5_0": (6, 32, 22), "q5_1": (7, 32, 24), "q8_0": (8, 32, 34),
    "q2_k": (10, 256, 84), "q3_k": (11, 256, 110), "q4_k": (12, 256, 144), "q5_k": (13, 256, 176),
    "q6_k": (14, 256, 210), "iq2_xxs": (16, 256, 66), "iq2_xs": (17, 256, 74), "iq3_xxs": (18, 256, 98),
    "iq1_s": (19, 256, 50), "iq4_nl": (20, 32, 18), "iq3_s": (21, 256, 110), "iq2_s": (22, 256, 82),
    "iq4_xs": (23, 256, 136), "iq1_m": (29, 256, 56), "tq1_0": (34, 256, 54), "tq2_0": (35, 256, 66),
    "mxfp4": (39, 32, 17),
}


def dequantize_blocks(data: np.ndarray, fmt: str) -> np.ndarray:
    """Raw blocks (..., bytes per row) -> float32 (..., values per row), as ``gguf.quants.dequantize``."""
    from gguf.quants import GGMLQuantizationType, dequantize

    return dequantize(np.ascontiguousarray(data), GGMLQuantizationType(FORMATS[fmt][0]))


def dequantize(w: Weight) -> np.ndarray:
    """The whole f32 matrix a block-quantized Weight stands for (a fresh array, never cached)."""
    return dequantize_blocks(w.data, w.format).reshape(w.shape)


def linear_reference(x, w: Weight):
    """x (..., in) @ W.T for a block-quantized W (out, in): dequantize a slab of rows at a time, f32 matmul."""
    rows, cols = w.shape[-2], w.shape[-1]
    data = w.data.reshape(rows, -1)
    out = np.empty((*x.shape[:-1], rows), dtype=F32)
    step = max(1, SLAB_VALUES // cols)
    for r in range(0, rows, step):
        out[..., r:r + step] = x @ dequantize_blocks(data[r:r + step], w.format).T
    return out


def embedding_reference(ids, w: Weight):
    """Rows ``ids`` of a block-quantized table (vocab, H) -> (T, H) f32; only those rows are dequantized."""
    idx = np.asarray(ids, dtype=np.int64)
    rows = w.data.reshape(w.shape[0], -1)[idx]
    return dequantize_blocks(rows, w.format).reshape(*idx.shape, w.shape[-1])


def _named(fmt: str):
    def linear(x, w: Weight):
        return linear_reference(x, w)

    linear.__name__ = linear.__qualname__ = f"linear_{fmt}_reference"
    linear.__doc__ = f"The reference {fmt.upper()} linear: dequantize (gguf.quants) then f32 matmul."
    return linear


linear_q4_0_reference = _named("q4_0")
linear_q4_1_reference = _named("q4_1")
linear_q5_0_reference = _named("q5_0")
linear_q5_1_reference = _named("q5_1")
linear_q8_0_reference = _named("q8_0")
linear_q2_k_reference = _named("q2_k")
linear_q3_k_reference = _named("q3_k")
linear_q4_k_reference = _named("q4_k")
linear_q5_k_reference = _named("q5_k")
linear_q6_k_reference = _named("q6_k")
REFERENCE = {fmt: globals().get(f"linear_{fmt}_reference") or _named(fmt) for fmt in FORMATS}


def table():
    """(op, function, variant) rows for the CPU backend: linear and embedding for every GGUF block format."""
    rows = [("linear", REFERENCE[fmt], fmt) for fmt in FORMATS]
    rows += [("embedding", embedding_reference, fmt) for fmt in FORMATS]
    return rows


__all__ = ["FORMATS", "REFERENCE", "dequantize", "dequantize_blocks", "embedding_reference", "linear_reference",
           "table"]
