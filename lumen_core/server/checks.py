"""Engine conditions a request can run into, checked here before the engine is called, so that the error names
what the client can change: a request field, another route. The engine's own messages are written for the command
line and the config file (a flag to drop, a config key to raise), which an HTTP client has no use for.

* No chat template (neither the checkpoint's nor its model family's): the chat routes answer a 400 that points
  to ``POST /v1/completions`` with a plain prompt.
* Thinking switched on or off where the template has no switch: a 400 naming the request field
  (``reasoning_effort``, ``chat_template_kwargs.enable_thinking``, Anthropic ``thinking``), from the routes.
* A forced tool call where the chat format has no tool-call syntax: a 400 naming ``tool_choice``.
* A prompt longer than the context: a 400 naming both sizes (OpenAI code ``context_length_exceeded``).
* No tokenizer: a 400 saying that the model takes no text.
* ``max_tokens`` more than the context left after the prompt (or the server's ``max-tokens-limit``): OpenAI's 400
  "max_tokens is too large", naming the field.
* Text the tokenizer cannot take (a lone UTF-16 surrogate, which JSON's ``\ud800`` escape can write): a 400 naming
  the field, from the request models' validator.
"""

from __future__ import annotations

import re

from .app import APIError

NO_TOKENIZER = "this model has no tokenizer, so the server can neither read a text prompt nor write a reply"


def chat_template(engine, tools: list | None = None) -> str | None:
    """The chat template the engine renders (its ``tool_use`` variant when tools are given and it has one): the
    tokenizer's, which the engine set at load (the checkpoint's, else the model family's); None when none."""
    template = getattr(engine.tokenizer, "chat_template", None) if engine.tokenizer is not None else None
    if isinstance(template, dict):
        template = template.get("tool_use" if tools is not None and "tool_use" in template else "default")
    return template or None


def require_chat_template(engine, tools: list | None, route: str) -> str:
    """The template of a chat request, or a 400 for a model without one (``route``: the route's name)."""
    if engine.tokenizer is None:
        raise APIError(400, NO_TOKENIZER)
    template = chat_template(engine, tools)
    if template is None:
        raise APIError(400, f"this model has no chat template, so {route} cannot format a conversation for it; "
                       "send a plain prompt to POST /v1/completions instead", param="messages")
    return template


def has_thinking_switch(engine, template: str) -> bool:
    """Whether the chat format names a template variable that switches thinking and ``template`` reads it."""
    kwarg = engine.chat_format().thinking_kwarg
    return bool(kwarg) and kwarg in template


def can_force_tool_call(engine) -> bool:
    """Whether the chat format has a call opener to write after the prompt (``tool_choice`` required / named)."""
    syntax = engine.chat_format().tool_calls
    return syntax is not None and hasattr(syntax, "opener")


def encode(engine, text: str, chat: bool = False) -> list[int]:
    """Token ids of a plain prompt, or (``chat``) of a rendered chat prompt, whose template wrote its own special
    tokens: counted exactly as Engine.chat tokenizes it."""
    if engine.tokenizer is None:
        raise APIError(400, NO_TOKENIZER)
    return engine.encode(text, add_special_tokens=not chat)


def check_length(engine, n: int, param: str) -> None:
    """A prompt of ``n`` tokens fits the context (and is not empty); ``param``: the field that holds it."""
    if n > engine.context_size:
        raise APIError(400, f"the prompt has {n} tokens but this model's context size is {engine.context_size} "
                       f"tokens; shorten the {param}", param=param, code="context_length_exceeded")
    if n == 0:
        raise APIError(400, "the prompt is empty (0 tokens)", param=param)


def check_max_tokens(engine, limit: int | None, prompt_tokens: int, max_tokens: int | None, param: str,
                     prompt_param: str) -> None:
    """A requested ``max_tokens`` (``param``: the field that holds it) within the server's ``limit`` and the
    context left after the prompt (``prompt_param``: the field that holds that); left out, nothing to check (the
    generation stops where the context ends)."""
    if max_tokens is None:
        return
    if limit is not None and max_tokens > limit:
        raise APIError(400, f"{param} is too large: {max_tokens}. This server generates at most {limit} tokens "
                       "per request", param=param)
    room = max(engine.context_size - prompt_tokens, 0)
    if max_tokens > room:
        raise APIError(400, f"{param} is too large: {max_tokens}. The prompt has {prompt_tokens} tokens and this "
                       f"model's context size is {engine.context_size} tokens, so at most {room} can be "
                       f"generated; lower {param} or shorten the {prompt_param}", param=param)


_SURROGATE = re.compile("[\ud800-\udfff]")  # after JSON decoding a pair is one code point: what is left is lone


def lone_surrogate(data) -> str | None:
    """The path (``messages[0].content``) of a string or key in a parsed JSON body that holds a lone UTF-16
    surrogate, or None. Walked without recursion, so any depth JSON allows is fine."""
    stack = [(data, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                return path or "body"
        elif isinstance(value, dict):
            for key, item in value.items():
                where = f"{path}.{key}" if path else str(key)
                if isinstance(key, str) and _SURROGATE.search(key):
                    return where
                stack.append((item, where))
        elif isinstance(value, list):
            stack.extend((item, f"{path}[{i}]") for i, item in enumerate(value))
    return None


def text_only(data):
    """A request model's before-validator: a ValueError (a 400) naming the field whose text holds a lone
    surrogate, which no tokenizer can read and no reply could quote."""
    path = lone_surrogate(data)
    if path is not None:  # a key on the path may hold one too: escaped, as pydantic cannot carry it
        path = path.encode("utf-8", "backslashreplace").decode("utf-8")
        raise ValueError(f"{path} holds a lone UTF-16 surrogate (such as \\ud800 without its pair), which is not "
                         "text; send the character itself or a whole surrogate pair")
    return data
