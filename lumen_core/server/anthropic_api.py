"""The Anthropic-compatible routes: ``POST /v1/messages`` (whole or streamed) and ``/v1/messages/count_tokens``.

An Anthropic request is turned into the OpenAI-style conversation the chat templates take, then answered with
``Engine.chat`` on the shared ``Service`` worker. Mapping:

* ``system`` (a string or text blocks) -> a ``system`` message.
* user blocks: ``text`` -> user message text; ``tool_result`` -> a ``{"role": "tool"}`` message, in the order the
  blocks come (Anthropic puts the results first, so they directly follow the assistant's tool calls);
  ``is_error`` results are prefixed with ``Error:``. ``image`` blocks (in user messages and in a tool_result's
  content) -> the engine's ``{"type": "image", "image": ...}`` parts in place, between the text parts (consecutive
  texts joined by newlines, as without images): a ``base64`` source (``media_type`` image/jpeg, image/png,
  image/gif or image/webp) decoded to bytes, a ``url`` source fetched by the server (``fetch.py``). A model
  loaded without a vision tower, a malformed source, a URL that cannot be fetched, a bad image: a 400 naming
  the field, before anything is queued (``vision.py``). ``document`` blocks -> 400.
* ``count_tokens`` counts each image as the tokens it becomes (preprocessed, not encoded: the tower does not run),
  so it needs the vision tower too.
* assistant blocks: ``text`` -> content, ``thinking`` -> ``reasoning_content``, ``tool_use`` -> ``tool_calls``
  (arguments as a dict, as the templates want); ``redacted_thinking`` is dropped.
* ``tools`` -> OpenAI-style function tools. ``tool_choice``: ``auto`` passes every tool; ``any`` passes every tool
  and starts the reply with a tool call; ``tool`` passes only the named one and starts the reply with a call to
  it (the format's call opener written after the prompt: ``Engine.chat(force_tool=...)``); ``none`` passes none.
  A forced call's input follows the tool's ``input_schema`` where the family has a call grammar (Qwen 3.5, Gemma 4;
  ``lumen_core/grammar.py``), and always for a tool with ``"strict": true`` (a schema that cannot be enforced, or a
  family without a call grammar: a 400).
* ``thinking``: ``enabled`` / ``disabled`` switch the template's thinking (``enabled`` on a template without a
  switch is a 400; ``disabled`` there is a no-op). Absent means off, as with Anthropic's API; ``adaptive`` or
  ``between_tools``: the template's default. ``budget_tokens`` is accepted but not enforced (``max_tokens``
  bounds thinking and answer together).
* ``stop_sequences`` are matched in this layer on the answer text (not inside thinking or tool calls), so the
  matched string can be reported as ``stop_sequence``.
* ``temperature``, ``top_p``, ``top_k`` -> sampling (anthropic SDK 2.x no longer has them as arguments: send them
  with ``extra_body``); ``metadata``, ``service_tier``, ``cache_control`` are accepted and ignored (they change
  nothing here); any other unknown top-level field is a 400 naming it.

* ``model``: the served id (``GET /v1/models``) or an alias of it (``server/app.py``: ``model_names``); any other
  name is Anthropic's 404 ``not_found_error``. Replies report the served id.
* A model without a chat template answers a 400 that points to ``/v1/completions``; errors name the request field
  to change, never a CLI flag (``checks.py`` checks the engine's conditions first).

* ``max_tokens`` may not exceed the context left after the prompt (a 400 naming it, as OpenAI does); a client that
  disconnects cancels its generation, streamed or not.

Not supported: documents (400), server tools (400), a final assistant message as a prefill (400).
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import secrets
from contextlib import aclosing
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.concurrency import run_in_threadpool

from ..chat import Content, Reasoning, ToolCall
from ..engine import sampling_params
from ..errors import InputError
from ..grammar import reply_grammar
from ..sampling import SamplingError
from ..tokenizer import StopMatcher
from . import checks, vision
from .app import APIError, JobStream, check_model, client_gone, submit
from .service import Usage

# --- request models (wrong types -> RequestValidationError -> 400 in Anthropic's shape) ---------------------


class _Model(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # strict: true is no integer, "yes" no boolean


class MessageParam(_Model):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class ToolParam(_Model):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    type: str | None = None


class ToolChoice(_Model):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None


class ThinkingParam(_Model):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = Field(default=None, strict=True)


class CountTokensRequest(BaseModel):
    """Top level: an unknown field is a 400 naming it (nothing silently ignored); per-block and per-tool extras
    such as ``cache_control`` are allowed (they change nothing here)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str
    messages: list[MessageParam]
    system: str | list[dict[str, Any]] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingParam | None = None

    _text_only = model_validator(mode="before")(checks.text_only)


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(strict=True, ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, strict=True, ge=0)
    stream: bool = False
    metadata: dict[str, Any] | None = None  # ignored: user ids and tags change nothing about the reply
    service_tier: str | None = None  # ignored: one local tier
    cache_control: dict[str, Any] | None = None  # ignored: no prompt cache across requests yet


