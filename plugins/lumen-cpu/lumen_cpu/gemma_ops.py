"""CPU ops added for Gemma: packed-expert MoE, a row gather, and the sliding / shared KV-cache attention ops
(implemented in ``attention.py`` beside the full-cache attention they share their kernel with)."""

from __future__ import annotations

import numpy as np

from lumen_core.backend import Weight

from .attention import attention_shared, sliding_kv_cache
from .ops import gelu_tanh_mul, silu_mul

F32 = np.float32


def gather(table, ids):  # table (N, ...), ids int (...) -> rows of table, (..., ...)
    return table[np.asarray(ids, dtype=np.int64)]


def moe_experts_packed(x, ids, weights, gate_up: Weight, down: Weight, act: str = "gelu_tanh"):
    """Like ``moe_experts`` with every expert in one tensor, as Gemma 4 checkpoints store them.

    x (T, H); ids, weights (T, k); gate_up (E, 2I, H): each expert's gate rows then up rows; down (E, H, I).
    bf16 experts run in lumen_cpu.moe_fused; the rest (and the reference: ``moe_experts_packed_per_expert``), one
    expert at a time through BLAS.
    """
    if gate_up.format == "bf16":
        from . import moe_fused

        y = moe_fused.experts_packed(x, ids, weights, gate_up, down, act)
        if y is not None:
            return y
    return moe_experts_packed_per_expert(x, ids, weights, gate_up, down, act)


def moe_experts_packed_per_expert(x, ids, weights, gate_up: Weight, down: Weight, act: str = "gelu_tanh"):
    """``moe_experts_packed`` one expert at a time (the matrix widened to f32, then BLAS)."""
    out = np.zeros_like(x)
    mul = silu_mul if act == "silu" else gelu_tanh_mul
    for e in np.unique(ids):
        tok, slot = np.nonzero(ids == e)
        h = x[tok]
        gu = h @ _expert(gate_up, e).T  # (n, 2I)
        half = gu.shape[-1] // 2
        y = mul(gu[:, :half], gu[:, half:]) @ _expert(down, e).T
        np.add.at(out, tok, y * weights[tok, slot][:, None])
    return out


def _expert(w: Weight, e: int) -> np.ndarray:
    """Expert e's (rows, cols) matrix in f32 (bf16 / f16 widen here)."""
    if w.scale is not None or w.format not in ("f32", "bf16", "f16"):
        raise NotImplementedError(f"packed experts in format {w.format!r} are not supported on the CPU yet")
    return w.data[e].astype(F32, copy=False)


def table():
    """(op, function, variant) rows, appended to ``ops.table()``."""
    return [(f.__name__, f, None) for f in (gather, moe_experts_packed, sliding_kv_cache, attention_shared)]
