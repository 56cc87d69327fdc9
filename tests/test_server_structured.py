"""Structured output through `lumen serve`, driven by the real openai and anthropic SDKs against a real uvicorn server
over the tiny random Qwen 3.5 (and Gemma 4 for tool calls): ``response_format`` json_object / json_schema (the SDK's
``parse`` helper with a pydantic model included), forced and strict tool calls, the 400s. Random weights write
garbage, so every valid document here is the grammar's doing; sampling at temperature 1 with fixed seeds and a
budget far above what they use (finish_reason 'stop' asserted; a cut document is 'length', asserted on purpose)."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import openai
import pydantic
import pytest
from server_util import Server, load_tiny

BUDGET = 3000
HELLO = [{"role": "user", "content": "Hello there"}]
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
ANSWER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 16},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "unit": {"enum": ["celsius", "fahrenheit"]},
    "hourly": {"type": "array", "items": {"type": "number", "minimum": -50, "maximum": 60}, "maxItems": 4},
}, "required": ["city", "days", "unit", "hourly"], "additionalProperties": False}
PARAMS = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "unit": {"enum": ["c", "f"]},
}, "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
             "additionalProperties": False}}}]
SCHEMA_OF = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    srv = Server(load_tiny(tiny_checkpoint("qwen3_5"), context=4096))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def create(client, **kw):
    kw = {"extra_body": NO_THINK, "max_tokens": BUDGET, **kw}
    return client.chat.completions.create(model="tiny", messages=HELLO, temperature=1.0, **kw)


def test_json_object(client):
    for seed in range(2):
        r = create(client, response_format={"type": "json_object"}, seed=seed)
        assert r.choices[0].finish_reason == "stop"
        assert isinstance(json.loads(r.choices[0].message.content), dict)


@pytest.mark.parametrize("strict", [True, False])
def test_json_schema(client, strict):
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": ANSWER, "strict": strict}}
    for seed in range(2):
        r = create(client, response_format=fmt, seed=seed)
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), ANSWER)


def test_json_schema_streamed_equals_whole(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": ANSWER}}
    whole = create(client, response_format=fmt, seed=5).choices[0].message.content
    chunks = list(create(client, response_format=fmt, seed=5, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole
    jsonschema.validate(json.loads(streamed), ANSWER)


def test_thinking_stays_free_and_the_answer_follows_the_schema(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": ANSWER}}
    r = create(client, response_format=fmt, seed=2, extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "stop" and msg.reasoning_content
    jsonschema.validate(json.loads(msg.content), ANSWER)


class Weather(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=16)
    days: int = pydantic.Field(ge=1, le=7)
    windy: bool


def test_the_sdks_parse_helper_with_a_pydantic_model(client):
    r = client.chat.completions.parse(model="tiny", messages=HELLO, max_tokens=BUDGET, temperature=1.0, seed=1,
                                      response_format=Weather, extra_body=NO_THINK)
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Weather) and 1 <= parsed.days <= 7


def test_max_tokens_cuts_the_document_with_finish_length(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": ANSWER}}
    r = create(client, response_format=fmt, seed=0, max_tokens=4)
    assert r.choices[0].finish_reason == "length"
    with pytest.raises(ValueError):
        json.loads(r.choices[0].message.content)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_calls_follow_the_parameters(client, choice):
    for seed in range(2):
        r = create(client, tools=TOOLS, tool_choice=choice, seed=seed)
        calls = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and calls
        for call in calls:
            if isinstance(choice, dict):
                assert call.function.name == "get_weather"
            jsonschema.validate(json.loads(call.function.arguments), SCHEMA_OF[call.function.name])


def test_strict_tools_under_auto(client):
    tools = [{"type": "function", "function": {**t["function"], "strict": True}} for t in TOOLS]
    for seed in range(3):
        r = create(client, tools=tools, seed=seed, max_tokens=200)
        for call in r.choices[0].message.tool_calls or []:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMA_OF[call.function.name])


@pytest.mark.parametrize("fmt, words", [
    ({"type": "xml"}, ["xml", "json_schema"]),
    ({"type": "json_schema"}, ["name", "schema"]),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}, ["not a valid JSON Schema"]),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}}},
     ["cannot be enforced", "uniqueItems"]),
])
def test_response_formats_that_cannot_be_honoured_are_400s(client, fmt, words):
    with pytest.raises(openai.BadRequestError) as info:
        create(client, response_format=fmt, max_tokens=2)
    assert all(w in str(info.value) for w in words), str(info.value)
    assert info.value.body["param"] == "response_format"


def test_a_strict_tool_whose_schema_cannot_be_enforced_is_a_400(client):
    tools = [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "(?=x)y"}}}}}]
    with pytest.raises(openai.BadRequestError, match="look-around"):
        create(client, tools=tools, max_tokens=2)


# --- Anthropic: tool_choice tool / any, Gemma 4's call syntax ----------------------------------------------------


@pytest.fixture(scope="module")
def gemma_server(tiny_checkpoint):
    srv = Server(load_tiny(tiny_checkpoint("gemma4"), context=4096))
    yield srv
    srv.stop()


@pytest.mark.parametrize("family", ["server", "gemma_server"])
@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_anthropic_forced_tool_use_follows_the_input_schema(request, family, choice):
    srv = request.getfixturevalue(family)
    client = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0, timeout=120)
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS]
    for _ in range(2):  # Anthropic's API has no seed: these draws differ run to run (the arguments are bounded)
        msg = client.messages.create(model="tiny", max_tokens=BUDGET, messages=HELLO, tools=tools, tool_choice=choice,
                                     extra_body={"temperature": 1.0})
        uses = [b for b in msg.content if b.type == "tool_use"]
        assert msg.stop_reason == "tool_use" and uses
        for use in uses:
            jsonschema.validate(use.input, SCHEMA_OF[use.name])


def test_openai_forced_call_on_gemma4(gemma_server):
    client = openai.OpenAI(base_url=gemma_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    r = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=BUDGET, temperature=1.0, seed=0,
                                       tools=TOOLS, tool_choice="required")
    for call in r.choices[0].message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMA_OF[call.function.name])


def test_anthropic_strict_tools_under_auto(server):
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"], "strict": True}
             for t in TOOLS]
    for _ in range(3):
        msg = client.messages.create(model="tiny", max_tokens=200, messages=HELLO, tools=tools,
                                     extra_body={"temperature": 1.0})
        for use in [b for b in msg.content if b.type == "tool_use"]:
            jsonschema.validate(use.input, SCHEMA_OF[use.name])
    bad = [{"name": "f", "strict": True, "input_schema": {"type": "object", "properties": {
        "a": {"type": "array", "uniqueItems": True}}}}]
    with pytest.raises(anthropic.BadRequestError, match="uniqueItems"):
        client.messages.create(model="tiny", max_tokens=2, messages=HELLO, tools=bad)
