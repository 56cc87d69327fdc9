"""The OpenAI-compatible routes: ``POST /v1/chat/completions`` and ``POST /v1/completions``.

Requests are pydantic models that forbid unknown fields, so a misspelt or unsupported option is a 400, never
silently dropped. A few fields OpenAI clients commonly send are declared and ignored because they change
nothing about the reply (``user``, ``metadata``, ``store``, ``service_tier``, ``prompt_cache_key``,
``safety_identifier``). Options this server cannot honour are refused with a 400 naming them: ``n`` other than
1, non-zero ``frequency_penalty``/``presence_penalty``, a non-empty ``logit_bias``, a ``response_format`` other
than ``text``, ``json_object`` and ``json_schema``, content parts other than text and ``image_url``,
``top_logprobs`` past 20 (or without ``logprobs: true``); for completions ``suffix``, ``best_of`` > 1, ``logprobs``
past 5, ``max_tokens: 0`` without ``echo`` and more than one prompt.

Behaviour worth knowing:

* ``model``: the served id (``GET /v1/models``), an alias of it (``server/app.py``: ``model_names``) or left out;
  any other name is OpenAI's 404 ``model_not_found``. The responses report the served id.
* Sampling options left out take the model config's defaults (then the engine's); ``max_tokens`` /
  ``max_completion_tokens`` likewise (both given: they must agree). Non-standard ``top_k``, ``min_p`` and
  ``repetition_penalty`` are accepted too.
* Thinking: ``reasoning_effort`` ``none``/``minimal`` switches the template's thinking off, ``low``/``medium``/
  ``high`` on; the non-standard ``chat_template_kwargs: {"enable_thinking": bool}`` does the same (other keys
  are refused; the two disagreeing is a 400). Left out, the template's default applies. A model whose template
  has no thinking switch refuses either with a 400 naming the field. The reply's reasoning comes back as
  ``reasoning_content``.
* A model without a chat template answers chat with a 400 that points to ``/v1/completions``. Errors speak in
  API terms (the field to change), never in the CLI's: the engine conditions are checked first (``checks.py``).
* ``tool_choice``: ``auto`` (default) passes the tools; ``none`` renders the prompt without them; a named
  function passes only that tool and starts the reply with a call to it; ``required`` passes them all and starts
  the reply with a tool call (the format's call opener is written after the prompt, closing an open reasoning
  block: ``Engine.chat(force_tool=...)``). ``parallel_tool_calls: false`` keeps only the first call.
* Structured output (``lumen_core/grammar.py``, llguidance; docs/structured-output.md): ``response_format``
  ``{"type": "json_object"}`` (any JSON object) or ``{"type": "json_schema", "json_schema": {"name", "schema",
  "strict"}}`` constrains the answer, ``strict`` or not; the reasoning stays free (the grammar starts after the
  reasoning block). A forced call's arguments (``required`` / a named function) follow the tool's ``parameters``
  where the family has a call grammar (Qwen 3.5, Gemma 4; elsewhere the call runs unconstrained), and a tool with
  ``"strict": true`` has them followed always (a family without one: a 400). A schema that cannot be enforced is a
  400 naming the reason. An answer cut by ``max_tokens`` ends with ``finish_reason`` ``length`` (a cut document).
* Images: ``{"type": "image_url", "image_url": {"url": ..., "detail": ...}}`` parts in user messages, the URL a
  ``data:image/...;base64,...`` URI or an http(s) URL (fetched by the server: ``fetch.py``); ``detail`` (``auto``,
  ``low``, ``high``) is accepted and changes nothing, the preprocessing follows the checkpoint's processor config.
  They become the engine's ``{"type": "image", "image": ...}`` parts in place, between the text parts (consecutive
  text parts joined by newlines, as a text-only content is). A model loaded without a vision tower, a URL that
  cannot be fetched, a bad image: a 400 naming the field, before anything is queued (``vision.py``). Usage and the
  context check count each image's tokens.
* ``finish_reason`` is ``tool_calls`` when the reply made calls, else ``length`` when ``max_tokens`` or the
  context ran out, else ``stop``.
* A prompt longer than the context (or a bad sampling value, a ``max_tokens`` past the context left after it,
  messages the chat template refuses) is a 400 before anything is queued, for streaming requests too, so a client
  never gets a broken stream for them. Types are strict (``true`` is no integer) and a lone surrogate in any
  string is a 400 naming the field.
* Logprobs (``lumen_core/logprobs.py``): a token's logprob is the float64 log-softmax of the raw logits (before
  temperature and the sampling filters), what ``lumen perplexity`` gives the same token after the same text.
  Chat ``logprobs: true`` (+ ``top_logprobs`` 0-20) gives ``choices[0].logprobs = {"content": [{"token",
  "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}...]}...], "refusal": null}`` over every
  generated token (reasoning and tool-call tokens included) except the trailing ones that wrote no text (the
  end-of-turn token, a stop string's tokens). ``token``: the token's own text (a SentencePiece word's leading
  space kept, special tokens as written); a token holding part of a UTF-8 character gives its raw bytes in
  ``bytes`` and ``\\xNN`` for them in ``token``, as OpenAI does. Streamed, each chunk carries the tokens
  generated since the previous chunk: the tokens of its text, and before them those whose text was held back (part
  of a character, a possible stop string, a tag the chat parser waits on); a chunk with text and no new token
  carries ``"content": []``, the role chunk ``null``; the tokens of a ``parallel_tool_calls: false`` call left out
  ride with the next chunk. Streamed and whole replies list the same tokens.
  Completions ``logprobs: 0..5`` gives the legacy ``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}],
  "text_offset"}`` over every generated token, the end-of-turn and stop-string tokens included (a scoring harness
  counts one entry per token); ``top_logprobs`` also holds the chosen token (up to ``logprobs`` + 1 entries, as
  OpenAI), two tokens that read the same keep the likelier; ``text_offset``: where each token's text starts in the
  reply's text, as the tokenizer's streamed decoding places it. ``echo: true`` writes the prompt before the reply,
  and with ``logprobs`` scores its tokens too (the first one ``null``), in a first pass over a fresh cache
  (``prompt_logprobs``); ``max_tokens: 0`` (with ``echo`` only) scores the prompt and generates nothing
  (``finish_reason`` ``length``): lm-evaluation-harness's loglikelihood requests. The prompt may be token ids
  (``[1, 2, 3]`` or ``[[1, 2, 3]]``, each in the model's vocabulary), as such harnesses send it; echoed, it is
  their decoding. Streamed completions carry their tokens per chunk the same way; the tokens that wrote no text
  come with the finishing chunk, and an echoed prompt's logprobs with the first chunk (the prompt's text).
* Every generation runs through the shared `Service` queue (a full queue: 429 with Retry-After); a client that
  disconnects cancels its generation, streamed or not (the next token is not computed).
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.concurrency import run_in_threadpool

from ..chat import Content, Reasoning, ToolCall, collect
from ..engine import Stats, sampling_params
from ..errors import InputError
from ..grammar import reply_grammar
from ..logprobs import Offsets, Scored, chat_logprobs, completion_logprobs, prompt_logprobs, with_logprobs
from ..sampling import SamplingError
from . import checks, vision
from .app import APIError, JobStream, check_model, client_gone, submit
from .service import Job, Usage

# --- request models ------------------------------------------------------------------------------------


# strict: a JSON value of the wrong type is a 400, never converted (true is not the integer 1, "yes" not a bool,
# 2.0 not an integer); an integer is still a number.
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _Loose(BaseModel):
    # Parts of messages: clients echo back assistant messages as the SDK returned them (refusal, annotations,
    # audio: null, ...), so unknown keys inside a message are ignored.
    model_config = ConfigDict(extra="ignore", strict=True)


class ContentPart(_Loose):
    type: str
    text: str | None = None
    image_url: Any = None  # {"url": ..., "detail": ...}: checked by _content, whose 400 names the field


class FunctionCallIn(_Loose):
    name: str
    arguments: str | dict = "{}"


class ToolCallIn(_Loose):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class Message(_Loose):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None  # an alias some clients use


class FunctionDef(_Loose):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(_Strict):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # OpenAI's; nothing to obfuscate here


class ResponseFormat(_Loose):
    type: str
    json_schema: dict[str, Any] | None = None  # {"name", "schema", "strict", "description"}


class _Common(_Strict):
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    n: int | None = None
    logit_bias: dict[str, float] | None = None
    # Commonly sent, no effect on the reply: accepted and ignored.
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    _text_only = model_validator(mode="before")(checks.text_only)


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    modalities: list[str] | None = None


class CompletionRequest(_Common):
    prompt: str | list[Any]
    max_tokens: int | None = Field(default=None, ge=0)  # 0: with echo, the prompt is scored and nothing generated
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = None


# --- shared helpers ------------------------------------------------------------------------------------


def _refuse(condition: bool, param: str, message: str) -> None:
    if condition:
        raise APIError(400, message, param=param)


def _common_checks(req: _Common) -> None:
    _refuse(req.n not in (None, 1), "n", f"n={req.n} is not supported: this server returns exactly one choice")
    for name in ("frequency_penalty", "presence_penalty"):
        value = getattr(req, name)
        _refuse(value not in (None, 0), name, f"{name}={value} is not supported (only 0); "
                "repetition_penalty is available instead")
    _refuse(bool(req.logit_bias), "logit_bias", "logit_bias is not supported")
    _refuse(req.stream_options is not None and not req.stream, "stream_options",
            "stream_options is only allowed with stream=true")


def _stops(stop) -> list[str] | None:
    if stop is None:
        return None
    stops = [stop] if isinstance(stop, str) else list(stop)
    _refuse(any(s == "" for s in stops), "stop", "stop sequences must not be empty strings")
    return stops


def _sampling(engine, req: _Common) -> dict:
    names = ("temperature", "top_k", "top_p", "min_p", "seed", "repetition_penalty")
    sampling = {k: getattr(req, k) for k in names if getattr(req, k) is not None}
    try:  # the worker would raise the same later; here it is a clean 400 before the queue (and the stream)
        sampling_params(engine.config.sampling_defaults(), sampling).validate()
    except SamplingError as exc:
        raise APIError(400, str(exc), param=exc.field) from exc
    except InputError as exc:
        raise APIError(400, str(exc)) from exc
    return sampling


def _include_usage(req: _Common) -> bool:
    return bool(req.stream and req.stream_options and req.stream_options.include_usage)


def _usage(usage: Usage) -> dict:
    """OpenAI's usage; ``prompt_tokens_details.cached_tokens``: prompt tokens the prefix cache supplied."""
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": min(usage.cached_tokens, usage.prompt_tokens)}}


