"""`lumen serve` with a prefix cache: a chat's second turn prefills only what is new, and the usage says so (the
Anthropic SDK's ``cache_read_input_tokens``, OpenAI's ``prompt_tokens_details.cached_tokens``); the reply equals a
server's without the cache; /metrics reports the hit rate."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest
from server_util import Server

import lumen_core as lumen

SYSTEM = "You are a careful assistant who answers briefly. " * 8


def load(path, mb):
    kv = {"context-size": 1024, "sequences": 2}
    if mb:
        kv["prefix-cache-mb"] = mb
    return lumen.load({"model": {"path": str(path), "hidden-layers": {"kv-cache": kv}}}, progress=False)


@pytest.fixture(scope="module")
def servers(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_5")
    cached, plain = Server(load(path, 32)), Server(load(path, 0))
    yield cached, plain
    for srv in (cached, plain):
        srv.stop()
        srv.app.state.engine.close()


def test_second_turn_reads_the_cache_anthropic(servers):
    cached, plain = servers
    clients = [anthropic.Anthropic(base_url=s.url, api_key="x", max_retries=0, timeout=120) for s in servers]
    messages = [{"role": "user", "content": "Name a colour."}]
    replies = []
    for _ in range(2):
        got = [c.messages.create(model="tiny", system=SYSTEM, messages=messages, max_tokens=12,
                                 extra_body={"temperature": 0}) for c in clients]
        assert [b.text for b in got[0].content] == [b.text for b in got[1].content]
        assert got[1].usage.cache_read_input_tokens == 0
        total = got[0].usage.input_tokens + got[0].usage.cache_read_input_tokens
        assert total == got[1].usage.input_tokens  # the prompt, split into prefilled and cached tokens
        replies.append(got[0])
        text = "".join(b.text for b in got[0].content if b.type == "text") or "ok"
        messages = messages + [{"role": "assistant", "content": text}, {"role": "user", "content": "Another?"}]
    assert replies[0].usage.cache_read_input_tokens == 0
    assert replies[1].usage.cache_read_input_tokens > len(SYSTEM.split())  # the history was not prefilled again
    metrics = httpx.get(cached.url + "/metrics").text
    assert "lumen_prefix_cache_hits_total 1" in metrics or "lumen_prefix_cache_hits_total 2" in metrics


def test_second_turn_reads_the_cache_openai(servers):
    cached, plain = servers
    clients = [openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=120) for s in servers]
    messages = [{"role": "system", "content": SYSTEM + " (openai)"}, {"role": "user", "content": "Name a fruit."}]
    usages = []
    for _ in range(2):
        got = [c.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
               for c in clients]
        assert got[0].choices[0].message.content == got[1].choices[0].message.content
        assert got[0].usage.prompt_tokens == got[1].usage.prompt_tokens
        assert got[1].usage.prompt_tokens_details.cached_tokens == 0
        usages.append(got[0].usage)
        messages = messages + [{"role": "assistant", "content": got[0].choices[0].message.content or "ok"},
                               {"role": "user", "content": "Another?"}]
    assert usages[0].prompt_tokens_details.cached_tokens == 0
    assert usages[1].prompt_tokens_details.cached_tokens > len(SYSTEM.split())
