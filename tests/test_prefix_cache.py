"""The prefix cache (lumen_core.prefix_cache): a chat's next turn and prompts sharing a system prompt resume from a
snapshot instead of prefilling again, and generate exactly what they generate without it: Gated-DeltaNet states
(Qwen 3.5), sliding-window rings and KV sharing (Gemma); solo and batched; within its byte budget; counted by the
plan."""

from __future__ import annotations

import threading

import pytest

import lumen_core as lumen
from lumen_core import prefix_cache

KINDS = ("qwen3_5", "qwen3_5_moe", "gemma3", "gemma4")
SYSTEM = "You are a careful assistant. " * 12


def load(path, mb: float = 0, sequences: int = 1, context: int = 512):
    kv = {"context-size": context, "sequences": sequences}
    if mb:
        kv["prefix-cache-mb"] = mb
    return lumen.load({"model": {"path": str(path), "hidden-layers": {"kv-cache": kv}}}, progress=False)


@pytest.fixture(scope="module", params=KINDS)
def pair(request, tiny_checkpoint):
    """(an engine with a prefix cache, one without), of one tiny checkpoint; small sliding windows for Gemma so the
    rings wrap within the test's prompts."""
    path = tiny_checkpoint(request.param)
    cached = load(path, mb=64)
    cached.prefix_cache = prefix_cache.PrefixCache(64_000_000, block=16)  # small blocks: the prompts span several
    return cached, load(path)


def turn(engine, messages, n=12):
    """(the prompt's ids, the reply's events, prompt tokens the prefix cache supplied): one chat turn, greedy."""
    ids = engine.encode(engine.chat_prompt(messages), add_special_tokens=False)
    events = list(engine.chat(messages, max_tokens=n, temperature=0))
    return ids, events, engine.stats.cached_tokens


def text_of(events) -> str:
    return "".join(e.text for e in events if type(e).__name__ == "Content")


def test_next_chat_turn_resumes_and_equals_a_full_prefill(pair):
    cached, plain = pair
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name three colours."}]
    for _ in range(3):  # three turns: each resumes from the snapshot the turn before left
        ids, toks, hit = turn(cached, messages)
        ids2, toks2, _ = turn(plain, messages)
        assert (ids, toks) == (ids2, toks2)
        reply = text_of(toks)
        messages = messages + [{"role": "assistant", "content": reply}, {"role": "user", "content": "And more?"}]
    assert hit > len(cached.encode(SYSTEM, add_special_tokens=False))  # the last turn skipped the history
    pc = cached.prefix_cache
    assert pc.hits >= 2 and pc.blocks > 0
    # the turns' snapshots share their common blocks: far less than a copy of every snapshot's rows
    assert pc.bytes < sum(s.nbytes + sum(pc._blocks[k].nbytes for k in s.keys) for s in pc._snaps.values())


def test_shared_system_prompt_is_saved_at_the_shared_point(pair):
    cached, plain = pair
    questions = ["What is a cat?", "Where is the sea?", "Why is the sky blue?"]
    hits = []
    for q in questions:
        messages = [{"role": "system", "content": SYSTEM + " v2"}, {"role": "user", "content": q}]
        ids, toks, hit = turn(cached, messages, n=6)
        assert toks == turn(plain, messages, n=6)[1]
        hits.append(hit)
    system_tokens = len(cached.encode(SYSTEM, add_special_tokens=False))
    assert hits[0] == 0 and hits[2] >= system_tokens  # the second saved the shared part; the third resumed there


def test_batched_generations_use_the_prefix_cache(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_5")
    cached, plain = load(path, mb=64, sequences=3), load(path)
    prompts = [cached.encode(SYSTEM + f" Question {i}: what now?") for i in range(3)]
    expect = [list(plain.generate_tokens(p, max_tokens=8)) for p in prompts]
    cached.start_batching()
    try:
        first = list(cached.generate_tokens(prompts[0], max_tokens=8))
        second = list(cached.generate_tokens(prompts[1], max_tokens=8))  # saves the shared part on the way
        out, hits = [None, None], [0, 0]

        def run(i):
            out[i] = list(cached.generate_tokens(prompts[i], max_tokens=8))
            hits[i] = cached.stats.cached_tokens

        threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        third = list(cached.generate_tokens(prompts[2], max_tokens=8))
        assert cached.stats.cached_tokens > len(cached.encode(SYSTEM)) // 2
    finally:
        cached.close()
    assert [first, second, third] == expect
    assert out == expect[:2] and min(hits) > 0  # the same prompts again: resumed from their own snapshots


def test_budget_bounds_the_snapshots(tiny_checkpoint):
    e = load(tiny_checkpoint("qwen3_5"), mb=0.25)
    for i in range(12):
        list(e.generate_tokens(e.encode(f"prompt number {i} " * 8), max_tokens=4))
    pc = e.prefix_cache
    assert pc.bytes <= pc.budget and pc.evicted > 0 and len(pc) >= 1


def test_plan_counts_the_budget(tiny_checkpoint):
    from lumen_core.engine import prepare

    cfg = {"model": {"path": str(tiny_checkpoint("qwen3_5")),
                     "hidden-layers": {"kv-cache": {"context-size": 64, "prefix-cache-mb": 5}}}}
    plan = prepare(cfg)[3]
    (entry,) = [e for e in plan.entries if e.component == "prefix cache"]
    assert entry.nbytes == 5_000_000 and entry.store == "ram"


def test_common_prefix():
    assert prefix_cache._common((1, 2, 3, 4), (1, 2, 9)) == 2
    assert prefix_cache._common((1, 2), (1, 2, 3)) == 2
    assert prefix_cache._common((5,), (1,)) == 0


def test_blocks_are_shared_and_freed_with_their_last_snapshot(tiny_checkpoint):
    e = load(tiny_checkpoint("qwen3_5"))
    pc = prefix_cache.PrefixCache(64_000_000, block=8)
    ids = e.encode("one two three four five six seven eight nine ten " * 6)[:60]
    cache = e.model.new_cache(128)
    e.model.forward(ids[:40], cache)
    pc.store(ids[:40], cache)
    assert pc.blocks == 5
    e.model.forward(ids[40:60], cache)
    pc.store(ids[:60], cache)
    assert pc.blocks == 7  # the first five are the first snapshot's
    assert pc._blocks[pc._snaps[tuple(ids[:40])].keys[0]].refs == 2
    # both restore exactly what the forwards that made them left: the next token's logits are bit-equal
    for n in (40, 60):
        fresh, ref = e.model.new_cache(128), e.model.new_cache(128)
        snap, _ = pc.lookup(ids[:n] + [7])
        assert snap.n == n and pc.restore(snap, fresh) == n
        for a, b in ((0, 40), (40, n)):  # the same chunks as the snapshot's cache saw
            if b > a:
                e.model.forward(ids[a:b], ref)
        assert (e.model.forward([7], fresh) == e.model.forward([7], ref)).all()
    with pc._lock:  # the older snapshot goes first; its blocks stay (the newer one holds them)
        pc._evict()
    assert len(pc) == 1 and pc.blocks == 7
    with pc._lock:
        pc._evict()
    assert len(pc) == 0 and pc.blocks == 0 and pc.bytes == 0