def _finish(usage: Usage, calls: bool) -> str:
    if calls:
        return "tool_calls"
    return "length" if usage.finish_reason == "length" else "stop"


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _sse_error(exc: BaseException) -> str:
    status = 400 if isinstance(exc, InputError) else 500
    kind = "invalid_request_error" if status == 400 else "api_error"
    message = str(exc) if status == 400 else f"internal error: {type(exc).__name__}: {exc}"
    return _sse({"error": {"message": message, "type": kind, "param": None, "code": None}})


async def _consume(request: Request, job: Job) -> list:
    """All events of a non-streamed generation; a client that disconnects meanwhile cancels it."""
    try:
        return await request.app.state.service.collect(job, lambda: client_gone(request))
    except InputError as exc:
        raise APIError(400, str(exc)) from exc


def _max_tokens_param(req: _Common) -> str:
    return "max_completion_tokens" if getattr(req, "max_completion_tokens", None) is not None else "max_tokens"


# --- chat ----------------------------------------------------------------------------------------------


DETAILS = ("auto", "low", "high")


def _content(content, where: str, role: str, refs: list[vision.ImageRef]) -> str | list | None:
    """A message's content for the chat template: a string, or (a list of parts) its text parts joined by newlines;
    with ``image_url`` parts (user messages only), a list of text parts (consecutive ones joined likewise) and the
    engine's image parts ``{"type": "image", "image": SOURCE}`` in their order, each recorded in ``refs``."""
    if content is None or isinstance(content, str):
        return content
    parts: list[dict] = []
    for j, part in enumerate(content):
        field = f"{where}.content[{j}]"
        if part.type == "text" and part.text is not None:
            if parts and parts[-1]["type"] == "text":
                parts[-1]["text"] += "\n" + part.text
            else:
                parts.append({"type": "text", "text": part.text})
        elif part.type == "image_url":
            _refuse(role != "user", "messages", f"{field}: image_url parts are taken in user messages only, not in "
                    f"a {role} message")
            parts.append(_image(part.image_url, field + ".image_url", refs))
        elif part.type == "text":
            raise APIError(400, f"{field}: a text part needs a string 'text'", param="messages")
        else:
            raise APIError(400, f"{field}: content part type {part.type!r} is not supported (text and image_url "
                           "parts only)", param="messages")
    if all(p["type"] == "text" for p in parts):
        return "\n".join(p["text"] for p in parts)
    return parts


