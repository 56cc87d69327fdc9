"""Weights of a GPU component kept in host RAM (``compute: cuda:N, store: ram`` for a layer, the input or the
output layer): read over PCIe, never resident in VRAM.

``CUDABackend.weight`` puts a ``store: ram`` matrix in page-locked host memory (the backend's
``pinned.PinnedArena``, the same arena as streamed experts: large matrices in a ``cudaHostAlloc`` of their own,
smaller ones packed into blocks that grow with the load, so the page-locked memory taken is the plan's host-RAM
figure; pinned.py says why). Under unified addressing the GPU reads page-locked memory at its host address, so
each op that takes a Weight (``linear``, ``linear_group``, ``embedding``; registered through ``_host_aware``,
which tells such a Weight by ``Weight.store == "ram"``) meets it as:

- **a few tokens (decode, T < STAGE_MIN_T)**: zero-copy device views of the same memory (``device_view``, made
  once and kept on the Weight: lumen_cuda.state), so the GEMV kernels read every byte once over PCIe, with no
  copy and no host sync: decode stays one CUDA graph. A token reads the matrix's bytes once either way, so a
  staging copy would move the same bytes and add a buffer.
- **many tokens (prefill)**: a transient VRAM copy (``staged``, one PCIe read of the matrix), then the usual GEMM
  path, whose tiles re-read the weight many times (from VRAM, not over PCIe). It is freed when the op returns.

The projections of such weights are never fused (``gemv.linear_group`` concatenates fused groups into VRAM): each
is a separate GEMV. This is the same direct-read design as the streamed routed experts (stream.py; the reasons
are in docs/cuda.md, Step 5) without a cache: every token reads these weights over PCIe.
"""

from __future__ import annotations

import cupy as cp
import numpy as np

from lumen_core.backend import Weight

from .gemv import linear_any
from .state import derived

STAGE_MIN_T = 8  # tokens from which a host weight is copied into VRAM for the op (the MoE prefill threshold too)


def on_host(w) -> bool:
    """Whether ``w`` is a Weight its backend keeps in host RAM."""
    return getattr(w, "store", None) == "ram"


def _view(a: np.ndarray) -> cp.ndarray:
    """A device array over page-locked host memory (the GPU reads it over PCIe; no copy)."""
    mem = cp.cuda.UnownedMemory(a.ctypes.data, a.nbytes, a, cp.cuda.runtime.getDevice())
    return cp.ndarray(a.shape, a.dtype, cp.cuda.MemoryPointer(mem, 0))


def _each(w: Weight, fn, store: str) -> Weight:
    """w with fn applied to its data and its scale arrays (fp8 scale; nvfp4 block scales)."""
    scale = w.scale
    if w.format == "nvfp4":
        scale = type(scale)(fn(scale.block), scale.global_scale)
    elif scale is not None:
        scale = fn(scale)
    return Weight(fn(w.data), w.format, w.shape, scale, w.block, store=store, activations=w.activations)


def device_view(w: Weight) -> Weight:
    """w's zero-copy device view (its bytes stay in host RAM: store 'ram'), made once and kept on w."""
    state = derived(w)
    view = state.get("device_view")
    if view is None:
        view = state["device_view"] = _each(w, _view, "ram")
    return view


def staged(w: Weight) -> Weight:
    """A transient VRAM copy of w (one host-to-device copy from page-locked memory)."""
    return _each(w, cp.asarray, "vram")


def _tokens(x) -> int:
    return int(np.prod(x.shape[:-1])) if getattr(x, "ndim", 1) > 1 else 1


def for_op(x, w: Weight) -> Weight:
    """What an op computing ``x`` against host Weight ``w`` reads: a VRAM copy for a prefill, else the view."""
    return staged(w) if _tokens(x) >= STAGE_MIN_T else device_view(w)


def dispatch(op: str, call, *args, **kwargs):
    """The registered ``op`` (``call``) with its host Weights replaced by what it reads (see the module docstring)."""
    if op == "linear_group":
        x, ws = args
        return [linear_any(x, for_op(x, w) if on_host(w) else w) for w in ws]  # never fused: see above
    if op == "embedding":
        ids, w = args
        return call(ids, device_view(w), **kwargs)  # the rows asked for, read over PCIe
    x, w = args
    return call(x, for_op(x, w), **kwargs)
