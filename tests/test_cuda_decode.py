"""The graph-capturable decode kernels (lumen_cuda.decode: kernels/decode_attention.cu, kernels/gdn_step.cu)
against the CuPy ops they replace (lumen_cuda.attention.attention, lumen_cuda.delta.gated_delta_rule /
causal_conv1d), over several sequential decode steps after a CuPy prefill, each implementation on its own copy
of the cache / state: outputs within 1e-5 × max(1, max |reference|), KV caches bit-identical, states within 1e-5.

The position reaches the kernels only through a device int32 array changed by ``pos.fill(p)`` (as graph replay
will drive it); one test replays a captured CUDA graph. GPU tests carry the ``gpu`` marker and skip without CuPy
or a CUDA device.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from gpu_util import close, host

pytest.importorskip("lumen_cuda")

STEPS = 5


@pytest.fixture(scope="module")
def mods(cp):
    from lumen_cuda import attention, decode, delta

    return attention, decode, delta


def strided(cp, rng, shape):
    """A random f32 device array of ``shape`` (1, H, D) that is a non-contiguous view."""
    a = cp.asarray(rng.normal(size=(shape[1], shape[0], *shape[2:])).astype(np.float32))
    return a.swapaxes(0, 1)


def copy_cache(cp, attention, cache):
    return attention.KVCache(cache.k.copy(), cache.v.copy())


def same_cache(cp, a, b):
    assert cp.array_equal(a.k, b.k) and cp.array_equal(a.v, b.v), "KV caches differ"


# -- attention ------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("ctx,prefill", [(64, 37), (4096, 700)])
@pytest.mark.parametrize("softcap", [None, 50.0])
@pytest.mark.parametrize("window", [None, 16])
@pytest.mark.parametrize("heads", [(8, 2), (4, 4)])
@pytest.mark.parametrize("dims", [(64, 64), (256, 256), (512, 512), (512, 128)])
@pytest.mark.parametrize("kv", ["f32", "f16", "bf16", "fp8"])
def test_attention_decode_against_the_cupy_op(cp, mods, kv, dims, heads, window, softcap, ctx, prefill):
    attention, decode, _ = mods
    (D, Dv), (Hq, Hkv) = dims, heads
    rng = np.random.default_rng(zlib.crc32(repr((kv, dims, heads, window, softcap, ctx)).encode()))
    scale = (4.0 if softcap else 1.0) * D ** -0.5  # scores up to ~15 with the softcap: it bends them
    ref = attention.kv_cache(ctx, Hkv, D, kv, head_dim_v=Dv)
    attention.attention(strided(cp, rng, (prefill, Hq, D)), strided(cp, rng, (prefill, Hkv, D)),
                        strided(cp, rng, (prefill, Hkv, Dv)), ref, 0, scale, window, softcap)
    mine = copy_cache(cp, attention, ref)
    pos = cp.zeros((1,), dtype=cp.int32)
    for p in range(prefill, prefill + STEPS):
        q, k, v = strided(cp, rng, (1, Hq, D)), strided(cp, rng, (1, Hkv, D)), strided(cp, rng, (1, Hkv, Dv))
        pos.fill(p)
        got = decode.attention_decode(q, k, v, mine, pos, scale, window, softcap)
        want = attention.attention(q, k, v, ref, p, scale, window, softcap)
        close(got, want)
        same_cache(cp, mine, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("chunk", [1, 16, 24])
@pytest.mark.parametrize("window", [None, 16])
def test_attention_decode_small_splits_and_wide_groups(cp, mods, chunk, window):
    """Many splits over a small cache (split edges at every position with chunk 1), and 16 query heads per kv
    head (two blocks of 8 heads sharing the kv head: both write the new key)."""
    attention, decode, _ = mods
    rng = np.random.default_rng(chunk + (window or 0))
    Hq, Hkv, D, Dv, ctx = 16, 1, 128, 96, 64
    for kv in ("bf16", "f16"):
        ref = attention.kv_cache(ctx, Hkv, D, kv, head_dim_v=Dv)
        attention.attention(strided(cp, rng, (30, Hq, D)), strided(cp, rng, (30, Hkv, D)),
                            strided(cp, rng, (30, Hkv, Dv)), ref, 0, 0.1, window)
        mine = copy_cache(cp, attention, ref)
        pos = cp.zeros((1,), dtype=cp.int32)
        for p in range(30, 30 + STEPS):
            q, k, v = strided(cp, rng, (1, Hq, D)), strided(cp, rng, (1, Hkv, D)), strided(cp, rng, (1, Hkv, Dv))
            pos.fill(p)
            close(decode.attention_decode(q, k, v, mine, pos, 0.1, window, chunk=chunk),
                  attention.attention(q, k, v, ref, p, 0.1, window))
            same_cache(cp, mine, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 16])
def test_attention_decode_reads_the_position_from_the_device(cp, mods, window):
    """Same q, k, v and the same pos array at every start p: only ``pos.fill(p)`` changes between calls."""
    attention, decode, _ = mods
    rng = np.random.default_rng(5)
    Hq, Hkv, D, ctx = 8, 2, 128, 1024
    ref = attention.kv_cache(ctx, Hkv, D, "bf16")
    attention.attention(strided(cp, rng, (500, Hq, D)), strided(cp, rng, (500, Hkv, D)),
                        strided(cp, rng, (500, Hkv, D)), ref, 0, D ** -0.5, window)
    q, k, v = strided(cp, rng, (1, Hq, D)), strided(cp, rng, (1, Hkv, D)), strided(cp, rng, (1, Hkv, D))
    pos = cp.zeros((1,), dtype=cp.int32)
    for p in (0, 1, 15, 16, 17, 127, 128, 129, 255, 256, 400, 499, 500, 1023):
        mine, theirs = copy_cache(cp, attention, ref), copy_cache(cp, attention, ref)
        pos.fill(p)
        got = decode.attention_decode(q, k, v, mine, pos, D ** -0.5, window)
        close(got, attention.attention(q, k, v, theirs, p, D ** -0.5, window))
        same_cache(cp, mine, theirs)


@pytest.mark.gpu
def test_attention_decode_replays_as_a_cuda_graph(cp, mods):
    """Captured once, replayed at five positions with new inputs copied in place and ``pos.fill(p)``."""
    attention, decode, _ = mods
    rng = np.random.default_rng(6)
    Hq, Hkv, D, ctx, start, window = 8, 2, 128, 2048, 300, 64
    ref = attention.kv_cache(ctx, Hkv, D, "f16")
    attention.attention(strided(cp, rng, (start, Hq, D)), strided(cp, rng, (start, Hkv, D)),
                        strided(cp, rng, (start, Hkv, D)), ref, 0, D ** -0.5, window)
    mine = copy_cache(cp, attention, ref)
    steps = [tuple(strided(cp, rng, (1, h, D)) for h in (Hq, Hkv, Hkv)) for _ in range(STEPS)]
    want = [host(attention.attention(*s, ref, start + i, D ** -0.5, window)) for i, s in enumerate(steps)]
    q, k, v = (cp.zeros_like(a) for a in steps[0])
    pos = cp.zeros((1,), dtype=cp.int32)
    scratch = copy_cache(cp, attention, ref)
    decode.attention_decode(q, k, v, scratch, pos, D ** -0.5, window)  # compile, and warm the memory pool
    stream = cp.cuda.Stream(non_blocking=True)
    try:
        with stream:
            stream.begin_capture()
            out = decode.attention_decode(q, k, v, mine, pos, D ** -0.5, window)
            graph = stream.end_capture()
    except Exception as e:  # CuPy or driver without stream capture
        pytest.skip(f"stream capture unavailable: {e}")
    for i, (qs, ks, vs) in enumerate(steps):
        with stream:
            cp.copyto(q, qs)
            cp.copyto(k, ks)
            cp.copyto(v, vs)
            pos.fill(start + i)
            graph.launch(stream)
        stream.synchronize()
        close(out, want[i])
    same_cache(cp, mine, ref)


@pytest.mark.gpu
def test_attention_decode_refuses_what_it_does_not_support(cp, mods):
    attention, decode, _ = mods
    pos = cp.zeros((1,), dtype=cp.int32)
    big = attention.kv_cache(16, 1, 640)
    with pytest.raises(ValueError, match="head dim"):
        decode.attention_decode(cp.zeros((1, 1, 640), cp.float32), cp.zeros((1, 1, 640), cp.float32),
                                cp.zeros((1, 1, 640), cp.float32), big, pos, 1.0)
    ring = attention.sliding_kv_cache(16, 1, 64)
    with pytest.raises(ValueError, match="ring KV cache of 16 positions"):
        decode.attention_decode(cp.zeros((1, 1, 64), cp.float32), cp.zeros((1, 1, 64), cp.float32),
                                cp.zeros((1, 1, 64), cp.float32), ring, pos, 1.0, window=8)


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["f32", "bf16", "fp8"])
@pytest.mark.parametrize("prefill", [5, 16, 37])
def test_attention_decode_over_a_ring_cache(cp, mods, kv, prefill):
    """A sliding-window ring (capacity = window = 16): before, at and after it wraps; the ring's slots end up
    bit-identical to the CuPy op's."""
    attention, decode, _ = mods
    rng = np.random.default_rng(prefill)
    Hq, Hkv, D, W = 8, 2, 64, 16
    ref = attention.sliding_kv_cache(W, Hkv, D, kv)
    attention.attention(strided(cp, rng, (prefill, Hq, D)), strided(cp, rng, (prefill, Hkv, D)),
                        strided(cp, rng, (prefill, Hkv, D)), ref, 0, 0.2, W)
    mine = attention.RingKVCache(ref.k.copy(), ref.v.copy())
    pos = cp.zeros((1,), dtype=cp.int32)
    for p in range(prefill, prefill + 2 * W):
        q, k, v = strided(cp, rng, (1, Hq, D)), strided(cp, rng, (1, Hkv, D)), strided(cp, rng, (1, Hkv, D))
        pos.fill(p)
        close(decode.attention_decode(q, k, v, mine, pos, 0.2, W), attention.attention(q, k, v, ref, p, 0.2, W))
        same_cache(cp, mine, ref)
        # a KV-sharing reader of the same ring at the same position (nothing written)
        q2 = strided(cp, rng, (1, Hq, D))
        close(decode.attention_decode(q2, None, None, mine, pos, 0.2, W),
              attention.attention_shared(q2, ref, p, 0.2, W))
        same_cache(cp, mine, ref)