def _image(image_url, field: str, refs: list[vision.ImageRef]) -> dict:
    """An ``image_url`` object -> the engine's image part: a ``data:`` URI as it is (the image loader decodes it),
    an http(s) URL to fetch; anything else is a 400 naming the field."""
    _refuse(not isinstance(image_url, dict), "messages",
            f'{field} must be an object {{"url": "data:image/png;base64,..." or "https://...", "detail": "auto"}}')
    url, detail = image_url.get("url"), image_url.get("detail")
    _refuse(not isinstance(url, str) or not url.strip(), "messages",
            f"{field}.url: a string is required, a data:image/...;base64,... URI or an http(s) URL")
    _refuse(detail is not None and detail not in DETAILS, "messages",
            f"{field}.detail: {detail!r}; expected one of {', '.join(DETAILS)}")
    if url.lstrip()[:5].lower() == "data:":
        return vision.image_part(url, field + ".url", refs)
    return vision.url_part(url.strip(), field + ".url", refs, "messages")


def _messages(messages: list[Message], refs: list[vision.ImageRef] | None = None) -> list[dict]:
    """OpenAI messages -> the conversation the chat templates render; image parts become the engine's, recorded in
    ``refs`` (a list to fill) in prompt order."""
    refs = [] if refs is None else refs
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                               "content": _content(m.content, where, m.role, refs)}
        if m.role == "assistant":
            reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
            if reasoning is not None:
                msg["reasoning_content"] = reasoning
            if m.tool_calls:
                calls = []
                for j, call in enumerate(m.tool_calls):
                    args = call.function.arguments
                    if isinstance(args, str):
                        try:
                            args = json.loads(args) if args.strip() else {}
                        except ValueError as exc:
                            raise APIError(400, f"{where}.tool_calls[{j}].function.arguments is not valid "
                                           f"JSON: {exc}", param="messages") from exc
                    _refuse(not isinstance(args, dict), "messages",
                            f"{where}.tool_calls[{j}].function.arguments must be a JSON object")
                    calls.append({"id": call.id, "type": "function",
                                  "function": {"name": call.function.name, "arguments": args}})
                msg["tool_calls"] = calls
        elif m.tool_calls:
            raise APIError(400, f"{where}: only assistant messages carry tool_calls", param="messages")
        if m.role == "tool":
            _refuse(msg["content"] is None, "messages", f"{where}: a tool message needs content")
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            if m.name is not None:
                msg["name"] = m.name
        out.append(msg)
    return out


