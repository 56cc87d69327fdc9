"""The CUDA device: VRAM, CuPy arrays. Weights stay in their checkpoint format (f32, f16, bf16 as uint16 bits).

CuPy is imported only where a device is asked for: on a machine without CuPy or a GPU, ``devices()`` is empty
and the plan check refuses ``cuda:N`` as a device that does not exist.
"""

from __future__ import annotations

import numpy as np

from lumen_core.backend import Backend, DeviceInfo, Weight

UPLOAD = {"f32": np.float32, "f16": np.float16, "bf16": np.uint16}  # bf16: the raw bits (CuPy has no bfloat16)


def _cupy():
    """CuPy, or None where it (or its CUDA runtime) cannot be loaded."""
    try:
        import cupy
    except Exception:  # ImportError, or a CuPy built for a CUDA this machine lacks
        return None
    return cupy


class CUDABackend(Backend):
    name = "cuda"
    stores = ("vram",)  # streaming weights from host RAM ("ram") comes with the hand-written kernels
    kv_types = ("f32", "f16", "bf16")

    @classmethod
    def devices(cls) -> list[DeviceInfo]:
        cp = _cupy()
        if cp is None:
            return []
        try:
            n = cp.cuda.runtime.getDeviceCount()
        except Exception:  # no driver / no device: CUDARuntimeError
            return []
        out = []
        for i in range(n):
            with cp.cuda.Device(i) as dev:
                free, total = dev.mem_info
                props = cp.cuda.runtime.getDeviceProperties(i)
            name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
            out.append(DeviceInfo(f"cuda:{i}", total, free, f"{name}, sm_{props['major']}{props['minor']}"))
        return out

    def __init__(self, device: str, registry):
        super().__init__(device, registry)
        cp = _cupy()
        if cp is None:
            raise RuntimeError("the cuda backend needs CuPy: pip install 'lumen-cuda[cuda13]' (or [cuda12])")
        self.cp = cp
        self.index = int(device.split(":", 1)[1]) if ":" in device else 0
        self.dev = cp.cuda.Device(self.index)

    def weight(self, array, fmt: str, store: str, scale=None, shape=None) -> Weight:
        if store != "vram":
            raise ValueError(f"the cuda backend computes only from store 'vram', not {store!r}")
        if scale is not None or fmt not in UPLOAD:
            raise NotImplementedError(f"weight format {fmt!r} is not yet supported on cuda (f32, f16, bf16 are)")
        host = np.ascontiguousarray(array).view(UPLOAD[fmt]) if fmt == "bf16" else np.asarray(array, UPLOAD[fmt])
        with self.dev:
            data = self.cp.asarray(host)
        return Weight(data, fmt, tuple(shape or host.shape))

    def tensor(self, array):
        host = np.asarray(array)
        # Integer arrays (expert ids routed on another device) keep their type; everything else is f32.
        dtype = np.int64 if host.dtype.kind in "iu" else np.float32
        with self.dev:
            return self.cp.asarray(host.astype(dtype, copy=False))

    def to_host(self, x):
        return self.cp.asnumpy(x) if isinstance(x, self.cp.ndarray) else np.asarray(x)

    def owns(self, x) -> bool:
        return isinstance(x, self.cp.ndarray) and x.device.id == self.index

    def take(self, x):
        # Each component's first call on this device: make it current, so the tensor arithmetic the
        # architecture does between ops (x + y) runs here too when several GPUs are in one plan.
        self.dev.use()
        if self.owns(x):
            return x
        if isinstance(x, self.cp.ndarray):  # another GPU: a peer copy
            with self.dev:
                return x.copy()
        return super().take(x)
