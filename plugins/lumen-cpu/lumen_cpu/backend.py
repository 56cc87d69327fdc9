"""The CPU device: host RAM, numpy arrays, weights kept in their checkpoint format."""

from __future__ import annotations

import os
import sys

import numpy as np

from lumen_core.backend import Backend, DeviceInfo, Weight, scale_block
from lumen_core.plan import host_available_bytes


class CPUBackend(Backend):
    name = "cpu"
    stores = ("ram", "mmap")
    kv_types = ("f32", "f16", "bf16", "fp8")
    compiles_on_first_use = True  # numba kernels (cached on disk after the first run)

    @classmethod
    def devices(cls) -> list[DeviceInfo]:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return [DeviceInfo("cpu", total, host_available_bytes(), f"{os.cpu_count()} cores")]

    conversion_reason = ("GGUF blocks held in RAM become int8 codes with block scales, the same values, decoded "
                         "~2x faster (4-6-bit) or ~15% faster (Q8_0) (lumen_cpu.int8; store mmap keeps the file's "
                         "bytes)")

    @classmethod
    def stored_format(cls, fmt: str, store: str = "ram") -> str:
        from .int8 import FORMATS

        return "i8" if store == "ram" and fmt in FORMATS else fmt

    @classmethod
    def stored_nbytes(cls, fmt: str, shape: tuple, store: str) -> int | None:
        from .int8 import nbytes

        return nbytes(fmt, shape) if cls.stored_format(fmt, store) == "i8" else None

    def weight(self, array, fmt: str, store: str, scale=None, shape=None) -> Weight:
        # ram: a private copy (the file can go away); mmap: a view on the page cache, read on use. GGUF block
        # formats in RAM: repacked to int8 codes (lumen_cpu.int8), the copy the file's bytes would have been.
        if self.stored_format(fmt, store) == "i8":
            from .int8 import repack

            self.int8_weights += 1
            return repack(array, fmt, shape or np.asarray(array).shape, qx=self.quantize_activations)
        if fmt == "nvfp4":  # scale = (e4m3 block scales (N, K/16), f32 global scale): kept as stored
            from .nvfp4 import weight

            self.nvfp4_weights += 1
            return weight(array, scale, shape, store, qx=self.quantize_activations, bf16=self.bf16_activations)
        data = np.array(array) if store == "ram" else array
        shape = tuple(shape or data.shape)
        block = None
        if scale is not None:
            scale = np.array(scale, dtype=np.float32)
            block = scale_block(shape, scale.shape)
        if fmt == "fp8":
            self.fp8_weights += 1
            if self.bf16_activations and scale is not None:
                from .fp8 import BF16Scale

                scale = scale.view(BF16Scale)
        return Weight(data, fmt, shape, scale, block)

    def configure_threads(self, threads: int) -> None:
        """cpu.threads: the numba pool every CPU kernel of the process runs on starts with ``threads`` threads
        (numba's own default: one per core, or NUMBA_NUM_THREADS). The pool starts once per process, at the first
        parallel kernel; a later load in the same process that asks for another count gets min(asked, running) for
        the loading thread (numba's per-thread setting) and a note saying so: the pool cannot be resized."""
        import numba
        from numba.np.ufunc import parallel

        if parallel._is_initialized:
            running = parallel.NUM_THREADS
            if threads != running:
                use = min(threads, running)
                numba.set_num_threads(use)
                print(f"lumen: note: cpu.threads {threads}: this process's CPU thread pool already runs {running} "
                      f"threads (it starts once, at the first CPU kernel); this thread uses {use}, others "
                      f"{running}. Set cpu.threads before the first load, or in a new process.", file=sys.stderr)
            return
        # numba reads its pool size from these two at the launch (numba.config's value is what set_num_threads
        # checks against; parallel.NUM_THREADS is what it launches): both, before the first parallel kernel
        numba.config.NUMBA_NUM_THREADS = threads
        parallel.NUM_THREADS = threads

    quantize_activations = False  # cpu.compute-quantization "int8": this backend's int8-layout weights quantize x
    bf16_activations = False  # cpu.compute-quantization "bf16": NVFP4 / fp8 experts' several-token products in AMX
    int8_weights = 0  # weights this backend repacked into the int8 layout
    nvfp4_weights = 0  # NVFP4 weights this backend loaded
    fp8_weights = 0  # fp8 weights this backend loaded

    def configure_compute_quantization(self, quantization: str) -> None:
        """cpu.compute-quantization: "int8" marks every int8-layout weight this backend loads (GGUF blocks in RAM):
        its GEMVs (1-3 tokens) quantize x to 8 bits a value and sum integer products (lumen_cpu.int8.gemv_q8); and
        every NVFP4 weight: one token's routed experts quantize x and h to 8 bits per 16 values and sum integer
        products (lumen_cpu.native.moe_token; needs the C kernels). "bf16" marks every NVFP4 and fp8 weight for the
        several-token expert products in AMX bf16 tiles (lumen_cpu/_native_amx.c; where the CPU has AMX-BF16)."""
        self.quantize_activations = quantization == "int8"
        self.bf16_activations = quantization == "bf16"

    def compute_quantization_applies(self) -> bool:
        from . import native

        if self.bf16_activations:
            return self.nvfp4_weights + self.fp8_weights > 0 and native.level == "amx"
        return (not self.quantize_activations or self.int8_weights > 0
                or (self.nvfp4_weights > 0 and native.available))

    def release_threads(self) -> None:
        """numba's OpenMP layer (GNU libgomp) keeps a pool of worker threads per thread that starts parallel kernels.
        When a GPU graph's host nodes run the CPU experts on CUDA's driver thread while the main thread (which ran
        the prefill's kernels) keeps its own idle pool, libgomp sees more threads than cores and stops spinning
        between kernels: each parallel kernel then waits for its workers to wake (~60 us per kernel on 2 cores
        here, against ~3 us). ``omp_pause_resource_all(omp_pause_soft)`` frees the calling thread's pool (it is
        made again at its next parallel kernel); cheap when there is none. Other threading layers: nothing."""
        gomp = _gomp()
        if gomp is not None:
            gomp.omp_pause_resource_all(1)

    def host_jobs(self):
        """lumen_cpu.hostjob where the C library has its experts server (one token's fp8 / NVFP4 routed experts
        asked by a GPU step through a mailbox), else None."""
        from . import hostjob

        return hostjob if hostjob.available() else None

    def tensor(self, array):
        # Always a private copy: small checkpoint tensors must not keep a view on the mapped file. Integer
        # arrays (expert ids routed on another device) keep their type; everything else becomes f32.
        array = np.asarray(array)
        return np.array(array, dtype=None if np.issubdtype(array.dtype, np.integer) else np.float32)

    def to_host(self, x):
        return np.asarray(x)


_GOMP: list = []


def _gomp():
    """GNU libgomp's omp_pause_resource_all when numba's running threading layer is "omp" on it; else None."""
    from numba.np.ufunc import parallel

    if not parallel._is_initialized:
        return None
    if not _GOMP:
        import ctypes

        import numba

        lib = None
        if numba.threading_layer() == "omp":
            try:
                lib = ctypes.CDLL("libgomp.so.1")
                lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
                lib.omp_pause_resource_all.restype = ctypes.c_int
            except (OSError, AttributeError):
                lib = None
        _GOMP.append(lib)
    return _GOMP[0]