# --- conversion ---------------------------------------------------------------------------------------------

MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")  # Anthropic's


def _bad(message: str) -> APIError:
    return APIError(400, message, "invalid_request_error")


def _block_text(block, where: str) -> str:
    if not isinstance(block, dict):
        raise _bad(f"{where}: a content block must be an object, got {type(block).__name__}")
    kind = block.get("type")
    if kind == "image":
        raise _bad(f"{where}: image blocks are taken in user messages and in tool_result content only")
    if kind == "document":
        raise _bad(f"{where}: document blocks are not supported; send the document's text as a text block")
    if kind != "text":
        raise _bad(f"{where}: unsupported content block type {kind!r} here")
    text = block.get("text")
    if not isinstance(text, str):
        raise _bad(f"{where}: a text block needs a string 'text'")
    return text


def _image_block(block: dict, where: str, refs: list[vision.ImageRef]) -> dict:
    """An image block -> the engine's image part (base64 data decoded to bytes; a URL fetched later), recorded in
    ``refs``; a malformed source is a 400 naming its field."""
    source = block.get("source")
    if not isinstance(source, dict):
        raise _bad(f'{where}.source: an image block needs a source object, {{"type": "base64", "media_type": '
                   '"image/png", "data": "..."}} or {"type": "url", "url": "https://..."}')
    kind = source.get("type")
    if kind == "base64":
        media = source.get("media_type")
        if media not in MEDIA_TYPES:
            raise _bad(f"{where}.source.media_type: {media!r} is not an image type taken here; expected one of "
                       f"{', '.join(MEDIA_TYPES)}")
        data = source.get("data")
        if not isinstance(data, str) or not data.strip():
            raise _bad(f"{where}.source.data: the image's base64 data (a non-empty string) is required")
        try:
            raw = base64.b64decode(re.sub(r"\s+", "", data), validate=True)
        except (binascii.Error, ValueError) as exc:
            raise _bad(f"{where}.source.data: not valid base64 ({exc})") from None
        return vision.image_part(raw, f"{where}.source.data", refs)
    if kind == "url":
        url = source.get("url")
        if not isinstance(url, str) or not url.strip():
            raise _bad(f"{where}.source.url: an http(s) URL (a non-empty string) is required")
        return vision.url_part(url.strip(), f"{where}.source.url", refs)
    if kind == "file":
        raise _bad(f"{where}.source: file sources (the Files API) are not supported; send base64 data or a url")
    raise _bad(f"{where}.source.type: {kind!r}; expected base64 or url")


def _add_text(parts: list[dict], text: str) -> None:
    """A text appended to a content's parts: joined by a newline to a text part just before it."""
    if parts and parts[-1]["type"] == "text":
        parts[-1]["text"] += "\n" + text
    else:
        parts.append({"type": "text", "text": text})


def _joined(parts: list[dict]) -> str | list[dict]:
    """A content's parts as the chat template takes them: the text alone without images, else the parts."""
    if all(p["type"] == "text" for p in parts):
        return parts[0]["text"] if parts else ""
    return parts


def _system_text(system) -> str | None:
    if system is None:
        return None
    if isinstance(system, str):
        return system or None
    return "\n".join(_block_text(b, f"system[{i}]") for i, b in enumerate(system)) or None


