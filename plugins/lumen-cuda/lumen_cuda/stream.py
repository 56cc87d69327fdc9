"""Routed experts streamed from host RAM (``experts: {compute: cuda:N, store: ram}``).

Weights: ``CUDABackend.weight(..., store="ram")`` copies each expert matrix (and its fp8 scales / NVFP4 block
scales) into page-locked host memory (the backend's ``pinned.PinnedArena``: a ``cudaHostAlloc`` of its own for each
large array, small ones packed into shared blocks, so that it takes what the plan counts; pinned.py says why). Such
memory is mapped into the GPU's address space (unified addressing), so a kernel can read it straight over PCIe.

Each streamed layer gets a ``HostExperts``: the device MoE kernels' pointer tables (``moe._Table``), in which the
entry of expert e points at its slot in the backend's **expert cache** when e is resident there, and otherwise at
its pinned host copy. The cache is ``slots`` expert-sized areas of VRAM shared by every streamed layer of one
engine on the device (``model.hidden-layers.experts.cache``; default ``DEFAULT_SLOTS``).

Ownership: the cache belongs to the backend instance (``CUDABackend.expert_streams``, an ``ExpertStreams``: one per
device per engine, so a main model and its draft, or two served models, never evict each other's experts), and
goes with ``CUDABackend.close``; a layer's ``HostExperts`` is kept on its first expert Weight (lumen_cuda.state)
and goes with the model. The ops reach the backend's ``ExpertStreams`` through ``backend=`` (ops.moe_experts).

- **Decode** (fewer than ``moe.GROUPED_MIN_T`` tokens): the kernels run over the tables as they are. A routed
  expert that is not resident is read from host memory by the GEMV kernels themselves (each byte crosses PCIe
  once, while the kernel computes): no host sync, no staging copy to wait for, so the decode step is captured as
  a CUDA graph like an all-VRAM one. A ``moe_count`` kernel (kernels/stream.cu) counts each expert's uses.
- **The cache policy** (``ExpertCache.maintain``, called once per decode step by the graph runner, or per layer
  call when decoding op by op): every ``REFRESH`` steps the counts are copied to pinned memory (asynchronously;
  read at the next refresh), folded into a decayed score per expert, and up to ``MAX_SWAPS`` experts whose score
  beats the weakest resident one by ``HYSTERESIS`` are brought in: the victim's table entries are pointed back at
  host memory (on the compute stream), the new expert is copied into the freed slot on a separate copy stream
  (after an event, so no kernel still reading the slot is overtaken), and its entries are pointed at the slot once
  that copy has finished (checked without blocking at the next step). Decoding never waits for a copy.
- **Prefill** (``moe.GROUPED_MIN_T`` tokens or more): the ids come to the host (one sync), and the distinct
  experts needed are staged into slots with ``cudaMemcpyAsync`` before the grouped kernels run, so each expert
  crosses PCIe once however many tokens route to it. When a call needs more experts than there are slots, it
  runs in passes: the ids of the experts outside the pass are masked to -1 and the passes' outputs are added.
  Victims are the resident experts with the lowest scores that the pass does not need.

Correctness never depends on residency: every table entry always points at a valid copy of its expert.
"""

from __future__ import annotations

import weakref

import cupy as cp
import numpy as np

from lumen_core.backend import Weight
from lumen_core.plan import DEFAULT_EXPERT_CACHE as DEFAULT_SLOTS  # the plan counts the same default

from . import gemv, kernels, moe, step
from .pinned import _round
from .state import derived

MEMORY_TYPE_HOST = 1  # cudaMemoryTypeHost


def _page_locked(a: np.ndarray) -> bool:
    """Whether the GPU can read ``a`` through its host address (page-locked host memory, mapped at the same address:
    unified addressing)."""
    try:
        attrs = cp.cuda.runtime.pointerGetAttributes(a.ctypes.data)
    except cp.cuda.runtime.CUDARuntimeError:
        return False
    return attrs.type == MEMORY_TYPE_HOST and attrs.devicePointer == a.ctypes.data


