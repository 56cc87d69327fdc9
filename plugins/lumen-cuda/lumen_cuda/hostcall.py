"""Host calls inside a captured decode step: routed experts on the CPU without leaving the CUDA graph.

``experts: {compute: cpu}`` under a GPU model crosses to the host and back in every MoE layer. Op by op, each
crossing is a host sync and the GPU part of the layer is dispatched from Python, which at 40 layers costs more
than the experts themselves (docs/cuda.md, Step 5). While a decode step is prepared for a CUDA graph
(lumen_cuda.step), ``CUDABackend.call`` instead queues, on the capturing stream (the Python host-node path; by
default a crossing that is one native job takes the mailbox path instead, "Native crossings" below):

1. device-to-host copies of the arguments (hidden states, expert ids, weights) into fixed page-locked buffers,
2. a host node (``cuLaunchHostFunc``) that runs the CPU function on numpy views of those buffers and writes its
   result into a fixed page-locked output buffer,
3. a host-to-device copy of that output into a device array, which the rest of the step reads.

All three become nodes of the graph, so a replay runs the CPU experts at their place in the step with no Python
dispatch around them; only the callback itself is Python (numba kernels inside). The buffers belong to the
``HostCall`` objects the step's ``StepInputs.host_calls`` keeps alive as long as the graph.

Threads: CUDA runs host nodes on a driver thread, which takes the GIL through ctypes. The main thread waits for
the GPU only in calls that release the GIL (CuPy's stream / event synchronize and memcpy), so the node can run.
A host node must not call CUDA; the CPU backend's ops do not. An exception in a node cannot stop the graph: it is
kept with its step and raised by ``raise_pending`` (the runner calls it after each step it waits for).

Process-wide, on purpose: CUDA calls one C entry point (``_TRAMPOLINE``) with an integer, so the integer must lead
to the ``HostCall``: ``_CALLS`` maps keys (from a counter, never reused, unlike ``id()``) to **weak** references.
It owns nothing (each HostCall belongs to its runner's step and leaves the map when that step is dropped), so two
engines' host calls never meet; ``_driver`` is the CUDA driver library, loaded once.

**Native crossings** (the default; docs/cuda.md "Native CPU-expert crossings"). When the target
backend offers ``host_jobs`` (lumen_cpu.hostjob) and ``fn`` is exactly one of its native jobs (one token's fp8 /
NVFP4 routed experts), the crossing skips the host node, the driver thread and Python altogether: ``NativeCall``
queues two kernels (kernels/hostcall.cu) around a mailbox in page-locked host memory that this GPU reads and writes
directly. ``hostcall_post`` writes the token and the job number, the backend's server threads
(lumen_cpu/_native_serve.c, spinning while a step is in flight: the runner arms them with the step's number of jobs
before each replay) run the experts and answer, and ``hostcall_wait`` polls the answer and copies it back.
``LUMEN_HOSTCALL``: ``native`` (default; a crossing that is not one native job stays a Python host node),
``python`` (every crossing a Python host node, as above), or ``node`` (the same server asked from a host node's C
function, no Python). A wait that passes ``LUMEN_HOSTCALL_TIMEOUT`` seconds
(default 60: a first touch of mmap'd experts can be slow) gives up, and the step raises on the host (``check``).
"""

from __future__ import annotations

import ctypes
import itertools
import os
import sys
import weakref

import cupy as cp
import numpy as np

from . import kernels
from .step import NotCapturable

_HOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_CALLS: weakref.WeakValueDictionary[int, HostCall] = weakref.WeakValueDictionary()
_KEYS = itertools.count(1)
_driver: list = []


def _trampoline(key) -> None:
    call = _CALLS.get(key or 0)
    if call is None:
        print(f"lumen: a host call ({key}) ran after its decode step was freed", file=sys.stderr)
        return
    try:
        call.run()
    except BaseException as exc:  # noqa: BLE001 - kept and raised on the main thread (raise_pending)
        call.errors.append(exc)


_TRAMPOLINE = _HOST_FN(_trampoline)  # one C entry point for every host call; lives as long as the module


def _launch_host_func(stream_ptr: int, key: int, fn=None) -> None:
    """cuLaunchHostFunc on the stream: ``fn`` (a C function's address; default the Python trampoline) with ``key``."""
    if not _driver:
        lib = None
        for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
            try:
                lib = ctypes.CDLL(name)
                break
            except OSError:
                continue
        if lib is None:
            raise NotCapturable("the CUDA driver library (libcuda) was not found, so host calls cannot be captured")
        lib.cuLaunchHostFunc.argtypes = [ctypes.c_void_p, _HOST_FN, ctypes.c_void_p]
        lib.cuLaunchHostFunc.restype = ctypes.c_int
        _driver.append(lib)
    rc = _driver[0].cuLaunchHostFunc(ctypes.c_void_p(stream_ptr), _TRAMPOLINE if fn is None else _HOST_FN(fn),
                                     ctypes.c_void_p(key))
    if rc:
        raise RuntimeError(f"cuLaunchHostFunc failed (CUresult {rc})")