def _tool_result_content(block: dict, where: str, refs: list[vision.ImageRef]) -> str | list[dict]:
    """A tool_result's content: its text, or text and image parts (images taken as in a user message)."""
    content = block.get("content", "")
    if content is None:
        content = ""
    if isinstance(content, list):
        parts: list[dict] = []
        for i, b in enumerate(content):
            if isinstance(b, dict) and b.get("type") == "image":
                parts.append(_image_block(b, f"{where}.content[{i}]", refs))
            else:
                _add_text(parts, _block_text(b, f"{where}.content[{i}]"))
        content = _joined(parts)
    elif not isinstance(content, str):
        raise _bad(f"{where}: tool_result content must be a string or a list of text and image blocks")
    if block.get("is_error"):
        if isinstance(content, str):
            content = "Error: " + content
        elif content[0]["type"] == "text":
            content[0]["text"] = "Error: " + content[0]["text"]
        else:
            content.insert(0, {"type": "text", "text": "Error:"})
    return content


def to_openai_messages(messages: list[MessageParam], system, refs: list[vision.ImageRef] | None = None) -> list[dict]:
    """Anthropic messages (+ system) -> the OpenAI-style list the chat templates render; image blocks become the
    engine's image parts in place, recorded in ``refs`` (a list to fill) in prompt order."""
    refs = [] if refs is None else refs
    out: list[dict] = []
    sys_text = _system_text(system)
    if sys_text is not None:
        out.append({"role": "system", "content": sys_text})
    if not messages:
        raise _bad("messages: at least one message is required")
    for m, msg in enumerate(messages):
        where = f"messages[{m}]"
        if msg.role == "assistant" and m == len(messages) - 1:
            raise _bad(f"{where}: a final assistant message (a prefill to continue) is not supported; end the "
                       "conversation with a user message")
        if isinstance(msg.content, str):
            out.append({"role": msg.role, "content": msg.content})
            continue
        if msg.role == "user":
            parts: list[dict] = []
            for i, block in enumerate(msg.content):
                kind = block.get("type")
                if kind == "tool_result":
                    if parts:
                        out.append({"role": "user", "content": _joined(parts)})
                        parts = []
                    tool_id = block.get("tool_use_id")
                    if not isinstance(tool_id, str):
                        raise _bad(f"{where}.content[{i}]: a tool_result needs a string 'tool_use_id'")
                    out.append({"role": "tool", "tool_call_id": tool_id,
                                "content": _tool_result_content(block, f"{where}.content[{i}]", refs)})
                elif kind == "image":
                    parts.append(_image_block(block, f"{where}.content[{i}]", refs))
                else:
                    _add_text(parts, _block_text(block, f"{where}.content[{i}]"))
            if parts or not msg.content:
                out.append({"role": "user", "content": _joined(parts)})
            continue
        texts, reasoning, calls = [], [], []
        for i, block in enumerate(msg.content):
            kind = block.get("type")
            if kind == "thinking":
                if not isinstance(block.get("thinking"), str):
                    raise _bad(f"{where}.content[{i}]: a thinking block needs a string 'thinking'")
                reasoning.append(block["thinking"])
            elif kind == "redacted_thinking":
                continue
            elif kind == "tool_use":
                name, args = block.get("name"), block.get("input", {})
                if not isinstance(name, str) or not isinstance(args, dict):
                    raise _bad(f"{where}.content[{i}]: a tool_use block needs a string 'name' and an object "
                               "'input'")
                calls.append({"id": str(block.get("id") or ""), "type": "function",
                              "function": {"name": name, "arguments": args}})
            else:
                texts.append(_block_text(block, f"{where}.content[{i}]"))
        turn: dict = {"role": "assistant", "content": "".join(texts)}
        if reasoning:
            turn["reasoning_content"] = "\n".join(reasoning)
        if calls:
            turn["tool_calls"] = calls
        out.append(turn)
    return out


