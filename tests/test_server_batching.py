"""`lumen serve` with ``kv-cache.sequences`` 4: concurrent clients (the real OpenAI and Anthropic SDKs, streamed and
whole) share batched steps and each gets exactly what it gets alone; a client that hangs up leaves the batch;
/metrics reports the batch, the queue wait and the latency histograms."""

from __future__ import annotations

import threading
import time

import anthropic
import httpx
import openai
import pytest
from server_util import Server

import lumen_core as lumen

PROMPTS = [f"Tell me about the number {i}." for i in range(8)]


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    engine = lumen.load({"model": {"path": str(tiny_checkpoint("qwen3_5")), "hidden-layers": {
        "kv-cache": {"context-size": 1024, "sequences": 4}}}}, progress=False)
    srv = Server(engine)
    yield srv
    srv.stop()
    engine.close()


def chat(client, prompt, stream, max_tokens=20):
    kw = dict(model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0,
              reasoning_effort="none")
    if not stream:
        return client.chat.completions.create(**kw).choices[0].message.content or ""
    return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                   if c.choices)


def message(client, prompt, stream, max_tokens=20):
    kw = dict(model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
              extra_body={"temperature": 0})
    if not stream:
        return "".join(b.text for b in client.messages.create(**kw).content if b.type == "text")
    with client.messages.stream(**kw) as s:
        return "".join(s.text_stream)


def test_concurrent_streams_equal_their_solo_outputs(server):
    oa = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
    an = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=120)
    alone = {p: (chat(oa, p, False), message(an, p, False)) for p in PROMPTS}
    results, errors = {}, []

    def client(i, prompt):
        try:
            results[i] = (chat(oa, prompt, i % 2 == 0), message(an, prompt, i % 2 == 1))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(repr(exc))

    threads = [threading.Thread(target=client, args=(i, p)) for i, p in enumerate(PROMPTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert [results[i] for i in range(len(PROMPTS))] == [alone[p] for p in PROMPTS]
    batcher = server.app.state.engine.batcher
    assert batcher is not None and batcher.batch_sizes > batcher.steps  # requests really shared steps
    metrics = httpx.get(server.url + "/metrics").text
    assert "lumen_batch_steps_total" in metrics and "lumen_time_to_first_token_seconds_bucket" in metrics
    assert "lumen_inter_token_latency_seconds_count" in metrics and "lumen_queue_wait_seconds_sum" in metrics


def test_a_client_that_hangs_up_leaves_the_batch(server):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "count"}], "max_tokens": 900, "stream": True,
            "temperature": 0, "reasoning_effort": "none"}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as response:
        for _ in response.iter_lines():
            break
    batcher = server.app.state.engine.batcher
    deadline = time.time() + 30
    while (batcher.running or server.app.state.service.queue_depth) and time.time() < deadline:
        time.sleep(0.05)
    assert batcher.running == 0 and server.app.state.service.queue_depth == 0


def test_serve_flags_set_the_batch_and_the_prefix_cache(capsys, monkeypatch, tiny_checkpoint, tmp_path):
    import json

    import uvicorn

    from lumen_core.cli import main

    seen = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: seen.update(app=app, **kw))
    path = tmp_path / "serve.json"
    path.write_text(json.dumps({"model": {"path": str(tiny_checkpoint("qwen3_5")),
                                          "hidden-layers": {"kv-cache": {"context-size": 256}}}}))
    main(["serve", "--config", str(path), "--sequences", "3", "--prefix-cache-mb", "16"])
    app = seen["app"]
    try:
        engine = app.state.engine
        assert engine.batcher is not None and engine.batcher.sequences == 3 and app.state.service.workers == 3
        assert engine.prefix_cache is not None and engine.prefix_cache.budget == 16_000_000
        assert "3 sequence(s) at once, prefix cache 16 MB" in capsys.readouterr().err
    finally:
        app.state.service.close()
        engine.close()


def test_queue_limit_and_time_limit_hold_under_batching(tiny_checkpoint, monkeypatch):
    """Two places and max-queue 1: two generations run, one waits, a fourth is a 429. Then real batched
    generation with a 0.3 s time limit: a long request is cut ("length", far fewer tokens than asked) while a
    short one beside it completes with what it generates alone."""
    from server_util import slow

    from lumen_core.server.settings import Limits

    engine = lumen.load({"model": {"path": str(tiny_checkpoint("qwen3_5")), "hidden-layers": {
        "kv-cache": {"context-size": 2048, "sequences": 2}}}}, progress=False)
    srv = Server(engine, limits=Limits(max_queue=1, request_timeout=0.3))
    try:
        assert srv.app.state.service.workers == 2 and engine.batcher is not None
        produced, start = [], threading.Event()
        with monkeypatch.context() as m:
            slow(engine, m, 0.001, produced, start)
            body = {"model": "tiny", "prompt": "Hi", "max_tokens": 5}
            threads = [threading.Thread(target=httpx.post, args=(srv.url + "/v1/completions",),
                                        kwargs={"json": body, "timeout": 30}) for _ in range(3)]
            for i, t in enumerate(threads):  # two run (held by `start`), one waits: the queue is full
                t.start()
                deadline = time.time() + 5
                while srv.app.state.service.queue_depth < i + 1:
                    assert time.time() < deadline
                    time.sleep(0.01)
            r = httpx.post(srv.url + "/v1/completions", json=body, timeout=30)
            assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
            start.set()
            for t in threads:
                t.join(30)
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
        short_alone = client.completions.create(model="tiny", prompt="One two", max_tokens=4, temperature=0)
        out = {}

        def ask(key, prompt, n):
            out[key] = client.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0)

        long = threading.Thread(target=ask, args=("long", "Once upon a time", 1900))
        long.start()
        time.sleep(0.05)
        ask("short", "One two", 4)
        long.join(60)
        assert out["long"].choices[0].finish_reason == "length" and out["long"].usage.completion_tokens < 1900
        assert out["short"].choices[0].text == short_alone.choices[0].text
    finally:
        srv.stop()
        engine.close()