# -- one expert's matrices as host pieces -----------------------------------------------------------------------
def _weight_pieces(w: Weight) -> list[np.ndarray]:
    """The host arrays one matrix is made of: data, then its fp8 scale or NVFP4 block scales."""
    parts = [w.data]
    if w.format == "fp8":
        parts.append(np.ascontiguousarray(w.scale, dtype=np.float32))
    elif w.format == "nvfp4":
        parts.append(w.scale.block)
    return parts


REFRESH = 16  # decode steps between two looks at the routing counts
DECAY = 0.5  # an expert's score: DECAY x its previous score + its uses since the last look
MAX_SWAPS = 32  # experts brought into the cache per look, at most
HYSTERESIS = 1.5  # a newcomer's score must exceed HYSTERESIS x the victim's + 1
COUNT_THREADS = 256


def _fn(name: str):
    return kernels.function("stream", name)


# -- one layer's experts ------------------------------------------------------------------------------------------
def _expert_mats(gate_up, down, packed: bool, e: int) -> list[tuple[str, tuple, list[np.ndarray], float | None]]:
    """Expert e's (gate, up, down) matrices: (format, logical shape, host pieces (data, then fp8 scale or NVFP4
    block scales), NVFP4 global scale or None)."""
    if packed:
        g, d = gate_up.data[e], down.data[e]
        I = g.shape[0] // 2
        return [(gate_up.format, (I, g.shape[1]), [g[:I]], None), (gate_up.format, (I, g.shape[1]), [g[I:]], None),
                (down.format, tuple(d.shape), [d], None)]
    gw, uw = gate_up[e]
    return [(w.format, tuple(w.shape), _weight_pieces(w),
             float(np.asarray(w.scale.global_scale, np.float32).reshape(())) if w.format == "nvfp4" else None)
            for w in (gw, uw, down[e])]


def _f32_bits(v: float) -> int:
    return int(np.asarray(v, dtype=np.float32).reshape(()).view(np.uint32))


def _rows(mats: list, ptrs: list[list[int]]) -> list[int]:
    """Table entries of some matrices (moe._Table layout): data pointers, then scale pointers (fp8 / nvfp4), then
    global scales' bits (nvfp4); ``ptrs`` per matrix, per piece."""
    fmt = mats[0][0]
    out = [p[0] for p in ptrs]
    if fmt in ("fp8", "nvfp4"):
        out += [p[1] for p in ptrs]
    if fmt == "nvfp4":
        out += [_f32_bits(m[3]) for m in mats]
    return out


