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
- ``LUMEN_CPU_ISA=amx|avx512vnni|avx512|avx2|scalar``: the highest instruction set the kernels may use (default: the
  highest); the CPU's own support caps it (amx: AMX-BF16 tiles, granted by the OS, used by the experts' prefill
  products, _native_amx.c). ``level`` is the one in use.
- ``LUMEN_CPU_PREFETCH=BYTES``: how far ahead of use the int8 layout's row kernels (and the AMX prefill's fp8 and
  NVFP4 row decoders) prefetch their rows (default 16384; 0: not at all; see _native.h). For tuning and comparisons.
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

F32 = np.float32
LEVELS = {"scalar": 0, "avx2": 1, "avx512": 2, "avx512vnni": 3, "amx": 4}
HIGHEST = "amx"
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
    """Let the int8 row kernels (and the AMX prefill's fp8 and NVFP4 row decoders) prefetch ``nbytes`` ahead (0:
    none); LUMEN_CPU_PREFETCH sets it at import."""
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


def lib():
    """The C library through ctypes (loaded: ``available``), the expert server's signatures set
    (lumen_cpu/_native_serve.c, lumen_cpu.hostjob)."""
    lib = _lib[0]
    if hasattr(lib, "lumen_serve_new") and lib.lumen_serve_new.restype is not ctypes.c_void_p:
        v, i, p = ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p
        for name, res, args in (("lumen_serve_new", v, [i, i]), ("lumen_serve_add", i, [p] + [i] * 12),
                                ("lumen_serve_job", i, [p, i]), ("lumen_serve_arm", None, [p, i]),
                                ("lumen_serve_ask", None, [p, i]), ("lumen_serve_free", None, [p]),
                                ("lumen_serve_layout", None, [p]), ("lumen_serve_hostfn", None, [p]),
                                ("lumen_serve_trace", i, [p, p, i, p])):
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = res, args
    return lib


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
    (the same values; f32 sums in another order), ``lumen_i8_gemm``, ``lumen_f32_dots`` and ``lumen_amx_dots`` as
    ones that decline (their callers' numba kernels run), and the AMX prefill's decoders and packers as empty stand-ins
    (called only at the amx level, which needs the library), so that the kernels that call them link."""
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

    @cfunc(types.int64(*[_i] * 9), cache=True)
    def dots(B, R, K, X, ldx, idx, m, C, ldc):
        return 0  # not done here: moe_fused._dots runs its numba kernel

    @cfunc(types.int64(*[_i] * 12, types.float32), cache=True)
    def amx(W, ldW, R, K, P, m, parts, srow, bc, C, ldc, tm, gs):
        return 0  # no AMX without the library: the AMX prefill's callers keep the f32 path (and never pack)

    @cfunc(types.void(*[_i] * 10), cache=True)
    def decode16(w, ldw, s, lds, r0, n, K, N, out, ldo):
        pass  # link-only: moe_fused calls it only at the amx level, which needs the library

    @cfunc(types.void(*[_i] * 8), cache=True)
    def decode8(w, ldw, r0, n, K, N, out, ldo):
        pass  # link-only, as decode16

    @cfunc(types.void(*[_i] * 6), cache=True)
    def pairs(X, ldx, idx, m, K, F):
        pass  # link-only, as decode16

    @cfunc(types.void(*[_i] * 5), cache=True)
    def from_pairs(F, m, K, parts, P):
        pass  # link-only, as decode16

    for name, f in (("lumen_nvfp4_decode_rows", decode), ("lumen_i8_rows", i8), ("lumen_i8_rows_q8", i8q),
                    ("lumen_i8_gemm", i8_gemm), ("lumen_f32_dots", dots), ("lumen_amx_dots", amx),
                    ("lumen_nvfp4_decode_rows_bf16", decode16), ("lumen_fp8_decode_rows_bf16", decode8),
                    ("lumen_f32_pairs", pairs), ("lumen_bf16_from_pairs", from_pairs)):
        binding.add_symbol(name, f.address)
        _fallbacks.append(f)


_fallbacks: list = []
if not available:
    _register_fallbacks()


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


# -- routed experts of one token (decode) ---------------------------------------------------------------------------
# One call a layer: one parallel region in which every thread runs lumen_moe_worker (_native_moe.c: tasks claimed
# from shared counters, the down rows of a slot started as soon as its h is complete), then the weighted sum.
# Each valid (token, slot) pair is its own task list: an expert picked by two tokens is read twice, so this path is
# for one token (moe_fused's sorted kernels share an expert's rows between tokens).
# lumen_moe_worker(fmt, n, ex, tok, H, I, A, E, gs, blk, x, xq, xs, h, hq, hs, ys, act, cgu, cd, pf, ctr)
moe_worker = types.ExternalFunction("lumen_moe_worker", types.void(*[_i] * 22))
# out[i] = NVFP4 row r0 + i . x with x quantized per 16 values: (w, ldw, s, lds, r0, n, K, xq, xs, gs, out, pf)
nvfp4_rows_q8 = types.ExternalFunction("lumen_nvfp4_rows_q8",
                                       types.void(_i, _i, _i, _i, _i, _i, _i, _i, _i, types.float32, _i, _i))
# C[r * ldc + t] = B[r] . X[idx[t]], r < R, t < m: (B, R, K, X, ldx, idx, m, C, ldc), B's rows K apart. Returns 0
# where it has no kernel (below AVX-512, K not a multiple of 16; without the library: the cfunc) and computed
# nothing: moe_fused's numba kernel runs then.
f32_dots = types.ExternalFunction("lumen_f32_dots", types.int64(*[_i] * 9))
# Several tokens' NVFP4 / fp8 expert products in AMX tiles (_native_amx.c): NVFP4 rows without the global scale, exact
# in bf16: (w, ldw, s, lds, r0, n, K, N, out, ldo) with out uint16; fp8 rows without their block scales, exact in bf16:
# (w, ldw, r0, n, K, N, out, ldo), both read LUMEN_CPU_PREFETCH bytes ahead within the matrix's N rows; tokens X[idx[t]]
# laid out for the tiles in f32: (X, ldx, idx, m, K, F); from that, `parts` bf16 planes of the tokens: 3 = hi + mid +
# lo, exact (the default), 1 = rounded to bf16 (cpu.compute-quantization bf16): (F, m, K, parts, P); and C[r * ldc + t]
# (tm 0) or C[t * ldc + r] (tm 1) = gs * W[r] . token t summed over the parts, W's rows ldW apart, each block of bc
# columns times srow[block] (an fp8 row block's scales; srow 0: none): (W, ldW, R, K, P, m, parts, srow, bc, C, ldc,
# tm, gs), returning 0 below the amx level (nothing computed).
nvfp4_decode_rows_bf16 = types.ExternalFunction("lumen_nvfp4_decode_rows_bf16", types.void(*[_i] * 10))
fp8_decode_rows_bf16 = types.ExternalFunction("lumen_fp8_decode_rows_bf16", types.void(*[_i] * 8))
f32_pairs = types.ExternalFunction("lumen_f32_pairs", types.void(*[_i] * 6))
bf16_from_pairs = types.ExternalFunction("lumen_bf16_from_pairs", types.void(*[_i] * 5))
amx_dots = types.ExternalFunction("lumen_amx_dots", types.int64(*[_i] * 12, types.float32))
# (x, K, xq, xs): x (K,) f32 -> xq (K,) int8 and xs (K / 16,) f32, a scale per 16 values
quant16 = types.ExternalFunction("lumen_quant16", types.void(_i, _i, _i, _i))
FP8, NVFP4, NVFP4_Q8 = 0, 1, 2  # lumen_moe_worker's formats


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


@njit(cache=True, parallel=True)
def moe_token(fmt, A, gs, blk, I, x, ids, wts, act, threads, cgu, cd, pf):
    """Routed experts of x (T, H), ids / wts (T, k): the weighted sum of each token's experts (T, H). fmt: FP8,
    NVFP4 or NVFP4_Q8; A (6, E): the addresses of each expert's gate, up and down codes, then of their scales (fp8:
    f32 block scales; NVFP4: e4m3 bytes); gs (3, E): NVFP4 global scales; blk (6,): fp8's scale layout (scales a
    row of gate / up, of down; the gate / up scale block's rows and columns, down's). cgu / cd: rows a task of
    gate and up / of down (cgu a multiple of 16 for NVFP4_Q8); pf: bytes the row kernels read ahead (prefetch)."""
    T, H = x.shape
    E = A.shape[1]
    ex, tok, flat = _slots(ids, E)
    n = ex.shape[0]
    xin, xq, xs = x, np.empty((1, 1), np.int8), np.empty((1, 1), F32)
    h = np.empty((n, I), F32)
    hq, hs = np.empty((1, 1), np.int8), np.empty((1, 1), F32)
    if fmt == NVFP4:
        xin = np.empty((T, H), F32)
        for t in range(T):
            nvfp4_permute(x[t:].ctypes.data, H, xin[t:].ctypes.data)
    elif fmt == NVFP4_Q8:
        xq, xs = np.empty((T, H), np.int8), np.empty((T, H // 16), F32)
        for t in range(T):
            quant16(x[t:].ctypes.data, H, xq[t:].ctypes.data, xs[t:].ctypes.data)
        hq, hs = np.empty((n, I), np.int8), np.empty((n, I // 16), F32)
    ys = np.empty((n, H), F32)
    ctr = np.zeros(2 + n, np.int64)
    nw = max(1, min(threads, n * ((I + cgu - 1) // cgu)))
    for _ in prange(nw):
        moe_worker(fmt, n, ex.ctypes.data, tok.ctypes.data, H, I, A.ctypes.data, E, gs.ctypes.data, blk.ctypes.data,
                   xin.ctypes.data, xq.ctypes.data, xs.ctypes.data, h.ctypes.data, hq.ctypes.data, hs.ctypes.data,
                   ys.ctypes.data, act, cgu, cd, pf, ctr.ctypes.data)
    return _combine(ys, tok, flat, wts, T, H)
