"""Batch-1 decode ops for CUDA-graph capture: attention over a KV cache (split-K, ``kernels/decode_attention.cu``),
the Gated-DeltaNet recurrent step and the causal conv1d update (``kernels/gdn_step.cu``).

Each op does no host synchronisation and no host-to-device copy, and its launch configuration depends only on
shapes (cache capacity, head counts, head dims), never on the token position: attention reads the position from
a device int32 array ``pos`` (1,), so a decode step captured once can be replayed at every position after
``pos.fill(p)``. Intermediate buffers are allocated per call with ``cp.empty`` (position-independent sizes).

Each raises ValueError naming what it does not support (the caller routes those cases to the CuPy ops in
``attention.py`` / ``delta.py``, which these match to 1e-5 relative; the caches they write are bit-identical).

Launch configurations:
- ``attention_decode``: ``attn_split_k<K>_v<V>`` grid (nsplit, Hkv, ceil(G / 8)), 128 threads, G = Hq / Hkv,
  nsplit = ceil(ctx / chunk), chunk = ``split_chunk(ctx)`` (a power of two in 32..256); then ``attn_combine``
  grid (Hq,), 128 threads.
- ``attention_verify`` (T tokens of a speculative verify, full cache): ``kv_store_k<K>_v<V>`` grid (T, Hkv), then
  ``attn_split_multi_k<K>_v<V>`` grid (nsplit, Hkv, ceil(G / 8) * T), then ``attn_combine_batch`` grid (Hq, T).
- ``gated_delta_step``: ``gdn_step_r<RPT>`` grid (Hv, ceil(Dv / 32)), 256 threads, RPT = 4/8/16/32 for
  Dk <= 32/64/128/256.
- ``causal_conv1d_step``: ``conv1d_step`` grid ceil(C / 128), 128 threads.
- ``gated_delta_net_step`` (``LUMEN_CUDA_GDN_DECODE=1``): ``gdn_decode_r<RPT>`` grid (Hv, ceil(Dv / 32)), 256
  threads: the conv, the step and the gated norm of the token mixer in one launch.
"""

from __future__ import annotations

import os

import cupy as cp
import numpy as np

from . import kernels
from .attention import KVCache, RingKVCache
from .delta import ConvState, DeltaState
from .state import derived

F32 = cp.float32
ATTN_FILE, GDN_FILE = "decode_attention", "gdn_step"
ATTN_GM = 8  # query heads per attention block (ATTN_GM in decode_attention.cu)
ATTN_NT = 128  # threads per attention block (ATTN_NT)
MAX_HEAD_DIM = 512  # D and Dv
MAX_SPLITS = 8192  # combine keeps one weight per split in shared memory (32 KB)
GDN_THREADS = 256  # GDN_WARPS * 32
GDN_RPT = (4, 8, 16, 32)  # key rows per thread: Dk <= 8 * RPT
CONV_THREADS = 128
CONV_TOKENS = 16  # tokens a thread of conv1d_prefill computes (kernels/gdn_step.cu)
_KV_NAMES = {np.dtype(np.float32): "f32", np.dtype(np.float16): "f16", np.dtype(np.uint16): "bf16",
             np.dtype(np.uint8): "fp8"}


def _fn(file: str, name: str) -> cp.RawKernel:
    return kernels.function(file, name)


def _f32(x, name: str):
    """A C-contiguous f32 device array (a device copy when x is a view or another dtype)."""
    if not isinstance(x, cp.ndarray):
        raise ValueError(f"{name} must be a CuPy array, not {type(x).__name__}")
    return cp.ascontiguousarray(x, dtype=F32)