def to_openai_tools(tools: list[ToolParam] | None, choice: ToolChoice | None) -> list[dict] | None:
    if not tools or (choice is not None and choice.type == "none"):
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.type not in (None, "custom"):
            raise _bad(f"tools[{i}]: server tool {tool.type!r} is not supported; only custom tools "
                       "(name, description, input_schema)")
        fn = {"name": tool.name, "parameters": tool.input_schema}
        if tool.description:
            fn["description"] = tool.description
        out.append({"type": "function", "function": fn})
    if choice is not None and choice.type == "tool":
        if not choice.name:
            raise _bad("tool_choice: type 'tool' needs a 'name'")
        out = [t for t in out if t["function"]["name"] == choice.name]
        if not out:
            raise _bad(f"tool_choice: no tool named {choice.name!r} in tools")
    return out


def _think(engine, thinking: ThinkingParam | None, template: str) -> bool | None:
    """Anthropic's semantics: no ``thinking`` field means no thinking (off where the template has a switch);
    adaptive / between_tools leave it to the template's default."""
    has_switch = checks.has_thinking_switch(engine, template)
    if thinking is not None and thinking.type in ("adaptive", "between_tools"):
        return None
    if thinking is None or thinking.type == "disabled":
        return False if has_switch else None
    if not has_switch:
        raise _bad("thinking: this model's chat template has no thinking switch; leave 'thinking' out or disable it")
    return True


class _Prepared:
    """A request rendered to its prompt: what generation and count_tokens need."""

    def __init__(self, app: FastAPI, req: CountTokensRequest):
        check_model(app, req.model)
        engine = app.state.engine
        self.engine = engine
        self.refs: list[vision.ImageRef] = []
        self.messages = to_openai_messages(req.messages, req.system, self.refs)
        self.tools = to_openai_tools(req.tools, req.tool_choice)
        template = checks.require_chat_template(engine, self.tools, "/v1/messages")
        self.think = _think(engine, req.thinking, template)
        choice = req.tool_choice
        self.force = (choice.name if choice is not None and choice.type == "tool" else
                      bool(choice is not None and choice.type == "any" and self.tools))
        if self.force and not checks.can_force_tool_call(engine):
            raise _bad(f"tool_choice: this model's chat format has no tool-call syntax to start a call with, so "
                       f"type {choice.type!r} cannot be honoured; use type 'auto'")
        try:
            prompt = engine.chat_prompt_and_parser(self.messages, self.tools, self.think, None, self.force)[0]
            if self.refs:  # as Engine.chat: what the family's processor writes around an image (Gemma 3)
                prompt = engine.arch.image_text(prompt)
            self.ids = checks.encode(engine, prompt, chat=True)
        except APIError:
            raise
        except InputError as exc:
            raise _bad(str(exc)) from exc
        except Exception as exc:  # a template that refuses the conversation (raise_exception in jinja)
            raise _bad(f"the chat template could not render this conversation: {exc}") from exc
        self.input_tokens = len(self.ids)  # the text's; ``prepare`` counts the images' tokens in

    async def measure_images(self, app: FastAPI) -> None:
        """Images checked, fetched and decoded (a 400 naming the field, before anything is queued), and their
        tokens counted in ``input_tokens``."""
        if not self.refs:
            return
        images = await vision.load_images(app, self.refs, param=None)
        ids = await run_in_threadpool(vision.expand, self.engine, self.ids, images, None)
        self.input_tokens = len(ids)


async def prepare(app: FastAPI, req: CountTokensRequest) -> _Prepared:
    """The request converted, rendered and measured, images included."""
    prep = _Prepared(app, req)
    await prep.measure_images(app)
    return prep


# --- generation ---------------------------------------------------------------------------------------------


class _StopSequences(StopMatcher):
    """StopMatcher that remembers which stop string matched."""

    matched: str | None = None

    def _first_stop(self):
        hits = [(i, s) for s in self.stops if (i := self.held.find(s)) >= 0]
        if not hits:
            return None
        i, self.matched = min(hits, key=lambda h: h[0])
        return i


def _tool_ids():
    while True:
        yield "toolu_" + secrets.token_hex(12)


