"""Serving benchmark on the GPU: continuous batching and the prefix cache, Qwen 3.5 shapes, random weights.

    python benchmarks/serving.py [--models 9b-fp8,35b-a3b-fp8 --layers 32 --moe-layers 8 --streams 1,4,16,64
                                  --prompt 128 --decode 64 --history 16384 --workdir /tmp/lumen-bench --json out.json]

Per model (checkpoints built as ``benchmarks/cuda_models.py`` builds them, fp8 by ``lumen quantize``), in one
process, everything on cuda:0:

- **baseline, batch 1 x N**: one generation at a time (``kv-cache.sequences`` 1: the captured decode graph and the
  on-device sampler): its decode tok/s is what N users get served one after another;
- **batched, N streams** (``sequences`` = the largest N): N generations started together, each from its own random
  prompt of ``--prompt`` tokens, ``--decode`` greedy tokens each: aggregate decode tok/s (all streams' tokens after
  their first / the time from the last first token to the end), its ratio to the baseline, and p50/p99 time to
  first token (every stream's prefill waits for the ones admitted before it: one prompt chunk per step);
- **prefix cache**: turn 10 of a 10-turn chat whose history holds ``--history`` tokens: time to first token with
  the prefix cache (turn 9 left a snapshot) and without (the whole history prefilled).

Also the fraction of the bandwidth bound of the batch-1 decode (bytes a decode step reads / the read bandwidth
measured in the same run). Dev tool: cupy, torch, transformers.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import cuda_models as cm  # noqa: E402 - the shapes and builders of the end-to-end benchmark


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="9b-fp8,35b-a3b-fp8")
    p.add_argument("--layers", type=int, default=32, help="layers of the 9B shape")
    p.add_argument("--moe-layers", type=int, default=8, help="layers of the 35B-A3B shape")
    p.add_argument("--streams", default="1,4,16,64")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens per stream")
    p.add_argument("--decode", type=int, default=64, help="greedy tokens per stream")
    p.add_argument("--history", type=int, default=16384, help="chat history tokens at turn 10 (0: skip)")
    p.add_argument("--workdir", default="/tmp/lumen-bench")
    p.add_argument("--json", default=None)
    p.add_argument("--config", default=None, help="benchmark this Lumen config instead of --models (e.g. the CPU "
                   "default model: examples/gemma3-270m-cpu.json); its placement is kept, its kv-cache keys set here")
    return p.parse_args(argv)


def load(path, sequences: int, context: int, prefix_mb: float = 0):
    """An engine of ``path``: a checkpoint (everything on cuda:0, bf16 KV cache) or a dict (a Lumen config, whose
    kv-cache keys are set here)."""
    import copy

    import lumen_core as lumen

    if isinstance(path, dict):
        cfg = copy.deepcopy(path)
        kv = cfg["model"].setdefault("hidden-layers", {}).setdefault("kv-cache", {})
        kv.update({"context-size": context, "sequences": sequences})
    else:
        kv = {"context-size": context, "sequences": sequences, "type-k": "bf16", "type-v": "bf16"}
        cfg = {"model": {"path": str(path), "compute": "cuda:0", "store": "vram", "hidden-layers": {"kv-cache": kv}}}
    if prefix_mb:
        kv["prefix-cache-mb"] = prefix_mb
    return lumen.load(cfg, progress=False)


def prompts(n: int, length: int, vocab: int):
    import numpy as np

    return [np.random.RandomState(1000 + i).randint(0, vocab, length).tolist() for i in range(n)]


def baseline(path, args) -> dict:
    engine = load(path, 1, args.prompt + args.decode + 8)
    ids = prompts(1, args.prompt, engine.model.vocab_size)[0]
    for _ in range(2):  # capture and compile, then time
        list(engine.generate_tokens(ids, args.decode + 1))
    tps = (engine.stats.generated_tokens - 1) / engine.stats.decode_seconds
    ttft = engine.stats.prefill_seconds
    engine.close()
    del engine
    gc.collect()
    return {"decode_tps": tps, "ttft_s": ttft}


def batched(path, args, streams: list[int]) -> dict:
    engine = load(path, max(streams), args.prompt + args.decode + 8)
    engine.start_batching()
    out = {}
    vocab = engine.model.vocab_size
    list(engine.generate_tokens(prompts(1, args.prompt, vocab)[0], 4))  # warm-up
    for n in streams:
        ps = prompts(n, args.prompt, vocab)
        firsts, ends, ttfts, counts = [0.0] * n, [0.0] * n, [0.0] * n, [0] * n
        start = threading.Barrier(n + 1)

        def run(i, ps=ps, firsts=firsts, ends=ends, ttfts=ttfts, counts=counts, start=start, engine=engine):
            start.wait()
            t0 = time.perf_counter()
            k = 0
            for _ in engine.generate_tokens(ps[i], args.decode):
                k += 1
                if k == 1:
                    firsts[i] = time.perf_counter()
            ends[i] = time.perf_counter()
            ttfts[i], counts[i] = firsts[i] - t0, k

        threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        start.wait()
        for t in threads:
            t.join()
        span = max(ends) - max(firsts)  # every stream decoding (after the last one's first token) to the end
        decoded = sum(c - 1 for c in counts)
        wall = max(ends) - min(firsts)
        ttfts.sort()
        out[n] = {"aggregate_tps": decoded / wall if wall > 0 else 0.0,
                  "all_running_s": span, "ttft_p50_s": statistics.median(ttfts),
                  "ttft_p99_s": ttfts[min(n - 1, int(round(0.99 * (n - 1))))],
                  "mean_batch": engine.batcher.batch_sizes / max(1, engine.batcher.steps)}
    engine.close()
    del engine
    gc.collect()
    return out


def prefix(path, args) -> dict:
    """TTFT of turn 10 (history of ``--history`` tokens) with and without the prefix cache."""
    turns, per_turn, reply = 10, args.history // 10, 16
    vocab_ids = None
    out = {}
    for mb in (0, 8192):
        engine = load(path, 1, args.history + turns * reply + 64, prefix_mb=mb)
        if vocab_ids is None:
            import numpy as np

            vocab_ids = np.random.RandomState(7).randint(0, engine.model.vocab_size, args.history + 64).tolist()
        history: list[int] = []
        for t in range(turns):
            history = history + vocab_ids[t * per_turn:(t + 1) * per_turn]
            gen = list(engine.generate_tokens(history, reply))
            ttft = engine.stats.prefill_seconds
            history = history + gen  # the next turn starts with this turn's prompt and reply
        out["with_cache" if mb else "without_cache"] = {"ttft_s": ttft, "cached_tokens": engine.stats.cached_tokens,
                                                         "prompt_tokens": engine.stats.prompt_tokens}
        engine.close()
        del engine
        gc.collect()
    return out


def main(argv=None):
    args = parse_args(argv)
    streams = [int(s) for s in args.streams.split(",")]
    results = {}
    if args.config:
        cfg = json.loads(Path(args.config).read_text())
        base = baseline(cfg, args)
        row = {"baseline": base, "batched": batched(cfg, args, streams)}
        if args.history:
            row["prefix"] = prefix(cfg, args)
        results[args.config] = row
        report(args.config, row, args)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1, default=str))
        return
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    bw = cm.read_bandwidth()
    for name in args.models.split(","):
        shape, fmt = name.rsplit("-", 1)
        layers = args.moe_layers if shape in cm.MOE_SHAPES else args.layers
        path = cm.build(shape, layers, 248320, workdir)
        if fmt != "bf16":
            path = cm.quantized(path, fmt)
        step_bytes = cm.bytes_per_token(path)[0]
        base = baseline(path, args)
        row = {"baseline": base, "bound_fraction": base["decode_tps"] * step_bytes / bw,
               "batched": batched(path, args, streams)}
        if args.history:
            row["prefix"] = prefix(path, args)
        results[name] = row
        print(f"\n{name} ({layers} layers), read bandwidth {bw / 1e12:.2f} TB/s")
        report(name, row, args)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))


def report(name, row, args) -> None:
    base = row["baseline"]
    bound = f" ({100 * row['bound_fraction']:.1f}% of the bandwidth bound)" if "bound_fraction" in row else ""
    print(f"{name}\n  baseline batch 1: {base['decode_tps']:.1f} tok/s decode{bound}, TTFT "
          f"{base['ttft_s'] * 1e3:.1f} ms")
    print("  streams | aggregate tok/s | x batch-1 | TTFT p50 ms | TTFT p99 ms | mean batch")
    for n, r in row["batched"].items():
        print(f"  {n:7d} | {r['aggregate_tps']:15.1f} | {r['aggregate_tps'] / base['decode_tps']:9.2f} | "
              f"{r['ttft_p50_s'] * 1e3:11.1f} | {r['ttft_p99_s'] * 1e3:11.1f} | {r['mean_batch']:.1f}")
    if args.history:
        p = row["prefix"]
        w, wo = p["with_cache"], p["without_cache"]
        print(f"  turn 10 of a {args.history}-token chat: TTFT {wo['ttft_s'] * 1e3:.1f} ms without the prefix "
              f"cache, {w['ttft_s'] * 1e3:.1f} ms with it ({w['cached_tokens']} of {w['prompt_tokens']} prompt "
              f"tokens cached): {wo['ttft_s'] / w['ttft_s']:.1f}x")


if __name__ == "__main__":
    main()
