"""Chat formats: reasoning and tool calls parsed back out of what the real chat templates render."""

from __future__ import annotations

import random

import pytest
import tokenizers
from chat_templates import real_template
from lumen_models_gemma.chat import GEMMA3, GEMMA4
from lumen_models_qwen.chat import QWEN3_5

from lumen_core.chat import (
    PLAIN,
    ChatFormat,
    ChatStreamParser,
    Content,
    Reasoning,
    ReasoningSyntax,
    ToolCall,
    collect,
    format_for,
    parse,
    prompt_ends_in_reasoning,
    random_call_ids,
    sequential_call_ids,
)
from lumen_core.plugins import build_registry, make_plugin_manager
from lumen_core.tokenizer import Tokenizer

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather for a city",
        "parameters": {"type": "object", "required": ["city"], "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"}, "ratio": {"type": "number"},
            "metric": {"type": "boolean"}, "opts": {"type": "object"}, "hours": {"type": "array"},
            "code": {"type": "string"}, "note": {"type": ["string", "null"]},
        }},
    }},
    {"type": "function", "function": {
        "name": "search", "description": "Search the web",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}}},
    }},
]

WEATHER_ARGS = {
    "city": "Paris, France", "days": 3, "ratio": 2.5, "metric": True, "opts": {"a": [1, 2], "b": {"c": "x"}},
    "hours": [6, 12], "code": "007", "note": "line one\nline two",
}
SEARCH_ARGS = {"query": "a < b {and} c: d", "limit": 10}


def template(name: str) -> Tokenizer:
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    return Tokenizer(backend, special_tokens={"bos_token": "<bos>", "eos_token": "<eos>"}, bos_id=None,
                     eos_ids=set(), chat_template=real_template(name))


def assistant_reply(tok: Tokenizer, messages: list[dict], ends: tuple[str, ...], **kwargs) -> tuple[str, str]:
    """(generation prompt, what the model would have written) for the last (assistant) message."""
    prompt = tok.apply_chat_template(messages[:-1], add_generation_prompt=True, tools=TOOLS, **kwargs)
    full = tok.apply_chat_template(messages, add_generation_prompt=False, tools=TOOLS, **kwargs)
    assert full.startswith(prompt), (prompt[-80:], full[len(prompt) - 80:])
    reply = full[len(prompt):]
    for end in ends:
        if reply.endswith(end):
            return prompt, reply[: -len(end)]
    raise AssertionError(f"reply does not end with a turn end: {reply[-40:]!r}")


def merged(events):
    out = []
    for e in events:
        if out and type(e) is type(out[-1]) and isinstance(e, (Content, Reasoning)):
            out[-1] = type(e)(out[-1].text + e.text)
        else:
            out.append(e)
    return out


def tags(fmt: ChatFormat) -> list[str]:
    out = []
    if fmt.reasoning:
        out += [fmt.reasoning.start, fmt.reasoning.end]
    if fmt.tool_calls:
        out += [fmt.tool_calls.start, fmt.tool_calls.end]
    return out


def stream(fmt, text, sizes, check_tags=True, **kwargs):
    """Push ``text`` in pieces of the given sizes (cycled); check no partial tag leaks out of `push`."""
    parser = ChatStreamParser(fmt, call_ids=sequential_call_ids(), **kwargs)
    events, pos, i = [], 0, 0
    while pos < len(text):
        n = sizes[i % len(sizes)]
        got = parser.push(text[pos:pos + n])
        pos, i = pos + n, i + 1
        for e in got:
            if check_tags and isinstance(e, (Content, Reasoning)):
                for tag in tags(fmt):
                    assert tag not in e.text, (tag, e)
                    assert not any(e.text.endswith(tag[:k]) for k in range(1, len(tag))), (tag, e)
        events += got
    return merged(events + parser.flush())


def check_streaming(fmt, text, check_tags=True, **kwargs):
    """Whole, one character at a time and random chunks all give the same events."""
    whole = stream(fmt, text, [len(text) or 1], check_tags=False, **kwargs)
    assert stream(fmt, text, [1], check_tags=check_tags, **kwargs) == whole
    rng = random.Random(len(text))
    for _ in range(4):
        sizes = [rng.randint(1, 9) for _ in range(50)]
        assert stream(fmt, text, sizes, check_tags=check_tags, **kwargs) == whole
    return collect(whole)


