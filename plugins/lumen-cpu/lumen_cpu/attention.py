"""Causal softmax attention over a preallocated KV cache (full or sliding window), GQA by head groups."""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

F32 = np.float32
KV_DTYPES = {"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16}


@dataclass
class KVCache:
    k: np.ndarray  # (kv_heads, ctx, head_dim)
    v: np.ndarray  # (kv_heads, ctx, head_dim_v)

    @property
    def capacity(self) -> int:
        return self.k.shape[1]


def kv_cache(context: int, kv_heads: int, head_dim: int, type_k: str = "f32", type_v: str | None = None,
             head_dim_v: int | None = None):
    k = np.zeros((kv_heads, context, head_dim), KV_DTYPES[type_k])
    v = np.zeros((kv_heads, context, head_dim_v or head_dim), KV_DTYPES[type_v or type_k])
    return KVCache(k, v)


def attention(q, k, v, cache: KVCache, start: int, scale: float, window: int | None = None,
              softcap: float | None = None):
    """q (T, Hq, D), k (T, Hkv, D), v (T, Hkv, Dv) for positions start..start+T-1 -> (T, Hq, Dv).

    Writes k, v into the cache first; query i sees keys j <= start+i (and > start+i-window if sliding).
    """
    T, hq, _ = q.shape
    end = start + T
    cache.k[:, start:end] = k.transpose(1, 0, 2)
    cache.v[:, start:end] = v.transpose(1, 0, 2)
    lo = 0 if window is None else max(0, start - window + 1)
    keys = cache.k[:, lo:end].astype(F32, copy=False)  # (Hkv, S, D); f16/bf16 caches widen here
    vals = cache.v[:, lo:end].astype(F32, copy=False)
    hkv = keys.shape[0]
    qg = q.transpose(1, 0, 2).reshape(hkv, hq // hkv * T, -1)  # (Hkv, group*T, D)
    scores = (qg @ keys.transpose(0, 2, 1)).reshape(hkv, hq // hkv, T, -1) * F32(scale)
    if softcap:
        scores = np.tanh(scores / F32(softcap)) * F32(softcap)
    scores = np.where(_mask(start, T, lo, end, window), scores, -np.inf)
    scores -= scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)
    out = p.reshape(hkv, -1, end - lo) @ vals  # (Hkv, group*T, Dv)
    return out.reshape(hq, T, -1).transpose(1, 0, 2)


def _mask(start: int, T: int, lo: int, end: int, window: int | None):
    qpos = np.arange(start, start + T)[:, None]
    kpos = np.arange(lo, end)[None, :]
    ok = kpos <= qpos
    if window is not None:
        ok &= kpos > qpos - window
    return ok
