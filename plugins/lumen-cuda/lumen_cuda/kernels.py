"""Hand-written CUDA kernels: the ``kernels/*.cu`` files beside this module, compiled by NVRTC through
``cupy.RawModule`` for the current device's architecture on first use (CuPy also keeps the compiled binary in its
on-disk kernel cache, so a later process skips NVRTC).

**The process-wide caches live here, and only here.** Compiled code and facts about a device are the same for
every engine in the process, never change once made, and hold no model's data, so they are cached at module level:

- ``_MODULES``: a compiled ``.cu`` file per (file, arch, options);
- ``_FUNCTIONS``: one kernel of it per (device, file, kernel, options), with the dynamic shared memory it has been
  allowed (``function(..., smem=)``);
- ``_ATTRIBUTES``: device attributes (shared memory a block may opt into, SM count) per (device, attribute), and
  facts about a compiled module on a device (``device_fact``) per (device, name);
- ``_CONSTANTS``: small immutable device tables (the e4m3 decoding table, 1 KB) per (device, name);
- ``_driver``: the CUDA driver library (ctypes) for ``cuLaunchKernelEx``, loaded once.

**Programmatic dependent launch (PDL).** The kernels of ``PDL_FILES`` call ``pdl_begin()`` (``kernels/pdl.cuh``)
before touching anything an earlier kernel writes; it (and the GEMVs' weight prefetch before it) is compiled in only
with ``-DLUMEN_PDL``. With ``LUMEN_CUDA_PDL`` set (``pdl_mode``: ``1``; ``noprefetch`` without the prefetch; ``late``
without it and without the early trigger), ``function`` builds those files with that mode's ``PDL_DEFINES`` and
returns launchers that,
while a stream is being captured on an sm_90+ device (a decode step becoming a CUDA graph), launch through
``cuLaunchKernelEx`` with the programmatic-stream-serialization attribute: in the replayed graph a kernel's blocks
are scheduled while the kernel before it drains, instead of after it. Outside a capture, the RawKernel launches as
usual; without the setting, the files are built and launched exactly as before. ``tests/test_cuda_pdl_sources.py``
(CPU) checks every kernel of those files calls ``pdl_begin()`` first.

Everything that belongs to a model or a decode step (weights' derived arrays, pointer tables, the expert cache,
pinned blocks, the step being captured) lives on the objects one engine owns instead: its ``CUDABackend``, its
``GraphRunner``, or the Weights themselves (lumen_cuda.state). The VRAM these caches take (kernel code, 1 KB
tables) is not returned when an engine is dropped; it is shared by every later engine.

The CUDA toolkit's include directory goes on the include path so that ``cuda_fp8.h`` / ``cuda_bf16.h`` /
``cuda_fp4.h`` resolve under NVRTC. Every ``.cu`` file must also build with nvcc for sm_90 and sm_120a
(``scripts/compile_kernels.sh``, run by CI).
"""

from __future__ import annotations

import ctypes
import os
from functools import cache
from pathlib import Path

import cupy as cp
import numpy as np

KERNEL_DIR = Path(__file__).with_name("kernels")
DEFAULT_SMEM = 48 * 1024  # dynamic shared memory a kernel may use without opting in
_MODULES: dict[tuple[str, str, tuple[str, ...]], cp.RawModule] = {}
_FUNCTIONS: dict[tuple, list] = {}  # (device, file, kernel, options) -> [RawKernel, shared memory allowed]
_ATTRIBUTES: dict[tuple[int, int], int] = {}
_CONSTANTS: dict[tuple[int, str], cp.ndarray] = {}


@cache
def include_dirs() -> tuple[str, ...]:
    """The CUDA include directory (the first that holds cuda_fp8.h), or none when CuPy's defaults must do."""
    roots = []
    try:
        roots.append(cp.cuda.get_cuda_path())
    except Exception:  # no toolkit found by CuPy
        pass
    roots += [os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), "/usr/local/cuda"]
    for root in roots:
        if root and (Path(root) / "include" / "cuda_fp8.h").is_file():
            return (str(Path(root) / "include"),)
    return ()


def arch() -> str:
    """The current device's compute capability, e.g. '90' (the H200) or '120'."""
    return cp.cuda.Device().compute_capability


