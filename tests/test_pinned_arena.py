"""The page-locked arena of the cuda backend (lumen_cuda.pinned) takes what the plan counts for weights a GPU keeps
in host RAM (``store: ram``), whatever an earlier load left in it. No GPU: the arena is given a stand-in allocator
(anonymous memory, rounded to CuPy's 512-byte unit as CuPy's pinned pool rounds) and the loader runs the cuda backend's
host-weight path against it, on a stand-in cuda:0. tests/test_cuda_hostweights.py measures the same on a GPU.
Each CUDABackend (one per device per engine) has an arena of its own, which counts the bytes it still holds
(``live``): a dropped engine's pinned memory is seen to go back."""

from __future__ import annotations

import gc
import mmap

import numpy as np
import pytest

from lumen_core import plan as plan_mod
from lumen_core.backend import DeviceInfo

pytest.importorskip("lumen_cuda")
from lumen_cuda import pinned  # noqa: E402
from lumen_cuda.backend import CUDABackend  # noqa: E402

GIB = 1 << 30
QWEN = {"hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 128, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128}


class _Pinned(mmap.mmap):
    """Page-aligned anonymous memory with CuPy's ``PinnedMemoryPointer.size()``."""

    def size(self) -> int:
        return len(self)


def _alloc(log: list):
    def alloc(n: int) -> _Pinned:
        log.append(n)
        return _Pinned(-1, -(-n // 512) * 512)

    return alloc


class _HostOnly:
    """The cuda backend's weight path for store 'ram' (CUDABackend._host_weight into ``arena``: no device touched);
    small tensors stay numpy."""

    def __init__(self, arena):
        self.backend = CUDABackend.__new__(CUDABackend)
        self.backend.arena = arena

    def weight(self, array, fmt, store, scale=None, shape=None):
        assert store == "ram"
        return self.backend._host_weight(array, fmt, scale, shape)

    def tensor(self, array):
        return np.asarray(array, np.float32)


@pytest.fixture
def standin_gpu(monkeypatch):
    devices = [DeviceInfo("cuda:0", 80 * GIB, 79 * GIB, "stand-in")]
    monkeypatch.setattr(CUDABackend, "devices", classmethod(lambda cls: devices))
    monkeypatch.setattr(plan_mod, "host_available_bytes", lambda: 64 * GIB)


def _load_host_weights(path, arena, monkeypatch):
    """Plan and load a checkpoint with every weight on cuda:0 from host RAM, into ``arena``; the plan."""
    from lumen_core.engine import prepare
    from lumen_core.loader import load_component

    _, ckpt, arch, plan, resolved = prepare({"model": {"path": str(path), "compute": "cuda:0", "store": "ram",
                                                       "hidden-layers": {"kv-cache": {"context-size": 64}}}})
    shared: dict = {}
    host = _HostOnly(arena)
    weights = {comp: load_component(ckpt, arch, host, resolved["placements"][comp].store, names, shared)
               for comp, names in resolved["layout"].needs.items()}
    return plan, weights


def test_host_weights_take_the_page_locked_memory_the_plan_counts(tiny_checkpoint, standin_gpu, monkeypatch):
    path = tiny_checkpoint("qwen3_5", **QWEN)
    log: list = []
    arena = pinned.PinnedArena(_alloc(log))
    plan, weights = _load_host_weights(path, arena, monkeypatch)
    want = plan.pools()["host RAM"]
    assert plan.pinned() == want  # every weight of this plan is page-locked for cuda:0
    assert want > 50e6
    # the bound of pinned.py (1/16 and a first block), and what it comes to here (~1 MiB: the first block, part full);
    # the plan's host-RAM figure also counts the few small non-matrix tensors, which the cuda backend keeps in VRAM
    assert want - 200_000 <= arena.allocated <= want * (1 + 1 / 16) + pinned.BLOCK_MIN
    assert arena.allocated - want <= 0.02 * want, (arena.allocated, want)
    assert all(n % pinned.PAGE == 0 for n in log) and len(log) < 64
    w = next(iter(weights.values()))
    some = next(v for v in w.values() if hasattr(v, "data") and v.store == "ram")
    assert isinstance(some.data, np.ndarray)
    assert some.data.flags.c_contiguous and some.data.ctypes.data % pinned.ALIGN == 0


def test_a_load_takes_the_same_whatever_came_before_it(tiny_checkpoint, standin_gpu, monkeypatch):
    """The old arena's figure depended on how much of its current 32 MiB block an earlier load had left free
    (335.5 vs 302.0 MB for the same model on the H200). Now each load (each CUDABackend) has an arena of its own:
    the same sizes are asked for (so CuPy's pinned pool can hand a dropped model's memory to its reload) and the
    same bytes taken, while an earlier engine's arena, partly filled, is still alive."""
    path = tiny_checkpoint("qwen3_5", **QWEN)
    log: list = []
    earlier = pinned.PinnedArena(_alloc(log))
    kept = [earlier.copy(np.zeros(1000, np.uint8)) for _ in range(3)]  # an earlier engine: a partly filled block
    sizes = []
    for _ in range(2):
        start = len(log)
        _load_host_weights(path, pinned.PinnedArena(_alloc(log)), monkeypatch)
        sizes.append(log[start:])
    assert sizes[0] == sizes[1] and kept


def test_an_arena_counts_what_it_holds_until_its_arrays_are_gone(tiny_checkpoint, standin_gpu, monkeypatch):
    """``live``: the bytes of allocations still held. Dropping a load's weights and closing its arena (what
    CUDABackend.close does) brings it to 0: nothing of a dropped engine stays page-locked."""
    path = tiny_checkpoint("qwen3_5", **QWEN)
    arena = pinned.PinnedArena(_alloc([]))
    plan, weights = _load_host_weights(path, arena, monkeypatch)
    assert arena.live == arena.allocated > 50e6
    del plan, weights
    gc.collect()
    assert 0 < arena.live <= pinned.BLOCK_MAX  # the block being filled is still the arena's
    arena.close()
    gc.collect()
    assert arena.live == 0


def test_large_arrays_get_their_own_allocation_and_small_ones_share_growing_blocks():
    MiB = 1 << 20
    log: list = []
    arena = pinned.PinnedArena(_alloc(log))
    assert arena.block_size() == pinned.BLOCK_MIN
    a = arena.copy(np.arange(MiB // 4 + 3, dtype=np.float32))  # over BLOCK_MIN / SHARE: its own, 1 page more
    assert log == [MiB + pinned.PAGE] and arena.allocated == MiB + pinned.PAGE
    np.testing.assert_array_equal(a, np.arange(MiB // 4 + 3, dtype=np.float32))
    smalls = [arena.copy(np.full(300, i, np.float32)) for i in range(10)]  # 1200 bytes each: one shared block
    assert log == [MiB + pinned.PAGE, pinned.BLOCK_MIN]
    assert all(s.ctypes.data % pinned.ALIGN == 0 for s in smalls)
    assert [int(s[0]) for s in smalls] == list(range(10))
    assert arena.copy(np.zeros((0, 4), np.float32)).shape == (0, 4)
    arena.taken = 100 * pinned.SHARE * MiB  # 100 MiB per block share: blocks of 64 MiB, arrays over 2 MiB their own
    assert arena.block_size() == 64 * MiB
    arena.taken = 1 << 50
    assert arena.block_size() == pinned.BLOCK_MAX


def test_each_cuda_backend_has_an_arena_of_its_own(monkeypatch):
    """Two CUDABackends on one device (two engines) never share an arena (tested without CuPy: the backend's CuPy
    is a stand-in); there is no process-wide arena."""
    import types

    from lumen_cuda import backend as cb

    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(Device=lambda i: ("device", i)))
    monkeypatch.setattr(cb, "_load_cupy", lambda: (fake, None), raising=False)
    monkeypatch.setattr(cb, "_cupy", lambda: fake)
    a, b = CUDABackend("cuda:0", None), CUDABackend("cuda:0", None)
    assert isinstance(a.arena, pinned.PinnedArena) and a.arena is not b.arena
    assert a.arena.block is None and a.arena.taken == 0
    assert not hasattr(pinned, "ARENA")
