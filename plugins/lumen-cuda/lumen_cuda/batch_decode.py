"""The token mixers of a batched step (continuous batching, ``lumen_core.batching``): the ``*_segments`` ops.

A batched step holds one row per decoding sequence (first, in the batcher's order) and maybe one prompt chunk of a
sequence being prefilled (last). The leading one-row spans go through one launch per op for all their sequences
(``kernels/decode_attention.cu`` ``attn_split_batch_*`` / ``attn_combine_batch``, ``kernels/gdn_step.cu``
``gdn_step_batch_r*`` / ``conv1d_step_batch``): the same per-sequence kernels as the batch-1 decode step, with the
sequence taken from the grid's last axis and its cache or state from a device table of pointers, so every row
computes exactly what a solo decode step computes for it. Any other span (a prompt chunk, or sequences the batched
kernels do not take: caches of different types or capacities) runs through the ordinary op of ``lumen_cuda.ops``.
"""

from __future__ import annotations

import cupy as cp
import numpy as np

from . import decode, ops
from .attention import KVCache, RingKVCache
from .delta import ConvState, DeltaState

F32 = cp.float32


def _decode_run(spans) -> int:
    """How many spans at the front hold one row each, rows 0, 1, 2, ... (the decoding sequences)."""
    n = 0
    for i, (first, end) in enumerate(spans):
        if first != i or end != i + 1:
            break
        n += 1
    return n


def _ptrs(arrays) -> cp.ndarray:
    return cp.asarray(np.array([a.data.ptr for a in arrays], dtype=np.uint64))


def _cat(parts):
    return parts[0] if len(parts) == 1 else cp.concatenate(parts)


