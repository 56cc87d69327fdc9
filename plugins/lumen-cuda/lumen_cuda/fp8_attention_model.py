"""FP8 attention's arithmetic in numpy: what an FP8-MMA attention kernel (issue 21: LumenLLM's
``attention.compute-quantization: fp8`` over an fp8 KV cache) is to compute, so that its accuracy can be measured
on the CPU before the kernel exists (``benchmarks/fp8_attention_accuracy.py``) and the kernel tested against it.
``attend`` is the arithmetic with one softmax max per row (what the accuracy benchmark measured); ``attend_tiled``
is the kernel's own order (``kernels/flash_mma.cu``, ``flash_fp8_*``): tiles of keys, the running max, P rounded
against it, so that the kernel can be compared with it closely (the e4m3 rounding of P depends on that max).

- K and V: the cache's e4m3 values as stored (Lumen's fp8 cache has no scale and saturates at +-448).
- Q: each (token, head) row scaled into e4m3: ``sq = amax|q| / 448``, codes ``e4m3(q / sq)`` (nearest, ties to
  even); a zero row stays zero.
- Scores: the code products are exact in f32 (an e4m3 value has 4 significant bits), summed in f32 as the MMA's
  accumulator does, then times ``sq`` and the softmax scale; softcap and the causal / sliding mask as usual.
- Softmax in f32, FlashAttention style: ``m`` = the row's max, ``p = exp(s - m)`` in (0, 1], ``l`` = the sum of
  the f32 ``p`` (before rounding).
- P into e4m3 with a fixed scale: ``e4m3(p * 448)``: the largest p (1) becomes 448; a p below ~2^-9 / 448
  (~4.4e-6) rounds to zero, one below 2^-6 / 448 keeps fewer than 4 significant bits (e4m3's subnormals).
- Output: ``(P codes . V)`` summed in f32, divided by 448 and by ``l``.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from .flash_mma_model import mma_product, online_softmax

F32 = np.float32
E4M3 = ml_dtypes.float8_e4m3fn
E4M3_MAX = 448.0


def e4m3(x) -> np.ndarray:
    """f32 values rounded to e4m3 (nearest, ties to even), back in f32; |x| must be <= 448."""
    return np.asarray(x, F32).astype(E4M3).astype(F32)


def quantize_q(q) -> tuple[np.ndarray, np.ndarray]:
    """q (..., D) f32 -> (codes as f32 values (..., D), scales (..., 1)): q ~ codes * scales, per row."""
    q = np.asarray(q, F32)
    amax = np.abs(q).max(axis=-1, keepdims=True)
    sq = np.where(amax > 0, amax / F32(E4M3_MAX), F32(1)).astype(F32)
    return e4m3(np.clip(q / sq, -E4M3_MAX, E4M3_MAX)), sq


def mask(start: int, T: int, lo: int, end: int, window: int | None, blocks=None) -> np.ndarray:
    """(T, end - lo) bool: query start + i sees key j (causal, within the window; ``blocks`` as lumen_cpu's)."""
    qpos = np.arange(start, start + T)[:, None]
    kpos = np.arange(lo, end)[None, :]
    ok = kpos <= qpos
    for first, stop in blocks or ():
        ok |= (qpos >= first) & (qpos < stop) & (kpos >= first) & (kpos < stop)
    if window is not None:
        ok &= kpos > qpos - window
    return ok


def attend(q, keys, vals, start: int, lo: int, scale: float, window: int | None = None,
           softcap: float | None = None, blocks=None) -> np.ndarray:
    """The kernel's result for q (T, Hq, D) at positions start.., keys (Hkv, S, D) / vals (Hkv, S, Dv) at lo..
    (f32 arrays holding e4m3 values: an fp8 cache's) -> (T, Hq, Dv) f32. The signature of lumen_cpu's ``_attend``."""
    q = np.asarray(q, F32)
    keys, vals = np.asarray(keys, F32), np.asarray(vals, F32)
    T, hq, D = q.shape
    hkv, S, _ = keys.shape
    g = hq // hkv
    codes, sq = quantize_q(q)  # (T, Hq, D), (T, Hq, 1)
    qg = codes.transpose(1, 0, 2).reshape(hkv, g * T, D)  # (Hkv, g T, D)
    s = (qg @ keys.transpose(0, 2, 1)).reshape(hkv, g, T, S)
    s = s * sq.transpose(1, 0, 2).reshape(hkv, g, T, 1) * F32(scale)
    if softcap:
        s = np.tanh(s / F32(softcap)) * F32(softcap)
    s = np.where(mask(start, T, lo, lo + S, window, blocks), s, -np.inf).astype(F32)
    p = np.exp(s - s.max(axis=-1, keepdims=True)).astype(F32)
    l = p.sum(axis=-1, keepdims=True, dtype=F32)
    pq = e4m3(p * F32(E4M3_MAX))
    o = (pq.reshape(hkv, g * T, S) @ vals).reshape(hkv, g, T, -1) / F32(E4M3_MAX) / l
    return o.reshape(hq, T, -1).transpose(1, 0, 2).astype(F32)


def attend_tiled(q, keys, vals, start: int, lo: int, scale: float, window: int | None = None,
                 softcap: float | None = None, bn: int = 64, rows: int = 64) -> np.ndarray:
    """``attend`` in the FP8 kernel's order: per kv head, blocks of ``rows`` flattened (query, head-of-group) rows,
    each walking tiles of ``bn`` keys from its first visible key rounded down to 16, with the online softmax (P
    rounded to e4m3 against the running max, the accumulator rescaled as it moves)."""
    q = np.asarray(q, F32)
    keys, vals = np.asarray(keys, F32), np.asarray(vals, F32)
    T, hq, D = q.shape
    hkv, S, _ = keys.shape
    G = hq // hkv
    codes, sq = quantize_q(q)
    out = np.zeros((T, hq, vals.shape[2]), F32)
    for h in range(hkv):
        qc = codes[:, h * G:(h + 1) * G].reshape(T * G, D)
        qs = sq[:, h * G:(h + 1) * G].reshape(T * G)
        rpos = np.repeat(start + np.arange(T), G)
        o = np.zeros((T * G, vals.shape[2]), F32)
        for r0 in range(0, T * G, rows):
            r1 = min(T * G, r0 + rows)
            qmin, qmax = rpos[r0], rpos[r1 - 1]
            j_begin = (max(0, qmin - window + 1 - lo) if window else 0) & ~15
            j_end = min(S, qmax - lo + 1)
            m = np.full(r1 - r0, -np.inf, F32)
            l = np.zeros(r1 - r0, F32)
            acc = np.zeros((r1 - r0, vals.shape[2]), F32)
            for j0 in range(j_begin, j_end, bn):
                j1 = min(j_end, j0 + bn)
                s = mma_product([qc[r0:r1]], keys[h, j0:j1], np.zeros((r1 - r0, j1 - j0), F32), k=32)
                s = s * qs[r0:r1, None] * F32(scale)
                if softcap:
                    s = np.tanh(s / F32(softcap)) * F32(softcap)
                kpos = lo + np.arange(j0, j1)
                ok = kpos[None, :] <= rpos[r0:r1, None]
                if window:
                    ok &= kpos[None, :] > rpos[r0:r1, None] - window
                m, l, p, alpha = online_softmax(m, l, np.where(ok, s, -np.inf).astype(F32))
                pq = e4m3(p * F32(E4M3_MAX))
                acc = mma_product([pq], np.ascontiguousarray(vals[h, j0:j1].T), acc * alpha[:, None], k=32)
            o[r0:r1] = acc / F32(E4M3_MAX) / l[:, None]
        out[:, h * G:(h + 1) * G] = o.reshape(T, G, -1)
    return out