def module(name: str, options: tuple[str, ...] = ()) -> cp.RawModule:
    """``kernels/<name>.cu`` compiled for the current device (cached per file, arch and options)."""
    key = (name, arch(), tuple(options))
    mod = _MODULES.get(key)
    if mod is None:
        src = (KERNEL_DIR / f"{name}.cu").read_text()
        opts = (f"-I{KERNEL_DIR}",) + tuple(f"-I{d}" for d in include_dirs()) + tuple(options)
        mod = cp.RawModule(code=src, options=opts, backend="nvrtc")
        _MODULES[key] = mod
    return mod


def function(name: str, kernel: str, options: tuple[str, ...] = (), smem: int = 0):
    """One ``extern "C"`` kernel of ``kernels/<name>.cu`` on the current device, allowed ``smem`` bytes of dynamic
    shared memory where that is over the default 48 KiB (cached per device: the decode hot path calls this). A
    ``cupy.RawKernel``, or for a file of ``PDL_FILES`` with PDL on a ``Launcher`` (called the same way) of the file
    built with ``-DLUMEN_PDL`` (its waits and prefetches; the default build has neither)."""
    pdl = PDL_DEFINES.get(pdl_mode()) if name in PDL_FILES else None  # the environment read once a call
    if pdl:
        options = (*options, *pdl)
    key = (cp.cuda.runtime.getDevice(), name, kernel, options)
    entry = _FUNCTIONS.get(key)
    if entry is None:
        raw = module(name, options).get_function(kernel)
        entry = _FUNCTIONS[key] = [raw, 0, Launcher(raw) if pdl else raw]
    if smem > DEFAULT_SMEM and entry[1] < smem:
        entry[0].max_dynamic_shared_size_bytes = smem
        entry[1] = smem
    return entry[2]


# -- fused decode ops ----------------------------------------------------------------------------------------------
def decode_fusion(env=None) -> bool:
    """``LUMEN_CUDA_DECODE_FUSION``: unset or 1 (the default since the twenty-fifth session) runs the fused decode
    ops of the twenty-fourth session (``moe_shared``'s shared-expert slot, ``add_rms_norm`` and ``rms_norm_gated`` in
    one kernel each, ``gated_delta_rule_gates``'s gates inside the step kernel); 0, the unfused kernels they replace
    (the baseline of benchmarks/cuda_decode_paths.py). Read at each call; anything else is an error naming it."""
    v = (os.environ if env is None else env).get("LUMEN_CUDA_DECODE_FUSION", "")
    if v not in ("", "0", "1"):
        raise ValueError(f"LUMEN_CUDA_DECODE_FUSION={v!r}: use 1 (fused decode ops, the default) or 0 (the unfused "
                         "kernels)")
    return v != "0"


# -- programmatic dependent launch ----------------------------------------------------------------------------------
PDL_FILES = ("rms_norm", "gemv", "gemv_fp8", "gemv_nvfp4", "gdn_step", "moe", "decode_attention")  # constant
_PDL_ATTRIBUTE = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (cuda.h, CUDA 12+)


PDL_DEFINES = {  # what each LUMEN_CUDA_PDL mode compiles PDL_FILES with (kernels/pdl.cuh); constant
    "1": ("-DLUMEN_PDL",),
    "noprefetch": ("-DLUMEN_PDL", "-DLUMEN_PDL_NO_PREFETCH"),
    "late": ("-DLUMEN_PDL", "-DLUMEN_PDL_NO_PREFETCH", "-DLUMEN_PDL_NO_TRIGGER"),
}


def pdl_mode(env=None) -> str:
    """``LUMEN_CUDA_PDL``: unset or 0 (off), 1 (each kernel of ``PDL_FILES`` waits for the one before, then lets the
    next one's blocks be scheduled; the GEMVs prefetch weight rows into L2 before the wait), ``noprefetch`` (the same
    without the prefetches) or ``late`` (the wait alone: the next kernel is scheduled only as this one's blocks exit).
    Anything else is an error naming it."""
    v = (os.environ if env is None else env).get("LUMEN_CUDA_PDL", "")
    if v not in ("", "0", *PDL_DEFINES):
        raise ValueError(f"LUMEN_CUDA_PDL={v!r}: use 1, noprefetch or late (programmatic dependent launch in captured "
                         "decode steps, docs/cuda.md) or 0")
    return v


