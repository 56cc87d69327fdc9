"""Tokenizer, chat template, streaming detokenizer and stop strings, against transformers."""

from __future__ import annotations

import importlib.util
import json
import shutil
import unicodedata
from pathlib import Path

import pytest
import transformers
from chat_templates import real_template
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, normalizers, processors, trainers

from lumen_core.errors import CheckpointError, InputError
from lumen_core.tokenizer import StopMatcher, StreamDecoder, Tokenizer

REPO = Path(__file__).resolve().parents[1]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")

TEXTS = [
    "Hello, world!",
    " leading space and  double  spaces\n\n\ttabs\r\n",
    "The quick brown fox jumps over the lazy dog. 3.14159 and 2024",
    "Café naïve résumé Straße crème brûlée",
    "e\u0301 a\u0308 n\u0303: combining marks",
    "日本語のテキスト、東京。你好，世界！한국어 텍스트",
    "emoji 🦀🙂👍 👩‍💻 🇯🇵 ❤️ 🫠",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n<think>\nok\n</think>\n",
    "",
    "Ω≈ç√∫˜µ≤≥÷ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
]


def _load_script():
    path = REPO / "scripts" / "make_tiny_checkpoint.py"
    spec = importlib.util.spec_from_file_location("make_tiny_checkpoint", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return _load_script().make("qwen3_5", tmp_path_factory.mktemp("tiny-qwen3_5"))


@pytest.fixture(scope="session")
def tok(tiny_dir) -> Tokenizer:
    return Tokenizer.from_dir(tiny_dir)


@pytest.fixture(scope="session")
def hf_tok(tiny_dir):
    return transformers.AutoTokenizer.from_pretrained(tiny_dir)


def _copy_tokenizer(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copy(src / name, dst / name)
    return dst


def _edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text()) if path.exists() else {}
    data.update(changes)
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False))


# --- loading and special tokens ------------------------------------------------------------------------


def test_tiny_checkpoint_special_tokens(tok, hf_tok):
    assert tok.eos_ids == {hf_tok.convert_tokens_to_ids("<|im_end|>")}
    assert tok.bos_id is None and not tok.add_bos
    assert tok.vocab_size == len(hf_tok) <= 1000
    assert tok.special_tokens["pad_token"] == "<|endoftext|>"


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(tok, hf_tok, text):
    assert tok.encode(text) == hf_tok(text)["input_ids"]
    assert tok.encode(text, add_special_tokens=False) == hf_tok(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("skip", [False, True])
def test_decode_matches_transformers(tok, hf_tok, text, skip):
    ids = hf_tok(text)["input_ids"]
    assert tok.decode(ids, skip_special_tokens=skip) == hf_tok.decode(ids, skip_special_tokens=skip)


def test_bos_from_post_processor_is_added_once(tiny_dir, tmp_path):
    d = _copy_tokenizer(tiny_dir, tmp_path / "bos")
    raw = RawTokenizer.from_file(str(d / "tokenizer.json"))
    bos = raw.token_to_id("<|endoftext|>")
    raw.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", pair="<|endoftext|> $A $B", special_tokens=[("<|endoftext|>", bos)],
    )
    raw.save(str(d / "tokenizer.json"))
    _edit_json(d / "tokenizer_config.json", bos_token="<|endoftext|>", add_bos_token=True)
    tok, hf = Tokenizer.from_dir(d), transformers.AutoTokenizer.from_pretrained(d)
    assert tok.bos_id == bos and tok.add_bos
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == hf(text)["input_ids"]
        assert ids[0] == bos and ids[1:2] != [bos]


def test_add_bos_token_without_post_processor_prepends_once(tiny_dir, tmp_path):
    # transformers 5 ignores add_bos_token when tokenizer.json exists; we honour it when the
    # post-processor does not already add BOS, because the checkpoint's author asked for it.
    d = _copy_tokenizer(tiny_dir, tmp_path / "bos2")
    _edit_json(d / "tokenizer_config.json", bos_token={"content": "<|endoftext|>"}, add_bos_token=True)
    tok = Tokenizer.from_dir(d)
    bos = tok.token_to_id("<|endoftext|>")
    assert tok.bos_id == bos and tok.add_bos
    assert tok.encode("hi") == [bos, *tok.encode("hi", add_special_tokens=False)]