@pytest.mark.gpu
def test_attention_decode_reads_a_shared_full_cache_without_writing(cp, mods):
    attention, decode, _ = mods
    rng = np.random.default_rng(3)
    ref = attention.kv_cache(64, 2, 64, "bf16")
    attention.attention(strided(cp, rng, (20, 4, 64)), strided(cp, rng, (20, 2, 64)), strided(cp, rng, (20, 2, 64)),
                        ref, 0, 0.2)
    before = copy_cache(cp, attention, ref)
    q = strided(cp, rng, (1, 4, 64))
    pos = cp.full((1,), 19, dtype=cp.int32)
    for window in (None, 8):
        close(decode.attention_decode(q, None, None, ref, pos, 0.2, window),
              attention.attention_shared(q, before, 19, 0.2, window))
    same_cache(cp, ref, before)


# -- Gated DeltaNet -------------------------------------------------------------------------------------------------
def gdn_inputs(cp, rng, T, Hk, Hv, Dk, Dv):
    q, k = strided(cp, rng, (T, Hk, Dk)), strided(cp, rng, (T, Hk, Dk))
    v = strided(cp, rng, (T, Hv, Dv))
    g = cp.asarray(-np.abs(rng.normal(size=(Hv, T))).astype(np.float32) * 0.5).T  # log decay, a strided view
    beta = cp.asarray(1 / (1 + np.exp(-rng.normal(size=(Hv, T)))), dtype=cp.float32).T
    return q, k, v, g, beta