def _pinned(shape, dtype, keep: list) -> np.ndarray:
    """A numpy array of ``shape`` in page-locked memory (the allocation appended to ``keep``)."""
    dtype, count = np.dtype(dtype), int(np.prod(shape))
    mem = cp.cuda.alloc_pinned_memory(max(count * dtype.itemsize, 1))
    keep.append(mem)
    return np.frombuffer(mem, dtype=dtype, count=count).reshape(shape)


class HostCall:
    """One crossing of a captured step: fixed page-locked buffers and the host function between them."""

    def __init__(self, fn, args: list[cp.ndarray], errors: list, target=None):
        self.fn, self.errors, self._memory, self.target = fn, errors, [], target  # target: the backend fn computes on
        self.inputs = [_pinned(a.shape, a.dtype, self._memory) for a in args]
        self.output = _pinned(args[0].shape, args[0].dtype, self._memory)
        self.key = next(_KEYS)
        _CALLS[self.key] = self

    def queue(self, args: list[cp.ndarray]) -> cp.ndarray:
        """Queue the copies out, the host node and the copy back on the current stream; the device result."""
        stream = cp.cuda.get_current_stream().ptr
        for a, host in zip(args, self.inputs, strict=True):
            a = cp.ascontiguousarray(a)
            cp.cuda.runtime.memcpyAsync(host.ctypes.data, a.data.ptr, a.nbytes,
                                        cp.cuda.runtime.memcpyDeviceToHost, stream)
        _launch_host_func(stream, self.key)
        out = cp.empty(self.output.shape, self.output.dtype)
        cp.cuda.runtime.memcpyAsync(out.data.ptr, self.output.ctypes.data, out.nbytes,
                                    cp.cuda.runtime.memcpyHostToDevice, stream)
        return out

    def run(self) -> None:
        """The host node's body (a CUDA driver thread)."""
        result = np.asarray(self.fn(*self.inputs))
        if result.shape != self.output.shape:
            raise ValueError(f"a host call returned shape {result.shape}; the step expects {self.output.shape}")
        np.copyto(self.output, result, casting="same_kind")


MODES = ("native", "node", "python")  # LUMEN_HOSTCALL (module docstring)


def mode() -> str:
    value = os.environ.get("LUMEN_HOSTCALL", "native")
    if value not in MODES:
        from lumen_core.errors import LumenError

        raise LumenError(f"LUMEN_HOSTCALL={value!r}: expected one of {', '.join(MODES)} (or leave it unset: "
                         "native)")
    return value


def timeout_ns() -> int:
    raw = os.environ.get("LUMEN_HOSTCALL_TIMEOUT", "60")
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        from lumen_core.errors import LumenError

        raise LumenError(f"LUMEN_HOSTCALL_TIMEOUT={raw!r}: expected seconds > 0 (default 60), or leave it unset")
    return int(value * 1e9)


