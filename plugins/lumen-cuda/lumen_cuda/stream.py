"""Routed experts streamed from host RAM (``experts: {compute: cuda:N, store: ram}``).

Weights: ``CUDABackend.weight(..., store="ram")`` copies each expert matrix (and its fp8 scales / NVFP4 block
scales) into page-locked host memory (``PinnedArena``: a few large ``cudaHostAlloc`` blocks, sub-allocated), so
host-to-device copies are asynchronous DMA.

Compute: ``experts(...)`` / ``experts_packed(...)`` (called by ``moe.experts`` when the expert weights are on the
host). Per call: the (T, k) expert ids come to the host (one sync), the distinct experts needed are staged into
the device's **expert cache** — ``slots`` expert-sized areas in VRAM, least recently used first out, shared by every
streamed layer on that device (``model.hidden-layers.experts.cache``; default ``DEFAULT_SLOTS``) — with
``cudaMemcpyAsync`` on the compute stream, and the device MoE kernels (``moe.py``) run over pointer tables that point
into the slots. An expert already resident is not copied again. When a call needs more experts than there are
slots (prefill), it runs in passes of at most ``slots`` experts: the ids of the other experts are masked to -1
(the kernels skip them) and the passes' outputs are added.

Not yet: overlapping the copies with compute (a copy stream and double-buffered staging), prefetching the next
layer's experts, and CUDA-graph capture (the ids must reach the host, so a model with streamed experts decodes op by
op: ``graph.require_host`` says so).
"""

from __future__ import annotations

import weakref
from collections import OrderedDict

import cupy as cp
import numpy as np

from lumen_core.backend import Weight
from lumen_core.plan import DEFAULT_EXPERT_CACHE as DEFAULT_SLOTS  # the plan counts the same default

ARENA_BLOCK = 256 << 20  # pinned host memory is allocated in blocks of at least this many bytes
ALIGN = 256  # byte alignment of every matrix inside a slot and inside the arena