def pdl_enabled(env=None) -> bool:
    """Whether ``LUMEN_CUDA_PDL`` (``pdl_mode``) asks for programmatic dependent launch while a decode step is
    captured (sm_90+)."""
    return pdl_mode(env) not in ("", "0")


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: id, 4 bytes of padding, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int), ("rest", ctypes.c_char * 60)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
                ("shared_mem", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


@cache
def _driver():
    """libcuda's ``cuLaunchKernelEx``, or None where the driver lacks it (before CUDA 12)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        fn = lib.cuLaunchKernelEx
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


def _param(a):
    """One kernel argument as the bytes the kernel reads (a device pointer, or a NumPy scalar's value)."""
    if isinstance(a, cp.ndarray):
        return ctypes.c_uint64(a.data.ptr)
    if isinstance(a, np.generic):
        return (ctypes.c_char * a.nbytes).from_buffer_copy(a.tobytes())
    raise TypeError(f"a {type(a).__name__} kernel argument (PDL launches take CuPy arrays and NumPy scalars)")


def _dims(d) -> tuple[int, int, int]:
    d = (d,) if isinstance(d, int) else tuple(d)
    return (*(int(v) for v in d), *(1,) * (3 - len(d)))


class Launcher:
    """A RawKernel of ``PDL_FILES``, called as one: ``launcher(grid, block, args, shared_mem=0)``. While the current
    stream is being captured on an sm_90+ device, through ``cuLaunchKernelEx`` with programmatic stream
    serialization; otherwise (and where the driver or an argument does not allow it) the RawKernel's own launch."""

    def __init__(self, raw):
        self.raw = raw

    def __getattr__(self, name):  # the RawKernel's attributes (max_dynamic_shared_size_bytes, num_regs, ...)
        return getattr(self.raw, name)

    def __call__(self, grid, block, args, shared_mem: int = 0):
        stream = cp.cuda.get_current_stream()
        fn = _driver()
        if fn is None or int(arch()) < 90 or not stream.is_capturing():
            return self.raw(grid, block, args, shared_mem=shared_mem)
        try:
            params = [_param(a) for a in args]
        except TypeError:
            return self.raw(grid, block, args, shared_mem=shared_mem)
        attr = _LaunchAttribute(id=_PDL_ATTRIBUTE, value=1)
        (gx, gy, gz), (bx, by, bz) = _dims(grid), _dims(block)
        config = _LaunchConfig(gx, gy, gz, bx, by, bz, int(shared_mem), ctypes.c_void_p(stream.ptr),
                               ctypes.pointer(attr), 1)
        ptrs = (ctypes.c_void_p * max(1, len(params)))(*[ctypes.addressof(p) for p in params])
        err = fn(ctypes.byref(config), ctypes.c_void_p(self.raw.kernel.ptr), ptrs, None)
        if err:
            raise RuntimeError(f"cuLaunchKernelEx({self.raw.name}) failed with CUresult {err} (LUMEN_CUDA_PDL=0 "
                               "launches without programmatic dependent launch)")


def device_attribute(attr: int, default: int) -> int:
    """``cudaDeviceGetAttribute(attr)`` of the current device (cached), or ``default`` where the runtime lacks it."""
    dev = cp.cuda.runtime.getDevice()
    value = _ATTRIBUTES.get((dev, attr))
    if value is None:
        try:
            value = int(cp.cuda.runtime.deviceGetAttribute(attr, dev))
        except Exception:  # a runtime without the attribute
            value = default
        _ATTRIBUTES[(dev, attr)] = value
    return value


def device_fact(name: str, compute) -> int:
    """``compute()`` for the current device, once (kept with the device attributes under ``name``): a fact about a
    compiled module there, e.g. whether it holds an arch-specific instruction (lumen_cuda.fp8_mma)."""
    key = (cp.cuda.runtime.getDevice(), name)
    value = _ATTRIBUTES.get(key)
    if value is None:
        value = _ATTRIBUTES[key] = int(compute())
    return value


def constant(name: str, make) -> cp.ndarray:
    """A small immutable device table ``make()`` (a numpy array) on the current device, uploaded once."""
    key = (cp.cuda.runtime.getDevice(), name)
    table = _CONSTANTS.get(key)
    if table is None:
        table = _CONSTANTS[key] = cp.asarray(make())
    return table
