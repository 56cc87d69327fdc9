"""The wgpu device (``wgpu:N``): WebGPU through wgpu-py, on Vulkan, Metal or DX12.

Weights live in GPU buffers (store ``vram``), uploaded once, in their checkpoint format: f32, f16, bf16, fp8, nvfp4
and GGUF q8_0/q4_0/q5_0/q4_k/q5_k/q6_k, decoded in the shaders (``quant.py``); other GGUF block formats are
dequantized to bf16 on load (``stored_format``). Matrices larger than the adapter's largest storage binding are split
by rows into several buffers (``linear.Matrix``). Activations are ``WTensor`` views on pooled
buffers. All state belongs to this backend instance (its ``Context``: device, pipelines, buffer pool, recorder);
``close`` drops it.

Store ``ram`` (a GPU reading weights from host memory) is refused: WebGPU has no portable way for a shader to read
mapped host memory.
"""

from __future__ import annotations

import numpy as np

from lumen_core.backend import Backend, DeviceInfo, Weight, scale_block
from lumen_core.errors import PlanError

from . import device as wdev
from . import quant
from .tensor import WTensor, from_numpy, set_current

# formats kept as they are and decoded in the shaders (quant.FORMATS: f32, f16, bf16, fp8, nvfp4, GGUF q8_0, q4_0,
# q5_0, q4_k, q5_k, q6_k); the other GGUF block formats become bf16 on load (stored_format)
NATIVE = quant.FORMATS


class WGPUBackend(Backend):
    name = "wgpu"
    stores = ("vram",)
    kv_types = ("f32", "f16", "bf16", "fp8")  # fp8: E4M3 bytes, rounded on write as the CPU rounds (attention.py)
    kv_stores = ("vram",)
    prefix_cache = False  # its caches (KVArray, WTensor states) have no host save/restore for lumen_core.prefix_cache
    speculative = False  # its caches cannot be copied or rewound yet, which speculative decoding needs

    @classmethod
    def devices(cls) -> list[DeviceInfo]:
        out = []
        for i, a in enumerate(wdev.adapters()):
            mem = wdev.adapter_memory(a)
            out.append(DeviceInfo(f"wgpu:{i}", mem, mem, wdev.adapter_summary(a)))
        return out

    @classmethod
    def device_info(cls, device: str) -> DeviceInfo:
        devices = cls.devices()
        for info in devices:
            if info.name == device:
                return info
        if not devices:
            err = PlanError(f"{device!r}: wgpu finds no Vulkan, Metal or DX12 adapter on this machine ({_why_none()})")
            err.fix = ('install a Vulkan driver (on Debian/Ubuntu without a GPU: apt-get install mesa-vulkan-drivers '
                       'gives lavapipe, a CPU one), or compute on "cpu"')
            raise err
        present = ", ".join(i.name for i in devices)
        raise PlanError(f"device {device!r} does not exist; wgpu finds {len(devices)} adapter(s): {present}")

    @classmethod
    def stored_format(cls, fmt: str, store: str = "vram") -> str:
        return fmt if fmt in NATIVE else "bf16" if _is_gguf_block(fmt) else fmt

    def __init__(self, device: str, registry):
        super().__init__(device, registry)
        self.index = int(device.split(":", 1)[1]) if ":" in device else 0
        self.ctx = wdev.Context(self.index)
        set_current(self.ctx)

    # -- weights and tensors ----------------------------------------------------------------------------------
    def weight(self, array, fmt: str, store: str, scale=None, shape=None) -> Weight:
        from .linear import Matrix

        if store != "vram":
            raise PlanError(f"wgpu keeps weights in 'vram' only (got store {store!r}): WebGPU shaders cannot read "
                            "host memory")
        if _is_gguf_block(fmt) and fmt not in NATIVE:
            array, fmt = _gguf_to_bf16(array, fmt, shape), "bf16"
            shape = array.shape
        if fmt not in NATIVE:
            raise PlanError(f"the wgpu backend does not read {fmt!r} weights yet (it reads {', '.join(NATIVE)} and "
                            "the other GGUF block formats, as bf16)")
        if shape is None:  # the array's own shape, but for nvfp4's packed pairs
            shape = np.shape(array)
            shape = (shape[0], shape[1] * 2) if fmt == "nvfp4" else shape
        shape = tuple(int(d) for d in shape)
        data = Matrix.upload(self.ctx, array, fmt, shape, scale)  # kept as stored; scales with their rows
        scales = data.layout.scales  # what Weight.nbytes counts of them (quant.Scales), None where none
        block = (1, quant.NVFP4_GROUP) if fmt == "nvfp4" else \
            scale_block(shape, scales.shape) if scales is not None else None
        return Weight(data, fmt, shape, scales, block, store="vram")

    def tensor(self, array):
        set_current(self.ctx)
        return from_numpy(self.ctx, array)

    def to_host(self, x):
        from .linear import Matrix

        if isinstance(x, Matrix):  # a weight's values (an architecture that transposes one on load)
            return x.to_host()
        return x._lumen_to_host() if isinstance(x, WTensor) else np.asarray(x)

    def use(self) -> None:
        set_current(self.ctx)

    def owns(self, x) -> bool:
        return isinstance(x, WTensor) and x.ctx is self.ctx

    def take(self, x):
        set_current(self.ctx)
        if self.owns(x):
            return x
        if isinstance(x, WTensor):  # another adapter: through the host
            return self.tensor(x._lumen_to_host())
        return super().take(x)

    def decode_runner(self, model, context_size: int):
        """Each step recorded into one command buffer, the greedy token picked on the device (lumen_wgpu.runner)."""
        from .runner import Runner

        self.use()
        return Runner(model, self, context_size)

    def close(self) -> None:
        self.ctx.close()


def _is_gguf_block(fmt: str) -> bool:
    from lumen_core.checkpoint.gguf import GGML_TYPES

    return any(name.lower() == fmt and block > 1 for name, block, _ in GGML_TYPES.values())


def _gguf_to_bf16(raw, fmt: str, shape) -> np.ndarray:
    """GGUF blocks (rows, bytes per row) -> bf16 bits, through ``gguf.quants.dequantize`` (the reference the CPU
    backend uses), rounded to nearest even."""
    from gguf.quants import GGMLQuantizationType, dequantize

    from lumen_core.checkpoint.gguf import TYPE_IDS

    values = dequantize(np.asarray(raw), GGMLQuantizationType(TYPE_IDS[fmt.upper()])).astype(np.float32)
    if shape is not None and tuple(values.shape) != tuple(shape):
        values = values.reshape(shape)
    bits = values.view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def _why_none() -> str:
    try:
        import wgpu  # noqa: F401
    except ImportError:
        return "wgpu-py is not installed: pip install wgpu"
    why = wdev.adapters_error()
    if why:  # e.g. its cffi backend missing: ModuleNotFoundError
        return f"wgpu-py failed to list adapters: {why}"
    return "no driver reported one; `vulkaninfo --summary` shows what the Vulkan loader sees"
