"""Hand-written CUDA kernels: the ``kernels/*.cu`` files beside this module, compiled by NVRTC through
``cupy.RawModule`` for the current device's architecture on first use, and cached per (file, arch, options)
(CuPy also keeps the compiled binary in its on-disk kernel cache, so a later process skips NVRTC).

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
_MODULES: dict[tuple[str, str, tuple[str, ...]], cp.RawModule] = {}


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


def function(name: str, kernel: str, options: tuple[str, ...] = ()) -> cp.RawKernel:
    """One ``extern "C"`` kernel of ``kernels/<name>.cu``."""
    return module(name, options).get_function(kernel)
