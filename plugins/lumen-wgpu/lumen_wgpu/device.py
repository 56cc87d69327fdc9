"""Adapters, devices and the command recorder: everything that talks to wgpu-py.

One ``Context`` per adapter per engine backend instance (principle 6: state belongs to the backend object). It owns
the wgpu device, the compiled pipelines, a pool of reusable activation buffers and the **recorder**: every op
appends its compute dispatches to one open command encoder, and nothing is submitted until a value is read back
(``read``) or the parameter ring fills. A decode step is therefore one command buffer, submitted once, with only
the values the host asks for (the logits row, or the sampled token) copied back.

Ordering: WebGPU runs a queue's work in order and puts a barrier between dispatches that touch one storage buffer,
so a pooled buffer freed by Python while the recorded commands still use it may be handed to a later dispatch of
the same recording. Host data reaches the device only through copies recorded in the same encoder (``upload``),
never ``queue.write_buffer`` into a buffer the recording already uses; the one exception is the parameter ring,
written once just before its recording is submitted.
"""

from __future__ import annotations

import os
import struct
import threading

import numpy as np

from lumen_core.errors import PlanError

ALIGN = 4  # storage buffers hold whole 32-bit words
PARAM_BYTES = 256  # the uniform block every kernel's params fit in (64 words)
RING_BYTES = 4 << 20  # parameter ring: about 16k dispatches a command buffer
WANTED_FEATURES = ("shader-f16", "subgroup")
_LIMITS = ("max-storage-buffer-binding-size", "max-buffer-size", "max-compute-workgroup-storage-size",
           "max-storage-buffers-per-shader-stage", "max-compute-invocations-per-workgroup",
           "max-compute-workgroup-size-x", "max-compute-workgroups-per-dimension")


def wgpu_module():
    """wgpu-py, imported on first use (importing the plugin must not touch a driver)."""
    os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")  # else every Vulkan call prints a harmless error line
    import wgpu

    return wgpu


_ADAPTERS: list | None = None
_ADAPTERS_ERROR: list[str] = []  # why enumerating failed (wgpu-py not importable, no loader), if it did
_ADAPTERS_LOCK = threading.Lock()


def adapters() -> list:
    """The adapters wgpu finds, in a stable order: ``wgpu:N`` is the N-th. Vulkan, Metal and DX12 adapters are
    listed; OpenGL ones are not (wgpu's GL backend lacks the storage-buffer sizes Lumen needs)."""
    global _ADAPTERS
    with _ADAPTERS_LOCK:
        if _ADAPTERS is None:
            try:
                wgpu = wgpu_module()
                found = wgpu.gpu.enumerate_adapters_sync()
            except Exception as exc:  # no wgpu-py (or its cffi), no loader, no driver: no device (adapters_error)
                found = []
                _ADAPTERS_ERROR.append(f"{type(exc).__name__}: {exc}")
            _ADAPTERS = [a for a in found if a.info.get("backend_type") in ("Vulkan", "Metal", "D3D12")]
        return _ADAPTERS


def adapters_error() -> str | None:
    """Why ``adapters()`` found none because wgpu-py failed (an import or loader error), or None."""
    adapters()
    return _ADAPTERS_ERROR[0] if _ADAPTERS_ERROR else None


def adapter_summary(adapter) -> str:
    info, limits = adapter.info, adapter.limits
    feats = ", ".join(f for f in WANTED_FEATURES if f in adapter.features) or "none of " + "/".join(WANTED_FEATURES)
    return (f"{info.get('device', '?')} ({info.get('backend_type', '?')}, {info.get('adapter_type', '?')}); max "
            f"storage binding {limits['max-storage-buffer-binding-size'] >> 20} MiB, max buffer "
            f"{limits['max-buffer-size'] >> 20} MiB; features: {feats}")


def adapter_memory(adapter) -> int:
    """Bytes the plan may count on: the host's RAM for CPU and integrated adapters (they share it); 0 (unknown:
    the plan shows the pool but does not check it) for discrete GPUs, whose VRAM size WebGPU does not report."""
    if adapter.info.get("adapter_type") in ("CPU", "IntegratedGPU"):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return 0


