"""Errors of `lumen serve` in API terms, through the real `openai` and `anthropic` SDKs (and httpx for raw bodies).

* A ``model`` the server does not serve: OpenAI's 404 ``model_not_found`` / Anthropic's 404 ``not_found_error``,
  which each SDK raises as ``NotFoundError``; the served id, its aliases and (OpenAI) no ``model`` are answered.
* Engine conditions (no chat template, no thinking switch, no tool-call syntax, a prompt over the context, no
  tokenizer): a 400 that names the request field or the route to use, never a CLI flag ("--chat", "omit",
  "drop the flag") nor a config key. The model is the tiny Qwen 3.5 checkpoint; the conditions are made on it by
  replacing its chat template or its chat format for one test (the server's worker uses the same engine object).
"""

from __future__ import annotations

import re

import anthropic
import httpx
import openai
import pytest
from server_util import Server, load_tiny, script

from lumen_core.chat import ChatFormat

CONTEXT = 2048
HI = [{"role": "user", "content": "Hello there"}]
O_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
A_TOOLS = [{"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
# A ChatML template that reads no thinking switch (no `enable_thinking`).
NO_SWITCH = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# What a message for a command-line user says, and an HTTP client must never read: a flag, advice to omit or
# drop one, a config key.
CLI_WORDS = re.compile(r"--[a-z]|\bomit\b|drop the flag|\bflag\b|\bconfig\b|chat-template|context-size", re.I)


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return load_tiny(tiny_checkpoint("qwen3_5"), context=CONTEXT)


@pytest.fixture(scope="module")
def server(engine):
    srv = Server(engine)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=60)


def api_terms(error) -> str:
    """The raw body of an SDK's error, checked for CLI wording; returns it."""
    body = error.response.text
    assert not CLI_WORDS.search(body), body
    return body


# --- model names ------------------------------------------------------------------------------------------------

def test_an_unknown_model_is_openais_404_model_not_found(oai, server):
    for stream in (False, True):
        with pytest.raises(openai.NotFoundError) as info:
            oai.chat.completions.create(model="gpt-4o", messages=HI, max_tokens=2, stream=stream)
        assert info.value.response.json() == {"error": {
            "message": "The model `gpt-4o` does not exist or you do not have access to it.",
            "type": "invalid_request_error", "param": "model", "code": "model_not_found"}}
        with pytest.raises(openai.NotFoundError) as info:
            oai.completions.create(model="gpt-3.5-turbo-instruct", prompt="Hi", max_tokens=2, stream=stream)
        assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        oai.models.retrieve("gpt-4o")
    # the model is checked before anything else in the body
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": "gpt-4o", "messages": HI, "n": 3})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_an_unknown_model_is_anthropics_404_not_found_error(claude, server):
    for stream in (False, True):
        with pytest.raises(anthropic.NotFoundError) as info:
            claude.messages.create(model="claude-nope-9", max_tokens=2, messages=HI, stream=stream)
        body = info.value.response.json()
        assert body["type"] == "error" and body["error"]["type"] == "not_found_error"
        assert body["error"]["message"].startswith("model: claude-nope-9") and "tiny" in body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.count_tokens(model="claude-nope-9", messages=HI)
    with pytest.raises(anthropic.NotFoundError):
        claude.models.retrieve("claude-nope-9")


def test_the_served_id_its_aliases_and_no_model_are_answered(oai, claude, server, engine, monkeypatch):
    script(engine, monkeypatch, "Hi.")
    path = str(engine.config.model_path)
    served, checkpoint = "tiny", path.rstrip("/").split("/")[-1]
    assert server.app.state.model_names == (served, checkpoint, path)
    for name in (served, checkpoint, path):
        r = oai.chat.completions.create(model=name, messages=HI, max_tokens=4)
        assert r.model == served  # replies name the served id
        assert oai.completions.create(model=name, prompt="Hi", max_tokens=2).model == served
        assert claude.messages.create(model=name, max_tokens=4, messages=HI).model == served
        assert claude.messages.count_tokens(model=name, messages=HI).input_tokens > 0
        assert oai.models.retrieve(name).id == served
    for route, body in (("/v1/chat/completions", {"messages": HI, "max_tokens": 2}),
                        ("/v1/completions", {"prompt": "Hi", "max_tokens": 2})):
        r = httpx.post(server.url + route, json=body)  # OpenAI routes: `model` may be left out
        assert r.status_code == 200 and r.json()["model"] == served, r.text
    assert [m.id for m in oai.models.list().data] == [served]  # the aliases are not listed


def test_without_model_name_the_served_id_is_the_checkpoints_name(engine):
    srv = Server(engine, model_name=None)
    try:
        name = str(engine.config.model_path).rstrip("/").split("/")[-1]
        assert httpx.get(srv.url + "/v1/models").json()["data"][0]["id"] == name
        r = httpx.post(srv.url + "/v1/chat/completions", json={"model": "tiny", "messages": HI, "max_tokens": 2})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    finally:
        srv.stop()


# --- engine conditions in API terms -----------------------------------------------------------------------------

@pytest.fixture
def no_template(engine, monkeypatch):
    """A model of no known family whose checkpoint has no chat template: nothing to chat with."""
    monkeypatch.setattr(engine.tokenizer, "chat_template", None)
    monkeypatch.setattr(engine, "chat_format", lambda: ChatFormat("plain"))


@pytest.mark.parametrize("stream", [False, True])
def test_chat_without_a_chat_template_points_to_completions(oai, claude, engine, monkeypatch, no_template, stream):
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model="tiny", messages=HI, max_tokens=2, stream=stream)
    body = api_terms(info.value)
    assert "no chat template" in body and "/v1/completions" in body and info.value.body["param"] == "messages"
    with pytest.raises(anthropic.BadRequestError) as info:
        claude.messages.create(model="tiny", max_tokens=2, messages=HI, stream=stream)
    body = api_terms(info.value)
    assert "no chat template" in body and "/v1/completions" in body
    assert info.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError) as info:
        claude.messages.count_tokens(model="tiny", messages=HI)
    assert "/v1/completions" in api_terms(info.value)
    # ...where a plain prompt is answered
    script(engine, monkeypatch, "Hi.")
    assert oai.completions.create(model="tiny", prompt="Hello", max_tokens=4, stream=stream)


