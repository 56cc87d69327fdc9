"""Continuous batching and the prefix cache on cuda:0: ``forward_batch`` rows equal per-sequence forwards, concurrent
greedy generations (batched, op by op) equal what each generates alone through the captured decode graph, and a
chat's next turn resumed from a prefix-cache snapshot (device arrays copied to the host and back in place) equals a
full prefill. GPU tests carry the ``gpu`` marker and skip without CuPy or a CUDA device."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from gpu_util import close

import lumen_core as lumen

pytest.importorskip("lumen_cuda")

KINDS = ("qwen3_5", "qwen3_5_moe", "gemma4")
PROMPTS = ["hello world", "The quick brown fox jumps over", "a b c d e f g h i j k", "one two three four five"]


def load(path, **kv):
    return lumen.load({"model": {"path": str(path), "compute": "cuda:0", "store": "vram",
                                 "hidden-layers": {"kv-cache": {"context-size": 256, **kv}}}}, progress=False)


@pytest.fixture(scope="module", params=KINDS)
def engine(request, tiny_checkpoint, cp):
    e = load(tiny_checkpoint(request.param), sequences=4, **{"prefix-cache-mb": 64})
    yield e
    e.close()


@pytest.mark.gpu
def test_forward_batch_rows_equal_solo_forwards(engine):
    m = engine.model
    ids = [engine.encode(p) for p in PROMPTS[:3]]
    solo, batched = [m.new_cache(64) for _ in ids], [m.new_cache(64) for _ in ids]
    for cache, seq in zip(solo, ids, strict=True):
        m.forward(seq[:-1], cache)
    m.forward_batch([(seq[:-1], c) for seq, c in zip(ids, batched, strict=True)])
    want = np.stack([np.asarray(m.forward(seq[-1:], c))[-1] for seq, c in zip(ids, solo, strict=True)])
    got = m.forward_batch([(seq[-1:], c) for seq, c in zip(ids, batched, strict=True)])
    close(got, want, 1e-4)  # f32 weights: GEMV (one row) against GEMM (three) reduction orders


@pytest.mark.gpu
def test_concurrent_greedy_generations_equal_the_graph_path(engine):
    prompts = [engine.encode(p) for p in PROMPTS]
    alone = [list(engine.generate_tokens(p, max_tokens=16)) for p in prompts]  # the captured decode graph
    engine.start_batching()
    out, errors = [None] * len(prompts), []

    def run(i):
        try:
            out[i] = list(engine.generate_tokens(prompts[i], max_tokens=16))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(repr(exc))

    try:
        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert engine.batcher.batch_sizes > engine.batcher.steps
    finally:
        engine.stop_batching()
    assert not errors, errors
    assert out == alone


@pytest.mark.gpu
def test_next_turn_from_the_prefix_cache_equals_a_full_prefill(engine, tiny_checkpoint):
    from lumen_core.prefix_cache import PrefixCache

    engine.prefix_cache = PrefixCache(64_000_000, block=16)  # small blocks: device rows copied block by block
    messages = [{"role": "system", "content": "Be brief. " * 20}, {"role": "user", "content": "Name a colour."}]
    reply = "".join(e.text for e in engine.chat(messages, max_tokens=8, temperature=0)
                    if type(e).__name__ == "Content") or "ok"
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Another one?"}]
    ids = engine.encode(engine.chat_prompt(messages), add_special_tokens=False)
    cached = list(engine.generate_tokens(ids, max_tokens=12))
    assert engine.stats.cached_tokens > 20 and engine.prefix_cache.blocks > 0
    engine.prefix_cache = None
    try:
        assert list(engine.generate_tokens(ids, max_tokens=12)) == cached
    finally:
        engine.prefix_cache = PrefixCache(64_000_000)


@pytest.fixture(scope="module")
def bd(cp):
    from lumen_cuda import attention, batch_decode, delta, ops

    return cp, attention, batch_decode, delta, ops


@pytest.mark.gpu
@pytest.mark.parametrize(("kv", "ring"), [("f32", False), ("bf16", False), ("fp8", False), ("bf16", True)])
def test_batched_attention_launch_equals_each_sequence_alone(bd, kv, ring):
    """Five decoding sequences at different positions and a prompt chunk, through attention_segments: outputs and
    caches bit-identical to each sequence's own attention call."""
    cp, attention, batch_decode, _, ops = bd
    rng = np.random.default_rng(0)
    Hq, Hkv, D, ctx, window = 8, 2, 64, 96, (32 if ring else None)

    def cache():
        make = attention.sliding_kv_cache if ring else attention.kv_cache
        return make(window if ring else ctx, Hkv, D, kv, kv)

    starts = [0, 5, 31, 40, 70]
    mine, ref = [cache() for _ in range(6)], [cache() for _ in range(6)]
    for c_m, c_r, s in zip(mine, ref, starts + [3], strict=True):  # fill the history alike
        if s:
            hist = [cp.asarray(rng.normal(size=(s, h, D)).astype(np.float32)) for h in (Hq, Hkv, Hkv)]
            ops.attention(*hist, c_m, 0, 0.125, window)
            ops.attention(*hist, c_r, 0, 0.125, window)
    T = 5 + 4
    q, k, v = (cp.asarray(rng.normal(size=(T, h, D)).astype(np.float32)) for h in (Hq, Hkv, Hkv))
    spans = [(i, i + 1) for i in range(5)] + [(5, 9)]
    got = batch_decode.attention_segments(q, k, v, mine, starts + [3], spans, 0.125, window)
    want = cp.concatenate([ops.attention(q[a:b], k[a:b], v[a:b], c, s, 0.125, window)
                           for (a, b), c, s in zip(spans, ref, starts + [3], strict=True)])
    assert cp.array_equal(got, want)
    for a, b in zip(mine, ref, strict=True):
        assert cp.array_equal(a.k, b.k) and cp.array_equal(a.v, b.v)