@pytest.mark.gpu
@pytest.mark.parametrize("Hk,Hv,Dk,Dv", [(2, 4, 128, 128), (2, 2, 64, 32), (1, 3, 256, 80), (2, 4, 40, 128)])
def test_gated_delta_step_against_the_cupy_op(cp, mods, Hk, Hv, Dk, Dv):
    _, decode, delta = mods
    rng = np.random.default_rng(Hk + Hv + Dk + Dv)
    ref = delta.delta_state(Hv, Dk, Dv)
    delta.gated_delta_rule(*gdn_inputs(cp, rng, 37, Hk, Hv, Dk, Dv), ref)
    mine = delta.DeltaState(ref.s.copy())
    for _ in range(STEPS):
        args = gdn_inputs(cp, rng, 1, Hk, Hv, Dk, Dv)
        got = decode.gated_delta_step(*args, mine)
        want = delta.gated_delta_rule(*args, ref)
        close(got, want)
        close(mine.s, ref.s)


@pytest.mark.gpu
@pytest.mark.parametrize("Hk,Hv,Dk,Dv", [(2, 4, 128, 128), (1, 3, 256, 80), (2, 4, 40, 128)])
def test_gated_delta_step_with_its_gates_is_the_two_launches(cp, mods, Hk, Hv, Dk, Dv, monkeypatch):
    """gdn_step_gates_r*: the gates computed in the step kernel from the raw projections give the bits of
    cupy_ops.gdn_gates followed by the step kernel (outputs and state, several steps); and the op as registered."""
    from lumen_cuda import cupy_ops, ops

    _, decode, delta = mods
    monkeypatch.setenv("LUMEN_CUDA_DECODE_FUSION", "1")
    rng = np.random.default_rng(Hk * Hv + Dk)
    ref = delta.delta_state(Hv, Dk, Dv)
    delta.gated_delta_rule(*gdn_inputs(cp, rng, 20, Hk, Hv, Dk, Dv), ref)
    mine = delta.DeltaState(ref.s.copy())
    neg_a = cp.asarray(-rng.uniform(1, 16, size=Hv).astype(np.float32))
    dt_bias = cp.asarray(rng.normal(size=Hv).astype(np.float32))
    for _ in range(STEPS):
        q, k, v, _, _ = gdn_inputs(cp, rng, 1, Hk, Hv, Dk, Dv)
        a, b = (cp.asarray(rng.normal(size=(1, Hv)).astype(np.float32) * 2) for _ in range(2))
        got = ops.gated_delta_rule_gates(q, k, v, a, b, neg_a, dt_bias, mine)
        want = decode.gated_delta_step(q, k, v, *cupy_ops.gdn_gates(a, b, neg_a, dt_bias), ref)
        np.testing.assert_array_equal(host(got), host(want))
        np.testing.assert_array_equal(host(mine.s), host(ref.s))


