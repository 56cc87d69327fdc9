"""lumen_cuda.fp8_attention_model (CPU, numpy): the arithmetic an FP8-MMA attention kernel is to compute (issue 21),
pinned before the kernel was written; benchmarks/fp8_attention_accuracy.py measures its perplexity cost."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

F32 = np.float32


@pytest.fixture(scope="module")
def model():
    from lumen_cuda import fp8_attention_model

    return fp8_attention_model


def reference(q, keys, vals, start, lo, scale, window=None):
    """f32 softmax attention in float64 (GQA by head groups)."""
    T, hq, _ = q.shape
    hkv, S, _ = keys.shape
    out = np.zeros((T, hq, vals.shape[2]))
    for t in range(T):
        for h in range(hq):
            kv = h // (hq // hkv)
            s = keys[kv].astype(np.float64) @ q[t, h] * scale
            pos = np.arange(lo, lo + S)
            ok = (pos <= start + t) & ((pos > start + t - window) if window else True)
            s = np.where(ok, s, -np.inf)
            p = np.exp(s - s.max())
            out[t, h] = p @ vals[kv] / p.sum()
    return out


def e4m3_values(rng, shape, spread=2.0):
    return (rng.normal(size=shape) * spread).astype(ml_dtypes.float8_e4m3fn).astype(F32)


def test_q_rows_scale_onto_e4m3(model):
    rng = np.random.default_rng(0)
    q = rng.normal(size=(5, 3, 64)).astype(F32) * 7
    q[1, 2] = 0
    codes, sq = model.quantize_q(q)
    assert np.abs(codes).max(axis=-1)[0, 0] == 448  # the row's largest magnitude lands on e4m3's largest value
    assert not codes[1, 2].any() and sq[1, 2, 0] == 1  # a zero row stays zero
    assert (codes.astype(ml_dtypes.float8_e4m3fn).astype(F32) == codes).all()
    amax = np.abs(q).max(axis=-1, keepdims=True)
    err = np.abs(codes * sq - q) / np.where(amax > 0, amax, 1)
    assert err.max() <= 2.0 ** -4  # e4m3 keeps 4 significant bits: within half a step of the row's largest value


def test_equal_scores_average_the_visible_values(model):
    """q = 0: every visible key scores the same, p = 1 goes in as 448 exactly, so each output is the plain mean of
    the values its query sees (causal, sliding window)."""
    rng = np.random.default_rng(1)
    T, S, start, lo, window = 6, 10, 4, 0, 5
    vals = e4m3_values(rng, (1, S, 8))
    got = model.attend(np.zeros((T, 2, 8), F32), e4m3_values(rng, (1, S, 8)), vals, start, lo, 0.125, window)
    for t in range(T):
        seen = [j for j in range(S) if j <= start + t and j > start + t - window]
        np.testing.assert_allclose(got[t, 0], vals[0, seen].mean(axis=0), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(got[t, 1], got[t, 0])


@pytest.mark.parametrize("window", [None, 7])
def test_close_to_f32_attention_but_not_equal(model, window):
    """Against float64 attention over the same e4m3 keys and values: the quantized Q and P move the output by at
    most a few percent of its scale (each p rounds by up to 2^-4 of itself; with 7 keys a query little of that
    averages out), never by zero (the rounding happens), and no query sees a later key."""
    rng = np.random.default_rng(2)
    T, hq, hkv, S, D = 12, 4, 2, 20, 32
    start, lo = S - T, 0
    q = rng.normal(size=(T, hq, D)).astype(F32)
    keys, vals = e4m3_values(rng, (hkv, S, D), 1.0), e4m3_values(rng, (hkv, S, D))
    scale = D ** -0.5
    got = model.attend(q, keys, vals, start, lo, scale, window)
    want = reference(q, keys, vals, start, lo, scale, window)
    rel = np.abs(got - want).max() / np.abs(want).max()
    assert 1e-5 < rel < 6e-2
    k2, v2 = keys.copy(), vals.copy()
    k2[:, -1] += 5  # the last key and value: only the last query sees them
    v2[:, -1] -= 5
    moved = model.attend(q, k2, v2, start, lo, scale, window)
    np.testing.assert_array_equal(moved[:-1], got[:-1])
    assert not np.array_equal(moved[-1], got[-1])


@pytest.mark.parametrize(("window", "softcap"), [(None, None), (40, 30.0)])
def test_tiled_order_one_tile_equals_the_row_max_form(model, window, softcap):
    """With every row's keys in one tile (and every query in one block), the running max is the row max: the
    kernel's order gives ``attend``'s result up to the order of f32 sums."""
    rng = np.random.default_rng(3)
    T, hq, hkv, D = 9, 4, 2, 64
    start = 20
    lo = 0 if window is None else max(0, start - window + 1)
    S = start - lo + T
    q = rng.normal(size=(T, hq, D)).astype(F32)
    keys, vals = e4m3_values(rng, (hkv, S, D), 1.0), e4m3_values(rng, (hkv, S, D))
    scale = 2 * D ** -0.5
    got = model.attend_tiled(q, keys, vals, start, lo, scale, window, softcap, bn=64, rows=64)
    want = model.attend(q, keys, vals, start, lo, scale, window, softcap)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())


@pytest.mark.parametrize(("window", "start"), [(None, 0), (50, 37)])
def test_tiled_order_over_many_tiles_stays_as_close_to_f32(model, window, start):
    """Many tiles and row blocks (the running max moves): the tiled result is no further from float64 attention than
    the row-max form is (both within 6% of the output scale: 4.4% here), and differs from it (P is rounded against
    another max)."""
    rng = np.random.default_rng(4)
    T, hq, hkv, D = 150, 4, 2, 64
    lo = 0 if window is None else max(0, start - window + 1)
    S = start - lo + T
    q = rng.normal(size=(T, hq, D)).astype(F32)
    keys, vals = e4m3_values(rng, (hkv, S, D), 1.0), e4m3_values(rng, (hkv, S, D))
    scale = 2 * D ** -0.5
    tiled = model.attend_tiled(q, keys, vals, start, lo, scale, window, bn=32, rows=16)
    rowmax = model.attend(q, keys, vals, start, lo, scale, window)
    want = reference(q, keys, vals, start, lo, scale, window)
    err_t = np.abs(tiled - want).max() / np.abs(want).max()
    err_r = np.abs(rowmax - want).max() / np.abs(want).max()
    assert err_t < 0.06 and err_r < 0.06, (err_t, err_r)
    assert err_t < 2 * err_r
    assert not np.array_equal(tiled, rowmax)
