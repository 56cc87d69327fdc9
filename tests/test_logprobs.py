"""lumen_core.logprobs: a prompt's per-token logprobs (prompt_logprobs) against a direct forward and
``Engine.perplexity``, a generation's recorded logprobs against the scored text, the bytes each token stands for
(byte-level BPE and SentencePiece with byte fallback), the pairing of a generation's events with its tokens, and
OpenAI's shapes."""

from __future__ import annotations

import numpy as np
import pytest
import tokenizers

import lumen_core as lumen
from lumen_core import engine as engine_module
from lumen_core.logprobs import (
    Offsets,
    Scored,
    TokenLogprob,
    chat_logprobs,
    completion_logprobs,
    log_softmax,
    prompt_logprobs,
    token_bytes,
    token_text,
    with_logprobs,
)
from lumen_core.tokenizer import Tokenizer

TEXT = "The quick brown fox jumps over the lazy dog and"
ODD = "Grüße, 鑫 und ß — 🙂 ok"  # characters the tiny tokenizer never merged: split into byte tokens


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    e = lumen.load({"model": {"path": str(tiny_checkpoint("qwen3_5")), "hidden-layers": {
        "kv-cache": {"context-size": 128, "sequences": 2}}}}, progress=False)
    yield e
    e.close()


def direct(engine, ids: list[int]) -> list[np.ndarray]:
    """Each position's float64 log-softmax from one forward over the whole text (no chunking)."""
    logits = np.asarray(engine.model.forward(ids[:-1], engine.model.new_cache(engine.context_size), all_logits=True))
    return [log_softmax(row) for row in logits]


def test_prompt_logprobs_equal_a_direct_forward_and_perplexity(engine, monkeypatch):
    ids = engine.encode(TEXT)
    rows = direct(engine, ids)
    monkeypatch.setattr(engine_module, "PREFILL_CHUNK", 4)  # several chunks over one cache, as a long prompt runs
    got = prompt_logprobs(engine, ids, top=5)
    assert got[0] is None and len(got) == len(ids)
    assert engine.stats.prompt_tokens == len(ids) and engine.stats.finish_reason == "scored"
    for i, e in enumerate(got[1:]):
        lp = rows[i]
        # (the unchunked forward sums its float32 rows in another order: ~1e-9 apart)
        assert e.token == ids[i + 1] and e.logprob == pytest.approx(lp[ids[i + 1]], abs=1e-6)
        best = np.argsort(-lp, kind="stable")[:5]
        assert [t for t, _ in e.top] == best.tolist()
        assert [v for _, v in e.top] == sorted((v for _, v in e.top), reverse=True)
        assert [v for _, v in e.top] == pytest.approx(lp[best].tolist(), abs=1e-6)
    ppl = engine.perplexity(ids)
    assert sum(e.logprob for e in got[1:]) == pytest.approx(-ppl["nll"] * (len(ids) - 1), abs=1e-6)
    assert prompt_logprobs(engine, ids[:1]) == [None] and prompt_logprobs(engine, []) == []
    assert all(e.top == [] for e in prompt_logprobs(engine, ids)[1:])  # top=0: the token's own only


def test_prompt_logprobs_beside_a_running_batcher(engine):
    """Through ``Engine.exclusive``: on the batcher's thread between two steps, with the same values."""
    ids = engine.encode(TEXT)
    alone = prompt_logprobs(engine, ids, 2)
    engine.start_batching()
    try:
        assert prompt_logprobs(engine, ids, 2) == alone
    finally:
        engine.stop_batching()


def test_a_generation_s_logprobs_are_the_scored_text_s(engine):
    ids = engine.encode(TEXT)
    out = list(engine.generate_tokens(ids, max_tokens=10, logprobs=3))
    recorded = engine.stats.token_logprobs
    assert [e.token for e in recorded][:len(out)] == out and len(recorded) == engine.stats.generated_tokens
    scored = prompt_logprobs(engine, ids + [e.token for e in recorded], 3)[len(ids):]
    for got, want in zip(recorded, scored, strict=True):
        assert got.token == want.token and got.logprob == pytest.approx(want.logprob, abs=1e-5)
        assert [t for t, _ in got.top] == [t for t, _ in want.top]
        assert got.top[0][1] == pytest.approx(got.logprob, abs=1e-9)  # greedy: the chosen token is the argmax


def test_token_bytes_rebuild_the_text_byte_level(engine):
    tok = engine.tokenizer
    ids = tok.encode(ODD, add_special_tokens=False)
    assert any(len(token_bytes(tok, i)) == 1 and token_bytes(tok, i)[0] >= 0x80 for i in ids)  # a split character
    assert b"".join(token_bytes(tok, i) for i in ids) == ODD.encode()
    eos = tok.token_to_id("<|im_end|>")
    assert token_bytes(tok, eos) == b"<|im_end|>" and token_text(tok, eos) == "<|im_end|>"
    partial = next(i for i in ids if token_bytes(tok, i)[-1] >= 0x80 and not _utf8(token_bytes(tok, i)))
    assert token_text(tok, partial) == "".join(
        chr(b) if b < 0x80 else f"\\x{b:02x}" for b in token_bytes(tok, partial))
    assert token_bytes(tok, 10**6) == b""  # past the tokenizer's vocabulary (a model's padding rows)


