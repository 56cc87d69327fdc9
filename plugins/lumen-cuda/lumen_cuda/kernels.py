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
- ``_CONSTANTS``: small immutable device tables (the e4m3 decoding table, 1 KB) per (device, name).

Everything that belongs to a model or a decode step (weights' derived arrays, pointer tables, the expert cache,
pinned blocks, the step being captured) lives on the objects one engine owns instead: its ``CUDABackend``, its
``GraphRunner``, or the Weights themselves (lumen_cuda.state). The VRAM these caches take (kernel code, 1 KB
tables) is not returned when an engine is dropped; it is shared by every later engine.

The CUDA toolkit's include directory goes on the include path so that ``cuda_fp8.h`` / ``cuda_bf16.h`` /
``cuda_fp4.h`` resolve under NVRTC. Every ``.cu`` file must also build with nvcc for sm_90 and sm_120a
(``scripts/compile_kernels.sh``, run by CI).
"""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path

import cupy as cp

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
        opts = tuple(f"-I{d}" for d in include_dirs()) + tuple(options)
        mod = cp.RawModule(code=src, options=opts, backend="nvrtc")
        _MODULES[key] = mod
    return mod


def function(name: str, kernel: str, options: tuple[str, ...] = (), smem: int = 0) -> cp.RawKernel:
    """One ``extern "C"`` kernel of ``kernels/<name>.cu`` on the current device, allowed ``smem`` bytes of dynamic
    shared memory where that is over the default 48 KiB (cached per device: the decode hot path calls this)."""
    key = (cp.cuda.runtime.getDevice(), name, kernel, options)
    entry = _FUNCTIONS.get(key)
    if entry is None:
        entry = _FUNCTIONS[key] = [module(name, options).get_function(kernel), 0]
    if smem > DEFAULT_SMEM and entry[1] < smem:
        entry[0].max_dynamic_shared_size_bytes = smem
        entry[1] = smem
    return entry[0]


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
