"""Causal softmax attention over a preallocated KV cache on the GPU (full, or a sliding-window ring).

Mirrors lumen_cpu.attention: the same two caches and the same ``recent`` record that lets a KV-sharing layer
read what a ring-cache layer attended over. A bf16 cache holds uint16 bits (CuPy has no bfloat16), rounded to
nearest-even on write as ml_dtypes rounds on the CPU. An fp8 cache holds E4M3 bytes (uint8), written
round-to-nearest-even saturating at ±448 as ``lumen_cpu.attention.store`` (kernels in decode_attention.cu).
"""

from __future__ import annotations

from dataclasses import dataclass

import cupy as cp

from . import flash, fp8_mma

F32 = cp.float32
KV_DTYPES = {"f32": cp.float32, "f16": cp.float16, "bf16": cp.uint16, "fp8": cp.uint8}
FP8_THREADS = 256


def _fp8(kernel: str, x, out_dtype):
    from . import kernels

    x = cp.ascontiguousarray(x)
    y = cp.empty(x.shape, dtype=out_dtype)
    n = x.size
    if n:
        kernels.function("decode_attention", kernel)(((n + FP8_THREADS - 1) // FP8_THREADS,), (FP8_THREADS,),
                                                     (x, y, cp.int64(n)))
    return y


def encode(x, dtype, out=None):
    """f32 -> the cache's element type (into ``out``, e.g. the cache's rows, when given)."""
    if dtype == cp.uint16:  # bf16, round to nearest even: add 0x7FFF plus the lowest kept bit, keep the top half
        return fp8_mma.bf16_round(x, out)
    if dtype == cp.uint8:  # fp8 E4M3
        y = _fp8("kv_fp8_encode", cp.asarray(x, dtype=F32), cp.uint8)
    else:
        y = x.astype(dtype, copy=False)
    if out is None:
        return y
    out[...] = y
    return out


def decode(x):
    """The cache's element type -> f32."""
    if x.dtype == cp.uint16:
        return _bf16_decode(x)
    if x.dtype == cp.uint8:
        return _fp8("kv_fp8_decode", x, F32)
    return x.astype(F32, copy=False)


_bf16_decode = cp.ElementwiseKernel("uint16 x", "float32 y", "y = __uint_as_float(((unsigned int)x) << 16)",
                                    "lumen_bf16_decode")


@dataclass
class KVCache:
    k: cp.ndarray  # (kv_heads, ctx, head_dim)
    v: cp.ndarray  # (kv_heads, ctx, head_dim_v)
    fp8_attention: bool = False  # attention.compute-quantization fp8: several-token attention in e4m3 MMA

    @property
    def capacity(self) -> int:
        return self.k.shape[1]


@dataclass
class RingKVCache:
    k: cp.ndarray  # (kv_heads, window, head_dim): position p lives in slot p % window
    v: cp.ndarray
    recent: tuple | None = None  # (first position, keys (Hkv, S, D), values (Hkv, S, Dv)) of the last call, cache type
    fp8_attention: bool = False

    @property
    def capacity(self) -> int:
        return self.k.shape[1]


def _alloc(n, kv_heads, head_dim, type_k, type_v, head_dim_v):
    k = cp.zeros((kv_heads, n, head_dim), KV_DTYPES[type_k])
    v = cp.zeros((kv_heads, n, head_dim_v or head_dim), KV_DTYPES[type_v or type_k])
    return k, v


def kv_cache(context: int, kv_heads: int, head_dim: int, type_k: str = "f32", type_v: str | None = None,
             head_dim_v: int | None = None, fp8_attention: bool = False):
    return KVCache(*_alloc(context, kv_heads, head_dim, type_k, type_v, head_dim_v),
                   fp8_attention=_fp8_checked(fp8_attention, type_k, type_v))


def sliding_kv_cache(window: int, kv_heads: int, head_dim: int, type_k: str = "f32", type_v: str | None = None,
                     head_dim_v: int | None = None, fp8_attention: bool = False):
    return RingKVCache(*_alloc(window, kv_heads, head_dim, type_k, type_v, head_dim_v),
                       fp8_attention=_fp8_checked(fp8_attention, type_k, type_v))


def _fp8_checked(fp8_attention: bool, type_k: str, type_v: str | None) -> bool:
    if fp8_attention and (type_k != "fp8" or (type_v or type_k) != "fp8"):
        raise ValueError(f"fp8 attention needs an fp8 KV cache, not type-k {type_k} / type-v {type_v or type_k}")
    return bool(fp8_attention)


def attention(q, k, v, cache, start: int, scale: float, window: int | None = None, softcap: float | None = None,
              blocks=None):
    """q (T, Hq, D), k (T, Hkv, D), v (T, Hkv, Dv) at start..start+T-1 -> (T, Hq, Dv); writes k, v first.
    ``blocks``: position ranges [(first, end)] whose queries also see every key of their range (the CPU's
    meaning)."""
    if isinstance(cache, RingKVCache):
        lo, keys, vals = _ring_update(cache, k, v, start, window)
    else:
        end = start + q.shape[0]
        encode(k.transpose(1, 0, 2), cache.k.dtype, out=cache.k[:, start:end])
        encode(v.transpose(1, 0, 2), cache.v.dtype, out=cache.v[:, start:end])
        lo = 0 if window is None else max(0, start - window + 1)
        keys, vals = cache.k[:, lo:end], cache.v[:, lo:end]  # (Hkv, S, D) in the cache's type
    return _attend(q, keys, vals, start, lo, scale, window, softcap, blocks, cache.fp8_attention)


def attention_shared(q, cache, start: int, scale: float, window: int | None = None, softcap: float | None = None,
                     blocks=None):
    """q (T, Hq, D) over keys another layer already wrote at ..start+T-1 -> (T, Hq, Dv); ``blocks`` as
    ``attention``'s."""
    end = start + q.shape[0]
    lo = 0 if window is None else max(0, start - window + 1)
    if isinstance(cache, RingKVCache):
        first, keys, vals = cache.recent
        if lo < first or end > first + keys.shape[1]:
            raise ValueError(f"positions {lo}..{end - 1} are not in the shared ring's last call")
        keys, vals = keys[:, lo - first:end - first], vals[:, lo - first:end - first]
    else:
        keys, vals = cache.k[:, lo:end], cache.v[:, lo:end]
    return _attend(q, keys, vals, start, lo, scale, window, softcap, blocks, cache.fp8_attention)


def _ring_update(cache: RingKVCache, k, v, start: int, window: int | None):
    """Gather the window's past from the ring, append the new keys, then store the newest ones."""
    cap, T = cache.capacity, k.shape[0]
    if window is None or window > cap:
        raise ValueError(f"a ring KV cache of {cap} positions cannot serve attention window {window}")
    end = start + T
    lo = max(0, start - window + 1)
    past = cp.arange(lo, start) % cap if lo < start else None
    new_k = encode(k.transpose(1, 0, 2), cache.k.dtype)  # (Hkv, T, D), rounded through the cache type
    new_v = encode(v.transpose(1, 0, 2), cache.v.dtype)
    if lo == start:  # nothing of the window before this call: its own rows
        keys, vals = cp.ascontiguousarray(new_k), cp.ascontiguousarray(new_v)
    else:
        keys = cp.concatenate([cache.k[:, past], new_k], axis=1)  # (Hkv, start-lo+T, D), the cache's type
        vals = cp.concatenate([cache.v[:, past], new_v], axis=1)
    n = min(T, cap)
    first = (end - n) % cap
    if first + n <= cap:  # the newest rows land in consecutive slots
        cache.k[:, first:first + n] = new_k[:, T - n:]
        cache.v[:, first:first + n] = new_v[:, T - n:]
    else:
        slots = cp.arange(end - n, end) % cap
        cache.k[:, slots] = new_k[:, T - n:]
        cache.v[:, slots] = new_v[:, T - n:]
    cache.recent = (lo, keys, vals)
    return lo, keys, vals


def _attend(q, keys, vals, start: int, lo: int, scale: float, window: int | None, softcap: float | None,
            blocks=None, fp8: bool = False):
    """q (T, Hq, D) at start.., keys (Hkv, S, D) / vals (Hkv, S, Dv) at lo.. (f32, or a KV cache's element type,
    decoded here) -> (T, Hq, Dv).

    T > 1: ``fp8`` (a cache made for ``attention.compute-quantization: fp8``), the FP8 kernel (``flash.attend_fp8``)
    where it applies; where ``flash.mma_wanted`` (the default: heads up to 256, wider ones from 2048 keys;
    ``LUMEN_CUDA_FLASH=mma``: always) and keys and values that are bf16 values (a bf16 or fp8 cache), the
    tensor-core flash kernel (``flash.attend_mma``); else the f32 flash kernel (``flash.attend``: one launch, no
    (T, S) scores in memory) unless it declines (unsupported shapes, ``LUMEN_CUDA_FLASH=0``) or ``blocks`` asks for
    a mask it has not; otherwise, and for T = 1, the CuPy path."""
    if q.shape[0] > 1 and not blocks:
        if fp8:
            out = flash.attend_fp8(q, keys, vals, start, lo, scale, window, softcap)
            if out is not None:
                return out
        if flash.mma_wanted(keys.shape[1], vals.shape[-1]):
            kb, vb = _bf16_values(keys), _bf16_values(vals)
            if kb is not None and vb is not None:
                out = flash.attend_mma(q, kb, vb, start, lo, scale, window, softcap)
                if out is not None:
                    return out
        keys, vals = decode(keys), decode(vals)
        out = flash.attend(q, keys, vals, start, lo, scale, window, softcap)
        if out is not None:
            return out
    return _attend_cupy(q, decode(keys), decode(vals), start, lo, scale, window, softcap, blocks)


def _bf16_values(x):
    """Keys or values as bf16 bits where they are bf16 values exactly (a bf16 cache's bits; an fp8 cache's e4m3
    bytes, widened); None for f32 and f16 (the f32 kernel's)."""
    if x.dtype == cp.uint16:
        return x
    if x.dtype == cp.uint8:
        return _fp8("kv_fp8_bf16", x, cp.uint16)
    return None


def _attend_cupy(q, keys, vals, start: int, lo: int, scale: float, window: int | None, softcap: float | None,
                 blocks=None):
    """``_attend`` with CuPy ops: the (Hkv, G*T, S) f32 scores materialised (the reference for the kernel)."""
    T, hq, _ = q.shape
    end = lo + keys.shape[1]
    hkv = keys.shape[0]
    qg = q.transpose(1, 0, 2).reshape(hkv, hq // hkv * T, -1)  # (Hkv, group*T, D)
    scores = cp.matmul(qg, keys.transpose(0, 2, 1)).reshape(hkv, hq // hkv, T, -1) * F32(scale)
    if softcap:
        scores = cp.tanh(scores / F32(softcap)) * F32(softcap)
    scores = cp.where(_mask(start, T, lo, end, window, blocks), scores, F32(-cp.inf))
    scores -= scores.max(axis=-1, keepdims=True)
    p = cp.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)
    out = cp.matmul(p.reshape(hkv, -1, end - lo), vals)  # (Hkv, group*T, Dv)
    return out.reshape(hq, T, -1).transpose(1, 0, 2)


def _mask(start: int, T: int, lo: int, end: int, window: int | None, blocks=None):
    qpos = cp.arange(start, start + T)[:, None]
    kpos = cp.arange(lo, end)[None, :]
    ok = kpos <= qpos
    for first, stop in blocks or ():  # bidirectional within each block: AND(window, OR(causal, same block))
        ok |= (qpos >= first) & (qpos < stop) & (kpos >= first) & (kpos < stop)
    if window is not None:
        ok &= kpos > qpos - window
    return ok
