"""The attention kernels' fragment bookkeeping (kernels/flash_mma.cu), on the CPU: one warp's ldmatrix addresses,
the MMA fragments those loads make, and the reuse of the score accumulators as P's A fragments, replayed lane by lane
through a numpy emulation of ``ldmatrix`` and ``mma.sync`` written from the PTX ISA's fragment tables, against plain
matrix products. Integer-valued data, so every comparison is exact. The address formulas below are the kernel's
(``a_row`` / ``b_row`` / ``v_row``, ``fm_vt_key``), copied; a change there must be made here too. This cannot catch
what only hardware shows (a wrong PTX operand order, bank conflicts); the GPU tests in tests/test_cuda_flash.py do.
"""

from __future__ import annotations

import numpy as np
import pytest

LANES = np.arange(32)
G, T4 = LANES >> 2, LANES & 3  # groupID, threadID_in_group


# -- the ISA's fragments ----------------------------------------------------------------------------------------------
def ldmatrix_x4(mem, rows, cols, trans=False):
    """mem (R, C) of 16-bit elements; lane i gives the address (rows[i], cols[i]) of row i % 8 of matrix i // 8.
    -> regs (32, 4, 2): lane's register j = two elements of matrix j: (row lane // 4, columns 2 (lane % 4) + 0, 1),
    or with ``trans`` (rows 2 (lane % 4) + 0, 1, column lane // 4)."""
    regs = np.zeros((32, 4, 2), mem.dtype)
    for j in range(4):
        mat = np.stack([mem[rows[8 * j + r], cols[8 * j + r]:cols[8 * j + r] + 8] for r in range(8)])  # (8, 8)
        for lane in range(32):
            if trans:
                regs[lane, j] = mat[2 * T4[lane]:2 * T4[lane] + 2, G[lane]]
            else:
                regs[lane, j] = mat[G[lane], 2 * T4[lane]:2 * T4[lane] + 2]
    return regs


def mma_m16n8k16(a, b):
    """a (32, 4, 2), b (32, 2, 2) lane registers of m16n8k16 (bf16 elements) -> the (16, 8) product, from the ISA's
    tables: a reg r = (row g + 8 (r & 1), k 2t + 8 (r >> 1) + 0, 1); b reg r = (k 2t + 8 r + 0, 1, n g)."""
    A, B = np.zeros((16, 16)), np.zeros((16, 8))
    for lane in range(32):
        g, t = G[lane], T4[lane]
        for r in range(4):
            A[g + 8 * (r & 1), 2 * t + 8 * (r >> 1) + np.arange(2)] = a[lane, r]
        for r in range(2):
            B[2 * t + 8 * r + np.arange(2), g] = b[lane, r]
    return A @ B


def mma_m16n8k32(a, b):
    """The same for m16n8k32 with 8-bit elements: a (32, 4, 4), b (32, 2, 4); a reg r = (row g + 8 (r & 1), k 4t +
    16 (r >> 1) + 0..3); b reg r = (k 4t + 16 r + 0..3, n g)."""
    A, B = np.zeros((16, 32)), np.zeros((32, 8))
    for lane in range(32):
        g, t = G[lane], T4[lane]
        for r in range(4):
            A[g + 8 * (r & 1), 4 * t + 16 * (r >> 1) + np.arange(4)] = a[lane, r]
        for r in range(2):
            B[4 * t + 16 * r + np.arange(4), g] = b[lane, r]
    return A @ B


def c_fragment(c):
    """A (16, 8) accumulator as the lanes hold it: (32, 4), c0, c1 = (row g, n 2t + 0, 1), c2, c3 = (row g + 8, ..)."""
    return np.stack([np.concatenate([c[G[lane], 2 * T4[lane]:2 * T4[lane] + 2],
                                     c[G[lane] + 8, 2 * T4[lane]:2 * T4[lane] + 2]]) for lane in range(32)])


