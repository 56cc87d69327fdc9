"""Qwen 3.5 chat format: ``<think>`` reasoning and ``<tool_call>`` blocks.

The chat template opens ``<think>\\n`` in the generation prompt (or pre-fills an empty block when
``enable_thinking=False``); the model closes it with ``</think>``, and a ``<tool_call>`` also ends it.
A tool call is written in the Qwen3-Coder XML form::

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call>

where VALUE is raw text (typed here by the tool's JSON schema), or in the classic Qwen 3 JSON form
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.
"""

from __future__ import annotations

import json
import re

from lumen_core.chat import ChatFormat, ReasoningSyntax, convert_value, package_template, tool_schema

_FUNCTION = re.compile(r"<function=([^>\n]*)>(.*?)(?:</function>|\Z)", re.S)
# A parameter ends at its closing tag, or (when the model forgot it) at the next parameter / function end.
_PARAMETER = re.compile(r"<parameter=([^>\n]*)>(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>)|\Z)", re.S)


class QwenToolCalls:
    """``<tool_call>`` … ``</tool_call>``, XML (Qwen3-Coder) or JSON (classic) inside."""

    start = "<tool_call>"
    end = "</tool_call>"

    def opener(self, name: str | None) -> str:
        return self.start + "\n" + (f"<function={name}>\n" if name else "")

    def parse(self, body: str, tools: list[dict] | None) -> list[tuple[str, dict]]:
        text = body.strip()
        if text.startswith("{"):
            return [_parse_json(text)]
        calls = []
        for m in _FUNCTION.finditer(text):
            name = m.group(1).strip()
            if not name:
                raise ValueError("tool call without a function name")
            props = tool_schema(tools, name).get("properties") or {}
            args = {}
            for p in _PARAMETER.finditer(m.group(2)):
                key = p.group(1).strip()
                args[key] = convert_value(_strip_one_newline(p.group(2)), props.get(key))
            calls.append((name, args))
        if not calls:
            raise ValueError("no <function=...> in the tool call")
        return calls


def _parse_json(text: str) -> tuple[str, dict]:
    obj = json.loads(text)
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError("a JSON tool call needs a string 'name'")
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        args = json.loads(args) if args.strip() else {}
    if not isinstance(args, dict):
        raise ValueError("tool call arguments are not an object")
    return obj["name"], args


def _strip_one_newline(value: str) -> str:
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


QWEN3_5 = ChatFormat(
    "qwen3_5",
    reasoning=ReasoningSyntax("<think>", "</think>"),
    tool_calls=QwenToolCalls(),
    thinking_kwarg="enable_thinking",
    thinking_default=True,
    template=package_template("lumen_models_qwen", "qwen3_5.jinja"),  # for checkpoints that carry none
)