@pytest.mark.gpu
def test_batched_gated_delta_and_conv_launches_equal_each_sequence_alone(bd):
    cp, _, batch_decode, delta, ops = bd
    rng = np.random.default_rng(1)
    B, Hk, Hv, Dk, Dv, C, K = 6, 2, 4, 32, 48, 40, 4
    states_m = [delta.delta_state(Hv, Dk, Dv) for _ in range(B + 1)]
    states_r = [delta.delta_state(Hv, Dk, Dv) for _ in range(B + 1)]
    convs_m = [delta.conv_state(C, K) for _ in range(B + 1)]
    convs_r = [delta.conv_state(C, K) for _ in range(B + 1)]
    for sm, sr, cm, cr in zip(states_m, states_r, convs_m, convs_r, strict=True):
        init = cp.asarray(rng.normal(size=(Hv, Dk, Dv)).astype(np.float32))
        sm.s[...] = init
        sr.s[...] = init
        xi = cp.asarray(rng.normal(size=(K - 1, C)).astype(np.float32))
        cm.x[...] = xi
        cr.x[...] = xi
    T = B + 3
    spans = [(i, i + 1) for i in range(B)] + [(B, T)]
    f = lambda *shape: cp.asarray(rng.normal(size=shape).astype(np.float32))  # noqa: E731
    q, k, v, g, beta = f(T, Hk, Dk), f(T, Hk, Dk), f(T, Hv, Dv), -abs(f(T, Hv)), abs(f(T, Hv)) / 4
    got = batch_decode.gated_delta_rule_segments(q, k, v, g, beta, states_m, spans)
    want = cp.concatenate([ops.gated_delta_rule(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], s)
                           for (a, b), s in zip(spans, states_r, strict=True)])
    assert cp.array_equal(got, want)
    assert all(cp.array_equal(a.s, b.s) for a, b in zip(states_m, states_r, strict=True))
    x, w = f(T, C), f(C, K)
    got = batch_decode.causal_conv1d_segments(x, w, convs_m, spans)
    want = cp.concatenate([ops.causal_conv1d(x[a:b], w, s) for (a, b), s in zip(spans, convs_r, strict=True)])
    assert cp.array_equal(got, want)
    assert all(cp.array_equal(a.x, b.x) for a, b in zip(convs_m, convs_r, strict=True))