def from_c_fragments(frags):
    """(32, 4) per 8-column block -> the (16, 8 x blocks) matrix."""
    out = np.zeros((16, 8 * len(frags)))
    for nb, f in enumerate(frags):
        for lane in range(32):
            g, t = G[lane], T4[lane]
            out[g, 8 * nb + 2 * t:8 * nb + 2 * t + 2] = f[lane, :2]
            out[g + 8, 8 * nb + 2 * t:8 * nb + 2 * t + 2] = f[lane, 2:]
    return out


def bytes_as_u16(x):
    return np.ascontiguousarray(x.astype(np.uint8)).view(np.uint16)


def u16_pairs_as_bytes(regs):
    """(32, n, 2) uint16 registers -> (32, n, 4) bytes, lowest first (little endian, as the hardware packs them)."""
    return np.ascontiguousarray(regs.astype(np.uint16)).view(np.uint8).reshape(regs.shape[0], regs.shape[1], 4)


# -- the kernel's addresses (flash_mma.cu) ----------------------------------------------------------------------------
def a_rows(wr):  # a_row = wr + (lane & 7) + 8 ((lane >> 3) & 1)
    return wr + (LANES & 7) + 8 * ((LANES >> 3) & 1)


B_ROW = (LANES & 7) + 8 * (LANES >> 4)  # b_row
V_ROW = (LANES & 7) + 8 * ((LANES >> 3) & 1)  # v_row (bf16 kernel, ldmatrix.trans)


def fm_vt_key(L):
    return 2 * (L >> 2) + (L & 1) + 8 * ((L >> 1) & 1)


