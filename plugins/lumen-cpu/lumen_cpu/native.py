"""The compiled row kernels of ``_native.c`` (fp8 and NVFP4 rows dotted with one f32 vector, decoded in registers
with AVX-512 / AVX2) and ``_native_i8.c`` (rows of the int8 layout, ``lumen_cpu.int8``), and the numba kernels that
call them on numba's threads.

``setup.py`` builds ``_native`` at install time; it is optional: where no C compiler was found the package installs
without it, ``available`` is False and the pure-numba kernels (``fp8``, ``nvfp4_fused``, ``moe_fused``) do this work;
the functions every path calls by name (``lumen_nvfp4_decode_rows``, ``lumen_i8_rows``, ``lumen_i8_rows_q8``) are
then numba cfuncs with the same results (``_register_fallbacks``).
The library is loaded into LLVM's symbol table (``llvmlite.binding.load_library_permanently``) and the kernels call
its functions by name (``numba.types.ExternalFunction``), so the numba kernels that call them stay cacheable.

Environment (read once, at import):

- ``LUMEN_CPU_NATIVE=0``: do not load the library (the numba kernels run; for comparisons).
- ``LUMEN_CPU_ISA=avx512vnni|avx512|avx2|scalar``: the highest instruction set the kernels may use (default: the
  highest); the CPU's own support caps it. ``level`` is the one in use.
- ``LUMEN_CPU_PREFETCH=BYTES``: how far ahead of use the int8 layout's row kernels prefetch their rows (default
  16384; 0: not at all; see _native.h). For tuning and comparisons.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import os
from pathlib import Path

import numpy as np
from numba import njit, prange, types
from numba.extending import intrinsic

from lumen_core.errors import LumenError

from .activations import moe_act as _act

F32 = np.float32
LEVELS = {"scalar": 0, "avx2": 1, "avx512": 2, "avx512vnni": 3}
HIGHEST = "avx512vnni"
NAMES = {v: k for k, v in LEVELS.items()}


def _library() -> Path | None:
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = Path(__file__).with_name("_native" + suffix)
        if path.exists():
            return path
    return None


_lib: list = []


def use(isa: str) -> str:
    """Let the kernels use at most ``isa`` (a key of LEVELS) from now on; the level in use (the CPU's support
    caps it). For tests and comparisons; LUMEN_CPU_ISA sets it at import."""
    global level
    if isa not in LEVELS:
        raise LumenError(f"LUMEN_CPU_ISA={isa!r}: expected one of {', '.join(LEVELS)} (or leave it unset)")
    if not _lib:
        raise RuntimeError("lumen_cpu's C kernels are not loaded (native.available is False)")
    level = NAMES[_lib[0].lumen_native_init(LEVELS[isa])]
    return level


PREFETCH = 16384


def prefetch(nbytes: int) -> None:
    """Let the int8 row kernels prefetch ``nbytes`` ahead from now on (0: none); LUMEN_CPU_PREFETCH sets it at
    import."""
    if not _lib:
        raise RuntimeError("lumen_cpu's C kernels are not loaded (native.available is False)")
    _lib[0].lumen_native_prefetch(int(nbytes))


def _prefetch_from_env() -> int:
    raw = os.environ.get("LUMEN_CPU_PREFETCH", str(PREFETCH))
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise LumenError(f"LUMEN_CPU_PREFETCH={raw!r}: expected a number of bytes >= 0 (0: no prefetch; default "
                         f"{PREFETCH}), or leave it unset")
    return value


def _load() -> bool:
    isa = os.environ.get("LUMEN_CPU_ISA", HIGHEST)
    if isa not in LEVELS:
        raise LumenError(f"LUMEN_CPU_ISA={isa!r}: expected one of {', '.join(LEVELS)} (or leave it unset)")
    ahead = _prefetch_from_env()
    path = _library()
    if path is None or os.environ.get("LUMEN_CPU_NATIVE", "1") == "0":
        return False
    from llvmlite import binding

    binding.load_library_permanently(str(path))
    lib = ctypes.CDLL(str(path))
    lib.lumen_native_init.restype = ctypes.c_int
    lib.lumen_native_init.argtypes = [ctypes.c_int]
    lib.lumen_native_prefetch.argtypes = [ctypes.c_int64]
    lib.lumen_native_prefetch.restype = None
    _lib.append(lib)
    use(isa)
    prefetch(ahead)
    return True


level: str | None = None
available = _load()

_i = types.int64  # pointers travel as integers (the same register in the x86-64 and AArch64 calling conventions)
# out[i] = sum over column blocks b of S[(r0+i)//br, b] * (e4m3 codes of row r0+i in block b) . x
fp8_rows = types.ExternalFunction("lumen_fp8_rows", types.void(_i, _i, _i, _i, _i, _i, _i, _i, _i, _i, _i))
# out[i] = gs * sum over blocks of 16 of e4m3(s[r0+i, b]) * (E2M1 codes of the block) . x, x permuted (permute)
nvfp4_rows = types.ExternalFunction("lumen_nvfp4_rows",
                                    types.void(_i, _i, _i, _i, _i, _i, _i, _i, types.float32, _i))
nvfp4_permute = types.ExternalFunction("lumen_nvfp4_permute", types.void(_i, _i, _i))
# out[i * ldo + k] = NVFP4 row r0 + i decoded to f32 (nvfp4.dequantize's values): (w, ldw, s, lds, r0, n, K, gs, out,
# ldo). The several-token expert kernels (moe_fused) call it whether or not the library was built: without it, the
# symbol is a numba cfunc (_register_fallbacks) with the same results.
nvfp4_decode_rows = types.ExternalFunction("lumen_nvfp4_decode_rows",
                                           types.void(_i, _i, _i, _i, _i, _i, _i, types.float32, _i, _i))
# out[t * ldo + i] = row r0 + i of an int8-layout matrix (lumen_cpu.int8) dotted with x's row t, t < T:
# (q, ldq, s, lds, s16, bs, m, ldm, r0, n, K, x, ldx, xs, T, out, ldo); s holds f16 bits when s16 (else f32), a
# scale per bs columns; m (0: none) a minimum per 32 columns, xs then x's sums per 32 columns (T rows of K / 32).
# Every i8 GEMV calls it (lumen_cpu.int8); without the library the symbol is a numba cfunc (_register_fallbacks).
i8_rows = types.ExternalFunction("lumen_i8_rows", types.void(*[_i] * 17))
# The same with x quantized to 8 bits (cpu.compute-quantization "int8"; int8.quantize_x): (q, ldq, s, lds, s16, bs,
# m, ldm, r0, n, K, xq, dx, xsq, xs, T, out, ldo); xq (T, K) int8, dx (T, K / 32) f32, xsq (T, K / bs) f32 sums of xq.
i8_rows_q8 = types.ExternalFunction("lumen_i8_rows_q8", types.void(*[_i] * 18))
# out[t * ldo + i] for t0 <= t < t1, row r0 + i (i < n) of an int8-layout matrix, many tokens (prefill): (q, ldq, s,
# lds, s16, bs, m, ldm, r0, n, K, x, ldx, t0, t1, out, ldo). Returns 0 where it has no kernel for this CPU (below
# AVX-512, or without the library: the cfunc) and computed nothing: int8.gemm runs its numba kernel then.
i8_gemm = types.ExternalFunction("lumen_i8_gemm", types.int64(*[_i] * 17))


@intrinsic
def _pointer(typingctx, addr, dtype):
    """An address (int64) as a pointer to ``dtype`` (np.uint8, np.float32: for numba.carray)."""
    ptr = types.CPointer(dtype.instance_type)

    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], context.get_value_type(ptr))

    return ptr(addr, dtype), codegen


def _register_fallbacks() -> None:
    """Without the library: ``lumen_nvfp4_decode_rows``, ``lumen_i8_rows`` and ``lumen_i8_rows_q8`` as numba cfuncs
    (the same values; f32 sums in another order), and ``lumen_i8_gemm`` as one that declines (its caller's numba
    kernel runs), so that the kernels that call them link."""
    from llvmlite import binding
    from numba import carray, cfunc

    from .bitcast import as_f32
    from .nvfp4 import E2M1
    from .nvfp4_fused import E4M3

    @cfunc(types.void(_i, _i, _i, _i, _i, _i, _i, types.float32, _i, _i), cache=True)
    def decode(w, ldw, s, lds, r0, n, K, gs, out, ldo):
        W = carray(_pointer(w, np.uint8), (r0 + n, ldw))
        S = carray(_pointer(s, np.uint8), (r0 + n, lds))
        O = carray(_pointer(out, np.float32), ((n - 1) * ldo + K,))
        for i in range(n):
            for c in range(0, K, 2):
                sc, b = E4M3[S[r0 + i, c // 16]], W[r0 + i, c // 2]
                O[i * ldo + c] = (E2M1[b & 15] * sc) * gs
                O[i * ldo + c + 1] = (E2M1[b >> 4] * sc) * gs

    @njit(inline="always")
    def _scale(S16, S32, s16, j):  # a block scale as f32: the file's f16 bits (exactly, as int8.scale_at) or f32
        if s16:
            h = np.uint32(S16[j])
            return as_f32(((h & np.uint32(0x7FFF)) << np.uint32(13)) |
                          ((h & np.uint32(0x8000)) << np.uint32(16))) * np.float32(5.192296858534828e33)
        return S32[j]

    @cfunc(types.void(*[_i] * 17), cache=True, fastmath=True)
    def i8(q, ldq, s, lds, s16, bs, m, ldm, r0, n, K, x, ldx, xs, T, out, ldo):
        rows, nc = r0 + n, K // 32
        Q = carray(_pointer(q, np.int8), ((rows - 1) * ldq + K,))
        S32 = carray(_pointer(s, np.float32), ((rows - 1) * lds + K // bs,))
        S16 = carray(_pointer(s, np.uint16), ((rows - 1) * lds + K // bs,))
        M = carray(_pointer(m, np.float32), ((rows - 1) * ldm + nc,) if m else (0,))
        X = carray(_pointer(x, np.float32), ((T - 1) * ldx + K,))
        XS = carray(_pointer(xs, np.float32), (T * nc,) if m else (0,))
        O = carray(_pointer(out, np.float32), ((T - 1) * ldo + n,))
        for i in range(n):
            r = r0 + i
            for t in range(T):
                acc = np.float32(0)
                for b in range(K // bs):
                    part = np.float32(0)
                    for k in range(b * bs, (b + 1) * bs):
                        part += np.float32(Q[r * ldq + k]) * X[t * ldx + k]
                    sc = _scale(S16, S32, s16, r * lds + b)
                    acc += part * sc
                if m:
                    for c in range(nc):
                        acc -= M[r * ldm + c] * XS[t * nc + c]
                O[t * ldo + i] = acc

    @cfunc(types.void(*[_i] * 18), cache=True)
    def i8q(q, ldq, s, lds, s16, bs, m, ldm, r0, n, K, xq, dx, xsq, xs, T, out, ldo):
        rows, nc = r0 + n, K // 32
        Q = carray(_pointer(q, np.int8), ((rows - 1) * ldq + K,))
        S32 = carray(_pointer(s, np.float32), ((rows - 1) * lds + K // bs,))
        S16 = carray(_pointer(s, np.uint16), ((rows - 1) * lds + K // bs,))
        M = carray(_pointer(m, np.float32), ((rows - 1) * ldm + nc,) if m else (0,))
        XQ = carray(_pointer(xq, np.int8), (T * K,))
        DX = carray(_pointer(dx, np.float32), (T * nc,))
        XS = carray(_pointer(xs, np.float32), (T * nc,) if m else (0,))
        O = carray(_pointer(out, np.float32), ((T - 1) * ldo + n,))
        for i in range(n):
            r = r0 + i
            for t in range(T):
                acc = np.float32(0)
                for b in range(K // bs):
                    dot = np.int32(0)
                    for k in range(b * bs, (b + 1) * bs):
                        dot += np.int32(Q[r * ldq + k]) * np.int32(XQ[t * K + k])
                    sc = _scale(S16, S32, s16, r * lds + b)
                    acc += np.float32(dot) * (sc * DX[t * nc + b * bs // 32])
                if m:
                    for c in range(nc):
                        acc -= M[r * ldm + c] * XS[t * nc + c]
                O[t * ldo + i] = acc

    @cfunc(types.int64(*[_i] * 17), cache=True)
    def i8_gemm(q, ldq, s, lds, s16, bs, m, ldm, r0, n, K, x, ldx, t0, t1, out, ldo):
        return 0  # not done here: int8.gemm runs its numba kernel

    for name, f in (("lumen_nvfp4_decode_rows", decode), ("lumen_i8_rows", i8), ("lumen_i8_rows_q8", i8q),
                    ("lumen_i8_gemm", i8_gemm)):
        binding.add_symbol(name, f.address)
        _fallbacks.append(f)


_fallbacks: list = []
if not available:
    _register_fallbacks()


@njit(inline="always")
def permuted_at(c, K):
    """Where column c of a vector goes in ``lumen_nvfp4_permute``'s order (per 32 columns the even ones, then the
    odd; a last block of 16 stays)."""
    base = c - c % 32
    if base + 32 > K:
        return c
    q = c % 32
    return base + q // 2 if q % 2 == 0 else base + 16 + q // 2


@njit(inline="always")
def _share(ntask, w, nw):  # worker w's contiguous range of tasks
    return w * ntask // nw, (w + 1) * ntask // nw


# -- one token through a matrix ----------------------------------------------------------------------------------
@njit(cache=True, parallel=True)
def gemv_fp8(raw, x, out, s, br, bc, rows, threads):
    """out (N,) = W x: raw (N, K) e4m3 bytes, s the block scales (rows of blocks, columns of blocks)."""
    N, K = raw.shape
    ntask = (N + rows - 1) // rows
    nw = min(ntask, threads)
    for w in prange(nw):
        t0, t1 = _share(ntask, w, nw)
        r0, r1 = t0 * rows, min(N, t1 * rows)
        if r1 > r0:
            fp8_rows(raw.ctypes.data, K, r0, r1 - r0, K, x.ctypes.data, s.ctypes.data, s.shape[1], br, bc,
                     out[r0:].ctypes.data)


@njit(cache=True, parallel=True)
def gemv_nvfp4(packed, block, gs, x, out, rows, threads):
    """out (N,) = W x for an NVFP4 matrix: packed (N, K/2) E2M1 codes, block (N, K/16) e4m3 scales, gs global."""
    N, K = packed.shape[0], x.shape[0]
    xp = np.empty(K, F32)
    nvfp4_permute(x.ctypes.data, K, xp.ctypes.data)
    ntask = (N + rows - 1) // rows
    nw = min(ntask, threads)
    for w in prange(nw):
        t0, t1 = _share(ntask, w, nw)
        r0, r1 = t0 * rows, min(N, t1 * rows)
        if r1 > r0:
            nvfp4_rows(packed.ctypes.data, packed.shape[1], block.ctypes.data, block.shape[1], r0, r1 - r0, K,
                       xp.ctypes.data, gs, out[r0:].ctypes.data)


# -- routed experts of a few tokens (decode) ----------------------------------------------------------------------
# One call a layer (sorting, both matrices' parallel regions and the weighted sum: the Python and dispatch cost of a
# call is paid once). Each valid (token, slot) pair is its own task list: an expert picked by two tokens is read
# twice, so this path is for one token (moe_fused's sorted kernels share an expert's rows between tokens).
# Tasks of (slot, chunk rows), each worker a contiguous range of them; h and ys have a row per slot; for NVFP4 h
# is written in permuted order (the down matrix reads it so).
@njit(inline="always")
def _slots(ids, E):  # the valid (token, slot) pairs in slot order: their experts, tokens and flat slot indices
    T, k = ids.shape
    ex, tok, flat = np.empty(T * k, np.int64), np.empty(T * k, np.int64), np.empty(T * k, np.int64)
    n = 0
    for t in range(T):
        for j in range(k):
            e = ids[t, j]
            if 0 <= e < E:
                ex[n], tok[n], flat[n] = e, t, t * k + j
                n += 1
    return ex[:n], tok[:n], flat[:n]


@njit(inline="always")
def _combine(ys, tok, flat, wts, T, H):  # out[t] = sum over j = 0 .. k-1 (in that order) of w[t, j] ys[slot]
    out = np.zeros((T, H), F32)
    k = wts.shape[1]
    for i in range(tok.shape[0]):
        w = wts[tok[i], flat[i] % k]
        for c in range(H):
            out[tok[i], c] += ys[i, c] * w
    return out


@njit(inline="always")
def _plan(n, rows, chunk, threads):  # n matrices of ``rows`` rows in tasks of chunk rows: (chunks, tasks, workers)
    nch = (rows + chunk - 1) // chunk
    return nch, n * nch, max(1, min(n * nch, threads))


@njit(cache=True, parallel=True)
def moe_fp8(G, U, D, SG, SU, SD, sgs, sds, bg, cg, bd, cd, I, x, ids, wts, act, threads, chunk):
    """Routed fp8 experts for x (T, H), ids / wts (T, k): the weighted sum of each token's experts (T, H). G, U, D
    (E,): the addresses of each expert's e4m3 matrices (gate and up (I, H), down (H, I)); SG, SU, SD: of their f32
    block scales, rows of sgs (gate / up) or sds (down) values; (bg, cg), (bd, cd): the blocks' shapes."""
    T, H = x.shape
    ex, tok, flat = _slots(ids, G.shape[0])
    n = ex.shape[0]
    h, ys = np.empty((n, I), F32), np.empty((n, H), F32)
    nch, ntask, nw = _plan(n, I, chunk, threads)
    for w in prange(nw):
        gate, up = np.empty(chunk, F32), np.empty(chunk, F32)
        t0, t1 = _share(ntask, w, nw)
        for task in range(t0, t1):
            j, r0 = task // nch, (task % nch) * chunk
            m = min(r0 + chunk, I) - r0
            e, xa = ex[j], x[tok[j]:].ctypes.data
            fp8_rows(G[e], H, r0, m, H, xa, SG[e], sgs, bg, cg, gate.ctypes.data)
            fp8_rows(U[e], H, r0, m, H, xa, SU[e], sgs, bg, cg, up.ctypes.data)
            for r in range(m):
                h[j, r0 + r] = _act(gate[r], act) * up[r]
    nch, ntask, nw = _plan(n, H, chunk, threads)
    for w in prange(nw):
        t0, t1 = _share(ntask, w, nw)
        for task in range(t0, t1):
            j, r0 = task // nch, (task % nch) * chunk
            e = ex[j]
            fp8_rows(D[e], I, r0, min(r0 + chunk, H) - r0, I, h[j:].ctypes.data, SD[e], sds, bd, cd,
                     ys[j, r0:].ctypes.data)
    return _combine(ys, tok, flat, wts, T, H)