def gdn_net_inputs(cp, rng, Hk, Hv, Dk, Dv):
    """One token's projections for ops.gated_delta_net: qkv (1, C) and z as strided views (a fused projection's
    columns are), a, b (1, Hv), and the layer's conv weight (C, K), neg_a, dt_bias, norm weight."""
    C = 2 * Hk * Dk + Hv * Dv
    wide = cp.asarray(rng.normal(size=(1, C + Hv * Dv + 8)).astype(np.float32))
    qkv, z = wide[:, :C], wide[:, C:C + Hv * Dv]
    a, b = (cp.asarray(rng.normal(size=(1, Hv)).astype(np.float32) * 2) for _ in range(2))
    return qkv, z, a, b


@pytest.mark.gpu
@pytest.mark.parametrize("Hk,Hv,Dk,Dv,K", [(16, 32, 128, 128, 4), (2, 4, 64, 32, 4), (4, 4, 128, 128, 2),
                                           (2, 6, 32, 48, 3), (1, 2, 256, 100, 4)])
def test_gated_delta_net_step_is_its_three_kernels(cp, mods, Hk, Hv, Dk, Dv, K, monkeypatch):
    """gdn_decode_r* (conv, step and gated norm in one launch, LUMEN_CUDA_GDN_DECODE=1) against the three kernels
    the composite runs (LUMEN_CUDA_GDN_DECODE=0): outputs, the conv state and the delta state bit for bit over several
    tokens after a prefill, and the counters back at zero after every call."""
    from lumen_cuda import ops
    from lumen_cuda.state import derived

    _, decode, delta = mods
    monkeypatch.setenv("LUMEN_CUDA_DECODE_FUSION", "1")
    rng = np.random.default_rng(Hk * Hv + Dk + Dv + K)
    C = 2 * Hk * Dk + Hv * Dv
    conv_w = cp.asarray(rng.normal(size=(C, K)).astype(np.float32) * 0.5)
    neg_a = cp.asarray(-rng.uniform(1, 16, size=Hv).astype(np.float32))
    dt_bias = cp.asarray(rng.normal(size=Hv).astype(np.float32))
    norm_w = cp.asarray(rng.uniform(0.5, 1.5, size=Dv).astype(np.float32))
    dims, eps = (Hk, Dk, Hv, Dv), 1e-6
    ref_c, ref_d = delta.conv_state(C, K), delta.delta_state(Hv, Dk, Dv)
    delta.causal_conv1d(cp.asarray(rng.normal(size=(9, C)).astype(np.float32)), conv_w, ref_c)
    delta.gated_delta_rule(*gdn_inputs(cp, rng, 9, Hk, Hv, Dk, Dv), ref_d)
    mine_c, mine_d = delta.ConvState(ref_c.x.copy()), delta.DeltaState(ref_d.s.copy())
    for _ in range(STEPS):
        qkv, z, a, b = gdn_net_inputs(cp, rng, Hk, Hv, Dk, Dv)
        monkeypatch.setenv("LUMEN_CUDA_GDN_DECODE", "0")
        want = ops.gated_delta_net(qkv, conv_w, ref_c, a, b, neg_a, dt_bias, ref_d, z, norm_w, eps, dims)
        monkeypatch.setenv("LUMEN_CUDA_GDN_DECODE", "1")
        got = ops.gated_delta_net(qkv, conv_w, mine_c, a, b, neg_a, dt_bias, mine_d, z, norm_w, eps, dims)
        assert got.shape == want.shape == (1, Hv, Dv)
        np.testing.assert_array_equal(host(got), host(want))
        np.testing.assert_array_equal(host(mine_c.x), host(ref_c.x))
        np.testing.assert_array_equal(host(mine_d.s), host(ref_d.s))
        assert not host(derived(mine_d)["gdn_counters"]).any()


