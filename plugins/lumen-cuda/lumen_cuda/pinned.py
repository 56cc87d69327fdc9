"""Page-locked host memory for weights kept in host RAM by a GPU (``store: ram``: streamed routed experts,
stream.py; layers and the input/output layers, hostweights.py).

**The arena takes what the plan says.** The plan (``lumen show-plan``, and the check that the host-RAM pool fits
``MemAvailable``) counts each tensor's own bytes, from the checkpoint header, before anything is loaded; the arena
is built to take those bytes and little more, whatever the model:

- An array gets a ``cudaHostAlloc`` of its own, of its size rounded up to the 4 KiB page (what the driver locks; a
  real model's matrices are whole pages), when it is over 1/``SHARE`` of the current block size.
- Smaller arrays are packed, 256-byte aligned, into shared blocks. A load's blocks grow with it: each new block is
  the largest power of two at most 1/``SHARE`` of what the load has taken so far (``BLOCK_MIN`` to ``BLOCK_MAX``).
  A block is left when the next array does not fit the rest of it (less than 1/``SHARE`` of a block stays unused
  so), and the block being filled at the end is at most 1/``SHARE`` of the load, or ``BLOCK_MIN``.

So a load takes at most about 1/16 more than its arrays' bytes, plus ``BLOCK_MIN``, and in practice under 2% (same-sized
expert matrices pack with little left over). Blocks rather than one allocation per matrix: the routed-expert
matrices of the largest MoE models number tens of thousands, and each ``cudaHostAlloc`` has a fixed cost (on the
H200 machine 256 KiB ones took 144 us each, 1.7 GiB/s, against 2.6 GiB/s in 64 MiB ones) and adds to the
process's memory mappings (one for every 8 allocations there). Measured on the H200: docs/cuda.md (host weights).

**One arena per load.** Each ``CUDABackend`` (one per device per engine) has its own ``PinnedArena``: what a load
takes depends on its own arrays only, two engines never share a block, and a reload asks for the same sizes, which
CuPy's pinned pool hands back. An allocation is released (to CuPy's pinned pool) when the last array in it is
gone, and the block being filled is let go by ``close`` (``CUDABackend.close``): ``live`` counts the bytes of the
allocations still held, so a test can see that a dropped engine returned all of its pinned memory.

This replaced 32 MiB blocks cut into by a bump pointer, which took more than the plan by an amount the plan could
not know: a new block whenever the next array did not fit the rest of the current one, and how much of the first
block was free depended on what an earlier load in the same process had left there. The ~275 MB f32 Qwen 3.5 of
tests/test_cuda_hostweights.py (matrices of up to 16 MiB) filled 10 blocks to 16 to 32 MiB each: 335.5 MB
taken from a fresh arena, 302.0 MB after a load that had left 16 MiB or more free, for a plan of 274.9 MB. Counting that
waste in the plan would have meant replaying the loader's order and the process's earlier loads in the plan, and the
memory would still have been wasted; the arena above makes the waste vanish instead.
"""

from __future__ import annotations

import weakref

import numpy as np

ALIGN = 256  # byte alignment of every array in the arena (and of every matrix in an expert cache slot: stream.py)
PAGE = 4096  # the granularity at which the driver page-locks host memory
BLOCK_MIN = 1 << 20  # bytes of the first shared block of a load
BLOCK_MAX = 2 << 30  # bytes of a shared block at most (arrays over 64 MiB always get their own)
SHARE = 32  # a new block is about 1/SHARE of what the load has taken; arrays over 1/SHARE of it get their own


def _round(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to


def _cupy_alloc(nbytes: int):
    import cupy as cp

    return cp.cuda.alloc_pinned_memory(nbytes)


class PinnedArena:
    """Page-locked host memory handed out as numpy arrays (module docstring). Each array keeps its allocation alive;
    an allocation goes back to CuPy's pinned-memory pool (for the next load, which asks for the same sizes) when the
    arrays in it are gone (and, for a shared block, once it is no longer the block being filled)."""

    def __init__(self, alloc=None):
        self.alloc = alloc or _cupy_alloc  # nbytes -> a buffer with .size() (CuPy's PinnedMemoryPointer)
        self.allocated = 0  # bytes of every allocation made (statistics: pinned host memory taken)
        self.live = 0  # bytes of the allocations still held (by an array, or as the block being filled)
        self.block = None  # the shared block being filled (a uint8 array over its allocation)
        self.free = 0  # bytes left in it
        self.used = 0
        self.taken = 0  # bytes allocated by this arena (what block_size grows with)

    def close(self) -> None:
        """Let go of the block being filled: every allocation is then released once its arrays are gone."""
        self.block, self.free, self.used = None, 0, 0

    def block_size(self) -> int:
        """The size of the next shared block: the largest power of two at most 1/SHARE of what this load has taken,
        within [BLOCK_MIN, BLOCK_MAX]."""
        b = BLOCK_MIN
        while b < BLOCK_MAX and 2 * b * SHARE <= self.taken:
            b *= 2
        return b

    def _take(self, nbytes: int) -> np.ndarray:
        """A new allocation as a uint8 array over it: every array handed out is a view of that array (numpy keeps
        it as their base), so a finalizer on it runs when the last of them is gone."""
        mem = self.alloc(nbytes)
        n = mem.size()
        self.allocated += n
        self.taken += n
        self.live += n
        buf = np.frombuffer(mem, dtype=np.uint8, count=n)
        weakref.finalize(buf, _released, weakref.ref(self), n)
        return buf

    def copy(self, array: np.ndarray) -> np.ndarray:
        a = np.ascontiguousarray(array)
        n = _round(max(a.nbytes, 1))
        block = self.block_size()
        if n > block // SHARE:  # its own allocation, rounded to the page
            mem, offset = self._take(_round(n, PAGE)), 0
        else:
            if n > self.free:  # what is left of the current block (< n) stays unused
                self.block = self._take(block)
                self.free, self.used = block, 0
            mem, offset = self.block, self.used
            self.used += n
            self.free -= n
        out = mem[offset:offset + a.nbytes].view(a.dtype).reshape(a.shape)
        out[...] = a
        return out


def _released(arena_ref, nbytes: int) -> None:
    arena = arena_ref()
    if arena is not None:
        arena.live -= nbytes
