"""Gemma 4 chat format: the thought channel and ``<|tool_call>`` blocks.

Reasoning is written in the thought channel, ``<|channel>thought\\n…<channel|>``; the chat template
pre-fills an empty one (``<|channel>thought\\n<channel|>``) when thinking is off, so the reply never
starts inside it. A tool call is::

    <|tool_call>call:NAME{key:<|"|>text<|"|>,num:42,flag:true,nested:{a:<|"|>x<|"|>},list:[1,2]}<tool_call|>

bare keys, ``<|"|>`` around strings (nothing is escaped between them), values nest. Gemma 3 writes
neither: its format is plain, with the family's turn-format template (`GEMMA3`).
"""

from __future__ import annotations

import json

from lumen_core.chat import ChatFormat, ReasoningSyntax, package_template

QUOTE = '<|"|>'


class GemmaToolCalls:
    """``<|tool_call>call:NAME{...}<tool_call|>``."""

    start = "<|tool_call>"
    end = "<tool_call|>"

    def opener(self, name: str | None) -> str:
        return self.start + "call:" + (name or "")

    def parse(self, body: str, tools: list[dict] | None) -> list[tuple[str, dict]]:
        text = body.strip()
        if not text.startswith("call:"):
            raise ValueError("a Gemma tool call starts with 'call:'")
        brace = text.find("{")
        name = (text[5:] if brace < 0 else text[5:brace]).strip()
        if not name:
            raise ValueError("tool call without a function name")
        if brace < 0:
            return [(name, {})]
        reader = _Reader(text, brace)
        args = reader.value()
        if text[reader.pos:].strip():
            raise ValueError(f"unexpected text after the arguments: {text[reader.pos:]!r}")
        return [(name, args)]


class _Reader:
    """A recursive-descent reader of Gemma's argument syntax."""

    def __init__(self, text: str, pos: int):
        self.text, self.pos = text, pos

    def _skip(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos].isspace():
            self.pos += 1

    def _peek(self) -> str:
        self._skip()
        if self.pos >= len(self.text):
            raise ValueError("unexpected end of the tool call")
        return self.text[self.pos]

    def value(self):
        c = self._peek()
        if self.text.startswith(QUOTE, self.pos):
            end = self.text.find(QUOTE, self.pos + len(QUOTE))
            if end < 0:
                raise ValueError("unterminated string")
            s = self.text[self.pos + len(QUOTE):end]
            self.pos = end + len(QUOTE)
            return s
        if c == '"':  # a JSON string, should the model fall back to JSON quoting
            s, self.pos = json.JSONDecoder().raw_decode(self.text, self.pos)
            return s
        if c == "{":
            return self._object()
        if c == "[":
            return self._list()
        return self._scalar()

    def _object(self) -> dict:
        self.pos += 1
        out = {}
        if self._peek() == "}":
            self.pos += 1
            return out
        while True:
            key = self._key()
            if self._peek() != ":":
                raise ValueError(f"expected ':' after key {key!r}")
            self.pos += 1
            out[key] = self.value()
            c = self._peek()
            self.pos += 1
            if c == "}":
                return out
            if c != ",":
                raise ValueError(f"expected ',' or '}}', found {c!r}")

    def _key(self) -> str:
        c = self._peek()
        if self.text.startswith(QUOTE, self.pos) or c == '"':
            key = self.value()
            if not isinstance(key, str):
                raise ValueError("bad key")
            return key
        start = self.pos
        while self.pos < len(self.text) and self.text[self.pos] not in ":,{}[]":
            self.pos += 1
        key = self.text[start:self.pos].strip()
        if not key:
            raise ValueError("empty key")
        return key

    def _list(self) -> list:
        self.pos += 1
        out = []
        if self._peek() == "]":
            self.pos += 1
            return out
        while True:
            out.append(self.value())
            c = self._peek()
            self.pos += 1
            if c == "]":
                return out
            if c != ",":
                raise ValueError(f"expected ',' or ']', found {c!r}")

    def _scalar(self):
        start = self.pos
        while self.pos < len(self.text) and self.text[self.pos] not in ",}]":
            self.pos += 1
        raw = self.text[start:self.pos].strip()
        if not raw:
            raise ValueError("empty value")
        low = raw.lower()
        if low in ("true", "false"):
            return low == "true"
        if low in ("null", "none"):
            return None
        for kind in (int, float):
            try:
                return kind(raw)
            except ValueError:
                pass
        return raw


GEMMA4 = ChatFormat(
    "gemma4",
    reasoning=ReasoningSyntax("<|channel>thought", "<channel|>"),
    tool_calls=GemmaToolCalls(),
    thinking_kwarg="enable_thinking",
    thinking_default=False,
    # <turn|> too: a GGUF's EOS is <eos> alone (HF lists <turn|> in generation_config; llama.cpp stops on it by name)
    stop=("<|tool_response>", "<turn|>"),
    template=package_template("lumen_models_gemma", "gemma4.jinja"),  # for checkpoints that carry none
)

# Gemma 3 writes no reasoning and no tool calls: a plain format, with the turn format for checkpoints that carry
# no template (the GGUF of Gemma 3 270M).
# A base checkpoint's EOS is <eos>, not the turn's end: the reply stops at <end_of_turn> too.
GEMMA3 = ChatFormat("gemma3", stop=("<end_of_turn>",), template=package_template("lumen_models_gemma", "gemma3.jinja"))
