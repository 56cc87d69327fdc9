"""What 8-bit activations cost in accuracy: perplexity of Gemma 3 270M Q4_K_M on a real text, on the CPU, with
``cpu.compute-quantization`` none (the default: f32 activations) and int8 (opt-in).

    python benchmarks/cpu_int8_perplexity.py [--text-file docs/design.md --tokens 1024 --threads 2]

int8 changes only the GEMVs of one to three tokens (decode); a prompt's prefill is f32 either way. So the text is
scored as decode scores it: one token a step through the KV cache, each next token's negative log-likelihood from
that step's logits. The default mode is also scored by ``Engine.perplexity`` (chunked prefill), as a check that
the step-by-step scoring is the same measurement. Default text: this repository's docs/design.md (English prose).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

from _gemma_text import first_tokens, gemma3_270m
from _timing import machine

ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--text-file", type=Path, default=ROOT / "docs" / "design.md", help="UTF-8 text to score")
    p.add_argument("--tokens", type=int, default=1024, help="score the text's first N tokens")
    p.add_argument("--threads", type=int, default=2)
    return p.parse_args(argv)


def stepwise_nll(engine, ids: list[int]) -> tuple[float, float]:
    """Mean NLL (nats) of ids[1:] with one token a step, and the steps' tokens per second."""
    import numpy as np

    model = engine.model
    cache = model.new_cache(len(ids) + 1)
    total, t0 = 0.0, time.perf_counter()
    for i in range(len(ids) - 1):
        logits = np.asarray(model.forward([ids[i]], cache)[-1], np.float64)
        top = logits.max()
        total += top + math.log(np.exp(logits - top).sum()) - logits[ids[i + 1]]
    return total / (len(ids) - 1), (len(ids) - 1) / (time.perf_counter() - t0)


def main(argv=None) -> None:
    args = parse_args(argv)
    path = gemma3_270m(args.threads)
    import lumen_core as lumen

    rows, ids = [], None
    for mode in ("none", "int8"):
        engine = lumen.load({"model": {"path": str(path), "hidden-layers": {"kv-cache": {
            "context-size": args.tokens + 8}}}, "cpu": {"compute-quantization": mode}}, progress=False)
        if ids is None:
            ids = first_tokens(engine, args.text_file, args.tokens)
            chunked = engine.perplexity(ids)["nll"]
        nll, speed = stepwise_nll(engine, ids)
        rows.append((mode, nll, speed))
    mach = machine()
    print(f"\nGemma 3 270M Q4_K_M ({path.name}), {len(ids) - 1} predicted tokens of {args.text_file.name}; "
          f"{mach['cpu']}, {args.threads} threads\n")
    print("| cpu.compute-quantization | NLL (nats/token) | perplexity | change vs none | steps/s |")
    print("|---|---:|---:|---:|---:|")
    base = rows[0][1]
    for mode, nll, speed in rows:
        change = f"{math.exp(nll) / math.exp(base) - 1:+.3%}" if mode != "none" else ""
        print(f"| {mode} | {nll:.5f} | {math.exp(nll):.4f} | {change} | {speed:.1f} |")
    print(f"\ncheck: the default's chunked-prefill NLL (Engine.perplexity) {chunked:.5f}, step by step {base:.5f} "
          f"(difference {chunked - base:+.2e})")


if __name__ == "__main__":
    main()
