"""Causal softmax attention over a preallocated KV cache (full or sliding window), GQA by head groups.

Two caches: ``KVCache`` holds every position of the context; ``RingKVCache`` holds only the last ``window``
positions of a sliding-window layer (position p in slot p % window), so its size does not grow with the
context. ``attention_shared`` lets a KV-sharing layer attend over a cache another layer wrote this call.

Element types: f32, f16, bf16, and fp8 (E4M3, no scale: values round to nearest-even and saturate at ±448, the
format's largest finite value, instead of becoming NaN as a plain cast would). Entries are rounded through the
cache type when written; attention reads them widened to f32.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np
from numba import njit, prange

from .activations import _exp

F32 = np.float32
KV_DTYPES = {"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16, "fp8": ml_dtypes.float8_e4m3fn}
FP8_MAX = F32(448.0)


def store(x, dtype):
    """x (f32) in the cache's element type; fp8 saturates at ±448."""
    if dtype == ml_dtypes.float8_e4m3fn:
        x = np.clip(x, -FP8_MAX, FP8_MAX)
    return x.astype(dtype)


@dataclass
class KVCache:
    k: np.ndarray  # (kv_heads, ctx, head_dim)
    v: np.ndarray  # (kv_heads, ctx, head_dim_v)

    @property
    def capacity(self) -> int:
        return self.k.shape[1]


@dataclass
class RingKVCache:
    k: np.ndarray  # (kv_heads, window, head_dim): position p lives in slot p % window
    v: np.ndarray  # (kv_heads, window, head_dim_v)
    # What the last call attended over, (first position, keys (Hkv, S, D) f32, values (Hkv, S, Dv) f32): the ring
    # alone cannot serve a KV-sharing reader once a long prefill has overwritten the older slots. After a one-token
    # decode (which cannot overwrite what it read) it is (first position, None, S): read from the ring itself.
    recent: tuple | None = None

    @property
    def capacity(self) -> int:
        return self.k.shape[1]


# Caches are allocated, not zeroed: attention reads only positions written before (or in) the same call, and np.zeros
# of a request's caches cost ~1.4 ms of a 16-token Gemma 3 270M first token (18 layers; np.empty ~0.05 ms).
def kv_cache(context: int, kv_heads: int, head_dim: int, type_k: str = "f32", type_v: str | None = None,
             head_dim_v: int | None = None):
    k = np.empty((kv_heads, context, head_dim), KV_DTYPES[type_k])
    v = np.empty((kv_heads, context, head_dim_v or head_dim), KV_DTYPES[type_v or type_k])
    return KVCache(k, v)


def sliding_kv_cache(window: int, kv_heads: int, head_dim: int, type_k: str = "f32", type_v: str | None = None,
                     head_dim_v: int | None = None):
    k = np.empty((kv_heads, window, head_dim), KV_DTYPES[type_k])
    v = np.empty((kv_heads, window, head_dim_v or head_dim), KV_DTYPES[type_v or type_k])
    return RingKVCache(k, v)


def attention(q, k, v, cache, start: int, scale: float, window: int | None = None,
              softcap: float | None = None, blocks=None):
    """q (T, Hq, D), k (T, Hkv, D), v (T, Hkv, Dv) for positions start..start+T-1 -> (T, Hq, Dv).

    Writes k, v into the cache first; query i sees keys j <= start+i (and > start+i-window if sliding).
    ``blocks``: position ranges [(first, end)] within this call (an image's tokens) whose queries also see every
    key of their range, later ones included (still within the window: keys j > start+i-window).
    """
    if q.shape[0] == 1 and blocks is None and _decodable(q, cache):
        return _decode_step(q, k, v, cache, start, scale, window, softcap)
    if isinstance(cache, RingKVCache):
        lo, keys, vals = _ring_update(cache, k, v, start, window)
    else:
        end = start + q.shape[0]
        cache.k[:, start:end] = store(k.transpose(1, 0, 2), cache.k.dtype)
        cache.v[:, start:end] = store(v.transpose(1, 0, 2), cache.v.dtype)
        lo = 0 if window is None else max(0, start - window + 1)
        keys = cache.k[:, lo:end].astype(F32, copy=False)  # (Hkv, S, D); f16/bf16 caches widen here
        vals = cache.v[:, lo:end].astype(F32, copy=False)
    return _attend(q, keys, vals, start, lo, scale, window, softcap, blocks)