def run(fmt, text, check_tags=True, **kwargs):
    result = check_streaming(fmt, text, check_tags=check_tags, **kwargs)
    assert parse(text, fmt, call_ids=sequential_call_ids(), **kwargs) == result
    return result


def calls(tool_calls):
    return [(c.name, c.arguments) for c in tool_calls]


# --- Qwen 3.5 ------------------------------------------------------------------------------------------

QWEN_ENDS = ("<|im_end|>\n",)


def qwen_messages(**assistant):
    return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
            {"role": "assistant", **assistant}]


def test_qwen_round_trip_with_the_real_template():
    tok = template("qwen3_5.jinja")
    messages = qwen_messages(
        content="Let me check.", reasoning_content="The user wants weather.\nUse the tool.",
        tool_calls=[{"type": "function", "function": {"name": "get_weather", "arguments": WEATHER_ARGS}},
                    {"type": "function", "function": {"name": "search", "arguments": SEARCH_ARGS}}])
    prompt, reply = assistant_reply(tok, messages, QWEN_ENDS, enable_thinking=True)
    assert prompt.endswith("<think>\n") and prompt_ends_in_reasoning(prompt, QWEN3_5)
    content, reasoning, tool_calls = run(QWEN3_5, reply, tools=TOOLS, starts_in_reasoning=True)
    assert reasoning == "The user wants weather.\nUse the tool."
    assert content == "Let me check."
    assert calls(tool_calls) == [("get_weather", WEATHER_ARGS), ("search", SEARCH_ARGS)]
    assert [c.id for c in tool_calls] == ["call_0", "call_1"]


def test_qwen_thinking_disabled_prefills_an_empty_block():
    tok = template("qwen3_5.jinja")
    prompt, reply = assistant_reply(tok, qwen_messages(content="Sunny."), QWEN_ENDS, enable_thinking=False)
    assert prompt.endswith("<think>\n\n</think>\n\n") and not prompt_ends_in_reasoning(prompt, QWEN3_5)
    assert run(QWEN3_5, reply) == ("Sunny.", None, [])
    # The model writing its own (empty) think block anyway.
    assert run(QWEN3_5, "<think>\n\n</think>\n\nSunny.") == ("Sunny.", None, [])


def test_qwen_tool_call_without_schema_keeps_strings():
    tok = template("qwen3_5.jinja")
    messages = qwen_messages(content="", tool_calls=[
        {"type": "function", "function": {"name": "get_weather", "arguments": WEATHER_ARGS}}])
    _, reply = assistant_reply(tok, messages, QWEN_ENDS)
    content, reasoning, tool_calls = run(QWEN3_5, reply, starts_in_reasoning=True)
    assert content == "" and reasoning is None
    args = tool_calls[0].arguments
    assert args["days"] == "3" and args["code"] == "007" and args["note"] == "line one\nline two"
    # With the schema, numbers are numbers but a string typed "string" stays a string.
    typed = parse(reply, QWEN3_5, tools=TOOLS, starts_in_reasoning=True)[2][0].arguments
    assert typed == WEATHER_ARGS and typed["code"] == "007"


def test_qwen_starts_in_reasoning_without_closing_tag():
    assert run(QWEN3_5, "Still thinking about it", starts_in_reasoning=True) == (
        "", "Still thinking about it", [])


def test_qwen_tool_call_ends_reasoning():
    text = ("hmm, call it\n<tool_call>\n<function=search>\n<parameter=query>\ncats\n</parameter>\n"
            "</function>\n</tool_call>")
    content, reasoning, tool_calls = run(QWEN3_5, text, tools=TOOLS, starts_in_reasoning=True)
    assert (content, reasoning, calls(tool_calls)) == ("", "hmm, call it", [("search", {"query": "cats"})])


def test_qwen_text_before_and_after_tool_calls():
    text = ("<think>\nplan\n</think>\n\nBefore.\n\n<tool_call>\n<function=search>\n<parameter=limit>\n5\n"
            "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=search>\n<parameter=query>\n"
            "dogs\n</parameter>\n</function>\n</tool_call>\nAfter.")
    content, reasoning, tool_calls = run(QWEN3_5, text, tools=TOOLS)
    assert reasoning == "plan"
    assert content == "Before.\nAfter."
    assert calls(tool_calls) == [("search", {"limit": 5}), ("search", {"query": "dogs"})]