def split_chunk(ctx: int) -> int:
    """Cache positions per attention split for a cache of ``ctx`` positions: ~128 splits per kv head, each of
    32..256 positions (a power of two), so that even a short cache with 2 kv heads spreads over dozens of
    blocks. Depends on the capacity only."""
    want = max(1, -(-ctx // 128))
    return min(256, max(32, 1 << (want - 1).bit_length()))


def _check_attention(Hq: int, D: int, kc, vc, window, chunk) -> tuple[int, int]:
    """What the split kernels support, for caches kc (Hkv, ctx, D) / vc (Hkv, ctx, Dv): ValueError naming what is
    not; -> (positions per split, splits)."""
    Hkv, ctx, Dv = vc.shape
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"query heads {Hq} not a multiple of kv heads {Hkv}")
    for name, d in (("head dim", D), ("value head dim", Dv)):
        if not 0 < d <= MAX_HEAD_DIM or d % 4:
            raise ValueError(f"{name} {d} unsupported (a multiple of 4, at most {MAX_HEAD_DIM})")
    for name, a in (("k", kc), ("v", vc)):
        if a.dtype not in _KV_NAMES:
            raise ValueError(f"cache {name} dtype {a.dtype} unsupported (f32, f16, bf16 bits as uint16, fp8 as "
                             "uint8)")
        if not a.flags.c_contiguous or a.data.ptr % 16:
            raise ValueError(f"cache {name} must be C-contiguous with a 16-byte aligned base")
    if window is not None and window < 1:
        raise ValueError(f"attention window {window} unsupported")
    chunk = int(chunk or split_chunk(ctx))
    if not 1 <= chunk <= 512:
        raise ValueError(f"attention split of {chunk} positions unsupported (1..512)")
    nsplit = -(-ctx // chunk)
    if nsplit > MAX_SPLITS:
        raise ValueError(f"a cache of {ctx} positions needs {nsplit} splits (at most {MAX_SPLITS})")
    return chunk, nsplit


# -- attention ----------------------------------------------------------------------------------------------------
def attention_decode(q, k, v, cache, pos, scale: float, window: int | None = None,
                     softcap: float | None = None, chunk: int | None = None):
    """One token's attention: q (1, Hq, D), k (1, Hkv, D), v (1, Hkv, Dv) f32 -> (1, Hq, Dv) f32.

    Writes k, v into slot ``pos[0]`` of ``cache`` (encoded to its dtype), then attends over positions
    lo..pos[0] (lo = max(0, pos - window + 1) with a window). ``pos``: a device int32 array (1,), read by the
    kernels only. ``chunk`` overrides the positions per split (tests; must not depend on the position).
    k = v = None: nothing is written (a KV-sharing layer reading the cache another layer wrote at ``pos``).
    A ring cache (RingKVCache, capacity = window): the new key goes to slot pos % capacity and every filled slot
    is attended (they all lie in the window); the ``recent`` record is left alone (one-token readers of a shared
    ring read the ring itself)."""
    ring = isinstance(cache, RingKVCache)
    if not isinstance(cache, KVCache) and not ring:
        raise ValueError(f"attention_decode needs a KVCache or RingKVCache, not {type(cache).__name__}")
    write = k is not None
    k = q[:, :1] if k is None else k
    v = cache.v[None, :, 0] if v is None else v
    if q.ndim != 3 or k.ndim != 3 or v.ndim != 3 or q.shape[0] != 1 or k.shape[0] != 1 or v.shape[0] != 1:
        raise ValueError(f"attention_decode takes one token: q {q.shape}, k {k.shape}, v {v.shape}")
    _, Hq, D = q.shape
    kc, vc = cache.k, cache.v
    Hkv, ctx, Dv = vc.shape
    if ring:
        if window is None or window != ctx:
            raise ValueError(f"a ring KV cache of {ctx} positions decodes attention window {ctx}, not {window}")
        window = None
    if (write and (k.shape != (1, Hkv, D) or v.shape != (1, Hkv, Dv))) or kc.shape != (Hkv, ctx, D):
        raise ValueError(f"shapes: q {q.shape}, k {k.shape}, v {v.shape}, cache k {kc.shape}, v {vc.shape}")
    chunk, nsplit = _check_attention(Hq, D, kc, vc, window, chunk)
    if not isinstance(pos, cp.ndarray) or pos.size != 1:
        raise ValueError("pos must be a device array of one int32 (this token's position)")
    if pos.dtype != cp.int32:
        pos = pos.astype(cp.int32)  # a device op: still graph-capturable

    G = Hq // Hkv
    qc = _f32(q, "q").reshape(Hq, D)
    kn = _f32(k, "k").reshape(Hkv, D) if write else np.uint64(0)  # null: no write
    vn = _f32(v, "v").reshape(Hkv, Dv) if write else np.uint64(0)
    slot = pos
    if ring:  # slot pos % ctx; attend slots 0 .. min(pos, ctx - 1) (device ops: still capturable)
        slot, pos = pos % np.int32(ctx), cp.minimum(pos, np.int32(ctx - 1))
    o_part = cp.empty((nsplit, Hq, Dv), dtype=F32)
    ml_part = cp.empty((nsplit, Hq, 2), dtype=F32)
    out = cp.empty((1, Hq, Dv), dtype=F32)
    gm = min(ATTN_GM, G)  # query heads per block
    smem = 4 * gm * (D + chunk + (ATTN_NT // 32) * 128)
    win = np.int32(window or 0)
    fn = _fn(ATTN_FILE, f"attn_split_k{_KV_NAMES[kc.dtype]}_v{_KV_NAMES[vc.dtype]}")
    fn((nsplit, Hkv, -(-G // ATTN_GM)), (ATTN_NT,),
       (qc, kn, vn, kc, vc, pos, slot, o_part, ml_part, np.int32(ctx), np.int32(D), np.int32(Dv), np.int32(Hq),
        np.int32(G), np.int32(chunk), np.float32(scale), np.float32(softcap or 0.0), win),
       shared_mem=smem)
    _fn(ATTN_FILE, "attn_combine")((Hq,), (ATTN_NT,),
                                   (o_part, ml_part, pos, out, np.int32(Hq), np.int32(Dv), np.int32(chunk), win,
                                    np.int32(nsplit)),
                                   shared_mem=4 * nsplit)
    return out


def attention_verify(q, k, v, cache, pos, scale: float, window: int | None = None, softcap: float | None = None,
                     chunk: int | None = None):
    """T tokens of one sequence (a speculative verify) in three launches: q (T, Hq, D), k (T, Hkv, D), v (T, Hkv, Dv)
    f32 at the positions in ``pos`` (a device int32 array (T,), ascending) -> (T, Hq, Dv) f32.

    ``kv_store`` writes the T new rows into slots pos[t] of a full cache (encoded as ``attention_decode`` encodes
    them), ``attn_split_multi`` attends every query up to its own position (grid z over tokens and head groups),
    ``attn_combine_batch`` combines per (head, token). Token t reads only rows <= pos[t], all written before the
    launch, so the result has the bits of T ``attention_decode`` calls in order (each writes its row, then attends
    up to it), at a fraction of the launches. A ring cache is refused (ValueError): a later token's row would
    overwrite a slot an earlier token still attends."""
    if not isinstance(cache, KVCache):
        raise ValueError(f"attention_verify needs a full KVCache, not {type(cache).__name__}")
    if q.ndim != 3 or k.ndim != 3 or v.ndim != 3:
        raise ValueError(f"attention_verify takes (T, heads, dim) arrays: q {q.shape}, k {k.shape}, v {v.shape}")
    T, Hq, D = q.shape
    kc, vc = cache.k, cache.v
    Hkv, ctx, Dv = vc.shape
    if k.shape != (T, Hkv, D) or v.shape != (T, Hkv, Dv) or kc.shape != (Hkv, ctx, D):
        raise ValueError(f"shapes: q {q.shape}, k {k.shape}, v {v.shape}, cache k {kc.shape}, v {vc.shape}")
    chunk, nsplit = _check_attention(Hq, D, kc, vc, window, chunk)
    if not isinstance(pos, cp.ndarray) or pos.shape != (T,):
        raise ValueError(f"pos must be a device array of {T} int32 (the tokens' positions)")
    if pos.dtype != cp.int32:
        pos = pos.astype(cp.int32)
    G = Hq // Hkv
    zg = -(-G // ATTN_GM)
    names = (_KV_NAMES[kc.dtype], _KV_NAMES[vc.dtype])
    _fn(ATTN_FILE, "kv_store_k{}_v{}".format(*names))(
        (T, Hkv), (ATTN_NT,), (_f32(k, "k"), _f32(v, "v"), kc, vc, pos, np.int32(ctx), np.int32(Hkv), np.int32(D),
                               np.int32(Dv)))
    o_part = cp.empty((T, nsplit, Hq, Dv), dtype=F32)
    ml_part = cp.empty((T, nsplit, Hq, 2), dtype=F32)
    out = cp.empty((T, Hq, Dv), dtype=F32)
    win = np.int32(window or 0)
    smem = 4 * min(ATTN_GM, G) * (D + chunk + (ATTN_NT // 32) * 128)
    _fn(ATTN_FILE, "attn_split_multi_k{}_v{}".format(*names))(
        (nsplit, Hkv, zg * T), (ATTN_NT,),
        (_f32(q, "q"), kc, vc, pos, o_part, ml_part, np.int32(ctx), np.int32(D), np.int32(Dv), np.int32(Hq),
         np.int32(G), np.int32(chunk), np.float32(scale), np.float32(softcap or 0.0), win, np.int32(zg)),
        shared_mem=smem)
    _fn(ATTN_FILE, "attn_combine_batch")(
        (Hq, T), (ATTN_NT,),
        (o_part, ml_part, pos, out, np.int32(Hq), np.int32(Dv), np.int32(chunk), win, np.int32(nsplit)),
        shared_mem=4 * nsplit)
    return out


# -- Gated DeltaNet -----------------------------------------------------------------------------------------------
def gated_delta_step(q, k, v, g, beta, state: DeltaState, gates=None):
    """The one-token gated delta rule (``delta.gated_delta_rule`` at T = 1), fused: q, k (1, Hk, Dk),
    v (1, Hv, Dv), g, beta (1, Hv) f32 -> (1, Hv, Dv) f32; ``state.s`` (Hv, Dk, Dv) f32 updated in place.
    ``gates`` = (neg_a, dt_bias) (Hv,): g and beta are then the raw projections a and b, and the kernel computes
    ``gdn_gates`` of them itself (``gdn_step_gates_r*``, the same expressions: one launch instead of two)."""
    if q.ndim != 3 or q.shape[0] != 1 or v.ndim != 3 or v.shape[0] != 1:
        raise ValueError(f"gated_delta_step takes one token: q {q.shape}, v {v.shape}")
    _, Hk, Dk = q.shape
    _, Hv, Dv = v.shape
    s = state.s
    if k.shape != q.shape or g.shape != (1, Hv) or beta.shape != (1, Hv) or s.shape != (Hv, Dk, Dv):
        raise ValueError(f"shapes: q {q.shape}, k {k.shape}, v {v.shape}, g {g.shape}, beta {beta.shape}, "
                         f"state {s.shape}")
    if Hk == 0 or Hv % Hk:
        raise ValueError(f"v heads {Hv} not a multiple of k heads {Hk}")
    rpt = next((r for r in GDN_RPT if Dk <= 8 * r), None)
    if rpt is None or Dk == 0 or Dv == 0:
        raise ValueError(f"key head dim {Dk} unsupported (1..{8 * GDN_RPT[-1]}) or value head dim {Dv}")
    if not isinstance(s, cp.ndarray) or s.dtype != F32 or not s.flags.c_contiguous:
        raise ValueError("delta state must be a C-contiguous f32 CuPy array")
    qc, kc, vc = _f32(q, "q"), _f32(k, "k"), _f32(v, "v")
    gc, bc = _f32(g, "g"), _f32(beta, "beta")
    out = cp.empty((1, Hv, Dv), dtype=F32)
    dims = (np.int32(Hk), np.int32(Hv), np.int32(Dk), np.int32(Dv), np.float32(Dk ** -0.5))
    if gates is None:
        _fn(GDN_FILE, f"gdn_step_r{rpt}")((Hv, -(-Dv // 32)), (GDN_THREADS,), (qc, kc, vc, gc, bc, s, out, *dims))
        return out
    neg_a, dt_bias = _f32(gates[0], "neg_a"), _f32(gates[1], "dt_bias")
    if neg_a.shape != (Hv,) or dt_bias.shape != (Hv,):
        raise ValueError(f"gates: neg_a {neg_a.shape}, dt_bias {dt_bias.shape}, expected ({Hv},)")
    _fn(GDN_FILE, f"gdn_step_gates_r{rpt}")((Hv, -(-Dv // 32)), (GDN_THREADS,),
                                            (qc, kc, vc, gc, bc, neg_a, dt_bias, s, out, *dims))
    return out


def gdn_decode(env=None) -> bool:
    """``LUMEN_CUDA_GDN_DECODE``: 1 runs a one-token ``ops.gated_delta_net`` as one kernel (``gated_delta_net_step``);
    unset or 0 (the default until a GPU suite has run on it), its three (conv, step, gated norm). Read at each call;
    anything else is an error naming it."""
    v = (os.environ if env is None else env).get("LUMEN_CUDA_GDN_DECODE", "")
    if v not in ("", "0", "1"):
        raise ValueError(f"LUMEN_CUDA_GDN_DECODE={v!r}: use 1 (the Gated-DeltaNet decode in one kernel) or 0 (three "
                         "kernels, the default)")
    return v == "1"


def gated_delta_net_step(qkv, conv_w, conv_state: ConvState, a, b, neg_a, dt_bias, delta_state: DeltaState, z,
                         norm_w, eps: float, dims):
    """``ops.gated_delta_net`` for one token in one launch (``gdn_decode_r*``): the q, k, v conv of qkv (1, C), the
    gated delta rule with its gates from a, b (1, Hv), and rms_norm(o, norm_w) * silu(z) per head; both states
    updated in place. Bit for bit what ``causal_conv1d_step``, ``gated_delta_step(gates=...)`` and
    ``gemv.rms_norm_gated`` give (the same arithmetic in the same order). Returns None where it does not apply
    (another shape, Dv > 128, a state that is not a C-contiguous f32 CuPy array): the caller runs those three.
    Two int32 counters per k head and v head, zero between calls, are kept on the delta state (lumen_cuda.state)."""
    Hk, Dk, Hv, Dv = (int(d) for d in dims)
    C = 2 * Hk * Dk + Hv * Dv
    arrays = (qkv, conv_w, a, b, neg_a, dt_bias, z, norm_w)
    if not all(isinstance(x, cp.ndarray) for x in arrays) or not isinstance(conv_state, ConvState):
        return None
    K = conv_w.shape[-1]
    sx, s = conv_state.x, getattr(delta_state, "s", None)
    rpt = next((r for r in GDN_RPT if Dk <= 8 * r), None)
    ok = (qkv.shape == (1, C) and conv_w.shape == (C, K) and K >= 2 and a.shape == b.shape == (1, Hv)
          and neg_a.shape == dt_bias.shape == (Hv,) and z.shape == (1, Hv * Dv) and norm_w.shape == (Dv,)
          and Hk > 0 and Hv % Hk == 0 and rpt is not None and 0 < Dv <= 128
          and isinstance(sx, cp.ndarray) and sx.dtype == F32 and sx.flags.c_contiguous and sx.shape == (K - 1, C)
          and isinstance(s, cp.ndarray) and s.dtype == F32 and s.flags.c_contiguous and s.shape == (Hv, Dk, Dv))
    if not ok:
        return None
    keep = derived(delta_state)
    cnt = keep.get("gdn_counters")
    if cnt is None or cnt.shape != (Hk + Hv,):
        cnt = keep["gdn_counters"] = cp.zeros(Hk + Hv, dtype=cp.int32)
    o, y = cp.empty((1, Hv, Dv), dtype=F32), cp.empty((1, Hv, Dv), dtype=F32)
    args = [_f32(x, n) for x, n in zip(arrays, ("qkv", "conv_w", "a", "b", "neg_a", "dt_bias", "z", "norm_w"),
                                        strict=True)]
    qkv_c, cw, ac, bc, na, dtb, zc, nw = args
    _fn(GDN_FILE, f"gdn_decode_r{rpt}")(
        (Hv, -(-Dv // 32)), (GDN_THREADS,),
        (qkv_c, cw, sx, ac, bc, na, dtb, s, zc, nw, o, y, cnt, np.int32(Hk), np.int32(Hv), np.int32(Dk),
         np.int32(Dv), np.int32(K), np.float32(Dk ** -0.5), np.float32(eps)))
    return y


def causal_conv1d_step(x, w, state: ConvState):
    """``delta.causal_conv1d`` at T = 1: x (1, C), w (C, K) f32 -> (1, C) f32 = silu(sum_k full[k] * w[:, k]),
    full = state rows then x; ``state.x`` (K-1, C) f32 becomes full[1:] (in place)."""
    if x.ndim != 2 or x.shape[0] != 1:
        raise ValueError(f"causal_conv1d_step takes one token: x {x.shape}")
    C = x.shape[1]
    K = w.shape[-1]
    sx = state.x
    if w.shape != (C, K) or K < 2 or sx.shape != (K - 1, C):
        raise ValueError(f"shapes: x {x.shape}, w {w.shape}, state {sx.shape} (kernel size >= 2)")
    if not isinstance(sx, cp.ndarray) or sx.dtype != F32 or not sx.flags.c_contiguous:
        raise ValueError("conv state must be a C-contiguous f32 CuPy array")
    xc, wc = _f32(x, "x"), _f32(w, "w")
    y = cp.empty((1, C), dtype=F32)
    if C:
        _fn(GDN_FILE, "conv1d_step")((-(-C // CONV_THREADS),), (CONV_THREADS,),
                                     (xc, wc, sx, y, np.int32(C), np.int32(K)))
    return y


def causal_conv1d_prefill(x, w, state: ConvState):
    """``delta.causal_conv1d`` for any T in two launches (``conv1d_prefill``, then the state's move): x (T, C),
    w (C, K) -> (T, C) f32, bit for bit the CuPy op's result; ``state.x`` (K-1, C) f32 becomes the last K-1 rows of
    [state; x] (in place)."""
    if x.ndim != 2 or x.shape[0] < 1:
        raise ValueError(f"causal_conv1d_prefill takes (T >= 1, C): x {x.shape}")
    T, C = x.shape
    K = w.shape[-1]
    sx = state.x
    if w.shape != (C, K) or K < 2 or sx.shape != (K - 1, C):
        raise ValueError(f"shapes: x {x.shape}, w {w.shape}, state {sx.shape} (kernel size >= 2)")
    if not isinstance(sx, cp.ndarray) or sx.dtype != F32 or not sx.flags.c_contiguous:
        raise ValueError("conv state must be a C-contiguous f32 CuPy array")
    xc, wc = _f32(x, "x"), _f32(w, "w")
    y = cp.empty((T, C), dtype=F32)
    if C:
        _fn(GDN_FILE, "conv1d_prefill")((-(-C // CONV_THREADS), -(-T // CONV_TOKENS)), (CONV_THREADS,),
                                        (xc, wc, sx, y, np.int32(T), np.int32(C), np.int32(K)))
        sx[...] = xc[T - (K - 1):] if T >= K - 1 else cp.concatenate([sx[T:], xc], axis=0)
    return y


# -- a speculative verify: T tokens of one sequence, the state after each kept (lumen_core.speculative) ------------
def gated_delta_rule_kept(q, k, v, g, beta, state: DeltaState):
    """The gated delta rule over T tokens one at a time in one launch (``gdn_steps_r*``): q, k (T, Hk, Dk),
    v (T, Hv, Dv), g, beta (T, Hv) -> ((T, Hv, Dv), [[state after token t]]); each token computes exactly what
    ``gated_delta_step`` computes for it; the states are views of one (T, Hv, Dk, Dv) buffer."""
    T, Hk, Dk = q.shape
    _, Hv, Dv = v.shape
    s = state.s
    if k.shape != q.shape or v.shape[0] != T or g.shape != (T, Hv) or beta.shape != (T, Hv) or s.shape != (Hv, Dk, Dv):
        raise ValueError(f"shapes: q {q.shape}, k {k.shape}, v {v.shape}, g {g.shape}, beta {beta.shape}, "
                         f"state {s.shape}")
    if Hk == 0 or Hv % Hk:
        raise ValueError(f"v heads {Hv} not a multiple of k heads {Hk}")
    rpt = next((r for r in GDN_RPT if Dk <= 8 * r), None)
    if rpt is None or Dk == 0 or Dv == 0:
        raise ValueError(f"key head dim {Dk} unsupported (1..{8 * GDN_RPT[-1]}) or value head dim {Dv}")
    if not isinstance(s, cp.ndarray) or s.dtype != F32 or not s.flags.c_contiguous:
        raise ValueError("delta state must be a C-contiguous f32 CuPy array")
    qc, kc, vc = _f32(q, "q"), _f32(k, "k"), _f32(v, "v")
    gc, bc = _f32(g, "g"), _f32(beta, "beta")
    out = cp.empty((T, Hv, Dv), dtype=F32)
    snaps = cp.empty((T, Hv, Dk, Dv), dtype=F32)
    _fn(GDN_FILE, f"gdn_steps_r{rpt}")((Hv, -(-Dv // 32)), (GDN_THREADS,),
                                       (qc, kc, vc, gc, bc, s, out, snaps, np.int32(T), np.int32(Hk), np.int32(Hv),
                                        np.int32(Dk), np.int32(Dv), np.float32(Dk ** -0.5)))
    return out, [[snaps[t]] for t in range(T)]


def causal_conv1d_kept(x, w, state: ConvState):
    """``causal_conv1d_step`` over T tokens in one launch (``conv1d_steps``): x (T, C) -> ((T, C), [[state after
    token t]]), the states views of one (T, K-1, C) buffer."""
    T, C = x.shape
    K = w.shape[-1]
    sx = state.x
    if w.shape != (C, K) or K < 2 or sx.shape != (K - 1, C):
        raise ValueError(f"shapes: x {x.shape}, w {w.shape}, state {sx.shape} (kernel size >= 2)")
    if not isinstance(sx, cp.ndarray) or sx.dtype != F32 or not sx.flags.c_contiguous:
        raise ValueError("conv state must be a C-contiguous f32 CuPy array")
    xc, wc = _f32(x, "x"), _f32(w, "w")
    y = cp.empty((T, C), dtype=F32)
    snaps = cp.empty((T, K - 1, C), dtype=F32)
    if C:
        _fn(GDN_FILE, "conv1d_steps")((-(-C // CONV_THREADS),), (CONV_THREADS,),
                                      (xc, wc, sx, y, snaps, np.int32(T), np.int32(C), np.int32(K)))
    return y, [[snaps[t]] for t in range(T)]
