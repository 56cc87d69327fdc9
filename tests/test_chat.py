"""Engine.chat (the chat template + the model family's chat format over generated tokens) and `lumen chat`.

The tiny checkpoints carry the real Qwen 3.5 / Gemma 4 templates. Their random weights write random text, so
two kinds of checks: wiring (a scripted reply, tokenized, run through Engine.chat's decoder and parser) and
consistency (the events of a real generation equal `chat.parse` of the same tokens decoded whole).
"""

from __future__ import annotations

import io

import pytest
from server_util import script

import lumen_core as lumen
from lumen_core.chat import Content, Reasoning, ToolCall, collect, parse, prompt_ends_in_reasoning, sequential_call_ids
from lumen_core.cli import main
from lumen_core.errors import InputError

WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]


def load(path):
    return lumen.load({"model": {"path": str(path), "hidden-layers": {"kv-cache": {"context-size": 512}}}},
                      progress=False)


@pytest.fixture(scope="module")
def qwen(tiny_checkpoint):
    return load(tiny_checkpoint("qwen3_5"))


@pytest.fixture(scope="module")
def gemma4(tiny_checkpoint):
    return load(tiny_checkpoint("gemma4"))




def test_a_scripted_qwen_reply_becomes_reasoning_content_and_a_typed_tool_call(qwen, monkeypatch):
    reply = ("Paris is in France.\n</think>\n\nLet me check.\n<tool_call>\n<function=get_weather>\n"
             "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
    script(qwen, monkeypatch, reply)
    events = list(qwen.chat([{"role": "user", "content": "Weather in Paris?"}], tools=WEATHER, think=True,
                            call_ids=sequential_call_ids()))
    content, reasoning, calls = collect(events)
    assert reasoning == "Paris is in France."
    assert content == "Let me check."
    assert calls == [ToolCall("call_0", "get_weather", {"city": "Paris", "days": 3})]


def test_a_scripted_gemma4_reply_with_specials_kept_and_its_stop_text(gemma4, monkeypatch):
    reply = ('<|channel>thought\nThe user wants weather.<channel|>Checking.<|tool_call>call:get_weather'
             '{city:<|"|>Paris<|"|>,days:2}<tool_call|><|tool_response>ignored after the stop')
    script(gemma4, monkeypatch, reply)
    events = list(gemma4.chat([{"role": "user", "content": "Weather?"}], tools=WEATHER, think=True,
                              call_ids=sequential_call_ids()))
    content, reasoning, calls = collect(events)
    assert reasoning == "The user wants weather."
    assert content == "Checking."
    assert calls == [ToolCall("call_0", "get_weather", {"city": "Paris", "days": 2})]
    assert "ignored" not in content


@pytest.mark.parametrize("think", [True, False])
def test_events_of_a_real_generation_equal_parsing_the_whole_reply(qwen, think):
    messages = [{"role": "user", "content": "Hello there"}]
    events = list(qwen.chat(messages, think=think, max_tokens=24, temperature=0.0))
    assert all(isinstance(e, Content | Reasoning | ToolCall) for e in events)
    prompt = qwen.tokenizer.apply_chat_template(messages, enable_thinking=think)
    ids = list(qwen.generate_tokens(qwen.encode(prompt), 24))  # greedy
    text = qwen.tokenizer.decode(ids, skip_special_tokens=False)
    fmt = qwen.chat_format()
    want = parse(text, fmt, starts_in_reasoning=prompt_ends_in_reasoning(prompt, fmt),
                 call_ids=sequential_call_ids())
    got = collect(events)
    assert (got[0], got[1]) == (want[0], want[1])
    assert [c.name for c in got[2]] == [c.name for c in want[2]]


def test_thinking_switch_is_refused_where_the_template_has_none(tiny_checkpoint):
    engine = load(tiny_checkpoint("gemma3"))
    with pytest.raises(InputError, match="no thinking switch"):
        list(engine.chat([{"role": "user", "content": "hi"}], think=True, max_tokens=2))


def run(capsys, monkeypatch, stdin: str, *argv):
    monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    try:
        main(list(argv))
        code = 0
    except SystemExit as exc:
        code = exc.code or 0
    out, err = capsys.readouterr()
    return code, out, err


def test_lumen_chat_keeps_a_conversation_and_runs_its_commands(capsys, monkeypatch, tiny_checkpoint):
    path = str(tiny_checkpoint("qwen3_5"))
    code, out, err = run(capsys, monkeypatch, "hello\n/think off\nagain\n/think\n/reset\n/bogus\n\n/exit\nnot read\n",
                         "chat", "-c", path, "-n", "6", "--system", "Be brief.")
    assert code == 0, err
    assert "[thinking off]" in err and "[thinking on]" in err
    assert "[conversation reset]" in err and "[unknown command /bogus" in err
    assert err.count("finish:") == 2  # two replies, each with its timing line
    assert "Traceback" not in err


def test_lumen_chat_with_a_checkpoint_without_a_template_uses_its_family_template(capsys, monkeypatch,
                                                                                  tiny_checkpoint):
    """The tiny Gemma 3 carries no template, as the default Gemma 3 270M GGUF: it chats in Gemma's turn format."""
    code, out, err = run(capsys, monkeypatch, "hi\n", "chat", "-c", str(tiny_checkpoint("gemma3")), "-n", "4")
    assert code == 0, err
    assert "gemma3 family's template" in err and err.count("finish:") == 1