def _tools(req: ChatRequest) -> list[dict] | None:
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    choice = req.tool_choice
    if choice == "none" or not tools:
        if isinstance(choice, NamedToolChoice) or choice == "required":
            raise APIError(400, "tool_choice 'required' or a named function needs tools", param="tool_choice")
        return None
    if isinstance(choice, NamedToolChoice):
        picked = [t for t in tools if t["function"]["name"] == choice.function.name]
        _refuse(not picked, "tool_choice", f"tool_choice names {choice.function.name!r}, which is not among "
                f"the tools ({', '.join(t['function']['name'] for t in tools)})")
        return picked
    return tools


def _think(engine, req: ChatRequest, template: str) -> bool | None:
    think = None
    if req.reasoning_effort is not None:
        effort = req.reasoning_effort.lower()
        _refuse(effort not in ("none", "minimal", "low", "medium", "high"), "reasoning_effort",
                f"reasoning_effort={req.reasoning_effort!r}: expected none, minimal, low, medium or high")
        think = effort not in ("none", "minimal")
    kwargs = req.chat_template_kwargs or {}
    unknown = sorted(set(kwargs) - {"enable_thinking"})
    _refuse(bool(unknown), "chat_template_kwargs",
            f"chat_template_kwargs {unknown} not supported (only enable_thinking)")
    if "enable_thinking" in kwargs:
        value = kwargs["enable_thinking"]
        _refuse(not isinstance(value, bool), "chat_template_kwargs",
                "chat_template_kwargs.enable_thinking must be true or false")
        _refuse(think is not None and think != value, "chat_template_kwargs",
                "chat_template_kwargs.enable_thinking disagrees with reasoning_effort")
        think = value
    if think is not None and not checks.has_thinking_switch(engine, template):
        fields = [name for name, given in (("reasoning_effort", req.reasoning_effort is not None),
                                           ("chat_template_kwargs.enable_thinking", "enable_thinking" in kwargs))
                  if given]
        raise APIError(400, f"{' and '.join(fields)}: this model's chat template has no thinking switch; leave "
                       f"{'them' if len(fields) > 1 else 'it'} out", param=fields[0].split(".")[0])
    return think


