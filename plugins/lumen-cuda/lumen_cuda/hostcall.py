"""Host calls inside a captured decode step: routed experts on the CPU without leaving the CUDA graph.

``experts: {compute: cpu}`` under a GPU model crosses to the host and back in every MoE layer. Op by op, each
crossing is a host sync and the GPU part of the layer is dispatched from Python, which at 40 layers costs more
than the experts themselves (docs/cuda.md, Step 5). While a decode step is prepared for a CUDA graph
(lumen_cuda.step), ``CUDABackend.call`` instead queues, on the capturing stream:

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
"""

from __future__ import annotations

import ctypes
import itertools
import sys
import weakref

import cupy as cp
import numpy as np

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


def _launch_host_func(stream_ptr: int, key: int) -> None:
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
    rc = _driver[0].cuLaunchHostFunc(ctypes.c_void_p(stream_ptr), _TRAMPOLINE, ctypes.c_void_p(key))
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


def call(fn, args, step, target=None) -> cp.ndarray:
    """``fn`` on numpy views of ``args`` as nodes of the step being prepared (``step.StepInputs``, which keeps
    the HostCall and collects its errors; see the module docstring). ``target``: the backend ``fn`` computes on
    (its ``release_threads`` is called on the launching thread before each replay)."""
    args = [a if isinstance(a, cp.ndarray) else cp.asarray(a) for a in args]
    hc = HostCall(fn, args, step.host_errors, target)
    step.host_calls.append(hc)
    return hc.queue(args)


def raise_pending(pending: list) -> None:
    """Raise the first exception the host nodes of a step met since the last check (the others go to stderr)."""
    if pending:
        errors = list(pending)
        pending.clear()
        for extra in errors[1:]:
            print(f"lumen: a further host-call error: {extra!r}", file=sys.stderr)
        raise RuntimeError(f"the CPU part of a captured decode step failed: {errors[0]!r}") from errors[0]
