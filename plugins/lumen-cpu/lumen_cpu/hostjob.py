"""One token's routed experts served to a GPU by native threads (lumen_cpu/_native_serve.c), for captured decode
steps with ``experts: {compute: cpu}`` (lumen_cuda/hostcall.py).

``CPUBackend.native_job(fn, args)`` (lumen_core.Backend's hook) decides whether the host function a GPU step calls
can run without Python: ``record`` runs ``fn`` once on zeros of the arguments' shapes while ``moe_fused._one_token``
records, instead of computing, what it would ask ``native.moe_token``. If ``fn``'s result is exactly that one
call's output (no other work on it), the call is a native job: its format, shapes and weight addresses are
registered with the backend's ``Server``, and the GPU asks for it by number through the server's mailbox. Anything
else (other formats, several calls, arithmetic on the result) returns None and stays a Python host call.

A ``Server`` owns its mailbox (page-locked by the GPU side, which registers it) and its threads; ``close`` stops
the threads. The weights of every job stay referenced by the server as long as it lives.
"""

from __future__ import annotations

import ctypes
import os
import threading

import numpy as np

from . import native

_state = threading.local()


class _Recorder:
    def __init__(self):
        self.calls: list[tuple] = []

    def note(self, layer, fmt: int, gs, blk, act: int, H: int, k: int, threads: int, cgu: int, cd: int, pf: int):
        out = np.zeros((1, H), np.float32)
        self.calls.append((out, (layer, fmt, gs, blk, act, H, k, threads, cgu, cd, pf)))
        return out


def recorder() -> _Recorder | None:
    """The recorder of the ``record`` running on this thread, if any (moe_fused._one_token asks)."""
    return getattr(_state, "recorder", None)


def available() -> bool:
    """Whether the C library is loaded with its experts server (not built on Windows, or without a compiler)."""
    return native.available and hasattr(native.lib(), "lumen_serve_new")


def record(fn, shapes: list[tuple[tuple, np.dtype]]):
    """The native job ``fn`` amounts to for arguments of these (shape, dtype), or None (module docstring)."""
    if not available():
        return None
    rec = _state.recorder = _Recorder()
    try:
        result = fn(*[np.zeros(shape, dtype) for shape, dtype in shapes])
    finally:
        _state.recorder = None
    if len(rec.calls) != 1 or result is not rec.calls[0][0]:
        return None
    return rec.calls[0][1]


def layout() -> dict[str, int]:
    """The mailbox's offsets (bytes): x, ids, wts, out; its size; the largest hidden size and k it holds."""
    out = np.zeros(7, np.int64)
    native.lib().lumen_serve_layout(ctypes.c_void_p(out.ctypes.data))
    return dict(zip(("x", "ids", "wts", "out", "bytes", "hmax", "kmax"), (int(v) for v in out), strict=True))


def server_threads(threads: int) -> int:
    """The server's thread count for a backend of ``threads``: at most one less than the cores this process may run
    on. Its threads spin while a step is in flight and each job waits for all of them, so a thread the OS parks to
    run another (the Python thread launching the next step, CUDA's) would hold the job for a time slice (~4 ms,
    measured: 5 tok/s instead of 50 at 40 layers with 16 threads and one more spinning on 16 cores)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(threads, cores - 1))


class Server:
    """Native threads serving registered jobs through a mailbox at ``address`` (``layout()["bytes"]`` bytes, zeroed,
    owned by ``keep``, which the server keeps alive). ``threads``: how many (see ``server_threads``)."""

    def __init__(self, address: int, keep, threads: int):
        lib = native.lib()
        self._lib, self._keep, self._jobs, self.address, self.threads = lib, keep, [], address, threads
        self._handle = lib.lumen_serve_new(ctypes.c_int64(address), ctypes.c_int64(threads))
        if not self._handle:
            raise RuntimeError(f"could not start {threads} expert server threads")

    def add(self, job) -> int | None:
        """Register a job (``record``'s); its number, or None where the server cannot hold it."""
        layer, fmt, gs, blk, act, H, k, threads, cgu, cd, pf = job
        i = self._lib.lumen_serve_add(self._handle, *(ctypes.c_int64(v) for v in (
            fmt, H, layer.I, layer.addresses.shape[1], k, act, cgu, cd, pf, layer.addresses.ctypes.data,
            gs.ctypes.data, blk.ctypes.data)))
        if i < 0:
            return None
        self._jobs.append(job)  # the layer (its arrays) lives as long as the server
        return int(i)

    def job_address(self, index: int) -> int:
        """The argument of ``lumen_serve_hostfn`` (a CUDA host node's function) for job ``index``."""
        return int(self._lib.lumen_serve_job(self._handle, ctypes.c_int64(index)))

    def hostfn(self) -> int:
        """The address of ``lumen_serve_hostfn``."""
        return ctypes.cast(self._lib.lumen_serve_hostfn, ctypes.c_void_p).value

    def arm(self, n: int) -> None:
        """``n`` jobs are about to be asked: spin until they are served (nothing once closed)."""
        if self._handle:
            self._lib.lumen_serve_arm(self._handle, ctypes.c_int64(n))

    def ask(self, index: int) -> None:
        """Ask job ``index`` from this thread (its inputs already in the mailbox) and wait for it."""
        if not self._handle:
            raise RuntimeError("this expert server is closed")
        self._lib.lumen_serve_ask(self._handle, ctypes.c_int64(index))

    def trace(self, n: int = 4096) -> dict:
        """The last ``n`` (at most 4096) jobs served, for profiling: ``rows`` (n, 5) int64 of job number and the ns
        (CLOCK_MONOTONIC) it was seen, the leader's part done, all threads' parts done, answered; ``served`` (all
        time) and ``cooled`` (times the threads stopped spinning with jobs still armed: a step that never asked
        them). Read between steps."""
        if not self._handle:
            raise RuntimeError("this expert server is closed")
        rows, stats = np.zeros((max(0, min(n, 4096)), 5), np.int64), np.zeros(2, np.int64)
        got = self._lib.lumen_serve_trace(self._handle, ctypes.c_void_p(rows.ctypes.data), ctypes.c_int64(len(rows)),
                                          ctypes.c_void_p(stats.ctypes.data))
        return {"rows": rows[:got], "served": int(stats[0]), "cooled": int(stats[1])}

    def close(self) -> None:
        """Stop the threads, once the jobs armed and not yet asked are served (up to 10 s: a GPU step still queued
        when its engine is dropped). Idempotent."""
        if self._handle:
            self._lib.lumen_serve_free(self._handle)
            self._handle = None

    def __del__(self):
        self.close()
