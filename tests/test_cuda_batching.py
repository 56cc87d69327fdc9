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
    messages = [{"role": "system", "content": "Be brief. " * 20}, {"role": "user", "content": "Name a colour."}]
    reply = "".join(e.text for e in engine.chat(messages, max_tokens=8, temperature=0)
                    if type(e).__name__ == "Content") or "ok"
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Another one?"}]
    ids = engine.encode(engine.chat_prompt(messages), add_special_tokens=False)
    cached = list(engine.generate_tokens(ids, max_tokens=12))
    assert engine.stats.cached_tokens > 20
    engine.prefix_cache = None
    try:
        assert list(engine.generate_tokens(ids, max_tokens=12)) == cached
    finally:
        from lumen_core.prefix_cache import PrefixCache

        engine.prefix_cache = PrefixCache(64_000_000)