def _prompt_tokens(engine, messages, tools, think, force, images=()) -> int:
    """Render and measure the prompt as Engine.chat will, each image as its tokens (``images``: preprocessed, in
    prompt order); too long is a 400 (APIError), and so is an InputError (a template refusal) at the caller."""
    prompt = engine.chat_prompt_and_parser(messages, tools, think, None, force)[0]
    if images:  # as Engine.chat: what the family's processor writes around an image (Gemma 3)
        prompt = engine.arch.image_text(prompt)
    n = len(vision.expand(engine, checks.encode(engine, prompt, chat=True), list(images)))
    checks.check_length(engine, n, "messages")
    return n


def _force(req: ChatRequest) -> bool | str:
    """tool_choice required → a tool call is forced; a named function → a call to it (the call's opener is
    written after the prompt, so the model continues inside it)."""
    if isinstance(req.tool_choice, NamedToolChoice):
        return req.tool_choice.function.name
    return req.tool_choice == "required"


MAX_TOP_LOGPROBS = 20  # OpenAI's limit (chat); completions' legacy logprobs: 5


def _chat_logprobs(req: ChatRequest) -> int | None:
    """The alternatives per token a chat request asks for (``top_logprobs``, 0 when left out), or None when it asks
    for no logprobs; ``top_logprobs`` without ``logprobs: true``, or past 20, is a 400 as OpenAI answers it."""
    if req.top_logprobs is not None:
        _refuse(req.logprobs is not True, "top_logprobs", "top_logprobs needs logprobs: true")
        _refuse(not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS, "top_logprobs",
                f"top_logprobs={req.top_logprobs} is out of range: expected 0 to {MAX_TOP_LOGPROBS}")
    return (req.top_logprobs or 0) if req.logprobs else None


def _response_format(req: ChatRequest) -> tuple[bool, dict | None]:
    """(a JSON answer?, its schema or None: any object) from ``response_format``; a 400 names a bad one."""
    rf = req.response_format
    if rf is None or rf.type == "text":
        return False, None
    if rf.type == "json_object":
        return True, None
    _refuse(rf.type != "json_schema", "response_format", f"response_format type {rf.type!r} is not supported "
            "(text, json_object or json_schema)")
    spec = rf.json_schema
    _refuse(not isinstance(spec, dict) or not isinstance(spec.get("name"), str), "response_format",
            'response_format json_schema needs {"name": ..., "schema": {...}}')
    schema = spec.get("schema")
    _refuse(schema is not None and not isinstance(schema, dict), "response_format",
            "response_format.json_schema.schema must be a JSON Schema object")
    return True, schema


