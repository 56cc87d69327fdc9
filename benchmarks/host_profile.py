"""Where a decode's host time goes (Python's cProfile): for placements that cannot use the CUDA graph (experts on the
CPU) the host runs every op, so its profile is the decode's. Loads a checkpoint with a placement, generates once to
warm up (compiles, caches), then profiles the greedy decode of --tokens tokens and prints the functions with the
most own time and the most cumulative time.

    python benchmarks/host_profile.py CKPT [--compute cuda:0] [--experts cpu|ram|vram] [--tokens 32]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint")
    p.add_argument("--compute", default="cuda:0")
    p.add_argument("--experts", default="cpu", choices=["cpu", "ram", "vram"],
                   help="cpu: routed experts computed on the CPU; ram: streamed from host RAM; vram: with the rest")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens (random ids)")
    p.add_argument("--tokens", type=int, default=32, help="decode tokens profiled")
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()

    import lumen_core as lumen
    from lumen_core.sampling import SamplingParams

    hidden = {"kv-cache": {"context-size": args.prompt + 2 * args.tokens + 8, "type-k": "bf16", "type-v": "bf16"}}
    if args.experts == "cpu":
        hidden["experts"] = {"compute": "cpu", "store": "ram"}
    elif args.experts == "ram":
        hidden["experts"] = {"compute": args.compute, "store": "ram"}
    store = "ram" if args.compute == "cpu" else "vram"
    engine = lumen.load({"model": {"path": args.checkpoint, "compute": args.compute, "store": store,
                                   "hidden-layers": hidden}}, progress=False)
    ids = np.random.RandomState(0).randint(0, engine.model.vocab_size, args.prompt).tolist()
    greedy = SamplingParams(temperature=0.0)
    list(engine.generate_tokens(ids, 4, greedy))
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    list(engine.generate_tokens(ids, args.tokens + 1, greedy))
    prof.disable()
    wall = time.perf_counter() - t
    print(f"decode {(engine.stats.generated_tokens - 1) / engine.stats.decode_seconds:.1f} tok/s "
          f"(profiled: {wall:.2f} s for prefill + {args.tokens + 1} tokens; graph: {bool(engine.decode_runner())})")
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(args.top)
    stats.sort_stats("cumulative").print_stats(args.top)


if __name__ == "__main__":
    main()
