"""The arithmetic of the tensor-core flash kernel (``kernels/flash_mma.cu``) in numpy, to pin its accuracy on the
CPU: the f32 queries and probabilities as three bf16 planes that sum to them exactly, each product of a plane and a
bf16 key or value exact, each m16n8k16 MMA's sixteen products summed and added to its f32 accumulator, the online
softmax of the f32 kernel over tiles of ``bn`` keys. tests/test_flash_mma_model.py compares it with float64
attention; the GPU tests compare the kernel itself with the CuPy path.
"""

from __future__ import annotations

import numpy as np

F32 = np.float32


def bf16(x):
    """f32 -> the nearest bf16 value (ties to even), as f32."""
    u = np.ascontiguousarray(x, dtype=F32).view(np.uint32)
    u = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return u.view(F32)


def planes(x, n: int = 3):
    """x f32 -> n bf16 planes (as f32): hi = bf16(x), mid = bf16(x - hi), lo = bf16(x - hi - mid)."""
    out, r = [], np.asarray(x, dtype=F32)
    for _ in range(n):
        p = bf16(r)
        out.append(p)
        r = (r - p).astype(F32)
    return out


def mma_product(a_planes, b, acc, k: int = 16):
    """acc (M, N) f32 += sum over planes and k-wide blocks of A_p B^T: each block's exact products summed in float64
    and rounded once to f32 (the MMA: k = 16 for bf16, 32 for e4m3), then added to the f32 accumulator in order."""
    K = b.shape[1]
    for k0 in range(0, K, k):
        for a in a_planes:
            part = a[:, k0:k0 + k].astype(np.float64) @ b[:, k0:k0 + k].astype(np.float64).T
            acc = (acc + part.astype(F32)).astype(F32)
    return acc


def online_softmax(m, l, s):
    """One tile of the kernels' online softmax: row maxima m, sums l (f32) and the tile's masked scores s (rows, keys;
    -inf where masked) -> (m, l, p, alpha): p = e^(s - m_new), l = l alpha + the f32 sum of p, alpha = e^(m_old -
    m_new), 0 for rows that have seen nothing."""
    mn = np.maximum(m, s.max(axis=1))
    mu = np.where(np.isneginf(mn), F32(0), mn)
    alpha = np.exp(m - mu).astype(F32)
    p = np.exp(s - mu[:, None]).astype(F32)
    return mn, (l * alpha + p.sum(axis=1, dtype=F32)).astype(F32), p, alpha


def attend(q, keys, vals, start: int, lo: int, scale: float, window=None, softcap=None, bn: int = 64, n: int = 3):
    """q (T, Hq, D) f32, keys (Hkv, S, D) / vals (Hkv, S, Dv) holding bf16 values -> (T, Hq, Dv) f32, as the kernel
    computes it (``n`` planes; the kernel's is 3)."""
    T, Hq, D = q.shape
    Hkv, S, _ = keys.shape
    G = Hq // Hkv
    out = np.zeros((T, Hq, vals.shape[2]), F32)
    qpos = start + np.arange(T)
    for h in range(Hkv):
        qh = q[:, h * G:(h + 1) * G].reshape(T * G, D)  # rows r = t G + g
        rpos = np.repeat(qpos, G)
        qp = planes(qh, n)
        m = np.full(T * G, -np.inf, F32)
        l = np.zeros(T * G, F32)
        acc = np.zeros((T * G, vals.shape[2]), F32)
        for j0 in range(0, S, bn):
            k, v = keys[h, j0:j0 + bn], vals[h, j0:j0 + bn]
            s = mma_product(qp, k, np.zeros((T * G, k.shape[0]), F32)) * F32(scale)
            if softcap:
                s = (np.tanh(s / F32(softcap)) * F32(softcap)).astype(F32)
            kpos = lo + j0 + np.arange(k.shape[0])
            ok = kpos[None, :] <= rpos[:, None]
            if window:
                ok &= kpos[None, :] > rpos[:, None] - window
            m, l, p, alpha = online_softmax(m, l, np.where(ok, s, -np.inf).astype(F32))
            acc = mma_product(planes(p, n), np.ascontiguousarray(v.T), acc * alpha[:, None])
        out[:, h * G:(h + 1) * G] = (acc / l[:, None]).reshape(T, G, -1)
    return out