# -- attention ----------------------------------------------------------------------------------------------------
def attention_decode_batch(q, k, v, caches, starts, scale: float, window: int | None = None,
                           softcap: float | None = None):
    """One token for each of B sequences: q (B, Hq, D), k (B, Hkv, D), v (B, Hkv, Dv) f32 -> (B, Hq, Dv); row b
    written into ``caches[b]`` at ``starts[b]`` and attended as ``decode.attention_decode`` does. ValueError where
    the caches differ in type, shape or dtype (or the shapes are ones the decode kernel refuses)."""
    first = caches[0]
    ring = isinstance(first, RingKVCache)
    if not isinstance(first, (KVCache, RingKVCache)) or any(type(c) is not type(first) for c in caches):
        raise ValueError("the batched decode attention needs caches of one type")
    kc, vc = first.k, first.v
    if any(c.k.shape != kc.shape or c.v.shape != vc.shape or c.k.dtype != kc.dtype or c.v.dtype != vc.dtype
           or not c.k.flags.c_contiguous or not c.v.flags.c_contiguous or c.k.data.ptr % 16 or c.v.data.ptr % 16
           for c in caches):
        raise ValueError("the batched decode attention needs caches of one shape and dtype, contiguous")
    B, Hq, D = q.shape
    Hkv, ctx, Dv = vc.shape
    if ring:
        if window is None or window != ctx:
            raise ValueError(f"a ring KV cache of {ctx} positions decodes attention window {ctx}, not {window}")
        window = None
    if k.shape != (B, Hkv, D) or v.shape != (B, Hkv, Dv) or kc.shape != (Hkv, ctx, D) or Hq % Hkv:
        raise ValueError(f"shapes: q {q.shape}, k {k.shape}, v {v.shape}, cache k {kc.shape}, v {vc.shape}")
    for d in (D, Dv):
        if not 0 < d <= decode.MAX_HEAD_DIM or d % 4:
            raise ValueError(f"head dim {d} unsupported")
    if kc.dtype not in decode._KV_NAMES or vc.dtype not in decode._KV_NAMES:
        raise ValueError(f"cache dtypes {kc.dtype}/{vc.dtype} unsupported")
    chunk = decode.split_chunk(ctx)
    nsplit = -(-ctx // chunk)
    if nsplit > decode.MAX_SPLITS:
        raise ValueError(f"a cache of {ctx} positions needs {nsplit} splits")
    pos = np.asarray(starts, dtype=np.int64)
    if (pos < 0).any() or (not ring and (pos >= ctx).any()):
        raise ValueError("a position past the cache")
    slot = pos % ctx if ring else pos
    shown = np.minimum(pos, ctx - 1) if ring else pos
    meta = cp.asarray(np.concatenate([shown, slot]).astype(np.int32))  # one copy: positions, then slots
    table = _ptrs([c.k for c in caches] + [c.v for c in caches])
    G = Hq // Hkv
    zg = -(-G // decode.ATTN_GM)
    gm = min(decode.ATTN_GM, G)
    qc = cp.ascontiguousarray(q, dtype=F32)
    kn, vn = cp.ascontiguousarray(k, dtype=F32), cp.ascontiguousarray(v, dtype=F32)
    o_part = cp.empty((B, nsplit, Hq, Dv), dtype=F32)
    ml_part = cp.empty((B, nsplit, Hq, 2), dtype=F32)
    out = cp.empty((B, Hq, Dv), dtype=F32)
    win = np.int32(window or 0)
    names = decode._KV_NAMES
    split = decode._fn(decode.ATTN_FILE, f"attn_split_batch_k{names[kc.dtype]}_v{names[vc.dtype]}")
    split((nsplit, Hkv, zg * B), (decode.ATTN_NT,),
          (qc, kn, vn, table, table[B:], meta, meta[B:], o_part, ml_part, np.int32(ctx), np.int32(D),
           np.int32(Dv), np.int32(Hq), np.int32(G), np.int32(chunk), np.float32(scale),
           np.float32(softcap or 0.0), win, np.int32(zg)),
          shared_mem=4 * gm * (D + chunk + (decode.ATTN_NT // 32) * 128))
    decode._fn(decode.ATTN_FILE, "attn_combine_batch")(
        (Hq, B), (decode.ATTN_NT,),
        (o_part, ml_part, meta, out, np.int32(Hq), np.int32(Dv), np.int32(chunk), win, np.int32(nsplit)),
        shared_mem=4 * nsplit)
    return out


def attention_segments(q, k, v, states, starts, spans, scale: float, window: int | None = None):
    n = _decode_run(spans)
    parts = []
    if n >= 2:
        try:
            parts.append(attention_decode_batch(q[:n], k[:n], v[:n], states[:n], starts[:n], scale, window))
        except ValueError:
            parts, n = [], 0
    else:
        n = 0
    for i in range(n, len(spans)):
        a, b = spans[i]
        parts.append(ops.attention(q[a:b], k[a:b], v[a:b], states[i], starts[i], scale, window))
    return _cat(parts)


# -- Gated-DeltaNet -----------------------------------------------------------------------------------------------
def gated_delta_step_batch(q, k, v, g, beta, states):
    """``decode.gated_delta_step`` for B sequences: q, k (B, Hk, Dk), v (B, Hv, Dv), g, beta (B, Hv) ->
    (B, Hv, Dv); ``states[b].s`` updated in place."""
    B, Hk, Dk = q.shape
    Hv, Dv = v.shape[1], v.shape[2]
    shape = (Hv, Dk, Dv)
    if any(not isinstance(s, DeltaState) or s.s.shape != shape or s.s.dtype != F32 or not s.s.flags.c_contiguous
           for s in states):
        raise ValueError("the batched Gated-DeltaNet step needs f32 contiguous states of one shape")
    if k.shape != q.shape or g.shape != (B, Hv) or beta.shape != (B, Hv) or Hk == 0 or Hv % Hk:
        raise ValueError(f"shapes: q {q.shape}, k {k.shape}, v {v.shape}, g {g.shape}, beta {beta.shape}")
    rpt = next((r for r in decode.GDN_RPT if Dk <= 8 * r), None)
    if rpt is None or Dv == 0:
        raise ValueError(f"key head dim {Dk} unsupported")
    args = [cp.ascontiguousarray(a, dtype=F32) for a in (q, k, v, g, beta)]
    out = cp.empty((B, Hv, Dv), dtype=F32)
    decode._fn(decode.GDN_FILE, f"gdn_step_batch_r{rpt}")(
        (Hv, -(-Dv // 32), B), (decode.GDN_THREADS,),
        (*args, _ptrs([s.s for s in states]), out, np.int32(Hk), np.int32(Hv), np.int32(Dk), np.int32(Dv),
         np.float32(Dk ** -0.5)))
    return out


def causal_conv1d_step_batch(x, w, states):
    """``decode.causal_conv1d_step`` for B sequences: x (B, C), w (C, K) -> (B, C); ``states[b].x`` updated."""
    B, C = x.shape
    K = w.shape[-1]
    if w.shape != (C, K) or K < 2 or any(not isinstance(s, ConvState) or s.x.shape != (K - 1, C)
                                         or s.x.dtype != F32 or not s.x.flags.c_contiguous for s in states):
        raise ValueError("the batched conv step needs f32 contiguous states of one shape")
    xc, wc = cp.ascontiguousarray(x, dtype=F32), cp.ascontiguousarray(w, dtype=F32)
    y = cp.empty((B, C), dtype=F32)
    if C:
        decode._fn(decode.GDN_FILE, "conv1d_step_batch")(
            (-(-C // decode.CONV_THREADS), B), (decode.CONV_THREADS,),
            (xc, wc, _ptrs([s.x for s in states]), y, np.int32(C), np.int32(K)))
    return y


def causal_conv1d_segments(x, w, states, spans):
    n = _decode_run(spans)
    parts = []
    if n >= 2:
        try:
            parts.append(causal_conv1d_step_batch(x[:n], w, states[:n]))
        except ValueError:
            parts, n = [], 0
    else:
        n = 0
    for i in range(n, len(spans)):
        a, b = spans[i]
        parts.append(ops.causal_conv1d(x[a:b], w, states[i]))
    return _cat(parts)


def gated_delta_rule_segments(q, k, v, g, beta, states, spans):
    n = _decode_run(spans)
    parts = []
    if n >= 2:
        try:
            parts.append(gated_delta_step_batch(q[:n], k[:n], v[:n], g[:n], beta[:n], states[:n]))
        except ValueError:
            parts, n = [], 0
    else:
        n = 0
    for i in range(n, len(spans)):
        a, b = spans[i]
        parts.append(ops.gated_delta_rule(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], states[i]))
    return _cat(parts)