class _Mailbox:
    """A native server of one target backend, with its mailbox in page-locked memory (owned here)."""

    def __init__(self, service, threads: int):
        self.layout = service.layout()
        self.memory = cp.cuda.alloc_pinned_memory(self.layout["bytes"])
        self.words = np.frombuffer(self.memory, np.uint64, count=self.layout["bytes"] // 8)
        self.words[:] = 0
        self.address = self.words.ctypes.data
        self.server = service.Server(self.address, self.memory, threads)
        self.jobs: dict = {}  # job key -> number

    def job(self, job) -> int | None:
        key = (job[0], *job[1:2], *job[4:])  # the layer (an object: hashed as itself), format, act, shapes
        if key not in self.jobs:
            self.jobs[key] = self.server.add(job)
        return self.jobs[key]

    def errors(self) -> tuple[int, int]:
        """(the server's unknown-job answers, the GPU's timeouts) since the last reset; resets them."""
        cpu, gpu = int(self.words[9]), int(self.words[10])
        if cpu or gpu:
            self.words[9] = self.words[10] = 0
        return cpu, gpu


def _mailbox(owner, target, service, threads: int) -> _Mailbox:
    boxes = owner.__dict__.setdefault("_mailboxes", weakref.WeakKeyDictionary())  # target backend -> _Mailbox
    box = boxes.get(target)
    if box is None:
        box = boxes[target] = _Mailbox(service, threads)
    return box


class NativeCall:
    """One crossing of a captured step served by a target backend's native threads (module docstring)."""

    def __init__(self, box: _Mailbox, index: int, target, how: str):
        self.box, self.index, self.target, self.how = box, index, target, how
        self.server = box.server
        self.seq = cp.zeros((1,), cp.uint64)

    @staticmethod
    def make(owner, target, fn, args: list[cp.ndarray], how: str):
        """The NativeCall for ``fn(*args)``, or None where it is not one native job."""
        service = target.host_jobs() if target is not None else None
        if service is None or len(args) != 3 or args[0].ndim != 2 or args[0].shape[0] != 1:
            return None
        shapes = [(tuple(a.shape), np.dtype(a.dtype)) for a in args]
        try:
            job = service.record(fn, shapes)
        except Exception as exc:  # fn on zeros failed: the Python host node runs it (and raises what it meets there)
            print(f"lumen: a CPU crossing stays a Python host node ({exc!r})", file=sys.stderr)
            return None
        if job is None:
            return None
        box = _mailbox(owner, target, service, service.server_threads(job[7]))
        index = box.job(job)
        return None if index is None else NativeCall(box, index, target, how)

    def queue(self, args: list[cp.ndarray]) -> cp.ndarray:
        x = cp.ascontiguousarray(args[0], dtype=cp.float32).reshape(-1)
        ids = cp.ascontiguousarray(args[1], dtype=cp.int64).reshape(-1)
        wts = cp.ascontiguousarray(args[2], dtype=cp.float32).reshape(-1)
        H, k, lay, mb = x.size, ids.size, self.box.layout, self.box.address
        out = cp.empty((1, H), cp.float32)
        stream = cp.cuda.get_current_stream()
        eager = not stream.is_capturing()
        if eager:  # a warm-up: the server is not armed by a replay
            self.server.arm(1)
        if self.how == "native":
            kernels.function("hostcall", "hostcall_post")(
                (1,), (256,), (x, ids, wts, np.int32(H), np.int32(k), np.uint64(mb), np.int64(lay["x"]),
                               np.int64(lay["ids"]), np.int64(lay["wts"]), np.int64(self.index), self.seq))
            kernels.function("hostcall", "hostcall_wait")(
                (1,), (256,), (np.uint64(mb), self.seq, out, np.int32(H), np.int64(lay["out"]),
                               np.uint64(timeout_ns())))
            return out
        for a, off in ((x, "x"), (ids, "ids"), (wts, "wts")):
            cp.cuda.runtime.memcpyAsync(mb + lay[off], a.data.ptr, a.nbytes, cp.cuda.runtime.memcpyDeviceToHost,
                                        stream.ptr)
        _launch_host_func(stream.ptr, self.server.job_address(self.index), self.server.hostfn())
        cp.cuda.runtime.memcpyAsync(out.data.ptr, mb + lay["out"], out.nbytes, cp.cuda.runtime.memcpyHostToDevice,
                                    stream.ptr)
        return out


def call(fn, args, step, target=None, owner=None) -> cp.ndarray:
    """``fn`` on numpy views of ``args`` as nodes of the step being prepared (``step.StepInputs``, which keeps
    the HostCall and collects its errors; see the module docstring). ``target``: the backend ``fn`` computes on
    (its ``release_threads`` is called on the launching thread before each replay); ``owner``: the GPU backend
    (it keeps the native servers of its targets)."""
    args = [a if isinstance(a, cp.ndarray) else cp.asarray(a) for a in args]
    how = mode()
    if how != "python" and owner is not None:
        nc = NativeCall.make(owner, target, fn, args, how)
        if nc is not None:
            step.host_calls.append(nc)
            return nc.queue(args)
    hc = HostCall(fn, args, step.host_errors, target)
    step.host_calls.append(hc)
    return hc.queue(args)


def arm(calls: list) -> None:
    """Before a replay: tell each native server how many jobs the step will ask of it."""
    counts: dict = {}  # server -> jobs
    for c in calls:
        if isinstance(c, NativeCall):
            counts[c.server] = counts.get(c.server, 0) + 1
    for server, n in counts.items():
        server.arm(n)


def check(step) -> None:
    """Raise what the step's crossings met since the last check: Python host nodes' exceptions (raise_pending),
    a native server's answer to an unknown job, a GPU wait that timed out."""
    raise_pending(step.host_errors)
    seen = set()
    for c in step.host_calls:
        if isinstance(c, NativeCall) and c.box not in seen:
            seen.add(c.box)
            cpu, gpu = c.box.errors()
            if gpu:
                raise RuntimeError(f"the CPU experts did not answer a captured decode step within "
                                   f"{timeout_ns() / 1e9:g} s ({gpu} time(s)); that step's output is wrong. "
                                   "Raise LUMEN_HOSTCALL_TIMEOUT if the experts are slow to load (mmap on a slow "
                                   "disk), or set LUMEN_HOSTCALL=python")
            if cpu:
                raise RuntimeError(f"the CPU experts server was asked an unknown job ({cpu} time(s))")


def raise_pending(pending: list) -> None:
    """Raise the first exception the host nodes of a step met since the last check (the others go to stderr)."""
    if pending:
        errors = list(pending)
        pending.clear()
        for extra in errors[1:]:
            print(f"lumen: a further host-call error: {extra!r}", file=sys.stderr)
        raise RuntimeError(f"the CPU part of a captured decode step failed: {errors[0]!r}") from errors[0]
