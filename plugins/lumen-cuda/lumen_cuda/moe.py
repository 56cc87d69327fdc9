"""Mixture-of-experts on the device (``kernels/moe.cu``): routing and the routed experts for T tokens
with no host synchronisation, no host->device copy per call, and launch configurations that depend only on
the shapes (E, k, H, I), never on which experts were picked. A decode step built from these can be captured
as a CUDA graph and replayed with new ids (the kernels read ``ids[j]`` from device memory).

- ``route(logits, k, normalize)``: softmax + top-k in one kernel (one block per token row); the same ids as
  ``ops.moe_route`` (ties -> the lower expert index) and weights to f32 rounding. E <= 1024, k <= 32, f32
  logits; otherwise ``ops.moe_route`` (which does not sync either).
- ``experts(x, ids, weights, gate_up, down, act)``: ``ops.moe_experts`` for any T (``experts_decode`` is the
  same function). Slot s = t * k + j reads token t's row of x.
  T < GROUPED_MIN_T: kernel A (grid (ceil(I / rows per block), min(T k, 65535)), looping over slots) writes
  act(gate . x_t) * (up . x_t) per slot into a (T k, I) f32 scratch; kernel B (grid (row blocks, min(T, 65535)),
  one warp per ROWS output rows of one token; ROWS = 1 at T = 1, so that the grid has H / 4 blocks) sums
  weights[t, j] * down_{ids[t, j]} . h[t k + j] over j in order, taking the slots in chunks (up to 8): the
  chunk's ids, then its table entries, then every weight load of the chunk before any FMA (a few dependent
  memory latencies per warp instead of ~3 per slot), the sum still j by j.
  T >= GROUPED_MIN_T: moe_bucket (one block) sorts the slots into per-expert buckets on the device; then the
  gate/up and down GEMVs run per (row block, expert), each 16-byte weight load shared by MOE_NT = 4 slots of
  that expert (h (T k, I), ys (T k, H) f32 scratch, allocated per call; T is cut into chunks that keep the
  scratch under 256 MiB), and moe_combine sums weights[t, j] * ys[t k + j] over j in order. Both paths are
  deterministic (no atomics in any sum). Expert matrices are found through a pointer table (uint64 (rows, E):
  data pointers; fp8: then the f32 scale pointers; nvfp4: then the e4m3 block-scale pointers, then the f32
  global scales, each stored as its float bits in the low 32 bits of a uint64 entry) built once per weight list
  and cached (the only host->device copy, on first use: make one eager call before capturing a graph).
- ``experts_packed`` (= ``experts_packed_decode``): ``ops.moe_experts_packed`` for any T; the expert's
  matrices are at base + e * stride, computed in the kernel (no table).

Fast-path requirements (checked; otherwise the CuPy references ``experts_grouped`` / ``experts_packed_grouped``
(``ops.moe_experts_grouped`` / ``ops.moe_experts_packed_grouped``), whose ``_groups`` brings the ids to the host —
a sync, and not capturable): formats bf16 / f16 / f32 / fp8 / nvfp4 (per list: one format, one shape and, for fp8,
one scale block shape; packed: bf16 / f16 / f32); K % 8 for bf16/f16, % 4 for f32, % 16 for fp8 (and an fp8 column block
a multiple of 16), % 32 for nvfp4 (one 16-byte load = 32 values), for K = H (gate/up) and K = I (down);
C-contiguous 16-byte aligned data (nvfp4: packed codes (N, K/2) uint8, its block scales (N, K/16) uint8
C-contiguous and 2-byte aligned, the global scale a host scalar). An nvfp4 value is (e2m1 x block scale) x global
scale as in ``gemv.gemv_nvfp4``: per 16-value block p = sum w x, lane sum = fmaf(p, block scale, sum), the
global scale multiplies the gate / up row sum (down: each slot's partial sum) afterwards.

Graph capture notes: for T = 1 the (k, I) scratch is kept with the layer's pointer table (packed experts: on the
gate_up Weight) and reused by every call of that layer, so its calls must be ordered on one stream (as a decode
step is); pass ``out`` (1, H) f32 to keep the output buffer fixed too. For T > 1 the scratch comes from the current
CuPy allocator per call: capture under a private pool (as lumen_cuda.graph does) so the graph keeps its addresses.

State: a list's pointer table (and that scratch) is built on its first call and kept on the list's first Weight
(lumen_cuda.state): it is freed with the model, and another engine's layers (another model, a draft) have their
own, so two engines' graphs never share a buffer. A table is rebuilt when the list's first or last Weight or its
length changes; replacing a middle item in place is not noticed.

Streamed experts (store 'ram') are not handled here: ops.moe_experts sends them to lumen_cuda.stream, which uses
this module's kernels over its own tables.
"""

from __future__ import annotations

import dataclasses
import os
import weakref
from dataclasses import dataclass
from typing import Any

import cupy as cp
import numpy as np

from . import cupy_ops, fp8_mma, gemv, kernels
from .state import derived
from .step import require_host