def _chat_logprobs_field(engine, lps: list) -> dict:
    return {"content": chat_logprobs(engine.tokenizer, lps), "refusal": None}


async def chat_completions(req: ChatRequest, request: Request):
    app = request.app
    engine, service, model = app.state.engine, app.state.service, app.state.model_name
    check_model(app, req.model)
    _common_checks(req)
    top = _chat_logprobs(req)
    json_answer, schema = _response_format(req)
    _refuse(req.modalities is not None and req.modalities != ["text"], "modalities",
            "only the text modality is supported")
    max_tokens = req.max_completion_tokens or req.max_tokens
    _refuse(req.max_tokens is not None and req.max_completion_tokens is not None
            and req.max_tokens != req.max_completion_tokens, "max_completion_tokens",
            "max_tokens and max_completion_tokens disagree; send one")
    sampling = _sampling(engine, req)
    stop = _stops(req.stop)
    refs: list[vision.ImageRef] = []
    messages, tools, force = _messages(req.messages, refs), _tools(req), _force(req)
    template = checks.require_chat_template(engine, tools, "/v1/chat/completions")
    think = _think(engine, req, template)
    _refuse(bool(force) and not checks.can_force_tool_call(engine), "tool_choice",
            "tool_choice: this model's chat format has no tool-call syntax to start a call with, so a call cannot "
            "be required; use tool_choice 'auto'")
    images = await vision.load_images(app, refs)  # no vision tower, a bad or unreachable image: a 400 here
    try:
        n = await run_in_threadpool(_prompt_tokens, engine, messages, tools, think, force, images)
    except InputError as exc:
        raise APIError(400, str(exc)) from exc
    checks.check_max_tokens(engine, app.state.limits.max_tokens, n, max_tokens, _max_tokens_param(req), "messages")
    single_call = req.parallel_tool_calls is False
    strict = any(t["function"].get("strict") is True for t in tools or ())
    try:  # built before the queue: a schema that cannot be enforced is a 400 (the first one binds the tokenizer)
        structure = await run_in_threadpool(reply_grammar, engine, messages, tools, think, force, schema=schema,
                                            json_answer=json_answer, strict=strict, parallel=not single_call)
    except InputError as exc:
        raise APIError(400, str(exc), param="response_format" if json_answer else "tools") from exc

    def run():
        extra = {} if structure is None else {"constraint": structure.constraint()}  # one per generation
        events = engine.chat(messages, tools=tools, think=think, max_tokens=max_tokens, stop=stop, force_tool=force,
                             logprobs=top, **extra, **sampling)
        return events if top is None else with_logprobs(engine, events)

    usage = Usage()
    job = submit(request, run, usage)
    cid, created = "chatcmpl-" + secrets.token_hex(12), int(time.time())
    if not req.stream:
        events = await _consume(request, job)
        logprobs = None
        if top is not None:  # the tokens that made no event (end of turn, a stop string) are left out
            logprobs = _chat_logprobs_field(engine, [lp for s in events if s.event is not None for lp in s.logprobs])
            events = [s.event for s in events if s.event is not None]
        content, reasoning, calls = collect(events)
        calls = calls[:1 if single_call else None]
        message: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None,
                                   "reasoning_content": reasoning}
        if calls:
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments_json}} for c in calls]
        return JSONResponse({
            "id": cid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": message, "logprobs": logprobs,
                         "finish_reason": _finish(usage, bool(calls))}],
            "usage": _usage(usage), "system_fingerprint": None})

    include_usage = _include_usage(req)

    pending: list = []  # logprobs of tokens generated since the last chunk that carried some

    def chunk(delta: dict, finish: str | None = None) -> str:
        logprobs = None
        if top is not None and (pending or (finish is None and "role" not in delta)):
            logprobs = _chat_logprobs_field(engine, pending)
            pending.clear()
        return _sse({"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                     "system_fingerprint": None,
                     "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]})

    async def body():
        stream = service.events(job)
        n_calls = 0
        try:
            yield chunk({"role": "assistant", "content": ""})
            try:
                async for event in stream:
                    if isinstance(event, Scored):
                        if event.event is None:  # tokens that made no text (end of turn, a stop string): left out
                            continue
                        pending.extend(event.logprobs)
                        event = event.event
                    if isinstance(event, Content):
                        yield chunk({"content": event.text})
                    elif isinstance(event, Reasoning):
                        yield chunk({"reasoning_content": event.text})
                    elif isinstance(event, ToolCall) and not (single_call and n_calls):
                        yield chunk({"tool_calls": [{"index": n_calls, "id": event.id, "type": "function",
                                                     "function": {"name": event.name,
                                                                  "arguments": event.arguments_json}}]})
                        n_calls += 1
            except Exception as exc:  # the status line is gone: report it in the stream, as OpenAI does
                yield _sse_error(exc)
                yield "data: [DONE]\n\n"
                return
            yield chunk({}, _finish(usage, n_calls > 0))  # with the logprobs of a call left out, if any
            if include_usage:
                yield _sse({"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                            "system_fingerprint": None, "choices": [], "usage": _usage(usage)})
            yield "data: [DONE]\n\n"
        finally:
            await stream.aclose()  # a disconnected client: cancels the generation

    return JobStream(body(), job)


# --- completions ---------------------------------------------------------------------------------------


MAX_LOGPROBS = 5  # OpenAI's limit for completions' legacy logprobs


@dataclass
class _PromptScores:
    """The first event of an echoed, scored prompt: each prompt token's logprob (None for the first)."""
    logprobs: list


def _prompt(prompt) -> str | list[int]:
    """A completion's prompt: a string, or token ids (``[1, 2, 3]``: what lm-evaluation-harness sends), or a list
    of exactly one of either."""
    def ids(value) -> bool:
        return isinstance(value, list) and bool(value) and all(
            isinstance(i, int) and not isinstance(i, bool) for i in value)

    if isinstance(prompt, str):
        return prompt
    if ids(prompt):
        return list(prompt)
    if len(prompt) == 1 and (isinstance(prompt[0], str) or ids(prompt[0])):
        return prompt[0]
    raise APIError(400, "prompt must be a string or a list of token ids (or a list of exactly one of them)",
                   param="prompt")


def _check_ids(engine, ids: list[int]) -> None:
    if engine.tokenizer is None:
        raise APIError(400, checks.NO_TOKENIZER)
    vocab = engine.model.vocab_size or engine.arch.vocab_size or engine.tokenizer.vocab_size
    bad = next((i for i in ids if not 0 <= i < vocab), None)
    _refuse(bad is not None, "prompt", f"prompt: token id {bad} is not in this model's vocabulary (0 to {vocab - 1})")


async def completions(req: CompletionRequest, request: Request):
    app = request.app
    engine, service, model = app.state.engine, app.state.service, app.state.model_name
    check_model(app, req.model)
    _common_checks(req)
    for name, bad in (("suffix", req.suffix is not None), ("best_of", req.best_of not in (None, 1))):
        _refuse(bad, name, f"{name} is not supported")
    top, echo = req.logprobs, bool(req.echo)
    _refuse(top is not None and not 0 <= top <= MAX_LOGPROBS, "logprobs",
            f"logprobs={top} is out of range: expected 0 to {MAX_LOGPROBS} (the most likely tokens listed per token)")
    _refuse(req.max_tokens == 0 and not echo, "max_tokens",
            "max_tokens=0 generates nothing: it is for echo=true (the prompt scored, with logprobs)")
    prompt = _prompt(req.prompt)
    sampling = _sampling(engine, req)
    stop = _stops(req.stop)

    def measure() -> tuple[list[int], str, list[int]]:
        """(the prompt's ids, its text as echoed, where each of its tokens starts in that text)."""
        if isinstance(prompt, str):
            ids = checks.encode(engine, prompt)
        else:
            _check_ids(engine, ids := prompt)
        checks.check_length(engine, len(ids), "prompt")
        if not echo or (top is None and isinstance(prompt, str)):
            return ids, prompt if isinstance(prompt, str) else "", []
        offsets = Offsets(engine.tokenizer)
        starts = offsets.take(ids)
        text = prompt if isinstance(prompt, str) else offsets.text()
        return ids, text, [min(o, len(text)) for o in starts]

    try:
        ids, prompt_text, prompt_offsets = await run_in_threadpool(measure)
    except InputError as exc:
        raise APIError(400, str(exc)) from exc
    checks.check_max_tokens(engine, app.state.limits.max_tokens, len(ids), req.max_tokens, "max_tokens", "prompt")
    head = prompt_text if echo else ""  # what the reply's text starts with

    def run():
        if echo and top is not None:
            yield _PromptScores(prompt_logprobs(engine, ids, top))
        if req.max_tokens == 0:
            if top is None:
                engine.stats = Stats(prompt_tokens=len(ids), finish_reason="length")  # the usage
            return
        pieces = engine.generate(ids, max_tokens=req.max_tokens, stop=stop, logprobs=top, **sampling)
        yield from (pieces if top is None else with_logprobs(engine, pieces))

    usage = Usage()
    job = submit(request, run, usage)
    cid, created = "cmpl-" + secrets.token_hex(12), int(time.time())

    def finish() -> str:
        return "length" if req.max_tokens == 0 else _finish(usage, False)

    def obj(text: str, finish: str | None, logprobs: dict | None = None) -> dict:
        return {"id": cid, "object": "text_completion", "created": created, "model": model,
                "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}]}

    def legacy(lps: list, offsets: list[int]) -> dict:
        return completion_logprobs(engine.tokenizer, lps, offsets)

    if not req.stream:
        scores, generated, pieces = [], [], []
        for item in await _consume(request, job):
            if isinstance(item, _PromptScores):
                scores = item.logprobs
            elif isinstance(item, Scored):
                generated += item.logprobs
                pieces.append(item.event or "")
            else:
                pieces.append(item)
        text = "".join(pieces)
        logprobs = None
        if top is not None:
            offsets = Offsets(engine.tokenizer, len(head)).take([e.token for e in generated], len(head) + len(text))
            logprobs = legacy(scores + generated, (prompt_offsets if echo else []) + offsets)
        return JSONResponse({**obj(head + text, finish(), logprobs), "usage": _usage(usage)})

    include_usage = _include_usage(req)

    async def body():
        stream = service.events(job)
        offsets, sent = Offsets(engine.tokenizer, len(head)), len(head)
        try:
            try:
                if echo and top is None:
                    yield _sse(obj(head, None))
                tail = None  # the logprobs of the tokens that made no text: with the last chunk
                async for item in stream:
                    if isinstance(item, _PromptScores):
                        yield _sse(obj(head, None, legacy(item.logprobs, prompt_offsets)))
                    elif isinstance(item, Scored) and item.event is None:
                        tokens = [e.token for e in item.logprobs]
                        tail = legacy(item.logprobs, offsets.take(tokens, sent))
                    elif isinstance(item, Scored):
                        sent += len(item.event)
                        yield _sse(obj(item.event, None, legacy(item.logprobs,
                                                               offsets.take([e.token for e in item.logprobs]))))
                    else:
                        yield _sse(obj(item, None))
            except Exception as exc:
                yield _sse_error(exc)
                yield "data: [DONE]\n\n"
                return
            yield _sse(obj("", finish(), tail))
            if include_usage:
                yield _sse({"id": cid, "object": "text_completion", "created": created, "model": model,
                            "choices": [], "usage": _usage(usage)})
            yield "data: [DONE]\n\n"
        finally:
            await stream.aclose()

    return JobStream(body(), job)


def mount(app: FastAPI) -> None:
    app.post("/v1/chat/completions")(chat_completions)
    app.post("/v1/completions")(completions)
