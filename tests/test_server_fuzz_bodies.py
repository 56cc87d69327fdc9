"""Fuzz the request bodies of the generating routes with hypothesis, against the real app over the tiny Qwen 3.5
checkpoint with its real generation and sampler (no script): OpenAI ``/v1/chat/completions`` and
``/v1/completions``, Anthropic ``/v1/messages``.

Each case starts from a valid body and replaces some of its fields (top level, or inside the first message) with
arbitrary JSON: null, booleans where integers are expected, integers past 2**63 and past the float range, floats
down to subnormals and NaN/Infinity (Python's json reads and writes them), strings with lone UTF-16 surrogates,
nested lists and objects; or adds a field; or sends a JSON value that is no object at all. The checks:

* never a 5xx, and every error body in its API's shape (OpenAI ``{"error": {message, type, param, code}}``,
  Anthropic ``{"type": "error", "error": {type, message}}``);
* a 200 is the API's object; a stream carries no internal error (the 500 of a response already started).

``max_tokens`` in the valid bodies is small, and the app's request timeout is 0.2 s, so a case the fuzz makes
valid with a large ``max_tokens`` costs little. ``LUMEN_FUZZ_EXAMPLES`` sets the cases per route (300) for a
longer soak. What it tried is printed at the end (``pytest -s``) and kept in
``BODY_FUZZ_REPORT``.
"""

from __future__ import annotations

import json
import os
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_util import load_tiny
from starlette.testclient import TestClient

from lumen_core.server.app import create_app
from lumen_core.server.settings import Limits

EXAMPLES = int(os.environ.get("LUMEN_FUZZ_EXAMPLES", 300))  # per route: ~10-15 s for the file on two cores
BODY_FUZZ_REPORT: Counter = Counter()
ANTHROPIC = "/v1/messages"
MESSAGE = {"role": "user", "content": "Hello there"}
VALID = {
    "/v1/chat/completions": {"model": "tiny", "messages": [MESSAGE], "max_tokens": 2},
    "/v1/completions": {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 2},
    ANTHROPIC: {"model": "tiny", "messages": [MESSAGE], "max_tokens": 2},
}
FIELDS = {  # the fields each route reads (and a few it refuses), so the fuzz reaches past "unknown field"
    "/v1/chat/completions": ["model", "messages", "stream", "stream_options", "stop", "max_tokens",
                             "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
                             "repetition_penalty", "frequency_penalty", "presence_penalty", "n", "logit_bias",
                             "user", "metadata", "tools", "tool_choice", "parallel_tool_calls", "logprobs",
                             "top_logprobs", "response_format", "reasoning_effort", "chat_template_kwargs",
                             "modalities"],
    "/v1/completions": ["model", "prompt", "stream", "stream_options", "stop", "max_tokens", "temperature",
                        "top_p", "top_k", "min_p", "seed", "repetition_penalty", "echo", "suffix", "best_of",
                        "logprobs", "n", "user"],
    ANTHROPIC: ["model", "messages", "max_tokens", "system", "stop_sequences", "temperature", "top_p", "top_k",
                "stream", "tools", "tool_choice", "thinking", "metadata"],
}
MESSAGE_FIELDS = ["role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content"]

# --- values -------------------------------------------------------------------------------------------------------

SURROGATES = st.sampled_from(["\ud800", "a\udc00b", "\udfff", "\ud83d", "x\ud800\ud800"])
TEXT = st.one_of(st.text(st.characters(exclude_categories=()), max_size=20), SURROGATES,
                 st.sampled_from(["", " ", "tiny", "user", "assistant", "text", "auto", "required", "none",
                              "enabled", "function", "Hello"]))
INTEGERS = st.one_of(st.integers(-3, 10), st.sampled_from([2**31, 2**63, -(2**63), 10**30, 10**400, 4096]),
                     st.integers())
FLOATS = st.one_of(st.floats(), st.sampled_from([1e-310, 5e-324, 1e-320, 1e308, -0.0, 0.5, 1.0, 2.0, 1e-5]))
SCALARS = st.one_of(st.none(), st.booleans(), INTEGERS, FLOATS, TEXT)
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(TEXT, inner, max_size=3)), max_leaves=8)
NUMBERS = st.one_of(FLOATS, INTEGERS)
TYPED = {  # a value of the field's own type, half the time: the fuzz then reaches the sampler, the context checks
    **dict.fromkeys(["temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty"], NUMBERS),
    **dict.fromkeys(["top_k", "seed", "max_tokens", "max_completion_tokens", "n", "best_of"], INTEGERS),
    **dict.fromkeys(["stream", "echo", "parallel_tool_calls", "logprobs"], st.booleans()),
    **dict.fromkeys(["model", "system", "suffix", "reasoning_effort", "role", "content", "user"], TEXT),
    **dict.fromkeys(["stop", "stop_sequences", "prompt"], st.one_of(TEXT, st.lists(TEXT, max_size=3))),
}