@pytest.mark.gpu
def test_gated_delta_net_step_declines_and_names_its_setting(cp, mods, monkeypatch):
    """None (the three kernels run) for Dv > 128 and for more than one token through the op; the op then equals the
    composite; a bad LUMEN_CUDA_GDN_DECODE is named."""
    from lumen_cuda import ops

    _, decode, delta = mods
    rng = np.random.default_rng(8)
    Hk, Hv, Dk, Dv, K = 1, 2, 32, 160, 4
    C = 2 * Hk * Dk + Hv * Dv
    conv_w = cp.asarray(rng.normal(size=(C, K)).astype(np.float32))
    neg_a, dt_bias = cp.full(Hv, -2.0, dtype=cp.float32), cp.zeros(Hv, dtype=cp.float32)
    norm_w = cp.ones(Dv, dtype=cp.float32)
    qkv, z, a, b = gdn_net_inputs(cp, rng, Hk, Hv, Dk, Dv)
    assert decode.gated_delta_net_step(qkv, conv_w, delta.conv_state(C, K), a, b, neg_a, dt_bias,
                                       delta.delta_state(Hv, Dk, Dv), z, norm_w, 1e-6, (Hk, Dk, Hv, Dv)) is None
    monkeypatch.setenv("LUMEN_CUDA_DECODE_FUSION", "1")
    T = 3
    qkv3 = cp.asarray(rng.normal(size=(T, C)).astype(np.float32))
    z3 = cp.asarray(rng.normal(size=(T, Hv * Dv)).astype(np.float32))
    a3, b3 = (cp.asarray(rng.normal(size=(T, Hv)).astype(np.float32)) for _ in range(2))
    outs = []
    for v in ("1", "0"):
        monkeypatch.setenv("LUMEN_CUDA_GDN_DECODE", v)
        outs.append(ops.gated_delta_net(qkv3, conv_w, delta.conv_state(C, K), a3, b3, neg_a, dt_bias,
                                        delta.delta_state(Hv, Dk, Dv), z3, norm_w, 1e-6, (Hk, Dk, Hv, Dv)))
    np.testing.assert_array_equal(host(outs[0]), host(outs[1]))
    assert decode.gdn_decode({}) is False and decode.gdn_decode({"LUMEN_CUDA_GDN_DECODE": "1"}) is True
    with pytest.raises(ValueError, match="LUMEN_CUDA_GDN_DECODE='2'"):
        decode.gdn_decode({"LUMEN_CUDA_GDN_DECODE": "2"})


