"""The SM120 native NVFP4 prefill GEMM (issue 21) on the CPU: numpy only, no CuPy, no GPU.

kernels/mma_sm120.cu has only been compiled (nvcc, sm_90 / sm_120a), never run: no SM120 GPU was available. What can
be checked without one is checked here, against lumen_cuda.sm120_layout:

(a) packing round trip: weights and activations packed for the MMA, then read back lane by lane and register by
    register with the PTX ISA's fragment tables for m16n8k64 (4-bit types) and the block-scale selectors, give the
    original codes and scales (with padding, and a negative block scale folded onto its codes);
(b) the numerics model of ``mma.sync ... kind::mxf4nvf4.block_scale.scale_vec::4X`` (exact products, f32
    accumulation per MMA) through the packed layout equals dequantize-then-matmul within an f32 summation bound;
    the error the activation quantization adds against the generic path's f32 result is measured at 512 x 4096 x
    4096 for 1, 2 and 3 planes and held to the bounds docs/cuda.md states;
(c) the selection logic: capability 9.0 (the H200) never takes the native path; 12.0 / 12.1 only with the option.
The real kernel's test is tests/test_cuda_sm120.py (skipped without an SM120 GPU: it has never run).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from lumen_cuda import sm120_layout as L

CU = Path(L.__file__).with_name("kernels") / "mma_sm120.cu"


def nvfp4_weight(rng, N, K, negative=()):
    """(codes (N, K) one per byte, packed data (N, K/2), e4m3 block scales (N, K/16)): every code, scales 0.25..~8;
    the blocks listed in ``negative`` get the sign bit set on their scale."""
    codes = rng.integers(0, 16, size=(N, K), dtype=np.uint8)
    block = rng.integers(0x28, 0x48, size=(N, K // 16), dtype=np.uint8)
    for r, b in negative:
        block[r, b] |= 0x80
    return codes, L.pack_nibbles(codes), block


def dequantize_weight(codes, block, gw):
    """The f32 matrix an NVFP4 weight stands for, (e2m1 x block scale) x global scale (kernels/nvfp4.cu's order)."""
    N, K = codes.shape
    v = (L.E2M1[codes].reshape(N, K // 16, 16) * L.E4M3[block][..., None]).astype(np.float32)
    return (v * np.float32(gw)).astype(np.float32).reshape(N, K)


# -- (a) packing round trip ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("N,K", [(40, 208), (3, 16), (130, 1040), (16, 64)])
def test_weight_packing_round_trips_through_the_a_fragments(N, K):
    rng = np.random.default_rng(N * 7 + K)
    neg = [(0, 0), (N - 1, K // 16 - 1)]
    codes, data, block = nvfp4_weight(rng, N, K, negative=neg)
    wq, ws = L.pack_weight(data, block)
    Np, Kp = L.padded(N, 16), L.padded(K, 64)
    assert wq.shape == (Np // 16, Kp // 64, 32, 16) and ws.shape == (Np // 16, Kp // 64, 16, 4)
    A, SFA = L.a_fragments(wq, ws)
    want = codes.copy()
    for r, b in neg:  # the sign moves from the scale onto the block's 16 codes
        want[r, 16 * b:16 * b + 16] ^= 8
    assert (A[:N, :K] == want).all()
    assert (A[N:] == 0).all() and (A[:, K:] == 0).all()  # padding: zero codes
    assert (SFA[:N, :K // 16] == (block & 0x7F)).all()
    assert (SFA[N:] == 0).all() and (SFA[:, K // 16:] == 0).all()
    # and the values are unchanged: -(e2m1) x |s| == e2m1 x (-s)
    np.testing.assert_array_equal(dequantize_weight(A[:N, :K], SFA[:N, :K // 16], 1.0),
                                  dequantize_weight(codes, block, 1.0))


@pytest.mark.parametrize("T,K,terms", [(13, 208, 1), (5, 64, 2), (64, 1040, 3), (1, 16, 1)])
def test_activation_packing_round_trips_through_the_b_fragments(T, K, terms):
    rng = np.random.default_rng(T + K)
    x = rng.standard_normal((T, K)).astype(np.float32)
    codes, scales, gx = L.quantize_x(x, terms)
    xq, xs = L.pack_x(codes, scales)
    Tp, Kp = L.padded(T, 8), L.padded(K, 64)
    assert xq.shape == (terms, Tp // 8, Kp // 64, 32, 8) and xs.shape == (terms, Tp // 8, Kp // 64, 8, 4)
    B, SFB = L.b_fragments(xq, xs)
    assert (B[:, :T, :K] == codes).all() and (B[:, T:] == 0).all() and (B[:, :, K:] == 0).all()
    assert (SFB[:, :T, :K // 16] == scales).all() and (SFB[:, T:] == 0).all()


def test_the_fragment_tables_cover_every_element_once():
    """Each (row, k) of a 16 x 64 A tile and each (k, column) of a 64 x 8 B tile is held by exactly one (lane,
    register, nibble): pack a tile of distinct positions and read it back."""
    # A: 16 rows x 64 k; a code per element can only hold 16 values, so check one bit-plane of the index at a time
    for bit in range(10):
        idx = np.arange(16 * 64).reshape(16, 64)
        codes = ((idx >> bit) & 1).astype(np.uint8)
        wq, ws = L.pack_weight(L.pack_nibbles(codes), np.zeros((16, 4), np.uint8))
        A, _ = L.a_fragments(wq, ws)
        assert (A == codes).all()
    assert L.pack_weight(L.pack_nibbles(np.zeros((16, 64), np.uint8)), np.zeros((16, 4), np.uint8))[0].size == 512


# -- quantizer pieces -------------------------------------------------------------------------------------------
def test_e4m3_rounding_is_nearest_ties_to_even_and_saturates():
    vals = L.E4M3[:0x7F].astype(np.float64)  # 0 .. 448, ascending
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.uniform(0, 500, 20000), rng.uniform(0, 0.03, 20000), (vals[1:] + vals[:-1]) / 2, vals,
                        [0.0, 1e-30, 448.0, 1e9]]).astype(np.float32)
    xd = x.astype(np.float64)
    hi = np.clip(np.searchsorted(vals, xd), 1, 126)
    lo = hi - 1
    dl, dh = xd - vals[lo], vals[hi] - xd
    want = np.where(dl < dh, lo, np.where(dh < dl, hi, np.where(lo % 2 == 0, lo, hi)))
    want = np.where(xd >= 448, 0x7E, np.where(xd <= 0, 0, want))
    np.testing.assert_array_equal(L.e4m3_rne(x), want)
    assert L.e4m3_rne(np.float32(np.nan)) == 0 and L.e4m3_rne(np.float32(-1.0)) == 0


def test_e2m1_rounding_is_nearest_ties_to_even_and_saturates():
    grid = L.E2M1[:8].astype(np.float64)
    x = np.concatenate([np.linspace(-8, 8, 4001), (grid[1:] + grid[:-1]) / 2, -(grid[1:] + grid[:-1]) / 2])
    got = L.e2m1_rne(x.astype(np.float32))
    d = np.abs(np.abs(x)[:, None] - grid[None, :])
    best = d.min(axis=1, keepdims=True)
    ties = d == best
    idx = np.where(ties[:, ::2].any(axis=1), np.argmax(ties & (np.arange(8) % 2 == 0), axis=1), np.argmax(ties, 1))
    np.testing.assert_array_equal(got & 7, idx)
    assert ((got >> 3) == (x < 0)).all()


def test_quantize_x_special_rows():
    x = np.random.default_rng(2).standard_normal((4, 64)).astype(np.float32)
    x[1] = 0
    x[2, 5] = np.nan
    x[3, 7] = np.inf
    codes, scales, gx = L.quantize_x(x, 2)
    assert (codes[:, 1] == 0).all() and (scales[:, 1] == 0).all() and (gx[:, 1] == 0).all()
    assert np.isnan(gx[:, 2]).all() and np.isnan(gx[:, 3]).all() and np.isfinite(gx[:, 0]).all()
    with pytest.raises(ValueError, match="multiple of 16"):
        L.quantize_x(np.zeros((2, 24), np.float32), 1)
    with pytest.raises(ValueError, match="terms"):
        L.quantize_x(x, 4)


# -- (b) numerics ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("N,K,T,terms", [(40, 208, 13, 1), (130, 1040, 37, 2), (64, 512, 8, 3)])
def test_mma_model_through_the_layout_equals_dequantize_then_matmul(N, K, T, terms):
    """Tolerance: the model rounds each MMA's exact 64-term sum to f32 and adds it to an f32 accumulator, KT adds,
    then <= 4 more f32 roundings (plane scale, plane sum, global scale): |y - ref| <= (KT + 4) 2^-24 (|X| |W|^T)."""
    rng = np.random.default_rng(N + K + T)
    codes, data, block = nvfp4_weight(rng, N, K, negative=[(1, 1)])
    gw = np.float32(0.0123)
    wq, ws = L.pack_weight(data, block)
    x = (rng.standard_normal((T, K)) * rng.uniform(0.1, 10, size=(T, 1))).astype(np.float32)
    qc, qs, gx = L.quantize_x(x, terms)
    xq, xs = L.pack_x(qc, qs)
    y = L.mma_model(wq, ws, gw, xq, xs, gx, N, T)
    W = dequantize_weight(codes, block, gw).astype(np.float64)
    X = L.dequantize_x(qc, qs, gx)
    ref = X @ W.T
    KT = L.padded(K, 64) // 64
    bound = (KT + 4) * 2.0**-24 * (np.abs(X) @ np.abs(W).T) + 1e-30
    assert y.shape == (T, N) and y.dtype == np.float32
    assert (np.abs(y - ref) <= bound).all(), np.abs(y - ref).max()


def test_model_of_a_nan_token_is_nan_only_there():
    rng = np.random.default_rng(3)
    codes, data, block = nvfp4_weight(rng, 16, 64)
    wq, ws = L.pack_weight(data, block)
    x = rng.standard_normal((9, 64)).astype(np.float32)
    x[4, 3] = np.nan
    qc, qs, gx = L.quantize_x(x, 1)
    y = L.mma_model(wq, ws, 1.0, *L.pack_x(qc, qs), gx, 16, 9)
    assert np.isnan(y[4]).all() and np.isfinite(np.delete(y, 4, axis=0)).all()


# Measured at 512 x 4096 x 4096 (docs/cuda.md states the numbers), error of the native path against the generic
# path's f32 result y = x . W^T (the same NVFP4 weight): ||Δ||_F / ||y||_F and max |Δ| / max |y|; measured 0.090 /
# 0.091 (1 plane), 0.0088 / 0.0090 (2), 0.00082 / 0.00076 (3). Bounds ~1.4x the measured values.
ERROR_BOUNDS = {1: (0.13, 0.13), 2: (0.013, 0.013), 3: (0.0012, 0.0012)}


def realistic_case(T=512, N=4096, K=4096, seed=4):
    """An NVFP4 weight quantized from a Gaussian (per-16 absmax scales, as a checkpoint's) and activations with a
    few outlier channels (1% of the channels x 20, as LLM hidden states have)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((N, K)).astype(np.float32) * 0.02
    g = np.float32(np.abs(w).max() / (6 * 448))
    blocks = w.reshape(N, K // 16, 16)
    block = L.e4m3_rne((np.abs(blocks).max(axis=-1) / (6 * g)).astype(np.float32))
    d = (L.E4M3[block] * g).astype(np.float32)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        codes = np.where(d > 0, L.e2m1_rne((blocks / d).astype(np.float32)), 0).astype(np.uint8).reshape(N, K)
    x = rng.standard_normal((T, K)).astype(np.float32)
    x[:, rng.choice(K, K // 100, replace=False)] *= 20
    return x, codes, block, g


def test_activation_quantization_error_against_the_generic_path_is_as_stated():
    x, codes, block, g = realistic_case()
    W = dequantize_weight(codes, block, g)
    y = x @ W.T  # the generic path's result (f32 activations; its own error vs this is ~5e-6)
    measured = {}
    for terms in (1, 2, 3):
        qc, qs, gx = L.quantize_x(x, terms)
        X = L.dequantize_x(qc, qs, gx).astype(np.float32)
        d = X @ W.T - y
        measured[terms] = (float(np.linalg.norm(d) / np.linalg.norm(y)), float(np.abs(d).max() / np.abs(y).max()))
    print("native NVFP4 activation planes, error vs f32 activations (frobenius, max):", measured)
    for terms, (fro, mx) in measured.items():
        assert fro <= ERROR_BOUNDS[terms][0] and mx <= ERROR_BOUNDS[terms][1], (terms, fro, mx)
    assert measured[1][0] > measured[2][0] > measured[3][0]  # each plane helps


# -- (c) selection ----------------------------------------------------------------------------------------------
def test_selection_needs_sm120_and_the_option():
    on = {L.OPTION: "1"}
    assert L.use_native("90", on) == 0  # the H200: always the generic path
    assert L.use_native((9, 0), {L.OPTION: "3"}) == 0
    assert L.use_native("100", on) == 0 and L.use_native("89", on) == 0
    assert L.use_native("120", {}) == 0 and L.use_native("120", {L.OPTION: "0"}) == 0
    assert L.use_native("120", {L.OPTION: ""}) == 0
    assert L.use_native("120", on) == 1 and L.use_native((12, 0), {L.OPTION: "2"}) == 2
    assert L.use_native("121", {L.OPTION: " 3 "}) == 3
    for bad in ("4", "yes", "-1", "1.5"):
        with pytest.raises(ValueError, match="LUMEN_CUDA_SM120_MMA"):
            L.use_native("120", {L.OPTION: bad})


def test_the_layout_module_imports_without_cupy():
    code = "import sys, lumen_cuda.sm120_layout; assert 'cupy' not in sys.modules, 'cupy imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_kernel_source_agrees_with_the_launcher_constants():
    """sm120.py's block shape (4 warps of 16 weight rows, 4 tiles of 8 tokens) and planes (1..3) are the .cu file's;
    sm120.py imports CuPy, so its constants are read from its source."""
    src = CU.read_text()
    host = Path(L.__file__).with_name("sm120.py").read_text()
    assert "#define SM120_WARPS 4" in src and "#define SM120_TOKEN_TILES 4" in src
    assert "WARPS = 4" in host and "TOKENS = 32" in host
    assert all(f"SM120_GEMM({t})" in src for t in range(1, L.MAX_TERMS + 1))
    assert "kind::mxf4nvf4.block_scale.scale_vec::4X.m16n8k64.row.col.f32.e2m1.e2m1.f32.ue4m3" in src