def test_eos_ids_union_of_sources(tiny_dir, tmp_path):
    d = _copy_tokenizer(tiny_dir, tmp_path / "eos")
    tok0 = Tokenizer.from_dir(d)
    ids = {t: tok0.token_to_id(t) for t in ("<|endoftext|>", "<|im_end|>", "</think>")}
    _edit_json(d / "tokenizer_config.json", eos_token={"content": "</think>", "special": True})
    _edit_json(d / "generation_config.json", eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]])
    _edit_json(d / "config.json", eos_token_id=7)  # only a fallback: ignored while others name one
    assert Tokenizer.from_dir(d).eos_ids == set(ids.values())


def test_eos_falls_back_to_config_json(tiny_dir, tmp_path):
    d = _copy_tokenizer(tiny_dir, tmp_path / "eos_cfg")
    (d / "generation_config.json").unlink()
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    del cfg["eos_token"]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    _edit_json(d / "config.json", text_config={"eos_token_id": 5, "bos_token_id": 4})
    tok = Tokenizer.from_dir(d)
    assert tok.eos_ids == {5} and tok.bos_id == 4


def test_special_tokens_map_is_read(tiny_dir, tmp_path):
    d = _copy_tokenizer(tiny_dir, tmp_path / "stm")
    (d / "generation_config.json").unlink()
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    del cfg["eos_token"]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    _edit_json(d / "special_tokens_map.json", eos_token={"content": "<|endoftext|>", "lstrip": False})
    tok = Tokenizer.from_dir(d)
    assert tok.eos_ids == {tok.token_to_id("<|endoftext|>")}


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(CheckpointError, match=r"tokenizer\.json.*needs a tokenizer\.json"):
        Tokenizer.from_dir(tmp_path)


def test_corrupt_json_names_the_file(tiny_dir, tmp_path):
    d = _copy_tokenizer(tiny_dir, tmp_path / "corrupt")
    (d / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="tokenizer_config.json"):
        Tokenizer.from_dir(d)
    (d / "tokenizer_config.json").write_text("{}")
    (d / "tokenizer.json").write_text("{broken")
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        Tokenizer.from_dir(d)


# --- chat templates ------------------------------------------------------------------------------------

TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city, e.g. «Zürich»",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}]

CHATS = {
    "multi_turn": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hi! 👋 What's 2+2?"},
        {"role": "assistant", "content": "It is 4."},
        {"role": "user", "content": "And 3+3? Answer in 日本語."},
    ],
    "reasoning_and_tools": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "Call the tool.", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        ]},
        {"role": "tool", "content": '{"temp": 21, "sky": "clear"}'},
        {"role": "assistant", "content": "It is 21°C and clear.", "tool_calls": None},
        {"role": "user", "content": "Thanks"},
    ],
}


def _template_dir(tiny_dir: Path, dst: Path, template: str, in_config: bool, **config) -> Path:
    d = _copy_tokenizer(tiny_dir, dst)
    if in_config:
        _edit_json(d / "tokenizer_config.json", chat_template=template, **config)
    else:
        _edit_json(d / "tokenizer_config.json", **config)
        (d / "chat_template.jinja").write_text(template, encoding="utf-8")
    return d


@pytest.fixture(scope="session")
def qwen_template_dir(tiny_dir, tmp_path_factory):
    template = real_template("qwen3_5.jinja")
    return _template_dir(tiny_dir, tmp_path_factory.mktemp("qwen_tpl"), template, in_config=True)


@pytest.fixture(scope="session")
def gemma_template_dir(tiny_dir, tmp_path_factory):
    template = real_template("gemma4.jinja")
    # "<bos>" is not in the tiny vocab: both loaders must add it as a special token.
    return _template_dir(tiny_dir, tmp_path_factory.mktemp("gemma_tpl"), template, in_config=False,
                         bos_token="<bos>")


CHAT_CASES = [
    ("multi_turn", None, {}),
    ("multi_turn", TOOLS, {}),
    ("multi_turn", None, {"enable_thinking": False}),
    ("multi_turn", TOOLS, {"enable_thinking": True}),
    ("reasoning_and_tools", TOOLS, {}),
    ("reasoning_and_tools", TOOLS, {"enable_thinking": False}),
]