class Buffer:
    """A GPU buffer handed out by the pool; returns to it when the last tensor viewing it is gone."""

    __slots__ = ("gpu", "size", "ctx", "__weakref__")

    def __init__(self, gpu, size: int, ctx):
        self.gpu, self.size, self.ctx = gpu, size, ctx

    def __del__(self):
        ctx = self.ctx
        if ctx is not None and not ctx.closed:
            holder = ctx._held.get(id(self.gpu))
            if holder is not None:  # a kept decode step reads it: free it when that capture is released
                holder.orphans.append((self.size, self.gpu))
            else:
                ctx._free.setdefault(self.size, []).append(self.gpu)


def size_class(nbytes: int) -> int:
    """Pool sizes: 256 B, then 2^k and 1.5 x 2^k (at most a third wasted)."""
    n = max(256, nbytes)
    p = 1 << (n - 1).bit_length()
    return p * 3 // 4 if n <= p * 3 // 4 and p >= 1024 else p


class Kernel:
    """A compiled compute pipeline with an explicit layout: storage bindings 0..n-1 (``access`` per binding: 'r'
    read-only, 'w' read-write), then one uniform block of params at binding n, bound at a dynamic offset."""

    def __init__(self, ctx, name: str, code: str, access: str):
        wgpu = wgpu_module()
        self.name, self.access = name, access
        entries = [{"binding": i, "visibility": wgpu.ShaderStage.COMPUTE,
                    "buffer": {"type": wgpu.BufferBindingType.read_only_storage if a == "r"
                               else wgpu.BufferBindingType.storage}} for i, a in enumerate(access)]
        entries.append({"binding": len(access), "visibility": wgpu.ShaderStage.COMPUTE,
                        "buffer": {"type": wgpu.BufferBindingType.uniform, "has_dynamic_offset": True,
                                   "min_binding_size": PARAM_BYTES}})
        dev = ctx.device
        self.layout = dev.create_bind_group_layout(entries=entries)
        try:
            module = dev.create_shader_module(code=code, label=name)
            self.pipeline = dev.create_compute_pipeline(
                layout=dev.create_pipeline_layout(bind_group_layouts=[self.layout]),
                compute={"module": module, "entry_point": "main"}, label=name)
        except Exception as exc:
            raise RuntimeError(f"wgpu kernel {name!r} failed to compile: {exc}\n--- source ---\n{code}") from None


class Capture:
    """One recorded decode step, kept to be issued again by ``Context.replay`` (the wgpu analogue of a CUDA graph:
    WebGPU cannot resubmit a command buffer, so the dispatches are re-encoded from this list, without the Python of
    the ops that made them).

    ``records``: ("upload", gpu buffer, data, dynamic) and ("dispatch", kernel, bind group, params, groups,
    dynamic). ``dynamic`` is None for a record that is the same every step, else a function of the step's inputs
    (``{"delta": positions since the capture, "token": the new token}``) returning the upload's bytes or the
    dispatch's (params, groups): what depends on the position (attention's key count, the rope tables) or on the
    token. Every buffer a record uses stays out of the pool until ``Context.release``."""

    def __init__(self):
        self.records: list = []
        self.buffers: dict[int, object] = {}  # id -> gpu buffer the records use
        self.orphans: list = []  # (size class, gpu buffer) whose tensors died while held
        self._uploads = self._steps = None

    @property
    def dispatches(self) -> int:
        return sum(1 for r in self.records if r[0] == "dispatch")

    @property
    def uploads(self) -> list:
        """The upload records, in order (replay writes them all before its dispatches)."""
        if self._uploads is None:
            self._uploads = [r for r in self.records if r[0] == "upload"]
        return self._uploads

    @property
    def steps(self) -> list:
        """(kernel, bind group, params, groups, dynamic) of each dispatch record, in order."""
        if self._steps is None:
            self._steps = [r[1:] for r in self.records if r[0] == "dispatch"]
        return self._steps


