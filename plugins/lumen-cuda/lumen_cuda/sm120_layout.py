"""The SM120 native NVFP4 prefill GEMM (kernels/mma_sm120.cu) on paper: how weights and activations are packed into
the layout the MMA fragments read, the activation quantizer, and a numerics model of the block-scaled MMA. Pure
numpy (importing this module never imports CuPy), so the CPU tests check it; the packing functions take an array
module ``xp`` and run unchanged on CuPy arrays (lumen_cuda.sm120 packs on the device with them).

The instruction (PTX ISA, "Block Scaling for mma.sync"; sm_120a / sm_120f):

    mma.sync.aligned.kind::mxf4nvf4.block_scale.scale_vec::4X.m16n8k64.row.col.f32.e2m1.e2m1.f32.ue4m3
    D (16 x 8, f32) = (A (16 x 64, e2m1) * SF_A (16 x 4, ue4m3)) . (B (64 x 8, e2m1) * SF_B (4 x 8, ue4m3)) + C

A holds 16 weight rows, B 8 tokens; one ue4m3 scale per row (column) and 16 k. Fragments (lane = 4 g + t):
A a0..a3 = row g k 8t.. | row g+8 k 8t.. | row g k 32+8t.. | row g+8 k 32+8t.. (8 e2m1 each, lowest k in the low
nibble); B b0, b1 = column g, k 8t.. and k 32+8t..; C/D c0..c3 = (g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1).
Scales with selectors (byte-id 0, thread-id 0): lane 4 (m % 8) + m // 8 holds row m's four scales (byte i = k block
i), lane 4 n holds column n's. Nothing here was run on an SM120 GPU: the layout is the ISA's tables, the model the
ISA's definition (products exact, f32 accumulation); docs/cuda.md, "SM120 native MMA (issue 21)".
"""

from __future__ import annotations

import numpy as np

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)
X_MAX = np.float32(6.0 * 448.0)  # the largest |value| one plane represents per unit of its per-token scale
MAX_TERMS = 3
OPTION = "LUMEN_CUDA_SM120_MMA"  # activation planes of the native NVFP4 prefill: 0 / unset = off, 1..3
NATIVE_CAPABILITIES = ("120", "121")  # CuPy's compute_capability strings the kernel is compiled for (sm_<cc>a)


def requested_terms(environ) -> int:
    """``LUMEN_CUDA_SM120_MMA`` from ``environ``: 0 where unset, empty or "0", else 1..3 planes; anything else is a
    clear error (never a silent default)."""
    raw = environ.get(OPTION, "").strip()
    if raw in ("", "0"):
        return 0
    if raw in {str(t) for t in range(1, MAX_TERMS + 1)}:
        return int(raw)
    raise ValueError(f"{OPTION}={raw!r}: expected 0 (off) or the number of NVFP4 activation planes, 1 to "
                     f"{MAX_TERMS} (docs/cuda.md, SM120 native MMA)")


def native_capability(cc) -> bool:
    """Whether a device of compute capability ``cc`` (CuPy's string, e.g. "120"; or a (major, minor) pair) runs the
    native kernel: 12.0 and 12.1 (compiled for sm_120a / sm_121a); Hopper (9.0) and everything else: no."""
    if isinstance(cc, tuple):
        cc = f"{cc[0]}{cc[1]}"
    return str(cc) in NATIVE_CAPABILITIES


def use_native(cc, environ) -> int:
    """The planes the NVFP4 prefill uses natively on a device of capability ``cc`` (0: the generic path)."""
    terms = requested_terms(environ)
    return terms if terms and native_capability(cc) else 0


def e4m3_table() -> np.ndarray:
    """The f32 value of each e4m3fn byte (NaN at 0x7f / 0xff), as lumen_cuda.gemv's table."""
    b = np.arange(256)
    e, m = (b >> 3) & 15, (b & 7).astype(np.float64)
    v = np.where(e == 0, m / 8 * 2.0**-6, (1 + m / 8) * 2.0 ** (e - 7))
    v = np.where((e == 15) & (m == 7), np.nan, v) * np.where(b >> 7, -1.0, 1.0)
    return v.astype(np.float32)


E4M3 = e4m3_table()