@pytest.mark.parametrize("template_dir", ["qwen_template_dir", "gemma_template_dir"])
@pytest.mark.parametrize(("chat", "tools", "kwargs"), CHAT_CASES)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(request, template_dir, chat, tools, kwargs,
                                            add_generation_prompt):
    d = request.getfixturevalue(template_dir)
    gen = add_generation_prompt
    tok = Tokenizer.from_dir(d)
    ours = tok.apply_chat_template(CHATS[chat], add_generation_prompt=gen, tools=tools, **kwargs)
    hf = transformers.AutoTokenizer.from_pretrained(d).apply_chat_template(
        CHATS[chat], tokenize=False, add_generation_prompt=gen, tools=tools, **kwargs,
    )
    assert ours == hf


def test_gemma_bos_token_is_added_and_rendered(gemma_template_dir):
    tok = Tokenizer.from_dir(gemma_template_dir)
    hf = transformers.AutoTokenizer.from_pretrained(gemma_template_dir)
    assert tok.bos_id == hf.bos_token_id is not None
    assert tok.apply_chat_template(CHATS["multi_turn"]).startswith("<bos>")
    assert tok.encode("<bos>hi") == hf("<bos>hi")["input_ids"]


def test_chat_template_file_wins_over_config(tiny_dir, tmp_path):
    d = _template_dir(tiny_dir, tmp_path / "both", "FILE {{ messages[0].content }}", in_config=False,
                      chat_template="CONFIG")
    assert Tokenizer.from_dir(d).apply_chat_template([{"role": "user", "content": "x"}]) == "FILE x"


def test_chat_template_helpers(tiny_dir, tmp_path):
    template = (
        "{{ messages | tojson }}|{{ tools | tojson(indent=2) }}|{{ strftime_now('%Y') | length }}"
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{% set ns.n = ns.n + 1 %}{% endfor %}|{{ ns.n }}|{{ eos_token }}|{{ flag }}"
        "{% if messages[0].role != 'user' %}{{ raise_exception('user first') }}{% endif %}"
    )
    d = _template_dir(tiny_dir, tmp_path / "helpers", template, in_config=True)
    tok, hf = Tokenizer.from_dir(d), transformers.AutoTokenizer.from_pretrained(d)
    msgs = [{"role": "user", "content": "héllo <b>"}, {"role": "assistant", "content": "z", "b": 1}]
    tools = [{"name": "f", "z": 1, "a": 2}]
    ours = tok.apply_chat_template(msgs, tools=tools, flag="on")
    hf_text = hf.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True, flag="on")
    assert ours == hf_text
    assert '"héllo <b>"' in ours and '"z": 1,\n    "a": 2' in ours
    with pytest.raises(InputError, match="user first"):
        tok.apply_chat_template([{"role": "system", "content": "s"}])


def test_missing_chat_template_raises(tiny_dir, tmp_path):
    d = _copy_tokenizer(tiny_dir, tmp_path / "no_tpl")
    with pytest.raises(InputError, match="no chat template"):
        Tokenizer.from_dir(d).apply_chat_template([{"role": "user", "content": "hi"}])


# --- streaming detokenizer -----------------------------------------------------------------------------

STREAM_TEXTS = [
    "Plain English text, nothing special.",
    "Emoji split over byte tokens: 🦀🫠👩‍💻 and 🇯🇵🇫🇷!",
    "CJK: 한국어 텍스트와 日本語の文章、中文。",
    "Combining: e\u0301 o\u0308 Z\u0336\u0321a\u0337l\u0335g\u0334o",
    "Mixed 🙂 café 東京 \U0001d518\U0001d52b  spaces   and\nnewlines\n",
]


def _stream(tok, ids, skip=True) -> list[str]:
    dec = StreamDecoder(tok, skip_special_tokens=skip)
    return [dec.push(i) for i in ids] + [dec.flush()]