WARPS = 4  # MOE_WARPS in moe.cu
MAX_E, MAX_K = 1024, 32  # ROUTE_MAX_E / ROUTE_MAX_K
ROUTE_THREADS = 256
ALIGN = {"bf16": 8, "f16": 8, "f32": 4, "fp8": 16, "nvfp4": 32}  # values per 16-byte load (K % ALIGN == 0)
DTYPE = {"bf16": np.uint16, "f16": np.float16, "f32": np.float32, "fp8": np.uint8, "nvfp4": np.uint8}
NVFP4_GROUP = 16  # values per e4m3 block scale
# Rows per warp (1, 2 and 4 are compiled): gate/up reads 2 x ROWS row streams per warp; down ROWS (T > 1; at
# T = 1 the down kernel runs ROWS_DOWN_T1 rows per warp: H / 4 blocks, enough warps to fill the GPU).
ROWS_GATE_UP = {"bf16": 2, "f16": 2, "f32": 2, "fp8": 2, "nvfp4": 2}
ROWS_DOWN = {"bf16": 2, "f16": 2, "f32": 2, "fp8": 4, "nvfp4": 2}
ROWS_DOWN_T1 = 1
SPLIT_ROWS, SPLIT_WARPS, SPLIT_MAX_S = 2, 2, 40  # moe.cu's DS_ROWS, DS_WARPS, DS_MAX_S (down_split)
ACTS = {"silu": 0, "gelu_tanh": 1}

def _fn(name: str) -> cp.RawKernel:
    blocks = gate_up_blocks()
    return kernels.function("moe", name, (f"-DMOE_GATE_UP_MIN_BLOCKS={blocks}",) if blocks else ())


def gate_up_blocks(env=None) -> int:
    """``LUMEN_CUDA_MOE_GATE_UP_BLOCKS``: unset (0), the per-slot gate/up kernels' registers are the compiler's
    choice; n (1..16), they are compiled to fit n blocks of 128 threads an SM (moe.cu's MOE_GATE_UP_MIN_BLOCKS; not
    for NVFP4 or 4 rows a warp, which would spill). At the 35B-A3B's decode shape (8 routed + 1 shared expert, I =
    512: 576 blocks) the fp8 kernel's 123 registers fit 4 blocks an SM, 528 on 132 SMs: a second wave; 5 fits them
    in one. Read at each call; anything else is an error naming it."""
    v = (os.environ if env is None else env).get("LUMEN_CUDA_MOE_GATE_UP_BLOCKS", "")
    if v in ("", "0"):
        return 0
    if not (v.isdigit() and 1 <= int(v) <= 16):
        raise ValueError(f"LUMEN_CUDA_MOE_GATE_UP_BLOCKS={v!r}: use a number of blocks an SM from 1 to 16, or 0 "
                         "(the compiler's register choice, the default)")
    return int(v)


# -- routing ------------------------------------------------------------------------------------------------------
def route(logits, k: int, normalize: bool = True, out=None, shared=None):
    """logits (T, E) -> weights (T, k) f32, ids (T, k) int64, as ``ops.moe_route``; ``out`` = (weights, ids)
    preallocated (C-contiguous) to write into. ``shared`` (T, 1) f32, the shared expert's gate logits: one more
    column, id E and weight sigmoid(shared) (``ops.moe_shared``'s slot for the shared expert run as expert E)."""
    ok = (isinstance(logits, cp.ndarray) and logits.ndim == 2 and logits.dtype == cp.float32
          and 1 <= k <= min(MAX_K, logits.shape[1]) and logits.shape[1] <= MAX_E)
    if shared is not None:
        ok = (ok and isinstance(shared, cp.ndarray) and shared.dtype == cp.float32 and shared.size == logits.shape[0])
    if not ok:
        w, ids = route_cupy(logits, k, normalize)
        if shared is not None:
            T = logits.shape[0]
            w = cp.concatenate([w, cupy_ops.sigmoid(shared.reshape(T, 1))], axis=1)
            ids = cp.concatenate([ids, cp.full((T, 1), logits.shape[1], dtype=ids.dtype)], axis=1)
        if out is not None:
            out[0][...], out[1][...] = w, ids
            return out
        return w, ids
    T, E = logits.shape
    n = k + (shared is not None)
    lg = cp.ascontiguousarray(logits)
    if out is None:
        w, ids = cp.empty((T, n), dtype=cp.float32), cp.empty((T, n), dtype=cp.int64)
    else:
        w, ids = out
        assert w.shape == ids.shape == (T, n) and w.dtype == cp.float32 and ids.dtype == cp.int64
        assert w.flags.c_contiguous and ids.flags.c_contiguous
    if not T:
        return w, ids
    if shared is not None:
        _fn("moe_route_shared_f32")((T,), (ROUTE_THREADS,), (lg, cp.ascontiguousarray(shared), w, ids, np.int32(E),
                                                            np.int32(k), np.int32(bool(normalize))))
    else:  # one block per row (moe.cu)
        _fn("moe_route_f32")((T,), (ROUTE_THREADS,), (lg, w, ids, np.int32(E), np.int32(k), np.int32(bool(normalize))))
    return w, ids