@pytest.mark.gpu
def test_gated_delta_step_refuses_wide_keys(cp, mods):
    _, decode, delta = mods
    with pytest.raises(ValueError, match="key head dim"):
        decode.gated_delta_step(*gdn_inputs(cp, np.random.default_rng(0), 1, 1, 1, 264, 8),
                                delta.delta_state(1, 264, 8))


@pytest.mark.gpu
@pytest.mark.parametrize("C,K", [(96, 4), (300, 2), (5, 3)])
def test_causal_conv1d_step_against_the_cupy_op(cp, mods, C, K):
    _, decode, delta = mods
    rng = np.random.default_rng(C + K)
    w = cp.asarray(rng.normal(size=(K, C)).astype(np.float32)).T  # (C, K), a strided view
    ref = delta.conv_state(C, K)
    delta.causal_conv1d(cp.asarray(rng.normal(size=(37, C)).astype(np.float32)), w, ref)
    mine = delta.ConvState(ref.x.copy())
    for _ in range(STEPS):
        x = cp.asarray(rng.normal(size=(1, C)).astype(np.float32))
        got = decode.causal_conv1d_step(x, w, mine)
        want = delta.causal_conv1d(x, w, ref)
        close(got, want, tol=1e-6)
        assert cp.array_equal(mine.x, ref.x)


@pytest.mark.gpu
@pytest.mark.parametrize("C,K", [(96, 4), (300, 2), (5, 3), (130, 8)])
@pytest.mark.parametrize("T", [1, 2, 7, 16, 37, 300])
def test_causal_conv1d_prefill_equals_the_cupy_op_bitwise(cp, mods, C, K, T):
    """The prefill kernel gives the CuPy op's bits (same products and sums in the same order, no FMA), and the same
    state after, from a state a first call left (T < K - 1 takes the state's own rows too), then a decode step."""
    _, decode, delta = mods
    rng = np.random.default_rng(C * K + T)
    w = cp.asarray(rng.normal(size=(K, C)).astype(np.float32)).T  # (C, K), a strided view
    ref, mine = delta.conv_state(C, K), delta.conv_state(C, K)
    for n in (T, 3, T):
        x = cp.asarray(rng.normal(size=(n, C)).astype(np.float32))
        got = decode.causal_conv1d_prefill(x, w, mine)
        want = delta.causal_conv1d(x, w, ref)
        assert got.shape == want.shape and cp.array_equal(got, want)
        assert cp.array_equal(mine.x, ref.x)
    with pytest.raises(ValueError, match="shapes"):
        decode.causal_conv1d_prefill(x[:, 1:], w, mine)  # one channel short of the weight's


@pytest.mark.gpu
def test_fp8_kv_encoding_equals_the_cpu_reference(cp, mods):
    """The fp8 KV cache's encode (kernels/decode_attention.cu, integer arithmetic) gives the bytes the CPU backend
    stores (ml_dtypes E4M3, round-to-nearest-even, saturating at ±448) for values across every binade, subnormals,
    the rounding ties and beyond the range; its decode gives back exactly ml_dtypes' values (NaN codes NaN)."""
    import ml_dtypes
    from lumen_cpu import attention as cpu_attention

    attention, _, _ = mods
    rng = np.random.default_rng(11)
    x = np.concatenate([rng.normal(size=4096).astype(np.float32) * s for s in (1e-4, 1e-2, 1, 30, 600)])
    ties = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    ties = ties[np.isfinite(ties)]
    mids = ((np.sort(ties)[1:] + np.sort(ties)[:-1]) / 2).astype(np.float32)  # exactly halfway: ties to even
    x = np.concatenate([x, mids, -mids, np.float32([0.0, -0.0, 448, 449, 1e30, -1e30, 2 ** -10, 2 ** -9])])
    want = cpu_attention.store(x, ml_dtypes.float8_e4m3fn).view(np.uint8)
    got = host(attention.encode(cp.asarray(x), cp.uint8))
    np.testing.assert_array_equal(got, want)
    codes = np.arange(256, dtype=np.uint8)
    back = host(attention.decode(cp.asarray(codes)))
    ref = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    np.testing.assert_array_equal(np.isnan(back), np.isnan(ref))
    np.testing.assert_array_equal(back[~np.isnan(ref)], ref[~np.isnan(ref)])