@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_stream_decoder_matches_full_decode_byte_level(tok, text):
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode([i]) for i in ids) or text.isascii()  # the case worth testing
    chunks = _stream(tok, ids)
    # The Qwen-style normalizer is NFC, so combining marks come back composed.
    assert "".join(chunks) == tok.decode(ids, skip_special_tokens=True) == unicodedata.normalize("NFC", text)
    assert not any("\ufffd" in c for c in chunks)


def test_stream_decoder_skips_special_tokens(tok):
    ids = tok.encode("<|im_start|>assistant\n🦀 hi<|im_end|>")
    assert "".join(_stream(tok, ids)) == tok.decode(ids, skip_special_tokens=True) == "assistant\n🦀 hi"
    assert "".join(_stream(tok, ids, skip=False)) == tok.decode(ids)


def test_stream_decoder_flush_keeps_an_incomplete_character(tok):
    ids = tok.encode("x🦀", add_special_tokens=False)[:-1]  # cut inside the emoji's bytes
    chunks = _stream(tok, ids)
    assert chunks[-1].endswith("\ufffd") and "".join(chunks) == tok.decode(ids, skip_special_tokens=True)


@pytest.fixture(scope="session")
def sentencepiece_like(tmp_path_factory) -> Tokenizer:
    """A Llama/Gemma-style BPE: ▁ for spaces, <0xNN> byte fallback, a decoder that strips one space."""
    raw = RawTokenizer(models.BPE())
    raw.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer = trainers.BpeTrainer(vocab_size=400, limit_alphabet=40, show_progress=False)
    raw.train_from_iterator([t.replace(" ", "▁") for t in TEXTS + STREAM_TEXTS] * 3, trainer=trainer)
    learned = json.loads(raw.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, **{f"<0x{b:02X}>": 2 + b for b in range(256)}}
    for token in learned["vocab"]:
        vocab.setdefault(token, len(vocab))
    raw.model = models.BPE(vocab=vocab, merges=[tuple(m) if isinstance(m, list) else tuple(m.split(" "))
                                                 for m in learned["merges"]],
                           unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    raw.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0),
    ])
    raw.add_special_tokens(["<s>"])
    raw.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    d = tmp_path_factory.mktemp("spm_like")
    raw.save(str(d / "tokenizer.json"))
    _edit_json(d / "tokenizer_config.json", bos_token="<s>", eos_token="<s>")
    return Tokenizer.from_dir(d)


@pytest.mark.parametrize("text", STREAM_TEXTS + [" leading space", "a  b   c"])
def test_stream_decoder_matches_full_decode_sentencepiece_like(sentencepiece_like, text):
    tok = sentencepiece_like
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id and tok.add_bos
    chunks = _stream(tok, ids)
    assert "".join(chunks) == tok.decode(ids, skip_special_tokens=True)
    assert not any("\ufffd" in c for c in chunks)


# --- stop strings --------------------------------------------------------------------------------------


def _run_stops(stops, pieces):
    matcher, out = StopMatcher(stops), []
    for piece in pieces:
        emit, stopped = matcher.push(piece)
        out.append(emit)
        if stopped:
            return out, True
    out.append(matcher.flush())
    return out, False


def test_stop_split_across_pushes_is_never_partly_emitted():
    out, stopped = _run_stops(["<|im_end|>"], ["Hello <|", "im_", "end", "|> tail"])
    assert stopped and "".join(out) == "Hello "
    assert out[0] == "Hello " and out[1:] == ["", "", ""]


def test_false_start_is_released():
    out, stopped = _run_stops(["STOP"], ["ab ST", "OX", " S", "T"])
    assert not stopped and "".join(out) == "ab STOX ST"
    assert out[:3] == ["ab ", "STOX", " "]


def test_earliest_of_several_stops_wins():
    out, stopped = _run_stops(["world", "lo w"], ["hel", "lo wor", "ld"])
    assert stopped and "".join(out) == "hel"


def test_stop_inside_one_push_and_after_stop():
    matcher = StopMatcher(["\n\n"])
    assert matcher.push("line one\n\nline two") == ("line one", True)
    assert matcher.push("more") == ("", True) and matcher.flush() == ""


def test_no_stops_passes_everything_through():
    matcher = StopMatcher(["", *[]])
    assert matcher.push("abc") == ("abc", False) and matcher.flush() == ""
