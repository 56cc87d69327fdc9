"""`lumen serve` over the tiny Gemma 4 checkpoint (the real Gemma 4 chat template): its chat format through both
APIs — the thought channel as reasoning, `<|tool_call>call:NAME{…}<tool_call|>` as tool calls, the reply ending at
`<|tool_response>` — with scripted replies (the engine's generate_tokens replaced by the tokens of a fixed text)."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest
from server_util import Server, load_tiny, script

WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]
CALL = ('<|channel>thought\nThe user wants the weather.<channel|>Let me look.<|tool_call>call:get_weather'
        '{city:<|"|>Paris<|"|>,days:3}<tool_call|><|tool_response>')


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return load_tiny(tiny_checkpoint("gemma4"), context=2048)


@pytest.fixture(scope="module")
def server(engine):
    srv = Server(engine)
    yield srv
    srv.stop()




def test_openai_tool_call_and_reasoning_in_gemma4_syntax(server, engine, monkeypatch):
    script(engine, monkeypatch, CALL)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    r = client.chat.completions.create(model="tiny", messages=messages, tools=WEATHER, reasoning_effort="high")
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert msg.reasoning_content == "The user wants the weather." and msg.content == "Let me look."
    (call,) = msg.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris", "days": 3}
    # the result goes back through the Gemma 4 template; the model answers
    script(engine, monkeypatch, "It is sunny in Paris.")
    history = messages + [msg.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "sunny"}'}]
    r2 = client.chat.completions.create(model="tiny", messages=history, tools=WEATHER)
    assert r2.choices[0].message.content == "It is sunny in Paris." and r2.choices[0].finish_reason == "stop"


def test_anthropic_tool_use_and_thinking_in_gemma4_syntax(server, engine, monkeypatch):
    script(engine, monkeypatch, CALL)
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    tools = [{"name": "get_weather", "description": "Weather for a city",
              "input_schema": WEATHER[0]["function"]["parameters"]}]
    msg = client.messages.create(model="tiny", max_tokens=64, tools=tools,
                                 thinking={"type": "enabled", "budget_tokens": 1024},
                                 messages=[{"role": "user", "content": "Weather in Paris?"}])
    kinds = [b.type for b in msg.content]
    assert kinds == ["thinking", "text", "tool_use"] and msg.stop_reason == "tool_use"
    assert msg.content[0].thinking == "The user wants the weather." and msg.content[1].text == "Let me look."
    assert msg.content[2].name == "get_weather" and msg.content[2].input == {"city": "Paris", "days": 3}