def test_qwen_classic_json_tool_call_and_malformed_json():
    good = '<tool_call>\n{"name": "search", "arguments": {"query": "x", "limit": 2}}\n</tool_call>'
    assert calls(run(QWEN3_5, good)[2]) == [("search", {"query": "x", "limit": 2})]
    as_string = '<tool_call>{"name": "search", "arguments": "{\\"query\\": \\"y\\"}"}</tool_call>'
    assert calls(run(QWEN3_5, as_string)[2]) == [("search", {"query": "y"})]
    bad = 'Sure. <tool_call>{"name": "search", "arguments": {"query": </tool_call> done'
    content, reasoning, tool_calls = run(QWEN3_5, bad, check_tags=False)
    assert tool_calls == [] and reasoning is None
    assert content == 'Sure. <tool_call>{"name": "search", "arguments": {"query": </tool_call> done'


def test_qwen_unterminated_tool_call_comes_back_as_content():
    text = "Calling.\n\n<tool_call>\n<function=search>\n<parameter=query>\ncats"
    content, reasoning, tool_calls = run(QWEN3_5, text, check_tags=False)
    assert tool_calls == [] and content == "Calling.\n\n<tool_call>\n<function=search>\n<parameter=query>\ncats"


def test_qwen_missing_parameter_close_and_held_back_partial_tag():
    text = "<tool_call><function=search><parameter=query>a\n<parameter=limit>3</function></tool_call>"
    assert calls(run(QWEN3_5, text, tools=TOOLS)[2]) == [("search", {"query": "a", "limit": 3})]
    # A partial tag at the very end is released as text by flush.
    assert run(QWEN3_5, "2 <tool_ca", check_tags=False) == ("2 <tool_ca", None, [])
    assert run(QWEN3_5, "deep <thi", starts_in_reasoning=True, check_tags=False) == ("", "deep <thi", [])


def test_qwen_angle_brackets_that_are_not_tags():
    text = "if a < b and b<c: print('<b>bold</b>') <thinking> <tool> </think"
    assert run(QWEN3_5, text, check_tags=False) == (text, None, [])
    # Split right after each '<', nothing is held back once the next character rules the tag out.
    parser = ChatStreamParser(QWEN3_5)
    assert parser.push("a <") == [Content("a")] and parser.push(" b") == [Content(" < b")]


# --- Gemma 4 -------------------------------------------------------------------------------------------

GEMMA_ENDS = ("<|tool_response>", "<turn|>\n")
GEMMA_ARGS = {
    "city": "Paris, France", "days": 3, "ratio": 2.5, "metric": True, "opts": {"a": [1, 2], "b": {"c": "x"}},
    "hours": [6, 12], "code": "007", "note": 'say "hi" {not: json}, [x] C:\\dir\\n',
}


@pytest.mark.parametrize("name", ["gemma4.jinja", "gemma4-interleaved.jinja"])
def test_gemma_round_trip_with_the_real_template(name):
    tok = template(name)
    messages = [{"role": "user", "content": "Weather?"}, {
        "role": "assistant", "content": "Checking now.", "reasoning_content": "Need the weather tool.",
        "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": GEMMA_ARGS}},
                       {"type": "function", "function": {"name": "search", "arguments": SEARCH_ARGS}}]}]
    prompt, reply = assistant_reply(tok, messages, GEMMA_ENDS, enable_thinking=True)
    assert prompt.endswith("<|turn>model\n") and not prompt_ends_in_reasoning(prompt, GEMMA4)
    assert "<|channel>thought" in reply and "<|tool_call>call:get_weather{" in reply
    content, reasoning, tool_calls = run(GEMMA4, reply, tools=TOOLS)
    assert reasoning == "Need the weather tool."
    assert content == "Checking now."
    assert calls(tool_calls) == [("get_weather", GEMMA_ARGS), ("search", SEARCH_ARGS)]


