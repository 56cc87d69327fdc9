"""Continuous batching (lumen_core.batching): generations that share batched steps give exactly what each gives
alone (greedy and seeded sampling, f32 on the CPU), join and leave between steps, respect the sequence cap, keep
decoding while a long prompt prefills in chunks; ``forward_batch`` equals per-sequence ``forward``; the plan counts
the caches."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import lumen_core as lumen
from lumen_core import batching
from lumen_core.errors import PlanError
from lumen_core.sampling import SamplingParams

KINDS = ("qwen3_5", "qwen3_5_moe", "gemma3", "gemma4")
PROMPTS = ["hello world", "The quick brown fox jumps over", "a b c d e f g h i j k", "x", "one two three four five"]


def load(path, sequences: int, context: int = 160):
    return lumen.load({"model": {"path": str(path), "hidden-layers": {
        "kv-cache": {"context-size": context, "sequences": sequences}}}}, progress=False)


@pytest.fixture(scope="module", params=KINDS)
def engine(request, tiny_checkpoint):
    e = load(tiny_checkpoint(request.param), 4)
    yield e
    e.close()


def run_concurrently(fns):
    results, errors = [None] * len(fns), []

    def run(i):
        try:
            results[i] = fns[i]()
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(repr(exc))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    return results


def test_forward_batch_equals_forward_per_sequence(engine):
    """Prefill chunks of different lengths and decode rows in one step: each row's logits equal a solo forward's."""
    m = engine.model
    ids = [engine.encode(p) for p in PROMPTS[:3]]
    solo, batched = [m.new_cache(64) for _ in ids], [m.new_cache(64) for _ in ids]
    for cache, seq in zip(solo, ids, strict=True):
        m.forward(seq[:-1], cache)
    rows = m.forward_batch([(seq[:-1], c) for seq, c in zip(ids, batched, strict=True)])
    assert rows.shape == (3, m.vocab_size)
    expect = np.stack([np.asarray(m.forward(seq[-1:], c))[-1] for seq, c in zip(ids, solo, strict=True)])
    got = m.forward_batch([(seq[-1:], c) for seq, c in zip(ids, batched, strict=True)])
    np.testing.assert_allclose(got, expect, rtol=0, atol=1e-5)  # f32; only a GEMM's row count differs
    assert [c.pos for c in batched] == [len(s) for s in ids]


def test_concurrent_generations_equal_solo(engine):
    prompts = [engine.encode(p) for p in PROMPTS]
    sampled = [SamplingParams(temperature=0.9, top_k=20, seed=i) for i in range(len(prompts))]
    greedy = [list(engine.generate_tokens(p, max_tokens=12 + i)) for i, p in enumerate(prompts)]
    drawn = [list(engine.generate_tokens(p, max_tokens=12, params=s)) for p, s in zip(prompts, sampled, strict=True)]
    engine.start_batching()
    try:
        fns = [lambda i=i: list(engine.generate_tokens(prompts[i], max_tokens=12 + i)) for i in range(len(prompts))]
        fns += [lambda i=i: list(engine.generate_tokens(prompts[i], max_tokens=12, params=sampled[i]))
                for i in range(len(prompts))]
        out = run_concurrently(fns)
        batcher = engine.batcher
        assert batcher.batch_sizes > batcher.steps  # steps really held several sequences
    finally:
        engine.stop_batching()
    assert out[:len(prompts)] == greedy
    assert out[len(prompts):] == drawn


def test_stats_are_per_generation(engine):
    engine.start_batching()
    try:
        def gen(i, n):
            toks = list(engine.generate_tokens(engine.encode(PROMPTS[i]), max_tokens=n))
            st = engine.stats
            return len(toks), st.generated_tokens, st.prompt_tokens, st.finish_reason

        out = run_concurrently([lambda: gen(0, 3), lambda: gen(1, 9)])
    finally:
        engine.stop_batching()
    for (n, generated, prompt, finish), i in zip(out, (0, 1), strict=True):
        assert prompt == len(engine.encode(PROMPTS[i]))
        assert generated >= n and finish in ("length", "stop")
    assert out[0][0] <= 3 and out[1][0] <= 9


def test_join_mid_batch_and_cancel(tiny_checkpoint):
    e = load(tiny_checkpoint("qwen3_5"), 3)
    a, b = e.encode(PROMPTS[0]), e.encode(PROMPTS[1])
    alone_a, alone_b = list(e.generate_tokens(a, max_tokens=30)), list(e.generate_tokens(b, max_tokens=30))
    e.start_batching()
    try:
        gen_a = e.generate_tokens(a, max_tokens=30)
        first = [next(gen_a) for _ in range(5)]  # a runs alone for a while
        gen_b = e.generate_tokens(b, max_tokens=30)  # b joins the running batch
        got_b = list(gen_b)
        got_a = first + list(gen_a)
        assert got_a == alone_a and got_b == alone_b
        gen_c = e.generate_tokens(a, max_tokens=30)
        next(gen_c)
        gen_c.close()  # the caller leaves: the sequence leaves the batch at the next step
        for _ in range(200):
            if e.batcher.running == 0:
                break
            threading.Event().wait(0.01)
        assert e.batcher.running == 0
        stopped = []
        e.should_stop = lambda: len(stopped) >= 2
        for tok in e.generate_tokens(a, max_tokens=30):
            stopped.append(tok)
        assert e.stats.finish_reason == "cancelled" and len(stopped) == 2  # as a solo run stops
        e.should_stop = None
    finally:
        e.close()


def test_sequence_cap_and_chunked_prefill(tiny_checkpoint, monkeypatch):
    """Two places, four generations: at most two run at once, the others wait; a prompt longer than a step's prefill
    budget goes in over several steps while the running one keeps decoding, and all equal their solo outputs."""
    monkeypatch.setattr(batching, "PREFILL_CHUNK", 8)
    e = load(tiny_checkpoint("qwen3_5"), 2)
    long_prompt = e.encode(" ".join(PROMPTS * 3))
    assert len(long_prompt) > 3 * 8
    prompts = [e.encode(PROMPTS[0]), long_prompt, e.encode(PROMPTS[2]), e.encode(PROMPTS[3])]
    alone = [list(e.generate_tokens(p, max_tokens=16)) for p in prompts]
    e.start_batching()
    seen = []
    original = e.model.forward_batch

    def watch(segments):
        seen.append([len(ids) for ids, _ in segments])
        return original(segments)

    monkeypatch.setattr(e.model, "forward_batch", watch)
    try:
        out = run_concurrently([lambda i=i: list(e.generate_tokens(prompts[i], max_tokens=16)) for i in range(4)])
    finally:
        e.close()
    assert out == alone
    assert max(len(s) for s in seen) <= 2  # never more than two sequences in a step
    assert all(sum(n for n in s if n > 1) <= 8 for s in seen)  # prompt tokens per step: PREFILL_CHUNK in all
    assert any(s.count(1) >= 1 and any(n > 1 for n in s) for s in seen)  # decoding went on beside a prefill


def test_plan_counts_every_sequence_cache(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_5")

    def cache_bytes(n):
        cfg = {"model": {"path": str(path), "hidden-layers": {"kv-cache": {"context-size": 64, "sequences": n}}}}
        plan, _ = _plan(cfg)
        return sum(e.nbytes for e in plan.entries if e.kind == "cache"), plan.notes

    one, _ = cache_bytes(1)
    four, notes = cache_bytes(4)
    assert four == 4 * one and any("kv-cache.sequences 4" in n for n in notes)
    cfg = {"model": {"path": str(path), "hidden-layers": {"kv-cache": {
        "context-size": 1 << 20, "allow-beyond-trained-context": True, "sequences": 4096}}}}
    with pytest.raises(PlanError, match="kv-cache.sequences"):
        _plan(cfg)


def _plan(cfg):
    from lumen_core.engine import prepare

    _, _, _, plan, resolved = prepare(cfg)
    return plan, resolved


def test_an_error_outside_a_step_fails_its_generations_and_the_batcher_lives_on(tiny_checkpoint):
    e = load(tiny_checkpoint("qwen3_5"), 2)
    e.start_batching()
    try:
        def broken():
            raise RuntimeError("a stop check that fails")

        e.should_stop = broken
        with pytest.raises(RuntimeError, match="a stop check that fails"):
            list(e.generate_tokens(e.encode(PROMPTS[0]), max_tokens=8))
        e.should_stop = None
        assert list(e.generate_tokens(e.encode(PROMPTS[0]), max_tokens=8))  # the next generation runs
    finally:
        e.close()