def test_thinking_on_a_template_without_a_switch_names_the_request_field(oai, claude, engine, monkeypatch):
    monkeypatch.setattr(engine.tokenizer, "chat_template", NO_SWITCH)
    script(engine, monkeypatch, "Hi.")
    cases = [({"reasoning_effort": "high"}, "reasoning_effort", "reasoning_effort"),
             ({"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}},
              "chat_template_kwargs.enable_thinking", "chat_template_kwargs"),
             ({"reasoning_effort": "low", "extra_body": {"chat_template_kwargs": {"enable_thinking": True}}},
              "reasoning_effort and chat_template_kwargs.enable_thinking", "reasoning_effort")]
    for stream in (False, True):
        for kw, named, param in cases:
            with pytest.raises(openai.BadRequestError) as info:
                oai.chat.completions.create(model="tiny", messages=HI, max_tokens=2, stream=stream, **kw)
            body = api_terms(info.value)
            assert named in body and "no thinking switch" in body and info.value.body["param"] == param, body
        with pytest.raises(anthropic.BadRequestError) as info:
            claude.messages.create(model="tiny", max_tokens=2, messages=HI, stream=stream,
                                   thinking={"type": "enabled", "budget_tokens": 1024})
        body = api_terms(info.value)
        assert "thinking" in body and "no thinking switch" in body
    # Without a thinking request, and with Anthropic's `disabled` (a no-op here), the same model answers.
    assert oai.chat.completions.create(model="tiny", messages=HI, max_tokens=4).choices[0].message.content == "Hi."
    for thinking in (None, {"type": "disabled"}):
        extra = {"thinking": thinking} if thinking else {}
        assert claude.messages.create(model="tiny", max_tokens=4, messages=HI, **extra).content[0].text == "Hi."


def test_a_forced_tool_call_without_tool_call_syntax_names_tool_choice(oai, claude, engine, monkeypatch):
    monkeypatch.setattr(engine.tokenizer, "chat_template", NO_SWITCH)
    monkeypatch.setattr(engine, "chat_format", lambda: ChatFormat("plain"))
    script(engine, monkeypatch, "Hi.")
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        with pytest.raises(openai.BadRequestError) as info:
            oai.chat.completions.create(model="tiny", messages=HI, tools=O_TOOLS, tool_choice=choice, max_tokens=2)
        assert "tool_choice" in api_terms(info.value) and info.value.body["param"] == "tool_choice"
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"}):
        with pytest.raises(anthropic.BadRequestError) as info:
            claude.messages.create(model="tiny", max_tokens=2, messages=HI, tools=A_TOOLS, tool_choice=choice)
        assert "tool_choice" in api_terms(info.value)
    # tools left to the model: answered, or refused (the engine may refuse tools it cannot read back) in API terms
    for call in (lambda: oai.chat.completions.create(model="tiny", messages=HI, tools=O_TOOLS, max_tokens=2),
                 lambda: claude.messages.create(model="tiny", max_tokens=2, messages=HI, tools=A_TOOLS)):
        try:
            call()
        except (openai.BadRequestError, anthropic.BadRequestError) as exc:
            assert "tools" in api_terms(exc)


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_over_the_context_names_both_sizes_and_no_config_key(oai, claude, stream):
    long = "hello " * (CONTEXT + 50)
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": long}], stream=stream)
    body = api_terms(info.value)
    assert f"context size is {CONTEXT}" in body and info.value.body["code"] == "context_length_exceeded"
    assert info.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model="tiny", prompt=long, stream=stream)
    assert f"context size is {CONTEXT}" in api_terms(info.value) and info.value.body["param"] == "prompt"
    with pytest.raises(anthropic.BadRequestError) as info:
        claude.messages.create(model="tiny", max_tokens=5, messages=[{"role": "user", "content": long}],
                               stream=stream)
    assert f"context size is {CONTEXT}" in api_terms(info.value)


def test_a_model_without_a_tokenizer_says_so_in_api_terms(oai, claude, engine, monkeypatch):
    monkeypatch.setattr(engine, "tokenizer", None)
    for call in (lambda: oai.completions.create(model="tiny", prompt="Hi", max_tokens=2),
                 lambda: oai.chat.completions.create(model="tiny", messages=HI, max_tokens=2),
                 lambda: claude.messages.create(model="tiny", max_tokens=2, messages=HI)):
        with pytest.raises((openai.BadRequestError, anthropic.BadRequestError)) as info:
            call()
        assert "no tokenizer" in api_terms(info.value)
