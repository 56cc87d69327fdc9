"""Load: 24 clients at once against one `lumen serve` (the tiny Qwen 3.5, real greedy generation): OpenAI
streamed and whole, Anthropic streamed and whole, four clients that hang up mid-stream. Every client that stays gets
exactly the text it gets alone; the hung-up ones cancel their generations; the queue drains to 0 and /metrics counts
every request. What it tried and saw is printed (run with ``-s``)."""

from __future__ import annotations

import threading
import time

import anthropic
import httpx
import openai
import pytest
from server_util import Server, load_tiny

PROMPTS = [f"Tell me about the number {i}." for i in range(6)]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    srv = Server(load_tiny(tiny_checkpoint("qwen3_5"), context=2048))
    yield srv
    srv.stop()


def openai_text(client, prompt, stream):
    kw = dict(model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS, temperature=0,
              reasoning_effort="none")
    if not stream:
        return client.chat.completions.create(**kw).choices[0].message.content or ""
    return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                   if c.choices)


def anthropic_text(client, prompt, stream):
    kw = dict(model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS,
              extra_body={"temperature": 0})
    if not stream:
        return "".join(b.text for b in client.messages.create(**kw).content if b.type == "text")
    with client.messages.stream(**kw) as s:
        return "".join(s.text_stream)


def hang_up(url, prompt):
    body = {"model": "tiny", "messages": [{"role": "user", "content": prompt}], "max_tokens": 400, "stream": True,
            "temperature": 0}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as response:
        for _ in response.iter_lines():
            break  # one line, then the client goes away


def test_many_clients_at_once(server):
    oa = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
    an = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=120)
    kinds = [("openai", False), ("openai", True), ("anthropic", False), ("anthropic", True)]
    alone = {(api, p): (openai_text(oa, p, False) if api == "openai" else anthropic_text(an, p, False))
             for api, _ in kinds for p in PROMPTS}
    jobs = [(api, stream, p) for api, stream in kinds for p in PROMPTS[:5]] + [("hangup", True, p) for p in PROMPTS[:4]]
    results, errors = {}, []

    def client(i, api, stream, prompt):
        try:
            if api == "hangup":
                hang_up(server.url, prompt)
            elif api == "openai":
                results[i] = openai_text(oa, prompt, stream)
            else:
                results[i] = anthropic_text(an, prompt, stream)
        except Exception as exc:  # reported below, with the job
            errors.append((api, stream, prompt, repr(exc)))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i, *job)) for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    wall = time.perf_counter() - t0
    assert not errors, errors
    for i, (api, stream, prompt) in enumerate(jobs):
        if api != "hangup":
            assert results[i] == alone[(api, prompt)], (api, stream, prompt)
    deadline = time.time() + 30
    while httpx.get(server.url + "/health").json()["queue_depth"] != 0:
        assert time.time() < deadline, "the queue did not drain"
        time.sleep(0.05)
    metrics = httpx.get(server.url + "/metrics").text
    served = sum(int(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                 if line.startswith("lumen_requests_total") and ('"/v1/chat/completions"' in line
                                                                 or '"/v1/messages"' in line))
    assert served >= len(jobs) + len(alone)
    assert "lumen_queue_depth 0" in metrics
    print(f"\nload: {len(jobs)} clients at once ({len(jobs) - 4} complete, 4 hang up), {wall:.2f} s wall; "
          f"all {len(jobs) - 4} got their solo text; queue drained; {served} chat requests counted")