def e4m3_rne(x) -> np.ndarray:
    """f32 x >= 0 -> the nearest e4m3fn code, ties to even, saturated at 448 (0x7e); 0 for x <= 0 or NaN. The bit
    arithmetic of ``e4m3_rne`` in kernels/mma_sm120.cu."""
    x = np.asarray(x, dtype=np.float32)
    u = x.view(np.uint32).astype(np.int64)
    e = (u >> 23) - 120
    m = (u >> 20) & 7
    rest = u & 0xFFFFF
    up = (rest > 0x80000) | ((rest == 0x80000) & ((m & 1) == 1))
    m = m + up
    e = e + (m == 8)
    m = np.where(m == 8, 0, m)
    normal = np.minimum((e << 3) | m, 0x7E)
    with np.errstate(invalid="ignore", over="ignore"):
        sub = np.rint(x.astype(np.float32) * np.float32(512.0)).astype(np.float64)
    sub = np.nan_to_num(sub).astype(np.int64)
    code = np.where(x < np.float32(0.015625), sub, normal)
    code = np.where(x >= np.float32(448.0), 0x7E, code)
    code = np.where(x > 0, code, 0)
    return code.astype(np.uint8)


def e2m1_rne(v) -> np.ndarray:
    """f32 -> e2m1 code (sign << 3 | index of 0, .5, 1, 1.5, 2, 3, 4, 6): nearest, ties to the even index,
    saturated at 6 (the thresholds of ``e2m1_rne`` in kernels/mma_sm120.cu)."""
    v = np.asarray(v, dtype=np.float32)
    a = np.abs(v)
    i = np.full(a.shape, 7, dtype=np.uint8)
    for bound, idx, inclusive in ((5.0, 6, True), (3.5, 5, False), (2.5, 4, True), (1.75, 3, False),
                                  (1.25, 2, True), (0.75, 1, False), (0.25, 0, True)):
        i = np.where(a <= bound if inclusive else a < bound, np.uint8(idx), i)
    return (i | np.where(v < 0, 8, 0).astype(np.uint8)).astype(np.uint8)


# -- the activation quantizer (the model of sm120_quantize_x) -----------------------------------------------------
def quantize_group(r: np.ndarray, gx: np.ndarray):
    """r (T, G, 16) f32 residuals, gx (T,) f32 -> (codes (T, G, 16) uint8, scales (T, G) uint8, the next residual):
    s = e4m3(amax16 / (gx * 6)), d = s * gx, code = e2m1(r / d), next = r - (e2m1 * s) * gx, each step in f32."""
    f = np.float32
    g = gx.astype(f)[:, None]
    amax = np.abs(r).max(axis=-1)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        target = (amax / (g * f(6.0))).astype(f)
        sc = np.where(g > 0, e4m3_rne(target), 0).astype(np.uint8)
        s = E4M3[sc]
        d = (s * g).astype(f)
        q = (r / d[..., None]).astype(f)
    codes = np.where(d[..., None] > 0, e2m1_rne(q), 0).astype(np.uint8)
    deq = ((E2M1[codes] * s[..., None]).astype(f) * g[..., None]).astype(f)
    return codes, sc, (r - deq).astype(f)


