"""Chat formats: split a model's reply into reasoning, content and tool calls, whole or streamed.

A `ChatFormat` names the tags a model family writes (a reasoning block, tool-call blocks) and how the
body of a tool call is read. `ChatStreamParser` takes the decoded text in pieces of any size (one
character at a time is fine) and turns it into events:

    Content(text)     answer text, to show the user
    Reasoning(text)   thinking text
    ToolCall(id, name, arguments)   one whole call, emitted when its closing tag arrives

It never emits part of a tag: a suffix of the text that could be the start of a tag is held back until
the next piece decides it. Whitespace next to a tag (and at the start and end of the reply) is dropped,
as the chat templates put newlines around their tags. At `flush()` an unterminated tool call comes back
as content text, and a held-back partial tag is released as text. `parse()` does the whole reply at once
with the same machine, so streaming and non-streaming results always agree.

Model plugins register formats with the `register_chat_formats` hook::

    register("qwen3_5", format=ChatFormat(...))

and `format_for(registry, model_type)` finds them (a plain format when nothing is registered).
"""

from __future__ import annotations

import itertools
import json
import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

# --- events --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class Reasoning:
    text: str


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: dict = field(default_factory=dict)

    @property
    def arguments_json(self) -> str:
        """The arguments as the JSON string OpenAI's `function.arguments` carries."""
        return json.dumps(self.arguments, ensure_ascii=False)


Event = Content | Reasoning | ToolCall


# --- format description --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReasoningSyntax:
    """A reasoning block: ``start`` … ``end``. A tool call's start tag also ends it."""

    start: str
    end: str


class ToolCallSyntax(Protocol):
    """A tool-call block ``start`` BODY ``end``; ``parse`` reads BODY.

    ``parse(body, tools)`` returns ``[(name, arguments), ...]`` (usually one call) and raises
    `ValueError` when the body is malformed; the block is then returned as content text.
    ``tools`` is the request's OpenAI-style tool list (or None), for typing arguments by schema.
    """

    start: str
    end: str

    def parse(self, body: str, tools: list[dict] | None) -> list[tuple[str, dict]]: ...

    def opener(self, name: str | None) -> str:
        """The text that starts a call (to function ``name``, or to one the model picks): written after the prompt
        to make the model call a tool (``tool_choice`` required / named)."""
        ...


@dataclass(frozen=True)
class ChatFormat:
    """How one model family writes reasoning and tool calls.

    ``thinking_kwarg`` is the chat-template variable that switches thinking (``enable_thinking``), and
    ``thinking_default`` what the template does when it is not given. ``stop``: text that ends a reply besides
    the end-of-turn token (Gemma 4 hands the turn to the tool with ``<|tool_response>``). ``template``: the
    family's Jinja chat template, used for a checkpoint that carries none (`package_template` reads one).
    """

    name: str
    reasoning: ReasoningSyntax | None = None
    tool_calls: ToolCallSyntax | None = None
    thinking_kwarg: str | None = None
    thinking_default: bool = False
    stop: tuple[str, ...] = ()
    template: str | None = field(default=None, repr=False)

    @property
    def plain(self) -> bool:
        return self.reasoning is None and self.tool_calls is None


PLAIN = ChatFormat("plain")


def package_template(package: str, name: str) -> str:
    """The chat template file ``templates/<name>`` shipped inside the Python package ``package``."""
    from importlib.resources import files

    return files(package).joinpath("templates", name).read_text(encoding="utf-8")


def format_for(registry, model_type: str | None) -> ChatFormat:
    """The chat format registered for ``model_type`` (``qwen3_5_text`` falls back to ``qwen3_5``).

    ``registry`` is a `lumen_core.plugins.Registry`, or None for the loaded plugins' registry.
    Unknown model types get `PLAIN` (no reasoning, no tool calls).
    """
    if registry is None:
        from lumen_core.plugins import get_registry

        registry = get_registry()
    if not model_type:
        return PLAIN
    candidates = [model_type]
    if model_type.endswith("_text"):
        candidates.append(model_type[: -len("_text")])
    for name in candidates:
        entry = registry.chat_formats.get(name)
        if entry is None:
            continue
        parsers = entry.value
        if isinstance(parsers.get("format"), ChatFormat):
            return parsers["format"]
        return ChatFormat(name, **parsers)  # register(model_type, reasoning=..., tool_calls=..., ...)
    return PLAIN


def prompt_ends_in_reasoning(prompt: str, fmt: ChatFormat) -> bool:
    """Whether the rendered prompt leaves a reasoning block open (Qwen's ``<think>\\n`` prompt)."""
    if fmt.reasoning is None:
        return False
    start, end = fmt.reasoning.start, fmt.reasoning.end
    return prompt.rfind(start) > prompt.rfind(end)


