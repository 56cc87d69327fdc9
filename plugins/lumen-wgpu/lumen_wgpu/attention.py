"""Causal softmax attention over a KV cache on the device (full or a sliding-window ring), KV sharing, and the
vision towers' bidirectional attention: the semantics of lumen_cpu.attention, as WGSL kernels.

Caches. ``KVCache`` holds every position (row p = position p); ``RingKVCache`` the last ``window`` positions (row
p % window). K and V are ``KVArray``s: (heads, rows, dim) in a dedicated buffer (zeroed by WebGPU), whole heads a
buffer (several buffers when one would pass the adapter's largest storage binding). Element types: f32, f16,
bf16 and fp8 (E4M3, saturating at ±448), packed into 32-bit words and rounded to nearest even on write exactly as
the CPU's numpy/ml_dtypes casts round, so the caches match the CPU's bit for bit; kernels widen them to f32.

One kernel computes every attention (``_attend_code``): a workgroup takes 16 query rows of one KV head — rows are
(token, query head of the group), so GQA heads share each K/V tile they read — and streams the keys in tiles of
32 with an online softmax (scores Q·Kᵀ through workgroup memory in chunks of 32 dims, then P·V with each thread
owning output dims). A row's visible keys form one interval (causal, window, ``blocks``), so tiles outside every
row's interval are skipped. When few workgroups would run (decode), the keys are split over ``nsplit``
workgroups per row tile and a second kernel combines their partial softmaxes (split-K); the keys a split are fixed
per cache, so the splits grow with the context.

Captured decode steps (runner.py): every dispatch whose params depend on the position (the cache row written,
the keys read, the number of splits) passes ``dynamic``, a function of the step's position delta, and nothing
else about the step changes with the position (same dispatches, same buffers).

Ring caches and KV sharing. A call whose keys all fit the ring (decode, short chunks) writes its new entries
into the ring and attends over the ring in place. A longer call (a prefill past the window) first gathers the
window's past out of the ring into a contiguous buffer, appends the new entries, attends over that buffer, then
stores the newest ``window`` entries into the ring. Either way ``recent`` records where the last call's keys
live (the ring, or that buffer, kept alive by the record), so ``attention_shared`` reads them on the device.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from . import wgsl
from .device import pack, wgpu_module
from .tensor import WTensor, current_context, empty

KV_TYPES = {"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16, "fp8": ml_dtypes.float8_e4m3fn}
PER_WORD = {"f32": 1, "f16": 2, "bf16": 2, "fp8": 4}  # elements a 32-bit word holds
BQ, BK, DC = 16, 32, 32  # query rows a workgroup, keys a tile, dims a score chunk
WG = 256
SPLIT_MIN_KEYS = 128  # split-K: at least this many keys a split
TARGET_GROUPS = 128  # split-K when fewer workgroups than this would run
MAX_SPLITS = 256  # split-K: at most this many splits ...
PARTIAL_BYTES = 16 << 20  # ... and their partial outputs in at most this many bytes


# -- the KV arrays --------------------------------------------------------------------------------------------
def binding_limit(ctx) -> int:
    """The most bytes a KV array keeps in one buffer (a function, so tests can make caches split)."""
    return ctx.max_binding


@dataclass
class _Part:
    """Heads [h0, h1) of a (heads, rows, dim) array in one buffer: element (h, r, d) at
    offset + (h - h0) * hs + r * rs + d."""

    gpu: object
    h0: int
    h1: int
    offset: int
    hs: int
    rs: int


class _Owned:
    """A dedicated buffer; when it goes, the context's cached bind groups that hold it go too (else they would
    keep it alive)."""

    __slots__ = ("gpu", "ctx")

    def __init__(self, ctx, nbytes: int):
        wgpu = wgpu_module()
        usage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST
        self.ctx = weakref.ref(ctx)
        self.gpu = ctx.device.create_buffer(size=max(16, -(-nbytes // 16) * 16), usage=usage)  # zeroed

    def __del__(self):
        ctx = self.ctx()
        if ctx is not None and not ctx.closed:
            ctx.forget(self.gpu)


class KVArray:
    """(heads, rows, dim) cache entries of one element type on the device.

    ``kv[:, a:b]`` reads those rows back to the host (numpy, in the element type) and ``kv[:, a:b] = array``
    writes them (recorded in order with the ops): what a prefix cache saving and restoring caches needs."""

    def __init__(self, ctx, shape, kind: str, parts: list[_Part], owners=()):
        self.ctx, self.shape, self.kind, self.parts, self._owners = ctx, tuple(shape), kind, parts, owners
        self.dtype = np.dtype(KV_TYPES[kind])

    @classmethod
    def zeros(cls, ctx, heads: int, rows: int, dim: int, kind: str, pooled: bool = False) -> KVArray:
        """A new array, whole heads a buffer; ``pooled``: from the activation pool (contents undefined), for the
        short-lived gather buffers of long ring calls."""
        if dim % PER_WORD[kind]:
            raise ValueError(f"a {kind} KV cache needs a head dim that is a multiple of {PER_WORD[kind]} (got {dim})")
        head_bytes = rows * dim * np.dtype(KV_TYPES[kind]).itemsize
        per = binding_limit(ctx) // max(1, head_bytes)
        if per < 1:
            raise ValueError(f"one KV head of {rows} positions x {dim} dims ({head_bytes >> 20} MiB) exceeds the "
                             f"adapter's largest storage binding ({ctx.max_binding >> 20} MiB): use a shorter "
                             "context or a smaller KV type")
        parts, owners = [], []
        for h0 in range(0, heads, per):
            h1 = min(heads, h0 + per)
            owner = ctx.alloc((h1 - h0) * head_bytes) if pooled else _Owned(ctx, (h1 - h0) * head_bytes)
            owners.append(owner)
            parts.append(_Part(owner.gpu, h0, h1, 0, rows * dim, dim))
        return cls(ctx, (heads, rows, dim), kind, parts, tuple(owners))

    @classmethod
    def view(cls, x: WTensor) -> KVArray:
        """An f32 (rows, heads, dim) tensor (``bidirectional_attention``'s k, v) as (heads, rows, dim)."""
        if x.strides[-1] != 1:
            x = x.dense()
        rows, heads, dim = x.shape
        return cls(x.ctx, (heads, rows, dim), "f32", [_Part(x.buf.gpu, 0, heads, x.offset, x.strides[1],
                                                              x.strides[0])], (x.buf,))

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def _rows(self, key) -> tuple[int, int]:
        if key is Ellipsis:
            return 0, self.shape[1]
        if (isinstance(key, tuple) and len(key) == 2 and key[0] == slice(None) and isinstance(key[1], slice)
                and key[1].step in (None, 1)):
            a, b, _ = key[1].indices(self.shape[1])
            return a, max(a, b)
        raise IndexError("a KV array takes [...] or [:, a:b]")

    def __getitem__(self, key) -> np.ndarray:
        a, b = self._rows(key)
        heads, _, dim = self.shape
        out = np.empty((heads, b - a, dim), self.dtype)
        isz = self.dtype.itemsize
        for p in self.parts:
            for h in range(p.h0, p.h1):
                at = p.offset + (h - p.h0) * p.hs + a * p.rs
                raw = self.ctx.read(p.gpu, at * isz, (b - a) * dim * isz)
                out[h] = np.frombuffer(raw, self.dtype).reshape(b - a, dim)
        return out

    def __setitem__(self, key, value) -> None:
        a, b = self._rows(key)
        heads, _, dim = self.shape
        host = np.broadcast_to(np.asarray(value), (heads, b - a, dim))
        if host.dtype != self.dtype:
            host = _store_host(host.astype(np.float32), self.dtype)
        src = self.ctx.upload(np.ascontiguousarray(host).view(np.uint8))  # ml_dtypes' types have no buffer protocol
        words = dim // PER_WORD[self.kind]
        for p in self.parts:
            _copy_rows(self.ctx, src.gpu, (0, heads), 0, (b - a) * words, words, (0, b - a), b - a, p,
                       (a, self.shape[1]), words, PER_WORD[self.kind])

    def get(self) -> np.ndarray:
        return self[...]

    _lumen_to_host = get

    def __array__(self, dtype=None, copy=None):
        a = self.get()
        return a if dtype is None else a.astype(dtype)

    def __repr__(self) -> str:
        return f"KVArray(shape={self.shape}, {self.kind}, wgpu:{self.ctx.index})"


def _store_host(x: np.ndarray, dtype) -> np.ndarray:
    """f32 -> the cache type as the CPU stores it (fp8 saturates at ±448)."""
    if dtype == ml_dtypes.float8_e4m3fn:
        x = np.clip(x, -448.0, 448.0)
    return x.astype(dtype)


@dataclass
class _Keys:
    """Where the keys of positions [first, end) live: position j in row (j - p0) % mod of k and v."""

    k: KVArray
    v: KVArray
    p0: int
    mod: int
    first: int
    end: int


@dataclass
class KVCache:
    k: KVArray  # (kv_heads, ctx, head_dim)
    v: KVArray  # (kv_heads, ctx, head_dim_v)

    @property
    def capacity(self) -> int:
        return self.k.shape[1]


@dataclass
class RingKVCache:
    k: KVArray  # (kv_heads, window, head_dim): position p in row p % window
    v: KVArray
    recent: _Keys | None = None  # where the last call's keys live (the ring itself, or a gathered buffer)

    @property
    def capacity(self) -> int:
        return self.k.shape[1]


def _kind(name, role: str) -> str:
    if name not in KV_TYPES:
        raise ValueError(f"the wgpu backend cannot keep a {name!r} KV cache ({role}); it keeps "
                         f"{', '.join(KV_TYPES)}")
    return name


def _arrays(rows, kv_heads, head_dim, type_k, type_v, head_dim_v):
    ctx = current_context()
    tk = _kind(type_k, "type_k")
    tv = _kind(type_v or type_k, "type_v")
    return (KVArray.zeros(ctx, kv_heads, rows, head_dim, tk),
            KVArray.zeros(ctx, kv_heads, rows, head_dim_v or head_dim, tv))


def kv_cache(context: int, kv_heads: int, head_dim: int, type_k: str = "f32", type_v: str | None = None,
             head_dim_v: int | None = None):
    return KVCache(*_arrays(context, kv_heads, head_dim, type_k, type_v, head_dim_v))


def sliding_kv_cache(window: int, kv_heads: int, head_dim: int, type_k: str = "f32", type_v: str | None = None,
                     head_dim_v: int | None = None):
    return RingKVCache(*_arrays(window, kv_heads, head_dim, type_k, type_v, head_dim_v))


# -- the ops --------------------------------------------------------------------------------------------------
def attention(q, k, v, cache, start: int, scale: float, window: int | None = None, softcap: float | None = None,
              blocks=None):
    """q (T, Hq, D), k (T, Hkv, D), v (T, Hkv, Dv) at start..start+T-1 -> (T, Hq, Dv); writes k, v first."""
    T = q.shape[0]
    _check_window(window)
    if isinstance(cache, RingKVCache):
        keys = _ring_update(cache, k, v, start, window)
    else:
        if start + T > cache.capacity:
            raise ValueError(f"positions {start}..{start + T - 1} do not fit a KV cache of {cache.capacity}")
        _store(k, cache.k, 0, start, cache.capacity)
        _store(v, cache.v, 0, start, cache.capacity)
        keys = _Keys(cache.k, cache.v, 0, cache.capacity, 0, start + T)
    return _attend(q, keys, start, _span(T, window), _max_keys(cache, keys, T, window), scale, window, softcap,
                   blocks)


def attention_shared(q, cache, start: int, scale: float, window: int | None = None, softcap: float | None = None,
                     blocks=None):
    """q (T, Hq, D) at start..start+T-1 over keys another layer wrote this call -> (T, Hq, Dv)."""
    T = q.shape[0]
    _check_window(window)
    lo, end = _span(T, window)(start)
    if isinstance(cache, RingKVCache):
        keys = cache.recent
        if keys is None or lo < keys.first or end > keys.end:
            raise ValueError(f"positions {lo}..{end - 1} are not in the shared ring's last call")
    else:
        if end > cache.capacity:
            raise ValueError(f"positions {start}..{end - 1} do not fit a KV cache of {cache.capacity}")
        keys = _Keys(cache.k, cache.v, 0, cache.capacity, 0, end)
    return _attend(q, keys, start, _span(T, window), _max_keys(cache, keys, T, window), scale, window, softcap,
                   blocks)


def bidirectional_attention(q, k, v, scale: float):
    """softmax(q kᵀ · scale) v, every query over every key: q (T, H, D), k (S, Hkv, D), v (S, Hkv, Dv) -> (T, H,
    Dv)."""
    S = k.shape[0]
    keys = _Keys(KVArray.view(k), KVArray.view(v), 0, max(1, S), 0, S)
    return _attend(q, keys, 0, lambda at: (0, S), S, scale, None, None, None, causal=False)


def _span(T: int, window: int | None):
    """position of the first query -> the keys [lo, end) a call reads."""
    return lambda at: (0 if window is None else max(0, at - window + 1), at + T)


def _max_keys(cache, keys: _Keys, T: int, window: int | None) -> int:
    """The most keys a call of T queries reads from ``keys`` at any position (see ``_attend``)."""
    if keys.mod != cache.capacity:  # a ring's gathered buffer: this call's keys exactly
        return keys.end - keys.first
    return cache.capacity if window is None else min(cache.capacity, window + T - 1)


def table():
    return [(f.__name__, f, None) for f in (kv_cache, sliding_kv_cache, attention, attention_shared,
                                            bidirectional_attention)]


def _check_window(window) -> None:
    if window is not None and window < 1:
        raise ValueError(f"attention window must be at least 1 (got {window})")


def _ring_update(cache: RingKVCache, k, v, start: int, window: int | None) -> _Keys:
    """Store the new entries into the ring and say where this call's keys live (see the module's docstring)."""
    cap, T = cache.capacity, k.shape[0]
    if window is None or window > cap:
        raise ValueError(f"a ring KV cache of {cap} positions cannot serve attention window {window}")
    end = start + T
    lo = max(0, start - window + 1)
    if end - lo <= cap:  # every key this call reads is still in the ring once the new ones are in
        _store(k, cache.k, 0, start, cap)
        _store(v, cache.v, 0, start, cap)
        keys = _Keys(cache.k, cache.v, 0, cap, lo, end)
    else:
        S = end - lo
        ctx = cache.k.ctx
        heads = cache.k.shape[0]
        gk = KVArray.zeros(ctx, heads, S, cache.k.shape[2], cache.k.kind, pooled=True)
        gv = KVArray.zeros(ctx, heads, S, cache.v.shape[2], cache.v.kind, pooled=True)
        for ring, buf, new in ((cache.k, gk, k), (cache.v, gv, v)):
            _gather_ring(ring, buf, lo, start)  # the window's past: rows 0..start-lo-1
            _store(new, buf, 0, start - lo, S)  # then this call's entries
            n = min(T, cap)  # the newest cap of them stay in the ring
            _store(new[T - n:], ring, 0, end - n, cap)
        keys = _Keys(gk, gv, lo, S, lo, end)
    cache.recent = keys
    return keys


# -- kernels: storing and copying entries -------------------------------------------------------------------------
# f32 -> the element type's bits, rounded to nearest even as numpy (f16) and ml_dtypes (bf16, fp8 E4M3) round.
_ENCODE = """
fn enc_f16(x: f32) -> u32 {
  let u = bitcast<u32>(x);
  let sign = (u >> 16u) & 0x8000u;
  let a = u & 0x7fffffffu;
  if (a > 0x7f800000u) { return sign | 0x7e00u; }
  if (a >= 0x477ff000u) { return sign | 0x7c00u; }  // rounds past 65504: inf
  if (a >= 0x38800000u) { return sign | ((a + 0xfffu + ((a >> 13u) & 1u) - 0x38000000u) >> 13u); }
  return sign | u32(round(bitcast<f32>(a) * 16777216.0));  // subnormal: units of 2^-24, round() ties to even
}
fn enc_bf16(x: f32) -> u32 {
  let u = bitcast<u32>(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) { return (u >> 16u) | 0x40u; }
  return (u + 0x7fffu + ((u >> 16u) & 1u)) >> 16u;
}
fn enc_fp8(x: f32) -> u32 {
  let u = bitcast<u32>(x);
  let sign = (u >> 24u) & 0x80u;
  if ((u & 0x7fffffffu) > 0x7f800000u) { return sign | 0x7fu; }
  let a = min(bitcast<f32>(u & 0x7fffffffu), 448.0);  // saturate (the CPU clips before the cast)
  let b = bitcast<u32>(a);
  if (a >= 0.015625) { return sign | (((b + 0x7ffffu + ((b >> 20u) & 1u)) >> 20u) - 960u); }  // 960 = 120 << 3
  return sign | u32(round(a * 512.0));  // subnormal: units of 2^-9
}
"""

_DECODE = {
    "f32": "fn ld_{n}(i: u32) -> f32 {{ return bitcast<f32>({B}[i]); }}",
    "f16": "fn ld_{n}(i: u32) -> f32 {{ return unpack2x16float({B}[i >> 1u])[i & 1u]; }}",
    "bf16": "fn ld_{n}(i: u32) -> f32 {{ let u = {B}[i >> 1u]; "
            "return bitcast<f32>(select(u << 16u, u & 0xffff0000u, (i & 1u) == 1u)); }}",
    "fp8": "fn ld_{n}(i: u32) -> f32 {{ let b = ({B}[i >> 2u] >> ((i & 3u) * 8u)) & 0xffu; "
           "let e = (b >> 3u) & 15u; let m = f32(b & 7u); "
           "var x = select(ldexp(1.0 + m * 0.125, i32(e) - 7), m * 0.001953125, e == 0u); "
           "if ((b & 0x7fu) == 0x7fu) {{ x = bitcast<f32>(0x7fc00000u); }} "
           "return select(x, -x, (b & 0x80u) != 0u); }}",
}


def _store_code(kind: str) -> str:
    per = PER_WORD[kind]
    if kind == "f32":
        word = "bitcast<u32>(ld_src(0u))"
    else:
        word = " | ".join(f"(enc_{kind}(ld_src({j}u)) << {j * 32 // per}u)" for j in range(per))
    return wgsl.header([("S", "r", "f32"), ("Dst", "w", "u32")]) + _ENCODE + f"""
// One invocation a destination word ({per} element(s)). words: 0 n, 1 words a row, 2 rows, 3 heads, 4 src offset,
// 5 src row stride, 6 src head stride, 7 src dim stride, 8 first src head, 9 dst offset (words), 10 dst head stride
// (words), 11 dst row stride (words), 12 first dst row, 13 dst rows (the ring: rows wrap), 14 first dst head in
// this buffer
var<private> src_at: u32;
fn ld_src(j: u32) -> f32 {{ return S[src_at + j * w(7u)]; }}
@compute @workgroup_size({WG})
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {{
  let i = group_id(wid, nw) * {WG}u + lid;
  if (i >= w(0u)) {{ return; }}
  let e = i % w(1u); let r = (i / w(1u)) % w(2u); let h = i / (w(1u) * w(2u));
  src_at = w(4u) + r * w(5u) + (w(8u) + h) * w(6u) + e * {per}u * w(7u);
  let row = (w(12u) + r) % w(13u);
  Dst[w(9u) + (w(14u) + h) * w(10u) + row * w(11u) + e] = {word};
}}
"""


_COPY = wgsl.header([("Src", "r", "u32"), ("Dst", "w", "u32")]) + """
// Rows of words, both sides possibly wrapping (a ring). words: 0 n, 1 words a row, 2 rows, 3 src offset, 4 src head
// stride, 5 src row stride, 6 first src row, 7 src rows, 8 first src head, 9 dst offset, 10 dst head stride,
// 11 dst row stride, 12 first dst row, 13 dst rows, 14 first dst head
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
  let i = group_id(wid, nw) * 256u + lid;
  if (i >= w(0u)) { return; }
  let e = i % w(1u); let r = (i / w(1u)) % w(2u); let h = i / (w(1u) * w(2u));
  let s = w(3u) + (w(8u) + h) * w(4u) + ((w(6u) + r) % w(7u)) * w(5u) + e;
  Dst[w(9u) + (w(14u) + h) * w(10u) + ((w(12u) + r) % w(13u)) * w(11u) + e] = Src[s];
}
"""


def _store(x: WTensor, dst: KVArray, src_row: int, dst_row: int, dst_rows: int) -> None:
    """Rows src_row.. of x (T, heads, dim), any strides, into dst rows dst_row.. (mod dst_rows), encoded. In a
    captured decode step the destination row moves with the position (``dynamic``)."""
    rows = x.shape[0] - src_row
    if rows <= 0:
        return
    heads, _, dim = dst.shape
    if x.shape[1:] != (heads, dim):
        raise ValueError(f"attention: new entries of shape {x.shape} do not fit a cache of {heads} heads x {dim}")
    ctx, per = dst.ctx, PER_WORD[dst.kind]
    words = dim // per
    kernel = ctx.kernel(f"kv_store_{dst.kind}", _store_code(dst.kind), "rw")
    st, sh, sd = x.strides
    for p in dst.parts:
        n = (p.h1 - p.h0) * rows * words
        groups = wgsl.grid(-(-n // WG), ctx.max_groups)

        def params(row, p=p, n=n, groups=groups):
            return pack(n, words, rows, p.h1 - p.h0, x.offset + src_row * st, st, sh, sd, p.h0, p.offset // per,
                        p.hs // per, p.rs // per, row % dst_rows, dst_rows, 0), groups

        ctx.dispatch(kernel, [x.buf.gpu, p.gpu], *params(dst_row),
                     dynamic=lambda inputs, params=params: params(dst_row + inputs["delta"]))


def _copy_rows(ctx, src_gpu, src_heads: tuple[int, int], src_off: int, src_hs: int, src_rs: int,
               src_rows: tuple[int, int], rows: int, p: _Part, dst_rows: tuple[int, int], words: int, per: int) -> None:
    """``rows`` rows of ``words`` words from a source holding heads [src_heads) (offset, head and row strides in
    words; rows from ``src_rows`` = (first, modulus)) into the heads of part ``p`` (its layout in elements, ``per``
    a word) both hold, rows from ``dst_rows`` = (first, modulus)."""
    a, b = max(src_heads[0], p.h0), min(src_heads[1], p.h1)
    if a >= b or rows <= 0:
        return
    n = (b - a) * rows * words
    params = pack(n, words, rows, src_off, src_hs, src_rs, src_rows[0] % src_rows[1], src_rows[1], a - src_heads[0],
                  p.offset // per, p.hs // per, p.rs // per, dst_rows[0] % dst_rows[1], dst_rows[1], a - p.h0)
    ctx.dispatch(ctx.kernel("kv_copy", _COPY, "rw"), [src_gpu, p.gpu], params, wgsl.grid(-(-n // WG), ctx.max_groups))


def _gather_ring(ring: KVArray, buf: KVArray, lo: int, start: int) -> None:
    """Positions lo..start-1 out of the ring (row p % cap) into rows 0.. of buf."""
    per = PER_WORD[ring.kind]
    words = ring.shape[2] // per
    for sp in ring.parts:
        for dp in buf.parts:
            _copy_rows(ring.ctx, sp.gpu, (sp.h0, sp.h1), sp.offset // per, sp.hs // per, sp.rs // per,
                       (lo, ring.shape[1]), start - lo, dp, (0, buf.shape[1]), words, per)


# -- kernels: attention -----------------------------------------------------------------------------------------
def _attend_code(kind_k: str, kind_v: str, dvpt: int) -> str:
    """The attention kernel for K, V element types and ``dvpt`` output dims a thread (Dv <= 256 * dvpt)."""
    binds = [("Q", "r", "f32"), ("K", "r", "u32"), ("V", "r", "u32"), ("BLK", "r", "u32"), ("O", "w", "f32"),
             ("ML", "w", "f32")]
    acc = BQ * dvpt
    return wgsl.header(binds) + _DECODE[kind_k].format(n="k", B="K") + "\n" + \
        _DECODE[kind_v].format(n="v", B="V") + f"""
// words: 0 T, 1 Hq, 2 G (query heads a KV head), 3 D, 4 Dv, 5 start (position of query 0), 6 lo, 7 end (keys
// [lo, end)), 8 window (0: none), 9 scale, 10 softcap (0: none), 11 flags (1: BLK holds each query's block end,
// 2: not causal, 4: write partials for the combine kernel), 12 q offset, 13..15 q strides (token, head, dim),
// 16 k offset, 17 k head stride, 18 k row stride, 19 first head of the k buffer, 20..23 the same for v, 24 p0,
// 25 rows mod (key j at row (j - p0) % mod), 26 nsplit, 27 keys a split, 28 first KV head of this dispatch,
// 29 rows (G * T)
// grid: x row tiles of {BQ}, y KV heads, z splits. Rows r = t * G + g: query head h * G + g of token t.
const BQ = {BQ}u; const BK = {BK}u; const DC = {DC}u; const KP = {DC + 1}u; const NEG = -3.0e38;
var<workgroup> qs: array<f32, {BQ * DC}>;
var<workgroup> ks: array<f32, {BK * (DC + 1)}>;
var<workgroup> ss: array<f32, {BQ * BK}>;
var<workgroup> red: array<f32, {WG}>;
var<workgroup> red2: array<f32, {WG}>;
var<workgroup> rm: array<f32, {BQ}>;
var<workgroup> rl: array<f32, {BQ}>;
var<workgroup> ra: array<f32, {BQ}>;
var<workgroup> rlo: array<u32, {BQ}>;
var<workgroup> rhi: array<u32, {BQ}>;
var<workgroup> kbeg_s: u32;
var<workgroup> kend_s: u32;
@compute @workgroup_size({WG})
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {{
  let T = w(0u); let Hq = w(1u); let G = w(2u); let D = w(3u); let Dv = w(4u);
  let start = w(5u); let lo = w(6u); let end = w(7u); let win = w(8u);
  let scale = wf(9u); let cap = wf(10u); let flags = w(11u);
  let p0 = w(24u); let md = w(25u);
  let h = w(28u) + wid.y;
  let rows = w(29u);
  let r0 = wid.x * BQ;
  let split = wid.z;
  let sbeg = lo + split * w(27u);
  let send = min(sbeg + w(27u), end);
  let kb = w(16u) + (h - w(19u)) * w(17u);
  let vb = w(20u) + (h - w(23u)) * w(21u);
  // each row's visible keys: one interval [a, b) (causal or its block's end, the window, this split)
  if (lid < BQ) {{
    let r = r0 + lid;
    var a = 0xffffffffu; var b = 0u;
    if (r < rows) {{
      let t = r / G; let qp = start + t;
      a = lo; b = qp + 1u;
      if (win > 0u && qp + 1u > win) {{ a = max(a, qp + 1u - win); }}
      if ((flags & 2u) != 0u) {{ b = end; }}
      if ((flags & 1u) != 0u) {{ b = max(b, BLK[t]); }}
      a = max(a, sbeg); b = min(min(b, end), send);
    }}
    rlo[lid] = a; rhi[lid] = b; rm[lid] = NEG; rl[lid] = 0.0;
  }}
  workgroupBarrier();
  if (lid == 0u) {{
    var a = 0xffffffffu; var b = 0u;
    for (var i = 0u; i < BQ; i++) {{ if (rlo[i] < rhi[i]) {{ a = min(a, rlo[i]); b = max(b, rhi[i]); }} }}
    if (a >= b) {{ a = 0u; b = 0u; }}
    kbeg_s = a; kend_s = b;
  }}
  let kbeg = workgroupUniformLoad(&kbeg_s);
  let kend = workgroupUniformLoad(&kend_s);
  let sq = lid / 16u; let sk = lid % 16u;
  let live = r0 + sq < rows;
  var acc: array<f32, {acc}>;
  for (var i = 0u; i < {acc}u; i++) {{ acc[i] = 0.0; }}
  for (var kt = kbeg; kt < kend; kt += BK) {{
    // scores of rows sq, keys kt + sk and kt + sk + 16, summed over chunks of DC dims
    var s0 = 0.0; var s1 = 0.0;
    for (var dc = 0u; dc < D; dc += DC) {{
      for (var i = 0u; i < {BQ * DC // WG}u; i++) {{
        let e = lid + i * {WG}u; let r = r0 + e / DC; let d = dc + e % DC;
        var x = 0.0;
        if (r < rows && d < D) {{
          x = Q[w(12u) + (r / G) * w(13u) + (h * G + r % G) * w(14u) + d * w(15u)];
        }}
        qs[e] = x;
      }}
      for (var i = 0u; i < {BK * DC // WG}u; i++) {{
        let e = lid + i * {WG}u; let kr = e / DC; let kd = e % DC; let j = kt + kr; let d = dc + kd;
        var x = 0.0;
        if (j < kend && d < D) {{ x = ld_k(kb + ((j - p0) % md) * w(18u) + d); }}
        ks[kr * KP + kd] = x;
      }}
      workgroupBarrier();
      if (live) {{  // rows past the last (decode: most of the tile) skip the math; their warps idle
        for (var kk = 0u; kk < DC; kk++) {{
          let qv = qs[sq * DC + kk];
          s0 += qv * ks[sk * KP + kk];
          s1 += qv * ks[(sk + 16u) * KP + kk];
        }}
      }}
      workgroupBarrier();
    }}
    // online softmax: the 16 threads of a row hold its 32 scores (2 each); the row's max and sum go through red
    let ja = kt + sk; let jb = ja + 16u;
    var sa = s0 * scale; var sb = s1 * scale;
    if (cap > 0.0) {{ sa = tanh_f(sa / cap) * cap; sb = tanh_f(sb / cap) * cap; }}
    sa = select(NEG, sa, ja >= rlo[sq] && ja < rhi[sq]);
    sb = select(NEG, sb, jb >= rlo[sq] && jb < rhi[sq]);
    red[lid] = max(sa, sb);
    workgroupBarrier();
    let mo = rm[sq];
    var mx = mo;
    for (var i = 0u; i < 16u; i++) {{ mx = max(mx, red[sq * 16u + i]); }}
    let pa = select(0.0, exp(sa - mx), sa > -1.0e38);
    let pb = select(0.0, exp(sb - mx), sb > -1.0e38);
    ss[sq * BK + sk] = pa; ss[sq * BK + sk + 16u] = pb;
    red2[lid] = pa + pb;
    workgroupBarrier();
    if (sk == 0u) {{  // rescale the row's running sum (and, below, its outputs) by alpha
      var sum = 0.0;
      for (var i = 0u; i < 16u; i++) {{ sum += red2[sq * 16u + i]; }}
      let alpha = exp(mo - mx);
      rl[sq] = rl[sq] * alpha + sum; rm[sq] = mx; ra[sq] = alpha;
    }}
    workgroupBarrier();
    let nk = min(BK, kend - kt);
    for (var c = 0u; c < {dvpt}u; c++) {{
      let d = lid + c * {WG}u;
      for (var rr = 0u; rr < BQ; rr++) {{ acc[rr * {dvpt}u + c] *= ra[rr]; }}
      if (d < Dv) {{
        for (var j = 0u; j < nk; j++) {{
          let vv = ld_v(vb + ((kt + j - p0) % md) * w(22u) + d);
          for (var rr = 0u; rr < BQ; rr++) {{  // a constant bound keeps acc in registers; the test is uniform
            if (r0 + rr < rows) {{ acc[rr * {dvpt}u + c] += ss[rr * BK + j] * vv; }}
          }}
        }}
      }}
    }}
    workgroupBarrier();
  }}
  let single = (flags & 4u) == 0u;
  let R = T * Hq;
  for (var rr = 0u; rr < BQ; rr++) {{
    let r = r0 + rr;
    if (r < rows) {{
      let orow = (r / G) * Hq + h * G + r % G;
      for (var c = 0u; c < {dvpt}u; c++) {{
        let d = lid + c * {WG}u;
        if (d < Dv) {{
          if (single) {{
            O[orow * Dv + d] = acc[rr * {dvpt}u + c] / rl[rr];
          }} else {{
            O[(split * R + orow) * Dv + d] = acc[rr * {dvpt}u + c];
          }}
        }}
      }}
      if (!single && lid == 0u) {{ ML[(split * R + orow) * 2u] = rm[rr]; ML[(split * R + orow) * 2u + 1u] = rl[rr]; }}
    }}
  }}
}}
"""


_COMBINE = wgsl.header([("P", "r", "f32"), ("ML", "r", "f32"), ("O", "w", "f32")]) + """
// The splits' partial softmaxes of each output element. words: 0 R (rows: T * Hq), 1 Dv, 2 nsplit
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
  let i = group_id(wid, nw) * 256u + lid;
  let R = w(0u); let Dv = w(1u); let ns = w(2u);
  if (i >= R * Dv) { return; }
  let row = i / Dv;
  var m = -3.0e38;
  for (var s = 0u; s < ns; s++) { m = max(m, ML[(s * R + row) * 2u]); }
  var num = 0.0; var den = 0.0;
  for (var s = 0u; s < ns; s++) {
    let wt = exp(ML[(s * R + row) * 2u] - m);
    num += wt * P[s * R * Dv + i];
    den += wt * ML[(s * R + row) * 2u + 1u];
  }
  O[i] = num / den;
}
"""


def _block_ends(blocks, start: int, T: int) -> np.ndarray:
    """Each query's block end: the largest end of the blocks holding its position (0: none). Blocks holding one
    position overlap there, so with the causal keys they make one interval [.., max(position + 1, end))."""
    out = np.zeros(T, np.uint32)
    pos = np.arange(start, start + T)
    for first, stop in blocks:
        inside = (pos >= first) & (pos < stop)
        out[inside] = np.maximum(out[inside], stop)
    return out


def _attend(q: WTensor, keys: _Keys, start: int, span, max_keys: int, scale: float, window, softcap, blocks,
            causal: bool = True) -> WTensor:
    """q (T, Hq, D) at positions start.. over the keys [lo, end) = ``span(start)`` of ``keys`` -> (T, Hq, Dv).

    ``max_keys`` bounds end - lo for every position this cache can serve: the split-K layout (keys a split,
    whether partials are combined, their buffer) is chosen from it, not from this call's key count, so a captured
    decode step keeps its dispatches and buffers as the position moves and only the params change (``dynamic``)."""
    ctx = q.ctx
    T, Hq, D = q.shape
    Hkv, _, Dk = keys.k.shape
    Dv = keys.v.shape[2]
    if Dk != D or Hq % Hkv:
        raise ValueError(f"attention: queries {q.shape} do not fit keys of {Hkv} heads x {Dk} dims")
    G = Hq // Hkv
    out = empty(ctx, (T, Hq, Dv))
    if T == 0 or max_keys <= 0:
        return out
    flags = 0 if causal else 2
    blk = q.buf
    if blocks:
        flags |= 1
        blk = ctx.upload(_block_ends(blocks, start, T))
    rows = G * T
    tiles = -(-rows // BQ)
    if tiles * Hkv >= TARGET_GROUPS:  # enough workgroups (a prefill): no split
        chunk = max_keys
    else:  # keys a split fixed for the cache, so the splits grow with the context (their partials' buffer bounded)
        room = max(1, min(MAX_SPLITS, PARTIAL_BYTES // (4 * T * Hq * Dv)))
        chunk = -(-max(SPLIT_MIN_KEYS, -(-max_keys // room)) // BK) * BK
    most = -(-max_keys // chunk)  # splits at the longest
    dvpt = -(-Dv // WG)
    kernel = ctx.kernel(f"attend_{keys.k.kind}_{keys.v.kind}_{dvpt}", _attend_code(keys.k.kind, keys.v.kind, dvpt),
                        "rrrrww")
    if most > 1:
        flags |= 4
        part = ctx.alloc(4 * most * T * Hq * Dv)
        ml = ctx.alloc(8 * most * T * Hq)
        dst = part.gpu
    else:
        ml = ctx.alloc(16)  # unwritten; a buffer of its own (a writable binding may alias no other)
        dst = out.buf.gpu

    def splits(at):
        lo, end = span(at)
        return lo, end, max(1, -(-(end - lo) // chunk)) if most > 1 else 1

    for h0, h1, kp, vp in _head_spans(keys.k, keys.v):
        def params(at, h0=h0, h1=h1, kp=kp, vp=vp):
            lo, end, nsplit = splits(at)
            return pack(T, Hq, G, D, Dv, at, lo, end, window or 0, float(scale), float(softcap or 0.0), flags,
                        q.offset, *q.strides, kp.offset, kp.hs, kp.rs, kp.h0, vp.offset, vp.hs, vp.rs, vp.h0,
                        keys.p0, keys.mod, nsplit, chunk, h0, rows), (tiles, h1 - h0, nsplit)

        ctx.dispatch(kernel, [q.buf.gpu, kp.gpu, vp.gpu, blk.gpu, dst, ml.gpu], *params(start),
                     dynamic=lambda inputs, params=params: params(start + inputs["delta"]))
    if most > 1:
        groups = wgsl.grid(-(-T * Hq * Dv // WG), ctx.max_groups)

        def combine(at):
            return pack(T * Hq, Dv, splits(at)[2]), groups

        ctx.dispatch(ctx.kernel("attend_combine", _COMBINE, "rrw"), [part.gpu, ml.gpu, out.buf.gpu], *combine(start),
                     dynamic=lambda inputs: combine(start + inputs["delta"]))
    return out


def _head_spans(k: KVArray, v: KVArray):
    """(h0, h1, k part, v part) for each run of heads that lies in one buffer of k and one of v."""
    for kp in k.parts:
        for vp in v.parts:
            a, b = max(kp.h0, vp.h0), min(kp.h1, vp.h1)
            if a < b:
                yield a, b, kp, vp
