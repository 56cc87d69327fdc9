"""Programmatic dependent launch (lumen_cuda.kernels, LUMEN_CUDA_PDL): a kernel launched with the attribute may start
while the kernel before it still runs, so every kernel of the files launched that way must wait for it
(``pdl_begin()``, kernels/pdl.cuh) before its first read or write. Checked here on the sources (no GPU needed): the
first statement of every ``extern "C"`` kernel of ``PDL_FILES`` is ``pdl_begin();``, after at most L2 prefetches of
its weights (``pdl_prefetch_rows``: no read into a register, nothing written)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

CUDA = Path(__file__).resolve().parents[1] / "plugins" / "lumen-cuda" / "lumen_cuda"
KERNELS = CUDA / "kernels"


def pdl_files() -> set[str]:
    tree = ast.parse((CUDA / "kernels.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "PDL_FILES":
            return set(ast.literal_eval(node.value))
    raise AssertionError("kernels.py defines no PDL_FILES")


PREFETCH = re.compile(r"pdl_prefetch_rows\([^;]*\);\s*")


def kernel_bodies(src: str) -> list[tuple[str, str]]:
    """(name, the text after the opening brace and any weight prefetches) of each extern "C" kernel, macros' line
    continuations removed."""
    flat = src.replace("\\\n", "\n")
    out = []
    for m in re.finditer(r'extern "C"\s+__global__', flat):
        brace = flat.index("{", m.end())
        head = flat[m.end():brace]
        name = re.findall(r"([A-Za-z_][A-Za-z0-9_#]*)\s*\(", head)[0]
        body = flat[brace + 1:].lstrip()
        while PREFETCH.match(body):
            body = body[PREFETCH.match(body).end():]
        out.append((name, body))
    return out


def test_pdl_files_exist_and_include_the_header():
    files = pdl_files()
    assert {"gemv_fp8", "moe", "rms_norm"} <= files
    for f in sorted(files):
        src = (KERNELS / f"{f}.cu").read_text()
        assert '#include "pdl.cuh"' in src, f


@pytest.mark.parametrize("name", sorted(pdl_files()))
def test_every_kernel_of_a_pdl_file_waits_first(name):
    bodies = kernel_bodies((KERNELS / f"{name}.cu").read_text())
    assert bodies, name
    late = [k for k, body in bodies if not body.startswith("pdl_begin();")]
    assert not late, f"{name}.cu: kernels that do not call pdl_begin() first: {late}"


def test_the_check_catches_a_kernel_without_the_wait():
    src = 'extern "C" __global__ void a(float* x) {\n  pdl_begin();\n  x[0] = 1;\n}\n' \
          'extern "C" __global__ void b(float* x) {\n  x[0] = 2;\n  pdl_begin();\n}\n' \
          'extern "C" __global__ void c(float* W) {\n  pdl_prefetch_rows(W, 8, 0, 1, 4);\n  pdl_begin();\n}\n' \
          'extern "C" __global__ void d(float* W) {\n  pdl_prefetch_rows(W, 8, 0, 1, 4);\n  W[0] = 0;\n}\n'
    assert [(k, body.startswith("pdl_begin();")) for k, body in kernel_bodies(src)] == [
        ("a", True), ("b", False), ("c", True), ("d", False)]


def test_every_pdl_mode_compiles_defines_the_header_reads():
    """LUMEN_CUDA_PDL's modes (kernels.PDL_DEFINES: 1, noprefetch, late) pass -D flags; each must be a macro that
    kernels/pdl.cuh tests, or the mode would build the same code as another under a different name."""
    tree = ast.parse((CUDA / "kernels.py").read_text())
    modes = next(ast.literal_eval(n.value) for n in tree.body
                 if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", None) == "PDL_DEFINES")
    assert set(modes) == {"1", "noprefetch", "late"}
    header = (KERNELS / "pdl.cuh").read_text()
    tested = set(re.findall(r"#\s*if(?:n?def)?\s+!?\s*(?:defined\()?(\w+)", header))
    tested |= set(re.findall(r"defined\((\w+)\)", header))
    builds = set()
    for mode, flags in modes.items():
        assert flags[0] == "-DLUMEN_PDL", mode
        for flag in flags:
            assert flag.startswith("-D") and flag[2:] in tested, (mode, flag)
        builds.add(frozenset(flags))
    assert len(builds) == len(modes), "two modes build the same code"
