"""OpenAI ``logprobs`` on `lumen serve`, driven by the real `openai` SDK against a real uvicorn server over a tiny
Qwen 3.5 checkpoint: chat ``logprobs``/``top_logprobs`` and completions' legacy ``logprobs``, ``echo`` and
``max_tokens: 0`` (what lm-evaluation-harness's loglikelihood requests send). The values are checked against the
reply's tokens scored after the prompt (``prompt_logprobs``, the ``lumen perplexity`` loop) and the prompt's
against ``Engine.perplexity``; streamed replies against whole ones; a scripted reply with split UTF-8 characters
checks which chunk carries which token."""

from __future__ import annotations

import math

import openai
import pytest
from server_util import Server, load_tiny

from lumen_core.engine import Stats
from lumen_core.logprobs import TokenLogprob, prompt_logprobs, token_bytes, token_text

HELLO = [{"role": "user", "content": "Hello there"}]
PROMPT = "Once upon a time"
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return load_tiny(tiny_checkpoint("qwen3_5"), context=512)


@pytest.fixture(scope="module")
def server(engine):
    srv = Server(engine)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def greedy(engine, ids: list[int], n: int) -> list[int]:
    """The greedy reply's tokens, the end-of-turn token included when it ended on one (the server is idle)."""
    list(engine.generate_tokens(ids, n, logprobs=0))
    return [e.token for e in engine.stats.token_logprobs]


def chat_ids(engine, messages, think=None) -> list[int]:
    return engine.encode(engine.chat_prompt_and_parser(messages, None, think)[0], add_special_tokens=False)


def test_chat_logprobs_are_the_reply_s_tokens_scored(client, engine):
    kw = dict(model="tiny", messages=HELLO, max_tokens=12, temperature=0, logprobs=True, top_logprobs=4)
    r = client.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    ids = chat_ids(engine, HELLO)
    reply = greedy(engine, ids, 12)
    scored = prompt_logprobs(engine, ids + reply, 4)[len(ids):]
    assert 1 <= len(content) <= len(reply) == r.usage.completion_tokens
    for item, want in zip(content, scored, strict=False):  # any left out: the end, tokens that made no text
        raw = token_bytes(engine.tokenizer, want.token)
        assert item.bytes == list(raw) and item.token == raw.decode("utf-8", "backslashreplace")
        assert item.logprob == pytest.approx(want.logprob, abs=1e-5)
        assert [t.bytes for t in item.top_logprobs] == [list(token_bytes(engine.tokenizer, t)) for t, _ in want.top]
        values = [t.logprob for t in item.top_logprobs]
        assert values == sorted(values, reverse=True) and values == pytest.approx([v for _, v in want.top], abs=1e-5)
        assert item.logprob == pytest.approx(values[0], abs=1e-9)  # greedy: the chosen token is the argmax
    assert r.choices[0].logprobs.refusal is None

    chunks = list(client.chat.completions.create(stream=True, **kw))
    streamed = [item for c in chunks if c.choices and c.choices[0].logprobs for item in c.choices[0].logprobs.content]
    assert [i.model_dump() for i in streamed] == [i.model_dump() for i in content]
    assert chunks[0].choices[0].logprobs is None  # the role chunk

    plain = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=2)
    assert plain.choices[0].logprobs is None
    zero = client.chat.completions.create(**{**kw, "top_logprobs": None, "max_tokens": 3})
    assert all(item.top_logprobs == [] for item in zero.choices[0].logprobs.content)


def test_completion_logprobs_are_the_reply_s_tokens_scored(client, engine):
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0, logprobs=3)
    choice, lp = r.choices[0], r.choices[0].logprobs
    ids = engine.encode(PROMPT)
    reply = greedy(engine, ids, 10)
    scored = prompt_logprobs(engine, ids + reply, 3)[len(ids):]
    # every generated token, an end-of-turn one included (a harness counts on one entry per token)
    assert lp.tokens == [token_text(engine.tokenizer, t) for t in reply] and len(reply) == r.usage.completion_tokens
    # f32, and two batch shapes (a prefill + one-token steps against one forward over it all) sum in different orders:
    # 1.4e-5 apart on a logprob of -5.76 was measured (2.4e-6 relative)
    assert lp.token_logprobs == pytest.approx([e.logprob for e in scored], abs=5e-5)
    for top, value, want in zip(lp.top_logprobs, lp.token_logprobs, scored, strict=True):
        expected: dict = {}  # by text: two tokens that read the same keep the likelier (the legacy shape is a dict)
        for t, v in [*want.top, (want.token, want.logprob)]:
            expected.setdefault(token_text(engine.tokenizer, t), v)
        assert list(top) == list(expected) and list(top.values()) == pytest.approx(list(expected.values()), abs=5e-5)
        assert max(top.values()) == pytest.approx(value, abs=1e-9)  # greedy: what a harness's is_greedy reads
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert all(o <= len(choice.text) for o in lp.text_offset)