def attention_shared(q, cache, start: int, scale: float, window: int | None = None, softcap: float | None = None,
                     blocks=None):
    """q (T, Hq, D) at positions start..start+T-1 over keys another layer already wrote -> (T, Hq, Dv); ``blocks``
    as ``attention``'s."""
    end = start + q.shape[0]
    lo = 0 if window is None else max(0, start - window + 1)
    if isinstance(cache, RingKVCache):
        first, keys, vals = cache.recent
        if keys is None:  # the last call was a one-token decode: the ring still holds every position it saw
            slots = np.arange(first, first + vals) % cache.capacity
            keys, vals = cache.k[:, slots].astype(F32, copy=False), cache.v[:, slots].astype(F32, copy=False)
        if lo < first or end > first + keys.shape[1]:
            raise ValueError(f"positions {lo}..{end - 1} are not in the shared ring's last call")
        keys, vals = keys[:, lo - first:end - first], vals[:, lo - first:end - first]
    else:
        keys = cache.k[:, lo:end].astype(F32, copy=False)
        vals = cache.v[:, lo:end].astype(F32, copy=False)
    return _attend(q, keys, vals, start, lo, scale, window, softcap, blocks)


# -- one-token decode over f32 caches: read in place, no gather ------------------------------------------------
# fastmath without nnan/ninf: a NaN from a corrupt weight must still reach the logits, where the engine reports it.
_FM = {"reassoc", "contract", "nsz", "arcp"}


def _decodable(q, cache) -> bool:
    return q.dtype == F32 and cache.k.dtype == F32 and cache.v.dtype == F32


def _decode_step(q, k, v, cache, start: int, scale: float, window: int | None, softcap: float | None):
    """attention() for one token over an f32 KVCache or RingKVCache: write the new entry, then one kernel reads the
    window where it lies (a ring's slots wrap) -- what _ring_update's gather + _attend compute, without the copies."""
    cap = cache.capacity
    lo = 0 if window is None else max(0, start - window + 1)
    if isinstance(cache, RingKVCache):
        if window is None or window > cap:
            raise ValueError(f"a ring KV cache of {cap} positions cannot serve attention window {window}")
        cache.k[:, start % cap] = k[0]
        cache.v[:, start % cap] = v[0]
        cache.recent = (lo, None, start + 1 - lo)  # attention_shared reads these positions from the ring
    else:
        cache.k[:, start] = k[0]
        cache.v[:, start] = v[0]
        cap = start + 2  # positions never wrap: p % cap == p for p <= start
    out = np.empty((1, q.shape[1], cache.v.shape[2]), F32)
    _attend_kernel(np.ascontiguousarray(q), cache.k, cache.v, 0, cap, start, lo, window or 0, F32(scale),
                   F32(softcap or 0.0), out)
    return out


# Compiled, not numpy + BLAS: OpenBLAS's threads spin after each call and starved the numba GEMMs that follow
# (measured: a 128-token Gemma 3 270M prefill took 0.96 s with BLAS attention, its GEMMs 3x their own speed).
@njit(cache=True, parallel=True, fastmath=_FM, error_model="numpy")  # no division check: the loops vectorise
def _attend_kernel(q, kc, vc, base, cap, start, lo, window, scale, softcap, out):
    """out (T, Hq, Dv) = causal softmax attention of q (T, Hq, D) at positions start.. over keys lo..start+T-1 (and
    > position - window when window > 0); position p's key is kc[kv head, (p - base) % cap]. Only the keys a query
    sees are read."""
    T, hq = q.shape[0], q.shape[1]
    group = hq // kc.shape[0]
    for job in prange(hq * T):
        h, t = job // T, job % T
        kh, pos = h // group, start + t
        first = max(lo, pos - window + 1) if window > 0 else lo
        n = pos + 1 - first
        s = np.empty(n, np.float32)
        top = np.float32(-np.inf)
        for j in range(n):
            row = kc[kh, (first + j - base) % cap]
            acc = np.float32(0.0)
            for d in range(q.shape[2]):
                acc += q[t, h, d] * row[d]
            acc *= scale
            if softcap > 0:
                acc = np.float32(np.tanh(acc / softcap)) * softcap
            s[j] = acc
            top = max(top, acc)
        total = np.float32(0.0)
        for j in range(n):
            s[j] = _exp(s[j] - top)  # in registers (libm's expf per key does not vectorise)
            total += s[j]
        o = np.zeros(vc.shape[2], np.float32)
        for j in range(n):
            p = s[j] / total
            row = vc[kh, (first + j - base) % cap]
            for d in range(o.shape[0]):
                o[d] += p * row[d]
        out[t, h] = o


