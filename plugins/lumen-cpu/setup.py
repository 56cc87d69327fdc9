"""The C row kernels (lumen_cpu/_native.c, _native_i8.c, _native_moe.c, _native_amx.c) as an optional extension: a
machine without a C compiler still installs the package, and numba kernels do that work (lumen_cpu/native.py).
Metadata: pyproject.toml."""

import sys

from setuptools import Extension, setup

args = [] if sys.platform == "win32" else ["-O3", "-std=c11", "-fno-strict-aliasing"]
setup(ext_modules=[Extension("lumen_cpu._native", ["lumen_cpu/_native.c", "lumen_cpu/_native_i8.c",
                                                           "lumen_cpu/_native_moe.c", "lumen_cpu/_native_amx.c"],
                             depends=["lumen_cpu/_native.h"], extra_compile_args=args, optional=True)])