@pytest.mark.parametrize("warp", [0, 2])
def test_bf16_kernel_scores_and_p_times_v(warp):
    """flash_mma: S (16 x BN) of warp ``warp`` from the query rows and the K tile (A by ldmatrix at a_row, 8 (lane >>
    4); B by ldmatrix at nb 8 + b_row, 8 ((lane >> 3) & 1)), then O = P V with P's A fragments taken from the score
    accumulators (s[2kb], s[2kb + 1]) and V's B fragments by ldmatrix.trans at kb 16 + v_row, vb 8 + 8 (lane >> 4)."""
    rng = np.random.default_rng(warp)
    ROWS, D, BN, DV = 64, 64, 32, 32
    Q = rng.integers(-4, 5, size=(ROWS, D + 8)).astype(np.float64)  # (rows, D + 8): the padded shared rows
    K = rng.integers(-4, 5, size=(BN, D + 8)).astype(np.float64)
    V = rng.integers(-4, 5, size=(BN, DV + 8)).astype(np.float64)
    wr = 16 * warp
    s = [np.zeros((32, 4)) for _ in range(BN // 8)]
    for kb in range(0, D, 16):
        a = ldmatrix_x4(Q, a_rows(wr), kb + 8 * (LANES >> 4))
        for nb in range(0, BN // 8, 2):
            b = ldmatrix_x4(K, nb * 8 + B_ROW, kb + 8 * ((LANES >> 3) & 1))
            s[nb] += c_fragment(mma_m16n8k16(a, b[:, 0:2]))
            s[nb + 1] += c_fragment(mma_m16n8k16(a, b[:, 2:4]))
    S = from_c_fragments(s)
    np.testing.assert_array_equal(S, Q[wr:wr + 16, :D] @ K[:, :D].T)

    acc = [np.zeros((32, 4)) for _ in range(DV // 8)]
    for kb in range(BN // 16):
        pa = np.stack([s[2 * kb][:, 0:2], s[2 * kb][:, 2:4], s[2 * kb + 1][:, 0:2], s[2 * kb + 1][:, 2:4]], axis=1)
        for vb in range(0, DV // 8, 2):
            b = ldmatrix_x4(V, kb * 16 + V_ROW, vb * 8 + 8 * (LANES >> 4), trans=True)
            acc[vb] += c_fragment(mma_m16n8k16(pa, b[:, 0:2]))
            acc[vb + 1] += c_fragment(mma_m16n8k16(pa, b[:, 2:4]))
    np.testing.assert_array_equal(from_c_fragments(acc), S @ V[:, :DV])


@pytest.mark.parametrize("warp", [0, 3])
def test_fp8_kernel_scores_and_p_times_v_through_the_permuted_v(warp):
    """flash_fp8: the same with 8-bit elements (ldmatrix moves byte pairs: columns in bytes, 16 a matrix row), P's A
    fragment packed from the accumulators of four 8-key blocks (s0[0], s0[1], s1[0], s1[1] | s0[2], s0[3], s1[2],
    s1[3] | the same of s2, s3), V read from fp8_vt's layout (each 16 keys in fm_vt_key's order, V transposed) by plain
    ldmatrix at vb 8 + b_row, kb 32 + 16 ((lane >> 3) & 1)."""
    rng = np.random.default_rng(10 + warp)
    ROWS, D, BN, DV = 64, 64, 64, 32
    Qb = rng.integers(0, 6, size=(ROWS, D + 16))  # byte values: small, so products stay exact
    Kb = rng.integers(0, 6, size=(BN, D + 16))
    Vb = rng.integers(0, 6, size=(BN, DV))
    wr = 16 * warp
    Q16, K16 = bytes_as_u16(Qb), bytes_as_u16(Kb)  # the shared rows as 16-bit columns
    s = [np.zeros((32, 4)) for _ in range(BN // 8)]
    for kb in range(0, D, 32):
        a = u16_pairs_as_bytes(ldmatrix_x4(Q16, a_rows(wr), (kb + 16 * (LANES >> 4)) // 2))
        for nb in range(0, BN // 8, 2):
            b = u16_pairs_as_bytes(ldmatrix_x4(K16, nb * 8 + B_ROW, (kb + 16 * ((LANES >> 3) & 1)) // 2))
            s[nb] += c_fragment(mma_m16n8k32(a, b[:, 0:2]))
            s[nb + 1] += c_fragment(mma_m16n8k32(a, b[:, 2:4]))
    S = from_c_fragments(s)
    np.testing.assert_array_equal(S, Qb[wr:wr + 16, :D] @ Kb[:, :D].T)

    P = (S % 7).astype(np.uint8)  # stand-in codes for e4m3(p x 448): any byte per (row, key)
    p = [c_fragment(P[:, 8 * nb:8 * nb + 8].astype(np.float64)) for nb in range(BN // 8)]
    Vt = np.zeros((DV, BN + 16), np.uint8)  # fp8_vt's layout of the tile, padded as the kernel's shared rows
    for L in range(BN):
        Vt[:, L] = Vb[16 * (L // 16) + fm_vt_key(L % 16)]
    Vt16 = bytes_as_u16(Vt)
    acc = [np.zeros((32, 4)) for _ in range(DV // 8)]
    for kb in range(BN // 32):
        s0, s1, s2, s3 = p[4 * kb:4 * kb + 4]
        pa = np.stack([np.stack([s0[:, 0], s0[:, 1], s1[:, 0], s1[:, 1]], 1),
                       np.stack([s0[:, 2], s0[:, 3], s1[:, 2], s1[:, 3]], 1),
                       np.stack([s2[:, 0], s2[:, 1], s3[:, 0], s3[:, 1]], 1),
                       np.stack([s2[:, 2], s2[:, 3], s3[:, 2], s3[:, 3]], 1)], axis=1)  # (32, 4, 4)
        for vb in range(0, DV // 8, 2):
            b = u16_pairs_as_bytes(ldmatrix_x4(Vt16, vb * 8 + B_ROW, (kb * 32 + 16 * ((LANES >> 3) & 1)) // 2))
            acc[vb] += c_fragment(mma_m16n8k32(pa, b[:, 0:2]))
            acc[vb + 1] += c_fragment(mma_m16n8k32(pa, b[:, 2:4]))
    np.testing.assert_array_equal(from_c_fragments(acc), P.astype(np.float64) @ Vb)


def test_fm_vt_key_is_a_permutation_of_16():
    assert sorted(fm_vt_key(L) for L in range(16)) == list(range(16))
    assert [fm_vt_key(L) for L in range(8)] == [0, 1, 8, 9, 2, 3, 10, 11]