def _round(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class PinnedArena:
    """Page-locked host memory handed out as numpy arrays; blocks are never freed before the process ends."""

    def __init__(self):
        self.blocks: list = []
        self.free = 0  # bytes left in the last block
        self.used = 0

    def copy(self, array: np.ndarray) -> np.ndarray:
        a = np.ascontiguousarray(array)
        n = _round(max(a.nbytes, 1))
        if n > self.free:
            mem = cp.cuda.alloc_pinned_memory(max(n, ARENA_BLOCK))
            self.blocks.append(mem)
            self.free = mem.size()
            self.used = 0
        mem = self.blocks[-1]
        out = np.frombuffer(mem, dtype=np.uint8, count=a.nbytes, offset=self.used).view(a.dtype).reshape(a.shape)
        out[...] = a
        self.used += n
        self.free -= n
        return out


ARENA = PinnedArena()


def pinned(array) -> np.ndarray:
    return ARENA.copy(np.asarray(array))


def is_host(w: Weight) -> bool:
    return isinstance(w.data, np.ndarray)


# -- one expert's matrices as host pieces -----------------------------------------------------------------------
def _weight_pieces(w: Weight) -> list[np.ndarray]:
    """The host arrays one matrix is made of: data, then its fp8 scale or NVFP4 block scales."""
    parts = [w.data]
    if w.format == "fp8":
        parts.append(np.ascontiguousarray(w.scale, dtype=np.float32))
    elif w.format == "nvfp4":
        parts.append(w.scale.block)
    return parts


def _device_weight(w: Weight, data, scale_dev, shape) -> Weight:
    if w.format == "fp8":
        return Weight(data, "fp8", shape, scale_dev, w.block)
    if w.format == "nvfp4":
        from .backend import NVFP4Scale

        return Weight(data, "nvfp4", shape, NVFP4Scale(scale_dev, w.scale.global_scale), w.block)
    return Weight(data, w.format, shape)


def _view(base, offset: int, like: np.ndarray):
    """A device array at byte ``offset`` of ``base`` (inside a slot) with a host array's dtype and shape."""
    mem = cp.cuda.MemoryPointer(base.data.mem, base.data.ptr - base.data.mem.ptr + offset)
    return cp.ndarray(like.shape, dtype=like.dtype, memptr=mem)


# -- the cache --------------------------------------------------------------------------------------------------
class ExpertCache:
    """``slots`` expert-sized areas of VRAM on one device; keys (id of the weight list, expert) -> slot."""

    def __init__(self, slots: int, slot_bytes: int):
        self.slots, self.slot_bytes = slots, slot_bytes
        self.buf = cp.empty(slots * slot_bytes, dtype=cp.uint8)
        self.lru: OrderedDict = OrderedDict()  # key -> slot, least recently used first
        self.copied = 0  # bytes copied host -> device (statistics)
        self.hits = self.misses = 0

    def stage(self, owner: np.ndarray, e: int, pieces: list[np.ndarray], keep: set) -> int:
        """The slot holding expert ``e`` of the weights whose host array is ``owner`` (its pieces copied there if
        it was not resident); never evicts a key in ``keep`` (the experts of the current pass). Keys hold a weak
        reference to ``owner``, so an id reused by a later model's array is never taken for a hit."""
        key = (id(owner), e)
        hit = self.lru.get(key)
        if hit is not None and hit[1]() is owner:
            self.lru.move_to_end(key)
            self.hits += 1
            return hit[0]
        self.misses += 1
        if hit is not None:  # a stale key (its owner is gone): reuse its slot
            slot = self.lru.pop(key)[0]
        elif len(self.lru) < self.slots:
            slot = len(self.lru)
        else:
            victim = next(k for k in self.lru if k not in keep)
            slot = self.lru.pop(victim)[0]
        self.lru[key] = (slot, weakref.ref(owner))
        stream = cp.cuda.get_current_stream().ptr
        base = self.buf.data.ptr + slot * self.slot_bytes
        off = 0
        for h in pieces:
            cp.cuda.runtime.memcpyAsync(base + off, h.ctypes.data, h.nbytes, cp.cuda.runtime.memcpyHostToDevice,
                                        stream)
            self.copied += h.nbytes
            off += _round(h.nbytes)
        return slot

    def views(self, slot: int, pieces: list[np.ndarray]) -> list:
        out, off = [], slot * self.slot_bytes
        for h in pieces:
            out.append(_view(self.buf, off, h))
            off += _round(h.nbytes)
        return out


_CACHES: dict[int, ExpertCache] = {}
SLOTS: dict[int, int] = {}  # device id -> configured slots (CUDABackend.configure_expert_cache)


def _cache(slot_bytes: int, k: int) -> ExpertCache:
    dev = cp.cuda.runtime.getDevice()
    slots = SLOTS.get(dev, DEFAULT_SLOTS)
    if slots < k:
        raise ValueError(f"the expert cache holds {slots} experts but a token routes to {k}: set "
                         f"model.hidden-layers.experts.cache to at least {k}")
    c = _CACHES.get(dev)
    if c is None or c.slot_bytes < slot_bytes or c.slots != slots:
        c = _CACHES[dev] = ExpertCache(slots, slot_bytes)
    return c


def stats() -> dict:
    """Per device: slots, bytes copied host -> device, hits, misses."""
    return {d: {"slots": c.slots, "copied_bytes": c.copied, "hits": c.hits, "misses": c.misses}
            for d, c in _CACHES.items()}


# -- the ops ----------------------------------------------------------------------------------------------------
def _expert_pieces(gate_up, down, packed: bool, e: int) -> tuple[list[np.ndarray], list[tuple]]:
    """Host pieces of expert e (gate, up, down matrices and their scales) and, per matrix, (source Weight, number
    of pieces, logical shape)."""
    if packed:
        g, d = gate_up.data[e], down.data[e]
        I = g.shape[0] // 2
        mats = [(gate_up, [g[:I]], (I, g.shape[1])), (gate_up, [g[I:]], (I, g.shape[1])),
                (down, [d], tuple(d.shape))]
    else:
        gw, uw = gate_up[e]
        dw = down[e]
        mats = [(w, _weight_pieces(w), tuple(w.shape)) for w in (gw, uw, dw)]
    pieces, layout = [], []
    for w, parts, shape in mats:
        pieces += [np.ascontiguousarray(p) for p in parts]
        layout.append((w, len(parts), shape))
    return pieces, layout


def _slot_bytes(pieces: list[np.ndarray]) -> int:
    return sum(_round(p.nbytes) for p in pieces)


def experts(x, ids, weights, gate_up, down, act: str = "silu", out=None, packed: bool = False):
    """``moe.experts`` (or ``moe.experts_packed`` with ``packed``) for expert weights in host RAM: stage the
    routed experts into the device's expert cache, then the device kernels; see the module docstring."""
    from . import graph, moe

    graph.require_host("experts streamed from host RAM")
    T, k = ids.shape
    E = gate_up.data.shape[0] if packed else len(gate_up)
    ids_host = cp.asnumpy(ids).astype(np.int64)
    valid = (ids_host >= 0) & (ids_host < E)
    needed = np.unique(ids_host[valid]).tolist()
    first_pieces, _ = _expert_pieces(gate_up, down, packed, needed[0] if needed else 0)
    cache = _cache(_slot_bytes(first_pieces), k)
    y = out if out is not None else cp.empty((T, x.shape[1]), dtype=cp.float32)
    if not needed:
        y[...] = 0
        return y
    def owner(e):  # the host array whose identity names expert e's weights
        return (gate_up.data, e) if packed else (gate_up[e][0].data, 0)

    acc = None
    for p0 in range(0, len(needed), cache.slots):
        chunk = needed[p0:p0 + cache.slots]
        keep = {(id(owner(e)[0]), owner(e)[1]) for e in chunk}
        staged = {}
        for e in chunk:
            pieces, layout = _expert_pieces(gate_up, down, packed, e)
            slot = cache.stage(*owner(e), pieces, keep)
            views = cache.views(slot, pieces)
            mats, i = [], 0
            for w, n, shape in layout:
                data, scale = views[i], views[i + 1] if n > 1 else None
                mats.append(_device_weight(w if not packed else Weight(None, w.format, shape), data, scale,
                                           shape))
                i += n
            staged[e] = mats
        filler = staged[chunk[0]]
        gu = [(staged.get(e, filler)[0], staged.get(e, filler)[1]) for e in range(E)]
        dn = [staged.get(e, filler)[2] for e in range(E)]
        masked = np.where(np.isin(ids_host, chunk), ids_host, -1)
        part = moe.experts_staged(x, cp.asarray(masked), weights, gu, dn, act)
        if acc is None:
            acc = part
        else:
            acc += part
    y[...] = acc
    return y