def _utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def sentencepiece_tokenizer() -> Tokenizer:
    """A Gemma-style SentencePiece BPE: ``▁`` for spaces, byte-fallback tokens ``<0x00>``..``<0xFF>``."""
    from lumen_core.gguf_tokenizer import _gemma

    pieces = ["<pad>", "<eos>", "<bos>", "<unk>", *(f"<0x{b:02X}>" for b in range(256)),
              "▁", "H", "e", "l", "o", "w", "r", "d", "He", "ll", "llo", "Hello", "▁w", "▁wo", "▁wor", "▁worl",
              "▁world", "ü"]
    backend, _ = _gemma(pieces)
    backend.add_special_tokens([tokenizers.AddedToken(t, special=True) for t in ("<pad>", "<eos>", "<bos>")])
    return Tokenizer(backend, special_tokens={"eos_token": "<eos>"}, bos_id=None, eos_ids={1})


def test_token_bytes_sentencepiece_with_byte_fallback():
    tok = sentencepiece_tokenizer()
    text = "Hello world ü 鑫"
    ids = tok.encode(text, add_special_tokens=False)
    assert b"".join(token_bytes(tok, i) for i in ids) == text.encode()
    world = tok.token_to_id("▁world")
    assert token_bytes(tok, world) == b" world" and token_text(tok, world) == " world"  # the word's space kept
    e2 = tok.token_to_id("<0xE2>")
    assert token_bytes(tok, e2) == b"\xe2" and token_text(tok, e2) == "\\xe2"
    assert token_bytes(tok, 1) == b"<eos>"


def test_with_logprobs_pairs_each_event_with_its_tokens(engine):
    """Every token in exactly one item: those an event waited for come with it, those that made none at the end."""
    class Stats:
        token_logprobs: list

    def gen():
        yield "first"  # before the generation starts (a chat's forced opener): the thread's old stats
        engine.stats = st = engine_module.Stats()
        st.token_logprobs = [TokenLogprob(i, -1.0) for i in range(2)]
        yield "a"
        st.token_logprobs.append(TokenLogprob(2, -1.0))
        st.token_logprobs.append(TokenLogprob(3, -1.0))
        yield "b"
        st.token_logprobs.append(TokenLogprob(4, -1.0))  # an end-of-turn token: no event

    engine.stats.token_logprobs = [TokenLogprob(99, -1.0)]  # a previous generation's, on this thread
    items = list(with_logprobs(engine, gen()))
    assert [(s.event, [e.token for e in s.logprobs]) for s in items] == [
        ("first", []), ("a", [0, 1]), ("b", [2, 3]), (None, [4])]
    assert isinstance(items[0], Scored)


def test_openai_shapes(engine):
    tok = engine.tokenizer
    ids = tok.encode(" hello world", add_special_tokens=False)
    lps = [TokenLogprob(ids[0], -0.5, [(ids[0], -0.5), (ids[1], -1.5)]), TokenLogprob(ids[1], -2.0, [(ids[0], -0.1)])]
    chat = chat_logprobs(tok, lps)
    assert chat[0]["token"] == token_text(tok, ids[0]) and chat[0]["bytes"] == list(token_bytes(tok, ids[0]))
    assert [t["logprob"] for t in chat[0]["top_logprobs"]] == [-0.5, -1.5] and set(chat[1]) == {
        "token", "logprob", "bytes", "top_logprobs"}
    offsets = Offsets(tok).take(ids[:2])
    legacy = completion_logprobs(tok, [None, *lps], [0, *offsets])
    assert legacy["tokens"][0] is None and legacy["token_logprobs"] == [None, -0.5, -2.0]
    assert legacy["top_logprobs"][1] == {token_text(tok, ids[0]): -0.5, token_text(tok, ids[1]): -1.5}
    # the chosen token is added to the alternatives when they lack it (OpenAI: up to logprobs + 1 entries)
    assert legacy["top_logprobs"][2] == {token_text(tok, ids[0]): -0.1, token_text(tok, ids[1]): -2.0}
    assert legacy["text_offset"] == [0, 0, len(token_text(tok, ids[0]))]
    assert chat_logprobs(tok, [TokenLogprob(ids[0], float("-inf"))])[0]["logprob"] == -9999.0  # JSON has no -inf


def test_offsets_follow_the_streamed_decoding(engine):
    tok = engine.tokenizer
    ids = tok.encode(ODD, add_special_tokens=False)
    off = Offsets(tok, base=3)
    starts = off.take(ids[:4]) + off.take(ids[4:])
    assert off.text() == ODD and starts[0] == 3 and starts == sorted(starts)
    for i, s in zip(ids, starts, strict=True):
        raw = token_bytes(tok, i)
        if _utf8(raw):  # a whole token starts where its text does
            assert ODD[s - 3:].encode().startswith(raw)
    assert Offsets(tok).take(ids, limit=2)[-1] == 2