class Context:
    """One wgpu device: pipelines, buffer pool, recorder."""

    def __init__(self, index: int):
        found = adapters()
        if index >= len(found):
            why = adapters_error()
            raise PlanError(f"device 'wgpu:{index}' does not exist on this machine ({len(found)} wgpu adapter(s)"
                            + (f"; wgpu-py failed: {why})" if why else ")"))
        self.adapter = found[index]
        self.index = index
        feats = [f for f in WANTED_FEATURES if f in self.adapter.features]
        limits = {k: self.adapter.limits[k] for k in _LIMITS}
        self.device = self.adapter.request_device_sync(required_features=feats, required_limits=limits,
                                                       label=f"lumen wgpu:{index}")
        self.features = frozenset(feats)
        self.limits = limits
        self.max_binding = int(limits["max-storage-buffer-binding-size"]) // 16 * 16
        self.max_groups = int(limits["max-compute-workgroups-per-dimension"])
        align = int(self.adapter.limits["min-uniform-buffer-offset-alignment"])
        self.param_align = max(align, 16)
        self.closed = False
        self._free: dict[int, list] = {}
        self._kernels: dict = {}
        self._bind_groups: dict = {}
        wgpu = wgpu_module()
        self._usage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST
        self._ring = self.device.create_buffer(size=RING_BYTES + PARAM_BYTES,
                                               usage=wgpu.BufferUsage.UNIFORM | wgpu.BufferUsage.COPY_DST)
        self._fence = self.device.create_buffer(size=16, usage=self._usage)
        self._params = bytearray()
        self._encoder = None
        self._pass = None
        self.dispatches = 0  # recorded since the context was made (tests and benchmarks read it)
        self.submits = 0
        self._capture: Capture | None = None  # the step being captured
        self._held: dict[int, Capture] = {}  # gpu buffer id -> the kept capture that uses it
        self.lock = threading.RLock()

    # -- memory -----------------------------------------------------------------------------------------------
    def alloc(self, nbytes: int) -> Buffer:
        """A pooled buffer of at least ``nbytes`` (contents undefined)."""
        size = size_class(nbytes)
        if size > self.max_binding:
            raise PlanError(f"a {nbytes >> 20} MiB activation does not fit the adapter's largest storage binding "
                            f"({self.max_binding >> 20} MiB): use a shorter prompt chunk or another device")
        free = self._free.get(size)
        gpu = free.pop() if free else self.device.create_buffer(size=size, usage=self._usage)
        return Buffer(gpu, size, self)

    def upload(self, data: bytes | np.ndarray, dynamic=None) -> Buffer:
        """A pooled buffer holding ``data``, copied in by a command recorded in order with the ops around it.
        ``dynamic``: while a step is captured, how the data changes from step to step (see ``Capture``)."""
        raw = memoryview(np.ascontiguousarray(data)).cast("B") if isinstance(data, np.ndarray) else memoryview(data)
        n = (len(raw) + ALIGN - 1) // ALIGN * ALIGN
        buf = self.alloc(n)
        if n == 0:
            return buf
        if self._capture is not None:
            self._capture.records.append(("upload", buf.gpu, bytes(raw), dynamic))
            self._hold(buf.gpu)
        wgpu = wgpu_module()
        if len(raw) != n:
            raw = memoryview(bytes(raw) + b"\0" * (n - len(raw)))
        staging = self.device.create_buffer(size=n, usage=wgpu.BufferUsage.COPY_SRC, mapped_at_creation=True)
        staging.write_mapped(raw)
        staging.unmap()
        self._end_pass()
        self._encoder_now().copy_buffer_to_buffer(staging, 0, buf.gpu, 0, n)
        return buf

    def weight_buffer(self, data: np.ndarray):
        """A dedicated (not pooled) buffer holding ``data`` (weights: uploaded once, never written again)."""
        raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        if raw.size % ALIGN:
            raw = np.concatenate([raw, np.zeros(ALIGN - raw.size % ALIGN, np.uint8)])
        if raw.size == 0:
            raw = np.zeros(ALIGN, np.uint8)
        return self.device.create_buffer_with_data(data=raw, usage=self._usage)

    # -- kernels ----------------------------------------------------------------------------------------------
    def kernel(self, name: str, code: str, access: str) -> Kernel:
        key = (name, code)
        k = self._kernels.get(key)
        if k is None:
            k = self._kernels[key] = Kernel(self, name, code, access)
        return k

    def dispatch(self, kernel: Kernel, buffers, params: bytes, groups, dynamic=None) -> None:
        """Record ``kernel`` over ``groups`` (x, y, z) workgroups with storage ``buffers`` (wgpu buffers, in
        binding order) and ``params`` (at most PARAM_BYTES) in its uniform block. ``dynamic``: while a step is
        captured, ``inputs -> (params, groups)`` for a later step (see ``Capture``), where they depend on the
        position or the token."""
        gx, gy, gz = (tuple(groups) + (1, 1))[:3]
        if (gx == 0 or gy == 0 or gz == 0) and (self._capture is None or dynamic is None):
            return
        if max(gx, gy, gz) > self.max_groups:
            raise ValueError(f"kernel {kernel.name}: {gx}x{gy}x{gz} workgroups exceed the adapter's "
                             f"{self.max_groups} a dimension")
        if len(self._params) + PARAM_BYTES > RING_BYTES:
            self.flush()
        offset = len(self._params)
        self._params += params
        pad = -len(self._params) % self.param_align
        self._params += b"\0" * pad
        key = (id(kernel.layout),) + tuple(id(b) for b in buffers)
        bg = self._bind_groups.get(key)
        if bg is None:
            if len(self._bind_groups) > 20000:
                self._bind_groups.clear()
            entries = [{"binding": i, "resource": {"buffer": b}} for i, b in enumerate(buffers)]
            entries.append({"binding": len(buffers), "resource": {"buffer": self._ring, "offset": 0,
                                                                   "size": PARAM_BYTES}})
            bg = self._bind_groups[key] = (self.device.create_bind_group(layout=kernel.layout, entries=entries),
                                           buffers)
        if self._capture is not None:
            self._capture.records.append(("dispatch", kernel, bg[0], bytes(params), (gx, gy, gz), dynamic))
            for b in buffers:
                self._hold(b)
        if gx == 0 or gy == 0 or gz == 0:
            return
        p = self._pass_now()
        p.set_pipeline(kernel.pipeline)
        p.set_bind_group(0, bg[0], [offset])
        p.dispatch_workgroups(gx, gy, gz)
        self.dispatches += 1

    # -- captured steps -----------------------------------------------------------------------------------------
    def begin_capture(self) -> None:
        """Record what follows (one decode step) as a ``Capture`` too; what was recorded before is submitted."""
        self.flush()
        self._capture = Capture()

    def end_capture(self) -> Capture:
        cap, self._capture = self._capture, None
        return cap

    def _hold(self, gpu) -> None:
        if id(gpu) not in self._capture.buffers:
            self._capture.buffers[id(gpu)] = gpu
            self._held[id(gpu)] = self._capture

    def release(self, cap: Capture) -> None:
        """The capture will not be replayed again: its buffers go back to the pool."""
        for key in cap.buffers:
            if self._held.get(key) is cap:
                del self._held[key]
        for size, gpu in cap.orphans:
            self._free.setdefault(size, []).append(gpu)
        cap.orphans, cap.buffers = [], {}

    def replay(self, cap: Capture, inputs: dict, chunk: int = 0) -> None:
        """Issue a captured step again with this step's ``inputs``. Uploads are written first (everything recorded
        before is submitted, so no earlier command still reads them); dispatches are re-encoded, and submitted
        every ``chunk`` dispatches (0: once, at the next read-back), so the device starts on a long step while the
        host still encodes its end. The encoding calls wgpu-native directly where wgpu-py lets it (``_Native``):
        the same commands, without wgpu-py's per-call error capture (they were validated when captured)."""
        self.flush()
        queue = self.device.queue
        for rec in cap.uploads:
            data = rec[2] if rec[3] is None else rec[3](inputs)
            pad = -len(data) % ALIGN
            queue.write_buffer(rec[1], 0, data + b"\0" * pad if pad else data)
        native = _native()
        align = self.param_align
        n = 0
        for kernel, bg, params, groups, dynamic in cap.steps:
            if dynamic is not None:
                params, groups = dynamic(inputs)
                if 0 in groups:
                    continue
            if len(self._params) + PARAM_BYTES > RING_BYTES:
                self.flush()
            offset = len(self._params)
            pad = -len(params) % align
            self._params += (params + b"\0" * pad) if pad else params
            p = self._pass_now()
            if native is not None:
                native.dispatch(p, kernel.pipeline, bg, offset, groups)
            else:
                p.set_pipeline(kernel.pipeline)
                p.set_bind_group(0, bg, [offset])
                p.dispatch_workgroups(*groups)
            n += 1
            if chunk and n % chunk == 0:
                self.flush()
        self.dispatches += n

    def forget(self, gpu_buffer) -> None:
        """Drop cached bind groups that hold ``gpu_buffer`` (before destroying it)."""
        self._bind_groups = {k: v for k, v in self._bind_groups.items()
                             if not any(b is gpu_buffer for b in v[1])}

    # -- recording --------------------------------------------------------------------------------------------
    def _encoder_now(self):
        if self._encoder is None:
            self._encoder = self.device.create_command_encoder()
        return self._encoder

    def _pass_now(self):
        if self._pass is None:
            self._pass = self._encoder_now().begin_compute_pass()
        return self._pass

    def _end_pass(self):
        if self._pass is not None:
            self._pass.end()
            self._pass = None

    def flush(self) -> None:
        """Submit what was recorded (one command buffer)."""
        if self._encoder is None:
            return
        self._end_pass()
        if self._params:
            self.device.queue.write_buffer(self._ring, 0, bytes(self._params))
            self._params = bytearray()
        self.device.queue.submit([self._encoder.finish()])
        self._encoder = None
        self.submits += 1

    def finish(self) -> None:
        """Submit the recording and wait until the device has run everything submitted (benchmarks, close)."""
        self.flush()
        # a 4-byte read-back waits for the queue (wgpu-py 0.32's on_submitted_work_done_sync fails on its native lib)
        self.device.queue.read_buffer(self._fence, 0, 4)

    def read(self, buf, offset: int, nbytes: int) -> bytes:
        """Submit the recording and copy ``nbytes`` at ``offset`` of a buffer back to the host."""
        start = offset // ALIGN * ALIGN
        end = (offset + nbytes + ALIGN - 1) // ALIGN * ALIGN
        self.flush()
        if end == start:
            return b""
        data = self.device.queue.read_buffer(buf, start, end - start)
        return bytes(data[offset - start:offset - start + nbytes])

    def close(self) -> None:
        with self.lock:
            self.closed = True
            self._held.clear()
            self._pass = self._encoder = None
            self._bind_groups.clear()
            self._kernels.clear()
            for bufs in self._free.values():
                for b in bufs:
                    b.destroy()
            self._free.clear()


