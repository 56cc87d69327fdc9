"""The optional op ``sandwich_layer`` (Gemma 3's decoder layer) on the CPU: one token with int8 matrices runs as one
compiled call (lumen_cpu.layer); its output, its KV cache and the next steps' outputs are bit for bit the composite's
(lumen_core.ops._sandwich_layer over the CPU's registered ops), for full and ring caches, both activations and every
repacked format; anything else (several tokens, f32 weights, an f16 cache) runs the composite itself."""

from __future__ import annotations

import numpy as np
import pytest
from lumen_cpu import int8, layer
from lumen_cpu.attention import kv_cache, sliding_kv_cache
from test_fused import random_blocks

from lumen_core.backend import Weight
from lumen_core.ops import _sandwich_layer
from lumen_core.rope import rope_tables

H, KV, D, C, INNER = 4, 1, 64, 256, 512  # Gemma 3's layout at a small size (heads, kv heads, head dim)


def i8(name: str, rows: int, cols: int, seed: int) -> Weight:
    return int8.repack(random_blocks(name, rows, cols, seed), name.lower(), (rows, cols))


def make(formats=("Q5_0", "Q4_K", "Q6_K"), seed: int = 0):
    """(norms, attn, mlp) with random int8 weights: q/k/v and gate/up in formats[0], o in [1], down in [2]."""
    rng = np.random.default_rng(seed)
    vec = lambda n: rng.uniform(-0.5, 0.5, n).astype(np.float32)  # noqa: E731
    qkv = [i8(formats[0], n, C, seed + i) for i, n in enumerate((H * D, KV * D, KV * D))]
    attn = (*qkv, vec(D), vec(D), i8(formats[1], C, H * D, seed + 3))
    mlp = (i8(formats[0], INNER, C, seed + 4), i8(formats[0], INNER, C, seed + 5), i8(formats[2], C, INNER, seed + 6))
    return tuple(vec(C) for _ in range(4)), attn, mlp


def copy(weights):  # fresh Weights over the same data (linear_group joins each group on its first call)
    norms, attn, mlp = weights
    fresh = lambda w: Weight(w.data, w.format, w.shape, None, None) if isinstance(w, Weight) else w  # noqa: E731
    return norms, tuple(fresh(w) for w in attn), tuple(fresh(w) for w in mlp)


def run(fn, weights, cache, xs, start, window, act):
    norms, attn, mlp = weights
    outs = []
    for t, x in enumerate(xs):
        rope = rope_tables([start + t], ROPE)
        outs.append(fn(x, norms, attn, mlp, cache, start + t, rope, (H, KV, D), D ** -0.5, window, 1e-6, 1.0, act))
    return outs


ROPE = list(1e4 ** (-np.arange(0, D, 2) / D))


@pytest.mark.parametrize("act", ["gelu_tanh", "silu"])
@pytest.mark.parametrize("ring,window", [(False, None), (False, 16), (True, 16)])
@pytest.mark.parametrize("formats", [("Q5_0", "Q4_K", "Q6_K"), ("Q8_0", "Q6_K", "Q4_K"), ("Q4_0", "Q5_K", "Q5_0")])
def test_one_token_compiled_layer_is_the_composite_bit_for_bit(act, ring, window, formats):
    weights = make(formats)
    rng = np.random.default_rng(1)
    prompt = rng.standard_normal((24, C)).astype(np.float32)
    steps = [rng.standard_normal((1, C)).astype(np.float32) for _ in range(6)]
    ops, results = layer._composite_ops(), []
    for compiled in (True, False):
        w = copy(weights)
        # 24 positions written by a composite prefill (a ring of 16 has wrapped)
        cache = sliding_kv_cache(window, KV, D) if ring else kv_cache(96, KV, D)
        _sandwich_layer(ops, prompt, *w, cache, 0, rope_tables(list(range(24)), ROPE), (H, KV, D), D ** -0.5, window,
                        1e-6, 1.0, act)
        fn = layer.sandwich_layer if compiled else (lambda *a: _sandwich_layer(ops, *a))  # noqa: B023
        if compiled:
            assert layer._compiled_args(steps[0], *w, cache, 24, rope_tables([24], ROPE), (H, KV, D), 1.0, window,
                                        1e-6, 1.0, act) is not None
        results.append((run(fn, w, cache, steps, 24, window, act), cache))
    (got, c1), (want, c2) = results
    for g, e in zip(got, want, strict=True):
        assert g.shape == (1, C) and np.isfinite(e).all()
        assert np.array_equal(g, e)
    if ring:
        assert c1.recent == c2.recent
        assert np.array_equal(c1.k, c2.k) and np.array_equal(c1.v, c2.v)
    else:  # the positions written (the rest of a full cache is never written: np.empty)
        assert np.array_equal(c1.k[:, :30], c2.k[:, :30]) and np.array_equal(c1.v[:, :30], c2.v[:, :30])


def test_what_the_compiled_layer_does_not_take_runs_the_composite():
    weights = make()
    rope = rope_tables([0], ROPE)
    x = np.random.default_rng(2).standard_normal((1, C)).astype(np.float32)
    args = lambda w, cache, x=x, act="gelu_tanh": (x, *w, cache, 0, rope, (H, KV, D), D ** -0.5, None, 1e-6, 1.0, act)  # noqa: E731
    assert layer._compiled_args(*args(copy(weights), kv_cache(8, KV, D))) is not None
    # several tokens, an f16 cache, an f32 weight, an unknown activation: not compiled
    x2 = np.concatenate([x, x])
    rope2 = rope_tables([0, 1], ROPE)
    assert layer._compiled_args(x2, *copy(weights), kv_cache(8, KV, D), 0, rope2, (H, KV, D), 1.0, None, 1e-6, 1.0,
                                "gelu_tanh") is None
    assert layer._compiled_args(*args(copy(weights), kv_cache(8, KV, D, "f16"))) is None
    norms, attn, mlp = copy(weights)
    dense = Weight(int8.dequantize_rows(attn[5]), "f32", attn[5].shape, None, None)
    assert layer._compiled_args(*args((norms, attn[:5] + (dense,), mlp), kv_cache(8, KV, D))) is None
    with pytest.raises(ValueError, match="act must be"):
        layer.sandwich_layer(*args(copy(weights), kv_cache(8, KV, D), act="relu"))
    # the composite's result for the f32 weight: the same as with the int8 one (the same values), within rounding
    want = layer.sandwich_layer(*args(copy(weights), kv_cache(8, KV, D)))
    got = layer.sandwich_layer(*args((norms, attn[:5] + (dense,), mlp), kv_cache(8, KV, D)))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_the_cpu_registers_the_op():
    from lumen_core.plugins import get_registry

    assert get_registry().op("sandwich_layer", "cpu") is not None
