"""lumen_cuda.flash_mma_model (CPU, numpy): the tensor-core flash kernel's arithmetic. Three bf16 planes hold any f32
exactly, and the model over bf16 keys and values stays within 2e-6 of float64 attention (the GPU tests ask the
kernel for 1e-5 against the CuPy path); two planes would not (why the kernel runs three)."""

from __future__ import annotations

import numpy as np
import pytest

F32 = np.float32


@pytest.fixture(scope="module")
def model():
    from lumen_cuda import flash_mma_model

    return flash_mma_model


def reference(q, keys, vals, start, lo, scale, window=None, softcap=None):
    T, hq, _ = q.shape
    hkv, S, _ = keys.shape
    out = np.zeros((T, hq, vals.shape[2]))
    pos = np.arange(lo, lo + S)
    for t in range(T):
        for h in range(hq):
            kv = h // (hq // hkv)
            s = keys[kv].astype(np.float64) @ q[t, h].astype(np.float64) * scale
            if softcap:
                s = np.tanh(s / softcap) * softcap
            ok = (pos <= start + t) & ((pos > start + t - window) if window else True)
            s = np.where(ok, s, -np.inf)
            p = np.exp(s - s.max())
            out[t, h] = p @ vals[kv].astype(np.float64) / p.sum()
    return out


def test_three_planes_hold_any_f32_exactly(model):
    """Every f32 from ~2^-110 up to bf16's largest value (below that the low plane would be a bf16 subnormal and could
    lose bits worth < 2^-133; queries and probabilities there contribute nothing a test could see)."""
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.normal(size=10000).astype(F32) * F32(10.0) ** rng.integers(-30, 30, 10000),
                        np.array([0.0, -0.0, 1.0, 1 + 2 ** -23, 1e-30, -1.5e30, 3.3e38], F32)]).astype(F32)
    hi, mid, lo = model.planes(x)
    for p in (hi, mid, lo):
        assert np.array_equal(model.bf16(p), p), "a plane holds a value bf16 cannot"
    assert np.array_equal((hi.astype(np.float64) + mid + lo).astype(F32), x)
    assert np.array_equal(hi + mid + lo, x)


@pytest.mark.parametrize(("D", "G", "T", "start", "window", "softcap"),
                         [(128, 4, 40, 0, None, None), (256, 2, 33, 70, 50, 30.0), (64, 1, 130, 0, None, None)])
def test_model_within_2e6_of_float64(model, D, G, T, start, window, softcap):
    rng = np.random.default_rng(D + T)
    Hkv = 2
    lo = 0 if window is None else max(0, start - window + 1)
    S = start - lo + T
    q = rng.normal(size=(T, G * Hkv, D)).astype(F32)
    keys = model.bf16(rng.normal(size=(Hkv, S, D)).astype(F32))
    vals = model.bf16(rng.normal(size=(Hkv, S, D)).astype(F32))
    scale = (4.0 if softcap else 1.0) * D ** -0.5
    want = reference(q, keys, vals, start, lo, scale, window, softcap)
    got = model.attend(q, keys, vals, start, lo, scale, window, softcap, bn=32)
    err = np.abs(got - want).max() / max(1.0, np.abs(want).max())
    assert err < 2e-6, err  # 1.1e-6 with the softcap: f32's own rounding of scores ~15 through tanh and exp
    two = model.attend(q, keys, vals, start, lo, scale, window, softcap, bn=32, n=2)
    assert np.abs(two - want).max() / max(1.0, np.abs(want).max()) > err  # two planes lose what three keep
