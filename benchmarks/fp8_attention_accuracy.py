"""What FP8 attention would cost in accuracy (issue 21): perplexity of Gemma 3 270M Q4_K_M on a real text, on the
CPU, with attention computed as the planned FP8-MMA kernel would compute it (``lumen_cuda.fp8_attention_model``:
Q per row and P with a fixed scale in e4m3, over an fp8 KV cache), beside the named baselines of the same run:
an f32 KV cache with f32 attention (Lumen's default) and an fp8 KV cache read into f32 attention (what the cpu backend
does). Two FP8 rows: the arithmetic with one softmax max per row (``attend``), and in the cuda kernel's own order
(``attend_tiled``: tiles of 64 keys, P rounded against the running max), which is what ``flash_fp8_*`` computes.

    python benchmarks/fp8_attention_accuracy.py [--text-file docs/design.md --tokens 2048 --threads 2]

Scored by ``Engine.perplexity`` (prefill in chunks of 512 tokens through the KV cache: each chunk's queries attend
over every earlier position, so long-context attention is exercised). The FP8 row swaps the CPU backend's
attention body (``lumen_cpu.attention._attend``) for the model's, which runs in numpy: slow, a measurement of
accuracy only. Gemma 3 270M's layers are 5 sliding-window (512) : 1 global. Default text: docs/design.md.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

from _gemma_text import first_tokens, gemma3_270m
from _timing import machine

ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--text-file", type=Path, default=ROOT / "docs" / "design.md", help="UTF-8 text to score")
    p.add_argument("--tokens", type=int, default=2048, help="score the text's first N tokens")
    p.add_argument("--threads", type=int, default=2)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    path = gemma3_270m(args.threads)
    from lumen_cpu import attention
    from lumen_cuda import fp8_attention_model

    import lumen_core as lumen

    rows, ids = [], None
    plain = attention._attend
    def tiled(q, keys, vals, start, lo, scale, window=None, softcap=None, blocks=None):
        if blocks:
            sys.exit("attend_tiled has no bidirectional blocks (a text-only model never asks for them)")
        return fp8_attention_model.attend_tiled(q, keys, vals, start, lo, scale, window, softcap)

    variants = (("f32 KV cache, f32 attention (default)", "f32", None),
                ("fp8 KV cache, f32 attention", "fp8", None),
                ("fp8 KV cache, FP8 attention (model, row max)", "fp8", fp8_attention_model.attend),
                ("fp8 KV cache, FP8 attention (the kernel's tiled order)", "fp8", tiled))
    for name, kv, fp8_attention in variants:
        engine = lumen.load({"model": {"path": str(path), "hidden-layers": {"kv-cache": {
            "context-size": args.tokens + 8, "type-k": kv, "type-v": kv}}}}, progress=False)
        if ids is None:
            ids = first_tokens(engine, args.text_file, args.tokens)
        calls = []

        def counted(*a, calls=calls, fn=fp8_attention, **k):
            calls.append(1)
            return fn(*a, **k)

        attention._attend = counted if fp8_attention else plain
        try:
            t0 = time.perf_counter()
            nll = engine.perplexity(ids)["nll"]
            seconds = time.perf_counter() - t0
        finally:
            attention._attend = plain
        if fp8_attention and not calls:
            sys.exit("the FP8 attention model was never called: the CPU backend no longer attends through "
                     "lumen_cpu.attention._attend for an fp8 cache (this benchmark needs updating)")
        rows.append((name, nll, seconds, len(calls)))
    mach = machine()
    print(f"\nGemma 3 270M Q4_K_M ({path.name}), {len(ids) - 1} predicted tokens of {args.text_file.name}; "
          f"{mach['cpu']}, {args.threads} threads\n")
    print("| KV cache, attention | NLL (nats/token) | perplexity | change vs the default | s | model calls |")
    print("|---|---:|---:|---:|---:|---:|")
    base = rows[0][1]
    for i, (name, nll, seconds, n) in enumerate(rows):
        change = f"{math.exp(nll) / math.exp(base) - 1:+.3%}" if i else ""
        print(f"| {name} | {nll:.5f} | {math.exp(nll):.4f} | {change} | {seconds:.1f} | {n or ''} |")
    fp8_kv = rows[1][1]
    for name, nll, _, _ in rows[2:]:
        print(f"\n{name} against the fp8 KV cache's f32 attention: {math.exp(nll) / math.exp(fp8_kv) - 1:+.3%} "
              "perplexity")


if __name__ == "__main__":
    main()