@njit(cache=True, parallel=True)
def moe_nvfp4(G, U, D, BG, BU, BD, gsg, gsu, gsd, I, x, ids, wts, act, threads, chunk):
    """Routed NVFP4 experts for x (T, H), ids / wts (T, k): the weighted sum of each token's experts (T, H). G, U,
    D (E,): the addresses of each expert's packed codes (gate and up (I, H/2), down (H, I/2)); BG, BU, BD: of their
    e4m3 block scales (a row's 1/16 as many); gsg, gsu, gsd: the global scales."""
    T, H = x.shape
    ex, tok, flat = _slots(ids, G.shape[0])
    n = ex.shape[0]
    xp = np.empty((T, H), F32)
    for t in range(T):
        nvfp4_permute(x[t:].ctypes.data, H, xp[t:].ctypes.data)
    hp, ys = np.empty((n, I), F32), np.empty((n, H), F32)
    nch, ntask, nw = _plan(n, I, chunk, threads)
    for w in prange(nw):
        gate, up = np.empty(chunk, F32), np.empty(chunk, F32)
        t0, t1 = _share(ntask, w, nw)
        for task in range(t0, t1):
            j, r0 = task // nch, (task % nch) * chunk
            m = min(r0 + chunk, I) - r0
            e, xa = ex[j], xp[tok[j]:].ctypes.data
            nvfp4_rows(G[e], H // 2, BG[e], H // 16, r0, m, H, xa, gsg[e], gate.ctypes.data)
            nvfp4_rows(U[e], H // 2, BU[e], H // 16, r0, m, H, xa, gsu[e], up.ctypes.data)
            for r in range(m):
                hp[j, permuted_at(r0 + r, I)] = _act(gate[r], act) * up[r]
    nch, ntask, nw = _plan(n, H, chunk, threads)
    for w in prange(nw):
        t0, t1 = _share(ntask, w, nw)
        for task in range(t0, t1):
            j, r0 = task // nch, (task % nch) * chunk
            e = ex[j]
            nvfp4_rows(D[e], I // 2, BD[e], I // 16, r0, min(r0 + chunk, H) - r0, I, hp[j:].ctypes.data, gsd[e],
                       ys[j, r0:].ctypes.data)
    return _combine(ys, tok, flat, wts, T, H)
