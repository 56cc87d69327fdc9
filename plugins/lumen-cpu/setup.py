"""The C row kernels (lumen_cpu/_native.c, _native_i8.c, _native_moe.c, _native_amx.c) and the experts server
(_native_serve.c) as an optional extension: a machine without a C compiler still installs the package, and numba
kernels do that work (lumen_cpu/native.py; a GPU step's CPU experts then cross through Python host nodes).
Metadata: pyproject.toml."""

import sys

from setuptools import Extension, setup

args = [] if sys.platform == "win32" else ["-O3", "-std=c11", "-fno-strict-aliasing", "-pthread"]
sources = [f"lumen_cpu/_native{part}.c" for part in ("", "_i8", "_moe", "_amx", "_serve")]
setup(ext_modules=[Extension("lumen_cpu._native", sources, depends=["lumen_cpu/_native.h"], extra_compile_args=args,
                             extra_link_args=args[-1:], optional=True)])