def quantize_x(x: np.ndarray, terms: int):
    """x (T, K) f32, K % 16 == 0 -> (codes (terms, T, K) uint8 e2m1 codes one per byte, scales (terms, T, K/16)
    e4m3 codes, gx (terms, T) f32): plane j quantizes the residual x - q_0 - ... - q_{j-1} with its own per-token
    scale gx_j = amax_j / (6 * 448). A token with a non-finite value gets gx = NaN in every plane."""
    if not 1 <= terms <= MAX_TERMS:
        raise ValueError(f"terms must be 1..{MAX_TERMS}, not {terms}")
    x = np.asarray(x, dtype=np.float32)
    T, K = x.shape
    if K % 16:
        raise ValueError(f"K = {K} is not a multiple of 16")
    bad = ~np.isfinite(x).all(axis=1)
    r = np.where(np.isfinite(x), x, 0).reshape(T, K // 16, 16).astype(np.float32)
    codes, scales, gxs = [], [], []
    for _ in range(terms):
        gx = (np.abs(r).reshape(T, -1).max(axis=1, initial=0) / X_MAX).astype(np.float32)
        c, s, r = quantize_group(r, gx)
        codes.append(c.reshape(T, K))
        scales.append(s)
        gxs.append(np.where(bad, np.float32(np.nan), gx))
    return np.stack(codes), np.stack(scales), np.stack(gxs).astype(np.float32)


def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """(..., K) codes -> (..., K/2) bytes, element 2i in the low nibble (the NVFP4 Weight layout)."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def dequantize_x(codes, scales, gx) -> np.ndarray:
    """The f32 activations the planes stand for, sum over planes of (e2m1 * scale) * gx (float64 sum)."""
    P, T, K = codes.shape
    v = (E2M1[codes].reshape(P, T, K // 16, 16) * E4M3[scales][..., None]).astype(np.float32)
    v = (v * gx[:, :, None, None]).astype(np.float32)
    return v.astype(np.float64).sum(axis=0).reshape(T, K)


# -- packing into the fragment layouts ----------------------------------------------------------------------------
def _pad(xp, a, rows: int, cols: int):
    if a.shape == (rows, cols):
        return xp.ascontiguousarray(a)
    out = xp.zeros((rows, cols), dtype=a.dtype)
    out[:a.shape[0], :a.shape[1]] = a
    return out


def padded(n: int, m: int) -> int:
    return -(-n // m) * m


def pack_weight(data, block, xp=np):
    """An NVFP4 weight -> (wq (N16/16, K64/64, 32, 16) uint8, ws (N16/16, K64/64, 16, 4) uint8) for the A fragments.
    data (N, K/2) packed codes, block (N, K/16) e4m3 scales. A block whose scale has the sign bit set gets the
    sign moved onto its 16 codes (ue4m3 has no sign; negating e2m1 is exact); N and K are padded with zeros."""
    N, half = data.shape
    K = 2 * half
    if block.shape != (N, K // 16) or K % 16:
        raise ValueError(f"NVFP4 block scales {block.shape} for codes {data.shape}")
    neg = (block & 0x80) != 0
    flip = (neg.astype(xp.uint8) * 0x88)[:, :, None]
    data = (data.reshape(N, K // 16, 8) ^ flip).reshape(N, half)
    block = block & 0x7F
    Np, Kp = padded(N, 16), padded(K, 64)
    d = _pad(xp, data, Np, Kp // 2).reshape(Np // 16, 2, 8, Kp // 64, 2, 4, 4)  # nt, h, g, kt, half, t, byte
    wq = d.transpose(0, 3, 2, 5, 4, 1, 6).reshape(Np // 16, Kp // 64, 32, 16)  # lane (g, t), reg (half, h)
    s = _pad(xp, block, Np, Kp // 16).reshape(Np // 16, 2, 8, Kp // 64, 4)  # nt, h, g, kt, k block
    ws = s.transpose(0, 3, 2, 1, 4).reshape(Np // 16, Kp // 64, 16, 4)  # slot 2 g + h
    return xp.ascontiguousarray(wq), xp.ascontiguousarray(ws)


def pack_x(codes, scales, xp=np):
    """Planes (P, T, K) codes (one per byte) and (P, T, K/16) scales -> (xq (P, T8/8, K64/64, 32, 8) uint8,
    xs (P, T8/8, K64/64, 8, 4) uint8): the B fragments sm120_quantize_x writes."""
    P, T, K = codes.shape
    Tp, Kp = padded(T, 8), padded(K, 64)
    packed = pack_nibbles(codes) if xp is np else (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(xp.uint8)
    xq = xp.stack([_pad(xp, packed[p], Tp, Kp // 2) for p in range(P)])
    xq = xq.reshape(P, Tp // 8, 8, Kp // 64, 2, 4, 4).transpose(0, 1, 3, 2, 5, 4, 6)  # p, tt, kt, g, t, half, b
    xs = xp.stack([_pad(xp, scales[p], Tp, Kp // 16) for p in range(P)])
    xs = xs.reshape(P, Tp // 8, 8, Kp // 64, 4).transpose(0, 1, 3, 2, 4)
    return (xp.ascontiguousarray(xq.reshape(P, Tp // 8, Kp // 64, 32, 8)),
            xp.ascontiguousarray(xs.reshape(P, Tp // 8, Kp // 64, 8, 4)))


# -- what each lane's registers hold (the ISA's fragment tables, read forward) -----------------------------------
def _nibbles(regs: np.ndarray) -> np.ndarray:
    """(..., R, 4) bytes of R 32-bit little-endian registers -> (..., R, 8) e2m1 codes, element 0 = low nibble."""
    b = regs.astype(np.uint8)
    return np.stack([b & 15, b >> 4], axis=-1).reshape(*b.shape[:-1], 8)


def a_fragments(wq: np.ndarray, ws: np.ndarray):
    """(A codes (N16, K64), SF_A (N16, K64/16)) as the MMA reads them from the packed weight: for each tile and lane
    the registers a0..a3 placed by the ISA's table (row g + 8 (i % 2), k 32 (i // 2) + 8 t + e for register i,
    element e), and the scale register of lane 4 (m % 8) + m // 8 for row m (byte i: k block i)."""
    NT, KT = wq.shape[:2]
    regs = _nibbles(wq.reshape(NT, KT, 32, 4, 4))  # nt, kt, lane, reg, element
    A = np.zeros((NT, 16, KT, 64), dtype=np.uint8)
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for i in range(4):
            A[:, g + 8 * (i % 2), :, 32 * (i // 2) + 8 * t: 32 * (i // 2) + 8 * t + 8] = regs[:, :, lane, i]
    sregs = np.stack([ws[:, :, (lane >> 2) * 2 + (lane & 1)] for lane in range(32)], axis=2)  # a lane's register
    SF = np.zeros((NT, 16, KT, 4), dtype=np.uint8)
    for m in range(16):
        SF[:, m] = sregs[:, :, 4 * (m % 8) + m // 8]
    return A.reshape(NT * 16, KT * 64), SF.reshape(NT * 16, KT * 4)


def b_fragments(xq: np.ndarray, xs: np.ndarray):
    """(B codes (P, T8, K64), SF_B (P, T8, K64/16)) from the packed planes: register b_i of lane (g, t) holds column
    g, k 32 i + 8 t + e; column n's scales are lane 4 n's register."""
    P, TT, KT = xq.shape[:3]
    regs = _nibbles(xq.reshape(P, TT, KT, 32, 2, 4))
    B = np.zeros((P, TT, 8, KT, 64), dtype=np.uint8)
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for i in range(2):
            B[:, :, g, :, 32 * i + 8 * t: 32 * i + 8 * t + 8] = regs[:, :, :, lane, i]
    SF = np.zeros((P, TT, 8, KT, 4), dtype=np.uint8)
    for n in range(8):
        SF[:, :, n] = xs[:, :, :, (4 * n) >> 2]
    return B.reshape(P, TT * 8, KT * 64), SF.reshape(P, TT * 8, KT * 4)


# -- the numerics model --------------------------------------------------------------------------------------------
def mma_model(wq, ws, gw: float, xq, xs, gx, N: int, T: int) -> np.ndarray:
    """y (T, N) f32 the kernel computes, through the fragments: per plane and 64-k tile, one MMA = the exact sum of
    its 64 scaled products (exact in float64: e2m1 x ue4m3 x e2m1 x ue4m3 have 12 significant bits and the 64 terms
    span under 2^50) rounded once to f32 and added to an f32 accumulator; then y = (sum_j acc_j * gx_j) * gw in f32.
    The hardware's internal order within one MMA is not specified by the ISA: a real SM120 result may differ from
    this in the last bits of each MMA's partial sum."""
    f = np.float32
    A, SFA = a_fragments(wq, ws)
    B, SFB = b_fragments(xq, xs)
    KT = A.shape[1] // 64
    wa = (E2M1[A].reshape(A.shape[0], KT * 4, 16) * E4M3[SFA][..., None]).astype(np.float64)
    xb = (E2M1[B].reshape(*B.shape[:2], KT * 4, 16) * E4M3[SFB][..., None]).astype(np.float64)
    wa = wa.reshape(A.shape[0], KT, 64)
    xb = xb.reshape(B.shape[0], B.shape[1], KT, 64)
    P = B.shape[0]
    y = np.zeros((B.shape[1], A.shape[0]), dtype=f)
    for p in range(P):
        acc = np.zeros((B.shape[1], A.shape[0]), dtype=f)
        for kt in range(KT):
            acc = (acc + (xb[p, :, kt] @ wa[:, kt].T).astype(f)).astype(f)
        term = (acc * np.pad(gx[p], (0, B.shape[1] - gx.shape[1]))[:, None]).astype(f)
        y = term if p == 0 else (y + term).astype(f)
    return (y * f(gw)).astype(f)[:T, :N]