# -- pointer tables -----------------------------------------------------------------------------------------------
@dataclass
class _Table:
    fmt: str
    shape: tuple[int, int]  # each expert's (N, K)
    block: tuple[int, int, int]  # fp8 (BR, BC, SK); nvfp4 (1, 16, K / 16); (1, 1, 1) otherwise
    # cupy uint64 (rows, E): data pointers per matrix; fp8: then scale pointers per matrix; nvfp4: then block-scale
    # pointers per matrix, then the global scales per matrix (f32 bits in the low 32 bits)
    ptrs: Any
    keep: list  # arrays the table points into that the Weights do not hold (contiguous f32 copies of scales)
    scratch: dict = dataclasses.field(default_factory=dict)  # (k, I) -> the T = 1 scratch of this layer (_scratch)


def _data_shape(fmt: str, shape) -> tuple[int, int]:
    return (shape[0], shape[1] // 2) if fmt == "nvfp4" else tuple(shape)  # nvfp4: two codes a byte


def _matrix_ok(w, fmt: str, shape, block) -> bool:
    d = w.data
    ok = (w.format == fmt and tuple(w.shape) == shape and isinstance(d, cp.ndarray) and d.dtype == DTYPE[fmt]
          and d.shape == _data_shape(fmt, shape) and d.flags.c_contiguous and d.data.ptr % 16 == 0)
    if not ok:
        return False
    if fmt == "fp8":
        return gemv.fp8_block(shape, w.scale, w.block) == block
    if fmt == "nvfp4":  # e4m3 block scales (N, K/16); the kernels read a load's two scales as one aligned u16
        b = getattr(w.scale, "block", None)
        return (isinstance(b, cp.ndarray) and b.dtype == cp.uint8 and b.shape == (shape[0], shape[1] // NVFP4_GROUP)
                and b.flags.c_contiguous and b.data.ptr % 2 == 0
                and np.isfinite(np.asarray(w.scale.global_scale, dtype=np.float32)).all())
    return True


def _f32_bits(v) -> int:
    """A host f32 scalar's bits as an int (the table stores nvfp4 global scales so)."""
    return int(np.asarray(v, dtype=np.float32).reshape(()).view(np.uint32))


def _build(mats: list[list]) -> _Table | None:
    """mats: per matrix role (gate, up / down), the E Weights. None where the kernels do not apply."""
    first = mats[0][0]
    fmt, shape = first.format, tuple(first.shape)
    if fmt not in ALIGN or len(shape) != 2 or shape[1] % ALIGN[fmt] or 0 in shape:
        return None
    if fmt == "fp8":
        block = gemv.fp8_block(shape, first.scale, first.block)
    elif fmt == "nvfp4":
        block = (1, NVFP4_GROUP, shape[1] // NVFP4_GROUP)
    else:
        block = (1, 1, 1)
    if fmt == "fp8" and block[1] % 16:
        return None
    if not all(_matrix_ok(w, fmt, shape, block) for role in mats for w in role):
        return None
    rows, keep = [[w.data.data.ptr for w in role] for role in mats], []
    if fmt == "fp8":
        for role in mats:
            row = []
            for w in role:
                s = cp.ascontiguousarray(w.scale, dtype=cp.float32)
                if s is not w.scale:
                    keep.append(s)
                row.append(s.data.ptr)
            rows.append(row)
    if fmt == "nvfp4":
        rows += [[w.scale.block.data.ptr for w in role] for role in mats]
        rows += [[_f32_bits(w.scale.global_scale) for w in role] for role in mats]
    return _Table(fmt, shape, block, cp.asarray(np.array(rows, dtype=np.uint64)), keep)


def _data_ptrs(ws) -> tuple:
    """Where each Weight's data (and fp8 scale) are now: device pointers, None for anything else."""
    def ptr(a):
        return a.data.ptr if isinstance(a, cp.ndarray) else None

    return tuple((ptr(getattr(w, "data", None)), ptr(getattr(w, "scale", None))) for w in ws)


def _table(lst, pairs: bool) -> _Table | None:
    """The table of a weight list (gate_up: pairs of (gate, up); down: Weights), built on first use and kept on the
    list's first Weight (module docstring), beside a weak reference to its last and its length."""
    if not len(lst):
        return None
    first, last = (lst[0][0], lst[-1][0]) if pairs else (lst[0], lst[-1])
    try:
        state = derived(first)
    except AttributeError:  # not a Weight: nothing to keep the table on
        state = {}
    # by length too: a layer's routed list and the same list with its shared expert appended (ops.moe_shared) start
    # with the same Weight and keep their own tables
    key = ("moe_table_pairs" if pairs else "moe_table", len(lst))
    # gemv.linear_group fuses a projection group into one buffer and re-points each member's data into it, freeing
    # the old buffers: the composite of ops.moe_shared does that to the shared expert's gate and up (the list's
    # last item), so a table is kept only while the last item's data are where they were when it was built
    where = _data_ptrs(lst[-1] if pairs else (lst[-1],))
    hit = state.get(key)
    if hit is not None and hit[0]() is last and hit[1] == len(lst) and hit[3] == where:
        return hit[2]
    try:
        mats = [[g for g, _ in lst], [u for _, u in lst]] if pairs else [list(lst)]
        tab = _build(mats)
    except (TypeError, ValueError, AttributeError, AssertionError):
        tab = None
    try:
        state[key] = (weakref.ref(last), len(lst), tab, where)
    except TypeError:  # a last item without weak references: not kept
        pass
    return tab


# -- experts ------------------------------------------------------------------------------------------------------
GROUPED_MIN_T = 8  # from this many tokens on, the grouped kernels (slots bucketed by expert on the device)
BUCKET_THREADS, BUCKET_MAX_E, COMBINE_THREADS = 1024, 4096, 256  # moe.cu
ROWS_GROUPED = 2  # rows per warp of the grouped kernels (2 and 4 are compiled)
MAX_GRID_Y = 65535
CHUNK_FLOATS = 1 << 26  # the grouped path's (T k, max(H, I)) f32 scratch per launch is kept under 256 MiB


def _scratch(owner: dict | None, k: int, I: int):
    """The (k, I) f32 buffer between the two kernels for T = 1, kept in the layer's ``owner`` dict (its table's, or
    its packed Weight's): fixed across that layer's calls (graphs), never shared with another layer or engine. No
    owner: a fresh buffer."""
    if owner is None:
        return cp.empty((k, I), dtype=cp.float32)
    h = owner.get((k, I))
    if h is None:
        h = owner[(k, I)] = cp.empty((k, I), dtype=cp.float32)
    return h


def _inputs(x, ids, weights, H: int):
    """(x (T, H) f32, ids (T, k) int32/int64, ids64, weights (T, k) f32), contiguous and 16-byte aligned, or
    None."""
    if not (isinstance(x, cp.ndarray) and isinstance(ids, cp.ndarray) and isinstance(weights, cp.ndarray)):
        return None
    if x.ndim != 2 or x.shape[1] != H or ids.ndim != 2 or ids.shape[0] != x.shape[0] or weights.shape != ids.shape:
        return None
    if ids.dtype not in (cp.int64, cp.int32) or not 1 <= ids.shape[1] <= 65535:
        return None
    if x.dtype != cp.float32 or not x.flags.c_contiguous or x.data.ptr % 16:
        x = cp.array(x, dtype=cp.float32, order="C", copy=True)
    ids = cp.ascontiguousarray(ids)
    weights = cp.ascontiguousarray(weights, dtype=cp.float32)
    return x, ids, int(ids.dtype == cp.int64), weights


def _out(out, T: int, H: int):
    if out is None:
        return cp.empty((T, H), dtype=cp.float32)
    assert out.shape == (T, H) and out.dtype == cp.float32 and out.flags.c_contiguous, (out.shape, out.dtype)
    return out


def _per_slot(gsrc, dsrc, gfmt, dfmt, gblock, dblock, x, ids, ids64, w, y, E, H, I, a, scratch):
    """Kernel A over (rows, slots), kernel B over (rows, tokens)."""
    T, k = ids.shape
    S = T * k
    h = _scratch(scratch, k, I) if T == 1 else cp.empty((S, I), dtype=cp.float32)
    rg, rd = ROWS_GATE_UP[gfmt], (ROWS_DOWN_T1 if T == 1 else ROWS_DOWN[dfmt])
    _fn(f"moe_gate_up_{gsrc[1]}_r{rg}")(
        ((I + rg * WARPS - 1) // (rg * WARPS), min(S, MAX_GRID_Y)), (WARPS * 32,),
        (gsrc[0], ids, np.int32(ids64), x, h, np.int32(S), np.int32(k), np.int32(E), np.int32(I), np.int32(H),
         *(np.int32(v) for v in gblock), a))
    _down(dsrc, dblock, rd, ids, ids64, w, h, y, T, k, E, H, I)


def down_split(env=None) -> bool:
    """``LUMEN_CUDA_MOE_DOWN_SPLIT``: 1 runs a one-token down GEMV as ``moe_down_split_*`` (a token's slots over the
    block's warps, one round of dependent loads: moe.cu's down_split; the same bits) where it is built (not NVFP4)
    and the token has at most ``SPLIT_MAX_S`` slots; unset or 0 (the default until a GPU has measured it), the
    chunked kernel. Read at each call; anything else is an error naming it."""
    v = (os.environ if env is None else env).get("LUMEN_CUDA_MOE_DOWN_SPLIT", "")
    if v not in ("", "0", "1"):
        raise ValueError(f"LUMEN_CUDA_MOE_DOWN_SPLIT={v!r}: use 1 (the one-token down GEMV with the slots split over "
                         "warps) or 0 (the chunked kernel, the default)")
    return v == "1"


def _down(dsrc, dblock, rd, ids, ids64, w, h, y, T, k, E, H, I):
    """Kernel B of the per-slot path: y[t] = sum over j of w[t, j] * down_{ids[t, j]} . h[t k + j], rd rows a warp
    (one token with ``down_split``: ``moe_down_split_*``, SPLIT_ROWS rows a block)."""
    if T == 1 and k <= SPLIT_MAX_S and not dsrc[1].endswith("nvfp4") and down_split():
        _fn(f"moe_down_split_{dsrc[1]}")(
            ((H + SPLIT_ROWS - 1) // SPLIT_ROWS,), (SPLIT_WARPS * 32,),
            (dsrc[0], ids, np.int32(ids64), w, h, y, np.int32(k), np.int32(E), np.int32(H), np.int32(I),
             *(np.int32(v) for v in dblock)))
        return
    _fn(f"moe_down_{dsrc[1]}_r{rd}")(
        ((H + rd * WARPS - 1) // (rd * WARPS), min(T, MAX_GRID_Y)), (WARPS * 32,),
        (dsrc[0], ids, np.int32(ids64), w, h, y, np.int32(T), np.int32(k), np.int32(E), np.int32(H), np.int32(I),
         *(np.int32(v) for v in dblock)))


def _grouped(gsrc, dsrc, gblock, dblock, x, ids, ids64, w, y, E, H, I, a):
    """Bucket the slots by expert (one block), kernel A and the down GEMVs per (rows, expert) with MOE_NT slots
    per weight load into (S, I) / (S, H) scratch, then the weighted sum per token in slot order."""
    T, k = ids.shape
    S = T * k
    off, order = cp.empty(E + 1, dtype=cp.int32), cp.empty(S, dtype=cp.int32)
    h, ys = cp.empty((S, I), dtype=cp.float32), cp.empty((S, H), dtype=cp.float32)
    r = ROWS_GROUPED
    _fn("moe_bucket")((1,), (BUCKET_THREADS,), (ids, np.int32(ids64), np.int32(S), np.int32(E), off, order))
    _fn(f"moe_gate_up_g_{gsrc[1]}_r{r}")(
        ((I + r * WARPS - 1) // (r * WARPS), E), (WARPS * 32,),
        (gsrc[0], off, order, x, h, np.int32(k), np.int32(E), np.int32(I), np.int32(H),
         *(np.int32(v) for v in gblock), a))
    _fn(f"moe_down_g_{dsrc[1]}_r{r}")(
        ((H + r * WARPS - 1) // (r * WARPS), E), (WARPS * 32,),
        (dsrc[0], off, order, h, ys, np.int32(E), np.int32(H), np.int32(I), *(np.int32(v) for v in dblock)))
    _fn("moe_combine")(((T * H + COMBINE_THREADS - 1) // COMBINE_THREADS,), (COMBINE_THREADS,),
                       (ids, np.int32(ids64), w, ys, y, np.int32(T), np.int32(k), np.int32(E), np.int32(H)))


def _grouped_x3(gsrc, dsrc, x, ids, ids64, w, y, E, H, I, a, planes: int = 3):
    """Routed experts on the bf16 tensor cores with f32-exact products (the default where the device has them; off
    with LUMEN_CUDA_MMA_PREFILL=0; lumen_cuda.fp8_mma): the slots bucketed as in ``_grouped``; x and then h as three
    bf16 planes; gate and up in one launch, then down, per (expert, run of 32 slots, 256 rows;
    ``fp8_mma.SlotBlocks``: the width, its work list built on the device); then the same weighted sum. gsrc / dsrc as
    ``_launch``'s: (table, "fp8" | "nvfp4" | "bf16") or (packed base, "packed_bf16"). ``planes`` 1: x and h
    rounded to bf16 (the experts' weights of cuda.compute-quantization bf16), one MMA where exact takes three."""
    T, k = ids.shape
    S = T * k
    off, order = cp.empty(E + 1, dtype=cp.int32), cp.empty(S, dtype=cp.int32)
    _fn("moe_bucket")((1,), (BUCKET_THREADS,), (ids, np.int32(ids64), np.int32(S), np.int32(E), off, order))
    work = fp8_mma.SlotBlocks(off, S, E, _fn("moe_slot_blocks"), BUCKET_THREADS, planes)
    xp = fp8_mma.x_planes(x, planes)
    gu, ys = cp.empty((2, S, I), dtype=cp.float32), cp.empty((S, H), dtype=cp.float32)

    def roles(src, n: int, planes, out, N: int, K: int, div: int):
        """The table's n matrices (2: gate and up, in one launch; 1: down), whose data rows come first, then their
        scales (fp8: f32 blocks; NVFP4: e4m3 blocks, then global scales)."""
        tab, kind = src
        if kind == "fp8":
            fp8_mma.moe_role(tab, 0, n, E, work, off, order, div, planes, out, N, K, n)
        elif kind == "nvfp4":
            fp8_mma.moe_role_nvfp4(tab, 0, n, 2 * n, E, work, off, order, div, planes, out, N, K, n)
        elif kind == "bf16":
            fp8_mma.moe_role_bf16(tab, 0, None, 0, 0, E, work, off, order, div, planes, out, N, K, n)
        else:  # packed: (E, 2I, H) with the up rows after the gate rows, (E, H, I)
            fp8_mma.moe_role_bf16(None, 0, tab, tab.shape[1] * K, 0, E, work, off, order, div, planes, out, N, K, n)

    roles(gsrc, 2, xp, gu, I, H, k)
    hp = fp8_mma.x_planes(fp8_mma.moe_act(gu[0], gu[1], int(a)), planes)
    roles(dsrc, 1, hp, ys, H, I, 1)
    _fn("moe_combine")(((T * H + COMBINE_THREADS - 1) // COMBINE_THREADS,), (COMBINE_THREADS,),
                       (ids, np.int32(ids64), w, ys, y, np.int32(T), np.int32(k), np.int32(E), np.int32(H)))


def _launch(gsrc, dsrc, gfmt, dfmt, gblock, dblock, inputs, E, H, I, act, out, scratch=None, x3: int = 0):
    """The kernels for one call; ``scratch``: the layer's dict that keeps its T = 1 buffer (``_scratch``); ``x3``:
    the grouped path on the tensor cores (``_grouped_x3``; fp8 / NVFP4 / bf16 tables, packed bf16) with that many
    activation planes (3 or 1: ``fp8_mma.planes_for``; 0: the CUDA-core path)."""
    x, ids, ids64, w = inputs
    T, k = ids.shape
    y = _out(out, T, H)
    if T == 0:
        return y
    a = np.int32(ACTS[act])
    if T < GROUPED_MIN_T or E > BUCKET_MAX_E:
        _per_slot(gsrc, dsrc, gfmt, dfmt, gblock, dblock, x, ids, ids64, w, y, E, H, I, a, scratch)
        return y
    step = max(1, CHUNK_FLOATS // (k * max(H, I)))  # tokens per launch: bounds the scratch (shape-only)
    for t0 in range(0, T, step):
        t1 = min(T, t0 + step)
        if x3:
            _grouped_x3(gsrc, dsrc, x[t0:t1], ids[t0:t1], ids64, w[t0:t1], y[t0:t1], E, H, I, a, x3)
        else:
            _grouped(gsrc, dsrc, gblock, dblock, x[t0:t1], ids[t0:t1], ids64, w[t0:t1], y[t0:t1], E, H, I, a)
    return y


def experts(x, ids, weights, gate_up, down, act: str = "silu", out=None):
    """``ops.moe_experts`` for any T without a host sync: x (T, H) f32; ids (T, k) int64/int32 and weights
    (T, k) f32 on the device; gate_up per expert (gate, up) Weights (I, H); down per expert (H, I). -> (T, H)
    f32 (``out`` (T, H) f32 C-contiguous to write into). Falls back to ``experts_grouped`` (which syncs on the
    ids) where the kernels do not apply."""
    tg = _table(gate_up, True) if act in ACTS else None
    td = _table(down, False) if tg is not None else None
    ok = tg is not None and td is not None and len(gate_up) == len(down)
    if ok:
        I, H = tg.shape
        ok = td.shape == (H, I)
        inputs = _inputs(x, ids, weights, H) if ok else None
    if not ok or inputs is None:
        y = experts_grouped(x, ids, weights, gate_up, down, act)
        if out is not None:
            out[...] = y
            return out
        return y
    # the grouped path on the tensor cores (the default; LUMEN_CUDA_MMA_PREFILL=0 keeps the CUDA-core kernels): asked
    # only for prefill-sized calls (its first answer launches a kernel and syncs once, never inside a captured decode
    # step)
    x3 = (inputs[1].shape[0] >= GROUPED_MIN_T and tg.fmt == td.fmt
          and fp8_mma.exact_experts(tg.fmt, tg.shape, td.shape, tg.block[:2], td.block[:2]))
    x3 = fp8_mma.planes_for(gate_up[0][0]) if x3 else 0
    return _launch((tg.ptrs, tg.fmt), (td.ptrs, td.fmt), tg.fmt, td.fmt, tg.block, td.block, inputs,
                   len(gate_up), H, I, act, out, tg.scratch, x3)


ROUTED_MAX_E = 512  # ROUTED_MAX_E in moe.cu: the logits a warp routes inside the gate/up kernel
ROUTED_ROWS = 2  # the rows per warp moe_gate_up_routed_* is compiled for


def route_in_experts(env=None) -> bool:
    """``LUMEN_CUDA_ROUTE_IN_EXPERTS``: 1 lets a one-token ``moe_shared`` route inside its gate/up kernel
    (``experts_routed``: no routing launch); unset or 0 (the default until a GPU suite has run on it), the routing
    kernel then the expert kernels. Read at each call; anything else is an error naming it."""
    v = (os.environ if env is None else env).get("LUMEN_CUDA_ROUTE_IN_EXPERTS", "")
    if v not in ("", "0", "1"):
        raise ValueError(f"LUMEN_CUDA_ROUTE_IN_EXPERTS={v!r}: use 1 (route inside the one-token gate/up kernel) or 0 "
                         "(a routing kernel first, the default)")
    return v == "1"


def experts_routed(x, logits, shared, k: int, gate_up, down, act: str = "silu", normalize: bool = True, out=None,
                   route_out=None):
    """``route(logits, k, normalize, shared=shared)`` then ``experts`` for one token, with the routing done inside
    the gate/up kernel (``moe_gate_up_routed_*``: every warp routes the token's Er <= ROUTED_MAX_E logits with the
    routing kernel's arithmetic, block (0, 0) writes the ids and weights the down kernel reads): one launch fewer.
    x (1, H) f32, logits (1, Er) f32, shared (1, 1) f32 (the shared expert's gate logit; the lists' last item is
    that expert, run as expert Er) or None (the lists are the Er routed experts). ``route_out``: (weights, ids) (1, k
    [+ 1]) f32 / int64 C-contiguous to keep the routing in (as ``route``'s ``out``). Returns None where this path
    does not apply (T != 1, too many logits, another table layout): the caller then routes and runs ``experts``."""
    if not (isinstance(x, cp.ndarray) and isinstance(logits, cp.ndarray) and x.ndim == 2 and x.shape[0] == 1
            and logits.ndim == 2 and logits.shape[0] == 1 and logits.dtype == cp.float32 and act in ACTS):
        return None
    Er = logits.shape[1]
    n = k + (shared is not None)
    E = len(gate_up)
    if not (1 <= k <= min(MAX_K, Er) and Er <= ROUTED_MAX_E and E == len(down) == Er + (shared is not None)):
        return None
    if shared is not None and not (isinstance(shared, cp.ndarray) and shared.dtype == cp.float32 and shared.size == 1):
        return None
    tg = _table(gate_up, True)
    td = _table(down, False) if tg is not None else None
    if td is None:
        return None
    I, H = tg.shape
    if td.shape != (H, I) or x.shape[1] != H:
        return None
    if x.dtype != cp.float32 or not x.flags.c_contiguous or x.data.ptr % 16:
        x = cp.array(x, dtype=cp.float32, order="C", copy=True)
    lg = cp.ascontiguousarray(logits)
    sh = cp.ascontiguousarray(shared) if shared is not None else None
    if route_out is None:
        w, ids = cp.empty((1, n), dtype=cp.float32), cp.empty((1, n), dtype=cp.int64)
    else:
        w, ids = route_out
        assert w.shape == ids.shape == (1, n) and w.dtype == cp.float32 and ids.dtype == cp.int64
        assert w.flags.c_contiguous and ids.flags.c_contiguous
    h = _scratch(tg.scratch, n, I)
    y = _out(out, 1, H)
    rg = ROUTED_ROWS
    _fn(f"moe_gate_up_routed_{tg.fmt}_r{rg}")(
        ((I + rg * WARPS - 1) // (rg * WARPS), n), (WARPS * 32,),
        (tg.ptrs, lg, sh if sh is not None else np.uint64(0), ids, w, x, h, np.int32(k), np.int32(Er), np.int32(E),
         np.int32(I), np.int32(H), *(np.int32(v) for v in tg.block), np.int32(ACTS[act]),
         np.int32(bool(normalize))))
    _down((td.ptrs, td.fmt), td.block, ROWS_DOWN_T1, ids, 1, w, h, y, 1, n, E, H, I)
    return y


def fits_one_table(gate_up, down) -> bool:
    """Whether the device kernels take these lists as they are (one format, shape and block for all), as
    ``experts`` checks before its fast path; builds (and keeps) the tables."""
    tg = _table(gate_up, True)
    td = _table(down, False) if tg is not None else None
    return td is not None and len(gate_up) == len(down) and td.shape == (tg.shape[1], tg.shape[0])


def _packed_ok(w, ndim_shape) -> bool:
    d = w.data
    return (w.format in ("bf16", "f16", "f32") and isinstance(d, cp.ndarray) and d.dtype == DTYPE[w.format]
            and d.shape == ndim_shape and d.flags.c_contiguous and d.data.ptr % 16 == 0)


def experts_packed(x, ids, weights, gate_up, down, act: str = "gelu_tanh", out=None):
    """``ops.moe_experts_packed`` for any T: gate_up Weight (E, 2I, H) (each expert's gate rows then its up
    rows), down Weight (E, H, I), bf16 / f16 / f32. Falls back to ``experts_packed_grouped`` (a host sync)."""
    ok = act in ACTS and getattr(gate_up.data, "ndim", 0) == 3 and getattr(down.data, "ndim", 0) == 3
    if ok:
        E, I2, H = gate_up.data.shape
        I = I2 // 2
        ok = (I2 % 2 == 0 and I > 0 and H > 0 and _packed_ok(gate_up, (E, I2, H)) and _packed_ok(down, (E, H, I))
              and H % ALIGN[gate_up.format] == 0 and I % ALIGN[down.format] == 0)
        inputs = _inputs(x, ids, weights, H) if ok else None
    if not ok or inputs is None:
        y = experts_packed_grouped(x, ids, weights, gate_up, down, act)
        if out is not None:
            out[...] = y
            return out
        return y
    one = (1, 1, 1)
    x3 = (inputs[1].shape[0] >= GROUPED_MIN_T and gate_up.format == down.format == "bf16"
          and fp8_mma.exact_experts("bf16", (I, H), (H, I)))  # as experts'
    x3 = fp8_mma.planes_for(gate_up) if x3 else 0
    return _launch((gate_up.data, f"packed_{gate_up.format}"), (down.data, f"packed_{down.format}"),
                   gate_up.format, down.format, one, one, inputs, E, H, I, act, out,
                   derived(gate_up).setdefault("moe_scratch", {}), x3)


def experts_staged(x, ids, weights, gate_up, down, act: str):
    """The device kernels over expert lists whose Weights point into VRAM staging (stream.py): tables built per
    call (not cached: the slots change). ids of experts not staged must be -1."""
    tg = _build([[g for g, _ in gate_up], [u for _, u in gate_up]]) if act in ACTS else None
    td = _build([list(down)]) if tg is not None else None
    if tg is None or td is None or td.shape != (tg.shape[1], tg.shape[0]):
        raise ValueError("streamed experts need a format and shape the device MoE kernels take (bf16, f16, f32, "
                         "fp8 or nvfp4; K a multiple of the format's 16-byte load)")
    I, H = tg.shape
    inputs = _inputs(x, ids, weights, H)
    if inputs is None:
        raise ValueError(f"streamed experts: x {getattr(x, 'shape', None)} / ids {getattr(ids, 'shape', None)} "
                         "do not fit the expert matrices")
    return _launch((tg.ptrs, tg.fmt), (td.ptrs, td.fmt), tg.fmt, td.fmt, tg.block, td.block, inputs, len(gate_up),
                   H, I, act, None)


experts_decode = experts  # the T = 1 names ops.py calls
experts_packed_decode = experts_packed


# -- the CuPy references (host syncs: not capturable) ---------------------------------------------------------------
def route_cupy(logits, k: int, normalize: bool = True):
    """The CuPy reference of ``route`` (argsort: not capturable). ``ops.moe_route_cupy``."""
    z = logits - logits.max(axis=-1, keepdims=True)
    p = cp.exp(z)
    p /= p.sum(axis=-1, keepdims=True)
    ids = cp.argsort(-p, axis=-1)[:, :k]  # CuPy's sort is stable, like the CPU's kind="stable"
    w = cp.take_along_axis(p, ids, axis=-1)
    if normalize:
        w = w / w.sum(axis=-1, keepdims=True)
    return w.astype(cp.float32, copy=False), ids


def _groups(ids):
    """Per routed expert e: (e, token rows, slots) — one host sync for the (T, k) ids, then device indices."""
    require_host("MoE over several tokens (expert ids grouped on the host)")
    host = cp.asnumpy(ids).astype(np.int64) if isinstance(ids, cp.ndarray) else np.asarray(ids, np.int64)
    for e in np.unique(host):
        tok, slot = np.nonzero(host == e)
        yield int(e), cp.asarray(tok), cp.asarray(slot)


def experts_grouped(x, ids, weights, gate_up, down, act: str = "silu"):
    """``experts`` by groups of tokens per expert (the ids go to the host once): any T, not capturable.
    ``ops.moe_experts_grouped``."""
    out = cp.zeros_like(x)
    mul = cupy_ops.silu_mul if act == "silu" else cupy_ops.gelu_tanh_mul
    for e, tok, slot in _groups(ids):
        h = x[tok]
        g, u = gate_up[e]
        y = gemv.linear(mul(gemv.linear(h, g), gemv.linear(h, u)), down[e])
        out[tok] += y * weights[tok, slot][:, None]  # a token picks an expert once: rows are distinct
    return out


def experts_packed_grouped(x, ids, weights, gate_up, down, act: str = "gelu_tanh"):
    """``experts_packed`` by groups of tokens per expert (host sync): any T, not capturable.
    ``ops.moe_experts_packed_grouped``."""
    out = cp.zeros_like(x)
    mul = cupy_ops.silu_mul if act == "silu" else cupy_ops.gelu_tanh_mul
    for e, tok, slot in _groups(ids):
        h = x[tok]
        gu = cp.matmul(h, cupy_ops.dense(gate_up.data[e], gate_up.format).T)  # (n, 2I)
        half = gu.shape[-1] // 2
        y = cp.matmul(mul(gu[:, :half], gu[:, half:]), cupy_ops.dense(down.data[e], down.format).T)
        out[tok] += y * weights[tok, slot][:, None]
    return out
