"""The Anthropic Messages API of `lumen serve`: the real `anthropic` SDK against a real server on loopback, over a
tiny Qwen 3.5 checkpoint (its real chat template). Random weights write random text, so tool calls, thinking and
stop sequences are checked with a scripted reply (``engine.generate_tokens`` yields the tokens of a fixed text)."""

from __future__ import annotations

import time

import anthropic
import httpx
import pytest
from server_util import Server, load_tiny, script

from lumen_core.engine import Stats

WEATHER = [{"name": "get_weather", "description": "Weather for a city",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                             "required": ["city"]}}]
HI = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return load_tiny(tiny_checkpoint("qwen3_5"), context=2048)


@pytest.fixture(scope="module")
def server(engine):
    srv = Server(engine)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=30)




def text_of(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def test_a_plain_message_with_usage(client):
    msg = client.messages.create(model="tiny", max_tokens=8, messages=HI, extra_body={"temperature": 0},
                                 thinking={"type": "disabled"}, metadata={"user_id": "u1"})
    assert msg.id.startswith("msg_") and msg.type == "message" and msg.role == "assistant" and msg.model == "tiny"
    assert msg.usage.input_tokens > 5 and 1 <= msg.usage.output_tokens <= 8
    assert msg.stop_reason in ("end_turn", "max_tokens")
    assert (msg.stop_reason == "max_tokens") == (msg.usage.output_tokens == 8)
    assert all(b.type in ("text", "thinking", "tool_use") for b in msg.content)


def test_streaming_gives_the_same_greedy_reply(client):
    kwargs = dict(model="tiny", max_tokens=12, messages=HI, extra_body={"temperature": 0}, system="Be brief.")
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        types = [event.type for event in stream]
        final = stream.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
    assert text_of(final) == text_of(whole)
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens == whole.usage.input_tokens
    assert types[0] == "message_start" and types[-1] == "message_stop" and "message_delta" in types


def test_a_tool_use_round_trip(client, engine, monkeypatch):
    call = ("Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
    script(engine, monkeypatch, call)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    first = client.messages.create(model="tiny", max_tokens=100, messages=messages, tools=WEATHER,
                                   tool_choice={"type": "auto"}, thinking={"type": "disabled"})
    assert first.stop_reason == "tool_use"
    assert [b.type for b in first.content] == ["text", "tool_use"]
    assert first.content[0].text == "Let me check."
    use = first.content[1]
    assert use.id.startswith("toolu_") and use.name == "get_weather" and use.input == {"city": "Paris", "days": 3}

    with client.messages.stream(model="tiny", max_tokens=100, messages=messages, tools=WEATHER,
                                thinking={"type": "disabled"}) as stream:
        deltas = [e.delta for e in stream if e.type == "content_block_delta"]
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use" and streamed.content[1].input == {"city": "Paris", "days": 3}
    assert any(d.type == "input_json_delta" for d in deltas)

    prompts: list[str] = []
    script(engine, monkeypatch, "It is sunny in Paris.", prompts)
    messages += [{"role": "assistant", "content": first.content},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                               "content": [{"type": "text", "text": "sunny, 23 C"}]},
                                              {"type": "text", "text": "Thanks!"}]}]
    second = client.messages.create(model="tiny", max_tokens=100, messages=messages, tools=WEATHER,
                                    thinking={"type": "disabled"})
    assert second.stop_reason == "end_turn" and text_of(second) == "It is sunny in Paris."
    prompt = prompts[0]
    assert "<function=get_weather>" in prompt and "<tool_response>\nsunny, 23 C\n</tool_response>" in prompt
    assert prompt.index("sunny, 23 C") < prompt.index("Thanks!")


def test_tool_choice_none_and_tool(client, engine, monkeypatch):
    prompts: list[str] = []
    script(engine, monkeypatch, "ok", prompts)
    two = WEATHER + [{"name": "get_time", "input_schema": {"type": "object", "properties": {}}}]
    for choice in ({"type": "none"}, {"type": "tool", "name": "get_time"}, {"type": "any"}):
        client.messages.create(model="tiny", max_tokens=5, messages=HI, tools=two, tool_choice=choice)
    none, only_time, any_ = prompts
    assert "get_weather" not in none and "get_time" not in none
    assert "get_time" in only_time and "get_weather" not in only_time
    assert "get_time" in any_ and "get_weather" in any_
    with pytest.raises(anthropic.BadRequestError, match="no tool named"):
        client.messages.create(model="tiny", max_tokens=5, messages=HI, tools=two,
                               tool_choice={"type": "tool", "name": "nope"})


def test_tool_choice_tool_starts_the_reply_with_that_call(client, engine, monkeypatch):
    prompts: list[str] = []
    script(engine, monkeypatch, "<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>", prompts)
    msg = client.messages.create(model="tiny", max_tokens=64, messages=HI, tools=WEATHER,
                                 tool_choice={"type": "tool", "name": "get_weather"})
    assert [b.type for b in msg.content] == ["tool_use"] and msg.stop_reason == "tool_use"
    assert msg.content[0].name == "get_weather" and msg.content[0].input == {"city": "Rome"}
    assert prompts[0].endswith("<tool_call>\n<function=get_weather>\n")


