"""Which chat template a model chats with, and the checks that run before any weight is read.

A checkpoint without a template (the default Gemma 3 270M GGUF has none) gets its model family's, as llama.cpp
does; a config's ``model.chat-template`` or ``--chat-template FILE`` names another. A chat the model cannot have
(no template at all, a thinking switch its template lacks) is refused before the weights load.
"""

from __future__ import annotations

import io
import json
import shutil

import pytest
import transformers
from chat_templates import real_template
from server_util import script

import lumen_core as lumen
from lumen_core.chat import PLAIN, Content, collect
from lumen_core.cli import main
from lumen_core.errors import InputError

GEMMA3_TURNS = ("<bos><start_of_turn>user\nBe brief.\n\nWhat is red?<end_of_turn>\n<start_of_turn>model\nA color."
                "<end_of_turn>\n<start_of_turn>user\nAnd blue?<end_of_turn>\n<start_of_turn>model\n")
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is red?"},
                {"role": "assistant", "content": "A color."}, {"role": "user", "content": "And blue?"}]


def load(path, **kwargs):
    return lumen.load({"model": {"path": str(path), "hidden-layers": {"kv-cache": {"context-size": 256}}}},
                      progress=False, **kwargs)


def run(capsys, monkeypatch, *argv, stdin: str = "") -> tuple[int, str, str]:
    monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    try:
        main(list(argv))
        code = 0
    except SystemExit as exc:
        code = exc.code or 0
    out, err = capsys.readouterr()
    return code, out, err


def without_template(src, dst):
    """A copy of an HF checkpoint with its chat template removed."""
    shutil.copytree(src, dst)
    (dst / "chat_template.jinja").unlink(missing_ok=True)
    cfg_path = dst / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("chat_template", None)
    cfg_path.write_text(json.dumps(cfg))
    return dst


@pytest.fixture
def no_weights(monkeypatch):
    """Fail the test if any weight is read or the tokenizer is built (the checks read the template's text only)."""

    def refuse(*args, **kwargs):
        raise AssertionError("weights or the tokenizer were loaded before the check")

    monkeypatch.setattr("lumen_core.engine.load_weights", refuse)
    monkeypatch.setattr("lumen_core.checkpoint.hf.HFCheckpoint.load_tokenizer", refuse)
    monkeypatch.setattr("lumen_core.checkpoint.gguf.GGUFCheckpoint.load_tokenizer", refuse)


# --- the family's template for a checkpoint without one ----------------------------------------------------


def test_gemma3_without_a_template_chats_in_its_turn_format(tiny_checkpoint, capsys):
    engine = load(tiny_checkpoint("gemma3"))
    assert engine.tokenizer.chat_template == real_template("gemma3.jinja")
    assert engine.chat_prompt(CONVERSATION) == GEMMA3_TURNS
    events = list(engine.chat(CONVERSATION, max_tokens=3))
    events += list(engine.chat(CONVERSATION, max_tokens=3))
    assert all(isinstance(e, Content) for e in events)
    err = capsys.readouterr().err
    assert err.count("lumen: note: chat template:") == 1  # said once, when first used
    assert "gemma3 family's template" in err


def test_gemma3_template_refuses_what_gemma_cannot_express(tiny_checkpoint):
    engine = load(tiny_checkpoint("gemma3"))
    with pytest.raises(InputError, match="alternate"):
        engine.chat_prompt([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    with pytest.raises(InputError, match="no tool role"):
        engine.chat_prompt([{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}])
    with pytest.raises(InputError, match="no tool-call syntax"):
        list(engine.chat([{"role": "user", "content": "a"}], tools=[{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "properties": {}}}}]))


def test_a_gemma3_reply_ends_at_end_of_turn(tiny_checkpoint, monkeypatch):
    engine = load(tiny_checkpoint("gemma3"))
    script(engine, monkeypatch, "Red is a color.<end_of_turn>\n<start_of_turn>user\nmore")
    content, _, _ = collect(engine.chat([{"role": "user", "content": "What is red?"}]))
    assert content == "Red is a color."


