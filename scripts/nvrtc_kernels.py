"""Compile every hand-written CUDA kernel file with NVRTC, the compiler lumen_cuda uses at run time.

``scripts/compile_kernels.sh`` builds each ``plugins/*/**/kernels/*.cu`` with nvcc; but a GPU user's process compiles
them with NVRTC (``lumen_cuda.kernels.module``: ``cupy.RawModule(backend="nvrtc")``), whose front end and options
differ (no host compiler, CuPy's ``--device-as-default-execution-space``). A file that builds under nvcc and not under
NVRTC fails only on a GPU, at its first launch. This check runs the NVRTC front end (PTX for ``compute_90`` and
``compute_120a``, no GPU needed) with the options lumen_cuda passes: the kernels' and the toolkit's include
directories, the PDL builds of files that include ``pdl.cuh`` (``LUMEN_CUDA_PDL``'s modes), and the ``-D`` settings
the Python side may add (``EXTRA``).

    python scripts/nvrtc_kernels.py          # exit 1 on any error; exit 0 with a note where NVRTC is absent

libnvrtc comes from the ``nvidia-cuda-nvrtc`` wheel (CI installs it) or the system (``NVRTC=/path/libnvrtc.so``);
the CUDA headers (cuda_fp8.h, ...) from ``CUDA_INCLUDE`` or a toolkit under /usr/local. One front end per core.
"""

from __future__ import annotations

import ast
import ctypes
import glob
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ARCHS = ("compute_90", "compute_120a")


def pdl_builds() -> tuple[tuple[str, ...], ...]:
    """The plain build and one per ``LUMEN_CUDA_PDL`` mode: lumen_cuda.kernels.PDL_DEFINES, read from its source
    (importing it needs CuPy)."""
    tree = ast.parse((ROOT / "plugins/lumen-cuda/lumen_cuda/kernels.py").read_text())
    modes = next(ast.literal_eval(n.value) for n in tree.body
                 if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", None) == "PDL_DEFINES")
    return ((), *(tuple(flags) for flags in modes.values()))


# -D settings lumen_cuda adds at run time (gemv.py, moe.py), one build each beside the plain one
EXTRA = {"gemv": (("-DGEMV_WARPS=8",), ("-DGEMV_U=4",)), "gemv_fp8": (("-DGEMV_U=4",),),
         "moe": (("-DMOE_GATE_UP_MIN_BLOCKS=5",),)}


def _site_dirs() -> list[Path]:
    import site

    return [Path(p) for p in (*site.getsitepackages(), site.getusersitepackages()) if Path(p).is_dir()]


def find_nvrtc() -> str | None:
    if os.environ.get("NVRTC"):
        return os.environ["NVRTC"]
    pats = [str(d / "nvidia" / "*" / "lib" / "libnvrtc.so*") for d in _site_dirs()]
    pats += [str(d / "nvidia" / "cuda_nvrtc" / "lib" / "libnvrtc.so*") for d in _site_dirs()]
    pats += ["/usr/local/cuda*/lib64/libnvrtc.so*", "/usr/lib/x86_64-linux-gnu/libnvrtc.so*"]
    for pat in pats:
        hits = sorted(p for p in glob.glob(pat) if "builtins" not in p and "alt" not in p)
        if hits:
            return hits[0]
    return None


def find_include() -> str | None:
    cands = [os.environ.get("CUDA_INCLUDE"), "/usr/local/cuda/include", *sorted(glob.glob("/usr/local/cuda-*/include"))]
    cands += [str(p) for d in _site_dirs() for p in (d / "nvidia").glob("*/include")]
    for c in cands:
        if c and (Path(c) / "cuda_fp8.h").is_file():
            return c
    return None


class NVRTC:
    def __init__(self, path: str):
        self.lib = ctypes.CDLL(path)

    def compile(self, src: bytes, name: str, opts: list[str]) -> tuple[bool, str]:
        lib, prog = self.lib, ctypes.c_void_p()
        if lib.nvrtcCreateProgram(ctypes.byref(prog), src, name.encode(), 0, None, None):
            return False, "nvrtcCreateProgram failed"
        try:
            arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
            rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
            n = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
            buf = ctypes.create_string_buffer(max(1, n.value))
            lib.nvrtcGetProgramLog(prog, buf)
            return rc == 0, buf.value.decode(errors="replace").strip()
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(prog))


def _job(job) -> tuple[bool, str]:
    path, f, _, opts = job
    return NVRTC(path).compile(Path(f).read_bytes(), Path(f).name, opts)


def main() -> int:
    files = sorted(ROOT.glob("plugins/*/**/kernels/*.cu"))
    if not files:
        print("nvrtc_kernels: no kernels/*.cu files under plugins/")
        return 0
    path, include = find_nvrtc(), find_include()
    if path is None or include is None:
        what = "libnvrtc" if path is None else "the CUDA headers (cuda_fp8.h)"
        print(f"nvrtc_kernels: {what} not found: skipping the NVRTC compile check (pip install nvidia-cuda-nvrtc, "
              "a CUDA toolkit's include directory, or set NVRTC / CUDA_INCLUDE)")
        return 0
    print(f"nvrtc_kernels: {path}, headers {include}")
    jobs, pdl = [], pdl_builds()
    for f in files:
        src = f.read_bytes()
        builds = [*(pdl if b'#include "pdl.cuh"' in src else ((),)), *EXTRA.get(f.stem, ())]
        jobs += [(path, str(f), arch, [f"-I{f.parent}", f"-I{include}", f"-arch={arch}",
                                       "--device-as-default-execution-space", *defines])
                 for arch in ARCHS for defines in builds]
    failed = 0
    with ProcessPoolExecutor(max_workers=os.cpu_count() or 1) as pool:  # one NVRTC front end per core
        for (_, f, arch, opts), (ok, log) in zip(jobs, pool.map(_job, jobs), strict=True):
            defines = " ".join(o for o in opts if o.startswith("-D"))
            print(f"{'ok ' if ok else 'ERR'} {arch:13} {Path(f).relative_to(ROOT)} {defines}", flush=True)
            if not ok:
                failed += 1
                print(log[:4000])
    if failed:
        print(f"nvrtc_kernels: {failed} build(s) failed")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