def _sampling(engine, req: MessagesRequest) -> dict:
    """The request's sampling options, checked here (a 400 naming the field) rather than on the worker."""
    sampling = {k: v for k, v in (("temperature", req.temperature), ("top_p", req.top_p), ("top_k", req.top_k))
                if v is not None}
    try:
        sampling_params(engine.config.sampling_defaults(), sampling).validate()
    except SamplingError as exc:
        raise _bad(str(exc)) from exc
    return sampling


def _runner(prep: _Prepared, req: MessagesRequest, state: dict, structure=None):
    """The zero-arg generator function the Service runs on its worker: chat events, answer text cut at the
    first stop sequence (``state["stop"]`` then names it); ``structure``: the reply's grammar (``reply_grammar``)."""
    sampling = _sampling(prep.engine, req)
    stops = [s for s in (req.stop_sequences or []) if s]

    def run():
        matcher = _StopSequences(stops)
        extra = {} if structure is None else {"constraint": structure.constraint()}  # one per generation
        for event in prep.engine.chat(prep.messages, tools=prep.tools, think=prep.think, max_tokens=req.max_tokens,
                                      call_ids=_tool_ids(), force_tool=prep.force, **extra, **sampling):
            if not stops:
                yield event
                continue
            if isinstance(event, Content):
                text, stopped = matcher.push(event.text)
                if text:
                    yield Content(text)
                if stopped:
                    state["stop"] = matcher.matched
                    return
                continue
            held = matcher.flush()  # a stop cannot span a tool call or a thinking block
            if held:
                yield Content(held)
            yield event
        held = matcher.flush()
        if held:
            yield Content(held)

    return run


def _stop_reason(usage: Usage, state: dict, saw_tool: bool) -> str:
    if state.get("stop") is not None:
        return "stop_sequence"
    if saw_tool:
        return "tool_use"
    if usage.finish_reason == "length":
        return "max_tokens"
    return "end_turn"


def _message_id() -> str:
    return "msg_" + secrets.token_hex(12)


def _sse(event: str, data: dict) -> str:
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


def _start_block(event) -> dict:
    if isinstance(event, Reasoning):
        return {"type": "thinking", "thinking": "", "signature": ""}
    if isinstance(event, ToolCall):
        return {"type": "tool_use", "id": event.id, "name": event.name, "input": {}}
    return {"type": "text", "text": ""}


def _delta(event) -> dict:
    if isinstance(event, Reasoning):
        return {"type": "thinking_delta", "thinking": event.text}
    if isinstance(event, ToolCall):
        return {"type": "input_json_delta", "partial_json": event.arguments_json}
    return {"type": "text_delta", "text": event.text}


def _blocks(events: list) -> list[dict]:
    """Events -> content blocks, consecutive text (or thinking) merged, in the order they came."""
    blocks: list[dict] = []
    for e in events:
        if isinstance(e, ToolCall):
            blocks.append({"type": "tool_use", "id": e.id, "name": e.name, "input": e.arguments})
        elif isinstance(e, Reasoning):
            if blocks and blocks[-1]["type"] == "thinking":
                blocks[-1]["thinking"] += e.text
            else:
                blocks.append({"type": "thinking", "thinking": e.text, "signature": ""})
        elif isinstance(e, Content):
            if blocks and blocks[-1]["type"] == "text":
                blocks[-1]["text"] += e.text
            else:
                blocks.append({"type": "text", "text": e.text})
    return blocks