def test_thinking_enabled_gives_a_thinking_block_then_text(client, engine, monkeypatch):
    prompts: list[str] = []
    script(engine, monkeypatch, "The user greets me.\n</think>\n\nHello!", prompts)
    kwargs = dict(model="tiny", max_tokens=1024, messages=HI, thinking={"type": "enabled", "budget_tokens": 1024})
    msg = client.messages.create(**kwargs)
    assert [b.type for b in msg.content] == ["thinking", "text"]
    assert msg.content[0].thinking == "The user greets me." and msg.content[1].text == "Hello!"
    assert msg.stop_reason == "end_turn"
    assert prompts[0].rstrip().endswith("<think>")

    with client.messages.stream(**kwargs) as stream:
        deltas = [(e.index, e.delta.type) for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert (0, "thinking_delta") in deltas and (1, "text_delta") in deltas
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in msg.content]

    # a past thinking block goes back to the template as that turn's reasoning_content
    prompts.clear()
    history = [{"role": "assistant", "content": [
        {"type": "thinking", "thinking": "I need the weather.", "signature": ""},
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]}]
    client.messages.create(model="tiny", max_tokens=5, thinking={"type": "enabled", "budget_tokens": 1024},
                           messages=HI + history, tools=WEATHER)
    assert "<think>\nI need the weather.\n</think>" in prompts[0]
    assert "<parameter=city>\nParis\n</parameter>" in prompts[0]


def test_a_client_that_leaves_a_stream_cancels_its_generation(server, engine, monkeypatch):
    produced = []

    def endless(prompt_ids, max_tokens=256, params=None):
        engine.stats = Stats(prompt_tokens=len(prompt_ids))
        tok = engine.tokenizer.backend.encode(" word", add_special_tokens=False).ids[0]
        for _ in range(max_tokens):
            time.sleep(0.002)
            produced.append(tok)
            yield tok

    monkeypatch.setattr(engine, "generate_tokens", endless)
    body = {"model": "tiny", "max_tokens": 2000, "messages": HI, "stream": True, "thinking": {"type": "disabled"}}
    with httpx.stream("POST", server.url + "/v1/messages", json=body, timeout=30) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("event: content_block_delta"):
                break
    deadline = time.time() + 10
    while server.app.state.service.queue_depth and time.time() < deadline:
        time.sleep(0.01)
    assert server.app.state.service.queue_depth == 0 and len(produced) < 500  # 2000 at this pace take 4 s


def test_stop_sequences(client, engine, monkeypatch):
    script(engine, monkeypatch, "One two. END three four")
    kwargs = dict(model="tiny", max_tokens=100, messages=HI, stop_sequences=["nomatch", "END"],
                  thinking={"type": "disabled"})
    msg = client.messages.create(**kwargs)
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == "END"
    assert text_of(msg).strip() == "One two." and "three" not in text_of(msg)
    with client.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == "END"
    assert text_of(final) == text_of(msg)

    script(engine, monkeypatch, "One two three")
    msg = client.messages.create(**kwargs)
    assert msg.stop_reason == "end_turn" and msg.stop_sequence is None
    msg = client.messages.create(**{**kwargs, "max_tokens": 2})
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 2


def test_count_tokens_equals_the_input_tokens_of_the_same_request(client):
    kwargs = dict(model="tiny", messages=HI, system=[{"type": "text", "text": "Be brief."}], tools=WEATHER)
    counted = client.messages.count_tokens(**kwargs)
    msg = client.messages.create(max_tokens=2, extra_body={"temperature": 0}, **kwargs)
    assert counted.input_tokens == msg.usage.input_tokens > 20


def test_a_bad_key_is_an_authentication_error(engine):
    srv = Server(engine, api_keys=["k1"])
    try:
        bad = anthropic.Anthropic(base_url=srv.url, api_key="nope", max_retries=0)
        with pytest.raises(anthropic.AuthenticationError):
            bad.messages.count_tokens(model="tiny", messages=HI)
        good = anthropic.Anthropic(base_url=srv.url, api_key="k1", max_retries=0)
        assert good.messages.count_tokens(model="tiny", messages=HI).input_tokens > 0
    finally:
        srv.stop()


def _error(response: httpx.Response, status: int = 400) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    return body["error"]["message"]


def test_invalid_requests_are_400_in_anthropic_shape(server):
    url = server.url + "/v1/messages"
    assert "max_tokens" in _error(httpx.post(url, json={"model": "tiny", "messages": HI}))
    assert "bogus_option" in _error(httpx.post(url, json={"model": "tiny", "max_tokens": 5, "messages": HI,
                                                          "bogus_option": 1}))  # unknown: refused, not ignored
    assert "JSON" in _error(httpx.post(url, content=b'{"model": "tiny", "max_tokens": ',
                                       headers={"content-type": "application/json"}))
    assert "max_tokens" in _error(httpx.post(url, json={"model": "tiny", "max_tokens": "many", "messages": HI}))
    assert "messages" in _error(httpx.post(url, json={"model": "tiny", "max_tokens": 5, "messages": "hi"}))
    _error(httpx.post(url, json={"model": "tiny", "max_tokens": 5,
                                 "messages": [{"role": "robot", "content": "hi"}]}))
    assert "temperature" in _error(httpx.post(url, json={"model": "tiny", "max_tokens": 5, "messages": HI,
                                                         "temperature": -1}))


def test_a_prompt_over_the_context_is_a_400_naming_the_sizes(client):
    long = [{"role": "user", "content": "word " * 3000}]
    for stream in (False, True):
        with pytest.raises(anthropic.BadRequestError, match="context size is 2048") as info:
            client.messages.create(model="tiny", max_tokens=5, messages=long, stream=stream)
        assert info.value.body["error"]["type"] == "invalid_request_error"


def test_an_image_block_is_refused(client):
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    with pytest.raises(anthropic.BadRequestError, match="no vision"):
        client.messages.create(model="tiny", max_tokens=5,
                               messages=[{"role": "user", "content": [image, {"type": "text", "text": "What?"}]}])


def test_models_in_anthropic_shape(client):
    assert [m.id for m in client.models.list()] == ["tiny"]
    assert client.models.retrieve("tiny").type == "model"
    with pytest.raises(anthropic.NotFoundError):
        client.models.retrieve("claude-9")
