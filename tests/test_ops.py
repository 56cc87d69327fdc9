"""The CPU backend implements the whole op contract, and its pieces agree with direct formulas."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lumen_core.ops import CONTRACT
from lumen_core.plugins import get_registry


def test_cpu_implements_every_op_in_the_contract():
    assert set(CONTRACT) <= get_registry().ops_of("cpu")


def cpu(op, variant=None):
    return get_registry().op(op, "cpu", variant)


def test_chunked_delta_rule_equals_the_recurrence():
    rng = np.random.default_rng(0)
    T, Hk, Hv, D = 150, 2, 4, 16
    q, k = rng.normal(size=(T, Hk, D)).astype(np.float32), rng.normal(size=(T, Hk, D)).astype(np.float32)
    v = rng.normal(size=(T, Hv, D)).astype(np.float32)
    g = -rng.uniform(0.01, 0.5, size=(T, Hv)).astype(np.float32)
    beta = rng.uniform(0, 1, size=(T, Hv)).astype(np.float32)
    s1, s2 = cpu("delta_state")(Hv, D, D), cpu("delta_state")(Hv, D, D)
    chunked = cpu("gated_delta_rule")(q, k, v, g, beta, s1)
    steps = np.concatenate([cpu("gated_delta_rule")(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1],
                                                    beta[t:t + 1], s2) for t in range(T)])
    assert np.abs(chunked - steps).max() <= 1e-4
    assert np.abs(s1.s - s2.s).max() <= 1e-4


def test_attention_matches_torch_sdpa_with_gqa_and_window():
    rng = np.random.default_rng(1)
    T, Hq, Hkv, D = 20, 4, 2, 8
    q, k, v = (rng.normal(size=(T, h, D)).astype(np.float32) for h in (Hq, Hkv, Hkv))
    for window in (None, 5):
        cache = cpu("kv_cache")(32, Hkv, D)
        ours = cpu("attention")(q, k, v, cache, 0, D ** -0.5, window=window)
        i, j = np.arange(T)[:, None], np.arange(T)[None, :]
        mask = (j <= i) & ((j > i - window) if window else True)
        kt = torch.tensor(k).repeat_interleave(Hq // Hkv, 1).transpose(0, 1)
        vt = torch.tensor(v).repeat_interleave(Hq // Hkv, 1).transpose(0, 1)
        ref = torch.nn.functional.scaled_dot_product_attention(
            torch.tensor(q).transpose(0, 1), kt, vt, attn_mask=torch.tensor(mask))
        assert np.abs(ours - ref.transpose(0, 1).numpy()).max() <= 1e-5


def test_mrope_interleaved_with_equal_positions_is_plain_rope():
    inv = [1.0 / 10000 ** (i / 8) for i in range(0, 8, 2)]
    pos = list(range(10))
    plain = cpu("rope_tables")(pos, inv)
    mrope = cpu("rope_tables")([pos, pos, pos], inv, [2, 1, 1], True)
    assert np.allclose(plain[0], mrope[0]) and np.allclose(plain[1], mrope[1])


def test_mrope_interleaved_takes_axes_in_turn():
    inv = [1.0, 0.5, 0.25, 0.125]
    cos, _ = cpu("rope_tables")([[1], [2], [3]], inv, [2, 1, 1], True)
    # frequency 0 from T, 1 from H, 2 from W, 3 from T again (H and W sections are used up)
    assert np.allclose(cos[0, :4], np.cos([1 * 1.0, 2 * 0.5, 3 * 0.25, 1 * 0.125]))


@pytest.mark.parametrize("fmt", ["bf16", "f16"])
def test_linear_in_half_formats_computes_in_f32(fmt):
    from lumen_core.backend import Weight

    rng = np.random.default_rng(2)
    w = rng.normal(size=(6, 5)).astype(np.float32)
    x = rng.normal(size=(3, 5)).astype(np.float32)
    import ml_dtypes

    dt = ml_dtypes.bfloat16 if fmt == "bf16" else np.float16
    stored = w.astype(dt)
    out = cpu("linear", fmt)(x, Weight(stored, fmt, stored.shape))
    assert np.allclose(out, x @ stored.astype(np.float32).T, atol=1e-6)


@pytest.mark.parametrize("ring", [False, True])
def test_fp8_kv_cache_rounds_and_saturates_like_e4m3(ring):
    """An fp8 KV cache keeps E4M3 values: attention over it equals attention over the f32 keys/values rounded to
    E4M3 (ml_dtypes, nearest-even) after saturating at ±448 (a plain cast would make them NaN); the cache is 1
    byte an element."""
    import ml_dtypes
    from lumen_cpu import attention as att

    rng = np.random.default_rng(5)
    T, Hq, Hkv, D = 6, 4, 2, 8
    q, k, v = (rng.normal(size=(T, h, D)).astype(np.float32) for h in (Hq, Hkv, Hkv))
    k[0, 0, 0], v[1, 1, 2] = 1000.0, -2000.0  # beyond E4M3's range
    make = (lambda t: att.sliding_kv_cache(4, Hkv, D, t)) if ring else (lambda t: att.kv_cache(16, Hkv, D, t))
    window = 4 if ring else None
    fp8, ref = make("fp8"), make("f32")
    assert fp8.k.dtype.itemsize == 1
    got = att.attention(q, k, v, fp8, 0, 0.3, window)

    def rounded(x):
        return np.clip(x, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)

    want = att.attention(q, rounded(k), rounded(v), ref, 0, 0.3, window)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    if not ring:
        assert fp8.k[0, 0, 0].astype(np.float32) == 448.0 and fp8.v[1, 1, 2].astype(np.float32) == -448.0


@pytest.mark.parametrize("shape,rot", [((1, 4, 256), 256), ((7, 3, 64), 32), ((2, 2, 80), 64)])
def test_apply_rope_rotates_half_as_the_formula_does(shape, rot):
    """The compiled rotate-half (full and partial rotary: dims past ``rot`` pass through) gives the formula's f32
    bits: x1 cos - x2 sin, x2 cos + x1 sin, two products then the sum."""
    rng = np.random.default_rng(7)
    x = rng.normal(size=shape).astype(np.float32)
    cos, sin = cpu("rope_tables")(list(range(40, 40 + shape[0])), [10000.0 ** (-2 * i / rot) for i in range(rot // 2)])
    half = rot // 2
    x1, x2 = x[..., :half], x[..., half:rot]
    c, s = cos[:, None, :], sin[:, None, :]
    want = np.concatenate([x1 * c[..., :half] + (-x2) * s[..., :half], x2 * c[..., half:] + x1 * s[..., half:],
                           x[..., rot:]], axis=-1)
    got = cpu("apply_rope")(x, cos, sin)
    assert got.dtype == np.float32 and np.array_equal(got, want)


@pytest.mark.parametrize("op", ["gelu_tanh_mul", "silu_mul"])
@pytest.mark.parametrize("shape", [(1, 2048), (16, 2048), (3, 5, 7)], ids=["decode", "parallel", "odd"])
def test_gated_activations_equal_torch_within_f32_rounding(op, shape):
    """One compiled pass (an in-register exp; g / (1 + exp(-2y)) for the tanh GELU) against torch's own GELU-tanh /
    SiLU in float64: within 4e-7 of the scale (numpy's tanh form is within ~1e-6); NaN stays NaN, infinities and
    signed zeros keep their sign, a strongly negative gate gives ~0."""
    rng = np.random.default_rng(3)
    gate = (rng.normal(size=shape) * 4).astype(np.float32)
    up = rng.normal(size=shape).astype(np.float32)
    g = torch.tensor(gate, dtype=torch.float64)
    act = torch.nn.functional.gelu(g, approximate="tanh") if op == "gelu_tanh_mul" else torch.nn.functional.silu(g)
    want = (act * torch.tensor(up, dtype=torch.float64)).numpy()
    got = cpu(op)(gate, up)
    assert got.dtype == np.float32 and got.shape == shape
    assert np.abs(got - want).max() <= 4e-7 * np.abs(want).max()
    edge = np.array([[np.nan, np.inf, -np.inf, 0.0, -0.0, 30.0, -30.0, 1e-30]], np.float32)
    out = cpu(op)(edge, np.ones_like(edge))[0]
    assert np.isnan(out[0]) and out[1] == np.inf and out[2] == -np.inf and out[3] == 0.0
    assert np.signbit(out[4]) and out[5] == 30.0 and abs(out[6]) < 1e-11 and out[7] == np.float32(0.5e-30)