def test_echo_with_max_tokens_0_scores_the_prompt_as_perplexity_does(client, engine):
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=0, echo=True, logprobs=2, temperature=0)
    r = client.completions.create(**kw)
    choice, lp = r.choices[0], r.choices[0].logprobs
    ids = engine.encode(PROMPT)
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 0
    assert len(lp.tokens) == len(ids) and lp.tokens[0] is None and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None and lp.tokens[1:] == [token_text(engine.tokenizer, i) for i in ids[1:]]
    nll = engine.perplexity(ids)["nll"]
    assert math.fsum(lp.token_logprobs[1:]) == pytest.approx(-nll * (len(ids) - 1), abs=1e-5)
    for token, offset in zip(lp.tokens[1:], lp.text_offset[1:], strict=True):
        assert PROMPT[offset:].startswith(token)

    chunks = list(client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == PROMPT
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    merged = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
    assert len(merged) == 1 and merged[0].model_dump() == lp.model_dump()

    plain = client.completions.create(**{**kw, "logprobs": None})
    assert plain.choices[0].text == PROMPT and plain.choices[0].logprobs is None
    assert plain.usage.prompt_tokens == len(ids) and plain.usage.completion_tokens == 0


def test_a_harness_loglikelihood_request(client, engine):
    """lm-evaluation-harness ``local-completions``: token ids, echo, max_tokens 1, logprobs 1; it sums
    ``token_logprobs[ctxlen:-1]`` and calls the continuation greedy when each equals the best of its top."""
    context, continuation = engine.encode("The capital of France is"), engine.encode(" Paris", False)
    ids = context + continuation
    r = client.completions.create(model="tiny", prompt=[ids], max_tokens=1, echo=True, logprobs=1, temperature=0,
                                  seed=1234)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(ids) + 1
    ctxlen = len(context)
    scored = prompt_logprobs(engine, ids)
    assert math.fsum(lp.token_logprobs[ctxlen:-1]) == pytest.approx(
        math.fsum(e.logprob for e in scored[ctxlen:]), abs=1e-5)
    is_greedy = all(t == max(top.values()) for t, top in zip(lp.token_logprobs[ctxlen:-1],
                                                             lp.top_logprobs[ctxlen:-1], strict=True))
    best = [e.top[0][0] if e.top else None for e in prompt_logprobs(engine, ids, 1)[ctxlen:]]
    assert is_greedy == (best == continuation)
    assert r.choices[0].text.startswith(engine.tokenizer.decode(ids, skip_special_tokens=True))


def test_streamed_completion_logprobs_equal_the_whole_reply(client):
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, logprobs=2, echo=True)
    whole = client.completions.create(**kw).choices[0]
    chunks = list(client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    parts = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
    for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for p in parts for x in getattr(p, name)] == getattr(whole.logprobs, name), name


def scripted(engine, monkeypatch, reply: str):
    """``engine`` 'generates' the tokens of ``reply`` then an end-of-turn token, recording a made-up logprob per
    token (-0.01 * its place) as the real loop records them; returns the tokens."""
    ids = engine.tokenizer.backend.encode(reply, add_special_tokens=False).ids
    eos = min(engine.tokenizer.eos_ids)

    def fake(prompt_ids, max_tokens=256, params=None, logprobs=None, **_):
        engine.stats = st = Stats(prompt_tokens=len(prompt_ids), finish_reason="length")
        for i, tok in enumerate([*ids, eos][:max_tokens]):
            st.generated_tokens += 1
            if logprobs is not None:
                st.token_logprobs.append(TokenLogprob(tok, -0.01 * (i + 1), [(tok, -0.01 * (i + 1))] * logprobs))
            if tok == eos:
                st.finish_reason = "stop"
                return
            yield tok

    monkeypatch.setattr(engine, "generate_tokens", fake)
    return ids, eos


REPLY = "Grüße 鑫 und ß — ok"  # characters the tiny tokenizer splits into byte tokens


def test_each_chunk_carries_the_tokens_of_its_text(client, engine, monkeypatch):
    ids, eos = scripted(engine, monkeypatch, REPLY)
    tok = engine.tokenizer
    assert any(not _utf8(token_bytes(tok, i)) for i in ids)  # a character split over tokens
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, logprobs=0, stream=True))
    tokens = []
    for c in chunks[:-1]:
        lp = c.choices[0].logprobs
        mine = ids[len(tokens):len(tokens) + len(lp.tokens)]
        assert lp.tokens == [token_text(tok, i) for i in mine]
        # a chunk's text is exactly its tokens' bytes: a split character comes with the chunk that writes it
        assert b"".join(token_bytes(tok, i) for i in mine) == c.choices[0].text.encode()
        tokens += lp.tokens
    last = chunks[-1].choices[0]
    assert last.finish_reason == "stop" and last.text == "" and last.logprobs.tokens == ["<|im_end|>"]
    assert tokens + last.logprobs.tokens == [token_text(tok, i) for i in [*ids, eos]]
    whole = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, logprobs=0).choices[0]
    assert whole.text == REPLY and whole.logprobs.tokens == tokens + ["<|im_end|>"]
    assert whole.logprobs.token_logprobs == pytest.approx([-0.01 * (i + 1) for i in range(len(ids) + 1)])
    for token, offset in zip(whole.logprobs.tokens, whole.logprobs.text_offset, strict=True):
        raw = token.encode()
        if "\\x" not in token and token != "<|im_end|>":
            assert REPLY[offset:].encode().startswith(raw)
    assert whole.logprobs.text_offset[-1] == len(REPLY)

    # chat: every token once over the chunks, in order; the end-of-turn token (no text) left out
    kw = dict(model="tiny", messages=HELLO, max_tokens=40, logprobs=True, extra_body=NO_THINK)
    chunks = list(client.chat.completions.create(stream=True, **kw))
    streamed = [i for c in chunks if c.choices[0].logprobs for i in c.choices[0].logprobs.content]
    assert [i.bytes for i in streamed] == [list(token_bytes(tok, i)) for i in ids]
    assert b"".join(bytes(i.bytes) for i in streamed).decode() == REPLY
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == REPLY
    whole = client.chat.completions.create(**kw).choices[0]
    assert [i.model_dump() for i in whole.logprobs.content] == [i.model_dump() for i in streamed]