OBJECTS = st.dictionaries(TEXT, VALUES, max_size=3)
ROUTE_TYPED = {  # structured fields: their shape right, their contents arbitrary (the chat templates read them)
    "/v1/chat/completions": {
        "tools": st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
            {"name": TEXT}, optional={"parameters": OBJECTS, "description": TEXT})}), max_size=2),
        "tool_choice": st.one_of(st.sampled_from(["auto", "none", "required"]), st.fixed_dictionaries(
            {"type": st.just("function"), "function": st.fixed_dictionaries({"name": TEXT})})),
        "tool_calls": st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
            {"name": TEXT, "arguments": st.one_of(TEXT, OBJECTS)})}), max_size=2),
        "chat_template_kwargs": st.fixed_dictionaries({}, optional={"enable_thinking": VALUES}),
    },
    ANTHROPIC: {
        "tools": st.lists(st.fixed_dictionaries({"name": TEXT}, optional={"input_schema": OBJECTS,
                                                                          "description": TEXT}), max_size=2),
        "tool_choice": st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "tool", "none"])},
                                             optional={"name": TEXT}),
        "thinking": st.fixed_dictionaries({"type": st.sampled_from(["enabled", "disabled", "adaptive"])},
                                          optional={"budget_tokens": INTEGERS}),
        "content": st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "tool_use", "tool_result",
                                                                           "thinking", "image"])},
                                                  optional={"text": TEXT, "name": TEXT, "input": VALUES,
                                                            "tool_use_id": TEXT, "content": VALUES,
                                                            "thinking": TEXT}), max_size=3),
    },
}


def value(route: str, name: str):
    typed = ROUTE_TYPED.get(route, {}).get(name, TYPED.get(name))
    return VALUES if typed is None else st.one_of(typed, VALUES)


@st.composite
def bodies(draw, route: str):
    """A valid body with some fields replaced, one added, or the first message changed; or no object at all."""
    kind = draw(st.sampled_from(["fields", "fields", "fields", "message", "extra", "not an object"]))
    if kind == "not an object":
        return draw(st.one_of(SCALARS, st.lists(VALUES, max_size=3)))
    body = json.loads(json.dumps(VALID[route]))
    if kind == "extra":
        body[draw(TEXT)] = draw(VALUES)
    elif kind == "message" and "messages" in body:
        message = dict(MESSAGE)
        for name in draw(st.lists(st.sampled_from(MESSAGE_FIELDS), min_size=1, max_size=3, unique=True)):
            message[name] = draw(value(route, name))
        body["messages"] = draw(st.sampled_from([[message], [message, MESSAGE], [MESSAGE, message]]))
    else:
        for name in draw(st.lists(st.sampled_from(FIELDS[route]), min_size=1, max_size=4, unique=True)):
            body[name] = draw(value(route, name))
    return body


# --- checks -------------------------------------------------------------------------------------------------------

def openai_error_shape(body) -> bool:
    err = body.get("error") if isinstance(body, dict) else None
    return (isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}
            and isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
            and (err["param"] is None or isinstance(err["param"], str))
            and (err["code"] is None or isinstance(err["code"], str)))


def anthropic_error_shape(body) -> bool:
    err = body.get("error") if isinstance(body, dict) else None
    return (body.get("type") == "error" and isinstance(err, dict) and set(err) == {"type", "message"}
            and isinstance(err["type"], str) and isinstance(err["message"], str) and err["message"])


def check_stream(route: str, text: str) -> None:
    """Every event parses; an in-stream error is a request error, never an internal one."""
    for line in text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        if route == ANTHROPIC and event.get("type") == "error":
            assert anthropic_error_shape(event) and event["error"]["type"] != "api_error", event
        elif route != ANTHROPIC and "error" in event:
            assert openai_error_shape(event) and event["error"]["type"] != "api_error", event


def check(route: str, body, response) -> None:
    status = response.status_code
    BODY_FUZZ_REPORT[(route, status)] += 1
    assert status < 500, (status, response.text, body)
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        assert status == 200
        check_stream(route, response.text)
        return
    reply = response.json()
    if status >= 400:
        shape = anthropic_error_shape if route == ANTHROPIC else openai_error_shape
        assert shape(reply), (status, reply, body)
        return
    kind = {"/v1/chat/completions": ("object", "chat.completion"), "/v1/completions": ("object", "text_completion"),
            ANTHROPIC: ("type", "message")}[route]
    assert reply[kind[0]] == kind[1], reply


# --- the fuzz -----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def client(tiny_checkpoint):
    engine = load_tiny(tiny_checkpoint("qwen3_5"), context=1024)
    app = create_app(engine, None, "tiny", Limits(request_timeout=0.2))
    with TestClient(app, raise_server_exceptions=False) as test_client:
        yield test_client
    app.state.service.close()


@pytest.mark.parametrize("route", list(VALID))
def test_no_body_makes_a_server_error(client, route):
    @given(body=bodies(route))
    @settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    def run(body):
        # json.dumps escapes lone surrogates (\ud800) and writes NaN/Infinity, as a careless client would
        content = json.dumps(body).encode()
        check(route, body, client.post(route, content=content, headers={"content-type": "application/json"}))

    run()


def test_report_what_the_fuzz_tried():
    if not BODY_FUZZ_REPORT:
        pytest.skip("the fuzz did not run (this test selected alone)")
    print(f"\nbody fuzz: {sum(BODY_FUZZ_REPORT.values())} requests per (route, status):")
    for (route, status), n in sorted(BODY_FUZZ_REPORT.items()):
        print(f"  POST {route} -> {status}: {n}")
    assert all(status < 500 for (_, status) in BODY_FUZZ_REPORT)