class _StreamBlocks:
    """Chat events -> content_block_start / _delta / _stop events: consecutive text (or thinking) shares a block,
    each tool call is a block of its own whose one input_json_delta carries the whole input."""

    def __init__(self):
        self.index, self.open, self.saw_tool = -1, None, False

    def push(self, event) -> list[str]:
        kind = type(event)
        if kind not in (Content, Reasoning, ToolCall):
            return []
        out = []
        self.saw_tool |= kind is ToolCall
        if self.open is not kind or kind is ToolCall:
            out += self.close()
            self.index += 1
            self.open = kind
            out.append(_sse("content_block_start", {"type": "content_block_start", "index": self.index,
                                                    "content_block": _start_block(event)}))
        out.append(_sse("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                "delta": _delta(event)}))
        return out

    def close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [_sse("content_block_stop", {"type": "content_block_stop", "index": self.index})]


async def _create(request: Request, req: MessagesRequest):
    app, model = request.app, request.app.state.model_name
    prep = await prepare(app, req)
    checks.check_length(prep.engine, prep.input_tokens, "messages")
    checks.check_max_tokens(prep.engine, app.state.limits.max_tokens, prep.input_tokens, req.max_tokens,
                            "max_tokens", "messages")
    strict = bool(prep.tools) and any((t.model_extra or {}).get("strict") is True for t in req.tools or ())
    try:  # before the queue: a schema that cannot be enforced is a 400
        structure = await run_in_threadpool(reply_grammar, prep.engine, prep.messages, prep.tools, prep.think,
                                            prep.force, strict=strict)
    except InputError as exc:
        raise _bad(str(exc)) from exc
    usage, state = Usage(), {}
    service = app.state.service
    job = submit(request, _runner(prep, req, state, structure), usage)
    msg_id = _message_id()

    if not req.stream:
        try:
            events = await service.collect(job, lambda: client_gone(request))
        except InputError as exc:
            raise _bad(str(exc)) from exc
        saw_tool = any(isinstance(e, ToolCall) for e in events)
        return JSONResponse({
            "id": msg_id, "type": "message", "role": "assistant", "model": model, "content": _blocks(events),
            "stop_reason": _stop_reason(usage, state, saw_tool), "stop_sequence": state.get("stop"),
            "usage": _usage(prep, usage, usage.completion_tokens)})

    # Wait for the first event before answering, so that errors raised before any output still come back as an
    # HTTP error rather than inside a 200 stream; a client that leaves meanwhile cancels the generation.
    stream = service.events(job)
    watch = service.watch(job, lambda: client_gone(request))
    try:
        first = [await stream.__anext__()]
    except StopAsyncIteration:
        first = []
    except InputError as exc:
        await stream.aclose()
        raise _bad(str(exc)) from exc
    except BaseException:
        await stream.aclose()
        raise
    finally:
        watch.cancel()

    async def sse():
        yield _sse("message_start", {"type": "message_start", "message": {
            "id": msg_id, "type": "message", "role": "assistant", "model": model, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": _usage(prep, usage, 0)}})
        yield _sse("ping", {"type": "ping"})
        blocks = _StreamBlocks()
        async with aclosing(stream) as it:
            try:
                for event in first:
                    for chunk in blocks.push(event):
                        yield chunk
                async for event in it:
                    for chunk in blocks.push(event):
                        yield chunk
            except Exception as exc:  # the headers are sent: Anthropic's in-stream error event
                kind = "invalid_request_error" if isinstance(exc, InputError) else "api_error"
                yield _sse("error", {"type": "error", "error": {"type": kind, "message": str(exc)}})
                return
        for chunk in blocks.close():
            yield chunk
        yield _sse("message_delta", {"type": "message_delta",
                                     "delta": {"stop_reason": _stop_reason(usage, state, blocks.saw_tool),
                                               "stop_sequence": state.get("stop")},
                                     "usage": _usage(prep, usage, usage.completion_tokens)})
        yield _sse("message_stop", {"type": "message_stop"})

    return JobStream(sse(), job)


def _usage(prep, usage, output_tokens: int) -> dict:
    """Anthropic's usage: ``input_tokens`` are the prompt tokens prefilled, ``cache_read_input_tokens`` those the
    prefix cache supplied (their sum is the prompt); nothing is written to a cache on request
    (``cache_creation_input_tokens`` 0: Lumen's prefix cache saves on its own)."""
    cached = min(usage.cached_tokens, prep.input_tokens)
    return {"input_tokens": prep.input_tokens - cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached, "output_tokens": output_tokens}


def mount(app: FastAPI) -> None:
    """Add the Anthropic routes to ``app`` (made by ``create_app``)."""

    @app.post("/v1/messages")
    async def messages(req: MessagesRequest, request: Request):
        return await _create(request, req)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(req: CountTokensRequest):
        return {"input_tokens": (await prepare(app, req)).input_tokens}
