"""The optional op ``sandwich_layer`` (Gemma 3's decoder layer) on the CPU: with int8 matrices a call runs as one
compiled function (lumen_cpu.layer); prefill, several-token and one-token calls give bit for bit the composite's
outputs, KV cache and ring record (lumen_core.ops._sandwich_layer over the CPU's registered ops), for full and ring
caches, both activations and every repacked format; anything else (f32 weights, an f16 cache) runs the composite."""

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


CALLS = (20, 1, 2, 5, 1, 1, 3, 1)  # tokens a call: a prompt longer than a ring of 16, then steps of every path


def run(fn, weights, cache, xs, window, act):
    norms, attn, mlp = weights
    outs, start = [], 0
    for x in xs:
        rope = rope_tables(list(range(start, start + x.shape[0])), ROPE)
        outs.append(fn(x, norms, attn, mlp, cache, start, rope, (H, KV, D), D ** -0.5, window, 1e-6, 1.0, act))
        outs.append(getattr(cache, "recent", None))
        start += x.shape[0]
    return outs


ROPE = list(1e4 ** (-np.arange(0, D, 2) / D))


def same(a, b) -> bool:
    if isinstance(a, tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, np.ndarray):
        return a.shape == b.shape and np.array_equal(a, b)
    return a == b


@pytest.mark.parametrize("act", ["gelu_tanh", "silu"])
@pytest.mark.parametrize("ring,window", [(False, None), (False, 16), (True, 16)])
@pytest.mark.parametrize("formats", [("Q5_0", "Q4_K", "Q6_K"), ("Q8_0", "Q6_K", "Q4_K"), ("Q4_0", "Q5_K", "Q5_0")])
def test_the_compiled_layer_is_the_composite_bit_for_bit(act, ring, window, formats):
    """Prefill, several-token and one-token calls: every output, the cache and a ring's record equal."""
    weights = make(formats)
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal((n, C)).astype(np.float32) for n in CALLS]
    ops, results = layer._composite_ops(), []
    for compiled in (True, False):
        w = copy(weights)
        cache = sliding_kv_cache(window, KV, D) if ring else kv_cache(64, KV, D)
        fn = layer.sandwich_layer if compiled else (lambda *a: _sandwich_layer(ops, *a))  # noqa: B023
        if compiled:  # this path is the compiled one
            assert layer._compiled_args(xs[0], *w, cache, 0, rope_tables(list(range(20)), ROPE), (H, KV, D), 1.0,
                                        window, 1e-6, 1.0, act) is not None
        results.append((run(fn, w, cache, xs, window, act), cache))
    (got, c1), (want, c2) = results
    for g, e in zip(got[::2], want[::2], strict=True):
        assert np.isfinite(e).all() and g.shape == e.shape
        assert np.array_equal(g, e)
    assert all(same(g, e) for g, e in zip(got[1::2], want[1::2], strict=True))
    n = sum(CALLS)
    if ring:
        assert np.array_equal(c1.k, c2.k) and np.array_equal(c1.v, c2.v)
    else:  # the positions written (the rest of a full cache is never written: np.empty)
        assert np.array_equal(c1.k[:, :n], c2.k[:, :n]) and np.array_equal(c1.v[:, :n], c2.v[:, :n])


def test_what_the_compiled_layer_does_not_take_runs_the_composite():
    weights = make()
    rope = rope_tables([0], ROPE)
    x = np.random.default_rng(2).standard_normal((1, C)).astype(np.float32)
    args = lambda w, cache, x=x, act="gelu_tanh": (x, *w, cache, 0, rope, (H, KV, D), D ** -0.5, None, 1e-6, 1.0, act)  # noqa: E731
    assert layer._compiled_args(*args(copy(weights), kv_cache(8, KV, D))) is not None
    # past the cache's end, an f16 cache, an f32 weight, an unknown activation: not compiled
    past_end = list(args(copy(weights), kv_cache(8, KV, D)))
    past_end[5] = 8  # start: the cache holds positions 0..7
    assert layer._compiled_args(*past_end) is None
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