def test_a_stop_string_s_tokens(client, engine, monkeypatch):
    """Completions list them (every generated token; their offsets at the text's end), chat leaves out the ones
    that wrote no text."""
    ids, _ = scripted(engine, monkeypatch, REPLY)
    tok = engine.tokenizer
    whole = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, logprobs=0, stop=["und"])
    choice = whole.choices[0]
    assert choice.text == REPLY[:REPLY.index("und")] and choice.finish_reason == "stop"
    n = len(choice.logprobs.tokens)
    assert choice.logprobs.tokens == [token_text(tok, i) for i in ids[:n]]
    assert b"".join(token_bytes(tok, i) for i in ids[:n]).decode().endswith("und")  # through the stop's last token
    assert choice.logprobs.text_offset[-1] <= len(choice.text)
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, logprobs=0, stop=["und"],
                                            stream=True))
    assert [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.text_offset] == \
        choice.logprobs.text_offset

    r = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=40, logprobs=True, stop=["und"],
                                       extra_body=NO_THINK)
    content = r.choices[0].logprobs.content
    assert r.choices[0].message.content == REPLY[:REPLY.index("und")].rstrip()  # (chat trims the end)
    assert [i.bytes for i in content] == [list(token_bytes(tok, i)) for i in ids[:len(content)]] and len(content) < n


def _utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


@pytest.mark.parametrize("route, body, param", [
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"logprobs": False, "top_logprobs": 0}, "top_logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("completions", {"logprobs": 6}, "logprobs"),
    ("completions", {"logprobs": -1}, "logprobs"),
    ("completions", {"max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": [1, 2, 10**6]}, "prompt"),
    ("completions", {"prompt": [[1, 2], [3]]}, "prompt"),
])
def test_refused_logprobs_options_are_400s_naming_the_field(client, route, body, param):
    with pytest.raises(openai.BadRequestError) as info:
        if route == "chat":
            client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=2, extra_body=body)
        else:
            client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, extra_body=body)
    assert info.value.body["param"] == param and param in info.value.body["message"]


def test_a_batching_server_gives_the_same_logprobs(client, tiny_checkpoint):
    """kv-cache.sequences 2: two workers, the engine's batcher; a prompt is scored through ``Engine.exclusive``
    while another request generates, and each request reads its own thread's tokens."""
    import threading

    import lumen_core as lumen

    chat = dict(model="tiny", messages=HELLO, max_tokens=10, temperature=0, logprobs=True, top_logprobs=2)
    score = dict(model="tiny", prompt=PROMPT * 3, max_tokens=0, echo=True, logprobs=1)
    solo = (client.chat.completions.create(**chat).choices[0].logprobs.model_dump(),
            client.completions.create(**score).choices[0].logprobs.model_dump())
    engine = lumen.load({"model": {"path": str(tiny_checkpoint("qwen3_5")), "hidden-layers": {
        "kv-cache": {"context-size": 512, "sequences": 2}}}}, progress=False)
    srv = Server(engine)
    try:
        batched = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        results: dict = {}
        jobs = {"chat": lambda: batched.chat.completions.create(**chat).choices[0].logprobs.model_dump(),
                "score": lambda: batched.completions.create(**score).choices[0].logprobs.model_dump()}
        threads = [threading.Thread(target=lambda k=k: results.__setitem__(k, jobs[k]())) for k in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert results["chat"]["content"] and len(results["chat"]["content"]) == len(solo[0]["content"])
        for got, want in zip(results["chat"]["content"], solo[0]["content"], strict=True):
            assert got["bytes"] == want["bytes"] and got["logprob"] == pytest.approx(want["logprob"], abs=1e-5)
        assert results["score"]["tokens"] == solo[1]["tokens"]
        assert results["score"]["token_logprobs"][1:] == pytest.approx(solo[1]["token_logprobs"][1:], abs=1e-5)
    finally:
        srv.stop()
        engine.close()