def test_qwen_without_a_template_gets_the_real_qwen_template(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("qwen3_5")
    bare = load(without_template(src, tmp_path / "bare"))
    assert bare.tokenizer.chat_template == real_template("qwen3_5.jinja")
    want = transformers.AutoTokenizer.from_pretrained(src).apply_chat_template(
        CONVERSATION, add_generation_prompt=True, tokenize=False, enable_thinking=False)
    assert bare.chat_prompt(CONVERSATION, enable_thinking=False) == want


def test_chat_prompt_ids_equal_transformers_with_one_bos(tiny_checkpoint):
    """The rendered prompt already holds the template's <bos>: it is tokenized without adding another."""
    path = tiny_checkpoint("gemma4")
    engine = load(path)
    prompts = []
    engine.generate_tokens = lambda ids, *a, **k: prompts.append(ids) or iter(())
    list(engine.chat(CONVERSATION))
    hf = transformers.AutoTokenizer.from_pretrained(path)
    want = hf.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert prompts == [list(want)]
    assert prompts[0].count(engine.tokenizer.bos_id) == 1


# --- a template named by the config or the CLI -------------------------------------------------------------


def test_config_and_cli_name_a_template_file(tiny_checkpoint, tmp_path, write_config, capsys, monkeypatch):
    template = tmp_path / "mine.jinja"
    template.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant] ")
    path = str(tiny_checkpoint("qwen3_5"))
    config = write_config({"model": {"path": path, "chat-template": str(template)}})
    engine = lumen.load(str(config), progress=False)
    assert engine.chat_prompt([{"role": "user", "content": "hi"}]) == "[user] hi\n[assistant] "
    list(engine.chat([{"role": "user", "content": "hi"}], max_tokens=1))
    assert f"from the file {template}" in capsys.readouterr().err
    code, out, err = run(capsys, monkeypatch, "generate", "-c", path, "-p", "hi", "--chat", "-n", "2", "-q",
                         "--chat-template", str(template))
    assert code == 0, err


def test_a_bad_template_file_is_a_clear_error_before_loading(tiny_checkpoint, tmp_path, capsys, monkeypatch,
                                                             no_weights):
    path = str(tiny_checkpoint("qwen3_5"))
    code, _, err = run(capsys, monkeypatch, "chat", "-c", path, "--chat-template", str(tmp_path / "missing.jinja"))
    assert code == 2 and "cannot read the chat template file" in err and "missing.jinja" in err
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}")
    code, _, err = run(capsys, monkeypatch, "chat", "-c", path, "--chat-template", str(broken))
    assert code == 2 and "not a valid Jinja template" in err
    assert "Traceback" not in err


# --- checks before the weights ----------------------------------------------------------------------------


def test_think_on_a_template_without_a_switch_fails_before_loading(tiny_checkpoint, capsys, monkeypatch,
                                                                   no_weights):
    path = str(tiny_checkpoint("gemma3"))
    code, _, err = run(capsys, monkeypatch, "generate", "-c", path, "-p", "hi", "--chat", "--think")
    assert code == 2 and "has no thinking switch" in err and "no chat template" not in err
    code, _, err = run(capsys, monkeypatch, "chat", "-c", path, "--no-think")
    assert code == 2 and "has no thinking switch" in err


def test_a_model_that_cannot_chat_is_refused_before_loading(tiny_checkpoint, tmp_path, capsys, monkeypatch,
                                                            no_weights):
    monkeypatch.setattr("lumen_core.engine.format_for", lambda *a: PLAIN)  # a family that ships no template
    path = str(without_template(tiny_checkpoint("qwen3_5"), tmp_path / "bare"))
    for argv in (["chat", "-c", path], ["generate", "-c", path, "-p", "hi", "--chat"],
                 ["generate", "-c", path, "-p", "hi", "--chat", "--think"]):
        code, _, err = run(capsys, monkeypatch, *argv, stdin="hi\n")
        assert code == 2 and "has no chat template" in err and "model.chat-template" in err, argv
        assert "thinking switch" not in err  # no template at all is what is wrong


def test_chat_options_without_chat_are_refused(tiny_checkpoint, capsys, monkeypatch, no_weights):
    path = str(tiny_checkpoint("qwen3_5"))
    for flag in (["--system", "Be brief."], ["--think"], ["--no-think"]):
        code, _, err = run(capsys, monkeypatch, "generate", "-c", path, "-p", "hi", *flag)
        assert code == 2 and "needs --chat" in err, flag


def test_the_apis_count_the_chat_prompt_as_it_is_tokenized(tiny_checkpoint):
    """usage.prompt_tokens (OpenAI) and count_tokens (Anthropic) count the one-BOS ids transformers gives."""
    import anthropic
    import openai
    from server_util import Server

    path = tiny_checkpoint("gemma4")
    messages = [{"role": "user", "content": "What is red?"}]
    hf = transformers.AutoTokenizer.from_pretrained(path)
    want = len(hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
    server = Server(load(path))
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=1)
        assert out.usage.prompt_tokens == want
        claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
        assert claude.messages.count_tokens(model="tiny", messages=messages).input_tokens == want
    finally:
        server.stop()


def test_a_bad_template_file_named_by_the_config_names_the_json_path(tiny_checkpoint, tmp_path, write_config,
                                                                      capsys, monkeypatch, no_weights):
    config = write_config({"model": {"path": str(tiny_checkpoint("qwen3_5")), "chat-template": "missing.jinja"}})
    for argv in (["validate", "-c", str(config)], ["chat", "-c", str(config)]):
        code, _, err = run(capsys, monkeypatch, *argv)
        assert code == 2 and "config model.chat-template: cannot read the chat template file" in err, err
        assert "fix: name a UTF-8 Jinja file" in err