class _Native:
    """wgpu-native's compute-pass calls, straight through cffi (wgpu-py wraps each in error capture, ~1-4 us a call
    in Python). Only for replaying commands that were already validated when captured."""

    def __init__(self, lib, ffi):
        self.set_pipeline = lib.wgpuComputePassEncoderSetPipeline
        self.set_bind_group = lib.wgpuComputePassEncoderSetBindGroup
        self.dispatch_groups = lib.wgpuComputePassEncoderDispatchWorkgroups
        self.offsets = ffi.new("uint32_t[1]")

    def dispatch(self, p, pipeline, bg, offset: int, groups) -> None:
        handle = p._internal
        self.set_pipeline(handle, pipeline._internal)
        self.offsets[0] = offset
        self.set_bind_group(handle, 0, bg._internal, 1, self.offsets)
        self.dispatch_groups(handle, groups[0], groups[1], groups[2])


_NATIVE: list = []


def _native() -> _Native | None:
    """The direct calls, or None where this wgpu-py does not expose them (then the public methods are used), or
    where LUMEN_WGPU_NATIVE=0."""
    if not _NATIVE:
        found = None
        if os.environ.get("LUMEN_WGPU_NATIVE", "1") != "0":
            try:
                from wgpu.backends.wgpu_native._ffi import ffi, lib

                found = _Native(lib, ffi)
            except Exception:  # another wgpu-py layout: the public API is always there
                found = None
        _NATIVE.append(found)
    return _NATIVE[0]


def pack(*values) -> bytes:
    """Params for a uniform block: Python ints as u32 (i32 when negative), floats as f32, in order."""
    out = bytearray()
    for v in values:
        if isinstance(v, float) or isinstance(v, np.floating):
            out += struct.pack("<f", float(v))
        elif v < 0:
            out += struct.pack("<i", int(v))
        else:
            out += struct.pack("<I", int(v))
    return bytes(out)