def random_call_ids() -> Iterator[str]:
    """``call_`` + 24 random hex digits, as OpenAI-compatible servers hand out."""
    while True:
        yield "call_" + secrets.token_hex(12)


def sequential_call_ids(prefix: str = "call_") -> Iterator[str]:
    """``call_0``, ``call_1``, …: deterministic ids for tests."""
    return (f"{prefix}{i}" for i in itertools.count())


# --- the streaming parser ------------------------------------------------------------------------------

_CONTENT, _REASONING, _TOOL = "content", "reasoning", "tool"


class ChatStreamParser:
    """Incremental parser: `push(text)` and `flush()` return lists of events."""

    def __init__(self, fmt: ChatFormat, tools: list[dict] | None = None, starts_in_reasoning: bool = False,
                 call_ids: Iterator[str] | None = None):
        self.fmt = fmt
        self.tools = tools
        self._ids = call_ids if call_ids is not None else random_call_ids()
        self._state = _REASONING if starts_in_reasoning and fmt.reasoning is not None else _CONTENT
        self._buf = ""
        self._out: list[Event] = []
        # Whitespace handling of the current section (the text between two tags).
        self._at_section_start = True
        self._pending_ws = ""
        self._content_seen = False
        self._done = False

    # -- public -------------------------------------------------------------------------------------------
    def push(self, text: str) -> list[Event]:
        if self._done:
            raise RuntimeError("ChatStreamParser.push after flush")
        if self.fmt.plain:
            return [Content(text)] if text else []
        self._buf += text
        self._scan()
        return self._take()

    def flush(self) -> list[Event]:
        if self._done:
            return []
        self._done = True
        if self.fmt.plain:
            return []
        self._scan()
        if self._state == _TOOL:  # unterminated tool call: give the text back, it is not lost
            self._state = _CONTENT
            self._emit(self.fmt.tool_calls.start + self._buf)
        else:
            self._emit(self._buf)  # a held-back partial tag is just text after all
        self._buf = ""
        self._end_section()
        return self._take()

    # -- machinery ----------------------------------------------------------------------------------------
    def _tags(self) -> list[tuple[str, str]]:
        """(tag, next state) pairs to look for in the current state."""
        r, t = self.fmt.reasoning, self.fmt.tool_calls
        tags = []
        if self._state == _CONTENT and r is not None:
            tags.append((r.start, _REASONING))
        if self._state == _REASONING:
            tags.append((r.end, _CONTENT))
        if t is not None:
            tags.append((t.start, _TOOL))
        return tags

    def _scan(self) -> None:
        while True:
            if self._state == _TOOL:
                end = self.fmt.tool_calls.end
                i = self._buf.find(end)
                if i < 0:
                    return
                body, self._buf = self._buf[:i], self._buf[i + len(end):]
                self._state = _CONTENT
                self._tool_block(body)
                continue
            tags = self._tags()
            hits = [(self._buf.find(tag), tag, state) for tag, state in tags]
            hits = [h for h in hits if h[0] >= 0]
            if hits:
                i, tag, state = min(hits, key=lambda h: (h[0], -len(h[1])))
                self._emit(self._buf[:i])
                if state != _TOOL or self._state == _REASONING:
                    # Content before a tool call keeps its trailing whitespace pending: should the call
                    # turn out malformed, its text continues that content.
                    self._end_section()
                self._buf = self._buf[i + len(tag):]
                self._state = state
                continue
            keep = _partial_tag_len(self._buf, [tag for tag, _ in tags])
            self._emit(self._buf[: len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep:]
            return

    def _tool_block(self, body: str) -> None:
        syntax = self.fmt.tool_calls
        try:
            calls = syntax.parse(body, self.tools)
        except (ValueError, TypeError, KeyError):
            calls = None
        if not calls:  # malformed: hand the text back as content rather than lose it or raise
            self._emit(syntax.start + body + syntax.end)
            return
        self._end_section()
        for name, arguments in calls:
            self._out.append(ToolCall(next(self._ids), name, arguments))

    def _emit(self, text: str) -> None:
        """Text of the current section; whitespace at its edges is dropped."""
        if not text:
            return
        kind = Reasoning if self._state == _REASONING else Content
        if self._at_section_start:
            stripped = text.lstrip()
            if kind is Content and self._content_seen:
                # Content resuming after a tool call: the whitespace after the tag separates the pieces.
                self._pending_ws += text[: len(text) - len(stripped)]
            text = stripped
            if not text:
                return
            self._at_section_start = False
        body = text.rstrip()
        if not body:
            self._pending_ws += text
            return
        text, self._pending_ws = self._pending_ws + body, text[len(body):]
        self._content_seen |= kind is Content
        if self._out and type(self._out[-1]) is kind:
            self._out[-1] = kind(self._out[-1].text + text)
        else:
            self._out.append(kind(text))

    def _end_section(self) -> None:
        self._at_section_start = True
        self._pending_ws = ""

    def _take(self) -> list[Event]:
        out, self._out = self._out, []
        return out


def _partial_tag_len(buf: str, tags: list[str]) -> int:
    """Length of the longest suffix of ``buf`` that is a proper prefix of one of ``tags``."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(buf)), best, -1):
            if buf.endswith(tag[:n]):
                best = n
                break
    return best


def parse(text: str, fmt: ChatFormat, tools: list[dict] | None = None, starts_in_reasoning: bool = False,
          call_ids: Iterator[str] | None = None) -> tuple[str, str | None, list[ToolCall]]:
    """A whole reply -> ``(content, reasoning or None, tool_calls)``."""
    parser = ChatStreamParser(fmt, tools=tools, starts_in_reasoning=starts_in_reasoning, call_ids=call_ids)
    events = parser.push(text) + parser.flush()
    return collect(events)


def collect(events: list[Event]) -> tuple[str, str | None, list[ToolCall]]:
    """Join a list of events into ``(content, reasoning or None, tool_calls)``."""
    content = "".join(e.text for e in events if isinstance(e, Content))
    reasoning = "".join(e.text for e in events if isinstance(e, Reasoning))
    calls = [e for e in events if isinstance(e, ToolCall)]
    return content, reasoning or None, calls


# --- helpers for tool-call syntaxes --------------------------------------------------------------------


def tool_schema(tools: list[dict] | None, name: str) -> dict:
    """The JSON schema of tool ``name``'s parameters (``{}`` when unknown), each property given as a local ``$ref``
    (``#/$defs/...``, as pydantic writes nested models and enums) replaced by what it points to, so that a value is
    typed by its real schema."""
    for tool in tools or ():
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if isinstance(fn, dict) and fn.get("name") == name:
            params = fn.get("parameters")
            return _properties_resolved(params) if isinstance(params, dict) else {}
    return {}


def _properties_resolved(params: dict) -> dict:
    props = params.get("properties")
    if not isinstance(props, dict) or not any(isinstance(p, dict) and "$ref" in p for p in props.values()):
        return params
    resolved = {}
    for key, prop in props.items():
        seen = set()
        while isinstance(prop, dict) and isinstance(prop.get("$ref"), str) and prop["$ref"] not in seen:
            seen.add(prop["$ref"])
            target: Any = params
            for part in prop["$ref"].removeprefix("#/").split("/") if prop["$ref"].startswith("#/") else [None]:
                target = target.get(part.replace("~1", "/").replace("~0", "~")) \
                    if isinstance(target, dict) and part is not None else None
            if not isinstance(target, dict):
                break
            prop = {**target, **{k: v for k, v in prop.items() if k != "$ref"}}
        resolved[key] = prop
    return {**params, "properties": resolved}


def schema_type(schema: Any) -> str | None:
    """The main JSON type of a property schema (``["integer", "null"]`` -> ``integer``)."""
    if not isinstance(schema, dict):
        return None
    t = schema.get("type")
    if isinstance(t, list):
        t = next((x for x in t if x != "null"), None)
    if t is None:
        for key in ("anyOf", "oneOf"):
            for option in schema.get(key) or ():
                t = schema_type(option)
                if t is not None:
                    return t
    return t.lower() if isinstance(t, str) else None


def convert_value(value: str, schema: Any) -> Any:
    """A parameter written as text, typed by its JSON schema (the text itself when it does not fit)."""
    t = schema_type(schema)
    if t is None or t == "string":
        return value
    if value.strip().lower() in ("null", "none"):
        return None
    if t in ("integer", "int", "number", "float"):
        for kind in (int, float):
            try:
                return kind(value.strip())
            except ValueError:
                pass
    if t in ("boolean", "bool"):
        low = value.strip().lower()
        if low in ("true", "false"):
            return low == "true"
    try:
        return json.loads(value)
    except ValueError:
        return value


__all__ = [
    "Content", "Reasoning", "ToolCall", "Event", "ReasoningSyntax", "ToolCallSyntax", "ChatFormat", "PLAIN",
    "ChatStreamParser", "parse", "collect", "format_for", "prompt_ends_in_reasoning", "random_call_ids",
    "sequential_call_ids", "tool_schema", "schema_type", "convert_value",
]