def test_gemma_thinking_disabled_and_enabled_prompts():
    tok = template("gemma4.jinja")
    messages = [{"role": "user", "content": "Hi"}]
    off = tok.apply_chat_template(messages, enable_thinking=False)
    on = tok.apply_chat_template(messages, enable_thinking=True)
    assert off.endswith("<|channel>thought\n<channel|>") and not prompt_ends_in_reasoning(off, GEMMA4)
    assert "<|think|>" in on and not prompt_ends_in_reasoning(on, GEMMA4)
    assert run(GEMMA4, "Hello there.") == ("Hello there.", None, [])
    assert run(GEMMA4, "<|channel>thought\nLet me think.\n<channel|>Answer.") == ("Answer.", "Let me think.", [])
    assert run(GEMMA4, "<|channel>thought\nforever") == ("", "forever", [])


def test_gemma_nested_values_and_escaped_looking_strings():
    text = ('<|tool_call>call:f{path:<|"|>C:\\dir\\"x"<|"|>,q:<|"|>{not: json},<|"|>,n:-1.5e3,'
            'e:[],o:{},u:null,deep:{a:[{b:<|"|>]}<|"|>},[true,false]]},s: bare words }<tool_call|>')
    content, reasoning, tool_calls = run(GEMMA4, text)
    assert content == "" and reasoning is None
    assert calls(tool_calls) == [("f", {
        "path": 'C:\\dir\\"x"', "q": "{not: json},", "n": -1500.0, "e": [], "o": {}, "u": None,
        "deep": {"a": [{"b": "]}"}, [True, False]]}, "s": "bare words"})]
    assert calls(run(GEMMA4, "<|tool_call>call:noargs{}<tool_call|>")[2]) == [("noargs", {})]


def test_gemma_malformed_and_unterminated_calls_are_content():
    bad = "x <|tool_call>call:f{a:<|\"|>oops}<tool_call|> y"
    assert run(GEMMA4, bad, check_tags=False) == (bad, None, [])
    cut = "Sure.<|tool_call>call:f{a:1"
    assert run(GEMMA4, cut, check_tags=False) == (cut, None, [])


def test_gemma_text_around_two_calls():
    text = "A.<|tool_call>call:f{x:1}<tool_call|><|tool_call>call:g{y:<|\"|>z<|\"|>}<tool_call|>B."
    content, _, tool_calls = run(GEMMA4, text)
    assert content == "A.B." and calls(tool_calls) == [("f", {"x": 1}), ("g", {"y": "z"})]


# --- generic -------------------------------------------------------------------------------------------


def test_registry_maps_model_types_to_formats():
    reg = build_registry(make_plugin_manager())
    for model_type in ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"):
        assert format_for(reg, model_type) is QWEN3_5
    assert format_for(reg, "gemma4") is GEMMA4 and format_for(reg, "gemma4_text") is GEMMA4
    assert format_for(reg, "gemma3_text") is GEMMA3 and format_for(reg, "llama") is PLAIN
    assert GEMMA3.plain and GEMMA3.template  # no reasoning or tool syntax; a template for GGUFs without one
    assert format_for(reg, None) is PLAIN
    assert QWEN3_5.thinking_kwarg == GEMMA4.thinking_kwarg == "enable_thinking"


def test_plain_format_passes_text_through():
    text = "  <think>x</think> <tool_call>{}</tool_call>\n"
    assert run(PLAIN, text, check_tags=False) == (text, None, [])
    assert not prompt_ends_in_reasoning("<think>\n", PLAIN)


def test_keyword_registration_and_ids():
    class Reg:
        chat_formats = {"toy": type("E", (), {"value": {"reasoning": ReasoningSyntax("<r>", "</r>")}})()}

    fmt = format_for(Reg(), "toy_text")
    assert fmt.name == "toy" and run(fmt, "<r>a</r>b") == ("b", "a", [])
    ids = random_call_ids()
    a, b = next(ids), next(ids)
    assert a.startswith("call_") and a != b
    parser = ChatStreamParser(QWEN3_5)
    parser.flush()
    with pytest.raises(RuntimeError):
        parser.push("x")
    assert isinstance(parse('<tool_call>{"name": "f"}</tool_call>', QWEN3_5)[2][0], ToolCall)
