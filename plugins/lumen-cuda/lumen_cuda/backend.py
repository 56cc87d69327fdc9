"""The CUDA device: VRAM, CuPy arrays. Weights stay in their checkpoint format (f32, f16, bf16 as uint16 bits, fp8,
nvfp4), except GGUF block formats (q8_0, q4_k, ...), which are dequantized to bf16 on load (``stored_format``).

CuPy is imported only where a device is asked for: on a machine without CuPy or a GPU, ``devices()`` is empty
and the plan check refuses ``cuda:N`` naming why (``device_info``): CuPy not installed (and the command that
installs it), CuPy that cannot load or finds no driver or GPU, or an index past the GPUs this machine has.

**State belongs to the backend instance** (one per device per engine: lumen_core.engine ``_backends``), never to a
module: its page-locked arena (``arena``: the engine's store-'ram' weights), its VRAM expert cache
(``expert_streams``), the decode runners it made; ``close`` releases them. What belongs to one Weight is kept on
the Weight (lumen_cuda.state), the step being captured on its runner (lumen_cuda.step), and the only module-level
caches are compiled kernels and device facts (lumen_cuda.kernels). Each Weight made here carries its ``store``
("vram" or "ram"), which is what the ops read to choose a path.

Module order (each imports only modules above it; tests/test_cuda_engines.py checks it):
``lumen_cuda.MODULE_ORDER``.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from lumen_core.backend import Backend, DeviceInfo, OpSet, Weight, _BoundOp, scale_block
from lumen_core.errors import PlanError
from lumen_core.plugins import install_hint

from .pinned import PinnedArena

UPLOAD = {"f32": np.float32, "f16": np.float16, "bf16": np.uint16}  # bf16: the raw bits (CuPy has no bfloat16)
NVFP4_GROUP = 16  # values per e4m3 block scale


def is_gguf_block(fmt: str) -> bool:
    """A GGUF block-quantized format (``q4_k``, ``q8_0``, ``iq4_xs``...): what the GGUF reader names its types."""
    from lumen_core.checkpoint.gguf import GGML_TYPES

    return any(name.lower() == fmt and block > 1 for name, block, _ in GGML_TYPES.values())


def dequantized_bf16(raw, fmt: str, shape) -> np.ndarray:
    """GGUF blocks (rows, bytes per row) -> bf16 bits (uint16, rows x values), through ``gguf.quants.dequantize``
    (the reference the CPU backend and transformers use), rounded to nearest even."""
    from gguf.quants import GGMLQuantizationType, dequantize

    from lumen_core.checkpoint.gguf import TYPE_IDS

    values = dequantize(np.asarray(raw), GGMLQuantizationType(TYPE_IDS[fmt.upper()])).astype(np.float32)
    if shape is not None and tuple(values.shape) != tuple(shape):
        values = values.reshape(shape)
    bits = values.view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


@dataclass
class NVFP4Scale:
    """An NVFP4 weight's scales on the GPU: e4m3 bytes (uint8) per 16 values of a row (N, K/16), and the f32
    global scale kept on the host (a kernel argument, no device read). A value is (e2m1 × block) × global."""

    block: Any  # cupy uint8 (N, K/16): e4m3fn bits
    global_scale: np.float32

    @property
    def nbytes(self) -> int:
        return int(self.block.nbytes) + 4


def _cupy():
    """CuPy, or None where it (or its CUDA runtime) cannot be loaded."""
    return _load_cupy()[0]


def _import_cupy():
    """``import cupy`` (one place, so tests can stand in for a machine without it: they never touch sys.modules,
    which would break a process that has the real CuPy or torch loaded)."""
    import cupy

    return cupy


def _load_cupy():
    """(cupy, None), or (None, why CuPy cannot be used: a sentence for the user, with the command that fixes it)."""
    try:
        cupy = _import_cupy()
    except ImportError as exc:
        if exc.name in ("cupy", "cupy_backends"):
            return None, _cupy_missing()
        return None, _cupy_broken(exc)
    except Exception as exc:  # a CuPy built for a CUDA this machine lacks
        return None, _cupy_broken(exc)
    return cupy, None


def _cupy_missing() -> str:
    return f"CuPy is not installed: {install_hint('lumen-cuda', 'cuda13', 'cuda12')}"


def _cupy_broken(exc: Exception) -> str:
    return (f"CuPy is installed but cannot be imported ({type(exc).__name__}: {exc}); install the CuPy wheel for "
            f"this machine's CUDA: {install_hint('lumen-cuda', 'cuda13', 'cuda12')}")


def _no_gpu_reason() -> str | None:
    """Why lumen-cuda sees no GPU at all, where the cause is CuPy or the driver; None where CuPy works (it may then
    count zero GPUs: the caller says how many there are)."""
    cp, why = _load_cupy()
    if cp is None:
        return why
    try:
        cp.cuda.runtime.getDeviceCount()
    except Exception as exc:  # CUDARuntimeError: no driver, no device, or a driver older than CuPy's CUDA
        return (f"CuPy {getattr(cp, '__version__', '?')} is installed but finds no CUDA driver or GPU "
                f"({type(exc).__name__}: {exc}); check that nvidia-smi lists a GPU and that the CuPy wheel matches "
                f"the driver's CUDA version (extra [cuda13] or [cuda12] of lumen-cuda)")
    return None


class CUDABackend(Backend):
    name = "cuda"
    # "ram": page-locked host memory. Routed experts stream from it through a VRAM expert cache (stream.py);
    # other weights are read over PCIe by decode and copied to VRAM per matrix by prefill (hostweights.py)
    stores = ("vram", "ram")
    expert_stores = ("ram",)  # routed experts in "ram" get the VRAM expert cache (Backend.expert_cache_size)
    # fp8 = E4M3 bytes without a scale, encoded on store and decoded in the attention kernels (attention.py,
    # kernels/decode_attention.cu); bit-equal to the CPU backend's encoding (tests/test_cuda_decode.py)
    kv_types = ("f32", "f16", "bf16", "fp8")
    kv_stores = ("vram",)  # a KV cache in host RAM for a GPU layer comes with issue 5
    graph_guests = ("cpu",)  # CPU experts under a GPU model stay inside the decode graph (hostcall.py)
    activations = "f32"  # what this backend's weights' several-token products take (cuda.compute-quantization)
    # attention.compute-quantization fp8: the KV caches made after configure_attention_quantization("fp8") run
    # several-token attention in e4m3 MMA (flash.attend_fp8); one token keeps the decode kernels' f32 arithmetic
    # over the same fp8 cache (bandwidth-bound: the MMA would read the same bytes). docs/cuda.md, "FP8 attention".
    attention_quantizations = ("fp8",)
    fp8_attention = False

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

    @classmethod
    def device_info(cls, device: str) -> DeviceInfo:
        """``device``'s DeviceInfo, or a PlanError naming why it cannot be used (Backend.device_info says only
        that it does not exist): CuPy missing, CuPy that cannot load or finds no driver or GPU, or an index
        past the GPUs this machine has."""
        devices = cls.devices()
        for info in devices:
            if info.name == device:
                return info
        if not devices:
            why = _no_gpu_reason()
            if why is not None:
                # the GPU may well be there: Lumen cannot use it until this is fixed (the message says how)
                err = PlanError(f"{why}; {device!r} cannot be used until then")
                err.fix = 'do what the message says, or compute on "cpu"'
                raise err
        n = len(devices)
        present = f" (cuda:0 to cuda:{n - 1})" if n > 1 else " (cuda:0)" if n == 1 else ""
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        shown = f", as CUDA_VISIBLE_DEVICES={visible!r} shows it" if visible is not None else ""
        raise PlanError(f"device {device!r} does not exist; this machine has {n} GPU{'' if n == 1 else 's'}"
                        f"{present}{shown}")

    def __init__(self, device: str, registry):
        super().__init__(device, registry)
        self.ops = _BackendOpSet(self)
        cp, why = _load_cupy()
        if cp is None:
            raise RuntimeError(f"the cuda backend needs CuPy. {why}")
        self.cp = cp
        self.index = int(device.split(":", 1)[1]) if ":" in device else 0
        self.dev = cp.cuda.Device(self.index)
        self.arena = PinnedArena()  # this engine's store-'ram' weights: page-locked blocks of their own (pinned.py)
        self._streams = None  # the VRAM expert cache (stream.ExpertStreams), made when first asked for
        self._runners = weakref.WeakSet()  # the decode runners made here (graph.GraphRunner), closed by close()

    @property
    def expert_streams(self):
        """This backend's VRAM expert cache for routed experts streamed from store 'ram' (stream.ExpertStreams)."""
        if self._streams is None:
            from .stream import ExpertStreams

            self._streams = ExpertStreams(self.index)
        return self._streams

    def configure_expert_cache(self, slots: int | None) -> None:
        """Experts kept in this backend's VRAM expert cache (routed experts streamed from store 'ram')."""
        from .stream import DEFAULT_SLOTS

        self.expert_streams.slots = slots or DEFAULT_SLOTS

    def expert_stats(self) -> dict | None:
        """The expert cache's statistics (stream.ExpertStreams.stats), or None where no expert has streamed."""
        return None if self._streams is None else self._streams.stats()

    def close(self) -> None:
        """Release what this backend holds for its engine: the decode runners' graphs, pools and caches, the native
        experts servers' threads, the expert cache's VRAM, the arena's block being filled (the arena's other
        blocks, and the weights' VRAM, go back when the engine's Weights are dropped). Queued work finishes first.
        Idempotent; the engine does not compute here afterwards."""
        with self.dev:
            for runner in list(self._runners):
                runner.close()
            self._runners = weakref.WeakSet()
            for box in list(self.__dict__.pop("_mailboxes", {}).values()):  # native experts servers (hostcall.py)
                box.server.close()
            if self._streams is not None:
                self._streams.close()
                self._streams = None
            self.arena.close()
            self.dev.synchronize()

    @classmethod
    def stored_format(cls, fmt: str, store: str = "vram") -> str:
        """GGUF block formats (q8_0, q4_k, ...) are dequantized to bf16 on load: no CUDA kernel reads them yet."""
        return "bf16" if is_gguf_block(fmt) else fmt

    def configure_compute_quantization(self, quantization: str) -> None:
        """``cuda.compute-quantization``: "bf16" marks every weight this backend makes afterwards
        (``Weight.activations``) so that its several-token products take the activations rounded to bf16 (one bf16
        product where the exact path runs two or three: gemv.py, fp8_mma.py, moe.py); "none" (the default) keeps
        them exact."""
        if quantization not in ("none", "bf16"):
            raise ValueError(f"cuda.compute-quantization {quantization!r}: the cuda backend takes none or bf16")
        self.activations = "bf16" if quantization == "bf16" else "f32"

    def configure_attention_quantization(self, quantization: str) -> None:
        if quantization not in ("none", "fp8"):
            raise ValueError(f"attention.compute-quantization {quantization!r}: the cuda backend takes none or fp8")
        if quantization == "fp8":
            from . import flash

            with self.dev:
                problem = flash.fp8_check()
            if problem is not None:
                from lumen_core.errors import ConfigError

                raise ConfigError("model.attention.compute-quantization", f"fp8 attention on {self.device}: {problem}",
                                  'set compute-quantization to "default" (the fp8 KV cache still halves the cache '
                                  "memory)")
        self.fp8_attention = quantization == "fp8"

    def weight(self, array, fmt: str, store: str, scale=None, shape=None) -> Weight:
        w = self._weight(array, fmt, store, scale, shape)
        w.activations = self.activations
        return w

    def _weight(self, array, fmt: str, store: str, scale=None, shape=None) -> Weight:
        if is_gguf_block(fmt):
            array, fmt = dequantized_bf16(array, fmt, shape), "bf16"
        if store == "ram":
            return self._host_weight(array, fmt, scale, shape)
        if store != "vram":
            raise ValueError(f"the cuda backend computes from store 'vram' (and 'ram' for routed experts), "
                             f"not {store!r}")
        if fmt == "fp8":
            return self._fp8(array, scale, shape)
        if fmt == "nvfp4":
            return self._nvfp4(array, scale, shape)
        if scale is not None or fmt not in UPLOAD:
            raise NotImplementedError(
                f"weight format {fmt!r} is not yet supported on cuda (f32, f16, bf16, fp8, nvfp4 are)")
        host = np.ascontiguousarray(array).view(UPLOAD[fmt]) if fmt == "bf16" else np.asarray(array, UPLOAD[fmt])
        with self.dev:
            data = self.cp.asarray(host)
        return Weight(data, fmt, tuple(shape or host.shape), store="vram")

    def _host_weight(self, array, fmt: str, scale, shape) -> Weight:
        """A matrix in page-locked host memory (this backend's arena, lumen_cuda.pinned: what the plan counts, within
        the bound pinned.py gives), laid out as its VRAM upload would be: a routed expert's is staged into the
        backend's expert cache when a token routes to it (stream.py), other weights are read over PCIe
        (hostweights.py)."""
        pinned = self.arena.copy
        if fmt == "fp8":
            host = np.ascontiguousarray(array)
            shape = tuple(shape or host.shape)
            s = np.ones(1, np.float32) if scale is None else np.ascontiguousarray(scale, dtype=np.float32)
            return Weight(pinned(host.view(np.uint8)), "fp8", shape, pinned(s), scale_block(shape, s.shape),
                          store="ram")
        if fmt == "nvfp4":
            host, bhost, shape, gs = self._nvfp4_parts(array, scale, shape)
            return Weight(pinned(host), "nvfp4", shape, NVFP4Scale(pinned(bhost), gs), (1, NVFP4_GROUP), store="ram")
        if scale is not None or fmt not in UPLOAD:
            raise NotImplementedError(
                f"weight format {fmt!r} is not yet supported on cuda (f32, f16, bf16, fp8, nvfp4 are)")
        host = np.ascontiguousarray(array).view(UPLOAD[fmt]) if fmt == "bf16" else np.asarray(array, UPLOAD[fmt])
        return Weight(pinned(host), fmt, tuple(shape or host.shape), store="ram")

    def _fp8(self, array, scale, shape) -> Weight:
        """e4m3 bytes (uint8) and the f32 scale (its checkpoint shape) in VRAM; the block as the CPU infers it."""
        host = np.ascontiguousarray(array)
        if host.dtype.itemsize != 1:
            raise ValueError(f"fp8 weight of dtype {host.dtype}: expected 1-byte e4m3 values")
        shape = tuple(shape or host.shape)
        s = np.ones(1, np.float32) if scale is None else np.ascontiguousarray(scale, dtype=np.float32)
        with self.dev:
            data, s_dev = self.cp.asarray(host.view(np.uint8)), self.cp.asarray(s)
        return Weight(data, "fp8", shape, s_dev, scale_block(shape, s.shape), store="vram")

    @staticmethod
    def _nvfp4_parts(array, scale, shape):
        """(packed codes (N, K/2) uint8, e4m3 block scales (N, K/16) uint8, shape, f32 global scale), checked."""
        if scale is None:
            raise ValueError("an nvfp4 weight needs its (block scales, global scale)")
        block, global_scale = scale
        host = np.ascontiguousarray(array)
        bhost = np.ascontiguousarray(block)
        shape = tuple(shape or (host.shape[0], host.shape[1] * 2))
        n, k = shape
        if host.dtype != np.uint8 or host.shape != (n, k // 2) or bhost.dtype.itemsize != 1 or \
                bhost.shape != (n, k // NVFP4_GROUP) or k % NVFP4_GROUP:
            raise ValueError(f"nvfp4 weight {host.dtype} {host.shape} with scales {bhost.shape} does not make {shape}")
        return host, bhost.view(np.uint8), shape, np.float32(np.asarray(global_scale, np.float32).reshape(()))

    def _nvfp4(self, array, scale, shape) -> Weight:
        """Packed E2M1 bytes (N, K/2), low nibble first; scale = (e4m3 block scales (N, K/16), f32 global)."""
        host, bhost, shape, gs = self._nvfp4_parts(array, scale, shape)
        with self.dev:
            data, bdev = self.cp.asarray(host), self.cp.asarray(bhost)
        return Weight(data, "nvfp4", shape, NVFP4Scale(bdev, gs), (1, NVFP4_GROUP), store="vram")

    def decode_runner(self, model, context_size: int):
        """The model's decode step captured as a CUDA graph (lumen_cuda.graph). Raises NotImplementedError with the
        reason where the step cannot be captured (the engine then decodes op by op), or where LUMEN_CUDA_GRAPH=0."""
        if os.environ.get("LUMEN_CUDA_GRAPH", "1") == "0":
            raise NotImplementedError("CUDA graphs are off (LUMEN_CUDA_GRAPH=0)")
        from .decode import gdn_decode
        from .flash import mode as flash_mode
        from .fp8_mma_model import requested, slot_block
        from .fuse_plan import partial_fusion
        from .graph import decode_runner
        from .hostcall import mode, timeout_ns
        from .kernels import decode_fusion, pdl_enabled
        from .moe import down_split, gate_up_blocks, route_in_experts

        # a bad LUMEN_HOSTCALL / LUMEN_HOSTCALL_TIMEOUT / LUMEN_CUDA_MMA_PREFILL / LUMEN_CUDA_X3_SLOTS /
        # LUMEN_CUDA_DECODE_FUSION / LUMEN_CUDA_PDL / LUMEN_CUDA_FLASH / LUMEN_CUDA_PARTIAL_FUSION /
        # LUMEN_CUDA_ROUTE_IN_EXPERTS / LUMEN_CUDA_MOE_GATE_UP_BLOCKS / LUMEN_CUDA_GDN_DECODE /
        # LUMEN_CUDA_MOE_DOWN_SPLIT is named here, at load, not mid-prompt
        mode(), timeout_ns(), requested(os.environ), slot_block(os.environ), decode_fusion(), pdl_enabled()
        flash_mode(), partial_fusion(), route_in_experts(), gate_up_blocks(), gdn_decode(), down_split()
        runner, why = decode_runner(model, self, context_size)
        if runner is None:
            raise NotImplementedError(why)
        self._runners.add(runner)
        return runner

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

    def call(self, target, fn, *args):
        from . import step

        current = step.current()
        if current is None or target is self or target.name not in self.graph_guests:
            return super().call(target, fn, *args)
        from . import hostcall  # a decode step being prepared: the crossing becomes nodes of the graph

        self.dev.use()
        return hostcall.call(fn, list(args), current, target, self)

    def use(self) -> None:
        self.dev.use()

    def take(self, x):
        # Each component's first call on this device: make it current, so the tensor arithmetic the
        # architecture does between ops (x + y) runs here too when several GPUs are in one plan.
        self.use()
        if self.owns(x):
            return x
        if isinstance(x, self.cp.ndarray):  # another GPU: a peer copy
            with self.dev:
                return x.copy()
        return super().take(x)


class _BackendOpSet(OpSet):
    """A CUDABackend's op set: an op registered with a ``bind`` attribute (lumen_cuda/__init__.py: the MoE expert
    ops, which stream host-RAM experts through this backend's cache) is bound to this backend instance when first
    resolved, so it reaches the backend's state without any module-level lookup. Other ops resolve as in OpSet."""

    def __getattr__(self, op: str):
        if op.startswith("_"):
            raise AttributeError(op)
        from lumen_core.ops import COMPOSITES

        if op in COMPOSITES and not self.has(op):
            return super().__getattr__(op)
        bound = _BindingOp(self._backend, op)
        setattr(self, op, bound)
        return bound


class _BindingOp(_BoundOp):
    __slots__ = ()

    def resolve(self, variant: str | None):
        fn = self.fns.get(variant)
        if fn is None:
            fn = super().resolve(variant)
            bind = getattr(fn, "bind", None)
            if bind is not None:
                fn = self.fns[variant] = bind(self.backend)
        return fn
