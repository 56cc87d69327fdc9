"""The OpenAI-compatible API of `lumen serve`, driven by the real `openai` SDK (and httpx for raw bodies) against a
real uvicorn server over a tiny Qwen 3.5 checkpoint (random weights, the real chat template).

Random weights write random text, so two kinds of checks: consistency (streamed == whole, concurrent == alone,
usage adds up) on greedy generations, and wiring on scripted replies (the engine's ``generate_tokens`` replaced
by one yielding the tokens of a fixed text; the server's worker thread calls the same engine object).
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
from server_util import Server, load_tiny, script

CONTEXT = 2048
WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]
HELLO = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return load_tiny(tiny_checkpoint("qwen3_5"), context=CONTEXT)


@pytest.fixture(scope="module")
def server(engine):
    srv = Server(engine)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)




def stream_chat(client, **kw):
    """(content, reasoning, chunks) of a streamed chat completion."""
    chunks = list(client.chat.completions.create(stream=True, **kw))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices)
    return content, reasoning, chunks


def test_models_list_and_retrieve(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError, match="does not exist") as info:
        client.models.retrieve("gpt-9")
    assert info.value.body["code"] == "model_not_found"


def test_plain_chat_and_its_usage(client, engine):
    r = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=8, temperature=0)
    assert r.object == "chat.completion" and r.model == "tiny"
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    u = r.usage
    assert u.prompt_tokens == len(engine.encode(engine.chat_prompt(HELLO)))
    assert 1 <= u.completion_tokens <= 8 and u.total_tokens == u.prompt_tokens + u.completion_tokens


def test_streamed_chat_equals_the_whole_reply_for_greedy(client):
    kw = dict(model="tiny", messages=HELLO, max_tokens=20, temperature=0)
    whole = client.chat.completions.create(**kw)
    content, reasoning, chunks = stream_chat(client, stream_options={"include_usage": True}, **kw)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert content == (whole.choices[0].message.content or "")
    assert reasoning == (getattr(whole.choices[0].message, "reasoning_content", None) or "")
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()


def test_a_tool_call_round_trip(client, engine, monkeypatch):
    script(engine, monkeypatch, "Checking the weather.\n</think>\n\n<tool_call>\n<function=get_weather>\n"
             "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    r = client.chat.completions.create(model="tiny", messages=messages, tools=WEATHER)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert msg.reasoning_content == "Checking the weather." and not msg.content
    (call,) = msg.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}

    # Streamed, the same call arrives as one tool_calls delta.
    _, _, chunks = stream_chat(client, model="tiny", messages=messages, tools=WEATHER)
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(d.index, d.function.name, json.loads(d.function.arguments)) for d in deltas] == \
        [(0, "get_weather", {"city": "Paris", "days": 3})]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    # The assistant turn (arguments as a JSON string) and the tool's result go back; the model answers.
    script(engine, monkeypatch, "It is sunny.\n</think>\n\nSunny in Paris for 3 days.")
    history = messages + [msg.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "sunny"}'}]
    r2 = client.chat.completions.create(model="tiny", messages=history, tools=WEATHER)
    assert r2.choices[0].message.content == "Sunny in Paris for 3 days."
    assert r2.choices[0].finish_reason == "stop" and not r2.choices[0].message.tool_calls
    prompt = engine.chat_prompt(
        messages + [{"role": "assistant", "content": None, "reasoning_content": "Checking the weather.",
                     "tool_calls": [{"type": "function", "function": {"name": "get_weather",
                                                                      "arguments": {"city": "Paris", "days": 3}}}]},
                    {"role": "tool", "content": '{"sky": "sunny"}'}], tools=WEATHER)
    assert "<parameter=city>\nParis\n</parameter>" in prompt and "<tool_response>" in prompt


def test_tool_choice_decides_which_tools_the_prompt_carries(client, engine, monkeypatch):
    other = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    kw = dict(model="tiny", messages=HELLO, max_tokens=1, temperature=0)

    def prompt_tokens(tools=None, **extra):
        return client.chat.completions.create(tools=tools, **kw, **extra).usage.prompt_tokens

    def rendered(tools):
        return len(engine.encode(engine.chat_prompt(HELLO, tools=tools)))

    assert prompt_tokens(WEATHER + other, tool_choice="none") == rendered(None)
    assert prompt_tokens(WEATHER + other, tool_choice="auto") == rendered(WEATHER + other)
    forced = engine.chat_prompt_and_parser(HELLO, other, None, None, "get_time")[0]
    assert forced.endswith("</think>\n\n<tool_call>\n<function=get_time>\n")  # the named call is opened
    assert prompt_tokens(WEATHER + other, tool_choice={"type": "function", "function": {"name": "get_time"}}) \
        == len(engine.encode(forced))
    # parallel_tool_calls=false keeps the first of two calls
    script(engine, monkeypatch, "</think><tool_call>\n<function=get_time>\n</function>\n</tool_call>\n"
             "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>")
    both = client.chat.completions.create(model="tiny", messages=HELLO, tools=WEATHER + other)
    assert [c.function.name for c in both.choices[0].message.tool_calls] == ["get_time", "get_weather"]
    one = client.chat.completions.create(model="tiny", messages=HELLO, tools=WEATHER + other,
                                         parallel_tool_calls=False)
    assert [c.function.name for c in one.choices[0].message.tool_calls] == ["get_time"]


def test_reasoning_comes_back_separately_and_thinking_off_renders_another_prompt(client, engine, monkeypatch):
    with monkeypatch.context() as m:
        script(engine, m, "First, think.</think>The answer is 4.")
        r = client.chat.completions.create(model="tiny", messages=HELLO)
        assert r.choices[0].message.reasoning_content == "First, think."
        assert r.choices[0].message.content == "The answer is 4."
        content, reasoning, _ = stream_chat(client, model="tiny", messages=HELLO)
        assert (content, reasoning) == ("The answer is 4.", "First, think.")
    kw = dict(model="tiny", messages=HELLO, max_tokens=1, temperature=0)
    on = client.chat.completions.create(**kw).usage.prompt_tokens
    off = client.chat.completions.create(extra_body={"chat_template_kwargs": {"enable_thinking": False}},
                                         **kw).usage.prompt_tokens
    effort_none = client.chat.completions.create(reasoning_effort="none", **kw).usage.prompt_tokens
    assert off > on and effort_none == off
    assert off == len(engine.encode(engine.chat_prompt(HELLO, enable_thinking=False)))


def test_stop_sequences_and_max_tokens(client):
    kw = dict(model="tiny", prompt="The quick brown fox", temperature=0)
    full = client.completions.create(max_tokens=24, **kw).choices[0].text
    stop = full[6:10]
    r = client.completions.create(max_tokens=24, stop=[stop, "\x00never"], **kw)
    assert r.choices[0].text == full[:full.index(stop)] and r.choices[0].finish_reason == "stop"
    r = client.completions.create(max_tokens=3, **kw)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    r = client.chat.completions.create(model="tiny", messages=HELLO, max_completion_tokens=3, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3


def test_chat_stop_sequence_on_a_scripted_reply(client, engine, monkeypatch):
    script(engine, monkeypatch, "</think>Hello world. END and more text")
    r = client.chat.completions.create(model="tiny", messages=HELLO, stop="END")
    assert r.choices[0].message.content == "Hello world." and r.choices[0].finish_reason == "stop"


def test_completions_whole_and_streamed(client, engine):
    kw = dict(model="tiny", prompt="Once upon a time", max_tokens=12, temperature=0)
    whole = client.completions.create(**kw)
    assert whole.object == "text_completion" and whole.choices[0].text
    assert whole.usage.prompt_tokens == len(engine.encode("Once upon a time"))
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert client.completions.create(**{**kw, "prompt": ["Once upon a time"]}).choices[0].text == \
        whole.choices[0].text


def test_api_keys(engine):
    srv = Server(engine, api_keys=["k1"])
    try:
        bad = openai.OpenAI(base_url=srv.url + "/v1", api_key="nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        good = openai.OpenAI(base_url=srv.url + "/v1", api_key="k1", max_retries=0)
        assert good.models.list().data[0].id == "tiny"
        assert httpx.get(srv.url + "/health").json()["status"] == "ok"
    finally:
        srv.stop()


def test_malformed_json_is_a_400_in_openai_shape(server):
    r = httpx.post(server.url + "/v1/chat/completions", content=b"{not json",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]


@pytest.mark.parametrize("extra, words", [
    ({"temperature": "hot"}, ["temperature"]),
    ({"n": 2}, ["n=2"]),
    ({"logprobs": True, "top_logprobs": 21}, ["top_logprobs", "0 to 20"]),
    ({"frequency_penalty": 0.5}, ["frequency_penalty", "not supported"]),
    ({"response_format": {"type": "xml"}}, ["xml", "json_schema"]),
    ({"temperature": -1}, ["temperature"]),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": WEATHER}, ["nope"]),
    ({"chat_template_kwargs": {"foo": 1}}, ["foo"]),
    ({"bogus_option": 1}, ["bogus_option"]),
])
def test_bad_requests_are_400s_naming_the_problem(client, extra, words):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=2, extra_body=extra)
    assert all(w in str(info.value) for w in words), str(info.value)


@pytest.mark.parametrize("extra", [{"logprobs": 6}, {"best_of": 2}, {"max_tokens": 0}, {"suffix": "x"},
                                   {"prompt": ["a", "b"]}])
def test_unsupported_completion_options_are_400s(client, extra):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="hi", max_tokens=2, extra_body=extra)


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_over_the_context_is_a_400_naming_the_sizes(client, stream):
    long = "hello " * (CONTEXT + 50)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": long}], stream=stream)
    assert f"context size is {CONTEXT}" in str(info.value)
    with pytest.raises(openai.BadRequestError, match=f"context size is {CONTEXT}"):
        client.completions.create(model="tiny", prompt=long, stream=stream)


def test_concurrent_streaming_clients_each_get_their_single_client_output(client):
    kw = dict(model="tiny", messages=HELLO, max_tokens=16, temperature=0)
    alone = stream_chat(client, **kw)[:2]
    results = [None] * 4

    def work(i):
        results[i] = stream_chat(client, **kw)[:2]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == [alone] * 4


def test_a_client_leaving_mid_stream_cancels_and_the_server_carries_on(client, server, engine, monkeypatch):
    kw = dict(model="tiny", messages=HELLO, max_tokens=12, temperature=0)
    before = client.chat.completions.create(**kw).choices[0].message
    real, produced = engine.generate_tokens, []

    def slow(prompt_ids, max_tokens=256, params=None):
        for tok in real(prompt_ids, max_tokens, params):
            produced.append(tok)
            time.sleep(0.01)
            yield tok

    monkeypatch.setattr(engine, "generate_tokens", slow)
    body = {"model": "tiny", "messages": HELLO, "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        first = next(r.iter_lines())
        assert first.startswith("data: ")
    deadline = time.time() + 10
    while httpx.get(server.url + "/health").json()["queue_depth"] != 0:
        assert time.time() < deadline, "the cancelled generation never left the queue"
        time.sleep(0.02)
    assert len(produced) < 100  # cancelled: it did not run on towards max_tokens (4 s at this pace)
    monkeypatch.setattr(engine, "generate_tokens", real)
    after = client.chat.completions.create(**kw).choices[0].message
    assert (after.content, after.reasoning_content) == (before.content, before.reasoning_content)
    assert "lumen_queue_depth 0" in httpx.get(server.url + "/metrics").text


def test_required_and_named_tool_choice_start_the_reply_with_a_call(client, engine, monkeypatch):
    """The call opener is written after the prompt: the model continues inside the call."""
    script(engine, monkeypatch, "<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>")
    named = client.chat.completions.create(model="tiny", messages=HELLO, tools=WEATHER,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Rome"}
    assert named.choices[0].finish_reason == "tool_calls" and not named.choices[0].message.reasoning_content
    script(engine, monkeypatch, "<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n"
             "</tool_call>")
    required = client.chat.completions.create(model="tiny", messages=HELLO, tools=WEATHER, tool_choice="required")
    (call,) = required.choices[0].message.tool_calls
    assert json.loads(call.function.arguments) == {"city": "Oslo"}