class HostExperts:
    """One layer's routed experts in pinned host memory, as the device MoE kernels see them (module docstring)."""

    def __init__(self, gate_up, down, packed: bool):
        self.E = gate_up.data.shape[0] if packed else len(gate_up)
        self.mats = [_expert_mats(gate_up, down, packed, e) for e in range(self.E)]
        (fmt, (I, H), gparts, _), _, (dfmt, dshape, dparts, _) = self.mats[0]
        ok = (fmt in moe.ALIGN and dfmt == fmt and dshape == (H, I) and I > 0 and H > 0
              and H % moe.ALIGN[fmt] == 0 and I % moe.ALIGN[fmt] == 0
              and all(tuple(m[1]) == tuple(r[1]) and m[0] == fmt for mats in self.mats
                      for m, r in zip(mats, self.mats[0], strict=True)))
        blocks = [(1, 1, 1)] * 2
        if ok and fmt == "fp8":
            src = [gate_up[0][0], down[0]] if not packed else []
            blocks = [gemv.fp8_block(w.shape, w.scale, w.block) for w in src]
            ok = all(b[1] % 16 == 0 for b in blocks)
        elif ok and fmt == "nvfp4":
            blocks = [(1, moe.NVFP4_GROUP, H // moe.NVFP4_GROUP), (1, moe.NVFP4_GROUP, I // moe.NVFP4_GROUP)]
        if not ok:
            raise ValueError("streamed experts need a format and shape the device MoE kernels take (bf16, f16, "
                             "f32, fp8 or nvfp4; every expert alike; K a multiple of the format's 16-byte load)")
        self.fmt, self.H, self.I, self.blocks = fmt, H, I, blocks
        self.pieces = [[p for m in mats for p in m[2]] for mats in self.mats]
        if not all(p.flags.c_contiguous and _page_locked(p) for pieces in self.pieces for p in pieces):
            raise ValueError("streamed experts must be in the pinned arena (CUDABackend.weight with store 'ram')")
        self.nbytes = sum(p.nbytes for p in self.pieces[0])
        self.slot_bytes = sum(_round(p.nbytes) for p in self.pieces[0])
        self.host_g = np.array([self._entries(e, None)[0] for e in range(self.E)], dtype=np.uint64).T.copy()
        self.host_d = np.array([self._entries(e, None)[1] for e in range(self.E)], dtype=np.uint64).T.copy()
        self.mirror_g, self.mirror_d = self.host_g.copy(), self.host_d.copy()
        self.tg = moe._Table(fmt, (I, H), blocks[0], cp.asarray(self.host_g), [])
        self.td = moe._Table(fmt, (H, I), blocks[1], cp.asarray(self.host_d), [])
        self.counts = cp.zeros(self.E, dtype=cp.int32)
        self.counts_host = np.frombuffer(cp.cuda.alloc_pinned_memory(4 * self.E), np.int32, self.E)
        self.score = np.zeros(self.E)
        self.slot: dict[int, int] = {}  # resident expert -> slot
        self.dirty = False

    def _entries(self, e: int, base: int | None) -> tuple[list[int], list[int]]:
        """(gate/up table column, down table column) of expert e: pointing into its pinned host pieces (base None)
        or into a cache slot at device address ``base``."""
        ptrs, off = [], 0
        for m in self.mats[e]:
            row = []
            for piece in m[2]:
                row.append(piece.ctypes.data if base is None else base + off)
                off += _round(piece.nbytes)
            ptrs.append(row)
        mats = self.mats[e]
        return _rows(mats[:2], ptrs[:2]), _rows(mats[2:], ptrs[2:])

    def map(self, e: int, slot: int, base: int) -> None:
        g, d = self._entries(e, base)
        self.mirror_g[:, e], self.mirror_d[:, e] = g, d
        self.slot[e] = slot
        self.dirty = True

    def unmap(self, e: int) -> None:
        self.mirror_g[:, e], self.mirror_d[:, e] = self.host_g[:, e], self.host_d[:, e]
        self.slot.pop(e, None)
        self.dirty = True

    def flush(self, stream) -> None:
        """Copy the table mirrors to the device, ordered on ``stream``."""
        if self.dirty:
            for dev, host in ((self.tg.ptrs, self.mirror_g), (self.td.ptrs, self.mirror_d)):
                cp.cuda.runtime.memcpyAsync(dev.data.ptr, host.ctypes.data, host.nbytes,
                                            cp.cuda.runtime.memcpyHostToDevice, stream.ptr)
            self.dirty = False

    def count(self, ids, ids64: int) -> None:
        n = ids.size
        _fn("moe_count")(((n + COUNT_THREADS - 1) // COUNT_THREADS,), (COUNT_THREADS,),
                         (ids, np.int32(ids64), np.int32(n), np.int32(self.E), self.counts))


def _layer(gate_up, down, packed: bool) -> HostExperts:
    """The HostExperts of an expert list, made on first use and kept on its first Weight (lumen_cuda.state), so it
    is dropped with the model (it holds their arrays, not the Weight objects: no cycle)."""
    key = gate_up if packed else gate_up[0][0]
    state = derived(key)
    hx = state.get("host_experts")
    if hx is None:
        hx = state["host_experts"] = HostExperts(gate_up, down, packed)
    return hx


# -- the cache --------------------------------------------------------------------------------------------------
class ExpertCache:
    """``slots`` expert-sized areas of VRAM on one device, shared by its streamed layers (module docstring)."""

    def __init__(self, slots: int, slot_bytes: int):
        self.slots, self.slot_bytes = slots, slot_bytes
        self.buf = cp.empty(slots * slot_bytes, dtype=cp.uint8)
        self.owner: list[tuple | None] = [None] * slots  # slot -> (weakref to HostExperts, expert)
        self.members: list = []  # weakrefs to the HostExperts using this cache
        self.copy_stream = cp.cuda.Stream(non_blocking=True)
        self.pending: list[tuple] = []  # (slot, weakref to HostExperts, expert, event): copies not yet mapped
        self.counting = None  # the event after which the counts in pinned memory are complete
        self.steps = 0.0
        self.copied = 0  # bytes copied host -> device (staging and swaps)
        self.host_read = 0  # bytes the decode kernels read from host memory (from the routing counts)
        self.hits = self.misses = self.swaps = 0

    def attach(self, hx: HostExperts) -> None:
        """Start serving a layer (its tables pointing at host memory, whatever cache they used before)."""
        for e in list(hx.slot):
            hx.unmap(e)
        hx.flush(cp.cuda.get_current_stream())
        self.members.append(weakref.ref(hx))

    def base(self, slot: int) -> int:
        return self.buf.data.ptr + slot * self.slot_bytes

    def _live(self) -> list[HostExperts]:
        self.members = [r for r in self.members if r() is not None]
        return [r() for r in self.members]

    def _free_dead(self) -> None:
        for s, o in enumerate(self.owner):
            if o is not None and o[0]() is None:
                self.owner[s] = None

    def _copy(self, slot: int, hx: HostExperts, e: int, stream) -> None:
        base, off = self.base(slot), 0
        for h in hx.pieces[e]:
            cp.cuda.runtime.memcpyAsync(base + off, h.ctypes.data, h.nbytes, cp.cuda.runtime.memcpyHostToDevice,
                                        stream.ptr)
            off += _round(h.nbytes)
        self.copied += hx.nbytes

    def _evict(self, slot: int) -> None:
        o = self.owner[slot]
        if o is not None and (hx := o[0]()) is not None:
            hx.unmap(o[1])
        self.owner[slot] = None

    def _flush(self, stream) -> None:
        for hx in self._live():
            hx.flush(stream)

    def _land(self, block: bool) -> None:
        """Point the tables at the swapped-in experts whose copies have finished (all of them with ``block``)."""
        stream = cp.cuda.get_current_stream()
        keep = []
        for slot, ref, e, ev in self.pending:
            if not block and not ev.done:
                keep.append((slot, ref, e, ev))
                continue
            ev.synchronize()
            hx = ref()
            if hx is not None and e not in hx.slot:
                hx.map(e, slot, self.base(slot))
                self.owner[slot] = (ref, e)
        self.pending = keep
        self._flush(stream)

    # -- prefill ---------------------------------------------------------------------------------------------
    def stage(self, hx: HostExperts, needed: list[int], uses: np.ndarray) -> None:
        """Make the experts ``needed`` (at most ``slots``) resident, copying the missing ones on the current
        stream; victims are the resident experts of lowest score outside ``needed``."""
        stream = cp.cuda.get_current_stream()
        self._land(block=True)
        self._free_dead()
        hx.score += uses
        missing = [e for e in needed if e not in hx.slot]
        self.hits += len(needed) - len(missing)
        self.misses += len(missing)
        if not missing:
            return
        busy = {hx.slot[e] for e in needed if e in hx.slot}
        free = [s for s in range(self.slots) if self.owner[s] is None and s not in busy]
        taken = [(self.owner[s][0]().score[self.owner[s][1]], s) for s in range(self.slots)
                 if self.owner[s] is not None and s not in busy]
        victims = [s for _, s in sorted(taken)]
        slots = (free + victims)[:len(missing)]
        for s in slots:
            self._evict(s)
        self._flush(stream)  # no kernel enqueued from here on reads a victim slot
        for s, e in zip(slots, missing, strict=True):
            self._copy(s, hx, e, stream)
            hx.map(e, s, self.base(s))
            self.owner[s] = (weakref.ref(hx), e)
        hx.flush(stream)

    # -- decode ----------------------------------------------------------------------------------------------
    def maintain(self, steps: float = 1.0) -> None:
        """Called once per decode step (or a fraction per layer call): every REFRESH steps, fold in the counts
        read last time, start swaps, and start reading the counts again; land finished swaps on every call."""
        if self.pending:
            self._land(block=False)
        self.steps += steps
        if self.steps < REFRESH:
            return
        self.steps = 0.0
        stream = cp.cuda.get_current_stream()
        members = self._live()
        if self.counting is not None and self.counting.done:
            self._fold(members)
            self._swap(members, stream)
            self.counting = None
        if self.counting is None:
            for hx in members:
                cp.cuda.runtime.memcpyAsync(hx.counts_host.ctypes.data, hx.counts.data.ptr, hx.counts.nbytes,
                                            cp.cuda.runtime.memcpyDeviceToHost, stream.ptr)
                hx.counts.fill(0)
            self.counting = cp.cuda.Event(block=False, disable_timing=True)
            self.counting.record(stream)

    def _fold(self, members: list[HostExperts]) -> None:
        for hx in members:
            c = hx.counts_host.astype(np.float64)
            host = np.ones(hx.E, dtype=bool)
            host[list(hx.slot)] = False
            self.host_read += int(c[host].sum()) * hx.nbytes
            hx.score = DECAY * hx.score + c

    def _swap(self, members: list[HostExperts], stream) -> None:
        self._free_dead()
        reserved = {p[0] for p in self.pending}
        pending_keys = {(p[1](), p[2]) for p in self.pending}  # (layer, expert): held while swapping
        free = [s for s in range(self.slots) if self.owner[s] is None and s not in reserved]
        resident = sorted((o[0]().score[o[1]], s) for s, o in enumerate(self.owner) if o is not None)
        cands = sorted(((hx.score[e], i, e) for i, hx in enumerate(members) for e in np.flatnonzero(hx.score > 0)
                        if e not in hx.slot and (hx, e) not in pending_keys), reverse=True)
        plan = []
        for sc, i, e in cands[:MAX_SWAPS]:
            if free:
                plan.append((free.pop(0), members[i], int(e)))
            elif resident and sc > HYSTERESIS * resident[0][0] + 1:
                s = resident.pop(0)[1]
                self._evict(s)
                plan.append((s, members[i], int(e)))
            else:
                break
        if not plan:
            return
        self._flush(stream)  # victims' entries point at host memory before their slots are overwritten
        ready = cp.cuda.Event(block=False, disable_timing=True)
        ready.record(stream)
        self.copy_stream.wait_event(ready)
        for s, hx, e in plan:
            self._copy(s, hx, e, self.copy_stream)
            ev = cp.cuda.Event(block=False, disable_timing=True)
            ev.record(self.copy_stream)
            self.pending.append((s, weakref.ref(hx), e, ev))
        self.swaps += len(plan)

    def drain(self) -> None:
        """Wait for outstanding swaps and counts and fold in every count so far (statistics are then complete)."""
        self._land(block=True)
        members = self._live()
        if self.counting is not None:
            self.counting.synchronize()
            self._fold(members)
            self.counting = None
        for hx in members:
            hx.counts_host[...] = cp.asnumpy(hx.counts)
            hx.counts.fill(0)
        self._fold(members)

    def close(self) -> None:
        """Wait for the copy stream (a copy into a slot must not outlive the slots' VRAM), then let the VRAM go.
        The layers' tables must point at host memory first (``ExpertStreams.close`` / ``cache_for`` see to it)."""
        self.copy_stream.synchronize()
        self.pending, self.owner, self.members = [], [None] * self.slots, []
        self.buf = None


class ExpertStreams:
    """One backend instance's expert cache (``CUDABackend.expert_streams``): the slots configured for it, the
    ``ExpertCache`` made on the first streamed call (sized for the largest expert seen), and its statistics."""

    def __init__(self, device: int, slots: int | None = None):
        self.device = device
        self.slots = slots or DEFAULT_SLOTS
        self.cache: ExpertCache | None = None

    def cache_for(self, slot_bytes: int) -> ExpertCache:
        """The cache, made (or remade larger, its layers moved over) so that a slot holds ``slot_bytes``."""
        c = self.cache
        if c is None or c.slot_bytes < slot_bytes or c.slots != self.slots:
            old = c
            c = self.cache = ExpertCache(self.slots, max(slot_bytes, old.slot_bytes if old else 0))
            if old is not None:  # a new cache: the old one's layers move to it
                old._land(block=True)
                for hx in old._live():
                    c.attach(hx)
                old.close()
        return c

    def maintain(self) -> None:
        """Once per decode step, on the step's stream (the graph runner calls it before each replay)."""
        if self.cache is not None:
            with cp.cuda.Device(self.device):
                self.cache.maintain()

    def stats(self) -> dict | None:
        """Slots, bytes copied host -> device, bytes the kernels read from host memory, prefill hits and misses,
        decode swaps (outstanding work is waited for first); None before the first streamed call."""
        c = self.cache
        if c is None:
            return None
        with cp.cuda.Device(self.device):
            c.drain()
        return {"slots": c.slots, "copied_bytes": c.copied, "host_read_bytes": c.host_read, "hits": c.hits,
                "misses": c.misses, "swaps": c.swaps}

    def close(self) -> None:
        """Free the cache's VRAM: outstanding copies finish, every layer's table points back at host memory (a
        later call, if any, makes a new cache)."""
        c, self.cache = self.cache, None
        if c is not None:
            with cp.cuda.Device(self.device):
                c._land(block=True)
                for hx in c._live():
                    for e in list(hx.slot):
                        hx.unmap(e)
                    hx.flush(cp.cuda.get_current_stream())
                c.close()


# -- the op -------------------------------------------------------------------------------------------------------
def experts(streams: ExpertStreams, x, ids, weights, gate_up, down, act: str = "silu", out=None,
            packed: bool = False):
    """``moe.experts`` (or ``moe.experts_packed`` with ``packed``) for expert weights in host RAM, through the
    backend's ``streams``; see the module docstring."""
    hx = _layer(gate_up, down, packed)
    cache = streams.cache_for(hx.slot_bytes)
    if not any(r() is hx for r in cache.members):
        cache.attach(hx)
    inputs = moe._inputs(x, ids, weights, hx.H)
    if inputs is None or act not in moe.ACTS:
        raise ValueError(f"streamed experts: x {getattr(x, 'shape', None)} / ids {getattr(ids, 'shape', None)} / "
                         f"act {act!r} do not fit the expert kernels")
    x, ids, ids64, w = inputs
    T = ids.shape[0]
    current = step.current()
    if current is not None:
        current.streams = streams  # the runner calls streams.maintain() before each replay
    y = moe._out(out, T, hx.H)
    args = ((hx.tg.ptrs, hx.fmt), (hx.td.ptrs, hx.fmt), hx.fmt, hx.fmt, hx.tg.block, hx.td.block)
    if T < moe.GROUPED_MIN_T:  # decode: straight from the tables (resident slots or host memory)
        if current is None:
            cache.maintain(1.0 / max(1, len(cache.members)))
        hx.count(ids, ids64)
        return moe._launch(*args, (x, ids, ids64, w), hx.E, hx.H, hx.I, act, y, hx.tg.scratch)
    step.require_host("a streamed-expert prefill")
    ids_host = cp.asnumpy(ids).astype(np.int64)
    valid = (ids_host >= 0) & (ids_host < hx.E)
    uses = np.bincount(ids_host[valid], minlength=hx.E).astype(np.float64)
    needed = np.flatnonzero(uses).tolist()
    per_pass = max(1, cache.slots)
    if len(needed) <= per_pass:
        cache.stage(hx, needed, uses)
        return moe._launch(*args, (x, ids, ids64, w), hx.E, hx.H, hx.I, act, y)
    acc = None
    for p0 in range(0, len(needed), per_pass):
        chunk = needed[p0:p0 + per_pass]
        cache.stage(hx, chunk, np.where(np.isin(np.arange(hx.E), chunk), uses, 0.0))
        masked = cp.asarray(np.where(np.isin(ids_host, chunk), ids_host, -1))
        part = moe._launch(*args, (x, masked, 1, w), hx.E, hx.H, hx.I, act, None)
        if acc is None:
            acc = part
        else:
            acc += part
    y[...] = acc
    return y