def _ring_update(cache: RingKVCache, k, v, start: int, window: int | None):
    """Gather the window's past from the ring, append the new keys, then store the newest ones."""
    cap, T = cache.capacity, k.shape[0]
    if window is None or window > cap:
        raise ValueError(f"a ring KV cache of {cap} positions cannot serve attention window {window}")
    end = start + T
    lo = max(0, start - window + 1)
    past = np.arange(lo, start) % cap
    # Round the new entries through the cache type, as the full cache does when it reads them back.
    new_k = store(k.transpose(1, 0, 2), cache.k.dtype)  # (Hkv, T, D)
    new_v = store(v.transpose(1, 0, 2), cache.v.dtype)
    keys = np.concatenate([cache.k[:, past], new_k], axis=1).astype(F32, copy=False)  # (Hkv, start-lo+T, D)
    vals = np.concatenate([cache.v[:, past], new_v], axis=1).astype(F32, copy=False)
    n = min(T, cap)
    slots = np.arange(end - n, end) % cap
    cache.k[:, slots] = new_k[:, T - n:]
    cache.v[:, slots] = new_v[:, T - n:]
    cache.recent = (lo, keys, vals)
    return lo, keys, vals


def _attend(q, keys, vals, start: int, lo: int, scale: float, window: int | None, softcap: float | None,
            blocks=None):
    """q (T, Hq, D) at start.., keys (Hkv, S, D) / vals (Hkv, S, Dv) at lo.. -> (T, Hq, Dv)."""
    T, hq, _ = q.shape
    if not blocks:  # causal (and windowed): the compiled kernel, which skips the masked keys
        out = np.empty((T, hq, vals.shape[2]), F32)
        _attend_kernel(np.ascontiguousarray(q, dtype=F32), np.ascontiguousarray(keys, dtype=F32),
                       np.ascontiguousarray(vals, dtype=F32), lo, keys.shape[1] + 1, start, lo, window or 0,
                       F32(scale), F32(softcap or 0.0), out)
        return out
    end = lo + keys.shape[1]
    hkv = keys.shape[0]
    qg = q.transpose(1, 0, 2).reshape(hkv, hq // hkv * T, -1)  # (Hkv, group*T, D)
    scores = (qg @ keys.transpose(0, 2, 1)).reshape(hkv, hq // hkv, T, -1) * F32(scale)
    if softcap:
        scores = np.tanh(scores / F32(softcap)) * F32(softcap)
    scores = np.where(_mask(start, T, lo, end, window, blocks), scores, -np.inf)
    scores -= scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)
    out = p.reshape(hkv, -1, end - lo) @ vals  # (Hkv, group*T, Dv)
    return out.reshape(hq, T, -1).transpose(1, 0, 2)


def _mask(start: int, T: int, lo: int, end: int, window: int | None, blocks=None):
    qpos = np.arange(start, start + T)[:, None]
    kpos = np.arange(lo, end)[None, :]
    ok = kpos <= qpos
    for first, stop in blocks or ():  # bidirectional within each block: AND(window, OR(causal, same block))
        ok |= (qpos >= first) & (qpos < stop) & (kpos >= first) & (kpos < stop)
    if window is not None:
        ok &= kpos > qpos - window
    return ok
